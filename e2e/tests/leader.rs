//! Operator replicas and leadership: the leader is killed mid-run and the
//! standby takes over (every task completes, tokens strictly increase per
//! task across both, never two `Held` leases of a task — the history
//! checker's invariants — and a held lease gets a full TTL from the
//! takeover, timed by the audit log); a deposed or cut-off leader stops
//! writing within its term (the audit log shows no write after it).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use batchlease_api::{LeaseOutcome, LeasePhase, TaskLease, TaskPhase};
use batchlease_e2e::operator::Operator;
use batchlease_e2e::tasks::{self, lease_phase, wait_phase};
use batchlease_e2e::worker::{claim, complete, renew};
use batchlease_e2e::{Cluster, audit, wait_for};
use futures::TryStreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::json;

const T: Duration = Duration::from_secs(60);

/// A worker of queue `q` driven by the lease watch: claims every Offered
/// lease of its queue, renews once, completes it — except the first lease
/// of an `expire-*` task, which it claims and then abandons (a holder that
/// died), so the operator must expire it and issue token 2.
async fn worker(api: Api<TaskLease>) {
    let stream = watcher(api.clone(), watcher::Config::default()).applied_objects();
    futures::pin_mut!(stream);
    while let Ok(Some(lease)) = stream.try_next().await {
        if lease_phase(&lease) != Some(LeasePhase::Offered) || lease.spec.queue != "q" {
            continue;
        }
        let api = api.clone();
        tokio::spawn(async move {
            let Ok(held) = claim(&api, &lease, "w").await else {
                return;
            };
            if lease.spec.task_name.starts_with("expire-") && lease.spec.fencing_token == 1 {
                return;
            }
            let Ok(held) = renew(&api, &held).await else {
                return;
            };
            let _ = complete(&api, &held, LeaseOutcome::Succeeded, None, None).await;
        });
    }
}

