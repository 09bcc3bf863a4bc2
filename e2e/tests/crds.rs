//! The generated CRDs install on a real API server and are served with the
//! names, short names and category users type.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use batchlease_e2e::{Cluster, kubectl};

#[tokio::test]
async fn crd_files_install_and_reach_established() {
    let _cluster = Cluster::connect().await.unwrap();
    // What users do: apply the checked-in YAML (generated from the types).
    kubectl::ok(&["apply", "--server-side", "--force-conflicts", "-f", "crds/"]).unwrap();
    let out = kubectl::ok(&[
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        "crd/batchtasks.batchlease.dev",
        "crd/taskleases.batchlease.dev",
        "crd/taskqueues.batchlease.dev",
        "crd/workerleases.batchlease.dev",
    ])
    .unwrap();
    assert!(
        out.contains("batchtasks.batchlease.dev condition met"),
        "{out}"
    );
    assert!(
        out.contains("taskleases.batchlease.dev condition met"),
        "{out}"
    );

    let resources = kubectl::ok(&[
        "api-resources",
        "--api-group=batchlease.dev",
        "--no-headers",
    ])
    .unwrap();
    let rows: Vec<Vec<&str>> = resources
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    let row = |name: &str| {
        rows.iter()
            .find(|r| r[0] == name)
            .cloned()
            .unwrap_or_default()
    };
    // NAME SHORTNAMES APIVERSION NAMESPACED KIND
    assert_eq!(
        row("batchtasks"),
        [
            "batchtasks",
            "bt",
            "batchlease.dev/v1alpha1",
            "true",
            "BatchTask"
        ],
        "{resources}"
    );
    assert_eq!(
        row("taskleases"),
        [
            "taskleases",
            "tl",
            "batchlease.dev/v1alpha1",
            "true",
            "TaskLease"
        ],
        "{resources}"
    );
    assert_eq!(
        row("taskqueues"),
        [
            "taskqueues",
            "tq",
            "batchlease.dev/v1alpha1",
            "true",
            "TaskQueue"
        ],
        "{resources}"
    );
}

#[tokio::test]
async fn batchtask_and_taskqueue_have_a_status_subresource_tasklease_not() {
    let _cluster = Cluster::with_crds().await.unwrap();
    let sub = |crd: &str| {
        kubectl::ok(&[
            "get",
            "crd",
            crd,
            "-o",
            "jsonpath={.spec.versions[0].subresources}",
        ])
        .unwrap()
    };
    assert_eq!(sub("batchtasks.batchlease.dev"), r#"{"status":{}}"#);
    // TaskLease: spec and status are written together, like coordination/v1 Lease.
    assert_eq!(sub("taskleases.batchlease.dev"), "");
    // TaskQueue: users write spec, the operator status.
    assert_eq!(sub("taskqueues.batchlease.dev"), r#"{"status":{}}"#);
    // WorkerLease: its worker writes spec, only the operator status.revoked.
    assert_eq!(sub("workerleases.batchlease.dev"), r#"{"status":{}}"#);
}
