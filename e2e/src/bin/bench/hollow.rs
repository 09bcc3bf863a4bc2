//! Hollow workers for the fleet simulator (issue 27), as kubemark's hollow
//! nodes are for the kubelet: each speaks a worker's protocol to the real
//! API server — its own identity, its own watch, its own slots, its own
//! claims, renewals, completions and presence record — but runs no
//! handler, so a thousand fit in one process. What the API server and etcd
//! serve is the same requests an SDK worker makes: the watches with the
//! SDK's selectors (every TaskLease of the queue; renewing per worker,
//! the leases addressed to it and the queue's unaddressed offers), the read of the task
//! before a claim, the claim, a renewal per held lease every TTL/3 from
//! when the last one was sent, the completion, and a presence Lease every
//! 10 s. The writes, the claim order and the presence record are the SDK's
//! own functions (`lease_ops`, `claim_order`, `presence_record`, exported
//! hidden for this), so they cannot drift from what SDK workers send.
//!
//! Renewed per worker ([`Renewal::Worker`], issue 27) a hollow worker
//! claims as the SDK does in that mode and renews its WorkerLease with the
//! SDK's own write (`worker_lease_ops`) every TTL/3 (30 s while it holds
//! nothing), listing what it holds; it writes each held TaskLease only
//! every refresh period (`refresh_period`), the first at a random phase
//! within it — as a fleet in steady state has them, so a window shorter
//! than the period still sees its share of refreshes. A renewal refused
//! with 409 is re-read and every revoked attempt dropped at once.
//!
//! It also takes bound attempts as the SDK does (`takesBound`): a lease the
//! operator created already held by it is read (its task), checked, and
//! held, with no claim; the renewal naming it comes within TTL/3. A hollow
//! worker runs no handler, so it does not wait for a fresher renewal when
//! the one the lease cites is old (the SDK sends one at once then).
//!
//! Cheaper than the SDK on the simulator's side only: a hollow worker
//! keeps the offers of its watch, not a copy of every lease, so the
//! process holding 1,000 watches stays small; the API server still sends
//! each of them every event.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use batchlease_api::keys::presence_name;
use batchlease_api::worker_lease::{refresh_period, worker_lease_name};
use batchlease_api::{
    AttemptRef, BatchTask, LeaseOutcome, LeasePhase, Renewal as Mode, TaskLease, WatchBackoff,
    WorkerLease,
};
use batchlease_worker_sdk::lease_ops::{self, Renewal};
use batchlease_worker_sdk::worker_lease_ops::{self, Adopted, Written};
use batchlease_worker_sdk::{PRESENCE_PERIOD, claim_order, offer_selectors, presence_record};
use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use rand::Rng;
use tokio::sync::{Mutex, Notify, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// The queue the fleet serves.
pub const QUEUE: &str = "fleet";

/// What the fleet did, counted as it went.
#[derive(Debug, Default)]
pub struct Stats {
    pub claims: AtomicU64,
    /// Bound attempts taken (created held by the worker, no claim).
    pub bound: AtomicU64,
    pub lost_races: AtomicU64,
    pub renewals: AtomicU64,
    pub failed_writes: AtomicU64,
    pub lost_leases: AtomicU64,
    pub completions: AtomicU64,
    /// task → (when the claim's answer came, holder, token), the latest claim.
    pub claimed: Mutex<HashMap<String, (Instant, String, i64)>>,
    /// task → (holder, token) while a worker holds its lease.
    pub holding: Mutex<HashMap<String, (String, i64)>>,
}

impl Stats {
    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }
    fn inc(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }
}

/// A running fleet: its workers stop when it is dropped.
#[derive(Debug)]
pub struct Fleet {
    pub stats: Arc<Stats>,
    stop: CancellationToken,
    /// Per worker: a token that freezes it (as SIGSTOP would: no more
    /// writes, no more reads) and its identity.
    workers: Vec<(CancellationToken, String)>,
    /// Slots per worker, grown by [`Fleet::add_slots`].
    slots: Vec<Arc<Semaphore>>,
    /// How many slots each worker has (what its WorkerLease says).
    slot_count: Arc<AtomicU64>,
    /// Wakes every worker's WorkerLease renewal (its slots changed).
    renew_now: Arc<Notify>,
}

