//! `batchlease-operator`: issues fenced TaskLeases for BatchTasks, follows
//! claims, expires silent holders by observed time, settles attempts into
//! success, retry or the dead-letter queue (design §3, §7, §8).

mod addressees;
mod config;
mod context;
mod controller;
mod effects;
mod error;
mod events;
mod expectations;
mod graph_index;
mod http;
mod inputs;
mod leader;
#[cfg(test)]
mod leader_fake;
mod metrics;
mod presence;
mod process;
mod queue_status;
mod queues;
mod reconcile;
mod spawned;
mod supervise;
mod sync_counter;

use batchlease_operator::{
    decide, deps, fit, leader_step, lease_build, locks, observe, offers, queue_gate, speculation,
    status, worker_leases,
};

use std::sync::Arc;
use std::sync::atomic::Ordering;

use anyhow::Context;
use clap::Parser;
use kube::runtime::events::Reporter;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;
use tracing::{error, info};

use crate::config::{Config, LogFormat};
use crate::leader::ElectionConfig;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cfg = Config::parse();
    cfg.validate()?;
    init_tracing(cfg.log_format);
    let client = client(&cfg).await?;
    let identity = leader::identity(cfg.identity.as_deref());
    info!(%identity, namespaces = ?cfg.watched_namespaces(), "starting batchlease-operator");

    let mut campaign = if cfg.leader_election {
        let election = ElectionConfig {
            namespace: cfg.leader_lease_namespace.clone(),
            lease_name: cfg.leader_lease_name.clone(),
            identity: identity.clone(),
            duration_seconds: cfg.leader_lease_seconds,
            grace_seconds: cfg.leader_grace_seconds,
        };
        leader::campaign(client.clone(), &election)
    } else {
        leader::Campaign::none()
    };
    let mut registry = Registry::default();
    // Unprefixed, as every Prometheus client names them: the restart alert
    // and the dashboard's memory and CPU panels read them.
    registry.register_collector(Box::new(process::ProcessCollector));
    let metrics = metrics::Metrics::new(&mut registry);
    let health = Arc::new(http::Health {
        registry,
        ready: Default::default(),
        live: Default::default(),
        holding: campaign.holding(),
        running: Default::default(),
    });
    let server = tokio::spawn(http::serve(cfg.metrics_addr, health.clone()));
    let namespaces: Vec<Option<String>> = match cfg.watched_namespaces() {
        Some(list) => list.into_iter().map(Some).collect(),
        None => vec![None],
    };
    let reporter = Reporter {
        controller: "batchlease-operator".into(),
        instance: Some(identity.clone()),
    };
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    tokio::pin!(server);
    let exit = loop {
        // A standby replica is healthy and ready: it serves metrics and waits.
        health.ready.store(true, Ordering::Release);
        if cfg.leader_election {
            info!("waiting for leadership");
        } else {
            info!("leader election disabled (--leader-election=false): this replica leads");
        }
        let leadership = tokio::select! {
            l = campaign.acquired() => match l {
                Ok(l) => l,
                Err(e) => {
                    // The election task died: nothing would ever lead or
                    // renew again. Let Kubernetes restart the process.
                    error!(error = format!("{e:#}"), "leader election ended: exiting");
                    health.live.fail(format!("leader election ended: {e}"));
                    break 1;
                }
            },
            _ = &mut shutdown => {
                info!("shutting down");
                break 0;
            }
            r = &mut server => {
                error!(result = ?r, "metrics server ended");
                break 1;
            }
        };
        health.ready.store(false, Ordering::Release);
        health.running.store(true, Ordering::Release);
        metrics.is_leader.set(1);
        info!(%identity, "leading: starting controllers");
        // Everything of a term is new: caches, observations (every held
        // lease gets a full TTL), expectations, the readiness count.
        let synced = Arc::new(sync_counter::SyncCounter::default());
        let shared = controller::Shared {
            client: client.clone(),
            synced: synced.clone(),
            metrics: metrics.clone(),
            reporter: reporter.clone(),
            leadership: leadership.clone(),
            lock_namespace: cfg.leader_lease_namespace.clone(),
            events: cfg.events,
            running_after: std::time::Duration::from_millis(cfg.running_status_delay_ms),
            address_offers: cfg.address_offers,
            bind_offers: cfg.bind_offers,
        };
        let stop = CancellationToken::new();
        let mut tasks = supervise::TermTasks::default();
        let mut stores = Vec::new();
        let mut lease_stores = Vec::new();
        let mut queue_stores = Vec::new();
        let mut indexes = Vec::new();
        for ns in &namespaces {
            let running = controller::start(&shared, ns.as_deref(), stop.clone());
            stores.push(running.tasks);
            lease_stores.push(running.leases);
            queue_stores.push(running.queues);
            indexes.push(running.index);
            let scope = ns.as_deref().unwrap_or("*");
            tasks.adopt(format!("controller for namespace {scope}"), running.done);
        }
        metrics.watch_tasks(
            stores,
            lease_stores,
            queue_stores,
            indexes,
            Some(synced.clone()),
        );
        // Not a term task: it only reads the caches, and ends with `stop`.
        tokio::spawn(metrics::forget_gone_queues(metrics.clone(), stop.clone()));
        let ready = {
            let (health, synced) = (health.clone(), synced.clone());
            tokio::spawn(async move {
                synced.wait().await;
                health.ready.store(true, Ordering::Release);
                info!("caches synced: ready");
            })
        };
        let ended = tokio::select! {
            _ = leadership.clone().lost() => {
                error!("leadership lost: stopped all writers of this term; standing by");
                None
            }
            _ = &mut shutdown => {
                info!("shutting down");
                Some(0)
            }
            r = &mut server => {
                error!(result = ?r, "metrics server ended");
                Some(1)
            }
            ended = tasks.first_ended() => {
                // Controllers run until `stop`; one that ended on its own
                // leaves a leader that holds the Lease and does nothing.
                error!(task = %ended.name, outcome = %ended.outcome,
                    "a controller ended unexpectedly: failing /healthz, stopping the term, exiting");
                health.live.fail(format!("{ended} unexpectedly"));
                Some(1)
            }
        };
        ready.abort();
        health.running.store(false, Ordering::Release);
        stop.cancel();
        metrics.is_leader.set(0);
        metrics.watch_tasks(Vec::new(), Vec::new(), Vec::new(), Vec::new(), None);
        let drain = tasks.drain();
        // The old term's writes are refused by their generation and bounded
        // by its end; still, let in-flight reconciles finish (bounded)
        // before campaigning again or vacating, so no request of this term
        // is outstanding when the next leader may start.
        if tokio::time::timeout(SHUTDOWN_BUDGET, drain).await.is_err() {
            tracing::warn!("controllers did not stop in time; going on");
        }
        if let Some(code) = ended {
            break code;
        }
    };
    // Vacate the lease (so a standby takes over at once instead of after a
    // TTL), bounded, then end.
    campaign.vacate(SHUTDOWN_BUDGET).await;
    std::process::exit(exit);
}

/// How long each shutdown step (draining reconciles, vacating the leader
/// Lease) may take.
const SHUTDOWN_BUDGET: std::time::Duration = std::time::Duration::from_secs(3);

async fn client(cfg: &Config) -> anyhow::Result<kube::Client> {
    let config = match &cfg.kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path).context("reading --kubeconfig")?;
            kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?
        }
        None => kube::Config::infer()
            .await
            .context("no kubeconfig and not in a cluster")?,
    };
    Ok(kube::Client::try_from(config)?)
}

fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,kube=warn"));
    // Colours only on a terminal: a log file or a collector gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stdout());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi);
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let Ok(mut term) =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        else {
            let _ = ctrl_c.await;
            return;
        };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}
