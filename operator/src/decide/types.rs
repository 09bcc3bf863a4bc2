//! The decision's vocabulary: what [`super::decide`] reads ([`Input`]) and
//! what it answers ([`Decision`], and the [`Transition`] a status write
//! means). Kept apart from the dispatcher in `decide/mod.rs` so that the
//! concern files, `settle.rs` and the model can name these types without
//! importing the module that calls them: `settle.rs` takes
//! [`ExpiryReason`] and [`Transition`] from here (they were `decide.rs`'s
//! and `settle.rs`'s, which imported each other), and nothing here
//! imports `settle.rs` or a concern file, so there is no import circle.

use std::sync::Arc;
use std::time::Duration;

use batchlease_api::keys::release_reason;
use batchlease_api::{BatchTask, BatchTaskStatus, TaskLease};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use tokio::time::Instant;

use crate::deps::Readiness;
use crate::locks::Slot;
use crate::observe::Observation;

/// Leases kept per task besides the current one; older ones are pruned.
pub const KEEP_LEASES: usize = 3;

/// How long to wait for the watch to show a lease this process just created.
pub const CREATE_SETTLE: Duration = Duration::from_secs(1);

/// Everything the decision depends on.
#[derive(Debug)]
pub struct Input<'a> {
    pub task: &'a BatchTask,
    /// The task's leases, in any order.
    pub leases: &'a [Arc<TaskLease>],
    /// What was observed of the current lease, if it is held.
    pub observation: Option<Observation>,
    /// Monotonic now, for expiry.
    pub now: Instant,
    /// Wall-clock now, for timestamps and backoff deadlines in status.
    pub wall: Timestamp,
    /// A uniform sample in [0, 1) for backoff jitter.
    pub jitter: f64,
    /// What the reconciler knows of the current lease beyond the cache.
    pub lookup: Lookup,
    /// Whether the task's dependencies let it run ([`crate::deps::assess`];
    /// `Ready` for a task without any).
    pub deps: Readiness,
    /// The locks decide asked for with [`Decision::FetchLocks`], read
    /// directly from the API server; `None` until then.
    pub locks: Option<Vec<Slot>>,
    /// How long a claim must have been observed before `Running` is
    /// written (`--running-status-delay`). The write is informational —
    /// fencing, expiry and settling read the lease — so an attempt that
    /// completes sooner settles straight from `Ready`, one write fewer.
    pub running_after: Duration,
    /// For a finished task: an unfinished task that still needs it (a
    /// dependent, or a child it spawned), which keeps it past its
    /// `ttlSecondsAfterFinished` ([`crate::graph_index`]).
    pub needed_by: Option<String>,
    /// What the task's queue allows now ([`crate::queues`]): checked
    /// before a lease is issued, and a paused queue's offers nobody
    /// claimed yet are withdrawn.
    pub queue: QueueGate,
    /// The current lease's address while it is an offer addressed to a
    /// worker (`spec.offeredTo`, [`crate::offers`]); `None` otherwise.
    pub offer: Option<OfferView>,
    /// Whether a new offer may be claimed to be renewed per worker
    /// (`spec.renewal: Lease`). False while the operator cannot watch
    /// WorkerLeases (`WorkerTracker::degraded`: its first list never came —
    /// the CRD not installed, list/watch not granted): it could credit no
    /// renewal through one, and an attempt renewed so would never expire.
    pub per_worker_offers: bool,
}

/// What the operator knows of an addressed offer: since when (its monotonic
/// clock) it has been addressed to its current worker, and until when that
/// worker counts as live — its last observed WorkerLease renewal plus the
/// renewal's duration (`None`: not live, or never seen).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OfferView {
    pub since: Instant,
    pub addressee_live_until: Option<Instant>,
}

/// What a queue allows at this moment: its `TaskQueue`, and its workers'
/// free slots when every worker of it takes bound attempts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum QueueGate {
    /// Issue (no TaskQueue, or one with room and a rate token).
    #[default]
    Open,
    /// `spec.paused`: no issue; unclaimed offers are withdrawn. The task is
    /// woken when the queue changes.
    Paused,
    /// `spec.maxConcurrent` leases are Offered or Held: the task is woken
    /// when one ends.
    Full,
    /// `spec.maxIssuesPerSecond` spent: look again after this long.
    Throttled(Duration),
    /// Every live worker of the queue takes bound attempts and none has a
    /// free slot for this task, or none is live but one that takes them
    /// went silent lately (`offers::awaited`; `queue_gate::worker_slots`):
    /// the task is woken when a lease of the queue ends or a worker renews
    /// with room, and its offer is then created bound to that worker.
    WorkerSlots,
}

