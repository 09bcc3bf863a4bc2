//! A task end to end on whatever control plane the harness points at —
//! `hack/test.sh` also runs this file (with `crds.rs`, `validation.rs` and
//! `admission.rs`) against the oldest Kubernetes minor batchlease supports,
//! a control plane of its own (`BATCHLEASE_KUBE=oldest`,
//! `e2e/controlplane/versions.env`). There `BATCHLEASE_EXPECT_KUBE` names
//! the version, and the server must report it: a run that silently used the
//! newest control plane proves nothing about the oldest.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use batchlease_api::TaskPhase;
use batchlease_e2e::operator::Operator;
use batchlease_e2e::tasks::{self, wait_phase};
use batchlease_e2e::workers;
use serde_json::json;

#[tokio::test]
async fn a_task_runs_end_to_end_with_operator_and_worker() {
    let (ns, op) = Operator::in_new_namespace("oldest", "op", Duration::from_secs(30))
        .await
        .unwrap();
    let cluster = batchlease_e2e::Cluster::connect().await.unwrap();
    let version = cluster.client.apiserver_version().await.unwrap();
    eprintln!("kube-apiserver {}", version.git_version);
    if let Ok(want) = std::env::var("BATCHLEASE_EXPECT_KUBE") {
        assert_eq!(version.git_version, want, "the control plane under test");
    }
    let w = workers::start_n(&ns.name, 1, 2).unwrap();
    for i in 0..3 {
        tasks::create(
            &ns,
            &format!("t{i}"),
            json!({"queue": "demo", "payload": {"steps": 2, "stepMillis": 100}}),
        )
        .await
        .unwrap();
    }
    for i in 0..3 {
        let t = wait_phase(
            &ns,
            &format!("t{i}"),
            TaskPhase::Succeeded,
            Duration::from_secs(60),
            || op.logs_with(&[&w[0]]),
        )
        .await
        .unwrap();
        assert_eq!(t.status.unwrap().fencing_token, 1, "t{i}: first attempt");
    }
    // Every write judged by the history checker (watches, audit log,
    // PostgreSQL), as on the newest control plane.
    ns.finish().await.unwrap();
}
