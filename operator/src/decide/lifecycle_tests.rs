//! Table tests of [`decide`] through a task's life up to its attempt's
//! end: the first write, the issue, the claim, expiry, and the races
//! (renewal vs. expiry, two claims, a crash between issue and lease
//! creation, a stale cache).

use super::tests::*;

#[test]
fn a_new_task_is_issued_in_its_first_write() {
    // No status yet: the first status is folded into the issue (one write
    // instead of two).
    let d = Case::new(task().spec(|s| {
        s.mode = TaskMode::Speculative;
        s.redrive = 2;
    }))
    .run();
    let Decision::Issue {
        status,
        lease,
        cause,
    } = d
    else {
        panic!("expected an issue, got {d:?}")
    };
    assert_eq!(status.phase, Some(TaskPhase::Ready));
    assert_eq!(status.fencing_token, 1);
    assert_eq!(status.effective_mode, Some(TaskMode::Speculative));
    assert_eq!(
        status.observed_redrive, 2,
        "a raised redrive is not replayed"
    );
    assert_eq!(lease.spec.fencing_token, 1);
    assert_eq!(cause, IssueCause::New);
}

#[test]
fn a_new_task_that_must_wait_writes_why_in_its_first_write() {
    // Dependencies unfinished: the first status carries the condition.
    let d = Case::new(task().spec(|s| s.depends_on = vec!["extract".into()]))
        .deps(Readiness::Waiting {
            missing: vec![],
            unfinished: vec!["extract".into()],
        })
        .run();
    let (st, tr) = status_of(&d);
    assert_eq!(st.phase, Some(TaskPhase::Pending));
    assert_eq!(st.effective_mode, Some(TaskMode::Exclusive));
    assert_eq!(*tr, Transition::WaitingForDependencies);
    assert!(
        st.conditions
            .iter()
            .any(|c| c.type_ == batchlease_api::keys::condition::WAITING_FOR_DEPENDENCIES)
    );
}

#[test]
fn a_new_task_with_resources_is_written_pending_first() {
    // Only a Pending task counts as a waiter for its locks (fairness).
    for mode in [TaskMode::Exclusive, TaskMode::Speculative] {
        let d = Case::new(task().spec(|s| {
            s.mode = mode;
            s.resources = vec!["db".into()];
        }))
        .run();
        let (st, tr) = status_of(&d);
        assert_eq!(st.phase, Some(TaskPhase::Pending), "{mode:?}");
        assert_eq!(st.effective_mode, Some(mode));
        assert_eq!(st.fencing_token, 0);
        assert_eq!(*tr, Transition::Initialized);
    }
}

#[test]
fn a_new_task_held_for_workers_slots_is_not_written_until_its_issue() {
    assert_eq!(
        Case::new(task()).queue(QueueGate::WorkerSlots).run(),
        Decision::HeldBack(QueueGate::WorkerSlots)
    );
    // A TaskQueue's hold may be long: the task is written Pending first.
    for gate in [QueueGate::Full, QueueGate::Paused] {
        let d = Case::new(task()).queue(gate).run();
        let (st, tr) = status_of(&d);
        assert_eq!(st.phase, Some(TaskPhase::Pending), "{gate:?}");
        assert_eq!(*tr, Transition::Initialized);
    }
    // A spawned child's first write is its admission (its parent's end
    // waits for it): written Pending even while it waits for slots.
    let mut child = task();
    child.metadata.labels = Some(
        [(
            batchlease_api::keys::LABEL_PARENT.to_owned(),
            "p".to_owned(),
        )]
        .into(),
    );
    child.metadata.owner_references = Some(vec![
        k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
            api_version: "batchlease.dev/v1alpha1".into(),
            kind: "BatchTask".into(),
            name: "p".into(),
            uid: "p-uid".into(),
            controller: Some(true),
            ..Default::default()
        },
    ]);
    let d = Case::new(child).queue(QueueGate::WorkerSlots).run();
    assert_eq!(status_of(&d).0.phase, Some(TaskPhase::Pending));
    // Once Pending, a task held for slots is held without a write.
    assert_eq!(
        Case::new(task().phase(TaskPhase::Pending, 0))
            .queue(QueueGate::WorkerSlots)
            .run(),
        Decision::HeldBack(QueueGate::WorkerSlots)
    );
}

