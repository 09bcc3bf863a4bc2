//! `TaskLease`: one object per attempt of a `BatchTask`.
//!
//! Like `coordination.k8s.io/v1` Lease it has no status subresource: spec and
//! status are written together, so every transition (offer, claim, renew,
//! complete, expire, release) is one conditional write of the whole object.
//! The CEL rules below keep the invariants even against a writer that skips
//! the `resourceVersion` precondition.

use std::collections::BTreeMap;

use crate::json::JsonObject;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The lease of one attempt: who holds it, under which fencing token.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "batchlease.dev",
    version = "v1alpha1",
    kind = "TaskLease",
    namespaced,
    // `status` here only adds the field to the root type; `crate::crds()`
    // strips the status subresource kube-derive adds with it (design §2).
    status = "TaskLeaseStatus",
    shortname = "tl",
    category = "batchlease",
    derive = "PartialEq",
    doc = "The lease of one attempt of a BatchTask. Created Offered by the operator, claimed and renewed by one worker.",
    printcolumn(name = "Task", type_ = "string", json_path = ".spec.taskName"),
    printcolumn(name = "Holder", type_ = "string", json_path = ".spec.holderIdentity"),
    printcolumn(name = "Token", type_ = "integer", json_path = ".spec.fencingToken"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    // The holder's clock, shown as written: as a `date` column, a renewal
    // from a worker whose clock runs ahead printed `<invalid>`. Expiry never
    // reads it (the operator times renewals by when it observes them).
    printcolumn(name = "Renewed", type_ = "string", json_path = ".spec.renewTime"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    selectable = ".spec.queue",
    selectable = ".spec.taskName",
    selectable = ".status.phase",
    validation = Rule::new(
        "!has(oldSelf.status) || !has(oldSelf.status.phase) || !(oldSelf.status.phase in ['Completed', 'Expired', 'Released']) || (has(self.status) && self.status == oldSelf.status && self.spec == oldSelf.spec)"
    )
    .message("a Completed, Expired or Released lease is final: neither its status (phase, outcome, result, checkpoint) nor its spec may change")
    .field_path(".status.phase")
    .reason(Reason::FieldValueForbidden),
    validation = Rule::new(
        "!has(oldSelf.status) || !has(oldSelf.status.phase) || oldSelf.status.phase != 'Held' || !has(self.status) || !has(self.status.phase) || self.status.phase != 'Offered'"
    )
    .message("a Held lease cannot be offered again")
    .field_path(".status.phase")
    .reason(Reason::FieldValueForbidden),
    // Only a holder completes, and only what it holds: without this an
    // Offered lease could be set Completed directly by anyone allowed to
    // write leases, with no claim ever visible. Who may claim is narrowed
    // further by admission (the install issue), not by CEL.
    validation = Rule::new(
        "!has(self.status) || !has(self.status.phase) || self.status.phase != 'Completed' || (has(oldSelf.status) && has(oldSelf.status.phase) && oldSelf.status.phase in ['Held', 'Completed'])"
    )
    .message("a lease may become Completed only from Held")
    .field_path(".status.phase")
    .reason(Reason::FieldValueForbidden),
    // A phase once set stays set: a lease without one is neither offered
    // nor held, and would wedge its task.
    validation = Rule::new(
        "!has(oldSelf.status) || !has(oldSelf.status.phase) || (has(self.status) && has(self.status.phase))"
    )
    .message("status.phase may not be removed once set")
    .field_path(".status.phase")
    .reason(Reason::FieldValueRequired),
    validation = Rule::new(
        "!has(self.status) || !has(self.status.phase) || !(self.status.phase in ['Held', 'Completed']) || (has(self.spec.holderIdentity) && self.spec.holderIdentity != '')"
    )
    .message("a Held or Completed lease must name its holder in spec.holderIdentity")
    .field_path(".spec.holderIdentity")
    .reason(Reason::FieldValueRequired),
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new(
    "has(self.resourceTokens) == has(oldSelf.resourceTokens) && (!has(self.resourceTokens) || self.resourceTokens == oldSelf.resourceTokens)"
)
.message("resourceTokens are immutable: they are the resource locks' fencing tokens of this attempt")
.field_path(".resourceTokens")
.reason(Reason::FieldValueForbidden))]
#[x_kube(validation = Rule::new(
    "has(oldSelf.renewal) ? (has(self.renewal) && (self.renewal == oldSelf.renewal || (oldSelf.renewal == 'Lease' && self.renewal == 'Worker' && (!has(oldSelf.holderIdentity) || oldSelf.holderIdentity == '') && has(self.holderIdentity) && self.holderIdentity != ''))) : !has(self.renewal)"
)
.message("renewal is set by the operator when it offers the lease and may change only from Lease to Worker, by the claim")
.field_path(".renewal")
.reason(Reason::FieldValueForbidden))]
#[x_kube(validation = Rule::new(
    "!has(oldSelf.holderIdentity) || oldSelf.holderIdentity == '' || (has(self.holderIdentity) && self.holderIdentity == oldSelf.holderIdentity)"
)
.message("holderIdentity may be set once and never changed")
.field_path(".holderIdentity")
.reason(Reason::FieldValueForbidden))]
// Addressed offers: only the addressee claims (the address before the
// claim is what counts), and from the claim on the address may only be
// dropped — never set or changed — so a re-address (a CAS on the still
// unclaimed offer) and a claim cannot both land, while an operator without
// the field (a rollback), whose typed writes drop it, can still expire or
// release the lease.
#[x_kube(validation = Rule::new(
    "!has(oldSelf.offeredTo) || (has(oldSelf.holderIdentity) && oldSelf.holderIdentity != '') || !has(self.holderIdentity) || self.holderIdentity == '' || self.holderIdentity == oldSelf.offeredTo"
)
.message("an offer addressed to a worker (offeredTo) may be claimed only by that worker")
.field_path(".holderIdentity")
.reason(Reason::FieldValueForbidden))]
#[x_kube(validation = Rule::new(
    "!has(self.holderIdentity) || self.holderIdentity == '' || !has(self.offeredTo) || (has(oldSelf.offeredTo) && self.offeredTo == oldSelf.offeredTo)"
)
.message("offeredTo may change only while the lease is unclaimed: from the claim on it may only be removed")
.field_path(".offeredTo")
.reason(Reason::FieldValueForbidden))]
#[x_kube(validation = Rule::new(
    "!has(self.boundAt) || (has(oldSelf.boundAt) && self.boundAt == oldSelf.boundAt)"
)
.message("boundAt is written only by the operator's create of a bound attempt: it may be removed, never added or changed")
.field_path(".boundAt")
.reason(Reason::FieldValueForbidden))]
pub struct TaskLeaseSpec {
    /// Name of the BatchTask this lease belongs to. Immutable.
    #[schemars(length(min = 1, max = 253))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("taskName is immutable"))]
    pub task_name: String,
    /// UID of that BatchTask, so a lease never outlives a re-created task of
    /// the same name.
    #[serde(rename = "taskUID")]
    #[schemars(length(max = 128))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("taskUID is immutable"))]
    pub task_uid: String,
    /// Queue of the task, copied so workers can list leases by queue.
    #[schemars(length(min = 1, max = 63))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("queue is immutable"))]
    pub queue: String,
    /// The fencing token of this attempt; every write the holder makes to
    /// storage carries it. Immutable.
    #[schemars(range(min = 1))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("fencingToken is immutable"))]
    pub fencing_token: i64,
    /// Lease TTL in seconds, fixed when the lease is offered. Immutable.
    #[x_kube(
        validation = Rule::new("self == oldSelf").message("leaseDurationSeconds is immutable"),
        validation = Rule::new("self >= 5 && self <= 3600").message("leaseDurationSeconds must be between 5 and 3600"),
    )]
    pub lease_duration_seconds: i32,
    /// The worker holding the lease; empty while offered. Set once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub holder_identity: Option<String>,
    /// When the holder claimed the lease (holder's clock, informational).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acquire_time: Option<MicroTime>,
    /// When the holder last renewed (holder's clock, informational: the
    /// operator times expiry by when it *observed* a renewal).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub renew_time: Option<MicroTime>,
    /// Fencing token of each resource lock taken for this attempt.
    /// Immutable: a holder raising one would fence the resource for good.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub resource_tokens: BTreeMap<String, i64>,
    /// How the holder keeps the lease alive. The operator offers `Lease`
    /// when it honours WorkerLeases; a claim may turn it into `Worker`
    /// (renewed through the holder's WorkerLease). Unset: an operator
    /// without WorkerLeases offered it, renewed per lease. Never removed,
    /// so an older operator (a rollback) cannot rewrite the lease as one
    /// renewed per lease and expire it behind a WorkerLease's back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub renewal: Option<Renewal>,
    /// The worker (holder identity) this offer is addressed to; only it may
    /// claim it. Set, and changed while unclaimed, by the operator alone;
    /// the lease then carries the label `batchlease.dev/worker` = that
    /// worker's WorkerLease name, which is what the worker watches. Unset:
    /// any worker of the queue may claim it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub offered_to: Option<String>,
    /// Set when the operator created the lease already `Held` by the
    /// worker it is addressed to — a bound attempt, with no claim write:
    /// the `spec.renewTime` of that worker's WorkerLease the operator had
    /// observed before the create. The worker starts the attempt only when
    /// that renewal is one it sent, its kill clock counted from when it
    /// sent it (the operator's clock for the attempt starts later, at its
    /// first sight of the lease). Written by the create alone; may be
    /// removed (an older operator's typed writes drop it), never added or
    /// changed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bound_at: Option<MicroTime>,
}

