//! The lease protocol, model-checked: one task's life in a small cluster,
//! every interleaving enumerated by [stateright].
//!
//! What is real and what is modelled:
//! - the operator's decision is the production `decide()` (with `settle`,
//!   `offered_lease`, `next_seen` for observations) from the operator's
//!   library, fed real `BatchTask`/`TaskLease` objects; the reconciler
//!   around it (cache lookups, expectations, the direct read, one write per
//!   pass) is mirrored from `operator/src/reconcile.rs` in a few lines;
//! - a worker's claim check is the production `check_current()`, its kill
//!   switch the SDK's `KillClock` (renew every TTL/3 from the send time,
//!   stop at 2/3 of the TTL);
//! - the API server ([`api_server`]) and PostgreSQL ([`storage`]) are
//!   models: compare-and-swap on resourceVersion and the CRDs' rules; the
//!   fenced table's registration and commit rules of design §4.
//!
//! Time is abstract ticks of two seconds; any actor may take no step for
//! any number of ticks (a pause, a partition, a GC stall). The operator may
//! crash (losing its cache, observations and an issue's second write, which
//! may still land later as a delayed request), its caches of the task and
//! of the leases lag independently, and a lease may be deleted by someone
//! else. See `docs/model.md`.

pub mod api_server;
pub mod operator;
pub mod storage;
pub mod worker;

use std::collections::BTreeMap;
use std::time::Duration;

use api_server::{ApiServer, decode, encode};
use batchlease_api::{BackoffSpec, BatchTask, BatchTaskSpec, LeasePhase, TaskLease, TaskPhase};
use batchlease_operator::observe::next_seen;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use operator::{Operator, Write};
use stateright::{Model, Property};
use storage::{Storage, StorageRule};
use tokio::time::Instant;
use worker::{Attempt, Worker, claim};

/// How the operator replaces a current lease that is gone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RepairRule {
    /// Today's rule: occupy the old name with a final tombstone, then issue
    /// the next token (`decide` returns `RetireToken`).
    RetireToken,
    /// The rule before issue 7: create the lease again under the same
    /// token. Kept to show the checker finds why it was wrong.
    SameToken,
}

/// When a worker stops its attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KillRule {
    /// The SDK's `KillClock`.
    Sdk,
    /// Never (a mutation: the checker must catch a worker without a kill
    /// switch).
    Never,
}

/// What a run explores.
#[derive(Clone, Debug)]
pub struct Config {
    pub workers: usize,
    /// Time runs from 0 to this many ticks (seconds).
    pub max_ticks: u8,
    pub operator_crashes: u8,
    /// Times someone else deletes a lease.
    pub lease_deletions: u8,
    pub repair: RepairRule,
    pub storage: StorageRule,
    pub kill: KillRule,
    /// Writes whose answer is lost (applied, the writer never learns).
    pub lost_answers: u8,
    /// Workers' clocks run this many percent fast or slow (each worker
    /// one or the other, all combinations explored); 0: exact clocks.
    pub drift_percent: u8,
    /// Liveness mode: time passes only when no other step changes
    /// anything (every live actor acts before the clock moves: the
    /// fairness under which "the task finishes" must hold).
    pub fair: bool,
}

impl Config {
    /// Two workers, 16 s, one operator crash, one deletion, today's rules
    /// (the CI tests narrow the bounds from here).
    pub fn quick() -> Self {
        Self {
            workers: 2,
            max_ticks: 8,
            operator_crashes: 1,
            lease_deletions: 1,
            repair: RepairRule::RetireToken,
            storage: StorageRule::RegisterFirst,
            kill: KillRule::Sdk,
            lost_answers: 0,
            drift_percent: 0,
            fair: false,
        }
    }
}

/// The lease TTL of the task (the CRD's minimum).
pub const TTL_SECONDS: i32 = 5;

/// Seconds per tick. Two keep the model small and still separate the
/// protocol's instants: a worker renews at most once per tick (the SDK
/// renews every TTL/3 ≈ 1.7 s), its kill switch fires in the second tick
/// after its last successful renewal was sent (2/3·TTL ≈ 3.3 s), the
/// operator expires a lease in the third tick without an observed renewal
/// (TTL = 5 s).
pub const TICK_SECONDS: u64 = 2;

/// The model: its configuration and the clocks' origins.
#[derive(Debug)]
pub struct Cluster {
    pub cfg: Config,
    base: Instant,
}

