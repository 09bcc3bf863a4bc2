//! Renewals per worker (issue 27, design "Fleets"): each worker renews one
//! `WorkerLease` (the CRD of `api/src/worker_lease.rs`) listing the
//! attempts it keeps alive, instead of each TaskLease
//! ([`Config::per_worker`](crate::Config::per_worker)).
//!
//! - The worker mirrors the SDK to be. Its WorkerLease exists from its
//!   start (the presence record; idle renewals are not modelled). Its
//!   claim turns the offer's `spec.renewal` from `Lease` to `Worker` and
//!   writes the TaskLease's `renewTime`; from then on it renews its
//!   WorkerLease (a CAS of the spec on its copy) listing the attempt by
//!   name and UID; the attempt's `KillClock` is fed only by successful
//!   renewals that listed it, with their send time. A 409 makes it re-read
//!   its WorkerLease and stop an attempt revoked there; a 404 (the object
//!   deleted) stops its attempt and creates the WorkerLease again, empty.
//!   It also refreshes the TaskLease's own `renewTime` (at least every
//!   [`REFRESH_TTLS`]·TTL, the model's R) and stops the attempt when a
//!   refresh meets 404 or none succeeded for R + 2/3·TTL (`crate::worker`).
//! - The operator watches WorkerLeases through a cache of its own that
//!   lags like the others, and credits renewals to TaskLeases with the
//!   production rule (`batchlease_operator::worker_leases`): a new
//!   `renewTime` or a first sight ([`next_worker_seen`], [`credit`]), and a
//!   WorkerLease gone from its cache ([`WorkerSeen::departure`]: the
//!   Delete event's last state, which carries a renewal not seen or not).
//!   Before it ends a held lease claimed `Worker` (expiry, release) it
//!   revokes the attempt in the holder's WorkerLease by a CAS of the status
//!   on the copy it observed ([`WorkerRule::Revoke`]): the TaskLease's own
//!   CAS does not conflict with a renewal of another object, the
//!   WorkerLease's does. With no copy cached it ends the lease only once it
//!   has seen that WorkerLease depart after the claim was observed, and
//!   otherwise waits (see [`Cluster::fleet_guard`]).
//! - Faults ([`Config::worker_faults`](crate::Config::worker_faults), one
//!   budget): a renewal that drops the attempt from `holds` while the
//!   worker still runs it (renewing one but not another, never listing it
//!   again); a renewal that lands late (sent while the attempt was alive,
//!   applied any number of steps later: a zombie's write). A renewal's
//!   lost answer takes the shared `lost_answers` budget; a paused worker
//!   is any worker taking no step.
//! - Someone else deletes a WorkerLease
//!   ([`Config::worker_deletions`](crate::Config::worker_deletions)): safe
//!   with the departure credited (`docs/model.md`).

use batchlease_api::worker_lease::worker_lease_name;
use batchlease_api::{AttemptRef, LeasePhase, TaskLease, WorkerLease, WorkerLeaseSpec};
use batchlease_operator::revocation::revocation_holder;
use batchlease_operator::worker_leases::{credit, next_worker_seen};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::ResourceExt;

use crate::api_server::{Refused, decode, encode};
use crate::operator::Write;
use crate::worker::{Worker, worker_name};
use crate::{Action, Cluster, State, TTL_SECONDS};
#[cfg(doc)]
use batchlease_operator::worker_leases::WorkerSeen;

/// The model's R, in TTLs: the longest a worker goes without refreshing a
/// held TaskLease's `renewTime` (the SDK's is `max(TTL, 120 s)`; a small
/// R against the TTL keeps the bound on a deleted lease's holder short
/// enough to reach, and R > TTL/3 + 1 s is what makes it differ from the
/// per-lease one).
pub const REFRESH_TTLS: u32 = 2;

