//! The optional fenced store: with a PostgreSQL connection string, each
//! attempt's token is registered in the SDK's tables before the command
//! starts (`WorkerBuilder::registry`), which is what the command's own
//! `SELECT batchlease_fence(uid, token)` checks against.
//!
//! The string usually carries a password: it comes from a file or from
//! `BATCHLEASE_PG_URL`, never a flag, and the child never inherits it
//! (`child_env::WITHHELD`).

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use batchlease_worker_sdk::WorkerBuilder;
use batchlease_worker_sdk::postgres::{ConnectOptions, FencedPool, migrate};
use tracing::info;

/// The environment variable with the connection string when no file is given.
pub const ENV: &str = "BATCHLEASE_PG_URL";

/// The connection string from `file` (trimmed), else [`ENV`]; `None`
/// without either.
pub fn load(file: Option<&Path>) -> anyhow::Result<Option<ConnectOptions>> {
    let raw = match file {
        Some(path) => std::fs::read_to_string(path)
            .with_context(|| format!("reading --database-url-file {}", path.display()))?,
        None => match std::env::var(ENV) {
            Ok(raw) => raw,
            Err(std::env::VarError::NotPresent) => return Ok(None),
            Err(e) => return Err(e).with_context(|| format!("reading {ENV}")),
        },
    };
    Ok(Some(ConnectOptions::parse(raw.trim())?))
}

/// The pool (a connection per slot), its tables migrated.
pub async fn fenced_store(
    pg: ConnectOptions,
    slots: usize,
    builder: &WorkerBuilder,
) -> anyhow::Result<Arc<FencedPool>> {
    let database = pg.describe();
    let store = Arc::new(FencedPool::new(
        slots,
        builder.metrics().clone(),
        move || pg.connect(),
    ));
    let first = store
        .get()
        .await
        .with_context(|| format!("connecting to PostgreSQL ({database})"))?;
    migrate(first.client()).await?;
    drop(first);
    info!(%database, "fenced store ready");
    Ok(store)
}
