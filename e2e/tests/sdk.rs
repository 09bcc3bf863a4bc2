//! The worker SDK end to end: real control plane, real operator, real demo
//! workers (processes), real PostgreSQL.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use batchlease_api::{BatchTask, LeasePhase, TaskLease, TaskPhase};
use batchlease_e2e::operator::Operator;
use batchlease_e2e::process::Process;
use batchlease_e2e::proxy::{Proxy, apiserver_addr, proxied_kubeconfig};
use batchlease_e2e::tasks::{self, lease_phase, wait_holder, wait_lease, wait_phase};
use batchlease_e2e::workers::{self, WorkerOpts};
use batchlease_e2e::{Cluster, TestNamespace, pg, wait_for};
use batchlease_worker_sdk::postgres::FencedStore;
use batchlease_worker_sdk::{Error as SdkError, Fence, KillClock, WorkerMetrics};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams};
use serde_json::json;
use tokio::time::Instant;

const T: Duration = Duration::from_secs(60);

async fn setup(prefix: &str) -> (TestNamespace, Operator, tokio_postgres::Client) {
    let cluster = Cluster::with_crds().await.unwrap();
    let ns = cluster.namespace(prefix).await.unwrap();
    let op = Operator::start(&ns.name, "op").unwrap();
    op.wait_leading(T).await.unwrap();
    let db = pg::connect().await.unwrap();
    (ns, op, db)
}

/// A demo worker with one slot.
fn one_slot_worker(ns: &TestNamespace, identity: &str) -> Process {
    let opts = WorkerOpts {
        slots: 1,
        ..Default::default()
    };
    workers::start(&ns.name, identity, &opts).unwrap()
}