impl Cluster {
    pub fn new(cfg: Config) -> Self {
        Self {
            cfg,
            base: Instant::now(),
        }
    }

    fn instant(&self, tick: u8) -> Instant {
        self.base + Duration::from_secs(u64::from(tick) * TICK_SECONDS)
    }

    /// What a worker whose clock runs at `rate` percent reads at `tick`.
    fn worker_instant(&self, rate: u8, tick: u8) -> Instant {
        self.base + Duration::from_millis(u64::from(tick) * TICK_SECONDS * 10 * u64::from(rate))
    }
}

/// Wall-clock time at `tick` (plus `micros`, to make renewal markers
/// unique within a tick as real microsecond timestamps are).
fn wall(tick: u8, micros: u32) -> Timestamp {
    let base = Timestamp::from_second(1_800_000_000).unwrap_or(Timestamp::UNIX_EPOCH);
    base.checked_add(
        Duration::from_secs(u64::from(tick) * TICK_SECONDS)
            + Duration::from_micros(u64::from(micros)),
    )
    .unwrap_or(base)
}

/// The whole cluster.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct State {
    pub now: u8,
    pub api: ApiServer,
    pub op: Operator,
    pub workers: Vec<Worker>,
    pub pg: Storage,
    pub crashes: u8,
    pub deletions: u8,
    pub lost: u8,
    /// Each worker's clock rate, percent.
    pub rates: Vec<u8>,
    /// Requests of an operator that then crashed: they may still land.
    pub late: Vec<Write>,
    /// Ghost: tokens of the leases created (not tombstones), in order.
    pub created: Vec<i64>,
    /// Ghost: tokens whose lease was set Expired.
    pub expired: Vec<i64>,
    /// Ghost: a storage write of an attempt was accepted after its lease
    /// was expired.
    pub write_after_expiry: bool,
    /// Ghost (coverage): storage refused a stale attempt; a crashed
    /// operator's request landed; a tombstone retired a token.
    pub fenced_by_storage: bool,
    pub late_landed: bool,
    pub tombstones: u8,
}

/// A step.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub enum Action {
    Tick,
    SyncTask,
    SyncLeases,
    Reconcile,
    /// The operator's pending request reaches the API server.
    SendWrite,
    CrashOperator,
    /// A crashed operator's request lands late.
    LateWrite(usize),
    DeleteLease(String),
    Claim(usize, String),
    /// The claim is applied; its answer is lost and the worker, whose
    /// re-read fails too, never learns it holds the lease.
    ClaimAnswerLost(usize, String),
    Renew(usize),
    /// The renewal is applied; its answer is lost (the worker's clock does
    /// not count it, its copy is stale).
    RenewAnswerLost(usize),
    Register(usize),
    CheckFence(usize),
    CommitLands(usize),
    Complete(usize),
}

fn phase(l: &TaskLease) -> Option<LeasePhase> {
    l.status.as_ref().and_then(|s| s.phase)
}

fn the_task() -> BatchTask {
    let mut spec = BatchTaskSpec::for_queue("q");
    spec.lease_duration_seconds = TTL_SECONDS;
    spec.max_retries = 1;
    spec.backoff = BackoffSpec {
        initial_seconds: 1,
        max_seconds: 1,
        multiplier: 1,
    };
    let mut t = BatchTask::new("t", spec);
    t.metadata.namespace = Some("ns".into());
    t.metadata.uid = Some("task-uid".into());
    t.metadata.generation = Some(1);
    t
}

impl Model for Cluster {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let d = self.cfg.drift_percent;
        let mut all_rates: Vec<Vec<u8>> = vec![Vec::new()];
        for _ in 0..self.cfg.workers {
            let choices: Vec<u8> = if d == 0 {
                vec![100]
            } else {
                vec![100 - d, 100 + d]
            };
            all_rates = all_rates
                .into_iter()
                .flat_map(|r| {
                    choices.iter().map(move |c| {
                        let mut r = r.clone();
                        r.push(*c);
                        r
                    })
                })
                .collect();
        }
        all_rates
            .into_iter()
            .map(|rates| State {
                now: 0,
                api: ApiServer::new(&the_task()),
                op: Operator::default(),
                workers: vec![Worker::Idle; self.cfg.workers],
                pg: Storage::new(self.cfg.storage),
                crashes: 0,
                deletions: 0,
                lost: 0,
                rates,
                late: Vec::new(),
                created: Vec::new(),
                expired: Vec::new(),
                write_after_expiry: false,
                fenced_by_storage: false,
                late_landed: false,
                tombstones: 0,
            })
            .collect()
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        if s.now < self.cfg.max_ticks && (!self.cfg.fair || self.quiescent(s)) {
            actions.push(Action::Tick);
        }
        self.steps(s, actions);
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        self.apply(last, action)
    }

    fn within_boundary(&self, s: &State) -> bool {
        s.now <= self.cfg.max_ticks
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let mut p = self.safety();
        if self.cfg.fair {
            p.push(Property::eventually("the task finishes", |_, s: &State| {
                s.api
                    .task()
                    .status
                    .and_then(|st| st.phase)
                    .is_some_and(TaskPhase::is_terminal)
            }));
        }
        p
    }
}

