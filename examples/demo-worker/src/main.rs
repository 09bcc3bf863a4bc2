//! `batchlease-demo-worker`: works through a task in steps, recording a
//! checkpoint after each (so a retry resumes where the last attempt got),
//! then commits its result to PostgreSQL under the attempt's fence.
//!
//! Payload: `{"steps": 5, "stepMillis": 200, "failureRate": 0.0,
//! "permanentFailure": false}`. For tests of hostile or careless handlers:
//! `"spinMillis": n` first computes for n ms without awaiting (a CPU-bound
//! handler), `"deepLevels": n` records a checkpoint and returns a result
//! nested n objects deep, `"resultBytes": n` returns a result of n bytes,
//! `"tag": s` adds `"tag": s` to every checkpoint and to the result,
//! `"failAfterSteps": k` makes an attempt that started from no checkpoint
//! fail (retryable, `FailAfterSteps`) right after its k-th checkpoint, so
//! the next attempt resumes from it (the conformance suite's behaviour).
//!
//! For tests of task graphs:
//! - `"spawn": {"children": n, "version": "v1", "stallAfter": k, "chain":
//!   false}` spawns n children through `ctx.spawn` (each runs the demo with
//!   `{"steps": 1, "stepMillis": 50}` on the parent's queue; with `chain`,
//!   child i depends on child i-1) and lists their names in the result as
//!   `"children"`. With `stallAfter` k < n, the first attempt
//!   (`ctx.attempt() == 1`; a drained attempt does not count, so the next
//!   one stalls again) creates only children 0..k and then waits until
//!   its kill switch fires — a test SIGKILLs the worker mid-expansion; a
//!   later attempt spawns all n, finding 0..k already there.
//! - `"readDependencies": true` adds `"dependencies": {name: result}` to
//!   the result, read through `ctx.dependency_results()`.
//!
//! For speculative mode: `"transfer": {"from": a, "to": b, "amount": n,
//! "thinkMillis": ms}` moves `n` between two accounts with `ctx.speculate`
//! (compare-and-swap commit, a compensated "notice"; see `transfer.rs`).
//!
//! Every result carries `"seen": <the task's name>`, so a downstream task
//! that reads it proves the data passed forward. Resource tokens (tasks
//! with `spec.resources`) are registered and checked by the fenced store
//! with the task's token; the committed row lists them as
//! `"resourceTokens"`.

mod expand;
mod pg_url;
mod transfer;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use batchlease_worker_sdk::postgres::{ConnectOptions, FencedPool, migrate, migrate_serialized};
use batchlease_worker_sdk::{
    DEFAULT_DRAIN_GRACE, JsonObject, Output, TaskContext, TaskError, WorkerBuilder,
};
use clap::Parser;
use rand::Rng;
use serde::Deserialize;
use serde_json::json;
use tracing::{info, warn};