/// Creates task `job` on the demo queue with lease TTL `ttl` seconds.
async fn demo_job(ns: &TestNamespace, ttl: u64, payload: serde_json::Value) {
    tasks::create(
        ns,
        "job",
        json!({"queue": "demo", "leaseDurationSeconds": ttl, "payload": payload}),
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn fifty_tasks_three_workers_all_succeed_with_their_tokens_in_postgres() {
    let (ns, op, db) = setup("fifty").await;
    let opts = WorkerOpts {
        slots: 4,
        ..Default::default()
    };
    let w: Vec<Process> = (1..=3)
        .map(|i| workers::start(&ns.name, &format!("w{i}"), &opts).unwrap())
        .collect();
    for i in 0..50 {
        tasks::create(
            &ns,
            &format!("t{i:02}"),
            json!({"queue": "demo", "payload": {"steps": 2, "stepMillis": 50}}),
        )
        .await
        .unwrap();
    }
    let refs: Vec<&Process> = w.iter().collect();
    for i in 0..50 {
        wait_phase(
            &ns,
            &format!("t{i:02}"),
            TaskPhase::Succeeded,
            Duration::from_secs(120),
            || op.logs_with(&refs),
        )
        .await
        .unwrap();
    }
    let mut by_worker = std::collections::BTreeMap::<String, usize>::new();
    for t in ns
        .api::<BatchTask>()
        .list(&Default::default())
        .await
        .unwrap()
    {
        let st = t.status.clone().unwrap();
        let (token, payload) = pg::row(&db, &t.uid().unwrap())
            .await
            .unwrap()
            .expect("row committed");
        assert_eq!(
            token,
            st.fencing_token,
            "{}: row token vs. the attempt that completed",
            t.name_any()
        );
        let holder = st.history.last().and_then(|h| h.holder.clone()).unwrap();
        assert_eq!(
            payload["worker"],
            json!(holder),
            "{}: the row is the completing worker's",
            t.name_any()
        );
        *by_worker.entry(holder).or_default() += 1;
    }
    assert_eq!(by_worker.values().sum::<usize>(), 50);
    ns.finish().await.unwrap();
}

#[tokio::test]
async fn gc_pause_zombie_is_fenced_by_the_sdk_the_api_server_and_postgres() {
    let (ns, op, db) = setup("gcpause").await;
    let leases: Api<TaskLease> = ns.api();
    let opts = WorkerOpts {
        slots: 1,
        ..Default::default()
    };
    let zombie_metrics = batchlease_e2e::ports::free_port().unwrap();
    let zombie_opts = WorkerOpts {
        metrics_port: Some(zombie_metrics),
        ..opts.clone()
    };
    let zombie = workers::start(&ns.name, "zombie", &zombie_opts).unwrap();
    demo_job(&ns, 5, json!({"steps": 30, "stepMillis": 200})).await;
    wait_holder(&ns, "job", "zombie", T, || op.logs_with(&[&zombie]))
        .await
        .unwrap();

    // A stop-the-world pause longer than the TTL.
    zombie.signal("STOP").unwrap();
    wait_lease(&ns, "job-1", LeasePhase::Expired, T, || {
        op.logs_with(&[&zombie])
    })
    .await
    .unwrap();
    let rescuer = workers::start(&ns.name, "rescuer", &opts).unwrap();
    wait_phase(&ns, "job", TaskPhase::Succeeded, T, || {
        op.logs_with(&[&zombie, &rescuer])
    })
    .await
    .unwrap();
    let uid = tasks::uid(&ns, "job").await.unwrap();
    let (token, row) = pg::row(&db, &uid).await.unwrap().unwrap();
    assert_eq!((token, &row["worker"]), (2, &json!("rescuer")));

    // The zombie wakes up. Its kill switch fires (the lease was last renewed
    // long ago): nothing it does afterwards reaches PostgreSQL or the lease.
    zombie.signal("CONT").unwrap();
    wait_for(
        "zombie's kill switch",
        T,
        || zombie.logs(),
        || {
            let text = zombie.log_text();
            async move { Ok(text.contains("kill switch fired").then_some(())) }
        },
    )
    .await
    .unwrap();
    let (token, row) = pg::row(&db, &uid).await.unwrap().unwrap();
    assert_eq!(
        (token, &row["worker"]),
        (2, &json!("rescuer")),
        "the row keeps the second worker's result"
    );
    let fired = workers::metric(
        zombie_metrics,
        "batchlease_worker_kill_switch_total{reason=\"renewals_failed\"}",
    )
    .await
    .unwrap();
    assert_eq!(fired, Some(1.0), "kill switch counted in the SDK metrics");
    let writes = pg::audit(&db, &uid).await.unwrap();
    assert_eq!(
        writes,
        [(2, "rescuer".to_owned())],
        "the zombie never committed"
    );
    let l1 = leases.get("job-1").await.unwrap();
    assert_eq!(
        lease_phase(&l1),
        Some(LeasePhase::Expired),
        "the zombie's lease stays expired"
    );

    // Layers below the SDK hold even for a zombie that skipped the kill
    // switch: PostgreSQL refuses its token …
    let (client, conn) =
        tokio_postgres::connect(&workers::pg_url().unwrap(), tokio_postgres::NoTls)
            .await
            .unwrap();
    tokio::spawn(conn);
    let metrics = WorkerMetrics::default();
    let mut store = FencedStore::new(client, metrics.clone());
    let id = uid.clone();
    // A live fence for `token`, as a worker without the SDK's clock check
    // would effectively have.
    let live = |token| {
        Fence::new(
            token,
            KillClock::new(Duration::from_secs(5), Instant::now(), None),
        )
    };
    let err = store
        .commit(&live(1), &id, &json!({"worker": "zombie"}))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            SdkError::Fenced {
                token: 1,
                current: 2
            }
        ),
        "{err}"
    );
    assert_eq!(metrics.fenced_commit_rejected.get(), 1, "counted");
    // … and the API server refuses its completion.
    let mut late = l1.clone();
    late.status.as_mut().unwrap().phase = Some(LeasePhase::Completed);
    let err = leases
        .replace("job-1", &Default::default(), &late)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("is final"), "{err}");
    // The rescuer's own commit, replayed (same token, same payload: a lost
    // acknowledgement), is an idempotent success; a different payload under
    // the same token is an error, never a silent success.
    let again = store.commit(&live(2), &id, &row).await.unwrap();
    assert_eq!(
        again,
        batchlease_worker_sdk::postgres::Committed::AlreadyCommitted
    );
    let err = store
        .commit(&live(2), &id, &json!({"worker": "rescuer", "other": true}))
        .await
        .unwrap_err();
    assert!(
        matches!(err, SdkError::PayloadMismatch { token: 2 }),
        "{err}"
    );
    ns.finish().await.unwrap();
}

