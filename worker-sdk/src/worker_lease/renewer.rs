//! The WorkerLease's renewal loop, on the heartbeat runtime with its
//! client (a handler that blocks its thread must not starve it). It
//! performs what `plan` decides; see the module above for what attempts
//! are told.

use std::time::Duration;

use batchlease_api::worker_lease::worker_lease_name;
use batchlease_api::{AttemptRef, TaskLease, WorkerLease};
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use tokio::time::{Instant, sleep_until, timeout};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use super::plan::{self, Held, OnCopy, Refusal};
use super::{EntryState, Mode, WorkerLeases};
use crate::fence::{Fence, KillReason};
use crate::lease_ops;
use crate::worker_lease_ops::{self as ops, Adopted, Written};

/// How often the WorkerLease is tried again while it cannot be created or
/// is refused (403, 422, a foreign holder): slowly, as nothing depends on
/// it meanwhile (attempts renew per lease).
pub(crate) const FALLBACK_RETRY: Duration = Duration::from_secs(30);

/// Bound on the delete when the worker stops (as the presence record's).
const DELETE_BUDGET: Duration = Duration::from_secs(2);

/// Bound on reading a revoked attempt's TaskLease (for the kill reason).
const REASON_READ_BUDGET: Duration = Duration::from_secs(2);

/// The renewal loop of one worker's WorkerLease.
pub(crate) struct Renewer {
    pub(crate) api: Api<WorkerLease>,
    pub(crate) task_leases: Api<TaskLease>,
    pub(crate) identity: String,
    pub(crate) queues: Vec<String>,
    pub(crate) leases: WorkerLeases,
}

