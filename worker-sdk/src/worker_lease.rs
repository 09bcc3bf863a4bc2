//! Renewals per worker (design "Fleets", opt-in with
//! `WorkerBuilder::renew_per_worker`): one WorkerLease per worker process
//! keeps alive every attempt it names, instead of one renewal per
//! TaskLease every TTL/3.
//!
//! Attempts register here ([`WorkerLeases::register`]) and are told, through
//! their fence, when a renewal naming them was answered in time (their
//! kill clock is fed with its send instant) or that the operator revoked
//! them (killed at once, never named or fed again) or that the WorkerLease
//! keeping them alive is gone (killed); or, when the API server refuses the
//! WorkerLease for a reason a retry cannot fix (403, 422), that they must
//! renew per lease again. An attempt the renewer killed gives its TaskLease
//! back after its handler was dropped (the attempt's give-back, one CAS):
//! while it stays Held by this worker, the operator would credit it with
//! every renewal of the worker's next WorkerLease. The renewal loop is in
//! `renewer`; its decisions in `plan`.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use batchlease_api::AttemptRef;
use batchlease_api::worker_lease::MAX_HOLDS;
use k8s_openapi::jiff::Timestamp;
use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use crate::fence::{Fence, KillReason};

pub(crate) mod plan;
mod renewer;

pub(crate) use renewer::Renewer;

/// How a registered attempt is kept alive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Named by the WorkerLease's renewals.
    Worker,
    /// Renewed per lease, by its own heartbeat: the WorkerLease was
    /// refused, or was not there when the attempt registered.
    PerLease,
}

/// The renewer's side of the attempts, shared with them.
#[derive(Clone, Default)]
pub(crate) struct WorkerLeases {
    shared: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    /// Wakes the renewal loop: an attempt registered or deregistered.
    wake: Notify,
    /// Wakes the worker's loop: a waiting bound attempt was confirmed.
    confirmed: Notify,
}

#[derive(Default)]
struct State {
    entries: HashMap<AttemptRef, Entry>,
    /// The WorkerLease exists and its renewals are not refused: new claims
    /// may be renewed per worker.
    live: bool,
    /// When the request that found the WorkerLease gone was sent: an
    /// attempt claimed before it was kept alive by an object that is no
    /// more, and is never named in its successor.
    lost_at: Option<Instant>,
    /// The worker stopped claiming for a while (its claim brake): its
    /// WorkerLease says no slots meanwhile, so nothing is addressed to it.
    claims_paused: bool,
    /// `status.revoked` of the copy last seen: an attempt that registers
    /// after that copy was read (its claim answered late) is killed at its
    /// registration instead of being named, and fed, until the next copy.
    revoked: Vec<AttemptRef>,
    /// The `renewTime` of each recent write of the WorkerLease (create or
    /// renewal) and when it was sent, newest last: a bound attempt cites
    /// one ([`WorkerLeases::sent_at`]).
    sent: VecDeque<(Timestamp, Instant)>,
    /// Bound attempts not started yet that wait for a renewal naming them
    /// ([`WorkerLeases::confirm`]): named from the next renewal on, their
    /// start counted from the send of one that was answered in time.
    pending: HashMap<AttemptRef, Pending>,
}

/// A bound attempt waiting for a renewal that names it.
struct Pending {
    ttl: std::time::Duration,
    /// When it began to wait.
    since: Instant,
    /// When the last renewal that named it was sent, answered in time or
    /// not: the next one follows at the usual pace, not at once.
    tried: Option<Instant>,
    confirmation: Confirmation,
}

/// Where a bound attempt waiting for a renewal naming it stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Confirmation {
    /// Not named by an answered renewal yet.
    Waiting,
    /// The last renewal that named it was sent at this instant and
    /// answered in time: a kill clock may count from it.
    Fed(Instant),
    /// The operator revoked it: never start it.
    Revoked,
    /// The WorkerLease is gone or refused: it cannot be confirmed.
    Lost,
}

/// How many recent writes [`State::sent`] remembers: at one per TTL/3, far
/// longer than a bound attempt may wait to start (half its TTL).
const SENT_KEPT: usize = 64;

struct Entry {
    fence: Fence,
    /// When it was last kept alive by a request known to be sent: its
    /// claim, then each renewal that fed it.
    since: Instant,
    state: EntryState,
    mode: watch::Sender<Mode>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EntryState {
    Named,
    PerLease,
    Killed,
}

impl WorkerLeases {
    /// Whether a claim may be renewed per worker now: the WorkerLease is
    /// live and has room.
    pub(crate) fn claims_per_worker(&self) -> bool {
        let s = self.lock();
        s.live && s.entries.len() < MAX_HOLDS
    }

    /// The claim brake engaged (`true`) or let go: the next renewal, sent
    /// now, says so in `slots`.
    pub(crate) fn set_claims_paused(&self, paused: bool) {
        let changed = {
            let mut s = self.lock();
            std::mem::replace(&mut s.claims_paused, paused) != paused
        };
        if changed {
            self.shared.wake.notify_one();
        }
    }

