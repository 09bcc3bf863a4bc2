//! The worker's presence record: a `coordination.k8s.io/v1` Lease per
//! worker process in its namespace, labelled [`LABEL_WORKER`], naming the
//! queues it serves, renewed every [`PERIOD`] and deleted when the worker
//! stops. Without it the operator sees a worker only through the
//! TaskLeases it holds, and a worker serving an idle queue counted as none
//! (`TaskQueue.status.workers`, the `WORKERS` column; issue 22).
//!
//! Best effort and informational: no decision reads it, so a worker whose
//! RBAC does not allow it (the chart's worker role does) says so once and
//! runs on. One write per worker per [`PERIOD`].

use std::time::Duration;

use batchlease_api::keys::{ANNOTATION_QUEUES, LABEL_WORKER, presence_name};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

/// How often the record is renewed.
pub const PERIOD: Duration = Duration::from_secs(10);
/// How long a record counts after its last renewal (three periods: one or
/// two lost renewals do not make a worker vanish).
pub const DURATION_SECONDS: i32 = 30;

/// The record of `identity` serving `queues`, renewed now (an apply
/// patch: created or updated in one request).
pub fn record(identity: &str, queues: &[String], now: Timestamp) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": presence_name(identity),
            "labels": { LABEL_WORKER: "true" },
            "annotations": { ANNOTATION_QUEUES: queues.join(",") },
        },
        "spec": {
            "holderIdentity": identity,
            "leaseDurationSeconds": DURATION_SECONDS,
            "renewTime": MicroTime(now),
        },
    })
}

/// Renews the record every [`PERIOD`] until `stop`, then deletes it.
pub async fn run(api: Api<Lease>, identity: String, queues: Vec<String>, stop: CancellationToken) {
    let name = presence_name(&identity);
    let params = PatchParams::apply("batchlease-worker").force();
    let mut warned = false;
    loop {
        let rec = record(&identity, &queues, Timestamp::now());
        match tokio::time::timeout(PERIOD, api.patch(&name, &params, &Patch::Apply(&rec))).await {
            Ok(Ok(_)) => warned = false,
            Ok(Err(e)) if !warned => {
                warned = true;
                warn!(error = %batchlease_api::Chain(&e), lease = %name,
                    "presence record not written: the operator will count this worker only while it holds a lease");
            }
            Ok(Err(e)) => debug!(error = %batchlease_api::Chain(&e), "presence record"),
            Err(_) => debug!("presence record: write timed out"),
        }
        tokio::select! {
            () = stop.cancelled() => break,
            () = tokio::time::sleep(PERIOD) => {}
        }
    }
    // Bounded: a worker on its way out does not wait for a silent server;
    // the record then lapses after its duration.
    let deleted = tokio::time::timeout(
        Duration::from_secs(2),
        api.delete(&name, &DeleteParams::default()),
    )
    .await;
    debug!(ok = matches!(deleted, Ok(Ok(_))), "presence record deleted");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_record_names_the_worker_and_its_queues() {
        let r = record(
            "pod-1/00beef",
            &["a".to_owned(), "b".to_owned()],
            Timestamp::from_second(1).unwrap(),
        );
        assert_eq!(r["metadata"]["name"], presence_name("pod-1/00beef"));
        assert!(
            r["metadata"]["name"]
                .as_str()
                .unwrap()
                .starts_with("batchlease-worker-")
        );
        assert_eq!(r["metadata"]["labels"][LABEL_WORKER], "true");
        assert_eq!(r["metadata"]["annotations"][ANNOTATION_QUEUES], "a,b");
        assert_eq!(r["spec"]["holderIdentity"], "pod-1/00beef");
        assert_eq!(r["spec"]["leaseDurationSeconds"], DURATION_SECONDS);
        assert_ne!(presence_name("pod-1/00beef"), presence_name("pod-1/00beee"));
    }
}
