//! `kubectl batchlease pause` and `resume`: `spec.paused` of the queue's
//! TaskQueue (named for the queue, in its namespace). Only `spec.paused`
//! is written — `maxConcurrent` and the rest stay as whoever set them left
//! them. `pause` creates the TaskQueue when the queue has none; `resume`
//! never creates one (a queue without a TaskQueue is not paused).

use batchlease_api::TaskQueue;
use serde::Serialize;
use serde_json::{Value, json};

/// Whether `queue` can name a queue (and so its TaskQueue): a DNS label,
/// as `spec.queue` of a BatchTask must be.
pub fn check_queue(queue: &str) -> Result<(), String> {
    let label = !queue.is_empty()
        && queue.len() <= 63
        && queue
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !queue.starts_with('-')
        && !queue.ends_with('-');
    if label {
        Ok(())
    } else {
        Err(format!(
            "{queue:?} is not a queue name: a DNS label (lowercase letters, digits and '-', at most 63 characters)"
        ))
    }
}

/// What to write to reach `spec.paused == paused`.
#[derive(Debug, Clone, PartialEq)]
pub enum Plan {
    /// No TaskQueue yet: create this one.
    Create(Value),
    /// Merge-patch the existing TaskQueue with this.
    Patch(Value),
    /// Nothing to write: it is already so (or, for `resume`, there is no
    /// TaskQueue, which means not paused).
    Nothing,
}

/// A TaskQueue named `queue` with only `spec.paused` set.
pub fn new_queue(queue: &str, paused: bool) -> Value {
    json!({
        "apiVersion": "batchlease.dev/v1alpha1",
        "kind": "TaskQueue",
        "metadata": {"name": queue},
        "spec": {"paused": paused},
    })
}

/// The merge patch setting `spec.paused` (explicitly `false` on resume, so
/// `kubectl get tq` shows it) and nothing else. The UID makes it
/// conditional: a TaskQueue deleted and created again meanwhile is not
/// touched.
pub fn paused_patch(uid: &str, paused: bool) -> Value {
    json!({"metadata": {"uid": uid}, "spec": {"paused": paused}})
}

/// What to write, given the TaskQueue as read (`None`: there is none).
pub fn plan(queue: &str, existing: Option<&TaskQueue>, paused: bool) -> Plan {
    match existing {
        None if paused => Plan::Create(new_queue(queue, true)),
        None => Plan::Nothing,
        Some(tq) if tq.spec.paused == paused => Plan::Nothing,
        Some(tq) => Plan::Patch(paused_patch(
            tq.metadata.uid.as_deref().unwrap_or_default(),
            paused,
        )),
    }
}

/// What `pause` or `resume` did (`-o json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Outcome {
    pub queue: String,
    pub namespace: String,
    /// `spec.paused` now (`false` without a TaskQueue).
    pub paused: bool,
    /// The TaskQueue was created.
    pub created: bool,
    /// `spec.paused` was written (false: it already was so).
    pub changed: bool,
    /// A TaskQueue exists (now).
    #[serde(skip)]
    pub exists: bool,
}

impl Outcome {
    /// The outcome of carrying out `plan` for `queue`.
    pub fn of(queue: &str, namespace: &str, plan: &Plan, existed: bool, paused: bool) -> Self {
        let (created, changed) = match plan {
            Plan::Create(_) => (true, true),
            Plan::Patch(_) => (false, true),
            Plan::Nothing => (false, false),
        };
        let exists = existed || created;
        Self {
            queue: queue.into(),
            namespace: namespace.into(),
            paused: paused && exists,
            created,
            changed,
            exists,
        }
    }

