//! One claimed attempt: run the handler while a heartbeat renews the lease,
//! drop the handler when the kill switch fires, then complete the lease —
//! only if the fence still allows it.

use std::future::Future;

use futures::FutureExt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use batchlease_api::{BatchTask, LeaseOutcome, MAX_MESSAGE_CHARS, MAX_REASON_CHARS, TaskLease};
use kube::ResourceExt;
use kube::api::Api;
use tokio::sync::oneshot;
use tokio::time::{Instant, timeout};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::context::{Output, TaskContext};
use crate::error::{Error, TaskError};
use crate::fence::{Fence, KillReason};
use crate::heartbeat_runtime::HeartbeatRuntime;
use crate::lease_ops::Completion;
use crate::metrics::{OutcomeLabels, ReasonLabels, WorkerMetrics};
use crate::registry::Registry;
use crate::worker_lease::Membership;

mod completion;
mod give_back;
mod heartbeat;

#[cfg(test)]
pub(crate) use completion::completion_for_tests;
use completion::{
    clip, completion_of, given_back, interrupted, outcome_label, registration_failed,
};
use give_back::{give_back, give_back_at};
use heartbeat::{Heartbeat, Verdict};

/// How an attempt ended, for the caller's bookkeeping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    Completed(LeaseOutcome),
    /// The attempt ended before its handler ran: the storage refused (or
    /// could not take) the registration of its token. Given back as
    /// `Interrupted`, no retry spent; the worker counts these to stop
    /// claiming when it keeps happening (see `claim_brake`).
    NotStarted,
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
    /// Where the attempt registers its token before the handler runs.
    pub registry: Option<Arc<dyn Registry>>,
    /// Where the heartbeat runs, and its own API handle built there. A
    /// handler that blocks its thread (CPU-bound code that never awaits)
    /// must not starve the renewals and the kill timer: on the handler's
    /// runtime a freshly spawned heartbeat sits in that very thread's
    /// non-stealable LIFO slot. `None` (unit tests): the current runtime.
    pub heartbeat_on: Option<(Arc<HeartbeatRuntime>, Api<TaskLease>)>,
    /// Where work that must outlive a dropped handler runs (a speculative
    /// round's compensations).
    pub background: tokio_util::task::TaskTracker,
    /// Renewed per worker: its registration with the WorkerLease renewer
    /// (the fence's clock is then `KillClock::per_worker`).
    pub membership: Option<Membership>,
    /// How long the handler's work may outlive its dropped future
    /// (`WorkerBuilder::stop_budget`; see [`give_back_at`]).
    pub stop_budget: Duration,
}

