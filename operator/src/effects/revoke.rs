//! Revocation: before the operator ends an attempt its holder did not end
//! itself (expiry, release on cancel), it adds the attempt to its holder's
//! WorkerLease's `status.revoked` by a compare-and-swap on the copy it
//! observed (design, "Fleets").
//!
//! Why a write and not a look: the holder's renewals of its WorkerLease
//! and the TaskLease's expiry are writes to different objects, so the
//! expiry's own CAS cannot see a renewal that landed unseen. This write is
//! on the object the holder renews: a renewal that landed after our copy
//! makes it fail (and counts as a renewal observed now), and once it lands
//! every later renewal of the holder fails and finds the attempt revoked.

use batchlease_api::worker_lease::worker_lease_name;
use batchlease_api::{AttemptRef, TaskLease, WorkerLease};
use kube::ResourceExt;
use kube::api::{Api, PostParams};
use kube::runtime::reflector::ObjectRef;
use std::time::Duration;

use tokio::time::Instant;
use tracing::{debug, info};

use crate::context::{Ctx, bounded};
use crate::error::Error;

/// Whether the attempt may be ended now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Revoked {
    /// Nothing can keep it alive any more (revoked now or before, or not
    /// renewed per worker): go on and end it.
    Done,
    /// Its holder renewed since what we saw, or its WorkerLease could not
    /// be read as it is: counted as a renewal now; decide again later.
    Renewed,
}

/// Revokes the attempt of `decided` (the lease the pass decided to end,
/// read from the cache or directly) on the WorkerLease of `holder`, whom
/// `revocation::revocation_holder` named.
///
/// `expiry`: the TTL when the attempt ends for want of renewals. Then the
/// timing is checked again against the copy the CAS is based on: the
/// decision was made on what had been observed before, and a renewal the
/// watch delivered since (it is credited before the cache stores it) must
/// stop the expiry, or the CAS would succeed on the very version that fed
/// the attempt's kill clock just now.
pub async fn revoke(
    ctx: &Ctx,
    decided: &TaskLease,
    holder: &str,
    expiry: Option<Duration>,
) -> Result<Revoked, Error> {
    let ns = decided.namespace().unwrap_or_default();
    // Until the WorkerLease watch has listed once, renewals may not have
    // been credited at all (a new leader): decide again shortly.
    if !ctx.workers.listed() {
        return Ok(Revoked::Renewed);
    }
    let name = worker_lease_name(holder);
    let attempt = AttemptRef::of(decided);
    let api: Api<WorkerLease> = Api::namespaced(ctx.client.clone(), &ns);
    let mut observed = match ctx.worker_leases.get(&ObjectRef::new(&name).within(&ns)) {
        Some(w) => Some((*w).clone()),
        // Not in the cache: created since (or never seen) — read it.
        None => read(ctx, &api, &name).await?,
    };
    // At most a few CASes: a conflict with another revocation (not a
    // renewal) is tried again on the fresh copy.
    for _ in 0..3 {
        let Some(mut w) = observed.take().filter(|w| w.worker() == Some(holder)) else {
            if ctx.workers.found_gone(&ns, &attempt, Instant::now()) {
                return Ok(Revoked::Done);
            }
            debug!(lease = %attempt.name, holder, "no WorkerLease of the holder: counting a renewal now, ending the attempt a TTL later");
            return Ok(renewed(ctx, &ns, &attempt));
        };
        let since_renewal = ctx
            .tracker
            .observation(&ns, &attempt.name)
            .map(|o| Instant::now().saturating_duration_since(o.last_renewal));
        match gate(
            w.is_revoked(&attempt),
            ctx.workers.observed(&w),
            expiry,
            since_renewal,
        ) {
            Gate::Done => return Ok(Revoked::Done),
            Gate::CountRenewal => return Ok(renewed(ctx, &ns, &attempt)),
            Gate::NotDue => {
                debug!(lease = %attempt.name, holder, "a renewal was credited since the decision: not revoking");
                return Ok(Revoked::Renewed);
            }
            Gate::Write => {}
        }
        let base = w.clone();
        w.revoke(attempt.clone());
        // Every other attempt of this holder that is due to expire goes in
        // the same write: they would each take one CAS on this object, and
        // all but one would conflict (a frozen worker's 100 attempts took
        // 20 s to end one by one).
        if expiry.is_some() {
            for (name, uid) in ctx.tracker.due_of_holder(&ns, holder, Instant::now()) {
                w.revoke(AttemptRef { name, uid });
            }
        }
        ctx.leadership.ensure()?;
        let written = bounded(ctx, "worker lease revoke", async {
            Ok(api.replace_status(&name, &PostParams::default(), &w).await)
        })
        .await?;
        match written {
            Ok(_) => {
                ctx.metrics.revocations.inc();
                info!(namespace = %ns, lease = %attempt.name, holder, worker_lease = %name, "attempt revoked on its holder's WorkerLease");
                return Ok(Revoked::Done);
            }
            // The object went after our copy: its deletion, once the watch
            // shows it, counts as a renewal then.
            Err(kube::Error::Api(s)) if s.code == 404 => {
                return Ok(renewed(ctx, &ns, &attempt));
            }
            // Someone wrote after our copy: a renewal (a new renewTime, or
            // another object) is one observed now; another revocation is
            // not, and the CAS is tried again on the fresh copy.
            Err(kube::Error::Api(s)) if s.code == 409 => {
                ctx.metrics.write_conflicts.inc();
                let fresh = read(ctx, &api, &name).await?;
                let same = fresh.as_ref().is_some_and(|f| {
                    f.uid() == base.uid() && f.spec.renew_time == base.spec.renew_time
                });
                if !same {
                    debug!(lease = %attempt.name, holder, "revocation lost to a renewal of the WorkerLease; not ending the attempt");
                    return Ok(renewed(ctx, &ns, &attempt));
                }
                observed = fresh;
            }
            Err(e) => return Err(crate::context::classify(ctx, e, "worker lease revoke")),
        }
    }
    Ok(Revoked::Renewed)
}

