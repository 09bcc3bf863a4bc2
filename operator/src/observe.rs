//! When did the operator last *see* each held lease renewed?
//!
//! Expiry is timed by the operator's monotonic clock at the moment a renewal
//! was observed, never by the `renewTime` a worker wrote: clocks skew, and an
//! observation is always later than the write it reports, so expiry can come
//! late but never early. A fresh process (restart, new leader) knows nothing
//! and so gives every held lease a full TTL from its first observation.
//!
//! The tracker also indexes leases by task so a reconcile finds a task's
//! leases without scanning the whole cache, and remembers, for a while,
//! until when the holder of a lease that left the cache may still run: a
//! deleted task's resource locks are held until then (`locks::holder`).

use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;
use std::time::Duration;

use batchlease_api::{AttemptRef, LeasePhase, TaskLease};
use kube::ResourceExt;
use tokio::time::Instant;

/// What the operator observed of the held lease of an attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Observation {
    /// When a renewal (or the claim) was last observed.
    pub last_renewal: Instant,
    /// When the claim was first observed (for `activeDeadlineSeconds`).
    pub claimed_at: Instant,
    /// A WorkerLease version observed since then named this attempt: its
    /// worker took it. A bound attempt that expires never named was never
    /// taken — the operator's bind failed, not the task — and costs no
    /// retry (`decide`'s `BoundNotTaken`).
    pub named: bool,
}

/// The last state seen of one held lease.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Seen {
    uid: String,
    holder: String,
    renew_marker: Option<String>,
    /// Held (not released) and claimed to be renewed through its holder's
    /// WorkerLease: what a WorkerLease renewal may be credited to.
    per_worker_held: bool,
    /// Held (not released), renewed either way: it takes a slot of its
    /// holder's.
    held: bool,
    /// The TTL the lease was issued with (the never-listed rule of
    /// `worker_leases`).
    ttl: Duration,
    /// A WorkerLease renewal of its holder, from a watch that had seen
    /// every version of that WorkerLease since before this claim was
    /// observed, named this attempt (`worker_leases::credit_seen`).
    listed: bool,
    pub observation: Observation,
}

impl Seen {
    /// The holder the record is of.
    pub fn holder(&self) -> &str {
        &self.holder
    }

    /// The UID of the lease object the record is of.
    pub fn uid(&self) -> &str {
        &self.uid
    }

    /// Whether a renewal of its holder's WorkerLease may keep it alive:
    /// held, and claimed to be renewed per worker.
    pub fn per_worker_held(&self) -> bool {
        self.per_worker_held
    }

    /// The TTL the lease was issued with.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Whether a gap-free WorkerLease renewal named this attempt.
    pub fn listed(&self) -> bool {
        self.listed
    }

    /// The record, marked as named by a gap-free WorkerLease renewal.
    pub fn seen_listed(&self) -> Seen {
        Seen {
            listed: true,
            ..self.clone()
        }
    }
}

/// Pure: the new record for `lease` seen at `now`, given the previous one.
/// `None` when the lease is not held, nor a held lease released (nothing
/// to time).
pub fn next_seen(prev: Option<&Seen>, lease: &TaskLease, now: Instant) -> Option<Seen> {
    let phase = lease.status.as_ref().and_then(|s| s.phase);
    // A held lease the operator released (spec.cancel) stays timed: its
    // holder may run until its kill switch, and the task ends only a TTL
    // after its last renewal was observed (see `decide`).
    let released_held = phase == Some(LeasePhase::Released) && lease.spec.holder_identity.is_some();
    if phase != Some(LeasePhase::Held) && !released_held {
        return None;
    }
    let uid = lease.uid().unwrap_or_default();
    let holder = lease.spec.holder_identity.clone().unwrap_or_default();
    // renewTime is compared for equality only: its value is the holder's
    // clock and means nothing here.
    let renew_marker = lease.spec.renew_time.as_ref().map(|t| t.0.to_string());
    let same_attempt = prev.filter(|p| p.uid == uid && p.holder == holder);
    let observation = match same_attempt {
        Some(p) => {
            if p.renew_marker == renew_marker {
                p.observation
            } else {
                Observation {
                    last_renewal: now,
                    ..p.observation
                }
            }
        }
        _ => Observation {
            last_renewal: now,
            claimed_at: now,
            named: false,
        },
    };
    Some(Seen {
        uid,
        holder,
        renew_marker,
        per_worker_held: phase == Some(LeasePhase::Held) && lease.renewed_per_worker(),
        held: phase == Some(LeasePhase::Held),
        ttl: lease_ttl(lease),
        listed: same_attempt.is_some_and(|p| p.listed),
        observation,
    })
}

