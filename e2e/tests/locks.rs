//! Resource locks against a real control plane, the operator, demo workers
//! and PostgreSQL: no two attempts ever hold one resource (checked on the
//! occupancy intervals the fenced store recorded, and by the history
//! checker on the leases), no deadlock, no starvation, and a zombie holder
//! of a resource fenced by the resource's own token.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use batchlease_api::{BatchTask, LeasePhase, TaskLease, TaskPhase};
use batchlease_e2e::operator::Operator;
use batchlease_e2e::process::Process;
use batchlease_e2e::tasks::{self, event_reasons, wait_holder, wait_lease, wait_phase};
use batchlease_e2e::workers::{self, WorkerOpts};
use batchlease_e2e::{TestNamespace, pg, wait_for};
use batchlease_worker_sdk::postgres::FencedStore;
use batchlease_worker_sdk::{Error as SdkError, Fence, KillClock, WorkerMetrics};
use k8s_openapi::api::coordination::v1::Lease;
use kube::ResourceExt;
use kube::api::Api;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde_json::json;
use tokio::time::Instant;

const T: Duration = Duration::from_secs(120);
const RESOURCES: [&str; 6] = ["r1", "r2", "r3", "r4", "r5", "r6"];

async fn setup(prefix: &str) -> (TestNamespace, Operator) {
    Operator::in_new_namespace(prefix, "op", T).await.unwrap()
}

fn start_workers(ns: &TestNamespace, n: usize, slots: usize) -> Vec<Process> {
    workers::start_n(&ns.name, n, slots).unwrap()
}

fn logs(op: &Operator, w: &[Process]) -> String {
    let refs: Vec<&Process> = w.iter().collect();
    op.logs_with(&refs)
}

/// Occupancy of `resource` from the fenced store's audit: per token,
/// (registered, committed) by the database's clock.
async fn occupancy(ns: &TestNamespace, resource: &str) -> Vec<(i64, f64, f64)> {
    let db = pg::connect().await.unwrap();
    let rows = pg::resource_audit(&db, &ns.name, resource).await.unwrap();
    let secs = |t: std::time::SystemTime| {
        t.duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64()
    };
    let mut spans: BTreeMap<i64, (Option<f64>, Option<f64>)> = BTreeMap::new();
    for r in rows {
        let e = spans.entry(r.token).or_default();
        match r.status.as_str() {
            "REGISTERED" => e.0 = e.0.or(Some(secs(r.at))),
            "COMMITTED" => e.1 = Some(secs(r.at)),
            other => panic!("unexpected status {other}"),
        }
    }
    spans
        .into_iter()
        .filter_map(|(t, (s, e))| Some((t, s?, e?)))
        .collect()
}

