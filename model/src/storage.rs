//! PostgreSQL's fenced tables of design §4 and §5, as rules on one row per
//! task (`task_state`) and one per resource (`resource_fence`).
//!
//! Today's rule (`RegisterFirst`, `worker-sdk/src/postgres.rs`): an attempt
//! registers its token before its handler runs (refused if a newer one
//! registered); a commit is accepted only while no newer token registered,
//! no other attempt committed, and before the attempt's deadline. The rule
//! before issue 7 (`CommitOnly`): no registration; a commit is accepted if
//! its token is at least the stored one, and stores it.
//!
//! Resource tokens (the lock's `leaseTransitions`) are fenced in the same
//! transactions, whatever the rule: registration raises each resource row
//! to the attempt's token (refused if a higher one is stored, or the same
//! one by another task; the same one by the same task is its own
//! re-registration); a commit is refused unless every resource row still
//! carries the attempt's token (or a lower one: an attempt that never
//! registered), and stamps it. A refusal of any row refuses the whole
//! transaction.
//!
//! Speculative rounds (design §6) commit in one transaction with the task
//! row's fenced commit a compare-and-swap on a versioned key ([`Key`],
//! [`Storage::commit_swap`]); [`CasRule`] has the rule and two mutations.

use std::collections::BTreeMap;

/// How a speculative round's compare-and-swap meets the fenced commit
/// (design §6).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CasRule {
    /// The SDK's rule: one transaction holds the task row's fenced commit
    /// and, for the key read, `version` still the one read (then the new
    /// state and `version + 1`); any refusal rolls it all back, and a
    /// fenced refusal is never a win.
    InFence,
    /// A mutation: the key is written without its version check (a lost
    /// update).
    Blind,
    /// A mutation: the compare-and-swap in a transaction of its own,
    /// before the fenced commit — it sticks when the task row refuses (a
    /// zombie, a second attempt of a task that committed).
    OutsideFence,
}

/// The versioned key speculative rounds read and swap. The rounds' function
/// adds one, so with sound rules `value` counts the tasks whose commit
/// stuck.
#[derive(Clone, Copy, Debug, Default, Hash, PartialEq, Eq)]
pub struct Key {
    pub value: u8,
    pub version: u8,
}

/// A speculative commit the fence accepted: the swap won (all written) or
/// was lost (all rolled back).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Swap {
    Won,
    Lost,
}

/// Which rules the table enforces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StorageRule {
    RegisterFirst,
    CommitOnly,
}

/// A task's row (`task_state`, keyed by the task).
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq)]
pub struct Row {
    /// `last_fencing_token`.
    pub token: i64,
    /// `committed_token` and whose payload it is.
    pub committed: Option<(i64, usize)>,
    /// Ghost: every distinct (token, worker) commit accepted.
    pub accepted: Vec<(i64, usize)>,
}

/// Which rows refuse a write (one transaction: any refusal refuses it
/// all). The SDK reports the task row's reason first; the model records
/// both, to tell when the resource rows alone stood in the way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// The task's row: a newer attempt, an earlier commit, or too late.
    pub task_row: bool,
    /// A resource's row: the resource passed to a newer holder.
    pub resource_rows: bool,
}

/// The tables.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct Storage {
    pub rule: StorageRule,
    /// One row per task, by the task's index.
    pub rows: Vec<Row>,
    /// `resource_fence`: per resource, `last_token` and the task (index)
    /// that wrote it.
    pub resources: BTreeMap<String, (i64, usize)>,
    /// Ghost: a write was accepted with a token below one already stored.
    pub stale_write_accepted: bool,
    /// Ghost: a commit was accepted with a resource token below the
    /// resource's stored one.
    pub stale_resource_write_accepted: bool,
    /// The key speculative rounds share, and how its swap is checked.
    pub key: Key,
    pub cas: CasRule,
    /// Ghost: a write of the key set a version other than the next one.
    pub key_version_not_next: bool,
    /// Coverage: the fence refused a speculative commit whose swap would
    /// have won (a zombie that read the current version).
    pub refused_a_winning_swap: bool,
}

impl Storage {
    pub fn new(rule: StorageRule, tasks: usize) -> Self {
        Self {
            rule,
            rows: vec![Row::default(); tasks],
            resources: BTreeMap::new(),
            stale_write_accepted: false,
            stale_resource_write_accepted: false,
            key: Key::default(),
            cas: CasRule::InFence,
            key_version_not_next: false,
            refused_a_winning_swap: false,
        }
    }

    /// Whether a resource row moved on from `rt`: a higher token, or the
    /// same one written by another task.
    fn moved_on(&self, task: usize, tokens: &BTreeMap<String, i64>) -> bool {
        tokens.iter().any(|(r, rt)| {
            self.resources
                .get(r)
                .is_some_and(|(last, by)| last > rt || (last == rt && *by != task))
        })
    }

    /// Writes `tokens` into the resource rows.
    fn stamp(&mut self, task: usize, tokens: &BTreeMap<String, i64>) {
        for (r, rt) in tokens {
            if self.resources.get(r).is_some_and(|(last, _)| last > rt) {
                self.stale_resource_write_accepted = true;
            }
            self.resources.insert(r.clone(), (*rt, task));
        }
    }

