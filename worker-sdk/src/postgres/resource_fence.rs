//! Resource tokens in PostgreSQL: one row per (namespace, resource) in
//! `resource_fence` (created by [`super::MIGRATION`]), carrying the last registered token of that resource's
//! lock (its `leaseTransitions`, design §5).
//!
//! The task row fences the attempts of one task against each other; a
//! resource row fences every task that ever held the resource: a zombie of
//! task A whose lock on "db" passed to task B is refused although B's row
//! in `task_state` is another row. The same three rules as for the task
//! row apply, in the same transactions:
//!
//! - **register** (with the task's registration): raise each row to our
//!   token if it is lower. An equal token registered by the same task is
//!   our own earlier registration; anything newer — or our token under
//!   another task (a reused token is not trusted) — is
//!   [`Error::ResourceFenced`](crate::Error::ResourceFenced).
//! - **lock** (in the commit, before the caller's writes): `SELECT … FOR
//!   UPDATE` the rows in resource order and refuse if one moved on. From
//!   here the caller's writes run while no newer holder can register.
//! - **stamp** (right before `COMMIT`): write our token and status
//!   `COMMITTED` into every row, only where it still carries our token (or
//!   a lower one, or none: an attempt that never registered, as the task
//!   row's commit allows), so an audit trigger sees when the occupancy
//!   ended.
//!
//! Rows are always written and locked in resource order (the order of the
//! operator's lock acquisition too), so two transactions never wait for
//! each other in a cycle. Every write carries the attempt's deadline, as
//! the task row's writes do.

use std::collections::BTreeMap;
use std::time::SystemTime;

use tokio_postgres::{Row, Transaction};

use crate::error::Error;
use crate::fence::Fence;

/// $1 namespace, $2 resources, $3 their tokens (same order), $4 task UID,
/// $5 deadline. Returns the resources written.
pub(super) const REGISTER: &str =
    "INSERT INTO resource_fence (namespace, resource, last_token, task_id, status, updated_at)
     SELECT $1, r.resource, r.token, $4, 'REGISTERED', now()
       FROM unnest($2::text[], $3::bigint[]) AS r(resource, token)
      WHERE clock_timestamp() < $5
      ORDER BY r.resource
     ON CONFLICT (namespace, resource) DO UPDATE SET last_token = EXCLUDED.last_token,
            task_id = EXCLUDED.task_id, status = 'REGISTERED', updated_at = now()
      WHERE resource_fence.last_token < EXCLUDED.last_token
     RETURNING resource";

/// Parameters as for [`REGISTER`]. Returns the resources written.
pub(super) const STAMP: &str =
    "INSERT INTO resource_fence (namespace, resource, last_token, task_id, status, updated_at)
     SELECT $1, r.resource, r.token, $4, 'COMMITTED', now()
       FROM unnest($2::text[], $3::bigint[]) AS r(resource, token)
      WHERE clock_timestamp() < $5
      ORDER BY r.resource
     ON CONFLICT (namespace, resource) DO UPDATE SET last_token = EXCLUDED.last_token,
            task_id = EXCLUDED.task_id, status = 'COMMITTED', updated_at = now()
      WHERE resource_fence.last_token < EXCLUDED.last_token
         OR (resource_fence.last_token = EXCLUDED.last_token
             AND resource_fence.task_id = EXCLUDED.task_id)
     RETURNING resource";

/// $1 namespace, $2 resources.
pub(super) const LOCK: &str = "SELECT resource, last_token, task_id FROM resource_fence
      WHERE namespace = $1 AND resource = ANY($2)
      ORDER BY resource FOR UPDATE";

/// $1 namespace, $2 resources.
const READ: &str = "SELECT resource, last_token, task_id FROM resource_fence
      WHERE namespace = $1 AND resource = ANY($2)";

/// One row of `resource_fence`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Stored {
    pub resource: String,
    pub last_token: i64,
    pub task_id: String,
}

impl Stored {
    fn of(row: &Row) -> Self {
        Self {
            resource: row.get(0),
            last_token: row.get(1),
            task_id: row.get(2),
        }
    }
}

/// Why a resource write was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Refusal {
    /// `resource` carries `current`: newer than ours, or ours under
    /// another task.
    Fenced {
        resource: String,
        token: i64,
        current: i64,
    },
    /// Nothing stands in the way but the deadline (the server's clock
    /// said the attempt's time was up).
    Late,
}

