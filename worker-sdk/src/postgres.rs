//! The fenced PostgreSQL store (design §4).
//!
//! One row per task, keyed by the task's **UID**. Two fenced writes:
//!
//! - **Registration** (before the handler runs, see [`crate::Registry`]):
//!   raises `last_fencing_token` to the attempt's token, if it is higher.
//!   From then on every write of an older attempt is refused, however late
//!   it arrives. A check of the fence before a commit is not enough on its
//!   own: a holder paused between its check and its write would land after
//!   its successor claimed but before the successor wrote anything.
//! - **Commit**: sets the result, only while the row carries no newer token
//!   and no attempt has committed yet — at most one attempt's effect sticks
//!   per task. The caller's own writes share the transaction; the fence is
//!   checked again right before `COMMIT`; `statement_timeout`,
//!   `lock_timeout` and `idle_in_transaction_session_timeout` keep a paused
//!   holder of the row lock from blocking its successor for long.
//! - Both writes carry the attempt's deadline and the server refuses them
//!   past it (`clock_timestamp() < deadline`): a write whose packets sat in
//!   the network until its lease could have expired is refused by the
//!   database's clock too. The deadline is the kill-switch instant put on
//!   the **server's** clock, never the worker's wall clock: the transaction
//!   opens by reading `clock_timestamp()`, and the deadline is that reading
//!   plus the kill clock's time left *after* the answer arrived (the server
//!   read its clock at some point before, so the deadline is at most the
//!   server's time at the kill instant), less a margin. A worker whose
//!   wall clock is minutes behind or ahead of the database's registers and
//!   commits like any other; the one assumption left is that the two
//!   clocks run at the same *rate* within the margin over one attempt.
//!
//! ```sql
//! -- register (T = our token)
//! INSERT INTO task_state (task_id, status, last_fencing_token) VALUES ($1, 'RUNNING', T)
//! ON CONFLICT (task_id) DO UPDATE SET last_fencing_token = T, …
//!  WHERE task_state.last_fencing_token < T
//! -- commit
//! … SET status = 'COMPLETED', payload = $3, committed_token = T, last_fencing_token = T
//!  WHERE task_state.last_fencing_token <= T AND task_state.committed_token IS NULL
//! ```
//!
//! Each write is one transaction on one connection, and its `SET LOCAL`
//! limits end with it, so no state is carried from one write to the next on
//! a connection: [`FencedPool`] hands its connections to concurrent slots
//! with the same guarantees as one [`FencedStore`] per slot.
//!
//! A refused commit is typed: [`Error::Fenced`] (a newer attempt
//! registered: we are a zombie), [`Error::CommittedEarlier`] (an earlier
//! attempt's commit stuck: the work is done), or — when the row already
//! carries *our* commit — success if the payload is the same (our own
//! commit whose acknowledgement was lost) and [`Error::PayloadMismatch`]
//! otherwise.
//!
//! **Resource locks.** An attempt of a task with `spec.resources` carries,
//! in its fence, each lock's own fencing token ([`Fence::resource_tokens`]).
//! They are fenced in `resource_fence`, one row per (namespace, resource),
//! in the same transactions as the task row: registration raises each
//! resource row to our token (an equal token of the same task is our own
//! earlier registration; a newer one is [`Error::ResourceFenced`], naming
//! the resource); a commit locks
//! the rows (`SELECT … FOR UPDATE`, in resource order) before the caller's
//! writes, so no newer holder can register while they run, and right
//! before `COMMIT` stamps them `COMMITTED` where they still carry our
//! token — else the whole commit rolls back as fenced. The stamp is the
//! end of the attempt's occupancy of the resource as an audit trigger sees
//! it (`REGISTERED` → `COMMITTED` per token).
//!
//! ```sql
//! -- register, per resource R with token t (same transaction as the task row)
//! INSERT INTO resource_fence … VALUES (ns, R, t, task, 'REGISTERED')
//! ON CONFLICT (namespace, resource) DO UPDATE SET last_token = t, …
//!  WHERE resource_fence.last_token < t
//! -- commit: before the caller's writes, then right before COMMIT
//! SELECT … FROM resource_fence WHERE namespace = ns AND resource = ANY(Rs)
//!  ORDER BY resource FOR UPDATE
//! INSERT … 'COMMITTED' ON CONFLICT … DO UPDATE SET status = 'COMMITTED', …
//!  WHERE last_token < t OR (last_token = t AND task_id = task)
//! ```

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::FutureExt;
use futures::future::BoxFuture;
use serde_json::Value;
use tokio_postgres::types::Json;
use tokio_postgres::{Client, SimpleQueryMessage, Transaction};

