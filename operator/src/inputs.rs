//! The reconciler's reads: what one pass gathers for [`decide`] besides
//! the task — its leases and the observation of the current one, the
//! expectations of a create in flight, its dependencies, whether it is
//! still needed, its queue's gate — and the direct reads a decision may
//! ask for ([`look_up`], [`fetch_locks`]). Reads only: every write is in
//! `effects/` (after Kubernetes' Job controller, whose `syncJob` gathers,
//! decides, then writes through one path).
//!
//! [`decide`]: crate::decide::decide

use std::sync::Arc;
use std::time::Duration;

use batchlease_api::{BatchTask, TaskLease, TaskPhase};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::reflector::ObjectRef;
use tokio::time::Instant;
use tracing::warn;

use crate::addressees;
use crate::context::{Ctx, bounded};
use crate::decide::{Lookup, OfferView, QueueGate};
use crate::deps::{self, Readiness};
use crate::error::Error;
use crate::locks::{self, Holder, Slot};
use crate::observe::Observation;

/// What one pass read for [`crate::decide::Input`], besides the task, its
/// leases and the locks.
#[derive(Debug)]
pub struct Gathered {
    /// The pass's monotonic now.
    pub now: Instant,
    /// What was observed of the current lease, if the tracker saw it.
    pub observation: Option<Observation>,
    /// Whether the current lease, missing from the cache, is one this
    /// process is creating.
    pub lookup: Lookup,
    /// Whether the task's dependencies let it run.
    pub readiness: Readiness,
    /// For a finished task with a TTL: an unfinished task that needs it.
    pub needed_by: Option<String>,
    /// What the task's queue allows now.
    pub queue_gate: QueueGate,
    /// The current lease's address while it is an addressed offer.
    pub offer: Option<OfferView>,
}

/// The task's leases in the cache (of this incarnation: its UID).
pub fn leases_of(ctx: &Ctx, task: &BatchTask) -> Vec<Arc<TaskLease>> {
    let ns = task.namespace().unwrap_or_default();
    let name = task.name_any();
    let uid = task.uid().unwrap_or_default();
    ctx.tracker
        .leases_of(&ns, &name)
        .into_iter()
        .filter_map(|l| ctx.leases.get(&ObjectRef::new(&l).within(&ns)))
        .filter(|l| l.spec.task_uid == uid)
        .collect()
}

/// Everything else the pass decides on, read from the caches, the
/// tracker, the graph index and the queue book (see [`Gathered`]).
pub fn gather(ctx: &Ctx, task: &BatchTask, leases: &[Arc<TaskLease>]) -> Gathered {
    let ns = task.namespace().unwrap_or_default();
    let name = task.name_any();
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
    // A pass that may issue tells the queue what its workers have room for
    // (only these: the count costs a look at every worker of the queue).
    let may_issue = matches!(readiness, Readiness::Ready)
        && !task
            .status
            .as_ref()
            .and_then(|s| s.phase)
            .is_some_and(TaskPhase::is_terminal)
        && !leases.iter().any(|l| {
            l.status
                .as_ref()
                .and_then(|s| s.phase)
                .is_none_or(|p| !p.is_terminal())
        });
    if may_issue {
        let free = addressees::bindable_free(ctx, &ns, &task.spec.queue, now);
        ctx.queues.worker_slots(&ns, &task.spec.queue, free);
    }
    let queue_gate = ctx.queues.peek(&ns, &task.spec.queue, &name, now);
    let offer = current
        .as_deref()
        .and_then(|cur| leases.iter().find(|l| l.name_any() == cur))
        .and_then(|l| offer_view(ctx, &ns, l, now));
    Gathered {
        now,
        observation,
        lookup,
        readiness,
        needed_by,
        queue_gate,
        offer,
    }
}

/// What the operator knows of `lease`'s address, if it is an open offer
/// addressed to a worker: since when, and until when that worker may be
/// addressed offers (`offers::addressable_until`). Before the WorkerLease
/// watch listed once a fresh leader knows no worker — it would take every
/// addressee for lapsed — so the offer counts as just addressed to a
/// worker live for one more second: it is looked at again then.
fn offer_view(ctx: &Ctx, ns: &str, lease: &TaskLease, now: Instant) -> Option<OfferView> {
    let to = lease.spec.offered_to.as_deref()?;
    if !crate::offers::is_open(lease) {
        return None;
    }
    if !ctx.workers.listed() {
        return Some(OfferView {
            since: now,
            addressee_live_until: Some(now + Duration::from_secs(1)),
        });
    }
    let since = ctx.offers.since(ns, &lease.name_any(), to, now);
    let label = batchlease_api::worker_lease::worker_lease_name(to);
    // Addressing off: every addressed offer counts as its worker's lapse,
    // and is opened to all at its next pass.
    let renewed_at = ctx
        .workers
        .renewed_at(ns, &label)
        .filter(|_| ctx.address_offers);
    let addressee_live_until = renewed_at.and_then(|at| {
        ctx.worker_leases
            .get(&ObjectRef::new(&label).within(ns))
            .filter(|w| w.worker() == Some(to))
            .and_then(|w| crate::offers::addressable_until(&w, at))
            .filter(|until| *until > now)
    });
    Some(OfferView {
        since,
        addressee_live_until,
    })
}

/// Reads the current lease directly (the cache does not show it) and says
/// what the read found.
pub async fn look_up(
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
pub async fn fetch_locks(
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
pub fn lease_live(ctx: &Ctx, ns: &str, name: &str, uid: &str, token: i64) -> bool {
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
