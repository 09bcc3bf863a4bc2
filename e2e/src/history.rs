//! The history checker: every TaskLease and BatchTask change in a test's
//! namespace, recorded from watches for the whole test, plus every write to
//! the fenced PostgreSQL table (from its audit trigger), checked at the end
//! against the protocol's invariants — not only the outcome a test
//! scripted.
//!
//! Checked (design §3, §4):
//! - per task, lease tokens strictly increase and no token is used by two
//!   leases (leases the operator issued: controlled by their task);
//! - never two leases of one task `Held` at once (in the watch's order,
//!   which is the API server's resourceVersion order);
//! - every committed PostgreSQL write carries the token of a lease of that
//!   task held by the worker that wrote it, and landed before that lease was
//!   seen `Expired`; at most one attempt's commit per task (exactly-once
//!   effect); every registration carries a token some lease of the task had;
//! - task graphs and resource locks: see [`crate::history_graph`];
//! - renewals per worker: no renewal keeps a revoked attempt alive, and
//!   the operator revokes before it ends one — see
//!   [`crate::history_workers`];
//! - speculative execution: every compensation ran or was kept by the one
//!   round that committed, none half-run — see [`crate::history_speculative`];
//! - optionally, every task ends `Succeeded`, `DeadLettered` or `Rejected`.
//!
//! A watch error is itself a violation (the record would have a gap),
//! unless the test injects control-plane faults and says so.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use batchlease_api::{BatchTask, LeasePhase, TaskLease, TaskPhase, WorkerLease};
use futures::StreamExt;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use tokio::task::JoinHandle;

/// One recorded change.
#[derive(Clone, Debug)]
pub enum Change {
    Lease(Box<TaskLease>),
    LeaseDeleted(Box<TaskLease>),
    Task(Box<BatchTask>),
    TaskDeleted(Box<BatchTask>),
    Worker(Box<WorkerLease>),
    WorkerDeleted(Box<WorkerLease>),
}

/// A change and when the watch delivered it (seconds since the epoch).
#[derive(Clone, Debug)]
pub struct Recorded {
    pub at: f64,
    pub change: Change,
}

/// One row of the fenced table's audit trigger.
#[derive(Clone, Debug, PartialEq)]
pub struct StorageWrite {
    pub task_uid: String,
    pub token: i64,
    /// `RUNNING` (a registration) or `COMPLETED` (a commit).
    pub status: String,
    /// The committing worker (commits only).
    pub worker: String,
    /// When the write committed (seconds since the epoch).
    pub at: f64,
}

#[derive(Default, Debug)]
struct Log {
    leases: Vec<Recorded>,
    tasks: Vec<Recorded>,
    workers: Vec<Recorded>,
    watch_errors: Vec<String>,
}

