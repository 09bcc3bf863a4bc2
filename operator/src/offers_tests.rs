use super::*;
use batchlease_api::worker_lease::worker_lease_name;
use batchlease_api::{TaskLeaseSpec, TaskLeaseStatus, WorkerLeaseSpec};

fn cand(identity: &str, free: i64) -> Candidate {
    Candidate {
        identity: identity.into(),
        label: worker_lease_name(identity),
        free,
        bind_at: None,
        renewed: Some(Instant::now()),
    }
}

#[test]
fn choose_table() {
    let a = cand("a/1", 2);
    let b = cand("b/1", 5);
    let c = cand("c/1", 5);
    let full = cand("d/1", 0);
    let over = cand("e/1", -3);
    let name = |x: Option<&Candidate>| x.map(|c| c.identity.clone());
    let first_of_tie = if b.label < c.label { "b/1" } else { "c/1" };
    // (what, candidates, excluded, chosen)
    type Case<'a> = (&'a str, Vec<Candidate>, Option<&'a str>, Option<&'a str>);
    let cases: Vec<Case> = vec![
        ("none", vec![], None, None),
        (
            "the most free",
            vec![a.clone(), b.clone()],
            None,
            Some("b/1"),
        ),
        (
            "ties by WorkerLease name",
            vec![c.clone(), b.clone(), a.clone()],
            None,
            Some(first_of_tie),
        ),
        (
            "never the excluded one",
            vec![a.clone(), b.clone()],
            Some("b/1"),
            Some("a/1"),
        ),
        (
            "the excluded one alone: none",
            vec![b.clone()],
            Some("b/1"),
            None,
        ),
        (
            "every slot taken: the least loaded",
            vec![over.clone(), full.clone()],
            None,
            Some("d/1"),
        ),
    ];
    for (what, cands, exclude, want) in cases {
        assert_eq!(name(choose(&cands, exclude)).as_deref(), want, "{what}");
    }
}

#[test]
fn readdress_table() {
    let from = cand("a/1", 0);
    let free = cand("b/1", 1);
    let busy = cand("c/1", 0);
    let to = |r: Option<Option<&Candidate>>| r.map(|c| c.map(|c| c.identity.clone()));
    // (what, candidates, lapsed, outcome: None stays, Some(None) to nobody)
    type Case<'a> = (&'a str, Vec<Candidate>, bool, Option<Option<&'a str>>);
    let cases: Vec<Case> = vec![
        (
            "slow, another has a slot: moved",
            vec![from.clone(), free.clone()],
            false,
            Some(Some("b/1")),
        ),
        (
            "slow, the others are busy: stays",
            vec![from.clone(), busy.clone()],
            false,
            None,
        ),
        ("slow, alone: stays", vec![from.clone()], false, None),
        (
            "lapsed, others busy: to the least loaded",
            vec![busy.clone()],
            true,
            Some(Some("c/1")),
        ),
        ("lapsed, nobody else: to nobody", vec![], true, Some(None)),
    ];
    for (what, cands, lapsed, want) in cases {
        assert_eq!(
            to(readdress(&cands, "a/1", lapsed)),
            want.map(|o| o.map(str::to_owned)),
            "{what}"
        );
    }
}

fn worker(identity: &str, queues: &[&str], slots: Option<i32>, holds: usize) -> WorkerLease {
    let mut w = WorkerLease::new(
        &worker_lease_name(identity),
        WorkerLeaseSpec {
            holder_identity: identity.into(),
            queues: queues.iter().map(|q| (*q).to_owned()).collect(),
            lease_duration_seconds: 30,
            renew_time: None,
            holds: (0..holds)
                .map(|i| batchlease_api::AttemptRef {
                    name: format!("l{i}"),
                    uid: format!("u{i}"),
                })
                .collect(),
            slots,
            takes_bound: None,
        },
    );
    w.metadata.namespace = Some("ns".into());
    w
}

