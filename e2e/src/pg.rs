//! Reading the fenced store's table from the tests.

use serde_json::Value;
use tokio::sync::OnceCell;
use tokio_postgres::{Client, NoTls};

use crate::workers::pg_url;

static SCHEMA: OnceCell<()> = OnceCell::const_new();

/// A connection to the test PostgreSQL with `task_state` (created by the
/// SDK's migration, before any worker races to create it) and an audit
/// trigger recording every write to it.
pub async fn connect() -> anyhow::Result<Client> {
    let (client, conn) = tokio_postgres::connect(&pg_url()?, NoTls).await?;
    tokio::spawn(conn);
    SCHEMA
        .get_or_try_init(|| async {
            // One session-level lock: test binaries run one after another,
            // but be safe if two ever overlap.
            client.batch_execute("SELECT pg_advisory_lock(4242)").await?;
            client.batch_execute(batchlease_worker_sdk::postgres::MIGRATION).await?;
            client
                .batch_execute(
                    "CREATE TABLE IF NOT EXISTS task_state_audit (
                         task_id text NOT NULL, token bigint NOT NULL, worker text, at timestamptz NOT NULL DEFAULT now());
                     CREATE OR REPLACE FUNCTION task_state_audit_fn() RETURNS trigger AS $$
                     BEGIN
                       INSERT INTO task_state_audit (task_id, token, worker)
                       VALUES (NEW.task_id, NEW.last_fencing_token, NEW.payload->>'worker');
                       RETURN NEW;
                     END $$ LANGUAGE plpgsql;
                     DROP TRIGGER IF EXISTS task_state_audit_tr ON task_state;
                     CREATE TRIGGER task_state_audit_tr AFTER INSERT OR UPDATE ON task_state
                       FOR EACH ROW EXECUTE FUNCTION task_state_audit_fn();
                     SELECT pg_advisory_unlock(4242);",
                )
                .await?;
            Ok::<_, anyhow::Error>(())
        })
        .await?;
    Ok(client)
}

/// The row of `namespace/task`: (token, payload).
pub async fn row(
    client: &Client,
    namespace: &str,
    task: &str,
) -> anyhow::Result<Option<(i64, Value)>> {
    let id = format!("{namespace}/{task}");
    let row = client
        .query_opt(
            "SELECT last_fencing_token, payload FROM task_state WHERE task_id = $1",
            &[&id],
        )
        .await?;
    Ok(row.map(|r| (r.get(0), r.get(1))))
}

/// Every write to `namespace/task`, oldest first: (token, worker).
pub async fn audit(
    client: &Client,
    namespace: &str,
    task: &str,
) -> anyhow::Result<Vec<(i64, String)>> {
    let id = format!("{namespace}/{task}");
    let rows = client
        .query(
            "SELECT token, coalesce(worker, '') FROM task_state_audit WHERE task_id = $1 ORDER BY at",
            &[&id],
        )
        .await?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}
