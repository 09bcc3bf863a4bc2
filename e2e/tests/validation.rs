//! Bad input is refused by the real API server with a clear message and loses
//! nothing; a valid object right next to each bad one passes.
//!
//! Every rule of the CRD schema (CEL rules, bounds, enums, formats) has a row
//! here. Objects go in as raw JSON so that values the Rust types cannot even
//! express (an unknown `mode`, a negative bound) are tested too.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use batchlease_api::{BatchTask, TaskLease};
use batchlease_e2e::{Cluster, TestNamespace};
use kube::api::{Api, ApiResource, DynamicObject, PostParams};
use serde_json::{Value, json};

fn ar_task() -> ApiResource {
    ApiResource::erase::<BatchTask>(&())
}
fn ar_lease() -> ApiResource {
    ApiResource::erase::<TaskLease>(&())
}

fn task(name: &str, spec: Value) -> Value {
    json!({"apiVersion": "batchlease.dev/v1alpha1", "kind": "BatchTask", "metadata": {"name": name}, "spec": spec})
}

fn lease(name: &str, holder: Option<&str>, phase: &str) -> Value {
    let mut spec = json!({
        "taskName": "t", "taskUID": "uid-1", "queue": "q",
        "fencingToken": 3, "leaseDurationSeconds": 30,
    });
    if let Some(h) = holder {
        spec["holderIdentity"] = json!(h);
        spec["acquireTime"] = json!("2026-11-29T10:00:00.000000Z");
        spec["renewTime"] = json!("2026-11-29T10:00:00.000000Z");
    }
    json!({"apiVersion": "batchlease.dev/v1alpha1", "kind": "TaskLease", "metadata": {"name": name},
           "spec": spec, "status": {"phase": phase}})
}

fn dyn_obj(v: Value) -> DynamicObject {
    serde_json::from_value(v).unwrap()
}

/// The message of a rejected write, or why the write was not rejected.
fn rejection(result: Result<DynamicObject, kube::Error>) -> Result<String, String> {
    match result {
        Err(kube::Error::Api(status)) if status.code == 422 => Ok(status.message.clone()),
        Err(e) => Err(format!("rejected, but not as invalid (422): {e}")),
        Ok(_) => Err("accepted".into()),
    }
}

struct Create {
    what: &'static str,
    kind: ApiResource,
    bad: Value,
    expect: &'static str,
    good: Value,
}

