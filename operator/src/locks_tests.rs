use super::*;
use batchlease_api::{BatchTaskSpec, BatchTaskStatus};
use std::collections::HashMap;

fn task(name: &str, uid: &str, token: i64, phase: TaskPhase) -> Arc<BatchTask> {
    let mut spec = BatchTaskSpec::for_queue("q");
    spec.resources = vec!["r2".into(), "r1".into()];
    let mut t = BatchTask::new(name, spec);
    t.metadata.namespace = Some("ns".into());
    t.metadata.uid = Some(uid.into());
    t.status = Some(BatchTaskStatus {
        phase: Some(phase),
        fencing_token: token,
        ..Default::default()
    });
    Arc::new(t)
}

fn lock(resource: &str, holder: Option<(&str, &str)>, transitions: i32) -> Lease {
    let mut l = Lease {
        metadata: Default::default(),
        spec: Some(LeaseSpec {
            holder_identity: holder.map(|(id, _)| id.to_owned()),
            lease_transitions: Some(transitions),
            ..Default::default()
        }),
    };
    l.metadata.name = Some(lock_name("ns", resource));
    l.metadata.resource_version = Some("7".into());
    l.labels_mut()
        .insert(LABEL_MANAGED_BY.into(), MANAGED_BY.into());
    l.labels_mut()
        .insert(LABEL_LOCK_NAMESPACE.into(), "ns".into());
    if let Some((_, uid)) = holder {
        l.annotations_mut().insert(HOLDER_UID.into(), uid.into());
    }
    l
}

fn wall() -> Timestamp {
    Timestamp::from_second(1_000_000).unwrap()
}

#[test]
fn holder_table() {
    use TaskPhase::*;
    let me = task("me", "u-me", 4, Pending);
    let world: HashMap<&str, Arc<BatchTask>> = [
        ("running", task("running", "u-run", 2, Running)),
        ("settled", task("settled", "u-set", 2, Pending)),
        ("moved-on", task("moved-on", "u-mo", 5, Ready)),
        ("acquiring", task("acquiring", "u-acq", 2, Pending)),
        ("rejected", task("rejected", "u-rej", 2, Rejected)),
    ]
    .into_iter()
    .collect();
    let lookup = |n: &str| world.get(n).cloned();
    // Deleted task "gone-running": its lease under token 1 is still Held.
    let lease_live = |n: &str, u: &str, t: i64| (n, u, t) == ("gone-running", "u-gr", 1);
    // Deleted task "gone-stopping": its lease is gone, and its holder may
    // run 4 s more; "gone": its holder has surely stopped. The lock's TTL
    // (7 s) is what a departure this process did not see is timed by.
    let gone_left = |n: &str, u: &str, t: i64, ttl: Duration| {
        if (n, u, t) == ("gone-stopping", "u-gs", 1) {
            assert_eq!(ttl, Duration::from_secs(7), "the lock's TTL");
            Duration::from_secs(4)
        } else {
            Duration::ZERO
        }
    };
    let look = Lookups {
        task: &lookup,
        lease_live: &lease_live,
        gone_left: &gone_left,
    };
    let mut stopping = lock("r1", Some(("ns/gone-stopping@1", "u-gs")), 3);
    stopping.spec.as_mut().unwrap().lease_duration_seconds = Some(7);
    let mut gone = lock("r1", Some(("ns/gone@1", "u-gone")), 3);
    gone.spec.as_mut().unwrap().lease_duration_seconds = Some(7);
    let mut foreign = lock("r1", None, 3);
    foreign.labels_mut().clear();
    let mut exhausted = lock("r1", None, i32::MAX);
    exhausted.metadata.name = Some("ns.r1".into());
    let cases: Vec<(&str, Option<Lease>, Holder)> = vec![
        (
            "a Lease we did not create under a lock's name",
            Some(foreign),
            Holder::Live("a Lease not managed by batchlease (ns.r1)".into()),
        ),
        (
            "a token that cannot grow",
            Some(exhausted),
            Holder::Live(
                "nobody: the lock's token is exhausted (leaseTransitions at its maximum)".into(),
            ),
        ),
        (
            "a deleted task whose lease still runs",
            Some(lock("r1", Some(("ns/gone-running@1", "u-gr")), 3)),
            Holder::Live("ns/gone-running@1".into()),
        ),
        ("no lease", None, Holder::Free),
        ("released", Some(lock("r1", None, 3)), Holder::Free),
        (
            "mine, this incarnation",
            Some(lock("r1", Some(("ns/me@5", "u-me")), 3)),
            Holder::Ours { token: 5 },
        ),
        (
            "my name, another incarnation",
            Some(lock("r1", Some(("ns/me@5", "u-old")), 3)),
            Holder::Dead("ns/me@5".into()),
        ),
        (
            "a running attempt",
            Some(lock("r1", Some(("ns/running@2", "u-run")), 3)),
            Holder::Live("ns/running@2".into()),
        ),
        (
            "a settled attempt",
            Some(lock("r1", Some(("ns/settled@2", "u-set")), 3)),
            Holder::Dead("ns/settled@2".into()),
        ),
        (
            "an older token of a task that moved on",
            Some(lock("r1", Some(("ns/moved-on@4", "u-mo")), 3)),
            Holder::Dead("ns/moved-on@4".into()),
        ),
        (
            "acquiring for its next attempt",
            Some(lock("r1", Some(("ns/acquiring@3", "u-acq")), 3)),
            Holder::Live("ns/acquiring@3".into()),
        ),
        (
            "acquiring, but the task was rejected since",
            Some(lock("r1", Some(("ns/rejected@3", "u-rej")), 3)),
            Holder::Dead("ns/rejected@3".into()),
        ),
        (
            "a deleted task whose holder has surely stopped",
            Some(gone),
            Holder::Dead("ns/gone@1".into()),
        ),
        (
            "a deleted task whose lease is gone but whose holder may run on",
            Some(stopping),
            Holder::Stopping {
                id: "ns/gone-stopping@1".into(),
                left: Duration::from_secs(4),
            },
        ),
        (
            "an identity we never write is never taken over",
            Some(lock("r1", Some(("someone", "x")), 3)),
            Holder::Live("someone".into()),
        ),
        (
            "another namespace's identity",
            Some(lock("r1", Some(("other/running@2", "u-run")), 3)),
            Holder::Live("other/running@2".into()),
        ),
    ];
    for (what, l, want) in cases {
        assert_eq!(holder(l.as_ref(), &me, &look), want, "{what}");
    }
}

