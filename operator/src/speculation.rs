//! The abort rate of speculative execution as a signal (design §6, §7):
//! which settled attempts count, the rate over a queue's recent attempts,
//! and the health band it falls in.
//!
//! A speculative queue trades lock waits for wasted work: every abort ran
//! the handler for nothing (and its compensations). Below 10 % aborts that
//! is a good trade; up to 25 % it still pays for cheap tasks; above 30 %
//! most of the work is thrown away and attempts mostly beat each other — a
//! livelock the quarantine (Exclusive after `maxSpeculativeAborts`) only
//! bounds per task. The rate is taken over the last [`WINDOW`] attempts of
//! a queue, so it follows the load instead of averaging over all time.

use std::collections::{BTreeMap, VecDeque};

use batchlease_api::{BatchTask, TaskMode};

use crate::decide::types::Transition;
use crate::status::{Cond, cond};
use batchlease_api::keys::condition;

/// Speculative attempts the rate is taken over, per queue.
pub const WINDOW: usize = 100;
/// Attempts in the window before a band other than `Good` is reported:
/// two aborts of the first three attempts are no livelock.
pub const MIN_SAMPLES: usize = 20;

/// Whether `transition` settles an attempt that ran speculatively, and if
/// so whether it aborted. `before` is the task as it was when the attempt
/// ended (its `effectiveMode` is the attempt's mode: a quarantine switches
/// it in the very write that settles the abort). A drained attempt
/// (`Interrupted`) says nothing about contention and is not counted.
pub fn settled_attempt(before: &BatchTask, transition: &Transition) -> Option<bool> {
    let mode = before
        .status
        .as_ref()
        .and_then(|s| s.effective_mode)
        .unwrap_or(before.spec.mode);
    if mode != TaskMode::Speculative {
        return None;
    }
    match transition {
        Transition::Aborted { .. } => Some(true),
        Transition::Succeeded | Transition::Retry { .. } | Transition::DeadLettered { .. } => {
            Some(false)
        }
        _ => None,
    }
}

/// The health bands of design §6.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Band {
    /// Under 10 % (or too few attempts to tell).
    Good,
    /// 10–25 %: acceptable for cheap tasks.
    Acceptable,
    /// 25–30 %: costly; watch it.
    Costly,
    /// Over 30 %: livelock.
    Livelock,
}

/// The band of `rate` over `samples` attempts.
pub fn band(rate: f64, samples: usize) -> Band {
    if samples < MIN_SAMPLES || rate < 0.10 {
        Band::Good
    } else if rate <= 0.25 {
        Band::Acceptable
    } else if rate <= 0.30 {
        Band::Costly
    } else {
        Band::Livelock
    }
}

/// The `SpeculationHealthy` condition for `queue` at `rate`.
pub fn health(queue: &str, rate: f64, samples: usize) -> Cond {
    let pct = rate * 100.0;
    let (ok, reason, advice) = match band(rate, samples) {
        Band::Good => (true, "AbortRateLow", "under 10%: speculation pays"),
        Band::Acceptable => (
            true,
            "AbortRateAcceptable",
            "10-25%: acceptable for cheap tasks",
        ),
        Band::Costly => (
            true,
            "AbortRateCostly",
            "25-30%: most of the gain is lost to retries",
        ),
        Band::Livelock => (
            false,
            "AbortRateLivelock",
            "over 30%: attempts mostly beat each other; run these tasks Exclusive or spread their keys",
        ),
    };
    cond(
        condition::SPECULATION_HEALTHY,
        ok,
        reason,
        &format!(
            "queue {queue}: {pct:.0}% of the last {samples} speculative attempts aborted ({advice})"
        ),
    )
}

/// The last [`WINDOW`] speculative outcomes per queue (true: aborted).
/// A queue is a name within a namespace: tenants whose queues share a name
/// never share a window (one tenant's aborts must not flip another's
/// `SpeculationHealthy` nor put livelock Events on its tasks).
#[derive(Debug, Default)]
pub struct AbortWindow {
    queues: BTreeMap<(String, String), VecDeque<bool>>,
}

impl AbortWindow {
    fn get(&self, ns: &str, queue: &str) -> Option<&VecDeque<bool>> {
        self.queues.get(&(ns.to_owned(), queue.to_owned()))
    }

    /// The rate and sample count queue `queue` of namespace `ns` would
    /// have with `aborted` added.
    pub fn with(&self, ns: &str, queue: &str, aborted: bool) -> (f64, usize) {
        let q = self.get(ns, queue);
        let mut n = q.map_or(0, VecDeque::len);
        let mut aborts = q.map_or(0, |q| q.iter().filter(|a| **a).count());
        if n == WINDOW {
            // The oldest falls out.
            if q.and_then(|q| q.front().copied()) == Some(true) {
                aborts -= 1;
            }
            n -= 1;
        }
        n += 1;
        aborts += usize::from(aborted);
        (ratio(aborts, n), n)
    }

    /// The rate and sample count of the queue now.
    pub fn rate(&self, ns: &str, queue: &str) -> (f64, usize) {
        self.get(ns, queue).map_or((0.0, 0), |q| {
            (ratio(q.iter().filter(|a| **a).count(), q.len()), q.len())
        })
    }