impl Drop for Fleet {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl Fleet {
    /// Starts `n` hollow workers in `ns` with `slots` slots each, sharing
    /// `client` (each watch is a connection of its own).
    /// `ttl_seconds`: the TTL of the fleet's leases (one for all), the pace
    /// of WorkerLease renewals when renewing per worker.
    pub fn start(
        client: &Client,
        ns: &str,
        n: usize,
        slots: usize,
        mode: Mode,
        ttl_seconds: u64,
    ) -> Fleet {
        let stats = Arc::new(Stats::default());
        let stop = CancellationToken::new();
        let slot_count = Arc::new(AtomicU64::new(u64::try_from(slots).unwrap_or(0)));
        let renew_now = Arc::new(Notify::new());
        let mut workers = Vec::with_capacity(n);
        let mut sems = Vec::with_capacity(n);
        for i in 0..n {
            let identity = format!(
                "fleet-w{i:04}/{:06x}",
                rand::rng().random_range(0..0xff_ffff)
            );
            let freeze = stop.child_token();
            let sem = Arc::new(Semaphore::new(slots));
            let w = Hollow {
                leases: Api::namespaced(client.clone(), ns),
                tasks: Api::namespaced(client.clone(), ns),
                presence: Api::namespaced(client.clone(), ns),
                worker_leases: Api::namespaced(client.clone(), ns),
                mode,
                ttl_seconds,
                held: std::sync::Mutex::default(),
                claimed: Notify::new(),
                identity: identity.clone(),
                slots: sem.clone(),
                slot_count: slot_count.clone(),
                renew_now: renew_now.clone(),
                stats: stats.clone(),
                freeze: freeze.clone(),
                freed: Notify::new(),
                started: std::sync::Mutex::default(),
            };
            tokio::spawn(w.run());
            workers.push((freeze, identity));
            sems.push(sem);
        }
        Fleet {
            stats,
            stop,
            workers,
            slots: sems,
            slot_count,
            renew_now,
        }
    }

    /// Gives every worker `n` more slots; with `renew_now`, each renews
    /// its WorkerLease at once to say so (else at its next renewal: a
    /// renewal forced on the worker about to be frozen would move its
    /// failover's start). The new count.
    pub fn add_slots(&self, n: usize, renew_now: bool) -> u64 {
        for s in &self.slots {
            s.add_permits(n);
        }
        let now = self
            .slot_count
            .fetch_add(u64::try_from(n).unwrap_or(0), Ordering::Relaxed)
            + u64::try_from(n).unwrap_or(0);
        if renew_now {
            self.renew_now.notify_waiters();
        }
        now
    }