/// What to do with a copy of the WorkerLease before revoking on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gate {
    /// Revoked already: nothing can keep the attempt alive.
    Done,
    /// A copy the watch has not shown (read by us): it may carry a renewal
    /// nobody credited — count one observed now, end nothing.
    CountRenewal,
    /// Ending for want of renewals, but one was credited since the
    /// decision (the watch credits before the cache stores the version):
    /// a CAS on this copy could land on the very version that fed it.
    NotDue,
    /// Revoke on this copy.
    Write,
}

/// Pure: the gate before the revocation's CAS on a copy: whether the
/// attempt is revoked in it, whether the watch delivered (and credited)
/// it, the TTL when the end is an expiry, and the time since the renewal
/// last credited to the attempt.
fn gate(
    revoked: bool,
    observed: bool,
    expiry: Option<Duration>,
    since_renewal: Option<Duration>,
) -> Gate {
    if revoked {
        return Gate::Done;
    }
    if !observed {
        return Gate::CountRenewal;
    }
    match (expiry, since_renewal) {
        (Some(ttl), Some(since)) if since < ttl => Gate::NotDue,
        _ => Gate::Write,
    }
}

/// Counts a renewal of `attempt` observed now: the attempt is not ended.
fn renewed(ctx: &Ctx, ns: &str, attempt: &AttemptRef) -> Revoked {
    ctx.tracker.touch(ns, &attempt.name, Instant::now());
    Revoked::Renewed
}

async fn read(ctx: &Ctx, api: &Api<WorkerLease>, name: &str) -> Result<Option<WorkerLease>, Error> {
    bounded(ctx, "worker lease read", async {
        api.get_opt(name).await.map_err(|source| Error::Kube {
            what: "worker lease read",
            source,
        })
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gate_before_a_revocation() {
        let s = Duration::from_secs;
        let ttl = Some(s(30));
        for (why, revoked, observed, expiry, since, want) in [
            ("revoked before", true, false, ttl, Some(s(1)), Gate::Done),
            (
                "a copy we read",
                false,
                false,
                ttl,
                Some(s(40)),
                Gate::CountRenewal,
            ),
            (
                "renewed since the decision",
                false,
                true,
                ttl,
                Some(s(29)),
                Gate::NotDue,
            ),
            ("still due", false, true, ttl, Some(s(30)), Gate::Write),
            (
                "a cancel: not timed",
                false,
                true,
                None,
                Some(s(1)),
                Gate::Write,
            ),
            (
                "no record: the decision's own",
                false,
                true,
                ttl,
                None,
                Gate::Write,
            ),
        ] {
            assert_eq!(gate(revoked, observed, expiry, since), want, "{why}");
        }
    }
}
