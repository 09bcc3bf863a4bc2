//! `TaskQueue.status`, the queue's slots and its metrics against the real
//! API server (issue 22): a field that went away is cleared on the server,
//! an idle queue costs no writes (counted from the audit log), the workers
//! of a queue are counted (also while they hold nothing), an issue whose
//! status write failed with an unknown outcome (a 5xx) does not keep its
//! slot, and per-queue metrics are per tenant, a gone queue's series gone.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use batchlease_api::{BatchTask, TaskPhase, TaskQueue, TaskQueueStatus};
use batchlease_e2e::cluster::TestNamespace;
use batchlease_e2e::operator::Operator;
use batchlease_e2e::tasks::{self, wait_phase};
use batchlease_e2e::wait::wait_for;
use batchlease_e2e::{audit, workers};
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;

/// The operator's status period (`queue_status::PERIOD`).
const PERIOD: f64 = 3.0;

async fn create_queue(ns: &TestNamespace, name: &str, spec: serde_json::Value) {
    tasks::create_queue(ns, name, spec).await.unwrap();
}

async fn queue_status(ns: &TestNamespace, name: &str) -> anyhow::Result<TaskQueueStatus> {
    Ok(ns
        .api::<TaskQueue>()
        .get(name)
        .await?
        .status
        .unwrap_or_default())
}

/// The times (server clock, seconds) of replica `op`'s TaskQueue status
/// writes in `ns`, from the audit log.
fn status_writes(ns: &str, op: &str) -> anyhow::Result<Vec<f64>> {
    let user = Operator::user(op);
    Ok(audit::writes_in(ns)?
        .into_iter()
        .filter(|w| w.user == user && w.resource == "taskqueues/status")
        .map(|w| w.at)
        .collect())
}

fn now_secs() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

#[tokio::test]
async fn a_cleared_field_is_cleared_on_the_server_and_an_idle_queue_writes_nothing() {
    let (ns, op) = Operator::in_new_namespace("queue-idle", "op", Duration::from_secs(30))
        .await
        .unwrap();
    create_queue(&ns, "demo", json!({})).await;
    // A short TTL: the worker stops counting a TTL after its last lease.
    tasks::create(
        &ns,
        "t",
        json!({"queue": "demo", "leaseDurationSeconds": 5,
               "payload": {"steps": 8, "stepMillis": 1000}}),
    )
    .await
    .unwrap();
    // No worker yet: the task waits Ready, and the status says since when.
    let st = wait_for(
        "status.oldestReadySince",
        Duration::from_secs(30),
        || op.logs(),
        || async {
            let st = queue_status(&ns, "demo").await?;
            Ok(st.oldest_ready_since.is_some().then_some(st))
        },
    )
    .await
    .unwrap();
    eprintln!("waiting: {st:?}");
    let worker = workers::start_n(&ns.name, 1, 1).unwrap();
    let logs = || op.logs_with(&worker.iter().collect::<Vec<_>>());
    // While the worker holds the lease, the queue counts it (issue 22,
    // point 10: WORKERS read 0).
    let st = wait_for(
        "status.workers = 1 while the lease is held",
        Duration::from_secs(30),
        logs,
        || async {
            let st = queue_status(&ns, "demo").await?;
            Ok((st.leases_held == 1 && st.workers == 1).then_some(st))
        },
    )
    .await
    .unwrap();
    eprintln!("running: {st:?}");
    wait_phase(
        &ns,
        "t",
        TaskPhase::Succeeded,
        Duration::from_secs(60),
        logs,
    )
    .await
    .unwrap();
    // Nothing is Ready any more: the field is gone from the server's copy
    // (a merge patch that skips it would leave it there for ever).
    let st = wait_for(
        "status.oldestReadySince cleared on the server",
        Duration::from_secs(30),
        logs,
        || async {
            let st = queue_status(&ns, "demo").await?;
            Ok((st.tasks.succeeded == 1 && st.oldest_ready_since.is_none()).then_some(st))
        },
    )
    .await
    .unwrap();
    eprintln!("done: {st:?}");
    // Idle now: no status write for four status periods, by the server's
    // record (the worker's lease stops counting a TTL after its end; its
    // presence record keeps it counted).
    let quiet = 4.0 * PERIOD;
    let writes = wait_for(
        "four status periods without a TaskQueue status write",
        Duration::from_secs(60),
        || {
            let w = status_writes(&ns.name, "op").unwrap_or_default();
            let tail: Vec<String> = w
                .iter()
                .rev()
                .take(10)
                .map(|t| format!("{:.1} s ago", now_secs() - t))
                .collect();
            format!("{} status writes, the last: {tail:?}\n{}", w.len(), logs())
        },
        || async {
            let w = status_writes(&ns.name, "op")?;
            let last = w.iter().copied().fold(f64::MIN, f64::max);
            Ok((now_secs() - last >= quiet).then_some(w))
        },
    )
    .await
    .unwrap();
    let st = queue_status(&ns, "demo").await.unwrap();
    eprintln!("{} status writes in all; idle status: {st:?}", writes.len());
    // The worker holds nothing and still serves the queue (issue 22, point
    // 10: WORKERS read 0 then).
    assert_eq!((st.leases_held, st.workers), (0, 1), "{st:?}");
    // A worker that stops (drains) is no worker of the queue any more.
    worker[0].signal("TERM").unwrap();
    wait_for(
        "status.workers = 0 once the worker stopped",
        Duration::from_secs(20),
        logs,
        || async {
            let st = queue_status(&ns, "demo").await?;
            Ok((st.workers == 0).then_some(()))
        },
    )
    .await
    .unwrap();
    ns.finish().await.unwrap();
}

