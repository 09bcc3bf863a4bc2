//! The fenced PostgreSQL store against a real PostgreSQL, driven through
//! the interleavings that matter (design §4): a holder paused between its
//! fence check and its write, a commit that lands before the successor
//! registered, a paused holder of the row lock, rolled-back user writes.
//!
//! The same store behind a pool ([`FencedPool`]): slots commit at once, a
//! broken connection is replaced, a cancelled write leaves nothing behind
//! on the connection the next slot gets.
//!
//! Each case writes a side effect (`effects`) in the same transaction as
//! the fenced commit, so "exactly one attempt's effect sticks" is counted,
//! not assumed.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use batchlease_e2e::{pg, workers};
use batchlease_worker_sdk::postgres::{Committed, FencedPool, FencedStore};
use batchlease_worker_sdk::{EarlierCommit, Error, Fence, KillClock, Registry, WorkerMetrics};
use rand::Rng;
use serde_json::json;
use tokio::time::Instant;
use tokio_postgres::{Client, NoTls};

static EFFECTS: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();

async fn client() -> Client {
    let (client, conn) = tokio_postgres::connect(&workers::pg_url().unwrap(), NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client
}

/// A store on its own connection (each attempt is its own process in
/// reality), and a fresh task UID.
async fn setup() -> (FencedStore, FencedStore, Client, String) {
    let db = pg::connect().await.unwrap();
    EFFECTS
        .get_or_try_init(|| {
            db.batch_execute(
                "CREATE TABLE IF NOT EXISTS effects (task_id text NOT NULL, token bigint NOT NULL)",
            )
        })
        .await
        .unwrap();
    let uid = format!("uid-{:012x}", rand::rng().random::<u64>() >> 16);
    let a = FencedStore::new(client().await, WorkerMetrics::default());
    let b = FencedStore::new(client().await, WorkerMetrics::default());
    (a, b, db, uid)
}

/// A fence for `token` whose kill clock started now.
fn live(token: i64, ttl_secs: u64) -> Fence {
    Fence::new(
        token,
        KillClock::new(Duration::from_secs(ttl_secs), Instant::now(), None),
    )
}

async fn effects(db: &Client, uid: &str) -> Vec<i64> {
    db.query(
        "SELECT token FROM effects WHERE task_id = $1 ORDER BY token",
        &[&uid],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| r.get(0))
    .collect()
}

/// Commits under `fence` with one side effect in the same transaction.
async fn commit_effect(
    store: &mut FencedStore,
    fence: &Fence,
    uid: &str,
) -> Result<Committed, Error> {
    let token = fence.token();
    let id = uid.to_owned();
    store
        .commit_with(fence, uid, &json!({"token": token}), move |tx| {
            Box::pin(async move {
                tx.execute(
                    "INSERT INTO effects (task_id, token) VALUES ($1, $2)",
                    &[&id, &token],
                )
                .await
                .map(|_| ())
            })
        })
        .await
}

#[tokio::test]
async fn a_holder_paused_between_check_and_commit_is_refused_once_the_successor_registered() {
    // W1 (token 1) checked its fence and then stalled; meanwhile its lease
    // expired, W2 claimed token 2 and registered it before running anything.
    // Without registration, W1's late commit would pass `last < 1` and W2's
    // later commit would pass `1 < 2`: two effects.
    let (mut w1, mut w2, db, uid) = setup().await;
    let (f1, f2) = (live(1, 30), live(2, 30));
    assert_eq!(w1.register(&f1, &uid).await.unwrap(), None);
    assert_eq!(w2.register(&f2, &uid).await.unwrap(), None);
    let err = commit_effect(&mut w1, &f1, &uid).await.unwrap_err();
    assert!(
        matches!(
            err,
            Error::Fenced {
                token: 1,
                current: 2
            }
        ),
        "{err}"
    );
    assert_eq!(
        commit_effect(&mut w2, &f2, &uid).await.unwrap(),
        Committed::Written
    );
    assert_eq!(effects(&db, &uid).await, [2], "exactly one effect, W2's");
    // Registering an older token after a newer one is refused too.
    assert!(matches!(
        w1.register(&f1, &uid).await.unwrap_err(),
        Error::Fenced {
            token: 1,
            current: 2
        }
    ));
}

#[tokio::test]
async fn a_commit_that_landed_before_the_successor_registered_is_seen_and_not_redone() {
    // W1's commit landed just before its lease expired, but its completion
    // never reached the API server: W2 is offered the task. Its registration
    // reports W1's commit, and a second commit is refused.
    let (mut w1, mut w2, db, uid) = setup().await;
    let (f1, f2) = (live(1, 30), live(2, 30));
    w1.register(&f1, &uid).await.unwrap();
    assert_eq!(
        commit_effect(&mut w1, &f1, &uid).await.unwrap(),
        Committed::Written
    );
    // W1 replaying its own commit (a lost acknowledgement) is idempotent …
    assert_eq!(
        w1.commit(&f1, &uid, &json!({"token": 1})).await.unwrap(),
        Committed::AlreadyCommitted
    );
    // … but not with another payload.
    assert!(matches!(
        w1.commit(&f1, &uid, &json!({"token": 1, "again": true}))
            .await
            .unwrap_err(),
        Error::PayloadMismatch { token: 1 }
    ));
    let earlier = w2.register(&f2, &uid).await.unwrap();
    assert_eq!(
        earlier,
        Some(EarlierCommit {
            token: 1,
            payload: Some(json!({"token": 1}))
        })
    );
    let err = commit_effect(&mut w2, &f2, &uid).await.unwrap_err();
    assert!(
        matches!(
            err,
            Error::CommittedEarlier {
                token: 2,
                earlier: 1
            }
        ),
        "{err}"
    );
    assert_eq!(effects(&db, &uid).await, [1], "exactly one effect, W1's");
    // Once W2 registered, even W1's replay is a zombie's write.
    assert!(matches!(
        w1.commit(&f1, &uid, &json!({"token": 1}))
            .await
            .unwrap_err(),
        Error::Fenced {
            token: 1,
            current: 2
        }
    ));
}

#[tokio::test]
async fn a_paused_holder_of_the_row_lock_does_not_block_its_successor() {
    // W1 (TTL 6 s) is inside its commit transaction, holding the row lock,
    // when it stalls. PostgreSQL ends its idle session after TTL/6, so W2's
    // registration (lock_timeout TTL/3) gets through and W1's commit fails.
    let (mut w1, mut w2, db, uid) = setup().await;
    let (f1, f2) = (live(1, 6), live(2, 6));
    w1.register(&f1, &uid).await.unwrap();
    let (locked_tx, locked) = tokio::sync::oneshot::channel::<()>();
    let (resume_tx, resume) = tokio::sync::oneshot::channel::<()>();
    let (id, key) = (uid.clone(), uid.clone());
    let stalled = tokio::spawn(async move {
        let r = w1
            .commit_with(&f1, &key, &json!({"token": 1}), move |tx| {
                Box::pin(async move {
                    tx.execute(
                        "INSERT INTO effects (task_id, token) VALUES ($1, 1)",
                        &[&id],
                    )
                    .await?;
                    let _ = locked_tx.send(());
                    // The pause: nothing is sent while the row is locked.
                    let _ = resume.await;
                    Ok(())
                })
            })
            .await;
        (w1, r)
    });
    locked.await.unwrap();
    let started = Instant::now();
    let registered = w2.register(&f2, &uid).await;
    let waited = started.elapsed();
    assert_eq!(registered.unwrap(), None, "nothing was committed by W1");
    assert!(
        waited < Duration::from_secs(2),
        "W2 waited {waited:?} for the row lock (bound: lock_timeout = TTL/3)"
    );
    let _ = resume_tx.send(());
    let (_w1, r) = stalled.await.unwrap();
    assert!(
        matches!(r, Err(Error::Postgres { .. })),
        "W1's session was ended: {r:?}"
    );
    assert_eq!(
        commit_effect(&mut w2, &f2, &uid).await.unwrap(),
        Committed::Written
    );
    assert_eq!(effects(&db, &uid).await, [2]);
}

#[tokio::test]
async fn user_writes_roll_back_with_the_fenced_commit() {
    let (mut w1, _, db, uid) = setup().await;
    let f1 = live(1, 30);
    w1.register(&f1, &uid).await.unwrap();
    // A failing user write rolls the fenced commit back with it.
    let id = uid.clone();
    let err = w1
        .commit_with(&f1, &uid, &json!({"token": 1}), move |tx| {
            Box::pin(async move {
                tx.execute(
                    "INSERT INTO effects (task_id, token) VALUES ($1, 1)",
                    &[&id],
                )
                .await?;
                tx.execute("SELECT * FROM no_such_table", &[])
                    .await
                    .map(|_| ())
            })
        })
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Postgres {
                what: "user writes",
                ..
            }
        ),
        "{err}"
    );
    assert!(effects(&db, &uid).await.is_empty());
    assert_eq!(pg::row(&db, &uid).await.unwrap(), None, "nothing committed");

    // A fence that dies during the user writes: the check right before
    // COMMIT refuses, and everything rolls back.
    let dying = f1.clone();
    let id = uid.clone();
    let err = w1
        .commit_with(&f1, &uid, &json!({"token": 1}), move |tx| {
            Box::pin(async move {
                tx.execute(
                    "INSERT INTO effects (task_id, token) VALUES ($1, 1)",
                    &[&id],
                )
                .await?;
                dying.kill(batchlease_worker_sdk::KillReason::LeaseLost);
                Ok(())
            })
        })
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Revoked { token: 1, .. }), "{err}");
    assert!(effects(&db, &uid).await.is_empty());
    assert_eq!(pg::row(&db, &uid).await.unwrap(), None);
}

