//! `BatchTask`: one unit of batch work, owned by users (spec) and the
//! operator (status). Its `status.fencingToken` is the fencing source for
//! every lease ever issued for the task.

use crate::json::JsonObject;
use crate::schema;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// What a user asks batchlease to run.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "batchlease.dev",
    version = "v1alpha1",
    kind = "BatchTask",
    namespaced,
    status = "BatchTaskStatus",
    shortname = "bt",
    category = "batchlease",
    derive = "PartialEq",
    doc = "A unit of batch work run by a worker that holds a fenced, renewable TaskLease.",
    printcolumn(name = "Queue", type_ = "string", json_path = ".spec.queue"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Token", type_ = "integer", json_path = ".status.fencingToken"),
    // Retries spent (failed or expired attempts), not attempts run: a task
    // that succeeded at its first try shows 0. Named "Attempts" it read as
    // the number of runs.
    printcolumn(
        name = "Retries",
        type_ = "integer",
        json_path = ".status.attempts",
        description = "Retries spent: attempts that failed or expired (0 for a task that succeeded at its first try)"
    ),
    printcolumn(name = "Holder", type_ = "string", json_path = ".status.holder"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    selectable = ".spec.queue",
    selectable = ".status.phase",
    // Rules that need the object's name or compare status across writes
    // live on the root: a rule on `status` alone would not see a writer that
    // drops the whole status stanza.
    validation = Rule::new("!has(self.spec.dependsOn) || !(self.metadata.name in self.spec.dependsOn)")
        .message("spec.dependsOn must not contain the task's own name")
        .field_path(".spec.dependsOn")
        .reason(Reason::FieldValueInvalid),
    // Immutable: a task holding locks for the resources it listed must give
    // back exactly those; an edit mid-acquisition would strand a lock.
    // On the root, so adding or removing the whole list is caught too (a
    // transition rule on the field does not run when it is absent).
    validation = Rule::new(
        "has(self.spec.resources) == has(oldSelf.spec.resources) && (!has(self.spec.resources) || self.spec.resources == oldSelf.spec.resources)"
    )
    .message("spec.resources is immutable: re-create the task to change them")
    .field_path(".spec.resources")
    .reason(Reason::FieldValueForbidden),
    validation = Rule::new(
        "!has(oldSelf.status) || !has(oldSelf.status.fencingToken) || (has(self.status) && has(self.status.fencingToken) && self.status.fencingToken >= oldSelf.status.fencingToken)"
    )
    .message("status.fencingToken must never decrease: it fences every lease issued for this task")
    .field_path(".status.fencingToken")
    .reason(Reason::FieldValueForbidden),
    // On the root: a transition rule on the field itself would not run
    // when a writer drops it.
    validation = Rule::new(
        "!has(oldSelf.spec.cancel) || !oldSelf.spec.cancel || (has(self.spec.cancel) && self.spec.cancel)"
    )
    .message("spec.cancel may only go from false to true: a cancelled task stays cancelled")
    .field_path(".spec.cancel")
    .reason(Reason::FieldValueForbidden),
)]
#[serde(rename_all = "camelCase")]
pub struct BatchTaskSpec {
    /// Worker pool that runs this task: workers claim leases of their queues.
    /// A DNS label (lowercase letters, digits and '-', at most 63 characters).
    /// Immutable: offered leases carry the queue, and a task must not move
    /// to another worker pool under a lease offered to the first.
    #[schemars(length(min = 1, max = 63))]
    #[x_kube(
        validation = Rule::new("self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$')")
            .message("queue must be a DNS label: lowercase letters, digits and '-', starting and ending with a letter or digit"),
        validation = Rule::new("self == oldSelf").message("queue is immutable"),
    )]
    pub queue: String,

    /// Free-form description of the work, handed to the worker as-is.
    /// Kept as raw JSON text (any depth the API server accepts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload: Option<JsonObject>,

    /// Lease TTL in seconds (5..3600). A holder that has not renewed for this
    /// long loses the task; its worker stops itself after 2/3 of it.
    #[serde(default = "defaults::lease_duration_seconds")]
    #[x_kube(validation = Rule::new("self >= 5 && self <= 3600")
        .message("leaseDurationSeconds must be between 5 and 3600"))]
    pub lease_duration_seconds: i32,

    /// Attempts after the first before the task is dead-lettered (0..100).
    #[serde(default = "defaults::max_retries")]
    #[x_kube(validation = Rule::new("self >= 0 && self <= 100")
        .message("maxRetries must be between 0 and 100"))]
    pub max_retries: i32,

    /// Delay between attempts: min(max, initial·multiplier^n) plus uniform
    /// jitter in [0, delay/2].
    #[serde(default)]
    pub backoff: BackoffSpec,

    /// Which failures are not worth a retry.
    #[serde(default, skip_serializing_if = "RetryPolicy::is_empty")]
    pub retry_policy: RetryPolicy,

    /// Wall-clock bound of one attempt, enforced by the worker's kill switch
    /// and by the operator. At most one year: a bound keeps every clock
    /// addition in the SDK and operator far from overflow.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 31_536_000))]
    pub active_deadline_seconds: Option<i64>,

    /// Seconds after the task finished (`Succeeded`, `DeadLettered`,
    /// `Rejected` or `Cancelled`; `status.completionTime`) that the operator deletes it,
    /// and with it its leases, which it owns. Unset: kept. What workers
    /// committed to storage is the user's and stays. At most one year.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 31_536_000))]
    pub ttl_seconds_after_finished: Option<i64>,

    /// Names of BatchTasks in the same namespace that must succeed first
    /// (a set: duplicates are rejected).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "schema::depends_on")]
    pub depends_on: Vec<String>,

    /// Named shared resources this task needs exclusively (Exclusive mode;
    /// a set: duplicates are rejected). Immutable.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "schema::resources")]
    pub resources: Vec<String>,

    /// How the task is protected against concurrent writers.
    #[serde(default)]
    pub mode: TaskMode,

    /// Aborted speculative attempts before the task falls back to Exclusive.
    #[serde(default = "defaults::max_speculative_aborts")]
    #[schemars(range(min = 0, max = 100))]
    pub max_speculative_aborts: i32,

    /// Bump to move a DeadLettered task back to Pending with a fresh retry
    /// budget. May only increase.
    #[serde(default)]
    #[schemars(range(min = 0))]
    #[x_kube(validation = Rule::new("self >= oldSelf").message("redrive may only increase"))]
    pub redrive: i64,

    /// Set to stop the task for good: an offered lease is withdrawn, a
    /// held one released (its holder's next renewal fails and its kill
    /// switch fires), and the task ends `Cancelled` once no attempt can
    /// still be running. May only go from false to true. A task that had
    /// already succeeded stays `Succeeded`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cancel: bool,
}

