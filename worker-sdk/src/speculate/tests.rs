//! The executor against the in-memory store: commit, abort with LIFO
//! compensations, in-place retries when Exclusive, zombies, failures.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::json;
use tokio::time::Instant;

use super::memory::{LogState, MemoryStore};
use super::*;
use crate::fence::KillClock;

fn fence(token: i64) -> Fence {
    Fence::new(
        token,
        KillClock::new(Duration::from_secs(30), Instant::now(), None),
    )
}

struct Env {
    fence: Fence,
    exclusive: bool,
    holds_locks: bool,
    earlier: Option<EarlierCommit>,
    background: TaskTracker,
    metrics: WorkerMetrics,
    rounds: AttemptRounds,
}

impl Env {
    fn new(token: i64) -> Self {
        Self {
            fence: fence(token),
            exclusive: false,
            holds_locks: false,
            earlier: None,
            background: TaskTracker::new(),
            metrics: WorkerMetrics::default(),
            rounds: AttemptRounds::default(),
        }
    }

    fn attempt(&self) -> Attempt<'_> {
        Attempt {
            task_uid: "uid-1",
            fence: &self.fence,
            rounds: &self.rounds,
            exclusive: self.exclusive,
            holds_locks: self.holds_locks,
            earlier: self.earlier.as_ref(),
            background: &self.background,
            metrics: &self.metrics,
        }
    }

    fn rounds(&self, outcome: &'static str) -> u64 {
        self.metrics
            .speculative_rounds
            .get_or_create(&OutcomeLabels { outcome })
            .get()
    }

    fn compensations(&self, outcome: &'static str) -> u64 {
        self.metrics
            .compensations
            .get_or_create(&OutcomeLabels { outcome })
            .get()
    }
}

fn keys(k: &[&str]) -> Vec<String> {
    k.iter().map(|s| s.to_string()).collect()
}

/// A transfer of `amount` from `a` to `b`, registering one compensation
/// per side effect (named `a`, `b`) that records its run in `undone`.
fn transfer(
    amount: i64,
    undone: Arc<Mutex<Vec<String>>>,
    before_commit: impl Fn() + Clone,
) -> impl FnMut(Snapshot, Compensations) -> BoxFuture<'static, Result<Proposal, TaskError>> {
    move |snap, comps| {
        let undone = undone.clone();
        let before_commit = before_commit.clone();
        let a: i64 = snap.state("a").ok().flatten().unwrap_or(0);
        let b: i64 = snap.state("b").ok().flatten().unwrap_or(0);
        let fut = async move {
            for name in ["debit-notice", "credit-notice"] {
                let undone = undone.clone();
                comps
                    .register(name, move || async move {
                        undone.lock().unwrap().push(name.to_owned());
                        Ok(())
                    })
                    .await?;
            }
            Ok(Proposal::new(json!({"moved": amount}))
                .write("a", json!(a - amount))
                .write("b", json!(b + amount)))
        };
        before_commit();
        Box::pin(fut)
    }
}

#[tokio::test]
async fn a_round_that_wins_writes_every_key_and_keeps_its_compensations() {
    let store = Arc::new(MemoryStore::new());
    store.put("a", json!(100));
    let env = Env::new(1);
    let undone = Arc::new(Mutex::new(vec![]));
    let out = run(
        env.attempt(),
        store.clone(),
        &keys(&["b", "a"]),
        transfer(30, undone.clone(), || {}),
    )
    .await
    .unwrap();
    assert_eq!(out.result, json!({"moved": 30}));
    assert_eq!(out.rounds, 1);
    assert_eq!(store.get("a"), Some((2, json!(70))));
    assert_eq!(store.get("b"), Some((1, json!(30))), "created at version 1");
    assert_eq!(store.committed("uid-1"), Some(1));
    assert!(undone.lock().unwrap().is_empty(), "nothing undone");
    let states: Vec<_> = store.log().into_iter().map(|(_, s)| s).collect();
    assert_eq!(states, vec![LogState::Kept, LogState::Kept]);
    assert_eq!(env.rounds("committed"), 1);
}