/// Records a namespace's history from the moment it is created.
#[derive(Debug)]
pub struct History {
    namespace: String,
    log: Arc<Mutex<Log>>,
    watches: Vec<JoinHandle<()>>,
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl History {
    /// Starts both watches and returns once each delivered its first list,
    /// so nothing the test does afterwards can be missed.
    pub async fn record(client: &Client, namespace: &str) -> anyhow::Result<Self> {
        let log = Arc::new(Mutex::new(Log::default()));
        let (lease_ready, lease_listed) = tokio::sync::oneshot::channel();
        let (task_ready, task_listed) = tokio::sync::oneshot::channel();
        let leases = spawn_watch::<TaskLease>(
            Api::namespaced(client.clone(), namespace),
            log.clone(),
            lease_ready,
            |l| Change::Lease(Box::new(l)),
            |l| Change::LeaseDeleted(Box::new(l)),
            |log| &mut log.leases,
        );
        let tasks = spawn_watch::<BatchTask>(
            Api::namespaced(client.clone(), namespace),
            log.clone(),
            task_ready,
            |t| Change::Task(Box::new(t)),
            |t| Change::TaskDeleted(Box::new(t)),
            |log| &mut log.tasks,
        );
        let (worker_ready, worker_listed) = tokio::sync::oneshot::channel();
        let workers = spawn_watch::<WorkerLease>(
            Api::namespaced(client.clone(), namespace),
            log.clone(),
            worker_ready,
            |w| Change::Worker(Box::new(w)),
            |w| Change::WorkerDeleted(Box::new(w)),
            |log| &mut log.workers,
        );
        let listed = async {
            lease_listed.await?;
            worker_listed.await?;
            task_listed.await
        };
        tokio::time::timeout(std::time::Duration::from_secs(30), listed)
            .await
            .map_err(|_| anyhow::anyhow!("history watches did not list within 30s"))??;
        Ok(Self {
            namespace: namespace.to_owned(),
            log,
            watches: vec![leases, tasks, workers],
        })
    }

    /// Waits until the watches have delivered every task and lease as the
    /// API server has it now (its current resourceVersion is recorded):
    /// a check that runs right after the test's last write must not judge
    /// a history whose last events are still on their way (a task seen
    /// `Running` while it is `Succeeded`).
    pub async fn catch_up(&self, client: &Client, namespace: &str) -> anyhow::Result<()> {
        let tasks: Api<BatchTask> = Api::namespaced(client.clone(), namespace);
        let leases: Api<TaskLease> = Api::namespaced(client.clone(), namespace);
        let mut want: BTreeSet<(String, String)> = BTreeSet::new();
        for t in tasks.list(&Default::default()).await? {
            want.insert((
                format!("task/{}", t.name_any()),
                t.resource_version().unwrap_or_default(),
            ));
        }
        for l in leases.list(&Default::default()).await? {
            want.insert((
                format!("lease/{}", l.name_any()),
                l.resource_version().unwrap_or_default(),
            ));
        }
        let log = self.log.clone();
        let missing = move || {
            let log = log.lock().unwrap_or_else(|e| e.into_inner());
            let seen: BTreeSet<(String, String)> = log
                .tasks
                .iter()
                .chain(log.leases.iter())
                .filter_map(|r| match &r.change {
                    Change::Task(t) => {
                        Some((format!("task/{}", t.name_any()), t.resource_version()?))
                    }
                    Change::Lease(l) => {
                        Some((format!("lease/{}", l.name_any()), l.resource_version()?))
                    }
                    _ => None,
                })
                .collect();
            want.difference(&seen).cloned().collect::<Vec<_>>()
        };
        let diag = missing.clone();
        crate::wait::wait_for(
            "the history watches caught up with the API server",
            std::time::Duration::from_secs(30),
            move || format!("not yet recorded: {:?}", diag()),
            || {
                let m = missing();
                async move { Ok(m.is_empty().then_some(())) }
            },
        )
        .await
    }

    /// The recorded lease and task changes so far.
    pub fn snapshot(&self) -> (Vec<Recorded>, Vec<Recorded>, Vec<String>) {
        let log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        (
            log.leases.clone(),
            log.tasks.clone(),
            log.watch_errors.clone(),
        )
    }

    /// The recorded WorkerLease changes so far.
    pub fn workers(&self) -> Vec<Recorded> {
        let log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        log.workers.clone()
    }

    /// Every check of the module docs; the list of violations (empty: ok).
    pub async fn violations(&self, opts: &Checks) -> anyhow::Result<Vec<String>> {
        let (leases, tasks, errors) = self.snapshot();
        let mut out = Vec::new();
        if !opts.tolerate_watch_errors {
            out.extend(
                errors
                    .iter()
                    .map(|e| format!("watch error (gap in the record): {e}")),
            );
        }
        out.extend(check_leases(&leases));
        out.extend(crate::history_workers::check_worker_leases(
            &self.workers(),
            &leases,
            errors.is_empty(),
        ));
        out.extend(crate::history_workers::check_addressed(&leases));
        out.extend(crate::history_workers::check_bound(
            &self.workers(),
            &leases,
            !opts.tolerate_watch_errors,
        ));
        out.extend(crate::history_graph::check_graph(&tasks));
        out.extend(crate::history_graph::check_lock_leases(
            &leases,
            errors.is_empty(),
        ));
        let uids: BTreeSet<String> = tasks
            .iter()
            .filter_map(|r| match &r.change {
                Change::Task(t) | Change::TaskDeleted(t) => t.uid(),
                _ => None,
            })
            .collect();
        let mut writes = Vec::new();
        if std::env::var_os("BATCHLEASE_PG_URL").is_some() && !uids.is_empty() {
            writes = storage_writes(&uids).await?;
            out.extend(check_storage(&leases, &writes));
            let resources = resource_writes(&uids).await?;
            out.extend(crate::history_graph::check_occupancy(&resources));
            let (log, committed) = crate::history_speculative::read(&uids).await?;
            out.extend(crate::history_speculative::check_compensations(
                &log, &committed,
            ));
        }
        // The API server's own record of when each write took effect (the
        // control plane of `e2e/controlplane/up.sh` always writes one).
        let server = match std::env::var_os("BATCHLEASE_AUDIT_LOG") {
            Some(_) => Some(crate::audit::writes_in(&self.namespace)?),
            None => None,
        };
        out.extend(crate::history_controls::check_cancel(
            &tasks,
            &leases,
            &writes,
            server.as_deref(),
        ));
        if opts.all_final {
            out.extend(check_final(&tasks));
        }
        Ok(out)
    }
}

impl Drop for History {
    fn drop(&mut self) {
        for w in &self.watches {
            w.abort();
        }
    }
}

/// What to check beyond the safety invariants.
#[derive(Debug, Clone, Copy, Default)]
pub struct Checks {
    /// Every task (not deleted) ends Succeeded, DeadLettered or Rejected.
    pub all_final: bool,
    /// The test restarts the control plane: watch errors are expected.
    pub tolerate_watch_errors: bool,
}

fn spawn_watch<K>(
    api: Api<K>,
    log: Arc<Mutex<Log>>,
    listed: tokio::sync::oneshot::Sender<()>,
    applied: fn(K) -> Change,
    deleted: fn(K) -> Change,
    into: fn(&mut Log) -> &mut Vec<Recorded>,
) -> JoinHandle<()>
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    tokio::spawn(async move {
        let mut listed = Some(listed);
        let stream = watcher(api, watcher::Config::default())
            .backoff(batchlease_api::WatchBackoff::new(rand::random));
        futures::pin_mut!(stream);
        while let Some(ev) = stream.next().await {
            let at = now();
            let mut log = log.lock().unwrap_or_else(|e| e.into_inner());
            match ev {
                Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => {
                    into(&mut log).push(Recorded {
                        at,
                        change: applied(o),
                    });
                }
                Ok(watcher::Event::Delete(o)) => into(&mut log).push(Recorded {
                    at,
                    change: deleted(o),
                }),
                Ok(watcher::Event::InitDone) => {
                    if let Some(tx) = listed.take() {
                        let _ = tx.send(());
                    }
                }
                Ok(watcher::Event::Init) => {}
                Err(e) => log.watch_errors.push(e.to_string()),
            }
        }
    })
}