    /// Whether the worker has stopped claiming for a while.
    pub(crate) fn claims_paused(&self) -> bool {
        self.lock().claims_paused
    }

    /// Whether the process holds as many attempts as a WorkerLease may
    /// list: no more claims until one ends.
    pub(crate) fn full(&self) -> bool {
        let s = self.lock();
        s.entries.len() + s.pending.len() >= MAX_HOLDS
    }

    /// Registers the attempt `attempt`, claimed (renewed per worker) by a
    /// request sent at `claim_sent`, whose fence the renewer feeds or
    /// kills. Deregistered when the returned membership is dropped.
    pub(crate) fn register(
        &self,
        attempt: AttemptRef,
        fence: Fence,
        claim_sent: Instant,
    ) -> Membership {
        let mut s = self.lock();
        if s.entries.contains_key(&attempt) {
            // Already running in this process (a second start of one bound
            // attempt): refused, and the running one keeps its entry. No
            // give-back either: the lease is the running one's.
            fence.kill(KillReason::LeaseLost);
            tracing::warn!(lease = %attempt.name, uid = %attempt.uid, "attempt already running in this process: not started again");
            let (_, rx) = watch::channel(Mode::PerLease);
            return Membership {
                leases: self.clone(),
                attempt,
                mode: rx,
                owns: false,
            };
        }
        // A bound attempt confirmed by a renewal naming it: named without
        // a gap from here on.
        s.pending.remove(&attempt);
        let state = if s.revoked.contains(&attempt) {
            // Revoked before it even registered (a cancel right after the
            // claim): a revocation is final.
            fence.kill(KillReason::Revoked);
            tracing::warn!(lease = %attempt.name, uid = %attempt.uid, reason = KillReason::Revoked.as_str(), "attempt revoked by the operator: stopping it");
            EntryState::Killed
        } else if s.lost_at.is_some_and(|lost| claim_sent <= lost) {
            // Claimed while the WorkerLease that would keep it alive was
            // being found gone: as its 404 killed the others (and given
            // back: the TaskLease is likely still held by us).
            fence.kill(KillReason::WorkerLeaseLost);
            EntryState::Killed
        } else if s.live {
            EntryState::Named
        } else {
            // Per-lease renewals are always safe: a compare-and-swap on
            // the TaskLease itself.
            fence.renew_per_lease();
            EntryState::PerLease
        };
        let mode = if state == EntryState::Named {
            Mode::Worker
        } else {
            Mode::PerLease
        };
        let (tx, rx) = watch::channel(mode);
        s.entries.insert(
            attempt.clone(),
            Entry {
                fence,
                since: claim_sent,
                state,
                mode: tx,
            },
        );
        drop(s);
        self.shared.wake.notify_one();
        Membership {
            leases: self.clone(),
            attempt,
            mode: rx,
            owns: true,
        }
    }

    /// Whether `attempt` runs in this process (registered, until its
    /// membership is dropped).
    pub(crate) fn is_registered(&self, attempt: &AttemptRef) -> bool {
        self.lock().entries.contains_key(attempt)
    }

    /// The bound attempts waiting for a renewal naming them.
    pub(crate) fn pending(&self) -> Vec<AttemptRef> {
        self.lock().pending.keys().cloned().collect()
    }

    /// A write of the WorkerLease carrying `renew_time` is being sent at
    /// `sent` (whether it lands or not: the operator may observe it even
    /// when its answer is lost).
    pub(crate) fn record_sent(&self, renew_time: Timestamp, sent: Instant) {
        let mut s = self.lock();
        s.sent.push_back((renew_time, sent));
        while s.sent.len() > SENT_KEPT {
            s.sent.pop_front();
        }
    }

    /// When this process sent the WorkerLease write that carried
    /// `renew_time` — the renewal a bound attempt cites — if it did and
    /// still remembers it.
    pub(crate) fn sent_at(&self, renew_time: Timestamp) -> Option<Instant> {
        self.lock()
            .sent
            .iter()
            .find(|(t, _)| *t == renew_time)
            .map(|(_, at)| *at)
    }

    /// Bound attempt `attempt` (TTL `ttl`) waits for a renewal naming it:
    /// it is named from the next renewal (sent at once) until it starts
    /// ([`WorkerLeases::register`] takes it over) or is dropped
    /// ([`WorkerLeases::drop_pending`]). Returns where it stands.
    pub(crate) fn confirm(&self, attempt: &AttemptRef, ttl: std::time::Duration) -> Confirmation {
        let mut s = self.lock();
        if let Some(p) = s.pending.get(attempt) {
            return p.confirmation;
        }
        let confirmation = if s.revoked.contains(attempt) {
            Confirmation::Revoked
        } else if s.live {
            Confirmation::Waiting
        } else {
            Confirmation::Lost
        };
        s.pending.insert(
            attempt.clone(),
            Pending {
                ttl,
                since: Instant::now(),
                tried: None,
                confirmation,
            },
        );
        drop(s);
        if confirmation == Confirmation::Waiting {
            self.shared.wake.notify_one();
        }
        confirmation
    }

