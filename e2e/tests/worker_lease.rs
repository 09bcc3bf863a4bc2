//! Renewals per worker end to end (issue 27, design "Fleets"): demo workers
//! that renew through one WorkerLease each, against the real operator,
//! control plane and PostgreSQL; every namespace's history is checked at
//! the end, WorkerLeases included (`history_workers`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::time::Duration;

use batchlease_api::worker_lease::worker_lease_name;
use batchlease_api::{
    AttemptRef, LeaseOutcome, LeasePhase, Renewal, TaskLease, TaskPhase, WorkerLease,
};
use batchlease_e2e::history::Change;
use batchlease_e2e::operator::Operator;
use batchlease_e2e::process::Process;
use batchlease_e2e::tasks::{self, wait_holder, wait_lease, wait_phase};
use batchlease_e2e::workers::{self, WorkerOpts};
use batchlease_e2e::{Cluster, TestNamespace, pg, wait_for};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::ResourceExt;
use kube::api::{Api, PostParams};
use serde_json::json;

const T: Duration = Duration::from_secs(60);
/// The lease TTL of these tests' tasks: short, so expiry and the kill
/// switch happen within seconds.
const TTL: u64 = 6;

async fn setup(prefix: &str) -> (TestNamespace, Operator, tokio_postgres::Client) {
    let cluster = Cluster::with_crds().await.unwrap();
    let ns = cluster.namespace(prefix).await.unwrap();
    let op = Operator::start(&ns.name, "op").unwrap();
    op.wait_leading(T).await.unwrap();
    let db = pg::connect().await.unwrap();
    (ns, op, db)
}

/// A demo worker that renews per worker, with `slots` slots.
fn per_worker(ns: &TestNamespace, identity: &str, slots: usize) -> Process {
    let opts = WorkerOpts {
        slots,
        env: vec![("BATCHLEASE_RENEW_PER_WORKER".into(), "1".into())],
        ..Default::default()
    };
    workers::start(&ns.name, identity, &opts).unwrap()
}

/// A task of `steps` steps of `step_ms` each (a checkpoint after each).
async fn job(ns: &TestNamespace, name: &str, steps: u64, step_ms: u64) {
    tasks::create(
        ns,
        name,
        json!({"queue": "demo", "leaseDurationSeconds": TTL,
               "payload": {"steps": steps, "stepMillis": step_ms}}),
    )
    .await
    .unwrap();
}

async fn worker_lease(ns: &TestNamespace, identity: &str) -> Option<WorkerLease> {
    ns.api::<WorkerLease>()
        .get_opt(&worker_lease_name(identity))
        .await
        .unwrap()
}

