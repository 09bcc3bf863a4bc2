//! Heartbeat cost (issue 12 item 5): the API requests an idle operator
//! makes (the control plane alone, then with the operator, same window),
//! and with many leases held at once the renewal writes per lease per
//! second (the SDK renews every TTL/3: 3/TTL) and what they cost the API
//! server, etcd and the operator in CPU.
//!
//! The windows are measurements, not waits: a fixed length of time is the
//! thing measured over (for renewals, a whole number of renewal periods).

use std::time::Duration;

use batchlease_api::{LeasePhase, TaskLease, TaskPhase};
use batchlease_e2e::workers::{self, WorkerOpts};
use batchlease_e2e::{Cluster, api_requests, wait_for};
use kube::api::Api;
use serde_json::json;
use tokio::time::Instant;

use crate::common::{
    component_pid, count_phase, cpu_of, create_all, emit, operator_at_defaults, quiet_cluster,
};

/// The TTL of the held leases (the default of a BatchTask).
pub const TTL_SECONDS: f64 = 30.0;

/// Requests and CPU over one window.
struct Window {
    requests: api_requests::Counts,
    secs: f64,
    /// CPU cores used, per process asked for (None: not running).
    cores: Vec<Option<f64>>,
}

async fn window(len: Duration, pids: &[Option<u32>]) -> anyhow::Result<Window> {
    let before = api_requests::snapshot()?;
    let cpu0 = cpu_of(pids);
    let start = Instant::now();
    tokio::time::sleep(len).await;
    let secs = start.elapsed().as_secs_f64();
    let cpu1 = cpu_of(pids);
    let requests = api_requests::delta(&before, &api_requests::snapshot()?);
    let cores = cpu0
        .iter()
        .zip(&cpu1)
        .map(|(a, b)| Some((b.as_ref()? - a.as_ref()?) / secs))
        .collect();
    Ok(Window {
        requests,
        secs,
        cores,
    })
}

fn cores(c: Option<f64>) -> String {
    c.map_or_else(|| "n/a".into(), |c| format!("{c:.3} cores"))
}

/// The idle operator, then `held` leases held for a window of `len`.
pub async fn run(
    cluster: &Cluster,
    held: usize,
    len: Duration,
    report: &mut String,
) -> anyhow::Result<()> {
    let cp = [component_pid("kube-apiserver"), component_pid("etcd")];
    let ns = cluster.namespace("bench-heartbeat").await?;

    // Idle: the control plane alone, then with a leading operator that has
    // nothing to do.
    let note = quiet_cluster(cluster).await?;
    let alone = window(len, &cp).await?;
    // Its leader election's renewals are the idle operator's only writes.
    let op = operator_at_defaults(&ns.name).await?;
    let idle = window(len, &[cp[0], cp[1], op.pid()]).await?;
    let (alone_table, alone_rate) = api_requests::per_second(&alone.requests, alone.secs);
    let (idle_table, idle_rate) = api_requests::per_second(&idle.requests, idle.secs);
    let lease_puts =
        |w: &Window| api_requests::count(&w.requests, "leases", &["PUT"], "2") / w.secs;
    emit(
        report,
        &format!(
            "idle, {:.0} s windows: the control plane alone {alone_rate:.2} requests/s; with an idle leading operator \
             {idle_rate:.2} requests/s: the operator's {:.2}/s, of which Lease renewals {:.2}/s (its leader election: \
             a renewal every 10/3 s at the defaults is 0.30/s); operator CPU {}{note}\n\
             control plane alone:\n{alone_table}with the idle operator:\n{idle_table}",
            len.as_secs_f64(),
            idle_rate - alone_rate,
            lease_puts(&idle) - lease_puts(&alone),
            cores(idle.cores[2]),
        ),
    );

    if held > 0 {
        // `held` leases at once: two workers with half the slots each,
        // tasks that outlast the window.
        // The per-lease renewals' cost: that mode pinned by name
        // (the fleet section measures renewals per worker).
        let opts = WorkerOpts {
            slots: held.div_ceil(2),
            env: workers::per_lease_env(),
            ..Default::default()
        };
        let w1 = workers::start(&ns.name, "hb-w1", &opts)?;
        let w2 = workers::start(&ns.name, "hb-w2", &opts)?;
        create_all(&ns.api::<batchlease_api::BatchTask>(), held, 16, |i| {
            json!({
                "apiVersion": "batchlease.dev/v1alpha1", "kind": "BatchTask",
                "metadata": {"name": format!("hb-{i:05}")},
                "spec": {"queue": "demo", "leaseDurationSeconds": TTL_SECONDS as i64,
                         "payload": {"steps": 1, "stepMillis": 3_600_000}},
            })
        })
        .await?;
        let leases: Api<TaskLease> = ns.api();
        wait_for(
            "every lease Held",
            Duration::from_secs(600),
            || format!("{}{}{}", op.logs(), w1.logs(), w2.logs()),
            || async {
                let n = leases
                    .list(&Default::default())
                    .await?
                    .items
                    .iter()
                    .filter(|l| l.status.as_ref().and_then(|s| s.phase) == Some(LeasePhase::Held))
                    .count();
                Ok((n == held).then_some(()))
            },
        )
        .await?;
        // And the operator done with them (each task's Running written):
        // from here on only renewals are due.
        wait_for(
            "every task Running",
            Duration::from_secs(600),
            || op.logs(),
            || async { Ok((count_phase(&ns, TaskPhase::Running).await? == held).then_some(())) },
        )
        .await?;
        // Each lease renews once per period wherever the window starts,
        // if the window is a whole number of periods: claims come in a
        // burst, so their renewals do too, and a shorter window would
        // catch a burst or miss it.
        let period = TTL_SECONDS / 3.0;
        let periods = (len.as_secs_f64() / period).ceil().max(1.0);
        let len = Duration::from_secs_f64(periods * period);
        let w = window(len, &[cp[0], cp[1], op.pid(), w1.pid(), w2.pid()]).await?;
        let renewals = api_requests::count(&w.requests, "taskleases", &api_requests::WRITES, "2");
        let failed = api_requests::count(&w.requests, "taskleases", &api_requests::WRITES, "4")
            + api_requests::count(&w.requests, "taskleases", &api_requests::WRITES, "5");
        let task_writes = api_requests::count(&w.requests, "batchtasks", &api_requests::WRITES, "");
        let per_lease = renewals / w.secs / held as f64;
        let (table, rate) = api_requests::per_second(&w.requests, w.secs);
        emit(
            report,
            &format!(
                "heartbeat: {held} leases held (TTL {TTL_SECONDS:.0} s), {:.0} s window: {per_lease:.4} renewal writes/s per lease \
                 (3/TTL = {:.4}; ratio {:.2}); failed lease writes {failed:.0}; task writes {task_writes:.0}; all requests {rate:.1}/s\n\
                 CPU: kube-apiserver {} (idle {}), etcd {} (idle {}), operator {} (idle {}), workers {} + {}\n{table}",
                w.secs,
                3.0 / TTL_SECONDS,
                per_lease / (3.0 / TTL_SECONDS),
                cores(w.cores[0]),
                cores(idle.cores[0]),
                cores(w.cores[1]),
                cores(idle.cores[1]),
                cores(w.cores[2]),
                cores(idle.cores[2]),
                cores(w.cores[3]),
                cores(w.cores[4]),
            ),
        );
        drop((w1, w2));
    }
    drop(op);
    ns.cleanup().await?;
    Ok(())
}
