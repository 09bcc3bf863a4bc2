//! Throughput, scale and latency benchmark, run by `hack/bench.sh` against
//! the local control plane. Reports ratios measured side by side in one run
//! (issue 12), one phase per module under `bench/`:
//!
//! 1. heartbeat: the requests of an idle operator next to the control
//!    plane's own; renewal writes per held lease and their CPU cost;
//! 2. throughput: raw API-server writes (ConfigMap creates, BatchTask
//!    creates and status updates, same client and concurrency), then no-op
//!    tasks end to end with the writes and 409s the API server counted per
//!    task, and the ratio to the limit the raw rate sets;
//! 3. scale: idle tasks added level by level up to N; at each level the
//!    operator's RSS and ≥ 100 probes, creation → lease Offered from watch
//!    events (the 0-task level is the baseline);
//! 4. task graphs and 5. resource locks, next to independent tasks;
//! 6. speculative vs. exclusive transfers (issue 11);
//! 7. failover: the holder of a task SIGSTOPped, the time until another
//!    worker holds it, from lease watch events;
//! 8. kill switch: a worker's API connection cut, the time until its
//!    handler is cancelled.
//!
//! With `--out=DIR`, SVG plots of the distributions and of RSS vs. tasks
//! are written there.

#![allow(clippy::unwrap_used, clippy::expect_used)]

// `#[path]`: files under `src/bin/` would be binaries of their own.
#[path = "bench/common.rs"]
mod common;
#[path = "bench/dashboard.rs"]
mod dashboard;
#[path = "bench/failover.rs"]
mod failover;
#[path = "bench/fleet.rs"]
mod fleet;
#[path = "bench/heartbeat.rs"]
mod heartbeat;
#[path = "bench/hollow.rs"]
mod hollow;
#[path = "bench/killswitch.rs"]
mod killswitch;
#[path = "bench/plot.rs"]
mod plot;
#[path = "bench/scale.rs"]
mod scale;
#[path = "bench/speculative.rs"]
mod speculative;
#[path = "bench/stats.rs"]
mod stats;
#[path = "bench/throughput.rs"]
mod throughput;
#[path = "bench/workloads.rs"]
mod workloads;

use std::path::PathBuf;
use std::time::Duration;

use batchlease_e2e::Cluster;

use crate::common::emit;

/// `--name=N`, else the full run's size, or with `--quick` the smoke run's.
fn arg(name: &str, full: usize, quick: usize) -> usize {
    let flag = format!("--{name}=");
    let mut args = std::env::args();
    let is_quick = args.any(|a| a == "--quick");
    std::env::args()
        .find_map(|a| a.strip_prefix(&flag).and_then(|v| v.parse().ok()))
        .unwrap_or(if is_quick { quick } else { full })
}

