//! What the checker checks in every state it reaches: the safety
//! properties (`always`) and the coverage properties (`sometimes`) that
//! show the interesting situations are reached at all.

use batchlease_api::{LeasePhase, TaskPhase};
use stateright::Property;

use crate::worker::Worker;
use crate::{Cluster, State, locks, phase, speculate};

/// Task `i`'s phase as stored.
fn task_phase(s: &State, i: usize) -> Option<TaskPhase> {
    s.api.task(i).status.and_then(|st| st.phase)
}

impl Cluster {
    /// Whether a worker with a drifted clock is alive (`alive`) where the
    /// same attempt with a true clock would not be, or the reverse.
    fn drift_changes(&self, s: &State, alive: bool) -> bool {
        s.workers.iter().any(|w| match w {
            Worker::Holding(a) if a.rate != 100 => {
                let mut true_clock = a.clone();
                true_clock.rate = 100;
                self.alive(a, s.now) == alive && self.alive(&true_clock, s.now) != alive
            }
            _ => false,
        })
    }

    pub(crate) fn safety(&self) -> Vec<Property<Self>> {
        let mut p = self.lease_properties();
        p.extend(Self::lock_properties());
        p.extend(Self::speculative_properties());
        p.extend(crate::cancel::properties());
        p.extend(crate::spawn::properties());
        p.extend(crate::fleet::properties());
        p.extend(crate::offers::properties());
        p.extend(crate::bound::properties());
        p
    }

