//! Running the real `batchlease-operator` binary against the test control
//! plane, one process per replica, scoped to the test's namespace.

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::ports::free_port;
use crate::process::Process;
use crate::secrets::PrivateDir;
use crate::wait::wait_for;

/// One operator replica.
#[derive(Debug)]
pub struct Operator {
    process: Process,
    pub name: String,
    pub metrics_port: u16,
    /// The replica's own client identity (key, certificate, kubeconfig),
    /// unless the caller passed `--kubeconfig`; kept for restarts. Declared
    /// after `process`: fields drop in order, so the replica is killed
    /// before its credentials are removed.
    _identity: Option<PrivateDir>,
}

/// The operator binary, built by `hack/test.sh` (`BATCHLEASE_OPERATOR_BIN`).
pub fn binary() -> anyhow::Result<String> {
    std::env::var("BATCHLEASE_OPERATOR_BIN")
        .context("BATCHLEASE_OPERATOR_BIN unset: run hack/test.sh (it builds the operator)")
}

impl Operator {
    /// Starts replica `name` watching `namespace`, electing a leader on a
    /// Lease in that namespace (short TTLs so hand-over is quick in tests).
    pub fn start(namespace: &str, name: &str) -> anyhow::Result<Self> {
        Self::start_with(namespace, name, Vec::new())
    }

    /// A fresh test namespace (CRDs installed) with operator `name`
    /// started in it and leading within `lead_within`: how most tests begin.
    pub async fn in_new_namespace(
        prefix: &str,
        name: &str,
        lead_within: Duration,
    ) -> anyhow::Result<(crate::TestNamespace, Self)> {
        let cluster = crate::Cluster::with_crds().await?;
        let ns = cluster.namespace(prefix).await?;
        let op = Self::start(&ns.name, name)?;
        op.wait_leading(lead_within).await?;
        Ok((ns, op))
    }

    /// Like [`Operator::start`], with extra flags (e.g. `--kubeconfig`);
    /// an extra flag replaces the default of the same name.
    pub fn start_with(namespace: &str, name: &str, extra: Vec<String>) -> anyhow::Result<Self> {
        let port = free_port()?;
        let mut args = vec![
            format!("--namespaces={namespace}"),
            format!("--metrics-addr=127.0.0.1:{port}"),
            "--leader-election=true".into(),
            "--leader-lease-name=batchlease-operator".into(),
            format!("--leader-lease-namespace={namespace}"),
            "--leader-lease-seconds=6".into(),
            "--leader-grace-seconds=2".into(),
            format!("--identity={name}"),
            // Tests follow tasks by their Events; the default publishes
            // only the important ones (the bench measures that).
            "--events=all".into(),
        ];
        // An extra flag replaces the default of the same name (clap would
        // append to a list flag such as --namespaces instead).
        let flag = |a: &str| a.split('=').next().unwrap_or_default().to_owned();
        args.retain(|a| !extra.iter().any(|e| flag(e) == flag(a)));
        // Its own client identity (user `operator-<name>`), so the audit log
        // tells this replica's writes from everyone else's.
        let identity = if extra.iter().any(|e| flag(e) == "--kubeconfig") {
            None
        } else {
            let dir = PrivateDir::new(&format!("{namespace}-{name}"))?;
            let kc = crate::identity::kubeconfig_as(&Self::user(name), &dir)?;
            args.push(format!("--kubeconfig={}", kc.display()));
            Some(dir)
        };
        args.extend(extra);
        let env = vec![(
            "RUST_LOG".into(),
            "info,kube=warn,batchlease_operator=debug".into(),
        )];
        let process = Process::start(binary()?, namespace, &format!("operator-{name}"), args, env)?;
        Ok(Self {
            process,
            name: name.into(),
            metrics_port: port,
            _identity: identity,
        })
    }

    /// The user replica `name` authenticates as (see the audit log).
    pub fn user(name: &str) -> String {
        format!("operator-{name}")
    }

    /// The process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.process.pid()
    }

    /// Sends a signal by name (`TERM`, `STOP`, `CONT`).
    pub fn signal(&self, sig: &str) -> anyhow::Result<()> {
        self.process.signal(sig)
    }

    /// SIGKILL: the process dies between whatever two writes it was doing.
    pub fn kill(&mut self) {
        self.process.kill();
    }

    /// The exit status, once the process has ended on its own.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.process.exited()
    }

    /// Starts the same replica again (same identity, port and log).
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.process.restart()
    }

    /// GET a path of the operator's HTTP server: (status code, body).
    pub async fn get(&self, path: &str) -> anyhow::Result<(u16, String)> {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", self.metrics_port)).await?;
        s.write_all(format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").as_bytes())
            .await?;
        let mut buf = String::new();
        s.read_to_string(&mut buf).await?;
        let code = buf
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let body = buf
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default();
        Ok((code, body))
    }

    /// The value of a sample line of `/metrics`, e.g.
    /// `batchlease_leases_issued_total{namespace="ns",queue="q"}`.
    pub async fn metric(&self, sample: &str) -> anyhow::Result<Option<f64>> {
        let (_, body) = self.get("/metrics").await?;
        Ok(body.lines().find_map(|l| {
            l.strip_prefix(sample)
                .and_then(|rest| rest.trim().parse().ok())
        }))
    }

    /// Waits until this replica leads and its caches synced.
    pub async fn wait_leading(&self, timeout: Duration) -> anyhow::Result<()> {
        wait_for(
            &format!("operator {} to lead", self.name),
            timeout,
            || self.logs(),
            || async {
                let leading = self.metric("batchlease_is_leader").await.ok().flatten() == Some(1.0);
                let ready = self
                    .get("/readyz")
                    .await
                    .map(|(c, _)| c == 200)
                    .unwrap_or(false);
                Ok((leading && ready).then_some(()))
            },
        )
        .await
    }

    /// Whether this replica leads and is ready, now.
    pub async fn leads(&self) -> bool {
        let leading = self.metric("batchlease_is_leader").await.ok().flatten() == Some(1.0);
        leading
            && self
                .get("/readyz")
                .await
                .map(|(c, _)| c == 200)
                .unwrap_or(false)
    }

    /// Waits until one of `ops` leads (replicas started together: which
    /// one takes the election Lease is up to the race for it); its index.
    pub async fn wait_one_leading(ops: &[&Operator], timeout: Duration) -> anyhow::Result<usize> {
        wait_for(
            "one replica to lead",
            timeout,
            || ops.iter().map(|o| o.logs()).collect(),
            || async {
                for (i, op) in ops.iter().enumerate() {
                    if op.leads().await {
                        return Ok(Some(i));
                    }
                }
                Ok(None)
            },
        )
        .await
    }

    /// Where the replica logs.
    pub fn log_path(&self) -> &Path {
        &self.process.log
    }

    /// The replica's log, for diagnostics.
    pub fn logs(&self) -> String {
        self.process.logs()
    }

    /// This replica's log followed by `workers`' logs: the diagnostics of
    /// a wait on a task.
    pub fn logs_with(&self, workers: &[&crate::process::Process]) -> String {
        let mut out = self.logs();
        for w in workers {
            out.push_str(&w.logs());
        }
        out
    }
}
