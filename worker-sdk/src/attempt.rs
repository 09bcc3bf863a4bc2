//! One claimed attempt: run the handler while a heartbeat renews the lease,
//! drop the handler when the kill switch fires, then complete the lease —
//! only if the fence still allows it.

use std::future::Future;

use futures::FutureExt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use batchlease_api::{BatchTask, LeaseOutcome, TaskLease};
use kube::ResourceExt;
use kube::api::Api;
use tokio::time::{Instant, sleep_until, timeout};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::context::{Output, TaskContext};
use crate::error::TaskError;
use crate::fence::{Fence, KillReason};
use crate::lease_ops::{self, Completion, Renewal};
use crate::metrics::{OutcomeLabels, ReasonLabels, WorkerMetrics};

/// How an attempt ended, for the caller's bookkeeping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    Completed(LeaseOutcome),
    Killed(KillReason),
    /// The handler finished but the completion was refused.
    CompletionRejected,
}

pub(crate) struct Attempt {
    pub api: Api<TaskLease>,
    pub identity: String,
    pub lease: TaskLease,
    pub task: BatchTask,
    pub fence: Fence,
    pub metrics: WorkerMetrics,
    /// Fires when the worker drains and the grace period is over.
    pub interrupt: CancellationToken,
}

impl Attempt {
    pub async fn run<H, F>(self, handler: H) -> Ended
    where
        H: FnOnce(TaskContext) -> F,
        F: Future<Output = Result<Output, TaskError>>,
    {
        let lease_name = self.lease.name_any();
        let token = self.fence.token();
        let shared = Arc::new(Mutex::new(self.lease.clone()));
        let pending_checkpoint = Arc::new(Mutex::new(None));
        let ctx = TaskContext {
            task_name: self.task.name_any(),
            namespace: self.task.namespace().unwrap_or_default(),
            payload: self
                .task
                .spec
                .payload
                .clone()
                .unwrap_or(serde_json::Value::Null),
            attempt: self.task.status.as_ref().map_or(0, |s| s.attempts) + 1,
            previous_checkpoint: self.task.status.as_ref().and_then(|s| s.checkpoint.clone()),
            resource_tokens: self.lease.spec.resource_tokens.clone(),
            fence: self.fence.clone(),
            pending_checkpoint: pending_checkpoint.clone(),
        };
        let done = CancellationToken::new();
        // However this attempt ends — even dropped mid-way — the heartbeat
        // stops with it: a lease must never outlive its work.
        let _stop_heartbeat = done.clone().drop_guard();
        let heartbeat = tokio::spawn(heartbeat(
            self.api.clone(),
            self.identity.clone(),
            shared.clone(),
            pending_checkpoint.clone(),
            self.fence.clone(),
            self.metrics.clone(),
            done.clone(),
        ));
        info!(lease = %lease_name, token, "attempt started");
        // A panicking handler is a failed attempt, not a lease held forever.
        let work = std::panic::AssertUnwindSafe(handler(ctx)).catch_unwind();
        let result = tokio::select! {
            r = work => Some(r.unwrap_or_else(|_| {
                error!(lease = %lease_name, token, "handler panicked");
                Err(TaskError::retryable("the handler panicked").with_reason("HandlerPanicked"))
            })),
            _ = self.fence.killed().cancelled() => None,
            // Drained: the handler is dropped and the lease released as
            // Interrupted, so the task is offered again at once.
            _ = self.interrupt.cancelled() => Some(Err(interrupted())),
        };
        done.cancel();
        let _ = heartbeat.await;

        let Some(result) = result else {
            let reason = self
                .fence
                .kill_reason()
                .unwrap_or(KillReason::RenewalsFailed);
            warn!(lease = %lease_name, token, reason = reason.as_str(), "kill switch fired: handler dropped, nothing more is written");
            return Ended::Killed(reason);
        };
        // The last word: refuse to complete an attempt we can no longer prove is ours.
        if let Err(e) = self.fence.check() {
            let reason = self
                .fence
                .kill_reason()
                .unwrap_or(KillReason::RenewalsFailed);
            warn!(lease = %lease_name, token, error = %e, "not completing: attempt revoked");
            return Ended::Killed(reason);
        }
        let completion = completion_of(
            result,
            pending_checkpoint
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take(),
        );
        let ours = shared.lock().unwrap_or_else(|e| e.into_inner()).clone();
        match lease_ops::complete(&self.api, &ours, &self.identity, &completion).await {
            Ok(()) => {
                let outcome = completion.outcome;
                self.metrics
                    .completions
                    .get_or_create(&OutcomeLabels {
                        outcome: outcome_label(outcome),
                    })
                    .inc();
                info!(lease = %lease_name, token, outcome = outcome_label(outcome), "attempt completed");
                Ended::Completed(outcome)
            }
            Err(e) => {
                self.metrics.completion_rejected.inc();
                error!(lease = %lease_name, token, error = %e, kind = e.kind(), "completion rejected");
                Ended::CompletionRejected
            }
        }
    }
}

