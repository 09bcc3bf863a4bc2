//! Tests of the operator's metrics: names and labels as exported, deleted
//! queues' series dropped, and every metric the chart's alerts and Grafana
//! dashboard use is one the operator exports.

use super::*;

fn q(ns: &str, queue: &str) -> QueueLabels {
    QueueLabels {
        namespace: ns.into(),
        queue: queue.into(),
    }
}

fn text(r: &Registry) -> String {
    let mut s = String::new();
    prometheus_client::encoding::text::encode(&mut s, r).unwrap();
    s
}

#[test]
fn tenants_with_a_queue_of_the_same_name_are_kept_apart() {
    let mut r = Registry::default();
    let m = Metrics::new(&mut r);
    // Tenant b's speculative attempts all abort: a livelock in b only.
    let mut last = (Band::Good, Band::Good);
    for _ in 0..crate::speculation::MIN_SAMPLES {
        last = m.record_speculative(&q("b", "demo"), true);
    }
    assert_eq!(last.1, Band::Livelock);
    let (rate, n) = m.abort_rate_with(&q("a", "demo"), false);
    assert_eq!((rate, n), (0.0, 1), "a's window is its own");
    assert_eq!(
        m.record_speculative(&q("a", "demo"), false),
        (Band::Good, Band::Good)
    );
    m.count(QueueCounter::LeasesIssued, &q("a", "demo"), 1);
    m.count_reason(ReasonCounter::Retries, &q("b", "demo"), "Boom");
    let t = text(&r);
    for line in [
        "batchlease_speculative_aborts_total{namespace=\"b\",queue=\"demo\"} 20",
        "batchlease_speculative_attempts_total{namespace=\"a\",queue=\"demo\"} 1",
        "batchlease_leases_issued_total{namespace=\"a\",queue=\"demo\"} 1",
        "batchlease_retries_total{namespace=\"b\",queue=\"demo\",reason=\"Boom\"} 1",
    ] {
        assert!(t.contains(line), "{line} in\n{t}");
    }
}

#[test]
fn the_series_and_window_of_a_gone_queue_are_removed() {
    let mut r = Registry::default();
    let m = Metrics::new(&mut r);
    for ns in ["a", "b"] {
        m.count(QueueCounter::LeasesIssued, &q(ns, "demo"), 1);
        m.count_reason(
            ReasonCounter::QueueIssuesThrottled,
            &q(ns, "demo"),
            "paused",
        );
        m.count_reason(ReasonCounter::TasksDeadLettered, &q(ns, "demo"), "Boom");
        m.record_speculative(&q(ns, "demo"), true);
    }
    let live: HashSet<(String, String)> = [("a".to_owned(), "demo".to_owned())].into();
    assert_eq!(m.forget_queues_not_in(&live), 1);
    let t = text(&r);
    assert!(!t.contains("namespace=\"b\""), "{t}");
    assert!(
        t.contains("batchlease_queue_issues_throttled_total{namespace=\"a\",queue=\"demo\",reason=\"paused\"} 1"),
        "{t}"
    );
    assert_eq!(m.abort_rate_with(&q("b", "demo"), false), (0.0, 1));
    assert_eq!(m.abort_rate_with(&q("a", "demo"), false), (0.5, 2));
    // Nothing is left to forget; a returning queue starts afresh.
    assert_eq!(m.forget_queues_not_in(&live), 0);
    // Without synced caches nothing is forgotten.
    assert_eq!(m.forget_gone_queues(), 0);
    assert!(text(&r).contains("namespace=\"a\""));
}

/// A cache holding `objects` (as a watch's initial list fills it).
fn cache<K>(objects: Vec<serde_json::Value>) -> Store<K>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + 'static,
    K::DynamicType: std::hash::Hash + Eq + Clone + Default,
{
    let (store, mut writer) = kube::runtime::reflector::store::<K>();
    writer.apply_watcher_event(&kube::runtime::watcher::Event::Init);
    for o in objects {
        let o: K = serde_json::from_value(o).unwrap();
        writer.apply_watcher_event(&kube::runtime::watcher::Event::InitApply(o));
    }
    writer.apply_watcher_event(&kube::runtime::watcher::Event::InitDone);
    store
}

fn object(kind: &str, ns: &str, name: &str) -> serde_json::Value {
    let spec = match kind {
        "BatchTask" => serde_json::json!({"queue": "demo"}),
        "TaskLease" => serde_json::json!({
            "taskName": name, "taskUID": "u", "queue": "demo",
            "fencingToken": 1, "leaseDurationSeconds": 30
        }),
        _ => serde_json::json!({}),
    };
    serde_json::json!({
        "apiVersion": "batchlease.dev/v1alpha1", "kind": kind,
        "metadata": {"name": name, "namespace": ns}, "spec": spec
    })
}