/// How the operator treats WorkerLeases.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WorkerRule {
    /// Credits renewals and departures with the production rule and
    /// revokes an attempt in its holder's WorkerLease (a CAS of its
    /// status) before expiring or releasing its lease.
    Revoke,
    /// The design as first written (a mutation): renewals credited with
    /// the production rule, the TaskLease expired by its own CAS alone —
    /// a renewal its cache has not shown yet does not stop the expiry.
    NoRevoke,
    /// Today's operator with a per-worker SDK (a mutation): WorkerLeases
    /// ignored, only a TaskLease's own `renewTime` counts.
    Ignore,
    /// A renewal credited only to the attempts the observed version lists
    /// (a mutation of the production rule, which credits every held lease
    /// of the worker but those whose listing it saw end): versions the
    /// operator's view skipped may have listed an attempt and fed its kill
    /// clock.
    NamedOnly,
    /// A WorkerLease's deletion credited as no renewal (a mutation of the
    /// production rule, which credits it when its last state carries a
    /// renewal not seen): the deletion hides renewals the operator's cache
    /// has not shown yet.
    IgnoreDepartures,
}

/// How the operator times the holder of a lost (deleted) lease of a
/// cancelled task: the `Lost` entry's wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LostWait {
    /// Today's `decide` (`lost_attempt_wait`): the lease's TTL (+ 1 s)
    /// after the loss was recorded — the per-lease bound.
    Ttl,
    /// The bound of the SDK's refresh rule, modelled on the status the
    /// operator writes: R + TTL after the loss was recorded (a
    /// Worker-mode holder stops at the latest R + 2/3·TTL after its last
    /// successful refresh, which landed before the deletion).
    RefreshBound,
}

/// A worker's side of its WorkerLease.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq)]
pub struct Client {
    /// Its last copy of the WorkerLease (JSON).
    pub copy: Option<String>,
    /// The tick of its last successful renewal (one per tick at most).
    pub last_ok: Option<u8>,
    /// A renewal on its way: sent at this tick, the WorkerLease as sent.
    pub in_flight: Option<(u8, String)>,
    /// Bound attempts: the recent writes of its WorkerLease it remembers,
    /// and the bound leases it has seen and not taken yet (by name).
    pub sent: Vec<crate::bound::Stamp>,
    pub bound: std::collections::BTreeMap<String, crate::bound::Pending>,
    /// Its WorkerLease was found gone at least once (the SDK's `lost_at`
    /// is set): not with [`crate::bound::BoundRule::FirstCut`].
    pub found_gone: bool,
}

/// Per-worker state of the clients, the fault budget and the ghosts.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq)]
pub struct Fleet {
    pub clients: Vec<Client>,
    pub faults: u8,
    pub deletions: u8,
    /// Coverage ghosts: a WorkerLease renewal kept an attempt alive past
    /// its claim's own kill switch; a worker stopped an attempt revoked in
    /// its WorkerLease; an expiry followed a fault of a WorkerLease; a late
    /// renewal naming an expired attempt reached the API server; a
    /// departure was credited to a held lease; a worker stopped its
    /// attempt on its WorkerLease's 404; an expiry followed the deletion
    /// of a WorkerLease; a worker stopped its attempt on a refresh's 404.
    pub kept_alive: bool,
    pub stopped_by_revocation: bool,
    pub expired_after_fault: bool,
    pub late_after_expiry: bool,
    pub departure_credited: bool,
    pub stopped_by_deletion: bool,
    pub expired_after_deletion: bool,
    pub stopped_by_refresh: bool,
    /// Idle renewals so far (budget `Config::idle_renewals`).
    pub idle: u8,
    /// Bound leases on their way to their workers, and coverage.
    pub bound: crate::bound::Ghosts,
}

impl Fleet {
    pub fn new(workers: usize) -> Self {
        Self {
            clients: vec![Client::default(); workers],
            ..Self::default()
        }
    }
}

/// How a renewal goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Send {
    Normal,
    /// Applied, the answer never arrives.
    AnswerLost,
    /// Sent now, applied in a later step ([`Action::RenewLands`]).
    Late,
    /// Drops the attempt from `holds` (for good) while it runs.
    Drop,
}

