//! The operator's whole decision, as one pure function: given a task, its
//! leases, what was observed of the current lease and the time, what is the
//! next write? The reconciler reads, calls [`decide`], performs the one write
//! and lets the watch bring the next state (design §3).
//!
//! One write per pass keeps every step idempotent and crash-safe: whatever
//! the process dies between, the next pass sees the state the API server
//! holds and continues from there.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use batchlease_api::{
    AttemptRecord, BatchTask, BatchTaskStatus, LeasePhase, TaskLease, TaskLeaseStatus, TaskMode,
    TaskPhase, check_current, names,
};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::ResourceExt;
use tokio::time::Instant;

use crate::deps::Readiness;
use crate::lease_build::offered_lease;
use crate::locks::{self, Slot, Step};
use crate::observe::Observation;
use crate::settle::{Transition, settle};
use crate::status::{self, set_condition};
use batchlease_api::LeaseOutcome;
use batchlease_api::keys::{condition, release_reason};

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
}

/// What a queue's `TaskQueue` allows at this moment.
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
}

impl QueueGate {
    /// How long a held-back task waits before it looks again unwoken.
    pub fn wait(self) -> Option<Duration> {
        match self {
            Self::Open => Some(Duration::ZERO),
            // Woken when the queue is resumed (a TaskQueue change).
            Self::Paused => None,
            Self::Full => Some(QUEUE_RECHECK),
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
}

impl ExpiryReason {
    /// The CamelCase reason written to the lease and the task's history.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::LeaseExpired => "LeaseExpired",
            Self::ActiveDeadlineExceeded => "ActiveDeadlineExceeded",
            Self::NotCurrentLease => "NotCurrentLease",
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

/// The pure core of the operator.
pub fn decide(input: &Input<'_>) -> Decision {
    let task = input.task;
    if task.metadata.deletion_timestamp.is_some() {
        // Garbage collection removes the leases; a holder's next renewal
        // finds its lease gone and fires its kill switch.
        return Decision::Wait(None);
    }
    let Some(current) = task.status.as_ref().filter(|s| s.phase.is_some()) else {
        return first_status(input);
    };
    if task.spec.redrive > current.observed_redrive {
        return redrive(task, current, input.wall);
    }
    let phase = current.phase.unwrap_or(TaskPhase::Pending);
    // Only a lease that passes every check is the current one; a forged or
    // stale object of the same name is as good as no lease.
    let lease = input.leases.iter().find(|l| check_current(task, l).is_ok());

    let decision = match phase {
        TaskPhase::Pending => pending(input, current),
        TaskPhase::Ready | TaskPhase::Running => match (lease, input.lookup) {
            (Some(lease), _) => leased(input, current, phase, lease),
            (None, Lookup::CacheOnly) => match &current.current_lease {
                Some(name) => Decision::LookUpLease(name.clone()),
                None => replace_lost(input, current, phase),
            },
            (None, Lookup::Creating) => Decision::Wait(Some(CREATE_SETTLE)),
            (None, Lookup::Absent) => {
                Decision::RetireToken(Box::new(tombstone(task, current.fencing_token)))
            }
            (None, Lookup::Occupied) => replace_lost(input, current, phase),
        },
        TaskPhase::Succeeded
        | TaskPhase::DeadLettered
        | TaskPhase::Rejected
        | TaskPhase::Cancelled => finished(task, current, input.wall, input.needed_by.as_deref()),
    };
    match decision {
        Decision::Wait(after) => {
            if let Some(stray) = stray(task, input.leases) {
                return stray;
            }
            match prunable(input.leases, current.current_lease.as_deref()) {
                victims if !victims.is_empty() => Decision::Prune {
                    victims,
                    then: after,
                },
                _ => Decision::Wait(after),
            }
        }
        Decision::HeldBack(gate) => stray(task, input.leases).unwrap_or(Decision::HeldBack(gate)),
        // No live lease may outlast the task's end (cheap to check, and the
        // model's "no lease of a Cancelled task is live").
        Decision::WriteStatus {
            transition: Transition::Cancelled { .. },
            ..
        } if stray(task, input.leases).is_some() => {
            stray(task, input.leases).unwrap_or(Decision::Wait(None))
        }
        other => other,
    }
}

/// A finished task: kept, or deleted once `ttlSecondsAfterFinished` has
/// passed since `status.completionTime` — unless an unfinished task still
/// needs it: a dependent (it would wait for a dependency gone missing) or
/// a child it spawned (garbage collection would delete it too). A task
/// finished by an operator that did not record that time counts from its
/// conditions' latest transition, else from its creation.
fn finished(
    task: &BatchTask,
    current: &BatchTaskStatus,
    wall: Timestamp,
    needed_by: Option<&str>,
) -> Decision {
    let Some(ttl) = task.spec.ttl_seconds_after_finished else {
        return Decision::Wait(None);
    };
    let done = current
        .completion_time
        .as_ref()
        .map(|t| t.0)
        .or_else(|| {
            current
                .conditions
                .iter()
                .map(|c| c.last_transition_time.0)
                .max()
        })
        .or_else(|| task.metadata.creation_timestamp.as_ref().map(|t| t.0))
        .unwrap_or(wall);
    let left = SignedDuration::from_secs(ttl.max(0)) - wall.duration_since(done);
    if left.is_positive() {
        // Whole seconds up: a deletion must not come early.
        let secs = u64::try_from(left.as_secs()).unwrap_or(0) + u64::from(left.subsec_nanos() > 0);
        return Decision::Wait(Some(Duration::from_secs(secs)));
    }
    if needed_by.is_some() {
        return Decision::Wait(Some(TTL_RECHECK));
    }
    match task.metadata.uid.clone() {
        Some(uid) => Decision::DeleteTask {
            uid,
            resource_version: task.metadata.resource_version.clone(),
        },
        None => Decision::Wait(None),
    }
}

/// The final lease that retires `token`'s name (see [`Decision::RetireToken`]).
fn tombstone(task: &BatchTask, token: i64) -> TaskLease {
    let mut l = offered_lease(task, token);
    l.status = Some(TaskLeaseStatus {
        phase: Some(LeasePhase::Released),
        reason: Some(TOKEN_RETIRED.into()),
        message: Some("the lease of this token was missing; the token is retired".into()),
        ..Default::default()
    });
    l
}

/// Reason of a [`tombstone`].
pub const TOKEN_RETIRED: &str = "TokenRetired";

/// A live (Offered or Held) lease controlled by the task, of an *older*
/// token than the task's, that is not its current lease: end it, so its
/// holder (if any) stops at its next renewal. A lease of a newer token means
/// the task cache lags the lease cache: never touch it.
fn stray(task: &BatchTask, leases: &[Arc<TaskLease>]) -> Option<Decision> {
    let uid = task.metadata.uid.as_deref()?;
    let token = task.status.as_ref().map_or(0, |s| s.fencing_token);
    let l = leases.iter().find(|l| {
        if l.spec.fencing_token >= token {
            return false;
        }
        let live = matches!(
            l.status.as_ref().and_then(|s| s.phase),
            Some(LeasePhase::Offered | LeasePhase::Held) | None
        );
        let ours = l
            .owner_references()
            .iter()
            .any(|o| o.uid == uid && o.controller == Some(true));
        live && ours && check_current(task, l).is_err()
    })?;
    let mut ended = (**l).clone();
    let st = ended.status.get_or_insert_with(Default::default);
    st.phase = Some(LeasePhase::Expired);
    st.reason = Some(ExpiryReason::NotCurrentLease.as_str().into());
    st.message = Some("not the task's current lease".into());
    Some(Decision::Expire {
        lease: Box::new(ended),
        reason: ExpiryReason::NotCurrentLease,
    })
}

/// The first decision of a new task. Its first status used to be a write
/// of its own (`Pending`), then the issue another; a task that needs no
/// lock goes straight to what `Pending` would decide — the issue, or the
/// dependency condition, or the rejection — with the first status folded
/// into that one write. A task that needs (or respects) locks is written
/// `Pending` first: only a `Pending` task counts as a waiter, which is what
/// keeps younger tasks from overtaking it (see `locks::waiting`).
fn first_status(input: &Input<'_>) -> Decision {
    let task = input.task;
    let init = initialize(task, input.wall);
    if !locks::needed(task).is_empty() || !locks::respected(task).is_empty() {
        return init;
    }
    let Decision::WriteStatus { status, .. } = &init else {
        return init;
    };
    match pending(input, status) {
        d @ (Decision::Issue { .. } | Decision::WriteStatus { .. }) => d,
        _ => init,
    }
}

fn initialize(task: &BatchTask, wall: Timestamp) -> Decision {
    let mut status = status::first(task, TaskPhase::Pending);
    set_condition(
        &mut status,
        task,
        wall,
        status::leased(false, "NotIssued", "no lease issued yet"),
    );
    Decision::WriteStatus {
        status: Box::new(status),
        transition: Transition::Initialized,
    }
}

fn redrive(task: &BatchTask, current: &BatchTaskStatus, wall: Timestamp) -> Decision {
    let mut status = current.clone();
    status.observed_redrive = task.spec.redrive;
    status.observed_generation = task.metadata.generation;
    if !matches!(
        current.phase,
        Some(TaskPhase::DeadLettered | TaskPhase::Rejected)
    ) {
        // Only a dead-lettered or rejected task is redriven (a rejected one
        // is checked again: its dependsOn may have been fixed); remember
        // the request as seen.
        return Decision::WriteStatus {
            status: Box::new(status),
            transition: Transition::RedriveIgnored,
        };
    }
    status.phase = Some(TaskPhase::Pending);
    status.completion_time = None;
    status.attempts = 0;
    status.aborts = 0;
    status.next_attempt_after = None;
    status.holder = None;
    status.effective_mode = Some(task.spec.mode);
    let (type_, was) = if current.phase == Some(TaskPhase::Rejected) {
        (
            condition::CYCLE_DETECTED,
            has_condition(current, condition::CYCLE_DETECTED),
        )
    } else {
        (condition::DEAD_LETTERED, true)
    };
    if was {
        set_condition(
            &mut status,
            task,
            wall,
            status::cond(type_, false, "Redriven", "spec.redrive was raised"),
        );
    }
    Decision::WriteStatus {
        status: Box::new(status),
        transition: Transition::Redriven,
    }
}

fn pending(input: &Input<'_>, current: &BatchTaskStatus) -> Decision {
    if input.task.spec.cancel {
        // A lost attempt of a cancelled task may still be running (see
        // `replace_lost`): the task ends when it cannot be any more.
        if let Some(wait) = lost_attempt_wait(input.task, current, input.wall) {
            return Decision::Wait(Some(wait));
        }
        return cancel_unleased(input, current.clone());
    }
    if let Some(after) = &current.next_attempt_after {
        let wait = after.0.duration_since(input.wall);
        if wait.is_positive() {
            return Decision::Wait(Some(
                Duration::try_from(wait).unwrap_or(Duration::from_secs(1)),
            ));
        }
    }
    let task = input.task;
    let mut status = current.clone();
    match &input.deps {
        Readiness::Ready => {}
        Readiness::Cycle(cycle) => return reject(input, current, cycle),
        not_ready => {
            // A task that may not run holds no locks (it would keep every
            // other user of its resources waiting for nothing).
            if let Some(d) = give_back_locks(input) {
                return d;
            }
            let failed = matches!(not_ready, Readiness::Failed { .. });
            let msg = not_ready.message();
            set_condition(
                &mut status,
                task,
                input.wall,
                status::waiting_for_dependencies(
                    !failed,
                    if failed {
                        "DependencyFailed"
                    } else {
                        "DependenciesNotSucceeded"
                    },
                    &msg,
                ),
            );
            if failed {
                set_condition(
                    &mut status,
                    task,
                    input.wall,
                    status::dependency_failed(true, "DependencyFailed", &msg),
                );
            } else if has_condition(&status, condition::DEPENDENCY_FAILED) {
                set_condition(
                    &mut status,
                    task,
                    input.wall,
                    status::dependency_failed(false, "DependencyRetrying", &msg),
                );
            }
            if status == *current {
                return Decision::Wait(None);
            }
            status.observed_generation = task.metadata.generation;
            return Decision::WriteStatus {
                status: Box::new(status),
                transition: if failed {
                    Transition::DependencyFailed
                } else {
                    Transition::WaitingForDependencies
                },
            };
        }
    }
    let reassigned = current
        .history
        .last()
        .is_some_and(|h| h.outcome == "Expired");
    let cause = if reassigned {
        IssueCause::Reassigned
    } else {
        IssueCause::New
    };
    for (type_, reason) in [
        (condition::WAITING_FOR_DEPENDENCIES, "DependenciesSucceeded"),
        (condition::DEPENDENCY_FAILED, "DependenciesSucceeded"),
    ] {
        if has_condition(&status, type_) {
            set_condition(
                &mut status,
                task,
                input.wall,
                status::cond(type_, false, reason, "every dependency succeeded"),
            );
        }
    }
    with_locks(input, status, cause, true)
}

fn has_condition(status: &BatchTaskStatus, type_: &str) -> bool {
    status.conditions.iter().any(|c| c.type_ == type_)
}

/// Reason of the history record of an attempt whose lease went missing
/// while a holder was known (the task was Running).
pub const LEASE_MISSING: &str = "LeaseMissing";

/// Reason of the history record of a token whose lease went missing while
/// no holder had been seen (the task was Ready). Its lease may have been
/// claimed a moment before (the Running write follows the claim) and then
/// deleted — so the record stays, and a cancel still waits for the TTL —
/// or it may never have existed: an operator stopped between the status
/// write that reserved the token and the lease's create leaves exactly
/// this. Nothing left in the API server tells the two apart (a deleted
/// object leaves no trace), so the reason names what is known, not a loss
/// that may not have happened.
pub const OFFER_MISSING: &str = "OfferMissing";

/// How long until every attempt whose lease went missing (recorded `Lost`
/// in the history, with the time the loss was seen) has surely stopped:
/// its holder, if it had one, runs at most until its kill switch, within a
/// TTL of the loss — the TTL its lease was issued with, recorded in the
/// entry: `spec.leaseDurationSeconds` may have been edited since (an entry
/// of an earlier release, without one, falls back to the spec's). `None`:
/// nothing to wait for.
///
/// A cancelled task must not end before then. Otherwise nothing fences
/// such a zombie out of storage: its successor — the attempt that would
/// register a higher token first — is the one the cancel withdrew.
fn lost_attempt_wait(
    task: &BatchTask,
    current: &BatchTaskStatus,
    wall: Timestamp,
) -> Option<Duration> {
    current
        .history
        .iter()
        .filter(|h| h.outcome == "Lost")
        .filter_map(|h| {
            let secs = h
                .lease_duration_seconds
                .unwrap_or(task.spec.lease_duration_seconds);
            Some((
                h.end.as_ref()?,
                SignedDuration::from_secs(i64::from(secs.max(1)) + 1),
            ))
        })
        .map(|(end, ttl)| end.0.checked_add(ttl).unwrap_or(end.0).duration_since(wall))
        .filter(|left| left.is_positive())
        .max()
        .map(|left| Duration::try_from(left).unwrap_or(Duration::from_secs(1)))
}

/// The step that gives back every lock the task holds, for a task that
/// will not run now (`NotRunnable`): read them first, then release what
/// is held. `None`: it holds none.
fn give_back_locks(input: &Input<'_>) -> Option<Decision> {
    let needed = locks::needed(input.task);
    if needed.is_empty() {
        return None;
    }
    let Some(slots) = &input.locks else {
        return Some(Decision::FetchLocks(needed));
    };
    let held = locks::release_any(slots);
    (!held.is_empty()).then_some(Decision::ReleaseLocks {
        leases: held,
        why: LockRelease::NotRunnable,
    })
}

/// Cancels a task without a live lease: it gives back the locks it may
/// hold (it will never run), then ends `Cancelled`.
fn cancel_unleased(input: &Input<'_>, status: BatchTaskStatus) -> Decision {
    let task = input.task;
    if let Some(d) = give_back_locks(input) {
        return d;
    }
    let (status, transition) = crate::settle::cancelled(task, &status, None, input.wall);
    Decision::WriteStatus {
        status: Box::new(status),
        transition,
    }
}

/// The task is on a dependency cycle: it can never run.
fn reject(
    input: &Input<'_>,
    current: &BatchTaskStatus,
    cycle: &batchlease_api::graph::Cycle,
) -> Decision {
    let task = input.task;
    let mut status = current.clone();
    status.phase = Some(TaskPhase::Rejected);
    status.completion_time = Some(Time(input.wall));
    status.observed_generation = task.metadata.generation;
    let shown = crate::deps::describe(cycle, task.metadata.name.as_deref());
    let msg = format!("dependency cycle: {shown}");
    set_condition(
        &mut status,
        task,
        input.wall,
        status::cycle_detected(true, "CycleDetected", &msg),
    );
    if has_condition(&status, condition::WAITING_FOR_DEPENDENCIES) {
        set_condition(
            &mut status,
            task,
            input.wall,
            status::waiting_for_dependencies(false, "Rejected", &msg),
        );
    }
    Decision::WriteStatus {
        status: Box::new(status),
        transition: Transition::CycleDetected { cycle: shown },
    }
}

/// Acquires the task's locks (if it needs any) for the next token, then
/// issues it. `fair`: queue behind older waiting tasks (not when a lost
/// lease is replaced: the task holds its locks already).
fn with_locks(
    input: &Input<'_>,
    status: BatchTaskStatus,
    cause: IssueCause,
    fair: bool,
) -> Decision {
    if input.queue != QueueGate::Open {
        // A task the queue holds back holds no locks: it would keep the
        // users of its resources in other queues waiting for nothing. Not
        // so a task whose lease went missing (`fair` false): the locks are
        // its lost attempt's, whose holder may still run.
        if fair && let Some(d) = give_back_locks(input) {
            return d;
        }
        return Decision::HeldBack(input.queue);
    }
    let task = input.task;
    let needed = locks::needed(task);
    if needed.is_empty() {
        let respected = locks::respected(task);
        if respected.is_empty() {
            return issue(input, status, cause, BTreeMap::new());
        }
        let Some(slots) = &input.locks else {
            return Decision::FetchLocks(respected);
        };
        return match locks::held_by_other(slots) {
            Some((resource, holder)) => Decision::LockBlocked {
                give_back: Vec::new(),
                resource,
                holder,
            },
            None => issue(input, status, cause, BTreeMap::new()),
        };
    }
    let Some(slots) = &input.locks else {
        return Decision::FetchLocks(needed);
    };
    let want = status.fencing_token + 1;
    match locks::acquire(task, want, slots, input.wall, fair) {
        Step::Take(lease) => Decision::TakeLock(lease),
        Step::Blocked {
            give_back,
            resource,
            holder,
        } => Decision::LockBlocked {
            give_back,
            resource,
            holder,
        },
        Step::Held(tokens) => issue(input, status, cause, tokens),
    }
}

/// The current lease is gone. Its token may have been claimed, so it is
/// retired: the next lease gets `token + 1`. An attempt that was running
/// (the status knew its holder) is recorded in the history; no retry is
/// spent, since the loss was not the worker's doing.
fn replace_lost(input: &Input<'_>, current: &BatchTaskStatus, phase: TaskPhase) -> Decision {
    let cancel = input.task.spec.cancel;
    let recorded = current
        .history
        .last()
        .is_some_and(|h| h.outcome == "Lost" && h.token == current.fencing_token);
    if cancel && recorded {
        // The loss is on record (below): end once its holder, if any, has
        // surely stopped.
        if let Some(wait) = lost_attempt_wait(input.task, current, input.wall) {
            return Decision::Wait(Some(wait));
        }
        return cancel_unleased(input, current.clone());
    }
    let mut status = current.clone();
    // A Ready task's lease may have been claimed too (the Running write
    // comes a moment after the claim): its loss is recorded as well.
    if matches!(phase, TaskPhase::Running | TaskPhase::Ready) {
        crate::status::push_history(
            &mut status,
            AttemptRecord {
                token: current.fencing_token,
                holder: current.holder.clone(),
                outcome: "Lost".into(),
                start: None,
                end: Some(Time(input.wall)),
                reason: Some(
                    if phase == TaskPhase::Running {
                        LEASE_MISSING
                    } else {
                        OFFER_MISSING
                    }
                    .into(),
                ),
                lease_duration_seconds: current.current_lease_duration_seconds,
            },
        );
    }
    if cancel {
        // The lost lease may have been claimed, and its holder may run
        // until its kill switch: with no successor whose token would fence
        // it out of storage, the task must not end (nor give back its
        // locks) before then. The loss and when it was seen go on record,
        // so a restart keeps the wait; the phase stays (Ready/Running), so
        // the locks taken for this token still count as held; the token is
        // retired already (the current lease's name is occupied), so
        // nothing can be claimed meanwhile.
        status.observed_generation = input.task.metadata.generation;
        set_condition(
            &mut status,
            input.task,
            input.wall,
            status::leased(
                false,
                LEASE_MISSING,
                "the current lease is missing; the task ends Cancelled once its holder, if any, has stopped",
            ),
        );
        return Decision::WriteStatus {
            status: Box::new(status),
            transition: Transition::CancelAwaitsLostHolder,
        };
    }
    with_locks(input, status, IssueCause::Replaced, false)
}

/// Token + 1, `Ready`, and the lease to offer under it, carrying the
/// fencing tokens of the resource locks taken for it.
fn issue(
    input: &Input<'_>,
    mut status: BatchTaskStatus,
    cause: IssueCause,
    resource_tokens: BTreeMap<String, i64>,
) -> Decision {
    let task = input.task;
    let token = status.fencing_token + 1;
    status.fencing_token = token;
    status.phase = Some(TaskPhase::Ready);
    status.current_lease = Some(names::lease_name(&task.name_any(), token));
    // The lease's own TTL, on record with its token: should the lease go
    // missing, its holder is timed by it, whatever the spec says by then.
    status.current_lease_duration_seconds = Some(task.spec.lease_duration_seconds);
    status.holder = None;
    status.next_attempt_after = None;
    status.observed_generation = task.metadata.generation;
    if status.effective_mode.is_none() {
        status.effective_mode = Some(TaskMode::Exclusive);
    }
    set_condition(
        &mut status,
        task,
        input.wall,
        status::leased(
            true,
            "Offered",
            &format!("lease with fencing token {token} offered"),
        ),
    );
    let mut lease = offered_lease(task, token);
    lease.spec.resource_tokens = resource_tokens;
    Decision::Issue {
        status: Box::new(status),
        lease: Box::new(lease),
        cause,
    }
}

fn leased(
    input: &Input<'_>,
    current: &BatchTaskStatus,
    phase: TaskPhase,
    lease: &TaskLease,
) -> Decision {
    let lease_phase = lease
        .status
        .as_ref()
        .and_then(|s| s.phase)
        .unwrap_or(LeasePhase::Offered);
    let retired = lease_phase == LeasePhase::Released
        && lease.status.as_ref().and_then(|s| s.reason.as_deref()) == Some(TOKEN_RETIRED);
    if retired {
        return replace_lost(input, current, phase);
    }
    let cancel = input.task.spec.cancel;
    match lease_phase {
        LeasePhase::Offered if cancel => release(lease, ReleaseWhy::Cancelled),
        LeasePhase::Offered if input.queue == QueueGate::Paused => {
            release(lease, ReleaseWhy::QueuePaused)
        }
        LeasePhase::Offered => Decision::Wait(None),
        LeasePhase::Held if cancel => release(lease, ReleaseWhy::Cancelled),
        LeasePhase::Held => held(input, current, phase, lease),
        LeasePhase::Completed | LeasePhase::Expired | LeasePhase::Released => {
            // A held lease the operator released (spec.cancel): its holder
            // learns at its next renewal, or stops by its kill switch at
            // the latest. Until a whole TTL has passed since its last
            // renewal was observed — the expiry rule — it may still be
            // running: its locks stay taken and the task does not end.
            if lease_phase == LeasePhase::Released && lease.spec.holder_identity.is_some() {
                let Some(obs) = input.observation else {
                    return Decision::Wait(Some(Duration::from_secs(1)));
                };
                let ttl = Duration::from_secs(
                    u64::try_from(lease.spec.lease_duration_seconds.max(1)).unwrap_or(1),
                );
                let left =
                    ttl.saturating_sub(input.now.saturating_duration_since(obs.last_renewal));
                if !left.is_zero() {
                    return Decision::Wait(Some(left));
                }
            }
            let succeeded = lease_phase == LeasePhase::Completed
                && lease.status.as_ref().and_then(|s| s.outcome) == Some(LeaseOutcome::Succeeded);
            if cancel
                && !succeeded
                && let Some(wait) = lost_attempt_wait(input.task, current, input.wall)
            {
                return Decision::Wait(Some(wait));
            }
            // The attempt's locks go back before the task settles, so the
            // phase change that wakes their waiters finds them free.
            if !lease.spec.resource_tokens.is_empty() {
                let Some(slots) = &input.locks else {
                    return Decision::FetchLocks(
                        lease.spec.resource_tokens.keys().cloned().collect(),
                    );
                };
                let held = locks::release_all(slots, lease.spec.fencing_token);
                if !held.is_empty() {
                    return Decision::ReleaseLocks {
                        leases: held,
                        why: LockRelease::AttemptEnded {
                            expired: lease_phase == LeasePhase::Expired,
                        },
                    };
                }
            }
            let reason = lease.status.as_ref().and_then(|s| s.reason.as_deref());
            let (status, transition) = if cancel && !succeeded {
                // Cancel wins over a retry; a success that landed first
                // stands (its result is committed).
                crate::settle::cancelled(input.task, current, Some(lease), input.wall)
            } else if lease_phase == LeasePhase::Released
                && reason == Some(release_reason::QUEUE_PAUSED)
            {
                crate::settle::withdrawn(input.task, current, input.wall)
            } else {
                settle(input.task, current, lease, input.wall, input.jitter)
            };
            Decision::WriteStatus {
                status: Box::new(status),
                transition,
            }
        }
    }
}

fn held(
    input: &Input<'_>,
    current: &BatchTaskStatus,
    phase: TaskPhase,
    lease: &TaskLease,
) -> Decision {
    let task = input.task;
    let holder = lease.spec.holder_identity.clone().unwrap_or_default();
    // The reconciler records an observation before deciding; without one
    // (it cannot happen) the safe answer is to start the clock now.
    let Some(obs) = input.observation else {
        return Decision::Wait(Some(Duration::from_secs(1)));
    };
    let ttl =
        Duration::from_secs(u64::try_from(lease.spec.lease_duration_seconds.max(1)).unwrap_or(1));
    let since_renewal = input.now.saturating_duration_since(obs.last_renewal);
    let mut wait = ttl.saturating_sub(since_renewal);
    let mut reason = ExpiryReason::LeaseExpired;
    if let Some(deadline) = task
        .spec
        .active_deadline_seconds
        .and_then(|d| u64::try_from(d).ok())
    {
        let left = Duration::from_secs(deadline)
            .saturating_sub(input.now.saturating_duration_since(obs.claimed_at));
        if left < wait {
            wait = left;
            reason = ExpiryReason::ActiveDeadlineExceeded;
        }
    }
    if !wait.is_zero()
        && (phase == TaskPhase::Ready || current.holder.as_deref() != Some(holder.as_str()))
    {
        let seen_for = input.now.saturating_duration_since(obs.claimed_at);
        let due = input.running_after.min(ttl / 2);
        if seen_for < due {
            // Come back when the write is due, or at expiry if sooner.
            return Decision::Wait(Some((due - seen_for).min(wait)));
        }
        let mut status = current.clone();
        status.phase = Some(TaskPhase::Running);
        status.holder = Some(holder.clone());
        status.observed_generation = task.metadata.generation;
        set_condition(
            &mut status,
            task,
            input.wall,
            status::leased(
                true,
                "Held",
                &format!(
                    "held by {holder} with fencing token {}",
                    current.fencing_token
                ),
            ),
        );
        return Decision::WriteStatus {
            status: Box::new(status),
            transition: Transition::Claimed { holder },
        };
    }
    if !wait.is_zero() {
        return Decision::Wait(Some(wait));
    }
    let mut expired = lease.clone();
    let st = expired.status.get_or_insert_with(Default::default);
    st.phase = Some(LeasePhase::Expired);
    st.reason = Some(reason.as_str().into());
    st.message = Some(match reason {
        ExpiryReason::LeaseExpired => format!("no renewal observed for {}s", ttl.as_secs()),
        ExpiryReason::ActiveDeadlineExceeded => {
            format!(
                "attempt ran longer than activeDeadlineSeconds={}",
                task.spec.active_deadline_seconds.unwrap_or(0)
            )
        }
        ExpiryReason::NotCurrentLease => "not the task's current lease".into(),
    });
    Decision::Expire {
        lease: Box::new(expired),
        reason,
    }
}

/// `lease` released for `why` (see [`Decision::Release`]).
fn release(lease: &TaskLease, why: ReleaseWhy) -> Decision {
    let mut ended = lease.clone();
    let st = ended.status.get_or_insert_with(Default::default);
    st.phase = Some(LeasePhase::Released);
    st.reason = Some(why.as_str().into());
    st.message = Some(match why {
        ReleaseWhy::Cancelled => "the task was cancelled (spec.cancel)".into(),
        ReleaseWhy::QueuePaused => format!("queue {} is paused", lease.spec.queue),
    });
    Decision::Release {
        lease: Box::new(ended),
        why,
    }
}

/// Final leases other than the current one, beyond the newest
/// [`KEEP_LEASES`], oldest first.
fn prunable(leases: &[Arc<TaskLease>], current: Option<&str>) -> Vec<(String, Option<String>)> {
    let mut done: Vec<&Arc<TaskLease>> = leases
        .iter()
        .filter(|l| Some(l.name_any().as_str()) != current)
        .filter(|l| {
            l.status
                .as_ref()
                .and_then(|s| s.phase)
                .is_some_and(LeasePhase::is_terminal)
        })
        .collect();
    if done.len() <= KEEP_LEASES {
        return Vec::new();
    }
    done.sort_by_key(|l| l.spec.fencing_token);
    let excess = done.len() - KEEP_LEASES;
    done.into_iter()
        .take(excess)
        .map(|l| (l.name_any(), l.resource_version()))
        .collect()
}

#[cfg(test)]
#[path = "decide_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "decide_graph_tests.rs"]
mod graph_tests;

#[cfg(test)]
#[path = "decide_cancel_tests.rs"]
mod cancel_tests;
