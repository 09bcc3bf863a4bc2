//! The locks page: every resource named by a task, who holds it and who
//! waits for it.
//!
//! The lock Leases themselves live in the operator's namespace, which a
//! tenant usually cannot read; what a tenant can read is enough: a live
//! TaskLease (Offered or Held) carries the lock tokens of its attempt in
//! `spec.resourceTokens`, so its task holds those resources, and an
//! unfinished Exclusive task that needs a resource it does not hold waits
//! for it — unless it waits for a dependency or a retry's backoff. (While
//! the operator is still taking a task's locks, before its lease exists,
//! the task shows as waiting.)

use std::collections::{BTreeMap, BTreeSet};

use batchlease_api::{BatchTask, LeasePhase, TaskMode, TaskPhase};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use serde::Serialize;

use super::snapshot::{Snapshot, phase};
use crate::age;

/// The holder of a resource.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Holder {
    pub task: String,
    /// The task's lease token.
    pub token: i64,
    /// The lock's own fencing token.
    pub lock_token: i64,
    pub holder: Option<String>,
}

/// A task waiting for a resource.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Waiter {
    pub task: String,
    /// Seconds since the task was created or its last attempt ended.
    pub waiting_seconds: Option<i64>,
}

/// One resource of one namespace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LockRow {
    pub namespace: String,
    pub resource: String,
    pub holder: Option<Holder>,
    /// Oldest first (the order the operator serves them in).
    pub waiters: Vec<Waiter>,
}

fn waiting_since(t: &BatchTask) -> Option<Timestamp> {
    let st = t.status.as_ref();
    st.and_then(|s| s.history.last())
        .and_then(|h| h.end.as_ref().map(|e| e.0))
        .or_else(|| t.metadata.creation_timestamp.as_ref().map(|c| c.0))
}

