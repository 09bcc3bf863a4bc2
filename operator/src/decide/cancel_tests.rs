//! Table tests of [`decide`] for `spec.cancel` and the queue gate
//! (TaskQueue pause, concurrency cap, issue rate).

use super::tests::*;
use batchlease_api::LeaseOutcome;
use batchlease_api::keys::{condition, release_reason};

fn cancelled(t: BatchTask) -> BatchTask {
    t.spec(|s| s.cancel = true)
}

fn released_reason(d: &Decision) -> (&TaskLease, ReleaseWhy) {
    match d {
        Decision::Release { lease, why } => {
            let st = lease.status.as_ref().unwrap();
            assert_eq!(st.phase, Some(LeasePhase::Released));
            assert_eq!(st.reason.as_deref(), Some(why.as_str()));
            (lease, *why)
        }
        other => panic!("expected a release, got {other:?}"),
    }
}

#[test]
fn a_cancelled_task_without_a_lease_ends_at_once() {
    for (name, t) in [
        ("new", cancelled(task())),
        ("pending", cancelled(task().phase(TaskPhase::Pending, 2))),
        (
            "pending in backoff",
            cancelled(task().phase(TaskPhase::Pending, 2).with(|s| {
                s.next_attempt_after = Some(Time(tests::wall(600)));
            })),
        ),
    ] {
        let (st, tr) = into_status(Case::new(t).run());
        assert_eq!(st.phase, Some(TaskPhase::Cancelled), "{name}");
        assert!(st.completion_time.is_some(), "{name}");
        assert_eq!(tr, Transition::Cancelled { holder: None }, "{name}");
        let c = st
            .conditions
            .iter()
            .find(|c| c.type_ == condition::CANCELLED)
            .unwrap();
        assert_eq!(c.status, "True", "{name}");
    }
}

#[test]
fn a_cancelled_task_never_issues_even_when_its_lease_is_gone() {
    let t = cancelled(task().phase(TaskPhase::Ready, 3));
    // The lease is missing: looked up, then its token retired (a create on
    // its way must not become live) — but no new token is issued.
    assert_eq!(
        Case::new(t.clone()).run(),
        Decision::LookUpLease("job-3".into())
    );
    assert!(matches!(
        Case::new(t.clone()).lookup(Lookup::Absent).run(),
        Decision::RetireToken(_)
    ));
    let mut tomb = (*lease(3, LeasePhase::Released, None)).clone();
    tomb.status.as_mut().unwrap().reason = Some(TOKEN_RETIRED.into());
    let tomb = Arc::new(tomb);
    // The lost lease may have been claimed: its holder may run until its
    // kill switch, and no successor's token fences it out of storage. The
    // task waits a TTL (recorded in status, so a restart keeps it).
    let (st, tr) = into_status(Case::new(t.clone()).leases(vec![tomb.clone()]).run());
    assert_eq!(tr, Transition::CancelAwaitsLostHolder);
    assert_eq!(
        st.phase,
        Some(TaskPhase::Ready),
        "the phase stays: the lost attempt's locks still count as held"
    );
    assert_eq!(st.fencing_token, 3, "no token issued after the cancel");
    let lost = st.history.last().unwrap();
    assert_eq!((lost.outcome.as_str(), lost.token), ("Lost", 3));
    // No claim was seen: one may have landed unseen and chosen to be
    // renewed per worker, whose holder learns of the loss only at its next
    // refresh of the lease — a refresh period more.
    assert_eq!(lost.renewal, Some(batchlease_api::Renewal::Worker));
    let ttl = t.spec.lease_duration_seconds;
    let refresh = batchlease_api::worker_lease::refresh_period(Duration::from_secs(
        u64::try_from(ttl).unwrap(),
    ))
    .as_secs();
    let waiting = t.clone().with(|s| *s = st.clone());
    assert_eq!(
        Case::new(waiting.clone()).leases(vec![tomb.clone()]).run(),
        Decision::Wait(Some(Duration::from_secs(
            u64::try_from(ttl).unwrap() + refresh + 1
        ))),
        "recorded once, then waited for"
    );
    // Once the wait is over: Cancelled, still no new token.
    let over = waiting.with(|s| {
        s.history.last_mut().unwrap().end = Some(Time(tests::wall(
            -i64::from(ttl) - i64::try_from(refresh).unwrap() - 2,
        )));
    });
    let (st, tr) = into_status(Case::new(over).leases(vec![tomb]).run());
    assert_eq!(st.phase, Some(TaskPhase::Cancelled));
    assert_eq!(st.fencing_token, 3);
    assert_eq!(tr, Transition::Cancelled { holder: None });
}

