//! One task: its graph (what it depends on, what it spawned, who spawned
//! it), its attempts as a timeline, and its resource locks.
//!
//! An attempt is a fencing token. What is known of it comes from two
//! places that overlap: its TaskLease (holder, claim, last renewal, last
//! checkpoint, how it ended — while the lease exists) and the task's
//! `status.history` (the last ten attempts as the operator settled them,
//! with issue and end times — after the lease is gone). The journal adds
//! every renewal and checkpoint the dashboard saw.

use std::collections::BTreeMap;

use batchlease_api::{BatchTask, LeasePhase, TaskLease, TaskPhase};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use serde::Serialize;

use super::journal::{Journal, Mark};
use super::snapshot::{Snapshot, phase};

/// A task in the graph.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Node {
    pub name: String,
    /// `None`: no such task (a dependency not created yet, or deleted).
    pub phase: Option<&'static str>,
}

/// One attempt, by fencing token.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Attempt {
    pub token: i64,
    pub lease: Option<String>,
    pub holder: Option<String>,
    /// The lease's phase, while the lease exists.
    pub lease_phase: Option<String>,
    /// How it ended: the history's outcome (`Succeeded`, `Failed`,
    /// `Aborted`, `Interrupted`, `Expired`, `Released`), else the lease's.
    pub outcome: Option<String>,
    pub reason: Option<String>,
    pub message: Option<String>,
    pub lease_duration_seconds: Option<i32>,
    /// When the lease was issued (created).
    pub issued: Option<Timestamp>,
    /// When the holder claimed it (the holder's clock).
    pub claimed: Option<Timestamp>,
    /// Every renewal time seen (the holder's clock), oldest first.
    pub renewals: Vec<Timestamp>,
    /// Renewals before the dashboard's journal began or past its bound.
    pub renewals_unseen: bool,
    /// When each new checkpoint was seen.
    pub checkpoints: Vec<Timestamp>,
    /// When it ended: the operator's settle time, else when the dashboard
    /// saw the lease's final phase.
    pub ended: Option<Timestamp>,
    /// The attempt's write was committed under this token (it completed
    /// `Succeeded`: the worker's fenced commit came first).
    pub committed: bool,
}

/// A resource lock of the task.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskLock {
    pub resource: String,
    /// The lock's fencing token given to this task's current attempt.
    pub token: Option<i64>,
    /// The task whose live lease holds the resource, if any (this task or
    /// another).
    pub held_by: Option<String>,
}

/// What the task page shows.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskDetail {
    pub namespace: String,
    pub name: String,
    pub queue: String,
    pub phase: &'static str,
    pub mode: String,
    pub fencing_token: i64,
    pub attempts_spent: i32,
    pub max_retries: i32,
    pub holder: Option<String>,
    pub cancel_requested: bool,
    pub labels: BTreeMap<String, String>,
    pub payload: Option<String>,
    pub checkpoint: Option<String>,
    pub result: Option<String>,
    pub last_failure: Option<String>,
    pub parent: Option<Node>,
    pub depends_on: Vec<Node>,
    pub dependents: Vec<Node>,
    pub children: Vec<Node>,
    pub attempts: Vec<Attempt>,
    pub locks: Vec<TaskLock>,
    /// Cancel makes sense (not finished, not already requested).
    pub can_cancel: bool,
    pub can_redrive: bool,
}

/// Phases by name, built once per page (a task with 1,000 children must
/// not scan the namespace 1,000 times).
type Phases<'a> = BTreeMap<&'a str, &'static str>;

fn node(phases: &Phases<'_>, name: &str) -> Node {
    Node {
        name: name.to_owned(),
        phase: phases.get(name).copied(),
    }
}

fn is_live(l: &TaskLease) -> bool {
    matches!(
        l.status.as_ref().and_then(|s| s.phase),
        Some(LeasePhase::Offered | LeasePhase::Held)
    )
}

