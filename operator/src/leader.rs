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
//! A standby takes the Lease only after it observed the same version of it
//! for a full `leaseDuration` by its own clock, so the old leader stopped at
//! least `grace` before. Every acquisition and takeover is a
//! resourceVersion CAS and bumps `leaseTransitions` (kubert's pattern).
//!
//! Losing the lease (deposed, or the term ran out during an outage) stops
//! every writer of that term at once; the replica then campaigns again as a
//! standby, and a new term starts its controllers afresh (empty caches and
//! observations: every held lease gets a full TTL). Each term has its own
//! generation, so a straggling writer of an old term can never write under
//! a new one. On shutdown the Lease is vacated, bounded in time, so a
//! standby takes over at once.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};
use tokio::sync::watch;
use tokio::time::{Instant, sleep_until, timeout};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::reconcile::Error;

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
}

impl Campaign {
    /// No election: always leading.
    pub fn none() -> Self {
        Self {
            task: None,
            stop: CancellationToken::new(),
            term: None,
            changed: None,
        }
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
    let (tx, rx) = watch::channel(0);
    let stop = CancellationToken::new();
    let elector = Elector {
        api: Api::namespaced(client, &cfg.namespace),
        cfg: cfg.clone(),
        term: term.clone(),
        tx,
        ours: None,
        seen: None,
    };
    let task = tokio::spawn(elector.run(stop.clone()));
    Campaign {
        task: Some(task),
        stop,
        term: Some(term),
        changed: Some(rx),
    }
}

/// A version of someone else's Lease, and when we first saw it.
#[derive(Clone, Debug, PartialEq)]
struct Seen {
    holder: String,
    version: String,
    since: Instant,
}

/// What to do with the Lease as read.
#[derive(Debug, Clone, PartialEq)]
enum Step {
    /// No Lease: create it, holding it.
    Create,
    /// Ours: renew it.
    Renew,
    /// Vacated, or silent for a full duration: take it over.
    TakeOver,
    /// Someone else holds it: look again later.
    Wait,
    /// We led, and now someone else holds it.
    Deposed,
}

/// Pure: the step for `lease` as read at `now`, given what we saw before.
/// Returns the new observation of a foreign holder too.
fn step(
    lease: Option<&Lease>,
    me: &str,
    leading: bool,
    prev: Option<&Seen>,
    now: Instant,
) -> (Step, Option<Seen>) {
    let Some(lease) = lease else {
        return (Step::Create, None);
    };
    let spec = lease.spec.clone().unwrap_or_default();
    let holder = spec.holder_identity.unwrap_or_default();
    if holder == me {
        return (Step::Renew, None);
    }
    if leading {
        return (Step::Deposed, None);
    }
    if holder.is_empty() {
        return (Step::TakeOver, None);
    }
    let version = lease.resource_version().unwrap_or_default();
    let seen = match prev {
        Some(p) if p.holder == holder && p.version == version => p.clone(),
        _ => Seen {
            holder,
            version,
            since: now,
        },
    };
    let duration = Duration::from_secs(
        u64::try_from(spec.lease_duration_seconds.unwrap_or(15).max(1)).unwrap_or(15),
    );
    if now.saturating_duration_since(seen.since) >= duration {
        (Step::TakeOver, Some(seen))
    } else {
        (Step::Wait, Some(seen))
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
    seen: Option<Seen>,
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
                Ok(true) => Instant::now() + self.cfg.renew_every(),
                Ok(false) if self.leading() => Instant::now() + self.cfg.renew_every() / 2,
                Ok(false) => Instant::now() + self.cfg.retry_every(),
                Err(()) => {
                    warn!("another replica holds the leader lease; standing by");
                    self.lose();
                    Instant::now() + self.cfg.retry_every()
                }
            };
        }
    }

    /// One look at the Lease. Ok(true): we hold it with a fresh term;
    /// Ok(false): not (yet), or a renewal failed; Err: deposed.
    async fn tick(&mut self) -> Result<bool, ()> {
        // A request that cannot finish within the term is useless.
        let budget = self
            .valid_until()
            .filter(|_| self.leading())
            .map_or(self.cfg.retry_every() * 2, |v| {
                v.saturating_duration_since(Instant::now())
            });
        if let Some(ours) = self.ours.clone() {
            // Renew from our copy: one CAS; a conflict means someone else
            // wrote the Lease, and then we look at it.
            match self.write(&ours, false, budget).await {
                Ok(true) => return Ok(true),
                Ok(false) => {}
                Err(()) => return Ok(false),
            }
        }
        let read = match timeout(budget, self.api.get_opt(&self.cfg.lease_name)).await {
            Ok(Ok(l)) => l,
            Ok(Err(e)) => {
                warn!(error = %batchlease_api::Chain(&e), "reading the leader lease failed");
                return Ok(false);
            }
            Err(_) => return Ok(false),
        };
        let (step, seen) = step(
            read.as_ref(),
            &self.cfg.identity,
            self.leading(),
            self.seen.as_ref(),
            Instant::now(),
        );
        self.seen = seen;
        match (step, read) {
            (Step::Deposed, _) => Err(()),
            (Step::Wait, _) => Ok(false),
            (Step::Create, _) => Ok(self.create(budget).await),
            (Step::Renew, Some(l)) => Ok(self.write(&l, false, budget).await == Ok(true)),
            (Step::TakeOver, Some(l)) => Ok(self.write(&l, true, budget).await == Ok(true)),
            (Step::Renew | Step::TakeOver, None) => Ok(false),
        }
    }

    fn spec(&self, prev: Option<&LeaseSpec>, take_over: bool) -> LeaseSpec {
        let now = MicroTime(Timestamp::now());
        let mut spec = prev.cloned().unwrap_or_default();
        if take_over || prev.is_none() {
            spec.acquire_time = Some(now.clone());
            spec.lease_transitions =
                Some(spec.lease_transitions.unwrap_or(0) + i32::from(prev.is_some()));
        }
        spec.holder_identity = Some(self.cfg.identity.clone());
        spec.lease_duration_seconds = i32::try_from(self.cfg.duration_seconds).ok();
        spec.renew_time = Some(now);
        spec
    }

    async fn create(&mut self, budget: Duration) -> bool {
        let mut lease = Lease::default();
        lease.metadata.name = Some(self.cfg.lease_name.clone());
        lease.metadata.namespace = Some(self.cfg.namespace.clone());
        lease.spec = Some(self.spec(None, true));
        let sent = Instant::now();
        match timeout(budget, self.api.create(&PostParams::default(), &lease)).await {
            Ok(Ok(stored)) => {
                self.won(stored, sent);
                true
            }
            Ok(Err(e)) => {
                debug!(error = %batchlease_api::Chain(&e), "creating the leader lease failed");
                false
            }
            Err(_) => false,
        }
    }

    /// Renews (or takes over) `from` by CAS. Ok(true): a fresh term;
    /// Ok(false): conflict (look again); Err: any other failure.
    async fn write(&mut self, from: &Lease, take_over: bool, budget: Duration) -> Result<bool, ()> {
        let mut lease = from.clone();
        lease.spec = Some(self.spec(from.spec.as_ref(), take_over));
        let sent = Instant::now();
        match timeout(
            budget,
            self.api
                .replace(&self.cfg.lease_name, &PostParams::default(), &lease),
        )
        .await
        {
            Ok(Ok(stored)) => {
                if take_over {
                    info!(identity = %self.cfg.identity, "took over the leader lease");
                }
                self.won(stored, sent);
                Ok(true)
            }
            Ok(Err(kube::Error::Api(s))) if s.code == 409 => Ok(false),
            Ok(Err(e)) => {
                warn!(error = %batchlease_api::Chain(&e), "writing the leader lease failed");
                Err(())
            }
            Err(_) => {
                warn!("writing the leader lease timed out");
                Err(())
            }
        }
    }

    /// A write sent at `sent` succeeded: the term runs from then. The first
    /// success after not leading starts a new generation.
    fn won(&mut self, stored: Lease, sent: Instant) {
        let first = self.ours.is_none();
        self.ours = Some(stored);
        self.seen = None;
        let until = sent + self.cfg.term();
        let generation = {
            let mut t = self.term.lock().unwrap_or_else(|e| e.into_inner());
            if first {
                t.generation += 1;
                t.valid_until = Some(until);
            } else {
                t.valid_until = Some(t.valid_until.map_or(until, |v| v.max(until)));
            }
            t.generation
        };
        if first {
            info!(identity = %self.cfg.identity, generation, "acquired the leader lease");
            let _ = self.tx.send(generation);
        }
    }

    /// Ends the current term at once (its writers stop), then stands by.
    fn lose(&mut self) {
        let was = self.ours.take().is_some();
        self.seen = None;
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
mod tests {
    use super::*;

    fn lease(holder: Option<&str>, rv: &str, secs: i32) -> Lease {
        let mut l = Lease::default();
        l.metadata.resource_version = Some(rv.into());
        l.spec = Some(LeaseSpec {
            holder_identity: holder.map(Into::into),
            lease_duration_seconds: Some(secs),
            ..Default::default()
        });
        l
    }

    #[test]
    fn step_table() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        assert_eq!(step(None, "me", false, None, t0).0, Step::Create);
        let mine = lease(Some("me"), "1", 15);
        assert_eq!(step(Some(&mine), "me", true, None, t0).0, Step::Renew);
        let vacated = lease(None, "2", 1);
        assert_eq!(
            step(Some(&vacated), "me", false, None, t0).0,
            Step::TakeOver
        );
        // We led and someone else holds it now: deposed, never "wait".
        let theirs = lease(Some("other"), "3", 15);
        assert_eq!(step(Some(&theirs), "me", true, None, t0).0, Step::Deposed);
        // A standby waits a full duration of *unchanged* version by its own
        // clock (the holder's renewTime is never trusted).
        let (st, seen) = step(Some(&theirs), "me", false, None, t0);
        assert_eq!(st, Step::Wait);
        let seen = seen.unwrap();
        assert_eq!(seen.since, t0);
        let (st, again) = step(Some(&theirs), "me", false, Some(&seen), t0 + s(14));
        assert_eq!(
            (st, again.as_ref().map(|x| x.since)),
            (Step::Wait, Some(t0))
        );
        assert_eq!(
            step(Some(&theirs), "me", false, Some(&seen), t0 + s(15)).0,
            Step::TakeOver
        );
        // A renewal (new version) restarts the clock.
        let renewed = lease(Some("other"), "4", 15);
        let (st, seen2) = step(Some(&renewed), "me", false, Some(&seen), t0 + s(15));
        assert_eq!((st, seen2.map(|x| x.since)), (Step::Wait, Some(t0 + s(15))));
    }

    #[test]
    fn timings() {
        let cfg = ElectionConfig {
            namespace: "ns".into(),
            lease_name: "l".into(),
            identity: "me".into(),
            duration_seconds: 15,
            grace_seconds: 5,
        };
        assert_eq!(cfg.term(), Duration::from_secs(10));
        assert!(cfg.renew_every() < cfg.term() / 2);
        // A grace larger than the duration still leaves a usable term.
        let odd = ElectionConfig {
            grace_seconds: 100,
            ..cfg
        };
        assert_eq!(odd.term(), Duration::from_secs(5));
    }

    #[tokio::test(start_paused = true)]
    async fn a_dead_election_task_is_an_error_not_another_term() {
        // The elector crashed mid-term: its term still looks valid until
        // the deadline, but no term may be handed out again.
        let term = Arc::new(Mutex::new(Term {
            generation: 1,
            valid_until: Some(Instant::now() + Duration::from_secs(10)),
        }));
        let (tx, rx) = watch::channel(1);
        let mut campaign = Campaign {
            task: None,
            stop: CancellationToken::new(),
            term: Some(term),
            changed: Some(rx),
        };
        assert!(campaign.acquired().await.is_ok(), "the elector is alive");
        drop(tx);
        let err = tokio::time::timeout(Duration::from_secs(1), campaign.acquired())
            .await
            .expect("fails at once, does not wait for a change")
            .unwrap_err();
        assert!(err.to_string().contains("election task ended"), "{err}");
    }

    #[tokio::test(start_paused = true)]
    async fn writes_stop_when_the_term_runs_out_without_any_task_running() {
        let term = Arc::new(Mutex::new(Term::default()));
        let (tx, rx) = watch::channel(0);
        let l = Leadership {
            term: Some(term.clone()),
            generation: 1,
            changed: Some(rx),
        };
        assert!(l.ensure().is_err(), "not leading before the first win");
        *term.lock().unwrap() = Term {
            generation: 1,
            valid_until: Some(Instant::now() + Duration::from_secs(10)),
        };
        let _ = tx.send(1);
        assert!(l.ensure().is_ok());
        let lost = tokio::spawn(l.clone().lost());
        tokio::time::advance(Duration::from_millis(9_999)).await;
        assert!(l.ensure().is_ok());
        tokio::time::advance(Duration::from_millis(1)).await;
        // Nobody marked it lost: the clock alone refuses the write …
        assert!(matches!(l.ensure(), Err(Error::NotLeader)));
        // … and `lost()` resolves by the same deadline.
        tokio::time::timeout(Duration::from_millis(10), lost)
            .await
            .unwrap()
            .unwrap();
        // A later term (re-acquired after the outage) never revives the
        // old term's writers.
        *term.lock().unwrap() = Term {
            generation: 2,
            valid_until: Some(Instant::now() + Duration::from_secs(10)),
        };
        let _ = tx.send(2);
        assert!(matches!(l.ensure(), Err(Error::NotLeader)));
        let next = Leadership {
            generation: 2,
            ..l.clone()
        };
        assert!(next.ensure().is_ok());
    }
}