/// Exponential backoff between attempts.
/// Which failures are not retried (design §9).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct RetryPolicy {
    /// Failure reasons — the CamelCase `reason` of a failed attempt, as its
    /// worker reported it (e.g. `BadInput`), or of an expired one
    /// (`LeaseExpired`, `ActiveDeadlineExceeded`) — that dead-letter the
    /// task at once instead of spending a retry. A set of at most 32.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "schema::reasons")]
    pub non_retryable_reasons: Vec<String>,
}

impl RetryPolicy {
    /// Nothing set (serialized as no field at all).
    pub fn is_empty(&self) -> bool {
        self.non_retryable_reasons.is_empty()
    }

    /// Whether a failure with `reason` is retried.
    pub fn retries(&self, reason: &str) -> bool {
        !self.non_retryable_reasons.iter().any(|r| r == reason)
    }
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.maxSeconds >= self.initialSeconds")
    .message("backoff.maxSeconds must be at least backoff.initialSeconds"))]
pub struct BackoffSpec {
    /// Delay before the first retry, in seconds.
    #[serde(default = "defaults::backoff_initial_seconds")]
    #[schemars(range(min = 1, max = 86400))]
    pub initial_seconds: i64,
    /// Upper bound of the delay (before jitter), in seconds.
    #[serde(default = "defaults::backoff_max_seconds")]
    #[schemars(range(min = 1, max = 86400))]
    pub max_seconds: i64,
    /// Growth factor per retry. An integer: Kubernetes APIs avoid floats.
    #[serde(default = "defaults::backoff_multiplier")]
    #[schemars(range(min = 1, max = 10))]
    pub multiplier: i64,
}

