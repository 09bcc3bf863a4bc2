//! What a task costs the API server (issue 12): a task that runs once and
//! succeeds is its user's create and five protocol writes — the issue
//! (status, with the token), the lease create, the claim, the completion
//! and the settle — counted per task from the API server's audit log, and
//! no Events at the default `--events=important`. A regression guard on
//! the protocol's write count, not a timing: the Running status write is
//! pushed past these tasks' life with `--running-status-delay-ms`, so the
//! count does not depend on the machine's speed.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::time::Duration;

use batchlease_api::TaskPhase;
use batchlease_e2e::operator::Operator;
use batchlease_e2e::tasks::{self, wait_phase};
use batchlease_e2e::workers::{self, WorkerOpts};
use batchlease_e2e::{Cluster, audit, wait_for};
use k8s_openapi::api::core::v1::Event;
use serde_json::json;

const T: Duration = Duration::from_secs(60);
const TASKS: usize = 10;

#[tokio::test]
async fn a_task_that_succeeds_first_time_costs_five_writes_beyond_its_create() {
    let cluster = Cluster::with_crds().await.unwrap();
    let ns = cluster.namespace("writes").await.unwrap();
    let op = Operator::start_with(
        &ns.name,
        "op",
        vec![
            "--events=important".into(),
            "--running-status-delay-ms=60000".into(),
        ],
    )
    .unwrap();
    op.wait_leading(T).await.unwrap();
    let w = workers::start(
        &ns.name,
        "w",
        &WorkerOpts {
            slots: 4,
            ..Default::default()
        },
    )
    .unwrap();
    for i in 0..TASKS {
        tasks::create(
            &ns,
            &format!("t{i}"),
            json!({"queue": "demo", "payload": {"steps": 0, "stepMillis": 0}}),
        )
        .await
        .unwrap();
    }
    for i in 0..TASKS {
        wait_phase(&ns, &format!("t{i}"), TaskPhase::Succeeded, T, || {
            op.logs_with(&[&w])
        })
        .await
        .unwrap();
    }
    // The settle is each task's last write; the audit log may show it a
    // moment after the watch did.
    let settled = |writes: &[audit::Write]| {
        writes
            .iter()
            .filter(|w| w.resource == "batchtasks/status")
            .count()
            >= 2 * TASKS
    };
    let writes = wait_for(
        "every settle in the audit log",
        T,
        || op.logs(),
        || async {
            let writes = audit::writes_in(&ns.name)?;
            Ok(settled(&writes).then_some(writes))
        },
    )
    .await
    .unwrap();
    for i in 0..TASKS {
        let task = format!("t{i}");
        let lease = batchlease_api::names::lease_name(&task, 1);
        let mut mine: BTreeMap<(String, String), usize> = BTreeMap::new();
        for wr in writes
            .iter()
            .filter(|wr| wr.name == task || wr.name == lease)
        {
            *mine
                .entry((wr.resource.clone(), wr.verb.clone()))
                .or_default() += 1;
        }
        let expected: BTreeMap<(String, String), usize> = [
            (("batchtasks", "create"), 1),
            // The issue (phase Ready, token 1, the lease's name) and the
            // settle (Succeeded).
            (("batchtasks/status", "update"), 2),
            (("taskleases", "create"), 1),
            // The claim and the completion (the demo worker's renewals
            // come every TTL/3 = 10 s; these tasks end long before).
            (("taskleases", "update"), 2),
        ]
        .into_iter()
        .map(|((r, v), n)| ((r.to_owned(), v.to_owned()), n))
        .collect();
        assert_eq!(mine, expected, "writes of {task} and {lease}");
    }
    // Events are not in the audit policy: listed instead.
    let events = ns.api::<Event>().list(&Default::default()).await.unwrap();
    let reasons: Vec<_> = events
        .items
        .iter()
        .filter(|e| e.involved_object.kind.as_deref() == Some("BatchTask"))
        .map(|e| e.reason.clone())
        .collect();
    assert!(
        reasons.is_empty(),
        "no Events for tasks that just succeed: {reasons:?}"
    );
    drop(w);
    drop(op);
    ns.finish().await.unwrap();
}
