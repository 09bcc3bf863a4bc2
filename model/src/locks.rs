//! Resource locks (design §5, `operator/src/locks.rs`) in the model.
//!
//! The operator's pass mirrors `reconcile_inner`'s loop: on
//! `Decision::FetchLocks` it reads the lock Leases directly from the API
//! server (the real code's GET, a linearizable read) and judges each holder
//! with the real `locks::holder` on its *cached* tasks (which lag), the
//! older waiters with the real `locks::waiting` and `locks::queue_key`,
//! then decides again. A lock write (`TakeLock`, each lease of
//! `ReleaseLocks` or of `LockBlocked`'s give-back) is a request that lands
//! in a later step, like every other operator write; when it lands, the
//! pass goes on as the real one does: it puts the write's answer into its
//! slot (`update_slots`) and decides again with the task object and leases
//! it started with — no re-read. So the state keeps the pass (its [`Pass`])
//! while a lock write is on its way; a crash drops it, the write may still
//! land.

use std::collections::BTreeMap;
use std::sync::Arc;

use batchlease_api::{BatchTask, LeasePhase, TaskLease, TaskPhase, names};
use batchlease_operator::decide::Lookup;
use batchlease_operator::locks::{self, Holder, Slot};
use batchlease_operator::observe::gone_attempt_left_by;
use k8s_openapi::api::coordination::v1::Lease;
use kube::ResourceExt;

use crate::api_server::{decode, encode};
use crate::{Cluster, State, phase};

/// The one resource the tasks of a locking configuration share.
pub const RESOURCE: &str = "r";

/// How the operator judges a lock's holder.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LockRule {
    /// The real `locks::holder`.
    Sound,
    /// A mutation the checker must catch: an attempt counts as alive only
    /// while its task is `Ready` or `Running` under its token — the rule
    /// without "one token ahead of a `Pending` task is an acquisition in
    /// progress", so a lock taken for an attempt not issued yet looks
    /// dead.
    AheadIsDead,
    /// A mutation the checker must catch (the rule before issue 22): a
    /// deleted task's attempt counts as over once its lease is gone,
    /// though its worker learns of the deletion only at its next renewal.
    GoneIsDead,
}

/// [`Holder`], hashable (the state keeps it in a [`Pass`]).
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub enum HolderRec {
    Free,
    Ours(i64),
    Live(String),
    Stopping(String, std::time::Duration),
    Dead(String),
}

impl From<&Holder> for HolderRec {
    fn from(h: &Holder) -> Self {
        match h {
            Holder::Free => Self::Free,
            Holder::Ours { token } => Self::Ours(*token),
            Holder::Live(id) => Self::Live(id.clone()),
            Holder::Stopping { id, left } => Self::Stopping(id.clone(), *left),
            Holder::Dead(id) => Self::Dead(id.clone()),
        }
    }
}

impl From<&HolderRec> for Holder {
    fn from(h: &HolderRec) -> Self {
        match h {
            HolderRec::Free => Self::Free,
            HolderRec::Ours(token) => Self::Ours { token: *token },
            HolderRec::Live(id) => Self::Live(id.clone()),
            HolderRec::Stopping(id, left) => Self::Stopping {
                id: id.clone(),
                left: *left,
            },
            HolderRec::Dead(id) => Self::Dead(id.clone()),
        }
    }
}

/// A [`Slot`], hashable: the lock Lease as JSON.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct SlotRec {
    pub resource: String,
    pub name: String,
    pub lease: Option<String>,
    pub holder: HolderRec,
    pub older_waiter: Option<String>,
}

impl From<&Slot> for SlotRec {
    fn from(s: &Slot) -> Self {
        Self {
            resource: s.resource.clone(),
            name: s.name.clone(),
            lease: s.lease.as_ref().map(encode),
            holder: (&s.holder).into(),
            older_waiter: s.older_waiter.clone(),
        }
    }
}

impl From<&SlotRec> for Slot {
    fn from(s: &SlotRec) -> Self {
        Self {
            resource: s.resource.clone(),
            name: s.name.clone(),
            lease: s.lease.as_deref().map(decode),
            holder: (&s.holder).into(),
            older_waiter: s.older_waiter.clone(),
        }
    }
}

/// What a reconcile pass decides on, kept while its lock write is on the
/// way: the task object and the leases it started with (the real pass
/// never re-reads them), what its direct lease read found, and its slots.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct Pass {
    pub task: String,
    pub leases: Vec<String>,
    pub lookup: LookupRec,
    pub slots: Vec<SlotRec>,
}

/// [`Lookup`], hashable.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum LookupRec {
    CacheOnly,
    Creating,
    Absent,
    Occupied,
}

