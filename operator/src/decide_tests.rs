//! Table tests of [`decide`]: every task phase and lease event, and the
//! races (renewal vs. expiry, two claims, a crash between issue and lease
//! creation, a stale cache).

use super::*;
use crate::observe::Observation;
use batchlease_api::{BatchTaskSpec, LeaseOutcome, TaskLeaseStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, Time};

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
    task: BatchTask,
    leases: Vec<Arc<TaskLease>>,
    /// Seconds since the renewal was observed / since the claim.
    observed: Option<(u64, u64)>,
    jitter: f64,
    lookup: Lookup,
    deps: Readiness,
    locks: Option<Vec<Slot>>,
    running_after: Duration,
    needed_by: Option<String>,
    queue: QueueGate,
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
        }
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

#[test]
fn a_new_task_is_issued_in_its_first_write() {
    // No status yet: the first status is folded into the issue (one write
    // instead of two).
    let d = Case::new(task().spec(|s| {
        s.mode = TaskMode::Speculative;
        s.redrive = 2;
    }))
    .run();
    let Decision::Issue {
        status,
        lease,
        cause,
    } = d
    else {
        panic!("expected an issue, got {d:?}")
    };
    assert_eq!(status.phase, Some(TaskPhase::Ready));
    assert_eq!(status.fencing_token, 1);
    assert_eq!(status.effective_mode, Some(TaskMode::Speculative));
    assert_eq!(
        status.observed_redrive, 2,
        "a raised redrive is not replayed"
    );
    assert_eq!(lease.spec.fencing_token, 1);
    assert_eq!(cause, IssueCause::New);
}

#[test]
fn a_new_task_that_must_wait_writes_why_in_its_first_write() {
    // Dependencies unfinished: the first status carries the condition.
    let d = Case::new(task().spec(|s| s.depends_on = vec!["extract".into()]))
        .deps(Readiness::Waiting {
            missing: vec![],
            unfinished: vec!["extract".into()],
        })
        .run();
    let (st, tr) = status_of(&d);
    assert_eq!(st.phase, Some(TaskPhase::Pending));
    assert_eq!(st.effective_mode, Some(TaskMode::Exclusive));
    assert_eq!(*tr, Transition::WaitingForDependencies);
    assert!(
        st.conditions
            .iter()
            .any(|c| c.type_ == batchlease_api::keys::condition::WAITING_FOR_DEPENDENCIES)
    );
}

#[test]
fn a_new_task_with_resources_is_written_pending_first() {
    // Only a Pending task counts as a waiter for its locks (fairness).
    for mode in [TaskMode::Exclusive, TaskMode::Speculative] {
        let d = Case::new(task().spec(|s| {
            s.mode = mode;
            s.resources = vec!["db".into()];
        }))
        .run();
        let (st, tr) = status_of(&d);
        assert_eq!(st.phase, Some(TaskPhase::Pending), "{mode:?}");
        assert_eq!(st.effective_mode, Some(mode));
        assert_eq!(st.fencing_token, 0);
        assert_eq!(*tr, Transition::Initialized);
    }
}

#[test]
fn pending_issues_the_next_token() {
    let d = Case::new(task().phase(TaskPhase::Pending, 4)).run();
    let Decision::Issue {
        status,
        lease,
        cause,
    } = d
    else {
        panic!("{d:?}")
    };
    assert_eq!(status.fencing_token, 5);
    assert_eq!(status.phase, Some(TaskPhase::Ready));
    assert_eq!(status.current_lease.as_deref(), Some("job-5"));
    assert_eq!(lease.spec.fencing_token, 5);
    assert_eq!(lease.metadata.name.as_deref(), Some("job-5"));
    assert_eq!(
        lease.status.as_ref().unwrap().phase,
        Some(LeasePhase::Offered)
    );
    assert_eq!(lease.spec.task_uid, "uid-job");
    let owner = &lease.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.uid.as_str(), owner.controller),
        ("BatchTask", "uid-job", Some(true))
    );
    assert_eq!(cause, IssueCause::New);
}

#[test]
fn pending_waits_for_backoff() {
    let d = Case::new(
        task()
            .phase(TaskPhase::Pending, 1)
            .with(|s| s.next_attempt_after = Some(Time(wall(7)))),
    )
    .run();
    assert_eq!(d, Decision::Wait(Some(Duration::from_secs(7))));
    // Elapsed backoff issues.
    let d = Case::new(
        task()
            .phase(TaskPhase::Pending, 1)
            .with(|s| s.next_attempt_after = Some(Time(wall(-1)))),
    )
    .run();
    assert!(matches!(d, Decision::Issue { .. }), "{d:?}");
}

