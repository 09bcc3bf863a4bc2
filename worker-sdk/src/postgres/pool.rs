//! [`FencedPool`]: one [`FencedStore`] per concurrent user, opened lazily,
//! reused, and replaced when its session ended.

use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::sync::Mutex;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::sync::{Semaphore, SemaphorePermit};
use tokio_postgres::Client;

use super::{DEFAULT_CLOCK_SKEW, FencedStore};
use crate::error::Error;
use crate::fence::Fence;
use crate::metrics::WorkerMetrics;
use crate::registry::{EarlierCommit, Registry};

/// Opens one connection for a [`FencedPool`] (and spawns its connection
/// task).
type Connect =
    Box<dyn Fn() -> BoxFuture<'static, Result<Client, tokio_postgres::Error>> + Send + Sync>;

/// Up to `size` [`FencedStore`]s, one per concurrent user: the worker's
/// slots register and commit at once instead of queueing behind one
/// connection (`Mutex<FencedStore>`), where one slow commit — or a holder
/// paused inside its transaction — stalls every other slot.
///
/// Connections are opened lazily and reused. One whose session ended (the
/// server ended an idle transaction's session, a restart, a network
/// failure) is dropped when it comes back and replaced by a new one on a
/// later [`FencedPool::get`], instead of failing every later write as a
/// single store would. The write that found it broken fails with
/// [`Error::Postgres`]: the attempt ends retryable, never with a doubtful
/// commit — each write is one transaction, and a dropped transaction rolls
/// back.
pub struct FencedPool {
    idle: Mutex<Vec<FencedStore>>,
    permits: Semaphore,
    size: usize,
    connect: Connect,
    metrics: WorkerMetrics,
    skew: Duration,
}

impl std::fmt::Debug for FencedPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FencedPool")
            .field("size", &self.size)
            .field("available", &self.permits.available_permits())
            .field("skew", &self.skew)
            .finish_non_exhaustive()
    }
}

impl FencedPool {
    /// A pool of at most `size` connections (at least one), each opened
    /// by `connect`, which also spawns the connection's task. Size it to
    /// the worker's slots: a slot uses at most one connection at a time.
    /// `metrics` counts rejected commits, as for [`FencedStore::new`].
    pub fn new<F, Fut>(size: usize, metrics: WorkerMetrics, connect: F) -> Self
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Client, tokio_postgres::Error>> + Send + 'static,
    {
        let size = size.max(1);
        Self {
            idle: Mutex::new(Vec::with_capacity(size)),
            permits: Semaphore::new(size),
            size,
            connect: Box::new(move || connect().boxed()),
            metrics,
            skew: DEFAULT_CLOCK_SKEW,
        }
    }

    /// The deadline margin of every store of the pool (see
    /// [`FencedStore::with_clock_skew`]).
    #[must_use]
    pub fn with_clock_skew(mut self, skew: Duration) -> Self {
        self.skew = skew;
        for store in self.idle.get_mut().unwrap_or_else(|e| e.into_inner()) {
            store.skew = skew;
        }
        self
    }

    /// A store for the caller alone, until the returned guard is dropped:
    /// an idle connection, or a new one while fewer than `size` are out.
    /// Waits while all are in use.
    pub async fn get(&self) -> Result<PooledStore<'_>, Error> {
        let Ok(permit) = self.permits.acquire().await else {
            // The semaphore is never closed.
            return Err(Error::Config("the connection pool was closed"));
        };
        let reused = {
            let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
            // A connection may have ended while idle; drop those.
            idle.retain(|s| !s.client.is_closed());
            idle.pop()
        };
        let store = match reused {
            Some(store) => store,
            None => {
                let client = (self.connect)().await.map_err(|source| Error::Postgres {
                    what: "connect",
                    source,
                })?;
                FencedStore::new(client, self.metrics.clone()).with_clock_skew(self.skew)
            }
        };
        Ok(PooledStore {
            store: Some(store),
            pool: self,
            _permit: permit,
        })
    }
}

/// A store of a [`FencedPool`], back to the pool when dropped (unless its
/// connection ended). Use it as a [`FencedStore`].
#[derive(Debug)]
pub struct PooledStore<'p> {
    /// `Some` until dropped.
    store: Option<FencedStore>,
    pool: &'p FencedPool,
    // Released after `drop` put the store back, so a waiter finds it idle.
    _permit: SemaphorePermit<'p>,
}

impl Deref for PooledStore<'_> {
    type Target = FencedStore;

    fn deref(&self) -> &FencedStore {
        // Taken only in `drop`.
        self.store.as_ref().unwrap_or_else(|| unreachable!())
    }
}

impl DerefMut for PooledStore<'_> {
    fn deref_mut(&mut self) -> &mut FencedStore {
        self.store.as_mut().unwrap_or_else(|| unreachable!())
    }
}

impl Drop for PooledStore<'_> {
    fn drop(&mut self) {
        // A write cancelled mid-transaction left its ROLLBACK queued on the
        // connection (tokio-postgres sends it when the transaction is
        // dropped), ahead of anything the next user sends: the connection
        // is clean to reuse. One whose session ended is not.
        if let Some(store) = self.store.take()
            && !store.client.is_closed()
        {
            self.pool
                .idle
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(store);
        }
    }
}

/// Each registration on a connection of its own (see [`FencedPool`]).
impl Registry for FencedPool {
    fn register<'a>(
        &'a self,
        task_uid: &'a str,
        fence: &'a Fence,
    ) -> BoxFuture<'a, Result<Option<EarlierCommit>, Error>> {
        async move { self.get().await?.register(fence, task_uid).await }.boxed()
    }
}
