// [snippet]
//! A worker that commits each result to PostgreSQL under the attempt's
//! fencing token, over TLS, and serves its metrics.
use std::sync::Arc;

use batchlease_worker_sdk::postgres::{ConnectOptions, FencedPool, migrate};
use batchlease_worker_sdk::{Output, TaskContext, TaskError, WorkerBuilder};
use prometheus_client::registry::Registry;
use serde::Deserialize;
use serde_json::json;

/// A task's `spec.payload`, e.g. `{"day": "2025-06-01"}`.
#[derive(Deserialize)]
struct Report {
    day: String,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = kube::Config::infer().await?;
    let namespace = std::env::var("TASK_NAMESPACE").unwrap_or_else(|_| "default".into());
    // postgres://app:…@db.example.com:5432/tasks?sslmode=verify-full&sslrootcert=/etc/pg-ca/ca.crt
    // from a Secret; the CA file is read now, so a wrong path fails here.
    let pg: ConnectOptions = std::env::var("PG_URL")?.parse()?;
    let slots = 4;
    let builder = WorkerBuilder::new(config, namespace)
        .queue("reports")
        .slots(slots);

    // The SDK's metrics in your registry, on :9090/metrics.
    let mut registry = Registry::default();
    builder.metrics().register(&mut registry);
    tokio::spawn(serve_metrics(Arc::new(registry)));

    // A connection per slot; each attempt registers its token before it runs.
    println!("fenced store: {}", pg.describe()); // never shows the password
    let store = Arc::new(FencedPool::new(
        slots,
        builder.metrics().clone(),
        move || pg.connect(),
    ));
    migrate(store.get().await?.client()).await?;
    let worker = builder.registry(store.clone()).build()?;
    worker
        .run(
            move |ctx: TaskContext| {
                let store = store.clone();
                async move { report(ctx, &store).await }
            },
            shutdown(),
        )
        .await?;
    Ok(())
}

async fn report(ctx: TaskContext, store: &FencedPool) -> Result<Output, TaskError> {
    if let Some(done) = ctx.earlier_commit() {
        // An earlier attempt committed, then lost its lease: the work is done.
        return Ok(Output::json(json!({ "committedBy": done.token })));
    }
    let job: Report = ctx.payload()?;
    let row = json!({ "day": job.day, "rows": 42 });
    // Refused once the lease is lost: by the SDK, and by PostgreSQL.
    store
        .get()
        .await?
        .commit(ctx.fence(), ctx.task_uid(), &row)
        .await?;
    Ok(Output::json(row))
}

async fn serve_metrics(registry: Arc<Registry>) -> anyhow::Result<()> {
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || async move {
            let mut body = String::new();
            match prometheus_client::encoding::text::encode(&mut body, &registry) {
                Ok(()) => (axum::http::StatusCode::OK, body),
                Err(_) => (axum::http::StatusCode::INTERNAL_SERVER_ERROR, String::new()),
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("0.0.0.0:9090").await?;
    axum::serve(listener, app).await?;
    Ok(())
}

/// SIGTERM or Ctrl-C: stop claiming and drain.
async fn shutdown() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
// [/snippet]