/// The lease duration `lease` was issued with (at least a second).
pub fn lease_ttl(lease: &TaskLease) -> Duration {
    Duration::from_secs(u64::try_from(lease.spec.lease_duration_seconds.max(1)).unwrap_or(1))
}

/// Whether `lease` may have (or get) a running holder: `Offered` (a claim
/// may land), `Held`, or `Released` by a cancel after a claim.
pub fn may_be_held(lease: &TaskLease) -> bool {
    match lease.status.as_ref().and_then(|s| s.phase) {
        None | Some(LeasePhase::Offered | LeasePhase::Held) => true,
        Some(LeasePhase::Released) => lease.spec.holder_identity.is_some(),
        Some(_) => false,
    }
}

/// Pure: until when the holder of `lease`, which just left the cache, may
/// still be running (its kill switch has fired by then); `None`: it has no
/// holder and never will.
///
/// `last` is the lease's last state: from its Delete event
/// (`final_state`: every change before the deletion was delivered first),
/// or the copy the cache held of a lease a relist no longer lists (a claim
/// or renewals may have landed unseen while the watch was down). The rule
/// is the expiry rule: a TTL (the lease's own) after the last renewal
/// observed, and a renewal not yet seen counts as seen now.
pub fn holder_stops_by(
    prev: Option<&Seen>,
    last: &TaskLease,
    final_state: bool,
    now: Instant,
) -> Option<Instant> {
    // A holder renewing through its WorkerLease writes its TaskLease only
    // every refresh period, and stops when a refresh fails or none
    // succeeded for that long plus its kill switch's 2/3·TTL: a deleted
    // lease is noticed at the next refresh, not the next renewal.
    let refresh = batchlease_api::worker_lease::refresh_period(lease_ttl(last));
    if !final_state {
        return unseen_holder_runs_for(last).map(|d| now + d);
    }
    let extra = if last.renewed_per_worker() {
        refresh
    } else {
        Duration::ZERO
    };
    next_seen(prev, last, now).map(|s| s.observation.last_renewal + lease_ttl(last) + extra)
}

/// Pure: how long after now the holder of `last` may still run when `last`
/// may not be the lease's last state (a relist no longer lists it: a claim
/// or renewals may have landed unseen while the watch was down); `None`:
/// it has no holder and never will. A renewal not yet seen counts as seen
/// now, so a TTL; and a claim may have chosen to renew per worker if the
/// offer allowed it, whose holder learns of the deletion only at its next
/// TaskLease write, up to a refresh period later. `Tracker::list_done`
/// and the model's relist both time departures by this.
pub fn unseen_holder_runs_for(last: &TaskLease) -> Option<Duration> {
    let ttl = lease_ttl(last);
    let extra = if last.spec.renewal.is_some() {
        batchlease_api::worker_lease::refresh_period(ttl)
    } else {
        Duration::ZERO
    };
    may_be_held(last).then_some(ttl + extra)
}

/// Pure: how long the attempt of a deleted task, whose lease is gone, may
/// still run. `departed`: the latest time until which a departure of the
/// task's attempts that this process saw may run. Otherwise it never saw
/// the departure (it started later, like a new leader, or missed it) and
/// first asked at `first_asked`: `ttl` (the longest the lease may have had:
/// the lock Lease's `leaseDurationSeconds`) and, since nothing shows the
/// holder did not renew per worker, the refresh period after which such a
/// holder finds its lease gone. `Tracker::gone_attempt_left` and the model
/// both answer by this.
pub fn gone_attempt_left_by(
    departed: Option<Instant>,
    first_asked: Instant,
    ttl: Duration,
    now: Instant,
) -> Duration {
    let until = departed
        .unwrap_or_else(|| first_asked + ttl + batchlease_api::worker_lease::refresh_period(ttl));
    until.saturating_duration_since(now)
}

/// How long a departure is remembered after its holder stopped: a lock
/// Lease may name the departed attempt until a waiter looks at it.
const DEPARTED_KEPT: Duration = Duration::from_secs(3600);

