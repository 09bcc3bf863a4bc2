//! `crdgen --check` fails when the checked-in CRDs drift from the types.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

fn crdgen(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_crdgen"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[test]
fn check_passes_on_generated_files_and_fails_on_drift() {
    let root = std::env::temp_dir().join(format!("crdgen-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let r = root.to_str().unwrap();

    let (ok, out) = crdgen(&["--root", r, "--check"]);
    assert!(!ok, "missing files must fail the check: {out}");

    let (ok, out) = crdgen(&["--root", r]);
    assert!(ok, "{out}");
    let (ok, out) = crdgen(&["--root", r, "--check"]);
    assert!(ok, "freshly generated files pass: {out}");

    // A hand edit in the chart's copy is drift.
    let chart = root.join("charts/batchlease-operator/crds/taskleases.batchlease.dev.yaml");
    let text = std::fs::read_to_string(&chart).unwrap();
    std::fs::write(&chart, text.replace("is immutable", "is IMMUTABLE")).unwrap();
    let (ok, out) = crdgen(&["--root", r, "--check"]);
    assert!(!ok);
    assert!(
        out.contains("CRD drift") && out.contains("taskleases.batchlease.dev.yaml"),
        "{out}"
    );

    // The repository's own copies are what the types produce.
    let (ok, out) = crdgen(&["--check"]);
    assert!(ok, "{out}");
    let _ = std::fs::remove_dir_all(&root);
}
