//! Which lease is a task's *current* lease.
//!
//! The operator and every worker must agree on it, and neither may trust a
//! lease by its name alone: anyone with `create` on taskleases can create an
//! object named `<task>-<token>` carrying any token (a forged
//! `fencingToken: 9223372036854775807` would fence out every real attempt
//! forever). A lease is the task's current one only if its name is the
//! task's `status.currentLease`, its token is the task's
//! `status.fencingToken`, and it belongs to this incarnation of the task by
//! `spec.taskUID` *and* by its controller ownerReference (the reference is
//! what garbage collection follows).

use kube::ResourceExt;

use crate::{BatchTask, TaskLease};

/// Why a lease is not its task's current lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NotCurrent {
    /// The task has no current lease, or it names another one.
    #[error("the task's status.currentLease names another lease")]
    Name,
    /// The lease's token is not the task's `status.fencingToken`.
    #[error("the lease's fencingToken is not the task's status.fencingToken")]
    Token,
    /// `spec.taskUID` names another incarnation of the task.
    #[error("the lease's taskUID is not the task's UID")]
    TaskUid,
    /// No controller ownerReference to this task's UID.
    #[error("the lease is not controlled by the task")]
    Owner,
}

impl NotCurrent {
    /// Low-cardinality label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Name => "name",
            Self::Token => "token",
            Self::TaskUid => "task_uid",
            Self::Owner => "owner",
        }
    }
}

/// Ok if `lease` is `task`'s current lease (see the module docs).
pub fn check_current(task: &BatchTask, lease: &TaskLease) -> Result<(), NotCurrent> {
    let status = task.status.as_ref();
    let name = lease.name_any();
    if status.and_then(|s| s.current_lease.as_deref()) != Some(name.as_str()) {
        return Err(NotCurrent::Name);
    }
    if status.map(|s| s.fencing_token) != Some(lease.spec.fencing_token) {
        return Err(NotCurrent::Token);
    }
    let uid = task.metadata.uid.as_deref().unwrap_or_default();
    if uid.is_empty() || lease.spec.task_uid != uid {
        return Err(NotCurrent::TaskUid);
    }
    let controlled = lease
        .owner_references()
        .iter()
        .any(|o| o.uid == uid && o.controller == Some(true));
    if !controlled {
        return Err(NotCurrent::Owner);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BatchTaskSpec, BatchTaskStatus, TaskLeaseSpec};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

    fn task() -> BatchTask {
        let mut t = BatchTask::new("job", BatchTaskSpec::for_queue("q"));
        t.metadata.uid = Some("u1".into());
        t.status = Some(BatchTaskStatus {
            fencing_token: 3,
            current_lease: Some("job-3".into()),
            ..Default::default()
        });
        t
    }

    fn lease(f: impl FnOnce(&mut TaskLease)) -> TaskLease {
        let mut l = TaskLease::new("job-3", TaskLeaseSpec::offered("job", "u1", "q", 3, 30));
        l.metadata.owner_references = Some(vec![OwnerReference {
            api_version: "batchlease.dev/v1alpha1".into(),
            kind: "BatchTask".into(),
            name: "job".into(),
            uid: "u1".into(),
            controller: Some(true),
            block_owner_deletion: Some(true),
        }]);
        f(&mut l);
        l
    }

    #[test]
    fn current_lease_table() {
        let cases: Vec<(&str, TaskLease, Result<(), NotCurrent>)> = vec![
            ("genuine", lease(|_| {}), Ok(())),
            (
                "other name",
                lease(|l| l.metadata.name = Some("job-2".into())),
                Err(NotCurrent::Name),
            ),
            (
                "forged token",
                lease(|l| l.spec.fencing_token = i64::MAX),
                Err(NotCurrent::Token),
            ),
            (
                "older incarnation",
                lease(|l| l.spec.task_uid = "u0".into()),
                Err(NotCurrent::TaskUid),
            ),
            (
                "no owner",
                lease(|l| l.metadata.owner_references = None),
                Err(NotCurrent::Owner),
            ),
            (
                "owner not controller",
                lease(|l| {
                    if let Some(o) = l.metadata.owner_references.as_mut() {
                        o[0].controller = None;
                    }
                }),
                Err(NotCurrent::Owner),
            ),
        ];
        for (what, l, want) in cases {
            assert_eq!(check_current(&task(), &l), want, "{what}");
        }
        let mut no_status = task();
        no_status.status = None;
        assert_eq!(
            check_current(&no_status, &lease(|_| {})),
            Err(NotCurrent::Name)
        );
        let mut no_uid = task();
        no_uid.metadata.uid = None;
        let mut l = lease(|_| {});
        l.spec.task_uid = String::new();
        assert_eq!(check_current(&no_uid, &l), Err(NotCurrent::TaskUid));
    }
}
