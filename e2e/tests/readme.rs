//! The README's install-and-run block, as a user runs it: read from
//! README.md (the `sh` block after the marker naming this file — never a
//! copy), run by bash from the repository root with only `kubectl`, `helm`
//! and `PG_URL`, on the real node of `e2e/node/up.sh`. It must end with
//! `hello` Succeeded and `kubectl get taskleases` naming the worker pod
//! that ran it.
//!
//! The node's pod network has no kube-proxy (the `kubernetes` Service IP
//! leads nowhere) and the harness PostgreSQL listens on loopback only, so
//! the worker must share the host's network, and every pod must be told
//! where the API server is — what the charts' `hostNetwork` and `extraEnv`
//! do on such a cluster. So that the block runs as written, for the
//! namespaces it uses only, a MutatingAdmissionPolicy sets that: it gives
//! their pods
//! `hostNetwork` (with each container port as a host port, as the API
//! server's defaulting would), the API server's loopback address as
//! `KUBERNETES_SERVICE_HOST`/`_PORT`, and the node's taint toleration.
//! Nothing else of the charts' objects is touched.
//!
//! The block installs cluster-wide objects (an all-namespaces operator,
//! its ClusterRoles and admission policy) into `batchlease` and `default`:
//! this file is its own test binary, and cargo runs test binaries one at a
//! time. Everything it created is removed at the end, also on failure.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::time::Instant;

use batchlease_api::{BatchTask, TaskPhase};
use batchlease_e2e::{Cluster, kubectl, node};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::ListParams;

const MARKER: &str = "<!-- e2e/tests/readme.rs runs the next block as written";
const POLICY: &str = "e2e-readme-node-network";

/// The README's install-and-run block: the first `sh` block after
/// [`MARKER`].
fn install_and_run_block() -> String {
    let readme = std::fs::read_to_string(batchlease_e2e::repo_root().join("README.md")).unwrap();
    let after = &readme[readme
        .find(MARKER)
        .expect("README.md has lost the marker of its install-and-run block")..];
    let start = after.find("```sh\n").expect("no sh block after the marker") + "```sh\n".len();
    let len = after[start..].find("```").expect("unterminated block");
    after[start..start + len].to_owned()
}

/// The node's network for the README's namespaces (see the module docs).
fn node_network_policy(host: &str, port: &str) -> String {
    format!(
        r#"apiVersion: admissionregistration.k8s.io/v1
kind: MutatingAdmissionPolicy
metadata:
  name: {POLICY}
spec:
  matchConstraints:
    namespaceSelector:
      matchExpressions:
      - {{key: kubernetes.io/metadata.name, operator: In, values: [batchlease, default]}}
    resourceRules:
    - apiGroups: [""]
      apiVersions: [v1]
      operations: [CREATE]
      resources: [pods]
  failurePolicy: Fail
  reinvocationPolicy: Never
  mutations:
  - patchType: ApplyConfiguration
    applyConfiguration:
      expression: >
        Object{{
          spec: Object.spec{{
            hostNetwork: true,
            containers: object.spec.containers.map(c, Object.spec.containers{{
              name: c.name,
              env: [
                Object.spec.containers.env{{name: "KUBERNETES_SERVICE_HOST", value: "{host}"}},
                Object.spec.containers.env{{name: "KUBERNETES_SERVICE_PORT", value: "{port}"}}
              ],
              ports: has(c.ports) ? c.ports.map(p, Object.spec.containers.ports{{
                containerPort: p.containerPort,
                hostPort: p.containerPort,
                protocol: has(p.protocol) ? p.protocol : "TCP"
              }}) : []
            }})
          }}
        }}
  # Tolerations are an atomic list: appended by JSON patch.
  - patchType: JSONPatch
    jsonPatch:
      expression: >
        has(object.spec.tolerations) ?
          [JSONPatch{{op: "add", path: "/spec/tolerations/-", value: {toleration}}}] :
          [JSONPatch{{op: "add", path: "/spec/tolerations", value: [{toleration}]}}]
---
apiVersion: admissionregistration.k8s.io/v1
kind: MutatingAdmissionPolicyBinding
metadata:
  name: {POLICY}
spec:
  policyName: {POLICY}
"#,
        toleration = format!(
            r#"Object.spec.tolerations{{key: "{}", operator: "Exists", effect: "NoSchedule"}}"#,
            node::TAINT
        )
    )
}

