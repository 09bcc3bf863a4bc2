//! The reconciler: read the task and its leases from the caches, call
//! [`decide`], perform the one conditional write it asks for, report it.

use std::sync::Arc;
use std::time::Duration;

use batchlease_api::{BatchTask, TaskLease, TaskPhase};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, PostParams, Preconditions};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Resource, ResourceExt};
use rand::Rng;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::decide::Transition;
use crate::decide::{
    Decision, ExpiryReason, Input, IssueCause, LockRelease, Lookup, QueueGate, ReleaseWhy, decide,
};
use crate::deps::{self, Readiness};
use crate::expectations::Expectations;
use crate::graph_index::GraphIndex;
use crate::leader::Leadership;
use crate::locks::{self, Holder, Slot};
use crate::metrics::{
    ErrorLabels, Metrics, QueueCounter, QueueLabels, ReasonCounter, reason_label,
};
use crate::observe::Tracker;
use crate::speculation;
use crate::status::set_condition;

/// Why a reconcile failed. Categories, not messages: they label metrics.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// This replica is not (or no longer) the leader: it must not write.
    #[error("not the leader; refusing to write")]
    NotLeader,
    /// A conditional write lost against a newer version (409).
    #[error("conflict writing {what}: the cached copy is stale")]
    Conflict { what: &'static str },
    /// A write did not answer before the leader's term ended.
    #[error("{what} did not answer within the leader's term")]
    Timeout { what: &'static str },
    /// Any other API error.
    #[error("kubernetes API error during {what}: {source}")]
    Kube {
        what: &'static str,
        #[source]
        source: kube::Error,
    },
}

impl Error {
    /// Low-cardinality label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::NotLeader => "not_leader",
            Self::Conflict { .. } => "conflict",
            Self::Timeout { .. } => "timeout",
            Self::Kube { .. } => "kube",
        }
    }
}

/// What every reconcile shares.
pub struct Ctx {
    pub client: kube::Client,
    pub leases: Store<TaskLease>,
    /// Set once the lease watch delivered its first complete list. Until
    /// then the lease cache is empty (the reflector fills it at the list's
    /// end), and a task would look as if it had no leases.
    pub leases_listed: Arc<std::sync::atomic::AtomicBool>,
    pub tracker: Arc<Tracker>,
    /// Leases this process created that the watch has not shown yet.
    pub expectations: Expectations,
    pub metrics: Arc<Metrics>,
    pub recorder: Recorder,
    /// Who reports Events (for those the recorder cannot name).
    pub reporter: kube::runtime::events::Reporter,
    pub leadership: Leadership,
    /// The task cache (dependencies and lock holders are looked up in it).
    pub tasks: Store<BatchTask>,
    pub index: Arc<GraphIndex>,
    /// Namespace of the resource-lock Leases.
    pub lock_namespace: String,
    /// Which Events to publish.
    pub events: crate::events::EventLevel,
    /// `--running-status-delay-ms` ([`Input::running_after`]).
    pub running_after: std::time::Duration,
    /// The queues' controls and counts ([`crate::queues`]).
    pub queues: Arc<crate::queues::QueueBook>,
    /// Set once the TaskQueue watch delivered its first list: until then a
    /// paused queue would look like one without controls.
    pub queues_listed: Arc<std::sync::atomic::AtomicBool>,
    /// Per task, the resourceVersion this process last wrote its status
    /// over: a cached copy still at that version has not seen our write.
    pub overwritten: std::sync::Mutex<std::collections::HashMap<(String, String), String>>,
}

impl Ctx {
    /// Whether the cache still shows `task` as it was before our last
    /// status write. Deciding on it would repeat a decision already
    /// written, and the write would fail its CAS (a 409 per task in a
    /// burst, issue 12): the watch event of our write brings the task
    /// back. Forgets the entry once the cache moved on.
    fn cache_behind(&self, ns: &str, name: &str, rv: Option<&str>) -> bool {
        let mut m = self.overwritten.lock().unwrap_or_else(|e| e.into_inner());
        let key = (ns.to_owned(), name.to_owned());
        match m.get(&key) {
            Some(old) if Some(old.as_str()) == rv => true,
            Some(_) => {
                m.remove(&key);
                false
            }
            None => false,
        }
    }
}

impl std::fmt::Debug for Ctx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ctx").finish_non_exhaustive()
    }
}

/// One pass for one task.
pub async fn reconcile(task: Arc<BatchTask>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    let started = Instant::now();
    let result = reconcile_inner(&task, &ctx).await;
    ctx.metrics
        .reconcile_duration
        .observe(started.elapsed().as_secs_f64());
    // A safety net, not the mechanism: every task is looked at again now
    // and then even if no event arrives (a lost watch event, metadata
    // changed behind our back), spread out so they do not come all at once.
    result.map(|action| {
        if action == Action::await_change() {
            Action::requeue(RESYNC + RESYNC.mul_f64(rand::rng().random::<f64>() / 5.0))
        } else {
            action
        }
    })
}

/// How long a task waits for an event before it is reconciled anyway.
const RESYNC: Duration = Duration::from_secs(300);

