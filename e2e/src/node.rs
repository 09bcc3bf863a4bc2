//! The node `e2e/node/up.sh` starts (a kubelet and containerd, registered
//! with the test control plane): pods that really run. `hack/test.sh`
//! always starts it and sets `BATCHLEASE_NODE`; the images of
//! `hack/image.sh` are imported into it (`e2e/node/import.sh`), never
//! pulled.

use std::process::Command;

use anyhow::Context;

use crate::kubectl;

/// The taint the node registers with: only pods tolerating it run there
/// (other tests' Deployments stay Pending, as without a node).
pub const TAINT: &str = "batchlease.dev/e2e-node";

/// The node's name, if `hack/test.sh` (or `local_env_up DIR node`) started
/// one.
pub fn name() -> Option<String> {
    std::env::var("BATCHLEASE_NODE")
        .ok()
        .filter(|n| !n.is_empty())
}

/// The node's name, or `None` after saying why `test` does nothing: no
/// node was started.
pub fn or_skip(test: &str) -> Option<String> {
    let node = name();
    if node.is_none() {
        eprintln!(
            "SKIPPED {test}: BATCHLEASE_NODE is unset — no node was started \
             (hack/test.sh starts one; by hand: `local_env_up DIR node` from hack/local-env.sh)"
        );
    }
    node
}

/// The node's address (the host's own: hostNetwork pods have it).
pub fn ip() -> anyhow::Result<String> {
    std::env::var("BATCHLEASE_NODE_IP").context("BATCHLEASE_NODE_IP unset (e2e/node/up.sh's env)")
}

/// The image reference `hack/image.sh` gives binary `bin` of this version.
pub fn image(bin: &str) -> String {
    format!("ghcr.io/batchlease/{bin}:{}", env!("CARGO_PKG_VERSION"))
}

/// The toleration of [`TAINT`], as a pod spec's JSON.
pub fn toleration() -> serde_json::Value {
    serde_json::json!({"key": TAINT, "operator": "Exists", "effect": "NoSchedule"})
}

/// `ctr -n k8s.io ARGS` against the node's containerd.
pub fn ctr(args: &[&str]) -> anyhow::Result<String> {
    let bin =
        std::env::var("BATCHLEASE_CTR").context("BATCHLEASE_CTR unset (e2e/node/up.sh's env)")?;
    let addr = std::env::var("BATCHLEASE_CONTAINERD_ADDRESS")
        .context("BATCHLEASE_CONTAINERD_ADDRESS unset (e2e/node/up.sh's env)")?;
    let out = Command::new(&bin)
        .args(["--address", &addr, "-n", "k8s.io"])
        .args(args)
        .output()
        .with_context(|| format!("running {bin}"))?;
    anyhow::ensure!(
        out.status.success(),
        "ctr {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The ids of the containers containerd runs now (tasks in state RUNNING).
pub fn running_containers() -> anyhow::Result<Vec<String>> {
    Ok(ctr(&["tasks", "ls"])?
        .lines()
        .skip(1)
        .filter(|l| l.split_whitespace().nth(2) == Some("RUNNING"))
        .filter_map(|l| l.split_whitespace().next().map(String::from))
        .collect())
}

/// The API server's host and port, as a hostNetwork pod reaches it (the
/// `kubernetes` Service IP is not routable here).
pub fn api_server() -> anyhow::Result<(String, String)> {
    let kc = std::fs::read_to_string(std::env::var("KUBECONFIG")?)?;
    let server = kc
        .lines()
        .find_map(|l| {
            l.trim()
                .strip_prefix("server:")
                .map(|v| v.trim().to_owned())
        })
        .context("no server in KUBECONFIG")?;
    let (host, port) = server
        .trim_start_matches("https://")
        .rsplit_once(':')
        .context("server without a port")?;
    Ok((host.to_owned(), port.to_owned()))
}

/// Where a pod on the node's pod network reaches the API server (host,
/// port): this host's address, where the control plane listens when
/// started with `BATCHLEASE_CP_BIND=host` (hack/local-env.sh does with a
/// node). Not the `kubernetes` Service IP: there is no kube-proxy.
pub fn api_from_pods() -> anyhow::Result<(String, String)> {
    let v = std::env::var("BATCHLEASE_API_FROM_PODS").unwrap_or_default();
    let (host, port) = v.rsplit_once(':').with_context(|| {
        format!(
            "BATCHLEASE_API_FROM_PODS={v:?}: the API server does not listen where pods reach it \
             (start the control plane with BATCHLEASE_CP_BIND=host)"
        )
    })?;
    Ok((host.to_owned(), port.to_owned()))
}

/// The last `n` lines of the node's component logs (kubelet, containerd).
pub fn component_logs(n: usize) -> String {
    let Ok(dir) = std::env::var("BATCHLEASE_NODE_DIR") else {
        return String::new();
    };
    let mut out = String::new();
    for c in ["kubelet", "containerd"] {
        let path = std::path::Path::new(&dir).join(format!("logs/{c}.log"));
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        out.push_str(&format!("--- last lines of {} ---\n", path.display()));
        for l in &lines[lines.len().saturating_sub(n)..] {
            out.push_str(l);
            out.push('\n');
        }
    }
    out
}

/// What a failed wait on pods of `namespace` prints: the pods' YAML, the
/// namespace's events, every container's log (and the previous run's),
/// the election Leases, the node, and the kubelet's and containerd's logs.
pub fn diagnostics(namespace: &str) -> String {
    let mut out = String::new();
    let mut run = |args: &[&str]| {
        out.push_str(&format!("$ kubectl {}\n", args.join(" ")));
        match kubectl::run_capped(args, 200_000) {
            Ok(o) => out.push_str(&o),
            Err(e) => out.push_str(&format!("(failed: {e:#})\n")),
        }
    };
    run(&["get", "pods", "-n", namespace, "-o", "yaml"]);
    run(&["get", "events", "-n", namespace, "--sort-by=.lastTimestamp"]);
    run(&["get", "leases", "-n", namespace, "-o", "yaml"]);
    if let Some(node) = name() {
        run(&["describe", "node", &node]);
    }
    let pods = kubectl::run(&[
        "get",
        "pods",
        "-n",
        namespace,
        "-o",
        "jsonpath={.items[*].metadata.name}",
    ])
    .map(|o| o.stdout)
    .unwrap_or_default();
    for pod in pods.split_whitespace() {
        for previous in ["--previous=false", "--previous=true"] {
            let args = [
                "logs",
                pod,
                "-n",
                namespace,
                "--all-containers",
                "--tail=80",
                previous,
            ];
            out.push_str(&format!("$ kubectl {}\n", args.join(" ")));
            match kubectl::run(&args) {
                Ok(o) => out.push_str(&o.combined()),
                Err(e) => out.push_str(&format!("(failed: {e:#})\n")),
            }
        }
    }
    out.push_str(&component_logs(40));
    out
}
