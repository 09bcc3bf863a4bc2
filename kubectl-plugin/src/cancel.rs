//! `kubectl batchlease cancel`: which tasks get `spec.cancel=true`, and
//! which are reported as already finished instead (a finished task is
//! never patched: `Succeeded` and `Cancelled` are final, and a
//! `DeadLettered` or `Rejected` task runs again only when redriven).

use batchlease_api::{BatchTask, TaskPhase};
use kube::ResourceExt;
use serde::Serialize;

/// What to cancel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selection {
    /// These tasks, by name; each must exist.
    Tasks(Vec<String>),
    /// Every unfinished task of a queue.
    Queue(String),
}

/// What `cancel` does with one task.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Action {
    /// `spec.cancel` is (or already was) set: the operator ends the task
    /// `Cancelled` (its lease released first).
    CancelRequested,
    /// The task had finished: nothing to cancel, nothing written.
    AlreadyFinished,
}

/// The decision for one task.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Decision {
    pub name: String,
    pub namespace: String,
    pub action: Action,
    /// The task's phase when it was listed (`Pending` before the operator
    /// first wrote its status).
    pub phase: String,
    /// The UID the patch carries (a task deleted and created again under
    /// the name meanwhile is left alone).
    #[serde(skip)]
    pub uid: String,
    /// `spec.cancel` was already set: no patch needed.
    #[serde(skip)]
    pub already_requested: bool,
}

impl Decision {
    /// Whether `spec.cancel` has to be written.
    pub fn needs_patch(&self) -> bool {
        self.action == Action::CancelRequested && !self.already_requested
    }

    /// The line `cancel` prints for this task.
    pub fn message(&self) -> String {
        let name = &self.name;
        match self.action {
            Action::AlreadyFinished => {
                format!("batchtask/{name} already {}, nothing to cancel", self.phase)
            }
            Action::CancelRequested if self.already_requested => {
                format!("batchtask/{name} cancel already requested")
            }
            Action::CancelRequested => format!("batchtask/{name} cancel requested"),
        }
    }
}

fn phase(t: &BatchTask) -> TaskPhase {
    t.status
        .as_ref()
        .and_then(|s| s.phase)
        .unwrap_or(TaskPhase::Pending)
}

/// What `cancel` does with task `t`: cancel it unless it has finished.
pub fn decide(t: &BatchTask) -> Decision {
    let phase = phase(t);
    Decision {
        name: t.name_any(),
        namespace: t.namespace().unwrap_or_default(),
        action: if phase.is_terminal() {
            Action::AlreadyFinished
        } else {
            Action::CancelRequested
        },
        phase: phase.as_str().to_owned(),
        uid: t.metadata.uid.clone().unwrap_or_default(),
        already_requested: t.spec.cancel,
    }
}