    /// Freezes the worker holding the most leases (as a SIGSTOP would);
    /// the (task, token) pairs it held.
    pub async fn freeze_busiest(&self) -> Vec<(String, i64)> {
        let holding = self.stats.holding.lock().await;
        let mut count: HashMap<&str, usize> = HashMap::new();
        for (h, _) in holding.values() {
            *count.entry(h.as_str()).or_default() += 1;
        }
        let Some(victim) = count
            .into_iter()
            .max_by_key(|(_, n)| *n)
            .map(|(h, _)| h.to_owned())
        else {
            return Vec::new();
        };
        if let Some((token, _)) = self.workers.iter().find(|(_, id)| *id == victim) {
            token.cancel();
        }
        holding
            .iter()
            .filter(|(_, (h, _))| *h == victim)
            .map(|(t, (_, token))| (t.clone(), *token))
            .collect()
    }
}

/// The offers a hollow worker's watches show, by (watch, lease name).
type Offers = HashMap<(usize, String), Arc<TaskLease>>;

/// One hollow worker.
struct Hollow {
    leases: Api<TaskLease>,
    tasks: Api<BatchTask>,
    presence: Api<Lease>,
    worker_leases: Api<WorkerLease>,
    mode: Mode,
    /// The TTL of the fleet's leases.
    ttl_seconds: u64,
    /// Renewed per worker: the attempts held, each with the token that
    /// stops its hold when the operator revoked it.
    held: std::sync::Mutex<BTreeMap<AttemptRef, CancellationToken>>,
    /// An attempt was claimed: the next WorkerLease renewal is due within
    /// TTL/3 of it (the SDK's rule), not at the idle pace.
    claimed: Notify,
    identity: String,
    slots: Arc<Semaphore>,
    /// What its WorkerLease says it has (addressed offers).
    slot_count: Arc<AtomicU64>,
    /// Renew the WorkerLease now (its slots changed).
    renew_now: Arc<Notify>,
    stats: Arc<Stats>,
    freeze: CancellationToken,
    /// A slot came free (the claim loop looks at the offers again).
    freed: Notify,
    /// Bound attempts taken (never taken twice); locked after the offers.
    started: std::sync::Mutex<HashSet<AttemptRef>>,
}

impl Hollow {
    async fn run(self) {
        let me = Arc::new(self);
        match me.mode {
            Mode::Lease => drop(tokio::spawn(me.clone().presence())),
            Mode::Worker => drop(tokio::spawn(me.clone().renew_worker_lease())),
        }
        // As the SDK: the watch keeps the offers up to date on a task of
        // its own, and the claim loop reads them afresh before each claim
        // (a loop that handled one event per claim fell behind the stream
        // and raced for offers long taken).
        let offers: Arc<std::sync::Mutex<Offers>> = Arc::default();
        let changed = Arc::new(Notify::new());
        tokio::spawn(me.clone().watch(offers.clone(), changed.clone()));
        loop {
            tokio::select! {
                () = me.freeze.cancelled() => return,
                () = changed.notified() => {}
                () = me.freed.notified() => {}
            }
            if me.slots.available_permits() == 0 {
                continue;
            }
            // A small random delay against thundering herds, then the
            // offers in the SDK's own order (`claim_order`).
            let herd = Duration::from_millis(rand::rng().random_range(0..25));
            tokio::select! {
                () = me.freeze.cancelled() => return,
                () = tokio::time::sleep(herd) => {}
            }
            loop {
                let Ok(permit) = me.slots.clone().try_acquire_owned() else {
                    break;
                };
                let first = {
                    let Ok(mut map) = offers.lock() else { return };
                    // Bound attempts first: they are ours already.
                    let bound = map.values().find(|l| l.bound()).map(|l| l.name_any());
                    let order = claim_order(
                        map.values().filter(|l| !l.bound()).cloned().collect(),
                        &me.identity,
                        &HashSet::new(),
                    );
                    let first = bound.or_else(|| order.first().map(|l| l.name_any()));
                    // Out of every watch's map: claimed (or lost) now.
                    let mut taken = None;
                    map.retain(|(_, name), l| {
                        if Some(name) == first.as_ref() {
                            taken.get_or_insert_with(|| l.clone());
                            false
                        } else {
                            true
                        }
                    });
                    if let Some(l) = taken.as_ref().filter(|l| l.bound()) {
                        me.started_lock().insert(AttemptRef::of(l));
                    }
                    taken
                };
                let Some(offer) = first else { break };
                let held = if offer.bound() {
                    me.take_bound(&offer).await
                } else {
                    me.claim(&offer).await
                };
                if let Some((held, hold)) = held {
                    let me = me.clone();
                    tokio::spawn(async move {
                        me.hold(held, hold).await;
                        drop(permit);
                        me.freed.notify_one();
                    });
                }
            }
        }
    }

