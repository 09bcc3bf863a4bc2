//! Label and condition names shared by the operator
//! and the SDK, so neither spells them on its own.

/// Label on a TaskLease: the (possibly shortened, see
/// [`crate::names::label_value`]) name of its BatchTask.
pub const LABEL_TASK: &str = "batchlease.dev/task";
/// Label on a TaskLease: its queue, so workers list only their queues.
pub const LABEL_QUEUE: &str = "batchlease.dev/queue";
/// Label on a BatchTask spawned by another (`ctx.spawn`): its parent's
/// (possibly shortened) name, so `kubectl get bt -l batchlease.dev/parent=NAME`
/// — and the operator, before a parent ends — lists a task's children.
pub const LABEL_PARENT: &str = "batchlease.dev/parent";

/// Label on a worker's presence record: a `coordination.k8s.io` Lease the
/// SDK renews for each worker process in its namespace, so the operator
/// counts the workers serving a queue even while they hold no TaskLease
/// (`TaskQueue.status.workers`). Informational: no decision reads it.
///
/// On a TaskLease the same key names the WorkerLease of the worker an
/// offer is addressed to (`spec.offeredTo`): that worker watches the
/// leases so labelled instead of every lease of its queues, so a lease's
/// changes are sent to its worker and the operator only.
pub const LABEL_WORKER: &str = "batchlease.dev/worker";
/// Annotation on a presence record: the queues the worker serves,
/// comma-separated.
pub const ANNOTATION_QUEUES: &str = "batchlease.dev/queues";

/// The name of the presence record of worker `identity` (holder
/// identities hold a `/`, which no object name may).
pub fn presence_name(identity: &str) -> String {
    format!("batchlease-worker-{}", crate::names::short_hash(identity))
}

/// Condition types of a BatchTask.
pub mod condition {
    /// True while a lease is offered or held for the current attempt.
    pub const LEASED: &str = "Leased";
    /// True once the task succeeded.
    pub const SUCCEEDED: &str = "Succeeded";
    /// True while the task is dead-lettered.
    pub const DEAD_LETTERED: &str = "DeadLettered";
    /// True while a dependency is missing or has not succeeded yet; the
    /// message names them.
    pub const WAITING_FOR_DEPENDENCIES: &str = "WaitingForDependencies";
    /// True while a dependency is dead-lettered or rejected.
    pub const DEPENDENCY_FAILED: &str = "DependencyFailed";
    /// True when the task was rejected for being on a dependency cycle; the
    /// message names the cycle.
    pub const CYCLE_DETECTED: &str = "CycleDetected";
    /// On a speculative task, after each of its attempts settled: whether
    /// the queue's recent abort rate is healthy (False above 30 %: a
    /// livelock, design §6); the message gives the rate.
    pub const SPECULATION_HEALTHY: &str = "SpeculationHealthy";
    /// True once the task is `Cancelled` (`spec.cancel`).
    pub const CANCELLED: &str = "Cancelled";
    /// True when a spawned task was `Rejected` because it was created after
    /// its parent had ended (a late create of a stopped attempt); the
    /// message names the parent and its phase.
    pub const SPAWN_REFUSED: &str = "SpawnRefused";
}

/// Reasons of the leases the operator releases (phase `Released`).
pub mod release_reason {
    /// The task's `spec.cancel` was set.
    pub const CANCELLED: &str = "Cancelled";
    /// The queue's TaskQueue is paused: an offer nobody claimed yet is
    /// withdrawn.
    pub const QUEUE_PAUSED: &str = "QueuePaused";
}
