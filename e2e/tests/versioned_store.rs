//! The speculative executor's PostgreSQL store (`VersionedStore` for
//! `FencedPool`, design §6) against a real PostgreSQL: the compare-and-swap
//! on written and on read-only keys, a key first created by two rounds, the
//! zombie refused by the task row, and the commit and a compensation's
//! claim excluding each other. Nothing of a refused round is written — the
//! task row included.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use batchlease_e2e::{pg, workers};
use batchlease_worker_sdk::postgres::{FencedPool, FencedStore};
use batchlease_worker_sdk::speculate::{
    CommitOutcome, Conflict, LogEntry, Proposal, Snapshot, VersionedStore,
};
use batchlease_worker_sdk::{Error, Fence, KillClock, WorkerMetrics};
use rand::Rng;
use serde_json::json;
use tokio::time::Instant;
use tokio_postgres::NoTls;

fn pool() -> Arc<FencedPool> {
    Arc::new(FencedPool::new(4, WorkerMetrics::default(), || async {
        let (client, conn) = tokio_postgres::connect(&workers::pg_url().unwrap(), NoTls).await?;
        tokio::spawn(conn);
        Ok(client)
    }))
}

fn live(token: i64) -> Fence {
    Fence::new(
        token,
        KillClock::new(Duration::from_secs(30), Instant::now(), None),
    )
}

/// Fresh keys and task UIDs: the tables are shared by every test.
fn unique(prefix: &str) -> String {
    format!("{prefix}-{:012x}", rand::rng().random::<u64>() >> 16)
}

async fn read(store: &FencedPool, keys: &[&str]) -> Snapshot {
    let keys: Vec<String> = keys.iter().map(|k| (*k).to_owned()).collect();
    store.read(&keys).await.unwrap()
}

async fn committed(uid: &str) -> Option<i64> {
    let db = pg::connect().await.unwrap();
    db.query_opt(
        "SELECT committed_token FROM task_state WHERE task_id = $1",
        &[&uid],
    )
    .await
    .unwrap()
    .and_then(|r| r.get(0))
}

#[tokio::test]
async fn a_stale_snapshot_loses_on_written_and_on_read_only_keys() {
    pg::connect().await.unwrap();
    let store = pool();
    let (a, b) = (unique("a"), unique("b"));
    // Two rounds read `a` absent; the first creates it at version 1, the
    // second's insert finds it taken.
    let snap1 = read(&store, &[&a, &b]).await;
    let snap2 = read(&store, &[&a]).await;
    assert_eq!(snap1.version(&a), 0);
    let (t1, t2) = (unique("task"), unique("task"));
    let p = Proposal::new(json!({"n": 1})).write(a.clone(), json!({"balance": 5}));
    let out = store.commit(&live(1), &t1, 0, 0, &snap1, &p).await.unwrap();
    assert_eq!(out, CommitOutcome::Committed);
    let out = store.commit(&live(1), &t2, 0, 0, &snap2, &p).await.unwrap();
    assert_eq!(
        out,
        CommitOutcome::Conflict(Conflict {
            key: a.clone(),
            read: 0,
            found: 1
        })
    );
    assert_eq!(committed(&t2).await, None, "the task row rolled back too");
    // A round that only reads `a` and writes `b` loses when `a` moved on
    // (write skew is refused, not only lost updates).
    let snap3 = read(&store, &[&a, &b]).await;
    let bump = read(&store, &[&a]).await;
    store
        .commit(
            &live(1),
            &unique("task"),
            0,
            0,
            &bump,
            &Proposal::new(json!({})).write(a.clone(), json!({"balance": 6})),
        )
        .await
        .unwrap();
    let t3 = unique("task");
    let out = store
        .commit(
            &live(1),
            &t3,
            0,
            0,
            &snap3,
            &Proposal::new(json!({})).write(b.clone(), json!({"balance": 1})),
        )
        .await
        .unwrap();
    assert!(
        matches!(&out, CommitOutcome::Conflict(c) if c.key == a && c.read == 1 && c.found == 2),
        "{out:?}"
    );
    let now = read(&store, &[&a, &b]).await;
    assert_eq!(now.version(&b), 0, "b was not written");
    assert_eq!(
        now.state::<serde_json::Value>(&a).unwrap(),
        Some(json!({"balance": 6}))
    );
    assert_eq!(committed(&t3).await, None);
}

