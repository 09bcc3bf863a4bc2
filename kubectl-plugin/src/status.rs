//! `kubectl batchlease status`: per queue, whether it is paused, how many
//! tasks are in each phase, who holds leases, how long the oldest ready
//! task has waited, and the speculative abort rate.

use std::borrow::Borrow;
use std::collections::{BTreeMap, BTreeSet};

use batchlease_api::{BatchTask, LeasePhase, TaskLease, TaskPhase, TaskQueue};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use serde::Serialize;

use crate::age;

/// One queue of one namespace.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct QueueStatus {
    pub namespace: String,
    pub queue: String,
    /// The queue's TaskQueue has `spec.paused` (no TaskQueue: not paused).
    pub paused: bool,
    /// Tasks by phase (phases with none left out).
    pub phases: BTreeMap<String, usize>,
    /// Holders of the queue's Held leases.
    pub holders: BTreeSet<String>,
    /// Seconds the oldest `Ready` task has waited since it was issued
    /// (its current lease's creation).
    pub oldest_ready_seconds: Option<i64>,
    /// Aborted speculative attempts over all attempts that ended (aborts
    /// and counted attempts) of the queue's tasks; `None` without either.
    pub abort_rate: Option<f64>,
}

/// The queues of `tasks` (and their `leases`, and the `controls` of their
/// TaskQueues), sorted by namespace and name. A queue with a TaskQueue but
/// no tasks is shown too (paused before its tasks arrive, say).
/// Generic over [`Borrow`] so the dashboard passes its caches' `Arc`s
/// without cloning 10,000 tasks per look.
pub fn summarize<T: Borrow<BatchTask>, L: Borrow<TaskLease>, Q: Borrow<TaskQueue>>(
    tasks: &[T],
    leases: &[L],
    controls: &[Q],
    now: Timestamp,
) -> Vec<QueueStatus> {
    let mut queues: BTreeMap<(String, String), QueueStatus> = BTreeMap::new();
    let empty = |key: &(String, String)| QueueStatus {
        namespace: key.0.clone(),
        queue: key.1.clone(),
        paused: false,
        phases: BTreeMap::new(),
        holders: BTreeSet::new(),
        oldest_ready_seconds: None,
        abort_rate: None,
    };
    for tq in controls {
        let tq = tq.borrow();
        let key = (tq.namespace().unwrap_or_default(), tq.name_any());
        queues
            .entry(key.clone())
            .or_insert_with(|| empty(&key))
            .paused = tq.spec.paused;
    }
    let mut aborts: BTreeMap<(String, String), (i64, i64)> = BTreeMap::new();
    let created: BTreeMap<(String, String), Timestamp> = leases
        .iter()
        .filter_map(|l| {
            let l = l.borrow();
            let at = l.metadata.creation_timestamp.as_ref()?.0;
            Some(((l.namespace().unwrap_or_default(), l.name_any()), at))
        })
        .collect();
    for t in tasks {
        let t = t.borrow();
        let key = (t.namespace().unwrap_or_default(), t.spec.queue.clone());
        let q = queues.entry(key.clone()).or_insert_with(|| empty(&key));
        let status = t.status.clone().unwrap_or_default();
        let phase = status.phase.unwrap_or(TaskPhase::Pending);
        *q.phases.entry(phase.as_str().to_owned()).or_default() += 1;
        if phase == TaskPhase::Ready {
            let issued = status
                .current_lease
                .as_ref()
                .and_then(|l| created.get(&(key.0.clone(), l.clone())))
                .copied()
                .or_else(|| t.metadata.creation_timestamp.as_ref().map(|c| c.0));
            if let Some(issued) = issued {
                let waited = age::seconds(issued, now);
                q.oldest_ready_seconds =
                    Some(q.oldest_ready_seconds.map_or(waited, |o| o.max(waited)));
            }
        }
        let a = aborts.entry(key).or_default();
        a.0 += i64::from(status.aborts);
        a.1 += i64::from(status.attempts);
    }
    for l in leases {
        let l = l.borrow();
        let held = l.status.as_ref().and_then(|s| s.phase) == Some(LeasePhase::Held);
        let key = (l.namespace().unwrap_or_default(), l.spec.queue.clone());
        if let (true, Some(q), Some(h)) =
            (held, queues.get_mut(&key), l.spec.holder_identity.clone())
        {
            q.holders.insert(h);
        }
    }
    for (key, (aborted, attempts)) in aborts {
        if let Some(q) = queues.get_mut(&key) {
            let ended = aborted + attempts;
            q.abort_rate = (aborted > 0).then(|| aborted as f64 / ended as f64);
        }
    }
    queues.into_values().collect()
}

/// The phases shown as columns, in lifecycle order.
const COLUMNS: [TaskPhase; 7] = TaskPhase::ALL;

