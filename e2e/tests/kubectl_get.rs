//! `kubectl apply -f examples/` works, and `kubectl get` shows the printer
//! columns an on-call human reads.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use batchlease_api::{
    LeasePhase, TaskLease, TaskLeaseSpec, TaskLeaseStatus, TaskQueue, TaskQueueSpec,
};
use batchlease_e2e::{Cluster, kubectl};
use kube::api::PostParams;

/// Header cells of `kubectl get` output.
fn header(out: &str) -> Vec<String> {
    out.lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

/// The row whose first cell is `name`.
fn row<'a>(out: &'a str, name: &str) -> Vec<&'a str> {
    out.lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|cells| cells.first() == Some(&name))
        .unwrap_or_else(|| panic!("no row {name} in:\n{out}"))
}

#[tokio::test]
async fn apply_examples_and_get_printer_columns() {
    let cluster = Cluster::with_crds().await.unwrap();
    let ns = cluster.namespace("kubectl").await.unwrap();
    let n = ns.name.as_str();

    let applied = kubectl::ok(&["apply", "-n", n, "-f", "examples/"]).unwrap();
    for name in [
        "hello",
        "extract",
        "transform",
        "load",
        "pay-alice-bob",
        "pay-bob-carol",
        "pay-carol-alice",
    ] {
        assert!(
            applied.contains(&format!("batchtask.batchlease.dev/{name} created")),
            "{applied}"
        );
    }

    for kind in ["batchtasks", "batchtask", "bt", "batchtasks.batchlease.dev"] {
        let out = kubectl::ok(&["get", kind, "-n", n]).unwrap();
        assert_eq!(
            header(&out),
            [
                "NAME", "QUEUE", "PHASE", "TOKEN", "RETRIES", "HOLDER", "AGE"
            ],
            "{kind}:\n{out}"
        );
        // No operator yet: no status, so Phase/Token/Retries/Holder are empty.
        assert_eq!(row(&out, "load")[1], "demo", "{out}");
        assert_eq!(out.lines().count(), 8, "{kind}:\n{out}");
    }

    // Defaults were applied by the API server from the schema.
    let hello = kubectl::ok(&["get", "bt", "hello", "-n", n, "-o",
        "jsonpath={.spec.leaseDurationSeconds} {.spec.maxRetries} {.spec.mode} {.spec.backoff.initialSeconds} {.spec.backoff.maxSeconds} {.spec.backoff.multiplier} {.spec.redrive}"]).unwrap();
    assert_eq!(hello, "30 3 Exclusive 1 300 2 0");

    // A lease as the operator will create it, then held by a worker.
    let leases = ns.api::<TaskLease>();
    let uid = "00000000-0000-0000-0000-000000000001";
    let mut lease = TaskLease::new(
        "hello-1",
        TaskLeaseSpec::offered("hello", uid, "demo", 1, 30),
    );
    lease.spec.holder_identity = Some("worker-a-7f3k".into());
    lease.status = Some(TaskLeaseStatus {
        phase: Some(LeasePhase::Held),
        ..Default::default()
    });
    leases.create(&PostParams::default(), &lease).await.unwrap();

    for kind in ["taskleases", "tasklease", "tl"] {
        let out = kubectl::ok(&["get", kind, "-n", n]).unwrap();
        assert_eq!(
            header(&out),
            ["NAME", "TASK", "HOLDER", "TOKEN", "PHASE", "RENEWED", "AGE"],
            "{kind}:\n{out}"
        );
        assert_eq!(
            row(&out, "hello-1")[..5],
            ["hello-1", "hello", "worker-a-7f3k", "1", "Held"],
            "{out}"
        );
    }

    // The category lists both kinds at once.
    let all = kubectl::ok(&["get", "batchlease", "-n", n, "-o", "name"]).unwrap();
    assert!(all.contains("batchtask.batchlease.dev/hello"), "{all}");
    assert!(all.contains("tasklease.batchlease.dev/hello-1"), "{all}");
    assert!(all.contains("taskqueue.batchlease.dev/demo"), "{all}");

    // examples/queue.yaml: the TaskQueue of queue demo.
    assert!(
        applied.contains("taskqueue.batchlease.dev/demo created"),
        "{applied}"
    );
    for kind in ["taskqueues", "taskqueue", "tq"] {
        let out = kubectl::ok(&["get", kind, "-n", n]).unwrap();
        assert_eq!(
            header(&out),
            [
                "NAME", "PAUSED", "READY", "RUNNING", "DEAD", "WORKERS", "AGE"
            ],
            "{kind}:\n{out}"
        );
        // No operator yet: no status; PAUSED is the spec's.
        assert_eq!(row(&out, "demo")[..2], ["demo", "false"], "{out}");
    }
    // A TaskQueue is named for its queue: a DNS label (a dot is fine for
    // the API server's name rules, not for a queue).
    let bad = TaskQueue::new("a.b", TaskQueueSpec::default());
    let err = ns
        .api::<TaskQueue>()
        .create(&PostParams::default(), &bad)
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("a TaskQueue is named for its queue"),
        "{err}"
    );

    // Selectable fields: kubectl can filter by queue.
    let by_queue = kubectl::ok(&[
        "get",
        "bt",
        "-n",
        n,
        "--field-selector",
        "spec.queue=demo",
        "-o",
        "name",
    ])
    .unwrap();
    assert_eq!(by_queue.lines().count(), 7, "{by_queue}");
    let none = kubectl::ok(&[
        "get",
        "bt",
        "-n",
        n,
        "--field-selector",
        "spec.queue=other",
        "-o",
        "name",
    ])
    .unwrap();
    assert_eq!(none.trim(), "", "{none}");

    ns.cleanup().await.unwrap();
}
