//! The fault soak: demo workers with fenced PostgreSQL commits run a stream
//! of tasks under two operator replicas while faults drawn from a seeded
//! RNG hit them — SIGSTOP past the TTL, SIGKILL, an API partition with
//! PostgreSQL reachable, PostgreSQL packets held past the TTL and then
//! delivered, the leader SIGKILLed, kube-apiserver and etcd restarted —
//! and hostile tenants: lease labels and owner references tampered with,
//! forged leases carrying the largest token, tasks with a 10,000-level
//! payload and handlers that compute for 2·TTL without yielding — and the
//! controls that meet renewals per worker at their joints: tasks cancelled
//! (running or still waiting), tasks that take one of two resource locks, WorkerLeases
//! deleted under their workers. At the end every task must have finished
//! and the history checker must find no violation (a commit after
//! `Cancelled` is judged on the API server's audit log, lock occupancy on
//! PostgreSQL's). The report gives the share of tasks that finished while
//! the faults went on. The seed is printed first, so a failure replays.
//!
//! Quick mode runs in CI (`e2e/tests/soak.rs`, ≥ 100 faults); the full run
//! is `hack/soak.sh --faults=1000` (`e2e/bench/RESULTS.md`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use batchlease_api::{BatchTask, TaskLease, TaskPhase, WorkerLease};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use tokio::sync::Mutex;
use tokio::time::Instant;

use crate::history::Checks;
use crate::operator::Operator;
use crate::process::Process;
use crate::proxy::{Proxy, apiserver_addr, proxied_kubeconfig};
use crate::secrets::PrivateDir;
use crate::tasks::phase_of;
use crate::workers::{self, WorkerOpts};

mod api_faults;
use crate::{Cluster, controlplane, wait_for};
use api_faults::{cancel, delete_worker_lease, forge, tamper};

/// What to run.
#[derive(Debug, Clone)]
pub struct SoakConfig {
    pub seed: u64,
    /// Faults to inject.
    pub faults: usize,
    /// Tasks to run in all.
    pub tasks: usize,
    pub workers: usize,
    pub slots: usize,
    /// Lease TTL of every task.
    pub ttl_seconds: u64,
    /// Mean pause between two faults.
    pub fault_every: Duration,
    /// The workers renew per worker (their WorkerLeases), not per lease.
    pub renew_per_worker: bool,
    /// How long every task has to finish once the faults stop: the run's
    /// liveness check; the history is checked only after it.
    pub drain: Duration,
}

impl SoakConfig {
    /// The CI run: ≥ 100 faults in a few minutes.
    pub fn quick(seed: u64) -> Self {
        Self {
            seed,
            faults: 100,
            tasks: 120,
            workers: 3,
            slots: 2,
            ttl_seconds: 5,
            fault_every: Duration::from_millis(900),
            renew_per_worker: false,
            drain: Duration::from_secs(300),
        }
    }
}

/// Fault kinds, with their weights.
const KINDS: [(&str, u32); 11] = [
    ("worker_sigstop_past_ttl", 20),
    ("worker_sigkill", 14),
    ("worker_api_partition", 16),
    ("worker_postgres_held_past_ttl", 16),
    ("leader_sigkill", 8),
    ("kube_apiserver_restart", 2),
    ("etcd_restart", 2),
    ("tamper_lease_metadata", 6),
    ("forge_lease", 3),
    ("cancel_task", 4),
    // Renewing per worker only (drawn again otherwise).
    ("delete_worker_lease", 6),
];

/// The resource locks the soak's tasks take (every fifth task one of them).
const LOCKS: [&str; 2] = ["soak-db-0", "soak-db-1"];

