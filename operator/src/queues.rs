//! The issuer's side of `TaskQueue` (design §9): pause, concurrency cap and
//! issue rate, enforced where leases are issued.
//!
//! The lease cache lags the API server, and the controller reconciles many
//! tasks at once, so "how many leases are live" is counted here, not read
//! from the cache alone: every issue reserves its slot (and its rate token)
//! under one lock *before* its writes, and the reservation is dropped once
//! the lease watch shows the lease (which then counts as live) or the issue
//! failed: refused, or failed in any way before its lease create was sent
//! (an issue is a status write, then the create; no lease can come of an
//! issue whose status write failed, whatever the answer was). A create
//! whose answer was lost keeps the slot until the watch shows the lease,
//! or the tombstone that retires its name (see `decide::RetireToken`:
//! once that is in, the lost create can never land). Two concurrent issues
//! can therefore never both take the last slot. The count starts from the
//! lease watch's list, so a new leader counts what its predecessor left
//! live.
//!
//! Tasks held back wait without polling, in line: the queue wakes the
//! oldest waiters (through the controller's wake-up channel), one per free
//! slot, when a lease ends, when the TaskQueue changes, and when a woken
//! waiter leaves the line without issuing — and, for issues waiting for
//! workers' slots, on what may free one (`queue_slots.rs`). Waiters keep
//! their places until they issue; one not held back again for
//! [`STALE_WAITER`] is dropped.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::Duration;

use batchlease_api::{LeasePhase, TaskLease, TaskQueue, TaskQueueSpec, ThrottleCounts};
use futures::channel::mpsc::UnboundedSender;
use kube::ResourceExt;
use kube::runtime::reflector::ObjectRef;
use tokio::time::Instant;

use crate::decide::QueueGate;
use crate::queue_gate::{self, Bucket, gate};

/// A reservation the watch never confirmed (a lease create whose answer
/// was lost and whose name no tombstone retired, e.g. its task was deleted)
/// is given up after this long: longer than two bounded writes (a status
/// write and a create, each at most a leader term or a minute), so a
/// create still on its way when the reservation goes cannot exist.
const RESERVATION_TIMEOUT: Duration = Duration::from_secs(300);

/// A waiter that has not been held back again for this long is dropped
/// from the line (a task deleted while the watch was down, which no event
/// and no reconcile will ever remove): held-back tasks of a full queue look
/// again every [`crate::decide::QUEUE_RECHECK`], throttled ones sooner.
/// Paused waiters are kept (they are woken by the resume).
const STALE_WAITER: Duration = Duration::from_secs(90);

type Key = (String, String);

#[derive(Debug, Default)]
struct Queue {
    spec: Option<TaskQueueSpec>,
    /// Offered or Held leases as the watch shows them: name → task.
    live: HashMap<String, String>,
    /// Issues of this process not yet shown by the watch, by lease name.
    reserved: HashMap<String, Reservation>,
    bucket: Bucket,
    /// Tasks held back, oldest first (sequence → task), and each task's
    /// sequence.
    waiters: BTreeMap<u64, String>,
    /// Task → (its sequence, when it was last held back).
    waiting: HashMap<String, (u64, Instant)>,
    throttled: ThrottleCounts,
    /// Holders of the queue's leases → until when they count as seen (the
    /// last observation plus the lease's TTL).
    holders: HashMap<String, Instant>,
    /// Workers whose presence record names the queue → until when they
    /// count (the last observation plus the record's duration).
    present: HashMap<String, Instant>,
    /// The free slots of the queue's live workers, as the last pass that
    /// could issue found them, when every one of them takes bound attempts
    /// (`queue_gate::worker_slots`); `None`: issues are not held for slots.
    worker_slots: Option<usize>,
}

