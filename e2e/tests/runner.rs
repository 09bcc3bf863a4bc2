//! `batchlease-run`: shell commands as tasks, end to end — the task in the
//! child's environment and files, its result file as the task's result, a
//! checkpoint file handed to the next attempt, exit codes as outcomes, the
//! kill switch stopping the child's whole process group within the grace,
//! and a drain giving the attempt back after forwarding SIGTERM.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use batchlease_api::TaskPhase;
use batchlease_e2e::operator::Operator;
use batchlease_e2e::process::Process;
use batchlease_e2e::runner::{self, RunnerOpts};
use batchlease_e2e::tasks::{self, wait_holder, wait_phase, wait_task};
use batchlease_e2e::wait_for;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(60);

fn result_of(t: &batchlease_api::BatchTask) -> Value {
    serde_json::to_value(&t.status.as_ref().unwrap().result).unwrap()
}

/// A fresh directory the children write their marks into (inherited
/// through the runner's environment as `MARK_DIR`).
fn mark_dir(ns: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("batchlease-e2e-{ns}/marks"));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn with_marks(dir: &Path) -> RunnerOpts {
    RunnerOpts {
        env: vec![("MARK_DIR".into(), dir.display().to_string())],
        ..Default::default()
    }
}

async fn wait_file(path: &Path, logs: impl FnOnce() -> String) -> String {
    let p = path.to_owned();
    wait_for(&format!("file {}", path.display()), WAIT, logs, || {
        let p = p.clone();
        async move { Ok(std::fs::read_to_string(&p).ok()) }
    })
    .await
    .unwrap()
}

/// The script's environment, payload and result file, as the task's result.
#[tokio::test]
async fn a_shell_task_succeeds_with_its_result_file_as_result() {
    let (ns, op) = Operator::in_new_namespace("run-ok", "op", WAIT)
        .await
        .unwrap();
    let script = r#"set -eu
echo "hello from $BATCHLEASE_TASK_NAME"
echo "to stderr" >&2
cat > "$BATCHLEASE_RESULT_FILE" <<EOF
{"ns": "$BATCHLEASE_TASK_NAMESPACE", "name": "$BATCHLEASE_TASK_NAME",
 "uid": "$BATCHLEASE_TASK_UID", "attempt": $BATCHLEASE_ATTEMPT,
 "token": $BATCHLEASE_FENCING_TOKEN, "queue": "$BATCHLEASE_QUEUE",
 "leaseSeconds": $BATCHLEASE_LEASE_SECONDS,
 "payload": $(cat "$BATCHLEASE_PAYLOAD_FILE"),
 "checkpointBytes": $(wc -c < "$BATCHLEASE_CHECKPOINT_FILE"),
 "pgUrl": "${BATCHLEASE_PG_URL:-withheld}",
 "dirMode": "$(stat -c %a "$(dirname "$BATCHLEASE_RESULT_FILE")")"}
EOF"#;
    let r = runner::start(&ns.name, "r1", &RunnerOpts::default(), script).unwrap();
    tasks::create(
        &ns,
        "job",
        json!({"queue": "sh", "leaseDurationSeconds": 12, "payload": {"rows": 3, "deep": {"a": [1, 2]}}}),
    )
    .await
    .unwrap();
    let done = wait_phase(&ns, "job", TaskPhase::Succeeded, WAIT, || {
        op.logs_with(&[&r])
    })
    .await
    .unwrap();
    let uid = tasks::uid(&ns, "job").await.unwrap();
    let st = done.status.clone().unwrap();
    let result = result_of(&done);
    let token = st.history.last().unwrap().token;
    assert_eq!(
        result,
        json!({"ns": ns.name, "name": "job", "uid": uid, "attempt": 1, "token": token,
               "queue": "sh", "leaseSeconds": 12, "payload": {"rows": 3, "deep": {"a": [1, 2]}},
               "checkpointBytes": 0, "pgUrl": "withheld", "dirMode": "700"}),
        "{}",
        r.logs()
    );
    // Output passes through, prefixed with the task and its token.
    let log = r.log_text();
    let prefix = format!("[{}/job token={token}] ", ns.name);
    assert!(log.contains(&format!("{prefix}hello from job")), "{log}");
    assert!(log.contains(&format!("{prefix}to stderr")), "{log}");
    drop(r);
    ns.finish().await.unwrap();
}