/// A lease the operator issued: controlled by its task.
pub(crate) fn issued(l: &TaskLease) -> bool {
    l.owner_references()
        .iter()
        .any(|o| o.kind == "BatchTask" && o.controller == Some(true) && o.uid == l.spec.task_uid)
}

/// A final lease the operator created to retire a token.
pub(crate) fn tombstone(l: &TaskLease) -> bool {
    let st = l.status.as_ref();
    st.and_then(|s| s.phase) == Some(LeasePhase::Released)
        && st.and_then(|s| s.reason.as_deref()) == Some("TokenRetired")
        && l.spec.holder_identity.is_none()
}

fn phase(l: &TaskLease) -> Option<LeasePhase> {
    l.status.as_ref().and_then(|s| s.phase)
}

/// Token order, token reuse, and at most one Held lease per task.
pub fn check_leases(leases: &[Recorded]) -> Vec<String> {
    let mut out = Vec::new();
    // task UID → (lease UID → token) in order of first appearance.
    let mut tokens: BTreeMap<String, Vec<(String, i64, String)>> = BTreeMap::new();
    // lease UID → (task UID, name) while Held.
    let mut held: BTreeMap<String, (String, String)> = BTreeMap::new();
    for r in leases {
        let (l, gone) = match &r.change {
            Change::Lease(l) => (l, false),
            Change::LeaseDeleted(l) => (l, true),
            _ => continue,
        };
        if !issued(l) {
            continue;
        }
        let uid = l.uid().unwrap_or_default();
        let task = l.spec.task_uid.clone();
        let name = l.name_any();
        // A tombstone (created final to retire a token whose lease went
        // missing) is never live: it does not "use" its token again.
        if tombstone(l) {
            continue;
        }
        let seen = tokens.entry(task.clone()).or_default();
        if !seen.iter().any(|(u, _, _)| *u == uid) {
            if let Some((_, _, other)) = seen.iter().find(|(_, t, _)| *t == l.spec.fencing_token) {
                out.push(format!(
                    "task {}: token {} used by two leases ({other} and {name})",
                    l.spec.task_name, l.spec.fencing_token
                ));
            } else if let Some((_, last, prev)) = seen.last()
                && *last > l.spec.fencing_token
            {
                out.push(format!(
                    "task {}: lease {name} (token {}) created after {prev} (token {last})",
                    l.spec.task_name, l.spec.fencing_token
                ));
            }
            seen.push((uid.clone(), l.spec.fencing_token, name.clone()));
        }
        if !gone && phase(l) == Some(LeasePhase::Held) {
            held.insert(uid, (task.clone(), name.clone()));
        } else {
            held.remove(&uid);
        }
        let now_held: Vec<&String> = held
            .values()
            .filter(|(t, _)| *t == task)
            .map(|(_, n)| n)
            .collect();
        if now_held.len() > 1 {
            out.push(format!(
                "task {}: leases {now_held:?} Held at once",
                l.spec.task_name
            ));
        }
    }
    out
}

