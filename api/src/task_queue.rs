//! `TaskQueue`: optional controls and a summary of one queue (design §9).
//! A queue without a TaskQueue behaves as if it had one with every field
//! unset: not paused, no cap, no rate limit.

use crate::schema;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// How the operator issues leases for the queue this object is named for.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[kube(
    group = "batchlease.dev",
    version = "v1alpha1",
    kind = "TaskQueue",
    namespaced,
    status = "TaskQueueStatus",
    shortname = "tq",
    category = "batchlease",
    derive = "PartialEq",
    doc = "Controls of one queue of BatchTasks (named for it, in the tasks' namespace): pause, concurrency cap, issue rate; its status summarises the queue.",
    printcolumn(name = "Paused", type_ = "boolean", json_path = ".spec.paused"),
    printcolumn(name = "Ready", type_ = "integer", json_path = ".status.tasks.ready"),
    printcolumn(name = "Running", type_ = "integer", json_path = ".status.tasks.running"),
    printcolumn(name = "Dead", type_ = "integer", json_path = ".status.tasks.deadLettered"),
    printcolumn(name = "Workers", type_ = "integer", json_path = ".status.workers"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    validation = Rule::new("self.metadata.name.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$') && size(self.metadata.name) <= 63")
        .message("a TaskQueue is named for its queue (spec.queue of its tasks): a DNS label of at most 63 characters")
        .reason(Reason::FieldValueInvalid),
)]
#[serde(rename_all = "camelCase")]
pub struct TaskQueueSpec {
    /// No new leases are offered while set; offered leases nobody claimed
    /// yet are withdrawn (their tasks wait, no retry spent); held leases
    /// run to their end.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub paused: bool,

    /// At most this many leases of the queue Offered or Held at once.
    /// Lowering it below what is live withdraws no lease; new ones wait
    /// until the queue is below the cap.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1_000_000))]
    pub max_concurrent: Option<i32>,

    /// At most this many leases issued per second (a token bucket holding
    /// one second's worth).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 10_000))]
    pub max_issues_per_second: Option<i32>,
}

/// The queue as the operator's caches last showed it, written at most
/// every few seconds (never per task).
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TaskQueueStatus {
    /// The spec generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Tasks by phase.
    #[serde(default)]
    pub tasks: TaskCounts,
    /// Leases offered and not yet claimed.
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub leases_offered: i64,
    /// Leases held by a worker.
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub leases_held: i64,
    /// Distinct workers holding a lease of the queue, or that held one
    /// within one lease TTL.
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub workers: i64,
    /// When the longest-waiting `Ready` task's lease was offered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oldest_ready_since: Option<Time>,
    /// Speculative attempts that lost their compare-and-swap, over all
    /// attempts that ended, of the queue's current tasks, in percent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 100))]
    pub abort_rate_percent: Option<i32>,
    /// Issues held back since the operator started: by the pause, the
    /// concurrency cap, the rate limit.
    #[serde(default)]
    pub throttled: ThrottleCounts,
    /// `Paused`, `AtCapacity`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "schema::conditions")]
    pub conditions: Vec<Condition>,
}

/// Tasks of a queue by phase.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct TaskCounts {
    #[serde(default)]
    pub pending: i64,
    #[serde(default)]
    pub ready: i64,
    #[serde(default)]
    pub running: i64,
    #[serde(default)]
    pub succeeded: i64,
    #[serde(default)]
    pub dead_lettered: i64,
    #[serde(default)]
    pub rejected: i64,
    #[serde(default)]
    pub cancelled: i64,
}

impl TaskCounts {
    /// Counts one task in `phase` (`None`: not yet initialized, Pending).
    pub fn add(&mut self, phase: Option<crate::TaskPhase>) {
        use crate::TaskPhase as P;
        let n = match phase.unwrap_or(P::Pending) {
            P::Pending => &mut self.pending,
            P::Ready => &mut self.ready,
            P::Running => &mut self.running,
            P::Succeeded => &mut self.succeeded,
            P::DeadLettered => &mut self.dead_lettered,
            P::Rejected => &mut self.rejected,
            P::Cancelled => &mut self.cancelled,
        };
        *n += 1;
    }
}

/// Issues held back, by cause.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ThrottleCounts {
    #[serde(default)]
    pub paused: i64,
    #[serde(default)]
    pub max_concurrent: i64,
    #[serde(default)]
    pub rate: i64,
    /// Held until a worker of the queue had a free slot (every live worker
    /// of it taking bound attempts): the issue then goes out bound.
    #[serde(default)]
    pub worker_slots: i64,
}

/// Condition types of a TaskQueue.
pub mod queue_condition {
    /// True while `spec.paused` is in force (offered leases withdrawn).
    pub const PAUSED: &str = "Paused";
    /// True while the queue has `spec.maxConcurrent` leases live.
    pub const AT_CAPACITY: &str = "AtCapacity";
}
