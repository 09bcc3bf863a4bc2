//! The `batchlease.dev/v1alpha1` API: `BatchTask`, `TaskLease` and
//! `TaskQueue`.
//!
//! Both the operator and the worker SDK depend on this crate and on nothing
//! of each other. It picks no `k8s-openapi` version feature: binaries do.

mod batch_task;
mod current;
mod error_chain;
pub mod graph;
mod json;
pub mod keys;
pub mod names;
mod schema;
mod task_lease;
mod task_queue;
mod watch_backoff;
pub mod worker_lease;

pub use batch_task::{
    AttemptRecord, BackoffSpec, BatchTask, BatchTaskSpec, BatchTaskStatus, Failure, RetryPolicy,
    TaskMode, TaskPhase, defaults,
};
pub use current::{NotCurrent, check_current};
pub use error_chain::{Chain, error_chain};
pub use json::{
    JsonObject, JsonObjectError, MAX_CHECKPOINT_BYTES, MAX_DEPTH, MAX_MESSAGE_CHARS,
    MAX_REASON_CHARS, MAX_RESULT_BYTES,
};
pub use task_lease::{
    BOUND_NO_SLOT, BOUND_NOT_TAKEN, BOUND_UNCONFIRMED, BOUND_WHILE_DRAINING, LeaseOutcome,
    LeasePhase, Renewal, TaskLease, TaskLeaseSpec, TaskLeaseStatus,
};
pub use task_queue::{
    TaskCounts, TaskQueue, TaskQueueSpec, TaskQueueStatus, ThrottleCounts, queue_condition,
};
pub use watch_backoff::WatchBackoff;
pub use worker_lease::{AttemptRef, WorkerLease, WorkerLeaseSpec, WorkerLeaseStatus};

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;

/// The CRDs to install, exactly as `crds/` holds them.
///
/// Use this rather than `TaskLease::crd()`: kube-derive gives every kind with
/// a status a status subresource, and TaskLease must not have one (design
/// §2: each lease transition is one write of spec and status together).
pub fn crds() -> Vec<CustomResourceDefinition> {
    let mut lease = TaskLease::crd();
    for version in &mut lease.spec.versions {
        version.subresources = None;
    }
    vec![
        BatchTask::crd(),
        lease,
        TaskQueue::crd(),
        WorkerLease::crd(),
    ]
}
