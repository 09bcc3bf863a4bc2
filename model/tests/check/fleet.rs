//! Fleets (issue 27): renewals per worker, the operator's election and
//! addressed offers (the model check of `check.rs`, split by concern).

use super::*;

/// Renewals per worker (issue 27): two workers renew one WorkerLease
/// each, listing the attempt they run, instead of its TaskLease; the
/// operator sees WorkerLeases through a cache of its own. `faults`: how
/// many attempts dropped from `holds` while running, and late renewals.
fn per_worker(ticks: u8, faults: u8) -> Config {
    Config {
        per_worker: true,
        worker_faults: faults,
        ..config(ticks, 0, 0)
    }
}

/// Renewals per worker, 6 s, one fault anywhere: a renewal drops the
/// running attempt from `holds` (renewing one but not another), or a
/// renewal lands late — a zombie's write naming an attempt the operator
/// has expired meanwhile. The WorkerLease stopping while the TaskLease
/// looks live is any worker taking no step. Every property holds;
/// WorkerLease renewals keep attempts alive, and an expiry revokes its
/// attempt first.
#[test]
fn safe_with_renewals_per_worker() {
    assert_safe(
        per_worker(3, 1),
        &[
            "an expired lease's task is offered again",
            "a WorkerLease renewal keeps an attempt alive past its claim's kill switch",
            "a worker stops an attempt revoked in its WorkerLease",
            "an expiry follows a fault of a WorkerLease",
            "a late WorkerLease renewal naming an expired attempt reaches the API server",
        ],
    );
}

/// Renewals per worker, 6 s, one answer lost: a claim's, or a WorkerLease
/// renewal's (applied; the worker's copy is stale and its kill clock not
/// fed).
#[test]
fn safe_when_worker_lease_answers_are_lost() {
    let mut cfg = per_worker(3, 0);
    cfg.lost_answers = 1;
    assert_safe(
        cfg,
        &[
            "an expiry follows a lost claim answer",
            "a WorkerLease renewal keeps an attempt alive past its claim's kill switch",
        ],
    );
}

/// The rule as the design first had it (a mutation): renewals credited by
/// the production rule, the TaskLease expired by its own CAS alone. The
/// operator's cache of WorkerLeases lags: it expires the lease while the
/// worker's renewals, which it has not seen, keep the attempt alive — and
/// the attempt writes to storage after its lease expired.
#[test]
fn expiring_without_revoking_is_caught() {
    let mut cfg = per_worker(3, 0);
    cfg.worker_rule = WorkerRule::NoRevoke;
    let p = "no storage write is accepted for an attempt whose lease expired";
    let path = run(cfg, Some(p)).0.assert_any_discovery(p);
    eprintln!("counterexample: {:?}", path.into_actions());
}

/// Today's operator with a per-worker SDK (a mutation): only a TaskLease's
/// own `renewTime` counts, so a lease whose worker renews only its worker
/// Lease expires a TTL after its claim while the attempt runs.
#[test]
fn ignoring_worker_leases_is_caught() {
    let mut cfg = per_worker(3, 0);
    cfg.worker_rule = WorkerRule::Ignore;
    let p = "no storage write is accepted for an attempt whose lease expired";
    let path = run(cfg, Some(p)).0.assert_any_discovery(p);
    eprintln!("counterexample: {:?}", path.into_actions());
}

/// Crediting a renewal only to the attempts it lists (a mutation of the
/// production rule): the operator first sees the WorkerLease at the
/// renewal that dropped the running attempt; the versions before, which
/// listed it and fed its kill clock, it never saw — it expires the lease
/// and the attempt writes after.
#[test]
fn crediting_only_the_listed_attempts_is_caught() {
    let mut cfg = per_worker(3, 1);
    cfg.worker_rule = WorkerRule::NamedOnly;
    let p = "no storage write is accepted for an attempt whose lease expired";
    let path = run(cfg, Some(p)).0.assert_any_discovery(p);
    eprintln!("counterexample: {:?}", path.into_actions());
}

