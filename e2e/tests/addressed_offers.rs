//! Addressed offers end to end (issue 27, design "Fleets"): demo workers
//! that renew per worker and take offers addressed to them, against the
//! real operator and control plane; every namespace's history is checked
//! at the end (`history_workers::check_addressed`: a claim names the
//! addressee, the address is fixed from the claim on, the label matches).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use batchlease_api::keys::LABEL_WORKER;
use batchlease_api::worker_lease::worker_lease_name;
use batchlease_api::{LeasePhase, TaskLease, TaskPhase, WorkerLease};
use batchlease_e2e::history::Change;
use batchlease_e2e::operator::Operator;
use batchlease_e2e::process::Process;
use batchlease_e2e::tasks::{self, wait_lease, wait_phase};
use batchlease_e2e::workers::{self, WorkerOpts};
use batchlease_e2e::{Cluster, TestNamespace, wait_for};
use kube::ResourceExt;
use kube::api::{Api, PostParams};
use serde_json::json;

const T: Duration = Duration::from_secs(60);
const TTL: u64 = 6;

async fn setup(prefix: &str) -> (TestNamespace, Operator) {
    let cluster = Cluster::with_crds().await.unwrap();
    let ns = cluster.namespace(prefix).await.unwrap();
    let op = Operator::start(&ns.name, "op").unwrap();
    op.wait_leading(T).await.unwrap();
    (ns, op)
}

fn per_worker(ns: &TestNamespace, identity: &str, slots: usize) -> Process {
    let opts = WorkerOpts {
        slots,
        env: vec![("BATCHLEASE_RENEW_PER_WORKER".into(), "1".into())],
        ..Default::default()
    };
    workers::start(&ns.name, identity, &opts).unwrap()
}

async fn job(ns: &TestNamespace, name: &str, step_ms: u64) {
    tasks::create(
        ns,
        name,
        json!({"queue": "demo", "leaseDurationSeconds": TTL,
               "payload": {"steps": 1, "stepMillis": step_ms}}),
    )
    .await
    .unwrap();
}

/// Waits until `identity`'s WorkerLease says it takes addressed offers.
async fn wait_slots(ns: &TestNamespace, identity: &str, logs: impl Fn() -> String) {
    let api: Api<WorkerLease> = ns.api();
    let name = worker_lease_name(identity);
    wait_for("the worker's WorkerLease with its slots", T, logs, || {
        let (api, name) = (api.clone(), name.clone());
        async move { Ok(api.get_opt(&name).await?.and_then(|w| w.spec.slots)) }
    })
    .await
    .unwrap();
}

/// A worker of queue demo that announced `slots`, renewed once (for
/// `duration` seconds) and died: it claims nothing.
async fn ghost_worker(ns: &TestNamespace, identity: &str, duration: i32, slots: i32) {
    workers::ghost_worker_lease(ns, identity, &["demo"], duration, Some(slots), false)
        .await
        .unwrap();
}

