//! Bound attempts (design "Fleets", "Bound attempts"): TaskLeases the
//! operator created already `Held` by this worker, with no claim write.
//!
//! A bound lease cites (`spec.boundAt`) the `renewTime` of this worker's
//! WorkerLease that the operator had observed before it created the
//! lease. The attempt's kill clock counts from when this process sent that
//! renewal: that send came before the operator's first sight of the lease,
//! where the operator's own clock for the attempt starts, so the kill
//! switch (2/3·TTL after it) fires before any expiry could. From its start
//! the attempt is renewed like a claimed one, named in the next renewals.
//!
//! A bound lease seen too late for that — half its TTL has passed since
//! the renewal it cites was sent — waits for a renewal that names it
//! instead: the renewer sends one at once, and the attempt starts from
//! that send. One citing a renewal this process did not send, or sent to
//! a WorkerLease since found gone, one that cannot be confirmed (the
//! WorkerLease gone or refused), or one not started within a TTL of its
//! sight is given back (`Interrupted`, which costs the task no retry) so
//! that it is issued again at once rather than at its expiry; one the
//! operator revoked is never started; none is taken twice ([`waiting`]).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use batchlease_api::{AttemptRef, BatchTask, LeaseOutcome, LeasePhase, TaskLease, check_current};
use kube::api::Api;
use kube::runtime::reflector::Store;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, timeout};
use tracing::{debug, info};

use crate::lease_ops::{self, Completion};
use crate::metrics::WorkerMetrics;
use crate::worker_lease::{Confirmation, WorkerLeases};

/// What to do now with one bound lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Step {
    /// Start it; its kill clock counts from `sent`.
    Start { sent: Instant },
    /// No free slot yet: look again by `until`.
    Wait { until: Instant },
    /// Wait for a renewal that names it ([`WorkerLeases::confirm`]).
    Confirm,
    /// The operator revoked it: never start it (nor write it: the
    /// operator ends it).
    Skip,
    /// Give it back without running it.
    GiveBack(Why),
}

/// Why a bound lease is given back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Why {
    /// It cannot be confirmed: the WorkerLease is gone or refused, or the
    /// worker does not renew per worker.
    Unconfirmed,
    /// No slot came free within a TTL of its first sight.
    NoSlot,
    /// The worker is draining.
    Draining,
}

impl Why {
    /// Low-cardinality label and the lease's `status.reason`.
    pub(super) fn as_str(self) -> &'static str {
        match self {
            Self::Unconfirmed => batchlease_api::BOUND_UNCONFIRMED,
            Self::NoSlot => batchlease_api::BOUND_NO_SLOT,
            Self::Draining => batchlease_api::BOUND_WHILE_DRAINING,
        }
    }
}

/// What the worker knows of one bound lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Known {
    /// When this process sent the renewal the lease cites, if it did.
    pub cited: Option<Instant>,
    /// That renewal went to a WorkerLease found gone since: the operator
    /// may end the attempt on that object's departure without revoking it
    /// in the one created again, so no renewal of the new one may start it
    /// (the model checker's counterexample).
    pub cited_lost: bool,
    /// Where its wait for a renewal naming it stands, if it waits
    /// (`None`: it does not, or the worker does not renew per worker).
    pub confirmation: Option<Confirmation>,
    /// Whether the worker renews per worker (it can wait for a renewal).
    pub per_worker: bool,
    /// When this process first saw it.
    pub seen: Instant,
}

