//! The worker of the README and `docs/sdk.md`, compiled: the code blocks of
//! those documents are the regions between `// [snippet]` and
//! `// [/snippet]` below, checked by `tests/doc_snippets.rs`, so the docs
//! cannot drift from code that builds.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use std::collections::BTreeMap;

use batchlease_worker_sdk::postgres::{FencedPool, migrate};
use batchlease_worker_sdk::{
    BatchTaskSpec, Child, JsonObject, Output, Subgraph, TaskContext, TaskError, WorkerBuilder,
    WorkerMetrics,
};
use serde::Deserialize;
use serde_json::json;

#[derive(Deserialize)]
struct Job {
    rows: u64,
}

/// What an `extract` task returns (docs/sdk.md, *Task graphs*).
#[derive(Deserialize)]
#[allow(dead_code)]
struct Extract {
    rows: u64,
}

/// A pipeline step (docs/sdk.md, *Task graphs*): reads its dependencies'
/// results, then expands into children.
#[allow(dead_code)]
async fn pipeline_step(ctx: TaskContext) -> Result<Output, TaskError> {
    // [snippet]
    let inputs: BTreeMap<String, Option<JsonObject>> = ctx.dependency_results().await?;
    let rows: Option<Extract> = ctx.dependency_result::<Extract>("extract").await?;
    // [/snippet]
    let _ = (inputs, rows);
    // [snippet]
    let mut graph = Subgraph::new("v1");
    let extract = graph.push(Child::new(BatchTaskSpec::for_queue("etl")));
    let load = graph.push(Child::new(BatchTaskSpec::for_queue("etl")).after(extract));
    let mut report = BatchTaskSpec::for_queue("etl");
    report.depends_on = vec!["daily-config".into()]; // an existing task
    graph.push(Child::new(report).after(load)); // dependsOn: daily-config, <load>
    let names = ctx.spawn(&graph).await?;
    // [/snippet]
    Ok(Output::json(json!({ "children": names })))
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
