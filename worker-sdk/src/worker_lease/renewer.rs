//! The WorkerLease's renewal loop, on the heartbeat runtime with its
//! client (a handler that blocks its thread must not starve it). It
//! performs what `plan` decides; see the module above for what attempts
//! are told.

use std::time::Duration;

use batchlease_api::worker_lease::worker_lease_name;
use batchlease_api::{AttemptRef, WorkerLease};
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use tokio::time::{Instant, sleep_until, timeout};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use super::plan::{self, Held, OnCopy, Refusal};
use super::{Confirmation, EntryState, Mode, WorkerLeases};
use crate::fence::{Fence, KillReason};
use crate::worker_lease_ops::{self as ops, Adopted, Written};

/// How often the WorkerLease is tried again while it cannot be created or
/// is refused (403, 422, a foreign holder): slowly, as nothing depends on
/// it meanwhile (attempts renew per lease).
pub(crate) const FALLBACK_RETRY: Duration = Duration::from_secs(30);

/// Bound on the delete when the worker stops (as the presence record's).
const DELETE_BUDGET: Duration = Duration::from_secs(2);

/// The renewal loop of one worker's WorkerLease.
pub(crate) struct Renewer {
    pub(crate) api: Api<WorkerLease>,
    pub(crate) identity: String,
    pub(crate) queues: Vec<String>,
    /// Its slots, when it takes addressed offers (`WorkerLeaseSpec::slots`):
    /// written as 0 once it stops claiming, so nothing more is addressed
    /// to it while it drains.
    pub(crate) slots: Option<i32>,
    /// It takes bound attempts (`WorkerLeaseSpec::takes_bound`).
    pub(crate) takes_bound: bool,
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
                // Draining: say so (slots 0) at once.
                () = stop.cancelled(), if !stop.is_cancelled() => {
                    retry_at = Some(Instant::now());
                    continue;
                }
                () = self.leases.shared.wake.notified() => continue,
                () = sleep_until(due) => {}
            }
            retry_at = None;
            let Some(current) = ours.as_ref() else {
                let renew_time = plan::next_renew_time(last_renew_time, Timestamp::now());
                last_renew_time = Some(renew_time);
                let sent = Instant::now();
                self.leases.record_sent(renew_time, sent);
                let desired = ops::object(
                    &self.identity,
                    &self.queues,
                    plan::slots(
                        self.slots,
                        stop.is_cancelled() || self.leases.claims_paused(),
                    ),
                    self.takes_bound,
                    ops::pod_owner(),
                    renew_time,
                );
                match timeout(
                    plan::try_budget(&[]),
                    ops::create_or_adopt(&self.api, &desired),
                )
                .await
                {
                    Ok(Ok(Adopted::Ours(w))) => {
                        info!(worker_lease = %name, identity = %self.identity, "worker lease ready: attempts are renewed per worker");
                        last_renew_time =
                            last_renew_time.max(w.spec.renew_time.as_ref().map(|t| t.0));
                        last_ok_sent = sent;
                        // An adopted object may carry revocations.
                        self.revoke(&w);
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
            // One renewal. Revocations first: an attempt the copy this CAS
            // is based on shows revoked is never named (nor fed), even one
            // registered after that copy was read — the CAS would land on
            // a version the operator has already revoked it in.
            self.revoke(current);
            let named = self.named();
            let held: Vec<Held> = named.iter().map(|n| n.held).collect();
            let holds: Vec<AttemptRef> = named.iter().map(|n| n.attempt.clone()).collect();
            let duration = plan::lease_duration_seconds(held.iter().map(|h| h.ttl));
            let renew_time = plan::next_renew_time(last_renew_time, Timestamp::now());
            // Whether or not it lands, never write it again.
            last_renew_time = Some(renew_time);
            let budget = plan::try_budget(&held);
            let sent = Instant::now();
            self.leases.record_sent(renew_time, sent);
            let written = timeout(
                budget,
                ops::renew(
                    &self.api,
                    current,
                    holds,
                    duration,
                    plan::slots(
                        self.slots,
                        stop.is_cancelled() || self.leases.claims_paused(),
                    ),
                    renew_time,
                ),
            )
            .await;
            match written {
                Ok(Ok(Written::Stored(stored))) => {
                    let answered = Instant::now();
                    // Never feed what the answer shows revoked.
                    self.revoke(&stored);
                    self.fed(&named, sent, answered);
                    last_ok_sent = sent;
                    if fallback {
                        info!(worker_lease = %name, "worker lease renewed again: new claims are renewed per worker");
                        fallback = false;
                    }
                    self.leases.lock().live = true;
                    debug!(worker_lease = %name, holds = named.len(), "worker lease renewed");
                    ours = Some(*stored);
                }
                Ok(Ok(Written::Refused { code, message })) => match plan::refusal(code) {
                    Refusal::Conflict => match timeout(budget, ops::read(&self.api, &name)).await {
                        Ok(Ok(fresh)) => match plan::reread(current, &self.identity, fresh) {
                            Ok(fresh) => {
                                debug!(worker_lease = %name, "worker lease conflict: renewing on the fresh copy");
                                self.revoke(&fresh);
                                if let Some(t) = fresh.spec.renew_time.as_ref() {
                                    last_renew_time = last_renew_time.max(Some(t.0));
                                }
                                ours = Some(fresh);
                                retry_at = Some(Instant::now());
                            }
                            Err(why) => {
                                self.lost(sent, why);
                                ours = None;
                                retry_at = Some(Instant::now());
                            }
                        },
                        Ok(Err(e)) => {
                            warn!(worker_lease = %name, error = %batchlease_api::Chain(&e), "worker lease re-read failed; retrying");
                            retry_at = Some(Instant::now() + plan::retry_after(&held));
                        }
                        Err(_) => retry_at = Some(Instant::now()),
                    },
                    Refusal::Gone => {
                        self.lost(sent, "deleted");
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

    /// The registered attempts still named, and the bound attempts waiting
    /// for a renewal naming them, sorted (stable holds). One still waiting
    /// makes the next renewal due at once.
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
                fence: Some(e.fence.clone()),
            })
            .collect();
        named.extend(s.pending.iter().filter_map(|(a, p)| {
            let since = match (p.confirmation, p.tried) {
                (Confirmation::Waiting, None) => p.since.checked_sub(p.ttl / 3).unwrap_or(p.since),
                (Confirmation::Waiting, Some(tried)) => tried,
                (Confirmation::Fed(sent), _) => sent,
                (Confirmation::Revoked | Confirmation::Lost, _) => return None,
            };
            Some(Named {
                attempt: a.clone(),
                held: Held { ttl: p.ttl, since },
                fence: None,
            })
        }));
        named.sort_by(|a, b| a.attempt.cmp(&b.attempt));
        named
    }

    /// A renewal sent at `sent` that named `named` was answered at
    /// `answered`: feed each one's kill clock it may feed — only while the
    /// renewer still names it. One killed meanwhile (revoked in the stored
    /// answer, which [`Renewer::revoke`] applies first, or its WorkerLease
    /// lost) is fed nothing: a dead fence stays dead, but its `since` must
    /// not move, nor a clock be fed past a revocation the worker has seen.
    fn fed(&self, named: &[Named], sent: Instant, answered: Instant) {
        let mut s = self.leases.lock();
        let mut confirmed = false;
        for n in named.iter().filter(|n| n.fence.is_none()) {
            // A waiting bound attempt: confirmed, unless it ended meanwhile.
            let Some(p) = s.pending.get_mut(&n.attempt) else {
                continue;
            };
            p.tried = Some(sent);
            if matches!(p.confirmation, Confirmation::Waiting | Confirmation::Fed(_))
                && plan::feeds(sent, answered, n.held.ttl)
            {
                p.confirmation = Confirmation::Fed(sent);
                confirmed = true;
            }
        }
        if confirmed {
            self.leases.shared.confirmed.notify_one();
        }
        for n in named {
            let Some(fence) = n.fence.as_ref() else {
                continue;
            };
            let Some(e) = s
                .entries
                .get_mut(&n.attempt)
                .filter(|e| e.state == EntryState::Named)
            else {
                continue;
            };
            if !plan::feeds(sent, answered, n.held.ttl) {
                continue;
            }
            fence.renewed(sent);
            e.since = e.since.max(sent);
        }
    }

    /// Applies the revocations of the copy `w`: every registered attempt it
    /// shows revoked is killed now and never named again, and they are
    /// remembered so that one registering later is killed at its
    /// registration. No read, no await: the fence refuses (and the
    /// handler's token fires) before this returns. The operator's cause
    /// (an expiry, a cancel, …) is not looked up — a bounded read of each
    /// TaskLease used to run first, holding off both the kill and the next
    /// renewal of every other attempt; the give-back after the kill (a CAS
    /// on the attempt's last copy) settles whether the lease was still
    /// ours, the only question the cause answered.
    fn revoke(&self, w: &WorkerLease) {
        let revoked = w.revoked();
        let mut s = self.leases.lock();
        if s.revoked.as_slice() != revoked {
            s.revoked = revoked.to_vec();
        }
        let mut killed = Vec::new();
        for (a, e) in &mut s.entries {
            if plan::on_copy(a, e.state != EntryState::Killed, revoked) == OnCopy::Kill {
                e.state = EntryState::Killed;
                e.fence.kill(KillReason::Revoked);
                killed.push(a.clone());
            }
        }
        let ended = end_pending(&mut s, Confirmation::Revoked, |a| revoked.contains(a));
        drop(s);
        if ended {
            self.leases.shared.confirmed.notify_one();
        }
        for a in killed {
            warn!(lease = %a.name, uid = %a.uid, reason = KillReason::Revoked.as_str(), "attempt revoked by the operator: stopping it");
        }
    }

    /// The WorkerLease is gone — deleted, another holder's, or created
    /// again as another object (`why`): every attempt it kept alive is
    /// killed (and gives its lease back: it may still be held by us, and
    /// the operator would credit it with every renewal of the next
    /// object), never to be named in the object created afresh, which
    /// holds nothing.
    fn lost(&self, sent: Instant, why: &'static str) {
        let mut s = self.leases.lock();
        s.live = false;
        s.lost_at = Some(sent);
        // The revocations went with the old object.
        s.revoked.clear();
        let mut killed = 0usize;
        for e in s.entries.values_mut() {
            if e.state == EntryState::Named {
                e.state = EntryState::Killed;
                e.fence.kill(KillReason::WorkerLeaseLost);
                killed += 1;
            }
        }
        if end_pending(&mut s, Confirmation::Lost, |_| true) {
            self.leases.shared.confirmed.notify_one();
        }
        drop(s);
        warn!(identity = %self.identity, killed, why, reason = KillReason::WorkerLeaseLost.as_str(), "worker lease gone: its attempts were stopped; creating it again");
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
        // A bound attempt not started cannot be confirmed any more.
        if end_pending(&mut s, Confirmation::Lost, |_| true) {
            self.leases.shared.confirmed.notify_one();
        }
        handed
    }
}

/// A named attempt as one renewal saw it.
struct Named {
    attempt: AttemptRef,
    held: Held,
    /// `None`: a bound attempt waiting for a renewal naming it.
    fence: Option<Fence>,
}

/// Ends (as `to`) every bound attempt still waiting or confirmed that
/// `which` selects; whether any was.
fn end_pending(
    s: &mut super::State,
    to: Confirmation,
    which: impl Fn(&AttemptRef) -> bool,
) -> bool {
    let mut any = false;
    for (a, p) in &mut s.pending {
        if matches!(p.confirmation, Confirmation::Waiting | Confirmation::Fed(_)) && which(a) {
            p.confirmation = to;
            any = true;
        }
    }
    any
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
            api: Api::namespaced(client, "ns"),
            identity: "pod-1/00beef".into(),
            queues: vec!["q".into()],
            slots: Some(2),
            takes_bound: true,
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

    /// A bound attempt waiting for a renewal is named at once (the next
    /// renewal is due now), confirmed only by an answer in time, never by
    /// a renewal that did not name it, and taken over by its registration
    /// without a gap in the naming.
    #[tokio::test(start_paused = true)]
    async fn a_waiting_bound_attempt_is_named_at_once_and_confirmed_in_time() {
        let leases = WorkerLeases::default();
        leases.lock().live = true;
        let r = renewer(&leases);
        let t0 = Instant::now();
        let before = r.named();
        assert_eq!(
            leases.confirm(&attempt("b"), Duration::from_secs(30)),
            Confirmation::Waiting
        );
        // A renewal sent before it waited does not name it.
        r.fed(&before, t0, t0);
        assert_eq!(
            leases.confirmation(&attempt("b")),
            Some(Confirmation::Waiting)
        );
        let named = r.named();
        assert_eq!(named.len(), 1);
        assert!(
            plan::next_renewal(t0, &r.held()) <= t0,
            "a waiting attempt makes the renewal due at once"
        );
        let sent = t0 + Duration::from_millis(100);
        r.fed(&named, sent, sent + Duration::from_secs(6));
        assert_eq!(
            leases.confirmation(&attempt("b")),
            Some(Confirmation::Waiting),
            "answered past T/6"
        );
        assert_eq!(
            plan::next_renewal(sent, &r.held()),
            sent + Duration::from_secs(10),
            "then at the usual pace"
        );
        r.fed(&named, sent, sent + Duration::from_secs(1));
        assert_eq!(
            leases.confirmation(&attempt("b")),
            Some(Confirmation::Fed(sent))
        );
        // Still named until it starts; then its entry is the one named.
        assert_eq!(r.named().len(), 1);
        let _m = leases.register(attempt("b"), fence(30, sent), sent);
        assert_eq!(leases.confirmation(&attempt("b")), None);
        let named = r.named();
        assert_eq!(named.len(), 1);
        assert!(named[0].fence.is_some(), "named as a running attempt now");
    }

    /// A waiting bound attempt the operator revoked, or whose WorkerLease
    /// went, is never confirmed; one dropped is named no more.
    #[tokio::test(start_paused = true)]
    async fn a_waiting_bound_attempt_revoked_or_lost_is_never_confirmed() {
        let leases = WorkerLeases::default();
        leases.lock().live = true;
        let r = renewer(&leases);
        let ttl = Duration::from_secs(30);
        leases.confirm(&attempt("a"), ttl);
        leases.confirm(&attempt("b"), ttl);
        leases.confirm(&attempt("c"), ttl);
        let mut copy = ops::object("pod-1/00beef", &[], None, false, None, Timestamp::now());
        copy.status = Some(batchlease_api::WorkerLeaseStatus {
            revoked: vec![attempt("a")],
        });
        r.revoke(&copy);
        assert_eq!(
            leases.confirmation(&attempt("a")),
            Some(Confirmation::Revoked)
        );
        leases.drop_pending(&attempt("c"));
        assert_eq!(r.named().len(), 1, "only b is named");
        r.lost(Instant::now(), "deleted");
        assert_eq!(leases.confirmation(&attempt("b")), Some(Confirmation::Lost));
        assert!(r.named().is_empty());
        // Revoked before it began to wait: revoked at once.
        leases.lock().live = true;
        leases.lock().revoked = vec![attempt("d")];
        assert_eq!(leases.confirm(&attempt("d"), ttl), Confirmation::Revoked);
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
        r.lost(t0 + Duration::from_secs(3), "deleted");
        assert_eq!(b.kill_reason(), Some(KillReason::WorkerLeaseLost));
        assert_eq!(
            a.kill_reason(),
            None,
            "renewed per lease: not the WorkerLease's"
        );
        assert!(r.named().is_empty());
        assert_eq!(leases.lock().lost_at, Some(t0 + Duration::from_secs(3)));
    }

    /// A copy showing an attempt revoked kills it at once, without any
    /// read (`Revoked`), and it is never named or fed again; others go on.
    #[tokio::test(start_paused = true)]
    async fn a_revoked_attempt_is_killed_at_once_and_never_named_again() {
        let leases = WorkerLeases::default();
        leases.lock().live = true;
        let r = renewer(&leases);
        let t0 = Instant::now();
        let (a, b) = (fence(30, t0), fence(30, t0));
        let _ma = leases.register(attempt("a"), a.clone(), t0);
        let _mb = leases.register(attempt("b"), b.clone(), t0);
        let named = r.named();
        let mut copy = ops::object("pod-1/00beef", &[], None, false, None, Timestamp::now());
        copy.revoke(attempt("a"));
        r.revoke(&copy);
        assert_eq!(a.kill_reason(), Some(KillReason::Revoked));
        assert!(a.check().is_err(), "the fence refuses at once");
        assert_eq!(b.kill_reason(), None);
        let names: Vec<AttemptRef> = r.named().into_iter().map(|n| n.attempt).collect();
        assert_eq!(names, [attempt("b")]);
        // A renewal that named both, answered in time after the copy
        // showed `a` revoked, feeds only `b`.
        let sent = t0 + Duration::from_secs(10);
        r.fed(&named, sent, sent);
        assert_eq!(leases.lock().entries[&attempt("a")].since, t0);
        assert_eq!(leases.lock().entries[&attempt("b")].since, sent);
        assert_eq!(b.clock().kill_at().0, sent + Duration::from_secs(20));
    }

    /// The reviewer's interleaving: a conflict's re-read already shows `c`
    /// revoked when `c` registers (its claim answered late). It is killed
    /// at registration, and a copy applied again before the next renewal
    /// builds its holds kills what slipped through; nothing revoked is
    /// ever named.
    #[tokio::test(start_paused = true)]
    async fn an_attempt_revoked_before_it_registers_is_never_named() {
        let leases = WorkerLeases::default();
        leases.lock().live = true;
        let r = renewer(&leases);
        let t0 = Instant::now();
        let mut fresh = ops::object("pod-1/00beef", &[], None, false, None, Timestamp::now());
        fresh.revoke(attempt("c"));
        r.revoke(&fresh);
        let c = fence(30, t0);
        let _mc = leases.register(attempt("c"), c.clone(), t0);
        assert_eq!(c.kill_reason(), Some(KillReason::Revoked));
        assert!(r.named().is_empty());
        // Registered before the revocation was seen, named, then the copy
        // the next renewal is based on shows it revoked.
        let d = fence(30, t0);
        let _md = leases.register(attempt("d"), d.clone(), t0);
        assert_eq!(r.named().len(), 1);
        fresh.revoke(attempt("d"));
        r.revoke(&fresh);
        assert!(r.named().is_empty());
        assert_eq!(d.kill_reason(), Some(KillReason::Revoked));
        // A lost WorkerLease forgets the old object's revocations (the
        // recreated one has its own) but kills what the old one named.
        let e = fence(30, t0);
        let _me = leases.register(attempt("e"), e.clone(), t0);
        r.lost(
            t0 + Duration::from_secs(1),
            "re-created (another metadata.uid)",
        );
        assert_eq!(e.kill_reason(), Some(KillReason::WorkerLeaseLost));
        assert!(leases.lock().revoked.is_empty());
    }
}
