//! Waiting for a condition with a deadline instead of sleeping.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

/// How long after a check the next one starts; only bounds how quickly a
/// met condition is noticed.
const POLL: Duration = Duration::from_millis(100);

/// Polls `check` until it yields `Some`, or fails after `timeout` with
/// `what`, the last error and the output of `diagnose`. The poll interval
/// only bounds how quickly a met condition is noticed; correctness rests on
/// the deadline.
///
/// The deadline bounds each check too: a check still running when it
/// passes is cancelled (dropped) and reported as the last error. Otherwise
/// one check that never returns (a request to a server that went silent,
/// which is what some tests arrange) would make the wait unbounded, and the
/// test would hang without ever printing why.
pub async fn wait_for<T, F, Fut>(
    what: &str,
    timeout: Duration,
    diagnose: impl FnOnce() -> String,
    mut check: F,
) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<Option<T>>>,
{
    let deadline = Instant::now() + timeout;
    let mut last_err: Option<anyhow::Error> = None;
    loop {
        // `timeout_at` polls the check before looking at the clock, so a
        // check that is ready at once still counts when no time is left.
        match tokio::time::timeout_at(deadline, check()).await {
            Ok(Ok(Some(v))) => return Ok(v),
            Ok(Ok(None)) => {}
            Ok(Err(e)) => last_err = Some(e),
            Err(_) => {
                // Keep what the check before said: a server that answered
                // with errors and then went silent shows both.
                let before = last_err
                    .take()
                    .map(|e| format!("; the check before failed: {e:#}"))
                    .unwrap_or_default();
                last_err = Some(anyhow::anyhow!(
                    "a check was still running at the deadline (cancelled){before}"
                ));
            }
        }
        let now = Instant::now();
        if now >= deadline {
            let err = last_err
                .map(|e| format!("\nlast error: {e:#}"))
                .unwrap_or_default();
            anyhow::bail!(
                "timed out after {timeout:?} waiting for {what}{err}\n{}",
                diagnose()
            );
        }
        tokio::time::sleep_until((now + POLL).min(deadline)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Longer than any wait in these tests takes when it works; only there
    /// so that a regression fails the test instead of hanging it.
    const GUARD: Duration = Duration::from_secs(30);

    /// The old `wait_for` awaited each check without a bound: this one
    /// never returned, and neither did the wait.
    #[tokio::test]
    async fn a_check_that_never_returns_fails_the_wait_at_the_deadline() {
        let timeout = Duration::from_millis(300);
        let started = Instant::now();
        let wait = wait_for(
            "a silent server",
            timeout,
            || "DIAGNOSTICS".to_owned(),
            std::future::pending::<anyhow::Result<Option<()>>>,
        );
        let err = tokio::time::timeout(GUARD, wait)
            .await
            .expect("wait_for returned")
            .unwrap_err();
        let msg = format!("{err:#}");
        assert!(started.elapsed() >= timeout, "gave up early: {msg}");
        assert!(msg.contains("waiting for a silent server"), "{msg}");
        assert!(msg.contains("still running at the deadline"), "{msg}");
        assert!(msg.contains("DIAGNOSTICS"), "{msg}");
    }

    #[tokio::test]
    async fn a_check_that_hangs_after_failing_reports_both() {
        let mut calls = 0;
        let wait = wait_for(
            "a server going silent",
            Duration::from_millis(300),
            || "DIAGNOSTICS".to_owned(),
            || {
                calls += 1;
                let first = calls == 1;
                async move {
                    if first {
                        anyhow::bail!("connection refused");
                    }
                    std::future::pending::<anyhow::Result<Option<()>>>().await
                }
            },
        );
        let err = tokio::time::timeout(GUARD, wait)
            .await
            .expect("wait_for returned")
            .unwrap_err();
        let msg = format!("{err:#}");
        assert!(msg.contains("still running at the deadline"), "{msg}");
        assert!(msg.contains("connection refused"), "{msg}");
        assert!(msg.contains("DIAGNOSTICS"), "{msg}");
    }

    #[tokio::test]
    async fn failing_checks_report_the_last_error_and_the_diagnostics() {
        let mut calls = 0;
        let wait = wait_for(
            "nothing",
            Duration::from_millis(300),
            || "DIAGNOSTICS".to_owned(),
            || {
                calls += 1;
                let n = calls;
                async move { Err::<Option<()>, _>(anyhow::anyhow!("failure {n}")) }
            },
        );
        let err = tokio::time::timeout(GUARD, wait)
            .await
            .expect("wait_for returned")
            .unwrap_err();
        let msg = format!("{err:#}");
        assert!(
            msg.contains(&format!("last error: failure {calls}")),
            "{msg}"
        );
        assert!(msg.contains("DIAGNOSTICS"), "{msg}");
    }

    #[tokio::test]
    async fn a_met_condition_returns_its_value() {
        let mut calls = 0;
        let v = wait_for(
            "the third check",
            GUARD,
            || panic!("no diagnostics on success"),
            || {
                calls += 1;
                let n = calls;
                async move { Ok((n == 3).then_some(n)) }
            },
        )
        .await
        .unwrap();
        assert_eq!(v, 3);
    }

    #[tokio::test]
    async fn a_ready_check_counts_with_no_time_left() {
        let v = wait_for("now", Duration::ZERO, String::new, || async { Ok(Some(7)) })
            .await
            .unwrap();
        assert_eq!(v, 7);
    }
}