#[test]
fn cache_sizes_are_exported_by_kind() {
    let mut r = Registry::default();
    let m = Metrics::new(&mut r);
    // A standby caches nothing, and says so for every kind.
    for kind in ["BatchTask", "TaskLease", "TaskQueue"] {
        let line = format!("\nbatchlease_cache_objects{{kind=\"{kind}\"}} 0\n");
        assert!(text(&r).contains(&line), "{line} in\n{}", text(&r));
    }
    // A leader watching two namespaces: the caches of both summed.
    let tasks = vec![
        cache::<BatchTask>(vec![
            object("BatchTask", "a", "t1"),
            object("BatchTask", "a", "t2"),
        ]),
        cache::<BatchTask>(vec![object("BatchTask", "b", "t1")]),
    ];
    let leases = vec![
        cache::<TaskLease>(vec![object("TaskLease", "a", "t1-1")]),
        cache::<TaskLease>(vec![object("TaskLease", "b", "t1-1")]),
    ];
    let queues = vec![
        cache::<TaskQueue>(vec![object("TaskQueue", "a", "demo")]),
        cache::<TaskQueue>(Vec::new()),
    ];
    m.watch_tasks(tasks, leases, queues, Vec::new(), None);
    let t = text(&r);
    for line in [
        "\n# TYPE batchlease_cache_objects gauge\n",
        "\nbatchlease_cache_objects{kind=\"BatchTask\"} 3\n",
        "\nbatchlease_cache_objects{kind=\"TaskLease\"} 2\n",
        "\nbatchlease_cache_objects{kind=\"TaskQueue\"} 1\n",
        // The other cache gauges, under their documented names.
        "\nbatchlease_tasks{namespace=\"a\",queue=\"demo\",phase=\"New\"} 2\n",
        "\n# TYPE batchlease_queue_leases_held gauge\n",
        "\n# TYPE batchlease_queue_oldest_ready_seconds gauge\n",
    ] {
        assert!(t.contains(line), "{line} in\n{t}");
    }
    assert!(!t.contains("batchlease_batchlease"), "{t}");
    // The term ends: its caches are dropped.
    m.watch_tasks(Vec::new(), Vec::new(), Vec::new(), Vec::new(), None);
    assert!(text(&r).contains("\nbatchlease_cache_objects{kind=\"BatchTask\"} 0\n"));
}

/// Every series of `queue` in namespace `ns`, one of each family.
fn every_series_of(m: &Metrics, ns: &str) {
    let queue = q(ns, "demo");
    for c in QueueCounter::ALL {
        m.count(c, &queue, 1);
    }
    for c in ReasonCounter::ALL {
        m.count_reason(c, &queue, "Boom");
    }
    m.record_speculative(&queue, true);
    m.observe_lock_wait(&queue, std::time::Duration::from_millis(20));
}

/// The metric families with a series carrying `namespace="<ns>"`.
fn families_with(text: &str, ns: &str) -> BTreeSet<String> {
    let label = format!("namespace=\"{ns}\"");
    text.lines()
        .filter(|l| !l.starts_with('#') && l.contains(&label))
        .filter_map(|l| l.split('{').next())
        .map(|n| n.trim_end_matches("_bucket").trim_end_matches("_count"))
        .map(|n| n.trim_end_matches("_sum").to_owned())
        .collect()
}

