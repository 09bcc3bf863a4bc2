//! Operator metrics (design §7), served as Prometheus text on `/metrics`.
//! Labels stay low-cardinality: namespace, queue, reason, outcome — never
//! task names. A queue is a name within a namespace, so every per-queue
//! series carries both (tenants whose queues share a name are not summed
//! into one series), and the series of a queue that is gone (no task of
//! it in the caches) are removed (see [`Metrics::forget_gone_queues`]):
//! the label set stays bounded by the queues that exist.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::{Arc, Mutex};

use batchlease_api::{BatchTask, LeasePhase, TaskLease, TaskPhase, TaskQueue};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::reflector::{ObjectRef, Store};
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

use crate::graph_index::GraphIndex;
use crate::speculation::{AbortWindow, Band, band};
use crate::sync_counter::SyncCounter;

/// `namespace`, `queue`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct QueueLabels {
    pub namespace: String,
    pub queue: String,
}

impl QueueLabels {
    /// The queue of `task`.
    pub fn of(task: &BatchTask) -> Self {
        Self {
            namespace: task.namespace().unwrap_or_default(),
            queue: task.spec.queue.clone(),
        }
    }

    fn with_reason(&self, reason: &str) -> ReasonLabels {
        ReasonLabels {
            namespace: self.namespace.clone(),
            queue: self.queue.clone(),
            reason: reason.to_owned(),
        }
    }
}

/// `namespace`, `queue`, `reason`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub namespace: String,
    pub queue: String,
    pub reason: String,
}

/// The per-queue counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueueCounter {
    LeasesIssued,
    Reassignments,
    GraphCycleDetected,
    LockContention,
    LockLeaseExpiredBeforeRelease,
}

impl QueueCounter {
    /// Every one: what a gone queue's series are removed from.
    pub const ALL: [Self; 5] = [
        Self::LeasesIssued,
        Self::Reassignments,
        Self::GraphCycleDetected,
        Self::LockContention,
        Self::LockLeaseExpiredBeforeRelease,
    ];
}

/// The per-queue counters with a reason.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReasonCounter {
    LeaseExpiredBeforeRelease,
    TasksDeadLettered,
    Retries,
    QueueIssuesThrottled,
}

impl ReasonCounter {
    /// Every one: what a gone queue's series are removed from.
    pub const ALL: [Self; 4] = [
        Self::LeaseExpiredBeforeRelease,
        Self::TasksDeadLettered,
        Self::Retries,
        Self::QueueIssuesThrottled,
    ];
}

/// A histogram family: each queue's histogram made with the same buckets.
type Histograms = Family<QueueLabels, Histogram, fn() -> Histogram>;

/// The buckets of `batchlease_lock_acquisition_duration_seconds`: 5 ms to
/// about 3 min.
fn lock_wait_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.005, 2.0, 16))
}

/// `kind`: the error category of a failed reconcile.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub kind: &'static str,
}

