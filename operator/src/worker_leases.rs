//! Renewals per worker (issue 27): when does a renewal of a worker's
//! Lease count as a renewal of one of its TaskLeases?
//!
//! A WorkerLease lists the attempts its worker keeps alive
//! (`spec.holds`, see `batchlease_api::worker_lease`); the SDK
//! feeds each attempt's kill clock only from renewals that listed it, and
//! lists an attempt from the first renewal after its claim until it has
//! stopped, never again after. The operator times expiry by what it
//! *observes*, as for per-lease renewals (`observe::next_seen`): a change
//! of the worker Lease's `renewTime` seen at `now` is a renewal at `now` —
//! never the written value.
//!
//! **The rule**: a renewal of worker `H`'s Lease counts for every TaskLease
//! still `Held` by `H` — except an attempt the operator has seen that Lease
//! list and, at a later observation, no longer list: that one's listing is
//! over, and renewals after the observation that showed it ended are not
//! credited to it (the observation that shows the end still is).
//!
//! Why not "the renewals that name it": the operator's view skips
//! versions (a relist after a watch outage, a cache that catches up in
//! one step), and a version it never saw may have listed an attempt and
//! fed its kill clock. The model checker found it (`docs/model.md`,
//! "Renewals per worker"): a worker Lease first seen at the renewal that
//! dropped a still-running attempt credited nothing, and the attempt,
//! kept alive by the versions in between, wrote after its expiry.
//! Crediting more than the worker renewed only delays an expiry. The cost:
//! an attempt whose listing the operator never saw is kept alive while its
//! worker renews — bounded by the SDK's rule (listed within T/3 of the
//! claim, seen by a watch that does not skip).
//!
//! Not credited: a renewal observed before the TaskLease's claim was, a
//! TaskLease no longer `Held` by that worker (a zombie's late write naming
//! an expired attempt renews nothing; the expired lease is frozen), one
//! claimed to be renewed per lease (`spec.renewal` not `Worker`), another
//! worker's or namespace's lease. A deletion of the WorkerLease counts as a
//! renewal observed then if its last state carries a `renewTime` not seen
//! before (the watch delivers every change before the deletion), and a
//! relist that no longer lists it as one observed at the relist: renewals
//! may have landed unseen, and whoever deleted it, the attempts they fed
//! run until their kill switch.
//!
//! Observing alone does not make expiry safe with a lagging cache: the
//! TaskLease's expiry CAS does not conflict with a renewal of another
//! object. The operator revokes the attempt in the WorkerLease by a CAS on
//! the copy it observed before it expires or releases the TaskLease
//! (`effects::revoke`).

use std::collections::BTreeSet;

use batchlease_api::{AttemptRef, LeasePhase, TaskLease, WorkerLease};
use kube::ResourceExt;
use tokio::time::Instant;

use crate::observe::Seen;

/// The last state seen of one WorkerLease.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct WorkerSeen {
    uid: String,
    holder: String,
    renew_marker: Option<String>,
    holds: BTreeSet<AttemptRef>,
    /// Attempts seen listed by this object and, later, no longer listed.
    ended: BTreeSet<AttemptRef>,
}

impl WorkerSeen {
    /// The worker's identity.
    pub fn holder(&self) -> &str {
        &self.holder
    }

    /// The attempts the last observed version listed.
    pub fn holds(&self) -> &BTreeSet<AttemptRef> {
        &self.holds
    }

    /// Attempts whose listing was seen to end (a tracker forgets them with
    /// their TaskLease).
    pub fn ended(&self) -> &BTreeSet<AttemptRef> {
        &self.ended
    }

    /// The UID of the object the record is of.
    pub fn uid(&self) -> &str {
        &self.uid
    }

    /// The renewal that the deletion of this object, with last state
    /// `last` (`None`: unknown — it left a relist), shows at `now`: one if
    /// a renewal may have landed after the last one seen.
    pub fn departure(&self, last: Option<&WorkerLease>, namespace: Option<String>, now: Instant) -> Option<Renewal> {
        let renewed = last.is_none_or(|l| renew_marker(l) != self.renew_marker);
        renewed.then(|| Renewal {
            holder: self.holder.clone(),
            namespace,
            names: last.map(|l| l.holds().iter().cloned().collect()).unwrap_or_default(),
            ended: self.ended.clone(),
            at: now,
        })
    }
}