fn interrupted() -> TaskError {
    TaskError::Retryable {
        reason: INTERRUPTED.into(),
        message: "worker drained before the handler finished".into(),
    }
}

const INTERRUPTED: &str = "WorkerDrained";

fn completion_of(
    result: Result<Output, TaskError>,
    checkpoint: Option<serde_json::Value>,
) -> Completion {
    match result {
        Ok(out) => Completion {
            outcome: LeaseOutcome::Succeeded,
            reason: None,
            message: None,
            permanent: false,
            result: out.result,
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
        Err(TaskError::Retryable { reason, message }) => Completion {
            outcome: LeaseOutcome::Failed,
            reason: Some(reason),
            message: Some(message),
            permanent: false,
            result: None,
            checkpoint,
        },
        Err(TaskError::Permanent { reason, message }) => Completion {
            outcome: LeaseOutcome::Failed,
            reason: Some(reason),
            message: Some(message),
            permanent: true,
            result: None,
            checkpoint,
        },
    }
}

fn outcome_label(o: LeaseOutcome) -> &'static str {
    match o {
        LeaseOutcome::Succeeded => "succeeded",
        LeaseOutcome::Failed => "failed",
        LeaseOutcome::Aborted => "aborted",
        LeaseOutcome::Interrupted => "interrupted",
    }
}

