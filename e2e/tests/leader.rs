//! Two operator replicas: the leader is killed mid-run, the standby takes
//! over, every task completes, tokens strictly increase per task, and no
//! task ever has two `Held` leases at once (checked from a watch over the
//! whole run).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use batchlease_api::{LeaseOutcome, LeasePhase, TaskLease, TaskPhase};
use batchlease_e2e::operator::Operator;
use batchlease_e2e::tasks::{self, lease_phase, phase_of, wait_phase};
use batchlease_e2e::worker::{claim, complete, renew};
use batchlease_e2e::{Cluster, wait_for};
use futures::{StreamExt, TryStreamExt};
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::json;

const T: Duration = Duration::from_secs(60);

/// Everything the lease watch saw, checked as it arrives.
#[derive(Default, Debug)]
struct Audit {
    /// lease → (task, last phase seen).
    phase: BTreeMap<String, (String, LeasePhase)>,
    /// task → tokens in the order their leases first appeared.
    tokens: BTreeMap<String, Vec<i64>>,
    violations: Vec<String>,
}

impl Audit {
    fn see(&mut self, l: &TaskLease) {
        let name = l.name_any();
        let task = l.spec.task_name.clone();
        if !self.phase.contains_key(&name) {
            let seq = self.tokens.entry(task.clone()).or_default();
            if seq.last().is_some_and(|last| *last >= l.spec.fencing_token) {
                self.violations.push(format!(
                    "{task}: token {} after {seq:?}",
                    l.spec.fencing_token
                ));
            }
            seq.push(l.spec.fencing_token);
        }
        self.phase.insert(
            name,
            (task.clone(), lease_phase(l).unwrap_or(LeasePhase::Offered)),
        );
        let held: Vec<&String> = self
            .phase
            .iter()
            .filter(|(_, (t, p))| *p == LeasePhase::Held && *t == task)
            .map(|(n, _)| n)
            .collect();
        if held.len() > 1 {
            self.violations
                .push(format!("{task}: two Held leases at once: {held:?}"));
        }
    }
}

/// A worker of queue `q` driven by the lease watch: claims every Offered
/// lease of its queue, renews once, completes it.
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
    let audit = Arc::new(Mutex::new(Audit::default()));
    let auditor = {
        let (audit, api) = (audit.clone(), leases.clone());
        tokio::spawn(async move {
            let stream = watcher(api, watcher::Config::default()).applied_objects();
            futures::pin_mut!(stream);
            while let Some(Ok(l)) = stream.next().await {
                audit.lock().unwrap().see(&l);
            }
        })
    };
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
    // Hold one lease across the failover, renewing as a worker would.
    tasks::create(
        &ns,
        "held",
        json!({"queue": "manual", "leaseDurationSeconds": 6}),
    )
    .await
    .unwrap();
    let offered =
        batchlease_e2e::tasks::wait_lease(&ns, "held-1", LeasePhase::Offered, T, || a.logs())
            .await
            .unwrap();
    let mut held = claim(&leases, &offered, "steady").await.unwrap();

    a.kill();
    for n in &names[4..] {
        tasks::create(&ns, n, json!({"queue": "q", "leaseDurationSeconds": 5}))
            .await
            .unwrap();
    }
    // Renew "held" every 2 s (TTL/3) until the standby leads and beyond a TTL.
    let mut tick = tokio::time::interval(Duration::from_secs(2));
    let mut renewals_after_takeover = 0;
    while renewals_after_takeover < 4 {
        tick.tick().await;
        held = renew(&leases, &held)
            .await
            .expect("a renewed lease was expired across the failover");
        if b.metric("batchlease_is_leader").await.ok().flatten() == Some(1.0) {
            renewals_after_takeover += 1;
        }
    }
    complete(&leases, &held, LeaseOutcome::Succeeded, None, None)
        .await
        .unwrap();

    for n in names.iter().chain(std::iter::once(&"held".to_owned())) {
        wait_phase(&ns, n, TaskPhase::Succeeded, T, || b.logs())
            .await
            .unwrap();
    }
    let all = ns
        .api::<batchlease_api::BatchTask>()
        .list(&Default::default())
        .await
        .unwrap();
    assert!(
        all.items
            .iter()
            .all(|t| phase_of(t) == Some(TaskPhase::Succeeded))
    );
    let held_task = all.items.iter().find(|t| t.name_any() == "held").unwrap();
    assert_eq!(
        held_task.status.as_ref().unwrap().fencing_token,
        1,
        "the held lease survived the failover"
    );

    work.abort();
    auditor.abort();
    {
        let audit = audit.lock().unwrap();
        assert!(
            audit.violations.is_empty(),
            "{:?}\n{}",
            audit.violations,
            b.logs()
        );
        let tasks_seen: BTreeSet<&String> = audit.tokens.keys().collect();
        assert_eq!(tasks_seen.len(), 9, "{audit:?}");
    }
    ns.cleanup().await.unwrap();
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
    let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
    let patch = json!({"spec": {"holderIdentity": "intruder", "acquireTime": now, "renewTime": now,
                                "leaseDurationSeconds": 60}});
    ns.api::<Lease>()
        .patch(
            "batchlease-operator",
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
        .unwrap();
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
    ns.cleanup().await.unwrap();
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
    let dir = std::env::temp_dir().join(format!("batchlease-e2e-{}", ns.name));
    std::fs::create_dir_all(&dir).unwrap();
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
    // Cut the operator off; the silent holder's expiry is then a write that
    // goes out into the void and never answers.
    proxy.cut();
    let log = op.log_path().to_owned();
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
