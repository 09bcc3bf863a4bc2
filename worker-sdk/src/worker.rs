//! The worker: watch the offered leases of its queues, claim one per free
//! slot, run the handler under a heartbeat, and drain on shutdown.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use batchlease_api::{AttemptRef, BatchTask, LeasePhase, Renewal, TaskLease, check_current};
use kube::api::Api;
use kube::runtime::reflector::Store;
use kube::{Client, ResourceExt};
use rand::Rng;
use tokio::sync::{Notify, Semaphore};
use tokio::task::JoinSet;
use tokio::time::{Instant, timeout};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::attempt::Ended;
use crate::claim_brake::{self, ClaimBrake};
use crate::claim_order::claim_order;
use crate::context::{Output, TaskContext};
use crate::error::{Error, TaskError};
use crate::heartbeat_runtime::HeartbeatRuntime;
use crate::lease_ops;
use crate::metrics::WorkerMetrics;
use crate::registry::Registry;
use crate::worker_lease::{Renewer, WorkerLeases};

mod bound;
mod builder;
mod offer_watch;
mod signal;
mod start;
pub use offer_watch::selectors as offer_selectors;
pub use signal::shutdown_signal;
use start::AttemptStart;

pub use builder::{
    CHECKPOINT_INTERVAL_ENV, DEFAULT_DRAIN_GRACE, RENEW_PER_WORKER_ENV, WorkerBuilder,
};
use builder::{MAX_IDENTITY_CHARS, default_identity};

impl WorkerBuilder {
    /// Validates the configuration.
    pub fn build(self) -> Result<Worker, Error> {
        if self.queues.is_empty() {
            return Err(Error::Config("at least one queue is required"));
        }
        if self.slots == 0 {
            return Err(Error::Config("slots must be at least 1"));
        }
        let identity = self.identity.unwrap_or_else(default_identity);
        // The CRD caps holderIdentity at 253 characters: a longer identity
        // made every claim fail with 422, which looked like lost races.
        if identity.is_empty() || identity.chars().count() > MAX_IDENTITY_CHARS {
            return Err(Error::Config(
                "identity must be 1 to 253 characters (spec.holderIdentity)",
            ));
        }
        if !identity.contains('/') {
            // Where the chart's holder-only admission policy is on, every
            // claim of this worker would be refused (403).
            warn!(
                %identity,
                "the holder identity is not <pod name>/<suffix> (or user:<user name>/<suffix>): \
                 the chart's holder-only admission policy refuses its claims"
            );
        }
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(Error::Config(
                "build() must be called inside a Tokio runtime",
            ));
        }
        let heartbeats = Arc::new(HeartbeatRuntime::start(self.config.clone())?);
        let client = Client::try_from(self.config).map_err(|source| Error::Kube {
            what: "client",
            source,
        })?;
        Ok(Worker {
            client,
            heartbeats,
            namespace: self.namespace,
            queues: self.queues,
            slots: self.slots,
            identity,
            drain_grace: self.drain_grace,
            metrics: self.metrics,
            registry: self.registry,
            renew_per_worker: self.renew_per_worker,
            stop_budget: self.stop_budget,
            checkpoint_interval: self.checkpoint_interval,
        })
    }
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("identity", &self.identity)
            .field("queues", &self.queues)
            .finish_non_exhaustive()
    }
}

/// Runs tasks of its queues. See [`WorkerBuilder`].
pub struct Worker {
    client: Client,
    heartbeats: Arc<HeartbeatRuntime>,
    namespace: String,
    queues: Vec<String>,
    slots: usize,
    identity: String,
    drain_grace: Duration,
    metrics: WorkerMetrics,
    registry: Option<Arc<dyn Registry>>,
    renew_per_worker: bool,
    stop_budget: Duration,
    checkpoint_interval: Option<Duration>,
}

