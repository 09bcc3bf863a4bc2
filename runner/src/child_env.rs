//! The environment a child runs with: the runner's own (PATH, the user's
//! variables) plus the task's, minus the runner's own secret — the child
//! connects to its database with its own variables.

use std::path::Path;

/// Variables of the runner that the child must not inherit: the fenced
/// store's connection string is the runner's credential, not the task's.
pub const WITHHELD: &[&str] = &["BATCHLEASE_PG_URL", "BATCHLEASE_PG_URL_FILE"];

/// What the child is told about its attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttemptInfo<'a> {
    pub namespace: &'a str,
    pub name: &'a str,
    pub uid: &'a str,
    pub queue: &'a str,
    pub attempt: i32,
    pub token: i64,
    pub lease_seconds: u64,
    pub dir: &'a Path,
}

pub const PAYLOAD_FILE: &str = "payload.json";
pub const CHECKPOINT_FILE: &str = "checkpoint.json";
pub const RESULT_FILE: &str = "result.json";

/// The task's variables, in a stable order.
pub fn vars(a: &AttemptInfo<'_>) -> Vec<(&'static str, String)> {
    let file = |f: &str| a.dir.join(f).display().to_string();
    vec![
        ("BATCHLEASE_TASK_NAMESPACE", a.namespace.to_owned()),
        ("BATCHLEASE_TASK_NAME", a.name.to_owned()),
        ("BATCHLEASE_TASK_UID", a.uid.to_owned()),
        ("BATCHLEASE_QUEUE", a.queue.to_owned()),
        ("BATCHLEASE_ATTEMPT", a.attempt.to_string()),
        ("BATCHLEASE_FENCING_TOKEN", a.token.to_string()),
        ("BATCHLEASE_LEASE_SECONDS", a.lease_seconds.to_string()),
        ("BATCHLEASE_PAYLOAD_FILE", file(PAYLOAD_FILE)),
        ("BATCHLEASE_CHECKPOINT_FILE", file(CHECKPOINT_FILE)),
        ("BATCHLEASE_RESULT_FILE", file(RESULT_FILE)),
    ]
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_child_is_told_its_attempt() {
        let dir = Path::new("/tmp/x");
        let v = vars(&AttemptInfo {
            namespace: "ns",
            name: "job",
            uid: "u-1",
            queue: "q",
            attempt: 2,
            token: 7,
            lease_seconds: 30,
            dir,
        });
        let get = |k: &str| {
            v.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.as_str())
                .unwrap()
        };
        let want = [
            ("BATCHLEASE_TASK_NAMESPACE", "ns"),
            ("BATCHLEASE_TASK_NAME", "job"),
            ("BATCHLEASE_TASK_UID", "u-1"),
            ("BATCHLEASE_QUEUE", "q"),
            ("BATCHLEASE_ATTEMPT", "2"),
            ("BATCHLEASE_FENCING_TOKEN", "7"),
            ("BATCHLEASE_LEASE_SECONDS", "30"),
            ("BATCHLEASE_PAYLOAD_FILE", "/tmp/x/payload.json"),
            ("BATCHLEASE_CHECKPOINT_FILE", "/tmp/x/checkpoint.json"),
            ("BATCHLEASE_RESULT_FILE", "/tmp/x/result.json"),
        ];
        for (k, val) in want {
            assert_eq!(get(k), val, "{k}");
        }
        assert_eq!(v.len(), want.len());
        // Never set, whatever the runner had.
        for w in WITHHELD {
            assert!(v.iter().all(|(k, _)| k != w));
        }
    }
}
