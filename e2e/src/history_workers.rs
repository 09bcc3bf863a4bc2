//! The history checker's rules for renewals per worker (design,
//! "Fleets"): WorkerLease versions recorded from a watch, judged with the
//! TaskLease versions.
//!
//! Versions of different objects are ordered by `resourceVersion`: on this
//! control plane it is etcd's revision, one counter for every object, so
//! "the revocation landed before the expiry" can be checked across kinds.
//!
//! Checked:
//! - a worker's renewal (a version whose `spec.renewTime` differs from the
//!   object's previous one) never lists an attempt revoked in it: once the
//!   operator's revocation landed, no renewal may keep that attempt alive;
//! - an attempt renewed per worker that the operator ended (a `Held` lease
//!   seen next `Expired`, or `Released` with its holder) was revoked first
//!   in its holder's WorkerLease — unless, at the end, that WorkerLease had
//!   never listed the attempt or was gone. In a record with gaps (a watch
//!   error, then a relist: the versions between are never delivered), the
//!   version that revoked it may be one of those missed; there a later
//!   recorded version of that WorkerLease showing it revoked is accepted
//!   instead (the soak of 2026-12-04: revoked at 17:39:43.387 and expired
//!   at .393 by the audit log, the revocation's version lost in the
//!   relist after a kube-apiserver restart). An attempt never seen revoked
//!   is a violation either way.
//!
//! And for addressed offers (`check_addressed`):
//! - a claim of an offer addressed to a worker (`spec.offeredTo`) names
//!   that worker: the claimed version, which keeps the address the claim
//!   met, is addressed to its holder or to nobody;
//! - the address never changes once the lease is claimed (it may be
//!   dropped: an operator without the field rewrites the lease);
//! - an addressed offer carries the label its worker watches
//!   (`batchlease.dev/worker` = its WorkerLease's name), and an
//!   unaddressed one none.
//!
//! And for bound attempts (`check_bound`, a lease created `Held` with
//! `spec.boundAt`):
//! - it is held by the worker it is addressed to, renewed per worker;
//! - the `renewTime` it cites is one its holder's WorkerLease was first
//!   recorded with before the lease (by `resourceVersion`): the operator
//!   cites a renewal it had observed — and, when the record has no gap, one
//!   that was recorded at all.

use std::collections::BTreeMap;

use batchlease_api::keys::LABEL_WORKER;
use batchlease_api::worker_lease::worker_lease_name;
use batchlease_api::{AttemptRef, LeasePhase, TaskLease, WorkerLease};
use kube::ResourceExt;

use crate::history::{Change, Recorded};

fn rv(o: &impl ResourceExt) -> u64 {
    o.resource_version()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// One recorded WorkerLease version (or its deletion).
struct Version<'a> {
    rv: u64,
    gone: bool,
    w: &'a WorkerLease,
}

/// Every rule of the module docs over recorded WorkerLease and TaskLease
/// changes. `gap_free`: no watch of the record failed.
pub fn check_worker_leases(
    workers: &[Recorded],
    leases: &[Recorded],
    gap_free: bool,
) -> Vec<String> {
    let mut out = Vec::new();
    // name → versions in watch order.
    let mut by_name: BTreeMap<String, Vec<Version<'_>>> = BTreeMap::new();
    for r in workers {
        let (w, gone) = match &r.change {
            Change::Worker(w) => (w.as_ref(), false),
            Change::WorkerDeleted(w) => (w.as_ref(), true),
            _ => continue,
        };
        by_name
            .entry(w.name_any())
            .or_default()
            .push(Version { rv: rv(w), gone, w });
    }
    for (name, versions) in &by_name {
        for pair in versions.windows(2) {
            let (prev, next) = (&pair[0], &pair[1]);
            let renewal = !next.gone
                && prev.w.uid() == next.w.uid()
                && prev.w.spec.renew_time != next.w.spec.renew_time;
            if !renewal {
                continue;
            }
            for a in next.w.holds() {
                if next.w.is_revoked(a) {
                    out.push(format!(
                        "WorkerLease {name}: a renewal (resourceVersion {}) lists attempt {} that was revoked",
                        next.rv, a.name
                    ));
                }
            }
        }
    }
    // Ends of attempts renewed per worker, by the operator.
    let mut last: BTreeMap<String, &TaskLease> = BTreeMap::new();
    for r in leases {
        let Change::Lease(l) = &r.change else {
            continue;
        };
        let uid = l.uid().unwrap_or_default();
        let before = last.insert(uid, l.as_ref());
        let was_held = before
            .is_some_and(|b| b.status.as_ref().and_then(|s| s.phase) == Some(LeasePhase::Held));
        let phase = l.status.as_ref().and_then(|s| s.phase);
        let ended_by_operator = matches!(phase, Some(LeasePhase::Expired | LeasePhase::Released));
        if !(was_held && ended_by_operator && l.renewed_per_worker()) {
            continue;
        }
        let Some(holder) = l.spec.holder_identity.as_deref() else {
            continue;
        };
        let attempt = AttemptRef::of(l);
        let end = rv(l.as_ref());
        let Some(versions) = by_name.get(&worker_lease_name(holder)) else {
            continue;
        };
        let earlier: Vec<&Version<'_>> = versions.iter().filter(|v| v.rv < end).collect();
        let Some(at_end) = earlier.last() else {
            continue;
        };
        if at_end.gone {
            continue;
        }
        let uid = at_end.w.uid();
        let listed = earlier
            .iter()
            .any(|v| v.w.uid() == uid && v.w.holds().contains(&attempt));
        let revoked_later = || {
            versions
                .iter()
                .any(|v| v.rv > end && v.w.uid() == uid && v.w.is_revoked(&attempt))
        };
        if listed && !at_end.w.is_revoked(&attempt) && (gap_free || !revoked_later()) {
            out.push(format!(
                "lease {} of {holder} ended {:?} (resourceVersion {end}) while its WorkerLease (resourceVersion {}) listed it unrevoked",
                attempt.name, phase, at_end.rv
            ));
        }
    }
    out
}

