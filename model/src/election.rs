//! The operator's own leader election (issue 23), model-checked: two
//! replicas with their own views of the election Lease, an API server
//! applying their CAS writes whenever it gets to them (a write abandoned at
//! its deadline may still land later), and someone editing the Lease by
//! hand — deleting it, clearing its holder, naming either replica as
//! holder. Time is ticks of one second; the replicas' lease duration is
//! 3 s and their grace 1 s, so a term runs 2 s from a renewal's send.
//!
//! What is real: the standby's and the leader's decision on the Lease as
//! read, `batchlease_operator::leader_step::step`, fed real `Lease`
//! objects. What is mirrored from `operator/src/leader.rs`: the elector's
//! loop (renew from its copy by CAS; on 409 read and decide; a 404 or
//! another holder ends the term; every request bounded by the term's end),
//! `won()` (a term runs until `sent + term`; a write answered after its
//! term ended starts a new generation), and the main loop's `acquired()`
//! (it wakes only for a new generation, and starts controllers).
//!
//! Properties: never two replicas in a term at once (each believes it may
//! write: the promise every write's `Leadership::ensure` rests on), and a
//! term that runs is never left without controllers once handed out (the
//! silent outage of finding 1). Mutations the checker must catch: a
//! missing Lease created holding it (finding 2), a vacated Lease taken at
//! once (finding 3), a late renewal reviving its ended term (finding 1).
//! A missing Lease is created vacated: waiting out its absence instead was
//! the checker's first counterexample (docs/model.md).

use std::hash::Hash;
use std::time::Duration;

use batchlease_operator::leader_step::{Seen, Step, step};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use stateright::{Model, Property};
use tokio::time::Instant;

/// The replicas' lease duration, in ticks (seconds).
pub const DURATION: u8 = 3;
/// Their term: duration − grace (1 s).
pub const TERM: u8 = 2;
/// A standby's request deadline (the elector's `retry_every() * 2`).
const STANDBY_BUDGET: u8 = 2;

/// Which election rule runs: the real one, or a mutation of it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ElectionRule {
    #[default]
    Real,
    /// Before issue 23: a missing Lease is created holding it (a term at
    /// once), and a leader whose renewal meets 404 leads on until its term
    /// runs out.
    CreateAtOnce,
    /// Before issue 23: a vacated Lease (no holder) is taken at once.
    TrustVacated,
    /// Before issue 23: a renewal answered after its term ended extends
    /// that term, under the same generation, and wakes nobody; leaders'
    /// follow-up requests are not bounded by the term.
    ReviveTerm,
}

/// The bounds of one run.
#[derive(Clone, Debug)]
pub struct ElectionConfig {
    pub max_ticks: u8,
    /// Hand edits of the Lease (each a delete, a cleared holder, or a
    /// holder naming a replica).
    pub edits: u8,
    pub rule: ElectionRule,
}

/// What the API server did with a write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Applied: the Lease's new version.
    Won(u8),
    Conflict,
    Gone,
    /// Created vacated: no term.
    Created,
}

/// One write of the Lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    Create,
    /// A CAS from version `from` (a renewal or a takeover).
    Replace {
        from: u8,
    },
}

/// A replica's request in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Req {
    pub kind: Kind,
    pub sent: u8,
    /// Abandoned at this tick (the tick's one deadline); `None`: unbounded
    /// (the `ReviveTerm` mutation).
    pub deadline: Option<u8>,
    /// Set once the API server applied (or refused) it.
    pub outcome: Option<Outcome>,
}

/// One replica.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Replica {
    /// The version of our copy while we lead.
    pub ours: Option<u8>,
    pub generation: u8,
    pub valid_until: Option<u8>,
    /// The version a standby watches and since when.
    pub seen: Option<(u8, u8)>,
    /// The version our last successful write produced (`Elector::wrote`).
    pub wrote: Option<u8>,
    pub req: Option<Req>,
    /// The last generation `acquired()` handed out.
    pub handed: u8,
    /// The generation whose controllers run.
    pub controllers: Option<u8>,
    /// Looked at the Lease this tick already: the elector looks at most
    /// once a second (it renews every term/3, a standby looks every
    /// second), which also bounds the versions a run can write.
    pub looked: bool,
}

impl Replica {
    fn in_term(&self, now: u8) -> bool {
        self.valid_until.is_some_and(|v| now < v)
    }
}