#[tokio::test]
async fn a_zombie_round_is_refused_by_the_task_row_and_writes_nothing() {
    pg::connect().await.unwrap();
    let store = pool();
    let (k, uid) = (unique("k"), unique("task"));
    let snap = read(&store, &[&k]).await;
    // The successor (token 2) registers while the zombie's round runs.
    let (client, conn) = tokio_postgres::connect(&workers::pg_url().unwrap(), NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    FencedStore::new(client, WorkerMetrics::default())
        .register(&live(2), &uid)
        .await
        .unwrap();
    let err = store
        .commit(
            &live(1),
            &uid,
            0,
            0,
            &snap,
            &Proposal::new(json!({})).write(k.clone(), json!(1)),
        )
        .await
        .unwrap_err();
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
    assert_eq!(read(&store, &[&k]).await.version(&k), 0, "nothing written");
}

#[tokio::test]
async fn a_commit_and_a_claim_of_its_rounds_compensation_exclude_each_other() {
    pg::connect().await.unwrap();
    let store = pool();
    let entry = |uid: &str, round| LogEntry {
        task_uid: uid.to_owned(),
        token: 1,
        round,
        seq: 0,
        name: "cancel-notice".into(),
    };
    // Claimed first (the attempt was dropped and its undo started): the
    // commit of that round is refused, nothing written.
    let (k, uid) = (unique("k"), unique("task"));
    let snap = read(&store, &[&k]).await;
    let e = entry(&uid, 0);
    store.log_registered(&e).await.unwrap();
    assert!(store.log_claim(&e).await.unwrap());
    let err = store
        .commit(
            &live(1),
            &uid,
            0,
            1,
            &snap,
            &Proposal::new(json!({})).write(k.clone(), json!(1)),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Revoked {
                reason: "compensation_claimed",
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(read(&store, &[&k]).await.version(&k), 0);
    assert_eq!(committed(&uid).await, None);
    // Committed first: the round's entries are KEPT and a later claim (a
    // drop right after a commit whose answer was lost) finds nothing to run.
    let (k, uid) = (unique("k"), unique("task"));
    let snap = read(&store, &[&k]).await;
    let e = entry(&uid, 0);
    store.log_registered(&e).await.unwrap();
    let out = store
        .commit(
            &live(1),
            &uid,
            0,
            1,
            &snap,
            &Proposal::new(json!({})).write(k.clone(), json!(1)),
        )
        .await
        .unwrap();
    assert_eq!(out, CommitOutcome::Committed);
    assert!(!store.log_claim(&e).await.unwrap(), "KEPT: never claimed");
    let db = pg::connect().await.unwrap();
    let status: String = db
        .query_one(
            "SELECT status FROM compensation_log WHERE task_id = $1",
            &[&uid],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(status, "KEPT");
    assert_eq!(committed(&uid).await, Some(1));
}

#[tokio::test]
async fn two_rounds_on_an_absent_key_only_read_by_one_are_serializable() {
    // Round A reads x (absent) and y, writes y; round B reads y and x,
    // creates x. Committed together from the same snapshot, neither order
    // of them explains the result (A saw x absent, B saw y before A's
    // write): at most one may win. Raced many times, on fresh keys.
    pg::connect().await.unwrap();
    let store = pool();
    let mut both = 0;
    for _ in 0..60 {
        let (x, y) = (unique("x"), unique("y"));
        let seed = read(&store, &[&y]).await;
        store
            .commit(
                &live(1),
                &unique("task"),
                0,
                0,
                &seed,
                &Proposal::new(json!({})).write(y.clone(), json!(1)),
            )
            .await
            .unwrap();
        let snap = read(&store, &[&x, &y]).await;
        assert_eq!((snap.version(&x), snap.version(&y)), (0, 1));
        let a = Proposal::new(json!({})).write(y.clone(), json!(2));
        let b = Proposal::new(json!({})).write(x.clone(), json!(1));
        let (ta, tb) = (unique("task"), unique("task"));
        let (fa, fb) = (live(1), live(1));
        let (ra, rb) = tokio::join!(
            store.commit(&fa, &ta, 0, 0, &snap, &a),
            store.commit(&fb, &tb, 0, 0, &snap, &b),
        );
        if ra.unwrap() == CommitOutcome::Committed && rb.unwrap() == CommitOutcome::Committed {
            both += 1;
        }
    }
    assert_eq!(
        both, 0,
        "write skew: both rounds committed {both} times of 60"
    );
}
