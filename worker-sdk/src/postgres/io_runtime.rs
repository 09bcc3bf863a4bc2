//! The runtime that drives the fenced store's PostgreSQL connections,
//! apart from the one that runs handlers.
//!
//! A `tokio-postgres` client is only a handle: its requests are carried by
//! a connection task. Spawned on the handlers' runtime, that task can sit
//! behind a handler that computes without awaiting — in the LIFO slot of
//! the handler's thread, which no other thread may steal — and every slot's
//! storage call waits with it: registrations time out and attempts are
//! given back although the database is idle (seen in CI with a CPU-bound
//! handler on one slot of two). So connections are opened and driven on a
//! one-thread runtime of their own, started on first use; the callers'
//! futures only exchange messages with it. The same reason put heartbeats
//! on a runtime of their own (`heartbeat_runtime.rs`).

use std::sync::OnceLock;

use tokio::runtime::{Handle, Runtime};

static IO: OnceLock<Option<Runtime>> = OnceLock::new();

/// The connections' runtime, started on first use; `None` if the process
/// cannot start a thread (then connections stay on the caller's runtime).
pub(crate) fn handle() -> Option<Handle> {
    IO.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("batchlease-postgres")
            .enable_all()
            .build()
            .ok()
    })
    .as_ref()
    .map(|r| r.handle().clone())
}