/// The leases of task `namespace/name` as `(namespace, name)`: the
/// journal entries its page needs.
pub fn lease_keys<'a>(snap: &'a Snapshot, namespace: &str, name: &str) -> Vec<(&'a str, &'a str)> {
    let Some(uid) = snap
        .task(namespace, name)
        .and_then(|t| t.metadata.uid.clone())
    else {
        return vec![];
    };
    snap.leases
        .iter()
        .filter(|l| l.spec.task_uid == uid)
        .filter_map(|l| {
            Some((
                l.metadata.namespace.as_deref()?,
                l.metadata.name.as_deref()?,
            ))
        })
        .collect()
}

/// The task page of `namespace/name`, or `None` if there is no such task.
pub fn detail(
    snap: &Snapshot,
    journal: &Journal,
    namespace: &str,
    name: &str,
) -> Option<TaskDetail> {
    let t = snap.task(namespace, name)?;
    let uid = t.metadata.uid.clone().unwrap_or_default();
    let st = t.status.clone().unwrap_or_default();
    let same_ns: Vec<&BatchTask> = snap
        .tasks
        .iter()
        .map(|t| &**t)
        .filter(|x| x.metadata.namespace.as_deref() == Some(namespace))
        .collect();
    let phases: Phases<'_> = same_ns
        .iter()
        .filter_map(|x| Some((x.metadata.name.as_deref()?, phase(x).as_str())))
        .collect();
    let controller_of = |x: &BatchTask| {
        x.owner_references()
            .iter()
            .find(|o| o.controller == Some(true) && o.kind == "BatchTask")
            .cloned()
    };
    let parent = controller_of(t).map(|o| node(&phases, &o.name));
    let mut children: Vec<Node> = same_ns
        .iter()
        .filter(|x| controller_of(x).is_some_and(|o| o.uid == uid))
        .map(|x| node(&phases, &x.name_any()))
        .collect();
    children.sort_by(|a, b| a.name.cmp(&b.name));
    let mut dependents: Vec<Node> = same_ns
        .iter()
        .filter(|x| x.spec.depends_on.iter().any(|d| d == name))
        .map(|x| node(&phases, &x.name_any()))
        .collect();
    dependents.sort_by(|a, b| a.name.cmp(&b.name));
    let leases: Vec<&TaskLease> = snap
        .leases
        .iter()
        .map(|l| &**l)
        .filter(|l| l.metadata.namespace.as_deref() == Some(namespace))
        .collect();
    let attempts = attempts(t, &leases, journal);
    let current = st
        .current_lease
        .as_ref()
        .and_then(|c| leases.iter().find(|l| &l.name_any() == c));
    let mut resources = t.spec.resources.clone();
    resources.sort();
    resources.dedup();
    let locks = resources
        .into_iter()
        .map(|r| TaskLock {
            token: current.and_then(|l| l.spec.resource_tokens.get(&r).copied()),
            held_by: leases
                .iter()
                .find(|l| is_live(l) && l.spec.resource_tokens.contains_key(&r))
                .map(|l| l.spec.task_name.clone()),
            resource: r,
        })
        .collect();
    let ph = phase(t);
    let text = |j: &Option<batchlease_api::JsonObject>| j.as_ref().map(|j| j.as_str().to_owned());
    Some(TaskDetail {
        namespace: namespace.to_owned(),
        name: name.to_owned(),
        queue: t.spec.queue.clone(),
        phase: ph.as_str(),
        mode: format!("{:?}", st.effective_mode.unwrap_or(t.spec.mode)),
        fencing_token: st.fencing_token,
        attempts_spent: st.attempts,
        max_retries: t.spec.max_retries,
        holder: st.holder.clone(),
        cancel_requested: t.spec.cancel,
        labels: t.metadata.labels.clone().unwrap_or_default(),
        payload: text(&t.spec.payload),
        checkpoint: text(&st.checkpoint),
        result: text(&st.result),
        last_failure: st
            .last_failure
            .as_ref()
            .map(|f| format!("{}: {}", f.reason, f.message)),
        parent,
        depends_on: t.spec.depends_on.iter().map(|d| node(&phases, d)).collect(),
        dependents,
        children,
        attempts,
        locks,
        can_cancel: !ph.is_terminal() && !t.spec.cancel,
        can_redrive: matches!(ph, TaskPhase::DeadLettered | TaskPhase::Rejected),
    })
}

