//! Readiness: counts the watches that have not finished their initial
//! list. A leaf, apart from `controller.rs` (which registers its watches)
//! so that `metrics.rs`, which reports it, imports no controller code.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Counts the watches that have not finished their initial list yet; the
/// operator is ready when it reaches zero.
#[derive(Debug, Default)]
pub struct SyncCounter(AtomicUsize, tokio::sync::Notify);

impl SyncCounter {
    /// True once every registered watch delivered its initial list.
    pub fn synced(&self) -> bool {
        self.0.load(Ordering::Acquire) == 0
    }

    /// Resolves once [`SyncCounter::synced`] is true.
    pub async fn wait(&self) {
        loop {
            let notified = self.1.notified();
            if self.synced() {
                return;
            }
            notified.await;
        }
    }

    /// Registers one watch; call the returned closure on each event.
    pub fn register(self: &Arc<Self>) -> impl Fn(bool) + Send + Sync + 'static {
        self.0.fetch_add(1, Ordering::AcqRel);
        let this = self.clone();
        let done = AtomicBool::new(false);
        move |init_done| {
            if init_done
                && !done.swap(true, Ordering::AcqRel)
                && this.0.fetch_sub(1, Ordering::AcqRel) == 1
            {
                this.1.notify_waiters();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn ready_only_after_every_watch_listed_once() {
        let counter = Arc::new(SyncCounter::default());
        let leases = counter.register();
        let tasks = counter.register();
        assert!(!counter.synced());
        leases(false); // an Apply before the list ended
        leases(true);
        assert!(!counter.synced(), "the task watch has not listed yet");
        let waiter = tokio::spawn({
            let c = counter.clone();
            async move { c.wait().await }
        });
        tasks(true);
        assert!(counter.synced());
        tokio::time::timeout(Duration::from_secs(1), waiter)
            .await
            .unwrap()
            .unwrap();
        // A later relist (InitDone again) must not count twice.
        leases(true);
        assert!(counter.synced());
    }
}
