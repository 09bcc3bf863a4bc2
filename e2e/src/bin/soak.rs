//! The fault soak's full run (`hack/soak.sh`): `--faults=1000 --tasks=1000
//! --seed=N --workers=3 --slots=2 [--renew-per-worker] [--drain-seconds=300]`.
//! Prints the report; exits 1 on any violation. See `batchlease_e2e::soak`.
//! A drain longer than the default 300 s gets the history checker's
//! verdict on a run whose tasks finish late (the missed default deadline
//! is then the only liveness finding to report).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use batchlease_e2e::soak::{self, SoakConfig};

fn arg(name: &str) -> Option<u64> {
    let flag = format!("--{name}=");
    std::env::args().find_map(|a| a.strip_prefix(&flag).and_then(|v| v.parse().ok()))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut cfg = SoakConfig::quick(arg("seed").unwrap_or_else(rand::random));
    if let Some(n) = arg("faults") {
        cfg.faults = n as usize;
        cfg.tasks = (n as usize).max(cfg.tasks);
    }
    if let Some(n) = arg("tasks") {
        cfg.tasks = n as usize;
    }
    if let Some(n) = arg("workers") {
        cfg.workers = n as usize;
    }
    if let Some(n) = arg("slots") {
        cfg.slots = n as usize;
    }
    if let Some(n) = arg("drain-seconds") {
        cfg.drain = std::time::Duration::from_secs(n);
    }
    cfg.renew_per_worker = std::env::args().any(|a| a == "--renew-per-worker");
    let report = soak::run(&cfg).await?;
    println!("{report}");
    if !report.violations.is_empty() {
        std::process::exit(1);
    }
    Ok(())
}