impl From<Lookup> for LookupRec {
    fn from(l: Lookup) -> Self {
        match l {
            Lookup::CacheOnly => Self::CacheOnly,
            Lookup::Creating => Self::Creating,
            Lookup::Absent => Self::Absent,
            Lookup::Occupied => Self::Occupied,
        }
    }
}

impl From<LookupRec> for Lookup {
    fn from(l: LookupRec) -> Self {
        match l {
            LookupRec::CacheOnly => Self::CacheOnly,
            LookupRec::Creating => Self::Creating,
            LookupRec::Absent => Self::Absent,
            LookupRec::Occupied => Self::Occupied,
        }
    }
}

impl Pass {
    pub(crate) fn new(
        task: &BatchTask,
        leases: &[Arc<TaskLease>],
        lookup: Lookup,
        slots: Option<&[Slot]>,
    ) -> Self {
        Self {
            task: encode(task),
            leases: leases.iter().map(|l| encode(&**l)).collect(),
            lookup: lookup.into(),
            slots: slots
                .unwrap_or_default()
                .iter()
                .map(SlotRec::from)
                .collect(),
        }
    }

    pub(crate) fn leases(&self) -> Vec<Arc<TaskLease>> {
        self.leases.iter().map(|l| Arc::new(decode(l))).collect()
    }

    pub(crate) fn slots(&self) -> Vec<Slot> {
        self.slots.iter().map(Slot::from).collect()
    }
}

/// The ghosts of the lock properties: as little history as they need
/// (every bit of history multiplies the states).
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq)]
pub struct LockGhosts {
    /// Per resource, the resource token on the TaskLease created last.
    pub last_created: BTreeMap<String, i64>,
    /// A TaskLease was created with a resource token not above the last.
    pub created_out_of_order: bool,
    /// Per resource and task, the latest take that landed: the resource
    /// token it wrote and the task token it was taken for.
    pub taken: BTreeMap<(String, usize), (i64, i64)>,
    /// A storage write for a resource was accepted from an attempt after
    /// the resource's lock was taken for another task's attempt.
    pub write_after_passed: bool,
    /// … for another attempt of the same task (a lost lease replaced).
    pub write_after_retaken: bool,
    /// Coverage: a lock passed to another task from an attempt whose
    /// lease expired; storage refused a write carrying a stale resource
    /// token; … and only the resource rows refused it (with the kill
    /// switch the task row's deadline always refuses such a write too).
    pub passed_after_expiry: bool,
    pub stale_resource_refused: bool,
    pub fenced_by_resource: bool,
    /// Coverage: a task other than the oldest took a lock before anyone.
    pub younger_first: bool,
    /// Coverage: a task was deleted while a worker held its lease and it
    /// held the lock; the lock then passed to another task.
    pub deleted_holding: bool,
    pub passed_from_deleted: bool,
}

/// The resource a lock Lease stands for (its label).
fn resource_of(lock: &Lease) -> String {
    lock.labels()
        .get(locks::LABEL_RESOURCE)
        .cloned()
        .unwrap_or_default()
}

/// `<namespace>/<task>@<token>` → (task, token).
fn parse_holder(id: &str) -> Option<(&str, i64)> {
    let (who, token) = id.rsplit_once('@')?;
    let (_, name) = who.split_once('/')?;
    Some((name, token.parse().ok()?))
}

impl Cluster {
    /// The operator's cached tasks, decoded (deleted ones are gone).
    fn cached_tasks(s: &State) -> Vec<Arc<BatchTask>> {
        s.op.tasks
            .iter()
            .flatten()
            .filter(|t| !t.is_empty())
            .map(|t| Arc::new(decode(t)))
            .collect()
    }

    /// `Tracker::gone_attempt_left`'s first sightings: before a pass reads
    /// the locks, every lock held by an attempt of a task gone from the
    /// cache whose lease is gone too, and whose departure the operator did
    /// not see, is noted as first asked about now.
    pub(crate) fn note_unknown_holders(&self, s: &mut State) {
        let cached = Self::cached_tasks(s);
        let now = self.instant(s.now);
        let mut first = Vec::new();
        for l in s.api.locks.values() {
            let lock: Lease = decode(l);
            let Some(uid) = lock.annotations().get(locks::HOLDER_UID).cloned() else {
                continue;
            };
            let Some((name, token)) = lock
                .spec
                .as_ref()
                .and_then(|sp| sp.holder_identity.as_deref())
                .and_then(parse_holder)
            else {
                continue;
            };
            let lease = names::lease_name(name, token);
            let known = cached
                .iter()
                .any(|t| t.name_any() == name && t.uid().as_deref() == Some(uid.as_str()))
                || s.op.leases.contains_key(&lease)
                || s.op.departed.get(&lease).is_some_and(|(u, _)| *u == uid);
            if !known {
                first.push((lease, uid));
            }
        }
        for k in first {
            s.op.unknown_since.entry(k).or_insert(now);
        }
    }

