//! What a handler gets: the task's payload, its fencing token, the previous
//! attempt's checkpoint, a cancellation token, and a way to record progress.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::fence::Fence;

/// The context of one attempt.
#[derive(Debug, Clone)]
pub struct TaskContext {
    pub(crate) task_name: String,
    pub(crate) namespace: String,
    pub(crate) payload: Value,
    pub(crate) attempt: i32,
    pub(crate) previous_checkpoint: Option<Value>,
    pub(crate) resource_tokens: BTreeMap<String, i64>,
    pub(crate) fence: Fence,
    pub(crate) pending_checkpoint: Arc<Mutex<Option<Value>>>,
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