/// A webhook nobody serves, for the status writes of the tasks labelled
/// `fail-status=yes` in `ns`: the API server answers those writes 500
/// ("failed calling webhook") without applying them — to the operator an
/// answer that says nothing about the outcome, like a lost one.
fn failing_webhook(ns: &str) -> ValidatingWebhookConfiguration {
    serde_json::from_value(json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": format!("batchlease-e2e-{ns}")},
        "webhooks": [{
            "name": "fail-status.batchlease-e2e.dev",
            "clientConfig": {"url": "https://127.0.0.1:1/nobody"},
            "rules": [{
                "apiGroups": ["batchlease.dev"], "apiVersions": ["*"],
                "operations": ["UPDATE"], "resources": ["batchtasks/status"],
                "scope": "Namespaced",
            }],
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
            "objectSelector": {"matchLabels": {"fail-status": "yes"}},
            "failurePolicy": "Fail",
            "sideEffects": "None",
            "admissionReviewVersions": ["v1"],
            "timeoutSeconds": 1,
        }],
    }))
    .unwrap()
}

#[tokio::test]
async fn an_issue_whose_status_write_got_a_5xx_does_not_keep_its_queue_slot() {
    let cluster = batchlease_e2e::Cluster::with_crds().await.unwrap();
    let ns = cluster.namespace("queue-lost").await.unwrap();
    let op = Operator::start(&ns.name, "op").unwrap();
    op.wait_leading(Duration::from_secs(30)).await.unwrap();
    create_queue(&ns, "demo", json!({"maxConcurrent": 1})).await;
    let hooks: Api<ValidatingWebhookConfiguration> = Api::all(cluster.client.clone());
    let hook = failing_webhook(&ns.name);
    let hook_name = kube::ResourceExt::name_any(&hook);
    hooks.create(&PostParams::default(), &hook).await.unwrap();
    // The first write of a new task is its issue (status with the token,
    // then the lease create): it takes the queue's only slot, and its
    // status write gets the 500.
    let t: BatchTask = serde_json::from_value(json!({
        "apiVersion": "batchlease.dev/v1alpha1", "kind": "BatchTask",
        "metadata": {"name": "a", "labels": {"fail-status": "yes"}},
        "spec": {"queue": "demo", "payload": {"steps": 1, "stepMillis": 10}},
    }))
    .unwrap();
    ns.api::<BatchTask>()
        .create(&PostParams::default(), &t)
        .await
        .unwrap();
    wait_for(
        "the operator's issue refused with 500 by the webhook",
        Duration::from_secs(30),
        || op.logs(),
        || async { Ok(op.logs().contains("failed calling webhook").then_some(())) },
    )
    .await
    .unwrap();
    // The write was never applied, so no lease of that issue can appear:
    // once the server accepts writes again, both tasks run, one at a time.
    hooks
        .delete(&hook_name, &DeleteParams::default())
        .await
        .unwrap();
    tasks::create(
        &ns,
        "b",
        json!({"queue": "demo", "payload": {"steps": 1, "stepMillis": 10}}),
    )
    .await
    .unwrap();
    let worker = workers::start_n(&ns.name, 1, 1).unwrap();
    let logs = || op.logs_with(&worker.iter().collect::<Vec<_>>());
    // Well within the 5 minutes a reservation the watch never confirmed
    // was kept: the slot is free again at once.
    for name in ["a", "b"] {
        wait_phase(
            &ns,
            name,
            TaskPhase::Succeeded,
            Duration::from_secs(45),
            logs,
        )
        .await
        .unwrap();
    }
    ns.finish().await.unwrap();
}

#[tokio::test]
async fn tenants_queues_of_one_name_have_their_own_series_and_a_gone_queues_go() {
    let cluster = batchlease_e2e::Cluster::with_crds().await.unwrap();
    let a = cluster.namespace("queue-ten-a").await.unwrap();
    let b = cluster.namespace("queue-ten-b").await.unwrap();
    let op = Operator::start_with(
        &a.name,
        "op",
        vec![format!("--namespaces={},{}", a.name, b.name)],
    )
    .unwrap();
    op.wait_leading(Duration::from_secs(30)).await.unwrap();
    // Both tenants name their queue "demo": one task in a's, two in b's.
    for (ns, names) in [(&a, &["x"][..]), (&b, &["x", "y"][..])] {
        for name in names {
            tasks::create(ns, name, json!({"queue": "demo"}))
                .await
                .unwrap();
        }
    }
    let issued =
        |ns: &str| format!("batchlease_leases_issued_total{{namespace=\"{ns}\",queue=\"demo\"}}");
    let counts = wait_for(
        "a series per tenant",
        Duration::from_secs(30),
        || op.logs(),
        || async {
            let ca = op.metric(&issued(&a.name)).await?;
            let cb = op.metric(&issued(&b.name)).await?;
            Ok((ca == Some(1.0) && cb == Some(2.0)).then_some((ca, cb)))
        },
    )
    .await
    .unwrap();
    eprintln!("leases issued (a, b): {counts:?}");
    // Tenant b's queue goes (its tasks are deleted): its series go too,
    // a's stay.
    for name in ["x", "y"] {
        b.api::<BatchTask>()
            .delete(name, &DeleteParams::default())
            .await
            .unwrap();
    }
    wait_for(
        "b's series removed",
        Duration::from_secs(45),
        || op.logs(),
        || async {
            let (_, body) = op.get("/metrics").await?;
            Ok((!body.contains(&format!("namespace=\"{}\"", b.name))).then_some(()))
        },
    )
    .await
    .unwrap();
    assert_eq!(op.metric(&issued(&a.name)).await.unwrap(), Some(1.0));
    b.cleanup().await.unwrap();
    a.cleanup().await.unwrap();
}
