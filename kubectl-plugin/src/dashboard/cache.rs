//! The dashboard's watches: BatchTasks, TaskLeases and TaskQueues of the
//! namespace (or of all, with `-A`), each kept in a reflector store with
//! the user's credentials, the lease events fed to the [`Journal`], and a
//! change counter the pages' event stream follows.
//!
//! A watch that fails (the API server restarting, a network cut, an
//! expired token) is retried with the operator's quick backoff; until it
//! is back the pages show a banner naming the error, and the stores keep
//! their last contents (stale, and said to be).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use batchlease_api::{BatchTask, TaskLease, TaskQueue, WatchBackoff};
use futures::StreamExt;
use k8s_openapi::jiff::Timestamp;
use std::time::Duration;

use kube::api::{Api, WatchParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::watch;

use super::journal::Journal;
use super::snapshot::Snapshot;

/// How a watch is doing.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WatchHealth {
    /// Its first list has arrived.
    pub synced: bool,
    /// The last error, while the watch has not recovered from it.
    pub error: Option<String>,
    pub error_since: Option<Timestamp>,
    /// When the watch last reported an error (it retries at least every
    /// 2 s while failing).
    #[serde(skip)]
    last_error: Option<std::time::Instant>,
}

/// Where the dashboard looks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Scope {
    /// `None`: every namespace.
    pub namespace: Option<String>,
}

/// The watched objects and what was seen of the leases.
#[derive(Debug)]
pub struct Cache {
    tasks: Store<BatchTask>,
    leases: Store<TaskLease>,
    queues: Store<TaskQueue>,
    journal: Mutex<Journal>,
    health: Mutex<BTreeMap<&'static str, WatchHealth>>,
    changes: watch::Sender<u64>,
    pub scope: Scope,
}

fn api<K>(client: &Client, scope: &Scope) -> Api<K>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
    K::DynamicType: Default,
{
    match &scope.namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

impl Cache {
    /// Starts the three watches (they run until the process ends).
    pub fn start(client: &Client, scope: Scope) -> Arc<Self> {
        let (tasks, tasks_w) = reflector::store();
        let (leases, leases_w) = reflector::store();
        let (queues, queues_w) = reflector::store();
        let (changes, _) = watch::channel(0);
        let cache = Arc::new(Self {
            tasks,
            leases,
            queues,
            journal: Mutex::new(Journal::default()),
            health: Mutex::new(BTreeMap::new()),
            changes,
            scope,
        });
        spawn_watch(
            cache.clone(),
            "batchtasks",
            api::<BatchTask>(client, &cache.scope),
            tasks_w,
            |_, _| {},
        );
        spawn_watch(
            cache.clone(),
            "taskleases",
            api::<TaskLease>(client, &cache.scope),
            leases_w,
            |c: &Cache, ev: &watcher::Event<TaskLease>| {
                let now = Timestamp::now();
                let mut j = c.journal.lock().unwrap_or_else(PoisonError::into_inner);
                match ev {
                    watcher::Event::Apply(l) | watcher::Event::InitApply(l) => j.observe(l, now),
                    watcher::Event::Delete(l) => {
                        j.forget(&l.namespace().unwrap_or_default(), &l.name_any())
                    }
                    watcher::Event::Init | watcher::Event::InitDone => {}
                }
            },
        );
        spawn_watch(
            cache.clone(),
            "taskqueues",
            api::<TaskQueue>(client, &cache.scope),
            queues_w,
            |_, _| {},
        );
        cache
    }

    /// The objects as the watches hold them now.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            tasks: self.tasks.state(),
            leases: self.leases.state(),
            queues: self.queues.state(),
        }
    }

    /// Runs `f` with the journal.
    pub fn with_journal<T>(&self, f: impl FnOnce(&Journal) -> T) -> T {
        f(&self.journal.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Each watch's health.
    pub fn health(&self) -> BTreeMap<&'static str, WatchHealth> {
        self.health
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// A receiver that sees the change counter move.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    fn set_health(&self, kind: &'static str, f: impl FnOnce(&mut WatchHealth)) {
        let mut h = self.health.lock().unwrap_or_else(PoisonError::into_inner);
        f(h.entry(kind).or_default());
    }

    fn bump(&self) {
        self.changes.send_modify(|v| *v = v.wrapping_add(1));
    }
}

