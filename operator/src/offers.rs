//! Addressed offers (issue 27): each offer goes to one worker — the one
//! with the most free slots — which alone watches it, as the kubelet
//! watches only the pods bound to its node, so a lease's changes are sent
//! to its worker and the operator, not to every worker of the queue.
//!
//! A worker takes addressed offers when its WorkerLease says how many
//! `slots` it has (`batchlease_api::WorkerLeaseSpec::slots`); it then
//! watches the TaskLeases labelled `batchlease.dev/worker` with its
//! WorkerLease's name, and its queues' unaddressed offers. The operator
//! counts a worker's free slots from its own caches — its slots, less the
//! leases it holds, less the offers addressed to it (this book, which
//! records each address as it is written, so two passes in a row do not
//! give the same last slot twice) — never from a count the worker wrote.
//!
//! Safety does not rest on any of this: the CRD lets only the addressee
//! claim an addressed offer, and a re-address is a CAS on the unclaimed
//! lease, so a claim and a re-address cannot both land. Addressing is
//! about cost and liveness: an offer whose worker lapsed, or that its
//! worker left unclaimed past [`CLAIM_DEADLINE`] while another has a free
//! slot, is addressed again (`decide::leased`); with no live candidate its
//! address is dropped and any worker may claim it. A queue also served by
//! a worker that takes no addressed offers is offered to all ([`mixed`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;

use batchlease_api::keys::LABEL_WORKER;
use batchlease_api::{LeasePhase, TaskLease, WorkerLease};
use kube::ResourceExt;
use tokio::time::Instant;

/// A worker an offer may be addressed to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    /// Its holder identity (`spec.offeredTo`).
    pub identity: String,
    /// Its WorkerLease's name (the label it watches).
    pub label: String,
    /// Slots less held leases less offers addressed to it; may be negative
    /// when it holds more than it now says it has (a drain).
    pub free: i64,
}

/// Pure: the candidate to address, if any: the most free slots, ties by
/// name (deterministic, so tests and the model can say which), never
/// `exclude` (the worker an offer is being moved away from). When every
/// slot is taken the offer still goes to the least loaded worker, where it
/// waits for a slot of its own: a backlog is spread over the fleet's
/// watches, not sent to all of them.
pub fn choose<'a>(candidates: &'a [Candidate], exclude: Option<&str>) -> Option<&'a Candidate> {
    candidates
        .iter()
        .filter(|c| Some(c.identity.as_str()) != exclude)
        .min_by(|a, b| b.free.cmp(&a.free).then_with(|| a.label.cmp(&b.label)))
}

/// Pure: where an addressed offer goes when it is addressed again — `Some(Some(c))`
/// to `c`, `Some(None)` to nobody (any worker may claim it), `None` stays
/// where it is. A live worker slow to claim keeps it unless another has a
/// free slot now; one that lapsed loses it to the best other live worker,
/// or to nobody.
pub fn readdress<'a>(
    candidates: &'a [Candidate],
    from: &str,
    lapsed: bool,
) -> Option<Option<&'a Candidate>> {
    match choose(candidates, Some(from)) {
        Some(c) if lapsed || c.free > 0 => Some(Some(c)),
        Some(_) => None,
        None if lapsed => Some(None),
        None => None,
    }
}

/// How long an addressed offer may wait for its worker's claim before it is
/// moved to a worker with a free slot now (at most the lease's TTL): a
/// live worker with a free slot claims within a second; one whose slots
/// are all taken would pin the offer behind its longest task.
pub const CLAIM_DEADLINE: Duration = Duration::from_secs(15);

/// Pure: whether `lease` is an open offer — `Offered`, no holder — the
/// one predicate the book, the reconciler and the checks share.
pub fn is_open(lease: &TaskLease) -> bool {
    lease.status.as_ref().and_then(|s| s.phase) == Some(LeasePhase::Offered)
        && lease
            .spec
            .holder_identity
            .as_deref()
            .is_none_or(str::is_empty)
}

/// Pure: until when `w`, last seen renewed at `renewed`, may be addressed
/// offers: half its duration after that renewal — at least 1.5 of its
/// renewal periods (T/3 busy, 30 s of 90 idle), so a worker that died, or
/// a leftover WorkerLease seen anew by a fresh leader, stops attracting
/// offers well before its attempts expire — and only while it gives free
/// slots (`slots` > 0: not draining, its claim brake not engaged).
pub fn addressable_until(w: &WorkerLease, renewed: Instant) -> Option<Instant> {
    (w.spec.slots? > 0).then(|| renewed + duration(w) / 2)
}