fn create_cases() -> Vec<Create> {
    let bt = |name: &str, spec: Value| task(name, spec);
    let sixty_five: Vec<String> = (0..65).map(|i| format!("dep-{i}")).collect();
    let sixty_four = &sixty_five[..64];
    vec![
        Create {
            what: "queue with an upper-case letter and '_'",
            kind: ar_task(),
            bad: bt("c-queue-bad", json!({"queue": "Bad_Queue"})),
            expect: "queue must be a DNS label",
            good: bt("c-queue-good", json!({"queue": "good-queue"})),
        },
        Create {
            what: "queue starting with '-'",
            kind: ar_task(),
            bad: bt("c-queue-dash", json!({"queue": "-lead"})),
            expect: "queue must be a DNS label",
            good: bt("c-queue-dash-ok", json!({"queue": "lead-1"})),
        },
        Create {
            what: "queue longer than a DNS label",
            kind: ar_task(),
            bad: bt("c-queue-long", json!({"queue": "q".repeat(64)})),
            expect: "spec.queue: Too long: may not be more than 63 bytes",
            good: bt("c-queue-long-ok", json!({"queue": "q".repeat(63)})),
        },
        Create {
            what: "missing queue",
            kind: ar_task(),
            bad: bt("c-queue-missing", json!({"payload": {"a": 1}})),
            expect: "spec.queue: Required value",
            good: bt(
                "c-queue-present",
                json!({"queue": "q", "payload": {"a": 1, "nested": {"kept": true}}}),
            ),
        },
        Create {
            what: "lease shorter than 5 s",
            kind: ar_task(),
            bad: bt(
                "c-ttl-low",
                json!({"queue": "q", "leaseDurationSeconds": 4}),
            ),
            expect: "leaseDurationSeconds must be between 5 and 3600",
            good: bt(
                "c-ttl-low-ok",
                json!({"queue": "q", "leaseDurationSeconds": 5}),
            ),
        },
        Create {
            what: "lease longer than an hour",
            kind: ar_task(),
            bad: bt(
                "c-ttl-high",
                json!({"queue": "q", "leaseDurationSeconds": 3601}),
            ),
            expect: "leaseDurationSeconds must be between 5 and 3600",
            good: bt(
                "c-ttl-high-ok",
                json!({"queue": "q", "leaseDurationSeconds": 3600}),
            ),
        },
        Create {
            what: "negative maxRetries",
            kind: ar_task(),
            bad: bt("c-retries-neg", json!({"queue": "q", "maxRetries": -1})),
            expect: "maxRetries must be between 0 and 100",
            good: bt("c-retries-zero", json!({"queue": "q", "maxRetries": 0})),
        },
        Create {
            what: "maxRetries above 100",
            kind: ar_task(),
            bad: bt("c-retries-high", json!({"queue": "q", "maxRetries": 101})),
            expect: "maxRetries must be between 0 and 100",
            good: bt("c-retries-100", json!({"queue": "q", "maxRetries": 100})),
        },
        Create {
            what: "unknown mode",
            kind: ar_task(),
            bad: bt("c-mode-bad", json!({"queue": "q", "mode": "Turbo"})),
            expect: "spec.mode: Unsupported value: \"Turbo\": supported values: \"Exclusive\", \"Speculative\"",
            good: bt("c-mode-ok", json!({"queue": "q", "mode": "Speculative"})),
        },
        Create {
            what: "duplicate dependency",
            kind: ar_task(),
            bad: bt(
                "c-deps-dup",
                json!({"queue": "q", "dependsOn": ["a", "b", "a"]}),
            ),
            expect: "spec.dependsOn[2]: Duplicate value: \"a\"",
            good: bt(
                "c-deps-uniq",
                json!({"queue": "q", "dependsOn": ["a", "b"]}),
            ),
        },
        Create {
            what: "task depending on itself",
            kind: ar_task(),
            bad: bt(
                "c-deps-self",
                json!({"queue": "q", "dependsOn": ["x", "c-deps-self"]}),
            ),
            expect: "spec.dependsOn must not contain the task's own name",
            good: bt(
                "c-deps-other",
                json!({"queue": "q", "dependsOn": ["x", "c-deps-self"]}),
            ),
        },
        Create {
            what: "65 dependencies",
            kind: ar_task(),
            bad: bt(
                "c-deps-many",
                json!({"queue": "q", "dependsOn": sixty_five}),
            ),
            expect: "spec.dependsOn: Too many: 65: must have at most 64 items",
            good: bt("c-deps-64", json!({"queue": "q", "dependsOn": sixty_four})),
        },
        Create {
            what: "duplicate resource",
            kind: ar_task(),
            bad: bt(
                "c-res-dup",
                json!({"queue": "q", "resources": ["db", "db"]}),
            ),
            expect: "spec.resources[1]: Duplicate value: \"db\"",
            good: bt(
                "c-res-uniq",
                json!({"queue": "q", "resources": ["db", "cache"]}),
            ),
        },
        Create {
            what: "backoff max below initial",
            kind: ar_task(),
            bad: bt(
                "c-backoff-bad",
                json!({"queue": "q", "backoff": {"initialSeconds": 10, "maxSeconds": 5}}),
            ),
            expect: "backoff.maxSeconds must be at least backoff.initialSeconds",
            good: bt(
                "c-backoff-ok",
                json!({"queue": "q", "backoff": {"initialSeconds": 10, "maxSeconds": 10}}),
            ),
        },
        Create {
            what: "zero backoff multiplier",
            kind: ar_task(),
            bad: bt(
                "c-mult-zero",
                json!({"queue": "q", "backoff": {"multiplier": 0}}),
            ),
            expect: "spec.backoff.multiplier: Invalid value: 0: spec.backoff.multiplier in body should be greater than or equal to 1",
            good: bt(
                "c-mult-one",
                json!({"queue": "q", "backoff": {"multiplier": 1}}),
            ),
        },
        Create {
            what: "payload that is not an object",
            kind: ar_task(),
            bad: bt(
                "c-payload-str",
                json!({"queue": "q", "payload": "just a string"}),
            ),
            expect: "spec.payload: Invalid value: \"string\": spec.payload in body must be of type object",
            good: bt(
                "c-payload-obj",
                json!({"queue": "q", "payload": {"any": ["shape", 1]}}),
            ),
        },
        Create {
            what: "activeDeadlineSeconds of zero",
            kind: ar_task(),
            bad: bt(
                "c-deadline-zero",
                json!({"queue": "q", "activeDeadlineSeconds": 0}),
            ),
            expect: "spec.activeDeadlineSeconds: Invalid value: 0",
            good: bt(
                "c-deadline-one",
                json!({"queue": "q", "activeDeadlineSeconds": 1}),
            ),
        },
        Create {
            what: "activeDeadlineSeconds near i64::MAX (panicked every claimant's clock)",
            kind: ar_task(),
            bad: bt(
                "c-deadline-huge",
                json!({"queue": "q", "activeDeadlineSeconds": i64::MAX}),
            ),
            expect: "spec.activeDeadlineSeconds: Invalid value: 9223372036854775807",
            good: bt(
                "c-deadline-year",
                json!({"queue": "q", "activeDeadlineSeconds": 31_536_000}),
            ),
        },
        Create {
            what: "maxSpeculativeAborts above 100",
            kind: ar_task(),
            bad: bt(
                "c-aborts-high",
                json!({"queue": "q", "maxSpeculativeAborts": 101}),
            ),
            expect: "spec.maxSpeculativeAborts: Invalid value: 101",
            good: bt(
                "c-aborts-100",
                json!({"queue": "q", "maxSpeculativeAborts": 100}),
            ),
        },
        Create {
            what: "backoff initialSeconds of zero",
            kind: ar_task(),
            bad: bt(
                "c-init-zero",
                json!({"queue": "q", "backoff": {"initialSeconds": 0}}),
            ),
            expect: "spec.backoff.initialSeconds: Invalid value: 0",
            good: bt(
                "c-init-one",
                json!({"queue": "q", "backoff": {"initialSeconds": 1}}),
            ),
        },
        Create {
            what: "backoff maxSeconds above a day",
            kind: ar_task(),
            bad: bt(
                "c-max-day",
                json!({"queue": "q", "backoff": {"maxSeconds": 86401}}),
            ),
            expect: "spec.backoff.maxSeconds: Invalid value: 86401",
            good: bt(
                "c-max-day-ok",
                json!({"queue": "q", "backoff": {"maxSeconds": 86400}}),
            ),
        },
        Create {
            what: "backoff multiplier above 10",
            kind: ar_task(),
            bad: bt(
                "c-mult-high",
                json!({"queue": "q", "backoff": {"multiplier": 11}}),
            ),
            expect: "spec.backoff.multiplier: Invalid value: 11",
            good: bt(
                "c-mult-ten",
                json!({"queue": "q", "backoff": {"multiplier": 10}}),
            ),
        },
        Create {
            what: "33 resources",
            kind: ar_task(),
            bad: bt(
                "c-res-many",
                json!({"queue": "q", "resources": (0..33).map(|i| format!("r{i}")).collect::<Vec<_>>()}),
            ),
            expect: "spec.resources: Too many",
            good: bt(
                "c-res-32",
                json!({"queue": "q", "resources": (0..32).map(|i| format!("r{i}")).collect::<Vec<_>>()}),
            ),
        },
        Create {
            what: "resource name that cannot be part of a Lease name",
            kind: ar_task(),
            bad: bt(
                "c-res-name-bad",
                json!({"queue": "q", "resources": ["Ware House"]}),
            ),
            expect: "spec.resources[0] in body should match",
            good: bt(
                "c-res-name-ok",
                json!({"queue": "q", "resources": ["ware-house"]}),
            ),
        },
        Create {
            what: "lease holder identity over 253 characters",
            kind: ar_lease(),
            bad: {
                let mut l = lease("c-lease-longholder", None, "Held");
                l["spec"]["holderIdentity"] = json!("w".repeat(254));
                l
            },
            expect: "spec.holderIdentity: Too long",
            good: {
                let mut l = lease("c-lease-holder253", None, "Held");
                l["spec"]["holderIdentity"] = json!("w".repeat(253));
                l
            },
        },
        Create {
            what: "lease reason over 128 characters",
            kind: ar_lease(),
            bad: {
                let mut l = lease("c-lease-longreason", Some("w1"), "Completed");
                l["status"]["outcome"] = json!("Failed");
                l["status"]["reason"] = json!("R".repeat(129));
                l
            },
            expect: "status.reason: Too long",
            good: {
                let mut l = lease("c-lease-reason128", Some("w1"), "Completed");
                l["status"]["outcome"] = json!("Failed");
                l["status"]["reason"] = json!("R".repeat(128));
                l
            },
        },
        Create {
            what: "lease message over 4096 characters",
            kind: ar_lease(),
            bad: {
                let mut l = lease("c-lease-longmsg", Some("w1"), "Completed");
                l["status"]["outcome"] = json!("Failed");
                l["status"]["message"] = json!("m".repeat(4097));
                l
            },
            expect: "status.message: Too long",
            good: {
                let mut l = lease("c-lease-msg4096", Some("w1"), "Completed");
                l["status"]["outcome"] = json!("Failed");
                l["status"]["message"] = json!("m".repeat(4096));
                l
            },
        },
        Create {
            what: "lease fencing token zero",
            kind: ar_lease(),
            bad: {
                let mut l = lease("c-lease-token0", None, "Offered");
                l["spec"]["fencingToken"] = json!(0);
                l
            },
            expect: "spec.fencingToken: Invalid value: 0",
            good: lease("c-lease-token3", None, "Offered"),
        },
        Create {
            what: "unknown lease outcome",
            kind: ar_lease(),
            bad: {
                let mut l = lease("c-lease-maybe", Some("w1"), "Completed");
                l["status"]["outcome"] = json!("Maybe");
                l
            },
            expect: "status.outcome: Unsupported value: \"Maybe\"",
            good: {
                let mut l = lease("c-lease-done", Some("w1"), "Completed");
                l["status"]["outcome"] = json!("Succeeded");
                l
            },
        },
        Create {
            what: "lease TTL out of range",
            kind: ar_lease(),
            bad: {
                let mut l = lease("c-lease-ttl", None, "Offered");
                l["spec"]["leaseDurationSeconds"] = json!(1);
                l
            },
            expect: "leaseDurationSeconds must be between 5 and 3600",
            good: lease("c-lease-ttl-ok", None, "Offered"),
        },
        Create {
            what: "Held lease without a holder",
            kind: ar_lease(),
            bad: lease("c-lease-noholder", None, "Held"),
            expect: "a Held or Completed lease must name its holder in spec.holderIdentity",
            good: lease("c-lease-holder", Some("w1"), "Held"),
        },
        Create {
            what: "unknown lease phase",
            kind: ar_lease(),
            bad: lease("c-lease-zombie", Some("w1"), "Zombie"),
            expect: "status.phase: Unsupported value: \"Zombie\"",
            good: lease("c-lease-offered", None, "Offered"),
        },
        Create {
            what: "lease without a fencing token",
            kind: ar_lease(),
            bad: {
                let mut l = lease("c-lease-notoken", None, "Offered");
                l["spec"].as_object_mut().unwrap().remove("fencingToken");
                l
            },
            expect: "spec.fencingToken: Required value",
            good: lease("c-lease-token", None, "Offered"),
        },
    ]
}

