//! The chart's monitoring, as `helm template` renders it (no cluster): the
//! PrometheusRule is rendered only where the API server serves it (or
//! forced), its groups are `files/alerts.yaml` — the file promtool checks
//! and unit-tests (hack/test.sh) — with each configured threshold in its
//! place and nothing else changed, every alert has a firing and a quiet
//! promtool case, and the Grafana dashboard ConfigMap carries the
//! sidecar's label and `files/dashboard.json` as valid JSON. That every
//! metric they name is exported is checked by the unit tests of the
//! operator (`operator/src/metrics.rs`) and the SDK (`worker-sdk/src/metrics.rs`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use batchlease_e2e::helm;
use serde_json::Value;

const CHART: &str = "charts/batchlease-operator";
const RULE_API: &str = "monitoring.coreos.com/v1/PrometheusRule";

fn file(path: &str) -> String {
    std::fs::read_to_string(batchlease_e2e::repo_root().join(path)).unwrap()
}

fn yaml(text: &str) -> Value {
    serde_yaml::from_str(text).unwrap()
}

/// The documents of `kind` that `helm template` renders with `args`.
fn render(kind: &str, args: &[&str]) -> Vec<Value> {
    let mut all = vec!["r", CHART];
    all.extend_from_slice(args);
    helm::rendered(&helm::template(&all).unwrap(), kind).unwrap()
}

/// The one PrometheusRule rendered with the rules on, the API served, and
/// `sets`.
fn rule_with(sets: &[String]) -> Value {
    let mut args = vec![
        "--set",
        "metrics.prometheusRule.enabled=true",
        "--api-versions",
        RULE_API,
    ];
    for s in sets {
        args.extend(["--set", s.as_str()]);
    }
    let mut rules = render("PrometheusRule", &args);
    assert_eq!(rules.len(), 1, "{rules:?}");
    rules.remove(0)
}

/// The thresholds of values.yaml, with their defaults.
fn thresholds() -> serde_json::Map<String, Value> {
    let values = yaml(&file(&format!("{CHART}/values.yaml")));
    values["metrics"]["prometheusRule"]["thresholds"]
        .as_object()
        .unwrap()
        .clone()
}