async fn reconcile_inner(task: &BatchTask, ctx: &Ctx) -> Result<Action, Error> {
    if !ctx.leases_listed.load(std::sync::atomic::Ordering::Acquire)
        || !ctx.queues_listed.load(std::sync::atomic::Ordering::Acquire)
    {
        return Ok(Action::requeue(Duration::from_millis(200)));
    }
    let ns = task.namespace().unwrap_or_default();
    let name = task.name_any();
    if ctx.cache_behind(&ns, &name, task.resource_version().as_deref()) {
        return Ok(Action::await_change());
    }
    // A spawned child created after its parent ended never runs.
    if let Some(action) = crate::spawned::admit(ctx, task).await? {
        return Ok(action);
    }
    let uid = task.uid().unwrap_or_default();
    let mut leases: Vec<Arc<TaskLease>> = ctx
        .tracker
        .leases_of(&ns, &name)
        .into_iter()
        .filter_map(|l| ctx.leases.get(&ObjectRef::new(&l).within(&ns)))
        .filter(|l| l.spec.task_uid == uid)
        .collect();
    repair_leases(ctx, task, &leases).await?;
    let now = Instant::now();
    let current = task.status.as_ref().and_then(|s| s.current_lease.clone());
    let observation = current
        .as_deref()
        .and_then(|l| ctx.tracker.observation(&ns, l));
    let mut lookup = Lookup::CacheOnly;
    if let Some(cur) = current.as_deref() {
        if leases.iter().any(|l| l.name_any() == cur) {
            ctx.expectations.done(&ns, cur);
        } else if ctx.expectations.pending(&ns, cur, now) {
            lookup = Lookup::Creating;
        }
    }
    let lookup_task = |n: &str| ctx.tasks.get(&ObjectRef::new(n).within(&ns));
    let lease_live = |n: &str, u: &str, t: i64| lease_live(ctx, &ns, n, u, t);
    let gone_left = |n: &str, u: &str, t: i64, ttl: Duration| {
        ctx.tracker
            .gone_attempt_left(&ns, n, u, t, ttl, Instant::now())
    };
    let look = locks::Lookups {
        task: &lookup_task,
        lease_live: &lease_live,
        gone_left: &gone_left,
    };
    // A new task (no phase yet) may be issued in its first write: its
    // dependencies are assessed too.
    let pending = task
        .status
        .as_ref()
        .and_then(|s| s.phase)
        .is_none_or(|p| p == TaskPhase::Pending);
    let readiness = if pending {
        let edges = ctx.index.edges();
        let check = !ctx.index.known_acyclic(&ns, &name, edges);
        let r = deps::assess(task, &lookup_task, check);
        if check && !matches!(r, Readiness::Cycle(_)) {
            ctx.index.mark_acyclic(&ns, &name, edges);
        }
        r
    } else {
        Readiness::Ready
    };
    let finished_with_ttl = task.spec.ttl_seconds_after_finished.is_some()
        && task
            .status
            .as_ref()
            .and_then(|s| s.phase)
            .is_some_and(TaskPhase::is_terminal);
    let needed_by = finished_with_ttl
        .then(|| ctx.index.needed_by(&ns, &name))
        .flatten();
    let queue_gate = ctx.queues.peek(&ns, &task.spec.queue, &name, now);
    let decide_with = |leases: &[Arc<TaskLease>], lookup, locks: Option<Vec<Slot>>| {
        decide(&Input {
            task,
            leases,
            observation,
            now,
            wall: Timestamp::now(),
            jitter: rand::rng().random::<f64>(),
            lookup,
            deps: readiness.clone(),
            locks,
            running_after: ctx.running_after,
            needed_by: needed_by.clone(),
            queue: queue_gate,
        })
    };
    let mut slots: Option<Vec<Slot>> = None;
    let mut looked_up = false;
    let mut decision;
    // Reads and lock writes happen in this loop, each followed by a new
    // decision; the loop ends at the first other decision. Bounded: each
    // lock is taken or given back at most once per pass.
    let mut steps = 0;
    loop {
        steps += 1;
        if steps > MAX_STEPS {
            return Ok(Action::requeue(Duration::from_millis(500)));
        }
        decision = decide_with(&leases, lookup, slots.clone());
        match &decision {
            Decision::LookUpLease(lease_name) if !looked_up => {
                looked_up = true;
                lookup = look_up(ctx, task, lease_name, &mut leases).await?;
            }
            Decision::FetchLocks(resources) => {
                slots = Some(fetch_locks(ctx, task, resources).await?);
            }
            Decision::TakeLock(lease) => {
                let written = take_lock(ctx, lease).await?;
                ctx.index.lock_wait_started(&ns, &name, now);
                update_slots(&mut slots, written, task, &look);
            }
            Decision::ReleaseLocks {
                leases: give_back,
                why,
            } => {
                let why = *why;
                let give_back = give_back.clone();
                release_locks(ctx, task, &give_back, &mut slots, &look).await?;
                if let LockRelease::AttemptEnded { expired: true } = why {
                    ctx.metrics.count(
                        QueueCounter::LockLeaseExpiredBeforeRelease,
                        &QueueLabels::of(task),
                        give_back.len() as u64,
                    );
                }
            }
            Decision::LockBlocked {
                give_back,
                resource,
                holder,
            } => {
                let give_back = give_back.clone();
                release_locks(ctx, task, &give_back, &mut slots, &look).await?;
                // Waiting for a lock, not for the queue: a slot it was
                // woken for goes to the next in line.
                ctx.queues.release_waiter(&ns, &task.spec.queue, &name);
                blocked(ctx, task, resource, holder).await;
                // A deleted task's holder that is stopping frees its lock
                // without any event: look again when it has surely stopped.
                let recheck = slots
                    .as_deref()
                    .and_then(locks::soonest_free)
                    .map_or(crate::decide::LOCK_RECHECK, |left| {
                        left.min(crate::decide::LOCK_RECHECK)
                    });
                return Ok(Action::requeue(recheck));
            }
            _ => break,
        }
    }
    debug!(task = %name, namespace = %ns, ?decision, "decided");
    let queue = QueueLabels::of(task);
    if !matches!(decision, Decision::HeldBack(_) | Decision::Issue { .. }) {
        ctx.queues.release_waiter(&ns, &queue.queue, &name);
    }
    match decision {
        Decision::HeldBack(gate) => {
            let held = ctx
                .queues
                .hold(&ns, &queue.queue, &name, gate, Instant::now());
            let Some(first) = held else {
                // The queue changed since the pass looked: decide again.
                return Ok(Action::requeue(Duration::from_millis(10)));
            };
            if first {
                ctx.metrics.count_reason(
                    ReasonCounter::QueueIssuesThrottled,
                    &queue,
                    throttle_reason(gate),
                );
            }
            Ok(gate
                .wait()
                .map_or_else(Action::await_change, Action::requeue))
        }
        Decision::Release { lease, why } => release(ctx, task, &lease, why).await,
        Decision::Wait(after) => Ok(after.map_or_else(Action::await_change, Action::requeue)),
        Decision::WriteStatus {
            mut status,
            transition,
        } => {
            // A settled speculative attempt: the queue's abort rate goes
            // into this very write (no extra one) and into the metrics.
            let speculative = speculation::settled_attempt(task, &transition);
            if let Some(aborted) = speculative {
                let (rate, n) = ctx.metrics.abort_rate_with(&queue, aborted);
                set_condition(
                    &mut status,
                    task,
                    Timestamp::now(),
                    speculation::health(&queue.queue, rate, n),
                );
            }
            // A task ends only once its children created so far passed
            // the spawn gate (their first pass reads it unfinished).
            if crate::spawned::children_pending(ctx, task, &status).await? {
                return Ok(Action::requeue(crate::spawned::CHILD_RECHECK));
            }
            write_status(ctx, task, *status).await?;
            if let Some(aborted) = speculative {
                let (was, now) = ctx.metrics.record_speculative(&queue, aborted);
                if now == speculation::Band::Livelock && was != now {
                    publish(
                        ctx,
                        task,
                        EventType::Warning,
                        "SpeculationLivelock",
                        format!(
                            "queue {}: over 30% of recent speculative attempts aborted; see condition SpeculationHealthy",
                            queue.queue
                        ),
                    )
                    .await;
                }
            }
            report(ctx, task, &transition).await;
            Ok(Action::await_change())
        }
        Decision::Issue {
            status,
            lease,
            cause,
        } => {
            let token = status.fencing_token;
            let lease_name = lease.name_any();
            // The queue's slot and rate token are taken before the writes
            // (two concurrent issues cannot both take the last one), and
            // given back if the issue fails.
            if !ctx
                .queues
                .reserve(&ns, &queue.queue, &name, &lease_name, Instant::now())
            {
                return Ok(Action::requeue(Duration::from_millis(100)));
            }
            // The slot is freed when no lease can come of this issue: its
            // status write failed, whatever the answer (the create is sent
            // only after it; a status applied despite a lost answer names a
            // lease that was never created, whose name the next pass
            // retires), or its create was refused. A create with an unknown
            // outcome (a timeout, a 5xx) may still land: its reservation
            // stays until the watch shows the lease or the tombstone that
            // retires its name (or expires, see `queues`).
            let create_refused = |e: &Error| match e {
                Error::Conflict { .. } | Error::NotLeader => true,
                Error::Kube {
                    source: kube::Error::Api(s),
                    ..
                } => s.code < 500,
                _ => false,
            };
            // Taken before the write: the watch event of the write ends the
            // wait in the index as soon as it arrives.
            let lock_wait = ctx.index.lock_wait_done(&ns, &name);
            if let Err(e) = write_status(ctx, task, *status).await {
                ctx.queues
                    .unreserve(&ns, &queue.queue, &lease_name, false, Instant::now());
                return Err(e);
            }
            if let Some(since) = lock_wait {
                ctx.metrics.observe_lock_wait(&queue, since.elapsed());
            }
            ctx.metrics.count(QueueCounter::LeasesIssued, &queue, 1);
            if cause != IssueCause::New {
                ctx.metrics.count(QueueCounter::Reassignments, &queue, 1);
            }
            ctx.queues.create_sent(&ns, &queue.queue, &lease_name);
            if let Err(e) = create_lease(ctx, &lease).await {
                if create_refused(&e) {
                    ctx.queues
                        .unreserve(&ns, &queue.queue, &lease_name, true, Instant::now());
                }
                return Err(e);
            }
            info!(task = %name, namespace = %ns, token, cause = ?cause, "lease issued");
            let locked = if lease.spec.resource_tokens.is_empty() {
                String::new()
            } else {
                let tokens: Vec<String> = lease
                    .spec
                    .resource_tokens
                    .iter()
                    .map(|(r, t)| format!("{r}={t}"))
                    .collect();
                format!(" (resource tokens {})", tokens.join(", "))
            };
            let (type_, reason, note) = match cause {
                IssueCause::New => (
                    EventType::Normal,
                    "LeaseIssued",
                    format!("lease {lease_name} offered with fencing token {token}{locked}"),
                ),
                IssueCause::Reassigned => (
                    EventType::Normal,
                    "Reassigned",
                    format!(
                        "previous holder's lease expired; lease {lease_name} offered with fencing token {token}"
                    ),
                ),
                IssueCause::Replaced => (
                    EventType::Warning,
                    "LeaseReplaced",
                    format!(
                        "lease with fencing token {} is missing; its token is retired and lease {lease_name} offered with fencing token {token}",
                        token - 1
                    ),
                ),
            };
            publish(ctx, task, type_, reason, note).await;
            Ok(Action::await_change())
        }
        Decision::RetireToken(tombstone) => {
            warn!(task = %name, namespace = %ns, lease = %tombstone.name_any(), "current lease missing; retiring its token");
            create_lease(ctx, &tombstone).await?;
            Ok(Action::await_change())
        }
        Decision::LookUpLease(lease_name) => {
            // Only after a read that found a current lease the cache lacks
            // (decided again above): the watch will deliver it.
            debug!(task = %name, lease = %lease_name, "lease not cached yet");
            Ok(Action::requeue(crate::decide::CREATE_SETTLE))
        }
        Decision::Expire { lease, reason } => expire(ctx, task, &lease, reason).await,
        Decision::Prune { victims, then } => {
            prune(ctx, &ns, victims).await?;
            Ok(then.map_or_else(Action::await_change, Action::requeue))
        }
        Decision::DeleteTask {
            uid,
            resource_version,
        } => {
            delete_finished(ctx, task, uid, resource_version).await?;
            Ok(Action::await_change())
        }
        // Handled in the loop above.
        Decision::FetchLocks(_)
        | Decision::TakeLock(_)
        | Decision::ReleaseLocks { .. }
        | Decision::LockBlocked { .. } => Ok(Action::requeue(Duration::from_millis(500))),
    }
}