/// A demo payload that also nests 9,980 objects deep (built as text).
fn deep_payload() -> String {
    let levels = 9_980;
    let mut s = String::with_capacity(levels * 6 + 64);
    s.push_str(r#"{"steps":4,"stepMillis":250,"n":"#);
    for _ in 1..levels {
        s.push_str(r#"{"n":"#);
    }
    s.push_str("{}");
    for _ in 0..levels {
        s.push('}');
    }
    s
}

/// What happened.
#[derive(Debug, Default)]
pub struct SoakReport {
    pub seed: u64,
    pub renew_per_worker: bool,
    pub faults: BTreeMap<&'static str, usize>,
    pub succeeded: usize,
    pub dead_lettered: usize,
    pub cancelled: usize,
    /// Of the tasks created by the time the faults stopped, the share
    /// that had finished by then (`None`: the tasks could not be listed).
    pub finished_during_faults: Option<f64>,
    /// Attempts held: created bound to their worker, and claimed.
    pub bound: usize,
    pub claimed: usize,
    /// Attempts the SDK stopped itself (kill switch), by reason.
    pub kill_switch: BTreeMap<String, f64>,
    /// Commits the SDK refused locally, or PostgreSQL refused, as stale.
    pub refused_by_fence: f64,
    pub refused_by_postgres: f64,
    /// Completions the API server refused (the lease was no longer ours).
    pub refused_by_api_server: f64,
    pub violations: Vec<String>,
    pub elapsed: Duration,
}

impl std::fmt::Display for SoakReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let total: usize = self.faults.values().sum();
        writeln!(
            f,
            "soak seed {} ({:.0?}){}",
            self.seed,
            self.elapsed,
            if self.renew_per_worker {
                ", workers renewing per worker"
            } else {
                ""
            }
        )?;
        writeln!(f, "faults injected: {total}")?;
        for (k, n) in &self.faults {
            writeln!(f, "  {k}: {n}")?;
        }
        writeln!(
            f,
            "tasks: {} succeeded, {} dead-lettered, {} cancelled; {} of those created had finished when the faults stopped",
            self.succeeded,
            self.dead_lettered,
            self.cancelled,
            self.finished_during_faults
                .map_or_else(|| "n/a".to_owned(), |r| format!("{r:.2}"))
        )?;
        writeln!(
            f,
            "attempts held: {} bound (no claim), {} claimed",
            self.bound, self.claimed
        )?;
        writeln!(f, "kill switch fired: {:?}", self.kill_switch)?;
        writeln!(
            f,
            "stale writes refused: by the fence {}, by PostgreSQL {}, by the API server {}",
            self.refused_by_fence - self.refused_by_postgres,
            self.refused_by_postgres,
            self.refused_by_api_server
        )?;
        writeln!(f, "violations: {}", self.violations.len())?;
        for v in &self.violations {
            writeln!(f, "  {v}")?;
        }
        Ok(())
    }
}

/// One demo worker and the proxies in front of its API server and its
/// PostgreSQL, so faults can target it alone.
struct Worker {
    process: Process,
    api: Proxy,
    pg: Proxy,
    metrics_port: u16,
    /// Counters of earlier lives of the process (before a SIGKILL).
    carried: BTreeMap<String, f64>,
    busy: bool,
}

const COUNTERS: [&str; 4] = [
    "batchlease_worker_fenced_commit_rejected_total",
    "batchlease_worker_refused_by_storage_total",
    "batchlease_worker_completion_rejected_total",
    "batchlease_worker_kill_switch_total",
];

async fn scrape(port: u16) -> BTreeMap<String, f64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut out = BTreeMap::new();
    let Ok(Ok(mut s)) = tokio::time::timeout(
        Duration::from_secs(2),
        tokio::net::TcpStream::connect(("127.0.0.1", port)),
    )
    .await
    else {
        return out;
    };
    let _ = s
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .await;
    let mut body = String::new();
    let _ = tokio::time::timeout(Duration::from_secs(2), s.read_to_string(&mut body)).await;
    for line in body.lines().filter(|l| !l.starts_with('#')) {
        let Some((name, value)) = line.rsplit_once(' ') else {
            continue;
        };
        if COUNTERS.iter().any(|c| name.starts_with(c))
            && let Ok(v) = value.parse::<f64>()
        {
            *out.entry(name.to_owned()).or_default() += v;
        }
    }
    out
}

fn add(into: &mut BTreeMap<String, f64>, from: &BTreeMap<String, f64>) {
    for (k, v) in from {
        *into.entry(k.clone()).or_default() += v;
    }
}