/// Pure: the identities of `workers` (one namespace's WorkerLeases) that
/// take addressed offers (`slots` set, whatever their value).
pub fn addressable<'a>(workers: impl IntoIterator<Item = &'a WorkerLease>) -> HashSet<String> {
    workers
        .into_iter()
        .filter(|w| w.spec.slots.is_some())
        .filter_map(|w| w.worker().map(str::to_owned))
        .collect()
}

/// Pure: whether a queue served by `present` (the workers seen serving
/// it: presence records, WorkerLeases, holders of its leases) has one
/// that takes no addressed offers — an older SDK, or one renewing per
/// lease. Such a queue is offered to all, as before addressing: the others
/// would otherwise get every offer while it idles, and an older SDK tries
/// every offer it sees, addressed or not, at a cost per try.
pub fn mixed(present: &[String], addressable: &HashSet<String>) -> bool {
    present.iter().any(|p| !addressable.contains(p))
}

/// Pure: the workers among `workers` (one namespace's WorkerLeases) that
/// may be addressed an offer of `queue` at `now`: they serve the queue and
/// are [`addressable_until`] a time after `now`.
/// `renewed(w)`: when the operator last observed a renewal of `w`;
/// `held(identity)` and `addressed(identity)`: what it counts against
/// their slots.
pub fn candidates<'a>(
    workers: impl IntoIterator<Item = &'a WorkerLease>,
    queue: &str,
    now: Instant,
    renewed: impl Fn(&WorkerLease) -> Option<Instant>,
    held: impl Fn(&str) -> usize,
    addressed: impl Fn(&str) -> usize,
) -> Vec<Candidate> {
    workers
        .into_iter()
        .filter_map(|w| {
            let slots = w.spec.slots?;
            let identity = w.worker()?;
            if !w.spec.queues.iter().any(|q| q == queue) {
                return None;
            }
            let until = addressable_until(w, renewed(w)?)?;
            if until <= now {
                return None;
            }
            let used = held(identity).max(w.holds().len()) + addressed(identity);
            Some(Candidate {
                identity: identity.to_owned(),
                label: w.name_any(),
                free: i64::from(slots) - i64::try_from(used).unwrap_or(i64::MAX),
            })
        })
        .collect()
}

/// How long a renewal of `w` counts.
pub fn duration(w: &WorkerLease) -> Duration {
    Duration::from_secs(u64::try_from(w.spec.lease_duration_seconds.clamp(1, 3600)).unwrap_or(1))
}

/// `lease` addressed to `to` (or to nobody): `spec.offeredTo` and the label
/// its worker watches, which go together.
pub fn addressed(lease: &TaskLease, to: Option<&Candidate>) -> TaskLease {
    let mut out = lease.clone();
    out.spec.offered_to = to.map(|c| c.identity.clone());
    match to {
        Some(c) => {
            out.labels_mut()
                .insert(LABEL_WORKER.to_owned(), c.label.clone());
        }
        None => {
            out.labels_mut().remove(LABEL_WORKER);
        }
    }
    out
}

/// One addressed offer outstanding: to whom, since when.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Address {
    to: String,
    since: Instant,
    /// The task the offer is for, once known (from this process's create,
    /// or the watch): what to wake when the addressee goes
    /// ([`OfferBook::tasks_offered_to`]).
    task: Option<String>,
}

/// The offers this process addressed, or saw addressed, that are still
/// unclaimed: what a worker's free slots are counted against, and since
/// when each offer waits for its worker. Fed by the operator's own writes
/// (before the watch shows them) and by the lease watch (a claim or an end
/// takes an offer out). A fresh process starts empty and learns the
/// outstanding addresses from its first list.
#[derive(Debug, Default)]
pub struct OfferBook {
    state: Mutex<BookState>,
    /// Held from a choice to its record ([`OfferBook::choosing`]): two
    /// passes choosing at once would both see the same last free slot.
    choosing: tokio::sync::Mutex<()>,
}

type Key = (String, String);

/// Where an address comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Record {
    /// This process wrote it (its age starts now).
    Written,
    /// The lease watch showed it (an address already known keeps its age).
    Watched,
    /// A pass looked it up (keeps its age; not a sign the lease was listed).
    Looked,
}

#[derive(Debug, Default)]
struct BookState {
    /// (namespace, lease name) → its address.
    offers: HashMap<Key, Address>,
    /// During a (re)list of the lease watch: the offers listed, or written
    /// by this process, so far; at its end the others were deleted unseen.
    listing: Option<std::collections::HashSet<Key>>,
}

