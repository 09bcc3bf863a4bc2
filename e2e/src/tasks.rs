//! Creating BatchTasks and waiting on them and their leases.

use std::time::Duration;

use batchlease_api::{BatchTask, LeasePhase, TaskLease, TaskPhase};
use kube::api::{Api, PostParams};

use crate::TestNamespace;
use crate::wait::wait_for;

/// Creates TaskQueue `name` in `ns` with `spec` (JSON, as in a manifest).
pub async fn create_queue(
    ns: &TestNamespace,
    name: &str,
    spec: serde_json::Value,
) -> anyhow::Result<batchlease_api::TaskQueue> {
    let q: batchlease_api::TaskQueue = serde_json::from_value(serde_json::json!({
        "apiVersion": "batchlease.dev/v1alpha1", "kind": "TaskQueue",
        "metadata": {"name": name}, "spec": spec,
    }))?;
    Ok(ns
        .api::<batchlease_api::TaskQueue>()
        .create(&PostParams::default(), &q)
        .await?)
}

/// Creates a BatchTask from a JSON spec (so tests read like manifests).
pub async fn create(
    ns: &TestNamespace,
    name: &str,
    spec: serde_json::Value,
) -> anyhow::Result<BatchTask> {
    let task: BatchTask = serde_json::from_value(serde_json::json!({
        "apiVersion": "batchlease.dev/v1alpha1", "kind": "BatchTask",
        "metadata": {"name": name}, "spec": spec,
    }))?;
    Ok(ns
        .api::<BatchTask>()
        .create(&PostParams::default(), &task)
        .await?)
}

/// Waits until task `name` satisfies `pred`; `extra` adds diagnostics.
pub async fn wait_task(
    ns: &TestNamespace,
    name: &str,
    what: &str,
    timeout: Duration,
    extra: impl FnOnce() -> String,
    pred: impl Fn(&BatchTask) -> bool,
) -> anyhow::Result<BatchTask> {
    let api: Api<BatchTask> = ns.api();
    let pred = &pred;
    wait_for(
        &format!("task {name}: {what}"),
        timeout,
        || format!("{}\n{}", ns.diagnostics(), extra()),
        || {
            let api = api.clone();
            async move { Ok(api.get_opt(name).await?.filter(|t| pred(t))) }
        },
    )
    .await
}

/// Waits until task `name` is in `phase`.
pub async fn wait_phase(
    ns: &TestNamespace,
    name: &str,
    phase: TaskPhase,
    timeout: Duration,
    extra: impl FnOnce() -> String,
) -> anyhow::Result<BatchTask> {
    wait_task(ns, name, phase.as_str(), timeout, extra, |t| {
        phase_of(t) == Some(phase)
    })
    .await
}

/// Waits until task `name` is held by worker `holder`.
pub async fn wait_holder(
    ns: &TestNamespace,
    name: &str,
    holder: &str,
    timeout: Duration,
    extra: impl FnOnce() -> String,
) -> anyhow::Result<BatchTask> {
    wait_task(
        ns,
        name,
        &format!("held by {holder}"),
        timeout,
        extra,
        |t| t.status.as_ref().and_then(|s| s.holder.as_deref()) == Some(holder),
    )
    .await
}

/// Waits until lease `name` exists and is in `phase`.
pub async fn wait_lease(
    ns: &TestNamespace,
    name: &str,
    phase: LeasePhase,
    timeout: Duration,
    extra: impl FnOnce() -> String,
) -> anyhow::Result<TaskLease> {
    let api: Api<TaskLease> = ns.api();
    wait_for(
        &format!("lease {name} {phase:?}"),
        timeout,
        || format!("{}\n{}", ns.diagnostics(), extra()),
        || {
            let api = api.clone();
            async move {
                Ok(api
                    .get_opt(name)
                    .await?
                    .filter(|l| lease_phase(l) == Some(phase)))
            }
        },
    )
    .await
}

/// The current status of task `name` (fails if it has none yet).
pub async fn status(
    ns: &TestNamespace,
    name: &str,
) -> anyhow::Result<batchlease_api::BatchTaskStatus> {
    ns.api::<BatchTask>()
        .get(name)
        .await?
        .status
        .ok_or_else(|| anyhow::anyhow!("task {name} has no status"))
}

/// The UID of task `name`: its key in fenced storage.
pub async fn uid(ns: &TestNamespace, name: &str) -> anyhow::Result<String> {
    ns.api::<BatchTask>()
        .get(name)
        .await?
        .metadata
        .uid
        .ok_or_else(|| anyhow::anyhow!("task {name} has no uid"))
}

/// The task's phase.
pub fn phase_of(t: &BatchTask) -> Option<TaskPhase> {
    t.status.as_ref().and_then(|s| s.phase)
}

/// The lease's phase.
pub fn lease_phase(l: &TaskLease) -> Option<LeasePhase> {
    l.status.as_ref().and_then(|s| s.phase)
}

/// Reasons of the Events recorded for object `name`, oldest first.
pub async fn event_reasons(ns: &TestNamespace, name: &str) -> anyhow::Result<Vec<String>> {
    use k8s_openapi::api::events::v1::Event;
    let events = ns.api::<Event>().list(&Default::default()).await?;
    let mut evs: Vec<_> = events
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .collect();
    evs.sort_by_key(|e| e.event_time.clone().map(|t| t.0));
    Ok(evs.into_iter().filter_map(|e| e.reason).collect())
}
