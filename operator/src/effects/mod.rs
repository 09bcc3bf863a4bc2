//! The reconciler's writes: the one write a [`Decision`] asks for
//! ([`apply`]), the lock steps of a pass ([`lock_step`]), the repair of a
//! lease's labels, and the Events, metrics and logs that report them
//! (`report.rs`). Every write the reconciler makes goes through this
//! module, after the pass has gathered its inputs (`inputs.rs`) and
//! decided (`decide`): Kubernetes' Job controller's shape (`syncJob`
//! gathers, decides, writes through one path).
//!
//! Split in files only for size: `writes.rs` (status write, lease create,
//! lease repair), `lock_writes.rs` (take and give back locks), `report.rs`
//! (Events and the metrics of transitions), `revoke.rs` (the revocation
//! on a WorkerLease that comes before ending an attempt renewed per
//! worker), `address.rs` (addressed offers). None imports this file.

mod address;
mod lock_writes;
pub mod report;
mod revoke;
pub mod writes;

use std::time::Duration;

use batchlease_api::{BatchTask, BatchTaskStatus, TaskLease};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, PostParams, Preconditions};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::context::{Ctx, bounded, classify};
use crate::decide::{Decision, ExpiryReason, IssueCause, QueueGate, ReleaseWhy, Transition};
use crate::error::Error;
use crate::metrics::{QueueCounter, QueueLabels, ReasonCounter};
use crate::speculation;
use crate::status::set_condition;

pub use lock_writes::lock_step;
pub use report::publish;
pub use writes::{create_lease, repair_leases, write_status};

/// A pass that neither issues nor is held back by its queue leaves the
/// queue's line of waiters (a slot it was woken for goes to the next in
/// line). Called before [`apply`], and before the reconciler's read of
/// children that may hold up a status write, as it always was.
pub fn leave_line(ctx: &Ctx, task: &BatchTask, decision: &Decision) {
    if !matches!(decision, Decision::HeldBack(_) | Decision::Issue { .. }) {
        ctx.queues.release_waiter(
            &task.namespace().unwrap_or_default(),
            &task.spec.queue,
            &task.name_any(),
        );
    }
}

/// Performs the one write `decision` asks for and says when to look
/// again. The lock steps and reads of a pass are handled in its loop
/// (`reconcile.rs`) before it gets here.
pub async fn apply(ctx: &Ctx, task: &BatchTask, decision: Decision) -> Result<Action, Error> {
    let ns = task.namespace().unwrap_or_default();
    let name = task.name_any();
    match decision {
        Decision::HeldBack(gate) => Ok(held_back(ctx, task, gate)),
        Decision::Release { lease, why } => release(ctx, task, &lease, why).await,
        Decision::Readdress { lease, lapsed } => {
            address::readdress(ctx, task, &lease, lapsed).await
        }
        Decision::Wait(after) => Ok(after.map_or_else(Action::await_change, Action::requeue)),
        Decision::WriteStatus { status, transition } => {
            write_transition(ctx, task, *status, transition).await
        }
        Decision::Issue {
            status,
            lease,
            cause,
        } => issue(ctx, task, *status, &lease, cause).await,
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
        // Handled in the reconciler's loop.
        Decision::FetchLocks(_)
        | Decision::TakeLock(_)
        | Decision::ReleaseLocks { .. }
        | Decision::LockBlocked { .. } => Ok(Action::requeue(Duration::from_millis(500))),
    }
}

/// The queue holds the issue back: the task waits in its queue's line.
fn held_back(ctx: &Ctx, task: &BatchTask, gate: QueueGate) -> Action {
    let (ns, name) = (task.namespace().unwrap_or_default(), task.name_any());
    let queue = QueueLabels::of(task);
    let held = ctx
        .queues
        .hold(&ns, &queue.queue, &name, gate, Instant::now());
    let Some(first) = held else {
        // The queue changed since the pass looked: decide again.
        return Action::requeue(Duration::from_millis(10));
    };
    if first {
        ctx.metrics.count_reason(
            ReasonCounter::QueueIssuesThrottled,
            &queue,
            throttle_reason(gate),
        );
    }
    gate.wait()
        .map_or_else(Action::await_change, Action::requeue)
}

/// A status write and its report. The reconciler has checked already that
/// no child of the task holds an ending write up (`spawned.rs`).
async fn write_transition(
    ctx: &Ctx,
    task: &BatchTask,
    mut status: BatchTaskStatus,
    transition: Transition,
) -> Result<Action, Error> {
    let queue = QueueLabels::of(task);
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
    write_status(ctx, task, status).await?;
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
    report::report(ctx, task, &transition).await;
    Ok(Action::await_change())
}

