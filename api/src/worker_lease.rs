//! `WorkerLease`: renewals per worker (issue 27, design "Fleets").
//!
//! One object per worker process, in the namespace of its tasks, named for
//! its identity ([`worker_lease_name`]). Its renewals keep alive the
//! attempts it lists in `spec.holds`, instead of one renewal per TaskLease:
//! a fleet's renewal writes grow with its workers, not with its tasks.
//!
//! Why a kind of our own, written by both sides: the holder's renewals and
//! the operator's end of an attempt must be compare-and-swaps on one
//! object, or an expiry could land after a renewal the holder counted and
//! never tell it. The operator ends an attempt kept alive here by first
//! adding it to `status.revoked` — a CAS on the copy it observed — so a
//! renewal that landed unseen makes that write fail (and counts as a
//! renewal then), and every renewal after it fails and finds the attempt
//! revoked. `status` is a subresource: the worker's writes cannot touch it,
//! and the operator's need only `workerleases/status`.
//!
//! Pure helpers shared by the operator (which credits a renewal and
//! revokes) and the SDK (which lists and stops what was revoked).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::{CustomResource, KubeSchema, ResourceExt};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::TaskLease;

/// Most attempts one WorkerLease may list: the SDK refuses claims past it.
/// 256, so the API server can hold the revocation rules (CEL, costed by
/// the largest lists the schema allows: `holds` 256, `status.revoked`
/// 512) on every write.
pub const MAX_HOLDS: usize = 256;

/// Most attempts `status.revoked` keeps: every one its worker may list
/// ([`MAX_HOLDS`]) and as many more it no longer lists.
pub const MAX_REVOKED: usize = 2 * MAX_HOLDS;

/// The renewals of one worker process, keeping its attempts alive.
// Printer columns repeat `type_ = "string"`, which the lint takes for a
// repeated attribute.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "batchlease.dev",
    version = "v1alpha1",
    kind = "WorkerLease",
    namespaced,
    status = "WorkerLeaseStatus",
    shortname = "wl",
    category = "batchlease",
    derive = "PartialEq",
    doc = "The renewals of one worker process: each keeps alive the attempts (TaskLeases) it lists in spec.holds. Written by its worker; status.revoked only by the operator.",
    printcolumn(name = "Holder", type_ = "string", json_path = ".spec.holderIdentity"),
    printcolumn(name = "Queues", type_ = "string", json_path = ".spec.queues"),
    printcolumn(
        name = "TTL",
        type_ = "integer",
        json_path = ".spec.leaseDurationSeconds"
    ),
    printcolumn(name = "Renewed", type_ = "string", json_path = ".spec.renewTime"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    // The two rules revocation rests on (docs/protocol.md, WorkerLeases),
    // held by the API server for every writer, not only the Rust SDK.
    // On the root: each compares spec with status, and a rule on a field
    // does not run when a writer drops it. An attempt is matched by its
    // UID alone (unique in a cluster; the name adds nothing but cost).
    //
    // A renewal (any write of spec) never names an attempt the operator
    // revoked: the operator's CAS on this object is what ends an attempt
    // renewed here, and a write that listed it again would feed the kill
    // clock of an attempt already ended. (A status write leaves spec as it
    // was: the operator revokes what the worker lists.)
    validation = Rule::new(
        "self.spec == oldSelf.spec || !has(self.status) || !has(self.status.revoked) || !has(self.spec.holds) || self.spec.holds.all(h, !self.status.revoked.exists(r, r.uid == h.uid))"
    )
    .message("spec.holds names an attempt in status.revoked: the operator ended it; stop it and leave it out")
    .field_path(".spec.holds")
    .reason(Reason::FieldValueForbidden),
    // status.revoked only grows, but for the oldest entries the worker no
    // longer lists (`WorkerLease::revoke` keeps it bounded): an entry that
    // left while listed would let the next renewal name it again.
    validation = Rule::new(
        "!has(oldSelf.status) || !has(oldSelf.status.revoked) || oldSelf.status.revoked.all(r, (has(self.status) && has(self.status.revoked) && self.status.revoked.exists(n, n.uid == r.uid)) || !has(self.spec.holds) || !self.spec.holds.exists(h, h.uid == r.uid))"
    )
    .message("status.revoked lost an attempt spec.holds still names: a revocation is never taken back")
    .field_path(".status.revoked")
    .reason(Reason::FieldValueForbidden),
)]
#[serde(rename_all = "camelCase")]
pub struct WorkerLeaseSpec {
    /// The worker process (`<pod>/<suffix>`). Immutable: the object is the
    /// renewals of one process, and the operator finds it by this name.
    #[schemars(length(min = 1, max = 253))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("holderIdentity is immutable"))]
    pub holder_identity: String,
    /// The queues the worker serves (for `TaskQueue.status.workers`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub queues: Vec<String>,
    /// How long a renewal counts, in seconds: the longest TTL of the
    /// attempts it lists, or the worker's idle period. Informational: each
    /// attempt expires by its own TaskLease's TTL.
    #[x_kube(validation = Rule::new("self >= 5 && self <= 3600").message("leaseDurationSeconds must be between 5 and 3600"))]
    pub lease_duration_seconds: i32,
    /// When the worker last renewed (its clock, informational: the operator
    /// times renewals by when it observes a change of this field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub renew_time: Option<MicroTime>,
    /// The attempts this worker keeps alive, each as its TaskLease's name
    /// and UID.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 256))]
    pub holds: Vec<AttemptRef>,
    /// How many attempts the worker runs at once. Set: the worker takes
    /// offers addressed to it (it watches the TaskLeases labelled
    /// `batchlease.dev/worker` = this object's name), and the operator
    /// addresses it at most this many, less those it holds; 0 while it
    /// drains. Unset: it is never addressed (an older worker that watches
    /// every lease of its queues).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 256))]
    pub slots: Option<i32>,
    /// `true`: the worker also takes bound attempts — TaskLeases the
    /// operator creates already `Held` by it, saving the claim write
    /// (`TaskLeaseSpec::bound_at`). Unset: offers to it are claimed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub takes_bound: Option<bool>,
}

