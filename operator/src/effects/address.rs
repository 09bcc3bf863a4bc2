//! The writes of addressed offers (`crate::offers`): the address a new
//! offer is created with, and a re-address — a CAS on the still-unclaimed
//! lease, so that a claim landing first wins and the next pass sees it.

use std::time::Duration;

use batchlease_api::{BatchTask, TaskLease};
use kube::ResourceExt;
use kube::api::{Api, PostParams};
use kube::runtime::controller::Action;
use tokio::time::Instant;
use tracing::{debug, info};

use crate::addressees::{Unaddressed, candidates_now};
use crate::context::{Ctx, bounded, classify};
use crate::error::Error;
use crate::offers;

/// `lease`, a new offer, addressed to the live worker of its queue with
/// the most free slots (recorded in the book before the create, so the
/// next pass counts it) — and bound to it (created `Held` by it, no claim:
/// [`offers::bound`]) when that worker has a free slot and takes bound
/// attempts, unless `--bind-offers=false` — or as it is when its queue has
/// no such worker or is served by one that takes no addressed offers.
pub async fn address_new(ctx: &Ctx, lease: &TaskLease) -> TaskLease {
    let ns = lease.namespace().unwrap_or_default();
    let _choosing = ctx.offers.choosing().await;
    let now = Instant::now();
    let Ok(candidates) = candidates_now(ctx, &ns, &lease.spec.queue, now) else {
        return lease.clone();
    };
    let Some(to) = offers::choose(&candidates, None) else {
        return lease.clone();
    };
    ctx.offers.addressed_new(
        &ns,
        &lease.name_any(),
        &lease.spec.task_name,
        &to.identity,
        now,
    );
    let addressed = offers::addressed(lease, Some(to));
    if ctx.bind_offers
        && let Some(bound) = offers::bound(&addressed, to, now)
    {
        ctx.metrics.attempts_bound.inc();
        return bound;
    }
    addressed
}

/// The offer was not issued after all: it counts against nobody.
pub fn unaddress(ctx: &Ctx, lease: &TaskLease) {
    ctx.offers.addressed(
        &lease.namespace().unwrap_or_default(),
        &lease.name_any(),
        None,
        Instant::now(),
    );
}

/// Addresses `lease` (an unclaimed offer, as cached) again, as
/// [`offers::readdress`] says: a worker that is live but slow to claim
/// keeps it while nobody else has a free slot (looked at again after the
/// claim deadline); one that lapsed loses it to another live worker, or to
/// nobody (any worker may claim it). With addressing off, or in a queue
/// served by a worker that takes no addressed offers, it is opened to all;
/// before the WorkerLease watch listed, nothing moves.
pub async fn readdress(
    ctx: &Ctx,
    task: &BatchTask,
    lease: &TaskLease,
    lapsed: bool,
) -> Result<Action, Error> {
    let ns = lease.namespace().unwrap_or_default();
    let name = lease.name_any();
    let from = lease.spec.offered_to.clone().unwrap_or_default();
    let ttl =
        Duration::from_secs(u64::try_from(lease.spec.lease_duration_seconds.max(1)).unwrap_or(1));
    let again = ttl.min(offers::CLAIM_DEADLINE);
    let choosing = ctx.offers.choosing().await;
    let now = Instant::now();
    let to = match candidates_now(ctx, &ns, &lease.spec.queue, now) {
        Err(Unaddressed::NotListed) => return Ok(Action::requeue(Duration::from_secs(1))),
        Err(Unaddressed::Disabled | Unaddressed::Mixed) => None,
        Ok(candidates) => match offers::readdress(&candidates, &from, lapsed) {
            Some(to) => to.cloned(),
            None => {
                // Nobody else can take it now: count its wait afresh.
                ctx.offers.addressed(&ns, &name, Some(&from), now);
                return Ok(Action::requeue(again));
            }
        },
    };
    // Recorded before the write (as a new offer's), so a pass choosing
    // meanwhile counts it; put back below if the write does not land.
    ctx.offers
        .addressed(&ns, &name, to.as_ref().map(|c| c.identity.as_str()), now);
    drop(choosing);
    let moved = offers::addressed(lease, to.as_ref());
    ctx.leadership.ensure()?;
    let api: Api<TaskLease> = Api::namespaced(ctx.client.clone(), &ns);
    let written = bounded(ctx, "offer re-address", async {
        Ok(api.replace(&name, &PostParams::default(), &moved).await)
    })
    .await;
    let written = match written {
        Ok(w) => w,
        Err(e) => {
            ctx.offers.addressed(&ns, &name, Some(&from), now);
            return Err(e);
        }
    };
    match written {
        Ok(_) => {
            let to_name = to.as_ref().map_or("", |c| c.identity.as_str());
            ctx.metrics.offers_readdressed.inc();
            info!(task = %task.name_any(), namespace = %ns, lease = %name, from = %from, to = %to_name, lapsed, "offer addressed again");
            Ok(Action::await_change())
        }
        // A claim (or another write) landed first: its watch event brings
        // the next pass.
        Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => {
            ctx.offers.addressed(&ns, &name, Some(&from), now);
            ctx.metrics.write_conflicts.inc();
            debug!(lease = %name, "re-address lost to a newer write; deciding again on it");
            Ok(Action::await_change())
        }
        Err(e) => {
            ctx.offers.addressed(&ns, &name, Some(&from), now);
            Err(classify(ctx, e, "offer re-address"))
        }
    }
}
