use super::*;
use batchlease_api::{TaskLeaseSpec, TaskLeaseStatus};

fn spec(paused: bool, max: Option<i32>, rate: Option<i32>) -> TaskQueueSpec {
    TaskQueueSpec {
        paused,
        max_concurrent: max,
        max_issues_per_second: rate,
    }
}

#[test]
fn gate_table() {
    let s = Duration::from_secs;
    for (name, spec, live, wait, pos, want) in [
        ("no TaskQueue", None, 100, s(0), 0, QueueGate::Open),
        (
            "all unset",
            Some(spec(false, None, None)),
            100,
            s(0),
            5,
            QueueGate::Open,
        ),
        (
            "paused",
            Some(spec(true, None, None)),
            0,
            s(0),
            0,
            QueueGate::Paused,
        ),
        (
            "paused beats full",
            Some(spec(true, Some(1), None)),
            5,
            s(0),
            0,
            QueueGate::Paused,
        ),
        (
            "below the cap",
            Some(spec(false, Some(2), None)),
            1,
            s(0),
            0,
            QueueGate::Open,
        ),
        (
            "at the cap",
            Some(spec(false, Some(2), None)),
            2,
            s(0),
            0,
            QueueGate::Full,
        ),
        (
            "full beats the rate",
            Some(spec(false, Some(2), Some(1))),
            2,
            s(1),
            0,
            QueueGate::Full,
        ),
        (
            "a token is there",
            Some(spec(false, None, Some(2))),
            0,
            s(0),
            7,
            QueueGate::Open,
        ),
        (
            "no token: the head waits for it",
            Some(spec(false, None, Some(2))),
            0,
            Duration::from_millis(300),
            0,
            QueueGate::Throttled(Duration::from_millis(300)),
        ),
        (
            "no token: the fifth in line waits its turn",
            Some(spec(false, None, Some(2))),
            0,
            Duration::from_millis(300),
            4,
            QueueGate::Throttled(Duration::from_millis(2300)),
        ),
    ] {
        assert_eq!(gate(spec.as_ref(), live, wait, pos), want, "{name}");
    }
}

#[tokio::test(start_paused = true)]
async fn the_bucket_holds_one_second_and_refills_at_the_rate() {
    let t0 = Instant::now();
    let mut b = Bucket::default();
    for _ in 0..4 {
        assert_eq!(b.wait(4, t0), Duration::ZERO);
        assert!(b.take(4, t0));
    }
    assert!(!b.take(4, t0), "a burst of one second's worth, no more");
    assert_eq!(b.wait(4, t0), Duration::from_millis(250));
    let t1 = t0 + Duration::from_millis(250);
    assert!(b.take(4, t1));
    assert!(!b.take(4, t1));
    // An idle queue does not save up more than one second.
    let t2 = t1 + Duration::from_secs(60);
    for _ in 0..4 {
        assert!(b.take(4, t2));
    }
    assert!(!b.take(4, t2));
}

fn book() -> (
    QueueBook,
    futures::channel::mpsc::UnboundedReceiver<ObjectRef<batchlease_api::BatchTask>>,
) {
    let (tx, rx) = futures::channel::mpsc::unbounded();
    (QueueBook::new(tx), rx)
}

fn queue(spec: TaskQueueSpec) -> TaskQueue {
    let mut q = TaskQueue::new("q", spec);
    q.metadata.namespace = Some("ns".into());
    q
}

fn lease(task: &str, phase: LeasePhase) -> TaskLease {
    let mut l = TaskLease::new(
        &format!("{task}-1"),
        TaskLeaseSpec::offered(task, "u", "q", 1, 30),
    );
    l.metadata.namespace = Some("ns".into());
    l.status = Some(TaskLeaseStatus {
        phase: Some(phase),
        ..Default::default()
    });
    if phase != LeasePhase::Offered {
        l.spec.holder_identity = Some("w".into());
    }
    l
}

fn woken(
    rx: &mut futures::channel::mpsc::UnboundedReceiver<ObjectRef<batchlease_api::BatchTask>>,
) -> Vec<String> {
    let mut out = Vec::new();
    while let Ok(r) = rx.try_recv() {
        out.push(r.name);
    }
    out
}

