//! Speculative execution (design §6): run without locks, commit with a
//! compare-and-swap on versions, undo side effects when the swap is lost.
//!
//! One round: read a versioned [`Snapshot`] of the keys the work touches,
//! run the caller's body on it — it may register [`Compensations`], undo
//! actions for side effects outside the store — then commit the proposal
//! through a [`VersionedStore`]: in **one** transaction, the task's fenced
//! commit (design §4) and, for every key read, `version` still equal to
//! the one read (written keys get the new state and `version + 1`). A
//! zombie can therefore neither win the swap (its fenced commit is refused
//! and everything rolls back) nor commit after its lease ended.
//!
//! A lost swap runs the round's compensations last-registered first, each
//! once, and ends the attempt `Aborted`: the operator retries it with
//! backoff without spending `maxRetries` and, after `maxSpeculativeAborts`,
//! runs it `Exclusive` — the quarantine, which holds the task's resource
//! locks so no new speculative attempt on them is issued. In that mode the
//! executor retries a lost swap in place (attempts issued before the locks
//! were taken can still win once each).
//!
//! **Compensation log.** Every compensation is written to the store's log
//! before the body gets on with its side effect, and each one is claimed
//! (`REGISTERED` → `RUNNING`) before it runs and recorded `RAN` or
//! `FAILED` after; the commit marks its round's entries `KEPT` in the same
//! transaction, and only if none was claimed. So a compensation runs at
//! most once, never for a round that committed, and one that never ran is
//! visible in the log. When the attempt is dropped mid-way (the kill
//! switch fired, the worker drained), the pending compensations are handed
//! to a background task that runs them to the end: a zombie's side
//! effects are undone whole, not half. A failed compensation is counted
//! and reported (the attempt fails retryably with reason
//! `CompensationFailed`), never dropped silently.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use crate::error::{Error, TaskError};
use crate::fence::Fence;
use crate::metrics::{OutcomeLabels, WorkerMetrics};
use crate::registry::EarlierCommit;

pub mod memory;

/// A key's value as read. Version 0: the key does not exist yet.
#[derive(Debug, Clone, PartialEq)]
pub struct Versioned {
    pub version: i64,
    pub state: Option<Value>,
}

/// Every key a round read, with its version: what the commit validates.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    entries: BTreeMap<String, Versioned>,
}

impl Snapshot {
    /// A snapshot of `entries` (keys missing from the store at version 0).
    pub fn new(entries: BTreeMap<String, Versioned>) -> Self {
        Self { entries }
    }

    /// The entry of `key`, if it was read.
    pub fn get(&self, key: &str) -> Option<&Versioned> {
        self.entries.get(key)
    }

    /// The version of `key` as read (0: absent or not read).
    pub fn version(&self, key: &str) -> i64 {
        self.entries.get(key).map_or(0, |v| v.version)
    }

    /// The state of `key`, deserialized; `Ok(None)` when it is absent. A
    /// state of the wrong shape is a permanent error: every retry would
    /// read the same.
    pub fn state<T: DeserializeOwned>(&self, key: &str) -> Result<Option<T>, TaskError> {
        self.entries
            .get(key)
            .and_then(|v| v.state.clone())
            .map(serde_json::from_value)
            .transpose()
            .map_err(|e| {
                TaskError::permanent(format!("state of {key}: {e}")).with_reason("InvalidState")
            })
    }

    /// The keys read, in order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    /// Keys with their entries, in order.
    pub fn entries(&self) -> &BTreeMap<String, Versioned> {
        &self.entries
    }
}

/// What a round proposes: new states for keys it read, and the task's
/// result (committed with the task's fenced row).
#[derive(Debug, Clone, PartialEq)]
pub struct Proposal {
    writes: BTreeMap<String, Value>,
    result: Value,
}

impl Proposal {
    /// A proposal that writes nothing yet and returns `result`.
    pub fn new(result: Value) -> Self {
        Self {
            writes: BTreeMap::new(),
            result,
        }
    }

    /// Also sets `key` to `state` (the key must have been read: only read
    /// keys are validated, and a blind write is what this mode exists to
    /// prevent).
    #[must_use]
    pub fn write(mut self, key: impl Into<String>, state: Value) -> Self {
        self.writes.insert(key.into(), state);
        self
    }

    /// The new states, by key.
    pub fn writes(&self) -> &BTreeMap<String, Value> {
        &self.writes
    }

    /// The task's result.
    pub fn result(&self) -> &Value {
        &self.result
    }
}