#[tokio::test]
async fn a_lost_swap_undoes_last_first_once_each_and_aborts() {
    let store = Arc::new(MemoryStore::new());
    store.put("a", json!(100));
    store.put("b", json!(0));
    let env = Env::new(1);
    let undone = Arc::new(Mutex::new(vec![]));
    // Another writer commits "b" while the body runs.
    let racer = store.clone();
    let err = run(
        env.attempt(),
        store.clone(),
        &keys(&["a", "b"]),
        transfer(30, undone.clone(), move || {
            racer.put("b", json!(5));
        }),
    )
    .await
    .unwrap_err();
    let TaskError::Aborted { message } = &err else {
        panic!("expected Aborted, got {err:?}")
    };
    assert!(message.contains("b was at version 2"), "{message}");
    assert_eq!(
        *undone.lock().unwrap(),
        vec!["credit-notice", "debit-notice"],
        "last registered first"
    );
    // Nothing of the round was written; the task is not committed.
    assert_eq!(store.get("a"), Some((1, json!(100))));
    assert_eq!(store.get("b"), Some((2, json!(5))));
    assert_eq!(store.committed("uid-1"), None);
    let states: Vec<_> = store.log().into_iter().map(|(_, s)| s).collect();
    assert_eq!(states, vec![LogState::Ran, LogState::Ran]);
    assert_eq!(env.rounds("conflict"), 1);
    assert_eq!(env.compensations("ran"), 2);
    // The lease's outcome: Aborted, with the SDK's reason.
    let c = crate::attempt::completion_for_tests(Err(err));
    assert_eq!(c.outcome, batchlease_api::LeaseOutcome::Aborted);
    assert_eq!(c.reason.as_deref(), Some(ABORTED_REASON));
}

#[tokio::test]
async fn in_exclusive_mode_a_lost_swap_is_retried_in_place() {
    let store = Arc::new(MemoryStore::new());
    store.put("a", json!(100));
    let mut env = Env::new(4);
    env.exclusive = true;
    let undone = Arc::new(Mutex::new(vec![]));
    // Two attempts issued before the locks were taken beat the first two
    // rounds; the third wins.
    let beaten = Arc::new(AtomicUsize::new(0));
    let (racer, b2) = (store.clone(), beaten.clone());
    let out = run(
        env.attempt(),
        store.clone(),
        &keys(&["a", "b"]),
        transfer(10, undone.clone(), move || {
            if b2.fetch_add(1, Ordering::SeqCst) < 2 {
                let (v, s) = racer.get("a").unwrap();
                racer.put("a", json!(s.as_i64().unwrap() - 1));
                assert!(v > 0);
            }
        }),
    )
    .await
    .unwrap();
    assert_eq!(out.rounds, 3);
    assert_eq!(store.get("a").unwrap().1, json!(88), "100 - 1 - 1 - 10");
    assert_eq!(store.get("b").unwrap().1, json!(10));
    assert_eq!(undone.lock().unwrap().len(), 4, "two rounds undone, 2 each");
    let log = store.log();
    assert!(
        log.iter()
            .all(|(e, s)| (e.round == 2) == (*s == LogState::Kept)),
        "{log:?}"
    );
    assert_eq!(env.rounds("conflict"), 2);
    assert_eq!(env.rounds("committed"), 1);
}

#[tokio::test]
async fn a_zombie_cannot_win_the_swap_and_undoes_its_side_effects() {
    let store = Arc::new(MemoryStore::new());
    store.put("a", json!(100));
    let env = Env::new(1);
    let undone = Arc::new(Mutex::new(vec![]));
    // The successor registers while the zombie's body runs: no version
    // moved, but the zombie's fenced commit is refused.
    let racer = store.clone();
    let err = run(
        env.attempt(),
        store.clone(),
        &keys(&["a", "b"]),
        transfer(30, undone.clone(), move || racer.register("uid-1", 2)),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(&err, TaskError::Retryable { reason, .. } if reason == "Fenced"),
        "{err:?}"
    );
    assert_eq!(store.get("a"), Some((1, json!(100))), "nothing written");
    assert_eq!(undone.lock().unwrap().len(), 2);
    assert_eq!(store.committed("uid-1"), None);
}

