//! The kill switch and the fence of one attempt (design §3 step 4).
//!
//! The attempt may act only while the worker can prove to itself that the
//! lease is still its own: a renewal succeeded less than 2/3 of the TTL ago,
//! counted from when that renewal was *sent* (the server may have applied it
//! at any moment after), by the worker's monotonic clock. Past that instant
//! — or past `activeDeadlineSeconds`, or once the lease was found lost — the
//! kill switch fires: the handler is dropped, its cancellation token fires,
//! and [`Fence::check`] refuses every later commit or completion. The
//! operator expires a lease only after a full TTL without an observed
//! renewal, so the worker stops at least TTL/3 before anyone else can start.
//!
//! A fence also carries the attempt's **resource tokens** (design §5): for
//! each resource lock the operator took for the task, that lock's own
//! fencing token, scoped to the task's namespace. Storage adapters register
//! and check them next to the task's token, so a fenced store refuses a
//! zombie's write to a shared resource even when the zombie belongs to
//! another task.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::error::Error;

/// Why an attempt was stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KillReason {
    /// No renewal succeeded for 2/3 of the TTL.
    RenewalsFailed,
    /// A renewal found the lease no longer held by us (expired, completed by
    /// someone else, or deleted with its task).
    LeaseLost,
    /// The attempt ran past `activeDeadlineSeconds`.
    DeadlineExceeded,
    /// The API server refused our own write of the lease as invalid (422):
    /// the same write would be refused again.
    WriteRefused,
    /// The operator released the lease because the task was cancelled
    /// (`spec.cancel`).
    Cancelled,
    /// Renewed per worker: the operator revoked the attempt on the worker's
    /// WorkerLease, which it does before it ends the attempt (its expiry,
    /// a cancel, a lost or stray lease). Which end it is, the worker does
    /// not read: the kill must not wait on a read, and the give-back's
    /// compare-and-swap settles the one question that matters — whether
    /// the lease is still ours.
    Revoked,
    /// Renewed per worker: the WorkerLease that kept the attempt alive is
    /// gone (deleted, or re-created as another object) and its renewals
    /// with it. The TaskLease may well still be held by us: unlike
    /// [`KillReason::LeaseLost`] it is given back.
    WorkerLeaseLost,
}

impl KillReason {
    /// Low-cardinality label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::RenewalsFailed => "renewals_failed",
            Self::LeaseLost => "lease_lost",
            Self::DeadlineExceeded => "deadline_exceeded",
            Self::WriteRefused => "write_refused",
            Self::Cancelled => "cancelled",
            Self::Revoked => "revoked",
            Self::WorkerLeaseLost => "worker_lease_lost",
        }
    }
}

/// Pure timing of the kill switch.
///
/// Per lease (the default) the clock is fed by the attempt's own writes of
/// its TaskLease. Renewed per worker ([`KillClock::per_worker`]) it is fed
/// by the WorkerLease renewals that named the attempt too, and bounded by
/// the last write of the TaskLease itself: such an attempt writes its
/// TaskLease at least every [`KillClock::refresh_every`], so one whose
/// TaskLease was deleted (every write then fails) stops at most
/// `refresh + 2/3·TTL` after its last successful write was sent — a bound
/// the operator counts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KillClock {
    ttl: Duration,
    /// When the last successful renewal (or the claim) was sent.
    last_ok_sent: Instant,
    /// When the last successful write of the TaskLease itself (or the
    /// claim) was sent.
    last_write_sent: Instant,
    /// Renewed per worker: how often the TaskLease itself is written at
    /// least (`max(TTL, 120 s)`). `None`: renewed per lease.
    refresh: Option<Duration>,
    /// Renewed per worker: how stale the checkpoint on the TaskLease may
    /// grow (`None`: the TTL; see [`KillClock::next_write`]).
    checkpoint_every: Option<Duration>,
    /// `claim sent + activeDeadlineSeconds`, if set.
    deadline: Option<Instant>,
}