impl QueueGate {
    /// How long a held-back task waits before it looks again unwoken.
    pub fn wait(self) -> Option<Duration> {
        match self {
            Self::Open => Some(Duration::ZERO),
            // Woken when the queue is resumed (a TaskQueue change).
            Self::Paused => None,
            Self::Full | Self::WorkerSlots => Some(QUEUE_RECHECK),
            Self::Throttled(after) => Some(after),
        }
    }
}

/// How long a task held back by a full queue waits at most for a wake-up
/// (the queue wakes its waiters as leases end; this covers a wake-up that
/// went to a task that no longer needed it).
pub const QUEUE_RECHECK: Duration = Duration::from_secs(30);

/// How often a finished task kept past its TTL looks again whether it is
/// still needed.
pub const TTL_RECHECK: Duration = Duration::from_secs(10);

/// What is known of a current lease the cache does not show.
///
/// A lease missing from the cache is usually one the watch has not
/// delivered yet (it lags the status write that named it); rarely it is
/// really gone (a crash between the two writes of an issue, a deleted
/// lease, a forged one in its place). Only "gone" may lead to a new lease,
/// and then always under a new token: the old token may already have been
/// claimed by a worker that is still running (design §3.1).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Lookup {
    /// Nothing beyond the cache.
    #[default]
    CacheOnly,
    /// This process created the lease moments ago; the watch will bring it.
    Creating,
    /// A direct read found nothing under the current lease's name.
    Absent,
    /// A direct read found an object under that name that is not the
    /// task's lease (forged, or of another incarnation).
    Occupied,
}

/// Why a held lease is taken away.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpiryReason {
    /// No renewal observed for the lease duration.
    LeaseExpired,
    /// The attempt ran longer than `activeDeadlineSeconds`.
    ActiveDeadlineExceeded,
    /// A live lease of the task that is not its current lease (a stray a
    /// late create left, or an object claiming the task as its owner).
    NotCurrentLease,
    /// A bound attempt (created held by its worker) that no renewal of
    /// that worker was seen to name before it expired: the worker never
    /// took it (it died, or lost it), and the task did nothing wrong — it
    /// runs again at once, as after an `Interrupted` attempt.
    BoundNotTaken,
}

impl ExpiryReason {
    /// The CamelCase reason written to the lease and the task's history.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::LeaseExpired => "LeaseExpired",
            Self::ActiveDeadlineExceeded => "ActiveDeadlineExceeded",
            Self::NotCurrentLease => "NotCurrentLease",
            Self::BoundNotTaken => batchlease_api::BOUND_NOT_TAKEN,
        }
    }
}

/// The next write.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Write the task's status (conditional on its resourceVersion).
    WriteStatus {
        status: Box<BatchTaskStatus>,
        transition: Transition,
    },
    /// Issue a lease: write the status (token + 1, `Ready`), then create the
    /// lease `Offered`.
    Issue {
        status: Box<BatchTaskStatus>,
        lease: Box<TaskLease>,
        cause: IssueCause,
    },
    /// The cache does not show the current lease: read it directly, then
    /// decide again with the answer in [`Input::lookup`] (or the lease).
    LookUpLease(String),
    /// The current lease's name is free: occupy it with this final
    /// (`Released`, `TokenRetired`) lease before issuing the next token, so
    /// a create of the old token that is still on its way (from a crashed
    /// or deposed operator) fails with AlreadyExists instead of becoming a
    /// second live lease. AlreadyExists here means "re-read".
    RetireToken(Box<TaskLease>),
    /// Take the held lease away (conditional on the lease's resourceVersion;
    /// a conflict means a renewal just landed).
    Expire {
        lease: Box<TaskLease>,
        reason: ExpiryReason,
    },
    /// Delete these old, final leases (name, resourceVersion), then look
    /// again after `then` (the timer the pass would otherwise have set: an
    /// expiry or a backoff must not be lost to housekeeping).
    Prune {
        victims: Vec<(String, Option<String>)>,
        then: Option<Duration>,
    },
    /// Read the lock Leases of these resources directly, then decide again
    /// with them in [`Input::locks`].
    FetchLocks(Vec<String>),
    /// Take one lock: create the Lease, or replace it (CAS on its
    /// resourceVersion).
    TakeLock(Box<Lease>),
    /// Give back these locks, in this order (a CAS each), then decide again.
    ReleaseLocks {
        leases: Vec<Lease>,
        why: LockRelease,
    },
    /// A resource is held by someone else (or an older task waits for it):
    /// give back `give_back` (reverse order; a CAS each) and wait to be
    /// woken.
    LockBlocked {
        give_back: Vec<Lease>,
        resource: String,
        holder: String,
    },
    /// The task finished `ttlSecondsAfterFinished` ago: delete it (its
    /// leases go with it by garbage collection), on the condition that it
    /// is still this object at this resourceVersion (a redrive or an edit
    /// in between wins).
    DeleteTask {
        uid: String,
        resource_version: Option<String>,
    },
    /// End an Offered or Held lease by releasing it (conditional on the
    /// lease's resourceVersion: a claim or a renewal that lands first wins,
    /// and the next pass decides on the lease as it then is).
    Release {
        lease: Box<TaskLease>,
        why: ReleaseWhy,
    },
    /// Address the offer to another worker, or drop its address, by a CAS
    /// on the still-unclaimed lease (a claim that lands first wins):
    /// its worker lapsed (`lapsed`), or left it unclaimed for a TTL
    /// (moved only to a worker with a free slot now).
    Readdress { lease: Box<TaskLease>, lapsed: bool },
    /// The queue holds the issue back (its TaskQueue is paused, full or
    /// out of rate tokens): wait to be woken, or as [`QueueGate::wait`]
    /// says.
    HeldBack(QueueGate),
    /// Nothing to write. Look again after this long, or on the next change.
    Wait(Option<Duration>),
}