#[tokio::test]
async fn a_revoked_attempt_reads_nothing_and_writes_nothing() {
    let store = Arc::new(MemoryStore::new());
    let env = Env::new(1);
    env.fence.kill(crate::fence::KillReason::RenewalsFailed);
    let calls = Arc::new(AtomicUsize::new(0));
    let c2 = calls.clone();
    let err = run(env.attempt(), store.clone(), &keys(&["a"]), move |_, _| {
        c2.fetch_add(1, Ordering::SeqCst);
        async { Ok(Proposal::new(json!({}))) }
    })
    .await
    .unwrap_err();
    assert!(
        matches!(&err, TaskError::Retryable { reason, .. } if reason == "Revoked"),
        "{err:?}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_failed_compensation_is_reported_not_dropped() {
    let store = Arc::new(MemoryStore::new());
    store.put("a", json!(1));
    let env = Env::new(1);
    let racer = store.clone();
    let err = run(
        env.attempt(),
        store.clone(),
        &keys(&["a"]),
        move |snap: Snapshot, comps: Compensations| {
            let racer = racer.clone();
            async move {
                comps.register("refund", || async { Ok(()) }).await?;
                comps
                    .register("unsend-mail", || async {
                        Err("mail server unreachable".to_owned())
                    })
                    .await?;
                racer.put("a", json!(2));
                Ok(Proposal::new(json!({})).write("a", json!(snap.version("a"))))
            }
        },
    )
    .await
    .unwrap_err();
    let TaskError::Retryable { reason, message } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(reason, COMPENSATION_FAILED_REASON);
    assert!(
        message.contains("unsend-mail: mail server unreachable"),
        "{message}"
    );
    let states: Vec<_> = store.log().into_iter().map(|(e, s)| (e.name, s)).collect();
    assert_eq!(
        states,
        vec![
            ("refund".to_owned(), LogState::Ran),
            ("unsend-mail".to_owned(), LogState::Failed)
        ],
        "the one after the failure still ran"
    );
    assert_eq!(env.compensations("failed"), 1);
    assert_eq!(env.compensations("ran"), 1);
}

#[tokio::test]
async fn a_dropped_attempt_still_undoes_its_side_effects_to_the_end() {
    let store = Arc::new(MemoryStore::new());
    let env = Env::new(1);
    let undone = Arc::new(Mutex::new(vec![]));
    let (registered, release) = (
        Arc::new(tokio::sync::Notify::new()),
        Arc::new(tokio::sync::Notify::new()),
    );
    let (u, r, rel) = (undone.clone(), registered.clone(), release.clone());
    let ks = keys(&["a"]);
    let fut = run(
        env.attempt(),
        store.clone(),
        &ks,
        move |_, comps: Compensations| {
            let (u, r, rel) = (u.clone(), r.clone(), rel.clone());
            async move {
                for name in ["first", "second"] {
                    let u = u.clone();
                    let rel = rel.clone();
                    comps
                        .register(name, move || async move {
                            // A slow undo: the drop must not cut it short.
                            if name == "second" {
                                rel.notified().await;
                            }
                            u.lock().unwrap().push(name.to_owned());
                            Ok(())
                        })
                        .await?;
                }
                r.notify_one();
                std::future::pending::<()>().await;
                Ok(Proposal::new(json!({})))
            }
        },
    );
    // The kill switch drops the attempt while its body runs.
    tokio::select! {
        _ = fut => panic!("the body never ends"),
        _ = registered.notified() => {}
    }
    assert_eq!(env.background.len(), 1, "handed to the background");
    release.notify_one();
    env.background.close();
    env.background.wait().await;
    assert_eq!(*undone.lock().unwrap(), vec!["second", "first"]);
    let states: Vec<_> = store.log().into_iter().map(|(_, s)| s).collect();
    assert_eq!(states, vec![LogState::Ran, LogState::Ran]);
}

#[tokio::test]
async fn a_commit_that_landed_is_never_compensated() {
    // The claim of each entry finds it KEPT (the commit's answer was lost
    // but the commit landed): skipped.
    let store = Arc::new(MemoryStore::new());
    let entry = LogEntry {
        task_uid: "uid-1".into(),
        token: 1,
        round: 0,
        seq: 0,
        name: "x".into(),
    };
    store.log_registered(&entry).await.unwrap();
    let snap = store.read(&keys(&["a"])).await.unwrap();
    let out = store
        .commit(&fence(1), "uid-1", 0, 1, &snap, &Proposal::new(json!({})))
        .await
        .unwrap();
    assert_eq!(out, CommitOutcome::Committed);
    assert!(!store.log_claim(&entry).await.unwrap(), "KEPT: not claimed");
    // And the other order: a claimed entry makes the commit refuse.
    let e2 = LogEntry {
        task_uid: "uid-2".into(),
        ..entry
    };
    store.log_registered(&e2).await.unwrap();
    assert!(store.log_claim(&e2).await.unwrap());
    let err = store
        .commit(&fence(1), "uid-2", 0, 1, &snap, &Proposal::new(json!({})))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Revoked { .. }), "{err:?}");
    assert_eq!(store.committed("uid-2"), None);
}

