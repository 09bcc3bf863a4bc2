//! Speculative execution on PostgreSQL (design §6): [`VersionedStore`] for
//! [`FencedPool`].
//!
//! Keys live in `versioned_state` (`key`, `version`, `state`); a commit is
//! the task's fenced commit ([`FencedStore::commit_with`]) whose writes are
//! the compare-and-swap, in key order (the same order in every
//! transaction, so two commits never wait for each other in a cycle):
//!
//! ```sql
//! -- a key read at version v > 0 and written
//! UPDATE versioned_state SET state = $new, version = version + 1, …
//!  WHERE key = $k AND version = $v
//! -- a key read absent (v = 0) and written (a version-0 row is a placeholder)
//! INSERT INTO versioned_state … VALUES ($k, 1, $new, …)
//! ON CONFLICT (key) DO UPDATE SET version = 1, … WHERE versioned_state.version = 0
//! -- a key only read: still at v (locked until COMMIT); read absent, first
//! -- a placeholder row to lock (it waits for a concurrent insert of the key)
//! INSERT INTO versioned_state … VALUES ($k, 0, 'null') ON CONFLICT (key) DO NOTHING
//! SELECT version FROM versioned_state WHERE key = $k FOR SHARE
//! -- the round's compensations, kept: exactly the ones registered
//! UPDATE compensation_log SET status = 'KEPT' … WHERE (task, token, round) AND status = 'REGISTERED'
//! ```
//!
//! Zero rows where one was due is a lost swap: the whole transaction rolls
//! back, the task row included. The compensation log is written outside
//! the fenced transaction, one statement each: a zombie's undo actions must
//! be recorded (and run) whatever its fence says.

use futures::FutureExt;
use futures::future::BoxFuture;
use serde_json::Value;
use tokio_postgres::Transaction;
use tokio_postgres::types::Json;

use super::{FencedPool, Guarded, GuardedWrites, Stop};
use crate::error::Error;
use crate::fence::Fence;
use crate::speculate::{
    CommitOutcome, Conflict, LogEntry, Proposal, Ran, Snapshot, Versioned, VersionedStore,
};

// Version 0 rows are placeholders (see PLACEHOLDER): absent to readers.
const READ: &str =
    "SELECT key, version, state FROM versioned_state WHERE key = ANY($1) AND version > 0";
const UPDATE: &str = "UPDATE versioned_state SET state = $2, version = version + 1,
            task_id = $4, token = $5, updated_at = now()
      WHERE key = $1 AND version = $3";
const INSERT: &str = "INSERT INTO versioned_state (key, version, state, task_id, token)
     VALUES ($1, 1, $2, $3, $4)
     ON CONFLICT (key) DO UPDATE SET version = 1, state = EXCLUDED.state,
            task_id = EXCLUDED.task_id, token = EXCLUDED.token, updated_at = now()
      WHERE versioned_state.version = 0";
// A key read absent and not written must still be held until COMMIT: a
// missing row cannot be locked, and a concurrent transaction's uncommitted
// insert is invisible to `FOR SHARE`. Inserting a version-0 placeholder
// waits for such an insert (on the unique index) and gives the row to lock.
const PLACEHOLDER: &str = "INSERT INTO versioned_state (key, version, state)
     VALUES ($1, 0, 'null'::jsonb) ON CONFLICT (key) DO NOTHING";
const VERSION: &str = "SELECT version FROM versioned_state WHERE key = $1 FOR SHARE";
const KEEP: &str = "UPDATE compensation_log SET status = 'KEPT', finished_at = now()
      WHERE task_id = $1 AND token = $2 AND round = $3 AND status = 'REGISTERED'";
const LOG: &str = "INSERT INTO compensation_log (task_id, token, round, seq, name, status)
     VALUES ($1, $2, $3, $4, $5, 'REGISTERED') ON CONFLICT DO NOTHING";
const CLAIM: &str = "UPDATE compensation_log SET status = 'RUNNING'
      WHERE task_id = $1 AND token = $2 AND round = $3 AND seq = $4 AND status = 'REGISTERED'";
const RAN: &str = "UPDATE compensation_log SET status = $5, error = $6, finished_at = now()
      WHERE task_id = $1 AND token = $2 AND round = $3 AND seq = $4 AND status = 'RUNNING'";

fn pg(what: &'static str) -> impl Fn(tokio_postgres::Error) -> Error {
    move |source| Error::Postgres { what, source }
}

/// The compare-and-swap of every key of `snapshot`, then the round's
/// compensations kept; `Err(Stop)` at the first key that moved on.
struct Swap<'a> {
    task_uid: &'a str,
    token: i64,
    round: i32,
    registered: usize,
    snapshot: &'a Snapshot,
    proposal: &'a Proposal,
}

impl Guarded for Swap<'_> {
    fn run<'t>(self, tx: &'t Transaction<'t>) -> GuardedWrites<'t>
    where
        Self: 't,
    {
        Box::pin(swap(tx, self))
    }
}

