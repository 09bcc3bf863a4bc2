//! How the child's end becomes the attempt's outcome: exit 0 succeeds, the
//! configured "retry" and "permanent" codes say what the command meant, any
//! other code is retryable (a crash is usually worth another try, and the
//! task's retry budget bounds it), and a death by signal is named.

use std::collections::BTreeSet;

use nix::sys::signal::Signal;

/// EX_TEMPFAIL (sysexits.h): "try again later".
pub const DEFAULT_RETRY_CODE: i32 = 75;
/// EX_DATAERR (sysexits.h): "the input data was incorrect" — a retry would
/// read the same payload.
pub const DEFAULT_PERMANENT_CODE: i32 = 65;

/// The reason a task shows when the worker drained; the SDK turns a
/// retryable failure with this reason into an `Interrupted` completion (the
/// lease is given back, no retry spent), as it does for its own drain.
pub const DRAINED_REASON: &str = "WorkerDrained";

/// How the child ended, as the OS reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChildEnd {
    Code(i32),
    Signal(i32),
}

impl ChildEnd {
    /// From the OS's status (a status with neither code nor signal cannot
    /// happen for a reaped child; it reads as signal 0).
    pub fn of(status: std::process::ExitStatus) -> Self {
        use std::os::unix::process::ExitStatusExt;
        match (status.code(), status.signal()) {
            (Some(c), _) => Self::Code(c),
            (None, Some(s)) => Self::Signal(s),
            (None, None) => Self::Signal(0),
        }
    }
}

/// Which exit codes mean what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExitPolicy {
    pub retry: BTreeSet<i32>,
    pub permanent: BTreeSet<i32>,
}

/// Codes in both lists: refused at start, an exit code must mean one thing.
pub fn overlapping(policy: &ExitPolicy) -> Vec<i32> {
    policy
        .retry
        .intersection(&policy.permanent)
        .copied()
        .collect()
}

/// What the attempt reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Exit 0: read the result file.
    Succeeded,
    Retryable {
        reason: &'static str,
        message: String,
    },
    Permanent {
        reason: &'static str,
        message: String,
    },
    /// The worker was draining and the child did not succeed: given back.
    Interrupted { message: String },
}

/// `SIGKILL`, `SIGTERM`…, or `signal N` for one nix does not know.
pub fn signal_name(sig: i32) -> String {
    match Signal::try_from(sig) {
        Ok(s) => s.as_str().to_owned(),
        Err(_) => format!("signal {sig}"),
    }
}

/// The verdict on `end`; `draining` when the runner had forwarded its own
/// SIGTERM to the child before it ended.
pub fn classify(end: ChildEnd, policy: &ExitPolicy, draining: bool) -> Verdict {
    let what = match end {
        ChildEnd::Code(0) => return Verdict::Succeeded,
        ChildEnd::Code(c) => format!("exited with code {c}"),
        ChildEnd::Signal(s) => format!("killed by {}", signal_name(s)),
    };
    if draining {
        return Verdict::Interrupted {
            message: format!("the worker drained (SIGTERM forwarded) and the command {what}"),
        };
    }
    match end {
        ChildEnd::Code(c) if policy.permanent.contains(&c) => Verdict::Permanent {
            reason: "PermanentExitCode",
            message: format!("the command {what} (a permanent-failure code)"),
        },
        ChildEnd::Code(c) if policy.retry.contains(&c) => Verdict::Retryable {
            reason: "RetryExitCode",
            message: format!("the command {what} (a retry code)"),
        },
        ChildEnd::Code(_) => Verdict::Retryable {
            reason: "ExitCode",
            message: format!("the command {what}"),
        },
        ChildEnd::Signal(_) => Verdict::Retryable {
            reason: "KilledBySignal",
            message: format!("the command was {what}"),
        },
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn policy() -> ExitPolicy {
        ExitPolicy {
            retry: [75, 111].into(),
            permanent: [65].into(),
        }
    }

    #[test]
    fn classify_table() {
        use ChildEnd::*;
        let cases: [(ChildEnd, bool, &str, &str); 9] = [
            (Code(0), false, "Succeeded", ""),
            (Code(0), true, "Succeeded", ""),
            (
                Code(75),
                false,
                "RetryExitCode",
                "exited with code 75 (a retry code)",
            ),
            (Code(111), false, "RetryExitCode", "exited with code 111"),
            (
                Code(65),
                false,
                "PermanentExitCode",
                "exited with code 65 (a permanent-failure code)",
            ),
            (Code(1), false, "ExitCode", "exited with code 1"),
            (Signal(9), false, "KilledBySignal", "killed by SIGKILL"),
            (Signal(11), false, "KilledBySignal", "killed by SIGSEGV"),
            (
                Code(65),
                true,
                "Interrupted",
                "drained (SIGTERM forwarded) and the command exited with code 65",
            ),
        ];
        for (end, draining, want_reason, want_msg) in cases {
            let v = classify(end, &policy(), draining);
            let (reason, msg) = match &v {
                Verdict::Succeeded => ("Succeeded", String::new()),
                Verdict::Retryable { reason, message } | Verdict::Permanent { reason, message } => {
                    (*reason, message.clone())
                }
                Verdict::Interrupted { message } => ("Interrupted", message.clone()),
            };
            assert_eq!(reason, want_reason, "{end:?} {draining}");
            assert!(msg.contains(want_msg), "{end:?}: {msg}");
        }
        assert!(matches!(
            classify(Code(65), &policy(), false),
            Verdict::Permanent { .. }
        ));
        assert!(matches!(
            classify(Signal(15), &policy(), true),
            Verdict::Interrupted { .. }
        ));
    }

    #[test]
    fn unknown_signals_are_numbered() {
        assert_eq!(signal_name(15), "SIGTERM");
        assert_eq!(signal_name(200), "signal 200");
    }

    #[test]
    fn child_end_of_real_statuses() {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            ChildEnd::of(std::process::ExitStatus::from_raw(75 << 8)),
            ChildEnd::Code(75)
        );
        assert_eq!(
            ChildEnd::of(std::process::ExitStatus::from_raw(9)),
            ChildEnd::Signal(9)
        );
    }

    #[test]
    fn overlapping_codes_are_found() {
        let mut p = policy();
        assert!(overlapping(&p).is_empty());
        p.permanent.insert(75);
        assert_eq!(overlapping(&p), vec![75]);
    }
}
