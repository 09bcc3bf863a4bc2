//! Task graphs against a real control plane, the operator, demo workers and
//! PostgreSQL: dependency order (from the start and end times the workers'
//! fenced writes record in PostgreSQL), results passed forward, cycles
//! found at run time, and idempotent expansion by a parent that dies
//! halfway.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::time::Duration;

use batchlease_api::keys::condition;
use batchlease_api::{BatchTask, TaskPhase};
use batchlease_e2e::operator::Operator;
use batchlease_e2e::process::Process;
use batchlease_e2e::tasks::{self, event_reasons, wait_phase, wait_task};
use batchlease_e2e::workers::{self, WorkerOpts};
use batchlease_e2e::{Cluster, TestNamespace, kubectl, pg, wait_for};
use kube::ResourceExt;
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(90);

async fn setup(prefix: &str, workers: usize) -> (TestNamespace, Operator, Vec<Process>) {
    let cluster = Cluster::with_crds().await.unwrap();
    let ns = cluster.namespace(prefix).await.unwrap();
    let op = Operator::start(&ns.name, "op").unwrap();
    op.wait_leading(T).await.unwrap();
    let opts = WorkerOpts {
        slots: 3,
        ..Default::default()
    };
    let w = (1..=workers)
        .map(|i| workers::start(&ns.name, &format!("w{i}"), &opts).unwrap())
        .collect();
    (ns, op, w)
}

fn logs(op: &Operator, w: &[Process]) -> String {
    let refs: Vec<&Process> = w.iter().collect();
    op.logs_with(&refs)
}

/// When each task's successful attempt started (its registration in the
/// fenced store, before the handler ran) and ended (its commit), by the
/// database's clock; keyed by task name.
async fn spans(ns: &TestNamespace) -> BTreeMap<String, (f64, f64)> {
    let db = pg::connect().await.unwrap();
    let mut out = BTreeMap::new();
    for t in ns
        .api::<BatchTask>()
        .list(&Default::default())
        .await
        .unwrap()
    {
        let uid = t.uid().unwrap();
        let rows = db
            .query(
                "SELECT token, status, extract(epoch from at)::float8 FROM task_state_audit
                  WHERE task_id = $1 ORDER BY at",
                &[&uid],
            )
            .await
            .unwrap();
        let committed: Option<i64> = rows
            .iter()
            .find(|r| r.get::<_, Option<String>>(1).as_deref() == Some("COMPLETED"))
            .map(|r| r.get(0));
        let Some(token) = committed else { continue };
        let at = |status: &str| {
            rows.iter()
                .find(|r| {
                    r.get::<_, i64>(0) == token
                        && r.get::<_, Option<String>>(1).as_deref() == Some(status)
                })
                .map(|r| r.get::<_, f64>(2))
        };
        out.insert(
            t.name_any(),
            (at("RUNNING").unwrap(), at("COMPLETED").unwrap()),
        );
    }
    out
}

/// Every edge `task → dependency` of the namespace ran in order: the
/// dependency's commit landed before the task's attempt began.
async fn assert_dependency_order(ns: &TestNamespace) {
    let spans = spans(ns).await;
    let all = ns
        .api::<BatchTask>()
        .list(&Default::default())
        .await
        .unwrap();
    let mut edges = 0;
    for t in &all {
        let (start, _) = spans[&t.name_any()];
        for d in &t.spec.depends_on {
            let (_, dep_end) = spans[d];
            assert!(
                dep_end <= start,
                "{} started at {start:.3}, before its dependency {d} committed at {dep_end:.3}",
                t.name_any()
            );
            edges += 1;
        }
    }
    assert!(edges > 0, "no edges checked");
}

fn result(t: &BatchTask) -> Value {
    t.status
        .as_ref()
        .and_then(|s| s.result.as_ref())
        .map(|r| r.to_value().unwrap())
        .unwrap_or(Value::Null)
}

fn condition_of(t: &BatchTask, type_: &str) -> Option<(String, String)> {
    t.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.clone(), c.message.clone()))
}