/// Lock steps and reads one reconcile may take before it yields.
const MAX_STEPS: usize = 2 * 32 + 8;

/// Reads the current lease directly (the cache does not show it) and says
/// what the read found.
async fn look_up(
    ctx: &Ctx,
    task: &BatchTask,
    lease_name: &str,
    leases: &mut Vec<Arc<TaskLease>>,
) -> Result<Lookup, Error> {
    let ns = task.namespace().unwrap_or_default();
    let api: Api<TaskLease> = Api::namespaced(ctx.client.clone(), &ns);
    let found = api
        .get_opt(lease_name)
        .await
        .map_err(|source| Error::Kube {
            what: "lease read",
            source,
        })?;
    Ok(match found {
        Some(l) if batchlease_api::check_current(task, &l).is_ok() => {
            leases.push(Arc::new(l));
            Lookup::CacheOnly
        }
        Some(l) => {
            let why = batchlease_api::check_current(task, &l)
                .err()
                .map_or("", |e| e.as_str());
            warn!(task = %task.name_any(), namespace = %ns, lease = %lease_name, why, "an object under the current lease's name is not the task's lease; ignoring it");
            Lookup::Occupied
        }
        None => Lookup::Absent,
    })
}

/// Reads the lock Leases of `resources` directly (a quorum read: a lock
/// decision never rests on a cache that may lag this process's own
/// writes) and says who holds each, and whether an older task waits for it.
async fn fetch_locks(
    ctx: &Ctx,
    task: &BatchTask,
    resources: &[String],
) -> Result<Vec<Slot>, Error> {
    let ns = task.namespace().unwrap_or_default();
    let api: Api<Lease> = Api::namespaced(ctx.client.clone(), &ctx.lock_namespace);
    let lookup = |n: &str| ctx.tasks.get(&ObjectRef::new(n).within(&ns));
    let live = |n: &str, u: &str, t: i64| lease_live(ctx, &ns, n, u, t);
    let gone_left = |n: &str, u: &str, t: i64, ttl: Duration| {
        ctx.tracker
            .gone_attempt_left(&ns, n, u, t, ttl, Instant::now())
    };
    let look = locks::Lookups {
        task: &lookup,
        lease_live: &live,
        gone_left: &gone_left,
    };
    let wall = Timestamp::now();
    let me = locks::queue_key(task);
    let mut slots = Vec::with_capacity(resources.len());
    for resource in resources {
        let name = locks::lock_name(&ns, resource);
        let lease = bounded(ctx, "lock read", async {
            api.get_opt(&name).await.map_err(|source| Error::Kube {
                what: "lock read",
                source,
            })
        })
        .await?;
        let mut holder = locks::holder(lease.as_ref(), task, &look);
        if matches!(holder, Holder::Stopping { .. } | Holder::Dead(_))
            && let Some((n, u, t)) = locks::gone_attempt(lease.as_ref(), task, &lookup)
            && lease_live_in_store(ctx, &ns, &n, &u, t).await?
        {
            // The cache lags (or its watch is down): the holder's lease is
            // still there, and its worker renews it.
            holder = Holder::Live(locks::holder_identity_of(&ns, &n, t));
        }
        let older_waiter = ctx
            .index
            .users_of(&ns, resource)
            .into_iter()
            .filter(|n| *n != task.name_any())
            .filter_map(|n| lookup(&n))
            .filter(|t| locks::queue_key(t) < me && locks::waiting(t, &lookup, wall))
            // A task its queue holds back (paused, full) waits for the
            // queue, not for this resource.
            .filter(|t| {
                !ctx.queues
                    .holds_back(&ns, &t.spec.queue, &t.name_any(), Instant::now())
            })
            .min_by_key(|t| locks::queue_key(t))
            .map(|t| format!("{ns}/{} (waiting longer)", t.name_any()));
        slots.push(Slot {
            resource: resource.clone(),
            name,
            lease,
            holder,
            older_waiter,
        });
    }
    Ok(slots)
}