/// Runs the soak; the report lists violations (empty: the run proved the
/// invariants under these faults).
pub async fn run(cfg: &SoakConfig) -> anyhow::Result<SoakReport> {
    let started = Instant::now();
    eprintln!("soak: seed {} (replay with --seed={})", cfg.seed, cfg.seed);
    let mut rng = StdRng::seed_from_u64(cfg.seed);
    let cluster = Cluster::with_crds().await?;
    let mut ns = cluster.namespace("soak").await?;
    ns.tolerate_watch_errors();
    // The workers' kubeconfigs; removed when the run ends.
    let secrets = PrivateDir::new(&ns.name)?;

    let ops = Arc::new(Mutex::new(vec![
        Operator::start(&ns.name, "op-a")?,
        Operator::start(&ns.name, "op-b")?,
    ]));
    {
        let ops = ops.lock().await;
        Operator::wait_one_leading(&[&ops[0], &ops[1]], Duration::from_secs(60)).await?;
    }

    let pg_url = workers::pg_url()?;
    let pg_addr = pg_url
        .split('@')
        .nth(1)
        .and_then(|r| r.split('/').next())
        .context("host:port in BATCHLEASE_PG_URL")?
        .to_owned();
    let mut fleet = Vec::new();
    for i in 0..cfg.workers {
        let api = Proxy::start(apiserver_addr()?).await?;
        let pg = Proxy::start(pg_addr.clone()).await?;
        let port = crate::ports::free_port()?;
        let opts = WorkerOpts {
            queue: "soak".into(),
            slots: cfg.slots,
            drain_grace_seconds: 2,
            kubeconfig: Some(proxied_kubeconfig(&api, &secrets)?),
            metrics_port: Some(port),
            pg_url: Some(pg_url.replace(&pg_addr, &format!("127.0.0.1:{}", pg.port))),
            extra: Vec::new(),
            pod_name: None,
            env: vec![(
                "BATCHLEASE_RENEW_PER_WORKER".into(),
                if cfg.renew_per_worker { "1" } else { "0" }.into(),
            )],
        };
        fleet.push(Worker {
            process: workers::start(&ns.name, &format!("w{i}"), &opts)?,
            api,
            pg,
            metrics_port: port,
            carried: BTreeMap::new(),
            busy: false,
        });
    }
    let fleet = Arc::new(Mutex::new(fleet));

    // The task stream: a few in flight at a time, all created by the end.
    let tasks_api: kube::Api<BatchTask> = ns.api();
    let feeder = {
        let (api, n, ttl) = (tasks_api.clone(), cfg.tasks, cfg.ttl_seconds);
        tokio::spawn(async move {
            for i in 0..n {
                // Every tenth task nests deep; every tenth (another) spins
                // the CPU for 2·TTL without awaiting.
                let payload = match i % 10 {
                    3 => json!(null),
                    7 => json!({"steps": 1, "stepMillis": 1, "spinMillis": 2 * ttl * 1000}),
                    _ => json!({"steps": 4, "stepMillis": 250}),
                };
                let mut t: BatchTask = serde_json::from_value(json!({
                    "apiVersion": "batchlease.dev/v1alpha1", "kind": "BatchTask",
                    "metadata": {"name": format!("t{i:04}")},
                    "spec": {"queue": "soak", "leaseDurationSeconds": ttl, "maxRetries": 20,
                             "backoff": {"initialSeconds": 1, "maxSeconds": 2},
                             "payload": payload}
                }))
                .expect("a valid task");
                // Every fifth task takes one of two locks: handovers under
                // every fault, checked on the storage's occupancy.
                if i % 5 == 1 {
                    t.spec.resources = vec![LOCKS[(i / 5) % 2].to_owned()];
                }
                if i % 10 == 3 {
                    t.spec.payload = batchlease_api::JsonObject::from_text(deep_payload()).ok();
                }
                // Control-plane faults make creates fail for a while: retry.
                while api.create(&Default::default(), &t).await.is_err() {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                tokio::time::sleep(Duration::from_millis(400)).await;
            }
        })
    };

    let mut report = SoakReport {
        seed: cfg.seed,
        renew_per_worker: cfg.renew_per_worker,
        ..Default::default()
    };
    let total_weight: u32 = KINDS.iter().map(|(_, w)| w).sum();
    let ttl = Duration::from_secs(cfg.ttl_seconds);
    let control_plane = Arc::new(Mutex::new(()));
    let mut running = tokio::task::JoinSet::new();
    while report.faults.values().sum::<usize>() < cfg.faults {
        let pause = cfg.fault_every.mul_f64(rng.random_range(0.3..1.7));
        tokio::time::sleep(pause).await;
        let mut pick = rng.random_range(0..total_weight);
        let kind = KINDS
            .iter()
            .find(|(_, w)| {
                if pick < *w {
                    true
                } else {
                    pick -= w;
                    false
                }
            })
            .map_or(KINDS[0].0, |(k, _)| *k);
        let target = rng.random_range(0..cfg.workers);
        let extra = Duration::from_millis(rng.random_range(500..2500));
        let injected = match kind {
            "worker_sigstop_past_ttl"
            | "worker_sigkill"
            | "worker_api_partition"
            | "worker_postgres_held_past_ttl" => {
                let mut f = fleet.lock().await;
                if f[target].busy {
                    false
                } else {
                    f[target].busy = true;
                    if kind == "worker_sigkill" {
                        let seen = scrape(f[target].metrics_port).await;
                        add(&mut f[target].carried, &seen);
                    }
                    drop(f);
                    let fleet = fleet.clone();
                    running.spawn(async move {
                        worker_fault(&fleet, target, kind, ttl + extra).await;
                    });
                    true
                }
            }
            "tamper_lease_metadata" => {
                let (api, pick) = (ns.api::<TaskLease>(), rng.random::<u64>());
                running.spawn(async move {
                    if let Err(e) = tamper(&api, pick).await {
                        eprintln!("soak: tampering failed: {e:#}");
                    }
                });
                true
            }
            "forge_lease" => {
                let (leases, tasks, pick) = (
                    ns.api::<TaskLease>(),
                    tasks_api.clone(),
                    rng.random::<u64>(),
                );
                let n = report.faults.get(kind).copied().unwrap_or(0);
                running.spawn(async move {
                    if let Err(e) = forge(&leases, &tasks, pick, n).await {
                        eprintln!("soak: forging failed: {e:#}");
                    }
                });
                true
            }
            // Counted only when done (one quick write, awaited here):
            // nothing to pick, or a refusal during a control-plane fault,
            // draws again.
            "cancel_task" => match cancel(&tasks_api, rng.random::<u64>()).await {
                Ok(done) => done,
                Err(e) => {
                    eprintln!("soak: cancelling failed: {e:#}");
                    false
                }
            },
            "delete_worker_lease" if cfg.renew_per_worker => {
                match delete_worker_lease(&ns.api::<WorkerLease>(), rng.random::<u64>()).await {
                    Ok(done) => done,
                    Err(e) => {
                        eprintln!("soak: deleting a WorkerLease failed: {e:#}");
                        false
                    }
                }
            }
            "delete_worker_lease" => false,
            "leader_sigkill" => {
                let ops = ops.clone();
                running.spawn(async move {
                    let mut ops = ops.lock().await;
                    for op in ops.iter_mut() {
                        if op.metric("batchlease_is_leader").await.ok().flatten() == Some(1.0) {
                            op.kill();
                            let _ = op.restart();
                            break;
                        }
                    }
                });
                true
            }
            component => {
                let component = if component == "etcd_restart" {
                    "etcd"
                } else {
                    "kube-apiserver"
                };
                match control_plane.clone().try_lock_owned() {
                    Ok(guard) => {
                        running.spawn(async move {
                            let _guard = guard;
                            let r = tokio::task::spawn_blocking(move || {
                                controlplane::restart(component, Duration::ZERO)
                            })
                            .await;
                            if !matches!(r, Ok(Ok(()))) {
                                eprintln!("soak: restarting {component} failed: {r:?}");
                            }
                        });
                        true
                    }
                    Err(_) => false,
                }
            }
        };
        if injected {
            *report.faults.entry(kind).or_default() += 1;
            let n: usize = report.faults.values().sum();
            if n.is_multiple_of(10) {
                eprintln!("soak: {n} faults injected ({:.0?})", started.elapsed());
            }
        }
    }
    while running.join_next().await.is_some() {}
    // What had finished while the faults went on (asked again while a
    // control-plane fault may still refuse).
    let listed = wait_for(
        "the tasks, as the faults stop",
        Duration::from_secs(60),
        String::new,
        || {
            let api = tasks_api.clone();
            async move { Ok(Some(api.list(&Default::default()).await?.items)) }
        },
    )
    .await;
    report.finished_during_faults = listed
        .ok()
        .map(|all| ratio(all.iter().filter(|t| finished(t)).count(), all.len()));
    eprintln!("soak: faults done; waiting for every task to finish");
    feeder.await?;

    // Everything must finish once the faults stop.
    let finished = wait_for("every soak task to finish", cfg.drain, String::new, || {
        let api = tasks_api.clone();
        async move {
            let all = api.list(&Default::default()).await?;
            let done = all.items.iter().filter(|t| finished(t)).count();
            Ok((done == all.items.len()).then_some(all.items))
        }
    })
    .await;
    let items = match finished {
        Ok(items) => items,
        Err(e) => {
            report.violations.push(format!("{e:#}"));
            tasks_api.list(&Default::default()).await?.items
        }
    };
    report.succeeded = items
        .iter()
        .filter(|t| phase_of(t) == Some(TaskPhase::Succeeded))
        .count();
    report.dead_lettered = items
        .iter()
        .filter(|t| phase_of(t) == Some(TaskPhase::DeadLettered))
        .count();
    report.cancelled = items
        .iter()
        .filter(|t| phase_of(t) == Some(TaskPhase::Cancelled))
        .count();
    let leases = ns.api::<TaskLease>().list(&Default::default()).await?.items;
    report.bound = leases.iter().filter(|l| l.bound()).count();
    report.claimed = leases
        .iter()
        .filter(|l| !l.bound() && l.spec.holder_identity.is_some())
        .count();
    if items.len() != cfg.tasks {
        report
            .violations
            .push(format!("{} of {} tasks exist", items.len(), cfg.tasks));
    }
    let mut counters = BTreeMap::new();
    for w in fleet.lock().await.iter() {
        add(&mut counters, &w.carried);
        add(&mut counters, &scrape(w.metrics_port).await);
    }
    let sum = |prefix: &str| {
        counters
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(_, v)| v)
            .sum::<f64>()
    };
    report.refused_by_fence = sum(COUNTERS[0]);
    report.refused_by_postgres = sum(COUNTERS[1]);
    report.refused_by_api_server = sum(COUNTERS[2]);
    report.kill_switch = counters
        .iter()
        .filter(|(k, _)| k.starts_with(COUNTERS[3]))
        .map(|(k, v)| (k.trim_start_matches(COUNTERS[3]).to_owned(), *v))
        .collect();
    report.violations.extend(
        ns.violations(Checks {
            all_final: true,
            tolerate_watch_errors: true,
        })
        .await?,
    );
    report.elapsed = started.elapsed();
    // Leave the control plane as found (see `restart.rs`).
    let _ = tokio::task::spawn_blocking(|| {
        controlplane::restart("kube-controller-manager", Duration::ZERO)
    })
    .await;
    if report.violations.is_empty() {
        ns.cleanup().await?;
    }
    Ok(report)
}