impl Renewer {
    /// Creates (or adopts) the WorkerLease and renews it until `stop` and
    /// no attempt is registered any more; then deletes it (bounded).
    pub(crate) async fn run(self, stop: CancellationToken) {
        let name = worker_lease_name(&self.identity);
        let mut ours: Option<WorkerLease> = None;
        let mut last_ok_sent = Instant::now();
        let mut last_renew_time: Option<Timestamp> = None;
        let mut retry_at: Option<Instant> = Some(Instant::now());
        let mut fallback = false;
        loop {
            if stop.is_cancelled() && self.leases.lock().entries.is_empty() {
                break;
            }
            let held = self.held();
            let due = retry_at.unwrap_or_else(|| plan::next_renewal(last_ok_sent, &held));
            tokio::select! {
                () = stop.cancelled(), if !stop.is_cancelled() => continue,
                () = self.leases.shared.wake.notified() => continue,
                () = sleep_until(due) => {}
            }
            retry_at = None;
            let Some(current) = ours.as_ref() else {
                let sent = Instant::now();
                let desired = ops::object(
                    &self.identity,
                    &self.queues,
                    ops::pod_owner(),
                    Timestamp::now(),
                );
                match timeout(
                    plan::try_budget(&[]),
                    ops::create_or_adopt(&self.api, &desired),
                )
                .await
                {
                    Ok(Ok(Adopted::Ours(w))) => {
                        info!(worker_lease = %name, identity = %self.identity, "worker lease ready: attempts are renewed per worker");
                        last_renew_time = w.spec.renew_time.as_ref().map(|t| t.0);
                        last_ok_sent = sent;
                        ours = Some(*w);
                        fallback = false;
                        self.leases.lock().live = true;
                    }
                    Ok(Ok(Adopted::Foreign(holder))) => {
                        error!(worker_lease = %name, identity = %self.identity, %holder, retry_in = ?FALLBACK_RETRY, "the worker lease's name is taken by another holder: attempts are renewed per lease");
                        retry_at = Some(Instant::now() + FALLBACK_RETRY);
                    }
                    Ok(Ok(Adopted::Refused { code, message })) => {
                        warn!(worker_lease = %name, code, %message, retry_in = ?FALLBACK_RETRY, "the worker lease cannot be created (RBAC for workerleases? the kind installed?): attempts are renewed per lease");
                        retry_at = Some(Instant::now() + FALLBACK_RETRY);
                    }
                    Ok(Err(e)) => {
                        warn!(worker_lease = %name, error = %batchlease_api::Chain(&e), "worker lease create failed; retrying");
                        retry_at = Some(Instant::now() + plan::retry_after(&[]));
                    }
                    Err(_) => retry_at = Some(Instant::now()),
                }
                continue;
            };
            // One renewal.
            let named = self.named();
            let held: Vec<Held> = named.iter().map(|n| n.held).collect();
            let holds: Vec<AttemptRef> = named.iter().map(|n| n.attempt.clone()).collect();
            let duration = plan::lease_duration_seconds(held.iter().map(|h| h.ttl));
            let renew_time = plan::next_renew_time(last_renew_time, Timestamp::now());
            // Whether or not it lands, never write it again.
            last_renew_time = Some(renew_time);
            let budget = plan::try_budget(&held);
            let sent = Instant::now();
            let written = timeout(
                budget,
                ops::renew(&self.api, current, holds, duration, renew_time),
            )
            .await;
            match written {
                Ok(Ok(Written::Stored(stored))) => {
                    let answered = Instant::now();
                    self.fed(&named, sent, answered);
                    last_ok_sent = sent;
                    if fallback {
                        info!(worker_lease = %name, "worker lease renewed again: new claims are renewed per worker");
                        fallback = false;
                    }
                    self.leases.lock().live = true;
                    self.on_copy(&stored).await;
                    debug!(worker_lease = %name, holds = named.len(), "worker lease renewed");
                    ours = Some(*stored);
                }
                Ok(Ok(Written::Refused { code, message })) => match plan::refusal(code) {
                    Refusal::Conflict => match timeout(budget, ops::read(&self.api, &name)).await {
                        Ok(Ok(Some(fresh))) if fresh.spec.holder_identity == self.identity => {
                            debug!(worker_lease = %name, "worker lease conflict: renewing on the fresh copy");
                            self.on_copy(&fresh).await;
                            if let Some(t) = fresh.spec.renew_time.as_ref() {
                                last_renew_time = last_renew_time.max(Some(t.0));
                            }
                            ours = Some(fresh);
                            retry_at = Some(Instant::now());
                        }
                        Ok(Ok(other)) => {
                            self.lost(sent, other.map(|w| w.spec.holder_identity));
                            ours = None;
                            retry_at = Some(Instant::now());
                        }
                        Ok(Err(e)) => {
                            warn!(worker_lease = %name, error = %batchlease_api::Chain(&e), "worker lease re-read failed; retrying");
                            retry_at = Some(Instant::now() + plan::retry_after(&held));
                        }
                        Err(_) => retry_at = Some(Instant::now()),
                    },
                    Refusal::Gone => {
                        self.lost(sent, None);
                        ours = None;
                        retry_at = Some(Instant::now());
                    }
                    Refusal::FallBack => {
                        let handed = self.fall_back();
                        error!(worker_lease = %name, code, %message, attempts = handed, retry_in = ?FALLBACK_RETRY,
                            "worker lease renewal refused (RBAC or admission changed?): its attempts are renewed per lease from now on");
                        fallback = true;
                        retry_at = Some(Instant::now() + FALLBACK_RETRY);
                    }
                    Refusal::Retry => {
                        warn!(worker_lease = %name, code, %message, "worker lease renewal failed; retrying");
                        retry_at = Some(Instant::now() + plan::retry_after(&held));
                    }
                },
                Ok(Err(e)) => {
                    warn!(worker_lease = %name, error = %batchlease_api::Chain(&e), "worker lease renewal failed; retrying");
                    retry_at = Some(Instant::now() + plan::retry_after(&held));
                }
                Err(_) => {
                    warn!(worker_lease = %name, budget = ?budget, "worker lease renewal timed out; retrying afresh");
                    retry_at = Some(Instant::now());
                }
            }
        }
        self.leases.lock().live = false;
        if ours.is_some() {
            let deleted = timeout(DELETE_BUDGET, ops::delete(&self.api, &name)).await;
            debug!(worker_lease = %name, ok = matches!(deleted, Ok(Ok(()))), "worker lease deleted");
        }
    }

    /// The attempts a renewal keeps alive, as `plan` sees them.
    fn held(&self) -> Vec<Held> {
        self.named().into_iter().map(|n| n.held).collect()
    }

