//! `TaskQueue.status`: a summary of the queue from the caches, written at
//! most every [`PERIOD`] and only when it changed, so it never dominates
//! API traffic (one write per queue per period at most, none while idle).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use batchlease_api::{
    BatchTask, LeasePhase, TaskCounts, TaskLease, TaskPhase, TaskQueue, TaskQueueStatus,
    ThrottleCounts, keys::condition, queue_condition,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::Store;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::leader::Leadership;
use crate::queues::QueueBook;

/// How often the summaries are computed (and written, if changed).
pub const PERIOD: Duration = Duration::from_secs(3);

/// What the operator knows of a queue beyond its tasks and leases.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Extra {
    pub throttled: ThrottleCounts,
    pub workers: i64,
}

/// Pure: the status of `tq` given the tasks and leases of its namespace
/// (any queue; filtered here).
pub fn summarize<'a>(
    tq: &TaskQueue,
    tasks: impl IntoIterator<Item = &'a BatchTask>,
    leases: impl IntoIterator<Item = &'a TaskLease>,
    extra: Extra,
    wall: Timestamp,
) -> TaskQueueStatus {
    let queue = tq.name_any();
    let mut counts = TaskCounts::default();
    let mut oldest_ready: Option<Timestamp> = None;
    let (mut aborts, mut attempts) = (0i64, 0i64);
    for t in tasks.into_iter().filter(|t| t.spec.queue == queue) {
        let st = t.status.as_ref();
        let phase = st.and_then(|s| s.phase);
        counts.add(phase);
        if phase == Some(TaskPhase::Ready) {
            let since = st
                .and_then(|s| s.conditions.iter().find(|c| c.type_ == condition::LEASED))
                .map(|c| c.last_transition_time.0);
            if let Some(since) = since {
                oldest_ready = Some(oldest_ready.map_or(since, |o| o.min(since)));
            }
        }
        if let Some(s) = st {
            aborts += i64::from(s.aborts);
            attempts += i64::from(s.attempts) + i64::from(s.aborts);
        }
    }
    let (mut offered, mut held) = (0, 0);
    for l in leases.into_iter().filter(|l| l.spec.queue == queue) {
        match l.status.as_ref().and_then(|s| s.phase) {
            None | Some(LeasePhase::Offered) => offered += 1,
            Some(LeasePhase::Held) => held += 1,
            _ => {}
        }
    }
    let old = tq.status.clone().unwrap_or_default();
    let mut status = TaskQueueStatus {
        observed_generation: tq.metadata.generation,
        tasks: counts,
        leases_offered: offered,
        leases_held: held,
        workers: extra.workers,
        oldest_ready_since: oldest_ready.map(Time),
        abort_rate_percent: (aborts > 0)
            .then(|| i32::try_from(aborts * 100 / attempts.max(1)).unwrap_or(100)),
        throttled: extra.throttled,
        conditions: old.conditions.clone(),
    };
    let paused = tq.spec.paused;
    set(
        &mut status.conditions,
        queue_condition::PAUSED,
        paused,
        if paused { "Paused" } else { "Running" },
        if paused {
            "spec.paused: no leases are offered; unclaimed offers were withdrawn; held leases run to their end"
        } else {
            "leases are offered"
        },
        tq.metadata.generation,
        wall,
    );
    let at_cap = tq
        .spec
        .max_concurrent
        .is_some_and(|m| offered + held >= i64::from(m));
    set(
        &mut status.conditions,
        queue_condition::AT_CAPACITY,
        at_cap,
        if at_cap {
            "MaxConcurrentReached"
        } else {
            "BelowMaxConcurrent"
        },
        &match tq.spec.max_concurrent {
            Some(m) => format!("{} of at most {m} leases offered or held", offered + held),
            None => "no spec.maxConcurrent".to_owned(),
        },
        tq.metadata.generation,
        wall,
    );
    status
}

/// Sets condition `type_`, keeping its transition time while its status
/// does not change.
fn set(
    conditions: &mut Vec<Condition>,
    type_: &str,
    on: bool,
    reason: &str,
    message: &str,
    generation: Option<i64>,
    wall: Timestamp,
) {
    let status = if on { "True" } else { "False" };
    let since = conditions
        .iter()
        .find(|c| c.type_ == type_ && c.status == status)
        .map_or(Time(wall), |c| c.last_transition_time.clone());
    conditions.retain(|c| c.type_ != type_);
    conditions.push(Condition {
        type_: type_.to_owned(),
        status: status.to_owned(),
        reason: reason.to_owned(),
        message: message.to_owned(),
        last_transition_time: since,
        observed_generation: generation,
    });
    conditions.sort_by(|a, b| a.type_.cmp(&b.type_));
}