#[tokio::test]
async fn forty_tasks_over_six_resources_never_share_one_and_all_finish() {
    let (ns, op) = setup("locks40").await;
    let w = start_workers(&ns, 4, 2);
    let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
    let mut users: BTreeMap<&str, usize> = BTreeMap::new();
    for i in 0..40 {
        // Each needs 2–3 resources, listed in random order: the operator
        // sorts them; a naive one taking them as listed could deadlock.
        let mut rs: Vec<&str> = RESOURCES.to_vec();
        rs.shuffle(&mut rng);
        rs.truncate(rng.random_range(2..=3));
        for r in &rs {
            *users.entry(r).or_default() += 1;
        }
        tasks::create(
            &ns,
            &format!("t{i:02}"),
            json!({"queue": "demo", "resources": rs, "payload": {"steps": 2, "stepMillis": 100}}),
        )
        .await
        .unwrap();
    }
    for i in 0..40 {
        wait_phase(&ns, &format!("t{i:02}"), TaskPhase::Succeeded, T, || {
            logs(&op, &w)
        })
        .await
        .unwrap();
    }
    // Storage side: each resource was occupied by one attempt at a time,
    // once per task that needed it.
    for r in RESOURCES {
        let spans = occupancy(&ns, r).await;
        assert_eq!(
            spans.len(),
            users.get(r).copied().unwrap_or(0),
            "{r}: {spans:?}"
        );
        let mut sorted = spans.clone();
        sorted.sort_by(|a, b| a.1.total_cmp(&b.1));
        for pair in sorted.windows(2) {
            assert!(
                pair[0].2 <= pair[1].1,
                "{r}: token {} held it until {:.3}, token {} from {:.3}",
                pair[0].0,
                pair[0].2,
                pair[1].0,
                pair[1].1
            );
            assert!(pair[0].0 < pair[1].0, "{r}: tokens out of order {pair:?}");
        }
    }
    // API side: every lock released, its token counting its holders.
    let locks: Api<Lease> = ns.api();
    for r in RESOURCES {
        let l = locks.get(&format!("{}.{r}", ns.name)).await.unwrap();
        let spec = l.spec.unwrap();
        assert_eq!(spec.holder_identity, None, "{r} still held");
        assert!(
            spec.lease_transitions.unwrap_or(0) as usize >= users[r],
            "{r}: {} transitions for {} users",
            spec.lease_transitions.unwrap_or(0),
            users[r]
        );
    }
    let acquired = op
        .metric(&format!(
            "batchlease_lock_acquisition_duration_seconds_count{{namespace=\"{}\",queue=\"demo\"}}",
            ns.name
        ))
        .await
        .unwrap()
        .unwrap_or(0.0);
    assert!(acquired >= 40.0, "{acquired}");
    // The history checker also checks that no two leases carrying a
    // resource's token were live at once.
    ns.finish().await.unwrap();
}

#[tokio::test]
async fn a_task_needing_all_six_resources_is_not_starved_by_a_stream_of_small_ones() {
    let (ns, op) = setup("starve").await;
    let w = start_workers(&ns, 4, 2);
    // A stream of single-resource tasks, on every resource in turn: one
    // every 150 ms, 1.5 s of work each, so each resource gets a new task
    // every 0.9 s but needs at least 1.5 s (plus lock hand-over) for one:
    // every queue grows for as long as the stream runs, and a moment in
    // which all six resources are free at once never comes by chance.
    // (The backlog must not depend on how fast this machine happens to be:
    // with 0.8 s tasks a quiet machine kept up with the stream and the
    // queue never formed.)
    let stop = tokio_util::sync::CancellationToken::new();
    let feeder = {
        let (api, stop) = (ns.api::<BatchTask>(), stop.clone());
        tokio::spawn(async move {
            let mut n = 0usize;
            let mut tick = tokio::time::interval(Duration::from_millis(150));
            while !stop.is_cancelled() {
                tick.tick().await;
                let task: BatchTask = serde_json::from_value(json!({
                    "apiVersion": "batchlease.dev/v1alpha1", "kind": "BatchTask",
                    "metadata": {"name": format!("s{n:04}")},
                    "spec": {"queue": "demo", "resources": [RESOURCES[n % 6]],
                             "payload": {"steps": 15, "stepMillis": 100}},
                }))
                .unwrap();
                api.create(&Default::default(), &task).await.unwrap();
                n += 1;
            }
            n
        })
    };
    // Let the stream fill every resource and queue up behind them, then
    // the big task arrives: it must wait for the queued ones older than it,
    // while younger ones keep coming.
    wait_for(
        "12 small tasks queued behind busy resources",
        T,
        || logs(&op, &w),
        || {
            let api = ns.api::<BatchTask>();
            async move {
                let list = api.list(&Default::default()).await?;
                let count = |p| {
                    list.iter()
                        .filter(|t| tasks::phase_of(t) == Some(p))
                        .count()
                };
                Ok(
                    (count(TaskPhase::Running) >= 1 && count(TaskPhase::Pending) >= 12)
                        .then_some(()),
                )
            }
        },
    )
    .await
    .unwrap();
    let created = Instant::now();
    let big = tasks::create(
        &ns,
        "all-six",
        json!({"queue": "demo", "resources": RESOURCES, "payload": {"steps": 2, "stepMillis": 100}}),
    )
    .await
    .unwrap();
    let created_at = big.metadata.creation_timestamp.clone();
    // The stated bound: the small tasks older than it finish (a backlog of
    // a few per resource, 1.5 s each), then it runs: 45 s is generous on
    // two loaded cores. Without creation-order service it would wait for a
    // moment in which all six happen to be free at once.
    let bound = Duration::from_secs(45);
    wait_phase(&ns, "all-six", TaskPhase::Succeeded, bound, || {
        logs(&op, &w)
    })
    .await
    .unwrap();
    let took = created.elapsed();
    let still_feeding = !feeder.is_finished();
    stop.cancel();
    let fed = feeder.await.unwrap();
    assert!(still_feeding, "the stream must outlast the big task");
    let younger = ns
        .api::<BatchTask>()
        .list(&Default::default())
        .await
        .unwrap()
        .into_iter()
        .filter(|t| t.metadata.creation_timestamp > created_at)
        .count();
    assert!(
        younger >= 6,
        "small tasks kept arriving while it waited: {younger}"
    );
    eprintln!("all-six finished {took:?} after creation, among {fed} small tasks");
    // Small tasks created after it did not overtake it: none of them got a
    // lease before it did (creation times have one-second resolution: only
    // tasks created in a later second are compared).
    let big = ns.api::<BatchTask>().get("all-six").await.unwrap();
    let big_created = big.metadata.creation_timestamp.clone().unwrap().0;
    let leases: Api<TaskLease> = ns.api();
    let big_issued = leases
        .get("all-six-1")
        .await
        .unwrap()
        .metadata
        .creation_timestamp
        .unwrap()
        .0;
    for t in ns
        .api::<BatchTask>()
        .list(&Default::default())
        .await
        .unwrap()
    {
        let younger = t.metadata.creation_timestamp.clone().unwrap().0 > big_created;
        if !younger {
            continue;
        }
        if let Some(l) = leases
            .get_opt(&format!("{}-1", t.name_any()))
            .await
            .unwrap()
        {
            let issued = l.metadata.creation_timestamp.unwrap().0;
            assert!(
                issued >= big_issued,
                "{} (younger) was issued at {issued}, before all-six at {big_issued}",
                t.name_any()
            );
        }
    }
    // Drain the stream so the namespace ends final.
    for i in 0..fed {
        wait_phase(&ns, &format!("s{i:04}"), TaskPhase::Succeeded, T, || {
            logs(&op, &w)
        })
        .await
        .unwrap();
    }
    ns.finish().await.unwrap();
}

