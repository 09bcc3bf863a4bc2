//! Addressed offers (issue 27, design "Fleets" → "Addressed offers"): each
//! offer goes to one worker (`spec.offeredTo`), which alone may claim it;
//! an offer whose worker lapsed, or left it unclaimed for a TTL, is
//! addressed again by a CAS on the unclaimed lease
//! ([`Config::addressed`](crate::Config::addressed), with renewals per
//! worker: the operator addresses the workers whose WorkerLease says
//! `slots`).
//!
//! - Real: the candidates and the choices (`offers::candidates`,
//!   `offers::choose`: the live worker with the most free slots — the
//!   least loaded when none has one — ties by name; `offers::readdress`:
//!   where an offer goes when it is addressed again), the addressed lease
//!   (`offers::addressed`: `offeredTo` and the label), and `decide`'s
//!   `Readdress` on the [`OfferView`] the model gives it.
//! - Mirrored: the operator's book of outstanding addresses
//!   (`offers::OfferBook`: since when each offer waits for its worker, fed
//!   by its own writes and its lease cache, lost in a crash;
//!   [`Operator::book`](crate::operator::Operator::book)); the effects of
//!   `effects/address.rs` (the address of a new offer after its status
//!   write, the re-address as a CAS on the cached copy, its 409).
//! - Modelled: whether a worker is live. The model's workers renew their
//!   WorkerLease only while they hold an attempt, so the production rule
//!   (renewed within its duration, as observed) would call every idle
//!   worker lapsed after 5 s. Instead the operator's view of a worker
//!   lapses at any step ([`Action::Lapse`](crate::Action::Lapse), a
//!   budget): its WorkerLease was not seen renewed for its duration — the
//!   worker died, or is paused, partitioned, or the operator's cache lags.
//!   Whether the worker then acts again is the checker's choice (any actor
//!   may take no step); [`Config::dead_worker`](crate::Config::dead_worker)
//!   makes worker 0 take none at all, for the liveness check.
//! - The workers, as the SDK since its filter, claim only offers
//!   addressed to them or to nobody; an older worker ([`OldClaim`], the
//!   last worker) claims any offer of its queue. Claims read the lease as
//!   it is now (as the model's claims always have): a claim from a copy
//!   older than a re-address meets 409 by the CAS alone, so the CRD rules
//!   matter for claims whose copy is current — which the model makes.
//! - The API server enforces the CRD's CEL rules on `offeredTo`
//!   ([`CelRules`], `api/src/task_lease.rs`): (B) only the addressee claims
//!   an addressed offer, (A) once `holderIdentity` is set `offeredTo` is
//!   unchanged, presence and value.

use std::collections::BTreeMap;

use batchlease_api::worker_lease::worker_lease_name;
use batchlease_api::{LeasePhase, TaskLease, WorkerLease};
use batchlease_operator::decide::OfferView;
use batchlease_operator::observe::Tracker;
use batchlease_operator::offers::{self as operator_offers, Candidate};
use kube::ResourceExt;

use crate::api_server::{Refused, decode, encode};
use crate::operator::{Sent, Write};
use crate::worker::worker_name;
use crate::{Action, Cluster, State, phase};

/// The slots each worker's WorkerLease says in addressed mode: one (a
/// model's worker runs one attempt at a time).
pub const SLOTS: i32 = 1;

/// The API server's rules on `spec.offeredTo` and how the operator
/// re-addresses (the mutations leave one out).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum AddressRule {
    /// The CRD's rules A and B; a re-address is a CAS (PUT with the
    /// cached resourceVersion) on the unclaimed offer.
    #[default]
    Real,
    /// Without rule B (a mutation): anyone may claim an addressed offer.
    NoClaimRule,
    /// Without rule A (a mutation): a write of a claimed lease may set or
    /// change `offeredTo`.
    NoFixedRule,
    /// The re-address without its CAS (a merge patch of `offeredTo` and
    /// the label on the lease as stored), rules kept.
    Patch,
    /// Without the CAS and without rule A (a mutation).
    PatchNoFixedRule,
}

