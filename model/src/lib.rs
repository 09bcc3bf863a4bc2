//! The lease protocol, model-checked: the lives of one or two tasks in a
//! small cluster (two sharing a resource lock; Speculative ones racing for
//! a storage key), every interleaving enumerated by [stateright].
//!
//! What is real and what is modelled:
//! - the operator's decision is the production `decide()` (with `settle`,
//!   `offered_lease`, `next_seen` for observations) from the operator's
//!   library, fed real `BatchTask`/`TaskLease` objects; the reconciler
//!   around it (cache lookups, expectations, the direct reads, one write
//!   per step) is mirrored from `operator/src/reconcile.rs` in a few lines;
//! - resource locks ([`locks`]): the real `locks::holder`, `waiting` and
//!   `queue_key` judge the lock Leases the operator reads directly, on its
//!   cached tasks; `decide` takes, releases and gives back;
//! - speculative mode ([`speculate`]): `settle` (an abort, the
//!   quarantine) and the lock rule of speculative tasks
//!   (`locks::respected`, `held_by_other`) are the production code; the
//!   SDK's speculative executor is mirrored in the worker ([`worker`]) and
//!   the store's compare-and-swap in the fenced transaction in
//!   [`storage`];
//! - renewals per worker ([`fleet`], issue 27): workers renew a
//!   `WorkerLease` (the CRD) listing their attempts; the operator credits
//!   its renewals and its departure with the production `worker_leases`
//!   rule and revokes an attempt in its status before it ends its lease;
//! - addressed offers ([`offers`], issue 27): the operator addresses each
//!   offer with the production `offers::candidates`/`choose` and re-addresses
//!   on `decide`'s `Readdress` by a CAS; the API server enforces the CRD's
//!   CEL rules on `offeredTo`;
//! - bound attempts ([`bound`], issue 27): the operator creates an
//!   addressed offer already `Held` by its worker (the production
//!   `offers::bound`, citing the WorkerLease `renewTime` its cache shows);
//!   the worker mirrors the SDK: its kill clock from the cited renewal's
//!   send, or from a renewal naming the attempt;
//! - a worker's claim check is the production `check_current()`, its kill
//!   switch the SDK's `KillClock` (renew every TTL/3 from the send time,
//!   stop at 2/3 of the TTL);
//! - the API server ([`api_server`]) and PostgreSQL ([`storage`]) are
//!   models: compare-and-swap on resourceVersion and the CRDs' rules (and
//!   the lock Leases); the fenced tables' registration and commit rules of
//!   design §4 and §5.
//!
//! Time is abstract ticks of two seconds; any actor may take no step for
//! any number of ticks (a pause, a partition, a GC stall). The operator may
//! crash (losing its cache, observations and a pass that waited for a
//! write's answer, while the write may still land later), its caches of the
//! tasks and of the leases lag independently, and a lease may be deleted by
//! someone else. See `docs/model.md`.

pub mod api_server;
pub mod bound;
pub mod cancel;
pub mod election;
pub mod fleet;
pub mod locks;
pub mod offers;
pub mod operator;
mod properties;
pub mod spawn;
pub mod speculate;
mod steps;
pub mod storage;
pub mod worker;

use std::collections::BTreeMap;
use std::time::Duration;

