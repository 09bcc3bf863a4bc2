//! Speculative mode (design §6) against a real control plane, the
//! operator, demo workers and PostgreSQL: transfers between hot accounts
//! with compare-and-swap commits, compensations of every lost round, the
//! quarantine to Exclusive, and a zombie that can neither win a swap nor
//! leave its undo half-run.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::time::Duration;

use batchlease_api::{BatchTask, TaskMode, TaskPhase};
use batchlease_e2e::operator::Operator;
use batchlease_e2e::process::Process;
use batchlease_e2e::tasks::{self, event_reasons, wait_phase};
use batchlease_e2e::workers::{self, WorkerOpts};
use batchlease_e2e::{TestNamespace, pg, wait_for};
use kube::ResourceExt;
use rand::{Rng, SeedableRng};
use serde_json::json;

const T: Duration = Duration::from_secs(120);
const SEED_BALANCE: i64 = 1000;

async fn setup(prefix: &str) -> (TestNamespace, Operator) {
    Operator::in_new_namespace(prefix, "op", T).await.unwrap()
}

fn start_workers(ns: &TestNamespace, n: usize, slots: usize) -> Vec<Process> {
    workers::start_n(&ns.name, n, slots).unwrap()
}

fn logs(op: &Operator, w: &[&Process]) -> String {
    op.logs_with(w)
}

/// The key of account `name` in `versioned_state` (the table is shared by
/// every test: keys carry the namespace).
fn key(ns: &TestNamespace, name: &str) -> String {
    format!("{}/{name}", ns.name)
}

/// Opens `accounts` with [`SEED_BALANCE`] each, at version 1.
async fn open_accounts(ns: &TestNamespace, accounts: &[&str]) {
    let db = pg::connect().await.unwrap();
    db.batch_execute(
        "CREATE TABLE IF NOT EXISTS demo_outbox (
            task_id text NOT NULL, token bigint NOT NULL, round integer NOT NULL,
            account text NOT NULL, amount bigint NOT NULL, cancelled integer NOT NULL DEFAULT 0,
            PRIMARY KEY (task_id, token, round, account))",
    )
    .await
    .unwrap();
    for a in accounts {
        db.execute(
            "INSERT INTO versioned_state (key, version, state) VALUES ($1, 1, $2)",
            &[
                &key(ns, a),
                &tokio_postgres::types::Json(json!({"balance": SEED_BALANCE})),
            ],
        )
        .await
        .unwrap();
    }
}

/// Version and balance of each account.
async fn balances(ns: &TestNamespace, accounts: &[&str]) -> BTreeMap<String, (i64, i64)> {
    let db = pg::connect().await.unwrap();
    let mut out = BTreeMap::new();
    for a in accounts {
        let r = db
            .query_one(
                "SELECT version, (state->>'balance')::bigint FROM versioned_state WHERE key = $1",
                &[&key(ns, a)],
            )
            .await
            .unwrap();
        out.insert((*a).to_owned(), (r.get(0), r.get(1)));
    }
    out
}

/// A speculative transfer task (resources = its accounts, so the
/// quarantine takes their locks).
fn transfer(
    ns: &TestNamespace,
    from: &str,
    to: &str,
    amount: i64,
    think_ms: u64,
    max_aborts: i32,
) -> serde_json::Value {
    json!({
        "queue": "demo", "mode": "Speculative", "maxSpeculativeAborts": max_aborts,
        "resources": [from, to],
        "backoff": {"initialSeconds": 1, "maxSeconds": 2},
        "payload": {"transfer": {"from": key(ns, from), "to": key(ns, to),
                                 "amount": amount, "thinkMillis": think_ms}},
    })
}

