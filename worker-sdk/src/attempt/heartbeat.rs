//! The lease's only writer during an attempt: renewals every TTL/3 with
//! the handler's latest checkpoint, then the completion; the kill switch
//! when no renewal succeeds in time.
//!
//! Renewed per worker (the claim set `spec.renewal: Worker`), the
//! WorkerLease's renewals keep the attempt alive and this loop writes the
//! TaskLease only for a new checkpoint (at most once per checkpoint
//! interval, the TTL by default) and for a
//! refresh every `max(TTL, 120 s)` (`KillClock::next_write`); the renewer
//! feeds or kills the fence from outside, and may hand the attempt back to
//! per-lease renewals.
//!
//! Apart from the attempt's running (`super`) because it is a loop of its
//! own, run on the heartbeat runtime, that shares nothing with the handler
//! but the fence, the checkpoint and the completion it is sent.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use batchlease_api::{JsonObject, LeaseOutcome, TaskLease};
use kube::ResourceExt;
use kube::api::Api;
use tokio::sync::oneshot;
use tokio::time::{Instant, sleep_until, timeout};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use super::completion::{COMPLETION_REFUSED, refused_completion};
use crate::error::Error;
use crate::fence::{Fence, KillReason};
use crate::lease_ops::{self, Completion, Renewal};
use crate::metrics::WorkerMetrics;
use crate::worker_lease::{Membership, Mode};

/// How the heartbeat ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Verdict {
    /// The completion was acknowledged.
    Completed(LeaseOutcome),
    /// The API server refused the completion: the lease is not ours.
    Rejected,
    /// The kill switch fired (or the attempt was dropped).
    Killed,
}

/// The lease's only writer during an attempt.
pub(super) struct Heartbeat {
    pub(super) api: Api<TaskLease>,
    pub(super) identity: String,
    /// Our latest copy of the lease.
    pub(super) lease: TaskLease,
    pub(super) checkpoint: Arc<Mutex<Option<JsonObject>>>,
    pub(super) fence: Fence,
    pub(super) metrics: WorkerMetrics,
    /// Its registration with the WorkerLease renewer, when renewed per
    /// worker; dropped (deregistered) with the heartbeat, after its verdict.
    pub(super) membership: Option<Membership>,
}

/// Resolves when the renewer hands the attempt to per-lease renewals.
async fn handed_back(membership: Option<&mut Membership>) {
    match membership {
        Some(m) => m.changed().await,
        None => std::future::pending().await,
    }
}

impl Heartbeat {
    /// Renews every TTL/3 from the claim's send time (retrying a failed
    /// renewal quickly) and, once the handler is done, completes — retrying
    /// transient errors while the fence holds. Fires the kill switch when no
    /// renewal succeeded in time or the lease was found lost.
    pub(super) async fn run(
        mut self,
        done: CancellationToken,
        finished: oneshot::Receiver<Completion>,
    ) -> (Verdict, TaskLease) {
        let verdict = self.beat(done, finished).await;
        (verdict, self.lease)
    }