/// Whether task `(name, uid)`'s lease of `token`, read directly, may have
/// a running holder (see `observe::may_be_held`).
async fn lease_live_in_store(
    ctx: &Ctx,
    ns: &str,
    name: &str,
    uid: &str,
    token: i64,
) -> Result<bool, Error> {
    let api: Api<TaskLease> = Api::namespaced(ctx.client.clone(), ns);
    let lease_name = batchlease_api::names::lease_name(name, token);
    let found = bounded(ctx, "holder lease read", async {
        api.get_opt(&lease_name)
            .await
            .map_err(|source| Error::Kube {
                what: "holder lease read",
                source,
            })
    })
    .await?;
    Ok(found.is_some_and(|l| {
        l.spec.task_uid == uid && l.spec.fencing_token == token && crate::observe::may_be_held(&l)
    }))
}

/// Whether the lease cache shows task `(name, uid)`'s lease of `token`
/// live (`Offered` or `Held`).
fn lease_live(ctx: &Ctx, ns: &str, name: &str, uid: &str, token: i64) -> bool {
    let lease_name = batchlease_api::names::lease_name(name, token);
    ctx.leases
        .get(&ObjectRef::new(&lease_name).within(ns))
        .is_some_and(|l| {
            l.spec.task_uid == uid
                && l.spec.fencing_token == token
                && matches!(
                    l.status.as_ref().and_then(|s| s.phase),
                    Some(batchlease_api::LeasePhase::Offered | batchlease_api::LeasePhase::Held)
                        | None
                )
        })
}

/// Creates (no resourceVersion) or replaces (CAS) a lock Lease.
async fn take_lock(ctx: &Ctx, lease: &Lease) -> Result<Lease, Error> {
    ctx.leadership.ensure()?;
    let api: Api<Lease> = Api::namespaced(ctx.client.clone(), &ctx.lock_namespace);
    let name = lease.name_any();
    bounded(ctx, "lock take", async {
        let written = if lease.metadata.resource_version.is_none() {
            api.create(&PostParams::default(), lease).await
        } else {
            api.replace(&name, &PostParams::default(), lease).await
        };
        written.map_err(|e| classify(ctx, e, "lock take"))
    })
    .await
}

