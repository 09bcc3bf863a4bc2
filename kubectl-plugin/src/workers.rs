//! `kubectl batchlease workers`: who holds what, kept alive how, renewed
//! when — TaskLeases joined with the WorkerLeases of their holders.
//!
//! A lease renewed per worker writes its own `renewTime` only every
//! `max(TTL, 120 s)`; what keeps it alive is its holder's WorkerLease, so
//! `kubectl get taskleases` alone shows an older RENEWED than the truth.
//! This joins the two: per worker, its renewal mode, how many leases it
//! holds, how many offers are addressed to it and wait, its slots, and its
//! last renewal — the WorkerLease's, or for a worker renewing per lease
//! the newest `renewTime` among its leases.

use std::borrow::Borrow;
use std::collections::BTreeMap;

use batchlease_api::{LeasePhase, TaskLease, WorkerLease};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use serde::Serialize;

use crate::age;

/// One worker of one namespace.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WorkerStatus {
    pub namespace: String,
    /// Its holder identity.
    pub worker: String,
    /// `Worker`: it has a WorkerLease (its attempts may be renewed through
    /// it); `Lease`: it renews each lease itself.
    pub renewal: &'static str,
    /// Its queues (from its WorkerLease; else those of the leases it holds).
    pub queues: Vec<String>,
    /// Leases it holds.
    pub held: usize,
    /// Offers addressed to it, not yet claimed.
    pub offered: usize,
    /// Its slots, if it takes addressed offers.
    pub slots: Option<i32>,
    /// Seconds since its last renewal (its own clock's `renewTime`).
    pub renewed_seconds_ago: Option<i64>,
}

#[derive(Default)]
struct Acc {
    renewal: &'static str,
    queues: Vec<String>,
    held: usize,
    offered: usize,
    slots: Option<i32>,
    renewed: Option<Timestamp>,
}

/// The workers of `worker_leases` and of the holders and addressees of
/// `leases`, sorted by namespace and identity.
pub fn summarize<W: Borrow<WorkerLease>, L: Borrow<TaskLease>>(
    worker_leases: &[W],
    leases: &[L],
    now: Timestamp,
) -> Vec<WorkerStatus> {
    let mut workers: BTreeMap<(String, String), Acc> = BTreeMap::new();
    for w in worker_leases {
        let w = w.borrow();
        let Some(id) = w.worker() else { continue };
        let a = workers
            .entry((w.namespace().unwrap_or_default(), id.to_owned()))
            .or_default();
        a.renewal = "Worker";
        a.queues = w.spec.queues.clone();
        a.slots = w.spec.slots;
        a.renewed = w.spec.renew_time.as_ref().map(|t| t.0);
    }
    for l in leases {
        let l = l.borrow();
        let ns = l.namespace().unwrap_or_default();
        match l.status.as_ref().and_then(|s| s.phase) {
            Some(LeasePhase::Held) => {
                let Some(h) = l.spec.holder_identity.clone() else {
                    continue;
                };
                let a = workers.entry((ns, h)).or_default();
                a.held += 1;
                if a.renewal.is_empty() {
                    a.renewal = "Lease";
                }
                if a.renewal == "Lease" {
                    if !a.queues.contains(&l.spec.queue) {
                        a.queues.push(l.spec.queue.clone());
                    }
                    let t = l.spec.renew_time.as_ref().map(|t| t.0);
                    a.renewed = a.renewed.max(t);
                }
            }
            Some(LeasePhase::Offered) => {
                if let Some(to) = l.spec.offered_to.clone() {
                    workers.entry((ns, to)).or_default().offered += 1;
                }
            }
            _ => {}
        }
    }
    workers
        .into_iter()
        .map(|((namespace, worker), a)| WorkerStatus {
            namespace,
            worker,
            // Addressed offers only, no WorkerLease seen (it went away).
            renewal: if a.renewal.is_empty() {
                "Lease"
            } else {
                a.renewal
            },
            queues: a.queues,
            held: a.held,
            offered: a.offered,
            slots: a.slots,
            renewed_seconds_ago: a.renewed.map(|t| age::seconds(t, now)),
        })
        .collect()
}

