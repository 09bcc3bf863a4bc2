//! Tests of `observe.rs`.
use super::*;
use batchlease_api::{TaskLeaseSpec, TaskLeaseStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use std::time::Duration;

fn lease(uid: &str, holder: Option<&str>, phase: LeasePhase, renew: i64) -> TaskLease {
    let mut l = TaskLease::new("t-1", TaskLeaseSpec::offered("t", "u", "q", 1, 30));
    l.spec.holder_identity = holder.map(Into::into);
    l.spec.renew_time = Some(MicroTime(
        k8s_openapi::jiff::Timestamp::from_second(renew).unwrap(),
    ));
    l.metadata.uid = Some(uid.into());
    l.metadata.namespace = Some("ns".into());
    l.status = Some(TaskLeaseStatus {
        phase: Some(phase),
        ..Default::default()
    });
    l
}

#[test]
fn observation_table() {
    let t0 = Instant::now();
    let t1 = t0 + Duration::from_secs(5);
    let held = lease("u1", Some("w1"), LeasePhase::Held, 100);
    let first = next_seen(None, &held, t0).unwrap();
    assert_eq!(
        first.observation,
        Observation {
            last_renewal: t0,
            claimed_at: t0,
            named: false
        }
    );

    // The same state seen again (a relist): no renewal.
    assert_eq!(
        next_seen(Some(&first), &held, t1).unwrap().observation,
        first.observation
    );

    // renewTime changed: a renewal, observed at t1, even though the
    // written clock went *backwards* (clock values are not trusted).
    let renewed = lease("u1", Some("w1"), LeasePhase::Held, 50);
    let got = next_seen(Some(&first), &renewed, t1).unwrap().observation;
    assert_eq!(
        got,
        Observation {
            last_renewal: t1,
            claimed_at: t0,
            named: false
        }
    );

    // A different object of the same name (re-created): starts afresh.
    let other = lease("u2", Some("w1"), LeasePhase::Held, 100);
    assert_eq!(
        next_seen(Some(&first), &other, t1).unwrap().observation,
        Observation {
            last_renewal: t1,
            claimed_at: t1,
            named: false
        }
    );

    // Not held: nothing to time.
    for phase in [
        LeasePhase::Offered,
        LeasePhase::Completed,
        LeasePhase::Expired,
    ] {
        assert!(next_seen(Some(&first), &lease("u1", Some("w1"), phase, 100), t1).is_none());
    }
    // Released unclaimed (a withdrawn offer, a tombstone): nothing to time.
    assert!(next_seen(None, &lease("u1", None, LeasePhase::Released, 100), t1).is_none());
    // A held lease released by a cancel keeps its clock: the holder may
    // run until its kill switch, timed from its last renewal.
    let released = lease("u1", Some("w1"), LeasePhase::Released, 100);
    assert_eq!(
        next_seen(Some(&first), &released, t1).unwrap().observation,
        first.observation
    );
    // First seen released (a new leader): a full TTL from now.
    assert_eq!(
        next_seen(None, &released, t1)
            .unwrap()
            .observation
            .last_renewal,
        t1
    );
}

#[test]
fn when_the_holder_of_a_departed_lease_has_surely_stopped() {
    let t0 = Instant::now();
    let t1 = t0 + Duration::from_secs(4);
    let ttl = Duration::from_secs(30);
    let held = lease("u1", Some("w1"), LeasePhase::Held, 100);
    let seen = next_seen(None, &held, t0).unwrap();
    // Deleted while held, last renewal seen at t0: a TTL after it.
    assert_eq!(
        holder_stops_by(Some(&seen), &held, true, t1),
        Some(t0 + ttl)
    );
    // The Delete event shows a renewal not seen before: seen now.
    let renewed = lease("u1", Some("w1"), LeasePhase::Held, 101);
    assert_eq!(
        holder_stops_by(Some(&seen), &renewed, true, t1),
        Some(t1 + ttl)
    );
    // Never seen held before (a new process): a full TTL from now.
    assert_eq!(holder_stops_by(None, &held, true, t1), Some(t1 + ttl));
    // Released by a cancel after a claim: still timed.
    let released = lease("u1", Some("w1"), LeasePhase::Released, 100);
    assert_eq!(
        holder_stops_by(Some(&seen), &released, true, t1),
        Some(t0 + ttl)
    );
    // Deleted while offered (its final state): nobody claimed it.
    let offered = lease("u1", None, LeasePhase::Offered, 100);
    assert_eq!(holder_stops_by(None, &offered, true, t1), None);
    // Gone in a relist: a claim or renewals may have landed unseen.
    assert_eq!(holder_stops_by(None, &offered, false, t1), Some(t1 + ttl));
    assert_eq!(
        holder_stops_by(Some(&seen), &held, false, t1),
        Some(t1 + ttl)
    );
    // Offered by an operator that honours WorkerLeases: a claim landed
    // unseen may have chosen to be renewed per worker — a refresh period
    // more (its holder learns of the deletion at its next refresh).
    let mut stamped = offered.clone();
    stamped.spec.renewal = Some(batchlease_api::Renewal::Lease);
    let refresh = batchlease_api::worker_lease::refresh_period(ttl);
    assert_eq!(
        holder_stops_by(None, &stamped, false, t1),
        Some(t1 + ttl + refresh)
    );
    assert_eq!(
        holder_stops_by(None, &stamped, true, t1),
        None,
        "final: unclaimed"
    );
    // Ended: no holder runs on.
    for phase in [LeasePhase::Completed, LeasePhase::Expired] {
        let ended = lease("u1", Some("w1"), phase, 100);
        assert_eq!(holder_stops_by(Some(&seen), &ended, true, t1), None);
        assert_eq!(holder_stops_by(Some(&seen), &ended, false, t1), None);
    }
}

#[test]
fn a_deleted_tasks_attempt_is_timed_from_its_last_renewal_or_first_sight() {
    let tracker = Tracker::default();
    let t0 = Instant::now();
    let ttl = Duration::from_secs(30);
    let mut held = lease("u1", Some("w1"), LeasePhase::Held, 1);
    held.spec.task_uid = "task-uid".into();
    tracker.observe(&held, t0);
    // The garbage collector deletes the lease 10 s after the last
    // renewal was seen.
    let t1 = t0 + Duration::from_secs(10);
    tracker.forget(&held, t1);
    assert_eq!(tracker.departed_until("ns", "t-1"), Some(t0 + ttl));
    let long = Duration::from_secs(3600);
    assert_eq!(
        tracker.gone_attempt_left("ns", "t", "task-uid", 1, long, t1),
        ttl - Duration::from_secs(10)
    );
    assert_eq!(
        tracker.gone_attempt_left("ns", "t", "task-uid", 1, long, t0 + ttl),
        Duration::ZERO
    );
    // Another incarnation of the task under the same name: not this
    // departure; never seen, so timed from the first question, by the
    // TTL given (the lock's) and the refresh period of a holder that may
    // have renewed per worker.
    let unseen = ttl + batchlease_api::worker_lease::refresh_period(ttl);
    assert_eq!(
        tracker.gone_attempt_left("ns", "t", "other-uid", 1, ttl, t1),
        unseen
    );
    assert_eq!(
        tracker.gone_attempt_left("ns", "t", "other-uid", 1, ttl, t1 + Duration::from_secs(5)),
        unseen - Duration::from_secs(5)
    );
    // A lease a relist no longer lists: a full TTL from the relist.
    let mut offered = lease("u2", None, LeasePhase::Offered, 1);
    offered.metadata.name = Some("t-2".into());
    offered.spec.task_uid = "task-uid".into();
    tracker.observe(&offered, t0);
    tracker.list_started();
    let t2 = t0 + Duration::from_secs(20);
    tracker.list_done(t2);
    assert_eq!(tracker.departed_until("ns", "t-2"), Some(t2 + ttl));
    // Deleted while offered, seen as such: no holder of its own to wait
    // for — but the task's earlier attempts (t-1, t-2) departed too and
    // may still run: the latest of them counts.
    let mut unclaimed = lease("u3", None, LeasePhase::Offered, 1);
    unclaimed.metadata.name = Some("t-3".into());
    unclaimed.spec.task_uid = "task-uid".into();
    tracker.observe(&unclaimed, t0);
    tracker.forget(&unclaimed, t1);
    assert_eq!(tracker.departed_until("ns", "t-3"), Some(t1));
    assert_eq!(
        tracker.gone_attempt_left("ns", "t", "task-uid", 3, long, t1),
        t2 + ttl - t1
    );
}

/// A held lease lost (deleted) and replaced under the same lock, then
/// the task deleted while the replacement was only offered: the lock
/// names the replacement's token, whose lease had no holder — but the
/// lost attempt's worker runs until its kill switch.
#[test]
fn a_lock_named_for_a_replacement_waits_for_the_lost_attempt_too() {
    let tracker = Tracker::default();
    let t0 = Instant::now();
    let ttl = Duration::from_secs(30);
    let mut lost = lease("u1", Some("w1"), LeasePhase::Held, 1);
    lost.spec.task_uid = "task-uid".into();
    tracker.observe(&lost, t0);
    let t1 = t0 + Duration::from_secs(2);
    tracker.forget(&lost, t1);
    let mut replacement = lease("u2", None, LeasePhase::Offered, 1);
    replacement.metadata.name = Some("t-2".into());
    replacement.spec.task_uid = "task-uid".into();
    tracker.observe(&replacement, t1);
    let t2 = t0 + Duration::from_secs(5);
    tracker.forget(&replacement, t2);
    assert_eq!(
        tracker.gone_attempt_left("ns", "t", "task-uid", 2, ttl, t2),
        t0 + ttl - t2,
        "the lost attempt of token 1 may run until a TTL after its last renewal"
    );
    // Another task's departures do not count.
    let mut other = lease("u3", Some("w2"), LeasePhase::Held, 1);
    other.metadata.name = Some("o-1".into());
    other.spec.task_uid = "other-uid".into();
    tracker.observe(&other, t2);
    tracker.forget(&other, t2);
    assert_eq!(
        tracker.gone_attempt_left("ns", "t", "task-uid", 2, ttl, t0 + ttl),
        Duration::ZERO
    );
}

#[test]
fn only_a_new_renew_time_is_a_renewal_after_a_conflict() {
    let cached = lease("u1", Some("w1"), LeasePhase::Held, 100);
    let mut labelled = cached.clone();
    labelled.metadata.labels = Some([("x".to_owned(), "y".to_owned())].into());
    assert!(!renewed_since(&cached, &labelled), "a label is no renewal");
    let renewed = lease("u1", Some("w1"), LeasePhase::Held, 101);
    assert!(renewed_since(&cached, &renewed));
    // Even a renewTime from the past is a change, hence a renewal.
    let old_clock = lease("u1", Some("w1"), LeasePhase::Held, 1);
    assert!(renewed_since(&cached, &old_clock));
    let completed = lease("u1", Some("w1"), LeasePhase::Completed, 100);
    assert!(
        renewed_since(&cached, &completed),
        "ended: leave it to settle"
    );
}

#[test]
fn a_relist_forgets_leases_deleted_while_the_watch_was_down() {
    let tracker = Tracker::default();
    let t0 = Instant::now();
    let mut a = lease("u1", Some("w1"), LeasePhase::Held, 1);
    a.metadata.name = Some("t-1".into());
    let mut b = lease("u2", Some("w1"), LeasePhase::Held, 1);
    b.metadata.name = Some("t-2".into());
    tracker.observe(&a, t0);
    tracker.observe(&b, t0);
    assert_eq!(tracker.leases_of("ns", "t").len(), 2);
    // t-2 was deleted during a disconnect: the relist lists only t-1.
    tracker.list_started();
    tracker.observe(&a, t0 + std::time::Duration::from_secs(1));
    tracker.list_done(t0 + Duration::from_secs(1));
    assert_eq!(tracker.leases_of("ns", "t"), vec!["t-1".to_owned()]);
    assert!(tracker.observation("ns", "t-2").is_none());
    // The relist did not count as a renewal (same renewTime).
    assert_eq!(tracker.observation("ns", "t-1").unwrap().last_renewal, t0);
}

#[test]
fn tracker_indexes_and_forgets() {
    let tracker = Tracker::default();
    let t0 = Instant::now();
    let held = lease("u1", Some("w1"), LeasePhase::Held, 1);
    tracker.observe(&held, t0);
    assert_eq!(tracker.leases_of("ns", "t"), vec!["t-1".to_owned()]);
    assert!(tracker.observation("ns", "t-1").is_some());
    let t1 = t0 + Duration::from_secs(3);
    tracker.touch("ns", "t-1", t1);
    assert_eq!(tracker.observation("ns", "t-1").unwrap().last_renewal, t1);
    tracker.forget(&held, t1);
    assert!(tracker.leases_of("ns", "t").is_empty());
    assert!(tracker.observation("ns", "t-1").is_none());
}

/// Issue 39, defect 2: a holder renewing per worker writes its TaskLease
/// only every refresh period (max(TTL, 120 s)) and learns of the lease's
/// deletion only then; only the Delete-event path allowed for it. A lease
/// a relist no longer lists, and a deleted task's attempt whose departure
/// this process never saw (a new leader), were timed by the TTL alone: the
/// task's lock went to the next task while the old handler still ran.
#[test]
fn a_holder_renewing_per_worker_is_waited_for_after_a_relist_or_unseen() {
    let tracker = Tracker::default();
    let t0 = Instant::now();
    let ttl = Duration::from_secs(30);
    let refresh = batchlease_api::worker_lease::refresh_period(ttl);
    let per_worker = |name: &str, phase| {
        let mut l = lease(&format!("u-{name}"), Some("pod/1"), phase, 1);
        l.metadata.name = Some(name.into());
        l.spec.task_uid = "task-uid".into();
        l.spec.renewal = Some(batchlease_api::Renewal::Worker);
        l
    };
    // Held per worker; and offered where a claim may turn it per worker.
    tracker.observe(&per_worker("t-1", LeasePhase::Held), t0);
    let mut offered = per_worker("t-2", LeasePhase::Offered);
    offered.spec.holder_identity = None;
    offered.spec.renewal = Some(batchlease_api::Renewal::Lease);
    tracker.observe(&offered, t0);
    tracker.list_started();
    let t1 = t0 + Duration::from_secs(20);
    tracker.list_done(t1);
    for name in ["t-1", "t-2"] {
        assert_eq!(
            tracker.departed_until("ns", name),
            Some(t1 + ttl + refresh),
            "{name}: the same rule as holder_stops_by's for a state that may not be the last"
        );
        assert_eq!(
            tracker.departed_until("ns", name),
            holder_stops_by(None, &per_worker(name, LeasePhase::Held), false, t1)
        );
    }
    // A new leader asks about an attempt it never saw depart: the lock's
    // TTL and the refresh period of a holder that may renew per worker.
    let fresh = Tracker::default();
    assert_eq!(
        fresh.gone_attempt_left("ns", "t", "task-uid", 1, ttl, t1),
        ttl + refresh
    );
    assert_eq!(
        fresh.gone_attempt_left("ns", "t", "task-uid", 1, ttl, t1 + ttl),
        refresh
    );
}

/// Issue 39, defect 5: an attempt a worker that renews per worker claimed
/// per lease (its WorkerLease not live yet, or after a 403/422 fallback)
/// takes one of its slots all the same. Counting only the attempts renewed
/// per worker left the worker addressed and bound offers it had no slot
/// for; each went back BoundNoSlot a TTL later and the interruption streak
/// dead-lettered tasks that never ran.
#[test]
fn every_attempt_a_holder_holds_counts_against_its_slots() {
    let tracker = Tracker::default();
    let t0 = Instant::now();
    let named = |name: &str, holder: &str, per_worker: bool, phase| {
        let mut l = lease(&format!("u-{name}"), Some(holder), phase, 1);
        l.metadata.name = Some(name.into());
        l.spec.task_name = name.into();
        l.spec.renewal = per_worker.then_some(batchlease_api::Renewal::Worker);
        l
    };
    tracker.observe(&named("a-1", "pod/1", true, LeasePhase::Held), t0);
    tracker.observe(&named("b-1", "pod/1", false, LeasePhase::Held), t0);
    tracker.observe(&named("c-1", "pod/2", false, LeasePhase::Held), t0);
    assert_eq!(
        tracker.held_count("ns", "pod/1"),
        2,
        "per worker and per lease"
    );
    assert_eq!(tracker.held_count("ns", "pod/2"), 1);
    // Only what is renewed per worker is credited by a WorkerLease renewal.
    assert_eq!(tracker.held_per_worker("ns", "pod/1").len(), 1);
    // A release or an end frees the slot; a relist keeps the count.
    tracker.observe(&named("b-1", "pod/1", false, LeasePhase::Completed), t0);
    assert_eq!(tracker.held_count("ns", "pod/1"), 1);
    tracker.list_started();
    tracker.observe(&named("a-1", "pod/1", true, LeasePhase::Held), t0);
    tracker.observe(&named("c-1", "pod/2", false, LeasePhase::Held), t0);
    tracker.list_done(t0);
    assert_eq!(tracker.held_count("ns", "pod/1"), 1);
    assert_eq!(tracker.held_count("ns", "pod/2"), 1);
}
