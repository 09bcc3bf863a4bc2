//! The operator: two caches that lag the API server, the reconciler's
//! pass around the real `decide()` (mirrored from
//! `operator/src/reconcile.rs`), and its requests, which land in a
//! separate step. Passes of different tasks run concurrently (the
//! controller runs them so), one pass per task at a time.

use std::collections::BTreeMap;
use std::sync::Arc;

use batchlease_api::{BatchTask, LeasePhase, TaskLease, check_current};
use batchlease_operator::decide::{Decision, Input, Lookup, QueueGate, decide};
use batchlease_operator::deps::Readiness;
use batchlease_operator::lease_build::offered_lease;
use batchlease_operator::locks::{self as operator_locks, Slot};
use batchlease_operator::observe::Seen;
use batchlease_operator::worker_leases::WorkerSeen;
use k8s_openapi::api::coordination::v1::Lease;
use kube::ResourceExt;

use crate::api_server::{Refused, decode, encode};
use crate::locks::{self, Pass};
use crate::{Cluster, RepairRule, State, TICK_SECONDS, phase};

/// What the operator holds in memory; all of it is lost in a crash.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq)]
pub struct Operator {
    /// Its cache of the tasks and of the leases (two watches: they lag
    /// independently; `None` until the first sync).
    pub tasks: Option<Vec<String>>,
    pub leases: BTreeMap<String, String>,
    pub seen: BTreeMap<String, Seen>,
    /// Lease creates sent, and when (the expectations `create_lease` sets,
    /// operator/src/effects/writes.rs).
    pub expect: BTreeMap<String, u8>,
    /// Per task, the write its pass decided, not applied yet (a request on
    /// its way): the task's next reconcile waits for it (the controller
    /// never runs two passes of one task at once), a crash leaves it in
    /// flight.
    pub pending: BTreeMap<usize, Write>,
    /// Per task, the last request the API server refused: deciding it
    /// again before the caches change is no step (a retry loop is not
    /// progress).
    pub refused: BTreeMap<usize, Write>,
    /// The tracker's departures (`observe::Tracker`): per lease gone from
    /// the cache, its task's UID and until when its holder may run.
    pub departed: BTreeMap<String, (String, tokio::time::Instant)>,
    /// Attempts of deleted tasks whose departure it did not see: when it
    /// first asked about one (lease name, task UID).
    pub unknown_since: BTreeMap<(String, String), tokio::time::Instant>,
    /// Per-worker renewals: its cache of the WorkerLeases (a watch of its
    /// own, lagging like the others) and what it observed of each.
    pub wleases: BTreeMap<String, String>,
    pub wseen: BTreeMap<String, WorkerSeen>,
    /// WorkerLeases it saw depart (gone from its cache), each with the
    /// UIDs of its holder's leases whose claim it had observed by then:
    /// those may end without a revocation (`Cluster::fleet_guard`).
    pub wgone: BTreeMap<String, std::collections::BTreeSet<String>>,
    /// Addressed offers: its book of outstanding addresses (lease → its
    /// worker and the tick since when, `offers::OfferBook`), and the
    /// workers its view has lapsed (see [`crate::offers`]).
    pub book: BTreeMap<String, (String, u8)>,
    pub lapsed: std::collections::BTreeSet<String>,
    /// Its WorkerLease cache has synced once (the watch listed).
    pub wlisted: bool,
}

/// What became of a request.
#[derive(Debug, Default)]
pub(crate) struct Sent {
    pub(crate) applied: bool,
    /// An issue's lease create, after its status write.
    pub(crate) next: Option<Write>,
    pub(crate) already_exists: bool,
    /// A lock Lease as written (the write's answer).
    pub(crate) lock: Option<Lease>,
    /// A lock to give back was not found (effects/lock_writes.rs skips it).
    pub(crate) not_found: bool,
}

