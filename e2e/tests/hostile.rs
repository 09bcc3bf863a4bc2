//! One tenant's bad data or bad worker hurts nobody else (issue 8): deep and
//! oversized JSON, tampered lease metadata, a handler that never yields.
//! Real control plane, operator, demo workers and PostgreSQL.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use batchlease_api::{BatchTask, JsonObject, LeaseOutcome, LeasePhase, TaskLease, TaskPhase};
use batchlease_e2e::operator::Operator;
use batchlease_e2e::tasks::{self, wait_lease, wait_phase};
use batchlease_e2e::workers::{self, WorkerOpts};
use batchlease_e2e::{TestNamespace, wait_for, worker};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;

const T: Duration = Duration::from_secs(60);

/// Deep enough to break every decoder with serde_json's default limit (128)
/// many times over, and as deep as the API server still serves back: at
/// 9,996 levels of payload it stores an object it cannot decode (see
/// docs/api.md, "Deep JSON").
const DEEP: usize = 9_990;

/// `{"n":{"n":…{}…}}`, `levels` objects deep, as text (a `Value` this deep
/// would overflow the stack when dropped).
fn nested(levels: usize) -> JsonObject {
    let mut s = String::with_capacity(levels * 6);
    for _ in 1..levels {
        s.push_str("{\"n\":");
    }
    s.push_str("{}");
    for _ in 1..levels {
        s.push('}');
    }
    JsonObject::from_text(s).unwrap()
}

async fn setup(prefix: &str) -> (TestNamespace, Operator) {
    Operator::in_new_namespace(prefix, "op", T).await.unwrap()
}

/// Waits for an Event with `reason` about `object` (Events follow the
/// status write they report).
async fn wait_event(ns: &TestNamespace, object: &str, reason: &str, op: &Operator) {
    wait_for(
        &format!("event {reason} on {object}"),
        T,
        || format!("{}\n{}", ns.diagnostics(), op.logs()),
        || async move {
            let reasons = tasks::event_reasons(ns, object).await?;
            Ok(reasons.iter().any(|r| r == reason).then_some(()))
        },
    )
    .await
    .unwrap();
}

fn quick(steps: u64) -> serde_json::Value {
    json!({"queue": "demo", "payload": {"steps": steps, "stepMillis": 20}})
}

