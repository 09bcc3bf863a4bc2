//! Resource locks (design §5), as pure functions: which lock Lease stands
//! for a resource, who holds it and whether that holder is still alive,
//! and the next step of acquiring or releasing a task's locks.
//!
//! A task in `Exclusive` mode needs each of its `spec.resources` before a
//! lease is issued. Each resource is a `coordination.k8s.io/v1` Lease in
//! the operator's namespace, named `<task namespace>.<resource>`: resources
//! are per namespace, and keeping the locks next to the operator means the
//! operator needs no write access to Leases in tenants' namespaces (where
//! other controllers keep their leader-election Leases) and tenants cannot
//! forge or steal a lock. Acquisition is a compare-and-swap on the Lease's
//! `resourceVersion` that sets `holderIdentity` to `<namespace>/<task>@<token>`
//! (the token the lease will be issued under) and bumps
//! `leaseTransitions`: the resource's own fencing token, handed to the
//! worker in the TaskLease's `spec.resourceTokens`.
//!
//! Locks are taken one at a time in sorted order, all or nothing: on
//! contention the task gives back what it took, in reverse order, and waits
//! to be woken. Waiting tasks are served in creation order per resource: a
//! task does not take a free resource while an older task that could run
//! now also waits for it, so a task that needs many resources is not
//! overtaken forever by a stream of tasks that need one of them (the oldest
//! waiting task is never blocked by a younger one, so it always progresses
//! once the holders it waits for finish).
//!
//! A lock's life follows the holder's TaskLease, not the Lease's own
//! `renewTime`: the holder's attempt is alive while its task is `Ready` or
//! `Running` under that token (or `Pending` one token below, while it is
//! still acquiring). Only those facts are trusted, because each is final
//! once observed; a judgement from a stale cache errs towards "alive".
//!
//! A deleted task's attempt runs on after its task and lease are gone: its
//! worker learns of the deletion only at its next renewal, or stops at its
//! kill switch. Its locks stay held until then — a TTL (the lease's own)
//! after its last renewal was observed, or, when this process did not see
//! the lease go (a new leader), a TTL from the first time it looks, the
//! TTL being the lock Lease's `leaseDurationSeconds`, which is never below
//! the TTL of a lease issued under the lock (see [`acquire`]).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use batchlease_api::{BatchTask, TaskMode, TaskPhase, names};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;

/// Annotation on a lock Lease: the UID of the holding task (a task deleted
/// and re-created under the same name is another holder).
pub const HOLDER_UID: &str = "batchlease.dev/holder-uid";
/// Label on a lock Lease: the namespace of the tasks it serves.
pub const LABEL_LOCK_NAMESPACE: &str = "batchlease.dev/lock-namespace";
/// Label on a lock Lease: the resource (a label value, see
/// [`names::label_value`]).
pub const LABEL_RESOURCE: &str = "batchlease.dev/resource";
/// Label on a lock Lease: who manages it.
pub const LABEL_MANAGED_BY: &str = "app.kubernetes.io/managed-by";
/// Its value.
pub const MANAGED_BY: &str = "batchlease-operator";

/// Name of the Lease that locks `resource` for the tasks of `namespace`:
/// `<namespace>.<resource>`, shortened with a hash when too long. A
/// namespace has no '.', so the first '.' separates the two.
pub fn lock_name(namespace: &str, resource: &str) -> String {
    let full = format!("{namespace}.{resource}");
    if full.len() <= names::MAX_NAME_LEN {
        return full;
    }
    let hash = names::short_hash(&full);
    let mut keep = (names::MAX_NAME_LEN - hash.len() - 1).min(full.len());
    // Byte slicing must land on a character boundary: a resource name the
    // CRD of an older release let through may be non-ASCII (it then fails
    // as a Lease name, for its own task only — it must not panic).
    while !full.is_char_boundary(keep) {
        keep -= 1;
    }
    let mut prefix = full[..keep].to_owned();
    while prefix.ends_with(['-', '.']) {
        prefix.pop();
    }
    format!("{prefix}-{hash}")
}

/// The resources `task` must hold before a lease is issued: none for a
/// task running speculatively (design §6), else its `resources`, sorted and
/// deduplicated (the canonical order every task takes them in).
pub fn needed(task: &BatchTask) -> Vec<String> {
    let mode = task
        .status
        .as_ref()
        .and_then(|s| s.effective_mode)
        .unwrap_or(task.spec.mode);
    if mode == TaskMode::Speculative {
        return Vec::new();
    }
    let mut r = task.spec.resources.clone();
    r.sort();
    r.dedup();
    r
}

