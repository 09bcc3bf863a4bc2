//! Ages as kubectl prints them (`45s`, `3m12s`, `5h`, `2d3h`).

use k8s_openapi::jiff::Timestamp;

/// Seconds from `then` to `now`; a time ahead of `now` (another clock) is 0.
pub fn seconds(then: Timestamp, now: Timestamp) -> i64 {
    now.duration_since(then).as_secs().max(0)
}

/// `secs` the way `kubectl get` prints an age.
pub fn human(secs: i64) -> String {
    let s = secs.max(0);
    match s {
        0..120 => format!("{s}s"),
        120..600 if s % 60 != 0 => format!("{}m{}s", s / 60, s % 60),
        120..10_800 => format!("{}m", s / 60),
        10_800..172_800 if (s / 60) % 60 != 0 && s < 28_800 => {
            format!("{}h{}m", s / 3600, (s / 60) % 60)
        }
        10_800..172_800 => format!("{}h", s / 3600),
        _ if (s / 3600) % 24 != 0 && s < 691_200 => format!("{}d{}h", s / 86_400, (s / 3600) % 24),
        _ => format!("{}d", s / 86_400),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_read_like_kubectl() {
        for (secs, want) in [
            (0, "0s"),
            (59, "59s"),
            (119, "119s"),
            (130, "2m10s"),
            (600, "10m"),
            (10_799, "179m"),
            (11_000, "3h3m"),
            (30_000, "8h"),
            (200_000, "2d7h"),
            (1_000_000, "11d"),
            (-5, "0s"),
        ] {
            assert_eq!(human(secs), want, "{secs}");
        }
    }
}