/// Pure: does `fresh` (read after a conflict) show a renewal since `cached`
/// — a new `renewTime` or holder, or a phase other than Held? Only that is a
/// sign of life; any other write (a label, an annotation) is not.
pub fn renewed_since(cached: &TaskLease, fresh: &TaskLease) -> bool {
    fresh.spec.renew_time != cached.spec.renew_time
        || fresh.spec.holder_identity != cached.spec.holder_identity
        || fresh.status.as_ref().and_then(|s| s.phase) != Some(LeasePhase::Held)
}

type Key = (String, String);

/// Puts the record `seen` of lease `key` in its holder's entries of the
/// two holder indexes: renewed per worker (what a WorkerLease renewal
/// credits), and held either way (what takes the holder's slots).
fn index_holder(
    by_holder: &mut HashMap<Key, BTreeSet<String>>,
    slots_of: &mut HashMap<Key, BTreeSet<String>>,
    key: &Key,
    seen: &Seen,
) {
    let hk = (key.0.clone(), seen.holder.clone());
    if seen.per_worker_held {
        by_holder
            .entry(hk.clone())
            .or_default()
            .insert(key.1.clone());
    }
    if seen.held {
        slots_of.entry(hk).or_default().insert(key.1.clone());
    }
}

impl State {
    /// Takes `key` out of its holder's index entry (its record is about to
    /// change or go).
    fn unindex_holder(&mut self, key: &Key) {
        let Some(seen) = self.seen.get(key) else {
            return;
        };
        let hk = (key.0.clone(), seen.holder.clone());
        for index in [&mut self.by_holder, &mut self.slots_of] {
            if let Some(names) = index.get_mut(&hk) {
                names.remove(&key.1);
                if names.is_empty() {
                    index.remove(&hk);
                }
            }
        }
    }

    /// Puts `key`'s new record `seen` in its holder's index entries.
    fn index_holder(&mut self, key: &Key, seen: &Seen) {
        index_holder(&mut self.by_holder, &mut self.slots_of, key, seen);
    }

    /// The records of the leases `holder` holds per worker in `namespace`,
    /// by name (the holder index, each with its observation).
    fn held_by<'a>(
        &'a self,
        namespace: &'a str,
        holder: &str,
    ) -> impl Iterator<Item = (&'a String, &'a Seen)> + 'a {
        self.by_holder
            .get(&(namespace.to_owned(), holder.to_owned()))
            .into_iter()
            .flatten()
            .filter_map(move |name| {
                Some((name, self.seen.get(&(namespace.to_owned(), name.clone()))?))
            })
    }

    /// Drops departures long over (and first sightings long past any TTL).
    fn prune(&mut self, now: Instant) {
        self.departed
            .retain(|_, (_, until)| *until + DEPARTED_KEPT > now);
        self.unknown_since
            .retain(|_, since| *since + DEPARTED_KEPT * 2 > now);
    }
}

/// A lease that may have a holder: what its departure needs to know.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Live {
    task_uid: String,
    ttl: Duration,
    /// [`unseen_holder_runs_for`] of its last observed state: how long its
    /// holder may run after a relist finds it gone.
    unseen_runs_for: Duration,
}

#[derive(Debug, Default)]
struct State {
    seen: HashMap<Key, Seen>,
    /// Leases whose last observed state may have a holder.
    live: HashMap<Key, Live>,
    /// Leases gone from the cache: (task UID, until when their holder may
    /// run — the time of the deletion when there was none).
    departed: HashMap<Key, (String, Instant)>,
    /// Attempts of deleted tasks this process never saw leave (it started
    /// after, or missed it): when it first asked about one.
    unknown_since: HashMap<(Key, String), Instant>,
    /// (namespace, task name) → lease names.
    by_task: HashMap<Key, BTreeSet<String>>,
    /// (namespace, holder) → names of the leases it holds per worker.
    by_holder: HashMap<Key, BTreeSet<String>>,
    /// (namespace, holder) → names of the leases it holds either way:
    /// what takes its slots.
    slots_of: HashMap<Key, BTreeSet<String>>,
    /// During a (re)list: the leases listed so far. A lease deleted while
    /// the watch was down gets no Delete event; the list's end forgets it.
    listed: Option<Vec<(Key, String)>>,
}

/// Observations and the task → leases index, fed by the lease watch.
#[derive(Debug, Default)]
pub struct Tracker {
    state: Mutex<State>,
}

impl Tracker {
    /// A (re)list of the watch begins.
    pub fn list_started(&self) {
        self.lock().listed = Some(Vec::new());
    }