use crate::error::Error;
use crate::fence::Fence;
use crate::metrics::WorkerMetrics;
use crate::registry::{EarlierCommit, Registry};

mod connect;
mod extender;
mod io_runtime;
mod pool;
mod resource_fence;
mod tls_verify;
mod versioned;

pub use connect::{ConnectError, ConnectOptions, SslMode};
pub use extender::spawn_extender;
pub use pool::{FencedPool, PooledStore};

use resource_fence::Step;

/// The tables the store writes (`task_state`, `resource_fence` for
/// resource tokens, and for speculative execution `versioned_state` and
/// `compensation_log`) and the SQL functions of the fence
/// (`postgres/fence.sql`: `batchlease_register`, `batchlease_fence`,
/// `batchlease_extend`, `batchlease_commit`), which this store calls and
/// any other client can call in its own transactions; create (or upgrade)
/// them with [`migrate`].
pub const MIGRATION: &str = concat!(
    "CREATE TABLE IF NOT EXISTS task_state (
    task_id            text PRIMARY KEY,
    status             text NOT NULL,
    payload            jsonb,
    last_fencing_token bigint NOT NULL,
    committed_token    bigint,
    updated_at         timestamptz NOT NULL DEFAULT now()
);
-- A table of an older version: only then (ALTER TABLE locks the table
-- exclusively even when the column exists, behind every open transaction).
DO $do$
BEGIN
  IF NOT EXISTS (SELECT 1 FROM information_schema.columns
                  WHERE table_schema = current_schema() AND table_name = 'task_state'
                    AND column_name = 'committed_token') THEN
    ALTER TABLE task_state ADD COLUMN committed_token bigint;
    UPDATE task_state SET committed_token = last_fencing_token WHERE status = 'COMPLETED';
  END IF;
END
$do$;
CREATE TABLE IF NOT EXISTS resource_fence (
    namespace  text NOT NULL,
    resource   text NOT NULL,
    last_token bigint NOT NULL,
    task_id    text NOT NULL,
    status     text NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (namespace, resource)
);
CREATE TABLE IF NOT EXISTS versioned_state (
    key        text PRIMARY KEY,
    version    bigint NOT NULL,
    state      jsonb NOT NULL,
    task_id    text,
    token      bigint,
    updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS compensation_log (
    task_id       text NOT NULL,
    token         bigint NOT NULL,
    round         integer NOT NULL,
    seq           integer NOT NULL,
    name          text NOT NULL,
    status        text NOT NULL,
    error         text,
    registered_at timestamptz NOT NULL DEFAULT now(),
    finished_at   timestamptz,
    PRIMARY KEY (task_id, token, round, seq)
);
",
    include_str!("postgres/fence.sql")
);

// The fence's rules live in the SQL functions of `postgres/fence.sql`
// (one implementation for this store and for any client's own
// transactions). Both writes carry the attempt's deadline ($3/$4, on the
// server's clock) and its TTL in milliseconds: a write whose packets sat
// in the network until after the lease could have expired is refused by
// the server's clock, not only by the worker's — at the statement, and
// at COMMIT (the functions arm a deferred check).
const REGISTER: &str = "SELECT committed_token, payload FROM batchlease_register($1, $2, $3, $4)";

const COMMIT: &str = "SELECT batchlease_commit($1, $2, $3, $4, $5)";

const EXTEND: &str = "SELECT batchlease_extend($1, $2, $3)";

