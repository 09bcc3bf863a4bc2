//! `spec.retryPolicy.nonRetryableReasons` (design §9): a failure whose
//! reason is listed dead-letters the task at once; another reason retries
//! within `maxRetries`. Real operator and demo worker (its `failureRate: 1`
//! fails every attempt with reason `DemoFlaky`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use batchlease_api::TaskPhase;
use batchlease_e2e::operator::Operator;
use batchlease_e2e::tasks::{self, event_reasons, wait_phase};
use batchlease_e2e::{pg, workers};
use serde_json::json;

#[tokio::test]
async fn a_non_retryable_reason_dead_letters_at_once_another_retries() {
    let (ns, op) = Operator::in_new_namespace("retrypolicy", "op", Duration::from_secs(30))
        .await
        .unwrap();
    let _db = pg::connect().await.unwrap();
    let worker = workers::start_n(&ns.name, 1, 2).unwrap();
    let failing = json!({"steps": 1, "stepMillis": 10, "failureRate": 1.0});
    let fast = json!({"initialSeconds": 1, "maxSeconds": 1});
    tasks::create(
        &ns,
        "listed",
        json!({"queue": "demo", "maxRetries": 5, "backoff": fast, "payload": failing,
               "retryPolicy": {"nonRetryableReasons": ["DemoFlaky"]}}),
    )
    .await
    .unwrap();
    tasks::create(
        &ns,
        "unlisted",
        json!({"queue": "demo", "maxRetries": 1, "backoff": fast, "payload": failing,
               "retryPolicy": {"nonRetryableReasons": ["BadInput"]}}),
    )
    .await
    .unwrap();
    let logs = || format!("{}{}", op.logs(), worker[0].logs());
    let listed = wait_phase(
        &ns,
        "listed",
        TaskPhase::DeadLettered,
        Duration::from_secs(60),
        logs,
    )
    .await
    .unwrap();
    let st = listed.status.unwrap();
    assert_eq!(st.attempts, 1, "dead-lettered at the first failure");
    let cond = st
        .conditions
        .iter()
        .find(|c| c.type_ == "DeadLettered")
        .unwrap();
    assert!(
        cond.message
            .contains("DemoFlaky is in spec.retryPolicy.nonRetryableReasons"),
        "{cond:?}"
    );
    let unlisted = wait_phase(
        &ns,
        "unlisted",
        TaskPhase::DeadLettered,
        Duration::from_secs(60),
        logs,
    )
    .await
    .unwrap();
    assert_eq!(
        unlisted.status.unwrap().attempts,
        2,
        "retried within maxRetries 1"
    );
    assert!(
        event_reasons(&ns, "listed")
            .await
            .unwrap()
            .contains(&"DeadLettered".to_owned())
    );

    // A reason that is not a CamelCase word is refused with the field's path.
    let bad = tasks::create(
        &ns,
        "bad",
        json!({"queue": "demo", "retryPolicy": {"nonRetryableReasons": ["not a reason"]}}),
    )
    .await
    .unwrap_err();
    assert!(
        format!("{bad:#}").contains("spec.retryPolicy.nonRetryableReasons[0]"),
        "{bad:#}"
    );
    ns.finish().await.unwrap();
}