    /// Keeps `offers` to the leases of the queue the watch shows Offered.
    async fn watch(self: Arc<Self>, offers: Arc<std::sync::Mutex<Offers>>, changed: Arc<Notify>) {
        // The SDK's selectors: renewing per worker, its own offers and the
        // queue's unaddressed ones (two watches, merged).
        let selectors = offer_selectors(
            &[QUEUE.to_owned()],
            &self.identity,
            self.mode == Mode::Worker,
        );
        // Each watch's events tagged with its index: a lease moving from
        // one selector to the other (a re-address) is added by one and
        // deleted by the other, in either order.
        let stream =
            futures::stream::select_all(selectors.iter().enumerate().map(|(i, selector)| {
                watcher(
                    self.leases.clone(),
                    watcher::Config::default().labels(selector),
                )
                .backoff(WatchBackoff::new(rand::random))
                .map(move |ev| (i, ev))
                .boxed()
            }));
        futures::pin_mut!(stream);
        loop {
            let ev = tokio::select! {
                () = self.freeze.cancelled() => return,
                ev = stream.next() => ev,
            };
            let Ok(mut map) = offers.lock() else { return };
            let Some((i, ev)) = ev else { return };
            match ev {
                Ok(watcher::Event::Apply(l) | watcher::Event::InitApply(l)) => {
                    let phase = l.status.as_ref().and_then(|s| s.phase);
                    let bound_to_us = l.bound()
                        && phase == Some(LeasePhase::Held)
                        && l.spec.holder_identity.as_deref() == Some(self.identity.as_str())
                        && !self.started_lock().contains(&AttemptRef::of(&l));
                    if phase == Some(LeasePhase::Offered) || bound_to_us {
                        map.insert((i, l.name_any()), Arc::new(l));
                        changed.notify_one();
                    } else {
                        map.remove(&(i, l.name_any()));
                    }
                }
                Ok(watcher::Event::Delete(l)) => {
                    map.remove(&(i, l.name_any()));
                }
                Ok(watcher::Event::Init | watcher::Event::InitDone) | Err(_) => {}
            }
        }
    }

    /// Reads the task of `lease`; how long to hold it (the payload's
    /// `holdMillis`) if `lease` is the task's current lease.
    async fn current(&self, lease: &TaskLease) -> Option<Duration> {
        let task = self.tasks.get_opt(&lease.spec.task_name).await.ok()??;
        let st = task.status.as_ref()?;
        if st.current_lease.as_deref() != Some(lease.name_any().as_str())
            || st.fencing_token != lease.spec.fencing_token
        {
            return None;
        }
        Some(
            task.spec
                .payload
                .as_ref()
                .and_then(|p| serde_json::from_str::<serde_json::Value>(p.as_str()).ok())
                .and_then(|p| p.get("holdMillis").and_then(serde_json::Value::as_u64))
                .map_or(Duration::ZERO, Duration::from_millis),
        )
    }

    /// Counts `held` as taken by this worker now.
    async fn took(&self, held: &TaskLease) {
        self.stats.claimed.lock().await.insert(
            held.spec.task_name.clone(),
            (
                Instant::now(),
                self.identity.clone(),
                held.spec.fencing_token,
            ),
        );
        self.stats.holding.lock().await.insert(
            held.spec.task_name.clone(),
            (self.identity.clone(), held.spec.fencing_token),
        );
    }

    /// A bound attempt: its task read and checked as before a claim, then
    /// held as it is (no write).
    async fn take_bound(&self, lease: &TaskLease) -> Option<(TaskLease, Duration)> {
        let hold = self.current(lease).await?;
        Stats::inc(&self.stats.bound);
        self.took(lease).await;
        Some((lease.clone(), hold))
    }