/// Whether a soak task reached one of the ends its stream allows:
/// Succeeded, DeadLettered, or Cancelled (a Rejected one would be a bug
/// of the soak's own tasks, and stays unfinished).
fn finished(t: &BatchTask) -> bool {
    matches!(
        phase_of(t),
        Some(TaskPhase::Succeeded | TaskPhase::DeadLettered | TaskPhase::Cancelled)
    )
}

/// `n / of`, 1 when there is nothing to divide.
fn ratio(n: usize, of: usize) -> f64 {
    if of == 0 {
        return 1.0;
    }
    #[allow(clippy::cast_precision_loss)]
    let r = n as f64 / of as f64;
    r
}

/// One fault on worker `i`, lasting `dur` where it has a duration.
async fn worker_fault(fleet: &Mutex<Vec<Worker>>, i: usize, kind: &str, dur: Duration) {
    match kind {
        "worker_sigstop_past_ttl" => {
            let _ = fleet.lock().await[i].process.signal("STOP");
            tokio::time::sleep(dur).await;
            let _ = fleet.lock().await[i].process.signal("CONT");
        }
        "worker_sigkill" => {
            let mut f = fleet.lock().await;
            let _ = f[i].process.restart();
        }
        "worker_api_partition" => {
            fleet.lock().await[i].api.cut();
            tokio::time::sleep(dur).await;
            fleet.lock().await[i].api.restore();
        }
        _ => {
            // PostgreSQL packets sit in the network past the TTL, then
            // arrive: whatever they carry lands late.
            fleet.lock().await[i].pg.hold();
            tokio::time::sleep(dur).await;
            fleet.lock().await[i].pg.restore();
        }
    }
    fleet.lock().await[i].busy = false;
}