/// Gives back locks, in the given order (each a CAS), and wakes the tasks
/// waiting for them.
async fn release_locks(
    ctx: &Ctx,
    task: &BatchTask,
    give_back: &[Lease],
    slots: &mut Option<Vec<Slot>>,
    look: &locks::Lookups<'_>,
) -> Result<(), Error> {
    if give_back.is_empty() {
        return Ok(());
    }
    let ns = task.namespace().unwrap_or_default();
    let api: Api<Lease> = Api::namespaced(ctx.client.clone(), &ctx.lock_namespace);
    let mut freed = Vec::new();
    for lease in give_back {
        ctx.leadership.ensure()?;
        let name = lease.name_any();
        let written = bounded(ctx, "lock release", async {
            Ok(api.replace(&name, &PostParams::default(), lease).await)
        })
        .await?;
        match written {
            Ok(l) => update_slots(slots, l, task, look),
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => {
                ctx.index.wake_users(&ns, &freed);
                return Err(classify(ctx, e, "lock release"));
            }
        }
        if let Some(r) = slots
            .iter()
            .flatten()
            .find(|s| s.name == name)
            .map(|s| s.resource.clone())
        {
            freed.push(r);
        }
    }
    debug!(task = %task.name_any(), namespace = %ns, resources = ?freed, "locks released");
    ctx.index.wake_users(&ns, &freed);
    Ok(())
}

/// Puts a lock Lease this pass wrote into its slot.
fn update_slots(
    slots: &mut Option<Vec<Slot>>,
    written: Lease,
    task: &BatchTask,
    look: &locks::Lookups<'_>,
) {
    let name = written.name_any();
    if let Some(slot) = slots.iter_mut().flatten().find(|s| s.name == name) {
        slot.holder = locks::holder(Some(&written), task, look);
        slot.lease = Some(written);
        slot.older_waiter = None;
    }
}

/// A lock acquisition is blocked: a metric and an Event when the blocker is
/// new for this task.
async fn blocked(ctx: &Ctx, task: &BatchTask, resource: &str, holder: &str) {
    let note = format!("waiting for resource {resource}: held by or promised to {holder}");
    let (ns, name) = (task.namespace().unwrap_or_default(), task.name_any());
    let new = ctx.index.new_blocker(&ns, &name, &note);
    // The wait starts at the first block, even before any lock was taken:
    // a task blocked on its first resource is waiting too, and
    // `batchlease_lock_oldest_wait_seconds` must show it.
    ctx.index.lock_wait_started(&ns, &name, Instant::now());
    debug!(task = %task.name_any(), resource, holder, "lock contention");
    if new {
        // Counted once per task and blocker, like the Event: a task looked
        // at again while the same holder keeps the lock is one contention.
        ctx.metrics
            .count(QueueCounter::LockContention, &QueueLabels::of(task), 1);
        publish(ctx, task, EventType::Normal, "WaitingForResource", note).await;
    }
}

/// Puts back the labels and controller reference of this task's leases
/// that someone changed (see `lease_build::repair`): without them workers
/// cannot see an offer and the garbage collector cannot find the lease.
/// Best effort: a failed repair is logged and retried on the lease's next
/// event or the resync; it never holds up the task's own decision.
async fn repair_leases(
    ctx: &Ctx,
    task: &BatchTask,
    leases: &[Arc<TaskLease>],
) -> Result<(), Error> {
    for lease in leases {
        let Some(fixed) = crate::lease_build::repair(task, lease) else {
            continue;
        };
        ctx.leadership.ensure()?;
        let name = lease.name_any();
        let api: Api<TaskLease> =
            Api::namespaced(ctx.client.clone(), &task.namespace().unwrap_or_default());
        // A CAS on the cached copy: a lease written since is not ours to
        // overwrite, and will be looked at again on its event.
        let written = bounded(ctx, "lease repair", async {
            api.replace(&name, &PostParams::default(), &fixed)
                .await
                .map(|_| ())
                .map_err(|e| classify(ctx, e, "lease repair"))
        })
        .await;
        match written {
            Ok(()) => {
                warn!(task = %task.name_any(), lease = %name, "lease labels or owner reference were changed; restored");
                publish(
                    ctx,
                    task,
                    EventType::Warning,
                    "LeaseRepaired",
                    format!("lease {name} had its labels or owner reference changed; restored"),
                )
                .await;
            }
            Err(e) => {
                debug!(task = %task.name_any(), lease = %name, error = %e, "lease repair not written; retried on the next event");
            }
        }
    }
    Ok(())
}

pub(crate) async fn write_status(
    ctx: &Ctx,
    task: &BatchTask,
    status: batchlease_api::BatchTaskStatus,
) -> Result<(), Error> {
    ctx.leadership.ensure()?;
    let (status, dropped) = crate::fit::fit(task, status);
    let api: Api<BatchTask> =
        Api::namespaced(ctx.client.clone(), &task.namespace().unwrap_or_default());
    let mut updated = task.clone();
    // The cached resourceVersion stays on the object: the write is a CAS.
    updated.status = Some(status);
    bounded(ctx, "status write", async {
        api.replace_status(&task.name_any(), &PostParams::default(), &updated)
            .await
            .map(|_| ())
            .map_err(|e| classify(ctx, e, "status write"))
    })
    .await?;
    if let Some(rv) = task.resource_version() {
        ctx.overwritten
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert((task.namespace().unwrap_or_default(), task.name_any()), rv);
    }
    for d in dropped {
        warn!(task = %task.name_any(), reason = d.reason(), "left out of the status: too large");
        publish(ctx, task, EventType::Warning, d.reason(), d.note()).await;
    }
    Ok(())
}

