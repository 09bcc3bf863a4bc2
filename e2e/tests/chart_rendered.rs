//! The chart as it renders, run: operator processes started with exactly
//! the command, args and env of `helm template`'s Deployment, on the
//! chart's ServiceAccount, in namespaced mode; `helm upgrade` with changed
//! values changes what runs; `helm uninstall` removes the release and
//! keeps the CRDs (and so the tasks). Cluster-wide mode is
//! `chart_cluster_wide.rs`, a test binary of its own.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use batchlease_api::TaskPhase;
use batchlease_e2e::chart::{Release, Replica};
use batchlease_e2e::ports::free_port;
use batchlease_e2e::secrets::PrivateDir;
use batchlease_e2e::tasks::{self, wait_phase};
use batchlease_e2e::workers::{self, WorkerOpts};
use batchlease_e2e::{Cluster, TestNamespace, helm, kubectl, pg, wait_for};
use serde_json::json;

/// Waits until the leader Lease in `ns` is held by one of `replicas`.
async fn wait_leader(ns: &str, pods: &[&str], logs: impl Fn() -> String) -> String {
    wait_for("a replica leads", Duration::from_secs(60), logs, || async {
        let out = kubectl::run(&[
            "get",
            "lease",
            "batchlease-operator",
            "-n",
            ns,
            "-o",
            "jsonpath={.spec.holderIdentity}",
        ])?;
        let holder = out.stdout.trim().to_owned();
        Ok(pods
            .iter()
            .any(|p| holder.starts_with(&format!("{p}-")))
            .then_some(holder))
    })
    .await
    .unwrap()
}

/// A demo worker as in pod `pod` of `ns` (ServiceAccount `worker` bound to
/// the chart's worker role, a token bound to the Pod object).
async fn pod_worker(
    ns: &TestNamespace,
    worker_role: &str,
    pod: &str,
    dir: &PrivateDir,
) -> batchlease_e2e::process::Process {
    let n = ns.name.as_str();
    let kc = batchlease_e2e::chart::worker_pod(ns, worker_role, pod, dir)
        .await
        .unwrap();
    let _db = pg::connect().await.unwrap();
    let opts = WorkerOpts {
        kubeconfig: Some(kc),
        pod_name: Some(pod.into()),
        ..Default::default()
    };
    workers::start(n, pod, &opts).unwrap()
}

fn logs_of(replicas: &[&Replica]) -> String {
    replicas.iter().map(|r| r.process.logs()).collect()
}