/// The CEL rules of the TaskLease CRD on `spec.offeredTo`, as the API
/// server model enforces them (a mutation leaves one out).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CelRules {
    /// (B, a transition rule) `!has(oldSelf.offeredTo) ||
    /// (has(oldSelf.holderIdentity) && oldSelf.holderIdentity != '') ||
    /// !has(self.holderIdentity) || self.holderIdentity == '' ||
    /// self.holderIdentity == oldSelf.offeredTo`: the claim of an addressed
    /// offer names the address before it.
    pub claim_by_addressee: bool,
    /// (A, a transition rule) `!has(self.holderIdentity) ||
    /// self.holderIdentity == '' || !has(self.offeredTo) ||
    /// (has(oldSelf.offeredTo) && self.offeredTo == oldSelf.offeredTo)`:
    /// from the claim on the address may be dropped, never set or changed.
    pub address_fixed: bool,
}

impl Default for CelRules {
    fn default() -> Self {
        Self {
            claim_by_addressee: true,
            address_fixed: true,
        }
    }
}

impl AddressRule {
    pub(crate) fn cel(self) -> CelRules {
        CelRules {
            claim_by_addressee: self != Self::NoClaimRule,
            address_fixed: !matches!(self, Self::NoFixedRule | Self::PatchNoFixedRule),
        }
    }

    fn patch(self) -> bool {
        matches!(self, Self::Patch | Self::PatchNoFixedRule)
    }
}

fn holder(l: &TaskLease) -> Option<&str> {
    l.spec.holder_identity.as_deref().filter(|h| !h.is_empty())
}

impl CelRules {
    /// Rules B and A, on an update (both are transition rules).
    pub(crate) fn transition(self, old: &TaskLease, new: &TaskLease) -> bool {
        let b = match (old.spec.offered_to.as_deref(), holder(old), holder(new)) {
            (Some(to), None, Some(h)) => h == to,
            _ => true,
        };
        let a = holder(new).is_none()
            || new.spec.offered_to.is_none()
            || (old.spec.offered_to.is_some() && new.spec.offered_to == old.spec.offered_to);
        (!self.claim_by_addressee || b) && (!self.address_fixed || a)
    }
}

/// How an older worker claims (the last worker, with
/// [`Config::old_worker`](crate::Config::old_worker)): whatever the
/// address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OldClaim {
    /// Its claim keeps `offeredTo` as read: the SDK between the field and
    /// its filter (built with the field, trying every offer of its
    /// queues), or a client that patches the claim fields.
    KeepsField,
    /// Its claim drops `offeredTo`: an SDK built before the field, whose
    /// PUT of the typed object it decoded carries no unknown field.
    DropsField,
}

/// Budgets and ghosts of addressed offers.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq)]
pub struct OfferGhosts {
    /// Lapses of a worker in the operator's view so far.
    pub lapses: u8,
    /// Per claimed lease (by UID): its holder and its address when the
    /// claim landed (`offeredTo` of the lease as stored before it).
    pub claims: BTreeMap<String, (String, Option<String>)>,
    /// Per addressed offer (by UID): the worker it was first addressed to.
    pub first: BTreeMap<String, String>,
    /// Coverage: a re-address landed (lapsed addressee / a TTL unclaimed),
    /// an address was dropped, an offer first addressed to one worker was
    /// claimed by another, a re-address met 409 on a claimed lease, one
    /// was refused by a CEL rule, an older worker's claim was refused.
    pub moved_lapsed: bool,
    pub moved_ttl: bool,
    pub dropped: bool,
    pub claimed_by_another: bool,
    pub readdress_lost_to_claim: bool,
    pub readdress_refused: bool,
    pub old_claim_refused: bool,
    /// Coverage: the operator decided to drop the address of an offer
    /// whose worker it had not seen lapse — its WorkerLease not yet seen
    /// (after a restart).
    pub dropped_unseen: bool,
}

impl Cluster {
    /// Whether worker `w` claims `l` (offered, of its queue): the SDK
    /// takes only an offer addressed to it or to nobody; an older worker
    /// any.
    pub(crate) fn may_claim(&self, w: usize, l: &TaskLease) -> bool {
        !self.cfg.addressed
            || self.old_claim(w).is_some()
            || l.spec
                .offered_to
                .as_deref()
                .is_none_or(|to| to == worker_name(w))
    }

    /// How worker `w` claims if it is the older worker.
    pub(crate) fn old_claim(&self, w: usize) -> Option<OldClaim> {
        self.cfg
            .old_worker
            .filter(|_| self.cfg.addressed && w + 1 == self.cfg.workers)
    }

    /// Whether worker `w` takes steps (worker 0 is dead with
    /// [`Config::dead_worker`](crate::Config::dead_worker)).
    pub(crate) fn acts(&self, w: usize) -> bool {
        !(self.cfg.dead_worker && w == 0)
    }