/// Pure: the step for a bound lease of TTL `ttl`, given what the worker
/// knows of it, with or without a free slot, at `now`. It starts from the
/// latest send known to keep it alive — the cited renewal, or a renewal
/// that named it — only while less than half its TTL has passed since:
/// its kill clock runs out at 2/3·TTL, and the next renewal (due by then)
/// needs up to TTL/6 to come back and feed it. Otherwise it waits for a
/// renewal naming it.
pub(super) fn step(ttl: Duration, k: Known, slot_free: bool, now: Instant) -> Step {
    let fed = match k.confirmation {
        Some(Confirmation::Revoked) => return Step::Skip,
        Some(Confirmation::Lost) => return Step::GiveBack(Why::Unconfirmed),
        Some(Confirmation::Fed(at)) => Some(at),
        Some(Confirmation::Waiting) | None => None,
    };
    // A renewal this process never sent: an attempt bound to another
    // process of the same identity (one that reused it, or crashed), which
    // may have named it before — a listing the operator saw end is never
    // credited again. Never started here.
    let Some(cited) = k.cited.filter(|_| k.per_worker && !k.cited_lost) else {
        return Step::GiveBack(Why::Unconfirmed);
    };
    let sent = fed.map_or(cited, |f| f.max(cited));
    let by = sent + ttl / 2;
    if now < by && slot_free {
        return Step::Start { sent };
    }
    if now >= k.seen + ttl {
        // A TTL since it was seen: no slot came, or no renewal confirmed
        // it (their answers all too late).
        return Step::GiveBack(if slot_free {
            Why::Unconfirmed
        } else {
            Why::NoSlot
        });
    }
    if now < by {
        Step::Wait {
            until: by.min(k.seen + ttl),
        }
    } else {
        Step::Confirm
    }
}

/// Pure: whether `lease` is bound to `identity` and still waiting for it:
/// `Held` by it, created so (`spec.boundAt`).
pub(super) fn is_bound_to(lease: &TaskLease, identity: &str) -> bool {
    lease.bound()
        && lease.spec.holder_identity.as_deref() == Some(identity)
        && lease.status.as_ref().and_then(|s| s.phase) == Some(LeasePhase::Held)
}

/// How long this process remembers a bound attempt it took (started,
/// given back, declined): past any TTL, so a lease that reappears — a
/// watch relisting, its worker label removed and put back, which moves it
/// between the worker's two watches — is never taken twice.
const TAKEN_KEPT: Duration = Duration::from_secs(2 * 3600);

/// The leases bound to `identity` in `stores` that this process has not
/// taken (`taken`, with when) nor registered (running), oldest token
/// first. `taken` forgets what it took more than [`TAKEN_KEPT`] ago.
pub(super) fn waiting(
    stores: &[Store<TaskLease>],
    identity: &str,
    taken: &mut HashMap<AttemptRef, Instant>,
    leases: Option<&WorkerLeases>,
    now: Instant,
) -> Vec<Arc<TaskLease>> {
    taken.retain(|_, at| now.saturating_duration_since(*at) < TAKEN_KEPT);
    let mut out: Vec<Arc<TaskLease>> = stores
        .iter()
        .flat_map(Store::state)
        .filter(|l| is_bound_to(l, identity))
        .filter(|l| {
            let a = AttemptRef::of(l);
            !taken.contains_key(&a) && !leases.is_some_and(|w| w.is_registered(&a))
        })
        .collect();
    out.sort_by_key(|l| (l.spec.fencing_token, AttemptRef::of(l)));
    out.dedup_by_key(|l| AttemptRef::of(l));
    out
}

/// When this process sent the renewal `lease` cites, if it did.
pub(super) fn cited_send(lease: &TaskLease, leases: Option<&WorkerLeases>) -> Option<Instant> {
    let at = lease.spec.bound_at.as_ref()?;
    leases?.sent_at(at.0)
}

/// A bound attempt ready to run: its slot, lease, task, and the send its
/// kill clock counts from.
pub(super) struct Ready {
    pub permit: OwnedSemaphorePermit,
    pub lease: TaskLease,
    pub task: BatchTask,
    pub sent: Instant,
}

/// What one look at the bound leases found: attempts to start, and when
/// to look again (a wait for a slot or a renewal runs out then).
#[derive(Default)]
pub(super) struct Round {
    pub ready: Vec<Ready>,
    pub look_again: Option<Instant>,
}

