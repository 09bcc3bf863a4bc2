//! Creating a planned sub-graph (see [`crate::subgraph`]) idempotently.
//!
//! Each child is created once, under a name derived from the parent's UID,
//! the child's logical index and the sub-graph's version. A create that
//! finds the name taken reads the object: the same owner and the same spec
//! (as the API server stores it, defaults applied) is our own earlier
//! create — a retried parent, a lost answer, or a zombie of the previous
//! attempt that got there first — and counts as success; anything else is
//! a typed [`Error::SpawnConflict`] naming what differs.

use std::collections::BTreeMap;
use std::time::Duration;

use batchlease_api::{BatchTask, BatchTaskSpec, JsonObject, names};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Api, PostParams};
use kube::{Resource, ResourceExt};
use serde_json::Value;
use tokio::time::timeout;
use tracing::{debug, info};

use crate::context::TaskContext;
use crate::error::Error;
use crate::subgraph::{PlannedChild, Subgraph, plan};

/// Label on a spawned child: its parent's name (shortened by
/// [`names::label_value`] when too long), so `kubectl get bt -l
/// batchlease.dev/parent=NAME` lists a task's children. The operator finds
/// a parent's children by it before the parent ends, and admits only a
/// child created before its parent ended (see `docs/graphs.md`).
pub const LABEL_PARENT: &str = batchlease_api::keys::LABEL_PARENT;

/// Bound of one create or read of a child.
const CALL_BUDGET: Duration = Duration::from_secs(5);

/// Creates that may find the name taken and then the object gone (deleted
/// in between) before giving up.
const CREATE_TRIES: usize = 3;

impl TaskContext {
    /// Creates the children of `subgraph` under this task, idempotently;
    /// returns their names in logical order.
    ///
    /// Nothing is created unless the whole sub-graph is valid (see
    /// [`crate::SubgraphError`]). Children are named
    /// `<parent>-<hex(SHA256(parentUID ‖ index ‖ version))[..10]>`, live in
    /// the parent's namespace, are owned by the parent (deleting it deletes
    /// them; `blockOwnerDeletion: false`, so the worker needs no permission
    /// on the parent's finalizers) and labelled [`LABEL_PARENT`]. They are
    /// created dependencies first, and the attempt's fence is checked
    /// before each create: a parent whose kill switch fired stops creating.
    ///
    /// Calling it again — in a retry of the parent, or after an error — is
    /// safe: a child that exists with the same owner and spec counts as
    /// created. That also makes a zombie's late create harmless while the
    /// parent is retried: it can only create a child its successor creates
    /// (or finds) anyway. This holds only if the sub-graph is a
    /// deterministic function of the task (payload, dependency results),
    /// never of time or chance; a different spec under the same version is
    /// [`Error::SpawnConflict`]. A new `version` is a new set of children,
    /// next to the old ones. A create that lands after the parent ended
    /// (cancelled, or its last attempt over) is refused by the operator:
    /// the child is `Rejected` (condition `SpawnRefused`) and never runs.
    ///
    /// A parent that needs its children's results waits for them without
    /// holding its lease: end the parent, and let a follow-up task — a
    /// last child `after` all the others, or an existing task whose
    /// `dependsOn` names the returned children — read them with
    /// [`TaskContext::dependency_results`].
    pub async fn spawn(&self, subgraph: &Subgraph) -> Result<Vec<String>, Error> {
        let parent = Parent {
            namespace: &self.namespace,
            name: &self.task_name,
            uid: &self.task_uid,
        };
        // A zombie parent must not go on expanding.
        let (names, created) =
            create_children(&self.client, &parent, subgraph, || self.fence.check()).await?;
        info!(
            task = %self.task_name,
            token = self.fence.token(),
            version = %subgraph.version,
            children = names.len(),
            created,
            "sub-graph spawned"
        );
        Ok(names)
    }
}

/// The task children are spawned under.
#[doc(hidden)]
#[derive(Debug, Clone, Copy)]
pub struct Parent<'a> {
    pub namespace: &'a str,
    pub name: &'a str,
    pub uid: &'a str,
}