/// One issue's claim on a slot of its queue.
#[derive(Debug, Clone, Copy)]
struct Reservation {
    since: Instant,
    /// The lease create was sent: from now on only the watch (the lease,
    /// or the tombstone of its name) or [`RESERVATION_TIMEOUT`] ends the
    /// reservation.
    create_sent: bool,
}

impl Queue {
    fn occupied(&mut self, now: Instant) -> usize {
        self.reserved
            .retain(|_, r| now.saturating_duration_since(r.since) < RESERVATION_TIMEOUT);
        self.live.len()
            + self
                .reserved
                .keys()
                .filter(|k| !self.live.contains_key(*k))
                .count()
    }

    fn rate(&self) -> Option<u32> {
        self.spec
            .as_ref()
            .and_then(|s| s.max_issues_per_second)
            .and_then(|r| u32::try_from(r).ok())
    }

    /// Drops waiters not held back for [`STALE_WAITER`] (not while paused).
    fn prune_stale(&mut self, now: Instant) {
        if self.spec.as_ref().is_some_and(|s| s.paused) {
            return;
        }
        let stale: Vec<String> = self
            .waiting
            .iter()
            .filter(|(_, (_, at))| now.saturating_duration_since(*at) > STALE_WAITER)
            .map(|(t, _)| t.clone())
            .collect();
        for t in stale {
            self.stop_waiting(&t);
        }
    }

    fn gate_for(&mut self, task: &str, now: Instant) -> QueueGate {
        self.prune_stale(now);
        let occupied = self.occupied(now);
        let token_wait = match self.rate() {
            Some(r) => self.bucket.wait(r, now),
            None => Duration::ZERO,
        };
        let position = match self.waiting.get(task) {
            Some((seq, _)) => self.waiters.range(..*seq).count(),
            None => self.waiters.len(),
        };
        // Slots go to the waiters in order: those ahead of this task count
        // as taken (a woken waiter keeps its place; a newcomer queues).
        let g = gate(
            self.spec.as_ref(),
            occupied + position,
            token_wait,
            position,
        );
        queue_gate::worker_slots(g, self.worker_slots, self.in_flight(), position)
    }

    /// Issues reserved whose lease create is not on its way yet: their
    /// addresses are not in the count of workers' free slots.
    fn in_flight(&self) -> usize {
        self.reserved.values().filter(|r| !r.create_sent).count()
    }

    /// Whether `identity` was seen serving this queue (a presence record
    /// or WorkerLease naming it, or a lease of it held) and still counts.
    fn serves(&self, identity: &str, now: Instant) -> bool {
        [self.present.get(identity), self.holders.get(identity)]
            .into_iter()
            .flatten()
            .any(|until| *until > now)
    }

    /// Whether anything may hold an issue of this queue back.
    fn gated(&self) -> bool {
        self.spec.is_some() || self.worker_slots.is_some()
    }

    fn wait(&mut self, task: &str, seq: &mut u64, why: QueueGate, now: Instant) -> bool {
        if let Some((_, at)) = self.waiting.get_mut(task) {
            *at = now;
            return false;
        }
        *seq += 1;
        self.waiters.insert(*seq, task.to_owned());
        self.waiting.insert(task.to_owned(), (*seq, now));
        match why {
            QueueGate::Paused => self.throttled.paused += 1,
            QueueGate::Full => self.throttled.max_concurrent += 1,
            QueueGate::Throttled(_) => self.throttled.rate += 1,
            QueueGate::WorkerSlots => self.throttled.worker_slots += 1,
            QueueGate::Open => {}
        }
        true
    }

    /// Removes `task` from the line; `true` if it was in it.
    fn stop_waiting(&mut self, task: &str) -> bool {
        match self.waiting.remove(task) {
            Some((seq, _)) => {
                self.waiters.remove(&seq);
                true
            }
            None => false,
        }
    }

