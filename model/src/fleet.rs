//! Renewals per worker (issue 27, design "Fleets"): each worker renews one
//! worker Lease listing the attempts it keeps alive, instead of each
//! TaskLease ([`Config::per_worker`](crate::Config::per_worker)).
//!
//! - The worker mirrors the SDK to be: its claim still writes the
//!   TaskLease's `renewTime`; from then on it renews only its worker Lease
//!   (a CAS on its copy; a create when it has none), listing its attempt;
//!   the attempt's `KillClock` is fed only by successful renewals that
//!   listed it, with their send time. A 409 or an AlreadyExists makes it
//!   re-read its Lease and stop an attempt the operator revoked there.
//! - The operator watches worker Leases through a cache of its own that
//!   lags like the others, and credits renewals to TaskLeases with the
//!   production rule (`batchlease_operator::worker_leases`). Before it
//!   expires or releases a held lease it revokes the attempt in the
//!   holder's worker Lease by a CAS on the copy it observed
//!   ([`WorkerRule::Revoke`]): the TaskLease's own CAS does not conflict
//!   with a renewal of another object, the worker Lease's does.
//! - Faults ([`Config::worker_faults`](crate::Config::worker_faults), one
//!   budget): a renewal that drops the attempt from `holds` while the
//!   worker still runs it (renewing one but not another, never listing it
//!   again); a renewal that lands late (sent while the attempt was alive,
//!   applied any number of steps later: a zombie's write). A renewal's
//!   lost answer takes the shared `lost_answers` budget; a paused worker
//!   is any worker taking no step.
//! - Someone else deletes a worker Lease
//!   ([`Config::worker_deletions`](crate::Config::worker_deletions)): the
//!   checker finds this unsafe — the deletion hides renewals the
//!   operator's cache has not shown yet, and no write after it can prove
//!   there were none — so admission must keep worker Leases holder-only
//!   for DELETE too (`docs/model.md`).

use std::collections::BTreeSet;

use batchlease_api::keys::{LABEL_WORKER, presence_name};
use batchlease_api::worker_lease::{holds, revoke, revoked, set_holds};
use batchlease_api::{LeasePhase, TaskLease};
use batchlease_operator::worker_leases::{credit, next_worker_seen};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::ResourceExt;

use crate::api_server::{Refused, decode, encode};
use crate::operator::Write;
use crate::worker::{Worker, worker_name};
use crate::{Action, Cluster, State, TTL_SECONDS};

/// How the operator treats worker Leases.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WorkerRule {
    /// Credits renewals with the production rule and revokes an attempt
    /// in its holder's worker Lease (a CAS) before expiring or releasing
    /// its lease.
    Revoke,
    /// The design as first written (a mutation): renewals credited with
    /// the production rule, the TaskLease expired by its own CAS alone —
    /// a renewal its cache has not shown yet does not stop the expiry.
    NoRevoke,
    /// Today's operator with a per-worker SDK (a mutation): worker Leases
    /// ignored, only a TaskLease's own `renewTime` counts.
    Ignore,
    /// A renewal credited only to the attempts the observed version lists
    /// (a mutation of the production rule, which credits every held lease
    /// of the worker but those whose listing it saw end): versions the
    /// operator's view skipped may have listed an attempt and fed its kill
    /// clock.
    NamedOnly,
}

/// A worker's side of its worker Lease.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq)]
pub struct Client {
    /// Its last copy of the Lease (JSON); `None`: it creates one.
    pub copy: Option<String>,
    /// The tick of its last successful renewal (one per tick at most).
    pub last_ok: Option<u8>,
    /// A renewal on its way: sent at this tick, the Lease as sent, and
    /// whether it is a create.
    pub in_flight: Option<(u8, String, bool)>,
}

