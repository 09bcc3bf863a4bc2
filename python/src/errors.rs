//! Errors between Rust and Python: the SDK's [`Error`] raised as the
//! package's exceptions, a handler's exception mapped to a [`TaskError`].

use batchlease_worker_sdk::{Error, TaskError};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Why `Worker.run` could not run or ended with an error.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("cannot start the worker's runtime: {0}")]
    Runtime(#[source] std::io::Error),
    #[error("no Kubernetes client configuration (KUBECONFIG or in-cluster): {0}")]
    KubeConfig(#[source] kube::config::InferConfigError),
    #[error("invalid database_url: {0}")]
    DatabaseUrl(String),
    #[error("{0}")]
    Sdk(#[from] Error),
}

/// The package's exception class for an SDK error: `Revoked`, `Fenced`,
/// `InvalidData`, `ConfigError`, else `BatchleaseError`.
fn class_of(e: &Error) -> &'static str {
    match e {
        Error::Revoked { .. } => "Revoked",
        Error::Fenced { .. } | Error::ResourceFenced { .. } => "Fenced",
        Error::InvalidJson { .. } | Error::TooLarge { .. } | Error::TooDeep { .. } => "InvalidData",
        Error::Config(_) => "ConfigError",
        _ => "BatchleaseError",
    }
}

/// An instance of `batchlease.<class>(message, kind=…, reason=…,
/// permanent=…)`, or a `RuntimeError` if the package cannot be imported.
fn raise(py: Python<'_>, class: &str, message: String, kind: &str, task: &TaskError) -> PyErr {
    let (reason, permanent) = match task {
        TaskError::Retryable { reason, .. } => (reason.as_str(), false),
        TaskError::Permanent { reason, .. } => (reason.as_str(), true),
        TaskError::Aborted { .. } => ("CompareAndSwapLost", false),
    };
    let built = (|| -> PyResult<PyErr> {
        let cls = py.import("batchlease")?.getattr(class)?;
        let kwargs = PyDict::new(py);
        kwargs.set_item("kind", kind)?;
        kwargs.set_item("reason", reason)?;
        kwargs.set_item("permanent", permanent)?;
        let value = cls.call((message.clone(),), Some(&kwargs))?;
        Ok(PyErr::from_value(value))
    })();
    built.unwrap_or_else(|_| PyRuntimeError::new_err(message))
}

/// The SDK's error as the package's exception; its `reason` and
/// `permanent` are what the SDK would report if the handler let it
/// propagate.
pub fn sdk_error(py: Python<'_>, e: Error) -> PyErr {
    let (class, kind, message) = (class_of(&e), e.kind(), e.to_string());
    let task = TaskError::from(e);
    raise(py, class, message, kind, &task)
}

/// `Worker.run`'s failure as the package's exception.
pub fn run_error(py: Python<'_>, e: &RunError) -> PyErr {
    let task = TaskError::retryable(e.to_string());
    match e {
        RunError::Sdk(sdk) => raise(py, class_of(sdk), e.to_string(), sdk.kind(), &task),
        RunError::DatabaseUrl(_) | RunError::KubeConfig(_) => {
            raise(py, "ConfigError", e.to_string(), "config", &task)
        }
        RunError::Runtime(_) => raise(py, "BatchleaseError", e.to_string(), "runtime", &task),
    }
}

/// How a handler's exception ends the attempt:
/// - `batchlease.RetryableError(reason, message)`: retryable, as given;
/// - `batchlease.PermanentError(reason, message)`: permanent, as given;
/// - an SDK error raised by the context (`batchlease.BatchleaseError`):
///   as the Rust SDK maps it (`reason`, `permanent` attributes);
/// - `asyncio.CancelledError` (the kill switch cancelled the handler):
///   retryable, reason `Cancelled`;
/// - anything else: retryable, reason = the exception's class name,
///   message = `str(exc)`.
pub fn task_error(py: Python<'_>, err: &PyErr) -> TaskError {
    let value = err.value(py);
    let attr = |name: &str| -> Option<String> {
        value
            .getattr(name)
            .ok()
            .and_then(|v| v.str().ok())
            .map(|s| s.to_string())
    };
    let is = |class: &str| -> bool {
        py.import("batchlease")
            .and_then(|m| m.getattr(class))
            .and_then(|c| value.is_instance(&c))
            .unwrap_or(false)
    };
    let message = attr("message").unwrap_or_else(|| {
        value
            .str()
            .map(|s| s.to_string())
            .unwrap_or_else(|_| "(unprintable exception)".into())
    });
    let reason = attr("reason").filter(|r| !r.is_empty());
    if is("PermanentError") {
        return TaskError::Permanent {
            reason: reason.unwrap_or_else(|| "PermanentFailure".into()),
            message,
        };
    }
    if is("RetryableError") {
        return TaskError::Retryable {
            reason: reason.unwrap_or_else(|| "HandlerFailed".into()),
            message,
        };
    }
    if is("BatchleaseError") {
        let permanent = value
            .getattr("permanent")
            .and_then(|p| p.is_truthy())
            .unwrap_or(false);
        let reason = reason.unwrap_or_else(|| "SdkError".into());
        return match permanent {
            true => TaskError::Permanent { reason, message },
            false => TaskError::Retryable { reason, message },
        };
    }
    let cancelled = py
        .import("asyncio")
        .and_then(|m| m.getattr("CancelledError"))
        .and_then(|c| value.is_instance(&c))
        .unwrap_or(false);
    if cancelled {
        return TaskError::Retryable {
            reason: "Cancelled".into(),
            message: "the handler was cancelled (kill switch or shutdown)".into(),
        };
    }
    let class = value
        .get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "HandlerFailed".into());
    TaskError::Retryable {
        reason: reason_of(&class),
        message,
    }
}

/// A CamelCase reason from a class name (`ValueError` stays; a name the
/// status would refuse becomes `HandlerFailed`).
fn reason_of(class: &str) -> String {
    let ok = !class.is_empty()
        && class.len() <= 128
        && class.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        && class
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic());
    match ok {
        true => class.to_owned(),
        false => "HandlerFailed".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::reason_of;

    #[test]
    fn reasons_are_class_names_the_status_accepts() {
        assert_eq!(reason_of("ValueError"), "ValueError");
        assert_eq!(reason_of("my_error"), "my_error");
        assert_eq!(reason_of("Ünïcode"), "HandlerFailed");
        assert_eq!(reason_of("_private"), "HandlerFailed");
        assert_eq!(reason_of(&"A".repeat(129)), "HandlerFailed");
    }
}
