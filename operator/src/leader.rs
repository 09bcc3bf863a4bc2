//! Leader election on a `coordination.k8s.io/v1` Lease, with a kill switch.
//!
//! Only the leader writes, and it may write only while it can prove to
//! itself that it still leads: a renewal of the election Lease succeeded
//! less than `leaseDuration − grace` ago, counted from when that renewal
//! was *sent* (the server may have applied it at any moment after), by the
//! monotonic clock. Every write checks [`Leadership::ensure`] first, and
//! that check reads the clock itself, so a leader that is partitioned, whose
//! renewals fail (its Lease's namespace deleted, RBAC revoked), or whose
//! election task is starved stops writing on time — not when it notices.
//!
//! A standby takes the Lease — takes it over, or creates it when missing —
//! only after it observed the same state of it (a version, or its absence)
//! for a full duration of its *own* configuration by its own clock, so the
//! old leader stopped at least `grace` before; nothing the Lease says
//! (holder, duration) is trusted, since anyone may edit or delete it
//! (`leader_step`, issue 23). Every acquisition and takeover is a
//! resourceVersion CAS and bumps `leaseTransitions` (kubert's pattern).
//!
//! Every request of one look at the Lease is bounded by one deadline, the
//! term's end while leading. A renewal that answers after its term ended
//! starts a *new* term (new generation: `acquired()` hands it out and the
//! controllers start again) — never revives the old one, whose writers
//! stopped; a Lease found deleted or held by another identity ends the
//! term at once.
//!
//! Losing the lease (deposed, or the term ran out during an outage) stops
//! every writer of that term at once; the replica then campaigns again as a
//! standby, and a new term starts its controllers afresh (empty caches and
//! observations: every held lease gets a full TTL). Each term has its own
//! generation, so a straggling writer of an old term can never write under
//! a new one. On shutdown the Lease is vacated (its holder cleared),
//! bounded in time; a standby still waits a full duration of that state.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, PostParams};
use tokio::sync::watch;
use tokio::time::{Instant, sleep_until, timeout, timeout_at};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::error::Error;
use crate::leader_step::{Seen, Step, step};

/// This process's identity in the election: the configured one (else the
/// pod's or host's name) plus a random suffix, always. Two processes given
/// the same `--identity` (a copied manifest, a restarted pod that kept its
/// name while the old process still runs) would otherwise both "hold" the
/// Lease and both lead.
pub fn identity(configured: Option<&str>) -> String {
    let base = configured.map(str::to_owned).unwrap_or_else(|| {
        std::env::var("POD_NAME")
            .or_else(|_| std::env::var("HOSTNAME"))
            .unwrap_or_else(|_| "batchlease-operator".into())
    });
    let suffix: u32 = rand::Rng::random_range(&mut rand::rng(), 0..0xff_ffff);
    format!("{base}-{suffix:06x}")
}

/// Election settings.
#[derive(Clone, Debug)]
pub struct ElectionConfig {
    pub namespace: String,
    pub lease_name: String,
    pub identity: String,
    pub duration_seconds: u64,
    pub grace_seconds: u64,
}

impl ElectionConfig {
    fn duration(&self) -> Duration {
        Duration::from_secs(self.duration_seconds.max(1))
    }

    /// How long after a renewal was sent this replica may still write.
    fn term(&self) -> Duration {
        let d = self.duration();
        d.saturating_sub(Duration::from_secs(self.grace_seconds))
            .max(d / 3)
    }

    /// How often the leader renews: three tries per term.
    fn renew_every(&self) -> Duration {
        self.term() / 3
    }

    /// How often a standby looks at the Lease (one GET; quick, so a
    /// leader whose term ran out during an outage leads again within a
    /// second of the API server's return).
    fn retry_every(&self) -> Duration {
        (self.duration() / 5).clamp(Duration::from_millis(200), Duration::from_secs(1))
    }
}

/// The leader's right to write: until this instant, by the monotonic clock.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Term {
    /// Counts acquisitions; a writer holds the generation it started under.
    generation: u64,
    /// None while not leading.
    valid_until: Option<Instant>,
}