    /// `locks::holder` on the operator's caches (its task cache; its lease
    /// cache for a deleted task's attempt), as the configured rule judges.
    fn holder(&self, s: &State, lock: Option<&Lease>, me: &BatchTask) -> Holder {
        let cached = Self::cached_tasks(s);
        let task = |n: &str| cached.iter().find(|t| t.name_any() == n).cloned();
        let lease_live = |n: &str, uid: &str, token: i64| {
            s.op.leases
                .get(&names::lease_name(n, token))
                .map(|l| decode::<TaskLease>(l))
                .is_some_and(|l| {
                    l.spec.task_uid == uid
                        && l.spec.fencing_token == token
                        && matches!(
                            phase(&l),
                            Some(LeasePhase::Offered | LeasePhase::Held) | None
                        )
                })
        };
        // `Tracker::gone_attempt_left` on the operator's memory.
        let now = self.instant(s.now);
        let gone_left = |n: &str, uid: &str, token: i64, ttl: std::time::Duration| {
            if self.cfg.lock_rule == LockRule::GoneIsDead {
                return std::time::Duration::ZERO;
            }
            let lease = names::lease_name(n, token);
            if let Some((u, until)) = s.op.departed.get(&lease)
                && u == uid
            {
                // As the Tracker: the latest of the task's departed attempts.
                let latest =
                    s.op.departed
                        .values()
                        .filter(|(u, _)| u == uid)
                        .map(|(_, t)| *t)
                        .fold(*until, std::cmp::max);
                return gone_attempt_left_by(Some(latest), now, ttl, now);
            }
            let since =
                s.op.unknown_since
                    .get(&(lease, uid.to_owned()))
                    .copied()
                    .unwrap_or(now);
            gone_attempt_left_by(None, since, ttl, now)
        };
        let look = locks::Lookups {
            task: &task,
            lease_live: &lease_live,
            gone_left: &gone_left,
        };
        let h = locks::holder(lock, me, &look);
        let Holder::Live(id) = &h else {
            return h;
        };
        if self.cfg.lock_rule == LockRule::AheadIsDead {
            let acquiring = parse_holder(id).and_then(|(name, token)| {
                let st = task(name)?.status.clone()?;
                Some(st.phase == Some(TaskPhase::Pending) && token > st.fencing_token)
            });
            if acquiring == Some(true) {
                return Holder::Dead(id.clone());
            }
        }
        h
    }

    /// `fetch_locks`: reads the lock Leases of `resources` directly and
    /// judges each on the cached tasks.
    pub(crate) fn fetch_locks(
        &self,
        s: &State,
        task: &BatchTask,
        resources: &[String],
    ) -> Vec<Slot> {
        let ns = task.namespace().unwrap_or_default();
        let cached = Self::cached_tasks(s);
        let lookup = |n: &str| cached.iter().find(|t| t.name_any() == n).cloned();
        let now = self.wall(s.now, 0);
        let me = locks::queue_key(task);
        resources
            .iter()
            .map(|resource| {
                let name = locks::lock_name(&ns, resource);
                let lease = s.api.lock(&name);
                let mut holder = self.holder(s, lease.as_ref(), task);
                // inputs.rs (fetch_locks) reads the lease of a gone task's attempt
                // directly when its cache does not show it live.
                if matches!(holder, Holder::Stopping { .. } | Holder::Dead(_))
                    && self.cfg.lock_rule != LockRule::GoneIsDead
                    && let Some((n, u, t)) = locks::gone_attempt(lease.as_ref(), task, &lookup)
                    && s.api.lease(&names::lease_name(&n, t)).is_some_and(|l| {
                        l.spec.task_uid == u
                            && l.spec.fencing_token == t
                            && batchlease_operator::observe::may_be_held(&l)
                    })
                {
                    holder = Holder::Live(locks::holder_identity_of(&ns, &n, t));
                }
                // The graph index's users of the resource: the cached
                // tasks that list it.
                let older_waiter = cached
                    .iter()
                    .filter(|t| t.spec.resources.contains(resource))
                    .filter(|t| t.name_any() != task.name_any())
                    .filter(|t| locks::queue_key(t) < me && locks::waiting(t, &lookup, now))
                    .min_by_key(|t| locks::queue_key(t))
                    .map(|t| format!("{ns}/{} (waiting longer)", t.name_any()));
                Slot {
                    resource: resource.clone(),
                    name,
                    lease,
                    holder,
                    older_waiter,
                }
            })
            .collect()
    }

