//! What an attempt's result becomes: the completion written to its lease
//! (outcome, reason, message, result), cut to what the CRD accepts.
//!
//! Pure functions of the handler's result, apart from the attempt's
//! running (`super`) and its heartbeat (`heartbeat`), which both send or
//! rewrite a completion.

use batchlease_api::{JsonObject, LeaseOutcome, MAX_MESSAGE_CHARS, MAX_REASON_CHARS};

use crate::context::Output;
use crate::error::{Error, TaskError};
use crate::fence::KillReason;
use crate::lease_ops::Completion;

pub(super) fn interrupted() -> TaskError {
    TaskError::Retryable {
        reason: INTERRUPTED.into(),
        message: "worker drained before the handler finished".into(),
    }
}

const INTERRUPTED: &str = "WorkerDrained";

/// The completion of an attempt whose registration failed: given back
/// (`Interrupted`, no retry spent) — the task is not at fault, this
/// worker's storage is, and another worker may well run it.
pub(super) fn registration_failed(e: &Error) -> TaskError {
    TaskError::Retryable {
        reason: REGISTRATION_FAILED.into(),
        message: format!(
            "the attempt's token could not be registered in storage before its handler ran: {e}"
        ),
    }
}

const REGISTRATION_FAILED: &str = "RegistrationFailed";

pub(super) fn completion_of(
    result: Result<Output, TaskError>,
    checkpoint: Option<JsonObject>,
) -> Completion {
    let failed = |reason: String, message: String, permanent: bool, checkpoint| Completion {
        outcome: LeaseOutcome::Failed,
        reason: Some(clip(reason, MAX_REASON_CHARS)),
        message: Some(clip(message, MAX_MESSAGE_CHARS)),
        permanent,
        result: None,
        checkpoint,
    };
    match result {
        Ok(Output {
            result: Some(Err(e)),
        }) => failed(e.reason.into(), e.message, true, checkpoint),
        Ok(out) => Completion {
            outcome: LeaseOutcome::Succeeded,
            reason: None,
            message: None,
            permanent: false,
            result: out.result.and_then(Result::ok),
            checkpoint,
        },
        Err(TaskError::Retryable { reason, message }) if reason == INTERRUPTED => Completion {
            outcome: LeaseOutcome::Interrupted,
            reason: Some(reason),
            message: Some(message),
            permanent: false,
            result: None,
            checkpoint,
        },
        Err(TaskError::Aborted { message }) => Completion {
            outcome: LeaseOutcome::Aborted,
            reason: Some(crate::speculate::ABORTED_REASON.into()),
            message: Some(clip(message, MAX_MESSAGE_CHARS)),
            permanent: false,
            result: None,
            checkpoint,
        },
        Err(TaskError::Retryable { reason, message }) => failed(reason, message, false, checkpoint),
        Err(TaskError::Permanent { reason, message }) => failed(reason, message, true, checkpoint),
    }
}

/// The lease completion a handler's result becomes.
pub(super) fn outcome_label(o: LeaseOutcome) -> &'static str {
    match o {
        LeaseOutcome::Succeeded => "succeeded",
        LeaseOutcome::Failed => "failed",
        LeaseOutcome::Aborted => "aborted",
        LeaseOutcome::Interrupted => "interrupted",
    }
}

#[cfg(test)]
pub(crate) fn completion_for_tests(result: Result<Output, TaskError>) -> Completion {
    completion_of(result, None)
}

/// `s` cut to at most `max` characters (the CRDs' `maxLength` counts
/// characters): an over-long message used to make the completion itself
/// fail with 422, losing the real error.
pub(super) fn clip(mut s: String, max: usize) -> String {
    if let Some((at, _)) = s.char_indices().nth(max) {
        s.truncate(at);
    }
    s
}

/// What replaces a completion the API server refused as invalid: the
/// attempt fails, retryably, with the server's own words.
pub(super) fn refused_completion(message: &str) -> Completion {
    Completion {
        outcome: LeaseOutcome::Failed,
        reason: Some(COMPLETION_REFUSED.into()),
        message: Some(clip(
            format!("the API server refused the completion: {message}"),
            MAX_MESSAGE_CHARS,
        )),
        permanent: false,
        result: None,
        checkpoint: None,
    }
}

pub(super) const COMPLETION_REFUSED: &str = "CompletionRefused";

