//! The storage fence as SQL, called the way a client that is not the Rust
//! store calls it — in its own transaction, from its own connection, and
//! from `psql` in a shell — against a real PostgreSQL with the SDK's
//! migration (`worker-sdk/src/postgres/fence.sql`).
//!
//! The attempt registers through the Rust store (what a worker runner
//! does before it starts the client), which records the attempt's
//! deadline on the server's clock; `batchlease_fence(uid, token)` then
//! refuses a token that is not the registered one, a deadline that passed,
//! and — at COMMIT — a transaction that outlived its deadline. Each case
//! writes a side effect in the fenced transaction, so what stuck is
//! counted.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::time::Duration;

use batchlease_e2e::{pg, wait_for, workers};
use batchlease_worker_sdk::postgres::FencedStore;
use batchlease_worker_sdk::{Error, Fence, KillClock, WorkerMetrics};
use rand::Rng;
use tokio::time::Instant;
use tokio_postgres::Client;

static EFFECTS: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();

async fn setup() -> (Client, String) {
    let db = pg::connect().await.unwrap();
    EFFECTS
        .get_or_try_init(|| {
            db.batch_execute(
                "CREATE TABLE IF NOT EXISTS sql_effects (task_id text NOT NULL, token bigint NOT NULL)",
            )
        })
        .await
        .unwrap();
    let uid = format!("uid-{:012x}", rand::rng().random::<u64>() >> 16);
    (db, uid)
}

fn fence(token: i64, ttl: Duration) -> Fence {
    Fence::new(token, KillClock::new(ttl, Instant::now(), None))
}

async fn register(uid: &str, fence: &Fence) {
    let mut store = FencedStore::new(pg::connect().await.unwrap(), WorkerMetrics::default());
    store.register(fence, uid).await.unwrap();
}

/// A client's fenced transaction: the fence, one side effect, COMMIT.
/// Returns the SQLSTATE and message of a refusal.
async fn fenced_write(
    uid: &str,
    token: i64,
    deadline: Option<&str>,
) -> Result<(), (String, String)> {
    let c = pg::connect().await.unwrap();
    let fence = match deadline {
        None => format!("SELECT batchlease_fence('{uid}', {token})"),
        Some(d) => format!("SELECT batchlease_fence('{uid}', {token}, {d})"),
    };
    let sql = format!("BEGIN; {fence}; INSERT INTO sql_effects VALUES ('{uid}', {token}); COMMIT");
    c.batch_execute(&sql).await.map_err(|e| {
        let db = e.as_db_error().expect("a database error");
        (db.code().code().to_owned(), db.message().to_owned())
    })
}

async fn effects(db: &Client, uid: &str) -> Vec<i64> {
    db.query(
        "SELECT token FROM sql_effects WHERE task_id = $1 ORDER BY token",
        &[&uid],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| r.get(0))
    .collect()
}

#[tokio::test]
async fn a_client_transaction_is_fenced_by_the_registered_token() {
    let (db, uid) = setup().await;
    let ttl = Duration::from_secs(60);
    register(&uid, &fence(1, ttl)).await;
    fenced_write(&uid, 1, None).await.unwrap();
    // Several fenced transactions of one live attempt are fine.
    fenced_write(&uid, 1, None).await.unwrap();
    assert_eq!(effects(&db, &uid).await, [1, 1]);

    // A successor registers: the zombie's fenced write is refused, naming
    // the newer token, and leaves nothing behind.
    register(&uid, &fence(2, ttl)).await;
    let (code, message) = fenced_write(&uid, 1, None).await.unwrap_err();
    assert_eq!(code, "LF001", "{message}");
    assert!(message.contains("attempt 2 registered"), "{message}");
    // A token that never registered is refused too.
    let (code, message) = fenced_write(&uid, 3, None).await.unwrap_err();
    assert_eq!(code, "LF003", "{message}");
    assert!(message.contains("not registered"), "{message}");
    let (code, _) = fenced_write("uid-never-registered", 1, None)
        .await
        .unwrap_err();
    assert_eq!(code, "LF003");
    fenced_write(&uid, 2, None).await.unwrap();
    assert_eq!(effects(&db, &uid).await, [1, 1, 2]);
}

