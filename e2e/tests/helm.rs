//! The Helm chart: it lints, carries exactly the generated CRDs, installs
//! with the real helm, and its RBAC is both sufficient (the operator and a
//! worker run end to end on the chart's ServiceAccount permissions) and
//! least-privilege (what they must not do, they cannot).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use batchlease_api::TaskPhase;
use batchlease_e2e::operator::Operator;
use batchlease_e2e::tasks::{self, wait_phase};
use batchlease_e2e::workers::{self, WorkerOpts};
use batchlease_e2e::{Cluster, helm, kubectl, pg};
use serde_json::json;

fn helm(args: &[&str]) -> String {
    helm::ok(args).unwrap()
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
        "taskqueues.batchlease.dev.yaml",
        "workerleases.batchlease.dev.yaml",
    ] {
        let crd =
            std::fs::read_to_string(batchlease_e2e::repo_root().join("crds").join(file)).unwrap();
        assert!(
            shown.contains(crd.trim()),
            "chart's {file} differs from crds/{file}"
        );
    }
}

#[test]
fn app_version_follows_the_crate_version() {
    let chart = std::fs::read_to_string(
        batchlease_e2e::repo_root().join("charts/batchlease-operator/Chart.yaml"),
    )
    .unwrap();
    let chart: serde_json::Value = serde_yaml::from_str(&chart).unwrap();
    // The workspace shares one version; the image tag defaults to it.
    assert_eq!(
        chart["appVersion"].as_str(),
        Some(env!("CARGO_PKG_VERSION")),
        "charts/batchlease-operator/Chart.yaml appVersion must be the crates' version"
    );
}

#[test]
fn the_chart_states_the_kubernetes_it_needs() {
    let root = batchlease_e2e::repo_root();
    let chart: serde_json::Value = serde_yaml::from_str(
        &std::fs::read_to_string(root.join("charts/batchlease-operator/Chart.yaml")).unwrap(),
    )
    .unwrap();
    let range = ">=1.32.0-0";
    assert_eq!(chart["kubeVersion"].as_str(), Some(range));
    // Why 1.32: the CRDs use selectableFields (GA in 1.32; the policy
    // API, GA in 1.30, is older).
    for file in ["batchtasks", "taskleases"] {
        let crd =
            std::fs::read_to_string(root.join(format!("crds/{file}.batchlease.dev.yaml"))).unwrap();
        assert!(crd.contains("selectableFields:"), "{file}");
    }
    let readme =
        std::fs::read_to_string(root.join("charts/batchlease-operator/README.md")).unwrap();
    assert!(readme.contains(range), "the chart README states {range}");
    // Older clusters are refused, before anything is rendered.
    let old = helm::run(&[
        "template",
        "r",
        "charts/batchlease-operator",
        "--kube-version",
        "1.31.9",
    ])
    .unwrap();
    assert!(!old.success, "{}", old.stdout);
    assert!(
        old.combined().contains(
            "chart requires kubeVersion: >=1.32.0-0 which is incompatible with Kubernetes v1.31.9"
        ),
        "{}",
        old.combined()
    );
    // Where the API server does not serve the admission-policy API, the
    // policy is left out (instead of failing the install) …
    let without = helm(&[
        "template",
        "r",
        "charts/batchlease-operator",
        "--kube-version",
        "1.32.0",
    ]);
    for kind in [
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ] {
        assert!(
            helm::rendered(&without, kind).unwrap().is_empty(),
            "{kind} rendered without the API"
        );
    }
    assert_eq!(helm::rendered(&without, "Deployment").unwrap().len(), 1);
    let with = helm::template(&["r", "charts/batchlease-operator"]).unwrap();
    // Holder-only writes to TaskLeases, and to WorkerLeases.
    assert_eq!(
        helm::rendered(&with, "ValidatingAdmissionPolicy")
            .unwrap()
            .len(),
        2
    );
    // … and NOTES.txt says so. `helm install --dry-run=client` asks the
    // cluster for its APIs (helm 3.22), and this one serves the policy:
    // render NOTES.txt with `helm template` (no cluster) instead, as a
    // ConfigMap in a copy of the chart.
    let notes = |sets: &str| {
        let dir = batchlease_e2e::secrets::PrivateDir::new("chart-copy").unwrap();
        let copy = dir.path().join("batchlease-operator");
        let cp = std::process::Command::new("cp")
            .args(["-r", "charts/batchlease-operator"])
            .arg(&copy)
            .current_dir(&root)
            .status()
            .unwrap();
        assert!(cp.success());
        let text = std::fs::read_to_string(copy.join("templates/NOTES.txt")).unwrap();
        std::fs::remove_file(copy.join("templates/NOTES.txt")).unwrap();
        std::fs::write(
            copy.join("templates/_notes.tpl"),
            format!("{{{{- define \"notes\" -}}}}\n{text}{{{{- end -}}}}\n"),
        )
        .unwrap();
        std::fs::write(
            copy.join("templates/notes.yaml"),
            "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n\
             data: {notes: {{ include \"notes\" . | quote }}}\n",
        )
        .unwrap();
        let yaml = helm(&[
            "template",
            "r",
            copy.to_str().unwrap(),
            "--kube-version",
            "1.32.0",
            "--set",
            sets,
        ]);
        let cm = helm::rendered(&yaml, "ConfigMap").unwrap();
        cm[0]["data"]["notes"].as_str().unwrap().to_owned()
    };
    let skipped = notes("admission.enabled=true");
    for says in [
        "WARNING: the holder-only admission policy was NOT installed",
        "--api-versions admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy",
    ] {
        assert!(
            skipped.contains(says),
            "NOTES should say {says:?}:\n{skipped}"
        );
    }
    assert!(
        !skipped.contains("Holder-only admission is on"),
        "{skipped}"
    );
    // Switched off on purpose: no warning.
    let off = notes("admission.enabled=false");
    assert!(off.contains("kubectl get taskleases -A"), "{off}");
    assert!(!off.contains("WARNING"), "{off}");
}