impl Term {
    fn valid(&self, generation: u64, now: Instant) -> bool {
        self.generation == generation && self.valid_until.is_some_and(|v| now < v)
    }
}

/// One term's right to write. Writers (the controllers of that term) hold
/// a clone; it never becomes valid again once its term ended.
#[derive(Clone, Debug)]
pub struct Leadership {
    term: Option<Arc<Mutex<Term>>>,
    generation: u64,
    changed: Option<watch::Receiver<u64>>,
}

impl Leadership {
    /// Leader election disabled: a single replica is always the leader.
    pub fn always() -> Self {
        Self {
            term: None,
            generation: 0,
            changed: None,
        }
    }

    /// True while this term runs.
    pub fn is_leader(&self) -> bool {
        let Some(term) = &self.term else {
            return true;
        };
        let t = *term.lock().unwrap_or_else(|e| e.into_inner());
        t.valid(self.generation, Instant::now())
    }

    /// How long this term may still write (a generous bound when election
    /// is disabled); zero once it ended.
    pub fn time_left(&self) -> Duration {
        let Some(term) = &self.term else {
            return Duration::from_secs(60);
        };
        let t = *term.lock().unwrap_or_else(|e| e.into_inner());
        match t.valid_until {
            Some(v) if t.generation == self.generation => {
                v.saturating_duration_since(Instant::now())
            }
            _ => Duration::ZERO,
        }
    }

    /// Fails with [`Error::NotLeader`] unless this replica is the leader.
    pub fn ensure(&self) -> Result<(), Error> {
        if self.is_leader() {
            Ok(())
        } else {
            Err(Error::NotLeader)
        }
    }

    /// Runs `write` while this term runs: abandoned (dropped, so nothing
    /// more of it is sent — kube's client retries 429/503/504 inside it)
    /// the moment the term ends, by its deadline or because it was lost.
    /// Never started once the term ended. Without election, bounded by a
    /// generous timeout.
    /// `None` when the term ended first.
    pub async fn bound<F: Future>(&self, write: F) -> Option<F::Output> {
        let lost = self.clone().lost();
        let limit = self.time_left();
        tokio::select! {
            biased;
            () = lost => None,
            r = timeout(limit, write) => r.ok(),
        }
    }

    /// Resolves when this term ends (never, when election is disabled).
    /// The term's own deadline ends it too, even if the election task is
    /// stuck.
    pub async fn lost(self) {
        let (Some(term), Some(mut rx)) = (self.term, self.changed) else {
            return std::future::pending().await;
        };
        loop {
            let t = *term.lock().unwrap_or_else(|e| e.into_inner());
            if !t.valid(self.generation, Instant::now()) {
                return;
            }
            let until = t
                .valid_until
                .unwrap_or_else(|| Instant::now() + Duration::from_secs(3600));
            tokio::select! {
                _ = sleep_until(until) => {}
                r = rx.changed() => if r.is_err() { return },
            }
        }
    }
}

/// The background task that campaigns for and holds the lease.
#[derive(Debug)]
pub struct Campaign {
    task: Option<tokio::task::JoinHandle<()>>,
    stop: CancellationToken,
    term: Option<Arc<Mutex<Term>>>,
    changed: Option<watch::Receiver<u64>>,
    holding: Arc<AtomicBool>,
}

impl Campaign {
    /// No election: always leading.
    pub fn none() -> Self {
        Self {
            task: None,
            stop: CancellationToken::new(),
            term: None,
            changed: None,
            holding: Arc::default(),
        }
    }

    /// Whether this replica holds the election Lease right now (a term
    /// runs). `/readyz` compares it with whether controllers run: holding
    /// the Lease without them blocks every standby while nothing is done.
    pub fn holding(&self) -> Arc<AtomicBool> {
        self.holding.clone()
    }

