//! The operator: two caches that lag the API server, the reconciler's
//! pass around the real `decide()` (mirrored from
//! `operator/src/reconcile.rs`), and its requests, which land in a
//! separate step.

use std::collections::BTreeMap;
use std::sync::Arc;

use batchlease_api::{BatchTask, LeasePhase, TaskLease, check_current};
use batchlease_operator::decide::{Decision, Input, Lookup, decide};
use batchlease_operator::deps::Readiness;
use batchlease_operator::lease_build::offered_lease;
use batchlease_operator::observe::Seen;
use kube::ResourceExt;

use crate::api_server::{decode, encode};
use crate::{Cluster, RepairRule, State, TICK_SECONDS, phase, wall};

/// What the operator holds in memory; all of it is lost in a crash.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq)]
pub struct Operator {
    /// Its cache of the task and of the leases (two watches: they lag
    /// independently).
    pub task: Option<String>,
    pub leases: BTreeMap<String, String>,
    pub seen: BTreeMap<String, Seen>,
    /// Lease creates sent, and when (reconcile.rs's expectations).
    pub expect: BTreeMap<String, u8>,
    /// The write this pass decided, not applied yet (a request on its
    /// way): the next reconcile waits for it, a crash leaves it in flight.
    pub pending: Option<Write>,
    /// The last request the API server refused: deciding it again before
    /// the caches change is no step (a retry loop is not progress).
    pub refused: Option<Write>,
}

/// What became of a request.
#[derive(Debug, Default)]
pub(crate) struct Sent {
    pub(crate) applied: bool,
    /// An issue's lease create, after its status write.
    pub(crate) next: Option<Write>,
    pub(crate) already_exists: bool,
}

/// One request of the operator to the API server.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub enum Write {
    /// `PUT …/status` (task JSON); an issue's lease create follows it.
    Status {
        task: String,
        then_create: Option<String>,
    },
    /// `PUT` of a lease (expiry).
    Lease(String),
    /// `POST` of a lease.
    Create(String),
    /// `DELETE` of a lease with a resourceVersion precondition.
    Delete(String, Option<String>),
}

impl Cluster {
    pub(crate) fn reconcile(&self, s: &mut State) {
        let Some(task_json) = s.op.task.clone() else {
            return;
        };
        let task: BatchTask = decode(&task_json);
        let uid = task.uid().unwrap_or_default();
        let mut leases: Vec<Arc<TaskLease>> =
            s.op.leases
                .values()
                .map(|l| Arc::new(decode::<TaskLease>(l)))
                .filter(|l| l.spec.task_uid == uid)
                .collect();
        let current = task.status.as_ref().and_then(|st| st.current_lease.clone());
        let observation = current
            .as_deref()
            .and_then(|c| s.op.seen.get(c))
            .map(|seen| seen.observation);
        let mut lookup = Lookup::CacheOnly;
        if let Some(cur) = current.as_deref() {
            if leases.iter().any(|l| l.name_any() == cur) {
                s.op.expect.remove(cur);
            } else if s
                .op
                .expect
                .get(cur)
                .is_some_and(|at| u64::from(s.now.saturating_sub(*at)) * TICK_SECONDS < 10)
            {
                lookup = Lookup::Creating;
            }
        }
        let decide_with = |leases: &[Arc<TaskLease>], lookup| {
            decide(&Input {
                task: &task,
                leases,
                observation,
                now: self.instant(s.now),
                wall: wall(s.now, 0),
                jitter: 0.5,
                lookup,
                deps: Readiness::Ready,
                locks: None,
            })
        };
        let mut decision = decide_with(&leases, lookup);
        if let Decision::LookUpLease(name) = &decision {
            let lookup = match s.api.lease(name) {
                Some(l) if check_current(&task, &l).is_ok() => {
                    leases.push(Arc::new(l));
                    Lookup::CacheOnly
                }
                Some(_) => Lookup::Occupied,
                None => Lookup::Absent,
            };
            decision = decide_with(&leases, lookup);
        }
        s.op.pending = match decision {
            Decision::Wait(_) | Decision::LookUpLease(_) => None,
            // The model's task needs no resources: decide never asks.
            Decision::FetchLocks(_)
            | Decision::TakeLock(_)
            | Decision::ReleaseLocks { .. }
            | Decision::LockBlocked { .. } => None,
            Decision::WriteStatus { status, .. } => {
                let mut t = task.clone();
                t.status = Some(*status);
                Some(Write::Status {
                    task: encode(&t),
                    then_create: None,
                })
            }
            Decision::Issue { status, lease, .. } => {
                let mut t = task.clone();
                t.status = Some(*status);
                Some(Write::Status {
                    task: encode(&t),
                    then_create: Some(encode(&*lease)),
                })
            }
            Decision::RetireToken(tombstone) => {
                s.op.expect.insert(tombstone.name_any(), s.now);
                Some(Write::Create(match self.cfg.repair {
                    RepairRule::RetireToken => encode(&*tombstone),
                    RepairRule::SameToken => {
                        let token = task.status.as_ref().map_or(0, |st| st.fencing_token);
                        encode(&offered_lease(&task, token))
                    }
                }))
            }
            Decision::Expire { lease, .. } => Some(Write::Lease(encode(&*lease))),
            // One delete per pass is enough for the model (it keeps few leases).
            Decision::Prune { victims, .. } => victims
                .into_iter()
                .next()
                .map(|(name, rv)| Write::Delete(name, rv)),
        };
        if s.op.pending.is_some() && s.op.pending == s.op.refused {
            s.op.pending = None;
        }
    }

    /// Applies one operator request.
    pub(crate) fn send(&self, s: &mut State, write: Write) -> Sent {
        let mut sent = Sent::default();
        match write {
            Write::Status { task, then_create } => {
                let t: BatchTask = decode(&task);
                if s.api.replace_status(&t).is_ok() {
                    sent.applied = true;
                    sent.next = then_create.map(Write::Create);
                }
            }
            Write::Lease(l) => {
                if let Ok(stored) = s.api.replace_lease(&decode(&l)) {
                    sent.applied = true;
                    if phase(&stored) == Some(LeasePhase::Expired) {
                        s.expired.push(stored.spec.fencing_token);
                    }
                }
            }
            Write::Create(l) => {
                let l: TaskLease = decode(&l);
                let tombstone =
                    l.status.as_ref().and_then(|st| st.reason.as_deref()) == Some("TokenRetired");
                match s.api.create_lease(&l) {
                    Ok(_) if tombstone => s.tombstones += 1,
                    Ok(_) => s.created.push(l.spec.fencing_token),
                    Err(_) => sent.already_exists = true,
                }
                sent.applied = !sent.already_exists;
            }
            Write::Delete(name, rv) => {
                sent.applied = s.api.delete_lease(&name, rv.as_deref()).is_ok();
            }
        }
        sent
    }
}
