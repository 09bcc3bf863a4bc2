//! Bound attempts (issue 27; design "Fleets", "Writes per task"):
//! an addressed offer to a worker with a free slot that takes bound
//! attempts is created already `Held` by it — no claim write
//! ([`Config::bound`](crate::Config::bound), with addressed offers).
//!
//! - Real: the operator's choice (`offers::candidates`, whose
//!   `Candidate::bind_at` is the `renewTime` of the worker's WorkerLease
//!   as the operator's lagging cache shows it, and `offers::bound`, which
//!   binds when the candidate has a free slot and takes bound attempts),
//!   called where the model addresses a new offer (`crate::offers`).
//! - Mirrored from the SDK (`worker-sdk/src/worker/bound.rs`,
//!   `worker_lease.rs`, `renewer.rs`): the worker remembers, for each
//!   write of its WorkerLease, the `renewTime` and the tick it sent it
//!   ([`Stamp`]); its watch delivers a bound lease's create at any later
//!   time, or never ([`Action::SeeBound`]); it then decides as the SDK's
//!   `step` does ([`Cluster::bound_step`]): a citation of a renewal it sent
//!   less than TTL/2 ago (by its own clock) starts the attempt with its
//!   kill clock counted from that send; otherwise it waits for a renewal
//!   that names the attempt (due at once) and starts from that renewal's
//!   send once it succeeded; revoked in its WorkerLease: never started;
//!   its WorkerLease lost (404) meanwhile: given back `Interrupted`. The
//!   start reads the task (`check_current`, the cancel) and registers with
//!   the renewer: revoked in the copy last seen, or counted from a send
//!   before the WorkerLease was found gone — killed at once and given
//!   back.
//! - The renewals of an idle worker (the SDK renews its WorkerLease
//!   always) are a budget ([`Config::idle_renewals`](crate::Config::idle_renewals)).
//!
//! The remembered sends are kept only while they may still start an
//! attempt (TTL/2 of the worker's clock): an older citation and one the
//! worker never sent lead to the same step (wait for a renewal).

use std::collections::BTreeMap;
use std::time::Duration;

use batchlease_api::worker_lease::worker_lease_name;
use batchlease_api::{
    AttemptRef, LeaseOutcome, LeasePhase, TaskLease, TaskMode, WorkerLease, check_current,
};
use batchlease_operator::offers::{self as operator_offers, Candidate};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::ResourceExt;

use crate::api_server::{decode, encode};
use crate::worker::{Attempt, Round, Worker, worker_name};
use crate::{Action, Cluster, LONG_TTL_SECONDS, State, TTL_SECONDS, phase};

/// The rule of bound attempts, and its mutations and variants.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum BoundRule {
    /// The SDK's and the operator's: a bound lease whose citation is not a
    /// send to the worker's current WorkerLease — one sent before it found
    /// its WorkerLease gone, or unknown once it has — is given back rather
    /// than confirmed by a renewal of the WorkerLease created again.
    #[default]
    Real,
    /// The SDK as first written (2026-12-03), a mutation now: such a lease
    /// waits for a renewal naming it, and a renewal of the WorkerLease
    /// created again confirms it, while the operator may have ended it on
    /// the old one's departure without a revocation (`docs/model.md`,
    /// "Bound attempts").
    FirstCut,
    /// A mutation of the SDK: the worker starts a bound attempt once its
    /// watch delivers it, its kill clock counted from then (as a claim's
    /// from the claim's send) — no citation, no renewal naming it.
    Sight,
    /// A mutation of the SDK: it decides as the SDK does, but a start from
    /// the cited renewal counts the kill clock from its sight of the lease
    /// instead of from that renewal's send.
    SightWhenFresh,
    /// A variant of the SDK: no age limit on the send it starts from (a
    /// citation older than TTL/2 starts the attempt too). Safe by the
    /// argument; the limit is for liveness (the next renewal must come
    /// back before the kill switch fires).
    NoAgeLimit,
    /// A variant of the operator: it cites the `renewTime` of the
    /// WorkerLease as the API server has it now, not as its cache shows
    /// it (a renewal it has not observed). Safe by the argument: that
    /// renewal, too, was sent before the create.
    NewestCitation,
}