#[tokio::test]
async fn tasks_longer_than_their_ttl_live_on_worker_renewals_alone() {
    let (ns, op, db) = setup("wl-live").await;
    let w: Vec<Process> = (1..=2)
        .map(|i| per_worker(&ns, &format!("w{i}"), 2))
        .collect();
    let logs = || op.logs_with(&w.iter().collect::<Vec<_>>());
    // 12 s of work each (two TTLs), a checkpoint every second: without
    // renewals a lease would expire halfway.
    for i in 1..=3 {
        job(&ns, &format!("job{i}"), 12, 1000).await;
    }
    for i in 1..=3 {
        wait_phase(&ns, &format!("job{i}"), TaskPhase::Succeeded, T, logs)
            .await
            .unwrap();
    }
    let (leases, _) = ns.recorded().await.unwrap();
    let workers_seen = ns.recorded_workers();
    for i in 1..=3 {
        let task = format!("job{i}");
        // The recorded versions of each of the task's attempts.
        let mut attempts: BTreeMap<String, Vec<&TaskLease>> = BTreeMap::new();
        for r in &leases {
            if let Change::Lease(l) = &r.change
                && l.spec.task_name == task
            {
                attempts.entry(l.name_any()).or_default().push(l.as_ref());
            }
        }
        let status = |v: &[&TaskLease]| v.last().and_then(|l| l.status.clone());
        // One attempt ran. One before it may have been bound to a worker
        // whose slots its own claims had just filled (the operator binds
        // on the free slots it has seen): that worker names it while it
        // waits for a slot, and gives it back unstarted after a TTL
        // (`BoundNoSlot`, no retry spent) or lets it expire, never run.
        let (ran, unstarted): (Vec<_>, Vec<_>) = attempts
            .iter()
            .partition(|(_, v)| status(v).and_then(|s| s.outcome) == Some(LeaseOutcome::Succeeded));
        assert_eq!(
            ran.len(),
            1,
            "{task}: one attempt succeeded, of {:?}",
            attempts
                .iter()
                .map(|(name, v)| (name, status(v)))
                .collect::<Vec<_>>()
        );
        for (name, v) in &unstarted {
            let st = status(v);
            let reason = st.as_ref().and_then(|s| s.reason.as_deref());
            assert!(
                matches!(
                    (st.as_ref().and_then(|s| s.outcome), reason),
                    (Some(LeaseOutcome::Interrupted), Some("BoundNoSlot"))
                ) || (st.as_ref().and_then(|s| s.phase) == Some(LeasePhase::Expired)
                    && reason == Some("BoundNotTaken")),
                "{task}: attempt {name} neither ran nor was given back unstarted: {st:?}"
            );
        }
        let (name, versions) = ran[0];
        let last = *versions.last().unwrap();
        assert_eq!(
            (
                last.spec.renewal,
                last.status.as_ref().and_then(|s| s.phase)
            ),
            (Some(Renewal::Worker), Some(LeasePhase::Completed)),
            "{name}: claimed to be renewed per worker, completed"
        );
        // Written by its holder: the claim, the twelve checkpoints
        // coalesced to at most one write per checkpoint interval (the TTL
        // by default: two here), the completion. A write whose answer a
        // loaded API server lost (504) lands and is made again at once
        // (409, re-read, 200): versions recorded within a second of the
        // one before count as one write. Renewed per lease it would be a
        // renewal every TTL/3, six over 12 s: the checkpoints cost at most
        // half of that (issue 39, defect 9; at TTL/3 they cost as much).
        let mut writes: Vec<f64> = Vec::new();
        for r in &leases {
            if let Change::Lease(l) = &r.change
                && l.name_any() == *name
                && l.spec.holder_identity.is_some()
                && writes.last().is_none_or(|w| r.at - w >= 1.0)
            {
                writes.push(r.at);
            }
        }
        let per_lease_renewals = 12 / (TTL / 3);
        assert!(
            writes.len() <= 4
                && writes.len().saturating_sub(2)
                    <= usize::try_from(per_lease_renewals / 2).unwrap(),
            "{name}: {} writes by its holder (at {writes:?}), {} versions",
            writes.len(),
            versions.len()
        );
        // Kept alive by its holder's WorkerLease, which listed it.
        let holder = last.spec.holder_identity.clone().unwrap();
        let attempt = AttemptRef::of(last);
        let renewals_naming_it = workers_seen
            .iter()
            .filter(|r| match &r.change {
                Change::Worker(wl) => {
                    wl.spec.holder_identity == holder && wl.holds().contains(&attempt)
                }
                _ => false,
            })
            .count();
        assert!(
            renewals_naming_it >= 3,
            "{name}: its holder's WorkerLease listed it {renewals_naming_it} times in 12 s at TTL {TTL}"
        );
    }
    // Each worker has its WorkerLease, which names its holder and queues,
    // and lists nothing once its attempts are done.
    for i in 1..=2 {
        let id = format!("w{i}");
        let wl = worker_lease(&ns, &id)
            .await
            .expect("a WorkerLease per worker");
        assert_eq!(wl.spec.holder_identity, id);
        assert_eq!(wl.spec.queues, ["demo"]);
    }
    for i in 1..=3 {
        let uid = tasks::uid(&ns, &format!("job{i}")).await.unwrap();
        assert_eq!(pg::audit(&db, &uid).await.unwrap().len(), 1, "one commit");
    }
    drop(w);
    ns.finish().await.unwrap();
}

