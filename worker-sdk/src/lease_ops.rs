//! The worker's writes to a TaskLease (design §3 steps 2, 3, 6). Each is
//! one replace of the whole object carrying the resourceVersion read.

use batchlease_api::{JsonObject, LeaseOutcome, LeasePhase, TaskLease};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, PostParams};

use crate::error::Error;

/// Result of a renewal.
#[derive(Debug)]
pub enum Renewal {
    /// Renewed; the lease as now stored.
    Renewed(Box<TaskLease>),
    /// The lease is no longer held by us: fire the kill switch.
    Lost(&'static str),
    /// The operator released the lease: the task was cancelled.
    Cancelled,
}

fn now() -> MicroTime {
    MicroTime(Timestamp::now())
}

/// True if `lease` is held by `holder`.
pub fn held_by(lease: &TaskLease, holder: &str) -> bool {
    lease.status.as_ref().and_then(|s| s.phase) == Some(LeasePhase::Held)
        && lease.spec.holder_identity.as_deref() == Some(holder)
}

/// True if the operator released `lease` because its task was cancelled.
pub fn released_by_cancel(lease: &TaskLease) -> bool {
    let st = lease.status.as_ref();
    st.and_then(|s| s.phase) == Some(LeasePhase::Released)
        && st.and_then(|s| s.reason.as_deref())
            == Some(batchlease_api::keys::release_reason::CANCELLED)
}

/// True if `lease` carries the completion `c` written by `holder`.
fn completed_by(lease: &TaskLease, holder: &str, c: &Completion) -> bool {
    let st = lease.status.as_ref();
    st.and_then(|s| s.phase) == Some(LeasePhase::Completed)
        && lease.spec.holder_identity.as_deref() == Some(holder)
        && st.and_then(|s| s.outcome) == Some(c.outcome)
}

/// Re-reads a lease after a conflict: `Ok(fresh)` while it is still held
/// by `holder`, `Err(fresh)` once it is not (`None`: gone).
async fn still_ours(
    api: &Api<TaskLease>,
    name: &str,
    holder: &str,
) -> Result<Result<TaskLease, Option<TaskLease>>, Error> {
    match api.get_opt(name).await {
        Ok(Some(fresh)) if held_by(&fresh, holder) => Ok(Ok(fresh)),
        Ok(other) => Ok(Err(other)),
        Err(source) => Err(Error::Kube {
            what: "re-read after conflict",
            source,
        }),
    }
}

/// Claims an `Offered` lease. `Ok(None)`: another worker won (409) or the
/// offer is gone.
///
/// `renewal` is how the claimant will keep it alive: `Renewal::Worker`
/// turns an offer stamped `Lease` into one renewed through the holder's
/// WorkerLease (only such an offer: the CRD refuses any other change of
/// `spec.renewal`); `Renewal::Lease` claims as always, renewed per lease.
pub async fn claim(
    api: &Api<TaskLease>,
    offered: &TaskLease,
    holder: &str,
    renewal: batchlease_api::Renewal,
) -> Result<Option<TaskLease>, Error> {
    let mut l = offered.clone();
    if renewal == batchlease_api::Renewal::Worker
        && l.spec.renewal == Some(batchlease_api::Renewal::Lease)
    {
        l.spec.renewal = Some(batchlease_api::Renewal::Worker);
    }
    let t = now();
    l.spec.holder_identity = Some(holder.into());
    l.spec.acquire_time = Some(t.clone());
    l.spec.renew_time = Some(t);
    l.status.get_or_insert_with(Default::default).phase = Some(LeasePhase::Held);
    match api.replace(&l.name_any(), &PostParams::default(), &l).await {
        Ok(held) => Ok(Some(held)),
        // 409: someone else's write won; 404: gone; 422: no longer Offered.
        Err(kube::Error::Api(s)) if matches!(s.code, 404 | 409 | 422) => Ok(None),
        Err(source) => Err(Error::Kube {
            what: "claim",
            source,
        }),
    }
}

/// Renews from our last copy, carrying the latest checkpoint.
pub async fn renew(
    api: &Api<TaskLease>,
    ours: &TaskLease,
    holder: &str,
    checkpoint: Option<JsonObject>,
) -> Result<Renewal, Error> {
    let mut l = ours.clone();
    l.spec.renew_time = Some(now());
    if let Some(cp) = checkpoint {
        l.status.get_or_insert_with(Default::default).checkpoint = Some(cp);
    }
    match api.replace(&l.name_any(), &PostParams::default(), &l).await {
        Ok(stored) => Ok(Renewal::Renewed(Box::new(stored))),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(Renewal::Lost("lease deleted")),
        Err(kube::Error::Api(s)) if s.code == 409 || s.code == 422 => {
            // Someone wrote after our copy. Only the operator writes a held
            // lease besides us, and only to end it — but look before leaping.
            match still_ours(api, &l.name_any(), holder).await? {
                // 422 on a lease still ours: the API server refuses the
                // write itself (our checkpoint?). The same write would be
                // refused again: end the attempt, saying why.
                Ok(_) if s.code == 422 => Err(Error::Invalid {
                    what: "renewal",
                    lease: l.name_any(),
                    message: s.message,
                }),
                // Still ours (e.g. our own earlier write whose answer was
                // lost): retry on the fresh copy right away.
                Ok(fresh) => {
                    Box::pin(renew(
                        api,
                        &fresh,
                        holder,
                        l.status.and_then(|s| s.checkpoint),
                    ))
                    .await
                }
                Err(Some(f)) if released_by_cancel(&f) => Ok(Renewal::Cancelled),
                Err(_) => Ok(Renewal::Lost("lease no longer held by us")),
            }
        }
        Err(source) => Err(Error::Kube {
            what: "renewal",
            source,
        }),
    }
}

/// How an attempt ended, as written to the lease.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    pub outcome: LeaseOutcome,
    pub reason: Option<String>,
    pub message: Option<String>,
    pub permanent: bool,
    pub result: Option<JsonObject>,
    pub checkpoint: Option<JsonObject>,
}