/// What one look at the bound leases needs.
pub(super) struct Look<'a> {
    pub stores: &'a [Store<TaskLease>],
    pub identity: &'a str,
    pub leases: &'a Api<TaskLease>,
    pub tasks: &'a Api<BatchTask>,
    pub slots: &'a Arc<Semaphore>,
    /// Whether attempts may start now (not while the claim brake pauses).
    pub may_start: bool,
    pub worker_leases: Option<&'a WorkerLeases>,
    pub metrics: &'a WorkerMetrics,
}

/// How long the read of a bound attempt's task may take.
const READ_BUDGET: Duration = Duration::from_secs(5);

/// Looks at every lease bound to this worker that it has not taken yet
/// (`taken`; first seen: `seen`): each starts, waits for a slot or for a
/// renewal naming it, is given back, or is left alone, as [`step`] says.
/// A started one's task is read first and checked as a claim's is: a
/// cancelled task, or a lease that is not its task's current one, is
/// never run; and the step is decided again after the read, which may
/// have taken the time the attempt had to start. A bound attempt waiting
/// for a renewal whose lease is no longer seen bound is no longer waited
/// for (nor named).
pub(super) async fn look(
    l: Look<'_>,
    taken: &mut HashMap<AttemptRef, Instant>,
    seen: &mut HashMap<AttemptRef, Instant>,
) -> Round {
    let mut round = Round::default();
    let waiting = waiting(l.stores, l.identity, taken, l.worker_leases, Instant::now());
    let visible: HashSet<AttemptRef> = waiting.iter().map(|w| AttemptRef::of(w)).collect();
    seen.retain(|a, _| visible.contains(a));
    if let Some(w) = l.worker_leases {
        for a in w.pending().into_iter().filter(|a| !visible.contains(a)) {
            w.drop_pending(&a);
            taken.insert(a, Instant::now());
        }
    }
    let again = |at: Instant, round: &mut Round| {
        round.look_again = Some(round.look_again.map_or(at, |r| r.min(at)));
    };
    for lease in waiting {
        let attempt = AttemptRef::of(&lease);
        let now = Instant::now();
        let first = *seen.entry(attempt.clone()).or_insert(now);
        let ttl =
            Duration::from_secs(u64::try_from(lease.spec.lease_duration_seconds).unwrap_or(5));
        let known = || Known {
            cited: cited_send(&lease, l.worker_leases),
            cited_lost: cited_send(&lease, l.worker_leases)
                .is_some_and(|c| l.worker_leases.is_some_and(|w| w.lost_since(c))),
            confirmation: l.worker_leases.and_then(|w| w.confirmation(&attempt)),
            per_worker: l.worker_leases.is_some(),
            seen: first,
        };
        let permit = if l.may_start {
            l.slots.clone().try_acquire_owned().ok()
        } else {
            None
        };
        let done = |taken: &mut HashMap<AttemptRef, Instant>| {
            if let Some(w) = l.worker_leases {
                w.drop_pending(&attempt);
            }
            taken.insert(attempt.clone(), Instant::now());
        };
        match step(ttl, known(), permit.is_some(), now) {
            Step::Start { .. } => {
                let Some(permit) = permit else { continue };
                let task = match timeout(READ_BUDGET, l.tasks.get_opt(&lease.spec.task_name)).await
                {
                    Ok(Ok(Some(task))) => task,
                    // The task is gone: garbage collection takes the lease.
                    Ok(Ok(None)) => {
                        done(taken);
                        continue;
                    }
                    _ => {
                        debug!(lease = %attempt.name, "reading a bound attempt's task failed; looking again");
                        again(now + Duration::from_secs(1), &mut round);
                        continue;
                    }
                };
                if task.spec.cancel {
                    // The operator revokes and releases it.
                    debug!(lease = %attempt.name, "task cancelled; bound attempt not started");
                    done(taken);
                    continue;
                }
                if let Err(why) = check_current(&task, &lease) {
                    l.metrics.claims_refused.inc();
                    debug!(lease = %attempt.name, why = why.as_str(), "bound lease is not its task's current one; not started");
                    done(taken);
                    continue;
                }
                // Decided again: the read may have used up its time.
                let Step::Start { sent } = step(ttl, known(), true, Instant::now()) else {
                    again(Instant::now(), &mut round);
                    continue;
                };
                taken.insert(attempt.clone(), Instant::now());
                round.ready.push(Ready {
                    permit,
                    lease: lease.as_ref().clone(),
                    task,
                    sent,
                });
            }
            Step::Wait { until } => again(until, &mut round),
            Step::Confirm => match l.worker_leases {
                Some(w) if !w.full() => {
                    w.confirm(&attempt, ttl);
                    // Given back if nothing confirms it within a TTL.
                    again(first + ttl, &mut round);
                }
                _ => {
                    done(taken);
                    tokio::spawn(give_back(
                        l.leases.clone(),
                        lease.clone(),
                        l.identity.to_owned(),
                        Why::NoSlot,
                    ));
                }
            },
            Step::Skip => done(taken),
            Step::GiveBack(why) => {
                done(taken);
                tokio::spawn(give_back(
                    l.leases.clone(),
                    lease.clone(),
                    l.identity.to_owned(),
                    why,
                ));
            }
        }
    }
    round
}