/// Flags (each also an environment variable).
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Namespace whose tasks to run (not POD_NAMESPACE, which for the
    /// operator names where its leader Lease lives: the worker's pod may
    /// run elsewhere than its tasks).
    #[arg(long, env = "BATCHLEASE_TASK_NAMESPACE", default_value = "default")]
    namespace: String,
    /// Queues to serve (comma-separated).
    #[arg(
        long,
        env = "BATCHLEASE_QUEUES",
        value_delimiter = ',',
        default_value = "demo"
    )]
    queues: Vec<String>,
    /// Attempts run at once.
    #[arg(long, env = "BATCHLEASE_SLOTS", default_value_t = 2)]
    slots: usize,
    /// Holder identity (default: `<POD_NAME or host name>/<random suffix>`).
    #[arg(long, env = "BATCHLEASE_IDENTITY")]
    identity: Option<String>,
    /// File with the PostgreSQL connection string for the fenced store
    /// (e.g. a mounted Secret); without it, the environment variable
    /// BATCHLEASE_PG_URL. Never a flag: a command line is visible to every
    /// user of the host. TLS: `sslmode=verify-full&sslrootcert=/path/ca.crt`
    /// in the URL (libpq's meaning; also PGSSLMODE / PGSSLROOTCERT).
    #[arg(long, env = "BATCHLEASE_PG_URL_FILE")]
    pg_url_file: Option<std::path::PathBuf>,
    /// Seconds running handlers may finish after SIGTERM (default: the
    /// SDK's `DEFAULT_DRAIN_GRACE`). Keep the pod's
    /// terminationGracePeriodSeconds at least 5 s above it: the rest of the
    /// leases are given back after it (the worker chart checks this).
    #[arg(
        long,
        env = "BATCHLEASE_DRAIN_GRACE_SECONDS",
        default_value_t = DEFAULT_DRAIN_GRACE.as_secs()
    )]
    drain_grace_seconds: u64,
    /// Serve the SDK's metrics on this address (`/metrics`), e.g. 0.0.0.0:9090.
    #[arg(long, env = "BATCHLEASE_METRICS_ADDR")]
    metrics_addr: Option<std::net::SocketAddr>,
    /// Milliseconds taken off each storage write's deadline (the SDK's
    /// `with_clock_skew`; it covers clock *rates*, not offsets: the
    /// deadline is on the database's clock). One larger than 2/3 of the
    /// lease TTL makes every registration late — how the tests show a
    /// worker that stops claiming when its storage refuses it.
    #[arg(
        long,
        env = "BATCHLEASE_STORAGE_DEADLINE_MARGIN_MS",
        default_value_t = 500
    )]
    storage_deadline_margin_ms: u64,
    /// Kubeconfig file (default: KUBECONFIG, then in-cluster).
    #[arg(long, env = "BATCHLEASE_KUBECONFIG")]
    kubeconfig: Option<std::path::PathBuf>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Payload {
    #[serde(default = "five")]
    steps: u64,
    #[serde(default = "two_hundred")]
    step_millis: u64,
    #[serde(default)]
    failure_rate: f64,
    #[serde(default)]
    permanent_failure: bool,
    /// Fail after this many steps when starting from scratch (0: never).
    #[serde(default)]
    fail_after_steps: u64,
    #[serde(default)]
    spin_millis: u64,
    #[serde(default)]
    deep_levels: usize,
    #[serde(default)]
    result_bytes: usize,
    /// Added as `"tag"` to every checkpoint and to the result (tests use
    /// it to make the API server refuse a write that is still ours).
    #[serde(default)]
    tag: Option<String>,
    /// Children to spawn (see the module docs).
    #[serde(default)]
    spawn: Option<expand::Spawn>,
    /// Put the dependencies' results into the result.
    #[serde(default)]
    read_dependencies: bool,
    /// A speculative transfer between two accounts (see `transfer.rs`).
    #[serde(default)]
    transfer: Option<transfer::Transfer>,
}

/// `v` with `"tag": tag` added, if there is one.
fn tagged(mut v: serde_json::Value, tag: &Option<String>) -> serde_json::Value {
    if let Some(t) = tag {
        v["tag"] = json!(t);
    }
    v
}

/// The demo's checkpoint.
#[derive(Deserialize)]
struct Progress {
    step: u64,
}

/// `{"n":{"n":…{"step":k}…}}`, `levels` objects deep, as JSON text: built
/// as text because a `serde_json::Value` this deep overflows the stack.
fn nested(levels: usize, step: u64) -> Result<JsonObject, TaskError> {
    let mut s = String::with_capacity(levels * 6 + 16);
    for _ in 1..levels {
        s.push_str("{\"n\":");
    }
    s.push_str(&format!("{{\"step\":{step}}}"));
    for _ in 1..levels {
        s.push('}');
    }
    JsonObject::from_text(s).map_err(|e| TaskError::permanent(e.to_string()))
}

