//! One conformance suite for every kind of worker: the same scenarios run
//! against the Rust SDK (the demo worker) and `batchlease-run` (a shell
//! command), each through its adapter in `batchlease_e2e::conformance`.
//! A kind that fails a scenario fails CI; a new kind is one more adapter
//! and one more `kind!` line at the bottom.
//!
//! Every scenario runs under the operator in its own namespace, checks
//! where the kind's fenced effects landed in PostgreSQL, and ends with the
//! history checker over the namespace's watches and the storage
//! (`TestNamespace::finish`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use batchlease_api::{BatchTask, TaskLease, TaskPhase};
use batchlease_e2e::conformance::{self, Kind, StartOpts};
use batchlease_e2e::operator::Operator;
use batchlease_e2e::process::Process;
use batchlease_e2e::proxy::{Proxy, apiserver_addr, proxied_kubeconfig};
use batchlease_e2e::secrets::PrivateDir;
use batchlease_e2e::tasks::{self, wait_holder, wait_phase, wait_task};
use batchlease_e2e::{pg, wait_for};
use kube::ResourceExt;
use kube::api::{Patch, PatchParams};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(60);

fn result_of(t: &BatchTask) -> Value {
    serde_json::to_value(&t.status.as_ref().unwrap().result).unwrap()
}

async fn setup(kind: Kind, prefix: &str) -> (batchlease_e2e::TestNamespace, Operator) {
    let db = pg::connect().await.unwrap();
    conformance::prepare(&db).await.unwrap();
    let prefix = format!("cf-{prefix}-{}", short(kind));
    Operator::in_new_namespace(&prefix, "op", WAIT)
        .await
        .unwrap()
}

fn short(kind: Kind) -> &'static str {
    match kind {
        Kind::RustSdk => "rs",
        Kind::Runner => "run",
        Kind::Python => "py",
    }
}

fn spec(kind: Kind, payload: Value, extra: Value) -> Value {
    let mut s = json!({"queue": kind.queue(), "payload": payload});
    if let (Some(s), Some(e)) = (s.as_object_mut(), extra.as_object()) {
        s.extend(e.clone());
    }
    s
}

async fn effects(kind: Kind, t: &BatchTask) -> Vec<i64> {
    let db = pg::connect().await.unwrap();
    kind.effects(&db, &t.uid().unwrap()).await.unwrap()
}

/// Waits until `p`'s log contains `marker`.
async fn wait_log(p: &Process, marker: &str) {
    let log = p.log.clone();
    wait_for(
        &format!("{marker:?} in the worker's log"),
        WAIT,
        || p.logs(),
        || {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            async move { Ok(text.contains(marker).then_some(())) }
        },
    )
    .await
    .unwrap();
}

/// Claim and succeed: the result, one attempt, one effect under its token.
pub async fn claim_and_succeed(kind: Kind) {
    let (ns, op) = setup(kind, "ok").await;
    let w = kind.start(&ns.name, "w1").unwrap();
    tasks::create(
        &ns,
        "job",
        spec(kind, json!({"steps": 2, "stepMillis": 100}), json!({})),
    )
    .await
    .unwrap();
    let done = wait_phase(&ns, "job", TaskPhase::Succeeded, WAIT, || {
        op.logs_with(&[&w])
    })
    .await
    .unwrap();
    let status = done.status.clone().unwrap();
    assert_eq!(result_of(&done)["resumedFrom"], json!(0), "{status:?}");
    assert_eq!(status.history.len(), 1, "{status:?}");
    assert_eq!(effects(kind, &done).await, [status.fencing_token]);
    drop(w);
    ns.finish().await.unwrap();
}

/// A retryable failure after two checkpoints: the next attempt resumes
/// from the second, and only its effect sticks.
pub async fn checkpoint_carried_to_the_next_attempt(kind: Kind) {
    let (ns, op) = setup(kind, "cp").await;
    let w = kind.start(&ns.name, "w1").unwrap();
    tasks::create(
        &ns,
        "job",
        spec(
            kind,
            json!({"steps": 3, "stepMillis": 100, "failAfterSteps": 2}),
            json!({"maxRetries": 2, "backoff": {"initialSeconds": 1}}),
        ),
    )
    .await
    .unwrap();
    let done = wait_phase(&ns, "job", TaskPhase::Succeeded, WAIT, || {
        op.logs_with(&[&w])
    })
    .await
    .unwrap();
    let status = done.status.clone().unwrap();
    assert_eq!(result_of(&done)["resumedFrom"], json!(2), "{status:?}");
    let outcomes: Vec<_> = status.history.iter().map(|h| h.outcome.clone()).collect();
    assert_eq!(outcomes, ["Failed", "Succeeded"], "{status:?}");
    assert_eq!(effects(kind, &done).await, [status.fencing_token]);
    drop(w);
    ns.finish().await.unwrap();
}

