//! `JsonObject`: user JSON (payload, checkpoint, result) kept as raw text.
//!
//! Why not `serde_json::Value`: a `Value` is decoded, cloned, compared,
//! serialized and dropped by recursion. serde_json refuses more than 128
//! levels while decoding, and the API server accepts up to 10,000 — so one
//! task with a deeply nested payload made every list of its namespace fail
//! to decode, stopping the operator (and every worker's lease watch) for all
//! tenants. Decoding into [`RawValue`] skips the value with serde_json's
//! iterative scanner (no depth limit, no recursion), and a boxed string is
//! cloned and dropped without recursion too. The operator never needs to
//! look inside user JSON; the SDK parses it only when a handler asks, where a
//! failure is that task's own typed error.

use std::fmt;

use schemars::{JsonSchema, Schema, SchemaGenerator};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::value::RawValue;

/// Upper bound of a checkpoint, in bytes of JSON. Checkpoints travel with
/// every renewal and are copied into the task's status.
pub const MAX_CHECKPOINT_BYTES: usize = 128 * 1024;

/// Upper bound of a result, in bytes of JSON. Results are copied into the
/// task's status, which must stay well below etcd's 1.5 MiB object limit.
pub const MAX_RESULT_BYTES: usize = 128 * 1024;

/// Upper bound of a failure message, in characters (the CRDs' `maxLength`).
pub const MAX_MESSAGE_CHARS: usize = 4096;

/// Upper bound of a reason, in characters (the CRDs' `maxLength`).
pub const MAX_REASON_CHARS: usize = 128;

/// Upper bound of the nesting depth of a checkpoint or result the SDK
/// writes. The API server accepts objects nested about 10,000 levels deep
/// but (Kubernetes 1.37) stores some it then cannot decode — every list of
/// that resource in the namespace fails for every client until the object
/// is removed by hand. Nothing legitimate nests 1,000 levels; staying far
/// below keeps a careless handler away from that edge.
pub const MAX_DEPTH: usize = 1000;

/// A JSON object held as its text. Equality is textual.
#[derive(Clone)]
pub struct JsonObject(Box<RawValue>);

/// Why a value cannot be a [`JsonObject`].
#[derive(Debug, thiserror::Error)]
pub enum JsonObjectError {
    /// Not valid JSON, or it could not be serialized.
    #[error("invalid JSON: {0}")]
    Invalid(#[from] serde_json::Error),
    /// Valid JSON, but not an object (the CRDs require objects).
    #[error("not a JSON object: payloads, checkpoints and results must be objects")]
    NotAnObject,
}

impl JsonObject {
    /// Takes JSON text, which must be one object. Validation scans without
    /// recursion, so any depth is accepted.
    pub fn from_text(text: impl Into<String>) -> Result<Self, JsonObjectError> {
        let raw = RawValue::from_string(text.into())?;
        Self::checked(raw)
    }

    /// Serializes `value`, which must serialize to an object.
    pub fn from_serialize<T: Serialize + ?Sized>(value: &T) -> Result<Self, JsonObjectError> {
        let raw = serde_json::value::to_raw_value(value)?;
        Self::checked(raw)
    }

    fn checked(raw: Box<RawValue>) -> Result<Self, JsonObjectError> {
        if raw.get().trim_start().starts_with('{') {
            Ok(Self(raw))
        } else {
            Err(JsonObjectError::NotAnObject)
        }
    }

    /// The JSON text.
    pub fn as_str(&self) -> &str {
        self.0.get()
    }

    /// Size in bytes of the JSON text: what limits and logs talk about.
    pub fn len(&self) -> usize {
        self.0.get().len()
    }