#[test]
fn a_cancelled_replacement_waits_for_the_lost_attempt_before_it() {
    // Token 1's lease was deleted while held (Lost, seen 2 s ago); token 2
    // was offered and the cancel withdrew it. The zombie of token 1 may
    // still run, and token 2 never registered to fence it out of storage:
    // the task ends only a TTL after the loss.
    let t = cancelled(task().phase(TaskPhase::Ready, 2).with(|s| {
        s.history.push(batchlease_api::AttemptRecord {
            token: 1,
            holder: Some("w1".into()),
            outcome: "Lost".into(),
            start: None,
            end: Some(Time(tests::wall(-2))),
            reason: Some(LEASE_MISSING.into()),
            lease_duration_seconds: None,
            renewal: None,
        });
    }));
    let mut w = (*lease(2, LeasePhase::Released, None)).clone();
    w.status.as_mut().unwrap().reason = Some(release_reason::CANCELLED.into());
    let w = Arc::new(w);
    let ttl = u64::try_from(t.spec.lease_duration_seconds).unwrap();
    assert_eq!(
        Case::new(t.clone()).leases(vec![w.clone()]).run(),
        Decision::Wait(Some(Duration::from_secs(ttl + 1 - 2)))
    );
    let later = t.with(|s| {
        s.history[0].end = Some(Time(tests::wall(-i64::try_from(ttl).unwrap() - 1)));
    });
    let (st, _) = into_status(Case::new(later).leases(vec![w]).run());
    assert_eq!(st.phase, Some(TaskPhase::Cancelled));
}

/// Issue 22 (2): the lost lease's holder runs on the TTL its lease was
/// issued with; `spec.leaseDurationSeconds` may have been cut since (the
/// recipe: 600 s, lease deleted while Running, then 5 s and cancel). The
/// wait counts from the lease's own TTL, recorded with the token at the
/// issue and copied into the `Lost` entry.
#[test]
fn a_cancelled_task_waits_the_lost_lease_ttl_not_the_edited_one() {
    // Issued under TTL 600 (the issue records it in status).
    let t = task().spec(|s| s.lease_duration_seconds = 600);
    let issued = match Case::new(t.clone().phase(TaskPhase::Pending, 0)).run() {
        Decision::Issue { status, lease, .. } => {
            assert_eq!(lease.spec.lease_duration_seconds, 600);
            status
        }
        other => panic!("expected an issue, got {other:?}"),
    };
    assert_eq!(issued.current_lease_duration_seconds, Some(600));
    // Running; then the lease is deleted, the TTL cut to 5 and the task
    // cancelled.
    let running = t
        .with(|s| {
            *s = (*issued).clone();
            s.phase = Some(TaskPhase::Running);
            s.holder = Some("w1".into());
        })
        .spec(|s| {
            s.lease_duration_seconds = 5;
            s.cancel = true;
        });
    let mut tomb = (*lease(1, LeasePhase::Released, None)).clone();
    tomb.status.as_mut().unwrap().reason = Some(TOKEN_RETIRED.into());
    let tomb = Arc::new(tomb);
    let (st, tr) = into_status(Case::new(running.clone()).leases(vec![tomb.clone()]).run());
    assert_eq!(tr, Transition::CancelAwaitsLostHolder);
    let lost = st.history.last().unwrap();
    assert_eq!(
        (lost.outcome.as_str(), lost.lease_duration_seconds),
        ("Lost", Some(600)),
        "the Lost entry carries the lost lease's TTL"
    );
    // 30 s after the loss (past the edited TTL): still waiting, for the
    // rest of the lease's own TTL.
    let waiting = running.with(|s| {
        *s = st.clone();
        s.history.last_mut().unwrap().end = Some(Time(tests::wall(-30)));
    });
    assert_eq!(
        Case::new(waiting.clone()).leases(vec![tomb.clone()]).run(),
        Decision::Wait(Some(Duration::from_secs(600 + 1 - 30))),
    );
    assert_eq!(
        st.history.last().unwrap().renewal,
        Some(batchlease_api::Renewal::Lease),
        "a holder recorded without how it renews: an older operator's, per lease"
    );
    // Had its holder renewed per worker: a refresh period (600 s) more.
    let per_worker = waiting.clone().with(|s| {
        s.history.last_mut().unwrap().renewal = Some(batchlease_api::Renewal::Worker);
    });
    assert_eq!(
        Case::new(per_worker).leases(vec![tomb.clone()]).run(),
        Decision::Wait(Some(Duration::from_secs(600 + 600 + 1 - 30))),
    );
    // The same for a cancelled task back in Pending (the Lost entry of an
    // earlier attempt).
    let pending = waiting.clone().with(|s| s.phase = Some(TaskPhase::Pending));
    assert_eq!(
        Case::new(pending).run(),
        Decision::Wait(Some(Duration::from_secs(600 + 1 - 30))),
    );
    // A Lost entry written by an earlier release (no TTL recorded) falls
    // back to the task's TTL.
    let legacy = waiting.with(|s| s.history.last_mut().unwrap().lease_duration_seconds = None);
    let (st, _) = into_status(Case::new(legacy).leases(vec![tomb]).run());
    assert_eq!(st.phase, Some(TaskPhase::Cancelled));
}

