//! The object writes of a pass: the task's status (a CAS), a lease's
//! create (with the expectation that lets the next pass wait for the
//! watch), and the repair of a lease's labels and owner reference.

use std::sync::Arc;

use batchlease_api::{BatchTask, TaskLease};
use kube::ResourceExt;
use kube::api::{Api, PostParams};
use kube::runtime::events::EventType;
use tokio::time::Instant;
use tracing::{debug, warn};

use super::report::publish;
use crate::context::{Ctx, bounded, classify};
use crate::error::Error;

/// Puts back the labels and controller reference of this task's leases
/// that someone changed (see `lease_build::repair`): without them workers
/// cannot see an offer and the garbage collector cannot find the lease.
/// Best effort: a failed repair is logged and retried on the lease's next
/// event or the resync; it never holds up the task's own decision.
pub async fn repair_leases(
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

/// Writes the task's status (a CAS on the cached resourceVersion), fitted
/// to the size limit (what is left out is reported), and remembers the
/// version it overwrote (see [`Ctx::cache_behind`]).
pub async fn write_status(
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

/// Creates a lease (an issue's, or a tombstone), expecting the watch to
/// show it.
pub async fn create_lease(ctx: &Ctx, lease: &TaskLease) -> Result<(), Error> {
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