    /// Adds an outcome; returns the new rate and sample count.
    pub fn record(&mut self, ns: &str, queue: &str, aborted: bool) -> (f64, usize) {
        let q = self
            .queues
            .entry((ns.to_owned(), queue.to_owned()))
            .or_default();
        if q.len() == WINDOW {
            q.pop_front();
        }
        q.push_back(aborted);
        let aborts = q.iter().filter(|a| **a).count();
        (ratio(aborts, q.len()), q.len())
    }

    /// Drops the windows of the queues `gone` says are gone.
    pub fn forget(&mut self, gone: impl Fn(&(String, String)) -> bool) {
        self.queues.retain(|k, _| !gone(k));
    }
}

fn ratio(a: usize, n: usize) -> f64 {
    if n == 0 {
        return 0.0;
    }
    // Both at most WINDOW: exact in f64.
    a as f64 / n as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use batchlease_api::{BatchTaskSpec, BatchTaskStatus};

    fn task(spec: TaskMode, effective: Option<TaskMode>) -> BatchTask {
        let mut s = BatchTaskSpec::for_queue("q");
        s.mode = spec;
        let mut t = BatchTask::new("t", s);
        t.status = Some(BatchTaskStatus {
            effective_mode: effective,
            ..Default::default()
        });
        t
    }

    #[test]
    fn which_settled_attempts_count() {
        use TaskMode::{Exclusive, Speculative};
        let retry = Transition::Retry {
            reason: "HandlerFailed".into(),
            expired: false,
            delay_seconds: 1.0,
        };
        let dead = Transition::DeadLettered {
            reason: "x".into(),
            expired: true,
        };
        let cases = [
            (
                Speculative,
                Some(Speculative),
                Transition::Aborted { quarantined: false },
                Some(true),
            ),
            // The abort that quarantines is still a speculative one.
            (
                Speculative,
                Some(Speculative),
                Transition::Aborted { quarantined: true },
                Some(true),
            ),
            (
                Speculative,
                Some(Speculative),
                Transition::Succeeded,
                Some(false),
            ),
            (Speculative, None, Transition::Succeeded, Some(false)),
            (Speculative, Some(Speculative), retry.clone(), Some(false)),
            (Speculative, Some(Speculative), dead, Some(false)),
            (
                Speculative,
                Some(Speculative),
                Transition::Interrupted { delay_seconds: 0.0 },
                None,
            ),
            (
                Speculative,
                Some(Speculative),
                Transition::Claimed { holder: "w".into() },
                None,
            ),
            // Quarantined: its attempts run Exclusive and do not count.
            (Speculative, Some(Exclusive), Transition::Succeeded, None),
            (
                Speculative,
                Some(Exclusive),
                Transition::Aborted { quarantined: false },
                None,
            ),
            (Exclusive, None, Transition::Succeeded, None),
            (Exclusive, Some(Exclusive), retry, None),
        ];
        for (spec, eff, tr, want) in cases {
            assert_eq!(
                settled_attempt(&task(spec, eff), &tr),
                want,
                "{spec:?} {eff:?} {tr:?}"
            );
        }
    }

    #[test]
    fn bands_follow_the_design() {
        let cases = [
            (0.0, 100, Band::Good),
            (0.099, 100, Band::Good),
            (0.10, 100, Band::Acceptable),
            (0.25, 100, Band::Acceptable),
            (0.26, 100, Band::Costly),
            (0.30, 100, Band::Costly),
            (0.31, 100, Band::Livelock),
            (1.0, 100, Band::Livelock),
            // Too few attempts to tell.
            (1.0, MIN_SAMPLES - 1, Band::Good),
            (0.5, MIN_SAMPLES, Band::Livelock),
        ];
        for (rate, n, want) in cases {
            assert_eq!(band(rate, n), want, "{rate} over {n}");
        }
        let c = health("hot", 0.42, 100);
        assert!(!c.status);
        assert_eq!(c.reason, "AbortRateLivelock");
        assert!(
            c.message.starts_with("queue hot: 42% of the last 100"),
            "{}",
            c.message
        );
        assert!(health("q", 0.05, 100).status);
    }

    #[test]
    fn the_window_keeps_the_last_attempts() {
        let mut w = AbortWindow::default();
        assert_eq!(w.with("a", "q", true), (1.0, 1));
        for _ in 0..WINDOW {
            w.record("a", "q", true);
        }
        assert_eq!(w.record("a", "q", true), (1.0, WINDOW));
        // Successes push the aborts out, one by one.
        assert_eq!(w.with("a", "q", false), (0.99, WINDOW));
        for _ in 0..WINDOW / 2 {
            w.record("a", "q", false);
        }
        assert_eq!(w.record("a", "q", false), (0.49, WINDOW));
        assert_eq!(w.with("a", "other", false), (0.0, 1), "per queue");
    }

    #[test]
    fn tenants_with_a_queue_of_the_same_name_have_their_own_windows() {
        let mut w = AbortWindow::default();
        for _ in 0..WINDOW {
            w.record("tenant-b", "q", true);
        }
        assert_eq!(w.rate("tenant-b", "q"), (1.0, WINDOW));
        assert_eq!(w.rate("tenant-a", "q"), (0.0, 0));
        assert_eq!(w.with("tenant-a", "q", false), (0.0, 1));
        w.record("tenant-a", "q", false);
        w.forget(|(ns, _)| ns == "tenant-b");
        assert_eq!(w.rate("tenant-b", "q"), (0.0, 0), "forgotten");
        assert_eq!(w.rate("tenant-a", "q"), (0.0, 1), "kept");
    }
}
