//! The worker conformance suite's adapters: every kind of worker runs the
//! same scenarios (`e2e/tests/conformance.rs`) through one [`Kind`] each.
//! Adding a kind means adding one adapter: how to start a worker of it,
//! the queue it serves, where its fenced effects land, and what it logs
//! when it stops an attempt's handler.
//!
//! Every kind implements the same behaviour, read from the task's payload:
//! `{"steps": n, "stepMillis": ms, "failAfterSteps": k,
//! "permanentFailure": b}` — n steps from the previous checkpoint's
//! `{"step": i}`, a checkpoint after each; started from scratch with k > 0,
//! a retryable failure after step k; with b, a permanent failure after the
//! steps; else one effect written to PostgreSQL under the attempt's fence
//! and a result carrying `"resumedFrom": i`. The Rust SDK's is the demo
//! worker's handler; `batchlease-run`'s is `e2e/conformance/behaviour.sh`.

use std::path::PathBuf;

use anyhow::Context;
use tokio_postgres::Client;

use crate::process::Process;
use crate::runner::{self, RunnerOpts};
use crate::workers::{self, WorkerOpts};

/// How to start a worker of a kind, beyond the defaults.
#[derive(Debug, Clone, Default)]
pub struct StartOpts {
    /// Reach the API server through this kubeconfig (e.g. a test proxy's)
    /// instead of `KUBECONFIG`.
    pub kubeconfig: Option<PathBuf>,
    /// Concurrent attempts (default 1).
    pub slots: usize,
    /// A queue other than the kind's own.
    pub queue: Option<String>,
    /// Renew per worker (`BATCHLEASE_RENEW_PER_WORKER`; the Rust SDK's
    /// demo worker only).
    pub renew_per_worker: bool,
}

/// Every kind, in the order reports list them.
pub const KINDS: [Kind; 3] = [Kind::RustSdk, Kind::Runner, Kind::Python];

/// A kind of worker under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The Rust SDK: the demo worker (`examples/demo-worker`).
    RustSdk,
    /// `batchlease-run` running `e2e/conformance/behaviour.sh`.
    Runner,
    /// The Python package: `e2e/conformance/behaviour.py` run by the
    /// interpreter `BATCHLEASE_PYTHON_BIN` (the venv `python/test.sh
    /// --build-only` prints, with the package installed).
    Python,
}