#[test]
fn a_task_its_queue_holds_back_gives_back_its_locks_first() {
    use crate::locks::{Holder, Slot, lock_name};
    let t = task()
        .phase(TaskPhase::Pending, 2)
        .spec(|s| s.resources = vec!["db".into()]);
    assert_eq!(
        Case::new(t.clone()).queue(QueueGate::Paused).run(),
        Decision::FetchLocks(vec!["db".into()])
    );
    let mut held = k8s_openapi::api::coordination::v1::Lease::default();
    held.metadata.name = Some(lock_name("ns", "db"));
    let slot = |holder| Slot {
        resource: "db".into(),
        name: lock_name("ns", "db"),
        lease: Some(held.clone()),
        holder,
        older_waiter: None,
    };
    assert!(matches!(
        Case::new(t.clone())
            .queue(QueueGate::Full)
            .locks(vec![slot(Holder::Ours { token: 3 })])
            .run(),
        Decision::ReleaseLocks { .. }
    ));
    assert_eq!(
        Case::new(t)
            .queue(QueueGate::Full)
            .locks(vec![slot(Holder::Free)])
            .run(),
        Decision::HeldBack(QueueGate::Full)
    );
}

#[test]
fn an_offered_or_held_lease_of_a_cancelled_task_is_released() {
    let offered = cancelled(task().phase(TaskPhase::Ready, 3));
    let d = Case::new(offered)
        .leases(vec![lease(3, LeasePhase::Offered, None)])
        .run();
    let (l, why) = released_reason(&d);
    assert_eq!(why, ReleaseWhy::Cancelled);
    assert_eq!(
        l.metadata.resource_version.as_deref(),
        Some("rv3"),
        "a CAS on the copy read"
    );

    let running = cancelled(
        task()
            .phase(TaskPhase::Running, 3)
            .with(|s| s.holder = Some("w1".into())),
    );
    let d = Case::new(running)
        .leases(vec![lease(3, LeasePhase::Held, Some("w1"))])
        .observed(0, 10)
        .run();
    let (l, _) = released_reason(&d);
    assert_eq!(
        l.spec.holder_identity.as_deref(),
        Some("w1"),
        "the holder stays named"
    );
}

#[test]
fn a_released_held_lease_ends_the_task_only_a_ttl_after_its_last_renewal() {
    let t = cancelled(
        task()
            .phase(TaskPhase::Running, 3)
            .with(|s| s.holder = Some("w1".into())),
    );
    let mut rel = (*lease(3, LeasePhase::Released, Some("w1"))).clone();
    rel.status.as_mut().unwrap().reason = Some(release_reason::CANCELLED.into());
    let rel = Arc::new(rel);
    let ttl = u64::try_from(rel.spec.lease_duration_seconds).unwrap();
    // The holder may still run (its kill switch fires within 2/3 TTL of
    // its last renewal): wait the rest of the TTL.
    assert_eq!(
        Case::new(t.clone())
            .leases(vec![rel.clone()])
            .observed(1, 20)
            .run(),
        Decision::Wait(Some(Duration::from_secs(ttl - 1)))
    );
    // No observation (cannot happen: the tracker times released held
    // leases): look again soon, never end early.
    assert_eq!(
        Case::new(t.clone()).leases(vec![rel.clone()]).run(),
        Decision::Wait(Some(Duration::from_secs(1)))
    );
    let (st, tr) = into_status(Case::new(t).leases(vec![rel]).observed(ttl, 40).run());
    assert_eq!(st.phase, Some(TaskPhase::Cancelled));
    assert_eq!(st.holder, None);
    assert_eq!(st.attempts, 0, "a cancel spends no retry");
    assert_eq!(st.history.last().unwrap().outcome, "Cancelled");
    assert_eq!(
        tr,
        Transition::Cancelled {
            holder: Some("w1".into())
        }
    );
}

