//! Invariants of the day-to-day controls (design §9) over a recorded
//! history: cancellation, and a queue's concurrency cap.
//!
//! Order across objects is taken from `resourceVersion`s: etcd numbers
//! every write of the cluster in one sequence, so a version written after
//! another has the larger number. (Clients must not rely on that in
//! general — the API promises only opaque strings — but this checker runs
//! against etcd, where it holds, and wall-clock receipt times of two
//! different watches would not give a reliable order.)
//!
//! Storage commits are ordered against the API server's own clock: the
//! audit log's record of the write that made a task Cancelled (see
//! `cancel_write_time`), not the time the recorder received its event.

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

/// When the API server applied the write that made a task `Cancelled`,
/// from its audit log: the status update whose precondition
/// (`objectRef.resourceVersion`, the version a PUT replaces) is the
/// version the history recorded just before the first `Cancelled` one.
/// The operator's status writes are compare-and-swap updates, so exactly
/// one accepted write carries that precondition; a Metadata-level log
/// records neither the body nor the version a write produced, and the
/// object's `managedFields` time has whole seconds only, so this is the
/// exact way to name the write.
///
/// The time is the request's receipt by the server: the write took effect
/// between then and its response, and the operator had decided the task
/// was over (no attempt could still commit) before it sent the write, so
/// a commit after that instant breaks the promise. The recorder's own
/// receipt of the watch event comes later still, by the watch's latency —
/// a check against it would pass commits that landed after `Cancelled`.
fn cancel_write_time(server: &[crate::audit::Write], name: &str, replaced: &str) -> Option<f64> {
    server
        .iter()
        .find(|w| {
            w.verb == "update"
                && w.resource == "batchtasks/status"
                && w.name == name
                && w.resource_version.as_deref() == Some(replaced)
        })
        .map(|w| w.received)
}