    /// The steps of addressed offers: the operator's view of a worker
    /// lapses (in the fair mode only the dead worker's).
    pub(crate) fn offer_steps(&self, s: &State, actions: &mut Vec<Action>) {
        if s.offers.lapses >= self.cfg.lapses {
            return;
        }
        for w in 0..self.cfg.workers {
            if (!self.cfg.fair || !self.acts(w)) && !s.op.lapsed.contains(&worker_name(w)) {
                actions.push(Action::Lapse(w));
            }
        }
    }

    /// The operator's view of worker `w` lapses.
    pub(crate) fn lapse(s: &mut State, w: usize) {
        s.offers.lapses += 1;
        s.op.lapsed.insert(worker_name(w));
    }

    /// `offers::candidates` on the operator's caches: its WorkerLeases,
    /// live unless its view says lapsed, less the leases its cache shows
    /// held and the offers its book counts.
    fn candidates(&self, s: &State, queue: &str) -> Vec<Candidate> {
        let now = self.instant(s.now);
        let workers: Vec<WorkerLease> = s.op.wleases.values().map(|j| decode(j)).collect();
        let leases: Vec<TaskLease> = s.op.leases.values().map(|j| decode(j)).collect();
        // The operator's lease tracker over its cache, for what takes a
        // worker's slots.
        let slots = Tracker::default();
        for l in &leases {
            slots.observe(l, now);
        }
        let mut addressed: BTreeMap<&str, usize> = BTreeMap::new();
        for (to, _) in s.op.book.values() {
            *addressed.entry(to.as_str()).or_default() += 1;
        }
        operator_offers::candidates(
            workers.iter(),
            queue,
            now,
            // Renewals observed as they happened: binding is allowed
            // whenever the worker is live (the production rule binds to
            // fewer — never after a renewal seen only in a list — and not
            // binding is an offer claimed as any other).
            |w| {
                w.worker().filter(|id| !s.op.lapsed.contains(*id)).map(|_| {
                    operator_offers::Renewals {
                        seen: now,
                        observed: Some(now),
                    }
                })
            },
            // The production count (issue 39, defect 5: every attempt
            // held, renewed per worker or per lease).
            |id| slots.held_count("ns", id),
            |id| addressed.get(id).copied().unwrap_or(0),
            // As the operator: an attempt its cache shows over.
            |a| {
                leases.iter().any(|l| {
                    l.metadata.name.as_deref() == Some(a.name.as_str())
                        && l.metadata.uid.as_deref() == Some(a.uid.as_str())
                        && phase(l).is_some_and(LeasePhase::is_terminal)
                })
            },
        )
    }

    /// The workers a new offer of `queue` may be addressed to:
    /// `offers::choose`'s pick and every candidate tied with it (its
    /// tie-break by name is arbitrary against the model's workers, one of
    /// which may be the older worker); none: it goes unaddressed.
    pub(crate) fn addressees(&self, s: &State, create: &str) -> Vec<usize> {
        let lease: TaskLease = decode(create);
        let tombstone =
            lease.status.as_ref().and_then(|st| st.reason.as_deref()) == Some("TokenRetired");
        if !self.cfg.addressed || tombstone || lease.spec.offered_to.is_some() {
            return Vec::new();
        }
        let candidates = self.candidates(s, &lease.spec.queue);
        let Some(best) = operator_offers::choose(&candidates, None) else {
            return Vec::new();
        };
        (0..self.cfg.workers)
            .filter(|w| {
                candidates
                    .iter()
                    .any(|c| c.identity == worker_name(*w) && c.free == best.free)
            })
            .collect()
    }

    /// `effects::address::address_new`: task `i`'s pending create of a
    /// new offer (after its status write) addressed to worker `w` (one of
    /// [`Self::addressees`]), recorded in the book before it is sent.
    pub(crate) fn address_new(&self, s: &mut State, i: usize, w: usize) {
        let Some(Write::Create(json)) = s.op.pending.get(&i) else {
            return;
        };
        let lease: TaskLease = decode(json);
        let candidates = self.candidates(s, &lease.spec.queue);
        let Some(to) = candidates.iter().find(|c| c.identity == worker_name(w)) else {
            return;
        };
        s.op.book
            .insert(lease.name_any(), (to.identity.clone(), s.now));
        let addressed = operator_offers::addressed(&lease, Some(to));
        // …and bound to it when `offers::bound` says so (`crate::bound`).
        let issued = self.bind(s, &addressed, to).unwrap_or(addressed);
        s.op.pending.insert(i, Write::Create(encode(&issued)));
    }