const READ: &str =
    "SELECT last_fencing_token, committed_token, payload FROM task_state WHERE task_id = $1";

/// Creates the `task_state` and `resource_fence` tables if they do not
/// exist (and adds the `committed_token` column to a table of an older
/// version). Safe to run from many workers at once: see
/// [`migrate_serialized`].
pub async fn migrate(client: &Client) -> Result<(), Error> {
    migrate_serialized(client, MIGRATION).await
}

/// The advisory lock key that serializes migrations (any 64-bit number no
/// other user of the database takes; "batchlse" in ASCII).
pub const MIGRATION_LOCK: i64 = 0x6261_7463_686c_7365;

/// Runs `sql` (DDL such as `CREATE TABLE IF NOT EXISTS …`) in one
/// transaction that first takes the advisory lock [`MIGRATION_LOCK`].
///
/// Why: `IF NOT EXISTS` is no guard against a concurrent creator.
/// Two sessions that both find the table missing both insert its catalog
/// rows, and the later one fails on a unique index of the catalog
/// (`pg_type_typname_nsp_index`) — what the replicas of a worker
/// Deployment do on their first start against an empty database. Under
/// the lock the second migration starts after the first committed and
/// finds everything there.
pub async fn migrate_serialized(client: &Client, sql: &str) -> Result<(), Error> {
    client
        .batch_execute(&format!(
            // Quiet: every start would log a NOTICE per existing table.
            "BEGIN; SET LOCAL client_min_messages = warning; \
             SELECT pg_advisory_xact_lock({MIGRATION_LOCK}); {sql}; COMMIT"
        ))
        .await
        .map_err(|source| Error::Postgres {
            what: "migration",
            source,
        })
}

/// What a commit did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Committed {
    /// The row now carries our result.
    Written,
    /// The row already carried our result: an earlier commit of ours whose
    /// acknowledgement was lost. Nothing was written again.
    AlreadyCommitted,
}

/// The future of the caller's writes that share the fenced transaction.
pub type Writes<'t> = Pin<Box<dyn Future<Output = Result<(), tokio_postgres::Error>> + Send + 't>>;

/// A PostgreSQL connection that writes only under a valid fence.
#[derive(Debug)]
pub struct FencedStore {
    client: Client,
    metrics: WorkerMetrics,
    skew: Duration,
}

/// The attempt's deadline on the database server's clock: the server's
/// reading of `clock_timestamp()` (`server_now_micros`, microseconds since
/// the Unix epoch) plus the kill clock's time left as measured once the
/// reading had arrived, less `margin`. The server read its clock before we
/// got the answer, so the kill instant is at least `time_left` after the
/// reading on the server's clock too: the deadline never lies past it,
/// whatever this host's wall clock says.
fn server_deadline(server_now_micros: i64, time_left: Duration, margin: Duration) -> SystemTime {
    let server_now = match u64::try_from(server_now_micros) {
        Ok(us) => UNIX_EPOCH + Duration::from_micros(us),
        // A server clock before 1970 is no clock to trust: a deadline
        // already past refuses the write.
        Err(_) => UNIX_EPOCH,
    };
    server_now + time_left.saturating_sub(margin)
}

/// The server's `clock_timestamp()` in microseconds since the Unix epoch,
/// as text (a simple query answers in text, whatever the session's
/// DateStyle or TimeZone).
const SERVER_CLOCK: &str = "SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint";

/// Session limits of one fenced transaction, from the fence's clock: no
/// statement outlives the attempt, a waiting successor gives up after a
/// third of the TTL, and a holder paused inside its transaction loses its
/// session (and so the row lock) after a sixth of it — before its lease
/// could expire.
fn limits(fence: &Fence) -> String {
    let ms = |d: Duration| d.as_millis().max(1);
    let ttl = fence.ttl();
    format!(
        "SET LOCAL statement_timeout = {}; SET LOCAL lock_timeout = {}; \
         SET LOCAL idle_in_transaction_session_timeout = {}",
        ms(fence.time_left()),
        ms(ttl / 3),
        ms(ttl / 6),
    )
}