    fn lease_properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(
                "at most one attempt's effect is committed",
                |_, s: &State| s.pg.rows.iter().all(|r| r.accepted.len() <= 1),
            ),
            Property::always("a token is used by at most one lease", |_, s: &State| {
                s.created.iter().all(|created| {
                    let mut seen = created.clone();
                    seen.sort_unstable();
                    seen.windows(2).all(|w| w[0] != w[1])
                })
            }),
            Property::always(
                "tokens of created leases strictly increase",
                |_, s: &State| s.created.iter().all(|c| c.windows(2).all(|w| w[0] < w[1])),
            ),
            Property::always("never two Held leases", |_, s: &State| {
                let leases = s.api.all_leases();
                (0..s.api.tasks.len()).all(|i| {
                    let name = crate::task_name(i);
                    leases
                        .iter()
                        .filter(|l| l.spec.task_name == name && phase(l) == Some(LeasePhase::Held))
                        .count()
                        <= 1
                })
            }),
            Property::always(
                "no accepted storage write carries a token below a registered one",
                |_, s: &State| !s.pg.stale_write_accepted,
            ),
            // The property that needs the kill switch: a worker stops (and
            // its writes carry a deadline) before the operator can expire
            // its lease, so nothing it writes lands after the expiry.
            Property::always(
                "no storage write is accepted for an attempt whose lease expired",
                |_, s: &State| !s.write_after_expiry,
            ),
            Property::sometimes("the task succeeds", |_, s: &State| {
                task_phase(s, 0) == Some(TaskPhase::Succeeded)
            }),
            // Coverage of the lost-answer and crash bounds: they reach an
            // expiry after the fault, where "no storage write after
            // expiry" can fail at all.
            Property::sometimes("an expiry follows a lost claim answer", |_, s: &State| {
                s.expired_after_lost_claim
            }),
            Property::sometimes("an expiry follows a lost renewal answer", |_, s: &State| {
                s.expired_after_lost_renewal
            }),
            Property::sometimes("an expiry follows an operator crash", |_, s: &State| {
                s.expired_after_crash
            }),
            // Coverage of the drift bound: a drifted clock changes whether
            // a worker's kill switch lets it write, both ways.
            Property::sometimes(
                "a drifted worker is alive where a true clock says dead",
                |m: &Cluster, s: &State| m.drift_changes(s, true),
            ),
            Property::sometimes(
                "a drifted worker is dead where a true clock says alive",
                |m: &Cluster, s: &State| m.drift_changes(s, false),
            ),
            // Coverage: the situations the safety properties are about are
            // reached (asserted by the CI bounds that should reach them).
            Property::sometimes("two workers hold attempts at once", |_, s: &State| {
                s.workers
                    .iter()
                    .filter(|w| matches!(w, Worker::Holding(_)))
                    .count()
                    >= 2
            }),
            Property::sometimes(
                "an expired lease's task is offered again",
                |_, s: &State| {
                    s.expired
                        .iter()
                        .zip(&s.created)
                        .any(|(e, c)| !e.is_empty() && c.len() >= 2)
                },
            ),
            Property::sometimes("storage refuses a stale attempt", |_, s: &State| {
                s.fenced_by_storage
            }),
            Property::sometimes("a crashed operator's request lands late", |_, s: &State| {
                s.late_landed
            }),
            Property::sometimes("a tombstone retires a token", |_, s: &State| {
                s.tombstones > 0
            }),
        ]
    }

    /// Resource locks (design §5).
    fn lock_properties() -> Vec<Property<Self>> {
        vec![
            Property::always(
                "never two live leases carry a token for one resource",
                |_, s: &State| s.api.locks.is_empty() || locks::one_live_holder(s),
            ),
            Property::always(
                "resource tokens of created leases strictly increase",
                |_, s: &State| !s.locks.created_out_of_order,
            ),
            // A restatement of the resource rows' rule: it guards a change
            // of `storage.rs`.
            Property::always(
                "no accepted commit carries a resource token below the stored one",
                |_, s: &State| !s.pg.stale_resource_write_accepted,
            ),
            // The zombie case: the lock passes to another task only once
            // the holder's lease ended — completed, or expired after its
            // kill switch fired.
            Property::always(
                "no storage write for a resource is accepted after its lock passed to another task",
                |_, s: &State| !s.locks.write_after_passed,
            ),
            Property::sometimes("every task succeeds", |_, s: &State| {
                (0..s.api.tasks.len()).all(|i| task_phase(s, i) == Some(TaskPhase::Succeeded))
            }),
            Property::sometimes("a lock acquisition is blocked", |_, s: &State| {
                locks::contended(s)
            }),
            Property::sometimes(
                "a lock passes to another task from an attempt whose lease expired",
                |_, s: &State| s.locks.passed_after_expiry,
            ),
            Property::sometimes("storage refuses a stale resource token", |_, s: &State| {
                s.locks.stale_resource_refused
            }),
            Property::sometimes(
                "only a resource row refuses a stale attempt",
                |_, s: &State| s.locks.fenced_by_resource,
            ),
            Property::sometimes("a younger task takes a lock first", |_, s: &State| {
                s.locks.younger_first
            }),
            Property::sometimes(
                "an attempt writes after its task took its lock again",
                |_, s: &State| s.locks.write_after_retaken,
            ),
            Property::sometimes(
                "a task is deleted while its lease is held and it holds the lock",
                |_, s: &State| s.locks.deleted_holding,
            ),
            Property::sometimes(
                "a deleted task's lock passes to another task",
                |_, s: &State| s.locks.passed_from_deleted,
            ),
        ]
    }

    /// Speculative mode (design §6).
    fn speculative_properties() -> Vec<Property<Self>> {
        vec![
            // Nothing lost (a lost update), nothing doubled (a zombie's or
            // a second attempt's swap sticking).
            Property::always(
                "the key counts the tasks whose commit stuck",
                |m: &Cluster, s: &State| m.key_counts_commits(s),
            ),
            Property::always(
                "each write of the key sets the next version",
                |_, s: &State| !s.pg.key_version_not_next,
            ),
            Property::always("a speculative abort spends no retry", |_, s: &State| {
                !s.spec.abort_spent_retry
            }),
            Property::always(
                "a round's side effect stays only if it committed",
                |m: &Cluster, s: &State| m.effects_balanced(s),
            ),
            Property::sometimes(
                "the fence refuses a round whose swap would win",
                |_, s: &State| s.pg.refused_a_winning_swap,
            ),
            Property::sometimes("an attempt aborts", |m: &Cluster, s: &State| {
                m.cfg.speculative && speculate::aborted(s)
            }),
            Property::sometimes("an abort quarantines a task", |m: &Cluster, s: &State| {
                m.cfg.speculative && speculate::quarantined_by_abort(s)
            }),
            Property::sometimes("a quarantined task succeeds", |m: &Cluster, s: &State| {
                m.cfg.speculative && speculate::quarantined_succeeded(s)
            }),
            Property::sometimes(
                "a speculative task is held back by a live lock holder",
                |m: &Cluster, s: &State| m.held_back(s),
            ),
            Property::sometimes(
                "a quarantined attempt wins its swap in place",
                |_, s: &State| speculate::won_in_place(s),
            ),
        ]
    }
}