#[test]
fn pending_issues_the_next_token() {
    let d = Case::new(task().phase(TaskPhase::Pending, 4)).run();
    let Decision::Issue {
        status,
        lease,
        cause,
    } = d
    else {
        panic!("{d:?}")
    };
    assert_eq!(status.fencing_token, 5);
    assert_eq!(status.phase, Some(TaskPhase::Ready));
    assert_eq!(status.current_lease.as_deref(), Some("job-5"));
    assert_eq!(lease.spec.fencing_token, 5);
    assert_eq!(lease.metadata.name.as_deref(), Some("job-5"));
    assert_eq!(
        lease.status.as_ref().unwrap().phase,
        Some(LeasePhase::Offered)
    );
    assert_eq!(lease.spec.task_uid, "uid-job");
    let owner = &lease.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.uid.as_str(), owner.controller),
        ("BatchTask", "uid-job", Some(true))
    );
    assert_eq!(cause, IssueCause::New);
}

#[test]
fn pending_waits_for_backoff() {
    let d = Case::new(
        task()
            .phase(TaskPhase::Pending, 1)
            .with(|s| s.next_attempt_after = Some(Time(wall(7)))),
    )
    .run();
    assert_eq!(d, Decision::Wait(Some(Duration::from_secs(7))));
    // Elapsed backoff issues.
    let d = Case::new(
        task()
            .phase(TaskPhase::Pending, 1)
            .with(|s| s.next_attempt_after = Some(Time(wall(-1)))),
    )
    .run();
    assert!(matches!(d, Decision::Issue { .. }), "{d:?}");
}

#[test]
fn a_missing_current_lease_is_looked_up_then_replaced_under_a_new_token() {
    // Status says Ready (or Running) with token 3, but the cache has no job-3:
    // the watch may lag, the process may have died between the two writes of
    // an issue, or someone deleted a lease a worker had already claimed.
    for phase in [TaskPhase::Ready, TaskPhase::Running] {
        let t = task()
            .phase(phase, 3)
            .with(|s| s.holder = (phase == TaskPhase::Running).then(|| "w1".into()));
        let old = vec![lease(2, LeasePhase::Expired, Some("w"))];
        // Cache only: read it directly before believing it is gone.
        let d = Case::new(t.clone()).leases(old.clone()).run();
        assert_eq!(d, Decision::LookUpLease("job-3".into()), "{phase:?}");
        // This process created it a moment ago: wait for the watch.
        let d = Case::new(t.clone())
            .leases(old.clone())
            .lookup(Lookup::Creating)
            .run();
        assert_eq!(d, Decision::Wait(Some(CREATE_SETTLE)), "{phase:?}");
        // Absent: the name is occupied by a final tombstone first, so a
        // create of job-3 still on its way can never become a live lease.
        let d = Case::new(t.clone())
            .leases(old.clone())
            .lookup(Lookup::Absent)
            .run();
        let Decision::RetireToken(stone) = d else {
            panic!("{d:?}")
        };
        assert_eq!(stone.metadata.name.as_deref(), Some("job-3"));
        assert_eq!(stone.spec.fencing_token, 3);
        let sst = stone.status.as_ref().unwrap();
        assert_eq!(
            (sst.phase, sst.reason.as_deref()),
            (Some(LeasePhase::Released), Some(TOKEN_RETIRED))
        );
        // With the tombstone in place: never recreate job-3 (token 3 may
        // have been claimed); issue 4.
        let mut with_stone = old.clone();
        with_stone.push(Arc::new(*stone));
        let d = Case::new(t).leases(with_stone).run();
        let Decision::Issue {
            status,
            lease,
            cause,
        } = d
        else {
            panic!("{d:?}")
        };
        assert_eq!(cause, IssueCause::Replaced);
        assert_eq!(lease.spec.fencing_token, 4, "a token is used once");
        assert_eq!(lease.metadata.name.as_deref(), Some("job-4"));
        assert_eq!(
            (status.fencing_token, status.phase, status.holder.as_deref()),
            (4, Some(TaskPhase::Ready), None)
        );
        assert_eq!(status.attempts, 0, "losing a lease spends no retry");
        let lost: Vec<_> = status
            .history
            .iter()
            .map(|h| (h.token, h.outcome.as_str(), h.reason.as_deref()))
            .collect();
        // Ready too: the lease may have been claimed before the Running
        // write (a cancel must wait for such a holder). With no holder seen,
        // it may also never have been created (an operator stopped between
        // the status write and the create): the reason says only what is
        // known.
        let reason = match phase {
            TaskPhase::Running => "LeaseMissing",
            _ => "OfferMissing",
        };
        assert_eq!(lost, [(3, "Lost", Some(reason))], "{phase:?}");
    }
}