#[tokio::test]
async fn the_pipeline_example_runs_in_dependency_order_and_passes_results_forward() {
    let (ns, op, w) = setup("pipeline", 2).await;
    // While `extract` runs, `load` waits and says for what.
    kubectl::ok(&["apply", "-n", &ns.name, "-f", "examples/pipeline.yaml"]).unwrap();
    let waiting = wait_task(
        &ns,
        "load",
        "WaitingForDependencies",
        T,
        || logs(&op, &w),
        |t| condition_of(t, condition::WAITING_FOR_DEPENDENCIES).is_some_and(|(s, _)| s == "True"),
    )
    .await
    .unwrap();
    let (_, msg) = condition_of(&waiting, condition::WAITING_FOR_DEPENDENCIES).unwrap();
    assert_eq!(msg, "waiting for transform");
    let load = wait_phase(&ns, "load", TaskPhase::Succeeded, T, || logs(&op, &w))
        .await
        .unwrap();
    // transform read extract's result, load read transform's.
    let r = result(&load);
    assert_eq!(
        r["dependencies"]["transform"]["seen"],
        json!("transform"),
        "{r}"
    );
    assert_eq!(
        r["dependencies"]["transform"]["dependencies"]["extract"]["seen"],
        json!("extract"),
        "{r}"
    );
    // load held the warehouse lock: its lease carried the resource token.
    let lease_tokens = load.status.as_ref().unwrap().current_lease.clone().unwrap();
    let lease = ns
        .api::<batchlease_api::TaskLease>()
        .get(&lease_tokens)
        .await
        .unwrap();
    assert!(
        lease.spec.resource_tokens.contains_key("warehouse"),
        "{lease:?}"
    );
    assert_eq!(
        condition_of(&load, condition::WAITING_FOR_DEPENDENCIES).map(|c| c.0),
        Some("False".into())
    );
    assert_dependency_order(&ns).await;
    ns.finish().await.unwrap();
}

