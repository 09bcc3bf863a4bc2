//! `spec.cancel` of a task without a live lease (a cancelled task with
//! one first has it released: `rules::release`, from `leased.rs`).

use batchlease_api::BatchTaskStatus;

use super::rules::give_back_locks;
use super::settle;
use super::types::{Decision, Input};

/// Cancels a task without a live lease: it gives back the locks it may
/// hold (it will never run), then ends `Cancelled`.
pub(super) fn cancel_unleased(input: &Input<'_>, status: BatchTaskStatus) -> Decision {
    let task = input.task;
    if let Some(d) = give_back_locks(input) {
        return d;
    }
    let (status, transition) = settle::cancelled(task, &status, None, input.wall);
    Decision::WriteStatus {
        status: Box::new(status),
        transition,
    }
}