#[tokio::test]
async fn leader_killed_mid_run_standby_finishes_without_double_holding() {
    let cluster = Cluster::with_crds().await.unwrap();
    let ns = cluster.namespace("leader").await.unwrap();
    let mut a = Operator::start(&ns.name, "op-a").unwrap();
    a.wait_leading(T).await.unwrap();
    let b = Operator::start(&ns.name, "op-b").unwrap();
    // The standby is healthy and ready but does not lead.
    wait_for(
        "standby op-b ready",
        T,
        || b.logs(),
        || async { Ok((b.get("/readyz").await.map(|r| r.0).unwrap_or(0) == 200).then_some(())) },
    )
    .await
    .unwrap();
    assert_eq!(b.metric("batchlease_is_leader").await.unwrap(), Some(0.0));

    let leases: Api<TaskLease> = ns.api();
    let work = tokio::spawn(worker(leases.clone()));

    let names: Vec<String> = (0..8).map(|i| format!("job-{i}")).collect();
    for n in &names[..4] {
        tasks::create(&ns, n, json!({"queue": "q", "leaseDurationSeconds": 5}))
            .await
            .unwrap();
    }
    for n in &names[..4] {
        wait_phase(&ns, n, TaskPhase::Succeeded, T, || a.logs())
            .await
            .unwrap();
    }
    // Holders that die right before the failover: the new leader must
    // expire their leases and issue token 2 (the history checker then sees
    // token order across the two leaders, not only token 1s).
    let expiring: Vec<String> = (0..3).map(|i| format!("expire-{i}")).collect();
    for n in &expiring {
        tasks::create(&ns, n, json!({"queue": "q", "leaseDurationSeconds": 5}))
            .await
            .unwrap();
    }
    for n in &expiring {
        wait_phase(&ns, n, TaskPhase::Running, T, || a.logs())
            .await
            .unwrap();
    }
    // Hold one lease across the failover. Its last renewal, just before the
    // leader dies, carries a renewTime from the year 2000: an operator that
    // trusted the holder's clock would expire it at once.
    let ttl = 6;
    tasks::create(
        &ns,
        "held",
        json!({"queue": "manual", "leaseDurationSeconds": ttl}),
    )
    .await
    .unwrap();
    let offered =
        batchlease_e2e::tasks::wait_lease(&ns, "held-1", LeasePhase::Offered, T, || a.logs())
            .await
            .unwrap();
    let held = claim(&leases, &offered, "steady").await.unwrap();
    let mut stale = held.clone();
    stale.spec.renew_time = Some(MicroTime("2000-01-01T00:00:00Z".parse().unwrap()));
    let held = leases
        .replace("held-1", &Default::default(), &stale)
        .await
        .unwrap();
    drop(held);

    a.kill();
    for n in &names[4..] {
        tasks::create(&ns, n, json!({"queue": "q", "leaseDurationSeconds": 5}))
            .await
            .unwrap();
    }
    b.wait_leading(T).await.unwrap();
    for n in names.iter().chain(&expiring) {
        wait_phase(&ns, n, TaskPhase::Succeeded, T, || b.logs())
            .await
            .unwrap();
    }
    for n in &expiring {
        let st = tasks::status(&ns, n).await.unwrap();
        assert_eq!(st.fencing_token, 2, "{n}: {st:?}");
    }
    // The abandoned "held" lease: expired by op-b no sooner than a full TTL
    // after op-b took over — timed by the API server's own audit log.
    batchlease_e2e::tasks::wait_lease(&ns, "held-1", LeasePhase::Expired, T, || b.logs())
        .await
        .unwrap();
    let writes = audit::writes_in(&ns.name).unwrap();
    let b_user = Operator::user("op-b");
    let takeover = writes
        .iter()
        .find(|w| w.user == b_user && w.resource == "leases")
        .expect("op-b's takeover of the election Lease is in the audit log")
        .at;
    let expired = writes
        .iter()
        .find(|w| {
            w.user == b_user
                && w.resource == "taskleases"
                && w.name == "held-1"
                && w.verb == "update"
        })
        .expect("op-b's expiry of held-1 is in the audit log")
        .at;
    assert!(
        expired >= takeover + ttl as f64,
        "held-1 expired {:.3}s after op-b took over (TTL {ttl}s)",
        expired - takeover
    );
    // op-a wrote nothing once dead, and op-b nothing before it led.
    let a_user = Operator::user("op-a");
    let killed_at = writes
        .iter()
        .filter(|w| w.user == a_user)
        .map(|w| w.at)
        .fold(0.0, f64::max);
    assert!(
        killed_at < takeover,
        "op-a wrote at {killed_at} after op-b took over at {takeover}"
    );
    assert!(
        writes
            .iter()
            .filter(|w| w.user == b_user && w.resource != "leases")
            .all(|w| w.at >= takeover),
        "op-b wrote before it led"
    );
    // The next attempt of "held" runs normally under token 2.
    let next =
        batchlease_e2e::tasks::wait_lease(&ns, "held-2", LeasePhase::Offered, T, || b.logs())
            .await
            .unwrap();
    let next = claim(&leases, &next, "steady").await.unwrap();
    complete(&leases, &next, LeaseOutcome::Succeeded, None, None)
        .await
        .unwrap();
    wait_phase(&ns, "held", TaskPhase::Succeeded, T, || b.logs())
        .await
        .unwrap();
    work.abort();
    ns.finish().await.unwrap();
}

