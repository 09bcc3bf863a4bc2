//! Housekeeping around the decision: a finished task deleted after its
//! TTL, stray live leases ended, old final leases pruned.

use std::sync::Arc;
use std::time::Duration;

use batchlease_api::{BatchTask, BatchTaskStatus, LeasePhase, TaskLease, check_current};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::ResourceExt;

use super::types::{Decision, ExpiryReason, KEEP_LEASES, TTL_RECHECK};

/// A finished task: kept, or deleted once `ttlSecondsAfterFinished` has
/// passed since `status.completionTime` — unless an unfinished task still
/// needs it: a dependent (it would wait for a dependency gone missing) or
/// a child it spawned (garbage collection would delete it too). A task
/// finished by an operator that did not record that time counts from its
/// conditions' latest transition, else from its creation.
pub(super) fn finished(
    task: &BatchTask,
    current: &BatchTaskStatus,
    wall: Timestamp,
    needed_by: Option<&str>,
) -> Decision {
    let Some(ttl) = task.spec.ttl_seconds_after_finished else {
        return Decision::Wait(None);
    };
    let done = current
        .completion_time
        .as_ref()
        .map(|t| t.0)
        .or_else(|| {
            current
                .conditions
                .iter()
                .map(|c| c.last_transition_time.0)
                .max()
        })
        .or_else(|| task.metadata.creation_timestamp.as_ref().map(|t| t.0))
        .unwrap_or(wall);
    let left = SignedDuration::from_secs(ttl.max(0)) - wall.duration_since(done);
    if left.is_positive() {
        // Whole seconds up: a deletion must not come early.
        let secs = u64::try_from(left.as_secs()).unwrap_or(0) + u64::from(left.subsec_nanos() > 0);
        return Decision::Wait(Some(Duration::from_secs(secs)));
    }
    if needed_by.is_some() {
        return Decision::Wait(Some(TTL_RECHECK));
    }
    match task.metadata.uid.clone() {
        Some(uid) => Decision::DeleteTask {
            uid,
            resource_version: task.metadata.resource_version.clone(),
        },
        None => Decision::Wait(None),
    }
}

/// A live (Offered or Held) lease controlled by the task, of an *older*
/// token than the task's, that is not its current lease: end it, so its
/// holder (if any) stops at its next renewal. A lease of a newer token means
/// the task cache lags the lease cache: never touch it.
pub(super) fn stray(task: &BatchTask, leases: &[Arc<TaskLease>]) -> Option<Decision> {
    let uid = task.metadata.uid.as_deref()?;
    let token = task.status.as_ref().map_or(0, |s| s.fencing_token);
    let l = leases.iter().find(|l| {
        if l.spec.fencing_token >= token {
            return false;
        }
        let live = matches!(
            l.status.as_ref().and_then(|s| s.phase),
            Some(LeasePhase::Offered | LeasePhase::Held) | None
        );
        let ours = l
            .owner_references()
            .iter()
            .any(|o| o.uid == uid && o.controller == Some(true));
        live && ours && check_current(task, l).is_err()
    })?;
    let mut ended = (**l).clone();
    let st = ended.status.get_or_insert_with(Default::default);
    st.phase = Some(LeasePhase::Expired);
    st.reason = Some(ExpiryReason::NotCurrentLease.as_str().into());
    st.message = Some("not the task's current lease".into());
    Some(Decision::Expire {
        lease: Box::new(ended),
        reason: ExpiryReason::NotCurrentLease,
    })
}

/// Final leases other than the current one, beyond the newest
/// [`KEEP_LEASES`], oldest first.
pub(super) fn prunable(
    leases: &[Arc<TaskLease>],
    current: Option<&str>,
) -> Vec<(String, Option<String>)> {
    let mut done: Vec<&Arc<TaskLease>> = leases
        .iter()
        .filter(|l| Some(l.name_any().as_str()) != current)
        .filter(|l| {
            l.status
                .as_ref()
                .and_then(|s| s.phase)
                .is_some_and(LeasePhase::is_terminal)
        })
        .collect();
    if done.len() <= KEEP_LEASES {
        return Vec::new();
    }
    done.sort_by_key(|l| l.spec.fencing_token);
    let excess = done.len() - KEEP_LEASES;
    done.into_iter()
        .take(excess)
        .map(|l| (l.name_any(), l.resource_version()))
        .collect()
}