fn spawn_watch<K>(
    cache: Arc<Cache>,
    kind: &'static str,
    api: Api<K>,
    writer: reflector::store::Writer<K>,
    on_event: fn(&Cache, &watcher::Event<K>),
) where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    cache.set_health(kind, |_| {});
    tokio::spawn(async move {
        let stream = watcher(api.clone(), watcher::Config::default())
            .backoff(WatchBackoff::new(rand::random))
            .reflect(writer);
        futures::pin_mut!(stream);
        let mut probe = tokio::time::interval(PROBE_EVERY);
        loop {
            let ev = tokio::select! {
                ev = stream.next() => ev,
                _ = probe.tick() => {
                    probe_recovery(&cache, kind, &api).await;
                    continue;
                }
            };
            let Some(ev) = ev else { return };
            match ev {
                Ok(ev) => {
                    on_event(&cache, &ev);
                    let synced = matches!(ev, watcher::Event::InitDone);
                    let recovered = cache.health().get(kind).is_some_and(|h| h.error.is_some());
                    cache.set_health(kind, |h| {
                        h.error = None;
                        h.error_since = None;
                        h.last_error = None;
                        h.synced |= synced;
                    });
                    // Objects of a (re)list reach the store at InitDone:
                    // a page refreshed on an InitApply would not see them.
                    if !matches!(ev, watcher::Event::Init | watcher::Event::InitApply(_))
                        || recovered
                    {
                        cache.bump();
                    }
                }
                Err(e) => {
                    let msg = describe(&e);
                    eprintln!("watch of {kind} failed, retrying: {msg}");
                    let fresh = cache.health().get(kind).is_none_or(|h| h.error.is_none());
                    cache.set_health(kind, |h| {
                        h.error = Some(msg);
                        h.last_error = Some(std::time::Instant::now());
                        if h.error_since.is_none() {
                            h.error_since = Some(Timestamp::now());
                        }
                    });
                    if fresh {
                        cache.bump();
                    }
                }
            }
        }
    });
}

/// How often a failing watch's recovery is probed.
const PROBE_EVERY: Duration = Duration::from_secs(1);
/// How long a probe may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// A failing watch retries at least this often (the backoff's cap and
/// its jitter): this long without an error, it is no longer failing.
const QUIET_AFTER_ERROR: Duration = Duration::from_secs(3);

/// A watch that failed to *restart* and then restarts fine produces no
/// event (kube's watcher resumes from its resource version; nothing
/// changed, nothing to say), so the banner would stay up for good. While
/// a watch is marked failing, once it has been quiet for longer than its
/// retry period a short watch of its own tells whether the API server
/// answers (and allows the watch) again; then the error is cleared and the
/// pages reload.
async fn probe_recovery<K>(cache: &Cache, kind: &'static str, api: &Api<K>)
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
{
    let quiet = cache
        .health()
        .get(kind)
        .and_then(|h| h.last_error)
        .is_some_and(|at| at.elapsed() > QUIET_AFTER_ERROR);
    if !quiet {
        return;
    }
    // A watch, not a list: a user allowed to list but not to watch must
    // keep the banner. Bounded, so a silent network does not stall the
    // watch stream this runs beside.
    let started = tokio::time::timeout(
        PROBE_TIMEOUT,
        api.watch_metadata(&WatchParams::default().timeout(1), "0"),
    )
    .await;
    if matches!(started, Ok(Ok(_))) {
        cache.set_health(kind, |h| {
            h.error = None;
            h.error_since = None;
            h.last_error = None;
        });
        cache.bump();
    }
}

/// A watch error as a user can act on it: the API server's own words for
/// a refusal (403 names the missing permission), else the causes.
fn describe(e: &watcher::Error) -> String {
    match e {
        watcher::Error::InitialListFailed(kube::Error::Api(s))
        | watcher::Error::WatchStartFailed(kube::Error::Api(s))
        | watcher::Error::WatchFailed(kube::Error::Api(s)) => {
            format!("{} ({})", s.message, s.code)
        }
        watcher::Error::WatchError(s) => format!("{} ({})", s.message, s.code),
        e => batchlease_api::Chain(e).to_string(),
    }
}
