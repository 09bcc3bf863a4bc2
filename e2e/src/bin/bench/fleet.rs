//! The fleet simulator (issue 27): W hollow workers ([`crate::hollow`])
//! holding M leases at once on the real control plane, with the operator.
//! Three measurements at that size, each from the API server's own
//! counters and /proc:
//!
//! 1. **held**: M leases held, nothing else happening, over a whole
//!    number of renewal periods: kube-apiserver and etcd CPU and memory,
//!    requests/s by verb, watch events sent/s — per held lease;
//! 2. **churn**: N short tasks through the fleet while the M stay held:
//!    tasks/s, and per task (the held leases' renewals subtracted)
//!    API writes, watch events sent, API-server CPU; offer latency from
//!    the create to the claim's answer;
//! 3. **failover**: one worker frozen (as by SIGSTOP) with its leases; the
//!    time until each of its tasks is held by another worker.
//!
//! The windows are measurements, not waits: the length of time is the
//! thing measured over.

use std::collections::BTreeMap;
use std::time::Duration;

use batchlease_api::{BatchTask, Renewal as Mode, TaskLease, TaskPhase};
use batchlease_e2e::tasks::phase_of;
use batchlease_e2e::{Cluster, TestNamespace, api_requests, wait_for};
use kube::ResourceExt;
use kube::api::{Api, ListParams};
use serde_json::json;
use tokio::time::Instant;

use crate::common::{
    component_pid, cpu_of, create_all, emit, operator_at_defaults, operator_count, quiet_cluster,
    rss_mib,
};
use crate::hollow::{Fleet, QUEUE, Stats};
use crate::stats;

/// Free slots the churn runs on, in all: the same at every fleet size, so
/// tasks/s compares the protocol, not the number of slots.
const CHURN_SLOTS: usize = 40;

/// The sizes of one fleet run.
#[derive(Debug, Clone, Copy)]
pub struct Opts {
    pub workers: usize,
    pub leases: usize,
    pub churn: usize,
    pub ttl_seconds: u64,
    /// The held window, rounded up to whole renewal periods.
    pub window: Duration,
    pub conc: usize,
    /// Kill-switch trials (a real SDK worker, its API connection cut)
    /// while the fleet holds its leases.
    pub killswitch: usize,
    /// How the fleet keeps its leases alive: today's per-lease renewals,
    /// or its workers' WorkerLeases (issue 27).
    pub mode: Mode,
}

/// A protocol's name in the report.
pub fn mode_name(m: Mode) -> &'static str {
    match m {
        Mode::Lease => "per lease",
        Mode::Worker => "per worker",
    }
}

/// What a run measured, for the comparison and the plots.
#[derive(Debug, Clone)]
pub struct Measured {
    pub opts: Opts,
    /// kube-apiserver cores per 1,000 held leases.
    pub apiserver_millicores_per_lease: f64,
    pub etcd_millicores_per_lease: f64,
    pub lease_watch_events_per_s: f64,
    pub tasks_per_s: f64,
    pub writes_per_task: f64,
    pub watch_events_per_task: f64,
    pub apiserver_ms_per_task: f64,
    pub offer_latency: Vec<Duration>,
    pub failover: Vec<Duration>,
    /// From the last renewal's renewTime to the handler cancelled.
    pub killswitch: Vec<Duration>,
}

/// A snapshot of the counters a window is the difference of.
struct Counters {
    at: Instant,
    requests: api_requests::Counts,
    events: BTreeMap<String, f64>,
    cpu: Vec<Option<f64>>,
}

fn counters(pids: &[Option<u32>]) -> anyhow::Result<Counters> {
    Ok(Counters {
        at: Instant::now(),
        requests: api_requests::snapshot()?,
        events: api_requests::watch_events()?,
        cpu: cpu_of(pids),
    })
}

/// `b − a`: seconds, requests, events per resource, CPU seconds per pid.
struct Delta {
    secs: f64,
    requests: api_requests::Counts,
    events: BTreeMap<String, f64>,
    cpu: Vec<f64>,
}

fn delta(a: &Counters, b: &Counters) -> Delta {
    Delta {
        secs: (b.at - a.at).as_secs_f64(),
        requests: api_requests::delta(&a.requests, &b.requests),
        events: b
            .events
            .iter()
            .map(|(k, v)| (k.clone(), v - a.events.get(k).copied().unwrap_or(0.0)))
            .filter(|(_, v)| *v > 0.0)
            .collect(),
        cpu: a
            .cpu
            .iter()
            .zip(&b.cpu)
            .map(|(a, b)| a.zip(*b).map_or(0.0, |(a, b)| b - a))
            .collect(),
    }
}

