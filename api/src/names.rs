//! Deterministic object names and label values.
//!
//! Kubernetes caps object names at 253 characters and label values at 63,
//! but a BatchTask name may already be 253 characters long. Long names are
//! cut and suffixed with a hash of the whole name, so they stay unique,
//! stable across retries and readable.

use sha2::{Digest, Sha256};

/// Longest object name the API server accepts (DNS subdomain).
pub const MAX_NAME_LEN: usize = 253;
/// Longest label value the API server accepts.
pub const MAX_LABEL_VALUE_LEN: usize = 63;
/// Hex digits of the hash suffix of a shortened name.
const HASH_LEN: usize = 10;

/// Name of the TaskLease of `task`'s attempt with fencing `token`:
/// `<task>-<token>`, shortened with a hash when too long.
pub fn lease_name(task: &str, token: i64) -> String {
    let suffix = format!("-{token}");
    let full = format!("{task}{suffix}");
    if full.len() <= MAX_NAME_LEN {
        return full;
    }
    // <prefix>-<hash>-<token>: the token stays visible at the end.
    let hash = short_hash(&full);
    let keep = MAX_NAME_LEN - suffix.len() - HASH_LEN - 1;
    format!("{}-{hash}{suffix}", trim_to(task, keep))
}

/// A label value standing for `name`: the name itself when it fits, else a
/// prefix plus a hash of the whole name.
pub fn label_value(name: &str) -> String {
    if name.len() <= MAX_LABEL_VALUE_LEN {
        return name.to_owned();
    }
    let hash = short_hash(name);
    let keep = MAX_LABEL_VALUE_LEN - HASH_LEN - 1;
    format!("{}-{hash}", trim_to(name, keep))
}

/// First `HASH_LEN` hex digits of SHA-256 of `s`.
pub fn short_hash(s: &str) -> String {
    let digest = Sha256::digest(s.as_bytes());
    let mut out = String::with_capacity(HASH_LEN);
    for byte in digest.iter().take(HASH_LEN / 2) {
        out.push_str(&format!("{byte:02x}"));
    }
    out
}

/// Cut `s` to at most `max` bytes, never ending on '-' or '.', so the result
/// is still a valid DNS-subdomain prefix. Names are ASCII (the API server
/// enforces it), so byte slicing is safe; non-ASCII input is cut at a char
/// boundary anyway.
fn trim_to(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].trim_end_matches(['-', '.'])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_names() {
        let long = "a".repeat(253);
        let long_dash = format!("{}-{}", "b".repeat(200), "c".repeat(52));
        let cases: &[(&str, i64, Option<&str>)] = &[
            ("etl", 1, Some("etl-1")),
            ("etl", 42, Some("etl-42")),
            (&long, 7, None),
            (&long_dash, 123456789, None),
        ];
        for (task, token, want) in cases {
            let got = lease_name(task, *token);
            assert!(got.len() <= MAX_NAME_LEN, "{got} too long");
            assert!(got.ends_with(&format!("-{token}")), "{got} lost its token");
            assert!(!got.contains("--"), "{got} has a double dash");
            if let Some(want) = want {
                assert_eq!(&got, want);
            }
            // deterministic
            assert_eq!(got, lease_name(task, *token));
        }
        // two long names that share a prefix stay distinct
        let a = format!("{}x", "a".repeat(252));
        let b = format!("{}y", "a".repeat(252));
        assert_ne!(lease_name(&a, 1), lease_name(&b, 1));
    }

    #[test]
    fn label_values() {
        assert_eq!(label_value("etl"), "etl");
        let exact = "a".repeat(63);
        assert_eq!(label_value(&exact), exact);
        let long = "a".repeat(64);
        let got = label_value(&long);
        assert_eq!(got.len(), 63);
        assert_ne!(got, label_value(&"a".repeat(65)));
    }

    #[test]
    fn hash_is_hex_of_fixed_length() {
        let h = short_hash("x");
        assert_eq!(h.len(), HASH_LEN);
        assert!(h.chars().all(|c| c.is_ascii_hexdigit()));
    }
}