#[test]
fn a_missing_current_lease_is_looked_up_then_replaced_under_a_new_token() {
    // Status says Ready (or Running) with token 3, but the cache has no job-3:
    // the watch may lag, the process may have died between the two writes of
    // an issue, or someone deleted a lease a worker had already claimed.
    for phase in [TaskPhase::Ready, TaskPhase::Running] {
        let t = task()
            .phase(phase, 3)
            .with(|s| s.holder = (phase == TaskPhase::Running).then(|| "w1".into()));
        let old = vec![lease(2, LeasePhase::Expired, Some("w"))];
        // Cache only: read it directly before believing it is gone.
        let d = Case::new(t.clone()).leases(old.clone()).run();
        assert_eq!(d, Decision::LookUpLease("job-3".into()), "{phase:?}");
        // This process created it a moment ago: wait for the watch.
        let d = Case::new(t.clone())
            .leases(old.clone())
            .lookup(Lookup::Creating)
            .run();
        assert_eq!(d, Decision::Wait(Some(CREATE_SETTLE)), "{phase:?}");
        // Absent: the name is occupied by a final tombstone first, so a
        // create of job-3 still on its way can never become a live lease.
        let d = Case::new(t.clone())
            .leases(old.clone())
            .lookup(Lookup::Absent)
            .run();
        let Decision::RetireToken(stone) = d else {
            panic!("{d:?}")
        };
        assert_eq!(stone.metadata.name.as_deref(), Some("job-3"));
        assert_eq!(stone.spec.fencing_token, 3);
        let sst = stone.status.as_ref().unwrap();
        assert_eq!(
            (sst.phase, sst.reason.as_deref()),
            (Some(LeasePhase::Released), Some(TOKEN_RETIRED))
        );
        // With the tombstone in place: never recreate job-3 (token 3 may
        // have been claimed); issue 4.
        let mut with_stone = old.clone();
        with_stone.push(Arc::new(*stone));
        let d = Case::new(t).leases(with_stone).run();
        let Decision::Issue {
            status,
            lease,
            cause,
        } = d
        else {
            panic!("{d:?}")
        };
        assert_eq!(cause, IssueCause::Replaced);
        assert_eq!(lease.spec.fencing_token, 4, "a token is used once");
        assert_eq!(lease.metadata.name.as_deref(), Some("job-4"));
        assert_eq!(
            (status.fencing_token, status.phase, status.holder.as_deref()),
            (4, Some(TaskPhase::Ready), None)
        );
        assert_eq!(status.attempts, 0, "losing a lease spends no retry");
        let lost: Vec<_> = status
            .history
            .iter()
            .map(|h| (h.token, h.outcome.as_str(), h.reason.as_deref()))
            .collect();
        // Ready too: the lease may have been claimed before the Running
        // write (a cancel must wait for such a holder). With no holder seen,
        // it may also never have been created (an operator stopped between
        // the status write and the create): the reason says only what is
        // known.
        let reason = match phase {
            TaskPhase::Running => "LeaseMissing",
            _ => "OfferMissing",
        };
        assert_eq!(lost, [(3, "Lost", Some(reason))], "{phase:?}");
    }
}

#[test]
fn a_forged_or_stale_lease_under_the_current_name_is_not_the_current_lease() {
    let t = task().phase(TaskPhase::Ready, 3);
    let forge = |f: &dyn Fn(&mut TaskLease)| {
        let mut l = (*lease(3, LeasePhase::Held, Some("mallory"))).clone();
        f(&mut l);
        Arc::new(l)
    };
    let forgeries = [
        forge(&|l| l.spec.fencing_token = i64::MAX),
        forge(&|l| l.spec.task_uid = "uid-older-incarnation".into()),
        forge(&|l| l.metadata.owner_references = None),
    ];
    for f in forgeries {
        // Never followed (no "Claimed" by mallory): looked up, and when the
        // read shows the same forgery, replaced under a new token.
        let d = Case::new(t.clone())
            .leases(vec![f.clone()])
            .observed(0, 0)
            .run();
        assert_eq!(d, Decision::LookUpLease("job-3".into()));
        let d = Case::new(t.clone())
            .leases(vec![f])
            .lookup(Lookup::Occupied)
            .run();
        assert!(
            matches!(&d, Decision::Issue { lease, cause: IssueCause::Replaced, .. } if lease.spec.fencing_token == 4),
            "{d:?}"
        );
    }
}

#[test]
fn a_live_lease_that_is_not_current_is_ended() {
    // A stale operator's late create left job-4 Offered (or claimed) after
    // the task moved on to token 5: it is expired so no holder keeps it.
    let t = task().phase(TaskPhase::Ready, 5);
    for phase in [LeasePhase::Offered, LeasePhase::Held] {
        let d = Case::new(t.clone())
            .leases(vec![
                lease(4, phase, Some("w1")),
                lease(5, LeasePhase::Offered, None),
            ])
            .run();
        let Decision::Expire { lease, reason } = d else {
            panic!("{d:?}")
        };
        assert_eq!(reason, ExpiryReason::NotCurrentLease);
        assert_eq!(lease.metadata.name.as_deref(), Some("job-4"));
        assert_eq!(
            lease.status.as_ref().unwrap().phase,
            Some(LeasePhase::Expired)
        );
    }
    // A lease of a newer token than the cached task knows: the task cache
    // lags (the lease watch delivered first). Never touched.
    let d = Case::new(t.clone())
        .leases(vec![
            lease(5, LeasePhase::Offered, None),
            lease(6, LeasePhase::Held, Some("w2")),
        ])
        .run();
    assert_eq!(d, Decision::Wait(None), "{d:?}");
    // Final leases and leases the task does not control are left alone.
    let mut foreign = (*lease(4, LeasePhase::Held, Some("m"))).clone();
    foreign.metadata.owner_references = None;
    let d = Case::new(t)
        .leases(vec![
            Arc::new(foreign),
            lease(3, LeasePhase::Expired, Some("w")),
            lease(5, LeasePhase::Offered, None),
        ])
        .run();
    assert_eq!(d, Decision::Wait(None));
}

