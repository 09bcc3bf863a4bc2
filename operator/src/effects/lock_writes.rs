//! The lock steps of a pass: take one lock, give locks back, or stop
//! blocked. Each is followed by a new decision in the reconciler's loop
//! (a blocked one ends the pass).

use batchlease_api::BatchTask;
use k8s_openapi::api::coordination::v1::Lease;
use kube::ResourceExt;
use kube::api::{Api, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use tokio::time::Instant;
use tracing::debug;

use super::report::publish;
use crate::context::{Ctx, bounded, classify};
use crate::decide::{Decision, LockRelease};
use crate::error::Error;
use crate::locks::{self, Slot};
use crate::metrics::{QueueCounter, QueueLabels};

/// Performs a lock step (`TakeLock`, `ReleaseLocks`, `LockBlocked`) of
/// the pass that started at `now`, keeping `slots` up to date for the next
/// decision. `Some(action)` ends the pass (blocked); any other decision is
/// not a lock step and does nothing.
pub async fn lock_step(
    ctx: &Ctx,
    task: &BatchTask,
    decision: &Decision,
    slots: &mut Option<Vec<Slot>>,
    look: &locks::Lookups<'_>,
    now: Instant,
) -> Result<Option<Action>, Error> {
    let (ns, name) = (task.namespace().unwrap_or_default(), task.name_any());
    match decision {
        Decision::TakeLock(lease) => {
            let written = take_lock(ctx, lease).await?;
            ctx.index.lock_wait_started(&ns, &name, now);
            update_slots(slots, written, task, look);
            Ok(None)
        }
        Decision::ReleaseLocks {
            leases: give_back,
            why,
        } => {
            release_locks(ctx, task, give_back, slots, look).await?;
            if let LockRelease::AttemptEnded { expired: true } = why {
                ctx.metrics.count(
                    QueueCounter::LockLeaseExpiredBeforeRelease,
                    &QueueLabels::of(task),
                    give_back.len() as u64,
                );
            }
            Ok(None)
        }
        Decision::LockBlocked {
            give_back,
            resource,
            holder,
        } => {
            release_locks(ctx, task, give_back, slots, look).await?;
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
            Ok(Some(Action::requeue(recheck)))
        }
        _ => Ok(None),
    }
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