/// The decisions for `selection` among `tasks` (one namespace's), or why
/// not: a named task that does not exist refuses the whole command before
/// anything is written (cancelling cannot be undone, so a typo in a list
/// must not leave half of it done). Names are taken once each, in the
/// order given; a queue's tasks sorted by name, finished ones left out.
pub fn decisions(tasks: &[BatchTask], selection: &Selection) -> Result<Vec<Decision>, String> {
    match selection {
        Selection::Tasks(names) => {
            let mut seen = std::collections::BTreeSet::new();
            let mut missing = vec![];
            let mut out = vec![];
            for name in names {
                if !seen.insert(name) {
                    continue;
                }
                match tasks.iter().find(|t| &t.name_any() == name) {
                    Some(t) => out.push(decide(t)),
                    None => missing.push(name.as_str()),
                }
            }
            match missing.as_slice() {
                [] => Ok(out),
                [one] => Err(format!("task {one} not found")),
                many => Err(format!("tasks {} not found", many.join(", "))),
            }
        }
        Selection::Queue(q) => {
            let mut out: Vec<Decision> = tasks
                .iter()
                .filter(|t| &t.spec.queue == q && !phase(t).is_terminal())
                .map(decide)
                .collect();
            out.sort_by(|a, b| a.name.cmp(&b.name));
            Ok(out)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::task;

    #[test]
    fn decides_per_task_by_phase_and_spec_cancel() {
        use Action::{AlreadyFinished, CancelRequested};
        use TaskPhase as P;
        // (phase, spec.cancel already set) → (action, patched, message)
        #[rustfmt::skip]
        let table = [
            (None,                  false, CancelRequested, true,  "cancel requested"),
            (Some(P::Pending),      false, CancelRequested, true,  "cancel requested"),
            (Some(P::Ready),        false, CancelRequested, true,  "cancel requested"),
            (Some(P::Running),      false, CancelRequested, true,  "cancel requested"),
            (Some(P::Running),      true,  CancelRequested, false, "cancel already requested"),
            (Some(P::Succeeded),    false, AlreadyFinished, false, "already Succeeded, nothing to cancel"),
            (Some(P::Succeeded),    true,  AlreadyFinished, false, "already Succeeded, nothing to cancel"),
            (Some(P::DeadLettered), false, AlreadyFinished, false, "already DeadLettered, nothing to cancel"),
            (Some(P::Rejected),     false, AlreadyFinished, false, "already Rejected, nothing to cancel"),
            (Some(P::Cancelled),    true,  AlreadyFinished, false, "already Cancelled, nothing to cancel"),
        ];
        for (phase, cancel, action, patched, message) in table {
            let mut t = task("t", "q", P::Pending, |s| s.phase = phase);
            t.spec.cancel = cancel;
            let d = decide(&t);
            let case = format!("{phase:?} cancel={cancel}");
            assert_eq!(d.action, action, "{case}");
            assert_eq!(d.needs_patch(), patched, "{case}");
            assert_eq!(d.message(), format!("batchtask/t {message}"), "{case}");
            assert_eq!(
                d.phase,
                phase.unwrap_or(TaskPhase::Pending).as_str(),
                "{case}"
            );
            assert_eq!((d.uid.as_str(), d.namespace.as_str()), ("uid-t", "ns"));
        }
    }

    #[test]
    fn selects_named_tasks_or_a_queues_unfinished_ones() {
        let mut asked = task("asked", "q", TaskPhase::Running, |_| {});
        asked.spec.cancel = true;
        let tasks = vec![
            task("run", "q", TaskPhase::Running, |_| {}),
            task("done", "q", TaskPhase::Succeeded, |_| {}),
            task("ready", "q", TaskPhase::Ready, |_| {}),
            asked,
            task("dead", "q", TaskPhase::DeadLettered, |_| {}),
            task("other", "x", TaskPhase::Ready, |_| {}),
        ];
        let names = |ds: Vec<Decision>| -> Vec<(String, Action)> {
            ds.into_iter().map(|d| (d.name, d.action)).collect()
        };
        let tasks_named = |ns: &[&str]| Selection::Tasks(ns.iter().map(|&n| n.into()).collect());
        assert_eq!(
            decisions(&tasks, &tasks_named(&["run", "done", "run"])).map(names),
            Ok(vec![
                ("run".into(), Action::CancelRequested),
                ("done".into(), Action::AlreadyFinished),
            ])
        );
        assert_eq!(
            decisions(&tasks, &tasks_named(&["run", "nope"])),
            Err("task nope not found".into())
        );
        assert_eq!(
            decisions(&tasks, &tasks_named(&["nope", "run", "gone"])),
            Err("tasks nope, gone not found".into())
        );
        assert_eq!(
            decisions(&tasks, &Selection::Queue("q".into())).map(names),
            Ok(vec![
                ("asked".into(), Action::CancelRequested),
                ("ready".into(), Action::CancelRequested),
                ("run".into(), Action::CancelRequested),
            ])
        );
        assert_eq!(
            decisions(&tasks, &Selection::Queue("empty".into())),
            Ok(vec![])
        );
    }

    #[test]
    fn json_carries_name_namespace_action_and_phase_only() {
        let d = decide(&task("t", "q", TaskPhase::Ready, |_| {}));
        assert_eq!(
            serde_json::to_value(&d).ok(),
            Some(serde_json::json!({
                "name": "t", "namespace": "ns", "action": "cancelRequested", "phase": "Ready"
            }))
        );
    }
}
