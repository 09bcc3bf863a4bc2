//! Throughput and scale benchmark, run by `hack/bench.sh` against the local
//! control plane. Reports ratios measured side by side in one run:
//!
//! 1. raw API-server write throughput (ConfigMap creates, same concurrency);
//! 2. end-to-end task throughput (operator + demo workers + PostgreSQL);
//! 3. scale: N idle BatchTasks issued by one operator, and how quickly a
//!    new task gets its lease while they exist, plus the operator's memory;
//! 4. task graphs: a layered DAG of N tasks end to end, next to N
//!    independent tasks in the same run;
//! 5. resource locks under contention: tasks/s when every task needs one of
//!    1, 3 or 6 shared resources.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use anyhow::Context;
use batchlease_api::{BatchTask, TaskPhase};
use batchlease_e2e::operator::Operator;
use batchlease_e2e::tasks::{phase_of, wait_phase};
use batchlease_e2e::workers::{self, WorkerOpts};
use batchlease_e2e::{Cluster, TestNamespace, pg, wait_for};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, PostParams};
use serde_json::json;
use tokio::time::Instant;

fn arg(name: &str, default: usize) -> usize {
    let flag = format!("--{name}=");
    std::env::args()
        .find_map(|a| a.strip_prefix(&flag).and_then(|v| v.parse().ok()))
        .unwrap_or(default)
}

/// Creates `n` objects built by `object(i)` through `api`, `conc` at a time.
async fn create_all<K>(
    api: &Api<K>,
    n: usize,
    conc: usize,
    object: impl Fn(usize) -> serde_json::Value,
) -> anyhow::Result<()>
where
    K: kube::Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    futures::stream::iter(0..n)
        .map(|i| {
            let api = api.clone();
            let obj = serde_json::from_value::<K>(object(i));
            async move {
                api.create(&PostParams::default(), &obj?)
                    .await
                    .context("create")?;
                Ok::<_, anyhow::Error>(())
            }
        })
        .buffer_unordered(conc)
        .try_collect::<Vec<_>>()
        .await?;
    Ok(())
}

async fn create_tasks(
    ns: &TestNamespace,
    prefix: &str,
    n: usize,
    queue: &str,
    conc: usize,
) -> anyhow::Result<()> {
    create_all(&ns.api::<BatchTask>(), n, conc, |i| {
        json!({
            "apiVersion": "batchlease.dev/v1alpha1", "kind": "BatchTask",
            "metadata": {"name": format!("{prefix}-{i:05}")},
            "spec": {"queue": queue, "payload": {"steps": 0, "stepMillis": 0}},
        })
    })
    .await
}

async fn count_phase(ns: &TestNamespace, phase: TaskPhase) -> anyhow::Result<usize> {
    let list = ns.api::<BatchTask>().list(&Default::default()).await?;
    Ok(list
        .items
        .iter()
        .filter(|t| phase_of(t) == Some(phase))
        .count())
}

