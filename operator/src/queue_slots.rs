//! The queue book's side of issues waiting for workers' slots
//! (`queue_gate::worker_slots`): what a pass counted, and what wakes the
//! lines held for slots.

use tokio::time::Instant;

use super::{Book, QueueBook};

impl QueueBook {
    /// What a pass that could issue found of the queue's workers: `free`
    /// slots between them when every live one takes bound attempts, `None`
    /// otherwise (`offers::bindable_free`). Waiters are woken for slots
    /// the count did not have before (a worker joined, an end this queue
    /// did not see: a worker serving several queues); when the slots stop
    /// holding issues back (a worker that takes claims joined, or none is
    /// live nor awaited: `offers::awaited`) the line goes on as the
    /// TaskQueue allows.
    pub fn worker_slots(&self, ns: &str, queue: &str, free: Option<usize>) {
        let woken = {
            let mut book = self.lock();
            let q = book
                .queues
                .entry((ns.to_owned(), queue.to_owned()))
                .or_default();
            let was = std::mem::replace(&mut q.worker_slots, free);
            match (was, free) {
                (Some(_), None) => q.wake(Instant::now()),
                (was, Some(now_free)) if now_free > was.unwrap_or(0) => q.wake(Instant::now()),
                _ => Vec::new(),
            }
        };
        self.send(ns, woken);
    }

    /// A WorkerLease of `ns` serving `queues` was written or deleted: the
    /// oldest `room` waiters (at least one) of each of those queues held
    /// for workers' slots look again. `room`: the free slots it says it
    /// has (what it lists may include attempts already over). The wake-up
    /// for a worker that joined, left, or changed what it takes — the pass
    /// of the first waiter counts the queue's slots afresh
    /// ([`QueueBook::worker_slots`]).
    pub fn worker_changed(&self, ns: &str, queues: &[String], room: usize) {
        let mut woken = Vec::new();
        {
            let book = self.lock();
            for queue in queues {
                if let Some(q) = book.queues.get(&(ns.to_owned(), queue.clone()))
                    && q.worker_slots.is_some()
                {
                    woken.extend(q.waiters.values().take(room.max(1)).cloned());
                }
            }
        }
        self.send(ns, woken);
    }

    /// The WorkerLease watch listed: the first waiter of each line held
    /// for workers' slots counts them again (held before the list, a
    /// leader's issues wait for it).
    pub fn workers_listed(&self) {
        let woken: Vec<(String, String)> = self
            .lock()
            .queues
            .iter()
            .filter(|(_, q)| q.worker_slots.is_some())
            .filter_map(|((ns, _), q)| Some((ns.clone(), q.waiters.values().next()?.clone())))
            .collect();
        for (ns, task) in woken {
            self.send(&ns, vec![task]);
        }
    }

    /// A lease held by `holder` in `ns` ended: its slot is free for the
    /// other queues `holder` serves too, whose lines this end does not
    /// wake otherwise (one waiter each).
    pub(super) fn slot_freed(book: &Book, ns: &str, queue: &str, holder: &str) -> Vec<String> {
        let now = Instant::now();
        book.queues
            .iter()
            .filter(|((n, qn), q)| {
                n == ns && qn != queue && q.worker_slots.is_some() && q.serves(holder, now)
            })
            .flat_map(|(_, q)| q.waiters.values().next().cloned())
            .collect()
    }
}
