//! Tests of `worker_leases.rs`.
use std::time::Duration;

use super::*;
use crate::observe::{Observation, next_seen};
use batchlease_api::worker_lease::worker_lease_name;
use batchlease_api::{Renewal as Mode, TaskLeaseSpec, TaskLeaseStatus, WorkerLeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;

fn micro(second: i64) -> MicroTime {
    MicroTime(k8s_openapi::jiff::Timestamp::from_second(second).unwrap())
}

fn worker(holder: &str, uid: &str, renew: i64, holds: &str) -> WorkerLease {
    let mut l = WorkerLease::new(
        &worker_lease_name(holder),
        WorkerLeaseSpec {
            holder_identity: holder.into(),
            queues: vec![],
            lease_duration_seconds: 30,
            renew_time: Some(micro(renew)),
            holds: names(
                &holds
                    .split(',')
                    .filter(|n| !n.is_empty())
                    .collect::<Vec<_>>(),
            )
            .into_iter()
            .collect(),
            slots: None,
            takes_bound: None,
        },
    );
    l.metadata.namespace = Some("ns".into());
    l.metadata.uid = Some(uid.into());
    l
}

fn task_lease(name: &str, holder: &str, phase: LeasePhase) -> TaskLease {
    let mut l = TaskLease::new(name, TaskLeaseSpec::offered("t", "task", "q", 1, 30));
    l.metadata.namespace = Some("ns".into());
    l.metadata.uid = Some(format!("uid-{name}"));
    l.spec.holder_identity = Some(holder.into());
    l.spec.renew_time = Some(micro(100));
    l.spec.renewal = Some(Mode::Worker);
    l.status = Some(TaskLeaseStatus {
        phase: Some(phase),
        ..Default::default()
    });
    l
}

/// Attempts by name, of `task_lease`'s UIDs.
fn names(v: &[&str]) -> BTreeSet<AttemptRef> {
    v.iter()
        .map(|s| AttemptRef {
            name: (*s).to_owned(),
            uid: format!("uid-{s}"),
        })
        .collect()
}

#[test]
fn worker_lease_observations() {
    let t0 = Instant::now();
    let t1 = t0 + Duration::from_secs(3);
    let v1 = worker("w1", "u1", 10, "t-1,t-2");
    // First sight: a renewal now; nothing ended yet.
    let first = next_worker_seen(None, &v1, t0).unwrap();
    let r = first.renewal.clone().unwrap();
    assert_eq!(
        (r.holder.as_str(), &r.names, r.at),
        ("w1", &names(&["t-1", "t-2"]), t0)
    );
    assert!(r.ended.is_empty());
    // Seen again unchanged (a relist, a revocation): no renewal.
    assert_eq!(
        next_worker_seen(Some(&first.seen), &v1, t1)
            .unwrap()
            .renewal,
        None
    );
    // A new renewTime, even an older clock value: a renewal at t1. It
    // no longer lists t-1: t-1's listing is over from now on, but this
    // observation still counts for it (versions skipped in between may
    // have listed it).
    let v2 = worker("w1", "u1", 5, "t-2");
    let got = next_worker_seen(Some(&first.seen), &v2, t1).unwrap();
    assert!(got.renewal.clone().unwrap().ended.is_empty());
    assert_eq!(got.seen.ended(), &names(&["t-1"]));
    // The next one does not count for t-1 any more.
    let v3 = worker("w1", "u1", 6, "t-2");
    let next = next_worker_seen(Some(&got.seen), &v3, t1).unwrap();
    assert_eq!(next.renewal.clone().unwrap().ended, names(&["t-1"]));
    // Named again: credited again, and its listing no longer over.
    let v4 = worker("w1", "u1", 7, "t-1,t-2");
    let named_again = next_worker_seen(Some(&next.seen), &v4, t1).unwrap();
    assert!(named_again.renewal.unwrap().ended.is_empty());
    assert!(named_again.seen.ended().is_empty());
    // Created again after a deletion (another UID): a first sight, and
    // the old object's ended listings are not carried over.
    let again = worker("w1", "u2", 6, "");
    let got = next_worker_seen(Some(&next.seen), &again, t1).unwrap();
    assert!(got.renewal.unwrap().ended.is_empty());
    // Not named for its holder: no record.
    let mut misnamed = v1.clone();
    misnamed.metadata.name = Some("other".into());
    assert!(next_worker_seen(None, &misnamed, t0).is_none());
}

#[test]
fn credit_table() {
    let t0 = Instant::now();
    let t1 = t0 + Duration::from_secs(4);
    let held = task_lease("t-1", "w1", LeasePhase::Held);
    let seen = next_seen(None, &held, t0).unwrap();
    let renewal = |holder: &str, listed: &[&str], ended: &[&str], at: Instant| Renewal {
        holder: holder.into(),
        namespace: Some("ns".into()),
        names: names(listed),
        ended: names(ended),
        revoked: BTreeSet::new(),
        at,
        gapless_since: None,
    };
    let timing = |o: Observation| (o.last_renewal, o.claimed_at);
    let credited = |r: &Renewal, l: &TaskLease| timing(credit(&seen, l, r).observation);
    let untouched = timing(seen.observation);
    let renewed = (t1, t0);
    for (why, r) in [
        ("listed", renewal("w1", &["t-1"], &[], t1)),
        // Versions the operator never saw may have listed it.
        (
            "not listed, listing never seen",
            renewal("w1", &[], &[], t1),
        ),
        ("another's listing ended", renewal("w1", &[], &["t-2"], t1)),
    ] {
        assert_eq!(credited(&r, &held), renewed, "{why}");
    }
    for (why, r, l) in [
        (
            "its listing was seen to end",
            renewal("w1", &[], &["t-1"], t1),
            held.clone(),
        ),
        (
            "another worker",
            renewal("w2", &["t-1"], &[], t1),
            held.clone(),
        ),
        (
            "revoked in the observed version",
            Renewal {
                revoked: names(&["t-1"]),
                ..renewal("w1", &["t-1"], &[], t1)
            },
            held.clone(),
        ),
        (
            "observed before the claim was",
            renewal("w1", &["t-1"], &[], t0 - Duration::from_secs(1)),
            held.clone(),
        ),
        (
            "expired: a zombie's write",
            renewal("w1", &["t-1"], &[], t1),
            task_lease("t-1", "w1", LeasePhase::Expired),
        ),
        (
            "completed",
            renewal("w1", &["t-1"], &[], t1),
            task_lease("t-1", "w1", LeasePhase::Completed),
        ),
        ("renewed per lease", renewal("w1", &["t-1"], &[], t1), {
            let mut l = held.clone();
            l.spec.renewal = Some(Mode::Lease);
            l
        }),
    ] {
        assert_eq!(credited(&r, &l), untouched, "{why}");
    }
    let listed = renewal("w1", &["t-1"], &[], t1);
    let mut elsewhere = held.clone();
    elsewhere.metadata.namespace = Some("other".into());
    assert_eq!(
        credited(&listed, &elsewhere),
        untouched,
        "another namespace"
    );
    // The record of another incarnation of the name: not this one's.
    let mut other = held.clone();
    other.metadata.uid = Some("uid-again".into());
    assert_eq!(credited(&listed, &other), untouched, "another object");
    // Never moves the last renewal back.
    let later = credit(&seen, &held, &listed);
    let earlier = renewal("w1", &["t-1"], &[], t0);
    assert_eq!(timing(credit(&later, &held, &earlier).observation), renewed);
    // Named: once a version observed since the claim lists it, whatever
    // the gaps; not by a version observed before the claim, nor another's.
    assert!(!seen.observation.named);
    assert!(later.observation.named, "listed");
    for (why, r) in [
        ("not listed", renewal("w1", &[], &[], t1)),
        (
            "before the claim",
            renewal("w1", &["t-1"], &[], t0 - Duration::from_secs(1)),
        ),
        ("another worker", renewal("w2", &["t-1"], &[], t1)),
    ] {
        assert!(!credit(&seen, &held, &r).observation.named, "{why}");
    }
}

/// The rule end to end, as a tracker would apply it: a TaskLease whose
/// holder renews only its worker Lease, then drops it.
#[test]
fn a_lease_kept_alive_by_its_workers_renewals() {
    let t = |s: u64| Instant::now() + Duration::from_secs(s);
    let (t0, t10, t20, t30) = (t(0), t(10), t(20), t(30));
    let held = task_lease("t-1", "w1", LeasePhase::Held);
    let mut seen = next_seen(None, &held, t0).unwrap();
    let mut ws = next_worker_seen(None, &worker("w1", "u1", 1, "t-1"), t0)
        .unwrap()
        .seen;
    for (at, renew, holds) in [(t10, 2, "t-1"), (t20, 3, "")] {
        let o = next_worker_seen(Some(&ws), &worker("w1", "u1", renew, holds), at).unwrap();
        seen = credit(&seen, &held, &o.renewal.unwrap());
        ws = o.seen;
    }
    // Dropped at t20: credited then, not after.
    assert_eq!(seen.observation.last_renewal, t20);
    let o = next_worker_seen(Some(&ws), &worker("w1", "u1", 4, ""), t30).unwrap();
    seen = credit(&seen, &held, &o.renewal.unwrap());
    assert_eq!(seen.observation.last_renewal, t20);
    // The TaskLease's own renewTime still counts (an older worker, a
    // checkpoint): next_seen is unchanged for it.
    let mut own = held.clone();
    own.spec.renew_time = Some(micro(101));
    assert_eq!(
        next_seen(Some(&seen), &own, t30)
            .unwrap()
            .observation
            .last_renewal,
        t30
    );
    // The deletion of a WorkerLease whose last state was seen renews
    // nothing; one that carries a renewal not seen, or a departure
    // from a relist (last state unknown), is a renewal observed then.
    let t40 = t(40);
    let last = worker("w1", "u1", 4, "");
    let o = next_worker_seen(Some(&ws), &last, t30).unwrap().seen;
    assert_eq!(o.departure(Some(&last), Some("ns".into()), t40), None);
    let unseen = worker("w1", "u1", 5, "t-1");
    let r = o.departure(Some(&unseen), Some("ns".into()), t40).unwrap();
    assert_eq!((r.at, r.ended.clone()), (t40, names(&["t-1"])));
    assert!(o.departure(None, Some("ns".into()), t40).is_some());
}

/// The never-listed rule: with every version of the WorkerLease seen since
/// before the claim was observed, renewals that do not name the attempt
/// keep it alive for 2·TTL, not longer; one naming it lifts the bound for
/// good. Renewals after a gap (a relist, a first sight, unknown) are
/// credited as before: a skipped version may have named it.
#[test]
fn an_attempt_never_seen_listed_is_credited_for_two_ttls_when_no_version_was_skipped() {
    let base = Instant::now();
    let t = |s: u64| base + Duration::from_secs(s);
    // TTL 30 s (task_lease): the bound is 60 s after the claim's observation.
    let held = task_lease("t-1", "w1", LeasePhase::Held);
    let claimed = next_seen(None, &held, t(10)).unwrap();
    assert_eq!(never_listed_until(&claimed), t(70));
    let renewal = |holds: &[&str], at: Instant, gapless_since: Option<Instant>| Renewal {
        holder: "w1".into(),
        namespace: Some("ns".into()),
        names: names(holds),
        ended: BTreeSet::new(),
        revoked: BTreeSet::new(),
        at,
        gapless_since,
    };
    let watched = Some(t(0));
    let early = credit(&claimed, &held, &renewal(&[], t(69), watched));
    assert_eq!(
        (early.observation.last_renewal, early.listed()),
        (t(69), false)
    );
    let late = credit(&early, &held, &renewal(&[], t(71), watched));
    assert_eq!(
        late.observation.last_renewal,
        t(69),
        "not credited past 2·TTL"
    );
    // After a gap, or with the gap unknown, or gap-free only since the
    // claim was observed: credited (a skipped version may have named it).
    for (why, since) in [
        ("a relist after the claim", Some(t(20))),
        ("since the claim's observation", Some(t(10))),
        ("unknown", None),
    ] {
        let r = credit(&early, &held, &renewal(&[], t(71), since));
        assert_eq!(r.observation.last_renewal, t(71), "{why}");
    }
    // A naming version after a gap marks nothing.
    let gap = credit(&claimed, &held, &renewal(&["t-1"], t(30), Some(t(25))));
    assert!(!gap.listed());
    // Named once, even after the bound: credited from then on, and the
    // mark survives the lease's own changes.
    let named = credit(&late, &held, &renewal(&["t-1"], t(80), watched));
    assert_eq!(
        (named.observation.last_renewal, named.listed()),
        (t(80), true)
    );
    let own = next_seen(Some(&named), &held, t(81)).unwrap();
    assert!(own.listed());
    let after = credit(&own, &held, &renewal(&[], t(90), watched));
    assert_eq!(after.observation.last_renewal, t(90));
    // Another worker's version naming it marks nothing.
    let other = Renewal {
        holder: "w2".into(),
        ..renewal(&["t-1"], t(20), watched)
    };
    assert!(!credit(&claimed, &held, &other).listed());
    // A new claim under the name (another UID) starts unlisted.
    let mut again = held.clone();
    again.metadata.uid = Some("uid-t-1-again".into());
    assert!(!next_seen(Some(&after), &again, t(95)).unwrap().listed());
}

/// The tracker sets `gapless_since`: a first sight and a relist start it
/// afresh, the watch's events in between keep it, so the cut-off reaches
/// an attempt claimed after the first sight and not one claimed before a
/// relist.
#[test]
fn the_tracker_cuts_off_a_never_listed_attempt_only_between_relists() {
    let base = Instant::now();
    let t = |s: u64| base + Duration::from_secs(s);
    let leases = Tracker::default();
    let workers = WorkerTracker::default();
    workers.list_started();
    workers.observe(&worker("w1", "u1", 1, ""), &leases, t(0));
    assert!(workers.list_done(&leases, t(0)).is_empty());
    let held = task_lease("t-1", "w1", LeasePhase::Held);
    leases.observe(&held, t(1));
    let last = || leases.observation("ns", "t-1").unwrap().last_renewal;
    // Renewals that never name it: credited until 2·TTL after the claim.
    for (i, at) in [(2, 30), (3, 60), (4, 62)] {
        workers.observe(&worker("w1", "u1", i, ""), &leases, t(at));
    }
    assert_eq!(last(), t(60), "cut off 60 s after the claim's observation");
    // A relist: versions may have been skipped — credited again.
    workers.list_started();
    workers.observe(&worker("w1", "u1", 5, ""), &leases, t(70));
    workers.list_done(&leases, t(70));
    assert_eq!(last(), t(70), "a relist is credited");
    workers.observe(&worker("w1", "u1", 6, ""), &leases, t(80));
    assert_eq!(
        last(),
        t(80),
        "gap-free only since after the claim: credited"
    );
    // A lease claimed after the relist, named by the watch: listed, and
    // credited past its bound.
    let next = task_lease("t-2", "w1", LeasePhase::Held);
    leases.observe(&next, t(81));
    let last2 = || leases.observation("ns", "t-2").unwrap().last_renewal;
    workers.observe(&worker("w1", "u1", 7, "t-2"), &leases, t(82));
    workers.observe(&worker("w1", "u1", 8, ""), &leases, t(150));
    assert_eq!(last2(), t(150), "named once: credited past 2·TTL");
    // A watch error: gap-free again only from the next observation on, so
    // a lease claimed before it is credited as before.
    let third = task_lease("t-3", "w1", LeasePhase::Held);
    leases.observe(&third, t(151));
    workers.watch_failed(t(151));
    workers.observe(&worker("w1", "u1", 9, ""), &leases, t(152));
    workers.observe(&worker("w1", "u1", 10, ""), &leases, t(220));
    let last3 = leases.observation("ns", "t-3").unwrap().last_renewal;
    assert_eq!(last3, t(220), "claimed before the watch error: credited");
}

/// The tracker end to end: WorkerLease events credited to the TaskLease
/// records of the lease watch's tracker.
#[test]
fn the_trackers_credit_worker_renewals_and_departures() {
    let base = Instant::now();
    let t = |s: u64| base + Duration::from_secs(s);
    let leases = Tracker::default();
    let workers = WorkerTracker::default();
    let held = task_lease("t-1", "w1", LeasePhase::Held);
    let mut per_lease = task_lease("t-2", "w1", LeasePhase::Held);
    per_lease.spec.renewal = Some(Mode::Lease);
    leases.observe(&held, t(0));
    leases.observe(&per_lease, t(0));
    let last = |name: &str| leases.observation("ns", name).unwrap().last_renewal;
    workers.list_started();
    workers.observe(&worker("w1", "u1", 1, "t-1"), &leases, t(1));
    workers.list_done(&leases, t(1));
    assert_eq!(last("t-1"), t(1), "first sight of the WorkerLease");
    assert_eq!(last("t-2"), t(0), "renewed per lease: not credited");
    workers.observe(&worker("w1", "u1", 2, "t-1"), &leases, t(5));
    assert_eq!(last("t-1"), t(5));
    // Another holder's renewal keeps nothing of w1's alive.
    workers.observe(&worker("w2", "u2", 1, "t-1"), &leases, t(6));
    assert_eq!(last("t-1"), t(5));
    // The same version seen again: nothing.
    workers.observe(&worker("w1", "u1", 2, "t-1"), &leases, t(7));
    assert_eq!(last("t-1"), t(5));
    // Deleted with a renewal we never saw: counted at the deletion.
    workers.forget(&worker("w1", "u1", 3, "t-1"), &leases, t(9));
    assert_eq!(last("t-1"), t(9));
    // Created again, then gone from a relist: a renewal at the relist.
    workers.observe(&worker("w1", "u3", 1, ""), &leases, t(10));
    assert_eq!(last("t-1"), t(10), "a new object of the holder");
    workers.list_started();
    workers.list_done(&leases, t(12));
    assert_eq!(last("t-1"), t(12));
    // Once the lease is no longer held, nothing is credited to it.
    let mut done = held.clone();
    done.status.as_mut().unwrap().phase = Some(LeasePhase::Completed);
    leases.observe(&done, t(13));
    workers.observe(&worker("w1", "u4", 1, "t-1"), &leases, t(14));
    assert_eq!(leases.observation("ns", "t-1"), None);
}

#[test]
fn a_worker_lease_found_gone_delays_an_end_once() {
    let workers = WorkerTracker::default();
    let a = AttemptRef {
        name: "t-1".into(),
        uid: "u".into(),
    };
    let now = Instant::now();
    assert!(
        !workers.found_gone("ns", &a, now),
        "first: count a renewal now"
    );
    assert!(workers.found_gone("ns", &a, now + Duration::from_secs(30)));
    let other = AttemptRef {
        name: "t-1".into(),
        uid: "another".into(),
    };
    assert!(!workers.found_gone("ns", &other, now), "per attempt");
}

#[test]
fn a_deleted_lease_renewed_per_worker_is_waited_for_a_refresh_period_more() {
    let t0 = Instant::now();
    let held = task_lease("t-1", "w1", LeasePhase::Held);
    let seen = next_seen(None, &held, t0).unwrap();
    let ttl = Duration::from_secs(30);
    let refresh = batchlease_api::worker_lease::refresh_period(ttl);
    assert_eq!(refresh, Duration::from_secs(120));
    assert_eq!(
        crate::observe::holder_stops_by(Some(&seen), &held, true, t0),
        Some(t0 + ttl + refresh)
    );
    let mut per_lease = held.clone();
    per_lease.spec.renewal = Some(Mode::Lease);
    assert_eq!(
        crate::observe::holder_stops_by(Some(&seen), &per_lease, true, t0),
        Some(t0 + ttl)
    );
}

#[test]
fn a_frozen_workers_attempts_fall_due_together() {
    let base = Instant::now();
    let t = |s: u64| base + Duration::from_secs(s);
    let leases = Tracker::default();
    let workers = WorkerTracker::default();
    let a = task_lease("t-1", "w1", LeasePhase::Held);
    let b = task_lease("t-2", "w1", LeasePhase::Held);
    let mut other = task_lease("t-3", "w2", LeasePhase::Held);
    other.metadata.uid = Some("uid-t-3".into());
    for l in [&a, &b, &other] {
        leases.observe(l, t(0));
    }
    workers.observe(&worker("w1", "u1", 1, "t-1,t-2"), &leases, t(5));
    // TTL 30: due 30 s after the last renewal credited (t5), not before.
    assert!(leases.due_of_holder("ns", "w1", t(34)).is_empty());
    let mut due = leases.due_of_holder("ns", "w1", t(35));
    due.sort();
    assert_eq!(
        due,
        [
            ("t-1".to_owned(), "uid-t-1".to_owned()),
            ("t-2".to_owned(), "uid-t-2".to_owned())
        ]
    );
    assert!(leases.due_of_holder("ns", "w9", t(35)).is_empty());
}

/// A worker counts as silent from its last renewal observed, or from the
/// watch's last error if later: an outage hides the renewals it stops.
#[test]
fn silence_counts_from_the_last_renewal_or_the_watch_error_after_it() {
    let base = Instant::now();
    let t = |s: u64| base + Duration::from_secs(s);
    let (workers, leases) = (WorkerTracker::default(), Tracker::default());
    let name = worker_lease_name("w1");
    assert_eq!(workers.silent_since("ns", &name), None, "never seen");
    workers.observe(&worker("w1", "u1", 1, ""), &leases, t(10));
    assert_eq!(workers.silent_since("ns", &name), Some(t(10)));
    workers.watch_failed(t(50));
    assert_eq!(workers.silent_since("ns", &name), Some(t(50)), "the error");
    assert_eq!(
        workers.renewed_at("ns", &name),
        Some(t(10)),
        "not a renewal"
    );
    workers.observe(&worker("w1", "u1", 2, ""), &leases, t(60));
    assert_eq!(workers.silent_since("ns", &name), Some(t(60)), "renewed");
    // The same version again (a relist): no renewal, the mark stays.
    workers.observe(&worker("w1", "u1", 2, ""), &leases, t(70));
    assert_eq!(workers.silent_since("ns", &name), Some(t(60)));
}

/// A renewal counts as observed as it happened only from a watch event
/// outside a list: a list (a new leader's first, a relist after an
/// outage) shows a version that may have been made long before, too old to
/// bind an attempt to. Its sight still counts for liveness (`renewed_at`).
#[test]
fn renewals_seen_in_a_list_are_not_observed_as_they_happened() {
    let base = Instant::now();
    let t = |s: u64| base + Duration::from_secs(s);
    let (workers, leases) = (WorkerTracker::default(), Tracker::default());
    let name = worker_lease_name("w1");
    // What binding reads of the version `w` (`WorkerTracker::renewals`).
    let observed = |w: &WorkerLease| workers.renewals(w).and_then(|r| r.observed);
    // A new leader's first list.
    let v1 = worker("w1", "u1", 1, "");
    workers.list_started();
    workers.observe(&v1, &leases, t(1));
    workers.list_done(&leases, t(1));
    assert_eq!(workers.renewed_at("ns", &name), Some(t(1)), "live");
    assert_eq!(observed(&v1), None, "listed only");
    // Its next renewal, from the watch.
    let v2 = worker("w1", "u1", 2, "");
    workers.observe(&v2, &leases, t(5));
    assert_eq!(observed(&v2), Some(t(5)));
    assert_eq!(observed(&v1), None, "not for an older version");
    // A relist showing a renewal made during the gap: not as it happened;
    // the one observed before stays.
    let v3 = worker("w1", "u1", 3, "");
    workers.list_started();
    workers.observe(&v3, &leases, t(30));
    workers.list_done(&leases, t(30));
    assert_eq!(workers.renewed_at("ns", &name), Some(t(30)));
    assert_eq!(observed(&v3), Some(t(5)));
    // Another object under the name, in a relist: nothing observed.
    let u2 = worker("w1", "u2", 1, "");
    workers.list_started();
    workers.observe(&u2, &leases, t(40));
    workers.list_done(&leases, t(40));
    assert_eq!(observed(&u2), None);
    // A worker's first write seen live (its create): observed.
    let w2 = worker("w2", "u3", 1, "");
    workers.observe(&w2, &leases, t(50));
    assert_eq!(observed(&w2), Some(t(50)));
    // A watch error, then the resumed watch replays a renewal made while
    // it was down: not as it happened. The next one is.
    workers.watch_failed(t(60));
    let w2b = worker("w2", "u3", 2, "");
    workers.observe(&w2b, &leases, t(70));
    assert_eq!(observed(&w2b), Some(t(50)));
    let w2c = worker("w2", "u3", 3, "");
    workers.observe(&w2c, &leases, t(75));
    assert_eq!(observed(&w2c), Some(t(75)));
}

/// The watch's errors excuse a worker's silence, by at most
/// SILENCE_EXCUSED: a watch that keeps failing does not have a dead
/// worker's WorkerLease awaited for good.
#[test]
fn watch_errors_excuse_silence_only_so_long() {
    let t0 = Instant::now();
    let t = |s: u64| t0 + Duration::from_secs(s);
    assert_eq!(silent_since(t(10), None), t(10));
    assert_eq!(silent_since(t(10), Some(t(5))), t(10), "an error before");
    assert_eq!(silent_since(t(10), Some(t(100))), t(100), "an outage after");
    assert_eq!(
        silent_since(t(10), Some(t(10_000))),
        t(10) + SILENCE_EXCUSED,
        "errors for hours"
    );
}

/// Issue 39, defect 7: a WorkerLease's record of the attempts whose
/// listing ended only grew (a worker that ran 100,000 attempts carried
/// them all, cloned into every renewal observed). It keeps an attempt
/// while its holder still holds it per worker, and otherwise an hour from
/// when its end was seen — past any lag of the lease watch, which may not
/// show a claim as held yet when the WorkerLease watch shows its end.
#[test]
fn a_worker_lease_record_keeps_only_the_ended_attempts_still_held() {
    let leases = Tracker::default();
    let wt = WorkerTracker::default();
    let base = Instant::now();
    let t = |s: u64| base + Duration::from_secs(s);
    let hour = ENDED_KEPT.as_secs();
    let mut a = task_lease("t-1", "w1", LeasePhase::Held);
    let b = task_lease("t-2", "w1", LeasePhase::Held);
    leases.observe(&a, t(0));
    leases.observe(&b, t(0));
    wt.observe(&worker("w1", "u1", 1, "t-1,t-2,t-3"), &leases, t(1));
    // All dropped from the listing: ended. t-3's claim is not seen held
    // yet (the lease watch lags): kept all the same.
    wt.observe(&worker("w1", "u1", 2, ""), &leases, t(2));
    assert_eq!(
        wt.ended_for_tests("ns", "w1"),
        names(&["t-1", "t-2", "t-3"])
    );
    // t-1 completes; within the hour it stays.
    a.status.as_mut().unwrap().phase = Some(LeasePhase::Completed);
    leases.observe(&a, t(3));
    wt.observe(&worker("w1", "u1", 3, ""), &leases, t(4));
    assert_eq!(
        wt.ended_for_tests("ns", "w1"),
        names(&["t-1", "t-2", "t-3"])
    );
    // An hour on: only what is still held (t-2) is kept.
    wt.observe(&worker("w1", "u1", 4, ""), &leases, t(2 + hour));
    assert_eq!(wt.ended_for_tests("ns", "w1"), names(&["t-2"]));
    // t-2's lease is deleted: nothing left, an hour after its end.
    leases.forget(&b, t(3 + hour));
    wt.observe(&worker("w1", "u1", 5, ""), &leases, t(4 + hour));
    assert_eq!(wt.ended_for_tests("ns", "w1"), BTreeSet::new());
}

#[test]
fn ended_attempts_are_pruned_to_those_held_or_ended_lately() {
    let base = Instant::now();
    let now = base + ENDED_KEPT;
    let ended = names(&["t-1", "t-2", "t-3"]);
    let held = names(&["t-2", "t-9"]);
    // t-3's end was seen just now; t-1's an hour ago.
    let at = |a: &AttemptRef| if a.name == "t-3" { now } else { base };
    assert_eq!(prune_ended(ended, &held, at, now), names(&["t-2", "t-3"]));
    // Another object of a name still held (a new UID): not the same attempt.
    let other = BTreeSet::from([AttemptRef {
        name: "t-2".into(),
        uid: "uid-other".into(),
    }]);
    assert_eq!(
        prune_ended(names(&["t-2"]), &other, |_| base, now),
        BTreeSet::new()
    );
}

/// Issue 39, defect 6: a WorkerLease watch that never lists held every
/// queue's issues for worker slots for good. A minute without a first list
/// degrades the operator to renewals per lease; a list ends it.
#[test]
fn an_operator_degrades_when_the_worker_lease_watch_never_lists() {
    let t0 = Instant::now();
    let s = Duration::from_secs;
    for (why, synced, started, at, want) in [
        ("not started", false, None, 600, false),
        ("within the grace", false, Some(0), 59, false),
        ("a minute without a list", false, Some(0), 60, true),
        ("listed", true, Some(0), 600, false),
    ] {
        assert_eq!(
            list_degraded(synced, started.map(|x| t0 + s(x)), t0 + s(at)),
            want,
            "{why}"
        );
    }
    let wt = WorkerTracker::default();
    wt.watch_started(t0);
    wt.watch_error(t0 + s(1), "workerleases is forbidden".into());
    assert!(!wt.degraded(t0 + s(30)));
    assert_eq!(wt.degraded_cause(t0 + s(30)), None);
    assert!(wt.degraded(t0 + s(61)));
    assert_eq!(
        wt.degraded_cause(t0 + s(61)).as_deref(),
        Some("workerleases is forbidden")
    );
    // The list comes: per worker again.
    let leases = Tracker::default();
    wt.list_started();
    wt.list_done(&leases, t0 + s(70));
    assert!(!wt.degraded(t0 + s(71)));
}
