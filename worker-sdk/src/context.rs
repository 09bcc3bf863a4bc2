//! What a handler gets: the task's payload, its fencing token, the previous
//! attempt's checkpoint, a cancellation token, and a way to record progress
//! — plus, through the worker's client, its dependencies' results
//! ([`crate::dependencies`]) and a way to spawn children
//! ([`crate::spawn`]).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use batchlease_api::{JsonObject, MAX_CHECKPOINT_BYTES, MAX_DEPTH, MAX_RESULT_BYTES};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::error::Error;
use crate::fence::Fence;
use crate::registry::EarlierCommit;

/// The context of one attempt.
#[derive(Clone)]
pub struct TaskContext {
    pub(crate) task_name: String,
    pub(crate) namespace: String,
    pub(crate) task_uid: String,
    pub(crate) queue: String,
    pub(crate) depends_on: Vec<String>,
    /// The worker's main client (not the heartbeat's: handlers' reads and
    /// creates must not queue behind, or delay, renewals).
    pub(crate) client: kube::Client,
    pub(crate) payload: Option<JsonObject>,
    pub(crate) attempt: i32,
    pub(crate) previous_checkpoint: Option<JsonObject>,
    pub(crate) resource_tokens: BTreeMap<String, i64>,
    pub(crate) fence: Fence,
    pub(crate) pending_checkpoint: Arc<Mutex<Option<JsonObject>>>,
    pub(crate) earlier_commit: Option<EarlierCommit>,
    /// The mode this attempt runs in (`status.effectiveMode`).
    pub(crate) mode: batchlease_api::TaskMode,
    /// Work that must finish even if the handler is dropped (the
    /// compensations of a speculative round); the worker waits for it
    /// before it exits.
    pub(crate) background: tokio_util::task::TaskTracker,
    pub(crate) metrics: crate::metrics::WorkerMetrics,
    /// The attempt registered its token in storage (a registry is
    /// configured): speculation relies on it.
    pub(crate) registered: bool,
    /// Rounds run so far by `speculate` in this attempt, and whether one
    /// committed: log keys never repeat, and one attempt commits once.
    pub(crate) speculation: Arc<crate::speculate::AttemptRounds>,
}

