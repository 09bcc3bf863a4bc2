//! What a worker watches to find its offers.
//!
//! Renewing per worker, it takes offers addressed to it (issue 27,
//! `offeredTo`): it watches the TaskLeases labelled with its WorkerLease's
//! name — its offers, and what it holds — and its queues' unaddressed
//! offers, instead of every lease of its queues. A lease's changes then go
//! to its worker and the operator only, whatever the size of the fleet.
//! Renewing per lease, it watches every lease of its queues as before
//! (and claims only those addressed to nobody or to itself).

use std::sync::Arc;

use batchlease_api::keys::{LABEL_QUEUE, LABEL_WORKER};
use batchlease_api::worker_lease::worker_lease_name;
use batchlease_api::{TaskLease, WatchBackoff};
use futures::StreamExt;
use kube::api::Api;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::warn;

/// Pure: the label selectors of the watches a worker of `queues` runs
/// (`addressed`: it takes addressed offers, renewing per worker).
pub fn selectors(queues: &[String], identity: &str, addressed: bool) -> Vec<String> {
    let queues = format!("{LABEL_QUEUE} in ({})", queues.join(","));
    if addressed {
        vec![
            format!("{LABEL_WORKER}={}", worker_lease_name(identity)),
            format!("{queues},!{LABEL_WORKER}"),
        ]
    } else {
        vec![queues]
    }
}

/// Starts one watch per selector, each filling its own store; every event
/// wakes `changed` (InitDone included: during a list the reflector buffers
/// objects and fills the store only at the list's end, so an object event
/// alone can arrive before the store shows it). The watches end with
/// `stop`.
pub(super) fn spawn(
    api: &Api<TaskLease>,
    selectors: &[String],
    changed: &Arc<Notify>,
    stop: &CancellationToken,
) -> Vec<Store<TaskLease>> {
    selectors
        .iter()
        .map(|selector| {
            let (store, writer) = reflector::store();
            let stream = watcher(api.clone(), watcher::Config::default().labels(selector))
                .backoff(WatchBackoff::new(rand::random))
                .reflect(writer);
            let (changed, stop) = (changed.clone(), stop.clone());
            tokio::spawn(async move {
                futures::pin_mut!(stream);
                loop {
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        ev = stream.next() => match ev {
                            Some(Ok(_)) => changed.notify_one(),
                            Some(Err(e)) => warn!(error = %batchlease_api::Chain(&e), "lease watch"),
                            None => return,
                        }
                    }
                }
            });
            store
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_taking_addressed_offers_watches_its_own_and_the_unaddressed() {
        let q = vec!["a".to_owned(), "b".to_owned()];
        assert_eq!(
            selectors(&q, "pod/1", false),
            vec!["batchlease.dev/queue in (a,b)".to_owned()]
        );
        let name = worker_lease_name("pod/1");
        assert_eq!(
            selectors(&q, "pod/1", true),
            vec![
                format!("batchlease.dev/worker={name}"),
                "batchlease.dev/queue in (a,b),!batchlease.dev/worker".to_owned(),
            ]
        );
    }
}
