//! When to stop claiming: a worker whose attempts keep ending before their
//! handler runs (its storage refuses or cannot take their registration)
//! must not go on claiming. Each such attempt is given back without
//! spending a retry, and one that fails that fast wins most claims — a
//! broken worker would take every offer of its queue and run none.
//!
//! After [`STREAK`] such attempts in a row the worker pauses its claims,
//! for [`FIRST_PAUSE`] doubling to [`MAX_PAUSE`] while it keeps happening;
//! one attempt whose handler ran resets it. Only attempts claimed after
//! the last pause began count towards the next one: the slots that were
//! already running when a database blipped all fail together, and must
//! not double the pause once each (a fleet sharing that database would
//! stop claiming for minutes after an outage of seconds). Pure: the
//! caller passes the times and acts on the answer.

use std::time::Duration;

use tokio::time::Instant;

/// Attempts in a row that ended before their handler ran, before the
/// worker pauses its claims.
pub const STREAK: u32 = 3;
/// The first pause.
pub const FIRST_PAUSE: Duration = Duration::from_secs(5);
/// The longest pause.
pub const MAX_PAUSE: Duration = Duration::from_secs(300);

/// The brake's state.
#[derive(Debug, Default, Clone)]
pub struct ClaimBrake {
    /// Attempts in a row that ended before their handler ran.
    streak: u32,
    /// Pauses since the last attempt whose handler ran.
    pauses: u32,
    paused_until: Option<Instant>,
    /// When the last pause began.
    paused_at: Option<Instant>,
}

impl ClaimBrake {
    /// An attempt claimed at `claimed` ended before its handler ran, at
    /// `now`. Returns the pause this starts, if it starts one.
    pub fn not_started(&mut self, claimed: Instant, now: Instant) -> Option<Duration> {
        if self.paused_at.is_some_and(|began| claimed < began) {
            // In flight when the last pause began: already counted.
            return None;
        }
        self.streak = self.streak.saturating_add(1);
        if self.streak < STREAK {
            return None;
        }
        let pause = FIRST_PAUSE
            .saturating_mul(1 << self.pauses.min(16))
            .min(MAX_PAUSE);
        self.pauses = self.pauses.saturating_add(1);
        // The streak starts again: the first attempt after the pause
        // decides alone whether to pause again (and longer).
        self.streak = STREAK - 1;
        self.paused_until = Some(now + pause);
        self.paused_at = Some(now);
        Some(pause)
    }

    /// An attempt's handler ran (whatever its outcome): the worker's
    /// storage works.
    pub fn started(&mut self) {
        *self = Self::default();
    }

    /// Until when claims wait, if they do at `now`.
    pub fn paused_until(&self, now: Instant) -> Option<Instant> {
        self.paused_until.filter(|until| *until > now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pauses_after_a_streak_doubling_to_the_cap() {
        let t0 = Instant::now();
        let mut b = ClaimBrake::default();
        assert_eq!(b.not_started(t0, t0), None);
        assert_eq!(b.not_started(t0, t0), None);
        assert_eq!(b.paused_until(t0), None, "no pause before the streak");
        assert_eq!(b.not_started(t0, t0), Some(FIRST_PAUSE));
        assert_eq!(b.paused_until(t0), Some(t0 + FIRST_PAUSE));
        assert_eq!(b.paused_until(t0 + FIRST_PAUSE), None, "the pause ends");
        // After a pause, one more failure pauses again, twice as long.
        let t1 = t0 + FIRST_PAUSE;
        assert_eq!(b.not_started(t1, t1), Some(FIRST_PAUSE * 2));
        assert_eq!(b.not_started(t1, t1), Some(FIRST_PAUSE * 4));
        let mut last = None;
        for _ in 0..20 {
            last = b.not_started(t1, t1);
        }
        assert_eq!(last, Some(MAX_PAUSE));
    }

    #[test]
    fn an_attempt_whose_handler_ran_resets_it() {
        let t0 = Instant::now();
        let mut b = ClaimBrake::default();
        for _ in 0..STREAK {
            b.not_started(t0, t0);
        }
        assert!(b.paused_until(t0).is_some());
        b.started();
        assert_eq!(b.paused_until(t0), None);
        assert_eq!(b.not_started(t0, t0), None, "a fresh streak");
        assert_eq!(b.not_started(t0, t0), None);
        assert_eq!(
            b.not_started(t0, t0),
            Some(FIRST_PAUSE),
            "from the first pause again"
        );
    }

    /// Eight slots whose registrations all fail at once (a database
    /// fail-over): one pause, not one doubling per slot.
    #[test]
    fn attempts_in_flight_when_a_pause_began_do_not_double_it() {
        let t0 = Instant::now();
        let mut b = ClaimBrake::default();
        let ended = t0 + Duration::from_secs(1);
        let pauses: Vec<_> = (0..8).filter_map(|_| b.not_started(t0, ended)).collect();
        assert_eq!(pauses, vec![FIRST_PAUSE]);
        assert_eq!(b.paused_until(ended), Some(ended + FIRST_PAUSE));
        // One claimed after the pause ended and failing again doubles it.
        let later = ended + FIRST_PAUSE;
        assert_eq!(b.not_started(later, later), Some(FIRST_PAUSE * 2));
    }

    #[test]
    fn failures_between_successes_never_pause() {
        let t0 = Instant::now();
        let mut b = ClaimBrake::default();
        for _ in 0..10 {
            assert_eq!(b.not_started(t0, t0), None);
            assert_eq!(b.not_started(t0, t0), None);
            b.started();
        }
        assert_eq!(b.paused_until(t0), None);
    }
}