impl KillClock {
    /// The clock of an attempt whose claim was sent at `claim_sent`.
    pub fn new(ttl: Duration, claim_sent: Instant, active_deadline: Option<Duration>) -> Self {
        Self {
            ttl,
            last_ok_sent: claim_sent,
            last_write_sent: claim_sent,
            refresh: None,
            checkpoint_every: None,
            // Checked: a deadline too far to represent is no deadline
            // (the schema caps it at a year; this keeps a hostile or
            // future value from panicking every claimant).
            deadline: active_deadline.and_then(|d| claim_sent.checked_add(d)),
        }
    }

    /// The lease duration.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Renew every TTL/3.
    pub fn renew_every(&self) -> Duration {
        self.ttl / 3
    }

    /// When the first renewal is due: TTL/3 after the claim was *sent*
    /// (not after the attempt started: the claim's round trip counts).
    pub fn next_renewal(&self) -> Instant {
        self.last_ok_sent + self.renew_every()
    }

    /// A renewal sent at `sent` succeeded: a write of the TaskLease, or
    /// (renewed per worker) a WorkerLease renewal that named the attempt
    /// and was answered in time.
    pub fn renewed(&mut self, sent: Instant) {
        self.last_ok_sent = self.last_ok_sent.max(sent);
    }

    /// A write of the TaskLease itself sent at `sent` succeeded: a renewal
    /// and, renewed per worker, the start of a new refresh period.
    pub fn written(&mut self, sent: Instant) {
        self.renewed(sent);
        self.last_write_sent = self.last_write_sent.max(sent);
    }

    /// The same clock for an attempt renewed per worker: its TaskLease is
    /// written at least every `max(TTL, 120 s)`, and the kill switch fires
    /// `2/3·TTL` after that period too (see the type's doc).
    #[must_use]
    pub fn per_worker(mut self) -> Self {
        // The operator counts a deleted lease's holder as running until its
        // last observed write plus this plus the TTL: one rule, shared.
        self.refresh = Some(batchlease_api::worker_lease::refresh_period(self.ttl));
        self
    }

    /// Renewed per worker: write a new checkpoint to the TaskLease at most
    /// every `every` (`None`: every TTL), kept between `TTL/3` and the
    /// refresh period (see [`KillClock::next_write`]).
    #[must_use]
    pub fn checkpoint_interval(mut self, every: Option<Duration>) -> Self {
        self.checkpoint_every = every;
        self
    }

    /// Renewed per worker: how often at most a new checkpoint is written
    /// to the TaskLease.
    pub fn checkpoint_every(&self) -> Option<Duration> {
        let refresh = self.refresh?;
        let every = self.checkpoint_every.unwrap_or(self.ttl);
        Some(every.clamp(self.renew_every(), refresh.max(self.renew_every())))
    }

    /// Back to renewals per lease (the WorkerLease refused a renewal for a
    /// reason other than a conflict): the refresh bound goes, as every
    /// write from now on is a TaskLease write.
    pub fn renew_per_lease(&mut self) {
        self.refresh = None;
    }

    /// Whether the attempt is renewed per worker.
    pub fn is_per_worker(&self) -> bool {
        self.refresh.is_some()
    }

    /// Renewed per worker: how often the TaskLease is written at least.
    pub fn refresh_every(&self) -> Option<Duration> {
        self.refresh
    }

    /// When the last successful write of the TaskLease (or the claim) was
    /// sent.
    pub fn last_written(&self) -> Instant {
        self.last_write_sent
    }

