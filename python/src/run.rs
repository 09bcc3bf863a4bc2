//! `Worker.run`: the SDK's worker on a Tokio runtime of its own, calling the
//! Python handler on blocking threads.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use batchlease_worker_sdk::postgres::{ConnectOptions, FencedPool, migrate};
use batchlease_worker_sdk::{Output, TaskContext, TaskError, WorkerBuilder};
use pyo3::prelude::*;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::context::{Context, dumps_object};
use crate::errors::{RunError, task_error};

/// What `batchlease.Worker(...)` was given.
#[derive(Debug, Clone)]
pub struct Config {
    pub namespace: String,
    pub queues: Vec<String>,
    pub slots: usize,
    pub identity: Option<String>,
    pub database_url: Option<String>,
    pub drain_grace: Duration,
}

/// Logs to stderr (`BATCHLEASE_LOG` or `RUST_LOG`, default `info,kube=warn`).
fn init_tracing() {
    let filter = std::env::var("BATCHLEASE_LOG")
        .ok()
        .and_then(|f| tracing_subscriber::EnvFilter::try_new(f).ok())
        .or_else(|| tracing_subscriber::EnvFilter::try_from_default_env().ok())
        .unwrap_or_else(|| tracing_subscriber::EnvFilter::new("info,kube=warn"));
    // A second `run` in one process keeps the first subscriber.
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_env_filter(filter)
        .try_init();
}

/// Runs the worker until SIGTERM/SIGINT; called with the GIL released.
pub fn run(config: Config, handler: Py<PyAny>, is_async: bool) -> Result<(), RunError> {
    init_tracing();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("batchlease-worker")
        .enable_all()
        .build()
        .map_err(RunError::Runtime)?;
    let outcome = runtime.block_on(serve(config, Arc::new(handler), is_async));
    // A sync handler the kill switch could not stop may still run on its
    // blocking thread: do not wait for it.
    runtime.shutdown_timeout(Duration::from_secs(1));
    outcome
}

async fn serve(config: Config, handler: Arc<Py<PyAny>>, is_async: bool) -> Result<(), RunError> {
    let kube_config = kube::Config::infer().await.map_err(RunError::KubeConfig)?;
    let mut builder = WorkerBuilder::new(kube_config, &config.namespace)
        .slots(config.slots)
        .drain_grace(config.drain_grace)
        // A sync handler's process group is SIGKILLed within the 50 ms poll
        // of the kill switch (pysrc/batchlease/_process.py): a killed
        // attempt is given back a second after the kill at the earliest.
        .stop_budget(Duration::from_secs(1));
    for queue in &config.queues {
        builder = builder.queue(queue);
    }
    if let Some(id) = &config.identity {
        builder = builder.identity(id);
    }
    let pool = match &config.database_url {
        Some(url) => {
            let options =
                ConnectOptions::parse(url).map_err(|e| RunError::DatabaseUrl(e.to_string()))?;
            // A connection per slot for registrations and the handler's
            // SDK calls, and one per slot for keeping deadlines extended.
            let pool = Arc::new(FencedPool::new(
                config.slots * 2,
                builder.metrics().clone(),
                move || options.connect(),
            ));
            migrate(pool.get().await?.client()).await?;
            builder = builder.registry(pool.clone());
            Some(pool)
        }
        None => None,
    };
    let worker = builder.build()?;
    info!(
        identity = worker.identity(),
        is_async, "python worker starting"
    );
    worker
        .run(
            move |ctx| {
                let (handler, pool) = (handler.clone(), pool.clone());
                async move { attempt(ctx, handler, is_async, pool).await }
            },
            shutdown(),
        )
        .await?;
    Ok(())
}

async fn shutdown() {
    batchlease_worker_sdk::shutdown_signal().await;
    info!("signal: draining");
}

/// One attempt: the deadline in storage kept extended, the handler on a
/// blocking thread, an asyncio handler cancelled when the kill switch fires
/// or the attempt is dropped (drain over).
async fn attempt(
    ctx: TaskContext,
    handler: Arc<Py<PyAny>>,
    is_async: bool,
    pool: Option<Arc<FencedPool>>,
) -> Result<Output, TaskError> {
    // Ends the extender when the attempt ends (or is dropped).
    let ended = CancellationToken::new();
    let _ended = ended.clone().drop_guard();
    if let Some(pool) = pool {
        batchlease_worker_sdk::postgres::spawn_extender(
            pool,
            ctx.fence().clone(),
            ctx.task_uid().to_owned(),
            ended.clone(),
        );
    }
    let finished = CancellationToken::new();
    let running: Arc<Mutex<Option<AsyncRun>>> = Arc::new(Mutex::new(None));
    if is_async {
        tokio::spawn(cancel_on_kill(
            ctx.cancellation(),
            ended.clone(),
            finished.clone(),
            running.clone(),
        ));
    }
    let call = {
        let (ctx, finished, running) = (ctx.clone(), finished.clone(), running.clone());
        let dropped = ended.clone();
        let runtime = tokio::runtime::Handle::current();
        tokio::task::spawn_blocking(move || {
            let _finished = finished.drop_guard();
            Python::attach(|py| {
                let pyctx = Context::new(py, ctx.clone(), dropped, runtime).map_err(|e| {
                    TaskError::permanent(format!("payload or checkpoint: {e}"))
                        .with_reason("InvalidPayload")
                })?;
                call_handler(py, &handler, ctx, pyctx, is_async, &running)
            })
        })
    };
    match call.await {
        Ok(result) => result,
        Err(e) => Err(
            TaskError::retryable(format!("the handler's thread failed: {e}"))
                .with_reason("HandlerPanicked"),
        ),
    }
}