/// The reproduced outage: with a deeply nested payload, checkpoint or
/// result anywhere in the namespace, the operator's list (after a restart)
/// and the workers' lease lists failed to decode — nobody's task ran.
#[tokio::test]
async fn deep_json_in_one_task_stops_nobody() {
    let (ns, mut op) = setup("deep").await;
    let tasks_api: Api<BatchTask> = ns.api();
    let leases: Api<TaskLease> = ns.api();

    // A hostile worker (raw API writes, no SDK) holds a task and renews it
    // with a 9,990-level checkpoint before any demo worker starts, so the
    // workers' first lease list contains it.
    tasks::create(
        &ns,
        "raw",
        json!({"queue": "demo", "leaseDurationSeconds": 60}),
    )
    .await
    .unwrap();
    let offered = wait_lease(&ns, "raw-1", LeasePhase::Offered, T, || op.logs())
        .await
        .unwrap();
    let held = worker::claim(&leases, &offered, "hostile").await.unwrap();
    let mut l = held.clone();
    l.spec.renew_time = Some(MicroTime(Timestamp::now()));
    l.status.as_mut().unwrap().checkpoint = Some(nested(DEEP));
    let held = leases
        .replace("raw-1", &PostParams::default(), &l)
        .await
        .unwrap();

    // A user's task with a 9,990-level payload.
    let mut deep_payload = BatchTask::new("deep-payload", {
        let mut s = batchlease_api::BatchTaskSpec::for_queue("demo");
        s.payload = Some(nested(DEEP));
        s
    });
    deep_payload.metadata.namespace = Some(ns.name.clone());
    tasks_api
        .create(&PostParams::default(), &deep_payload)
        .await
        .unwrap();

    let w = workers::start(&ns.name, "w", &WorkerOpts::default()).unwrap();
    for i in 0..3 {
        tasks::create(&ns, &format!("ok-{i}"), quick(2))
            .await
            .unwrap();
    }
    // A handler that tries to record a checkpoint deeper than the SDK's
    // limit gets a typed, permanent error of its own.
    tasks::create(
        &ns,
        "deep-handler",
        json!({"queue": "demo", "payload": {"steps": 1, "stepMillis": 1, "deepLevels": 2000}}),
    )
    .await
    .unwrap();

    // The hostile worker completes with a 9,990-level result.
    let mut done = held.clone();
    let st = done.status.as_mut().unwrap();
    st.phase = Some(LeasePhase::Completed);
    st.outcome = Some(LeaseOutcome::Succeeded);
    st.result = Some(nested(DEEP));
    leases
        .replace("raw-1", &PostParams::default(), &done)
        .await
        .unwrap();

    for i in 0..3 {
        wait_phase(&ns, &format!("ok-{i}"), TaskPhase::Succeeded, T, || {
            op.logs_with(&[&w])
        })
        .await
        .unwrap();
    }
    let raw = wait_phase(&ns, "raw", TaskPhase::Succeeded, T, || op.logs_with(&[&w]))
        .await
        .unwrap();
    let st = raw.status.unwrap();
    assert_eq!(st.result.as_ref().map(JsonObject::depth), Some(DEEP));
    assert_eq!(st.checkpoint.as_ref().map(JsonObject::depth), Some(DEEP));
    // The deep payload harms nobody, not even its own task: the demo's
    // payload type skips unknown fields without recursion. (A handler that
    // decodes all of it gets a typed InvalidPayload error; unit-tested.)
    wait_phase(&ns, "deep-payload", TaskPhase::Succeeded, T, || {
        op.logs_with(&[&w])
    })
    .await
    .unwrap();
    let dh = wait_phase(&ns, "deep-handler", TaskPhase::DeadLettered, T, || {
        op.logs_with(&[&w])
    })
    .await
    .unwrap();
    let failure = dh.status.unwrap().last_failure.unwrap();
    assert_eq!(failure.reason, "CheckpointTooDeep", "{failure:?}");

    // A fresh operator and a fresh worker list everything, deep objects
    // included, and go on working.
    op.restart().unwrap();
    op.wait_leading(T).await.unwrap();
    drop(w);
    let w2 = workers::start(&ns.name, "w2", &WorkerOpts::default()).unwrap();
    for i in 3..6 {
        tasks::create(&ns, &format!("ok-{i}"), quick(1))
            .await
            .unwrap();
    }
    for i in 3..6 {
        wait_phase(&ns, &format!("ok-{i}"), TaskPhase::Succeeded, T, || {
            op.logs_with(&[&w2])
        })
        .await
        .unwrap();
    }
    assert!(
        !op.logs().contains("recursion limit"),
        "the operator failed to decode something:\n{}",
        op.logs()
    );
    ns.finish().await.unwrap();
}

/// Handlers that compute for 2·TTL without awaiting, one per slot and as
/// many as the worker's runtime has threads: their leases stay renewed (the
/// heartbeat has its own runtime), so the tasks are not taken away from a
/// worker that is still running them. On a shared runtime every thread is
/// blocked and no renewal is sent.
#[tokio::test]
async fn cpu_bound_handlers_keep_their_leases() {
    let (ns, op) = setup("spin").await;
    // The demo worker's runtime has one thread per core.
    let n = std::thread::available_parallelism().map_or(2, |n| n.get().max(2));
    let w = workers::start(
        &ns.name,
        "w",
        &WorkerOpts {
            slots: n,
            ..Default::default()
        },
    )
    .unwrap();
    for i in 0..n {
        tasks::create(
            &ns,
            &format!("spin-{i}"),
            // TTL 8 s, 16 s of compute: 2·TTL as before, with room for the
            // heartbeat thread on a CI machine whose two cores these
            // handlers and the rest of the suite saturate (with TTL 5 s a
            // renewal starved for 5 s once in CI: 11:27:08–13, 2026-12-01).
            json!({"queue": "demo", "leaseDurationSeconds": 8,
                   "payload": {"steps": 1, "stepMillis": 1, "spinMillis": 16_000}}),
        )
        .await
        .unwrap();
    }
    for i in 0..n {
        let done = wait_phase(&ns, &format!("spin-{i}"), TaskPhase::Succeeded, T, || {
            op.logs_with(&[&w])
        })
        .await
        .unwrap();
        let st = done.status.unwrap();
        assert_eq!(
            (st.fencing_token, st.attempts, st.history.len()),
            (1, 0, 1),
            "spin-{i}: one attempt, never expired: {:?}",
            st.history
        );
        assert_eq!(st.history[0].outcome, "Succeeded");
    }
    ns.finish().await.unwrap();
}