#[test]
fn offered_lease_waits_for_a_claim() {
    let d = Case::new(task().phase(TaskPhase::Ready, 1))
        .leases(vec![lease(1, LeasePhase::Offered, None)])
        .run();
    assert_eq!(d, Decision::Wait(None));
}

#[test]
fn claim_moves_the_task_to_running() {
    let d = Case::new(task().phase(TaskPhase::Ready, 1))
        .leases(vec![lease(1, LeasePhase::Held, Some("w1"))])
        .observed(0, 0)
        .run();
    let (st, tr) = status_of(&d);
    assert_eq!(st.phase, Some(TaskPhase::Running));
    assert_eq!(st.holder.as_deref(), Some("w1"));
    assert_eq!(
        *tr,
        Transition::Claimed {
            holder: "w1".into()
        }
    );
}

#[test]
fn two_claims_only_the_winner_is_followed() {
    // Two workers raced; the API server let exactly one CAS through. The
    // operator only ever sees the winner in the lease.
    let d = Case::new(task().phase(TaskPhase::Ready, 1))
        .leases(vec![lease(1, LeasePhase::Held, Some("winner"))])
        .observed(0, 0)
        .run();
    assert_eq!(status_of(&d).0.holder.as_deref(), Some("winner"));
}

#[test]
fn held_lease_expiry_table() {
    // (ttl, since renewal, since claim, deadline, expected)
    type Row = (i32, u64, u64, Option<i64>, Result<Duration, ExpiryReason>);
    let cases: Vec<Row> = vec![
        (30, 0, 0, None, Ok(Duration::from_secs(30))),
        (30, 29, 100, None, Ok(Duration::from_secs(1))),
        (30, 30, 100, None, Err(ExpiryReason::LeaseExpired)),
        (30, 31, 100, None, Err(ExpiryReason::LeaseExpired)),
        (30, 5, 55, Some(60), Ok(Duration::from_secs(5))),
        (
            30,
            5,
            60,
            Some(60),
            Err(ExpiryReason::ActiveDeadlineExceeded),
        ),
        (5, 2, 2, Some(600), Ok(Duration::from_secs(3))),
    ];
    for (ttl, since_renewal, since_claim, deadline, want) in cases {
        let t = task()
            .phase(TaskPhase::Running, 1)
            .with(|s| s.holder = Some("w1".into()))
            .spec(|s| {
                s.lease_duration_seconds = ttl;
                s.active_deadline_seconds = deadline;
            });
        let mut l = (*lease(1, LeasePhase::Held, Some("w1"))).clone();
        l.spec.lease_duration_seconds = ttl;
        let d = Case::new(t)
            .leases(vec![Arc::new(l)])
            .observed(since_renewal, since_claim)
            .run();
        match (want, d) {
            (Ok(w), Decision::Wait(Some(got))) => {
                assert_eq!(got, w, "ttl={ttl} r={since_renewal} c={since_claim}")
            }
            (Err(reason), Decision::Expire { lease, reason: got }) => {
                assert_eq!(got, reason);
                let st = lease.status.unwrap();
                assert_eq!(st.phase, Some(LeasePhase::Expired));
                assert_eq!(st.reason.as_deref(), Some(reason.as_str()));
                assert_eq!(
                    lease.metadata.resource_version.as_deref(),
                    Some("rv1"),
                    "expiry is a CAS on the read version"
                );
            }
            (w, d) => panic!("ttl={ttl} r={since_renewal} c={since_claim}: want {w:?}, got {d:?}"),
        }
    }
}

#[test]
fn renewal_observed_just_in_time_prevents_expiry() {
    // The race renewal vs. expiry, decided by observation: a renewal seen
    // 1 s ago restarts the clock whatever renewTime says.
    let t = task()
        .phase(TaskPhase::Running, 1)
        .with(|s| s.holder = Some("w1".into()));
    let d = Case::new(t)
        .leases(vec![lease(1, LeasePhase::Held, Some("w1"))])
        .observed(1, 500)
        .run();
    assert_eq!(d, Decision::Wait(Some(Duration::from_secs(29))));
}

#[test]
fn success_settles_the_task() {
    let t = task()
        .phase(TaskPhase::Running, 2)
        .with(|s| s.holder = Some("w1".into()));
    let l = completed(2, LeaseOutcome::Succeeded, |s| {
        s.result =
            Some(batchlease_api::JsonObject::try_from(serde_json::json!({"rows": 7})).unwrap());
        s.checkpoint =
            Some(batchlease_api::JsonObject::try_from(serde_json::json!({"step": 9})).unwrap());
    });
    let d = Case::new(t).leases(vec![l]).run();
    let (st, tr) = status_of(&d);
    assert_eq!(*tr, Transition::Succeeded);
    assert_eq!(st.phase, Some(TaskPhase::Succeeded));
    assert_eq!(
        st.result,
        Some(batchlease_api::JsonObject::try_from(serde_json::json!({"rows": 7})).unwrap())
    );
    assert_eq!(st.holder, None);
    assert_eq!(st.fencing_token, 2);
    assert_eq!(st.history.last().unwrap().outcome, "Succeeded");
    assert!(
        st.conditions
            .iter()
            .any(|c| c.type_ == "Succeeded" && c.status == "True")
    );
}

