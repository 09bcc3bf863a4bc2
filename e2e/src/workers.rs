//! Demo workers (`examples/demo-worker`) as real processes.

use anyhow::Context;

use crate::process::Process;

/// The demo worker binary, built by `hack/test.sh` (`BATCHLEASE_DEMO_WORKER_BIN`).
pub fn binary() -> anyhow::Result<String> {
    std::env::var("BATCHLEASE_DEMO_WORKER_BIN")
        .context("BATCHLEASE_DEMO_WORKER_BIN unset: run hack/test.sh (it builds the demo worker)")
}

/// The throwaway PostgreSQL of `e2e/postgres/up.sh`.
pub fn pg_url() -> anyhow::Result<String> {
    std::env::var("BATCHLEASE_PG_URL")
        .context("BATCHLEASE_PG_URL unset: run hack/test.sh (it starts PostgreSQL)")
}

/// Options of a demo worker process.
#[derive(Debug, Clone)]
pub struct WorkerOpts {
    pub queue: String,
    pub slots: usize,
    pub drain_grace_seconds: u64,
    /// A kubeconfig other than `KUBECONFIG` (e.g. through a test proxy).
    pub kubeconfig: Option<std::path::PathBuf>,
    /// Serve the SDK metrics on this loopback port.
    pub metrics_port: Option<u16>,
    /// A PostgreSQL URL other than `BATCHLEASE_PG_URL` (e.g. through a
    /// test proxy).
    pub pg_url: Option<String>,
    /// More flags for the demo worker.
    pub extra: Vec<String>,
    /// Run as if in Pod `pod_name`: `POD_NAME` set, no `--identity`, so
    /// the SDK's default identity (`<pod>/<suffix>`) is what is tested.
    pub pod_name: Option<String>,
}

impl Default for WorkerOpts {
    fn default() -> Self {
        Self {
            queue: "demo".into(),
            slots: 2,
            drain_grace_seconds: 10,
            kubeconfig: None,
            metrics_port: None,
            pg_url: None,
            extra: Vec::new(),
            pod_name: None,
        }
    }
}

/// Starts demo worker `identity` for `namespace`.
pub fn start(namespace: &str, identity: &str, opts: &WorkerOpts) -> anyhow::Result<Process> {
    let mut args = vec![
        format!("--namespace={namespace}"),
        format!("--queues={}", opts.queue),
        format!("--slots={}", opts.slots),
        format!("--drain-grace-seconds={}", opts.drain_grace_seconds),
    ];
    if opts.pod_name.is_none() {
        args.push(format!("--identity={identity}"));
    }
    args.extend(opts.extra.iter().cloned());
    if let Some(port) = opts.metrics_port {
        args.push(format!("--metrics-addr=127.0.0.1:{port}"));
    }
    if let Some(kc) = &opts.kubeconfig {
        args.push(format!("--kubeconfig={}", kc.display()));
    }
    let mut env = vec![
        (
            "RUST_LOG".into(),
            "info,kube=warn,batchlease_worker_sdk=debug".into(),
        ),
        // Never on the command line, where every user of the host sees it.
        (
            "BATCHLEASE_PG_URL".into(),
            opts.pg_url.clone().map_or_else(pg_url, Ok)?,
        ),
    ];
    if let Some(pod) = &opts.pod_name {
        env.push(("POD_NAME".into(), pod.clone()));
    }
    Process::start(
        binary()?,
        namespace,
        &format!("worker-{identity}"),
        args,
        env,
    )
}

/// The value of a sample line of a demo worker's `/metrics`.
pub async fn metric(port: u16, sample: &str) -> anyhow::Result<Option<f64>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .await?;
    let mut body = String::new();
    s.read_to_string(&mut body).await?;
    Ok(body
        .lines()
        .find_map(|l| l.strip_prefix(sample).and_then(|v| v.trim().parse().ok())))
}

/// Demo workers `w1`..`wN` of `namespace`, `slots` each, on the default
/// queue.
pub fn start_n(namespace: &str, n: usize, slots: usize) -> anyhow::Result<Vec<Process>> {
    let opts = WorkerOpts {
        slots,
        ..Default::default()
    };
    (1..=n)
        .map(|i| start(namespace, &format!("w{i}"), &opts))
        .collect()
}