impl Cluster {
    /// No step but a tick changes anything.
    fn quiescent(&self, s: &State) -> bool {
        let mut steps = Vec::new();
        self.steps(s, &mut steps);
        steps.into_iter().all(|a| self.apply(s, a).is_none())
    }

    /// Every step but a tick that `s` allows.
    fn steps(&self, s: &State, actions: &mut Vec<Action>) {
        if s.op.task.as_ref() != Some(&s.api.task) {
            actions.push(Action::SyncTask);
        }
        if s.op.leases != s.api.leases {
            actions.push(Action::SyncLeases);
        }
        if s.op.task.is_some() && s.op.pending.is_none() {
            actions.push(Action::Reconcile);
        }
        if s.op.pending.is_some() {
            actions.push(Action::SendWrite);
        }
        if s.crashes < self.cfg.operator_crashes && s.op != Operator::default() {
            actions.push(Action::CrashOperator);
        }
        for i in 0..s.late.len() {
            actions.push(Action::LateWrite(i));
        }
        if s.deletions < self.cfg.lease_deletions {
            for (name, l) in &s.api.leases {
                let l: TaskLease = decode(l);
                if phase(&l) == Some(LeasePhase::Held) {
                    actions.push(Action::DeleteLease(name.clone()));
                }
            }
        }
        for (w, worker) in s.workers.iter().enumerate() {
            match worker {
                Worker::Idle => {
                    for (name, l) in &s.api.leases {
                        let l: TaskLease = decode(l);
                        if phase(&l) == Some(LeasePhase::Offered) {
                            actions.push(Action::Claim(w, name.clone()));
                            if s.lost < self.cfg.lost_answers {
                                actions.push(Action::ClaimAnswerLost(w, name.clone()));
                            }
                        }
                    }
                }
                Worker::Holding(a) => {
                    if self.alive(a, s.now) && a.last_ok_sent < s.now {
                        actions.push(Action::Renew(w));
                        if s.lost < self.cfg.lost_answers {
                            actions.push(Action::RenewAnswerLost(w));
                        }
                    }
                    let registered = a.registered || self.cfg.storage == StorageRule::CommitOnly;
                    if !a.registered && self.cfg.storage == StorageRule::RegisterFirst {
                        actions.push(Action::Register(w));
                    }
                    if registered && !a.checked {
                        actions.push(Action::CheckFence(w));
                    }
                    if a.checked && !a.committed {
                        actions.push(Action::CommitLands(w));
                    }
                    if a.committed {
                        actions.push(Action::Complete(w));
                    }
                }
            }
        }
    }

