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
use batchlease_api::{LeasePhase, Renewal, TaskLease, WorkerLease};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
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
    /// It takes bound attempts: the `renewTime` of its WorkerLease as the
    /// operator observed it, which a lease bound to it cites ([`bound`]).
    pub bind_at: Option<MicroTime>,
    /// When the operator observed that renewal as it happened (`None`: it
    /// saw it only in a list, which may show a renewal made long before).
    pub renewed: Option<Instant>,
}

/// What the operator saw of a worker's renewals (`WorkerTracker`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Renewals {
    /// Its last renewal seen, in a list or not: whether it is live.
    pub seen: Instant,
    /// Its last renewal observed as it happened (a watch event outside a
    /// list): whether a lease may be bound to it ([`bound`]).
    pub observed: Option<Instant>,
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
/// `renewed(w)`: what the operator saw of `w`'s renewals;
/// `held(identity)` and `addressed(identity)`: what it counts against
/// their slots; `ended(attempt)`: the lease cache shows that attempt over
/// (a WorkerLease lists what its worker ran until its next renewal, up to
/// TTL/3 after the attempt ended, and counting those would take slots that
/// are free — and bound attempts with them).
pub fn candidates<'a>(
    workers: impl IntoIterator<Item = &'a WorkerLease>,
    queue: &str,
    now: Instant,
    renewed: impl Fn(&WorkerLease) -> Option<Renewals>,
    held: impl Fn(&str) -> usize,
    addressed: impl Fn(&str) -> usize,
    ended: impl Fn(&batchlease_api::AttemptRef) -> bool,
) -> Vec<Candidate> {
    workers
        .into_iter()
        .filter_map(|w| {
            let slots = w.spec.slots?;
            let identity = w.worker()?;
            if !w.spec.queues.iter().any(|q| q == queue) {
                return None;
            }
            let renewed = renewed(w)?;
            let until = addressable_until(w, renewed.seen)?;
            if until <= now {
                return None;
            }
            let listed = w.holds().iter().filter(|a| !ended(a)).count();
            let used = held(identity).max(listed) + addressed(identity);
            Some(Candidate {
                identity: identity.to_owned(),
                label: w.name_any(),
                free: i64::from(slots) - i64::try_from(used).unwrap_or(i64::MAX),
                bind_at: w
                    .spec
                    .renew_time
                    .clone()
                    .filter(|_| w.spec.takes_bound == Some(true)),
                renewed: renewed.observed,
            })
        })
        .collect()
}

/// Pure: the free slots between `candidates` when every one of them takes
/// bound attempts — an issue held until one is free is then created bound
/// (`queue_gate::worker_slots`) — or `None` when there is none, or one
/// that only claims: its offers cost a claim anyway, and a backlog
/// addressed to it is as cheap as one held here. `awaited`: workers of the
/// queue that take bound attempts but are not candidates now ([`awaited`]:
/// resting, or silent for a while); with no candidate but these, issues
/// wait (none free) for them rather than go out open to every worker.
pub fn bindable_free(candidates: &[Candidate], awaited: usize) -> Option<usize> {
    if candidates.is_empty() {
        return (awaited > 0).then_some(0);
    }
    if candidates.iter().any(|c| c.bind_at.is_none()) {
        return None;
    }
    Some(
        candidates
            .iter()
            .map(|c| usize::try_from(c.free).unwrap_or(0))
            .sum(),
    )
}

/// How long at least a worker that takes bound attempts and has gone
/// silent keeps its queues' issues waiting for it ([`awaited`]).
pub const SILENT_AWAITED: Duration = Duration::from_secs(60);