/// Gives back every lease bound to this worker that it has not taken nor
/// started: it is draining.
pub(super) async fn give_back_all(
    stores: &[Store<TaskLease>],
    identity: &str,
    leases: &Api<TaskLease>,
    taken: &mut HashMap<AttemptRef, Instant>,
    worker_leases: Option<&WorkerLeases>,
) {
    let left = waiting(stores, identity, taken, worker_leases, Instant::now());
    for lease in &left {
        let a = AttemptRef::of(lease);
        if let Some(w) = worker_leases {
            w.drop_pending(&a);
        }
        taken.insert(a, Instant::now());
    }
    futures::future::join_all(
        left.into_iter()
            .map(|lease| give_back(leases.clone(), lease, identity.to_owned(), Why::Draining)),
    )
    .await;
}

/// How long a give-back may take.
const GIVE_BACK_BUDGET: Duration = Duration::from_secs(2);

/// Gives `lease` back without running it: `Interrupted` (the operator
/// issues the task again at once, no retry spent), by a CAS on the copy
/// seen, retried on a fresh copy while the lease is still held by us — a
/// lease that moved on refuses it, harmlessly. Bounded, best effort: one
/// left behind expires (it is named by no renewal).
pub(super) async fn give_back(
    api: Api<TaskLease>,
    lease: Arc<TaskLease>,
    identity: String,
    why: Why,
) {
    let c = Completion {
        outcome: LeaseOutcome::Interrupted,
        reason: Some(why.as_str().to_owned()),
        message: Some(match why {
            Why::Unconfirmed => "no renewal of this worker's WorkerLease could confirm the bound attempt; not started".to_owned(),
            Why::NoSlot => "no free slot for the bound attempt within its TTL; not started".to_owned(),
            Why::Draining => "the worker is draining; bound attempt not started".to_owned(),
        }),
        permanent: false,
        result: None,
        checkpoint: None,
    };
    let name = kube::ResourceExt::name_any(lease.as_ref());
    match timeout(
        GIVE_BACK_BUDGET,
        lease_ops::complete(&api, &lease, &identity, &c),
    )
    .await
    {
        Ok(Ok(())) => {
            info!(lease = %name, reason = why.as_str(), "bound attempt given back without running")
        }
        Ok(Err(e)) => {
            debug!(lease = %name, reason = why.as_str(), error = %e, "bound attempt not given back (it moved on)")
        }
        Err(_) => {
            debug!(lease = %name, reason = why.as_str(), "giving a bound attempt back timed out")
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
#[path = "bound_tests.rs"]
mod tests;
