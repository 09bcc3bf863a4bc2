//! One consistent look at the caches: what every page is computed from.
//! The views are pure functions of a [`Snapshot`] and a time, so they are
//! table-tested without a server.

use std::sync::Arc;

use batchlease_api::{BatchTask, TaskLease, TaskPhase, TaskQueue};

/// The objects the dashboard's watches hold.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub tasks: Vec<Arc<BatchTask>>,
    pub leases: Vec<Arc<TaskLease>>,
    pub queues: Vec<Arc<TaskQueue>>,
}

impl Snapshot {
    /// The task `name` of `namespace`.
    pub fn task(&self, namespace: &str, name: &str) -> Option<&Arc<BatchTask>> {
        self.tasks.iter().find(|t| {
            t.metadata.name.as_deref() == Some(name)
                && t.metadata.namespace.as_deref() == Some(namespace)
        })
    }
}

/// A task's phase (`Pending` before the operator first wrote its status).
pub fn phase(t: &BatchTask) -> TaskPhase {
    t.status
        .as_ref()
        .and_then(|s| s.phase)
        .unwrap_or(TaskPhase::Pending)
}