#[tokio::test]
async fn a_paused_worker_is_revoked_before_its_lease_expires_and_cannot_commit() {
    let (ns, op, db) = setup("wl-pause").await;
    let zombie = per_worker(&ns, "zombie", 1);
    job(&ns, "job", 40, 250).await;
    wait_holder(&ns, "job", "zombie", T, || op.logs_with(&[&zombie]))
        .await
        .unwrap();
    let attempt = AttemptRef::of(&ns.api::<TaskLease>().get("job-1").await.unwrap());
    // A stop-the-world pause longer than the TTL: its WorkerLease stops.
    zombie.signal("STOP").unwrap();
    wait_lease(&ns, "job-1", LeasePhase::Expired, T, || {
        op.logs_with(&[&zombie])
    })
    .await
    .unwrap();
    let wl = worker_lease(&ns, "zombie").await.unwrap();
    assert!(
        wl.is_revoked(&attempt),
        "revoked on the WorkerLease before the expiry: {:?}",
        wl.status
    );
    let rescuer = per_worker(&ns, "rescuer", 1);
    let logs = || op.logs_with(&[&zombie, &rescuer]);
    wait_phase(&ns, "job", TaskPhase::Succeeded, T, logs)
        .await
        .unwrap();
    // The zombie wakes: its kill switch has fired, or its next renewal
    // finds the attempt revoked. Nothing of it reaches PostgreSQL.
    zombie.signal("CONT").unwrap();
    wait_for(
        "the zombie stops its attempt",
        T,
        || zombie.logs(),
        || {
            let text = zombie.log_text();
            async move {
                Ok((text.contains("kill switch fired")
                    || text.contains("attempt revoked by the operator"))
                .then_some(()))
            }
        },
    )
    .await
    .unwrap();
    let uid = tasks::uid(&ns, "job").await.unwrap();
    assert_eq!(
        pg::audit(&db, &uid).await.unwrap(),
        [(2, "rescuer".to_owned())],
        "only the second attempt committed"
    );
    // Its renewals go on, without the revoked attempt (the history check
    // refuses a renewal that lists it).
    let wl = ns.api::<WorkerLease>();
    let name = worker_lease_name("zombie");
    wait_for(
        "the zombie renews its WorkerLease without the revoked attempt",
        T,
        || zombie.logs(),
        || {
            let wl = wl.clone();
            let name = name.clone();
            let attempt = attempt.clone();
            async move {
                let w = wl.get(&name).await?;
                Ok((!w.holds().contains(&attempt)).then_some(()))
            }
        },
    )
    .await
    .unwrap();
    drop((zombie, rescuer));
    ns.finish().await.unwrap();
}

#[tokio::test]
async fn cancel_revokes_an_attempt_renewed_per_worker() {
    let (ns, op, _db) = setup("wl-cancel").await;
    let w = per_worker(&ns, "w", 1);
    job(&ns, "job", 400, 100).await;
    wait_holder(&ns, "job", "w", T, || op.logs_with(&[&w]))
        .await
        .unwrap();
    let attempt = AttemptRef::of(&ns.api::<TaskLease>().get("job-1").await.unwrap());
    ns.api::<batchlease_api::BatchTask>()
        .patch(
            "job",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"spec": {"cancel": true}})),
        )
        .await
        .unwrap();
    wait_phase(&ns, "job", TaskPhase::Cancelled, T, || op.logs_with(&[&w]))
        .await
        .unwrap();
    let wl = worker_lease(&ns, "w").await.unwrap();
    assert!(wl.is_revoked(&attempt), "{:?}", wl.status);
    // The worker learns of it by whichever read comes first: the
    // revocation on its WorkerLease, or the cancel on the TaskLease when it
    // writes a checkpoint there. Both renewals run every TTL/3 from the
    // moment the bound attempt started, so the two race by milliseconds;
    // either must fire the kill switch.
    wait_for(
        "the worker stops the cancelled attempt",
        T,
        || w.logs(),
        || {
            let text = w.log_text();
            async move {
                let revoked = text.contains("attempt revoked by the operator");
                let cancelled = text.contains("the task was cancelled: stopping the attempt");
                let fired = text.contains("kill switch fired");
                Ok(((revoked || cancelled) && fired).then_some(()))
            }
        },
    )
    .await
    .unwrap();
    // And its renewals no longer list the attempt.
    let wl_api = ns.api::<WorkerLease>();
    let name = worker_lease_name("w");
    wait_for(
        "the worker renews its WorkerLease without the cancelled attempt",
        T,
        || w.logs(),
        || {
            let wl_api = wl_api.clone();
            let name = name.clone();
            let attempt = attempt.clone();
            async move {
                let l = wl_api.get(&name).await?;
                Ok((!l.holds().contains(&attempt)).then_some(()))
            }
        },
    )
    .await
    .unwrap();
    drop(w);
    ns.finish().await.unwrap();
}

