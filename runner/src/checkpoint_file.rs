//! `BATCHLEASE_CHECKPOINT_FILE`: the previous attempt's checkpoint when the
//! child starts; what the child writes there is recorded as this attempt's
//! checkpoint (sent with the next renewal, and with the completion) if it
//! is a JSON object within the SDK's limits. Anything else is refused
//! with one warning and the last good checkpoint stands: a half-written
//! file must not wipe progress.

use batchlease_worker_sdk::{JsonObject, MAX_CHECKPOINT_BYTES, MAX_DEPTH};

/// Why the file's content is not a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CheckpointError {
    #[error("not UTF-8")]
    NotUtf8,
    #[error("not a JSON object: {0}")]
    NotAnObject(String),
    #[error("{bytes} bytes, over the limit of {limit}")]
    TooLarge { bytes: usize, limit: usize },
    #[error("nested {depth} levels deep, over the limit of {limit}")]
    TooDeep { depth: usize, limit: usize },
}

impl CheckpointError {
    /// Low-cardinality label for logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::NotUtf8 => "not_utf8",
            Self::NotAnObject(_) => "not_an_object",
            Self::TooLarge { .. } => "too_large",
            Self::TooDeep { .. } => "too_deep",
        }
    }
}

/// Files larger than this are refused without being read (escaping only
/// grows the stored form, so such a file can never fit).
pub const MAX_FILE_BYTES: u64 = MAX_CHECKPOINT_BYTES as u64 * 4;

/// The checkpoint in `bytes`: `Ok(None)` for an empty (or blank) file —
/// nothing recorded yet.
pub fn parse(bytes: &[u8]) -> Result<Option<JsonObject>, CheckpointError> {
    let text = std::str::from_utf8(bytes).map_err(|_| CheckpointError::NotUtf8)?;
    let text = text.trim();
    if text.is_empty() {
        return Ok(None);
    }
    if text.len() > MAX_FILE_BYTES as usize {
        return Err(CheckpointError::TooLarge {
            bytes: text.len(),
            limit: MAX_CHECKPOINT_BYTES,
        });
    }
    let cp = JsonObject::from_text(text.to_owned())
        .map_err(|e| CheckpointError::NotAnObject(e.to_string()))?;
    let bytes = cp.stored_len();
    if bytes > MAX_CHECKPOINT_BYTES {
        return Err(CheckpointError::TooLarge {
            bytes,
            limit: MAX_CHECKPOINT_BYTES,
        });
    }
    let depth = cp.depth();
    if depth > MAX_DEPTH {
        return Err(CheckpointError::TooDeep {
            depth,
            limit: MAX_DEPTH,
        });
    }
    Ok(Some(cp))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn parse_table() {
        let deep = format!(
            "{}1{}",
            "{\"a\":".repeat(MAX_DEPTH + 1),
            "}".repeat(MAX_DEPTH + 1)
        );
        let big = format!("{{\"x\":\"{}\"}}", "y".repeat(MAX_CHECKPOINT_BYTES));
        let cases: Vec<(&[u8], Result<bool, &str>)> = vec![
            (b"", Ok(false)),
            (b"  \n", Ok(false)),
            (b"{\"step\": 3}\n", Ok(true)),
            (b"{}", Ok(true)),
            (b"[1,2]", Err("not_an_object")),
            (b"{\"step\": ", Err("not_an_object")),
            (b"3", Err("not_an_object")),
            (b"\xff\xfe", Err("not_utf8")),
            (deep.as_bytes(), Err("too_deep")),
            (big.as_bytes(), Err("too_large")),
        ];
        for (input, want) in cases {
            let got = parse(input);
            match (want, got) {
                (Ok(some), Ok(cp)) => {
                    assert_eq!(cp.is_some(), some, "{:?}", String::from_utf8_lossy(input))
                }
                (Err(kind), Err(e)) => assert_eq!(e.kind(), kind, "{e}"),
                (want, got) => panic!(
                    "{:.60?}: want {want:?}, got {got:?}",
                    String::from_utf8_lossy(input)
                ),
            }
        }
    }

    #[test]
    fn the_checkpoint_keeps_the_childs_text() {
        let cp = parse(b"{\"step\":3,\"of\":10}\n").unwrap().unwrap();
        assert_eq!(cp.as_str(), "{\"step\":3,\"of\":10}");
    }
}