/// A task of queue demo with a long TTL (300 s: the claim deadline, 15 s,
/// is the shorter), `step_ms` of work.
async fn long_job(ns: &TestNamespace, name: &str, step_ms: u64) {
    tasks::create(
        ns,
        name,
        json!({"queue": "demo", "leaseDurationSeconds": 300,
               "payload": {"steps": 1, "stepMillis": step_ms}}),
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn each_offer_goes_to_one_worker_and_only_it_claims() {
    let (ns, op) = setup("addr").await;
    let w: Vec<Process> = (1..=2)
        .map(|i| per_worker(&ns, &format!("w{i}"), 2))
        .collect();
    let logs = || op.logs_with(&w.iter().collect::<Vec<_>>());
    for i in 1..=2 {
        wait_slots(&ns, &format!("w{i}"), logs).await;
    }
    for i in 1..=6 {
        job(&ns, &format!("job{i}"), 200).await;
    }
    for i in 1..=6 {
        wait_phase(&ns, &format!("job{i}"), TaskPhase::Succeeded, T, logs)
            .await
            .unwrap();
    }
    let (leases, _) = ns.recorded().await.unwrap();
    for i in 1..=6 {
        let name = format!("job{i}-1");
        let versions: Vec<&TaskLease> = leases
            .iter()
            .filter_map(|r| match &r.change {
                Change::Lease(l) if l.name_any() == name => Some(l.as_ref()),
                _ => None,
            })
            .collect();
        let first = versions.first().unwrap();
        let to = first
            .spec
            .offered_to
            .clone()
            .unwrap_or_else(|| panic!("{name}: offered to nobody: {first:?}"));
        assert_eq!(
            first.labels().get(LABEL_WORKER),
            Some(&worker_lease_name(&to)),
            "{name}: labelled for its worker's watch"
        );
        let last = versions.last().unwrap();
        assert_eq!(
            last.spec.holder_identity.as_deref(),
            Some(to.as_str()),
            "{name}: claimed by its addressee"
        );
    }
    // The history check (at `finish`) holds every claim to its address.
    drop(w);
    ns.finish().await.unwrap();
}

#[tokio::test]
async fn an_offer_to_a_worker_that_died_is_addressed_again_and_runs() {
    let (ns, op) = setup("addr-dead").await;
    let w = per_worker(&ns, "w", 1);
    let logs = || op.logs_with(&[&w]);
    wait_slots(&ns, "w", logs).await;
    // A worker that announced many slots, renewed once and died: the
    // operator prefers it (the most free slots) until it lapses.
    let ghost = "ghost/000001";
    ghost_worker(&ns, ghost, 10, 50).await;
    job(&ns, "job", 100).await;
    let offered = wait_lease(&ns, "job-1", LeasePhase::Offered, T, logs)
        .await
        .unwrap();
    assert_eq!(
        offered.spec.offered_to.as_deref(),
        Some(ghost),
        "offered to the worker with the most free slots"
    );
    // `kubectl batchlease workers` shows who is offered what.
    let out = std::process::Command::new(
        std::env::var("BATCHLEASE_PLUGIN_BIN")
            .expect("BATCHLEASE_PLUGIN_BIN unset: run hack/test.sh (it builds the plugin)"),
    )
    .args(["workers", "-n", &ns.name, "-o", "json"])
    .output()
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let row = |id: &str| {
        rows.as_array()
            .unwrap()
            .iter()
            .find(|r| r["worker"] == id)
            .cloned()
            .unwrap_or_else(|| panic!("no row for {id}: {rows}"))
    };
    let g = row(ghost);
    assert_eq!(
        (&g["renewal"], &g["offered"], &g["held"], &g["slots"]),
        (&json!("Worker"), &json!(1), &json!(0), &json!(50)),
        "{rows}"
    );
    assert_eq!(row("w")["slots"], json!(1), "{rows}");
    // Only the addressee may claim it: the live worker's claim in its own
    // name is refused by the API server.
    let leases: Api<TaskLease> = ns.api();
    let mut stolen = offered.clone();
    stolen.spec.holder_identity = Some("w".into());
    stolen.status.get_or_insert_with(Default::default).phase = Some(LeasePhase::Held);
    let e = leases
        .replace("job-1", &PostParams::default(), &stolen)
        .await
        .expect_err("a claim by another worker");
    assert!(
        matches!(&e, kube::Error::Api(s) if s.code == 422
            && s.message.contains("may be claimed only by that worker")),
        "{e}"
    );
    // It never claims; once it lapsed (or a TTL passed) the operator
    // addresses the offer to the live worker, which runs it.
    let done = wait_phase(&ns, "job", TaskPhase::Succeeded, T, logs)
        .await
        .unwrap();
    let st = done.status.unwrap();
    assert_eq!(
        st.fencing_token, 1,
        "the same offer, moved: {:?}",
        st.history
    );
    let held = leases.get("job-1").await.unwrap();
    assert_eq!(held.spec.offered_to.as_deref(), Some("w"));
    assert_eq!(held.spec.holder_identity.as_deref(), Some("w"));
    let moved = op
        .metric("batchlease_offers_readdressed_total")
        .await
        .unwrap()
        .unwrap_or(0.0);
    assert!(moved >= 1.0, "offers_readdressed {moved}");
    drop(w);
    ns.finish().await.unwrap();
}

#[tokio::test]
async fn an_offer_moves_at_once_when_its_workers_lease_is_deleted() {
    let (ns, op) = setup("addr-gone").await;
    let w = per_worker(&ns, "w", 1);
    let logs = || op.logs_with(&[&w]);
    wait_slots(&ns, "w", logs).await;
    // A worker that announced many slots and would stay addressable for
    // 300 s (half its WorkerLease's 600 s), then stops and deletes its
    // WorkerLease: its offer moves when the deletion is seen, not at its
    // lapse nor at the 15 s claim deadline.
    let ghost = "ghost/000003";
    ghost_worker(&ns, ghost, 600, 50).await;
    let created = std::time::Instant::now();
    long_job(&ns, "job", 10).await;
    let offered = wait_lease(&ns, "job-1", LeasePhase::Offered, T, logs)
        .await
        .unwrap();
    assert_eq!(offered.spec.offered_to.as_deref(), Some(ghost));
    ns.api::<WorkerLease>()
        .delete(&worker_lease_name(ghost), &Default::default())
        .await
        .unwrap();
    let leases: Api<TaskLease> = ns.api();
    wait_for("the offer moved to the live worker", T, logs, || {
        let leases = leases.clone();
        async move {
            let l = leases.get("job-1").await?;
            Ok((l.spec.offered_to.as_deref() == Some("w")).then_some(()))
        }
    })
    .await
    .unwrap();
    // The claim deadline runs from the address's write, after `created`:
    // a move it made is seen 15 s or more after `created`.
    let moved_after = created.elapsed();
    assert!(
        moved_after < Duration::from_secs(14),
        "moved {moved_after:?} after the task was created: the claim deadline (15 s), not the deletion, moved it\n{}",
        logs()
    );
    let done = wait_phase(&ns, "job", TaskPhase::Succeeded, T, logs)
        .await
        .unwrap();
    assert_eq!(
        done.status.unwrap().fencing_token,
        1,
        "the same offer, moved"
    );
    drop(w);
    ns.finish().await.unwrap();
}

#[tokio::test]
async fn with_addressing_off_outstanding_offers_open_to_all() {
    // The runbook before a rollback: --address-offers=false opens what an
    // operator with addressing offered to one worker, and offers no more.
    let cluster = Cluster::with_crds().await.unwrap();
    let ns = cluster.namespace("addr-off").await.unwrap();
    let op = Operator::start(&ns.name, "op1").unwrap();
    op.wait_leading(T).await.unwrap();
    // A worker that announced slots and will never claim.
    let ghost = "ghost/000002";
    ghost_worker(&ns, ghost, 600, 5).await;
    long_job(&ns, "job", 10).await;
    let offered = wait_lease(&ns, "job-1", LeasePhase::Offered, T, || op.logs())
        .await
        .unwrap();
    assert_eq!(offered.spec.offered_to.as_deref(), Some(ghost));
    drop(op);
    let op = Operator::start_with(&ns.name, "op2", vec!["--address-offers=false".into()]).unwrap();
    op.wait_leading(T).await.unwrap();
    let w = per_worker(&ns, "w", 1);
    let logs = || op.logs_with(&[&w]);
    let done = wait_phase(&ns, "job", TaskPhase::Succeeded, T, logs)
        .await
        .unwrap();
    assert_eq!(
        done.status.unwrap().fencing_token,
        1,
        "the same offer, opened"
    );
    let leases: Api<TaskLease> = ns.api();
    let l = leases.get("job-1").await.unwrap();
    assert_eq!(
        (l.spec.offered_to.as_deref(), l.labels().get(LABEL_WORKER)),
        (None, None),
        "opened to all"
    );
    assert_eq!(l.spec.holder_identity.as_deref(), Some("w"));
    // And a new offer goes to nobody in particular.
    job(&ns, "next", 10).await;
    wait_phase(&ns, "next", TaskPhase::Succeeded, T, logs)
        .await
        .unwrap();
    assert_eq!(leases.get("next-1").await.unwrap().spec.offered_to, None);
    drop(w);
    ns.finish().await.unwrap();
}
