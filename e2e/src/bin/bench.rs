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
//!    1, 3 or 6 shared resources;
//! 6. speculative vs. exclusive transfers (issue 11): throughput, latency
//!    and abort rates at low contention (100 accounts) and high contention
//!    (every transfer touches one hot account), balances checked;
//! 7. failover: the holder of a task SIGSTOPped, the time until another
//!    worker holds it, from lease watch events (`bench/failover.rs`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

// Not `src/bin/failover.rs`: that would be a binary of its own.
#[path = "bench/failover.rs"]
mod failover;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use batchlease_api::{BatchTask, TaskMode, TaskPhase};
use batchlease_e2e::operator::Operator;
use batchlease_e2e::process::Process;
use batchlease_e2e::tasks::{phase_of, wait_phase};
use batchlease_e2e::workers::{self, WorkerOpts};
use batchlease_e2e::{Cluster, TestNamespace, api_requests, pg, wait_for};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::ResourceExt;
use kube::api::{Api, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use rand::{Rng, SeedableRng};
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
    let speculative_n = arg("speculative", 200);
    let failover_n = arg("failover", 20);
    let cluster = Cluster::with_crds().await?;
    let mut report = String::new();

    // 1. Raw API-server writes.
    let mut raw_rate = None;
    if raw_n > 0 {
        let ns = cluster.namespace("bench-raw").await?;
        let cms: Api<ConfigMap> = ns.api();
        let start = Instant::now();
        create_all(&cms, raw_n, conc, |i| {
            json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": format!("cm-{i:05}")}, "data": {"k": "v"}})
        })
        .await?;
        let rate = raw_n as f64 / start.elapsed().as_secs_f64();
        raw_rate = Some(rate);
        emit(
            &mut report,
            &format!(
                "raw API writes: {raw_n} ConfigMap creates, concurrency {conc}: {rate:.0} writes/s\n"
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
                crd_rate / rate
            ),
        );
        ns.cleanup().await?;
    }

    // 2. End-to-end task throughput.
    if tasks_n > 0 {
        let (task_rate, requests) = run_tasks_counted(
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
                "end-to-end: {tasks_n} tasks (operator + 2 demo workers × 8 slots + fenced PostgreSQL commit): {task_rate:.1} tasks/s\n"
            ),
        );
        // Beyond the user's create: the protocol's writes (tasks' status,
        // leases) and, apart, Events and the lock Leases.
        let (table, writes, conflicts) =
            api_requests::per_task(&requests, tasks_n, &["batchtasks", "taskleases"]);
        emit(
            &mut report,
            &format!(
                "API writes counted by the API server (apiserver_request_total), per task:\n{table}\
                 protocol writes per task (batchtasks + taskleases, the user's create included): {writes:.2}; \
                 409 conflicts per task: {conflicts:.2}\n"
            ),
        );
        if let Some(raw_rate) = raw_rate {
            emit(
                &mut report,
                &format!(
                    "ratio tasks/s ÷ raw writes/s: {:.3} (writes per task: counted above)\n",
                    task_rate / raw_rate
                ),
            );
        }
    }

    // 3. Scale: many idle tasks, one operator.
    if scale_n > 0 {
        let ns = cluster.namespace("bench-scale").await?;
        let op = Operator::start_with(&ns.name, "op", vec!["--events=important".into()])?;
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
    if speculative_n > 0 {
        speculative(&cluster, speculative_n, conc, &mut report).await?;
    }
    if failover_n > 0 {
        let v = failover::run(&cluster, failover_n).await?;
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        emit(
            &mut report,
            &format!(
                "failover ({failover_n} trials, TTL {} s; SIGSTOP of the holder → the task Held by the other worker, from lease watch events): p50 {:.0} ms, p95 {:.0} ms, max {:.0} ms; p95 ÷ TTL {:.2}\n",
                failover::TTL_SECONDS,
                ms(failover::quantile(&v, 0.5)),
                ms(failover::quantile(&v, 0.95)),
                ms(failover::quantile(&v, 1.0)),
                failover::quantile(&v, 0.95).as_secs_f64() / failover::TTL_SECONDS as f64,
            ),
        );
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
    Ok(run_tasks_counted(cluster, prefix, n, conc, spec).await?.0)
}

/// [`run_tasks`], also returning the requests the API server counted from
/// the first create to the last task seen `Succeeded` (cluster-wide: the
/// control plane's own leader elections are in it too, as rows of their
/// own).
async fn run_tasks_counted(
    cluster: &Cluster,
    prefix: &str,
    n: usize,
    conc: usize,
    spec: impl Fn(usize) -> serde_json::Value,
) -> anyhow::Result<(f64, api_requests::Counts)> {
    let ns = cluster.namespace(prefix).await?;
    let _db = pg::connect().await?;
    let op = Operator::start_with(&ns.name, "op", vec!["--events=important".into()])?;
    op.wait_leading(Duration::from_secs(60)).await?;
    let opts = WorkerOpts {
        slots: 8,
        ..Default::default()
    };
    let w1 = workers::start(&ns.name, "bench-w1", &opts)?;
    let w2 = workers::start(&ns.name, "bench-w2", &opts)?;
    let before = api_requests::snapshot()?;
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
    let requests = api_requests::delta(&before, &api_requests::snapshot()?);
    drop((w1, w2, op));
    ns.cleanup().await?;
    Ok((rate, requests))
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

/// Balance every account of the speculative phase opens with.
const SEED_BALANCE: i64 = 1000;
/// Every transfer's think time between its reads and its commit.
const THINK_MILLIS: u64 = 20;
/// No task reaching Succeeded for this long is a stuck run, not a slow one.
const STALL: Duration = Duration::from_secs(180);

/// The outbox the demo transfer sends its notices to (created here so the
/// workers do not race to create it, as `e2e/tests/speculative.rs` does).
const OUTBOX: &str = "CREATE TABLE IF NOT EXISTS demo_outbox (
    task_id text NOT NULL, token bigint NOT NULL, round integer NOT NULL,
    account text NOT NULL, amount bigint NOT NULL, cancelled integer NOT NULL DEFAULT 0,
    PRIMARY KEY (task_id, token, round, account))";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Contention {
    /// Each transfer between two of 100 accounts (seeded RNG).
    Low,
    /// Each transfer between the one hot account and an account of its
    /// own: every task shares exactly one key.
    Hot,
}