/// Renews every TTL/3 (retrying a failed renewal quickly) until `done`, and
/// fires the kill switch when no renewal succeeded in time or the lease is
/// found lost.
async fn heartbeat(
    api: Api<TaskLease>,
    identity: String,
    lease: Arc<Mutex<TaskLease>>,
    checkpoint: Arc<Mutex<Option<serde_json::Value>>>,
    fence: Fence,
    metrics: WorkerMetrics,
    done: CancellationToken,
) {
    let every = fence.clock().renew_every();
    let retry = (every / 4).clamp(Duration::from_millis(100), Duration::from_secs(1));
    let mut next = Instant::now() + every;
    loop {
        let (kill_at, reason) = fence.clock().kill_at();
        tokio::select! {
            // Past the deadline, the kill switch wins over a late renewal.
            biased;
            _ = done.cancelled() => return,
            _ = sleep_until(kill_at) => {
                if fence.kill(reason) {
                    metrics.kill_switch.get_or_create(&ReasonLabels { reason: reason.as_str() }).inc();
                }
                return;
            }
            _ = sleep_until(next) => {}
        }
        let sent = Instant::now();
        let ours = lease.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let cp = checkpoint.lock().unwrap_or_else(|e| e.into_inner()).clone();
        // A renewal that cannot finish before the kill switch is useless:
        // bound it, so a black-holed connection cannot hold us.
        let budget = kill_at.saturating_duration_since(sent);
        match timeout(budget, lease_ops::renew(&api, &ours, &identity, cp)).await {
            Ok(Ok(Renewal::Renewed(stored))) => {
                fence.renewed(sent);
                metrics
                    .renewal_latency
                    .observe(sent.elapsed().as_secs_f64());
                *lease.lock().unwrap_or_else(|e| e.into_inner()) = *stored;
                next = sent + every;
                debug!(lease = %ours.name_any(), "renewed");
            }
            Ok(Ok(Renewal::Lost(why))) => {
                warn!(lease = %ours.name_any(), why, "renewal found the lease lost");
                if fence.kill(KillReason::LeaseLost) {
                    metrics
                        .kill_switch
                        .get_or_create(&ReasonLabels {
                            reason: KillReason::LeaseLost.as_str(),
                        })
                        .inc();
                }
                return;
            }
            Ok(Err(e)) => {
                warn!(lease = %ours.name_any(), error = %e, "renewal failed; retrying");
                next = Instant::now() + retry;
            }
            Err(_) => {
                warn!(lease = %ours.name_any(), "renewal timed out");
                next = Instant::now();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fence::KillClock;
    use batchlease_api::{BatchTaskSpec, TaskLeaseSpec};
    use std::sync::atomic::{AtomicBool, Ordering};

    struct DropFlag(Arc<AtomicBool>);
    impl Drop for DropFlag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    /// An API server nobody listens on: every renewal fails at once.
    fn unreachable_api() -> Api<TaskLease> {
        let config = kube::Config::new("http://127.0.0.1:1".parse().unwrap());
        Api::namespaced(kube::Client::try_from(config).unwrap(), "ns")
    }

    fn held_lease() -> TaskLease {
        let mut l = TaskLease::new("t-1", TaskLeaseSpec::offered("t", "u", "q", 1, 30));
        l.spec.holder_identity = Some("me".into());
        l
    }

    async fn run_until_killed(deadline: Option<Duration>) -> (Ended, Duration, bool, bool) {
        let start = Instant::now();
        let fence = Fence::new(1, KillClock::new(Duration::from_secs(30), start, deadline));
        let dropped = Arc::new(AtomicBool::new(false));
        let cancelled = Arc::new(AtomicBool::new(false));
        let attempt = Attempt {
            api: unreachable_api(),
            identity: "me".into(),
            lease: held_lease(),
            task: BatchTask::new("t", BatchTaskSpec::for_queue("q")),
            fence,
            metrics: WorkerMetrics::default(),
            interrupt: CancellationToken::new(),
        };
        let (d, c) = (dropped.clone(), cancelled.clone());
        let ended = attempt
            .run(move |ctx: TaskContext| async move {
                let _flag = DropFlag(d);
                let token = ctx.cancellation();
                tokio::spawn(async move {
                    token.cancelled().await;
                    c.store(true, Ordering::SeqCst);
                });
                std::future::pending::<Result<Output, TaskError>>().await
            })
            .await;
        tokio::task::yield_now().await;
        (
            ended,
            start.elapsed(),
            dropped.load(Ordering::SeqCst),
            cancelled.load(Ordering::SeqCst),
        )
    }

    #[tokio::test(start_paused = true)]
    async fn kill_switch_fires_at_two_thirds_of_the_ttl_when_renewals_fail() {
        let (ended, elapsed, dropped, cancelled) = run_until_killed(None).await;
        assert_eq!(ended, Ended::Killed(KillReason::RenewalsFailed));
        // 2/3 of 30 s, measured from the claim; never later.
        assert!(
            elapsed >= Duration::from_secs(20) && elapsed < Duration::from_millis(20_100),
            "{elapsed:?}"
        );
        assert!(dropped, "the handler's future was dropped");
        assert!(cancelled, "the cancellation token fired");
    }

    #[tokio::test(start_paused = true)]
    async fn a_dropped_attempt_stops_its_heartbeat() {
        let fence = Fence::new(
            1,
            KillClock::new(Duration::from_secs(30), Instant::now(), None),
        );
        let attempt = Attempt {
            api: unreachable_api(),
            identity: "me".into(),
            lease: held_lease(),
            task: BatchTask::new("t", BatchTaskSpec::for_queue("q")),
            fence: fence.clone(),
            metrics: WorkerMetrics::default(),
            interrupt: CancellationToken::new(),
        };
        let run =
            attempt.run(|_ctx: TaskContext| std::future::pending::<Result<Output, TaskError>>());
        // Drop the attempt mid-way (e.g. its task was aborted).
        assert!(
            tokio::time::timeout(Duration::from_secs(1), run)
                .await
                .is_err()
        );
        // The heartbeat saw `done` and ended: no kill switch ever fires for
        // an attempt nobody runs any more, and nothing keeps renewing.
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert_eq!(fence.kill_reason(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn active_deadline_kills_first_when_it_is_sooner() {
        let (ended, elapsed, dropped, _) = run_until_killed(Some(Duration::from_secs(7))).await;
        assert_eq!(ended, Ended::Killed(KillReason::DeadlineExceeded));
        assert!(
            elapsed >= Duration::from_secs(7) && elapsed < Duration::from_millis(7_100),
            "{elapsed:?}"
        );
        assert!(dropped);
    }
}