/// `--name=A,B,C`, else the full run's list, or with `--quick` the smoke
/// run's (`--name=0`: none).
fn list_arg(name: &str, full: &[usize], quick: &[usize]) -> Vec<usize> {
    let flag = format!("--{name}=");
    let is_quick = std::env::args().any(|a| a == "--quick");
    std::env::args()
        .find_map(|a| {
            a.strip_prefix(&flag)
                .map(|v| v.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        })
        .unwrap_or_else(|| {
            if is_quick {
                quick.to_vec()
            } else {
                full.to_vec()
            }
        })
        .into_iter()
        .filter(|n| *n > 0)
        .collect()
}

fn out_dir() -> Option<PathBuf> {
    std::env::args().find_map(|a| a.strip_prefix("--out=").map(PathBuf::from))
}

fn write_plot(dir: &Option<PathBuf>, name: &str, svg: String) -> anyhow::Result<()> {
    if let Some(dir) = dir {
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join(name), svg)?;
        eprintln!("plot: {}", dir.join(name).display());
    }
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let held_n = arg("held", 1000, 20);
    let window = Duration::from_secs(arg("window", 60, 5) as u64);
    let raw_n = arg("raw", 2000, 100);
    let tasks_n = arg("tasks", 2000, 100);
    let scale_n = arg("scale", 100_000, 200);
    let probes = arg("probes", 100, 10);
    let conc = arg("concurrency", 16, 16);
    let dag_n = arg("dag", 1000, 100);
    let locked_n = arg("locked", 200, 20);
    let speculative_n = arg("speculative", 200, 20);
    let failover_n = arg("failover", 20, 2);
    let killswitch_n = arg("killswitch", 20, 2);
    let kinds_n = arg("kinds", 500, 40);
    let dashboard_n = arg("dashboard", 10_000, 200);
    let fleet_workers = list_arg("fleet-workers", &[10, 100, 1000], &[10]);
    let fleet_leases = arg("fleet-leases", 1000, 40);
    let fleet_churn = arg("fleet-churn", 500, 20);
    let fleet_ttl = arg("fleet-ttl", 30, 6) as u64;
    let fleet_killswitch = arg("fleet-killswitch", 5, 1);
    // Both protocols side by side by default: `--fleet-modes=lease` or
    // `=worker` for one.
    let fleet_modes: Vec<batchlease_api::Renewal> = std::env::args()
        .find_map(|a| a.strip_prefix("--fleet-modes=").map(str::to_owned))
        .unwrap_or_else(|| "lease,worker".into())
        .split(',')
        .filter_map(|m| match m.trim() {
            "lease" => Some(batchlease_api::Renewal::Lease),
            "worker" => Some(batchlease_api::Renewal::Worker),
            _ => None,
        })
        .collect();
    // A quick run follows the e2e tests on their control plane: a test's
    // namespace that will not go soon must not hold it up.
    let quiet = Duration::from_secs(arg("quiet-seconds", 600, 30) as u64);
    let _ = common::QUIET_WAIT.set(quiet);
    let out = out_dir();
    let cluster = Cluster::with_crds().await?;
    let mut report = String::new();

    // First, on a cluster nothing else has touched yet: the idle windows.
    if window > Duration::ZERO {
        eprintln!("== heartbeat: idle windows of {window:?}, then {held_n} held leases");
        heartbeat::run(&cluster, held_n, window, &mut report).await?;
    }
    let mut raw = None;
    if raw_n > 0 {
        eprintln!("== raw API writes: {raw_n} of each");
        raw = Some(throughput::raw(&cluster, raw_n, conc, &mut report).await?);
    }
    if tasks_n > 0 {
        eprintln!("== end to end: {tasks_n} tasks");
        throughput::end_to_end(&cluster, tasks_n, conc, raw.as_ref(), &mut report).await?;
    }
    if scale_n > 0 {
        eprintln!("== scale: up to {scale_n} idle tasks, {probes} probes per level");
        let levels = scale::run(&cluster, scale_n, probes, conc, &mut report).await?;
        let rss: Vec<(f64, f64)> = levels
            .iter()
            .filter_map(|l| Some((l.tasks as f64, l.rss_mib?)))
            .collect();
        write_plot(
            &out,
            "rss-vs-tasks.svg",
            plot::lines(
                "Operator RSS vs. tasks cached",
                "tasks (and their leases)",
                "RSS (MiB)",
                &[("RSS".into(), rss)],
            ),
        )?;
        let series: Vec<(String, &[Duration])> = levels
            .iter()
            .map(|l| (format!("{} tasks", l.tasks), &l.probes[..]))
            .collect();
        write_plot(
            &out,
            "offer-latency.svg",
            plot::cdf(
                "A new task's lease Offered, after its creation (watch events)",
                &series,
                None,
            ),
        )?;
    }
    if dag_n > 0 {
        eprintln!("== graphs: {dag_n} tasks");
        workloads::graphs(&cluster, dag_n, conc, &mut report).await?;
    }
    if locked_n > 0 {
        eprintln!("== locks: {locked_n} tasks per run");
        workloads::locks(&cluster, locked_n, conc, &mut report).await?;
    }
    if speculative_n > 0 {
        eprintln!("== speculative: {speculative_n} transfers per run");
        speculative::speculative(&cluster, speculative_n, conc, &mut report).await?;
    }
    if failover_n > 0 {
        eprintln!("== failover: {failover_n} trials");
        let v = failover::run(&cluster, failover_n).await?;
        let ttl = Duration::from_secs(failover::TTL_SECONDS);
        emit(
            &mut report,
            &format!(
                "failover ({failover_n} trials, TTL {} s; SIGSTOP of the holder → the task Held by the other worker, from lease watch events): {}; p95 − TTL {:.0} ms\n",
                failover::TTL_SECONDS,
                stats::summary(&v),
                stats::ms(stats::quantile(&v, 0.95)) - stats::ms(ttl),
            ),
        );
        write_plot(
            &out,
            "failover.svg",
            plot::cdf(
                "Failover: holder SIGSTOPped → task held by another worker",
                &[("failover".into(), &v[..])],
                Some(("TTL", ttl)),
            ),
        )?;
    }
    if kinds_n > 0 {
        eprintln!("== worker kinds: {kinds_n} no-op tasks each");
        throughput::kinds(&cluster, kinds_n, conc, &mut report).await?;
    }
    if killswitch_n > 0 {
        let two_thirds = Duration::from_secs(killswitch::TTL_SECONDS) * 2 / 3;
        let mut runs = Vec::new();
        for kind in batchlease_e2e::conformance::KINDS {
            eprintln!("== kill switch ({}): {killswitch_n} trials", kind.label());
            let k = killswitch::run(&cluster, killswitch_n, kind, false).await?;
            emit(
                &mut report,
                &format!(
                    "kill switch, {} ({killswitch_n} trials, TTL {} s, 2/3·TTL = {:.0} ms; the worker's API connection cut right after it logged a renewal acknowledged → \
                     its handler stopped — the SDK's `kill switch fired`, for batchlease-run the child's SIGTERM — by the worker's log timestamp): from the cut {}; from the last renewal's renewTime {}; \
                     max |from renewal − 2/3·TTL| {:.0} ms\n",
                    kind.label(),
                    killswitch::TTL_SECONDS,
                    stats::ms(two_thirds),
                    stats::summary(&k.from_cut),
                    stats::summary(&k.from_renewal),
                    k.from_renewal
                        .iter()
                        .map(|d| (stats::ms(*d) - stats::ms(two_thirds)).abs())
                        .fold(0.0, f64::max),
                ),
            );
            runs.push((kind, k));
        }
        let series: Vec<(String, &[Duration])> = runs
            .iter()
            .flat_map(|(kind, k)| {
                [
                    (format!("{}: from the cut", kind.label()), &k.from_cut[..]),
                    (
                        format!("{}: from the last renewal sent", kind.label()),
                        &k.from_renewal[..],
                    ),
                ]
            })
            .collect();
        write_plot(
            &out,
            "kill-switch.svg",
            plot::cdf(
                "Kill switch: API connection cut → handler stopped",
                &series,
                Some(("2/3·TTL", two_thirds)),
            ),
        )?;
    }
    if fleet_leases > 0 && !fleet_workers.is_empty() {
        let mut runs = Vec::new();
        for &workers in &fleet_workers {
            for &mode in &fleet_modes {
                eprintln!(
                    "== fleet ({}): {workers} hollow workers, {fleet_leases} held leases, {fleet_churn} churn tasks",
                    fleet::mode_name(mode)
                );
                let o = fleet::Opts {
                    workers,
                    leases: fleet_leases,
                    churn: fleet_churn,
                    ttl_seconds: fleet_ttl,
                    window,
                    conc,
                    // A real SDK worker's kill switch, renewing as the fleet.
                    killswitch: fleet_killswitch,
                    mode,
                };
                // A size today's protocol cannot serve is a result, not the
                // end of the sweep: say how it failed and go on.
                match fleet::run(&cluster, o, &mut report).await {
                    Ok(m) => runs.push(m),
                    Err(e) => {
                        // Its first lines: a protocol violation lists each
                        // violation on a line of its own (the diagnostics
                        // after them are long).
                        let first = format!("{e:#}");
                        let first = first.lines().take(20).collect::<Vec<_>>().join("\n  ");
                        emit(
                            &mut report,
                            &format!(
                                "fleet ({}): {workers} workers, {fleet_leases} leases: did not complete: {first}\n",
                                fleet::mode_name(mode)
                            ),
                        );
                        common::quiet_cluster(&cluster).await?;
                    }
                }
            }
        }
        fleet_summary(&runs, &out, &mut report)?;
    }
    if dashboard_n > 0 {
        eprintln!("== dashboard: 100 and {dashboard_n} tasks in a headless browser");
        dashboard::run(&cluster, dashboard_n, conc, &mut report).await?;
    }
    println!("\n--- results ---\n{report}");
    Ok(())
}