/// An update of an existing object: the base is created (and its status
/// written) first, then `bad` must be refused and leave the object as it
/// was, and `good` applied to the same object must pass.
struct Update {
    what: &'static str,
    kind: ApiResource,
    base: Value,
    /// Write through the `/status` subresource (BatchTask status).
    status: bool,
    bad: fn(&mut Value),
    expect: &'static str,
    good: fn(&mut Value),
}

fn update_cases() -> Vec<Update> {
    let with_token = |name: &str| {
        let mut t = task(name, json!({"queue": "q"}));
        t["status"] = json!({"phase": "Ready", "fencingToken": 5});
        t
    };
    vec![
        Update {
            what: "redrive decreased",
            kind: ar_task(),
            base: task("u-redrive", json!({"queue": "q", "redrive": 2})),
            status: false,
            bad: |o| o["spec"]["redrive"] = json!(1),
            expect: "redrive may only increase",
            good: |o| o["spec"]["redrive"] = json!(3),
        },
        Update {
            what: "fencing token decreased",
            kind: ar_task(),
            base: with_token("u-token-down"),
            status: true,
            bad: |o| o["status"]["fencingToken"] = json!(4),
            expect: "status.fencingToken must never decrease",
            good: |o| o["status"]["fencingToken"] = json!(6),
        },
        Update {
            what: "fencing token dropped with the whole status",
            kind: ar_task(),
            base: with_token("u-token-drop"),
            status: true,
            bad: |o| {
                o.as_object_mut().unwrap().remove("status");
            },
            expect: "status.fencingToken must never decrease",
            good: |o| o["status"]["phase"] = json!("Running"),
        },
        Update {
            what: "task queue changed under its leases",
            kind: ar_task(),
            base: task("u-queue", json!({"queue": "q"})),
            status: false,
            bad: |o| o["spec"]["queue"] = json!("other"),
            expect: "queue is immutable",
            good: |o| o["spec"]["payload"] = json!({"n": 2}),
        },
        Update {
            what: "task resources edited (a lock could be stranded)",
            kind: ar_task(),
            base: task("u-resources", json!({"queue": "q", "resources": ["db"]})),
            status: false,
            bad: |o| o["spec"]["resources"] = json!(["db", "wh"]),
            expect: "spec.resources is immutable",
            good: |o| o["spec"]["dependsOn"] = json!(["x"]),
        },
        Update {
            what: "task resources added",
            kind: ar_task(),
            base: task("u-resources-add", json!({"queue": "q"})),
            status: false,
            bad: |o| o["spec"]["resources"] = json!(["db"]),
            expect: "spec.resources is immutable",
            good: |o| o["spec"]["payload"] = json!({"n": 2}),
        },
        Update {
            what: "lease resource tokens raised",
            kind: ar_lease(),
            base: {
                let mut l = lease("u-lease-rt", None, "Offered");
                l["spec"]["resourceTokens"] = json!({"db": 3});
                l
            },
            status: false,
            bad: |o| o["spec"]["resourceTokens"] = json!({"db": i64::MAX}),
            expect: "resourceTokens are immutable",
            good: |o| o["metadata"]["labels"] = json!({"x": "y"}),
        },
        Update {
            what: "lease queue changed",
            kind: ar_lease(),
            base: lease("u-lease-queue", None, "Offered"),
            status: false,
            bad: |o| o["spec"]["queue"] = json!("other"),
            expect: "queue is immutable",
            good: |o| o["metadata"]["labels"] = json!({"x": "y"}),
        },
        Update {
            what: "lease taskUID changed",
            kind: ar_lease(),
            base: lease("u-lease-uid", None, "Offered"),
            status: false,
            bad: |o| o["spec"]["taskUID"] = json!("uid-2"),
            expect: "taskUID is immutable",
            good: |o| o["metadata"]["labels"] = json!({"x": "z"}),
        },
        Update {
            what: "Completed lease's result rewritten",
            kind: ar_lease(),
            base: {
                let mut l = lease("u-lease-result", Some("w1"), "Completed");
                l["status"]["outcome"] = json!("Succeeded");
                l["status"]["result"] = json!({"rows": 1});
                l
            },
            status: false,
            bad: |o| o["status"]["result"] = json!({"rows": 1000}),
            expect: "a Completed, Expired or Released lease is final",
            good: |o| o["metadata"]["labels"] = json!({"seen": "yes"}),
        },
        Update {
            what: "Expired lease given an outcome",
            kind: ar_lease(),
            base: lease("u-lease-outcome", Some("w1"), "Expired"),
            status: false,
            bad: |o| {
                o["status"]["outcome"] = json!("Succeeded");
                o["status"]["checkpoint"] = json!({"step": 9});
            },
            expect: "a Completed, Expired or Released lease is final",
            good: |o| o["metadata"]["labels"] = json!({"seen": "too"}),
        },
        Update {
            what: "lease fencing token changed",
            kind: ar_lease(),
            base: lease("u-lease-token", Some("w1"), "Held"),
            status: false,
            bad: |o| o["spec"]["fencingToken"] = json!(4),
            expect: "fencingToken is immutable",
            good: |o| o["spec"]["renewTime"] = json!("2026-11-29T10:00:10.000000Z"),
        },
        Update {
            what: "lease duration changed",
            kind: ar_lease(),
            base: lease("u-lease-ttl", Some("w1"), "Held"),
            status: false,
            bad: |o| o["spec"]["leaseDurationSeconds"] = json!(60),
            expect: "leaseDurationSeconds is immutable",
            good: |o| o["status"]["checkpoint"] = json!({"step": 3}),
        },
        Update {
            what: "lease task name changed",
            kind: ar_lease(),
            base: lease("u-lease-task", Some("w1"), "Held"),
            status: false,
            bad: |o| o["spec"]["taskName"] = json!("other"),
            expect: "taskName is immutable",
            good: |o| o["spec"]["renewTime"] = json!("2026-11-29T10:00:20.000000Z"),
        },
        Update {
            what: "lease holder replaced",
            kind: ar_lease(),
            base: lease("u-lease-steal", Some("w1"), "Held"),
            status: false,
            bad: |o| o["spec"]["holderIdentity"] = json!("w2"),
            expect: "holderIdentity may be set once and never changed",
            good: |o| o["spec"]["holderIdentity"] = json!("w1"),
        },
        Update {
            what: "lease holder removed",
            kind: ar_lease(),
            base: lease("u-lease-unset", Some("w1"), "Held"),
            status: false,
            bad: |o| {
                o["spec"].as_object_mut().unwrap().remove("holderIdentity");
            },
            expect: "holderIdentity may be set once and never changed",
            good: |o| o["status"]["phase"] = json!("Expired"),
        },
        Update {
            what: "Offered lease settled without being held (any worker could settle any task)",
            kind: ar_lease(),
            base: lease("u-lease-settle-offer", None, "Offered"),
            status: false,
            bad: |o| {
                o["spec"]["holderIdentity"] = json!("w-other-queue");
                o["status"]["phase"] = json!("Completed");
                o["status"]["outcome"] = json!("Succeeded");
            },
            expect: "a lease may become Completed only from Held",
            good: |o| o["status"]["phase"] = json!("Expired"),
        },
        Update {
            what: "Held lease's phase removed (wedged its task)",
            kind: ar_lease(),
            base: lease("u-lease-phase-gone", Some("w1"), "Held"),
            status: false,
            bad: |o| {
                o["status"].as_object_mut().unwrap().remove("phase");
            },
            expect: "status.phase may not be removed once set",
            good: |o| o["status"]["phase"] = json!("Expired"),
        },
        Update {
            what: "Held lease offered again",
            kind: ar_lease(),
            base: lease("u-lease-reoffer", Some("w1"), "Held"),
            status: false,
            bad: |o| o["status"]["phase"] = json!("Offered"),
            expect: "a Held lease cannot be offered again",
            good: |o| {
                o["status"]["phase"] = json!("Completed");
                o["status"]["outcome"] = json!("Succeeded");
            },
        },
        Update {
            what: "Completed lease revived",
            kind: ar_lease(),
            base: {
                let mut l = lease("u-lease-revive", Some("w1"), "Completed");
                l["status"]["outcome"] = json!("Failed");
                l
            },
            status: false,
            bad: |o| o["status"]["phase"] = json!("Held"),
            expect: "a Completed, Expired or Released lease is final",
            good: |o| {
                o["metadata"]["labels"] = json!({"note": "metadata-may-change"});
            },
        },
        Update {
            what: "zombie renewal of an Expired lease",
            kind: ar_lease(),
            base: lease("u-lease-zombie", Some("w1"), "Expired"),
            status: false,
            bad: |o| o["spec"]["renewTime"] = json!("2026-11-29T10:05:00.000000Z"),
            expect: "a Completed, Expired or Released lease is final",
            good: |o| {
                o["metadata"]["annotations"] = json!({"batchlease.dev/note": "ok"});
            },
        },
        Update {
            what: "Released lease completed late",
            kind: ar_lease(),
            base: lease("u-lease-late", Some("w1"), "Released"),
            status: false,
            bad: |o| {
                o["status"]["phase"] = json!("Completed");
                o["status"]["outcome"] = json!("Succeeded");
            },
            expect: "a Completed, Expired or Released lease is final",
            good: |o| {
                o["metadata"]["labels"] = json!({"seen": "true"});
            },
        },
    ]
}