/// What [`TaskContext::spawn`] does once it has its parent: plan the
/// sub-graph, then create each child (dependencies first), calling
/// `check` right before each create; returns the children's names in
/// logical order and how many were new.
///
/// Not for handlers — `ctx.spawn` passes the attempt's fence as `check`.
/// Public so a test can play a worker that passed its fence check and
/// was paused before its create landed (`e2e/tests/graphs.rs`), with the
/// very objects the SDK sends.
#[doc(hidden)]
pub async fn create_children(
    client: &kube::Client,
    parent: &Parent<'_>,
    subgraph: &Subgraph,
    mut check: impl FnMut() -> Result<(), Error>,
) -> Result<(Vec<String>, usize), Error> {
    let plan = plan(parent.name, parent.uid, subgraph)?;
    let api: Api<BatchTask> = Api::namespaced(client.clone(), parent.namespace);
    let mut created = 0usize;
    for &i in &plan.create_order {
        let Some(child) = plan.children.get(i) else {
            continue;
        };
        check()?;
        let object = child_object(child, parent.name, parent.uid, parent.namespace);
        if create_child(&api, &object, parent.uid).await? == Created::New {
            created += 1;
        }
    }
    Ok((plan.children.into_iter().map(|c| c.name).collect(), created))
}

/// What a create found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Created {
    New,
    /// Our own earlier create.
    Existed,
}

/// The child as sent to the API server.
fn child_object(
    child: &PlannedChild,
    parent: &str,
    parent_uid: &str,
    namespace: &str,
) -> BatchTask {
    let mut object = BatchTask::new(&child.name, child.spec.clone());
    object.metadata.namespace = Some(namespace.to_owned());
    object.metadata.labels = Some(BTreeMap::from([(
        LABEL_PARENT.to_owned(),
        names::label_value(parent),
    )]));
    object.metadata.owner_references = Some(vec![OwnerReference {
        api_version: BatchTask::api_version(&()).into_owned(),
        kind: BatchTask::kind(&()).into_owned(),
        name: parent.to_owned(),
        uid: parent_uid.to_owned(),
        controller: Some(true),
        // `true` needs update permission on the parent's finalizers.
        block_owner_deletion: Some(false),
    }]);
    object
}

/// Creates `object`; a taken name is success only if it holds our child.
async fn create_child(
    api: &Api<BatchTask>,
    object: &BatchTask,
    parent_uid: &str,
) -> Result<Created, Error> {
    let name = object.name_any();
    for _ in 0..CREATE_TRIES {
        let err = match timeout(CALL_BUDGET, api.create(&PostParams::default(), object)).await {
            Err(_) => {
                return Err(Error::Timeout {
                    what: "child create",
                });
            }
            Ok(Ok(_)) => {
                debug!(child = %name, "child created");
                return Ok(Created::New);
            }
            Ok(Err(e)) => e,
        };
        match err {
            kube::Error::Api(s) if s.is_already_exists() => {}
            kube::Error::Api(s) if s.code < 500 && s.code != 429 => {
                return Err(Error::SpawnRefused {
                    name,
                    source: kube::Error::Api(s),
                });
            }
            source => {
                return Err(Error::Kube {
                    what: "child create",
                    source,
                });
            }
        }
        let existing = match timeout(CALL_BUDGET, api.get_opt(&name)).await {
            Err(_) => return Err(Error::Timeout { what: "child read" }),
            Ok(Err(source)) => {
                return Err(Error::Kube {
                    what: "child read",
                    source,
                });
            }
            // Deleted since: create it again.
            Ok(Ok(None)) => continue,
            Ok(Ok(Some(existing))) => existing,
        };
        return match difference(object, &existing, parent_uid) {
            None => {
                debug!(child = %name, "child exists already, same owner and spec");
                Ok(Created::Existed)
            }
            Some(differs) => Err(Error::SpawnConflict { name, differs }),
        };
    }
    Err(Error::Contended {
        what: "child create",
    })
}

/// What makes `existing` not the child `sent` would have created, if
/// anything: its controlling owner, or fields of its spec (`None`: the
/// same child).
fn difference(sent: &BatchTask, existing: &BatchTask, parent_uid: &str) -> Option<String> {
    let owner = existing
        .owner_references()
        .iter()
        .find(|o| o.controller == Some(true))
        .map(|o| o.uid.as_str());
    if owner != Some(parent_uid) {
        return Some("owner".to_owned());
    }
    let fields = spec_differences(&sent.spec, &existing.spec);
    if fields.is_empty() {
        None
    } else {
        Some(fields.join(", "))
    }
}

