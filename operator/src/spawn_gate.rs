//! Which spawned children may run (issue 22, point 5): a child created
//! after its parent ended never does.
//!
//! `ctx.spawn` checks the attempt's fence and then creates the child; a
//! worker paused between the two sends the create when it resumes, maybe
//! long after its lease was released (a cancel) or expired. A retried
//! parent makes such a late create harmless (its successor creates, or
//! finds, the very same child), but after the parent's *last* attempt —
//! `Cancelled`, or `Succeeded`/`DeadLettered` with the child since
//! deleted, or a non-deterministic sub-graph — nothing would: the child
//! would run work its parent was stopped from ordering.
//!
//! The rule: **a child is admitted only if it was created before its
//! parent's final status write.** The API server gives no order between
//! two objects' writes a client may rely on, so the order is established
//! by two reads, each made after the fact it orders:
//!
//! - **the child's first pass** (it has no phase yet) reads its parent
//!   directly (a quorum GET, never the cache). Not final: the child
//!   existed before that read, so before any final write of the parent —
//!   admitted, and its first status write records it (a task with a phase
//!   was admitted). Final: [`Admission::Refused`], and the child is written
//!   `Rejected` with condition `SpawnRefused`, so it is never issued.
//! - **the parent's final write** waits until every child a direct list
//!   (label [`LABEL_PARENT`], controlled by the parent's UID) finds has a
//!   phase ([`unadmitted`]). A child created while the parent's attempt
//!   was live is on that list (the list is made after the operator saw the
//!   attempt end), so it is admitted before the parent ends, however late
//!   the operator first looks at it — a follow-up child of a `Succeeded`
//!   parent still runs. A child created after the list is refused or
//!   admitted by its own read, and either way was not created after the
//!   parent's final write.
//!
//! Both reads go to the API server, and admission is persisted in the
//! child's status before anything is issued, so neither a stale cache nor
//! a new leader changes the answer.

use batchlease_api::keys::{LABEL_PARENT, condition};
use batchlease_api::{BatchTask, BatchTaskStatus, TaskPhase};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;

use crate::status::{self, set_condition};

/// Reason of the `SpawnRefused` condition and of its Warning Event.
pub const PARENT_FINISHED: &str = "ParentFinished";

/// The parent a spawned task names: its controlling BatchTask owner
/// `(name, uid)`, if it also carries the [`LABEL_PARENT`] label (tasks
/// made by hand with an owner reference only are not spawned children).
pub fn parent_of(task: &BatchTask) -> Option<(&str, &str)> {
    if !task.labels().contains_key(LABEL_PARENT) {
        return None;
    }
    task.owner_references()
        .iter()
        .find(|o| o.controller == Some(true) && o.kind == "BatchTask")
        .map(|o| (o.name.as_str(), o.uid.as_str()))
}

/// Whether `task` still has to pass the gate: a spawned child without a
/// phase (one with a phase was admitted, or refused, already).
pub fn needs_admission(task: &BatchTask) -> bool {
    task.status.as_ref().and_then(|s| s.phase).is_none() && parent_of(task).is_some()
}

/// What a child's first pass decides, on its parent as just read.
#[derive(Debug, Clone, PartialEq)]
pub enum Admission {
    /// Not a spawned child, or one admitted already: decide as usual.
    NotGated,
    /// The parent had not ended when it was read: decide as usual (the
    /// first status write records the admission).
    Admitted,
    /// The parent had ended: write this status (`Rejected`, condition
    /// `SpawnRefused`) and never issue.
    Refused {
        status: Box<BatchTaskStatus>,
        message: String,
    },
    /// The parent is gone or going (absent, another incarnation, being
    /// deleted): garbage collection deletes the child, or, if the parent
    /// was deleted orphaning it, removes the owner reference — a change
    /// that brings the task back. Nothing is written meanwhile.
    ParentGone,
}