impl Contention {
    fn label(self) -> &'static str {
        match self {
            Self::Low => "100 keys",
            Self::Hot => "1 key",
        }
    }
}

/// The accounts of a configuration and its transfers (indexes into
/// `accounts`, amount).
struct Transfers {
    accounts: Vec<String>,
    moves: Vec<(usize, usize, i64)>,
}

/// The same transfers for both modes of a contention level.
fn transfers(contention: Contention, n: usize) -> Transfers {
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    match contention {
        Contention::Low => Transfers {
            accounts: (0..100).map(|i| format!("a{i:03}")).collect(),
            moves: (0..n)
                .map(|_| {
                    let from = rng.random_range(0..100);
                    let to = (from + rng.random_range(1..100)) % 100;
                    (from, to, rng.random_range(1..=50))
                })
                .collect(),
        },
        Contention::Hot => Transfers {
            accounts: std::iter::once("hot".to_owned())
                .chain((0..n).map(|i| format!("c{i:05}")))
                .collect(),
            // Alternating directions keep the hot balance near its seed.
            moves: (0..n)
                .map(|i| {
                    let amount = rng.random_range(1..=50);
                    if i % 2 == 0 {
                        (0, 1 + i, amount)
                    } else {
                        (1 + i, 0, amount)
                    }
                })
                .collect(),
        },
    }
}

