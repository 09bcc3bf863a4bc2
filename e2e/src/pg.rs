//! Reading the fenced store's table from the tests.

use serde_json::Value;
use tokio::sync::OnceCell;
use tokio_postgres::{Client, NoTls};

use crate::workers::pg_url;

static SCHEMA: OnceCell<()> = OnceCell::const_new();

/// A connection to the test PostgreSQL with `task_state` and
/// `resource_fence` (created by the SDK's migration, before any worker
/// races to create them) and audit triggers recording every write to them.
pub async fn connect() -> anyhow::Result<Client> {
    let (client, conn) = tokio_postgres::connect(&pg_url()?, NoTls).await?;
    tokio::spawn(conn);
    SCHEMA.get_or_try_init(|| ensure_schema(&client)).await?;
    Ok(client)
}

/// Creates the schema and the audit triggers once per test run. A test
/// binary after the first finds them there and takes no lock: its DDL
/// (`ALTER TABLE`, `CREATE TRIGGER`) would queue for exclusive locks behind
/// the registrations of workers still running, and deadlock with them (seen
/// once: "deadlock detected" on `task_state`). The first one retries a
/// deadlock, which PostgreSQL resolves by failing one side.
async fn ensure_schema(client: &Client) -> anyhow::Result<()> {
    let done = client
        .query_one(
            "SELECT count(*) FROM pg_trigger
              WHERE tgname IN ('task_state_audit_tr', 'resource_fence_audit_tr',
                               'batchlease_deadline')",
            &[],
        )
        .await?
        .get::<_, i64>(0)
        == 3;
    if done {
        return Ok(());
    }
    let mut attempt = 0;
    loop {
        attempt += 1;
        match create_schema(client).await {
            Ok(()) => return Ok(()),
            Err(e)
                if attempt < 5
                    && e.code()
                        == Some(&tokio_postgres::error::SqlState::T_R_DEADLOCK_DETECTED) =>
            {
                client.batch_execute("ROLLBACK").await?;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// The SDK's migration, the audit tables and their triggers, in one
/// transaction under the SDK's migration lock (serialized with the
/// migrations of workers starting at the same time).
async fn create_schema(client: &Client) -> Result<(), tokio_postgres::Error> {
    let lock = batchlease_worker_sdk::postgres::MIGRATION_LOCK;
    client
        .batch_execute(&format!(
            "BEGIN; SELECT pg_advisory_xact_lock({lock}); {}; {RESOURCE_AUDIT}; {TASK_STATE_AUDIT}; COMMIT",
            batchlease_worker_sdk::postgres::MIGRATION
        ))
        .await
}

/// Every registration and commit of `task_state`, as it happened.
const TASK_STATE_AUDIT: &str = "CREATE TABLE IF NOT EXISTS task_state_audit (
                         task_id text NOT NULL, token bigint NOT NULL, status text, worker text,
                         at timestamptz NOT NULL DEFAULT clock_timestamp());
                     ALTER TABLE task_state_audit ADD COLUMN IF NOT EXISTS status text;
                     CREATE OR REPLACE FUNCTION task_state_audit_fn() RETURNS trigger AS $$
                     BEGIN
                       -- A commit sets committed_token; anything else (a
                       -- registration) is recorded as RUNNING with its token.
                       IF NEW.committed_token IS NOT NULL
                          AND (TG_OP = 'INSERT' OR OLD.committed_token IS NULL) THEN
                         INSERT INTO task_state_audit (task_id, token, status, worker)
                         VALUES (NEW.task_id, NEW.committed_token, 'COMPLETED', NEW.payload->>'worker');
                       ELSE
                         INSERT INTO task_state_audit (task_id, token, status, worker)
                         VALUES (NEW.task_id, NEW.last_fencing_token, 'RUNNING', NULL);
                       END IF;
                       RETURN NEW;
                     END $$ LANGUAGE plpgsql;
                     DROP TRIGGER IF EXISTS task_state_audit_tr ON task_state;
                     CREATE TRIGGER task_state_audit_tr AFTER INSERT OR UPDATE ON task_state
                       FOR EACH ROW EXECUTE FUNCTION task_state_audit_fn();";

/// Every insert or update of `resource_fence`, as it happened: the
/// registration (`REGISTERED`) and the commit stamp (`COMMITTED`) of each
/// resource token, so a test reconstructs who occupied a resource when.
/// `seq` orders rows written within one clock tick.
const RESOURCE_AUDIT: &str = "CREATE TABLE IF NOT EXISTS resource_fence_audit (
         seq bigserial, namespace text NOT NULL, resource text NOT NULL, token bigint NOT NULL,
         task_id text NOT NULL, status text NOT NULL,
         at timestamptz NOT NULL DEFAULT clock_timestamp());
     CREATE OR REPLACE FUNCTION resource_fence_audit_fn() RETURNS trigger AS $$
     BEGIN
       INSERT INTO resource_fence_audit (namespace, resource, token, task_id, status)
       VALUES (NEW.namespace, NEW.resource, NEW.last_token, NEW.task_id, NEW.status);
       RETURN NEW;
     END $$ LANGUAGE plpgsql;
     DROP TRIGGER IF EXISTS resource_fence_audit_tr ON resource_fence;
     CREATE TRIGGER resource_fence_audit_tr AFTER INSERT OR UPDATE ON resource_fence
       FOR EACH ROW EXECUTE FUNCTION resource_fence_audit_fn();";

/// One write to `resource_fence`, from its audit.
#[derive(Debug, Clone, PartialEq)]
pub struct ResourceWrite {
    pub token: i64,
    /// The UID of the task whose attempt wrote it.
    pub task_id: String,
    /// `REGISTERED` or `COMMITTED`.
    pub status: String,
    /// The database's clock when the write happened.
    pub at: std::time::SystemTime,
}

/// Every write to resource `resource` of `namespace`, oldest first. An
/// attempt occupied the resource from its token's `REGISTERED` to its
/// `COMMITTED` (or, if it never committed, to the next token's
/// `REGISTERED`).
pub async fn resource_audit(
    client: &Client,
    namespace: &str,
    resource: &str,
) -> anyhow::Result<Vec<ResourceWrite>> {
    let rows = client
        .query(
            "SELECT token, task_id, status, at FROM resource_fence_audit
              WHERE namespace = $1 AND resource = $2 ORDER BY at, seq",
            &[&namespace, &resource],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| ResourceWrite {
            token: r.get(0),
            task_id: r.get(1),
            status: r.get(2),
            at: r.get(3),
        })
        .collect())
}

/// The committed result of the task with UID `task_uid`: (committing
/// token, payload); `None` while nothing is committed.
pub async fn row(client: &Client, task_uid: &str) -> anyhow::Result<Option<(i64, Value)>> {
    let row = client
        .query_opt(
            "SELECT committed_token, payload FROM task_state
              WHERE task_id = $1 AND committed_token IS NOT NULL",
            &[&task_uid],
        )
        .await?;
    Ok(row.map(|r| (r.get(0), r.get(1))))
}

/// Every commit to the task with UID `task_uid`, oldest first: (token, worker).
pub async fn audit(client: &Client, task_uid: &str) -> anyhow::Result<Vec<(i64, String)>> {
    Ok(audit_all(client, task_uid)
        .await?
        .into_iter()
        .filter(|(_, status, _)| status == "COMPLETED")
        .map(|(t, _, w)| (t, w))
        .collect())
}

/// Every write (registrations too), oldest first: (token, status, worker).
pub async fn audit_all(
    client: &Client,
    task_uid: &str,
) -> anyhow::Result<Vec<(i64, String, String)>> {
    let rows = client
        .query(
            "SELECT token, coalesce(status, ''), coalesce(worker, '') FROM task_state_audit
              WHERE task_id = $1 ORDER BY at",
            &[&task_uid],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect())
}

/// A PostgreSQL of the test's own that accepts TLS connections only
/// (`e2e/postgres/up.sh --tls`: ssl=on, a server certificate for
/// 127.0.0.1 signed by a test CA, `hostnossl … reject`), as managed
/// PostgreSQL services are. Stopped and deleted when dropped.
#[derive(Debug)]
pub struct TlsPostgres {
    dir: std::path::PathBuf,
    /// `postgres://batchlease@127.0.0.1:<port>/batchlease`, no TLS parameters.
    pub plain_url: String,
    /// The test CA's certificate (PEM), which signed the server's.
    pub ca: std::path::PathBuf,
}

impl TlsPostgres {
    /// Starts one (about 3 s: initdb, certificates, start).
    pub fn start() -> anyhow::Result<Self> {
        use anyhow::Context;
        let dir = std::env::temp_dir().join(format!(
            "batchlease-pg-tls-{}-{}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir)?;
        // PostgreSQL runs as an unprivileged user and must reach it.
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
        let script = crate::crate_dir().join("postgres/up.sh");
        let out = std::process::Command::new("bash")
            .arg(&script)
            .arg("--tls")
            .arg(dir.join("pg"))
            .output()
            .with_context(|| format!("running {}", script.display()))?;
        // From here on, Drop stops whatever was started.
        let mut pg = Self {
            dir,
            plain_url: String::new(),
            ca: Default::default(),
        };
        anyhow::ensure!(
            out.status.success(),
            "{} --tls failed: {}",
            script.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let env = std::fs::read_to_string(pg.dir.join("pg/env"))?;
        let var = |name: &str| {
            env.lines()
                .find_map(|l| l.strip_prefix(&format!("export {name}=")))
                .map(|v| v.trim_matches('\'').to_owned())
                .with_context(|| format!("{name} missing from up.sh's env file:\n{env}"))
        };
        pg.plain_url = var("BATCHLEASE_PG_PLAIN_URL")?;
        pg.ca = var("BATCHLEASE_PG_CA")?.into();
        Ok(pg)
    }

    /// The URL with `sslmode=verify-full&sslrootcert=<ca>`.
    pub fn verify_full_url(&self, ca: &std::path::Path) -> String {
        format!(
            "{}?sslmode=verify-full&sslrootcert={}",
            self.plain_url,
            ca.display()
        )
    }

    /// The server's log, for diagnostics.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("pg/postgres.log")).unwrap_or_default()
    }
}

impl Drop for TlsPostgres {
    fn drop(&mut self) {
        let _ = std::process::Command::new("bash")
            .arg(crate::crate_dir().join("postgres/down.sh"))
            .arg(self.dir.join("pg"))
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