/// A result the SDK refuses is a permanent failure with a typed reason, at
/// once; a result written without the SDK that would not fit the task is
/// left out with an Event, and the task still settles.
#[tokio::test]
async fn oversized_results_settle_with_a_clear_reason() {
    let (ns, op) = setup("big").await;
    let leases: Api<TaskLease> = ns.api();
    // 1 MB of payload: a 600 kB result would make the task exceed etcd's
    // object limit, and the settle write failed forever.
    let filler = "p".repeat(1_000_000);
    tasks::create(
        &ns,
        "raw",
        json!({"queue": "raw", "payload": {"filler": filler}}),
    )
    .await
    .unwrap();
    let offered = wait_lease(&ns, "raw-1", LeasePhase::Offered, T, || op.logs())
        .await
        .unwrap();
    let mut done = worker::claim(&leases, &offered, "hostile").await.unwrap();
    let st = done.status.as_mut().unwrap();
    st.phase = Some(LeasePhase::Completed);
    st.outcome = Some(LeaseOutcome::Succeeded);
    st.result = Some(JsonObject::try_from(json!({"blob": "r".repeat(600_000)})).unwrap());
    leases
        .replace("raw-1", &PostParams::default(), &done)
        .await
        .unwrap();
    let raw = wait_phase(&ns, "raw", TaskPhase::Succeeded, T, || op.logs())
        .await
        .unwrap();
    assert_eq!(raw.status.unwrap().result, None, "left out");
    wait_event(&ns, "raw", "ResultTooLarge", &op).await;

    let w = workers::start(&ns.name, "w", &WorkerOpts::default()).unwrap();
    tasks::create(
        &ns,
        "sdk",
        json!({"queue": "demo", "payload": {"steps": 1, "stepMillis": 1, "resultBytes": 200_000}}),
    )
    .await
    .unwrap();
    let sdk = wait_phase(&ns, "sdk", TaskPhase::DeadLettered, T, || {
        op.logs_with(&[&w])
    })
    .await
    .unwrap();
    let st = sdk.status.unwrap();
    let failure = st.last_failure.unwrap();
    assert_eq!(
        (failure.reason.as_str(), st.attempts),
        ("ResultTooLarge", 1),
        "permanent at the first attempt: {failure:?}"
    );
    ns.finish().await.unwrap();
}

/// Labels and owner references are plain metadata anyone who may update a
/// lease can change: the operator puts them back, so the offer becomes
/// visible to workers again and the lease is still collected with its task.
#[tokio::test]
async fn tampered_lease_metadata_is_restored() {
    let (ns, op) = setup("tamper").await;
    let leases: Api<TaskLease> = ns.api();
    tasks::create(&ns, "job", quick(1)).await.unwrap();
    wait_lease(&ns, "job-1", LeasePhase::Offered, T, || op.logs())
        .await
        .unwrap();
    // Hide the offer from the queue's workers and cut it from its task.
    leases
        .patch(
            "job-1",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {
                "labels": {"batchlease.dev/queue": "elsewhere"},
                "ownerReferences": null,
            }})),
        )
        .await
        .unwrap();
    let repaired = wait_for(
        "lease job-1 repaired",
        T,
        || format!("{}\n{}", ns.diagnostics(), op.logs()),
        || {
            let leases = leases.clone();
            async move {
                let l = leases.get("job-1").await?;
                let ok = l.labels().get("batchlease.dev/queue").map(String::as_str) == Some("demo")
                    && l.owner_references()
                        .iter()
                        .any(|r| r.controller == Some(true));
                Ok(ok.then_some(l))
            }
        },
    )
    .await
    .unwrap();
    assert_eq!(repaired.owner_references()[0].kind, "BatchTask");
    let w = workers::start(&ns.name, "w", &WorkerOpts::default()).unwrap();
    let done = wait_phase(&ns, "job", TaskPhase::Succeeded, T, || op.logs_with(&[&w]))
        .await
        .unwrap();
    assert_eq!(done.status.unwrap().fencing_token, 1, "the same lease ran");
    wait_event(&ns, "job", "LeaseRepaired", &op).await;
    ns.finish().await.unwrap();
}

