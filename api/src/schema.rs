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

/// Lowercase RFC 1123 subdomain: dot-separated labels of `[a-z0-9-]`, each
/// starting and ending with a letter or digit — what the API server accepts
/// as an object name (`IsDNS1123Subdomain`).
const DNS_SUBDOMAIN_PATTERN: &str =
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$";

/// A set of object names (BatchTask names in `dependsOn`).
///
/// `x-kubernetes-list-type: set` makes the API server itself reject
/// duplicates ("Duplicate value") at no CEL cost, and lets server-side apply
/// merge items; a CEL uniqueness rule is quadratic and exceeds the API
/// server's cost budget by more than 100x at 64 items.
pub fn depends_on(_: &mut SchemaGenerator) -> Schema {
    name_set(64, 253, None)
}

/// A set of resource names (`resources`): at most 32, each usable as a
/// `coordination.k8s.io` Lease name suffix.
///
/// A resource is locked through a Lease whose name contains the resource
/// name, so a name the API server would refuse in a Lease name ("Ware
/// House", "DB", "a..b") must be refused here, when the task is created and
/// the user is looking, not when the operator first tries to take the lock
/// and the task is stuck. The pattern is the full DNS-subdomain rule rather
/// than a character class: "a..b" or "a.-b" have only valid characters and
/// are still not names. It is an OpenAPI `pattern`, not a CEL rule, so it
/// costs nothing of the CEL budget (32 items × a regex would).
pub fn resources(_: &mut SchemaGenerator) -> Schema {
    name_set(32, 200, Some(DNS_SUBDOMAIN_PATTERN))
}

/// A set of failure reasons (`retryPolicy.nonRetryableReasons`): at most
/// 32 CamelCase words of at most 128 characters, the length of a lease's
/// `status.reason` — a pattern, not CEL, for the same reason as above.
pub fn reasons(_: &mut SchemaGenerator) -> Schema {
    name_set(32, 128, Some("^[A-Z][A-Za-z0-9]*$"))
}

fn name_set(max_items: u32, max_len: u32, pattern: Option<&str>) -> Schema {
    let mut item = serde_json::json!({ "type": "string", "minLength": 1, "maxLength": max_len });
    if let Some(pattern) = pattern {
        item["pattern"] = pattern.into();
    }
    json_schema!({
        "type": "array",
        "maxItems": max_items,
        "items": item,
        "x-kubernetes-list-type": "set",
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::core::cel::Validator;
    use serde_json::json;

    /// The `resources` item pattern, evaluated with CEL's `matches()` (RE2
    /// syntax, like the API server's Go regexp) on one string.
    fn matches(value: &str) -> bool {
        let schema = resources(&mut SchemaGenerator::default()).to_value();
        let pattern = schema["items"]["pattern"].as_str().unwrap();
        let rule = json!({
            "type": "string",
            "x-kubernetes-validations": [{"rule": format!("self.matches(r'{pattern}')")}],
        });
        Validator::new()
            .validate(&rule, &json!(value), None)
            .is_ok()
    }

    #[test]
    fn resource_names_are_dns_subdomains() {
        let cases: &[(&str, bool)] = &[
            ("db", true),
            ("ware-house", true),
            ("db.primary", true),
            ("a", true),
            ("0", true),
            ("r2-d2.eu-west-1", true),
            ("Ware House", false),
            ("DB", false),
            ("ware_house", false),
            ("-db", false),
            ("db-", false),
            (".db", false),
            ("db.", false),
            ("a..b", false),
            ("a.-b", false),
            ("a-.b", false),
            ("", false),
        ];
        for (name, valid) in cases {
            assert_eq!(matches(name), *valid, "{name:?}");
        }
    }
}
