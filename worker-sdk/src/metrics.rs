//! SDK metrics (design §7), registered in the application's registry.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// `reason`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

/// `outcome`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: &'static str,
}

/// The worker's metrics.
#[derive(Debug, Clone)]
pub struct WorkerMetrics {
    pub renewal_latency: Histogram,
    pub kill_switch: Family<ReasonLabels, Counter>,
    pub fenced_commit_rejected: Counter,
    pub refused_by_storage: Counter,
    pub claims: Counter,
    /// Bound attempts (created held by this worker, no claim) started.
    pub bound_started: Counter,
    pub claim_conflicts: Counter,
    pub claims_refused: Counter,
    pub completions: Family<OutcomeLabels, Counter>,
    pub completion_rejected: Counter,
    /// Speculative rounds by outcome: `committed`, `conflict`, `failed`.
    pub speculative_rounds: Family<OutcomeLabels, Counter>,
    /// Compensations by outcome: `ran`, `failed`, `skipped` (its round
    /// committed after all).
    pub compensations: Family<OutcomeLabels, Counter>,
    /// Attempts that ended before their handler ran, by why (`registration`:
    /// the storage refused or could not take the token's registration).
    /// Given back as `Interrupted`: no retry spent.
    pub not_started: Family<ReasonLabels, Counter>,
    /// 1 while the worker does not claim because its attempts keep ending
    /// before their handler runs (see `claim_brake`), else 0.
    pub claims_paused: Gauge,
    /// How often the worker stopped claiming for that reason.
    pub claim_pauses: Counter,
}

impl Default for WorkerMetrics {
    fn default() -> Self {
        Self {
            renewal_latency: Histogram::new(exponential_buckets(0.001, 2.0, 14)),
            kill_switch: Family::default(),
            fenced_commit_rejected: Counter::default(),
            refused_by_storage: Counter::default(),
            claims: Counter::default(),
            bound_started: Counter::default(),
            claim_conflicts: Counter::default(),
            claims_refused: Counter::default(),
            completions: Family::default(),
            completion_rejected: Counter::default(),
            speculative_rounds: Family::default(),
            compensations: Family::default(),
            not_started: Family::default(),
            claims_paused: Gauge::default(),
            claim_pauses: Counter::default(),
        }
    }
}

impl WorkerMetrics {
    /// Registers every metric under the `batchlease_worker` prefix.
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("batchlease_worker");
        // Which SDK version a worker runs: `batchlease_worker_build_info{version} 1`.
        let build_info = Family::<Vec<(&'static str, &'static str)>, Gauge>::default();
        build_info
            .get_or_create(&vec![("version", env!("CARGO_PKG_VERSION"))])
            .set(1);
        r.register(
            "build_info",
            "Always 1; the batchlease worker SDK's version as a label",
            build_info,
        );
        r.register(
            "renewal_latency_seconds",
            "Round trip of a lease renewal",
            self.renewal_latency.clone(),
        );
        r.register(
            "kill_switch",
            "Attempts stopped locally by the kill switch",
            self.kill_switch.clone(),
        );
        r.register(
            "fenced_commit_rejected",
            "Commits refused because the attempt was fenced or revoked",
            self.fenced_commit_rejected.clone(),
        );
        r.register(
            "refused_by_storage",
            "Writes the storage refused as fenced (a newer attempt registered first)",
            self.refused_by_storage.clone(),
        );
        r.register("claims", "Leases claimed", self.claims.clone());
        r.register(
            "bound_attempts_started",
            "Bound attempts (leases the operator created held by this worker, no claim) started",
            self.bound_started.clone(),
        );
        r.register(
            "claims_refused",
            "Offered leases not claimed because they are not their task's current lease (stale or forged)",
            self.claims_refused.clone(),
        );
        r.register(
            "claim_conflicts",
            "Claims lost to another worker (409)",
            self.claim_conflicts.clone(),
        );
        r.register(
            "completions",
            "Attempts completed, by outcome",
            self.completions.clone(),
        );
        r.register(
            "completion_rejected",
            "Completions refused because the lease was no longer ours",
            self.completion_rejected.clone(),
        );
        r.register(
            "speculative_rounds",
            "Speculative rounds, by outcome (committed, conflict, failed)",
            self.speculative_rounds.clone(),
        );
        r.register(
            "compensations",
            "Compensations of rounds that did not commit, by outcome (ran, failed, skipped)",
            self.compensations.clone(),
        );
        r.register(
            "attempts_not_started",
            "Attempts that ended before their handler ran (given back, no retry spent), by why",
            self.not_started.clone(),
        );
        r.register(
            "claims_paused",
            "1 while the worker does not claim because its attempts keep ending before their handler runs",
            self.claims_paused.clone(),
        );
        r.register(
            "claim_pauses",
            "Times the worker stopped claiming because its attempts kept ending before their handler ran",
            self.claim_pauses.clone(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// The exposition with a series in every family (a family shows in it
    /// only once it has one).
    fn exposition() -> String {
        let mut r = Registry::default();
        let m = WorkerMetrics::default();
        m.register(&mut r);
        for f in [&m.kill_switch, &m.not_started] {
            f.get_or_create(&ReasonLabels { reason: "x" }).inc();
        }
        for f in [&m.completions, &m.speculative_rounds, &m.compensations] {
            f.get_or_create(&OutcomeLabels { outcome: "x" }).inc();
        }
        let mut s = String::new();
        prometheus_client::encoding::text::encode(&mut s, &r).unwrap();
        s
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
                _ => &[""],
            };
            out.extend(suffixes.iter().map(|s| format!("{name}{s}")));
        }
        out
    }

    #[test]
    fn build_info_carries_the_sdk_version() {
        let line = format!(
            "\nbatchlease_worker_build_info{{version=\"{}\"}} 1\n",
            env!("CARGO_PKG_VERSION")
        );
        assert!(exposition().contains(&line), "{line} in\n{}", exposition());
    }

    /// The operator chart's dashboard and alerts name SDK metrics too: a
    /// rename here must fail until they follow.
    #[test]
    fn every_worker_metric_the_chart_uses_is_exported() {
        let exported = sample_names(&exposition());
        assert!(
            exported.contains("batchlease_worker_claims_total"),
            "{exported:?}"
        );
        let chart = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../charts/batchlease-operator/files");
        let mut used = BTreeSet::new();
        for file in ["alerts.yaml", "dashboard.json"] {
            let text = std::fs::read_to_string(chart.join(file)).unwrap();
            used.extend(
                text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .filter(|w| w.starts_with("batchlease_worker_"))
                    .map(str::to_owned),
            );
        }
        assert!(used.len() >= 5, "the dashboard shows the workers: {used:?}");
        let missing: Vec<&String> = used.iter().filter(|n| !exported.contains(*n)).collect();
        assert!(
            missing.is_empty(),
            "the chart uses worker metrics the SDK does not export: {missing:?}\nexported: {exported:?}"
        );
    }
}
