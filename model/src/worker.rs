//! The workers: a claim after the SDK's `check_current`, renewals, the
//! kill switch (the SDK's `KillClock`), registration, the fence check, a
//! commit that lands later, and completion.
//!
//! A speculative attempt (design §6) mirrors `worker-sdk/src/speculate.rs`:
//! after registration each round reads the key, runs the function (one
//! side effect) and sends its commit — the fenced commit and the key's
//! compare-and-swap in one transaction ([`Storage::commit_swap`]). A lost
//! swap rolls back and undoes the round's side effect; the attempt then
//! completes `Aborted`, or — in `Exclusive` mode, the quarantine — runs
//! one more round in place first (the SDK: up to `IN_PLACE_ROUNDS`). An
//! attempt that ends any other way without a commit undoes its side
//! effect too (the SDK hands the compensations to a background task).
//!
//! [`Storage::commit_swap`]: crate::storage::Storage::commit_swap

use std::collections::BTreeMap;
use std::time::Duration;

use batchlease_api::{LeaseOutcome, LeasePhase, Renewal, TaskLease, check_current};
use batchlease_worker_sdk::KillClock;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;

use crate::api_server::{Refused, decode, encode};
use crate::storage::{Key, Refusal, Swap};
use crate::{Action, Cluster, KillRule, State, phase};

/// One worker.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub enum Worker {
    Idle,
    Holding(Attempt),
}

/// A claimed attempt.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct Attempt {
    /// The worker's clock rate, percent.
    pub rate: u8,
    /// The task's index.
    pub task: usize,
    /// The lease's resource tokens (`spec.resourceTokens`).
    pub resource_tokens: BTreeMap<String, i64>,
    pub lease: String,
    pub token: i64,
    /// The lease's TTL (`spec.leaseDurationSeconds`): its kill clock's.
    pub ttl: i32,
    /// The worker's last copy of the lease (JSON).
    pub copy: String,
    pub claim_sent: u8,
    pub last_ok_sent: u8,
    /// Per-worker mode: when the last successful write of the TaskLease's
    /// own `renewTime` was sent (the claim, a refresh).
    pub last_refresh_sent: u8,
    pub registered: bool,
    /// The storage refused the registration: the handler never runs, and
    /// the SDK gives the lease back `Interrupted` (no retry spent).
    pub not_started: bool,
    /// Passed its fence check for the commit; the write may land later.
    pub checked: bool,
    pub committed: bool,
    /// Passed its fence check for the child's create (sent, see
    /// [`crate::spawn`]).
    pub spawned: bool,
    /// A speculative attempt's round (`None`: not speculative).
    pub round: Option<Round>,
    /// Per-worker renewals: the worker dropped the attempt from its worker
    /// Lease's `holds` while running it, and never lists it again (a fault,
    /// see [`crate::fleet`]).
    pub dropped: bool,
}

/// A speculative attempt's current round.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq)]
pub struct Round {
    /// The attempt runs `Exclusive` (the task's effectiveMode at the claim:
    /// quarantined): a lost swap is retried in place.
    pub exclusive: bool,
    /// The key as this round read it; its commit is on the way.
    pub read: Option<Key>,
    /// The side effect of this round is done, neither committed nor
    /// undone.
    pub effect: bool,
    /// A round was retried in place (once at most in the model).
    pub retried: bool,
    /// The swap was lost for good: the attempt completes `Aborted`.
    pub lost: bool,
}

pub(crate) fn worker_name(w: usize) -> String {
    format!("w{w}")
}

/// Worker `w`'s attempt ends: the side effect of a round that did not
/// commit is undone (each once), and the worker is idle.
pub(crate) fn end(s: &mut State, w: usize) {
    if let Worker::Holding(a) = &s.workers[w]
        && a.round.as_ref().is_some_and(|r| r.effect)
    {
        s.spec.effects = s.spec.effects.saturating_sub(1);
    }
    s.workers[w] = Worker::Idle;
}

/// Records storage's answer to worker `w`'s write for `a` in the ghosts;
/// a refusal ends the attempt. Returns whether it was accepted.
fn stored(s: &mut State, w: usize, a: &Attempt, answer: Result<(), Refusal>) -> bool {
    match answer {
        Err(refusal) => {
            refused(s, &refusal);
            end(s, w);
            false
        }
        Ok(()) => {
            if s.expired[a.task].contains(&a.token) {
                s.write_after_expiry = true;
            }
            crate::cancel::storage_write(s, a.task);
            crate::locks::wrote(s, a.task, &a.resource_tokens);
            true
        }
    }
}