/// Every metric the operator updates.
#[derive(Debug)]
pub struct Metrics {
    leases_issued: Family<QueueLabels, Counter>,
    lease_expired_before_release: Family<ReasonLabels, Counter>,
    reassignments: Family<QueueLabels, Counter>,
    tasks_dead_lettered: Family<ReasonLabels, Counter>,
    retries: Family<ReasonLabels, Counter>,
    pub reconcile_duration: Histogram,
    pub reconcile_errors: Family<ErrorLabels, Counter>,
    pub write_conflicts: Counter,
    /// Attempts revoked on their holder's WorkerLease before an end.
    pub revocations: Counter,
    /// Offers addressed again (their worker lapsed, or left them
    /// unclaimed while another had a free slot).
    pub offers_readdressed: Counter,
    pub attempts_bound: Counter,
    pub is_leader: Gauge,
    graph_cycle_detected: Family<QueueLabels, Counter>,
    lock_acquisition_duration: Histograms,
    lock_contention: Family<QueueLabels, Counter>,
    lock_lease_expired_before_release: Family<QueueLabels, Counter>,
    speculative_attempts: Family<QueueLabels, Counter>,
    speculative_aborts: Family<QueueLabels, Counter>,
    speculative_abort_ratio: Family<QueueLabels, Gauge<f64, AtomicU64>>,
    queue_issues_throttled: Family<ReasonLabels, Counter>,
    abort_window: Mutex<AbortWindow>,
    /// The queues with series, and the reasons each was counted with (to
    /// remove them when the queue is gone: a family cannot be listed).
    series: Mutex<BTreeMap<QueueLabels, BTreeSet<String>>>,
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
            revocations: Counter::default(),
            offers_readdressed: Counter::default(),
            attempts_bound: Counter::default(),
            is_leader: Gauge::default(),
            graph_cycle_detected: Family::default(),
            lock_acquisition_duration: Family::new_with_constructor(lock_wait_histogram),
            lock_contention: Family::default(),
            lock_lease_expired_before_release: Family::default(),
            speculative_attempts: Family::default(),
            speculative_aborts: Family::default(),
            speculative_abort_ratio: Family::default(),
            queue_issues_throttled: Family::default(),
            abort_window: Mutex::new(AbortWindow::default()),
            series: Mutex::default(),
            tasks: TaskPhases::default(),
        };
        let r = registry.sub_registry_with_prefix("batchlease");
        // Which version runs where: `batchlease_build_info{version} 1`, the
        // usual info gauge (a dashboard's version column, an alert's join
        // to tell the operator's processes from others).
        let build_info = Family::<Vec<(&'static str, &'static str)>, Gauge>::default();
        build_info
            .get_or_create(&vec![("version", env!("CARGO_PKG_VERSION"))])
            .set(1);
        r.register(
            "build_info",
            "Always 1; the operator's version as a label",
            build_info,
        );
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
            "worker_lease_revocations",
            "Attempts revoked on their holder's WorkerLease before the operator ended them (expiry, cancel)",
            m.revocations.clone(),
        );
        r.register(
            "offers_readdressed",
            "Offers addressed to another worker, or opened to all, because their worker lapsed or left them unclaimed for a TTL",
            m.offers_readdressed.clone(),
        );
        r.register(
            "attempts_bound",
            "Leases created already Held by the worker they were addressed to (a bound attempt: no claim write)",
            m.attempts_bound.clone(),
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
            "Time from a task's first attempt to take its resource locks (a lock taken, or the first block) until it held them all",
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
            "speculative_abort_ratio",
            "Aborted share (0 to 1) of the queue's last 100 speculative attempts (over 0.3: livelock)",
            m.speculative_abort_ratio.clone(),
        );
        r.register(
            "queue_issues_throttled",
            "Tasks held back from being issued, by reason (paused, max_concurrent, rate: their TaskQueue; worker_slots: no free slot among the queue's workers that take bound attempts); counted once per wait",
            m.queue_issues_throttled.clone(),
        );
        // Its descriptors are named without the prefix, which the
        // sub-registry adds (they once had it too: `batchlease_batchlease_tasks`).
        r.register_collector(Box::new(m.tasks.clone()));
        Arc::new(m)
    }

    fn note(&self, queue: &QueueLabels, reason: Option<&str>) {
        let mut series = self.series.lock().unwrap_or_else(|e| e.into_inner());
        let reasons = series.entry(queue.clone()).or_default();
        if let Some(r) = reason {
            reasons.insert(r.to_owned());
        }
    }

    fn queue_family(&self, c: QueueCounter) -> &Family<QueueLabels, Counter> {
        match c {
            QueueCounter::LeasesIssued => &self.leases_issued,
            QueueCounter::Reassignments => &self.reassignments,
            QueueCounter::GraphCycleDetected => &self.graph_cycle_detected,
            QueueCounter::LockContention => &self.lock_contention,
            QueueCounter::LockLeaseExpiredBeforeRelease => &self.lock_lease_expired_before_release,
        }
    }

    fn reason_family(&self, c: ReasonCounter) -> &Family<ReasonLabels, Counter> {
        match c {
            ReasonCounter::LeaseExpiredBeforeRelease => &self.lease_expired_before_release,
            ReasonCounter::TasksDeadLettered => &self.tasks_dead_lettered,
            ReasonCounter::Retries => &self.retries,
            ReasonCounter::QueueIssuesThrottled => &self.queue_issues_throttled,
        }
    }

    /// Adds `n` to counter `c` of `queue`.
    pub fn count(&self, c: QueueCounter, queue: &QueueLabels, n: u64) {
        self.note(queue, None);
        self.queue_family(c).get_or_create(queue).inc_by(n);
    }

    /// Adds one to counter `c` of `queue` with `reason` (a low-cardinality
    /// label: a fixed word, or [`reason_label`]'s).
    pub fn count_reason(&self, c: ReasonCounter, queue: &QueueLabels, reason: &str) {
        self.note(queue, Some(reason));
        self.reason_family(c)
            .get_or_create(&queue.with_reason(reason))
            .inc();
    }

    /// A task of `queue` held all its locks after waiting `waited`.
    pub fn observe_lock_wait(&self, queue: &QueueLabels, waited: std::time::Duration) {
        self.note(queue, None);
        self.lock_acquisition_duration
            .get_or_create(queue)
            .observe(waited.as_secs_f64());
    }

    /// The abort rate and sample count `queue` would have with this
    /// outcome: for the condition written with the settling status.
    pub fn abort_rate_with(&self, queue: &QueueLabels, aborted: bool) -> (f64, usize) {
        self.abort_window
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .with(&queue.namespace, &queue.queue, aborted)
    }

    /// Counts a settled speculative attempt (once its status is written);
    /// returns the queue's band before and after.
    pub fn record_speculative(&self, queue: &QueueLabels, aborted: bool) -> (Band, Band) {
        self.note(queue, None);
        self.speculative_attempts.get_or_create(queue).inc();
        if aborted {
            self.speculative_aborts.get_or_create(queue).inc();
        }
        let mut w = self.abort_window.lock().unwrap_or_else(|e| e.into_inner());
        let (was, n_was) = w.rate(&queue.namespace, &queue.queue);
        let (rate, n) = w.record(&queue.namespace, &queue.queue, aborted);
        self.speculative_abort_ratio.get_or_create(queue).set(rate);
        (band(was, n_was), band(rate, n))
    }

    /// Lets `batchlease_tasks{namespace,queue,phase}` count the tasks in
    /// these caches (the current term's; a standby counts none),
    /// `batchlease_cache_objects{kind}` their sizes,
    /// `batchlease_lock_oldest_wait_seconds` the lock waits of `indexes`,
    /// and [`Metrics::forget_gone_queues`] tell which queues exist once
    /// `synced` says every cache listed.
    pub fn watch_tasks(
        &self,
        stores: Vec<Store<BatchTask>>,
        leases: Vec<Store<TaskLease>>,
        queues: Vec<Store<TaskQueue>>,
        indexes: Vec<Arc<GraphIndex>>,
        synced: Option<Arc<SyncCounter>>,
    ) {
        *self.tasks.stores.lock().unwrap_or_else(|e| e.into_inner()) = stores;
        *self.tasks.leases.lock().unwrap_or_else(|e| e.into_inner()) = leases;
        *self.tasks.queues.lock().unwrap_or_else(|e| e.into_inner()) = queues;
        *self.tasks.indexes.lock().unwrap_or_else(|e| e.into_inner()) = indexes;
        *self.tasks.synced.lock().unwrap_or_else(|e| e.into_inner()) = synced;
    }

    /// Removes the series and the abort window of every queue with no task
    /// in the caches. Only while the caches are watched and have listed
    /// (a standby, or a term still listing, knows of no queue and forgets
    /// nothing). A queue that comes back starts its counters afresh, which
    /// Prometheus reads as a counter reset.
    pub fn forget_gone_queues(&self) -> usize {
        let synced = self
            .tasks
            .synced
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if !synced.is_some_and(|s| s.synced()) {
            return 0;
        }
        let mut live: HashSet<(String, String)> = HashSet::new();
        for store in self
            .tasks
            .stores
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            for t in store.state() {
                live.insert((t.namespace().unwrap_or_default(), t.spec.queue.clone()));
            }
        }
        self.forget_queues_not_in(&live)
    }

    /// Removes the series and windows of the queues not in `live`; returns
    /// how many queues were forgotten.
    fn forget_queues_not_in(&self, live: &HashSet<(String, String)>) -> usize {
        let gone: Vec<(QueueLabels, BTreeSet<String>)> = {
            let mut series = self.series.lock().unwrap_or_else(|e| e.into_inner());
            let gone: Vec<QueueLabels> = series
                .keys()
                .filter(|q| !live.contains(&(q.namespace.clone(), q.queue.clone())))
                .cloned()
                .collect();
            gone.into_iter()
                .filter_map(|q| series.remove_entry(&q))
                .collect()
        };
        for (q, reasons) in &gone {
            for c in QueueCounter::ALL {
                self.queue_family(c).remove(q);
            }
            self.speculative_attempts.remove(q);
            self.speculative_aborts.remove(q);
            self.speculative_abort_ratio.remove(q);
            self.lock_acquisition_duration.remove(q);
            for r in reasons {
                let labels = q.with_reason(r);
                for c in ReasonCounter::ALL {
                    self.reason_family(c).remove(&labels);
                }
            }
        }
        self.abort_window
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .forget(|k| !live.contains(k));
        gone.len()
    }
}