    /// The registered attempts still named, sorted (stable holds).
    fn named(&self) -> Vec<Named> {
        let s = self.leases.lock();
        let mut named: Vec<Named> = s
            .entries
            .iter()
            .filter(|(_, e)| e.state == EntryState::Named)
            .map(|(a, e)| Named {
                attempt: a.clone(),
                held: Held {
                    ttl: e.fence.ttl(),
                    since: e.since,
                },
                fence: e.fence.clone(),
            })
            .collect();
        named.sort_by(|a, b| a.attempt.cmp(&b.attempt));
        named
    }

    /// A renewal sent at `sent` that named `named` was answered at
    /// `answered`: feed each one's kill clock it may feed.
    fn fed(&self, named: &[Named], sent: Instant, answered: Instant) {
        let mut s = self.leases.lock();
        for n in named {
            if !plan::feeds(sent, answered, n.held.ttl) {
                continue;
            }
            n.fence.renewed(sent);
            if let Some(e) = s.entries.get_mut(&n.attempt) {
                e.since = e.since.max(sent);
            }
        }
    }

    /// Kills every registered attempt the copy `w` shows revoked, each
    /// with the reason its TaskLease gives (read once, bounded).
    async fn on_copy(&self, w: &WorkerLease) {
        let doomed: Vec<(AttemptRef, Fence)> = {
            let mut s = self.leases.lock();
            s.entries
                .iter_mut()
                .filter(|(a, e)| {
                    plan::on_copy(a, e.state != EntryState::Killed, w.revoked()) == OnCopy::Kill
                })
                .map(|(a, e)| {
                    e.state = EntryState::Killed;
                    (a.clone(), e.fence.clone())
                })
                .collect()
        };
        let reasons =
            futures::future::join_all(doomed.iter().map(|(a, _)| self.revoked_reason(a))).await;
        for ((attempt, fence), reason) in doomed.into_iter().zip(reasons) {
            warn!(lease = %attempt.name, uid = %attempt.uid, reason = reason.as_str(), "attempt revoked by the operator: stopping it");
            fence.kill(reason);
        }
    }

    async fn revoked_reason(&self, attempt: &AttemptRef) -> KillReason {
        match timeout(REASON_READ_BUDGET, self.task_leases.get_opt(&attempt.name)).await {
            Ok(Ok(Some(l)))
                if AttemptRef::of(&l) == *attempt && lease_ops::released_by_cancel(&l) =>
            {
                KillReason::Cancelled
            }
            _ => KillReason::LeaseLost,
        }
    }

    /// The WorkerLease is gone (or was replaced by another holder's):
    /// every attempt it kept alive is killed; it is created afresh with
    /// nothing held.
    fn lost(&self, sent: Instant, foreign: Option<String>) {
        let mut s = self.leases.lock();
        s.live = false;
        s.lost_at = Some(sent);
        let mut killed = 0usize;
        for e in s.entries.values_mut() {
            if e.state == EntryState::Named {
                e.state = EntryState::Killed;
                e.fence.kill(KillReason::LeaseLost);
                killed += 1;
            }
        }
        drop(s);
        warn!(identity = %self.identity, killed, foreign_holder = ?foreign, "worker lease gone: its attempts were stopped; creating it again");
    }

    /// Hands every named attempt to per-lease renewals; how many.
    fn fall_back(&self) -> usize {
        let mut s = self.leases.lock();
        s.live = false;
        let mut handed = 0usize;
        for e in s.entries.values_mut() {
            if e.state == EntryState::Named {
                e.state = EntryState::PerLease;
                e.fence.renew_per_lease();
                e.mode.send_replace(Mode::PerLease);
                handed += 1;
            }
        }
        handed
    }
}

/// A named attempt as one renewal saw it.
struct Named {
    attempt: AttemptRef,
    held: Held,
    fence: Fence,
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::fence::KillClock;

    fn renewer(leases: &WorkerLeases) -> Renewer {
        let config = kube::Config::new("http://127.0.0.1:1".parse().unwrap());
        let client = kube::Client::try_from(config).unwrap();
        Renewer {
            api: Api::namespaced(client.clone(), "ns"),
            task_leases: Api::namespaced(client, "ns"),
            identity: "pod-1/00beef".into(),
            queues: vec!["q".into()],
            leases: leases.clone(),
        }
    }

