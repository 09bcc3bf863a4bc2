//! The fixtures of the table tests of [`decide`] (a task, its leases, a
//! [`Case`] to decide), and the names they all use. The tests themselves
//! are split by concern: `lifecycle_tests.rs` (first write, issue, claim,
//! expiry), `settle_tests.rs`, `finished_tests.rs`, `graph_tests.rs`,
//! `cancel_tests.rs`, `offer_tests.rs`.

pub(super) use super::*;
pub(super) use crate::deps::Readiness;
pub(super) use crate::lease_build::offered_lease;
pub(super) use crate::locks::Slot;
pub(super) use crate::observe::Observation;
pub(super) use batchlease_api::{
    BatchTask, BatchTaskSpec, BatchTaskStatus, LeaseOutcome, LeasePhase, TaskLease,
    TaskLeaseStatus, TaskMode, TaskPhase,
};
pub(super) use k8s_openapi::api::coordination::v1::Lease;
pub(super) use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, Time};
pub(super) use k8s_openapi::jiff::Timestamp;
pub(super) use kube::ResourceExt;
pub(super) use std::collections::BTreeMap;
pub(super) use std::sync::Arc;
pub(super) use std::time::Duration;
pub(super) use tokio::time::Instant;

const WALL: i64 = 1_800_000_000;

pub(super) fn wall(offset: i64) -> Timestamp {
    Timestamp::from_second(WALL + offset).unwrap()
}

/// A task fixture with builder methods.
pub(super) fn task() -> BatchTask {
    let mut t = BatchTask::new("job", BatchTaskSpec::for_queue("q"));
    t.metadata.namespace = Some("ns".into());
    t.metadata.uid = Some("uid-job".into());
    t.metadata.generation = Some(1);
    t
}

pub(super) trait TaskFixture {
    fn phase(self, phase: TaskPhase, token: i64) -> Self;
    fn with(self, f: impl FnOnce(&mut BatchTaskStatus)) -> Self;
    fn spec(self, f: impl FnOnce(&mut BatchTaskSpec)) -> Self;
}

impl TaskFixture for BatchTask {
    fn phase(mut self, phase: TaskPhase, token: i64) -> Self {
        let st = self.status.get_or_insert_with(Default::default);
        st.phase = Some(phase);
        st.fencing_token = token;
        st.effective_mode = Some(TaskMode::Exclusive);
        if token > 0 {
            st.current_lease = Some(format!("job-{token}"));
        }
        self
    }
    fn with(mut self, f: impl FnOnce(&mut BatchTaskStatus)) -> Self {
        f(self.status.get_or_insert_with(Default::default));
        self
    }
    fn spec(mut self, f: impl FnOnce(&mut BatchTaskSpec)) -> Self {
        f(&mut self.spec);
        self
    }
}

pub(super) fn lease(token: i64, phase: LeasePhase, holder: Option<&str>) -> Arc<TaskLease> {
    let mut l = offered_lease(&task(), token);
    l.metadata.resource_version = Some(format!("rv{token}"));
    l.metadata.creation_timestamp = Some(Time(wall(-100)));
    l.spec.holder_identity = holder.map(Into::into);
    l.spec.renew_time = holder.map(|_| MicroTime(wall(-1)));
    l.status = Some(TaskLeaseStatus {
        phase: Some(phase),
        ..Default::default()
    });
    Arc::new(l)
}

pub(super) fn completed(
    token: i64,
    outcome: LeaseOutcome,
    f: impl FnOnce(&mut TaskLeaseStatus),
) -> Arc<TaskLease> {
    let mut l = (*lease(token, LeasePhase::Completed, Some("w1"))).clone();
    let st = l.status.get_or_insert_with(Default::default);
    st.outcome = Some(outcome);
    f(st);
    Arc::new(l)
}