/// Every resource some task names, sorted by namespace and resource.
pub fn locks(snap: &Snapshot, now: Timestamp) -> Vec<LockRow> {
    let mut rows: BTreeMap<(String, String), LockRow> = BTreeMap::new();
    fn row<'a>(
        rows: &'a mut BTreeMap<(String, String), LockRow>,
        ns: &str,
        r: &str,
    ) -> &'a mut LockRow {
        rows.entry((ns.to_owned(), r.to_owned()))
            .or_insert_with(|| LockRow {
                namespace: ns.to_owned(),
                resource: r.to_owned(),
                holder: None,
                waiters: vec![],
            })
    }
    for l in &snap.leases {
        let live = matches!(
            l.status.as_ref().and_then(|s| s.phase),
            Some(LeasePhase::Offered | LeasePhase::Held)
        );
        if !live {
            continue;
        }
        let ns = l.namespace().unwrap_or_default();
        for (r, lock_token) in &l.spec.resource_tokens {
            row(&mut rows, &ns, r).holder = Some(Holder {
                task: l.spec.task_name.clone(),
                token: l.spec.fencing_token,
                lock_token: *lock_token,
                holder: l.spec.holder_identity.clone(),
            });
        }
    }
    let mut tasks: Vec<&BatchTask> = snap.tasks.iter().map(|t| &**t).collect();
    tasks.sort_by(|a, b| {
        let created = |t: &BatchTask| t.metadata.creation_timestamp.as_ref().map(|c| c.0);
        created(a)
            .cmp(&created(b))
            .then_with(|| a.metadata.name.cmp(&b.metadata.name))
    });
    let succeeded: BTreeSet<(&str, &str)> = snap
        .tasks
        .iter()
        .filter(|t| phase(t) == TaskPhase::Succeeded)
        .filter_map(|t| {
            Some((
                t.metadata.namespace.as_deref()?,
                t.metadata.name.as_deref()?,
            ))
        })
        .collect();
    for t in tasks {
        let ns = t.namespace().unwrap_or_default();
        let name = t.name_any();
        let mode = t
            .status
            .as_ref()
            .and_then(|s| s.effective_mode)
            .unwrap_or(t.spec.mode);
        // Pending for another reason than a lock: a dependency not yet
        // Succeeded, or a retry's backoff still running.
        let deps_done = t
            .spec
            .depends_on
            .iter()
            .all(|d| succeeded.contains(&(ns.as_str(), d.as_str())));
        let backing_off = t
            .status
            .as_ref()
            .and_then(|s| s.next_attempt_after.as_ref())
            .is_some_and(|a| a.0 > now);
        let may_wait = mode == TaskMode::Exclusive
            && phase(t) == TaskPhase::Pending
            && !t.spec.cancel
            && deps_done
            && !backing_off;
        let mut resources: Vec<&String> = t.spec.resources.iter().collect();
        resources.sort();
        resources.dedup();
        for r in resources {
            let row = row(&mut rows, &ns, r);
            let holds = row.holder.as_ref().is_some_and(|h| h.task == name);
            if may_wait && !holds {
                row.waiters.push(Waiter {
                    task: name.clone(),
                    waiting_seconds: waiting_since(t).map(|s| age::seconds(s, now)),
                });
            }
        }
    }
    rows.into_values().collect()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::fixtures::{lease, task, ts};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    #[test]
    fn holders_come_from_live_leases_and_waiters_oldest_first() {
        let mk = |name: &str, p: TaskPhase, created: i64, res: &[&str]| {
            let mut t = task(name, "q", p, |_| {});
            t.metadata.creation_timestamp = Some(Time(ts(created)));
            t.spec.resources = res.iter().map(|r| r.to_string()).collect();
            t
        };
        let mut spec = mk("spec", TaskPhase::Pending, 0, &["db"]);
        spec.spec.mode = TaskMode::Speculative;
        let mut cancelled = mk("gone", TaskPhase::Pending, 0, &["db"]);
        cancelled.spec.cancel = true;
        let mut after = mk("after", TaskPhase::Pending, 0, &["db", "db"]);
        after.spec.depends_on = vec!["late".into()];
        let mut backoff = mk("backoff", TaskPhase::Pending, 0, &["db"]);
        if let Some(s) = backoff.status.as_mut() {
            s.next_attempt_after = Some(Time(ts(500)));
        }
        let mut held = lease("a-4", "q", LeasePhase::Held, Some("w/1"), ts(1));
        held.spec.resource_tokens = BTreeMap::from([("db".into(), 9)]);
        let mut old = lease("z-1", "q", LeasePhase::Completed, Some("w/2"), ts(1));
        old.spec.resource_tokens = BTreeMap::from([("gpu".into(), 2)]);
        let snap = Snapshot {
            tasks: vec![
                Arc::new(mk("a", TaskPhase::Running, 1, &["db"])),
                Arc::new(mk("late", TaskPhase::Pending, 30, &["db", "gpu"])),
                Arc::new(mk("early", TaskPhase::Pending, 20, &["db"])),
                Arc::new(spec),
                Arc::new(cancelled),
                Arc::new(after),
                Arc::new(backoff),
                Arc::new(mk("done", TaskPhase::Succeeded, 0, &["gpu"])),
            ],
            leases: vec![Arc::new(held), Arc::new(old)],
            queues: vec![],
        };
        let rows = locks(&snap, ts(100));
        assert_eq!(rows.len(), 2);
        let db = &rows[0];
        assert_eq!(db.resource, "db");
        assert_eq!(
            db.holder,
            Some(Holder {
                task: "a".into(),
                token: 4,
                lock_token: 9,
                holder: Some("w/1".into())
            })
        );
        let w: Vec<(&str, Option<i64>)> = db
            .waiters
            .iter()
            .map(|w| (w.task.as_str(), w.waiting_seconds))
            .collect();
        assert_eq!(w, vec![("early", Some(80)), ("late", Some(70))]);
        // A completed lease holds nothing.
        assert_eq!(rows[1].resource, "gpu");
        assert_eq!(rows[1].holder, None);
        assert_eq!(rows[1].waiters.len(), 1);
    }
}
