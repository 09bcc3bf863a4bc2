//! The worker of the README and `docs/sdk.md`, compiled: the code blocks of
//! those documents are the regions between `// [snippet]` and
//! `// [/snippet]` below, checked by `tests/doc_snippets.rs`, so the docs
//! cannot drift from code that builds.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use batchlease_worker_sdk::postgres::{FencedPool, migrate};
use batchlease_worker_sdk::{Output, TaskContext, TaskError, WorkerBuilder, WorkerMetrics};
use serde::Deserialize;
use serde_json::json;

#[derive(Deserialize)]
struct Job {
    rows: u64,
}

async fn shutdown_signal() {
    let _ = tokio::signal::ctrl_c().await;
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = kube::Config::infer().await?;
    let pg_url = std::env::var("PG_URL")?;
    // Opens one connection (the pool calls it up to once per slot).
    let connect = move || {
        let pg_url = pg_url.clone();
        async move {
            let (pg, conn) = tokio_postgres::connect(&pg_url, tokio_postgres::NoTls).await?;
            tokio::spawn(conn);
            Ok(pg)
        }
    };
    let shutdown = shutdown_signal();
    // [snippet]
    // A connection per slot: slots register and commit concurrently.
    let store = Arc::new(FencedPool::new(4, WorkerMetrics::default(), connect));
    migrate(store.get().await?.client()).await?;
    let worker = WorkerBuilder::new(config, "default")
        .queue("demo")
        .slots(4)
        .registry(store.clone()) // each attempt registers its token before it runs
        .build()?;
    worker
        .run(
            move |ctx: TaskContext| {
                let store = store.clone();
                async move {
                    if let Some(done) = ctx.earlier_commit() {
                        // An earlier attempt committed, then lost its lease: done.
                        return Ok(Output::json(json!({"committedBy": done.token})));
                    }
                    let job: Job = ctx.payload()?; // wrong shape: a permanent error
                    ctx.checkpoint(json!({"step": 1}))?; // handed to the next attempt
                    let rows = json!({"rows": job.rows});
                    // Refused once the lease is lost, by the SDK and by PostgreSQL.
                    let mut db = store.get().await?;
                    db.commit(ctx.fence(), ctx.task_uid(), &rows).await?;
                    Ok::<_, TaskError>(Output::json(rows))
                }
            },
            shutdown,
        )
        .await?;
    // [/snippet]
    Ok(())
}