/// `name` depending on `deps`, recording what it read from them.
async fn node(ns: &TestNamespace, name: &str, deps: &[&str]) {
    tasks::create(
        ns,
        name,
        json!({"queue": "demo", "dependsOn": deps,
               "payload": {"steps": 2, "stepMillis": 100, "readDependencies": true}}),
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn a_diamond_and_a_fan_out_fan_in_run_in_order() {
    let (ns, op, w) = setup("dag", 3).await;
    // Created dependents first, so every task waits for a while (and for
    // missing dependencies at first).
    node(&ns, "d-join", &["d-left", "d-right"]).await;
    node(&ns, "d-left", &["d-root"]).await;
    node(&ns, "d-right", &["d-root"]).await;
    node(&ns, "d-root", &[]).await;
    // 3 levels: one root, fan-out to 4, each fans out to 2, all fan in.
    let mut leaves = Vec::new();
    for i in 0..4 {
        for j in 0..2 {
            leaves.push(format!("f-{i}-{j}"));
        }
    }
    let leaf_refs: Vec<&str> = leaves.iter().map(String::as_str).collect();
    node(&ns, "f-sink", &leaf_refs).await;
    for i in 0..4 {
        for j in 0..2 {
            node(&ns, &format!("f-{i}-{j}"), &[&format!("f-{i}")]).await;
        }
        node(&ns, &format!("f-{i}"), &["f-root"]).await;
    }
    node(&ns, "f-root", &[]).await;
    for name in ["d-join", "f-sink"] {
        wait_phase(&ns, name, TaskPhase::Succeeded, T, || logs(&op, &w))
            .await
            .unwrap();
    }
    let all = ns
        .api::<BatchTask>()
        .list(&Default::default())
        .await
        .unwrap();
    assert_eq!(all.items.len(), 4 + 1 + 4 + 8 + 1);
    let join = all.iter().find(|t| t.name_any() == "d-join").unwrap();
    let r = result(join);
    for side in ["d-left", "d-right"] {
        assert_eq!(
            r["dependencies"][side]["dependencies"]["d-root"]["seen"],
            json!("d-root"),
            "{r}"
        );
    }
    let sink = all.iter().find(|t| t.name_any() == "f-sink").unwrap();
    let read = result(sink)["dependencies"].as_object().unwrap().len();
    assert_eq!(read, 8, "the sink read all eight leaves' results");
    assert_dependency_order(&ns).await;
    ns.finish().await.unwrap();
}

fn cyclic(dep: &str) -> Value {
    json!({"queue": "demo", "dependsOn": [dep], "payload": {"steps": 1, "stepMillis": 10}})
}

#[tokio::test]
async fn cycles_applied_at_once_or_closed_later_reject_exactly_their_tasks() {
    let (ns, op, w) = setup("cycles", 1).await;
    // A 3-cycle applied at once, a task that depends on it, an unrelated one.
    let manifest = ["a", "b", "c"]
        .iter()
        .zip(["b", "c", "a"])
        .map(|(n, d)| {
            format!(
                "apiVersion: batchlease.dev/v1alpha1\nkind: BatchTask\nmetadata: {{name: {n}}}\nspec: {{queue: demo, dependsOn: [{d}], payload: {{steps: 1, stepMillis: 10}}}}\n"
            )
        })
        .collect::<Vec<_>>()
        .join("---\n");
    let file = std::env::temp_dir().join(format!("{}-cycle.yaml", ns.name));
    std::fs::write(&file, manifest).unwrap();
    kubectl::ok(&["apply", "-n", &ns.name, "-f", file.to_str().unwrap()]).unwrap();
    std::fs::remove_file(&file).unwrap();
    tasks::create(&ns, "after-a", cyclic("a")).await.unwrap();
    tasks::create(
        &ns,
        "free",
        json!({"queue": "demo", "payload": {"steps": 1, "stepMillis": 10}}),
    )
    .await
    .unwrap();
    // A chain whose cycle is closed later, by a task created afterwards.
    tasks::create(&ns, "x", cyclic("y")).await.unwrap();
    tasks::create(&ns, "y", cyclic("z")).await.unwrap();
    let y = wait_task(
        &ns,
        "y",
        "waiting for a missing z",
        T,
        || logs(&op, &w),
        |t| {
            condition_of(t, condition::WAITING_FOR_DEPENDENCIES)
                .is_some_and(|(s, m)| s == "True" && m.contains("missing: z"))
        },
    )
    .await
    .unwrap();
    assert_eq!(tasks::phase_of(&y), Some(TaskPhase::Pending));
    tasks::create(&ns, "z", cyclic("x")).await.unwrap();

    let expect = [
        ("a", "a → b → c → a"),
        ("b", "a → b → c → a"),
        ("c", "a → b → c → a"),
        ("x", "x → y → z → x"),
        ("y", "x → y → z → x"),
        ("z", "x → y → z → x"),
    ];
    for (name, cycle) in expect {
        let t = wait_phase(&ns, name, TaskPhase::Rejected, T, || logs(&op, &w))
            .await
            .unwrap();
        assert_eq!(
            condition_of(&t, condition::CYCLE_DETECTED),
            Some(("True".into(), format!("dependency cycle: {cycle}"))),
            "{name}"
        );
        // The Event is recorded after the status write that rejected the
        // task: wait for it rather than list once.
        wait_for(
            &format!("{name}'s CycleDetected event"),
            T,
            || logs(&op, &w),
            || {
                let ns = &ns;
                async move {
                    let reasons = event_reasons(ns, name).await?;
                    Ok(reasons.iter().any(|r| r == "CycleDetected").then_some(()))
                }
            },
        )
        .await
        .unwrap();
    }
    // Not on a cycle: the unrelated task runs; the one that depends on the
    // cycle waits with DependencyFailed, never Rejected.
    wait_phase(&ns, "free", TaskPhase::Succeeded, T, || logs(&op, &w))
        .await
        .unwrap();
    let after = wait_task(
        &ns,
        "after-a",
        "DependencyFailed",
        T,
        || logs(&op, &w),
        |t| condition_of(t, condition::DEPENDENCY_FAILED).is_some_and(|(s, _)| s == "True"),
    )
    .await
    .unwrap();
    assert_eq!(tasks::phase_of(&after), Some(TaskPhase::Pending));
    assert_eq!(
        op.metric(&format!(
            "batchlease_graph_cycle_detected_total{{namespace=\"{}\",queue=\"demo\"}}",
            ns.name
        ))
        .await
        .unwrap(),
        Some(6.0)
    );
    // Nothing on a cycle ever got a lease.
    for (name, _) in expect {
        assert_eq!(
            tasks::status(&ns, name).await.unwrap().fencing_token,
            0,
            "{name}"
        );
    }
    // `after-a` can never run (by design it waits, not Rejected): every
    // other task is final; the history's safety checks still run.
    ns.cleanup().await.unwrap();
}

/// The children of `parent` (by the parent label the SDK sets).
async fn children(ns: &TestNamespace, parent: &str) -> Vec<BatchTask> {
    let lp = kube::api::ListParams::default().labels(&format!("batchlease.dev/parent={parent}"));
    ns.api::<BatchTask>().list(&lp).await.unwrap().items
}

#[tokio::test]
async fn a_parent_killed_halfway_through_spawning_ends_with_one_copy_of_each_child() {
    let cluster = Cluster::with_crds().await.unwrap();
    let ns = cluster.namespace("spawn").await.unwrap();
    let op = Operator::start(&ns.name, "op").unwrap();
    op.wait_leading(T).await.unwrap();
    let one = WorkerOpts {
        slots: 1,
        ..Default::default()
    };
    let mut first = workers::start(&ns.name, "first", &one).unwrap();
    // The first attempt creates children 0..3 of 6 and stalls; chained, so
    // the children also depend on each other.
    tasks::create(
        &ns,
        "parent",
        json!({"queue": "demo", "leaseDurationSeconds": 5,
               "payload": {"spawn": {"children": 6, "version": "v1", "stallAfter": 3, "chain": true}}}),
    )
    .await
    .unwrap();
    let uid = tasks::uid(&ns, "parent").await.unwrap();
    wait_for(
        "three children spawned",
        T,
        || op.logs_with(&[&first]),
        || {
            let ns = &ns;
            async move { Ok((children(ns, "parent").await.len() >= 3).then_some(())) }
        },
    )
    .await
    .unwrap();
    first.kill(); // SIGKILL mid-expansion
    let w = workers::start(
        &ns.name,
        "second",
        &WorkerOpts {
            slots: 3,
            ..Default::default()
        },
    )
    .unwrap();
    let parent = wait_phase(&ns, "parent", TaskPhase::Succeeded, T, || {
        op.logs_with(&[&w])
    })
    .await
    .unwrap();
    let st = parent.status.clone().unwrap();
    assert!(st.fencing_token >= 2, "the parent was retried: {st:?}");
    let kids = children(&ns, "parent").await;
    let mut names: Vec<String> = kids.iter().map(|k| k.name_any()).collect();
    names.sort();
    let mut want: Vec<String> = (0..6)
        .map(|i| batchlease_api::names::child_name("parent", &uid, i, "v1"))
        .collect();
    want.sort();
    assert_eq!(
        names, want,
        "exactly one copy of each child, under its deterministic name"
    );
    assert_eq!(
        ns.api::<BatchTask>()
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .len(),
        7,
        "nothing else was created"
    );
    for k in &kids {
        let owner = &k.owner_references()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.uid.as_str()),
            ("BatchTask", uid.as_str())
        );
    }
    // The result names them in logical order; the chain runs in order.
    let r = result(&parent);
    let listed: Vec<String> = serde_json::from_value(r["children"].clone()).unwrap();
    let ordered: Vec<String> = (0..6)
        .map(|i| batchlease_api::names::child_name("parent", &uid, i, "v1"))
        .collect();
    assert_eq!(listed, ordered, "{r}");
    for name in &ordered {
        wait_phase(&ns, name, TaskPhase::Succeeded, T, || op.logs_with(&[&w]))
            .await
            .unwrap();
    }
    assert_dependency_order(&ns).await;
    ns.finish().await.unwrap();
}

