//! Spawning (design §5, `ctx.spawn`; issue 22 point 5): an attempt of the
//! first task checks its fence and sends the create of its one child (the
//! sub-graph is deterministic: every attempt spawns the same name, so one
//! create per run is explored — a second meets AlreadyExists); the
//! create lands in a later step — any number of ticks later, after the
//! worker's kill switch, its lease's release or expiry, the parent's end
//! (a worker paused between the check and the create).
//!
//! The operator's side is the production gate
//! (`batchlease_operator::spawn_gate`): a child's first pass reads its
//! parent from the API server and is refused (written `Rejected`) if the
//! parent has ended; a parent's final status write waits while a child it
//! lists from the API server has not had its first pass. The properties:
//! no lease is created for a child created after its parent ended, and a
//! child created while its parent's attempt was live is never refused.

use std::collections::BTreeMap;

use batchlease_api::keys::{LABEL_PARENT, condition};
use batchlease_api::{BatchTask, BatchTaskSpec, BatchTaskStatus, LeasePhase, TaskPhase};
use batchlease_operator::spawn_gate::{self, Admission};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::ResourceExt;
use stateright::Property;

use crate::api_server::decode;
use crate::{Cluster, State, TTL_SECONDS, phase};

/// The queue of the spawned child: no worker serves it (the properties
/// are about its lease being created, not about running it).
pub const CHILD_QUEUE: &str = "q-children";

/// Which parts of the gate the operator runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SpawnRule {
    /// Today's rule: the child's first pass reads its parent, and a
    /// parent's end waits for its listed children's first pass.
    Gate,
    /// No gate (the behaviour before issue 22): a child is decided like
    /// any task. A mutation the checker must catch.
    Ungated,
    /// The child's read only: a parent ends without waiting for its
    /// children, so a child created while its parent ran but first looked
    /// at after the parent ended is refused. A mutation.
    ParentDoesNotWait,
}

/// A child's create on its way: sent by worker `worker` in the attempt
/// holding lease `lease`, after its fence check.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct InFlight {
    pub worker: usize,
    pub lease: String,
}

/// The creates on their way, and the checker's memory of the child.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq)]
pub struct SpawnGhosts {
    pub in_flight: Vec<InFlight>,
    /// The child was created while its parent's phase was final.
    pub late: bool,
    /// The child was created while the spawning attempt's lease was
    /// Offered or Held.
    pub while_live: bool,
    /// A lease was created for a child that was created late.
    pub issued_late: bool,
    /// The child was refused.
    pub refused: bool,
    /// The child got a phase other than the refusal.
    pub admitted: bool,
}

/// The child's index in the API server (after the configured tasks).
pub fn child_index(cluster: &Cluster) -> usize {
    cluster.cfg.tasks
}

fn child(cluster: &Cluster, parent: &BatchTask) -> BatchTask {
    let mut spec = BatchTaskSpec::for_queue(CHILD_QUEUE);
    spec.lease_duration_seconds = TTL_SECONDS;
    let mut t = BatchTask::new(&crate::task_name(child_index(cluster)), spec);
    t.metadata.namespace = Some("ns".into());
    t.metadata.uid = Some("child-uid".into());
    t.metadata.generation = Some(1);
    t.metadata.labels = Some(BTreeMap::from([(
        LABEL_PARENT.to_owned(),
        parent.name_any(),
    )]));
    t.metadata.owner_references = Some(vec![OwnerReference {
        api_version: "batchlease.dev/v1alpha1".into(),
        kind: "BatchTask".into(),
        name: parent.name_any(),
        uid: parent.uid().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: Some(false),
    }]);
    t
}

impl Cluster {
    /// Worker `w`'s attempt passed its fence check and sent the create.
    pub(crate) fn spawn_sent(s: &mut State, w: usize, lease: &str) {
        s.spawn.in_flight.push(InFlight {
            worker: w,
            lease: lease.to_owned(),
        });
    }