/// What the lease record says of one attempt.
#[derive(Debug, Default)]
struct Attempt {
    holder: Option<String>,
    expired_at: Option<f64>,
}

/// PostgreSQL writes against the lease record.
pub fn check_storage(leases: &[Recorded], writes: &[StorageWrite]) -> Vec<String> {
    let mut attempts: BTreeMap<(String, i64), Attempt> = BTreeMap::new();
    for r in leases {
        let Change::Lease(l) = &r.change else {
            continue;
        };
        if !issued(l) {
            continue;
        }
        let a = attempts
            .entry((l.spec.task_uid.clone(), l.spec.fencing_token))
            .or_default();
        if let Some(h) = &l.spec.holder_identity {
            a.holder = Some(h.clone());
        }
        if phase(l) == Some(LeasePhase::Expired) && a.expired_at.is_none() {
            a.expired_at = Some(r.at);
        }
    }
    let mut out = Vec::new();
    let mut commits: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
    for w in writes {
        let Some(a) = attempts.get(&(w.task_uid.clone(), w.token)) else {
            out.push(format!(
                "storage: {} write with token {} for task {}, which no lease of the task carried",
                w.status, w.token, w.task_uid
            ));
            continue;
        };
        if w.status != "COMPLETED" {
            continue;
        }
        commits.entry(&w.task_uid).or_default().push(w.token);
        if a.holder.as_deref() != Some(w.worker.as_str()) {
            out.push(format!(
                "storage: task {} committed with token {} by {:?}, but that lease was held by {:?}",
                w.task_uid, w.token, w.worker, a.holder
            ));
        }
        if let Some(e) = a.expired_at
            && w.at >= e
        {
            out.push(format!(
                "storage: task {} committed with token {} at {:.3}, after its lease was seen Expired at {e:.3}",
                w.task_uid, w.token, w.at
            ));
        }
    }
    for (task, tokens) in commits {
        if tokens.len() > 1 {
            out.push(format!(
                "storage: task {task} committed {} times (tokens {tokens:?}): not exactly once",
                tokens.len()
            ));
        }
    }
    out
}

/// Every task not deleted ends Succeeded, DeadLettered or Rejected.
pub fn check_final(tasks: &[Recorded]) -> Vec<String> {
    let mut last: BTreeMap<String, Option<TaskPhase>> = BTreeMap::new();
    for r in tasks {
        match &r.change {
            Change::Task(t) => {
                last.insert(t.name_any(), t.status.as_ref().and_then(|s| s.phase));
            }
            Change::TaskDeleted(t) => {
                last.remove(&t.name_any());
            }
            _ => {}
        }
    }
    last.into_iter()
        .filter(|(_, p)| !p.is_some_and(TaskPhase::is_terminal))
        .map(|(name, p)| format!("task {name} is stuck in {p:?}"))
        .collect()
}

async fn storage_writes(uids: &BTreeSet<String>) -> anyhow::Result<Vec<StorageWrite>> {
    if uids.is_empty() {
        return Ok(Vec::new());
    }
    let db = crate::pg::connect().await?;
    let ids: Vec<String> = uids.iter().cloned().collect();
    let rows = db
        .query(
            "SELECT task_id, token, coalesce(status, ''), coalesce(worker, ''),
                    extract(epoch from at)::float8
               FROM task_state_audit WHERE task_id = ANY($1) ORDER BY at",
            &[&ids],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| StorageWrite {
            task_uid: r.get(0),
            token: r.get(1),
            status: r.get(2),
            worker: r.get(3),
            at: r.get(4),
        })
        .collect())
}

