//! The real `helm` built by `e2e/controlplane/build.sh` (`BATCHLEASE_HELM`),
//! run from the repository root so `charts/…` paths work.

use std::process::Command;

use anyhow::Context;

use crate::kubectl::Output;

/// The helm binary.
pub fn binary() -> anyhow::Result<String> {
    std::env::var("BATCHLEASE_HELM").context("BATCHLEASE_HELM unset: run hack/test.sh")
}

/// Runs helm with `args`.
pub fn run(args: &[&str]) -> anyhow::Result<Output> {
    let bin = binary()?;
    let out = Command::new(&bin)
        .args(args)
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .output()
        .with_context(|| format!("running {bin} {}", args.join(" ")))?;
    Ok(Output {
        success: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    })
}

/// Runs helm and fails with its output unless it succeeded.
pub fn ok(args: &[&str]) -> anyhow::Result<String> {
    let out = run(args)?;
    anyhow::ensure!(
        out.success,
        "helm {} failed:\n{}",
        args.join(" "),
        out.combined()
    );
    Ok(out.stdout)
}

/// The documents of `helm template` output of `kind`.
pub fn rendered(yaml: &str, kind: &str) -> anyhow::Result<Vec<serde_json::Value>> {
    let mut out = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(yaml) {
        let v: serde_json::Value = serde::Deserialize::deserialize(doc)?;
        if v.get("kind").and_then(|k| k.as_str()) == Some(kind) {
            out.push(v);
        }
    }
    Ok(out)
}
