//! Retry delays: `min(max, initial·multiplier^n)` plus uniform jitter in
//! `[0, delay/2]` (design §2). Pure, so the bounds are table-tested.

use std::time::Duration;

use batchlease_api::BackoffSpec;

/// Delay before retry number `n` (0 for the first retry). `jitter` is a
/// uniform sample in `[0, 1)` supplied by the caller, so this stays pure.
pub fn retry_delay(spec: &BackoffSpec, n: u32, jitter: f64) -> Duration {
    let initial = spec.initial_seconds.max(1) as f64;
    let max = spec.max_seconds.max(spec.initial_seconds).max(1) as f64;
    let multiplier = spec.multiplier.max(1) as f64;
    // powi saturates to infinity for large n; min() brings it back to max.
    let base = (initial * multiplier.powi(n.min(1_000) as i32)).min(max);
    let jitter = jitter.clamp(0.0, 1.0) * base / 2.0;
    Duration::from_secs_f64(base + jitter)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(initial: i64, max: i64, multiplier: i64) -> BackoffSpec {
        BackoffSpec {
            initial_seconds: initial,
            max_seconds: max,
            multiplier,
        }
    }

    #[test]
    fn table() {
        let cases = [
            // (spec, n, jitter, expected seconds)
            (spec(1, 300, 2), 0, 0.0, 1.0),
            (spec(1, 300, 2), 1, 0.0, 2.0),
            (spec(1, 300, 2), 4, 0.0, 16.0),
            (spec(1, 300, 2), 9, 0.0, 300.0), // 512 capped
            (spec(1, 300, 2), 60, 0.0, 300.0),
            (spec(1, 300, 2), 5000, 0.0, 300.0), // no overflow
            (spec(2, 60, 3), 2, 0.0, 18.0),
            (spec(5, 5, 1), 7, 0.0, 5.0),
            (spec(1, 300, 2), 0, 0.999_999, 1.0 + 0.5 * 0.999_999),
            (spec(1, 300, 2), 9, 0.5, 300.0 + 75.0), // jitter on top of the cap
        ];
        for (spec, n, jitter, want) in cases {
            let got = retry_delay(&spec, n, jitter).as_secs_f64();
            assert!(
                (got - want).abs() < 1e-6,
                "{spec:?} n={n} jitter={jitter}: got {got}, want {want}"
            );
        }
    }

    #[test]
    fn jitter_stays_within_half_the_delay() {
        let s = spec(4, 100, 2);
        for n in 0..10 {
            let lo = retry_delay(&s, n, 0.0);
            let hi = retry_delay(&s, n, 0.999_999_9);
            assert!(hi >= lo && hi.as_secs_f64() <= lo.as_secs_f64() * 1.5 + 1e-9);
        }
    }
}
