//! Table tests of [`decide`] settling an ended attempt: success, retries
//! with backoff, dead-lettering, interruptions, speculative aborts.

use super::tests::*;

#[test]
fn success_settles_the_task() {
    let t = task()
        .phase(TaskPhase::Running, 2)
        .with(|s| s.holder = Some("w1".into()));
    let l = completed(2, LeaseOutcome::Succeeded, |s| {
        s.result =
            Some(batchlease_api::JsonObject::try_from(serde_json::json!({"rows": 7})).unwrap());
        s.checkpoint =
            Some(batchlease_api::JsonObject::try_from(serde_json::json!({"step": 9})).unwrap());
    });
    let d = Case::new(t).leases(vec![l]).run();
    let (st, tr) = status_of(&d);
    assert_eq!(*tr, Transition::Succeeded);
    assert_eq!(st.phase, Some(TaskPhase::Succeeded));
    assert_eq!(
        st.result,
        Some(batchlease_api::JsonObject::try_from(serde_json::json!({"rows": 7})).unwrap())
    );
    assert_eq!(st.holder, None);
    assert_eq!(st.fencing_token, 2);
    assert_eq!(st.history.last().unwrap().outcome, "Succeeded");
    assert!(
        st.conditions
            .iter()
            .any(|c| c.type_ == "Succeeded" && c.status == "True")
    );
}

#[test]
fn failures_retry_with_growing_backoff_then_dead_letter() {
    let spec = |s: &mut BatchTaskSpec| {
        s.max_retries = 2;
        s.backoff = batchlease_api::BackoffSpec {
            initial_seconds: 2,
            max_seconds: 5,
            multiplier: 2,
        };
    };
    // (attempts before, expected: delay seconds or dead-letter)
    for (attempts, want) in [(0, Some(2)), (1, Some(4)), (2, None)] {
        let t = task()
            .spec(spec)
            .phase(TaskPhase::Running, attempts + 1)
            .with(|s| {
                s.attempts = attempts as i32;
                s.holder = Some("w1".into());
            });
        let l = completed(attempts + 1, LeaseOutcome::Failed, |s| {
            s.reason = Some("Boom".into());
            s.message = Some("it broke".into());
            s.checkpoint =
                Some(batchlease_api::JsonObject::try_from(serde_json::json!({"step": 3})).unwrap());
        });
        let d = Case::new(t).leases(vec![l]).run();
        let (st, tr) = status_of(&d);
        assert_eq!(st.attempts, attempts as i32 + 1);
        let failure = st.last_failure.as_ref().unwrap();
        assert_eq!(
            (
                failure.reason.as_str(),
                failure.message.as_str(),
                failure.token
            ),
            ("Boom", "it broke", attempts + 1)
        );
        assert_eq!(
            st.checkpoint,
            Some(batchlease_api::JsonObject::try_from(serde_json::json!({"step": 3})).unwrap()),
            "progress is handed to the next attempt"
        );
        match want {
            Some(delay) => {
                assert_eq!(st.phase, Some(TaskPhase::Pending));
                assert_eq!(st.next_attempt_after, Some(Time(wall(delay))));
                assert!(
                    matches!(tr, Transition::Retry { expired: false, .. }),
                    "{tr:?}"
                );
            }
            None => {
                assert_eq!(st.phase, Some(TaskPhase::DeadLettered));
                assert_eq!(st.next_attempt_after, None);
                assert_eq!(
                    *tr,
                    Transition::DeadLettered {
                        reason: "Boom".into(),
                        expired: false
                    }
                );
            }
        }
    }
}

#[test]
fn backoff_respects_max_seconds_with_jitter() {
    let t = task()
        .spec(|s| {
            s.max_retries = 50;
            s.backoff = batchlease_api::BackoffSpec {
                initial_seconds: 1,
                max_seconds: 10,
                multiplier: 10,
            };
        })
        .phase(TaskPhase::Running, 5)
        .with(|s| s.attempts = 4);
    let mut c = Case::new(t).leases(vec![completed(5, LeaseOutcome::Failed, |_| {})]);
    c.jitter = 0.999;
    let (st, _) = into_status(c.run());
    let after = st.next_attempt_after.as_ref().unwrap().0;
    let delay = after.duration_since(wall(0)).as_secs_f64();
    assert!(
        (10.0..=15.0).contains(&delay),
        "delay {delay} outside [max, 1.5·max]"
    );
}