    /// `inputs::offer_view` on the model's state: for the current lease
    /// as cached, an unclaimed offer addressed to a worker — since when
    /// (the book's, recorded now if it did not know) and whether the
    /// operator's view has it live.
    pub(crate) fn offer_view(&self, s: &mut State, lease: &TaskLease) -> Option<OfferView> {
        if !self.cfg.addressed || !operator_offers::is_open(lease) {
            return None;
        }
        let to = lease.spec.offered_to.clone()?;
        let now = self.instant(s.now);
        if !s.op.wlisted {
            // A fresh leader before its WorkerLease list: the offer counts
            // as just addressed to a worker live one more second.
            return Some(OfferView {
                since: now,
                addressee_live_until: Some(now + std::time::Duration::from_secs(1)),
            });
        }
        let since = match s.op.book.get(&lease.name_any()) {
            Some((t, at)) if *t == to => *at,
            _ => {
                s.op.book.insert(lease.name_any(), (to.clone(), s.now));
                s.now
            }
        };
        // inputs.rs: addressable until `offers::addressable_until` its
        // last observed renewal — in the model "now" unless its view
        // lapsed (see the module) — if its WorkerLease is seen.
        let until =
            s.op.wleases
                .get(&worker_lease_name(&to))
                .map(|j| decode::<WorkerLease>(j))
                .filter(|w| w.worker() == Some(to.as_str()) && !s.op.lapsed.contains(&to))
                .and_then(|w| operator_offers::addressable_until(&w, now));
        Some(OfferView {
            since: self.instant(since),
            addressee_live_until: until,
        })
    }

    /// `effects::address::readdress`: where `offers::readdress` says — to
    /// another candidate (one with a free slot, unless the addressee
    /// `lapsed`), to nobody if it lapsed and there is none; else no write,
    /// its wait counted afresh.
    pub(crate) fn readdress(
        &self,
        s: &mut State,
        lease: &TaskLease,
        lapsed: bool,
    ) -> Option<Write> {
        if !self.cfg.addressed {
            return None;
        }
        if !s.op.wlisted {
            // Before the WorkerLease list nothing moves.
            return None;
        }
        let from = lease.spec.offered_to.clone().unwrap_or_default();
        let candidates = self.candidates(s, &lease.spec.queue);
        let Some(to) = operator_offers::readdress(&candidates, &from, lapsed) else {
            s.op.book.insert(lease.name_any(), (from, s.now));
            return None;
        };
        if to.is_none() && !s.op.lapsed.contains(&from) {
            s.offers.dropped_unseen = true;
        }
        Some(Write::Readdress {
            lease: encode(&operator_offers::addressed(lease, to)),
            lapsed,
        })
    }

    /// The re-address reaches the API server: a CAS on the copy it was
    /// decided on (or, [`AddressRule::Patch`], the address and label set
    /// on the lease as stored).
    pub(crate) fn send_readdress(&self, s: &mut State, json: &str, lapsed: bool) -> Sent {
        let mut sent = Sent::default();
        let moved: TaskLease = decode(json);
        let name = moved.name_any();
        let request = if self.cfg.address_rule.patch() {
            let Some(mut stored) = s.api.lease(&name) else {
                return sent;
            };
            let unchanged = stored.spec.offered_to == moved.spec.offered_to
                && stored.metadata.labels == moved.metadata.labels;
            if unchanged {
                // The API server writes nothing for a patch that changes
                // nothing (no new resourceVersion): else a stale cache
                // would re-address without end, each write a new version.
                sent.applied = true;
                return sent;
            }
            stored.spec.offered_to.clone_from(&moved.spec.offered_to);
            stored.metadata.labels.clone_from(&moved.metadata.labels);
            stored
        } else {
            moved.clone()
        };
        let claimed = s.api.lease(&name).is_some_and(|l| holder(&l).is_some());
        match s.api.replace_lease(&request) {
            Ok(_) => {
                sent.applied = true;
                match moved.spec.offered_to {
                    Some(to) => {
                        s.op.book.insert(name, (to, s.now));
                        if lapsed {
                            s.offers.moved_lapsed = true;
                        } else {
                            s.offers.moved_ttl = true;
                        }
                    }
                    None => {
                        s.op.book.remove(&name);
                        s.offers.dropped = true;
                    }
                }
            }
            Err(Refused::Conflict) if claimed => s.offers.readdress_lost_to_claim = true,
            Err(Refused::Invalid) if claimed => s.offers.readdress_refused = true,
            Err(_) => {}
        }
        sent
    }