/// A replica whose leader Lease is taken over stops writing at once and
/// stands by; when the Lease is free again it leads a new term.
#[tokio::test]
async fn deposed_leader_stops_writing_and_stands_by() {
    use k8s_openapi::api::coordination::v1::Lease;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
    use kube::api::{Patch, PatchParams};

    let cluster = Cluster::with_crds().await.unwrap();
    let ns = cluster.namespace("deposed").await.unwrap();
    let mut a = Operator::start(&ns.name, "op-a").unwrap();
    a.wait_leading(T).await.unwrap();

    // Someone else now holds the election Lease (as after a partition in
    // which the lease ran out and another replica took it).
    let stamp = MicroTime(k8s_openapi::jiff::Timestamp::now());
    let patch = json!({"spec": {"holderIdentity": "intruder", "acquireTime": stamp, "renewTime": stamp,
                                "leaseDurationSeconds": 60}});
    ns.api::<Lease>()
        .patch(
            "batchlease-operator",
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
        .unwrap();
    let deposed = now();
    wait_not_leading(&a).await;
    assert!(a.logs().contains("leadership lost"), "{}", a.logs());
    assert!(a.exited().is_none(), "a deposed replica stands by");

    // Nothing of op-a writes any more: a new task stays untouched while the
    // intruder holds the Lease.
    tasks::create(&ns, "job", json!({"queue": "q"}))
        .await
        .unwrap();
    let untouched = ns
        .api::<batchlease_api::BatchTask>()
        .get("job")
        .await
        .unwrap();
    assert!(untouched.status.is_none());
    // The intruder vacates the way its owner would: op-a leads a new term.
    let vacated = now();
    ns.api::<Lease>()
        .patch(
            "batchlease-operator",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"holderIdentity": null}})),
        )
        .await
        .unwrap();
    a.wait_leading(T).await.unwrap();
    wait_phase(&ns, "job", TaskPhase::Ready, T, || a.logs())
        .await
        .unwrap();
    // The audit log: no write by op-a from the end of its term (at most a
    // term, 4 s, after it was deposed) until it led again.
    assert_no_writes(&ns.name, "op-a", deposed + TERM, vacated);
    ns.cleanup().await.unwrap();
}

/// The term of the test replicas (lease 6 s − grace 2 s).
const TERM: f64 = 4.0;

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// The audit log shows no accepted write by replica `name` in `namespace`
/// (other than to its election Lease) between `from` and `to`.
fn assert_no_writes(namespace: &str, name: &str, from: f64, to: f64) {
    let user = Operator::user(name);
    let stale: Vec<_> = audit::writes_in(namespace)
        .unwrap()
        .into_iter()
        .filter(|w| w.user == user && w.resource != "leases" && w.at > from && w.at < to)
        .collect();
    assert!(
        stale.is_empty(),
        "{name} wrote after its term ended: {stale:#?}"
    );
}

/// Waits until `op` reports it does not lead.
async fn wait_not_leading(op: &Operator) -> tokio::time::Instant {
    wait_for(
        &format!("operator {} to stop leading", op.name),
        T,
        || op.logs(),
        || async {
            let m = op.metric("batchlease_is_leader").await.ok().flatten();
            Ok((m == Some(0.0)).then(tokio::time::Instant::now))
        },
    )
    .await
    .unwrap()
}

/// Waits for `op` to exit on its own; returns its exit code and when.
async fn wait_exit(op: &mut Operator, within: Duration) -> (Option<i32>, tokio::time::Instant) {
    let log = op.log_path().to_owned();
    let status = wait_for(
        &format!("operator {} to exit", op.name),
        within,
        || std::fs::read_to_string(log).unwrap_or_default(),
        || {
            let s = op.exited();
            async move { Ok(s) }
        },
    )
    .await
    .unwrap();
    (status.code(), tokio::time::Instant::now())
}

/// The operator's own kill switch: a leader whose renewals fail — here the
/// namespace holding its election Lease is deleted — stops writing when its
/// term (leaseDuration − grace after the last successful renewal was sent)
/// runs out, and exits, instead of leading on beside a successor.
#[tokio::test]
async fn a_leader_whose_lease_namespace_is_deleted_steps_down_within_its_term() {
    use k8s_openapi::api::coordination::v1::Lease;
    let cluster = Cluster::with_crds().await.unwrap();
    let ns = cluster.namespace("lease-gone").await.unwrap();
    let home = cluster.namespace("lease-home").await.unwrap();
    let home_name = home.name.clone();
    // Lease 6 s, grace 2 s: a term of 4 s after each renewal's send.
    let mut op = Operator::start_with(
        &ns.name,
        "op-a",
        vec![format!("--leader-lease-namespace={home_name}")],
    )
    .unwrap();
    op.wait_leading(T).await.unwrap();
    let leases: Api<Lease> = home.api();
    home.cleanup().await.unwrap();
    wait_for(
        "the election Lease to be deleted with its namespace",
        T,
        || op.logs(),
        || {
            let leases = leases.clone();
            async move {
                Ok(leases
                    .get_opt("batchlease-operator")
                    .await?
                    .is_none()
                    .then_some(()))
            }
        },
    )
    .await
    .unwrap();
    let gone = tokio::time::Instant::now();
    let gone_at = now();
    let stopped = wait_not_leading(&op).await;
    let logs = op.logs();
    assert!(logs.contains("leadership lost"), "{logs}");
    // The last renewal that succeeded was sent before the Lease vanished:
    // the term ends at most 4 s later; allow 2 s for the metric poll.
    let took = stopped - gone;
    assert!(
        took <= Duration::from_secs(6),
        "stepped down {took:?} after its Lease vanished"
    );
    // It stands by (cannot lead: the namespace is gone) and writes nothing.
    tasks::create(&ns, "late", json!({"queue": "q"}))
        .await
        .unwrap();
    assert!(op.exited().is_none());
    let late = ns
        .api::<batchlease_api::BatchTask>()
        .get("late")
        .await
        .unwrap();
    assert!(late.status.is_none(), "a standby wrote {late:?}");
    // Its last successful renewal was sent before the Lease vanished: from
    // a term later on, the audit log shows no write of op-a at all.
    assert_no_writes(&ns.name, "op-a", gone_at + TERM, f64::MAX);
    ns.cleanup().await.unwrap();
}