    /// The (re)list ended: forget every lease it did not contain. A lease
    /// that may have had a holder departs: a claim or renewals may have
    /// landed unseen, so its holder gets a full TTL from now.
    pub fn list_done(&self, now: Instant) {
        let mut state = self.lock();
        let Some(listed) = state.listed.take() else {
            return;
        };
        let keep: std::collections::HashSet<Key> = listed.iter().map(|(k, _)| k.clone()).collect();
        let gone: Vec<(Key, Live)> = state
            .live
            .iter()
            .filter(|(k, _)| !keep.contains(*k))
            .map(|(k, l)| (k.clone(), l.clone()))
            .collect();
        for (k, l) in gone {
            state.live.remove(&k);
            state
                .departed
                .insert(k, (l.task_uid, now + l.unseen_runs_for));
        }
        state.prune(now);
        let mut by_task: HashMap<Key, BTreeSet<String>> = HashMap::new();
        for ((ns, name), task) in &listed {
            by_task
                .entry((ns.clone(), task.clone()))
                .or_default()
                .insert(name.clone());
        }
        state.seen.retain(|k, _| keep.contains(k));
        state.by_task = by_task;
        let State {
            seen,
            by_holder,
            slots_of,
            ..
        } = &mut *state;
        by_holder.clear();
        slots_of.clear();
        for (key, record) in seen.iter() {
            index_holder(by_holder, slots_of, key, record);
        }
    }

    /// Records a lease event from the watch (apply or initial list).
    pub fn observe(&self, lease: &TaskLease, now: Instant) {
        let ns = lease.namespace().unwrap_or_default();
        let key = (ns.clone(), lease.name_any());
        let mut state = self.lock();
        if let Some(listed) = &mut state.listed {
            listed.push((key.clone(), lease.spec.task_name.clone()));
        }
        state
            .by_task
            .entry((ns, lease.spec.task_name.clone()))
            .or_default()
            .insert(key.1.clone());
        if let Some(unseen_runs_for) = unseen_holder_runs_for(lease) {
            state.live.insert(
                key.clone(),
                Live {
                    task_uid: lease.spec.task_uid.clone(),
                    ttl: lease_ttl(lease),
                    unseen_runs_for,
                },
            );
        } else {
            state.live.remove(&key);
        }
        let next = next_seen(state.seen.get(&key), lease, now);
        state.unindex_holder(&key);
        match next {
            Some(seen) => {
                state.index_holder(&key, &seen);
                state.seen.insert(key, seen);
            }
            None => {
                state.seen.remove(&key);
            }
        }
    }

    /// How many leases `holder` holds in `namespace`, renewed per worker
    /// or per lease, as the watch shows them: what addressing counts
    /// against its slots (a worker that renews per worker may hold some
    /// per lease: claimed before its WorkerLease was live, or after a
    /// fallback).
    pub fn held_count(&self, namespace: &str, holder: &str) -> usize {
        self.lock()
            .slots_of
            .get(&(namespace.to_owned(), holder.to_owned()))
            .map_or(0, BTreeSet::len)
    }

    /// The attempts `holder` holds per worker in `namespace`, as the watch
    /// shows them (by name and the task lease's UID).
    pub fn held_per_worker(&self, namespace: &str, holder: &str) -> BTreeSet<AttemptRef> {
        let state = self.lock();
        state
            .held_by(namespace, holder)
            .map(|(name, seen)| AttemptRef {
                name: name.clone(),
                uid: seen.uid().to_owned(),
            })
            .collect()
    }

    /// The leases `holder` holds per worker in `namespace` that are due to
    /// expire at `now` (no renewal observed for their TTL), by name and
    /// UID: one revocation can end them all (a frozen worker's attempts all
    /// fall due at once, credited by the same renewals).
    pub fn due_of_holder(
        &self,
        namespace: &str,
        holder: &str,
        now: Instant,
    ) -> Vec<(String, String)> {
        let state = self.lock();
        state
            .held_by(namespace, holder)
            .filter_map(|(name, seen)| {
                let ttl = state.live.get(&(namespace.to_owned(), name.clone()))?.ttl;
                (seen.per_worker_held
                    && now.saturating_duration_since(seen.observation.last_renewal) >= ttl)
                    .then(|| (name.clone(), seen.uid.clone()))
            })
            .collect()
    }