impl Worker {
    /// The holder identity written into claimed leases.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// Claims and runs tasks until `shutdown` resolves, then drains: no new
    /// claims, running handlers get the grace period, the rest are dropped
    /// and their leases released as `Interrupted`.
    pub async fn run<H, F>(
        self,
        handler: H,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), Error>
    where
        H: Fn(TaskContext) -> F + Send + Sync + 'static,
        F: Future<Output = Result<Output, TaskError>> + Send + 'static,
    {
        let handler = Arc::new(handler);
        let leases: Api<TaskLease> = Api::namespaced(self.client.clone(), &self.namespace);
        let tasks: Api<BatchTask> = Api::namespaced(self.client.clone(), &self.namespace);
        let changed = Arc::new(Notify::new());
        let stop_watch = CancellationToken::new();
        // The watches end with `run`, even when `run`'s future is dropped.
        let _stop_watch = stop_watch.clone().drop_guard();
        // Renewing per worker, it tells the operator its slots and takes
        // offers addressed to it (`offer_watch`).
        let selectors = offer_watch::selectors(&self.queues, &self.identity, self.renew_per_worker);
        let stores = offer_watch::spawn(&leases, &selectors, &changed, &stop_watch);
        // The presence record ends with `run` too (deleted on the way out).
        // Renewed per worker, the WorkerLease is the presence record: its
        // renewer runs on the heartbeat runtime with the heartbeat client,
        // and deletes it once every attempt has stopped.
        let stop_presence = CancellationToken::new();
        let (presence, worker_leases) = if self.renew_per_worker {
            let leases = WorkerLeases::default();
            let renewer = Renewer {
                api: Api::namespaced(self.heartbeats.client(), &self.namespace),
                identity: self.identity.clone(),
                queues: self.queues.clone(),
                slots: Some(i32::try_from(self.slots).unwrap_or(i32::MAX)),
                takes_bound: true,
                leases: leases.clone(),
            };
            let runtime = self
                .heartbeats
                .handle()
                .unwrap_or_else(tokio::runtime::Handle::current);
            (
                runtime.spawn(renewer.run(stop_presence.clone())),
                Some(leases),
            )
        } else {
            (
                tokio::spawn(crate::presence::run(
                    Api::namespaced(self.client.clone(), &self.namespace),
                    self.identity.clone(),
                    self.queues.clone(),
                    stop_presence.clone(),
                )),
                None,
            )
        };
        let _stop_presence = stop_presence.clone().drop_guard();
        info!(identity = %self.identity, queues = ?self.queues, slots = self.slots, renew_per_worker = self.renew_per_worker, "worker started");
        let slots = Arc::new(Semaphore::new(self.slots));
        let interrupt = CancellationToken::new();
        // Compensations of speculative rounds whose handler was dropped:
        // they run to the end even then, and the worker waits for them.
        let background = tokio_util::task::TaskTracker::new();
        // Each attempt's end, with when it was claimed (for the brake).
        let mut running: JoinSet<(Ended, Instant)> = JoinSet::new();
        futures::pin_mut!(shutdown);
        // After a claim failed for a reason other than a lost race (an API
        // error), look again soon: no watch event may come to wake us. In
        // an outage, back off instead of hammering every offer each second.
        let mut retry_at: Option<Instant> = None;
        let mut failed_rounds: u32 = 0;
        let mut just_claimed: HashMap<String, Instant> = HashMap::new();
        let mut brake = ClaimBrake::default();
        // Bound attempts (created held by us) started, given back or
        // declined, and when each waiting one was first seen.
        let mut taken: HashMap<AttemptRef, Instant> = HashMap::new();
        let mut bound_seen: HashMap<AttemptRef, Instant> = HashMap::new();
        let confirmed = async |w: &Option<WorkerLeases>| match w {
            Some(w) => w.confirmed().await,
            None => std::future::pending().await,
        };
        let start = |running: &mut JoinSet<(Ended, Instant)>,
                     permit: tokio::sync::OwnedSemaphorePermit,
                     held: TaskLease,
                     task: BatchTask,
                     sent: Instant| {
            let attempt = AttemptStart {
                leases: leases.clone(),
                heartbeat_on: Some((
                    self.heartbeats.clone(),
                    Api::namespaced(self.heartbeats.client(), &self.namespace),
                )),
                identity: self.identity.clone(),
                metrics: self.metrics.clone(),
                interrupt: interrupt.clone(),
                registry: self.registry.clone(),
                background: background.clone(),
                worker_leases: worker_leases.clone(),
                stop_budget: self.stop_budget,
                checkpoint_interval: self.checkpoint_interval,
            };
            let handler = handler.clone();
            running.spawn(async move {
                let _permit = permit;
                let ended = attempt.run(held, task, sent, move |ctx| handler(ctx)).await;
                (ended, sent)
            });
        };
        loop {
            tokio::select! {
                _ = &mut shutdown => break,
                _ = changed.notified() => {}
                () = confirmed(&worker_leases) => {}
                Some(ended) = running.join_next(), if !running.is_empty() => {
                    self.brake_on(&mut brake, ended);
                }
                _ = tokio::time::sleep_until(retry_at.unwrap_or_else(Instant::now)), if retry_at.is_some() => {}
            }
            just_claimed.retain(|_, at| at.elapsed() < JUST_CLAIMED_FOR);
            let paused = brake.paused_until(Instant::now());
            if let Some(leases) = &worker_leases {
                leases.set_claims_paused(paused.is_some());
            }
            // Bound attempts first: they are ours already.
            let round = bound::look(
                bound::Look {
                    stores: &stores,
                    identity: &self.identity,
                    leases: &leases,
                    tasks: &tasks,
                    slots: &slots,
                    may_start: paused.is_none(),
                    worker_leases: worker_leases.as_ref(),
                    metrics: &self.metrics,
                },
                &mut taken,
                &mut bound_seen,
            )
            .await;
            retry_at = round.look_again;
            for r in round.ready {
                self.metrics.bound_started.inc();
                info!(lease = %r.lease.name_any(), token = r.lease.spec.fencing_token, "bound attempt started");
                start(&mut running, r.permit, r.lease, r.task, r.sent);
            }
            if let Some(until) = paused {
                // Offers wait for other workers meanwhile; look again
                // when the pause ends.
                retry_at = Some(retry_at.map_or(until, |r| r.min(until)));
                continue;
            }
            self.metrics.claims_paused.set(0);
            while let Ok(permit) = slots.clone().try_acquire_owned() {
                let skip: HashSet<String> = just_claimed.keys().cloned().collect();
                let claimed = self
                    .claim_one(&leases, &tasks, &stores, &skip, worker_leases.as_ref())
                    .await;
                let (held, task, sent) = match claimed {
                    Claim::Claimed(held, task, sent) => {
                        failed_rounds = 0;
                        // Our cache shows it offered until the watch
                        // delivers the claim: do not race ourselves for it.
                        just_claimed.insert(held.name_any(), Instant::now());
                        (*held, *task, sent)
                    }
                    Claim::Nothing => {
                        failed_rounds = 0;
                        break;
                    }
                    Claim::Failed { offers, error } => {
                        let delay = claim_retry_delay(failed_rounds);
                        // One line per round, not one per offer.
                        warn!(offers, failed_rounds, retry_in = ?delay, error = %batchlease_api::Chain(&error), "claims failed");
                        failed_rounds = failed_rounds.saturating_add(1);
                        let at = Instant::now() + delay;
                        retry_at = Some(retry_at.map_or(at, |r| r.min(at)));
                        break;
                    }
                };
                start(&mut running, permit, held, task, sent);
            }
        }
        // A draining worker serves no queue any more (the WorkerLease,
        // though, is renewed until its last attempt has stopped, and says
        // `slots: 0` at once, so nothing more is bound to it).
        stop_presence.cancel();
        // Bound to us but not started: back to the operator at once — and
        // again once drained, for an attempt bound before the operator saw
        // the slots go (the watches run until then).
        bound::give_back_all(
            &stores,
            &self.identity,
            &leases,
            &mut taken,
            worker_leases.as_ref(),
        )
        .await;
        info!(running = running.len(), grace = ?self.drain_grace, "draining: no more claims");
        let drained = tokio::time::timeout(self.drain_grace, async {
            while running.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            warn!(
                running = running.len(),
                "grace period over: releasing the rest as Interrupted"
            );
            interrupt.cancel();
            while running.join_next().await.is_some() {}
        }
        bound::give_back_all(
            &stores,
            &self.identity,
            &leases,
            &mut taken,
            worker_leases.as_ref(),
        )
        .await;
        stop_watch.cancel();
        background.close();
        if !background.is_empty() {
            info!(
                tasks = background.len(),
                "waiting for compensations of dropped attempts"
            );
        }
        background.wait().await;
        // Its delete is bounded (see `presence`).
        let _ = presence.await;
        info!("worker stopped");
        Ok(())
    }

    /// Feeds how an attempt ended to the claim brake; says so, loudly and
    /// in the metrics, when the worker stops claiming.
    fn brake_on(
        &self,
        brake: &mut ClaimBrake,
        ended: Result<(Ended, Instant), tokio::task::JoinError>,
    ) {
        match ended {
            Ok((Ended::NotStarted, claimed)) => {
                if let Some(pause) = brake.not_started(claimed, Instant::now()) {
                    self.metrics.claims_paused.set(1);
                    self.metrics.claim_pauses.inc();
                    warn!(
                        pause = ?pause,
                        in_a_row = claim_brake::STREAK,
                        "attempts keep ending before their handler runs (the storage refuses or cannot take their registration): not claiming for a while, so other workers get the offers; see the warnings above for the storage's error"
                    );
                }
            }
            // The handler ran (and returned): the storage took the
            // registration.
            Ok((Ended::Completed(_) | Ended::CompletionRejected, _)) => brake.started(),
            // A kill switch says nothing about the storage (the handler
            // may not have run), nor does a panicked or cancelled attempt
            // task.
            Ok((Ended::Killed(_), _)) | Err(_) => {}
        }
    }

    /// Claims one offered lease of our queues (addressed to nobody or to
    /// this worker), oldest second first and
    /// spread across workers within a second (see `claim_order`), after a small
    /// random delay against thundering herds. Only a lease that is its
    /// task's current one (design §3.1: name, token, task UID and owner
    /// checked against the task as read just before the claim) is claimed:
    /// a forged or stale lease is never run.
    async fn claim_one(
        &self,
        api: &Api<TaskLease>,
        tasks: &Api<BatchTask>,
        stores: &[Store<TaskLease>],
        just_claimed: &HashSet<String>,
        worker_leases: Option<&WorkerLeases>,
    ) -> Claim {
        if worker_leases.is_some_and(WorkerLeases::full) {
            // A WorkerLease lists at most MAX_HOLDS attempts.
            debug!(
                max = batchlease_api::worker_lease::MAX_HOLDS,
                "holding as many attempts as a worker lease lists: not claiming"
            );
            return Claim::Nothing;
        }
        let offered: Vec<Arc<TaskLease>> = stores
            .iter()
            .flat_map(Store::state)
            .filter(|l| l.status.as_ref().and_then(|s| s.phase) == Some(LeasePhase::Offered))
            .filter(|l| self.queues.contains(&l.spec.queue))
            .collect();
        let offered = claim_order(offered, &self.identity, just_claimed);
        if offered.is_empty() {
            return Claim::Nothing;
        }
        let herd_delay = Duration::from_millis(rand::rng().random_range(0..25));
        tokio::time::sleep(herd_delay).await;
        let mut failure: Option<(usize, Error)> = None;
        for candidate in offered {
            let task = match timeout(READ_BUDGET, tasks.get_opt(&candidate.spec.task_name)).await {
                Ok(Ok(Some(task))) => task,
                // The task is gone: garbage collection takes the lease.
                Ok(Ok(None)) => continue,
                Ok(Err(source)) => {
                    let n = failure.as_ref().map_or(0, |f| f.0) + 1;
                    failure = Some((
                        n,
                        Error::Kube {
                            what: "task read",
                            source,
                        },
                    ));
                    continue;
                }
                Err(_) => {
                    let n = failure.as_ref().map_or(0, |f| f.0) + 1;
                    failure = Some((n, Error::Timeout { what: "task read" }));
                    continue;
                }
            };
            if task.spec.cancel {
                // The operator withdraws the offer; never start a task a
                // user cancelled.
                self.metrics.claims_refused.inc();
                debug!(lease = %candidate.name_any(), "task cancelled; not claiming");
                continue;
            }
            if let Err(why) = check_current(&task, &candidate) {
                // A stale offer (the task moved on; the watch will show it
                // ended) or a forgery: never claimed.
                self.metrics.claims_refused.inc();
                debug!(lease = %candidate.name_any(), why = why.as_str(), "not the task's current lease; not claiming");
                continue;
            }
            // Renewed per worker only while the WorkerLease is live, and
            // only an offer stamped for it.
            let renewal = if worker_leases.is_some_and(WorkerLeases::claims_per_worker)
                && candidate.spec.renewal == Some(Renewal::Lease)
            {
                Renewal::Worker
            } else {
                Renewal::Lease
            };
            let sent = Instant::now();
            let claimed = match timeout(
                READ_BUDGET,
                lease_ops::claim(api, &candidate, &self.identity, renewal),
            )
            .await
            {
                Ok(r) => r,
                Err(_) => Err(Error::Timeout { what: "claim" }),
            };
            let claimed = match claimed {
                // The claim may have been applied with its answer lost:
                // look, and adopt the lease if it is ours (its kill clock
                // counts from this claim's send), so it does not sit Held by
                // nobody until it expires and costs the task a retry.
                Err(e) => match timeout(READ_BUDGET, api.get_opt(&candidate.name_any())).await {
                    Ok(Ok(Some(l))) if lease_ops::held_by(&l, &self.identity) => Ok(Some(l)),
                    _ => Err(e),
                },
                other => other,
            };
            match claimed {
                Ok(Some(held)) => {
                    self.metrics.claims.inc();
                    info!(lease = %held.name_any(), token = held.spec.fencing_token, "claimed");
                    return Claim::Claimed(Box::new(held), Box::new(task), sent);
                }
                Ok(None) => {
                    self.metrics.claim_conflicts.inc();
                }
                Err(e) => {
                    let n = failure.as_ref().map_or(0, |f| f.0) + 1;
                    failure = Some((n, e));
                }
            }
        }
        match failure {
            Some((offers, error)) => Claim::Failed { offers, error },
            None => Claim::Nothing,
        }
    }
}

/// The pause after a round of failed claims: 1 s, doubling to 16 s, with
/// up to 25 % jitter so a fleet does not retry in step.
fn claim_retry_delay(failed_rounds: u32) -> Duration {
    let base = Duration::from_secs(1 << failed_rounds.min(4));
    base + base.mul_f64(rand::rng().random_range(0.0..0.25))
}

/// How long a lease this worker claimed is kept out of its own claim
/// order (until its cache has surely seen the claim).
const JUST_CLAIMED_FOR: Duration = Duration::from_secs(30);

/// Bound on a read made while claiming.
const READ_BUDGET: Duration = Duration::from_secs(5);

/// What one claim round got.
enum Claim {
    /// This lease, claimed by a request sent at that instant, and its task
    /// as read just before.
    Claimed(Box<TaskLease>, Box<BatchTask>, Instant),
    /// Nothing offered, or every race lost: wait for the next watch event.
    Nothing,
    /// API errors on `offers` offers (the last one given): look again after
    /// a backoff.
    Failed { offers: usize, error: Error },
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests;
