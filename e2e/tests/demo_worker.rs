//! The demo worker's configuration edges: without a PostgreSQL connection
//! string it runs anyway and says plainly that its commits are not fenced
//! in storage (it used to refuse to start); its log file carries no colour
//! codes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use batchlease_api::TaskPhase;
use batchlease_e2e::operator::Operator;
use batchlease_e2e::process::Process;
use batchlease_e2e::tasks::{self, wait_phase};
use batchlease_e2e::workers;
use serde_json::json;

#[tokio::test]
async fn runs_without_postgres_and_says_commits_are_not_fenced() {
    let (ns, op) = Operator::in_new_namespace("nopg", "op", Duration::from_secs(30))
        .await
        .unwrap();
    // Only what a pod would have: no BATCHLEASE_PG_URL in the environment.
    let env = vec![
        (
            "KUBECONFIG".to_owned(),
            std::env::var("KUBECONFIG").unwrap(),
        ),
        ("RUST_LOG".to_owned(), "info,kube=warn".to_owned()),
        ("BATCHLEASE_TASK_NAMESPACE".to_owned(), ns.name.clone()),
        ("POD_NAME".to_owned(), "nopg-0".to_owned()),
    ];
    let worker = Process::start_clean(
        workers::binary().unwrap(),
        &ns.name,
        "worker-nopg",
        vec!["--queues=demo".into()],
        env,
    )
    .unwrap();
    tasks::create(
        &ns,
        "job",
        json!({"queue": "demo", "payload": {"steps": 1, "stepMillis": 10}}),
    )
    .await
    .unwrap();
    tasks::create(
        &ns,
        "transfer",
        json!({"queue": "demo", "payload": {"transfer": {"from": "a", "to": "b", "amount": 1}}}),
    )
    .await
    .unwrap();
    let logs = || format!("{}{}", op.logs(), worker.logs());
    let done = wait_phase(
        &ns,
        "job",
        TaskPhase::Succeeded,
        Duration::from_secs(60),
        logs,
    )
    .await
    .unwrap();
    let result = serde_json::to_value(done.status.unwrap().result).unwrap();
    assert_eq!(result["committed"], false, "{result}");
    assert!(
        result["worker"].as_str().unwrap().starts_with("nopg-0/"),
        "{result}"
    );
    // What needs the store fails at once, saying why.
    let t = wait_phase(
        &ns,
        "transfer",
        TaskPhase::DeadLettered,
        Duration::from_secs(60),
        logs,
    )
    .await
    .unwrap();
    assert_eq!(
        t.status.unwrap().last_failure.unwrap().reason,
        "NoFencedStore"
    );
    let log = worker.log_text();
    assert!(
        log.contains("results are NOT committed to a fenced store"),
        "{log}"
    );
    assert!(!log.contains('\u{1b}'), "ANSI escapes in a log file");
    ns.cleanup().await.unwrap();
}

/// A task without `payload` used to be dead-lettered `InvalidPayload`
/// ("invalid type: null, expected struct Payload"): an absent payload reads
/// as `{}`, so the demo runs with its defaults.
#[tokio::test]
async fn a_task_without_a_payload_runs_with_the_defaults() {
    let (ns, op) = Operator::in_new_namespace("nopayload", "op", Duration::from_secs(30))
        .await
        .unwrap();
    let worker = workers::start(&ns.name, "w1", &workers::WorkerOpts::default()).unwrap();
    tasks::create(&ns, "bare", json!({"queue": "demo"}))
        .await
        .unwrap();
    let done = wait_phase(
        &ns,
        "bare",
        TaskPhase::Succeeded,
        Duration::from_secs(60),
        || op.logs_with(&[&worker]),
    )
    .await
    .unwrap();
    let st = done.status.unwrap();
    assert_eq!(st.attempts, 0, "no failed attempt: {:?}", st.history);
    drop(worker);
    ns.finish().await.unwrap();
}