    fn attempt(name: &str) -> AttemptRef {
        AttemptRef {
            name: name.into(),
            uid: format!("uid-{name}"),
        }
    }

    fn fence(ttl: u64, at: Instant) -> Fence {
        Fence::new(
            1,
            KillClock::new(Duration::from_secs(ttl), at, None).per_worker(),
        )
    }

    /// A renewal answered within T/6 feeds only the attempts it named;
    /// a slower answer feeds only those whose T/6 it met.
    #[tokio::test(start_paused = true)]
    async fn a_renewal_feeds_what_it_named_in_time() {
        let leases = WorkerLeases::default();
        leases.lock().live = true;
        let r = renewer(&leases);
        let t0 = Instant::now();
        let (short, long) = (fence(30, t0), fence(300, t0));
        let _a = leases.register(attempt("a"), short.clone(), t0);
        let _b = leases.register(attempt("b"), long.clone(), t0);
        let named = r.named();
        assert_eq!(named.len(), 2);
        let late = fence(30, t0);
        let _c = leases.register(attempt("c"), late.clone(), t0);
        let sent = t0 + Duration::from_secs(10);
        // Answered 6 s after its send: past 30/6, within 300/6.
        r.fed(&named, sent, sent + Duration::from_secs(6));
        assert_eq!(short.clock().kill_at().0, t0 + Duration::from_secs(20));
        assert_eq!(long.clock().kill_at().0, sent + Duration::from_secs(200));
        assert_eq!(
            late.clock().kill_at().0,
            t0 + Duration::from_secs(20),
            "not named"
        );
        r.fed(&named, sent, sent + Duration::from_secs(1));
        assert_eq!(short.clock().kill_at().0, sent + Duration::from_secs(20));
        assert_eq!(leases.lock().entries[&attempt("a")].since, sent);
    }

    /// 403/422: every named attempt goes back to per-lease renewals and is
    /// never named again; 404: every named attempt is killed.
    #[tokio::test(start_paused = true)]
    async fn refusals_hand_back_or_kill_what_was_named() {
        let leases = WorkerLeases::default();
        leases.lock().live = true;
        let r = renewer(&leases);
        let t0 = Instant::now();
        let (a, b) = (fence(30, t0), fence(30, t0));
        let mut ma = leases.register(attempt("a"), a.clone(), t0);
        assert_eq!(r.fall_back(), 1);
        assert_eq!(ma.mode(), Mode::PerLease);
        ma.changed().await;
        assert!(!a.clock().is_per_worker());
        assert!(r.named().is_empty(), "never named again");
        assert!(!leases.claims_per_worker());

        leases.lock().live = true;
        let _mb = leases.register(attempt("b"), b.clone(), t0);
        r.lost(t0 + Duration::from_secs(3), None);
        assert_eq!(b.kill_reason(), Some(KillReason::LeaseLost));
        assert_eq!(
            a.kill_reason(),
            None,
            "renewed per lease: not the WorkerLease's"
        );
        assert!(r.named().is_empty());
        assert_eq!(leases.lock().lost_at, Some(t0 + Duration::from_secs(3)));
    }

    /// A copy showing an attempt revoked kills it (its TaskLease cannot be
    /// read here: `LeaseLost`) and it is never named again; others go on.
    #[tokio::test]
    async fn a_revoked_attempt_is_killed_and_never_named_again() {
        let leases = WorkerLeases::default();
        leases.lock().live = true;
        let r = renewer(&leases);
        let t0 = Instant::now();
        let (a, b) = (fence(30, t0), fence(30, t0));
        let _ma = leases.register(attempt("a"), a.clone(), t0);
        let _mb = leases.register(attempt("b"), b.clone(), t0);
        let mut copy = ops::object("pod-1/00beef", &[], None, Timestamp::now());
        copy.revoke(attempt("a"));
        r.on_copy(&copy).await;
        assert_eq!(a.kill_reason(), Some(KillReason::LeaseLost));
        assert_eq!(b.kill_reason(), None);
        let named: Vec<AttemptRef> = r.named().into_iter().map(|n| n.attempt).collect();
        assert_eq!(named, [attempt("b")]);
    }
}