/// The server's clock has reached `deadline` of the task's row.
async fn past_recorded_deadline(db: &Client, uid: &str) {
    wait_for(
        "the server's clock past the recorded deadline",
        Duration::from_secs(30),
        String::new,
        || async {
            let past: bool = db
                .query_one(
                    "SELECT clock_timestamp() >= deadline FROM task_state WHERE task_id = $1",
                    &[&uid],
                )
                .await?
                .get(0);
            Ok(past.then_some(()))
        },
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn the_recorded_deadline_refuses_late_writes_until_a_renewal_extends_it() {
    let (db, uid) = setup().await;
    // A 3 s TTL: the kill instant 2 s from now, the deadline half a second
    // (the clock margin) before it, on the server's clock.
    let ttl = Duration::from_secs(3);
    register(&uid, &fence(1, ttl)).await;
    fenced_write(&uid, 1, None).await.unwrap();
    past_recorded_deadline(&db, &uid).await;
    let (code, message) = fenced_write(&uid, 1, None).await.unwrap_err();
    assert_eq!(code, "LF002", "{message}");

    // A renewal (a new kill clock for the same token) extends it: the
    // store's `extend` moves the recorded deadline forward.
    let renewed = fence(1, Duration::from_secs(60));
    let mut store = FencedStore::new(pg::connect().await.unwrap(), WorkerMetrics::default());
    store.extend(&renewed, &uid).await.unwrap();
    fenced_write(&uid, 1, None).await.unwrap();
    assert_eq!(effects(&db, &uid).await, [1, 1]);

    // Extending a token that a successor replaced is refused, typed.
    register(&uid, &fence(2, Duration::from_secs(60))).await;
    let err = store.extend(&renewed, &uid).await.unwrap_err();
    assert!(
        matches!(
            err,
            Error::Fenced {
                token: 1,
                current: 2
            }
        ),
        "{err:?}"
    );
}

#[tokio::test]
async fn a_commit_that_arrives_after_the_deadline_is_refused_at_commit() {
    let (db, uid) = setup().await;
    register(&uid, &fence(1, Duration::from_secs(60))).await;
    // The client passes a deadline of its own (what an SDK that put its
    // kill instant on the server's clock does): 300 ms from now.
    let c = pg::connect().await.unwrap();
    c.batch_execute(&format!(
        "BEGIN; SELECT batchlease_fence('{uid}', 1, clock_timestamp() + interval '300 ms');
         INSERT INTO sql_effects VALUES ('{uid}', 1)"
    ))
    .await
    .unwrap();
    let deadline: f64 = c
        .query_one("SELECT current_setting('batchlease.deadline')::float8", &[])
        .await
        .unwrap()
        .get(0);
    // The transaction sits (a paused client, packets in the network)
    // until the server's clock passed the deadline; then COMMIT.
    wait_for(
        "the server's clock past the deadline",
        Duration::from_secs(30),
        String::new,
        || async {
            let now: f64 = db
                .query_one("SELECT extract(epoch FROM clock_timestamp())::float8", &[])
                .await?
                .get(0);
            Ok((now >= deadline).then_some(()))
        },
    )
    .await
    .unwrap();
    let err = c.batch_execute("COMMIT").await.unwrap_err();
    let db_err = err.as_db_error().expect("refused by the server");
    assert_eq!(db_err.code().code(), "LF002", "{db_err:?}");
    assert!(
        effects(&db, &uid).await.is_empty(),
        "the effect rolled back"
    );
}

#[tokio::test]
async fn psql_in_a_shell_fences_its_write() {
    let (db, uid) = setup().await;
    let ttl = Duration::from_secs(60);
    register(&uid, &fence(1, ttl)).await;
    let url = workers::pg_url().unwrap();
    // What a shell task runs, with the runner's environment.
    let script = r#"psql "$DATABASE_URL" -X -q -v ON_ERROR_STOP=1 \
        -v uid="$BATCHLEASE_TASK_UID" -v token="$BATCHLEASE_FENCING_TOKEN" <<'SQL'
BEGIN;
SELECT batchlease_fence(:'uid', :token);
INSERT INTO sql_effects VALUES (:'uid', :token);
COMMIT;
SQL"#;
    let run = |token: i64| {
        Command::new("bash")
            .args(["-c", script])
            .env("DATABASE_URL", &url)
            .env("BATCHLEASE_TASK_UID", &uid)
            .env("BATCHLEASE_FENCING_TOKEN", token.to_string())
            .output()
            .unwrap()
    };
    let ok = run(1);
    assert!(ok.status.success(), "{ok:?}");
    register(&uid, &fence(2, ttl)).await;
    let stale = run(1);
    assert_eq!(
        stale.status.code(),
        Some(3),
        "psql's ON_ERROR_STOP exit: {stale:?}"
    );
    let stderr = String::from_utf8_lossy(&stale.stderr);
    assert!(
        stderr.contains("is fenced: attempt 2 registered"),
        "{stderr}"
    );
    assert_eq!(effects(&db, &uid).await, [1]);
}

#[tokio::test]
async fn a_successor_registers_after_the_zombies_open_transaction_ends() {
    let (db, uid) = setup().await;
    let ttl = Duration::from_secs(60);
    register(&uid, &fence(1, ttl)).await;
    // The zombie's fenced transaction holds the task's row.
    let zombie = pg::connect().await.unwrap();
    zombie
        .batch_execute(&format!(
            "BEGIN; SELECT batchlease_fence('{uid}', 1); INSERT INTO sql_effects VALUES ('{uid}', 1)"
        ))
        .await
        .unwrap();
    // The successor's registration waits for that row lock.
    let successor = {
        let uid = uid.clone();
        tokio::spawn(async move {
            let mut store =
                FencedStore::new(pg::connect().await.unwrap(), WorkerMetrics::default());
            store.register(&fence(2, ttl), &uid).await
        })
    };
    wait_for(
        "the registration waiting for the zombie's row lock",
        Duration::from_secs(30),
        String::new,
        || async {
            let waiting: i64 = db
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity
                      WHERE wait_event_type = 'Lock' AND query LIKE '%batchlease_register%'",
                    &[],
                )
                .await?
                .get(0);
            Ok((waiting > 0).then_some(()))
        },
    )
    .await
    .unwrap();
    assert!(!successor.is_finished());
    // The zombie commits in time: its write is ordered before the
    // successor's registration, which then goes through.
    zombie.batch_execute("COMMIT").await.unwrap();
    successor.await.unwrap().unwrap();
    let (code, _) = fenced_write(&uid, 1, None).await.unwrap_err();
    assert_eq!(code, "LF001");
    assert_eq!(effects(&db, &uid).await, [1]);
}

#[tokio::test]
async fn extend_does_not_queue_behind_the_attempts_own_open_transaction() {
    let (_db, uid) = setup().await;
    let ttl = Duration::from_secs(6);
    let f = fence(1, ttl);
    register(&uid, &f).await;
    let own = pg::connect().await.unwrap();
    own.batch_execute(&format!("BEGIN; SELECT batchlease_fence('{uid}', 1)"))
        .await
        .unwrap();
    let mut store = FencedStore::new(pg::connect().await.unwrap(), WorkerMetrics::default());
    // A short lock wait (TTL/12, at most 1 s), then an error to retry —
    // not a connection pinned for the TTL/3 of a registration's wait.
    let started = Instant::now();
    let err = store.extend(&f, &uid).await.unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert!(matches!(err, Error::Postgres { .. }), "{err:?}");
    own.batch_execute("COMMIT").await.unwrap();
    store.extend(&f, &uid).await.unwrap();
}

#[tokio::test]
async fn the_fence_never_loosens_a_limit_the_client_set() {
    let (_db, uid) = setup().await;
    register(&uid, &fence(1, Duration::from_secs(60))).await;
    let c = pg::connect().await.unwrap();
    c.batch_execute(&format!(
        "SET statement_timeout = 1234; SET lock_timeout = 0;
         BEGIN; SELECT batchlease_fence('{uid}', 1)"
    ))
    .await
    .unwrap();
    let show = |name: &'static str| {
        let c = &c;
        async move {
            c.query_one(&format!("SHOW {name}"), &[])
                .await
                .unwrap()
                .get::<_, String>(0)
        }
    };
    // Stricter than the fence's (the deadline is a minute away): kept.
    assert_eq!(show("statement_timeout").await, "1234ms");
    // None set: the fence's TTL/3.
    assert_eq!(show("lock_timeout").await, "20s");
    c.batch_execute("ROLLBACK").await.unwrap();
}
