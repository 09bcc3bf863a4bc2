//! Renewals per worker (issue 27): when does a renewal of a worker's
//! Lease count as a renewal of one of its TaskLeases?
//!
//! A WorkerLease lists the attempts its worker keeps alive
//! (`spec.holds`, see `batchlease_api::worker_lease`); the SDK
//! feeds each attempt's kill clock only from renewals that listed it, and
//! lists an attempt from the first renewal after its claim until it has
//! stopped, never again after. The operator times expiry by what it
//! *observes*, as for per-lease renewals (`observe::next_seen`): a change
//! of the worker Lease's `renewTime` seen at `now` is a renewal at `now` —
//! never the written value.
//!
//! **The rule**: a renewal of worker `H`'s Lease counts for every TaskLease
//! still `Held` by `H` — except an attempt the operator has seen that Lease
//! list and, at a later observation, no longer list: that one's listing is
//! over, and renewals after the observation that showed it ended are not
//! credited to it (the observation that shows the end still is) — until a
//! version names it again, which is credited as any naming one.
//!
//! Why not "the renewals that name it": the operator's view skips
//! versions (a relist after a watch outage, a cache that catches up in
//! one step), and a version it never saw may have listed an attempt and
//! fed its kill clock. The model checker found it (`docs/model.md`,
//! "Renewals per worker"): a worker Lease first seen at the renewal that
//! dropped a still-running attempt credited nothing, and the attempt,
//! kept alive by the versions in between, wrote after its expiry.
//! Crediting more than the worker renewed only delays an expiry. The cost:
//! an attempt whose listing the operator never saw is kept alive while its
//! worker renews — bounded by the SDK's rule (listed within T/3 of the
//! claim) and, against a worker that breaks it, by the never-listed rule
//! below while the watch does not skip.
//!
//! **Never listed**: from 2·TTL after the claim was observed, renewals are
//! not credited to an attempt that no version observed without a gap
//! since then has named — and only renewals the watch delivered with no
//! version skipped since before the claim was observed
//! ([`never_listed_until`]; after a relist, a first sight or a watch error
//! a skipped version may have named it, and renewals are credited as
//! above).
//!
//! Not credited: a renewal observed before the TaskLease's claim was, a
//! TaskLease no longer `Held` by that worker (a zombie's late write naming
//! an expired attempt renews nothing; the expired lease is frozen), one
//! claimed to be renewed per lease (`spec.renewal` not `Worker`), another
//! worker's or namespace's lease. A deletion of the WorkerLease counts as a
//! renewal observed then if its last state carries a `renewTime` not seen
//! before (the watch delivers every change before the deletion), and a
//! relist that no longer lists it as one observed at the relist: renewals
//! may have landed unseen, and whoever deleted it, the attempts they fed
//! run until their kill switch.
//!
//! Observing alone does not make expiry safe with a lagging cache: the
//! TaskLease's expiry CAS does not conflict with a renewal of another
//! object. The operator revokes the attempt in the WorkerLease by a CAS on
//! the copy it observed before it expires or releases the TaskLease
//! (`effects::revoke`).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;

use batchlease_api::{AttemptRef, LeasePhase, TaskLease, WorkerLease};
use kube::ResourceExt;
use tokio::time::Instant;

use crate::observe::{Seen, Tracker};
use crate::offers::Renewals;
use tracing::{error, info};

/// The last state seen of one WorkerLease.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct WorkerSeen {
    uid: String,
    holder: String,
    renew_marker: Option<String>,
    holds: BTreeSet<AttemptRef>,
    /// Attempts seen listed by this object and, later, no longer listed.
    ended: BTreeSet<AttemptRef>,
    /// When a renewal of this object was last observed (its first sight
    /// counts): whether its worker is live, for addressing offers.
    renewed_at: Instant,
    /// When a renewal of it was last observed as it happened: a watch
    /// event outside a (re)list. What a list shows may be a renewal made
    /// long before (a new leader's first list, a relist after an outage),
    /// too old to bind an attempt to (`offers::bound`).
    renewal_observed: Option<Instant>,
}