/// What the bench's task watch saw: when each task was first seen
/// Succeeded, and tasks that ended otherwise.
#[derive(Default)]
struct Seen {
    succeeded: HashMap<String, Instant>,
    ended: Vec<String>,
}

/// What one configuration of the speculative phase measured.
struct SpecResult {
    mode: TaskMode,
    contention: Contention,
    rate: f64,
    span: Duration,
    /// From the first create request to the ⌈0.95·N⌉-th task seen
    /// Succeeded: the bulk, without the tail.
    bulk95: Duration,
    p50_ms: f64,
    p95_ms: f64,
    max_ms: f64,
    /// Tasks with at least one abort, and the p50 latency of those and of
    /// the others.
    aborted_tasks: usize,
    aborted_p50_ms: Option<f64>,
    clean_p50_ms: Option<f64>,
    aborts: i64,
    retries: i64,
    quarantined: usize,
    /// The operator's speculative attempts and aborts (counters) and its
    /// abort-rate gauge (last 100 attempts of the queue), if it saw any.
    metric: Option<(f64, f64, Option<f64>)>,
    accounts: usize,
}

impl SpecResult {
    /// Σ aborts / (Σ aborts + N): of all attempts that reached a commit
    /// (each task commits once), the share that lost its swap.
    fn abort_rate(&self, n: usize) -> f64 {
        self.aborts as f64 / (self.aborts as f64 + n as f64)
    }
}

/// A latency in ms, or "—" when there is none.
fn ms(x: Option<f64>) -> String {
    x.map_or_else(|| "—".to_owned(), |x| format!("{x:.0} ms"))
}

/// The nearest-rank percentile `p` (0..1] of sorted `xs`.
fn percentile(xs: &[f64], p: f64) -> f64 {
    let rank = (p * xs.len() as f64).ceil() as usize;
    xs[rank.clamp(1, xs.len()) - 1]
}

/// Speculative vs. Exclusive transfers (issue 11), 100 keys and 1 key,
/// each configuration in its own namespace with its own operator and three
/// demo workers × 2 slots, one after the other.
async fn speculative(
    cluster: &Cluster,
    n: usize,
    conc: usize,
    report: &mut String,
) -> anyhow::Result<()> {
    let mut results = Vec::new();
    for contention in [Contention::Low, Contention::Hot] {
        for mode in [TaskMode::Speculative, TaskMode::Exclusive] {
            let r = run_transfers(cluster, n, conc, mode, contention).await?;
            let metric = r.metric.map_or_else(
                || "none".to_owned(),
                |(attempts, aborts, window)| {
                    format!(
                        "{aborts:.0}/{attempts:.0} speculative attempts aborted, window {}",
                        window.map_or_else(|| "n/a".to_owned(), |w| format!("{w:.2}"))
                    )
                },
            );
            emit(
                report,
                &format!(
                    "transfers, {mode:?}, {}: {n} in {:.1} s ({:.1} s to 95 %): {:.1} tasks/s; latency p50 {:.0} ms, \
                     p95 {:.0} ms, max {:.0} ms; {} aborts ({:.1} % of attempts; operator: {metric}) in {} tasks \
                     (their p50 {}, the others' {}); {} quarantined; {} retries spent; balances checked ({} accounts)\n",
                    r.contention.label(),
                    r.span.as_secs_f64(),
                    r.bulk95.as_secs_f64(),
                    r.rate,
                    r.p50_ms,
                    r.p95_ms,
                    r.max_ms,
                    r.aborts,
                    100.0 * r.abort_rate(n),
                    r.aborted_tasks,
                    ms(r.aborted_p50_ms),
                    ms(r.clean_p50_ms),
                    r.quarantined,
                    r.retries,
                    r.accounts,
                ),
            );
            results.push(r);
        }
    }
    let mut table = format!(
        "\nspeculative vs. exclusive: {n} transfers per configuration, {THINK_MILLIS} ms think, 3 demo workers × 2 slots\n\
         | mode | contention | tasks/s | 95 % done after | p50 latency | p95 latency | max latency | aborts | abort rate Σaborts/(Σaborts+N) | operator: aborted/speculative attempts (window) | quarantined |\n\
         |---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|\n"
    );
    for r in &results {
        let metric = r.metric.map_or_else(
            || "—".to_owned(),
            |(attempts, aborts, window)| {
                format!(
                    "{aborts:.0}/{attempts:.0} ({})",
                    window.map_or_else(|| "n/a".to_owned(), |w| format!("{w:.2}"))
                )
            },
        );
        table.push_str(&format!(
            "| {:?} | {} | {:.1} | {:.1} s | {:.0} ms | {:.0} ms | {:.0} ms | {} | {:.1} % | {metric} | {} |\n",
            r.mode,
            r.contention.label(),
            r.rate,
            r.bulk95.as_secs_f64(),
            r.p50_ms,
            r.p95_ms,
            r.max_ms,
            r.aborts,
            100.0 * r.abort_rate(n),
            r.quarantined,
        ));
    }
    for contention in [Contention::Low, Contention::Hot] {
        let of = |mode| {
            results
                .iter()
                .find(|r| r.mode == mode && r.contention == contention)
        };
        if let (Some(s), Some(e)) = (of(TaskMode::Speculative), of(TaskMode::Exclusive)) {
            table.push_str(&format!(
                "{}: Speculative ÷ Exclusive throughput {:.2}× (to 95 % done {:.2}×), p50 latency {:.2}×, p95 latency {:.2}×\n",
                contention.label(),
                s.rate / e.rate,
                e.bulk95.as_secs_f64() / s.bulk95.as_secs_f64(),
                s.p50_ms / e.p50_ms,
                s.p95_ms / e.p95_ms,
            ));
        }
    }
    emit(report, &table);
    Ok(())
}

