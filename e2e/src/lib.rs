//! Harness for the end-to-end tests.
//!
//! The tests run against the control plane and PostgreSQL that
//! `e2e/controlplane/up.sh` and `e2e/postgres/up.sh` start (`hack/test.sh`
//! does both); their env files tell where. Every test gets its own
//! namespace, waits on conditions with deadlines, and prints diagnostics
//! (object YAML, events, component logs) when a wait fails.

// A test-only crate: failing loudly is the point.
#![allow(clippy::unwrap_used, clippy::expect_used)]

pub mod api_requests;
pub mod audit;
pub mod browser;
pub mod chart;
pub mod cluster;
pub mod conformance;
pub mod controlplane;
pub mod dashboard;
pub mod helm;
pub mod history;
pub mod history_controls;
pub mod history_graph;
pub mod history_speculative;
pub mod history_workers;
pub mod identity;
pub mod kubectl;
pub mod node;
pub mod node_world;
pub mod oci;
pub mod operator;
pub mod pg;
pub mod ports;
pub mod process;
pub mod proxy;
pub mod runner;
pub mod secrets;
pub mod soak;
pub mod structure;
pub mod tasks;
pub mod wait;
pub mod worker;
pub mod workers;

pub use cluster::{Cluster, TestNamespace};

/// The e2e crate's directory. Cargo sets `CARGO_MANIFEST_DIR` when it runs
/// a test, and that is read first: the compile-time value can name another
/// checkout whose build cargo reused from a shared target directory (a CI
/// clone elsewhere), where `kubectl` then failed to start ("No such file or
/// directory" for its working directory).
pub fn crate_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(std::path::PathBuf::from)
        .filter(|p| p.join("Cargo.toml").is_file())
        .unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into())
}

/// The repository root (kubectl and helm run from it so relative paths such
/// as `examples/` work).
pub fn repo_root() -> std::path::PathBuf {
    crate_dir().join("..")
}
pub use wait::wait_for;