/// `alert name → expr` of a rule file's groups.
fn exprs(groups: &Value) -> Vec<(String, String)> {
    groups["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap())
        .map(|r| {
            (
                r["alert"].as_str().unwrap().to_owned(),
                r["expr"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

#[test]
fn the_prometheus_rule_is_rendered_only_where_its_api_is_served_or_forced() {
    let on = ["--set", "metrics.prometheusRule.enabled=true"];
    assert!(
        render("PrometheusRule", &on).is_empty(),
        "no Prometheus Operator: nothing to apply it to"
    );
    assert_eq!(
        render(
            "PrometheusRule",
            &[&on[..], &["--api-versions", RULE_API]].concat()
        )
        .len(),
        1
    );
    let forced = [&on[..], &["--set", "metrics.prometheusRule.force=true"]].concat();
    assert_eq!(render("PrometheusRule", &forced).len(), 1);
    // Off by default, served API or not.
    assert!(render("PrometheusRule", &["--api-versions", RULE_API]).is_empty());
}

#[test]
fn the_rendered_rules_are_the_promtool_tested_file_with_the_configured_thresholds() {
    let want = yaml(&file(&format!("{CHART}/files/alerts.yaml")));
    // The defaults of values.yaml are the numbers promtool tested.
    let rule = rule_with(&[
        "metrics.prometheusRule.namespace=monitoring".into(),
        "metrics.prometheusRule.labels.release=kube-prometheus-stack".into(),
    ]);
    assert_eq!(rule["spec"], want, "the defaults render the file unchanged");
    assert_eq!(rule["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(rule["metadata"]["namespace"], "monitoring");
    assert_eq!(
        rule["metadata"]["labels"]["release"],
        "kube-prometheus-stack"
    );

    // Each threshold changes its own alert's expression, at its number.
    let file_exprs = exprs(&want);
    let names = thresholds();
    assert!(names.len() >= 6, "{names:?}");
    for (name, default) in &names {
        let marker = format!("# threshold: {name}");
        let uses: Vec<&(String, String)> = file_exprs
            .iter()
            .filter(|(_, e)| e.contains(&marker))
            .collect();
        assert_eq!(uses.len(), 1, "{name} is used by one alert: {uses:?}");
        let (alert, expr) = uses[0];
        assert!(
            expr.contains(&format!("{} {marker}", default)),
            "{alert}: values.yaml's default {default} is the file's number:\n{expr}"
        );
        let odd = if default.as_f64().unwrap() < 1.0 && default.as_f64().unwrap() > 0.0 {
            "0.4242"
        } else {
            "4242"
        };
        let got =
            exprs(&rule_with(&[format!("metrics.prometheusRule.thresholds.{name}={odd}")])["spec"]);
        for ((a, e), (_, before)) in got.iter().zip(&file_exprs) {
            if a == alert {
                assert_eq!(
                    e,
                    &expr.replace(&format!("{default} {marker}"), &format!("{odd} {marker}")),
                    "{name}"
                );
            } else {
                assert_eq!(e, before, "{name} changed {a}");
            }
        }
    }
}

#[test]
fn every_alert_has_a_firing_and_a_quiet_promtool_case() {
    let alerts: Vec<String> = exprs(&yaml(&file(&format!("{CHART}/files/alerts.yaml"))))
        .into_iter()
        .map(|(a, _)| a)
        .collect();
    assert!(alerts.len() >= 8, "{alerts:?}");
    let tests = yaml(&file("e2e/promtool/alerts_test.yaml"));
    assert_eq!(
        tests["rule_files"][0], "../../charts/batchlease-operator/files/alerts.yaml",
        "promtool tests the file the chart embeds, not a copy"
    );
    let cases: Vec<&Value> = tests["tests"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|t| t["alert_rule_test"].as_array().unwrap())
        .collect();
    for alert in &alerts {
        let of: Vec<&&Value> = cases.iter().filter(|c| c["alertname"] == *alert).collect();
        let fires = of
            .iter()
            .any(|c| c["exp_alerts"].as_array().is_some_and(|a| !a.is_empty()));
        let quiet = of
            .iter()
            .any(|c| c["exp_alerts"].as_array().is_some_and(Vec::is_empty));
        assert!(fires && quiet, "{alert}: fires {fires}, quiet {quiet}");
    }
}

#[test]
fn the_dashboard_configmap_carries_the_sidecar_label_and_the_dashboard() {
    assert!(
        render("ConfigMap", &[])
            .iter()
            .all(|c| !c["metadata"]["name"]
                .as_str()
                .unwrap()
                .ends_with("-dashboard")),
        "off by default"
    );
    let dashboards = |sets: &[&str]| -> Vec<Value> {
        let mut args = vec!["--set", "metrics.grafanaDashboard.enabled=true"];
        for s in sets {
            args.extend(["--set", s]);
        }
        render("ConfigMap", &args)
            .into_iter()
            .filter(|c| {
                c["metadata"]["name"]
                    .as_str()
                    .unwrap()
                    .ends_with("-dashboard")
            })
            .collect()
    };
    let cms = dashboards(&[]);
    assert_eq!(cms.len(), 1, "{cms:?}");
    let cm = &cms[0];
    assert_eq!(cm["metadata"]["labels"]["grafana_dashboard"], "1");
    let data = cm["data"].as_object().unwrap();
    assert_eq!(data.len(), 1, "one dashboard");
    let (key, json) = data.iter().next().unwrap();
    assert!(key.ends_with(".json"), "{key}");
    let dashboard: Value = serde_json::from_str(json.as_str().unwrap()).unwrap();
    let want: Value =
        serde_json::from_str(&file(&format!("{CHART}/files/dashboard.json"))).unwrap();
    assert_eq!(dashboard, want);
    // A dashboard Grafana can show: a uid, panels with queries, and the
    // data source as a variable (no instance's data source uid baked in).
    assert_eq!(dashboard["uid"], "batchlease-operator");
    let targets: Vec<&Value> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().into_iter().flatten())
        .collect();
    assert!(targets.len() >= 20, "{}", targets.len());
    for t in &targets {
        assert_eq!(t["datasource"]["uid"], "${datasource}", "{t}");
        assert!(t["expr"].as_str().is_some_and(|e| !e.is_empty()), "{t}");
    }

    // Where the sidecar looks, and what it matches.
    let cm = &dashboards(&[
        "metrics.grafanaDashboard.namespace=grafana",
        "metrics.grafanaDashboard.labels.grafana_dashboard=null",
        "metrics.grafanaDashboard.labels.dashboards=batchlease",
        "metrics.grafanaDashboard.annotations.grafana_folder=batchlease",
    ])[0];
    assert_eq!(cm["metadata"]["namespace"], "grafana");
    assert_eq!(cm["metadata"]["labels"]["dashboards"], "batchlease");
    assert!(cm["metadata"]["labels"].get("grafana_dashboard").is_none());
    assert_eq!(
        cm["metadata"]["annotations"]["grafana_folder"],
        "batchlease"
    );
}

#[test]
fn the_service_monitor_keeps_the_tenant_namespace_label() {
    let sms = render(
        "ServiceMonitor",
        &["--set", "metrics.serviceMonitor.enabled=true"],
    );
    assert_eq!(sms.len(), 1);
    // Not renamed exported_namespace: the dashboard and the alerts select
    // tenants by `namespace`.
    assert_eq!(sms[0]["spec"]["endpoints"][0]["honorLabels"], true);
}