/// The task's attempts, by token, from its leases, its history and the
/// journal.
fn attempts(t: &BatchTask, leases: &[&TaskLease], journal: &Journal) -> Vec<Attempt> {
    let uid = t.metadata.uid.clone().unwrap_or_default();
    let mut by_token: BTreeMap<i64, Attempt> = BTreeMap::new();
    for l in leases.iter().filter(|l| l.spec.task_uid == uid) {
        let st = l.status.clone().unwrap_or_default();
        let a = by_token.entry(l.spec.fencing_token).or_default();
        a.token = l.spec.fencing_token;
        a.lease = Some(l.name_any());
        a.holder = l.spec.holder_identity.clone();
        a.lease_phase = st.phase.map(|p| format!("{p:?}"));
        a.outcome = st
            .outcome
            .map(|o| format!("{o:?}"))
            .or_else(|| match st.phase {
                Some(p @ (LeasePhase::Expired | LeasePhase::Released)) => Some(format!("{p:?}")),
                _ => None,
            });
        a.reason = st.reason.clone();
        a.message = st.message.clone();
        a.lease_duration_seconds = Some(l.spec.lease_duration_seconds);
        a.issued = l.metadata.creation_timestamp.as_ref().map(|c| c.0);
        a.claimed = l.spec.acquire_time.as_ref().map(|c| c.0);
        let last_renewal = l.spec.renew_time.as_ref().map(|r| r.0);
        let ns = l.namespace().unwrap_or_default();
        match journal.marks(&ns, &l.name_any()) {
            Some(m) => {
                for mark in &m.marks {
                    match mark {
                        Mark::Renewal { at } => a.renewals.push(*at),
                        Mark::Checkpoint { seen, .. } => a.checkpoints.push(*seen),
                        Mark::Phase {
                            seen,
                            phase,
                            initial,
                        } => {
                            // Seen already ended: when it ended is not known.
                            if !initial
                                && matches!(phase.as_str(), "Completed" | "Expired" | "Released")
                            {
                                a.ended = Some(*seen);
                            }
                        }
                    }
                }
                // A claim renews once; anything before the first seen
                // renewal (other than the claim itself) was not seen.
                a.renewals_unseen =
                    m.dropped > 0 || a.renewals.first().is_some_and(|f| Some(*f) != a.claimed);
            }
            None => {
                a.renewals.extend(last_renewal);
                a.renewals_unseen = last_renewal.is_some() && last_renewal != a.claimed;
            }
        }
    }
    let st = t.status.clone().unwrap_or_default();
    for h in &st.history {
        let a = by_token.entry(h.token).or_default();
        a.token = h.token;
        a.holder = a.holder.clone().or_else(|| h.holder.clone());
        a.outcome = Some(h.outcome.clone());
        a.reason = h.reason.clone().or_else(|| a.reason.clone());
        a.issued = a.issued.or(h.start.as_ref().map(|s| s.0));
        if let Some(e) = &h.end {
            a.ended = Some(e.0);
        }
        a.lease_duration_seconds = a.lease_duration_seconds.or(h.lease_duration_seconds);
    }
    for a in by_token.values_mut() {
        a.committed = a.outcome.as_deref() == Some("Succeeded");
    }
    by_token.into_values().collect()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::fixtures::{lease, task, ts};
    use batchlease_api::{AttemptRecord, JsonObject};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, OwnerReference, Time};

    fn held(name: &str, holder: &str, claimed: i64) -> TaskLease {
        let mut l = lease(name, "q", LeasePhase::Held, Some(holder), ts(claimed - 1));
        l.spec.acquire_time = Some(MicroTime(ts(claimed)));
        l.spec.renew_time = Some(MicroTime(ts(claimed)));
        l
    }

    fn renew(l: &mut TaskLease, s: i64) {
        l.spec.renew_time = Some(MicroTime(ts(s)));
    }

    /// A zombie story: token 1 held by w-1, its renewals stop, it expires;
    /// token 2 is held by w-2, renews twice, checkpoints, and succeeds.
    #[test]
    fn the_timeline_of_an_expired_attempt_and_its_successor() {
        let mut j = Journal::default();
        let mut l1 = held("job-1", "w-1/a", 10);
        j.observe(&l1, ts(10));
        renew(&mut l1, 20);
        j.observe(&l1, ts(20));
        if let Some(s) = l1.status.as_mut() {
            s.phase = Some(LeasePhase::Expired);
        }
        j.observe(&l1, ts(50));
        let mut l2 = held("job-2", "w-2/b", 51);
        j.observe(&l2, ts(51));
        renew(&mut l2, 61);
        j.observe(&l2, ts(61));
        if let Some(s) = l2.status.as_mut() {
            s.checkpoint = JsonObject::from_text(r#"{"step":2}"#).ok();
        }
        j.observe(&l2, ts(65));
        renew(&mut l2, 71);
        j.observe(&l2, ts(71));
        if let Some(s) = l2.status.as_mut() {
            s.phase = Some(LeasePhase::Completed);
            s.outcome = Some(batchlease_api::LeaseOutcome::Succeeded);
        }
        j.observe(&l2, ts(75));
        let t = task("job", "q", TaskPhase::Succeeded, |s| {
            s.fencing_token = 2;
            s.history = vec![
                AttemptRecord {
                    token: 1,
                    holder: Some("w-1/a".into()),
                    outcome: "Expired".into(),
                    start: Some(Time(ts(9))),
                    end: Some(Time(ts(49))),
                    reason: Some("LeaseExpired".into()),
                    lease_duration_seconds: Some(30),
                    renewal: None,
                },
                AttemptRecord {
                    token: 2,
                    holder: Some("w-2/b".into()),
                    outcome: "Succeeded".into(),
                    start: Some(Time(ts(50))),
                    end: Some(Time(ts(74))),
                    reason: None,
                    lease_duration_seconds: Some(30),
                    renewal: None,
                },
            ];
        });
        let snap = Snapshot {
            tasks: vec![Arc::new(t)],
            leases: vec![Arc::new(l1), Arc::new(l2)],
            queues: vec![],
        };
        let d = detail(&snap, &j, "ns", "job").unwrap_or_else(|| panic!("no task"));
        assert_eq!(d.attempts.len(), 2);
        let (a1, a2) = (&d.attempts[0], &d.attempts[1]);
        assert_eq!(a1.token, 1);
        assert_eq!(a1.holder.as_deref(), Some("w-1/a"));
        assert_eq!(a1.renewals, vec![ts(10), ts(20)]);
        assert!(!a1.renewals_unseen);
        assert_eq!(a1.outcome.as_deref(), Some("Expired"));
        assert_eq!(a1.reason.as_deref(), Some("LeaseExpired"));
        // The operator's settle time wins over when the dashboard saw it.
        assert_eq!(a1.ended, Some(ts(49)));
        assert!(!a1.committed);
        assert_eq!(a2.renewals, vec![ts(51), ts(61), ts(71)]);
        assert_eq!(a2.checkpoints, vec![ts(65)]);
        assert_eq!(a2.claimed, Some(ts(51)));
        assert!(a2.committed);
        assert!(!d.can_cancel);
        assert!(!d.can_redrive);
    }

    #[test]
    fn an_attempt_known_only_from_history_and_a_lease_seen_late() {
        let mut l = held("job-3", "w/c", 100);
        renew(&mut l, 130);
        let t = task("job", "q", TaskPhase::Running, |s| {
            s.fencing_token = 3;
            s.current_lease = Some("job-3".into());
            s.history = vec![AttemptRecord {
                token: 2,
                holder: Some("w/b".into()),
                outcome: "Failed".into(),
                reason: Some("HandlerFailed".into()),
                ..Default::default()
            }];
        });
        let snap = Snapshot {
            tasks: vec![Arc::new(t)],
            leases: vec![Arc::new(l)],
            queues: vec![],
        };
        // No journal: the dashboard only saw the last renewal.
        let d = detail(&snap, &Journal::default(), "ns", "job").unwrap_or_else(|| panic!());
        assert_eq!(
            d.attempts.iter().map(|a| a.token).collect::<Vec<_>>(),
            vec![2, 3]
        );
        assert_eq!(d.attempts[0].lease, None);
        assert_eq!(d.attempts[0].reason.as_deref(), Some("HandlerFailed"));
        assert_eq!(d.attempts[1].renewals, vec![ts(130)]);
        assert!(d.attempts[1].renewals_unseen);
        assert!(d.can_cancel);
        assert!(detail(&snap, &Journal::default(), "ns", "nope").is_none());
        assert!(detail(&snap, &Journal::default(), "other-ns", "job").is_none());
    }

    #[test]
    fn the_graph_shows_dependencies_dependents_parent_and_children() {
        let mut root = task("root", "q", TaskPhase::Running, |_| {});
        root.spec.depends_on = vec!["dep".into(), "missing".into()];
        let mut child = task("child", "q", TaskPhase::Pending, |_| {});
        child.metadata.owner_references = Some(vec![OwnerReference {
            api_version: "batchlease.dev/v1alpha1".into(),
            kind: "BatchTask".into(),
            name: "root".into(),
            uid: "uid-root".into(),
            controller: Some(true),
            block_owner_deletion: None,
        }]);
        let mut after = task("after", "q", TaskPhase::Pending, |_| {});
        after.spec.depends_on = vec!["root".into()];
        let snap = Snapshot {
            tasks: [
                root,
                child,
                after,
                task("dep", "q", TaskPhase::Succeeded, |_| {}),
            ]
            .into_iter()
            .map(Arc::new)
            .collect(),
            ..Default::default()
        };
        let j = Journal::default();
        let d = detail(&snap, &j, "ns", "root").unwrap_or_else(|| panic!());
        assert_eq!(
            d.depends_on,
            vec![
                Node {
                    name: "dep".into(),
                    phase: Some("Succeeded")
                },
                Node {
                    name: "missing".into(),
                    phase: None
                },
            ]
        );
        assert_eq!(
            d.children,
            vec![Node {
                name: "child".into(),
                phase: Some("Pending")
            }]
        );
        assert_eq!(
            d.dependents,
            vec![Node {
                name: "after".into(),
                phase: Some("Pending")
            }]
        );
        let c = detail(&snap, &j, "ns", "child").unwrap_or_else(|| panic!());
        assert_eq!(
            c.parent,
            Some(Node {
                name: "root".into(),
                phase: Some("Running")
            })
        );
    }

    #[test]
    fn locks_name_their_token_and_who_holds_each_resource() {
        let mut me = task("me", "q", TaskPhase::Running, |s| {
            s.current_lease = Some("me-2".into())
        });
        me.spec.resources = vec!["db".into(), "bucket".into()];
        let mut mine = held("me-2", "w/a", 5);
        mine.spec.task_uid = "uid-me".into();
        mine.spec.resource_tokens = BTreeMap::from([("db".into(), 7), ("bucket".into(), 3)]);
        let mut other = held("you-1", "w/b", 5);
        other.spec.resource_tokens = BTreeMap::from([("gpu".into(), 1)]);
        let mut wants = task("waits", "q", TaskPhase::Pending, |_| {});
        wants.spec.resources = vec!["gpu".into()];
        let snap = Snapshot {
            tasks: vec![Arc::new(me), Arc::new(wants)],
            leases: vec![Arc::new(mine), Arc::new(other)],
            queues: vec![],
        };
        let j = Journal::default();
        let d = detail(&snap, &j, "ns", "me").unwrap_or_else(|| panic!());
        assert_eq!(
            d.locks,
            vec![
                TaskLock {
                    resource: "bucket".into(),
                    token: Some(3),
                    held_by: Some("me".into())
                },
                TaskLock {
                    resource: "db".into(),
                    token: Some(7),
                    held_by: Some("me".into())
                },
            ]
        );
        let w = detail(&snap, &j, "ns", "waits").unwrap_or_else(|| panic!());
        assert_eq!(
            w.locks,
            vec![TaskLock {
                resource: "gpu".into(),
                token: None,
                held_by: Some("you".into())
            }]
        );
    }
}