#[tokio::test]
async fn the_database_clock_refuses_writes_past_the_attempts_deadline() {
    // A write whose packets sat in the network until after the attempt's
    // deadline reaches the server late: the statement itself carries the
    // deadline, and the server's clock refuses it. Simulated by a skew
    // allowance larger than the time left (the deadline is already past
    // when the statement runs), with a fence that is still live locally.
    let (w1, _, db, uid) = setup().await;
    let mut late = w1.with_clock_skew(Duration::from_secs(3600));
    let f1 = live(1, 30);
    let err = late.register(&f1, &uid).await.unwrap_err();
    assert!(
        matches!(
            err,
            Error::Revoked {
                token: 1,
                reason: "deadline_passed_at_storage"
            }
        ),
        "{err}"
    );
    let err = commit_effect(&mut late, &f1, &uid).await.unwrap_err();
    assert!(
        matches!(
            err,
            Error::Revoked {
                token: 1,
                reason: "deadline_passed_at_storage"
            }
        ),
        "{err}"
    );
    assert!(effects(&db, &uid).await.is_empty());
    assert_eq!(pg::row(&db, &uid).await.unwrap(), None);
    // The same store within its deadline writes.
    let mut on_time = late.with_clock_skew(Duration::ZERO);
    on_time.register(&f1, &uid).await.unwrap();
    assert_eq!(
        commit_effect(&mut on_time, &f1, &uid).await.unwrap(),
        Committed::Written
    );
}