    /// Credits a renewal of `holder`'s WorkerLease in `namespace`: `credit`
    /// gives each record of a lease it holds per worker (by name) its new
    /// state (see `worker_leases::credit_seen`).
    pub fn credit_holder(
        &self,
        namespace: &str,
        holder: &str,
        credit: impl Fn(&str, &Seen) -> Seen,
    ) {
        let mut state = self.lock();
        let key = (namespace.to_owned(), holder.to_owned());
        let Some(names) = state.by_holder.get(&key).cloned() else {
            return;
        };
        for name in names {
            let k = (namespace.to_owned(), name);
            if let Some(seen) = state.seen.get(&k) {
                let next = credit(&k.1, seen);
                state.seen.insert(k, next);
            }
        }
    }

    /// Records a lease deletion (`lease`: its last state, from the Delete
    /// event), and until when its holder, if any, may still run.
    pub fn forget(&self, lease: &TaskLease, now: Instant) {
        let ns = lease.namespace().unwrap_or_default();
        let name = lease.name_any();
        let mut state = self.lock();
        let key = (ns.clone(), name.clone());
        let until = holder_stops_by(state.seen.get(&key), lease, true, now).unwrap_or(now);
        state.live.remove(&key);
        state
            .departed
            .insert(key, (lease.spec.task_uid.clone(), until));
        state.prune(now);
        state.unindex_holder(&(ns.clone(), name.clone()));
        state.seen.remove(&(ns.clone(), name.clone()));
        let task_key = (ns, lease.spec.task_name.clone());
        if let Some(names) = state.by_task.get_mut(&task_key) {
            names.remove(&name);
            if names.is_empty() {
                state.by_task.remove(&task_key);
            }
        }
    }

    /// A write to the lease was refused with a conflict: someone (the
    /// holder, renewing) wrote it after our cached copy. Count that as a
    /// renewal now; the watch brings the new state.
    pub fn touch(&self, namespace: &str, lease: &str, now: Instant) {
        if let Some(seen) = self
            .lock()
            .seen
            .get_mut(&(namespace.to_owned(), lease.to_owned()))
        {
            seen.observation.last_renewal = now;
        }
    }

    /// The observation of a held lease, if it is held.
    pub fn observation(&self, namespace: &str, lease: &str) -> Option<Observation> {
        self.lock()
            .seen
            .get(&(namespace.to_owned(), lease.to_owned()))
            .map(|s| s.observation)
    }

    /// How long the attempt of task `(task, uid)` under `token` — a task
    /// gone from the cache, whose lease is gone too — may still be running:
    /// until its holder's kill switch has surely fired. A departure this
    /// process saw is timed by [`holder_stops_by`]; one it did not see (it
    /// started later, like a new leader) by [`gone_attempt_left_by`] from
    /// the first time it asks — `ttl` being the longest the lease may have
    /// had (the lock Lease's `leaseDurationSeconds`, see `locks::acquire`).
    pub fn gone_attempt_left(
        &self,
        namespace: &str,
        task: &str,
        uid: &str,
        token: i64,
        ttl: Duration,
        now: Instant,
    ) -> Duration {
        let key = (
            namespace.to_owned(),
            batchlease_api::names::lease_name(task, token),
        );
        let mut state = self.lock();
        if let Some((u, until)) = state.departed.get(&key)
            && u == uid
        {
            // The task's earlier attempts that departed too (a lease lost
            // and replaced under the same lock, then the task deleted): the
            // lock is free only once every one of them has stopped.
            let latest = state
                .departed
                .iter()
                .filter(|((ns, _), (u, _))| ns == namespace && u == uid)
                .map(|(_, (_, t))| *t)
                .fold(*until, Instant::max);
            return gone_attempt_left_by(Some(latest), now, ttl, now);
        }
        let since = *state
            .unknown_since
            .entry((key, uid.to_owned()))
            .or_insert(now);
        gone_attempt_left_by(None, since, ttl, now)
    }

    /// Names of the leases of a task.
    pub fn leases_of(&self, namespace: &str, task: &str) -> Vec<String> {
        self.lock()
            .by_task
            .get(&(namespace.to_owned(), task.to_owned()))
            .map(|s| s.iter().cloned().collect())
            .unwrap_or_default()
    }

    #[cfg(test)]
    fn departed_until(&self, namespace: &str, lease: &str) -> Option<Instant> {
        self.lock()
            .departed
            .get(&(namespace.to_owned(), lease.to_owned()))
            .map(|(_, until)| *until)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding this lock leaves plain data behind; keep going.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
#[path = "observe_tests.rs"]
mod tests;