#[tokio::test]
async fn silent_partition_fires_the_kill_switch_within_two_thirds_of_the_ttl() {
    let (ns, op, db) = setup("partition").await;
    let proxy = Proxy::start(apiserver_addr().unwrap()).await.unwrap();
    let dir = batchlease_e2e::secrets::PrivateDir::new(&ns.name).unwrap();
    let kubeconfig = proxied_kubeconfig(&proxy, &dir).unwrap();
    let opts = WorkerOpts {
        slots: 1,
        kubeconfig: Some(kubeconfig),
        ..Default::default()
    };
    let cut_off = workers::start(&ns.name, "cutoff", &opts).unwrap();
    let ttl = Duration::from_secs(6);
    demo_job(&ns, 6, json!({"steps": 100, "stepMillis": 200})).await;
    wait_holder(&ns, "job", "cutoff", T, || op.logs_with(&[&cut_off]))
        .await
        .unwrap();
    // Wait for one renewal through the proxy, then cut it right after.
    let first = ns
        .api::<TaskLease>()
        .get("job-1")
        .await
        .unwrap()
        .spec
        .renew_time;
    wait_for(
        "a renewal",
        T,
        || cut_off.logs(),
        || async {
            let now = ns.api::<TaskLease>().get("job-1").await?.spec.renew_time;
            Ok((now != first).then_some(()))
        },
    )
    .await
    .unwrap();
    proxy.cut();
    let cut_at = Instant::now();
    wait_for(
        "kill switch after the partition",
        T,
        || cut_off.logs(),
        || {
            let text = cut_off.log_text();
            async move { Ok(text.contains("kill switch fired").then_some(())) }
        },
    )
    .await
    .unwrap();
    let fired_after = cut_at.elapsed();
    // The last successful renewal was sent before the cut: the switch fires
    // no later than 2/3·TTL after it (plus a second for the log poll and
    // scheduling on a loaded 2-core machine).
    assert!(
        fired_after <= ttl * 2 / 3 + Duration::from_secs(1),
        "fired {fired_after:?} after the cut"
    );

    // PostgreSQL stayed reachable, yet the cut-off worker writes nothing.
    let rescuer = one_slot_worker(&ns, "rescuer");
    wait_phase(
        &ns,
        "job",
        TaskPhase::Succeeded,
        Duration::from_secs(90),
        || op.logs_with(&[&cut_off, &rescuer]),
    )
    .await
    .unwrap();
    let writes = pg::audit(&db, &tasks::uid(&ns, "job").await.unwrap())
        .await
        .unwrap();
    assert_eq!(
        writes,
        [(2, "rescuer".to_owned())],
        "only the rescuer wrote"
    );
    ns.finish().await.unwrap();
}

#[tokio::test]
async fn checkpoint_survives_a_killed_attempt() {
    let (ns, op, _db) = setup("checkpoint").await;
    let opts = WorkerOpts {
        slots: 1,
        ..Default::default()
    };
    let mut first = workers::start(&ns.name, "first", &opts).unwrap();
    demo_job(&ns, 5, json!({"steps": 12, "stepMillis": 400})).await;
    // Progress travels with the renewals: wait until the lease shows step ≥ 3.
    let leases: Api<TaskLease> = ns.api();
    wait_for(
        "checkpoint step >= 3",
        T,
        || op.logs_with(&[&first]),
        || async {
            let l = leases.get_opt("job-1").await?;
            let step = l
                .and_then(|l| l.status)
                .and_then(|s| s.checkpoint)
                .and_then(|c| c.to_value().ok()?["step"].as_u64());
            Ok(step.filter(|s| *s >= 3))
        },
    )
    .await
    .unwrap();
    first.kill();
    let second = workers::start(&ns.name, "second", &opts).unwrap();
    let done = wait_phase(&ns, "job", TaskPhase::Succeeded, T, || {
        op.logs_with(&[&second])
    })
    .await
    .unwrap();
    let st = done.status.unwrap();
    assert_eq!(st.fencing_token, 2);
    let resumed = st.result.unwrap().to_value().unwrap()["resumedFrom"]
        .as_u64()
        .unwrap();
    assert!(resumed >= 3, "attempt 2 started from step {resumed}");
    ns.finish().await.unwrap();
}