/// The fleet runs side by side: how each cost grows with the number of
/// workers at the same number of held leases, per protocol, and the ratio
/// of renewals per worker to per lease at each size (measured in this run).
fn fleet_summary(
    runs: &[fleet::Measured],
    out: &Option<PathBuf>,
    report: &mut String,
) -> anyhow::Result<()> {
    let mut t = String::from(
        "fleet, side by side (same held leases, TTL, churn):\n\
         | renewed | workers | held leases | kube-apiserver millicores per held lease | etcd millicores per held lease | TaskLease watch events/s while held | churn tasks/s | writes per task | watch events per task | kube-apiserver ms per task | offer p95 | failover p95 | kill switch max |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in runs {
        t.push_str(&format!(
            "| {} | {} | {} | {:.3} | {:.3} | {:.0} | {:.1} | {:.2} | {:.1} | {:.1} | {:.0} ms | {:.0} ms | {} |\n",
            fleet::mode_name(r.opts.mode),
            r.opts.workers,
            r.opts.leases,
            r.apiserver_millicores_per_lease,
            r.etcd_millicores_per_lease,
            r.lease_watch_events_per_s,
            r.tasks_per_s,
            r.writes_per_task,
            r.watch_events_per_task,
            r.apiserver_ms_per_task,
            stats::ms(stats::quantile(&r.offer_latency, 0.95)),
            stats::ms(stats::quantile(&r.failover, 0.95)),
            r.killswitch
                .last()
                .map_or_else(|| "—".to_owned(), |d| format!("{:.0} ms", stats::ms(*d))),
        ));
    }
    // Per size, per worker ÷ per lease, both from this run.
    let find = |w: usize, m: batchlease_api::Renewal| {
        runs.iter()
            .find(|r| r.opts.workers == w && r.opts.mode == m)
    };
    let mut sizes: Vec<usize> = runs.iter().map(|r| r.opts.workers).collect();
    sizes.dedup();
    let mut ratios = String::from(
        "\nrenewals per worker ÷ per lease, at each size (target: kube-apiserver CPU per held lease ≤ 0.20):\n\
         | workers | kube-apiserver CPU per held lease | etcd CPU per held lease | TaskLease watch events/s while held | failover p95 (TTL + …) |\n\
         |---:|---:|---:|---:|---:|\n",
    );
    for w in sizes {
        let (Some(l), Some(p)) = (
            find(w, batchlease_api::Renewal::Lease),
            find(w, batchlease_api::Renewal::Worker),
        ) else {
            continue;
        };
        let ttl_ms = (p.opts.ttl_seconds * 1000) as f64;
        ratios.push_str(&format!(
            "| {w} | {:.2} | {:.2} | {:.2} | {:.0} ms |\n",
            p.apiserver_millicores_per_lease / l.apiserver_millicores_per_lease.max(1e-9),
            p.etcd_millicores_per_lease / l.etcd_millicores_per_lease.max(1e-9),
            p.lease_watch_events_per_s / l.lease_watch_events_per_s.max(1e-9),
            stats::ms(stats::quantile(&p.failover, 0.95)) - ttl_ms,
        ));
    }
    t.push_str(&ratios);
    emit(report, &t);
    let per = |f: fn(&fleet::Measured) -> f64| -> Vec<(String, Vec<(f64, f64)>)> {
        [
            batchlease_api::Renewal::Lease,
            batchlease_api::Renewal::Worker,
        ]
        .into_iter()
        .map(|m| {
            (
                format!("renewed {}", fleet::mode_name(m)),
                runs.iter()
                    .filter(|r| r.opts.mode == m)
                    .map(|r| (r.opts.workers as f64, f(r)))
                    .collect::<Vec<_>>(),
            )
        })
        .filter(|(_, p)| !p.is_empty())
        .collect()
    };
    write_plot(
        out,
        "fleet-watch-events.svg",
        plot::lines(
            "Watch events sent per task vs. workers",
            "workers",
            "watch events per task",
            &per(|r| r.watch_events_per_task),
        ),
    )?;
    write_plot(
        out,
        "fleet-apiserver-cpu.svg",
        plot::lines(
            "kube-apiserver CPU per held lease vs. workers",
            "workers",
            "millicores per held lease",
            &per(|r| r.apiserver_millicores_per_lease),
        ),
    )?;
    Ok(())
}
