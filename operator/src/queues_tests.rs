use super::*;
use batchlease_api::{TaskLeaseSpec, TaskLeaseStatus};

fn spec(paused: bool, max: Option<i32>, rate: Option<i32>) -> TaskQueueSpec {
    TaskQueueSpec {
        paused,
        max_concurrent: max,
        max_issues_per_second: rate,
    }
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

/// Holds `tasks` back for workers' slots, in this order.
fn wait_for_slots(b: &QueueBook, tasks: &[&str], now: Instant) {
    for t in tasks {
        let g = b.peek("ns", "q", t, now);
        assert_eq!(g, QueueGate::WorkerSlots, "{t}");
        assert_eq!(b.hold("ns", "q", t, g, now), Some(true), "{t}");
    }
}

#[tokio::test(start_paused = true)]
async fn without_a_free_worker_slot_issues_wait_in_line_and_an_end_wakes_one() {
    let (b, mut rx) = book();
    let now = Instant::now();
    b.lease_seen(&lease("a", LeasePhase::Held), now);
    assert_eq!(
        b.peek("ns", "q", "c", now),
        QueueGate::Open,
        "not gated yet"
    );
    b.worker_slots("ns", "q", Some(0));
    wait_for_slots(&b, &["c", "d", "e"], now);
    assert_eq!(
        b.summary("ns", "q", now).0.max_concurrent,
        0,
        "not the cap's"
    );
    // No TaskQueue: an end still wakes one waiter, not the line.
    b.lease_seen(&lease("a", LeasePhase::Completed), now);
    assert_eq!(woken(&mut rx), vec!["c"]);
    // The woken pass finds the slot (one more than the count had: the
    // head is woken again, no one else); the next in line does not take it.
    b.worker_slots("ns", "q", Some(1));
    assert_eq!(woken(&mut rx), vec!["c"]);
    assert_eq!(b.peek("ns", "q", "c", now), QueueGate::Open);
    assert_eq!(b.peek("ns", "q", "d", now), QueueGate::WorkerSlots);
    assert!(b.reserve("ns", "q", "c", "c-1", now));
    // c's issue is in flight, not yet in the count of free slots.
    assert_eq!(b.peek("ns", "q", "d", now), QueueGate::WorkerSlots);
    assert!(!b.reserve("ns", "q", "d", "d-1", now));
    b.create_sent("ns", "q", "c-1");
    b.worker_slots("ns", "q", Some(0));
    assert_eq!(b.peek("ns", "q", "d", now), QueueGate::WorkerSlots);
    assert_eq!(woken(&mut rx), Vec::<String>::new());
    assert_eq!(b.summary("ns", "q", now).0.worker_slots, 3);
}

#[tokio::test(start_paused = true)]
async fn a_worker_renewing_with_room_wakes_as_many_waiters_of_its_queues() {
    let (b, mut rx) = book();
    let now = Instant::now();
    b.worker_slots("ns", "q", Some(0));
    wait_for_slots(&b, &["c", "d", "e"], now);
    b.worker_changed("ns", &["q".into(), "other".into()], 2);
    assert_eq!(woken(&mut rx), vec!["c", "d"]);
    // No room, or gone: the head counts the slots again.
    b.worker_changed("ns", &["q".into()], 0);
    assert_eq!(woken(&mut rx), vec!["c"]);
    // A count with more room than before wakes as many.
    b.worker_slots("ns", "q", Some(2));
    assert_eq!(woken(&mut rx), vec!["c", "d"]);
    // The WorkerLease watch listed: each held line's head looks again.
    b.workers_listed();
    assert_eq!(woken(&mut rx), vec!["c"]);
}

#[tokio::test(start_paused = true)]
async fn an_end_frees_the_slot_for_the_holders_other_queues_too() {
    let (b, mut rx) = book();
    let now = Instant::now();
    let d = Duration::from_secs(30);
    b.worker_seen("ns", "w", &["q".into(), "q2".into()], d, now);
    b.worker_seen("ns", "x", &["q3".into()], d, now);
    let mut l2 = lease("b", LeasePhase::Held);
    l2.spec.queue = "q2".into();
    b.lease_seen(&l2, now);
    for (queue, task) in [("q", "c"), ("q3", "z")] {
        b.worker_slots("ns", queue, Some(0));
        let g = b.peek("ns", queue, task, now);
        assert_eq!(g, QueueGate::WorkerSlots);
        assert_eq!(b.hold("ns", queue, task, g, now), Some(true));
    }
    // w's lease of q2 ends: q's line (w serves it) wakes, q3's does not.
    l2.status.as_mut().unwrap().phase = Some(LeasePhase::Completed);
    b.lease_seen(&l2, now);
    assert_eq!(woken(&mut rx), vec!["c"]);
}

#[tokio::test(start_paused = true)]
async fn a_woken_waiter_that_leaves_hands_its_wake_on_without_a_taskqueue() {
    let (b, mut rx) = book();
    let now = Instant::now();
    b.lease_seen(&lease("a", LeasePhase::Held), now);
    b.worker_slots("ns", "q", Some(0));
    wait_for_slots(&b, &["c", "d"], now);
    b.lease_seen(&lease("a", LeasePhase::Completed), now);
    assert_eq!(woken(&mut rx), vec!["c"]);
    // c is cancelled (or its lock is taken): d gets the slot's wake.
    b.release_waiter("ns", "q", "c");
    assert_eq!(woken(&mut rx), vec!["d"]);
}

#[tokio::test(start_paused = true)]
async fn a_resume_wakes_as_many_as_the_workers_have_slots() {
    let (b, mut rx) = book();
    let now = Instant::now();
    b.queue_seen(&queue(spec(true, None, None)), now);
    for t in ["x", "y", "z", "w"] {
        let g = b.peek("ns", "q", t, now);
        assert_eq!(g, QueueGate::Paused);
        assert_eq!(b.hold("ns", "q", t, g, now), Some(true));
    }
    b.worker_slots("ns", "q", Some(3));
    woken(&mut rx);
    b.queue_seen(&queue(spec(false, None, None)), now);
    assert_eq!(woken(&mut rx), vec!["x", "y", "z"]);
}

#[tokio::test(start_paused = true)]
async fn when_slots_stop_holding_issues_back_the_line_goes_on() {
    let (b, mut rx) = book();
    let now = Instant::now();
    b.worker_slots("ns", "q", Some(0));
    wait_for_slots(&b, &["c", "d"], now);
    // A worker that only claims joined (or none is live any more).
    b.worker_slots("ns", "q", None);
    assert_eq!(woken(&mut rx), vec!["c", "d"]);
    assert_eq!(b.peek("ns", "q", "d", now), QueueGate::Open);
    // With a TaskQueue's cap the line goes on as the cap allows (c and d
    // are still in it: woken, not yet issued).
    b.queue_seen(&queue(spec(false, Some(1), None)), now);
    woken(&mut rx);
    b.worker_slots("ns", "q", Some(0));
    assert_eq!(b.peek("ns", "q", "c", now), QueueGate::WorkerSlots);
    b.worker_slots("ns", "q", None);
    assert_eq!(woken(&mut rx), vec!["c"], "one slot under the cap");
}

#[tokio::test(start_paused = true)]
async fn the_taskqueue_comes_before_the_workers_slots() {
    let (b, _rx) = book();
    let now = Instant::now();
    b.queue_seen(&queue(spec(true, None, None)), now);
    b.worker_slots("ns", "q", Some(0));
    assert_eq!(b.peek("ns", "q", "c", now), QueueGate::Paused);
    b.queue_seen(&queue(spec(false, Some(1), None)), now);
    b.lease_seen(&lease("a", LeasePhase::Held), now);
    b.worker_slots("ns", "q", Some(5));
    assert_eq!(b.peek("ns", "q", "c", now), QueueGate::Full);
    assert!(b.holds_back("ns", "q", "c", now));
}