/// The top-level spec fields (`spec.payload`, `spec.dependsOn`, …) in
/// which `stored` (as the API server returned it) differs from `sent`.
///
/// The API server fills in schema defaults for absent fields, and the
/// schema's defaults are serde's (schemars reads them from the serde
/// attributes), so `sent` is compared after a serde round trip — which
/// applies exactly those defaults, to fields this SDK knows. Fields it
/// does not know are dropped from both sides alike. The payload is
/// compared as JSON, not as text: the server re-encodes it (key order,
/// `<` as `\u003c`, `1.0` as `1`).
fn spec_differences(sent: &BatchTaskSpec, stored: &BatchTaskSpec) -> Vec<String> {
    let mut differs = Vec::new();
    if !same_payload(sent.payload.as_ref(), stored.payload.as_ref()) {
        differs.push("spec.payload".to_owned());
    }
    let without_payload = |s: &BatchTaskSpec| BatchTaskSpec {
        payload: None,
        ..s.clone()
    };
    let sent = serde_json::to_value(without_payload(sent))
        .and_then(serde_json::from_value::<BatchTaskSpec>)
        .and_then(serde_json::to_value);
    let stored = serde_json::to_value(without_payload(stored));
    let (Ok(Value::Object(sent)), Ok(Value::Object(stored))) = (sent, stored) else {
        // Cannot happen for these types; never call it the same.
        differs.push("spec".to_owned());
        return differs;
    };
    let mut keys: Vec<&String> = sent.keys().chain(stored.keys()).collect();
    keys.sort();
    keys.dedup();
    for key in keys {
        if sent.get(key) != stored.get(key) {
            differs.push(format!("spec.{key}"));
        }
    }
    differs
}

/// The same JSON, whatever its encoding. A payload nested deeper than
/// serde_json decodes (128 levels) is compared as text only.
fn same_payload(a: Option<&JsonObject>, b: Option<&JsonObject>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) if a == b => true,
        (Some(a), Some(b)) => match (a.to_value(), b.to_value()) {
            (Ok(a), Ok(b)) => same_json(&a, &b),
            _ => false,
        },
        _ => false,
    }
}