/// Pure: until when a worker that takes bound attempts, silent since
/// `silent` (its last renewal observed, or the operator's WorkerLease
/// watch's last error if later: `WorkerTracker::silent_since`), is awaited
/// by its queues when it is no candidate: twice its duration, at least
/// [`SILENT_AWAITED`].
///
/// Why wait for a silent worker: its renewals stop in every outage of the
/// API server or etcd, for every worker at once. Were its queues then
/// offered open to all, the pass of every held task after the outage (the
/// watches relist) would issue the whole backlog in one burst — two writes
/// a task, to an API server just back, which in the 1,000-fault soak cost
/// the leader its term, again and again — as open offers its workers must
/// claim, one write more each. Waiting, the first renewal that lands
/// wakes as many issues as it has slots, created bound. Why from the
/// watch's last error: during the outage the operator sees no renewal of
/// anyone, which says nothing of the workers. Why not forever: a worker
/// that died without deleting its WorkerLease (outside a pod, no garbage
/// collection) would hold its queues' tasks back for good; past this, they
/// go out open, as with no worker (the next look of a waiter, within
/// 30 s, finds it so). A new leader first sees every WorkerLease at its
/// list, which counts as a renewal: a dead worker's leftover is awaited
/// again for a while after each leader change.
pub fn awaited_until(w: &WorkerLease, silent: Instant) -> Instant {
    silent + (duration(w) * 2).max(SILENT_AWAITED)
}

/// Pure: how many of `workers` (one namespace's WorkerLeases) that serve
/// `queue`, take bound attempts and take addressed offers (`slots` set)
/// are awaited at `now` — silent (`silent(w)`) for less than
/// [`awaited_until`] allows. The `awaited` of [`bindable_free`], which
/// reads it only when no worker is a candidate: then these are
/// - resting: live but giving no slots (`slots: 0`: draining, their claim
///   brake engaged), so issues wait rather than go out open just when the
///   workers say they take no more;
/// - silent: not renewed within half their duration (not addressable),
///   as every worker during an outage — a worker resting when it went
///   silent included (a claim brake engages under faults).
pub fn awaited<'a>(
    workers: impl IntoIterator<Item = &'a WorkerLease>,
    queue: &str,
    now: Instant,
    silent: impl Fn(&WorkerLease) -> Option<Instant>,
) -> usize {
    workers
        .into_iter()
        .filter(|w| w.spec.takes_bound == Some(true) && w.spec.slots.is_some())
        .filter(|w| w.spec.queues.iter().any(|q| q == queue))
        .filter(|w| silent(w).is_some_and(|s| awaited_until(w, s) > now))
        .count()
}

/// Pure: the renewal a worker declined to start a bound attempt on —
/// `(holder, the renewTime the attempt cited)` — when `lease` is a bound
/// attempt given back unstarted as `BOUND_UNCONFIRMED`, or expired
/// `BOUND_NOT_TAKEN` (no renewal of its worker named it within a TTL: the
/// worker is frozen, partitioned or gone, yet still addressable — an idle
/// one up to 45 s after its last renewal — and, every slot free, the
/// first pick for the next bind).
pub fn declined_citation(lease: &TaskLease) -> Option<(String, MicroTime)> {
    let st = lease.status.as_ref()?;
    let declined = matches!(
        st.reason.as_deref(),
        Some(batchlease_api::BOUND_UNCONFIRMED | batchlease_api::BOUND_NOT_TAKEN)
    );
    if !declined || !st.phase.is_some_and(LeasePhase::is_terminal) {
        return None;
    }
    Some((
        lease.spec.holder_identity.clone()?,
        lease.spec.bound_at.clone()?,
    ))
}