    /// Reads the task, checks the offer is its current lease, claims it.
    /// The held lease and how long to hold it (the payload's `holdMillis`).
    async fn claim(&self, offer: &TaskLease) -> Option<(TaskLease, Duration)> {
        let hold = self.current(offer).await?;
        match lease_ops::claim(&self.leases, offer, &self.identity, self.mode).await {
            Ok(Some(held)) => {
                Stats::inc(&self.stats.claims);
                self.took(&held).await;
                Some((held, hold))
            }
            Ok(None) => {
                Stats::inc(&self.stats.lost_races);
                None
            }
            Err(_) => {
                Stats::inc(&self.stats.failed_writes);
                None
            }
        }
    }

    /// Renews `ours` every TTL/3 (from when the last renewal was sent)
    /// until `hold` has passed, then completes it; stops at once when
    /// frozen or when the lease is no longer ours.
    async fn hold(&self, ours: TaskLease, hold: Duration) {
        let task = ours.spec.task_name.clone();
        let token = ours.spec.fencing_token;
        self.hold_until_done(ours, hold).await;
        let mut holding = self.stats.holding.lock().await;
        if holding
            .get(&task)
            .is_some_and(|(h, t)| *h == self.identity && *t == token)
        {
            holding.remove(&task);
        }
    }

    async fn hold_until_done(&self, mut ours: TaskLease, hold: Duration) {
        let ttl =
            Duration::from_secs(u64::try_from(ours.spec.lease_duration_seconds).unwrap_or(30));
        let done = Instant::now() + hold;
        // Renewed per worker: listed in the WorkerLease (its renewals keep
        // it alive), and the lease itself written only every refresh
        // period, the first at a random phase (see the module docs).
        let per_worker = ours.renewed_per_worker();
        let revoked = CancellationToken::new();
        let (mut next, every) = if per_worker {
            let r = refresh_period(ttl);
            self.held_lock()
                .insert(AttemptRef::of(&ours), revoked.clone());
            self.claimed.notify_one();
            (
                Instant::now() + r.mul_f64(rand::rng().random_range(0.0..1.0)),
                r,
            )
        } else {
            (Instant::now() + ttl / 3, ttl / 3)
        };
        let attempt = AttemptRef::of(&ours);
        let _unlist = scopeguard(|| {
            self.held_lock().remove(&attempt);
        });
        loop {
            let complete = tokio::select! {
                () = self.freeze.cancelled() => return,
                () = revoked.cancelled() => {
                    Stats::inc(&self.stats.lost_leases);
                    return;
                }
                () = tokio::time::sleep_until(done.min(next)) => done <= next,
            };
            if complete {
                let c = lease_ops::Completion {
                    outcome: LeaseOutcome::Succeeded,
                    reason: None,
                    message: None,
                    permanent: false,
                    result: None,
                    checkpoint: None,
                };
                match lease_ops::complete_once(&self.leases, &ours, &c).await {
                    Ok(()) => Stats::inc(&self.stats.completions),
                    Err(_) => Stats::inc(&self.stats.failed_writes),
                }
                return;
            }
            next = Instant::now() + every;
            // The SDK's renewal: a conflict is re-read, and only a lease no
            // longer ours ends the hold.
            match lease_ops::renew(&self.leases, &ours, &self.identity, None).await {
                Ok(Renewal::Renewed(stored)) => {
                    Stats::inc(&self.stats.renewals);
                    ours = *stored;
                }
                Ok(Renewal::Lost(_) | Renewal::Cancelled) => {
                    Stats::inc(&self.stats.lost_leases);
                    return;
                }
                Err(_) => Stats::inc(&self.stats.failed_writes),
            }
        }
    }

    fn slot_count(&self) -> i32 {
        i32::try_from(self.slot_count.load(Ordering::Relaxed)).unwrap_or(i32::MAX)
    }