fn run(cmd: &str, args: &[&str]) -> (bool, String) {
    match Command::new(cmd)
        .args(args)
        .current_dir(batchlease_e2e::repo_root())
        .output()
    {
        Ok(o) => (
            o.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            ),
        ),
        Err(e) => (false, format!("{cmd}: {e}")),
    }
}

fn helm() -> String {
    std::env::var("BATCHLEASE_HELM").unwrap_or_else(|_| "helm".into())
}

/// Removes what the block creates (and the policy), whatever state it is
/// in: at the start (a run before may have died) and at the end, also when
/// the test panicked.
fn remove_everything() {
    let k = kubectl::binary();
    let h = helm();
    for args in [
        vec![
            "uninstall",
            "demo",
            "-n",
            "default",
            "--ignore-not-found",
            "--wait",
        ],
        vec![
            "uninstall",
            "batchlease",
            "-n",
            "batchlease",
            "--ignore-not-found",
            "--wait",
        ],
    ] {
        run(&h, &args);
    }
    for args in [
        vec![
            "delete",
            "batchtask",
            "hello",
            "-n",
            "default",
            "--ignore-not-found",
            "--wait=true",
        ],
        vec![
            "delete",
            "taskleases",
            "-n",
            "default",
            "--all",
            "--ignore-not-found",
        ],
        vec![
            "delete",
            "secret",
            "batchlease-pg",
            "-n",
            "default",
            "--ignore-not-found",
        ],
        vec![
            "delete",
            "namespace",
            "batchlease",
            "--ignore-not-found",
            "--wait=true",
        ],
        vec![
            "delete",
            "mutatingadmissionpolicybinding,mutatingadmissionpolicy",
            POLICY,
            "--ignore-not-found",
        ],
    ] {
        run(&k, &args);
    }
}

struct Cleanup;

impl Drop for Cleanup {
    fn drop(&mut self) {
        remove_everything();
    }
}

fn diagnostics() -> String {
    let k = kubectl::binary();
    let mut out = node::diagnostics("batchlease");
    out.push_str(&node::diagnostics("default"));
    for (ns, sel) in [
        ("batchlease", "app.kubernetes.io/name=batchlease-operator"),
        ("default", "app.kubernetes.io/instance=demo"),
    ] {
        out.push_str(&format!("--- kubectl logs -n {ns} -l {sel} ---\n"));
        out.push_str(&run(&k, &["logs", "-n", ns, "-l", sel, "--tail=60", "--prefix"]).1);
    }
    out.push_str(&run(&k, &["get", "bt,tl", "-n", "default", "-o", "yaml"]).1);
    out
}

