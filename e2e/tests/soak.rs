//! The fault soak in its quick CI mode: ≥ 100 faults of every kind against
//! operator replicas, demo workers, PostgreSQL and the control plane, then
//! the history checker (see `batchlease_e2e::soak`). The seed is printed;
//! `BATCHLEASE_SOAK_SEED` replays one. Its own test binary, since it
//! restarts the shared control plane.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use batchlease_e2e::soak::{self, SoakConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quick_fault_soak_finds_no_violation() {
    let seed = std::env::var("BATCHLEASE_SOAK_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    let report = soak::run(&SoakConfig::quick(seed)).await.unwrap();
    eprintln!("{report}");
    assert!(report.faults.values().sum::<usize>() >= 100, "{report}");
    assert!(report.violations.is_empty(), "{report}");
}