#[test]
fn failures_retry_with_growing_backoff_then_dead_letter() {
    let spec = |s: &mut BatchTaskSpec| {
        s.max_retries = 2;
        s.backoff = batchlease_api::BackoffSpec {
            initial_seconds: 2,
            max_seconds: 5,
            multiplier: 2,
        };
    };
    // (attempts before, expected: delay seconds or dead-letter)
    for (attempts, want) in [(0, Some(2)), (1, Some(4)), (2, None)] {
        let t = task()
            .spec(spec)
            .phase(TaskPhase::Running, attempts + 1)
            .with(|s| {
                s.attempts = attempts as i32;
                s.holder = Some("w1".into());
            });
        let l = completed(attempts + 1, LeaseOutcome::Failed, |s| {
            s.reason = Some("Boom".into());
            s.message = Some("it broke".into());
            s.checkpoint =
                Some(batchlease_api::JsonObject::try_from(serde_json::json!({"step": 3})).unwrap());
        });
        let d = Case::new(t).leases(vec![l]).run();
        let (st, tr) = status_of(&d);
        assert_eq!(st.attempts, attempts as i32 + 1);
        let failure = st.last_failure.as_ref().unwrap();
        assert_eq!(
            (
                failure.reason.as_str(),
                failure.message.as_str(),
                failure.token
            ),
            ("Boom", "it broke", attempts + 1)
        );
        assert_eq!(
            st.checkpoint,
            Some(batchlease_api::JsonObject::try_from(serde_json::json!({"step": 3})).unwrap()),
            "progress is handed to the next attempt"
        );
        match want {
            Some(delay) => {
                assert_eq!(st.phase, Some(TaskPhase::Pending));
                assert_eq!(st.next_attempt_after, Some(Time(wall(delay))));
                assert!(
                    matches!(tr, Transition::Retry { expired: false, .. }),
                    "{tr:?}"
                );
            }
            None => {
                assert_eq!(st.phase, Some(TaskPhase::DeadLettered));
                assert_eq!(st.next_attempt_after, None);
                assert_eq!(
                    *tr,
                    Transition::DeadLettered {
                        reason: "Boom".into(),
                        expired: false
                    }
                );
            }
        }
    }
}

#[test]
fn backoff_respects_max_seconds_with_jitter() {
    let t = task()
        .spec(|s| {
            s.max_retries = 50;
            s.backoff = batchlease_api::BackoffSpec {
                initial_seconds: 1,
                max_seconds: 10,
                multiplier: 10,
            };
        })
        .phase(TaskPhase::Running, 5)
        .with(|s| s.attempts = 4);
    let mut c = Case::new(t).leases(vec![completed(5, LeaseOutcome::Failed, |_| {})]);
    c.jitter = 0.999;
    let (st, _) = into_status(c.run());
    let after = st.next_attempt_after.as_ref().unwrap().0;
    let delay = after.duration_since(wall(0)).as_secs_f64();
    assert!(
        (10.0..=15.0).contains(&delay),
        "delay {delay} outside [max, 1.5·max]"
    );
}

#[test]
fn next_attempt_after_is_rounded_up_never_down() {
    // metav1.Time keeps whole seconds: a deadline truncated on the wire
    // would let the retry start before the announced backoff.
    let t = task()
        .spec(|s| {
            s.backoff = batchlease_api::BackoffSpec {
                initial_seconds: 1,
                max_seconds: 10,
                multiplier: 2,
            };
        })
        .phase(TaskPhase::Running, 1);
    for (jitter, want) in [(0.0, 1), (0.2, 2), (0.999, 2)] {
        let mut c = Case::new(t.clone()).leases(vec![completed(1, LeaseOutcome::Failed, |_| {})]);
        c.jitter = jitter;
        let (st, _) = into_status(c.run());
        let at = st.next_attempt_after.unwrap().0;
        assert_eq!(at, wall(want), "jitter {jitter}");
        // What the API server will store is what the operator computed.
        let json = serde_json::to_value(Time(at)).unwrap();
        let back: Time = serde_json::from_value(json).unwrap();
        assert_eq!(back.0, at);
    }
}

#[test]
fn permanent_failure_dead_letters_at_once() {
    let t = task()
        .spec(|s| s.max_retries = 10)
        .phase(TaskPhase::Running, 1);
    let l = completed(1, LeaseOutcome::Failed, |s| {
        s.permanent = true;
        s.reason = Some("BadInput".into());
    });
    let (st, tr) = into_status(Case::new(t).leases(vec![l]).run());
    assert_eq!(st.phase, Some(TaskPhase::DeadLettered));
    assert_eq!(st.attempts, 1);
    assert_eq!(
        tr,
        Transition::DeadLettered {
            reason: "BadInput".into(),
            expired: false
        }
    );
}