#[tokio::test]
async fn a_zombie_holder_of_a_resource_cannot_commit_after_the_resource_moved_on() {
    let (ns, op) = setup("lockzombie").await;
    let opts = WorkerOpts {
        slots: 1,
        ..Default::default()
    };
    let zombie = workers::start(&ns.name, "zombie", &opts).unwrap();
    // maxRetries 0: after its lease expires the task is dead-lettered, so
    // its own (task) fence stays at the zombie's token — only the resource
    // fence can stop the zombie's write.
    tasks::create(
        &ns,
        "hold",
        json!({"queue": "demo", "leaseDurationSeconds": 5, "maxRetries": 0, "resources": ["db"],
               "payload": {"steps": 40, "stepMillis": 200}}),
    )
    .await
    .unwrap();
    wait_holder(&ns, "hold", "zombie", T, || op.logs_with(&[&zombie]))
        .await
        .unwrap();
    let held = ns.api::<TaskLease>().get("hold-1").await.unwrap();
    let zombie_token = held.spec.resource_tokens["db"];
    // A stop-the-world pause past the TTL; meanwhile another task needs db.
    zombie.signal("STOP").unwrap();
    tasks::create(
        &ns,
        "next",
        json!({"queue": "demo", "resources": ["db"], "payload": {"steps": 1, "stepMillis": 50}}),
    )
    .await
    .unwrap();
    wait_for(
        "next waits for db",
        T,
        || op.logs_with(&[&zombie]),
        || {
            let ns = &ns;
            async move {
                let reasons = event_reasons(ns, "next").await?;
                Ok(reasons
                    .iter()
                    .any(|r| r == "WaitingForResource")
                    .then_some(()))
            }
        },
    )
    .await
    .unwrap();
    wait_lease(&ns, "hold-1", LeasePhase::Expired, T, || {
        op.logs_with(&[&zombie])
    })
    .await
    .unwrap();
    let rescuer = workers::start(&ns.name, "rescuer", &opts).unwrap();
    let next = wait_phase(&ns, "next", TaskPhase::Succeeded, T, || {
        op.logs_with(&[&zombie, &rescuer])
    })
    .await
    .unwrap();
    wait_phase(&ns, "hold", TaskPhase::DeadLettered, T, || {
        op.logs_with(&[&zombie])
    })
    .await
    .unwrap();
    let next_lease = ns
        .api::<TaskLease>()
        .get(next.status.unwrap().current_lease.as_deref().unwrap())
        .await
        .unwrap();
    let next_token = next_lease.spec.resource_tokens["db"];
    assert!(next_token > zombie_token, "{next_token} vs {zombie_token}");
    assert_eq!(
        op.metric(&format!(
            "batchlease_lock_lease_expired_before_release_total{{namespace=\"{}\",queue=\"demo\"}}",
            ns.name
        ))
        .await
        .unwrap(),
        Some(1.0)
    );

    // The zombie's write, with its still-current task token but the old
    // resource token: refused by the resource fence.
    let hold_uid = tasks::uid(&ns, "hold").await.unwrap();
    let (client, conn) =
        tokio_postgres::connect(&workers::pg_url().unwrap(), tokio_postgres::NoTls)
            .await
            .unwrap();
    tokio::spawn(conn);
    let metrics = WorkerMetrics::default();
    let mut store = FencedStore::new(client, metrics.clone());
    let fence = Fence::new(
        1,
        KillClock::new(Duration::from_secs(5), Instant::now(), None),
    )
    .with_resources(
        ns.name.clone(),
        BTreeMap::from([("db".to_owned(), zombie_token)]),
    );
    let err = store
        .commit(&fence, &hold_uid, &json!({"worker": "zombie"}))
        .await
        .unwrap_err();
    assert!(matches!(err, SdkError::ResourceFenced { .. }), "{err}");
    assert_eq!(metrics.fenced_commit_rejected.get(), 1, "counted");

    // The real zombie wakes: its kill switch fires, nothing of it lands.
    zombie.signal("CONT").unwrap();
    wait_for(
        "zombie's kill switch",
        T,
        || zombie.logs(),
        || {
            let text = zombie.log_text();
            async move { Ok(text.contains("kill switch fired").then_some(())) }
        },
    )
    .await
    .unwrap();
    let db = pg::connect().await.unwrap();
    assert_eq!(
        pg::audit(&db, &hold_uid).await.unwrap(),
        vec![],
        "the zombie never committed"
    );
    let tokens: BTreeSet<i64> = pg::resource_audit(&db, &ns.name, "db")
        .await
        .unwrap()
        .into_iter()
        .filter(|w| w.status == "COMMITTED")
        .map(|w| w.token)
        .collect();
    assert_eq!(
        tokens,
        BTreeSet::from([next_token]),
        "only next committed on db"
    );
    ns.finish().await.unwrap();
}