/// The ghosts of a write the storage refused.
fn refused(s: &mut State, refusal: &Refusal) {
    s.fenced_by_storage = true;
    if refusal.resource_rows {
        s.locks.stale_resource_refused = true;
        if !refusal.task_row {
            s.locks.fenced_by_resource = true;
        }
    }
}

/// After a refused write: the fresh copy while the lease is still held by
/// `me` (retry from it), else `None` (the attempt is over).
fn still_ours(s: &State, a: &Attempt, me: &str) -> Option<String> {
    s.api
        .lease(&a.lease)
        .filter(|f| {
            phase(f) == Some(LeasePhase::Held) && f.spec.holder_identity.as_deref() == Some(me)
        })
        .map(|f| encode(&f))
}

impl Cluster {
    /// Worker `w` claims lease `name` if it is its task's current lease
    /// (the SDK reads the task first); the lease as stored, or `None`.
    pub(crate) fn claim(&self, s: &mut State, w: usize, name: &str) -> Option<TaskLease> {
        let lease = s.api.lease(name)?;
        let task = s.api.task_index(&lease.spec.task_name)?;
        let t = s.api.task(task);
        check_current(&t, &lease).ok()?;
        // The SDK does not claim a task it read with spec.cancel set.
        if t.spec.cancel {
            return None;
        }
        let before = lease.clone();
        let mut l = lease;
        if self.old_claim(w) == Some(crate::offers::OldClaim::DropsField) {
            l.spec.offered_to = None;
        }
        l.spec.holder_identity = Some(worker_name(w));
        l.spec.acquire_time = Some(MicroTime(self.wall(s.now, s.api.lease_writes(name))));
        l.spec.renew_time = l.spec.acquire_time.clone();
        l.status.get_or_insert_with(Default::default).phase = Some(LeasePhase::Held);
        if self.cfg.per_worker && l.spec.renewal == Some(Renewal::Lease) {
            // Renewed through its WorkerLease from now on.
            l.spec.renewal = Some(Renewal::Worker);
        }
        match s.api.replace_lease(&l) {
            Ok(stored) => {
                if self.cfg.addressed {
                    crate::offers::claimed(s, &worker_name(w), &before);
                }
                Some(stored)
            }
            Err(Refused::Invalid) => {
                if self.old_claim(w).is_some() && before.spec.offered_to.is_some() {
                    s.offers.old_claim_refused = true;
                }
                None
            }
            Err(_) => None,
        }
    }

    fn kill_clock(&self, a: &Attempt) -> KillClock {
        // The TTL of the lease it holds (the SDK reads it from the lease).
        let ttl = Duration::from_secs(a.ttl.unsigned_abs().into());
        // The worker's own monotonic clock.
        let mut c = KillClock::new(ttl, self.worker_instant(a.rate, a.claim_sent), None);
        c.renewed(self.worker_instant(a.rate, a.last_ok_sent));
        c
    }

    /// The SDK's fence: alive strictly before the kill switch fires — and
    /// in per-worker mode before R + 2/3·TTL without a successful refresh
    /// of the TaskLease (the rule that bounds the holder of a deleted
    /// lease, whose WorkerLease renewals go on succeeding).
    pub(crate) fn alive(&self, a: &Attempt, now: u8) -> bool {
        if self.cfg.kill == KillRule::Never {
            return true;
        }
        let at = self.worker_instant(a.rate, now);
        let ttl = Duration::from_secs(a.ttl.unsigned_abs().into());
        let unrefreshed = self.cfg.per_worker
            && at
                >= self.worker_instant(a.rate, a.last_refresh_sent)
                    + ttl * crate::fleet::REFRESH_TTLS
                    + ttl * 2 / 3;
        at < self.kill_clock(a).kill_at().0 && !unrefreshed
    }