    /// When the attempt's heartbeat next writes its TaskLease. Per lease:
    /// [`KillClock::next_renewal`] (a checkpoint rides on each renewal).
    /// Renewed per worker: when a refresh is due (`refresh` after the last
    /// write), or [`KillClock::checkpoint_every`] after the last write when
    /// a checkpoint not yet written is pending — the latest one then, so a
    /// handler that checkpoints every second costs one write per interval.
    /// Why the TTL by default and not `TTL/3`: at `TTL/3` a checkpointing
    /// attempt cost a write every `TTL/3` on top of its worker's renewals,
    /// more than renewing per lease (16 leases at TTL 6 s checkpointing
    /// every second: 9.3 writes/s against 8.6/s); at the TTL it costs a
    /// third of that. The price is staleness: a task resumed after its
    /// worker died starts from a checkpoint at most that old (one given
    /// back by a drain, a completion or a failure carries the latest).
    pub fn next_write(&self, new_checkpoint: bool) -> Instant {
        let (Some(refresh), Some(every)) = (self.refresh, self.checkpoint_every()) else {
            return self.next_renewal();
        };
        let refresh_at = self.last_write_sent + refresh;
        if new_checkpoint {
            refresh_at.min(self.last_write_sent + every)
        } else {
            refresh_at
        }
    }

    /// When the kill switch fires, and why.
    pub fn kill_at(&self) -> (Instant, KillReason) {
        let mut renewal_bound = self.last_ok_sent + self.ttl * 2 / 3;
        if let Some(refresh) = self.refresh {
            renewal_bound = renewal_bound.min(self.last_write_sent + refresh + self.ttl * 2 / 3);
        }
        match self.deadline {
            Some(d) if d <= renewal_bound => (d, KillReason::DeadlineExceeded),
            _ => (renewal_bound, KillReason::RenewalsFailed),
        }
    }
}

/// The fence of one attempt: its token, its resource tokens, and whether
/// it may still act. Cheap to clone; hand it to storage adapters.
#[derive(Debug, Clone)]
pub struct Fence {
    token: i64,
    resources: Arc<Resources>,
    inner: Arc<Inner>,
}

/// The `Error::Revoked` reason of a fence whose handler a drain stopped.
const STOPPED_BY_DRAIN: &str = "drained";

/// The resource locks of an attempt. Locks are scoped per namespace:
/// resource "db" in namespace A is not resource "db" in namespace B.
#[derive(Debug, Default)]
struct Resources {
    namespace: String,
    tokens: BTreeMap<String, i64>,
}

#[derive(Debug)]
struct Inner {
    killed: CancellationToken,
    /// Fires when the handler is stopped: by the kill switch (a child of
    /// `killed`), or by a drain past its grace ([`Fence::stop`]).
    stopped: CancellationToken,
    clock: Mutex<KillClock>,
    reason: Mutex<Option<KillReason>>,
}

impl Fence {
    /// A live fence for `token`.
    pub fn new(token: i64, clock: KillClock) -> Self {
        let killed = CancellationToken::new();
        Self {
            token,
            resources: Arc::default(),
            inner: Arc::new(Inner {
                stopped: killed.child_token(),
                killed,
                clock: Mutex::new(clock),
                reason: Mutex::new(None),
            }),
        }
    }

    /// The fencing token every write of this attempt must carry.
    pub fn token(&self) -> i64 {
        self.token
    }

    /// The same fence, holding the resource locks `tokens` (resource name
    /// to that lock's fencing token) in `namespace`. The SDK builds every
    /// attempt's fence with the lease's `spec.resourceTokens`; fenced
    /// storage registers and checks them with the task's token.
    #[must_use]
    pub fn with_resources(
        mut self,
        namespace: impl Into<String>,
        tokens: BTreeMap<String, i64>,
    ) -> Self {
        self.resources = Arc::new(Resources {
            namespace: namespace.into(),
            tokens,
        });
        self
    }

    /// Resource name to its lock's fencing token (empty without locks).
    pub fn resource_tokens(&self) -> &BTreeMap<String, i64> {
        &self.resources.tokens
    }

    /// The fencing token of the lock on `resource`, if the attempt holds
    /// it: what user code writes next to its own rows of that resource
    /// (`… WHERE fence <= $token`) to fence them itself.
    pub fn resource_token(&self, resource: &str) -> Option<i64> {
        self.resources.tokens.get(resource).copied()
    }

    /// The namespace the resource locks belong to.
    pub fn resource_namespace(&self) -> &str {
        &self.resources.namespace
    }

