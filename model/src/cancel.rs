//! Cancellation (design §9, `spec.cancel`): a user sets it at any moment;
//! the operator releases the task's offered or held lease (a CAS that a
//! claim, a renewal or a completion may beat), and writes `Cancelled`
//! only once no attempt can still be running (a TTL after the released
//! holder's last observed renewal, the expiry rule). The properties: no
//! lease is created for a cancelled task, `Cancelled` is final, no lease
//! of it is live, and nothing an attempt writes to storage lands after it.

use batchlease_api::{BatchTaskStatus, LeasePhase, TaskPhase};
use stateright::Property;

use crate::worker::Worker;
use crate::{Cluster, State, phase};

/// When the operator ends a task whose held lease it released.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CancelRule {
    /// Today's rule (`decide`): a TTL after the holder's last renewal was
    /// observed, when its kill switch has surely fired.
    WaitTtl,
    /// At once (a mutation: the checker must find the holder's write
    /// landing after `Cancelled`).
    EndAtRelease,
    /// A lost lease's holder timed by the task's current
    /// `spec.leaseDurationSeconds` rather than the TTL the lease was issued
    /// with (the rule before issue 22; a mutation: with
    /// [`crate::Config::ttl_edit`] the checker must find the lost holder's
    /// write landing after `Cancelled`).
    SpecTtl,
}

/// What the checker remembers of cancellations.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq)]
pub struct CancelGhosts {
    /// `spec.cancel` was set while a worker held the task's lease.
    pub while_held: bool,
    /// A lease (not a tombstone) was created for a task already Cancelled.
    pub issued_after: bool,
    /// A status write moved a task out of Cancelled.
    pub left_cancelled: bool,
    /// Storage accepted an attempt's write while its task was Cancelled.
    pub write_after: bool,
    /// A task whose lease was held when cancelled ended Cancelled.
    pub held_then_cancelled: bool,
}

fn cancelled(st: Option<&BatchTaskStatus>) -> bool {
    st.and_then(|s| s.phase) == Some(TaskPhase::Cancelled)
}

/// A user set `spec.cancel` on task `i`.
pub(crate) fn requested(s: &mut State, i: usize) {
    let held = s
        .workers
        .iter()
        .any(|w| matches!(w, Worker::Holding(a) if a.task == i));
    if held {
        s.cancel.while_held = true;
    }
}

/// A status write landed.
pub(crate) fn status_written(s: &mut State, old: Option<&BatchTaskStatus>, new: &BatchTaskStatus) {
    if cancelled(old) && !cancelled(Some(new)) {
        s.cancel.left_cancelled = true;
    }
    if !cancelled(old) && cancelled(Some(new)) && s.cancel.while_held {
        s.cancel.held_then_cancelled = true;
    }
}

/// A lease of task `i` was created.
pub(crate) fn lease_created(s: &mut State, i: usize) {
    if cancelled(s.api.task(i).status.as_ref()) {
        s.cancel.issued_after = true;
    }
}

/// Storage accepted a write of an attempt of task `i`.
pub(crate) fn storage_write(s: &mut State, i: usize) {
    if cancelled(s.api.task(i).status.as_ref()) {
        s.cancel.write_after = true;
    }
}

/// No lease of a Cancelled task is Offered or Held.
fn none_live(s: &State) -> bool {
    let leases = s.api.all_leases();
    (0..s.api.tasks.len()).all(|i| {
        let t = s.api.task(i);
        !cancelled(t.status.as_ref())
            || leases.iter().all(|l| {
                l.spec.task_name != crate::task_name(i)
                    || !matches!(phase(l), Some(LeasePhase::Offered | LeasePhase::Held))
            })
    })
}

pub(crate) fn properties() -> Vec<Property<Cluster>> {
    vec![
        Property::always(
            "no lease is created for a Cancelled task",
            |_, s: &State| !s.cancel.issued_after,
        ),
        Property::always("Cancelled is final", |_, s: &State| {
            !s.cancel.left_cancelled
        }),
        Property::always("no lease of a Cancelled task is live", |_, s: &State| {
            none_live(s)
        }),
        Property::always(
            "no storage write is accepted after the task is Cancelled",
            |_, s: &State| !s.cancel.write_after,
        ),
        Property::sometimes("a task is cancelled", |_, s: &State| {
            (0..s.api.tasks.len()).any(|i| cancelled(s.api.task(i).status.as_ref()))
        }),
        Property::sometimes(
            "a task cancelled while held ends Cancelled",
            |_, s: &State| s.cancel.held_then_cancelled,
        ),
    ]
}
