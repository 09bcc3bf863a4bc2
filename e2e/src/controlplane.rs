//! Faults injected into the test control plane.

use anyhow::{Context, bail};

/// Restarts `component` (`kube-apiserver`, `etcd` or
/// `kube-controller-manager`) of the running test
/// control plane with its original command line after keeping it down for
/// `down` (the outage injected), and waits until it is ready again
/// (`e2e/controlplane/restart.sh`).
pub fn restart(component: &str, down: std::time::Duration) -> anyhow::Result<()> {
    let dir = std::env::var("BATCHLEASE_CP_DIR").context("BATCHLEASE_CP_DIR unset")?;
    let script = crate::crate_dir().join("controlplane/restart.sh");
    let out = std::process::Command::new("bash")
        .arg(&script)
        .args([&dir, component, &down.as_secs().to_string()])
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    if !out.status.success() {
        bail!(
            "restarting {component} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}