#[tokio::test]
async fn an_earlier_commit_is_returned_without_running_the_body_again() {
    let store = Arc::new(MemoryStore::new());
    let mut env = Env::new(3);
    env.earlier = Some(EarlierCommit {
        token: 2,
        payload: Some(json!({"moved": 30})),
    });
    let out = run(env.attempt(), store, &keys(&["a"]), |_, _| async {
        panic!("the transfer must not run twice")
    })
    .await
    .unwrap();
    assert_eq!(
        out,
        Speculated {
            result: json!({"moved": 30}),
            rounds: 0,
            earlier: true
        }
    );
}

#[tokio::test]
async fn writing_a_key_not_read_is_refused() {
    let store = Arc::new(MemoryStore::new());
    let env = Env::new(1);
    let err = run(env.attempt(), store.clone(), &keys(&["a"]), |_, _| async {
        Ok(Proposal::new(json!({})).write("b", json!(1)))
    })
    .await
    .unwrap_err();
    assert!(
        matches!(&err, TaskError::Permanent { reason, .. } if reason == "UnreadKeyWritten"),
        "{err:?}"
    );
    assert_eq!(store.get("b"), None);
}

#[tokio::test]
async fn compensations_cut_short_by_the_kill_switch_still_run_to_the_end() {
    // The swap is lost and the compensations start; the kill switch drops
    // the attempt while the first one runs: the rest still run.
    let store = Arc::new(MemoryStore::new());
    store.put("a", json!(1));
    let env = Env::new(1);
    let undone = Arc::new(Mutex::new(vec![]));
    let (running, release) = (
        Arc::new(tokio::sync::Notify::new()),
        Arc::new(tokio::sync::Notify::new()),
    );
    let (u, run2, rel, racer) = (
        undone.clone(),
        running.clone(),
        release.clone(),
        store.clone(),
    );
    let ks = keys(&["a"]);
    let fut = run(
        env.attempt(),
        store.clone(),
        &ks,
        move |snap: Snapshot, comps: Compensations| {
            let (u, run2, rel, racer) = (u.clone(), run2.clone(), rel.clone(), racer.clone());
            async move {
                for name in ["first", "second"] {
                    let (u, run2, rel) = (u.clone(), run2.clone(), rel.clone());
                    comps
                        .register(name, move || async move {
                            if name == "second" {
                                // Runs first (LIFO), and stalls.
                                run2.notify_one();
                                rel.notified().await;
                            }
                            u.lock().unwrap().push(name.to_owned());
                            Ok(())
                        })
                        .await?;
                }
                racer.put("a", json!(5));
                Ok(Proposal::new(json!({})).write("a", json!(snap.version("a"))))
            }
        },
    );
    tokio::select! {
        _ = fut => panic!("the compensation is stalled"),
        _ = running.notified() => {}
    }
    // The attempt is gone; its undo is not.
    release.notify_one();
    env.background.close();
    env.background.wait().await;
    assert_eq!(*undone.lock().unwrap(), vec!["second", "first"]);
    let states: Vec<_> = store.log().into_iter().map(|(_, s)| s).collect();
    assert_eq!(states, vec![LogState::Ran, LogState::Ran]);
}

