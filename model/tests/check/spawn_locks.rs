//! Spawned children, TTL edits after a lost lease, resource locks and
//! speculative tasks (the model check of `check.rs`, split by concern).

use super::*;

/// One worker whose attempts spawn a child (fence check, then a create
/// that lands any number of steps later — a worker paused between the
/// two), a user who may cancel the parent at any step: the late create
/// lands after the parent was Cancelled, or after it Succeeded or was
/// retried, before or after the operator first looks at the child.
/// The wall clocks stand still (as in [`locks`]): the cancel's wait is
/// timed on the monotonic clock, and no backoff ends within the bound.
fn spawning(ticks: u8) -> Config {
    let mut cfg = config(ticks, 0, 0);
    cfg.workers = 1;
    cfg.cancel = true;
    cfg.spawn = true;
    cfg.frozen_wall = true;
    cfg
}

#[test]
fn safe_when_a_paused_parent_spawns_late() {
    assert_safe(
        spawning(3),
        &[
            "a child spawned after its parent ended is refused",
            "a child spawned while its parent ran is admitted",
            "a task cancelled while held ends Cancelled",
        ],
    );
}

/// Without the gate (the behaviour before issue 22) a child whose create
/// lands after its parent was Cancelled is issued a lease.
#[test]
fn an_ungated_late_child_is_caught() {
    let mut cfg = spawning(3);
    cfg.spawn_rule = SpawnRule::Ungated;
    let p = "no lease is created for a child spawned after its parent ended";
    let path = run(cfg, Some(p)).0.assert_any_discovery(p);
    eprintln!("counterexample: {:?}", path.into_actions());
}

/// The child's read alone is not enough: a parent that ends without
/// waiting for its children's first pass gets a child created while it
/// ran refused.
#[test]
fn a_parent_ending_before_its_children_passed_the_gate_is_caught() {
    let mut cfg = spawning(3);
    cfg.spawn_rule = SpawnRule::ParentDoesNotWait;
    let p = "a child spawned while its parent's attempt was live is not refused";
    let path = run(cfg, Some(p)).0.assert_any_discovery(p);
    eprintln!("counterexample: {:?}", path.into_actions());
}

/// Issue 22 (2): the task is issued with a 10 s TTL, which the cancel cuts
/// to 5 s (one spec update, at any step: before the issue, while offered,
/// held, after the held lease was deleted and its loss recorded). The lost
/// lease's holder runs on the lease's 10 s; the task ends only once that
/// holder has surely stopped.
#[test]
fn safe_when_the_ttl_is_cut_after_a_lease_is_lost() {
    let mut cfg = config(3, 0, 1);
    cfg.workers = 1;
    cfg.start_pending = true;
    cfg.cancel = true;
    cfg.ttl_edit = true;
    // The task cannot end Cancelled within 6 s of a loss (it waits 11 s):
    // what is checked is that it does not end early.
    assert_safe(cfg, &["a tombstone retires a token"]);
}

/// Timing a lost lease's holder by the task's current TTL (the rule before
/// issue 22, a mutation): the TTL cut from 10 s to 5 s with the cancel
/// after the loss ends the task while the holder, whose kill clock runs on
/// 10 s, still writes.
#[test]
fn timing_a_lost_holder_by_the_edited_ttl_is_caught() {
    let mut cfg = config(3, 0, 1);
    cfg.workers = 1;
    cfg.start_pending = true;
    cfg.cancel = true;
    cfg.ttl_edit = true;
    cfg.cancel_rule = CancelRule::SpecTtl;
    let p = "no storage write is accepted after the task is Cancelled";
    let path = run(cfg, Some(p)).0.assert_any_discovery(p);
    eprintln!("counterexample: {:?}", path.into_actions());
}

/// Two tasks share the resource `r`: the lock passes between them through
/// contention, CAS races of concurrent passes, expiry (the zombie's commit
/// lands after the next holder registered) and success.
#[test]
fn safe_when_two_tasks_share_a_lock() {
    assert_safe(
        locks(3),
        &[
            "every task succeeds",
            "a lock acquisition is blocked",
            "a lock passes to another task from an attempt whose lease expired",
            "storage refuses a stale resource token",
        ],
    );
}