#[tokio::test(start_paused = true)]
async fn reservations_count_before_the_watch_shows_the_lease() {
    let (b, _rx) = book();
    let now = Instant::now();
    b.queue_seen(&queue(spec(false, Some(2), None)), now);
    assert!(b.reserve("ns", "q", "a", "a-1", now));
    assert!(b.reserve("ns", "q", "b", "b-1", now));
    // Two issues in flight, nothing in the cache yet: the third waits.
    assert_eq!(b.peek("ns", "q", "c", now), QueueGate::Full);
    assert!(!b.reserve("ns", "q", "c", "c-1", now));
    // The watch shows them: still two live, still full.
    b.lease_seen(&lease("a", LeasePhase::Offered), now);
    b.lease_seen(&lease("b", LeasePhase::Held), now);
    assert_eq!(b.peek("ns", "q", "c", now), QueueGate::Full);
    // A failed issue gives its slot back.
    b.unreserve("ns", "q", "a-1", false, now);
    assert_eq!(
        b.peek("ns", "q", "c", now),
        QueueGate::Full,
        "a-1 is live in the watch"
    );
}

#[tokio::test(start_paused = true)]
async fn a_lease_that_ends_wakes_the_oldest_waiter_only() {
    let (b, mut rx) = book();
    let now = Instant::now();
    b.queue_seen(&queue(spec(false, Some(1), None)), now);
    b.lease_seen(&lease("a", LeasePhase::Held), now);
    for t in ["c", "d", "e"] {
        let g = b.peek("ns", "q", t, now);
        assert_eq!(g, QueueGate::Full);
        assert_eq!(b.hold("ns", "q", t, g, now), Some(true));
    }
    assert_eq!(woken(&mut rx), Vec::<String>::new());
    b.lease_seen(&lease("a", LeasePhase::Completed), now);
    assert_eq!(woken(&mut rx), vec!["c"]);
    assert!(b.reserve("ns", "q", "c", "c-1", now));
    assert_eq!(b.summary("ns", "q", now).0.max_concurrent, 3);
}

#[tokio::test(start_paused = true)]
async fn pause_wakes_the_holders_of_live_leases_and_resume_every_waiter() {
    let (b, mut rx) = book();
    let now = Instant::now();
    b.queue_seen(&queue(spec(false, None, None)), now);
    b.lease_seen(&lease("a", LeasePhase::Offered), now);
    b.queue_seen(&queue(spec(true, None, None)), now);
    assert_eq!(woken(&mut rx), vec!["a"], "a's offer is to be withdrawn");
    for t in ["x", "y"] {
        let g = b.peek("ns", "q", t, now);
        assert_eq!(g, QueueGate::Paused);
        assert_eq!(b.hold("ns", "q", t, g, now), Some(true));
    }
    // The same spec again (a status write, a resync): nobody is woken.
    b.queue_seen(&queue(spec(true, None, None)), now);
    assert!(woken(&mut rx).iter().all(|t| t == "a"));
    b.queue_seen(&queue(spec(false, None, None)), now);
    let mut w = woken(&mut rx);
    w.sort();
    assert_eq!(w, vec!["x", "y"]);
    assert_eq!(b.summary("ns", "q", now).0.paused, 2);
}

#[tokio::test(start_paused = true)]
async fn a_relist_replaces_the_live_set() {
    let (b, _rx) = book();
    let now = Instant::now();
    b.queue_seen(&queue(spec(false, Some(1), None)), now);
    b.lease_seen(&lease("a", LeasePhase::Held), now);
    assert_eq!(b.peek("ns", "q", "c", now), QueueGate::Full);
    // The lease ended while the watch was down: the relist does not show it.
    b.list_started();
    b.list_done(now);
    assert_eq!(b.peek("ns", "q", "c", now), QueueGate::Open);
}

#[tokio::test(start_paused = true)]
async fn the_rate_is_taken_by_reservations() {
    let (b, _rx) = book();
    let now = Instant::now();
    b.queue_seen(&queue(spec(false, None, Some(2))), now);
    assert!(b.reserve("ns", "q", "a", "a-1", now));
    assert!(b.reserve("ns", "q", "b", "b-1", now));
    assert!(!b.reserve("ns", "q", "c", "c-1", now));
    assert_eq!(
        b.peek("ns", "q", "d", now),
        QueueGate::Throttled(Duration::from_millis(1000)),
        "c waits ahead of d"
    );
    let later = now + Duration::from_millis(500);
    assert!(b.reserve("ns", "q", "c", "c-1", later));
}

