//! A test worker that drives TaskLeases through the API exactly as the SDK
//! will (design §3 steps 2, 3, 6): every write carries the resourceVersion
//! it read.

use batchlease_api::{LeaseOutcome, LeasePhase, TaskLease};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, PostParams};

/// Claims an `Offered` lease: holder, acquire and renew time, phase `Held`.
pub async fn claim(
    api: &Api<TaskLease>,
    lease: &TaskLease,
    holder: &str,
) -> Result<TaskLease, kube::Error> {
    let mut l = lease.clone();
    let now = MicroTime(Timestamp::now());
    l.spec.holder_identity = Some(holder.into());
    l.spec.acquire_time = Some(now.clone());
    l.spec.renew_time = Some(now);
    l.status.get_or_insert_with(Default::default).phase = Some(LeasePhase::Held);
    api.replace(&l.name_any(), &PostParams::default(), &l).await
}

/// Renews a held lease from the copy the holder last wrote.
pub async fn renew(api: &Api<TaskLease>, lease: &TaskLease) -> Result<TaskLease, kube::Error> {
    let mut l = lease.clone();
    l.spec.renew_time = Some(MicroTime(Timestamp::now()));
    api.replace(&l.name_any(), &PostParams::default(), &l).await
}

/// Completes a held lease with `outcome`.
pub async fn complete(
    api: &Api<TaskLease>,
    lease: &TaskLease,
    outcome: LeaseOutcome,
    reason: Option<&str>,
    result: Option<serde_json::Value>,
) -> Result<TaskLease, kube::Error> {
    let mut l = lease.clone();
    let st = l.status.get_or_insert_with(Default::default);
    st.phase = Some(LeasePhase::Completed);
    st.outcome = Some(outcome);
    st.reason = reason.map(Into::into);
    st.result = result.and_then(|v| batchlease_api::JsonObject::try_from(v).ok());
    api.replace(&l.name_any(), &PostParams::default(), &l).await
}

/// The HTTP status code of a failed API call (0 if not an API error).
pub fn code(e: &kube::Error) -> u16 {
    match e {
        kube::Error::Api(s) => s.code,
        _ => 0,
    }
}
