//! Which attempt the operator revokes on its holder's WorkerLease before
//! it ends the attempt itself (issue 39): one pure rule, called by the
//! reconciler's effects (`effects::release`, `effects::expire`) and by the
//! model checker's operator (`Cluster::fleet_guard`).

use batchlease_api::{LeasePhase, TaskLease};
use kube::ResourceExt;

/// Pure: whose WorkerLease must revoke the attempt of `decided` before the
/// operator ends it on its own (an expiry, a cancel's or a pause's
/// release); `None` when nothing renews it per worker.
///
/// `decided` is the copy the pass decided on, its phase already the one
/// it is about to write; `cached` is the lease cache's copy of the same
/// name, if any. The rule follows the decided copy, never the cache alone:
/// the pass may have decided on a lease it read directly (a lagging lease
/// watch, a new leader whose task list is newer than its lease list, a
/// lookup after a late create), and then the cache holds an older object
/// or none. Ending such an attempt without its revocation left its holder
/// naming it in every renewal — its kill clock and its storage deadline
/// fed — until its next TaskLease write, up to max(TTL, 120 s) later: a
/// cancelled task could commit about 90 s after it showed Cancelled at a
/// TTL of 30 s. Only a cached copy of the same object that its holder
/// completed, or that is expired already, shows that nothing renews the
/// attempt any more (the pass's own write will meet a conflict).
pub fn revocation_holder<'a>(
    decided: &'a TaskLease,
    cached: Option<&TaskLease>,
) -> Option<&'a str> {
    let ended = cached.is_some_and(|c| {
        c.uid() == decided.uid()
            && matches!(
                c.status.as_ref().and_then(|s| s.phase),
                Some(LeasePhase::Completed | LeasePhase::Expired)
            )
    });
    if ended || !decided.renewed_per_worker() {
        return None;
    }
    decided
        .spec
        .holder_identity
        .as_deref()
        .filter(|h| !h.is_empty())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use batchlease_api::{Renewal as Mode, TaskLeaseSpec, TaskLeaseStatus};

    fn task_lease(name: &str, holder: &str, phase: LeasePhase) -> TaskLease {
        let mut l = TaskLease::new(name, TaskLeaseSpec::offered("t", "task", "q", 1, 30));
        l.metadata.namespace = Some("ns".into());
        l.metadata.uid = Some(format!("uid-{name}"));
        l.spec.holder_identity = Some(holder.into());
        l.spec.renewal = Some(Mode::Worker);
        l.status = Some(TaskLeaseStatus {
            phase: Some(phase),
            ..Default::default()
        });
        l
    }

    /// Issue 39, defect 1: a cancel decided on a lease read directly (the
    /// cache lags, or holds nothing yet) released it without revoking the
    /// attempt on its holder's WorkerLease. The rule follows the decided copy.
    #[test]
    fn the_attempt_to_revoke_follows_the_decided_lease_not_the_cache() {
        let released = |mut l: TaskLease| {
            l.status.get_or_insert_with(Default::default).phase = Some(LeasePhase::Released);
            l
        };
        let held = task_lease("t-1", "pod/1", LeasePhase::Held);
        let decided = released(held.clone());
        let mut per_lease = decided.clone();
        per_lease.spec.renewal = Some(Mode::Lease);
        let mut unclaimed = released(task_lease("t-1", "", LeasePhase::Offered));
        unclaimed.spec.holder_identity = None;
        let mut other_object = held.clone();
        other_object.metadata.uid = Some("uid-older".into());
        let mut completed = task_lease("t-1", "pod/1", LeasePhase::Completed);
        completed.spec.renewal = Some(Mode::Worker);
        let expired = task_lease("t-1", "pod/1", LeasePhase::Expired);
        for (why, decided, cached, want) in [
            (
                "the cache shows it held",
                &decided,
                Some(&held),
                Some("pod/1"),
            ),
            // The defect: read directly, no copy cached.
            (
                "not in the cache (read directly)",
                &decided,
                None,
                Some("pod/1"),
            ),
            (
                "the cache holds an older object of the name",
                &decided,
                Some(&other_object),
                Some("pod/1"),
            ),
            (
                "the cache shows it released already (its holder may run on)",
                &decided,
                Some(&decided),
                Some("pod/1"),
            ),
            ("its holder completed it", &decided, Some(&completed), None),
            ("expired already", &decided, Some(&expired), None),
            ("renewed per lease", &per_lease, None, None),
            ("never claimed", &unclaimed, None, None),
        ] {
            assert_eq!(revocation_holder(decided, cached), want, "{why}");
        }
    }
}