/// A holder rule without "one token ahead of a Pending task is acquiring"
/// (a mutation of `locks::holder`): the other task takes the lock its
/// holder took a moment ago and has not issued its lease under yet — two
/// live leases carry a token for `r`.
#[test]
fn a_lock_taken_from_an_acquiring_task_is_caught() {
    let mut cfg = locks(0);
    cfg.start_pending = false;
    cfg.lock_rule = LockRule::AheadIsDead;
    let p = "never two live leases carry a token for one resource";
    let path = run(cfg, Some(p)).0.assert_any_discovery(p);
    eprintln!("counterexample: {:?}", path.into_actions());
}

/// The younger task's acquisition races with the older task's first
/// pass: it may take the lock first, and from the moment the older task
/// waits the creation-order rule holds it back; concurrent passes race
/// for the lock's compare-and-swap.
#[test]
fn safe_when_the_younger_task_locks_first() {
    let mut cfg = locks(1);
    cfg.start_pending = false;
    assert_safe(
        cfg,
        &["every task succeeds", "a younger task takes a lock first"],
    );
}

/// Someone deletes a held lease of a task holding the lock: the task
/// retires the token and takes its own lock again for the next attempt
/// (no queueing), while the old attempt's worker may still write — before
/// the new attempt registers, which storage orders first (the strict form
/// of "no write after the lock passed on" fails for the same task, and
/// needs not hold: the task's row fences the old attempt from then on).
#[test]
fn safe_when_a_locked_lease_is_deleted() {
    let mut cfg = locks(0);
    cfg.lease_deletions = 1;
    assert_safe(
        cfg,
        &[
            "a tombstone retires a token",
            "an attempt writes after its task took its lock again",
        ],
    );
}

/// Issue 22 (3): the task holding the lock is deleted at any step (its
/// worker may be running, renewing, registering, committing); the garbage
/// collector deletes its leases. Its worker learns of the deletion at its
/// next renewal at the latest: the lock passes on only once it has surely
/// stopped, a TTL after its last renewal was observed.
#[test]
fn safe_when_a_task_holding_the_lock_is_deleted() {
    let mut cfg = locks(1);
    cfg.task_deletion = true;
    assert_safe(
        cfg,
        &[
            "a task is deleted while its lease is held and it holds the lock",
            "a deleted task's lock passes to another task",
        ],
    );
}

/// A deleted task's lock taken over as soon as its lease is gone (the rule
/// before issue 22, a mutation of the holder rule): the deleted task's
/// worker, still running, writes after the lock passed to the other task.
#[test]
fn a_deleted_tasks_lock_taken_at_once_is_caught() {
    let mut cfg = locks(1);
    cfg.task_deletion = true;
    cfg.lock_rule = LockRule::GoneIsDead;
    let p = "no storage write for a resource is accepted after its lock passed to another task";
    let path = run(cfg, Some(p)).0.assert_any_discovery(p);
    eprintln!("counterexample: {:?}", path.into_actions());
}

/// The operator crashes once anywhere while tasks take, give back and
/// pass the lock: its lock writes land late (or never), and the pass
/// that was waiting for their answer is gone.
#[test]
fn safe_when_the_operator_crashes_while_locking() {
    let mut cfg = locks(0);
    cfg.operator_crashes = 1;
    assert_safe(
        cfg,
        &[
            "every task succeeds",
            "a crashed operator's request lands late",
        ],
    );
}

/// Without the kill switch a holder whose lease expired writes on: its
/// commit lands after the lock passed to the other task (before that
/// task registered its resource token — after it, only the resource row
/// refuses the zombie). The kill switch is what makes the lock exclusive
/// in time, not only in storage order.
#[test]
fn a_lock_holder_without_a_kill_switch_is_caught() {
    let mut cfg = locks(3);
    cfg.kill = KillRule::Never;
    let p = "no storage write for a resource is accepted after its lock passed to another task";
    let path = run(cfg, Some(p)).0.assert_any_discovery(p);
    eprintln!("counterexample: {:?}", path.into_actions());
}