/// Counts a refused write (by the fence, or by the storage) and passes the
/// error on.
fn refused(metrics: &WorkerMetrics, e: Error) -> Error {
    if matches!(
        e,
        Error::Revoked { .. } | Error::Fenced { .. } | Error::ResourceFenced { .. }
    ) {
        metrics.fenced_commit_rejected.inc();
    }
    if matches!(e, Error::Fenced { .. } | Error::ResourceFenced { .. }) {
        metrics.refused_by_storage.inc();
    }
    e
}

/// Checks the fence (a revoked attempt must not even try), begins a
/// transaction with the session limits of [`limits`], and returns it with
/// the deadline its statements carry, on the server's clock
/// ([`server_deadline`]; the limits and the clock reading share one round
/// trip).
async fn begin_fenced<'c>(
    client: &'c mut Client,
    metrics: &WorkerMetrics,
    fence: &Fence,
    margin: Duration,
) -> Result<(Transaction<'c>, SystemTime), Error> {
    fence.check().map_err(|e| refused(metrics, e))?;
    let pg = |what| move |source| Error::Postgres { what, source };
    let tx = client.transaction().await.map_err(pg("begin"))?;
    let answer = tx
        .simple_query(&format!("{}; {SERVER_CLOCK}", limits(fence)))
        .await
        .map_err(pg("session limits"))?;
    // Measured after the answer arrived: the conservative side.
    let time_left = fence.time_left();
    let server_now = answer
        .iter()
        .find_map(|m| match m {
            SimpleQueryMessage::Row(row) => row.get(0).and_then(|v| v.parse::<i64>().ok()),
            _ => None,
        })
        .ok_or(Error::Config(
            "the database did not answer its clock reading",
        ))?;
    Ok((tx, server_deadline(server_now, time_left, margin)))
}

/// Default margin taken off each write's deadline: the worker's and the
/// database's clocks may run at slightly different rates (or the server's
/// be stepped) during an attempt. Their offset does not matter (see
/// [`server_deadline`]).
pub const DEFAULT_CLOCK_SKEW: Duration = Duration::from_millis(500);

/// The server's clock said the attempt's deadline had passed.
fn late(token: i64) -> Error {
    Error::Revoked {
        token,
        reason: "deadline_passed_at_storage",
    }
}

/// A refusal the fence's SQL functions raised (their SQLSTATEs, class
/// `LF`: see `postgres/fence.sql`), as the store's typed error; `None` for
/// any other database error.
fn fence_refusal(e: &tokio_postgres::Error, token: i64) -> Option<Error> {
    let db = e.as_db_error()?;
    let current = || db.detail().and_then(|d| d.parse::<i64>().ok());
    match db.code().code() {
        "LF001" => Some(Error::Fenced {
            token,
            // A newer token raised it: at least one more than ours.
            current: current().unwrap_or(token + 1),
        }),
        "LF002" => Some(late(token)),
        "LF003" => Some(Error::Revoked {
            token,
            reason: "not_registered_at_storage",
        }),
        _ => None,
    }
}

/// A failed statement of a fenced write: the fence's refusal, typed and
/// counted, or [`Error::Postgres`] naming the step.
fn failed<'m>(
    metrics: &'m WorkerMetrics,
    token: i64,
    what: &'static str,
) -> impl FnOnce(tokio_postgres::Error) -> Error + 'm {
    move |source| match fence_refusal(&source, token) {
        Some(e) => refused(metrics, e),
        None => Error::Postgres { what, source },
    }
}

/// The attempt's TTL in milliseconds, as the fence's SQL functions take it.
fn ttl_ms(fence: &Fence) -> i64 {
    i64::try_from(fence.ttl().as_millis()).unwrap_or(i64::MAX)
}

impl FencedStore {
    /// Wraps a connected client. `metrics` counts rejected commits.
    pub fn new(client: Client, metrics: WorkerMetrics) -> Self {
        Self {
            client,
            metrics,
            skew: DEFAULT_CLOCK_SKEW,
        }
    }