use api_server::{ApiServer, decode, encode};
use batchlease_api::{
    BackoffSpec, BatchTask, BatchTaskSpec, LeasePhase, TaskLease, TaskMode, TaskPhase,
};
use batchlease_operator::observe::{holder_stops_by, next_seen};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, Time};
use k8s_openapi::jiff::Timestamp;
use locks::{LockGhosts, LockRule};
use operator::{Operator, Write};
use speculate::SpecGhosts;
use stateright::{Model, Property};
use storage::{CasRule, Storage, StorageRule};
use tokio::time::Instant;
use worker::{Attempt, Round, Worker};

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
    /// Tasks, created in this order (distinct creation times).
    pub tasks: usize,
    pub workers: usize,
    /// Time runs from 0 to this many ticks (of [`TICK_SECONDS`]).
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
    /// The fast clocks' rate in percent instead of `100 + drift_percent`
    /// (0: that). With 2 s ticks a fast clock changes a worker's kill
    /// switch only from 167 % on, a slow one from 83 % down (issue 23).
    pub fast_percent: u8,
    /// Every task is Exclusive and needs the resource [`locks::RESOURCE`]:
    /// the lock passes between them.
    pub resource: bool,
    pub lock_rule: LockRule,
    /// The run starts with every task initialized (`Pending`, by the
    /// operator's own first pass) and the operator's task cache synced.
    /// Left out: a younger task taking a lock before the oldest is
    /// initialized (from then on the creation-order rule serves the
    /// oldest first).
    pub start_pending: bool,
    /// Each worker serves one task's queue (worker `w` task `w % tasks`;
    /// each task has a queue of its own) instead of every worker all.
    pub dedicated_workers: bool,
    /// The wall clocks stand still (the monotonic clocks, which time
    /// expiry and the kill switch, run on): written timestamps then carry
    /// no tick, so states that differ only in when a status or a lock was
    /// written are one. No backoff ever ends, so a failed attempt is never
    /// retried — within 6 s (3 ticks) none is anyway (see `docs/model.md`).
    pub frozen_wall: bool,
    /// Liveness mode: time passes only when no other step changes
    /// anything (every live actor acts before the clock moves: the
    /// fairness under which "the task finishes" must hold).
    pub fair: bool,
    /// Every task is `Speculative` (design §6, `maxSpeculativeAborts` 1):
    /// its attempts read the storage key [`storage::Key`] and commit with a
    /// compare-and-swap on its version (see [`speculate`]); with
    /// [`Config::resource`] they respect the lock of `r` and take it once
    /// quarantined.
    pub speculative: bool,
    pub cas: CasRule,
    /// The last task starts quarantined (`effectiveMode` Exclusive after
    /// one abort), the others `Speculative` (with
    /// [`Config::start_pending`]).
    pub start_quarantined: bool,
    /// A user may set `spec.cancel` on the first task, once, at any step
    /// (design §9; see [`cancel`]).
    pub cancel: bool,
    pub cancel_rule: cancel::CancelRule,
    /// Each attempt of the first task may spawn its one child (see
    /// [`spawn`]): a fence check, then a create that lands any time later.
    pub spawn: bool,
    pub spawn_rule: spawn::SpawnRule,
    /// The first task is created with [`LONG_TTL_SECONDS`], and the cancel
    /// also cuts its `spec.leaseDurationSeconds` to [`TTL_SECONDS`] (one
    /// spec update, the recipe); it comes only after a lease was
    /// deleted (the other orders are the plain cancel bounds'). Leases
    /// issued before keep their TTL (and their holders' kill clocks run on
    /// it).
    pub ttl_edit: bool,
    /// A user may delete the first task, once, at any step; the garbage
    /// collector then deletes its leases, one step each.
    pub task_deletion: bool,
    /// Renewals per worker (issue 27): workers renew a WorkerLease
    /// listing their attempts instead of each TaskLease (see [`fleet`]).
    pub per_worker: bool,
    pub worker_rule: fleet::WorkerRule,
    /// Faults of WorkerLeases (one budget): an attempt dropped from
    /// `holds` while it runs, a renewal that lands late.
    pub worker_faults: u8,
    /// Times someone other than its worker deletes a WorkerLease.
    pub worker_deletions: u8,
    /// How the operator times the holder of a lost lease of a cancelled
    /// task in per-worker mode (today's `decide`, or the refresh bound).
    pub lost_wait: fleet::LostWait,
    /// Addressed offers (issue 27, with [`Config::per_worker`]): each
    /// WorkerLease says [`offers::SLOTS`], the operator addresses each offer
    /// to a worker and re-addresses it (see [`offers`]).
    pub addressed: bool,
    pub address_rule: offers::AddressRule,
    /// Times the operator's view of a worker lapses (its WorkerLease not
    /// seen renewed for its duration).
    pub lapses: u8,
    /// The last worker is an older one: it claims any offer of its queue,
    /// whatever the address.
    pub old_worker: Option<offers::OldClaim>,
    /// Worker 0 is dead: it takes no step (its WorkerLease stands).
    pub dead_worker: bool,
    /// Bound attempts (with [`Config::addressed`]): each WorkerLease says
    /// `takesBound` and carries a `renewTime` from its create; a new
    /// offer to a worker with a free slot is created `Held` by it (see
    /// [`bound`]).
    pub bound: bool,
    pub bound_rule: bound::BoundRule,
    /// Renewals of a WorkerLease by a worker with nothing to name (the
    /// SDK renews it always; a budget here): fresh citations for bound
    /// attempts, and a 404 found while idle.
    pub idle_renewals: u8,
}