    /// The line printed.
    pub fn message(&self) -> String {
        let q = &self.queue;
        match (self.paused, self.created, self.changed, self.exists) {
            (true, true, _, _) => format!("taskqueue/{q} paused (TaskQueue created)"),
            (true, false, true, _) => format!("taskqueue/{q} paused"),
            (true, false, false, _) => format!("taskqueue/{q} already paused"),
            (false, _, true, _) => format!("taskqueue/{q} resumed"),
            (false, _, false, true) => format!("taskqueue/{q} not paused"),
            (false, _, false, false) => format!("taskqueue/{q} not paused (no TaskQueue)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use batchlease_api::TaskQueueSpec;

    fn queue(paused: bool) -> TaskQueue {
        let mut tq = TaskQueue::new(
            "q",
            TaskQueueSpec {
                paused,
                max_concurrent: Some(3),
                ..Default::default()
            },
        );
        tq.metadata.uid = Some("uid-q".into());
        tq
    }

    #[test]
    fn writes_only_spec_paused_and_only_when_it_differs() {
        let (running, paused) = (queue(false), queue(true));
        // (existing, pause?) → plan, JSON outcome, message
        let table = [
            (
                None,
                true,
                Plan::Create(json!({
                    "apiVersion": "batchlease.dev/v1alpha1", "kind": "TaskQueue",
                    "metadata": {"name": "q"}, "spec": {"paused": true},
                })),
                json!({"queue": "q", "namespace": "ns", "paused": true, "created": true, "changed": true}),
                "taskqueue/q paused (TaskQueue created)",
            ),
            (
                Some(&running),
                true,
                Plan::Patch(json!({"metadata": {"uid": "uid-q"}, "spec": {"paused": true}})),
                json!({"queue": "q", "namespace": "ns", "paused": true, "created": false, "changed": true}),
                "taskqueue/q paused",
            ),
            (
                Some(&paused),
                true,
                Plan::Nothing,
                json!({"queue": "q", "namespace": "ns", "paused": true, "created": false, "changed": false}),
                "taskqueue/q already paused",
            ),
            (
                Some(&paused),
                false,
                Plan::Patch(json!({"metadata": {"uid": "uid-q"}, "spec": {"paused": false}})),
                json!({"queue": "q", "namespace": "ns", "paused": false, "created": false, "changed": true}),
                "taskqueue/q resumed",
            ),
            (
                Some(&running),
                false,
                Plan::Nothing,
                json!({"queue": "q", "namespace": "ns", "paused": false, "created": false, "changed": false}),
                "taskqueue/q not paused",
            ),
            (
                None,
                false,
                Plan::Nothing,
                json!({"queue": "q", "namespace": "ns", "paused": false, "created": false, "changed": false}),
                "taskqueue/q not paused (no TaskQueue)",
            ),
        ];
        for (existing, pause, want_plan, want_json, want_message) in table {
            let case = format!("{:?} pause={pause}", existing.map(|q| q.spec.paused));
            let got = plan("q", existing, pause);
            assert_eq!(got, want_plan, "{case}");
            let outcome = Outcome::of("q", "ns", &got, existing.is_some(), pause);
            assert_eq!(
                serde_json::to_value(&outcome).ok(),
                Some(want_json),
                "{case}"
            );
            assert_eq!(outcome.message(), want_message, "{case}");
        }
    }

    #[test]
    fn queue_names_are_dns_labels() {
        for ok in ["q", "etl-2", "0", &"a".repeat(63)] {
            assert_eq!(check_queue(ok), Ok(()), "{ok}");
        }
        for bad in ["", "Bad_Name", "-q", "q-", "a.b", &"a".repeat(64)] {
            assert!(check_queue(bad).is_err(), "{bad}");
        }
        assert_eq!(
            check_queue("Etl"),
            Err("\"Etl\" is not a queue name: a DNS label (lowercase letters, digits and '-', at most 63 characters)".into())
        );
    }

    #[test]
    fn the_created_queue_reads_back_as_a_paused_task_queue() {
        let tq: Result<TaskQueue, _> = serde_json::from_value(new_queue("etl", true));
        let tq = tq.map_err(|e| e.to_string());
        assert_eq!(
            tq.map(|t| (t.metadata.name, t.spec)),
            Ok((
                Some("etl".into()),
                TaskQueueSpec {
                    paused: true,
                    ..Default::default()
                }
            ))
        );
    }
}