/// A cancelled task: `Cancelled` is final, no lease of it is created or
/// live after it became Cancelled, and storage accepts no write of it
/// from then on — on the API server's clock (`server`: the namespace's
/// writes from its audit log, see [`cancel_write_time`]); `None` when the
/// run has no audit log: then storage writes are compared with the time
/// the recorder received the Cancelled version, which is later.
pub fn check_cancel(
    tasks: &[Recorded],
    leases: &[Recorded],
    writes: &[StorageWrite],
    server: Option<&[crate::audit::Write]>,
) -> Vec<String> {
    let mut out = Vec::new();
    // task UID → (time it became Cancelled, resourceVersion, name) of its
    // first Cancelled version.
    let mut cancelled: BTreeMap<String, (f64, u64, String)> = BTreeMap::new();
    // task UID → the resourceVersion of the latest version recorded so far.
    let mut last_rv: BTreeMap<String, u64> = BTreeMap::new();
    for r in tasks {
        let Change::Task(t) = &r.change else {
            continue;
        };
        let uid = t.uid().unwrap_or_default();
        let phase = t.status.as_ref().and_then(|s| s.phase);
        let before = last_rv.insert(uid.clone(), rv(&**t));
        if phase == Some(TaskPhase::Cancelled) {
            if cancelled.contains_key(&uid) {
                continue;
            }
            let name = t.name_any();
            let at = match (server, before) {
                (None, _) => r.at,
                (Some(server), Some(before)) => {
                    match cancel_write_time(server, &name, &before.to_string()) {
                        Some(at) => at,
                        None => {
                            out.push(format!(
                                "task {name}: the audit log has no status update replacing resourceVersion {before} (the Cancelled write)"
                            ));
                            r.at
                        }
                    }
                }
                (Some(_), None) => {
                    out.push(format!(
                        "task {name}: Cancelled in its first recorded version; the write cannot be found in the audit log"
                    ));
                    r.at
                }
            };
            cancelled.insert(uid, (at, rv(&**t), name));
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
                "storage: task {name}: {} write with token {} at {:.6}, after the task became Cancelled at {at:.6}",
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
        assert!(check_cancel(&tasks, &leases, &[write(5.0)], None).is_empty());

        let late_write = check_cancel(&tasks, &leases, &[write(9.5)], None);
        assert!(
            late_write[0].contains("after the task became Cancelled"),
            "{late_write:?}"
        );

        let mut revived = tasks.clone();
        revived.push(task(TaskPhase::Pending, 11, 11.0));
        assert!(check_cancel(&revived, &leases, &[], None)[0].contains("left Cancelled"));

        // A held lease deleted before the cancel ended is not live then.
        let mut deleted = vec![lease("a", LeasePhase::Held, 2, 2)];
        let mut gone = lease("a", LeasePhase::Held, 5, 2);
        if let Change::Lease(l) = gone.change {
            gone.change = Change::LeaseDeleted(l);
        }
        deleted.push(gone);
        assert!(check_cancel(&tasks, &deleted, &[], None).is_empty());

        // A lease still Offered when the task became Cancelled.
        let open = vec![lease("a", LeasePhase::Offered, 2, 1)];
        let v = check_cancel(&tasks, &open, &[], None);
        assert!(
            v[0].contains("was live when the task became Cancelled"),
            "{v:?}"
        );

        let mut issued_after = leases.clone();
        issued_after.push(lease("b", LeasePhase::Offered, 12, 1));
        let v = check_cancel(&tasks, &issued_after, &[], None);
        assert!(v.iter().any(|m| m.contains("created after")), "{v:?}");
        assert!(v.iter().any(|m| m.contains("live")), "{v:?}");
    }

    /// The update that made `t` Cancelled, as the audit log records it:
    /// received at `received`, replacing resourceVersion `replaced`.
    fn status_update(replaced: u64, received: f64) -> crate::audit::Write {
        crate::audit::Write {
            user: "operator-a".into(),
            verb: "update".into(),
            resource: "batchtasks/status".into(),
            name: "t".into(),
            at: received + 0.004,
            received,
            resource_version: Some(replaced.to_string()),
            pod: None,
        }
    }

    #[test]
    fn storage_writes_are_judged_on_the_api_servers_clock() {
        // The server received the Cancelled write (replacing version 3) at
        // 9.0; the recorder got the watch event at 9.4 (watch latency).
        let tasks = vec![
            task(TaskPhase::Running, 3, 3.0),
            task(TaskPhase::Cancelled, 9, 9.4),
        ];
        let leases = vec![
            lease("a", LeasePhase::Offered, 2, 1),
            lease("a", LeasePhase::Held, 4, 2),
            lease("a", LeasePhase::Released, 6, 3),
        ];
        // Other writes of the task (and another task's) must not be taken
        // for it.
        let mut other_name = status_update(3, 1.0);
        other_name.name = "u".into();
        let server = vec![
            status_update(1, 1.0),
            other_name,
            crate::audit::Write {
                resource: "batchtasks".into(),
                ..status_update(3, 2.0)
            },
            status_update(3, 9.0),
        ];
        let commit = write(9.2);
        // Between the server's write and the recorder's receipt: the old
        // comparison (receipt time) passed it; the server's time flags it.
        assert!(check_cancel(&tasks, &leases, std::slice::from_ref(&commit), None).is_empty());
        let v = check_cancel(&tasks, &leases, &[commit], Some(&server));
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(
            v[0].contains("after the task became Cancelled at 9.000000"),
            "{v:?}"
        );
        assert!(check_cancel(&tasks, &leases, &[write(8.9)], Some(&server)).is_empty());

        // A Cancelled version the audit log has no write for is itself a
        // violation: the check cannot be made on the server's clock.
        let v = check_cancel(&tasks, &leases, &[], Some(&server[..3]));
        assert!(
            v.iter()
                .any(|m| m.contains("no status update replacing resourceVersion 3")),
            "{v:?}"
        );
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