    /// The lease cache caught up: the book, as `OfferBook::observe` and
    /// `forget` keep it (an unclaimed addressed offer is outstanding since
    /// it was first seen addressed there; anything else is not).
    pub(crate) fn book_sync(&self, s: &mut State) {
        if !self.cfg.addressed {
            return;
        }
        let gone: Vec<String> =
            s.op.leases
                .keys()
                .filter(|n| !s.api.leases.contains_key(*n))
                .cloned()
                .collect();
        for name in gone {
            s.op.book.remove(&name);
        }
        for (name, json) in &s.api.leases {
            let l: TaskLease = decode(json);
            let offered = phase(&l) == Some(LeasePhase::Offered) && holder(&l).is_none();
            match l.spec.offered_to.filter(|_| offered) {
                Some(to) => {
                    if s.op.book.get(name).is_none_or(|(t, _)| *t != to) {
                        s.op.book.insert(name.clone(), (to, s.now));
                    }
                }
                None => {
                    s.op.book.remove(name);
                }
            }
        }
    }
}

/// A lease was created: the worker an offer was first addressed to.
pub(crate) fn created(s: &mut State, l: &TaskLease) {
    if let (Some(uid), Some(to)) = (l.uid(), l.spec.offered_to.clone()) {
        s.offers.first.insert(uid, to);
    }
    crate::bound::created(s, l);
}

/// Worker `me`'s claim of `before` (the lease as stored) landed.
pub(crate) fn claimed(s: &mut State, me: &str, before: &TaskLease) {
    let Some(uid) = before.uid() else {
        return;
    };
    if s.offers.first.get(&uid).is_some_and(|to| to != me) {
        s.offers.claimed_by_another = true;
    }
    s.offers
        .claims
        .insert(uid, (me.to_owned(), before.spec.offered_to.clone()));
}

/// The lease's address has not been set or changed since its claim (rule
/// A's promise; dropping it is allowed: a rolled-back operator's writes).
fn address_kept(s: &State) -> bool {
    s.api.leases.values().all(|j| {
        let l: TaskLease = decode(j);
        match (holder(&l), l.uid()) {
            (Some(_), Some(uid)) => s.offers.claims.get(&uid).is_none_or(|(_, at_claim)| {
                l.spec.offered_to.is_none() || *at_claim == l.spec.offered_to
            }),
            _ => true,
        }
    })
}

/// The safety properties of addressed offers, and their coverage.
pub(crate) fn properties() -> Vec<stateright::Property<Cluster>> {
    use stateright::Property;
    vec![
        Property::always(
            "a lease addressed at its claim is held by its addressee",
            |_, s: &State| {
                s.offers
                    .claims
                    .values()
                    .all(|(h, to)| to.as_ref().is_none_or(|to| to == h))
            },
        ),
        Property::always(
            "a claimed lease's address is never set or changed",
            |_, s: &State| address_kept(s),
        ),
        Property::sometimes(
            "an offer is addressed again after its worker lapsed",
            |_, s: &State| s.offers.moved_lapsed,
        ),
        Property::sometimes(
            "an offer is addressed again after a TTL unclaimed",
            |_, s: &State| s.offers.moved_ttl,
        ),
        Property::sometimes("an offer's address is dropped", |_, s: &State| {
            s.offers.dropped
        }),
        Property::sometimes(
            "an offer first addressed to one worker is claimed by another",
            |_, s: &State| s.offers.claimed_by_another,
        ),
        Property::sometimes(
            "an offer's address is dropped because its worker's WorkerLease is not seen yet",
            |_, s: &State| s.offers.dropped_unseen,
        ),
        Property::sometimes(
            "a re-address meets 409: a claim landed first",
            |_, s: &State| s.offers.readdress_lost_to_claim,
        ),
        Property::sometimes(
            "a re-address of a claimed lease is refused by the CRD",
            |_, s: &State| s.offers.readdress_refused,
        ),
        Property::sometimes(
            "an older worker's claim of an addressed offer is refused",
            |_, s: &State| s.offers.old_claim_refused,
        ),
    ]
}
