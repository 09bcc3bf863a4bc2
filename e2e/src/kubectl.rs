//! Running the real `kubectl` (and `helm`) built by `e2e/controlplane/build.sh`.

use std::process::Command;

use anyhow::Context;

/// What a finished command printed.
#[derive(Debug)]
pub struct Output {
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    /// stdout and stderr together, for diagnostics.
    pub fn combined(&self) -> String {
        format!("{}{}", self.stdout, self.stderr)
    }
}

/// The kubectl binary: `$BATCHLEASE_KUBECTL`, which the control plane's env
/// file sets to the v1.37 build (the machine's own kubectl may be too old).
pub fn binary() -> String {
    std::env::var("BATCHLEASE_KUBECTL").unwrap_or_else(|_| "kubectl".into())
}

/// Runs kubectl with `args`, from the repository root so relative paths such
/// as `examples/` work.
pub fn run(args: &[&str]) -> anyhow::Result<Output> {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let out = Command::new(binary())
        .args(args)
        .current_dir(root)
        .output()
        .with_context(|| format!("running {} {}", binary(), args.join(" ")))?;
    Ok(Output {
        success: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    })
}

/// Runs kubectl and fails with its output unless it succeeded.
pub fn ok(args: &[&str]) -> anyhow::Result<String> {
    let out = run(args)?;
    anyhow::ensure!(
        out.success,
        "kubectl {} failed:\n{}",
        args.join(" "),
        out.combined()
    );
    Ok(out.stdout)
}
