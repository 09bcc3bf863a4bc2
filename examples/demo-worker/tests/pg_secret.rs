//! The PostgreSQL password never shows: not in `--help` (clap prints a
//! flag's environment value there), not in logs or errors, and there is no
//! flag to put it on the command line, where every user of the host sees it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::process::{Command, Output};

const PASSWORD: &str = "s3cret-pw";
const URL: &str = "postgres://app:s3cret-pw@127.0.0.1:1/tasks";

/// The demo worker with the given flags and `BATCHLEASE_PG_URL=URL`.
fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_batchlease-demo-worker"))
        .args(args)
        .env("BATCHLEASE_PG_URL", URL)
        .env_remove("BATCHLEASE_PG_URL_FILE")
        .env_remove("BATCHLEASE_KUBECONFIG")
        .env("RUST_LOG", "debug")
        .output()
        .unwrap()
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A directory of this test's own, with a kubeconfig for an API server that
/// is never contacted (creating the client does not connect).
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("demo-worker-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("kubeconfig"),
        "apiVersion: v1\nkind: Config\n\
         clusters: [{name: c, cluster: {server: 'https://127.0.0.1:1'}}]\n\
         users: [{name: u, user: {token: t}}]\n\
         contexts: [{name: x, context: {cluster: c, user: u}}]\n\
         current-context: x\n",
    )
    .unwrap();
    dir
}

#[test]
fn help_does_not_print_the_password_from_the_environment() {
    let out = run(&["--help"]);
    assert!(out.status.success());
    let help = text(&out);
    assert!(help.contains("BATCHLEASE_PG_URL"), "{help}");
    assert!(!help.contains(PASSWORD), "{help}");
}

#[test]
fn the_connection_string_is_not_a_flag() {
    let out = run(&[&format!("--pg-url={URL}")]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
}

#[test]
fn a_failed_connection_names_the_database_but_not_the_password() {
    let dir = scratch("env");
    let kubeconfig = format!("--kubeconfig={}", dir.join("kubeconfig").display());
    let out = run(&[&kubeconfig]);
    let log = text(&out);
    assert!(!out.status.success(), "{log}");
    assert!(log.contains("app@127.0.0.1:1/tasks"), "{log}");
    assert!(!log.contains(PASSWORD), "{log}");

    // The same from a file (e.g. a mounted Secret), which wins over the
    // environment.
    let file = dir.join("pg-url");
    std::fs::write(&file, "postgres://other:s3cret-pw@127.0.0.1:1/files\n").unwrap();
    let out = run(&[&kubeconfig, &format!("--pg-url-file={}", file.display())]);
    let log = text(&out);
    assert!(!out.status.success(), "{log}");
    assert!(log.contains("other@127.0.0.1:1/files"), "{log}");
    assert!(!log.contains(PASSWORD), "{log}");
    std::fs::remove_dir_all(&dir).unwrap();
}