#[tokio::test(start_paused = true)]
async fn holders_count_for_one_ttl() {
    let (b, _rx) = book();
    let now = Instant::now();
    b.lease_seen(&lease("a", LeasePhase::Held), now);
    assert_eq!(b.summary("ns", "q", now).1, 1);
    assert_eq!(b.summary("ns", "q", now + Duration::from_secs(31)).1, 0);
}

#[tokio::test(start_paused = true)]
async fn woken_waiters_keep_their_place_and_newcomers_queue_behind() {
    let (b, mut rx) = book();
    let now = Instant::now();
    b.queue_seen(&queue(spec(false, Some(1), None)), now);
    b.lease_seen(&lease("a", LeasePhase::Held), now);
    assert_eq!(b.hold("ns", "q", "c", QueueGate::Full, now), Some(true));
    b.lease_seen(&lease("a", LeasePhase::Completed), now);
    assert_eq!(woken(&mut rx), vec!["c"]);
    // Before c's pass runs, a newcomer looks: the free slot is c's.
    assert_eq!(b.peek("ns", "q", "n", now), QueueGate::Full);
    assert!(!b.reserve("ns", "q", "n", "n-1", now));
    assert!(b.reserve("ns", "q", "c", "c-1", now));
}

#[tokio::test(start_paused = true)]
async fn a_hold_that_finds_the_queue_open_again_says_so() {
    let (b, _rx) = book();
    let now = Instant::now();
    b.queue_seen(&queue(spec(true, None, None)), now);
    let g = b.peek("ns", "q", "c", now);
    assert_eq!(g, QueueGate::Paused);
    // Resumed between the pass's look and its hold: the resume's wake-up
    // went out before c was waiting, so the hold says "decide again".
    b.queue_seen(&queue(spec(false, None, None)), now);
    assert_eq!(b.hold("ns", "q", "c", g, now), None);
}

#[tokio::test(start_paused = true)]
async fn a_queue_deleted_while_the_watch_was_down_loses_its_controls_at_the_relist() {
    let (b, mut rx) = book();
    let now = Instant::now();
    b.queue_seen(&queue(spec(true, None, None)), now);
    assert_eq!(b.hold("ns", "q", "c", QueueGate::Paused, now), Some(true));
    b.queues_list_started();
    b.queues_list_done();
    assert_eq!(b.peek("ns", "q", "c", now), QueueGate::Open);
    assert_eq!(woken(&mut rx), vec!["c"]);
}

#[tokio::test(start_paused = true)]
async fn a_stale_waiter_does_not_block_the_line_for_ever() {
    let (b, mut rx) = book();
    let now = Instant::now();
    b.queue_seen(&queue(spec(false, Some(1), None)), now);
    b.lease_seen(&lease("x", LeasePhase::Held), now);
    // `gone` waits, then is deleted while the watch is down: no event,
    // no reconcile ever removes it.
    assert_eq!(b.hold("ns", "q", "gone", QueueGate::Full, now), Some(true));
    b.lease_seen(&lease("x", LeasePhase::Completed), now);
    assert_eq!(woken(&mut rx), vec!["gone"]);
    assert_eq!(b.peek("ns", "q", "n", now), QueueGate::Full, "gone's slot");
    let later = now + STALE_WAITER + Duration::from_secs(1);
    assert_eq!(b.peek("ns", "q", "n", later), QueueGate::Open);
}

#[tokio::test(start_paused = true)]
async fn a_woken_waiter_that_leaves_passes_its_slot_on() {
    let (b, mut rx) = book();
    let now = Instant::now();
    b.queue_seen(&queue(spec(false, Some(1), None)), now);
    b.lease_seen(&lease("x", LeasePhase::Held), now);
    for t in ["c", "d"] {
        assert_eq!(b.hold("ns", "q", t, QueueGate::Full, now), Some(true));
    }
    b.lease_seen(&lease("x", LeasePhase::Completed), now);
    assert_eq!(woken(&mut rx), vec!["c"]);
    // c was cancelled (or waits for a lock now): d gets the slot.
    b.release_waiter("ns", "q", "c");
    assert_eq!(woken(&mut rx), vec!["d"]);
    assert_eq!(b.peek("ns", "q", "d", now), QueueGate::Open);
}