/// A permanent failure dead-letters at once, retries left or not; nothing
/// is written.
pub async fn a_permanent_failure_dead_letters_without_a_retry(kind: Kind) {
    let (ns, op) = setup(kind, "perm").await;
    let w = kind.start(&ns.name, "w1").unwrap();
    tasks::create(
        &ns,
        "job",
        spec(
            kind,
            json!({"steps": 1, "stepMillis": 50, "permanentFailure": true}),
            json!({"maxRetries": 3}),
        ),
    )
    .await
    .unwrap();
    let dead = wait_phase(&ns, "job", TaskPhase::DeadLettered, WAIT, || {
        op.logs_with(&[&w])
    })
    .await
    .unwrap();
    let status = dead.status.clone().unwrap();
    assert_eq!(status.history.len(), 1, "{status:?}");
    assert_eq!(status.history[0].outcome, "Failed", "{status:?}");
    assert!(effects(kind, &dead).await.is_empty());
    drop(w);
    ns.finish().await.unwrap();
}

/// SIGTERM to the worker: the running attempt is given back
/// `Interrupted` (no retry spent: `maxRetries: 0`), and the next worker
/// finishes the task from its checkpoint.
pub async fn sigterm_gives_the_attempt_back(kind: Kind) {
    let (ns, op) = setup(kind, "term").await;
    let w1 = kind.start(&ns.name, "w1").unwrap();
    tasks::create(
        &ns,
        "job",
        spec(
            kind,
            json!({"steps": 40, "stepMillis": 100}),
            json!({"maxRetries": 0}),
        ),
    )
    .await
    .unwrap();
    wait_holder(&ns, "job", "w1", WAIT, || op.logs_with(&[&w1]))
        .await
        .unwrap();
    w1.signal("TERM").unwrap();
    let t = wait_task(
        &ns,
        "job",
        "attempt 1 given back Interrupted",
        WAIT,
        || op.logs_with(&[&w1]),
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
    assert_eq!(t.status.unwrap().attempts, 0, "no retry spent");
    let w2 = kind.start(&ns.name, "w2").unwrap();
    let done = wait_phase(&ns, "job", TaskPhase::Succeeded, WAIT, || {
        op.logs_with(&[&w1, &w2])
    })
    .await
    .unwrap();
    let status = done.status.clone().unwrap();
    assert_eq!(effects(kind, &done).await, [status.fencing_token]);
    drop((w1, w2));
    ns.finish().await.unwrap();
}

/// SIGSTOP past the TTL: the task is reassigned and finished by another
/// worker; once continued, the stopped worker's kill switch stops its
/// handler, and no effect of its token is in PostgreSQL.
pub async fn a_paused_worker_is_reassigned_and_its_late_write_refused(kind: Kind) {
    let (ns, op) = setup(kind, "stop").await;
    let w1 = kind.start(&ns.name, "w1").unwrap();
    tasks::create(
        &ns,
        "job",
        spec(
            kind,
            json!({"steps": 30, "stepMillis": 200}),
            json!({"leaseDurationSeconds": 6, "maxRetries": 3}),
        ),
    )
    .await
    .unwrap();
    let held = wait_holder(&ns, "job", "w1", WAIT, || op.logs_with(&[&w1]))
        .await
        .unwrap();
    let zombie = held.status.unwrap().fencing_token;
    w1.signal("STOP").unwrap();
    let w2 = kind.start(&ns.name, "w2").unwrap();
    wait_task(
        &ns,
        "job",
        "reassigned to w2",
        WAIT,
        || op.logs_with(&[&w1, &w2]),
        |t| {
            t.status.as_ref().is_some_and(|s| {
                s.fencing_token > zombie && s.holder.as_deref().is_some_and(|h| h.starts_with("w2"))
            })
        },
    )
    .await
    .unwrap();
    w1.signal("CONT").unwrap();
    wait_log(&w1, kind.killed_marker()).await;
    let done = wait_phase(&ns, "job", TaskPhase::Succeeded, WAIT, || {
        op.logs_with(&[&w1, &w2])
    })
    .await
    .unwrap();
    let status = done.status.clone().unwrap();
    let stuck = effects(kind, &done).await;
    assert_eq!(stuck, [status.fencing_token], "only the successor's effect");
    assert!(!stuck.contains(&zombie));
    drop((w1, w2));
    ns.finish().await.unwrap();
}

/// `spec.cancel` on a running task: the worker stops its handler, the task
/// ends Cancelled, nothing is written.
pub async fn cancel_stops_the_handler(kind: Kind) {
    let (ns, op) = setup(kind, "cancel").await;
    let w = kind.start(&ns.name, "w1").unwrap();
    tasks::create(
        &ns,
        "job",
        spec(kind, json!({"steps": 100, "stepMillis": 100}), json!({})),
    )
    .await
    .unwrap();
    wait_holder(&ns, "job", "w1", WAIT, || op.logs_with(&[&w]))
        .await
        .unwrap();
    ns.api::<BatchTask>()
        .patch(
            "job",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"cancel": true}})),
        )
        .await
        .unwrap();
    wait_log(&w, kind.cancelled_marker()).await;
    let done = wait_phase(&ns, "job", TaskPhase::Cancelled, WAIT, || {
        op.logs_with(&[&w])
    })
    .await
    .unwrap();
    assert!(effects(kind, &done).await.is_empty());
    drop(w);
    ns.finish().await.unwrap();
}

