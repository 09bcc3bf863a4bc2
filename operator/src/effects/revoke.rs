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
use batchlease_api::{AttemptRef, LeasePhase, TaskLease, WorkerLease};
use kube::ResourceExt;
use kube::api::{Api, PostParams};
use kube::runtime::reflector::ObjectRef;
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

/// Pure: whether ending `lease` needs a revocation first: held (or the
/// copy we end was held), claimed to be renewed per worker, with a holder.
pub fn needs_revocation(lease: &TaskLease) -> Option<&str> {
    let held = lease.status.as_ref().and_then(|s| s.phase) == Some(LeasePhase::Held);
    (held && lease.renewed_per_worker())
        .then_some(lease.spec.holder_identity.as_deref())
        .flatten()
        .filter(|h| !h.is_empty())
}

/// Revokes `cached`'s attempt (the lease as the cache shows it, still
/// held) on its holder's WorkerLease, if it is renewed per worker.
pub async fn revoke(ctx: &Ctx, cached: &TaskLease) -> Result<Revoked, Error> {
    let Some(holder) = needs_revocation(cached) else {
        return Ok(Revoked::Done);
    };
    let ns = cached.namespace().unwrap_or_default();
    let name = worker_lease_name(holder);
    let attempt = AttemptRef::of(cached);
    let api: Api<WorkerLease> = Api::namespaced(ctx.client.clone(), &ns);
    let observed = match ctx.worker_leases.get(&ObjectRef::new(&name).within(&ns)) {
        Some(w) => Some((*w).clone()),
        // Not in the cache: created since (or never seen) — read it.
        None => {
            bounded(ctx, "worker lease read", async {
                api.get_opt(&name).await.map_err(|source| Error::Kube {
                    what: "worker lease read",
                    source,
                })
            })
            .await?
        }
    };
    let Some(mut w) = observed.filter(|w| w.worker() == Some(holder)) else {
        if ctx.workers.found_gone(&ns, &attempt, Instant::now()) {
            return Ok(Revoked::Done);
        }
        debug!(lease = %attempt.name, holder, "no WorkerLease of the holder: counting a renewal now, ending the attempt a TTL later");
        ctx.tracker.touch(&ns, &attempt.name, Instant::now());
        return Ok(Revoked::Renewed);
    };
    if w.is_revoked(&attempt) {
        return Ok(Revoked::Done);
    }
    w.revoke(attempt.clone());
    ctx.leadership.ensure()?;
    let written = bounded(ctx, "worker lease revoke", async {
        Ok(api.replace_status(&name, &PostParams::default(), &w).await)
    })
    .await?;
    match written {
        Ok(_) => {
            ctx.metrics.revocations.inc();
            info!(namespace = %ns, lease = %attempt.name, holder, worker_lease = %name, "attempt revoked on its holder's WorkerLease");
            Ok(Revoked::Done)
        }
        // 409: the holder renewed after our copy (a renewal observed now);
        // 404: the object went after our copy (its deletion, once the
        // watch shows it, counts as a renewal then).
        Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => {
            ctx.metrics.write_conflicts.inc();
            ctx.tracker.touch(&ns, &attempt.name, Instant::now());
            debug!(lease = %attempt.name, holder, code = s.code, "revocation lost to a renewal of the WorkerLease; not ending the attempt");
            Ok(Revoked::Renewed)
        }
        Err(e) => Err(crate::context::classify(ctx, e, "worker lease revoke")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use batchlease_api::{Renewal, TaskLeaseSpec, TaskLeaseStatus};

    fn lease(phase: LeasePhase, holder: Option<&str>, renewal: Option<Renewal>) -> TaskLease {
        let mut l = TaskLease::new("t-1", TaskLeaseSpec::offered("t", "u", "q", 1, 30));
        l.spec.holder_identity = holder.map(Into::into);
        l.spec.renewal = renewal;
        l.status = Some(TaskLeaseStatus {
            phase: Some(phase),
            ..Default::default()
        });
        l
    }

    #[test]
    fn which_ends_need_a_revocation() {
        let w = Some(Renewal::Worker);
        assert_eq!(
            needs_revocation(&lease(LeasePhase::Held, Some("p/1"), w)),
            Some("p/1")
        );
        for (why, l) in [
            (
                "renewed per lease",
                lease(LeasePhase::Held, Some("p/1"), Some(Renewal::Lease)),
            ),
            (
                "an older operator's offer",
                lease(LeasePhase::Held, Some("p/1"), None),
            ),
            (
                "offered",
                lease(LeasePhase::Offered, None, Some(Renewal::Lease)),
            ),
            (
                "already completed",
                lease(LeasePhase::Completed, Some("p/1"), w),
            ),
            (
                "already released",
                lease(LeasePhase::Released, Some("p/1"), w),
            ),
            ("no holder", lease(LeasePhase::Held, Some(""), w)),
        ] {
            assert_eq!(needs_revocation(&l), None, "{why}");
        }
    }
}
