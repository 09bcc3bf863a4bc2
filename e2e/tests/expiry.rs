//! When the operator expires a lease, against a real control plane with a
//! test worker driving TaskLeases through the API: a full TTL after the
//! last renewal it saw and no sooner (a silent holder, renewals across an
//! operator restart, writes that are no renewals), and at the active
//! deadline despite renewals. Each lower bound counts from when the test
//! sent the write, since the operator may see a write before its answer
//! reaches the test.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use batchlease_api::{LeaseOutcome, LeasePhase, TaskLease, TaskPhase};
use batchlease_e2e::TestNamespace;
use batchlease_e2e::operator::Operator;
use batchlease_e2e::tasks::{self, event_reasons, lease_phase, wait_lease, wait_phase};
use batchlease_e2e::worker::{self, claim, complete, renew};
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;
use tokio::time::Instant;

const T: Duration = Duration::from_secs(30);

async fn setup(prefix: &str) -> (TestNamespace, Operator) {
    Operator::in_new_namespace(prefix, "op-a", T).await.unwrap()
}

#[tokio::test]
async fn silent_holder_expires_after_ttl_and_the_zombie_is_fenced() {
    let (ns, op) = setup("expiry").await;
    let leases: Api<TaskLease> = ns.api();
    tasks::create(&ns, "job", json!({"queue": "q", "leaseDurationSeconds": 5}))
        .await
        .unwrap();
    let offered = wait_lease(&ns, "job-1", LeasePhase::Offered, T, || op.logs())
        .await
        .unwrap();

    let sent = Instant::now();
    let zombie = claim(&leases, &offered, "zombie").await.unwrap();
    let acked = Instant::now();
    // The zombie now stalls: no renewal. Watch for the expiry.
    let expired = wait_lease(
        &ns,
        "job-1",
        LeasePhase::Expired,
        Duration::from_secs(20),
        || op.logs(),
    )
    .await
    .unwrap();
    let seen = Instant::now();
    let ttl = Duration::from_secs(5);
    assert!(
        seen.duration_since(sent) >= ttl,
        "expired early: {:?} after the claim was sent",
        seen.duration_since(sent)
    );
    assert!(
        seen.duration_since(acked) <= ttl + Duration::from_secs(3),
        "expired late: {:?} after the claim was acknowledged",
        seen.duration_since(acked)
    );
    assert_eq!(
        expired.status.as_ref().unwrap().reason.as_deref(),
        Some("LeaseExpired")
    );

    // Reassigned under token 2 and completed by another worker.
    let offered2 = wait_lease(&ns, "job-2", LeasePhase::Offered, T, || op.logs())
        .await
        .unwrap();
    assert_eq!(offered2.spec.fencing_token, 2);
    let held2 = claim(&leases, &offered2, "rescuer").await.unwrap();

    // The zombie wakes up. Its renewal carries a stale resourceVersion: 409.
    let late = renew(&leases, &zombie).await.unwrap_err();
    assert_eq!(worker::code(&late), 409, "{late}");
    // Even re-reading first (no stale version) cannot revive the lease: 422.
    let fresh = leases.get("job-1").await.unwrap();
    let blind = renew(&leases, &fresh).await.unwrap_err();
    assert_eq!(worker::code(&blind), 422, "{blind}");
    assert!(blind.to_string().contains("is final"), "{blind}");
    // And its late completion is refused the same way.
    let late_done = complete(&leases, &fresh, LeaseOutcome::Succeeded, None, None)
        .await
        .unwrap_err();
    assert_eq!(worker::code(&late_done), 422, "{late_done}");

    complete(
        &leases,
        &held2,
        LeaseOutcome::Succeeded,
        None,
        Some(json!({"by": "rescuer"})),
    )
    .await
    .unwrap();
    let done = wait_phase(&ns, "job", TaskPhase::Succeeded, T, || op.logs())
        .await
        .unwrap();
    let st = done.status.unwrap();
    assert_eq!(st.fencing_token, 2);
    assert_eq!(
        st.result.map(|r| r.to_value().unwrap()),
        Some(json!({"by": "rescuer"}))
    );
    assert_eq!(st.attempts, 1, "the expiry spent one retry");
    let outcomes: Vec<_> = st
        .history
        .iter()
        .map(|h| (h.token, h.outcome.as_str()))
        .collect();
    assert_eq!(outcomes, [(1, "Expired"), (2, "Succeeded")]);
    assert_eq!(
        leases.get("job-1").await.unwrap().status.unwrap().phase,
        Some(LeasePhase::Expired)
    );
    let reasons = event_reasons(&ns, "job").await.unwrap();
    for r in ["LeaseExpired", "Reassigned"] {
        assert!(
            reasons.iter().any(|x| x == r),
            "missing event {r}: {reasons:?}"
        );
    }
    assert_eq!(
        op.metric(
            &format!("batchlease_lease_expired_before_release_total{{namespace=\"{}\",queue=\"q\",reason=\"LeaseExpired\"}}", ns.name)
        )
        .await
        .unwrap(),
        Some(1.0)
    );
    assert_eq!(
        op.metric(&format!(
            "batchlease_reassignments_total{{namespace=\"{}\",queue=\"q\"}}",
            ns.name
        ))
        .await
        .unwrap(),
        Some(1.0)
    );
    ns.finish().await.unwrap();
}