fn rss_mib(pid: Option<u32>) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{}/status", pid?)).ok()?;
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kib / 1024.0)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let raw_n = arg("raw", 2000);
    let tasks_n = arg("tasks", 500);
    let scale_n = arg("scale", 10_000);
    let conc = arg("concurrency", 16);
    let dag_n = arg("dag", 1000);
    let locked_n = arg("locked", 200);
    let cluster = Cluster::with_crds().await?;
    let mut report = String::new();

    // 1. Raw API-server writes.
    let ns = cluster.namespace("bench-raw").await?;
    let cms: Api<ConfigMap> = ns.api();
    let start = Instant::now();
    create_all(&cms, raw_n, conc, |i| {
        json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": format!("cm-{i:05}")}, "data": {"k": "v"}})
    })
    .await?;
    let raw_rate = raw_n as f64 / start.elapsed().as_secs_f64();
    emit(
        &mut report,
        &format!(
            "raw API writes: {raw_n} ConfigMap creates, concurrency {conc}: {raw_rate:.0} writes/s\n"
        ),
    );
    ns.cleanup().await?;

    // 1b. Raw BatchTask creates, no operator: the cost of the CRD itself
    // (schema validation, CEL) next to a ConfigMap.
    let ns = cluster.namespace("bench-crd").await?;
    let start = Instant::now();
    create_tasks(&ns, "raw", raw_n, "nobody", conc).await?;
    let crd_rate = raw_n as f64 / start.elapsed().as_secs_f64();
    emit(
        &mut report,
        &format!(
            "raw BatchTask creates (no operator): {raw_n}, concurrency {conc}: {crd_rate:.0} writes/s ({:.2}× ConfigMap)\n",
            crd_rate / raw_rate
        ),
    );
    ns.cleanup().await?;

    // 2. End-to-end task throughput.
    let task_rate = run_tasks(
        &cluster,
        "bench-e2e",
        tasks_n,
        conc,
        |_| json!({"queue": "demo", "payload": {"steps": 0, "stepMillis": 0}}),
    )
    .await?;
    emit(
        &mut report,
        &format!(
            "end-to-end: {tasks_n} tasks (operator + 2 demo workers × 8 slots + fenced PostgreSQL commit): {task_rate:.1} tasks/s\n\
         ratio tasks/s ÷ raw writes/s: {:.3} (each task costs ≥ 7 API writes: create, init, issue, lease, claim, running, complete, settle)\n",
            task_rate / raw_rate
        ),
    );

    // 3. Scale: many idle tasks, one operator.
    if scale_n > 0 {
        let ns = cluster.namespace("bench-scale").await?;
        let op = Operator::start(&ns.name, "op")?;
        op.wait_leading(Duration::from_secs(60)).await?;
        let start = Instant::now();
        create_tasks(&ns, "idle", scale_n, "nobody", conc).await?;
        let created = start.elapsed();
        wait_for(
            "all idle tasks issued",
            Duration::from_secs(3600),
            || op.logs(),
            || async { Ok((count_phase(&ns, TaskPhase::Ready).await? == scale_n).then_some(())) },
        )
        .await?;
        let issued = start.elapsed();
        // Responsiveness with N tasks cached: a new task's lease.
        let probe_start = Instant::now();
        create_tasks(&ns, "probe", 1, "probe", 1).await?;
        wait_phase(
            &ns,
            "probe-00000",
            TaskPhase::Ready,
            Duration::from_secs(120),
            || op.logs(),
        )
        .await?;
        let probe = probe_start.elapsed();
        let rss = rss_mib(op.pid())
            .map(|m| format!("{m:.0} MiB"))
            .unwrap_or_else(|| "n/a".into());
        emit(
            &mut report,
            &format!(
                "scale: {scale_n} BatchTasks created in {:.1}s; all issued (Ready, lease Offered) after {:.1}s ({:.0} tasks/s); \
             a new task got its lease {:.0} ms after creation with {scale_n} cached; operator RSS {rss}\n",
                created.as_secs_f64(),
                issued.as_secs_f64(),
                scale_n as f64 / issued.as_secs_f64(),
                probe.as_secs_f64() * 1000.0
            ),
        );
        drop(op);
        ns.cleanup().await?;
    }
    if dag_n > 0 {
        graphs(&cluster, dag_n, conc, &mut report).await?;
    }
    if locked_n > 0 {
        locks(&cluster, locked_n, conc, &mut report).await?;
    }
    println!("\n--- results ---\n{report}");
    Ok(())
}

/// Runs `n` tasks built by `spec(i)` to success with an operator and two
/// demo workers × 8 slots in a fresh namespace; tasks/s from the first
/// create to the last success.
async fn run_tasks(
    cluster: &Cluster,
    prefix: &str,
    n: usize,
    conc: usize,
    spec: impl Fn(usize) -> serde_json::Value,
) -> anyhow::Result<f64> {
    let ns = cluster.namespace(prefix).await?;
    let _db = pg::connect().await?;
    let op = Operator::start(&ns.name, "op")?;
    op.wait_leading(Duration::from_secs(60)).await?;
    let opts = WorkerOpts {
        slots: 8,
        ..Default::default()
    };
    let w1 = workers::start(&ns.name, "bench-w1", &opts)?;
    let w2 = workers::start(&ns.name, "bench-w2", &opts)?;
    let start = Instant::now();
    create_all(&ns.api::<BatchTask>(), n, conc, |i| {
        json!({
            "apiVersion": "batchlease.dev/v1alpha1", "kind": "BatchTask",
            "metadata": {"name": format!("t-{i:05}")},
            "spec": spec(i),
        })
    })
    .await?;
    wait_for(
        "all tasks succeeded",
        Duration::from_secs(3600),
        || format!("{}{}{}", op.logs(), w1.logs(), w2.logs()),
        || async { Ok((count_phase(&ns, TaskPhase::Succeeded).await? == n).then_some(())) },
    )
    .await?;
    let rate = n as f64 / start.elapsed().as_secs_f64();
    drop((w1, w2, op));
    ns.cleanup().await?;
    Ok(rate)
}

/// A layered DAG (layers of 50; each task depends on 2 of the layer before)
/// next to as many independent tasks.
async fn graphs(
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
async fn locks(
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

/// Prints a result line as soon as it is known, and keeps it for the summary.
fn emit(report: &mut String, line: &str) {
    print!("{line}");
    report.push_str(line);
}
