//! Bound attempts (issue 27): an addressed offer to a worker
//! with a free slot is created `Held` by it, citing the renewal of its
//! WorkerLease the operator's cache showed; the worker starts it from that
//! renewal's send, or from a renewal naming it (`model/src/bound.rs`).

use batchlease_api::LeasePhase;
use batchlease_api::worker_lease::worker_lease_name;
use batchlease_model::bound::BoundRule;
use batchlease_model::{Action, State};

use super::*;

/// Bound attempts: renewals per worker, addressed offers, each
/// WorkerLease taking bound attempts; `ticks`, no crash, no deletion.
fn bound(ticks: u8, rule: BoundRule) -> Config {
    Config {
        per_worker: true,
        addressed: true,
        bound: true,
        bound_rule: rule,
        ..config(ticks, 0, 0)
    }
}

/// Two workers, 6 s: bound leases created on lagging caches, delivered to
/// their workers late (after the operator's first sight, after their
/// expiry) or never; started from the cited renewal or, seen too late for
/// it, from a renewal naming them; revoked before they started; expired
/// and issued again. Every property holds.
#[test]
fn safe_with_bound_attempts() {
    assert_safe(
        bound(3, BoundRule::Real),
        &[
            "a bound lease is created",
            "a bound attempt starts from the renewal its lease cites",
            "a bound attempt starts from a renewal naming it",
            "a bound attempt revoked before it started is never started",
            "a bound lease expires",
            "a worker's watch delivers a bound lease after it ended",
            "an expired lease's task is offered again",
        ],
    );
}

/// One worker whose clock runs 20 % slow or fast, 6 s: the bound of the
/// mutation below, with the SDK's rule — safe.
#[test]
fn safe_with_bound_attempts_and_drifting_clocks() {
    let mut cfg = bound(3, BoundRule::Real);
    cfg.workers = 1;
    cfg.drift_percent = 20;
    assert_safe(
        cfg,
        &[
            "a bound attempt starts from the renewal its lease cites",
            "a bound attempt starts from a renewal naming it",
            "a bound lease expires",
        ],
    );
}

/// The kill clock counted from when the worker's watch delivered the
/// create (a mutation of the SDK: a bound lease taken as a claim seen
/// then): the operator's clock ran from its own first sight, at 0; the
/// worker sees the lease at 4 s, is alive until 7.3 s, and registers
/// after the expiry at 6 s (15 steps).
#[test]
fn a_bound_attempt_clocked_from_its_sight_is_caught() {
    let p = "no storage write is accepted for an attempt whose lease expired";
    let path = run(bound(3, BoundRule::Sight), Some(p))
        .0
        .assert_any_discovery(p);
    eprintln!("counterexample: {:?}", path.into_actions());
}

/// The SDK's decision, but a start from the cited renewal counted from
/// the sight instead of that renewal's send (a mutation): within the 2 s
/// ticks it takes a slow clock — the worker at 80 % sees the lease at
/// 2 s (1.6 s by its clock, fresh), is alive until 6.2 s, and registers
/// after the expiry at 6 s.
#[test]
fn a_bound_attempt_clocked_from_its_sight_when_fresh_is_caught() {
    let mut cfg = bound(3, BoundRule::SightWhenFresh);
    cfg.workers = 1;
    cfg.drift_percent = 20;
    let p = "no storage write is accepted for an attempt whose lease expired";
    let path = run(cfg, Some(p)).0.assert_any_discovery(p);
    eprintln!("counterexample: {:?}", path.into_actions());
}

/// The operator citing the renewal the API server has now instead of the
/// one its cache shows (a variant): safe, as the argument says — that
/// renewal was sent before the create too. One worker renewing once while
/// idle, 6 s. Not in CI for its cost (2.3 M states, ≈ 50 s).
#[test]
#[ignore = "deep: about a minute"]
fn safe_when_a_bound_lease_cites_the_newest_renewal() {
    let mut cfg = bound(3, BoundRule::NewestCitation);
    cfg.workers = 1;
    cfg.idle_renewals = 1;
    assert_safe(
        cfg,
        &["a bound lease cites a renewal the operator's cache did not show"],
    );
}

/// Takes `steps` from the initial state of `cfg`, each enabled and
/// changing something.
fn replay(cfg: Config, steps: &[Action]) -> State {
    let model = Cluster::new(cfg);
    let mut s = model.init_states().remove(0);
    for a in steps {
        let mut enabled = Vec::new();
        model.actions(&s, &mut enabled);
        assert!(enabled.contains(a), "{a:?} is not enabled");
        s = model.next_state(&s, a.clone()).expect("a step");
    }
    s
}