/// The WorkerLease of `holder` as its worker creates it, nothing held;
/// with bound attempts it takes them and carries `renew_time` (as the
/// SDK's create does), else no renewal yet.
fn fresh(holder: &str, slots: Option<i32>, renew_time: Option<MicroTime>) -> WorkerLease {
    let mut l = WorkerLease::new(
        &worker_lease_name(holder),
        WorkerLeaseSpec {
            holder_identity: holder.into(),
            queues: vec!["q".into()],
            lease_duration_seconds: TTL_SECONDS,
            takes_bound: renew_time.is_some().then_some(true),
            renew_time,
            holds: Vec::new(),
            slots,
        },
    );
    l.metadata.namespace = Some("ns".into());
    l
}

/// The attempt worker `w` runs, by name and UID (`None`: idle).
fn attempt_of(s: &State, w: usize) -> Option<AttemptRef> {
    match &s.workers[w] {
        Worker::Holding(a) => Some(AttemptRef::of(&decode::<TaskLease>(&a.copy))),
        Worker::Idle => None,
    }
}

impl Cluster {
    /// The start of a run in per-worker mode: each worker has created its
    /// WorkerLease (the SDK does at its start, before any claim).
    pub(crate) fn fleet_start(&self, s: &mut State) {
        for w in 0..s.fleet.clients.len() {
            self.create_worker_lease(s, w);
        }
    }

    /// Worker `w` creates its WorkerLease (saying [`crate::offers::SLOTS`]
    /// with addressed offers; carrying a `renewTime`, remembered as sent,
    /// with bound attempts).
    fn create_worker_lease(&self, s: &mut State, w: usize) {
        let slots = self.cfg.addressed.then_some(crate::offers::SLOTS);
        let stamp = self.cfg.bound.then(|| self.stamp(s, w));
        self.record_sent(s, w, stamp.as_ref());
        let created = s
            .api
            .create_worker_lease(&fresh(&worker_name(w), slots, stamp));
        s.fleet.clients[w].copy = created.ok().map(|c| encode(&c));
    }
}

impl Cluster {
    /// The per-worker renewal steps of worker `w`: renewals, once per tick
    /// at most, while its attempt lives; with bound attempts also while
    /// one waits for a renewal naming it (the first at once), and an idle
    /// worker's (a budget).
    pub(crate) fn fleet_steps(&self, s: &State, w: usize, actions: &mut Vec<Action>) {
        let holding = match &s.workers[w] {
            Worker::Holding(a) => Some(a),
            Worker::Idle => None,
        };
        // The refresh of the TaskLease's own `renewTime` (any tick: "at
        // least every R"). Offered only in bounds that delete TaskLeases,
        // where it is what tells a holder of the deletion; elsewhere it is
        // a renewal of the TaskLease, which the per-lease bounds check,
        // and would only grow the state space.
        if let Some(a) = holding
            && self.alive(a, s.now)
            && a.last_refresh_sent < s.now
            && self.cfg.lease_deletions > 0
        {
            actions.push(Action::Refresh(w));
        }
        let c = &s.fleet.clients[w];
        // One renewal at a time (its landing: `fleet_faults`).
        if c.in_flight.is_some() {
            return;
        }
        let paced = c.last_ok != Some(s.now);
        let running = holding.filter(|a| self.alive(a, s.now));
        let for_attempt = running.is_some_and(|a| a.last_ok_sent < s.now) && paced;
        let for_bound = self.cfg.bound
            && (crate::bound::due_at_once(s, w) || (crate::bound::names_any(s, w) && paced));
        let idle = self.cfg.bound
            && running.is_none()
            && !crate::bound::names_any(s, w)
            && s.fleet.idle < self.cfg.idle_renewals
            && paced;
        if !(for_attempt || for_bound || idle) {
            return;
        }
        actions.push(Action::Renew(w));
        if s.lost < self.cfg.lost_answers {
            actions.push(Action::RenewAnswerLost(w));
        }
        if s.fleet.faults < self.cfg.worker_faults {
            actions.push(Action::SendRenewal(w));
            if running.is_some_and(|a| !a.dropped) {
                actions.push(Action::DropAttempt(w));
            }
        }
    }