/// The resources a task running speculatively must find free of a live
/// holder before a lease is issued (none for an Exclusive task): it takes
/// no lock itself, but a quarantined task (design §6: Exclusive after too
/// many aborts) holds the locks so that it is certain to finish — new
/// speculative attempts on its resources would only keep beating its
/// compare-and-swap. Attempts already running when the lock was taken
/// finish, each beating it at most once (the SDK retries a lost
/// compare-and-swap in place while it holds the locks).
pub fn respected(task: &BatchTask) -> Vec<String> {
    if !needed(task).is_empty() {
        return Vec::new();
    }
    let mut r = task.spec.resources.clone();
    r.sort();
    r.dedup();
    r
}

/// The first slot held by a live attempt of another task: a speculative
/// task waits for it (see [`respected`]). A free lock promised to an older
/// waiter does not hold it back: it takes nothing that waiter needs.
pub fn held_by_other(slots: &[Slot]) -> Option<(String, String)> {
    slots
        .iter()
        .find_map(|s| s.holder.live().map(|h| (s.resource.clone(), h)))
}

/// The soonest a slot held by a deleted task's attempt becomes free (when
/// its holder has surely stopped): a task blocked by it looks again then.
pub fn soonest_free(slots: &[Slot]) -> Option<Duration> {
    slots
        .iter()
        .filter_map(|s| match &s.holder {
            Holder::Stopping { left, .. } => Some(*left),
            _ => None,
        })
        .min()
}

/// `holderIdentity` of `task`'s attempt with fencing `token`.
pub fn holder_identity(task: &BatchTask, token: i64) -> String {
    holder_identity_of(
        &task.namespace().unwrap_or_default(),
        &task.name_any(),
        token,
    )
}

/// `holderIdentity` of the attempt of task `namespace/name` with `token`.
pub fn holder_identity_of(namespace: &str, name: &str, token: i64) -> String {
    format!("{namespace}/{name}@{token}")
}

/// Who holds a lock, as the task that asks sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Holder {
    /// Nobody (no Lease yet, or released).
    Free,
    /// The asking task, for its attempt with this token.
    Ours { token: i64 },
    /// Another task whose attempt is (or may be) alive.
    Live(String),
    /// A deleted task's attempt whose lease is gone too: it may run for
    /// `left` more, until its holder's kill switch has surely fired.
    Stopping { id: String, left: Duration },
    /// A holder whose attempt ended, or whose task is gone and whose
    /// holder has surely stopped: the lock may be taken over.
    Dead(String),
}

impl Holder {
    /// Who keeps the lock from others, if anyone does.
    fn live(&self) -> Option<String> {
        match self {
            Self::Live(h) => Some(h.clone()),
            Self::Stopping { id, left } => Some(format!(
                "{id} (task deleted; its attempt may run for {}s more)",
                left.as_secs() + u64::from(left.subsec_nanos() > 0)
            )),
            _ => None,
        }
    }
}

/// Parses `<namespace>/<task>@<token>`.
fn parse_holder(id: &str) -> Option<(&str, &str, i64)> {
    let (who, token) = id.rsplit_once('@')?;
    let (ns, name) = who.split_once('/')?;
    Some((ns, name, token.parse().ok()?))
}

/// What the operator's caches say of other tasks and their leases.
pub struct Lookups<'a> {
    /// A task of the asking task's namespace, by name.
    pub task: &'a (dyn Fn(&str) -> Option<Arc<BatchTask>> + Sync),
    /// Whether a TaskLease of task `(name, uid)` under `token` is live
    /// (`Offered` or `Held`): a deleted task's attempt runs on until the
    /// garbage collector deletes its lease.
    pub lease_live: &'a (dyn Fn(&str, &str, i64) -> bool + Sync),
    /// For task `(name, uid)`, gone, whose lease under `token` is gone too:
    /// how long its holder may still run, given the longest TTL the lease
    /// may have had (`observe::Tracker::gone_attempt_left`).
    pub gone_left: &'a (dyn Fn(&str, &str, i64, Duration) -> Duration + Sync),
}

impl std::fmt::Debug for Lookups<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lookups").finish_non_exhaustive()
    }
}

