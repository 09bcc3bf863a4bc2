//! Bound attempts end to end (issue 27, design "Fleets"): an offer to a
//! worker that renews per worker, has a free slot and takes bound attempts
//! is created already `Held` by it (`spec.boundAt`), and no claim follows.
//! Against the real operator and control plane; every namespace's history
//! is checked at the end (`history_workers::check_bound`: a bound lease is
//! held by its addressee and cites a renewal its WorkerLease made before).
//! What a bound task costs is in `write_cost.rs`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use batchlease_api::WorkerLease;
use batchlease_api::worker_lease::worker_lease_name;
use batchlease_api::{LeasePhase, TaskLease, TaskPhase};
use batchlease_e2e::operator::Operator;
use batchlease_e2e::process::Process;
use batchlease_e2e::tasks::{self, wait_lease, wait_phase};
use batchlease_e2e::workers::{self, WorkerOpts};
use batchlease_e2e::{Cluster, TestNamespace, wait_for};
use kube::api::{Api, PostParams};
use serde_json::json;

const T: Duration = Duration::from_secs(60);
const TTL: u64 = 6;

fn per_worker(ns: &TestNamespace, identity: &str, slots: usize) -> Process {
    let opts = WorkerOpts {
        slots,
        env: vec![("BATCHLEASE_RENEW_PER_WORKER".into(), "1".into())],
        ..Default::default()
    };
    workers::start(&ns.name, identity, &opts).unwrap()
}

/// Waits until `identity`'s WorkerLease says it takes bound attempts.
async fn wait_takes_bound(ns: &TestNamespace, identity: &str, logs: impl Fn() -> String) {
    let api: Api<WorkerLease> = ns.api();
    let name = worker_lease_name(identity);
    wait_for(
        "the worker's WorkerLease taking bound attempts",
        T,
        logs,
        || {
            let (api, name) = (api.clone(), name.clone());
            async move {
                Ok(api
                    .get_opt(&name)
                    .await?
                    .and_then(|w| w.spec.takes_bound.filter(|t| *t)))
            }
        },
    )
    .await
    .unwrap();
}

async fn job(ns: &TestNamespace, name: &str) {
    tasks::create(
        ns,
        name,
        json!({"queue": "demo", "leaseDurationSeconds": TTL,
               "payload": {"steps": 1, "stepMillis": 200}}),
    )
    .await
    .unwrap();
}

/// A worker that announced many free slots and bound attempts, renewed
/// once and stopped, gets the task bound to it (it has the most free
/// slots, and its renewal is fresh). Nobody takes it: no renewal ever
/// names it, so it expires a TTL later as `BoundNotTaken` — the worker
/// failed, not the task — and the task runs on the live worker without
/// spending a retry. The next attempt is not bound to the stopped worker:
/// its last renewal is older than half a TTL by then.
#[tokio::test]
async fn an_attempt_bound_to_a_worker_that_stopped_runs_elsewhere_without_spending_a_retry() {
    let cluster = Cluster::with_crds().await.unwrap();
    let ns = cluster.namespace("bound-ghost").await.unwrap();
    let op = Operator::start(&ns.name, "op").unwrap();
    op.wait_leading(T).await.unwrap();
    let w = per_worker(&ns, "w", 1);
    let logs = || op.logs_with(&[&w]);
    wait_takes_bound(&ns, "w", logs).await;
    let ghost = "ghost/00000b";
    workers::ghost_worker_lease(&ns, ghost, &["demo"], 10, Some(10), true)
        .await
        .unwrap();
    job(&ns, "job").await;
    let first = wait_lease(&ns, "job-1", LeasePhase::Expired, T, logs)
        .await
        .unwrap();
    assert!(
        first.bound(),
        "bound to the ghost: {:?}\n{}",
        first.spec,
        logs()
    );
    assert_eq!(first.spec.holder_identity.as_deref(), Some(ghost));
    assert_eq!(
        first.status.as_ref().and_then(|s| s.reason.as_deref()),
        Some("BoundNotTaken"),
        "{:?}",
        first.status
    );
    let done = wait_phase(&ns, "job", TaskPhase::Succeeded, T, logs)
        .await
        .unwrap();
    let st = done.status.unwrap();
    assert_eq!(st.attempts, 0, "no retry spent: {:?}", st.history);
    assert_eq!(
        st.history.first().map(|h| h.outcome.as_str()),
        Some("Interrupted"),
        "{:?}",
        st.history
    );
    let last: TaskLease = ns
        .api::<TaskLease>()
        .get(&batchlease_api::names::lease_name("job", st.fencing_token))
        .await
        .unwrap();
    assert_eq!(last.spec.holder_identity.as_deref(), Some("w"));
    drop(w);
    ns.finish().await.unwrap();
}

