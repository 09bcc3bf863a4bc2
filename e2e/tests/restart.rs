//! The control plane restarts under a running operator: kube-apiserver,
//! then etcd. After each is back the operator resumes within seconds —
//! a silent holder's lease expires, a finished lease is settled — instead
//! of idling in its watchers' backoff.
//!
//! Its own test binary on purpose: restarting the shared API server would
//! disturb tests running beside it, and cargo runs test binaries one at a
//! time.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use batchlease_api::{
    BatchTask, LeaseOutcome, LeasePhase, TaskLease, TaskPhase, TaskQueue, WorkerLease,
};
use batchlease_e2e::operator::Operator;
use batchlease_e2e::tasks::{self, wait_lease, wait_phase};
use batchlease_e2e::worker::{claim, complete};
use batchlease_e2e::workers::{self, WorkerOpts};
use batchlease_e2e::{Cluster, controlplane};
use kube::api::Api;
use serde_json::json;
use tokio::time::Instant;

const T: Duration = Duration::from_secs(60);
/// "Within a few seconds" of the component being back.
const RESUME: Duration = Duration::from_secs(6);

/// When fresh watches of every kind the operator's readiness waits for
/// (BatchTasks, TaskLeases, TaskQueues, WorkerLeases), configured as the
/// operator's are, have all delivered their initial list. After an etcd
/// restart the API server re-initializes its cache of each kind on its
/// own, so one kind served again says nothing about the others.
async fn served_again(ns: &batchlease_e2e::TestNamespace) -> Instant {
    use futures::StreamExt;
    use kube::runtime::watcher;
    async fn listed<K>(api: Api<K>)
    where
        K: kube::Resource<DynamicType = ()>
            + Clone
            + std::fmt::Debug
            + serde::de::DeserializeOwned
            + Send
            + 'static,
    {
        let stream = watcher(api, watcher::Config::default());
        futures::pin_mut!(stream);
        while let Some(ev) = stream.next().await {
            if matches!(ev, Ok(watcher::Event::InitDone)) {
                return;
            }
        }
    }
    let both = async {
        tokio::join!(
            listed(ns.api::<BatchTask>()),
            listed(ns.api::<TaskLease>()),
            listed(ns.api::<TaskQueue>()),
            listed(ns.api::<WorkerLease>()),
        );
    };
    tokio::time::timeout(T, both)
        .await
        .expect("the API server serves lists again");
    Instant::now()
}

#[tokio::test]
async fn the_operator_resumes_within_seconds_after_apiserver_and_etcd_restarts() {
    let cluster = Cluster::with_crds().await.unwrap();
    let mut ns = cluster.namespace("restart").await.unwrap();
    ns.tolerate_watch_errors();
    // Production election timings (15 s, grace 5 s): a quick restart is
    // shorter than the leader's term, so the leader rides over it.
    let op = Operator::start_with(
        &ns.name,
        "op-a",
        vec![
            "--leader-lease-seconds=15".into(),
            "--leader-grace-seconds=5".into(),
        ],
    )
    .unwrap();
    op.wait_leading(T).await.unwrap();
    let leases: Api<TaskLease> = ns.api();
    let ttl = 5;
    // A real worker (SDK) on its own queue rides over the restarts too.
    let worker = workers::start(&ns.name, "w", &WorkerOpts::default()).unwrap();

    // A quick restart of each, then an outage longer than the leader's term
    // (the watchers' backoff and the term both run out while it lasts).
    let faults = [("kube-apiserver", 0), ("etcd", 0), ("kube-apiserver", 20)];
    for (round, (component, down)) in faults.into_iter().enumerate() {
        let (silent, done) = (format!("silent-{round}"), format!("done-{round}"));
        // The silent holder's lease is short; the finishing one's long
        // enough to outlive the outage.
        for (name, secs) in [(&silent, ttl), (&done, 120)] {
            tasks::create(
                &ns,
                name,
                json!({"queue": "q", "leaseDurationSeconds": secs, "maxRetries": 0}),
            )
            .await
            .unwrap();
        }
        let mut held = Vec::new();
        for name in [&silent, &done] {
            let lease = format!("{name}-1");
            let offered = wait_lease(&ns, &lease, LeasePhase::Offered, T, || op.logs())
                .await
                .unwrap();
            held.push(claim(&leases, &offered, "w").await.unwrap());
            wait_phase(&ns, name, TaskPhase::Running, T, || op.logs())
                .await
                .unwrap();
        }

        controlplane::restart(component, Duration::from_secs(down)).unwrap();
        // Back = the API server serves what the operator asks for again:
        // the initial list of a watch like each of the operator's (after an
        // etcd restart that can take a while after /readyz).
        let back = served_again(&ns).await;
        // Clients reconnect: a fresh connection answers at once.
        let done_lease = held.pop().unwrap();
        let completed = tokio::time::timeout(T, async {
            loop {
                match complete(&leases, &done_lease, LeaseOutcome::Succeeded, None, None).await {
                    Ok(l) => return l,
                    Err(kube::Error::Api(s)) if s.code == 409 => panic!("{s:?}"),
                    Err(_) => tokio::task::yield_now().await,
                }
            }
        })
        .await
        .unwrap();
        drop(completed);
        let settled_in = {
            wait_phase(&ns, &done, TaskPhase::Succeeded, T, || op.logs())
                .await
                .unwrap();
            back.elapsed()
        };
        // The silent holder renewed last before the restart: its lease is
        // due at most TTL after the operator is back.
        let expired_in = {
            wait_lease(&ns, &format!("{silent}-1"), LeasePhase::Expired, T, || {
                op.logs()
            })
            .await
            .unwrap();
            back.elapsed()
        };
        assert!(
            settled_in <= RESUME,
            "{component} restart: a completed lease settled {settled_in:?} after it was back"
        );
        assert!(
            expired_in <= Duration::from_secs(ttl as u64) + RESUME,
            "{component} restart: a silent lease expired {expired_in:?} after it was back (TTL {ttl}s)"
        );
        // A task created now is claimed and run by the SDK worker, whose
        // lease watch had to come back as well.
        let fresh = format!("fresh-{round}");
        tasks::create(
            &ns,
            &fresh,
            json!({"queue": "demo", "payload": {"steps": 1, "stepMillis": 10}}),
        )
        .await
        .unwrap();
        let created = Instant::now();
        wait_phase(&ns, &fresh, TaskPhase::Succeeded, T, || {
            format!("{}{}", op.logs(), worker.logs())
        })
        .await
        .unwrap();
        let ran_in = created.elapsed();
        assert!(
            ran_in <= RESUME,
            "{component} restart: a new task took {ran_in:?} to run"
        );
        eprintln!(
            "{component} down {down}s: settled after {settled_in:?}, expired after {expired_in:?}, \
             a new task ran in {ran_in:?}"
        );
    }
    assert!(op.metric("batchlease_is_leader").await.unwrap() == Some(1.0));
    ns.finish().await.unwrap();
    // Leave the control plane as found: kube-controller-manager's garbage
    // collector may take long to recover from the outages on its own, and
    // later tests rely on it. A fresh start rediscovers every resource.
    controlplane::restart("kube-controller-manager", Duration::ZERO).unwrap();
}