/// Attempt 1 writes a checkpoint and exits with the retry code; attempt 2
/// finds it in its checkpoint file.
#[tokio::test]
async fn a_checkpoint_file_reaches_the_next_attempt() {
    let (ns, op) = Operator::in_new_namespace("run-cp", "op", WAIT)
        .await
        .unwrap();
    let marks = mark_dir(&ns.name);
    // The half-written checkpoint stays until the runner has refused it
    // (the test sees its warning and creates the mark `go`).
    let script = r#"set -eu
if [ "$BATCHLEASE_ATTEMPT" = 1 ]; then
  echo 'not json yet' > "$BATCHLEASE_CHECKPOINT_FILE"
  while [ ! -e "$MARK_DIR/go" ]; do sleep 0.05; done
  echo '{"step": 3, "of": 5}' > "$BATCHLEASE_CHECKPOINT_FILE"
  exit 75
fi
printf '{"attempt": %s, "saw": %s}' "$BATCHLEASE_ATTEMPT" "$(cat "$BATCHLEASE_CHECKPOINT_FILE")" > "$BATCHLEASE_RESULT_FILE""#;
    let r = runner::start(&ns.name, "r1", &with_marks(&marks), script).unwrap();
    tasks::create(
        &ns,
        "job",
        json!({"queue": "sh", "maxRetries": 2, "backoff": {"initialSeconds": 1, "maxSeconds": 1}}),
    )
    .await
    .unwrap();
    // The half-written checkpoint is refused, with a warning, not recorded.
    let log = r.log.clone();
    wait_for(
        "the runner to refuse the half-written checkpoint",
        WAIT,
        || r.logs(),
        || {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            async move { Ok(text.contains("not a valid checkpoint").then_some(())) }
        },
    )
    .await
    .unwrap();
    std::fs::write(marks.join("go"), "").unwrap();
    let done = wait_phase(&ns, "job", TaskPhase::Succeeded, WAIT, || {
        op.logs_with(&[&r])
    })
    .await
    .unwrap();
    assert_eq!(
        result_of(&done),
        json!({"attempt": 2, "saw": {"step": 3, "of": 5}}),
        "{}",
        r.logs()
    );
    let st = done.status.unwrap();
    let first = &st.history[0];
    assert_eq!(first.outcome, "Failed", "{:?}", st.history);
    assert_eq!(
        first.reason.as_deref(),
        Some("RetryExitCode"),
        "{:?}",
        st.history
    );
    drop(r);
    ns.finish().await.unwrap();
}

/// A permanent exit code dead-letters the task without a retry; a death
/// by signal is named.
#[tokio::test]
async fn a_permanent_exit_code_dead_letters_and_signals_are_named() {
    let (ns, op) = Operator::in_new_namespace("run-perm", "op", WAIT)
        .await
        .unwrap();
    let script = r#"case "$BATCHLEASE_TASK_NAME" in
  bad) echo "bad input" >&2; exit 65 ;;
  crash) kill -SEGV $$ ;;
esac"#;
    let r = runner::start(&ns.name, "r1", &RunnerOpts::default(), script).unwrap();
    tasks::create(&ns, "bad", json!({"queue": "sh", "maxRetries": 3}))
        .await
        .unwrap();
    tasks::create(&ns, "crash", json!({"queue": "sh", "maxRetries": 0}))
        .await
        .unwrap();
    for (name, reason, message) in [
        ("bad", "PermanentExitCode", "exited with code 65"),
        ("crash", "KilledBySignal", "killed by SIGSEGV"),
    ] {
        let t = wait_phase(&ns, name, TaskPhase::DeadLettered, WAIT, || {
            op.logs_with(&[&r])
        })
        .await
        .unwrap();
        let st = t.status.unwrap();
        assert_eq!(st.history.len(), 1, "no retry: {:?}", st.history);
        let f = st.last_failure.unwrap();
        assert_eq!(f.reason, reason);
        assert!(f.message.contains(message), "{}", f.message);
    }
    drop(r);
    ns.finish().await.unwrap();
}