/// One attempt: a TaskLease by name and UID (a name repeats when a task is
/// re-created).
#[derive(
    Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash,
)]
pub struct AttemptRef {
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// The TaskLease's UID (Kubernetes UIDs are 36-character UUIDs).
    #[schemars(length(max = 36))]
    pub uid: String,
}

impl AttemptRef {
    /// The attempt `lease` is.
    pub fn of(lease: &TaskLease) -> Self {
        Self {
            name: lease.name_any(),
            uid: lease.uid().unwrap_or_default(),
        }
    }
}

/// What the operator has ended.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct WorkerLeaseStatus {
    /// Attempts the operator ended while this object could keep them alive
    /// (expired, released on cancel). Its worker stops them and never lists
    /// them again; a renewal listing one is refused.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 512))] // MAX_REVOKED
    pub revoked: Vec<AttemptRef>,
}

/// How often a holder renewing through its WorkerLease still writes each
/// TaskLease it holds (`renewTime`, and its checkpoint): at most this long
/// apart, so `kubectl get taskleases` shows a recent time and a deleted
/// TaskLease is noticed (the write fails). Its kill switch fires when none
/// succeeded for this long plus 2/3 of the TTL; the operator counts a
/// deleted lease's holder as running until its last observed write plus
/// this plus the TTL.
pub fn refresh_period(ttl: std::time::Duration) -> std::time::Duration {
    ttl.max(std::time::Duration::from_secs(120))
}

/// The name of worker `identity`'s WorkerLease (identities hold a `/`,
/// which no object name may).
pub fn worker_lease_name(identity: &str) -> String {
    crate::keys::presence_name(identity)
}

impl WorkerLease {
    /// The attempts the worker lists.
    pub fn holds(&self) -> &[AttemptRef] {
        &self.spec.holds
    }