/// How a held lease is kept alive.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Renewal {
    /// By writes of its own `spec.renewTime` every TTL/3.
    Lease,
    /// By the renewals of its holder's WorkerLease, which lists it.
    Worker,
}

/// The `status.reason` of a bound attempt its worker gave back unstarted
/// because it could not confirm it: the renewal it cites was not sent by
/// this process of the worker (another one, since restarted), went to a
/// WorkerLease since lost, or no renewal naming it was answered in time.
/// The operator binds nothing more to that worker citing the same renewal.
pub const BOUND_UNCONFIRMED: &str = "BoundUnconfirmed";

/// The `status.reason` of a bound attempt the operator expired because no
/// renewal of its worker named it: the worker never took it.
pub const BOUND_NOT_TAKEN: &str = "BoundNotTaken";

/// The `status.reason` of a bound attempt its worker gave back unstarted
/// because no slot came free within a TTL of its first sight.
pub const BOUND_NO_SLOT: &str = "BoundNoSlot";

/// The `status.reason` of a bound attempt its worker gave back unstarted
/// because it is draining.
pub const BOUND_WHILE_DRAINING: &str = "WorkerDraining";

impl TaskLease {
    /// Whether the lease was claimed to be renewed through its holder's
    /// WorkerLease.
    pub fn renewed_per_worker(&self) -> bool {
        self.spec.renewal == Some(Renewal::Worker)
    }