    /// A renewal on its way lands (whatever its worker does meanwhile);
    /// someone deletes a WorkerLease.
    pub(crate) fn fleet_faults(&self, s: &State, actions: &mut Vec<Action>) {
        for (w, c) in s.fleet.clients.iter().enumerate() {
            if c.in_flight.is_some() {
                actions.push(Action::RenewLands(w));
            }
        }
        if s.fleet.deletions < self.cfg.worker_deletions {
            for name in s.api.workers.keys() {
                actions.push(Action::DeleteWorkerLease(name.clone()));
            }
        }
    }

    /// Worker `w` renews its WorkerLease (a CAS of the spec on its copy),
    /// listing its attempt while it lives, and the bound attempts that
    /// wait for a renewal naming them (not one its copy shows revoked).
    pub(crate) fn fleet_renew(&self, s: &mut State, w: usize, how: Send) {
        let mut listed = Vec::new();
        let mut idle = true;
        let attempt = attempt_of(s, w);
        let now = s.now;
        let alive = matches!(&s.workers[w], Worker::Holding(a) if self.alive(a, now));
        if let (Some(attempt), true, Worker::Holding(a)) = (attempt, alive, &mut s.workers[w]) {
            if how == Send::Drop {
                a.dropped = true;
            }
            idle = false;
            if !a.dropped {
                listed.push(attempt);
            }
        }
        let Some(copy) = s.fleet.clients[w].copy.clone() else {
            return;
        };
        let mut l: WorkerLease = decode(&copy);
        if self.cfg.bound {
            // The SDK: revocations first, then the attempts named.
            crate::bound::revoked_in(s, w, &l);
            let named = crate::bound::named(s, w);
            idle &= named.is_empty();
            listed.extend(named);
            listed.sort();
            if idle {
                s.fleet.idle += 1;
            }
        }
        l.spec.holds = listed;
        let stamp = self.stamp(s, w);
        self.record_sent(s, w, Some(&stamp));
        l.spec.renew_time = Some(stamp);
        if matches!(how, Send::Late | Send::Drop) {
            s.fleet.faults += 1;
        }
        if how == Send::Late {
            s.fleet.clients[w].in_flight = Some((s.now, encode(&l)));
            return;
        }
        if how == Send::AnswerLost {
            s.lost += 1;
            s.lost_renewal = true;
        }
        self.fleet_land(s, w, s.now, &l, how == Send::AnswerLost);
    }

    /// Worker `w`'s late renewal reaches the API server.
    pub(crate) fn fleet_lands(&self, s: &mut State, w: usize) {
        let Some((sent, json)) = s.fleet.clients[w].in_flight.take() else {
            return;
        };
        let l: WorkerLease = decode(&json);
        let expired = l.holds().iter().any(|r| {
            s.api.lease(&r.name).is_some_and(|t| {
                t.uid().as_deref() == Some(r.uid.as_str())
                    && t.status.and_then(|st| st.phase) == Some(LeasePhase::Expired)
            })
        });
        s.fleet.late_after_expiry |= expired;
        self.fleet_land(s, w, sent, &l, false);
    }

