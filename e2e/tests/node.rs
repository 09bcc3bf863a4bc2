//! Pods that really run: on the node of `e2e/node/up.sh` (a kubelet and
//! containerd with runc; `hack/test.sh` always starts it). A demo-worker
//! pod runs to completion and `kubectl logs` reads it; a running pod's
//! deletion goes through the kubelet; and the operator as the chart
//! deploys it — Deployment, ReplicaSet, scheduler, the kubelet starting
//! the image with the service-account token it mounts, the kubelet's
//! probes — runs as two replicas on the node's pod network: one leads,
//! the other stands by warm, and after `kubectl delete pod` of the leader
//! the standby leads while a worker's running task keeps its lease.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use batchlease_api::{TaskLease, TaskPhase};
use batchlease_e2e::chart::Release;
use batchlease_e2e::secrets::PrivateDir;
use batchlease_e2e::tasks::{self, wait_phase, wait_task};
use batchlease_e2e::workers::{self, WorkerOpts};
use batchlease_e2e::{Cluster, TestNamespace, audit, kubectl, node, pg, wait_for};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use kube::api::{DeleteParams, ListParams, PostParams};
use serde_json::json;

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// The ServiceAccount admission plugin refuses pods until the namespace's
/// `default` ServiceAccount exists (kube-controller-manager creates it).
async fn wait_default_sa(ns: &TestNamespace) {
    let api = ns.api::<ServiceAccount>();
    wait_for(
        "the namespace's default ServiceAccount",
        Duration::from_secs(30),
        || node::diagnostics(&ns.name),
        || {
            let api = api.clone();
            async move { Ok(api.get_opt("default").await?.map(|_| ())) }
        },
    )
    .await
    .unwrap();
}

async fn wait_pod<T>(
    ns: &TestNamespace,
    what: &str,
    timeout: Duration,
    extra: impl Fn() -> String,
    check: impl Fn(&[Pod]) -> Option<T>,
) -> T {
    let api = ns.api::<Pod>();
    let check = &check;
    wait_for(
        what,
        timeout,
        || format!("{}\n{}", node::diagnostics(&ns.name), extra()),
        || {
            let api = api.clone();
            async move { Ok(check(&api.list(&ListParams::default()).await?.items)) }
        },
    )
    .await
    .unwrap()
}

fn phase(p: &Pod) -> &str {
    p.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or_default()
}

fn condition(p: &Pod, kind: &str) -> Option<(String, String)> {
    p.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == kind)
        .map(|c| (c.status.clone(), c.message.clone().unwrap_or_default()))
}

fn ready(p: &Pod) -> bool {
    p.metadata.deletion_timestamp.is_none()
        && condition(p, "Ready").is_some_and(|(s, _)| s == "True")
}

fn pod_ip(p: &Pod) -> Option<String> {
    p.status.as_ref()?.pod_ip.clone()
}

fn name(p: &Pod) -> String {
    p.metadata.name.clone().unwrap_or_default()
}

