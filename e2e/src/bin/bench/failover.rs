//! Failover latency (issue 12 item 3): a worker holding a task is
//! SIGSTOPped; the time from the stop to the task held by the other
//! worker, timed from lease watch events (not polled), over many trials,
//! next to the lease TTL.

use std::time::Duration;

use anyhow::Context;
use batchlease_api::{LeasePhase, TaskLease};
use batchlease_e2e::operator::Operator;
use batchlease_e2e::tasks;
use batchlease_e2e::workers::{self, WorkerOpts};
use batchlease_e2e::{Cluster, TestNamespace};
use futures::StreamExt;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::json;
use tokio::time::Instant;

/// The lease TTL of the trials (the CRD's minimum).
pub const TTL_SECONDS: u64 = 5;

/// Waits, on `events`, for a lease of task `task` with a token of at least
/// `min_token` to be seen Held; returns its holder and token.
async fn held(
    events: &mut (impl futures::Stream<Item = Result<TaskLease, watcher::Error>> + Unpin),
    task: &str,
    min_token: i64,
    deadline: Duration,
) -> anyhow::Result<(String, i64)> {
    let found = tokio::time::timeout(deadline, async {
        while let Some(ev) = events.next().await {
            let l = ev?;
            let phase = l.status.as_ref().and_then(|s| s.phase);
            if l.spec.task_name == task
                && l.spec.fencing_token >= min_token
                && phase == Some(LeasePhase::Held)
                && let Some(h) = l.spec.holder_identity.clone()
            {
                return Ok((h, l.spec.fencing_token));
            }
        }
        anyhow::bail!("the lease watch ended")
    })
    .await;
    found.with_context(|| format!("{task}: no Held lease with token ≥ {min_token} in time"))?
}

/// `trials` failovers; the sorted latencies.
pub async fn run(cluster: &Cluster, trials: usize) -> anyhow::Result<Vec<Duration>> {
    let ns: TestNamespace = cluster.namespace("bench-failover").await?;
    let op = Operator::start_with(&ns.name, "op", vec!["--events=important".into()])?;
    op.wait_leading(Duration::from_secs(60)).await?;
    let opts = WorkerOpts {
        slots: 1,
        ..Default::default()
    };
    let workers = [
        workers::start(&ns.name, "fa", &opts)?,
        workers::start(&ns.name, "fb", &opts)?,
    ];
    let leases: Api<TaskLease> = ns.api();
    let mut events = Box::pin(watcher(leases, watcher::Config::default()).touched_objects());
    let mut out = Vec::with_capacity(trials);
    for i in 0..trials {
        let name = format!("f{i:03}");
        tasks::create(
            &ns,
            &name,
            json!({"queue": "demo", "leaseDurationSeconds": TTL_SECONDS, "maxRetries": 100,
                   "backoff": {"initialSeconds": 1, "maxSeconds": 1},
                   "payload": {"steps": 80, "stepMillis": 100}}),
        )
        .await?;
        let (holder, token) = held(&mut events, &name, 1, Duration::from_secs(60)).await?;
        let idx = usize::from(holder == "fb");
        let stopped = &workers[idx];
        stopped.signal("STOP")?;
        let t0 = Instant::now();
        let (next, _) = held(&mut events, &name, token + 1, Duration::from_secs(60)).await?;
        let took = t0.elapsed();
        stopped.signal("CONT")?;
        anyhow::ensure!(next != holder, "{name}: held again by the stopped {holder}");
        out.push(took);
        eprintln!("failover {i}: {holder} stopped, {next} holds it after {took:?}");
        // Both workers free for the next trial: the zombie's attempt ends
        // by its kill switch, the other's when the task (8 s of work,
        // resumed from its checkpoint) succeeds.
        tasks::wait_phase(
            &ns,
            &name,
            batchlease_api::TaskPhase::Succeeded,
            Duration::from_secs(120),
            || op.logs(),
        )
        .await?;
    }
    drop(workers);
    drop(op);
    ns.cleanup().await?;
    out.sort();
    Ok(out)
}
