//! Wiring: one watch per kind (per watched namespace), the lease watch
//! feeding the observation tracker, and the BatchTask controller.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use batchlease_api::{BatchTask, TaskLease, TaskQueue, WatchBackoff, WorkerLease};
use futures::{StreamExt, TryStreamExt};
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{Controller, WatchStreamExt, watcher};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::context::Ctx;
use crate::graph_index::GraphIndex;
use crate::leader::Leadership;
use crate::metrics::Metrics;
use crate::observe::Tracker;
use crate::offers::OfferBook;
use crate::queues::QueueBook;
use crate::reconcile::{error_policy, reconcile};
use crate::sync_counter::SyncCounter;
use crate::worker_leases::WorkerTracker;

fn jitter() -> f64 {
    rand::random()
}

/// Handles of one running controller.
pub struct Running {
    pub tasks: Store<BatchTask>,
    pub leases: Store<TaskLease>,
    pub queues: Store<TaskQueue>,
    /// Its lock waits, for `batchlease_lock_oldest_wait_seconds`.
    pub index: Arc<GraphIndex>,
    pub done: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for Running {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Running").finish_non_exhaustive()
    }
}

/// Context pieces shared by all namespaces' controllers.
pub struct Shared {
    pub client: kube::Client,
    pub synced: Arc<SyncCounter>,
    pub metrics: Arc<Metrics>,
    pub reporter: Reporter,
    pub leadership: Leadership,
    /// Namespace of the resource-lock Leases (the operator's own).
    pub lock_namespace: String,
    pub events: crate::events::EventLevel,
    /// `--running-status-delay-ms`.
    pub running_after: std::time::Duration,
    /// `--address-offers`.
    pub address_offers: bool,
    /// `--bind-offers`.
    pub bind_offers: bool,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").finish_non_exhaustive()
    }
}

