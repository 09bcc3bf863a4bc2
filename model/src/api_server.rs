//! The API server of the model: a linearizable store of one BatchTask and
//! its TaskLeases, with `resourceVersion` compare-and-swap and the CRDs'
//! rules that matter to the protocol (final leases frozen, a held lease
//! never offered again, holder set once, Completed only from Held, phase
//! never removed, the task's token never decreasing).
//!
//! Objects are kept as their JSON text: real `BatchTask`/`TaskLease`
//! values go in and come out (so the operator's real `decide` reads what
//! it reads in production), and the state stays hashable for the checker.

use std::collections::BTreeMap;

use batchlease_api::{BatchTask, LeasePhase, TaskLease};
use kube::ResourceExt;

/// Why a write was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// 409: the object changed since the writer's copy.
    Conflict,
    /// 404.
    NotFound,
    /// 409 on create.
    AlreadyExists,
    /// 422: a CRD rule refused the new object.
    Invalid,
}

/// The store.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct ApiServer {
    /// The last resourceVersion handed out.
    pub rv: u32,
    pub task: String,
    pub leases: BTreeMap<String, String>,
    /// Lease UIDs handed out.
    pub uids: u32,
}

pub fn decode<T: serde::de::DeserializeOwned>(json: &str) -> T {
    // The model only ever stores what it encoded itself.
    serde_json::from_str(json).unwrap_or_else(|e| panic!("model state: {e}: {json}"))
}

pub fn encode<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_else(|e| panic!("model state: {e}"))
}

fn phase(l: &TaskLease) -> Option<LeasePhase> {
    l.status.as_ref().and_then(|s| s.phase)
}

/// The CRD rules on a lease update (see `api/src/task_lease.rs`).
fn lease_update_allowed(old: &TaskLease, new: &TaskLease) -> bool {
    let (op, np) = (phase(old), phase(new));
    if op.is_some_and(LeasePhase::is_terminal) {
        return old.spec == new.spec && old.status == new.status;
    }
    if op == Some(LeasePhase::Held) && np == Some(LeasePhase::Offered) {
        return false;
    }
    if op.is_some() && np.is_none() {
        return false;
    }
    if np == Some(LeasePhase::Completed)
        && !matches!(op, Some(LeasePhase::Held | LeasePhase::Completed))
    {
        return false;
    }
    let old_holder = old.spec.holder_identity.as_deref().unwrap_or("");
    if !old_holder.is_empty() && new.spec.holder_identity.as_deref() != Some(old_holder) {
        return false;
    }
    if matches!(np, Some(LeasePhase::Held | LeasePhase::Completed))
        && new.spec.holder_identity.as_deref().unwrap_or("").is_empty()
    {
        return false;
    }
    old.spec.fencing_token == new.spec.fencing_token && old.spec.task_uid == new.spec.task_uid
}

impl ApiServer {
    pub fn new(task: &BatchTask) -> Self {
        let mut t = task.clone();
        t.metadata.resource_version = Some("1".into());
        Self {
            rv: 1,
            task: encode(&t),
            leases: BTreeMap::new(),
            uids: 0,
        }
    }

    pub fn task(&self) -> BatchTask {
        decode(&self.task)
    }

    pub fn lease(&self, name: &str) -> Option<TaskLease> {
        self.leases.get(name).map(|l| decode(l))
    }

    pub fn all_leases(&self) -> Vec<TaskLease> {
        self.leases.values().map(|l| decode(l)).collect()
    }

    fn next_rv(&mut self) -> String {
        self.rv += 1;
        self.rv.to_string()
    }

    /// `PUT …/status` carrying the writer's resourceVersion.
    pub fn replace_status(&mut self, new: &BatchTask) -> Result<(), Refused> {
        let cur = self.task();
        if cur.metadata.resource_version != new.metadata.resource_version {
            return Err(Refused::Conflict);
        }
        let old_token = cur.status.as_ref().map_or(0, |s| s.fencing_token);
        let new_token = new.status.as_ref().map_or(0, |s| s.fencing_token);
        if new_token < old_token {
            return Err(Refused::Invalid);
        }
        let mut stored = cur;
        stored.status = new.status.clone();
        stored.metadata.resource_version = Some(self.next_rv());
        self.task = encode(&stored);
        Ok(())
    }

    /// `POST` of a lease.
    pub fn create_lease(&mut self, new: &TaskLease) -> Result<TaskLease, Refused> {
        let name = new.name_any();
        if self.leases.contains_key(&name) {
            return Err(Refused::AlreadyExists);
        }
        let mut stored = new.clone();
        self.uids += 1;
        stored.metadata.uid = Some(format!("lease-uid-{}", self.uids));
        stored.metadata.resource_version = Some(self.next_rv());
        self.leases.insert(name, encode(&stored));
        Ok(stored)
    }

    /// `PUT` of a lease carrying the writer's resourceVersion.
    pub fn replace_lease(&mut self, new: &TaskLease) -> Result<TaskLease, Refused> {
        let name = new.name_any();
        let cur = self.lease(&name).ok_or(Refused::NotFound)?;
        if cur.metadata.resource_version != new.metadata.resource_version {
            return Err(Refused::Conflict);
        }
        if !lease_update_allowed(&cur, new) {
            return Err(Refused::Invalid);
        }
        let mut stored = new.clone();
        stored.metadata.uid = cur.metadata.uid;
        stored.metadata.resource_version = Some(self.next_rv());
        self.leases.insert(name, encode(&stored));
        Ok(stored)
    }

    /// `DELETE` of a lease, with a resourceVersion precondition if given.
    pub fn delete_lease(&mut self, name: &str, rv: Option<&str>) -> Result<(), Refused> {
        let cur = self.lease(name).ok_or(Refused::NotFound)?;
        if rv.is_some() && cur.metadata.resource_version.as_deref() != rv {
            return Err(Refused::Conflict);
        }
        self.leases.remove(name);
        self.rv += 1;
        Ok(())
    }
}
