//! Kill-switch latency (issue 12 item 4): a worker's connection to the API
//! server is cut silently (a proxy drops every byte) right after the worker
//! logged a renewal as acknowledged; the time from the cut to its handler
//! being cancelled — the SDK's `kill switch fired` line, by the worker's
//! own log timestamp on this host's clock — over many trials, next to
//! 2/3·TTL.
//!
//! The SDK's rule: the switch fires 2/3·TTL after the last renewal that
//! succeeded was *sent*, so a cut right after an acknowledged renewal fires
//! just under 2/3·TTL later; the time from that renewal's `renewTime` (the
//! worker's clock when it sent it) is printed beside. (A cut timed by the
//! lease watch instead can fall between the API server applying a renewal
//! and the worker reading the answer: then the last renewal the worker
//! knows of is the one before, and the switch fires a renewal period
//! earlier — early, never late.)

use std::time::Duration;

use anyhow::Context;
use batchlease_api::{BatchTask, TaskLease};
use batchlease_e2e::conformance::{Kind, StartOpts};
use batchlease_e2e::operator::Operator;
use batchlease_e2e::process::Process;
use batchlease_e2e::proxy::{Proxy, apiserver_addr, proxied_kubeconfig};
use batchlease_e2e::{Cluster, tasks, wait_for};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams};
use serde_json::json;
use tokio::time::Instant;

/// The lease TTL of the trials: 2/3 of it is 4 s.
pub const TTL_SECONDS: u64 = 6;

/// The measurements of one run, sorted.
pub struct KillSwitch {
    /// From the cut to the switch firing.
    pub from_cut: Vec<Duration>,
    /// From the `renewTime` of the last renewal that landed to the switch
    /// firing.
    pub from_renewal: Vec<Duration>,
}

/// The timestamp that starts a `tracing` fmt line (ANSI colours allowed).
pub fn log_time(line: &str) -> Option<Timestamp> {
    plain(line).split_whitespace().next()?.parse().ok()
}

/// A signed span `to - from` as a duration (zero when negative).
fn between(from: Timestamp, to: Timestamp) -> Duration {
    let micros = to.as_microsecond() - from.as_microsecond();
    Duration::from_micros(u64::try_from(micros).unwrap_or(0))
}

