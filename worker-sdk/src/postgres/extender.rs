//! Keeps an attempt's recorded storage deadline moving while a client of
//! its own runs — a command's `psql`, a Python handler's psycopg — that
//! fences its transactions with `batchlease_fence(uid, token)` and so
//! checks the deadline registration recorded.
//!
//! The SDK renews the lease every TTL/3, moving the kill instant; the
//! extender looks every TTL/6 and, when the instant moved, calls
//! [`FencedStore::extend`](super::FencedStore::extend) — at once at the
//! start too, since a renewal may have moved it while registration ran. So
//! the recorded deadline trails the kill switch by at most TTL/6, the
//! clock margin and a round trip, and is never past it.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::{Instant, timeout};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, warn};

use super::FencedPool;
use crate::error::Error;
use crate::fence::{Fence, KillReason};

/// A kill instant that moved by less than this is not worth a write.
const MIN_MOVE: Duration = Duration::from_millis(200);

/// The floor of the look interval: a TTL under the CRD's minimum must not
/// make it spin.
const MIN_EVERY: Duration = Duration::from_millis(50);

/// Spawns the extender of one attempt (`fence`, task `task_uid`); it ends
/// when `done` fires (the handler ended or was dropped), when the kill
/// switch fires, or when storage says the attempt is over. Storage holding
/// a newer token fires the kill switch: the client must stop now, not at
/// the kill instant.
pub fn spawn_extender(
    store: Arc<FencedPool>,
    fence: Fence,
    task_uid: String,
    done: CancellationToken,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let every = (fence.ttl() / 6).max(MIN_EVERY);
        let token = fence.token();
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
                    debug!(task_uid = %task_uid, token, "storage deadline extended");
                }
                Ok(Err(e @ Error::Fenced { .. })) => {
                    error!(task_uid = %task_uid, token, error = %e, "storage holds a newer token: stopping the attempt");
                    fence.kill(KillReason::LeaseLost);
                    return;
                }
                // Never registered, or late at the storage: nothing to
                // extend any more (the kill switch follows).
                Ok(Err(e @ Error::Revoked { .. })) => {
                    warn!(task_uid = %task_uid, token, error = %e, "the storage deadline cannot be extended: stopping the extender");
                    return;
                }
                Ok(Err(e)) => {
                    warn!(task_uid = %task_uid, token, error = %e, kind = e.kind(), "extending the storage deadline failed; retrying");
                }
                Err(_) => {
                    warn!(task_uid = %task_uid, token, "extending the storage deadline timed out; retrying");
                }
            }
        }
    })
}