/// The whole system.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ElectionState {
    pub now: u8,
    /// `(version, holder)`; no holder: vacated.
    pub lease: Option<(u8, Option<u8>)>,
    pub next_version: u8,
    pub replicas: [Replica; 2],
    /// Abandoned requests that may still land (nobody hears the answer).
    pub strays: Vec<(u8, Kind)>,
    pub edits: u8,
    /// Coverage ghosts.
    pub taken_over: bool,
    pub recreated_after_delete: bool,
    pub deleted: bool,
    pub late_renewal: bool,
}

/// Something that happens.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ElectionAction {
    Tick,
    /// Replica `r`'s elector looks at the Lease (renews while leading).
    Look(u8),
    /// The API server applies replica `r`'s request.
    Land(u8),
    /// Replica `r` gets the answer.
    Answer(u8),
    /// Replica `r` gives up on its request at its deadline.
    Abandon(u8),
    /// Replica `r`'s term ran out with no renewal in flight.
    RunOut(u8),
    /// Replica `r`'s main loop: `acquired()` hands out the new term.
    Acquire(u8),
    /// An abandoned request lands.
    LandStray(usize),
    /// A hand edit: delete the Lease.
    Delete,
    /// A hand edit: set the holder (`None`: clear it).
    SetHolder(Option<u8>),
}

/// The model.
#[derive(Clone, Debug)]
pub struct Election {
    pub cfg: ElectionConfig,
    base: Instant,
}

impl Election {
    pub fn new(cfg: ElectionConfig) -> Self {
        Self {
            cfg,
            base: Instant::now(),
        }
    }

    fn instant(&self, tick: u8) -> Instant {
        self.base + Duration::from_secs(u64::from(tick))
    }

    /// The Lease as replica code reads it.
    fn lease_object(lease: Option<(u8, Option<u8>)>) -> Option<Lease> {
        lease.map(|(version, holder)| {
            let mut l = Lease::default();
            l.metadata.resource_version = Some(version.to_string());
            l.spec = Some(LeaseSpec {
                holder_identity: holder.map(identity),
                lease_duration_seconds: Some(i32::from(DURATION)),
                ..Default::default()
            });
            l
        })
    }

    /// The production decision, or a mutation of it.
    fn decide(&self, s: &ElectionState, r: u8) -> Step {
        let me = &s.replicas[usize::from(r)];
        let leading = me.ours.is_some();
        match self.cfg.rule {
            ElectionRule::CreateAtOnce if s.lease.is_none() => return Step::Create,
            // The real rule creates a missing Lease at once too, vacated.
            ElectionRule::TrustVacated if !leading && matches!(s.lease, Some((_, None))) => {
                return Step::TakeOver;
            }
            _ => {}
        }
        let lease = Self::lease_object(s.lease);
        let prev = me.seen.map(|(version, since)| Seen {
            version: version.to_string(),
            since: self.instant(since),
        });
        let wrote = me.wrote.map(|v| v.to_string());
        step(
            lease.as_ref(),
            &identity(r),
            leading,
            prev.as_ref(),
            wrote.as_deref(),
            self.instant(s.now),
            Duration::from_secs(u64::from(DURATION)),
        )
        .0
    }

    /// The new observation after `decide` (recomputed the same way).
    fn observe(&self, s: &ElectionState, r: u8) -> Option<(u8, u8)> {
        let me = &s.replicas[usize::from(r)];
        if me.ours.is_some() {
            return None;
        }
        let version = s.lease.map(|(v, _)| v)?;
        match me.seen {
            Some((v, since)) if v == version => Some((v, since)),
            _ => Some((version, s.now)),
        }
    }

    /// The leader's or a standby's request deadline for a look at `now`.
    fn deadline(&self, me: &Replica, now: u8) -> Option<u8> {
        match (me.ours, me.valid_until) {
            (Some(_), _) if self.cfg.rule == ElectionRule::ReviveTerm => None,
            (Some(_), Some(v)) => Some(v),
            _ => Some(now + STANDBY_BUDGET),
        }
    }

