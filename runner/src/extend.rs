//! Keeps the attempt's storage deadline moving while the child runs.
//!
//! Registration records the attempt's deadline (the kill switch's instant,
//! on the database's clock) in the task's row; a child that fences its own
//! transaction with `batchlease_fence(uid, token)` is refused once that
//! deadline passes. The SDK renews the lease every TTL/3, moving the kill
//! instant; this task looks every TTL/6 and, when the instant moved,
//! calls `FencedStore::extend` — so the recorded deadline is never less
//! than TTL/6 ahead of a live attempt, and never past its kill switch.

use std::sync::Arc;
use std::time::Duration;

use batchlease_worker_sdk::postgres::FencedPool;
use batchlease_worker_sdk::{Error, Fence, KillReason};
use tokio::time::{Instant, timeout};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, warn};

/// A kill instant that moved by less than this is not worth a write.
const MIN_MOVE: Duration = Duration::from_millis(200);

/// Spawns the extender of one attempt; it ends when `done` fires (the
/// handler ended or was dropped) or the fence is revoked.
pub fn spawn(
    store: Arc<FencedPool>,
    fence: Fence,
    task_uid: String,
    label: String,
    done: CancellationToken,
) {
    tokio::spawn(async move {
        let every = (fence.ttl() / 6).max(crate::attempt::MIN_POLL);
        // Registration recorded the claim's kill instant.
        let mut extended_to = Instant::now() + fence.time_left();
        loop {
            tokio::select! {
                _ = done.cancelled() => return,
                _ = fence.killed().cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            let kill_at = Instant::now() + fence.time_left();
            if kill_at < extended_to + MIN_MOVE {
                continue;
            }
            let r = timeout(every, async {
                store.get().await?.extend(&fence, &task_uid).await
            })
            .await;
            match r {
                Ok(Ok(())) => {
                    extended_to = kill_at;
                    debug!(task = %label, token = fence.token(), "storage deadline extended");
                }
                // A newer attempt registered: this one is a zombie, and
                // its child must stop now, not at the kill switch.
                Ok(Err(e @ Error::Fenced { .. })) => {
                    error!(task = %label, token = fence.token(), error = %e, "storage holds a newer token: stopping the attempt");
                    fence.kill(KillReason::LeaseLost);
                    return;
                }
                Ok(Err(e)) => {
                    warn!(task = %label, token = fence.token(), error = %e, kind = e.kind(), "extending the storage deadline failed; retrying");
                }
                Err(_) => {
                    warn!(task = %label, token = fence.token(), "extending the storage deadline timed out; retrying");
                }
            }
        }
    });
}
