//! The real `helm` built by `e2e/controlplane/build.sh` (`BATCHLEASE_HELM`),
//! run from the repository root so `charts/…` paths work.

use std::process::Command;

use anyhow::Context;

use crate::kubectl::Output;

/// The helm binary.
pub fn binary() -> anyhow::Result<String> {
    std::env::var("BATCHLEASE_HELM").context("BATCHLEASE_HELM unset: run hack/test.sh")
}

/// Runs helm with `args`.
pub fn run(args: &[&str]) -> anyhow::Result<Output> {
    let bin = binary()?;
    let out = Command::new(&bin)
        .args(args)
        .current_dir(crate::repo_root())
        .output()
        .with_context(|| format!("running {bin} {}", args.join(" ")))?;
    Ok(Output {
        success: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    })
}

/// Runs helm and fails with its output unless it succeeded.
pub fn ok(args: &[&str]) -> anyhow::Result<String> {
    let out = run(args)?;
    anyhow::ensure!(
        out.success,
        "helm {} failed:\n{}",
        args.join(" "),
        out.combined()
    );
    Ok(out.stdout)
}

/// What `helm template` is told of the cluster: the oldest Kubernetes the
/// charts support (their `kubeVersion`; helm assumes 1.20 without a
/// cluster, and refuses them) and the admission-policy API it serves.
pub const CLUSTER: [&str; 4] = [
    "--kube-version",
    "1.32.0",
    "--api-versions",
    "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy",
];

/// `helm template ARGS…` as on a [`CLUSTER`]: the rendered YAML.
pub fn template(args: &[&str]) -> anyhow::Result<String> {
    let mut all = vec!["template"];
    all.extend_from_slice(args);
    all.extend_from_slice(&CLUSTER);
    ok(&all)
}

/// The documents of `helm template` output of `kind`.
pub fn rendered(yaml: &str, kind: &str) -> anyhow::Result<Vec<serde_json::Value>> {
    let mut out = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(yaml) {
        let v: serde_json::Value = serde::Deserialize::deserialize(doc)?;
        if v.get("kind").and_then(|k| k.as_str()) == Some(kind) {
            out.push(v);
        }
    }
    Ok(out)
}

/// Environment variables, in order.
pub type Env = Vec<(String, String)>;

/// The first container of a rendered Deployment: its args (none when
/// absent), and its env with the downward-API fields resolved as the
/// kubelet would for pod `pod` in `namespace`. Fails on an env source it
/// does not know, so a chart change cannot slip past the tests that run it.
pub fn container_of(
    deploy: &serde_json::Value,
    namespace: &str,
    pod: &str,
) -> anyhow::Result<(Vec<String>, Env)> {
    let container = &deploy["spec"]["template"]["spec"]["containers"][0];
    anyhow::ensure!(
        container.get("command").is_none(),
        "the chart sets a command: the image's entrypoint would not run"
    );
    let args = container["args"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|a| {
            a.as_str()
                .map(String::from)
                .context("an arg is not a string")
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut env = Vec::new();
    for e in container["env"].as_array().into_iter().flatten() {
        let name = e["name"].as_str().context("env without a name")?.to_owned();
        let value = if let Some(v) = e["value"].as_str() {
            v.to_owned()
        } else {
            match e["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
                Some("metadata.name") => pod.to_owned(),
                Some("metadata.namespace") => namespace.to_owned(),
                // No Pod object stands behind these processes (or not the
                // one named): no UID, so no owner reference is written.
                Some("metadata.uid") => String::new(),
                _ => anyhow::bail!("env {name}: a source the tests do not resolve: {e}"),
            }
        };
        env.push((name, value));
    }
    Ok((args, env))
}

/// The operator container of the chart's Deployment as `helm template`
/// renders it for `release` in `namespace` with `sets` (`--set` values):
/// its args, and its env with the downward-API fields resolved as the
/// kubelet would for pod `pod`. Fails on an env source it does not know,
/// so a chart change cannot slip past the tests that run it.
pub fn rendered_operator(
    release: &str,
    namespace: &str,
    sets: &[&str],
    pod: &str,
) -> anyhow::Result<(Vec<String>, Env)> {
    let mut args = vec![release, "charts/batchlease-operator", "-n", namespace];
    for s in sets {
        args.extend(["--set", s]);
    }
    let yaml = template(&args)?;
    let deploy = rendered(&yaml, "Deployment")?
        .into_iter()
        .next()
        .context("no Deployment rendered")?;
    let (args, env) = container_of(&deploy, namespace, pod)?;
    anyhow::ensure!(!args.is_empty(), "the operator's Deployment has no args");
    Ok((args, env))
}
