//! Which Events the operator publishes (issue 12: Events are API writes
//! too — three per task when every state change had one, as many as the
//! protocol's own writes).
//!
//! `important` (the default) keeps what an on-call person acts on: every
//! Warning (expiry, retries, dead letters, cycles, repairs, livelock) and
//! the Normal Events that record someone else's action or a recovery
//! (`Reassigned`, `Redriven`). `all` adds one per ordinary step
//! (`LeaseIssued`, `LeaseClaimed`, `Succeeded`, `Interrupted`, `Aborted`,
//! `WaitingForResource`) — for following one task by hand, or in tests.
//! The task's status and conditions say the same either way.

use clap::ValueEnum;
use kube::runtime::events::EventType;

/// How many Events to publish.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum EventLevel {
    #[default]
    Important,
    All,
}

/// Normal Events kept at `important`.
const IMPORTANT_NORMAL: [&str; 2] = ["Reassigned", "Redriven"];

impl EventLevel {
    /// Whether an Event of `type_` with `reason` is published.
    pub fn wants(self, type_: &EventType, reason: &str) -> bool {
        self == Self::All
            || matches!(type_, EventType::Warning)
            || IMPORTANT_NORMAL.contains(&reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn important_keeps_warnings_and_recoveries() {
        use EventType::{Normal, Warning};
        let cases = [
            (Warning, "LeaseExpired", true, true),
            (Warning, "DeadLettered", true, true),
            (Warning, "Interrupted", true, true),
            (Normal, "Reassigned", true, true),
            (Normal, "Redriven", true, true),
            (Normal, "LeaseIssued", false, true),
            (Normal, "LeaseClaimed", false, true),
            (Normal, "Succeeded", false, true),
            (Normal, "Interrupted", false, true),
            (Normal, "WaitingForResource", false, true),
        ];
        for (t, reason, important, all) in cases {
            assert_eq!(
                EventLevel::Important.wants(&t, reason),
                important,
                "{reason}"
            );
            assert_eq!(EventLevel::All.wants(&t, reason), all, "{reason}");
        }
    }
}