#[test]
fn bad_values_are_refused_with_a_clear_message() {
    // (value, what the error must say, whether `helm lint` fails too: it
    // checks the schema, but reports a template's `fail` as [INFO] only)
    let cases = [
        (
            "replicaCount=0",
            "at '/replicaCount': minimum: got 0, want 1",
            true,
        ),
        (
            "logFormat=xml",
            "at '/logFormat': value must be one of 'text', 'json'",
            true,
        ),
        (
            "watchNamespaces={Not_A_Namespace}",
            "'Not_A_Namespace' does not match pattern",
            true,
        ),
        ("metrics.port=70000", "at '/metrics/port': maximum", true),
        ("image.pullPolicy=Sometimes", "at '/image/pullPolicy'", true),
        (
            "replicas=2",
            "additional properties 'replicas' not allowed",
            true,
        ),
        (
            "admission.exemptUsers=alice",
            "at '/admission/exemptUsers'",
            true,
        ),
        // Two replicas without leader election would both write.
        (
            "leaderElection.enabled=false",
            "at '/replicaCount': maximum: got 2, want 1",
            true,
        ),
        (
            "metrics.service.enabled=false,metrics.serviceMonitor.enabled=true",
            "at '/metrics/service/enabled': value must be true",
            true,
        ),
        // No grace: a standby's takeover could meet the old leader's last
        // write (issue 23).
        (
            "leaderElection.graceSeconds=0",
            "at '/leaderElection/graceSeconds': minimum: got 0, want 1",
            true,
        ),
        (
            "leaderElection.graceSeconds=15",
            "leaderElection.graceSeconds must be less than leaderElection.leaseDurationSeconds",
            false,
        ),
    ];
    for (value, says, lint_fails) in cases {
        let chart = "charts/batchlease-operator";
        let mut template = vec!["template", "r", chart, "--set", value];
        template.extend(helm::CLUSTER);
        let lint = ["lint", chart, "--set", value];
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
    // And good values render what they ask for.
    let yaml = helm::template(&[
        "r",
        "charts/batchlease-operator",
        "-n",
        "ops",
        "--set",
        "podDisruptionBudget.enabled=true,metrics.serviceMonitor.enabled=true,replicaCount=1,leaderElection.enabled=false",
        "--set",
        "watchNamespaces={a,b}",
    ])
    .unwrap();
    let pdb = helm::rendered(&yaml, "PodDisruptionBudget").unwrap();
    assert_eq!(pdb.len(), 1, "{yaml}");
    assert_eq!(pdb[0]["spec"]["minAvailable"], 1);
    let sm = helm::rendered(&yaml, "ServiceMonitor").unwrap();
    assert_eq!(sm[0]["spec"]["endpoints"][0]["port"], "metrics", "{yaml}");
    let binding = helm::rendered(&yaml, "ValidatingAdmissionPolicyBinding").unwrap();
    assert_eq!(
        binding[0]["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"][0]["values"],
        serde_json::json!(["a", "b"]),
        "the holder-only policy binds where the release runs tasks"
    );
    let policy = helm::rendered(&yaml, "ValidatingAdmissionPolicy").unwrap();
    assert_eq!(
        policy[0]["spec"]["matchConditions"][0]["expression"],
        "!(request.userInfo.username in [\"system:serviceaccount:ops:r-batchlease-operator\",\"system:serviceaccount:kube-system:generic-garbage-collector\",\"system:kube-controller-manager\"])"
    );
    let deploy = &helm::rendered(&yaml, "Deployment").unwrap()[0];
    let args = &deploy["spec"]["template"]["spec"]["containers"][0]["args"];
    assert!(
        args.as_array()
            .unwrap()
            .iter()
            .any(|a| a == "--leader-election=false"),
        "{args}"
    );
    // Off by default: no CRD of the Prometheus Operator needed, no PDB.
    let plain = helm::template(&["r", "charts/batchlease-operator"]).unwrap();
    assert!(helm::rendered(&plain, "ServiceMonitor").unwrap().is_empty());
    assert!(
        helm::rendered(&plain, "PodDisruptionBudget")
            .unwrap()
            .is_empty()
    );
    // NOTES.txt tells how to look at tasks and leases (a server dry run:
    // the real cluster's version and APIs; nothing is created).
    let notes = helm(&[
        "install",
        "r",
        "charts/batchlease-operator",
        "-n",
        "ops",
        "--dry-run=server",
        "--set",
        "watchNamespaces={a,b}",
    ]);
    for says in [
        "It runs the BatchTasks of: a, b.",
        "kubectl get taskleases -A",
        "kubectl get batchtasks -A",
        "--clusterrole=r-batchlease-operator-worker",
        "Holder-only admission is on",
    ] {
        assert!(notes.contains(says), "NOTES should say {says:?}:\n{notes}");
    }
    assert!(!notes.contains("WARNING"), "{notes}");
}

#[test]
fn pod_settings_render_where_they_belong_and_bad_ones_are_refused() {
    let chart = "charts/batchlease-operator";
    // (flag, value, what the error says)
    let bad = [
        (
            "--set",
            "extraEnv[0].value=x",
            "at '/extraEnv/0': missing property 'name'",
        ),
        (
            "--set",
            "extraArgs[0]=1",
            "at '/extraArgs/0': got number, want string",
        ),
        (
            "--set",
            "nodeSelector.disk=1",
            "at '/nodeSelector/disk': got number, want string",
        ),
        (
            "--set",
            "podLabels.team=1",
            "at '/podLabels/team': got number, want string",
        ),
        (
            "--set",
            "tolerations.key=x",
            "at '/tolerations': got object, want array",
        ),
        (
            "--set-json",
            r#"imagePullSecrets=[{"name":""}]"#,
            "at '/imagePullSecrets/0/name': minLength: got 0, want 1",
        ),
        (
            "--set-json",
            r#"imagePullSecrets=["regcred"]"#,
            "at '/imagePullSecrets/0': got string, want object",
        ),
    ];
    for (flag, value, says) in bad {
        let mut args = vec!["template", "r", chart, flag, value];
        args.extend(helm::CLUSTER);
        let out = helm::run(&args).unwrap();
        assert!(!out.success, "{flag} {value} passed");
        assert!(
            out.combined().contains(says),
            "{flag} {value} should say {says:?}:\n{}",
            out.combined()
        );
    }
    let yaml = helm::template(&[
        "r",
        chart,
        "--set-json",
        r#"imagePullSecrets=[{"name":"regcred"}]"#,
        "--set-json",
        r#"extraArgs=["--events=all"]"#,
        "--set-json",
        r#"extraEnv=[{"name":"KUBERNETES_SERVICE_HOST","value":"127.0.0.1"}]"#,
        "--set",
        "podAnnotations.a=b,podLabels.team=batch,nodeSelector.disk=ssd",
        "--set-json",
        r#"tolerations=[{"key":"dedicated","operator":"Exists"}]"#,
        "--set-json",
        r#"affinity={"nodeAffinity":{"requiredDuringSchedulingIgnoredDuringExecution":{"nodeSelectorTerms":[{"matchExpressions":[{"key":"zone","operator":"In","values":["a"]}]}]}}}"#,
        "--set-json",
        r#"topologySpreadConstraints=[{"maxSkew":1,"topologyKey":"kubernetes.io/hostname","whenUnsatisfiable":"ScheduleAnyway"}]"#,
    ])
    .unwrap();
    let deploy = &helm::rendered(&yaml, "Deployment").unwrap()[0];
    let pod = &deploy["spec"]["template"];
    let spec = &pod["spec"];
    let c = &spec["containers"][0];
    assert_eq!(spec["imagePullSecrets"], json!([{"name": "regcred"}]));
    let args = c["args"].as_array().unwrap();
    assert_eq!(args.last().unwrap(), "--events=all", "appended: {args:?}");
    let env = c["env"].as_array().unwrap();
    assert_eq!(env[0]["name"], "POD_NAME", "the chart's own come first");
    assert_eq!(
        env.last().unwrap(),
        &json!({"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"})
    );
    assert_eq!(pod["metadata"]["annotations"], json!({"a": "b"}));
    assert_eq!(pod["metadata"]["labels"]["team"], "batch");
    // Added labels stay out of the selector (it is immutable).
    assert!(
        deploy["spec"]["selector"]["matchLabels"]
            .get("team")
            .is_none()
    );
    assert_eq!(spec["nodeSelector"], json!({"disk": "ssd"}));
    assert_eq!(spec["tolerations"][0]["key"], "dedicated");
    assert_eq!(
        spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
            [0]["matchExpressions"][0]["key"],
        "zone"
    );
    assert_eq!(spec["topologySpreadConstraints"][0]["maxSkew"], 1);
    // None of it by default; memory sized for ~50,000 tasks (values.yaml
    // and the README give the rule).
    let plain = helm::template(&["r", chart]).unwrap();
    let deploy = &helm::rendered(&plain, "Deployment").unwrap()[0];
    let spec = &deploy["spec"]["template"]["spec"];
    for key in [
        "imagePullSecrets",
        "nodeSelector",
        "tolerations",
        "affinity",
        "topologySpreadConstraints",
    ] {
        assert!(spec.get(key).is_none(), "{key}: {spec}");
    }
    assert!(
        deploy["spec"]["template"]["metadata"]
            .get("annotations")
            .is_none()
    );
    let resources = &spec["containers"][0]["resources"];
    assert_eq!(resources["limits"]["memory"], "384Mi", "{resources}");
    assert_eq!(resources["requests"]["memory"], "64Mi", "{resources}");
    for file in ["values.yaml", "README.md"] {
        let text = std::fs::read_to_string(
            batchlease_e2e::repo_root()
                .join("charts/batchlease-operator")
                .join(file),
        )
        .unwrap();
        assert!(text.contains("6 KiB"), "{file} gives the memory rule");
        assert!(
            text.contains("batchlease_cache_objects"),
            "{file} names the metric"
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
        // Tasks past their ttlSecondsAfterFinished.
        ("delete", "batchtasks.batchlease.dev", n),
        // Resource locks live in the operator's own namespace.
        ("update", "leases.coordination.k8s.io", n),
        ("create", "leases.coordination.k8s.io", n),
    ];
    let no = [
        ("update", "batchtasks.batchlease.dev", n),
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
    // A worker as in a pod: a token bound to its Pod object, its identity
    // the pod's name (the chart's holder-only policy is on by default and
    // checks both; e2e/tests/admission.rs tests it).
    let worker_kc = batchlease_e2e::chart::worker_pod(
        &ns,
        &format!("{release}-batchlease-operator-worker"),
        "sa-worker",
        &dir,
    )
    .await
    .unwrap();
    let _db = pg::connect().await.unwrap();
    let opts = WorkerOpts {
        kubeconfig: Some(worker_kc),
        pod_name: Some("sa-worker".into()),
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
