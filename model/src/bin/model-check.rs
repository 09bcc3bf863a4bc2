//! `model-check`: runs the model checker with the given bounds and prints
//! what it explored and every property's verdict, with the trace of each
//! counterexample (`docs/model.md` keeps two of them).
//!
//! `cargo run -p batchlease-model --release --bin model-check -- --ticks=8
//!  [--workers=2] [--crashes=1] [--deletions=1] [--repair=same-token]
//!  [--lost=1] [--drift=10] [--fair] [--storage=commit-only]
//!  [--tasks=2 --locks [--holder=ahead-is-dead|gone-is-dead]] [--frozen-wall] [--dedicated]
//!  [--kill=never] [--speculative [--start-quarantined]
//!  [--cas=blind|outside-fence]] [--cancel [--cancel-rule=end-at-release|spec-ttl]]
//!  [--ttl-edit] [--delete-task]
//!  [--per-worker [--worker-faults=1] [--worker-deletions=1]
//!  [--worker-rule=no-revoke|ignore|named-only|ignore-departures]
//!  [--lost-wait=refresh-bound]
//!  [--addressed [--lapses=1] [--old-worker=keeps-field|drops-field] [--dead-worker]
//!  [--address-rule=no-claim-rule|no-fixed-rule|patch|patch-no-fixed-rule]
//!  [--bound [--idle-renewals=1]
//!  [--bound-rule=sight|sight-when-fresh|no-age-limit|newest-citation|first-cut]]]]
//!  [--threads=N] [--stop-at-failure] [--dfs] [--timeout-seconds=600]`
//!
//! `--cancel`: a user may set `spec.cancel` on the first task at any step;
//! `--cancel-rule=end-at-release`: the mutation that ends the task as soon
//! as its held lease is released (the checker must catch it);
//! `--ttl-edit`: the first task is created with a 10 s TTL that a user may
//! cut to 5 s at any step; `--cancel-rule=spec-ttl`: the mutation that
//! times a lost lease's holder by the task's current TTL (the checker must
//! catch it with `--ttl-edit`).
//! `--per-worker`: workers renew a WorkerLease listing their attempts
//! instead of each TaskLease (issue 27); `--worker-faults`: how many
//! attempts dropped from it while running and late renewals;
//! `--worker-deletions`: deletions of a WorkerLease by someone else;
//! `--worker-rule`: the mutations (no revocation before an expiry;
//! WorkerLeases ignored; only listed attempts credited; departures not
//! credited); `--lost-wait=refresh-bound`: a lost Worker-mode lease's
//! holder timed by R + TTL instead of today's TTL.
//! `--addressed` (with `--per-worker`): offers addressed to one worker and
//! re-addressed (issue 27); `--lapses`: how many times the operator's view
//! of a worker lapses; `--old-worker`: the last worker claims whatever the
//! address, keeping or dropping `offeredTo`; `--dead-worker`: worker 0
//! takes no step; `--address-rule`: the mutations (a CEL rule left out, the
//! re-address without its CAS).
//! `--bound` (with `--addressed`): a new offer to a worker with a free
//! slot is created `Held` by it (bound attempts); `--idle-renewals`: how
//! many renewals of an idle worker's WorkerLease; `--bound-rule`: the
//! mutations (the kill clock from the worker's sight of the lease, always
//! or when its citation is fresh) and variants (no age limit on the
//! citation; the operator citing the API server's newest renewal).
//! `--locks`: every task needs the resource `r` (the lock passes between
//! them); `--holder=ahead-is-dead`: the mutation of the holder's liveness
//! rule the checker must catch; `--frozen-wall`, `--dedicated`: see
//! `Config`; `--speculative`: every task is Speculative and commits with a
//! compare-and-swap on a shared key (with `--locks` it respects `r`, and
//! takes it once quarantined); `--start-quarantined`: the last task starts
//! quarantined; `--cas`: the mutations of the swap's rule;
//! `--stop-at-failure`: stop at the first safety counterexample
//! (with `--threads=1`, a shortest one: the search is breadth-first);
//! `--dfs`: search depth-first — the same states, but memory for one path
//! instead of a whole breadth-first frontier (deep runs; its
//! counterexamples are not the shortest).

use std::time::{Duration, Instant};

use batchlease_model::KillRule;
use batchlease_model::bound::BoundRule;
use batchlease_model::fleet::WorkerRule;
use batchlease_model::locks::LockRule;
use batchlease_model::offers::{AddressRule, OldClaim};
use batchlease_model::storage::{CasRule, StorageRule};
use batchlease_model::{Cluster, Config, RepairRule};
use stateright::{Checker, HasDiscoveries, Model};