/// The compare-and-swap failed: `key` was read at version `read` but is at
/// `found` now. Nothing of the round was written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conflict {
    pub key: String,
    pub read: i64,
    pub found: i64,
}

/// What a commit did.
#[derive(Debug, Clone, PartialEq)]
pub enum CommitOutcome {
    /// Every version matched: the states, the result and the task's fenced
    /// row are written, the round's compensations are `KEPT`.
    Committed,
    /// A version had moved on; nothing was written.
    Conflict(Conflict),
}

/// One compensation in the log: attempt `token` of task `task_uid`, its
/// `round` (rounds retried in place share the token) and its place `seq`
/// in registration order.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LogEntry {
    pub task_uid: String,
    pub token: i64,
    pub round: i32,
    pub seq: i32,
    pub name: String,
}

/// How a compensation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ran {
    Ok,
    Failed,
}

/// Where speculative rounds read and commit, and where compensations are
/// logged. Implemented for PostgreSQL (`postgres::FencedPool`) and in
/// memory ([`memory::MemoryStore`], for tests).
pub trait VersionedStore: Send + Sync {
    /// The current versions and states of `keys`.
    fn read<'a>(&'a self, keys: &'a [String]) -> BoxFuture<'a, Result<Snapshot, Error>>;

    /// In one transaction: the task's fenced commit of the proposal's
    /// result under `fence`; every key of `snapshot` still at its version
    /// (else [`CommitOutcome::Conflict`], nothing written); the proposal's
    /// writes with `version + 1`; and exactly `registered` log entries of
    /// (`task_uid`, token, `round`) moved from `REGISTERED` to `KEPT`
    /// (fewer: one was claimed to run — refused, nothing written). A task
    /// row already committed is an error, [`Error::CommittedEarlier`],
    /// even under our own token: the swap did not run.
    fn commit<'a>(
        &'a self,
        fence: &'a Fence,
        task_uid: &'a str,
        round: i32,
        registered: usize,
        snapshot: &'a Snapshot,
        proposal: &'a Proposal,
    ) -> BoxFuture<'a, Result<CommitOutcome, Error>>;

    /// Logs `entry` as `REGISTERED`, before its side effect happens; an
    /// entry already in the log is an error (log keys never repeat: an
    /// entry that silently stayed as it was would never run).
    fn log_registered<'a>(&'a self, entry: &'a LogEntry) -> BoxFuture<'a, Result<(), Error>>;

    /// Claims `entry` to run it: `REGISTERED` → `RUNNING`. `false`: it is
    /// not `REGISTERED` (its round committed, or it ran already).
    fn log_claim<'a>(&'a self, entry: &'a LogEntry) -> BoxFuture<'a, Result<bool, Error>>;

    /// Records how `entry` ran (`RUNNING` → `RAN` / `FAILED`).
    fn log_ran<'a>(
        &'a self,
        entry: &'a LogEntry,
        ran: Ran,
        error: Option<&'a str>,
    ) -> BoxFuture<'a, Result<(), Error>>;
}

type Undo = Box<dyn FnOnce() -> BoxFuture<'static, Result<(), String>> + Send>;

struct Pending {
    entry: LogEntry,
    undo: Undo,
}

struct Round {
    store: Arc<dyn VersionedStore>,
    task_uid: String,
    token: i64,
    round: i32,
    next_seq: i32,
    pending: Vec<Pending>,
    /// Set once the round committed (its entries are `KEPT`) or its
    /// compensations were taken to run: nothing is left for `Drop`.
    settled: bool,
    background: TaskTracker,
    metrics: WorkerMetrics,
}

/// The undo actions of one round, registered by the body. Cheap to clone;
/// every clone is the same list.
#[derive(Clone)]
pub struct Compensations {
    inner: Arc<Mutex<Round>>,
}

impl std::fmt::Debug for Compensations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let r = lock(&self.inner);
        f.debug_struct("Compensations")
            .field("token", &r.token)
            .field("round", &r.round)
            .field("pending", &r.pending.len())
            .finish()
    }
}