impl Delta {
    fn events(&self, resource: &str) -> f64 {
        self.events.get(resource).copied().unwrap_or(0.0)
    }
    fn protocol_writes(&self) -> f64 {
        ["taskleases", "batchtasks"]
            .iter()
            .map(|r| api_requests::count(&self.requests, r, &api_requests::WRITES, "2"))
            .sum()
    }
    fn events_table(&self) -> String {
        let mut t = String::from("| resource | watch events sent/s |\n|---|---:|\n");
        for (r, v) in &self.events {
            // The control plane's own watches (a few events a minute) left out.
            if v / self.secs >= 1.0 {
                t.push_str(&format!("| {r} | {:.1} |\n", v / self.secs));
            }
        }
        t
    }
}

fn task(name: String, ttl: u64, hold_ms: u64, churn: bool) -> serde_json::Value {
    json!({
        "apiVersion": "batchlease.dev/v1alpha1", "kind": "BatchTask",
        "metadata": {"name": name, "labels": {"bench": if churn { "churn" } else { "held" }}},
        "spec": {"queue": QUEUE, "leaseDurationSeconds": ttl, "maxRetries": 5,
                 "payload": {"holdMillis": hold_ms}},
    })
}

async fn phases(api: &Api<BatchTask>, selector: &str) -> anyhow::Result<BTreeMap<String, usize>> {
    let mut out = BTreeMap::new();
    for t in api
        .list(&ListParams::default().labels(selector))
        .await?
        .items
    {
        let p = phase_of(&t).map_or_else(|| "-".to_owned(), |p| format!("{p:?}"));
        *out.entry(p).or_default() += 1;
    }
    Ok(out)
}

/// One fleet run at `o`'s sizes.
pub async fn run(cluster: &Cluster, o: Opts, report: &mut String) -> anyhow::Result<Measured> {
    let ns = cluster.namespace("bench-fleet").await?;
    // The namespace goes whether the run completed or not: a failed size
    // must not leave its tasks to the next one.
    let measured = measure(cluster, &ns, o, report).await;
    ns.cleanup().await?;
    measured
}

