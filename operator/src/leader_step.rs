//! The election's one decision, pure: what to do with the Lease as read.
//!
//! Nothing in the Lease is trusted but its identity of version: anyone with
//! RBAC on Leases can delete it, clear its holder, name another replica as
//! holder, or shrink its `leaseDurationSeconds` (issue 23). So a replica
//! that does not lead takes the Lease over only after it observed the
//! *same version* of it for a full duration of **its own configured**
//! length, by its own monotonic clock. Whoever led before either renewed
//! within that time (which changes the version and restarts the wait), or
//! its term — which ends `grace` before a duration after its last renewal
//! was sent — is over.
//!
//! A missing Lease is created at once, but **vacated** (no holder): a
//! create is never a term. Its absence could not be waited out instead:
//! absence has no version, so a Lease created and deleted again between
//! two looks (a rival's term begun in between) would look like one long
//! absence — the model checker found exactly that. The created version is
//! new and unique, and is waited out like any other; the old leader's
//! renewals meet 404 or a conflict and end its term, which ran out anyway
//! a duration after its last renewal, before the deletion.
//!
//! A leader, for its part, treats any state it did not write as the end of
//! its term: a Lease gone or held by another identity.
//!
//! One state a replica can trust without waiting: the very version its own
//! last write produced (this process wrote it, the identity is unique per
//! process, and nobody wrote since — any later write changes the version).
//! Its own term has ended (it does not lead), so taking that version over
//! by CAS at once overlaps no term: a standby racing for the same version
//! loses the CAS, or wins it and this replica's loses. Without this, a lone
//! operator whose renewals failed through an API-server outage would sit
//! out a whole extra duration after the server came back.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use kube::ResourceExt;
use tokio::time::Instant;

/// One version of the Lease and when this replica first saw it.
#[derive(Clone, Debug, PartialEq)]
pub struct Seen {
    pub version: String,
    pub since: Instant,
}

/// What to do with the Lease as read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// No Lease: create it vacated (no holder, no term).
    Create,
    /// We lead and it is ours: renew it.
    Renew,
    /// Unchanged for a full duration: take it over.
    TakeOver,
    /// Not ours to take yet: look again later.
    Wait,
    /// We led, and the Lease is gone or names someone else: the term ends.
    Deposed,
}

/// Pure: the step for `lease` as read at `now` by replica `me`, which leads
/// or not, with its own lease `duration`, given the state it saw before and
/// the version its own last successful write produced (`wrote`). Returns
/// the observation to keep (none while leading).
pub fn step(
    lease: Option<&Lease>,
    me: &str,
    leading: bool,
    prev: Option<&Seen>,
    wrote: Option<&str>,
    now: Instant,
    duration: Duration,
) -> (Step, Option<Seen>) {
    if leading {
        let ours = lease.is_some_and(|l| holder(l) == me);
        return (if ours { Step::Renew } else { Step::Deposed }, None);
    }
    // Not leading: a vacated Lease, one naming this very replica (which
    // does not lead: someone wrote that by hand, or a renewal of a term
    // already given up landed late), one with a short duration — all are
    // the same to a standby: a version that must stay unchanged for a full
    // duration of its own.
    let Some(lease) = lease else {
        return (Step::Create, None);
    };
    let version = lease.resource_version().unwrap_or_default();
    if wrote == Some(version.as_str()) && holder(lease) == me {
        // Exactly what this process wrote last, untouched since.
        return (Step::TakeOver, None);
    }
    let seen = match prev {
        Some(p) if p.version == version => p.clone(),
        _ => Seen {
            version,
            since: now,
        },
    };
    if now.saturating_duration_since(seen.since) < duration {
        (Step::Wait, Some(seen))
    } else {
        (Step::TakeOver, Some(seen))
    }
}

