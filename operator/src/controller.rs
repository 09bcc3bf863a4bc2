//! Wiring: one watch per kind (per watched namespace), the lease watch
//! feeding the observation tracker, and the BatchTask controller.

use std::sync::Arc;

use batchlease_api::{BatchTask, TaskLease};
use futures::{StreamExt, TryStreamExt};
use kube::api::Api;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{Controller, WatchStreamExt, watcher};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::observe::Tracker;
use crate::reconcile::{Ctx, error_policy, reconcile};

/// Handles of one running controller.
pub struct Running {
    pub tasks: Store<BatchTask>,
    pub leases: Store<TaskLease>,
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
    pub tracker: Arc<Tracker>,
    pub make_ctx: Box<dyn Fn(Store<TaskLease>) -> Arc<Ctx> + Send + Sync>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").finish_non_exhaustive()
    }
}

/// Starts the controller for `namespace` (`None`: all namespaces).
pub fn start(shared: &Shared, namespace: Option<&str>, stop: CancellationToken) -> Running {
    let (tasks_api, leases_api): (Api<BatchTask>, Api<TaskLease>) = match namespace {
        Some(ns) => (
            Api::namespaced(shared.client.clone(), ns),
            Api::namespaced(shared.client.clone(), ns),
        ),
        None => (
            Api::all(shared.client.clone()),
            Api::all(shared.client.clone()),
        ),
    };
    let (lease_store, lease_writer) = reflector::store();
    let tracker = shared.tracker.clone();
    // Observations are stamped as the watch delivers each event, before the
    // reconcile it triggers runs.
    let lease_stream = watcher(leases_api, watcher::Config::default())
        .default_backoff()
        .inspect_ok(move |event| {
            let now = Instant::now();
            match event {
                watcher::Event::Apply(l) | watcher::Event::InitApply(l) => tracker.observe(l, now),
                watcher::Event::Delete(l) => tracker.forget(l),
                watcher::Event::Init | watcher::Event::InitDone => {}
            }
        })
        .reflect(lease_writer)
        .touched_objects();
    let ctx = (shared.make_ctx)(lease_store.clone());
    let controller = Controller::new(tasks_api, watcher::Config::default())
        .owns_stream(lease_stream)
        .graceful_shutdown_on(async move { stop.cancelled().await });
    let tasks = controller.store();
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
        info!(namespace = %scope, "controller stopped");
    });
    Running {
        tasks,
        leases: lease_store,
        done,
    }
}
