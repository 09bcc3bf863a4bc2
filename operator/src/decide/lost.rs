//! A current lease that is gone: its token is retired (a tombstone under
//! its name), its possible attempt recorded `Lost`, and the next token is
//! issued — or, for a cancelled task, the end waits until the lost holder
//! has surely stopped.

use batchlease_api::{
    AttemptRecord, BatchTask, BatchTaskStatus, LeasePhase, Renewal, TaskLease, TaskLeaseStatus,
    TaskPhase,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::rules::{LEASE_MISSING, Next, OFFER_MISSING, TOKEN_RETIRED, lost_attempt_wait};
use super::types::{Decision, Input, IssueCause, Transition};
use crate::lease_build::offered_lease;
use crate::status::{self, set_condition};

/// The current lease is gone. Its token may have been claimed, so it is
/// retired: the next lease gets `token + 1`. An attempt that was running
/// (the status knew its holder) is recorded in the history; no retry is
/// spent, since the loss was not the worker's doing.
pub(super) fn replace_lost(input: &Input<'_>, current: &BatchTaskStatus, phase: TaskPhase) -> Next {
    let cancel = input.task.spec.cancel;
    let recorded = current
        .history
        .last()
        .is_some_and(|h| h.outcome == "Lost" && h.token == current.fencing_token);
    if cancel && recorded {
        // The loss is on record (below): end once its holder, if any, has
        // surely stopped.
        if let Some(wait) = lost_attempt_wait(input.task, current, input.wall) {
            return Decision::Wait(Some(wait)).into();
        }
        return Next::CancelUnleased(Box::new(current.clone()));
    }
    let mut status = current.clone();
    // A Ready task's lease may have been claimed too (the Running write
    // comes a moment after the claim): its loss is recorded as well.
    if matches!(phase, TaskPhase::Running | TaskPhase::Ready) {
        crate::status::push_history(
            &mut status,
            AttemptRecord {
                token: current.fencing_token,
                holder: current.holder.clone(),
                outcome: "Lost".into(),
                start: None,
                end: Some(Time(input.wall)),
                reason: Some(
                    if phase == TaskPhase::Running {
                        LEASE_MISSING
                    } else {
                        OFFER_MISSING
                    }
                    .into(),
                ),
                lease_duration_seconds: current.current_lease_duration_seconds,
                renewal: Some(lost_renewal(current)),
            },
        );
    }
    if cancel {
        // The lost lease may have been claimed, and its holder may run
        // until its kill switch: with no successor whose token would fence
        // it out of storage, the task must not end (nor give back its
        // locks) before then. The loss and when it was seen go on record,
        // so a restart keeps the wait; the phase stays (Ready/Running), so
        // the locks taken for this token still count as held; the token is
        // retired already (the current lease's name is occupied), so
        // nothing can be claimed meanwhile.
        status.observed_generation = input.task.metadata.generation;
        set_condition(
            &mut status,
            input.task,
            input.wall,
            status::leased(
                false,
                LEASE_MISSING,
                "the current lease is missing; the task ends Cancelled once its holder, if any, has stopped",
            ),
        );
        return Decision::WriteStatus {
            status: Box::new(status),
            transition: Transition::CancelAwaitsLostHolder,
        }
        .into();
    }
    Next::Issue {
        status: Box::new(status),
        cause: IssueCause::Replaced,
        fair: false,
    }
}

/// Pure: how the holder of the current attempt, whose lease is missing,
/// kept it alive: as recorded with its holder; recorded without one (an
/// older operator's status, an offer without `spec.renewal`): per lease;
/// no claim seen — one may have landed unseen and chosen to be renewed per
/// worker: the longer wait.
fn lost_renewal(current: &BatchTaskStatus) -> Renewal {
    match (&current.holder, current.current_renewal) {
        (_, Some(r)) => r,
        (Some(_), None) => Renewal::Lease,
        (None, None) => Renewal::Worker,
    }
}

/// The final lease that retires `token`'s name (see [`Decision::RetireToken`]).
pub(super) fn tombstone(task: &BatchTask, token: i64) -> TaskLease {
    let mut l = offered_lease(task, token);
    l.status = Some(TaskLeaseStatus {
        phase: Some(LeasePhase::Released),
        reason: Some(TOKEN_RETIRED.into()),
        message: Some("the lease of this token was missing; the token is retired".into()),
        ..Default::default()
    });
    l
}
