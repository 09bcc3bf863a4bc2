//! The WorkerLease renewer's decisions, as pure functions of instants and
//! TTLs: when to renew, what a renewal says, whom it keeps alive, and what
//! a conflict's fresh copy means for the attempts. The loop (`renewer`)
//! only performs them, so every rule here is table-tested without an API
//! server.

use std::time::Duration;

use batchlease_api::{AttemptRef, WorkerLease};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use tokio::time::Instant;

/// How often an idle worker (holding nothing) renews its WorkerLease.
pub const IDLE_PERIOD: Duration = Duration::from_secs(30);

/// `leaseDurationSeconds` of a WorkerLease holding nothing.
pub const IDLE_DURATION_SECONDS: i32 = 90;

/// The CRD's bounds on `leaseDurationSeconds`.
const MIN_DURATION_SECONDS: i32 = 5;
const MAX_DURATION_SECONDS: i32 = 3600;

/// One attempt as the plan sees it: its TTL and when it was last kept
/// alive by a request it knows was sent (its claim, or the last renewal
/// that fed it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    pub ttl: Duration,
    pub since: Instant,
}

/// When the next renewal is due: `T_min/3` after the previous successful
/// renewal was sent (`T_min` the shortest TTL held; [`IDLE_PERIOD`] while
/// none), and no later than `T/3` after each attempt was last kept alive —
/// so a newly registered attempt brings it forward to `T/3` after its
/// claim was sent.
pub fn next_renewal(last_ok_sent: Instant, held: &[Held]) -> Instant {
    let period = period(held);
    held.iter()
        .map(|h| h.since + h.ttl / 3)
        .fold(last_ok_sent + period, Instant::min)
}

/// The shortest TTL held, if any.
pub fn shortest_ttl(held: &[Held]) -> Option<Duration> {
    held.iter().map(|h| h.ttl).min()
}

/// The renewal period: `T_min/3`, or [`IDLE_PERIOD`].
pub fn period(held: &[Held]) -> Duration {
    shortest_ttl(held).map_or(IDLE_PERIOD, |t| t / 3)
}

/// The budget of one try: `T_min/6` — the most a renewal's answer may take
/// and still feed the attempts — or `IDLE_PERIOD/6` while none is held.
/// A try over it is dropped with its connection and retried afresh.
pub fn try_budget(held: &[Held]) -> Duration {
    shortest_ttl(held).unwrap_or(IDLE_PERIOD) / 6
}

/// How soon a failed try (not a conflict) is retried: `period/4`, 0.1–1 s
/// (as the per-lease heartbeat retries).
pub fn retry_after(held: &[Held]) -> Duration {
    (period(held) / 4).clamp(Duration::from_millis(100), Duration::from_secs(1))
}

/// `leaseDurationSeconds`: the longest TTL held, or
/// [`IDLE_DURATION_SECONDS`]; always within the CRD's 5..=3600.
pub fn lease_duration_seconds(ttls: impl IntoIterator<Item = Duration>) -> i32 {
    ttls.into_iter()
        .max()
        .map_or(IDLE_DURATION_SECONDS, |t| {
            i32::try_from(t.as_secs()).unwrap_or(MAX_DURATION_SECONDS)
        })
        .clamp(MIN_DURATION_SECONDS, MAX_DURATION_SECONDS)
}

/// Pure: the slots to write — `slots` while the worker claims (at most
/// the CRD's 256 (`MAX_HOLDS`): a process lists no more attempts), 0 while it does not
/// (draining, or its claim brake engaged: nothing more is addressed to
/// it), nothing for a worker that takes no addressed offers.
pub fn slots(slots: Option<i32>, not_claiming: bool) -> Option<i32> {
    let max = i32::try_from(batchlease_api::worker_lease::MAX_HOLDS).unwrap_or(i32::MAX);
    slots.map(|n| if not_claiming { 0 } else { n.clamp(0, max) })
}

/// The `renewTime` to write: the wall clock, unless that is not strictly
/// after the last one written (the clock stepped back, or two renewals
/// within its resolution) — then the last one plus 1 µs. The operator
/// counts a renewal when it sees `renewTime` *change*: an equal one would
/// be a renewal it never credits.
pub fn next_renew_time(last: Option<Timestamp>, now: Timestamp) -> Timestamp {
    // MicroTime carries microseconds: compare at that resolution.
    let now = truncate_to_micros(now);
    match last {
        Some(last) if now <= last => last
            .checked_add(SignedDuration::from_micros(1))
            .unwrap_or(last),
        _ => now,
    }
}

fn truncate_to_micros(t: Timestamp) -> Timestamp {
    let micros = t.as_microsecond();
    Timestamp::from_microsecond(micros).unwrap_or(t)
}

/// Whether a successful renewal sent at `sent` and answered at `answered`
/// feeds the kill clock of an attempt of TTL `ttl` that it named: only if
/// answered within `ttl/6` of being sent. A slower answer proves only that
/// the write landed *some* time after `sent`, and the operator may have
/// expired the attempt meanwhile; the kill switch must not count on it.
pub fn feeds(sent: Instant, answered: Instant, ttl: Duration) -> bool {
    answered.saturating_duration_since(sent) <= ttl / 6
}