async fn create_lease(ctx: &Ctx, lease: &TaskLease) -> Result<(), Error> {
    ctx.leadership.ensure()?;
    let ns = lease.namespace().unwrap_or_default();
    let name = lease.name_any();
    let api: Api<TaskLease> = Api::namespaced(ctx.client.clone(), &ns);
    ctx.expectations.expect(&ns, &name, Instant::now());
    let created = bounded(ctx, "lease create", async {
        Ok(api.create(&PostParams::default(), lease).await)
    })
    .await?;
    match created {
        Ok(_) => Ok(()),
        // AlreadyExists is never success: the token was issued by the
        // status write just made, so an object of that name is not ours (a
        // forgery, or a leftover). Re-read: the next pass checks it and, if
        // it is not the task's current lease, retires the token.
        Err(kube::Error::Api(s)) if s.code == 409 => {
            ctx.expectations.done(&ns, &name);
            ctx.metrics.write_conflicts.inc();
            warn!(lease = %name, namespace = %ns, "a lease under a newly issued token already exists; re-reading");
            Err(Error::Conflict {
                what: "lease create",
            })
        }
        Err(e) => {
            // A refused create (4xx) will not show up; an unknown outcome
            // (timeout, 5xx) may: keep expecting it for a while.
            if matches!(&e, kube::Error::Api(s) if s.code < 500) {
                ctx.expectations.done(&ns, &name);
            }
            Err(classify(ctx, e, "lease create"))
        }
    }
}

/// The metric label of a held-back issue.
fn throttle_reason(gate: QueueGate) -> &'static str {
    match gate {
        QueueGate::Paused => "paused",
        QueueGate::Full => "max_concurrent",
        QueueGate::Throttled(_) => "rate",
        QueueGate::Open => "none",
    }
}

/// Releases an Offered or Held lease (CAS on the cached copy). A conflict
/// means a claim, a renewal or a completion landed first: the watch brings
/// the lease as it now is and the next pass decides on that.
async fn release(
    ctx: &Ctx,
    task: &BatchTask,
    lease: &TaskLease,
    why: ReleaseWhy,
) -> Result<Action, Error> {
    let ns = lease.namespace().unwrap_or_default();
    let api: Api<TaskLease> = Api::namespaced(ctx.client.clone(), &ns);
    ctx.leadership.ensure()?;
    let written = bounded(ctx, "lease release", async {
        Ok(api
            .replace(&lease.name_any(), &PostParams::default(), lease)
            .await)
    })
    .await?;
    match written {
        Ok(_) => {
            let holder = lease.spec.holder_identity.clone();
            info!(task = %task.name_any(), namespace = %ns, lease = %lease.name_any(), holder = holder.as_deref().unwrap_or(""), reason = why.as_str(), "lease released");
            if why == ReleaseWhy::Cancelled
                && let Some(h) = holder
            {
                let ttl = lease.spec.lease_duration_seconds;
                publish(
                        ctx,
                        task,
                        EventType::Normal,
                        "Cancelling",
                        format!(
                            "spec.cancel: released lease {} of {h}; its next renewal fails and stops it; the task ends Cancelled once it cannot be running (about {ttl}s)",
                            lease.name_any()
                        ),
                    )
                    .await;
            }
            Ok(Action::await_change())
        }
        Err(kube::Error::Api(s)) if s.code == 409 => {
            ctx.metrics.write_conflicts.inc();
            debug!(lease = %lease.name_any(), "release lost to a newer write; deciding again on it");
            Ok(Action::requeue(Duration::from_millis(200)))
        }
        Err(kube::Error::Api(s)) if s.code == 404 => {
            Ok(Action::requeue(Duration::from_millis(200)))
        }
        Err(e) => Err(classify(ctx, e, "lease release")),
    }
}

async fn expire(
    ctx: &Ctx,
    task: &BatchTask,
    lease: &TaskLease,
    reason: ExpiryReason,
) -> Result<Action, Error> {
    let ns = lease.namespace().unwrap_or_default();
    let api: Api<TaskLease> = Api::namespaced(ctx.client.clone(), &ns);
    let mut attempt = lease.clone();
    // At most two writes: the cached copy, then — after a conflict that was
    // not a renewal — the copy a re-read returned.
    for retry in [false, true] {
        ctx.leadership.ensure()?;
        let written = bounded(ctx, "lease expire", async {
            Ok(api
                .replace(&attempt.name_any(), &PostParams::default(), &attempt)
                .await)
        })
        .await?;
        match written {
            Ok(_) => {
                expired(ctx, task, &attempt, reason).await;
                return Ok(Action::await_change());
            }
            Err(kube::Error::Api(s)) if s.code == 409 => {
                ctx.metrics.write_conflicts.inc();
                // A write landed after our read (design §3.5: re-read). A
                // renewal — a new renewTime — is one observed now: never
                // expire on a stale copy. Anything else (a label, a blind
                // writer) is no sign of life: expire the fresh copy.
                let fresh = bounded(ctx, "lease read", async {
                    api.get_opt(&attempt.name_any())
                        .await
                        .map_err(|source| Error::Kube {
                            what: "lease read",
                            source,
                        })
                })
                .await?;
                match fresh {
                    Some(f) if !crate::observe::renewed_since(lease, &f) => {
                        if retry {
                            // Still no renewal, but the lease keeps changing:
                            // try again shortly, without crediting it.
                            return Ok(Action::requeue(Duration::from_millis(200)));
                        }
                        debug!(lease = %f.name_any(), "expiry conflicted with a write that was no renewal; expiring the fresh copy");
                        let mut next = f;
                        next.status = attempt.status.clone();
                        attempt = next;
                    }
                    _ => {
                        ctx.tracker.touch(&ns, &lease.name_any(), Instant::now());
                        debug!(lease = %lease.name_any(), "expiry lost to a renewal; not expiring");
                        return Ok(Action::requeue(Duration::from_millis(500)));
                    }
                }
            }
            Err(e) => return Err(classify(ctx, e, "lease expire")),
        }
    }
    Ok(Action::requeue(Duration::from_millis(500)))
}