#[tokio::test]
async fn sigterm_drains_releases_interrupted_and_spends_no_retry() {
    let (ns, op, _db) = setup("drain").await;
    let opts = WorkerOpts {
        slots: 1,
        drain_grace_seconds: 1,
        ..Default::default()
    };
    let draining = workers::start(&ns.name, "draining", &opts).unwrap();
    let payload = json!({"steps": 200, "stepMillis": 100});
    tasks::create(
        &ns,
        "job",
        json!({"queue": "demo", "maxRetries": 0, "payload": payload}),
    )
    .await
    .unwrap();
    wait_phase(&ns, "job", TaskPhase::Running, T, || {
        op.logs_with(&[&draining])
    })
    .await
    .unwrap();
    draining.signal("TERM").unwrap();
    let l = wait_lease(&ns, "job-1", LeasePhase::Completed, T, || {
        op.logs_with(&[&draining])
    })
    .await
    .unwrap();
    assert_eq!(
        l.status.unwrap().outcome,
        Some(batchlease_api::LeaseOutcome::Interrupted)
    );
    // Offered again at once, retry budget untouched (maxRetries is 0).
    wait_lease(&ns, "job-2", LeasePhase::Offered, T, || {
        op.logs_with(&[&draining])
    })
    .await
    .unwrap();
    let st = tasks::status(&ns, "job").await.unwrap();
    assert_eq!(st.attempts, 0);
    assert_eq!(st.history.last().unwrap().outcome, "Interrupted");
    ns.cleanup().await.unwrap();
}

#[tokio::test]
async fn permanent_error_dead_letters_immediately() {
    let (ns, op, db) = setup("permanent").await;
    let w = workers::start(&ns.name, "w", &WorkerOpts::default()).unwrap();
    let payload = json!({"steps": 1, "stepMillis": 10, "permanentFailure": true});
    tasks::create(
        &ns,
        "job",
        json!({"queue": "demo", "maxRetries": 5, "payload": payload}),
    )
    .await
    .unwrap();
    let t = wait_phase(&ns, "job", TaskPhase::DeadLettered, T, || {
        op.logs_with(&[&w])
    })
    .await
    .unwrap();
    let st = t.status.unwrap();
    assert_eq!((st.attempts, st.fencing_token), (1, 1));
    assert_eq!(st.last_failure.unwrap().reason, "DemoPermanent");
    assert!(
        pg::row(&db, &tasks::uid(&ns, "job").await.unwrap())
            .await
            .unwrap()
            .is_none(),
        "nothing committed"
    );
    ns.finish().await.unwrap();
}

#[tokio::test]
async fn deleting_a_running_task_fires_the_kill_switch_and_collects_its_leases() {
    let (ns, op, db) = setup("delete").await;
    let w = one_slot_worker(&ns, "w");
    demo_job(&ns, 6, json!({"steps": 200, "stepMillis": 100})).await;
    wait_phase(&ns, "job", TaskPhase::Running, T, || op.logs_with(&[&w]))
        .await
        .unwrap();
    let uid = tasks::uid(&ns, "job").await.unwrap();
    ns.api::<BatchTask>()
        .delete("job", &DeleteParams::background())
        .await
        .unwrap();
    // The garbage collector removes the lease; the next renewal finds it gone.
    let leases: Api<TaskLease> = ns.api();
    wait_for(
        "leases garbage-collected",
        T,
        || op.logs_with(&[&w]),
        || async {
            Ok(leases
                .list(&Default::default())
                .await?
                .items
                .is_empty()
                .then_some(()))
        },
    )
    .await
    .unwrap();
    wait_for(
        "kill switch on the lost lease",
        T,
        || w.logs(),
        || {
            let text = w.log_text();
            async move {
                Ok(
                    (text.contains("kill switch fired") && text.contains("lease_lost"))
                        .then_some(()),
                )
            }
        },
    )
    .await
    .unwrap();
    assert!(pg::row(&db, &uid).await.unwrap().is_none());
    ns.finish().await.unwrap();
}