    /// Renewal `l`, sent at tick `sent`, is applied; the worker learns the
    /// answer unless it is lost.
    fn fleet_land(&self, s: &mut State, w: usize, sent: u8, l: &WorkerLease, lost: bool) {
        let written = s.api.replace_worker_lease(l);
        if lost {
            return;
        }
        let attempt = attempt_of(s, w);
        match written {
            Ok(stored) => {
                if self.cfg.bound {
                    crate::bound::revoked_in(s, w, &stored);
                    crate::bound::fed(s, w, stored.holds(), sent);
                }
                let c = &mut s.fleet.clients[w];
                c.copy = Some(encode(&stored));
                c.last_ok = Some(sent);
                // The SDK: `KillClock::renewed(sent)` for each attempt the
                // renewal listed.
                if let (Worker::Holding(a), Some(attempt)) = (&mut s.workers[w], attempt)
                    && stored.holds().contains(&attempt)
                    && sent > a.last_ok_sent
                {
                    a.last_ok_sent = sent;
                    s.fleet.kept_alive |= sent >= a.claim_sent + 2;
                }
            }
            Err(Refused::Conflict | Refused::Invalid) => {
                let Some(fresh) = s.api.worker_lease(&l.name_any()) else {
                    self.fleet_gone(s, w);
                    return;
                };
                s.fleet.clients[w].copy = Some(encode(&fresh));
                if self.cfg.bound {
                    crate::bound::revoked_in(s, w, &fresh);
                }
                if attempt.is_some_and(|a| fresh.is_revoked(&a)) {
                    s.fleet.stopped_by_revocation = true;
                    crate::worker::end(s, w);
                }
            }
            Err(Refused::NotFound | Refused::AlreadyExists) => self.fleet_gone(s, w),
        }
    }

    /// Worker `w` found its WorkerLease deleted (404): the SDK stops every
    /// attempt (renewals it cannot make any more may already have been
    /// missed) and creates the object again with nothing listed — the
    /// revocations went with the old one, so it never lists an attempt
    /// claimed before. A bound attempt waiting for a renewal naming it is
    /// given up (`bound::lost`).
    fn fleet_gone(&self, s: &mut State, w: usize) {
        if matches!(s.workers[w], Worker::Holding(_)) {
            s.fleet.stopped_by_deletion = true;
            crate::worker::end(s, w);
        }
        if self.cfg.bound {
            crate::bound::lost(s, w, self.cfg.bound_rule);
        }
        self.create_worker_lease(s, w);
    }

    /// The operator's WorkerLease cache catches up: each renewal it shows,
    /// and each departure (a WorkerLease gone, with the last state its
    /// Delete event carries), is credited to the held leases of its cache
    /// by the production rule.
    pub(crate) fn fleet_sync(&self, s: &mut State) {
        let now = self.instant(s.now);
        let rule = self.cfg.worker_rule;
        let mut departures = Vec::new();
        for (name, rec) in &s.op.wseen {
            if s.api.workers.contains_key(name) {
                continue;
            }
            // The Delete event's last state, if it is of the object the
            // record is of (else a relist: unknown).
            let last = s
                .api
                .deleted_workers
                .get(name)
                .map(|j| decode::<WorkerLease>(j))
                .filter(|l| l.uid().as_deref() == Some(rec.uid()));
            if let Some(r) = rec.departure(last.as_ref(), Some("ns".into()), now)
                && rule != WorkerRule::IgnoreDepartures
            {
                departures.push(r);
            }
            // The leases of its holder whose claim it has observed by now:
            // those it may end on this departure (`fleet_guard`).
            let claimed =
                s.op.seen
                    .values()
                    .filter(|r| r.holder() == rec.holder())
                    .map(|r| r.uid().to_owned())
                    .collect();
            s.op.wgone.insert(name.clone(), claimed);
        }
        let mut renewals = Vec::new();
        let mut seen = std::collections::BTreeMap::new();
        for (name, json) in &s.api.workers {
            let l: WorkerLease = decode(json);
            let Some(o) = next_worker_seen(s.op.wseen.get(name), &l, now) else {
                continue;
            };
            renewals.extend(o.renewal);
            s.op.wgone.remove(name);
            seen.insert(name.clone(), o.seen);
        }
        if rule != WorkerRule::Ignore {
            let all = departures.iter().map(|r| (r, true));
            for (r, departure) in all.chain(renewals.iter().map(|r| (r, false))) {
                for (lease, rec) in &mut s.op.seen {
                    if rule == WorkerRule::NamedOnly && !r.names.iter().any(|a| &a.name == lease) {
                        continue;
                    }
                    if let Some(copy) = s.op.leases.get(lease) {
                        let next = credit(rec, &decode::<TaskLease>(copy), r);
                        s.fleet.departure_credited |= departure && next != *rec;
                        *rec = next;
                    }
                }
            }
        }
        s.op.wseen = seen;
        s.op.wleases = s.api.workers.clone();
        s.op.wlisted = true;
    }

