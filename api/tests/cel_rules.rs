//! The CEL rules of the generated CRDs, evaluated client-side (kube-cel) as a
//! fast table test. `e2e/tests/validation.rs` shows the real API server
//! agrees.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use kube::core::cel::Validator;
use serde_json::{Value, json};

fn schema(plural: &str) -> Value {
    let crd = batchlease_api::crds()
        .into_iter()
        .find(|c| c.spec.names.plural == plural)
        .unwrap();
    serde_json::to_value(
        crd.spec.versions[0]
            .schema
            .as_ref()
            .unwrap()
            .open_api_v3_schema
            .as_ref()
            .unwrap(),
    )
    .unwrap()
}

fn task(name: &str, spec: Value, status: Option<Value>) -> Value {
    let mut t = json!({"apiVersion": "batchlease.dev/v1alpha1", "kind": "BatchTask",
                       "metadata": {"name": name}, "spec": spec});
    if let Some(s) = status {
        t["status"] = s;
    }
    t
}

fn lease(holder: Option<&str>, phase: &str, token: i64) -> Value {
    let mut spec = json!({"taskName": "t", "taskUID": "u", "queue": "q",
                          "fencingToken": token, "leaseDurationSeconds": 30});
    if let Some(h) = holder {
        spec["holderIdentity"] = json!(h);
    }
    json!({"apiVersion": "batchlease.dev/v1alpha1", "kind": "TaskLease",
           "metadata": {"name": "t-1"}, "spec": spec, "status": {"phase": phase}})
}

/// (what, plural, new, old, expected message fragment or None for "passes")
type Case = (
    &'static str,
    &'static str,
    Value,
    Option<Value>,
    Option<&'static str>,
);