/// Spawning children, where the kind can (`ctx.spawn`): the parent
/// succeeds after its children exist; each child runs and succeeds.
pub async fn spawn_where_supported(kind: Kind) {
    if !kind.spawns() {
        eprintln!("{kind:?} cannot spawn children: scenario not applicable");
        return;
    }
    let (ns, op) = setup(kind, "spawn").await;
    let w = kind.start(&ns.name, "w1").unwrap();
    tasks::create(
        &ns,
        "parent",
        spec(
            kind,
            json!({"steps": 1, "stepMillis": 50, "spawn": {"children": 2, "version": "v1"}}),
            json!({}),
        ),
    )
    .await
    .unwrap();
    let done = wait_phase(&ns, "parent", TaskPhase::Succeeded, WAIT, || {
        op.logs_with(&[&w])
    })
    .await
    .unwrap();
    let children: Vec<String> =
        serde_json::from_value(result_of(&done)["children"].clone()).unwrap();
    assert_eq!(children.len(), 2, "{:?}", result_of(&done));
    for c in &children {
        wait_phase(&ns, c, TaskPhase::Succeeded, WAIT, || op.logs_with(&[&w]))
            .await
            .unwrap();
    }
    drop(w);
    ns.finish().await.unwrap();
}

/// The time of the first line of `log` containing `marker` (the tracing
/// timestamp at its start), in seconds since the epoch.
fn logged_at(log: &str, marker: &str) -> Option<f64> {
    let line = log.lines().find(|l| l.contains(marker))?;
    let stamp = line.split_whitespace().next()?;
    let t: k8s_openapi::jiff::Timestamp = stamp.parse().ok()?;
    Some(t.as_microsecond() as f64 / 1e6)
}

/// A silent partition from the API server: the kill switch stops the
/// handler no later than 2/3·TTL (+ 0.2 s) after the last successful
/// renewal was sent (its `renewTime`), measured on this host's clock.
pub async fn kill_switch_within_two_thirds_of_the_ttl(kind: Kind) {
    let (ns, op) = setup(kind, "kill").await;
    let proxy = Proxy::start(apiserver_addr().unwrap()).await.unwrap();
    let dir = PrivateDir::new(&ns.name).unwrap();
    let kubeconfig = proxied_kubeconfig(&proxy, &dir).unwrap();
    let w = kind
        .start_opts(
            &ns.name,
            "w1",
            &StartOpts {
                kubeconfig: Some(kubeconfig.clone()),
                ..Default::default()
            },
        )
        .unwrap();
    let ttl = 6.0;
    tasks::create(
        &ns,
        "job",
        spec(
            kind,
            json!({"steps": 100, "stepMillis": 200}),
            json!({"leaseDurationSeconds": 6, "maxRetries": 3}),
        ),
    )
    .await
    .unwrap();
    wait_holder(&ns, "job", "w1", WAIT, || op.logs_with(&[&w]))
        .await
        .unwrap();
    let leases = ns.api::<TaskLease>();
    let claimed = leases.get("job-1").await.unwrap().spec.renew_time;
    // One renewal through the proxy, then cut it right after.
    let renewed = wait_for(
        "a renewal",
        WAIT,
        || w.logs(),
        || async {
            let now = leases.get("job-1").await?.spec.renew_time;
            Ok((now != claimed).then_some(now))
        },
    )
    .await
    .unwrap();
    proxy.cut();
    wait_log(&w, kind.killed_marker()).await;
    // The renewal the cut may have swallowed on its way back was sent
    // later still: the last one the worker saw succeed is no later than
    // the newest renewTime the server holds.
    let last = leases.get("job-1").await.unwrap().spec.renew_time;
    let last = last.or(renewed).expect("a renewTime");
    let sent = last.0.as_microsecond() as f64 / 1e6;
    let fired = logged_at(&w.log_text(), kind.killed_marker()).expect("a timestamped line");
    let latency = fired - sent;
    eprintln!(
        "{kind:?}: handler stopped {latency:.3} s after the last renewal's send (2/3·TTL = {:.3} s)",
        ttl * 2.0 / 3.0
    );
    assert!(
        latency <= ttl * 2.0 / 3.0 + 0.2,
        "{kind:?}: stopped {latency:.3} s after the last renewal (TTL {ttl} s)\n{}",
        w.logs()
    );
    // The task goes on elsewhere.
    let w2 = kind.start(&ns.name, "w2").unwrap();
    let done = wait_phase(
        &ns,
        "job",
        TaskPhase::Succeeded,
        Duration::from_secs(90),
        || op.logs_with(&[&w, &w2]),
    )
    .await
    .unwrap();
    let status = done.status.clone().unwrap();
    assert_eq!(effects(kind, &done).await, [status.fencing_token]);
    drop((w, w2));
    ns.finish().await.unwrap();
}