/// `log` with its ANSI colour sequences removed.
fn plain(log: &str) -> String {
    let mut out = String::with_capacity(log.len());
    let mut chars = log.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // An SGR sequence: ESC [ … m.
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Waits until `worker` has logged a renewal of `lease` as acknowledged
/// (renewed per worker: a renewal of its WorkerLease listing one attempt,
/// after `after` such lines), looking every 5 ms (the cut should follow
/// it closely).
async fn acked_renewal(worker: &Process, lease: &str, per_worker: bool) -> anyhow::Result<()> {
    if per_worker {
        // The first renewal listing it may have been sent before the claim
        // was acknowledged; wait for the second.
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            let n = plain(&worker.log_text())
                .lines()
                .filter(|l| l.contains("worker lease renewed") && l.contains("holds=1"))
                .count();
            if n >= 2 {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        anyhow::bail!(
            "{lease}: no acknowledged WorkerLease renewal in 60 s\n{}",
            worker.logs()
        );
    }
    let line = format!("renewed lease={lease}");
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if plain(&worker.log_text()).contains(&line) {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    anyhow::bail!(
        "{lease}: no acknowledged renewal in 60 s\n{}",
        worker.logs()
    )
}

/// `trials` cuts, each with a worker of its own behind a proxy of its own
/// (a cut connection is not reused), on a queue of its own.
pub async fn run(
    cluster: &Cluster,
    trials: usize,
    kind: Kind,
    per_worker: bool,
) -> anyhow::Result<KillSwitch> {
    let ns = cluster
        .namespace(&format!(
            "bench-killswitch-{}{}",
            kind.label(),
            if per_worker { "-pw" } else { "" }
        ))
        .await?;
    let op = Operator::start_with(&ns.name, "op", vec!["--events=important".into()])?;
    op.wait_leading(Duration::from_secs(60)).await?;
    let dir = batchlease_e2e::secrets::PrivateDir::new(&ns.name)?;
    let leases: Api<TaskLease> = ns.api();
    let (mut from_cut, mut from_renewal) = (Vec::new(), Vec::new());
    for i in 0..trials {
        let proxy = Proxy::start(apiserver_addr()?).await?;
        let queue = format!("ks{i}");
        let opts = StartOpts {
            queue: Some(queue.clone()),
            slots: 1,
            kubeconfig: Some(proxied_kubeconfig(&proxy, &dir)?),
            renew_per_worker: per_worker,
        };
        let worker = kind.start_opts(&ns.name, &format!("k{i}"), &opts)?;
        if per_worker {
            // A claim made before its WorkerLease is ready is renewed per
            // lease (and the trial would wait for WorkerLease renewals in
            // vain): the task comes once the worker renews per worker.
            let wls = ns.api::<batchlease_api::WorkerLease>();
            let wl = batchlease_api::worker_lease::worker_lease_name(&format!("k{i}"));
            wait_for(
                "the worker's WorkerLease",
                Duration::from_secs(60),
                || worker.logs(),
                || {
                    let (wls, wl) = (wls.clone(), wl.clone());
                    async move { Ok(wls.get_opt(&wl).await?.map(|_| ())) }
                },
            )
            .await?;
        }
        let name = format!("k{i:03}");
        tasks::create(
            &ns,
            &name,
            json!({"queue": queue, "leaseDurationSeconds": TTL_SECONDS, "maxRetries": 0,
                   "payload": {"steps": 600, "stepMillis": 1000}}),
        )
        .await?;
        let lease = format!("{name}-1");
        acked_renewal(&worker, &lease, per_worker).await?;
        proxy.cut();
        let cut = Timestamp::now();
        // The worker can renew no more: the lease's (or, renewed per
        // worker, its WorkerLease's) renewTime is that of the renewal it
        // logged.
        let renew = if per_worker {
            let holder = leases
                .get(&lease)
                .await?
                .spec
                .holder_identity
                .context("a held lease without holder")?;
            ns.api::<batchlease_api::WorkerLease>()
                .get(&batchlease_api::worker_lease::worker_lease_name(&holder))
                .await?
                .spec
                .renew_time
                .map(|t| t.0)
                .context("a WorkerLease without renewTime")?
        } else {
            leases
                .get(&lease)
                .await?
                .spec
                .renew_time
                .map(|t| t.0)
                .context("a held lease without renewTime")?
        };
        let fired = wait_for(
            "the kill switch after the cut",
            Duration::from_secs(4 * TTL_SECONDS),
            || worker.logs(),
            || {
                let at = worker
                    .log_text()
                    .lines()
                    .find(|l| l.contains(kind.killed_marker()))
                    .and_then(log_time);
                async move { Ok(at) }
            },
        )
        .await?;
        from_cut.push(between(cut, fired));
        from_renewal.push(between(renew, fired));
        eprintln!(
            "kill switch {i}: fired {:?} after the cut, {:?} after the last renewal's renewTime",
            between(cut, fired),
            between(renew, fired)
        );
        drop(worker);
        ns.api::<BatchTask>()
            .delete(&name, &DeleteParams::default())
            .await?;
    }
    drop(op);
    ns.cleanup().await?;
    from_cut.sort();
    from_renewal.sort();
    Ok(KillSwitch {
        from_cut,
        from_renewal,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_timestamp_of_a_coloured_line() {
        let line = "\u{1b}[2m2026-12-01T02:48:31.355583Z\u{1b}[0m \u{1b}[33m WARN\u{1b}[0m kill switch fired";
        let t = log_time(line).unwrap();
        assert_eq!(t.to_string(), "2026-12-01T02:48:31.355583Z");
        assert_eq!(log_time("no time here"), None);
        let later: Timestamp = "2026-12-01T02:48:35.355583Z".parse().unwrap();
        assert_eq!(between(t, later), Duration::from_secs(4));
        assert_eq!(between(later, t), Duration::ZERO);
    }
}