async fn measure(
    cluster: &Cluster,
    ns: &TestNamespace,
    o: Opts,
    report: &mut String,
) -> anyhow::Result<Measured> {
    let note = quiet_cluster(cluster).await?;
    // A fleet at size loads the API server: a quick leader term would lapse.
    let op = operator_at_defaults(&ns.name).await?;
    let (apiserver, etcd) = (component_pid("kube-apiserver"), component_pid("etcd"));
    let pids = [apiserver, etcd, op.pid(), Some(std::process::id())];
    let slots = o.leases.div_ceil(o.workers);
    let fleet = Fleet::start(
        &cluster.client,
        &ns.name,
        o.workers,
        slots,
        o.mode,
        o.ttl_seconds,
    );
    let s = fleet.stats.clone();
    let tasks: Api<BatchTask> = ns.api();

    // 1. Fill: M tasks that outlast the run, all claimed, all Running.
    let fill = Instant::now();
    create_all(&tasks, o.leases, o.conc, |i| {
        task(format!("h-{i:05}"), o.ttl_seconds, 36_000_000, false)
    })
    .await?;
    let diag = || format!("{:?}\n{}", s, op.logs());
    wait_for(
        "every lease held",
        Duration::from_secs(1800),
        diag,
        || async {
            let taken = Stats::get(&s.claims) + Stats::get(&s.bound);
            Ok((taken >= o.leases as u64).then_some(()))
        },
    )
    .await?;
    let fill_secs = fill.elapsed().as_secs_f64();
    wait_for(
        "every task Running",
        Duration::from_secs(1800),
        || format!("{:?}", s),
        || async {
            let running = operator_count(&op, &ns.name, TaskPhase::Running).await?;
            Ok((running == o.leases).then_some(()))
        },
    )
    .await?;

    // 2. Held: a whole number of renewal periods.
    let period = o.ttl_seconds as f64 / 3.0;
    let periods = (o.window.as_secs_f64() / period).ceil().max(1.0);
    let a = counters(&pids)?;
    let renewals0 = Stats::get(&s.renewals);
    tokio::time::sleep(Duration::from_secs_f64(periods * period)).await;
    let b = counters(&pids)?;
    let held = delta(&a, &b);
    let held_renewals = (Stats::get(&s.renewals) - renewals0) as f64;
    let renewals = held_renewals / held.secs;
    let m = o.leases as f64;
    let core = |i: usize| held.cpu[i] / held.secs;
    let (table, rate) = api_requests::per_second(&held.requests, held.secs);
    emit(
        report,
        &format!(
            "fleet, renewed {mode}: {w} hollow workers × {slots} slots, {m:.0} leases held (TTL {ttl} s), filled in {fill_secs:.1} s; \
             {:.0} s held window{note}: renewal writes {renewals:.1}/s ({:.4}/s per lease, 3/TTL = {:.4}); all requests {rate:.1}/s\n\
             CPU: kube-apiserver {:.3} cores ({:.3} millicores per held lease), etcd {:.3} cores ({:.3} per lease), operator {:.3} cores, \
             the fleet (this process) {:.3} cores; RSS: kube-apiserver {}, etcd {}\n\
             TaskLease watch events sent {:.1}/s ({:.2} per renewal)\n{table}{}",
            held.secs,
            renewals / m,
            3.0 / o.ttl_seconds as f64,
            core(0),
            core(0) * 1000.0 / m,
            core(1),
            core(1) * 1000.0 / m,
            core(2),
            core(3),
            mib(rss_mib(apiserver)),
            mib(rss_mib(etcd)),
            held.events("taskleases") / held.secs,
            held.events("taskleases") / (renewals * held.secs).max(1.0),
            held.events_table(),
            w = o.workers,
            ttl = o.ttl_seconds,
            mode = mode_name(o.mode),
        ),
    );

    // The kill switch of a real SDK worker while the fleet holds its
    // leases (its own namespace, operator and proxy).
    let killswitch = if o.killswitch > 0 {
        let k = crate::killswitch::run(
            cluster,
            o.killswitch,
            batchlease_e2e::conformance::Kind::RustSdk,
            o.mode == Mode::Worker,
        )
        .await?;
        let two_thirds = Duration::from_secs(crate::killswitch::TTL_SECONDS) * 2 / 3;
        emit(
            report,
            &format!(
                "fleet kill switch ({}): {} trials (TTL {} s, 2/3·TTL = {:.0} ms) while the {m:.0} leases are held: from the last renewal's renewTime {}\n",
                mode_name(o.mode),
                o.killswitch,
                crate::killswitch::TTL_SECONDS,
                stats::ms(two_thirds),
                stats::summary(&k.from_renewal),
            ),
        );
        k.from_renewal
    } else {
        Vec::new()
    };

    // 3. Churn: N no-op tasks through the fleet, with CHURN_SLOTS free
    // slots in all (at least one per worker), whatever the fleet's size.
    let churn_slots = fleet.add_slots(CHURN_SLOTS.div_ceil(o.workers).max(1), true);
    // Renewing per worker, the operator addresses (and binds) by the slots
    // the WorkerLeases say: the churn starts once every one says the new
    // count, as a fleet that had those slots all along would.
    if o.mode == Mode::Worker {
        let wls = ns.api::<batchlease_api::WorkerLease>();
        let want = i32::try_from(churn_slots).unwrap_or(i32::MAX);
        wait_for(
            "every WorkerLease saying its churn slots",
            Duration::from_secs(120),
            || format!("{:?}", s),
            || async {
                let all = wls.list(&Default::default()).await?.items;
                let done = all.len() == o.workers && all.iter().all(|w| w.spec.slots == Some(want));
                Ok(done.then_some(()))
            },
        )
        .await?;
    }
    let c0 = counters(&pids)?;
    let renewals_c0 = Stats::get(&s.renewals);
    let mut created: Vec<(String, Instant)> = Vec::with_capacity(o.churn);
    let start = Instant::now();
    for chunk in (0..o.churn).collect::<Vec<_>>().chunks(o.conc.max(1)) {
        let made = futures::future::join_all(chunk.iter().map(|i| {
            let tasks = tasks.clone();
            let obj = task(format!("c-{i:05}"), o.ttl_seconds, 0, true);
            async move {
                let t: BatchTask = serde_json::from_value(obj)?;
                tasks.create(&Default::default(), &t).await?;
                anyhow::Ok((t.name_any(), Instant::now()))
            }
        }))
        .await;
        for m in made {
            created.push(m?);
        }
    }
    wait_for(
        "every churn task Succeeded",
        Duration::from_secs(1800),
        || format!("{:?}\n{}", s, op.logs()),
        || async {
            // The operator's count: a LIST each 100 ms would be a cost of
            // its own in what is measured.
            let done = operator_count(&op, &ns.name, TaskPhase::Succeeded).await?;
            Ok((done == o.churn).then_some(()))
        },
    )
    .await?;
    let churn_secs = start.elapsed().as_secs_f64();
    let c1 = counters(&pids)?;
    let p = phases(&tasks, "bench=churn").await?;
    // Attempts per churn task (a bound attempt its worker never took, or a
    // lost race, is issued again): from each task's last token.
    let attempts: i64 = tasks
        .list(&ListParams::default().labels("bench=churn"))
        .await?
        .items
        .iter()
        .map(|t| t.status.as_ref().map_or(0, |s| s.fencing_token))
        .sum();
    // Churn attempts bound to their worker (no claim), of all held.
    let churn_leases: Vec<TaskLease> = ns
        .api::<TaskLease>()
        .list(&Default::default())
        .await?
        .items
        .into_iter()
        .filter(|l| l.spec.task_name.starts_with("c-") && l.spec.holder_identity.is_some())
        .collect();
    let bound_share =
        churn_leases.iter().filter(|l| l.bound()).count() as f64 / churn_leases.len().max(1) as f64;
    anyhow::ensure!(
        p.get("Succeeded").copied() == Some(o.churn),
        "the operator counted {} churn tasks Succeeded, the API server has {p:?}",
        o.churn
    );
    let churn = delta(&c0, &c1);
    let n = o.churn.max(1) as f64;
    // What the held leases cost meanwhile: the held window's cost per
    // renewal times the renewals made during the churn (not per second: a
    // loaded API server renews late, and a time-based share overshoots).
    let renewals_churn = (Stats::get(&s.renewals) - renewals_c0) as f64;
    let steady = renewals_churn / held_renewals.max(1.0);
    let writes = (churn.protocol_writes() - held.protocol_writes() * steady) / n;
    let events = (churn.events("taskleases") + churn.events("batchtasks")
        - (held.events("taskleases") + held.events("batchtasks")) * steady)
        / n;
    let api_ms = (churn.cpu[0] - held.cpu[0] * steady) * 1000.0 / n;
    let mut offer: Vec<Duration> = {
        let claimed = s.claimed.lock().await;
        created
            .iter()
            .filter_map(|(name, at)| Some(claimed.get(name)?.0.saturating_duration_since(*at)))
            .collect()
    };
    offer.sort();
    let tasks_per_s = n / churn_secs;
    // Every write of the churn window by resource and verb (the held
    // leases' refreshes and WorkerLease renewals included).
    let (writes_table, _, _) =
        api_requests::per_task(&churn.requests, o.churn, &["taskleases", "batchtasks"]);
    emit(
        report,
        &format!(
            "fleet churn ({}): {} no-op tasks while the {m:.0} stay held: {tasks_per_s:.1} tasks/s; per task, the held leases' renewals subtracted at the held window's cost per renewal: \
             protocol writes {writes:.2}, watch events sent {events:.1} (TaskLeases and BatchTasks), kube-apiserver CPU {api_ms:.1} ms; \
             claims lost to another worker {} ({:.2} per task); churn attempts bound (no claim) {:.0} %, attempts per task {:.2}; offer latency, create → claim answered or bound attempt taken: {}\n{writes_table}",
            mode_name(o.mode),
            o.churn,
            Stats::get(&s.lost_races),
            Stats::get(&s.lost_races) as f64 / n,
            100.0 * bound_share,
            attempts as f64 / n,
            stats::summary(&offer),
        ),
    );

    // 4. Failover: the busiest worker frozen with its leases; the others
    // get room for all of them (its leases are long tasks).
    let _ = fleet.add_slots(
        slots.div_ceil(o.workers.saturating_sub(1).max(1)) + 1,
        false,
    );
    let theirs = fleet.freeze_busiest().await;
    let frozen_at = Instant::now();
    anyhow::ensure!(!theirs.is_empty(), "no worker holds a lease");
    let mut failover = Vec::new();
    wait_for(
        "the frozen worker's tasks held by others",
        Duration::from_secs(o.ttl_seconds * 4 + 30),
        || format!("{:?}\n{}", s, op.logs()),
        || async {
            let claimed = s.claimed.lock().await;
            let moved: Vec<Duration> = theirs
                .iter()
                .filter_map(|(t, token)| {
                    let (at, _, now) = claimed.get(t)?;
                    (now > token).then(|| at.saturating_duration_since(frozen_at))
                })
                .collect();
            Ok((moved.len() == theirs.len()).then_some(moved))
        },
    )
    .await
    .map(|v| failover = v)?;
    failover.sort();
    emit(
        report,
        &format!(
            "fleet failover ({}): a worker holding {} leases frozen → each of its tasks held by another worker (TTL {} s): {}; p95 − TTL {:.0} ms\n",
            mode_name(o.mode),
            theirs.len(),
            o.ttl_seconds,
            stats::summary(&failover),
            stats::ms(stats::quantile(&failover, 0.95)) - (o.ttl_seconds * 1000) as f64,
        ),
    );
    drop(fleet);
    drop(op);
    Ok(Measured {
        opts: o,
        apiserver_millicores_per_lease: core(0) * 1000.0 / m,
        etcd_millicores_per_lease: core(1) * 1000.0 / m,
        lease_watch_events_per_s: held.events("taskleases") / held.secs,
        tasks_per_s,
        writes_per_task: writes,
        watch_events_per_task: events,
        apiserver_ms_per_task: api_ms,
        offer_latency: offer,
        failover,
        killswitch,
    })
}

fn mib(v: Option<f64>) -> String {
    v.map_or_else(|| "n/a".into(), |v| format!("{v:.0} MiB"))
}