/// A table like `kubectl get` prints.
pub fn table(queues: &[QueueStatus], all_namespaces: bool) -> String {
    let mut rows = vec![];
    let mut header: Vec<String> = vec![];
    if all_namespaces {
        header.push("NAMESPACE".into());
    }
    header.extend(["QUEUE".into(), "PAUSED".into()]);
    header.extend(COLUMNS.iter().map(|p| p.as_str().to_uppercase()));
    header.extend(["OLDEST READY".into(), "ABORT RATE".into(), "HOLDERS".into()]);
    rows.push(header);
    for q in queues {
        let mut row = vec![];
        if all_namespaces {
            row.push(q.namespace.clone());
        }
        row.push(q.queue.clone());
        row.push(q.paused.to_string());
        for p in COLUMNS {
            row.push(q.phases.get(p.as_str()).copied().unwrap_or(0).to_string());
        }
        row.push(q.oldest_ready_seconds.map_or("<none>".into(), age::human));
        row.push(
            q.abort_rate
                .map_or("<none>".into(), |r| format!("{:.0}%", r * 100.0)),
        );
        let holders: Vec<&str> = q.holders.iter().map(String::as_str).collect();
        row.push(if holders.is_empty() {
            "<none>".into()
        } else {
            holders.join(",")
        });
        rows.push(row);
    }
    crate::render::columns(&rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{lease, task, task_queue, ts};

    #[test]
    fn counts_phases_holders_oldest_ready_and_aborts_per_queue() {
        let now = ts(1_000);
        let tasks = vec![
            task("a", "q", TaskPhase::Ready, |s| {
                s.current_lease = Some("a-1".into())
            }),
            task("b", "q", TaskPhase::Ready, |s| {
                s.current_lease = Some("b-1".into())
            }),
            task("c", "q", TaskPhase::Running, |s| {
                s.current_lease = Some("c-1".into())
            }),
            task("d", "q", TaskPhase::DeadLettered, |s| {
                s.attempts = 3;
                s.aborts = 1;
            }),
            task("e", "other", TaskPhase::Succeeded, |s| s.attempts = 1),
        ];
        let leases = vec![
            lease("a-1", "q", LeasePhase::Offered, None, ts(900)),
            lease("b-1", "q", LeasePhase::Offered, None, ts(400)),
            lease("c-1", "q", LeasePhase::Held, Some("w-0/ab"), ts(500)),
        ];
        let got = summarize(&tasks, &leases, &[] as &[TaskQueue], now);
        assert_eq!(got.len(), 2);
        let (other, q) = (&got[0], &got[1]);
        assert_eq!(other.queue, "other");
        assert_eq!(other.abort_rate, None);
        assert_eq!(q.queue, "q");
        assert!(!q.paused);
        assert_eq!(
            q.phases,
            BTreeMap::from([
                ("DeadLettered".into(), 1),
                ("Ready".into(), 2),
                ("Running".into(), 1)
            ])
        );
        assert_eq!(q.holders, BTreeSet::from(["w-0/ab".to_owned()]));
        assert_eq!(q.oldest_ready_seconds, Some(600));
        assert_eq!(q.abort_rate, Some(0.25));
        let text = table(&got, false);
        let lines: Vec<&str> = text.lines().collect();
        assert!(
            lines[0].starts_with("QUEUE   PAUSED   PENDING   READY"),
            "{text}"
        );
        assert!(
            lines[2].starts_with("q       false    0         2       1         0           1"),
            "{text}"
        );
        assert!(
            lines[2].contains("10m") && lines[2].contains("25%") && lines[2].ends_with("w-0/ab"),
            "{text}"
        );
    }

    #[test]
    fn marks_paused_queues_and_shows_a_task_queue_without_tasks() {
        let mut elsewhere = task("x", "q", TaskPhase::Ready, |_| {});
        elsewhere.metadata.namespace = Some("ns2".into());
        let tasks = vec![
            task("a", "q", TaskPhase::Running, |_| {}),
            task("b", "other", TaskPhase::Cancelled, |_| {}),
            elsewhere,
        ];
        let controls = vec![
            task_queue("q", true),
            task_queue("other", false),
            task_queue("idle", true),
        ];
        let got = summarize(&tasks, &[] as &[TaskLease], &controls, ts(0));
        let paused: Vec<(&str, &str, bool)> = got
            .iter()
            .map(|q| (q.namespace.as_str(), q.queue.as_str(), q.paused))
            .collect();
        assert_eq!(
            paused,
            [
                ("ns", "idle", true),
                ("ns", "other", false),
                ("ns", "q", true),
                ("ns2", "q", false),
            ]
        );
        assert_eq!(got[0].phases, BTreeMap::new());
        assert_eq!(
            table(&got, true),
            [
                "NAMESPACE   QUEUE   PAUSED   PENDING   READY   RUNNING   SUCCEEDED   DEADLETTERED   REJECTED   CANCELLED   OLDEST READY   ABORT RATE   HOLDERS",
                "ns          idle    true     0         0       0         0           0              0          0           <none>         <none>       <none>",
                "ns          other   false    0         0       0         0           0              0          1           <none>         <none>       <none>",
                "ns          q       true     0         0       1         0           0              0          0           <none>         <none>       <none>",
                "ns2         q       false    0         1       0         0           0              0          0           0s             <none>       <none>",
                "",
            ]
            .join("\n")
        );
        let json = serde_json::to_value(&got[2]).ok();
        assert_eq!(
            json.as_ref().map(|j| (&j["queue"], &j["paused"])),
            Some((&"q".into(), &true.into()))
        );
    }
}