impl Config {
    /// Two workers, 16 s, one operator crash, one deletion, today's rules
    /// (the CI tests narrow the bounds from here).
    pub fn quick() -> Self {
        Self {
            tasks: 1,
            resource: false,
            lock_rule: LockRule::Sound,
            frozen_wall: false,
            dedicated_workers: false,
            start_pending: false,
            workers: 2,
            max_ticks: 8,
            operator_crashes: 1,
            lease_deletions: 1,
            repair: RepairRule::RetireToken,
            storage: StorageRule::RegisterFirst,
            kill: KillRule::Sdk,
            lost_answers: 0,
            drift_percent: 0,
            fast_percent: 0,
            fair: false,
            speculative: false,
            cas: CasRule::InFence,
            start_quarantined: false,
            cancel: false,
            cancel_rule: cancel::CancelRule::WaitTtl,
            spawn: false,
            spawn_rule: spawn::SpawnRule::Gate,
            ttl_edit: false,
            task_deletion: false,
            per_worker: false,
            worker_rule: fleet::WorkerRule::Revoke,
            worker_faults: 0,
            worker_deletions: 0,
            lost_wait: fleet::LostWait::Ttl,
            addressed: false,
            address_rule: offers::AddressRule::Real,
            lapses: 0,
            old_worker: None,
            dead_worker: false,
            bound: false,
            bound_rule: bound::BoundRule::Real,
            idle_renewals: 0,
        }
    }
}

/// The lease TTL of the task (the CRD's minimum).
pub const TTL_SECONDS: i32 = 5;

/// The first task's TTL with [`Config::ttl_edit`], before the edit.
pub const LONG_TTL_SECONDS: i32 = 10;

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

    /// Whether worker `w` takes leases of `lease`'s queue.
    fn serves(&self, w: usize, lease: &TaskLease) -> bool {
        lease.spec.queue != spawn::CHILD_QUEUE
            && (!self.cfg.dedicated_workers
                || self.cfg.tasks == 0
                || lease.spec.task_name == task_name(w % self.cfg.tasks))
    }

    /// Wall-clock time at `tick` (see [`Config::frozen_wall`]).
    fn wall(&self, tick: u8, micros: u32) -> Timestamp {
        wall(if self.cfg.frozen_wall { 0 } else { tick }, micros)
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
    /// Ghost, per task: tokens of the leases created (not tombstones), in
    /// order.
    pub created: Vec<Vec<i64>>,
    /// Ghost, per task: tokens whose lease was set Expired.
    pub expired: Vec<Vec<i64>>,
    /// Ghost: a storage write of an attempt was accepted after its lease
    /// was expired.
    pub write_after_expiry: bool,
    /// Ghost (coverage): storage refused a stale attempt; a crashed
    /// operator's request landed; a tombstone retired a token.
    pub fenced_by_storage: bool,
    pub late_landed: bool,
    /// Coverage ghosts: a claim's or a renewal's answer was lost; an
    /// expiry landed after each, after the operator crashed.
    pub lost_claim: bool,
    pub lost_renewal: bool,
    pub expired_after_lost_claim: bool,
    pub expired_after_lost_renewal: bool,
    pub expired_after_crash: bool,
    pub tombstones: u8,
    /// Ghosts of the lock properties.
    pub locks: LockGhosts,
    /// Ghosts of speculative mode.
    pub spec: SpecGhosts,
    /// Ghosts of cancellation.
    pub cancel: cancel::CancelGhosts,
    /// Children's creates on their way, and ghosts of spawning.
    pub spawn: spawn::SpawnGhosts,
    /// Workers' sides of their WorkerLeases, and ghosts of renewals per
    /// worker.
    pub fleet: fleet::Fleet,
    /// Budgets and ghosts of addressed offers.
    pub offers: offers::OfferGhosts,
}

/// A step.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub enum Action {
    Tick,
    /// The task cache catches up (one watch for all tasks: the cache is
    /// always the API server's state at some earlier moment).
    SyncTask,
    SyncLeases,
    /// A reconcile pass of task `i`.
    Reconcile(usize),
    /// The request of task `i`'s pass reaches the API server (passes of
    /// different tasks run concurrently, as the controller runs them).
    SendWrite(usize),
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
    /// A speculative round: reads the key, runs the function (its side
    /// effect), passes its fence check and sends its commit, which lands
    /// in a later step (`CommitLands`).
    ReadKey(usize),
    CommitLands(usize),
    Complete(usize),
    /// A user sets `spec.cancel` on task `i`.
    Cancel(usize),
    /// Worker `w`'s attempt (of the first task) passes its fence check
    /// and sends the create of its child.
    SpawnCheck(usize),
    /// The `k`-th create on its way lands.
    SpawnLands(usize),
    /// A user deletes task `i`.
    DeleteTask(usize),
    /// The garbage collector deletes a lease whose task is gone.
    CollectLease(String),
    /// The operator's cache of WorkerLeases catches up.
    SyncWorkerLeases,
    /// Worker `w` sends a renewal of its WorkerLease that lands later.
    SendRenewal(usize),
    /// Worker `w`'s renewal on its way lands.
    RenewLands(usize),
    /// Worker `w` renews its WorkerLease without its attempt (which it
    /// still runs).
    DropAttempt(usize),
    /// Someone deletes a WorkerLease.
    DeleteWorkerLease(String),
    /// Worker `w` refreshes its held TaskLease's `renewTime` (per-worker
    /// mode: at least every R, see [`fleet::REFRESH_TTLS`]).
    Refresh(usize),
    /// Task `i`'s pending create of a new offer, addressed to worker `w`,
    /// reaches the API server.
    SendAddressed(usize, usize),
    /// The operator's view of worker `w` lapses: its WorkerLease not seen
    /// renewed for its duration.
    Lapse(usize),
    /// Worker `w`'s watch delivers the create of lease `name`, bound to it
    /// (at any later time, or never), and the worker looks at it.
    SeeBound(usize, String),
    /// Worker `w` looks again at bound lease `name`, which waits (for a
    /// renewal naming it, or a slot).
    LookBound(usize, String),
}