/// Starts the controller for `namespace` (`None`: all namespaces).
pub fn start(shared: &Shared, namespace: Option<&str>, stop: CancellationToken) -> Running {
    let (tasks_api, leases_api, queues_api): (Api<BatchTask>, Api<TaskLease>, Api<TaskQueue>) =
        match namespace {
            Some(ns) => (
                Api::namespaced(shared.client.clone(), ns),
                Api::namespaced(shared.client.clone(), ns),
                Api::namespaced(shared.client.clone(), ns),
            ),
            None => (
                Api::all(shared.client.clone()),
                Api::all(shared.client.clone()),
                Api::all(shared.client.clone()),
            ),
        };
    let (lease_store, lease_writer) = reflector::store();
    let (task_store, task_writer) = reflector::store();
    // One tracker per watch: a relist prunes exactly what this watch covers.
    // Created with the controller, so a new leader starts with no
    // observations and gives every held lease a full TTL.
    let tracker = Arc::new(Tracker::default());
    let ctx_tracker = tracker.clone();
    let tracker_for_workers = tracker.clone();
    let lease_synced = shared.synced.register();
    let leases_listed = Arc::new(AtomicBool::new(false));
    let listed = leases_listed.clone();
    // After every (re)list of leases, reconcile every task once: the
    // reflector swaps a list into the cache only at its end, so the
    // reconciles its objects triggered may have read the cache before.
    let (relisted_tx, relisted) = futures::channel::mpsc::unbounded::<()>();
    // The task watch's relists too (e.g. after the API server restarted):
    // tasks created or changed while the watch was down get a pass.
    let task_relisted_tx = relisted_tx.clone();
    let task_synced = shared.synced.register();
    // Dependents and resource users of a changed task are woken through
    // this channel (see graph_index).
    let (wake_tx, wake_rx) = futures::channel::mpsc::unbounded();
    // Tasks held back by their queue are woken through it too.
    let queues = Arc::new(QueueBook::new(wake_tx.clone()));
    let index = Arc::new(GraphIndex::new(wake_tx));
    let lease_queues = queues.clone();
    let offers = Arc::new(OfferBook::default());
    let lease_offers = offers.clone();
    let watch_queues = queues.clone();
    let task_queues = queues.clone();
    let watch_index = index.clone();
    let lease_index = index.clone();
    // Observations are stamped as the watch delivers each event, before the
    // reconcile it triggers runs.
    let lease_stream = watcher(leases_api, watcher::Config::default())
        .backoff(WatchBackoff::new(jitter))
        .modify(forget_managed_fields)
        .inspect_ok(move |event| {
            lease_synced(matches!(event, watcher::Event::InitDone));
            if matches!(event, watcher::Event::InitDone) {
                listed.store(true, Ordering::Release);
                let _ = relisted_tx.unbounded_send(());
            }
            let now = Instant::now();
            match event {
                watcher::Event::Apply(l) | watcher::Event::InitApply(l) => {
                    tracker.observe(l, now);
                    lease_queues.lease_seen(l, now);
                    lease_offers.observe(l, now);
                }
                watcher::Event::Delete(l) => {
                    tracker.forget(l, now);
                    lease_offers.forget(&l.namespace().unwrap_or_default(), &l.name_any());
                    lease_queues.lease_gone(l, now);
                    // A deleted task's lock is held until its lease is gone
                    // (see locks::holder): then its waiters may go.
                    if !l.spec.resource_tokens.is_empty() {
                        let resources: Vec<String> =
                            l.spec.resource_tokens.keys().cloned().collect();
                        lease_index.wake_users(&l.namespace().unwrap_or_default(), &resources);
                    }
                }
                watcher::Event::Init => {
                    tracker.list_started();
                    lease_queues.list_started();
                    lease_offers.list_started();
                }
                watcher::Event::InitDone => {
                    tracker.list_done(now);
                    lease_queues.list_done(now);
                    lease_offers.list_done();
                }
            }
        })
        .reflect(lease_writer)
        .touched_objects();
    // TaskQueues: their specs go to the queue book (which wakes the tasks
    // a change concerns); no task is reconciled for a TaskQueue event
    // itself. Tasks are not decided before the first list is in, so a
    // paused queue is never issued to by a fresh leader.
    let (queue_store, queue_writer) = reflector::store();
    let queue_synced = shared.synced.register();
    let queues_listed = Arc::new(AtomicBool::new(false));
    let q_listed = queues_listed.clone();
    let queue_stream = watcher(queues_api, watcher::Config::default())
        .backoff(WatchBackoff::new(jitter))
        .modify(forget_managed_fields)
        .inspect_ok(move |event| {
            queue_synced(matches!(event, watcher::Event::InitDone));
            let now = Instant::now();
            match event {
                watcher::Event::Apply(q) => watch_queues.queue_seen(q, now),
                watcher::Event::InitApply(q) => {
                    watch_queues.queue_seen(q, now);
                    watch_queues.queue_listed(q);
                }
                watcher::Event::Delete(q) => watch_queues.queue_gone(q),
                watcher::Event::Init => watch_queues.queues_list_started(),
                watcher::Event::InitDone => {
                    watch_queues.queues_list_done();
                    q_listed.store(true, Ordering::Release);
                }
            }
        })
        .reflect(queue_writer)
        .touched_objects();
    // WorkerLeases: each renewal is credited to its holder's leases (see
    // `worker_leases`); the cache is what revocations are CASes on; and
    // each counts as its worker's presence in its queues.
    let workers = Arc::new(WorkerTracker::default());
    let (worker_store, worker_writer) = reflector::store();
    let worker_leases_api: Api<WorkerLease> = match namespace {
        Some(ns) => Api::namespaced(shared.client.clone(), ns),
        None => Api::all(shared.client.clone()),
    };
    let worker_stream = watch_worker_leases(
        worker_leases_api,
        worker_writer,
        workers.clone(),
        tracker_for_workers,
        queues.clone(),
        offers.clone(),
        shared.synced.register(),
    );
    let ctx = Arc::new(Ctx {
        client: shared.client.clone(),
        leases: lease_store,
        leases_listed,
        tracker: ctx_tracker,
        worker_leases: worker_store,
        workers,
        offers,
        address_offers: shared.address_offers,
        bind_offers: shared.bind_offers,
        expectations: Default::default(),
        metrics: shared.metrics.clone(),
        recorder: Recorder::new(shared.client.clone(), shared.reporter.clone()),
        reporter: shared.reporter.clone(),
        leadership: shared.leadership.clone(),
        tasks: task_store.clone(),
        index: index.clone(),
        lock_namespace: shared.lock_namespace.clone(),
        events: shared.events,
        running_after: shared.running_after,
        overwritten: Default::default(),
        queues: queues.clone(),
        queues_listed,
    });
    let status_sources = crate::queue_status::Sources {
        client: shared.client.clone(),
        queues: queue_store.clone(),
        tasks: task_store.clone(),
        leases: ctx.leases.clone(),
        book: queues.clone(),
        leadership: shared.leadership.clone(),
    };
    let lease_store = ctx.leases.clone();
    // The index is fed after the store: a woken task reads the change that
    // woke it.
    let task_stream = watcher(tasks_api, watcher::Config::default())
        .backoff(WatchBackoff::new(jitter))
        .modify(forget_managed_fields)
        .reflect(task_writer)
        .inspect_ok(move |event| {
            task_synced(matches!(event, watcher::Event::InitDone));
            match event {
                watcher::Event::Apply(t) | watcher::Event::InitApply(t) => watch_index.apply(t),
                watcher::Event::Delete(t) => {
                    watch_index.delete(t);
                    task_queues.release_waiter(
                        &t.namespace().unwrap_or_default(),
                        &t.spec.queue,
                        &t.name_any(),
                    );
                }
                watcher::Event::Init => watch_index.list_started(),
                watcher::Event::InitDone => {
                    watch_index.list_done();
                    let _ = task_relisted_tx.unbounded_send(());
                }
            }
        })
        .applied_objects();
    let controller = Controller::for_stream(task_stream, task_store.clone())
        // Leases map to their task by the immutable spec.taskName, not by
        // the owner reference (metadata anyone who may update a lease can
        // remove, which would hide the lease from its task's reconcile).
        .watches_stream(lease_stream, |l: TaskLease| {
            std::iter::once(
                ObjectRef::<BatchTask>::new(&l.spec.task_name)
                    .within(&l.namespace().unwrap_or_default()),
            )
        })
        .watches_stream(queue_stream, |_: TaskQueue| std::iter::empty())
        .reconcile_all_on(relisted)
        .reconcile_on(wake_rx)
        .graceful_shutdown_on({
            let stop = stop.clone();
            async move { stop.cancelled().await }
        });
    // Workers' presence records, for the queues' worker counts only.
    let presence_api: Api<k8s_openapi::api::coordination::v1::Lease> = match namespace {
        Some(ns) => Api::namespaced(shared.client.clone(), ns),
        None => Api::all(shared.client.clone()),
    };
    let presence = tokio::spawn(crate::presence::watch(
        presence_api,
        queues.clone(),
        stop.clone(),
    ));
    let worker_watch = tokio::spawn({
        let stop = stop.clone();
        async move {
            futures::pin_mut!(worker_stream);
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    e = worker_stream.next() => match e {
                        Some(Ok(_)) => {}
                        Some(Err(e)) => warn!(error = %batchlease_api::Chain(&e), "WorkerLease watch (renewals per worker are not credited meanwhile)"),
                        None => return,
                    },
                }
            }
        }
    });
    let status_loop = tokio::spawn(crate::queue_status::run(status_sources, stop));
    let tasks = task_store;
    let scope = namespace.unwrap_or("*").to_owned();
    let done = tokio::spawn(async move {
        info!(namespace = %scope, "controller started");
        controller
            .run(reconcile, error_policy, ctx)
            .for_each(|result| async move {
                if let Err(e) = result {
                    match e {
                        kube::runtime::controller::Error::ObjectNotFound(_) => {}
                        other => warn!(error = %other, "controller"),
                    }
                }
            })
            .await;
        status_loop.abort();
        presence.abort();
        worker_watch.abort();
        info!(namespace = %scope, "controller stopped");
    });
    Running {
        tasks,
        leases: lease_store,
        queues: queue_store,
        index,
        done,
    }
}