impl Kind {
    /// Its name in reports.
    pub fn label(self) -> &'static str {
        match self {
            Kind::RustSdk => "rust-sdk",
            Kind::Runner => "batchlease-run",
            Kind::Python => "python",
        }
    }

    /// The queue its workers serve.
    pub fn queue(self) -> &'static str {
        match self {
            Kind::RustSdk => "demo",
            Kind::Runner => "sh",
            Kind::Python => "py",
        }
    }

    /// Starts worker `identity` for `namespace` (one slot; a drain that
    /// gives attempts back within a few seconds).
    pub fn start(self, namespace: &str, identity: &str) -> anyhow::Result<Process> {
        self.start_opts(namespace, identity, &StartOpts::default())
    }

    /// [`Kind::start`] with `opts`.
    pub fn start_opts(
        self,
        namespace: &str,
        identity: &str,
        opts: &StartOpts,
    ) -> anyhow::Result<Process> {
        let queue = opts.queue.as_deref().unwrap_or(self.queue()).to_owned();
        let slots = opts.slots.max(1);
        match self {
            Kind::RustSdk => workers::start(
                namespace,
                identity,
                &WorkerOpts {
                    queue,
                    slots,
                    drain_grace_seconds: 2,
                    kubeconfig: opts.kubeconfig.clone(),
                    env: if opts.renew_per_worker {
                        vec![("BATCHLEASE_RENEW_PER_WORKER".into(), "1".into())]
                    } else {
                        Vec::new()
                    },
                    ..Default::default()
                },
            ),
            Kind::Runner => {
                let script = crate::crate_dir().join("conformance/behaviour.sh");
                let runner_opts = RunnerOpts {
                    queue,
                    slots,
                    kill_grace: 1.0,
                    env: vec![("CONFORMANCE_DB".into(), workers::pg_url()?)],
                    extra: opts
                        .kubeconfig
                        .as_ref()
                        .map(|k| vec![format!("--kubeconfig={}", k.display())])
                        .unwrap_or_default(),
                    ..Default::default()
                };
                runner::start(
                    namespace,
                    identity,
                    &runner_opts,
                    &format!("exec {}", script.display()),
                )
            }
            Kind::Python => {
                let python = std::env::var("BATCHLEASE_PYTHON_BIN").context(
                    "BATCHLEASE_PYTHON_BIN unset: run hack/test.sh (it builds the Python package: python/test.sh --build-only)",
                )?;
                let script = crate::crate_dir().join("conformance/behaviour.py");
                let mut env = vec![
                    (
                        "RUST_LOG".to_owned(),
                        "info,kube=warn,batchlease_worker_sdk=debug".to_owned(),
                    ),
                    ("BATCHLEASE_PG_URL".into(), workers::pg_url()?),
                    ("CONFORMANCE_DB".into(), workers::pg_url()?),
                ];
                if let Some(k) = &opts.kubeconfig {
                    env.push(("KUBECONFIG".into(), k.display().to_string()));
                }
                Process::start(
                    python,
                    namespace,
                    &format!("python-{identity}"),
                    vec![
                        script.display().to_string(),
                        format!("--namespace={namespace}"),
                        format!("--queue={queue}"),
                        format!("--identity={identity}"),
                        format!("--slots={slots}"),
                    ],
                    env,
                )
            }
        }
    }

    /// The tokens whose effect stuck for task `uid`, in order: the Rust
    /// SDK's commits (`task_state`'s audit), the runner's fenced rows.
    pub async fn effects(self, db: &Client, uid: &str) -> anyhow::Result<Vec<i64>> {
        let sql = match self {
            Kind::RustSdk => {
                "SELECT token FROM task_state_audit
                  WHERE task_id = $1 AND status = 'COMPLETED' ORDER BY at"
            }
            Kind::Runner | Kind::Python => {
                "SELECT token FROM conformance_effects WHERE task_id = $1 ORDER BY token"
            }
        };
        Ok(db
            .query(sql, &[&uid])
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect())
    }

    /// What its log says once an attempt's handler has started.
    pub fn started_marker(self) -> &'static str {
        match self {
            Kind::RustSdk => "working",
            Kind::Runner => "command started",
            Kind::Python => "attempt started",
        }
    }

    /// What its log says when a cancel stops a running handler.
    pub fn cancelled_marker(self) -> &'static str {
        match self {
            Kind::RustSdk | Kind::Python => "the task was cancelled: stopping the attempt",
            Kind::Runner => "SIGTERM to the child's process group",
        }
    }

    /// What its log says when its kill switch stops a running handler.
    pub fn killed_marker(self) -> &'static str {
        match self {
            Kind::RustSdk | Kind::Python => "kill switch fired",
            Kind::Runner => "SIGTERM to the child's process group",
        }
    }

    /// Whether it can expand a task into children (`ctx.spawn`).
    pub fn spawns(self) -> bool {
        matches!(self, Kind::RustSdk | Kind::Python)
    }
}

/// Creates the runner's effects table, once per test binary and under
/// the SDK's migration lock (`CREATE TABLE IF NOT EXISTS` from concurrent
/// tests races in the catalog).
pub async fn prepare(db: &Client) -> anyhow::Result<()> {
    static DONE: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    DONE.get_or_try_init(|| async {
        batchlease_worker_sdk::postgres::migrate_serialized(
            db,
            "CREATE TABLE IF NOT EXISTS conformance_effects (
                 task_id text NOT NULL, token bigint NOT NULL,
                 at timestamptz NOT NULL DEFAULT clock_timestamp())",
        )
        .await
    })
    .await?;
    Ok(())
}
