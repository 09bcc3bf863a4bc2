//! Operator metrics (design §7), served as Prometheus text on `/metrics`.
//! Labels stay low-cardinality: queue, reason, outcome — never task names.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use batchlease_api::{BatchTask, LeasePhase, TaskLease, TaskPhase};
use k8s_openapi::jiff::Timestamp;
use kube::runtime::reflector::Store;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

use crate::speculation::{AbortWindow, Band, band};

/// `queue`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QueueLabels {
    pub queue: String,
}

/// `queue`, `reason`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub queue: String,
    pub reason: String,
}

/// `kind`: the error category of a failed reconcile.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub kind: &'static str,
}

/// Every metric the operator updates.
#[derive(Debug)]
pub struct Metrics {
    pub leases_issued: Family<QueueLabels, Counter>,
    pub lease_expired_before_release: Family<ReasonLabels, Counter>,
    pub reassignments: Family<QueueLabels, Counter>,
    pub tasks_dead_lettered: Family<ReasonLabels, Counter>,
    pub retries: Family<ReasonLabels, Counter>,
    pub reconcile_duration: Histogram,
    pub reconcile_errors: Family<ErrorLabels, Counter>,
    pub write_conflicts: Counter,
    pub is_leader: Gauge,
    pub graph_cycle_detected: Family<QueueLabels, Counter>,
    pub lock_acquisition_duration: Histogram,
    pub lock_contention: Family<QueueLabels, Counter>,
    pub lock_lease_expired_before_release: Family<QueueLabels, Counter>,
    pub speculative_attempts: Family<QueueLabels, Counter>,
    pub speculative_aborts: Family<QueueLabels, Counter>,
    pub speculative_abort_rate: Family<QueueLabels, Gauge<f64, AtomicU64>>,
    pub queue_issues_throttled: Family<ReasonLabels, Counter>,
    abort_window: Mutex<AbortWindow>,
    tasks: TaskPhases,
}

impl Metrics {
    /// Creates the metrics and registers them under the `batchlease` prefix.
    pub fn new(registry: &mut Registry) -> Arc<Self> {
        let m = Self {
            leases_issued: Family::default(),
            lease_expired_before_release: Family::default(),
            reassignments: Family::default(),
            tasks_dead_lettered: Family::default(),
            retries: Family::default(),
            reconcile_duration: Histogram::new(exponential_buckets(0.001, 2.0, 14)),
            reconcile_errors: Family::default(),
            write_conflicts: Counter::default(),
            is_leader: Gauge::default(),
            graph_cycle_detected: Family::default(),
            lock_acquisition_duration: Histogram::new(exponential_buckets(0.005, 2.0, 16)),
            lock_contention: Family::default(),
            lock_lease_expired_before_release: Family::default(),
            speculative_attempts: Family::default(),
            speculative_aborts: Family::default(),
            speculative_abort_rate: Family::default(),
            queue_issues_throttled: Family::default(),
            abort_window: Mutex::new(AbortWindow::default()),
            tasks: TaskPhases::default(),
        };
        let r = registry.sub_registry_with_prefix("batchlease");
        r.register(
            "leases_issued",
            "TaskLeases offered",
            m.leases_issued.clone(),
        );
        r.register(
            "lease_expired_before_release",
            "Held leases taken away because no renewal was observed in time (or the attempt overran its deadline)",
            m.lease_expired_before_release.clone(),
        );
        r.register(
            "reassignments",
            "Tasks offered again after their holder's lease expired",
            m.reassignments.clone(),
        );
        r.register(
            "tasks_dead_lettered",
            "Tasks moved to DeadLettered",
            m.tasks_dead_lettered.clone(),
        );
        r.register(
            "retries",
            "Attempts that failed and were scheduled again",
            m.retries.clone(),
        );
        r.register(
            "reconcile_duration_seconds",
            "Time spent in one reconcile",
            m.reconcile_duration.clone(),
        );
        r.register(
            "reconcile_errors",
            "Reconciles that ended in an error, by category",
            m.reconcile_errors.clone(),
        );
        r.register(
            "write_conflicts",
            "Conditional writes refused with 409 (stale read; retried)",
            m.write_conflicts.clone(),
        );
        r.register(
            "is_leader",
            "1 while this replica holds the leader lease",
            m.is_leader.clone(),
        );
        r.register(
            "graph_cycle_detected",
            "Tasks rejected for being on a dependency cycle",
            m.graph_cycle_detected.clone(),
        );
        r.register(
            "lock_acquisition_duration_seconds",
            "Time from a task's first attempt to take its resource locks until it held them all",
            m.lock_acquisition_duration.clone(),
        );
        r.register(
            "lock_contention",
            "Lock acquisitions blocked, counted once per task and blocker (another holder, or an older waiting task)",
            m.lock_contention.clone(),
        );
        r.register(
            "lock_lease_expired_before_release",
            "Resource locks given back because the holder's TaskLease expired before it completed",
            m.lock_lease_expired_before_release.clone(),
        );
        r.register(
            "speculative_attempts",
            "Settled attempts that ran speculatively (aborted, succeeded or failed; drained ones not counted)",
            m.speculative_attempts.clone(),
        );
        r.register(
            "speculative_aborts",
            "Speculative attempts whose compare-and-swap commit lost",
            m.speculative_aborts.clone(),
        );
        r.register(
            "speculative_abort_rate",
            "Aborted share of the queue's last 100 speculative attempts (over 0.3: livelock)",
            m.speculative_abort_rate.clone(),
        );
        r.register(
            "queue_issues_throttled",
            "Tasks a TaskQueue held back from being issued, by reason (paused, max_concurrent, rate); counted once per wait",
            m.queue_issues_throttled.clone(),
        );
        r.register_collector(Box::new(m.tasks.clone()));
        Arc::new(m)
    }