    /// Size in bytes once the API server has stored it: Go's JSON encoder
    /// writes `<`, `>` and `&` as `\u003c` (6 bytes for 1) and U+2028 /
    /// U+2029 as `\u2028` (6 for 3), so a limit checked on our own text
    /// alone could be exceeded six times over on the server.
    pub fn stored_len(&self) -> usize {
        let text = self.as_str();
        let html = text
            .bytes()
            .filter(|b| matches!(b, b'<' | b'>' | b'&'))
            .count();
        let separators = text
            .chars()
            .filter(|c| matches!(c, '\u{2028}' | '\u{2029}'))
            .count();
        text.len() + 5 * html + 3 * separators
    }

    /// Never true for a valid object (`{}` has two bytes); for clippy.
    pub fn is_empty(&self) -> bool {
        self.0.get().is_empty()
    }

    /// Nesting depth of the object (`{}` is 1), counted by one pass over
    /// the text without recursion.
    pub fn depth(&self) -> usize {
        let (mut depth, mut max) = (0usize, 0usize);
        let (mut in_string, mut escaped) = (false, false);
        for b in self.as_str().bytes() {
            if in_string {
                match (escaped, b) {
                    (true, _) => escaped = false,
                    (false, b'\\') => escaped = true,
                    (false, b'"') => in_string = false,
                    _ => {}
                }
                continue;
            }
            match b {
                b'"' => in_string = true,
                b'{' | b'[' => {
                    depth += 1;
                    max = max.max(depth);
                }
                b'}' | b']' => depth = depth.saturating_sub(1),
                _ => {}
            }
        }
        max
    }

    /// Decodes into `T` with serde_json's default limits (128 levels): a
    /// deeper object is an error here, for the one caller that asked.
    pub fn parse<T: DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_str(self.0.get())
    }
}

impl JsonObject {
    /// Decodes into a `serde_json::Value` (same limits as [`Self::parse`]).
    pub fn to_value(&self) -> Result<serde_json::Value, serde_json::Error> {
        self.parse()
    }
}

impl PartialEq for JsonObject {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
    }
}

/// Logs show sizes, never contents: payloads and results belong to users.
impl fmt::Debug for JsonObject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "JsonObject({} bytes)", self.len())
    }
}

impl Serialize for JsonObject {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

/// Accepts any JSON value without recursion. It does not insist on an
/// object: the CRD schema already does, and refusing one stored object
/// here would fail the whole list it arrives in.
impl<'de> Deserialize<'de> for JsonObject {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Box::<RawValue>::deserialize(d).map(Self)
    }
}

impl JsonSchema for JsonObject {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "JsonObject".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(generator: &mut SchemaGenerator) -> Schema {
        crate::schema::free_form_object(generator)
    }
}

impl TryFrom<serde_json::Value> for JsonObject {
    type Error = JsonObjectError;

