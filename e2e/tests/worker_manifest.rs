//! The worker manifest of `docs/write-a-worker.md`
//! (`examples/my-worker/deployment.yaml`) is one the API server accepts
//! (`kubectl apply --dry-run=server`: schema, defaulting, admission), and
//! its pods outlast the SDK's drain grace.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use batchlease_e2e::{Cluster, kubectl};
use batchlease_worker_sdk::DEFAULT_DRAIN_GRACE;

const MANIFEST: &str = "examples/my-worker/deployment.yaml";

#[tokio::test]
async fn the_documented_worker_manifest_is_accepted_by_the_api_server() {
    let cluster = Cluster::connect().await.unwrap();
    let ns = cluster.namespace("mkworker").await.unwrap();
    let out = kubectl::run(&[
        "apply",
        "--dry-run=server",
        "-n",
        &ns.name,
        "-f",
        MANIFEST,
        "-o",
        "json",
    ])
    .unwrap();
    assert!(out.success, "{}", out.combined());
    let applied: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    let items = applied["items"].as_array().unwrap();
    let kinds: Vec<&str> = items.iter().map(|i| i["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["ServiceAccount", "RoleBinding", "Deployment"]);
    // As the server stored it (after defaulting), not as written.
    let pod = &items[2]["spec"]["template"]["spec"];
    let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap();
    assert!(
        grace > DEFAULT_DRAIN_GRACE.as_secs(),
        "terminationGracePeriodSeconds {grace} ≤ the drain grace {DEFAULT_DRAIN_GRACE:?}"
    );
    let env = &pod["containers"][0]["env"];
    let pod_name = env
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "POD_NAME")
        .unwrap();
    assert_eq!(
        pod_name["valueFrom"]["fieldRef"]["fieldPath"], "metadata.name",
        "the SDK's identity must name the pod"
    );
    // Dry run: nothing was created.
    let sa = kubectl::run(&["get", "sa", "report-worker", "-n", &ns.name]).unwrap();
    assert!(!sa.success, "{}", sa.combined());
    ns.cleanup().await.unwrap();
}
