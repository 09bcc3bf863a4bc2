//! Table tests of [`decide`] for task graphs and resource locks: waiting
//! for and failing on dependencies, cycles, acquiring and giving back
//! locks around an attempt.

use super::tests::*;
use crate::locks::{HOLDER_UID, Holder, lock_name};
use batchlease_api::graph::Cycle;
use batchlease_api::{LeaseOutcome, keys::condition};
use k8s_openapi::api::coordination::v1::LeaseSpec;

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

fn cond<'a>(st: &'a BatchTaskStatus, type_: &str) -> Option<(&'a str, &'a str, &'a str)> {
    st.conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.as_str(), c.reason.as_str(), c.message.as_str()))
}

fn waiting(unfinished: &[&str]) -> Readiness {
    Readiness::Waiting {
        missing: vec![],
        unfinished: strings(unfinished),
    }
}

#[test]
fn waiting_for_dependencies_is_a_condition_written_once() {
    let t = task().phase(TaskPhase::Pending, 0);
    let d = Case::new(t.clone()).deps(waiting(&["extract"])).run();
    let (st, tr) = into_status(d);
    assert_eq!(tr, Transition::WaitingForDependencies);
    assert_eq!(st.phase, Some(TaskPhase::Pending));
    assert_eq!(st.fencing_token, 0, "no lease is issued");
    assert_eq!(
        cond(&st, condition::WAITING_FOR_DEPENDENCIES),
        Some(("True", "DependenciesNotSucceeded", "waiting for extract"))
    );
    // The same state again: nothing to write, woken by the dependency.
    let mut again = t.clone();
    again.status = Some(st.clone());
    assert_eq!(
        Case::new(again.clone()).deps(waiting(&["extract"])).run(),
        Decision::Wait(None)
    );
    // The dependency succeeded: issued, the condition flips to False.
    let Decision::Issue { status, .. } = Case::new(again).run() else {
        panic!("expected an issue")
    };
    assert_eq!(
        cond(&status, condition::WAITING_FOR_DEPENDENCIES).map(|c| c.0),
        Some("False")
    );
    assert_eq!(status.fencing_token, 1);
}

#[test]
fn a_failed_dependency_is_reported_and_cleared_when_it_is_redriven() {
    let t = task().phase(TaskPhase::Pending, 0);
    let failed = Readiness::Failed {
        failed: strings(&["extract"]),
        cancelled: vec![],
    };
    let (st, tr) = into_status(Case::new(t.clone()).deps(failed).run());
    assert_eq!(tr, Transition::DependencyFailed);
    assert_eq!(
        cond(&st, condition::DEPENDENCY_FAILED).map(|c| c.0),
        Some("True")
    );
    assert!(
        cond(&st, condition::DEPENDENCY_FAILED)
            .unwrap()
            .2
            .contains("extract")
    );
    // Redriven: the dependency is unfinished again.
    let mut redriven = t.clone();
    redriven.status = Some(st);
    let (st, _) = into_status(Case::new(redriven).deps(waiting(&["extract"])).run());
    assert_eq!(
        cond(&st, condition::DEPENDENCY_FAILED).map(|c| (c.0, c.1)),
        Some(("False", "DependencyRetrying"))
    );
    assert_eq!(
        cond(&st, condition::WAITING_FOR_DEPENDENCIES).map(|c| c.0),
        Some("True")
    );
}

#[test]
fn a_task_on_a_cycle_is_rejected_naming_it_and_redrive_checks_again() {
    let t = task().phase(TaskPhase::Pending, 0);
    let cycle = Readiness::Cycle(Cycle {
        path: strings(&["a", "b", "job"]),
    });
    let (st, tr) = into_status(Case::new(t.clone()).deps(cycle).run());
    assert_eq!(st.phase, Some(TaskPhase::Rejected));
    assert_eq!(
        tr,
        Transition::CycleDetected {
            cycle: "a → b → job → a".into()
        }
    );
    assert_eq!(
        cond(&st, condition::CYCLE_DETECTED),
        Some(("True", "CycleDetected", "dependency cycle: a → b → job → a"))
    );
    // Final: nothing more happens…
    let mut rejected = t.clone();
    rejected.status = Some(st);
    assert_eq!(Case::new(rejected.clone()).run(), Decision::Wait(None));
    // …until spec.redrive is raised (after fixing dependsOn).
    let bumped = rejected.spec(|s| s.redrive = 1);
    let (st, tr) = into_status(Case::new(bumped).run());
    assert_eq!(tr, Transition::Redriven);
    assert_eq!(st.phase, Some(TaskPhase::Pending));
    assert_eq!(
        cond(&st, condition::CYCLE_DETECTED).map(|c| c.0),
        Some("False")
    );
}