/// One write of a worker's WorkerLease as its worker remembers it (the
/// SDK's `WorkerLeases::record_sent`).
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct Stamp {
    /// Its `renewTime`, as a marker.
    pub renew_time: String,
    /// The tick it was sent.
    pub sent: u8,
    /// Sent before the request that found the WorkerLease gone (the SDK's
    /// `lost_at`): an attempt counted from it is killed at registration.
    pub before_loss: bool,
}

/// Where a bound attempt waiting for a renewal naming it stands (the
/// SDK's `Confirmation`).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Confirmation {
    Waiting,
    /// A renewal naming it, sent at this tick, succeeded.
    Fed(u8),
    Revoked,
    Lost,
}

/// A bound lease the worker has seen and not taken yet.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct Pending {
    /// The lease as its watch delivered it (its create).
    pub copy: String,
    /// The tick of its first sight.
    pub seen: u8,
    /// `None`: it does not wait for a renewal naming it (yet).
    pub confirmation: Option<Confirmation>,
    /// A renewal named it (the next one follows at the usual pace).
    pub tried: bool,
}

/// Bound leases on their way to their workers' watches, and coverage.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq)]
pub struct Ghosts {
    /// Bound leases as created (name → holder, JSON) whose create the
    /// holder's watch has not delivered yet.
    pub unseen: BTreeMap<String, (String, String)>,
    /// Coverage: a bound lease was created; a bound attempt started from
    /// its citation, from a renewal naming it; one revoked before it
    /// started was skipped; one was given back; one was killed at its
    /// start; a bound lease expired; a worker saw a bound lease after it
    /// had ended.
    pub created: bool,
    pub started_cited: bool,
    pub started_named: bool,
    pub skipped_revoked: bool,
    pub given_back: bool,
    pub killed_at_start: bool,
    pub expired: bool,
    pub seen_after_end: bool,
    /// Coverage ([`BoundRule::NewestCitation`]): a bound lease cites a
    /// renewal the operator's cache did not show.
    pub cited_unobserved: bool,
}

/// What to do now with one bound lease (the SDK's `bound::Step`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    /// Start it, its kill clock from the send at tick `sent` (a citation
    /// if `cited`; `before_loss`: sent before the WorkerLease was lost).
    Start {
        sent: u8,
        cited: bool,
        before_loss: bool,
    },
    /// No free slot yet.
    Wait,
    /// Wait for a renewal naming it.
    Confirm,
    /// Revoked: never start it.
    Skip,
    GiveBack,
}

fn marker(t: &MicroTime) -> String {
    t.0.to_string()
}

impl Cluster {
    /// The `renewTime` worker `w` writes into its WorkerLease now (unique
    /// per write, as real microsecond timestamps are).
    pub(crate) fn stamp(&self, s: &State, w: usize) -> MicroTime {
        let name = worker_lease_name(&worker_name(w));
        MicroTime(self.wall(s.now, s.api.worker_writes(&name)))
    }

    /// Worker `w` sends a write of its WorkerLease carrying `renew_time`
    /// (the SDK records it whether it lands or not).
    pub(crate) fn record_sent(&self, s: &mut State, w: usize, renew_time: Option<&MicroTime>) {
        if let (true, Some(t)) = (self.cfg.bound, renew_time) {
            s.fleet.clients[w].sent.push(Stamp {
                renew_time: marker(t),
                sent: s.now,
                before_loss: false,
            });
        }
    }