/// How often the series of gone queues are looked for.
pub const FORGET_PERIOD: std::time::Duration = std::time::Duration::from_secs(10);

/// Calls [`Metrics::forget_gone_queues`] every [`FORGET_PERIOD`] until
/// `stop`.
pub async fn forget_gone_queues(metrics: Arc<Metrics>, stop: tokio_util::sync::CancellationToken) {
    let mut tick = tokio::time::interval(FORGET_PERIOD);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let n = metrics.forget_gone_queues();
        if n > 0 {
            tracing::debug!(queues = n, "series of gone queues removed");
        }
    }
}

/// `batchlease_tasks{namespace,queue,phase}` and the other per-queue
/// gauges, computed from the caches at scrape time, so deleted tasks never
/// linger in a gauge.
#[derive(Clone, Debug, Default)]
struct TaskPhases {
    stores: Arc<Mutex<Vec<Store<BatchTask>>>>,
    leases: Arc<Mutex<Vec<Store<TaskLease>>>>,
    queues: Arc<Mutex<Vec<Store<TaskQueue>>>>,
    indexes: Arc<Mutex<Vec<Arc<GraphIndex>>>>,
    synced: Arc<Mutex<Option<Arc<SyncCounter>>>>,
}

type Key = (String, String);

/// Objects in the caches of `stores`.
fn cached<K>(stores: &Mutex<Vec<Store<K>>>) -> i64
where
    K: kube::Resource + Clone + 'static,
    K::DynamicType: std::hash::Hash + Eq + Clone,
{
    let n: usize = stores
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .map(Store::len)
        .sum();
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl TaskPhases {
    /// The longest lock wait of each queue, in seconds. The indexes know
    /// tasks by name; the caches tell their queue (a task no longer cached
    /// is not waiting).
    fn lock_waits(&self) -> BTreeMap<Key, f64> {
        let indexes = self
            .indexes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let stores = self.stores.lock().unwrap_or_else(|e| e.into_inner());
        let now = tokio::time::Instant::now();
        let mut oldest: BTreeMap<Key, f64> = BTreeMap::new();
        for (ns, name, since) in indexes.iter().flat_map(|i| i.lock_waits()) {
            let key = ObjectRef::new(&name).within(&ns);
            let Some(task) = stores.iter().find_map(|s| s.get(&key)) else {
                continue;
            };
            let secs = now.saturating_duration_since(since).as_secs_f64();
            let o = oldest.entry((ns, task.spec.queue.clone())).or_default();
            *o = o.max(secs);
        }
        oldest
    }
}

impl prometheus_client::collector::Collector for TaskPhases {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        // What the operator's memory grows with (about 6 KiB per task with
        // its lease, see the chart's `resources`): every kind, 0 on a
        // standby, so a ratio or an alert never meets a missing series.
        let objects = ConstGauge::new(0i64);
        let mut family = encoder.encode_descriptor(
            "cache_objects",
            "Objects in the operator's watch caches, by kind (its memory grows with them)",
            None,
            objects.metric_type(),
        )?;
        for (kind, n) in [
            ("BatchTask", cached(&self.stores)),
            ("TaskLease", cached(&self.leases)),
            ("TaskQueue", cached(&self.queues)),
        ] {
            ConstGauge::new(n).encode(family.encode_family(&[("kind", kind)])?)?;
        }
        let mut counts: BTreeMap<(Key, String), i64> = BTreeMap::new();
        let mut oldest: BTreeMap<Key, Timestamp> = BTreeMap::new();
        for store in self.stores.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            for task in store.state() {
                let key = (
                    task.namespace().unwrap_or_default(),
                    task.spec.queue.clone(),
                );
                let phase = task.status.as_ref().and_then(|s| s.phase);
                if phase == Some(TaskPhase::Ready) {
                    let since = task.status.as_ref().and_then(|s| {
                        s.conditions
                            .iter()
                            .find(|c| c.type_ == batchlease_api::keys::condition::LEASED)
                            .map(|c| c.last_transition_time.0)
                    });
                    if let Some(since) = since {
                        let o = oldest.entry(key.clone()).or_insert(since);
                        *o = (*o).min(since);
                    }
                }
                let phase = phase.map_or("New", |p| p.as_str());
                *counts.entry((key, phase.to_owned())).or_default() += 1;
            }
        }
        let gauge = ConstGauge::new(0i64);
        let mut family = encoder.encode_descriptor(
            "tasks",
            "BatchTasks by namespace, queue and phase",
            None,
            gauge.metric_type(),
        )?;
        for (((namespace, queue), phase), n) in counts {
            let labels = [("namespace", namespace), ("queue", queue), ("phase", phase)];
            ConstGauge::new(n).encode(family.encode_family(&labels)?)?;
        }
        let mut held: BTreeMap<Key, i64> = BTreeMap::new();
        for store in self.leases.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            for l in store.state() {
                if l.status.as_ref().and_then(|s| s.phase) == Some(LeasePhase::Held) {
                    *held
                        .entry((l.namespace().unwrap_or_default(), l.spec.queue.clone()))
                        .or_default() += 1;
                }
            }
        }
        let mut family = encoder.encode_descriptor(
            "queue_leases_held",
            "TaskLeases Held, by namespace and queue",
            None,
            gauge.metric_type(),
        )?;
        for ((namespace, queue), n) in held {
            let labels = [("namespace", namespace), ("queue", queue)];
            ConstGauge::new(n).encode(family.encode_family(&labels)?)?;
        }
        let now = Timestamp::now();
        let age = ConstGauge::new(0f64);
        let mut family = encoder.encode_descriptor(
            "queue_oldest_ready_seconds",
            "Age of the longest-waiting Ready task's offer, by namespace and queue",
            None,
            age.metric_type(),
        )?;
        for ((namespace, queue), since) in oldest {
            let secs = now.duration_since(since).as_secs_f64().max(0.0);
            let labels = [("namespace", namespace), ("queue", queue)];
            ConstGauge::new(secs).encode(family.encode_family(&labels)?)?;
        }
        let mut family = encoder.encode_descriptor(
            "lock_oldest_wait_seconds",
            "How long the longest-waiting task has been waiting for its resource locks, by namespace and queue",
            None,
            age.metric_type(),
        )?;
        for ((namespace, queue), secs) in self.lock_waits() {
            let labels = [("namespace", namespace), ("queue", queue)];
            ConstGauge::new(secs).encode(family.encode_family(&labels)?)?;
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
#[path = "metrics_tests.rs"]
mod tests;