    /// The attempts the operator revoked.
    pub fn revoked(&self) -> &[AttemptRef] {
        self.status.as_ref().map_or(&[], |s| s.revoked.as_slice())
    }

    /// Whether the operator revoked `attempt` here.
    pub fn is_revoked(&self, attempt: &AttemptRef) -> bool {
        self.revoked().contains(attempt)
    }

    /// The holder of this object if it is a well-formed WorkerLease: named
    /// for its `holderIdentity` ([`worker_lease_name`]), so there is one per
    /// identity, the one the operator looks up.
    pub fn worker(&self) -> Option<&str> {
        let holder = self.spec.holder_identity.as_str();
        (!holder.is_empty()
            && self.metadata.name.as_deref() == Some(worker_lease_name(holder).as_str()))
        .then_some(holder)
    }

    /// Adds `attempt` to `status.revoked` (the operator's write, sent as a
    /// compare-and-swap on the copy it observed). Past [`MAX_REVOKED`]
    /// entries the oldest the worker no longer lists are dropped — never
    /// the one added now (the worker may not have listed it yet, or read
    /// it: it would name it again and feed its kill clock after the end),
    /// and the oldest first, so the ones added by the same write (appended
    /// after every older one) go last. With at most [`MAX_HOLDS`] listed,
    /// there are always enough to drop.
    pub fn revoke(&mut self, attempt: AttemptRef) {
        let holds = self.spec.holds.clone();
        let status = self.status.get_or_insert_with(Default::default);
        if status.revoked.contains(&attempt) {
            return;
        }
        let mut excess = (status.revoked.len() + 1).saturating_sub(MAX_REVOKED);
        status.revoked.retain(|r| {
            let drop = excess > 0 && !holds.contains(r);
            if drop {
                excess -= 1;
            }
            !drop
        });
        status.revoked.push(attempt);
    }
}

