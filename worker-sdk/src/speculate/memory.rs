//! A [`VersionedStore`] in memory, with the same rules as the PostgreSQL
//! one: for unit tests of speculative handlers (and of the executor).

use std::collections::BTreeMap;
use std::sync::Mutex;

use futures::FutureExt;
use futures::future::BoxFuture;
use serde_json::Value;

use super::{
    CommitOutcome, Conflict, LogEntry, Proposal, Ran, Snapshot, Versioned, VersionedStore,
};
use crate::error::Error;
use crate::fence::Fence;

/// The state of one compensation in the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogState {
    Registered,
    Running,
    Ran,
    Failed,
    Kept,
}

#[derive(Debug, Default)]
struct Inner {
    keys: BTreeMap<String, (i64, Value)>,
    /// Per task UID: the newest token registered or committed, and the
    /// token that committed (at most one).
    tasks: BTreeMap<String, (i64, Option<i64>)>,
    log: BTreeMap<LogEntry, LogState>,
    /// Commits that found a conflict (for tests).
    conflicts: usize,
}

/// Keys with versions, the tasks' fence rows and the compensation log, in
/// memory.
#[derive(Debug, Default)]
pub struct MemoryStore {
    inner: Mutex<Inner>,
}

impl MemoryStore {
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Writes `key` as another writer would: a new state, version + 1.
    pub fn put(&self, key: &str, state: Value) -> i64 {
        let mut inner = self.lock();
        let e = inner.keys.entry(key.to_owned()).or_insert((0, Value::Null));
        e.0 += 1;
        e.1 = state;
        e.0
    }

    /// The version and state of `key`.
    pub fn get(&self, key: &str) -> Option<(i64, Value)> {
        self.lock().keys.get(key).cloned()
    }

    /// Registers `token` for `task_uid` as a newer attempt would (design
    /// §4): older attempts' commits are refused from then on.
    pub fn register(&self, task_uid: &str, token: i64) {
        let mut inner = self.lock();
        let e = inner.tasks.entry(task_uid.to_owned()).or_insert((0, None));
        e.0 = e.0.max(token);
    }

    /// The token that committed for `task_uid`.
    pub fn committed(&self, task_uid: &str) -> Option<i64> {
        self.lock().tasks.get(task_uid).and_then(|t| t.1)
    }

    /// The compensation log, in (task, token, round, seq) order.
    pub fn log(&self) -> Vec<(LogEntry, LogState)> {
        self.lock()
            .log
            .iter()
            .map(|(e, s)| (e.clone(), *s))
            .collect()
    }

    /// How many commits lost their compare-and-swap.
    pub fn conflicts(&self) -> usize {
        self.lock().conflicts
    }
}

impl VersionedStore for MemoryStore {
    fn read<'a>(&'a self, keys: &'a [String]) -> BoxFuture<'a, Result<Snapshot, Error>> {
        async move {
            let inner = self.lock();
            let entries = keys
                .iter()
                .map(|k| {
                    let v = inner.keys.get(k).map_or(
                        Versioned {
                            version: 0,
                            state: None,
                        },
                        |(version, state)| Versioned {
                            version: *version,
                            state: Some(state.clone()),
                        },
                    );
                    (k.clone(), v)
                })
                .collect();
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
            fence.check()?;
            let token = fence.token();
            let mut inner = self.lock();
            let (last, committed) = inner.tasks.get(task_uid).copied().unwrap_or((0, None));
            if last > token {
                return Err(Error::Fenced {
                    token,
                    current: last,
                });
            }
            if let Some(earlier) = committed {
                return Err(Error::CommittedEarlier { token, earlier });
            }
            for (key, read) in snapshot.entries() {
                let found = inner.keys.get(key).map_or(0, |(v, _)| *v);
                if found != read.version {
                    inner.conflicts += 1;
                    return Ok(CommitOutcome::Conflict(Conflict {
                        key: key.clone(),
                        read: read.version,
                        found,
                    }));
                }
            }
            let ours: Vec<LogEntry> = inner
                .log
                .iter()
                .filter(|(e, s)| {
                    e.task_uid == task_uid
                        && e.token == token
                        && e.round == round
                        && **s == LogState::Registered
                })
                .map(|(e, _)| e.clone())
                .collect();
            if ours.len() != registered {
                return Err(Error::Revoked {
                    token,
                    reason: "compensation_claimed",
                });
            }
            for e in ours {
                inner.log.insert(e, LogState::Kept);
            }
            for (key, state) in proposal.writes() {
                let e = inner.keys.entry(key.clone()).or_insert((0, Value::Null));
                e.0 += 1;
                e.1 = state.clone();
            }
            inner
                .tasks
                .insert(task_uid.to_owned(), (token, Some(token)));
            Ok(CommitOutcome::Committed)
        }
        .boxed()
    }

    fn log_registered<'a>(&'a self, entry: &'a LogEntry) -> BoxFuture<'a, Result<(), Error>> {
        async move {
            let mut inner = self.lock();
            if inner.log.contains_key(entry) {
                return Err(Error::Config("compensation log entry already exists"));
            }
            inner.log.insert(entry.clone(), LogState::Registered);
            Ok(())
        }
        .boxed()
    }

    fn log_claim<'a>(&'a self, entry: &'a LogEntry) -> BoxFuture<'a, Result<bool, Error>> {
        async move {
            let mut inner = self.lock();
            match inner.log.get_mut(entry) {
                Some(s) if *s == LogState::Registered => {
                    *s = LogState::Running;
                    Ok(true)
                }
                _ => Ok(false),
            }
        }
        .boxed()
    }

    fn log_ran<'a>(
        &'a self,
        entry: &'a LogEntry,
        ran: Ran,
        _error: Option<&'a str>,
    ) -> BoxFuture<'a, Result<(), Error>> {
        async move {
            let mut inner = self.lock();
            if let Some(s) = inner.log.get_mut(entry)
                && *s == LogState::Running
            {
                *s = match ran {
                    Ran::Ok => LogState::Ran,
                    Ran::Failed => LogState::Failed,
                };
            }
            Ok(())
        }
        .boxed()
    }
}
