//! What the API server itself counted: `apiserver_request_total` from its
//! `/metrics` (through kubectl), so a benchmark reports the writes and the
//! failed writes a run cost — counted, not estimated (issue 12).

use std::collections::BTreeMap;

/// (verb, resource[/subresource], code) → requests.
pub type Counts = BTreeMap<(String, String, String), f64>;

/// The verbs that write, as the metric spells them (HTTP methods, and
/// APPLY for server-side apply).
pub const WRITES: [&str; 5] = ["POST", "PUT", "PATCH", "DELETE", "APPLY"];

/// Reads the API server's request counters now.
pub fn snapshot() -> anyhow::Result<Counts> {
    let text = crate::kubectl::ok(&["get", "--raw", "/metrics"])?;
    Ok(parse(&text))
}

/// `apiserver_request_total` samples of Prometheus text.
pub fn parse(text: &str) -> Counts {
    let mut out = Counts::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("apiserver_request_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let Ok(v) = value.trim().parse::<f64>() else {
            continue;
        };
        let label = |name: &str| {
            labels
                .split(',')
                .find_map(|kv| kv.strip_prefix(&format!("{name}=\"")))
                .map(|v| v.trim_end_matches('"').to_owned())
                .unwrap_or_default()
        };
        let mut resource = label("resource");
        let sub = label("subresource");
        if !sub.is_empty() {
            resource = format!("{resource}/{sub}");
        }
        *out.entry((label("verb"), resource, label("code")))
            .or_default() += v;
    }
    out
}

/// Watch events the API server has sent so far, per resource
/// (`apiserver_watch_events_total`: one per event per watcher, so a change
/// seen by W watches counts W times).
pub fn watch_events() -> anyhow::Result<BTreeMap<String, f64>> {
    let text = crate::kubectl::ok(&["get", "--raw", "/metrics"])?;
    Ok(parse_watch_events(&text))
}

/// `apiserver_watch_events_total` samples of Prometheus text, summed per
/// resource.
pub fn parse_watch_events(text: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("apiserver_watch_events_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let Ok(v) = value.trim().parse::<f64>() else {
            continue;
        };
        let resource = labels
            .split(',')
            .find_map(|kv| kv.strip_prefix("resource=\""))
            .map(|v| v.trim_end_matches('"').to_owned())
            .unwrap_or_default();
        *out.entry(resource).or_default() += v;
    }
    out
}

/// The API server's own CPU time so far (`process_cpu_seconds_total`).
pub fn cpu_seconds() -> anyhow::Result<f64> {
    let text = crate::kubectl::ok(&["get", "--raw", "/metrics"])?;
    text.lines()
        .find_map(|l| l.strip_prefix("process_cpu_seconds_total "))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no process_cpu_seconds_total in /metrics"))
}

/// Requests of every verb in `d` over `secs` seconds: a table by verb and
/// resource (requests/s; rows under one request in the window left out),
/// and the total rate.
pub fn per_second(d: &Counts, secs: f64) -> (String, f64) {
    let mut rows: BTreeMap<(String, String), f64> = BTreeMap::new();
    for ((verb, resource, _), v) in d {
        *rows.entry((resource.clone(), verb.clone())).or_default() += v;
    }
    let secs = secs.max(f64::EPSILON);
    let mut table = String::from("| resource | verb | requests/s |\n|---|---|---:|\n");
    let mut total = 0.0;
    for ((resource, verb), v) in &rows {
        total += v;
        if *v >= 1.0 {
            table.push_str(&format!("| {resource} | {verb} | {:.2} |\n", v / secs));
        }
    }
    (table, total / secs)
}

/// Requests in `d` of resource `resource` (subresources included) whose
/// verb is one of `verbs` and whose code starts with `code_prefix`.
pub fn count(d: &Counts, resource: &str, verbs: &[&str], code_prefix: &str) -> f64 {
    d.iter()
        .filter(|((verb, res, code), _)| {
            res.split('/').next() == Some(resource)
                && verbs.contains(&verb.as_str())
                && code.starts_with(code_prefix)
        })
        // A fold from +0.0: an empty `sum` of floats is -0.0.
        .fold(0.0, |acc, (_, v)| acc + v)
}

/// `after - before`, only what changed.
pub fn delta(before: &Counts, after: &Counts) -> Counts {
    after
        .iter()
        .filter_map(|(k, v)| {
            let d = v - before.get(k).copied().unwrap_or(0.0);
            (d > 0.0).then(|| (k.clone(), d))
        })
        .collect()
}