#[tokio::test]
async fn a_child_name_taken_by_another_spec_fails_the_parent_clearly() {
    let cluster = Cluster::with_crds().await.unwrap();
    let ns = cluster.namespace("spawnconflict").await.unwrap();
    let op = Operator::start(&ns.name, "op").unwrap();
    op.wait_leading(T).await.unwrap();
    tasks::create(
        &ns,
        "parent",
        json!({"queue": "demo", "payload": {"spawn": {"children": 2, "version": "v1"}}}),
    )
    .await
    .unwrap();
    let uid = tasks::uid(&ns, "parent").await.unwrap();
    let taken = batchlease_api::names::child_name("parent", &uid, 1, "v1");
    tasks::create(
        &ns,
        &taken,
        json!({"queue": "elsewhere", "payload": {"not": "a child"}}),
    )
    .await
    .unwrap();
    let w = workers::start(&ns.name, "w", &WorkerOpts::default()).unwrap();
    let parent = wait_phase(&ns, "parent", TaskPhase::DeadLettered, T, || {
        op.logs_with(&[&w])
    })
    .await
    .unwrap();
    let failure = parent.status.unwrap().last_failure.unwrap();
    assert_eq!(failure.reason, "SpawnConflict", "{failure:?}");
    assert!(failure.message.contains(&taken), "{failure:?}");
    // The foreign object was left alone.
    let other = ns.api::<BatchTask>().get(&taken).await.unwrap();
    assert_eq!(other.spec.queue, "elsewhere");
    assert!(other.owner_references().is_empty());
    ns.cleanup().await.unwrap();
}
