//! What the writes are reported as: Events (bounded by the leader's term,
//! filtered by `--events`), the metrics of status transitions, and logs.

use batchlease_api::{BatchTask, TaskLease};
use kube::runtime::events::{Event, EventType};
use kube::{Resource, ResourceExt};
use tracing::{debug, info, warn};

use crate::context::Ctx;
use crate::decide::{ExpiryReason, Transition};
use crate::metrics::{QueueCounter, QueueLabels, ReasonCounter, reason_label};

/// Events, metrics and logs for a status transition.
pub async fn report(ctx: &Ctx, task: &BatchTask, transition: &Transition) {
    let queue = QueueLabels::of(task);
    let token = task.status.as_ref().map_or(0, |s| s.fencing_token);
    let (type_, reason, note) = match transition {
        Transition::Initialized | Transition::RedriveIgnored => return,
        Transition::Claimed { holder } => (
            EventType::Normal,
            "LeaseClaimed",
            format!("{holder} holds the lease with fencing token {token}"),
        ),
        Transition::Succeeded => (
            EventType::Normal,
            "Succeeded",
            format!("completed with fencing token {token}"),
        ),
        Transition::Retry {
            reason,
            delay_seconds,
            ..
        } => {
            ctx.metrics
                .count_reason(ReasonCounter::Retries, &queue, &reason_label(reason));
            (
                EventType::Warning,
                "Retrying",
                format!(
                    "attempt with token {token} ended: {reason}; next attempt in {delay_seconds:.1}s"
                ),
            )
        }
        Transition::Interrupted { delay_seconds } if *delay_seconds > 0.0 => (
            EventType::Warning,
            "Interrupted",
            format!(
                "attempt with token {token} interrupted again; next attempt in {delay_seconds:.1}s"
            ),
        ),
        Transition::Interrupted { .. } => (
            EventType::Normal,
            "Interrupted",
            format!(
                "attempt with token {token} interrupted (worker drained or gave the lease back); offered again at once"
            ),
        ),
        Transition::Aborted { quarantined } => {
            let note = if *quarantined {
                "speculative commit lost its compare-and-swap; too many aborts, falling back to Exclusive".to_owned()
            } else {
                "speculative commit lost its compare-and-swap; retrying".to_owned()
            };
            (EventType::Normal, "Aborted", note)
        }
        Transition::DeadLettered { reason, .. } => {
            ctx.metrics.count_reason(
                ReasonCounter::TasksDeadLettered,
                &queue,
                &reason_label(reason),
            );
            (
                EventType::Warning,
                "DeadLettered",
                format!(
                    "gave up after the attempt with token {token}: {reason}; raise spec.redrive to retry"
                ),
            )
        }
        Transition::WaitingForDependencies => return,
        Transition::DependencyFailed => (
            EventType::Warning,
            "DependencyFailed",
            task.status
                .as_ref()
                .and_then(|s| {
                    s.conditions
                        .iter()
                        .find(|c| c.type_ == batchlease_api::keys::condition::DEPENDENCY_FAILED)
                })
                .map(|c| c.message.clone())
                .unwrap_or_default(),
        ),
        Transition::CycleDetected { cycle } => {
            ctx.metrics
                .count(QueueCounter::GraphCycleDetected, &queue, 1);
            (
                EventType::Warning,
                "CycleDetected",
                format!("rejected: dependency cycle {cycle}"),
            )
        }
        Transition::Redriven => (
            EventType::Normal,
            "Redriven",
            "spec.redrive raised: back to Pending with a fresh retry budget".to_owned(),
        ),
        Transition::Cancelled { holder } => (
            EventType::Normal,
            "Cancelled",
            match holder {
                Some(h) => format!(
                    "cancelled (spec.cancel): the lease of {h} with fencing token {token} was released and its attempt has stopped"
                ),
                None => "cancelled (spec.cancel) before any worker held it".to_owned(),
            },
        ),
        Transition::CancelAwaitsLostHolder => (
            EventType::Warning,
            "LeaseMissing",
            format!(
                "cancelled, but the lease with fencing token {token} is missing: the task ends Cancelled once its holder, if any, has stopped"
            ),
        ),
        Transition::Withdrawn => {
            debug!(task = %task.name_any(), queue = %queue.queue, "queue paused: offer withdrawn");
            return;
        }
    };
    info!(task = %task.name_any(), namespace = %task.namespace().unwrap_or_default(), reason, "transition");
    publish(ctx, task, type_, reason, note).await;
}

