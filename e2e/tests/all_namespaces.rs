//! One operator watching every namespace, logging JSON. A test binary of its
//! own: cargo runs test binaries one after another, so no other test's
//! operator competes for the same tasks meanwhile.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use batchlease_api::TaskPhase;
use batchlease_e2e::Cluster;
use batchlease_e2e::operator::Operator;
use batchlease_e2e::tasks::{self, wait_phase};
use serde_json::json;

#[tokio::test]
async fn watches_all_namespaces_and_logs_json() {
    let cluster = Cluster::with_crds().await.unwrap();
    let a = cluster.namespace("all-a").await.unwrap();
    let b = cluster.namespace("all-b").await.unwrap();
    let op = Operator::start_with(
        &a.name,
        "all",
        vec!["--namespaces=".into(), "--log-format=json".into()],
    )
    .unwrap();
    op.wait_leading(Duration::from_secs(30)).await.unwrap();
    for ns in [&a, &b] {
        tasks::create(ns, "job", json!({"queue": "q"}))
            .await
            .unwrap();
        wait_phase(ns, "job", TaskPhase::Ready, Duration::from_secs(30), || {
            op.logs()
        })
        .await
        .unwrap();
    }
    let log = std::fs::read_to_string(op.log_path()).unwrap();
    let lines: Vec<&str> = log.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(!lines.is_empty());
    for line in &lines {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(
            v.get("level").is_some() && v.get("fields").is_some(),
            "{line}"
        );
    }
    assert!(
        log.contains(r#""message":"controller started","namespace":"*""#),
        "{log}"
    );
    a.cleanup().await.unwrap();
    b.cleanup().await.unwrap();
}