impl WorkerSeen {
    /// The worker's identity.
    pub fn holder(&self) -> &str {
        &self.holder
    }

    /// The attempts the last observed version listed.
    pub fn holds(&self) -> &BTreeSet<AttemptRef> {
        &self.holds
    }

    /// Attempts whose listing was seen to end (a tracker forgets them with
    /// their TaskLease).
    pub fn ended(&self) -> &BTreeSet<AttemptRef> {
        &self.ended
    }

    /// The UID of the object the record is of.
    pub fn uid(&self) -> &str {
        &self.uid
    }

    /// When a renewal of it was last observed.
    pub fn renewed_at(&self) -> Instant {
        self.renewed_at
    }

    /// The renewal that the deletion of this object, with last state
    /// `last` (`None`: unknown — it left a relist), shows at `now`: one if
    /// a renewal may have landed after the last one seen.
    pub fn departure(
        &self,
        last: Option<&WorkerLease>,
        namespace: Option<String>,
        now: Instant,
    ) -> Option<Renewal> {
        let renewed = last.is_none_or(|l| renew_marker(l) != self.renew_marker);
        renewed.then(|| Renewal {
            holder: self.holder.clone(),
            namespace,
            names: last
                .map(|l| l.holds().iter().cloned().collect())
                .unwrap_or_default(),
            ended: self.ended.clone(),
            revoked: last
                .map(|l| l.revoked().iter().cloned().collect())
                .unwrap_or_default(),
            at: now,
            gapless_since: None,
        })
    }
}

/// `renewTime` as a marker, compared for equality only: the value is the
/// worker's clock.
fn renew_marker(w: &WorkerLease) -> Option<String> {
    w.spec.renew_time.as_ref().map(|t| t.0.to_string())
}

/// A renewal of a WorkerLease, observed at `at`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Renewal {
    pub holder: String,
    /// The namespace of the WorkerLease, whose TaskLeases it keeps alive.
    pub namespace: Option<String>,
    /// The attempts the observed version lists (informational: the rule
    /// credits every held lease of the holder but `ended`).
    pub names: BTreeSet<AttemptRef>,
    /// Attempts not credited: their listing was seen to end at an earlier
    /// observation.
    pub ended: BTreeSet<AttemptRef>,
    /// Attempts not credited: revoked in the observed version. Once the
    /// revocation landed no renewal can keep them alive (a renewal based
    /// on an older version fails), so this one and every later one says
    /// nothing of them — and crediting them would keep an attempt its
    /// worker stopped listing alive for as long as the worker renews.
    pub revoked: BTreeSet<AttemptRef>,
    pub at: Instant,
    /// Since when the watch has delivered every version of this object
    /// without a gap (its first sight, or the last relist): set by
    /// [`WorkerTracker`]; `None` (unknown) counts as a gap. The
    /// never-listed rule applies only to renewals gap-free since before
    /// the claim was observed.
    pub gapless_since: Option<Instant>,
}

/// What one observation of a WorkerLease gives: the new record, and the
/// renewal observed, if any.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerObservation {
    pub seen: WorkerSeen,
    pub renewal: Option<Renewal>,
}

/// How much of a worker's silence the watch's errors may excuse
/// ([`WorkerTracker::silent_since`]): longer than any outage the operator
/// should ride out without opening a queue to all.
pub const SILENCE_EXCUSED: Duration = Duration::from_secs(600);

/// Pure: since when a worker last seen renewed at `renewed` counts as
/// silent, the WorkerLease watch having last failed at `failed_at`: from
/// that failure if later, by at most [`SILENCE_EXCUSED`].
pub fn silent_since(renewed: Instant, failed_at: Option<Instant>) -> Instant {
    failed_at.map_or(renewed, |f| f.clamp(renewed, renewed + SILENCE_EXCUSED))
}