/// Per-worker state of the clients, the fault budget and the ghosts.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq)]
pub struct Fleet {
    pub clients: Vec<Client>,
    pub faults: u8,
    pub deletions: u8,
    /// Coverage ghosts: a worker-Lease renewal kept an attempt alive past
    /// its claim's own kill switch; a worker stopped an attempt revoked in
    /// its Lease; an expiry followed a fault of a worker Lease; a late
    /// renewal naming an expired attempt reached the API server.
    pub kept_alive: bool,
    pub stopped_by_revocation: bool,
    pub expired_after_fault: bool,
    pub late_after_expiry: bool,
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

/// The worker Lease of `holder` as first written (no renewal yet).
fn fresh(holder: &str) -> Lease {
    let mut l = Lease::default();
    l.metadata.name = Some(presence_name(holder));
    l.metadata.namespace = Some("ns".into());
    l.labels_mut().insert(LABEL_WORKER.into(), "true".into());
    l.spec = Some(LeaseSpec {
        holder_identity: Some(holder.into()),
        lease_duration_seconds: Some(TTL_SECONDS),
        ..LeaseSpec::default()
    });
    l
}

impl Cluster {
    /// The per-worker renewal steps of worker `w`, which holds an attempt
    /// (renewals, once per tick at most, while the attempt lives).
    pub(crate) fn fleet_steps(&self, s: &State, w: usize, actions: &mut Vec<Action>) {
        let Worker::Holding(a) = &s.workers[w] else {
            return;
        };
        let c = &s.fleet.clients[w];
        // One renewal at a time (its landing: `fleet_faults`).
        if c.in_flight.is_some() {
            return;
        }
        if !self.alive(a, s.now) || a.last_ok_sent >= s.now || c.last_ok == Some(s.now) {
            return;
        }
        actions.push(Action::Renew(w));
        if s.lost < self.cfg.lost_answers {
            actions.push(Action::RenewAnswerLost(w));
        }
        if s.fleet.faults < self.cfg.worker_faults {
            actions.push(Action::SendRenewal(w));
            if !a.dropped {
                actions.push(Action::DropAttempt(w));
            }
        }
    }

    /// A renewal on its way lands (whatever its worker does meanwhile);
    /// someone deletes a worker Lease.
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

    /// Worker `w` renews its worker Lease, listing its attempt.
    pub(crate) fn fleet_renew(&self, s: &mut State, w: usize, how: Send) {
        let Worker::Holding(a) = &mut s.workers[w] else {
            return;
        };
        let me = worker_name(w);
        if how == Send::Drop {
            a.dropped = true;
        }
        let listed: BTreeSet<String> = if a.dropped {
            BTreeSet::new()
        } else {
            BTreeSet::from([a.lease.clone()])
        };
        let c = &s.fleet.clients[w];
        let create = c.copy.is_none();
        let mut l = c
            .copy
            .as_deref()
            .map_or_else(|| fresh(&me), decode::<Lease>);
        set_holds(&mut l, &listed);
        let stamp = self.wall(s.now, s.api.worker_writes(&presence_name(&me)));
        if let Some(spec) = l.spec.as_mut() {
            spec.renew_time = Some(MicroTime(stamp));
        }
        if matches!(how, Send::Late | Send::Drop) {
            s.fleet.faults += 1;
        }
        if how == Send::Late {
            s.fleet.clients[w].in_flight = Some((s.now, encode(&l), create));
            return;
        }
        if how == Send::AnswerLost {
            s.lost += 1;
            s.lost_renewal = true;
        }
        self.fleet_land(s, w, s.now, &l, create, how == Send::AnswerLost);
    }

    /// Worker `w`'s late renewal reaches the API server.
    pub(crate) fn fleet_lands(&self, s: &mut State, w: usize) {
        let Some((sent, json, create)) = s.fleet.clients[w].in_flight.take() else {
            return;
        };
        let l: Lease = decode(&json);
        let expired = holds(&l).iter().any(|name| {
            s.api
                .lease(name)
                .is_some_and(|t| t.status.and_then(|st| st.phase) == Some(LeasePhase::Expired))
        });
        s.fleet.late_after_expiry |= expired;
        self.fleet_land(s, w, sent, &l, create, false);
    }