#[test]
fn next_attempt_after_is_rounded_up_never_down() {
    // metav1.Time keeps whole seconds: a deadline truncated on the wire
    // would let the retry start before the announced backoff.
    let t = task()
        .spec(|s| {
            s.backoff = batchlease_api::BackoffSpec {
                initial_seconds: 1,
                max_seconds: 10,
                multiplier: 2,
            };
        })
        .phase(TaskPhase::Running, 1);
    for (jitter, want) in [(0.0, 1), (0.2, 2), (0.999, 2)] {
        let mut c = Case::new(t.clone()).leases(vec![completed(1, LeaseOutcome::Failed, |_| {})]);
        c.jitter = jitter;
        let (st, _) = into_status(c.run());
        let at = st.next_attempt_after.unwrap().0;
        assert_eq!(at, wall(want), "jitter {jitter}");
        // What the API server will store is what the operator computed.
        let json = serde_json::to_value(Time(at)).unwrap();
        let back: Time = serde_json::from_value(json).unwrap();
        assert_eq!(back.0, at);
    }
}

#[test]
fn permanent_failure_dead_letters_at_once() {
    let t = task()
        .spec(|s| s.max_retries = 10)
        .phase(TaskPhase::Running, 1);
    let l = completed(1, LeaseOutcome::Failed, |s| {
        s.permanent = true;
        s.reason = Some("BadInput".into());
    });
    let (st, tr) = into_status(Case::new(t).leases(vec![l]).run());
    assert_eq!(st.phase, Some(TaskPhase::DeadLettered));
    assert_eq!(st.attempts, 1);
    assert_eq!(
        tr,
        Transition::DeadLettered {
            reason: "BadInput".into(),
            expired: false
        }
    );
}

#[test]
fn a_non_retryable_reason_dead_letters_at_once_and_another_retries() {
    let policy = |s: &mut batchlease_api::BatchTaskSpec| {
        s.max_retries = 10;
        s.retry_policy.non_retryable_reasons =
            vec!["BadInput".into(), "ActiveDeadlineExceeded".into()];
    };
    // (the lease's phase and reason, dead-lettered?)
    for (phase, reason, dead) in [
        (LeasePhase::Completed, "BadInput", true),
        (LeasePhase::Completed, "Flaky", false),
        (LeasePhase::Expired, "ActiveDeadlineExceeded", true),
        (LeasePhase::Expired, "LeaseExpired", false),
    ] {
        let t = task()
            .spec(policy)
            .phase(TaskPhase::Running, 1)
            .with(|s| s.holder = Some("w1".into()));
        let l = if phase == LeasePhase::Completed {
            completed(1, LeaseOutcome::Failed, |s| s.reason = Some(reason.into()))
        } else {
            let mut l = lease(1, LeasePhase::Expired, Some("w1"));
            std::sync::Arc::make_mut(&mut l)
                .status
                .get_or_insert_with(Default::default)
                .reason = Some(reason.into());
            l
        };
        let (st, tr) = into_status(Case::new(t).leases(vec![l]).run());
        assert_eq!(st.attempts, 1, "{reason}");
        if dead {
            assert_eq!(st.phase, Some(TaskPhase::DeadLettered), "{reason}");
            assert!(
                matches!(&tr, Transition::DeadLettered { reason: r, .. } if r == reason),
                "{reason}: {tr:?}"
            );
            let cond = st
                .conditions
                .iter()
                .find(|c| c.type_ == "DeadLettered")
                .unwrap();
            assert!(cond.message.contains("nonRetryableReasons"), "{cond:?}");
        } else {
            assert_eq!(st.phase, Some(TaskPhase::Pending), "{reason}");
            assert!(matches!(tr, Transition::Retry { .. }), "{reason}: {tr:?}");
        }
    }
}