/// A pool of `size` connections to the test PostgreSQL.
fn pool(size: usize) -> std::sync::Arc<FencedPool> {
    std::sync::Arc::new(FencedPool::new(size, WorkerMetrics::default(), || async {
        let (client, conn) = tokio_postgres::connect(&workers::pg_url().unwrap(), NoTls).await?;
        tokio::spawn(conn);
        Ok(client)
    }))
}

/// A fresh task UID (the tables are shared by every test).
fn new_uid() -> String {
    format!("uid-{:012x}", rand::rng().random::<u64>() >> 16)
}

#[tokio::test]
async fn pooled_slots_register_and_commit_while_another_slot_holds_its_connection_busy() {
    // Slot A is inside a slow commit (its writes take 3 s). Slots B and C
    // register and commit other tasks meanwhile. Behind one connection
    // (`Mutex<FencedStore>`, or a pool of one) they would wait for A.
    let (_, _, db, uid_a) = setup().await;
    let pool = pool(3);
    let fa = live(1, 30);
    Registry::register(&*pool, &uid_a, &fa).await.unwrap();
    let (inside_tx, inside) = tokio::sync::oneshot::channel::<()>();
    let slow = tokio::spawn({
        let (pool, uid) = (pool.clone(), uid_a.clone());
        async move {
            let mut store = pool.get().await.unwrap();
            let id = uid.clone();
            store
                .commit_with(&fa, &uid, &json!({"token": 1}), move |tx| {
                    Box::pin(async move {
                        tx.execute(
                            "INSERT INTO effects (task_id, token) VALUES ($1, 1)",
                            &[&id],
                        )
                        .await?;
                        let _ = inside_tx.send(());
                        tx.execute("SELECT pg_sleep(3)", &[]).await.map(|_| ())
                    })
                })
                .await
        }
    });
    inside.await.unwrap();
    let started = Instant::now();
    let others: Vec<_> = (0..2)
        .map(|_| {
            let (pool, uid) = (pool.clone(), new_uid());
            tokio::spawn(async move {
                let f = live(1, 30);
                Registry::register(&*pool, &uid, &f).await.unwrap();
                let mut store = pool.get().await.unwrap();
                let committed = commit_effect(&mut store, &f, &uid).await.unwrap();
                (uid, committed)
            })
        })
        .collect();
    for other in others {
        let (uid, committed) = other.await.unwrap();
        assert_eq!(committed, Committed::Written);
        assert_eq!(effects(&db, &uid).await, [1]);
    }
    let waited = started.elapsed();
    assert!(
        waited < Duration::from_secs(2),
        "B and C took {waited:?}: they waited for A's connection"
    );
    assert!(!slow.is_finished(), "A is still inside its commit");
    assert_eq!(slow.await.unwrap().unwrap(), Committed::Written);
    assert_eq!(effects(&db, &uid_a).await, [1]);
}

