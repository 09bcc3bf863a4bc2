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