#[test]
fn a_non_retryable_reason_dead_letters_at_once_and_another_retries() {
    let policy = |s: &mut batchlease_api::BatchTaskSpec| {
        s.max_retries = 10;
        s.retry_policy.non_retryable_reasons =
            vec!["BadInput".into(), "ActiveDeadlineExceeded".into()];
    };
    // (the lease's phase and reason, dead-lettered?)
    for (phase, reason, dead) in [
        (LeasePhase::Completed, "BadInput", true),
        (LeasePhase::Completed, "Flaky", false),
        (LeasePhase::Expired, "ActiveDeadlineExceeded", true),
        (LeasePhase::Expired, "LeaseExpired", false),
    ] {
        let t = task()
            .spec(policy)
            .phase(TaskPhase::Running, 1)
            .with(|s| s.holder = Some("w1".into()));
        let l = if phase == LeasePhase::Completed {
            completed(1, LeaseOutcome::Failed, |s| s.reason = Some(reason.into()))
        } else {
            let mut l = lease(1, LeasePhase::Expired, Some("w1"));
            std::sync::Arc::make_mut(&mut l)
                .status
                .get_or_insert_with(Default::default)
                .reason = Some(reason.into());
            l
        };
        let (st, tr) = into_status(Case::new(t).leases(vec![l]).run());
        assert_eq!(st.attempts, 1, "{reason}");
        if dead {
            assert_eq!(st.phase, Some(TaskPhase::DeadLettered), "{reason}");
            assert!(
                matches!(&tr, Transition::DeadLettered { reason: r, .. } if r == reason),
                "{reason}: {tr:?}"
            );
            let cond = st
                .conditions
                .iter()
                .find(|c| c.type_ == "DeadLettered")
                .unwrap();
            assert!(cond.message.contains("nonRetryableReasons"), "{cond:?}");
        } else {
            assert_eq!(st.phase, Some(TaskPhase::Pending), "{reason}");
            assert!(matches!(tr, Transition::Retry { .. }), "{reason}: {tr:?}");
        }
    }
}

#[test]
fn expired_lease_is_retried_and_the_next_issue_is_a_reassignment() {
    let t = task()
        .phase(TaskPhase::Running, 1)
        .with(|s| s.holder = Some("w1".into()));
    let d = Case::new(t)
        .leases(vec![lease(1, LeasePhase::Expired, Some("w1"))])
        .run();
    let (st, tr) = status_of(&d);
    assert!(
        matches!(tr, Transition::Retry { expired: true, .. }),
        "{tr:?}"
    );
    assert_eq!(st.history.last().unwrap().outcome, "Expired");
    assert_eq!(st.last_failure.as_ref().unwrap().reason, "LeaseExpired");
    // The TTL without renewals was the wait: no backoff on top.
    assert_eq!(st.next_attempt_after, None);
    assert!(
        matches!(tr, Transition::Retry { delay_seconds, .. } if *delay_seconds == 0.0),
        "{tr:?}"
    );

    let mut next = task();
    next.status = Some(st.clone());
    let d = Case::new(next)
        .leases(vec![lease(1, LeasePhase::Expired, Some("w1"))])
        .run();
    let Decision::Issue { status, cause, .. } = d else {
        panic!("{d:?}")
    };
    assert_eq!(status.fencing_token, 2);
    assert_eq!(cause, IssueCause::Reassigned);
}

#[test]
fn an_attempt_expired_by_its_deadline_waits_the_backoff() {
    // It was renewing: the worker did not fail, the task ran too long.
    let t = task()
        .phase(TaskPhase::Running, 1)
        .with(|s| s.holder = Some("w1".into()));
    let mut expired = lease(1, LeasePhase::Expired, Some("w1"));
    std::sync::Arc::make_mut(&mut expired)
        .status
        .get_or_insert_with(Default::default)
        .reason = Some(ExpiryReason::ActiveDeadlineExceeded.as_str().into());
    let (st, tr) = into_status(Case::new(t).leases(vec![expired]).run());
    assert_eq!(st.attempts, 1);
    assert!(st.next_attempt_after.is_some(), "{st:?}");
    assert!(
        matches!(tr, Transition::Retry { expired: true, delay_seconds, .. } if delay_seconds > 0.0),
        "{tr:?}"
    );
}

#[test]
fn a_second_expiry_in_a_row_waits_the_backoff() {
    let t = task()
        .phase(TaskPhase::Running, 1)
        .with(|s| s.holder = Some("w1".into()));
    let first = Case::new(t.clone())
        .leases(vec![lease(1, LeasePhase::Expired, Some("w1"))])
        .run();
    let (after_one, _) = into_status(first);
    let mut t2 = t;
    t2.status = Some(BatchTaskStatus {
        phase: Some(TaskPhase::Running),
        fencing_token: 2,
        holder: Some("w2".into()),
        current_lease: Some("job-2".into()),
        ..after_one
    });
    let d = Case::new(t2)
        .leases(vec![
            lease(1, LeasePhase::Expired, Some("w1")),
            lease(2, LeasePhase::Expired, Some("w2")),
        ])
        .run();
    let (st, tr) = status_of(&d);
    assert_eq!(st.attempts, 2);
    assert!(st.next_attempt_after.is_some(), "{st:?}");
    assert!(
        matches!(tr, Transition::Retry { expired: true, delay_seconds, .. } if *delay_seconds > 0.0),
        "{tr:?}"
    );
}