/// One request of the operator to the API server.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub enum Write {
    /// `PUT …/status` (task JSON); an issue's lease create follows it.
    Status {
        task: String,
        then_create: Option<String>,
    },
    /// `PUT` of a lease (expiry).
    Lease(String),
    /// `POST` of a lease.
    Create(String),
    /// `DELETE` of a lease with a resourceVersion precondition.
    Delete(String, Option<String>),
    /// `POST` (no resourceVersion) or `PUT` (a CAS) of a lock Lease
    /// (JSON); when it lands, `pass` goes on from its answer.
    TakeLock {
        lease: String,
        pass: Option<Box<Pass>>,
    },
    /// `PUT`s (CAS each) giving back lock Leases, first to last, one per
    /// step; then `pass` decides again (`ReleaseLocks`) or ends
    /// (`LockBlocked`'s give-back).
    ReleaseLocks {
        leases: Vec<String>,
        pass: Option<Box<Pass>>,
        then_decide: bool,
    },
    /// `PUT …/status` of a WorkerLease (a CAS on the cached copy)
    /// revoking an attempt (JSON); then the write that ends its lease.
    Revoke { lease: String, then: Box<Write> },
    /// `PUT` of an unclaimed offer addressed again (a CAS on the cached
    /// copy; JSON), its addressee `lapsed` or a TTL unclaimed.
    Readdress { lease: String, lapsed: bool },
}

impl Write {
    /// The request alone, as it may still land after its sender crashed
    /// (the pass waiting for its answer is gone).
    pub(crate) fn in_flight(self) -> Self {
        match self {
            Self::TakeLock { lease, .. } => Self::TakeLock { lease, pass: None },
            Self::ReleaseLocks { mut leases, .. } => {
                leases.truncate(1);
                Self::ReleaseLocks {
                    leases,
                    pass: None,
                    then_decide: false,
                }
            }
            other => other,
        }
    }
}

impl Cluster {
    /// One reconcile pass of task `i`, as `reconcile.rs` does it, on the
    /// operator's caches and its direct reads; leaves its request pending
    /// (nothing when it decides to wait). Returns whether a speculative
    /// task was held back by a live lock holder (for a coverage
    /// property: kept out of the state, where it would double it).
    pub(crate) fn reconcile(&self, s: &mut State, i: usize) -> bool {
        let Some(task_json) =
            s.op.tasks
                .as_ref()
                .and_then(|t| t.get(i))
                .filter(|t| !t.is_empty())
                .cloned()
        else {
            return false;
        };
        let mut task: BatchTask = decode(&task_json);
        if self.cfg.cancel_rule == crate::cancel::CancelRule::SpecTtl
            && let Some(st) = task.status.as_mut()
        {
            // The mutation: no lease TTL on record, so a loss is timed by
            // the spec's (what decide did before issue 22).
            st.current_lease_duration_seconds = None;
            for h in &mut st.history {
                h.lease_duration_seconds = None;
            }
        }
        let task = task;
        // reconcile.rs: a spawned child's first pass reads its parent.
        match self.admission(s, &task) {
            Err(()) => return false,
            Ok(Some(refused)) => {
                let mut t = task.clone();
                t.status = Some(refused);
                let w = Write::Status {
                    task: encode(&t),
                    then_create: None,
                };
                if s.op.refused.get(&i) != Some(&w) {
                    s.op.pending.insert(i, w);
                }
                return false;
            }
            Ok(None) => {}
        }
        let uid = task.uid().unwrap_or_default();
        let mut leases: Vec<Arc<TaskLease>> =
            s.op.leases
                .values()
                .map(|l| Arc::new(decode::<TaskLease>(l)))
                .filter(|l| l.spec.task_uid == uid)
                .collect();
        let current = task.status.as_ref().and_then(|st| st.current_lease.clone());
        let mut observation = current
            .as_deref()
            .and_then(|c| s.op.seen.get(c))
            .map(|seen| seen.observation);
        if self.cfg.cancel_rule == crate::cancel::CancelRule::EndAtRelease {
            // The mutation: a released holder is taken as long silent.
            let released = current
                .as_deref()
                .and_then(|c| leases.iter().find(|l| l.name_any() == c))
                .is_some_and(|l| {
                    phase(l) == Some(LeasePhase::Released) && l.spec.holder_identity.is_some()
                });
            if released {
                let long_ago = self
                    .instant(0)
                    .checked_sub(std::time::Duration::from_secs(3600))
                    .unwrap_or(self.instant(0));
                observation = Some(batchlease_operator::observe::Observation {
                    last_renewal: long_ago,
                    claimed_at: long_ago,
                    named: false,
                });
            }
        }
        let mut lookup = Lookup::CacheOnly;
        if let Some(cur) = current.as_deref() {
            if leases.iter().any(|l| l.name_any() == cur) {
                s.op.expect.remove(cur);
            } else if s
                .op
                .expect
                .get(cur)
                .is_some_and(|at| u64::from(s.now.saturating_sub(*at)) * TICK_SECONDS < 10)
            {
                lookup = Lookup::Creating;
            }
        }
        let offer = current
            .as_deref()
            .and_then(|c| leases.iter().find(|l| l.name_any() == c))
            .cloned()
            .and_then(|l| self.offer_view(s, &l));
        let tick = s.now;
        let decide_with = |leases: &[Arc<TaskLease>], lookup, locks: Option<Vec<Slot>>| {
            decide(&Input {
                task: &task,
                leases,
                observation,
                now: self.instant(tick),
                wall: self.wall(tick, 0),
                jitter: 0.5,
                lookup,
                deps: Readiness::Ready,
                locks,
                // Running is written on the first pass that sees a claim.
                // A pass is a step the checker may take at any point, so
                // this reaches every state the operator's default delay
                // (1 s) reaches — that delay only turns early passes into
                // waits — and more: settling from Ready is explored when a
                // claim and its completion land before the next pass. A
                // delay here would leave the 0 s bounds (crash, deletion,
                // speculative races) without a Running write at all
                // (measured: the 2-task 6 s bound went from 873,130 to
                // 532,157 states with 1 s).
                running_after: std::time::Duration::ZERO,
                needed_by: None,
                queue: QueueGate::Open,
                offer,
                per_worker_offers: true,
            })
        };
        let mut decision = decide_with(&leases, lookup, None);
        if let Decision::LookUpLease(name) = &decision {
            lookup = match s.api.lease(name) {
                Some(l) if check_current(&task, &l).is_ok() => {
                    leases.push(Arc::new(l));
                    Lookup::CacheOnly
                }
                Some(_) => Lookup::Occupied,
                None => Lookup::Absent,
            };
            decision = decide_with(&leases, lookup, None);
        }
        let mut slots = None;
        let mut held_back = false;
        if let Decision::FetchLocks(resources) = &decision {
            self.note_unknown_holders(s);
            let fetched = self.fetch_locks(s, &task, resources);
            decision = decide_with(&leases, lookup, Some(fetched.clone()));
            slots = Some(fetched);
            held_back = matches!(&decision, Decision::LockBlocked { .. })
                && !operator_locks::respected(&task).is_empty();
        }
        let pass = || Pass::new(&task, &leases, lookup, slots.as_deref());
        match self.request(s, &task, decision, pass) {
            Some(w) if s.op.refused.get(&i) != Some(&w) => {
                s.op.pending.insert(i, w);
            }
            _ => {}
        }
        held_back
    }