/// The rules of addressed offers over recorded TaskLease changes (watch
/// order: each lease's versions in order).
pub fn check_addressed(leases: &[Recorded]) -> Vec<String> {
    let mut out = Vec::new();
    let mut last: BTreeMap<String, &TaskLease> = BTreeMap::new();
    for r in leases {
        let Change::Lease(l) = &r.change else {
            continue;
        };
        let name = l.name_any();
        let offered = l.status.as_ref().and_then(|s| s.phase) == Some(LeasePhase::Offered);
        if offered {
            let label = l.labels().get(LABEL_WORKER);
            let want = l.spec.offered_to.as_deref().map(worker_lease_name);
            if label != want.as_ref() {
                out.push(format!(
                    "lease {name} (resourceVersion {}): offered to {:?} but labelled {LABEL_WORKER}={label:?}",
                    rv(l.as_ref()),
                    l.spec.offered_to
                ));
            }
        }
        let Some(before) = last.insert(l.uid().unwrap_or_default(), l.as_ref()) else {
            continue;
        };
        let holder = l.spec.holder_identity.as_deref();
        let claim = before.spec.holder_identity.is_none() && holder.is_some();
        // Judged on the claimed version's own address: the CRD keeps the
        // claim from changing it, so it is the address the claim met. The
        // version recorded before it need not be: a watch that relisted
        // (an API server or etcd restart) skips versions, a re-address
        // among them (the soak found it so). A claim that dropped the
        // address is the CRD's to judge (rule B, checked by the model and
        // `addressed_offers.rs`), not this record's.
        if claim
            && let Some(to) = l.spec.offered_to.as_deref()
            && holder != Some(to)
        {
            out.push(format!(
                "lease {name}: claimed by {holder:?} (resourceVersion {}) while addressed to {to}",
                rv(l.as_ref())
            ));
        }
        if before.spec.holder_identity.is_some()
            && l.spec.offered_to.is_some()
            && before.spec.offered_to != l.spec.offered_to
        {
            out.push(format!(
                "lease {name}: addressed again after its claim (resourceVersion {}): {:?} → {:?}",
                rv(l.as_ref()),
                before.spec.offered_to,
                l.spec.offered_to
            ));
        }
    }
    out
}