impl std::fmt::Debug for TaskContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TaskContext")
            .field("task_name", &self.task_name)
            .field("namespace", &self.namespace)
            .field("task_uid", &self.task_uid)
            .field("attempt", &self.attempt)
            .field("token", &self.fence.token())
            .finish_non_exhaustive()
    }
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

    /// The BatchTask's queue (children spawned onto the same worker pool
    /// name it).
    pub fn queue(&self) -> &str {
        &self.queue
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

    /// The payload as JSON text (any depth; `None` when the task has none).
    pub fn payload_raw(&self) -> Option<&JsonObject> {
        self.payload.as_ref()
    }

    /// The payload, deserialized. A task without one reads as `null` where
    /// the type takes it (`Option<T>` is `None`, a `Value` is `Null`) and
    /// as the empty object `{}` otherwise, so a struct whose fields all
    /// have defaults (or a map) needs no payload. A payload of the wrong
    /// shape — or nested deeper than serde_json's 128 levels — is a
    /// permanent error: a retry would see the same payload.
    pub fn payload<T: DeserializeOwned>(&self) -> Result<T, crate::TaskError> {
        let parsed = match &self.payload {
            Some(p) => p.parse(),
            None => absent_payload(),
        };
        parsed.map_err(|e| {
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

    /// Fencing tokens of the task's resource locks (resource name to that
    /// lock's own token; the locks belong to the task's namespace). The
    /// fenced store registers and checks them itself; write one next to
    /// your own rows of a resource to fence them too.
    pub fn resource_tokens(&self) -> &BTreeMap<String, i64> {
        &self.resource_tokens
    }

    /// Progress recorded by the previous attempt, to resume from, as JSON
    /// text.
    pub fn previous_checkpoint_raw(&self) -> Option<&JsonObject> {
        self.previous_checkpoint.as_ref()
    }

    /// Progress recorded by the previous attempt, deserialized; `Ok(None)`
    /// when there is none. A checkpoint of the wrong shape is a permanent
    /// error (the next attempt would read the same one).
    pub fn previous_checkpoint<T: DeserializeOwned>(&self) -> Result<Option<T>, crate::TaskError> {
        self.previous_checkpoint
            .as_ref()
            .map(JsonObject::parse)
            .transpose()
            .map_err(|e| {
                crate::TaskError::permanent(format!("previous checkpoint: {e}"))
                    .with_reason("InvalidCheckpoint")
            })
    }

    /// Records progress; it travels with the next renewal (no extra write)
    /// and is handed to the next attempt if this one fails. It must
    /// serialize to a JSON object of at most
    /// [`MAX_CHECKPOINT_BYTES`](batchlease_api::MAX_CHECKPOINT_BYTES);
    /// otherwise nothing is recorded and the error says why (a permanent
    /// failure if returned from the handler).
    pub fn checkpoint(&self, progress: impl Serialize) -> Result<(), Error> {
        let cp = JsonObject::from_serialize(&progress).map_err(|e| Error::InvalidJson {
            what: "checkpoint",
            source: e,
        })?;
        check("checkpoint", &cp, MAX_CHECKPOINT_BYTES)?;
        *self
            .pending_checkpoint
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(cp);
        Ok(())
    }

    /// Fires when the handler is stopped — by the kill switch, or by a
    /// drain past its grace. The SDK also drops the handler's future then;
    /// the token is for work the handler spawned elsewhere, whose writes
    /// through the fence are refused from then on.
    pub fn cancellation(&self) -> CancellationToken {
        self.fence.stopped().clone()
    }

    /// The attempt's fence, for storage adapters (see `postgres::FencedStore`).
    pub fn fence(&self) -> &Fence {
        &self.fence
    }

    /// The mode this attempt runs in: the task's `status.effectiveMode` —
    /// `Exclusive` for a speculative task quarantined after too many
    /// aborts (design §6).
    pub fn mode(&self) -> batchlease_api::TaskMode {
        self.mode
    }

    /// Runs `body` speculatively over `keys` of `store` (design §6, see
    /// [`crate::speculate`]): read a versioned snapshot, run `body` (which
    /// may register compensations), commit with compare-and-swap in the
    /// same transaction as the task's fenced commit. A lost swap undoes
    /// the round's side effects and returns [`crate::TaskError::Aborted`]
    /// (return it from the handler); in `Exclusive` mode it is retried in
    /// place. An earlier attempt's commit (found at registration) is
    /// returned without running `body` again.
    ///
    /// ```no_run
    /// # async fn f(ctx: batchlease_worker_sdk::TaskContext,
    /// #            store: std::sync::Arc<batchlease_worker_sdk::speculate::memory::MemoryStore>)
    /// #            -> Result<batchlease_worker_sdk::Output, batchlease_worker_sdk::TaskError> {
    /// use batchlease_worker_sdk::speculate::Proposal;
    /// use serde_json::json;
    /// let done = ctx
    ///     .speculate(store, &["counter"], |snap, _undo| async move {
    ///         let n: i64 = snap.state("counter")?.unwrap_or(0);
    ///         Ok(Proposal::new(json!({"was": n})).write("counter", json!(n + 1)))
    ///     })
    ///     .await?;
    /// Ok(batchlease_worker_sdk::Output::json(done.result))
    /// # }
    /// ```
    pub async fn speculate<S, F, Fut>(
        &self,
        store: Arc<S>,
        keys: &[&str],
        body: F,
    ) -> Result<crate::speculate::Speculated, crate::TaskError>
    where
        S: crate::speculate::VersionedStore + 'static,
        F: FnMut(crate::speculate::Snapshot, crate::speculate::Compensations) -> Fut,
        Fut: std::future::Future<Output = Result<crate::speculate::Proposal, crate::TaskError>>,
    {
        let keys: Vec<String> = keys.iter().map(|k| (*k).to_owned()).collect();
        if !self.registered {
            // Without registration a zombie is refused only by its own
            // clocks, and an earlier attempt's commit is not found (the
            // body would run again, then fail on the committed row).
            return Err(Error::Config(
                "speculate needs the attempt registered in storage: configure WorkerBuilder::registry",
            )
            .into());
        }
        crate::speculate::run(
            crate::speculate::Attempt {
                task_uid: &self.task_uid,
                fence: &self.fence,
                rounds: &self.speculation,
                exclusive: self.mode == batchlease_api::TaskMode::Exclusive,
                holds_locks: !self.resource_tokens.is_empty(),
                earlier: self.earlier_commit.as_ref(),
                background: &self.background,
                metrics: &self.metrics,
            },
            store,
            &keys,
            body,
        )
        .await
    }
}

/// What a successful handler returns: a small result for the task's status.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Output {
    /// The result, or why it cannot be one (reported as a permanent
    /// failure of the attempt when the handler returns).
    pub(crate) result: Option<Result<JsonObject, OutputError>>,
}

/// Why a handler's result was refused; see [`Output::try_json`].
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct OutputError {
    /// `ResultTooLarge`, `ResultTooDeep` or `InvalidResult`.
    pub(crate) reason: &'static str,
    pub(crate) message: String,
}

impl OutputError {
    fn of(e: &Error) -> Self {
        let reason = match e {
            Error::TooLarge { .. } => "ResultTooLarge",
            Error::TooDeep { .. } => "ResultTooDeep",
            _ => "InvalidResult",
        };
        Self {
            reason,
            message: e.to_string(),
        }
    }
}

impl Output {
    /// No result.
    pub fn none() -> Self {
        Self::default()
    }

    /// A result: `value` must serialize to a JSON object of at most
    /// [`MAX_RESULT_BYTES`](batchlease_api::MAX_RESULT_BYTES) (it is stored
    /// in the BatchTask's status). If it does not, the attempt fails
    /// permanently with reason `ResultTooLarge`, `ResultTooDeep` or
    /// `InvalidResult` when the
    /// handler returns; use [`Output::try_json`] to find out earlier.
    pub fn json(value: impl Serialize) -> Self {
        Self::try_json(value).unwrap_or_else(|e| Self {
            result: Some(Err(OutputError::of(&e))),
        })
    }

    /// Like [`Output::json`], but reports a refused result at once.
    pub fn try_json(value: impl Serialize) -> Result<Self, Error> {
        let result = JsonObject::from_serialize(&value).map_err(|e| Error::InvalidJson {
            what: "result",
            source: e,
        })?;
        Self::try_raw(result)
    }

    /// A result given as JSON text (any depth), checked like
    /// [`Output::try_json`].
    pub fn try_raw(result: JsonObject) -> Result<Self, Error> {
        check("result", &result, MAX_RESULT_BYTES)?;
        Ok(Self {
            result: Some(Ok(result)),
        })
    }
}

/// Size and depth limits of what the SDK writes into a lease.
fn check(what: &'static str, json: &JsonObject, max_bytes: usize) -> Result<(), Error> {
    // As the API server will store it (it escapes some characters).
    let bytes = json.stored_len();
    if bytes > max_bytes {
        return Err(Error::TooLarge {
            what,
            bytes,
            limit: max_bytes,
        });
    }
    let depth = json.depth();
    if depth > MAX_DEPTH {
        return Err(Error::TooDeep {
            what,
            depth,
            limit: MAX_DEPTH,
        });
    }
    Ok(())
}

/// What a task without a payload deserializes as (see
/// [`TaskContext::payload`]): `null` where `T` takes it, else `{}` — whose
/// error (a missing required field, say) is the one worth reporting.
fn absent_payload<T: DeserializeOwned>() -> Result<T, serde_json::Error> {
    serde_json::from_value(Value::Null)
        .or_else(|_| serde_json::from_value(Value::Object(serde_json::Map::new())))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {

    use serde::Deserialize;

    use super::*;

    #[derive(Debug, Deserialize, PartialEq)]
    struct Defaults {
        #[serde(default)]
        steps: u64,
    }

    #[derive(Debug, Deserialize)]
    #[allow(dead_code)]
    struct Required {
        steps: u64,
    }

    /// A task without a payload used to be dead-lettered as "invalid type:
    /// null, expected struct" by every handler whose payload type has
    /// defaults for all its fields.
    #[test]
    fn an_absent_payload_reads_as_empty_where_the_type_allows_it() {
        assert_eq!(absent_payload::<Defaults>().unwrap(), Defaults { steps: 0 });
        assert_eq!(absent_payload::<Option<Defaults>>().unwrap(), None);
        assert_eq!(absent_payload::<Value>().unwrap(), Value::Null);
        assert!(
            absent_payload::<BTreeMap<String, u64>>()
                .unwrap()
                .is_empty()
        );
        assert_eq!(absent_payload::<()>().unwrap(), ());
    }

    #[test]
    fn an_absent_payload_a_type_needs_says_what_is_missing() {
        let e = absent_payload::<Required>().unwrap_err().to_string();
        assert!(e.contains("missing field `steps`"), "{e}");
    }
}