/// A claim that fails with an API error (here: 403, the worker may not yet
/// update leases) is retried on its own: no new watch event is needed.
#[tokio::test]
async fn claims_failing_with_api_errors_are_retried_without_new_events() {
    use batchlease_e2e::kubectl;
    let (ns, op, _db) = setup("claimretry").await;
    let n = ns.name.as_str();
    kubectl::ok(&["create", "serviceaccount", "w", "-n", n]).unwrap();
    kubectl::ok(&[
        "create",
        "role",
        "read",
        "-n",
        n,
        "--verb=get,list,watch",
        "--resource=taskleases.batchlease.dev,batchtasks.batchlease.dev",
    ])
    .unwrap();
    kubectl::ok(&[
        "create",
        "rolebinding",
        "read",
        "-n",
        n,
        "--role=read",
        &format!("--serviceaccount={n}:w"),
    ])
    .unwrap();
    let dir = batchlease_e2e::secrets::PrivateDir::new(n).unwrap();
    let kc = kubectl::service_account_kubeconfig(n, "w", &dir).unwrap();
    let w = workers::start(
        n,
        "w",
        &WorkerOpts {
            kubeconfig: Some(kc),
            ..Default::default()
        },
    )
    .unwrap();
    tasks::create(
        &ns,
        "job",
        json!({"queue": "demo", "payload": {"steps": 1, "stepMillis": 10}}),
    )
    .await
    .unwrap();
    wait_for(
        "a refused claim",
        T,
        || w.logs(),
        || {
            let text = w.log_text();
            async move { Ok(text.contains("claims failed").then_some(())) }
        },
    )
    .await
    .unwrap();
    // Now allow claims. The offered lease does not change, so only the
    // worker's own retry can pick it up.
    kubectl::ok(&[
        "create",
        "role",
        "claim",
        "-n",
        n,
        "--verb=update",
        "--resource=taskleases.batchlease.dev",
    ])
    .unwrap();
    kubectl::ok(&[
        "create",
        "rolebinding",
        "claim",
        "-n",
        n,
        "--role=claim",
        &format!("--serviceaccount={n}:w"),
    ])
    .unwrap();
    wait_phase(&ns, "job", TaskPhase::Succeeded, T, || op.logs_with(&[&w]))
        .await
        .unwrap();
    ns.finish().await.unwrap();
}

