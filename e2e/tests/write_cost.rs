//! What a task costs the API server (issue 12): a task that runs once and
//! succeeds is its user's create and five protocol writes — the issue
//! (status, with the token), the lease create, the claim, the completion
//! and the settle — counted per task from the API server's audit log, and
//! no Events at the default `--events=important`. A regression guard on
//! the protocol's write count, not a timing: the Running status write is
//! pushed past these tasks' life with `--running-status-delay-ms`, so the
//! count does not depend on the machine's speed.
//!
//! A worker renewing per worker that takes bound attempts saves the claim:
//! its tasks cost their create and four protocol writes (issue 27).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::time::Duration;

use batchlease_api::TaskPhase;
use batchlease_e2e::cluster::TestNamespace;
use batchlease_e2e::operator::Operator;
use batchlease_e2e::process::Process;
use batchlease_e2e::tasks::{self, wait_phase};
use batchlease_e2e::workers::{self, WorkerOpts};
use batchlease_e2e::{Cluster, audit, wait_for};
use k8s_openapi::api::core::v1::Event;
use serde_json::json;

const T: Duration = Duration::from_secs(60);
const TASKS: usize = 10;

#[tokio::test]
async fn a_task_that_succeeds_first_time_costs_five_writes_beyond_its_create() {
    let (_cluster, ns, op, w) = start(
        "writes",
        WorkerOpts {
            slots: 4,
            ..Default::default()
        },
    )
    .await;
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
    let writes = audited(&ns, &op, settled).await;
    for i in 0..TASKS {
        let task = format!("t{i}");
        let mine = writes_of(&writes, &task);
        let expected = counts(&[
            (("batchtasks", "create"), 1),
            // The issue (phase Ready, token 1, the lease's name) and the
            // settle (Succeeded).
            (("batchtasks/status", "update"), 2),
            (("taskleases", "create"), 1),
            // The claim and the completion (the demo worker's renewals
            // come every TTL/3 = 10 s; these tasks end long before).
            (("taskleases", "update"), 2),
        ]);
        assert_eq!(mine, expected, "writes of {task} and its lease");
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

/// A namespace with an operator (only important Events; the Running write
/// pushed past these tasks' life) and one worker `w` started with `opts`.
async fn start(prefix: &str, opts: WorkerOpts) -> (Cluster, TestNamespace, Operator, Process) {
    let cluster = Cluster::with_crds().await.unwrap();
    let ns = cluster.namespace(prefix).await.unwrap();
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
    let w = workers::start(&ns.name, "w", &opts).unwrap();
    (cluster, ns, op, w)
}

/// The namespace's writes from the audit log, once `settled` says every
/// settle is in it (the audit log may show a write a moment after the
/// watch did).
async fn audited(
    ns: &TestNamespace,
    op: &Operator,
    settled: impl Fn(&[audit::Write]) -> bool,
) -> Vec<audit::Write> {
    wait_for(
        "every settle in the audit log",
        T,
        || op.logs(),
        || async {
            let writes = audit::writes_in(&ns.name)?;
            Ok(settled(&writes).then_some(writes))
        },
    )
    .await
    .unwrap()
}

/// `((resource, verb), n)` rows as `writes_of` counts them.
fn counts(rows: &[((&str, &str), usize)]) -> BTreeMap<(String, String), usize> {
    rows.iter()
        .map(|((r, v), n)| (((*r).to_owned(), (*v).to_owned()), *n))
        .collect()
}

/// The writes of `task` and of its first lease, by (resource, verb).
fn writes_of(writes: &[audit::Write], task: &str) -> BTreeMap<(String, String), usize> {
    let lease = batchlease_api::names::lease_name(task, 1);
    let mut mine: BTreeMap<(String, String), usize> = BTreeMap::new();
    for wr in writes
        .iter()
        .filter(|wr| wr.name == task || wr.name == lease)
    {
        *mine
            .entry((wr.resource.clone(), wr.verb.clone()))
            .or_default() += 1;
    }
    mine
}

/// A worker renewing per worker with a free slot gets its tasks bound:
/// the lease is created Held by it (`spec.boundAt`), and the only write
/// of the lease after its create is the completion. Its WorkerLease
/// renewals are shared by every attempt it holds (counted by the fleet
/// bench, not per task).
#[tokio::test]
async fn a_bound_task_costs_four_writes_beyond_its_create() {
    bound_tasks_cost_four_writes("writes-bound", TASKS + 2).await;
}

/// A burst larger than the worker's slots: the tasks it has no slot for
/// wait in the operator (`QueueGate::WorkerSlots`, no lease) and are
/// issued bound as its slots free, instead of as offers it would claim —
/// still four writes each beyond the create. Without the wait, all but
/// two would be offers claimed later (a fifth write each).
#[tokio::test]
async fn a_burst_beyond_the_slots_waits_for_them_and_is_bound_too() {
    bound_tasks_cost_four_writes("writes-burst", 2).await;
}

async fn bound_tasks_cost_four_writes(prefix: &str, slots: usize) {
    let (_cluster, ns, op, w) = start(
        prefix,
        WorkerOpts {
            slots,
            env: vec![("BATCHLEASE_RENEW_PER_WORKER".into(), "1".into())],
            ..Default::default()
        },
    )
    .await;
    let logs = || op.logs_with(&[&w]);
    // A first task through, so the operator has seen the worker's
    // WorkerLease before the measured ones are issued.
    tasks::create(
        &ns,
        "warm",
        json!({"queue": "demo", "payload": {"steps": 0, "stepMillis": 0}}),
    )
    .await
    .unwrap();
    wait_phase(&ns, "warm", TaskPhase::Succeeded, T, logs)
        .await
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
        wait_phase(&ns, &format!("t{i}"), TaskPhase::Succeeded, T, logs)
            .await
            .unwrap();
    }
    let leases = ns.api::<batchlease_api::TaskLease>();
    for i in 0..TASKS {
        let l = leases
            .get(&batchlease_api::names::lease_name(&format!("t{i}"), 1))
            .await
            .unwrap();
        assert!(
            l.bound(),
            "t{i}'s lease was bound: {:?}\n{}",
            l.spec,
            logs()
        );
        assert_eq!(
            l.spec.holder_identity, l.spec.offered_to,
            "bound to its addressee"
        );
    }
    let settled = |writes: &[audit::Write]| {
        (0..TASKS).all(|i| {
            writes_of(writes, &format!("t{i}"))
                .get(&("batchtasks/status".to_owned(), "update".to_owned()))
                .is_some_and(|n| *n >= 2)
        })
    };
    let writes = audited(&ns, &op, settled).await;
    for i in 0..TASKS {
        let task = format!("t{i}");
        let expected = counts(&[
            (("batchtasks", "create"), 1),
            (("batchtasks/status", "update"), 2),
            // Created Held by the worker: no claim.
            (("taskleases", "create"), 1),
            // The completion.
            (("taskleases", "update"), 1),
        ]);
        assert_eq!(
            writes_of(&writes, &task),
            expected,
            "writes of {task} and its lease"
        );
    }
    drop(w);
    drop(op);
    ns.finish().await.unwrap();
}