/// SIGTERM to the runner: the child gets SIGTERM, the attempt is given back
/// (Interrupted, no retry spent), and the next runner finishes the task.
#[tokio::test]
async fn sigterm_to_the_runner_forwards_it_and_gives_the_attempt_back() {
    let (ns, op) = Operator::in_new_namespace("run-drain", "op", WAIT)
        .await
        .unwrap();
    let marks = mark_dir(&ns.name);
    let script = r#"m="$MARK_DIR/$BATCHLEASE_TASK_NAME"
if [ -e "$m.started" ]; then echo '{"second": true}' > "$BATCHLEASE_RESULT_FILE"; exit 0; fi
trap 'echo "$BATCHLEASE_FENCING_TOKEN" > "$m.term"; exit 143' TERM
touch "$m.started"
while :; do sleep 0.1; done"#;
    let mut r1 = runner::start(&ns.name, "r1", &with_marks(&marks), script).unwrap();
    tasks::create(&ns, "job", json!({"queue": "sh", "maxRetries": 0}))
        .await
        .unwrap();
    wait_file(&marks.join("job.started"), || op.logs_with(&[&r1])).await;
    r1.signal("TERM").unwrap();
    let t = wait_task(
        &ns,
        "job",
        "attempt 1 Interrupted",
        WAIT,
        || op.logs_with(&[&r1]),
        |t| {
            t.status.as_ref().is_some_and(|s| {
                s.history
                    .first()
                    .is_some_and(|h| h.outcome == "Interrupted")
            })
        },
    )
    .await
    .unwrap();
    let first = t.status.unwrap().history[0].clone();
    assert_eq!(first.reason.as_deref(), Some("WorkerDrained"), "{first:?}");
    let term = wait_file(&marks.join("job.term"), || r1.logs()).await;
    assert_eq!(term.trim(), first.token.to_string());
    let log = r1.log.clone();
    wait_for(
        "runner r1 exits after draining",
        WAIT,
        || std::fs::read_to_string(log).unwrap_or_default(),
        || {
            let exited = r1.exited();
            async move { Ok(exited) }
        },
    )
    .await
    .unwrap();
    // No retry spent: maxRetries 0, yet the next runner runs it.
    let r2 = runner::start(&ns.name, "r2", &with_marks(&marks), script).unwrap();
    let done = wait_phase(&ns, "job", TaskPhase::Succeeded, WAIT, || {
        op.logs_with(&[&r1, &r2])
    })
    .await
    .unwrap();
    assert_eq!(result_of(&done), json!({"second": true}));
    drop(r2);
    ns.finish().await.unwrap();
}