fn main() {
    let mut cfg = Config::quick();
    let mut timeout = Duration::from_secs(600);
    let mut threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut stop_at_failure = false;
    let mut dfs = false;
    for arg in std::env::args().skip(1) {
        let (k, v) = arg.split_once('=').unwrap_or((arg.as_str(), ""));
        let n = || {
            v.parse::<u8>()
                .unwrap_or_else(|_| panic!("{k} wants a number"))
        };
        match k {
            "--ticks" => cfg.max_ticks = n(),
            "--workers" => cfg.workers = n().into(),
            "--tasks" => cfg.tasks = n().into(),
            "--locks" => cfg.resource = true,
            "--frozen-wall" => cfg.frozen_wall = true,
            "--dedicated" => cfg.dedicated_workers = true,
            "--start-pending" => cfg.start_pending = true,
            "--speculative" => cfg.speculative = true,
            "--start-quarantined" => cfg.start_quarantined = true,
            "--cas" if v == "blind" => cfg.cas = CasRule::Blind,
            "--cas" if v == "outside-fence" => cfg.cas = CasRule::OutsideFence,
            "--kill" if v == "never" => cfg.kill = KillRule::Never,
            "--threads" => threads = n().into(),
            "--stop-at-failure" => stop_at_failure = true,
            "--dfs" => dfs = true,
            "--holder" if v == "ahead-is-dead" => cfg.lock_rule = LockRule::AheadIsDead,
            "--holder" if v == "gone-is-dead" => cfg.lock_rule = LockRule::GoneIsDead,
            "--crashes" => cfg.operator_crashes = n(),
            "--deletions" => cfg.lease_deletions = n(),
            "--lost" => cfg.lost_answers = n(),
            "--fair" => cfg.fair = true,
            "--cancel" => cfg.cancel = true,
            "--ttl-edit" => cfg.ttl_edit = true,
            "--delete-task" => cfg.task_deletion = true,
            "--per-worker" => cfg.per_worker = true,
            "--worker-faults" => cfg.worker_faults = n(),
            "--worker-deletions" => cfg.worker_deletions = n(),
            "--worker-rule" if v == "no-revoke" => cfg.worker_rule = WorkerRule::NoRevoke,
            "--worker-rule" if v == "ignore" => cfg.worker_rule = WorkerRule::Ignore,
            "--worker-rule" if v == "named-only" => cfg.worker_rule = WorkerRule::NamedOnly,
            "--worker-rule" if v == "ignore-departures" => {
                cfg.worker_rule = WorkerRule::IgnoreDepartures;
            }
            "--addressed" => cfg.addressed = true,
            "--bound" => cfg.bound = true,
            "--idle-renewals" => cfg.idle_renewals = n(),
            "--bound-rule" if v == "sight" => cfg.bound_rule = BoundRule::Sight,
            "--bound-rule" if v == "sight-when-fresh" => cfg.bound_rule = BoundRule::SightWhenFresh,
            "--bound-rule" if v == "no-age-limit" => cfg.bound_rule = BoundRule::NoAgeLimit,
            "--bound-rule" if v == "newest-citation" => cfg.bound_rule = BoundRule::NewestCitation,
            "--bound-rule" if v == "first-cut" => {
                cfg.bound_rule = BoundRule::FirstCut;
            }
            "--lapses" => cfg.lapses = n(),
            "--dead-worker" => cfg.dead_worker = true,
            "--old-worker" if v == "keeps-field" => cfg.old_worker = Some(OldClaim::KeepsField),
            "--old-worker" if v == "drops-field" => cfg.old_worker = Some(OldClaim::DropsField),
            "--address-rule" if v == "no-claim-rule" => cfg.address_rule = AddressRule::NoClaimRule,
            "--address-rule" if v == "no-fixed-rule" => cfg.address_rule = AddressRule::NoFixedRule,
            "--address-rule" if v == "patch" => cfg.address_rule = AddressRule::Patch,
            "--address-rule" if v == "patch-no-fixed-rule" => {
                cfg.address_rule = AddressRule::PatchNoFixedRule;
            }
            "--lost-wait" if v == "refresh-bound" => {
                cfg.lost_wait = batchlease_model::fleet::LostWait::RefreshBound;
            }
            "--cancel-rule" if v == "spec-ttl" => {
                cfg.cancel_rule = batchlease_model::cancel::CancelRule::SpecTtl;
            }
            "--cancel-rule" if v == "end-at-release" => {
                cfg.cancel_rule = batchlease_model::cancel::CancelRule::EndAtRelease;
            }
            "--drift" => cfg.drift_percent = n(),
            "--fast" => cfg.fast_percent = n(),
            "--repair" if v == "same-token" => cfg.repair = RepairRule::SameToken,
            "--storage" if v == "commit-only" => cfg.storage = StorageRule::CommitOnly,
            "--timeout-seconds" => {
                timeout = Duration::from_secs(v.parse().unwrap_or(600));
            }
            _ => panic!("unknown argument {arg}"),
        }
    }
    let started = Instant::now();
    let model = Cluster::new(cfg.clone());
    let mut checker = model.checker().threads(threads).timeout(timeout);
    if stop_at_failure {
        checker = checker.finish_when(HasDiscoveries::AnyFailures);
    }
    println!("{cfg:?}");
    if dfs {
        report(&checker.spawn_dfs().join(), started, timeout);
    } else {
        report(&checker.spawn_bfs().join(), started, timeout);
    }
}

/// What `checker` explored, and every property's verdict.
fn report(checker: &impl Checker<Cluster>, started: Instant, timeout: Duration) {
    // stateright's is_done() is also true after a timeout.
    let timed_out = started.elapsed() >= timeout;
    println!(
        "states: {} ({} unique), max depth {}, {:.1?}{}",
        checker.state_count(),
        checker.unique_state_count(),
        checker.max_depth(),
        started.elapsed(),
        if timed_out { " (timed out)" } else { "" }
    );
    for p in checker.model().properties() {
        match checker.discovery(p.name) {
            None => println!("  {:?} {}: no counterexample", p.expectation, p.name),
            Some(path) => {
                println!("  {:?} {}: FOUND, trace:", p.expectation, p.name);
                for action in path.into_actions() {
                    println!("    {action:?}");
                }
            }
        }
    }
}
