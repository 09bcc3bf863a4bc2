//! Settling an attempt whose lease ended (design §3 step 7): success, a
//! retry with backoff, an immediate retry, or the dead-letter queue.
//!
//! Shared by the concern files `leased.rs` (an ended attempt) and
//! `cancel.rs` (a cancel without a live lease) like `rules.rs`, and like
//! it below them: it imports only `types.rs`.

use batchlease_api::{
    AttemptRecord, BatchTask, BatchTaskStatus, Failure, LeaseOutcome, LeasePhase, TaskLease,
    TaskMode, TaskPhase,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::{SignedDuration, Timestamp};

use super::types::{ExpiryReason, Transition};
use crate::backoff::retry_delay;
use crate::status::{self, push_history, set_condition};
use batchlease_api::keys::{condition, release_reason};

/// Consecutive `Interrupted` attempts retried at once; from this many on,
/// each waits the task's backoff.
pub const INTERRUPTS_FREE: usize = 3;
/// The attempt that makes this many consecutive `Interrupted` outcomes
/// counts as a failure (and may dead-letter the task).
pub const INTERRUPTS_AS_FAILURE: usize = 6;

/// The status after the attempt of `lease` (final) ended.
pub fn settle(
    task: &BatchTask,
    current: &BatchTaskStatus,
    lease: &TaskLease,
    wall: Timestamp,
    jitter: f64,
) -> (BatchTaskStatus, Transition) {
    let lst = lease.status.clone().unwrap_or_default();
    let phase = lst.phase.unwrap_or(LeasePhase::Completed);
    let outcome = match phase {
        // Never taken by the worker it was bound to: no fault of the task.
        LeasePhase::Expired
            if lst.reason.as_deref() == Some(ExpiryReason::BoundNotTaken.as_str()) =>
        {
            Outcome::Interrupted
        }
        LeasePhase::Expired => Outcome::Expired,
        LeasePhase::Released => Outcome::Interrupted,
        _ => match lst.outcome {
            Some(LeaseOutcome::Succeeded) => Outcome::Succeeded,
            Some(LeaseOutcome::Interrupted) => Outcome::Interrupted,
            Some(LeaseOutcome::Aborted) => Outcome::Aborted,
            Some(LeaseOutcome::Failed) | None => Outcome::Failed {
                permanent: lst.permanent,
            },
        },
    };
    // An attempt that keeps ending Interrupted (a worker that cannot read
    // its task, a fleet restarting in a loop) must not spin for free.
    let streak = 1 + current
        .history
        .iter()
        .rev()
        .take_while(|h| h.outcome == Outcome::Interrupted.name())
        .count();
    // An expired attempt already waited a whole TTL without a renewal:
    // that wait is the backoff of a worker failure (a crash, a partition,
    // a stopped process), and adding the task's backoff on top only
    // delays failover. Two expiries in a row look like a task that takes
    // its workers down (an OOM kill, a poison input); from the second on,
    // each waits the task's backoff as a failure does.
    let repeated_expiry = current
        .history
        .last()
        .is_some_and(|h| h.outcome == Outcome::Expired.name());
    // An attempt expired by activeDeadlineSeconds was renewing: its worker
    // did not fail, the task ran too long; it waits the backoff as a
    // failure does.
    let deadline_expiry =
        lst.reason.as_deref() == Some(ExpiryReason::ActiveDeadlineExceeded.as_str());
    // A lost swap of an attempt that did not run speculatively (the
    // quarantine, which holds the task's locks and retries in place): the
    // keys are written by tasks that do not name these resources. Free
    // retries would let it spin for ever; it is a failure, and the retry
    // budget brings it to a human.
    let mode = current.effective_mode.unwrap_or(task.spec.mode);
    let exclusive_abort = outcome == Outcome::Aborted && mode != TaskMode::Speculative;
    let outcome = if exclusive_abort {
        Outcome::Failed { permanent: false }
    } else {
        outcome
    };
    let (outcome, lst) = if outcome == Outcome::Interrupted && streak >= INTERRUPTS_AS_FAILURE {
        let mut lst = lst;
        lst.reason = Some("InterruptedRepeatedly".into());
        lst.message = Some(format!(
            "{streak} attempts in a row ended Interrupted; counted as a failure"
        ));
        (Outcome::Failed { permanent: false }, lst)
    } else {
        (outcome, lst)
    };
    let mut status = current.clone();
    status.holder = None;
    status.current_renewal = None;
    status.observed_generation = task.metadata.generation;
    if lst.checkpoint.is_some() {
        status.checkpoint = lst.checkpoint.clone();
    }
    let default_reason = match outcome {
        Outcome::Expired => "LeaseExpired",
        Outcome::Failed { .. } => "HandlerFailed",
        Outcome::Aborted => "CompareAndSwapLost",
        Outcome::Interrupted => "WorkerDrained",
        Outcome::Succeeded => "Completed",
    };
    let reason = lst
        .reason
        .clone()
        .unwrap_or_else(|| default_reason.to_owned());
    let message = lst.message.clone().unwrap_or_default();
    push_history(
        &mut status,
        AttemptRecord {
            token: lease.spec.fencing_token,
            holder: lease.spec.holder_identity.clone(),
            outcome: outcome.name().into(),
            start: lease.metadata.creation_timestamp.clone(),
            end: Some(Time(wall)),
            reason: Some(reason.clone()),
            lease_duration_seconds: None,
            renewal: None,
        },
    );
    set_condition(
        &mut status,
        task,
        wall,
        status::leased(false, outcome.name(), "the attempt's lease ended"),
    );

    let transition = match outcome {
        Outcome::Succeeded => {
            status.phase = Some(TaskPhase::Succeeded);
            status.completion_time = Some(Time(wall));
            status.result = lst.result.clone();
            status.next_attempt_after = None;
            set_condition(
                &mut status,
                task,
                wall,
                status::succeeded(
                    true,
                    "Completed",
                    &format!("completed with fencing token {}", lease.spec.fencing_token),
                ),
            );
            Transition::Succeeded
        }
        Outcome::Interrupted => {
            status.phase = Some(TaskPhase::Pending);
            if streak >= INTERRUPTS_FREE {
                let n = u32::try_from(streak - INTERRUPTS_FREE).unwrap_or(0);
                let delay = retry_delay(&task.spec.backoff, n, jitter);
                status.next_attempt_after = Some(after(wall, delay));
                Transition::Interrupted {
                    delay_seconds: delay.as_secs_f64(),
                }
            } else {
                status.next_attempt_after = None;
                Transition::Interrupted { delay_seconds: 0.0 }
            }
        }
        Outcome::Aborted => {
            status.aborts += 1;
            let quarantined = status.aborts >= task.spec.max_speculative_aborts
                && status.effective_mode == Some(TaskMode::Speculative);
            if quarantined {
                status.effective_mode = Some(TaskMode::Exclusive);
            }
            let n = u32::try_from(status.aborts - 1).unwrap_or(0);
            status.phase = Some(TaskPhase::Pending);
            status.next_attempt_after =
                Some(after(wall, retry_delay(&task.spec.backoff, n, jitter)));
            Transition::Aborted { quarantined }
        }
        Outcome::Expired | Outcome::Failed { .. } => {
            let expired = outcome == Outcome::Expired;
            let permanent = matches!(outcome, Outcome::Failed { permanent: true });
            status.attempts += 1;
            if exclusive_abort {
                status.aborts += 1;
            }
            status.last_failure = Some(Failure {
                reason: reason.clone(),
                message,
                token: lease.spec.fencing_token,
                time: Time(wall),
            });
            let not_retried = !task.spec.retry_policy.retries(&reason);
            if permanent || not_retried || status.attempts > task.spec.max_retries {
                status.phase = Some(TaskPhase::DeadLettered);
                status.completion_time = Some(Time(wall));
                status.next_attempt_after = None;
                let why = if permanent {
                    format!("permanent failure: {reason}")
                } else if not_retried {
                    format!("{reason} is in spec.retryPolicy.nonRetryableReasons")
                } else {
                    format!("{} attempts failed, last: {reason}", status.attempts)
                };
                set_condition(
                    &mut status,
                    task,
                    wall,
                    status::dead_lettered(true, &reason, &why),
                );
                Transition::DeadLettered { reason, expired }
            } else {
                status.phase = Some(TaskPhase::Pending);
                let delay = if expired && !repeated_expiry && !deadline_expiry {
                    status.next_attempt_after = None;
                    std::time::Duration::ZERO
                } else {
                    let n = u32::try_from(status.attempts - 1).unwrap_or(0);
                    let delay = retry_delay(&task.spec.backoff, n, jitter);
                    status.next_attempt_after = Some(after(wall, delay));
                    delay
                };
                Transition::Retry {
                    reason,
                    expired,
                    delay_seconds: delay.as_secs_f64(),
                }
            }
        }
    };
    (status, transition)
}

/// The status of a task whose `spec.cancel` ended it: `lease`, if any, is
/// the attempt's final lease (released by the operator, expired, or
/// completed without success).
pub fn cancelled(
    task: &BatchTask,
    current: &BatchTaskStatus,
    lease: Option<&TaskLease>,
    wall: Timestamp,
) -> (BatchTaskStatus, Transition) {
    let mut status = current.clone();
    let holder = lease.and_then(|l| l.spec.holder_identity.clone());
    if let Some(l) = lease.filter(|l| l.spec.holder_identity.is_some()) {
        let lst = l.status.clone().unwrap_or_default();
        let outcome = match lst.phase {
            Some(LeasePhase::Expired) => "Expired",
            Some(LeasePhase::Completed) => match lst.outcome {
                Some(LeaseOutcome::Interrupted) => "Interrupted",
                Some(LeaseOutcome::Aborted) => "Aborted",
                _ => "Failed",
            },
            _ => "Cancelled",
        };
        if lst.checkpoint.is_some() {
            status.checkpoint = lst.checkpoint.clone();
        }
        push_history(
            &mut status,
            AttemptRecord {
                token: l.spec.fencing_token,
                holder: holder.clone(),
                outcome: outcome.into(),
                start: l.metadata.creation_timestamp.clone(),
                end: Some(Time(wall)),
                reason: Some(lst.reason.unwrap_or_else(|| "Cancelled".into())),
                lease_duration_seconds: None,
                renewal: None,
            },
        );
    }
    status.phase = Some(TaskPhase::Cancelled);
    status.completion_time = Some(Time(wall));
    status.holder = None;
    status.current_renewal = None;
    status.next_attempt_after = None;
    status.observed_generation = task.metadata.generation;
    let msg = match &holder {
        Some(h) => format!("spec.cancel was set; the attempt of {h} was stopped"),
        None => "spec.cancel was set".to_owned(),
    };
    set_condition(
        &mut status,
        task,
        wall,
        status::leased(false, "Cancelled", "the task was cancelled"),
    );
    set_condition(
        &mut status,
        task,
        wall,
        status::cond(condition::CANCELLED, true, "CancelRequested", &msg),
    );
    (status, Transition::Cancelled { holder })
}

/// The status of a task whose unclaimed offer was withdrawn because its
/// queue was paused: `Pending` again, no attempt counted, no backoff (the
/// issue waits for the queue anyway).
pub fn withdrawn(
    task: &BatchTask,
    current: &BatchTaskStatus,
    wall: Timestamp,
) -> (BatchTaskStatus, Transition) {
    let mut status = current.clone();
    status.phase = Some(TaskPhase::Pending);
    status.holder = None;
    status.current_renewal = None;
    status.next_attempt_after = None;
    status.observed_generation = task.metadata.generation;
    set_condition(
        &mut status,
        task,
        wall,
        status::leased(
            false,
            release_reason::QUEUE_PAUSED,
            &format!(
                "queue {} is paused: the offer was withdrawn",
                task.spec.queue
            ),
        ),
    );
    (status, Transition::Withdrawn)
}

/// `wall + delay`, rounded *up* to a whole second: `metav1.Time` is
/// serialized with one-second resolution, and a truncated deadline would
/// let the retry start before the backoff it announced.
fn after(wall: Timestamp, delay: std::time::Duration) -> Time {
    let delay = SignedDuration::try_from(delay).unwrap_or(SignedDuration::MAX);
    let at = wall.checked_add(delay).unwrap_or(wall);
    let whole = Timestamp::from_second(at.as_second()).unwrap_or(at);
    let up = if whole < at {
        whole
            .checked_add(SignedDuration::from_secs(1))
            .unwrap_or(at)
    } else {
        whole
    };
    Time(up)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Succeeded,
    Failed { permanent: bool },
    Expired,
    Aborted,
    Interrupted,
}

impl Outcome {
    fn name(self) -> &'static str {
        match self {
            Self::Succeeded => "Succeeded",
            Self::Failed { .. } => "Failed",
            Self::Expired => "Expired",
            Self::Aborted => "Aborted",
            Self::Interrupted => "Interrupted",
        }
    }
}
