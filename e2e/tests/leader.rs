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

/// A replica whose leader Lease is taken over stops writing and exits (so
/// its Deployment restarts it as a standby); its successor carries on.
#[tokio::test]
async fn deposed_leader_exits() {
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
    let log = a.log_path().to_owned();
    let status = wait_for(
        "deposed op-a to exit",
        T,
        || std::fs::read_to_string(log).unwrap_or_default(),
        || {
            let s = a.exited();
            async move { Ok(s) }
        },
    )
    .await
    .unwrap();
    assert_eq!(status.code(), Some(1), "{}", a.logs());
    assert!(a.logs().contains("leadership lost"), "{}", a.logs());

    // Nothing of op-a writes any more: a new task stays untouched until a
    // new replica leads (the intruder's lease runs out after 60 s, so
    // vacate it the way its owner would).
    tasks::create(&ns, "job", json!({"queue": "q"}))
        .await
        .unwrap();
    let untouched = ns
        .api::<batchlease_api::BatchTask>()
        .get("job")
        .await
        .unwrap();
    assert!(untouched.status.is_none());
    ns.api::<Lease>()
        .patch(
            "batchlease-operator",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"holderIdentity": null}})),
        )
        .await
        .unwrap();
    let b = Operator::start(&ns.name, "op-b").unwrap();
    b.wait_leading(T).await.unwrap();
    wait_phase(&ns, "job", TaskPhase::Ready, T, || b.logs())
        .await
        .unwrap();
    ns.cleanup().await.unwrap();
}