    /// Whether worker `w`'s attempt holding `lease` has a create on its
    /// way (its handler is still in `spawn`: it cannot complete).
    pub(crate) fn spawning(s: &State, w: usize, lease: &str) -> bool {
        s.spawn
            .in_flight
            .iter()
            .any(|f| f.worker == w && f.lease == lease)
    }

    /// Create `k` lands: the child is created, unless it exists (an
    /// earlier attempt's create: AlreadyExists, the same child).
    pub(crate) fn spawn_lands(&self, s: &mut State, k: usize) {
        if k >= s.spawn.in_flight.len() {
            return;
        }
        let f = s.spawn.in_flight.remove(k);
        if s.api.tasks.len() > child_index(self) {
            return;
        }
        let parent = s.api.task(0);
        let ended = parent
            .status
            .as_ref()
            .and_then(|st| st.phase)
            .is_some_and(TaskPhase::is_terminal);
        let live = s
            .api
            .lease(&f.lease)
            .is_some_and(|l| matches!(phase(&l), Some(LeasePhase::Offered | LeasePhase::Held)));
        s.spawn.late = ended;
        s.spawn.while_live = live;
        s.api.create_task(&child(self, &parent));
        s.created.push(Vec::new());
        s.expired.push(Vec::new());
    }

    /// The gate of the child's first pass (`spawned::admit`): `Some`
    /// status to write (refused), `None` to decide as usual, or
    /// `Err(())` to do nothing (parent gone).
    pub(crate) fn admission(
        &self,
        s: &State,
        task: &BatchTask,
    ) -> Result<Option<BatchTaskStatus>, ()> {
        if self.cfg.spawn_rule == SpawnRule::Ungated {
            return Ok(None);
        }
        // A direct read of the parent.
        let parent = spawn_gate::parent_of(task)
            .and_then(|(name, _)| s.api.task_index(name))
            .map(|i| s.api.task(i));
        match spawn_gate::admission(task, parent.as_ref(), self.wall(s.now, 0)) {
            Admission::NotGated | Admission::Admitted => Ok(None),
            Admission::Refused { status, .. } => Ok(Some(*status)),
            Admission::ParentGone => Err(()),
        }
    }

    /// Whether `task`'s write of `new` must wait (`spawned::children_pending`,
    /// on a direct list of the tasks).
    pub(crate) fn children_pending(
        &self,
        s: &State,
        task: &BatchTask,
        new: &BatchTaskStatus,
    ) -> bool {
        if self.cfg.spawn_rule != SpawnRule::Gate || !spawn_gate::ends(task, new) {
            return false;
        }
        let listed: Vec<BatchTask> = s.api.tasks.iter().map(|t| decode(t)).collect();
        !spawn_gate::unadmitted(task, &listed).is_empty()
    }
}

/// A status write of task `i` landed.
pub(crate) fn status_written(s: &mut State, cluster: &Cluster, i: usize, new: &BatchTaskStatus) {
    if i != child_index(cluster) {
        return;
    }
    let refused = new.phase == Some(TaskPhase::Rejected)
        && new
            .conditions
            .iter()
            .any(|c| c.type_ == condition::SPAWN_REFUSED && c.status == "True");
    if refused {
        s.spawn.refused = true;
    } else if new.phase.is_some() {
        s.spawn.admitted = true;
    }
}

/// A lease of task `i` was created.
pub(crate) fn lease_created(s: &mut State, cluster: &Cluster, i: usize) {
    if i == child_index(cluster) && s.spawn.late {
        s.spawn.issued_late = true;
    }
}

pub(crate) fn properties() -> Vec<Property<Cluster>> {
    vec![
        Property::always(
            "no lease is created for a child spawned after its parent ended",
            |_, s: &State| !s.spawn.issued_late,
        ),
        Property::always(
            "a child spawned while its parent's attempt was live is not refused",
            |_, s: &State| !(s.spawn.while_live && s.spawn.refused),
        ),
        Property::sometimes(
            "a child spawned after its parent ended is refused",
            |_, s: &State| s.spawn.late && s.spawn.refused,
        ),
        Property::sometimes(
            "a child spawned while its parent ran is admitted",
            |_, s: &State| s.spawn.while_live && s.spawn.admitted,
        ),
    ]
}
