//! One operator with many tasks (issue 12 item 2): idle tasks (a queue no
//! worker serves) are added level by level; at each level the time to
//! issue them all (counted as leases seen Offered, not task phases), the
//! operator's RSS, and ≥ 100 probes — a new task's latency from its
//! creation to its lease Offered, both taken from watch events — so the
//! latency at 0 tasks is the baseline of the same run.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use batchlease_api::{BatchTask, LeasePhase, TaskLease};
use batchlease_e2e::operator::Operator;
use batchlease_e2e::{Cluster, wait_for};
use futures::StreamExt;
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};
use tokio::time::Instant;

use crate::common::{emit, rss_mib};
use crate::stats;

/// What the watches saw: when each task was first seen, and when its
/// first lease was first seen Offered.
#[derive(Default)]
struct Seen {
    created: HashMap<String, Instant>,
    offered: HashMap<String, Instant>,
}

/// One level's measurements.
pub struct Level {
    pub tasks: usize,
    pub rss_mib: Option<f64>,
    pub probes: Vec<Duration>,
}

/// The levels between 0 and `max`: 0, a tenth, a quarter, a half, all.
pub fn levels(max: usize) -> Vec<usize> {
    let mut v = vec![0, max / 10, max / 4, max / 2, max];
    v.dedup();
    v
}

/// Runs the levels of [`levels`]`(max)` with `probes` probes each.
pub async fn run(
    cluster: &Cluster,
    max: usize,
    probes: usize,
    conc: usize,
    report: &mut String,
) -> anyhow::Result<Vec<Level>> {
    let ns = cluster.namespace("bench-scale").await?;
    let op = Operator::start_with(&ns.name, "op", vec!["--events=important".into()])?;
    op.wait_leading(Duration::from_secs(60)).await?;
    let seen = Arc::new(Mutex::new(Seen::default()));
    let watches = {
        let tasks: Api<BatchTask> = ns.api();
        let leases: Api<TaskLease> = ns.api();
        let (s1, s2) = (seen.clone(), seen.clone());
        let cfg = watcher::Config::default();
        let t = tokio::spawn(async move {
            let mut ev = Box::pin(watcher(tasks, cfg.clone()).touched_objects());
            while let Some(Ok(t)) = ev.next().await {
                s1.lock()
                    .unwrap()
                    .created
                    .entry(t.name_any())
                    .or_insert_with(Instant::now);
            }
        });
        let l = tokio::spawn(async move {
            let mut ev = Box::pin(watcher(leases, watcher::Config::default()).touched_objects());
            while let Some(Ok(l)) = ev.next().await {
                if l.status.as_ref().and_then(|s| s.phase) == Some(LeasePhase::Offered) {
                    s2.lock()
                        .unwrap()
                        .offered
                        .entry(l.spec.task_name.clone())
                        .or_insert_with(Instant::now);
                }
            }
        });
        [t, l]
    };
    let mut out = Vec::new();
    let mut idle = 0;
    for level in levels(max) {
        let start = Instant::now();
        if level > idle {
            // Names continue where the last level stopped.
            create_range(&ns, idle, level, conc).await?;
            let created = start.elapsed();
            let names: HashSet<String> = (idle..level).map(idle_name).collect();
            wait_for(
                "every idle task's lease Offered",
                Duration::from_secs(7200),
                || op.logs(),
                || {
                    let s = seen.lock().unwrap();
                    let done = names.iter().all(|n| s.offered.contains_key(n));
                    async move { Ok(done.then_some(())) }
                },
            )
            .await?;
            let issued = start.elapsed();
            eprintln!(
                "scale: {level} idle tasks ({} new created in {:.1}s, all Offered after {:.1}s)",
                level - idle,
                created.as_secs_f64(),
                issued.as_secs_f64()
            );
            emit(
                report,
                &format!(
                    "scale: tasks {idle}→{level}: created in {:.1}s, every lease seen Offered after {:.1}s ({:.0} tasks/s)\n",
                    created.as_secs_f64(),
                    issued.as_secs_f64(),
                    (level - idle) as f64 / issued.as_secs_f64()
                ),
            );
            idle = level;
        }
        let mut lat = Vec::with_capacity(probes);
        for j in 0..probes {
            let name = format!("probe-{level}-{j:03}");
            batchlease_e2e::tasks::create(&ns, &name, serde_json::json!({"queue": "probe"}))
                .await?;
            let d = wait_for(
                "a probe's lease Offered",
                Duration::from_secs(120),
                || op.logs(),
                || {
                    let s = seen.lock().unwrap();
                    let d = s
                        .created
                        .get(&name)
                        .zip(s.offered.get(&name))
                        .map(|(c, o)| o.saturating_duration_since(*c));
                    async move { Ok(d) }
                },
            )
            .await?;
            lat.push(d);
        }
        lat.sort();
        let rss = rss_mib(op.pid());
        emit(
            report,
            &format!(
                "scale: with {level} idle tasks: operator RSS {}; {probes} probes, creation → lease Offered (watch events): {}\n",
                rss.map_or_else(|| "n/a".into(), |m| format!("{m:.0} MiB")),
                stats::summary(&lat)
            ),
        );
        out.push(Level {
            tasks: level,
            rss_mib: rss,
            probes: lat,
        });
    }
    for w in watches {
        w.abort();
    }
    drop(op);
    ns.cleanup().await?;
    Ok(out)
}

fn idle_name(i: usize) -> String {
    format!("idle-{i:06}")
}

async fn create_range(
    ns: &batchlease_e2e::TestNamespace,
    from: usize,
    to: usize,
    conc: usize,
) -> anyhow::Result<()> {
    crate::common::create_all(&ns.api::<BatchTask>(), to - from, conc, |i| {
        serde_json::json!({
            "apiVersion": "batchlease.dev/v1alpha1", "kind": "BatchTask",
            "metadata": {"name": idle_name(from + i)},
            "spec": {"queue": "nobody", "payload": {"steps": 0, "stepMillis": 0}},
        })
    })
    .await
}

#[cfg(test)]
mod tests {
    #[test]
    fn levels_start_at_zero_and_end_at_max() {
        assert_eq!(super::levels(100_000), [0, 10_000, 25_000, 50_000, 100_000]);
        assert_eq!(super::levels(0), [0]);
    }
}
