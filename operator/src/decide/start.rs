//! A task's first status, and a redrive (`spec.redrive` raised): the
//! writes that (re)start a task's life before any lease.

use batchlease_api::keys::condition;
use batchlease_api::{BatchTask, BatchTaskStatus, TaskPhase};
use k8s_openapi::jiff::Timestamp;

use super::rules::has_condition;
use super::types::{Decision, Transition};
use crate::status::{self, set_condition};

pub(super) fn initialize(task: &BatchTask, wall: Timestamp) -> Decision {
    let mut status = status::first(task, TaskPhase::Pending);
    set_condition(
        &mut status,
        task,
        wall,
        status::leased(false, "NotIssued", "no lease issued yet"),
    );
    Decision::WriteStatus {
        status: Box::new(status),
        transition: Transition::Initialized,
    }
}

pub(super) fn redrive(task: &BatchTask, current: &BatchTaskStatus, wall: Timestamp) -> Decision {
    let mut status = current.clone();
    status.observed_redrive = task.spec.redrive;
    status.observed_generation = task.metadata.generation;
    if !matches!(
        current.phase,
        Some(TaskPhase::DeadLettered | TaskPhase::Rejected)
    ) {
        // Only a dead-lettered or rejected task is redriven (a rejected one
        // is checked again: its dependsOn may have been fixed); remember
        // the request as seen.
        return Decision::WriteStatus {
            status: Box::new(status),
            transition: Transition::RedriveIgnored,
        };
    }
    status.phase = Some(TaskPhase::Pending);
    status.completion_time = None;
    status.attempts = 0;
    status.aborts = 0;
    status.next_attempt_after = None;
    status.holder = None;
    status.current_renewal = None;
    status.effective_mode = Some(task.spec.mode);
    let (type_, was) = if current.phase == Some(TaskPhase::Rejected) {
        (
            condition::CYCLE_DETECTED,
            has_condition(current, condition::CYCLE_DETECTED),
        )
    } else {
        (condition::DEAD_LETTERED, true)
    };
    if was {
        set_condition(
            &mut status,
            task,
            wall,
            status::cond(type_, false, "Redriven", "spec.redrive was raised"),
        );
    }
    Decision::WriteStatus {
        status: Box::new(status),
        transition: Transition::Redriven,
    }
}
