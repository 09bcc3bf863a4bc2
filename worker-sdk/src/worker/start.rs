//! Starting one claimed attempt: its kill clock (renewed per lease, or per
//! worker when its claim says so, then registered with the WorkerLease
//! renewer), its fence, and the attempt itself.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use batchlease_api::{AttemptRef, BatchTask, TaskLease};
use kube::ResourceExt;
use kube::api::Api;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::attempt::{Attempt, Ended};
use crate::context::{Output, TaskContext};
use crate::error::TaskError;
use crate::fence::{Fence, KillClock};
use crate::heartbeat_runtime::HeartbeatRuntime;
use crate::metrics::WorkerMetrics;
use crate::registry::Registry;
use crate::worker_lease::WorkerLeases;

/// What a spawned attempt needs besides the lease and its task.
pub(super) struct AttemptStart {
    pub(super) leases: Api<TaskLease>,
    pub(super) heartbeat_on: Option<(Arc<HeartbeatRuntime>, Api<TaskLease>)>,
    pub(super) identity: String,
    pub(super) metrics: WorkerMetrics,
    pub(super) interrupt: CancellationToken,
    pub(super) registry: Option<Arc<dyn Registry>>,
    pub(super) background: tokio_util::task::TaskTracker,
    pub(super) worker_leases: Option<WorkerLeases>,
    pub(super) stop_budget: std::time::Duration,
    /// `WorkerBuilder::checkpoint_interval`.
    pub(super) checkpoint_interval: Option<Duration>,
}

impl AttemptStart {
    pub(super) async fn run<H, F>(
        self,
        held: TaskLease,
        task: BatchTask,
        claim_sent: Instant,
        handler: H,
    ) -> Ended
    where
        H: FnOnce(TaskContext) -> F,
        F: Future<Output = Result<Output, TaskError>>,
    {
        let ttl = Duration::from_secs(u64::try_from(held.spec.lease_duration_seconds).unwrap_or(5));
        let deadline = task
            .spec
            .active_deadline_seconds
            .and_then(|d| u64::try_from(d).ok())
            .map(Duration::from_secs);
        // Renewed per worker when the claim (as stored) says so.
        let per_worker = self
            .worker_leases
            .as_ref()
            .filter(|_| held.renewed_per_worker());
        let mut clock = KillClock::new(ttl, claim_sent, deadline);
        if per_worker.is_some() {
            clock = clock
                .per_worker()
                .checkpoint_interval(self.checkpoint_interval);
        }
        // Resource locks belong to the task's namespace (the lease's too).
        let fence = Fence::new(held.spec.fencing_token, clock).with_resources(
            task.namespace().unwrap_or_default(),
            held.spec.resource_tokens.clone(),
        );
        let membership =
            per_worker.map(|w| w.register(AttemptRef::of(&held), fence.clone(), claim_sent));
        Attempt {
            api: self.leases,
            identity: self.identity,
            lease: held,
            task,
            fence,
            metrics: self.metrics,
            interrupt: self.interrupt,
            registry: self.registry,
            heartbeat_on: self.heartbeat_on,
            background: self.background,
            membership,
            stop_budget: self.stop_budget,
        }
        .run(handler)
        .await
    }
}