#[tokio::test]
async fn a_deleted_worker_lease_stops_its_attempts_and_the_task_runs_again() {
    let (ns, op, db) = setup("wl-deleted").await;
    let w = per_worker(&ns, "w", 1);
    job(&ns, "job", 30, 400).await;
    wait_holder(&ns, "job", "w", T, || op.logs_with(&[&w]))
        .await
        .unwrap();
    // Someone (an admin, not the holder) deletes the WorkerLease: the
    // operator counts that as a renewal seen then; the worker, at its next
    // renewal, stops the attempt and creates the object again.
    let wl: Api<WorkerLease> = ns.api();
    wl.delete(&worker_lease_name("w"), &Default::default())
        .await
        .unwrap();
    wait_for(
        "the worker stops its attempt and creates its WorkerLease again",
        T,
        || w.logs(),
        || {
            let text = w.log_text();
            async move { Ok(text.contains("worker lease gone").then_some(())) }
        },
    )
    .await
    .unwrap();
    let done = wait_phase(&ns, "job", TaskPhase::Succeeded, T * 2, || {
        op.logs_with(&[&w])
    })
    .await
    .unwrap();
    let st = done.status.unwrap();
    assert!(
        st.fencing_token >= 2,
        "the stopped attempt was replaced: {:?}",
        st.history
    );
    let uid = tasks::uid(&ns, "job").await.unwrap();
    let commits = pg::audit(&db, &uid).await.unwrap();
    assert_eq!(commits.len(), 1, "{commits:?}");
    assert_eq!(commits[0].0, st.fencing_token);
    drop(w);
    ns.finish().await.unwrap();
}

/// The never-listed rule: a worker that claimed an attempt per worker and
/// lost track of it — it keeps renewing its WorkerLease but never names
/// the attempt — does not keep the task. Renewals stop counting for it
/// 2·TTL after the claim was observed (the operator's watch saw every
/// version of the WorkerLease since before the claim); the attempt is
/// revoked, expires, and the task runs again under the next token.
#[tokio::test]
async fn an_attempt_its_worker_never_lists_expires_while_the_worker_renews() {
    let (ns, op, db) = setup("wl-unlisted").await;
    let ghost = "ghost/000001";
    let wls: Api<WorkerLease> = ns.api();
    workers::ghost_worker_lease(
        &ns,
        ghost,
        &["demo"],
        i32::try_from(TTL).unwrap(),
        None,
        false,
    )
    .await
    .unwrap();
    job(&ns, "job", 1, 10).await;
    let offered = wait_lease(&ns, "job-1", LeasePhase::Offered, T, || op.logs())
        .await
        .unwrap();
    let leases: Api<TaskLease> = ns.api();
    let claimed =
        batchlease_worker_sdk::lease_ops::claim(&leases, &offered, ghost, Renewal::Worker)
            .await
            .unwrap()
            .expect("the ghost's claim");
    assert_eq!(claimed.spec.renewal, Some(Renewal::Worker));
    let claimed_at = std::time::Instant::now();
    // It renews every TTL/3, listing nothing.
    let stop = tokio_util::sync::CancellationToken::new();
    let renewer = tokio::spawn({
        let (wls, stop) = (wls.clone(), stop.clone());
        async move {
            let mut renewals = 0u32;
            let mut every = tokio::time::interval(Duration::from_secs(TTL / 3));
            while !stop.is_cancelled() {
                tokio::select! {
                    () = stop.cancelled() => break,
                    _ = every.tick() => {}
                }
                let mut w = wls.get(&worker_lease_name(ghost)).await.unwrap();
                w.spec.renew_time = Some(MicroTime(k8s_openapi::jiff::Timestamp::now()));
                // A conflict with a revocation: read again and renew.
                if wls
                    .replace(&w.name_any(), &PostParams::default(), &w)
                    .await
                    .is_ok()
                {
                    renewals += 1;
                }
            }
            renewals
        }
    });
    let expired = wait_lease(&ns, "job-1", LeasePhase::Expired, T * 2, || op.logs())
        .await
        .unwrap();
    let after = claimed_at.elapsed();
    stop.cancel();
    let renewals = renewer.await.unwrap();
    assert!(
        after >= Duration::from_secs(2 * TTL),
        "expired {after:?} after the claim: before the 2·TTL cut-off, so not by it"
    );
    assert!(
        u64::from(renewals) * (TTL / 3) >= 2 * TTL,
        "the worker renewed throughout ({renewals} renewals)"
    );
    // Revoked on its WorkerLease before it expired (the history checker
    // judges the order).
    let w = worker_lease(&ns, ghost).await.unwrap();
    assert!(
        w.is_revoked(&AttemptRef::of(&expired)),
        "revoked: {:?}",
        w.status
    );
    // A real worker runs the task under the next token.
    let real = per_worker(&ns, "w", 1);
    let done = wait_phase(&ns, "job", TaskPhase::Succeeded, T, || {
        op.logs_with(&[&real])
    })
    .await
    .unwrap();
    let st = done.status.unwrap();
    assert_eq!(st.fencing_token, 2, "{:?}", st.history);
    let uid = tasks::uid(&ns, "job").await.unwrap();
    assert_eq!(pg::audit(&db, &uid).await.unwrap().len(), 1);
    drop(real);
    ns.finish().await.unwrap();
}