    /// Reads the Lease and acts on it (a look, or the read after a 409).
    fn read_and_act(&self, s: &mut ElectionState, r: u8, deadline: Option<u8>) {
        let step = self.decide(s, r);
        let seen = self.observe(s, r);
        let now = s.now;
        let me = &mut s.replicas[usize::from(r)];
        me.seen = seen;
        let kind = match (step, s.lease) {
            (Step::Deposed, _) => {
                lose(me);
                return;
            }
            (Step::Wait, _) | (Step::Renew | Step::TakeOver, None) => return,
            (Step::Create, _) => Kind::Create,
            (Step::Renew | Step::TakeOver, Some((v, _))) => Kind::Replace { from: v },
        };
        if deadline.is_some_and(|d| now >= d) {
            return;
        }
        me.req = Some(Req {
            kind,
            sent: now,
            deadline,
            outcome: None,
        });
    }

    /// The API server applies `kind` from replica `r`.
    fn apply(s: &mut ElectionState, r: u8, kind: Kind, rule: ElectionRule) -> Outcome {
        let outcome = match (kind, s.lease) {
            (Kind::Create, Some(_)) => return Outcome::Conflict,
            (Kind::Replace { .. }, None) => return Outcome::Gone,
            (Kind::Replace { from }, Some((v, _))) if v != from => return Outcome::Conflict,
            (Kind::Create, None) => {
                if s.deleted {
                    s.recreated_after_delete = true;
                }
                // Created vacated (no term), except under the old rule,
                // which created it holding it.
                let holder = (rule == ElectionRule::CreateAtOnce).then_some(r);
                s.lease = Some((s.next_version, holder));
                s.next_version += 1;
                return if holder.is_some() {
                    Outcome::Won(s.next_version - 1)
                } else {
                    Outcome::Created
                };
            }
            (Kind::Replace { .. }, Some((_, holder))) => {
                if holder != Some(r) {
                    s.taken_over = true;
                }
                Outcome::Won(s.next_version)
            }
        };
        s.lease = Some((s.next_version, Some(r)));
        s.next_version += 1;
        outcome
    }

    /// `won()`: a write sent at `sent` answered now.
    fn won(&self, s: &mut ElectionState, r: u8, version: u8, sent: u8) {
        let now = s.now;
        let until = sent + TERM;
        let me = &mut s.replicas[usize::from(r)];
        me.wrote = Some(version);
        let leading = me.ours.is_some();
        let runs = me.in_term(now);
        if leading && !runs {
            s.late_renewal = true;
        }
        if self.cfg.rule == ElectionRule::ReviveTerm && leading {
            me.ours = Some(version);
            me.seen = None;
            me.valid_until = me.valid_until.map(|v| v.max(until));
            return;
        }
        if until <= now {
            lose(me);
            return;
        }
        me.ours = Some(version);
        me.seen = None;
        if runs {
            me.valid_until = me.valid_until.map(|v| v.max(until));
        } else {
            me.generation += 1;
            me.valid_until = Some(until);
        }
    }
}

fn identity(r: u8) -> String {
    format!("op-{r}")
}

/// `lose()`: the term ends now, its controllers stop.
fn lose(me: &mut Replica) {
    me.ours = None;
    me.seen = None;
    me.valid_until = None;
    me.controllers = None;
}

impl Model for Election {
    type State = ElectionState;
    type Action = ElectionAction;

    fn init_states(&self) -> Vec<ElectionState> {
        vec![ElectionState {
            now: 0,
            lease: None,
            next_version: 1,
            replicas: Default::default(),
            strays: Vec::new(),
            edits: 0,
            taken_over: false,
            recreated_after_delete: false,
            deleted: false,
            late_renewal: false,
        }]
    }

    fn actions(&self, s: &ElectionState, actions: &mut Vec<ElectionAction>) {
        use ElectionAction as A;
        if s.now < self.cfg.max_ticks {
            actions.push(A::Tick);
        }
        for r in 0..2u8 {
            let me = &s.replicas[usize::from(r)];
            match me.req {
                None => {
                    if me.ours.is_some() && !me.in_term(s.now) {
                        actions.push(A::RunOut(r));
                    } else if !me.looked {
                        actions.push(A::Look(r));
                    }
                }
                Some(req) => {
                    if req.outcome.is_none() {
                        actions.push(A::Land(r));
                    } else if req.deadline.is_none_or(|d| s.now <= d) {
                        actions.push(A::Answer(r));
                    }
                    if req.deadline.is_some_and(|d| s.now >= d) {
                        actions.push(A::Abandon(r));
                    }
                }
            }
            if me.in_term(s.now) && me.generation > me.handed {
                actions.push(A::Acquire(r));
            }
        }
        for i in 0..s.strays.len() {
            actions.push(A::LandStray(i));
        }
        if s.edits < self.cfg.edits && s.lease.is_some() {
            actions.push(A::Delete);
            actions.push(A::SetHolder(None));
            actions.push(A::SetHolder(Some(0)));
            actions.push(A::SetHolder(Some(1)));
        }
    }

