//! Invariants of the day-to-day controls (design §9) over a recorded
//! history: cancellation, and a queue's concurrency cap.
//!
//! Order across objects is taken from `resourceVersion`s: etcd numbers
//! every write of the cluster in one sequence, so a version written after
//! another has the larger number. (Clients must not rely on that in
//! general — the API promises only opaque strings — but this checker runs
//! against etcd, where it holds, and wall-clock receipt times of two
//! different watches would not give a reliable order.)

use std::collections::{BTreeMap, BTreeSet};

use batchlease_api::{LeasePhase, TaskPhase};
use kube::ResourceExt;

use crate::history::{Change, Recorded, StorageWrite, issued, tombstone};

fn rv(o: &impl kube::Resource) -> u64 {
    o.meta()
        .resource_version
        .as_deref()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// A cancelled task: `Cancelled` is final, no lease of it is created or
/// live after it became Cancelled, and storage accepts no write of it
/// from then on.
pub fn check_cancel(
    tasks: &[Recorded],
    leases: &[Recorded],
    writes: &[StorageWrite],
) -> Vec<String> {
    let mut out = Vec::new();
    // task UID → (receipt time, resourceVersion, name) of its first
    // Cancelled version.
    let mut cancelled: BTreeMap<String, (f64, u64, String)> = BTreeMap::new();
    for r in tasks {
        let Change::Task(t) = &r.change else {
            continue;
        };
        let uid = t.uid().unwrap_or_default();
        let phase = t.status.as_ref().and_then(|s| s.phase);
        if phase == Some(TaskPhase::Cancelled) {
            cancelled
                .entry(uid)
                .or_insert((r.at, rv(&**t), t.name_any()));
        } else if let Some((_, at_rv, name)) = cancelled.get(&uid)
            && rv(&**t) > *at_rv
        {
            out.push(format!(
                "task {name}: left Cancelled for {phase:?} (resourceVersion {})",
                rv(&**t)
            ));
        }
    }
    let mut seen: BTreeSet<String> = BTreeSet::new();
    // Per lease: its last version written before its task became Cancelled
    // (resourceVersion, live, name, task name).
    let mut at_cancel: BTreeMap<String, (u64, bool, String, String)> = BTreeMap::new();
    for r in leases {
        let (l, gone) = match &r.change {
            Change::Lease(l) => (l, false),
            // A deletion's object carries the deletion's resourceVersion.
            Change::LeaseDeleted(l) => (l, true),
            _ => continue,
        };
        if !issued(l) || tombstone(l) {
            continue;
        }
        let first = !gone && seen.insert(l.uid().unwrap_or_default());
        let Some((_, at_rv, name)) = cancelled.get(&l.spec.task_uid) else {
            continue;
        };
        let live_now = !gone
            && matches!(
                l.status.as_ref().and_then(|s| s.phase),
                None | Some(LeasePhase::Offered | LeasePhase::Held)
            );
        if rv(&**l) <= *at_rv {
            let e = at_cancel.entry(l.uid().unwrap_or_default()).or_default();
            if rv(&**l) >= e.0 {
                *e = (rv(&**l), live_now, l.name_any(), name.clone());
            }
            continue;
        }
        if first && l.metadata.generation.unwrap_or(1) <= 1 {
            out.push(format!(
                "task {name}: lease {} created after the task was Cancelled",
                l.name_any()
            ));
        }
        if live_now {
            out.push(format!(
                "task {name}: lease {} live (resourceVersion {}) after the task was Cancelled",
                l.name_any(),
                rv(&**l)
            ));
        }
    }
    for (_, live, lease, task) in at_cancel.values() {
        if *live {
            out.push(format!(
                "task {task}: lease {lease} was live when the task became Cancelled"
            ));
        }
    }
    for w in writes {
        if let Some((at, _, name)) = cancelled.get(&w.task_uid)
            && w.at >= *at
        {
            out.push(format!(
                "storage: task {name}: {} write with token {} at {:.3}, after the task was seen Cancelled at {at:.3}",
                w.status, w.token, w.at
            ));
        }
    }
    out
}

/// The most leases of `queue` Offered or Held at once, replaying the lease
/// watch in its order (one watch: its order is the API server's).
pub fn max_live(leases: &[Recorded], queue: &str) -> usize {
    let mut live: BTreeSet<String> = BTreeSet::new();
    let mut max = 0;
    for r in leases {
        let (l, gone) = match &r.change {
            Change::Lease(l) => (l, false),
            Change::LeaseDeleted(l) => (l, true),
            _ => continue,
        };
        if l.spec.queue != queue || tombstone(l) {
            continue;
        }
        let is_live = !gone
            && matches!(
                l.status.as_ref().and_then(|s| s.phase),
                None | Some(LeasePhase::Offered | LeasePhase::Held)
            );
        if is_live {
            live.insert(l.uid().unwrap_or_default());
        } else {
            live.remove(&l.uid().unwrap_or_default());
        }
        max = max.max(live.len());
    }
    max
}

/// When each lease of `queue` was first seen (receipt times, seconds since
/// the epoch), in order: the issue times as the watch saw them.
pub fn issue_times(leases: &[Recorded], queue: &str) -> Vec<f64> {
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for r in leases {
        let Change::Lease(l) = &r.change else {
            continue;
        };
        if l.spec.queue == queue && !tombstone(l) && seen.insert(l.uid().unwrap_or_default()) {
            out.push(r.at);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use batchlease_api::{
        BatchTask, BatchTaskSpec, BatchTaskStatus, TaskLease, TaskLeaseSpec, TaskLeaseStatus,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

    fn task(phase: TaskPhase, rv: u64, at: f64) -> Recorded {
        let mut t = BatchTask::new("t", BatchTaskSpec::for_queue("q"));
        t.metadata.uid = Some("task-uid".into());
        t.metadata.resource_version = Some(rv.to_string());
        t.status = Some(BatchTaskStatus {
            phase: Some(phase),
            ..Default::default()
        });
        Recorded {
            at,
            change: Change::Task(Box::new(t)),
        }
    }

    fn lease(uid: &str, phase: LeasePhase, rv: u64, generation: i64) -> Recorded {
        let mut l = TaskLease::new(
            &format!("t-{uid}"),
            TaskLeaseSpec::offered("t", "task-uid", "q", 1, 30),
        );
        l.metadata.uid = Some(uid.into());
        l.metadata.resource_version = Some(rv.to_string());
        l.metadata.generation = Some(generation);
        l.metadata.owner_references = Some(vec![OwnerReference {
            api_version: "batchlease.dev/v1alpha1".into(),
            kind: "BatchTask".into(),
            name: "t".into(),
            uid: "task-uid".into(),
            controller: Some(true),
            block_owner_deletion: None,
        }]);
        l.status = Some(TaskLeaseStatus {
            phase: Some(phase),
            ..Default::default()
        });
        Recorded {
            at: rv as f64,
            change: Change::Lease(Box::new(l)),
        }
    }

    fn write(at: f64) -> StorageWrite {
        StorageWrite {
            task_uid: "task-uid".into(),
            token: 1,
            status: "COMPLETED".into(),
            worker: "w".into(),
            at,
        }
    }

    #[test]
    fn a_clean_cancel_passes_and_each_breach_is_named() {
        let tasks = vec![
            task(TaskPhase::Running, 3, 3.0),
            task(TaskPhase::Cancelled, 9, 9.0),
        ];
        let leases = vec![
            lease("a", LeasePhase::Offered, 2, 1),
            lease("a", LeasePhase::Held, 4, 2),
            lease("a", LeasePhase::Released, 6, 3),
        ];
        assert!(check_cancel(&tasks, &leases, &[write(5.0)]).is_empty());

        let late_write = check_cancel(&tasks, &leases, &[write(9.5)]);
        assert!(
            late_write[0].contains("after the task was seen Cancelled"),
            "{late_write:?}"
        );

        let mut revived = tasks.clone();
        revived.push(task(TaskPhase::Pending, 11, 11.0));
        assert!(check_cancel(&revived, &leases, &[])[0].contains("left Cancelled"));

        // A held lease deleted before the cancel ended is not live then.
        let mut deleted = vec![lease("a", LeasePhase::Held, 2, 2)];
        let mut gone = lease("a", LeasePhase::Held, 5, 2);
        if let Change::Lease(l) = gone.change {
            gone.change = Change::LeaseDeleted(l);
        }
        deleted.push(gone);
        assert!(check_cancel(&tasks, &deleted, &[]).is_empty());

        // A lease still Offered when the task became Cancelled.
        let open = vec![lease("a", LeasePhase::Offered, 2, 1)];
        let v = check_cancel(&tasks, &open, &[]);
        assert!(
            v[0].contains("was live when the task became Cancelled"),
            "{v:?}"
        );

        let mut issued_after = leases.clone();
        issued_after.push(lease("b", LeasePhase::Offered, 12, 1));
        let v = check_cancel(&tasks, &issued_after, &[]);
        assert!(v.iter().any(|m| m.contains("created after")), "{v:?}");
        assert!(v.iter().any(|m| m.contains("live")), "{v:?}");
    }

    #[test]
    fn max_live_replays_the_watch() {
        let mut h = vec![
            lease("a", LeasePhase::Offered, 1, 1),
            lease("b", LeasePhase::Offered, 2, 1),
            lease("a", LeasePhase::Held, 3, 2),
            lease("a", LeasePhase::Completed, 4, 3),
            lease("c", LeasePhase::Offered, 5, 1),
        ];
        assert_eq!(max_live(&h, "q"), 2);
        h.push(lease("d", LeasePhase::Offered, 6, 1));
        assert_eq!(max_live(&h, "q"), 3);
        assert_eq!(max_live(&h, "other"), 0);
        assert_eq!(issue_times(&h, "q"), vec![1.0, 2.0, 5.0, 6.0]);
    }
}