    /// The request a decision asks for (`None`: nothing to write); a lock
    /// write carries the `pass`, which goes on when it lands.
    fn request(
        &self,
        s: &mut State,
        task: &BatchTask,
        decision: Decision,
        pass: impl FnOnce() -> Pass,
    ) -> Option<Write> {
        match decision {
            // A second read, or locks a pass already read, is the end of
            // the pass (reconcile.rs requeues).
            // The model's tasks set no ttlSecondsAfterFinished.
            // The model's queue has no TaskQueue: nothing is held back.
            Decision::Wait(_)
            | Decision::HeldBack(_)
            | Decision::LookUpLease(_)
            | Decision::FetchLocks(_)
            | Decision::DeleteTask { .. } => None,
            Decision::Readdress { lease, lapsed } => self.readdress(s, &lease, lapsed),
            Decision::TakeLock(lease) => Some(Write::TakeLock {
                lease: encode(&*lease),
                pass: Some(Box::new(pass())),
            }),
            Decision::ReleaseLocks { leases, .. } => Some(Write::ReleaseLocks {
                leases: leases.iter().map(encode).collect(),
                pass: Some(Box::new(pass())),
                then_decide: true,
            }),
            Decision::LockBlocked { give_back, .. } => {
                (!give_back.is_empty()).then(|| Write::ReleaseLocks {
                    leases: give_back.iter().map(encode).collect(),
                    pass: Some(Box::new(pass())),
                    then_decide: false,
                })
            }
            // reconcile.rs: a task ends once its listed children passed
            // the spawn gate.
            Decision::WriteStatus { status, .. } if self.children_pending(s, task, &status) => None,
            Decision::WriteStatus { status, .. } => {
                let mut t = task.clone();
                t.status = Some(self.lost_wait(task, *status));
                Some(Write::Status {
                    task: encode(&t),
                    then_create: None,
                })
            }
            Decision::Issue {
                status, mut lease, ..
            } => {
                let mut t = task.clone();
                t.status = Some(self.lost_wait(task, *status));
                if self.cfg.per_worker {
                    // The operator that honours WorkerLeases offers each
                    // lease renewed per lease; the claim may turn it.
                    lease.spec.renewal = Some(batchlease_api::Renewal::Lease);
                }
                Some(Write::Status {
                    task: encode(&t),
                    then_create: Some(encode(&*lease)),
                })
            }
            Decision::RetireToken(tombstone) => {
                s.op.expect.insert(tombstone.name_any(), s.now);
                Some(Write::Create(match self.cfg.repair {
                    RepairRule::RetireToken => encode(&*tombstone),
                    RepairRule::SameToken => {
                        let token = task.status.as_ref().map_or(0, |st| st.fencing_token);
                        encode(&offered_lease(task, token))
                    }
                }))
            }
            Decision::Expire { lease, .. } | Decision::Release { lease, .. } => {
                self.fleet_guard(s, &lease, Write::Lease(encode(&*lease)))
            }
            // One delete per pass is enough for the model (it keeps few leases).
            Decision::Prune { victims, .. } => victims
                .into_iter()
                .next()
                .map(|(name, rv)| Write::Delete(name, rv)),
        }
    }