#[test]
fn interrupted_retries_at_once_without_spending_a_retry() {
    let t = task().phase(TaskPhase::Running, 3).with(|s| s.attempts = 1);
    let (st, tr) = into_status(
        Case::new(t)
            .leases(vec![completed(3, LeaseOutcome::Interrupted, |_| {})])
            .run(),
    );
    assert_eq!(tr, Transition::Interrupted { delay_seconds: 0.0 });
    assert_eq!(
        (st.phase, st.attempts, st.next_attempt_after.clone()),
        (Some(TaskPhase::Pending), 1, None)
    );
}

/// `n` Interrupted attempts in the task's history.
fn interrupted_before(s: &mut BatchTaskStatus, n: i64) {
    for k in 0..n {
        crate::status::push_history(
            s,
            batchlease_api::AttemptRecord {
                token: k + 1,
                holder: None,
                outcome: "Interrupted".into(),
                start: None,
                end: None,
                reason: None,
                lease_duration_seconds: None,
            },
        );
    }
}

#[test]
fn repeated_interruptions_back_off_then_count_as_failures() {
    // (Interrupted outcomes already in the history, expected: attempts
    // after, backoff set?)
    let cases = [
        (0, 0, false),
        (1, 0, false),
        (2, 0, true),
        (4, 0, true),
        (5, 1, true),
    ];
    for (before, attempts, delayed) in cases {
        let t = task()
            .phase(TaskPhase::Running, 9)
            .with(|s| interrupted_before(s, before));
        let (st, tr) = into_status(
            Case::new(t)
                .leases(vec![completed(9, LeaseOutcome::Interrupted, |_| {})])
                .run(),
        );
        assert_eq!(st.attempts, attempts, "{before} before: {tr:?}");
        assert_eq!(st.next_attempt_after.is_some(), delayed, "{before}: {tr:?}");
        if attempts == 1 {
            assert!(matches!(tr, Transition::Retry { .. }), "{tr:?}");
            let last = st.history.last().unwrap();
            assert_eq!(
                (last.outcome.as_str(), last.reason.as_deref()),
                ("Failed", Some("InterruptedRepeatedly"))
            );
        }
    }
    // With no retries left, the sixth interruption in a row dead-letters.
    let t = task()
        .spec(|s| s.max_retries = 0)
        .phase(TaskPhase::Running, 9)
        .with(|s| interrupted_before(s, 5));
    let (st, _) = into_status(
        Case::new(t)
            .leases(vec![completed(9, LeaseOutcome::Interrupted, |_| {})])
            .run(),
    );
    assert_eq!(st.phase, Some(TaskPhase::DeadLettered));
}

#[test]
fn speculative_aborts_quarantine_to_exclusive() {
    let t = task()
        .spec(|s| {
            s.mode = TaskMode::Speculative;
            s.max_speculative_aborts = 2;
        })
        .phase(TaskPhase::Running, 2)
        .with(|s| {
            s.aborts = 1;
            s.effective_mode = Some(TaskMode::Speculative);
        });
    let (st, tr) = into_status(
        Case::new(t)
            .leases(vec![completed(2, LeaseOutcome::Aborted, |_| {})])
            .run(),
    );
    assert_eq!(tr, Transition::Aborted { quarantined: true });
    assert_eq!(
        (st.aborts, st.attempts, st.effective_mode),
        (2, 0, Some(TaskMode::Exclusive))
    );
}

#[test]
fn an_abort_of_a_quarantined_attempt_spends_a_retry() {
    // Quarantined, it held its locks and still lost its swap: the keys are
    // written by tasks that do not name its resources. Free retries would
    // let it spin for ever.
    let t = task()
        .spec(|s| {
            s.mode = TaskMode::Speculative;
            s.max_retries = 1;
        })
        .phase(TaskPhase::Running, 5)
        .with(|s| {
            s.aborts = 3;
            s.effective_mode = Some(TaskMode::Exclusive);
        });
    let aborted = |t: BatchTask| {
        into_status(
            Case::new(t)
                .leases(vec![completed(5, LeaseOutcome::Aborted, |s| {
                    s.reason = Some("CompareAndSwapLost".into())
                })])
                .run(),
        )
    };
    let (st, tr) = aborted(t.clone());
    assert!(
        matches!(&tr, Transition::Retry { reason, .. } if reason == "CompareAndSwapLost"),
        "{tr:?}"
    );
    assert_eq!(
        (st.aborts, st.attempts, st.effective_mode),
        (4, 1, Some(TaskMode::Exclusive))
    );
    // The budget spent: dead-lettered, with the reason.
    let (st, tr) = aborted(t.with(|s| s.attempts = 1));
    assert!(
        matches!(&tr, Transition::DeadLettered { reason, .. } if reason == "CompareAndSwapLost"),
        "{tr:?}"
    );
    assert_eq!(st.phase, Some(TaskPhase::DeadLettered));
}