fn slot(resource: &str, holder: Holder, lease: Option<Lease>, older: Option<&str>) -> Slot {
    Slot {
        resource: resource.into(),
        name: lock_name("ns", resource),
        lease,
        holder,
        older_waiter: older.map(str::to_owned),
    }
}

#[test]
fn acquire_takes_in_order_and_rolls_back_in_reverse() {
    let me = task("me", "u-me", 4, TaskPhase::Pending);
    let mine = |r: &str, t: i32| lock(r, Some(("ns/me@5", "u-me")), t);
    let ours = Holder::Ours { token: 5 };
    // Nothing held: take the first (a create: no Lease yet).
    let step = acquire(
        &me,
        5,
        &[
            slot("r1", Holder::Free, None, None),
            slot("r2", Holder::Free, None, None),
        ],
        wall(),
        true,
    );
    let Step::Take(l) = step else {
        panic!("{step:?}")
    };
    let spec = l.spec.clone().unwrap();
    assert_eq!(l.metadata.name.as_deref(), Some("ns.r1"));
    assert!(l.metadata.resource_version.is_none(), "a create");
    assert_eq!(spec.holder_identity.as_deref(), Some("ns/me@5"));
    assert_eq!(spec.lease_transitions, Some(1));
    assert_eq!(
        l.annotations().get(HOLDER_UID).map(String::as_str),
        Some("u-me")
    );
    assert_eq!(
        l.labels().get(LABEL_RESOURCE).map(String::as_str),
        Some("r1")
    );
    // First held, second free: take the second, bumping its count.
    let step = acquire(
        &me,
        5,
        &[
            slot("r1", ours.clone(), Some(mine("r1", 1)), None),
            slot(
                "r2",
                Holder::Dead("ns/x@1".into()),
                Some(lock("r2", Some(("ns/x@1", "u-x")), 8)),
                None,
            ),
        ],
        wall(),
        true,
    );
    let Step::Take(l) = step else {
        panic!("{step:?}")
    };
    assert_eq!(l.spec.unwrap().lease_transitions, Some(9));
    assert_eq!(l.metadata.resource_version.as_deref(), Some("7"), "a CAS");
    // Everything held: the tokens.
    let step = acquire(
        &me,
        5,
        &[
            slot("r1", ours.clone(), Some(mine("r1", 1)), None),
            slot("r2", ours.clone(), Some(mine("r2", 9)), None),
        ],
        wall(),
        true,
    );
    assert_eq!(
        step,
        Step::Held(BTreeMap::from([("r1".into(), 1), ("r2".into(), 9)]))
    );
    // Everything held, but the task's TTL was raised since r2 was taken:
    // r2 is updated first (same holder, same token), so the lock never
    // carries less than the TTL of the lease issued under it.
    let mut short = mine("r2", 9);
    short.spec.as_mut().unwrap().lease_duration_seconds = Some(5);
    let step = acquire(
        &me,
        5,
        &[
            slot("r1", ours.clone(), Some(mine("r1", 1)), None),
            slot("r2", ours.clone(), Some(short), None),
        ],
        wall(),
        true,
    );
    let Step::Take(l) = step else {
        panic!("{step:?}")
    };
    let spec = l.spec.clone().unwrap();
    assert_eq!(l.metadata.name.as_deref(), Some("ns.r2"));
    assert_eq!(
        spec.lease_duration_seconds,
        Some(me.spec.lease_duration_seconds)
    );
    assert_eq!(spec.lease_transitions, Some(9), "no new resource token");
    assert_eq!(spec.holder_identity.as_deref(), Some("ns/me@5"));
    assert_eq!(l.metadata.resource_version.as_deref(), Some("7"), "a CAS");
    // Contention on the third: give back the first two, last first.
    let step = acquire(
        &me,
        5,
        &[
            slot("r1", ours.clone(), Some(mine("r1", 1)), None),
            slot("r2", ours.clone(), Some(mine("r2", 9)), None),
            slot(
                "r3",
                Holder::Live("ns/y@2".into()),
                Some(lock("r3", Some(("ns/y@2", "u-y")), 4)),
                None,
            ),
        ],
        wall(),
        true,
    );
    let Step::Blocked {
        give_back: back,
        resource,
        holder,
    } = step
    else {
        panic!("{step:?}")
    };
    assert_eq!((resource.as_str(), holder.as_str()), ("r3", "ns/y@2"));
    let names: Vec<_> = back.iter().map(|l| l.name_any()).collect();
    assert_eq!(names, vec!["ns.r2", "ns.r1"]);
    assert!(
        back.iter()
            .all(|l| l.spec.as_ref().unwrap().holder_identity.is_none())
    );
    assert_eq!(
        back[0].spec.as_ref().unwrap().lease_transitions,
        Some(9),
        "counts never go back"
    );
    // A later lock is busy: nothing is taken first (it would only be given
    // back).
    let step = acquire(
        &me,
        5,
        &[
            slot("r1", Holder::Free, None, None),
            slot(
                "r2",
                Holder::Live("ns/y@2".into()),
                Some(lock("r2", Some(("ns/y@2", "u-y")), 4)),
                None,
            ),
        ],
        wall(),
        true,
    );
    assert_eq!(
        step,
        Step::Blocked {
            give_back: vec![],
            resource: "r2".into(),
            holder: "ns/y@2".into()
        }
    );
    // Contention with nothing held: wait.
    let step = acquire(
        &me,
        5,
        &[slot(
            "r1",
            Holder::Live("ns/y@2".into()),
            Some(lock("r1", Some(("ns/y@2", "u-y")), 4)),
            None,
        )],
        wall(),
        true,
    );
    assert_eq!(
        step,
        Step::Blocked {
            give_back: vec![],
            resource: "r1".into(),
            holder: "ns/y@2".into()
        }
    );
}