fn lock(m: &Mutex<Round>) -> std::sync::MutexGuard<'_, Round> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Compensations {
    /// Registers `undo` under `name` (low-cardinality: it is logged and
    /// counted) and logs it. Call it **before** the side effect it undoes:
    /// a crash between the two then leaves an undo for an effect that never
    /// happened, never an effect without its undo — so `undo` must accept
    /// that the effect may be missing, and be idempotent towards its
    /// target (it runs at most once, but the target may have seen a retry
    /// of the effect). The log write takes a connection of the store: do
    /// not hold one of a small pool across this call.
    pub async fn register<F, Fut>(&self, name: &str, undo: F) -> Result<(), Error>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = Result<(), String>> + Send + 'static,
    {
        // Pending before it is logged: an attempt dropped while the log
        // write is under way still runs it (or finds it never logged and
        // skips it) — never a logged entry nobody runs.
        let (store, entry) = {
            let mut r = lock(&self.inner);
            if r.settled {
                // Nobody would run it: its round committed or was undone.
                return Err(Error::Config(
                    "a compensation was registered after its round ended",
                ));
            }
            let entry = LogEntry {
                task_uid: r.task_uid.clone(),
                token: r.token,
                round: r.round,
                seq: r.next_seq,
                name: name.to_owned(),
            };
            r.next_seq += 1;
            r.pending.push(Pending {
                entry: entry.clone(),
                undo: Box::new(move || Box::pin(undo())),
            });
            (r.store.clone(), entry)
        };
        if let Err(e) = store.log_registered(&entry).await {
            // Not logged: the caller must not go on with its side effect.
            lock(&self.inner).pending.retain(|p| p.entry != entry);
            return Err(e);
        }
        Ok(())
    }

    /// The attempt's fencing token (to key side effects by attempt).
    pub fn token(&self) -> i64 {
        lock(&self.inner).token
    }

    /// The round within the attempt (0 unless lost swaps were retried in
    /// place).
    pub fn round(&self) -> i32 {
        lock(&self.inner).round
    }

    /// How many are registered and not yet run.
    pub fn len(&self) -> usize {
        lock(&self.inner).pending.len()
    }

    /// Whether none is pending.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn registered(&self) -> usize {
        lock(&self.inner).pending.len()
    }

    fn keep(&self) {
        let mut r = lock(&self.inner);
        r.pending.clear();
        r.settled = true;
    }

    /// Takes the pending compensations to run (last registered first).
    fn take(&self) -> (Arc<dyn VersionedStore>, Vec<Pending>, WorkerMetrics) {
        let mut r = lock(&self.inner);
        r.settled = true;
        let mut pending = std::mem::take(&mut r.pending);
        pending.reverse();
        (r.store.clone(), pending, r.metrics.clone())
    }
}

impl Drop for Round {
    /// The round was dropped (the attempt's future was, by the kill switch
    /// or a drain) neither committed nor compensated: undo its side
    /// effects in the background, to the end.
    fn drop(&mut self) {
        if self.settled || self.pending.is_empty() {
            return;
        }
        let mut pending = std::mem::take(&mut self.pending);
        pending.reverse();
        let (store, metrics) = (self.store.clone(), self.metrics.clone());
        let (token, round) = (self.token, self.round);
        let run = async move {
            let report = run_compensations(store.as_ref(), pending, &metrics).await;
            info!(
                token,
                round,
                ran = report.ran,
                failed = report.failed.len(),
                "compensations of a dropped attempt ran"
            );
        };
        match tokio::runtime::Handle::try_current() {
            Ok(_) => {
                self.background.spawn(run);
            }
            Err(_) => warn!(
                token,
                round,
                "attempt dropped outside a runtime: its compensations stay REGISTERED in the log"
            ),
        }
    }
}

/// What running a round's compensations did.
#[derive(Debug, Default)]
struct Report {
    ran: usize,
    /// `name: error` of each failure (including a log write that failed).
    failed: Vec<String>,
}

async fn run_compensations(
    store: &dyn VersionedStore,
    pending: Vec<Pending>,
    metrics: &WorkerMetrics,
) -> Report {
    let mut report = Report::default();
    let count = |outcome: &'static str| {
        metrics
            .compensations
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
    };
    for Pending { entry, undo } in pending {
        match store.log_claim(&entry).await {
            Ok(true) => {}
            Ok(false) => {
                // Its round committed after all (a commit whose answer was
                // lost), or it ran already: it must not run.
                count("skipped");
                continue;
            }
            Err(e) => {
                // Not claimed, not run: it stays REGISTERED in the log.
                count("failed");
                report
                    .failed
                    .push(format!("{}: not claimed: {e}", entry.name));
                continue;
            }
        }
        // A panicking or hanging undo is a failed one: the rest still run,
        // and the worker is not kept from exiting.
        let result = match tokio::time::timeout(
            UNDO_TIMEOUT,
            std::panic::AssertUnwindSafe(undo()).catch_unwind(),
        )
        .await
        {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err("the compensation panicked".to_owned()),
            Err(_) => Err(format!(
                "the compensation did not end within {UNDO_TIMEOUT:?}"
            )),
        };
        let (ran, error) = match &result {
            Ok(()) => (Ran::Ok, None),
            Err(e) => (Ran::Failed, Some(e.as_str())),
        };
        if let Err(e) = store.log_ran(&entry, ran, error).await {
            warn!(name = %entry.name, error = %e, "compensation ran but its end was not logged");
        }
        match result {
            Ok(()) => {
                count("ran");
                report.ran += 1;
            }
            Err(e) => {
                count("failed");
                warn!(name = %entry.name, token = entry.token, error = %e, "compensation failed");
                report.failed.push(format!("{}: {e}", entry.name));
            }
        }
    }
    report
}

