//! A task with its current lease: an offer waiting for a claim (or
//! withdrawn), a held lease followed to `Running` or expired, and an ended
//! attempt settled (`settle.rs`) once its locks are given back.

use std::time::Duration;

use tokio::time::Instant;

use batchlease_api::keys::release_reason;
use batchlease_api::{BatchTaskStatus, LeaseOutcome, LeasePhase, TaskLease, TaskPhase};

use super::rules::{Next, TOKEN_RETIRED, lost_attempt_wait, release};
use super::settle::{self, settle};
use super::types::{
    Decision, ExpiryReason, Input, LockRelease, OfferView, QueueGate, ReleaseWhy, Transition,
};
use crate::locks;
use crate::status::{self, set_condition};

/// The task's current lease exists. A tombstone under its name (the token
/// was retired, `lost::tombstone`) is no lease: the case goes to `lost.rs`.
pub(super) fn leased(
    input: &Input<'_>,
    current: &BatchTaskStatus,
    phase: TaskPhase,
    lease: &TaskLease,
) -> Next {
    let lease_phase = lease
        .status
        .as_ref()
        .and_then(|s| s.phase)
        .unwrap_or(LeasePhase::Offered);
    let retired = lease_phase == LeasePhase::Released
        && lease.status.as_ref().and_then(|s| s.reason.as_deref()) == Some(TOKEN_RETIRED);
    if retired {
        return Next::Lost;
    }
    Next::Decided(by_phase(input, current, phase, lease, lease_phase))
}

/// The current lease, by its phase: Offered, Held, or ended.
fn by_phase(
    input: &Input<'_>,
    current: &BatchTaskStatus,
    phase: TaskPhase,
    lease: &TaskLease,
    lease_phase: LeasePhase,
) -> Decision {
    let cancel = input.task.spec.cancel;
    match lease_phase {
        LeasePhase::Offered if cancel => release(lease, ReleaseWhy::Cancelled),
        LeasePhase::Offered if input.queue == QueueGate::Paused => {
            release(lease, ReleaseWhy::QueuePaused)
        }
        LeasePhase::Offered => offered(input, lease),
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
                settle::cancelled(input.task, current, Some(lease), input.wall)
            } else if lease_phase == LeasePhase::Released
                && reason == Some(release_reason::QUEUE_PAUSED)
            {
                settle::withdrawn(input.task, current, input.wall)
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
        if !taken(lease, obs) {
            // Bound, and not taken by its worker yet: not running. Looked
            // at again while it may be taken (no write meanwhile).
            return Decision::Wait(Some(due.max(Duration::from_millis(500)).min(wait)));
        }
        if seen_for < due {
            // Come back when the write is due, or at expiry if sooner.
            return Decision::Wait(Some((due - seen_for).min(wait)));
        }
        let mut status = current.clone();
        status.phase = Some(TaskPhase::Running);
        status.holder = Some(holder.clone());
        status.current_renewal = lease.spec.renewal;
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
    if reason == ExpiryReason::LeaseExpired && !taken(lease, obs) {
        reason = ExpiryReason::BoundNotTaken;
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
        ExpiryReason::BoundNotTaken => format!(
            "bound to {holder}, whose renewals never named it within {}s; issued again without spending a retry",
            ttl.as_secs()
        ),
    });
    Decision::Expire {
        lease: Box::new(expired),
        reason,
    }
}

/// Whether the worker holding `lease` has taken it: a claim did, and a
/// bound attempt is taken once a renewal of its worker's WorkerLease was
/// seen to name it, or its holder wrote it (a per-lease renewal, a
/// refresh or a checkpoint changes `renewTime` from the cited one).
fn taken(lease: &TaskLease, obs: crate::observe::Observation) -> bool {
    !lease.bound() || obs.named || lease.spec.renew_time != lease.spec.bound_at
}

/// An offer waiting for its claim. One addressed to a worker is addressed
/// again once that worker lapsed (see `offers::addressable_until`) or left
/// it unclaimed past its claim deadline; an unaddressed one waits for any
/// worker.
fn offered(input: &Input<'_>, lease: &TaskLease) -> Decision {
    let (Some(_), Some(view)) = (lease.spec.offered_to.as_ref(), input.offer) else {
        return Decision::Wait(None);
    };
    match readdress_after(view, lease_ttl(lease), input.now) {
        None => Decision::Readdress {
            lease: Box::new(lease.clone()),
            lapsed: view.addressee_live_until.is_none_or(|t| t <= input.now),
        },
        Some(wait) => Decision::Wait(Some(wait)),
    }
}

/// Pure: `None` when an addressed offer is to be addressed again now, else
/// how long until it is: its claim deadline (`offers::CLAIM_DEADLINE`, at
/// most the lease's TTL) unclaimed, or its worker's lapse if sooner (so a
/// worker that died loses its offers when it lapses).
pub(super) fn readdress_after(view: OfferView, ttl: Duration, now: Instant) -> Option<Duration> {
    let lapse = view.addressee_live_until?.saturating_duration_since(now);
    let deadline = ttl.min(crate::offers::CLAIM_DEADLINE);
    let unclaimed = deadline.saturating_sub(now.saturating_duration_since(view.since));
    let left = lapse.min(unclaimed);
    (!left.is_zero()).then_some(left)
}

fn lease_ttl(lease: &TaskLease) -> Duration {
    Duration::from_secs(u64::try_from(lease.spec.lease_duration_seconds.max(1)).unwrap_or(1))
}
