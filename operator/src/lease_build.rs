//! The TaskLease the operator offers for an attempt.

use std::collections::BTreeMap;

use batchlease_api::keys::{LABEL_QUEUE, LABEL_TASK, LABEL_WORKER};
use batchlease_api::{
    BatchTask, LeasePhase, Renewal, TaskLease, TaskLeaseSpec, TaskLeaseStatus, names,
};
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
    // This operator honours WorkerLeases: the claim may choose to be
    // renewed through one (see `effects::revoke`).
    lease.spec.renewal = Some(Renewal::Lease);
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

/// `lease` with the labels and controller reference the operator created
/// it with put back, or `None` if they are intact.
///
/// Workers find offers by the queue label and the garbage collector deletes
/// leases with their task by the owner reference, and an addressed offer's
/// worker finds it by its label (`batchlease.dev/worker`, which goes with
/// `spec.offeredTo`); all are plain metadata
/// that anyone allowed to update a lease can change (CEL cannot guard
/// labels). A lease is repaired only when it is one the operator created
/// for this task: its immutable `taskName`, `taskUID` and token say so, and
/// its name is the one that token gets. Other labels are left alone; another
/// controller reference is replaced (a lease has one controller: its task).
/// The caller writes the result with the cached `resourceVersion` (a CAS,
/// under the `update` verb the operator already has): a lease that changed
/// since is repaired on its next event.
pub fn repair(task: &BatchTask, lease: &TaskLease) -> Option<TaskLease> {
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
    // The label its addressee watches goes with `spec.offeredTo`: a lease
    // without it would be invisible to its worker, one with it but no
    // address sent to a worker that may not claim it.
    let worker_label = lease
        .spec
        .offered_to
        .as_deref()
        .map(batchlease_api::worker_lease::worker_lease_name);
    let labels_ok = want_labels
        .iter()
        .all(|(k, v)| lease.labels().get(*k) == Some(v))
        && lease.labels().get(LABEL_WORKER) == worker_label.as_ref();
    let owner = task.controller_owner_ref(&())?;
    let owner_ok = lease
        .owner_references()
        .iter()
        .filter(|r| r.controller == Some(true))
        .eq(std::iter::once(&owner));
    if labels_ok && owner_ok {
        return None;
    }
    let mut fixed = lease.clone();
    for (k, v) in want_labels {
        fixed.labels_mut().insert(k.to_owned(), v);
    }
    match worker_label {
        Some(v) => {
            fixed.labels_mut().insert(LABEL_WORKER.to_owned(), v);
        }
        None => {
            fixed.labels_mut().remove(LABEL_WORKER);
        }
    }
    if !owner_ok {
        let refs = fixed.owner_references_mut();
        refs.retain(|r| r.controller != Some(true));
        refs.push(owner);
    }
    Some(fixed)
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

    /// (labels of the task and queue, controller kinds) after repair.
    fn shape(l: &TaskLease) -> (Option<String>, Option<String>, Vec<String>, usize) {
        (
            l.labels().get(LABEL_TASK).cloned(),
            l.labels().get(LABEL_QUEUE).cloned(),
            l.owner_references()
                .iter()
                .filter(|r| r.controller == Some(true))
                .map(|r| r.uid.clone())
                .collect(),
            l.labels().len(),
        )
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
        let fixed = Some((
            Some("t".into()),
            Some("q".into()),
            vec!["uid-1".to_owned()],
            2,
        ));
        type Edit = fn(&mut TaskLease, &OwnerReference);
        let cases: Vec<(&str, Edit, Option<_>)> = vec![
            ("intact", |_, _| {}, None),
            (
                "extra user label kept, not a repair",
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
                fixed.clone(),
            ),
            (
                "queue label changed",
                |l, _| {
                    l.labels_mut().insert(LABEL_QUEUE.into(), "other".into());
                },
                fixed.clone(),
            ),
            (
                "worker label without an address",
                |l, _| {
                    l.labels_mut().insert(LABEL_WORKER.into(), "x".into());
                },
                fixed.clone(),
            ),
            (
                "owner removed",
                |l, _| l.metadata.owner_references = None,
                fixed.clone(),
            ),
            (
                "controller replaced",
                |l, s| l.metadata.owner_references = Some(vec![s.clone()]),
                fixed.clone(),
            ),
        ];
        for (what, edit, want) in cases {
            let mut l = intact.clone();
            edit(&mut l, &stranger);
            let got = repair(&t, &l);
            assert_eq!(got.as_ref().map(shape), want, "{what}");
            if let Some(g) = got {
                assert_eq!(
                    (&g.spec, &g.status),
                    (&l.spec, &l.status),
                    "{what}: only metadata"
                );
            }
        }
        // Not a lease the operator made for this task: left alone.
        let mut forged = offered_lease(&t, 9);
        forged.metadata.owner_references = None;
        assert!(repair(&t, &forged).is_none(), "token above the task's");
        let mut other_uid = offered_lease(&t, 1);
        other_uid.spec.task_uid = "uid-0".into();
        other_uid.metadata.labels = None;
        assert!(
            repair(&t, &other_uid).is_none(),
            "another incarnation's lease"
        );
    }

    #[test]
    fn an_addressed_offer_gets_its_worker_label_back() {
        let t = task();
        let mut l = offered_lease(&t, 2);
        l.spec.offered_to = Some("w/1".into());
        let fixed = repair(&t, &l).unwrap();
        assert_eq!(
            fixed.labels().get(LABEL_WORKER),
            Some(&batchlease_api::worker_lease::worker_lease_name("w/1"))
        );
        assert!(repair(&t, &fixed).is_none(), "intact once repaired");
    }
}