    /// The oldest waiters, one per free slot (all of them without a cap).
    /// While issues wait for workers' slots, no more than the free slots
    /// the last pass counted (less the issues on their way), and at least
    /// one: whatever woke the line (an end, a failed issue) may have freed
    /// a slot that count did not have. They keep their places until they
    /// issue (or are no longer held back), so a newcomer cannot overtake
    /// them.
    fn wake(&mut self, now: Instant) -> Vec<String> {
        self.prune_stale(now);
        let free = match self.spec.as_ref() {
            Some(s) if s.paused => 0,
            Some(TaskQueueSpec {
                max_concurrent: Some(max),
                ..
            }) => usize::try_from(*max)
                .unwrap_or(0)
                .saturating_sub(self.occupied(now)),
            _ => usize::MAX,
        };
        let free = match self.worker_slots {
            Some(slots) => free.min(slots.saturating_sub(self.in_flight()).max(1)),
            None => free,
        };
        self.waiters.values().take(free).cloned().collect()
    }
}

/// Per (namespace, queue): the TaskQueue's spec, live leases,
/// reservations, rate bucket and waiters.
#[derive(Debug)]
pub struct QueueBook {
    state: Mutex<Book>,
    wake: UnboundedSender<ObjectRef<batchlease_api::BatchTask>>,
}

#[derive(Debug, Default)]
struct Book {
    queues: HashMap<Key, Queue>,
    seq: u64,
    /// During a (re)list of the leases: the live ones listed so far.
    listing: Option<HashMap<Key, HashMap<String, String>>>,
    /// During a (re)list of the TaskQueues: those listed so far.
    listing_queues: Option<std::collections::HashSet<Key>>,
}

fn live(l: &TaskLease) -> bool {
    matches!(
        l.status.as_ref().and_then(|s| s.phase),
        None | Some(LeasePhase::Offered | LeasePhase::Held)
    )
}

fn key_of(l: &TaskLease) -> Key {
    (l.namespace().unwrap_or_default(), l.spec.queue.clone())
}

