//! The backoff both the operator and the workers use for their watches.
//!
//! kube's default (client-go's reflector: 0.8 s doubling to 30 s, reset
//! only after 120 s without errors) is kind to a struggling API server but
//! leaves a controller idle for up to half a minute after a restart of
//! kube-apiserver or etcd — leases unexpired, offers unclaimed. One leader
//! (standbys do not watch) and a few workers per queue are a small load, so
//! retry quickly: 100 ms doubling to 2 s, with up to 25 % jitter, reset by
//! the first success.

use std::time::Duration;

use kube::runtime::utils::Backoff;

/// Quick, capped, jittered exponential backoff for watch streams.
#[derive(Debug, Clone)]
pub struct WatchBackoff {
    next: Duration,
    jitter: fn() -> f64,
}

const FIRST: Duration = Duration::from_millis(100);
const CAP: Duration = Duration::from_secs(2);

impl WatchBackoff {
    /// A backoff whose jitter comes from `jitter` (uniform in [0, 1)).
    pub fn new(jitter: fn() -> f64) -> Self {
        Self {
            next: FIRST,
            jitter,
        }
    }
}

impl Iterator for WatchBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let base = self.next;
        self.next = (self.next * 2).min(CAP);
        Some(base + base.mul_f64((self.jitter)().clamp(0.0, 1.0) / 4.0))
    }
}

impl Backoff for WatchBackoff {
    fn reset(&mut self) {
        self.next = FIRST;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_to_the_cap_and_resets() {
        let mut b = WatchBackoff::new(|| 0.0);
        let got: Vec<u128> = (0..7).map(|_| b.next().unwrap().as_millis()).collect();
        assert_eq!(got, [100, 200, 400, 800, 1600, 2000, 2000]);
        b.reset();
        assert_eq!(b.next(), Some(FIRST));
        let mut j = WatchBackoff::new(|| 0.999);
        assert!(j.next().unwrap() < Duration::from_millis(125));
    }
}