/// Pure: whether `w`'s current renewal is one its worker declined
/// (`declined`: the last renewal declined by that worker, from
/// [`OfferBook::declined`]). Such a worker is no candidate until it renews
/// again: every attempt bound to it now would cite the same renewal and
/// be given back the same way. After a worker process restarts, the
/// operator binds to it citing the renewal of the process before, until
/// it sees the new one's: in the 1,000-fault soak each restart cost about
/// three issues and give-backs so, in a loop of issue, give-back and
/// issue again.
pub fn cites_declined(w: &WorkerLease, declined: Option<&MicroTime>) -> bool {
    declined.is_some_and(|d| w.spec.renew_time.as_ref() == Some(d))
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

/// Pure: `lease` (a new offer, already [`addressed`] to `to`) bound to
/// `to` — created `Held` by it, to be renewed through its WorkerLease, no
/// claim — when `to` has a free slot, takes bound attempts, and was seen
/// renewing less than half the lease's TTL before `now` (a renewal seen
/// in a list does not count: a new leader's first list, or a relist after
/// an outage, shows renewals made long before, which the worker could
/// only give back or confirm by a renewal of its own — in the 1,000-fault
/// soak, attempts bound at each leader change expired `BoundNotTaken`);
/// `None`: it stays an offer for `to` to claim.
///
/// Why fresh: a worker that stopped (a crash, a pause) keeps a WorkerLease
/// that looks live for half its duration — 45 s when it was idle — and an
/// attempt bound to it would wait a whole TTL to expire, where an offer is
/// moved at its claim deadline. Half a TTL is also how old the cited
/// renewal may be for the worker to start from it without sending another
/// (`worker::bound`); a worker busy renewing every TTL/3 always is.
///
/// Why it is safe without the claim's compare-and-swap: the lease cites
/// (`spec.boundAt`) the WorkerLease renewal the operator had observed
/// before this create was sent. Its worker counts the attempt's kill clock
/// from when it sent that renewal, so the kill switch fires 2/3·TTL after
/// a send that came before the operator's first sight of the lease, where
/// its own expiry clock starts; every later end goes through a revocation
/// on the WorkerLease as for a claimed attempt (`effects::revoke`).
pub fn bound(lease: &TaskLease, to: &Candidate, now: Instant) -> Option<TaskLease> {
    let ttl =
        Duration::from_secs(u64::try_from(lease.spec.lease_duration_seconds.max(1)).unwrap_or(1));
    let fresh = to
        .renewed
        .is_some_and(|r| now.saturating_duration_since(r) < ttl / 2);
    let at = to.bind_at.clone().filter(|_| to.free > 0 && fresh)?;
    let mut out = lease.clone();
    out.spec.holder_identity = Some(to.identity.clone());
    out.spec.renewal = Some(Renewal::Worker);
    out.spec.renew_time = Some(at.clone());
    out.spec.bound_at = Some(at);
    out.status.get_or_insert_with(Default::default).phase = Some(LeasePhase::Held);
    Some(out)
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

/// How long a declined renewal is remembered: far longer than a worker
/// goes without renewing (a renewal not seen again is forgotten).
const DECLINED_KEPT: Duration = Duration::from_secs(3600);

#[derive(Debug, Default)]
struct BookState {
    /// (namespace, lease name) → its address.
    offers: HashMap<Key, Address>,
    /// (namespace, worker identity) → the last renewal it declined to
    /// start a bound attempt on ([`declined_citation`]), and when seen.
    declined: HashMap<Key, (MicroTime, Instant)>,
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
        let ns = lease.namespace().unwrap_or_default();
        if let Some((holder, at)) = declined_citation(lease) {
            let mut state = self.lock();
            state
                .declined
                .retain(|_, (_, seen)| now.saturating_duration_since(*seen) < DECLINED_KEPT);
            // The latest citation declined (a list may show an older
            // give-back after a newer one): the worker renews forward.
            let key = (ns.clone(), holder);
            if state.declined.get(&key).is_none_or(|(d, _)| *d < at) {
                state.declined.insert(key, (at, now));
            }
        }
        let key = (ns, lease.name_any());
        let to = lease.spec.offered_to.as_deref().filter(|_| is_open(lease));
        self.record(key, to, Some(&lease.spec.task_name), now, Record::Watched);
    }

    /// The last renewal worker `identity` of `namespace` declined to start
    /// a bound attempt on, if the lease watch showed one.
    pub fn declined(&self, namespace: &str, identity: &str) -> Option<MicroTime> {
        self.lock()
            .declined
            .get(&(namespace.to_owned(), identity.to_owned()))
            .map(|(at, _)| at.clone())
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