impl Default for BackoffSpec {
    fn default() -> Self {
        Self {
            initial_seconds: defaults::backoff_initial_seconds(),
            max_seconds: defaults::backoff_max_seconds(),
            multiplier: defaults::backoff_multiplier(),
        }
    }
}

/// Concurrency protection of a task.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TaskMode {
    /// Take the task's resource locks before a lease is issued.
    #[default]
    Exclusive,
    /// Run without locks and commit with compare-and-swap; aborts retry.
    Speculative,
}

/// Lifecycle of a task. Written only by the operator.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TaskPhase {
    /// Waiting for dependencies, backoff or locks.
    Pending,
    /// A lease is offered to the task's queue.
    Ready,
    /// A worker holds the lease.
    Running,
    /// A worker completed the task.
    Succeeded,
    /// The retry budget is spent; bump `spec.redrive` to try again.
    DeadLettered,
    /// The task can never run as specified (e.g. a dependency cycle).
    Rejected,
    /// `spec.cancel` was set; no attempt runs and none will. Final.
    Cancelled,
}

impl TaskPhase {
    /// The phase as written in the API (stable, for labels and logs).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "Pending",
            Self::Ready => "Ready",
            Self::Running => "Running",
            Self::Succeeded => "Succeeded",
            Self::DeadLettered => "DeadLettered",
            Self::Rejected => "Rejected",
            Self::Cancelled => "Cancelled",
        }
    }

    /// A task in a terminal phase gets no more leases (until redriven,
    /// for `DeadLettered` and `Rejected`; `Succeeded` and `Cancelled`
    /// are final).
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            Self::Succeeded | Self::DeadLettered | Self::Rejected | Self::Cancelled
        )
    }

    /// Every phase, in lifecycle order (for metrics and summaries).
    pub const ALL: [Self; 7] = [
        Self::Pending,
        Self::Ready,
        Self::Running,
        Self::Succeeded,
        Self::DeadLettered,
        Self::Rejected,
        Self::Cancelled,
    ];
}

/// What the operator knows about a task. Users never write it.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct BatchTaskStatus {
    /// Where the task is in its lifecycle.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<TaskPhase>,
    /// Incremented each time a lease is issued; the token a worker's writes
    /// carry. Never decreases.
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub fencing_token: i64,
    /// Attempts that spent the retry budget.
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub attempts: i32,
    /// Speculative attempts that lost their compare-and-swap.
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub aborts: i32,
    /// Name of the TaskLease of the current attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_lease: Option<String>,
    /// The TTL the current lease was issued with (its
    /// `spec.leaseDurationSeconds`), written with the token. Should that
    /// lease go missing, its holder's kill switch runs on this TTL, not on
    /// the task's `spec.leaseDurationSeconds`, which may have been edited
    /// since.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub current_lease_duration_seconds: Option<i32>,
    /// Identity of the worker holding the current lease.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder: Option<String>,
    /// How the holder keeps the current lease alive (its
    /// `spec.renewal`), written with `holder`. Should the lease go
    /// missing, a holder renewing per worker may run a refresh period
    /// longer than one renewing per lease.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_renewal: Option<crate::Renewal>,
    /// No lease is issued before this time (backoff); kept in status so it
    /// survives operator restarts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_attempt_after: Option<Time>,
    /// The mode in force: Speculative tasks fall back to Exclusive after too
    /// many aborts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effective_mode: Option<TaskMode>,
    /// Last progress a worker recorded, handed to the next attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<JsonObject>,
    /// Small result reported by the worker that completed the task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<JsonObject>,
    /// Why the last attempt failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_failure: Option<Failure>,
    /// When the task became `Succeeded`, `DeadLettered`, `Rejected` or
    /// `Cancelled`
    /// (cleared by a redrive): `spec.ttlSecondsAfterFinished` counts from
    /// here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_time: Option<Time>,
    /// The last 10 attempts, oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 10))]
    pub history: Vec<AttemptRecord>,
    /// Standard conditions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "schema::conditions")]
    pub conditions: Vec<Condition>,
    /// The spec generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The `spec.redrive` value the operator has acted on; a larger
    /// `spec.redrive` is a pending redrive request.
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub observed_redrive: i64,
}