/// The resource fence's audit rows written by these tasks' attempts.
async fn resource_writes(
    uids: &BTreeSet<String>,
) -> anyhow::Result<Vec<crate::history_graph::ResourceWrite>> {
    let db = crate::pg::connect().await?;
    let ids: Vec<String> = uids.iter().cloned().collect();
    let rows = db
        .query(
            "SELECT namespace || '/' || resource, token, coalesce(status, ''),
                    extract(epoch from at)::float8
               FROM resource_fence_audit WHERE task_id = ANY($1) ORDER BY at",
            &[&ids],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| crate::history_graph::ResourceWrite {
            resource: r.get(0),
            token: r.get(1),
            status: r.get(2),
            at: r.get(3),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use batchlease_api::{TaskLeaseSpec, TaskLeaseStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

    fn lease(uid: &str, token: i64, phase: LeasePhase, holder: Option<&str>) -> Recorded {
        let mut l = TaskLease::new(
            &format!("t-{token}"),
            TaskLeaseSpec::offered("t", "task-uid", "q", token, 30),
        );
        l.metadata.uid = Some(uid.into());
        l.metadata.owner_references = Some(vec![OwnerReference {
            api_version: "batchlease.dev/v1alpha1".into(),
            kind: "BatchTask".into(),
            name: "t".into(),
            uid: "task-uid".into(),
            controller: Some(true),
            block_owner_deletion: None,
        }]);
        l.spec.holder_identity = holder.map(Into::into);
        l.status = Some(TaskLeaseStatus {
            phase: Some(phase),
            ..Default::default()
        });
        Recorded {
            at: 100.0 + token as f64,
            change: Change::Lease(Box::new(l)),
        }
    }

    fn write(token: i64, status: &str, worker: &str, at: f64) -> StorageWrite {
        StorageWrite {
            task_uid: "task-uid".into(),
            token,
            status: status.into(),
            worker: worker.into(),
            at,
        }
    }

    #[test]
    fn a_clean_history_passes() {
        let h = vec![
            lease("a", 1, LeasePhase::Offered, None),
            lease("a", 1, LeasePhase::Held, Some("w1")),
            lease("a", 1, LeasePhase::Expired, Some("w1")),
            lease("b", 2, LeasePhase::Offered, None),
            lease("b", 2, LeasePhase::Held, Some("w2")),
            lease("b", 2, LeasePhase::Completed, Some("w2")),
        ];
        assert!(check_leases(&h).is_empty());
        let writes = [
            write(1, "RUNNING", "", 101.0),
            write(2, "RUNNING", "", 102.0),
            write(2, "COMPLETED", "w2", 102.5),
        ];
        assert!(check_storage(&h, &writes).is_empty());
    }

    #[test]
    fn each_violation_is_found() {
        // Token reuse (the repair bug) and two Held at once.
        let h = vec![
            lease("a", 1, LeasePhase::Held, Some("w1")),
            lease("a2", 1, LeasePhase::Held, Some("w2")),
        ];
        let v = check_leases(&h);
        assert!(v.iter().any(|m| m.contains("used by two leases")), "{v:?}");
        assert!(v.iter().any(|m| m.contains("Held at once")), "{v:?}");
        // Tokens going backwards.
        let h = vec![
            lease("b", 2, LeasePhase::Offered, None),
            lease("a", 1, LeasePhase::Offered, None),
        ];
        assert!(check_leases(&h)[0].contains("created after"));
        // Storage: a zombie's commit after expiry, by the wrong worker, twice.
        let h = vec![
            lease("a", 1, LeasePhase::Held, Some("w1")),
            lease("a", 1, LeasePhase::Expired, Some("w1")),
            lease("b", 2, LeasePhase::Held, Some("w2")),
        ];
        let writes = [
            write(1, "COMPLETED", "w1", 200.0),
            write(2, "COMPLETED", "w3", 102.5),
            write(7, "RUNNING", "", 103.0),
        ];
        let v = check_storage(&h, &writes);
        assert!(
            v.iter()
                .any(|m| m.contains("after its lease was seen Expired")),
            "{v:?}"
        );
        assert!(
            v.iter().any(|m| m.contains("held by Some(\"w2\")")),
            "{v:?}"
        );
        assert!(v.iter().any(|m| m.contains("not exactly once")), "{v:?}");
        assert!(
            v.iter().any(|m| m.contains("no lease of the task carried")),
            "{v:?}"
        );
    }

    #[test]
    fn a_tombstone_does_not_use_its_token_again() {
        let mut stone = lease("s", 1, LeasePhase::Released, None);
        if let Change::Lease(l) = &mut stone.change {
            l.status.as_mut().unwrap().reason = Some("TokenRetired".into());
        }
        let h = vec![
            lease("a", 1, LeasePhase::Held, Some("w1")),
            stone,
            lease("b", 2, LeasePhase::Offered, None),
        ];
        assert!(check_leases(&h).is_empty(), "{:?}", check_leases(&h));
    }

    #[test]
    fn foreign_leases_are_not_the_operators() {
        let mut forged = lease("f", i64::MAX, LeasePhase::Held, Some("mallory"));
        if let Change::Lease(l) = &mut forged.change {
            l.metadata.owner_references = None;
        }
        let h = vec![forged, lease("a", 1, LeasePhase::Held, Some("w1"))];
        assert!(check_leases(&h).is_empty());
    }
}
