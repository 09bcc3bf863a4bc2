//! `batchlease-run`: runs any command as a batchlease worker.
//!
//! `batchlease-run --namespace NS --queue Q [--slots N] -- CMD ARGS…`
//! claims TaskLeases of the queue with the SDK and, per attempt, starts
//! CMD in its own process group with the task in its environment (see
//! `child_env`), renews the lease while it runs, stops it (SIGTERM, then
//! SIGKILL after a grace that ends before the lease could be reissued)
//! when the kill switch fires, and reports its exit status as the
//! attempt's outcome. See docs/batchlease-run.md.

mod attempt;
mod checkpoint_file;
mod child;
mod child_env;
mod exit;
mod grace;
mod metrics;
mod output;
mod pg;
mod preflight;
mod workdir;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use batchlease_worker_sdk::WorkerBuilder;
use clap::Parser;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::output::LogFormat;

/// Flags (each also an environment variable).
#[derive(Debug, Parser)]
#[command(version, about, trailing_var_arg = true)]
struct Args {
    /// Namespace whose tasks to run.
    #[arg(long, env = "BATCHLEASE_TASK_NAMESPACE", default_value = "default")]
    namespace: String,
    /// Queues to serve (comma-separated).
    #[arg(
        long = "queue",
        env = "BATCHLEASE_QUEUES",
        value_delimiter = ',',
        required = true
    )]
    queues: Vec<String>,
    /// Attempts (children) run at once.
    #[arg(long, env = "BATCHLEASE_SLOTS", default_value_t = 1)]
    slots: usize,
    /// Holder identity (default: `<POD_NAME or host name>/<random suffix>`).
    #[arg(long, env = "BATCHLEASE_IDENTITY")]
    identity: Option<String>,
    /// Exit codes that mean "retry" (comma-separated; default 75,
    /// EX_TEMPFAIL). Other non-zero codes are retried too; these are
    /// reported as `RetryExitCode`.
    #[arg(
        long,
        env = "BATCHLEASE_RETRY_EXIT_CODES",
        value_delimiter = ',',
        default_values_t = [exit::DEFAULT_RETRY_CODE]
    )]
    retry_exit_codes: Vec<i32>,
    /// Exit codes that mean "permanent failure": the task is dead-lettered
    /// without a retry (comma-separated; default 65, EX_DATAERR).
    #[arg(
        long,
        env = "BATCHLEASE_PERMANENT_EXIT_CODES",
        value_delimiter = ',',
        default_values_t = [exit::DEFAULT_PERMANENT_CODE]
    )]
    permanent_exit_codes: Vec<i32>,
    /// Seconds between SIGTERM and SIGKILL to the child's process group
    /// (fractions allowed). Clamped per attempt to TTL/3 - 0.5 s, so the
    /// SIGKILL lands before the lease could be reissued.
    #[arg(long, env = "BATCHLEASE_KILL_GRACE_SECONDS", default_value_t = 5.0)]
    kill_grace: f64,
    /// How the child's output (and the runner's log) is written.
    #[arg(long, env = "BATCHLEASE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// File with the PostgreSQL connection string of the fenced store;
    /// without it, the environment variable BATCHLEASE_PG_URL. Never a
    /// flag (a command line is visible to every user of the host). With
    /// it, each attempt's token is registered before CMD starts, so CMD
    /// can fence its own writes with `batchlease_fence(uid, token)`.
    #[arg(long, env = "BATCHLEASE_PG_URL_FILE")]
    database_url_file: Option<PathBuf>,
    /// Serve the SDK's metrics on this address (`/metrics`).
    #[arg(long, env = "BATCHLEASE_METRICS_ADDR")]
    metrics_addr: Option<std::net::SocketAddr>,
    /// Where attempts' private directories are made (default: the
    /// system's temporary directory).
    #[arg(long, env = "BATCHLEASE_WORK_DIR")]
    work_dir: Option<PathBuf>,
    /// Kubeconfig file (default: KUBECONFIG, then in-cluster).
    #[arg(long, env = "BATCHLEASE_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// The command to run per attempt, and its arguments (after `--`).
    #[arg(required = true, num_args = 1.., value_name = "CMD")]
    command: Vec<String>,
}

