//! Leader election on a `coordination.k8s.io/v1` Lease (kube-lease-manager).
//!
//! Only the leader writes. Every write checks [`Leadership::ensure`] first
//! (the linkerd pattern), and losing the lease cancels the controllers and
//! ends the process, so a deposed leader has no writer left running. Its
//! writes are resourceVersion-conditional anyway, so a late one fails.

use kube_lease_manager::LeaseManagerBuilder;
use tokio::sync::watch;

use crate::reconcile::Error;

/// Whether this replica may write right now.
#[derive(Clone, Debug)]
pub struct Leadership {
    rx: Option<watch::Receiver<bool>>,
}

impl Leadership {
    /// Leader election disabled: a single replica is always the leader.
    pub fn always() -> Self {
        Self { rx: None }
    }

    /// True while this replica holds the leader lease.
    pub fn is_leader(&self) -> bool {
        self.rx.as_ref().is_none_or(|rx| *rx.borrow())
    }

    /// Fails with [`Error::NotLeader`] unless this replica is the leader.
    pub fn ensure(&self) -> Result<(), Error> {
        if self.is_leader() {
            Ok(())
        } else {
            Err(Error::NotLeader)
        }
    }

    /// Resolves once this replica has become the leader.
    pub async fn acquired(&mut self) -> anyhow::Result<()> {
        if let Some(rx) = &mut self.rx {
            rx.wait_for(|leader| *leader).await?;
        }
        Ok(())
    }

    /// Resolves when leadership is lost (never, when election is disabled).
    pub async fn lost(mut self) {
        match &mut self.rx {
            Some(rx) => {
                let _ = rx.wait_for(|leader| !*leader).await;
            }
            None => std::future::pending().await,
        }
    }
}

/// Election settings.
#[derive(Clone, Debug)]
pub struct ElectionConfig {
    pub namespace: String,
    pub lease_name: String,
    pub identity: String,
    pub duration_seconds: u64,
    pub grace_seconds: u64,
}

/// Starts campaigning; the returned [`Leadership`] follows the lease.
/// Dropping every clone of it releases the lease (the manager's task sees
/// its channel closed and vacates, so a successor need not wait a TTL).
pub async fn campaign(
    client: kube::Client,
    cfg: &ElectionConfig,
) -> anyhow::Result<(Leadership, Campaign)> {
    let manager = LeaseManagerBuilder::new(client, &cfg.lease_name)
        .with_namespace(&cfg.namespace)
        .with_identity(&cfg.identity)
        .with_duration(cfg.duration_seconds)
        .with_grace(cfg.grace_seconds)
        .with_field_manager("batchlease-operator")
        .build()
        .await?;
    let (rx, task) = manager.watch().await;
    Ok((Leadership { rx: Some(rx) }, Campaign(Some(task))))
}

/// The background task that holds (and on shutdown releases) the lease.
#[derive(Debug)]
pub struct Campaign(
    Option<tokio::task::JoinHandle<kube_lease_manager::Result<kube_lease_manager::LeaseManager>>>,
);

impl Campaign {
    /// No election.
    pub fn none() -> Self {
        Self(None)
    }

    /// Once every [`Leadership`] clone is dropped, waits (bounded) for the
    /// lease to be vacated so a standby takes over without waiting a TTL.
    pub async fn vacate(self) {
        if let Some(task) = self.0 {
            match tokio::time::timeout(std::time::Duration::from_secs(5), task).await {
                Ok(Ok(Ok(_))) => tracing::info!("leader lease released"),
                Ok(Ok(Err(e))) => tracing::warn!(error = %e, "releasing the leader lease failed"),
                Ok(Err(e)) => tracing::warn!(error = %e, "leader election task failed"),
                Err(_) => tracing::warn!("leader lease not released within 5s"),
            }
        }
    }
}