/// Pure: whether a renewal of `worker` may keep `task_lease` alive: a
/// well-formed WorkerLease ([`WorkerLease::worker`]) of the TaskLease's
/// holder, in its namespace, for a TaskLease claimed to be renewed per
/// worker. Says nothing of the phase: the operator credits only a lease
/// still held by that holder.
pub fn covers(worker: &WorkerLease, task_lease: &TaskLease) -> bool {
    let Some(holder) = worker.worker() else {
        return false;
    };
    task_lease.renewed_per_worker()
        && task_lease.spec.holder_identity.as_deref() == Some(holder)
        && worker.metadata.namespace == task_lease.metadata.namespace
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Renewal, TaskLeaseSpec};

    fn worker(name: &str, holder: &str) -> WorkerLease {
        let mut w = WorkerLease::new(
            name,
            WorkerLeaseSpec {
                holder_identity: holder.into(),
                queues: vec!["q".into()],
                lease_duration_seconds: 30,
                renew_time: None,
                holds: vec![],
                slots: None,
                takes_bound: None,
            },
        );
        w.metadata.namespace = Some("ns".into());
        w
    }

    fn task_lease(name: &str, holder: Option<&str>, renewal: Option<Renewal>) -> TaskLease {
        let mut l = TaskLease::new(name, TaskLeaseSpec::offered("t", "u", "q", 1, 30));
        l.metadata.namespace = Some("ns".into());
        l.spec.holder_identity = holder.map(Into::into);
        l.spec.renewal = renewal;
        l
    }

    fn attempt(name: &str, uid: &str) -> AttemptRef {
        AttemptRef {
            name: name.into(),
            uid: uid.into(),
        }
    }

    #[test]
    fn covers_table() {
        let w1 = worker(&worker_lease_name("pod-1/ab"), "pod-1/ab");
        let held = task_lease("t-1", Some("pod-1/ab"), Some(Renewal::Worker));
        assert!(covers(&w1, &held));
        let cases = [
            (
                "renewed per lease",
                w1.clone(),
                task_lease("t-1", Some("pod-1/ab"), Some(Renewal::Lease)),
            ),
            (
                "from an operator without WorkerLeases",
                w1.clone(),
                task_lease("t-1", Some("pod-1/ab"), None),
            ),
            (
                "another holder's lease",
                w1.clone(),
                task_lease("t-1", Some("pod-2/cd"), Some(Renewal::Worker)),
            ),
            (
                "an offered lease",
                w1.clone(),
                task_lease("t-1", None, Some(Renewal::Lease)),
            ),
            (
                "not named for its holder",
                worker("other", "pod-1/ab"),
                held.clone(),
            ),
            (
                "named for another holder",
                worker(&worker_lease_name("pod-2/cd"), "pod-1/ab"),
                held.clone(),
            ),
        ];
        for (why, w, l) in cases {
            assert!(!covers(&w, &l), "{why}");
        }
        let mut elsewhere = held.clone();
        elsewhere.metadata.namespace = Some("other".into());
        assert!(!covers(&w1, &elsewhere), "another namespace");
    }

    #[test]
    fn revocations_are_kept_in_order_and_bounded() {
        let mut w = worker(&worker_lease_name("w"), "w");
        w.spec.holds = vec![attempt("t-1", "a"), attempt("t-2", "b")];
        w.revoke(attempt("t-2", "b"));
        w.revoke(attempt("t-1", "a"));
        w.revoke(attempt("t-2", "b"));
        assert_eq!(w.revoked(), &[attempt("t-2", "b"), attempt("t-1", "a")]);
        assert!(w.is_revoked(&attempt("t-1", "a")));
        assert!(!w.is_revoked(&attempt("t-1", "other-uid")), "by UID too");
        // An attempt the worker has not listed yet is revoked all the same.
        w.revoke(attempt("t-3", "c"));
        assert!(w.is_revoked(&attempt("t-3", "c")));
        // Past the bound, the oldest unlisted entries go first.
        w.spec.holds = vec![attempt("t-1", "a")];
        for i in 0..MAX_REVOKED - 1 {
            w.revoke(attempt(&format!("x-{i}"), "u"));
        }
        assert_eq!(w.revoked().len(), MAX_REVOKED);
        assert!(w.is_revoked(&attempt("t-1", "a")), "still listed: kept");
        assert!(
            !w.is_revoked(&attempt("t-2", "b")),
            "oldest unlisted: dropped"
        );
        assert!(!w.is_revoked(&attempt("t-3", "c")));
        assert!(w.is_revoked(&attempt(&format!("x-{}", MAX_REVOKED - 2), "u")));
    }

    /// Review of issue 39's caps: a frozen worker lists MAX_HOLDS attempts
    /// and holds one more it has not listed yet (bound, or just claimed);
    /// the operator revokes them all in one write. Dropping by the count of
    /// holds dropped that one — the only unlisted entry — and the write
    /// still succeeded, leaving it unrevoked but ended.
    #[test]
    fn no_revocation_of_one_write_is_dropped() {
        let mut w = worker(&worker_lease_name("w"), "w");
        w.spec.holds = (0..MAX_HOLDS)
            .map(|i| attempt(&format!("h-{i}"), &format!("u-{i}")))
            .collect();
        let mut all = w.spec.holds.clone();
        all.push(attempt("unlisted", "u-x"));
        for a in &all {
            w.revoke(a.clone());
        }
        for a in &all {
            assert!(w.is_revoked(a), "{a:?} dropped");
        }
        // Even at the bound, the one added now stays.
        let mut full = worker(&worker_lease_name("w"), "w");
        full.spec.holds = (0..MAX_HOLDS)
            .map(|i| attempt(&format!("h-{i}"), &format!("u-{i}")))
            .collect();
        for a in full.spec.holds.clone() {
            full.revoke(a);
        }
        for i in 0..MAX_REVOKED {
            full.revoke(attempt(&format!("late-{i}"), "u"));
            assert!(full.is_revoked(&attempt(&format!("late-{i}"), "u")));
            assert!(full.revoked().len() <= MAX_REVOKED);
        }
    }
}
