//! `kubectl batchlease tree TASK`: the task, the tasks it depends on, the
//! children it spawned (tasks whose controlling owner it is), and its
//! leases — token, phase, holder, age — oldest first.

use batchlease_api::{BatchTask, TaskLease, TaskPhase};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use serde::Serialize;

use crate::age;

/// A task in the tree: its name and phase (`None`: it does not exist).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Node {
    pub name: String,
    pub phase: Option<String>,
}

/// One lease of the task.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LeaseRow {
    pub name: String,
    pub token: i64,
    pub phase: Option<String>,
    pub holder: Option<String>,
    pub outcome: Option<String>,
    pub age_seconds: Option<i64>,
}

/// What `tree` shows.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Tree {
    pub name: String,
    pub phase: String,
    pub fencing_token: i64,
    pub attempts: i32,
    pub depends_on: Vec<Node>,
    pub children: Vec<Node>,
    pub leases: Vec<LeaseRow>,
}

fn phase_of(t: &BatchTask) -> String {
    t.status
        .as_ref()
        .and_then(|s| s.phase)
        .unwrap_or(TaskPhase::Pending)
        .as_str()
        .to_owned()
}

/// The tree of task `name` among `tasks` and `leases` of its namespace.
pub fn tree(name: &str, tasks: &[BatchTask], leases: &[TaskLease], now: Timestamp) -> Option<Tree> {
    let task = tasks.iter().find(|t| t.name_any() == name)?;
    let uid = task.metadata.uid.clone().unwrap_or_default();
    let status = task.status.clone().unwrap_or_default();
    let depends_on = task
        .spec
        .depends_on
        .iter()
        .map(|d| Node {
            name: d.clone(),
            phase: tasks.iter().find(|t| &t.name_any() == d).map(phase_of),
        })
        .collect();
    let mut children: Vec<Node> = tasks
        .iter()
        .filter(|t| {
            t.owner_references()
                .iter()
                .any(|o| o.uid == uid && o.controller == Some(true))
        })
        .map(|t| Node {
            name: t.name_any(),
            phase: Some(phase_of(t)),
        })
        .collect();
    children.sort_by(|a, b| a.name.cmp(&b.name));
    let mut rows: Vec<LeaseRow> = leases
        .iter()
        .filter(|l| l.spec.task_uid == uid)
        .map(|l| {
            let st = l.status.clone().unwrap_or_default();
            LeaseRow {
                name: l.name_any(),
                token: l.spec.fencing_token,
                phase: st.phase.map(|p| format!("{p:?}")),
                holder: l.spec.holder_identity.clone(),
                outcome: st.outcome.map(|o| format!("{o:?}")),
                age_seconds: l
                    .metadata
                    .creation_timestamp
                    .as_ref()
                    .map(|c| age::seconds(c.0, now)),
            }
        })
        .collect();
    rows.sort_by_key(|r| r.token);
    Some(Tree {
        name: name.to_owned(),
        phase: phase_of(task),
        fencing_token: status.fencing_token,
        attempts: status.attempts,
        depends_on,
        children,
        leases: rows,
    })
}

/// The tree as text.
pub fn render(t: &Tree) -> String {
    let mut out = format!(
        "{}  {}  token {}  attempts {}\n",
        t.name, t.phase, t.fencing_token, t.attempts
    );
    let node = |n: &Node| format!("{}  {}", n.name, n.phase.as_deref().unwrap_or("<missing>"));
    let lease = |l: &LeaseRow| {
        let mut s = format!(
            "{}  token {}  {}",
            l.name,
            l.token,
            l.phase.as_deref().unwrap_or("<no phase>")
        );
        if let Some(o) = &l.outcome {
            s.push_str(&format!(" ({o})"));
        }
        s.push_str(&format!(
            "  {}",
            l.holder.as_deref().unwrap_or("<unclaimed>")
        ));
        if let Some(a) = l.age_seconds {
            s.push_str(&format!("  {}", age::human(a)));
        }
        s
    };
    let sections = [
        (
            "depends on",
            t.depends_on.iter().map(node).collect::<Vec<_>>(),
        ),
        ("children", t.children.iter().map(node).collect()),
        ("leases", t.leases.iter().map(lease).collect()),
    ];
    let shown: Vec<_> = sections
        .iter()
        .filter(|(_, items)| !items.is_empty())
        .collect();
    for (i, (title, items)) in shown.iter().enumerate() {
        let last = i + 1 == shown.len();
        out.push_str(&format!("{}─ {title}\n", if last { "└" } else { "├" }));
        for (j, item) in items.iter().enumerate() {
            let bar = if last { " " } else { "│" };
            let tip = if j + 1 == items.len() { "└" } else { "├" };
            out.push_str(&format!("{bar}  {tip}─ {item}\n"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{lease, task, ts};
    use batchlease_api::LeasePhase;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

    #[test]
    fn shows_dependencies_children_and_leases() {
        let mut job = task("job", "q", TaskPhase::Running, |s| {
            s.fencing_token = 2;
            s.attempts = 1;
        });
        job.spec.depends_on = vec!["a".into(), "gone".into()];
        let mut child = task("job-c1", "q", TaskPhase::Pending, |_| {});
        child.metadata.owner_references = Some(vec![OwnerReference {
            api_version: "batchlease.dev/v1alpha1".into(),
            kind: "BatchTask".into(),
            name: "job".into(),
            uid: "uid-job".into(),
            controller: Some(true),
            block_owner_deletion: Some(false),
        }]);
        let tasks = vec![job, task("a", "q", TaskPhase::Succeeded, |_| {}), child];
        let mut first = lease("job-1", "q", LeasePhase::Expired, Some("w-0/aa"), ts(0));
        first.spec.fencing_token = 1;
        let second = lease("job-2", "q", LeasePhase::Held, Some("w-1/bb"), ts(990));
        let t = tree("job", &tasks, &[second, first], ts(1_000)).unwrap();
        assert_eq!(
            render(&t),
            "job  Running  token 2  attempts 1\n\
             ├─ depends on\n\
             │  ├─ a  Succeeded\n\
             │  └─ gone  <missing>\n\
             ├─ children\n\
             │  └─ job-c1  Pending\n\
             └─ leases\n   \
             ├─ job-1  token 1  Expired  w-0/aa  16m\n   \
             └─ job-2  token 2  Held  w-1/bb  10s\n"
        );
        assert!(tree("nope", &tasks, &[], ts(0)).is_none());
    }
}