impl QueueBook {
    /// An empty book that wakes tasks through `wake`.
    pub fn new(wake: UnboundedSender<ObjectRef<batchlease_api::BatchTask>>) -> Self {
        Self {
            state: Mutex::new(Book::default()),
            wake,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Book> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn send(&self, ns: &str, tasks: Vec<String>) {
        for t in tasks {
            let _ = self.wake.unbounded_send(ObjectRef::new(&t).within(ns));
        }
    }

    /// Wakes `tasks` of namespace `ns` (a pass for each, now).
    pub fn wake_tasks(&self, ns: &str, tasks: Vec<String>) {
        self.send(ns, tasks);
    }

    /// What the queue allows task `task` now (for [`crate::decide::Input`]).
    pub fn peek(&self, ns: &str, queue: &str, task: &str, now: Instant) -> QueueGate {
        let mut book = self.lock();
        match book.queues.get_mut(&(ns.to_owned(), queue.to_owned())) {
            Some(q) if q.gated() => q.gate_for(task, now),
            _ => QueueGate::Open,
        }
    }

    /// The decision held `task` back for `why`: it joins the queue's
    /// waiting list (counted as throttled once per wait). `Some(true)` when
    /// it was not waiting yet; `None` when the queue (looked at again,
    /// under the lock) no longer holds it back — it changed since the pass
    /// looked, and its wake-up may have gone out before the task was on
    /// the list: the caller decides again.
    pub fn hold(
        &self,
        ns: &str,
        queue: &str,
        task: &str,
        why: QueueGate,
        now: Instant,
    ) -> Option<bool> {
        let mut book = self.lock();
        let Book { queues, seq, .. } = &mut *book;
        let q = queues.get_mut(&(ns.to_owned(), queue.to_owned()))?;
        let first = q.wait(task, seq, why, now);
        if !q.gated() || q.gate_for(task, now) == QueueGate::Open {
            return None;
        }
        Some(first)
    }

    /// Whether the queue holds `task` back for more than a moment (paused,
    /// full or out of workers' slots with it in line): such a task does not wait for resource
    /// locks, so it must not keep younger users of its resources waiting.
    pub fn holds_back(&self, ns: &str, queue: &str, task: &str, now: Instant) -> bool {
        matches!(
            self.peek(ns, queue, task, now),
            QueueGate::Paused | QueueGate::Full | QueueGate::WorkerSlots
        )
    }

    /// `task` is not held back (any other decision, or it is gone). If
    /// it was in line, a slot it was woken for goes to the next waiter.
    pub fn release_waiter(&self, ns: &str, queue: &str, task: &str) {
        let woken = {
            let mut book = self.lock();
            let Some(q) = book.queues.get_mut(&(ns.to_owned(), queue.to_owned())) else {
                return;
            };
            if !q.stop_waiting(task) || !q.gated() {
                return;
            }
            q.wake(Instant::now())
        };
        self.send(ns, woken);
    }

    /// Reserves the slot and the rate token of an issue of `lease` for
    /// `task`, if the queue (checked again, under the lock) still allows
    /// it. `false`: held back after all (another issue took the slot).
    pub fn reserve(&self, ns: &str, queue: &str, task: &str, lease: &str, now: Instant) -> bool {
        let mut book = self.lock();
        let Book { queues, seq, .. } = &mut *book;
        let q = queues.entry((ns.to_owned(), queue.to_owned())).or_default();
        if q.gated() {
            let g = q.gate_for(task, now);
            if g != QueueGate::Open {
                q.wait(task, seq, g, now);
                return false;
            }
            if let Some(r) = q.rate()
                && !q.bucket.take(r, now)
            {
                q.wait(task, seq, QueueGate::Throttled(Duration::ZERO), now);
                return false;
            }
        }
        q.stop_waiting(task);
        // The same issue again (its task's cache lagged its own status
        // write) keeps what is known of the first: a create sent for it.
        q.reserved.entry(lease.to_owned()).or_insert(Reservation {
            since: now,
            create_sent: false,
        });
        true
    }

    /// The lease create of the issue of `lease` is about to be sent.
    pub fn create_sent(&self, ns: &str, queue: &str, lease: &str) {
        let mut book = self.lock();
        if let Some(r) = book
            .queues
            .get_mut(&(ns.to_owned(), queue.to_owned()))
            .and_then(|q| q.reserved.get_mut(lease))
        {
            r.create_sent = true;
        }
    }

    /// The issue of `lease` failed and no lease can come of it: its slot
    /// is free again. `create_failed`: its lease create was refused (4xx or
    /// a conflict). Otherwise its status write failed, with any answer (a
    /// 5xx, a timeout: the write may even have been applied, but the create
    /// was never sent); a reservation whose create was sent by an earlier
    /// attempt of the same issue is kept.
    pub fn unreserve(&self, ns: &str, queue: &str, lease: &str, create_failed: bool, now: Instant) {
        let woken = {
            let mut book = self.lock();
            let Some(q) = book.queues.get_mut(&(ns.to_owned(), queue.to_owned())) else {
                return;
            };
            match q.reserved.get(lease) {
                Some(r) if create_failed || !r.create_sent => {
                    q.reserved.remove(lease);
                }
                _ => return,
            }
            q.wake(now)
        };
        self.send(ns, woken);
    }

    /// The lease watch showed `l` (an add or a change).
    pub fn lease_seen(&self, l: &TaskLease, now: Instant) {
        let key = key_of(l);
        let name = l.name_any();
        let woken = {
            let mut book = self.lock();
            if let Some(listing) = book.listing.as_mut()
                && live(l)
            {
                listing
                    .entry(key.clone())
                    .or_default()
                    .insert(name.clone(), l.spec.task_name.clone());
            }
            let q = book.queues.entry(key.clone()).or_default();
            q.reserved.remove(&name);
            if l.status.as_ref().and_then(|s| s.phase) == Some(LeasePhase::Held)
                && let Some(h) = l.spec.holder_identity.clone()
            {
                if !q.holders.contains_key(&h) {
                    // A new holder: forget those not seen for a TTL (no
                    // status loop reads queues without a TaskQueue).
                    q.holders.retain(|_, until| *until > now);
                }
                let ttl = Duration::from_secs(
                    u64::try_from(l.spec.lease_duration_seconds.max(1)).unwrap_or(1),
                );
                q.holders.insert(h, now + ttl);
            }
            if live(l) {
                q.live.insert(name, l.spec.task_name.clone());
                Vec::new()
            } else if q.live.remove(&name).is_some() {
                let mut woken = q.wake(now);
                if let Some(h) = l.spec.holder_identity.as_deref() {
                    woken.extend(Self::slot_freed(&book, &key.0, &key.1, h));
                }
                woken
            } else {
                Vec::new()
            }
        };
        self.send(&key.0, woken);
    }

    /// The lease watch showed `l` deleted.
    pub fn lease_gone(&self, l: &TaskLease, now: Instant) {
        let key = key_of(l);
        let woken = {
            let mut book = self.lock();
            let Some(q) = book.queues.get_mut(&key) else {
                return;
            };
            q.reserved.remove(&l.name_any());
            if q.live.remove(&l.name_any()).is_some() {
                let mut woken = q.wake(now);
                if let Some(h) = l.spec.holder_identity.as_deref() {
                    woken.extend(Self::slot_freed(&book, &key.0, &key.1, h));
                }
                woken
            } else {
                Vec::new()
            }
        };
        self.send(&key.0, woken);
    }

    /// A (re)list of the leases begins.
    pub fn list_started(&self) {
        self.lock().listing = Some(HashMap::new());
    }

    /// The (re)list ended: the live leases are exactly those it listed.
    pub fn list_done(&self, now: Instant) {
        let mut woken = Vec::new();
        {
            let mut book = self.lock();
            let Some(mut listed) = book.listing.take() else {
                return;
            };
            for (key, q) in &mut book.queues {
                q.live = listed.remove(key).unwrap_or_default();
                woken.push((key.0.clone(), q.wake(now)));
            }
            for (key, live) in listed {
                book.queues.entry(key).or_default().live = live;
            }
        }
        for (ns, tasks) in woken {
            self.send(&ns, tasks);
        }
    }

    /// A TaskQueue was added or changed: its spec is in force from now.
    /// The waiters a slot is free for are woken (a resume, a raised cap),
    /// and on a pause the tasks with live leases, so their unclaimed offers
    /// are withdrawn.
    pub fn queue_seen(&self, tq: &TaskQueue, now: Instant) {
        let key = (tq.namespace().unwrap_or_default(), tq.name_any());
        let woken = {
            let mut book = self.lock();
            let q = book.queues.entry(key.clone()).or_default();
            let changed = q.spec.as_ref() != Some(&tq.spec);
            q.spec = Some(tq.spec.clone());
            if !changed {
                Vec::new()
            } else {
                // The line starts afresh from the change (a long pause
                // does not make its waiters stale).
                for (_, at) in q.waiting.values_mut() {
                    *at = now;
                }
                // A resume or a raised cap: the waiters a slot is free for.
                let mut w = q.wake(now);
                if tq.spec.paused {
                    w.extend(q.live.values().cloned());
                }
                w
            }
        };
        self.send(&key.0, woken);
    }

    /// A (re)list of the TaskQueues begins.
    pub fn queues_list_started(&self) {
        self.lock().listing_queues = Some(std::collections::HashSet::new());
    }

    /// One TaskQueue of a (re)list (after [`QueueBook::queue_seen`]).
    pub fn queue_listed(&self, tq: &TaskQueue) {
        if let Some(l) = self.lock().listing_queues.as_mut() {
            l.insert((tq.namespace().unwrap_or_default(), tq.name_any()));
        }
    }

    /// The (re)list ended: a TaskQueue it did not show was deleted while
    /// the watch was down (no Delete event comes for it).
    pub fn queues_list_done(&self) {
        let mut woken = Vec::new();
        {
            let mut book = self.lock();
            let Some(listed) = book.listing_queues.take() else {
                return;
            };
            for (key, q) in &mut book.queues {
                if q.spec.is_some() && !listed.contains(key) {
                    q.spec = None;
                    q.waiting.clear();
                    woken.push((key.0.clone(), std::mem::take(&mut q.waiters)));
                }
            }
        }
        for (ns, waiters) in woken {
            self.send(&ns, waiters.into_values().collect());
        }
    }

    /// A TaskQueue was deleted: its queue has no controls any more.
    pub fn queue_gone(&self, tq: &TaskQueue) {
        let key = (tq.namespace().unwrap_or_default(), tq.name_any());
        let woken = {
            let mut book = self.lock();
            let Some(q) = book.queues.get_mut(&key) else {
                return;
            };
            q.spec = None;
            q.waiting.clear();
            std::mem::take(&mut q.waiters).into_values().collect()
        };
        self.send(&key.0, woken);
    }

    /// A worker's presence record was seen (`presence` parses and feeds
    /// it; the book takes plain data, so it does not import `presence`):
    /// `identity` serves these `queues` of `ns` for `duration` from `now`.
    pub fn worker_seen(
        &self,
        ns: &str,
        identity: &str,
        queues: &[String],
        duration: Duration,
        now: Instant,
    ) {
        let mut book = self.lock();
        for queue in queues {
            let q = book
                .queues
                .entry((ns.to_owned(), queue.clone()))
                .or_default();
            q.present.retain(|_, until| *until > now);
            q.present.insert(identity.to_owned(), now + duration);
        }
    }

    /// A worker's presence record was deleted: `identity` stopped serving
    /// these `queues` of `ns`.
    pub fn worker_gone(&self, ns: &str, identity: &str, queues: &[String]) {
        let mut book = self.lock();
        for queue in queues {
            if let Some(q) = book.queues.get_mut(&(ns.to_owned(), queue.clone())) {
                q.present.remove(identity);
            }
        }
    }

    /// The workers seen serving a queue now: presence records and
    /// WorkerLeases naming it, and holders of its leases seen within one
    /// TTL (whether it is served by a worker that takes no addressed
    /// offers: `offers::mixed`).
    pub fn workers_present(&self, ns: &str, queue: &str, now: Instant) -> Vec<String> {
        let book = self.lock();
        let Some(q) = book.queues.get(&(ns.to_owned(), queue.to_owned())) else {
            return Vec::new();
        };
        q.present
            .iter()
            .chain(q.holders.iter())
            .filter(|(_, until)| **until > now)
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// Issues held back so far, and the distinct workers of a queue: those
    /// whose presence record names it, and the holders of its leases seen
    /// within one TTL (a worker without a record, e.g. an older SDK or no
    /// RBAC for it).
    pub fn summary(&self, ns: &str, queue: &str, now: Instant) -> (ThrottleCounts, i64) {
        let mut book = self.lock();
        let Some(q) = book.queues.get_mut(&(ns.to_owned(), queue.to_owned())) else {
            return (ThrottleCounts::default(), 0);
        };
        q.holders.retain(|_, until| *until > now);
        q.present.retain(|_, until| *until > now);
        let workers = q.present.len()
            + q.holders
                .keys()
                .filter(|h| !q.present.contains_key(*h))
                .count();
        (
            q.throttled.clone(),
            i64::try_from(workers).unwrap_or(i64::MAX),
        )
    }
}

#[path = "queue_slots.rs"]
mod slots;

#[cfg(test)]
#[path = "queues_tests.rs"]
mod tests;
