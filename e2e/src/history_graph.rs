//! History checks of task graphs and resource locks (design §5), over the
//! same recorded watches as [`crate::history`]:
//!
//! - **dependency order**: a task is issued its first lease (its status
//!   shows a fencing token for the first time) only after every task it
//!   depends on was seen `Succeeded`. Both are task-watch events, so their
//!   order is the API server's;
//! - **cycles**: a task `Rejected` with `CycleDetected` names a cycle that
//!   goes through it and whose every edge is in the recorded specs;
//! - **lock exclusivity** (API side): for each resource, the TaskLeases
//!   carrying a token for it are never live (Offered or Held) at once, and
//!   the resource's tokens grow in the order the leases were created;
//! - **lock exclusivity** (storage side): the occupancy intervals the fenced
//!   store recorded (a resource registered by an attempt until that attempt
//!   committed) never overlap for one resource.

use std::collections::{BTreeMap, BTreeSet};

use batchlease_api::keys::condition;
use batchlease_api::{LeasePhase, TaskPhase};
use kube::ResourceExt;

use crate::history::{Change, Recorded};

/// Dependency order and cycle claims, from the task record.
pub fn check_graph(tasks: &[Recorded]) -> Vec<String> {
    let mut out = Vec::new();
    // name → uid of tasks seen Succeeded (by name: dependsOn names tasks).
    let mut succeeded: BTreeSet<String> = BTreeSet::new();
    let mut issued: BTreeSet<String> = BTreeSet::new();
    let mut specs: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut rejected: Vec<(String, String)> = Vec::new();
    for r in tasks {
        let (t, gone) = match &r.change {
            Change::Task(t) => (t, false),
            Change::TaskDeleted(t) => (t, true),
            _ => continue,
        };
        let name = t.name_any();
        if gone {
            succeeded.remove(&name);
            continue;
        }
        specs.insert(name.clone(), t.spec.depends_on.clone());
        let st = t.status.as_ref();
        let phase = st.and_then(|s| s.phase);
        if phase == Some(TaskPhase::Succeeded) {
            succeeded.insert(name.clone());
        }
        if st.is_some_and(|s| s.fencing_token > 0) && issued.insert(name.clone()) {
            let waiting: Vec<&String> = t
                .spec
                .depends_on
                .iter()
                .filter(|d| !succeeded.contains(*d))
                .collect();
            if !waiting.is_empty() {
                out.push(format!(
                    "task {name}: issued a lease before its dependencies {waiting:?} succeeded"
                ));
            }
        }
        if phase == Some(TaskPhase::Rejected)
            && let Some(c) = st.and_then(|s| {
                s.conditions
                    .iter()
                    .find(|c| c.type_ == condition::CYCLE_DETECTED && c.status == "True")
            })
        {
            rejected.push((name.clone(), c.message.clone()));
        }
    }
    let mut seen = BTreeSet::new();
    for (name, message) in rejected {
        if !seen.insert(name.clone()) {
            continue;
        }
        let shown = message.trim_start_matches("dependency cycle: ");
        if shown.contains('…') {
            // A long cycle, shown from this task with its middle elided:
            // the shown edges must be real, starting at the task.
            let head: Vec<&str> = shown.split(" → ").take_while(|p| *p != "…").collect();
            let real = head.windows(2).all(|w| {
                specs
                    .get(w[0])
                    .is_some_and(|deps| deps.iter().any(|d| d == w[1]))
            });
            if head.first() != Some(&name.as_str()) || !real {
                out.push(format!(
                    "task {name}: rejected for a cycle that is not one through it: {message}"
                ));
            }
            continue;
        }
        let path: Vec<&str> = shown.split(" → ").collect();
        let on_it = path.contains(&name.as_str());
        let closed = path.len() >= 2 && path.first() == path.last();
        let edges_real = path.windows(2).all(|w| {
            specs
                .get(w[0])
                .is_some_and(|deps| deps.iter().any(|d| d == w[1]))
        });
        if !(on_it && closed && edges_real) {
            out.push(format!(
                "task {name}: rejected for a cycle that is not one through it: {message}"
            ));
        }
    }
    out
}

