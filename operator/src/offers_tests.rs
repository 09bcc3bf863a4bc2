use super::*;
use batchlease_api::worker_lease::worker_lease_name;
use batchlease_api::{TaskLeaseSpec, TaskLeaseStatus, WorkerLeaseSpec};

fn cand(identity: &str, free: i64) -> Candidate {
    Candidate {
        identity: identity.into(),
        label: worker_lease_name(identity),
        free,
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
    let renewed = |w: &WorkerLease| match w.spec.holder_identity.as_str() {
        "lapsed/1" => stale,
        "unseen/1" => None,
        _ => fresh,
    };
    // busy: 3 held seen by the lease watch (more than its WorkerLease
    // lists yet) and 1 offer outstanding.
    let held = |id: &str| if id == "busy/1" { 3 } else { 0 };
    let addressed = |id: &str| usize::from(id == "busy/1");
    let got: Vec<(String, i64)> = candidates(&workers, "q", now, renewed, held, addressed)
        .into_iter()
        .map(|c| (c.identity, c.free))
        .collect();
    assert_eq!(
        got,
        vec![("busy/1".to_owned(), 0)],
        "only live workers of the queue that take addressed offers and are not draining"
    );
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
