//! `batchlease.Context`: what a Python handler gets for one attempt.

use batchlease_worker_sdk::{BatchTaskSpec, Child, JsonObject, Subgraph, TaskContext};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use tokio_util::sync::CancellationToken;

use crate::errors::sdk_error;

/// The context of one attempt (see the stubs for the Python API).
#[pyclass(module = "batchlease._native", name = "Context", frozen)]
#[derive(Debug)]
pub struct Context {
    ctx: TaskContext,
    /// Fires when the SDK dropped the attempt (the drain's grace is over).
    dropped: CancellationToken,
    /// The worker's runtime, for the SDK's async calls (`spawn`, …) made
    /// from the handler's thread with the GIL released.
    runtime: tokio::runtime::Handle,
    payload: Py<PyAny>,
    previous_checkpoint: Py<PyAny>,
    earlier_commit: Py<PyAny>,
}

/// `json.loads(text)`.
pub fn loads<'py>(py: Python<'py>, text: &str) -> PyResult<Bound<'py, PyAny>> {
    py.import("json")?.call_method1("loads", (text,))
}

/// `json.dumps(value)` as a JSON object, or a `TypeError`/`ValueError`.
pub fn dumps_object(py: Python<'_>, value: &Bound<'_, PyAny>, what: &str) -> PyResult<JsonObject> {
    if !value.is_instance_of::<PyDict>() {
        return Err(pyo3::exceptions::PyTypeError::new_err(format!(
            "{what} must be a dict (a JSON object), not {}",
            value.get_type().name()?
        )));
    }
    let kwargs = PyDict::new(py);
    kwargs.set_item("allow_nan", false)?;
    let text: String = py
        .import("json")?
        .call_method("dumps", (value,), Some(&kwargs))?
        .extract()?;
    JsonObject::from_text(text)
        .map_err(|e| pyo3::exceptions::PyValueError::new_err(format!("{what}: {e}")))
}

impl Context {
    /// Builds the Python view of `ctx` (payload and checkpoint parsed once).
    pub fn new(
        py: Python<'_>,
        ctx: TaskContext,
        dropped: CancellationToken,
        runtime: tokio::runtime::Handle,
    ) -> PyResult<Self> {
        let payload = match ctx.payload_raw() {
            Some(p) => loads(py, p.as_str())?.unbind(),
            None => PyDict::new(py).into_any().unbind(),
        };
        let previous_checkpoint = match ctx.previous_checkpoint_raw() {
            Some(c) => loads(py, c.as_str())?.unbind(),
            None => py.None(),
        };
        let earlier_commit = match ctx.earlier_commit() {
            Some(e) => {
                let d = PyDict::new(py);
                d.set_item("token", e.token)?;
                match &e.payload {
                    Some(p) => d.set_item("payload", loads(py, &p.to_string())?)?,
                    None => d.set_item("payload", py.None())?,
                }
                d.into_any().unbind()
            }
            None => py.None(),
        };
        Ok(Self {
            ctx,
            dropped,
            runtime,
            payload,
            previous_checkpoint,
            earlier_commit,
        })
    }
}

#[pymethods]
impl Context {
    /// `spec.payload` as a dict (`{}` when the task has none).
    #[getter]
    fn payload(&self, py: Python<'_>) -> Py<PyAny> {
        self.payload.clone_ref(py)
    }

    /// The attempt's fencing token.
    #[getter]
    fn token(&self) -> i64 {
        self.ctx.fencing_token()
    }

    #[getter]
    fn task_uid(&self) -> &str {
        self.ctx.task_uid()
    }

    #[getter]
    fn name(&self) -> &str {
        self.ctx.task_name()
    }

    #[getter]
    fn namespace(&self) -> &str {
        self.ctx.namespace()
    }

    #[getter]
    fn queue(&self) -> &str {
        self.ctx.queue()
    }

    /// 1 for the first attempt, 2 for the first retry, …
    #[getter]
    fn attempt(&self) -> i32 {
        self.ctx.attempt()
    }

    /// The previous attempt's last checkpoint (a dict), or None.
    #[getter]
    fn previous_checkpoint(&self, py: Python<'_>) -> Py<PyAny> {
        self.previous_checkpoint.clone_ref(py)
    }