/// Pure: the record of WorkerLease `lease` seen at `now`, given the
/// previous one, and the renewal observed now, if any (a new `renewTime`,
/// or a first sight of the object). `None` when `lease` is not well formed
/// (`WorkerLease::worker`).
pub fn next_worker_seen(
    prev: Option<&WorkerSeen>,
    lease: &WorkerLease,
    now: Instant,
) -> Option<WorkerObservation> {
    let holder = lease.worker()?.to_owned();
    let uid = lease.uid().unwrap_or_default();
    let renew_marker = renew_marker(lease);
    let holds: BTreeSet<AttemptRef> = lease.holds().iter().cloned().collect();
    // Another object under the name (deleted and created again) starts
    // afresh: its worker lists what still runs.
    let same_object = prev.filter(|p| p.uid == uid && p.holder == holder);
    let mut ended_before = same_object.map(|p| p.ended.clone()).unwrap_or_default();
    // Named again after its listing was seen to end (the SDK never does;
    // another process of the same identity, adopting the object, could):
    // credited again. Crediting more only delays an expiry — a renewal
    // that feeds a kill clock must never go uncredited.
    ended_before.retain(|a| !holds.contains(a));
    let mut ended = ended_before.clone();
    if let Some(p) = same_object {
        ended.extend(p.holds.difference(&holds).cloned());
    }
    let renewed = same_object.is_none_or(|p| p.renew_marker != renew_marker);
    let renewal = renewed.then(|| Renewal {
        holder: holder.clone(),
        namespace: lease.metadata.namespace.clone(),
        names: holds.clone(),
        ended: ended_before,
        revoked: lease.revoked().iter().cloned().collect(),
        at: now,
        gapless_since: None,
    });
    Some(WorkerObservation {
        seen: WorkerSeen {
            uid,
            holder,
            renew_marker,
            holds,
            ended,
            renewed_at: match same_object {
                Some(p) if !renewed => p.renewed_at,
                _ => now,
            },
            renewal_observed: match same_object {
                Some(p) if !renewed => p.renewal_observed,
                _ => Some(now),
            },
        },
        renewal,
    })
}

/// Pure: the attempts of `ended` to keep: those its holder still holds per
/// worker (`held`, by the lease tracker), and those whose end was first
/// seen (`ended_at`) less than [`ENDED_KEPT`] before `now`. No renewal is
/// credited to an attempt no longer Held per worker by the renewal's
/// holder, so a record need not keep it — but the lease watch may lag the
/// WorkerLease watch (a claim not yet seen as held), and an entry dropped
/// then would let later renewals feed an attempt its worker stopped
/// listing. Kept an hour, past any such lag; without pruning the set grew
/// by every attempt the worker ever ran and was cloned into every renewal.
pub fn prune_ended(
    mut ended: BTreeSet<AttemptRef>,
    held: &BTreeSet<AttemptRef>,
    ended_at: impl Fn(&AttemptRef) -> Instant,
    now: Instant,
) -> BTreeSet<AttemptRef> {
    ended.retain(|a| held.contains(a) || now.saturating_duration_since(ended_at(a)) < ENDED_KEPT);
    ended
}

/// How long an ended attempt stays in its WorkerLease's record once the
/// lease tracker no longer shows it held ([`prune_ended`]).
pub const ENDED_KEPT: Duration = Duration::from_secs(3600);

/// How long the operator waits for the WorkerLease watch's first list
/// before it degrades to renewals per lease ([`list_degraded`]).
pub const LIST_GRACE: Duration = Duration::from_secs(60);

/// Pure: whether an operator whose WorkerLease watch started at `started`
/// and has `synced` (its first list in) or not is degraded at `now`: no
/// list for [`LIST_GRACE`]. Until the first list every queue whose
/// workers take bound attempts waits for their slots, and no renewal
/// through a WorkerLease can be credited; a list that never comes (the
/// CRD not installed — `helm upgrade` does not upgrade CRDs — or
/// list/watch not granted) would stall every queue for good, per-lease
/// workers' queues too. Degraded, the operator issues open offers that
/// are claimed and renewed per lease, as before WorkerLeases existed.
pub fn list_degraded(synced: bool, started: Option<Instant>, now: Instant) -> bool {
    !synced && started.is_some_and(|t| now.saturating_duration_since(t) >= LIST_GRACE)
}