/// How long one compensation may run before it counts as failed.
pub const UNDO_TIMEOUT: Duration = Duration::from_secs(60);

/// How many rounds an attempt in `Exclusive` mode runs in place before
/// reporting `Aborted` after all, when it holds no resource locks.
pub const IN_PLACE_ROUNDS: i32 = 10;
/// The same holding its resource locks: no new speculative attempt on
/// those resources is issued meanwhile and each one issued before wins at
/// most once, so it finishes long before this — unless tasks write these
/// keys without naming the resources (then it aborts, and in Exclusive
/// mode an abort spends a retry: the task dead-letters instead of
/// spinning while it holds the locks).
pub const IN_PLACE_ROUNDS_LOCKED: i32 = 50;
/// The longest pause between two rounds in place.
const MAX_ROUND_PAUSE_MS: u64 = 500;

/// What a speculative attempt committed.
#[derive(Debug, Clone, PartialEq)]
pub struct Speculated {
    /// The committed result (an earlier attempt's, when [`Self::earlier`]).
    pub result: Value,
    /// Rounds this call ran (lost swaps retried in place + 1); 0 when an
    /// earlier attempt's commit was found.
    pub rounds: i32,
    /// An earlier attempt of the task had committed: nothing was run.
    pub earlier: bool,
}

/// The rounds of one attempt across its `speculate` calls: log keys
/// (token, round, seq) never repeat, and an attempt commits once.
#[derive(Debug, Default)]
pub(crate) struct AttemptRounds {
    next: AtomicI32,
    committed: AtomicBool,
}

/// What one speculative attempt needs from its context.
pub(crate) struct Attempt<'a> {
    pub task_uid: &'a str,
    pub fence: &'a Fence,
    pub rounds: &'a AttemptRounds,
    /// `Exclusive` (the quarantine): a lost swap is retried in place.
    pub exclusive: bool,
    /// The attempt holds resource locks (its lease carries resource
    /// tokens): in place without a bound (see [`IN_PLACE_ROUNDS`]).
    pub holds_locks: bool,
    pub earlier: Option<&'a EarlierCommit>,
    pub background: &'a TaskTracker,
    pub metrics: &'a WorkerMetrics,
}

/// The reason of an aborted attempt in the task's status.
pub const ABORTED_REASON: &str = "CompareAndSwapLost";
/// The reason of an attempt whose compensations did not all run.
pub const COMPENSATION_FAILED_REASON: &str = "CompensationFailed";

