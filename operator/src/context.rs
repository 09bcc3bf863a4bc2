//! What every reconcile shares ([`Ctx`]), and how each of its writes is
//! made ([`bounded`] by the leader's term) and judged ([`classify`]). Kept
//! apart from `reconcile.rs` so that the modules the reconciler calls
//! (`spawned.rs`, the effects) and those it is built from import this,
//! not the reconciler: no import circle.

use std::sync::Arc;

use batchlease_api::{BatchTask, TaskLease, WorkerLease};
use kube::runtime::events::Recorder;
use kube::runtime::reflector::Store;

use crate::error::Error;
use crate::expectations::Expectations;
use crate::graph_index::GraphIndex;
use crate::leader::Leadership;
use crate::metrics::Metrics;
use crate::observe::Tracker;
use crate::worker_leases::WorkerTracker;

/// What every reconcile shares.
pub struct Ctx {
    pub client: kube::Client,
    pub leases: Store<TaskLease>,
    /// Set once the lease watch delivered its first complete list. Until
    /// then the lease cache is empty (the reflector fills it at the list's
    /// end), and a task would look as if it had no leases.
    pub leases_listed: Arc<std::sync::atomic::AtomicBool>,
    pub tracker: Arc<Tracker>,
    /// The WorkerLeases cache: the copies a revocation is a CAS on.
    pub worker_leases: Store<WorkerLease>,
    /// What the WorkerLease watch observed (see `worker_leases`).
    pub workers: Arc<WorkerTracker>,
    /// Offers addressed to workers and still unclaimed ([`crate::offers`]).
    pub offers: Arc<crate::offers::OfferBook>,
    /// `--address-offers`.
    pub address_offers: bool,
    /// `--bind-offers`.
    pub bind_offers: bool,
    /// Leases this process created that the watch has not shown yet.
    pub expectations: Expectations,
    pub metrics: Arc<Metrics>,
    pub recorder: Recorder,
    /// Who reports Events (for those the recorder cannot name).
    pub reporter: kube::runtime::events::Reporter,
    pub leadership: Leadership,
    /// The task cache (dependencies and lock holders are looked up in it).
    pub tasks: Store<BatchTask>,
    pub index: Arc<GraphIndex>,
    /// Namespace of the resource-lock Leases.
    pub lock_namespace: String,
    /// Which Events to publish.
    pub events: crate::events::EventLevel,
    /// `--running-status-delay-ms` ([`Input::running_after`]).
    pub running_after: std::time::Duration,
    /// The queues' controls and counts ([`crate::queues`]).
    pub queues: Arc<crate::queues::QueueBook>,
    /// Set once the TaskQueue watch delivered its first list: until then a
    /// paused queue would look like one without controls.
    pub queues_listed: Arc<std::sync::atomic::AtomicBool>,
    /// Per task, the resourceVersion this process last wrote its status
    /// over: a cached copy still at that version has not seen our write.
    pub overwritten: std::sync::Mutex<std::collections::HashMap<(String, String), String>>,
}

impl Ctx {
    /// Whether the cache still shows `task` as it was before our last
    /// status write. Deciding on it would repeat a decision already
    /// written, and the write would fail its CAS (a 409 per task in a
    /// burst, issue 12): the watch event of our write brings the task
    /// back. Forgets the entry once the cache moved on.
    pub(crate) fn cache_behind(&self, ns: &str, name: &str, rv: Option<&str>) -> bool {
        let mut m = self.overwritten.lock().unwrap_or_else(|e| e.into_inner());
        let key = (ns.to_owned(), name.to_owned());
        match m.get(&key) {
            Some(old) if Some(old.as_str()) == rv => true,
            Some(_) => {
                m.remove(&key);
                false
            }
            None => false,
        }
    }
}

impl std::fmt::Debug for Ctx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ctx").finish_non_exhaustive()
    }
}

/// Runs a write only as long as this term may still write: a request that
/// has not answered when the term ends — by its deadline, or lost before
/// it — is abandoned (the term's end is the last moment this replica may
/// believe it leads), and kube's retries inside it with it.
pub(crate) async fn bounded<T>(
    ctx: &Ctx,
    what: &'static str,
    write: impl std::future::Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    match ctx.leadership.bound(write).await {
        Some(r) => r,
        None => Err(Error::Timeout { what }),
    }
}

/// The error of a failed write: a conflict (409) is counted and named as
/// such (the cached copy was stale); anything else is an API error.
pub(crate) fn classify(ctx: &Ctx, e: kube::Error, what: &'static str) -> Error {
    match e {
        kube::Error::Api(s) if s.code == 409 => {
            ctx.metrics.write_conflicts.inc();
            Error::Conflict { what }
        }
        source => Error::Kube { what, source },
    }
}
