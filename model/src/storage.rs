//! PostgreSQL's fenced table of design §4, as rules on one row.
//!
//! Today's rule (`RegisterFirst`, `worker-sdk/src/postgres.rs`): an attempt
//! registers its token before its handler runs (refused if a newer one
//! registered); a commit is accepted only while no newer token registered,
//! no other attempt committed, and before the attempt's deadline. The rule
//! before issue 7 (`CommitOnly`): no registration; a commit is accepted if
//! its token is at least the stored one, and stores it.

/// Which rules the table enforces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StorageRule {
    RegisterFirst,
    CommitOnly,
}

/// The task's row.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct Storage {
    pub rule: StorageRule,
    /// `last_fencing_token`.
    pub token: i64,
    /// `committed_token` and whose payload it is.
    pub committed: Option<(i64, usize)>,
    /// Ghost: every distinct (token, worker) commit accepted.
    pub accepted: Vec<(i64, usize)>,
    /// Ghost: a write was accepted with a token below one already stored.
    pub stale_write_accepted: bool,
}

impl Storage {
    pub fn new(rule: StorageRule) -> Self {
        Self {
            rule,
            token: 0,
            committed: None,
            accepted: Vec::new(),
            stale_write_accepted: false,
        }
    }

    /// `register`: raises the stored token; `false` = fenced.
    pub fn register(&mut self, token: i64) -> bool {
        if self.token > token {
            return false;
        }
        self.token = token;
        true
    }

    /// `commit` by `worker` under `token`; `in_time`: the server's clock is
    /// still before the attempt's deadline. `false` = refused.
    pub fn commit(&mut self, token: i64, worker: usize, in_time: bool) -> bool {
        let accepted = match self.rule {
            StorageRule::RegisterFirst => {
                in_time
                    && self.token <= token
                    && match self.committed {
                        None => true,
                        // Our own commit again (a lost acknowledgement).
                        Some(c) => c == (token, worker),
                    }
            }
            StorageRule::CommitOnly => self.token <= token,
        };
        if !accepted {
            return false;
        }
        if token < self.token {
            self.stale_write_accepted = true;
        }
        self.token = token;
        if self.committed.is_none() {
            self.committed = Some((token, worker));
        }
        if !self.accepted.contains(&(token, worker)) {
            self.accepted.push((token, worker));
        }
        true
    }
}