#[test]
fn older_waiters_are_served_first_unless_the_lock_is_already_ours() {
    let me = task("me", "u-me", 4, TaskPhase::Pending);
    let free_but_queued = [slot(
        "r1",
        Holder::Free,
        Some(lock("r1", None, 3)),
        Some("older"),
    )];
    assert_eq!(
        acquire(&me, 5, &free_but_queued, wall(), true),
        Step::Blocked {
            give_back: vec![],
            resource: "r1".into(),
            holder: "older".into()
        }
    );
    // Without the rule (a lost lease being replaced) it is taken.
    assert!(matches!(
        acquire(&me, 5, &free_but_queued, wall(), false),
        Step::Take(_)
    ));
    // A lock held under our previous token is taken over at once.
    let prev = [slot(
        "r1",
        Holder::Ours { token: 4 },
        Some(lock("r1", Some(("ns/me@4", "u-me")), 3)),
        Some("older"),
    )];
    let Step::Take(l) = acquire(&me, 5, &prev, wall(), true) else {
        panic!()
    };
    assert_eq!(l.spec.unwrap().lease_transitions, Some(4));
}

#[test]
fn attempt_liveness_table() {
    use TaskPhase::*;
    let cases = [
        (3, Running, 3, true),
        (3, Ready, 3, true),
        (3, Pending, 3, false),
        (3, Succeeded, 3, false),
        (3, Running, 2, false),
        (3, Pending, 4, true),
        (3, Succeeded, 4, false),
        (3, DeadLettered, 4, false),
        (3, Pending, 9, true),
    ];
    for (task_token, phase, lock_token, want) in cases {
        let t = task("t", "u", task_token, phase);
        assert_eq!(
            attempt_alive(&t, lock_token),
            want,
            "task at {task_token} {phase:?}, lock at {lock_token}"
        );
    }
}