/// Per resource (namespace-wide): leases carrying its token are never live
/// at once, and its tokens grow with each new lease.
///
/// `gap_free`: the lease watch never failed. Where it did (a test that
/// restarts the control plane), a relist may have skipped the version that
/// ended a lease; the record then shows it live beside its successor. Such
/// an overlap is judged by what the record can show: a lease recorded
/// final (or deleted) in a version written before the successor's
/// (etcd's resourceVersion order, as `history_controls` uses) was over
/// first. Gap-free records stay strict.
pub fn check_lock_leases(leases: &[Recorded], gap_free: bool) -> Vec<String> {
    let mut out = Vec::new();
    let rv = |l: &batchlease_api::TaskLease| -> u64 {
        l.metadata
            .resource_version
            .as_deref()
            .and_then(|v| v.parse().ok())
            .unwrap_or(u64::MAX)
    };
    // uid → the lowest resourceVersion recorded with the lease over.
    let mut ended_at: BTreeMap<String, u64> = BTreeMap::new();
    for r in leases {
        let (l, gone) = match &r.change {
            Change::Lease(l) => (l, false),
            Change::LeaseDeleted(l) => (l, true),
            _ => continue,
        };
        let phase = l.status.as_ref().and_then(|s| s.phase);
        if gone || !matches!(phase, Some(LeasePhase::Offered | LeasePhase::Held) | None) {
            let e = ended_at
                .entry(l.uid().unwrap_or_default())
                .or_insert(u64::MAX);
            *e = (*e).min(rv(l));
        }
    }
    // resource → (lease uid → name) of live leases.
    let mut live: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    // resource → last token seen on a new lease.
    let mut last: BTreeMap<String, (i64, String)> = BTreeMap::new();
    let mut known: BTreeSet<String> = BTreeSet::new();
    for r in leases {
        let (l, gone) = match &r.change {
            Change::Lease(l) => (l, false),
            Change::LeaseDeleted(l) => (l, true),
            _ => continue,
        };
        if l.spec.resource_tokens.is_empty() {
            continue;
        }
        let uid = l.uid().unwrap_or_default();
        let name = l.name_any();
        let phase = l.status.as_ref().and_then(|s| s.phase);
        let is_live = !gone && matches!(phase, Some(LeasePhase::Offered | LeasePhase::Held) | None);
        let new = known.insert(uid.clone());
        for (resource, token) in &l.spec.resource_tokens {
            if new {
                if let Some((prev, prev_name)) = last.get(resource)
                    && *prev >= *token
                {
                    out.push(format!(
                        "resource {resource}: lease {name} has token {token}, not above {prev} of the earlier {prev_name}"
                    ));
                }
                last.insert(resource.clone(), (*token, name.clone()));
            }
            let set = live.entry(resource.clone()).or_default();
            if is_live {
                set.insert(uid.clone(), name.clone());
                if !gap_free {
                    let now = rv(l);
                    set.retain(|other, _| {
                        *other == uid || ended_at.get(other).is_none_or(|end| *end > now)
                    });
                }
            } else {
                set.remove(&uid);
            }
            if set.len() > 1 {
                let names: Vec<&String> = set.values().collect();
                out.push(format!(
                    "resource {resource}: leases {names:?} live at once"
                ));
            }
        }
    }
    out
}

/// One row of the resource fence's audit trigger.
#[derive(Clone, Debug, PartialEq)]
pub struct ResourceWrite {
    pub resource: String,
    pub token: i64,
    /// `REGISTERED` or `COMMITTED`.
    pub status: String,
    /// Seconds since the epoch, by the database's clock.
    pub at: f64,
}