#[test]
fn candidates_table() {
    let now = Instant::now();
    let fresh = now.checked_sub(Duration::from_secs(5));
    // Half its 30 s duration: a worker renewed 20 s ago is not addressed.
    let stale = now.checked_sub(Duration::from_secs(20));
    let workers = [
        worker("old/1", &["q"], None, 0),
        worker("other-queue/1", &["r"], Some(4), 0),
        worker("lapsed/1", &["q"], Some(4), 0),
        worker("unseen/1", &["q"], Some(4), 0),
        worker("busy/1", &["q", "r"], Some(4), 1),
        worker("drain/1", &["q"], Some(0), 2),
    ];
    let renewed = |w: &WorkerLease| {
        let seen = match w.spec.holder_identity.as_str() {
            "lapsed/1" => stale,
            "unseen/1" => None,
            _ => fresh,
        }?;
        Some(Renewals {
            seen,
            observed: None,
        })
    };
    // busy: 3 held seen by the lease watch (more than its WorkerLease
    // lists yet) and 1 offer outstanding.
    let held = |id: &str| if id == "busy/1" { 3 } else { 0 };
    let addressed = |id: &str| usize::from(id == "busy/1");
    let got: Vec<(String, i64)> =
        candidates(&workers, "q", now, renewed, held, addressed, |_| false)
            .into_iter()
            .map(|c| (c.identity, c.free))
            .collect();
    assert_eq!(
        got,
        vec![("busy/1".to_owned(), 0)],
        "only live workers of the queue that take addressed offers and are not draining"
    );
    // Live by its sight (in a list), renewing as observed: what binding
    // reads is the latter.
    let w = worker("w/1", &["q"], Some(2), 0);
    let with = |observed| {
        candidates(
            [&w],
            "q",
            now,
            |_| {
                Some(Renewals {
                    seen: now,
                    observed,
                })
            },
            |_| 0,
            |_| 0,
            |_| false,
        )
        .pop()
        .map(|c| c.renewed)
    };
    assert_eq!(with(None), Some(None), "a candidate, not renewing as seen");
    assert_eq!(with(fresh), Some(fresh));
}

fn offer(name: &str, to: Option<&str>, phase: LeasePhase, holder: Option<&str>) -> TaskLease {
    let mut l = TaskLease::new(name, TaskLeaseSpec::offered("t", "uid", "q", 1, 30));
    l.metadata.namespace = Some("ns".into());
    l.spec.offered_to = to.map(str::to_owned);
    l.spec.holder_identity = holder.map(str::to_owned);
    l.status = Some(TaskLeaseStatus {
        phase: Some(phase),
        ..Default::default()
    });
    l
}

#[test]
fn book_counts_outstanding_offers_and_keeps_their_age() {
    let book = OfferBook::default();
    let t0 = Instant::now();
    let t1 = t0 + Duration::from_secs(10);
    // Written by this process, then seen by the watch: the age is the write's.
    book.addressed("ns", "a-1", Some("w/1"), t0);
    book.observe(&offer("a-1", Some("w/1"), LeasePhase::Offered, None), t1);
    assert_eq!(book.since("ns", "a-1", "w/1", t1), t0);
    // Seen addressed elsewhere: counted from then.
    book.observe(&offer("a-1", Some("w/2"), LeasePhase::Offered, None), t1);
    assert_eq!(
        book.since("ns", "a-1", "w/2", t1 + Duration::from_secs(1)),
        t1
    );
    book.observe(&offer("b-1", Some("w/2"), LeasePhase::Offered, None), t1);
    book.observe(&offer("c-1", None, LeasePhase::Offered, None), t1);
    book.observe(&offer("a-1", Some("w/1"), LeasePhase::Offered, None), t1);
    let counts = book.counts("ns");
    assert_eq!(counts.get("w/1"), Some(&1));
    assert_eq!(counts.get("w/2"), Some(&1));
    assert!(book.counts("other").is_empty());
    // Claimed, ended, dropped, deleted: no longer outstanding.
    book.observe(
        &offer("a-1", Some("w/1"), LeasePhase::Held, Some("w/1")),
        t1,
    );
    book.addressed("ns", "b-1", None, t1);
    assert!(book.counts("ns").is_empty());
    book.observe(&offer("d-1", Some("w/1"), LeasePhase::Offered, None), t1);
    book.observe(&offer("d-1", Some("w/1"), LeasePhase::Released, None), t1);
    book.observe(&offer("e-1", Some("w/1"), LeasePhase::Offered, None), t1);
    book.forget("ns", "e-1");
    assert!(book.counts("ns").is_empty());
    // A fresh process learns an address at its first look.
    assert_eq!(book.since("ns", "f-1", "w/1", t1), t1);
    // A relist forgets what it no longer lists, not what was written meanwhile.
    book.list_started();
    book.addressed("ns", "g-1", Some("w/1"), t1);
    book.list_done();
    assert_eq!(
        book.counts("ns").into_iter().collect::<Vec<_>>(),
        vec![("w/1".to_owned(), 1)]
    );
}