/// Whether `lease` is one of our locks for `namespace`: created by the
/// operator, for that namespace. Any other Lease under a lock's name (the
/// operator's namespace may hold other Leases) is never written.
fn is_lock(lease: &Lease, namespace: &str) -> bool {
    let labels = lease.labels();
    labels.get(LABEL_MANAGED_BY).map(String::as_str) == Some(MANAGED_BY)
        && labels.get(LABEL_LOCK_NAMESPACE).map(String::as_str) == Some(namespace)
}

/// Who holds `lock`, asked by `me`.
pub fn holder(lock: Option<&Lease>, me: &BatchTask, look: &Lookups<'_>) -> Holder {
    let ns_of_me = me.namespace().unwrap_or_default();
    if let Some(l) = lock
        && !is_lock(l, &ns_of_me)
    {
        return Holder::Live(format!(
            "a Lease not managed by batchlease ({})",
            l.name_any()
        ));
    }
    if lock
        .and_then(|l| l.spec.as_ref())
        .and_then(|s| s.lease_transitions)
        .is_some_and(|t| t == i32::MAX)
    {
        // The token cannot grow any more: never hand it out again.
        return Holder::Live(
            "nobody: the lock's token is exhausted (leaseTransitions at its maximum)".into(),
        );
    }
    let Some(id) = lock
        .and_then(|l| l.spec.as_ref())
        .and_then(|s| s.holder_identity.as_deref())
        .filter(|s| !s.is_empty())
    else {
        return Holder::Free;
    };
    let uid = lock.and_then(|l| l.annotations().get(HOLDER_UID).cloned());
    // An identity we did not write (someone edited the Lease): never taken
    // over automatically; an administrator deletes or releases it.
    let Some((ns, name, token)) = parse_holder(id) else {
        return Holder::Live(id.to_owned());
    };
    if ns != ns_of_me {
        return Holder::Live(id.to_owned());
    }
    if name == me.name_any() && uid == me.uid() {
        return Holder::Ours { token };
    }
    let task = (look.task)(name).filter(|t| uid.is_some() && uid == t.uid());
    let Some(task) = task else {
        // Deleted (or re-created under the same name): its attempt runs on
        // while its lease is live, and after the lease is gone until its
        // holder has surely stopped (the worker learns of the deletion at
        // its next renewal at the earliest).
        let Some(uid) = uid.as_deref() else {
            return Holder::Dead(id.to_owned());
        };
        if (look.lease_live)(name, uid, token) {
            return Holder::Live(id.to_owned());
        }
        let left = (look.gone_left)(name, uid, token, lock_ttl(lock));
        return if left.is_zero() {
            Holder::Dead(id.to_owned())
        } else {
            Holder::Stopping {
                id: id.to_owned(),
                left,
            }
        };
    };
    if attempt_alive(&task, token) {
        Holder::Live(id.to_owned())
    } else {
        Holder::Dead(id.to_owned())
    }
}

/// The attempt holding `lock` when it is another task's of `me`'s namespace
/// that the cache no longer shows (deleted, or re-created under its name):
/// (task name, task UID, token). Its lease is what tells whether it may
/// still run; a reconciler reads it directly when its cache does not show
/// it live (a lagging cache must not make a running holder look gone).
pub fn gone_attempt(
    lock: Option<&Lease>,
    me: &BatchTask,
    task: &(dyn Fn(&str) -> Option<Arc<BatchTask>> + Sync),
) -> Option<(String, String, i64)> {
    let l = lock?;
    let ns_of_me = me.namespace().unwrap_or_default();
    if !is_lock(l, &ns_of_me) {
        return None;
    }
    let id = l.spec.as_ref()?.holder_identity.as_deref()?;
    let (ns, name, token) = parse_holder(id)?;
    let uid = l.annotations().get(HOLDER_UID)?.clone();
    if ns != ns_of_me || (name == me.name_any() && Some(&uid) == me.uid().as_ref()) {
        return None;
    }
    let cached = task(name).is_some_and(|t| t.uid().as_ref() == Some(&uid));
    (!cached).then(|| (name.to_owned(), uid, token))
}