fn phase(l: &TaskLease) -> Option<LeasePhase> {
    l.status.as_ref().and_then(|s| s.phase)
}

/// Name of task `i`: `t`, `u`, `v`, …
pub fn task_name(i: usize) -> String {
    let c = u8::try_from(i).map_or('?', |i| char::from(b't'.saturating_add(i)));
    c.to_string()
}

/// Task `i` as created: each a second after the one before (the creation
/// order serves waiting tasks in turn, see `operator/src/locks.rs`).
fn new_task(cfg: &Config, i: usize) -> BatchTask {
    let mut spec = BatchTaskSpec::for_queue(if cfg.dedicated_workers {
        format!("q-{}", task_name(i))
    } else {
        "q".into()
    });
    if cfg.resource {
        spec.resources = vec![locks::RESOURCE.into()];
    }
    if cfg.speculative {
        spec.mode = TaskMode::Speculative;
        spec.max_speculative_aborts = 1;
    }
    spec.lease_duration_seconds = if cfg.ttl_edit && i == 0 {
        LONG_TTL_SECONDS
    } else {
        TTL_SECONDS
    };
    spec.max_retries = 1;
    spec.backoff = BackoffSpec {
        initial_seconds: 1,
        max_seconds: 1,
        multiplier: 1,
    };
    let mut t = BatchTask::new(&task_name(i), spec);
    t.metadata.namespace = Some("ns".into());
    t.metadata.uid = Some(if i == 0 {
        "task-uid".into()
    } else {
        format!("task-uid-{i}")
    });
    let created = wall(0, 0)
        .checked_sub(Duration::from_secs(60 - u64::try_from(i).unwrap_or(0)))
        .unwrap_or(Timestamp::UNIX_EPOCH);
    t.metadata.creation_timestamp = Some(Time(created));
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
            let fast = match self.cfg.fast_percent {
                0 => 100 + d,
                f => f,
            };
            let choices: Vec<u8> = if d == 0 {
                vec![100]
            } else {
                vec![100 - d, fast]
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
        let states = all_rates.into_iter().map(|rates| State {
            now: 0,
            api: ApiServer::new(
                (0..self.cfg.tasks)
                    .map(|i| new_task(&self.cfg, i))
                    .collect(),
            ),
            op: Operator::default(),
            workers: vec![Worker::Idle; self.cfg.workers],
            pg: Storage {
                cas: self.cfg.cas,
                ..Storage::new(self.cfg.storage, self.cfg.tasks)
            },
            crashes: 0,
            deletions: 0,
            lost: 0,
            rates,
            late: Vec::new(),
            created: vec![Vec::new(); self.cfg.tasks],
            expired: vec![Vec::new(); self.cfg.tasks],
            write_after_expiry: false,
            fenced_by_storage: false,
            late_landed: false,
            lost_claim: false,
            lost_renewal: false,
            expired_after_lost_claim: false,
            expired_after_lost_renewal: false,
            expired_after_crash: false,
            tombstones: 0,
            locks: LockGhosts::default(),
            spec: SpecGhosts::default(),
            cancel: cancel::CancelGhosts::default(),
            spawn: spawn::SpawnGhosts::default(),
            fleet: fleet::Fleet::new(self.cfg.workers),
            offers: offers::OfferGhosts::default(),
        });
        states
            .map(|mut s| {
                s.api.offer_rules = self.cfg.address_rule.cel();
                if self.cfg.per_worker {
                    self.fleet_start(&mut s);
                }
                self.started(s)
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
                (0..s.api.tasks.len()).all(|i| {
                    s.api
                        .task(i)
                        .status
                        .and_then(|st| st.phase)
                        .is_some_and(TaskPhase::is_terminal)
                })
            }));
        }
        p
    }
}