/// Pure: the record `seen` of TaskLease `lease` (from `observe::next_seen`
/// on this very copy) with `renewal` credited to it — its last renewal
/// becomes the renewal's instant — when the rule says so (see the
/// module); otherwise `seen` unchanged.
pub fn credit(seen: &Seen, lease: &TaskLease, renewal: &Renewal) -> Seen {
    let held = lease.status.as_ref().and_then(|s| s.phase) == Some(LeasePhase::Held);
    let this_copy = held
        && lease.renewed_per_worker()
        && lease.spec.holder_identity.as_deref() == Some(seen.holder())
        && seen.uid() == lease.uid().unwrap_or_default()
        && lease.metadata.namespace == renewal.namespace;
    if !this_copy {
        return seen.clone();
    }
    credit_seen(seen, &lease.name_any(), renewal)
}

/// Pure: [`credit`] on the tracker's record alone: `seen` is the record of
/// TaskLease `name` in the renewal's namespace (the tracker's index of
/// leases held per worker finds them).
pub fn credit_seen(seen: &Seen, name: &str, renewal: &Renewal) -> Seen {
    let attempt = AttemptRef {
        name: name.to_owned(),
        uid: seen.uid().to_owned(),
    };
    let ours = seen.per_worker_held() && seen.holder() == renewal.holder;
    // Every version of the WorkerLease since before the claim was observed
    // has been seen: none that named this attempt was skipped.
    let gap_free = ours
        && renewal
            .gapless_since
            .is_some_and(|t| t < seen.observation.claimed_at);
    let listed = seen.listed() || (gap_free && renewal.names.contains(&attempt));
    let never_listed = gap_free && !listed && renewal.at >= never_listed_until(seen);
    let credited = ours
        && !renewal.ended.contains(&attempt)
        && !renewal.revoked.contains(&attempt)
        // Observed before the claim was: it says nothing of this attempt.
        && renewal.at >= seen.observation.claimed_at
        && !never_listed;
    let mut out = if listed && !seen.listed() {
        seen.seen_listed()
    } else {
        seen.clone()
    };
    if credited {
        out.observation.last_renewal = out.observation.last_renewal.max(renewal.at);
    }
    if ours && renewal.at >= seen.observation.claimed_at && renewal.names.contains(&attempt) {
        out.observation.named = true;
    }
    out
}

/// Pure: from when renewals of its holder's WorkerLease no longer keep
/// alive an attempt that no gap-free version observed since its claim
/// has named — 2·TTL after the claim was observed (by this process: a new
/// leader starts it afresh) — provided the watch delivered every version
/// of that WorkerLease since before then. The SDK names an attempt within
/// TTL/3 of its claim; a worker that lost track of a claim, or never
/// lists, would otherwise keep its task for as long as it renews.
///
/// Why gap-free only: a version the watch skipped (a relist) may have
/// named the attempt and fed its kill clock, then a later one dropped it
/// while it still ran (the model checker's counterexample for crediting
/// only named attempts). With every version seen since before the claim
/// was observed, a naming version observed after the claim marks the
/// attempt listed (one observed while the lease watch had not yet stored
/// the claim was written before that instant), and one observed before
/// `claimed_at` was sent before it: the kill clock it fed ran out by
/// `claimed_at` + 2/3·TTL, while an end the cut-off brings comes after
/// `claimed_at` + 2·TTL. The attempt then lives up to about 3·TTL.
pub fn never_listed_until(seen: &Seen) -> Instant {
    seen.observation.claimed_at + 2 * seen.ttl()
}

type Key = (String, String);