    /// Whether a write sent at `sent` went to a WorkerLease this process
    /// has since found gone (and created again).
    pub(crate) fn lost_since(&self, sent: Instant) -> bool {
        self.lock().lost_at.is_some_and(|lost| sent <= lost)
    }

    /// Where bound attempt `attempt` stands in its wait for a renewal
    /// naming it, if it waits.
    pub(crate) fn confirmation(&self, attempt: &AttemptRef) -> Option<Confirmation> {
        self.lock().pending.get(attempt).map(|p| p.confirmation)
    }

    /// No longer waits for a renewal naming it (given back, or its lease
    /// gone): named no more.
    pub(crate) fn drop_pending(&self, attempt: &AttemptRef) {
        self.lock().pending.remove(attempt);
    }

    /// Resolves when a renewal has confirmed (or ended) a waiting bound
    /// attempt.
    pub(crate) async fn confirmed(&self) {
        self.shared.confirmed.notified().await;
    }

    /// Marks the WorkerLease live, as a successful create does.
    #[cfg(test)]
    pub(crate) fn set_live_for_tests(&self) {
        self.lock().live = true;
    }

    /// How many attempts are registered.
    #[cfg(test)]
    pub(crate) fn registered_for_tests(&self) -> usize {
        self.lock().entries.len()
    }

    fn deregister(&self, attempt: &AttemptRef) {
        self.lock().entries.remove(attempt);
        self.shared.wake.notify_one();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.shared.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// An attempt's registration with the renewer; dropping it deregisters
/// the attempt (once it has stopped: its completion acknowledged, or
/// killed), which is then never named again.
pub(crate) struct Membership {
    leases: WorkerLeases,
    attempt: AttemptRef,
    mode: watch::Receiver<Mode>,
    /// `false`: a refused second registration, which must not take the
    /// running one's entry with it when dropped.
    owns: bool,
}

impl Membership {
    /// How the attempt is kept alive now.
    pub(crate) fn mode(&self) -> Mode {
        *self.mode.borrow()
    }

    /// Resolves when the mode changes (to per lease), never otherwise.
    pub(crate) async fn changed(&mut self) {
        if self.mode.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        if self.owns {
            self.leases.deregister(&self.attempt);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::fence::KillClock;

    pub(super) fn attempt(name: &str) -> AttemptRef {
        AttemptRef {
            name: name.into(),
            uid: format!("uid-{name}"),
        }
    }

    pub(super) fn fence(at: Instant) -> Fence {
        Fence::new(
            1,
            KillClock::new(Duration::from_secs(30), at, None).per_worker(),
        )
    }

    #[tokio::test(start_paused = true)]
    async fn registration_follows_the_worker_lease() {
        let leases = WorkerLeases::default();
        let t0 = Instant::now();
        // No live WorkerLease yet: renewed per lease, which is always safe.
        let f = fence(t0);
        let m = leases.register(attempt("a"), f.clone(), t0);
        assert_eq!(m.mode(), Mode::PerLease);
        assert!(!f.clock().is_per_worker());
        assert!(!leases.claims_per_worker());

        leases.lock().live = true;
        assert!(leases.claims_per_worker());
        let f = fence(t0);
        let m2 = leases.register(attempt("b"), f.clone(), t0);
        assert_eq!(m2.mode(), Mode::Worker);
        assert!(f.clock().is_per_worker());
        assert_eq!(f.kill_reason(), None);

        // Claimed before the WorkerLease was found gone: never named in
        // its successor.
        leases.lock().lost_at = Some(t0 + Duration::from_secs(5));
        let f = fence(t0 + Duration::from_secs(1));
        let _m3 = leases.register(attempt("c"), f.clone(), t0 + Duration::from_secs(1));
        assert_eq!(f.kill_reason(), Some(KillReason::WorkerLeaseLost));
        let f = fence(t0 + Duration::from_secs(6));
        let m4 = leases.register(attempt("d"), f.clone(), t0 + Duration::from_secs(6));
        assert_eq!(m4.mode(), Mode::Worker);

        // Revoked in the copy last seen, before it registered: killed at
        // once, never named.
        leases.lock().revoked = vec![attempt("e")];
        let f = fence(t0 + Duration::from_secs(7));
        let m5 = leases.register(attempt("e"), f.clone(), t0 + Duration::from_secs(7));
        assert_eq!(f.kill_reason(), Some(KillReason::Revoked));
        assert_eq!(m5.mode(), Mode::PerLease, "not named");
        assert_eq!(
            leases.lock().entries[&attempt("e")].state,
            EntryState::Killed
        );

        // Dropping a membership deregisters it.
        assert_eq!(leases.lock().entries.len(), 5);
        drop(m);
        drop(m2);
        drop(m5);
        assert_eq!(leases.lock().entries.len(), 2);
        assert!(!leases.lock().entries.contains_key(&attempt("a")));
        assert!(!leases.full());
    }
}
