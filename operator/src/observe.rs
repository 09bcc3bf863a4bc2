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

use batchlease_api::{LeasePhase, TaskLease};
use kube::ResourceExt;
use tokio::time::Instant;

/// What the operator observed of the held lease of an attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Observation {
    /// When a renewal (or the claim) was last observed.
    pub last_renewal: Instant,
    /// When the claim was first observed (for `activeDeadlineSeconds`).
    pub claimed_at: Instant,
}

/// The last state seen of one held lease.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Seen {
    uid: String,
    holder: String,
    renew_marker: Option<String>,
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
    let observation = match prev {
        Some(p) if p.uid == uid && p.holder == holder => {
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
        },
    };
    Some(Seen {
        uid,
        holder,
        renew_marker,
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
    let ttl = lease_ttl(last);
    if !final_state {
        return may_be_held(last).then(|| now + ttl);
    }
    next_seen(prev, last, now).map(|s| s.observation.last_renewal + ttl)
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

impl State {
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
            state.departed.insert(k, (l.task_uid, now + l.ttl));
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
        if may_be_held(lease) {
            state.live.insert(
                key.clone(),
                Live {
                    task_uid: lease.spec.task_uid.clone(),
                    ttl: lease_ttl(lease),
                },
            );
        } else {
            state.live.remove(&key);
        }
        match next_seen(state.seen.get(&key), lease, now) {
            Some(seen) => {
                state.seen.insert(key, seen);
            }
            None => {
                state.seen.remove(&key);
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
    /// started later, like a new leader) gets `ttl` from the first time it
    /// asks — `ttl` being the longest the lease may have had (the lock
    /// Lease's `leaseDurationSeconds`, see `locks::acquire`).
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
            return latest.saturating_duration_since(now);
        }
        let since = *state
            .unknown_since
            .entry((key, uid.to_owned()))
            .or_insert(now);
        (since + ttl).saturating_duration_since(now)
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
mod tests {
    use super::*;
    use batchlease_api::{TaskLeaseSpec, TaskLeaseStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
    use std::time::Duration;

    fn lease(uid: &str, holder: Option<&str>, phase: LeasePhase, renew: i64) -> TaskLease {
        let mut l = TaskLease::new("t-1", TaskLeaseSpec::offered("t", "u", "q", 1, 30));
        l.spec.holder_identity = holder.map(Into::into);
        l.spec.renew_time = Some(MicroTime(
            k8s_openapi::jiff::Timestamp::from_second(renew).unwrap(),
        ));
        l.metadata.uid = Some(uid.into());
        l.metadata.namespace = Some("ns".into());
        l.status = Some(TaskLeaseStatus {
            phase: Some(phase),
            ..Default::default()
        });
        l
    }

    #[test]
    fn observation_table() {
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_secs(5);
        let held = lease("u1", Some("w1"), LeasePhase::Held, 100);
        let first = next_seen(None, &held, t0).unwrap();
        assert_eq!(
            first.observation,
            Observation {
                last_renewal: t0,
                claimed_at: t0
            }
        );

        // The same state seen again (a relist): no renewal.
        assert_eq!(
            next_seen(Some(&first), &held, t1).unwrap().observation,
            first.observation
        );

        // renewTime changed: a renewal, observed at t1, even though the
        // written clock went *backwards* (clock values are not trusted).
        let renewed = lease("u1", Some("w1"), LeasePhase::Held, 50);
        let got = next_seen(Some(&first), &renewed, t1).unwrap().observation;
        assert_eq!(
            got,
            Observation {
                last_renewal: t1,
                claimed_at: t0
            }
        );

        // A different object of the same name (re-created): starts afresh.
        let other = lease("u2", Some("w1"), LeasePhase::Held, 100);
        assert_eq!(
            next_seen(Some(&first), &other, t1).unwrap().observation,
            Observation {
                last_renewal: t1,
                claimed_at: t1
            }
        );

        // Not held: nothing to time.
        for phase in [
            LeasePhase::Offered,
            LeasePhase::Completed,
            LeasePhase::Expired,
        ] {
            assert!(next_seen(Some(&first), &lease("u1", Some("w1"), phase, 100), t1).is_none());
        }
        // Released unclaimed (a withdrawn offer, a tombstone): nothing to time.
        assert!(next_seen(None, &lease("u1", None, LeasePhase::Released, 100), t1).is_none());
        // A held lease released by a cancel keeps its clock: the holder may
        // run until its kill switch, timed from its last renewal.
        let released = lease("u1", Some("w1"), LeasePhase::Released, 100);
        assert_eq!(
            next_seen(Some(&first), &released, t1).unwrap().observation,
            first.observation
        );
        // First seen released (a new leader): a full TTL from now.
        assert_eq!(
            next_seen(None, &released, t1)
                .unwrap()
                .observation
                .last_renewal,
            t1
        );
    }

    #[test]
    fn when_the_holder_of_a_departed_lease_has_surely_stopped() {
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_secs(4);
        let ttl = Duration::from_secs(30);
        let held = lease("u1", Some("w1"), LeasePhase::Held, 100);
        let seen = next_seen(None, &held, t0).unwrap();
        // Deleted while held, last renewal seen at t0: a TTL after it.
        assert_eq!(
            holder_stops_by(Some(&seen), &held, true, t1),
            Some(t0 + ttl)
        );
        // The Delete event shows a renewal not seen before: seen now.
        let renewed = lease("u1", Some("w1"), LeasePhase::Held, 101);
        assert_eq!(
            holder_stops_by(Some(&seen), &renewed, true, t1),
            Some(t1 + ttl)
        );
        // Never seen held before (a new process): a full TTL from now.
        assert_eq!(holder_stops_by(None, &held, true, t1), Some(t1 + ttl));
        // Released by a cancel after a claim: still timed.
        let released = lease("u1", Some("w1"), LeasePhase::Released, 100);
        assert_eq!(
            holder_stops_by(Some(&seen), &released, true, t1),
            Some(t0 + ttl)
        );
        // Deleted while offered (its final state): nobody claimed it.
        let offered = lease("u1", None, LeasePhase::Offered, 100);
        assert_eq!(holder_stops_by(None, &offered, true, t1), None);
        // Gone in a relist: a claim or renewals may have landed unseen.
        assert_eq!(holder_stops_by(None, &offered, false, t1), Some(t1 + ttl));
        assert_eq!(
            holder_stops_by(Some(&seen), &held, false, t1),
            Some(t1 + ttl)
        );
        // Ended: no holder runs on.
        for phase in [LeasePhase::Completed, LeasePhase::Expired] {
            let ended = lease("u1", Some("w1"), phase, 100);
            assert_eq!(holder_stops_by(Some(&seen), &ended, true, t1), None);
            assert_eq!(holder_stops_by(Some(&seen), &ended, false, t1), None);
        }
    }

    #[test]
    fn a_deleted_tasks_attempt_is_timed_from_its_last_renewal_or_first_sight() {
        let tracker = Tracker::default();
        let t0 = Instant::now();
        let ttl = Duration::from_secs(30);
        let mut held = lease("u1", Some("w1"), LeasePhase::Held, 1);
        held.spec.task_uid = "task-uid".into();
        tracker.observe(&held, t0);
        // The garbage collector deletes the lease 10 s after the last
        // renewal was seen.
        let t1 = t0 + Duration::from_secs(10);
        tracker.forget(&held, t1);
        assert_eq!(tracker.departed_until("ns", "t-1"), Some(t0 + ttl));
        let long = Duration::from_secs(3600);
        assert_eq!(
            tracker.gone_attempt_left("ns", "t", "task-uid", 1, long, t1),
            ttl - Duration::from_secs(10)
        );
        assert_eq!(
            tracker.gone_attempt_left("ns", "t", "task-uid", 1, long, t0 + ttl),
            Duration::ZERO
        );
        // Another incarnation of the task under the same name: not this
        // departure; never seen, so timed from the first question, by the
        // TTL given (the lock's).
        assert_eq!(
            tracker.gone_attempt_left("ns", "t", "other-uid", 1, ttl, t1),
            ttl
        );
        assert_eq!(
            tracker.gone_attempt_left("ns", "t", "other-uid", 1, ttl, t1 + Duration::from_secs(5)),
            ttl - Duration::from_secs(5)
        );
        // A lease a relist no longer lists: a full TTL from the relist.
        let mut offered = lease("u2", None, LeasePhase::Offered, 1);
        offered.metadata.name = Some("t-2".into());
        offered.spec.task_uid = "task-uid".into();
        tracker.observe(&offered, t0);
        tracker.list_started();
        let t2 = t0 + Duration::from_secs(20);
        tracker.list_done(t2);
        assert_eq!(tracker.departed_until("ns", "t-2"), Some(t2 + ttl));
        // Deleted while offered, seen as such: no holder of its own to wait
        // for — but the task's earlier attempts (t-1, t-2) departed too and
        // may still run: the latest of them counts.
        let mut unclaimed = lease("u3", None, LeasePhase::Offered, 1);
        unclaimed.metadata.name = Some("t-3".into());
        unclaimed.spec.task_uid = "task-uid".into();
        tracker.observe(&unclaimed, t0);
        tracker.forget(&unclaimed, t1);
        assert_eq!(tracker.departed_until("ns", "t-3"), Some(t1));
        assert_eq!(
            tracker.gone_attempt_left("ns", "t", "task-uid", 3, long, t1),
            t2 + ttl - t1
        );
    }

    /// A held lease lost (deleted) and replaced under the same lock, then
    /// the task deleted while the replacement was only offered: the lock
    /// names the replacement's token, whose lease had no holder — but the
    /// lost attempt's worker runs until its kill switch.
    #[test]
    fn a_lock_named_for_a_replacement_waits_for_the_lost_attempt_too() {
        let tracker = Tracker::default();
        let t0 = Instant::now();
        let ttl = Duration::from_secs(30);
        let mut lost = lease("u1", Some("w1"), LeasePhase::Held, 1);
        lost.spec.task_uid = "task-uid".into();
        tracker.observe(&lost, t0);
        let t1 = t0 + Duration::from_secs(2);
        tracker.forget(&lost, t1);
        let mut replacement = lease("u2", None, LeasePhase::Offered, 1);
        replacement.metadata.name = Some("t-2".into());
        replacement.spec.task_uid = "task-uid".into();
        tracker.observe(&replacement, t1);
        let t2 = t0 + Duration::from_secs(5);
        tracker.forget(&replacement, t2);
        assert_eq!(
            tracker.gone_attempt_left("ns", "t", "task-uid", 2, ttl, t2),
            t0 + ttl - t2,
            "the lost attempt of token 1 may run until a TTL after its last renewal"
        );
        // Another task's departures do not count.
        let mut other = lease("u3", Some("w2"), LeasePhase::Held, 1);
        other.metadata.name = Some("o-1".into());
        other.spec.task_uid = "other-uid".into();
        tracker.observe(&other, t2);
        tracker.forget(&other, t2);
        assert_eq!(
            tracker.gone_attempt_left("ns", "t", "task-uid", 2, ttl, t0 + ttl),
            Duration::ZERO
        );
    }

    #[test]
    fn only_a_new_renew_time_is_a_renewal_after_a_conflict() {
        let cached = lease("u1", Some("w1"), LeasePhase::Held, 100);
        let mut labelled = cached.clone();
        labelled.metadata.labels = Some([("x".to_owned(), "y".to_owned())].into());
        assert!(!renewed_since(&cached, &labelled), "a label is no renewal");
        let renewed = lease("u1", Some("w1"), LeasePhase::Held, 101);
        assert!(renewed_since(&cached, &renewed));
        // Even a renewTime from the past is a change, hence a renewal.
        let old_clock = lease("u1", Some("w1"), LeasePhase::Held, 1);
        assert!(renewed_since(&cached, &old_clock));
        let completed = lease("u1", Some("w1"), LeasePhase::Completed, 100);
        assert!(
            renewed_since(&cached, &completed),
            "ended: leave it to settle"
        );
    }

    #[test]
    fn a_relist_forgets_leases_deleted_while_the_watch_was_down() {
        let tracker = Tracker::default();
        let t0 = Instant::now();
        let mut a = lease("u1", Some("w1"), LeasePhase::Held, 1);
        a.metadata.name = Some("t-1".into());
        let mut b = lease("u2", Some("w1"), LeasePhase::Held, 1);
        b.metadata.name = Some("t-2".into());
        tracker.observe(&a, t0);
        tracker.observe(&b, t0);
        assert_eq!(tracker.leases_of("ns", "t").len(), 2);
        // t-2 was deleted during a disconnect: the relist lists only t-1.
        tracker.list_started();
        tracker.observe(&a, t0 + std::time::Duration::from_secs(1));
        tracker.list_done(t0 + Duration::from_secs(1));
        assert_eq!(tracker.leases_of("ns", "t"), vec!["t-1".to_owned()]);
        assert!(tracker.observation("ns", "t-2").is_none());
        // The relist did not count as a renewal (same renewTime).
        assert_eq!(tracker.observation("ns", "t-1").unwrap().last_renewal, t0);
    }

    #[test]
    fn tracker_indexes_and_forgets() {
        let tracker = Tracker::default();
        let t0 = Instant::now();
        let held = lease("u1", Some("w1"), LeasePhase::Held, 1);
        tracker.observe(&held, t0);
        assert_eq!(tracker.leases_of("ns", "t"), vec!["t-1".to_owned()]);
        assert!(tracker.observation("ns", "t-1").is_some());
        let t1 = t0 + Duration::from_secs(3);
        tracker.touch("ns", "t-1", t1);
        assert_eq!(tracker.observation("ns", "t-1").unwrap().last_renewal, t1);
        tracker.forget(&held, t1);
        assert!(tracker.leases_of("ns", "t").is_empty());
        assert!(tracker.observation("ns", "t-1").is_none());
    }
}