#[derive(Debug, Default)]
struct State {
    /// (namespace, WorkerLease name) → its record.
    seen: HashMap<Key, WorkerSeen>,
    /// When each ended attempt of a record was first seen ended
    /// ([`prune_ended`]).
    ended_at: HashMap<(Key, AttemptRef), Instant>,
    /// During a (re)list: the WorkerLeases listed so far.
    listed: Option<HashSet<Key>>,
    /// Attempts whose WorkerLease a read found gone: when (see
    /// [`WorkerTracker::found_gone`]).
    found_gone: HashMap<(String, AttemptRef), Instant>,
    /// The first list is in.
    synced: bool,
    /// (namespace, WorkerLease name) → since when the watch has delivered
    /// every version of it (its first sight, or the last relist).
    gapless_since: HashMap<Key, Instant>,
    /// When the watch last reported an error: renewals may have gone
    /// unseen until then, so no worker has been silent since longer.
    failed_at: Option<Instant>,
    /// When the watch was started (`None`: not yet).
    started: Option<Instant>,
    /// The watch's last error, as it said it: the cause a degraded
    /// operator names.
    last_error: Option<String>,
    /// Degraded was logged (once per degradation).
    degraded_logged: bool,
}

/// The WorkerLeases as the watch shows them, crediting each renewal it
/// observes to the TaskLease records of [`Tracker`].
#[derive(Debug, Default)]
pub struct WorkerTracker {
    state: Mutex<State>,
}

impl WorkerTracker {
    /// A (re)list of the watch begins.
    pub fn list_started(&self) {
        self.lock().listed = Some(HashSet::new());
    }

    /// Whether `w` is a version this tracker observed (and credited):
    /// same object, same `renewTime` as its record. A copy the operator
    /// read itself may carry a renewal the watch has not shown yet.
    pub fn observed(&self, w: &WorkerLease) -> bool {
        let key = (w.namespace().unwrap_or_default(), w.name_any());
        self.lock().seen.get(&key).is_some_and(|s| {
            s.uid == w.uid().unwrap_or_default() && s.renew_marker == renew_marker(w)
        })
    }

    /// When a renewal of WorkerLease `name` in `namespace` was last
    /// observed, if the watch shows it.
    pub fn renewed_at(&self, namespace: &str, name: &str) -> Option<Instant> {
        self.lock()
            .seen
            .get(&(namespace.to_owned(), name.to_owned()))
            .map(|s| s.renewed_at)
    }

    /// What the watch showed of `w`'s renewals (one read of its record):
    /// its last renewal seen, and the last observed as it happened (not in
    /// a list) — the latter only while `w` is the version the record is
    /// of, the one a lease bound to it would cite (the watch feeds this
    /// tracker before the cache that `w` comes from).
    pub fn renewals(&self, w: &WorkerLease) -> Option<Renewals> {
        let key = (w.namespace().unwrap_or_default(), w.name_any());
        let state = self.lock();
        let s = state.seen.get(&key)?;
        let current = s.uid == w.uid().unwrap_or_default() && s.renew_marker == renew_marker(w);
        Some(Renewals {
            seen: s.renewed_at,
            observed: s.renewal_observed.filter(|_| current),
        })
    }

    /// Since when WorkerLease `name` in `namespace` may have been silent,
    /// as far as the watch can tell: its last renewal observed, or the
    /// watch's last error if later (an outage of the API server hides the
    /// renewals it stops; it is not the worker's silence). What a queue's
    /// wait for a silent worker counts from (`offers::awaited`).
    ///
    /// At most [`SILENCE_EXCUSED`] after its last renewal: a watch that
    /// keeps failing (not an outage: one that ends) must not have a dead
    /// worker's leftover WorkerLease hold its queues for good.
    pub fn silent_since(&self, namespace: &str, name: &str) -> Option<Instant> {
        let state = self.lock();
        let renewed = state
            .seen
            .get(&(namespace.to_owned(), name.to_owned()))
            .map(|s| s.renewed_at)?;
        Some(silent_since(renewed, state.failed_at))
    }

    /// Whether the watch delivered its first complete list: before, an
    /// attempt's WorkerLease renewals may not have been credited yet.
    pub fn listed(&self) -> bool {
        self.lock().synced
    }

    /// The watch starts now (what [`WorkerTracker::degraded`] counts from).
    pub fn watch_started(&self, now: Instant) {
        self.lock().started.get_or_insert(now);
    }