fn cases() -> Vec<Case> {
    let q = |v: &str| json!({"queue": v});
    vec![
        (
            "dns queue",
            "batchtasks",
            task("a", q("etl-1"), None),
            None,
            None,
        ),
        (
            "bad queue",
            "batchtasks",
            task("a", q("ETL"), None),
            None,
            Some("queue must be a DNS label"),
        ),
        (
            "ttl 4",
            "batchtasks",
            task("a", json!({"queue": "q", "leaseDurationSeconds": 4}), None),
            None,
            Some("leaseDurationSeconds must be between 5 and 3600"),
        ),
        (
            "ttl 3600",
            "batchtasks",
            task(
                "a",
                json!({"queue": "q", "leaseDurationSeconds": 3600}),
                None,
            ),
            None,
            None,
        ),
        (
            "retries 101",
            "batchtasks",
            task("a", json!({"queue": "q", "maxRetries": 101}), None),
            None,
            Some("maxRetries must be between 0 and 100"),
        ),
        (
            "self dependency",
            "batchtasks",
            task("a", json!({"queue": "q", "dependsOn": ["a"]}), None),
            None,
            Some("must not contain the task's own name"),
        ),
        (
            "redrive down",
            "batchtasks",
            task("a", json!({"queue": "q", "redrive": 1}), None),
            Some(task("a", json!({"queue": "q", "redrive": 2}), None)),
            Some("redrive may only increase"),
        ),
        (
            "redrive up",
            "batchtasks",
            task("a", json!({"queue": "q", "redrive": 3}), None),
            Some(task("a", json!({"queue": "q", "redrive": 2}), None)),
            None,
        ),
        (
            "token down",
            "batchtasks",
            task("a", q("q"), Some(json!({"fencingToken": 1}))),
            Some(task("a", q("q"), Some(json!({"fencingToken": 2})))),
            Some("must never decrease"),
        ),
        (
            "token dropped",
            "batchtasks",
            task("a", q("q"), None),
            Some(task("a", q("q"), Some(json!({"fencingToken": 2})))),
            Some("must never decrease"),
        ),
        (
            "token up",
            "batchtasks",
            task("a", q("q"), Some(json!({"fencingToken": 3}))),
            Some(task("a", q("q"), Some(json!({"fencingToken": 2})))),
            None,
        ),
        (
            "claim",
            "taskleases",
            lease(Some("w1"), "Held", 1),
            Some(lease(None, "Offered", 1)),
            None,
        ),
        (
            "steal",
            "taskleases",
            lease(Some("w2"), "Held", 1),
            Some(lease(Some("w1"), "Held", 1)),
            Some("holderIdentity may be set once"),
        ),
        (
            "token changed",
            "taskleases",
            lease(Some("w1"), "Held", 2),
            Some(lease(Some("w1"), "Held", 1)),
            Some("fencingToken is immutable"),
        ),
        (
            "revive",
            "taskleases",
            lease(Some("w1"), "Held", 1),
            Some(lease(Some("w1"), "Expired", 1)),
            Some("is final"),
        ),
        (
            "re-offer",
            "taskleases",
            lease(Some("w1"), "Offered", 1),
            Some(lease(Some("w1"), "Held", 1)),
            Some("cannot be offered again"),
        ),
        (
            "final lease's outcome rewritten",
            "taskleases",
            {
                let mut l = lease(Some("w1"), "Completed", 1);
                l["status"]["outcome"] = json!("Succeeded");
                l
            },
            Some({
                let mut l = lease(Some("w1"), "Completed", 1);
                l["status"]["outcome"] = json!("Failed");
                l
            }),
            Some("is final"),
        ),
        (
            "queue moved",
            "batchtasks",
            task("a", q("other"), None),
            Some(task("a", q("q"), None)),
            Some("queue is immutable"),
        ),
        (
            "held without holder",
            "taskleases",
            lease(None, "Held", 1),
            None,
            Some("must name its holder"),
        ),
        (
            "expire",
            "taskleases",
            lease(Some("w1"), "Expired", 1),
            Some(lease(Some("w1"), "Held", 1)),
            None,
        ),
        (
            "settle an offer nobody ran",
            "taskleases",
            lease(Some("w1"), "Completed", 1),
            Some(lease(None, "Offered", 1)),
            Some("Completed only from Held"),
        ),
        (
            // Transition rules do not run on create; workers' RBAC has no
            // create on taskleases, so only the operator creates leases.
            "created Completed (not a transition)",
            "taskleases",
            lease(Some("w1"), "Completed", 1),
            None,
            None,
        ),
        (
            "complete a held lease",
            "taskleases",
            lease(Some("w1"), "Completed", 1),
            Some(lease(Some("w1"), "Held", 1)),
            None,
        ),
        (
            "phase removed",
            "taskleases",
            {
                let mut l = lease(Some("w1"), "Held", 1);
                l["status"] = json!({});
                l
            },
            Some(lease(Some("w1"), "Held", 1)),
            Some("may not be removed"),
        ),
        (
            "resources edited",
            "batchtasks",
            task("a", json!({"queue": "q", "resources": ["db"]}), None),
            Some(task(
                "a",
                json!({"queue": "q", "resources": ["db", "wh"]}),
                None,
            )),
            Some("spec.resources is immutable"),
        ),
        (
            "resources added",
            "batchtasks",
            task("a", json!({"queue": "q", "resources": ["db"]}), None),
            Some(task("a", json!({"queue": "q"}), None)),
            Some("spec.resources is immutable"),
        ),
        (
            "resources removed",
            "batchtasks",
            task("a", json!({"queue": "q"}), None),
            Some(task("a", json!({"queue": "q", "resources": ["db"]}), None)),
            Some("spec.resources is immutable"),
        ),
        (
            "resources unchanged, dependsOn edited",
            "batchtasks",
            task(
                "a",
                json!({"queue": "q", "resources": ["db"], "dependsOn": ["x"]}),
                None,
            ),
            Some(task("a", json!({"queue": "q", "resources": ["db"]}), None)),
            None,
        ),
        (
            "resource tokens raised by a holder",
            "taskleases",
            {
                let mut l = lease(Some("w1"), "Held", 1);
                l["spec"]["resourceTokens"] = json!({"db": i64::MAX});
                l
            },
            Some({
                let mut l = lease(Some("w1"), "Held", 1);
                l["spec"]["resourceTokens"] = json!({"db": 3});
                l
            }),
            Some("resourceTokens are immutable"),
        ),
        (
            "resource tokens dropped",
            "taskleases",
            lease(Some("w1"), "Held", 1),
            Some({
                let mut l = lease(Some("w1"), "Held", 1);
                l["spec"]["resourceTokens"] = json!({"db": 3});
                l
            }),
            Some("resourceTokens are immutable"),
        ),
        (
            "resource tokens kept on a renewal",
            "taskleases",
            {
                let mut l = lease(Some("w1"), "Held", 1);
                l["spec"]["resourceTokens"] = json!({"db": 3});
                l
            },
            Some({
                let mut l = lease(Some("w1"), "Held", 1);
                l["spec"]["resourceTokens"] = json!({"db": 3});
                l
            }),
            None,
        ),
        (
            "status removed",
            "taskleases",
            {
                let mut l = lease(Some("w1"), "Held", 1);
                l.as_object_mut().unwrap().remove("status");
                l
            },
            Some(lease(Some("w1"), "Held", 1)),
            Some("may not be removed"),
        ),
    ]
}

#[test]
fn cel_rules_table() {
    let validator = Validator::new();
    for (what, plural, new, old, expect) in cases() {
        let result = validator.validate(&schema(plural), &new, old.as_ref());
        match (expect, result) {
            (None, Ok(())) => {}
            (None, Err(e)) => panic!("{what}: expected to pass, got {e:?}"),
            (Some(msg), Ok(())) => panic!("{what}: expected {msg:?}, passed"),
            (Some(msg), Err(errors)) => assert!(
                errors.iter().any(|e| e.message.contains(msg)),
                "{what}: expected {msg:?}, got {errors:?}"
            ),
        }
    }
}