pub(super) struct Case {
    pub(super) task: BatchTask,
    pub(super) leases: Vec<Arc<TaskLease>>,
    /// Seconds since the renewal was observed / since the claim.
    pub(super) observed: Option<(u64, u64)>,
    pub(super) jitter: f64,
    pub(super) lookup: Lookup,
    pub(super) deps: Readiness,
    pub(super) locks: Option<Vec<Slot>>,
    pub(super) running_after: Duration,
    pub(super) needed_by: Option<String>,
    pub(super) queue: QueueGate,
    /// Seconds since the offer was addressed to its worker, and for how
    /// many more seconds that worker counts as live (0: lapsed).
    pub(super) offer: Option<(u64, u64)>,
    pub(super) per_worker_offers: bool,
    /// A WorkerLease version seen since the claim named the attempt.
    pub(super) named: bool,
}

impl Case {
    pub(super) fn new(task: BatchTask) -> Self {
        Self {
            task,
            leases: Vec::new(),
            observed: None,
            jitter: 0.0,
            lookup: Lookup::CacheOnly,
            deps: Readiness::Ready,
            locks: None,
            running_after: Duration::ZERO,
            needed_by: None,
            queue: QueueGate::Open,
            offer: None,
            per_worker_offers: true,
            named: false,
        }
    }
    pub(super) fn named(mut self) -> Self {
        self.named = true;
        self
    }
    pub(super) fn offer(mut self, since: u64, live_for: u64) -> Self {
        self.offer = Some((since, live_for));
        self
    }
    pub(super) fn queue(mut self, gate: QueueGate) -> Self {
        self.queue = gate;
        self
    }
    pub(super) fn deps(mut self, deps: Readiness) -> Self {
        self.deps = deps;
        self
    }
    pub(super) fn locks(mut self, locks: Vec<Slot>) -> Self {
        self.locks = Some(locks);
        self
    }
    pub(super) fn lookup(mut self, lookup: Lookup) -> Self {
        self.lookup = lookup;
        self
    }
    pub(super) fn leases(mut self, l: Vec<Arc<TaskLease>>) -> Self {
        self.leases = l;
        self
    }
    pub(super) fn needed_by(mut self, name: &str) -> Self {
        self.needed_by = Some(name.into());
        self
    }

    pub(super) fn running_after(mut self, d: Duration) -> Self {
        self.running_after = d;
        self
    }
    pub(super) fn observed(mut self, since_renewal: u64, since_claim: u64) -> Self {
        self.observed = Some((since_renewal, since_claim));
        self
    }
    pub(super) fn run(&self) -> Decision {
        let now = Instant::now() + Duration::from_secs(10_000);
        let observation = self.observed.map(|(r, c)| Observation {
            last_renewal: now - Duration::from_secs(r),
            claimed_at: now - Duration::from_secs(c),
            named: self.named,
        });
        decide(&Input {
            task: &self.task,
            leases: &self.leases,
            observation,
            now,
            wall: wall(0),
            jitter: self.jitter,
            lookup: self.lookup,
            deps: self.deps.clone(),
            locks: self.locks.clone(),
            running_after: self.running_after,
            needed_by: self.needed_by.clone(),
            queue: self.queue,
            offer: self.offer.map(|(since, live_for)| OfferView {
                since: now - Duration::from_secs(since),
                addressee_live_until: (live_for > 0).then(|| now + Duration::from_secs(live_for)),
            }),
            per_worker_offers: self.per_worker_offers,
        })
    }
}

pub(super) fn status_of(d: &Decision) -> (&BatchTaskStatus, &Transition) {
    match d {
        Decision::WriteStatus { status, transition } => (status, transition),
        other => panic!("expected a status write, got {other:?}"),
    }
}

pub(super) fn into_status(d: Decision) -> (BatchTaskStatus, Transition) {
    match d {
        Decision::WriteStatus { status, transition } => (*status, transition),
        other => panic!("expected a status write, got {other:?}"),
    }
}