/// Someone other than its worker deletes a WorkerLease, at any step: safe
/// now that the operator credits a departure — the deletion's last state
/// (its Delete event) carrying a renewal not seen counts as a renewal
/// observed then — and its worker stops its attempts at the 404 and
/// creates the object again with nothing listed. (With the coordination
/// Lease carrier, which credited no departure, the checker found this
/// unsafe: renewals the cache had not shown yet were hidden by the
/// deletion.)
#[test]
fn safe_when_a_worker_lease_is_deleted_by_someone_else() {
    let mut cfg = per_worker(3, 0);
    cfg.worker_deletions = 1;
    assert_safe(
        cfg,
        &[
            "a WorkerLease's departure is credited to a held lease",
            "a worker stops its attempts when its WorkerLease is gone",
            "an expiry follows the deletion of a WorkerLease",
        ],
    );
}

/// Crediting no departure (a mutation of the production rule): the
/// renewals at 2 s and 4 s not yet in the operator's cache, the
/// WorkerLease deleted, the operator's cache shows it gone and credits
/// nothing; with no copy to revoke on it expires the lease a TTL after the
/// claim, and the worker, fed until 7.3 s, registers.
#[test]
fn ignoring_worker_lease_departures_is_caught() {
    let mut cfg = per_worker(3, 0);
    cfg.worker_deletions = 1;
    cfg.worker_rule = WorkerRule::IgnoreDepartures;
    let p = "no storage write is accepted for an attempt whose lease expired";
    let path = run(cfg, Some(p)).0.assert_any_discovery(p);
    eprintln!("counterexample: {:?}", path.into_actions());
}

/// A TaskLease deleted while held in per-worker mode, its task cancelled:
/// one worker, `ticks`. The holder renews only its WorkerLease, so it learns
/// of the deletion at a refresh of the TaskLease (404) — which the SDK
/// makes at least every R — or stops R + 2/3·TTL after the last one.
fn lost_per_worker(ticks: u8, wait: LostWait) -> Config {
    let mut cfg = per_worker(ticks, 0);
    cfg.workers = 1;
    cfg.cancel = true;
    cfg.lease_deletions = 1;
    cfg.lost_wait = wait;
    cfg
}

/// With the loss timed by the refresh bound (R + TTL after it was
/// recorded) the task does not end while the holder may run. 4 s: the
/// cancel, the deletion, the loss recorded, the holder's refresh meeting
/// 404 (6 s, where today's rule ends the task, does not finish within the
/// CI timeout: 8.2 M states in 300 s).
#[test]
fn safe_when_a_worker_mode_lease_is_deleted() {
    assert_safe(
        lost_per_worker(2, LostWait::RefreshBound),
        &[
            "a task is cancelled",
            "a tombstone retires a token",
            "a worker stops an attempt whose TaskLease refresh meets 404",
        ],
    );
}

/// Today's `decide` times a lost lease's holder by the lease's TTL (+ 1 s)
/// after the loss was recorded — the per-lease bound. A Worker-mode
/// holder, fed by its WorkerLease, runs until R + 2/3·TTL after its last
/// refresh: the task ends `Cancelled` and the holder commits after (27
/// steps). The production rule's gap, kept until `decide` is fixed; not
/// in CI for its cost: `cargo test --release -p batchlease-model --test
/// check -- --ignored`.
#[test]
#[ignore = "deep: about four minutes"]
fn timing_a_lost_worker_mode_holder_by_its_ttl_is_caught() {
    let p = "no storage write is accepted after the task is Cancelled";
    let path = run(lost_per_worker(3, LostWait::Ttl), Some(p))
        .0
        .assert_any_discovery(p);
    eprintln!("counterexample: {:?}", path.into_actions());
}

/// The operator's own election (issue 23): two replicas, one hand edit of
/// the election Lease anywhere (deleted, holder cleared, holder set to
/// either replica), renewals that land late or never, for `ticks` seconds.
fn election(ticks: u8, rule: ElectionRule) -> ElectionConfig {
    ElectionConfig {
        max_ticks: ticks,
        edits: 1,
        rule,
    }
}