    /// One reconcile pass, as `reconcile.rs` does it, on the operator's
    /// caches; returns the new state (unchanged when it decides to wait).
    pub(crate) fn worker_step(&self, s: &mut State, w: usize, action: &Action) {
        let me = worker_name(w);
        let Worker::Holding(mut a) = s.workers[w].clone() else {
            return;
        };
        let alive = self.alive(&a, s.now);
        match action {
            Action::Renew(_) => {
                let mut l: TaskLease = decode(&a.copy);
                l.spec.renew_time = Some(MicroTime(self.wall(s.now, s.api.lease_writes(&a.lease))));
                match s.api.replace_lease(&l) {
                    Ok(stored) => {
                        a.copy = encode(&stored);
                        a.last_ok_sent = s.now;
                    }
                    Err(Refused::Conflict | Refused::Invalid) => match still_ours(s, &a, &me) {
                        Some(fresh) => a.copy = fresh,
                        None => {
                            end(s, w);
                            return;
                        }
                    },
                    Err(_) => {
                        end(s, w);
                        return;
                    }
                }
            }
            Action::Refresh(_) => {
                let mut l: TaskLease = decode(&a.copy);
                l.spec.renew_time = Some(MicroTime(self.wall(s.now, s.api.lease_writes(&a.lease))));
                match s.api.replace_lease(&l) {
                    Ok(stored) => {
                        a.copy = encode(&stored);
                        a.last_refresh_sent = s.now;
                    }
                    Err(Refused::Conflict | Refused::Invalid) => match still_ours(s, &a, &me) {
                        Some(fresh) => a.copy = fresh,
                        None => {
                            end(s, w);
                            return;
                        }
                    },
                    Err(_) => {
                        // 404: the lease is gone, its attempt is over.
                        s.fleet.stopped_by_refresh = true;
                        end(s, w);
                        return;
                    }
                }
            }
            Action::Register(_) => {
                if !alive {
                    end(s, w);
                    return;
                }
                if let Err(refusal) = s.pg.register(a.task, a.token, &a.resource_tokens) {
                    // The handler never runs; the attempt goes on to give
                    // its lease back (the SDK's `Ended::NotStarted`).
                    refused(s, &refusal);
                    a.not_started = true;
                    s.workers[w] = Worker::Holding(a);
                    return;
                }
                if !stored(s, w, &a, Ok(())) {
                    return;
                }
                a.registered = true;
            }
            Action::CheckFence(_) => {
                if !alive {
                    end(s, w);
                    return;
                }
                a.checked = true;
            }
            Action::SpawnCheck(_) => {
                if !alive {
                    end(s, w);
                    return;
                }
                a.spawned = true;
                Self::spawn_sent(s, w, &a.lease);
            }
            Action::ReadKey(_) => {
                if !alive {
                    end(s, w);
                    return;
                }
                if let Some(r) = a.round.as_mut() {
                    r.read = Some(s.pg.key);
                    r.effect = true;
                    s.spec.effects = s.spec.effects.saturating_add(1);
                }
                a.checked = true;
            }
            Action::CommitLands(_) => {
                let deadline = self.kill_clock(&a).kill_at().0;
                // The deadline travels with the write; modelled in the
                // worker's time frame.
                let in_time = self.cfg.kill == KillRule::Never
                    || self.worker_instant(a.rate, s.now) <= deadline;
                let Some(read) = a.round.as_ref().and_then(|r| r.read) else {
                    let answer = s.pg.commit(a.task, a.token, w, in_time, &a.resource_tokens);
                    if !stored(s, w, &a, answer) {
                        return;
                    }
                    a.committed = true;
                    s.workers[w] = Worker::Holding(a);
                    return;
                };
                let answer =
                    s.pg.commit_swap(a.task, a.token, w, in_time, &a.resource_tokens, read);
                let swap = match answer {
                    Ok(swap) => swap,
                    Err(refusal) => {
                        stored(s, w, &a, Err(refusal));
                        return;
                    }
                };
                let Some(r) = a.round.as_mut() else {
                    return;
                };
                r.read = None;
                r.effect = false;
                match swap {
                    Swap::Won => {
                        // The side effect is the committed one now.
                        a.committed = true;
                        if !stored(s, w, &a, Ok(())) {
                            return;
                        }
                    }
                    // Rolled back: the round's side effect is undone, then
                    // one more round in place, or Aborted.
                    Swap::Lost => {
                        s.spec.effects = s.spec.effects.saturating_sub(1);
                        a.checked = false;
                        if r.exclusive && !r.retried {
                            r.retried = true;
                        } else {
                            r.lost = true;
                        }
                    }
                }
            }
            Action::Complete(_) => {
                if !alive {
                    end(s, w);
                    return;
                }
                let mut l: TaskLease = decode(&a.copy);
                let st = l.status.get_or_insert_with(Default::default);
                st.phase = Some(LeasePhase::Completed);
                st.outcome = Some(if a.committed {
                    LeaseOutcome::Succeeded
                } else if a.not_started {
                    LeaseOutcome::Interrupted
                } else {
                    LeaseOutcome::Aborted
                });
                match s.api.replace_lease(&l) {
                    Ok(_) => {
                        end(s, w);
                        return;
                    }
                    Err(Refused::Conflict) => match still_ours(s, &a, &me) {
                        Some(fresh) => a.copy = fresh,
                        None => {
                            end(s, w);
                            return;
                        }
                    },
                    Err(_) => {
                        end(s, w);
                        return;
                    }
                }
            }
            _ => {}
        }
        s.workers[w] = Worker::Holding(a);
    }
}
