//! Why a reconcile failed. A leaf: `leader.rs` refuses a write with
//! [`Error::NotLeader`], and the reconciler's modules all return it, so it
//! lives below them all (it used to be `reconcile.rs`'s, which tied
//! `leader.rs` into an import circle).

/// Why a reconcile failed. Categories, not messages: they label metrics.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// This replica is not (or no longer) the leader: it must not write.
    #[error("not the leader; refusing to write")]
    NotLeader,
    /// A conditional write lost against a newer version (409).
    #[error("conflict writing {what}: the cached copy is stale")]
    Conflict { what: &'static str },
    /// A write did not answer before the leader's term ended.
    #[error("{what} did not answer within the leader's term")]
    Timeout { what: &'static str },
    /// Any other API error.
    #[error("kubernetes API error during {what}: {source}")]
    Kube {
        what: &'static str,
        #[source]
        source: kube::Error,
    },
}

impl Error {
    /// Low-cardinality label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::NotLeader => "not_leader",
            Self::Conflict { .. } => "conflict",
            Self::Timeout { .. } => "timeout",
            Self::Kube { .. } => "kube",
        }
    }
}
