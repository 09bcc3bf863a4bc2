//! `spec.cancel` (design §9): the operator releases the task's lease, the
//! holder's next renewal finds it released and stops the handler, and the
//! task ends `Cancelled` — final, with an Event, and nothing committed
//! afterwards. A Ready task's offer is withdrawn before anyone claims it.
//! Real operator, demo workers and PostgreSQL; the namespace's whole
//! history is checked at the end (`check_cancel`: Cancelled is final, no
//! lease created or live after it, no storage write after it).
//!
//! The tests of a running task pin renewals per lease (the default),
//! whose timings they state: renewing per worker (opt-in) the operator
//! revokes the attempt on the WorkerLease instead
//! (`worker_lease.rs`: `cancel_revokes_an_attempt_renewed_per_worker`), and
//! a lost lease's holder may run a refresh period longer (design, Fleets).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use batchlease_api::{BatchTask, LeasePhase, TaskLease, TaskPhase};
use batchlease_e2e::operator::Operator;
use batchlease_e2e::tasks::{self, event_reasons, lease_phase, wait_phase};
use batchlease_e2e::wait::wait_for;
use batchlease_e2e::{pg, workers};
use kube::api::{Patch, PatchParams};
use serde_json::json;

const TTL: u64 = 6;

async fn cancel(ns: &batchlease_e2e::cluster::TestNamespace, name: &str) -> anyhow::Result<()> {
    ns.api::<BatchTask>()
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"cancel": true}})),
        )
        .await?;
    Ok(())
}

#[tokio::test]
async fn cancelling_a_running_task_stops_its_handler_and_ends_it_cancelled() {
    let (ns, op) = Operator::in_new_namespace("cancel-run", "op", Duration::from_secs(30))
        .await
        .unwrap();
    let db = pg::connect().await.unwrap();
    let worker = workers::start_n_per_lease(&ns.name, 1, 1).unwrap();
    // 60 s of work in 100 ms steps: it would not finish during the test.
    tasks::create(
        &ns,
        "long",
        json!({"queue": "demo", "leaseDurationSeconds": TTL,
               "payload": {"steps": 600, "stepMillis": 100}}),
    )
    .await
    .unwrap();
    let logs = || format!("{}{}", op.logs(), worker[0].logs());
    wait_phase(
        &ns,
        "long",
        TaskPhase::Running,
        Duration::from_secs(30),
        logs,
    )
    .await
    .unwrap();
    let uid = tasks::uid(&ns, "long").await.unwrap();
    let sent = Instant::now();
    cancel(&ns, "long").await.unwrap();

    // The holder renews every TTL/3: its next renewal finds the lease
    // released and cancels the handler.
    let stopped = wait_for(
        "the worker to stop the cancelled attempt",
        Duration::from_secs(TTL * 2),
        logs,
        || async {
            Ok(worker[0]
                .logs()
                .contains("the task was cancelled: stopping the attempt")
                .then(Instant::now))
        },
    )
    .await
    .unwrap();
    let took = stopped.duration_since(sent);
    eprintln!("handler cancelled {took:?} after spec.cancel was set");
    assert!(
        took <= Duration::from_secs(TTL / 3 + 2),
        "handler cancelled after {took:?}, more than TTL/3 + 2 s slack"
    );

    let t = wait_phase(
        &ns,
        "long",
        TaskPhase::Cancelled,
        Duration::from_secs(TTL * 3),
        logs,
    )
    .await
    .unwrap();
    let ended = Instant::now().duration_since(sent);
    let st = t.status.unwrap();
    assert_eq!(st.attempts, 0, "a cancel spends no retry");
    assert!(st.completion_time.is_some());
    let last = st.history.last().unwrap();
    assert_eq!(
        (last.outcome.as_str(), last.reason.as_deref()),
        ("Cancelled", Some("Cancelled"))
    );
    // Ended only once the holder could no longer be running: the operator
    // waits a TTL from the holder's last observed renewal.
    assert!(
        ended >= Duration::from_secs(TTL) - Duration::from_secs(TTL / 3) - Duration::from_secs(1),
        "Cancelled after {ended:?}: before the holder's kill switch could have fired"
    );
    let lease: TaskLease = ns
        .api::<TaskLease>()
        .get(st.current_lease.as_deref().unwrap())
        .await
        .unwrap();
    assert_eq!(lease_phase(&lease), Some(LeasePhase::Released));
    assert_eq!(
        lease.status.as_ref().unwrap().reason.as_deref(),
        Some("Cancelled")
    );
    // Nothing was committed for the task: the fenced row has no result.
    assert_eq!(pg::row(&db, &uid).await.unwrap(), None);
    let reasons = event_reasons(&ns, "long").await.unwrap();
    assert!(
        reasons.contains(&"Cancelled".to_owned()),
        "Events: {reasons:?}"
    );
    // The worker is free again and runs the next task.
    tasks::create(
        &ns,
        "next",
        json!({"queue": "demo", "payload": {"steps": 1, "stepMillis": 10}}),
    )
    .await
    .unwrap();
    wait_phase(
        &ns,
        "next",
        TaskPhase::Succeeded,
        Duration::from_secs(30),
        logs,
    )
    .await
    .unwrap();
    ns.finish().await.unwrap();
}

