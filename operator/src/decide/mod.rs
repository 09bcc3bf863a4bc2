//! The operator's whole decision, as one pure function: given a task, its
//! leases, what was observed of the current lease and the time, what is the
//! next write? The reconciler reads, calls [`decide`], performs the one write
//! and lets the watch bring the next state (design §3).
//!
//! One write per pass keeps every step idempotent and crash-safe: whatever
//! the process dies between, the next pass sees the state the API server
//! holds and continues from there.
//!
//! Its shape (issue 27): [`decide`] here is a dispatcher over one file per
//! concern — `start` (first status, redrive), `pending`, `issue` (locks,
//! then the lease), `lost` (a missing current lease), `leased` (offer,
//! hold, expiry, settling), `cancel`, `housekeeping` (TTL, strays,
//! pruning). The concern files call each other never: a rule that ends in
//! another concern's case answers a `rules::Next` hand-off, which only
//! `follow` here takes to the file that owns it. What they share sits
//! below them: the types in `types.rs`, the shared rules in `rules.rs`,
//! and `settle.rs` (the status after an attempt ends).

pub mod types;

mod cancel;
mod housekeeping;
mod issue;
mod leased;
mod lost;
mod pending;
mod rules;
pub mod settle;
mod start;

use batchlease_api::{BatchTaskStatus, TaskPhase, check_current};

use crate::locks;
use rules::Next;

pub use rules::{LEASE_MISSING, OFFER_MISSING, TOKEN_RETIRED};
pub use types::{
    CREATE_SETTLE, Decision, ExpiryReason, Input, IssueCause, KEEP_LEASES, LOCK_RECHECK,
    LockRelease, Lookup, OfferView, QUEUE_RECHECK, QueueGate, ReleaseWhy, TTL_RECHECK, Transition,
};

/// The pure core of the operator.
pub fn decide(input: &Input<'_>) -> Decision {
    let task = input.task;
    if task.metadata.deletion_timestamp.is_some() {
        // Garbage collection removes the leases; a holder's next renewal
        // finds its lease gone and fires its kill switch.
        return Decision::Wait(None);
    }
    let Some(current) = task.status.as_ref().filter(|s| s.phase.is_some()) else {
        return first_status(input);
    };
    if task.spec.redrive > current.observed_redrive {
        return start::redrive(task, current, input.wall);
    }
    let phase = current.phase.unwrap_or(TaskPhase::Pending);
    // Only a lease that passes every check is the current one; a forged or
    // stale object of the same name is as good as no lease.
    let lease = input.leases.iter().find(|l| check_current(task, l).is_ok());

    let decision = match phase {
        TaskPhase::Pending => follow(input, current, phase, pending::pending(input, current)),
        TaskPhase::Ready | TaskPhase::Running => match (lease, input.lookup) {
            (Some(lease), _) => follow(
                input,
                current,
                phase,
                leased::leased(input, current, phase, lease),
            ),
            (None, Lookup::CacheOnly) => match &current.current_lease {
                Some(name) => Decision::LookUpLease(name.clone()),
                None => follow(input, current, phase, Next::Lost),
            },
            (None, Lookup::Creating) => Decision::Wait(Some(CREATE_SETTLE)),
            (None, Lookup::Absent) => {
                Decision::RetireToken(Box::new(lost::tombstone(task, current.fencing_token)))
            }
            (None, Lookup::Occupied) => follow(input, current, phase, Next::Lost),
        },
        TaskPhase::Succeeded
        | TaskPhase::DeadLettered
        | TaskPhase::Rejected
        | TaskPhase::Cancelled => {
            housekeeping::finished(task, current, input.wall, input.needed_by.as_deref())
        }
    };
    match decision {
        Decision::Wait(after) => {
            if let Some(stray) = housekeeping::stray(task, input.leases) {
                return stray;
            }
            match housekeeping::prunable(input.leases, current.current_lease.as_deref()) {
                victims if !victims.is_empty() => Decision::Prune {
                    victims,
                    then: after,
                },
                _ => Decision::Wait(after),
            }
        }
        Decision::HeldBack(gate) => {
            housekeeping::stray(task, input.leases).unwrap_or(Decision::HeldBack(gate))
        }
        // No live lease may outlast the task's end (cheap to check, and the
        // model's "no lease of a Cancelled task is live").
        Decision::WriteStatus {
            transition: Transition::Cancelled { .. },
            ..
        } if housekeeping::stray(task, input.leases).is_some() => {
            housekeeping::stray(task, input.leases).unwrap_or(Decision::Wait(None))
        }
        other => other,
    }
}

/// The first decision of a new task. Its first status used to be a write
/// of its own (`Pending`), then the issue another; a task that needs no
/// lock goes straight to what `Pending` would decide — the issue, or the
/// dependency condition, or the rejection — with the first status folded
/// into that one write. A task that needs (or respects) locks is written
/// `Pending` first: only a `Pending` task counts as a waiter, which is what
/// keeps younger tasks from overtaking it (see `locks::waiting`). A task
/// held back for workers' slots is not written at all until its issue:
/// the wait is to save its claim write, and a `Pending` write would spend
/// it again (a TaskQueue's pause, cap or rate may hold a task for long,
/// and writes it `Pending` as before). Not so a spawned child: its first
/// write is its admission, which its parent's end waits for
/// (`spawn_gate`).
fn first_status(input: &Input<'_>) -> Decision {
    let task = input.task;
    let init = start::initialize(task, input.wall);
    if !locks::needed(task).is_empty() || !locks::respected(task).is_empty() {
        return init;
    }
    let Decision::WriteStatus { status, .. } = &init else {
        return init;
    };
    match follow(
        input,
        status,
        TaskPhase::Pending,
        pending::pending(input, status),
    ) {
        d @ (Decision::Issue { .. } | Decision::WriteStatus { .. }) => d,
        d @ Decision::HeldBack(QueueGate::WorkerSlots)
            if crate::spawn_gate::parent_of(task).is_none() =>
        {
            d
        }
        _ => init,
    }
}

/// Follows a concern's hand-off to the concern that owns the case: the
/// one place where the decision functions reach each other. `current`
/// and `phase` are the task's as [`decide`] saw them (for a lost lease).
fn follow(input: &Input<'_>, current: &BatchTaskStatus, phase: TaskPhase, next: Next) -> Decision {
    match next {
        Next::Decided(d) => d,
        Next::Issue {
            status,
            cause,
            fair,
        } => issue::with_locks(input, *status, cause, fair),
        Next::CancelUnleased(status) => cancel::cancel_unleased(input, *status),
        Next::Lost => follow(
            input,
            current,
            phase,
            lost::replace_lost(input, current, phase),
        ),
    }
}

#[cfg(test)]
#[path = "fixture_tests.rs"]
mod tests;

#[cfg(test)]
mod lifecycle_tests;

#[cfg(test)]
mod settle_tests;

#[cfg(test)]
mod finished_tests;

#[cfg(test)]
mod graph_tests;

#[cfg(test)]
mod cancel_tests;

#[cfg(test)]
mod offer_tests;