/// Pure: the JSON merge patch that turns the status the server stored
/// (`stored`, as the cache shows it) into `want`, or `None` when they are
/// equal (an idle queue writes nothing).
///
/// Under a merge patch (RFC 7386) an absent key means "unchanged", and the
/// typed status skips its unset fields when serialized: a field that went
/// away (`oldestReadySince` once no task is Ready, `abortRatePercent`, the
/// conditions) must be sent as an explicit `null`, or the server keeps it
/// and the stored status never equals the computed one again (a write
/// every period, for ever). So every top-level key the stored status has
/// and `want` lacks is nulled; objects and lists are sent whole.
pub fn status_patch(
    stored: Option<&TaskQueueStatus>,
    want: &TaskQueueStatus,
) -> Option<serde_json::Value> {
    if stored == Some(want) {
        return None;
    }
    let to_map = |s: &TaskQueueStatus| match serde_json::to_value(s) {
        Ok(serde_json::Value::Object(m)) => m,
        _ => serde_json::Map::new(),
    };
    let mut patch = to_map(want);
    if let Some(stored) = stored {
        for key in to_map(stored).keys() {
            if !patch.contains_key(key) {
                patch.insert(key.clone(), serde_json::Value::Null);
            }
        }
    }
    Some(serde_json::json!({ "status": patch }))
}

/// Everything the status loop reads.
pub struct Sources {
    pub client: kube::Client,
    pub queues: Store<TaskQueue>,
    pub tasks: Store<BatchTask>,
    pub leases: Store<TaskLease>,
    pub book: Arc<QueueBook>,
    pub leadership: Leadership,
}