#[tokio::test]
async fn cancelling_a_ready_or_pending_task_ends_it_before_any_claim() {
    let (ns, op) = Operator::in_new_namespace("cancel-ready", "op", Duration::from_secs(30))
        .await
        .unwrap();
    // No worker: the offer waits.
    tasks::create(&ns, "ready", json!({"queue": "demo"}))
        .await
        .unwrap();
    // A dependency that does not exist keeps this one Pending.
    tasks::create(
        &ns,
        "pending",
        json!({"queue": "demo", "dependsOn": ["missing"]}),
    )
    .await
    .unwrap();
    let logs = || op.logs();
    wait_phase(
        &ns,
        "ready",
        TaskPhase::Ready,
        Duration::from_secs(30),
        logs,
    )
    .await
    .unwrap();
    wait_phase(
        &ns,
        "pending",
        TaskPhase::Pending,
        Duration::from_secs(30),
        logs,
    )
    .await
    .unwrap();
    cancel(&ns, "ready").await.unwrap();
    cancel(&ns, "pending").await.unwrap();
    let t = wait_phase(
        &ns,
        "ready",
        TaskPhase::Cancelled,
        Duration::from_secs(15),
        logs,
    )
    .await
    .unwrap();
    let st = t.status.unwrap();
    assert_eq!(st.fencing_token, 1, "no token issued after the cancel");
    let lease: TaskLease = ns.api::<TaskLease>().get("ready-1").await.unwrap();
    assert_eq!(lease_phase(&lease), Some(LeasePhase::Released));
    assert_eq!(lease.spec.holder_identity, None, "never claimed");
    let p = wait_phase(
        &ns,
        "pending",
        TaskPhase::Cancelled,
        Duration::from_secs(15),
        logs,
    )
    .await
    .unwrap();
    assert_eq!(p.status.unwrap().fencing_token, 0, "never issued");
    for name in ["ready", "pending"] {
        let reasons = event_reasons(&ns, name).await.unwrap();
        assert!(
            reasons.contains(&"Cancelled".to_owned()),
            "{name}: {reasons:?}"
        );
    }

    // A worker that starts now finds nothing to claim; a new task still runs.
    let worker = workers::start_n(&ns.name, 1, 1).unwrap();
    tasks::create(
        &ns,
        "after",
        json!({"queue": "demo", "payload": {"steps": 1, "stepMillis": 10}}),
    )
    .await
    .unwrap();
    wait_phase(
        &ns,
        "after",
        TaskPhase::Succeeded,
        Duration::from_secs(30),
        || format!("{}{}", op.logs(), worker[0].logs()),
    )
    .await
    .unwrap();
    assert_eq!(
        tasks::phase_of(&ns.api::<BatchTask>().get("ready").await.unwrap()),
        Some(TaskPhase::Cancelled),
        "Cancelled is final"
    );

    // spec.cancel cannot be taken back.
    let undo = ns
        .api::<BatchTask>()
        .patch(
            "ready",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"cancel": false}})),
        )
        .await
        .unwrap_err();
    assert!(
        undo.to_string()
            .contains("spec.cancel may only go from false to true"),
        "{undo}"
    );
    ns.finish().await.unwrap();
}

#[tokio::test]
async fn a_cancelled_task_whose_lease_was_deleted_ends_a_ttl_after_the_loss() {
    let (ns, op) = Operator::in_new_namespace("cancel-lost", "op", Duration::from_secs(30))
        .await
        .unwrap();
    let _db = pg::connect().await.unwrap();
    let worker = workers::start_n_per_lease(&ns.name, 1, 1).unwrap();
    tasks::create(
        &ns,
        "lost",
        json!({"queue": "demo", "leaseDurationSeconds": TTL,
               "payload": {"steps": 600, "stepMillis": 100}}),
    )
    .await
    .unwrap();
    let logs = || format!("{}{}", op.logs(), worker[0].logs());
    let t = wait_phase(
        &ns,
        "lost",
        TaskPhase::Running,
        Duration::from_secs(30),
        logs,
    )
    .await
    .unwrap();
    let lease = t.status.unwrap().current_lease.unwrap();
    // Someone deletes the held lease, and the task is cancelled: its
    // holder may run until its next renewal, and no successor will
    // register a newer token to fence it — the task must not end first.
    cancel(&ns, "lost").await.unwrap();
    // From before the delete is sent: the operator may see the loss before
    // the delete's answer reaches this test.
    let deleted = Instant::now();
    ns.api::<TaskLease>()
        .delete(&lease, &Default::default())
        .await
        .unwrap();
    let t = wait_phase(
        &ns,
        "lost",
        TaskPhase::Cancelled,
        Duration::from_secs(TTL * 4),
        logs,
    )
    .await
    .unwrap();
    let after = deleted.elapsed();
    let st = t.status.unwrap();
    let outcomes: Vec<&str> = st.history.iter().map(|h| h.outcome.as_str()).collect();
    if outcomes.contains(&"Lost") {
        // The operator saw the loss before the release: it waited a TTL.
        assert!(
            after >= Duration::from_secs(TTL),
            "Cancelled {after:?} after the loss: before its holder must have stopped"
        );
        let reasons = event_reasons(&ns, "lost").await.unwrap();
        assert!(reasons.contains(&"LeaseMissing".to_owned()), "{reasons:?}");
    } else {
        // The release landed before the deletion: the released-holder rule.
        assert_eq!(outcomes.last(), Some(&"Cancelled"), "{outcomes:?}");
    }
    eprintln!("Cancelled {after:?} after the lease was deleted; history {outcomes:?}");
    ns.finish().await.unwrap();
}

