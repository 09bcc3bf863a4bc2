//! The Helm chart carries exactly the generated CRDs, and the real helm
//! (built by `e2e/controlplane/build.sh`) accepts it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

fn helm(args: &[&str]) -> String {
    let bin = std::env::var("BATCHLEASE_HELM").expect("BATCHLEASE_HELM unset: run hack/test.sh");
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let out = Command::new(&bin)
        .args(args)
        .current_dir(root)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "helm {} failed:\n{}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn chart_lints_and_ships_the_generated_crds() {
    let version = helm(&["version", "--short"]);
    assert!(version.starts_with("v3."), "{version}");
    let lint = helm(&["lint", "charts/batchlease-operator"]);
    assert!(lint.contains("0 chart(s) failed"), "{lint}");

    let shown = helm(&["show", "crds", "charts/batchlease-operator"]);
    for file in [
        "batchtasks.batchlease.dev.yaml",
        "taskleases.batchlease.dev.yaml",
    ] {
        let crd = std::fs::read_to_string(format!("{}/../crds/{file}", env!("CARGO_MANIFEST_DIR")))
            .unwrap();
        assert!(
            shown.contains(crd.trim()),
            "chart's {file} differs from crds/{file}"
        );
    }
}