    /// Whether the operator created it already held (no claim): see
    /// `TaskLeaseSpec::bound_at`.
    pub fn bound(&self) -> bool {
        self.spec.bound_at.is_some()
    }
}

impl TaskLeaseSpec {
    /// The spec of a lease as offered: no holder, no times, no locks yet.
    pub fn offered(
        task_name: impl Into<String>,
        task_uid: impl Into<String>,
        queue: impl Into<String>,
        fencing_token: i64,
        lease_duration_seconds: i32,
    ) -> Self {
        Self {
            task_name: task_name.into(),
            task_uid: task_uid.into(),
            queue: queue.into(),
            fencing_token,
            lease_duration_seconds,
            holder_identity: None,
            acquire_time: None,
            renew_time: None,
            resource_tokens: BTreeMap::new(),
            renewal: None,
            offered_to: None,
            bound_at: None,
        }
    }
}

/// Lifecycle of a lease. Completed, Expired and Released are final.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LeasePhase {
    /// Created by the operator, waiting for a worker of the queue.
    Offered,
    /// Claimed by `holderIdentity`, kept alive by renewals.
    Held,
    /// The holder finished the attempt; see `status.outcome`.
    Completed,
    /// Renewals stopped; the task is handed to someone else.
    Expired,
    /// Ended by the operator without a holder's outcome (e.g. task deleted
    /// or redriven).
    Released,
}

impl LeasePhase {
    /// A final lease never changes again (enforced by CEL).
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Completed | Self::Expired | Self::Released)
    }
}

/// How a holder ended an attempt.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LeaseOutcome {
    /// The work is committed.
    Succeeded,
    /// The work failed; the task is retried within its budget, or
    /// dead-lettered at once when `status.permanent` is set.
    Failed,
    /// A speculative commit lost its compare-and-swap; retried without
    /// spending the retry budget.
    Aborted,
    /// The worker was drained (SIGTERM); retried at once without spending
    /// the retry budget.
    Interrupted,
}

/// Where a lease is in its lifecycle and how it ended.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TaskLeaseStatus {
    /// Lifecycle phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<LeasePhase>,
    /// Set with phase Completed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<LeaseOutcome>,
    /// Short CamelCase reason of the outcome, e.g. `HandlerFailed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 128))]
    pub reason: Option<String>,
    /// With outcome Failed: a retry cannot help, dead-letter the task now.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub permanent: bool,
    /// Human-readable detail of the outcome.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 4096))]
    pub message: Option<String>,
    /// Small result reported with a successful completion.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<JsonObject>,
    /// Latest progress recorded by the holder, sent with renewals.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<JsonObject>,
}