    async fn beat(
        &mut self,
        done: CancellationToken,
        mut finished: oneshot::Receiver<Completion>,
    ) -> Verdict {
        let clock = self.fence.clock();
        let every = clock.renew_every();
        let retry = (every / 4).clamp(Duration::from_millis(100), Duration::from_secs(1));
        let per_try = (every / 2).max(Duration::from_millis(500));
        let mut next = clock.next_renewal();
        let mut completion: Option<Completion> = None;
        let mut per_worker = clock.is_per_worker()
            && self
                .membership
                .as_ref()
                .is_some_and(|m| m.mode() == Mode::Worker);
        // Renewed per worker: the checkpoint last written to the lease.
        let mut written: Option<JsonObject> = None;
        loop {
            let (kill_at, _) = self.fence.clock().kill_at();
            tokio::select! {
                // Past the deadline, the kill switch wins over a late write.
                biased;
                _ = done.cancelled() => return Verdict::Killed,
                _ = sleep_until(kill_at) => {
                    // Renewed per worker, the renewer may have fed the
                    // clock meanwhile: look again.
                    let (at, reason) = self.fence.clock().kill_at();
                    if at > Instant::now() {
                        continue;
                    }
                    self.fence.kill(reason);
                    return Verdict::Killed;
                }
                // Killed from outside: revoked on the WorkerLease, or the
                // fence found past its instant.
                _ = self.fence.killed().cancelled() => return Verdict::Killed,
                _ = handed_back(self.membership.as_mut()), if per_worker => {
                    info!(lease = %self.lease.name_any(), "renewed per lease from now on (the worker lease was refused)");
                    per_worker = false;
                    next = next.min(self.fence.clock().next_renewal());
                    continue;
                }
                c = &mut finished, if completion.is_none() => match c {
                    Ok(c) => {
                        completion = Some(c);
                        next = Instant::now();
                    }
                    // The handler was dropped without an outcome: the kill
                    // switch fired.
                    Err(_) => return Verdict::Killed,
                },
                _ = sleep_until(next) => {}
            }
            if Instant::now() < next {
                continue;
            }
            if per_worker && completion.is_none() {
                // Write only a refresh or a new checkpoint; look again for
                // a checkpoint every TTL/3 meanwhile.
                let pending = self
                    .checkpoint
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone();
                let new_checkpoint = pending.is_some() && pending != written;
                let due = self.fence.clock().next_write(new_checkpoint);
                let now = Instant::now();
                if now < due {
                    next = due.min(now + every);
                    continue;
                }
            }
            let sent = Instant::now();
            // A write that cannot finish before the kill switch is useless,
            // and one stuck on a black-holed connection must not use up the
            // whole budget: each try gets at most half a renewal period,
            // then is dropped (with its connection) and retried afresh.
            let budget = kill_at.saturating_duration_since(sent).min(per_try);
            if let Some(c) = completion.clone() {
                // The last word: never complete an attempt we cannot prove ours.
                if let Err(e) = self.fence.check_alive() {
                    warn!(lease = %self.lease.name_any(), error = %e, "not completing: attempt revoked");
                    return Verdict::Killed;
                }
                match timeout(
                    budget,
                    lease_ops::complete(&self.api, &self.lease, &self.identity, &c),
                )
                .await
                {
                    Ok(Ok(())) => return Verdict::Completed(c.outcome),
                    Ok(Err(e @ Error::Rejected { .. })) => {
                        error!(lease = %self.lease.name_any(), error = %e, kind = e.kind(), "completion rejected");
                        return Verdict::Rejected;
                    }
                    // Our own completion is invalid (the lease is still
                    // ours): report that instead, once; it carries nothing
                    // of the handler's output that could be refused again.
                    Ok(Err(Error::Invalid { message, .. }))
                        if c.reason.as_deref() != Some(COMPLETION_REFUSED) =>
                    {
                        error!(lease = %self.lease.name_any(), %message, "completion refused as invalid; reporting the refusal");
                        completion = Some(refused_completion(&message));
                        next = Instant::now();
                    }
                    Ok(Err(e @ Error::Invalid { .. })) => {
                        error!(lease = %self.lease.name_any(), error = %e, "completion refused as invalid");
                        return Verdict::Rejected;
                    }
                    Ok(Err(e)) => {
                        warn!(lease = %self.lease.name_any(), error = %batchlease_api::Chain(&e), "completion failed; retrying while the fence holds");
                        next = Instant::now() + retry;
                    }
                    Err(_) => {
                        warn!(lease = %self.lease.name_any(), "completion timed out");
                        next = Instant::now();
                    }
                }
                continue;
            }
            let cp = self
                .checkpoint
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            match timeout(
                budget,
                lease_ops::renew(&self.api, &self.lease, &self.identity, cp.clone()),
            )
            .await
            {
                Ok(Ok(Renewal::Renewed(stored))) => {
                    if per_worker {
                        self.fence.written(sent);
                        written = cp;
                    } else {
                        self.fence.renewed(sent);
                    }
                    self.metrics
                        .renewal_latency
                        .observe(sent.elapsed().as_secs_f64());
                    self.lease = *stored;
                    next = sent + every;
                    debug!(lease = %self.lease.name_any(), "renewed");
                }
                Ok(Ok(Renewal::Cancelled)) => {
                    info!(lease = %self.lease.name_any(), "the task was cancelled: stopping the attempt");
                    self.fence.kill(KillReason::Cancelled);
                    return Verdict::Killed;
                }
                Ok(Ok(Renewal::Lost(why))) => {
                    warn!(lease = %self.lease.name_any(), why, "renewal found the lease lost");
                    self.fence.kill(KillReason::LeaseLost);
                    return Verdict::Killed;
                }
                Ok(Err(e @ Error::Invalid { .. })) => {
                    error!(lease = %self.lease.name_any(), error = %e, "renewal refused as invalid: ending the attempt");
                    self.fence.kill(KillReason::WriteRefused);
                    return Verdict::Killed;
                }
                Ok(Err(e)) => {
                    warn!(lease = %self.lease.name_any(), error = %batchlease_api::Chain(&e), "renewal failed; retrying");
                    next = Instant::now() + retry;
                }
                Err(_) => {
                    warn!(lease = %self.lease.name_any(), "renewal timed out");
                    next = Instant::now();
                }
            }
        }
    }
}
