//! Keeps the attempt's storage deadline moving while the child runs.
//!
//! Registration records the attempt's deadline (the kill switch's instant,
//! on the database's clock) in the task's row; a child that fences its own
//! transaction with `batchlease_fence(uid, token)` is refused once that
//! deadline passes. The SDK renews the lease every TTL/3, moving the kill
//! instant; this task looks every TTL/6 and, when the instant moved,
//! calls `FencedStore::extend` (at once, too: a renewal may have moved it
//! while registration ran) — so the recorded deadline trails the kill
//! switch by at most TTL/6, the 500 ms clock margin and a round trip, and
//! is never past it.

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
        // Registration recorded the kill instant of its time, which a
        // renewal during a slow registration may already have moved: the
        // first extend is at once.
        let mut extended_to: Option<Instant> = None;
        let mut first = true;
        loop {
            if !first {
                tokio::select! {
                    _ = done.cancelled() => return,
                    _ = fence.killed().cancelled() => return,
                    _ = tokio::time::sleep(every) => {}
                }
            }
            first = false;
            let kill_at = Instant::now() + fence.time_left();
            if extended_to.is_some_and(|to| kill_at < to + MIN_MOVE) {
                continue;
            }
            let r = timeout(every, async {
                store.get().await?.extend(&fence, &task_uid).await
            })
            .await;
            match r {
                Ok(Ok(())) => {
                    extended_to = Some(kill_at);
                    debug!(task = %label, token = fence.token(), "storage deadline extended");
                }
                // A newer attempt registered: this one is a zombie, and
                // its child must stop now, not at the kill switch.
                Ok(Err(e @ Error::Fenced { .. })) => {
                    error!(task = %label, token = fence.token(), error = %e, "storage holds a newer token: stopping the attempt");
                    fence.kill(KillReason::LeaseLost);
                    return;
                }
                // Never registered, or its deadline passed at the storage:
                // nothing to extend any more (the kill switch follows).
                Ok(Err(e @ Error::Revoked { .. })) => {
                    warn!(task = %label, token = fence.token(), error = %e, "the storage deadline cannot be extended: stopping the extender");
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