/// Metrics, log and Event of a lease the operator expired.
pub async fn expired(ctx: &Ctx, task: &BatchTask, lease: &TaskLease, reason: ExpiryReason) {
    let ns = lease.namespace().unwrap_or_default();
    ctx.metrics.count_reason(
        ReasonCounter::LeaseExpiredBeforeRelease,
        &QueueLabels::of(task),
        reason.as_str(),
    );
    let holder = lease.spec.holder_identity.clone().unwrap_or_default();
    info!(task = %task.name_any(), namespace = %ns, lease = %lease.name_any(), %holder, reason = reason.as_str(), "lease expired");
    let note = format!(
        "lease {} of {holder} (fencing token {}) expired: {}",
        lease.name_any(),
        lease.spec.fencing_token,
        lease
            .status
            .as_ref()
            .and_then(|s| s.message.clone())
            .unwrap_or_default()
    );
    publish(ctx, task, EventType::Warning, reason.as_str(), note).await;
}

/// Publishes an Event about `task` (a best-effort write: only while this
/// replica leads, only those `--events` asks for).
pub async fn publish(ctx: &Ctx, task: &BatchTask, type_: EventType, reason: &str, note: String) {
    // Events are writes too: none after the term, and only those asked for.
    if !ctx.leadership.is_leader() || !ctx.events.wants(&type_, reason) {
        return;
    }
    let event = Event {
        type_,
        reason: reason.into(),
        note: Some(clip(note, MAX_NOTE_BYTES)),
        action: reason.into(),
        secondary: None,
    };
    let regarding = task.object_ref(&());
    // Bounded by the term like every write: kube's client retries an Event
    // refused with 429/503/504 (honouring Retry-After), which could land
    // it long after the term; the bound drops the request and its retries.
    let published = ctx
        .leadership
        .bound(async {
            if task.name_any().len() <= crate::events::MAX_RECORDER_NAME {
                ctx.recorder.publish(&event, &regarding).await
            } else {
                publish_long_named(ctx, &event, regarding.clone()).await
            }
        })
        .await;
    match published {
        Some(Ok(())) => {}
        // Events are best effort: the status already says what happened.
        Some(Err(e)) => {
            warn!(error = %batchlease_api::Chain(&e), task = %task.name_any(), "publishing event failed")
        }
        None => debug!(task = %task.name_any(), reason, "event abandoned: the term ended"),
    }
}

/// An Event about a task whose name is too long for kube-rs's Event names
/// (see [`crate::events::event_name`]): created as kube-rs would, under a
/// shortened name, without its aggregation into a series (such names are
/// rare; each Event is its own object).
async fn publish_long_named(
    ctx: &Ctx,
    ev: &Event,
    regarding: k8s_openapi::api::core::v1::ObjectReference,
) -> Result<(), kube::Error> {
    use k8s_openapi::api::events::v1::Event as K8sEvent;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
    let now = k8s_openapi::jiff::Timestamp::now();
    let namespace = regarding.namespace.clone().unwrap_or_default();
    let name = crate::events::event_name(
        regarding.name.as_deref().unwrap_or_default(),
        now.as_nanosecond(),
    );
    let event = K8sEvent {
        action: Some(ev.action.clone()),
        reason: Some(ev.reason.clone()),
        event_time: Some(MicroTime(now)),
        regarding: Some(regarding),
        note: ev.note.clone(),
        metadata: kube::api::ObjectMeta {
            namespace: Some(namespace.clone()),
            name: Some(name),
            ..Default::default()
        },
        reporting_controller: Some(ctx.reporter.controller.clone()),
        reporting_instance: Some(
            ctx.reporter
                .instance
                .clone()
                .unwrap_or_else(|| ctx.reporter.controller.clone()),
        ),
        type_: Some(
            match ev.type_ {
                EventType::Normal => "Normal",
                EventType::Warning => "Warning",
            }
            .into(),
        ),
        ..Default::default()
    };
    kube::Api::<K8sEvent>::namespaced(ctx.client.clone(), &namespace)
        .create(&kube::api::PostParams::default(), &event)
        .await
        .map(|_| ())
}

/// events.k8s.io/v1 refuses a `note` over 1 kB.
const MAX_NOTE_BYTES: usize = 1000;

/// `s` cut to at most `max` bytes on a character boundary, marked with "…".
fn clip(mut s: String, max: usize) -> String {
    if s.len() <= max {
        return s;
    }
    let mut end = max - '…'.len_utf8();
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s.truncate(end);
    s.push('…');
    s
}
