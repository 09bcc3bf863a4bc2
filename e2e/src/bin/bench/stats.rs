//! Distributions of measured durations: nearest-rank quantiles and the
//! one-line summary every latency phase prints.

use std::time::Duration;

/// The `q`-quantile of sorted `v` (nearest rank); zero for no samples.
pub fn quantile(v: &[Duration], q: f64) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

/// Milliseconds, for printing.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// `p50 … ms, p95 … ms, p99 … ms, max … ms` of sorted `v`.
pub fn summary(v: &[Duration]) -> String {
    format!(
        "p50 {:.0} ms, p95 {:.0} ms, p99 {:.0} ms, max {:.0} ms",
        ms(quantile(v, 0.5)),
        ms(quantile(v, 0.95)),
        ms(quantile(v, 0.99)),
        ms(quantile(v, 1.0)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let v: Vec<Duration> = (1..=20).map(Duration::from_millis).collect();
        assert_eq!(quantile(&v, 0.5), Duration::from_millis(10));
        assert_eq!(quantile(&v, 0.95), Duration::from_millis(19));
        assert_eq!(quantile(&v, 1.0), Duration::from_millis(20));
        assert_eq!(quantile(&[], 0.5), Duration::ZERO);
    }
}
