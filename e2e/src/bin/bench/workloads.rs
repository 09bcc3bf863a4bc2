//! Task graphs and resource locks: throughput next to as many independent
//! tasks in the same run.

use batchlease_e2e::Cluster;
use serde_json::json;

use crate::common::{emit, run_tasks};

/// A layered DAG (layers of 50; each task depends on 2 of the layer before)
/// next to as many independent tasks.
pub async fn graphs(
    cluster: &Cluster,
    n: usize,
    conc: usize,
    report: &mut String,
) -> anyhow::Result<()> {
    let width = 50;
    let flat = run_tasks(
        cluster,
        "bench-flat",
        n,
        conc,
        |_| json!({"queue": "demo", "payload": {"steps": 0, "stepMillis": 0}}),
    )
    .await?;
    let dag = run_tasks(cluster, "bench-dag", n, conc, |i| {
        let deps: Vec<String> = if i < width {
            Vec::new()
        } else {
            let base = (i / width - 1) * width;
            vec![
                format!("t-{:05}", base + i % width),
                format!("t-{:05}", base + (i * 7 + 3) % width),
            ]
        };
        json!({"queue": "demo", "dependsOn": deps, "payload": {"steps": 0, "stepMillis": 0}})
    })
    .await?;
    emit(
        report,
        &format!(
            "graph: {n} tasks in {} layers of {width} (2 dependencies each): {dag:.1} tasks/s; {n} independent tasks, same run: {flat:.1} tasks/s (ratio {:.2})\n",
            n.div_ceil(width),
            dag / flat
        ),
    );
    Ok(())
}

/// Every task needs one of `k` shared resources (round robin), for k = 1, 3,
/// 6; 100 ms of work each, so contention, not the work, sets the pace.
pub async fn locks(
    cluster: &Cluster,
    n: usize,
    conc: usize,
    report: &mut String,
) -> anyhow::Result<()> {
    let payload = json!({"steps": 1, "stepMillis": 100});
    let free = run_tasks(
        cluster,
        "bench-nolock",
        n,
        conc,
        |_| json!({"queue": "demo", "payload": payload}),
    )
    .await?;
    let mut line = format!("locks: {n} tasks of 100 ms, no lock: {free:.1} tasks/s");
    for k in [1usize, 3, 6] {
        let rate = run_tasks(
            cluster,
            &format!("bench-lock{k}"),
            n,
            conc,
            |i| json!({"queue": "demo", "resources": [format!("r{}", i % k)], "payload": payload}),
        )
        .await?;
        line.push_str(&format!("; {k} shared: {rate:.1} tasks/s"));
    }
    line.push('\n');
    emit(report, &line);
    Ok(())
}