pub(crate) async fn run<F, Fut>(
    attempt: Attempt<'_>,
    store: Arc<dyn VersionedStore>,
    keys: &[String],
    mut body: F,
) -> Result<Speculated, TaskError>
where
    F: FnMut(Snapshot, Compensations) -> Fut,
    Fut: Future<Output = Result<Proposal, TaskError>>,
{
    if let Some(earlier) = attempt.earlier {
        // The work is done: running it again would apply it twice.
        return Ok(Speculated {
            result: earlier.payload.clone().unwrap_or(Value::Null),
            rounds: 0,
            earlier: true,
        });
    }
    let mut keys = keys.to_vec();
    keys.sort();
    keys.dedup();
    let token = attempt.fence.token();
    let count = |outcome: &'static str| {
        attempt
            .metrics
            .speculative_rounds
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
    };
    if attempt.rounds.committed.load(Ordering::SeqCst) {
        // The task's fenced row takes one commit: a second one would be
        // refused after its side effects ran.
        return Err(TaskError::permanent(
            "speculate was called again after this attempt committed",
        )
        .with_reason("SpeculatedTwice"));
    }
    let limit = if attempt.holds_locks {
        IN_PLACE_ROUNDS_LOCKED
    } else {
        IN_PLACE_ROUNDS
    };
    let mut local = 0;
    loop {
        let round = attempt.rounds.next.fetch_add(1, Ordering::SeqCst);
        local += 1;
        attempt.fence.check()?;
        let snapshot = store.read(&keys).await?;
        let comps = Compensations {
            inner: Arc::new(Mutex::new(Round {
                store: store.clone(),
                task_uid: attempt.task_uid.to_owned(),
                token,
                round,
                next_seq: 0,
                pending: Vec::new(),
                settled: false,
                background: attempt.background.clone(),
                metrics: attempt.metrics.clone(),
            })),
        };
        let proposal = match body(snapshot.clone(), comps.clone()).await {
            Ok(p) => p,
            Err(e) => {
                count("failed");
                // A failed round's side effects are undone too.
                let report = compensate(&comps).await;
                return Err(with_report(e, &report));
            }
        };
        if let Some(key) = proposal.writes.keys().find(|k| snapshot.get(k).is_none()) {
            count("failed");
            let report = compensate(&comps).await;
            let e = TaskError::permanent(format!(
                "the proposal writes {key}, which the round did not read"
            ))
            .with_reason("UnreadKeyWritten");
            return Err(with_report(e, &report));
        }
        let committed = store
            .commit(
                attempt.fence,
                attempt.task_uid,
                round,
                comps.registered(),
                &snapshot,
                &proposal,
            )
            .await;
        match committed {
            Ok(CommitOutcome::Committed) => {
                count("committed");
                comps.keep();
                attempt.rounds.committed.store(true, Ordering::SeqCst);
                debug!(token, round, "speculative commit won");
                return Ok(Speculated {
                    result: proposal.result,
                    rounds: local,
                    earlier: false,
                });
            }
            Ok(CommitOutcome::Conflict(c)) => {
                count("conflict");
                let report = compensate(&comps).await;
                if !report.failed.is_empty() {
                    return Err(compensation_failed(&report));
                }
                info!(token, round, key = %c.key, read = c.read, found = c.found, "compare-and-swap lost");
                if attempt.exclusive && local < limit {
                    // Whoever beat us was issued before we took the locks;
                    // a short, jittered pause lets it finish.
                    let ms = (10 * u64::try_from(local).unwrap_or(1)).min(MAX_ROUND_PAUSE_MS);
                    let jitter = rand::random::<u64>() % (ms + 1);
                    tokio::time::sleep(Duration::from_millis(ms + jitter)).await;
                    continue;
                }
                return Err(TaskError::Aborted {
                    message: format!(
                        "{} was at version {} when committing, not {} as read",
                        c.key, c.found, c.read
                    ),
                });
            }
            Err(e) => {
                count("failed");
                // Fenced, revoked, or refused because a compensation was
                // claimed: nothing was written, undo. A storage error may
                // hide a commit that landed: the claim of each entry finds
                // it `KEPT` then and skips it.
                let report = compensate(&comps).await;
                return Err(with_report(e.into(), &report));
            }
        }
    }
}

/// Runs the round's compensations on the background tracker and waits for
/// them: if the attempt is dropped while they run (the kill switch fires
/// in the middle), they still run to the end.
async fn compensate(comps: &Compensations) -> Report {
    let (store, pending, metrics) = comps.take();
    let background = lock(&comps.inner).background.clone();
    let run =
        background.spawn(async move { run_compensations(store.as_ref(), pending, &metrics).await });
    run.await.unwrap_or_else(|e| Report {
        ran: 0,
        failed: vec![format!("the compensations' task ended abnormally: {e}")],
    })
}

fn compensation_failed(report: &Report) -> TaskError {
    TaskError::retryable(format!(
        "{} compensation(s) failed after the round was not committed: {}",
        report.failed.len(),
        report.failed.join("; ")
    ))
    .with_reason(COMPENSATION_FAILED_REASON)
}

/// `e`, or a compensation failure when one happened (it needs a human more
/// than the original error does; the original stays in the message).
fn with_report(e: TaskError, report: &Report) -> TaskError {
    if report.failed.is_empty() {
        return e;
    }
    let (TaskError::Retryable { message, .. }
    | TaskError::Permanent { message, .. }
    | TaskError::Aborted { message }) = &e;
    let mut out = compensation_failed(report);
    if let TaskError::Retryable { message: m, .. } = &mut out {
        m.push_str(&format!(" (after: {message})"));
    }
    out
}

#[cfg(test)]
mod tests;
