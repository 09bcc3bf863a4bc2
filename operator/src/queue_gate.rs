//! What a queue allows an issue now, as pure functions: its `TaskQueue`
//! (pause, concurrency cap, issue rate: design §9) and its workers' free
//! slots when every worker of the queue takes bound attempts
//! ([`worker_slots`]). `queues` keeps the state they are applied to.

use std::time::Duration;

use batchlease_api::TaskQueueSpec;
use tokio::time::Instant;

use crate::decide::QueueGate;

/// A token bucket holding one second's worth of `rate` (at least one).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Bucket {
    tokens: f64,
    at: Option<Instant>,
}

impl Bucket {
    fn refill(&mut self, rate: u32, now: Instant) {
        let cap = f64::from(rate.max(1));
        self.tokens = match self.at {
            None => cap,
            Some(t) => (self.tokens
                + f64::from(rate) * now.saturating_duration_since(t).as_secs_f64())
            .min(cap),
        };
        self.at = Some(now);
    }

    /// How long until a token is there (zero: now).
    pub fn wait(&mut self, rate: u32, now: Instant) -> Duration {
        self.refill(rate, now);
        if self.tokens >= 1.0 || rate == 0 {
            return Duration::ZERO;
        }
        Duration::from_secs_f64((1.0 - self.tokens) / f64::from(rate))
    }

    /// Takes a token (call after [`Bucket::wait`] said zero).
    pub fn take(&mut self, rate: u32, now: Instant) -> bool {
        self.refill(rate, now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// Pure: what `spec` allows with `live` leases live (reserved included)
/// and `token_wait` until the next rate token. `position`: how many tasks
/// wait ahead of this one (a throttled task comes back when its turn is
/// due, not all at once).
pub fn gate(
    spec: Option<&TaskQueueSpec>,
    live: usize,
    token_wait: Duration,
    position: usize,
) -> QueueGate {
    let Some(spec) = spec else {
        return QueueGate::Open;
    };
    if spec.paused {
        return QueueGate::Paused;
    }
    if let Some(max) = spec.max_concurrent
        && live >= usize::try_from(max.max(0)).unwrap_or(0)
    {
        return QueueGate::Full;
    }
    if let Some(rate) = spec
        .max_issues_per_second
        .and_then(|r| u32::try_from(r).ok())
    {
        // Whoever finds a token takes it; without one, a waiter comes back
        // when its turn in the line is due rather than all at once.
        if !token_wait.is_zero() {
            let turn = Duration::from_secs_f64(position as f64 / f64::from(rate.max(1)));
            return QueueGate::Throttled(token_wait + turn);
        }
    }
    QueueGate::Open
}

/// Pure: `gate` (what the TaskQueue allows) with the queue's workers'
/// slots applied. `free`: the free slots of its live workers when every
/// one of them takes bound attempts (none when none is live but one that
/// takes them went silent lately: `offers::bindable_free`), `None`
/// otherwise; `in_flight`: issues of this process reserved but not yet
/// addressed (their slots are not in `free` yet); `position`: waiters
/// ahead of this task.
///
/// Why hold an issue back when no worker has a slot: the offer would go
/// to a worker as a backlog and cost a claim write when a slot frees; held
/// until a slot frees, it is created bound to that worker — one write
/// fewer per task, and no lease object sitting unclaimed (kube-scheduler
/// likewise leaves a pod unbound until a node has room for it). Safety
/// does not rest on it: a held-back task writes nothing.
pub fn worker_slots(
    gate: QueueGate,
    free: Option<usize>,
    in_flight: usize,
    position: usize,
) -> QueueGate {
    match (gate, free) {
        (QueueGate::Open, Some(free)) if position >= free.saturating_sub(in_flight) => {
            QueueGate::WorkerSlots
        }
        (g, _) => g,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(paused: bool, max: Option<i32>, rate: Option<i32>) -> TaskQueueSpec {
        TaskQueueSpec {
            paused,
            max_concurrent: max,
            max_issues_per_second: rate,
        }
    }

    #[test]
    fn worker_slots_table() {
        use QueueGate::*;
        let t = Throttled(Duration::from_secs(1));
        for (name, gate, free, in_flight, position, want) in [
            ("not gated by slots", Open, None, 3, 9, Open),
            ("a free slot, first in line", Open, Some(1), 0, 0, Open),
            ("no free slot", Open, Some(0), 0, 0, WorkerSlots),
            (
                "the free slot is a waiter's ahead",
                Open,
                Some(1),
                0,
                1,
                WorkerSlots,
            ),
            ("two free, second in line", Open, Some(2), 0, 1, Open),
            (
                "the free slot taken by an issue in flight",
                Open,
                Some(1),
                1,
                0,
                WorkerSlots,
            ),
            ("more in flight than free", Open, Some(1), 5, 0, WorkerSlots),
            (
                "the TaskQueue's pause comes first",
                Paused,
                Some(0),
                0,
                0,
                Paused,
            ),
            ("its cap", Full, Some(0), 0, 0, Full),
            ("its rate", t, Some(5), 0, 0, t),
        ] {
            assert_eq!(
                worker_slots(gate, free, in_flight, position),
                want,
                "{name}"
            );
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
}
