//! `model-check`: runs the model checker with the given bounds and prints
//! what it explored and every property's verdict, with the trace of each
//! counterexample (`docs/model.md` keeps two of them).
//!
//! `cargo run -p batchlease-model --release --bin model-check -- --ticks=8
//!  [--workers=2] [--crashes=1] [--deletions=1] [--repair=same-token]
//!  [--lost=1] [--drift=10] [--fair] [--storage=commit-only] [--timeout-seconds=600]`

use std::time::{Duration, Instant};

use batchlease_model::storage::StorageRule;
use batchlease_model::{Cluster, Config, RepairRule};
use stateright::{Checker, Model};

fn main() {
    let mut cfg = Config::quick();
    let mut timeout = Duration::from_secs(600);
    for arg in std::env::args().skip(1) {
        let (k, v) = arg.split_once('=').unwrap_or((arg.as_str(), ""));
        let n = || {
            v.parse::<u8>()
                .unwrap_or_else(|_| panic!("{k} wants a number"))
        };
        match k {
            "--ticks" => cfg.max_ticks = n(),
            "--workers" => cfg.workers = n().into(),
            "--crashes" => cfg.operator_crashes = n(),
            "--deletions" => cfg.lease_deletions = n(),
            "--lost" => cfg.lost_answers = n(),
            "--fair" => cfg.fair = true,
            "--drift" => cfg.drift_percent = n(),
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
    let properties = model.properties();
    let checker = model
        .checker()
        .threads(std::thread::available_parallelism().map_or(1, |n| n.get()))
        .timeout(timeout)
        .spawn_bfs()
        .join();
    println!("{cfg:?}");
    println!(
        "states: {} ({} unique), max depth {}, {:.1?}{}",
        checker.state_count(),
        checker.unique_state_count(),
        checker.max_depth(),
        started.elapsed(),
        if checker.is_done() {
            ""
        } else {
            " (timed out)"
        }
    );
    for p in properties {
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