/// The longest TTL a lease issued under `lock` may have: its
/// `leaseDurationSeconds` (the CRD's maximum if it has none).
fn lock_ttl(lock: Option<&Lease>) -> Duration {
    let secs = lock
        .and_then(|l| l.spec.as_ref())
        .and_then(|s| s.lease_duration_seconds)
        .unwrap_or(MAX_LEASE_SECONDS);
    Duration::from_secs(u64::try_from(secs.max(1)).unwrap_or(1))
}

/// The largest `spec.leaseDurationSeconds` the CRD admits.
const MAX_LEASE_SECONDS: i32 = 3600;

/// Whether `task`'s attempt under `token` may still be running or about to
/// run. Dead only on facts that stay true once seen: the task moved to a
/// later token, or settled the attempt (left `Ready`/`Running` at that
/// token). One token ahead of the task is an acquisition in progress.
pub fn attempt_alive(task: &BatchTask, token: i64) -> bool {
    let Some(st) = task.status.as_ref() else {
        return true;
    };
    let phase = st.phase.unwrap_or(TaskPhase::Pending);
    if token < st.fencing_token {
        return false;
    }
    if token == st.fencing_token {
        return matches!(phase, TaskPhase::Ready | TaskPhase::Running);
    }
    // Ahead of the task: acquiring for its next attempt (or our cache of
    // the task lags). Alive, unless the task can never run again.
    !phase.is_terminal()
}

/// One lock as the acquiring task sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct Slot {
    pub resource: String,
    /// Name of its lock Lease ([`lock_name`]).
    pub name: String,
    /// The Lease as read directly from the API server (`None`: absent).
    pub lease: Option<Lease>,
    pub holder: Holder,
    /// An older task that could run now and waits for this resource: this
    /// task must not take it first.
    pub older_waiter: Option<String>,
}

/// The next lock step of a task that wants to be issued `want`.
#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    /// Create (no `resourceVersion`) or replace (CAS) this Lease.
    Take(Box<Lease>),
    /// Blocked by `holder` on `resource`: give back `give_back` (what this
    /// round took, last first; each a CAS) and wait.
    Blocked {
        give_back: Vec<Lease>,
        resource: String,
        holder: String,
    },
    /// Every lock is held: the resource tokens for the lease.
    Held(BTreeMap<String, i64>),
}

/// The next step towards holding every slot for `want` (slots sorted by
/// resource): block if any slot is held by a live attempt of another task
/// (or, with `fair`, promised to an older waiting task), else take the
/// first slot not yet ours, else all are held. A task that holds a lock
/// under an older token of its own (its lease was lost and is being
/// replaced) takes it over without queueing again.
pub fn acquire(task: &BatchTask, want: i64, slots: &[Slot], wall: Timestamp, fair: bool) -> Step {
    // Every slot was read before this decision: if one blocks, taking the
    // others first would only be given back (and wake their waiters for
    // nothing). Block at once; give back what an earlier round took.
    let blocker = slots.iter().find_map(|slot| {
        let by = match &slot.holder {
            Holder::Ours { .. } => None,
            Holder::Free | Holder::Dead(_) => slot.older_waiter.clone().filter(|_| fair),
            h @ (Holder::Live(_) | Holder::Stopping { .. }) => h.live(),
        };
        by.map(|by| (slot.resource.clone(), by))
    });
    if let Some((resource, holder)) = blocker {
        return Step::Blocked {
            give_back: release_all(slots, want),
            resource,
            holder,
        };
    }
    // Then one at a time, in order: a racing acquirer (another task's
    // reconcile) loses a CAS on the first lock they both want, never
    // holds one the other needs while waiting for it.
    if let Some(slot) = slots
        .iter()
        .find(|s| s.holder != Holder::Ours { token: want })
    {
        return Step::Take(Box::new(taken(task, want, slot, wall)));
    }
    // Each lock carries at least the TTL the lease will be issued with: a
    // waiter that cannot see that lease (its task deleted, this process a
    // new leader) waits that long for its holder. The spec may have been
    // edited since a lock was taken; then the lock is updated first.
    let ttl = task.spec.lease_duration_seconds;
    if let Some(lease) = slots.iter().filter_map(|s| s.lease.as_ref()).find(|l| {
        l.spec
            .as_ref()
            .and_then(|s| s.lease_duration_seconds)
            .is_some_and(|t| t < ttl)
    }) {
        let mut l = lease.clone();
        l.spec
            .get_or_insert_with(LeaseSpec::default)
            .lease_duration_seconds = Some(ttl);
        return Step::Take(Box::new(l));
    }
    Step::Held(
        slots
            .iter()
            .map(|s| {
                let token = s
                    .lease
                    .as_ref()
                    .and_then(|l| l.spec.as_ref())
                    .and_then(|sp| sp.lease_transitions)
                    .unwrap_or(0);
                (s.resource.clone(), i64::from(token))
            })
            .collect(),
    )
}

