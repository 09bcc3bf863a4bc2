//! The fenced PostgreSQL store against a real PostgreSQL, driven through
//! the interleavings that matter (design §4): a holder paused between its
//! fence check and its write, a commit that lands before the successor
//! registered, a paused holder of the row lock, rolled-back user writes.
//!
//! Each case writes a side effect (`effects`) in the same transaction as
//! the fenced commit, so "exactly one attempt's effect sticks" is counted,
//! not assumed.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use batchlease_e2e::{pg, workers};
use batchlease_worker_sdk::postgres::{Committed, FencedStore};
use batchlease_worker_sdk::{EarlierCommit, Error, Fence, KillClock, WorkerMetrics};
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