#[test]
fn a_forged_or_stale_lease_under_the_current_name_is_not_the_current_lease() {
    let t = task().phase(TaskPhase::Ready, 3);
    let forge = |f: &dyn Fn(&mut TaskLease)| {
        let mut l = (*lease(3, LeasePhase::Held, Some("mallory"))).clone();
        f(&mut l);
        Arc::new(l)
    };
    let forgeries = [
        forge(&|l| l.spec.fencing_token = i64::MAX),
        forge(&|l| l.spec.task_uid = "uid-older-incarnation".into()),
        forge(&|l| l.metadata.owner_references = None),
    ];
    for f in forgeries {
        // Never followed (no "Claimed" by mallory): looked up, and when the
        // read shows the same forgery, replaced under a new token.
        let d = Case::new(t.clone())
            .leases(vec![f.clone()])
            .observed(0, 0)
            .run();
        assert_eq!(d, Decision::LookUpLease("job-3".into()));
        let d = Case::new(t.clone())
            .leases(vec![f])
            .lookup(Lookup::Occupied)
            .run();
        assert!(
            matches!(&d, Decision::Issue { lease, cause: IssueCause::Replaced, .. } if lease.spec.fencing_token == 4),
            "{d:?}"
        );
    }
}

#[test]
fn a_live_lease_that_is_not_current_is_ended() {
    // A stale operator's late create left job-4 Offered (or claimed) after
    // the task moved on to token 5: it is expired so no holder keeps it.
    let t = task().phase(TaskPhase::Ready, 5);
    for phase in [LeasePhase::Offered, LeasePhase::Held] {
        let d = Case::new(t.clone())
            .leases(vec![
                lease(4, phase, Some("w1")),
                lease(5, LeasePhase::Offered, None),
            ])
            .run();
        let Decision::Expire { lease, reason } = d else {
            panic!("{d:?}")
        };
        assert_eq!(reason, ExpiryReason::NotCurrentLease);
        assert_eq!(lease.metadata.name.as_deref(), Some("job-4"));
        assert_eq!(
            lease.status.as_ref().unwrap().phase,
            Some(LeasePhase::Expired)
        );
    }
    // A lease of a newer token than the cached task knows: the task cache
    // lags (the lease watch delivered first). Never touched.
    let d = Case::new(t.clone())
        .leases(vec![
            lease(5, LeasePhase::Offered, None),
            lease(6, LeasePhase::Held, Some("w2")),
        ])
        .run();
    assert_eq!(d, Decision::Wait(None), "{d:?}");
    // Final leases and leases the task does not control are left alone.
    let mut foreign = (*lease(4, LeasePhase::Held, Some("m"))).clone();
    foreign.metadata.owner_references = None;
    let d = Case::new(t)
        .leases(vec![
            Arc::new(foreign),
            lease(3, LeasePhase::Expired, Some("w")),
            lease(5, LeasePhase::Offered, None),
        ])
        .run();
    assert_eq!(d, Decision::Wait(None));
}

#[test]
fn offered_lease_waits_for_a_claim() {
    let d = Case::new(task().phase(TaskPhase::Ready, 1))
        .leases(vec![lease(1, LeasePhase::Offered, None)])
        .run();
    assert_eq!(d, Decision::Wait(None));
}

#[test]
fn claim_moves_the_task_to_running() {
    let d = Case::new(task().phase(TaskPhase::Ready, 1))
        .leases(vec![lease(1, LeasePhase::Held, Some("w1"))])
        .observed(0, 0)
        .run();
    let (st, tr) = status_of(&d);
    assert_eq!(st.phase, Some(TaskPhase::Running));
    assert_eq!(st.holder.as_deref(), Some("w1"));
    assert_eq!(
        *tr,
        Transition::Claimed {
            holder: "w1".into()
        }
    );
}

#[test]
fn two_claims_only_the_winner_is_followed() {
    // Two workers raced; the API server let exactly one CAS through. The
    // operator only ever sees the winner in the lease.
    let d = Case::new(task().phase(TaskPhase::Ready, 1))
        .leases(vec![lease(1, LeasePhase::Held, Some("winner"))])
        .observed(0, 0)
        .run();
    assert_eq!(status_of(&d).0.holder.as_deref(), Some("winner"));
}