    /// Renewal `l`, sent at tick `sent`, is applied; the worker learns the
    /// answer unless it is lost.
    fn fleet_land(&self, s: &mut State, w: usize, sent: u8, l: &Lease, create: bool, lost: bool) {
        let written = if create {
            s.api.create_worker_lease(l)
        } else {
            s.api.replace_worker_lease(l)
        };
        if lost {
            return;
        }
        match written {
            Ok(stored) => {
                let c = &mut s.fleet.clients[w];
                c.copy = Some(encode(&stored));
                c.last_ok = Some(sent);
                // The SDK: `KillClock::renewed(sent)` for each attempt the
                // renewal listed.
                if let Worker::Holding(a) = &mut s.workers[w]
                    && holds(&stored).contains(&a.lease)
                    && sent > a.last_ok_sent
                {
                    a.last_ok_sent = sent;
                    s.fleet.kept_alive |= sent >= a.claim_sent + 2;
                }
            }
            Err(Refused::Conflict | Refused::AlreadyExists) => {
                let name = l.name_any();
                let fresh = s.api.worker_lease(&name);
                s.fleet.clients[w].copy = fresh.as_ref().map(encode);
                let stop = match (&fresh, &s.workers[w]) {
                    (Some(f), Worker::Holding(a)) => revoked(f).contains(&a.lease),
                    _ => false,
                };
                if stop {
                    s.fleet.stopped_by_revocation = true;
                    crate::worker::end(s, w);
                }
            }
            Err(_) => s.fleet.clients[w].copy = None,
        }
    }

    /// The operator's worker-Lease cache catches up: each renewal it shows
    /// is credited to the held leases of its cache by the production rule.
    pub(crate) fn fleet_sync(&self, s: &mut State) {
        let now = self.instant(s.now);
        let mut seen = std::collections::BTreeMap::new();
        for (name, json) in &s.api.workers {
            let l: Lease = decode(json);
            let Some(o) = next_worker_seen(s.op.wseen.get(name), &l, now) else {
                continue;
            };
            if let Some(r) = &o.renewal
                && self.cfg.worker_rule != WorkerRule::Ignore
            {
                let named_only = self.cfg.worker_rule == WorkerRule::NamedOnly;
                for (lease, rec) in &mut s.op.seen {
                    if named_only && !r.names.contains(lease) {
                        continue;
                    }
                    if let Some(copy) = s.op.leases.get(lease) {
                        *rec = credit(rec, &decode::<TaskLease>(copy), r);
                    }
                }
            }
            seen.insert(name.clone(), o.seen);
        }
        s.op.wseen = seen;
        s.op.wleases = s.api.workers.clone();
    }

    /// The operator's write `then` ending held lease `lease` on its own
    /// (expiry, release), preceded by the revocation of the attempt in its
    /// holder's worker Lease as the operator's cache shows it (a CAS; a
    /// create when its cache shows none).
    pub(crate) fn fleet_guard(&self, s: &State, lease: &TaskLease, then: Write) -> Write {
        let holder = lease.spec.holder_identity.as_deref().unwrap_or("");
        if !self.cfg.per_worker || self.cfg.worker_rule != WorkerRule::Revoke || holder.is_empty() {
            return then;
        }
        let cached = s.op.wleases.get(&presence_name(holder));
        let mut l = cached.map_or_else(|| fresh(holder), |j| decode::<Lease>(j));
        // A revocation stands: the CAS that wrote it proved every renewal
        // before it observed, and none after it names the attempt (its
        // kill switch had fired by then, and a renewal sent earlier meets
        // the new resourceVersion). Writing it again would only loop on a
        // stale cache of the TaskLeases.
        if revoked(&l).contains(&lease.name_any()) {
            return then;
        }
        revoke(&mut l, &lease.name_any());
        Write::Revoke {
            lease: encode(&l),
            create: cached.is_none(),
            then: Box::new(then),
        }
    }
}

/// Coverage of renewals per worker (asserted by the bounds meant to reach
/// them); the safety properties are the existing ones — above all "no
/// storage write is accepted for an attempt whose lease expired".
pub(crate) fn properties() -> Vec<stateright::Property<Cluster>> {
    use stateright::Property;
    vec![
        Property::sometimes(
            "a worker-Lease renewal keeps an attempt alive past its claim's kill switch",
            |_, s: &State| s.fleet.kept_alive,
        ),
        Property::sometimes(
            "a worker stops an attempt revoked in its worker Lease",
            |_, s: &State| s.fleet.stopped_by_revocation,
        ),
        Property::sometimes(
            "an expiry follows a fault of a worker Lease",
            |_, s: &State| s.fleet.expired_after_fault,
        ),
        Property::sometimes(
            "a late worker-Lease renewal naming an expired attempt reaches the API server",
            |_, s: &State| s.fleet.late_after_expiry,
        ),
    ]
}