const ELECTION_SAFETY: [&str; 2] = [
    "never two replicas in a term at once",
    "a term handed out runs with its controllers",
];

fn run_election(
    cfg: ElectionConfig,
    stop_at: Option<&'static str>,
) -> (impl Checker<Election>, bool) {
    let started = Instant::now();
    let mut checker = Election::new(cfg.clone())
        .checker()
        .threads(2)
        .timeout(TIMEOUT);
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
    (checker, started.elapsed() < TIMEOUT)
}

/// The real rule: never two replicas in a term, never a term without
/// controllers, through deletions, hand edits, takeovers and late renewals.
#[test]
fn the_election_is_safe_through_edits_and_late_renewals() {
    let (checker, finished) = run_election(election(ELECTION_TICKS, ElectionRule::Real), None);
    assert!(finished, "the bounded check did not finish in time");
    for p in ELECTION_SAFETY {
        checker.assert_no_discovery(p);
    }
    for p in [
        "a replica leads",
        "a replica takes the Lease over from another holder",
        "the Lease is created again after a deletion",
        "a renewal answers after its term ended",
        "a late renewal's replica leads a new term",
    ] {
        checker.assert_any_discovery(p);
    }
}

/// The mutations of the rules before issue 23, each caught.
#[test]
fn the_old_election_rules_are_caught() {
    for (rule, p) in [
        (ElectionRule::CreateAtOnce, ELECTION_SAFETY[0]),
        (ElectionRule::TrustVacated, ELECTION_SAFETY[0]),
        (ElectionRule::ReviveTerm, ELECTION_SAFETY[1]),
    ] {
        let (checker, _) = run_election(election(ELECTION_TICKS, rule), Some(p));
        let path = checker.assert_any_discovery(p);
        eprintln!("{rule:?}: counterexample: {:?}", path.into_actions());
    }
}

/// Seconds explored by the election bounds.
const ELECTION_TICKS: u8 = 6;

/// Addressed offers (issue 27): renewals per worker, each WorkerLease
/// saying one slot; the operator addresses each offer to the live worker
/// with the most free slots and re-addresses it by a CAS when its worker
/// lapsed in its view (`lapses` times, any worker, any step) or left it
/// unclaimed for a TTL.
fn addressed(ticks: u8, lapses: u8) -> Config {
    Config {
        addressed: true,
        lapses,
        ..per_worker(ticks, 0)
    }
}

/// An offer addressed to a worker that lapsed (dead, paused, or its
/// WorkerLease unseen), at any step: the operator addresses it to the
/// other worker — racing the first one's claim (a claim landing first
/// makes the re-address meet 409) — or, with the other worker busy or
/// lapsed too, drops the address; every property holds, the new ones
/// included: a lease addressed at its claim is held by its addressee, a
/// claimed lease's address never changes. 0 s, one operator crash
/// anywhere (its book and view lost, a re-address landing late).
#[test]
fn safe_when_an_addressed_offer_is_moved() {
    let mut cfg = addressed(0, 2);
    cfg.operator_crashes = 1;
    assert_safe(
        cfg,
        &[
            "an offer is addressed again after its worker lapsed",
            "an offer's address is dropped",
            "an offer first addressed to one worker is claimed by another",
            "a re-address meets 409: a claim landed first",
        ],
    );
}

/// Addressed offers through an expiry and a reassignment, 6 s: an offer
/// left unclaimed for a TTL by a live worker (paused) is moved to the
/// other, the next offer after an expiry goes to the worker with a free
/// slot.
#[test]
fn safe_when_an_addressed_offer_waits_a_ttl() {
    assert_safe(
        addressed(3, 0),
        &[
            "an offer is addressed again after a TTL unclaimed",
            "an offer first addressed to one worker is claimed by another",
            "an expired lease's task is offered again",
        ],
    );
}