impl Attempt {
    pub async fn run<H, F>(mut self, handler: H) -> Ended
    where
        H: FnOnce(TaskContext) -> F,
        F: Future<Output = Result<Output, TaskError>>,
    {
        let lease_name = self.lease.name_any();
        let token = self.fence.token();
        let pending_checkpoint = Arc::new(Mutex::new(None));
        let ctx = TaskContext {
            task_name: self.task.name_any(),
            namespace: self.task.namespace().unwrap_or_default(),
            task_uid: self.task.uid().unwrap_or_default(),
            queue: self.task.spec.queue.clone(),
            depends_on: self.task.spec.depends_on.clone(),
            client: self.api.clone().into_client(),
            payload: self.task.spec.payload.clone(),
            attempt: self.task.status.as_ref().map_or(0, |s| s.attempts) + 1,
            previous_checkpoint: self.task.status.as_ref().and_then(|s| s.checkpoint.clone()),
            resource_tokens: self.lease.spec.resource_tokens.clone(),
            fence: self.fence.clone(),
            pending_checkpoint: pending_checkpoint.clone(),
            earlier_commit: None,
            mode: self
                .task
                .status
                .as_ref()
                .and_then(|s| s.effective_mode)
                .unwrap_or(self.task.spec.mode),
            background: self.background.clone(),
            metrics: self.metrics.clone(),
            registered: false,
            speculation: Arc::default(),
        };
        let done = CancellationToken::new();
        // However this attempt ends — even dropped mid-way — the heartbeat
        // stops with it: a lease must never outlive its work.
        let _stop_heartbeat = done.clone().drop_guard();
        let (finish, finished) = oneshot::channel();
        // The heartbeat is the lease's only writer from here on: it renews
        // until the handler returns, then completes, retrying while the
        // fence holds — so a completion never conflicts with a renewal of
        // our own. (It does not renew meanwhile: a completion that cannot
        // be written before the kill instant ends in the kill switch.)
        let (runtime, heartbeat_api) = match &self.heartbeat_on {
            Some((rt, api)) => (
                rt.handle().unwrap_or_else(tokio::runtime::Handle::current),
                api.clone(),
            ),
            None => (tokio::runtime::Handle::current(), self.api.clone()),
        };
        let heartbeat = runtime.spawn(
            Heartbeat {
                api: heartbeat_api,
                identity: self.identity.clone(),
                lease: self.lease.clone(),
                checkpoint: pending_checkpoint.clone(),
                fence: self.fence.clone(),
                metrics: self.metrics.clone(),
                membership: self.membership.take(),
            }
            .run(done.clone(), finished),
        );
        // The last check before user code runs: a claim that took most of
        // the kill clock (a slow API server) must not start work it cannot
        // finish under the fence.
        let mut not_started = false;
        let result = if self.fence.check().is_err() {
            None
        } else {
            info!(lease = %lease_name, token, "attempt started");
            // A panicking handler is a failed attempt, not a lease held forever.
            let registry = self.registry.clone();
            let work = std::panic::AssertUnwindSafe(async move {
                let mut ctx = ctx;
                if let Some(registry) = registry {
                    // Design §4: the token goes into storage before any user
                    // code runs, so every write of an older attempt that
                    // lands later is refused, whatever its timing.
                    // Bounded: a storage that does not answer (a
                    // black-holed connection has no client-side timeout)
                    // must not keep the lease renewed with nothing running.
                    let budget = ctx.fence.ttl() / 3;
                    match timeout(budget, registry.register(&ctx.task_uid, &ctx.fence)).await {
                        Ok(Ok(earlier)) => ctx.earlier_commit = earlier,
                        Ok(Err(e)) => return Run::NotStarted(e),
                        Err(_) => {
                            return Run::NotStarted(Error::Timeout {
                                what: "registration",
                            });
                        }
                    }
                    ctx.registered = true;
                }
                Run::Handler(handler(ctx).await)
            })
            .catch_unwind();
            tokio::select! {
                r = work => Some(match r {
                    Ok(Run::Handler(result)) => result,
                    Ok(Run::NotStarted(e)) => {
                        warn!(lease = %lease_name, token, error = %e, kind = e.kind(), "the storage did not take the attempt's registration: handler not run, lease given back");
                        self.metrics
                            .not_started
                            .get_or_create(&ReasonLabels { reason: "registration" })
                            .inc();
                        not_started = true;
                        Err(registration_failed(&e))
                    }
                    Err(_) => {
                        error!(lease = %lease_name, token, "handler panicked");
                        Err(TaskError::retryable("the handler panicked").with_reason("HandlerPanicked"))
                    }
                }),
                _ = self.fence.killed().cancelled() => None,
                // Drained: the handler is dropped and the lease released as
                // Interrupted, so the task is offered again at once — once
                // what the handler started has surely stopped: the
                // operator re-issues the task and hands its locks on at
                // the give-back, and a runner child in its SIGTERM grace
                // may still write. The lease stays renewed meanwhile
                // (`give_back::drained_give_back_at`).
                _ = self.interrupt.cancelled() => {
                    // Work the handler spawned is told, and its writes refused.
                    self.fence.stop();
                    let at = give_back::drained_give_back_at(Instant::now(), self.fence.ttl(), self.stop_budget);
                    tokio::select! {
                        () = tokio::time::sleep_until(at) => Some(Err(interrupted())),
                        // Killed meanwhile: the kill's own rules apply.
                        _ = self.fence.killed().cancelled() => None,
                    }
                }
            }
        };
        if let Some(result) = result {
            let checkpoint = pending_checkpoint
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take();
            // If the heartbeat already ended (kill switch), the send fails
            // and its verdict below stands.
            let completion = match result {
                // Given back, not failed: a user's handler returning the
                // same reason is an ordinary failure (see `completion_of`).
                Err(TaskError::Retryable { reason, message }) if not_started => Completion {
                    outcome: LeaseOutcome::Interrupted,
                    reason: Some(clip(reason, MAX_REASON_CHARS)),
                    message: Some(clip(message, MAX_MESSAGE_CHARS)),
                    permanent: false,
                    result: None,
                    checkpoint: None,
                },
                result => completion_of(result, checkpoint),
            };
            let _ = finish.send(completion);
        } else {
            drop(finish);
        }
        let (verdict, last_copy) = heartbeat
            .await
            .unwrap_or_else(|_| (Verdict::Killed, self.lease.clone()));
        match verdict {
            Verdict::Completed(LeaseOutcome::Interrupted) if not_started => {
                info!(lease = %lease_name, token, "attempt given back before its handler ran");
                Ended::NotStarted
            }
            Verdict::Completed(outcome) => {
                self.metrics
                    .completions
                    .get_or_create(&OutcomeLabels {
                        outcome: outcome_label(outcome),
                    })
                    .inc();
                info!(lease = %lease_name, token, outcome = outcome_label(outcome), "attempt completed");
                Ended::Completed(outcome)
            }
            Verdict::Rejected => {
                self.metrics.completion_rejected.inc();
                Ended::CompletionRejected
            }
            Verdict::Killed => {
                let reason = self
                    .fence
                    .kill_reason()
                    .unwrap_or(KillReason::RenewalsFailed);
                count_kill(&self.metrics, reason);
                warn!(lease = %lease_name, token, reason = reason.as_str(), "kill switch fired: handler dropped, nothing more is written");
                // The lease may still be ours (e.g. a slow claim ate the
                // clock while the API server is reachable, or the
                // WorkerLease renewing it was deleted): hand it back at
                // once, best effort, so nobody waits a TTL for nothing —
                // renewed per worker, nobody would wait at all, as the
                // operator credits every renewal of the worker's next
                // WorkerLease to a lease still Held by it. The CAS on our
                // last copy cannot touch a lease that moved on. Not before
                // the attempt has surely stopped (`give_back_at`): the
                // slot stays taken until then, as its work may be.
                if given_back(reason).is_some() {
                    let at = give_back_at(&self.fence.clock(), Instant::now(), self.stop_budget);
                    debug!(lease = %lease_name, token, wait = ?at.saturating_duration_since(Instant::now()), "giving the lease back once the attempt has surely stopped");
                    // A drain past its grace stops waiting: the lease is
                    // left to expire (the WorkerLease goes with the worker).
                    tokio::select! {
                        () = async {
                            tokio::time::sleep_until(at).await;
                            give_back(&self.api, &last_copy, reason).await;
                        } => {}
                        () = self.interrupt.cancelled() => {
                            info!(lease = %lease_name, token, reason = reason.as_str(), "drained before the killed attempt was given back: its lease is left to expire");
                        }
                    }
                }
                Ended::Killed(reason)
            }
        }
    }
}