/// The runner SIGSTOPped past the TTL: the task goes to another runner,
/// and once continued the stopped runner's kill switch SIGTERMs its
/// child's process group and SIGKILLs what is left after the grace.
#[tokio::test]
async fn the_kill_switch_stops_the_childs_process_group_within_the_grace() {
    let (ns, op) = Operator::in_new_namespace("run-kill", "op", WAIT)
        .await
        .unwrap();
    let marks = mark_dir(&ns.name);
    // Ignores SIGTERM after noting it (and keeps a grandchild), so only
    // the SIGKILL ends the group.
    let script = r#"m="$MARK_DIR/$BATCHLEASE_TASK_NAME"
if [ -e "$m.started" ]; then echo '{"second": true}' > "$BATCHLEASE_RESULT_FILE"; exit 0; fi
trap 'echo "$BATCHLEASE_FENCING_TOKEN" >> "$m.term"' TERM
sleep 600 &
echo $$ > "$m.pgid"
touch "$m.started"
while :; do sleep 0.1; done"#;
    let grace = 1.0;
    let opts = RunnerOpts {
        kill_grace: grace,
        ..with_marks(&marks)
    };
    let r1 = runner::start(&ns.name, "r1", &opts, script).unwrap();
    tasks::create(
        &ns,
        "job",
        json!({"queue": "sh", "leaseDurationSeconds": 6, "maxRetries": 3}),
    )
    .await
    .unwrap();
    wait_holder(&ns, "job", "r1", WAIT, || op.logs_with(&[&r1]))
        .await
        .unwrap();
    wait_file(&marks.join("job.started"), || op.logs_with(&[&r1])).await;
    let pgid: i32 = std::fs::read_to_string(marks.join("job.pgid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(!runner::live_group_members(pgid).is_empty());
    r1.signal("STOP").unwrap();
    let r2 = runner::start(&ns.name, "r2", &opts, script).unwrap();
    // The lease expires (a TTL without renewal) and r2 gets the task.
    wait_task(
        &ns,
        "job",
        "reassigned to r2 or done",
        WAIT,
        || op.logs_with(&[&r1, &r2]),
        |t| {
            t.status
                .as_ref()
                .is_some_and(|s| s.history.iter().any(|h| h.holder.as_deref() == Some("r2")))
                || t.status.as_ref().and_then(|s| s.holder.as_deref()) == Some("r2")
        },
    )
    .await
    .unwrap();
    // The child of the stopped runner ran on, untouched so far.
    assert!(!marks.join("job.term").exists());
    assert!(!runner::live_group_members(pgid).is_empty());
    let continued = Instant::now();
    r1.signal("CONT").unwrap();
    let term = wait_file(&marks.join("job.term"), || r1.logs()).await;
    assert_eq!(term.lines().count(), 1, "one SIGTERM: {term}");
    wait_for(
        "no live process left in the child's group",
        WAIT,
        || format!("{:?}\n{}", runner::live_group_members(pgid), r1.logs()),
        || {
            let left = runner::live_group_members(pgid);
            async move { Ok(left.is_empty().then_some(())) }
        },
    )
    .await
    .unwrap();
    let took = continued.elapsed();
    assert!(
        took < Duration::from_secs_f64(grace + 2.0),
        "group gone {took:?} after SIGCONT (grace {grace} s)\n{}",
        r1.logs()
    );
    let log = r1.log_text();
    assert!(
        log.contains("SIGKILL to the child's process group"),
        "{log}"
    );
    let done = wait_phase(&ns, "job", TaskPhase::Succeeded, WAIT, || {
        op.logs_with(&[&r1, &r2])
    })
    .await
    .unwrap();
    assert_eq!(result_of(&done), json!({"second": true}));
    drop((r1, r2));
    ns.finish().await.unwrap();
}

/// A grace that no lease could honour is refused at start.
#[tokio::test]
async fn a_grace_longer_than_any_lease_allows_is_refused_at_start() {
    let mut p = Process::start(
        runner::binary().unwrap(),
        "run-grace",
        "runner-grace",
        vec![
            "--namespace=x".into(),
            "--queue=q".into(),
            "--kill-grace=1500".into(),
            "--".into(),
            "true".into(),
        ],
        vec![],
    )
    .unwrap();
    let log = p.log.clone();
    let status = wait_for(
        "the runner refuses to start",
        WAIT,
        || std::fs::read_to_string(log).unwrap_or_default(),
        || {
            let s = p.exited();
            async move { Ok(s) }
        },
    )
    .await
    .unwrap();
    assert!(!status.success());
    assert!(p.log_text().contains("2/3 of the TTL"), "{}", p.logs());
}

/// A shell task fences its own `psql` write with `batchlease_fence`: the
/// live attempt's writes stick — the second one after the deadline
/// recorded at registration, so only the runner's `extend` after the
/// renewals keeps it open — and a write carrying the earlier attempt's
/// token is refused.
#[tokio::test]
async fn a_shell_task_fences_its_own_psql_write() {
    let (ns, op) = Operator::in_new_namespace("run-psql", "op", WAIT)
        .await
        .unwrap();
    let db = batchlease_e2e::pg::connect().await.unwrap();
    db.batch_execute(
        "CREATE TABLE IF NOT EXISTS run_effects (task_uid text NOT NULL, written_token bigint NOT NULL, by_token bigint NOT NULL)",
    )
    .await
    .unwrap();
    let marks = mark_dir(&ns.name);
    let script = r#"set -u
m="$MARK_DIR/$BATCHLEASE_TASK_NAME"
write() {
  psql "$APP_DB_URL" -X -q -v ON_ERROR_STOP=1 -c "BEGIN; SELECT batchlease_fence('$BATCHLEASE_TASK_UID', $1); INSERT INTO run_effects VALUES ('$BATCHLEASE_TASK_UID', $1, $BATCHLEASE_FENCING_TOKEN); COMMIT;" >/dev/null
}
if [ "$BATCHLEASE_ATTEMPT" = 1 ]; then
  write "$BATCHLEASE_FENCING_TOKEN" || exit 1
  echo "$BATCHLEASE_FENCING_TOKEN" > "$m.token1"
  exit 75
fi
# Past the deadline the registration recorded (2/3 of the 6 s TTL).
sleep 5
write "$BATCHLEASE_FENCING_TOKEN" || exit 1
write "$(cat "$m.token1")" 2> "$m.stale.err"
echo "{\"staleExit\": $?}" > "$BATCHLEASE_RESULT_FILE""#;
    let mut opts = with_marks(&marks);
    opts.env.push((
        "APP_DB_URL".into(),
        batchlease_e2e::workers::pg_url().unwrap(),
    ));
    let r = runner::start(&ns.name, "r1", &opts, script).unwrap();
    tasks::create(
        &ns,
        "job",
        json!({"queue": "sh", "leaseDurationSeconds": 6, "maxRetries": 1,
               "backoff": {"initialSeconds": 1, "maxSeconds": 1}}),
    )
    .await
    .unwrap();
    let done = wait_phase(&ns, "job", TaskPhase::Succeeded, WAIT, || {
        op.logs_with(&[&r])
    })
    .await
    .unwrap();
    let st = done.status.clone().unwrap();
    let (t1, t2) = (st.history[0].token, st.history[1].token);
    let uid = tasks::uid(&ns, "job").await.unwrap();
    let stale_err = std::fs::read_to_string(marks.join("job.stale.err")).unwrap_or_default();
    assert_ne!(
        result_of(&done)["staleExit"],
        json!(0),
        "{stale_err}\n{}",
        r.logs()
    );
    assert!(stale_err.contains("is fenced"), "{stale_err}");
    let rows: Vec<(i64, i64)> = db
        .query(
            "SELECT written_token, by_token FROM run_effects WHERE task_uid = $1 ORDER BY by_token",
            &[&uid],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(rows, vec![(t1, t1), (t2, t2)], "{}", r.logs());
    assert!(
        r.log_text().contains("storage deadline extended"),
        "{}",
        r.logs()
    );
    drop(r);
    ns.finish().await.unwrap();
}

/// `spec.cancel` of a running task: the runner's next renewal finds it
/// cancelled, and the command gets SIGTERM (then SIGKILL after the grace).
#[tokio::test]
async fn cancelling_a_running_task_stops_its_command() {
    use kube::api::{Patch, PatchParams};
    let (ns, op) = Operator::in_new_namespace("run-cancel", "op", WAIT)
        .await
        .unwrap();
    let marks = mark_dir(&ns.name);
    let script = r#"m="$MARK_DIR/$BATCHLEASE_TASK_NAME"
trap 'echo "$BATCHLEASE_FENCING_TOKEN" > "$m.term"; exit 143' TERM
touch "$m.started"
while :; do sleep 0.1; done"#;
    let r = runner::start(&ns.name, "r1", &with_marks(&marks), script).unwrap();
    tasks::create(
        &ns,
        "job",
        json!({"queue": "sh", "leaseDurationSeconds": 6}),
    )
    .await
    .unwrap();
    wait_file(&marks.join("job.started"), || op.logs_with(&[&r])).await;
    ns.api::<batchlease_api::BatchTask>()
        .patch(
            "job",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"cancel": true}})),
        )
        .await
        .unwrap();
    wait_file(&marks.join("job.term"), || op.logs_with(&[&r])).await;
    let t = wait_phase(&ns, "job", TaskPhase::Cancelled, WAIT, || {
        op.logs_with(&[&r])
    })
    .await
    .unwrap();
    assert_eq!(t.status.unwrap().attempts, 0, "a cancel spends no retry");
    let log = r.log_text();
    assert!(log.contains("cause=\"revoked\""), "{log}");
    drop(r);
    ns.cleanup().await.unwrap();
}