#[tokio::test]
async fn a_forged_lease_is_neither_claimed_nor_followed() {
    let (ns, op, db) = setup("forged").await;
    // Before the task exists, someone with `create` on taskleases plants a
    // lease under the name the task's first lease will have, with the
    // largest token there is (it would fence out every real attempt).
    let forged: TaskLease = serde_json::from_value(json!({
        "apiVersion": "batchlease.dev/v1alpha1", "kind": "TaskLease",
        "metadata": {"name": "job-1", "labels": {
            "batchlease.dev/task": "job", "batchlease.dev/queue": "demo"}},
        "spec": {"taskName": "job", "taskUID": "forged", "queue": "demo",
                 "fencingToken": i64::MAX, "leaseDurationSeconds": 30},
        "status": {"phase": "Offered"}
    }))
    .unwrap();
    let leases: Api<TaskLease> = ns.api();
    leases.create(&Default::default(), &forged).await.unwrap();
    let w = workers::start(&ns.name, "w", &WorkerOpts::default()).unwrap();
    tasks::create(
        &ns,
        "job",
        json!({"queue": "demo", "payload": {"steps": 1, "stepMillis": 10}}),
    )
    .await
    .unwrap();
    // The operator's create of job-1 meets the forgery: token 1 is retired
    // and job-2 issued; the worker runs job-2 and commits under token 2.
    let done = wait_phase(&ns, "job", TaskPhase::Succeeded, T, || op.logs_with(&[&w]))
        .await
        .unwrap();
    let st = done.status.unwrap();
    assert_eq!(st.fencing_token, 2, "{st:?}");
    let (token, _) = pg::row(&db, &done.metadata.uid.unwrap())
        .await
        .unwrap()
        .expect("committed");
    assert_eq!(token, 2);
    let still = leases.get("job-1").await.unwrap();
    assert_eq!(
        (lease_phase(&still), still.spec.holder_identity.as_deref()),
        (Some(LeasePhase::Offered), None),
        "nobody claimed the forgery"
    );
    ns.finish().await.unwrap();
}

#[tokio::test]
async fn a_renewal_that_finds_the_lease_ended_fires_the_kill_switch_after_a_re_read() {
    let (ns, op, db) = setup("lost").await;
    let port = batchlease_e2e::ports::free_port().unwrap();
    let w = workers::start(
        &ns.name,
        "w",
        &WorkerOpts {
            slots: 1,
            metrics_port: Some(port),
            ..Default::default()
        },
    )
    .unwrap();
    demo_job(&ns, 30, json!({"steps": 100, "stepMillis": 100})).await;
    wait_holder(&ns, "job", "w", T, || op.logs_with(&[&w]))
        .await
        .unwrap();
    // Someone else ends the lease under the worker (as the operator's expiry
    // does): the worker's next renewal carries an old resourceVersion (409)
    // or hits a final lease (422); it re-reads, finds the lease no longer
    // held by it, and stops at once — long before its own clock would.
    let leases: Api<TaskLease> = ns.api();
    let mut l = leases.get("job-1").await.unwrap();
    l.status.as_mut().unwrap().phase = Some(LeasePhase::Expired);
    l.status.as_mut().unwrap().reason = Some("TestExpired".into());
    leases
        .replace("job-1", &Default::default(), &l)
        .await
        .unwrap();
    let ended = Instant::now();
    wait_for(
        "the kill switch on a lost lease",
        T,
        || w.logs(),
        || async {
            let n = workers::metric(
                port,
                "batchlease_worker_kill_switch_total{reason=\"lease_lost\"}",
            )
            .await
            .ok()
            .flatten();
            Ok((n == Some(1.0)).then_some(()))
        },
    )
    .await
    .unwrap();
    // One renewal period (TTL/3 = 10 s) at most, not 2/3 of the TTL.
    assert!(
        ended.elapsed() < Duration::from_secs(12),
        "{:?}",
        ended.elapsed()
    );
    assert!(
        w.log_text().contains("renewal found the lease lost"),
        "{}",
        w.logs()
    );
    // The retry (token 2) runs to the end; token 1 never committed.
    wait_phase(
        &ns,
        "job",
        TaskPhase::Succeeded,
        Duration::from_secs(90),
        || op.logs_with(&[&w]),
    )
    .await
    .unwrap();
    let uid = tasks::uid(&ns, "job").await.unwrap();
    assert_eq!(pg::audit(&db, &uid).await.unwrap(), [(2, "w".to_owned())]);
    ns.finish().await.unwrap();
}

