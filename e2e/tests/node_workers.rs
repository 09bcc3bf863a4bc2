//! Workers as Kubernetes deploys them, on the node of `e2e/node/up.sh`:
//! the worker chart's Deployment (hostNetwork, several replicas on one
//! node with metrics off, the PostgreSQL URL from a Secret, pod-bound
//! tokens under the holder-only policy), with the operator as a harness
//! process on the operator chart's ServiceAccount. A `kubectl rollout
//! restart` while 200 tasks run gives every interrupted attempt back
//! (`Interrupted`, no retry spent, none expired); a pod deleted with
//! `--grace-period=0 --force` and a worker process SIGKILLed under the
//! kubelet (which restarts it) leave their leases to expire, and the tasks
//! get their next lease within TTL + 1 s of the old leases' last renewal —
//! of the kill itself for the SIGKILL; the force-deleted pod's worker
//! still renews during the kubelet's minimum grace (2 s), so from its
//! delete, TTL + 3 s.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use batchlease_api::{BatchTask, TaskPhase};
use batchlease_e2e::node_world::{DEPLOYMENT, World, container, holder_pod, now, pod_name, ready};
use batchlease_e2e::tasks::{self, phase_of};
use batchlease_e2e::{TestNamespace, kubectl, node, wait_for};
use k8s_openapi::api::core::v1::Pod;
use serde_json::json;

/// One test at a time in this binary: each runs a few pods and up to 200
/// tasks on a 2-core machine, and measures how quickly leases move.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Creates tasks `t-000`… with `payload` and `extra` spec fields.
async fn create_tasks(ns: &TestNamespace, n: usize, payload: serde_json::Value, lease_ttl: i32) {
    for i in 0..n {
        tasks::create(
            ns,
            &format!("t-{i:03}"),
            json!({"queue": "demo", "payload": payload, "leaseDurationSeconds": lease_ttl}),
        )
        .await
        .unwrap();
    }
}

/// The kubelet's minimum grace period: what a pod deleted with
/// `--grace-period=0 --force` still gets between SIGTERM and SIGKILL.
const KILL_GRACE: f64 = 2.0;