    fn try_from(v: serde_json::Value) -> Result<Self, Self::Error> {
        Self::from_serialize(&v)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::{BatchTask, BatchTaskSpec, TaskLease};
    use serde_json::json;

    /// `{"a":{"a":…{}…}}`, `levels` objects deep.
    fn nested(levels: usize) -> String {
        let mut s = String::with_capacity(levels * 6);
        for _ in 0..levels - 1 {
            s.push_str("{\"a\":");
        }
        s.push_str("{}");
        for _ in 0..levels - 1 {
            s.push('}');
        }
        s
    }

    #[test]
    fn objects_only() {
        assert!(JsonObject::from_text("{\"a\":1}").is_ok());
        assert!(matches!(
            JsonObject::from_text("[1]"),
            Err(JsonObjectError::NotAnObject)
        ));
        assert!(matches!(
            JsonObject::from_text("{\"a\":"),
            Err(JsonObjectError::Invalid(_))
        ));
        assert!(matches!(
            JsonObject::try_from(json!("s")),
            Err(JsonObjectError::NotAnObject)
        ));
        assert_eq!(
            JsonObject::try_from(json!({"n": 1})).unwrap().as_str(),
            r#"{"n":1}"#
        );
    }

    #[test]
    fn depth_counts_nesting_outside_strings() {
        let cases = [
            ("{}", 1),
            (r#"{"a":[1,{"b":2}]}"#, 3),
            (r#"{"a":"{{{[[["}"#, 1),
            (r#"{"a":"\"{{","b":{}}"#, 2),
            (r#"{"a":"\\","b":{"c":{}}}"#, 3),
        ];
        for (text, want) in cases {
            assert_eq!(JsonObject::from_text(text).unwrap().depth(), want, "{text}");
        }
        assert_eq!(
            JsonObject::from_text(nested(10_000)).unwrap().depth(),
            10_000
        );
    }

    #[test]
    fn stored_len_counts_what_the_api_server_escapes() {
        let o = JsonObject::from_text("{\"a\":\"<>&\u{2028}x\"}").unwrap();
        // {"a":"\u003c\u003e\u0026\u2028x"} as the API server returns it.
        assert_eq!(o.stored_len(), r#"{"a":"\u003c\u003e\u0026\u2028x"}"#.len());
        assert_eq!(JsonObject::from_text("{}").unwrap().stored_len(), 2);
    }

    #[test]
    fn debug_shows_the_size_not_the_content() {
        let o = JsonObject::from_text(r#"{"secret":"hunter2"}"#).unwrap();
        let shown = format!("{o:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert_eq!(shown, "JsonObject(20 bytes)");
    }

    /// The bug this type fixes: a list with one deeply nested task failed
    /// to decode as a whole (serde_json's 128-level limit), and a `Value`
    /// that deep would overflow the stack when dropped.
    #[test]
    fn a_list_with_a_10000_level_payload_decodes_and_round_trips() {
        let deep = nested(10_000);
        let task = format!(
            r#"{{"apiVersion":"batchlease.dev/v1alpha1","kind":"BatchTask","metadata":{{"name":"deep","namespace":"n"}},"spec":{{"queue":"q","payload":{deep}}},"status":{{"checkpoint":{deep},"result":{deep}}}}}"#
        );
        let list = format!(
            r#"{{"apiVersion":"batchlease.dev/v1alpha1","kind":"BatchTaskList","metadata":{{"resourceVersion":"1"}},"items":[{task}]}}"#
        );
        // The old field type fails exactly as the operator did.
        let old: Result<serde_json::Value, _> = serde_json::from_str(&list);
        assert!(old.unwrap_err().to_string().contains("recursion limit"));

        let decoded: kube::core::ObjectList<BatchTask> = serde_json::from_str(&list).unwrap();
        let t = &decoded.items[0];
        assert_eq!(t.spec.payload.as_ref().unwrap().as_str(), deep);
        let again = serde_json::to_string(t).unwrap();
        assert_eq!(
            serde_json::from_str::<BatchTask>(&again).unwrap(),
            t.clone()
        );
        // Parsing on demand is the asker's own, typed failure.
        assert!(
            t.spec
                .payload
                .as_ref()
                .unwrap()
                .parse::<serde_json::Value>()
                .is_err()
        );
        // Watch events decode the same way.
        let event = format!(r#"{{"type":"MODIFIED","object":{task}}}"#);
        let ev: kube::core::WatchEvent<BatchTask> = serde_json::from_str(&event).unwrap();
        assert!(matches!(ev, kube::core::WatchEvent::Modified(_)));
        let lease = format!(
            r#"{{"apiVersion":"batchlease.dev/v1alpha1","kind":"TaskLease","metadata":{{"name":"l"}},"spec":{{"taskName":"t","taskUID":"u","queue":"q","fencingToken":1,"leaseDurationSeconds":30}},"status":{{"checkpoint":{deep},"result":{deep}}}}}"#
        );
        let l: TaskLease = serde_json::from_str(&lease).unwrap();
        assert_eq!(l.status.unwrap().result.unwrap().len(), deep.len());
        let _ = BatchTaskSpec::for_queue("q");
    }
}