#[tokio::test]
async fn in_place_retries_are_bounded_without_locks_and_not_with_them() {
    // Every round is beaten: without locks the attempt gives up after
    // IN_PLACE_ROUNDS and aborts; holding its locks it keeps going until
    // the racers are done (here: the 15th round wins).
    for holds_locks in [false, true] {
        let store = Arc::new(MemoryStore::new());
        store.put("a", json!(0));
        let mut env = Env::new(1);
        env.exclusive = true;
        env.holds_locks = holds_locks;
        let rounds = Arc::new(AtomicUsize::new(0));
        let (r2, racer) = (rounds.clone(), store.clone());
        let out = run(
            env.attempt(),
            store.clone(),
            &keys(&["a"]),
            move |snap: Snapshot, _| {
                if r2.fetch_add(1, Ordering::SeqCst) < 14 {
                    racer.put("a", json!(-1));
                }
                async move { Ok(Proposal::new(json!({})).write("a", json!(snap.version("a")))) }
            },
        )
        .await;
        if holds_locks {
            assert_eq!(out.unwrap().rounds, 15);
        } else {
            assert!(matches!(out, Err(TaskError::Aborted { .. })), "{out:?}");
            assert_eq!(rounds.load(Ordering::SeqCst), IN_PLACE_ROUNDS as usize);
        }
    }
}

/// A store whose log writes wait for a signal: to drop an attempt while
/// `register` is under way.
struct SlowLog {
    inner: MemoryStore,
    entered: tokio::sync::Notify,
}

impl VersionedStore for SlowLog {
    fn read<'a>(&'a self, keys: &'a [String]) -> BoxFuture<'a, Result<Snapshot, Error>> {
        self.inner.read(keys)
    }
    fn commit<'a>(
        &'a self,
        fence: &'a Fence,
        task_uid: &'a str,
        round: i32,
        registered: usize,
        snapshot: &'a Snapshot,
        proposal: &'a Proposal,
    ) -> BoxFuture<'a, Result<CommitOutcome, Error>> {
        self.inner
            .commit(fence, task_uid, round, registered, snapshot, proposal)
    }
    fn log_registered<'a>(&'a self, entry: &'a LogEntry) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move {
            self.entered.notify_one();
            std::future::pending::<()>().await;
            self.inner.log_registered(entry).await
        })
    }
    fn log_claim<'a>(&'a self, entry: &'a LogEntry) -> BoxFuture<'a, Result<bool, Error>> {
        self.inner.log_claim(entry)
    }
    fn log_ran<'a>(
        &'a self,
        entry: &'a LogEntry,
        ran: Ran,
        error: Option<&'a str>,
    ) -> BoxFuture<'a, Result<(), Error>> {
        self.inner.log_ran(entry, ran, error)
    }
}

#[tokio::test]
async fn an_attempt_dropped_while_logging_a_compensation_leaves_nothing_registered() {
    let store = Arc::new(SlowLog {
        inner: MemoryStore::new(),
        entered: tokio::sync::Notify::new(),
    });
    let env = Env::new(1);
    let ran = Arc::new(AtomicUsize::new(0));
    let r2 = ran.clone();
    let ks = keys(&["a"]);
    let fut = run(
        env.attempt(),
        store.clone(),
        &ks,
        move |_, comps: Compensations| {
            let r2 = r2.clone();
            async move {
                comps
                    .register("undo", move || async move {
                        r2.fetch_add(1, Ordering::SeqCst);
                        Ok(())
                    })
                    .await?;
                Ok(Proposal::new(json!({})))
            }
        },
    );
    tokio::select! {
        _ = fut => panic!("the log write never ends"),
        _ = store.entered.notified() => {}
    }
    env.background.close();
    env.background.wait().await;
    // Never logged, so never claimed and never run; nothing left behind.
    assert!(store.inner.log().is_empty());
    assert_eq!(ran.load(Ordering::SeqCst), 0);
    assert_eq!(env.compensations("skipped"), 1);
}

