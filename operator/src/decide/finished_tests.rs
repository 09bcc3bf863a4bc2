//! Table tests of [`decide`] for finished tasks and housekeeping: redrive,
//! pruning old leases, deletion after `ttlSecondsAfterFinished`.

use super::tests::*;

#[test]
fn redrive_brings_back_a_dead_lettered_task_with_a_fresh_budget() {
    let t = task()
        .spec(|s| s.redrive = 1)
        .phase(TaskPhase::DeadLettered, 4)
        .with(|s| {
            s.attempts = 4;
            s.observed_redrive = 0;
        });
    let (st, tr) = into_status(Case::new(t).run());
    assert_eq!(tr, Transition::Redriven);
    assert_eq!(
        (st.phase, st.attempts, st.observed_redrive, st.fencing_token),
        (Some(TaskPhase::Pending), 0, 1, 4)
    );

    // Raised on a running task: recorded, nothing else changes.
    let t = task().spec(|s| s.redrive = 1).phase(TaskPhase::Running, 2);
    let (st, tr) = into_status(Case::new(t).run());
    assert_eq!(tr, Transition::RedriveIgnored);
    assert_eq!(
        (st.phase, st.observed_redrive),
        (Some(TaskPhase::Running), 1)
    );
}

#[test]
fn final_tasks_wait_and_prune_old_leases() {
    let t = task().phase(TaskPhase::Succeeded, 6);
    let leases: Vec<_> = (1..=6)
        .map(|k| lease(k, LeasePhase::Expired, Some("w")))
        .collect();
    let d = Case::new(t.clone()).leases(leases).run();
    let names: Vec<String> = match d {
        Decision::Prune { victims, then } => {
            assert_eq!(then, None);
            victims
        }
        .into_iter()
        .map(|(n, rv)| format!("{n}@{}", rv.unwrap()))
        .collect(),
        other => panic!("{other:?}"),
    };
    // job-6 is current; keep job-3..5; prune the oldest two, with their versions.
    assert_eq!(names, ["job-1@rv1", "job-2@rv2"]);

    let few: Vec<_> = (4..=6)
        .map(|k| lease(k, LeasePhase::Expired, Some("w")))
        .collect();
    assert_eq!(Case::new(t).leases(few).run(), Decision::Wait(None));
}

#[test]
fn pruning_carries_the_timer_the_pass_would_have_set() {
    // A held lease with 12 s left before expiry, and old leases to prune:
    // the prune must not drop the expiry timer.
    let t = task()
        .phase(TaskPhase::Running, 9)
        .with(|s| s.holder = Some("w".into()));
    let mut leases: Vec<_> = (1..=8)
        .map(|k| lease(k, LeasePhase::Expired, Some("w")))
        .collect();
    leases.push(lease(9, LeasePhase::Held, Some("w")));
    let d = Case::new(t).leases(leases).observed(18, 18).run();
    let Decision::Prune { victims, then } = d else {
        panic!("{d:?}")
    };
    assert_eq!(victims.len(), 5);
    assert_eq!(then, Some(Duration::from_secs(12)));
}

#[test]
fn held_or_offered_leases_are_never_pruned() {
    let t = task()
        .phase(TaskPhase::Running, 9)
        .with(|s| s.holder = Some("w".into()));
    let mut leases: Vec<_> = (1..=8)
        .map(|k| lease(k, LeasePhase::Held, Some("w")))
        .collect();
    leases.push(lease(9, LeasePhase::Held, Some("w")));
    // Live leases are never deleted: the stray ones are ended first (an
    // Expire, which a holder notices), the current one is left alone.
    let d = Case::new(t).leases(leases).observed(0, 0).run();
    assert!(
        matches!(&d, Decision::Expire { lease, reason: ExpiryReason::NotCurrentLease }
            if lease.spec.fencing_token < 9),
        "{d:?}"
    );
}

#[test]
fn deleted_task_is_left_to_garbage_collection() {
    let mut t = task().phase(TaskPhase::Running, 1);
    t.metadata.deletion_timestamp = Some(Time(wall(0)));
    assert_eq!(Case::new(t).run(), Decision::Wait(None));
}

#[test]
fn a_finished_task_is_deleted_once_its_ttl_has_passed() {
    let done = |phase: TaskPhase, ago: i64, ttl: Option<i64>| {
        let mut t = task()
            .spec(|s| s.ttl_seconds_after_finished = ttl)
            .phase(phase, 1)
            .with(|s| s.completion_time = Some(Time(wall(-ago))));
        t.metadata.resource_version = Some("rv7".into());
        Case::new(t).run()
    };
    for phase in [
        TaskPhase::Succeeded,
        TaskPhase::DeadLettered,
        TaskPhase::Rejected,
    ] {
        // Kept without a TTL.
        assert_eq!(done(phase, 1_000, None), Decision::Wait(None), "{phase:?}");
        // Not yet: look again when it is due.
        assert_eq!(
            done(phase, 4, Some(10)),
            Decision::Wait(Some(Duration::from_secs(6))),
            "{phase:?}"
        );
        // Due: deleted, if it is still this object at this version.
        assert_eq!(
            done(phase, 10, Some(10)),
            Decision::DeleteTask {
                uid: "uid-job".into(),
                resource_version: Some("rv7".into())
            },
            "{phase:?}"
        );
        assert!(matches!(
            done(phase, 0, Some(0)),
            Decision::DeleteTask { .. }
        ));
    }
    // Due, but an unfinished dependent or child still needs it: kept, and
    // looked at again.
    let due = task()
        .spec(|s| s.ttl_seconds_after_finished = Some(1))
        .phase(TaskPhase::Succeeded, 1)
        .with(|s| s.completion_time = Some(Time(wall(-60))));
    assert_eq!(
        Case::new(due).needed_by("follow-up").run(),
        Decision::Wait(Some(crate::decide::TTL_RECHECK))
    );
}

#[test]
fn finishing_records_the_completion_time_and_a_redrive_clears_it() {
    let t = task()
        .phase(TaskPhase::Running, 1)
        .with(|s| s.holder = Some("w1".into()));
    let ok = completed(1, LeaseOutcome::Succeeded, |_| {});
    let (st, _) = into_status(Case::new(t.clone()).leases(vec![ok]).run());
    assert_eq!(st.phase, Some(TaskPhase::Succeeded));
    assert_eq!(st.completion_time, Some(Time(wall(0))));

    let t = t.spec(|s| s.max_retries = 0);
    let failed = completed(1, LeaseOutcome::Failed, |_| {});
    let (st, _) = into_status(Case::new(t.clone()).leases(vec![failed]).run());
    assert_eq!(st.phase, Some(TaskPhase::DeadLettered));
    assert_eq!(st.completion_time, Some(Time(wall(0))));

    let mut redriven = t.spec(|s| s.redrive = 1);
    redriven.status = Some(st);
    let (st, _) = into_status(Case::new(redriven).run());
    assert_eq!(st.phase, Some(TaskPhase::Pending));
    assert_eq!(st.completion_time, None);
}