/// A lease write the API server refuses although the lease is still ours
/// (here: an admission policy refusing a checkpoint or a result) ends the
/// attempt at once with the refusal as its reason — before, a refused
/// renewal looped PUT+GET until the kill switch and was recorded as an
/// interruption, and a refused completion looked like an expiry.
#[tokio::test]
async fn writes_the_api_server_refuses_end_the_attempt_with_that_reason() {
    let (ns, op) = setup("refused").await;
    let policy = format!("refuse-poison-{}", ns.name);
    let manifest = format!(
        r#"apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingAdmissionPolicy
metadata:
  name: {policy}
spec:
  failurePolicy: Fail
  matchConstraints:
    namespaceSelector:
      matchLabels:
        kubernetes.io/metadata.name: {ns}
    resourceRules:
    - apiGroups: [batchlease.dev]
      apiVersions: [v1alpha1]
      operations: [UPDATE]
      resources: [taskleases]
  validations:
  - expression: "!has(object.status) || !has(object.status.checkpoint) || !has(object.status.checkpoint.tag) || object.status.checkpoint.tag != 'poison'"
    reason: Invalid
    message: this checkpoint is refused
  - expression: "!has(object.status) || !has(object.status.result) || !has(object.status.result.tag) || object.status.result.tag != 'poison-result'"
    reason: Invalid
    message: this result is refused
---
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingAdmissionPolicyBinding
metadata:
  name: {policy}
spec:
  policyName: {policy}
  validationActions: [Deny]
"#,
        ns = ns.name
    );
    let dir = batchlease_e2e::secrets::PrivateDir::new(&ns.name).unwrap();
    let path = dir.write("policy.yaml", &manifest).unwrap();
    batchlease_e2e::kubectl::ok(&["apply", "-f", &path.to_string_lossy()]).unwrap();
    // The policy is in force once a write it refuses is refused.
    let leases: Api<TaskLease> = ns.api();
    let probe: TaskLease = serde_json::from_value(json!({
        "apiVersion": "batchlease.dev/v1alpha1", "kind": "TaskLease",
        "metadata": {"name": "probe"},
        "spec": {"taskName": "probe", "taskUID": "probe", "queue": "none",
                 "fencingToken": 1, "leaseDurationSeconds": 30},
        "status": {"phase": "Offered"}
    }))
    .unwrap();
    leases.create(&PostParams::default(), &probe).await.unwrap();
    wait_for(
        "the admission policy to refuse",
        T,
        || ns.diagnostics(),
        || {
            let leases = leases.clone();
            async move {
                let mut p = leases.get("probe").await?;
                p.status.as_mut().unwrap().checkpoint =
                    Some(JsonObject::try_from(json!({"tag": "poison"}))?);
                Ok(
                    match leases.replace("probe", &PostParams::default(), &p).await {
                        Err(kube::Error::Api(s)) if s.code == 422 => Some(()),
                        _ => None,
                    },
                )
            }
        },
    )
    .await
    .unwrap();

    let w = workers::start(&ns.name, "w", &WorkerOpts::default()).unwrap();
    // Renewals carry the refused checkpoint (first renewal at 2 s, the
    // handler runs 4 s).
    tasks::create(
        &ns,
        "cp",
        json!({"queue": "demo", "leaseDurationSeconds": 6, "maxRetries": 0,
               "payload": {"steps": 4, "stepMillis": 1000, "tag": "poison"}}),
    )
    .await
    .unwrap();
    // The completion carries the refused result.
    tasks::create(
        &ns,
        "result",
        json!({"queue": "demo", "maxRetries": 0,
               "payload": {"steps": 1, "stepMillis": 10, "tag": "poison-result"}}),
    )
    .await
    .unwrap();
    for (task, reason) in [("cp", "LeaseWriteRefused"), ("result", "CompletionRefused")] {
        let t = wait_phase(&ns, task, TaskPhase::DeadLettered, T, || {
            op.logs_with(&[&w])
        })
        .await
        .unwrap();
        let st = t.status.unwrap();
        let failure = st.last_failure.unwrap();
        assert_eq!(
            (failure.reason.as_str(), st.fencing_token),
            (reason, 1),
            "{task}: one attempt, ended with the refusal: {failure:?}"
        );
    }
    let result = tasks::status(&ns, "result")
        .await
        .unwrap()
        .last_failure
        .unwrap();
    assert!(
        result.message.contains("this result is refused"),
        "{result:?}"
    );
    batchlease_e2e::kubectl::ok(&[
        "delete",
        "validatingadmissionpolicybinding,validatingadmissionpolicy",
        &policy,
    ])
    .unwrap();
    ns.finish().await.unwrap();
}