    /// The margin taken off each write's deadline (default 500 ms): writes
    /// must reach the server that long before the attempt's kill instant,
    /// as the server's clock counts it. The deadline is put on the
    /// server's clock by reading it in the same transaction, so the offset
    /// between this host's wall clock and the server's does not count; the
    /// margin covers clocks that run at different rates (or a step of the
    /// server's clock) within one attempt.
    #[must_use]
    pub fn with_clock_skew(mut self, skew: Duration) -> Self {
        self.skew = skew;
        self
    }

    /// The underlying client (for reads).
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Registers `fence`'s token for task `task_uid` (design §4), and its
    /// resource tokens in the same transaction. Returns the commit of an
    /// earlier attempt if one stuck; [`Error::Fenced`] if a newer attempt
    /// registered first, [`Error::ResourceFenced`] if a newer holder of one
    /// of the resources did (nothing is registered then). Registering twice
    /// is harmless.
    pub async fn register(
        &mut self,
        fence: &Fence,
        task_uid: &str,
    ) -> Result<Option<EarlierCommit>, Error> {
        let token = fence.token();
        let pg = |what| move |source| Error::Postgres { what, source };
        let (tx, until) = begin_fenced(&mut self.client, &self.metrics, fence, self.skew).await?;
        // Raises (typed by `failed`) if a newer attempt registered or the
        // deadline passed; returns the commit that stuck, if any.
        let row = tx
            .query_one(REGISTER, &[&task_uid, &token, &until, &ttl_ms(fence)])
            .await
            .map_err(failed(&self.metrics, token, "register"))?;
        let committed: Option<i64> = row.get(0);
        let payload: Option<Json<Value>> = row.get(1);
        let earlier = committed.map(|token| EarlierCommit {
            token,
            payload: payload.map(|p| p.0),
        });
        let resources = resource_fence::write(&tx, Step::Register, fence, task_uid, until)
            .await
            .map_err(pg("resource register"))?;
        if let Err(refusal) = resources {
            let _ = tx.rollback().await;
            let e = resource_fence::error_of(refusal, late(token));
            return Err(refused(&self.metrics, e));
        }
        tx.commit().await.map_err(pg("commit"))?;
        Ok(earlier)
    }

    /// Moves the attempt's deadline recorded in the task's row forward to
    /// `fence`'s kill instant (on the server's clock, as every write
    /// puts it): call it after each renewal while a client of its own —
    /// a shell command's `psql`, a Python handler — fences its writes with
    /// `batchlease_fence(task_uid, token)`, which checks that recorded
    /// deadline. [`Error::Fenced`] if a newer attempt registered,
    /// [`Error::Revoked`] if this one never did or its deadline passed,
    /// [`Error::Postgres`] if the attempt's own client held the task's row
    /// longer than a short lock wait (try again later).
    pub async fn extend(&mut self, fence: &Fence, task_uid: &str) -> Result<(), Error> {
        let token = fence.token();
        let (tx, until) = begin_fenced(&mut self.client, &self.metrics, fence, self.skew).await?;
        // Typed, but not counted as refused commits: an extend is none.
        let typed = |what| {
            move |source: tokio_postgres::Error| {
                fence_refusal(&source, token).unwrap_or(Error::Postgres { what, source })
            }
        };
        tx.execute(EXTEND, &[&task_uid, &token, &until])
            .await
            .map_err(typed("extend"))?;
        tx.commit().await.map_err(typed("commit"))?;
        Ok(())
    }

    /// Commits `payload` for task `task_uid` under `fence`.
    pub async fn commit(
        &mut self,
        fence: &Fence,
        task_uid: &str,
        payload: &Value,
    ) -> Result<Committed, Error> {
        self.commit_with(fence, task_uid, payload, |_| Box::pin(async { Ok(()) }))
            .await
    }

