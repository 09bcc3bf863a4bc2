//! The TaskLease the operator offers for an attempt.

use std::collections::BTreeMap;

use batchlease_api::keys::{LABEL_QUEUE, LABEL_TASK};
use batchlease_api::{BatchTask, LeasePhase, TaskLease, TaskLeaseSpec, TaskLeaseStatus, names};
use kube::{Resource, ResourceExt};

/// A lease `Offered` to the task's queue under fencing `token`, owned by the
/// task so deleting the task garbage-collects it.
pub fn offered_lease(task: &BatchTask, token: i64) -> TaskLease {
    let name = names::lease_name(&task.name_any(), token);
    let mut lease = TaskLease::new(
        &name,
        TaskLeaseSpec::offered(
            task.name_any(),
            task.uid().unwrap_or_default(),
            task.spec.queue.clone(),
            token,
            task.spec.lease_duration_seconds,
        ),
    );
    lease.metadata.namespace = task.namespace();
    lease.metadata.labels = Some(BTreeMap::from([
        (LABEL_TASK.to_owned(), names::label_value(&task.name_any())),
        (LABEL_QUEUE.to_owned(), task.spec.queue.clone()),
    ]));
    lease.metadata.owner_references = task.controller_owner_ref(&()).map(|r| vec![r]);
    lease.status = Some(TaskLeaseStatus {
        phase: Some(LeasePhase::Offered),
        ..Default::default()
    });
    lease
}

/// The metadata patch that gives `lease` back the labels and controller
/// reference the operator created it with, or `None` if they are intact.
///
/// Workers find offers by the queue label and the garbage collector deletes
/// leases with their task by the owner reference; both are plain metadata
/// that anyone allowed to update a lease can change (CEL cannot guard
/// labels). A lease is repaired only when it is one the operator created
/// for this task: its immutable `taskName`, `taskUID` and token say so, and
/// its name is the one that token gets. Other labels are left alone; another
/// controller reference is replaced (a lease has one controller: its task).
pub fn repair(task: &BatchTask, lease: &TaskLease) -> Option<serde_json::Value> {
    let uid = task.uid()?;
    let token = lease.spec.fencing_token;
    let ours = lease.spec.task_name == task.name_any()
        && lease.spec.task_uid == uid
        && token <= task.status.as_ref().map_or(0, |s| s.fencing_token)
        && lease.name_any() == names::lease_name(&task.name_any(), token);
    if !ours {
        return None;
    }
    let want_labels = [
        (LABEL_TASK, names::label_value(&task.name_any())),
        (LABEL_QUEUE, task.spec.queue.clone()),
    ];
    let labels = lease.labels();
    let labels_ok = want_labels.iter().all(|(k, v)| labels.get(*k) == Some(v));
    let owner = task.controller_owner_ref(&())?;
    let refs = lease.owner_references();
    let owner_ok = refs
        .iter()
        .filter(|r| r.controller == Some(true))
        .eq(std::iter::once(&owner));
    if labels_ok && owner_ok {
        return None;
    }
    let mut patch = serde_json::json!({"metadata": {}});
    if !labels_ok {
        patch["metadata"]["labels"] = want_labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), serde_json::Value::from(v.as_str())))
            .collect::<serde_json::Map<_, _>>()
            .into();
    }
    if !owner_ok {
        // A merge patch replaces the whole list: keep the non-controller
        // references, put ours back.
        let mut keep: Vec<_> = refs
            .iter()
            .filter(|r| r.controller != Some(true))
            .cloned()
            .collect();
        keep.push(owner);
        patch["metadata"]["ownerReferences"] = serde_json::to_value(keep).ok()?;
    }
    Some(patch)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use batchlease_api::{BatchTaskSpec, BatchTaskStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

    fn task() -> BatchTask {
        let mut t = BatchTask::new("t", BatchTaskSpec::for_queue("q"));
        t.metadata.namespace = Some("ns".into());
        t.metadata.uid = Some("uid-1".into());
        t.status = Some(BatchTaskStatus {
            fencing_token: 2,
            ..Default::default()
        });
        t
    }

    #[test]
    fn repair_table() {
        let t = task();
        let intact = offered_lease(&t, 2);
        let stranger = OwnerReference {
            api_version: "v1".into(),
            kind: "ConfigMap".into(),
            name: "x".into(),
            uid: "other".into(),
            controller: Some(true),
            ..Default::default()
        };
        type Edit = fn(&mut TaskLease, &OwnerReference);
        let cases: Vec<(&str, Edit, Option<serde_json::Value>)> = vec![
            ("intact", |_, _| {}, None),
            (
                "extra user label kept",
                |l, _| {
                    l.labels_mut().insert("team".into(), "a".into());
                },
                None,
            ),
            (
                "queue label removed",
                |l, _| {
                    l.labels_mut().remove(LABEL_QUEUE);
                },
                Some(
                    serde_json::json!({"metadata": {"labels": {LABEL_TASK: "t", LABEL_QUEUE: "q"}}}),
                ),
            ),
            (
                "queue label changed",
                |l, _| {
                    l.labels_mut().insert(LABEL_QUEUE.into(), "other".into());
                },
                Some(
                    serde_json::json!({"metadata": {"labels": {LABEL_TASK: "t", LABEL_QUEUE: "q"}}}),
                ),
            ),
            (
                "owner removed",
                |l, _| l.metadata.owner_references = None,
                Some(serde_json::json!({"metadata": {"ownerReferences": [
                    serde_json::to_value(task().controller_owner_ref(&()).unwrap()).unwrap()
                ]}})),
            ),
            (
                "controller replaced",
                |l, s| l.metadata.owner_references = Some(vec![s.clone()]),
                Some(serde_json::json!({"metadata": {"ownerReferences": [
                    serde_json::to_value(task().controller_owner_ref(&()).unwrap()).unwrap()
                ]}})),
            ),
        ];
        for (what, edit, want) in cases {
            let mut l = intact.clone();
            edit(&mut l, &stranger);
            assert_eq!(repair(&t, &l), want, "{what}");
        }
        // Not a lease the operator made for this task: left alone.
        let mut forged = offered_lease(&t, 9);
        forged.metadata.owner_references = None;
        assert_eq!(repair(&t, &forged), None, "token above the task's");
        let mut other_uid = offered_lease(&t, 1);
        other_uid.spec.task_uid = "uid-0".into();
        other_uid.metadata.labels = None;
        assert_eq!(repair(&t, &other_uid), None, "another incarnation's lease");
    }
}