/// Runs `n` transfers in `mode` at `contention` to success: seeds the
/// accounts, creates every task at once (`conc` creates in flight) while a
/// watch records when each is first seen Succeeded, then checks every
/// balance and the recorded history. Retries spent are reported, not
/// refused: a quarantined attempt that loses its swap spends one by design.
async fn run_transfers(
    cluster: &Cluster,
    n: usize,
    conc: usize,
    mode: TaskMode,
    contention: Contention,
) -> anyhow::Result<SpecResult> {
    let prefix = format!(
        "bench-{}-{}",
        match mode {
            TaskMode::Speculative => "spec",
            TaskMode::Exclusive => "excl",
        },
        match contention {
            Contention::Low => "k100",
            Contention::Hot => "k1",
        }
    );
    let ns = cluster.namespace(&prefix).await?;
    let t = transfers(contention, n);
    // `versioned_state` is shared by every namespace: keys carry its name.
    let key = |a: &str| format!("{}/{a}", ns.name);
    let db = pg::connect().await?;
    db.batch_execute(OUTBOX).await?;
    for a in &t.accounts {
        db.execute(
            "INSERT INTO versioned_state (key, version, state) VALUES ($1, 1, $2)",
            &[
                &key(a),
                &tokio_postgres::types::Json(json!({"balance": SEED_BALANCE})),
            ],
        )
        .await?;
    }
    let op = Operator::start_with(&ns.name, "op", vec!["--events=important".into()])?;
    op.wait_leading(Duration::from_secs(60)).await?;
    let workers = (1..=3)
        .map(|i| workers::start(&ns.name, &format!("bench-w{i}"), &WorkerOpts::default()))
        .collect::<anyhow::Result<Vec<Process>>>()?;
    let wr: Vec<&Process> = workers.iter().collect();

    // When each task is first seen Succeeded (or ends otherwise), from a
    // watch started before the first create.
    let seen: Arc<Mutex<Seen>> = Arc::default();
    let (listed_tx, listed) = tokio::sync::oneshot::channel();
    let watch = tokio::spawn({
        let (seen, api) = (seen.clone(), ns.api::<BatchTask>());
        async move {
            let mut listed_tx = Some(listed_tx);
            let stream = watcher(api, watcher::Config::default())
                .backoff(batchlease_api::WatchBackoff::new(rand::random));
            futures::pin_mut!(stream);
            while let Some(ev) = stream.next().await {
                match ev {
                    Ok(watcher::Event::Apply(t) | watcher::Event::InitApply(t)) => {
                        let mut seen = seen.lock().unwrap();
                        match phase_of(&t) {
                            Some(TaskPhase::Succeeded) => {
                                seen.succeeded
                                    .entry(t.name_any())
                                    .or_insert_with(Instant::now);
                            }
                            Some(p) if p.is_terminal() => {
                                seen.ended.push(format!("{} {}", t.name_any(), p.as_str()));
                            }
                            _ => {}
                        }
                    }
                    Ok(watcher::Event::InitDone) => {
                        if let Some(tx) = listed_tx.take() {
                            let _ = tx.send(());
                        }
                    }
                    _ => {}
                }
            }
        }
    });
    tokio::time::timeout(Duration::from_secs(30), listed)
        .await
        .context("the bench's task watch did not list within 30 s")??;

    let mode_name = serde_json::to_value(mode)?;
    let api = ns.api::<BatchTask>();
    let created: HashMap<String, Instant> = futures::stream::iter(0..n)
        .map(|i| {
            let api = api.clone();
            let (from, to, amount) = t.moves[i];
            let (from, to) = (&t.accounts[from], &t.accounts[to]);
            let name = format!("t-{i:05}");
            let task = serde_json::from_value::<BatchTask>(json!({
                "apiVersion": "batchlease.dev/v1alpha1", "kind": "BatchTask",
                "metadata": {"name": name},
                "spec": {
                    "queue": "demo", "mode": mode_name, "resources": [from, to],
                    "payload": {"transfer": {"from": key(from), "to": key(to),
                                             "amount": amount, "thinkMillis": THINK_MILLIS}},
                },
            }));
            async move {
                let task = task?;
                let at = Instant::now();
                api.create(&PostParams::default(), &task)
                    .await
                    .context("create")?;
                Ok::<_, anyhow::Error>((name, at))
            }
        })
        .buffer_unordered(conc)
        .try_collect()
        .await?;

    // Wait for all; a task ending otherwise, or no progress for STALL, is a
    // product problem to report, not to wait out.
    let mut progress = (0, Instant::now());
    loop {
        let (done, ended) = {
            let seen = seen.lock().unwrap();
            (seen.succeeded.len(), seen.ended.clone())
        };
        if !ended.is_empty() {
            anyhow::bail!(
                "{}: transfers ended without success: {ended:?}\n{}\n{}",
                ns.name,
                ns.diagnostics(),
                op.logs_with(&wr)
            );
        }
        if done == n {
            break;
        }
        if done > progress.0 {
            progress = (done, Instant::now());
        } else if progress.1.elapsed() > STALL {
            anyhow::bail!(
                "{}: {done} of {n} transfers Succeeded, none more for {STALL:?}\n{}\n{}",
                ns.name,
                ns.diagnostics(),
                op.logs_with(&wr)
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    watch.abort();
    let done = std::mem::take(&mut seen.lock().unwrap().succeeded);
    let first = created.values().min().copied().context("no task")?;
    let last = done.values().max().copied().context("no task")?;
    let span = last - first;
    let mut finished: Vec<Instant> = done.values().copied().collect();
    finished.sort();
    let bulk95 = finished[(n * 95).div_ceil(100).clamp(1, n) - 1] - first;
    let latency = |name: &str| (done[name] - created[name]).as_secs_f64() * 1000.0;
    let mut latencies: Vec<f64> = created.keys().map(|name| latency(name)).collect();
    latencies.sort_by(f64::total_cmp);

    let all = api.list(&Default::default()).await?.items;
    let status = |t: &BatchTask| t.status.clone().unwrap_or_default();
    let (mut aborted_lat, mut clean_lat): (Vec<f64>, Vec<f64>) = (Vec::new(), Vec::new());
    for t in &all {
        let l = latency(&t.name_any());
        if status(t).aborts > 0 {
            aborted_lat.push(l);
        } else {
            clean_lat.push(l);
        }
    }
    let p50 = |mut xs: Vec<f64>| {
        xs.sort_by(f64::total_cmp);
        (!xs.is_empty()).then(|| percentile(&xs, 0.50))
    };
    let aborts: i64 = all.iter().map(|t| i64::from(status(t).aborts)).sum();
    let retries: i64 = all.iter().map(|t| i64::from(status(t).attempts)).sum();
    let quarantined = all
        .iter()
        .filter(|t| {
            t.spec.mode == TaskMode::Speculative
                && status(t).effective_mode == Some(TaskMode::Exclusive)
        })
        .count();
    let sample = |name: &str| format!("batchlease_speculative_{name}{{queue=\"demo\"}}");
    let metric = match (
        op.metric(&sample("attempts_total")).await?,
        op.metric(&sample("aborts_total")).await?,
    ) {
        (Some(attempts), aborts) => Some((
            attempts,
            aborts.unwrap_or(0.0),
            op.metric(&sample("abort_rate")).await?,
        )),
        (None, _) => None,
    };

    // Correctness: every transfer applied exactly once.
    let mut expected: HashMap<String, i64> =
        t.accounts.iter().map(|a| (key(a), SEED_BALANCE)).collect();
    for &(from, to, amount) in &t.moves {
        *expected.get_mut(&key(&t.accounts[from])).unwrap() -= amount;
        *expected.get_mut(&key(&t.accounts[to])).unwrap() += amount;
    }
    let keys: Vec<String> = expected.keys().cloned().collect();
    let rows = db
        .query(
            "SELECT key, version, (state->>'balance')::bigint FROM versioned_state WHERE key = ANY($1)",
            &[&keys],
        )
        .await?;
    let mut wrong = Vec::new();
    let (mut total, mut bumps) = (0i64, 0i64);
    for r in &rows {
        let (k, version, balance): (String, i64, i64) = (r.get(0), r.get(1), r.get(2));
        total += balance;
        bumps += version - 1;
        if expected[&k] != balance {
            wrong.push(format!("{k}: {balance}, expected {}", expected[&k]));
        }
    }
    let accounts = t.accounts.len();
    if rows.len() != accounts
        || !wrong.is_empty()
        || total != accounts as i64 * SEED_BALANCE
        || bumps != 2 * n as i64
    {
        anyhow::bail!(
            "{}: wrong result: {} of {accounts} accounts, Σ balance {total} (seeded {}), \
             {bumps} version bumps for {n} transfers; {wrong:?}",
            ns.name,
            rows.len(),
            accounts as i64 * SEED_BALANCE
        );
    }
    drop(workers);
    drop(op);
    // The recorded history: the protocol's invariants, and every
    // compensation of a round that did not commit ran (none that did).
    ns.finish().await?;
    Ok(SpecResult {
        mode,
        contention,
        rate: n as f64 / span.as_secs_f64(),
        span,
        bulk95,
        p50_ms: percentile(&latencies, 0.50),
        p95_ms: percentile(&latencies, 0.95),
        max_ms: latencies[n - 1],
        aborted_tasks: aborted_lat.len(),
        aborted_p50_ms: p50(aborted_lat),
        clean_p50_ms: p50(clean_lat),
        aborts,
        retries,
        quarantined,
        metric,
        accounts,
    })
}

/// Prints a result line as soon as it is known, and keeps it for the summary.
fn emit(report: &mut String, line: &str) {
    print!("{line}");
    report.push_str(line);
}