/// Writes in `d`, per task (`n`): a table by resource and verb, with the
/// failed ones (409 conflicts, other errors) beside; and the totals
/// (writes per task, conflicts per task) for resources in `of`.
pub fn per_task(d: &Counts, n: usize, of: &[&str]) -> (String, f64, f64) {
    let mut rows: BTreeMap<(String, String), (f64, f64, f64)> = BTreeMap::new();
    for ((verb, resource, code), v) in d {
        if !WRITES.contains(&verb.as_str()) {
            continue;
        }
        let e = rows.entry((resource.clone(), verb.clone())).or_default();
        match code.as_str() {
            c if c.starts_with('2') => e.0 += v,
            "409" => e.1 += v,
            _ => e.2 += v,
        }
    }
    let n = n.max(1) as f64;
    let mut table = String::from(
        "| resource | verb | ok / task | 409 / task | other errors / task |\n|---|---|---:|---:|---:|\n",
    );
    let (mut writes, mut conflicts) = (0.0, 0.0);
    for ((resource, verb), (ok, c, other)) in &rows {
        if ok + c + other < 0.5 {
            // Background noise (the control plane's own, other
            // namespaces' cleanup): under one request in the whole run.
            continue;
        }
        table.push_str(&format!(
            "| {resource} | {verb} | {:.2} | {:.2} | {:.2} |\n",
            ok / n,
            c / n,
            other / n
        ));
        if of.iter().any(|r| resource.split('/').next() == Some(*r)) {
            writes += ok;
            conflicts += c;
        }
    }
    (table, writes / n, conflicts / n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_writes_and_conflicts_per_task() {
        let before = parse(
            r#"# HELP apiserver_request_total x
apiserver_request_total{code="201",component="apiserver",dry_run="",group="batchlease.dev",resource="taskleases",scope="resource",subresource="",verb="POST",version="v1alpha1"} 5
apiserver_request_total{code="200",component="apiserver",dry_run="",group="batchlease.dev",resource="batchtasks",scope="resource",subresource="status",verb="PUT",version="v1alpha1"} 1
"#,
        );
        let after = parse(
            r#"apiserver_request_total{code="201",component="apiserver",dry_run="",group="batchlease.dev",resource="taskleases",scope="resource",subresource="",verb="POST",version="v1alpha1"} 15
apiserver_request_total{code="409",component="apiserver",dry_run="",group="batchlease.dev",resource="taskleases",scope="resource",subresource="",verb="PUT",version="v1alpha1"} 4
apiserver_request_total{code="200",component="apiserver",dry_run="",group="batchlease.dev",resource="batchtasks",scope="resource",subresource="status",verb="PUT",version="v1alpha1"} 21
apiserver_request_total{code="200",component="apiserver",dry_run="",group="",resource="pods",scope="namespace",subresource="",verb="LIST",version="v1"} 9
apiserver_request_total{code="201",component="apiserver",dry_run="",group="events.k8s.io",resource="events",scope="resource",subresource="",verb="POST",version="v1"} 30
"#,
        );
        let d = delta(&before, &after);
        assert_eq!(d.len(), 5);
        let (table, writes, conflicts) = per_task(&d, 10, &["taskleases", "batchtasks"]);
        assert!(
            table.contains("| batchtasks/status | PUT | 2.00 | 0.00 | 0.00 |"),
            "{table}"
        );
        assert!(table.contains("| events | POST | 3.00 |"), "{table}");
        assert!(!table.contains("LIST"), "reads are not writes");
        assert_eq!(
            writes, 3.0,
            "1 lease create + 2 status updates per task, events apart"
        );
        assert_eq!(conflicts, 0.4);
        assert_eq!(count(&d, "taskleases", &WRITES, "2"), 10.0);
        assert_eq!(count(&d, "batchtasks", &["PUT"], ""), 20.0);
        let (rates, total) = per_second(&d, 10.0);
        assert!(rates.contains("| pods | LIST | 0.90 |"), "{rates}");
        assert_eq!(total, (10.0 + 4.0 + 20.0 + 9.0 + 30.0) / 10.0);
    }

    #[test]
    fn sums_watch_events_per_resource() {
        let w = parse_watch_events(
            r#"# HELP apiserver_watch_events_total [BETA] Number of events sent in watch clients
apiserver_watch_events_total{group="batchlease.dev",resource="taskleases",version="v1alpha1"} 120
apiserver_watch_events_total{group="batchlease.dev",resource="taskleases",version="v1"} 3
apiserver_watch_events_total{group="coordination.k8s.io",resource="leases",version="v1"} 7
apiserver_request_total{code="200",resource="taskleases",verb="PUT"} 99
"#,
        );
        assert_eq!(w.get("taskleases"), Some(&123.0));
        assert_eq!(w.get("leases"), Some(&7.0));
        assert_eq!(w.len(), 2, "{w:?}");
    }
}
