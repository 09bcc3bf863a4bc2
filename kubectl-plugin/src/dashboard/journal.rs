//! What the dashboard saw happen to each TaskLease while it watched: the
//! renewals (each new `spec.renewTime`), the checkpoints (each new
//! `status.checkpoint`) and the phase changes, with the time it saw them.
//!
//! A TaskLease holds only its *last* renewal and checkpoint; the attempt
//! timeline needs every one, and nothing in the cluster keeps them (the
//! audit log is not the user's to read). So the dashboard records what its
//! watch delivers, from the moment it starts: a renewal written while it
//! was not watching is not in the picture, and the page says so. Bounded
//! per lease and in leases kept, so a long-running dashboard does not grow
//! without end.

use std::collections::{BTreeMap, VecDeque};

use batchlease_api::{LeasePhase, TaskLease};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use serde::Serialize;

/// Marks kept per lease (the oldest are dropped first; the count of
/// dropped ones is kept so the page can say "and N earlier").
pub const MAX_MARKS_PER_LEASE: usize = 300;
/// Leases remembered; the least recently changed are forgotten first.
pub const MAX_LEASES: usize = 20_000;

/// One thing seen to happen to a lease.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase", tag = "kind")]
pub enum Mark {
    /// A new `spec.renewTime` (the holder's clock, as written).
    Renewal { at: Timestamp },
    /// A new `status.checkpoint`, seen at `seen` (the checkpoint carries
    /// no time of its own); `bytes` is its size.
    Checkpoint { seen: Timestamp, bytes: usize },
    /// The lease's phase became `phase`, seen at `seen`; `initial`: the
    /// phase it had when the dashboard first saw it (so `seen` is not when
    /// it became that).
    Phase {
        seen: Timestamp,
        phase: String,
        initial: bool,
    },
}

/// The marks of one lease and what the last observation was.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LeaseMarks {
    pub marks: Vec<Mark>,
    /// Marks dropped to keep within [`MAX_MARKS_PER_LEASE`].
    pub dropped: usize,
    #[serde(skip)]
    last_renew: Option<Timestamp>,
    /// A hash of the last checkpoint: a checkpoint may be 128 KiB, and
    /// 20,000 of them are not worth keeping to tell a new one.
    #[serde(skip)]
    last_checkpoint: Option<u64>,
    #[serde(skip)]
    last_phase: Option<LeasePhase>,
    #[serde(skip)]
    touched: u64,
}

/// Every lease's marks, keyed by `(namespace, name)`.
#[derive(Debug, Default)]
pub struct Journal {
    leases: BTreeMap<(String, String), LeaseMarks>,
    clock: u64,
    /// Keys in the order they were last touched (may hold stale entries;
    /// `touched` tells which is current).
    order: VecDeque<((String, String), u64)>,
}

impl Journal {
    /// Records what is new in `lease`, observed at `now`. The first sight
    /// of a lease records its current renewal, checkpoint and phase.
    pub fn observe(&mut self, lease: &TaskLease, now: Timestamp) {
        let key = (lease.namespace().unwrap_or_default(), lease.name_any());
        self.clock += 1;
        let clock = self.clock;
        let e = self.leases.entry(key.clone()).or_default();
        let before = e.marks.len() + e.dropped;
        let first_sight = e.touched == 0 && e.marks.is_empty();
        if let Some(r) = lease.spec.renew_time.as_ref().map(|t| t.0)
            && e.last_renew != Some(r)
        {
            e.last_renew = Some(r);
            push(e, Mark::Renewal { at: r });
        }
        let status = lease.status.clone().unwrap_or_default();
        if let Some(cp) = status.checkpoint.as_ref().map(|c| c.as_str())
            && e.last_checkpoint != Some(hash(cp))
        {
            e.last_checkpoint = Some(hash(cp));
            push(
                e,
                Mark::Checkpoint {
                    seen: now,
                    bytes: cp.len(),
                },
            );
        }
        if let Some(p) = status.phase
            && e.last_phase != Some(p)
        {
            e.last_phase = Some(p);
            push(
                e,
                Mark::Phase {
                    seen: now,
                    phase: format!("{p:?}"),
                    initial: first_sight,
                },
            );
        }
        if e.marks.len() + e.dropped != before || e.touched == 0 {
            e.touched = clock;
            self.order.push_back((key, clock));
        }
        self.evict();
    }

    /// Forgets a deleted lease.
    pub fn forget(&mut self, namespace: &str, name: &str) {
        self.leases.remove(&(namespace.to_owned(), name.to_owned()));
    }