/// What to do with a registered attempt when a copy of the WorkerLease
/// (the one a renewal is about to be based on, its stored answer, a
/// conflict's re-read) shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnCopy {
    /// Not revoked: keep it as it is.
    Keep,
    /// Revoked by the operator: kill it at once, never name or feed it
    /// again.
    Kill,
    /// Already killed: nothing to do.
    Ignore,
}

/// The decision for `attempt` in a copy whose `status.revoked` is
/// `revoked`; `live` whether it is still running as far as the renewer
/// knows (named, or handed to per-lease renewals: a revocation is final
/// either way, as the operator ends what it revoked).
pub fn on_copy(attempt: &AttemptRef, live: bool, revoked: &[AttemptRef]) -> OnCopy {
    match (live, revoked.contains(attempt)) {
        (false, _) => OnCopy::Ignore,
        (true, true) => OnCopy::Kill,
        (true, false) => OnCopy::Keep,
    }
}

/// A conflict's re-read `fresh` of the copy `ours` that a renewal by
/// `identity` was based on: `Ok` with it when it is the same object,
/// written by someone else since (the operator revoking) — apply its
/// revocations and renew on it; `Err(why)` when the object that kept the
/// attempts alive is no more, as after a 404.
///
/// The same holder is not enough: a WorkerLease deleted and created again
/// under its name (another `metadata.uid`) carries none of the old one's
/// revocations, and the operator counts none of the old one's renewals
/// for it — renewing on it would name, and feed, attempts the operator
/// may already have ended. Without both UIDs nothing proves it the same
/// object: lost, which is always safe.
pub fn reread(
    ours: &WorkerLease,
    identity: &str,
    fresh: Option<WorkerLease>,
) -> Result<WorkerLease, &'static str> {
    let Some(fresh) = fresh else {
        return Err("deleted");
    };
    if fresh.spec.holder_identity != identity {
        return Err("taken by another holder");
    }
    match (ours.metadata.uid.as_deref(), fresh.metadata.uid.as_deref()) {
        (Some(a), Some(b)) if a == b => Ok(fresh),
        _ => Err("re-created (another metadata.uid)"),
    }
}

/// How a renewal refused by the API server is handled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// 409: someone (the operator revoking) wrote after our copy: re-read,
    /// kill what was revoked, renew at once on the fresh copy.
    Conflict,
    /// 404: the WorkerLease is gone with its revocations: kill every
    /// attempt it kept alive, create it afresh with nothing held.
    Gone,
    /// 403 or 422: RBAC or admission changed under us: hand every attempt
    /// to per-lease renewals, keep renewing the empty object slowly.
    FallBack,
    /// Anything else (5xx, 429, …): retry soon.
    Retry,
}

