//! `TaskQueue` (design §9): pause withdraws unclaimed offers and lets held
//! leases finish, resume runs the rest; `maxConcurrent` bounds the leases
//! Offered or Held at once (audited over the whole recorded lease watch);
//! `maxIssuesPerSecond` bounds the issue rate (measured from the audit log).
//! Real operator and demo workers; each namespace's history is checked at
//! the end.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use batchlease_api::{BatchTask, LeasePhase, TaskLease, TaskPhase, TaskQueue};
use batchlease_e2e::cluster::TestNamespace;
use batchlease_e2e::history::{Change, Recorded};
use batchlease_e2e::history_controls::{issue_times, max_live};
use batchlease_e2e::operator::Operator;
use batchlease_e2e::tasks::{self, lease_phase, phase_of};
use batchlease_e2e::wait::wait_for;
use batchlease_e2e::workers;
use kube::api::{ListParams, Patch, PatchParams};
use serde_json::json;

async fn create_queue(ns: &TestNamespace, name: &str, spec: serde_json::Value) {
    tasks::create_queue(ns, name, spec).await.unwrap();
}

async fn set_paused(ns: &TestNamespace, name: &str, paused: bool) -> i64 {
    let q = ns
        .api::<TaskQueue>()
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"paused": paused}})),
        )
        .await
        .unwrap();
    q.metadata.generation.unwrap()
}

async fn phases(ns: &TestNamespace) -> Vec<Option<TaskPhase>> {
    ns.api::<BatchTask>()
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(phase_of)
        .collect()
}

fn count(p: &[Option<TaskPhase>], phase: TaskPhase) -> usize {
    p.iter().filter(|x| **x == Some(phase)).count()
}

async fn leases_in(ns: &TestNamespace, phase: LeasePhase) -> Vec<TaskLease> {
    ns.api::<TaskLease>()
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|l| lease_phase(l) == Some(phase))
        .collect()
}

async fn all_succeed(ns: &TestNamespace, n: usize, logs: impl FnOnce() -> String) {
    wait_for(
        "every task to succeed",
        Duration::from_secs(120),
        logs,
        || async {
            let p = phases(ns).await;
            Ok((count(&p, TaskPhase::Succeeded) == n).then_some(()))
        },
    )
    .await
    .unwrap();
}