#[tokio::test]
async fn the_readme_install_and_run_block_runs_as_written() {
    if node::or_skip("the_readme_install_and_run_block_runs_as_written").is_none() {
        return;
    }
    let block = install_and_run_block();
    // What the README promises a user needs: helm and kubectl, no Rust.
    for line in block.lines().filter(|l| !l.trim().is_empty()) {
        let cmd = line.split_whitespace().next().unwrap_or_default();
        assert!(
            ["helm", "kubectl"].contains(&cmd),
            "the install-and-run block needs only helm and kubectl: {line}"
        );
    }
    // The CRDs are the harness's already (helm skips existing ones).
    let cluster = Cluster::with_crds().await.unwrap();
    remove_everything();
    let _cleanup = Cleanup;
    let (host, port) = node::api_server().unwrap();
    let policy = node_network_policy(&host, &port);
    let dir = batchlease_e2e::secrets::PrivateDir::new("readme").unwrap();
    let path = dir.write("node-network.yaml", &policy).unwrap();
    kubectl::ok(&["apply", "-f", &path.to_string_lossy()]).unwrap();
    // In force once a pod created in both namespaces (server-side dry run:
    // admission runs, nothing is stored) comes back mutated: the API server
    // loads policies asynchronously.
    let probe = dir
        .write(
            "probe.yaml",
            "apiVersion: v1\nkind: Pod\nmetadata: {name: readme-probe}\n\
             spec: {containers: [{name: c, image: none, ports: [{containerPort: 1}]}]}\n",
        )
        .unwrap();
    batchlease_e2e::wait_for(
        "the node-network policy to be in force",
        std::time::Duration::from_secs(60),
        diagnostics,
        || {
            let probe = probe.clone();
            async move {
                let mut all = true;
                for ns in ["batchlease", "default"] {
                    let out = kubectl::run(&[
                        "create",
                        "--dry-run=server",
                        "-o",
                        "jsonpath={.spec.hostNetwork}",
                        "-n",
                        ns,
                        "-f",
                        &probe.to_string_lossy(),
                    ])?;
                    // `batchlease` does not exist yet: the policy is
                    // checked in `default` only until it does.
                    all &= out.stdout.trim() == "true"
                        || (ns == "batchlease" && out.stderr.contains("NotFound"));
                }
                Ok(all.then_some(()))
            }
        },
    )
    .await
    .unwrap();

    // As a user runs it: bash, from the repository root, kubectl and helm
    // first on PATH (the control plane's env puts them there), PG_URL set.
    let bin = std::path::Path::new(&kubectl::binary())
        .parent()
        .unwrap()
        .to_owned();
    let path_env = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let pg_url = std::env::var("BATCHLEASE_PG_URL").unwrap();
    let started = Instant::now();
    let out = tokio::task::spawn_blocking(move || {
        Command::new("bash")
            .args(["-euo", "pipefail", "-x", "-c", &block])
            .current_dir(batchlease_e2e::repo_root())
            .env("PATH", path_env)
            .env("PG_URL", pg_url)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "the README's block failed after {:?}\n--- stdout ---\n{stdout}\n--- stderr (bash -x) ---\n{stderr}\n{}",
        started.elapsed(),
        diagnostics()
    );
    eprintln!("README block ran in {:?}:\n{stdout}", started.elapsed());

    let hello = Api::<BatchTask>::namespaced(cluster.client.clone(), "default")
        .get("hello")
        .await
        .unwrap();
    let st = hello.status.unwrap();
    assert_eq!(st.phase, Some(TaskPhase::Succeeded));
    // The last command's table names the worker pod that held the lease:
    // holders are `<pod>/<suffix>`.
    let pods: Vec<String> = Api::<Pod>::namespaced(cluster.client.clone(), "default")
        .list(&ListParams::default().labels("app.kubernetes.io/instance=demo"))
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|p| p.metadata.name)
        .collect();
    let holder = st
        .history
        .last()
        .and_then(|h| h.holder.clone())
        .unwrap_or_default();
    assert!(
        pods.iter().any(|p| holder.starts_with(&format!("{p}/"))),
        "hello was held by {holder:?}, not by a worker pod {pods:?}"
    );
    assert!(
        stdout.contains("hello-1") && stdout.contains(&holder),
        "kubectl get taskleases names the lease and its holder {holder}:\n{stdout}"
    );
    // The operator ran as a pod too: its first replica is Running.
    let ops = Api::<Pod>::namespaced(cluster.client.clone(), "batchlease")
        .list(&ListParams::default().labels("app.kubernetes.io/name=batchlease-operator"))
        .await
        .unwrap();
    assert!(
        ops.items
            .iter()
            .any(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")),
        "no operator pod running:\n{}",
        diagnostics()
    );
}
