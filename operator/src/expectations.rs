//! Leases this process created and the watch has not shown yet.
//!
//! The lease cache lags the writes that name a lease: a pass that follows
//! the status write of an issue often runs before the watch delivered the
//! lease. Without a memory of the create, such a pass would take the lease
//! for gone and (rightly, by the protocol) retire its token. This is the
//! controller-runtime "expectations" idea: remember in-flight creates for a
//! short while; past that, a direct read decides (see `decide::Lookup`).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// How long a create is expected to show up in the watch. Past this, the
/// reconciler reads the lease directly instead of waiting.
pub const EXPECT_FOR: Duration = Duration::from_secs(10);

type Key = (String, String);

/// In-flight lease creates, by (namespace, name).
#[derive(Debug, Default)]
pub struct Expectations {
    creates: Mutex<HashMap<Key, Instant>>,
}

impl Expectations {
    /// A create of `name` is about to be sent.
    pub fn expect(&self, namespace: &str, name: &str, now: Instant) {
        let mut m = self.lock();
        m.retain(|_, at| now.saturating_duration_since(*at) < EXPECT_FOR);
        m.insert((namespace.to_owned(), name.to_owned()), now);
    }

    /// True while a create of `name` is recent and not yet seen.
    pub fn pending(&self, namespace: &str, name: &str, now: Instant) -> bool {
        self.lock()
            .get(&(namespace.to_owned(), name.to_owned()))
            .is_some_and(|at| now.saturating_duration_since(*at) < EXPECT_FOR)
    }

    /// The lease was seen, or its create definitely failed.
    pub fn done(&self, namespace: &str, name: &str) {
        self.lock().remove(&(namespace.to_owned(), name.to_owned()));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Instant>> {
        self.creates.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expectations_last_until_seen_or_stale() {
        let e = Expectations::default();
        let t0 = Instant::now();
        assert!(!e.pending("ns", "a-1", t0));
        e.expect("ns", "a-1", t0);
        assert!(e.pending("ns", "a-1", t0 + Duration::from_secs(9)));
        assert!(!e.pending("ns", "a-1", t0 + EXPECT_FOR));
        assert!(!e.pending("other", "a-1", t0));
        e.done("ns", "a-1");
        assert!(!e.pending("ns", "a-1", t0));
        // Stale entries are dropped when new ones come.
        e.expect("ns", "b-1", t0);
        e.expect("ns", "c-1", t0 + EXPECT_FOR);
        assert_eq!(e.lock().len(), 1);
    }
}