/// A queue whose only worker takes bound attempts and went silent — as
/// every worker does during an outage of the API server or etcd — holds
/// its issues for that worker (`offers::awaited`) instead of offering
/// them open to all: the pass of every waiting task after an outage would
/// otherwise issue the whole backlog at once (the 1,000-fault soak's
/// bursts of 700 issues). The worker's next renewal wakes them, and they
/// are bound to it.
#[tokio::test]
async fn issues_wait_for_a_silent_worker_that_takes_bound_attempts() {
    let cluster = Cluster::with_crds().await.unwrap();
    let ns = cluster.namespace("bound-silent").await.unwrap();
    let op = Operator::start(&ns.name, "op").unwrap();
    op.wait_leading(T).await.unwrap();
    let logs = || op.logs();
    // Renewed once (its create), then silent: a candidate for half its
    // 10 s, awaited for 60 s after that renewal.
    let ghost = "ghost/00000c";
    let wl = workers::ghost_worker_lease(&ns, ghost, &["demo"], 10, Some(2), true)
        .await
        .unwrap();
    // A TTL long enough that the issue finds the ghost fresh (seen renewed
    // within half of it, and within half the ghost's duration).
    tasks::create(
        &ns,
        "job",
        json!({"queue": "demo", "leaseDurationSeconds": 20,
               "payload": {"steps": 1, "stepMillis": 200}}),
    )
    .await
    .unwrap();
    // Bound to the ghost while it is fresh; never taken, it expires when
    // the ghost's WorkerLease lapses (10 s), past its half duration.
    let first = wait_lease(&ns, "job-1", LeasePhase::Expired, T, logs)
        .await
        .unwrap();
    assert!(
        first.bound(),
        "bound to the ghost: {:?}\n{}",
        first.spec,
        logs()
    );
    // The next issue waits for the silent worker: counted as held back for
    // workers' slots, and no lease written.
    let held = format!(
        "batchlease_queue_issues_throttled_total{{namespace=\"{}\",queue=\"demo\",reason=\"worker_slots\"}}",
        ns.name
    );
    wait_for("the issue held back for the silent worker", T, logs, || {
        let held = held.clone();
        let op = &op;
        async move { Ok(op.metric(&held).await?.filter(|n| *n >= 1.0)) }
    })
    .await
    .unwrap();
    let leases: Api<TaskLease> = ns.api();
    assert!(
        leases.get_opt("job-2").await.unwrap().is_none(),
        "no lease while the worker is silent\n{}",
        logs()
    );
    // Its renewal lands: the waiting issue goes out bound to it.
    let api: Api<WorkerLease> = ns.api();
    let mut renewed = api.get(&wl.metadata.name.clone().unwrap()).await.unwrap();
    renewed.spec.renew_time = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(
        k8s_openapi::jiff::Timestamp::now(),
    ));
    api.replace(&worker_lease_name(ghost), &PostParams::default(), &renewed)
        .await
        .unwrap();
    let second = wait_for("the issue after the renewal", T, logs, || {
        let leases = leases.clone();
        async move { Ok(leases.get_opt("job-2").await?) }
    })
    .await
    .unwrap();
    assert!(
        second.bound() && second.spec.holder_identity.as_deref() == Some(ghost),
        "bound to the worker that renewed: {:?}\n{}",
        second.spec,
        logs()
    );
    // The worker finishes it (as the ghost).
    batchlease_e2e::worker::complete(
        &leases,
        &second,
        batchlease_api::LeaseOutcome::Succeeded,
        None,
        None,
    )
    .await
    .unwrap();
    wait_phase(&ns, "job", TaskPhase::Succeeded, T, logs)
        .await
        .unwrap();
    ns.finish().await.unwrap();
}