    /// Resolves with the next term this replica leads. Fails once the
    /// election task ended (it ends only when vacating, which consumes the
    /// campaign, so any end seen here is a crash): its last term may still
    /// look valid until its deadline, and handing it out again would start
    /// controllers that stop at once, over and over.
    pub async fn acquired(&mut self) -> anyhow::Result<Leadership> {
        let (Some(term), Some(rx)) = (&self.term, &mut self.changed) else {
            return Ok(Leadership::always());
        };
        loop {
            anyhow::ensure!(rx.has_changed().is_ok(), "the leader election task ended");
            let t = *term.lock().unwrap_or_else(|e| e.into_inner());
            if t.valid(t.generation, Instant::now()) {
                return Ok(Leadership {
                    term: Some(term.clone()),
                    generation: t.generation,
                    changed: Some(rx.clone()),
                });
            }
            rx.changed().await?;
        }
    }

    /// Stops campaigning and vacates the lease if held, within `budget`
    /// whatever the API server does, so shutdown is bounded.
    pub async fn vacate(self, budget: Duration) {
        self.stop.cancel();
        if let Some(task) = self.task
            && timeout(budget, task).await.is_err()
        {
            warn!(?budget, "leader lease not released in time; exiting anyway");
        }
    }
}

/// Starts campaigning; [`Campaign::acquired`] yields each term led.
pub fn campaign(client: Client, cfg: &ElectionConfig) -> Campaign {
    let term = Arc::new(Mutex::new(Term::default()));
    let holding = Arc::new(AtomicBool::new(false));
    let (tx, rx) = watch::channel(0);
    let stop = CancellationToken::new();
    let elector = Elector {
        api: Api::namespaced(client, &cfg.namespace),
        cfg: cfg.clone(),
        term: term.clone(),
        tx,
        ours: None,
        seen: None,
        wrote: None,
        holding: holding.clone(),
    };
    let task = tokio::spawn(elector.run(stop.clone()));
    Campaign {
        task: Some(task),
        stop,
        term: Some(term),
        changed: Some(rx),
        holding,
    }
}

struct Elector {
    api: Api<Lease>,
    cfg: ElectionConfig,
    term: Arc<Mutex<Term>>,
    /// Announces each change of the term (its generation).
    tx: watch::Sender<u64>,
    /// Our last copy of the Lease while we hold it.
    ours: Option<Lease>,
    /// The state of the Lease a standby watches, and since when.
    seen: Option<Seen>,
    /// The version our last successful write of the Lease produced (kept
    /// when the term ends: see `leader_step`).
    wrote: Option<String>,
    /// Whether this replica holds the Lease (for `/readyz`).
    holding: Arc<AtomicBool>,
}

/// How one write of the Lease went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wrote {
    /// Applied, and a term runs from it.
    Won,
    /// Someone else wrote the Lease first (409): look at it.
    Conflict,
    /// The Lease is gone (404).
    Gone,
    /// Created, vacated: no term.
    Created,
    /// Any other failure, or no answer before the deadline.
    Failed,
}

/// What one look at the Lease came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tick {
    /// We hold it with a fresh term.
    Leading,
    /// Not (yet), or a renewal failed: try again.
    Again,
    /// We led, and the Lease is gone or someone else's: the term ends now.
    Deposed,
}

impl Elector {
    fn leading(&self) -> bool {
        self.ours.is_some()
    }

    fn valid_until(&self) -> Option<Instant> {
        self.term
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .valid_until
    }

    async fn run(mut self, stop: CancellationToken) {
        let mut next = Instant::now();
        loop {
            let deadline = self.valid_until().filter(|_| self.leading());
            tokio::select! {
                biased;
                _ = stop.cancelled() => {
                    self.vacate().await;
                    return;
                }
                _ = sleep_until(deadline.unwrap_or(next)), if deadline.is_some_and(|d| d <= next) => {
                    warn!("leader term ran out without a successful renewal; standing by");
                    self.lose();
                    next = Instant::now() + self.cfg.retry_every();
                    continue;
                }
                _ = sleep_until(next) => {}
            }
            next = match self.tick().await {
                Tick::Leading => Instant::now() + self.cfg.renew_every(),
                Tick::Again if self.leading() => {
                    if self.valid_until().is_none_or(|v| Instant::now() >= v) {
                        // Every call of the tick was bounded by the term,
                        // and the term is over: it ends here, not later.
                        warn!("leader term ran out while renewing; standing by");
                        self.lose();
                        Instant::now() + self.cfg.retry_every()
                    } else {
                        Instant::now() + self.cfg.renew_every() / 2
                    }
                }
                Tick::Again => Instant::now() + self.cfg.retry_every(),
                Tick::Deposed => {
                    warn!("the leader lease is gone or held by another identity; standing by");
                    self.lose();
                    Instant::now() + self.cfg.retry_every()
                }
            };
        }
    }