    /// `status` as the operator writes it for `task`: with
    /// [`LostWait::RefreshBound`](crate::fleet::LostWait) in per-worker
    /// mode, a `Lost` entry the decision adds carries R + the lease's TTL
    /// as the wait for its holder (how long a Worker-mode holder of a
    /// deleted lease may run: it stops at the latest R + 2/3·TTL after its
    /// last successful refresh, which landed before the deletion).
    /// Today's `decide` records the TTL alone (`LostWait::Ttl`).
    fn lost_wait(
        &self,
        task: &BatchTask,
        mut status: batchlease_api::BatchTaskStatus,
    ) -> batchlease_api::BatchTaskStatus {
        if !self.cfg.per_worker || self.cfg.lost_wait != crate::fleet::LostWait::RefreshBound {
            return status;
        }
        let known: Vec<i64> = task.status.as_ref().map_or_else(Vec::new, |st| {
            st.history
                .iter()
                .filter(|h| h.outcome == "Lost")
                .map(|h| h.token)
                .collect()
        });
        for h in &mut status.history {
            if h.outcome == "Lost" && !known.contains(&h.token) {
                let ttl = h
                    .lease_duration_seconds
                    .unwrap_or(task.spec.lease_duration_seconds);
                let refresh = ttl
                    .saturating_mul(i32::try_from(crate::fleet::REFRESH_TTLS).unwrap_or(i32::MAX));
                h.lease_duration_seconds = Some(ttl.saturating_add(refresh));
            }
        }
        status
    }

    /// The pass goes on after a lock write: it decides again on what it
    /// started with and the slots as its writes left them. (No renewal
    /// observation: a pass that writes locks never times a held lease.)
    fn go_on(&self, s: &mut State, pass: Pass) -> Option<Write> {
        let task: BatchTask = decode(&pass.task);
        let leases = pass.leases();
        let decision = decide(&Input {
            task: &task,
            leases: &leases,
            observation: None,
            now: self.instant(s.now),
            wall: self.wall(s.now, 0),
            jitter: 0.5,
            lookup: pass.lookup.into(),
            deps: Readiness::Ready,
            locks: Some(pass.slots()),
            running_after: std::time::Duration::ZERO,
            needed_by: None,
            queue: QueueGate::Open,
            offer: None,
            per_worker_offers: true,
        });
        self.request(s, &task, decision, || pass)
    }

    /// Task `i`'s pending request reaches the API server; an issue's
    /// create follows its status write, a pass goes on after a lock write.
    pub(crate) fn send_pending(&self, s: &mut State, i: usize) {
        let Some(w) = s.op.pending.remove(&i) else {
            return;
        };
        // effects/writes.rs: every create is expected first; one that meets an
        // existing object is not.
        let creating = match &w {
            Write::Create(l) => Some(decode::<TaskLease>(l).name_any()),
            _ => None,
        };
        let sent = self.send(s, w.clone());
        if let (Some(name), true) = (creating, sent.already_exists) {
            // effects/address.rs `unaddress`: it counts against nobody.
            s.op.book.remove(&name);
            s.op.expect.remove(&name);
        }
        // A refused lock write fails the pass (reconcile.rs returns the
        // error); a lock to give back that is gone is skipped.
        if !sent.applied && !sent.not_found {
            if self.cfg.fair {
                s.op.refused.insert(i, w);
            }
            return;
        }
        let next = match w {
            Write::TakeLock {
                pass: Some(mut pass),
                ..
            } => {
                if let Some(written) = &sent.lock {
                    self.update_slots(s, &mut pass, written);
                }
                self.go_on(s, *pass)
            }
            Write::ReleaseLocks {
                mut leases,
                pass: Some(mut pass),
                then_decide,
            } => {
                if let Some(written) = &sent.lock {
                    self.update_slots(s, &mut pass, written);
                }
                leases.remove(0);
                if !leases.is_empty() {
                    Some(Write::ReleaseLocks {
                        leases,
                        pass: Some(pass),
                        then_decide,
                    })
                } else if then_decide {
                    self.go_on(s, *pass)
                } else {
                    None
                }
            }
            _ => sent.next,
        };
        if let Some(next) = next {
            if let Write::Create(l) = &next {
                let l: TaskLease = decode(l);
                s.op.expect.insert(l.name_any(), s.now);
            }
            s.op.pending.insert(i, next);
        }
    }

