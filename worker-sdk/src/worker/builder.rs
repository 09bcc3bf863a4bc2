//! The worker's configuration: [`WorkerBuilder`] and the defaults it
//! reads from the environment (renewals per worker, the checkpoint
//! interval, the holder identity). `WorkerBuilder::build` (in the parent) checks
//! it and starts the worker.

use std::sync::Arc;
use std::time::Duration;

use rand::Rng;

use crate::metrics::WorkerMetrics;
use crate::registry::Registry;

/// Configures a [`Worker`](super::Worker).
pub struct WorkerBuilder {
    pub(super) config: kube::Config,
    pub(super) namespace: String,
    pub(super) queues: Vec<String>,
    pub(super) slots: usize,
    pub(super) identity: Option<String>,
    pub(super) drain_grace: Duration,
    pub(super) metrics: WorkerMetrics,
    pub(super) registry: Option<Arc<dyn Registry>>,
    pub(super) renew_per_worker: bool,
    pub(super) stop_budget: Duration,
    pub(super) checkpoint_interval: Option<Duration>,
}

impl WorkerBuilder {
    /// A worker for `namespace`: one slot, no queue yet, [`DEFAULT_DRAIN_GRACE`].
    /// It takes the client *configuration* (e.g. `kube::Config::infer()`),
    /// not a client: it builds two clients from it, one for claims and
    /// handlers and one on the heartbeat's own runtime, so a handler that
    /// blocks its thread cannot starve the lease's renewals.
    pub fn new(config: kube::Config, namespace: impl Into<String>) -> Self {
        Self {
            config,
            namespace: namespace.into(),
            queues: Vec::new(),
            slots: 1,
            identity: None,
            drain_grace: DEFAULT_DRAIN_GRACE,
            metrics: WorkerMetrics::default(),
            registry: None,
            stop_budget: Duration::ZERO,
            renew_per_worker: renew_per_worker_from_env(
                std::env::var(RENEW_PER_WORKER_ENV).ok().as_deref(),
            )
            .unwrap_or(false),
            checkpoint_interval: checkpoint_interval_from_env(
                std::env::var(CHECKPOINT_INTERVAL_ENV).ok().as_deref(),
            ),
        }
    }

    /// Renews the attempts through one `WorkerLease` per worker process
    /// instead of one write per TaskLease every TTL/3 (design "Fleets"):
    /// a fleet's renewal writes then grow with its workers, not with its
    /// tasks. Off by default (the default can also be set with
    /// `BATCHLEASE_RENEW_PER_WORKER=1` or `true`, and `0` or `false`; this
    /// call overrides it).
    ///
    /// Only offers stamped for it (`spec.renewal: Lease`, by an operator
    /// that honours WorkerLeases) are claimed so, and only while the
    /// WorkerLease is live; others are renewed per lease as always. Such an
    /// attempt still writes its TaskLease for a new checkpoint (at most
    /// once per [`WorkerBuilder::checkpoint_interval`]) and every
    /// `max(TTL, 120 s)`. If the API server
    /// refuses the WorkerLease (403, 422: RBAC or admission changed), its
    /// attempts go back to per-lease renewals. The WorkerLease replaces
    /// the presence record: the worker needs RBAC on `workerleases`.
    #[must_use]
    pub fn renew_per_worker(mut self, on: bool) -> Self {
        self.renew_per_worker = on;
        self
    }

    /// Registers each attempt's fencing token in `registry` (e.g. a
    /// `postgres::FencedStore`) before its handler runs (design §4), and
    /// hands the handler what an earlier attempt committed
    /// ([`TaskContext::earlier_commit`](crate::TaskContext::earlier_commit)).
    #[must_use]
    pub fn registry(mut self, registry: Arc<dyn Registry>) -> Self {
        self.registry = Some(registry);
        self
    }

    /// Adds a queue to serve.
    #[must_use]
    pub fn queue(mut self, queue: impl Into<String>) -> Self {
        self.queues.push(queue.into());
        self
    }

    /// How many attempts run at once.
    #[must_use]
    pub fn slots(mut self, slots: usize) -> Self {
        self.slots = slots;
        self
    }

    /// The holder identity (default: `<POD_NAME or host name>/<random
    /// suffix>`, so a restarted process is a new holder). Where the chart's
    /// holder-only admission policy is on, it must be `<principal>/<suffix>`,
    /// the principal being the pod of the worker's bound service-account
    /// token, or `user:<user name>` without one.
    #[must_use]
    pub fn identity(mut self, identity: impl Into<String>) -> Self {
        self.identity = Some(identity.into());
        self
    }

    /// How long running handlers may finish after shutdown is requested
    /// before they are dropped and their leases released as `Interrupted`.
    #[must_use]
    pub fn drain_grace(mut self, grace: Duration) -> Self {
        self.drain_grace = grace;
        self
    }