/// When `line` was logged: the demo worker's log lines start with an
/// RFC 3339 timestamp (tracing's default format).
fn logged_at(line: &str) -> k8s_openapi::jiff::Timestamp {
    line.split_whitespace()
        .next()
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("no timestamp in {line:?}"))
}

/// The first line of `text` containing every one of `needles`.
fn line_with<'a>(text: &'a str, needles: &[&str]) -> Option<&'a str> {
    text.lines().find(|l| needles.iter().all(|n| l.contains(n)))
}

/// Issue 22 (3): a deleted task's attempt runs on until its worker's next
/// renewal finds the lease gone (or its kill switch fires), so its locks
/// are not free when the task and its lease are gone: the next task's
/// handler must not start before the deleted task's has stopped. TTL 15 s:
/// the holder renews every 5 s, and the task is deleted right after its
/// claim, so its handler runs about 5 s past the deletion — before the
/// fix, the waiting task's handler started within a second or two.
#[tokio::test]
async fn a_deleted_tasks_lock_waits_until_its_holder_has_stopped() {
    const TTL: u64 = 15;
    let (ns, op) = setup("lockdeleted").await;
    let w = start_workers(&ns, 2, 1);
    // A long handler: it is stopped by its worker, never completes.
    tasks::create(
        &ns,
        "first",
        json!({"queue": "demo", "leaseDurationSeconds": TTL, "resources": ["db"],
               "payload": {"steps": 1200, "stepMillis": 100}}),
    )
    .await
    .unwrap();
    let running = wait_task_held(&ns, "first", &op, &w).await;
    let holder = running.spec.holder_identity.clone().unwrap();
    tasks::create(
        &ns,
        "second",
        json!({"queue": "demo", "leaseDurationSeconds": TTL, "resources": ["db"],
               "payload": {"steps": 5, "stepMillis": 100}}),
    )
    .await
    .unwrap();
    wait_for(
        "second waits for db",
        T,
        || logs(&op, &w),
        || {
            let ns = &ns;
            async move {
                let reasons = event_reasons(ns, "second").await?;
                Ok(reasons
                    .iter()
                    .any(|r| r == "WaitingForResource")
                    .then_some(()))
            }
        },
    )
    .await
    .unwrap();
    ns.api::<BatchTask>()
        .delete("first", &Default::default())
        .await
        .unwrap();
    let deleted = std::time::Instant::now();
    let second = wait_phase(&ns, "second", TaskPhase::Succeeded, T, || logs(&op, &w))
        .await
        .unwrap();
    let took = deleted.elapsed();
    // The first task's worker stopped its handler when a renewal found
    // the lease gone (or at its kill switch); the second's handler
    // started ("working") only after that. Both workers log on this
    // machine's clock.
    let first_lease = format!("lease={}", running.name_any());
    let stopped = wait_for(
        "first's worker to stop its handler",
        Duration::from_secs(TTL + 10),
        || logs(&op, &w),
        || {
            let (w, first_lease) = (&w, &first_lease);
            async move {
                Ok(w.iter().find_map(|p| {
                    let t = p.log_text();
                    line_with(&t, &["renewal found the lease lost", first_lease])
                        .or_else(|| line_with(&t, &["kill switch fired", first_lease]))
                        .map(str::to_owned)
                }))
            }
        },
    )
    .await
    .unwrap();
    let stopped = stopped.as_str();
    let all: Vec<String> = w.iter().map(Process::log_text).collect();
    let second_lease = second
        .status
        .as_ref()
        .unwrap()
        .current_lease
        .clone()
        .unwrap();
    let started = all
        .iter()
        .find_map(|t| line_with(t, &["working", "second"]))
        .unwrap_or_else(|| panic!("no handler of second logged: {}", logs(&op, &w)));
    let (stopped_at, started_at) = (logged_at(stopped), logged_at(started));
    eprintln!(
        "first's handler stopped at {stopped_at} ({holder}); second's ({second_lease}) started \
         at {started_at}, {took:?} after the deletion"
    );
    assert!(
        started_at > stopped_at,
        "second's handler started at {started_at}, while first's still ran (stopped at \
         {stopped_at})\n{}",
        logs(&op, &w)
    );
    // The lock was held a TTL after the last renewal seen (the claim, a
    // moment before the deletion), not a TTL after the deletion.
    assert!(
        took < Duration::from_secs(TTL + 10),
        "second ran {took:?} after the deletion"
    );
    ns.finish().await.unwrap();
}

/// Waits until `name`'s current lease is held; returns it.
async fn wait_task_held(ns: &TestNamespace, name: &str, op: &Operator, w: &[Process]) -> TaskLease {
    wait_for(
        &format!("{name}'s lease held"),
        T,
        || logs(op, w),
        || async move {
            let Some(t) = ns.api::<BatchTask>().get_opt(name).await? else {
                return Ok(None);
            };
            let Some(lease) = t.status.and_then(|s| s.current_lease) else {
                return Ok(None);
            };
            Ok(ns
                .api::<TaskLease>()
                .get_opt(&lease)
                .await?
                .filter(|l| tasks::lease_phase(l) == Some(LeasePhase::Held)))
        },
    )
    .await
    .unwrap()
}