    /// Applies one operator request.
    pub(crate) fn send(&self, s: &mut State, write: Write) -> Sent {
        let mut sent = Sent::default();
        match write {
            Write::Status { task, then_create } => {
                let t: BatchTask = decode(&task);
                let old = s
                    .api
                    .task_index(&t.name_any())
                    .and_then(|i| s.api.task(i).status);
                if s.api.replace_status(&t).is_ok() {
                    if let Some(new) = &t.status {
                        crate::speculate::status_written(s, old.as_ref(), new);
                        crate::cancel::status_written(s, old.as_ref(), new);
                        if let Some(i) = s.api.task_index(&t.name_any()) {
                            crate::spawn::status_written(s, self, i, new);
                        }
                    }
                    sent.applied = true;
                    sent.next = then_create.map(Write::Create);
                }
            }
            Write::Lease(l) => {
                if let Ok(stored) = s.api.replace_lease(&decode(&l)) {
                    sent.applied = true;
                    crate::bound::lease_written(s, &stored);
                    let ti = s.api.task_index(&stored.spec.task_name);
                    if let (Some(LeasePhase::Expired), Some(ti)) = (phase(&stored), ti) {
                        s.expired[ti].push(stored.spec.fencing_token);
                        s.expired_after_lost_claim |= s.lost_claim;
                        s.expired_after_lost_renewal |= s.lost_renewal;
                        s.expired_after_crash |= s.crashes > 0;
                        s.fleet.expired_after_fault |= s.fleet.faults > 0;
                        s.fleet.expired_after_deletion |= s.fleet.deletions > 0;
                    }
                }
            }
            Write::Create(l) => {
                let l: TaskLease = decode(&l);
                let tombstone =
                    l.status.as_ref().and_then(|st| st.reason.as_deref()) == Some("TokenRetired");
                match s.api.create_lease(&l) {
                    Ok(_) if tombstone => s.tombstones += 1,
                    Ok(stored) => {
                        if let Some(ti) = s.api.task_index(&l.spec.task_name) {
                            s.created[ti].push(l.spec.fencing_token);
                            crate::cancel::lease_created(s, ti);
                            crate::spawn::lease_created(s, self, ti);
                        }
                        locks::lease_created(s, &l);
                        if self.cfg.addressed {
                            crate::offers::created(s, &stored);
                        }
                    }
                    Err(_) => sent.already_exists = true,
                }
                sent.applied = !sent.already_exists;
            }
            Write::Readdress { lease, lapsed } => return self.send_readdress(s, &lease, lapsed),
            Write::Revoke { lease, then } => {
                if s.api.replace_worker_status(&decode(&lease)).is_ok() {
                    sent.applied = true;
                    sent.next = Some(*then);
                }
            }
            Write::Delete(name, rv) => {
                sent.applied = s.api.delete_lease(&name, rv.as_deref()).is_ok();
            }
            Write::TakeLock { lease, .. } => {
                let lease: Lease = decode(&lease);
                let written = if lease.metadata.resource_version.is_none() {
                    s.api.create_lock(&lease)
                } else {
                    s.api.replace_lock(&lease)
                };
                if let Ok(written) = written {
                    locks::took(s, &written);
                    sent.applied = true;
                    sent.lock = Some(written);
                }
            }
            Write::ReleaseLocks { leases, .. } => {
                if let Some(first) = leases.first() {
                    match s.api.replace_lock(&decode(first)) {
                        Ok(written) => {
                            sent.applied = true;
                            sent.lock = Some(written);
                        }
                        Err(Refused::NotFound) => sent.not_found = true,
                        Err(_) => {}
                    }
                }
            }
        }
        sent
    }
}