    /// Commits `payload` and runs `writes` in the same transaction, after the
    /// fence let us through (the fenced row stays locked until commit); the
    /// fence is checked once more right before `COMMIT`.
    ///
    /// With resource tokens in the fence, `writes` run while the resource
    /// rows are locked and checked to carry our tokens, and the rows are
    /// stamped `COMMITTED` right before `COMMIT` (refused: everything rolls
    /// back, [`Error::ResourceFenced`]). So writes to data guarded by a
    /// resource are fenced by its lock just by running here. To fence rows
    /// of your own by a resource's token as well (the classic fencing-token
    /// column), write [`Fence::resource_token`] with them:
    ///
    /// ```no_run
    /// # async fn f(db: &mut batchlease_worker_sdk::postgres::FencedStore,
    /// #            fence: &batchlease_worker_sdk::Fence) -> Result<(), batchlease_worker_sdk::Error> {
    /// let token = fence.resource_token("ledger").unwrap_or_default();
    /// db.commit_with(fence, "task-uid", &serde_json::json!({"ok": true}), move |tx| {
    ///     Box::pin(async move {
    ///         tx.execute(
    ///             "UPDATE ledger SET balance = balance - 10, fence = $1 WHERE id = 7 AND fence <= $1",
    ///             &[&token],
    ///         )
    ///         .await?;
    ///         Ok(())
    ///     })
    /// })
    /// .await?;
    /// # Ok(()) }
    /// ```
    pub async fn commit_with<W>(
        &mut self,
        fence: &Fence,
        task_uid: &str,
        payload: &Value,
        writes: W,
    ) -> Result<Committed, Error>
    where
        W: for<'t> FnOnce(&'t Transaction<'t>) -> Writes<'t>,
    {
        match self
            .commit_guarded(fence, task_uid, payload, Plain(writes))
            .await?
        {
            Ok(c) => Ok(c),
            // The caller's writes never stop the commit.
            Err(_) => Err(Error::Config("unreachable: plain writes stopped a commit")),
        }
    }

    /// [`Self::commit_with`] whose writes may stop the commit (a lost
    /// compare-and-swap): everything rolls back and the reason is returned.
    pub(crate) async fn commit_guarded<W: Guarded>(
        &mut self,
        fence: &Fence,
        task_uid: &str,
        payload: &Value,
        writes: W,
    ) -> Result<Result<Committed, Stop>, Error> {
        let token = fence.token();
        let pg = |what| move |source| Error::Postgres { what, source };
        let (tx, until) = begin_fenced(&mut self.client, &self.metrics, fence, self.skew).await?;
        let written: bool = tx
            .query_one(
                COMMIT,
                &[&task_uid, &token, &Json(payload), &until, &ttl_ms(fence)],
            )
            .await
            .map_err(failed(&self.metrics, token, "fenced upsert"))?
            .get(0);
        if !written {
            let r = tx
                .query_opt(READ, &[&task_uid])
                .await
                .map_err(pg("fence read"))?;
            let _ = tx.rollback().await;
            let Some(r) = r else {
                return Err(refused(&self.metrics, late(token)));
            };
            let current: i64 = r.get(0);
            let committed: Option<i64> = r.get(1);
            let stored: Option<Json<Value>> = r.get(2);
            return match committed {
                None if current <= token => Err(refused(&self.metrics, late(token))),
                _ if current > token => {
                    Err(refused(&self.metrics, Error::Fenced { token, current }))
                }
                Some(c) if c == token => {
                    if stored.map(|j| j.0).as_ref() == Some(payload) {
                        Ok(Ok(Committed::AlreadyCommitted))
                    } else {
                        Err(Error::PayloadMismatch { token })
                    }
                }
                Some(c) => Err(Error::CommittedEarlier { token, earlier: c }),
                None => Err(refused(&self.metrics, Error::Fenced { token, current })),
            };
        }
        // The caller's writes run under the resource rows' locks: no newer
        // holder of a resource registers until we commit or roll back.
        let locked = resource_fence::lock(&tx, fence, task_uid)
            .await
            .map_err(pg("resource lock"))?;
        if let Err(refusal) = locked {
            let _ = tx.rollback().await;
            let e = resource_fence::error_of(refusal, late(token));
            return Err(refused(&self.metrics, e));
        }
        match writes.run(&tx).await {
            Ok(Ok(())) => {}
            Ok(Err(stop)) => {
                let _ = tx.rollback().await;
                return Ok(Err(stop));
            }
            Err(source) => {
                let _ = tx.rollback().await;
                return Err(Error::Postgres {
                    what: "user writes",
                    source,
                });
            }
        }
        // Right before COMMIT: the occupancy of each resource ends here.
        let stamped = resource_fence::write(&tx, Step::Stamp, fence, task_uid, until)
            .await
            .map_err(pg("resource stamp"))?;
        if let Err(refusal) = stamped {
            let _ = tx.rollback().await;
            let e = resource_fence::error_of(refusal, late(token));
            return Err(refused(&self.metrics, e));
        }
        // The last word before COMMIT; the server checks the deadline once
        // more at COMMIT (LF002: the transaction rolled back).
        if let Err(e) = fence.check() {
            let _ = tx.rollback().await;
            return Err(refused(&self.metrics, e));
        }
        tx.commit()
            .await
            .map_err(failed(&self.metrics, token, "commit"))?;
        Ok(Ok(Committed::Written))
    }
}