#[test]
fn a_deleted_queues_series_disappear_from_every_family() {
    let mut r = Registry::default();
    let m = Metrics::new(&mut r);
    every_series_of(&m, "a");
    every_series_of(&m, "b");
    let before = families_with(&text(&r), "b");
    // Every per-queue family the operator counts in, so a family added
    // without being forgotten fails here.
    let want: BTreeSet<String> = [
        "batchlease_leases_issued_total",
        "batchlease_reassignments_total",
        "batchlease_graph_cycle_detected_total",
        "batchlease_lock_contention_total",
        "batchlease_lock_lease_expired_before_release_total",
        "batchlease_lease_expired_before_release_total",
        "batchlease_tasks_dead_lettered_total",
        "batchlease_retries_total",
        "batchlease_queue_issues_throttled_total",
        "batchlease_speculative_attempts_total",
        "batchlease_speculative_aborts_total",
        "batchlease_speculative_abort_ratio",
        "batchlease_lock_acquisition_duration_seconds",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    assert_eq!(before, want);
    let live: HashSet<(String, String)> = [("a".to_owned(), "demo".to_owned())].into();
    assert_eq!(m.forget_queues_not_in(&live), 1);
    let t = text(&r);
    assert_eq!(families_with(&t, "b"), BTreeSet::new(), "{t}");
    assert_eq!(
        families_with(&t, "a"),
        want,
        "the live queue keeps its series"
    );
}

#[test]
fn the_abort_ratio_is_a_share_between_0_and_1() {
    let mut r = Registry::default();
    let m = Metrics::new(&mut r);
    m.record_speculative(&q("a", "demo"), true);
    m.record_speculative(&q("a", "demo"), false);
    let t = text(&r);
    assert!(
        t.contains("\nbatchlease_speculative_abort_ratio{namespace=\"a\",queue=\"demo\"} 0.5\n"),
        "{t}"
    );
    assert!(!t.contains("abort_rate"), "{t}");
}

#[test]
fn build_info_carries_the_version() {
    let mut r = Registry::default();
    let _m = Metrics::new(&mut r);
    let line = format!(
        "\nbatchlease_build_info{{version=\"{}\"}} 1\n",
        env!("CARGO_PKG_VERSION")
    );
    assert!(text(&r).contains(&line), "{line} in\n{}", text(&r));
}

#[test]
fn the_longest_lock_wait_of_each_queue_is_exported() {
    let mut r = Registry::default();
    let m = Metrics::new(&mut r);
    let pending = |name: &str, queue: &str| {
        let mut o = object("BatchTask", "a", name);
        o["spec"]["queue"] = queue.into();
        o["spec"]["resources"] = serde_json::json!(["db"]);
        o["status"] = serde_json::json!({"phase": "Pending"});
        o
    };
    let tasks = cache::<BatchTask>(vec![
        pending("t1", "demo"),
        pending("t2", "demo"),
        pending("t3", "other"),
    ]);
    let (tx, _rx) = futures::channel::mpsc::unbounded();
    let index = Arc::new(GraphIndex::new(tx));
    for t in tasks.state() {
        index.apply(&t);
    }
    let now = tokio::time::Instant::now();
    let ago = |s| now.checked_sub(std::time::Duration::from_secs(s)).unwrap();
    index.lock_wait_started("a", "t1", ago(100));
    index.lock_wait_started("a", "t2", ago(300));
    // A wait of a task gone from the cache is no wait.
    index.apply(&serde_json::from_value(pending("gone", "other")).unwrap());
    index.lock_wait_started("a", "gone", ago(900));
    m.watch_tasks(vec![tasks], Vec::new(), Vec::new(), vec![index], None);
    let t = text(&r);
    let value = |queue: &str| -> f64 {
        let prefix =
            format!("batchlease_lock_oldest_wait_seconds{{namespace=\"a\",queue=\"{queue}\"}} ");
        t.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .map_or(-1.0, |v| v.parse().unwrap())
    };
    let demo = value("demo");
    assert!(
        (300.0..400.0).contains(&demo),
        "the oldest of two: {demo}\n{t}"
    );
    assert_eq!(value("other"), -1.0, "t3 is not waiting\n{t}");
}

/// The metric names `text` (a file of the chart) uses that start with
/// one of `prefixes`: the words of letters, digits and `_` that do.
fn names_used(text: &str, prefixes: &[&str]) -> BTreeSet<String> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .filter(|w| prefixes.iter().any(|p| w.starts_with(p)))
        .map(str::to_owned)
        .collect()
}

/// The sample names an exposition can have: from its `# TYPE` lines,
/// with the suffixes each type adds.
fn sample_names(exposition: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for l in exposition.lines() {
        let mut w = l.split_whitespace();
        let (Some("#"), Some("TYPE"), Some(name), Some(kind)) =
            (w.next(), w.next(), w.next(), w.next())
        else {
            continue;
        };
        let suffixes: &[&str] = match kind {
            "counter" => &["_total"],
            "histogram" => &["_bucket", "_sum", "_count"],
            "info" => &["_info"],
            _ => &[""],
        };
        out.extend(suffixes.iter().map(|s| format!("{name}{s}")));
    }
    out
}

#[test]
fn every_operator_metric_the_chart_uses_is_exported() {
    let mut r = Registry::default();
    r.register_collector(Box::new(crate::process::ProcessCollector));
    let m = Metrics::new(&mut r);
    // A family shows in the exposition once it has a series.
    every_series_of(&m, "a");
    m.reconcile_errors
        .get_or_create(&ErrorLabels { kind: "kube" })
        .inc();
    let exported = sample_names(&text(&r));
    assert!(
        exported.contains("process_start_time_seconds"),
        "{exported:?}"
    );
    let chart = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../charts/batchlease-operator/files");
    for file in ["alerts.yaml", "dashboard.json"] {
        let text = std::fs::read_to_string(chart.join(file)).unwrap();
        let used = names_used(&text, &["batchlease_", "process_"]);
        // The SDK's are checked by the SDK's own test.
        let ours: Vec<&String> = used
            .iter()
            .filter(|n| !n.starts_with("batchlease_worker_"))
            .collect();
        assert!(ours.len() >= 5, "{file} uses operator metrics: {ours:?}");
        let missing: Vec<&&String> = ours.iter().filter(|n| !exported.contains(**n)).collect();
        assert!(
            missing.is_empty(),
            "{file} uses metrics the operator does not export: {missing:?}\nexported: {exported:?}"
        );
    }
}

#[test]
fn reason_labels_stay_low_cardinality() {
    for (reason, want) in [
        ("Boom", "Boom"),
        ("LeaseExpired", "LeaseExpired"),
        ("timeout after 3.2s", "Other"),
        ("lowercase", "Other"),
        ("", "Other"),
        ("Order-4711-Failed", "Other"),
    ] {
        assert_eq!(reason_label(reason), want, "{reason}");
    }
    assert_eq!(reason_label(&"A".repeat(65)), "Other");
}