/// An issue: the queue's slot, the status write (token + 1), the lease's
/// create, their metrics and the Event.
async fn issue(
    ctx: &Ctx,
    task: &BatchTask,
    status: BatchTaskStatus,
    lease: &TaskLease,
    cause: IssueCause,
) -> Result<Action, Error> {
    let (ns, name) = (task.namespace().unwrap_or_default(), task.name_any());
    let queue = QueueLabels::of(task);
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
    if let Err(e) = write_status(ctx, task, status).await {
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
    // Addressed to one worker of the queue (`offers`): chosen after the
    // status write, so a pass that failed there took no slot. Marked sent
    // only then: until its address is in the book, the queue counts the
    // issue as one on its way (`queue_gate::worker_slots`).
    let lease = &address::address_new(ctx, lease).await;
    ctx.queues.create_sent(&ns, &queue.queue, &lease_name);
    if let Err(e) = create_lease(ctx, lease).await {
        if create_refused(&e) {
            ctx.queues
                .unreserve(&ns, &queue.queue, &lease_name, true, Instant::now());
            // Not on AlreadyExists: that lease is real, and the watch
            // counts it by what it carries.
            if !matches!(e, Error::Conflict { .. }) {
                address::unaddress(ctx, lease);
            }
        }
        return Err(e);
    }
    // A bound attempt is created held by its worker (no claim follows).
    let offered = match lease
        .spec
        .holder_identity
        .as_deref()
        .filter(|_| lease.bound())
    {
        Some(holder) => format!("bound to {holder}"),
        None => "offered".to_owned(),
    };
    info!(task = %name, namespace = %ns, token, cause = ?cause, bound = lease.bound(), "lease issued");
    // Degraded (the WorkerLease watch never listed): said on the task.
    if lease.spec.renewal.is_none()
        && let Some(why) = ctx.workers.degraded_cause(Instant::now())
    {
        publish(
            ctx,
            task,
            EventType::Warning,
            "WorkerLeasesUnavailable",
            format!(
                "lease {lease_name} is to be renewed per lease, not per worker, and no queue waits for worker slots: the operator cannot watch WorkerLeases ({why}). Install the WorkerLease CRD (helm upgrade does not upgrade CRDs) and let the operator list and watch workerleases"
            ),
        )
        .await;
    }
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
            format!("lease {lease_name} {offered} with fencing token {token}{locked}"),
        ),
        IssueCause::Reassigned => (
            EventType::Normal,
            "Reassigned",
            format!(
                "previous holder's lease expired; lease {lease_name} {offered} with fencing token {token}"
            ),
        ),
        IssueCause::Replaced => (
            EventType::Warning,
            "LeaseReplaced",
            format!(
                "lease with fencing token {} is missing; its token is retired and lease {lease_name} {offered} with fencing token {token}",
                token - 1
            ),
        ),
    };
    publish(ctx, task, type_, reason, note).await;
    Ok(Action::await_change())
}

/// The metric label of a held-back issue.
fn throttle_reason(gate: QueueGate) -> &'static str {
    match gate {
        QueueGate::Paused => "paused",
        QueueGate::Full => "max_concurrent",
        QueueGate::WorkerSlots => "worker_slots",
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
    // A cancel's release is not timed by renewals (the task ends a TTL
    // after the last one observed), so no expiry to check again.
    if let Some(holder) = revocation_holder(ctx, lease)
        && revoke::revoke(ctx, lease, &holder, None).await? == revoke::Revoked::Renewed
    {
        return Ok(Action::requeue(Duration::from_millis(500)));
    }
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
    // Past its deadline an attempt ends whatever its renewals (its kill
    // switch fires at the deadline too); otherwise the timing is checked
    // again against the copy the revocation is based on.
    let timed = matches!(
        reason,
        ExpiryReason::LeaseExpired | ExpiryReason::BoundNotTaken
    )
    .then(|| crate::observe::lease_ttl(lease));
    if let Some(holder) = revocation_holder(ctx, lease)
        && revoke::revoke(ctx, lease, &holder, timed).await? == revoke::Revoked::Renewed
    {
        return Ok(Action::requeue(Duration::from_millis(500)));
    }
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
                report::expired(ctx, task, &attempt, reason).await;
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

/// The holder whose WorkerLease must revoke `lease`'s attempt before the
/// pass ends it (`revocation::revocation_holder`: the decided copy,
/// read from the cache or directly, with the cache's copy as a witness
/// only that the attempt ended already).
fn revocation_holder(ctx: &Ctx, lease: &TaskLease) -> Option<String> {
    let ns = lease.namespace().unwrap_or_default();
    let cached = ctx
        .leases
        .get(&kube::runtime::reflector::ObjectRef::new(&lease.name_any()).within(&ns));
    batchlease_operator::revocation::revocation_holder(lease, cached.as_deref()).map(str::to_owned)
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
