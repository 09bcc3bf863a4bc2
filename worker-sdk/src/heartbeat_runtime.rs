//! The runtime that renews leases, apart from the one that runs handlers.
//!
//! A handler is user code: it may compute for seconds without awaiting. On
//! a shared runtime that starves everything queued behind it on its thread
//! — including the heartbeat just spawned into that thread's LIFO slot,
//! which no other thread may steal — so no renewal is sent, the kill timer
//! does not fire, and the lease expires under a worker that still runs the
//! work. Heartbeats and kill timers therefore run on their own runtime with
//! their own thread, talking to the API server through their own client
//! (a `kube::Client` is driven by a task of the runtime that built it).

use kube::Client;
use tokio::runtime::{Handle, Runtime};

use crate::error::Error;

/// A one-thread runtime plus a client built on it.
pub(crate) struct HeartbeatRuntime {
    runtime: Option<Runtime>,
    client: Client,
}

impl HeartbeatRuntime {
    /// Starts the runtime and builds its client from `config`.
    pub(crate) fn start(config: kube::Config) -> Result<Self, Error> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("batchlease-heartbeat")
            .enable_all()
            .build()
            .map_err(|_| Error::Config("cannot start the heartbeat runtime"))?;
        let client = {
            let _inside = runtime.enter();
            Client::try_from(config)
        };
        match client {
            Ok(client) => Ok(Self {
                runtime: Some(runtime),
                client,
            }),
            Err(source) => {
                // Dropping a runtime blocks, which panics inside async code
                // (where `build()` is normally called).
                runtime.shutdown_background();
                Err(Error::Kube {
                    what: "heartbeat client",
                    source,
                })
            }
        }
    }

    /// Where heartbeats are spawned.
    pub(crate) fn handle(&self) -> Option<Handle> {
        self.runtime.as_ref().map(|r| r.handle().clone())
    }

    pub(crate) fn client(&self) -> Client {
        self.client.clone()
    }
}

impl Drop for HeartbeatRuntime {
    fn drop(&mut self) {
        // Dropping a runtime blocks, which is forbidden inside async code.
        // Every attempt holds an `Arc` of this runtime, so it is dropped
        // only after the worker and its last attempt (even one aborted
        // with a dropped `Worker::run`) are gone.
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}