/// A table like `kubectl get` prints.
pub fn table(workers: &[WorkerStatus], all_namespaces: bool) -> String {
    let mut header: Vec<String> = vec![];
    if all_namespaces {
        header.push("NAMESPACE".into());
    }
    header.extend(
        [
            "WORKER", "RENEWAL", "QUEUES", "HELD", "OFFERED", "SLOTS", "RENEWED",
        ]
        .map(String::from),
    );
    let mut rows = vec![header];
    for w in workers {
        let mut row = vec![];
        if all_namespaces {
            row.push(w.namespace.clone());
        }
        row.push(w.worker.clone());
        row.push(w.renewal.to_owned());
        row.push(if w.queues.is_empty() {
            "<none>".into()
        } else {
            w.queues.join(",")
        });
        row.push(w.held.to_string());
        row.push(w.offered.to_string());
        row.push(w.slots.map_or("<none>".into(), |s| s.to_string()));
        row.push(w.renewed_seconds_ago.map_or("<none>".into(), age::human));
        rows.push(row);
    }
    crate::render::columns(&rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{lease, ts};
    use batchlease_api::worker_lease::worker_lease_name;
    use batchlease_api::{Renewal, WorkerLeaseSpec};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;

    fn worker_lease(id: &str, slots: Option<i32>, renewed: i64) -> WorkerLease {
        let mut w = WorkerLease::new(
            &worker_lease_name(id),
            WorkerLeaseSpec {
                holder_identity: id.into(),
                queues: vec!["q".into()],
                lease_duration_seconds: 30,
                renew_time: Some(MicroTime(ts(renewed))),
                holds: vec![],
                slots,
                takes_bound: None,
            },
        );
        w.metadata.namespace = Some("ns".into());
        w
    }

    #[test]
    fn joins_worker_leases_with_what_their_holders_hold_and_are_offered() {
        let mut per_worker = lease("a-1", "q", LeasePhase::Held, Some("w/1"), ts(0));
        per_worker.spec.renewal = Some(Renewal::Worker);
        // Its own renewTime is old: the WorkerLease's is what counts.
        per_worker.spec.renew_time = Some(MicroTime(ts(10)));
        let mut per_lease = lease("b-1", "r", LeasePhase::Held, Some("old/1"), ts(0));
        per_lease.spec.renew_time = Some(MicroTime(ts(95)));
        let mut offered = lease("c-1", "q", LeasePhase::Offered, None, ts(0));
        offered.spec.offered_to = Some("w/1".into());
        let open = lease("d-1", "q", LeasePhase::Offered, None, ts(0));
        let done = lease("e-1", "q", LeasePhase::Completed, Some("w/1"), ts(0));
        let got = summarize(
            &[
                worker_lease("w/1", Some(4), 98),
                worker_lease("idle/1", None, 40),
            ],
            &[per_worker, per_lease, offered, open, done],
            ts(100),
        );
        let rows: Vec<_> = got
            .iter()
            .map(|w| {
                (
                    w.worker.as_str(),
                    w.renewal,
                    w.held,
                    w.offered,
                    w.slots,
                    w.renewed_seconds_ago,
                )
            })
            .collect();
        assert_eq!(
            rows,
            vec![
                ("idle/1", "Worker", 0, 0, None, Some(60)),
                ("old/1", "Lease", 1, 0, None, Some(5)),
                ("w/1", "Worker", 1, 1, Some(4), Some(2)),
            ]
        );
        assert_eq!(
            got[1].queues,
            ["r"],
            "a per-lease worker's queues from its leases"
        );
        let t = table(&got, false);
        assert!(t.starts_with("WORKER"), "{t}");
        assert!(
            t.contains("w/1") && t.contains("Worker") && t.contains("<none>"),
            "{t}"
        );
    }
}
