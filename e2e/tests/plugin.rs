//! `kubectl batchlease` against the real control plane: each command's
//! text (golden, with ages masked) and JSON (parsed), and the effect of
//! redrive, cancel, pause and resume on the API objects.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::time::Duration;

use batchlease_api::{BatchTask, TaskPhase, TaskQueue};
use batchlease_e2e::Cluster;
use batchlease_e2e::operator::Operator;
use batchlease_e2e::tasks::{self, wait_phase, wait_task};
use batchlease_e2e::{pg, workers};
use kube::api::{Patch, PatchParams};
use serde_json::{Value, json};

struct Run {
    ok: bool,
    stdout: String,
    stderr: String,
}

fn plugin(args: &[&str]) -> Run {
    let bin = std::env::var("BATCHLEASE_PLUGIN_BIN")
        .expect("BATCHLEASE_PLUGIN_BIN unset: run hack/test.sh (it builds the plugin)");
    let out = Command::new(&bin).args(args).output().unwrap();
    Run {
        ok: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// The words of each line, ages (`12s`, `3m4s`, …) masked as `<age>`.
fn masked(text: &str) -> Vec<Vec<String>> {
    let age = |w: &str| {
        let w = w.trim_end_matches(['s', 'm', 'h', 'd']);
        !w.is_empty() && w.chars().all(|c| c.is_ascii_digit() || "smhd".contains(c))
    };
    text.lines()
        .map(|l| {
            l.split_whitespace()
                .map(|w| {
                    if age(w) && w.chars().any(|c| "smhd".contains(c)) {
                        "<age>".into()
                    } else {
                        w.into()
                    }
                })
                .collect()
        })
        .collect()
}

fn words(lines: &[&str]) -> Vec<Vec<String>> {
    lines
        .iter()
        .map(|l| l.split_whitespace().map(String::from).collect())
        .collect()
}

#[tokio::test]
async fn status_tree_and_redrive_against_the_cluster() {
    let (ns, op) = Operator::in_new_namespace("plugin", "op", Duration::from_secs(30))
        .await
        .unwrap();
    let n = ns.name.as_str();
    let _db = pg::connect().await.unwrap();
    let worker = workers::start_n(n, 1, 2).unwrap();
    let quick = json!({"steps": 1, "stepMillis": 10});
    let failing = json!({"steps": 1, "stepMillis": 10, "failureRate": 1.0});
    tasks::create(&ns, "ok", json!({"queue": "demo", "payload": quick}))
        .await
        .unwrap();
    tasks::create(
        &ns,
        "parent",
        json!({"queue": "demo", "dependsOn": ["ok"], "payload": quick}),
    )
    .await
    .unwrap();
    for bad in ["bad", "bad2"] {
        tasks::create(
            &ns,
            bad,
            json!({"queue": "demo", "maxRetries": 0, "payload": failing}),
        )
        .await
        .unwrap();
    }
    // No worker serves queue `idle`: its task waits Ready.
    tasks::create(&ns, "waiting", json!({"queue": "idle"}))
        .await
        .unwrap();
    let logs = || format!("{}{}", op.logs(), worker[0].logs());
    let t = Duration::from_secs(60);
    for (name, phase) in [
        ("parent", TaskPhase::Succeeded),
        ("ok", TaskPhase::Succeeded),
        ("bad", TaskPhase::DeadLettered),
        ("bad2", TaskPhase::DeadLettered),
        ("waiting", TaskPhase::Ready),
    ] {
        wait_phase(&ns, name, phase, t, logs).await.unwrap();
    }

    let status = plugin(&["status", "-n", n]);
    assert!(status.ok, "{}", status.stderr);
    assert_eq!(
        masked(&status.stdout),
        words(&[
            "QUEUE PAUSED PENDING READY RUNNING SUCCEEDED DEADLETTERED REJECTED CANCELLED OLDEST READY ABORT RATE HOLDERS",
            "demo false 0 0 0 2 2 0 0 <none> <none> <none>",
            "idle false 0 1 0 0 0 0 0 <age> <none> <none>",
        ]),
        "{}",
        status.stdout
    );
    let json: Value =
        serde_json::from_str(&plugin(&["status", "-n", n, "-o", "json"]).stdout).unwrap();
    assert_eq!(json[0]["queue"], "demo");
    assert_eq!(json[0]["paused"], false);
    assert_eq!(
        json[0]["phases"],
        json!({"Succeeded": 2, "DeadLettered": 2})
    );
    assert_eq!(json[1]["phases"], json!({"Ready": 1}));
    assert!(json[1]["oldestReadySeconds"].as_i64().is_some(), "{json}");

    let tree = plugin(&["tree", "parent", "-n", n]);
    assert!(tree.ok, "{}", tree.stderr);
    assert_eq!(
        masked(&tree.stdout),
        words(&[
            "parent Succeeded token 1 attempts 0",
            "├─ depends on",
            "│ └─ ok Succeeded",
            "└─ leases",
            "└─ parent-1 token 1 Completed (Succeeded) w1 <age>",
        ]),
        "{}",
        tree.stdout
    );
    let json: Value =
        serde_json::from_str(&plugin(&["tree", "parent", "-n", n, "-o", "json"]).stdout).unwrap();
    assert_eq!(
        json["dependsOn"],
        json!([{"name": "ok", "phase": "Succeeded"}])
    );
    assert_eq!(json["leases"][0]["holder"], "w1");
    let missing = plugin(&["tree", "nope", "-n", n]);
    assert!(
        !missing.ok
            && missing
                .stderr
                .contains(&format!("task nope not found in namespace {n}")),
        "{}",
        missing.stderr
    );

    // Redrive: refused for a task that did not fail, then every
    // dead-lettered task of the queue; the operator acts on it.
    let refused = plugin(&["redrive", "ok", "-n", n]);
    assert!(!refused.ok, "{}", refused.stdout);
    assert!(
        refused
            .stderr
            .contains("task ok is Succeeded: only DeadLettered or Rejected tasks are redriven"),
        "{}",
        refused.stderr
    );
    let redriven = plugin(&["redrive", "--queue", "demo", "--all", "-n", n]);
    assert!(redriven.ok, "{}", redriven.stderr);
    assert_eq!(
        redriven.stdout,
        "batchtask/bad redriven (spec.redrive=1)\nbatchtask/bad2 redriven (spec.redrive=1)\n"
    );
    for bad in ["bad", "bad2"] {
        wait_task(&ns, bad, "redriven and dead-lettered again", t, logs, |t| {
            t.status.as_ref().is_some_and(|s| {
                s.observed_redrive == 1 && s.phase == Some(TaskPhase::DeadLettered)
            })
        })
        .await
        .unwrap();
    }
    let one: Value =
        serde_json::from_str(&plugin(&["redrive", "bad", "-n", n, "-o", "json"]).stdout).unwrap();
    assert_eq!(one, json!([{"task": "bad", "redrive": 2}]));

    // Cancel: a name that does not exist refuses the whole command before
    // anything is written; a finished task is reported, not patched.
    let api = ns.api::<BatchTask>();
    let cancel_of = |name: &'static str| {
        let api = api.clone();
        async move { api.get(name).await.unwrap().spec.cancel }
    };
    let refused = plugin(&["cancel", "waiting", "nope", "-n", n]);
    assert!(!refused.ok, "{}", refused.stdout);
    assert!(
        refused.stderr.contains(&format!(
            "task nope not found in namespace {n}: nothing cancelled"
        )),
        "{}",
        refused.stderr
    );
    assert!(!cancel_of("waiting").await);
    let cancelled = plugin(&["cancel", "ok", "waiting", "-n", n]);
    assert!(cancelled.ok, "{}", cancelled.stderr);
    assert_eq!(
        cancelled.stdout,
        "batchtask/ok already Succeeded, nothing to cancel\nbatchtask/waiting cancel requested\n"
    );
    assert!(cancel_of("waiting").await);
    assert!(!cancel_of("ok").await);
    // The operator withdraws the offer and ends the task Cancelled.
    wait_phase(&ns, "waiting", TaskPhase::Cancelled, t, logs)
        .await
        .unwrap();
    tasks::create(&ns, "waiting2", json!({"queue": "idle"}))
        .await
        .unwrap();
    wait_phase(&ns, "waiting2", TaskPhase::Ready, t, logs)
        .await
        .unwrap();
    let queue = plugin(&["cancel", "--queue", "idle", "--all", "-n", n, "-o", "json"]);
    assert!(queue.ok, "{}", queue.stderr);
    let queue: Value = serde_json::from_str(&queue.stdout).unwrap();
    assert_eq!(
        queue,
        json!([{"name": "waiting2", "namespace": n, "action": "cancelRequested", "phase": "Ready"}])
    );
    assert!(cancel_of("waiting2").await);
    let again = plugin(&["cancel", "waiting", "-n", n, "-o", "json"]);
    assert!(again.ok, "{}", again.stderr);
    assert_eq!(
        serde_json::from_str::<Value>(&again.stdout).unwrap(),
        json!([{"name": "waiting", "namespace": n, "action": "alreadyFinished", "phase": "Cancelled"}])
    );
    wait_phase(&ns, "waiting2", TaskPhase::Cancelled, t, logs)
        .await
        .unwrap();
    let nothing = plugin(&["cancel", "--queue", "idle", "--all", "-n", n]);
    assert_eq!(
        (nothing.ok, nothing.stdout.as_str()),
        (
            true,
            format!("No unfinished tasks to cancel in namespace {n}.\n").as_str()
        ),
        "{}",
        nothing.stderr
    );
    let status: Value =
        serde_json::from_str(&plugin(&["status", "-n", n, "-o", "json"]).stdout).unwrap();
    assert_eq!(status[1]["phases"], json!({"Cancelled": 2}));
    ns.cleanup().await.unwrap();
}

/// pause, resume and status's PAUSED column: only the API objects are
/// looked at (the operator's reaction to a pause is tested with it, elsewhere).
#[tokio::test]
async fn pause_and_resume_against_the_cluster() {
    let cluster = Cluster::with_crds().await.unwrap();
    let ns = cluster.namespace("plugin-queue").await.unwrap();
    let n = ns.name.as_str();
    let queues = ns.api::<TaskQueue>();
    let list = || {
        let queues = queues.clone();
        async move {
            let mut names: Vec<(String, bool)> = queues
                .list(&Default::default())
                .await
                .unwrap()
                .items
                .into_iter()
                .map(|q| (q.metadata.name.unwrap_or_default(), q.spec.paused))
                .collect();
            names.sort();
            names
        }
    };
    let outcome = |queue: &str, paused: bool, created: bool, changed: bool| json!({"queue": queue, "namespace": n, "paused": paused, "created": created, "changed": changed});
    let json_of = |run: Run| -> Value {
        assert!(run.ok, "{}", run.stderr);
        serde_json::from_str(&run.stdout).unwrap()
    };

    // A queue without a TaskQueue is not paused: resume creates nothing.
    let resumed = plugin(&["resume", "q", "-n", n]);
    assert!(resumed.ok, "{}", resumed.stderr);
    assert_eq!(resumed.stdout, "taskqueue/q not paused (no TaskQueue)\n");
    assert_eq!(
        json_of(plugin(&["resume", "q", "-n", n, "-o", "json"])),
        outcome("q", false, false, false)
    );
    assert_eq!(list().await, vec![]);

    // pause creates the TaskQueue with spec.paused, written by the plugin.
    let paused = plugin(&["pause", "q", "-n", n]);
    assert!(paused.ok, "{}", paused.stderr);
    assert_eq!(paused.stdout, "taskqueue/q paused (TaskQueue created)\n");
    assert_eq!(list().await, vec![("q".to_owned(), true)]);
    let tq = queues.get("q").await.unwrap();
    let managers: Vec<_> = tq
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .filter_map(|m| m.manager.clone())
        .collect();
    assert_eq!(managers, vec!["kubectl-batchlease".to_owned()]);
    let again = plugin(&["pause", "q", "-n", n]);
    assert_eq!(
        again.stdout, "taskqueue/q already paused\n",
        "{}",
        again.stderr
    );
    assert_eq!(
        json_of(plugin(&["pause", "q", "-n", n, "-o", "json"])),
        outcome("q", true, false, false)
    );
    assert_eq!(
        json_of(plugin(&["pause", "later", "-n", n, "-o", "json"])),
        outcome("later", true, true, true)
    );

    // status: PAUSED per queue, and a queue with a TaskQueue but no tasks.
    for (task, queue) in [("t1", "q"), ("t2", "q"), ("t3", "other")] {
        tasks::create(&ns, task, json!({"queue": queue}))
            .await
            .unwrap();
    }
    let status = plugin(&["status", "-n", n]);
    assert!(status.ok, "{}", status.stderr);
    assert_eq!(
        masked(&status.stdout),
        words(&[
            "QUEUE PAUSED PENDING READY RUNNING SUCCEEDED DEADLETTERED REJECTED CANCELLED OLDEST READY ABORT RATE HOLDERS",
            "later true 0 0 0 0 0 0 0 <none> <none> <none>",
            "other false 1 0 0 0 0 0 0 <none> <none> <none>",
            "q true 2 0 0 0 0 0 0 <none> <none> <none>",
        ]),
        "{}",
        status.stdout
    );
    let status = json_of(plugin(&["status", "-n", n, "-o", "json"]));
    let paused: Vec<(&str, bool)> = status
        .as_array()
        .unwrap()
        .iter()
        .map(|q| (q["queue"].as_str().unwrap(), q["paused"].as_bool().unwrap()))
        .collect();
    assert_eq!(paused, [("later", true), ("other", false), ("q", true)]);

    // resume writes spec.paused only: a field another writer set stays.
    queues
        .patch(
            "q",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"maxConcurrent": 3}})),
        )
        .await
        .unwrap();
    let resumed = plugin(&["resume", "q", "-n", n]);
    assert!(resumed.ok, "{}", resumed.stderr);
    assert_eq!(resumed.stdout, "taskqueue/q resumed\n");
    let tq = queues.get("q").await.unwrap();
    assert_eq!((tq.spec.paused, tq.spec.max_concurrent), (false, Some(3)));
    let again = plugin(&["resume", "q", "-n", n]);
    assert_eq!(again.stdout, "taskqueue/q not paused\n", "{}", again.stderr);
    assert_eq!(
        json_of(plugin(&["resume", "later", "-n", n, "-o", "json"])),
        outcome("later", false, false, true)
    );
    assert_eq!(
        list().await,
        vec![("later".to_owned(), false), ("q".to_owned(), false)]
    );

    // Not a queue name: refused before anything is written.
    let bad = plugin(&["pause", "Bad_Name", "-n", n]);
    assert!(!bad.ok, "{}", bad.stdout);
    assert!(
        bad.stderr.contains("\"Bad_Name\" is not a queue name"),
        "{}",
        bad.stderr
    );
    assert_eq!(list().await.len(), 2);

    // One namespace at a time.
    let everywhere = plugin(&["pause", "q", "-A"]);
    assert!(!everywhere.ok, "{}", everywhere.stdout);
    assert!(
        everywhere
            .stderr
            .contains("pause acts in one namespace: use -n"),
        "{}",
        everywhere.stderr
    );
    ns.cleanup().await.unwrap();
}