    /// A journal of only the given leases' marks: what one page needs,
    /// copied out so the lock over the whole journal is held briefly.
    pub fn subset<'a>(&self, keys: impl IntoIterator<Item = (&'a str, &'a str)>) -> Journal {
        let mut out = Journal::default();
        for (ns, name) in keys {
            if let Some(m) = self.marks(ns, name) {
                out.leases
                    .insert((ns.to_owned(), name.to_owned()), m.clone());
            }
        }
        out
    }

    /// The marks of a lease, if any were seen.
    pub fn marks(&self, namespace: &str, name: &str) -> Option<&LeaseMarks> {
        self.leases.get(&(namespace.to_owned(), name.to_owned()))
    }

    fn evict(&mut self) {
        while self.leases.len() > MAX_LEASES {
            let Some((key, at)) = self.order.pop_front() else {
                return;
            };
            if self.leases.get(&key).is_some_and(|e| e.touched == at) {
                self.leases.remove(&key);
            }
        }
        // Stale entries of the order queue are bounded by the live ones.
        if self.order.len() > 4 * MAX_LEASES.max(self.leases.len()) {
            let leases = &self.leases;
            self.order
                .retain(|(k, at)| leases.get(k).is_some_and(|e| e.touched == *at));
        }
    }
}

fn hash(s: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    s.hash(&mut h);
    h.finish()
}

fn push(e: &mut LeaseMarks, m: Mark) {
    if e.marks.len() >= MAX_MARKS_PER_LEASE {
        e.marks.remove(0);
        e.dropped += 1;
    }
    e.marks.push(m);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{lease, ts};
    use batchlease_api::JsonObject;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;

    fn renewed(mut l: TaskLease, s: i64) -> TaskLease {
        l.spec.renew_time = Some(MicroTime(ts(s)));
        l
    }

    #[test]
    fn each_new_renewal_checkpoint_and_phase_is_a_mark_and_repeats_are_not() {
        let mut j = Journal::default();
        let l = renewed(lease("l1", "q", LeasePhase::Held, Some("w"), ts(0)), 10);
        j.observe(&l, ts(11));
        // The same object again (a resync): nothing new.
        j.observe(&l, ts(12));
        let l = renewed(l, 20);
        j.observe(&l, ts(21));
        let mut l = l;
        if let Some(s) = l.status.as_mut() {
            s.checkpoint = JsonObject::from_text(r#"{"step":1}"#).ok();
        }
        j.observe(&l, ts(22));
        if let Some(s) = l.status.as_mut() {
            s.phase = Some(LeasePhase::Expired);
        }
        j.observe(&l, ts(40));
        let m = &j
            .marks("ns", "l1")
            .map(|m| m.marks.clone())
            .unwrap_or_default();
        assert_eq!(
            m,
            &vec![
                Mark::Renewal { at: ts(10) },
                Mark::Phase {
                    seen: ts(11),
                    phase: "Held".into(),
                    initial: true,
                },
                Mark::Renewal { at: ts(20) },
                Mark::Checkpoint {
                    seen: ts(22),
                    bytes: 10
                },
                Mark::Phase {
                    seen: ts(40),
                    phase: "Expired".into(),
                    initial: false,
                },
            ]
        );
    }

    #[test]
    fn marks_per_lease_are_bounded_and_the_dropped_are_counted() {
        let mut j = Journal::default();
        let base = lease("l1", "q", LeasePhase::Held, Some("w"), ts(0));
        for s in 0..(MAX_MARKS_PER_LEASE as i64 + 5) {
            j.observe(&renewed(base.clone(), s), ts(s));
        }
        let m = j.marks("ns", "l1").cloned().unwrap_or_default();
        assert_eq!(m.marks.len(), MAX_MARKS_PER_LEASE);
        // 305 renewals and one phase mark: six dropped.
        assert_eq!(m.dropped, 6);
        assert_eq!(
            m.marks.last(),
            Some(&Mark::Renewal {
                at: ts(MAX_MARKS_PER_LEASE as i64 + 4)
            })
        );
    }

    #[test]
    fn a_forgotten_lease_has_no_marks() {
        let mut j = Journal::default();
        j.observe(&lease("l1", "q", LeasePhase::Offered, None, ts(0)), ts(1));
        assert!(j.marks("ns", "l1").is_some());
        j.forget("ns", "l1");
        assert!(j.marks("ns", "l1").is_none());
    }
}
