//! Workers' presence records (the SDK's `presence`: a `coordination.k8s.io`
//! Lease per worker process, labelled `batchlease.dev/worker`, naming the
//! queues it serves): for `TaskQueue.status.workers`, which otherwise saw a
//! worker only through the TaskLeases it holds — one serving an idle queue
//! counted as none (issue 22). Informational: no decision reads it. A
//! record counts for its `leaseDurationSeconds` from when this process
//! observed it (not the worker's clock), like every other expiry here.

use std::sync::Arc;
use std::time::Duration;

use batchlease_api::WatchBackoff;
use batchlease_api::keys::{ANNOTATION_QUEUES, LABEL_WORKER};
use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::queues::QueueBook;

/// What a presence record says: who, which queues, for how long.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Presence {
    pub identity: String,
    pub queues: Vec<String>,
    pub duration: Duration,
}

/// Pure: the presence `l` records, if it is a well-formed one.
pub fn parse(l: &Lease) -> Option<Presence> {
    let spec = l.spec.as_ref()?;
    let identity = spec.holder_identity.clone().filter(|h| !h.is_empty())?;
    let queues: Vec<String> = l
        .annotations()
        .get(ANNOTATION_QUEUES)?
        .split(',')
        .map(str::trim)
        .filter(|q| !q.is_empty())
        .map(str::to_owned)
        .collect();
    let secs = spec.lease_duration_seconds.unwrap_or(0).clamp(1, 3600);
    Some(Presence {
        identity,
        queues,
        duration: Duration::from_secs(u64::try_from(secs).unwrap_or(1)),
    })
}

/// Feeds the presence records of `api`'s scope to `book` until `stop`
/// (as plain data: the book does not know [`Presence`], so `queues.rs`
/// does not import this module).
/// Not counted in readiness: a watch that cannot list (no RBAC for Leases)
/// only leaves idle workers uncounted.
pub async fn watch(api: Api<Lease>, book: Arc<QueueBook>, stop: CancellationToken) {
    let config = watcher::Config::default().labels(&format!("{LABEL_WORKER}=true"));
    let stream = watcher(api, config).backoff(WatchBackoff::new(rand::random));
    futures::pin_mut!(stream);
    loop {
        let event = tokio::select! {
            () = stop.cancelled() => return,
            e = stream.next() => e,
        };
        let ns = |l: &Lease| l.namespace().unwrap_or_default();
        match event {
            Some(Ok(watcher::Event::Apply(l) | watcher::Event::InitApply(l))) => {
                if let Some(p) = parse(&l) {
                    book.worker_seen(&ns(&l), &p.identity, &p.queues, p.duration, Instant::now());
                }
            }
            Some(Ok(watcher::Event::Delete(l))) => {
                if let Some(p) = parse(&l) {
                    book.worker_gone(&ns(&l), &p.identity, &p.queues);
                }
            }
            Some(Ok(_)) => {}
            Some(Err(e)) => {
                warn!(error = %batchlease_api::Chain(&e), "presence watch (workers serving idle queues are not counted meanwhile)");
            }
            None => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::coordination::v1::LeaseSpec;

    fn lease(holder: Option<&str>, queues: Option<&str>, secs: Option<i32>) -> Lease {
        let mut l = Lease::default();
        if let Some(q) = queues {
            l.annotations_mut()
                .insert(ANNOTATION_QUEUES.into(), q.into());
        }
        l.spec = Some(LeaseSpec {
            holder_identity: holder.map(Into::into),
            lease_duration_seconds: secs,
            ..Default::default()
        });
        l
    }

    #[test]
    fn what_a_record_says() {
        let p = |id: &str, q: &[&str], s: u64| {
            Some(Presence {
                identity: id.into(),
                queues: q.iter().map(|s| (*s).to_owned()).collect(),
                duration: Duration::from_secs(s),
            })
        };
        let cases = [
            (
                lease(Some("w/1"), Some("a,b"), Some(30)),
                p("w/1", &["a", "b"], 30),
            ),
            (
                lease(Some("w/1"), Some(" a, ,b "), Some(30)),
                p("w/1", &["a", "b"], 30),
            ),
            // Out-of-range durations are clamped.
            (lease(Some("w/1"), Some("a"), None), p("w/1", &["a"], 1)),
            (
                lease(Some("w/1"), Some("a"), Some(99_999)),
                p("w/1", &["a"], 3600),
            ),
            (lease(None, Some("a"), Some(30)), None),
            (lease(Some(""), Some("a"), Some(30)), None),
            (lease(Some("w/1"), None, Some(30)), None),
        ];
        for (l, want) in cases {
            assert_eq!(parse(&l), want, "{l:?}");
        }
    }
}