/// The locks among `slots` that `task` holds under `token`, released, in
/// reverse order (an ended attempt gives back what it held).
pub fn release_all(slots: &[Slot], token: i64) -> Vec<Lease> {
    slots
        .iter()
        .rev()
        .filter(|s| s.holder == Holder::Ours { token })
        .filter_map(|s| s.lease.as_ref().map(released))
        .collect()
}

/// The locks among `slots` that `task` holds under any token (a task that
/// may not run now holds nothing).
pub fn release_any(slots: &[Slot]) -> Vec<Lease> {
    slots
        .iter()
        .rev()
        .filter(|s| matches!(s.holder, Holder::Ours { .. }))
        .filter_map(|s| s.lease.as_ref().map(released))
        .collect()
}

/// `slot`'s Lease taken by `task` for `want`: a new holder and the next
/// transition count — the resource's new fencing token.
fn taken(task: &BatchTask, want: i64, slot: &Slot, wall: Timestamp) -> Lease {
    let mut lease = slot.lease.clone().unwrap_or_else(|| Lease {
        metadata: ObjectMeta {
            name: Some(slot.name.clone()),
            ..Default::default()
        },
        spec: None,
    });
    let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
    spec.holder_identity = Some(holder_identity(task, want));
    spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0).saturating_add(1));
    spec.acquire_time = Some(MicroTime(wall));
    spec.renew_time = Some(MicroTime(wall));
    // Taken over from our own older attempt (its lease lost and replaced):
    // that attempt may still run on its own, possibly longer, TTL, which a
    // waiter that cannot see its lease must wait out; never shorten it.
    let kept = match slot.holder {
        Holder::Ours { .. } => spec.lease_duration_seconds.unwrap_or(0),
        _ => 0,
    };
    spec.lease_duration_seconds = Some(task.spec.lease_duration_seconds.max(kept));
    lease
        .annotations_mut()
        .insert(HOLDER_UID.into(), task.uid().unwrap_or_default());
    let ns = task.namespace().unwrap_or_default();
    let labels = lease.labels_mut();
    labels.insert(LABEL_LOCK_NAMESPACE.into(), ns);
    labels.insert(LABEL_RESOURCE.into(), names::label_value(&slot.resource));
    labels.insert(LABEL_MANAGED_BY.into(), MANAGED_BY.into());
    lease
}

/// `lease` with no holder. The transition count stays: it only grows.
fn released(lease: &Lease) -> Lease {
    let mut l = lease.clone();
    if let Some(spec) = l.spec.as_mut() {
        spec.holder_identity = None;
        spec.acquire_time = None;
        spec.renew_time = None;
    }
    l.annotations_mut().remove(HOLDER_UID);
    l
}

/// Whether `task` waits for resources now: `Pending`, in Exclusive mode,
/// backoff over, every dependency succeeded. Only such tasks hold back
/// younger ones (a task blocked on its dependencies must not).
pub fn waiting(
    task: &BatchTask,
    lookup: &dyn Fn(&str) -> Option<Arc<BatchTask>>,
    wall: Timestamp,
) -> bool {
    let Some(st) = task.status.as_ref() else {
        return false;
    };
    if task.metadata.deletion_timestamp.is_some()
        || st.phase != Some(TaskPhase::Pending)
        || needed(task).is_empty()
        || st.next_attempt_after.as_ref().is_some_and(|t| t.0 > wall)
    {
        return false;
    }
    task.spec.depends_on.iter().all(|d| {
        lookup(d)
            .and_then(|t| t.status.as_ref().and_then(|s| s.phase))
            .is_some_and(|p| p == TaskPhase::Succeeded)
    })
}

/// The order in which waiting tasks are served: creation time, then name.
pub fn queue_key(task: &BatchTask) -> (Option<Timestamp>, String) {
    (
        task.metadata.creation_timestamp.as_ref().map(|t| t.0),
        task.name_any(),
    )
}

#[cfg(test)]
#[path = "locks_tests.rs"]
mod tests;