#[tokio::test(start_paused = true)]
async fn a_long_pause_does_not_make_its_waiters_stale() {
    let (b, mut rx) = book();
    let now = Instant::now();
    b.queue_seen(&queue(spec(true, None, None)), now);
    assert_eq!(b.hold("ns", "q", "c", QueueGate::Paused, now), Some(true));
    let later = now + STALE_WAITER * 10;
    b.queue_seen(&queue(spec(false, None, None)), later);
    assert_eq!(woken(&mut rx), vec!["c"]);
}

#[tokio::test(start_paused = true)]
async fn an_issue_whose_status_write_failed_frees_its_slot_whatever_the_answer() {
    let (b, mut rx) = book();
    let now = Instant::now();
    b.queue_seen(&queue(spec(false, Some(1), None)), now);
    assert!(b.reserve("ns", "q", "a", "a-1", now));
    assert_eq!(b.peek("ns", "q", "b", now), QueueGate::Full);
    assert_eq!(b.hold("ns", "q", "b", QueueGate::Full, now), Some(true));
    // The status write got a 5xx (or no answer): no create was sent, so
    // no lease can come of it. The slot is free, the next waiter woken,
    // and the same issue retried is not held back by its own reservation.
    b.unreserve("ns", "q", "a-1", false, now);
    assert_eq!(woken(&mut rx), vec!["b"]);
    assert_eq!(
        b.peek("ns", "q", "a", now),
        QueueGate::Full,
        "b is first in line"
    );
    b.release_waiter("ns", "q", "b");
    assert!(b.reserve("ns", "q", "a", "a-1", now));
}

#[tokio::test(start_paused = true)]
async fn a_create_with_a_lost_answer_keeps_its_slot_until_the_watch_resolves_it() {
    let (b, _rx) = book();
    let now = Instant::now();
    b.queue_seen(&queue(spec(false, Some(1), None)), now);
    assert!(b.reserve("ns", "q", "a", "a-1", now));
    b.create_sent("ns", "q", "a-1");
    // The create timed out; a later pass of the same issue (the task cache
    // lagging) fails its status write: the create may still land.
    assert!(!b.reserve("ns", "q", "a", "a-1", now), "full: a-1 counts");
    b.release_waiter("ns", "q", "a");
    b.unreserve("ns", "q", "a-1", false, now);
    assert_eq!(b.peek("ns", "q", "b", now), QueueGate::Full);
    // A refused create frees it; so does the watch showing the name
    // taken (the lease itself, or the tombstone that retires it).
    b.unreserve("ns", "q", "a-1", true, now);
    assert_eq!(b.peek("ns", "q", "b", now), QueueGate::Open);
    assert!(b.reserve("ns", "q", "a", "a-1", now));
    b.create_sent("ns", "q", "a-1");
    b.lease_seen(&lease("a", LeasePhase::Released), now);
    assert_eq!(b.peek("ns", "q", "b", now), QueueGate::Open);
}

#[tokio::test(start_paused = true)]
async fn workers_are_those_present_and_the_holders_seen_within_a_ttl() {
    let (b, _rx) = book();
    let now = Instant::now();
    let queues =
        |queues: &[&str]| -> Vec<String> { queues.iter().map(|q| (*q).to_owned()).collect() };
    let ttl = Duration::from_secs(30);
    // An idle worker of q (and of another queue), and another namespace's.
    b.worker_seen("ns", "w", &queues(&["q", "other"]), ttl, now);
    b.worker_seen("ns2", "v", &queues(&["q"]), ttl, now);
    assert_eq!(b.summary("ns", "q", now).1, 1);
    assert_eq!(b.summary("ns", "other", now).1, 1);
    // The same worker holding a lease counts once; a holder without a
    // record (an older SDK) counts too.
    b.lease_seen(&lease("a", LeasePhase::Held), now);
    assert_eq!(b.summary("ns", "q", now).1, 1, "w holds a-1");
    let mut other = lease("b", LeasePhase::Held);
    other.spec.holder_identity = Some("old-sdk".into());
    b.lease_seen(&other, now);
    assert_eq!(b.summary("ns", "q", now).1, 2);
    // A record lapses after its duration unless renewed; a deleted one at
    // once.
    let later = now + Duration::from_secs(31);
    b.worker_seen("ns", "x", &queues(&["q"]), ttl, later);
    assert_eq!(b.summary("ns", "q", later).1, 1, "only x");
    b.worker_gone("ns", "x", &queues(&["q"]));
    assert_eq!(b.summary("ns", "q", later).1, 0);
}