#[test]
fn redrive_brings_back_a_dead_lettered_task_with_a_fresh_budget() {
    let t = task()
        .spec(|s| s.redrive = 1)
        .phase(TaskPhase::DeadLettered, 4)
        .with(|s| {
            s.attempts = 4;
            s.observed_redrive = 0;
        });
    let (st, tr) = into_status(Case::new(t).run());
    assert_eq!(tr, Transition::Redriven);
    assert_eq!(
        (st.phase, st.attempts, st.observed_redrive, st.fencing_token),
        (Some(TaskPhase::Pending), 0, 1, 4)
    );

    // Raised on a running task: recorded, nothing else changes.
    let t = task().spec(|s| s.redrive = 1).phase(TaskPhase::Running, 2);
    let (st, tr) = into_status(Case::new(t).run());
    assert_eq!(tr, Transition::RedriveIgnored);
    assert_eq!(
        (st.phase, st.observed_redrive),
        (Some(TaskPhase::Running), 1)
    );
}

#[test]
fn final_tasks_wait_and_prune_old_leases() {
    let t = task().phase(TaskPhase::Succeeded, 6);
    let leases: Vec<_> = (1..=6)
        .map(|k| lease(k, LeasePhase::Expired, Some("w")))
        .collect();
    let d = Case::new(t.clone()).leases(leases).run();
    let names: Vec<String> = match d {
        Decision::Prune { victims, then } => {
            assert_eq!(then, None);
            victims
        }
        .into_iter()
        .map(|(n, rv)| format!("{n}@{}", rv.unwrap()))
        .collect(),
        other => panic!("{other:?}"),
    };
    // job-6 is current; keep job-3..5; prune the oldest two, with their versions.
    assert_eq!(names, ["job-1@rv1", "job-2@rv2"]);

    let few: Vec<_> = (4..=6)
        .map(|k| lease(k, LeasePhase::Expired, Some("w")))
        .collect();
    assert_eq!(Case::new(t).leases(few).run(), Decision::Wait(None));
}

#[test]
fn pruning_carries_the_timer_the_pass_would_have_set() {
    // A held lease with 12 s left before expiry, and old leases to prune:
    // the prune must not drop the expiry timer.
    let t = task()
        .phase(TaskPhase::Running, 9)
        .with(|s| s.holder = Some("w".into()));
    let mut leases: Vec<_> = (1..=8)
        .map(|k| lease(k, LeasePhase::Expired, Some("w")))
        .collect();
    leases.push(lease(9, LeasePhase::Held, Some("w")));
    let d = Case::new(t).leases(leases).observed(18, 18).run();
    let Decision::Prune { victims, then } = d else {
        panic!("{d:?}")
    };
    assert_eq!(victims.len(), 5);
    assert_eq!(then, Some(Duration::from_secs(12)));
}

#[test]
fn held_or_offered_leases_are_never_pruned() {
    let t = task()
        .phase(TaskPhase::Running, 9)
        .with(|s| s.holder = Some("w".into()));
    let mut leases: Vec<_> = (1..=8)
        .map(|k| lease(k, LeasePhase::Held, Some("w")))
        .collect();
    leases.push(lease(9, LeasePhase::Held, Some("w")));
    // Live leases are never deleted: the stray ones are ended first (an
    // Expire, which a holder notices), the current one is left alone.
    let d = Case::new(t).leases(leases).observed(0, 0).run();
    assert!(
        matches!(&d, Decision::Expire { lease, reason: ExpiryReason::NotCurrentLease }
            if lease.spec.fencing_token < 9),
        "{d:?}"
    );
}

#[test]
fn deleted_task_is_left_to_garbage_collection() {
    let mut t = task().phase(TaskPhase::Running, 1);
    t.metadata.deletion_timestamp = Some(Time(wall(0)));
    assert_eq!(Case::new(t).run(), Decision::Wait(None));
}

#[test]
fn a_silent_claim_expires_even_before_running_is_written() {
    // The task still says Ready (its Running write not made yet) while the
    // lease is Held and silent for longer than the TTL: expire at once —
    // Running is informational and must not postpone expiry — and the
    // settle that follows records the claim in the history from the lease.
    let t = task().phase(TaskPhase::Ready, 1);
    let d = Case::new(t.clone())
        .leases(vec![lease(1, LeasePhase::Held, Some("w1"))])
        .observed(60, 60)
        .run();
    assert!(matches!(d, Decision::Expire { .. }), "{d:?}");
    let (st, tr) = into_status(
        Case::new(t)
            .leases(vec![lease(1, LeasePhase::Expired, Some("w1"))])
            .run(),
    );
    assert!(
        matches!(tr, Transition::Retry { expired: true, .. }),
        "{tr:?}"
    );
    let h = st.history.last().unwrap();
    assert_eq!(
        (h.outcome.as_str(), h.holder.as_deref()),
        ("Expired", Some("w1"))
    );
}