/// `--log-format json`: the command's lines as JSON objects naming the
/// task, token and stream; the SDK's metrics on `--metrics-addr`.
#[tokio::test]
async fn json_output_and_metrics() {
    let (ns, op) = Operator::in_new_namespace("run-json", "op", WAIT)
        .await
        .unwrap();
    let port = batchlease_e2e::ports::free_port().unwrap();
    let opts = RunnerOpts {
        extra: vec![
            "--log-format=json".into(),
            format!("--metrics-addr=127.0.0.1:{port}"),
        ],
        ..Default::default()
    };
    let r = runner::start(
        &ns.name,
        "r1",
        &opts,
        r#"echo "a \"quoted\" line"; echo oops >&2"#,
    )
    .unwrap();
    tasks::create(&ns, "job", json!({"queue": "sh"}))
        .await
        .unwrap();
    let done = wait_phase(&ns, "job", TaskPhase::Succeeded, WAIT, || {
        op.logs_with(&[&r])
    })
    .await
    .unwrap();
    let token = done.status.unwrap().history.last().unwrap().token;
    let lines: Vec<Value> = r
        .log_text()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    for (stream, line) in [("stdout", "a \"quoted\" line"), ("stderr", "oops")] {
        let want = json!({"namespace": ns.name, "task": "job", "token": token, "stream": stream, "line": line});
        assert!(lines.contains(&want), "{want} not in {}", r.logs());
    }
    // The runner's own log is JSON too.
    assert!(
        lines
            .iter()
            .any(|l| l["fields"]["message"] == "command started"),
        "{}",
        r.logs()
    );
    let claims = batchlease_e2e::workers::metric(port, "batchlease_worker_claims_total ")
        .await
        .unwrap();
    assert_eq!(claims, Some(1.0), "{}", r.logs());
    drop(r);
    ns.finish().await.unwrap();
}