/// SIGTERM while the API server is unreachable: shutdown is bounded (drain,
/// then vacate with a timeout), not stuck on requests that never answer.
#[tokio::test]
async fn sigterm_with_the_api_server_unreachable_exits_promptly() {
    use batchlease_e2e::proxy::{Proxy, apiserver_addr, proxied_kubeconfig};
    let cluster = Cluster::with_crds().await.unwrap();
    let ns = cluster.namespace("term-cut").await.unwrap();
    let proxy = Proxy::start(apiserver_addr().unwrap()).await.unwrap();
    let dir = batchlease_e2e::secrets::PrivateDir::new(&ns.name).unwrap();
    let kc = proxied_kubeconfig(&proxy, &dir).unwrap();
    // A long term (25 s) so the kill switch cannot be what ends it.
    let mut op = Operator::start_with(
        &ns.name,
        "op-a",
        vec![
            format!("--kubeconfig={}", kc.display()),
            "--leader-lease-seconds=30".into(),
            "--leader-grace-seconds=5".into(),
        ],
    )
    .unwrap();
    op.wait_leading(T).await.unwrap();
    tasks::create(&ns, "job", json!({"queue": "q", "leaseDurationSeconds": 5}))
        .await
        .unwrap();
    let leases: Api<TaskLease> = ns.api();
    let offered =
        batchlease_e2e::tasks::wait_lease(&ns, "job-1", LeasePhase::Offered, T, || op.logs())
            .await
            .unwrap();
    claim(&leases, &offered, "w").await.unwrap();
    wait_phase(&ns, "job", TaskPhase::Running, T, || op.logs())
        .await
        .unwrap();
    let log = op.log_path().to_owned();
    // The operator must have had the answer to its Running write before the
    // cut: cut while that answer is on the wire, the reconcile waits on it
    // until the term ends and no expiry is ever decided (seen once in CI).
    // A reconcile that decided after the Running write shows the answer came
    // (a task is never reconciled twice at once).
    wait_for(
        "the operator to reconcile after its Running write",
        T,
        || op.logs(),
        || {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let done = text
                .rfind("phase: Some(Running)")
                .is_some_and(|at| text[at..].contains("decision=Wait("));
            async move { Ok(done.then_some(())) }
        },
    )
    .await
    .unwrap();
    // Cut the operator off; the silent holder's expiry is then a write that
    // goes out into the void and never answers.
    proxy.cut();
    let expiries = || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .matches("Expire {")
            .count()
    };
    let before = expiries();
    wait_for(
        "an expiry write in flight",
        T,
        || op.logs(),
        || {
            let n = expiries();
            async move { Ok((n > before).then_some(())) }
        },
    )
    .await
    .unwrap();
    let sent = tokio::time::Instant::now();
    op.signal("TERM").unwrap();
    let (code, exited) = wait_exit(&mut op, T).await;
    assert_eq!(code, Some(0), "{}", op.logs());
    let took = exited - sent;
    assert!(
        took <= Duration::from_secs(10),
        "exit took {took:?} after SIGTERM"
    );
    assert!(op.logs().contains("shutting down"), "{}", op.logs());
    ns.cleanup().await.unwrap();
}
