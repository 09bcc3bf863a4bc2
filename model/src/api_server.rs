//! The API server of the model: a linearizable store of the BatchTasks
//! and their TaskLeases, with `resourceVersion` compare-and-swap and the CRDs'
//! rules that matter to the protocol (final leases frozen, a held lease
//! never offered again, holder set once, Completed only from Held, phase
//! never removed, the task's token never decreasing, `spec.renewal` turned
//! only from Lease to Worker by the claim; an addressed offer claimed only
//! by its addressee, and its address fixed from the claim on — the CEL
//! rules on `offeredTo`, see [`crate::offers`]), of the `coordination.k8s.io/v1`
//! Leases that lock resources, in the operator's namespace (create fails
//! if one exists, update is a compare-and-swap), and of the WorkerLeases
//! (spec and status subresource, one resourceVersion).
//!
//! Objects are kept as their JSON text: real `BatchTask`/`TaskLease`
//! values go in and come out (so the operator's real `decide` reads what
//! it reads in production), and the state stays hashable for the checker.

use std::collections::BTreeMap;

use batchlease_api::{BatchTask, LeasePhase, Renewal, TaskLease, WorkerLease};
use k8s_openapi::api::coordination::v1::Lease;
use kube::ResourceExt;

/// The operator's namespace, where the lock Leases live.
pub const LOCK_NAMESPACE: &str = "batchlease-system";

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
    /// Per object (`task/…`, `lease/…`, `lock/…`), the last
    /// resourceVersion handed out. Per object, not one counter for the
    /// whole store as etcd's revision is: clients only ever compare the
    /// versions of one object, so writes to different objects commute and
    /// their order does not make states distinct. Never reset, so an
    /// object created again under a name gets versions its earlier
    /// incarnation never had.
    pub versions: BTreeMap<String, u32>,
    /// The tasks, in creation order.
    pub tasks: Vec<String>,
    pub leases: BTreeMap<String, String>,
    /// Lock Leases by name (all in [`LOCK_NAMESPACE`]).
    pub locks: BTreeMap<String, String>,
    /// Indices of the tasks deleted (their last state stays in `tasks`, for
    /// the properties; the API serves them no more).
    pub deleted: std::collections::BTreeSet<usize>,
    /// The last state of each lease the garbage collector deleted (and not
    /// created again since): what its Delete event carries to a watch.
    /// Only these: other deletions (a user's, the operator's pruning) need
    /// no departure timing in the model — only a deleted task's lock does —
    /// and recording them would split the other bounds' states.
    pub deleted_leases: BTreeMap<String, String>,
    /// WorkerLeases (`batchlease.dev`, in the tasks' namespace) by name:
    /// one per worker in per-worker renewal mode (see [`crate::fleet`]).
    /// Create fails if one exists and drops `status`; a write of the spec
    /// (the worker's renewal) or of the status subresource (the
    /// operator's revocation) is a compare-and-swap on the one
    /// resourceVersion both bump, so each conflicts with the other; anyone
    /// may delete one.
    pub workers: BTreeMap<String, String>,
    /// The last state of each WorkerLease deleted (and not created again
    /// since): what its Delete event carries to the operator's watch.
    pub deleted_workers: BTreeMap<String, String>,
    /// The CRD's rules on `spec.offeredTo` (a mutation leaves one out).
    pub offer_rules: crate::offers::CelRules,
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
    // `spec.renewal`: set by the offer, turned from Lease to Worker only by
    // the claim (the write that sets the holder), never removed.
    let renewal_ok = match (old.spec.renewal, new.spec.renewal) {
        (None, None) => true,
        (Some(o), Some(n)) if o == n => true,
        (Some(Renewal::Lease), Some(Renewal::Worker)) => {
            old.spec.holder_identity.as_deref().unwrap_or("").is_empty()
                && !new.spec.holder_identity.as_deref().unwrap_or("").is_empty()
        }
        _ => false,
    };
    if !renewal_ok {
        return false;
    }
    // `spec.boundAt`: written by the create of a bound attempt alone; may
    // be removed, never added or changed.
    if new.spec.bound_at.is_some() && new.spec.bound_at != old.spec.bound_at {
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
    /// A store holding `tasks`, each stored once (resourceVersions from 1).
    pub fn new(tasks: Vec<BatchTask>) -> Self {
        let mut versions = BTreeMap::new();
        let tasks = tasks
            .into_iter()
            .map(|mut t| {
                versions.insert(format!("task/{}", t.name_any()), 1);
                t.metadata.resource_version = Some("1".into());
                encode(&t)
            })
            .collect();
        Self {
            versions,
            tasks,
            leases: BTreeMap::new(),
            locks: BTreeMap::new(),
            deleted: std::collections::BTreeSet::new(),
            deleted_leases: BTreeMap::new(),
            workers: BTreeMap::new(),
            deleted_workers: BTreeMap::new(),
            offer_rules: crate::offers::CelRules::default(),
        }
    }

    /// Task `i` as stored (panics on an index the model never makes).
    pub fn task(&self, i: usize) -> BatchTask {
        decode(&self.tasks[i])
    }

    /// The index of the task named `name` (`None` once it is deleted).
    pub fn task_index(&self, name: &str) -> Option<usize> {
        (0..self.tasks.len()).find(|i| crate::task_name(*i) == name && !self.deleted.contains(i))
    }

    /// The tasks as a watch shows them: a deleted one as `""`.
    pub fn task_view(&self) -> Vec<String> {
        self.tasks
            .iter()
            .enumerate()
            .map(|(i, t)| {
                if self.deleted.contains(&i) {
                    String::new()
                } else {
                    t.clone()
                }
            })
            .collect()
    }

    /// A user deletes task `i`; its leases stay until the garbage
    /// collector deletes them ([`Self::collectable`]).
    pub fn delete_task(&mut self, i: usize) {
        self.deleted.insert(i);
    }

    /// The garbage collector deletes lease `name`, whose task is gone; its
    /// last state is kept for the operator's watch (see `deleted_leases`).
    pub fn collect_lease(&mut self, name: &str) {
        if let Some(last) = self.leases.remove(name) {
            self.deleted_leases.insert(name.to_owned(), last);
        }
    }

    /// Leases whose task is deleted: the garbage collector's to delete.
    pub fn collectable(&self) -> Vec<String> {
        if self.deleted.is_empty() {
            return Vec::new();
        }
        let uids: Vec<String> = self
            .deleted
            .iter()
            .filter_map(|i| self.task(*i).metadata.uid)
            .collect();
        self.leases
            .iter()
            .filter(|(_, l)| uids.contains(&decode::<TaskLease>(l).spec.task_uid))
            .map(|(n, _)| n.clone())
            .collect()
    }

    pub fn lease(&self, name: &str) -> Option<TaskLease> {
        self.leases.get(name).map(|l| decode(l))
    }

    pub fn all_leases(&self) -> Vec<TaskLease> {
        self.leases.values().map(|l| decode(l)).collect()
    }

    fn next_rv(&mut self, key: &str) -> String {
        let v = self.versions.entry(key.to_owned()).or_default();
        *v += 1;
        v.to_string()
    }

    /// How many versions lease `name` had (in any incarnation): a writer
    /// uses it to make its timestamps unique per write, as real
    /// microsecond timestamps are.
    pub fn lease_writes(&self, name: &str) -> u32 {
        self.versions
            .get(&format!("lease/{name}"))
            .copied()
            .unwrap_or(0)
    }

    /// A user sets `spec.cancel` on task `i` (an update of the spec: a new
    /// resourceVersion and generation, status kept).
    pub fn cancel_task(&mut self, i: usize) {
        self.edit_spec(i, |spec| spec.cancel = true);
    }

    /// A user edits task `i`'s spec (a new resourceVersion and
    /// generation, status kept).
    pub fn edit_spec(&mut self, i: usize, f: impl FnOnce(&mut batchlease_api::BatchTaskSpec)) {
        let mut t = self.task(i);
        f(&mut t.spec);
        t.metadata.generation = Some(t.metadata.generation.unwrap_or(1) + 1);
        t.metadata.resource_version = Some(self.next_rv(&format!("task/{}", t.name_any())));
        self.tasks[i] = encode(&t);
    }

    /// `POST` of a task (a spawned child); the caller checked that no
    /// task of its name exists.
    pub fn create_task(&mut self, new: &BatchTask) {
        let mut t = new.clone();
        t.status = None;
        t.metadata.resource_version = Some(self.next_rv(&format!("task/{}", t.name_any())));
        self.tasks.push(encode(&t));
    }

    /// `PUT …/status` carrying the writer's resourceVersion.
    pub fn replace_status(&mut self, new: &BatchTask) -> Result<(), Refused> {
        let i = self.task_index(&new.name_any()).ok_or(Refused::NotFound)?;
        let cur = self.task(i);
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
        stored.metadata.resource_version = Some(self.next_rv(&format!("task/{}", new.name_any())));
        self.tasks[i] = encode(&stored);
        Ok(())
    }

    /// `POST` of a lease.
    pub fn create_lease(&mut self, new: &TaskLease) -> Result<TaskLease, Refused> {
        let name = new.name_any();
        if self.leases.contains_key(&name) {
            return Err(Refused::AlreadyExists);
        }
        // A lease of a deleted task: the real API server takes it and the
        // garbage collector deletes it; nobody can claim it meanwhile (a
        // worker reads the task first). The model drops it at once: an
        // operator whose task cache lags would otherwise create and the
        // collector delete it without end (a new resourceVersion each
        // time), and the bound would never close.
        if self
            .deleted
            .iter()
            .any(|i| self.task(*i).metadata.uid.as_deref() == Some(new.spec.task_uid.as_str()))
        {
            return Err(Refused::NotFound);
        }
        let mut stored = new.clone();
        let rv = self.next_rv(&format!("lease/{name}"));
        stored.metadata.uid = Some(format!("lease-uid-{name}-{rv}"));
        stored.metadata.resource_version = Some(rv);
        self.deleted_leases.remove(&name);
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
        if !lease_update_allowed(&cur, new) || !self.offer_rules.transition(&cur, new) {
            return Err(Refused::Invalid);
        }
        let mut stored = new.clone();
        stored.metadata.uid = cur.metadata.uid;
        stored.metadata.resource_version = Some(self.next_rv(&format!("lease/{name}")));
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
        Ok(())
    }

    /// The lock Lease `name`, read directly.
    pub fn lock(&self, name: &str) -> Option<Lease> {
        self.locks.get(name).map(|l| decode(l))
    }

    /// `POST` of a lock Lease.
    pub fn create_lock(&mut self, new: &Lease) -> Result<Lease, Refused> {
        let name = new.name_any();
        if self.locks.contains_key(&name) {
            return Err(Refused::AlreadyExists);
        }
        let mut stored = new.clone();
        stored.metadata.namespace = Some(LOCK_NAMESPACE.into());
        stored.metadata.resource_version = Some(self.next_rv(&format!("lock/{name}")));
        self.locks.insert(name, encode(&stored));
        Ok(stored)
    }

    /// `PUT` of a lock Lease carrying the writer's resourceVersion.
    pub fn replace_lock(&mut self, new: &Lease) -> Result<Lease, Refused> {
        let name = new.name_any();
        let cur = self.lock(&name).ok_or(Refused::NotFound)?;
        if cur.metadata.resource_version != new.metadata.resource_version {
            return Err(Refused::Conflict);
        }
        let mut stored = new.clone();
        stored.metadata.namespace = Some(LOCK_NAMESPACE.into());
        stored.metadata.resource_version = Some(self.next_rv(&format!("lock/{name}")));
        self.locks.insert(name, encode(&stored));
        Ok(stored)
    }

    /// The WorkerLease `name`, read directly.
    pub fn worker_lease(&self, name: &str) -> Option<WorkerLease> {
        self.workers.get(name).map(|l| decode(l))
    }

    /// How many versions WorkerLease `name` had (in any incarnation), to
    /// make its `renewTime`s unique per write.
    pub fn worker_writes(&self, name: &str) -> u32 {
        self.versions
            .get(&format!("worker/{name}"))
            .copied()
            .unwrap_or(0)
    }

    /// `POST` of a WorkerLease (the worker's): `status` is a subresource,
    /// so whatever the request carries there is dropped.
    pub fn create_worker_lease(&mut self, new: &WorkerLease) -> Result<WorkerLease, Refused> {
        let name = new.name_any();
        if self.workers.contains_key(&name) {
            return Err(Refused::AlreadyExists);
        }
        let mut stored = new.clone();
        stored.status = None;
        let rv = self.next_rv(&format!("worker/{name}"));
        stored.metadata.uid = Some(format!("worker-uid-{name}-{rv}"));
        stored.metadata.resource_version = Some(rv);
        self.deleted_workers.remove(&name);
        self.workers.insert(name, encode(&stored));
        Ok(stored)
    }

    /// The stored WorkerLease `new` replaces, if `new` carries its
    /// resourceVersion.
    fn worker_cas(&self, new: &WorkerLease) -> Result<WorkerLease, Refused> {
        let cur = self
            .worker_lease(&new.name_any())
            .ok_or(Refused::NotFound)?;
        if cur.metadata.resource_version != new.metadata.resource_version {
            return Err(Refused::Conflict);
        }
        Ok(cur)
    }

    fn store_worker(&mut self, mut stored: WorkerLease) -> WorkerLease {
        let name = stored.name_any();
        stored.metadata.resource_version = Some(self.next_rv(&format!("worker/{name}")));
        self.workers.insert(name, encode(&stored));
        stored
    }

    /// `PUT` of a WorkerLease (a renewal: its spec), carrying the writer's
    /// resourceVersion; the stored status is kept. The CRD's rule: `holds`
    /// never names a revoked attempt (`api`'s `WorkerLease` type holds it
    /// in CEL; e2e `validation.rs` shows the API server refusing).
    pub fn replace_worker_lease(&mut self, new: &WorkerLease) -> Result<WorkerLease, Refused> {
        let cur = self.worker_cas(new)?;
        let revoked = |a: &batchlease_api::AttemptRef| cur.revoked().iter().any(|r| r.uid == a.uid);
        if new.spec != cur.spec && new.holds().iter().any(revoked) {
            return Err(Refused::Invalid);
        }
        let mut stored = new.clone();
        stored.metadata.uid = cur.metadata.uid;
        stored.status = cur.status;
        Ok(self.store_worker(stored))
    }

    /// `PUT …/status` of a WorkerLease (the operator's revocation),
    /// carrying the writer's resourceVersion; the stored spec is kept.
    /// The CRD's rule: an entry leaves `revoked` only once `holds` no
    /// longer names it.
    pub fn replace_worker_status(&mut self, new: &WorkerLease) -> Result<WorkerLease, Refused> {
        let mut stored = self.worker_cas(new)?;
        // As the CEL rule: matched by UID.
        let taken_back = stored.revoked().iter().any(|r| {
            !new.revoked().iter().any(|n| n.uid == r.uid)
                && stored.holds().iter().any(|h| h.uid == r.uid)
        });
        if taken_back {
            return Err(Refused::Invalid);
        }
        stored.status = new.status.clone();
        Ok(self.store_worker(stored))
    }

    /// `DELETE` of a WorkerLease (someone's: a fault); its last state is
    /// kept for the operator's watch.
    pub fn delete_worker_lease(&mut self, name: &str) {
        if let Some(last) = self.workers.remove(name) {
            self.deleted_workers.insert(name.to_owned(), last);
        }
    }
}