impl OfferBook {
    /// The operator wrote (or is about to write) `lease`'s address.
    pub fn addressed(&self, namespace: &str, lease: &str, to: Option<&str>, now: Instant) {
        self.record(
            (namespace.to_owned(), lease.to_owned()),
            to,
            None,
            now,
            Record::Written,
        );
    }

    /// The operator is about to create offer `lease` of `task` addressed
    /// to `to` (its task is known before the watch shows it).
    pub fn addressed_new(&self, namespace: &str, lease: &str, task: &str, to: &str, now: Instant) {
        let key = (namespace.to_owned(), lease.to_owned());
        self.record(key, Some(to), Some(task), now, Record::Written);
    }

    /// A lease event from the watch: an unclaimed addressed offer is
    /// (still) outstanding, counted from when this process first saw it
    /// addressed there; anything else is not.
    pub fn observe(&self, lease: &TaskLease, now: Instant) {
        let key = (lease.namespace().unwrap_or_default(), lease.name_any());
        let to = lease.spec.offered_to.as_deref().filter(|_| is_open(lease));
        self.record(key, to, Some(&lease.spec.task_name), now, Record::Watched);
    }

    /// Records `key` addressed to `to` (or to nobody) at `now`, as `how`
    /// says, for `task` when known (else the task already recorded);
    /// returns since when it is addressed there.
    fn record(
        &self,
        key: Key,
        to: Option<&str>,
        task: Option<&str>,
        now: Instant,
        how: Record,
    ) -> Instant {
        let keep_age = how != Record::Written;
        let mut state = self.lock();
        if how != Record::Looked
            && let Some(listing) = &mut state.listing
        {
            listing.insert(key.clone());
        }
        let offers = &mut state.offers;
        let Some(to) = to else {
            offers.remove(&key);
            return now;
        };
        match offers.get_mut(&key) {
            Some(a) if keep_age && a.to == to => {
                if let Some(t) = task {
                    a.task = Some(t.to_owned());
                }
                a.since
            }
            prev => {
                let task = task
                    .map(str::to_owned)
                    .or_else(|| prev.and_then(|a| a.task.clone()));
                offers.insert(
                    key,
                    Address {
                        to: to.to_owned(),
                        since: now,
                        task,
                    },
                );
                now
            }
        }
    }

    /// Taken while choosing an address and recording it.
    pub async fn choosing(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.choosing.lock().await
    }

    /// The lease left the cache.
    pub fn forget(&self, namespace: &str, lease: &str) {
        self.lock()
            .offers
            .remove(&(namespace.to_owned(), lease.to_owned()));
    }

    /// A (re)list of the lease watch begins.
    pub fn list_started(&self) {
        self.lock().listing = Some(std::collections::HashSet::new());
    }

    /// The (re)list ended: an offer it did not list (nor this process
    /// wrote meanwhile) is gone.
    pub fn list_done(&self) {
        let mut state = self.lock();
        if let Some(listing) = state.listing.take() {
            state.offers.retain(|k, _| listing.contains(k));
        }
    }

    /// Since when `lease` (an open offer: the caller checks) has been
    /// addressed to `to`, as this process knows it; recorded as `now` if it
    /// did not know (a fresh process between its list and the watch's
    /// first event of it).
    pub fn since(&self, namespace: &str, lease: &str, to: &str, now: Instant) -> Instant {
        self.record(
            (namespace.to_owned(), lease.to_owned()),
            Some(to),
            None,
            now,
            Record::Looked,
        )
    }

    /// How many outstanding offers of `namespace` are addressed to each
    /// worker.
    pub fn counts(&self, namespace: &str) -> BTreeMap<String, usize> {
        let mut out: BTreeMap<String, usize> = BTreeMap::new();
        for ((ns, _), a) in &self.lock().offers {
            if ns == namespace {
                *out.entry(a.to.clone()).or_default() += 1;
            }
        }
        out
    }

    /// The tasks whose outstanding offers in `namespace` are addressed to
    /// `to` (those whose task is known): woken when `to`'s WorkerLease is
    /// deleted, so they move at that pass instead of at its lapse or the
    /// claim deadline.
    pub fn tasks_offered_to(&self, namespace: &str, to: &str) -> Vec<String> {
        let mut out: Vec<String> = self
            .lock()
            .offers
            .iter()
            .filter(|((ns, _), a)| ns == namespace && a.to == to)
            .filter_map(|(_, a)| a.task.clone())
            .collect();
        out.sort();
        out
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BookState> {
        // A panic while holding this lock leaves plain data behind; keep going.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
#[path = "offers_tests.rs"]
mod tests;
