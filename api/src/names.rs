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

/// Name of the child a task spawns: `<parent>-<hex(SHA256(parentUID ‖ logicalIndex ‖ subgraphVersion))[..10]>`,
/// the parent's name cut (like lease_name's trim) so the whole fits in 253 characters.
///
/// Why these inputs: the name must be the same every time the same parent
/// attempt spawns the same logical child (so a retried or zombie spawn hits
/// AlreadyExists instead of creating a twin), and different for anything
/// else. The parent's UID, not its name, because a deleted and re-created
/// parent reuses the name; the sub-graph version, because a new version of
/// the sub-graph is new work. The parent's name is only the readable prefix:
/// uniqueness comes from the hash, so cutting it loses nothing.
///
/// ‖ is unambiguous: the hash covers the bytes of `parent_uid`, a 0x00 byte,
/// `logical_index` in decimal, a 0x00 byte, then `subgraph_version`. Without
/// the separators ("1", 1, "") and ("", 1, "1") would collide. UIDs and
/// versions are Kubernetes strings, which never contain NUL.
///
/// This format is persisted in object names: changing it makes existing
/// children unrecognisable to a retried spawn (the golden test pins it).
pub fn child_name(
    parent: &str,
    parent_uid: &str,
    logical_index: u32,
    subgraph_version: &str,
) -> String {
    let mut hasher = Sha256::new();
    hasher.update(parent_uid.as_bytes());
    hasher.update([0]);
    hasher.update(logical_index.to_string().as_bytes());
    hasher.update([0]);
    hasher.update(subgraph_version.as_bytes());
    let hash = hex_prefix(&hasher.finalize());
    let prefix = trim_to(parent, MAX_NAME_LEN - HASH_LEN - 1);
    if prefix.is_empty() {
        // Only for a parent name that is empty or all '-'/'.' (not a valid
        // object name): the hash alone is still a valid name.
        return hash;
    }
    format!("{prefix}-{hash}")
}

/// First `HASH_LEN` hex digits of SHA-256 of `s`.
pub fn short_hash(s: &str) -> String {
    hex_prefix(&Sha256::digest(s.as_bytes()))
}

/// First `HASH_LEN` hex digits of `digest`.
fn hex_prefix(digest: &[u8]) -> String {
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

    /// A valid DNS subdomain (RFC 1123), as the API server checks names.
    fn is_dns_subdomain(s: &str) -> bool {
        s.len() <= MAX_NAME_LEN
            && s.split('.').all(|label| {
                let bytes = label.as_bytes();
                let alnum = |b: &u8| b.is_ascii_lowercase() || b.is_ascii_digit();
                bytes.first().is_some_and(alnum)
                    && bytes.last().is_some_and(alnum)
                    && bytes.iter().all(|b| alnum(b) || *b == b'-')
            })
    }

    #[test]
    fn child_names() {
        let long = "a".repeat(253);
        // Cut at 242 characters, right after a dash: the dash must go too.
        let dash_at_cut = format!("{}-{}", "b".repeat(241), "c".repeat(11));
        let dots_at_cut = format!("{}.-.{}", "d".repeat(240), "e".repeat(20));
        // (parent, uid, index, version, expected or None for "only check it")
        let cases: &[(&str, &str, u32, &str, Option<&str>)] = &[
            // Golden values, computed outside Rust so the format cannot drift:
            //   printf '%s\0%s\0%s' uid 1 v1 | sha256sum
            ("etl", "uid", 1, "v1", Some("etl-94f920f9cc")),
            //   printf '%s\0%s\0%s' 0b6c1d2e-uid 42 sub-v2 | sha256sum
            (
                "report.daily",
                "0b6c1d2e-uid",
                42,
                "sub-v2",
                Some("report.daily-1a322e34f0"),
            ),
            (&long, "uid", 1, "v1", None),
            (&dash_at_cut, "uid", 7, "v1", None),
            (&dots_at_cut, "uid", 7, "v1", None),
            ("etl", "uid", u32::MAX, "", None),
        ];
        for (parent, uid, index, version, want) in cases {
            let got = child_name(parent, uid, *index, version);
            assert!(got.len() <= MAX_NAME_LEN, "{got} too long");
            assert!(!got.contains("--"), "{got} has a double dash");
            assert!(is_dns_subdomain(&got), "{got} is not a DNS subdomain");
            let hash = &got[got.len() - HASH_LEN..];
            assert!(hash.chars().all(|c| c.is_ascii_hexdigit()), "{got}");
            assert!(
                parent.starts_with(&got[..got.len() - HASH_LEN - 1]),
                "{got}"
            );
            if let Some(want) = want {
                assert_eq!(&got, want);
            }
            // deterministic
            assert_eq!(got, child_name(parent, uid, *index, version));
        }
        assert_eq!(child_name(&long, "uid", 1, "v1").len(), MAX_NAME_LEN);
    }

    #[test]
    fn child_names_differ() {
        /// (parent UID, logical index, sub-graph version)
        type Inputs = (&'static str, u32, &'static str);
        let cases: &[(&str, Inputs, Inputs)] = &[
            ("uid", ("u1", 0, "v"), ("u2", 0, "v")),
            ("index", ("u", 0, "v"), ("u", 1, "v")),
            ("version", ("u", 0, "v1"), ("u", 0, "v2")),
            ("uid/version boundary", ("1", 1, ""), ("", 1, "1")),
            ("uid/index boundary", ("a1", 2, "v"), ("a", 12, "v")),
            ("index/version boundary", ("a", 1, "2v"), ("a", 12, "v")),
        ];
        for (what, (u1, i1, v1), (u2, i2, v2)) in cases {
            assert_ne!(
                child_name("p", u1, *i1, v1),
                child_name("p", u2, *i2, v2),
                "{what}"
            );
        }
        // The parent's name is only a readable prefix, not hashed: two
        // parents never share a UID, so the UID is what tells them apart.
        // The same inputs under two long names cut to the same prefix give
        // the same name.
        let a = child_name(&format!("{}x", "a".repeat(252)), "u", 0, "v");
        let b = child_name(&format!("{}y", "a".repeat(252)), "u", 0, "v");
        assert_eq!(a, b);
    }

    #[test]
    fn hash_is_hex_of_fixed_length() {
        let h = short_hash("x");
        assert_eq!(h.len(), HASH_LEN);
        assert!(h.chars().all(|c| c.is_ascii_hexdigit()));
    }
}
