use super::*;
use batchlease_api::{Renewal, TaskLeaseSpec, TaskLeaseStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;

fn bound(holder: &str, phase: LeasePhase) -> TaskLease {
    let mut l = TaskLease::new("t-1", TaskLeaseSpec::offered("t", "u", "q", 1, 30));
    l.spec.holder_identity = Some(holder.into());
    l.spec.renewal = Some(Renewal::Worker);
    l.spec.bound_at = Some(MicroTime(Timestamp::from_second(100).unwrap()));
    l.status = Some(TaskLeaseStatus {
        phase: Some(phase),
        ..Default::default()
    });
    l
}

#[test]
fn step_table() {
    let t0 = Instant::now();
    let s = Duration::from_secs;
    let ttl = s(30);
    let k = |cited: Option<u64>, confirmation, per_worker| Known {
        cited: cited.map(|c| t0 + s(c)),
        cited_lost: false,
        confirmation,
        per_worker,
        seen: t0 + s(10),
    };
    let fed = |c: u64| Some(Confirmation::Fed(t0 + s(c)));
    // (known, slot free, now, want)
    let cases = [
        (
            k(Some(0), None, true),
            true,
            s(10),
            Step::Start { sent: t0 },
        ),
        (
            k(Some(0), None, true),
            true,
            s(14),
            Step::Start { sent: t0 },
        ),
        // Half the TTL after the cited send: wait for a renewal.
        (k(Some(0), None, true), true, s(15), Step::Confirm),
        // A renewal this process never sent: never started here.
        (
            k(None, None, true),
            true,
            s(10),
            Step::GiveBack(Why::Unconfirmed),
        ),
        (
            k(None, fed(12), true),
            true,
            s(13),
            Step::GiveBack(Why::Unconfirmed),
        ),
        (
            k(Some(0), None, false),
            true,
            s(10),
            Step::GiveBack(Why::Unconfirmed),
        ),
        (
            k(Some(0), Some(Confirmation::Waiting), true),
            true,
            s(16),
            Step::Confirm,
        ),
        // A renewal that named it is newer than the citation.
        (
            k(Some(0), fed(16), true),
            true,
            s(17),
            Step::Start { sent: t0 + s(16) },
        ),
        (
            k(Some(0), fed(16), true),
            true,
            s(30),
            Step::Start { sent: t0 + s(16) },
        ),
        // Nothing confirmed it within a TTL of its sight: given back.
        (
            k(Some(0), fed(16), true),
            true,
            s(40),
            Step::GiveBack(Why::Unconfirmed),
        ),
        (
            k(Some(0), Some(Confirmation::Waiting), true),
            true,
            s(40),
            Step::GiveBack(Why::Unconfirmed),
        ),
        (
            k(Some(0), Some(Confirmation::Revoked), true),
            true,
            s(11),
            Step::Skip,
        ),
        (
            k(Some(0), Some(Confirmation::Lost), true),
            true,
            s(11),
            Step::GiveBack(Why::Unconfirmed),
        ),
        // No slot: wait while it may still start, and for a TTL at most.
        (
            k(Some(5), None, true),
            false,
            s(11),
            Step::Wait { until: t0 + s(20) },
        ),
        (
            k(Some(0), fed(30), true),
            false,
            s(31),
            Step::Wait { until: t0 + s(40) },
        ),
        (
            k(Some(0), fed(30), true),
            false,
            s(40),
            Step::GiveBack(Why::NoSlot),
        ),
        (k(Some(0), None, true), false, s(16), Step::Confirm),
    ];
    // The cited renewal went to a WorkerLease since found gone: never
    // started, not even from a renewal of the one created again.
    let lost = Known {
        cited_lost: true,
        ..k(Some(0), fed(16), true)
    };
    assert_eq!(
        step(ttl, lost, true, t0 + s(17)),
        Step::GiveBack(Why::Unconfirmed)
    );
    for (known, free, at, want) in cases {
        assert_eq!(
            step(ttl, known, free, t0 + at),
            want,
            "{known:?} {free} {at:?}"
        );
    }
}

#[test]
fn bound_means_created_held_by_us() {
    assert!(is_bound_to(&bound("w/1", LeasePhase::Held), "w/1"));
    assert!(
        !is_bound_to(&bound("w/2", LeasePhase::Held), "w/1"),
        "another worker's"
    );
    assert!(
        !is_bound_to(&bound("w/1", LeasePhase::Completed), "w/1"),
        "ended"
    );
    let mut claimed = bound("w/1", LeasePhase::Held);
    claimed.spec.bound_at = None;
    assert!(!is_bound_to(&claimed, "w/1"), "claimed, not bound");
}

#[test]
fn the_cited_renewal_is_found_only_among_our_sends() {
    let leases = WorkerLeases::default();
    let t0 = Instant::now();
    let l = bound("w/1", LeasePhase::Held);
    assert_eq!(cited_send(&l, Some(&leases)), None);
    leases.record_sent(Timestamp::from_second(99).unwrap(), t0);
    assert_eq!(cited_send(&l, Some(&leases)), None, "another renewal");
    leases.record_sent(
        Timestamp::from_second(100).unwrap(),
        t0 + Duration::from_secs(1),
    );
    assert_eq!(
        cited_send(&l, Some(&leases)),
        Some(t0 + Duration::from_secs(1))
    );
    assert_eq!(cited_send(&l, None), None, "not renewing per worker");
}

fn store_of(leases: &[TaskLease]) -> Store<TaskLease> {
    let (reader, mut writer) = kube::runtime::reflector::store();
    for l in leases {
        writer.apply_watcher_event(&kube::runtime::watcher::Event::Apply(l.clone()));
    }
    reader
}

fn with_uid(mut l: TaskLease, uid: &str) -> TaskLease {
    l.metadata.uid = Some(uid.into());
    l.metadata.namespace = Some("ns".into());
    l
}

/// A bound lease once taken is never waiting again, even when it
/// leaves both watches and comes back (its worker label removed and
/// put back moves it from one watch to the other); one running in this
/// process never is; and a second registration of a running attempt is
/// refused without ending the first's.
#[test]
fn a_taken_or_running_bound_attempt_is_never_waiting_again() {
    let now = Instant::now();
    let l = with_uid(bound("w/1", LeasePhase::Held), "u1");
    let a = AttemptRef::of(&l);
    let mut taken = HashMap::new();
    assert_eq!(
        waiting(
            &[store_of(std::slice::from_ref(&l))],
            "w/1",
            &mut taken,
            None,
            now
        )
        .len(),
        1
    );
    taken.insert(a.clone(), now);
    // Gone from every store, then back in the other one.
    assert!(waiting(&[store_of(&[])], "w/1", &mut taken, None, now).is_empty());
    let back = [store_of(&[]), store_of(std::slice::from_ref(&l))];
    assert!(
        waiting(&back, "w/1", &mut taken, None, now).is_empty(),
        "a tombstone"
    );
    // Forgotten only past any TTL.
    let later = now + TAKEN_KEPT + Duration::from_secs(1);
    assert_eq!(waiting(&back, "w/1", &mut taken, None, later).len(), 1);
    // Running (registered): not waiting, whatever `taken` says.
    let leases = WorkerLeases::default();
    leases.set_live_for_tests();
    let fence = || {
        crate::fence::Fence::new(
            1,
            crate::fence::KillClock::new(Duration::from_secs(30), now, None).per_worker(),
        )
    };
    let first = fence();
    let running = leases.register(a.clone(), first.clone(), now);
    let mut none = HashMap::new();
    assert!(waiting(&back, "w/1", &mut none, Some(&leases), now).is_empty());
    let second = fence();
    let again = leases.register(a.clone(), second.clone(), now);
    assert!(second.killed().is_cancelled(), "a second start is refused");
    assert!(!first.killed().is_cancelled());
    drop(again);
    assert!(leases.is_registered(&a), "the running one keeps its entry");
    drop(running);
    assert!(!leases.is_registered(&a));
}