#[test]
fn lock_names_fit_and_stay_distinct() {
    assert_eq!(lock_name("team-a", "warehouse"), "team-a.warehouse");
    let long = "r".repeat(200);
    let a = lock_name(&"n".repeat(63), &long);
    let b = lock_name(&"n".repeat(63), &format!("{}x", "r".repeat(199)));
    assert!(a.len() <= 253 && b.len() <= 253);
    assert_ne!(a, b);
    assert!(!a.contains(".-") && !a.ends_with('-'));
    // Not a panic on a multi-byte character at the cut.
    let wide = lock_name("ab", &"é".repeat(200));
    assert!(wide.len() <= 253);
}

#[test]
fn needed_is_sorted_and_empty_when_speculative() {
    let mut t = (*task("t", "u", 1, TaskPhase::Pending)).clone();
    t.spec.resources = vec!["b".into(), "a".into()];
    assert_eq!(needed(&t), vec!["a", "b"]);
    t.spec.mode = TaskMode::Speculative;
    t.status.as_mut().unwrap().effective_mode = Some(TaskMode::Speculative);
    assert!(needed(&t).is_empty());
    // Quarantined: back to Exclusive, so the locks are needed again.
    t.status.as_mut().unwrap().effective_mode = Some(TaskMode::Exclusive);
    assert_eq!(needed(&t), vec!["a", "b"]);
}

#[test]
fn gone_attempt_names_only_another_tasks_attempt_the_cache_lost() {
    let me = task("me", "u-me", 4, TaskPhase::Pending);
    let world: HashMap<&str, Arc<BatchTask>> =
        [("running", task("running", "u-run", 2, TaskPhase::Running))]
            .into_iter()
            .collect();
    let lookup = |n: &str| world.get(n).cloned();
    let cases = [
        (
            "deleted",
            Some(lock("r1", Some(("ns/gone@3", "u-gone")), 3)),
            Some(("gone".to_owned(), "u-gone".to_owned(), 3)),
        ),
        (
            "re-created under its name",
            Some(lock("r1", Some(("ns/running@2", "u-old")), 3)),
            Some(("running".to_owned(), "u-old".to_owned(), 2)),
        ),
        (
            "cached",
            Some(lock("r1", Some(("ns/running@2", "u-run")), 3)),
            None,
        ),
        ("mine", Some(lock("r1", Some(("ns/me@5", "u-me")), 3)), None),
        ("free", Some(lock("r1", None, 3)), None),
        ("no lease", None, None),
        (
            "another namespace",
            Some(lock("r1", Some(("other/gone@3", "u-gone")), 3)),
            None,
        ),
    ];
    for (what, l, want) in cases {
        assert_eq!(gone_attempt(l.as_ref(), &me, &lookup), want, "{what}");
    }
}

/// A replacement attempt (token 6) takes over the lock from the task's own
/// lost attempt (token 5), whose lease had a longer TTL than the task's
/// spec says now: the lock keeps the longer TTL, which a waiter that
/// cannot see the lost lease (a new leader) waits out.
#[test]
fn taking_over_from_our_own_older_attempt_never_shortens_the_lock() {
    let me = task("me", "u-me", 5, TaskPhase::Running);
    assert_eq!(me.spec.lease_duration_seconds, 30);
    let mut long = lock("r1", Some(("ns/me@5", "u-me")), 3);
    long.spec.as_mut().unwrap().lease_duration_seconds = Some(600);
    let free = slot("r2", Holder::Free, None, None);
    let step = acquire(
        &me,
        6,
        &[
            slot("r1", Holder::Ours { token: 5 }, Some(long), None),
            free.clone(),
        ],
        wall(),
        true,
    );
    let Step::Take(l) = step else {
        panic!("{step:?}")
    };
    let spec = l.spec.unwrap();
    assert_eq!(spec.holder_identity.as_deref(), Some("ns/me@6"));
    assert_eq!(
        spec.lease_duration_seconds,
        Some(600),
        "kept, not cut to 30"
    );
    // Taken from another task's dead holder: the task's own TTL.
    let mut other = lock("r1", Some(("ns/x@1", "u-x")), 3);
    other.spec.as_mut().unwrap().lease_duration_seconds = Some(600);
    let step = acquire(
        &me,
        6,
        &[
            slot("r1", Holder::Dead("ns/x@1".into()), Some(other), None),
            free,
        ],
        wall(),
        true,
    );
    let Step::Take(l) = step else {
        panic!("{step:?}")
    };
    assert_eq!(l.spec.unwrap().lease_duration_seconds, Some(30));
}