#[tokio::test]
async fn operator_restart_while_held_neither_expires_early_nor_reissues() {
    let (ns, mut op) = setup("restart").await;
    let leases: Api<TaskLease> = ns.api();
    tasks::create(&ns, "job", json!({"queue": "q", "leaseDurationSeconds": 6}))
        .await
        .unwrap();
    let offered = wait_lease(&ns, "job-1", LeasePhase::Offered, T, || op.logs())
        .await
        .unwrap();
    let mut held = claim(&leases, &offered, "w").await.unwrap();
    wait_phase(&ns, "job", TaskPhase::Running, T, || op.logs())
        .await
        .unwrap();

    // Keep renewing every 2 s (TTL/3) across a SIGKILL and restart, for
    // longer than two TTLs. Pacing a renewal loop is the worker's job; the
    // interval is not a wait for a condition.
    let until = Instant::now() + Duration::from_secs(14);
    let mut restarted = false;
    let mut ticker = tokio::time::interval(Duration::from_secs(2));
    // When the last renewal was sent: the operator cannot see a renewal
    // before it is sent, so this is the earliest it may time the TTL from.
    let mut last_renewal = Instant::now();
    while Instant::now() < until {
        ticker.tick().await;
        last_renewal = Instant::now();
        held = renew(&leases, &held)
            .await
            .expect("renewal refused: the lease was expired while renewed");
        if !restarted && Instant::now() + Duration::from_secs(10) > until {
            op.restart().unwrap();
            restarted = true;
        }
    }
    let l = leases.get("job-1").await.unwrap();
    assert_eq!(lease_phase(&l), Some(LeasePhase::Held));
    // The restarted operator times the lease from its own first observation:
    // with renewals stopped, expiry comes no sooner than a full TTL after the
    // last renewal was sent.
    let expired = wait_lease(&ns, "job-1", LeasePhase::Expired, T, || op.logs())
        .await
        .unwrap();
    let after = Instant::now().duration_since(last_renewal);
    assert!(
        after >= Duration::from_secs(6),
        "expired {after:?} after the last renewal was sent, under its 6 s TTL"
    );
    assert_eq!(expired.spec.fencing_token, 1);
    let offered = wait_lease(&ns, "job-2", LeasePhase::Offered, T, || op.logs())
        .await
        .unwrap();
    assert_eq!(
        offered.spec.fencing_token, 2,
        "one token per lease, none reused"
    );
    let held = claim(&leases, &offered, "w2").await.unwrap();
    complete(&leases, &held, LeaseOutcome::Succeeded, None, None)
        .await
        .unwrap();
    let st = wait_phase(&ns, "job", TaskPhase::Succeeded, T, || op.logs())
        .await
        .unwrap()
        .status
        .unwrap();
    assert_eq!(st.fencing_token, 2);
    ns.finish().await.unwrap();
}

