//! The chart in cluster-wide mode (`watchNamespaces` empty, its default),
//! run as rendered: the operator, in its own namespace on the chart's
//! ServiceAccount and ClusterRoleBinding, runs a task in another
//! namespace, where a worker pod's claims pass the holder-only policy,
//! bound in every namespace. A test binary of its own: cargo runs test
//! binaries one after another, so no other test's operator competes for
//! tasks, and no other test's workers meet a cluster-wide policy.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use batchlease_api::TaskPhase;
use batchlease_e2e::chart::{self, Release};
use batchlease_e2e::ports::free_port;
use batchlease_e2e::secrets::PrivateDir;
use batchlease_e2e::tasks::{self, wait_phase};
use batchlease_e2e::workers::{self, WorkerOpts};
use batchlease_e2e::{Cluster, kubectl, pg, wait_for};
use serde_json::json;

#[tokio::test]
async fn cluster_wide_release_runs_tasks_in_every_namespace() {
    let cluster = Cluster::with_crds().await.unwrap();
    let ops = cluster.namespace("cw-op").await.unwrap();
    let tenant = cluster.namespace("cw-tenant").await.unwrap();
    let (a, b) = (ops.name.as_str(), tenant.name.as_str());
    let name = format!("c{}", &a[a.len() - 6..]);
    let dir = PrivateDir::new(a).unwrap();
    // The chart's defaults, nothing set.
    let mut release = Release::install(&name, a, &[]).unwrap();
    let full = release.full_name();
    let op = release
        .start_replica(&format!("{full}-0"), Some(free_port().unwrap()), &dir)
        .unwrap();
    assert!(
        op.args.contains(&"--namespaces=".to_owned()),
        "{:?}",
        op.args
    );
    kubectl::ok(&["get", "clusterrolebinding", &full]).unwrap();
    let binding = kubectl::ok(&[
        "get",
        "validatingadmissionpolicybinding",
        &format!("{full}-holder-only"),
        "-o",
        "jsonpath={.spec.matchResources.namespaceSelector}",
    ])
    .unwrap();
    assert!(
        binding.trim().is_empty() || binding.trim() == "{}",
        "bound everywhere: {binding}"
    );
    let sa = format!("--as=system:serviceaccount:{a}:{full}");
    for (verb, res) in [("update", "batchtasks.batchlease.dev"), ("delete", "pods")] {
        let out = kubectl::run(&["auth", "can-i", verb, res, "-n", b, &sa]).unwrap();
        assert_eq!(out.stdout.trim(), "no", "{verb} {res} in {b}");
    }
    let out = kubectl::run(&[
        "auth",
        "can-i",
        "update",
        "batchtasks.batchlease.dev",
        "--subresource=status",
        "-n",
        b,
        &sa,
    ])
    .unwrap();
    assert_eq!(out.stdout.trim(), "yes");

    wait_for(
        "the operator leads",
        Duration::from_secs(60),
        || op.process.logs(),
        || async { Ok((op.get("/readyz").await.unwrap_or(0) == 200).then_some(())) },
    )
    .await
    .unwrap();

    // A worker pod in the tenant namespace.
    let kc = chart::worker_pod(&tenant, &format!("{full}-worker"), "w-0", &dir)
        .await
        .unwrap();
    let _db = pg::connect().await.unwrap();
    let worker = workers::start(
        b,
        "w-0",
        &WorkerOpts {
            kubeconfig: Some(kc),
            pod_name: Some("w-0".into()),
            ..Default::default()
        },
    )
    .unwrap();
    tasks::create(
        &tenant,
        "job",
        json!({"queue": "demo", "payload": {"steps": 2, "stepMillis": 10}}),
    )
    .await
    .unwrap();
    let done = wait_phase(
        &tenant,
        "job",
        TaskPhase::Succeeded,
        Duration::from_secs(60),
        || format!("{}{}", op.process.logs(), worker.logs()),
    )
    .await
    .unwrap();
    let holder = done
        .status
        .unwrap()
        .history
        .last()
        .and_then(|h| h.holder.clone());
    assert!(
        holder.as_deref().is_some_and(|h| h.starts_with("w-0/")),
        "{holder:?}"
    );
    drop(worker);
    drop(op);
    release.uninstall().unwrap();
    let out = kubectl::run(&[
        "get",
        "validatingadmissionpolicy",
        &format!("{full}-holder-only"),
    ])
    .unwrap();
    assert!(out.stderr.contains("NotFound"), "{}", out.combined());
    ops.cleanup().await.unwrap();
    tenant.cleanup().await.unwrap();
}