/// A demo worker with renewals per lease pinned (every lease renewed by
/// its own writes).
fn per_lease(ns: &TestNamespace, identity: &str, slots: usize) -> Process {
    let opts = WorkerOpts {
        slots,
        env: workers::per_lease_env(),
        ..Default::default()
    };
    workers::start(&ns.name, identity, &opts).unwrap()
}

/// Moving a running fleet to renewals per worker (issue 39): workers
/// renewing per lease (an older release) serve a queue while tasks run;
/// workers renewing per worker join, and the old ones are drained one by
/// one, as a rolling update does. No task is lost or run twice: every task succeeds with one
/// commit and no retry spent, both protocols held attempts, and the
/// history checker (revocations, tokens, storage, cancels) finds nothing.
#[tokio::test]
async fn a_fleet_moved_from_per_lease_to_per_worker_renewals_loses_and_repeats_nothing() {
    let (ns, op, db) = setup("wl-upgrade").await;
    let mut old: Vec<Process> = (1..=2)
        .map(|i| per_lease(&ns, &format!("old{i}"), 2))
        .collect();
    // 4 s of work each, a checkpoint every 250 ms: several run across each
    // step of the rollout.
    let n = 24;
    for i in 0..n {
        job(&ns, &format!("up{i:02}"), 16, 250).await;
    }
    // The new release joins, renewing per worker.
    let new: Vec<Process> = (1..=2)
        .map(|i| per_worker(&ns, &format!("new{i}"), 2))
        .collect();
    let held_by =
        |leases: &[batchlease_e2e::history::Recorded], prefix: &str, renewal: Option<Renewal>| {
            leases.iter().any(|r| match &r.change {
                Change::Lease(l) => {
                    l.spec
                        .holder_identity
                        .as_deref()
                        .is_some_and(|h| h.starts_with(prefix))
                        && l.spec.renewal.filter(|r| *r == Renewal::Worker) == renewal
                        && l.status.as_ref().and_then(|s| s.phase) == Some(LeasePhase::Held)
                }
                _ => false,
            })
        };
    // Once a new worker runs one per worker, the old ones go, one by one
    // (SIGTERM: drain, give back), as a rolling update does.
    wait_for(
        "a new worker holds an attempt per worker",
        T,
        || op.logs_with(&new.iter().chain(&old).collect::<Vec<_>>()),
        || async {
            let (leases, _) = ns.recorded().await?;
            Ok(held_by(&leases, "new", Some(Renewal::Worker)).then_some(()))
        },
    )
    .await
    .unwrap();
    for w in old.drain(..) {
        w.signal("TERM").unwrap();
        let w = std::sync::Mutex::new(w);
        wait_for(
            "an old worker drains and exits",
            T,
            || w.lock().unwrap().logs(),
            || {
                let exited = w.lock().unwrap().exited().is_some();
                async move { Ok(exited.then_some(())) }
            },
        )
        .await
        .unwrap();
    }
    let all: Vec<&Process> = new.iter().collect();
    for i in 0..n {
        let name = format!("up{i:02}");
        let done = wait_phase(&ns, &name, TaskPhase::Succeeded, T * 2, || {
            op.logs_with(&all)
        })
        .await
        .unwrap();
        let st = done.status.unwrap();
        assert_eq!(st.attempts, 0, "{name}: no retry spent: {:?}", st.history);
        let uid = tasks::uid(&ns, &name).await.unwrap();
        let commits = pg::audit(&db, &uid).await.unwrap();
        assert_eq!(commits.len(), 1, "{name}: one commit: {commits:?}");
        assert_eq!(
            commits[0].0, st.fencing_token,
            "{name}: by the last attempt"
        );
    }
    let (leases, _) = ns.recorded().await.unwrap();
    assert!(
        held_by(&leases, "old", None),
        "an old worker held an attempt per lease"
    );
    assert!(
        !held_by(&leases, "old", Some(Renewal::Worker)),
        "no old worker renewed per worker"
    );
    drop(new);
    ns.finish().await.unwrap();
}