/// JSON equality in which numbers are equal when their values are: the
/// API server decodes `1.0` as the integer 1 and large integers as floats.
/// Recursion is bounded by serde_json's 128-level decoding limit.
fn same_json(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => {
            x == y || (x.is_f64() || y.is_f64()) && x.as_f64() == y.as_f64()
        }
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same_json(x, y))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| same_json(v, w)))
        }
        _ => a == b,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    fn planned(payload: Option<&str>) -> PlannedChild {
        let mut spec = BatchTaskSpec::for_queue("q");
        spec.payload = payload.map(|p| JsonObject::from_text(p).unwrap());
        spec.depends_on = vec!["a".into()];
        PlannedChild {
            name: "p-0123456789".into(),
            spec,
        }
    }

    /// What the API server would return for `sent`: re-encoded as Go does
    /// it (through the CRD's structural schema and defaults).
    fn as_stored(sent: &BatchTask, server_json: Value) -> BatchTask {
        let mut v = serde_json::to_value(sent).unwrap();
        v["spec"] = server_json;
        v["metadata"]["uid"] = json!("child-uid");
        v["metadata"]["resourceVersion"] = json!("42");
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn the_child_object_is_owned_labelled_and_namespaced() {
        let long_parent = "p".repeat(100);
        let o = child_object(&planned(None), &long_parent, "uid-1", "ns");
        assert_eq!(o.metadata.namespace.as_deref(), Some("ns"));
        assert_eq!(o.name_any(), "p-0123456789");
        let owner = &o.owner_references()[0];
        assert_eq!(
            (
                owner.kind.as_str(),
                owner.api_version.as_str(),
                owner.uid.as_str()
            ),
            ("BatchTask", "batchlease.dev/v1alpha1", "uid-1")
        );
        assert_eq!(
            (owner.controller, owner.block_owner_deletion),
            (Some(true), Some(false))
        );
        assert_eq!(o.labels()[LABEL_PARENT], names::label_value(&long_parent));
        assert!(o.labels()[LABEL_PARENT].len() <= 63);
    }

    #[test]
    fn an_existing_child_is_ours_only_with_our_owner_and_spec() {
        let sent = child_object(
            &planned(Some(r#"{"b":1.0,"a":"<x>","big":12345678901234567890}"#)),
            "p",
            "uid-1",
            "ns",
        );
        // The spec as the API server stores it: keys sorted, 1.0 decoded
        // as an integer, a huge integer as a float, and every default
        // spelled out.
        let server_spec = json!({
            "queue": "q",
            "payload": {"a": "<x>", "b": 1, "big": 1.2345678901234567e19},
            "leaseDurationSeconds": 30, "maxRetries": 3,
            "backoff": {"initialSeconds": 1, "maxSeconds": 300, "multiplier": 2},
            "dependsOn": ["a"], "mode": "Exclusive", "maxSpeculativeAborts": 3, "redrive": 0,
        });
        let same = as_stored(&sent, server_spec.clone());
        // A server that leaves defaults out of what it returns (or an
        // older child without them) is the same child too.
        let mut sparse_spec = server_spec.clone();
        for k in [
            "leaseDurationSeconds",
            "maxRetries",
            "backoff",
            "mode",
            "redrive",
        ] {
            sparse_spec.as_object_mut().unwrap().remove(k);
        }
        let sparse = as_stored(&sent, sparse_spec);
        let mut other_owner = same.clone();
        other_owner.metadata.owner_references.as_mut().unwrap()[0].uid = "uid-2".into();
        let mut no_owner = same.clone();
        no_owner.metadata.owner_references = None;
        let mut other_payload = server_spec.clone();
        other_payload["payload"]["b"] = json!(2);
        let mut other_deps_and_retries = server_spec.clone();
        other_deps_and_retries["dependsOn"] = json!(["a", "b"]);
        other_deps_and_retries["maxRetries"] = json!(5);
        let mut extra_field = server_spec.clone();
        extra_field["activeDeadlineSeconds"] = json!(60);
        let cases: Vec<(&str, BatchTask, Option<&str>)> = vec![
            ("same child, re-encoded", same, None),
            ("defaults left out", sparse, None),
            ("another owner", other_owner, Some("owner")),
            ("no owner", no_owner, Some("owner")),
            (
                "another payload",
                as_stored(&sent, other_payload),
                Some("spec.payload"),
            ),
            (
                "other fields",
                as_stored(&sent, other_deps_and_retries),
                Some("spec.dependsOn, spec.maxRetries"),
            ),
            (
                "a field we did not set",
                as_stored(&sent, extra_field),
                Some("spec.activeDeadlineSeconds"),
            ),
        ];
        for (what, existing, want) in cases {
            assert_eq!(
                difference(&sent, &existing, "uid-1").as_deref(),
                want,
                "{what}"
            );
        }
    }

    #[test]
    fn json_equality_is_by_value() {
        let cases = [
            (json!({"a": 1}), json!({"a": 1.0}), true),
            (
                json!({"a": [1, {"b": 2.5}]}),
                json!({"a": [1.0, {"b": 2.5}]}),
                true,
            ),
            (json!({"a": 1}), json!({"a": 1.5}), false),
            (json!({"a": 1}), json!({"a": "1"}), false),
            (json!({"a": 1}), json!({"a": 1, "b": null}), false),
            (json!({"a": [1, 2]}), json!({"a": [2, 1]}), false),
            (json!({"a": -1}), json!({"a": -1}), true),
        ];
        for (a, b, want) in cases {
            assert_eq!(same_json(&a, &b), want, "{a} vs {b}");
        }
        let deep = |n: usize| {
            JsonObject::from_text(format!("{}1{}", "{\"a\":".repeat(n), "}".repeat(n))).unwrap()
        };
        assert!(
            same_payload(Some(&deep(200)), Some(&deep(200))),
            "same text"
        );
        assert!(!same_payload(Some(&deep(200)), Some(&deep(201))));
        assert!(!same_payload(Some(&deep(1)), None));
        assert!(same_payload(None, None));
        let text = |t: &str| JsonObject::from_text(t).unwrap();
        assert!(
            same_payload(
                Some(&text(r#"{"a":"<x>"}"#)),
                Some(&text(r#"{"a":"\u003cx>"}"#))
            ),
            "Go escapes < as \\u003c"
        );
    }
}
