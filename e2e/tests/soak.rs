//! The fault soak in its quick CI mode: ≥ 100 faults of every kind against
//! operator replicas, demo workers, PostgreSQL and the control plane, then
//! the history checker (see `batchlease_e2e::soak`), with the workers
//! renewing per lease, then per worker (WorkerLeases). The seed is printed;
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
    // Both protocols, one after the other (each restarts the shared
    // control plane): today's per-lease renewals, then WorkerLeases.
    for renew_per_worker in [false, true] {
        let cfg = SoakConfig {
            renew_per_worker,
            ..SoakConfig::quick(seed)
        };
        let report = soak::run(&cfg).await.unwrap();
        eprintln!("{report}");
        assert!(report.faults.values().sum::<usize>() >= 100, "{report}");
        assert!(report.violations.is_empty(), "{report}");
        // Renewing per worker, the workers take bound attempts too: the
        // soak's faults hit that path as well as claims.
        assert_eq!(report.bound > 0, renew_per_worker, "{report}");
    }
}
