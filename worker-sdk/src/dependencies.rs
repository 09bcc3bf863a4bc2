//! Reading the results of the tasks this one depends on, so a pipeline
//! passes data forward through the tasks' own status instead of a side
//! channel.
//!
//! The operator issues a task only once every task of its `dependsOn` has
//! `Succeeded`, so the results are there to read. They are read on demand
//! (a handler that does not ask costs nothing), with the worker's main
//! client, one GET per dependency, and each read checks the phase again:
//! a dependency deleted, re-created or redriven since is a typed error,
//! never a silently missing input.

use std::collections::BTreeMap;
use std::time::Duration;

use batchlease_api::{BatchTask, JsonObject, JsonObjectError, TaskPhase};
use futures::{StreamExt, TryStreamExt};
use kube::api::Api;
use serde::de::DeserializeOwned;
use tokio::time::timeout;

use crate::context::TaskContext;
use crate::error::Error;

/// Bound of one read.
const READ_BUDGET: Duration = Duration::from_secs(5);

/// Reads in flight at once (`dependsOn` has at most 64 entries).
const PARALLEL_READS: usize = 8;

impl TaskContext {
    /// The task's `spec.dependsOn`: tasks that had succeeded before this
    /// attempt was issued.
    pub fn depends_on(&self) -> &[String] {
        &self.depends_on
    }

    /// Every dependency's result (`None` for one that succeeded without a
    /// result), by name. One GET per dependency, made now; call it once
    /// and keep the map. [`Error::DependencyNotSucceeded`] if one is gone
    /// or not `Succeeded` any more.
    pub async fn dependency_results(&self) -> Result<BTreeMap<String, Option<JsonObject>>, Error> {
        let api = self.tasks();
        // Each read owns its inputs: a closure over borrowed names makes the
        // handler's future `Send` for one lifetime only, not for all.
        let reads = self.depends_on.clone().into_iter().map(move |name| {
            let api = api.clone();
            async move { read_result(&api, &name).await }
        });
        let results: Vec<Option<JsonObject>> = futures::stream::iter(reads)
            .buffered(PARALLEL_READS)
            .try_collect()
            .await?;
        Ok(self.depends_on.iter().cloned().zip(results).collect())
    }

    /// The result of dependency `name`, deserialized (`Ok(None)`: it
    /// succeeded without a result). [`Error::NotADependency`] for a task
    /// not in `spec.dependsOn`; [`Error::InvalidJson`] for a result of
    /// another shape than `T`.
    pub async fn dependency_result<T: DeserializeOwned>(
        &self,
        name: &str,
    ) -> Result<Option<T>, Error> {
        if !self.depends_on.iter().any(|d| d == name) {
            return Err(Error::NotADependency {
                name: name.to_owned(),
            });
        }
        let Some(result) = read_result(&self.tasks(), name).await? else {
            return Ok(None);
        };
        result.parse().map(Some).map_err(|e| Error::InvalidJson {
            what: "dependency result",
            source: JsonObjectError::Invalid(e),
        })
    }

    fn tasks(&self) -> Api<BatchTask> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }
}

/// Reads dependency `name` and returns its result.
async fn read_result(api: &Api<BatchTask>, name: &str) -> Result<Option<JsonObject>, Error> {
    match timeout(READ_BUDGET, api.get_opt(name)).await {
        Err(_) => Err(Error::Timeout {
            what: "dependency read",
        }),
        Ok(Err(source)) => Err(Error::Kube {
            what: "dependency read",
            source,
        }),
        Ok(Ok(task)) => succeeded_result(name, task),
    }
}

/// The result of dependency `name` as read (`None`: not found), if it
/// succeeded.
fn succeeded_result(name: &str, task: Option<BatchTask>) -> Result<Option<JsonObject>, Error> {
    let not_succeeded = |phase| Error::DependencyNotSucceeded {
        name: name.to_owned(),
        phase,
    };
    let Some(task) = task else {
        return Err(not_succeeded("NotFound"));
    };
    let status = task.status.unwrap_or_default();
    match status.phase {
        Some(TaskPhase::Succeeded) => Ok(status.result),
        Some(phase) => Err(not_succeeded(phase.as_str())),
        None => Err(not_succeeded("Unknown")),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use batchlease_api::{BatchTaskSpec, BatchTaskStatus};

    fn task(phase: Option<TaskPhase>, result: Option<&str>) -> Option<BatchTask> {
        let mut t = BatchTask::new("up", BatchTaskSpec::for_queue("q"));
        t.status = Some(BatchTaskStatus {
            phase,
            result: result.map(|r| JsonObject::from_text(r).unwrap()),
            ..Default::default()
        });
        Some(t)
    }

    #[test]
    fn only_a_succeeded_dependency_has_a_result() {
        /// (what, the task as read, its result or the phase reported)
        type Case = (
            &'static str,
            Option<BatchTask>,
            Result<Option<&'static str>, &'static str>,
        );
        let cases: Vec<Case> = vec![
            (
                "succeeded with a result",
                task(Some(TaskPhase::Succeeded), Some(r#"{"n":1}"#)),
                Ok(Some(r#"{"n":1}"#)),
            ),
            (
                "succeeded without one",
                task(Some(TaskPhase::Succeeded), None),
                Ok(None),
            ),
            ("deleted", None, Err("NotFound")),
            (
                "re-created, pending",
                task(Some(TaskPhase::Pending), None),
                Err("Pending"),
            ),
            (
                "redriven and running",
                task(Some(TaskPhase::Running), Some(r#"{"old":1}"#)),
                Err("Running"),
            ),
            (
                "dead-lettered",
                task(Some(TaskPhase::DeadLettered), None),
                Err("DeadLettered"),
            ),
            ("no status yet", task(None, None), Err("Unknown")),
        ];
        for (what, t, want) in cases {
            let got = succeeded_result("up", t);
            match (got, want) {
                (Ok(r), Ok(w)) => assert_eq!(r.as_ref().map(JsonObject::as_str), w, "{what}"),
                (Err(Error::DependencyNotSucceeded { name, phase }), Err(w)) => {
                    assert_eq!((name.as_str(), phase), ("up", w), "{what}");
                }
                (got, _) => panic!("{what}: {got:?}"),
            }
        }
    }
}
