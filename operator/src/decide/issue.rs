//! Issuing a lease: the task's resource locks first (if it needs or
//! respects any), then token + 1 and the lease offered under it.

use std::collections::BTreeMap;

use batchlease_api::{BatchTaskStatus, TaskMode, TaskPhase, names};
use kube::ResourceExt;

use super::rules::give_back_locks;
use super::types::{Decision, Input, IssueCause, QueueGate};
use crate::lease_build::offered_lease;
use crate::locks::{self, Step};
use crate::status::{self, set_condition};

/// Acquires the task's locks (if it needs any) for the next token, then
/// issues it. `fair`: queue behind older waiting tasks (not when a lost
/// lease is replaced: the task holds its locks already).
pub(super) fn with_locks(
    input: &Input<'_>,
    status: BatchTaskStatus,
    cause: IssueCause,
    fair: bool,
) -> Decision {
    if input.queue != QueueGate::Open {
        // A task the queue holds back holds no locks: it would keep the
        // users of its resources in other queues waiting for nothing. Not
        // so a task whose lease went missing (`fair` false): the locks are
        // its lost attempt's, whose holder may still run.
        if fair && let Some(d) = give_back_locks(input) {
            return d;
        }
        return Decision::HeldBack(input.queue);
    }
    let task = input.task;
    let needed = locks::needed(task);
    if needed.is_empty() {
        let respected = locks::respected(task);
        if respected.is_empty() {
            return issue(input, status, cause, BTreeMap::new());
        }
        let Some(slots) = &input.locks else {
            return Decision::FetchLocks(respected);
        };
        return match locks::held_by_other(slots) {
            Some((resource, holder)) => Decision::LockBlocked {
                give_back: Vec::new(),
                resource,
                holder,
            },
            None => issue(input, status, cause, BTreeMap::new()),
        };
    }
    let Some(slots) = &input.locks else {
        return Decision::FetchLocks(needed);
    };
    let want = status.fencing_token + 1;
    match locks::acquire(task, want, slots, input.wall, fair) {
        Step::Take(lease) => Decision::TakeLock(lease),
        Step::Blocked {
            give_back,
            resource,
            holder,
        } => Decision::LockBlocked {
            give_back,
            resource,
            holder,
        },
        Step::Held(tokens) => issue(input, status, cause, tokens),
    }
}

/// Token + 1, `Ready`, and the lease to offer under it, carrying the
/// fencing tokens of the resource locks taken for it.
fn issue(
    input: &Input<'_>,
    mut status: BatchTaskStatus,
    cause: IssueCause,
    resource_tokens: BTreeMap<String, i64>,
) -> Decision {
    let task = input.task;
    let token = status.fencing_token + 1;
    status.fencing_token = token;
    status.phase = Some(TaskPhase::Ready);
    status.current_lease = Some(names::lease_name(&task.name_any(), token));
    // The lease's own TTL, on record with its token: should the lease go
    // missing, its holder is timed by it, whatever the spec says by then.
    status.current_lease_duration_seconds = Some(task.spec.lease_duration_seconds);
    status.holder = None;
    status.current_renewal = None;
    status.next_attempt_after = None;
    status.observed_generation = task.metadata.generation;
    if status.effective_mode.is_none() {
        status.effective_mode = Some(TaskMode::Exclusive);
    }
    set_condition(
        &mut status,
        task,
        input.wall,
        status::leased(
            true,
            "Offered",
            &format!("lease with fencing token {token} offered"),
        ),
    );
    let mut lease = offered_lease(task, token);
    lease.spec.resource_tokens = resource_tokens;
    if !input.per_worker_offers {
        // Claimed and renewed per lease, as an older operator's offer.
        lease.spec.renewal = None;
    }
    Decision::Issue {
        status: Box::new(status),
        lease: Box::new(lease),
        cause,
    }
}