/// The WorkerLease watch: fills the cache revocations are CASes on, credits
/// each observed renewal (and departure) to the holder's leases, and counts
/// each WorkerLease as its worker's presence in its queues. Observations
/// are stamped as the watch delivers each event, like the lease watch's.
fn watch_worker_leases(
    api: Api<WorkerLease>,
    writer: reflector::store::Writer<WorkerLease>,
    workers: Arc<WorkerTracker>,
    leases: Arc<Tracker>,
    book: Arc<QueueBook>,
    offers: Arc<OfferBook>,
    synced: impl Fn(bool) + Send + 'static,
) -> impl futures::Stream<Item = Result<watcher::Event<WorkerLease>, watcher::Error>> + Send {
    let failed = workers.clone();
    workers.watch_started(Instant::now());
    watcher(api, watcher::Config::default())
        .backoff(WatchBackoff::new(jitter))
        .modify(forget_managed_fields)
        // An error may stand for a version lost (one that did not decode):
        // from here on nothing counts as seen without a gap.
        .inspect_err(move |e| {
            failed.watch_error(Instant::now(), batchlease_api::Chain(e).to_string());
        })
        .inspect_ok(move |event| {
            synced(matches!(event, watcher::Event::InitDone));
            let now = Instant::now();
            let presence = |w: &WorkerLease| {
                let secs = u64::try_from(w.spec.lease_duration_seconds.clamp(1, 3600)).unwrap_or(1);
                (
                    w.namespace().unwrap_or_default(),
                    std::time::Duration::from_secs(secs),
                )
            };
            match event {
                watcher::Event::Apply(w) | watcher::Event::InitApply(w) => {
                    workers.observe(w, &leases, now);
                    if let Some(holder) = w.worker() {
                        let (ns, duration) = presence(w);
                        book.worker_seen(&ns, holder, &w.spec.queues, duration, now);
                        let slots = usize::try_from(w.spec.slots.unwrap_or(0)).unwrap_or(0);
                        book.worker_changed(
                            &ns,
                            &w.spec.queues,
                            slots.saturating_sub(w.holds().len()),
                        );
                    }
                }
                watcher::Event::Delete(w) => {
                    workers.forget(w, &leases, now);
                    if let Some(holder) = w.worker() {
                        let (ns, _) = presence(w);
                        book.worker_gone(&ns, holder, &w.spec.queues);
                        book.worker_changed(&ns, &w.spec.queues, 0);
                        // Its offers move at their next pass (a deleted
                        // addressee counts as lapsed): have it now.
                        book.wake_tasks(&ns, offers.tasks_offered_to(&ns, holder));
                    }
                }
                watcher::Event::Init => workers.list_started(),
                watcher::Event::InitDone => {
                    // Deleted while the watch was down: as a Delete.
                    for (ns, holder) in workers.list_done(&leases, now) {
                        book.wake_tasks(&ns, offers.tasks_offered_to(&ns, &holder));
                    }
                    book.workers_listed();
                }
            }
        })
        .reflect(writer)
}

/// Drops `metadata.managedFields` from a watched object before it is
/// cached: nothing here reads them, and on a task whose status was written
/// a few times they are a large part of the object (issue 12: memory per
/// cached task). Writes of cached copies leave the field out, and the API
/// server keeps its own record.
fn forget_managed_fields<K: kube::Resource>(o: &mut K) {
    o.meta_mut().managed_fields = None;
}