    /// Ok while the attempt may still write; checked synchronously against
    /// the clock too, so a process that wakes from a pause (SIGSTOP, GC)
    /// refuses before its timers even had a chance to run. Refused too
    /// once a drain stopped the handler: work it spawned must not write
    /// while its lease is being given back.
    pub fn check(&self) -> Result<(), Error> {
        if self.inner.stopped.is_cancelled() && self.kill_reason().is_none() {
            return Err(Error::Revoked {
                token: self.token,
                reason: STOPPED_BY_DRAIN,
            });
        }
        self.check_alive()
    }

    /// [`Fence::check`] without the drain's stop: whether the lease may
    /// still be written as ours (the heartbeat's completion of a drained
    /// attempt).
    pub(crate) fn check_alive(&self) -> Result<(), Error> {
        if let Some(reason) = self.kill_reason() {
            return Err(Error::Revoked {
                token: self.token,
                reason: reason.as_str(),
            });
        }
        let (at, reason) = self.clock().kill_at();
        if Instant::now() >= at {
            self.kill(reason);
            return Err(Error::Revoked {
                token: self.token,
                reason: reason.as_str(),
            });
        }
        Ok(())
    }

    /// The lease duration of the attempt.
    pub fn ttl(&self) -> Duration {
        self.clock().ttl()
    }

    /// How long the attempt may still act (zero once revoked or stopped).
    pub fn time_left(&self) -> Duration {
        if self.inner.stopped.is_cancelled() {
            return Duration::ZERO;
        }
        self.clock()
            .kill_at()
            .0
            .saturating_duration_since(Instant::now())
    }

    /// Fires when the kill switch does.
    pub fn killed(&self) -> &CancellationToken {
        &self.inner.killed
    }

    /// Fires when the handler is stopped: by the kill switch, or by a
    /// drain past its grace. What `TaskContext::cancellation` hands out.
    pub fn stopped(&self) -> &CancellationToken {
        &self.inner.stopped
    }

    /// A drain past its grace stopped the handler: work it spawned is told
    /// (`stopped`) and every later [`Fence::check`] refuses, while the
    /// lease, still ours, is renewed until it is given back.
    pub(crate) fn stop(&self) {
        self.inner.stopped.cancel();
    }

