//! The election against an API server that answers when the test says
//! (`leader_fake`), in paused time: the timings of issue 23 exactly.

use super::*;
use crate::leader_fake::FakeLeases;

fn s(secs: u64) -> Duration {
    Duration::from_secs(secs)
}

fn ms(millis: u64) -> Duration {
    Duration::from_millis(millis)
}

/// Lease 15 s, grace 5 s: a term of 10 s, renewed every 3.33 s.
fn cfg(identity: &str) -> ElectionConfig {
    ElectionConfig {
        namespace: "ns".into(),
        lease_name: "l".into(),
        identity: identity.into(),
        duration_seconds: 15,
        grace_seconds: 5,
    }
}

fn held_by(holder: &str) -> Lease {
    let mut l = Lease::default();
    l.metadata.name = Some("l".into());
    l.metadata.namespace = Some("ns".into());
    l.spec = Some(LeaseSpec {
        holder_identity: Some(holder.into()),
        lease_duration_seconds: Some(15),
        ..Default::default()
    });
    l
}

/// Waits (in paused time) for the next term; returns it and when it began.
async fn lead(campaign: &mut Campaign, within: Duration) -> (Leadership, Instant) {
    let l = timeout(within, campaign.acquired())
        .await
        .expect("a term within the time allowed")
        .expect("the election task runs");
    (l, Instant::now())
}

fn answered(fake: &FakeLeases, method: &str, status: u16) -> Vec<Instant> {
    fake.log()
        .into_iter()
        .filter(|a| a.method == method && a.status == status)
        .map(|a| a.at)
        .collect()
}

/// Finding 1: the renewal at 3.3 s meets a 409 answered at 6.7 s (someone
/// annotated the Lease), the GET that follows answers at 10.8 s — after
/// the term's end at 10 s — and the PUT from it at 13.3 s. The old code
/// spent one budget three times, let that PUT land, extended the ended
/// term under its old generation and never woke `acquired()`: a replica
/// renewing its Lease forever with no controllers.
#[tokio::test(start_paused = true)]
async fn a_renewal_answered_after_the_term_ended_never_revives_it_without_controllers() {
    let fake = FakeLeases::default();
    let mut c = campaign(fake.client(), &cfg("me"));
    let (first, _) = lead(&mut c, s(60)).await;
    fake.script("PUT", ms(3_370), Some(409));
    fake.script("GET", ms(4_100), None);
    fake.script("PUT", ms(2_500), None);
    timeout(s(11), first.clone().lost())
        .await
        .expect("the term ends by its own deadline");
    assert!(first.ensure().is_err());
    // Whatever landed late, the replica leads again only as a new term —
    // one that `acquired()` hands out, so controllers start again.
    let (next, _) = lead(&mut c, s(40)).await;
    assert_ne!(next.generation, first.generation);
    assert!(next.is_leader());
    assert!(first.ensure().is_err(), "the old term stays over");
}

/// Finding 2, the standby's side: no Lease (never created, or deleted by
/// `kubectl delete leases --all`) is created at once but vacated — a
/// create is never a term — and taken only after a full duration of that
/// version, by the replica's own clock.
#[tokio::test(start_paused = true)]
async fn a_missing_lease_is_created_vacated_and_taken_after_a_full_duration() {
    let fake = FakeLeases::default();
    let t0 = Instant::now();
    let mut c = campaign(fake.client(), &cfg("me"));
    let (_, at) = lead(&mut c, s(60)).await;
    let created = answered(&fake, "POST", 201);
    let first = *created.first().expect("created");
    assert!(at >= first + s(15), "led {:?} after creating", at - first);
    assert!(at >= t0 + s(15), "led {:?} after start", at - t0);
}