/// The tasks to wake when an addressee's WorkerLease is deleted: those of
/// its outstanding offers the watch has shown, kept across a move written
/// by this process, not those claimed or moved elsewhere.
#[test]
fn the_book_knows_the_tasks_offered_to_a_worker() {
    let book = OfferBook::default();
    let t0 = Instant::now();
    let task = |name: &str, to: Option<&str>, phase, holder| {
        let mut l = offer(name, to, phase, holder);
        l.spec.task_name = format!("task-{name}");
        l
    };
    // Written before the watch shows it: known from the write.
    book.addressed_new("ns", "a-1", "task-a-1", "w/1", t0);
    assert_eq!(
        book.tasks_offered_to("ns", "w/1"),
        vec!["task-a-1".to_owned()]
    );
    book.observe(&task("a-1", Some("w/1"), LeasePhase::Offered, None), t0);
    book.observe(&task("b-1", Some("w/1"), LeasePhase::Offered, None), t0);
    book.observe(&task("c-1", Some("w/2"), LeasePhase::Offered, None), t0);
    book.observe(&task("d-1", Some("w/1"), LeasePhase::Held, Some("w/1")), t0);
    assert_eq!(
        book.tasks_offered_to("ns", "w/1"),
        vec!["task-a-1".to_owned(), "task-b-1".to_owned()]
    );
    // Moved by this process: the task goes with it.
    book.addressed("ns", "b-1", Some("w/2"), t0);
    assert_eq!(
        book.tasks_offered_to("ns", "w/1"),
        vec!["task-a-1".to_owned()]
    );
    assert_eq!(
        book.tasks_offered_to("ns", "w/2"),
        vec!["task-b-1".to_owned(), "task-c-1".to_owned()]
    );
    assert!(book.tasks_offered_to("other", "w/1").is_empty());
}

#[test]
fn addressing_sets_field_and_label_together() {
    let l = offer("a-1", None, LeasePhase::Offered, None);
    let c = cand("w/1", 1);
    let to = addressed(&l, Some(&c));
    assert_eq!(to.spec.offered_to.as_deref(), Some("w/1"));
    assert_eq!(to.labels().get(LABEL_WORKER), Some(&c.label));
    let back = addressed(&to, None);
    assert_eq!(back.spec.offered_to, None);
    assert!(!back.labels().contains_key(LABEL_WORKER));
    assert_eq!(
        back.spec.task_name, l.spec.task_name,
        "nothing else changes"
    );
}