#[test]
fn expired_lease_is_retried_and_the_next_issue_is_a_reassignment() {
    let t = task()
        .phase(TaskPhase::Running, 1)
        .with(|s| s.holder = Some("w1".into()));
    let d = Case::new(t)
        .leases(vec![lease(1, LeasePhase::Expired, Some("w1"))])
        .run();
    let (st, tr) = status_of(&d);
    assert!(
        matches!(tr, Transition::Retry { expired: true, .. }),
        "{tr:?}"
    );
    assert_eq!(st.history.last().unwrap().outcome, "Expired");
    assert_eq!(st.last_failure.as_ref().unwrap().reason, "LeaseExpired");
    // The TTL without renewals was the wait: no backoff on top.
    assert_eq!(st.next_attempt_after, None);
    assert!(
        matches!(tr, Transition::Retry { delay_seconds, .. } if *delay_seconds == 0.0),
        "{tr:?}"
    );

    let mut next = task();
    next.status = Some(st.clone());
    let d = Case::new(next)
        .leases(vec![lease(1, LeasePhase::Expired, Some("w1"))])
        .run();
    let Decision::Issue { status, cause, .. } = d else {
        panic!("{d:?}")
    };
    assert_eq!(status.fencing_token, 2);
    assert_eq!(cause, IssueCause::Reassigned);
}

#[test]
fn an_attempt_expired_by_its_deadline_waits_the_backoff() {
    // It was renewing: the worker did not fail, the task ran too long.
    let t = task()
        .phase(TaskPhase::Running, 1)
        .with(|s| s.holder = Some("w1".into()));
    let mut expired = lease(1, LeasePhase::Expired, Some("w1"));
    std::sync::Arc::make_mut(&mut expired)
        .status
        .get_or_insert_with(Default::default)
        .reason = Some(ExpiryReason::ActiveDeadlineExceeded.as_str().into());
    let (st, tr) = into_status(Case::new(t).leases(vec![expired]).run());
    assert_eq!(st.attempts, 1);
    assert!(st.next_attempt_after.is_some(), "{st:?}");
    assert!(
        matches!(tr, Transition::Retry { expired: true, delay_seconds, .. } if delay_seconds > 0.0),
        "{tr:?}"
    );
}

#[test]
fn a_second_expiry_in_a_row_waits_the_backoff() {
    let t = task()
        .phase(TaskPhase::Running, 1)
        .with(|s| s.holder = Some("w1".into()));
    let first = Case::new(t.clone())
        .leases(vec![lease(1, LeasePhase::Expired, Some("w1"))])
        .run();
    let (after_one, _) = into_status(first);
    let mut t2 = t;
    t2.status = Some(BatchTaskStatus {
        phase: Some(TaskPhase::Running),
        fencing_token: 2,
        holder: Some("w2".into()),
        current_lease: Some("job-2".into()),
        ..after_one
    });
    let d = Case::new(t2)
        .leases(vec![
            lease(1, LeasePhase::Expired, Some("w1")),
            lease(2, LeasePhase::Expired, Some("w2")),
        ])
        .run();
    let (st, tr) = status_of(&d);
    assert_eq!(st.attempts, 2);
    assert!(st.next_attempt_after.is_some(), "{st:?}");
    assert!(
        matches!(tr, Transition::Retry { expired: true, delay_seconds, .. } if *delay_seconds > 0.0),
        "{tr:?}"
    );
}

#[test]
fn interrupted_retries_at_once_without_spending_a_retry() {
    let t = task().phase(TaskPhase::Running, 3).with(|s| s.attempts = 1);
    let (st, tr) = into_status(
        Case::new(t)
            .leases(vec![completed(3, LeaseOutcome::Interrupted, |_| {})])
            .run(),
    );
    assert_eq!(tr, Transition::Interrupted { delay_seconds: 0.0 });
    assert_eq!(
        (st.phase, st.attempts, st.next_attempt_after.clone()),
        (Some(TaskPhase::Pending), 1, None)
    );
}

#[test]
fn a_bound_attempt_never_taken_retries_at_once_without_spending_a_retry() {
    let t = task().phase(TaskPhase::Ready, 3).with(|s| s.attempts = 1);
    let mut l = (*lease(3, LeasePhase::Expired, Some("w1"))).clone();
    l.status.get_or_insert_with(Default::default).reason =
        Some(ExpiryReason::BoundNotTaken.as_str().into());
    let (st, tr) = into_status(Case::new(t).leases(vec![Arc::new(l)]).run());
    assert_eq!(tr, Transition::Interrupted { delay_seconds: 0.0 });
    assert_eq!((st.phase, st.attempts), (Some(TaskPhase::Pending), 1));
}