    /// The longest TTL of a bound lease in this run.
    fn longest_ttl(&self) -> Duration {
        let ttl = if self.cfg.ttl_edit {
            LONG_TTL_SECONDS
        } else {
            TTL_SECONDS
        };
        Duration::from_secs(ttl.unsigned_abs().into())
    }

    /// Time passed: the sends no bound attempt may start from any more are
    /// forgotten (they lead to the step a send never made leads to).
    pub(crate) fn forget_sends(&self, s: &mut State) {
        if !self.cfg.bound || self.cfg.bound_rule == BoundRule::NoAgeLimit {
            return;
        }
        let half = self.longest_ttl() / 2;
        for w in 0..s.fleet.clients.len() {
            let rate = s.rates[w];
            let now = self.worker_instant(rate, s.now);
            let keep = |st: &Stamp| now < self.worker_instant(rate, st.sent) + half;
            s.fleet.clients[w].sent.retain(keep);
        }
    }
}

/// Worker `w` found its WorkerLease gone (404): every send before is
/// before the loss, and a bound attempt waiting for a renewal cannot be
/// confirmed any more (the SDK's `lost`).
pub(crate) fn lost(s: &mut State, w: usize, rule: BoundRule) {
    let c = &mut s.fleet.clients[w];
    c.found_gone |= rule != BoundRule::FirstCut;
    for st in &mut c.sent {
        st.before_loss = true;
    }
    for p in c.bound.values_mut() {
        if matches!(
            p.confirmation,
            Some(Confirmation::Waiting | Confirmation::Fed(_))
        ) {
            p.confirmation = Some(Confirmation::Lost);
        }
    }
}

fn attempt_of(p: &Pending) -> AttemptRef {
    AttemptRef::of(&decode::<TaskLease>(&p.copy))
}

/// Worker `w` read `copy` of its WorkerLease: a waiting bound attempt
/// revoked there is never named or started (the SDK's `revoke`).
pub(crate) fn revoked_in(s: &mut State, w: usize, copy: &WorkerLease) {
    for p in s.fleet.clients[w].bound.values_mut() {
        if matches!(
            p.confirmation,
            Some(Confirmation::Waiting | Confirmation::Fed(_))
        ) && copy.is_revoked(&attempt_of(p))
        {
            p.confirmation = Some(Confirmation::Revoked);
        }
    }
}

/// The waiting bound attempts worker `w`'s next renewal names (marked
/// tried).
pub(crate) fn named(s: &mut State, w: usize) -> Vec<AttemptRef> {
    let mut out = Vec::new();
    for p in s.fleet.clients[w].bound.values_mut() {
        if matches!(
            p.confirmation,
            Some(Confirmation::Waiting | Confirmation::Fed(_))
        ) {
            p.tried = true;
            out.push(attempt_of(p));
        }
    }
    out
}

/// A renewal of worker `w` sent at tick `sent` listing `holds` succeeded:
/// each waiting bound attempt it named is confirmed from that send (the
/// model feeds from a renewal's send however late its answer, as it does
/// for running attempts — more than the SDK, which wants it within TTL/6).
pub(crate) fn fed(s: &mut State, w: usize, holds: &[AttemptRef], sent: u8) {
    for p in s.fleet.clients[w].bound.values_mut() {
        let newer = match p.confirmation {
            Some(Confirmation::Waiting) => true,
            Some(Confirmation::Fed(at)) => sent > at,
            _ => false,
        };
        if newer && holds.contains(&attempt_of(p)) {
            p.confirmation = Some(Confirmation::Fed(sent));
        }
    }
}

/// Whether worker `w` has a bound attempt whose wait for a renewal naming
/// it has not been tried yet: its renewal is due at once.
pub(crate) fn due_at_once(s: &State, w: usize) -> bool {
    s.fleet.clients[w]
        .bound
        .values()
        .any(|p| p.confirmation == Some(Confirmation::Waiting) && !p.tried)
}