/// `renewTime` as a marker, compared for equality only: the value is the
/// worker's clock.
fn renew_marker(w: &WorkerLease) -> Option<String> {
    w.spec.renew_time.as_ref().map(|t| t.0.to_string())
}

/// A renewal of a WorkerLease, observed at `at`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Renewal {
    pub holder: String,
    /// The namespace of the WorkerLease, whose TaskLeases it keeps alive.
    pub namespace: Option<String>,
    /// The attempts the observed version lists (informational: the rule
    /// credits every held lease of the holder but `ended`).
    pub names: BTreeSet<AttemptRef>,
    /// Attempts not credited: their listing was seen to end at an earlier
    /// observation.
    pub ended: BTreeSet<AttemptRef>,
    pub at: Instant,
}

/// What one observation of a WorkerLease gives: the new record, and the
/// renewal observed, if any.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerObservation {
    pub seen: WorkerSeen,
    pub renewal: Option<Renewal>,
}

/// Pure: the record of WorkerLease `lease` seen at `now`, given the
/// previous one, and the renewal observed now, if any (a new `renewTime`,
/// or a first sight of the object). `None` when `lease` is not well formed
/// (`WorkerLease::worker`).
pub fn next_worker_seen(
    prev: Option<&WorkerSeen>,
    lease: &WorkerLease,
    now: Instant,
) -> Option<WorkerObservation> {
    let holder = lease.worker()?.to_owned();
    let uid = lease.uid().unwrap_or_default();
    let renew_marker = renew_marker(lease);
    let holds: BTreeSet<AttemptRef> = lease.holds().iter().cloned().collect();
    // Another object under the name (deleted and created again) starts
    // afresh: its worker lists what still runs.
    let same_object = prev.filter(|p| p.uid == uid && p.holder == holder);
    let ended_before = same_object.map(|p| p.ended.clone()).unwrap_or_default();
    let mut ended = ended_before.clone();
    if let Some(p) = same_object {
        ended.extend(p.holds.difference(&holds).cloned());
    }
    let renewed = same_object.is_none_or(|p| p.renew_marker != renew_marker);
    let renewal = renewed.then(|| Renewal {
        holder: holder.clone(),
        namespace: lease.metadata.namespace.clone(),
        names: holds.clone(),
        ended: ended_before,
        at: now,
    });
    Some(WorkerObservation {
        seen: WorkerSeen {
            uid,
            holder,
            renew_marker,
            holds,
            ended,
        },
        renewal,
    })
}

