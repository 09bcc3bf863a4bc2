//! Small pure helpers for BatchTask status: conditions and history.

use batchlease_api::keys::condition;
use batchlease_api::{AttemptRecord, BatchTask, BatchTaskStatus, TaskPhase};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

/// Attempts kept in `status.history`.
pub const HISTORY_LEN: usize = 10;

/// A condition to set: (type, status, reason, message).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cond {
    pub(crate) type_: &'static str,
    pub(crate) status: bool,
    pub(crate) reason: String,
    pub(crate) message: String,
}

/// Any condition.
pub fn cond(type_: &'static str, status: bool, reason: &str, message: &str) -> Cond {
    Cond {
        type_,
        status,
        reason: reason.into(),
        message: message.into(),
    }
}

/// `Leased`: a lease is offered or held for the current attempt.
pub fn leased(status: bool, reason: &str, message: &str) -> Cond {
    cond(condition::LEASED, status, reason, message)
}
/// `Succeeded`.
pub fn succeeded(status: bool, reason: &str, message: &str) -> Cond {
    cond(condition::SUCCEEDED, status, reason, message)
}
/// `DeadLettered`.
pub fn dead_lettered(status: bool, reason: &str, message: &str) -> Cond {
    cond(condition::DEAD_LETTERED, status, reason, message)
}

/// `WaitingForDependencies`.
pub fn waiting_for_dependencies(status: bool, reason: &str, message: &str) -> Cond {
    cond(condition::WAITING_FOR_DEPENDENCIES, status, reason, message)
}
/// `DependencyFailed`.
pub fn dependency_failed(status: bool, reason: &str, message: &str) -> Cond {
    cond(condition::DEPENDENCY_FAILED, status, reason, message)
}
/// `CycleDetected`.
pub fn cycle_detected(status: bool, reason: &str, message: &str) -> Cond {
    cond(condition::CYCLE_DETECTED, status, reason, message)
}

/// The status of a task's first write, in `phase`: the mode it runs in
/// fixed (a later spec edit does not switch a running task), and the
/// redrive and generation it has seen, so only a later raise of
/// `spec.redrive` or a later spec edit counts as one.
pub fn first(task: &BatchTask, phase: TaskPhase) -> BatchTaskStatus {
    let mut st = task.status.clone().unwrap_or_default();
    st.phase = Some(phase);
    st.effective_mode = Some(st.effective_mode.unwrap_or(task.spec.mode));
    st.observed_redrive = task.spec.redrive;
    st.observed_generation = task.metadata.generation;
    st
}

/// Sets a condition; `lastTransitionTime` changes only when its status does
/// (the Kubernetes convention, so `kubectl wait` and humans see real flips).
pub fn set_condition(status: &mut BatchTaskStatus, task: &BatchTask, wall: Timestamp, c: Cond) {
    let value = if c.status { "True" } else { "False" };
    let generation = task.metadata.generation;
    match status.conditions.iter_mut().find(|x| x.type_ == c.type_) {
        Some(existing) => {
            if existing.status != value {
                existing.last_transition_time = Time(wall);
            }
            existing.status = value.into();
            existing.reason = c.reason;
            existing.message = c.message;
            existing.observed_generation = generation;
        }
        None => status.conditions.push(Condition {
            type_: c.type_.into(),
            status: value.into(),
            reason: c.reason,
            message: c.message,
            last_transition_time: Time(wall),
            observed_generation: generation,
        }),
    }
}

/// Appends an attempt to the history, keeping the last [`HISTORY_LEN`].
pub fn push_history(status: &mut BatchTaskStatus, record: AttemptRecord) {
    status.history.push(record);
    let excess = status.history.len().saturating_sub(HISTORY_LEN);
    status.history.drain(..excess);
}

#[cfg(test)]
mod tests {
    use super::*;
    use batchlease_api::BatchTaskSpec;

    #[test]
    fn transition_time_moves_only_on_flips() {
        let task = BatchTask::new("t", BatchTaskSpec::for_queue("q"));
        let mut st = BatchTaskStatus::default();
        let t0 = Timestamp::from_second(1_000).unwrap();
        let t1 = Timestamp::from_second(2_000).unwrap();
        let t2 = Timestamp::from_second(3_000).unwrap();
        set_condition(&mut st, &task, t0, leased(true, "Offered", "a"));
        set_condition(&mut st, &task, t1, leased(true, "Held", "b"));
        assert_eq!(st.conditions.len(), 1);
        assert_eq!(st.conditions[0].last_transition_time, Time(t0));
        assert_eq!(st.conditions[0].reason, "Held");
        set_condition(&mut st, &task, t2, leased(false, "Released", "c"));
        assert_eq!(st.conditions[0].last_transition_time, Time(t2));
        assert_eq!(st.conditions[0].status, "False");
    }

    #[test]
    fn history_keeps_the_last_ten() {
        let mut st = BatchTaskStatus::default();
        for token in 1..=13 {
            push_history(
                &mut st,
                AttemptRecord {
                    token,
                    holder: None,
                    outcome: "Failed".into(),
                    start: None,
                    end: None,
                    reason: None,
                    lease_duration_seconds: None,
                    renewal: None,
                },
            );
        }
        let tokens: Vec<i64> = st.history.iter().map(|h| h.token).collect();
        assert_eq!(tokens, (4..=13).collect::<Vec<_>>());
    }
}
