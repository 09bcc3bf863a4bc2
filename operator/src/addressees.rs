//! Who an offer of a queue may be addressed to now, read from the
//! operator's caches (`offers` has the pure rules): used where an offer is
//! addressed (`effects::address`) and where a pass asks whether its
//! queue's workers have a slot for it (`inputs`, `queue_gate`).

use batchlease_api::LeasePhase;
use kube::ResourceExt;
use kube::runtime::reflector::ObjectRef;
use tokio::time::Instant;

use crate::context::Ctx;
use crate::offers::{self, Candidate};

/// Why an offer of a queue goes to nobody in particular now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unaddressed {
    /// `--address-offers=false`.
    Disabled,
    /// The WorkerLease watch has not listed yet (a new leader does not
    /// know who is live).
    NotListed,
    /// A worker of the queue takes no addressed offers.
    Mixed,
}

/// The workers an offer of `queue` in `ns` may be addressed to now, or why
/// none may.
pub fn candidates_now(
    ctx: &Ctx,
    ns: &str,
    queue: &str,
    now: Instant,
) -> Result<Vec<Candidate>, Unaddressed> {
    if !ctx.address_offers {
        return Err(Unaddressed::Disabled);
    }
    if !ctx.workers.listed() {
        // Never listed for long: as if addressing were off (open offers,
        // nothing held for slots), renewed per lease (`Input::per_worker_offers`).
        if ctx.workers.degraded(now) {
            return Err(Unaddressed::Disabled);
        }
        return Err(Unaddressed::NotListed);
    }
    let workers: Vec<_> = ctx
        .worker_leases
        .state()
        .into_iter()
        .filter(|w| w.namespace().as_deref() == Some(ns))
        .collect();
    let present = ctx.queues.workers_present(ns, queue, now);
    if offers::mixed(
        &present,
        &offers::addressable(workers.iter().map(AsRef::as_ref)),
    ) {
        return Err(Unaddressed::Mixed);
    }
    let addressed = ctx.offers.counts(ns);
    // A worker whose current renewal it declined to start a bound attempt
    // on waits for its next renewal (`offers::cites_declined`).
    let renewed_since_declined = |w: &&std::sync::Arc<batchlease_api::WorkerLease>| {
        let declined = w.worker().and_then(|id| ctx.offers.declined(ns, id));
        !offers::cites_declined(w, declined.as_ref())
    };
    Ok(offers::candidates(
        workers
            .iter()
            .filter(renewed_since_declined)
            .map(AsRef::as_ref),
        queue,
        now,
        |w| ctx.workers.renewals(w),
        |identity| ctx.tracker.held_count(ns, identity),
        |identity| addressed.get(identity).copied().unwrap_or(0),
        // Over: final in the cache, or gone from it (deleted, or its name
        // now another incarnation's) — a worker lists what it ran until
        // its next renewal.
        |a| {
            ctx.leases
                .get(&ObjectRef::new(&a.name).within(ns))
                .is_none_or(|l| {
                    l.uid().as_deref() != Some(a.uid.as_str())
                        || l.status
                            .as_ref()
                            .and_then(|s| s.phase)
                            .is_some_and(LeasePhase::is_terminal)
                })
        },
    ))
}

/// The free slots of the live workers of `queue` in `ns` when an issue
/// held until one is free would be created bound (`offers::bindable_free`,
/// `--bind-offers`); `None`: issues of the queue are not held for slots.
/// None free when its only workers take bound attempts but are no
/// candidates now: they give no slots, or have gone silent for a while
/// (`offers::awaited`). Before the WorkerLease watch listed,
/// none (a new leader does not know
/// the fleet yet: a backlog issued now would go out as open offers to
/// every worker); the list wakes the lines (`QueueBook::workers_listed`).
pub fn bindable_free(ctx: &Ctx, ns: &str, queue: &str, now: Instant) -> Option<usize> {
    if !ctx.bind_offers {
        return None;
    }
    match candidates_now(ctx, ns, queue, now) {
        Ok(candidates) => {
            let workers = ctx.worker_leases.state();
            let awaited = offers::awaited(
                workers
                    .iter()
                    .filter(|w| w.namespace().as_deref() == Some(ns))
                    .map(AsRef::as_ref),
                queue,
                now,
                |w| ctx.workers.silent_since(ns, &w.name_any()),
            );
            offers::bindable_free(&candidates, awaited)
        }
        Err(Unaddressed::NotListed) => Some(0),
        Err(Unaddressed::Disabled | Unaddressed::Mixed) => None,
    }
}