    fn started_lock(&self) -> std::sync::MutexGuard<'_, HashSet<AttemptRef>> {
        self.started.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn held_lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<AttemptRef, CancellationToken>> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Renewals per worker: the WorkerLease created, then renewed by CAS
    /// every TTL/3 while it holds anything (30 s idle), listing the
    /// attempts held; a conflict re-reads it and ends every revoked one.
    async fn renew_worker_lease(self: Arc<Self>) {
        let desired = worker_lease_ops::object(
            &self.identity,
            &[QUEUE.to_owned()],
            Some(self.slot_count()),
            true,
            None,
            Timestamp::now(),
        );
        let mut ours = loop {
            match worker_lease_ops::create_or_adopt(&self.worker_leases, &desired).await {
                Ok(Adopted::Ours(w)) => break *w,
                _ => {
                    Stats::inc(&self.stats.failed_writes);
                    tokio::select! {
                        () = self.freeze.cancelled() => return,
                        () = tokio::time::sleep(Duration::from_secs(1)) => {}
                    }
                }
            }
        };
        let name = worker_lease_name(&self.identity);
        let mut last = Timestamp::now();
        let mut sent = Instant::now();
        loop {
            // The fleet's leases share one TTL: the shortest one's pace,
            // from when the last renewal was sent; 30 s while idle, and a
            // claim brings the next one forward to within TTL/3 of it.
            let busy = Duration::from_secs(self.ttl_seconds.max(1)) / 3;
            let idle = self.held_lock().is_empty();
            let mut next = sent + if idle { Duration::from_secs(30) } else { busy };
            loop {
                tokio::select! {
                    () = self.freeze.cancelled() => return,
                    () = tokio::time::sleep_until(next) => break,
                    () = self.renew_now.notified() => break,
                    () = self.claimed.notified() => {
                        next = next.min(Instant::now() + busy);
                    }
                }
            }
            sent = Instant::now();
            let holds: Vec<AttemptRef> = self.held_lock().keys().cloned().collect();
            // Strictly increasing, as the SDK's.
            let now = Timestamp::now().max(last + Duration::from_micros(1));
            last = now;
            let ttl = i32::try_from(self.ttl_seconds.max(5)).unwrap_or(30);
            match worker_lease_ops::renew(
                &self.worker_leases,
                &ours,
                holds,
                ttl,
                Some(self.slot_count()),
                now,
            )
            .await
            {
                Ok(Written::Stored(w)) => {
                    Stats::inc(&self.stats.renewals);
                    ours = *w;
                }
                Ok(Written::Refused { code: 409, .. }) => {
                    if let Ok(Some(fresh)) =
                        worker_lease_ops::read(&self.worker_leases, &name).await
                    {
                        for a in fresh.revoked() {
                            if let Some(stop) = self.held_lock().remove(a) {
                                stop.cancel();
                            }
                        }
                        ours = fresh;
                    }
                }
                _ => Stats::inc(&self.stats.failed_writes),
            }
        }
    }

    /// The SDK's presence record: an apply every 10 s.
    async fn presence(self: Arc<Self>) {
        let params = PatchParams::apply("batchlease-worker").force();
        let name = presence_name(&self.identity);
        // Workers of a fleet do not start in step.
        let spread = PRESENCE_PERIOD.mul_f64(rand::rng().random_range(0.0..1.0));
        tokio::select! {
            () = self.freeze.cancelled() => return,
            () = tokio::time::sleep(spread) => {}
        }
        loop {
            let rec = presence_record(&self.identity, &[QUEUE.to_owned()], Timestamp::now());
            if self
                .presence
                .patch(&name, &params, &Patch::Apply(&rec))
                .await
                .is_err()
            {
                Stats::inc(&self.stats.failed_writes);
            }
            tokio::select! {
                () = self.freeze.cancelled() => return,
                () = tokio::time::sleep(PRESENCE_PERIOD) => {}
            }
        }
    }
}

/// Runs `f` when dropped (a hold's end, whichever way it ends).
fn scopeguard(f: impl FnOnce()) -> impl Drop {
    struct Guard<F: FnOnce()>(Option<F>);
    impl<F: FnOnce()> Drop for Guard<F> {
        fn drop(&mut self) {
            if let Some(f) = self.0.take() {
                f();
            }
        }
    }
    Guard(Some(f))
}