#[tokio::test]
async fn calls_of_one_attempt_never_reuse_log_keys_and_commit_once() {
    let store = Arc::new(MemoryStore::new());
    store.put("a", json!(0));
    let env = Env::new(1);
    let undone = Arc::new(Mutex::new(vec![]));
    // The handler retries speculate itself after a lost swap.
    let racer = store.clone();
    let first = run(
        env.attempt(),
        store.clone(),
        &keys(&["a", "b"]),
        transfer(1, undone.clone(), move || {
            racer.put("a", json!(9));
        }),
    )
    .await;
    assert!(matches!(first, Err(TaskError::Aborted { .. })), "{first:?}");
    let second = run(
        env.attempt(),
        store.clone(),
        &keys(&["a", "b"]),
        transfer(1, undone.clone(), || {}),
    )
    .await
    .unwrap();
    assert_eq!(second.rounds, 1);
    let rounds: Vec<(i32, LogState)> = store.log().into_iter().map(|(e, s)| (e.round, s)).collect();
    assert_eq!(
        rounds,
        vec![
            (0, LogState::Ran),
            (0, LogState::Ran),
            (1, LogState::Kept),
            (1, LogState::Kept)
        ],
        "the second call's round is round 1, its entries logged and kept"
    );
    // A third call after the commit is refused before it does anything.
    let third = run(env.attempt(), store.clone(), &keys(&["a"]), |_, _| async {
        panic!("must not run")
    })
    .await;
    assert!(
        matches!(&third, Err(TaskError::Permanent { reason, .. }) if reason == "SpeculatedTwice"),
        "{third:?}"
    );
}

#[tokio::test]
async fn a_panicking_undo_is_a_failed_one_and_the_rest_still_run() {
    let store = Arc::new(MemoryStore::new());
    store.put("a", json!(1));
    let env = Env::new(1);
    let ran = Arc::new(AtomicUsize::new(0));
    let (r2, racer) = (ran.clone(), store.clone());
    let err = run(
        env.attempt(),
        store.clone(),
        &keys(&["a"]),
        move |_, comps: Compensations| {
            let (r2, racer) = (r2.clone(), racer.clone());
            async move {
                comps
                    .register("first", move || async move {
                        r2.fetch_add(1, Ordering::SeqCst);
                        Ok(())
                    })
                    .await?;
                comps
                    .register("boom", || async { panic!("undo bug") })
                    .await?;
                racer.put("a", json!(2));
                Ok(Proposal::new(json!({})).write("a", json!(0)))
            }
        },
    )
    .await
    .unwrap_err();
    assert!(
        matches!(&err, TaskError::Retryable { reason, message }
            if reason == COMPENSATION_FAILED_REASON && message.contains("boom: the compensation panicked")),
        "{err:?}"
    );
    assert_eq!(ran.load(Ordering::SeqCst), 1, "the one after the panic ran");
    let states: Vec<_> = store.log().into_iter().map(|(e, s)| (e.name, s)).collect();
    assert_eq!(
        states,
        vec![
            ("first".to_owned(), LogState::Ran),
            ("boom".to_owned(), LogState::Failed)
        ],
        "in registration order"
    );
}

#[tokio::test]
async fn registering_after_the_round_ended_is_refused() {
    let store = Arc::new(MemoryStore::new());
    let env = Env::new(1);
    let kept: Arc<Mutex<Option<Compensations>>> = Arc::new(Mutex::new(None));
    let k2 = kept.clone();
    run(
        env.attempt(),
        store.clone(),
        &keys(&["a"]),
        move |_, comps| {
            *k2.lock().unwrap() = Some(comps);
            async { Ok(Proposal::new(json!({}))) }
        },
    )
    .await
    .unwrap();
    let comps = kept.lock().unwrap().take().unwrap();
    let err = comps
        .register("late", || async { Ok(()) })
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err:?}");
    assert!(store.log().is_empty());
}
