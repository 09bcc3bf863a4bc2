//! Waiting for a condition with a deadline instead of sleeping.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

/// Polls `check` until it yields `Some`, or fails after `timeout` with
/// `what` and the output of `diagnose`. The poll interval only bounds how
/// quickly a met condition is noticed; correctness rests on the deadline.
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
    let mut last_err = None;
    loop {
        match check().await {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last_err = Some(e),
        }
        if Instant::now() >= deadline {
            let err = last_err
                .map(|e| format!("\nlast error: {e:#}"))
                .unwrap_or_default();
            anyhow::bail!(
                "timed out after {timeout:?} waiting for {what}{err}\n{}",
                diagnose()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
