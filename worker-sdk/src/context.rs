//! What a handler gets: the task's payload, its fencing token, the previous
//! attempt's checkpoint, a cancellation token, and a way to record progress.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::error::Error;
use crate::fence::Fence;

/// A commit that an earlier attempt of the same task made before this one
/// registered (design §4). The work is done; a handler normally returns
/// this result instead of doing it again.
#[derive(Debug, Clone, PartialEq)]
pub struct EarlierCommit {
    /// The fencing token of the attempt whose commit stuck.
    pub token: i64,
    /// What it committed.
    pub payload: Option<Value>,
}

/// Storage in which each attempt registers its fencing token before its
/// handler runs (see `postgres::FencedStore`). Registration raises the
/// stored token to ours, so every later write of an older attempt is
/// refused; it fails with [`Error::Fenced`] when a newer attempt already
/// registered (we are the zombie).
pub trait Registry: Send + Sync {
    /// Registers `fence`'s token for the task with UID `task_uid`; returns
    /// the commit of an earlier attempt, if one stuck.
    fn register<'a>(
        &'a self,
        task_uid: &'a str,
        fence: &'a Fence,
    ) -> futures::future::BoxFuture<'a, Result<Option<EarlierCommit>, Error>>;
}

/// The context of one attempt.
#[derive(Debug, Clone)]
pub struct TaskContext {
    pub(crate) task_name: String,
    pub(crate) namespace: String,
    pub(crate) task_uid: String,
    pub(crate) payload: Value,
    pub(crate) attempt: i32,
    pub(crate) previous_checkpoint: Option<Value>,
    pub(crate) resource_tokens: BTreeMap<String, i64>,
    pub(crate) fence: Fence,
    pub(crate) pending_checkpoint: Arc<Mutex<Option<Value>>>,
    pub(crate) earlier_commit: Option<EarlierCommit>,
}

impl TaskContext {
    /// The BatchTask's name.
    pub fn task_name(&self) -> &str {
        &self.task_name
    }

    /// The BatchTask's namespace.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The BatchTask's UID: the key of the task's row in fenced storage, so a
    /// deleted and re-created task of the same name starts clean and a
    /// zombie of the old one cannot touch it.
    pub fn task_uid(&self) -> &str {
        &self.task_uid
    }

    /// The commit of an earlier attempt of this task, found when this
    /// attempt registered its token (only with a registry configured).
    pub fn earlier_commit(&self) -> Option<&EarlierCommit> {
        self.earlier_commit.as_ref()
    }

    /// The payload as JSON.
    pub fn payload_json(&self) -> &Value {
        &self.payload
    }

    /// The payload, deserialized; a payload of the wrong shape is a
    /// permanent error (a retry would see the same payload).
    pub fn payload<T: DeserializeOwned>(&self) -> Result<T, crate::TaskError> {
        serde_json::from_value(self.payload.clone()).map_err(|e| {
            crate::TaskError::permanent(format!("payload: {e}")).with_reason("InvalidPayload")
        })
    }

    /// The fencing token of this attempt: every write to storage carries it.
    pub fn fencing_token(&self) -> i64 {
        self.fence.token()
    }

    /// 1 for the first attempt, 2 for the first retry, …
    pub fn attempt(&self) -> i32 {
        self.attempt
    }

    /// Fencing tokens of the task's resource locks.
    pub fn resource_tokens(&self) -> &BTreeMap<String, i64> {
        &self.resource_tokens
    }

    /// Progress recorded by the previous attempt, to resume from.
    pub fn previous_checkpoint(&self) -> Option<&Value> {
        self.previous_checkpoint.as_ref()
    }

    /// Records progress; it travels with the next renewal (no extra write)
    /// and is handed to the next attempt if this one fails.
    pub fn checkpoint(&self, progress: Value) {
        *self
            .pending_checkpoint
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(progress);
    }

    /// Fires when the kill switch does. The SDK also drops the handler's
    /// future then; the token is for work the handler spawned elsewhere.
    pub fn cancellation(&self) -> CancellationToken {
        self.fence.killed().clone()
    }

    /// The attempt's fence, for storage adapters (see `postgres::FencedStore`).
    pub fn fence(&self) -> &Fence {
        &self.fence
    }
}

/// What a successful handler returns: a small result for the task's status.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Output {
    pub result: Option<Value>,
}

impl Output {
    /// No result.
    pub fn none() -> Self {
        Self::default()
    }

    /// A JSON result (keep it small: it is stored in the BatchTask status).
    pub fn json(result: Value) -> Self {
        Self {
            result: Some(result),
        }
    }
}