/// Issue 22 (2), the recipe with shorter times: a task issued with TTL 45
/// (its holder renews every 15 s) whose handler commits after 12 s; while
/// it runs its lease is deleted, then the TTL is cut to 5 s and the task
/// cancelled. The holder's kill clock runs on the lease's 45 s, so it
/// commits before its first renewal could find the lease gone; the task
/// must not end Cancelled before that. Before the fix it waited the
/// edited 5 s (+1) after the loss and ended Cancelled seconds before the
/// commit landed.
#[tokio::test]
async fn a_cancelled_task_waits_the_lost_leases_own_ttl_when_the_spec_ttl_was_cut() {
    const LONG: u64 = 45;
    let (ns, op) = Operator::in_new_namespace("cancel-ttl", "op", Duration::from_secs(30))
        .await
        .unwrap();
    let db = pg::connect().await.unwrap();
    let worker = workers::start_n_per_lease(&ns.name, 1, 1).unwrap();
    tasks::create(
        &ns,
        "edited",
        json!({"queue": "demo", "leaseDurationSeconds": LONG,
               "payload": {"steps": 120, "stepMillis": 100}}),
    )
    .await
    .unwrap();
    let logs = || format!("{}{}", op.logs(), worker[0].logs());
    let t = wait_phase(
        &ns,
        "edited",
        TaskPhase::Running,
        Duration::from_secs(30),
        logs,
    )
    .await
    .unwrap();
    let uid = t.metadata.uid.clone().unwrap();
    let st = t.status.unwrap();
    ns.api::<TaskLease>()
        .delete(st.current_lease.as_deref().unwrap(), &Default::default())
        .await
        .unwrap();
    ns.api::<BatchTask>()
        .patch(
            "edited",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"leaseDurationSeconds": 5, "cancel": true}})),
        )
        .await
        .unwrap();
    let edited = Instant::now();
    // The old holder commits (its handler knows nothing of the deletion
    // until its first renewal, 15 s after its claim).
    let (token, _) = wait_for(
        "the old holder's commit",
        Duration::from_secs(20),
        logs,
        || {
            let db = &db;
            let uid = &uid;
            async move { pg::row(db, uid).await }
        },
    )
    .await
    .unwrap();
    assert_eq!(token, 1);
    let phase = tasks::phase_of(&ns.api::<BatchTask>().get("edited").await.unwrap());
    eprintln!(
        "the old holder committed {:?} after the edit; the task was {phase:?}",
        edited.elapsed()
    );
    assert_ne!(
        phase,
        Some(TaskPhase::Cancelled),
        "Cancelled before the lost lease's holder stopped: its commit landed after"
    );
    // Cancelled a whole lease TTL (45 s, not 5 s) after the loss.
    let t = wait_phase(
        &ns,
        "edited",
        TaskPhase::Cancelled,
        Duration::from_secs(LONG + 15),
        logs,
    )
    .await
    .unwrap();
    let after = edited.elapsed();
    let st = t.status.unwrap();
    let lost = st
        .history
        .iter()
        .find(|h| h.outcome == "Lost")
        .unwrap_or_else(|| panic!("no Lost entry: {:?}", st.history));
    assert_eq!(
        lost.lease_duration_seconds,
        Some(i32::try_from(LONG).unwrap())
    );
    assert_eq!(
        st.current_lease_duration_seconds,
        Some(i32::try_from(LONG).unwrap()),
        "the issue recorded the lease's TTL"
    );
    assert!(
        after >= Duration::from_secs(LONG - 5),
        "Cancelled {after:?} after the loss, before a lease TTL"
    );
    ns.finish().await.unwrap();
}