#[tokio::test]
async fn namespaced_release_runs_as_rendered_upgrades_and_uninstalls() {
    let cluster = Cluster::with_crds().await.unwrap();
    let ns = cluster.namespace("rendered").await.unwrap();
    let n = ns.name.as_str();
    let name = format!("r{}", &n[n.len() - 6..]);
    let dir = PrivateDir::new(n).unwrap();
    let mut release = Release::install(&name, n, &[format!("watchNamespaces={{{n}}}")]).unwrap();
    let full = release.full_name();
    let pods = [format!("{full}-0"), format!("{full}-1")];
    let r0 = release
        .start_replica(&pods[0], Some(free_port().unwrap()), &dir)
        .unwrap();
    let r1 = release
        .start_replica(&pods[1], Some(free_port().unwrap()), &dir)
        .unwrap();

    // What runs is what renders: the values' flags, the downward-API env,
    // nothing else (the token comes through KUBECONFIG).
    for flag in [
        format!("--namespaces={n}"),
        "--log-format=json".into(),
        "--leader-election=true".into(),
        "--leader-lease-name=batchlease-operator".into(),
        "--leader-lease-seconds=15".into(),
        "--leader-grace-seconds=5".into(),
        "--address-offers=true".into(),
        "--bind-offers=true".into(),
    ] {
        assert!(r0.args.contains(&flag), "{flag} not in {:?}", r0.args);
    }
    let names: Vec<&str> = r0.env.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(names, ["POD_NAME", "POD_NAMESPACE", "KUBECONFIG"]);
    assert_eq!(r0.env[0].1, pods[0]);
    assert_eq!(r0.env[1].1, n);
    let same = |r: &Replica| -> Vec<String> {
        r.args
            .iter()
            .filter(|a| !a.starts_with("--metrics-addr="))
            .cloned()
            .collect()
    };
    assert_eq!(
        same(&r0),
        same(&r1),
        "replicas differ only in their metrics port"
    );

    let pod_names: Vec<&str> = pods.iter().map(String::as_str).collect();
    let leader = wait_leader(n, &pod_names, || logs_of(&[&r0, &r1])).await;
    let worker = pod_worker(&ns, &format!("{full}-worker"), "w-0", &dir).await;
    tasks::create(
        &ns,
        "before",
        json!({"queue": "demo", "payload": {"steps": 1, "stepMillis": 10}}),
    )
    .await
    .unwrap();
    wait_phase(
        &ns,
        "before",
        TaskPhase::Succeeded,
        Duration::from_secs(60),
        || format!("{}{}", logs_of(&[&r0, &r1]), worker.logs()),
    )
    .await
    .unwrap();
    // logFormat=json: every line a JSON object.
    for r in [&r0, &r1] {
        for line in r
            .process
            .log_text()
            .lines()
            .filter(|l| !l.trim().is_empty())
        {
            assert!(
                serde_json::from_str::<serde_json::Value>(line).is_ok(),
                "not JSON: {line}"
            );
        }
    }
    // The rendered probes, asked of the leader on the rendered port.
    let yaml = helm::template(&[
        &name,
        "charts/batchlease-operator",
        "-n",
        n,
        "--set",
        &format!("watchNamespaces={{{n}}}"),
    ])
    .unwrap();
    let deploy = &helm::rendered(&yaml, "Deployment").unwrap()[0];
    let container = &deploy["spec"]["template"]["spec"]["containers"][0];
    let leading = if leader.starts_with(&pods[0]) {
        &r0
    } else {
        &r1
    };
    for probe in ["livenessProbe", "readinessProbe"] {
        let http = &container[probe]["httpGet"];
        assert_eq!(http["port"], "metrics", "{probe}: {http}");
        let path = http["path"].as_str().unwrap();
        assert_eq!(leading.get(path).await.unwrap(), 200, "{probe} {path}");
    }

    // helm upgrade with changed values (one replica without leader
    // election, text logs): the Deployment says so, the optional
    // PodDisruptionBudget appears, the admission policy goes.
    release
        .upgrade(&[
            format!("watchNamespaces={{{n}}}"),
            "replicaCount=1".into(),
            "logFormat=text".into(),
            "leaderElection.enabled=false".into(),
            "podDisruptionBudget.enabled=true".into(),
            "admission.enabled=false".into(),
        ])
        .unwrap();
    let deployed = kubectl::ok(&[
        "get",
        "deployment",
        &full,
        "-n",
        n,
        "-o",
        "jsonpath={.spec.replicas} {.spec.template.spec.containers[0].args}",
    ])
    .unwrap();
    assert!(deployed.starts_with("1 "), "{deployed}");
    for flag in ["--log-format=text", "--leader-election=false"] {
        assert!(deployed.contains(flag), "{flag} not in {deployed}");
    }
    kubectl::ok(&["get", "poddisruptionbudget", &full, "-n", n]).unwrap();
    let policy = kubectl::run(&[
        "get",
        "validatingadmissionpolicy",
        &format!("{full}-holder-only"),
    ])
    .unwrap();
    assert!(policy.stderr.contains("NotFound"), "{}", policy.combined());

    // The rollout: the old replicas go, one starts from the new rendering.
    drop(r0);
    drop(r1);
    let r2 = release
        .start_replica(&format!("{full}-2"), Some(free_port().unwrap()), &dir)
        .unwrap();
    assert!(
        r2.args.contains(&"--log-format=text".to_owned()),
        "{:?}",
        r2.args
    );
    wait_for(
        "the new replica ready",
        Duration::from_secs(60),
        || r2.process.logs(),
        || async { Ok((r2.get("/readyz").await.unwrap_or(0) == 200).then_some(())) },
    )
    .await
    .unwrap();
    tasks::create(
        &ns,
        "after",
        json!({"queue": "demo", "payload": {"steps": 1, "stepMillis": 10}}),
    )
    .await
    .unwrap();
    wait_phase(
        &ns,
        "after",
        TaskPhase::Succeeded,
        Duration::from_secs(60),
        || format!("{}{}", r2.process.logs(), worker.logs()),
    )
    .await
    .unwrap();
    let text = r2.process.log_text();
    assert!(
        text.lines().any(|l| l.contains("INFO")) && !text.trim_start().starts_with('{'),
        "logFormat=text: {text}"
    );
    // A log file gets no colour codes; without election nobody waits.
    assert!(
        !text.contains('\u{1b}'),
        "ANSI escapes in a log file: {text}"
    );
    assert!(!text.contains("waiting for leadership"), "{text}");
    assert!(text.contains("leader election disabled"), "{text}");

    // helm uninstall: the release's objects go; the CRDs stay, and with
    // them the tasks.
    drop(r2);
    release.uninstall().unwrap();
    let left = kubectl::ok(&[
        "get",
        "deployment,serviceaccount,role,rolebinding,service,poddisruptionbudget",
        "-n",
        n,
        "-l",
        &format!("app.kubernetes.io/instance={name}"),
        "-o",
        "name",
    ])
    .unwrap();
    assert!(left.trim().is_empty(), "left after uninstall: {left}");
    for gone in [full.clone(), format!("{full}-worker")] {
        let out = kubectl::run(&["get", "clusterrole", &gone]).unwrap();
        assert!(out.stderr.contains("NotFound"), "{}", out.combined());
    }
    kubectl::ok(&[
        "get",
        "crd",
        "batchtasks.batchlease.dev",
        "taskleases.batchlease.dev",
        "taskqueues.batchlease.dev",
        "workerleases.batchlease.dev",
    ])
    .unwrap();
    let kept = kubectl::ok(&["get", "batchtasks", "-n", n, "-o", "name"]).unwrap();
    assert!(kept.contains("before") && kept.contains("after"), "{kept}");
    drop(worker);
    ns.cleanup().await.unwrap();
}