/// Notices of the namespace's tasks: (task UID, token, round) → cancelled
/// count, and the (task UID, token, round) whose compensations were KEPT
/// (the committed rounds).
#[allow(clippy::type_complexity)]
async fn notices(
    uids: &[String],
) -> (
    BTreeMap<(String, i64, i32), i32>,
    std::collections::BTreeSet<(String, i64, i32)>,
) {
    let db = pg::connect().await.unwrap();
    let sent = db
        .query(
            "SELECT task_id, token, round, cancelled FROM demo_outbox WHERE task_id = ANY($1)",
            &[&uids],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| ((r.get(0), r.get(1), r.get(2)), r.get(3)))
        .collect();
    let kept = db
        .query(
            "SELECT DISTINCT task_id, token, round FROM compensation_log
              WHERE task_id = ANY($1) AND status = 'KEPT'",
            &[&uids],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    (sent, kept)
}

/// Every notice of a committed round stands; every other one was
/// cancelled exactly once.
fn check_notices(
    sent: &BTreeMap<(String, i64, i32), i32>,
    kept: &std::collections::BTreeSet<(String, i64, i32)>,
) -> (usize, usize) {
    let mut cancelled = 0;
    for (round, n) in sent {
        let want = if kept.contains(round) { 0 } else { 1 };
        assert_eq!(
            *n,
            want,
            "notice of {round:?} cancelled {n} times (committed round: {})",
            kept.contains(round)
        );
        cancelled += usize::try_from(*n).unwrap();
    }
    (sent.len(), cancelled)
}

#[tokio::test]
async fn two_hundred_transfers_over_five_hot_accounts_lose_nothing() {
    let (ns, op) = setup("spec-transfers").await;
    const ACCOUNTS: [&str; 5] = ["a0", "a1", "a2", "a3", "a4"];
    open_accounts(&ns, &ACCOUNTS).await;
    let w = start_workers(&ns, 3, 2);
    let wr: Vec<&Process> = w.iter().collect();
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let mut expected: BTreeMap<String, i64> = ACCOUNTS
        .iter()
        .map(|a| ((*a).to_owned(), SEED_BALANCE))
        .collect();
    let api = ns.api::<BatchTask>();
    for i in 0..200 {
        let from = rng.random_range(0..5);
        let to = (from + rng.random_range(1..5)) % 5;
        let amount = rng.random_range(1..=50);
        *expected.get_mut(ACCOUNTS[from]).unwrap() -= amount;
        *expected.get_mut(ACCOUNTS[to]).unwrap() += amount;
        tasks::create(
            &ns,
            &format!("t{i:03}"),
            transfer(&ns, ACCOUNTS[from], ACCOUNTS[to], amount, 20, 3),
        )
        .await
        .unwrap();
    }
    wait_for(
        "all 200 transfers Succeeded",
        Duration::from_secs(400),
        || logs(&op, &wr),
        || {
            let api = api.clone();
            async move {
                let list = api.list(&Default::default()).await?;
                Ok(list
                    .iter()
                    .all(|t| tasks::phase_of(t) == Some(TaskPhase::Succeeded))
                    .then_some(()))
            }
        },
    )
    .await
    .unwrap();
    let all = api.list(&Default::default()).await.unwrap().items;
    // Nothing lost or doubled: each transfer applied exactly once.
    let got = balances(&ns, &ACCOUNTS).await;
    for a in ACCOUNTS {
        assert_eq!(got[a].1, expected[a], "balance of {a}: {got:?}");
    }
    let total: i64 = got.values().map(|(_, b)| b).sum();
    assert_eq!(total, 5 * SEED_BALANCE, "money is conserved");
    // Every committed swap bumped both its keys once: 200 commits × 2 keys.
    let versions: i64 = got.values().map(|(v, _)| v - 1).sum();
    assert_eq!(versions, 400, "{got:?}");
    // Aborts spent no retry; count them and the quarantined tasks.
    let aborts: i32 = all.iter().map(|t| t.status.as_ref().unwrap().aborts).sum();
    let quarantined = all
        .iter()
        .filter(|t| t.status.as_ref().unwrap().effective_mode == Some(TaskMode::Exclusive))
        .count();
    for t in &all {
        assert_eq!(
            t.status.as_ref().unwrap().attempts,
            0,
            "{}: an abort must not spend a retry",
            t.name_any()
        );
    }
    assert!(
        aborts > 0,
        "five hot accounts, six slots: some swaps must lose"
    );
    // Every compensation of a round that did not commit ran exactly once,
    // none of a committed one (the history check below checks the log).
    let uids: Vec<String> = all.iter().map(|t| t.uid().unwrap()).collect();
    let (sent, kept) = notices(&uids).await;
    assert_eq!(kept.len(), 200, "one committed round per task");
    let (rounds, cancelled) = check_notices(&sent, &kept);
    // The abort rate, as the operator reports it.
    let attempts_m = op
        .metric(&format!(
            "batchlease_speculative_attempts_total{{namespace=\"{}\",queue=\"demo\"}}",
            ns.name
        ))
        .await
        .unwrap()
        .unwrap_or(0.0);
    let aborts_m = op
        .metric(&format!(
            "batchlease_speculative_aborts_total{{namespace=\"{}\",queue=\"demo\"}}",
            ns.name
        ))
        .await
        .unwrap()
        .unwrap_or(0.0);
    let rate = op
        .metric(&format!(
            "batchlease_speculative_abort_ratio{{namespace=\"{}\",queue=\"demo\"}}",
            ns.name
        ))
        .await
        .unwrap();
    assert!(
        attempts_m >= 1.0 && aborts_m >= 1.0,
        "{attempts_m} {aborts_m}"
    );
    assert!(
        aborts_m <= f64::from(aborts),
        "metric {aborts_m} > status total {aborts}"
    );
    assert!(rate.is_some_and(|r| (0.0..=1.0).contains(&r)), "{rate:?}");
    let with_cond = all
        .iter()
        .filter(|t| {
            t.status.as_ref().unwrap().conditions.iter().any(|c| {
                c.type_ == batchlease_api::keys::condition::SPECULATION_HEALTHY
                    && c.message.contains("speculative attempts aborted")
            })
        })
        .count();
    assert!(with_cond > 0, "the abort rate is shown on the tasks");
    eprintln!(
        "200 transfers: {aborts} aborts, {quarantined} quarantined to Exclusive, {rounds} rounds \
         sent notices, {cancelled} cancelled; operator: {aborts_m}/{attempts_m} speculative \
         attempts aborted, window rate {rate:?}"
    );
    drop(w);
    ns.finish().await.unwrap();
}

#[tokio::test]
async fn an_extremely_hot_key_falls_back_to_exclusive_and_everything_finishes() {
    let (ns, op) = setup("spec-hot").await;
    const ACCOUNTS: [&str; 4] = ["hot", "c1", "c2", "c3"];
    open_accounts(&ns, &ACCOUNTS).await;
    let w = start_workers(&ns, 3, 2);
    let wr: Vec<&Process> = w.iter().collect();
    // Every task moves 1 out of "hot", thinking 300 ms between its read and
    // its commit: six at once on one key, five of them lose each round.
    for i in 0..24 {
        tasks::create(
            &ns,
            &format!("h{i:02}"),
            transfer(&ns, "hot", ACCOUNTS[1 + i % 3], 1, 300, 2),
        )
        .await
        .unwrap();
    }
    for i in 0..24 {
        wait_phase(&ns, &format!("h{i:02}"), TaskPhase::Succeeded, T, || {
            logs(&op, &wr)
        })
        .await
        .unwrap();
    }
    let all = ns
        .api::<BatchTask>()
        .list(&Default::default())
        .await
        .unwrap()
        .items;
    let quarantined: Vec<&BatchTask> = all
        .iter()
        .filter(|t| t.status.as_ref().unwrap().effective_mode == Some(TaskMode::Exclusive))
        .collect();
    assert!(
        !quarantined.is_empty(),
        "some tasks must have fallen back to Exclusive"
    );
    for t in &quarantined {
        let st = t.status.as_ref().unwrap();
        assert!(
            st.aborts >= 2,
            "{}: quarantined after {} aborts",
            t.name_any(),
            st.aborts
        );
        assert_eq!(st.attempts, 0, "{}: no retry spent", t.name_any());
        // Its last attempt held the locks of its accounts.
        let lease = ns
            .api::<batchlease_api::TaskLease>()
            .get(st.current_lease.as_deref().unwrap())
            .await
            .unwrap();
        assert!(
            lease.spec.resource_tokens.contains_key("hot"),
            "{}: the quarantine takes the lock: {:?}",
            t.name_any(),
            lease.spec.resource_tokens
        );
    }
    let reasons = event_reasons(&ns, &quarantined[0].name_any())
        .await
        .unwrap();
    assert!(reasons.iter().any(|r| r == "Aborted"), "{reasons:?}");
    let got = balances(&ns, &ACCOUNTS).await;
    assert_eq!(got["hot"].1, SEED_BALANCE - 24, "{got:?}");
    let total: i64 = got.values().map(|(_, b)| b).sum();
    assert_eq!(total, 4 * SEED_BALANCE);
    eprintln!(
        "hot key: {} of 24 quarantined; aborts per task {:?}",
        quarantined.len(),
        all.iter()
            .map(|t| t.status.as_ref().unwrap().aborts)
            .collect::<Vec<_>>()
    );
    drop(w);
    ns.finish().await.unwrap();
}

#[tokio::test]
async fn a_zombie_speculative_worker_neither_wins_the_swap_nor_leaves_its_undo_half_run() {
    let (ns, op) = setup("spec-zombie").await;
    open_accounts(&ns, &["x", "y"]).await;
    let opts = WorkerOpts {
        slots: 1,
        ..Default::default()
    };
    let zombie = workers::start(&ns.name, "zombie", &opts).unwrap();
    // A long think between the notice and the commit: the pause lands
    // there, after the side effect, before the swap.
    let mut spec = transfer(&ns, "x", "y", 10, 4000, 3);
    spec["leaseDurationSeconds"] = json!(5);
    tasks::create(&ns, "pay", spec).await.unwrap();
    let uid = tasks::uid(&ns, "pay").await.unwrap();
    let db = pg::connect().await.unwrap();
    wait_for(
        "the zombie sent its notice",
        T,
        || op.logs_with(&[&zombie]),
        || {
            let (db, uid) = (&db, uid.clone());
            async move {
                let n: i64 = db
                    .query_one(
                        "SELECT count(*) FROM demo_outbox WHERE task_id = $1",
                        &[&uid],
                    )
                    .await?
                    .get(0);
                Ok((n > 0).then_some(()))
            }
        },
    )
    .await
    .unwrap();
    zombie.signal("STOP").unwrap();
    // Its lease expires; another worker runs the transfer.
    let other = workers::start(&ns.name, "other", &opts).unwrap();
    let done = wait_phase(&ns, "pay", TaskPhase::Succeeded, T, || {
        op.logs_with(&[&zombie, &other])
    })
    .await
    .unwrap();
    let st = done.status.as_ref().unwrap();
    assert_eq!(st.history.last().unwrap().holder.as_deref(), Some("other"));
    // The zombie wakes: its kill switch fires, its commit (if it gets
    // that far) is refused, and its undo runs to the end.
    zombie.signal("CONT").unwrap();
    wait_for(
        "the zombie's compensation ran",
        T,
        || op.logs_with(&[&zombie, &other]),
        || {
            let (db, uid) = (&db, uid.clone());
            async move {
                let rows = db
                    .query(
                        "SELECT status FROM compensation_log WHERE task_id = $1 AND token = 1",
                        &[&uid],
                    )
                    .await?;
                let st: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
                Ok((!st.is_empty() && st.iter().all(|s| s == "RAN")).then_some(st))
            }
        },
    )
    .await
    .unwrap();
    let got = balances(&ns, &["x", "y"]).await;
    assert_eq!(
        got["x"],
        (2, SEED_BALANCE - 10),
        "one swap, by the successor"
    );
    assert_eq!(got["y"], (2, SEED_BALANCE + 10));
    let (sent, kept) = notices(std::slice::from_ref(&uid)).await;
    assert_eq!(kept.len(), 1);
    assert!(kept.iter().all(|(_, token, _)| *token > 1), "{kept:?}");
    check_notices(&sent, &kept);
    assert!(
        sent.keys().any(|(_, token, _)| *token == 1),
        "the zombie's notice was sent"
    );
    let zlog = zombie.log_text();
    assert!(zlog.contains("kill switch fired"), "{zlog}");
    drop((zombie, other));
    ns.finish().await.unwrap();
}