fn holder(lease: &Lease) -> &str {
    lease
        .spec
        .as_ref()
        .and_then(|s| s.holder_identity.as_deref())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::coordination::v1::LeaseSpec;

    fn lease(holder: Option<&str>, rv: &str, secs: i32) -> Lease {
        let mut l = Lease::default();
        l.metadata.resource_version = Some(rv.into());
        l.spec = Some(LeaseSpec {
            holder_identity: holder.map(Into::into),
            lease_duration_seconds: Some(secs),
            ..Default::default()
        });
        l
    }

    const D: Duration = Duration::from_secs(15);

    /// Runs a standby over `reads` (what it read, at which second) and
    /// returns the step of each.
    fn standby(reads: &[(Option<&Lease>, u64)]) -> Vec<Step> {
        let t0 = Instant::now();
        let mut seen = None;
        reads
            .iter()
            .map(|(l, at)| {
                let (s, next) = step(
                    *l,
                    "me",
                    false,
                    seen.as_ref(),
                    None,
                    t0 + Duration::from_secs(*at),
                    D,
                );
                seen = next;
                s
            })
            .collect()
    }

    #[test]
    fn a_leader_renews_only_its_own_lease() {
        let t0 = Instant::now();
        let mine = lease(Some("me"), "1", 15);
        let theirs = lease(Some("other"), "2", 15);
        let vacated = lease(None, "3", 1);
        for (l, want) in [
            (Some(&mine), Step::Renew),
            (Some(&theirs), Step::Deposed),
            (Some(&vacated), Step::Deposed),
            // Deleted under it: its term cannot be renewed, and a standby
            // may create it a duration later; it stops now.
            (None, Step::Deposed),
        ] {
            assert_eq!(
                step(l, "me", true, None, None, t0, D),
                (want, None),
                "{l:?}"
            );
        }
    }

    /// A replica whose term ended (renewals failed through an outage)
    /// finds the Lease exactly as its own last write left it: taken back at
    /// once. The same identity in a version it did not write (a hand edit,
    /// or a write of ours whose answer was lost) is waited out.
    #[test]
    fn the_version_our_own_last_write_produced_is_taken_back_at_once() {
        let t0 = Instant::now();
        let ours = lease(Some("me"), "7", 15);
        assert_eq!(
            step(Some(&ours), "me", false, None, Some("7"), t0, D),
            (Step::TakeOver, None)
        );
        let edited = lease(Some("me"), "8", 15);
        assert_eq!(
            step(Some(&edited), "me", false, None, Some("7"), t0, D).0,
            Step::Wait
        );
        // Our version, but someone else's name in it cannot happen; a
        // vacated one (a hand edit keeps no version) is waited out too.
        let vacated = lease(None, "7", 15);
        assert_eq!(
            step(Some(&vacated), "me", false, None, Some("7"), t0, D).0,
            Step::Wait
        );
    }

    #[test]
    fn a_standby_waits_a_full_duration_of_unchanged_state_whatever_the_lease_says() {
        use Step::{Create, TakeOver, Wait};
        let theirs = lease(Some("other"), "3", 15);
        let renewed = lease(Some("other"), "4", 15);
        // Held by another replica: unchanged for 15 s, then taken over.
        assert_eq!(
            standby(&[(Some(&theirs), 0), (Some(&theirs), 14), (Some(&theirs), 15)]),
            [Wait, Wait, TakeOver]
        );
        // A renewal (new version) restarts the wait.
        assert_eq!(
            standby(&[
                (Some(&theirs), 0),
                (Some(&renewed), 14),
                (Some(&renewed), 28)
            ]),
            [Wait, Wait, Wait]
        );
        // Deleted (by `kubectl delete leases --all`): created again at
        // once, vacated; the created version is then waited out.
        let created = lease(None, "5", 15);
        assert_eq!(
            standby(&[
                (Some(&theirs), 0),
                (None, 1),
                (Some(&created), 2),
                (Some(&created), 16),
                (Some(&created), 17),
            ]),
            [Wait, Create, Wait, Wait, TakeOver]
        );
        // Absence is never waited out: it has no version (a Lease created
        // and deleted between two looks would look like one absence).
        assert_eq!(standby(&[(None, 0), (None, 100)]), [Create, Create]);
        // Hand edits: holder cleared, holder set to this very replica, the
        // duration shrunk to 1 s — each waits the replica's own 15 s.
        for edited in [
            lease(None, "5", 15),
            lease(Some(""), "5", 15),
            lease(Some("me"), "5", 15),
            lease(Some("other"), "5", 1),
        ] {
            assert_eq!(
                standby(&[(Some(&edited), 0), (Some(&edited), 14), (Some(&edited), 15)]),
                [Wait, Wait, TakeOver],
                "{edited:?}"
            );
        }
    }
}
