//! `kubectl batchlease` against the real control plane: each command's
//! text (golden, with ages masked) and JSON (parsed), and redrive's effect.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::time::Duration;

use batchlease_api::TaskPhase;
use batchlease_e2e::operator::Operator;
use batchlease_e2e::tasks::{self, wait_phase, wait_task};
use batchlease_e2e::{pg, workers};
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
            "QUEUE PENDING READY RUNNING SUCCEEDED DEADLETTERED REJECTED OLDEST READY ABORT RATE HOLDERS",
            "demo 0 0 0 2 2 0 <none> <none> <none>",
            "idle 0 1 0 0 0 0 <age> <none> <none>",
        ]),
        "{}",
        status.stdout
    );
    let json: Value =
        serde_json::from_str(&plugin(&["status", "-n", n, "-o", "json"]).stdout).unwrap();
    assert_eq!(json[0]["queue"], "demo");
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
    ns.cleanup().await.unwrap();
}