/// Counts a fired kill switch once, whoever noticed it (the heartbeat's
/// timer, a lost renewal, or `Fence::check` on waking from a pause).
fn count_kill(metrics: &WorkerMetrics, reason: KillReason) {
    metrics
        .kill_switch
        .get_or_create(&ReasonLabels {
            reason: reason.as_str(),
        })
        .inc();
}

/// What the handler's future gave: its result, or the registration error
/// that kept it from running.
enum Run {
    Handler(Result<Output, TaskError>),
    NotStarted(Error),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fence::KillClock;
    use batchlease_api::{BatchTaskSpec, TaskLeaseSpec};
    use std::sync::atomic::{AtomicBool, Ordering};
    use tokio::time::Instant;

    /// Notes when the handler's future was dropped.
    struct DropFlag(Arc<std::sync::Mutex<Option<Instant>>>);
    impl Drop for DropFlag {
        fn drop(&mut self) {
            *self.0.lock().unwrap() = Some(Instant::now());
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

    /// An attempt on a held lease whose API server nobody listens on.
    fn attempt(fence: Fence) -> Attempt {
        Attempt {
            api: unreachable_api(),
            identity: "me".into(),
            lease: held_lease(),
            task: BatchTask::new("t", BatchTaskSpec::for_queue("q")),
            fence,
            metrics: WorkerMetrics::default(),
            interrupt: CancellationToken::new(),
            registry: None,
            heartbeat_on: None,
            background: tokio_util::task::TaskTracker::new(),
            membership: None,
            stop_budget: Duration::from_secs(5),
        }
    }

    /// The verdict, when the handler was dropped (since the claim), whether
    /// it was, and whether its cancellation token fired.
    async fn run_until_killed(deadline: Option<Duration>) -> (Ended, Duration, bool, bool) {
        let start = Instant::now();
        let fence = Fence::new(1, KillClock::new(Duration::from_secs(30), start, deadline));
        let dropped = Arc::new(std::sync::Mutex::new(None));
        let cancelled = Arc::new(AtomicBool::new(false));
        let attempt = attempt(fence);
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
        let dropped_at = *dropped.lock().unwrap();
        (
            ended,
            dropped_at.map_or(start.elapsed(), |at| at - start),
            dropped_at.is_some(),
            cancelled.load(Ordering::SeqCst),
        )
    }

    #[tokio::test(start_paused = true)]
    async fn kill_switch_fires_at_two_thirds_of_the_ttl_when_renewals_fail() {
        let (ended, elapsed, dropped, cancelled) = run_until_killed(None).await;
        assert_eq!(ended, Ended::Killed(KillReason::RenewalsFailed));
        // 2/3 of 30 s, measured from the claim; never later. (The verdict
        // comes a third of the TTL later, with the give-back.)
        assert!(
            elapsed >= Duration::from_secs(20) && elapsed < Duration::from_millis(20_100),
            "{elapsed:?}"
        );
        assert!(dropped, "the handler's future was dropped");
        assert!(cancelled, "the cancellation token fired");
    }

    /// The production path: the heartbeat on its own runtime fires the
    /// kill switch while the handler blocks the only thread of the
    /// handler's runtime. With the heartbeat on the handler's runtime it
    /// could not run until the handler yielded.
    #[tokio::test(flavor = "current_thread")]
    async fn a_blocking_handler_cannot_hold_off_the_kill_switch() {
        let rt = Arc::new(
            HeartbeatRuntime::start(kube::Config::new("http://127.0.0.1:1".parse().unwrap()))
                .unwrap(),
        );
        let api = Api::namespaced(rt.client(), "ns");
        // Renewals fail at once (nobody listens): the kill switch fires at
        // 2/3 of 1.5 s, while the handler still blocks for 2.5 s.
        let fence = Fence::new(
            1,
            KillClock::new(Duration::from_millis(1500), Instant::now(), None),
        );
        let attempt = Attempt {
            heartbeat_on: Some((rt, api)),
            ..attempt(fence)
        };
        let seen = Arc::new(AtomicBool::new(false));
        let s = seen.clone();
        let ended = attempt
            .run(move |ctx: TaskContext| async move {
                std::thread::sleep(Duration::from_millis(2500));
                s.store(ctx.cancellation().is_cancelled(), Ordering::SeqCst);
                Ok::<_, TaskError>(Output::none())
            })
            .await;
        assert!(
            seen.load(Ordering::SeqCst),
            "the kill switch fired while the handler blocked its thread"
        );
        assert_eq!(ended, Ended::Killed(KillReason::RenewalsFailed));
    }

    #[tokio::test(start_paused = true)]
    async fn a_dropped_attempt_stops_its_heartbeat() {
        let fence = Fence::new(
            1,
            KillClock::new(Duration::from_secs(30), Instant::now(), None),
        );
        let attempt = attempt(fence.clone());
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

    /// Renewed per worker, the renewer feeds the fence from outside (the
    /// heartbeat writes nothing before a refresh is due) and a revocation
    /// ends the attempt at once, with its reason; the attempt then leaves
    /// the renewer.
    #[tokio::test(start_paused = true)]
    async fn renewed_per_worker_the_renewer_keeps_it_alive_and_revokes_it() {
        use crate::worker_lease::WorkerLeases;
        let start = Instant::now();
        let fence = Fence::new(
            1,
            KillClock::new(Duration::from_secs(30), start, None).per_worker(),
        );
        let leases = WorkerLeases::default();
        leases.set_live_for_tests();
        let membership = leases.register(
            batchlease_api::AttemptRef::of(&held_lease()),
            fence.clone(),
            start,
        );
        let feeder = {
            let fence = fence.clone();
            tokio::spawn(async move {
                for _ in 0..6 {
                    tokio::time::sleep(Duration::from_secs(10)).await;
                    fence.renewed(Instant::now());
                }
                fence.kill(KillReason::Cancelled);
            })
        };
        let attempt = Attempt {
            membership: Some(membership),
            ..attempt(fence)
        };
        let ended = attempt
            .run(|_ctx: TaskContext| std::future::pending::<Result<Output, TaskError>>())
            .await;
        assert_eq!(ended, Ended::Killed(KillReason::Cancelled));
        let elapsed = start.elapsed();
        assert!(
            elapsed >= Duration::from_secs(60) && elapsed < Duration::from_millis(60_100),
            "{elapsed:?}"
        );
        feeder.await.unwrap();
        assert_eq!(
            leases.registered_for_tests(),
            0,
            "deregistered after its verdict"
        );
    }

    /// Issue 39, defect 3: a revoked attempt was given back the moment it
    /// was killed, and the operator acts on a give-back at once (the
    /// task's locks released, Cancelled written) — while the storage
    /// deadline recorded for it still lay ahead (the kill instant before
    /// the revocation) and a runner child had its SIGKILL grace to go. The
    /// verdict (and the give-back with it) now waits for both.
    #[tokio::test(start_paused = true)]
    async fn a_revoked_attempt_is_given_back_only_once_it_has_surely_stopped() {
        let start = Instant::now();
        let ttl = Duration::from_secs(30);
        let fence = Fence::new(1, KillClock::new(ttl, start, None).per_worker());
        let feeder = {
            let fence = fence.clone();
            tokio::spawn(async move {
                // Renewed at 20 s (kill instant 20 + 20 = 40 s), revoked
                // at 25 s.
                tokio::time::sleep(Duration::from_secs(20)).await;
                fence.renewed(Instant::now());
                tokio::time::sleep(Duration::from_secs(5)).await;
                fence.kill(KillReason::Revoked);
            })
        };
        let dropped_at = Arc::new(std::sync::Mutex::new(None));
        let d = dropped_at.clone();
        let ended = attempt(fence)
            .run(move |_ctx: TaskContext| async move {
                let _flag = DropFlag(d);
                std::future::pending::<Result<Output, TaskError>>().await
            })
            .await;
        feeder.await.unwrap();
        assert_eq!(ended, Ended::Killed(KillReason::Revoked));
        let dropped = dropped_at.lock().unwrap().unwrap() - start;
        assert!(
            dropped >= Duration::from_secs(25) && dropped < Duration::from_millis(25_100),
            "the handler is stopped at the revocation: {dropped:?}"
        );
        // max(the clock's kill instant, 40 s; the kill + the 5 s budget).
        let elapsed = start.elapsed();
        assert!(
            elapsed >= Duration::from_secs(40) && elapsed < Duration::from_millis(42_100),
            "given back at {elapsed:?}"
        );
    }

    /// Issue 39, defect 4: a give-back after a lost WorkerLease was one
    /// 2 s try. Failed (an API server briefly away), the lease stayed Held
    /// and the worker's next WorkerLease, a new object that never names
    /// it, kept it alive in the operator's eyes for as long as the worker
    /// renewed. It is tried again until it lands or the lease moved on; a
    /// revoked attempt's, which the operator ends itself, is tried once.
    #[tokio::test(start_paused = true)]
    async fn a_lost_worker_lease_s_give_back_is_tried_until_it_lands() {
        let s = Duration::from_secs;
        for (reason, gives_up) in [
            (KillReason::WorkerLeaseLost, false),
            (KillReason::Revoked, true),
        ] {
            let start = Instant::now();
            let fence = Fence::new(1, KillClock::new(s(30), start, None).per_worker());
            let killer = {
                let fence = fence.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(s(1)).await;
                    fence.kill(reason);
                })
            };
            let run = attempt(fence)
                .run(|_ctx: TaskContext| std::future::pending::<Result<Output, TaskError>>());
            // Nobody answers (connection refused): a transient failure.
            let ended = tokio::time::timeout(s(600), run).await;
            killer.await.unwrap();
            assert_eq!(ended.is_ok(), gives_up, "{reason:?}: {ended:?}");
        }
    }