async fn run_create(
    ns: &TestNamespace,
    client: &kube::Client,
    case: &Create,
) -> Result<(), String> {
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns.name, &case.kind);
    let bad_name = case.bad["metadata"]["name"].as_str().unwrap().to_owned();
    let msg = rejection(
        api.create(&PostParams::default(), &dyn_obj(case.bad.clone()))
            .await,
    )?;
    if !msg.contains(case.expect) {
        return Err(format!("message lacks {:?}: {msg}", case.expect));
    }
    // Nothing half-created.
    if api
        .get_opt(&bad_name)
        .await
        .map_err(|e| e.to_string())?
        .is_some()
    {
        return Err("the rejected object exists".into());
    }
    api.create(&PostParams::default(), &dyn_obj(case.good.clone()))
        .await
        .map_err(|e| format!("valid neighbour refused: {e}"))?;
    Ok(())
}

async fn run_update(
    ns: &TestNamespace,
    client: &kube::Client,
    case: &Update,
) -> Result<(), String> {
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns.name, &case.kind);
    let name = case.base["metadata"]["name"].as_str().unwrap().to_owned();
    let created = api
        .create(&PostParams::default(), &dyn_obj(case.base.clone()))
        .await
        .map_err(|e| format!("base refused: {e}"))?;
    if case.status {
        let mut with_status = serde_json::to_value(&created).unwrap();
        with_status["status"] = case.base["status"].clone();
        api.replace_status(&name, &PostParams::default(), &dyn_obj(with_status))
            .await
            .map_err(|e| format!("base status refused: {e}"))?;
    }
    let before = api.get(&name).await.map_err(|e| e.to_string())?;
    let write = |obj: Value| {
        let api = api.clone();
        let name = name.clone();
        let status = case.status;
        async move {
            if status {
                api.replace_status(&name, &PostParams::default(), &dyn_obj(obj))
                    .await
            } else {
                api.replace(&name, &PostParams::default(), &dyn_obj(obj))
                    .await
            }
        }
    };
    let mut bad = serde_json::to_value(&before).unwrap();
    (case.bad)(&mut bad);
    let msg = rejection(write(bad).await)?;
    if !msg.contains(case.expect) {
        return Err(format!("message lacks {:?}: {msg}", case.expect));
    }
    let after = api.get(&name).await.map_err(|e| e.to_string())?;
    if after.metadata.resource_version != before.metadata.resource_version
        || after.data != before.data
    {
        return Err("the rejected write changed the object".into());
    }
    let mut good = serde_json::to_value(&after).unwrap();
    (case.good)(&mut good);
    write(good)
        .await
        .map_err(|e| format!("valid neighbour refused: {e}"))?;
    Ok(())
}

