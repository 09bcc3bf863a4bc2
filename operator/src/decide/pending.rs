//! A `Pending` task: cancelled, backing off, waiting for (or failed by)
//! its dependencies, rejected on a cycle — or due for its next lease,
//! which it hands to `issue.rs` through the dispatcher ([`Next::Issue`]).

use std::time::Duration;

use batchlease_api::keys::condition;
use batchlease_api::{BatchTaskStatus, TaskPhase};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::rules::{Next, give_back_locks, has_condition, lost_attempt_wait};
use super::types::{Decision, Input, IssueCause, Transition};
use crate::deps::Readiness;
use crate::status::{self, set_condition};

pub(super) fn pending(input: &Input<'_>, current: &BatchTaskStatus) -> Next {
    if input.task.spec.cancel {
        // A lost attempt of a cancelled task may still be running (see
        // `replace_lost`): the task ends when it cannot be any more.
        if let Some(wait) = lost_attempt_wait(input.task, current, input.wall) {
            return Decision::Wait(Some(wait)).into();
        }
        return Next::CancelUnleased(Box::new(current.clone()));
    }
    if let Some(after) = &current.next_attempt_after {
        let wait = after.0.duration_since(input.wall);
        if wait.is_positive() {
            return Decision::Wait(Some(
                Duration::try_from(wait).unwrap_or(Duration::from_secs(1)),
            ))
            .into();
        }
    }
    let task = input.task;
    let mut status = current.clone();
    match &input.deps {
        Readiness::Ready => {}
        Readiness::Cycle(cycle) => return reject(input, current, cycle).into(),
        not_ready => {
            // A task that may not run holds no locks (it would keep every
            // other user of its resources waiting for nothing).
            if let Some(d) = give_back_locks(input) {
                return d.into();
            }
            let failed = matches!(not_ready, Readiness::Failed { .. });
            let msg = not_ready.message();
            set_condition(
                &mut status,
                task,
                input.wall,
                status::waiting_for_dependencies(
                    !failed,
                    if failed {
                        "DependencyFailed"
                    } else {
                        "DependenciesNotSucceeded"
                    },
                    &msg,
                ),
            );
            if failed {
                set_condition(
                    &mut status,
                    task,
                    input.wall,
                    status::dependency_failed(true, "DependencyFailed", &msg),
                );
            } else if has_condition(&status, condition::DEPENDENCY_FAILED) {
                set_condition(
                    &mut status,
                    task,
                    input.wall,
                    status::dependency_failed(false, "DependencyRetrying", &msg),
                );
            }
            if status == *current {
                return Decision::Wait(None).into();
            }
            status.observed_generation = task.metadata.generation;
            return Decision::WriteStatus {
                status: Box::new(status),
                transition: if failed {
                    Transition::DependencyFailed
                } else {
                    Transition::WaitingForDependencies
                },
            }
            .into();
        }
    }
    let reassigned = current
        .history
        .last()
        .is_some_and(|h| h.outcome == "Expired");
    let cause = if reassigned {
        IssueCause::Reassigned
    } else {
        IssueCause::New
    };
    for (type_, reason) in [
        (condition::WAITING_FOR_DEPENDENCIES, "DependenciesSucceeded"),
        (condition::DEPENDENCY_FAILED, "DependenciesSucceeded"),
    ] {
        if has_condition(&status, type_) {
            set_condition(
                &mut status,
                task,
                input.wall,
                status::cond(type_, false, reason, "every dependency succeeded"),
            );
        }
    }
    Next::Issue {
        status: Box::new(status),
        cause,
        fair: true,
    }
}

/// The task is on a dependency cycle: it can never run.
fn reject(
    input: &Input<'_>,
    current: &BatchTaskStatus,
    cycle: &batchlease_api::graph::Cycle,
) -> Decision {
    let task = input.task;
    let mut status = current.clone();
    status.phase = Some(TaskPhase::Rejected);
    status.completion_time = Some(Time(input.wall));
    status.observed_generation = task.metadata.generation;
    let shown = crate::deps::describe(cycle, task.metadata.name.as_deref());
    let msg = format!("dependency cycle: {shown}");
    set_condition(
        &mut status,
        task,
        input.wall,
        status::cycle_detected(true, "CycleDetected", &msg),
    );
    if has_condition(&status, condition::WAITING_FOR_DEPENDENCIES) {
        set_condition(
            &mut status,
            task,
            input.wall,
            status::waiting_for_dependencies(false, "Rejected", &msg),
        );
    }
    Decision::WriteStatus {
        status: Box::new(status),
        transition: Transition::CycleDetected { cycle: shown },
    }
}