fn five() -> u64 {
    5
}
fn two_hundred() -> u64 {
    200
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        // Colours only on a terminal: a log file gets plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,kube=warn")),
        )
        .init();
    let args = Args::parse();
    let config = match &args.kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)?;
            kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?
        }
        None => kube::Config::infer().await?,
    };
    let pg = pg_url::load(args.pg_url_file.as_deref())?;
    let mut builder = WorkerBuilder::new(config, &args.namespace)
        .slots(args.slots)
        .drain_grace(Duration::from_secs(args.drain_grace_seconds));
    for q in &args.queues {
        builder = builder.queue(q);
    }
    if let Some(id) = &args.identity {
        builder = builder.identity(id);
    }
    if let Some(addr) = args.metrics_addr {
        let mut registry = prometheus_client::registry::Registry::default();
        builder.metrics().register(&mut registry);
        tokio::spawn(serve_metrics(addr, Arc::new(registry)));
    }
    let store = match pg {
        Some(pg) => Some(
            fenced_store(
                pg,
                args.slots,
                Duration::from_millis(args.storage_deadline_margin_ms),
                &builder,
            )
            .await?,
        ),
        None => {
            warn!(
                "no PostgreSQL connection string ({} or --pg-url-file): results are NOT committed \
                 to a fenced store — a zombie attempt's work is refused by the API server only, \
                 and transfer tasks fail",
                pg_url::ENV
            );
            None
        }
    };
    // Each attempt registers its token before the handler runs (docs/sdk.md,
    // "Fenced PostgreSQL store").
    if let Some(store) = &store {
        builder = builder.registry(store.clone());
    }
    let worker = builder.build()?;
    let identity = worker.identity().to_owned();
    info!(%identity, "demo worker starting");
    worker
        .run(
            move |ctx| {
                let (store, identity) = (store.clone(), identity.clone());
                async move { work(ctx, store, identity).await }
            },
            shutdown(),
        )
        .await?;
    Ok(())
}

/// The fenced store on `pg`: a connection per slot (slots commit
/// concurrently), its tables migrated. TLS as the connection string's
/// `sslmode` says (the SDK's `ConnectOptions`).
async fn fenced_store(
    pg: ConnectOptions,
    slots: usize,
    margin: Duration,
    builder: &WorkerBuilder,
) -> anyhow::Result<Arc<FencedPool>> {
    let database = pg.describe();
    let store = Arc::new(
        FencedPool::new(slots, builder.metrics().clone(), move || pg.connect())
            .with_clock_skew(margin),
    );
    let first = match store.get().await {
        Ok(db) => db,
        Err(e) => {
            // The server's pg_hba.conf refused a connection without TLS
            // (`hostnossl … reject`, what managed PostgreSQL does): say
            // what to change, not only what the server said.
            let hint = match &e {
                batchlease_worker_sdk::Error::Postgres { source, .. }
                    if source
                        .as_db_error()
                        .is_some_and(|d| d.message().contains("no encryption")) =>
                {
                    " — the server accepts TLS connections only: add sslmode=verify-full and \
                     sslrootcert=<its CA file> (or sslmode=require, unverified) to the connection string"
                }
                _ => "",
            };
            return Err(e).with_context(|| format!("connecting to PostgreSQL ({database}){hint}"));
        }
    };
    migrate(first.client()).await?;
    drop(first);
    // Under the same lock as the SDK's migration: replicas started at once
    // on an empty database must not race to create it.
    migrate_serialized(store.get().await?.client(), transfer::OUTBOX)
        .await
        .context("creating the demo's outbox table")?;
    info!(%database, "fenced store ready");
    Ok(store)
}