/// Metrics, log and Event of a lease the operator expired.
async fn expired(ctx: &Ctx, task: &BatchTask, lease: &TaskLease, reason: ExpiryReason) {
    let ns = lease.namespace().unwrap_or_default();
    ctx.metrics.count_reason(
        ReasonCounter::LeaseExpiredBeforeRelease,
        &QueueLabels::of(task),
        reason.as_str(),
    );
    let holder = lease.spec.holder_identity.clone().unwrap_or_default();
    info!(task = %task.name_any(), namespace = %ns, lease = %lease.name_any(), %holder, reason = reason.as_str(), "lease expired");
    let note = format!(
        "lease {} of {holder} (fencing token {}) expired: {}",
        lease.name_any(),
        lease.spec.fencing_token,
        lease
            .status
            .as_ref()
            .and_then(|s| s.message.clone())
            .unwrap_or_default()
    );
    publish(ctx, task, EventType::Warning, reason.as_str(), note).await;
}

async fn prune(ctx: &Ctx, ns: &str, victims: Vec<(String, Option<String>)>) -> Result<(), Error> {
    let api: Api<TaskLease> = Api::namespaced(ctx.client.clone(), ns);
    for (name, rv) in victims {
        ctx.leadership.ensure()?;
        let dp = DeleteParams {
            preconditions: Some(Preconditions {
                resource_version: rv,
                uid: None,
            }),
            ..DeleteParams::default()
        };
        let deleted = bounded(ctx, "lease prune", async {
            Ok(api.delete(&name, &dp).await)
        })
        .await?;
        match deleted {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
            Err(e) => return Err(classify(ctx, e, "lease prune")),
        }
    }
    Ok(())
}

/// Deletes a task whose `ttlSecondsAfterFinished` has passed, in the
/// background (garbage collection takes its leases), on the condition that
/// it is the object that was decided on: a precondition failure (redriven
/// or edited meanwhile) re-decides on the watch event that caused it, and a
/// task already gone is done.
async fn delete_finished(
    ctx: &Ctx,
    task: &BatchTask,
    uid: String,
    resource_version: Option<String>,
) -> Result<(), Error> {
    ctx.leadership.ensure()?;
    let api: Api<BatchTask> =
        Api::namespaced(ctx.client.clone(), &task.namespace().unwrap_or_default());
    let dp = DeleteParams {
        preconditions: Some(Preconditions {
            resource_version,
            uid: Some(uid),
        }),
        propagation_policy: Some(kube::api::PropagationPolicy::Background),
        ..DeleteParams::default()
    };
    let deleted = bounded(ctx, "task delete", async {
        Ok(api.delete(&task.name_any(), &dp).await)
    })
    .await?;
    match deleted {
        Ok(_) => {
            info!(task = %task.name_any(), "deleted: ttlSecondsAfterFinished has passed");
            Ok(())
        }
        Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Ok(()),
        Err(e) => Err(classify(ctx, e, "task delete")),
    }
}

/// Runs a write only as long as this term may still write: a request that
/// has not answered when the term ends — by its deadline, or lost before
/// it — is abandoned (the term's end is the last moment this replica may
/// believe it leads), and kube's retries inside it with it.
pub(crate) async fn bounded<T>(
    ctx: &Ctx,
    what: &'static str,
    write: impl std::future::Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    match ctx.leadership.bound(write).await {
        Some(r) => r,
        None => Err(Error::Timeout { what }),
    }
}

fn classify(ctx: &Ctx, e: kube::Error, what: &'static str) -> Error {
    match e {
        kube::Error::Api(s) if s.code == 409 => {
            ctx.metrics.write_conflicts.inc();
            Error::Conflict { what }
        }
        source => Error::Kube { what, source },
    }
}

/// Events, metrics and logs for a status transition.
async fn report(ctx: &Ctx, task: &BatchTask, transition: &Transition) {
    let queue = QueueLabels::of(task);
    let token = task.status.as_ref().map_or(0, |s| s.fencing_token);
    let (type_, reason, note) = match transition {
        Transition::Initialized | Transition::RedriveIgnored => return,
        Transition::Claimed { holder } => (
            EventType::Normal,
            "LeaseClaimed",
            format!("{holder} holds the lease with fencing token {token}"),
        ),
        Transition::Succeeded => (
            EventType::Normal,
            "Succeeded",
            format!("completed with fencing token {token}"),
        ),
        Transition::Retry {
            reason,
            delay_seconds,
            ..
        } => {
            ctx.metrics
                .count_reason(ReasonCounter::Retries, &queue, &reason_label(reason));
            (
                EventType::Warning,
                "Retrying",
                format!(
                    "attempt with token {token} ended: {reason}; next attempt in {delay_seconds:.1}s"
                ),
            )
        }
        Transition::Interrupted { delay_seconds } if *delay_seconds > 0.0 => (
            EventType::Warning,
            "Interrupted",
            format!(
                "attempt with token {token} interrupted again; next attempt in {delay_seconds:.1}s"
            ),
        ),
        Transition::Interrupted { .. } => (
            EventType::Normal,
            "Interrupted",
            format!(
                "attempt with token {token} interrupted (worker drained or gave the lease back); offered again at once"
            ),
        ),
        Transition::Aborted { quarantined } => {
            let note = if *quarantined {
                "speculative commit lost its compare-and-swap; too many aborts, falling back to Exclusive".to_owned()
            } else {
                "speculative commit lost its compare-and-swap; retrying".to_owned()
            };
            (EventType::Normal, "Aborted", note)
        }
        Transition::DeadLettered { reason, .. } => {
            ctx.metrics.count_reason(
                ReasonCounter::TasksDeadLettered,
                &queue,
                &reason_label(reason),
            );
            (
                EventType::Warning,
                "DeadLettered",
                format!(
                    "gave up after the attempt with token {token}: {reason}; raise spec.redrive to retry"
                ),
            )
        }
        Transition::WaitingForDependencies => return,
        Transition::DependencyFailed => (
            EventType::Warning,
            "DependencyFailed",
            task.status
                .as_ref()
                .and_then(|s| {
                    s.conditions
                        .iter()
                        .find(|c| c.type_ == batchlease_api::keys::condition::DEPENDENCY_FAILED)
                })
                .map(|c| c.message.clone())
                .unwrap_or_default(),
        ),
        Transition::CycleDetected { cycle } => {
            ctx.metrics
                .count(QueueCounter::GraphCycleDetected, &queue, 1);
            (
                EventType::Warning,
                "CycleDetected",
                format!("rejected: dependency cycle {cycle}"),
            )
        }
        Transition::Redriven => (
            EventType::Normal,
            "Redriven",
            "spec.redrive raised: back to Pending with a fresh retry budget".to_owned(),
        ),
        Transition::Cancelled { holder } => (
            EventType::Normal,
            "Cancelled",
            match holder {
                Some(h) => format!(
                    "cancelled (spec.cancel): the lease of {h} with fencing token {token} was released and its attempt has stopped"
                ),
                None => "cancelled (spec.cancel) before any worker held it".to_owned(),
            },
        ),
        Transition::CancelAwaitsLostHolder => (
            EventType::Warning,
            "LeaseMissing",
            format!(
                "cancelled, but the lease with fencing token {token} is missing: the task ends Cancelled once its holder, if any, has stopped"
            ),
        ),
        Transition::Withdrawn => {
            debug!(task = %task.name_any(), queue = %queue.queue, "queue paused: offer withdrawn");
            return;
        }
    };
    info!(task = %task.name_any(), namespace = %task.namespace().unwrap_or_default(), reason, "transition");
    publish(ctx, task, type_, reason, note).await;
}