/// The gate for `child` given its parent as read directly from the API
/// server (`None`: not found). `wall`: for the refusal's timestamps.
pub fn admission(child: &BatchTask, parent: Option<&BatchTask>, wall: Timestamp) -> Admission {
    if !needs_admission(child) {
        return Admission::NotGated;
    }
    let Some((parent_name, parent_uid)) = parent_of(child) else {
        return Admission::NotGated;
    };
    let Some(parent) = parent.filter(|p| {
        p.uid().as_deref() == Some(parent_uid) && p.metadata.deletion_timestamp.is_none()
    }) else {
        return Admission::ParentGone;
    };
    let phase = parent.status.as_ref().and_then(|s| s.phase);
    match phase {
        Some(p) if p.is_terminal() => {
            let message = format!(
                "created after its parent {parent_name} ended {p:?}: a late create of a stopped attempt; it will not run (raise spec.redrive to run it anyway)"
            );
            Admission::Refused {
                status: Box::new(refused_status(child, &message, wall)),
                message,
            }
        }
        _ => Admission::Admitted,
    }
}

/// The first (and final) status of a refused child.
fn refused_status(child: &BatchTask, message: &str, wall: Timestamp) -> BatchTaskStatus {
    // Only a later raise of spec.redrive runs it.
    let mut st = status::first(child, TaskPhase::Rejected);
    st.completion_time = Some(Time(wall));
    set_condition(
        &mut st,
        child,
        wall,
        status::cond(condition::SPAWN_REFUSED, true, PARENT_FINISHED, message),
    );
    st
}

/// Whether writing `new` ends `task`: a non-final phase (or none) becomes
/// a final one. Such a write must wait for [`unadmitted`] children.
pub fn ends(task: &BatchTask, new: &BatchTaskStatus) -> bool {
    let old = task.status.as_ref().and_then(|s| s.phase);
    !old.is_some_and(TaskPhase::is_terminal) && new.phase.is_some_and(TaskPhase::is_terminal)
}