#[test]
fn a_candidate_cites_the_renewal_seen_only_if_it_takes_bound_attempts() {
    let now = Instant::now();
    let at = MicroTime(k8s_openapi::jiff::Timestamp::from_second(100).unwrap());
    let mut takes = worker("b/1", &["q"], Some(2), 0);
    takes.spec.takes_bound = Some(true);
    takes.spec.renew_time = Some(at.clone());
    let mut older = worker("o/1", &["q"], Some(2), 0);
    older.spec.renew_time = Some(at.clone());
    let got: Vec<(String, Option<MicroTime>)> = candidates(
        &[takes, older],
        "q",
        now,
        |_| {
            Some(Renewals {
                seen: now,
                observed: Some(now),
            })
        },
        |_| 0,
        |_| 0,
        |_| false,
    )
    .into_iter()
    .map(|c| (c.identity, c.bind_at))
    .collect();
    assert_eq!(
        got,
        vec![("b/1".to_owned(), Some(at)), ("o/1".to_owned(), None)]
    );
}

#[test]
fn an_attempt_listed_but_over_takes_no_slot() {
    let now = Instant::now();
    // Lists l0 and l1 until its next renewal; the lease cache shows l0
    // Completed already.
    let w = worker("w/1", &["q"], Some(2), 2);
    let free = |ended: &dyn Fn(&batchlease_api::AttemptRef) -> bool| {
        candidates(
            [&w],
            "q",
            now,
            |_| {
                Some(Renewals {
                    seen: now,
                    observed: Some(now),
                })
            },
            |_| 0,
            |_| 0,
            ended,
        )[0]
        .free
    };
    assert_eq!(free(&|_| false), 0);
    assert_eq!(free(&|a| a.name == "l0"), 1);
}

#[test]
fn bound_table() {
    let at = MicroTime(k8s_openapi::jiff::Timestamp::from_second(100).unwrap());
    let l = addressed(
        &offer("a-1", None, LeasePhase::Offered, None),
        Some(&cand("w/1", 1)),
    );
    let now = Instant::now();
    let with = |free: i64, bind_at: Option<MicroTime>, age: u64| Candidate {
        bind_at,
        renewed: Some(now - Duration::from_secs(age)),
        ..cand("w/1", free)
    };
    // (candidate, bound?) — the lease's TTL is 30 s.
    let cases = [
        (
            "a free slot, takes bound",
            with(1, Some(at.clone()), 0),
            true,
        ),
        ("seen renewed 14 s ago", with(1, Some(at.clone()), 14), true),
        (
            "seen renewed half a TTL ago: maybe stopped",
            with(1, Some(at.clone()), 15),
            false,
        ),
        (
            "no free slot: an offer that waits for one",
            with(0, Some(at.clone()), 0),
            false,
        ),
        (
            "over its slots (a drain)",
            with(-1, Some(at.clone()), 0),
            false,
        ),
        ("takes no bound attempts", with(3, None, 0), false),
        (
            "its renewal seen only in a list",
            Candidate {
                renewed: None,
                ..with(1, Some(at.clone()), 0)
            },
            false,
        ),
    ];
    for (what, c, want) in cases {
        let got = bound(&l, &c, now);
        assert_eq!(got.is_some(), want, "{what}");
        if let Some(b) = got {
            assert_eq!(
                b.status.as_ref().and_then(|s| s.phase),
                Some(LeasePhase::Held),
                "{what}"
            );
            assert_eq!(b.spec.holder_identity.as_deref(), Some("w/1"));
            assert_eq!(b.spec.offered_to.as_deref(), Some("w/1"), "address kept");
            assert_eq!(b.labels().get(LABEL_WORKER), l.labels().get(LABEL_WORKER));
            assert_eq!(b.spec.renewal, Some(batchlease_api::Renewal::Worker));
            assert_eq!(b.spec.bound_at.as_ref(), Some(&at), "cites the renewal");
            assert_eq!(b.spec.renew_time.as_ref(), Some(&at));
            assert!(b.bound());
            assert_eq!(
                (b.spec.fencing_token, &b.spec.task_name),
                (l.spec.fencing_token, &l.spec.task_name)
            );
        }
    }
}