    /// How long a handler's work may go on after its attempt's kill switch
    /// fired and its future was dropped — work the future started that
    /// dropping it does not stop: a child process in its grace, a process
    /// group being killed. A killed attempt is given back (so the operator
    /// may act on it at once) only once this has passed since the kill,
    /// capped at a third of the TTL, and once its storage deadline has
    /// passed. Default zero: a handler whose work is its future.
    /// `batchlease-run` sets its kill grace, the Python worker a second.
    #[must_use]
    pub fn stop_budget(mut self, budget: Duration) -> Self {
        self.stop_budget = budget;
        self
    }

    /// Renewed per worker: how stale a handler's checkpoint may be on its
    /// TaskLease — a new checkpoint is written at most this often (the
    /// latest one then), kept between TTL/3 and `max(TTL, 120 s)`. Default
    /// the TTL (or `BATCHLEASE_CHECKPOINT_INTERVAL_SECONDS`; this call
    /// overrides it): a checkpointing attempt then costs a third of the
    /// writes of renewing it per lease. What it trades: a task resumed
    /// after its worker *died* starts from a checkpoint up to this old; a
    /// drain, a failure or a completion carries the latest one. Renewed
    /// per lease, a checkpoint rides on every renewal and this is unused.
    #[must_use]
    pub fn checkpoint_interval(mut self, every: Duration) -> Self {
        self.checkpoint_interval = Some(every);
        self
    }

    /// The worker's metrics, to register in the application's registry.
    pub fn metrics(&self) -> &WorkerMetrics {
        &self.metrics
    }
}

/// How long running handlers may finish after shutdown begins: 20 s, so
/// that with Kubernetes' default `terminationGracePeriodSeconds` (30 s)
/// the worker still has 10 s to give the rest of its leases back before
/// the kubelet's SIGKILL (the give-back of each is bounded to 2 s). At
/// 30 s, the old default, the SIGKILL landed first and those tasks waited
/// a whole TTL. Keep `terminationGracePeriodSeconds` above the grace.
pub const DEFAULT_DRAIN_GRACE: Duration = Duration::from_secs(20);

/// The environment variable that sets [`WorkerBuilder::renew_per_worker`]'s
/// default (`1`/`true` on, `0`/`false` off).
pub const RENEW_PER_WORKER_ENV: &str = "BATCHLEASE_RENEW_PER_WORKER";

/// The environment variable that sets [`WorkerBuilder::checkpoint_interval`]
/// by default, in seconds.
pub const CHECKPOINT_INTERVAL_ENV: &str = "BATCHLEASE_CHECKPOINT_INTERVAL_SECONDS";

/// Pure: the interval `BATCHLEASE_CHECKPOINT_INTERVAL_SECONDS`'s value
/// sets: a positive number of seconds; anything else leaves the default
/// (logged, as the builder cannot fail).
pub(super) fn checkpoint_interval_from_env(value: Option<&str>) -> Option<Duration> {
    let value = value?.trim();
    match value
        .parse::<f64>()
        .ok()
        .filter(|v| v.is_finite() && *v > 0.0)
    {
        Some(secs) => Duration::try_from_secs_f64(secs).ok(),
        None => {
            tracing::warn!(
                value,
                variable = CHECKPOINT_INTERVAL_ENV,
                "not a positive number of seconds: the checkpoint interval stays the TTL"
            );
            None
        }
    }
}

/// Pure: what `BATCHLEASE_RENEW_PER_WORKER`'s value says: `1`/`true` on,
/// `0`/`false` off, anything else (or unset) nothing — the default (off)
/// holds (a value it cannot read is logged).
pub(super) fn renew_per_worker_from_env(value: Option<&str>) -> Option<bool> {
    let value = value?.trim().to_ascii_lowercase();
    match value.as_str() {
        "1" | "true" => Some(true),
        "0" | "false" => Some(false),
        "" => None,
        other => {
            tracing::warn!(
                value = other,
                variable = RENEW_PER_WORKER_ENV,
                "neither 1/true nor 0/false: renewals per worker stay off (the default)"
            );
            None
        }
    }
}

/// `spec.holderIdentity`'s `maxLength`.
pub(super) const MAX_IDENTITY_CHARS: usize = 253;

pub(super) fn default_identity() -> String {
    identity_of(
        std::env::var("POD_NAME").ok().as_deref(),
        std::env::var("HOSTNAME").ok().as_deref(),
        rand::rng().random_range(0..0xff_ffff),
    )
}

/// `<pod name>/<suffix>`: the chart's holder-only admission policy compares
/// what comes before the last `/` with the pod name in the worker's bound
/// service-account token, so a worker in a pod is its pod (the host name is
/// the pod name in a pod without `POD_NAME`); the suffix makes each process
/// a new holder.
pub(super) fn identity_of(pod: Option<&str>, host: Option<&str>, suffix: u32) -> String {
    let base = [pod, host]
        .into_iter()
        .flatten()
        .find(|s| !s.is_empty())
        .unwrap_or("worker");
    format!("{base}/{suffix:06x}")
}

impl std::fmt::Debug for WorkerBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerBuilder")
            .field("namespace", &self.namespace)
            .field("queues", &self.queues)
            .finish_non_exhaustive()
    }
}