/// Liveness with the lock: with one worker and every actor acting before
/// time moves on, both tasks finish on every path (no deadlock, and the
/// younger task is not starved by the creation-order rule).
#[test]
fn both_tasks_finish_under_fairness() {
    let mut cfg = config(6, 0, 0);
    cfg.tasks = 2;
    cfg.resource = true;
    cfg.workers = 1;
    cfg.fair = true;
    let (checker, finished) = run(cfg, None);
    assert!(finished);
    checker.assert_no_discovery("the task finishes");
    for p in SAFETY {
        checker.assert_no_discovery(p);
    }
}

/// Two Speculative tasks race from the start, without fairness: both
/// read version 0, one swap wins, the other rolls back, undoes its side
/// effect, completes `Aborted` (no retry spent) and is quarantined.
#[test]
fn safe_when_two_speculative_tasks_race() {
    assert_safe(
        speculative(0),
        &["an attempt aborts", "an abort quarantines a task"],
    );
}

/// A speculative task's zombies: a round paused past its deadline (8 s),
/// or whose held lease was deleted and whose task was issued again (no
/// time), commits late — the fence refuses it although its swap would
/// win, and nothing it read or wrote sticks.
#[test]
fn safe_when_speculative_zombies_commit() {
    for cfg in [speculative_zombies(2, 0), speculative_zombies(0, 1)] {
        assert_safe(
            cfg,
            &[
                "storage refuses a stale attempt",
                "the fence refuses a round whose swap would win",
            ],
        );
    }
}

/// Liveness in speculative mode: `t` runs speculatively, `u` starts
/// quarantined (it aborted once: Exclusive now), a worker each, every
/// actor acting before time moves on, for 2 s (the wall clock runs: an
/// abort's backoff of 1.25 s ends). `u` takes the lock of `r`; `t` is held back while
/// `u`'s attempt lives, or was issued before and races it: the loser of
/// the swap rolls back and undoes its side effect — `t` aborts (no retry
/// spent) and is quarantined in turn, `u` retries in place and wins. Both
/// tasks finish on every path, and every safety property holds.
#[test]
fn every_speculative_task_finishes_under_fairness() {
    let mut cfg = speculative(1);
    cfg.start_quarantined = true;
    cfg.frozen_wall = false;
    cfg.fair = true;
    let (checker, finished) = run(cfg, None);
    assert!(finished);
    checker.assert_no_discovery("the task finishes");
    for p in SAFETY {
        checker.assert_no_discovery(p);
    }
    for p in [
        "every task succeeds",
        "an attempt aborts",
        "an abort quarantines a task",
        "a quarantined task succeeds",
        "a speculative task is held back by a live lock holder",
        "a quarantined attempt wins its swap in place",
    ] {
        checker.assert_any_discovery(p);
    }
}

/// The key written without its version check (a mutation of the store's
/// transaction): both tasks read version 0 and both commits stick — one
/// update is lost.
#[test]
fn a_blind_write_of_the_key_is_caught() {
    let mut cfg = speculative(0);
    cfg.cas = CasRule::Blind;
    let p = "the key counts the tasks whose commit stuck";
    let path = run(cfg, Some(p)).0.assert_any_discovery(p);
    eprintln!("counterexample: {:?}", path.into_actions());
}

/// The swap in a transaction of its own, before the fenced commit (a
/// mutation): a round that read the current version and whose fenced
/// commit is refused — past its deadline — still writes the key.
#[test]
fn a_swap_outside_the_fence_is_caught() {
    let mut cfg = speculative_zombies(2, 0);
    cfg.cas = CasRule::OutsideFence;
    let p = "the key counts the tasks whose commit stuck";
    let path = run(cfg, Some(p)).0.assert_any_discovery(p);
    eprintln!("counterexample: {:?}", path.into_actions());
}