#[test]
fn a_queue_with_a_worker_that_takes_no_addressed_offers_is_mixed() {
    let workers = [
        worker("new/1", &["q"], Some(2), 0),
        worker("draining/1", &["q"], Some(0), 1),
        worker("per-lease/1", &["q"], None, 0),
    ];
    let addressable = addressable(&workers);
    let present = |ids: &[&str]| ids.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    assert!(
        !mixed(&present(&["new/1", "draining/1"]), &addressable),
        "a drain is not a mix"
    );
    assert!(mixed(&present(&["new/1", "per-lease/1"]), &addressable));
    assert!(
        mixed(&present(&["new/1", "old-sdk/1"]), &addressable),
        "no WorkerLease at all"
    );
    assert!(!mixed(&[], &addressable));
}

#[test]
fn bindable_free_table() {
    let binds = |identity: &str, free: i64| Candidate {
        bind_at: Some(MicroTime(k8s_openapi::jiff::Timestamp::UNIX_EPOCH)),
        ..cand(identity, free)
    };
    for (name, candidates, want) in [
        ("no worker, none awaited: not held for slots", vec![], None),
        (
            "one that only claims",
            vec![binds("a", 2), cand("b", 1)],
            None,
        ),
        (
            "all bind, slots free",
            vec![binds("a", 2), binds("b", 1)],
            Some(3),
        ),
        (
            "all bind, all taken",
            vec![binds("a", 0), binds("b", 0)],
            Some(0),
        ),
        (
            "a draining worker's negative count takes nothing from the others",
            vec![binds("a", -3), binds("b", 1)],
            Some(1),
        ),
    ] {
        assert_eq!(bindable_free(&candidates, 0), want, "{name}");
    }
    // Every worker that takes bound attempts drains (slots 0) or went
    // silent lately: issues wait, they do not go out open to all.
    assert_eq!(bindable_free(&[], 2), Some(0));
    assert_eq!(bindable_free(&[binds("a", 0)], 1), Some(0));
}

#[test]
fn awaited_workers_take_bound_attempts_and_went_silent_lately_if_at_all() {
    let now = Instant::now() + Duration::from_secs(1000);
    let ago = |s: u64| now.checked_sub(Duration::from_secs(s));
    // Durations are 30 s: awaited while silent for less than 60 s (twice
    // 30 s is no more than SILENT_AWAITED).
    let w = |name: &str, queues: &[&str], slots, takes_bound| {
        let mut l = worker(name, queues, slots, 0);
        l.spec.takes_bound = takes_bound;
        l
    };
    for (name, lease, renewed, want) in [
        (
            "resting: live, no slots",
            w("a", &["q"], Some(0), Some(true)),
            ago(1),
            1,
        ),
        (
            "resting, then silent",
            w("a", &["q"], Some(0), Some(true)),
            ago(20),
            1,
        ),
        (
            "resting, silent too long",
            w("a", &["q"], Some(0), Some(true)),
            ago(60),
            0,
        ),
        ("only claims", w("a", &["q"], Some(0), None), ago(1), 0),
        (
            "another queue",
            w("a", &["other"], Some(0), Some(true)),
            ago(1),
            0,
        ),
        (
            "silent lately",
            w("a", &["q"], Some(3), Some(true)),
            ago(20),
            1,
        ),
        (
            "silent just under the bound",
            w("a", &["q"], Some(3), Some(true)),
            ago(59),
            1,
        ),
        (
            "silent too long",
            w("a", &["q"], Some(3), Some(true)),
            ago(60),
            0,
        ),
        (
            "silent, takes no bound attempts",
            w("a", &["q"], Some(3), Some(false)),
            ago(20),
            0,
        ),
        (
            "no slots set: not addressed",
            w("a", &["q"], None, Some(true)),
            ago(1),
            0,
        ),
        (
            "never seen renewed",
            w("a", &["q"], Some(3), Some(true)),
            None,
            0,
        ),
    ] {
        let got = awaited(std::slice::from_ref(&lease), "q", now, |_| renewed);
        assert_eq!(got, want, "{name}");
    }
    // A long duration awaits twice its length.
    let mut long = w("a", &["q"], Some(3), Some(true));
    long.spec.lease_duration_seconds = 90;
    assert_eq!(
        awaited(std::slice::from_ref(&long), "q", now, |_| ago(170)),
        1
    );
    assert_eq!(
        awaited(std::slice::from_ref(&long), "q", now, |_| ago(180)),
        0
    );
}