    /// `update_slots`: the lock Lease this pass wrote, into its slot.
    pub(crate) fn update_slots(&self, s: &State, pass: &mut Pass, written: &Lease) {
        let task: BatchTask = decode(&pass.task);
        let name = written.name_any();
        if let Some(slot) = pass.slots.iter_mut().find(|sl| sl.name == name) {
            slot.holder = (&self.holder(s, Some(written), &task)).into();
            slot.lease = Some(encode(written));
            slot.older_waiter = None;
        }
    }
}

/// Ghosts of a take that landed: for whom, and whether the lock passed
/// from another task's attempt whose lease expired.
pub(crate) fn took(s: &mut State, written: &Lease) {
    let resource = resource_of(written);
    let Some((name, token)) = written
        .spec
        .as_ref()
        .and_then(|sp| sp.holder_identity.as_deref())
        .and_then(parse_holder)
    else {
        return;
    };
    let Some(task) = s.api.task_index(name) else {
        return;
    };
    let rt = written
        .spec
        .as_ref()
        .and_then(|sp| sp.lease_transitions)
        .map_or(0, i64::from);
    // The previous holder: the take with the highest resource token.
    let before = s
        .locks
        .taken
        .iter()
        .filter(|((r, _), _)| *r == resource)
        .max_by_key(|(_, (rt, _))| *rt)
        .map(|((_, t), (_, its_token))| (*t, *its_token));
    if let Some((before, its_token)) = before
        && before != task
        && s.expired[before].contains(&its_token)
    {
        s.locks.passed_after_expiry = true;
    }
    if rt == 1 && task != 0 {
        s.locks.younger_first = true;
    }
    if let Some((before, _)) = before
        && before != task
        && s.api.deleted.contains(&before)
    {
        s.locks.passed_from_deleted = true;
    }
    s.locks.taken.insert((resource, task), (rt, token));
}

/// Ghosts of a user's deletion of task `i`: was a worker holding its lease
/// while it held a lock?
pub(crate) fn task_deleted(s: &mut State, i: usize) {
    let name = crate::task_name(i);
    let holding = s
        .workers
        .iter()
        .any(|w| matches!(w, crate::worker::Worker::Holding(a) if a.task == i));
    let locked = s.api.locks.values().any(|l| {
        let lock: Lease = decode(l);
        lock.spec
            .as_ref()
            .and_then(|sp| sp.holder_identity.as_deref())
            .and_then(parse_holder)
            .is_some_and(|(n, _)| n == name)
    });
    if holding && locked {
        s.locks.deleted_holding = true;
    }
}

/// Ghosts of a TaskLease created with resource tokens.
pub(crate) fn lease_created(s: &mut State, lease: &TaskLease) {
    for (r, t) in &lease.spec.resource_tokens {
        if s.locks.last_created.get(r).is_some_and(|last| last >= t) {
            s.locks.created_out_of_order = true;
        }
        s.locks.last_created.insert(r.clone(), *t);
    }
}

/// Ghosts of an accepted storage write of task `task`'s attempt holding
/// `tokens`: was any of its resources taken for another attempt since?
pub(crate) fn wrote(s: &mut State, task: usize, tokens: &BTreeMap<String, i64>) {
    for (r, rt) in tokens {
        for ((resource, by), (later, _)) in &s.locks.taken {
            if resource == r && later > rt {
                if *by == task {
                    s.locks.write_after_retaken = true;
                } else {
                    s.locks.write_after_passed = true;
                }
            }
        }
    }
}

/// Whether a `Pending` task needs a resource whose lock another task's
/// attempt holds (alive, as the API server's state says): its acquisition
/// is blocked. A predicate on the state rather than a ghost the blocked
/// decision sets — a bit of history would double the states.
pub(crate) fn contended(s: &State) -> bool {
    s.api.locks.values().any(|l| {
        let lock: Lease = decode(l);
        let resource = resource_of(&lock);
        let Some((name, token)) = lock
            .spec
            .as_ref()
            .and_then(|sp| sp.holder_identity.as_deref())
            .and_then(parse_holder)
        else {
            return false;
        };
        let Some(holder) = s.api.task_index(name) else {
            return false;
        };
        locks::attempt_alive(&s.api.task(holder), token)
            && (0..s.api.tasks.len()).any(|i| {
                let t = s.api.task(i);
                i != holder
                    && t.spec.resources.contains(&resource)
                    && t.status.and_then(|st| st.phase) == Some(TaskPhase::Pending)
            })
    })
}

/// Whether at most one live (Offered or Held) TaskLease carries a token
/// for each resource.
pub(crate) fn one_live_holder(s: &State) -> bool {
    let mut seen = std::collections::BTreeSet::new();
    s.api
        .all_leases()
        .iter()
        .filter(|l| matches!(phase(l), Some(LeasePhase::Offered | LeasePhase::Held)))
        .flat_map(|l| l.spec.resource_tokens.keys().cloned().collect::<Vec<_>>())
        .all(|r| seen.insert(r))
}