#[tokio::test]
async fn a_pod_runs_on_the_node_logs_and_is_deleted_through_the_kubelet() {
    let Some(node_name) = node::or_skip("a_pod_runs_on_the_node") else {
        return;
    };
    let cluster = Cluster::with_crds().await.unwrap();
    let ns = cluster.namespace("node-pod").await.unwrap();
    let n = ns.name.clone();
    wait_default_sa(&ns).await;
    let pods = ns.api::<Pod>();

    // The demo worker's --help, run to completion by the kubelet (placed
    // by the scheduler; the image imported, never pulled).
    let help: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "help"},
        "spec": {
            "hostNetwork": true, "restartPolicy": "Never",
            "tolerations": [node::toleration()],
            "containers": [{
                "name": "main", "image": node::image("batchlease-demo-worker"),
                "imagePullPolicy": "Never", "args": ["--help"],
            }],
        },
    }))
    .unwrap();
    let started = std::time::Instant::now();
    pods.create(&PostParams::default(), &help).await.unwrap();
    let done = wait_pod(
        &ns,
        "pod help Succeeded",
        Duration::from_secs(90),
        String::new,
        |ps| {
            ps.iter()
                .find(|p| name(p) == "help" && phase(p) == "Succeeded")
                .cloned()
        },
    )
    .await;
    eprintln!(
        "pod help: created → Succeeded in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let spec = done.spec.as_ref().unwrap();
    assert_eq!(spec.node_name.as_deref(), Some(node_name.as_str()));
    let status = done.status.as_ref().unwrap();
    assert_eq!(
        status.host_ip.as_deref(),
        Some(node::ip().unwrap().as_str())
    );
    let cs = &status.container_statuses.as_ref().unwrap()[0];
    assert!(
        cs.container_id
            .as_deref()
            .is_some_and(|id| id.starts_with("containerd://")),
        "{cs:?}"
    );
    let terminated = cs.state.as_ref().unwrap().terminated.as_ref().unwrap();
    assert_eq!(terminated.exit_code, 0, "{terminated:?}");
    // The service-account token the kubelet mounted (ServiceAccount
    // admission put the projected volume in).
    assert!(
        spec.volumes
            .iter()
            .flatten()
            .any(|v| v.projected.as_ref().is_some_and(|p| p
                .sources
                .iter()
                .flatten()
                .any(|s| s.service_account_token.is_some()))),
        "no service-account token volume: {spec:?}"
    );
    // Its output, read through the API server from the kubelet.
    let logs = kubectl::ok(&["logs", "help", "-n", &n]).unwrap();
    assert!(
        logs.contains("Usage: batchlease-demo-worker"),
        "kubectl logs help:\n{logs}"
    );

    // A running pod (the pause image: it waits for a signal) is deleted
    // gracefully: the API server only marks it, the kubelet stops its
    // container and then removes the object.
    let sleeper: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "sleeper"},
        "spec": {
            "hostNetwork": true, "terminationGracePeriodSeconds": 30,
            "tolerations": [node::toleration()],
            "containers": [{
                "name": "main", "image": format!("batchlease.local/pause:{}", pause_tag()),
                "imagePullPolicy": "Never",
            }],
        },
    }))
    .unwrap();
    pods.create(&PostParams::default(), &sleeper).await.unwrap();
    let running = wait_pod(
        &ns,
        "pod sleeper Running",
        Duration::from_secs(60),
        String::new,
        |ps| {
            ps.iter()
                .find(|p| name(p) == "sleeper" && phase(p) == "Running")
                .cloned()
        },
    )
    .await;
    let id = running
        .status
        .as_ref()
        .unwrap()
        .container_statuses
        .as_ref()
        .unwrap()[0]
        .container_id
        .clone()
        .unwrap();
    let id = id.trim_start_matches("containerd://").to_owned();
    assert!(
        node::running_containers().unwrap().contains(&id),
        "containerd does not run {id}"
    );
    let deleted_at = std::time::Instant::now();
    pods.delete("sleeper", &DeleteParams::default())
        .await
        .unwrap();
    let marked = pods.get_opt("sleeper").await.unwrap();
    assert!(
        marked.is_some_and(|p| p.metadata.deletion_timestamp.is_some()),
        "a running pod's deletion must wait for its kubelet"
    );
    wait_for(
        "pod sleeper gone (the kubelet confirmed its deletion)",
        Duration::from_secs(60),
        || node::diagnostics(&n),
        || {
            let pods = pods.clone();
            async move { Ok(pods.get_opt("sleeper").await?.is_none().then_some(())) }
        },
    )
    .await
    .unwrap();
    eprintln!(
        "pod sleeper: delete → gone in {:.1} s",
        deleted_at.elapsed().as_secs_f64()
    );
    assert!(
        !node::running_containers().unwrap().contains(&id),
        "containerd still runs {id} after the kubelet deleted its pod"
    );
    pods.delete("help", &DeleteParams::default()).await.unwrap();
    ns.cleanup().await.unwrap();
}