#[tokio::test]
async fn a_completion_that_meets_an_outage_is_retried_while_the_fence_holds() {
    let (ns, op, db) = setup("complete-retry").await;
    let proxy = Proxy::start(apiserver_addr().unwrap()).await.unwrap();
    let dir = batchlease_e2e::secrets::PrivateDir::new(&ns.name).unwrap();
    let w = workers::start(
        &ns.name,
        "w",
        &WorkerOpts {
            slots: 1,
            kubeconfig: Some(proxied_kubeconfig(&proxy, &dir).unwrap()),
            ..Default::default()
        },
    )
    .unwrap();
    // TTL 30 s: the kill switch fires 20 s after the last renewal was sent;
    // each try of a write is bounded by half a renewal period (5 s).
    demo_job(&ns, 30, json!({"steps": 10, "stepMillis": 200})).await;
    wait_holder(&ns, "job", "w", T, || op.logs_with(&[&w]))
        .await
        .unwrap();
    // The API server becomes unreachable for the worker while it works
    // (PostgreSQL stays reachable): it commits, then its completion fails.
    proxy.cut();
    let uid = tasks::uid(&ns, "job").await.unwrap();
    wait_for(
        "the commit",
        T,
        || w.logs(),
        || {
            let (db, uid) = (&db, uid.clone());
            async move { Ok(pg::row(db, &uid).await?.map(|_| ())) }
        },
    )
    .await
    .unwrap();
    wait_for(
        "a failed completion try",
        T,
        || w.logs(),
        || {
            let text = w.log_text();
            async move {
                Ok(
                    (text.contains("completion timed out") || text.contains("completion failed"))
                        .then_some(()),
                )
            }
        },
    )
    .await
    .unwrap();
    // The outage ends before the fence runs out: the completion lands.
    proxy.restore();
    let done = wait_phase(&ns, "job", TaskPhase::Succeeded, T, || op.logs_with(&[&w]))
        .await
        .unwrap();
    let st = done.status.unwrap();
    assert_eq!(
        (st.fencing_token, st.attempts, st.history.len()),
        (1, 0, 1),
        "the first attempt's completion landed: no expiry, no second attempt"
    );
    assert!(!w.log_text().contains("kill switch fired"), "{}", w.logs());
    ns.finish().await.unwrap();
}

#[tokio::test]
async fn a_worker_whose_kill_switch_fired_gives_the_lease_back_at_once() {
    let (ns, op, _db) = setup("giveback").await;
    let w = one_slot_worker(&ns, "w");
    // TTL 30 s: the worker's kill switch fires 20 s after its last renewal
    // was sent (its claim, about a second before the pause below), the
    // operator would expire the lease 30 s after it saw it. A pause of 22 s
    // ends 2 s past the kill time and about 7 s before the expiry: room for
    // a loaded machine to deliver SIGCONT and the give-back.
    demo_job(&ns, 30, json!({"steps": 200, "stepMillis": 100})).await;
    wait_holder(&ns, "job", "w", T, || op.logs_with(&[&w]))
        .await
        .unwrap();
    // Stalled past its kill time but not past the TTL (the fault: a pause
    // of 22 s, its length the fault's parameter, not a wait), then running
    // again with the API server reachable.
    w.signal("STOP").unwrap();
    tokio::time::sleep(Duration::from_secs(22)).await;
    w.signal("CONT").unwrap();
    // It stops its work and hands the lease back as Interrupted instead of
    // leaving it Held until the operator expires it.
    let l = wait_lease(&ns, "job-1", LeasePhase::Completed, T, || {
        op.logs_with(&[&w])
    })
    .await
    .unwrap();
    let st = l.status.unwrap();
    assert_eq!(
        (st.outcome, st.reason.as_deref()),
        (
            Some(batchlease_api::LeaseOutcome::Interrupted),
            Some("KillSwitch")
        )
    );
    // The worker logs it once its write has returned, which may be after
    // the lease's new state reached this test.
    batchlease_e2e::wait_for(
        "the worker's log of the give-back",
        T,
        || w.logs(),
        || async { Ok(w.log_text().contains("lease given back").then_some(())) },
    )
    .await
    .unwrap();
    wait_phase(
        &ns,
        "job",
        TaskPhase::Succeeded,
        Duration::from_secs(90),
        || op.logs_with(&[&w]),
    )
    .await
    .unwrap();
    let st = tasks::status(&ns, "job").await.unwrap();
    assert_eq!((st.fencing_token, st.attempts), (2, 0), "no retry spent");
    ns.finish().await.unwrap();
}