/// `n` Interrupted attempts in the task's history.
fn interrupted_before(s: &mut BatchTaskStatus, n: i64) {
    for k in 0..n {
        crate::status::push_history(
            s,
            batchlease_api::AttemptRecord {
                token: k + 1,
                holder: None,
                outcome: "Interrupted".into(),
                start: None,
                end: None,
                reason: None,
                lease_duration_seconds: None,
                renewal: None,
            },
        );
    }
}

#[test]
fn repeated_interruptions_back_off_then_count_as_failures() {
    // (Interrupted outcomes already in the history, expected: attempts
    // after, backoff set?)
    let cases = [
        (0, 0, false),
        (1, 0, false),
        (2, 0, true),
        (4, 0, true),
        (5, 1, true),
    ];
    for (before, attempts, delayed) in cases {
        let t = task()
            .phase(TaskPhase::Running, 9)
            .with(|s| interrupted_before(s, before));
        let (st, tr) = into_status(
            Case::new(t)
                .leases(vec![completed(9, LeaseOutcome::Interrupted, |_| {})])
                .run(),
        );
        assert_eq!(st.attempts, attempts, "{before} before: {tr:?}");
        assert_eq!(st.next_attempt_after.is_some(), delayed, "{before}: {tr:?}");
        if attempts == 1 {
            assert!(matches!(tr, Transition::Retry { .. }), "{tr:?}");
            let last = st.history.last().unwrap();
            assert_eq!(
                (last.outcome.as_str(), last.reason.as_deref()),
                ("Failed", Some("InterruptedRepeatedly"))
            );
        }
    }
    // With no retries left, the sixth interruption in a row dead-letters.
    let t = task()
        .spec(|s| s.max_retries = 0)
        .phase(TaskPhase::Running, 9)
        .with(|s| interrupted_before(s, 5));
    let (st, _) = into_status(
        Case::new(t)
            .leases(vec![completed(9, LeaseOutcome::Interrupted, |_| {})])
            .run(),
    );
    assert_eq!(st.phase, Some(TaskPhase::DeadLettered));
}

#[test]
fn speculative_aborts_quarantine_to_exclusive() {
    let t = task()
        .spec(|s| {
            s.mode = TaskMode::Speculative;
            s.max_speculative_aborts = 2;
        })
        .phase(TaskPhase::Running, 2)
        .with(|s| {
            s.aborts = 1;
            s.effective_mode = Some(TaskMode::Speculative);
        });
    let (st, tr) = into_status(
        Case::new(t)
            .leases(vec![completed(2, LeaseOutcome::Aborted, |_| {})])
            .run(),
    );
    assert_eq!(tr, Transition::Aborted { quarantined: true });
    assert_eq!(
        (st.aborts, st.attempts, st.effective_mode),
        (2, 0, Some(TaskMode::Exclusive))
    );
}

#[test]
fn an_abort_of_a_quarantined_attempt_spends_a_retry() {
    // Quarantined, it held its locks and still lost its swap: the keys are
    // written by tasks that do not name its resources. Free retries would
    // let it spin for ever.
    let t = task()
        .spec(|s| {
            s.mode = TaskMode::Speculative;
            s.max_retries = 1;
        })
        .phase(TaskPhase::Running, 5)
        .with(|s| {
            s.aborts = 3;
            s.effective_mode = Some(TaskMode::Exclusive);
        });
    let aborted = |t: BatchTask| {
        into_status(
            Case::new(t)
                .leases(vec![completed(5, LeaseOutcome::Aborted, |s| {
                    s.reason = Some("CompareAndSwapLost".into())
                })])
                .run(),
        )
    };
    let (st, tr) = aborted(t.clone());
    assert!(
        matches!(&tr, Transition::Retry { reason, .. } if reason == "CompareAndSwapLost"),
        "{tr:?}"
    );
    assert_eq!(
        (st.aborts, st.attempts, st.effective_mode),
        (4, 1, Some(TaskMode::Exclusive))
    );
    // The budget spent: dead-lettered, with the reason.
    let (st, tr) = aborted(t.with(|s| s.attempts = 1));
    assert!(
        matches!(&tr, Transition::DeadLettered { reason, .. } if reason == "CompareAndSwapLost"),
        "{tr:?}"
    );
    assert_eq!(st.phase, Some(TaskPhase::DeadLettered));
}
