//! The queues page: `kubectl batchlease status` per queue, plus what only
//! the TaskQueue says — its limits, whether it is at capacity, and how
//! many issues the pause, the cap and the rate limit held back.

use std::collections::BTreeMap;

use batchlease_api::{LeasePhase, TaskQueue, ThrottleCounts, queue_condition};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use serde::Serialize;

use super::snapshot::Snapshot;
use crate::status::{self, QueueStatus};

/// One row of the queues page.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct QueueRow {
    #[serde(flatten)]
    pub status: QueueStatus,
    /// Leases offered and not yet claimed.
    pub offered: usize,
    /// Leases held by a worker.
    pub held: usize,
    /// The TaskQueue's `spec.maxConcurrent`.
    pub max_concurrent: Option<i32>,
    /// The TaskQueue's `spec.maxIssuesPerSecond`.
    pub max_issues_per_second: Option<i32>,
    /// The operator's `AtCapacity` condition is True.
    pub at_capacity: bool,
    /// Issues held back since the operator started, by cause.
    pub throttled: ThrottleCounts,
}

/// Every queue of `snap`, sorted by namespace and name.
pub fn queues(snap: &Snapshot, now: Timestamp) -> Vec<QueueRow> {
    let controls: BTreeMap<(String, String), &TaskQueue> = snap
        .queues
        .iter()
        .map(|q| ((q.namespace().unwrap_or_default(), q.name_any()), &**q))
        .collect();
    let mut live: BTreeMap<(String, String), (usize, usize)> = BTreeMap::new();
    for l in &snap.leases {
        let key = (l.namespace().unwrap_or_default(), l.spec.queue.clone());
        let e = live.entry(key).or_default();
        match l.status.as_ref().and_then(|s| s.phase) {
            Some(LeasePhase::Offered) => e.0 += 1,
            Some(LeasePhase::Held) => e.1 += 1,
            _ => {}
        }
    }
    status::summarize(&snap.tasks, &snap.leases, &snap.queues, now)
        .into_iter()
        .map(|status| {
            let key = (status.namespace.clone(), status.queue.clone());
            let tq = controls.get(&key);
            let tq_status = tq.and_then(|q| q.status.clone()).unwrap_or_default();
            let (offered, held) = live.get(&key).copied().unwrap_or_default();
            QueueRow {
                offered,
                held,
                max_concurrent: tq.and_then(|q| q.spec.max_concurrent),
                max_issues_per_second: tq.and_then(|q| q.spec.max_issues_per_second),
                at_capacity: tq_status
                    .conditions
                    .iter()
                    .any(|c| c.type_ == queue_condition::AT_CAPACITY && c.status == "True"),
                throttled: tq_status.throttled,
                status,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::fixtures::{lease, task, task_queue, ts};
    use batchlease_api::{TaskPhase, TaskQueueStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

    #[test]
    fn a_queue_row_joins_the_tasks_the_leases_and_the_taskqueue() {
        let mut tq = task_queue("q", true);
        tq.spec.max_concurrent = Some(2);
        tq.status = Some(TaskQueueStatus {
            throttled: ThrottleCounts {
                paused: 3,
                max_concurrent: 1,
                rate: 0,
                worker_slots: 0,
            },
            conditions: vec![Condition {
                type_: "AtCapacity".into(),
                status: "True".into(),
                last_transition_time: Time(ts(0)),
                message: String::new(),
                reason: "Cap".into(),
                observed_generation: None,
            }],
            ..Default::default()
        });
        let snap = Snapshot {
            tasks: vec![
                Arc::new(task("a", "q", TaskPhase::Running, |_| {})),
                Arc::new(task("b", "q", TaskPhase::Ready, |s| {
                    s.current_lease = Some("b-1".into())
                })),
                Arc::new(task("c", "other", TaskPhase::Pending, |_| {})),
            ],
            leases: vec![
                Arc::new(lease("a-1", "q", LeasePhase::Held, Some("w-0/x"), ts(5))),
                Arc::new(lease("b-1", "q", LeasePhase::Offered, None, ts(10))),
                Arc::new(lease("a-0", "q", LeasePhase::Expired, Some("w-1/y"), ts(1))),
            ],
            queues: vec![Arc::new(tq)],
        };
        let rows = queues(&snap, ts(70));
        assert_eq!(rows.len(), 2);
        let (other, q) = (&rows[0], &rows[1]);
        assert_eq!(other.status.queue, "other");
        assert_eq!(
            (other.offered, other.held, other.at_capacity),
            (0, 0, false)
        );
        assert!(q.status.paused);
        assert_eq!((q.offered, q.held), (1, 1));
        assert_eq!(q.max_concurrent, Some(2));
        assert!(q.at_capacity);
        assert_eq!(q.throttled.paused, 3);
        assert_eq!(q.status.oldest_ready_seconds, Some(60));
        let json = serde_json::to_value(q).unwrap_or_default();
        // Flattened: the page reads one object per queue.
        assert_eq!(json["queue"], "q");
        assert_eq!(json["atCapacity"], true);
    }
}
