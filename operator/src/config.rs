//! Command-line flags (each also readable from the environment).

use std::net::SocketAddr;

use clap::{Parser, ValueEnum};

/// Log output format.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// The batchlease operator.
#[derive(Debug, Parser)]
#[command(version, about)]
pub struct Config {
    /// Kubeconfig file; without it, KUBECONFIG or the in-cluster config.
    #[arg(long, env = "BATCHLEASE_KUBECONFIG")]
    pub kubeconfig: Option<std::path::PathBuf>,
    /// Namespaces to watch, comma-separated; empty watches all.
    #[arg(
        long,
        env = "BATCHLEASE_NAMESPACES",
        value_delimiter = ',',
        default_value = ""
    )]
    pub namespaces: Vec<String>,
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, env = "BATCHLEASE_METRICS_ADDR", default_value = "0.0.0.0:8080")]
    pub metrics_addr: SocketAddr,
    /// Elect a leader among replicas (disable only with one replica).
    #[arg(long, env = "BATCHLEASE_LEADER_ELECTION", default_value_t = true, action = clap::ArgAction::Set)]
    pub leader_election: bool,
    /// Name of the coordination.k8s.io Lease used for leader election.
    #[arg(
        long,
        env = "BATCHLEASE_LEADER_LEASE_NAME",
        default_value = "batchlease-operator"
    )]
    pub leader_lease_name: String,
    /// Namespace of that Lease and of the resource-lock Leases (in a pod:
    /// its own namespace).
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    pub leader_lease_namespace: String,
    /// Leader lease duration in seconds.
    #[arg(long, env = "BATCHLEASE_LEADER_LEASE_SECONDS", default_value_t = 15)]
    pub leader_lease_seconds: u64,
    /// Renew the leader lease this many seconds before it runs out.
    #[arg(long, env = "BATCHLEASE_LEADER_GRACE_SECONDS", default_value_t = 5)]
    pub leader_grace_seconds: u64,
    /// This replica's identity (default: POD_NAME, or the host name, plus a
    /// random suffix).
    #[arg(long, env = "BATCHLEASE_IDENTITY")]
    pub identity: Option<String>,
    /// Log format.
    #[arg(
        long,
        env = "BATCHLEASE_LOG_FORMAT",
        value_enum,
        default_value = "text"
    )]
    pub log_format: LogFormat,
    /// Events to publish: `important` (Warnings, Reassigned, Redriven) or
    /// `all` (one per step of every task).
    #[arg(
        long,
        env = "BATCHLEASE_EVENTS",
        value_enum,
        default_value = "important"
    )]
    pub events: crate::events::EventLevel,
    /// Write a task `Running` only once its claim has been observed this
    /// many milliseconds (at most half the TTL). Shorter attempts settle
    /// straight from `Ready`: one API write per task fewer. 0 writes
    /// `Running` on every claim.
    #[arg(
        long,
        env = "BATCHLEASE_RUNNING_STATUS_DELAY_MS",
        default_value_t = 1000
    )]
    pub running_status_delay_ms: u64,
}

impl Config {
    /// Watched namespaces; `None` means all.
    pub fn watched_namespaces(&self) -> Option<Vec<String>> {
        let list: Vec<String> = self
            .namespaces
            .iter()
            .filter(|n| !n.is_empty())
            .cloned()
            .collect();
        (!list.is_empty()).then_some(list)
    }
}
