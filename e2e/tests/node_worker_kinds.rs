//! Each worker kind through the worker chart, as its pods run under the
//! node's kubelet (read-only root filesystem, non-root, the PostgreSQL URL
//! from a Secret): `batchlease-run` wrapping a command, and the Python
//! worker image serving a queue named by the chart's `queues`. Both broke
//! there before: the runner made each attempt's directory under a `/tmp`
//! it could not write (`WorkDirFailed`, a retry spent per attempt), the
//! Python worker read `BATCHLEASE_QUEUE` and served `demo` whatever the
//! chart said. A runner whose command does not exist refuses to start
//! (its pod restarts with the reason in its log) and charges no task.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use batchlease_api::{BatchTask, TaskPhase};
use batchlease_e2e::node_world::{World, pod_name};
use batchlease_e2e::{kubectl, node, pg, tasks};
use kube::api::{Patch, PatchParams};
use serde_json::json;

/// One test at a time: each runs pods on a 2-core machine's one node.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The registered fencing token of the task with UID `uid`.
async fn registered_token(uid: &str) -> Option<i64> {
    let client = pg::connect().await.unwrap();
    client
        .query_opt(
            "SELECT last_fencing_token FROM task_state WHERE task_id = $1",
            &[&uid],
        )
        .await
        .unwrap()
        .map(|r| r.get(0))
}

#[tokio::test]
async fn the_runner_image_runs_a_command_under_the_chart_s_read_only_root() {
    if node::or_skip("the_runner_image_runs_a_command_under_the_chart").is_none() {
        return;
    }
    let _serial = SERIAL.lock().await;
    let mut w = World::new("node-run").await;
    // The runner image holds one executable: itself. `--version` is a
    // command that exits 0; what matters is the attempt's private
    // directory under the chart's /tmp and the token's registration.
    w.install_workers_of(
        "batchlease-run",
        1,
        2,
        &["extraArgs={--,/usr/local/bin/batchlease-run,--version}".into()],
    );
    w.wait_ready(1, Duration::from_secs(120)).await;
    tasks::create(
        &w.ns,
        "cmd",
        json!({"queue": "demo", "leaseDurationSeconds": 10, "maxRetries": 0}),
    )
    .await
    .unwrap();
    let t = tasks::wait_phase(
        &w.ns,
        "cmd",
        TaskPhase::Succeeded,
        Duration::from_secs(60),
        || w.diag(),
    )
    .await
    .unwrap();
    let s = t.status.as_ref().unwrap();
    // One attempt, by a pod of the chart; no retry spent.
    assert_eq!(s.attempts, 0, "{s:?}");
    assert_eq!(s.history.len(), 1, "{s:?}");
    assert!(
        s.history[0]
            .holder
            .as_deref()
            .is_some_and(|h| h.starts_with("w-batchlease-worker-")),
        "{s:?}"
    );
    let uid = t.metadata.uid.clone().unwrap();
    assert_eq!(
        registered_token(&uid).await,
        Some(s.fencing_token),
        "the attempt's token is registered in the fenced store from the chart's Secret"
    );
    w.finish().await;
}

#[tokio::test]
async fn a_runner_whose_command_is_missing_refuses_to_start_and_charges_no_task() {
    if node::or_skip("a_runner_whose_command_is_missing_refuses_to_start").is_none() {
        return;
    }
    let _serial = SERIAL.lock().await;
    let mut w = World::new("node-run-bad").await;
    tasks::create(
        &w.ns,
        "waits",
        json!({"queue": "demo", "leaseDurationSeconds": 10, "maxRetries": 0}),
    )
    .await
    .unwrap();
    w.install_workers_of(
        "batchlease-run",
        1,
        1,
        &["extraArgs={--,/usr/local/bin/no-such-tool}".into()],
    );
    // The kubelet restarts the container: the runner exited at start.
    let pod = w
        .wait_pods(
            "the runner's container restarted",
            Duration::from_secs(120),
            |ps| {
                ps.iter()
                    .find(|p| batchlease_e2e::node_world::container(p).is_some_and(|(_, n)| n >= 1))
                    .map(pod_name)
            },
        )
        .await;
    let logs = kubectl::run(&["logs", &pod, "-n", &w.ns.name, "--previous"])
        .unwrap()
        .combined();
    assert!(
        logs.contains("\"/usr/local/bin/no-such-tool\" does not exist"),
        "the reason in the log:\n{logs}\n{}",
        w.diag()
    );
    // Nothing was charged: the task was never claimed.
    let s = tasks::status(&w.ns, "waits").await.unwrap();
    assert_eq!(s.attempts, 0, "{s:?}\n{}", w.diag());
    assert!(s.history.is_empty(), "{s:?}");
    assert_eq!(s.phase, Some(TaskPhase::Ready), "offered, unclaimed: {s:?}");
    // Ended (Cancelled, final) so that the history check finds no task
    // left waiting.
    w.ns.api::<BatchTask>()
        .patch(
            "waits",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"cancel": true}})),
        )
        .await
        .unwrap();
    tasks::wait_phase(
        &w.ns,
        "waits",
        TaskPhase::Cancelled,
        Duration::from_secs(60),
        || w.diag(),
    )
    .await
    .unwrap();
    w.finish().await;
}

#[tokio::test]
async fn the_python_image_serves_the_chart_s_queue_and_commits_fenced() {
    if node::or_skip("the_python_image_serves_the_chart_s_queue").is_none() {
        return;
    }
    let _serial = SERIAL.lock().await;
    let mut w = World::new("node-py").await;
    // Not the example's default queue: the chart's BATCHLEASE_QUEUES.
    w.install_workers_of(
        "batchlease-python-worker",
        1,
        2,
        &["queues={py-etl}".into()],
    );
    w.wait_ready(1, Duration::from_secs(120)).await;
    tasks::create(
        &w.ns,
        "py",
        json!({"queue": "py-etl", "payload": {"steps": 2, "stepMillis": 50},
               "leaseDurationSeconds": 10, "maxRetries": 0}),
    )
    .await
    .unwrap();
    let t = tasks::wait_phase(
        &w.ns,
        "py",
        TaskPhase::Succeeded,
        Duration::from_secs(60),
        || w.diag(),
    )
    .await
    .unwrap();
    let s = t.status.as_ref().unwrap();
    // The example handler's sync code ran in its forkserver child (a
    // socket under the chart's /tmp) and committed through the fence.
    assert_eq!(
        s.result.as_ref().map(|r| serde_json::to_value(r).unwrap()),
        Some(json!({"steps": 2, "resumedFrom": 0, "token": s.fencing_token, "committed": true})),
        "{s:?}"
    );
    let uid = t.metadata.uid.clone().unwrap();
    let client = pg::connect().await.unwrap();
    let row = client
        .query_one(
            "SELECT token FROM python_worker_results WHERE task_uid = $1",
            &[&uid],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, i64>(0), s.fencing_token);
    w.finish().await;
}
