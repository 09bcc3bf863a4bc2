//! Workers whose wall clock disagrees with the database's (and the API
//! server's), run under libfaketime: the fenced store's deadline is put on
//! the database's clock, so a worker 10 s or 10 min behind, or 10 min
//! ahead, registers and commits like any other. A worker behind used to
//! have every registration refused ("deadline_passed_at_storage") about
//! 20 ms after its claim, and — failing that fast — win most claims and
//! dead-letter its queue.
//!
//! And a worker whose storage refuses its registrations anyway stops
//! claiming for a while (log, metrics), and the attempts it gave back spend
//! no retry.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use batchlease_api::{BatchTask, TaskLease, TaskPhase};
use batchlease_e2e::operator::Operator;
use batchlease_e2e::process::Process;
use batchlease_e2e::tasks::{self, wait_phase};
use batchlease_e2e::workers::{self, WorkerOpts, faketime_env};
use batchlease_e2e::{Cluster, TestNamespace, pg, ports, wait_for};
use kube::ResourceExt;
use kube::api::{Api, ListParams};
use serde_json::json;

const T: Duration = Duration::from_secs(90);

async fn setup(prefix: &str) -> (TestNamespace, Operator) {
    let cluster = Cluster::with_crds().await.unwrap();
    let ns = cluster.namespace(prefix).await.unwrap();
    let op = Operator::start(&ns.name, "op").unwrap();
    op.wait_leading(T).await.unwrap();
    (ns, op)
}

/// (queue, libfaketime offset, the offset in seconds)
const SKEWS: [(&str, &str, i64); 3] = [
    ("behind10m", "-10m", -600),
    ("behind10s", "-10s", -10),
    ("ahead10m", "+10m", 600),
];

#[tokio::test]
async fn workers_minutes_behind_or_ahead_of_the_database_run_their_tasks_first_time() {
    let (ns, op) = setup("skew").await;
    let db = pg::connect().await.unwrap();
    let mut fleet: Vec<Process> = Vec::new();
    for (queue, offset, _) in SKEWS {
        let opts = WorkerOpts {
            queue: queue.into(),
            slots: 1,
            env: faketime_env(offset).unwrap(),
            ..Default::default()
        };
        fleet.push(workers::start(&ns.name, queue, &opts).unwrap());
        // The recipe: a 6 s TTL and 2 s of work in four steps.
        tasks::create(
            &ns,
            queue,
            json!({"queue": queue, "leaseDurationSeconds": 6,
                   "payload": {"steps": 4, "stepMillis": 500}}),
        )
        .await
        .unwrap();
    }
    let refs: Vec<&Process> = fleet.iter().collect();
    let leases: Api<TaskLease> = ns.api();
    for (queue, offset, seconds) in SKEWS {
        let t = wait_phase(&ns, queue, TaskPhase::Succeeded, T, || op.logs_with(&refs))
            .await
            .unwrap();
        let st = t.status.clone().unwrap();
        // The first attempt ran to the end: no refused registration, no
        // retry.
        let outcomes: Vec<_> = st
            .history
            .iter()
            .map(|h| (h.token, h.outcome.as_str()))
            .collect();
        assert_eq!(
            outcomes,
            vec![(1, "Succeeded")],
            "{queue}: one attempt, succeeded\n{}",
            op.logs_with(&refs)
        );
        let (token, row) = pg::row(&db, &t.uid().unwrap())
            .await
            .unwrap()
            .expect("committed");
        assert_eq!(token, 1, "{queue}: committed under token 1: {row}");
        assert_eq!(row["worker"], json!(queue), "{queue}: {row}");
        // The worker's clock really was off: the claim's acquireTime is the
        // worker's wall clock, the lease's creation the server's.
        let lease = leases
            .list(&ListParams::default().labels(&format!(
                "{}={}",
                batchlease_api::keys::LABEL_TASK,
                t.name_any()
            )))
            .await
            .unwrap()
            .items
            .pop()
            .expect("the task's lease");
        let created = lease.metadata.creation_timestamp.clone().unwrap().0;
        let acquired = lease.spec.acquire_time.clone().expect("claimed").0;
        let skew = acquired.as_second() - created.as_second();
        assert!(
            (skew - seconds).abs() <= 5,
            "{queue} ({offset}): acquireTime {acquired} vs. created {created}: {skew} s, expected ≈ {seconds} s"
        );
    }
    drop(fleet);
    ns.finish().await.unwrap();
}

#[tokio::test]
async fn a_worker_whose_storage_refuses_its_registrations_stops_claiming_and_spends_no_retry() {
    let (ns, op) = setup("brake").await;
    // Every registration of this worker is late: its deadline margin (60 s)
    // is longer than the kill clock (2/3 of the 6 s TTL).
    let port = ports::free_port().unwrap();
    let broken = workers::start(
        &ns.name,
        "broken",
        &WorkerOpts {
            slots: 1,
            metrics_port: Some(port),
            extra: vec!["--storage-deadline-margin-ms=60000".into()],
            ..Default::default()
        },
    )
    .unwrap();
    let names = ["a", "b", "c"];
    for name in names {
        tasks::create(
            &ns,
            name,
            json!({"queue": "demo", "leaseDurationSeconds": 6,
                   "payload": {"steps": 1, "stepMillis": 10}}),
        )
        .await
        .unwrap();
    }
    // Three attempts in a row that never ran their handler: the worker
    // stops claiming, says so, and shows it in its metrics.
    wait_for(
        "the broken worker pauses its claims",
        T,
        || format!("{}\n{}", op.logs(), broken.logs()),
        || async move {
            let paused = workers::metric(port, "batchlease_worker_claims_paused ").await?;
            let pauses = workers::metric(port, "batchlease_worker_claim_pauses_total ").await?;
            Ok((paused == Some(1.0) && pauses >= Some(1.0)).then_some(()))
        },
    )
    .await
    .unwrap();
    let logs = broken.log_text();
    assert!(
        logs.contains("not claiming for a while"),
        "the worker says why it stopped claiming:\n{logs}"
    );
    assert!(
        logs.contains("deadline_passed_at_storage"),
        "and what the storage said:\n{logs}"
    );
    let not_started = workers::metric(
        port,
        "batchlease_worker_attempts_not_started_total{reason=\"registration\"} ",
    )
    .await
    .unwrap()
    .unwrap_or(0.0);
    assert!(not_started >= 3.0, "attempts not started: {not_started}");
    // What it gave back spent no retry: Interrupted, nothing dead-lettered.
    let api: Api<BatchTask> = ns.api();
    for t in api.list(&ListParams::default()).await.unwrap() {
        let st = t.status.clone().unwrap_or_default();
        assert_ne!(st.phase, Some(TaskPhase::DeadLettered), "{}", t.name_any());
        assert_eq!(st.attempts, 0, "{}: no retry spent: {st:?}", t.name_any());
        for h in &st.history {
            assert_eq!(
                (h.outcome.as_str(), h.reason.as_deref()),
                ("Interrupted", Some("RegistrationFailed")),
                "{}: {h:?}",
                t.name_any()
            );
        }
    }
    // A healthy worker runs them all.
    let good = workers::start(
        &ns.name,
        "good",
        &WorkerOpts {
            slots: 2,
            ..Default::default()
        },
    )
    .unwrap();
    for name in names {
        wait_phase(&ns, name, TaskPhase::Succeeded, T, || {
            op.logs_with(&[&broken, &good])
        })
        .await
        .unwrap();
    }
    drop((broken, good));
    ns.finish().await.unwrap();
}
