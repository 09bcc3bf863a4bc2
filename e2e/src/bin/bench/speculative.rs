//! Speculative vs. exclusive transfers (issue 11): throughput, latency
//! and abort rates at low and high contention, balances checked.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use batchlease_api::{BatchTask, TaskMode, TaskPhase};
use batchlease_e2e::operator::Operator;
use batchlease_e2e::process::Process;
use batchlease_e2e::tasks::phase_of;
use batchlease_e2e::workers::{self, WorkerOpts};
use batchlease_e2e::{Cluster, pg};
use futures::{StreamExt, TryStreamExt};
use kube::ResourceExt;
use kube::api::PostParams;
use kube::runtime::{WatchStreamExt, watcher};
use rand::{Rng, SeedableRng};
use serde_json::json;
use tokio::time::Instant;

use crate::common::emit;

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
pub async fn speculative(
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
    let sample = |name: &str| {
        format!(
            "batchlease_speculative_{name}{{namespace=\"{}\",queue=\"demo\"}}",
            ns.name
        )
    };
    let metric = match (
        op.metric(&sample("attempts_total")).await?,
        op.metric(&sample("aborts_total")).await?,
    ) {
        (Some(attempts), aborts) => Some((
            attempts,
            aborts.unwrap_or(0.0),
            op.metric(&sample("abort_ratio")).await?,
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