#[test]
fn cancel_meets_an_attempt_that_already_ended() {
    let t = cancelled(
        task()
            .phase(TaskPhase::Running, 3)
            .with(|s| s.holder = Some("w1".into())),
    );
    // A success that landed before the release stands: its result is
    // committed.
    let ok = completed(3, LeaseOutcome::Succeeded, |_| {});
    let (st, _) = into_status(Case::new(t.clone()).leases(vec![ok]).run());
    assert_eq!(st.phase, Some(TaskPhase::Succeeded));
    // A failure, an expiry: cancelled, not retried.
    let failed = completed(3, LeaseOutcome::Failed, |s| s.reason = Some("Boom".into()));
    let (st, _) = into_status(Case::new(t.clone()).leases(vec![failed]).run());
    assert_eq!(st.phase, Some(TaskPhase::Cancelled));
    assert_eq!(st.history.last().unwrap().outcome, "Failed");
    let expired = lease(3, LeasePhase::Expired, Some("w1"));
    let (st, _) = into_status(Case::new(t).leases(vec![expired]).run());
    assert_eq!(st.phase, Some(TaskPhase::Cancelled));
    assert_eq!(st.history.last().unwrap().outcome, "Expired");
}

#[test]
fn cancelled_is_final() {
    let t = cancelled(task().phase(TaskPhase::Cancelled, 3)).spec(|s| s.redrive = 1);
    let (st, tr) = into_status(Case::new(t.clone()).run());
    assert_eq!(
        st.phase,
        Some(TaskPhase::Cancelled),
        "a redrive does not revive it"
    );
    assert_eq!(tr, Transition::RedriveIgnored);
    let t = t.with(|s| s.observed_redrive = 1);
    assert_eq!(Case::new(t).run(), Decision::Wait(None));
}

#[test]
fn the_queue_gate_holds_back_issues() {
    let t = task().phase(TaskPhase::Pending, 2);
    for gate in [
        QueueGate::Paused,
        QueueGate::Full,
        QueueGate::Throttled(Duration::from_millis(250)),
    ] {
        assert_eq!(
            Case::new(t.clone()).queue(gate).run(),
            Decision::HeldBack(gate),
            "{gate:?}"
        );
    }
    assert!(matches!(
        Case::new(t).queue(QueueGate::Open).run(),
        Decision::Issue { .. }
    ));
    // A new task is written Pending first, then waits.
    let (st, _) = into_status(Case::new(task()).queue(QueueGate::Paused).run());
    assert_eq!(st.phase, Some(TaskPhase::Pending));
    // A cancelled task is not held back by its queue: it ends.
    let (st, _) = into_status(Case::new(cancelled(task())).queue(QueueGate::Paused).run());
    assert_eq!(st.phase, Some(TaskPhase::Cancelled));
}

#[test]
fn a_paused_queue_withdraws_offers_but_not_held_leases() {
    let ready = task().phase(TaskPhase::Ready, 3);
    let d = Case::new(ready.clone())
        .leases(vec![lease(3, LeasePhase::Offered, None)])
        .queue(QueueGate::Paused)
        .run();
    assert_eq!(released_reason(&d).1, ReleaseWhy::QueuePaused);
    // A full queue or a rate limit withdraws nothing.
    for gate in [
        QueueGate::Full,
        QueueGate::Throttled(Duration::from_secs(1)),
    ] {
        assert_eq!(
            Case::new(ready.clone())
                .leases(vec![lease(3, LeasePhase::Offered, None)])
                .queue(gate)
                .run(),
            Decision::Wait(None)
        );
    }
    // Held: runs to its end.
    let running = task()
        .phase(TaskPhase::Running, 3)
        .with(|s| s.holder = Some("w1".into()));
    assert_eq!(
        Case::new(running)
            .leases(vec![lease(3, LeasePhase::Held, Some("w1"))])
            .observed(0, 10)
            .queue(QueueGate::Paused)
            .run(),
        Decision::Wait(Some(Duration::from_secs(30)))
    );
    // The withdrawn offer: Pending again, nothing spent.
    let mut w = (*lease(3, LeasePhase::Released, None)).clone();
    w.status.as_mut().unwrap().reason = Some(release_reason::QUEUE_PAUSED.into());
    let (st, tr) = into_status(
        Case::new(ready)
            .leases(vec![Arc::new(w)])
            .queue(QueueGate::Paused)
            .run(),
    );
    assert_eq!(tr, Transition::Withdrawn);
    assert_eq!(st.phase, Some(TaskPhase::Pending));
    assert_eq!((st.attempts, st.next_attempt_after.clone()), (0, None));
    assert!(st.history.is_empty(), "no attempt ran");
    let leased = st
        .conditions
        .iter()
        .find(|c| c.type_ == condition::LEASED)
        .unwrap();
    assert_eq!(leased.reason, "QueuePaused");
}