/// Why the operator releases a lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReleaseWhy {
    /// `spec.cancel` (an Offered or a Held lease).
    Cancelled,
    /// The queue is paused (an Offered lease only: held ones run on).
    QueuePaused,
}

impl ReleaseWhy {
    /// The reason written to the lease.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Cancelled => release_reason::CANCELLED,
            Self::QueuePaused => release_reason::QUEUE_PAUSED,
        }
    }
}

/// Why locks are given back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LockRelease {
    /// The attempt that held them ended; `expired`: its lease expired
    /// before the worker completed it.
    AttemptEnded { expired: bool },
    /// The task may not run now (a dependency is missing or failed): it
    /// must not keep others waiting.
    NotRunnable,
}

/// How long a task blocked on a lock waits at most before looking again.
/// It is woken when the lock is released (see `graph_index`); this only
/// covers wake-ups nobody sends (an older waiter that stopped waiting
/// without a phase change).
pub const LOCK_RECHECK: Duration = Duration::from_secs(10);

/// Why a lease is issued.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IssueCause {
    /// A first attempt, or a retry after a failure or an interruption.
    New,
    /// The previous holder's lease expired.
    Reassigned,
    /// The current lease vanished (or was never created); its token is
    /// retired, never reused.
    Replaced,
}

/// What a status write means, for Events, metrics and logs. `settle`
/// computes most of them; they live here, beside the [`Decision`] they
/// label, so that `settle` needs no decision code.
#[derive(Debug, Clone, PartialEq)]
pub enum Transition {
    /// First status of a new task.
    Initialized,
    /// A worker claimed the offered lease.
    Claimed { holder: String },
    /// The task succeeded.
    Succeeded,
    /// The attempt failed or expired; retried after `delay_seconds`.
    Retry {
        reason: String,
        expired: bool,
        delay_seconds: f64,
    },
    /// The worker was drained (or gave the lease back); retried without
    /// spending a retry: at once, or after `delay_seconds` when it keeps
    /// happening.
    Interrupted { delay_seconds: f64 },
    /// A speculative commit lost its compare-and-swap.
    Aborted { quarantined: bool },
    /// The retry budget is spent, or the failure was permanent.
    DeadLettered { reason: String, expired: bool },
    /// A dead-lettered task was redriven.
    Redriven,
    /// `spec.redrive` was raised on a task that is not dead-lettered.
    RedriveIgnored,
    /// The task is on a dependency cycle and was rejected.
    CycleDetected { cycle: String },
    /// A dependency is missing or unfinished (condition updated).
    WaitingForDependencies,
    /// A dependency is dead-lettered or rejected (condition updated).
    DependencyFailed,
    /// `spec.cancel` was set; `holder`: the attempt that was running.
    Cancelled { holder: Option<String> },
    /// The queue was paused: the offer nobody claimed was withdrawn and
    /// the task waits, no retry spent.
    Withdrawn,
    /// A cancelled task's current lease went missing: it ends a TTL later,
    /// once the lease's holder (if any) has surely stopped.
    CancelAwaitsLostHolder,
}
