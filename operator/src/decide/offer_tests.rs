//! Table tests of [`decide`] on an offer addressed to a worker: when it is
//! addressed again, and what wins over that.

use super::tests::*;

fn addressed(token: i64, to: Option<&str>) -> Arc<TaskLease> {
    let mut l = (*lease(token, LeasePhase::Offered, None)).clone();
    l.spec.offered_to = to.map(Into::into);
    Arc::new(l)
}

#[test]
fn an_addressed_offer_is_moved_when_its_worker_lapsed_or_after_a_ttl() {
    // Leases of the fixture have a 30 s TTL: the claim deadline is 15 s.
    let ready = || task().phase(TaskPhase::Ready, 1);
    type Check = fn(&Decision) -> bool;
    let cases: Vec<(&str, Case, Check)> = vec![
        (
            "unaddressed: waits for any worker's claim",
            Case::new(ready()).leases(vec![addressed(1, None)]),
            |d| matches!(d, Decision::Wait(None)),
        ),
        (
            "addressed, worker live for long, 5 s: waits the rest of its claim deadline",
            Case::new(ready())
                .leases(vec![addressed(1, Some("w/1"))])
                .offer(5, 60),
            |d| matches!(d, Decision::Wait(Some(w)) if *w == Duration::from_secs(10)),
        ),
        (
            "addressed, worker lapses in 3 s: looks again then",
            Case::new(ready())
                .leases(vec![addressed(1, Some("w/1"))])
                .offer(5, 3),
            |d| matches!(d, Decision::Wait(Some(w)) if *w == Duration::from_secs(3)),
        ),
        (
            "addressed, worker live, past its claim deadline: moved (if someone has a slot)",
            Case::new(ready())
                .leases(vec![addressed(1, Some("w/1"))])
                .offer(30, 60),
            |d| matches!(d, Decision::Readdress { lapsed: false, .. }),
        ),
        (
            "addressed, worker lapsed: moved at once",
            Case::new(ready())
                .leases(vec![addressed(1, Some("w/1"))])
                .offer(0, 0),
            |d| matches!(d, Decision::Readdress { lapsed: true, lease } if lease.spec.offered_to.as_deref() == Some("w/1")),
        ),
        (
            "a cancel withdraws it, addressed or not",
            Case::new(ready().spec(|s| s.cancel = true))
                .leases(vec![addressed(1, Some("w/1"))])
                .offer(0, 0),
            |d| {
                matches!(
                    d,
                    Decision::Release {
                        why: ReleaseWhy::Cancelled,
                        ..
                    }
                )
            },
        ),
        (
            "a paused queue withdraws it",
            Case::new(ready())
                .leases(vec![addressed(1, Some("w/1"))])
                .offer(0, 0)
                .queue(QueueGate::Paused),
            |d| {
                matches!(
                    d,
                    Decision::Release {
                        why: ReleaseWhy::QueuePaused,
                        ..
                    }
                )
            },
        ),
        (
            "no view of its address (not an offer any more in the cache): waits",
            Case::new(ready()).leases(vec![addressed(1, Some("w/1"))]),
            |d| matches!(d, Decision::Wait(None)),
        ),
    ];
    for (what, case, ok) in cases {
        let d = case.run();
        assert!(ok(&d), "{what}: got {d:?}");
    }
}

#[test]
fn a_claimed_addressed_offer_is_a_held_lease() {
    // The claim won the race with a re-address: the lease is followed as
    // any held lease, whatever the view of its old address says.
    let mut l = (*lease(1, LeasePhase::Held, Some("w/1"))).clone();
    l.spec.offered_to = Some("w/1".into());
    let d = Case::new(task().phase(TaskPhase::Ready, 1))
        .leases(vec![Arc::new(l)])
        .observed(0, 0)
        .offer(100, 0)
        .run();
    assert!(
        !matches!(d, Decision::Readdress { .. }),
        "a held lease is never re-addressed: {d:?}"
    );
}

/// Issue 39, defect 6: while the operator cannot watch WorkerLeases, a new
/// offer is claimed and renewed per lease (no `spec.renewal`, as an older
/// operator's); otherwise it may be claimed per worker.
#[test]
fn an_offer_allows_renewals_per_worker_only_while_worker_leases_are_watched() {
    let pending = || task().phase(TaskPhase::Pending, 0);
    for (watched, want) in [(true, Some(batchlease_api::Renewal::Lease)), (false, None)] {
        let mut case = Case::new(pending());
        case.per_worker_offers = watched;
        let Decision::Issue { lease, .. } = case.run() else {
            panic!("expected an issue");
        };
        assert_eq!(lease.spec.renewal, want, "watched: {watched}");
    }
}