    /// `register` of task `task`'s attempt under `token` holding the
    /// resource tokens `tokens`: raises the stored tokens.
    pub fn register(
        &mut self,
        task: usize,
        token: i64,
        tokens: &BTreeMap<String, i64>,
    ) -> Result<(), Refusal> {
        let refusal = Refusal {
            task_row: self.rows.get(task).is_none_or(|row| row.token > token),
            resource_rows: self.moved_on(task, tokens),
        };
        if refusal.task_row || refusal.resource_rows {
            return Err(refusal);
        }
        if let Some(row) = self.rows.get_mut(task) {
            row.token = token;
        }
        self.stamp(task, tokens);
        Ok(())
    }

    /// Why the task row or a resource row refuses a commit by `worker` of
    /// task `task`'s attempt under `token` holding the resource tokens
    /// `tokens` (`in_time`: the server's clock is still before the
    /// attempt's deadline); `None`: accepted.
    fn commit_refusal(
        &self,
        task: usize,
        token: i64,
        worker: usize,
        in_time: bool,
        tokens: &BTreeMap<String, i64>,
    ) -> Option<Refusal> {
        let moved_on = self.moved_on(task, tokens);
        let Some(row) = self.rows.get(task) else {
            return Some(Refusal {
                task_row: true,
                resource_rows: moved_on,
            });
        };
        let accepted = match self.rule {
            StorageRule::RegisterFirst => {
                in_time
                    && row.token <= token
                    && match row.committed {
                        None => true,
                        // Our own commit again (a lost acknowledgement).
                        Some(c) => c == (token, worker),
                    }
            }
            StorageRule::CommitOnly => row.token <= token,
        };
        (!accepted || moved_on).then_some(Refusal {
            task_row: !accepted,
            resource_rows: moved_on,
        })
    }

    /// Writes an accepted commit into the task row and the resource rows.
    fn commit_rows(
        &mut self,
        task: usize,
        token: i64,
        worker: usize,
        tokens: &BTreeMap<String, i64>,
    ) {
        let Some(row) = self.rows.get_mut(task) else {
            return;
        };
        if token < row.token {
            self.stale_write_accepted = true;
        }
        row.token = token;
        if row.committed.is_none() {
            row.committed = Some((token, worker));
        }
        if !row.accepted.contains(&(token, worker)) {
            row.accepted.push((token, worker));
        }
        self.stamp(task, tokens);
    }

    /// `commit` by `worker` of task `task`'s attempt under `token` holding
    /// the resource tokens `tokens`; `in_time`: the server's clock is
    /// still before the attempt's deadline.
    pub fn commit(
        &mut self,
        task: usize,
        token: i64,
        worker: usize,
        in_time: bool,
        tokens: &BTreeMap<String, i64>,
    ) -> Result<(), Refusal> {
        if let Some(refusal) = self.commit_refusal(task, token, worker, in_time, tokens) {
            return Err(refusal);
        }
        self.commit_rows(task, token, worker, tokens);
        Ok(())
    }

    /// A speculative round's commit (design §6, `worker-sdk/src/speculate.rs`):
    /// the fenced commit above and, as [`CasRule`] says, the
    /// compare-and-swap of the key against `read`, the key as the round
    /// read it. The round's function adds one: the key's new value is
    /// `read.value + 1`.
    pub fn commit_swap(
        &mut self,
        task: usize,
        token: i64,
        worker: usize,
        in_time: bool,
        tokens: &BTreeMap<String, i64>,
        read: Key,
    ) -> Result<Swap, Refusal> {
        let refusal = self.commit_refusal(task, token, worker, in_time, tokens);
        if refusal.is_some() && self.key.version == read.version {
            self.refused_a_winning_swap = true;
        }
        match self.cas {
            CasRule::InFence => {
                if let Some(refusal) = refusal {
                    return Err(refusal);
                }
                if self.key.version != read.version {
                    return Ok(Swap::Lost);
                }
            }
            CasRule::Blind => {
                if let Some(refusal) = refusal {
                    return Err(refusal);
                }
            }
            CasRule::OutsideFence => {
                if self.key.version != read.version {
                    return Ok(Swap::Lost);
                }
                // Its own transaction, committed before the fenced one.
                self.write_key(read);
                if let Some(refusal) = refusal {
                    return Err(refusal);
                }
                self.commit_rows(task, token, worker, tokens);
                return Ok(Swap::Won);
            }
        }
        self.write_key(read);
        self.commit_rows(task, token, worker, tokens);
        Ok(Swap::Won)
    }

    /// The key written from `read`: state + 1, version + 1 (of the
    /// version read: under [`CasRule::Blind`] not always the next one).
    fn write_key(&mut self, read: Key) {
        let next = Key {
            value: read.value.saturating_add(1),
            version: read.version.saturating_add(1),
        };
        if next.version != self.key.version.saturating_add(1) {
            self.key_version_not_next = true;
        }
        self.key = next;
    }
}