/// Time the SDK gives running attempts after SIGTERM beyond the kill
/// grace: the child gets SIGTERM at once and SIGKILL after the grace, and
/// its end must still be reported (as `Interrupted`) by the runner itself.
const DRAIN_SLACK: Duration = Duration::from_secs(5);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    init_tracing(args.log_format);
    let grace = Duration::try_from_secs_f64(args.kill_grace)
        .map_err(|e| anyhow::anyhow!("--kill-grace {}: {e}", args.kill_grace))?;
    grace::validate(grace)?;
    let default_ttl = Duration::from_secs(30);
    if grace > grace::budget(default_ttl) {
        warn!(
            ?grace,
            "--kill-grace is longer than TTL/3 - 0.5 s of the default 30 s lease: attempts of tasks with shorter leases get a shorter grace (logged per attempt)"
        );
    }
    let policy = exit::ExitPolicy {
        retry: args
            .retry_exit_codes
            .iter()
            .copied()
            .collect::<BTreeSet<_>>(),
        permanent: args.permanent_exit_codes.iter().copied().collect(),
    };
    let both = exit::overlapping(&policy);
    anyhow::ensure!(
        both.is_empty(),
        "exit codes {both:?} are both retry and permanent codes"
    );
    anyhow::ensure!(
        !policy.retry.contains(&0) && !policy.permanent.contains(&0),
        "exit code 0 always means success"
    );
    // Before any claim: a worker that cannot run its command or make an
    // attempt's directory refuses to start (preflight.rs says why).
    let work_root = args.work_dir.clone().unwrap_or_else(std::env::temp_dir);
    let program = args
        .command
        .first()
        .ok_or_else(|| anyhow::anyhow!("no command given after `--`"))?;
    let resolved = preflight::resolve(program, std::env::var_os("PATH"))?;
    preflight::work_dir(&work_root)?;
    let config = match &args.kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)?;
            kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?
        }
        None => kube::Config::infer().await?,
    };
    let pg = pg::load(args.database_url_file.as_deref())?;
    let mut builder = WorkerBuilder::new(config, &args.namespace)
        .slots(args.slots)
        .drain_grace(grace + DRAIN_SLACK)
        // A killed attempt's command is SIGKILLed only after the grace: its
        // lease is not given back before (the SDK caps it at TTL/3).
        .stop_budget(grace);
    for q in &args.queues {
        builder = builder.queue(q);
    }
    if let Some(id) = &args.identity {
        builder = builder.identity(id);
    }
    if let Some(addr) = args.metrics_addr {
        let mut registry = prometheus_client::registry::Registry::default();
        builder.metrics().register(&mut registry);
        tokio::spawn(metrics::serve(addr, Arc::new(registry)));
    }
    let store = match pg {
        Some(pg) => Some(pg::fenced_store(pg, args.slots, &builder).await?),
        None => {
            info!(
                "no PostgreSQL connection string: attempts are not registered in a fenced store (batchlease_fence cannot be used)"
            );
            None
        }
    };
    if let Some(store) = &store {
        builder = builder.registry(store.clone());
    }
    let drain = CancellationToken::new();
    let live = child::LiveGroups::default();
    // However main ends, no child outlives the runner.
    let _kill_on_exit = child::KillOnExit(live.clone());
    let cfg = Arc::new(attempt::Config {
        command: args.command,
        policy,
        grace,
        log_format: args.log_format,
        work_root,
        drain: drain.clone(),
        live,
        store,
    });
    let worker = builder.build()?;
    info!(identity = worker.identity(), command = ?cfg.command, program = %resolved.display(), work_root = %cfg.work_root.display(), ?grace, "batchlease-run starting");
    worker
        .run(move |ctx| attempt::run(ctx, cfg.clone()), shutdown(drain))
        .await
        .context("worker")?;
    Ok(())
}

fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,kube=warn"));
    // The runner's own log goes to stderr: stdout carries the children's.
    let fmt = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(filter);
    match format {
        LogFormat::Text => fmt.init(),
        LogFormat::Json => fmt.json().init(),
    }
}

/// SIGTERM or SIGINT: forward SIGTERM to the children (`drain`), then let
/// the SDK drain (no more claims; attempts given back when they end).
async fn shutdown(drain: CancellationToken) {
    batchlease_worker_sdk::shutdown_signal().await;
    info!("SIGTERM: draining; SIGTERM forwarded to the running commands");
    drain.cancel();
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::Args;

    #[test]
    fn the_cli_is_consistent() {
        Args::command().debug_assert();
    }

    #[test]
    fn everything_after_the_double_dash_is_the_command() {
        let a = Args::try_parse_from([
            "batchlease-run",
            "--queue=a,b",
            "--kill-grace=2.5",
            "--",
            "./job.sh",
            "--verbose",
            "--queue=x",
        ])
        .unwrap();
        assert_eq!(a.queues, ["a", "b"]);
        assert_eq!(a.command, ["./job.sh", "--verbose", "--queue=x"]);
        assert_eq!(a.slots, 1);
        assert_eq!(a.retry_exit_codes, [75]);
        assert_eq!(a.permanent_exit_codes, [65]);
        assert!((a.kill_grace - 2.5).abs() < f64::EPSILON);
        // A command is required.
        assert!(Args::try_parse_from(["batchlease-run", "--queue=a"]).is_err());
    }
}