#[test]
fn running_is_written_once_the_claim_is_old_enough() {
    // (claim seen for s, renewal seen s ago, TTL 30 s unless a deadline,
    //  running_after s, expected)
    let t = task().phase(TaskPhase::Ready, 1);
    let held = || vec![lease(1, LeasePhase::Held, Some("w"))];
    let wait = |s: u64| Decision::Wait(Some(Duration::from_secs(s)));
    // Too young: come back when it is due.
    assert_eq!(
        Case::new(t.clone())
            .leases(held())
            .observed(0, 0)
            .running_after(Duration::from_secs(2))
            .run(),
        wait(2)
    );
    assert_eq!(
        Case::new(t.clone())
            .leases(held())
            .observed(1, 1)
            .running_after(Duration::from_secs(2))
            .run(),
        wait(1)
    );
    // Due: Running with the holder.
    let (st, tr) = into_status(
        Case::new(t.clone())
            .leases(held())
            .observed(2, 2)
            .running_after(Duration::from_secs(2))
            .run(),
    );
    assert_eq!(
        (st.phase, st.holder.as_deref()),
        (Some(TaskPhase::Running), Some("w"))
    );
    assert_eq!(tr, Transition::Claimed { holder: "w".into() });
    // A delay beyond half the TTL is cut to half the TTL (15 s of 30 s),
    // so it never postpones expiry.
    assert_eq!(
        Case::new(t.clone())
            .leases(held())
            .observed(0, 0)
            .running_after(Duration::from_secs(600))
            .run(),
        wait(15)
    );
    // An expiry due first wins over the informational write.
    let d = Case::new(t.clone())
        .leases(held())
        .observed(30, 30)
        .running_after(Duration::from_secs(600))
        .run();
    assert!(matches!(d, Decision::Expire { .. }), "{d:?}");
    // An active deadline sooner than the delay: the wait ends at it.
    let mut short = t.clone();
    short.spec.active_deadline_seconds = Some(3);
    assert_eq!(
        Case::new(short)
            .leases(held())
            .observed(1, 1)
            .running_after(Duration::from_secs(10))
            .run(),
        wait(2)
    );
}

#[test]
fn a_completion_before_the_running_write_settles_straight_from_ready() {
    let t = task().phase(TaskPhase::Ready, 1);
    let (st, tr) = into_status(
        Case::new(t)
            .leases(vec![completed(1, LeaseOutcome::Succeeded, |_| {})])
            .running_after(Duration::from_secs(1))
            .run(),
    );
    assert_eq!(st.phase, Some(TaskPhase::Succeeded));
    assert_eq!(tr, Transition::Succeeded);
    assert_eq!(st.history.len(), 1);
}

#[test]
fn a_finished_task_is_deleted_once_its_ttl_has_passed() {
    let done = |phase: TaskPhase, ago: i64, ttl: Option<i64>| {
        let mut t = task()
            .spec(|s| s.ttl_seconds_after_finished = ttl)
            .phase(phase, 1)
            .with(|s| s.completion_time = Some(Time(wall(-ago))));
        t.metadata.resource_version = Some("rv7".into());
        Case::new(t).run()
    };
    for phase in [
        TaskPhase::Succeeded,
        TaskPhase::DeadLettered,
        TaskPhase::Rejected,
    ] {
        // Kept without a TTL.
        assert_eq!(done(phase, 1_000, None), Decision::Wait(None), "{phase:?}");
        // Not yet: look again when it is due.
        assert_eq!(
            done(phase, 4, Some(10)),
            Decision::Wait(Some(Duration::from_secs(6))),
            "{phase:?}"
        );
        // Due: deleted, if it is still this object at this version.
        assert_eq!(
            done(phase, 10, Some(10)),
            Decision::DeleteTask {
                uid: "uid-job".into(),
                resource_version: Some("rv7".into())
            },
            "{phase:?}"
        );
        assert!(matches!(
            done(phase, 0, Some(0)),
            Decision::DeleteTask { .. }
        ));
    }
    // Due, but an unfinished dependent or child still needs it: kept, and
    // looked at again.
    let due = task()
        .spec(|s| s.ttl_seconds_after_finished = Some(1))
        .phase(TaskPhase::Succeeded, 1)
        .with(|s| s.completion_time = Some(Time(wall(-60))));
    assert_eq!(
        Case::new(due).needed_by("follow-up").run(),
        Decision::Wait(Some(crate::decide::TTL_RECHECK))
    );
}

#[test]
fn finishing_records_the_completion_time_and_a_redrive_clears_it() {
    let t = task()
        .phase(TaskPhase::Running, 1)
        .with(|s| s.holder = Some("w1".into()));
    let ok = completed(1, LeaseOutcome::Succeeded, |_| {});
    let (st, _) = into_status(Case::new(t.clone()).leases(vec![ok]).run());
    assert_eq!(st.phase, Some(TaskPhase::Succeeded));
    assert_eq!(st.completion_time, Some(Time(wall(0))));

    let t = t.spec(|s| s.max_retries = 0);
    let failed = completed(1, LeaseOutcome::Failed, |_| {});
    let (st, _) = into_status(Case::new(t.clone()).leases(vec![failed]).run());
    assert_eq!(st.phase, Some(TaskPhase::DeadLettered));
    assert_eq!(st.completion_time, Some(Time(wall(0))));

    let mut redriven = t.spec(|s| s.redrive = 1);
    redriven.status = Some(st);
    let (st, _) = into_status(Case::new(redriven).run());
    assert_eq!(st.phase, Some(TaskPhase::Pending));
    assert_eq!(st.completion_time, None);
}