fn held_after(leases: &[Recorded], t: f64) -> Vec<String> {
    leases
        .iter()
        .filter(|r| r.at > t)
        .filter_map(|r| match &r.change {
            Change::Lease(l) if lease_phase(l) == Some(LeasePhase::Held) => {
                Some(kube::ResourceExt::name_any(&**l))
            }
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn pause_withdraws_offers_lets_held_leases_finish_and_resume_runs_the_rest() {
    let (ns, op) = Operator::in_new_namespace("queue-pause", "op", Duration::from_secs(30))
        .await
        .unwrap();
    create_queue(&ns, "demo", json!({})).await;
    // Two workers of one slot, 20 tasks of 3 s: two held, 18 offered.
    let worker = workers::start_n(&ns.name, 2, 1).unwrap();
    for i in 0..20 {
        tasks::create(
            &ns,
            &format!("t{i:02}"),
            json!({"queue": "demo", "payload": {"steps": 30, "stepMillis": 100}}),
        )
        .await
        .unwrap();
    }
    let logs = || format!("{}{}{}", op.logs(), worker[0].logs(), worker[1].logs());
    wait_for(
        "two tasks held, the other 18 offered",
        Duration::from_secs(60),
        logs,
        || async {
            let p = phases(&ns).await;
            Ok(
                (count(&p, TaskPhase::Running) + leases_in(&ns, LeasePhase::Held).await.len() >= 2
                    && count(&p, TaskPhase::Ready) >= 15)
                    .then_some(()),
            )
        },
    )
    .await
    .unwrap();
    // Per-queue metrics, from the operator's caches at scrape time.
    let (_, body) = op.get("/metrics").await.unwrap();
    assert!(
        body.contains(&format!(
            "\nbatchlease_queue_leases_held{{namespace=\"{}\",queue=\"demo\"}}",
            ns.name
        )),
        "{body}"
    );
    assert!(
        body.contains(&format!(
            "\nbatchlease_queue_oldest_ready_seconds{{namespace=\"{}\",queue=\"demo\"}}",
            ns.name
        )),
        "{body}"
    );
    let generation = set_paused(&ns, "demo", true).await;
    // Every unclaimed offer is withdrawn; the queue says it is paused.
    wait_for(
        "no lease Offered and the TaskQueue's Paused condition",
        Duration::from_secs(30),
        logs,
        || async {
            let offered = leases_in(&ns, LeasePhase::Offered).await;
            let q = ns.api::<TaskQueue>().get("demo").await?;
            let st = q.status.unwrap_or_default();
            let paused = st.conditions.iter().any(|c| {
                c.type_ == "Paused"
                    && c.status == "True"
                    && c.observed_generation == Some(generation)
            });
            Ok((offered.is_empty() && paused).then_some(()))
        },
    )
    .await
    .unwrap();
    let (recorded, _) = ns.recorded().await.unwrap();
    let paused_at = recorded.last().map_or(0.0, |r| r.at);
    let held_at_pause = leases_in(&ns, LeasePhase::Held).await.len();
    // The held leases run to their end; nothing new is offered or claimed.
    let succeeded = wait_for(
        "the held tasks to finish and the rest to wait Pending",
        Duration::from_secs(60),
        logs,
        || async {
            let p = phases(&ns).await;
            let busy = count(&p, TaskPhase::Running) + count(&p, TaskPhase::Ready);
            let q = ns.api::<TaskQueue>().get("demo").await?;
            let st = q.status.unwrap_or_default();
            let done = count(&p, TaskPhase::Succeeded);
            Ok((busy == 0
                && leases_in(&ns, LeasePhase::Held).await.is_empty()
                && st.tasks.succeeded == done as i64
                && st.tasks.pending == (20 - done) as i64
                && st.throttled.paused >= 1)
                .then_some(done))
        },
    )
    .await
    .unwrap();
    assert!(
        succeeded >= held_at_pause && succeeded < 20,
        "{succeeded} succeeded, {held_at_pause} held at the pause"
    );
    let (recorded, _) = ns.recorded().await.unwrap();
    let claimed = held_after(&recorded, paused_at);
    assert!(claimed.is_empty(), "claimed while paused: {claimed:?}");
    let offered_after: Vec<f64> = issue_times(&recorded, "demo")
        .into_iter()
        .filter(|t| *t > paused_at)
        .collect();
    assert!(
        offered_after.is_empty(),
        "offered while paused at {offered_after:?}"
    );
    // The printer columns show it.
    let row =
        batchlease_e2e::kubectl::ok(&["get", "taskqueue", "demo", "-n", &ns.name, "--no-headers"])
            .unwrap();
    assert!(row.starts_with("demo"), "{row}");
    assert!(row.contains("true"), "PAUSED column: {row}");

    set_paused(&ns, "demo", false).await;
    all_succeed(&ns, 20, logs).await;
    let st = ns
        .api::<TaskQueue>()
        .get("demo")
        .await
        .unwrap()
        .status
        .unwrap_or_default();
    eprintln!("queue status after resume: {st:?}");
    ns.finish().await.unwrap();
}

#[tokio::test]
async fn max_concurrent_bounds_the_live_leases_over_the_whole_run() {
    let (ns, op) = Operator::in_new_namespace("queue-cap", "op", Duration::from_secs(30))
        .await
        .unwrap();
    create_queue(&ns, "demo", json!({"maxConcurrent": 2})).await;
    // Four workers of two slots: eight could run at once.
    let worker = workers::start_n(&ns.name, 4, 2).unwrap();
    for i in 0..16 {
        tasks::create(
            &ns,
            &format!("c{i:02}"),
            json!({"queue": "demo", "payload": {"steps": 4, "stepMillis": 100}}),
        )
        .await
        .unwrap();
    }
    let logs = || {
        let mut s = op.logs();
        for w in &worker {
            s.push_str(&w.logs());
        }
        s
    };
    all_succeed(&ns, 16, logs).await;
    let (recorded, _) = ns.recorded().await.unwrap();
    let max = max_live(&recorded, "demo");
    eprintln!("most leases Offered or Held at once: {max}");
    assert_eq!(max, 2, "the cap is reached and never exceeded");
    // The queue's status counted the throttling and the workers.
    let st = wait_for(
        "the queue status to show the run",
        Duration::from_secs(15),
        logs,
        || async {
            let st = ns
                .api::<TaskQueue>()
                .get("demo")
                .await?
                .status
                .unwrap_or_default();
            Ok((st.tasks.succeeded == 16).then_some(st))
        },
    )
    .await
    .unwrap();
    assert!(st.throttled.max_concurrent >= 1, "{st:?}");
    assert!(
        st.conditions.iter().any(|c| c.type_ == "AtCapacity"),
        "{st:?}"
    );
    let (_, body) = op.get("/metrics").await.unwrap();
    assert!(
        body.contains(
            &format!("batchlease_queue_issues_throttled_total{{namespace=\"{}\",queue=\"demo\",reason=\"max_concurrent\"}}", ns.name)
        ),
        "{body}"
    );
    ns.finish().await.unwrap();
}

#[tokio::test]
async fn max_issues_per_second_bounds_the_issue_rate() {
    const RATE: f64 = 4.0;
    const N: usize = 24;
    let (ns, op) = Operator::in_new_namespace("queue-rate", "op", Duration::from_secs(30))
        .await
        .unwrap();
    create_queue(&ns, "demo", json!({"maxIssuesPerSecond": 4})).await;
    // No worker: every issue stays Offered; only the issue times matter.
    for i in 0..N {
        tasks::create(&ns, &format!("r{i:02}"), json!({"queue": "demo"}))
            .await
            .unwrap();
    }
    let logs = || op.logs();
    wait_for(
        "every task offered",
        Duration::from_secs(60),
        logs,
        || async {
            let p = phases(&ns).await;
            Ok((count(&p, TaskPhase::Ready) == N).then_some(()))
        },
    )
    .await
    .unwrap();
    // When the API server received each lease create (its audit log): the
    // watch's delivery times bunch up on a loaded machine. A write still
    // reaches the server some time after the bucket let it go; JITTER allows
    // for that. A missing or doubled limiter still fails: unthrottled, all 24
    // land within a second; at twice the rate, in 2.4 s.
    const JITTER: f64 = 0.5;
    let times = wait_for(
        "every lease create in the audit log",
        Duration::from_secs(30),
        logs,
        || async {
            let mut t: Vec<f64> = batchlease_e2e::audit::writes_in(&ns.name)?
                .into_iter()
                .filter(|w| w.verb == "create" && w.resource == "taskleases")
                .map(|w| w.received)
                .collect();
            t.sort_by(f64::total_cmp);
            Ok((t.len() >= N).then_some(t))
        },
    )
    .await
    .unwrap();
    assert_eq!(times.len(), N, "{times:?}");
    // A bucket of one second's worth (4) then 4 per second: the last issue
    // comes at least (N - 5) / 4 s after the first.
    let span = times[N - 1] - times[0];
    let rate = (N - 1 - 4) as f64 / span;
    eprintln!("{N} issues over {span:.2} s: {rate:.2}/s beyond the burst (limit {RATE}/s)");
    let first = times[0];
    let rel: Vec<String> = times.iter().map(|t| format!("{:.3}", t - first)).collect();
    assert!(
        span >= (N - 1 - 4) as f64 / RATE - JITTER,
        "issued at {rate:.2}/s, above {RATE}/s: {rel:?}"
    );
    assert!(
        rate >= RATE * 0.5,
        "issued at only {rate:.2}/s: throttled too hard: {rel:?}"
    );
    // No one-second window holds more than the burst plus the rate (and
    // what the jitter can push into it).
    for (i, t) in times.iter().enumerate() {
        let in_window = times[i..].iter().take_while(|u| **u < t + 1.0).count();
        assert!(
            in_window as f64 <= 4.0 + RATE * (1.0 + JITTER),
            "{in_window} issues within 1 s from {:.3}: {rel:?}",
            t - first
        );
    }
    let (_, body) = op.get("/metrics").await.unwrap();
    assert!(
        body.contains(&format!("batchlease_queue_issues_throttled_total{{namespace=\"{}\",queue=\"demo\",reason=\"rate\"}}", ns.name)),
        "{body}"
    );
    // Pausing now withdraws all 24 offers; the tasks wait, no retry spent.
    set_paused(&ns, "demo", true).await;
    wait_for(
        "every offer withdrawn",
        Duration::from_secs(30),
        logs,
        || async {
            let p = phases(&ns).await;
            Ok((count(&p, TaskPhase::Pending) == N
                && leases_in(&ns, LeasePhase::Offered).await.is_empty())
            .then_some(()))
        },
    )
    .await
    .unwrap();
    let t = ns.api::<BatchTask>().get("r00").await.unwrap();
    assert_eq!(t.status.unwrap().attempts, 0);
    ns.cleanup().await.unwrap();
}