/// The children of `parent` among `listed` (a direct list by
/// [`LABEL_PARENT`]; the label value may be shortened, so the owner's UID
/// decides) that have not passed the gate yet: the parent's final write
/// waits for them.
pub fn unadmitted(parent: &BatchTask, listed: &[BatchTask]) -> Vec<String> {
    let Some(uid) = parent.uid() else {
        return Vec::new();
    };
    listed
        .iter()
        .filter(|c| parent_of(c).is_some_and(|(_, u)| u == uid))
        .filter(|c| c.metadata.deletion_timestamp.is_none() && needs_admission(c))
        .map(ResourceExt::name_any)
        .collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use batchlease_api::BatchTaskSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
    use std::collections::BTreeMap;

    fn task(name: &str, uid: &str, phase: Option<TaskPhase>) -> BatchTask {
        let mut t = BatchTask::new(name, BatchTaskSpec::for_queue("q"));
        t.metadata.uid = Some(uid.into());
        t.metadata.generation = Some(1);
        t.status = phase.map(|p| BatchTaskStatus {
            phase: Some(p),
            ..Default::default()
        });
        t
    }

    fn child_of(parent_uid: &str, label: bool, phase: Option<TaskPhase>) -> BatchTask {
        let mut c = task("p-0123456789", "child-uid", phase);
        if label {
            c.metadata.labels = Some(BTreeMap::from([(LABEL_PARENT.into(), "p".into())]));
        }
        c.metadata.owner_references = Some(vec![OwnerReference {
            api_version: "batchlease.dev/v1alpha1".into(),
            kind: "BatchTask".into(),
            name: "p".into(),
            uid: parent_uid.into(),
            controller: Some(true),
            block_owner_deletion: Some(false),
        }]);
        c
    }

    fn verdict(a: &Admission) -> &'static str {
        match a {
            Admission::NotGated => "not gated",
            Admission::Admitted => "admitted",
            Admission::Refused { .. } => "refused",
            Admission::ParentGone => "parent gone",
        }
    }

    #[test]
    fn a_child_is_admitted_only_while_its_parent_has_not_ended() {
        let wall = Timestamp::from_second(1_800_000_000).unwrap();
        let mut deleting = task("p", "p-uid", Some(TaskPhase::Running));
        deleting.metadata.deletion_timestamp = Some(Time(wall));
        let parent = |phase| task("p", "p-uid", phase);
        let cases: Vec<(&str, BatchTask, Option<BatchTask>, &str)> = vec![
            (
                "parent running",
                child_of("p-uid", true, None),
                Some(parent(Some(TaskPhase::Running))),
                "admitted",
            ),
            (
                "parent not initialized yet",
                child_of("p-uid", true, None),
                Some(parent(None)),
                "admitted",
            ),
            (
                "parent pending (a retry between attempts)",
                child_of("p-uid", true, None),
                Some(parent(Some(TaskPhase::Pending))),
                "admitted",
            ),
            (
                "parent cancelled",
                child_of("p-uid", true, None),
                Some(parent(Some(TaskPhase::Cancelled))),
                "refused",
            ),
            (
                "parent succeeded",
                child_of("p-uid", true, None),
                Some(parent(Some(TaskPhase::Succeeded))),
                "refused",
            ),
            (
                "parent dead-lettered",
                child_of("p-uid", true, None),
                Some(parent(Some(TaskPhase::DeadLettered))),
                "refused",
            ),
            (
                "parent rejected",
                child_of("p-uid", true, None),
                Some(parent(Some(TaskPhase::Rejected))),
                "refused",
            ),
            (
                "admitted before: has a phase",
                child_of("p-uid", true, Some(TaskPhase::Pending)),
                Some(parent(Some(TaskPhase::Cancelled))),
                "not gated",
            ),
            (
                "no parent label: not a spawned child",
                child_of("p-uid", false, None),
                Some(parent(Some(TaskPhase::Cancelled))),
                "not gated",
            ),
            (
                "parent not found",
                child_of("p-uid", true, None),
                None,
                "parent gone",
            ),
            (
                "parent of that name is another incarnation",
                child_of("old-uid", true, None),
                Some(parent(Some(TaskPhase::Running))),
                "parent gone",
            ),
            (
                "parent being deleted",
                child_of("p-uid", true, None),
                Some(deleting),
                "parent gone",
            ),
        ];
        for (what, child, parent, want) in cases {
            assert_eq!(
                verdict(&admission(&child, parent.as_ref(), wall)),
                want,
                "{what}"
            );
        }
    }

    #[test]
    fn a_refused_child_is_rejected_for_good_and_says_why() {
        let wall = Timestamp::from_second(1_800_000_000).unwrap();
        let mut child = child_of("p-uid", true, None);
        child.spec.redrive = 2;
        let parent = task("p", "p-uid", Some(TaskPhase::Cancelled));
        let Admission::Refused { status, message } = admission(&child, Some(&parent), wall) else {
            panic!("not refused");
        };
        assert_eq!(status.phase, Some(TaskPhase::Rejected));
        assert_eq!(status.fencing_token, 0, "never issued");
        assert_eq!(status.observed_redrive, 2, "only a later raise redrives");
        assert_eq!(status.completion_time, Some(Time(wall)));
        let c = &status.conditions[0];
        assert_eq!(
            (c.type_.as_str(), c.status.as_str(), c.reason.as_str()),
            (condition::SPAWN_REFUSED, "True", PARENT_FINISHED)
        );
        assert!(message.contains("parent p ended Cancelled"), "{message}");
        assert_eq!(c.message, message);
    }

    #[test]
    fn a_parent_ends_only_once_its_listed_children_passed_the_gate() {
        let parent = task("p", "p-uid", Some(TaskPhase::Running));
        let mut other = child_of("other-uid", true, None);
        other.metadata.name = Some("p-other".into());
        let mut going = child_of("p-uid", true, None);
        going.metadata.name = Some("p-going".into());
        going.metadata.deletion_timestamp = Some(Time(Timestamp::UNIX_EPOCH));
        let listed = vec![
            child_of("p-uid", true, None),
            child_of("p-uid", true, Some(TaskPhase::Pending)),
            other,
            going,
        ];
        assert_eq!(unadmitted(&parent, &listed), vec!["p-0123456789"]);
        assert!(unadmitted(&parent, &listed[1..]).is_empty());

        let done = |p| BatchTaskStatus {
            phase: Some(p),
            ..Default::default()
        };
        let cases = [
            (Some(TaskPhase::Running), TaskPhase::Succeeded, true),
            (Some(TaskPhase::Ready), TaskPhase::Cancelled, true),
            (Some(TaskPhase::Pending), TaskPhase::DeadLettered, true),
            (None, TaskPhase::Rejected, true),
            (Some(TaskPhase::Running), TaskPhase::Pending, false),
            (Some(TaskPhase::Succeeded), TaskPhase::Succeeded, false),
            (Some(TaskPhase::DeadLettered), TaskPhase::Pending, false),
        ];
        for (from, to, want) in cases {
            assert_eq!(
                ends(&task("p", "p-uid", from), &done(to)),
                want,
                "{from:?} → {to:?}"
            );
        }
    }
}