#[tokio::test]
async fn invalid_objects_and_updates_are_rejected_with_clear_messages() {
    let cluster = Cluster::with_crds().await.unwrap();
    let ns = cluster.namespace("validation").await.unwrap();
    let creates = create_cases();
    let updates = update_cases();
    assert!(creates.len() + updates.len() >= 12);

    let mut failures = Vec::new();
    for case in &creates {
        if let Err(e) = run_create(&ns, &cluster.client, case).await {
            failures.push(format!("create, {}: {e}", case.what));
        }
    }
    for case in &updates {
        if let Err(e) = run_update(&ns, &cluster.client, case).await {
            failures.push(format!("update, {}: {e}", case.what));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}\n{}",
        failures.len(),
        creates.len() + updates.len(),
        failures.join("\n"),
        ns.diagnostics()
    );
    ns.cleanup().await.unwrap();
}

/// A writer that skips the resourceVersion precondition still cannot break
/// the invariants: CEL holds them on every write.
#[tokio::test]
async fn blind_writes_cannot_revive_a_final_lease() {
    let cluster = Cluster::with_crds().await.unwrap();
    let ns = cluster.namespace("blind").await.unwrap();
    let api: Api<DynamicObject> =
        Api::namespaced_with(cluster.client.clone(), &ns.name, &ar_lease());
    api.create(
        &PostParams::default(),
        &dyn_obj(lease("blind-1", Some("w1"), "Expired")),
    )
    .await
    .unwrap();
    // A merge patch carries no resourceVersion: the write is unconditional.
    let patch =
        json!({"spec": {"renewTime": "2026-11-29T11:00:00.000000Z"}, "status": {"phase": "Held"}});
    let res = api
        .patch(
            "blind-1",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await;
    let msg = rejection(res).unwrap();
    assert!(msg.contains("is final"), "{msg}");
    let now = api.get("blind-1").await.unwrap();
    assert_eq!(now.data["status"]["phase"], "Expired");
    ns.cleanup().await.unwrap();
}

/// The two rules revocation rests on (issue 39, defect 8), held by the API
/// server for any writer, not only the Rust SDK's filter: a write of a
/// WorkerLease's spec never names an attempt in its `status.revoked`, and
/// an entry leaves `status.revoked` only once `spec.holds` no longer
/// names it. Each refusal leaves the object as it was; the writes the
/// protocol makes right beside them pass.
#[tokio::test]
async fn a_worker_lease_never_renews_a_revoked_attempt_and_no_revocation_is_taken_back() {
    let cluster = Cluster::with_crds().await.unwrap();
    let ns = cluster.namespace("wl-rules").await.unwrap();
    let api: Api<DynamicObject> = Api::namespaced_with(
        cluster.client.clone(),
        &ns.name,
        &ApiResource::erase::<batchlease_api::WorkerLease>(&()),
    );
    let a = json!({"name": "t-a-1", "uid": "00000000-0000-0000-0000-00000000000a"});
    let b = json!({"name": "t-b-1", "uid": "00000000-0000-0000-0000-00000000000b"});
    let c = json!({"name": "t-c-1", "uid": "00000000-0000-0000-0000-00000000000c"});
    let holder = "pod-1/1";
    let name = batchlease_api::worker_lease::worker_lease_name(holder);
    api.create(
        &PostParams::default(),
        &dyn_obj(json!({
            "apiVersion": "batchlease.dev/v1alpha1", "kind": "WorkerLease",
            "metadata": {"name": name},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": 30,
                     "renewTime": "2026-12-07T10:00:00.000000Z", "holds": [a, b]},
        })),
    )
    .await
    .unwrap();
    let get = || {
        let api = api.clone();
        let name = name.clone();
        async move { serde_json::to_value(api.get(&name).await.unwrap()).unwrap() }
    };
    let status = |v: Value| {
        let api = api.clone();
        let name = name.clone();
        async move {
            api.replace_status(&name, &PostParams::default(), &dyn_obj(v))
                .await
        }
    };
    let spec = |v: Value| {
        let api = api.clone();
        let name = name.clone();
        async move {
            api.replace(&name, &PostParams::default(), &dyn_obj(v))
                .await
        }
    };
    let refused = |what: &str, res: Result<DynamicObject, kube::Error>, expect: &str| {
        let msg = rejection(res).unwrap_or_else(|e| panic!("{what}: {e}\n{}", ns.diagnostics()));
        assert!(msg.contains(expect), "{what}: {msg}");
    };

    // The operator revokes a, which the worker lists (a status write).
    let mut w = get().await;
    w["status"] = json!({"revoked": [a]});
    status(w).await.unwrap();

    // A renewal still naming a is refused, a new renewTime or not.
    let before = get().await;
    let mut w = before.clone();
    w["spec"]["renewTime"] = json!("2026-12-07T10:00:10.000000Z");
    refused(
        "a renewal naming the revoked attempt",
        spec(w).await,
        "spec.holds names an attempt in status.revoked",
    );
    let mut w = before.clone();
    w["spec"]["holds"] = json!([b, a, c]);
    refused(
        "a renewal adding beside the revoked attempt",
        spec(w).await,
        "spec.holds names an attempt in status.revoked",
    );
    // Matched by UID: another name does not hide it.
    let mut w = before.clone();
    w["spec"]["holds"] = json!([b, {"name": "t-other", "uid": a["uid"]}]);
    refused(
        "the revoked UID under another name",
        spec(w).await,
        "spec.holds names an attempt in status.revoked",
    );
    // The operator may not take the revocation back while a is listed.
    let mut w = before.clone();
    w["status"] = json!({"revoked": [b]});
    refused(
        "a revocation dropped while listed",
        status(w).await,
        "status.revoked lost an attempt spec.holds still names",
    );
    let mut w = before.clone();
    w.as_object_mut().unwrap().remove("status");
    refused(
        "the whole status dropped while listed",
        status(w).await,
        "status.revoked lost an attempt spec.holds still names",
    );
    let after = get().await;
    assert_eq!(
        after["metadata"]["resourceVersion"], before["metadata"]["resourceVersion"],
        "a refused write changed the object"
    );

    // The protocol's own writes pass: the renewal that leaves a out, a
    // revocation of b beside a, and once nothing lists a, dropping it
    // (WorkerLease::revoke bounds the list so).
    let mut w = after.clone();
    w["spec"]["holds"] = json!([b, c]);
    w["spec"]["renewTime"] = json!("2026-12-07T10:00:20.000000Z");
    spec(w).await.unwrap();
    let mut w = get().await;
    w["status"] = json!({"revoked": [a, b]});
    status(w).await.unwrap();
    let mut w = get().await;
    w["spec"]["holds"] = json!([c]);
    spec(w).await.unwrap();
    let mut w = get().await;
    w["status"] = json!({"revoked": [b]});
    status(w).await.unwrap();
    ns.cleanup().await.unwrap();
}