    /// The operator's write `then` ending held lease `lease` on its own
    /// (expiry, release). For a lease claimed `Worker`: first the
    /// revocation of the attempt in its holder's WorkerLease as the
    /// operator's cache shows it (a CAS of the status). With no copy
    /// cached the operator cannot prove every renewal was observed: it
    /// ends the lease without a revocation only once it has seen that
    /// WorkerLease depart after it had observed the lease's claim (the
    /// departure credited; the worker stops its attempts at the 404 and
    /// never lists one claimed before in the object it creates again), and
    /// otherwise waits (`None`) for its cache to show one.
    pub(crate) fn fleet_guard(&self, s: &State, lease: &TaskLease, then: Write) -> Option<Write> {
        // Whose WorkerLease revokes it: the operator's own rule, on the
        // decided copy (read from the cache or directly) and the cache's.
        let cached: Option<TaskLease> = s.op.leases.get(&lease.name_any()).map(|c| decode(c));
        let Some(holder) = revocation_holder(lease, cached.as_ref()) else {
            return Some(then);
        };
        if matches!(
            self.cfg.worker_rule,
            WorkerRule::NoRevoke | WorkerRule::Ignore
        ) {
            return Some(then);
        }
        let name = worker_lease_name(holder);
        let attempt = AttemptRef::of(lease);
        let Some(cached) = s.op.wleases.get(&name) else {
            // Its claim observed before the departure was: in the order
            // the operator observed them, not by tick — within a tick the
            // claim may follow a departure (of a WorkerLease its worker
            // created again since, listing the claim).
            let uid = lease.uid()?;
            return s.op.wgone.get(&name)?.contains(&uid).then_some(then);
        };
        let mut l: WorkerLease = decode(cached);
        // A revocation stands: the CAS that wrote it proved every renewal
        // before it observed, and none after it names the attempt (its
        // kill switch had fired by then, and a renewal sent earlier meets
        // the new resourceVersion). Writing it again would only loop on a
        // stale cache of the TaskLeases.
        if l.is_revoked(&attempt) {
            return Some(then);
        }
        l.revoke(attempt);
        Some(Write::Revoke {
            lease: encode(&l),
            then: Box::new(then),
        })
    }
}

/// Coverage of renewals per worker (asserted by the bounds meant to reach
/// them); the safety properties are the existing ones — above all "no
/// storage write is accepted for an attempt whose lease expired".
pub(crate) fn properties() -> Vec<stateright::Property<Cluster>> {
    use stateright::Property;
    vec![
        Property::sometimes(
            "a WorkerLease's departure is credited to a held lease",
            |_, s: &State| s.fleet.departure_credited,
        ),
        Property::sometimes(
            "a worker stops its attempts when its WorkerLease is gone",
            |_, s: &State| s.fleet.stopped_by_deletion,
        ),
        Property::sometimes(
            "an expiry follows the deletion of a WorkerLease",
            |_, s: &State| s.fleet.expired_after_deletion,
        ),
        Property::sometimes(
            "a worker stops an attempt whose TaskLease refresh meets 404",
            |_, s: &State| s.fleet.stopped_by_refresh,
        ),
        Property::sometimes(
            "a WorkerLease renewal keeps an attempt alive past its claim's kill switch",
            |_, s: &State| s.fleet.kept_alive,
        ),
        Property::sometimes(
            "a worker stops an attempt revoked in its WorkerLease",
            |_, s: &State| s.fleet.stopped_by_revocation,
        ),
        Property::sometimes(
            "an expiry follows a fault of a WorkerLease",
            |_, s: &State| s.fleet.expired_after_fault,
        ),
        Property::sometimes(
            "a late WorkerLease renewal naming an expired attempt reaches the API server",
            |_, s: &State| s.fleet.late_after_expiry,
        ),
    ]
}