/// `--bind-offers=false` (the runbook before rolling the operator back to
/// a version that does not bind): offers to the same worker are claimed.
#[tokio::test]
async fn with_binding_off_offers_are_claimed() {
    let cluster = Cluster::with_crds().await.unwrap();
    let ns = cluster.namespace("bound-off").await.unwrap();
    let op = Operator::start_with(&ns.name, "op", vec!["--bind-offers=false".into()]).unwrap();
    op.wait_leading(T).await.unwrap();
    let w = per_worker(&ns, "w", 4);
    let logs = || op.logs_with(&[&w]);
    wait_takes_bound(&ns, "w", logs).await;
    for i in 1..=3 {
        job(&ns, &format!("job{i}")).await;
    }
    for i in 1..=3 {
        wait_phase(&ns, &format!("job{i}"), TaskPhase::Succeeded, T, logs)
            .await
            .unwrap();
        let l: TaskLease = ns
            .api::<TaskLease>()
            .get(&format!("job{i}-1"))
            .await
            .unwrap();
        assert!(!l.bound(), "claimed, not bound: {:?}", l.spec);
        assert_eq!(l.spec.offered_to.as_deref(), Some("w"), "still addressed");
        assert!(l.spec.acquire_time.is_some(), "the claim wrote acquireTime");
    }
    drop(w);
    ns.finish().await.unwrap();
}

/// The CRD keeps `spec.boundAt` to the create: a write may not add it to a
/// lease (a claimed attempt passed off as bound) nor change it (another
/// renewal cited), and may drop it (an older operator's typed write).
#[tokio::test]
async fn bound_at_is_set_by_the_create_alone() {
    let cluster = Cluster::with_crds().await.unwrap();
    let ns = cluster.namespace("bound-cel").await.unwrap();
    let api: Api<TaskLease> = ns.api();
    let at = |s: i64| {
        k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(
            k8s_openapi::jiff::Timestamp::from_second(1_800_000_000 + s).unwrap(),
        )
    };
    let held = |name: &str, bound: Option<i64>| {
        let mut l = TaskLease::new(
            name,
            batchlease_api::TaskLeaseSpec::offered("t", "uid-1", "demo", 1, 30),
        );
        l.spec.holder_identity = Some("w/1".into());
        l.spec.renewal = Some(batchlease_api::Renewal::Worker);
        l.spec.offered_to = Some("w/1".into());
        l.spec.renew_time = Some(at(0));
        l.spec.bound_at = bound.map(at);
        l.status = Some(batchlease_api::TaskLeaseStatus {
            phase: Some(LeasePhase::Held),
            ..Default::default()
        });
        l
    };
    let refused = |r: Result<TaskLease, kube::Error>| match r {
        Err(kube::Error::Api(s)) if s.code == 422 => s.message,
        other => panic!("not refused with 422: {other:?}"),
    };
    let rule = "boundAt is written only by the operator's create of a bound attempt";
    // Added to a lease created without it.
    let claimed = api
        .create(&PostParams::default(), &held("claimed-1", None))
        .await
        .unwrap();
    let mut added = claimed.clone();
    added.spec.bound_at = Some(at(0));
    let msg = refused(
        api.replace("claimed-1", &PostParams::default(), &added)
            .await,
    );
    assert!(msg.contains(rule), "{msg}");
    // Changed on a bound one; dropped is allowed.
    let bound = api
        .create(&PostParams::default(), &held("bound-1", Some(0)))
        .await
        .unwrap();
    let mut changed = bound.clone();
    changed.spec.bound_at = Some(at(5));
    let msg = refused(
        api.replace("bound-1", &PostParams::default(), &changed)
            .await,
    );
    assert!(msg.contains(rule), "{msg}");
    let mut dropped = bound.clone();
    dropped.spec.bound_at = None;
    let stored = api
        .replace("bound-1", &PostParams::default(), &dropped)
        .await
        .unwrap();
    assert!(!stored.bound());
    // Made by hand, the bound lease cites a renewal no WorkerLease made:
    // the history checker says so (and only that).
    let v = ns
        .violations(batchlease_e2e::history::Checks::default())
        .await
        .unwrap();
    assert!(
        v.len() == 1 && v[0].contains("bound-1") && v[0].contains("never recorded"),
        "{v:?}"
    );
    Api::<k8s_openapi::api::core::v1::Namespace>::all(cluster.client.clone())
        .delete(&ns.name, &Default::default())
        .await
        .unwrap();
}
