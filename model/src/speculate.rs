//! Speculative mode (design §6) in the model.
//!
//! What is real: the operator's `decide()` and `settle()` — an attempt
//! completed `Aborted` settles the task back to `Pending` with `aborts + 1`
//! and a backoff, spending no retry, and quarantines it (`effectiveMode`
//! Exclusive) at `maxSpeculativeAborts`; a speculative task takes no lock
//! but reads the locks of its resources and is not issued while a live
//! attempt of another task holds one (`locks::respected`,
//! `locks::held_by_other`); a quarantined task takes them. What is
//! mirrored: the SDK's executor (`worker-sdk/src/speculate.rs`) in the
//! model's worker ([`crate::worker::Round`]) and the store's transaction
//! in [`crate::storage::Storage::commit_swap`].
//!
//! Here: the ghosts, the start state of a quarantined task, and the
//! predicates of the properties.

use batchlease_api::{BatchTask, BatchTaskStatus, LeaseOutcome, LeasePhase, TaskMode, TaskPhase};

use crate::api_server::{decode, encode};
use crate::worker::Worker;
use crate::{Cluster, State, phase};

/// Ghosts of speculative mode.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq)]
pub struct SpecGhosts {
    /// Side effects of rounds in the world: run, and neither undone nor
    /// part of a commit that was refused.
    pub effects: u8,
    /// A status write that counted an abort of a speculative attempt also
    /// changed `attempts` (an abort of a quarantined attempt spends a
    /// retry on purpose: it must not spin for ever).
    pub abort_spent_retry: bool,
}

/// The last task as if it had aborted once already: quarantined
/// (`effectiveMode` Exclusive, `aborts` 1), its backoff over.
pub(crate) fn quarantine_last(s: &mut State) {
    let Some(last) = s.api.tasks.len().checked_sub(1) else {
        return;
    };
    let mut t = s.api.task(last);
    let st = t.status.get_or_insert_with(Default::default);
    st.aborts = 1;
    st.effective_mode = Some(TaskMode::Exclusive);
    s.api.tasks[last] = encode(&t);
}

/// Ghosts of task `i`'s status write `new` replacing `old`.
pub(crate) fn status_written(s: &mut State, old: Option<&BatchTaskStatus>, new: &BatchTaskStatus) {
    let (aborts, attempts) = old.map_or((0, 0), |o| (o.aborts, o.attempts));
    let speculative = old.and_then(|o| o.effective_mode) != Some(TaskMode::Exclusive);
    if speculative && new.aborts > aborts && new.attempts != attempts {
        s.spec.abort_spent_retry = true;
    }
}

/// Whether task `t` is a speculative task running Exclusive.
fn quarantined(t: &BatchTask) -> bool {
    t.spec.mode == TaskMode::Speculative
        && t.status.as_ref().and_then(|st| st.effective_mode) == Some(TaskMode::Exclusive)
}

impl Cluster {
    /// The key counts the tasks whose commit stuck (in a speculative
    /// configuration: every commit is a round's).
    pub(crate) fn key_counts_commits(&self, s: &State) -> bool {
        !self.cfg.speculative
            || usize::from(s.pg.key.value)
                == s.pg.rows.iter().filter(|r| r.committed.is_some()).count()
    }

    /// Each side effect of a round is undone once unless its round
    /// committed: the ones in the world are the committed ones and those
    /// of rounds still running.
    pub(crate) fn effects_balanced(&self, s: &State) -> bool {
        if !self.cfg.speculative {
            return true;
        }
        let committed = s.pg.rows.iter().filter(|r| r.committed.is_some()).count();
        let running = s
            .workers
            .iter()
            .filter(
                |w| matches!(w, Worker::Holding(a) if a.round.as_ref().is_some_and(|r| r.effect)),
            )
            .count();
        usize::from(s.spec.effects) == committed + running
    }

    /// A pass of a speculative task, run now, decides `LockBlocked`: a
    /// live attempt of another task holds a lock of its resources. (The
    /// pass is run on a copy: a ghost recording such decisions would
    /// double the states.)
    pub(crate) fn held_back(&self, s: &State) -> bool {
        if !self.cfg.speculative || !self.cfg.resource || s.api.locks.is_empty() {
            return false;
        }
        let Some(cached) = &s.op.tasks else {
            return false;
        };
        (0..cached.len())
            .filter(|i| !s.op.pending.contains_key(i) && !cached[*i].is_empty())
            .filter(|i| {
                let t: BatchTask = decode(&cached[*i]);
                t.status.and_then(|st| st.phase) == Some(TaskPhase::Pending)
            })
            .any(|i| self.reconcile(&mut s.clone(), i))
    }
}

/// A worker completed a lease `Aborted`.
pub(crate) fn aborted(s: &State) -> bool {
    s.api.all_leases().iter().any(|l| {
        l.status.as_ref().and_then(|st| st.outcome) == Some(LeaseOutcome::Aborted)
            && phase(l) == Some(LeasePhase::Completed)
    })
}

/// Some task was quarantined by an abort it settled (its history records
/// one; a task started quarantined has none).
pub(crate) fn quarantined_by_abort(s: &State) -> bool {
    (0..s.api.tasks.len()).any(|i| {
        let t = s.api.task(i);
        quarantined(&t)
            && t.status
                .is_some_and(|st| st.history.iter().any(|h| h.outcome == "Aborted"))
    })
}

/// Some quarantined task succeeded.
pub(crate) fn quarantined_succeeded(s: &State) -> bool {
    (0..s.api.tasks.len()).any(|i| {
        let t = s.api.task(i);
        quarantined(&t) && t.status.and_then(|st| st.phase) == Some(TaskPhase::Succeeded)
    })
}

/// A worker's attempt committed in the round it retried in place.
pub(crate) fn won_in_place(s: &State) -> bool {
    s.workers.iter().any(|w| {
        matches!(w, Worker::Holding(a) if a.committed && a.round.as_ref().is_some_and(|r| r.retried))
    })
}