/// "after 6.8, 6.9 s from the fault (6.1, 6.0 s from the last renewal)".
fn figures(after: &BTreeMap<String, (f64, f64)>) -> String {
    let list = |f: fn(&(f64, f64)) -> f64| {
        after
            .values()
            .map(|v| format!("{:.1}", f(v)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        "after {} s from the fault ({} s from the old leases' last renewal)",
        list(|v| v.0),
        list(|v| v.1)
    )
}

fn outcomes(t: &BatchTask) -> Vec<(String, String)> {
    t.status
        .as_ref()
        .map(|s| {
            s.history
                .iter()
                .map(|h| (h.outcome.clone(), h.holder.clone().unwrap_or_default()))
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test]
async fn a_rollout_restart_gives_every_running_attempt_back_and_spends_no_retry() {
    if node::or_skip("a_rollout_restart_gives_every_running_attempt_back").is_none() {
        return;
    }
    let _serial = SERIAL.lock().await;
    let mut w = World::new("node-roll").await;
    // Three pods of four slots; a short drain grace (1 s: most 4-second
    // handlers are still running when it ends) so that the rollout
    // interrupts attempts, which the workers then give back.
    w.install_workers(
        3,
        4,
        &[
            "drainGraceSeconds=1".into(),
            "terminationGracePeriodSeconds=6".into(),
        ],
    );
    let old: BTreeSet<String> = w
        .wait_ready(3, Duration::from_secs(120))
        .await
        .into_iter()
        .collect();
    let started = Instant::now();
    create_tasks(&w.ns, 200, json!({"steps": 8, "stepMillis": 500}), 30).await;
    eprintln!(
        "200 tasks created in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    // Every slot busy and some tasks done: the workers run.
    wait_for(
        "all 12 slots running and 10 tasks done",
        Duration::from_secs(120),
        || w.diag(),
        || async {
            let ts = w.tasks().await?;
            let count = |p| ts.iter().filter(|t| phase_of(t) == Some(p)).count();
            Ok(
                (count(TaskPhase::Running) >= 12 && count(TaskPhase::Succeeded) >= 10)
                    .then_some(()),
            )
        },
    )
    .await
    .unwrap();

    let restart = Instant::now();
    kubectl::ok(&[
        "rollout",
        "restart",
        &format!("deployment/{DEPLOYMENT}"),
        "-n",
        &w.ns.name,
    ])
    .unwrap();
    // The Deployment's surge: one new pod up, one old pod drained, …
    let new = w
        .wait_pods(
            "the rollout: three new pods Ready, the old ones gone",
            Duration::from_secs(180),
            |ps| {
                let names: BTreeSet<String> = ps.iter().map(pod_name).collect();
                (ps.len() == 3 && ps.iter().all(ready) && names.is_disjoint(&old)).then_some(names)
            },
        )
        .await;
    let rollout = restart.elapsed().as_secs_f64();
    let succeeded = w.wait_all_succeeded(Duration::from_secs(300)).await;
    let total = started.elapsed().as_secs_f64();

    // No retry spent, no attempt expired: every attempt that did not
    // succeed was given back (Interrupted) by a pod the rollout ended.
    let mut interrupted = 0;
    let mut by_new = 0;
    for t in &succeeded {
        let name = t.metadata.name.as_deref().unwrap();
        let status = t.status.as_ref().unwrap();
        assert_eq!(status.attempts, 0, "{name} spent a retry: {status:?}");
        for (outcome, holder) in outcomes(t) {
            match outcome.as_str() {
                "Succeeded" => by_new += usize::from(new.contains(holder_pod(&holder))),
                "Interrupted" => {
                    interrupted += 1;
                    assert!(
                        old.contains(holder_pod(&holder)),
                        "{name}: an attempt of {holder}, not a pod the rollout ended, was interrupted: {status:?}"
                    );
                }
                other => panic!("{name}: attempt of {holder} ended {other}: {status:?}"),
            }
        }
    }
    let events = kubectl::ok(&[
        "get",
        "events",
        "-n",
        &w.ns.name,
        "-o",
        "jsonpath={range .items[*]}{.reason}{\"\\n\"}{end}",
    ])
    .unwrap();
    let reasons: BTreeSet<&str> = events.lines().collect();
    assert!(
        !reasons.contains("LeaseExpired"),
        "a lease expired: {reasons:?}"
    );
    assert!(
        interrupted > 0,
        "the rollout interrupted no attempt: nothing was tested"
    );
    assert!(by_new > 0, "the new pods completed nothing");
    eprintln!(
        "rollout restart of 3 worker pods (4 slots each; drain grace 1 s, pod grace 6 s) while \
         200 tasks of 4 s ran: new pods Ready, old gone after {rollout:.1} s; {interrupted} \
         attempts given back Interrupted, 0 expired, 0 retries spent; {by_new} tasks completed \
         by the new pods; all 200 Succeeded {total:.1} s after the first was created"
    );
    w.finish().await;
}

#[tokio::test]
async fn a_force_deleted_pod_and_a_killed_container_lose_their_leases_within_the_ttl() {
    if node::or_skip("a_force_deleted_pod_and_a_killed_container").is_none() {
        return;
    }
    let _serial = SERIAL.lock().await;
    const TTL: f64 = 6.0;
    let mut w = World::new("node-kill").await;
    w.install_workers(2, 4, &[]);
    let pods = w.wait_ready(2, Duration::from_secs(120)).await;
    // Eight 30-second tasks for eight slots: each pod holds four, and
    // they outlast both faults.
    create_tasks(
        &w.ns,
        8,
        json!({"steps": 60, "stepMillis": 500}),
        TTL as i32,
    )
    .await;
    wait_for(
        "eight tasks Running, four on each pod",
        Duration::from_secs(120),
        || w.diag(),
        || async {
            let ts = w.tasks().await?;
            let mut per_pod: BTreeMap<String, usize> = BTreeMap::new();
            for t in &ts {
                let s = t.status.as_ref();
                if s.and_then(|s| s.phase) == Some(TaskPhase::Running)
                    && let Some(h) = s.and_then(|s| s.holder.as_deref())
                {
                    *per_pod.entry(holder_pod(h).to_owned()).or_default() += 1;
                }
            }
            Ok((pods.iter().all(|p| per_pod.get(p) == Some(&4))).then_some(()))
        },
    )
    .await
    .unwrap();

    // 1. `kubectl delete pod --grace-period=0 --force`: the object goes at
    // once; the kubelet then stops the container (its minimum grace, 2 s,
    // is less than the drain grace: no give-back).
    let victim = pods[0].clone();
    let held = w.held_by(&victim).await;
    assert_eq!(held.len(), 4, "{held:?}");
    let deleted = now();
    kubectl::ok(&[
        "delete",
        "pod",
        &victim,
        "-n",
        &w.ns.name,
        "--grace-period=0",
        "--force",
    ])
    .unwrap();
    let after = w
        .reassigned_after(&held, deleted, Duration::from_secs(60))
        .await;
    eprintln!(
        "force-deleted pod {victim}: its 4 tasks' next leases {} (TTL {TTL} s)",
        figures(&after)
    );
    // The bound is the TTL from the last renewal. The kubelet stops a
    // force-deleted pod's containers with its minimum grace, 2 s (SIGTERM,
    // then SIGKILL), and a draining worker renews until it dies: so from
    // the delete, TTL + that grace.
    for (task, (from_delete, from_renewal)) in &after {
        assert!(
            *from_renewal <= TTL + 1.0 && *from_delete <= TTL + KILL_GRACE + 1.0,
            "{task} of the force-deleted pod waited too long for its next lease: {after:?}{}",
            w.foreign_denials()
        );
    }
    // The Deployment replaces the pod.
    w.wait_ready(2, Duration::from_secs(120)).await;

    // 2. SIGKILL of the worker process under the kubelet (the container's
    // init, found through containerd): the kubelet restarts the container.
    let target = pods[1].clone();
    let pod = w.ns.api::<Pod>().get(&target).await.unwrap();
    let (id, restarts) = container(&pod).expect("the worker container's id");
    let pid = node::ctr(&["tasks", "ls"])
        .unwrap()
        .lines()
        .find_map(|l| {
            let mut f = l.split_whitespace();
            (f.next() == Some(id.as_str())).then(|| f.next().unwrap().to_owned())
        })
        .unwrap_or_else(|| panic!("containerd runs no task {id}"));
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap();
    assert!(
        comm.trim().starts_with("batchlease-demo"),
        "pid {pid} is {comm:?}"
    );
    let held = w.held_by(&target).await;
    assert_eq!(held.len(), 4, "{held:?}");
    let killed = now();
    let out = std::process::Command::new("kill")
        .args(["-KILL", &pid])
        .output()
        .unwrap();
    assert!(out.status.success(), "kill -KILL {pid}: {out:?}");
    let after = w
        .reassigned_after(&held, killed, Duration::from_secs(60))
        .await;
    let restarted = w
        .wait_pods(
            &format!("{target} restarted by the kubelet, Ready again"),
            Duration::from_secs(120),
            |ps| {
                let p = ps.iter().find(|p| pod_name(p) == target)?;
                let (new_id, n) = container(p)?;
                (n > restarts && new_id != id && ready(p)).then_some(n)
            },
        )
        .await;
    eprintln!(
        "SIGKILLed worker of {target} (pid {pid}): its 4 tasks' next leases {} (TTL {TTL} s); \
         restartCount {restarts} → {restarted}",
        figures(&after)
    );
    // No grace at all: from the kill, the TTL.
    for (task, (from_kill, from_renewal)) in &after {
        assert!(
            *from_kill <= TTL + 1.0 && *from_renewal <= TTL + 1.0,
            "{task} of the killed worker waited too long for its next lease: {after:?}{}",
            w.foreign_denials()
        );
    }

    // Every task ends Succeeded; the faulted attempts expired (the killed
    // processes gave nothing back).
    let done = w.wait_all_succeeded(Duration::from_secs(180)).await;
    let mut expired = 0;
    for t in &done {
        for (outcome, holder) in outcomes(t) {
            if outcome == "Expired" {
                expired += 1;
                let pod = holder_pod(&holder);
                assert!(pod == victim || pod == target, "{holder} expired: {t:?}");
            }
        }
    }
    eprintln!("attempts expired: {expired} (8 held by the two faulted pods)");
    w.finish().await;
}
