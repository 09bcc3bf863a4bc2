//! When did the operator last *see* each held lease renewed?
//!
//! Expiry is timed by the operator's monotonic clock at the moment a renewal
//! was observed, never by the `renewTime` a worker wrote: clocks skew, and an
//! observation is always later than the write it reports, so expiry can come
//! late but never early. A fresh process (restart, new leader) knows nothing
//! and so gives every held lease a full TTL from its first observation.
//!
//! The tracker also indexes leases by task so a reconcile finds a task's
//! leases without scanning the whole cache.

use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;

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

/// Pure: does `fresh` (read after a conflict) show a renewal since `cached`
/// — a new `renewTime` or holder, or a phase other than Held? Only that is a
/// sign of life; any other write (a label, an annotation) is not.
pub fn renewed_since(cached: &TaskLease, fresh: &TaskLease) -> bool {
    fresh.spec.renew_time != cached.spec.renew_time
        || fresh.spec.holder_identity != cached.spec.holder_identity
        || fresh.status.as_ref().and_then(|s| s.phase) != Some(LeasePhase::Held)
}

type Key = (String, String);

#[derive(Debug, Default)]
struct State {
    seen: HashMap<Key, Seen>,
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

    /// The (re)list ended: forget every lease it did not contain.
    pub fn list_done(&self) {
        let mut state = self.lock();
        let Some(listed) = state.listed.take() else {
            return;
        };
        let keep: std::collections::HashSet<&Key> = listed.iter().map(|(k, _)| k).collect();
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
        match next_seen(state.seen.get(&key), lease, now) {
            Some(seen) => {
                state.seen.insert(key, seen);
            }
            None => {
                state.seen.remove(&key);
            }
        }
    }

    /// Records a lease deletion.
    pub fn forget(&self, lease: &TaskLease) {
        let ns = lease.namespace().unwrap_or_default();
        let name = lease.name_any();
        let mut state = self.lock();
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

    /// Names of the leases of a task.
    pub fn leases_of(&self, namespace: &str, task: &str) -> Vec<String> {
        self.lock()
            .by_task
            .get(&(namespace.to_owned(), task.to_owned()))
            .map(|s| s.iter().cloned().collect())
            .unwrap_or_default()
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
        tracker.list_done();
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
        tracker.forget(&held);
        assert!(tracker.leases_of("ns", "t").is_empty());
        assert!(tracker.observation("ns", "t-1").is_none());
    }
}
