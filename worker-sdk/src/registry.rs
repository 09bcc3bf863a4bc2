//! Registration of an attempt's fencing token in storage before its handler
//! runs (design §4), and what it can find there: an earlier attempt's
//! commit.
//!
//! Its own module because both the handler's context and the speculative
//! executor ([`crate::speculate`]) read an [`EarlierCommit`]; kept apart
//! from either, neither has to import the other to name it.

use serde_json::Value;

use crate::error::Error;
use crate::fence::Fence;

/// A commit that an earlier attempt of the same task made before this one
/// registered (design §4). The work is done; a handler normally returns
/// this result instead of doing it again.
#[derive(Debug, Clone, PartialEq)]
pub struct EarlierCommit {
    /// The fencing token of the attempt whose commit stuck.
    pub token: i64,
    /// What it committed.
    pub payload: Option<Value>,
}

/// Storage in which each attempt registers its fencing token before its
/// handler runs (see `postgres::FencedStore`). Registration raises the
/// stored token to ours, so every later write of an older attempt is
/// refused; it fails with [`Error::Fenced`] when a newer attempt already
/// registered (we are the zombie). The fence also carries the attempt's
/// resource tokens ([`Fence::resource_tokens`]): a registry registers them
/// too, in the same transaction, and fails with [`Error::ResourceFenced`]
/// when a newer holder of a resource registered first.
pub trait Registry: Send + Sync {
    /// Registers `fence`'s token (and its resource tokens) for the task
    /// with UID `task_uid`; returns the commit of an earlier attempt, if
    /// one stuck.
    fn register<'a>(
        &'a self,
        task_uid: &'a str,
        fence: &'a Fence,
    ) -> futures::future::BoxFuture<'a, Result<Option<EarlierCommit>, Error>>;
}