    /// Whether the operator runs degraded, without WorkerLeases
    /// ([`list_degraded`]); logged once, with the watch's last error.
    pub fn degraded(&self, now: Instant) -> bool {
        let mut state = self.lock();
        let degraded = list_degraded(state.synced, state.started, now);
        if degraded && !state.degraded_logged {
            state.degraded_logged = true;
            error!(
                cause = state.last_error.as_deref().unwrap_or("no answer"),
                grace = ?LIST_GRACE,
                "the WorkerLease watch has not listed: offers are claimed and renewed per lease, not per worker, and no queue waits for worker slots (is the WorkerLease CRD installed, and may the operator list and watch workerleases?)"
            );
        }
        degraded
    }

    /// Why the WorkerLease watch has not listed, while degraded: its last
    /// error, for the Events that name the cause.
    pub fn degraded_cause(&self, now: Instant) -> Option<String> {
        let state = self.lock();
        list_degraded(state.synced, state.started, now).then(|| {
            state
                .last_error
                .clone()
                .unwrap_or_else(|| "the WorkerLease watch has not listed".into())
        })
    }

    /// The watch's error, as it said it (kept for [`WorkerTracker::degraded_cause`]).
    pub fn watch_error(&self, now: Instant, cause: String) {
        self.watch_failed(now);
        self.lock().last_error = Some(cause);
    }

    /// A WorkerLease event from the watch (apply or initial list).
    pub fn observe(&self, w: &WorkerLease, leases: &Tracker, now: Instant) {
        let key = (w.namespace().unwrap_or_default(), w.name_any());
        // Taken before this tracker's lock (the lease tracker never calls
        // back into this one).
        let held = w
            .worker()
            .map(|h| leases.held_per_worker(&key.0, h))
            .unwrap_or_default();
        let mut state = self.lock();
        let relisting = state.listed.is_some();
        if let Some(listed) = &mut state.listed {
            listed.insert(key.clone());
        }
        let prev_uid = state.seen.get(&key).map(|p| p.uid.clone());
        let prev_observed = state.seen.get(&key).and_then(|p| p.renewal_observed);
        // The first event of a known object after a watch error: a resumed
        // watch replays what happened while it was down, late.
        let resumed = prev_uid.is_some() && !state.gapless_since.contains_key(&key);
        match next_worker_seen(state.seen.get(&key), w, now) {
            Some(mut o) => {
                for a in &o.seen.ended {
                    state
                        .ended_at
                        .entry((key.clone(), a.clone()))
                        .or_insert(now);
                }
                let since = |a: &AttemptRef| {
                    state
                        .ended_at
                        .get(&(key.clone(), a.clone()))
                        .copied()
                        .unwrap_or(now)
                };
                o.seen.ended = prune_ended(std::mem::take(&mut o.seen.ended), &held, since, now);
                let kept = &o.seen.ended;
                state
                    .ended_at
                    .retain(|(k, a), _| k != &key || kept.contains(a));
                // A list shows the version as it is, not when it was made;
                // a resumed watch, versions made while it was down.
                if relisting || resumed {
                    o.seen.renewal_observed =
                        prev_observed.filter(|_| prev_uid.as_deref() == Some(o.seen.uid.as_str()));
                }
                // A relist may have skipped versions; so may a first
                // sight, another object under the name, or the events
                // before a watch error (no mark since): gap-free from now.
                if relisting
                    || prev_uid.as_deref() != Some(o.seen.uid.as_str())
                    || !state.gapless_since.contains_key(&key)
                {
                    state.gapless_since.insert(key.clone(), now);
                }
                let gapless_since = state.gapless_since.get(&key).copied();
                state.seen.insert(key.clone(), o.seen);
                drop(state);
                if let Some(mut r) = o.renewal {
                    r.gapless_since = gapless_since;
                    apply(&key.0, &r, leases);
                }
            }
            None => {
                state.seen.remove(&key);
                state.gapless_since.remove(&key);
            }
        }
    }

