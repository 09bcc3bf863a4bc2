//! `batchlease._native`: the Python binding of the batchlease worker SDK.
//!
//! The SDK does everything that must not depend on Python: claims, the
//! heartbeat (on its own runtime thread, never touching the GIL), the kill
//! switch, registration of each attempt's fencing token in PostgreSQL and
//! keeping its recorded deadline extended. Python code runs only on
//! blocking threads (`spawn_blocking`), never on the runtime's workers, so a
//! handler that holds the GIL for minutes cannot stall a renewal.
//!
//! The pure-Python half (`pysrc/batchlease/__init__.py`) defines the
//! exceptions; this module looks them up there when it raises or maps them.

mod context;
mod errors;
mod run;

use pyo3::prelude::*;

pub use context::Context;

/// A worker: claims its queues' tasks and runs a Python handler for each.
#[pyclass(module = "batchlease._native", name = "Worker", frozen)]
#[derive(Debug, Clone)]
pub struct Worker {
    config: run::Config,
}

#[pymethods]
impl Worker {
    #[new]
    #[pyo3(signature = (namespace, queues = vec!["default".to_owned()], slots = 1, identity = None, database_url = None, drain_grace_seconds = 20.0))]
    fn new(
        namespace: String,
        queues: Vec<String>,
        slots: usize,
        identity: Option<String>,
        database_url: Option<String>,
        drain_grace_seconds: f64,
    ) -> PyResult<Self> {
        if queues.is_empty() || queues.iter().any(|q| q.trim().is_empty()) {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "queues must name at least one queue, none of them empty",
            ));
        }
        if slots == 0 {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "slots must be at least 1",
            ));
        }
        if !(drain_grace_seconds.is_finite() && drain_grace_seconds >= 0.0) {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "drain_grace_seconds must be a non-negative number",
            ));
        }
        Ok(Self {
            config: run::Config {
                namespace,
                queues,
                slots,
                identity,
                database_url,
                drain_grace: std::time::Duration::from_secs_f64(drain_grace_seconds),
            },
        })
    }

    /// Runs `handler` for each claimed task until SIGTERM or SIGINT, then
    /// drains. Blocks, with the GIL released.
    fn run(&self, py: Python<'_>, handler: Py<PyAny>) -> PyResult<()> {
        let is_async = py
            .import("inspect")?
            .call_method1("iscoroutinefunction", (handler.bind(py),))?
            .is_truthy()?;
        if !is_async && !handler.bind(py).is_callable() {
            return Err(pyo3::exceptions::PyTypeError::new_err(
                "handler must be a function taking the task's context",
            ));
        }
        let config = self.config.clone();
        let outcome = py.detach(move || run::run(config, handler, is_async));
        // The worker's own SIGINT handler chains to Python's, which only
        // notes the signal: run Python's handlers now, and take the
        // KeyboardInterrupt of the SIGINT that made the worker drain as
        // the clean end it was (a user's handler's other errors propagate).
        if let Err(e) = py.check_signals()
            && !e.is_instance_of::<pyo3::exceptions::PyKeyboardInterrupt>(py)
        {
            return Err(e);
        }
        outcome.map_err(|e| errors::run_error(py, &e))
    }

    fn __repr__(&self) -> String {
        format!(
            "Worker(namespace={:?}, queues={:?}, slots={})",
            self.config.namespace, self.config.queues, self.config.slots
        )
    }
}

/// The extension module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Worker>()?;
    m.add_class::<Context>()?;
    Ok(())
}