/// Whether worker `w` has a bound attempt its renewals name.
pub(crate) fn names_any(s: &State, w: usize) -> bool {
    s.fleet.clients[w].bound.values().any(|p| {
        matches!(
            p.confirmation,
            Some(Confirmation::Waiting | Confirmation::Fed(_))
        )
    })
}

/// A lease was created: a bound one goes to its holder's watch.
pub(crate) fn created(s: &mut State, l: &TaskLease) {
    let Some(holder) = l.spec.holder_identity.clone().filter(|_| l.bound()) else {
        return;
    };
    s.fleet.bound.created = true;
    s.fleet
        .bound
        .unseen
        .insert(l.name_any(), (holder, encode(l)));
}

/// The operator wrote lease `l` (coverage: a bound lease expired).
pub(crate) fn lease_written(s: &mut State, l: &TaskLease) {
    if l.bound() && phase(l) == Some(LeasePhase::Expired) {
        s.fleet.bound.expired = true;
    }
}

/// Gives bound lease `copy` back without running it: `Interrupted`, one
/// CAS on the copy seen (a lease that moved on refuses it).
fn give_back(s: &mut State, copy: &str) {
    let mut l: TaskLease = decode(copy);
    let st = l.status.get_or_insert_with(Default::default);
    st.phase = Some(LeasePhase::Completed);
    st.outcome = Some(LeaseOutcome::Interrupted);
    st.reason = Some("BoundUnconfirmed".into());
    if s.api.replace_lease(&l).is_ok() {
        s.fleet.bound.given_back = true;
    }
}

impl Cluster {
    /// `offers::bound` for the new offer `lease` addressed to `to`: the
    /// lease created `Held` by it when the production rule says so.
    pub(crate) fn bind(
        &self,
        s: &mut State,
        lease: &TaskLease,
        to: &Candidate,
    ) -> Option<TaskLease> {
        if !self.cfg.bound {
            return None;
        }
        let mut to = to.clone();
        if self.cfg.bound_rule == BoundRule::NewestCitation {
            let newest = s
                .api
                .worker_lease(&worker_lease_name(&to.identity))
                .filter(|w| w.spec.takes_bound == Some(true))
                .and_then(|w| w.spec.renew_time);
            s.fleet.bound.cited_unobserved |= to.free > 0 && newest != to.bind_at;
            to.bind_at = newest;
        }
        operator_offers::bound(lease, &to, self.instant(s.now))
    }

    /// The bound-attempt steps of worker `w`: its watch delivers a bound
    /// lease's create; it looks again at one that waits, when that would
    /// change something.
    pub(crate) fn bound_steps(&self, s: &State, w: usize, actions: &mut Vec<Action>) {
        if !self.cfg.bound {
            return;
        }
        let me = worker_name(w);
        for (name, (holder, _)) in &s.fleet.bound.unseen {
            if *holder == me {
                actions.push(Action::SeeBound(w, name.clone()));
            }
        }
        for (name, p) in &s.fleet.clients[w].bound {
            let acts = match self.bound_step(s, w, p) {
                Step::Wait => false,
                Step::Confirm => p.confirmation.is_none(),
                Step::Start { .. } | Step::Skip | Step::GiveBack => true,
            };
            if acts {
                actions.push(Action::LookBound(w, name.clone()));
            }
        }
    }