/// Writes the summaries every [`PERIOD`] until `stop`.
pub async fn run(src: Sources, stop: CancellationToken) {
    let mut tick = tokio::time::interval(PERIOD);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        if !src.leadership.is_leader() {
            continue;
        }
        let queues = src.queues.state();
        if queues.is_empty() {
            continue;
        }
        // One pass over each cache, grouped by the queues that have a
        // TaskQueue (not queues × tasks).
        let keys: HashSet<(String, String)> = queues
            .iter()
            .map(|q| (q.namespace().unwrap_or_default(), q.name_any()))
            .collect();
        let mut tasks: HashMap<(String, String), Vec<Arc<BatchTask>>> = HashMap::new();
        for t in src.tasks.state() {
            let key = (t.namespace().unwrap_or_default(), t.spec.queue.clone());
            if keys.contains(&key) {
                tasks.entry(key).or_default().push(t);
            }
        }
        let mut leases: HashMap<(String, String), Vec<Arc<TaskLease>>> = HashMap::new();
        for l in src.leases.state() {
            let key = (l.namespace().unwrap_or_default(), l.spec.queue.clone());
            if keys.contains(&key) {
                leases.entry(key).or_default().push(l);
            }
        }
        let now = Instant::now();
        for tq in queues {
            let ns = tq.namespace().unwrap_or_default();
            let key = (ns.clone(), tq.name_any());
            let (throttled, workers) = src.book.summary(&ns, &key.1, now);
            let status = summarize(
                &tq,
                tasks.get(&key).into_iter().flatten().map(|t| &**t),
                leases.get(&key).into_iter().flatten().map(|l| &**l),
                Extra { throttled, workers },
                Timestamp::now(),
            );
            let Some(patch) = status_patch(tq.status.as_ref(), &status) else {
                continue;
            };
            if src.leadership.ensure().is_err() {
                break;
            }
            let api: Api<TaskQueue> = Api::namespaced(src.client.clone(), &ns);
            // Written over the version summarized (a 409 when it changed:
            // the next pass summarizes the new one), and bounded by the
            // term: abandoned the moment it ends.
            let mut patch = patch;
            patch["metadata"] = serde_json::json!({ "resourceVersion": tq.resource_version() });
            let (name, pp) = (tq.name_any(), PatchParams::default());
            let patch = Patch::Merge(&patch);
            match src
                .leadership
                .bound(api.patch_status(&name, &pp, &patch))
                .await
            {
                Some(Ok(_)) => {
                    debug!(queue = %name, namespace = %ns, "queue status written")
                }
                Some(Err(kube::Error::Api(s))) if s.code == 404 => {}
                Some(Err(kube::Error::Api(s))) if s.code == 409 => {
                    debug!(queue = %name, namespace = %ns, "queue changed since summarized")
                }
                Some(Err(e)) => {
                    warn!(queue = %name, namespace = %ns, error = %e, "queue status write failed")
                }
                None => {
                    debug!(queue = %name, namespace = %ns, "queue status write abandoned: the term ended");
                    break;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use batchlease_api::{
        BatchTaskSpec, BatchTaskStatus, TaskLeaseSpec, TaskLeaseStatus, TaskQueueSpec,
    };

    fn task(name: &str, queue: &str, phase: TaskPhase, ready_since: i64) -> BatchTask {
        let mut t = BatchTask::new(name, BatchTaskSpec::for_queue(queue));
        t.status = Some(BatchTaskStatus {
            phase: Some(phase),
            attempts: 1,
            aborts: i32::from(name == "c"),
            conditions: vec![Condition {
                type_: condition::LEASED.into(),
                status: "True".into(),
                reason: "Offered".into(),
                message: String::new(),
                last_transition_time: Time(Timestamp::from_second(ready_since).unwrap()),
                observed_generation: None,
            }],
            ..Default::default()
        });
        t
    }

    fn lease(task: &str, queue: &str, phase: LeasePhase) -> TaskLease {
        let mut l = TaskLease::new(
            &format!("{task}-1"),
            TaskLeaseSpec::offered(task, "u", queue, 1, 30),
        );
        l.status = Some(TaskLeaseStatus {
            phase: Some(phase),
            ..Default::default()
        });
        l
    }

    #[test]
    fn a_summary_of_the_queue_and_only_of_it() {
        let mut tq = TaskQueue::new(
            "q",
            TaskQueueSpec {
                paused: true,
                max_concurrent: Some(2),
                max_issues_per_second: None,
            },
        );
        tq.metadata.generation = Some(4);
        let tasks = [
            task("a", "q", TaskPhase::Ready, 200),
            task("b", "q", TaskPhase::Ready, 100),
            task("c", "q", TaskPhase::Running, 50),
            task("d", "q", TaskPhase::DeadLettered, 50),
            task("x", "other", TaskPhase::Ready, 1),
        ];
        let leases = [
            lease("a", "q", LeasePhase::Offered),
            lease("c", "q", LeasePhase::Held),
            lease("d", "q", LeasePhase::Expired),
            lease("x", "other", LeasePhase::Held),
        ];
        let wall = Timestamp::from_second(1000).unwrap();
        let extra = Extra {
            throttled: ThrottleCounts {
                paused: 3,
                ..Default::default()
            },
            workers: 1,
        };
        let s = summarize(&tq, &tasks, &leases, extra.clone(), wall);
        assert_eq!(
            (s.tasks.ready, s.tasks.running, s.tasks.dead_lettered),
            (2, 1, 1)
        );
        assert_eq!((s.leases_offered, s.leases_held, s.workers), (1, 1, 1));
        assert_eq!(
            s.oldest_ready_since,
            Some(Time(Timestamp::from_second(100).unwrap()))
        );
        // One abort among 4 attempts + 1 abort.
        assert_eq!(s.abort_rate_percent, Some(20));
        assert_eq!(s.throttled.paused, 3);
        assert_eq!(s.observed_generation, Some(4));
        let cond = |t: &str| s.conditions.iter().find(|c| c.type_ == t).unwrap().clone();
        assert_eq!(cond("Paused").status, "True");
        assert_eq!(cond("AtCapacity").status, "True");
        // Written again with nothing changed: equal, so no write, and the
        // transition times stay.
        tq.status = Some(s.clone());
        let later = Timestamp::from_second(2000).unwrap();
        assert_eq!(summarize(&tq, &tasks, &leases, extra, later), s);
    }

    #[test]
    fn the_patch_clears_what_went_away_and_nothing_is_sent_when_equal() {
        let t = |sec| Some(Time(Timestamp::from_second(sec).unwrap()));
        let busy = TaskQueueStatus {
            observed_generation: Some(2),
            leases_offered: 1,
            oldest_ready_since: t(100),
            abort_rate_percent: Some(20),
            ..Default::default()
        };
        let idle = TaskQueueStatus {
            observed_generation: Some(2),
            ..Default::default()
        };
        let cases: [(
            &str,
            Option<&TaskQueueStatus>,
            &TaskQueueStatus,
            Option<serde_json::Value>,
        ); 4] = [
            ("unchanged: no write", Some(&busy), &busy, None),
            (
                "went idle: the fields that went away are nulled",
                Some(&busy),
                &idle,
                Some(serde_json::json!({"status": {
                    "observedGeneration": 2,
                    "tasks": serde_json::to_value(TaskCounts::default()).unwrap(),
                    "leasesOffered": 0, "leasesHeld": 0, "workers": 0,
                    "throttled": serde_json::to_value(ThrottleCounts::default()).unwrap(),
                    "oldestReadySince": null,
                    "abortRatePercent": null,
                }})),
            ),
            (
                "no status yet: no nulls",
                None,
                &idle,
                Some(serde_json::json!({"status": serde_json::to_value(&idle).unwrap()})),
            ),
            (
                "a field set again",
                Some(&idle),
                &busy,
                Some(serde_json::json!({"status": serde_json::to_value(&busy).unwrap()})),
            ),
        ];
        for (what, stored, want, patch) in cases {
            assert_eq!(status_patch(stored, want), patch, "{what}");
        }
        // Conditions that went away are nulled too.
        let mut with_conditions = idle.clone();
        with_conditions.conditions = busy_conditions();
        let p = status_patch(Some(&with_conditions), &idle).unwrap();
        assert_eq!(p["status"]["conditions"], serde_json::Value::Null);
    }

    fn busy_conditions() -> Vec<Condition> {
        vec![Condition {
            type_: "Paused".into(),
            status: "False".into(),
            reason: "Running".into(),
            message: String::new(),
            last_transition_time: Time(Timestamp::from_second(1).unwrap()),
            observed_generation: None,
        }]
    }
}