    /// `{"token": int, "payload": dict | None}` when an earlier attempt's
    /// commit stuck (found at registration; only with a database), else
    /// None.
    #[getter]
    fn earlier_commit(&self, py: Python<'_>) -> Py<PyAny> {
        self.earlier_commit.clone_ref(py)
    }

    /// Records progress (a dict); it travels with the next renewal.
    fn checkpoint(&self, py: Python<'_>, progress: &Bound<'_, PyAny>) -> PyResult<()> {
        let cp = dumps_object(py, progress, "checkpoint")?;
        self.ctx.checkpoint(cp).map_err(|e| sdk_error(py, e))
    }

    /// True once the kill switch fired, or the worker gave the attempt
    /// up (its drain grace is over): stop, nothing you write will be
    /// accepted.
    fn is_cancelled(&self) -> bool {
        self.ctx.cancellation().is_cancelled() || self.dropped.is_cancelled()
    }

    /// Raises `batchlease.Revoked` if the attempt may no longer write.
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        self.ctx.fence().check().map_err(|e| sdk_error(py, e))
    }

    /// Seconds left before the kill switch fires unless a renewal succeeds.
    fn time_left(&self) -> f64 {
        self.ctx.fence().time_left().as_secs_f64()
    }

    /// `(sql, params)` fencing the caller's own transaction:
    /// `cur.execute(*ctx.fence_sql())` first thing after BEGIN.
    fn fence_sql<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let params = PyTuple::new(
            py,
            [
                self.ctx.task_uid().into_pyobject(py)?.into_any(),
                self.ctx.fencing_token().into_pyobject(py)?.into_any(),
            ],
        )?;
        PyTuple::new(
            py,
            [
                "SELECT batchlease_fence(%s, %s)"
                    .into_pyobject(py)?
                    .into_any(),
                params.into_any(),
            ],
        )
    }

    /// Creates the sub-graph `children` (each `{"spec": {...BatchTask
    /// spec...}, "after": [sibling indexes]}`) under this task,
    /// idempotently per `version` (the SDK's `TaskContext::spawn`); returns
    /// the children's names. Blocks (GIL released) until created.
    fn spawn(
        &self,
        py: Python<'_>,
        version: String,
        children: Vec<Bound<'_, PyAny>>,
    ) -> PyResult<Vec<String>> {
        let mut graph = Subgraph::new(version);
        for (i, child) in children.iter().enumerate() {
            let value = dumps_object(py, child, "a child")?;
            let parsed: ChildSpec = value
                .parse()
                .map_err(|e| pyo3::exceptions::PyValueError::new_err(format!("child {i}: {e}")))?;
            graph.push(Child {
                spec: parsed.spec,
                after: parsed.after,
            });
        }
        let (ctx, runtime) = (self.ctx.clone(), self.runtime.clone());
        py.detach(move || runtime.block_on(async move { ctx.spawn(&graph).await }))
            .map_err(|e| sdk_error(py, e))
    }

    /// The results of the task's `dependsOn` tasks: name to result (a dict,
    /// or None for a dependency that succeeded without one). Blocks (GIL
    /// released) while they are read.
    fn dependency_results<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (ctx, runtime) = (self.ctx.clone(), self.runtime.clone());
        let results = py
            .detach(move || runtime.block_on(async move { ctx.dependency_results().await }))
            .map_err(|e| sdk_error(py, e))?;
        let out = PyDict::new(py);
        for (name, result) in results {
            match result {
                Some(r) => out.set_item(name, loads(py, r.as_str())?)?,
                None => out.set_item(name, py.None())?,
            }
        }
        Ok(out)
    }

    fn __repr__(&self) -> String {
        format!(
            "Context(name={:?}, namespace={:?}, token={}, attempt={})",
            self.ctx.task_name(),
            self.ctx.namespace(),
            self.ctx.fencing_token(),
            self.ctx.attempt()
        )
    }
}

/// One child as `Context.spawn` takes it.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ChildSpec {
    spec: BatchTaskSpec,
    #[serde(default)]
    after: Vec<u32>,
}