/// Storage side: per resource, the intervals from an attempt's
/// registration to its commit never overlap (attempts that never
/// committed — zombies that were fenced — have no interval).
pub fn check_occupancy(writes: &[ResourceWrite]) -> Vec<String> {
    let mut out = Vec::new();
    // (resource, token) → (registered, committed)
    let mut spans: BTreeMap<(String, i64), (Option<f64>, Option<f64>)> = BTreeMap::new();
    for w in writes {
        let e = spans.entry((w.resource.clone(), w.token)).or_default();
        match w.status.as_str() {
            "REGISTERED" => {
                e.0 = Some(e.0.map_or(w.at, |a: f64| a.min(w.at)));
            }
            "COMMITTED" => e.1 = Some(w.at),
            _ => {}
        }
    }
    let mut by_resource: BTreeMap<&str, Vec<(f64, f64, i64)>> = BTreeMap::new();
    for ((resource, token), (start, end)) in &spans {
        if let (Some(s), Some(e)) = (start, end) {
            by_resource
                .entry(resource)
                .or_default()
                .push((*s, *e, *token));
        }
    }
    for (resource, mut v) in by_resource {
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
        for w in v.windows(2) {
            let (a, b) = (w[0], w[1]);
            if b.0 < a.1 {
                out.push(format!(
                    "resource {resource}: token {} occupied it from {:.3} to {:.3}, token {} from {:.3} — overlapping",
                    a.2, a.0, a.1, b.2, b.0
                ));
            }
            if b.2 <= a.2 {
                out.push(format!(
                    "resource {resource}: token {} came after token {}",
                    b.2, a.2
                ));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use batchlease_api::{
        BatchTask, BatchTaskSpec, BatchTaskStatus, TaskLease, TaskLeaseSpec, TaskLeaseStatus,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

    fn task(name: &str, deps: &[&str], phase: TaskPhase, token: i64) -> Recorded {
        let mut spec = BatchTaskSpec::for_queue("q");
        spec.depends_on = deps.iter().map(|s| s.to_string()).collect();
        let mut t = BatchTask::new(name, spec);
        t.status = Some(BatchTaskStatus {
            phase: Some(phase),
            fencing_token: token,
            ..Default::default()
        });
        Recorded {
            at: 0.0,
            change: Change::Task(Box::new(t)),
        }
    }

    fn rejected(name: &str, deps: &[&str], message: &str) -> Recorded {
        let mut r = task(name, deps, TaskPhase::Rejected, 0);
        if let Change::Task(t) = &mut r.change {
            t.status.as_mut().unwrap().conditions.push(Condition {
                type_: condition::CYCLE_DETECTED.into(),
                status: "True".into(),
                reason: "CycleDetected".into(),
                message: message.into(),
                last_transition_time: Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH),
                observed_generation: None,
            });
        }
        r
    }

    #[test]
    fn dependency_order_is_checked_in_the_task_record() {
        use TaskPhase::*;
        let good = vec![
            task("a", &[], Pending, 0),
            task("b", &["a"], Pending, 0),
            task("a", &[], Ready, 1),
            task("a", &[], Succeeded, 1),
            task("b", &["a"], Ready, 1),
        ];
        assert!(check_graph(&good).is_empty());
        let bad = vec![
            task("a", &[], Ready, 1),
            task("b", &["a"], Ready, 1),
            task("a", &[], Succeeded, 1),
        ];
        assert_eq!(check_graph(&bad).len(), 1);
    }

    #[test]
    fn cycle_claims_must_be_real_cycles_through_the_task() {
        let real = vec![
            task("b", &["c"], TaskPhase::Pending, 0),
            task("c", &["a"], TaskPhase::Pending, 0),
            rejected("a", &["b"], "dependency cycle: a → b → c → a"),
        ];
        assert!(check_graph(&real).is_empty(), "{:?}", check_graph(&real));
        let not_through = vec![
            task("b", &["c"], TaskPhase::Pending, 0),
            task("c", &["b"], TaskPhase::Pending, 0),
            rejected("a", &["b"], "dependency cycle: b → c → b"),
        ];
        assert_eq!(check_graph(&not_through).len(), 1);
        let invented = vec![
            task("b", &[], TaskPhase::Pending, 0),
            rejected("a", &["b"], "dependency cycle: a → b → a"),
        ];
        assert_eq!(check_graph(&invented).len(), 1);
    }

    fn lease(uid: &str, resource_token: i64, phase: LeasePhase) -> Recorded {
        let mut l = TaskLease::new(
            &format!("l-{uid}"),
            TaskLeaseSpec::offered("t", "tu", "q", 1, 30),
        );
        l.metadata.uid = Some(uid.into());
        l.spec.resource_tokens = BTreeMap::from([("db".into(), resource_token)]);
        l.status = Some(TaskLeaseStatus {
            phase: Some(phase),
            ..Default::default()
        });
        Recorded {
            at: 0.0,
            change: Change::Lease(Box::new(l)),
        }
    }

    #[test]
    fn lock_leases_never_live_at_once_and_tokens_grow() {
        use LeasePhase::*;
        let good = vec![
            lease("1", 1, Offered),
            lease("1", 1, Held),
            lease("1", 1, Completed),
            lease("2", 2, Offered),
            lease("2", 2, Expired),
            lease("3", 3, Offered),
        ];
        assert!(check_lock_leases(&good, true).is_empty());
        let overlap = vec![lease("1", 1, Held), lease("2", 2, Offered)];
        assert_eq!(check_lock_leases(&overlap, true).len(), 1);
        assert_eq!(
            check_lock_leases(&overlap, false).len(),
            1,
            "no later version shows it over first"
        );
        let backwards = vec![lease("1", 5, Completed), lease("2", 5, Offered)];
        assert_eq!(check_lock_leases(&backwards, true).len(), 1);
        // A relist skipped the version that ended lease 1 (rv 11) before
        // lease 2 was created (rv 12); it shows up later. With gaps in the
        // record that is no overlap; ended after (rv 13), it still is.
        let at = |mut r: Recorded, v: u64| {
            if let Change::Lease(l) = &mut r.change {
                l.metadata.resource_version = Some(v.to_string());
            }
            r
        };
        let skipped = vec![
            at(lease("1", 1, Held), 10),
            at(lease("2", 2, Offered), 12),
            at(lease("1", 1, Completed), 11),
        ];
        assert_eq!(
            check_lock_leases(&skipped, true).len(),
            1,
            "gap-free: strict"
        );
        assert!(check_lock_leases(&skipped, false).is_empty());
        let later = vec![
            at(lease("1", 1, Held), 10),
            at(lease("2", 2, Offered), 12),
            at(lease("1", 1, Completed), 13),
        ];
        assert_eq!(check_lock_leases(&later, false).len(), 1);
    }

    fn w(token: i64, status: &str, at: f64) -> ResourceWrite {
        ResourceWrite {
            resource: "ns/db".into(),
            token,
            status: status.into(),
            at,
        }
    }

    #[test]
    fn occupancy_intervals_must_not_overlap() {
        let good = vec![
            w(1, "REGISTERED", 1.0),
            w(1, "COMMITTED", 2.0),
            w(2, "REGISTERED", 2.5),
            w(2, "COMMITTED", 3.0),
            // Registered, then fenced before committing: no interval.
            w(3, "REGISTERED", 3.5),
            w(4, "REGISTERED", 3.6),
            w(4, "COMMITTED", 4.0),
        ];
        assert!(
            check_occupancy(&good).is_empty(),
            "{:?}",
            check_occupancy(&good)
        );
        let bad = vec![
            w(1, "REGISTERED", 1.0),
            w(2, "REGISTERED", 1.5),
            w(1, "COMMITTED", 2.0),
            w(2, "COMMITTED", 3.0),
        ];
        assert_eq!(check_occupancy(&bad).len(), 1);
    }
}