/// What an attempt stopped by its kill switch for `reason` gives back: the
/// completion its heartbeat's last copy of the lease is written with (one
/// CAS, so only a lease still held by us and unwritten since takes it), or
/// `None` when there is nothing to give back. Exhaustive on purpose: every
/// new reason decides.
pub(super) fn given_back(reason: KillReason) -> Option<Completion> {
    let (outcome, reason, message) = match reason {
        // The lease is gone or not ours, or the operator released it: the
        // CAS could only fail.
        KillReason::LeaseLost | KillReason::Cancelled => return None,
        KillReason::WriteRefused => (
            LeaseOutcome::Failed,
            "LeaseWriteRefused",
            "the API server refused the attempt's renewal as invalid; see the worker's log",
        ),
        KillReason::DeadlineExceeded => (
            LeaseOutcome::Failed,
            "ActiveDeadlineExceeded",
            "the attempt ran past activeDeadlineSeconds",
        ),
        KillReason::RenewalsFailed => (
            LeaseOutcome::Interrupted,
            "KillSwitch",
            "the worker could not renew in time and stopped its work",
        ),
        // Renewed per worker and still Held by us: nothing else would ever
        // end it, as the operator credits every renewal of the worker's
        // next WorkerLease to every lease still Held by the worker.
        KillReason::WorkerLeaseLost => (
            LeaseOutcome::Interrupted,
            "WorkerLeaseLost",
            "the worker's WorkerLease, which kept the attempt alive, was deleted or replaced; the worker stopped its work",
        ),
        // The operator ends what it revoked; a give-back that lands first
        // (the lease still Held by us, unwritten since) only ends it
        // sooner, and otherwise fails.
        KillReason::Revoked => (
            LeaseOutcome::Interrupted,
            "Revoked",
            "the operator revoked the attempt on the worker's WorkerLease; the worker stopped its work",
        ),
    };
    Some(Completion {
        outcome,
        reason: Some(reason.into()),
        message: Some(message.into()),
        permanent: false,
        result: None,
        checkpoint: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only the SDK gives an attempt back for a failed registration: a
    /// handler returning the same reason has failed, and spends a retry.
    #[test]
    fn a_handler_cannot_pass_its_failure_off_as_a_give_back() {
        let c = completion_for_tests(Err(
            TaskError::retryable("no").with_reason(REGISTRATION_FAILED)
        ));
        assert_eq!(c.outcome, LeaseOutcome::Failed);
        let drained = completion_for_tests(Err(interrupted()));
        assert_eq!(drained.outcome, LeaseOutcome::Interrupted);
    }

    /// Every kill gives the lease back, but for one whose lease is known
    /// not to be ours: a WorkerLease lost or a revocation leaves the
    /// TaskLease Held by us, possibly for good.
    #[test]
    fn a_killed_attempt_gives_back_unless_the_lease_is_not_ours() {
        use LeaseOutcome::{Failed, Interrupted};
        // (reason, expected outcome and reason; None: nothing given back)
        let cases = [
            (KillReason::LeaseLost, None),
            (KillReason::Cancelled, None),
            (
                KillReason::RenewalsFailed,
                Some((Interrupted, "KillSwitch")),
            ),
            (
                KillReason::WorkerLeaseLost,
                Some((Interrupted, "WorkerLeaseLost")),
            ),
            (KillReason::Revoked, Some((Interrupted, "Revoked"))),
            (
                KillReason::WriteRefused,
                Some((Failed, "LeaseWriteRefused")),
            ),
            (
                KillReason::DeadlineExceeded,
                Some((Failed, "ActiveDeadlineExceeded")),
            ),
        ];
        for (reason, want) in cases {
            let c = given_back(reason);
            assert_eq!(
                c.as_ref()
                    .map(|c| (c.outcome, c.reason.as_deref().unwrap_or_default())),
                want,
                "{reason:?}"
            );
            if let Some(c) = c {
                assert!(!c.permanent, "{reason:?}: a give-back never ends the task");
                assert!(c.result.is_none() && c.checkpoint.is_none());
                assert!(c.reason.unwrap().chars().count() <= MAX_REASON_CHARS);
                assert!(c.message.unwrap().chars().count() <= MAX_MESSAGE_CHARS);
            }
        }
    }

    /// An oversized or non-object result, or an over-long message, used to
    /// make the completion fail with 422 and the attempt look expired.
    #[test]
    fn completions_fit_the_crd_or_say_why_not() {
        let big = serde_json::json!({"x": "y".repeat(batchlease_api::MAX_RESULT_BYTES)});
        let c = completion_of(Ok(Output::json(big)), None);
        assert_eq!(c.outcome, LeaseOutcome::Failed);
        assert!(c.permanent);
        assert_eq!(c.reason.as_deref(), Some("ResultTooLarge"));
        assert!(c.result.is_none());

        let c = completion_of(Ok(Output::json(vec![1, 2])), None);
        assert_eq!(c.reason.as_deref(), Some("InvalidResult"));
        assert!(c.permanent);

        let ok = completion_of(Ok(Output::json(serde_json::json!({"n": 1}))), None);
        assert_eq!(ok.outcome, LeaseOutcome::Succeeded);
        assert_eq!(ok.result.unwrap().as_str(), r#"{"n":1}"#);

        let long = "é".repeat(MAX_MESSAGE_CHARS + 10);
        let c = completion_of(
            Err(TaskError::retryable(long).with_reason("R".repeat(500))),
            None,
        );
        assert_eq!(c.message.unwrap().chars().count(), MAX_MESSAGE_CHARS);
        assert_eq!(c.reason.unwrap().chars().count(), MAX_REASON_CHARS);
        assert!(!c.permanent);

        // Counted as the API server stores it: `<` becomes `\u003c`.
        assert!(matches!(
            Output::try_json(serde_json::json!({"x": "<".repeat(30_000)})),
            Err(Error::TooLarge { bytes, .. }) if bytes > 180_000
        ));
        let e: TaskError = Output::try_json(serde_json::json!({"x": "y".repeat(200_000)}))
            .unwrap_err()
            .into();
        assert!(
            matches!(e, TaskError::Permanent { ref reason, .. } if reason == "ResultTooLarge"),
            "{e:?}"
        );
    }
}