pub(crate) async fn publish(
    ctx: &Ctx,
    task: &BatchTask,
    type_: EventType,
    reason: &str,
    note: String,
) {
    // Events are writes too: none after the term, and only those asked for.
    if !ctx.leadership.is_leader() || !ctx.events.wants(&type_, reason) {
        return;
    }
    let event = Event {
        type_,
        reason: reason.into(),
        note: Some(clip(note, MAX_NOTE_BYTES)),
        action: reason.into(),
        secondary: None,
    };
    let regarding = task.object_ref(&());
    // Bounded by the term like every write: kube's client retries an Event
    // refused with 429/503/504 (honouring Retry-After), which could land
    // it long after the term; the bound drops the request and its retries.
    let published = ctx
        .leadership
        .bound(async {
            if task.name_any().len() <= crate::events::MAX_RECORDER_NAME {
                ctx.recorder.publish(&event, &regarding).await
            } else {
                publish_long_named(ctx, &event, regarding.clone()).await
            }
        })
        .await;
    match published {
        Some(Ok(())) => {}
        // Events are best effort: the status already says what happened.
        Some(Err(e)) => {
            warn!(error = %batchlease_api::Chain(&e), task = %task.name_any(), "publishing event failed")
        }
        None => debug!(task = %task.name_any(), reason, "event abandoned: the term ended"),
    }
}

/// An Event about a task whose name is too long for kube-rs's Event names
/// (see [`crate::events::event_name`]): created as kube-rs would, under a
/// shortened name, without its aggregation into a series (such names are
/// rare; each Event is its own object).
async fn publish_long_named(
    ctx: &Ctx,
    ev: &Event,
    regarding: k8s_openapi::api::core::v1::ObjectReference,
) -> Result<(), kube::Error> {
    use k8s_openapi::api::events::v1::Event as K8sEvent;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
    let now = k8s_openapi::jiff::Timestamp::now();
    let namespace = regarding.namespace.clone().unwrap_or_default();
    let name = crate::events::event_name(
        regarding.name.as_deref().unwrap_or_default(),
        now.as_nanosecond(),
    );
    let event = K8sEvent {
        action: Some(ev.action.clone()),
        reason: Some(ev.reason.clone()),
        event_time: Some(MicroTime(now)),
        regarding: Some(regarding),
        note: ev.note.clone(),
        metadata: kube::api::ObjectMeta {
            namespace: Some(namespace.clone()),
            name: Some(name),
            ..Default::default()
        },
        reporting_controller: Some(ctx.reporter.controller.clone()),
        reporting_instance: Some(
            ctx.reporter
                .instance
                .clone()
                .unwrap_or_else(|| ctx.reporter.controller.clone()),
        ),
        type_: Some(
            match ev.type_ {
                EventType::Normal => "Normal",
                EventType::Warning => "Warning",
            }
            .into(),
        ),
        ..Default::default()
    };
    kube::Api::<K8sEvent>::namespaced(ctx.client.clone(), &namespace)
        .create(&kube::api::PostParams::default(), &event)
        .await
        .map(|_| ())
}

/// events.k8s.io/v1 refuses a `note` over 1 kB.
const MAX_NOTE_BYTES: usize = 1000;

/// `s` cut to at most `max` bytes on a character boundary, marked with "…".
fn clip(mut s: String, max: usize) -> String {
    if s.len() <= max {
        return s;
    }
    let mut end = max - '…'.len_utf8();
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s.truncate(end);
    s.push('…');
    s
}

/// What to do after a failed reconcile.
pub fn error_policy(task: Arc<BatchTask>, error: &Error, ctx: Arc<Ctx>) -> Action {
    ctx.metrics
        .reconcile_errors
        .get_or_create(&ErrorLabels { kind: error.kind() })
        .inc();
    match error {
        // The watch brings the newer version, which triggers a new pass; the
        // requeue is a safety net.
        Error::Conflict { .. } => Action::requeue(Duration::from_millis(500)),
        Error::NotLeader => Action::await_change(),
        Error::Kube { .. } | Error::Timeout { .. } => {
            warn!(task = %task.name_any(), error = %batchlease_api::Chain(&error), "reconcile failed");
            Action::requeue(Duration::from_secs(2))
        }
    }
}