/// The pause image's tag (e2e/node/versions.env).
fn pause_tag() -> String {
    let env =
        std::fs::read_to_string(batchlease_e2e::crate_dir().join("node/versions.env")).unwrap();
    env.lines()
        .find_map(|l| l.strip_prefix("PAUSE_TAG="))
        .unwrap()
        .trim()
        .to_owned()
}

/// The pod named by the election Lease's holder (`<pod>-<6 hex digits>`).
async fn leader_pod(ns: &TestNamespace) -> anyhow::Result<Option<String>> {
    let lease = ns.api::<Lease>().get_opt("batchlease-operator").await?;
    Ok(lease
        .and_then(|l| l.spec?.holder_identity)
        .and_then(|h| h.rsplit_once('-').map(|(pod, _)| pod.to_owned())))
}

#[tokio::test]
async fn the_chart_runs_the_operator_on_the_node_and_the_standby_takes_over() {
    let Some(node_name) = node::or_skip("the_chart_runs_the_operator_on_the_node") else {
        return;
    };
    let cluster = Cluster::with_crds().await.unwrap();
    let ns = cluster.namespace("node-op").await.unwrap();
    let n = ns.name.clone();
    wait_default_sa(&ns).await;
    let release_name = format!("n{}", &n[n.len() - 6..]);
    let sa = format!("{release_name}-batchlease-operator");
    let user = format!("system:serviceaccount:{n}:{sa}");
    // On the node's pod network: each replica has its own address, so
    // both run — one leads, the other is a warm standby. No kube-proxy:
    // the API server is reached at this host's address, not the Service IP.
    let (api_host, api_port) = node::api_from_pods().unwrap();
    let sets = [
        format!("watchNamespaces={{{n}}}"),
        "image.pullPolicy=Never".into(),
        "logFormat=text".into(),
        format!("tolerations[0].key={}", node::TAINT),
        "tolerations[0].operator=Exists".into(),
        "tolerations[0].effect=NoSchedule".into(),
    ];
    let strings = [
        "extraEnv[0].name=KUBERNETES_SERVICE_HOST".to_owned(),
        format!("extraEnv[0].value={api_host}"),
        "extraEnv[1].name=KUBERNETES_SERVICE_PORT".into(),
        format!("extraEnv[1].value={api_port}"),
    ];
    let mut release = Release::install_with(&release_name, &n, &sets, &strings).unwrap();
    let diag = || node::diagnostics(&n);

    // The Deployment's two replicas, both started by the kubelet on the
    // pod network; the kubelet's probes reach each at its own address.
    let pods_now = || async { ns.api::<Pod>().list(&ListParams::default()).await };
    wait_pod(
        &ns,
        "both operator pods Running, each with its pod-network address",
        Duration::from_secs(120),
        String::new,
        |ps| {
            let running = ps
                .iter()
                .filter(|p| phase(p) == "Running" && pod_ip(p).is_some())
                .count();
            (running == 2).then_some(())
        },
    )
    .await;
    let metrics_port = pods_now().await.unwrap().items[0]
        .spec
        .as_ref()
        .unwrap()
        .containers[0]
        .ports
        .as_ref()
        .and_then(|ps| ps.iter().find(|p| p.name.as_deref() == Some("metrics")))
        .map(|p| u16::try_from(p.container_port).unwrap())
        .expect("the chart names its metrics port");
    // One leads: the election Lease names it and its /metrics says so;
    // the other says it does not lead and is Ready too — a warm standby,
    // its caches synced, that takes over without a pod start.
    let (first, standby) = wait_for(
        "one replica to lead and the other to stand by, both Ready",
        Duration::from_secs(60),
        diag,
        || async {
            let Some(leader) = leader_pod(&ns).await? else {
                return Ok(None);
            };
            let mut roles = Vec::new();
            for p in pods_now().await?.items.iter().filter(|p| ready(p)) {
                let ip = pod_ip(p).unwrap_or_default();
                let leads = workers::metric_at(&ip, metrics_port, "batchlease_is_leader")
                    .await
                    .ok()
                    .flatten();
                roles.push((name(p), leads));
            }
            let leading = roles.iter().find(|(p, l)| *p == leader && *l == Some(1.0));
            let standing = roles.iter().find(|(p, l)| *p != leader && *l == Some(0.0));
            Ok(leading
                .zip(standing)
                .map(|(l, s)| (l.0.clone(), s.0.clone())))
        },
    )
    .await
    .unwrap();
    let pod = ns.api::<Pod>().get(&first).await.unwrap();
    let spec = pod.spec.as_ref().unwrap();
    assert_eq!(spec.node_name.as_deref(), Some(node_name.as_str()));
    assert_ne!(spec.host_network, Some(true));
    assert_eq!(spec.service_account_name.as_deref(), Some(sa.as_str()));
    let container = &spec.containers[0];
    assert!(
        container.readiness_probe.is_some() && container.liveness_probe.is_some(),
        "the chart's probes: {container:?}"
    );
    let ips: Vec<_> = pods_now()
        .await
        .unwrap()
        .items
        .iter()
        .filter_map(pod_ip)
        .collect();
    let cidr = std::env::var("BATCHLEASE_POD_CIDR").unwrap();
    let prefix = cidr.rsplit_once('.').unwrap().0;
    assert!(
        ips.len() == 2 && ips[0] != ips[1] && ips.iter().all(|ip| ip.starts_with(prefix)),
        "two addresses of the pod network {cidr}: {ips:?}"
    );
    eprintln!("{first} leads; {standby} stands by (pod addresses {ips:?})");

    // A task held by a worker the harness runs (its token bound to a Pod
    // object, as the chart's holder-only policy wants).
    let dir = PrivateDir::new(&n).unwrap();
    let worker_kc = batchlease_e2e::chart::worker_pod(&ns, &format!("{sa}-worker"), "w1", &dir)
        .await
        .unwrap();
    let _db = pg::connect().await.unwrap();
    let worker = workers::start(
        &n,
        "w1",
        &WorkerOpts {
            kubeconfig: Some(worker_kc),
            pod_name: Some("w1".into()),
            ..Default::default()
        },
    )
    .unwrap();
    // Long enough to outlast the failover below (≈ a lease duration, 15 s,
    // plus a pod start).
    tasks::create(
        &ns,
        "job",
        json!({"queue": "demo", "payload": {"steps": 45, "stepMillis": 1000}}),
    )
    .await
    .unwrap();
    wait_task(
        &ns,
        "job",
        "Running, held by w1",
        Duration::from_secs(60),
        || format!("{}{}", diag(), worker.logs()),
        |t| {
            t.status.as_ref().is_some_and(|s| {
                s.phase == Some(TaskPhase::Running)
                    && s.holder.as_deref().is_some_and(|h| h.starts_with("w1/"))
            })
        },
    )
    .await
    .unwrap();

    // The operator's writes came with the token the kubelet mounted: the
    // chart's ServiceAccount, bound to the pod.
    let writes = audit::writes_in(&n).unwrap();
    assert!(
        writes
            .iter()
            .any(|w| w.user == user && w.pod.as_deref() == Some(first.as_str())),
        "no write by {user} from pod {first}: {writes:?}"
    );

    // Delete the leader's pod: it gives up its term as the kubelet stops
    // it, and a standby takes over — the warm one, or the ReplicaSet's
    // replacement: the old leader may take up to 5 s to vacate (reconciles
    // 3 s, the vacate 2 s), the replacement can be running by then, and
    // each candidate waits a full lease duration from its first sight of
    // the vacated Lease (docs/operator.md, shutdown), both looking every
    // second — equals in that race.
    let deleted = now();
    kubectl::ok(&["delete", "pod", &first, "-n", &n, "--wait=false"]).unwrap();
    let next = wait_for(
        "the standby to lead",
        Duration::from_secs(120),
        || format!("{}{}", diag(), worker.logs()),
        || async {
            let Some(leader) = leader_pod(&ns).await? else {
                return Ok(None);
            };
            if leader == first {
                return Ok(None);
            }
            let Some(pod) = ns.api::<Pod>().get_opt(&leader).await? else {
                return Ok(None);
            };
            let ip = pod_ip(&pod).unwrap_or_default();
            let leads = workers::metric_at(&ip, metrics_port, "batchlease_is_leader")
                .await
                .ok()
                .flatten();
            Ok((ready(&pod) && leads == Some(1.0)).then_some(leader))
        },
    )
    .await
    .unwrap();
    assert_ne!(next, first);
    let took_over = if next == standby {
        "the warm standby"
    } else {
        "the ReplicaSet's replacement"
    };
    wait_for(
        "the deleted pod gone",
        Duration::from_secs(60),
        diag,
        || async {
            let gone = ns.api::<Pod>().get_opt(&first).await?.is_none();
            Ok(gone.then_some(()))
        },
    )
    .await
    .unwrap();
    let writes = audit::writes_in(&n).unwrap();
    let by = |pod: &str| {
        writes
            .iter()
            .filter(|w| w.user == user && w.pod.as_deref() == Some(pod))
            .cloned()
            .collect::<Vec<_>>()
    };
    let new_writes = by(&next);
    // Its first write after the delete (before it, it may have created
    // the election Lease, vacated, when the namespace had none).
    let first_write = new_writes
        .iter()
        .find(|w| w.received >= deleted)
        .expect("the new leader wrote");
    let old_last = by(&first).last().map(|w| w.at).unwrap_or(deleted);
    assert!(
        first_write.received >= old_last,
        "the new leader wrote before the old one's last write ({first_write:?})"
    );
    // The standby wrote no task or lease of ours while it stood by (the
    // election Lease aside).
    assert!(
        new_writes
            .iter()
            .all(|w| w.received >= deleted || w.resource == "leases"),
        "the standby wrote before the leader's pod was deleted: {new_writes:?}"
    );
    eprintln!(
        "failover: kubectl delete pod {first} → {took_over} {next}'s first write ({} {}) {:.1} s \
         (the old leader's last write {:.1} s after the delete)",
        first_write.verb,
        first_write.resource,
        first_write.received - deleted,
        old_last - deleted,
    );
    // The pod that did not take over — the replacement or the old
    // standby — stands by.
    wait_for(
        "a standby (the pod that did not take over, Ready, not leading)",
        Duration::from_secs(120),
        diag,
        || async {
            for p in pods_now().await?.items.iter().filter(|p| ready(p)) {
                let (pod, ip) = (name(p), pod_ip(p).unwrap_or_default());
                if pod == first || pod == next {
                    continue;
                }
                let leads = workers::metric_at(&ip, metrics_port, "batchlease_is_leader")
                    .await
                    .ok()
                    .flatten();
                if leads == Some(0.0) {
                    return Ok(Some(()));
                }
            }
            Ok(None)
        },
    )
    .await
    .unwrap();

    // The task was not disturbed: the same lease, one attempt, and the
    // worker's commit under its token.
    let done = wait_phase(
        &ns,
        "job",
        TaskPhase::Succeeded,
        Duration::from_secs(120),
        || format!("{}{}", diag(), worker.logs()),
    )
    .await
    .unwrap();
    let status = done.status.unwrap();
    assert_eq!(status.fencing_token, 1, "{status:?}");
    let leases = ns
        .api::<TaskLease>()
        .list(&ListParams::default())
        .await
        .unwrap();
    let names: Vec<_> = leases
        .items
        .iter()
        .filter_map(|l| l.metadata.name.clone())
        .collect();
    assert_eq!(names, ["job-1"], "one lease, never reissued");
    let nothing_new = tasks::event_reasons(&ns, "job").await.unwrap();
    assert!(
        !nothing_new
            .iter()
            .any(|r| r == "LeaseExpired" || r == "Reassigned"),
        "{nothing_new:?}"
    );

    // helm uninstall: the kubelet stops the remaining replicas.
    release.uninstall().unwrap();
    wait_pod(
        &ns,
        "the release's pods gone",
        Duration::from_secs(60),
        String::new,
        |ps| (!ps.iter().any(|p| name(p).starts_with(&sa))).then_some(()),
    )
    .await;
    drop(worker);
    ns.finish().await.unwrap();
}