    fn apply(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match &action {
            Action::Tick => s.now += 1,
            Action::SyncTask => {
                s.op.task = Some(s.api.task.clone());
                s.op.refused = None;
            }
            Action::SyncLeases => {
                let now = self.instant(s.now);
                let mut seen = BTreeMap::new();
                for (name, json) in &s.api.leases {
                    let l: TaskLease = decode(json);
                    if let Some(next) = next_seen(s.op.seen.get(name), &l, now) {
                        seen.insert(name.clone(), next);
                    }
                }
                s.op.seen = seen;
                s.op.leases = s.api.leases.clone();
                s.op.refused = None;
            }
            Action::Reconcile => self.reconcile(&mut s),
            Action::SendWrite => {
                if let Some(w) = s.op.pending.take() {
                    // reconcile.rs: every create is expected first; one
                    // that meets an existing object is not.
                    let creating = match &w {
                        Write::Create(l) => Some(decode::<TaskLease>(l).name_any()),
                        _ => None,
                    };
                    let sent = self.send(&mut s, w.clone());
                    if let (Some(name), true) = (creating, sent.already_exists) {
                        s.op.expect.remove(&name);
                    }
                    if !sent.applied {
                        s.op.refused = Some(w);
                    }
                    let next = sent.next;
                    if let Some(Write::Create(l)) = &next {
                        let l: TaskLease = decode(l);
                        s.op.expect.insert(l.name_any(), s.now);
                    }
                    s.op.pending = next;
                }
            }
            Action::CrashOperator => {
                s.crashes += 1;
                if let Some(w) = s.op.pending.take() {
                    // Already sent: it may still land.
                    s.late.push(w);
                }
                s.op = Operator::default();
            }
            Action::LateWrite(i) => {
                let w = s.late.remove(*i);
                if self.send(&mut s, w).applied {
                    s.late_landed = true;
                }
            }
            Action::DeleteLease(name) => {
                s.deletions += 1;
                let _ = s.api.delete_lease(name, None);
            }
            Action::ClaimAnswerLost(w, name) => {
                s.lost += 1;
                claim(&mut s, *w, name)?;
            }
            Action::RenewAnswerLost(w) => {
                let Worker::Holding(a) = &s.workers[*w] else {
                    return None;
                };
                let mut l: TaskLease = decode(&a.copy);
                l.spec.renew_time = Some(MicroTime(wall(s.now, s.api.rv)));
                s.lost += 1;
                s.api.replace_lease(&l).ok()?;
            }
            Action::Claim(w, name) => {
                let stored = claim(&mut s, *w, name)?;
                s.workers[*w] = Worker::Holding(Attempt {
                    rate: s.rates[*w],
                    lease: name.clone(),
                    token: stored.spec.fencing_token,
                    copy: encode(&stored),
                    claim_sent: s.now,
                    last_ok_sent: s.now,
                    registered: false,
                    checked: false,
                    committed: false,
                });
            }
            Action::Renew(w)
            | Action::Register(w)
            | Action::CheckFence(w)
            | Action::CommitLands(w)
            | Action::Complete(w) => self.worker_step(&mut s, *w, &action),
        }
        // A step that changes nothing is no step: paths then end where
        // nothing can happen any more, which `eventually` needs.
        (s != *last).then_some(s)
    }

    fn safety(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(
                "at most one attempt's effect is committed",
                |_, s: &State| s.pg.accepted.len() <= 1,
            ),
            Property::always("a token is used by at most one lease", |_, s: &State| {
                let mut seen = s.created.clone();
                seen.sort_unstable();
                seen.windows(2).all(|w| w[0] != w[1])
            }),
            Property::always(
                "tokens of created leases strictly increase",
                |_, s: &State| s.created.windows(2).all(|w| w[0] < w[1]),
            ),
            Property::always("never two Held leases", |_, s: &State| {
                s.api
                    .all_leases()
                    .iter()
                    .filter(|l| phase(l) == Some(LeasePhase::Held))
                    .count()
                    <= 1
            }),
            Property::always(
                "no accepted storage write carries a token below a registered one",
                |_, s: &State| !s.pg.stale_write_accepted,
            ),
            // The property that needs the kill switch: a worker stops (and
            // its writes carry a deadline) before the operator can expire
            // its lease, so nothing it writes lands after the expiry.
            Property::always(
                "no storage write is accepted for an attempt whose lease expired",
                |_, s: &State| !s.write_after_expiry,
            ),
            Property::sometimes("the task succeeds", |_, s: &State| {
                s.api.task().status.and_then(|st| st.phase) == Some(TaskPhase::Succeeded)
            }),
            // Coverage: the situations the safety properties are about are
            // reached (asserted by the CI bounds that should reach them).
            Property::sometimes("two workers hold attempts at once", |_, s: &State| {
                s.workers
                    .iter()
                    .filter(|w| matches!(w, Worker::Holding(_)))
                    .count()
                    >= 2
            }),
            Property::sometimes(
                "an expired lease's task is offered again",
                |_, s: &State| !s.expired.is_empty() && s.created.len() >= 2,
            ),
            Property::sometimes("storage refuses a stale attempt", |_, s: &State| {
                s.fenced_by_storage
            }),
            Property::sometimes("a crashed operator's request lands late", |_, s: &State| {
                s.late_landed
            }),
            Property::sometimes("a tombstone retires a token", |_, s: &State| {
                s.tombstones > 0
            }),
        ]
    }
}