    /// The send worker `w` remembers as the one `lease` cites, if any.
    fn cited<'a>(&self, s: &'a State, w: usize, lease: &TaskLease) -> Option<&'a Stamp> {
        let at = marker(lease.spec.bound_at.as_ref()?);
        s.fleet.clients[w]
            .sent
            .iter()
            .find(|st| st.renew_time == at)
    }

    /// The SDK's `bound::step` for `p` at worker `w` now (by its clock).
    fn bound_step(&self, s: &State, w: usize, p: &Pending) -> Step {
        let lease: TaskLease = decode(&p.copy);
        let rate = s.rates[w];
        let at = |tick| self.worker_instant(rate, tick);
        let ttl = Duration::from_secs(lease.spec.lease_duration_seconds.unsigned_abs().into());
        let now = at(s.now);
        let slot_free = matches!(s.workers[w], Worker::Idle);
        let rule = self.cfg.bound_rule;
        if rule == BoundRule::Sight {
            return if slot_free {
                Step::Start {
                    sent: p.seen,
                    cited: false,
                    before_loss: false,
                }
            } else {
                Step::Wait
            };
        }
        let fed = match p.confirmation {
            Some(Confirmation::Revoked) => return Step::Skip,
            Some(Confirmation::Lost) => return Step::GiveBack,
            Some(Confirmation::Fed(t)) => Some(t),
            Some(Confirmation::Waiting) | None => None,
        };
        if !slot_free && now >= at(p.seen) + ttl {
            return Step::GiveBack;
        }
        if rule != BoundRule::FirstCut
            && s.fleet.clients[w].found_gone
            && self.cited(s, w, &lease).is_none_or(|c| c.before_loss)
        {
            return Step::GiveBack;
        }
        // The later of the cited send and a renewal that named it (a
        // citation is sent before the create, a naming renewal after the
        // sight: on a tie the renewal is the later).
        let from = match (self.cited(s, w, &lease), fed) {
            (Some(c), Some(f)) if c.sent > f => Some((c.sent, true, c.before_loss)),
            (_, Some(f)) => Some((f, false, false)),
            (Some(c), None) => Some((c.sent, true, c.before_loss)),
            (None, None) => None,
        };
        match from {
            Some((sent, cited, before_loss))
                if rule == BoundRule::NoAgeLimit || now < at(sent) + ttl / 2 =>
            {
                if !slot_free {
                    return Step::Wait;
                }
                let sent = if cited && rule == BoundRule::SightWhenFresh {
                    p.seen
                } else {
                    sent
                };
                Step::Start {
                    sent,
                    cited,
                    before_loss,
                }
            }
            _ => Step::Confirm,
        }
    }

    /// Worker `w`'s watch delivers bound lease `name`'s create; it looks at
    /// it at once.
    pub(crate) fn see_bound(&self, s: &mut State, w: usize, name: &str) {
        let Some((_, json)) = s.fleet.bound.unseen.remove(name) else {
            return;
        };
        let uid = decode::<TaskLease>(&json).uid();
        let live = s
            .api
            .lease(name)
            .is_some_and(|l| l.uid() == uid && phase(&l) == Some(LeasePhase::Held) && l.bound());
        s.fleet.bound.seen_after_end |= !live;
        s.fleet.clients[w].bound.insert(
            name.to_owned(),
            Pending {
                copy: json,
                seen: s.now,
                confirmation: None,
                tried: false,
            },
        );
        self.look_bound(s, w, name);
    }

    /// Worker `w` looks at bound lease `name` (the SDK's `bound::look`).
    pub(crate) fn look_bound(&self, s: &mut State, w: usize, name: &str) {
        let Some(p) = s.fleet.clients[w].bound.get(name).cloned() else {
            return;
        };
        let done = |s: &mut State| {
            s.fleet.clients[w].bound.remove(name);
        };
        match self.bound_step(s, w, &p) {
            Step::Wait => {}
            Step::Confirm => {
                if p.confirmation.is_none() {
                    // The SDK's `confirm`: revoked in the copy last seen,
                    // or no live WorkerLease: never confirmed.
                    let copy = s.fleet.clients[w]
                        .copy
                        .as_deref()
                        .map(decode::<WorkerLease>);
                    let c = match copy {
                        Some(l) if l.is_revoked(&attempt_of(&p)) => Confirmation::Revoked,
                        Some(_) => Confirmation::Waiting,
                        None => Confirmation::Lost,
                    };
                    if let Some(p) = s.fleet.clients[w].bound.get_mut(name) {
                        p.confirmation = Some(c);
                    }
                }
            }
            Step::Skip => {
                done(s);
                s.fleet.bound.skipped_revoked = true;
            }
            Step::GiveBack => {
                done(s);
                give_back(s, &p.copy);
            }
            Step::Start {
                sent,
                cited,
                before_loss,
            } => {
                done(s);
                self.start_bound(s, w, &p, sent, cited, before_loss);
            }
        }
    }

    /// Worker `w` starts bound attempt `p`, its kill clock from tick
    /// `sent`: the task read (gone, cancelled or not current: never
    /// started), then its registration with the renewer (revoked in the
    /// copy last seen, or counted from a send before the WorkerLease was
    /// found gone: killed at once, given back).
    fn start_bound(
        &self,
        s: &mut State,
        w: usize,
        p: &Pending,
        sent: u8,
        cited: bool,
        before_loss: bool,
    ) {
        let lease: TaskLease = decode(&p.copy);
        let Some(task) = s.api.task_index(&lease.spec.task_name) else {
            return;
        };
        let t = s.api.task(task);
        if t.spec.cancel || check_current(&t, &lease).is_err() {
            return;
        }
        let revoked = s.fleet.clients[w]
            .copy
            .as_deref()
            .map(decode::<WorkerLease>)
            .is_some_and(|l| l.is_revoked(&AttemptRef::of(&lease)));
        if revoked || before_loss {
            s.fleet.bound.killed_at_start = true;
            give_back(s, &p.copy);
            return;
        }
        if cited {
            s.fleet.bound.started_cited = true;
        } else {
            s.fleet.bound.started_named = true;
        }
        let mode = t.status.and_then(|st| st.effective_mode);
        s.workers[w] = Worker::Holding(Attempt {
            rate: s.rates[w],
            task,
            resource_tokens: lease.spec.resource_tokens.clone(),
            lease: lease.name_any(),
            token: lease.spec.fencing_token,
            ttl: lease.spec.lease_duration_seconds,
            copy: p.copy.clone(),
            claim_sent: sent,
            last_ok_sent: sent,
            last_refresh_sent: sent,
            registered: false,
            not_started: false,
            checked: false,
            committed: false,
            spawned: false,
            round: self.cfg.speculative.then(|| Round {
                exclusive: mode == Some(TaskMode::Exclusive),
                ..Round::default()
            }),
            dropped: false,
        });
    }
}