/// The rules for bound attempts of the module docs. `gap_free`: the
/// record has no watch error (no version skipped), so a cited `renewTime`
/// never recorded is itself a violation.
pub fn check_bound(workers: &[Recorded], leases: &[Recorded], gap_free: bool) -> Vec<String> {
    // (WorkerLease name, renewTime) → the first resourceVersion recorded.
    let mut renewals: BTreeMap<(String, String), u64> = BTreeMap::new();
    for r in workers {
        let Change::Worker(w) = &r.change else {
            continue;
        };
        if let Some(t) = &w.spec.renew_time {
            let e = renewals
                .entry((w.name_any(), t.0.to_string()))
                .or_insert(u64::MAX);
            *e = (*e).min(rv(w.as_ref()));
        }
    }
    let mut out = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for r in leases {
        let Change::Lease(l) = &r.change else {
            continue;
        };
        let Some(at) = &l.spec.bound_at else {
            continue;
        };
        if !seen.insert(l.uid().unwrap_or_default()) {
            continue;
        }
        let name = l.name_any();
        let holder = l.spec.holder_identity.as_deref();
        if holder.is_none()
            || (l.spec.offered_to.is_some() && l.spec.offered_to.as_deref() != holder)
            || !l.renewed_per_worker()
        {
            out.push(format!(
                "lease {name}: bound (boundAt) but held by {holder:?}, addressed to {:?}, renewed {:?}",
                l.spec.offered_to, l.spec.renewal
            ));
            continue;
        }
        let key = (
            worker_lease_name(holder.unwrap_or_default()),
            at.0.to_string(),
        );
        match renewals.get(&key) {
            Some(first) if *first < rv(l.as_ref()) => {}
            Some(first) => out.push(format!(
                "lease {name} (resourceVersion {}): cites renewTime {} that {} first carried later (resourceVersion {first})",
                rv(l.as_ref()),
                key.1,
                key.0
            )),
            None if gap_free => out.push(format!(
                "lease {name}: cites renewTime {} that {} was never recorded with",
                key.1, key.0
            )),
            None => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use batchlease_api::{
        Renewal, TaskLeaseSpec, TaskLeaseStatus, WorkerLeaseSpec, WorkerLeaseStatus,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;

    fn at(s: i64) -> MicroTime {
        MicroTime(k8s_openapi::jiff::Timestamp::from_second(s).unwrap())
    }

    fn attempt() -> AttemptRef {
        AttemptRef {
            name: "t-1".into(),
            uid: "l1".into(),
        }
    }

    fn worker(rv: u64, renew: i64, holds: bool, revoked: bool) -> Recorded {
        let mut w = WorkerLease::new(
            &worker_lease_name("w/1"),
            WorkerLeaseSpec {
                holder_identity: "w/1".into(),
                queues: vec![],
                lease_duration_seconds: 30,
                renew_time: Some(at(renew)),
                holds: if holds { vec![attempt()] } else { vec![] },
                slots: None,
                takes_bound: None,
            },
        );
        w.metadata.uid = Some("w1".into());
        w.metadata.resource_version = Some(rv.to_string());
        w.status = Some(WorkerLeaseStatus {
            revoked: if revoked { vec![attempt()] } else { vec![] },
        });
        Recorded {
            at: 0.0,
            change: Change::Worker(Box::new(w)),
        }
    }

    fn lease(rv: u64, phase: LeasePhase) -> Recorded {
        let mut l = TaskLease::new("t-1", TaskLeaseSpec::offered("t", "u", "q", 1, 30));
        l.metadata.uid = Some("l1".into());
        l.metadata.resource_version = Some(rv.to_string());
        l.spec.holder_identity = Some("w/1".into());
        l.spec.renewal = Some(Renewal::Worker);
        l.status = Some(TaskLeaseStatus {
            phase: Some(phase),
            ..Default::default()
        });
        Recorded {
            at: 0.0,
            change: Change::Lease(Box::new(l)),
        }
    }

    #[test]
    fn what_the_rules_accept_and_refuse() {
        let held = lease(10, LeasePhase::Held);
        let ok = [
            worker(11, 1, true, false),
            worker(12, 2, true, false),
            // The revocation: holds unchanged, renewTime unchanged.
            worker(13, 2, true, true),
            // The worker's next renewal drops it.
            worker(15, 3, false, true),
        ];
        let leases = [held.clone(), lease(14, LeasePhase::Expired)];
        assert_eq!(
            check_worker_leases(&ok, &leases, true),
            Vec::<String>::new()
        );

        let renewed_revoked = [
            worker(11, 1, true, false),
            worker(13, 1, true, true),
            worker(15, 2, true, true),
        ];
        let v = check_worker_leases(&renewed_revoked, &[], true);
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(v[0].contains("lists attempt t-1 that was revoked"), "{v:?}");

        let not_revoked = [worker(11, 1, true, false), worker(12, 2, true, false)];
        let v = check_worker_leases(&not_revoked, &leases, true);
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(v[0].contains("listed it unrevoked"), "{v:?}");

        // Revoked only after the expiry: still a violation.
        let late = [worker(11, 1, true, false), worker(15, 1, true, true)];
        assert_eq!(check_worker_leases(&late, &leases, true).len(), 1);
        // With gaps the revocation before the end may have gone unrecorded:
        // seen revoked later, it is accepted; never seen revoked, it is not.
        assert!(check_worker_leases(&late, &leases, false).is_empty());
        assert_eq!(check_worker_leases(&not_revoked, &leases, false).len(), 1);

        // Never listed, or gone at the end: nothing to revoke on.
        let never = [worker(11, 1, false, false)];
        assert!(check_worker_leases(&never, &leases, true).is_empty());
        let mut gone = worker(12, 1, true, false);
        if let Change::Worker(w) = gone.change {
            gone.change = Change::WorkerDeleted(w);
        }
        assert!(check_worker_leases(&[worker(11, 1, true, false), gone], &leases, true).is_empty());

        // A completion by the holder needs no revocation.
        let completed = [held, lease(14, LeasePhase::Completed)];
        assert!(check_worker_leases(&not_revoked, &completed, true).is_empty());
    }

    fn offer(rv: u64, to: Option<&str>, label: Option<&str>, holder: Option<&str>) -> Recorded {
        let mut l = TaskLease::new("t-1", TaskLeaseSpec::offered("t", "u", "q", 1, 30));
        l.metadata.uid = Some("l1".into());
        l.metadata.resource_version = Some(rv.to_string());
        l.spec.offered_to = to.map(Into::into);
        if let Some(label) = label {
            l.labels_mut().insert(LABEL_WORKER.into(), label.into());
        }
        l.spec.holder_identity = holder.map(Into::into);
        l.status = Some(TaskLeaseStatus {
            phase: Some(if holder.is_some() {
                LeasePhase::Held
            } else {
                LeasePhase::Offered
            }),
            ..Default::default()
        });
        Recorded {
            at: 0.0,
            change: Change::Lease(Box::new(l)),
        }
    }

    #[test]
    fn what_the_address_rules_accept_and_refuse() {
        let a = worker_lease_name("a/1");
        let b = worker_lease_name("b/1");
        let ok = [
            offer(1, Some("a/1"), Some(&a), None),
            offer(2, Some("b/1"), Some(&b), None),
            offer(3, Some("b/1"), Some(&b), Some("b/1")),
        ];
        assert_eq!(check_addressed(&ok), Vec::<String>::new());
        let open = [
            offer(1, None, None, None),
            offer(2, None, None, Some("c/1")),
        ];
        assert_eq!(check_addressed(&open), Vec::<String>::new());

        let stolen = [
            offer(1, Some("a/1"), Some(&a), None),
            offer(2, Some("a/1"), Some(&a), Some("c/1")),
        ];
        let v = check_addressed(&stolen);
        assert!(
            v.len() == 1 && v[0].contains("while addressed to a/1"),
            "{v:?}"
        );
        // A re-address the record skipped (a relist): the claim met the
        // address it carries.
        let skipped = [
            offer(1, Some("a/1"), Some(&a), None),
            offer(3, Some("b/1"), Some(&b), Some("b/1")),
        ];
        assert_eq!(check_addressed(&skipped), Vec::<String>::new());

        let moved = [
            offer(1, Some("a/1"), Some(&a), Some("a/1")),
            offer(2, Some("b/1"), Some(&b), Some("a/1")),
        ];
        let v = check_addressed(&moved);
        assert!(v.len() == 1 && v[0].contains("after its claim"), "{v:?}");
        // Dropped after the claim (an older operator's expiry): allowed.
        let mut dropped = offer(2, None, Some(&a), Some("a/1"));
        if let Change::Lease(l) = &mut dropped.change {
            l.status.get_or_insert_with(Default::default).phase = Some(LeasePhase::Expired);
        }
        assert!(
            check_addressed(&[
                ok[0].clone(),
                offer(2, Some("a/1"), Some(&a), Some("a/1")),
                dropped
            ])
            .is_empty()
        );

        let unlabelled = [
            offer(1, Some("a/1"), None, None),
            offer(2, None, Some(&a), None),
        ];
        let v = check_addressed(&unlabelled);
        assert_eq!(v.len(), 2, "{v:?}");
    }

    #[test]
    fn a_bound_lease_cites_a_renewal_its_holder_made_before_it() {
        let bound = |rv: u64, cites: i64, to: &str| {
            let mut r = lease(rv, LeasePhase::Held);
            if let Change::Lease(l) = &mut r.change {
                l.spec.bound_at = Some(at(cites));
                l.spec.offered_to = Some(to.into());
            }
            r
        };
        let workers = [worker(5, 1, false, false), worker(7, 2, false, false)];
        let ok = [bound(8, 2, "w/1"), lease(9, LeasePhase::Completed)];
        assert_eq!(check_bound(&workers, &ok, true), Vec::<String>::new());
        // A renewal recorded only after the lease.
        let v = check_bound(&workers, &[bound(6, 2, "w/1")], true);
        assert!(v.len() == 1 && v[0].contains("later"), "{v:?}");
        // A renewal never recorded: a violation only without gaps.
        assert_eq!(check_bound(&workers, &[bound(8, 3, "w/1")], true).len(), 1);
        assert!(check_bound(&workers, &[bound(8, 3, "w/1")], false).is_empty());
        // Held by another worker than its address.
        let v = check_bound(&workers, &[bound(8, 2, "w/2")], true);
        assert!(v.len() == 1 && v[0].contains("addressed to"), "{v:?}");
        // Claimed leases are not judged here.
        assert!(check_bound(&[], &[lease(8, LeasePhase::Held)], true).is_empty());
    }
}
