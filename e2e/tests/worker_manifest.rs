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

/// The Python package's default drain grace (`Worker(drain_grace_seconds=…)`
/// in python/pysrc/batchlease/__init__.py), read from the source.
fn python_drain_grace() -> f64 {
    let src = std::fs::read_to_string(
        batchlease_e2e::repo_root().join("python/pysrc/batchlease/__init__.py"),
    )
    .unwrap();
    src.lines()
        .find_map(|l| l.trim().strip_prefix("drain_grace_seconds: float = "))
        .and_then(|v| v.trim_end_matches(',').parse().ok())
        .expect("a default drain grace in the Python Worker")
}

/// The Python example's manifest (`examples/python-worker/deployment.yaml`):
/// accepted by the API server, its pods outlast the Python worker's drain
/// grace, name the pod as the SDK's identity, and give the forkserver a
/// writable /tmp under a read-only root.
#[tokio::test]
async fn the_python_worker_manifest_is_accepted_by_the_api_server() {
    let cluster = Cluster::connect().await.unwrap();
    let ns = cluster.namespace("pyworker").await.unwrap();
    let out = kubectl::run(&[
        "apply",
        "--dry-run=server",
        "-n",
        &ns.name,
        "-f",
        "examples/python-worker/deployment.yaml",
        "-o",
        "json",
    ])
    .unwrap();
    assert!(out.success, "{}", out.combined());
    let applied: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    let items = applied["items"].as_array().unwrap();
    let deployment = items.iter().find(|i| i["kind"] == "Deployment").unwrap();
    let pod = &deployment["spec"]["template"]["spec"];
    let grace = pod["terminationGracePeriodSeconds"].as_f64().unwrap();
    let drain = python_drain_grace();
    assert!(
        grace > drain,
        "terminationGracePeriodSeconds {grace} ≤ the Python worker's drain grace {drain}"
    );
    let container = &pod["containers"][0];
    let env = container["env"].as_array().unwrap();
    let pod_name = env.iter().find(|e| e["name"] == "POD_NAME").unwrap();
    assert_eq!(
        pod_name["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.name"
    );
    let tmp = container["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"] == "/tmp");
    assert!(
        tmp.is_some(),
        "no writable /tmp for the forkserver: {container}"
    );
    // The queues by the variable every kind reads, not a flag; a pod
    // without the optional CA ConfigMap still starts.
    assert!(
        env.iter()
            .any(|e| e["name"] == "BATCHLEASE_QUEUES" && e["value"].is_string()),
        "{container}"
    );
    assert!(
        !container["args"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a == "--queue"),
        "{container}"
    );
    let ca = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "pg-ca")
        .unwrap();
    assert_eq!(ca["configMap"]["optional"], true, "{ca}");
    ns.cleanup().await.unwrap();
}