/// One completion attempt from `ours`, no re-read: a conflict means someone
/// else wrote the lease, and then it is not ours to end.
pub async fn complete_once(
    api: &Api<TaskLease>,
    ours: &TaskLease,
    c: &Completion,
) -> Result<(), Error> {
    let l = completed(ours, c);
    match api.replace(&l.name_any(), &PostParams::default(), &l).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code < 500 => Err(Error::Rejected {
            what: "completion",
            lease: l.name_any(),
            source: kube::Error::Api(s),
        }),
        Err(source) => Err(Error::Kube {
            what: "completion",
            source,
        }),
    }
}

/// `ours` with the completion written into its status.
fn completed(ours: &TaskLease, c: &Completion) -> TaskLease {
    let mut l = ours.clone();
    let st = l.status.get_or_insert_with(Default::default);
    st.phase = Some(LeasePhase::Completed);
    st.outcome = Some(c.outcome);
    st.reason = c.reason.clone();
    st.message = c.message.clone();
    st.permanent = c.permanent;
    st.result = c.result.clone();
    if c.checkpoint.is_some() {
        st.checkpoint = c.checkpoint.clone();
    }
    l
}

/// Sets the lease `Completed`. A conflict is retried only while the lease
/// is still held by us; otherwise the completion is rejected (typed).
pub async fn complete(
    api: &Api<TaskLease>,
    ours: &TaskLease,
    holder: &str,
    c: &Completion,
) -> Result<(), Error> {
    let mut current = ours.clone();
    for _ in 0..3 {
        let l = completed(&current, c);
        let rejected = |s| Error::Rejected {
            what: "completion",
            lease: l.name_any(),
            source: kube::Error::Api(s),
        };
        match api.replace(&l.name_any(), &PostParams::default(), &l).await {
            Ok(_) => return Ok(()),
            Err(kube::Error::Api(s)) if s.code == 409 => {
                let fresh = api
                    .get_opt(&l.name_any())
                    .await
                    .map_err(|source| Error::Kube {
                        what: "re-read after conflict",
                        source,
                    })?;
                match fresh {
                    // Our own earlier try landed, its answer lost: done.
                    Some(f) if completed_by(&f, holder, c) => return Ok(()),
                    Some(f) if held_by(&f, holder) => current = f,
                    _ => return Err(rejected(s)),
                }
            }
            Err(kube::Error::Api(s)) if s.code == 422 => {
                // A final lease refuses every write: maybe it is final with
                // our own completion, whose answer was lost.
                let fresh = api.get_opt(&l.name_any()).await.ok().flatten();
                return match fresh {
                    Some(f) if completed_by(&f, holder, c) => Ok(()),
                    // Still ours: the completion itself is invalid.
                    Some(f) if held_by(&f, holder) => Err(Error::Invalid {
                        what: "completion",
                        lease: l.name_any(),
                        message: s.message,
                    }),
                    _ => Err(rejected(s)),
                };
            }
            Err(kube::Error::Api(s)) if s.code == 404 => return Err(rejected(s)),
            Err(source) => {
                return Err(Error::Kube {
                    what: "completion",
                    source,
                });
            }
        }
    }
    Err(Error::Contended { what: "completion" })
}