    /// One look at the Lease, every request of it bounded by one deadline:
    /// the term's end while leading (an answer after it is of no use: the
    /// term's writers stopped then), a short bound otherwise.
    async fn tick(&mut self) -> Tick {
        let deadline = match self.valid_until() {
            Some(v) if self.leading() => v,
            _ => Instant::now() + self.cfg.retry_every() * 2,
        };
        if let Some(ours) = self.ours.clone() {
            // Renew from our copy: one CAS; a conflict means someone else
            // wrote the Lease, and then we look at it.
            match self.write(&ours, false, deadline).await {
                Wrote::Won => return Tick::Leading,
                Wrote::Conflict => {}
                // Deleted: a standby may create it a duration after it
                // saw it gone; this term cannot be renewed, so it ends now.
                Wrote::Gone => return Tick::Deposed,
                Wrote::Failed | Wrote::Created => return Tick::Again,
            }
        }
        let read = match timeout_at(deadline, self.api.get_opt(&self.cfg.lease_name)).await {
            Ok(Ok(l)) => l,
            Ok(Err(e)) => {
                warn!(error = %batchlease_api::Chain(&e), "reading the leader lease failed");
                return Tick::Again;
            }
            Err(_) => return Tick::Again,
        };
        let (step, seen) = step(
            read.as_ref(),
            &self.cfg.identity,
            self.leading(),
            self.seen.as_ref(),
            self.wrote.as_deref(),
            Instant::now(),
            self.cfg.duration(),
        );
        self.seen = seen;
        let wrote = match (step, read) {
            (Step::Deposed, _) => return Tick::Deposed,
            (Step::Wait, _) | (Step::Renew | Step::TakeOver, None) => return Tick::Again,
            (Step::Create, _) => self.create(deadline).await,
            (Step::Renew, Some(l)) => self.write(&l, false, deadline).await,
            (Step::TakeOver, Some(l)) => self.write(&l, true, deadline).await,
        };
        match wrote {
            Wrote::Won => Tick::Leading,
            Wrote::Gone if self.leading() => Tick::Deposed,
            _ => Tick::Again,
        }
    }

    fn spec(&self, prev: Option<&LeaseSpec>, take_over: bool) -> LeaseSpec {
        let now = MicroTime(Timestamp::now());
        let mut spec = prev.cloned().unwrap_or_default();
        if take_over {
            spec.acquire_time = Some(now.clone());
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
        }
        spec.holder_identity = Some(self.cfg.identity.clone());
        spec.lease_duration_seconds = i32::try_from(self.cfg.duration_seconds).ok();
        spec.renew_time = Some(now);
        spec
    }

    /// Creates the missing Lease *vacated*: no holder, so no term. The new
    /// version is then waited out like any other (see `leader_step`).
    async fn create(&mut self, deadline: Instant) -> Wrote {
        let mut lease = Lease::default();
        lease.metadata.name = Some(self.cfg.lease_name.clone());
        lease.metadata.namespace = Some(self.cfg.namespace.clone());
        lease.spec = Some(LeaseSpec {
            lease_duration_seconds: i32::try_from(self.cfg.duration_seconds).ok(),
            renew_time: Some(MicroTime(Timestamp::now())),
            ..LeaseSpec::default()
        });
        match timeout_at(deadline, self.api.create(&PostParams::default(), &lease)).await {
            Ok(Ok(_)) => {
                info!("created the leader lease, vacated: taking it after a lease duration");
                Wrote::Created
            }
            Ok(Err(e)) => {
                debug!(error = %batchlease_api::Chain(&e), "creating the leader lease failed");
                Wrote::Failed
            }
            Err(_) => Wrote::Failed,
        }
    }