/// Pure: the record `seen` of TaskLease `lease` (from `observe::next_seen`
/// on this very copy) with `renewal` credited to it — its last renewal
/// becomes the renewal's instant — when the rule says so (see the
/// module); otherwise `seen` unchanged.
pub fn credit(seen: &Seen, lease: &TaskLease, renewal: &Renewal) -> Seen {
    let held = lease.status.as_ref().and_then(|s| s.phase) == Some(LeasePhase::Held);
    let holder = lease.spec.holder_identity.as_deref();
    let over = renewal.ended.contains(&AttemptRef::of(lease));
    let credited = held
        && lease.renewed_per_worker()
        && !over
        && holder == Some(renewal.holder.as_str())
        && seen.holder() == renewal.holder
        && seen.uid() == lease.uid().unwrap_or_default()
        && lease.metadata.namespace == renewal.namespace
        // Observed before the claim was: it says nothing of this attempt.
        && renewal.at >= seen.observation.claimed_at;
    let mut out = seen.clone();
    if credited {
        out.observation.last_renewal = out.observation.last_renewal.max(renewal.at);
    }
    out
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::observe::{Observation, next_seen};
    use batchlease_api::worker_lease::worker_lease_name;
    use batchlease_api::{Renewal as Mode, TaskLeaseSpec, TaskLeaseStatus, WorkerLeaseSpec};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;

    fn micro(second: i64) -> MicroTime {
        MicroTime(k8s_openapi::jiff::Timestamp::from_second(second).unwrap())
    }

    fn worker(holder: &str, uid: &str, renew: i64, holds: &str) -> WorkerLease {
        let mut l = WorkerLease::new(
            &worker_lease_name(holder),
            WorkerLeaseSpec {
                holder_identity: holder.into(),
                queues: vec![],
                lease_duration_seconds: 30,
                renew_time: Some(micro(renew)),
                holds: names(&holds.split(',').filter(|n| !n.is_empty()).collect::<Vec<_>>())
                    .into_iter()
                    .collect(),
            },
        );
        l.metadata.namespace = Some("ns".into());
        l.metadata.uid = Some(uid.into());
        l
    }

    fn task_lease(name: &str, holder: &str, phase: LeasePhase) -> TaskLease {
        let mut l = TaskLease::new(name, TaskLeaseSpec::offered("t", "task", "q", 1, 30));
        l.metadata.namespace = Some("ns".into());
        l.metadata.uid = Some(format!("uid-{name}"));
        l.spec.holder_identity = Some(holder.into());
        l.spec.renew_time = Some(micro(100));
        l.spec.renewal = Some(Mode::Worker);
        l.status = Some(TaskLeaseStatus {
            phase: Some(phase),
            ..Default::default()
        });
        l
    }

    /// Attempts by name, of `task_lease`'s UIDs.
    fn names(v: &[&str]) -> BTreeSet<AttemptRef> {
        v.iter()
            .map(|s| AttemptRef {
                name: (*s).to_owned(),
                uid: format!("uid-{s}"),
            })
            .collect()
    }

    #[test]
    fn worker_lease_observations() {
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_secs(3);
        let v1 = worker("w1", "u1", 10, "t-1,t-2");
        // First sight: a renewal now; nothing ended yet.
        let first = next_worker_seen(None, &v1, t0).unwrap();
        let r = first.renewal.clone().unwrap();
        assert_eq!(
            (r.holder.as_str(), &r.names, r.at),
            ("w1", &names(&["t-1", "t-2"]), t0)
        );
        assert!(r.ended.is_empty());
        // Seen again unchanged (a relist, a revocation): no renewal.
        assert_eq!(
            next_worker_seen(Some(&first.seen), &v1, t1)
                .unwrap()
                .renewal,
            None
        );
        // A new renewTime, even an older clock value: a renewal at t1. It
        // no longer lists t-1: t-1's listing is over from now on, but this
        // observation still counts for it (versions skipped in between may
        // have listed it).
        let v2 = worker("w1", "u1", 5, "t-2");
        let got = next_worker_seen(Some(&first.seen), &v2, t1).unwrap();
        assert!(got.renewal.clone().unwrap().ended.is_empty());
        assert_eq!(got.seen.ended(), &names(&["t-1"]));
        // The next one does not count for t-1 any more.
        let v3 = worker("w1", "u1", 6, "t-2");
        let next = next_worker_seen(Some(&got.seen), &v3, t1).unwrap();
        assert_eq!(next.renewal.unwrap().ended, names(&["t-1"]));
        // Created again after a deletion (another UID): a first sight, and
        // the old object's ended listings are not carried over.
        let again = worker("w1", "u2", 6, "");
        let got = next_worker_seen(Some(&next.seen), &again, t1).unwrap();
        assert!(got.renewal.unwrap().ended.is_empty());
        // Not named for its holder: no record.
        let mut misnamed = v1.clone();
        misnamed.metadata.name = Some("other".into());
        assert!(next_worker_seen(None, &misnamed, t0).is_none());
    }

    #[test]
    fn credit_table() {
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_secs(4);
        let held = task_lease("t-1", "w1", LeasePhase::Held);
        let seen = next_seen(None, &held, t0).unwrap();
        let renewal = |holder: &str, listed: &[&str], ended: &[&str], at: Instant| Renewal {
            holder: holder.into(),
            namespace: Some("ns".into()),
            names: names(listed),
            ended: names(ended),
            at,
        };
        let credited = |r: &Renewal, l: &TaskLease| credit(&seen, l, r).observation;
        let untouched = seen.observation;
        let renewed = Observation {
            last_renewal: t1,
            claimed_at: t0,
        };
        for (why, r) in [
            ("listed", renewal("w1", &["t-1"], &[], t1)),
            // Versions the operator never saw may have listed it.
            (
                "not listed, listing never seen",
                renewal("w1", &[], &[], t1),
            ),
            ("another's listing ended", renewal("w1", &[], &["t-2"], t1)),
        ] {
            assert_eq!(credited(&r, &held), renewed, "{why}");
        }
        for (why, r, l) in [
            (
                "its listing was seen to end",
                renewal("w1", &[], &["t-1"], t1),
                held.clone(),
            ),
            (
                "another worker",
                renewal("w2", &["t-1"], &[], t1),
                held.clone(),
            ),
            (
                "observed before the claim was",
                renewal("w1", &["t-1"], &[], t0 - Duration::from_secs(1)),
                held.clone(),
            ),
            (
                "expired: a zombie's write",
                renewal("w1", &["t-1"], &[], t1),
                task_lease("t-1", "w1", LeasePhase::Expired),
            ),
            (
                "completed",
                renewal("w1", &["t-1"], &[], t1),
                task_lease("t-1", "w1", LeasePhase::Completed),
            ),
            ("renewed per lease", renewal("w1", &["t-1"], &[], t1), {
                let mut l = held.clone();
                l.spec.renewal = Some(Mode::Lease);
                l
            }),
        ] {
            assert_eq!(credited(&r, &l), untouched, "{why}");
        }
        let listed = renewal("w1", &["t-1"], &[], t1);
        let mut elsewhere = held.clone();
        elsewhere.metadata.namespace = Some("other".into());
        assert_eq!(
            credited(&listed, &elsewhere),
            untouched,
            "another namespace"
        );
        // The record of another incarnation of the name: not this one's.
        let mut other = held.clone();
        other.metadata.uid = Some("uid-again".into());
        assert_eq!(credited(&listed, &other), untouched, "another object");
        // Never moves the last renewal back.
        let later = credit(&seen, &held, &listed);
        let earlier = renewal("w1", &["t-1"], &[], t0);
        assert_eq!(credit(&later, &held, &earlier).observation, renewed);
    }

    /// The rule end to end, as a tracker would apply it: a TaskLease whose
    /// holder renews only its worker Lease, then drops it.
    #[test]
    fn a_lease_kept_alive_by_its_workers_renewals() {
        let t = |s: u64| Instant::now() + Duration::from_secs(s);
        let (t0, t10, t20, t30) = (t(0), t(10), t(20), t(30));
        let held = task_lease("t-1", "w1", LeasePhase::Held);
        let mut seen = next_seen(None, &held, t0).unwrap();
        let mut ws = next_worker_seen(None, &worker("w1", "u1", 1, "t-1"), t0)
            .unwrap()
            .seen;
        for (at, renew, holds) in [(t10, 2, "t-1"), (t20, 3, "")] {
            let o = next_worker_seen(Some(&ws), &worker("w1", "u1", renew, holds), at).unwrap();
            seen = credit(&seen, &held, &o.renewal.unwrap());
            ws = o.seen;
        }
        // Dropped at t20: credited then, not after.
        assert_eq!(seen.observation.last_renewal, t20);
        let o = next_worker_seen(Some(&ws), &worker("w1", "u1", 4, ""), t30).unwrap();
        seen = credit(&seen, &held, &o.renewal.unwrap());
        assert_eq!(seen.observation.last_renewal, t20);
        // The TaskLease's own renewTime still counts (an older worker, a
        // checkpoint): next_seen is unchanged for it.
        let mut own = held.clone();
        own.spec.renew_time = Some(micro(101));
        assert_eq!(
            next_seen(Some(&seen), &own, t30)
                .unwrap()
                .observation
                .last_renewal,
            t30
        );
        // The deletion of a WorkerLease whose last state was seen renews
        // nothing; one that carries a renewal not seen, or a departure
        // from a relist (last state unknown), is a renewal observed then.
        let t40 = t(40);
        let last = worker("w1", "u1", 4, "");
        let o = next_worker_seen(Some(&ws), &last, t30).unwrap().seen;
        assert_eq!(o.departure(Some(&last), Some("ns".into()), t40), None);
        let unseen = worker("w1", "u1", 5, "t-1");
        let r = o.departure(Some(&unseen), Some("ns".into()), t40).unwrap();
        assert_eq!((r.at, r.ended.clone()), (t40, names(&["t-1"])));
        assert!(o.departure(None, Some("ns".into()), t40).is_some());
    }
}