/// Finding 2, the leader's side: its Lease deleted, its next renewal gets
/// 404 and the term ends then — not when it runs out — and it leads again
/// only a full duration after it recreated the Lease, vacated.
#[tokio::test(start_paused = true)]
async fn a_leader_whose_lease_is_deleted_stops_at_the_next_renewal() {
    let fake = FakeLeases::default();
    let mut c = campaign(fake.client(), &cfg("me"));
    let (first, t0) = lead(&mut c, s(60)).await;
    tokio::time::sleep(ms(500)).await;
    fake.put(None);
    let deleted = Instant::now();
    timeout(s(4), first.clone().lost())
        .await
        .expect("lost at the renewal that found no Lease (3.3 s), not at the term's end (10 s)");
    assert!(Instant::now() < t0 + s(4));
    let (next, at) = lead(&mut c, s(60)).await;
    assert_ne!(next.generation, first.generation);
    assert!(
        at >= deleted + s(15),
        "led {:?} after the deletion",
        at - deleted
    );
}

/// Finding 3: hand edits of a Lease that another replica renews. Cleared
/// holder, this very standby named as holder, a duration shrunk to 1 s:
/// the standby still waits its own full duration of an unchanged Lease.
#[tokio::test(start_paused = true)]
async fn hand_edits_of_the_lease_are_waited_out_by_the_standbys_own_duration() {
    type Edit = fn(&mut LeaseSpec);
    let edits: [(&str, Edit); 4] = [
        ("holder cleared", |s| s.holder_identity = None),
        ("holder empty", |s| s.holder_identity = Some(String::new())),
        ("holder set to the standby", |s| {
            s.holder_identity = Some("b".into())
        }),
        ("duration shrunk to 1 s", |s| {
            s.lease_duration_seconds = Some(1)
        }),
    ];
    for (what, edit) in edits {
        let fake = FakeLeases::default();
        fake.put(Some(held_by("a")));
        let mut c = campaign(fake.client(), &cfg("b"));
        // Replica "a" renews every 2 s: "b" stands by.
        for _ in 0..10 {
            tokio::time::sleep(s(2)).await;
            fake.edit(|s| s.renew_time = Some(MicroTime(Timestamp::now())));
        }
        assert!(
            timeout(Duration::ZERO, c.acquired()).await.is_err(),
            "{what}: b led while a renewed"
        );
        fake.edit(edit);
        let edited = Instant::now();
        let (_, at) = lead(&mut c, s(60)).await;
        assert!(
            at >= edited + s(15),
            "{what}: b led {:?} after the edit",
            at - edited
        );
        c.vacate(s(1)).await;
    }
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
        holding: Arc::default(),
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

/// Finding 4: a write in flight when the term is lost (deposed: not at its
/// deadline) is abandoned at once, not when the deadline comes; and none
/// starts after the term.
#[tokio::test(start_paused = true)]
async fn a_bounded_write_is_abandoned_the_moment_the_term_is_lost() {
    let term = Arc::new(Mutex::new(Term {
        generation: 1,
        valid_until: Some(Instant::now() + s(10)),
    }));
    let (tx, rx) = watch::channel(1);
    let l = Leadership {
        term: Some(term.clone()),
        generation: 1,
        changed: Some(rx),
    };
    assert_eq!(l.bound(async { 7 }).await, Some(7));
    let started = Instant::now();
    let write = tokio::spawn({
        let l = l.clone();
        async move { l.bound(std::future::pending::<()>()).await }
    });
    tokio::time::sleep(s(1)).await;
    // What `lose()` does: the term ends now, before its deadline.
    term.lock().unwrap().valid_until = None;
    tx.send_replace(1);
    let r = timeout(ms(10), write)
        .await
        .expect("abandoned at once")
        .unwrap();
    assert_eq!(r, None);
    assert!(Instant::now() < started + s(2));
    // Once over, nothing is even started.
    let mut started_write = false;
    let r = l
        .bound(async {
            started_write = true;
        })
        .await;
    assert_eq!((r, started_write), (None, false));
}

/// Finding 3: two processes configured with the same identity are two
/// identities in the election.
#[test]
fn every_process_has_its_own_identity_even_when_one_is_configured() {
    let a = identity(Some("op"));
    let b = identity(Some("op"));
    assert!(a.starts_with("op-") && b.starts_with("op-"), "{a} {b}");
    assert_ne!(a, b);
}