    /// The watch reported an error: a version may have been lost (one that
    /// did not decode is skipped without a relist), so every WorkerLease
    /// counts as seen without a gap only from its next observation on.
    pub fn watch_failed(&self, now: Instant) {
        let mut state = self.lock();
        state.gapless_since.clear();
        state.failed_at = Some(now);
    }

    /// A WorkerLease deletion (`last`: its final state from the Delete
    /// event): a renewal not seen before counts as observed now.
    pub fn forget(&self, last: &WorkerLease, leases: &Tracker, now: Instant) {
        let key = (last.namespace().unwrap_or_default(), last.name_any());
        let prev = {
            let mut state = self.lock();
            state.gapless_since.remove(&key);
            state.ended_at.retain(|(k, _), _| k != &key);
            state.seen.remove(&key)
        };
        // A departure is a renewal only when its last state carries a
        // renewTime never seen — a version was skipped: no gap-free mark.
        if let Some(r) = prev.and_then(|p| p.departure(Some(last), last.namespace(), now)) {
            apply(&key.0, &r, leases);
        }
    }

    /// The (re)list ended: a WorkerLease it no longer lists was deleted
    /// while the watch was down, with renewals perhaps unseen — a renewal
    /// observed now. Returns the holders gone so, by namespace.
    pub fn list_done(&self, leases: &Tracker, now: Instant) -> Vec<(String, String)> {
        let mut state = self.lock();
        let Some(listed) = state.listed.take() else {
            return Vec::new();
        };
        if !state.synced && state.degraded_logged {
            info!("the WorkerLease watch has listed: offers may be renewed per worker again");
        }
        state.synced = true;
        let gone: Vec<(Key, WorkerSeen)> = state
            .seen
            .iter()
            .filter(|(k, _)| !listed.contains(*k))
            .map(|(k, s)| (k.clone(), s.clone()))
            .collect();
        for (k, _) in &gone {
            state.seen.remove(k);
            state.gapless_since.remove(k);
            state.ended_at.retain(|(key, _), _| key != k);
        }
        state
            .found_gone
            .retain(|_, at| now.saturating_duration_since(*at) < FOUND_GONE_KEPT);
        drop(state);
        let mut holders = Vec::with_capacity(gone.len());
        for ((ns, _), seen) in gone {
            if let Some(r) = seen.departure(None, Some(ns.clone()), now) {
                apply(&ns, &r, leases);
            }
            holders.push((ns, seen.holder().to_owned()));
        }
        holders
    }

    /// A read found no WorkerLease for `attempt`'s holder (the cache had
    /// none either). The first time: `false`, and the caller counts a
    /// renewal observed now — the object that fed the attempt was gone at
    /// this read, so its renewals all landed before it, but some may be
    /// unseen. Afterwards `true`: a TTL from that read, the attempt has
    /// stopped.
    pub fn found_gone(&self, namespace: &str, attempt: &AttemptRef, now: Instant) -> bool {
        let mut state = self.lock();
        let key = (namespace.to_owned(), attempt.clone());
        if state.found_gone.contains_key(&key) {
            return true;
        }
        state.found_gone.insert(key, now);
        false
    }

    #[cfg(test)]
    fn ended_for_tests(&self, namespace: &str, holder: &str) -> BTreeSet<AttemptRef> {
        let name = batchlease_api::worker_lease::worker_lease_name(holder);
        self.lock()
            .seen
            .get(&(namespace.to_owned(), name))
            .map(|s| s.ended.clone())
            .unwrap_or_default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding this lock leaves plain data behind; keep going.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// How long a "found gone" stays remembered: past any TTL.
const FOUND_GONE_KEPT: std::time::Duration = std::time::Duration::from_secs(7200);

fn apply(namespace: &str, renewal: &Renewal, leases: &Tracker) {
    leases.credit_holder(namespace, &renewal.holder, |name, seen| {
        credit_seen(seen, name, renewal)
    });
}

#[cfg(test)]
#[path = "worker_leases_tests.rs"]
mod tests;