#[tokio::test]
async fn attempt_overrunning_active_deadline_is_expired_despite_renewals() {
    let (ns, op) = setup("deadline").await;
    let leases: Api<TaskLease> = ns.api();
    let spec = json!({"queue": "q", "leaseDurationSeconds": 30, "activeDeadlineSeconds": 3, "maxRetries": 0});
    tasks::create(&ns, "job", spec).await.unwrap();
    let offered = wait_lease(&ns, "job-1", LeasePhase::Offered, T, || op.logs())
        .await
        .unwrap();
    let sent = Instant::now();
    let mut held = claim(&leases, &offered, "slow").await.unwrap();
    // The holder keeps renewing (it is alive, just too slow).
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let expired = loop {
        tick.tick().await;
        match renew(&leases, &held).await {
            Ok(l) => held = l,
            Err(e) => {
                assert_eq!(worker::code(&e), 409, "{e}");
                break leases.get("job-1").await.unwrap();
            }
        }
        assert!(
            sent.elapsed() < Duration::from_secs(15),
            "not expired by the deadline\n{}",
            op.logs()
        );
    };
    let st = expired.status.unwrap();
    assert_eq!(
        (st.phase, st.reason.as_deref()),
        (Some(LeasePhase::Expired), Some("ActiveDeadlineExceeded"))
    );
    // Timed by the API server's audit log, not by this test's polling: the
    // expiry was applied within [claim + deadline, claim + deadline + 2 s],
    // the claim timed from when the API server received it (the operator
    // may see it before its answer is complete).
    let writes = batchlease_e2e::audit::writes_in(&ns.name).unwrap();
    let on_lease: Vec<_> = writes
        .iter()
        .filter(|w| w.resource == "taskleases" && w.name == "job-1" && w.verb == "update")
        .collect();
    let claimed = on_lease
        .iter()
        .find(|w| w.user == "admin")
        .expect("the claim is in the audit log")
        .received;
    let expired_at = on_lease
        .iter()
        .find(|w| w.user == Operator::user("op-a"))
        .expect("the operator's expiry is in the audit log")
        .at;
    let after = expired_at - claimed;
    assert!(
        (3.0..=5.0).contains(&after),
        "expired {after:.3}s after the claim (activeDeadlineSeconds 3)"
    );
    let t = wait_phase(&ns, "job", TaskPhase::DeadLettered, T, || op.logs())
        .await
        .unwrap();
    assert_eq!(
        t.status.unwrap().last_failure.unwrap().reason,
        "ActiveDeadlineExceeded"
    );
    ns.finish().await.unwrap();
}

/// Design §3.5: a conflict on the expiry write means "re-read". A renewal
/// (a new renewTime) is credited; any other write is no sign of life. A
/// holder that went silent while something else keeps writing its lease (a
/// labeller, a blind writer) is expired on time all the same.
#[tokio::test]
async fn writes_that_are_no_renewals_do_not_keep_a_silent_lease_alive() {
    let (ns, op) = setup("churn").await;
    let leases: Api<TaskLease> = ns.api();
    tasks::create(
        &ns,
        "job",
        json!({"queue": "q", "leaseDurationSeconds": 5, "maxRetries": 0}),
    )
    .await
    .unwrap();
    let offered = wait_lease(&ns, "job-1", LeasePhase::Offered, T, || op.logs())
        .await
        .unwrap();
    // Sent: the operator may see the claim before its answer reaches this
    // test, so the lower bound counts from the request, the upper from the
    // answer.
    let sent = Instant::now();
    claim(&leases, &offered, "silent").await.unwrap();
    let claimed = Instant::now();
    // The holder never renews; a labeller rewrites the lease's labels as
    // fast as it can (each write changes its resourceVersion).
    let churn = {
        let leases = leases.clone();
        tokio::spawn(async move {
            let mut n = 0u64;
            loop {
                n += 1;
                let patch = json!({"metadata": {"labels": {"churn": n.to_string()}}});
                let _ = leases
                    .patch("job-1", &PatchParams::default(), &Patch::Merge(&patch))
                    .await;
            }
        })
    };
    wait_lease(&ns, "job-1", LeasePhase::Expired, T, || op.logs())
        .await
        .unwrap();
    let after = claimed.elapsed();
    let after_sent = sent.elapsed();
    churn.abort();
    assert!(
        after < Duration::from_secs(5 + 4),
        "a silent lease under churn expired {after:?} after its claim (TTL 5 s)"
    );
    assert!(
        after_sent >= Duration::from_secs(5),
        "expired early: {after_sent:?} after the claim was sent"
    );
    wait_phase(&ns, "job", TaskPhase::DeadLettered, T, || op.logs())
        .await
        .unwrap();
    let conflicts = op
        .metric("batchlease_write_conflicts_total")
        .await
        .unwrap()
        .unwrap_or(0.0);
    eprintln!("expiry write conflicts under churn: {conflicts}");
    ns.finish().await.unwrap();
}