/// Why an attempt failed.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Failure {
    /// Short CamelCase reason, e.g. `LeaseExpired`, `HandlerFailed`.
    #[schemars(length(max = 128))]
    pub reason: String,
    /// Human-readable detail.
    #[serde(default)]
    #[schemars(length(max = 4096))]
    pub message: String,
    /// The fencing token of the attempt that failed. Tokens are not
    /// ordinals (a token whose lease went missing is skipped without
    /// spending a retry), so this is no count: `status.attempts` is. Read
    /// also from `attempt`, its name before 0.1.0.
    #[serde(alias = "attempt")]
    pub token: i64,
    /// When the operator recorded the failure.
    pub time: Time,
}

/// One past attempt of a task.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AttemptRecord {
    /// Fencing token of the attempt's lease.
    pub token: i64,
    /// Worker that held the lease, if any claimed it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder: Option<String>,
    /// `Succeeded`, `Failed`, `Aborted`, `Interrupted`, `Expired` or `Released`.
    #[schemars(length(max = 64))]
    pub outcome: String,
    /// When the lease was issued.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<Time>,
    /// When the operator settled the attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end: Option<Time>,
    /// Short reason for the outcome.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 128))]
    pub reason: Option<String>,
    /// For a `Lost` attempt: the TTL its lease was issued with. Its holder
    /// may run until its kill switch, within this TTL of the loss; a
    /// cancelled task ends only after that.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub lease_duration_seconds: Option<i32>,
    /// For a `Lost` attempt: how its holder kept it alive (`Worker` when
    /// it may have been claimed so unseen). Renewed per worker, its holder
    /// may run a refresh period longer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub renewal: Option<crate::Renewal>,
}

/// Defaults shared by serde and the CRD schema (schemars reads them from the
/// serde attributes), so `kubectl apply` and Rust callers agree.
pub mod defaults {
    /// 30 seconds.
    pub fn lease_duration_seconds() -> i32 {
        30
    }
    /// Three retries after the first attempt.
    pub fn max_retries() -> i32 {
        3
    }
    /// Three aborts before a speculative task is quarantined.
    pub fn max_speculative_aborts() -> i32 {
        3
    }
    /// One second.
    pub fn backoff_initial_seconds() -> i64 {
        1
    }
    /// Five minutes.
    pub fn backoff_max_seconds() -> i64 {
        300
    }
    /// Doubling.
    pub fn backoff_multiplier() -> i64 {
        2
    }
}

impl BatchTaskSpec {
    /// A spec with every default applied, for the given queue.
    pub fn for_queue(queue: impl Into<String>) -> Self {
        Self {
            queue: queue.into(),
            payload: None,
            lease_duration_seconds: defaults::lease_duration_seconds(),
            max_retries: defaults::max_retries(),
            backoff: BackoffSpec::default(),
            retry_policy: RetryPolicy::default(),
            active_deadline_seconds: None,
            ttl_seconds_after_finished: None,
            depends_on: Vec::new(),
            resources: Vec::new(),
            mode: TaskMode::default(),
            max_speculative_aborts: defaults::max_speculative_aborts(),
            redrive: 0,
            cancel: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_last_failure_written_before_the_rename_is_read_and_written_as_token() {
        let old = serde_json::json!({
            "reason": "HandlerFailed", "message": "boom", "attempt": 3,
            "time": "2026-12-01T00:00:00Z"
        });
        let f: Failure = serde_json::from_value(old).unwrap();
        assert_eq!(f.token, 3);
        let back = serde_json::to_value(&f).unwrap();
        assert_eq!(back["token"], 3);
        assert!(back.get("attempt").is_none(), "{back}");
    }
}