/// One worker, one deletion of its WorkerLease by someone else, one idle
/// renewal.
fn deleted(rule: BoundRule) -> Config {
    let mut cfg = bound(3, rule);
    cfg.workers = 1;
    cfg.worker_deletions = 1;
    cfg.idle_renewals = 1;
    cfg
}

/// The steps of the gap up to the worker's sight of the lease: the
/// operator binds `t-1` to `w0` on its cache (citing the renewal its
/// WorkerLease's create carried at 0) while someone has deleted that
/// WorkerLease; it sees the departure after the claim, and with no copy
/// to revoke on it ends the lease at 6 s on the departure (the rule for a
/// claimed attempt: its worker stops it at the 404). Then `w0` renews its
/// WorkerLease (404: it creates it again) and its watch delivers the
/// create of `t-1`, whose citation is 6 s old.
fn until_the_sight() -> Vec<Action> {
    let wl = worker_lease_name("w0");
    vec![
        Action::SyncTask,
        Action::SyncWorkerLeases,
        Action::DeleteWorkerLease(wl),
        Action::Reconcile(0),
        Action::SendWrite(0),
        Action::SyncTask,
        Action::SendAddressed(0, 0),
        Action::SyncLeases,
        Action::Tick,
        Action::Tick,
        Action::SyncWorkerLeases,
        Action::Tick,
        Action::Reconcile(0),
        Action::SendWrite(0),
        Action::Renew(0),
        Action::SeeBound(0, "t-1".into()),
    ]
}

/// **A gap of the SDK's rule** (found by the checker, 19 steps): a bound
/// lease the worker first sees after it found its WorkerLease gone and
/// created it again waits for a renewal naming it — a renewal of the
/// *new* WorkerLease, which the operator never had to revoke in: it ended
/// the lease on the old one's departure. The renewal succeeds, the
/// attempt starts from its send (6 s, alive until 9.3 s) and registers
/// after its lease expired. Replayed here (the breadth-first search finds
/// it in `a_bound_attempt_confirmed_on_a_new_worker_lease_is_caught`);
/// production times the end differently (the WorkerLease read directly
/// and found gone twice a TTL apart) but ends the lease without a
/// revocation all the same (`docs/model.md`, "Bound attempts").
#[test]
fn a_bound_attempt_confirmed_on_a_new_worker_lease_writes_after_its_expiry() {
    let mut steps = until_the_sight();
    let s = replay(deleted(BoundRule::FirstCut), &steps);
    let t1 = s.api.lease("t-1").expect("t-1");
    assert_eq!(t1.status.and_then(|st| st.phase), Some(LeasePhase::Expired));
    steps.extend([
        Action::Renew(0),
        Action::LookBound(0, "t-1".into()),
        Action::Register(0),
    ]);
    let s = replay(deleted(BoundRule::FirstCut), &steps);
    assert!(
        s.write_after_expiry,
        "the attempt's registration was accepted after its lease expired"
    );
    // The SDK's rule: the citation is of a WorkerLease found gone
    // since, so the lease is given back at once and never started.
    let s = replay(deleted(BoundRule::Real), &until_the_sight());
    assert!(s.fleet.clients[0].bound.is_empty());
    assert!(matches!(
        s.workers[0],
        batchlease_model::worker::Worker::Idle
    ));
}

/// The same gap found by the search, with the first cut: one worker,
/// 6 s, one WorkerLease deletion, one idle renewal (≈ 7 M states, ≈ 3
/// min). Not in CI for its cost.
#[test]
#[ignore = "deep: about three minutes"]
fn a_bound_attempt_confirmed_on_a_new_worker_lease_is_caught() {
    let p = "no storage write is accepted for an attempt whose lease expired";
    let path = run(deleted(BoundRule::FirstCut), Some(p))
        .0
        .assert_any_discovery(p);
    eprintln!("counterexample: {:?}", path.into_actions());
}

/// With the SDK's rule (`BoundRule::Real`: a citation of
/// a send to an earlier WorkerLease, or unknown after a loss, is given
/// back) the same bound is safe (15.8 M states, ≈ 10 min). Not in CI.
#[test]
#[ignore = "deep: about ten minutes"]
fn safe_when_a_bound_attempt_is_given_back_after_a_worker_lease_loss() {
    assert_safe(
        deleted(BoundRule::Real),
        &[
            "a bound attempt is given back without running",
            "a bound attempt starts from a renewal naming it",
            "an expiry follows the deletion of a WorkerLease",
        ],
    );
}
