//! Objects for the unit tests, built like the API server returns them.

use batchlease_api::{
    BatchTask, BatchTaskSpec, BatchTaskStatus, LeasePhase, TaskLease, TaskLeaseSpec,
    TaskLeaseStatus, TaskPhase, TaskQueue, TaskQueueSpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;

/// Second `s` after the epoch.
pub fn ts(s: i64) -> Timestamp {
    Timestamp::from_second(s).unwrap_or(Timestamp::UNIX_EPOCH)
}

pub fn task(
    name: &str,
    queue: &str,
    phase: TaskPhase,
    f: impl FnOnce(&mut BatchTaskStatus),
) -> BatchTask {
    let mut t = BatchTask::new(name, BatchTaskSpec::for_queue(queue));
    t.metadata.namespace = Some("ns".into());
    t.metadata.uid = Some(format!("uid-{name}"));
    t.metadata.creation_timestamp = Some(Time(ts(0)));
    let mut status = BatchTaskStatus {
        phase: Some(phase),
        ..Default::default()
    };
    f(&mut status);
    t.status = Some(status);
    t
}

pub fn lease(
    name: &str,
    queue: &str,
    phase: LeasePhase,
    holder: Option<&str>,
    created: Timestamp,
) -> TaskLease {
    let (task, token) = name.rsplit_once('-').unwrap_or((name, "1"));
    let mut l = TaskLease::new(
        name,
        TaskLeaseSpec::offered(
            task,
            format!("uid-{task}"),
            queue,
            token.parse().unwrap_or(1),
            30,
        ),
    );
    l.metadata.namespace = Some("ns".into());
    l.metadata.creation_timestamp = Some(Time(created));
    l.spec.holder_identity = holder.map(Into::into);
    l.status = Some(TaskLeaseStatus {
        phase: Some(phase),
        ..Default::default()
    });
    l
}

/// The TaskQueue of queue `name` in namespace `ns`.
pub fn task_queue(name: &str, paused: bool) -> TaskQueue {
    let mut q = TaskQueue::new(
        name,
        TaskQueueSpec {
            paused,
            ..Default::default()
        },
    );
    q.metadata.namespace = Some("ns".into());
    q.metadata.uid = Some(format!("uid-{name}"));
    q
}
