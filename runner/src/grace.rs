//! How long the child gets between SIGTERM and SIGKILL.
//!
//! The kill switch fires 2/3 of the TTL after the last successful
//! renewal was *sent*; the operator reissues the lease no earlier than a
//! full TTL after a renewal it observed (which is after the send). So the
//! SIGKILL must land within TTL/3 of the SIGTERM, less a margin for the
//! runner's own reaction (timer wake-up, the `kill` calls): then no
//! process of the child is alive when another worker can start the task.

use std::time::Duration;

/// Taken off TTL/3 for the runner's own latency.
pub const SAFETY_MARGIN: Duration = Duration::from_millis(500);

/// The longest TTL the CRD allows (`leaseDurationSeconds` ≤ 3600).
pub const MAX_TTL: Duration = Duration::from_secs(3600);

/// The longest grace that still ends before a lease of `ttl` could be
/// reissued.
pub fn budget(ttl: Duration) -> Duration {
    (ttl / 3).saturating_sub(SAFETY_MARGIN)
}

/// The grace for an attempt whose lease lasts `ttl`: the configured one,
/// or the budget when the configured one would outlive the lease (the
/// caller logs that).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Grace {
    AsConfigured(Duration),
    Clamped { configured: Duration, to: Duration },
}

impl Grace {
    pub fn get(self) -> Duration {
        match self {
            Self::AsConfigured(d) => d,
            Self::Clamped { to, .. } => to,
        }
    }
}

/// The grace for one attempt.
pub fn for_attempt(configured: Duration, ttl: Duration) -> Grace {
    let b = budget(ttl);
    if configured <= b {
        Grace::AsConfigured(configured)
    } else {
        Grace::Clamped { configured, to: b }
    }
}

/// A grace that no lease could ever honour (longer than the largest
/// TTL's budget) is refused at start; what fits only a long TTL is
/// clamped per attempt instead (the TTL is the task's).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "--kill-grace {configured:?} cannot end before any lease is reissued: the kill switch \
     fires at 2/3 of the TTL, so the grace must be under TTL/3 - {SAFETY_MARGIN:?} \
     ({max:?} for the longest TTL the CRD allows, 3600 s)"
)]
pub struct GraceTooLong {
    pub configured: Duration,
    pub max: Duration,
}

/// Checks the configured grace at start.
pub fn validate(configured: Duration) -> Result<(), GraceTooLong> {
    let max = budget(MAX_TTL);
    if configured > max {
        return Err(GraceTooLong { configured, max });
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const fn s(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    #[test]
    fn grace_per_attempt_table() {
        let ms = Duration::from_millis;
        let cases = [
            // (configured, ttl, effective, clamped)
            (s(5), s(30), s(5), false),
            (ms(9500), s(30), ms(9500), false),
            (s(10), s(30), ms(9500), true),
            (s(5), s(5), ms(1166), true),
            (s(0), s(5), s(0), false),
            (s(100), s(3600), s(100), false),
        ];
        for (configured, ttl, want, clamped) in cases {
            let g = for_attempt(configured, ttl);
            // TTL/3 of 5 s is 1.666… s: compare to the millisecond.
            assert_eq!(
                g.get().as_millis(),
                want.as_millis(),
                "{configured:?} {ttl:?}"
            );
            assert_eq!(
                matches!(g, Grace::Clamped { .. }),
                clamped,
                "{configured:?} {ttl:?}"
            );
            assert!(g.get() + SAFETY_MARGIN <= ttl / 3 || g.get().is_zero());
        }
    }

    #[test]
    fn a_grace_no_ttl_can_hold_is_refused_at_start() {
        assert!(validate(s(10)).is_ok());
        assert!(validate(budget(MAX_TTL)).is_ok());
        let e = validate(s(1200)).unwrap_err();
        assert!(e.to_string().contains("2/3 of the TTL"), "{e}");
    }
}