fn given_back(reason: &str, phase: LeasePhase, bound_at: Option<i64>) -> TaskLease {
    let mut l = TaskLease::new("t-1", TaskLeaseSpec::offered("t", "uid", "q", 1, 30));
    l.metadata.namespace = Some("ns".into());
    l.spec.holder_identity = Some("w/1".into());
    l.spec.bound_at = bound_at.map(stamp);
    l.status = Some(TaskLeaseStatus {
        phase: Some(phase),
        outcome: Some(batchlease_api::LeaseOutcome::Interrupted),
        reason: Some(reason.into()),
        ..Default::default()
    });
    l
}

fn stamp(s: i64) -> MicroTime {
    MicroTime(k8s_openapi::jiff::Timestamp::from_second(1_800_000_000 + s).unwrap())
}

#[test]
fn a_bound_attempt_given_back_unconfirmed_declines_its_citation() {
    let bu = batchlease_api::BOUND_UNCONFIRMED;
    for (name, lease, want) in [
        (
            "given back unconfirmed",
            given_back(bu, LeasePhase::Released, Some(1)),
            Some(("w/1".to_owned(), stamp(1))),
        ),
        (
            "not bound (a claim)",
            given_back(bu, LeasePhase::Released, None),
            None,
        ),
        (
            "given back for another reason (no slot)",
            given_back("BoundNoSlot", LeasePhase::Released, Some(1)),
            None,
        ),
        (
            "not ended yet",
            given_back(bu, LeasePhase::Held, Some(1)),
            None,
        ),
        // Expired never named: the worker did not take it (frozen,
        // partitioned, dead). Bound to it again at once, each issue lost a
        // TTL: an idle worker stays addressable up to 45 s after its last
        // renewal, and a frozen one has every slot free.
        (
            "expired, never taken",
            given_back(
                batchlease_api::BOUND_NOT_TAKEN,
                LeasePhase::Expired,
                Some(1),
            ),
            Some(("w/1".to_owned(), stamp(1))),
        ),
        (
            "expired for want of renewals (it ran)",
            given_back("LeaseExpired", LeasePhase::Expired, Some(1)),
            None,
        ),
    ] {
        assert_eq!(declined_citation(&lease), want, "{name}");
    }
}

#[test]
fn a_worker_whose_current_renewal_was_declined_is_no_candidate_until_it_renews() {
    let mut w = worker("w/1", &["q"], Some(2), 0);
    w.spec.renew_time = Some(stamp(1));
    assert!(cites_declined(&w, Some(&stamp(1))), "the declined renewal");
    assert!(!cites_declined(&w, None), "nothing declined");
    w.spec.renew_time = Some(stamp(2));
    assert!(!cites_declined(&w, Some(&stamp(1))), "renewed since");
    // The book learns it from the lease watch, per worker, the last one.
    let book = OfferBook::default();
    let now = Instant::now();
    let bu = batchlease_api::BOUND_UNCONFIRMED;
    book.observe(&given_back(bu, LeasePhase::Held, Some(1)), now);
    assert_eq!(book.declined("ns", "w/1"), None, "still held");
    book.observe(&given_back(bu, LeasePhase::Released, Some(1)), now);
    assert_eq!(book.declined("ns", "w/1"), Some(stamp(1)));
    book.observe(&given_back(bu, LeasePhase::Released, Some(2)), now);
    assert_eq!(book.declined("ns", "w/1"), Some(stamp(2)), "the later one");
    // An older give-back seen after (a relist): the later citation stays.
    book.observe(&given_back(bu, LeasePhase::Released, Some(1)), now);
    assert_eq!(
        book.declined("ns", "w/1"),
        Some(stamp(2)),
        "still the later"
    );
    assert_eq!(book.declined("other", "w/1"), None, "per namespace");
}