#[test]
fn a_bound_attempt_never_named_expires_as_not_taken() {
    let t = task()
        .phase(TaskPhase::Ready, 1)
        .with(|s| s.holder = Some("w1".into()));
    let mut l = (*lease(1, LeasePhase::Held, Some("w1"))).clone();
    l.spec.bound_at = l.spec.renew_time.clone();
    let l = Arc::new(l);
    let reason = |named: bool, bound: &Arc<TaskLease>| {
        let mut c = Case::new(t.clone())
            .leases(vec![bound.clone()])
            .observed(31, 31);
        if named {
            c = c.named();
        }
        match c.run() {
            Decision::Expire { reason, .. } => reason,
            d => panic!("{d:?}"),
        }
    };
    assert_eq!(reason(false, &l), ExpiryReason::BoundNotTaken);
    assert_eq!(
        reason(true, &l),
        ExpiryReason::LeaseExpired,
        "its worker took it"
    );
    let claimed = lease(1, LeasePhase::Held, Some("w1"));
    assert_eq!(
        reason(false, &claimed),
        ExpiryReason::LeaseExpired,
        "a claim is a take"
    );
    // Written by its holder (a refresh, a per-lease renewal): taken.
    let mut written = (*l).clone();
    written.spec.renew_time = Some(MicroTime(wall(5)));
    assert_eq!(
        reason(false, &Arc::new(written)),
        ExpiryReason::LeaseExpired
    );
}

#[test]
fn a_bound_attempt_is_running_only_once_taken() {
    let t = task().phase(TaskPhase::Ready, 1);
    let mut l = (*lease(1, LeasePhase::Held, Some("w1"))).clone();
    l.spec.bound_at = l.spec.renew_time.clone();
    let case = || {
        Case::new(t.clone())
            .leases(vec![Arc::new(l.clone())])
            .observed(2, 2)
            .running_after(Duration::from_secs(1))
    };
    // Not named yet: no write, looked at again soon.
    assert_eq!(case().run(), Decision::Wait(Some(Duration::from_secs(1))));
    // Named by a renewal: Running, with its holder.
    assert_eq!(
        status_of(&case().named().run()).0.holder.as_deref(),
        Some("w1")
    );
}

#[test]
fn held_lease_expiry_table() {
    // (ttl, since renewal, since claim, deadline, expected)
    type Row = (i32, u64, u64, Option<i64>, Result<Duration, ExpiryReason>);
    let cases: Vec<Row> = vec![
        (30, 0, 0, None, Ok(Duration::from_secs(30))),
        (30, 29, 100, None, Ok(Duration::from_secs(1))),
        (30, 30, 100, None, Err(ExpiryReason::LeaseExpired)),
        (30, 31, 100, None, Err(ExpiryReason::LeaseExpired)),
        (30, 5, 55, Some(60), Ok(Duration::from_secs(5))),
        (
            30,
            5,
            60,
            Some(60),
            Err(ExpiryReason::ActiveDeadlineExceeded),
        ),
        (5, 2, 2, Some(600), Ok(Duration::from_secs(3))),
    ];
    for (ttl, since_renewal, since_claim, deadline, want) in cases {
        let t = task()
            .phase(TaskPhase::Running, 1)
            .with(|s| s.holder = Some("w1".into()))
            .spec(|s| {
                s.lease_duration_seconds = ttl;
                s.active_deadline_seconds = deadline;
            });
        let mut l = (*lease(1, LeasePhase::Held, Some("w1"))).clone();
        l.spec.lease_duration_seconds = ttl;
        let d = Case::new(t)
            .leases(vec![Arc::new(l)])
            .observed(since_renewal, since_claim)
            .run();
        match (want, d) {
            (Ok(w), Decision::Wait(Some(got))) => {
                assert_eq!(got, w, "ttl={ttl} r={since_renewal} c={since_claim}")
            }
            (Err(reason), Decision::Expire { lease, reason: got }) => {
                assert_eq!(got, reason);
                let st = lease.status.unwrap();
                assert_eq!(st.phase, Some(LeasePhase::Expired));
                assert_eq!(st.reason.as_deref(), Some(reason.as_str()));
                assert_eq!(
                    lease.metadata.resource_version.as_deref(),
                    Some("rv1"),
                    "expiry is a CAS on the read version"
                );
            }
            (w, d) => panic!("ttl={ttl} r={since_renewal} c={since_claim}: want {w:?}, got {d:?}"),
        }
    }
}