async fn work(
    ctx: TaskContext,
    store: Option<Arc<FencedPool>>,
    identity: String,
) -> Result<Output, TaskError> {
    let p: Payload = ctx.payload()?;
    if let Some(t) = &p.transfer {
        let Some(store) = store else {
            return Err(TaskError::permanent(
                "a transfer needs the fenced store: start the demo worker with a PostgreSQL connection string",
            )
            .with_reason("NoFencedStore"));
        };
        // Speculative: the executor handles an earlier commit itself.
        return transfer::run(&ctx, store, t, &identity).await;
    }
    if let Some(earlier) = ctx.earlier_commit() {
        // An earlier attempt committed before its lease ended (its
        // completion was lost): the work is done, report it, do not redo it.
        info!(
            task = ctx.task_name(),
            token = ctx.fencing_token(),
            earlier = earlier.token,
            "already committed by an earlier attempt"
        );
        return Ok(Output::json(
            json!({"committedBy": earlier.token, "result": earlier.payload, "seen": ctx.task_name()}),
        ));
    }
    // Before the steps: a dependency that is gone fails the attempt before
    // any work, and children exist before the parent can succeed.
    let dependencies = match p.read_dependencies {
        true => Some(ctx.dependency_results().await?),
        false => None,
    };
    let children = match &p.spawn {
        Some(knob) => Some(expand::spawn(&ctx, knob).await?),
        None => None,
    };
    // A deep checkpoint (deepLevels) is not one this demo resumes from.
    let from = if p.deep_levels > 0 {
        0
    } else {
        ctx.previous_checkpoint::<Progress>()?.map_or(0, |c| c.step)
    };
    if p.spin_millis > 0 {
        // Computes without ever awaiting, like CPU-bound user code: the
        // lease must stay renewed all the same (the heartbeat has its own
        // runtime).
        let until = std::time::Instant::now() + Duration::from_millis(p.spin_millis);
        let mut spins: u64 = 0;
        while std::time::Instant::now() < until {
            spins = std::hint::black_box(spins.wrapping_add(1));
        }
    }
    info!(
        task = ctx.task_name(),
        token = ctx.fencing_token(),
        resource_tokens = ?ctx.resource_tokens(),
        from,
        steps = p.steps,
        "working"
    );
    for step in from..p.steps {
        // The "work" of this demo is waiting; a real worker computes here.
        tokio::time::sleep(Duration::from_millis(p.step_millis)).await;
        if p.deep_levels > 0 {
            ctx.checkpoint(nested(p.deep_levels, step + 1)?)?;
        } else {
            ctx.checkpoint(tagged(json!({"step": step + 1}), &p.tag))?;
        }
        if from == 0 && p.fail_after_steps == step + 1 {
            return Err(TaskError::retryable(format!(
                "failing after {} steps, as the payload asks",
                step + 1
            ))
            .with_reason("FailAfterSteps"));
        }
    }
    if p.permanent_failure {
        return Err(
            TaskError::permanent("the payload asks for a permanent failure")
                .with_reason("DemoPermanent"),
        );
    }
    if rand::rng().random::<f64>() < p.failure_rate {
        return Err(TaskError::retryable("simulated flaky failure").with_reason("DemoFlaky"));
    }
    let mut row = json!({"worker": identity, "token": ctx.fencing_token(), "steps": p.steps, "resumedFrom": from});
    if !ctx.resource_tokens().is_empty() {
        row["resourceTokens"] = json!(ctx.resource_tokens());
    }
    let Some(store) = store else {
        // No fenced store: the result goes only into the lease.
        info!(
            task = ctx.task_name(),
            token = ctx.fencing_token(),
            "done (not committed: no fenced store)"
        );
        return Ok(Output::json(tagged(
            json!({"worker": identity, "resumedFrom": from, "seen": ctx.task_name(), "committed": false}),
            &p.tag,
        )));
    };
    let committed = match store.get().await {
        Ok(mut db) => db.commit(ctx.fence(), ctx.task_uid(), &row).await,
        Err(e) => Err(e),
    };
    match committed {
        Ok(c) => info!(
            task = ctx.task_name(),
            token = ctx.fencing_token(),
            ?c,
            "committed"
        ),
        Err(e) => {
            tracing::error!(task = ctx.task_name(), token = ctx.fencing_token(), error = %e, kind = e.kind(), "commit rejected");
            return Err(e.into());
        }
    }
    if p.deep_levels > 0 {
        return Ok(Output::try_raw(nested(p.deep_levels, p.steps)?)?);
    }
    if p.result_bytes > 0 {
        // Output::json defers the size check to the completion, which
        // reports it as a permanent ResultTooLarge failure.
        let filler = "x".repeat(p.result_bytes);
        return Ok(Output::json(json!({"worker": identity, "filler": filler})));
    }
    let mut result = json!({"worker": identity, "resumedFrom": from, "seen": ctx.task_name()});
    if let Some(children) = children {
        result["children"] = json!(children);
    }
    if let Some(dependencies) = dependencies {
        result["dependencies"] = json!(dependencies);
    }
    Ok(Output::json(tagged(result, &p.tag)))
}

/// `/metrics` in the Prometheus text format.
async fn serve_metrics(
    addr: std::net::SocketAddr,
    registry: Arc<prometheus_client::registry::Registry>,
) -> anyhow::Result<()> {
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let registry = registry.clone();
            async move {
                let mut body = String::new();
                match prometheus_client::encoding::text::encode(&mut body, &registry) {
                    Ok(()) => (axum::http::StatusCode::OK, body),
                    Err(_) => (axum::http::StatusCode::INTERNAL_SERVER_ERROR, String::new()),
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind(addr).await?;
    info!(addr = %listener.local_addr()?, "serving /metrics");
    axum::serve(listener, app).await?;
    Ok(())
}

async fn shutdown() {
    batchlease_worker_sdk::shutdown_signal().await;
    info!("SIGTERM: draining");
}