/// Which write left rows unwritten.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Step {
    Register,
    Stamp,
}

/// A row moved on from our token: held by a newer token, or by another
/// task under ours.
fn moved_on(row: &Stored, token: i64, task_id: &str) -> bool {
    row.last_token > token || (row.last_token == token && row.task_id != task_id)
}

fn fenced(row: &Stored, token: i64) -> Refusal {
    Refusal::Fenced {
        resource: row.resource.clone(),
        token,
        current: row.last_token,
    }
}

/// After the rows were locked: refuses if one of them moved on. A row
/// below our token (or none) is fine here; the stamp raises it.
pub(super) fn check_locked(
    tokens: &BTreeMap<String, i64>,
    task_id: &str,
    rows: &[Stored],
) -> Result<(), Refusal> {
    for row in rows {
        if let Some(&token) = tokens.get(&row.resource)
            && moved_on(row, token, task_id)
        {
            return Err(fenced(row, token));
        }
    }
    Ok(())
}

/// After `step` wrote the resources `written`: why the others were not.
/// A registration leaves our own earlier registration alone (equal token,
/// same task); otherwise an unwritten row that did not move on — or no row
/// at all — was stopped by the deadline.
pub(super) fn check_written(
    step: Step,
    tokens: &BTreeMap<String, i64>,
    task_id: &str,
    written: &[String],
    rows: &[Stored],
) -> Result<(), Refusal> {
    for (resource, &token) in tokens {
        if written.contains(resource) {
            continue;
        }
        let Some(row) = rows.iter().find(|r| &r.resource == resource) else {
            return Err(Refusal::Late);
        };
        if moved_on(row, token, task_id) {
            return Err(fenced(row, token));
        }
        if !(step == Step::Register && row.last_token == token) {
            return Err(Refusal::Late);
        }
    }
    Ok(())
}

/// The refusal as the SDK reports it.
pub(super) fn error_of(refusal: Refusal, late: Error) -> Error {
    match refusal {
        Refusal::Fenced {
            resource,
            token,
            current,
        } => Error::ResourceFenced {
            resource,
            token,
            current,
        },
        Refusal::Late => late,
    }
}

/// The fence's resources and tokens as statement parameters, in resource
/// order (a `BTreeMap` iterates sorted).
fn columns(fence: &Fence) -> (Vec<&str>, Vec<i64>) {
    fence
        .resource_tokens()
        .iter()
        .map(|(r, &t)| (r.as_str(), t))
        .unzip()
}

/// Runs `step`'s upsert for every resource of `fence` and checks that each
/// row carries our token afterwards. No-op without resources.
pub(super) async fn write(
    tx: &Transaction<'_>,
    step: Step,
    fence: &Fence,
    task_id: &str,
    until: SystemTime,
) -> Result<Result<(), Refusal>, tokio_postgres::Error> {
    if fence.resource_tokens().is_empty() {
        return Ok(Ok(()));
    }
    let namespace = fence.resource_namespace();
    let (resources, tokens) = columns(fence);
    let sql = match step {
        Step::Register => REGISTER,
        Step::Stamp => STAMP,
    };
    let written: Vec<String> = tx
        .query(sql, &[&namespace, &resources, &tokens, &task_id, &until])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    if written.len() == resources.len() {
        return Ok(Ok(()));
    }
    let rows: Vec<Stored> = tx
        .query(READ, &[&namespace, &resources])
        .await?
        .iter()
        .map(Stored::of)
        .collect();
    Ok(check_written(
        step,
        fence.resource_tokens(),
        task_id,
        &written,
        &rows,
    ))
}