#[test]
fn renewal_observed_just_in_time_prevents_expiry() {
    // The race renewal vs. expiry, decided by observation: a renewal seen
    // 1 s ago restarts the clock whatever renewTime says.
    let t = task()
        .phase(TaskPhase::Running, 1)
        .with(|s| s.holder = Some("w1".into()));
    let d = Case::new(t)
        .leases(vec![lease(1, LeasePhase::Held, Some("w1"))])
        .observed(1, 500)
        .run();
    assert_eq!(d, Decision::Wait(Some(Duration::from_secs(29))));
}

#[test]
fn a_silent_claim_expires_even_before_running_is_written() {
    // The task still says Ready (its Running write not made yet) while the
    // lease is Held and silent for longer than the TTL: expire at once —
    // Running is informational and must not postpone expiry — and the
    // settle that follows records the claim in the history from the lease.
    let t = task().phase(TaskPhase::Ready, 1);
    let d = Case::new(t.clone())
        .leases(vec![lease(1, LeasePhase::Held, Some("w1"))])
        .observed(60, 60)
        .run();
    assert!(matches!(d, Decision::Expire { .. }), "{d:?}");
    let (st, tr) = into_status(
        Case::new(t)
            .leases(vec![lease(1, LeasePhase::Expired, Some("w1"))])
            .run(),
    );
    assert!(
        matches!(tr, Transition::Retry { expired: true, .. }),
        "{tr:?}"
    );
    let h = st.history.last().unwrap();
    assert_eq!(
        (h.outcome.as_str(), h.holder.as_deref()),
        ("Expired", Some("w1"))
    );
}

#[test]
fn running_is_written_once_the_claim_is_old_enough() {
    // (claim seen for s, renewal seen s ago, TTL 30 s unless a deadline,
    //  running_after s, expected)
    let t = task().phase(TaskPhase::Ready, 1);
    let held = || vec![lease(1, LeasePhase::Held, Some("w"))];
    let wait = |s: u64| Decision::Wait(Some(Duration::from_secs(s)));
    // Too young: come back when it is due.
    assert_eq!(
        Case::new(t.clone())
            .leases(held())
            .observed(0, 0)
            .running_after(Duration::from_secs(2))
            .run(),
        wait(2)
    );
    assert_eq!(
        Case::new(t.clone())
            .leases(held())
            .observed(1, 1)
            .running_after(Duration::from_secs(2))
            .run(),
        wait(1)
    );
    // Due: Running with the holder.
    let (st, tr) = into_status(
        Case::new(t.clone())
            .leases(held())
            .observed(2, 2)
            .running_after(Duration::from_secs(2))
            .run(),
    );
    assert_eq!(
        (st.phase, st.holder.as_deref()),
        (Some(TaskPhase::Running), Some("w"))
    );
    assert_eq!(tr, Transition::Claimed { holder: "w".into() });
    // A delay beyond half the TTL is cut to half the TTL (15 s of 30 s),
    // so it never postpones expiry.
    assert_eq!(
        Case::new(t.clone())
            .leases(held())
            .observed(0, 0)
            .running_after(Duration::from_secs(600))
            .run(),
        wait(15)
    );
    // An expiry due first wins over the informational write.
    let d = Case::new(t.clone())
        .leases(held())
        .observed(30, 30)
        .running_after(Duration::from_secs(600))
        .run();
    assert!(matches!(d, Decision::Expire { .. }), "{d:?}");
    // An active deadline sooner than the delay: the wait ends at it.
    let mut short = t.clone();
    short.spec.active_deadline_seconds = Some(3);
    assert_eq!(
        Case::new(short)
            .leases(held())
            .observed(1, 1)
            .running_after(Duration::from_secs(10))
            .run(),
        wait(2)
    );
}

#[test]
fn a_completion_before_the_running_write_settles_straight_from_ready() {
    let t = task().phase(TaskPhase::Ready, 1);
    let (st, tr) = into_status(
        Case::new(t)
            .leases(vec![completed(1, LeaseOutcome::Succeeded, |_| {})])
            .running_after(Duration::from_secs(1))
            .run(),
    );
    assert_eq!(st.phase, Some(TaskPhase::Succeeded));
    assert_eq!(tr, Transition::Succeeded);
    assert_eq!(st.history.len(), 1);
}
