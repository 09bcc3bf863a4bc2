//! The reconciler, thin: one pass gathers its inputs (`inputs.rs`),
//! calls [`decide`], and hands the [`Decision`] to the effects
//! (`effects/`), which make the one write it asks for and report it. The
//! reads and lock writes a decision may ask for first (a direct read of a
//! lease or of the locks, taking or giving back a lock) run in a bounded
//! loop here, each followed by a new decision. After Kubernetes' Job
//! controller (`syncJob`: gather, decide, write through one path) and
//! kube-rs's controller-rs (a thin `reconcile`).
//!
//! What the pass shares ([`Ctx`]) and its [`Error`] live in `context.rs`
//! and `error.rs`, so that the modules it calls import those, not this.

use std::sync::Arc;
use std::time::Duration;

use batchlease_api::{BatchTask, TaskLease};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use rand::Rng;
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::context::Ctx;
use crate::decide::{Decision, Input, decide};
use crate::effects;
use crate::error::Error;
use crate::inputs::{self, Gathered};
use crate::locks::{self, Slot};
use crate::metrics::ErrorLabels;
use crate::spawned;

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
    if let Some(action) = spawned::admit(ctx, task).await? {
        return Ok(action);
    }
    let mut leases: Vec<Arc<TaskLease>> = inputs::leases_of(ctx, task);
    effects::repair_leases(ctx, task, &leases).await?;
    let Gathered {
        now,
        observation,
        mut lookup,
        readiness,
        needed_by,
        queue_gate,
        offer,
    } = inputs::gather(ctx, task, &leases);
    let lookup_task = |n: &str| ctx.tasks.get(&ObjectRef::new(n).within(&ns));
    let lease_live = |n: &str, u: &str, t: i64| inputs::lease_live(ctx, &ns, n, u, t);
    let gone_left = |n: &str, u: &str, t: i64, ttl: Duration| {
        ctx.tracker
            .gone_attempt_left(&ns, n, u, t, ttl, Instant::now())
    };
    let look = locks::Lookups {
        task: &lookup_task,
        lease_live: &lease_live,
        gone_left: &gone_left,
    };
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
            offer,
            per_worker_offers: !ctx.workers.degraded(now),
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
                lookup = inputs::look_up(ctx, task, lease_name, &mut leases).await?;
            }
            Decision::FetchLocks(resources) => {
                slots = Some(inputs::fetch_locks(ctx, task, resources).await?);
            }
            Decision::TakeLock(_)
            | Decision::ReleaseLocks { .. }
            | Decision::LockBlocked { .. } => {
                if let Some(action) =
                    effects::lock_step(ctx, task, &decision, &mut slots, &look, now).await?
                {
                    return Ok(action);
                }
            }
            _ => break,
        }
    }
    debug!(task = %name, namespace = %ns, ?decision, "decided");
    effects::leave_line(ctx, task, &decision);
    // A task ends only once its children created so far passed the spawn
    // gate (their first pass reads it unfinished): a read that holds the
    // ending status write up.
    if let Decision::WriteStatus { status, .. } = &decision
        && spawned::children_pending(ctx, task, status).await?
    {
        return Ok(Action::requeue(spawned::CHILD_RECHECK));
    }
    effects::apply(ctx, task, decision).await
}

/// Lock steps and reads one reconcile may take before it yields.
const MAX_STEPS: usize = 2 * 32 + 8;

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