#[tokio::test]
async fn a_pooled_connection_whose_session_ended_is_replaced() {
    // The server ended the session (here by hand; in production e.g.
    // `idle_in_transaction_session_timeout` for a paused holder, or a
    // restart). A single store would fail every later write; the pool
    // drops the dead connection and opens a new one.
    let (_, _, db, uid) = setup().await;
    let pool = pool(1);
    let old: i32 = {
        let store = pool.get().await.unwrap();
        store
            .client()
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .unwrap()
            .get(0)
    };
    db.execute("SELECT pg_terminate_backend($1)", &[&old])
        .await
        .unwrap();
    let f1 = live(1, 30);
    // The first use may find out the hard way (a Postgres error, never a
    // doubtful write); the next gets a new connection.
    let mut failures = 0;
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match Registry::register(&*pool, &uid, &f1).await {
            Ok(earlier) => {
                assert_eq!(earlier, None);
                break;
            }
            Err(Error::Postgres { .. }) if Instant::now() < deadline => {
                failures += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("the pool kept the dead connection: {e}"),
        }
    }
    assert!(
        failures <= 1,
        "{failures} writes failed on the dead connection"
    );
    let mut store = pool.get().await.unwrap();
    let new: i32 = store
        .client()
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    assert_ne!(new, old, "a new session");
    assert_eq!(
        commit_effect(&mut store, &f1, &uid).await.unwrap(),
        Committed::Written
    );
    assert_eq!(effects(&db, &uid).await, [1]);
}

#[tokio::test]
async fn a_write_cancelled_mid_transaction_leaves_nothing_for_the_next_user_of_its_connection() {
    // A's handler is dropped (kill switch) inside its commit transaction,
    // after its side effect and with the row locked. The connection goes
    // back to the pool; B (the successor, on that same connection: a pool
    // of one) must not find itself inside A's transaction — else B's
    // COMMIT would make A's effect stick too.
    let (_, _, db, uid) = setup().await;
    let pool = pool(1);
    let f1 = live(1, 30);
    Registry::register(&*pool, &uid, &f1).await.unwrap();
    let (inside_tx, inside) = tokio::sync::oneshot::channel::<()>();
    let a = tokio::spawn({
        let (pool, uid) = (pool.clone(), uid.clone());
        async move {
            let mut store = pool.get().await.unwrap();
            let id = uid.clone();
            store
                .commit_with(&f1, &uid, &json!({"token": 1}), move |tx| {
                    Box::pin(async move {
                        tx.execute(
                            "INSERT INTO effects (task_id, token) VALUES ($1, 1)",
                            &[&id],
                        )
                        .await?;
                        let _ = inside_tx.send(());
                        std::future::pending::<()>().await;
                        Ok(())
                    })
                })
                .await
        }
    });
    inside.await.unwrap();
    a.abort();
    assert!(a.await.unwrap_err().is_cancelled());
    let f2 = live(2, 30);
    let started = Instant::now();
    assert_eq!(Registry::register(&*pool, &uid, &f2).await.unwrap(), None);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "A's row lock was released with its transaction"
    );
    let mut store = pool.get().await.unwrap();
    assert_eq!(
        commit_effect(&mut store, &f2, &uid).await.unwrap(),
        Committed::Written
    );
    assert_eq!(effects(&db, &uid).await, [2], "A's effect rolled back");
    assert_eq!(pg::row(&db, &uid).await.unwrap().map(|(t, _)| t), Some(2));
}