    fn next_state(&self, last: &ElectionState, action: ElectionAction) -> Option<ElectionState> {
        use ElectionAction as A;
        let mut s = last.clone();
        match action {
            A::Tick => {
                s.now += 1;
                let now = s.now;
                for me in &mut s.replicas {
                    me.looked = false;
                    if !me.in_term(now) {
                        // Writers stop by the clock (`ensure`, `lost()`).
                        me.controllers = None;
                    }
                }
            }
            A::Look(r) => {
                s.replicas[usize::from(r)].looked = true;
                let me = &s.replicas[usize::from(r)];
                let deadline = self.deadline(me, s.now);
                match me.ours {
                    Some(from) => {
                        s.replicas[usize::from(r)].req = Some(Req {
                            kind: Kind::Replace { from },
                            sent: s.now,
                            deadline,
                            outcome: None,
                        });
                    }
                    None => self.read_and_act(&mut s, r, deadline),
                }
            }
            A::Land(r) => {
                let req = s.replicas[usize::from(r)].req?;
                let outcome = Self::apply(&mut s, r, req.kind, self.cfg.rule);
                if let Some(q) = s.replicas[usize::from(r)].req.as_mut() {
                    q.outcome = Some(outcome);
                }
            }
            A::Answer(r) => {
                let req = s.replicas[usize::from(r)].req.take()?;
                let leading = s.replicas[usize::from(r)].ours.is_some();
                match req.outcome? {
                    Outcome::Won(v) => self.won(&mut s, r, v, req.sent),
                    Outcome::Conflict if leading => self.read_and_act(&mut s, r, req.deadline),
                    Outcome::Gone if leading && self.cfg.rule != ElectionRule::CreateAtOnce => {
                        lose(&mut s.replicas[usize::from(r)]);
                    }
                    Outcome::Conflict | Outcome::Gone | Outcome::Created => {}
                }
            }
            A::Abandon(r) => {
                let req = s.replicas[usize::from(r)].req.take()?;
                if req.outcome.is_none() {
                    s.strays.push((r, req.kind));
                }
            }
            A::RunOut(r) => lose(&mut s.replicas[usize::from(r)]),
            A::Acquire(r) => {
                let me = &mut s.replicas[usize::from(r)];
                me.handed = me.generation;
                me.controllers = Some(me.generation);
            }
            A::LandStray(i) => {
                let (r, kind) = s.strays.remove(i);
                Self::apply(&mut s, r, kind, self.cfg.rule);
            }
            A::Delete => {
                s.lease = None;
                s.deleted = true;
                s.edits += 1;
            }
            A::SetHolder(h) => {
                s.lease = Some((s.next_version, h));
                s.next_version += 1;
                s.edits += 1;
            }
        }
        Some(s)
    }

    fn within_boundary(&self, s: &ElectionState) -> bool {
        s.now <= self.cfg.max_ticks
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(
                "never two replicas in a term at once",
                |_, s: &ElectionState| !s.replicas.iter().all(|r| r.in_term(s.now)),
            ),
            Property::always(
                "a term handed out runs with its controllers",
                |_, s: &ElectionState| {
                    s.replicas.iter().all(|r| {
                        !(r.in_term(s.now)
                            && r.handed == r.generation
                            && r.controllers != Some(r.generation))
                    })
                },
            ),
            Property::sometimes("a replica leads", |_, s: &ElectionState| {
                s.replicas.iter().any(|r| r.controllers.is_some())
            }),
            Property::sometimes(
                "a replica takes the Lease over from another holder",
                |_, s: &ElectionState| s.taken_over,
            ),
            Property::sometimes(
                "the Lease is created again after a deletion",
                |_, s: &ElectionState| s.recreated_after_delete,
            ),
            Property::sometimes(
                "a renewal answers after its term ended",
                |_, s: &ElectionState| s.late_renewal,
            ),
            Property::sometimes(
                "a late renewal's replica leads a new term",
                |_, s: &ElectionState| {
                    s.late_renewal
                        && s.replicas
                            .iter()
                            .any(|r| r.controllers.is_some_and(|g| g >= 2))
                },
            ),
        ]
    }
}