/// An older worker (the last one) claims any offer of its queue: the SDK
/// before its filter, whose claim keeps `offeredTo`, and an SDK built
/// before the field, whose claim drops it — either refused by rule B
/// unless the offer was addressed to it (rule A lets the addressee's claim
/// drop the address).
#[test]
fn safe_when_an_older_worker_claims_addressed_offers() {
    for old in [OldClaim::KeepsField, OldClaim::DropsField] {
        let mut cfg = addressed(0, 1);
        cfg.old_worker = Some(old);
        assert_safe(
            cfg,
            &["an older worker's claim of an addressed offer is refused"],
        );
    }
}

/// Without rule B (a mutation of the CRD): an SDK that does not look at
/// the address (as before the SDK's filter) claims an offer addressed to
/// the other worker.
#[test]
fn a_claim_by_another_worker_without_rule_b_is_caught() {
    let mut cfg = addressed(0, 0);
    cfg.old_worker = Some(OldClaim::KeepsField);
    cfg.address_rule = AddressRule::NoClaimRule;
    let p = "a lease addressed at its claim is held by its addressee";
    let path = run(cfg, Some(p)).0.assert_any_discovery(p);
    eprintln!("counterexample: {:?}", path.into_actions());
}

/// Without rule B (a mutation of the CRD): an SDK built before the field
/// drops `offeredTo` in its claim (which rule A allows: from the claim on
/// the address may be dropped) — it holds an offer addressed to the other
/// worker. Rule B judges the address before the claim.
#[test]
fn a_claim_dropping_the_address_without_rule_b_is_caught() {
    let mut cfg = addressed(0, 0);
    cfg.old_worker = Some(OldClaim::DropsField);
    cfg.address_rule = AddressRule::NoClaimRule;
    let p = "a lease addressed at its claim is held by its addressee";
    let path = run(cfg, Some(p)).0.assert_any_discovery(p);
    eprintln!("counterexample: {:?}", path.into_actions());
}

/// The re-address without its CAS (a merge patch on the lease as stored),
/// rules kept: a re-address decided on a stale copy lands on the claimed
/// lease and rule A (or B) refuses it — the CAS is not what keeps a claim.
#[test]
fn safe_when_a_readdress_is_a_patch() {
    let mut cfg = addressed(0, 1);
    cfg.address_rule = AddressRule::Patch;
    assert_safe(
        cfg,
        &["a re-address of a claimed lease is refused by the CRD"],
    );
}

/// Without the CAS and without rule A (a mutation): the operator, its
/// cache not yet showing `w0`'s claim, moves the offer to `w1`, having
/// judged `w0` lapsed — the patch lands on the claimed lease (rule B looks
/// only at claims): a held lease addressed to another worker.
#[test]
fn a_readdress_without_cas_or_rule_a_is_caught() {
    let mut cfg = addressed(0, 1);
    cfg.address_rule = AddressRule::PatchNoFixedRule;
    let p = "a claimed lease's address is never set or changed";
    let path = run(cfg, Some(p)).0.assert_any_discovery(p);
    eprintln!("counterexample: {:?}", path.into_actions());
}

/// Liveness: worker 0 is dead (it takes no step; its WorkerLease stands),
/// every other actor acts before time moves on, 12 s: an offer addressed
/// to the dead worker is moved to the other, which claims it — the task
/// finishes on every path. Twice: the operator's view of the dead worker
/// never lapses (the offer moves after a TTL unclaimed), or lapses (under
/// fairness, before time moves: it moves at once).
#[test]
fn an_offer_addressed_to_a_dead_worker_is_claimed_by_another_under_fairness() {
    for (lapses, moved) in [
        (0, "an offer is addressed again after a TTL unclaimed"),
        (1, "an offer is addressed again after its worker lapsed"),
    ] {
        let mut cfg = addressed(6, lapses);
        cfg.dead_worker = true;
        cfg.fair = true;
        let (checker, finished) = run(cfg, None);
        assert!(finished);
        checker.assert_no_discovery("the task finishes");
        for p in SAFETY {
            checker.assert_no_discovery(p);
        }
        for p in [
            "an offer first addressed to one worker is claimed by another",
            moved,
        ] {
            checker.assert_any_discovery(p);
        }
    }
}