/// Coverage of bound attempts (asserted by the bounds meant to reach
/// them); the safety properties are the existing ones.
pub(crate) fn properties() -> Vec<stateright::Property<Cluster>> {
    use stateright::Property;
    vec![
        Property::sometimes("a bound lease is created", |_, s: &State| {
            s.fleet.bound.created
        }),
        Property::sometimes(
            "a bound attempt starts from the renewal its lease cites",
            |_, s: &State| s.fleet.bound.started_cited,
        ),
        Property::sometimes(
            "a bound attempt starts from a renewal naming it",
            |_, s: &State| s.fleet.bound.started_named,
        ),
        Property::sometimes(
            "a bound attempt revoked before it started is never started",
            |_, s: &State| s.fleet.bound.skipped_revoked,
        ),
        Property::sometimes(
            "a bound attempt is given back without running",
            |_, s: &State| s.fleet.bound.given_back,
        ),
        Property::sometimes("a bound attempt is killed at its start", |_, s: &State| {
            s.fleet.bound.killed_at_start
        }),
        Property::sometimes("a bound lease expires", |_, s: &State| {
            s.fleet.bound.expired
        }),
        Property::sometimes(
            "a worker's watch delivers a bound lease after it ended",
            |_, s: &State| s.fleet.bound.seen_after_end,
        ),
        Property::sometimes(
            "a bound lease cites a renewal the operator's cache did not show",
            |_, s: &State| s.fleet.bound.cited_unobserved,
        ),
    ]
}
