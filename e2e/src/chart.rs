//! A Helm release of the chart, and operator processes started exactly as
//! its rendered Deployment says: the image's entrypoint (the operator
//! binary), the rendered args and env — nothing else in the environment —
//! on the chart's ServiceAccount token (through `KUBECONFIG`; the pod's
//! in-cluster mount is what `e2e/tests/image.rs` runs).

use anyhow::Context;

use crate::helm;
use crate::process::Process;
use crate::secrets::PrivateDir;

/// A release, uninstalled when dropped (also when a test fails: a
/// cluster-wide admission policy left behind would refuse other tests'
/// workers).
#[derive(Debug)]
pub struct Release {
    pub name: String,
    pub namespace: String,
    /// The `--set` values it was installed or last upgraded with.
    pub sets: Vec<String>,
    /// `--set-string` values (kept as strings: an env value that looks
    /// like a number).
    pub set_strings: Vec<String>,
    uninstalled: bool,
}

impl Release {
    /// `helm install NAME charts/batchlease-operator -n NAMESPACE --set …`.
    pub fn install(name: &str, namespace: &str, sets: &[String]) -> anyhow::Result<Self> {
        Self::install_with(name, namespace, sets, &[])
    }

    /// Like [`Release::install`], with `--set-string` values too.
    pub fn install_with(
        name: &str,
        namespace: &str,
        sets: &[String],
        set_strings: &[String],
    ) -> anyhow::Result<Self> {
        let r = Self {
            name: name.into(),
            namespace: namespace.into(),
            sets: sets.to_vec(),
            set_strings: set_strings.to_vec(),
            uninstalled: false,
        };
        r.helm("install")?;
        Ok(r)
    }

    /// `helm upgrade` with `sets` instead of the previous values.
    pub fn upgrade(&mut self, sets: &[String]) -> anyhow::Result<String> {
        self.sets = sets.to_vec();
        self.helm("upgrade")
    }

    fn helm(&self, verb: &str) -> anyhow::Result<String> {
        let mut args = vec![
            verb,
            &self.name,
            "charts/batchlease-operator",
            "-n",
            &self.namespace,
            "--wait=false",
        ];
        for s in &self.sets {
            args.extend(["--set", s]);
        }
        for s in &self.set_strings {
            args.extend(["--set-string", s]);
        }
        helm::ok(&args)
    }

    /// `helm uninstall`.
    pub fn uninstall(&mut self) -> anyhow::Result<String> {
        self.uninstalled = true;
        helm::ok(&["uninstall", &self.name, "-n", &self.namespace])
    }

    /// The chart's ServiceAccount (and object names).
    pub fn full_name(&self) -> String {
        format!("{}-batchlease-operator", self.name)
    }

    /// An operator replica as the kubelet would start pod `pod` of the
    /// rendered Deployment. `metrics_port` replaces `metrics.port` in this
    /// replica's rendering only: pods have addresses of their own, these
    /// processes share the host's.
    pub fn start_replica(
        &self,
        pod: &str,
        metrics_port: Option<u16>,
        secrets: &PrivateDir,
    ) -> anyhow::Result<Replica> {
        let mut sets: Vec<&str> = self.sets.iter().map(String::as_str).collect();
        let port_set = metrics_port.map(|p| format!("metrics.port={p}"));
        if let Some(p) = &port_set {
            sets.push(p);
        }
        let (args, mut env) = helm::rendered_operator(&self.name, &self.namespace, &sets, pod)?;
        let kc = crate::kubectl::service_account_kubeconfig(
            &self.namespace,
            &self.full_name(),
            secrets,
        )?;
        env.push(("KUBECONFIG".into(), kc.display().to_string()));
        let port = args
            .iter()
            .find_map(|a| a.strip_prefix("--metrics-addr=0.0.0.0:"))
            .and_then(|p| p.parse().ok())
            .context("no --metrics-addr=0.0.0.0:PORT in the rendered args")?;
        let process = Process::start_clean(
            crate::operator::binary()?,
            &self.namespace,
            pod,
            args.clone(),
            env.clone(),
        )?;
        Ok(Replica {
            process,
            args,
            env,
            metrics_port: port,
        })
    }
}

impl Drop for Release {
    fn drop(&mut self) {
        if !self.uninstalled {
            let _ = helm::run(&["uninstall", &self.name, "-n", &self.namespace]);
        }
    }
}

/// An operator process started from the rendered Deployment.
#[derive(Debug)]
pub struct Replica {
    pub process: Process,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub metrics_port: u16,
}

impl Replica {
    /// The status code of `GET path` on its metrics port.
    pub async fn get(&self, path: &str) -> anyhow::Result<u16> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", self.metrics_port)).await?;
        s.write_all(format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").as_bytes())
            .await?;
        let mut buf = String::new();
        s.read_to_string(&mut buf).await?;
        Ok(buf
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0))
    }
}

/// A Pod object (no kubelet runs it: it exists so that tokens can be bound
/// to it, as a real pod's projected token is).
pub fn pod_object(name: &str, service_account: &str) -> k8s_openapi::api::core::v1::Pod {
    let mut pod = k8s_openapi::api::core::v1::Pod::default();
    pod.metadata.name = Some(name.into());
    pod.spec = Some(k8s_openapi::api::core::v1::PodSpec {
        service_account_name: Some(service_account.into()),
        containers: vec![k8s_openapi::api::core::v1::Container {
            name: "main".into(),
            image: Some("batchlease".into()),
            ..Default::default()
        }],
        ..Default::default()
    });
    pod
}

/// A worker as in pod `pod` of `ns`: ServiceAccount `worker` (created if
/// missing) bound to the chart's worker role `worker_role`, the Pod
/// object, and a kubeconfig whose token is bound to it (the API server
/// names the pod in each request: what the holder-only policy checks).
pub async fn worker_pod(
    ns: &crate::TestNamespace,
    worker_role: &str,
    pod: &str,
    dir: &PrivateDir,
) -> anyhow::Result<std::path::PathBuf> {
    let n = ns.name.as_str();
    if !crate::kubectl::run(&["get", "serviceaccount", "worker", "-n", n])?.success {
        crate::kubectl::ok(&["create", "serviceaccount", "worker", "-n", n])?;
        crate::kubectl::ok(&[
            "create",
            "rolebinding",
            "worker",
            "-n",
            n,
            &format!("--clusterrole={worker_role}"),
            &format!("--serviceaccount={n}:worker"),
        ])?;
    }
    ns.api::<k8s_openapi::api::core::v1::Pod>()
        .create(&Default::default(), &pod_object(pod, "worker"))
        .await
        .with_context(|| format!("creating pod {pod}"))?;
    crate::kubectl::pod_token_kubeconfig(n, "worker", pod, dir)
}
