//! The bounded model check run in CI, and the two known bugs it must find.
//! Each configuration is explored completely (BFS to a fixed point within
//! its time bound); the state counts are printed (`--nocapture`).
//! Deeper runs: `model-check` (docs/model.md, e2e/bench/RESULTS.md).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use batchlease_model::storage::StorageRule;
use batchlease_model::{Cluster, Config, KillRule, RepairRule};
use stateright::{Checker, HasDiscoveries, Model};

const SAFETY: [&str; 6] = [
    "at most one attempt's effect is committed",
    "a token is used by at most one lease",
    "tokens of created leases strictly increase",
    "never two Held leases",
    "no accepted storage write carries a token below a registered one",
    "no storage write is accepted for an attempt whose lease expired",
];

fn config(ticks: u8, crashes: u8, deletions: u8) -> Config {
    Config {
        max_ticks: ticks,
        operator_crashes: crashes,
        lease_deletions: deletions,
        ..Config::quick()
    }
}

fn run(cfg: Config, stop_at: Option<&'static str>) -> impl Checker<Cluster> {
    let started = Instant::now();
    let mut checker = Cluster::new(cfg.clone())
        .checker()
        .threads(2)
        .timeout(Duration::from_secs(300));
    if let Some(p) = stop_at {
        checker = checker.finish_when(HasDiscoveries::AnyOf(BTreeSet::from([p])));
    }
    let checker = checker.spawn_bfs().join();
    eprintln!(
        "{cfg:?}: {} states ({} unique), depth {}, {:.1?}",
        checker.state_count(),
        checker.unique_state_count(),
        checker.max_depth(),
        started.elapsed()
    );
    checker
}

/// Checks `cfg` completely: no safety counterexample, and every situation
/// in `reached` (coverage properties) was reached.
fn assert_safe(cfg: Config, reached: &[&'static str]) {
    let checker = run(cfg, None);
    assert!(
        checker.is_done(),
        "the bounded check did not finish in time"
    );
    for p in SAFETY {
        checker.assert_no_discovery(p);
    }
    checker.assert_any_discovery("the task succeeds");
    for p in reached {
        checker.assert_any_discovery(p);
    }
}

/// Claims, pauses past the kill switch, expiry and reassignment to the
/// other worker, late commits: 8 s of two workers and one operator.
#[test]
fn safe_through_pauses_expiry_and_reassignment() {
    assert_safe(
        config(4, 0, 0),
        &[
            "two workers hold attempts at once",
            "an expired lease's task is offered again",
            "storage refuses a stale attempt",
        ],
    );
}

/// The operator crashes once anywhere, losing its cache, its observations
/// and an issue's second write, which may still land afterwards.
#[test]
fn safe_when_the_operator_crashes() {
    assert_safe(
        config(2, 1, 0),
        &["a crashed operator's request lands late"],
    );
}

/// Someone deletes a held lease while its holder works on.
#[test]
fn safe_when_a_held_lease_is_deleted() {
    assert_safe(config(1, 0, 1), &["a tombstone retires a token"]);
}

/// The liveness check can fail: with no worker the task never finishes,
/// and the checker says so.
#[test]
fn the_liveness_check_is_not_vacuous() {
    let mut cfg = config(3, 0, 0);
    cfg.workers = 0;
    cfg.fair = true;
    run(cfg, None).assert_any_discovery("the task finishes");
}

/// Workers' clocks run 10 % fast or slow (every combination): the kill
/// switch fires early or late by their own clock.
#[test]
fn safe_with_drifting_worker_clocks() {
    let mut cfg = config(3, 0, 0);
    cfg.drift_percent = 10;
    assert_safe(cfg, &[]);
}

/// A claim or a renewal is applied but its answer is lost: the worker
/// does not know it holds a lease, or does not count a renewal.
#[test]
fn safe_when_answers_are_lost() {
    let mut cfg = config(2, 0, 0);
    cfg.lost_answers = 1;
    assert_safe(cfg, &[]);
}

/// Liveness: with one worker and the operator taking every step they can
/// before time moves on (fairness), every path ends with the task
/// finished.
#[test]
fn the_task_finishes_under_fairness() {
    let mut cfg = config(6, 0, 0);
    cfg.workers = 1;
    cfg.fair = true;
    let checker = run(cfg, None);
    assert!(checker.is_done());
    checker.assert_no_discovery("the task finishes");
    for p in SAFETY {
        checker.assert_no_discovery(p);
    }
}

/// A worker without a kill switch (a mutation of the SDK): its writes land
/// after its lease expired, and the checker says so. With the SDK's
/// `KillClock` they cannot (the bounds above).
#[test]
fn a_worker_without_a_kill_switch_is_caught() {
    let mut cfg = config(4, 0, 0);
    cfg.kill = KillRule::Never;
    let p = "no storage write is accepted for an attempt whose lease expired";
    let path = run(cfg, Some(p)).assert_any_discovery(p);
    eprintln!("counterexample: {:?}", path.into_actions());
}

/// The rule before issue 7: a current lease found gone was created again
/// under the same token — two leases, two holders, one token.
#[test]
fn the_same_token_repair_is_caught() {
    let mut cfg = config(2, 0, 1);
    cfg.repair = RepairRule::SameToken;
    let p = "a token is used by at most one lease";
    let path = run(cfg, Some(p)).assert_any_discovery(p);
    eprintln!("counterexample: {:?}", path.into_actions());
}

/// The storage rule before issue 7: no registration, a commit accepted if
/// its token is at least the stored one — a holder paused between its
/// fence check and its write commits after its successor did not yet.
#[test]
fn commit_without_registration_is_caught() {
    let mut cfg = config(4, 0, 0);
    cfg.storage = StorageRule::CommitOnly;
    let p = "at most one attempt's effect is committed";
    let path = run(cfg, Some(p)).assert_any_discovery(p);
    eprintln!("counterexample: {:?}", path.into_actions());
}