    /// The abort rate and sample count `queue` would have with this
    /// outcome: for the condition written with the settling status.
    pub fn abort_rate_with(&self, queue: &str, aborted: bool) -> (f64, usize) {
        self.abort_window
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .with(queue, aborted)
    }

    /// Counts a settled speculative attempt (once its status is written);
    /// returns the queue's band before and after.
    pub fn record_speculative(&self, queue: &str, aborted: bool) -> (Band, Band) {
        let labels = QueueLabels {
            queue: queue.to_owned(),
        };
        self.speculative_attempts.get_or_create(&labels).inc();
        if aborted {
            self.speculative_aborts.get_or_create(&labels).inc();
        }
        let mut w = self.abort_window.lock().unwrap_or_else(|e| e.into_inner());
        let (was, n_was) = w.rate(queue);
        let (rate, n) = w.record(queue, aborted);
        self.speculative_abort_rate.get_or_create(&labels).set(rate);
        (band(was, n_was), band(rate, n))
    }

    /// Lets `batchlease_tasks{queue,phase}` count the tasks in these caches
    /// (the current term's; a standby counts none).
    pub fn watch_tasks(&self, stores: Vec<Store<BatchTask>>, leases: Vec<Store<TaskLease>>) {
        *self.tasks.stores.lock().unwrap_or_else(|e| e.into_inner()) = stores;
        *self.tasks.leases.lock().unwrap_or_else(|e| e.into_inner()) = leases;
    }
}

/// `batchlease_tasks{queue,phase}`, computed from the task caches at scrape
/// time, so deleted tasks never linger in a gauge.
#[derive(Clone, Debug, Default)]
struct TaskPhases {
    stores: Arc<Mutex<Vec<Store<BatchTask>>>>,
    leases: Arc<Mutex<Vec<Store<TaskLease>>>>,
}

impl prometheus_client::collector::Collector for TaskPhases {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut counts: BTreeMap<(String, String), i64> = BTreeMap::new();
        let mut oldest: BTreeMap<String, Timestamp> = BTreeMap::new();
        for store in self.stores.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            for task in store.state() {
                let phase = task.status.as_ref().and_then(|s| s.phase);
                if phase == Some(TaskPhase::Ready) {
                    let since = task.status.as_ref().and_then(|s| {
                        s.conditions
                            .iter()
                            .find(|c| c.type_ == batchlease_api::keys::condition::LEASED)
                            .map(|c| c.last_transition_time.0)
                    });
                    if let Some(since) = since {
                        let o = oldest.entry(task.spec.queue.clone()).or_insert(since);
                        *o = (*o).min(since);
                    }
                }
                let phase = phase.map_or("New", |p| p.as_str());
                *counts
                    .entry((task.spec.queue.clone(), phase.to_owned()))
                    .or_default() += 1;
            }
        }
        let gauge = ConstGauge::new(0i64);
        let mut family = encoder.encode_descriptor(
            "batchlease_tasks",
            "BatchTasks by queue and phase",
            None,
            gauge.metric_type(),
        )?;
        for ((queue, phase), n) in counts {
            let labels = [("queue", queue), ("phase", phase)];
            ConstGauge::new(n).encode(family.encode_family(&labels)?)?;
        }
        let mut held: BTreeMap<String, i64> = BTreeMap::new();
        for store in self.leases.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            for l in store.state() {
                if l.status.as_ref().and_then(|s| s.phase) == Some(LeasePhase::Held) {
                    *held.entry(l.spec.queue.clone()).or_default() += 1;
                }
            }
        }
        let mut family = encoder.encode_descriptor(
            "batchlease_queue_leases_held",
            "TaskLeases Held, by queue",
            None,
            gauge.metric_type(),
        )?;
        for (queue, n) in held {
            ConstGauge::new(n).encode(family.encode_family(&[("queue", queue)])?)?;
        }
        let now = Timestamp::now();
        let age = ConstGauge::new(0f64);
        let mut family = encoder.encode_descriptor(
            "batchlease_queue_oldest_ready_seconds",
            "Age of the longest-waiting Ready task's offer, by queue",
            None,
            age.metric_type(),
        )?;
        for (queue, since) in oldest {
            let secs = now.duration_since(since).as_secs_f64().max(0.0);
            ConstGauge::new(secs).encode(family.encode_family(&[("queue", queue)])?)?;
        }
        Ok(())
    }
}

/// A failure reason as a metric label. Reasons come from workers; only
/// short CamelCase words pass, anything else is `Other`, so a handler that
/// puts variable text in its reason cannot blow up the label set.
pub fn reason_label(reason: &str) -> String {
    let camel = reason.len() <= 64
        && reason
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_uppercase())
        && reason.chars().all(|c| c.is_ascii_alphanumeric());
    if camel {
        reason.to_owned()
    } else {
        "Other".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::reason_label;

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
}
