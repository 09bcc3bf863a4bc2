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
    /// Leader lease duration in seconds. Every replica must be given the
    /// same: a standby waits its own duration, whatever the Lease says.
    #[arg(long, env = "BATCHLEASE_LEADER_LEASE_SECONDS", default_value_t = 15,
          value_parser = clap::value_parser!(u64).range(2..))]
    pub leader_lease_seconds: u64,
    /// The leader stops writing this many seconds before a standby may take
    /// over (at least 1, less than the duration): the margin for request
    /// latency and for clocks that run at different rates.
    #[arg(long, env = "BATCHLEASE_LEADER_GRACE_SECONDS", default_value_t = 5,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub leader_grace_seconds: u64,
    /// This replica's identity (default: POD_NAME, or the host name); a
    /// random suffix is always added, so two processes never share one.
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
    /// Address each offer to one worker that takes addressed offers
    /// (issue 27). `false` offers to every worker of the queue and opens
    /// outstanding addressed offers as they come up — set it before
    /// rolling back to an operator without addressing.
    #[arg(long, env = "BATCHLEASE_ADDRESS_OFFERS", default_value_t = true, action = clap::ArgAction::Set)]
    pub address_offers: bool,
    /// Bind a new offer to the worker it is addressed to when that worker
    /// has a free slot and takes bound attempts: the lease is created
    /// already `Held` by it, and the claim write goes (design "Fleets").
    /// `false` offers every attempt to be claimed — set it before rolling
    /// back to an operator that does not bind.
    #[arg(long, env = "BATCHLEASE_BIND_OFFERS", default_value_t = true, action = clap::ArgAction::Set)]
    pub bind_offers: bool,
}

impl Config {
    /// Checks what clap cannot: the grace is below the lease duration.
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.leader_grace_seconds < self.leader_lease_seconds,
            "--leader-grace-seconds ({}) must be less than --leader-lease-seconds ({})",
            self.leader_grace_seconds,
            self.leader_lease_seconds
        );
        Ok(())
    }

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

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> anyhow::Result<Config> {
        let cfg = Config::try_parse_from([&["batchlease-operator"], args].concat())?;
        cfg.validate()?;
        Ok(cfg)
    }

    #[test]
    fn the_election_needs_a_grace_below_the_duration() {
        assert!(parse(&[]).is_ok());
        assert!(parse(&["--leader-lease-seconds=6", "--leader-grace-seconds=2"]).is_ok());
        for bad in [
            &["--leader-grace-seconds=0"][..],
            &["--leader-lease-seconds=1"],
            &["--leader-lease-seconds=6", "--leader-grace-seconds=6"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?} accepted");
        }
    }
}