/// The handling of an API status code.
pub fn refusal(code: u16) -> Refusal {
    match code {
        409 => Refusal::Conflict,
        404 | 410 => Refusal::Gone,
        400 | 403 | 422 => Refusal::FallBack,
        _ => Refusal::Retry,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn s(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    #[test]
    fn slots_are_written_while_claiming_and_zero_while_draining() {
        assert_eq!(slots(None, false), None, "takes no addressed offers");
        assert_eq!(slots(None, true), None);
        assert_eq!(slots(Some(4), false), Some(4));
        assert_eq!(slots(Some(4), true), Some(0));
        assert_eq!(slots(Some(-1), false), Some(0));
        assert_eq!(slots(Some(5000), false), Some(256), "the CRD's maximum");
    }

    #[test]
    fn next_renewal_table() {
        let t0 = Instant::now();
        let held = |ttl: u64, since: u64| Held {
            ttl: s(ttl),
            since: t0 + s(since),
        };
        // (last ok sent, held, expected offset)
        let cases: [(u64, Vec<Held>, u64); 6] = [
            (0, vec![], 30),
            (100, vec![], 130),
            // T_min/3 from the last renewal's send.
            (0, vec![held(30, 0), held(60, 0)], 10),
            // A newly claimed attempt brings it forward to T/3 after its
            // claim was sent…
            (100, vec![held(300, 100), held(30, 104)], 110),
            (100, vec![held(300, 100), held(60, 95)], 115),
            // …but never later than T_min/3 after the last renewal.
            (100, vec![held(30, 100), held(30, 150)], 110),
        ];
        for (last, held, want) in cases {
            assert_eq!(
                next_renewal(t0 + s(last), &held),
                t0 + s(want),
                "{last} {held:?}"
            );
        }
        assert_eq!(try_budget(&[]), s(5));
        assert_eq!(try_budget(&[held(30, 0), held(12, 0)]), s(2));
        assert_eq!(retry_after(&[]), s(1));
        assert_eq!(retry_after(&[held(5, 0)]), s(5) / 12);
        assert_eq!(retry_after(&[held(1, 0)]), Duration::from_millis(100));
    }

    #[test]
    fn lease_duration_is_the_longest_ttl_within_the_crd_bounds() {
        let cases: [(&[u64], i32); 5] = [
            (&[], 90),
            (&[30, 600, 60], 600),
            (&[1], 5),
            (&[7200], 3600),
            (&[u64::MAX], 3600),
        ];
        for (ttls, want) in cases {
            assert_eq!(
                lease_duration_seconds(ttls.iter().map(|&t| s(t))),
                want,
                "{ttls:?}"
            );
        }
    }

    #[test]
    fn renew_time_strictly_increases() {
        let at = |us: i64| Timestamp::from_microsecond(us).unwrap();
        let ns = |n: i128| Timestamp::from_nanosecond(n).unwrap();
        // (last written, wall clock now, expected)
        let cases = [
            (None, at(1_000), at(1_000)),
            (Some(at(1_000)), at(2_000), at(2_000)),
            // Equal: bumped by 1 µs.
            (Some(at(1_000)), at(1_000), at(1_001)),
            // The clock stepped back: still after the last one.
            (Some(at(5_000)), at(1_000), at(5_001)),
            // Sub-microsecond progress is no progress once written.
            (Some(at(1_000)), ns(1_000_400), at(1_001)),
            (None, ns(1_000_400), at(1_000)),
        ];
        for (last, now, want) in cases {
            assert_eq!(next_renew_time(last, now), want, "{last:?} {now:?}");
        }
        // A run of renewals in one microsecond: each one later.
        let mut last = None;
        for _ in 0..5 {
            let t = next_renew_time(last, at(7));
            assert!(last.is_none_or(|l| t > l));
            last = Some(t);
        }
        assert_eq!(last, Some(at(11)));
    }

    #[test]
    fn a_renewal_feeds_only_if_answered_within_a_sixth_of_the_ttl() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        // (ttl, answered after, feeds)
        let cases = [
            (30, ms(0), true),
            (30, ms(4_999), true),
            (30, ms(5_000), true),
            (30, ms(5_001), false),
            (6, ms(1_500), false),
            (300, ms(30_000), true),
        ];
        for (ttl, after, want) in cases {
            assert_eq!(feeds(t0, t0 + after, s(ttl)), want, "{ttl} {after:?}");
        }
        // An answer "before" its send (clock reads out of order) feeds.
        assert!(feeds(t0 + s(1), t0, s(30)));
    }

    #[test]
    fn revoked_attempts_are_killed_once_whether_named_or_per_lease() {
        let a = |n: &str, u: &str| AttemptRef {
            name: n.into(),
            uid: u.into(),
        };
        let revoked = [a("t-1", "u1")];
        // (attempt, live, expected)
        let cases = [
            (a("t-1", "u1"), true, OnCopy::Kill),
            (a("t-1", "u1"), false, OnCopy::Ignore),
            // Same name, another attempt (the task was re-created).
            (a("t-1", "u2"), true, OnCopy::Keep),
            (a("t-2", "u1"), true, OnCopy::Keep),
            (a("t-2", "u1"), false, OnCopy::Ignore),
        ];
        for (attempt, live, want) in cases {
            assert_eq!(
                on_copy(&attempt, live, &revoked),
                want,
                "{attempt:?} {live}"
            );
        }
        assert_eq!(on_copy(&a("t-1", "u1"), true, &[]), OnCopy::Keep);
    }

    #[test]
    fn a_reread_is_the_same_object_only_by_holder_and_uid() {
        let w = |holder: &str, uid: Option<&str>| {
            let mut w = WorkerLease::new(
                "w",
                batchlease_api::WorkerLeaseSpec {
                    holder_identity: holder.into(),
                    queues: vec![],
                    lease_duration_seconds: 90,
                    renew_time: None,
                    holds: vec![],
                    slots: None,
                    takes_bound: None,
                },
            );
            w.metadata.uid = uid.map(Into::into);
            w
        };
        let ours = w("me", Some("u1"));
        let recreated = Err("re-created (another metadata.uid)");
        // (fresh, expected)
        let cases = [
            (Some(w("me", Some("u1"))), Ok(())),
            (None, Err("deleted")),
            (Some(w("other", Some("u1"))), Err("taken by another holder")),
            // Deleted and created again with our holder: not ours to renew.
            (Some(w("me", Some("u2"))), recreated),
            (Some(w("me", None)), recreated),
        ];
        for (fresh, want) in cases {
            let why = format!("{fresh:?}");
            assert_eq!(reread(&ours, "me", fresh).map(|_| ()), want, "{why}");
        }
        // Our copy without a UID (never one the API server stored): lost.
        assert_eq!(
            reread(&w("me", None), "me", Some(w("me", None))).map(|_| ()),
            recreated
        );
    }

    #[test]
    fn refusals_table() {
        let cases = [
            (409, Refusal::Conflict),
            (404, Refusal::Gone),
            (410, Refusal::Gone),
            (403, Refusal::FallBack),
            (422, Refusal::FallBack),
            (400, Refusal::FallBack),
            (429, Refusal::Retry),
            (500, Refusal::Retry),
            (503, Refusal::Retry),
        ];
        for (code, want) in cases {
            assert_eq!(refusal(code), want, "{code}");
        }
    }
}