    /// An API server in this process that takes every write (echoing the
    /// object with a new resourceVersion) and records when each came and
    /// whether it completed the lease.
    fn recording_api(log: Arc<std::sync::Mutex<Vec<(Instant, bool)>>>) -> Api<TaskLease> {
        let service = tower::service_fn(move |req: http::Request<kube::client::Body>| {
            let log = log.clone();
            async move {
                let body = req.into_body().collect_bytes().await?;
                let mut object: serde_json::Value = serde_json::from_slice(&body)?;
                let completed = object["status"]["phase"] == "Completed";
                log.lock().unwrap().push((Instant::now(), completed));
                let rv = log.lock().unwrap().len();
                object["metadata"]["resourceVersion"] = serde_json::json!(rv.to_string());
                let answer = serde_json::to_vec(&object)?;
                Ok::<_, Box<dyn std::error::Error + Send + Sync>>(http::Response::new(
                    kube::client::Body::from(answer),
                ))
            }
        });
        Api::namespaced(kube::Client::new(service, "ns"), "ns")
    }

    /// A drain past its grace gave the lease back the moment it dropped
    /// the handler, and the operator re-issues the task and hands its
    /// locks on at once — while a runner child was still in its SIGTERM
    /// grace. The completion now waits the stop budget, the lease renewed
    /// meanwhile (review of issue 39's give-back fix).
    #[tokio::test(start_paused = true)]
    async fn a_drained_attempt_is_given_back_after_its_stop_budget() {
        let start = Instant::now();
        let s = Duration::from_secs;
        let log = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut lease = held_lease();
        lease.metadata.resource_version = Some("0".into());
        lease.status = Some(batchlease_api::TaskLeaseStatus {
            phase: Some(batchlease_api::LeasePhase::Held),
            ..Default::default()
        });
        // TTL 12 s: a renewal is due at 4 s, inside the stop budget's wait.
        let attempt = Attempt {
            api: recording_api(log.clone()),
            lease,
            stop_budget: s(4),
            ..attempt(Fence::new(1, KillClock::new(s(12), start, None)))
        };
        let interrupt = attempt.interrupt.clone();
        let drainer = tokio::spawn(async move {
            tokio::time::sleep(s(1)).await;
            interrupt.cancel();
        });
        let dropped_at = Arc::new(std::sync::Mutex::new(None));
        let d = dropped_at.clone();
        // Work the handler spawned: told at the drain, its writes refused.
        let told = Arc::new(std::sync::Mutex::new(None));
        let t = told.clone();
        let ended = attempt
            .run(move |ctx: TaskContext| async move {
                let _flag = DropFlag(d);
                let (token, fence) = (ctx.cancellation(), ctx.fence().clone());
                tokio::spawn(async move {
                    token.cancelled().await;
                    *t.lock().unwrap() = Some((Instant::now(), fence.check().is_err()));
                });
                std::future::pending::<Result<Output, TaskError>>().await
            })
            .await;
        drainer.await.unwrap();
        assert_eq!(ended, Ended::Completed(LeaseOutcome::Interrupted));
        let dropped = dropped_at.lock().unwrap().unwrap() - start;
        assert!(
            dropped < Duration::from_millis(1_100),
            "stopped at the drain: {dropped:?}"
        );
        let (told_at, refused) = told.lock().unwrap().unwrap();
        assert!(
            told_at - start < Duration::from_millis(1_100) && refused,
            "spawned work told at the drain ({:?}) and refused ({refused})",
            told_at - start
        );
        let log = log.lock().unwrap();
        let at = |completed: bool| -> Vec<Duration> {
            log.iter()
                .filter(|(_, c)| *c == completed)
                .map(|(t, _)| *t - start)
                .collect()
        };
        // The lease renewed meanwhile (at 4 s), given back at the drain
        // (1 s) + the 4 s stop budget.
        let (renewals, completions) = (at(false), at(true));
        assert_eq!(completions.len(), 1, "{log:?}");
        assert!(
            completions[0] >= s(5) && completions[0] < Duration::from_millis(5_100),
            "given back at {:?}",
            completions[0]
        );
        assert!(
            renewals.iter().any(|r| *r >= s(4) && *r < s(5)),
            "renewed while it waited: {renewals:?}"
        );
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