    /// Renews (or takes over) `from` by CAS, answered by `deadline` or
    /// abandoned.
    async fn write(&mut self, from: &Lease, take_over: bool, deadline: Instant) -> Wrote {
        let mut lease = from.clone();
        lease.spec = Some(self.spec(from.spec.as_ref(), take_over));
        let sent = Instant::now();
        let pp = PostParams::default();
        match timeout_at(
            deadline,
            self.api.replace(&self.cfg.lease_name, &pp, &lease),
        )
        .await
        {
            Ok(Ok(stored)) => {
                if take_over {
                    info!(identity = %self.cfg.identity, "took over the leader lease");
                }
                self.won(stored, sent)
            }
            Ok(Err(kube::Error::Api(s))) if s.code == 409 => Wrote::Conflict,
            Ok(Err(kube::Error::Api(s))) if s.code == 404 => {
                warn!("the leader lease is gone");
                Wrote::Gone
            }
            Ok(Err(e)) => {
                warn!(error = %batchlease_api::Chain(&e), "writing the leader lease failed");
                Wrote::Failed
            }
            Err(_) => {
                warn!("writing the leader lease timed out");
                Wrote::Failed
            }
        }
    }

    /// A write sent at `sent` succeeded: a term runs until `sent + term`.
    /// It continues the current term only if that term has not ended yet;
    /// otherwise — the first success after standing by, or a renewal that
    /// answered after its term's end, whose writers have stopped — it is a
    /// new term, with a new generation that `acquired()` hands out, so
    /// controllers start again. A write that answered too late to leave
    /// any term at all counts as lost.
    fn won(&mut self, stored: Lease, sent: Instant) -> Wrote {
        self.wrote = stored.metadata.resource_version.clone();
        let now = Instant::now();
        let until = sent + self.cfg.term();
        if until <= now {
            warn!("the leader lease write answered after the term it would start; standing by");
            self.lose();
            return Wrote::Failed;
        }
        self.ours = Some(stored);
        self.seen = None;
        self.holding.store(true, Ordering::Release);
        let (generation, new) = {
            let mut t = self.term.lock().unwrap_or_else(|e| e.into_inner());
            let runs = t.valid_until.is_some_and(|v| now < v);
            if runs {
                t.valid_until = t.valid_until.map(|v| v.max(until));
            } else {
                t.generation += 1;
                t.valid_until = Some(until);
            }
            (t.generation, !runs)
        };
        if new {
            info!(identity = %self.cfg.identity, generation, "acquired the leader lease");
            let _ = self.tx.send(generation);
        }
        Wrote::Won
    }

    /// Ends the current term at once (its writers stop), then stands by.
    fn lose(&mut self) {
        let was = self.ours.take().is_some();
        self.seen = None;
        self.holding.store(false, Ordering::Release);
        let generation = {
            let mut t = self.term.lock().unwrap_or_else(|e| e.into_inner());
            t.valid_until = None;
            t.generation
        };
        if was {
            warn!(identity = %self.cfg.identity, generation, "leadership lost");
        }
        self.tx.send_replace(generation);
    }

    /// Hands the Lease back (holder cleared) so a standby takes over at once.
    async fn vacate(&mut self) {
        let Some(ours) = self.ours.clone() else {
            return;
        };
        // Stop writing first: a vacated lease may be taken at once.
        self.lose();
        let mut lease = ours;
        if let Some(spec) = lease.spec.as_mut() {
            spec.holder_identity = None;
            spec.lease_duration_seconds = Some(1);
            spec.renew_time = Some(MicroTime(Timestamp::now()));
        }
        let pp = PostParams::default();
        let write = self.api.replace(&self.cfg.lease_name, &pp, &lease);
        match timeout(VACATE_BUDGET, write).await {
            Ok(Ok(_)) => info!("leader lease released"),
            Ok(Err(e)) => {
                warn!(error = %batchlease_api::Chain(&e), "releasing the leader lease failed")
            }
            Err(_) => warn!("releasing the leader lease timed out"),
        }
    }
}

/// How long vacating the Lease may take on shutdown.
const VACATE_BUDGET: Duration = Duration::from_secs(2);

#[cfg(test)]
#[path = "leader_tests.rs"]
mod campaign_tests;