fn lock_lease(resource: &str, holder: Option<&str>, transitions: i32) -> Lease {
    let mut l = Lease {
        metadata: Default::default(),
        spec: Some(LeaseSpec {
            holder_identity: holder.map(str::to_owned),
            lease_transitions: Some(transitions),
            ..Default::default()
        }),
    };
    l.metadata.name = Some(lock_name("ns", resource));
    l.metadata.resource_version = Some("1".into());
    if holder.is_some() {
        l.annotations_mut()
            .insert(HOLDER_UID.into(), "uid-job".into());
    }
    l
}

fn slot(resource: &str, holder: Holder, lease: Option<Lease>) -> Slot {
    Slot {
        resource: resource.into(),
        name: lock_name("ns", resource),
        lease,
        holder,
        older_waiter: None,
    }
}

fn with_resources(t: BatchTask) -> BatchTask {
    t.spec(|s| s.resources = strings(&["wh", "db"]))
}

#[test]
fn locks_are_fetched_taken_in_order_and_their_tokens_go_to_the_lease() {
    let t = with_resources(task().phase(TaskPhase::Pending, 2));
    assert_eq!(
        Case::new(t.clone()).run(),
        Decision::FetchLocks(strings(&["db", "wh"])),
        "sorted: the canonical order"
    );
    let free = vec![
        slot("db", Holder::Free, None),
        slot("wh", Holder::Free, None),
    ];
    let Decision::TakeLock(l) = Case::new(t.clone()).locks(free).run() else {
        panic!("expected a lock take")
    };
    assert_eq!(l.metadata.name.as_deref(), Some("ns.db"));
    assert_eq!(
        l.spec.as_ref().unwrap().holder_identity.as_deref(),
        Some("ns/job@3"),
        "held for the token about to be issued"
    );
    let ours = Holder::Ours { token: 3 };
    let held = vec![
        slot(
            "db",
            ours.clone(),
            Some(lock_lease("db", Some("ns/job@3"), 4)),
        ),
        slot("wh", ours, Some(lock_lease("wh", Some("ns/job@3"), 11))),
    ];
    let Decision::Issue { lease, status, .. } = Case::new(t).locks(held).run() else {
        panic!("expected an issue")
    };
    assert_eq!(status.fencing_token, 3);
    assert_eq!(
        lease.spec.resource_tokens,
        BTreeMap::from([("db".into(), 4), ("wh".into(), 11)])
    );
}

#[test]
fn contention_gives_back_what_was_taken() {
    let t = with_resources(task().phase(TaskPhase::Pending, 2));
    let slots = vec![
        slot(
            "db",
            Holder::Ours { token: 3 },
            Some(lock_lease("db", Some("ns/job@3"), 4)),
        ),
        slot(
            "wh",
            Holder::Live("ns/other@7".into()),
            Some(lock_lease("wh", Some("ns/other@7"), 11)),
        ),
    ];
    let Decision::LockBlocked {
        give_back,
        resource,
        holder,
    } = Case::new(t).locks(slots).run()
    else {
        panic!("expected a block")
    };
    assert_eq!((resource.as_str(), holder.as_str()), ("wh", "ns/other@7"));
    assert_eq!(give_back.len(), 1);
    assert_eq!(give_back[0].metadata.name.as_deref(), Some("ns.db"));
    assert_eq!(give_back[0].spec.as_ref().unwrap().holder_identity, None);
}

#[test]
fn a_task_that_may_not_run_gives_its_locks_back() {
    let t = with_resources(task().phase(TaskPhase::Pending, 2));
    let deps = waiting(&["gone-then-back"]);
    assert_eq!(
        Case::new(t.clone()).deps(deps.clone()).run(),
        Decision::FetchLocks(strings(&["db", "wh"]))
    );
    let slots = vec![
        slot(
            "db",
            Holder::Ours { token: 3 },
            Some(lock_lease("db", Some("ns/job@3"), 4)),
        ),
        slot("wh", Holder::Free, None),
    ];
    let Decision::ReleaseLocks { leases, why } =
        Case::new(t.clone()).deps(deps.clone()).locks(slots).run()
    else {
        panic!("expected a release")
    };
    assert_eq!(why, LockRelease::NotRunnable);
    assert_eq!(leases.len(), 1);
    // Nothing held: the condition is written.
    let none = vec![
        slot("db", Holder::Free, None),
        slot("wh", Holder::Free, None),
    ];
    let (_, tr) = into_status(Case::new(t).deps(deps).locks(none).run());
    assert_eq!(tr, Transition::WaitingForDependencies);
}

