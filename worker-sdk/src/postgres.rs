//! The fenced PostgreSQL store (design §4).
//!
//! Every commit is one conditional upsert keyed by task id:
//!
//! ```sql
//! INSERT INTO task_state (task_id, status, payload, last_fencing_token, updated_at)
//! VALUES ($1, 'COMPLETED', $3, $2, now())
//! ON CONFLICT (task_id) DO UPDATE SET status = 'COMPLETED', payload = EXCLUDED.payload,
//!        last_fencing_token = EXCLUDED.last_fencing_token, updated_at = now()
//!  WHERE task_state.last_fencing_token < EXCLUDED.last_fencing_token
//! ```
//!
//! Zero rows affected means a newer (or equal) token got there first: with
//! an equal token it is our own earlier commit whose acknowledgement was
//! lost (success, idempotently), otherwise [`Error::Fenced`]. The first
//! insert is fenced too, by the same statement. The caller's own writes can
//! share the transaction: they commit only if the fence let us through.

use std::future::Future;
use std::pin::Pin;

use serde_json::Value;
use tokio_postgres::types::Json;
use tokio_postgres::{Client, Transaction};

use crate::error::Error;
use crate::fence::Fence;
use crate::metrics::WorkerMetrics;

/// The table the store writes; create it with [`migrate`].
pub const MIGRATION: &str = "CREATE TABLE IF NOT EXISTS task_state (
    task_id            text PRIMARY KEY,
    status             text NOT NULL,
    payload            jsonb,
    last_fencing_token bigint NOT NULL,
    updated_at         timestamptz NOT NULL DEFAULT now()
)";

const FENCED_UPSERT: &str =
    "INSERT INTO task_state (task_id, status, payload, last_fencing_token, updated_at)
     VALUES ($1, 'COMPLETED', $3, $2, now())
     ON CONFLICT (task_id) DO UPDATE SET status = 'COMPLETED', payload = EXCLUDED.payload,
            last_fencing_token = EXCLUDED.last_fencing_token, updated_at = now()
      WHERE task_state.last_fencing_token < EXCLUDED.last_fencing_token";

/// Creates the `task_state` table if it does not exist.
pub async fn migrate(client: &Client) -> Result<(), Error> {
    client
        .batch_execute(MIGRATION)
        .await
        .map_err(|source| Error::Postgres {
            what: "migration",
            source,
        })
}

/// What a commit did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Committed {
    /// The row now carries our token.
    Written,
    /// The row already carried our token: an earlier commit of ours whose
    /// acknowledgement was lost. Nothing was written again.
    AlreadyCommitted,
}

/// The future of the caller's writes that share the fenced transaction.
pub type Writes<'t> = Pin<Box<dyn Future<Output = Result<(), tokio_postgres::Error>> + Send + 't>>;

/// A PostgreSQL connection that commits only under a valid fence.
#[derive(Debug)]
pub struct FencedStore {
    client: Client,
    metrics: WorkerMetrics,
}

impl FencedStore {
    /// Wraps a connected client. `metrics` counts rejected commits.
    pub fn new(client: Client, metrics: WorkerMetrics) -> Self {
        Self { client, metrics }
    }

    /// The underlying client (for reads).
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Commits `payload` for `task_id` under `fence`.
    pub async fn commit(
        &mut self,
        fence: &Fence,
        task_id: &str,
        payload: &Value,
    ) -> Result<Committed, Error> {
        self.commit_with(fence, task_id, payload, |_| Box::pin(async { Ok(()) }))
            .await
    }

    /// Commits `payload` and runs `writes` in the same transaction, after the
    /// fence let us through (the fenced row stays locked until commit).
    pub async fn commit_with<W>(
        &mut self,
        fence: &Fence,
        task_id: &str,
        payload: &Value,
        writes: W,
    ) -> Result<Committed, Error>
    where
        W: for<'t> FnOnce(&'t Transaction<'t>) -> Writes<'t>,
    {
        // Refuse locally first: a revoked attempt must not even try.
        if let Err(e) = fence.check() {
            self.metrics.fenced_commit_rejected.inc();
            return Err(e);
        }
        let token = fence.token();
        let pg = |what| move |source| Error::Postgres { what, source };
        let tx = self.client.transaction().await.map_err(pg("begin"))?;
        let rows = tx
            .execute(FENCED_UPSERT, &[&task_id, &token, &Json(payload)])
            .await
            .map_err(pg("fenced upsert"))?;
        if rows == 0 {
            let current: i64 = tx
                .query_one(
                    "SELECT last_fencing_token FROM task_state WHERE task_id = $1",
                    &[&task_id],
                )
                .await
                .map_err(pg("fence read"))?
                .get(0);
            tx.rollback().await.map_err(pg("rollback"))?;
            if current == token {
                return Ok(Committed::AlreadyCommitted);
            }
            self.metrics.fenced_commit_rejected.inc();
            return Err(Error::Fenced { token, current });
        }
        let result = writes(&tx).await;
        match result {
            Ok(()) => {
                tx.commit().await.map_err(pg("commit"))?;
                Ok(Committed::Written)
            }
            Err(source) => {
                let _ = tx.rollback().await;
                Err(Error::Postgres {
                    what: "user writes",
                    source,
                })
            }
        }
    }
}
