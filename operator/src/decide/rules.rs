//! The rules several concerns share — small pure helpers — and [`Next`],
//! the way a concern hands a case to another.
//!
//! The decision functions call each other in a loop (pending → issue,
//! leased → lost → issue, pending → cancel), so a plain split by concern
//! would tie the files into an import circle. Instead the concern files
//! never import each other: a rule that ends in another concern's case
//! answers a [`Next`] hand-off, and only the dispatcher in `decide/mod.rs`
//! follows it. This module is the leaf they all may use: it imports only
//! the types, never a concern file.

use std::time::Duration;

use batchlease_api::{BatchTask, BatchTaskStatus, LeasePhase, TaskLease};
use k8s_openapi::jiff::{SignedDuration, Timestamp};

use super::types::{Decision, Input, IssueCause, LockRelease, ReleaseWhy};
use crate::locks;

/// Where a concern's rule ends: the decision, or a case that another
/// concern takes over. Only the dispatcher ([`super::decide`]) follows a
/// hand-off, so the concern files need not know each other.
#[derive(Debug)]
pub(super) enum Next {
    /// The decision.
    Decided(Decision),
    /// Acquire the task's locks for the next token, then issue it under
    /// `cause` (`issue::with_locks`). `fair`: queue behind older waiting
    /// tasks (not when a lost lease is replaced: the task holds its locks
    /// already).
    Issue {
        status: Box<BatchTaskStatus>,
        cause: IssueCause,
        fair: bool,
    },
    /// The current lease is gone: retire its token and replace it
    /// (`lost::replace_lost`; it never hands off to itself).
    Lost,
    /// End the task, which has no live lease, from this status
    /// (`cancel::cancel_unleased`).
    CancelUnleased(Box<BatchTaskStatus>),
}

impl From<Decision> for Next {
    fn from(d: Decision) -> Self {
        Self::Decided(d)
    }
}

/// Reason of a `lost::tombstone`.
pub const TOKEN_RETIRED: &str = "TokenRetired";

/// Reason of the history record of an attempt whose lease went missing
/// while a holder was known (the task was Running).
pub const LEASE_MISSING: &str = "LeaseMissing";

/// Reason of the history record of a token whose lease went missing while
/// no holder had been seen (the task was Ready). Its lease may have been
/// claimed a moment before (the Running write follows the claim) and then
/// deleted — so the record stays, and a cancel still waits for the TTL —
/// or it may never have existed: an operator stopped between the status
/// write that reserved the token and the lease's create leaves exactly
/// this. Nothing left in the API server tells the two apart (a deleted
/// object leaves no trace), so the reason names what is known, not a loss
/// that may not have happened.
pub const OFFER_MISSING: &str = "OfferMissing";

pub(super) fn has_condition(status: &BatchTaskStatus, type_: &str) -> bool {
    status.conditions.iter().any(|c| c.type_ == type_)
}

/// How long until every attempt whose lease went missing (recorded `Lost`
/// in the history, with the time the loss was seen) has surely stopped:
/// its holder, if it had one, runs at most until its kill switch, within a
/// TTL of the loss — the TTL its lease was issued with, recorded in the
/// entry: `spec.leaseDurationSeconds` may have been edited since (an entry
/// of an earlier release, without one, falls back to the spec's) — plus a
/// refresh period for a holder that renewed per worker. `None`: nothing to
/// wait for.
///
/// A cancelled task must not end before then. Otherwise nothing fences
/// such a zombie out of storage: its successor — the attempt that would
/// register a higher token first — is the one the cancel withdrew.
pub(super) fn lost_attempt_wait(
    task: &BatchTask,
    current: &BatchTaskStatus,
    wall: Timestamp,
) -> Option<Duration> {
    current
        .history
        .iter()
        .filter(|h| h.outcome == "Lost")
        .filter_map(|h| {
            let secs = h
                .lease_duration_seconds
                .unwrap_or(task.spec.lease_duration_seconds);
            let ttl = Duration::from_secs(u64::try_from(secs.max(1)).unwrap_or(1));
            // Renewed per worker, its holder learns of the loss only at its
            // next refresh of the lease (design, "A deleted TaskLease").
            let refresh = if h.renewal == Some(batchlease_api::Renewal::Worker) {
                batchlease_api::worker_lease::refresh_period(ttl)
            } else {
                Duration::ZERO
            };
            let wait = i64::try_from((ttl + refresh).as_secs()).unwrap_or(i64::MAX / 2);
            Some((h.end.as_ref()?, SignedDuration::from_secs(wait + 1)))
        })
        .map(|(end, ttl)| end.0.checked_add(ttl).unwrap_or(end.0).duration_since(wall))
        .filter(|left| left.is_positive())
        .max()
        .map(|left| Duration::try_from(left).unwrap_or(Duration::from_secs(1)))
}

/// The step that gives back every lock the task holds, for a task that
/// will not run now (`NotRunnable`): read them first, then release what
/// is held. `None`: it holds none.
pub(super) fn give_back_locks(input: &Input<'_>) -> Option<Decision> {
    let needed = locks::needed(input.task);
    if needed.is_empty() {
        return None;
    }
    let Some(slots) = &input.locks else {
        return Some(Decision::FetchLocks(needed));
    };
    let held = locks::release_any(slots);
    (!held.is_empty()).then_some(Decision::ReleaseLocks {
        leases: held,
        why: LockRelease::NotRunnable,
    })
}

/// `lease` released for `why` (see [`Decision::Release`]).
pub(super) fn release(lease: &TaskLease, why: ReleaseWhy) -> Decision {
    let mut ended = lease.clone();
    let st = ended.status.get_or_insert_with(Default::default);
    st.phase = Some(LeasePhase::Released);
    st.reason = Some(why.as_str().into());
    st.message = Some(match why {
        ReleaseWhy::Cancelled => "the task was cancelled (spec.cancel)".into(),
        ReleaseWhy::QueuePaused => format!("queue {} is paused", lease.spec.queue),
    });
    Decision::Release {
        lease: Box::new(ended),
        why,
    }
}