#[test]
fn an_ended_attempt_gives_its_locks_back_before_the_task_settles() {
    for (lease_phase, expired) in [(LeasePhase::Completed, false), (LeasePhase::Expired, true)] {
        let t = with_resources(task().phase(TaskPhase::Running, 3))
            .with(|s| s.holder = Some("w1".into()));
        let mut l = if lease_phase == LeasePhase::Completed {
            (*completed(3, LeaseOutcome::Succeeded, |_| {})).clone()
        } else {
            (*lease(3, LeasePhase::Expired, Some("w1"))).clone()
        };
        l.spec.resource_tokens = BTreeMap::from([("db".into(), 4), ("wh".into(), 11)]);
        let leases = vec![Arc::new(l)];
        assert_eq!(
            Case::new(t.clone()).leases(leases.clone()).run(),
            Decision::FetchLocks(strings(&["db", "wh"]))
        );
        let ours = Holder::Ours { token: 3 };
        let held = vec![
            slot(
                "db",
                ours.clone(),
                Some(lock_lease("db", Some("ns/job@3"), 4)),
            ),
            slot("wh", ours, Some(lock_lease("wh", Some("ns/job@3"), 11))),
        ];
        let Decision::ReleaseLocks { leases: back, why } = Case::new(t.clone())
            .leases(leases.clone())
            .locks(held)
            .run()
        else {
            panic!("expected a release")
        };
        assert_eq!(why, LockRelease::AttemptEnded { expired });
        let names: Vec<_> = back.iter().map(|l| l.name_any()).collect();
        assert_eq!(names, vec!["ns.wh", "ns.db"], "reverse order");
        // Released (or taken over by the next holder since): settle.
        let gone = vec![
            slot("db", Holder::Free, Some(lock_lease("db", None, 4))),
            slot(
                "wh",
                Holder::Live("ns/next@1".into()),
                Some(lock_lease("wh", Some("ns/next@1"), 12)),
            ),
        ];
        let d = Case::new(t).leases(leases).locks(gone).run();
        assert!(matches!(d, Decision::WriteStatus { .. }), "{d:?}");
    }
}

#[test]
fn speculative_tasks_take_no_locks_but_wait_for_a_live_holder() {
    let t = with_resources(task().phase(TaskPhase::Pending, 0))
        .spec(|s| s.mode = TaskMode::Speculative)
        .with(|s| s.effective_mode = Some(TaskMode::Speculative));
    // It reads the locks of its resources (in canonical order) ...
    assert_eq!(
        Case::new(t.clone()).run(),
        Decision::FetchLocks(strings(&["db", "wh"]))
    );
    let free = |h: Holder| {
        let mut older = slot("db", Holder::Free, None);
        older.older_waiter = Some("ns/older (waiting longer)".into());
        vec![
            older,
            slot("wh", h, Some(lock_lease("wh", Some("ns/x@1"), 3))),
        ]
    };
    // ... and, whatever an older waiter wants, is issued without taking
    // any when no live attempt holds one (free, or its holder is over) ...
    for holder in [Holder::Free, Holder::Dead("ns/x@1".into())] {
        let d = Case::new(t.clone()).locks(free(holder.clone())).run();
        let Decision::Issue { lease, .. } = d else {
            panic!("{holder:?}: expected an issue, got {d:?}")
        };
        assert!(lease.spec.resource_tokens.is_empty(), "{holder:?}");
    }
    // ... but waits, taking nothing, while a live attempt holds one: a
    // quarantined task holds the locks to be certain to finish.
    assert_eq!(
        Case::new(t.clone())
            .locks(free(Holder::Live("ns/quarantined@4".into())))
            .run(),
        Decision::LockBlocked {
            give_back: vec![],
            resource: "wh".into(),
            holder: "ns/quarantined@4".into(),
        }
    );
    // Without resources there is nothing to read.
    let bare = t.spec(|s| s.resources.clear());
    assert!(matches!(Case::new(bare).run(), Decision::Issue { .. }));
    // Quarantined (Exclusive now): it takes the locks like any other.
    let quarantined = with_resources(task().phase(TaskPhase::Pending, 3))
        .spec(|s| s.mode = TaskMode::Speculative)
        .with(|s| s.effective_mode = Some(TaskMode::Exclusive));
    let Decision::TakeLock(l) = Case::new(quarantined)
        .locks(vec![
            slot("db", Holder::Free, None),
            slot("wh", Holder::Free, None),
        ])
        .run()
    else {
        panic!("expected a lock taken")
    };
    assert_eq!(l.metadata.name.as_deref(), Some("ns.db"));
}

#[test]
fn a_lost_lease_is_replaced_under_the_locks_already_held() {
    // Running under token 3, holding db; its lease vanished: the next token
    // takes the lock over at once (no queueing behind older waiters).
    let t = task()
        .spec(|s| s.resources = strings(&["db"]))
        .phase(TaskPhase::Running, 3)
        .with(|s| s.holder = Some("w1".into()));
    let mut held = slot(
        "db",
        Holder::Ours { token: 3 },
        Some(lock_lease("db", Some("ns/job@3"), 4)),
    );
    held.older_waiter = Some("ns/older".into());
    let d = Case::new(t)
        .lookup(Lookup::Occupied)
        .locks(vec![held])
        .run();
    let Decision::TakeLock(l) = d else {
        panic!("expected a take-over, got {d:?}")
    };
    assert_eq!(
        l.spec.as_ref().unwrap().holder_identity.as_deref(),
        Some("ns/job@4")
    );
    assert_eq!(l.spec.as_ref().unwrap().lease_transitions, Some(5));
}