    /// Why the kill switch fired, if it did.
    pub fn kill_reason(&self) -> Option<KillReason> {
        *self.inner.reason.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Fires the kill switch (first reason wins). Returns true if this call
    /// fired it.
    pub fn kill(&self, reason: KillReason) -> bool {
        let mut r = self.inner.reason.lock().unwrap_or_else(|e| e.into_inner());
        if r.is_some() {
            return false;
        }
        *r = Some(reason);
        self.inner.killed.cancel();
        true
    }

    pub(crate) fn clock(&self) -> KillClock {
        *self.inner.clock.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn renewed(&self, sent: Instant) {
        self.with_clock(|c| c.renewed(sent));
    }

    /// A write of the TaskLease itself, sent at `sent`, succeeded.
    pub(crate) fn written(&self, sent: Instant) {
        self.with_clock(|c| c.written(sent));
    }

    /// Renewed per lease from now on (see [`KillClock::renew_per_lease`]).
    pub(crate) fn renew_per_lease(&self) {
        self.with_clock(KillClock::renew_per_lease);
    }

    fn with_clock(&self, f: impl FnOnce(&mut KillClock)) {
        f(&mut self.inner.clock.lock().unwrap_or_else(|e| e.into_inner()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(30);

    /// `activeDeadlineSeconds` near `i64::MAX` made `Instant + Duration`
    /// panic in every worker that claimed the task.
    #[test]
    fn an_unrepresentable_deadline_is_no_deadline() {
        let c = KillClock::new(
            TTL,
            Instant::now(),
            Some(Duration::from_secs(i64::MAX.unsigned_abs())),
        );
        assert_eq!(c.kill_at().1, KillReason::RenewalsFailed);
        let c = KillClock::new(TTL, Instant::now(), Some(Duration::MAX));
        assert_eq!(c.kill_at().1, KillReason::RenewalsFailed);
    }

    #[test]
    fn kill_at_table() {
        let t0 = Instant::now();
        let cases = [
            // (active deadline, renewed at offset, expected kill offset, reason)
            (None, None, 20, KillReason::RenewalsFailed),
            (None, Some(10), 30, KillReason::RenewalsFailed),
            (Some(15), None, 15, KillReason::DeadlineExceeded),
            (Some(100), Some(90), 100, KillReason::DeadlineExceeded),
            (Some(100), Some(10), 30, KillReason::RenewalsFailed),
        ];
        for (deadline, renewed, want, reason) in cases {
            let mut c = KillClock::new(TTL, t0, deadline.map(Duration::from_secs));
            if let Some(r) = renewed {
                c.renewed(t0 + Duration::from_secs(r));
            }
            assert_eq!(
                c.kill_at(),
                (t0 + Duration::from_secs(want), reason),
                "{deadline:?} {renewed:?}"
            );
        }
        // A late acknowledgement of an older renewal never moves the clock back.
        let mut c = KillClock::new(TTL, t0, None);
        c.renewed(t0 + Duration::from_secs(12));
        c.renewed(t0 + Duration::from_secs(6));
        assert_eq!(c.kill_at().0, t0 + Duration::from_secs(32));
        assert_eq!(c.renew_every(), Duration::from_secs(10));
    }

    /// Renewed per worker: the kill instant is the earlier of 2/3·T after
    /// the last feeding and R + 2/3·T after the last TaskLease write, R =
    /// max(T, 120 s).
    #[test]
    fn kill_at_per_worker_table() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        /// (ttl, WorkerLease renewals fed at, TaskLease writes at,
        /// deadline, expected kill offset, reason)
        type Case = (
            u64,
            &'static [u64],
            &'static [u64],
            Option<u64>,
            u64,
            KillReason,
        );
        let cases: [Case; 8] = [
            // Only the claim: as per lease.
            (30, &[], &[], None, 20, KillReason::RenewalsFailed),
            // Fed by naming renewals, bounded by the refresh: 0 + 120 + 20.
            (30, &[100, 130], &[], None, 140, KillReason::RenewalsFailed),
            (30, &[10], &[], None, 30, KillReason::RenewalsFailed),
            // A TaskLease write moves both bounds.
            (
                30,
                &[100, 130],
                &[110],
                None,
                150,
                KillReason::RenewalsFailed,
            ),
            (
                30,
                &[200, 250],
                &[110],
                None,
                250,
                KillReason::RenewalsFailed,
            ),
            // A long TTL: R = TTL.
            (300, &[900], &[0], None, 500, KillReason::RenewalsFailed),
            // The deadline still wins when sooner.
            (
                30,
                &[100, 130],
                &[],
                Some(135),
                135,
                KillReason::DeadlineExceeded,
            ),
            (
                30,
                &[100, 130],
                &[],
                Some(141),
                140,
                KillReason::RenewalsFailed,
            ),
        ];
        for (ttl, fed, writes, deadline, want, reason) in cases {
            let mut c = KillClock::new(s(ttl), t0, deadline.map(s)).per_worker();
            assert!(c.is_per_worker());
            for &f in fed {
                c.renewed(t0 + s(f));
            }
            for &w in writes {
                c.written(t0 + s(w));
            }
            assert_eq!(
                c.kill_at(),
                (t0 + s(want), reason),
                "ttl {ttl} fed {fed:?} writes {writes:?} deadline {deadline:?}"
            );
        }
        assert_eq!(
            KillClock::new(s(30), t0, None).per_worker().refresh_every(),
            Some(Duration::from_secs(120))
        );
        assert_eq!(KillClock::new(s(30), t0, None).refresh_every(), None);
        // Falling back to per-lease renewals drops the refresh bound.
        let mut c = KillClock::new(s(30), t0, None).per_worker();
        c.renewed(t0 + s(130));
        assert_eq!(c.kill_at().0, t0 + s(140));
        c.renew_per_lease();
        assert!(!c.is_per_worker());
        assert_eq!(c.kill_at().0, t0 + s(150));
        // When the TaskLease is written.
        let mut c = KillClock::new(s(30), t0, None).per_worker();
        c.renewed(t0 + s(100));
        assert_eq!(c.next_write(false), t0 + s(120), "a refresh");
        assert_eq!(
            c.next_write(true),
            t0 + s(30),
            "a checkpoint, a TTL after the claim"
        );
        c.written(t0 + s(50));
        assert_eq!(c.next_write(false), t0 + s(170));
        assert_eq!(c.next_write(true), t0 + s(80));
        let long = KillClock::new(s(600), t0, None).per_worker();
        assert_eq!(long.next_write(false), t0 + s(600), "R = TTL past 120 s");
        let mut per_lease = KillClock::new(s(30), t0, None);
        per_lease.renewed(t0 + s(40));
        assert_eq!(per_lease.next_write(false), t0 + s(50));
        assert_eq!(per_lease.next_write(true), t0 + s(50));
        // A late acknowledgement of an older write never moves it back.
        let mut c = KillClock::new(s(30), t0, None).per_worker();
        c.written(t0 + s(50));
        c.written(t0 + s(40));
        assert_eq!(c.last_written(), t0 + s(50));
    }

    #[tokio::test(start_paused = true)]
    async fn fence_refuses_after_two_thirds_of_the_ttl_without_timers() {
        let fence = Fence::new(7, KillClock::new(TTL, Instant::now(), None));
        assert!(fence.check().is_ok());
        tokio::time::advance(Duration::from_secs(19)).await;
        assert!(fence.check().is_ok());
        fence.renewed(Instant::now()); // renewal sent at 19 s
        tokio::time::advance(Duration::from_secs(19)).await; // 38 s: within 19 + 20
        assert!(fence.check().is_ok());
        tokio::time::advance(Duration::from_secs(1)).await; // 39 s = 19 + 20
        let err = fence.check().unwrap_err();
        assert!(
            matches!(
                err,
                Error::Revoked {
                    token: 7,
                    reason: "renewals_failed"
                }
            ),
            "{err}"
        );
        assert!(
            fence.killed().is_cancelled(),
            "check() fires the switch itself"
        );
        assert_eq!(fence.kill_reason(), Some(KillReason::RenewalsFailed));
    }

    #[test]
    fn first_kill_reason_wins() {
        let fence = Fence::new(1, KillClock::new(TTL, Instant::now(), None));
        assert!(fence.kill(KillReason::LeaseLost));
        assert!(!fence.kill(KillReason::RenewalsFailed));
        assert_eq!(fence.kill_reason(), Some(KillReason::LeaseLost));
        assert!(matches!(
            fence.check(),
            Err(Error::Revoked {
                reason: "lease_lost",
                ..
            })
        ));
    }

    /// Issue 39, defect 9: renewed per worker, a new checkpoint is written
    /// at most every checkpoint interval (the TTL by default), kept
    /// between TTL/3 and the refresh period; per lease it rides on the
    /// renewal every TTL/3.
    #[test]
    fn checkpoint_writes_are_coalesced_to_their_interval() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        // (TTL, interval asked, per worker, a checkpoint written again after)
        for (ttl, asked, per_worker, want) in [
            (6, None, true, 6),
            (30, None, true, 30),
            (30, Some(60), true, 60),
            // Never more often than TTL/3, never past the refresh.
            (30, Some(1), true, 10),
            (30, Some(600), true, 120),
            (300, None, true, 300),
            // Per lease: with every renewal.
            (6, None, false, 2),
            (30, Some(60), false, 10),
        ] {
            let mut c = KillClock::new(s(ttl), t0, None).checkpoint_interval(asked.map(s));
            if per_worker {
                c = c.per_worker();
            }
            assert_eq!(
                c.next_write(true),
                t0 + s(want),
                "TTL {ttl} s, asked {asked:?}, per worker {per_worker}"
            );
        }
    }
}
