//! The worker Lease (issue 27, design "Fleets"): one `coordination.k8s.io/v1`
//! Lease per worker process — its presence record, promoted — whose
//! renewals keep alive the attempts it lists in
//! [`ANNOTATION_HOLDS`](crate::keys::ANNOTATION_HOLDS), instead of one
//! renewal per TaskLease.
//!
//! Pure helpers shared by the operator (which credits a renewal to the
//! leases it names) and the SDK (which writes the list and stops what the
//! operator revoked). A renewal keeps a TaskLease alive only if the Lease
//! [covers] it: the operator must never count one worker's renewal for
//! another's attempt, nor a list written into someone else's Lease.

use std::collections::BTreeSet;

use k8s_openapi::api::coordination::v1::Lease;
use kube::ResourceExt;

use crate::TaskLease;
use crate::keys::{ANNOTATION_HOLDS, ANNOTATION_REVOKED, LABEL_WORKER, presence_name};

/// Pure: the names in a comma-separated annotation value; spaces around
/// names and empty entries (`"a,,b, "`) are ignored.
pub fn parse_names(value: &str) -> BTreeSet<String> {
    value
        .split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Pure: `names` as an annotation value (sorted, so equal sets write equal
/// values and a renewal that lists the same attempts changes nothing but
/// its `renewTime`).
pub fn format_names(names: &BTreeSet<String>) -> String {
    names
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join(",")
}

fn names(lease: &Lease, key: &str) -> BTreeSet<String> {
    lease
        .annotations()
        .get(key)
        .map(|v| parse_names(v))
        .unwrap_or_default()
}

/// The attempts `lease` says its worker keeps alive.
pub fn holds(lease: &Lease) -> BTreeSet<String> {
    names(lease, ANNOTATION_HOLDS)
}

/// The attempts the operator revoked in `lease`.
pub fn revoked(lease: &Lease) -> BTreeSet<String> {
    names(lease, ANNOTATION_REVOKED)
}

/// The holder of `lease` if it is a worker Lease: labelled
/// `batchlease.dev/worker=true`, a non-empty `holderIdentity`, and named
/// for that identity ([`presence_name`]) — so there is one Lease per
/// identity, the one the operator looks up, and another object that
/// happens to carry the label and the identity keeps nothing alive.
pub fn worker_of(lease: &Lease) -> Option<&str> {
    let holder = lease
        .spec
        .as_ref()?
        .holder_identity
        .as_deref()
        .filter(|h| !h.is_empty())?;
    let labelled = lease.labels().get(LABEL_WORKER).map(String::as_str) == Some("true");
    (labelled && lease.metadata.name.as_deref() == Some(presence_name(holder).as_str()))
        .then_some(holder)
}

/// Pure: whether a renewal of `worker` keeps `task_lease` alive: a worker
/// Lease ([`worker_of`]) of the TaskLease's holder, in its namespace,
/// listing it in `holds`. Says nothing about the TaskLease's phase: the
/// operator credits only a lease still held by that holder.
pub fn covers(worker: &Lease, task_lease: &TaskLease) -> bool {
    let Some(holder) = worker_of(worker) else {
        return false;
    };
    task_lease.spec.holder_identity.as_deref() == Some(holder)
        && worker.metadata.namespace == task_lease.metadata.namespace
        && task_lease
            .metadata
            .name
            .as_ref()
            .is_some_and(|n| holds(worker).contains(n))
}

/// Sets `lease`'s list of the attempts it keeps alive.
pub fn set_holds(lease: &mut Lease, names: &BTreeSet<String>) {
    lease
        .annotations_mut()
        .insert(ANNOTATION_HOLDS.into(), format_names(names));
}

/// Adds `attempt` to `lease`'s revoked attempts (the operator's write,
/// sent as a compare-and-swap on the copy it observed).
pub fn revoke(lease: &mut Lease, attempt: &str) {
    let mut all = revoked(lease);
    all.insert(attempt.to_owned());
    lease
        .annotations_mut()
        .insert(ANNOTATION_REVOKED.into(), format_names(&all));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TaskLeaseSpec;
    use k8s_openapi::api::coordination::v1::LeaseSpec;

    fn worker(name: &str, holder: Option<&str>, label: Option<&str>, holds: Option<&str>) -> Lease {
        let mut l = Lease::default();
        l.metadata.name = Some(name.into());
        l.metadata.namespace = Some("ns".into());
        if let Some(v) = label {
            l.labels_mut().insert(LABEL_WORKER.into(), v.into());
        }
        if let Some(h) = holds {
            l.annotations_mut()
                .insert(ANNOTATION_HOLDS.into(), h.into());
        }
        l.spec = Some(LeaseSpec {
            holder_identity: holder.map(Into::into),
            ..Default::default()
        });
        l
    }

    fn task_lease(name: &str, holder: Option<&str>) -> TaskLease {
        let mut l = TaskLease::new(name, TaskLeaseSpec::offered("t", "u", "q", 1, 30));
        l.metadata.namespace = Some("ns".into());
        l.spec.holder_identity = holder.map(Into::into);
        l
    }

    #[test]
    fn names_parse_tolerantly_and_format_sorted() {
        let want: BTreeSet<String> = ["a-1", "b-2"].into_iter().map(Into::into).collect();
        for v in ["a-1,b-2", " b-2 , a-1 ", "a-1,,b-2,", ",a-1, ,b-2,a-1"] {
            assert_eq!(parse_names(v), want, "{v:?}");
        }
        assert!(parse_names("").is_empty());
        assert!(parse_names(" , ").is_empty());
        assert_eq!(format_names(&want), "a-1,b-2");
        assert_eq!(parse_names(&format_names(&want)), want);
    }

    #[test]
    fn covers_table() {
        let w1 = presence_name("pod-1/ab");
        let held = task_lease("t-1", Some("pod-1/ab"));
        let yes = worker(&w1, Some("pod-1/ab"), Some("true"), Some("t-1, t-2"));
        assert!(covers(&yes, &held));
        let cases: [(&str, Lease, TaskLease); 8] = [
            (
                "not listed",
                worker(&w1, Some("pod-1/ab"), Some("true"), Some("t-2")),
                held.clone(),
            ),
            (
                "no holds annotation",
                worker(&w1, Some("pod-1/ab"), Some("true"), None),
                held.clone(),
            ),
            (
                "another holder's lease",
                yes.clone(),
                task_lease("t-1", Some("pod-2/cd")),
            ),
            ("an offered lease", yes.clone(), task_lease("t-1", None)),
            (
                "not labelled",
                worker(&w1, Some("pod-1/ab"), None, Some("t-1")),
                held.clone(),
            ),
            (
                "labelled otherwise",
                worker(&w1, Some("pod-1/ab"), Some("false"), Some("t-1")),
                held.clone(),
            ),
            (
                "not named for its holder",
                worker("other", Some("pod-1/ab"), Some("true"), Some("t-1")),
                held.clone(),
            ),
            (
                "no holder",
                worker(&w1, None, Some("true"), Some("t-1")),
                held.clone(),
            ),
        ];
        for (why, w, l) in cases {
            assert!(!covers(&w, &l), "{why}");
        }
        let mut elsewhere = held.clone();
        elsewhere.metadata.namespace = Some("other".into());
        assert!(!covers(&yes, &elsewhere), "another namespace");
        // A Lease named for one identity but held by another is nobody's.
        let forged = worker(&w1, Some("pod-2/cd"), Some("true"), Some("t-1"));
        assert_eq!(worker_of(&forged), None);
        assert!(!covers(&forged, &task_lease("t-1", Some("pod-2/cd"))));
    }

    #[test]
    fn holds_and_revocations_are_written_as_lists() {
        let mut w = worker(&presence_name("w"), Some("w"), Some("true"), None);
        set_holds(&mut w, &parse_names("t-2,t-1"));
        assert_eq!(w.annotations()[ANNOTATION_HOLDS], "t-1,t-2");
        assert_eq!(holds(&w), parse_names("t-1,t-2"));
        assert!(revoked(&w).is_empty());
        revoke(&mut w, "t-2");
        revoke(&mut w, "t-1");
        revoke(&mut w, "t-2");
        assert_eq!(w.annotations()[ANNOTATION_REVOKED], "t-1,t-2");
        set_holds(&mut w, &BTreeSet::new());
        assert!(holds(&w).is_empty());
        assert_eq!(revoked(&w).len(), 2, "the holds list leaves revocations be");
    }
}