/// Locks the rows of `fence`'s resources (in resource order) and checks
/// that none moved on. No-op without resources.
pub(super) async fn lock(
    tx: &Transaction<'_>,
    fence: &Fence,
    task_id: &str,
) -> Result<Result<(), Refusal>, tokio_postgres::Error> {
    if fence.resource_tokens().is_empty() {
        return Ok(Ok(()));
    }
    let (resources, _) = columns(fence);
    let rows: Vec<Stored> = tx
        .query(LOCK, &[&fence.resource_namespace(), &resources])
        .await?
        .iter()
        .map(Stored::of)
        .collect();
    Ok(check_locked(fence.resource_tokens(), task_id, &rows))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(resource: &str, last_token: i64, task_id: &str) -> Stored {
        Stored {
            resource: resource.into(),
            last_token,
            task_id: task_id.into(),
        }
    }

    fn tokens(pairs: &[(&str, i64)]) -> BTreeMap<String, i64> {
        pairs.iter().map(|(r, t)| ((*r).to_owned(), *t)).collect()
    }

    fn fenced_on(resource: &str, token: i64, current: i64) -> Result<(), Refusal> {
        Err(Refusal::Fenced {
            resource: resource.into(),
            token,
            current,
        })
    }

    #[test]
    fn unwritten_rows_are_ours_fenced_or_late() {
        let ours = tokens(&[("a", 5), ("b", 7)]);
        type Case<'a> = (
            &'a str,
            Step,
            &'a [&'a str],
            Vec<Stored>,
            Result<(), Refusal>,
        );
        let cases: Vec<Case<'_>> = vec![
            ("all written", Step::Register, &["a", "b"], vec![], Ok(())),
            (
                "our own earlier registration",
                Step::Register,
                &["a"],
                vec![row("a", 5, "me"), row("b", 7, "me")],
                Ok(()),
            ),
            (
                "a newer holder registered",
                Step::Register,
                &["a"],
                vec![row("a", 5, "me"), row("b", 8, "other")],
                fenced_on("b", 7, 8),
            ),
            (
                "our token under another task",
                Step::Register,
                &["b"],
                vec![row("a", 5, "other"), row("b", 7, "me")],
                fenced_on("a", 5, 5),
            ),
            (
                "no row: the deadline stopped the insert",
                Step::Register,
                &[],
                vec![],
                Err(Refusal::Late),
            ),
            (
                "a lower row left alone: the deadline",
                Step::Register,
                &["a"],
                vec![row("b", 6, "other")],
                Err(Refusal::Late),
            ),
            (
                "a newer holder before our stamp",
                Step::Stamp,
                &["a"],
                vec![row("b", 9, "other")],
                fenced_on("b", 7, 9),
            ),
            (
                "an equal row not stamped: the deadline",
                Step::Stamp,
                &["a"],
                vec![row("b", 7, "me")],
                Err(Refusal::Late),
            ),
        ];
        for (what, step, written, rows, want) in cases {
            let written: Vec<String> = written.iter().map(|s| (*s).to_owned()).collect();
            assert_eq!(
                check_written(step, &ours, "me", &written, &rows),
                want,
                "{what}"
            );
        }
    }

    #[test]
    fn locked_rows_must_not_have_moved_on() {
        let ours = tokens(&[("a", 5), ("b", 7)]);
        let cases: Vec<(&str, Vec<Stored>, Result<(), Refusal>)> = vec![
            ("ours", vec![row("a", 5, "me"), row("b", 7, "me")], Ok(())),
            (
                "lower or missing: the stamp raises them",
                vec![row("a", 4, "x")],
                Ok(()),
            ),
            (
                "newer",
                vec![row("a", 5, "me"), row("b", 8, "x")],
                fenced_on("b", 7, 8),
            ),
            (
                "ours under another task",
                vec![row("a", 5, "x")],
                fenced_on("a", 5, 5),
            ),
            ("not one of ours", vec![row("z", 99, "x")], Ok(())),
        ];
        for (what, rows, want) in cases {
            assert_eq!(check_locked(&ours, "me", &rows), want, "{what}");
        }
    }

    #[test]
    fn statements_are_parameterised_and_ordered() {
        // Values are never spliced into SQL, and rows are written and
        // locked in resource order (no lock-order cycles).
        for sql in [REGISTER, STAMP] {
            assert!(sql.contains("unnest($2::text[], $3::bigint[])"), "{sql}");
            assert!(sql.contains("ORDER BY r.resource"), "{sql}");
            assert!(sql.contains("clock_timestamp() < $5"), "{sql}");
        }
        assert!(LOCK.contains("ORDER BY resource FOR UPDATE"));
        assert!(REGISTER.contains("WHERE resource_fence.last_token < EXCLUDED.last_token\n"));
        assert!(STAMP.contains("'COMMITTED'") && REGISTER.contains("'REGISTERED'"));
    }
}
