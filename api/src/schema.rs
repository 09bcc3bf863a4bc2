//! Hand-written schema fragments for fields whose Rust type cannot express
//! what the API server needs (free-form objects, list merge semantics).

use schemars::{Schema, SchemaGenerator, json_schema};

/// An object whose keys the API server must keep although the schema does
/// not name them: payloads, checkpoints and results belong to user code.
///
/// Atomic: without it the API server tracks every nested key of the object
/// in `metadata.managedFields`, mirroring its whole depth there — and
/// managedFields are decoded as `serde_json::Value`, so a deeply nested
/// payload broke every client's decoding of the object all the same. An
/// opaque user blob is one field to server-side apply anyway.
pub fn free_form_object(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": true,
        "x-kubernetes-map-type": "atomic",
    })
}

/// `metav1.Condition` list keyed by `type`, so server-side apply merges
/// conditions one by one instead of replacing the list.
pub fn conditions(generator: &mut SchemaGenerator) -> Schema {
    let item =
        generator.subschema_for::<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition>();
    json_schema!({
        "type": "array",
        "items": item,
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["type"],
    })
}

/// A set of object names (BatchTask names in `dependsOn`).
///
/// `x-kubernetes-list-type: set` makes the API server itself reject
/// duplicates ("Duplicate value") at no CEL cost, and lets server-side apply
/// merge items; a CEL uniqueness rule is quadratic and exceeds the API
/// server's cost budget by more than 100x at 64 items.
pub fn depends_on(_: &mut SchemaGenerator) -> Schema {
    name_set(64, 253)
}

/// A set of resource names (`resources`): at most 32, each usable as a
/// `coordination.k8s.io` Lease name suffix.
pub fn resources(_: &mut SchemaGenerator) -> Schema {
    name_set(32, 200)
}

fn name_set(max_items: u32, max_len: u32) -> Schema {
    json_schema!({
        "type": "array",
        "maxItems": max_items,
        "items": { "type": "string", "minLength": 1, "maxLength": max_len },
        "x-kubernetes-list-type": "set",
    })
}
