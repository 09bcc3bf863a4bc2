//! `spec.ttlSecondsAfterFinished`: the operator deletes a Succeeded or
//! DeadLettered task (and garbage collection its leases) that long after
//! `status.completionTime` — not before, and not much later; a task without
//! it stays; what the worker committed to PostgreSQL stays (it is the
//! user's).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use batchlease_api::{BatchTask, TaskLease, TaskPhase};
use batchlease_e2e::operator::Operator;
use batchlease_e2e::tasks::{self, wait_phase};
use batchlease_e2e::{TestNamespace, pg, wait_for, workers};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams};
use serde_json::json;

const TTL: i64 = 3;

#[tokio::test]
async fn finished_tasks_are_deleted_on_time_with_their_leases() {
    let (ns, op) = Operator::in_new_namespace("ttl", "op", Duration::from_secs(30))
        .await
        .unwrap();
    let db = pg::connect().await.unwrap();
    let worker = workers::start_n(&ns.name, 1, 2).unwrap();
    let quick = json!({"steps": 1, "stepMillis": 10});
    tasks::create(
        &ns,
        "ok",
        json!({"queue": "demo", "ttlSecondsAfterFinished": TTL, "payload": quick}),
    )
    .await
    .unwrap();
    tasks::create(
        &ns,
        "dead",
        json!({"queue": "demo", "ttlSecondsAfterFinished": TTL, "maxRetries": 0,
               "payload": {"steps": 1, "stepMillis": 10, "failureRate": 1.0}}),
    )
    .await
    .unwrap();
    tasks::create(&ns, "kept", json!({"queue": "demo", "payload": quick}))
        .await
        .unwrap();
    let logs = || format!("{}{}", op.logs(), worker[0].logs());
    // Both at once: each is gone TTL seconds after it finishes.
    let (ok, _) = tokio::join!(
        deleted_on_time(&ns, "ok", TaskPhase::Succeeded, &logs),
        deleted_on_time(&ns, "dead", TaskPhase::DeadLettered, &logs),
    );
    // The commit stays: it is the user's data.
    assert!(pg::row(&db, &ok).await.unwrap().is_some(), "ok's row");
    let kept = wait_phase(
        &ns,
        "kept",
        TaskPhase::Succeeded,
        Duration::from_secs(60),
        logs,
    )
    .await
    .unwrap();
    assert!(kept.spec.ttl_seconds_after_finished.is_none());
    assert!(
        ns.api::<BatchTask>()
            .get_opt("kept")
            .await
            .unwrap()
            .is_some()
    );
    ns.cleanup().await.unwrap();
}

/// Waits for task `name` to reach `phase`, then to be deleted — not before
/// `TTL` seconds after its `completionTime`, and within 5 s of it — and
/// its leases collected; returns its UID.
async fn deleted_on_time(
    ns: &TestNamespace,
    name: &str,
    phase: TaskPhase,
    logs: &impl Fn() -> String,
) -> String {
    let tasks: Api<BatchTask> = ns.api();
    let leases: Api<TaskLease> = ns.api();
    let done = wait_phase(ns, name, phase, Duration::from_secs(60), logs)
        .await
        .unwrap();
    let completed = done
        .status
        .unwrap()
        .completion_time
        .expect("completionTime recorded")
        .0;
    let gone_at = wait_for(
        &format!("task {name} deleted"),
        Duration::from_secs(30),
        logs,
        || {
            let tasks = tasks.clone();
            async move { Ok(tasks.get_opt(name).await?.is_none().then(Timestamp::now)) }
        },
    )
    .await
    .unwrap();
    let after = gone_at.duration_since(completed).as_secs_f64();
    assert!(
        // The slack is for a loaded machine (four tests at once, two
        // cores): the operator's requeue is due at the TTL.
        after >= TTL as f64 && after <= TTL as f64 + 5.0,
        "{name} deleted {after:.2} s after completionTime, TTL {TTL} s"
    );
    // Its leases go with it (garbage collection: it owns them).
    wait_for(
        &format!("the leases of {name} collected"),
        Duration::from_secs(30),
        logs,
        || {
            let leases = leases.clone();
            async move {
                let lp = ListParams::default().fields(&format!("spec.taskName={name}"));
                Ok(leases.list(&lp).await?.items.is_empty().then_some(()))
            }
        },
    )
    .await
    .unwrap();
    done.metadata.uid.unwrap()
}

#[tokio::test]
async fn a_finished_task_is_kept_past_its_ttl_while_a_dependent_runs() {
    let (ns, op) = Operator::in_new_namespace("ttl-needed", "op", Duration::from_secs(30))
        .await
        .unwrap();
    let _db = pg::connect().await.unwrap();
    let worker = workers::start_n(&ns.name, 1, 2).unwrap();
    // `dep` is due 1 s after it succeeds; `user` depends on it and runs 8 s.
    tasks::create(
        &ns,
        "dep",
        json!({"queue": "demo", "ttlSecondsAfterFinished": 1, "payload": {"steps": 1, "stepMillis": 10}}),
    )
    .await
    .unwrap();
    tasks::create(
        &ns,
        "user",
        json!({"queue": "demo", "dependsOn": ["dep"], "payload": {"steps": 1, "stepMillis": 8000}}),
    )
    .await
    .unwrap();
    let logs = || format!("{}{}", op.logs(), worker[0].logs());
    let dep = wait_phase(
        &ns,
        "dep",
        TaskPhase::Succeeded,
        Duration::from_secs(60),
        logs,
    )
    .await
    .unwrap();
    let due = dep.status.unwrap().completion_time.unwrap().0
        + k8s_openapi::jiff::SignedDuration::from_secs(3);
    // Past its TTL (with 2 s to spare) while `user` still runs: still there.
    let user = tasks::wait_task(
        &ns,
        "user",
        "running past dep's TTL",
        Duration::from_secs(30),
        logs,
        |t| {
            Timestamp::now() >= due
                && t.status.as_ref().and_then(|s| s.phase) == Some(TaskPhase::Running)
        },
    )
    .await
    .unwrap();
    assert!(user.status.unwrap().completion_time.is_none());
    assert!(
        ns.api::<BatchTask>()
            .get_opt("dep")
            .await
            .unwrap()
            .is_some(),
        "dep was deleted while user, which depends on it, ran"
    );
    // Once `user` is done, `dep` goes (at the next look, within 10 s).
    wait_phase(
        &ns,
        "user",
        TaskPhase::Succeeded,
        Duration::from_secs(60),
        logs,
    )
    .await
    .unwrap();
    let tasks: Api<BatchTask> = ns.api();
    wait_for(
        "dep deleted once nothing needs it",
        Duration::from_secs(30),
        logs,
        || {
            let tasks = tasks.clone();
            async move { Ok(tasks.get_opt("dep").await?.is_none().then_some(())) }
        },
    )
    .await
    .unwrap();
    ns.cleanup().await.unwrap();
}
