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
    /// More environment variables (e.g. [`faketime_env`]).
    pub env: Vec<(String, String)>,
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
            env: Vec::new(),
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
    env.extend(opts.env.iter().cloned());
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
    metric_at("127.0.0.1", port, sample).await
}

/// [`metric`] of a server at `host` (e.g. a pod's IP).
pub async fn metric_at(host: &str, port: u16, sample: &str) -> anyhow::Result<Option<f64>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // Bounded: a pod's address that leads nowhere would hold a wait's
    // check for minutes of SYN retries.
    let mut s = tokio::time::timeout(
        std::time::Duration::from_secs(2),
        tokio::net::TcpStream::connect((host, port)),
    )
    .await??;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .await?;
    let mut body = String::new();
    s.read_to_string(&mut body).await?;
    Ok(body
        .lines()
        .find_map(|l| l.strip_prefix(sample).and_then(|v| v.trim().parse().ok())))
}

/// Demo workers `w1`..`wN` of `namespace`, `slots` each, on the default
/// queue, renewing per lease (the SDK's default).
pub fn start_n(namespace: &str, n: usize, slots: usize) -> anyhow::Result<Vec<Process>> {
    let opts = WorkerOpts {
        slots,
        ..Default::default()
    };
    (1..=n)
        .map(|i| start(namespace, &format!("w{i}"), &opts))
        .collect()
}

/// The environment that pins renewals per lease (the SDK's default) with
/// `BATCHLEASE_RENEW_PER_WORKER=0`, for a test of what that mode promises
/// (its timings, its log lines) whatever the default becomes.
pub fn per_lease_env() -> Vec<(String, String)> {
    vec![("BATCHLEASE_RENEW_PER_WORKER".into(), "0".into())]
}

/// [`start_n`] with renewals per lease pinned ([`per_lease_env`]).
pub fn start_n_per_lease(namespace: &str, n: usize, slots: usize) -> anyhow::Result<Vec<Process>> {
    let opts = WorkerOpts {
        slots,
        env: per_lease_env(),
        ..Default::default()
    };
    (1..=n)
        .map(|i| start(namespace, &format!("w{i}"), &opts))
        .collect()
}

/// The environment that runs a process with its wall clock `offset` off
/// (libfaketime's syntax: `-10m`, `-10s`, `+10m`), as a host whose clock is
/// wrong: `CLOCK_REALTIME` only — monotonic clocks (the kill switch's) are
/// left alone, as NTP leaves them. Needs Debian's `faketime` package
/// (`hack/deps.sh` installs it).
pub fn faketime_env(offset: &str) -> anyhow::Result<Vec<(String, String)>> {
    let lib = std::fs::read_dir("/usr/lib")?
        .filter_map(Result::ok)
        .map(|d| d.path().join("faketime/libfaketime.so.1"))
        .find(|p| p.exists())
        .context("libfaketime.so.1 not found under /usr/lib/*/faketime: install Debian's faketime package")?;
    Ok(vec![
        ("LD_PRELOAD".into(), lib.display().to_string()),
        ("FAKETIME".into(), offset.into()),
        ("FAKETIME_DONT_FAKE_MONOTONIC".into(), "1".into()),
        // Read the offset once, not from a cache refreshed every few
        // seconds (it never changes here).
        ("FAKETIME_NO_CACHE".into(), "0".into()),
    ])
}

/// A WorkerLease of a worker `identity` serving `queues`, renewed once now
/// (for `duration` seconds) and never again by any process: a worker that
/// announced itself — taking addressed offers when `slots` is given, and
/// bound attempts too with `takes_bound` — and died, or one a test renews
/// by hand.
pub async fn ghost_worker_lease(
    ns: &crate::TestNamespace,
    identity: &str,
    queues: &[&str],
    duration: i32,
    slots: Option<i32>,
    takes_bound: bool,
) -> anyhow::Result<batchlease_api::WorkerLease> {
    use batchlease_api::{WorkerLease, WorkerLeaseSpec};
    let mut wl = WorkerLease::new(
        &batchlease_api::worker_lease::worker_lease_name(identity),
        WorkerLeaseSpec {
            holder_identity: identity.into(),
            queues: queues.iter().map(|q| (*q).to_owned()).collect(),
            lease_duration_seconds: duration,
            renew_time: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(
                k8s_openapi::jiff::Timestamp::now(),
            )),
            holds: vec![],
            slots,
            takes_bound: takes_bound.then_some(true),
        },
    );
    wl.metadata.namespace = Some(ns.name.clone());
    ns.api::<WorkerLease>()
        .create(&kube::api::PostParams::default(), &wl)
        .await
        .context("creating a ghost WorkerLease")
}
