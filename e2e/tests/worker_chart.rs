//! The worker chart (`charts/batchlease-worker`): it lints and packages,
//! its defaults fit the SDK's (drain grace) and the demo worker's CLI (the
//! environment it sets), bad values are refused with clear messages, and
//! installed on the real control plane its ServiceAccount has exactly the
//! worker role's permissions — enough for the demo worker, started with
//! the rendered Deployment's environment on a token bound to a Pod of that
//! ServiceAccount, to run a task under the holder-only policy. (Its pods
//! on a node — rollouts, force-deleted pods, killed containers — are
//! `node_workers.rs`.)

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use batchlease_api::TaskPhase;
use batchlease_e2e::operator::Operator;
use batchlease_e2e::process::Process;
use batchlease_e2e::secrets::PrivateDir;
use batchlease_e2e::tasks::{self, wait_phase};
use batchlease_e2e::{Cluster, chart, helm, kubectl, pg};
use serde_json::json;

const CHART: &str = "charts/batchlease-worker";

fn chart_yaml(chart: &str) -> serde_json::Value {
    let path = batchlease_e2e::repo_root().join(chart).join("Chart.yaml");
    serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn values() -> serde_json::Value {
    let path = batchlease_e2e::repo_root().join(CHART).join("values.yaml");
    serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// `helm template` of the worker chart in `ns` with `sets`: its one
/// Deployment and everything rendered.
fn render(ns: &str, sets: &[&str]) -> (serde_json::Value, String) {
    let mut args = vec!["w", CHART, "-n", ns];
    for s in sets {
        args.extend(["--set", s]);
    }
    let yaml = helm::template(&args).unwrap();
    let deploys = helm::rendered(&yaml, "Deployment").unwrap();
    assert_eq!(deploys.len(), 1, "{yaml}");
    (deploys[0].clone(), yaml)
}

fn env_of(deploy: &serde_json::Value) -> Vec<(String, String)> {
    helm::container_of(deploy, "ns", "pod-0").unwrap().1
}

fn get<'a>(env: &'a [(String, String)], name: &str) -> Option<&'a str> {
    env.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

#[test]
fn worker_chart_lints_packages_and_fits_the_sdk_and_the_demo_worker() {
    let lint = helm::ok(&["lint", CHART]).unwrap();
    assert!(lint.contains("0 chart(s) failed"), "{lint}");
    // Published next to the operator's: both package.
    let dir = PrivateDir::new("package").unwrap();
    let dest = dir.path().to_str().unwrap();
    for chart in [CHART, "charts/batchlease-operator"] {
        let out = helm::ok(&["package", chart, "-d", dest]).unwrap();
        assert!(out.contains("Successfully packaged"), "{out}");
    }
    for archive in [
        "batchlease-worker-0.1.0.tgz",
        "batchlease-operator-0.1.0.tgz",
    ] {
        assert!(dir.path().join(archive).is_file(), "{archive}");
    }
    let (worker, operator) = (chart_yaml(CHART), chart_yaml("charts/batchlease-operator"));
    assert_eq!(
        worker["appVersion"].as_str(),
        Some(env!("CARGO_PKG_VERSION")),
        "the image tag defaults to the crates' version"
    );
    assert_eq!(worker["kubeVersion"], operator["kubeVersion"]);

    // The drain grace: the SDK's default, and the pod's grace above it by
    // the margin the chart enforces.
    let v = values();
    let sdk = batchlease_worker_sdk::DEFAULT_DRAIN_GRACE.as_secs();
    assert_eq!(v["drainGraceSeconds"].as_u64(), Some(sdk));
    assert!(v["terminationGracePeriodSeconds"].as_u64().unwrap() >= sdk + 5);
    let (deploy, _) = render("ns", &[]);
    assert_eq!(
        deploy["spec"]["template"]["spec"]["terminationGracePeriodSeconds"],
        30
    );
    // The demo worker's own default is the SDK's too, and it reads every
    // variable the chart sets (clap `env`), which its --help lists.
    let help = std::process::Command::new(batchlease_e2e::workers::binary().unwrap())
        .arg("--help")
        .output()
        .unwrap();
    // Wrapped to the terminal's width, if any: compare words only.
    let help = String::from_utf8_lossy(&help.stdout)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    assert!(
        help.contains(&format!(
            "[env: BATCHLEASE_DRAIN_GRACE_SECONDS=] [default: {sdk}]"
        )),
        "{help}"
    );
    let (deploy, _) = render("ns", &["postgres.existingSecret=pg"]);
    // POD_NAME and POD_UID are the SDK's own (its identity, its
    // WorkerLease's owner), as is BATCHLEASE_RENEW_PER_WORKER; TMPDIR is
    // the runtime's (Rust's std::env::temp_dir, Python's tempfile: where
    // batchlease-run and the forkserver write).
    let (per_worker, _) = render("ns", &["postgres.existingSecret=pg", "renewPerWorker=true"]);
    let sdk_reads = |name: &str| {
        name == "POD_NAME"
            || name == "POD_UID"
            || name == "TMPDIR"
            || name == batchlease_worker_sdk::RENEW_PER_WORKER_ENV
    };
    assert!(
        env_of(&per_worker)
            .iter()
            .any(|(n, v)| n == batchlease_worker_sdk::RENEW_PER_WORKER_ENV && v == "true"),
        "renewPerWorker sets the SDK's variable"
    );
    assert!(
        env_of(&deploy)
            .iter()
            .any(|(n, v)| n == batchlease_worker_sdk::RENEW_PER_WORKER_ENV && v == "false"),
        "renewals per lease by default, said to the SDK"
    );
    for (name, _) in env_of(&deploy) {
        if !sdk_reads(&name) {
            assert!(
                help.contains(&format!("[env: {name}=")),
                "the demo worker does not read {name}:\n{help}"
            );
        }
    }
}

#[test]
fn worker_chart_refuses_bad_values_with_a_clear_message() {
    // (value, what the error says, whether `helm lint` fails too: it checks
    // the schema, but reports a template's `fail` as [INFO] only)
    let grace = "must be at least drainGraceSeconds";
    let cases = [
        ("slots=0", "at '/slots': minimum: got 0, want 1", true),
        (
            "queues={Demo}",
            "at '/queues/0': 'Demo' does not match pattern",
            true,
        ),
        (
            "taskNamespace=Not_A_Namespace",
            "at '/taskNamespace': 'Not_A_Namespace' does not match pattern",
            true,
        ),
        (
            "postgres.existingSecret=My_Secret",
            "at '/postgres/existingSecret'",
            true,
        ),
        (
            "replicas=3",
            "additional properties 'replicas' not allowed",
            true,
        ),
        ("metrics.port=0", "at '/metrics/port': minimum", true),
        (
            "tmp.medium=Disk",
            "at '/tmp/medium': value must be one of '', 'Memory'",
            true,
        ),
        ("tmp.sizeLimit=lots", "at '/tmp/sizeLimit'", true),
        (
            "extraVolumeMounts[0].name=ca",
            "at '/extraVolumeMounts/0': missing property 'mountPath'",
            true,
        ),
        (
            "hostNetwork=yes",
            "at '/hostNetwork': got string, want boolean",
            true,
        ),
        (
            "extraEnv[0].value=x",
            "at '/extraEnv/0': missing property 'name'",
            true,
        ),
        (
            "nodeSelector.disk=1",
            "at '/nodeSelector/disk': got number, want string",
            true,
        ),
        // The kubelet's SIGKILL would come before the give-back.
        (
            "terminationGracePeriodSeconds=20",
            "terminationGracePeriodSeconds (20) must be at least drainGraceSeconds (20) + 5",
            false,
        ),
        (
            "drainGraceSeconds=26",
            "terminationGracePeriodSeconds (30) must be at least drainGraceSeconds (26) + 5",
            false,
        ),
        (
            "drainGraceSeconds=60,terminationGracePeriodSeconds=60",
            grace,
            false,
        ),
    ];
    for (value, says, lint_fails) in cases {
        let mut template = vec!["template", "w", CHART, "--set", value];
        template.extend(helm::CLUSTER);
        let lint = ["lint", CHART, "--set", value];
        for args in [template.as_slice(), lint.as_slice()]
            .into_iter()
            .take(if lint_fails { 2 } else { 1 })
        {
            let out = helm::run(args).unwrap();
            let cmd = args.join(" ");
            assert!(!out.success, "helm {cmd} passed:\n{}", out.stdout);
            assert!(
                out.combined().contains(says),
                "helm {cmd} should say {says:?}:\n{}",
                out.combined()
            );
        }
    }
    // Exactly the margin passes.
    let (deploy, _) = render(
        "ns",
        &["drainGraceSeconds=60", "terminationGracePeriodSeconds=65"],
    );
    assert_eq!(
        get(&env_of(&deploy), "BATCHLEASE_DRAIN_GRACE_SECONDS"),
        Some("60")
    );
    // A chart older than the cluster range is refused like the operator's.
    let old = helm::run(&["template", "w", CHART, "--kube-version", "1.31.0"]).unwrap();
    assert!(!old.success);
    assert!(
        old.combined()
            .contains("chart requires kubeVersion: >=1.32.0-0"),
        "{}",
        old.combined()
    );
}

#[test]
fn worker_chart_renders_what_a_worker_needs() {
    // Defaults: the demo image, POD_NAME from the downward API, the
    // release's namespace, the default operator release's worker role, no
    // PostgreSQL (and NOTES would warn).
    let (deploy, yaml) = render("etl", &[]);
    let spec = &deploy["spec"]["template"]["spec"];
    let c = &spec["containers"][0];
    assert_eq!(
        c["image"],
        format!(
            "ghcr.io/batchlease/batchlease-demo-worker:{}",
            env!("CARGO_PKG_VERSION")
        )
    );
    assert_eq!(
        c["env"][0],
        json!({"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}),
        "the holder identity's principal is the pod's name"
    );
    let env = helm::container_of(&deploy, "etl", "w-0").unwrap().1;
    for (name, want) in [
        ("POD_NAME", "w-0"),
        ("BATCHLEASE_TASK_NAMESPACE", "etl"),
        ("BATCHLEASE_QUEUES", "demo"),
        ("BATCHLEASE_SLOTS", "2"),
        ("BATCHLEASE_DRAIN_GRACE_SECONDS", "20"),
        ("BATCHLEASE_METRICS_ADDR", "0.0.0.0:9090"),
    ] {
        assert_eq!(get(&env, name), Some(want), "{name}: {env:?}");
    }
    assert_eq!(get(&env, "BATCHLEASE_PG_URL_FILE"), None);
    // A writable temp directory under the read-only root: batchlease-run
    // makes each attempt's directory there, Python's forkserver its socket.
    assert_eq!(get(&env, "TMPDIR"), Some("/tmp"));
    assert_eq!(
        spec["volumes"],
        json!([{"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}}])
    );
    assert_eq!(
        c["volumeMounts"],
        json!([{"name": "tmp", "mountPath": "/tmp"}])
    );
    assert!(c.get("args").is_none(), "no flags by default: {c}");
    assert_eq!(spec["serviceAccountName"], "w-batchlease-worker");
    assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
    assert!(spec.get("hostNetwork").is_none() && spec.get("dnsPolicy").is_none());
    assert_eq!(
        c["ports"],
        json!([{"name": "metrics", "containerPort": 9090}])
    );
    let sa = helm::rendered(&yaml, "ServiceAccount").unwrap();
    assert_eq!(sa[0]["metadata"]["name"], "w-batchlease-worker");
    let rb = &helm::rendered(&yaml, "RoleBinding").unwrap()[0];
    assert_eq!(rb["metadata"]["namespace"], "etl");
    assert_eq!(
        rb["roleRef"],
        json!({"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
               "name": "batchlease-batchlease-operator-worker"})
    );
    assert_eq!(
        rb["subjects"],
        json!([{"kind": "ServiceAccount", "name": "w-batchlease-worker", "namespace": "etl"}])
    );
    for kind in ["ClusterRole", "ClusterRoleBinding", "Role", "Secret"] {
        assert!(
            helm::rendered(&yaml, kind).unwrap().is_empty(),
            "the worker chart creates no {kind}"
        );
    }

    // Tasks of another namespace, another operator release, PostgreSQL
    // from a Secret, and every pod setting.
    let (deploy, yaml) = render(
        "workers",
        &[
            "taskNamespace=etl",
            "queues={fast,slow}",
            "slots=8",
            "workerRole.operatorRelease=ops",
            "postgres.existingSecret=pg,postgres.key=dsn",
            "metrics.enabled=false",
            "extraArgs={--storage-deadline-margin-ms=1000}",
            "extraEnv[0].name=RUST_LOG,extraEnv[0].value=debug",
            "imagePullSecrets[0].name=regcred",
            "podAnnotations.a=b,podLabels.team=etl,nodeSelector.pool=batch",
            "tolerations[0].key=batch,tolerations[0].operator=Exists",
            "topologySpreadConstraints[0].maxSkew=1",
            "affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].weight=1",
        ],
    );
    let pod = &deploy["spec"]["template"];
    let spec = &pod["spec"];
    let c = &spec["containers"][0];
    let (args, env) = helm::container_of(&deploy, "workers", "w-0").unwrap();
    assert_eq!(args, ["--storage-deadline-margin-ms=1000"]);
    for (name, want) in [
        ("BATCHLEASE_TASK_NAMESPACE", Some("etl")),
        ("BATCHLEASE_QUEUES", Some("fast,slow")),
        ("BATCHLEASE_SLOTS", Some("8")),
        (
            "BATCHLEASE_PG_URL_FILE",
            Some("/var/run/secrets/batchlease/postgres/dsn"),
        ),
        ("BATCHLEASE_METRICS_ADDR", None),
    ] {
        assert_eq!(get(&env, name), want, "{name}: {env:?}");
    }
    assert_eq!(env.last().unwrap(), &("RUST_LOG".into(), "debug".into()));
    assert!(c.get("ports").is_none());
    // The Secret's key as a file, read-only, 0440 (the fsGroup reads it).
    assert_eq!(
        spec["volumes"][0],
        json!({"name": "postgres", "secret": {"secretName": "pg",
               "items": [{"key": "dsn", "path": "dsn"}], "defaultMode": 0o440}})
    );
    assert_eq!(
        c["volumeMounts"][0],
        json!({"name": "postgres", "mountPath": "/var/run/secrets/batchlease/postgres", "readOnly": true})
    );
    assert_eq!(spec["securityContext"]["fsGroup"], 65532);
    assert_eq!(spec["imagePullSecrets"], json!([{"name": "regcred"}]));
    assert_eq!(pod["metadata"]["annotations"], json!({"a": "b"}));
    assert_eq!(pod["metadata"]["labels"]["team"], "etl");
    assert!(
        deploy["spec"]["selector"]["matchLabels"]
            .get("team")
            .is_none()
    );
    assert_eq!(spec["nodeSelector"], json!({"pool": "batch"}));
    assert_eq!(spec["tolerations"][0]["key"], "batch");
    assert_eq!(spec["topologySpreadConstraints"][0]["maxSkew"], 1);
    assert!(spec.get("hostNetwork").is_none());
    assert!(spec["affinity"]["podAntiAffinity"].is_object());
    let rb = &helm::rendered(&yaml, "RoleBinding").unwrap()[0];
    assert_eq!(rb["metadata"]["namespace"], "etl", "where the tasks are");
    assert_eq!(rb["roleRef"]["name"], "ops-batchlease-operator-worker");
    assert_eq!(rb["subjects"][0]["namespace"], "workers");
    // An operator release named like its chart keeps its name, as the
    // operator chart's full name does; or the role is named outright.
    for (set, role) in [
        (
            "workerRole.operatorRelease=batchlease-operator",
            "batchlease-operator-worker",
        ),
        ("workerRole.name=my-worker-role", "my-worker-role"),
    ] {
        let (_, yaml) = render("etl", &[set]);
        let rb = &helm::rendered(&yaml, "RoleBinding").unwrap()[0];
        assert_eq!(rb["roleRef"]["name"], role, "{set}");
    }
    // The temp directory's settings, extra volumes and mounts (a CA for
    // sslmode=verify-full), and no temp directory at all.
    let (deploy, _) = render(
        "etl",
        &[
            "tmp.medium=Memory,tmp.sizeLimit=",
            "extraVolumes[0].name=pg-ca,extraVolumes[0].configMap.name=pg-ca",
            "extraVolumeMounts[0].name=pg-ca,extraVolumeMounts[0].mountPath=/etc/pg-ca",
        ],
    );
    let spec = &deploy["spec"]["template"]["spec"];
    assert_eq!(
        spec["volumes"],
        json!([{"name": "tmp", "emptyDir": {"medium": "Memory"}},
               {"name": "pg-ca", "configMap": {"name": "pg-ca"}}])
    );
    assert_eq!(
        spec["containers"][0]["volumeMounts"],
        json!([{"name": "tmp", "mountPath": "/tmp"},
               {"name": "pg-ca", "mountPath": "/etc/pg-ca"}])
    );
    let (deploy, _) = render("etl", &["tmp.sizeLimit="]);
    assert_eq!(
        deploy["spec"]["template"]["spec"]["volumes"],
        json!([{"name": "tmp", "emptyDir": {}}])
    );
    let (deploy, _) = render("etl", &["tmp.enabled=false"]);
    let spec = &deploy["spec"]["template"]["spec"];
    assert!(spec.get("volumes").is_none(), "{spec}");
    assert!(spec["containers"][0].get("volumeMounts").is_none());
    assert_eq!(get(&env_of(&deploy), "TMPDIR"), None);
    // In the node's network: several replicas per node once metrics are
    // off — no port declared (the scheduler would keep a second replica
    // Pending on "free ports") and none bound.
    let (deploy, _) = render("etl", &["hostNetwork=true", "metrics.enabled=false"]);
    let spec = &deploy["spec"]["template"]["spec"];
    assert_eq!(spec["hostNetwork"], true);
    assert_eq!(spec["dnsPolicy"], "ClusterFirstWithHostNet");
    assert!(spec["containers"][0].get("ports").is_none());
    assert_eq!(get(&env_of(&deploy), "BATCHLEASE_METRICS_ADDR"), None);
    // The operator chart's own name for that role, for the same release.
    let op = helm::template(&["ops", "charts/batchlease-operator"]).unwrap();
    assert!(
        helm::rendered(&op, "ClusterRole")
            .unwrap()
            .iter()
            .any(|r| r["metadata"]["name"] == "ops-batchlease-operator-worker"),
        "{op}"
    );
}

/// `kubectl auth can-i VERB RESOURCE` as `sa` of `ns`, in `in_ns`.
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
    kubectl::run(&args).unwrap().stdout.trim() == "yes"
}

#[tokio::test]
async fn worker_chart_installs_and_its_workers_run_tasks_on_its_rbac_only() {
    let cluster = Cluster::with_crds().await.unwrap();
    let ns = cluster.namespace("wchart").await.unwrap();
    let n = ns.name.as_str();
    let op_release = format!("o{}", &n[n.len() - 6..]);
    let mut operator =
        chart::Release::install(&op_release, n, &[format!("watchNamespaces={{{n}}}")]).unwrap();
    // The PostgreSQL URL in a Secret, as a user would keep it.
    let dir = PrivateDir::new(n).unwrap();
    let pg_url = batchlease_e2e::workers::pg_url().unwrap();
    let url_file = dir.write("pg-url", &pg_url).unwrap();
    kubectl::ok(&[
        "create",
        "secret",
        "generic",
        "pg",
        "-n",
        n,
        &format!("--from-file=url={}", url_file.display()),
    ])
    .unwrap();
    let sets = [
        format!("workerRole.operatorRelease={op_release}"),
        "postgres.existingSecret=pg".to_owned(),
        "queues={demo}".to_owned(),
        "slots=2".to_owned(),
    ];
    let mut install = vec!["install", "w", CHART, "-n", n, "--wait=false"];
    for s in &sets {
        install.extend(["--set", s.as_str()]);
    }
    let notes = helm::ok(&install).unwrap();
    assert!(
        notes.contains(&format!(
            "ClusterRole\n{op_release}-batchlease-operator-worker in {n}"
        )),
        "{notes}"
    );
    assert!(!notes.contains("WARNING"), "{notes}");

    // The objects exist as rendered.
    let sa = "w-batchlease-worker";
    let deploy = kubectl::ok(&[
        "get",
        "deployment",
        sa,
        "-n",
        n,
        "-o",
        "jsonpath={.spec.replicas} {.spec.template.spec.serviceAccountName} {.spec.template.spec.terminationGracePeriodSeconds}",
    ])
    .unwrap();
    assert_eq!(deploy, format!("2 {sa} 30"));
    kubectl::ok(&["get", "serviceaccount", sa, "-n", n]).unwrap();
    let role = kubectl::ok(&[
        "get",
        "rolebinding",
        sa,
        "-n",
        n,
        "-o",
        "jsonpath={.roleRef.kind}/{.roleRef.name}",
    ])
    .unwrap();
    assert_eq!(
        role,
        format!("ClusterRole/{op_release}-batchlease-operator-worker")
    );

    // What the worker role allows, and nothing more.
    let yes = [
        ("get", "taskleases.batchlease.dev"),
        ("list", "taskleases.batchlease.dev"),
        ("watch", "taskleases.batchlease.dev"),
        ("update", "taskleases.batchlease.dev"),
        ("get", "batchtasks.batchlease.dev"),
        ("create", "batchtasks.batchlease.dev"),
        // Its WorkerLease, when it renews per worker.
        ("create", "workerleases.batchlease.dev"),
        ("update", "workerleases.batchlease.dev"),
        ("delete", "workerleases.batchlease.dev"),
    ];
    let no = [
        ("create", "taskleases.batchlease.dev"),
        ("delete", "taskleases.batchlease.dev"),
        ("update", "batchtasks.batchlease.dev"),
        ("update", "batchtasks.batchlease.dev/status"),
        ("delete", "batchtasks.batchlease.dev"),
        ("get", "secrets"),
        ("create", "pods"),
        ("update", "taskqueues.batchlease.dev/status"),
        // Revocations are the operator's.
        ("update", "workerleases.batchlease.dev/status"),
        // Presence records are off in the operator chart by default.
        ("create", "leases.coordination.k8s.io"),
    ];
    for (verb, res) in yes {
        assert!(can(n, sa, verb, res, n), "worker cannot {verb} {res}");
    }
    for (verb, res) in no {
        assert!(!can(n, sa, verb, res, n), "worker may {verb} {res}");
    }
    // Only in the namespace it was bound in.
    assert!(!can(
        n,
        sa,
        "update",
        "taskleases.batchlease.dev",
        "default"
    ));

    // Run it: the operator on the operator chart's ServiceAccount, and the
    // demo worker as the kubelet would start pod w-0 of the rendered
    // Deployment — the image's entrypoint, the rendered args and env
    // (nothing else), the Secret's key where the mount puts it, and a token
    // bound to a Pod of the chart's ServiceAccount (what the holder-only
    // policy checks).
    let op_kc = kubectl::service_account_kubeconfig(n, &operator.full_name(), &dir).unwrap();
    let op =
        Operator::start_with(n, "op", vec![format!("--kubeconfig={}", op_kc.display())]).unwrap();
    let pod = "w-batchlease-worker-0";
    ns.api::<k8s_openapi::api::core::v1::Pod>()
        .create(&Default::default(), &chart::pod_object(pod, sa))
        .await
        .unwrap();
    let worker_kc = kubectl::pod_token_kubeconfig(n, sa, pod, &dir).unwrap();
    let mut sets_ref: Vec<&str> = vec!["-n", n];
    for s in &sets {
        sets_ref.extend(["--set", s.as_str()]);
    }
    let mut targs = vec!["w", CHART];
    targs.extend(sets_ref);
    let yaml = helm::template(&targs).unwrap();
    let rendered = &helm::rendered(&yaml, "Deployment").unwrap()[0];
    let (args, mut env) = helm::container_of(rendered, n, pod).unwrap();
    let mount =
        rendered["spec"]["template"]["spec"]["containers"][0]["volumeMounts"][0]["mountPath"]
            .as_str()
            .unwrap();
    for (k, v) in &mut env {
        if k == "BATCHLEASE_PG_URL_FILE" {
            assert_eq!(*v, format!("{mount}/url"));
            *v = url_file.display().to_string();
        }
        if k == "BATCHLEASE_METRICS_ADDR" {
            // Pods have addresses of their own; this process shares the host's.
            *v = "127.0.0.1:0".into();
        }
    }
    env.push(("KUBECONFIG".into(), worker_kc.display().to_string()));
    let worker = Process::start_clean(
        batchlease_e2e::workers::binary().unwrap(),
        n,
        pod,
        args,
        env,
    )
    .unwrap();
    op.wait_leading(Duration::from_secs(30)).await.unwrap();
    tasks::create(
        &ns,
        "job",
        json!({"queue": "demo", "payload": {"steps": 1, "stepMillis": 10}}),
    )
    .await
    .unwrap();
    let task = wait_phase(
        &ns,
        "job",
        TaskPhase::Succeeded,
        Duration::from_secs(60),
        || format!("{}{}", op.logs(), worker.logs()),
    )
    .await
    .unwrap();
    // Committed under the fence, through the Secret's URL, by the pod.
    let db = pg::connect().await.unwrap();
    let uid = task.metadata.uid.clone().unwrap();
    let (token, row) = pg::row(&db, &uid).await.unwrap().expect("no committed row");
    assert_eq!(token, 1, "{row}");
    let status = task.status.unwrap();
    let holder = status
        .history
        .last()
        .and_then(|h| h.holder.clone())
        .unwrap_or_default();
    assert!(holder.starts_with(&format!("{pod}/")), "holder {holder}");
    // Nothing refused but the presence record, which the operator chart
    // grants only with workerRole.presenceRecords (and the SDK says so).
    let logs = worker.logs().to_lowercase();
    for line in logs.lines().filter(|l| l.contains("forbidden")) {
        assert!(line.contains("presence record not written"), "{line}");
    }
    drop(worker);
    drop(op);
    helm::ok(&["uninstall", "w", "-n", n]).unwrap();
    operator.uninstall().unwrap();
    ns.cleanup().await.unwrap();
}

/// The optional PodMonitor (issue 40): off by default; on, it scrapes the
/// pods' `metrics` port in the release's namespace with the chart's
/// selector; asked for without a metrics port, the render fails naming
/// why.
#[test]
fn the_pod_monitor_scrapes_the_workers_metrics_port() {
    let yaml = helm::template(&["w", CHART, "-n", "ns"]).unwrap();
    assert!(helm::rendered(&yaml, "PodMonitor").unwrap().is_empty());
    let (deploy, yaml) = render(
        "ns",
        &[
            "metrics.podMonitor.enabled=true",
            "metrics.podMonitor.labels.release=prom",
        ],
    );
    let pms = helm::rendered(&yaml, "PodMonitor").unwrap();
    assert_eq!(pms.len(), 1, "{yaml}");
    let pm = &pms[0];
    assert_eq!(pm["metadata"]["namespace"], "ns");
    assert_eq!(pm["metadata"]["labels"]["release"], "prom");
    assert_eq!(
        pm["spec"]["selector"]["matchLabels"],
        deploy["spec"]["selector"]["matchLabels"]
    );
    assert_eq!(pm["spec"]["podMetricsEndpoints"][0]["port"], "metrics");
    let ports = &deploy["spec"]["template"]["spec"]["containers"][0]["ports"];
    assert!(
        ports
            .as_array()
            .is_some_and(|p| p.iter().any(|p| p["name"] == "metrics")),
        "{ports}"
    );
    let err = helm::template(&[
        "w",
        CHART,
        "-n",
        "ns",
        "--set",
        "metrics.podMonitor.enabled=true",
        "--set",
        "metrics.enabled=false",
    ])
    .unwrap_err()
    .to_string();
    assert!(err.contains("needs metrics.enabled"), "{err}");
}