async fn swap(
    tx: &Transaction<'_>,
    Swap {
        task_uid,
        token,
        round,
        registered,
        snapshot,
        proposal,
    }: Swap<'_>,
) -> Result<Result<(), Stop>, tokio_postgres::Error> {
    for (key, read) in snapshot.entries() {
        let rows = match proposal.writes().get(key) {
            Some(state) if read.version > 0 => {
                tx.execute(
                    UPDATE,
                    &[key, &Json(state), &read.version, &task_uid, &token],
                )
                .await?
            }
            Some(state) => {
                tx.execute(INSERT, &[key, &Json(state), &task_uid, &token])
                    .await?
            }
            None => {
                if read.version == 0 {
                    tx.execute(PLACEHOLDER, &[key]).await?;
                }
                let now: i64 = tx.query_opt(VERSION, &[key]).await?.map_or(0, |r| r.get(0));
                u64::from(now == read.version)
            }
        };
        if rows != 1 {
            let found: i64 = tx.query_opt(VERSION, &[key]).await?.map_or(0, |r| r.get(0));
            return Ok(Err(Stop::Conflict(Conflict {
                key: key.clone(),
                read: read.version,
                found,
            })));
        }
    }
    let kept = tx.execute(KEEP, &[&task_uid, &token, &round]).await?;
    if usize::try_from(kept).ok() != Some(registered) {
        return Ok(Err(Stop::CompensationClaimed));
    }
    Ok(Ok(()))
}

impl VersionedStore for FencedPool {
    fn read<'a>(&'a self, keys: &'a [String]) -> BoxFuture<'a, Result<Snapshot, Error>> {
        async move {
            let store = self.get().await?;
            let rows = store
                .client()
                .query(READ, &[&keys])
                .await
                .map_err(pg("versioned read"))?;
            let mut entries: std::collections::BTreeMap<String, Versioned> = keys
                .iter()
                .map(|k| {
                    (
                        k.clone(),
                        Versioned {
                            version: 0,
                            state: None,
                        },
                    )
                })
                .collect();
            for r in rows {
                let key: String = r.get(0);
                let state: Json<Value> = r.get(2);
                entries.insert(
                    key,
                    Versioned {
                        version: r.get(1),
                        state: Some(state.0),
                    },
                );
            }
            Ok(Snapshot::new(entries))
        }
        .boxed()
    }

    fn commit<'a>(
        &'a self,
        fence: &'a Fence,
        task_uid: &'a str,
        round: i32,
        registered: usize,
        snapshot: &'a Snapshot,
        proposal: &'a Proposal,
    ) -> BoxFuture<'a, Result<CommitOutcome, Error>> {
        async move {
            let token = fence.token();
            let mut store = self.get().await?;
            let stopped = store
                .commit_guarded(
                    fence,
                    task_uid,
                    proposal.result(),
                    Swap {
                        task_uid,
                        token,
                        round,
                        registered,
                        snapshot,
                        proposal,
                    },
                )
                .await?;
            match stopped {
                Ok(super::Committed::Written) => Ok(CommitOutcome::Committed),
                // The row carries our own commit already (an earlier call
                // of this attempt): the swap did not run now.
                Ok(super::Committed::AlreadyCommitted) => Err(Error::CommittedEarlier {
                    token,
                    earlier: token,
                }),
                Err(Stop::Conflict(c)) => Ok(CommitOutcome::Conflict(c)),
                Err(Stop::CompensationClaimed) => Err(Error::Revoked {
                    token,
                    reason: "compensation_claimed",
                }),
            }
        }
        .boxed()
    }

    fn log_registered<'a>(&'a self, e: &'a LogEntry) -> BoxFuture<'a, Result<(), Error>> {
        async move {
            let store = self.get().await?;
            let n = store
                .client()
                .execute(LOG, &[&e.task_uid, &e.token, &e.round, &e.seq, &e.name])
                .await
                .map_err(pg("compensation log"))?;
            if n != 1 {
                // An entry under this key exists: this one would never run.
                return Err(Error::Config("compensation log entry already exists"));
            }
            Ok(())
        }
        .boxed()
    }

    fn log_claim<'a>(&'a self, e: &'a LogEntry) -> BoxFuture<'a, Result<bool, Error>> {
        async move {
            let store = self.get().await?;
            let n = store
                .client()
                .execute(CLAIM, &[&e.task_uid, &e.token, &e.round, &e.seq])
                .await
                .map_err(pg("compensation claim"))?;
            Ok(n == 1)
        }
        .boxed()
    }

    fn log_ran<'a>(
        &'a self,
        e: &'a LogEntry,
        ran: Ran,
        error: Option<&'a str>,
    ) -> BoxFuture<'a, Result<(), Error>> {
        async move {
            let status = match ran {
                Ran::Ok => "RAN",
                Ran::Failed => "FAILED",
            };
            let store = self.get().await?;
            store
                .client()
                .execute(
                    RAN,
                    &[&e.task_uid, &e.token, &e.round, &e.seq, &status, &error],
                )
                .await
                .map_err(pg("compensation log"))?;
            Ok(())
        }
        .boxed()
    }
}
