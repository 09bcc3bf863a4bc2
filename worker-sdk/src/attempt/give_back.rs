//! The give-back after the kill switch: when a killed attempt may be handed
//! back (not before it has surely stopped), and how hard to try.

use std::time::Duration;

use batchlease_api::{LeasePhase, TaskLease};
use kube::ResourceExt;
use kube::api::Api;
use tokio::time::{Instant, timeout};
use tracing::{debug, info, warn};

use super::completion::{given_back, outcome_label};
use crate::error::Error;
use crate::fence::KillReason;
use crate::lease_ops;

/// After the kill switch: complete the lease (from our last copy, so only a
/// lease nobody else wrote since matches) as `completion::given_back` says
/// — `Interrupted`, or `Failed` when the attempt ran out of its deadline.
/// Each try is bounded; a lease that moved on refuses the CAS (a 4xx),
/// harmlessly.
///
/// One try, but after a lost WorkerLease: then nothing else would ever end
/// the attempt — the operator credits every renewal of the worker's next
/// WorkerLease (a new object, which never names it) to a lease still Held
/// by the worker — so a try that failed for want of an answer (an API
/// server away, a timeout) is made again, backing off to
/// [`GIVE_BACK_RETRY_MAX`], until it lands or the lease has moved on.
pub(super) async fn give_back(api: &Api<TaskLease>, lease: &TaskLease, reason: KillReason) {
    let Some(c) = given_back(reason) else {
        return;
    };
    let name = lease.name_any();
    let persist = reason == KillReason::WorkerLeaseLost;
    let mut copy = lease.clone();
    let mut pause = GIVE_BACK_RETRY_MIN;
    loop {
        let why = match timeout(GIVE_BACK_BUDGET, lease_ops::complete_once(api, &copy, &c)).await {
            Ok(Ok(())) => {
                info!(lease = %name, reason = reason.as_str(), outcome = outcome_label(c.outcome), "lease given back after the kill switch");
                return;
            }
            Ok(Err(e @ Error::Rejected { .. })) => {
                let code = match &e {
                    Error::Rejected {
                        source: kube::Error::Api(s),
                        ..
                    } => s.code,
                    _ => 0,
                };
                match (persist, code) {
                    // Too many requests: no answer about the lease.
                    (true, 429) => e.to_string(),
                    // Someone wrote it since our copy: still ours (Held by
                    // us, same object) — a label, an annotation — or not.
                    (true, 409) => match timeout(GIVE_BACK_BUDGET, api.get_opt(&name)).await {
                        Ok(Ok(Some(fresh))) if still_ours(&copy, &fresh) => {
                            copy = fresh;
                            e.to_string()
                        }
                        Ok(Ok(_)) => {
                            debug!(lease = %name, reason = reason.as_str(), "lease not given back (it moved on)");
                            return;
                        }
                        Ok(Err(read)) => read.to_string(),
                        Err(_) => "re-read timed out".to_owned(),
                    },
                    _ => {
                        debug!(lease = %name, reason = reason.as_str(), error = %e, "lease not given back (it moved on)");
                        return;
                    }
                }
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => "timed out".to_owned(),
        };
        if !persist {
            debug!(lease = %name, reason = reason.as_str(), error = %why, "lease not given back");
            return;
        }
        warn!(lease = %name, reason = reason.as_str(), error = %why, retry_in = ?pause, "giving the lease back failed: trying again (nothing else ends it)");
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(GIVE_BACK_RETRY_MAX);
    }
}

/// Pure: whether `fresh` (read after a conflict) is still the lease `ours`
/// gave back: the same object, Held by the same holder under the same
/// token. Anything else moved on, and is not ours to end.
fn still_ours(ours: &TaskLease, fresh: &TaskLease) -> bool {
    fresh.uid() == ours.uid()
        && fresh.spec.holder_identity == ours.spec.holder_identity
        && fresh.spec.fencing_token == ours.spec.fencing_token
        && fresh.status.as_ref().and_then(|s| s.phase) == Some(LeasePhase::Held)
}

/// The first and the longest pause between tries of a give-back that must
/// land (see [`give_back`]).
const GIVE_BACK_RETRY_MIN: Duration = Duration::from_millis(500);
const GIVE_BACK_RETRY_MAX: Duration = Duration::from_secs(30);

/// Pure: the earliest instant an attempt killed at `killed_at` may be
/// given back. The operator acts on a give-back at once — releases the
/// task's resource locks, writes Cancelled, offers the task again — so it
/// must not come before the attempt has surely stopped:
///
/// - its storage deadline has passed: the deadline recorded in storage is
///   never past the kill instant of the attempt's clock (the extender
///   records that instant and stops at the kill), and an early kill (a
///   revocation, a lost WorkerLease) leaves it ahead; after it every
///   `batchlease_fence` transaction of the attempt is refused;
/// - and its work has had `stop_budget` since the kill to stop, at most a
///   third of the TTL: `batchlease-run` SIGKILLs the command's process
///   group after its kill grace (at most TTL/3 − 0.5 s), a Python
///   handler's process group goes within 50 ms. (A Python thread or a
///   Rust `spawn_blocking` cannot be stopped at all: the storage deadline
///   is what refuses their writes.)
///
/// A kill by the clock itself (no renewal for 2/3·TTL) is at or past the
/// kill instant: given back after the stop budget alone, still before the
/// operator would expire the lease (a TTL after the last renewal it saw),
/// so it still spends no retry.
pub(super) fn give_back_at(
    clock: &crate::fence::KillClock,
    killed_at: Instant,
    stop_budget: Duration,
) -> Instant {
    let budget = stop_budget.min(clock.ttl() / 3);
    clock.kill_at().0.max(killed_at + budget)
}

/// Pure: the earliest instant an attempt stopped by a drain at `stopped`
/// may be given back: its stop budget later, at most TTL/3 (as after a
/// kill). Its lease is still ours and renewed until then, so no kill
/// instant bounds it; the budget is the time the handler's work may
/// outlive the handler (a runner child in its SIGTERM grace).
pub(super) fn drained_give_back_at(
    stopped: Instant,
    ttl: Duration,
    stop_budget: Duration,
) -> Instant {
    stopped + stop_budget.min(ttl / 3)
}

/// How long a give-back may take.
const GIVE_BACK_BUDGET: Duration = Duration::from_secs(2);

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::fence::KillClock;
    use batchlease_api::TaskLeaseSpec;

    fn held_lease() -> TaskLease {
        let mut l = TaskLease::new("t-1", TaskLeaseSpec::offered("t", "u", "q", 1, 30));
        l.spec.holder_identity = Some("me".into());
        l
    }

    /// A conflict during a lost WorkerLease's give-back is tried again only
    /// while the lease is still ours, as it was (a label written since).
    #[test]
    fn a_conflicting_give_back_is_tried_again_only_on_a_lease_still_ours() {
        let mut ours = held_lease();
        ours.metadata.uid = Some("u-1".into());
        ours.status = Some(batchlease_api::TaskLeaseStatus {
            phase: Some(LeasePhase::Held),
            ..Default::default()
        });
        let mut labelled = ours.clone();
        labelled.metadata.labels = Some([("x".to_owned(), "y".to_owned())].into());
        assert!(still_ours(&ours, &labelled));
        let mut expired = ours.clone();
        expired.status.as_mut().unwrap().phase = Some(LeasePhase::Expired);
        let mut other = ours.clone();
        other.metadata.uid = Some("u-2".into());
        let mut next = ours.clone();
        next.spec.fencing_token += 1;
        let mut claimed = ours.clone();
        claimed.spec.holder_identity = Some("them".into());
        for (why, fresh) in [
            ("expired", expired),
            ("another object", other),
            ("the next token", next),
            ("another holder", claimed),
        ] {
            assert!(!still_ours(&ours, &fresh), "{why}");
        }
    }

    #[test]
    fn when_a_killed_attempt_may_be_given_back() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let clock = KillClock::new(s(30), t0, None);
        // (killed at, stop budget, given back at), from the claim at 0.
        for (killed, budget, want) in [
            // Killed by its own clock at 20 s: the work's stop budget.
            (20, 0, 20),
            (20, 5, 25),
            // Capped at TTL/3: before the operator's expiry at 30 s.
            (20, 60, 30),
            // Revoked early: the storage deadline (at most the clock's
            // kill instant, 20 s) comes later than the stop budget.
            (5, 5, 20),
            (5, 0, 20),
            // Revoked close to the kill instant: the budget.
            (18, 5, 23),
            // A late notice of a kill: from when it was noticed.
            (50, 5, 55),
        ] {
            assert_eq!(
                give_back_at(&clock, t0 + s(killed), s(budget)),
                t0 + s(want),
                "killed at {killed} s, budget {budget} s"
            );
        }
    }

    #[test]
    fn when_a_drained_attempt_may_be_given_back() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        // (TTL, stop budget, given back after the stop).
        for (ttl, budget, want) in [(30, 0, 0), (30, 5, 5), (30, 60, 10), (6, 5, 2)] {
            assert_eq!(
                drained_give_back_at(t0, s(ttl), s(budget)),
                t0 + s(want),
                "TTL {ttl} s, budget {budget} s"
            );
        }
    }
}
