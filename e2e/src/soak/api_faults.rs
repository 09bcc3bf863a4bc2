//! The soak's faults made through the API, as a tenant or an admin
//! would: tampered and forged leases, cancels, deleted WorkerLeases.

use batchlease_api::{BatchTask, LeasePhase, TaskLease, TaskPhase, WorkerLease};
use kube::ResourceExt;
use kube::api::{Patch, PatchParams};
use serde_json::json;

use crate::tasks::phase_of;

/// Hides a live lease from the queue's workers (wrong queue label) and
/// from the garbage collector (no owner reference); the operator must put
/// both back.
pub(super) async fn tamper(api: &kube::Api<TaskLease>, pick: u64) -> anyhow::Result<()> {
    let live: Vec<TaskLease> = api
        .list(&Default::default())
        .await?
        .items
        .into_iter()
        .filter(|l| {
            matches!(
                l.status.as_ref().and_then(|s| s.phase),
                Some(LeasePhase::Offered | LeasePhase::Held)
            ) && !l.owner_references().is_empty()
        })
        .collect();
    let Some(victim) = pick_one(&live, pick) else {
        return Ok(());
    };
    api.patch(
        &victim.name_any(),
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {
            "labels": {"batchlease.dev/queue": "elsewhere"},
            "ownerReferences": null,
        }})),
    )
    .await?;
    Ok(())
}

/// Plants an Offered lease with the largest token for a running task,
/// visible to the queue's workers: nobody may claim it or be fenced by it.
pub(super) async fn forge(
    leases: &kube::Api<TaskLease>,
    tasks: &kube::Api<BatchTask>,
    pick: u64,
    n: usize,
) -> anyhow::Result<()> {
    let open: Vec<BatchTask> = tasks
        .list(&Default::default())
        .await?
        .items
        .into_iter()
        .filter(|t| !phase_of(t).is_some_and(TaskPhase::is_terminal))
        .collect();
    let Some(task) = pick_one(&open, pick) else {
        return Ok(());
    };
    let forged: TaskLease = serde_json::from_value(json!({
        "apiVersion": "batchlease.dev/v1alpha1", "kind": "TaskLease",
        "metadata": {"name": format!("forged-{n}"), "labels": {
            "batchlease.dev/task": task.name_any(), "batchlease.dev/queue": "soak"}},
        "spec": {"taskName": task.name_any(), "taskUID": task.uid().unwrap_or_default(),
                 "queue": "soak", "fencingToken": i64::MAX, "leaseDurationSeconds": 30},
        "status": {"phase": "Offered"}
    }))?;
    leases.create(&Default::default(), &forged).await?;
    Ok(())
}

/// Cancels a task that has not finished (`spec.cancel`, as `kubectl
/// batchlease cancel` does) — running (its attempt revoked or released,
/// its locks handed on) or waiting; whether there was one.
pub(super) async fn cancel(tasks: &kube::Api<BatchTask>, pick: u64) -> anyhow::Result<bool> {
    let open: Vec<BatchTask> = tasks
        .list(&Default::default())
        .await?
        .items
        .into_iter()
        .filter(|t| !phase_of(t).is_some_and(TaskPhase::is_terminal) && !t.spec.cancel)
        .collect();
    let Some(task) = pick_one(&open, pick) else {
        return Ok(false);
    };
    tasks
        .patch(
            &task.name_any(),
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"cancel": true}})),
        )
        .await?;
    Ok(true)
}

/// Deletes a worker's WorkerLease under it (a user's `kubectl delete wl`,
/// a namespace cleanup): its worker kills what it kept alive, gives it
/// back and creates the object again.
pub(super) async fn delete_worker_lease(
    api: &kube::Api<WorkerLease>,
    pick: u64,
) -> anyhow::Result<bool> {
    let all = api.list(&Default::default()).await?.items;
    let Some(victim) = pick_one(&all, pick) else {
        return Ok(false);
    };
    api.delete(&victim.name_any(), &Default::default()).await?;
    Ok(true)
}

fn pick_one<T>(items: &[T], pick: u64) -> Option<&T> {
    let len = u64::try_from(items.len()).ok().filter(|n| *n > 0)?;
    items.get(usize::try_from(pick % len).ok()?)
}
