//! `kubectl batchlease redrive`: which tasks go back to `Pending`, and the
//! `spec.redrive` each is given (one more than it has: the operator acts on
//! a value above `status.observedRedrive`, which never exceeds it).

use batchlease_api::{BatchTask, TaskPhase};
use kube::ResourceExt;

/// What to redrive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selection {
    /// One task, which must be `DeadLettered` or `Rejected`.
    Task(String),
    /// Every `DeadLettered` task of a queue.
    Queue(String),
}

/// A task to redrive: its name, its UID (the patch carries it, so a task
/// deleted and created again under the name meanwhile is left alone) and
/// the `spec.redrive` it gets.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Target {
    pub name: String,
    pub uid: String,
    pub redrive: i64,
}

/// The targets of `selection` among `tasks`, or why not.
pub fn targets(tasks: &[BatchTask], selection: &Selection) -> Result<Vec<Target>, String> {
    let phase = |t: &BatchTask| t.status.as_ref().and_then(|s| s.phase);
    let next = |t: &BatchTask| Target {
        name: t.name_any(),
        uid: t.metadata.uid.clone().unwrap_or_default(),
        redrive: t.spec.redrive + 1,
    };
    match selection {
        Selection::Task(name) => {
            let t = tasks
                .iter()
                .find(|t| &t.name_any() == name)
                .ok_or_else(|| format!("task {name} not found"))?;
            match phase(t) {
                Some(TaskPhase::DeadLettered | TaskPhase::Rejected) => Ok(vec![next(t)]),
                p => Err(format!(
                    "task {name} is {}: only DeadLettered or Rejected tasks are redriven",
                    p.unwrap_or(TaskPhase::Pending).as_str()
                )),
            }
        }
        Selection::Queue(q) => {
            let mut out: Vec<_> = tasks
                .iter()
                .filter(|t| &t.spec.queue == q && phase(t) == Some(TaskPhase::DeadLettered))
                .map(next)
                .collect();
            out.sort();
            Ok(out)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::task;

    #[test]
    fn picks_dead_lettered_tasks_and_explains_refusals() {
        let mut dead = task("d", "q", TaskPhase::DeadLettered, |_| {});
        dead.spec.redrive = 2;
        let tasks = vec![
            dead,
            task("r", "q", TaskPhase::Rejected, |_| {}),
            task("run", "q", TaskPhase::Running, |_| {}),
            task("other", "x", TaskPhase::DeadLettered, |_| {}),
        ];
        let t = |name: &str, redrive| Target {
            name: name.into(),
            uid: format!("uid-{name}"),
            redrive,
        };
        assert_eq!(
            targets(&tasks, &Selection::Task("d".into())),
            Ok(vec![t("d", 3)])
        );
        assert_eq!(
            targets(&tasks, &Selection::Task("r".into())),
            Ok(vec![t("r", 1)])
        );
        assert_eq!(
            targets(&tasks, &Selection::Task("run".into())),
            Err("task run is Running: only DeadLettered or Rejected tasks are redriven".into())
        );
        assert_eq!(
            targets(&tasks, &Selection::Task("nope".into())),
            Err("task nope not found".into())
        );
        assert_eq!(
            targets(&tasks, &Selection::Queue("q".into())),
            Ok(vec![t("d", 3)])
        );
        assert_eq!(
            targets(&tasks, &Selection::Queue("empty".into())),
            Ok(vec![])
        );
    }
}
