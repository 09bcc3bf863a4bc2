//! The Helm chart: it lints, carries exactly the generated CRDs, installs
//! with the real helm, and its RBAC is both sufficient (the operator and a
//! worker run end to end on the chart's ServiceAccount permissions) and
//! least-privilege (what they must not do, they cannot).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::time::Duration;

use batchlease_api::TaskPhase;
use batchlease_e2e::operator::Operator;
use batchlease_e2e::tasks::{self, wait_phase};
use batchlease_e2e::workers::{self, WorkerOpts};
use batchlease_e2e::{Cluster, kubectl, pg};
use serde_json::json;

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

/// `kubectl auth can-i VERB RESOURCE` as `sa` in `ns`.
fn can(ns: &str, sa: &str, verb: &str, resource: &str, in_ns: &str) -> bool {
    let who = format!("--as=system:serviceaccount:{ns}:{sa}");
    let mut args = vec!["auth", "can-i", verb, "-n", in_ns, &who];
    let sub;
    match resource.split_once('/') {
        Some((res, subresource)) => {
            sub = format!("--subresource={subresource}");
            args.extend([res, sub.as_str()]);
        }
        None => args.push(resource),
    }
    let out = kubectl::run(&args).unwrap();
    out.stdout.trim() == "yes"
}

#[tokio::test]
async fn helm_install_rbac_is_sufficient_and_least_privilege() {
    let cluster = Cluster::with_crds().await.unwrap();
    let ns = cluster.namespace("helm").await.unwrap();
    let n = ns.name.as_str();
    let release = format!("r{}", &n[n.len() - 6..]);
    let watch = format!("watchNamespaces={{{n}}}");
    helm(&[
        "install",
        &release,
        "charts/batchlease-operator",
        "-n",
        n,
        "--set",
        &watch,
        "--wait=false",
    ]);
    let sa = format!("{release}-batchlease-operator");
    let deploy = kubectl::ok(&[
        "get",
        "deployment",
        &sa,
        "-n",
        n,
        "-o",
        "jsonpath={.spec.replicas} {.spec.template.spec.serviceAccountName}",
    ])
    .unwrap();
    assert_eq!(deploy, format!("2 {sa}"));
    kubectl::ok(&["get", "service", &format!("{sa}-metrics"), "-n", n]).unwrap();

    // Least privilege.
    let yes = [
        ("update", "batchtasks.batchlease.dev/status", n),
        ("watch", "batchtasks.batchlease.dev", n),
        ("create", "taskleases.batchlease.dev", n),
        ("create", "events.events.k8s.io", n),
        // Resource locks live in the operator's own namespace.
        ("update", "leases.coordination.k8s.io", n),
        ("create", "leases.coordination.k8s.io", n),
    ];
    let no = [
        ("update", "batchtasks.batchlease.dev", n),
        ("delete", "batchtasks.batchlease.dev", n),
        ("get", "secrets", n),
        ("create", "pods", n),
        ("list", "taskleases.batchlease.dev", "default"),
        ("delete", "leases.coordination.k8s.io", n),
        // …and nowhere else: other controllers' leader-election Leases.
        ("update", "leases.coordination.k8s.io", "kube-system"),
        ("create", "leases.coordination.k8s.io", "default"),
    ];
    for (verb, res, in_ns) in yes {
        assert!(
            can(n, &sa, verb, res, in_ns),
            "operator cannot {verb} {res} in {in_ns}"
        );
    }
    for (verb, res, in_ns) in no {
        assert!(
            !can(n, &sa, verb, res, in_ns),
            "operator may {verb} {res} in {in_ns}"
        );
    }

    // Sufficient: run the operator and a worker on those identities only.
    let dir = batchlease_e2e::secrets::PrivateDir::new(n).unwrap();
    let op_kc = kubectl::service_account_kubeconfig(n, &sa, &dir).unwrap();
    let op = Operator::start_with(
        n,
        "sa-op",
        vec![format!("--kubeconfig={}", op_kc.display())],
    )
    .unwrap();
    op.wait_leading(Duration::from_secs(30)).await.unwrap();
    kubectl::ok(&["create", "serviceaccount", "worker", "-n", n]).unwrap();
    kubectl::ok(&[
        "create",
        "rolebinding",
        "worker",
        "-n",
        n,
        &format!("--clusterrole={release}-batchlease-operator-worker"),
        &format!("--serviceaccount={n}:worker"),
    ])
    .unwrap();
    assert!(
        !can(n, "worker", "update", "batchtasks.batchlease.dev/status", n),
        "workers never write task status"
    );
    assert!(
        can(n, "worker", "create", "batchtasks.batchlease.dev", n),
        "workers create the children they spawn"
    );
    let worker_kc = kubectl::service_account_kubeconfig(n, "worker", &dir).unwrap();
    let _db = pg::connect().await.unwrap();
    let opts = WorkerOpts {
        kubeconfig: Some(worker_kc),
        ..Default::default()
    };
    let worker = workers::start(n, "sa-worker", &opts).unwrap();
    // A resource lock and a dependency: every kind of write the operator
    // makes, on the chart's permissions only.
    tasks::create(
        &ns,
        "first",
        json!({"queue": "demo", "resources": ["db"], "payload": {"steps": 1, "stepMillis": 10}}),
    )
    .await
    .unwrap();
    tasks::create(
        &ns,
        "job",
        json!({"queue": "demo", "dependsOn": ["first"], "resources": ["db"], "payload": {"steps": 1, "stepMillis": 10}}),
    )
    .await
    .unwrap();
    wait_phase(
        &ns,
        "job",
        TaskPhase::Succeeded,
        Duration::from_secs(60),
        || format!("{}{}", op.logs(), worker.logs()),
    )
    .await
    .unwrap();
    // Nothing was refused along the way.
    let logs = op.logs().to_lowercase();
    assert!(!logs.contains("forbidden"), "{logs}");
    assert_eq!(
        op.metric("batchlease_reconcile_errors_total{kind=\"kube\"}")
            .await
            .unwrap(),
        None,
        "{logs}"
    );
    helm(&["uninstall", &release, "-n", n]);
    ns.cleanup().await.unwrap();
}
