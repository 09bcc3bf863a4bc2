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
const IMPORTANT_NORMAL: [&str; 3] = ["Reassigned", "Redriven", "Cancelled"];

impl EventLevel {
    /// Whether an Event of `type_` with `reason` is published.
    pub fn wants(self, type_: &EventType, reason: &str) -> bool {
        self == Self::All
            || matches!(type_, EventType::Warning)
            || IMPORTANT_NORMAL.contains(&reason)
    }
}

/// The longest regarding-object name kube-rs's `Recorder` can name an
/// Event after: it names it `<name>.<event time in nanoseconds, hex>` (up
/// to 16 digits), and names may be at most 253 characters.
pub const MAX_RECORDER_NAME: usize = 253 - 1 - 16;

/// The name of an Event about object `regarding` at `nanos`: kube-rs's
/// scheme, except that a name too long for it is cut to 200 characters
/// plus a hash of the whole name, so two long names sharing a prefix do not
/// share Events (the API server refused the Events of such tasks outright).
pub fn event_name(regarding: &str, nanos: i128) -> String {
    if regarding.len() <= MAX_RECORDER_NAME {
        return format!("{regarding}.{nanos:x}");
    }
    let hash = batchlease_api::names::short_hash(regarding);
    // Names are DNS subdomains (ASCII): cutting at a byte is at a char.
    let head = regarding
        .get(..200)
        .unwrap_or(regarding)
        .trim_end_matches(['-', '.']);
    format!("{head}-{hash}.{nanos:x}")
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

    #[test]
    fn event_names_fit_the_api_servers_limit() {
        let short = "job";
        assert_eq!(event_name(short, 0x1f), "job.1f");
        let longest_kept = "a".repeat(MAX_RECORDER_NAME);
        assert_eq!(event_name(&longest_kept, 1), format!("{longest_kept}.1"));
        let nanos = i128::from(u64::MAX);
        let a = format!("{}-a", "x".repeat(251));
        let b = format!("{}-b", "x".repeat(251));
        for long in [&a, &b] {
            assert_eq!(long.len(), 253);
            let name = event_name(long, nanos);
            assert!(name.len() <= 253, "{} > 253: {name}", name.len());
            assert!(name.starts_with(&"x".repeat(200)), "{name}");
        }
        assert_ne!(event_name(&a, nanos), event_name(&b, nanos));
        assert_eq!(event_name(&a, nanos), event_name(&a, nanos));
    }
}