/// Why guarded writes stopped a commit (everything rolled back).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Stop {
    /// A compare-and-swap found another version.
    Conflict(crate::speculate::Conflict),
    /// A compensation of the round was claimed to run: the round must not
    /// commit.
    CompensationClaimed,
}

/// The future of writes that may stop the commit.
pub(crate) type GuardedWrites<'t> =
    Pin<Box<dyn Future<Output = Result<Result<(), Stop>, tokio_postgres::Error>> + Send + 't>>;

/// Writes inside a fenced commit that may stop it.
pub(crate) trait Guarded {
    fn run<'t>(self, tx: &'t Transaction<'t>) -> GuardedWrites<'t>
    where
        Self: 't;
}

/// The caller's writes of [`FencedStore::commit_with`]: they never stop it.
struct Plain<W>(W);

impl<W> Guarded for Plain<W>
where
    W: for<'t> FnOnce(&'t Transaction<'t>) -> Writes<'t>,
{
    fn run<'t>(self, tx: &'t Transaction<'t>) -> GuardedWrites<'t>
    where
        Self: 't,
    {
        let w = (self.0)(tx);
        Box::pin(async move { w.await.map(|()| Ok(())) })
    }
}

/// A shared store registers each attempt (see [`crate::WorkerBuilder::registry`]).
impl Registry for tokio::sync::Mutex<FencedStore> {
    fn register<'a>(
        &'a self,
        task_uid: &'a str,
        fence: &'a Fence,
    ) -> BoxFuture<'a, Result<Option<EarlierCommit>, Error>> {
        async move { self.lock().await.register(fence, task_uid).await }.boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: i64 = 1_000_000;

    /// The deadline is the server's reading plus the time left: this
    /// host's wall clock plays no part, so a worker minutes behind or
    /// ahead of the database gets the same deadline.
    #[test]
    fn the_deadline_is_on_the_servers_clock() {
        let server_now = 1_800_000_000 * SECOND;
        let cases = [
            // (time left, margin, deadline after the server's reading)
            (
                Duration::from_secs(4),
                Duration::from_millis(500),
                Duration::from_millis(3500),
            ),
            (
                Duration::from_secs(4),
                Duration::ZERO,
                Duration::from_secs(4),
            ),
            // Less left than the margin: already due.
            (
                Duration::from_millis(300),
                Duration::from_millis(500),
                Duration::ZERO,
            ),
            (Duration::ZERO, Duration::ZERO, Duration::ZERO),
        ];
        for (left, margin, after) in cases {
            let d = server_deadline(server_now, left, margin);
            let reading = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
            assert_eq!(d, reading + after, "left {left:?} margin {margin:?}");
        }
    }

    #[test]
    fn a_server_clock_before_the_epoch_gives_a_deadline_already_past() {
        let d = server_deadline(-5 * SECOND, Duration::from_secs(10), Duration::ZERO);
        assert_eq!(d, UNIX_EPOCH + Duration::from_secs(10));
        assert!(d < SystemTime::now());
    }
}