/// An asyncio handler's loop and task, to cancel it from another thread.
struct AsyncRun {
    event_loop: Py<PyAny>,
    task: Py<PyAny>,
}

/// Cancels the asyncio task when the kill switch fires or the attempt is
/// dropped before the handler finished (`task.cancel()` on the handler's
/// loop: the coroutine sees `CancelledError` at its next `await`).
async fn cancel_on_kill(
    killed: CancellationToken,
    ended: CancellationToken,
    finished: CancellationToken,
    running: Arc<Mutex<Option<AsyncRun>>>,
) {
    tokio::select! {
        biased;
        _ = finished.cancelled() => return,
        _ = killed.cancelled() => {}
        _ = ended.cancelled() => {}
    }
    if finished.is_cancelled() {
        return;
    }
    debug!("cancelling the asyncio handler");
    // Never take the GIL on a runtime worker thread.
    let _ = tokio::task::spawn_blocking(move || {
        Python::attach(|py| {
            let guard = running.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(run) = guard.as_ref() {
                let cancel = run.task.bind(py).getattr("cancel");
                let scheduled = cancel.and_then(|c| {
                    run.event_loop
                        .bind(py)
                        .call_method1("call_soon_threadsafe", (c,))
                });
                if let Err(e) = scheduled {
                    // The loop is closed: the handler has returned.
                    debug!(error = %e, "asyncio handler not cancelled");
                }
            }
        })
    })
    .await;
}

/// Calls the handler with the GIL held (on a blocking thread) and maps its
/// outcome.
fn call_handler(
    py: Python<'_>,
    handler: &Py<PyAny>,
    ctx: TaskContext,
    pyctx: Context,
    is_async: bool,
    running: &Mutex<Option<AsyncRun>>,
) -> Result<Output, TaskError> {
    let killed = ctx.cancellation();
    let returned = if is_async {
        run_coroutine(py, handler, pyctx, &killed, running)
    } else {
        handler.bind(py).call1((pyctx,))
    };
    match returned {
        Ok(value) if value.is_none() => Ok(Output::none()),
        Ok(value) => {
            let result = dumps_object(py, &value, "the handler's result")
                .map_err(|e| TaskError::permanent(e.to_string()).with_reason("InvalidResult"))?;
            Output::try_raw(result).map_err(TaskError::from)
        }
        Err(e) => {
            let mapped = task_error(py, &e);
            if !matches!(&mapped, TaskError::Retryable { reason, .. } if reason == "Cancelled") {
                // The traceback, on stderr with the worker's logs.
                e.display(py);
            }
            warn!(error = %mapped, "handler failed");
            Err(mapped)
        }
    }
}

/// `asyncio.new_event_loop().run_until_complete(handler(ctx))`, the task
/// published in `running` for [`cancel_on_kill`].
fn run_coroutine<'py>(
    py: Python<'py>,
    handler: &Py<PyAny>,
    pyctx: Context,
    killed: &CancellationToken,
    running: &Mutex<Option<AsyncRun>>,
) -> PyResult<Bound<'py, PyAny>> {
    let asyncio = py.import("asyncio")?;
    let event_loop = asyncio.call_method0("new_event_loop")?;
    let outcome = (|| {
        let coroutine = handler.bind(py).call1((pyctx,))?;
        let task = event_loop.call_method1("create_task", (coroutine,))?;
        {
            let mut guard = running.lock().unwrap_or_else(|e| e.into_inner());
            *guard = Some(AsyncRun {
                event_loop: event_loop.clone().unbind(),
                task: task.clone().unbind(),
            });
            // Killed before the task was published: cancel it now.
            if killed.is_cancelled() {
                task.call_method0("cancel")?;
            }
        }
        event_loop.call_method1("run_until_complete", (task,))
    })();
    {
        let mut guard = running.lock().unwrap_or_else(|e| e.into_inner());
        *guard = None;
    }
    if let Err(e) = event_loop.call_method0("close") {
        debug!(error = %e, "closing the handler's event loop");
    }
    outcome
}