/// The API server unreachable when the handler is done: the completion is
/// retried while the fence holds and lands once it is back — one attempt,
/// no retry spent, one effect.
pub async fn completion_retried_across_a_short_api_outage(kind: Kind) {
    let (ns, op) = setup(kind, "outage").await;
    let proxy = Proxy::start(apiserver_addr().unwrap()).await.unwrap();
    let dir = PrivateDir::new(&ns.name).unwrap();
    let kubeconfig = proxied_kubeconfig(&proxy, &dir).unwrap();
    let w = kind
        .start_opts(
            &ns.name,
            "w1",
            &StartOpts {
                kubeconfig: Some(kubeconfig.clone()),
                ..Default::default()
            },
        )
        .unwrap();
    // A 30 s lease: the first renewal is due 10 s after the claim, the kill
    // switch 20 s after it; the handler is done after about 1 s.
    tasks::create(
        &ns,
        "job",
        spec(
            kind,
            json!({"steps": 5, "stepMillis": 200}),
            json!({"leaseDurationSeconds": 30, "maxRetries": 0}),
        ),
    )
    .await
    .unwrap();
    wait_log(&w, kind.started_marker()).await;
    proxy.cut();
    let outage = std::time::Instant::now();
    // Its completion meets the outage: a try fails or times out.
    let log = w.log.clone();
    wait_for(
        "a failed completion",
        WAIT,
        || w.logs(),
        || {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            async move {
                Ok(
                    (text.contains("completion failed") || text.contains("completion timed out"))
                        .then_some(()),
                )
            }
        },
    )
    .await
    .unwrap();
    proxy.restore();
    eprintln!(
        "{kind:?}: API server unreachable for {:.1} s",
        outage.elapsed().as_secs_f64()
    );
    let done = wait_phase(&ns, "job", TaskPhase::Succeeded, WAIT, || {
        op.logs_with(&[&w])
    })
    .await
    .unwrap();
    let status = done.status.clone().unwrap();
    assert_eq!(status.history.len(), 1, "{status:?}");
    assert_eq!(status.attempts, 0, "{status:?}");
    assert_eq!(effects(kind, &done).await, [status.fencing_token]);
    drop(w);
    ns.finish().await.unwrap();
}

/// The scenarios for one kind, as a module of tests named for it.
macro_rules! kind {
    ($module:ident, $kind:expr) => {
        mod $module {
            use super::*;

            #[tokio::test]
            async fn claim_and_succeed() {
                super::claim_and_succeed($kind).await
            }

            #[tokio::test]
            async fn checkpoint_carried_to_the_next_attempt() {
                super::checkpoint_carried_to_the_next_attempt($kind).await
            }

            #[tokio::test]
            async fn a_permanent_failure_dead_letters_without_a_retry() {
                super::a_permanent_failure_dead_letters_without_a_retry($kind).await
            }

            #[tokio::test]
            async fn sigterm_gives_the_attempt_back() {
                super::sigterm_gives_the_attempt_back($kind).await
            }

            #[tokio::test]
            async fn a_paused_worker_is_reassigned_and_its_late_write_refused() {
                super::a_paused_worker_is_reassigned_and_its_late_write_refused($kind).await
            }

            #[tokio::test]
            async fn cancel_stops_the_handler() {
                super::cancel_stops_the_handler($kind).await
            }

            #[tokio::test]
            async fn kill_switch_within_two_thirds_of_the_ttl() {
                super::kill_switch_within_two_thirds_of_the_ttl($kind).await
            }

            #[tokio::test]
            async fn completion_retried_across_a_short_api_outage() {
                super::completion_retried_across_a_short_api_outage($kind).await
            }

            #[tokio::test]
            async fn spawn_where_supported() {
                super::spawn_where_supported($kind).await
            }
        }
    };
}

kind!(rust_sdk, Kind::RustSdk);
kind!(runner, Kind::Runner);
kind!(python, Kind::Python);
