//! The operator against a real control plane, with a test worker driving
//! TaskLeases through the API exactly as the SDK will.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use batchlease_api::{BatchTask, BatchTaskStatus, LeaseOutcome, LeasePhase, TaskLease, TaskPhase};
use batchlease_e2e::operator::Operator;
use batchlease_e2e::tasks::{self, event_reasons, wait_lease, wait_phase, wait_task};
use batchlease_e2e::worker::{self, claim, complete, renew};
use batchlease_e2e::{Cluster, TestNamespace};
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;

const T: Duration = Duration::from_secs(30);

async fn setup(prefix: &str) -> (TestNamespace, Operator) {
    Operator::in_new_namespace(prefix, "op-a", T).await.unwrap()
}

#[tokio::test]
async fn happy_path_one_lease_token_one() {
    let (ns, op) = setup("happy").await;
    let leases: Api<TaskLease> = ns.api();
    tasks::create(&ns, "job", json!({"queue": "q", "payload": {"n": 1}}))
        .await
        .unwrap();

    let task = wait_phase(&ns, "job", TaskPhase::Ready, T, || op.logs())
        .await
        .unwrap();
    let st = task.status.unwrap();
    assert_eq!(
        (st.fencing_token, st.current_lease.as_deref()),
        (1, Some("job-1"))
    );
    let offered = wait_lease(&ns, "job-1", LeasePhase::Offered, T, || op.logs())
        .await
        .unwrap();
    assert_eq!(offered.spec.fencing_token, 1);
    assert_eq!(
        offered.owner_references()[0].uid,
        task.metadata.uid.clone().unwrap()
    );

    let held = claim(&leases, &offered, "worker-1").await.unwrap();
    let running = wait_phase(&ns, "job", TaskPhase::Running, T, || op.logs())
        .await
        .unwrap();
    assert_eq!(running.status.unwrap().holder.as_deref(), Some("worker-1"));
    let held = renew(&leases, &held).await.unwrap();
    let held = renew(&leases, &held).await.unwrap();
    complete(
        &leases,
        &held,
        LeaseOutcome::Succeeded,
        None,
        Some(json!({"rows": 42})),
    )
    .await
    .unwrap();

    let done = wait_phase(&ns, "job", TaskPhase::Succeeded, T, || op.logs())
        .await
        .unwrap();
    let st = done.status.unwrap();
    assert_eq!(st.fencing_token, 1);
    assert_eq!(st.attempts, 0);
    assert_eq!(
        st.result.map(|r| r.to_value().unwrap()),
        Some(json!({"rows": 42}))
    );
    assert_eq!(st.history.len(), 1);
    assert_eq!(st.history[0].outcome, "Succeeded");
    assert_eq!(st.history[0].holder.as_deref(), Some("worker-1"));
    assert!(
        st.conditions
            .iter()
            .any(|c| c.type_ == "Succeeded" && c.status == "True"),
        "{:?}",
        st.conditions
    );
    assert_eq!(
        leases.list(&Default::default()).await.unwrap().items.len(),
        1,
        "exactly one lease"
    );
    let reasons = event_reasons(&ns, "job").await.unwrap();
    for r in ["LeaseIssued", "LeaseClaimed", "Succeeded"] {
        assert!(
            reasons.iter().any(|x| x == r),
            "missing event {r}: {reasons:?}"
        );
    }
    assert_eq!(
        op.metric(&format!(
            "batchlease_leases_issued_total{{namespace=\"{}\",queue=\"q\"}}",
            ns.name
        ))
        .await
        .unwrap(),
        Some(1.0)
    );
    let (code, body) = op.get("/metrics").await.unwrap();
    assert_eq!(code, 200);
    assert!(
        body.contains(&format!(
            "\nbatchlease_tasks{{namespace=\"{}\",queue=\"q\",phase=\"Succeeded\"}} 1",
            ns.name
        )),
        "{body}"
    );
    assert!(
        body.contains("batchlease_reconcile_duration_seconds_count"),
        "{body}"
    );
    assert_eq!(op.get("/healthz").await.unwrap().0, 200);
    ns.finish().await.unwrap();
}

/// `name` is the final lease that retired its token: Released, reason
/// TokenRetired, nobody ever held it — token 1 was never used for a second
/// live lease.
fn assert_tombstone(leases: &[TaskLease], name: &str) {
    let l = leases
        .iter()
        .find(|l| l.name_any() == name)
        .unwrap_or_else(|| panic!("no {name} in {leases:?}"));
    let st = l.status.clone().unwrap();
    assert_eq!(
        (
            st.phase,
            st.reason.as_deref(),
            l.spec.holder_identity.as_deref()
        ),
        (Some(LeasePhase::Released), Some("TokenRetired"), None),
        "{l:?}"
    );
}

#[tokio::test]
async fn crash_between_status_write_and_lease_creation_retires_the_token() {
    let cluster = Cluster::with_crds().await.unwrap();
    let ns = cluster.namespace("repair").await.unwrap();
    // Leave the task exactly as an operator that died after the first write
    // of an issue would: status says Ready with token 1, no lease exists.
    let task = tasks::create(&ns, "job", json!({"queue": "q"}))
        .await
        .unwrap();
    let api: Api<BatchTask> = ns.api();
    let mut t = task.clone();
    t.status = Some(BatchTaskStatus {
        phase: Some(TaskPhase::Ready),
        fencing_token: 1,
        current_lease: Some("job-1".into()),
        ..Default::default()
    });
    api.replace_status("job", &PostParams::default(), &t)
        .await
        .unwrap();

    // The new operator cannot know whether a create of job-1 is still on
    // its way or was claimed and deleted: token 1 is retired, never reused.
    let op = Operator::start(&ns.name, "op-a").unwrap();
    let lease = wait_lease(&ns, "job-2", LeasePhase::Offered, T, || op.logs())
        .await
        .unwrap();
    assert_eq!(lease.spec.fencing_token, 2);
    let task = api.get("job").await.unwrap();
    let st = task.status.unwrap();
    assert_eq!(
        (st.fencing_token, st.current_lease.as_deref(), st.attempts),
        (2, Some("job-2"), 0),
        "a new token, and no retry spent on the operator's crash"
    );
    // On record as a token whose offer went missing, not as a lost lease
    // of a holder: no holder was ever seen, and the lease may never have
    // existed.
    let lost: Vec<_> = st
        .history
        .iter()
        .map(|h| {
            (
                h.token,
                h.outcome.as_str(),
                h.reason.as_deref(),
                h.holder.as_deref(),
            )
        })
        .collect();
    assert_eq!(lost, [(1, "Lost", Some("OfferMissing"), None)]);
    let all = ns
        .api::<TaskLease>()
        .list(&Default::default())
        .await
        .unwrap();
    let mut names: Vec<String> = all.items.iter().map(|l| l.name_any()).collect();
    names.sort();
    assert_eq!(names, ["job-1", "job-2"]);
    assert_tombstone(&all.items[..], "job-1");
    let reasons = event_reasons(&ns, "job").await.unwrap();
    assert!(reasons.iter().any(|r| r == "LeaseReplaced"), "{reasons:?}");
    ns.cleanup().await.unwrap();
}

#[tokio::test]
async fn a_deleted_claimed_lease_is_replaced_under_a_new_token_never_recreated() {
    let (ns, op) = setup("deleted-lease").await;
    let leases: Api<TaskLease> = ns.api();
    tasks::create(
        &ns,
        "job",
        json!({"queue": "q", "leaseDurationSeconds": 30}),
    )
    .await
    .unwrap();
    let offered = wait_lease(&ns, "job-1", LeasePhase::Offered, T, || op.logs())
        .await
        .unwrap();
    let held = claim(&leases, &offered, "w1").await.unwrap();
    wait_phase(&ns, "job", TaskPhase::Running, T, || op.logs())
        .await
        .unwrap();
    // Someone deletes the claimed lease (kubectl delete tl job-1). w1 is
    // still working under token 1: recreating job-1 would let a second
    // worker claim token 1 too.
    leases.delete("job-1", &Default::default()).await.unwrap();
    let next = wait_lease(&ns, "job-2", LeasePhase::Offered, T, || op.logs())
        .await
        .unwrap();
    assert_eq!(next.spec.fencing_token, 2);
    let again = leases.list(&Default::default()).await.unwrap().items;
    assert_tombstone(&again, "job-1");
    let st = tasks::status(&ns, "job").await.unwrap();
    assert_eq!((st.fencing_token, st.attempts), (2, 0));
    let lost = st.history.last().unwrap();
    assert_eq!(
        (lost.token, lost.outcome.as_str(), lost.holder.as_deref()),
        (1, "Lost", Some("w1"))
    );
    // w1's next renewal is refused: its lease is gone, and the object now
    // under its name is another one (the SDK re-reads and fires its kill
    // switch).
    let err = renew(&leases, &held).await.unwrap_err();
    assert!(matches!(worker::code(&err), 404 | 409), "{err}");
    // The replacement runs normally.
    let held2 = claim(&leases, &next, "w2").await.unwrap();
    complete(&leases, &held2, LeaseOutcome::Succeeded, None, None)
        .await
        .unwrap();
    wait_phase(&ns, "job", TaskPhase::Succeeded, T, || op.logs())
        .await
        .unwrap();
    ns.finish().await.unwrap();
}

#[tokio::test]
async fn failures_back_off_then_dead_letter_and_redrive_recovers() {
    let (ns, op) = setup("deadletter").await;
    let leases: Api<TaskLease> = ns.api();
    let spec = json!({"queue": "q", "maxRetries": 3,
                      "backoff": {"initialSeconds": 1, "maxSeconds": 2, "multiplier": 3}});
    tasks::create(&ns, "job", spec).await.unwrap();

    let mut delays = Vec::new();
    for token in 1..=4 {
        let name = format!("job-{token}");
        let offered = wait_lease(&ns, &name, LeasePhase::Offered, T, || op.logs())
            .await
            .unwrap();
        let held = claim(&leases, &offered, "w").await.unwrap();
        complete(&leases, &held, LeaseOutcome::Failed, Some("Boom"), None)
            .await
            .unwrap();
        let settled = wait_task(
            &ns,
            "job",
            "attempt settled",
            T,
            || op.logs(),
            |t| {
                t.status
                    .as_ref()
                    .is_some_and(|s| s.attempts == token as i32)
            },
        )
        .await
        .unwrap();
        let st = settled.status.unwrap();
        let failure = st.last_failure.clone().unwrap();
        assert_eq!((failure.reason.as_str(), failure.token), ("Boom", token));
        if token < 4 {
            assert_eq!(st.phase, Some(TaskPhase::Pending));
            let after = st.next_attempt_after.unwrap().0;
            delays.push(after.duration_since(failure.time.0).as_secs_f64());
            // The next lease is not offered before the backoff elapsed.
            let next = wait_lease(
                &ns,
                &format!("job-{}", token + 1),
                LeasePhase::Offered,
                T,
                || op.logs(),
            )
            .await
            .unwrap();
            let created = next.metadata.creation_timestamp.unwrap().0;
            assert!(
                created.as_second() >= after.as_second(),
                "offered at {created}, before {after}"
            );
        } else {
            assert_eq!(st.phase, Some(TaskPhase::DeadLettered));
            assert_eq!(st.history.len(), 4);
            assert!(st.history.iter().all(|h| h.outcome == "Failed"));
        }
    }
    // initial·3^n capped at maxSeconds, plus jitter in [0, delay/2]: 1–1.5 s,
    // 2–3 s, then capped at 2–3 s (9–13.5 s uncapped). Status times have
    // one-second resolution: the failure time is truncated and the retry
    // deadline rounded up (never early), so each bound widens by 1.5 s.
    assert!((1.0..=3.0).contains(&delays[0]), "{delays:?}");
    assert!((2.0..=4.0).contains(&delays[1]), "{delays:?}");
    assert!(
        (2.0..=4.0).contains(&delays[2]),
        "maxSeconds not respected: {delays:?}"
    );
    let reasons = event_reasons(&ns, "job").await.unwrap();
    assert!(reasons.iter().any(|r| r == "DeadLettered"), "{reasons:?}");
    assert_eq!(
        op.metric(&format!(
            "batchlease_tasks_dead_lettered_total{{namespace=\"{}\",queue=\"q\",reason=\"Boom\"}}",
            ns.name
        ))
        .await
        .unwrap(),
        Some(1.0)
    );

    // Redrive: a fresh budget, a new lease with the next token.
    ns.api::<BatchTask>()
        .patch(
            "job",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"redrive": 1}})),
        )
        .await
        .unwrap();
    let offered = wait_lease(&ns, "job-5", LeasePhase::Offered, T, || op.logs())
        .await
        .unwrap();
    let st = tasks::status(&ns, "job").await.unwrap();
    assert_eq!((st.attempts, st.observed_redrive), (0, 1));
    let held = claim(&leases, &offered, "w").await.unwrap();
    complete(&leases, &held, LeaseOutcome::Succeeded, None, None)
        .await
        .unwrap();
    wait_phase(&ns, "job", TaskPhase::Succeeded, T, || op.logs())
        .await
        .unwrap();
    assert!(
        event_reasons(&ns, "job")
            .await
            .unwrap()
            .iter()
            .any(|r| r == "Redriven")
    );
    // Old leases are pruned: the current one plus the last three remain.
    let names = batchlease_e2e::wait_for(
        "old leases pruned",
        T,
        || op.logs(),
        || async {
            let mut names: Vec<String> = leases
                .list(&Default::default())
                .await?
                .items
                .iter()
                .map(|l| l.name_any())
                .collect();
            names.sort();
            Ok((names.len() == 4).then_some(names))
        },
    )
    .await
    .unwrap();
    assert_eq!(names, ["job-2", "job-3", "job-4", "job-5"], "job-1 pruned");
    ns.finish().await.unwrap();
}

#[tokio::test]
async fn permanent_failure_and_interruption() {
    let (ns, op) = setup("outcomes").await;
    let leases: Api<TaskLease> = ns.api();
    tasks::create(&ns, "perm", json!({"queue": "q", "maxRetries": 5}))
        .await
        .unwrap();
    tasks::create(&ns, "drain", json!({"queue": "q", "maxRetries": 0}))
        .await
        .unwrap();

    let offered = wait_lease(&ns, "perm-1", LeasePhase::Offered, T, || op.logs())
        .await
        .unwrap();
    let mut held = claim(&leases, &offered, "w").await.unwrap();
    let st = held.status.get_or_insert_with(Default::default);
    st.permanent = true;
    complete(&leases, &held, LeaseOutcome::Failed, Some("BadInput"), None)
        .await
        .unwrap();
    let t = wait_phase(&ns, "perm", TaskPhase::DeadLettered, T, || op.logs())
        .await
        .unwrap();
    assert_eq!(
        t.status.unwrap().attempts,
        1,
        "dead-lettered at once despite maxRetries=5"
    );

    // Interrupted (a drained worker) does not spend the (zero) retry budget.
    let offered = wait_lease(&ns, "drain-1", LeasePhase::Offered, T, || op.logs())
        .await
        .unwrap();
    let held = claim(&leases, &offered, "w").await.unwrap();
    complete(&leases, &held, LeaseOutcome::Interrupted, None, None)
        .await
        .unwrap();
    let offered = wait_lease(&ns, "drain-2", LeasePhase::Offered, T, || op.logs())
        .await
        .unwrap();
    let st = tasks::status(&ns, "drain").await.unwrap();
    assert_eq!((st.attempts, st.phase), (0, Some(TaskPhase::Ready)));
    let held = claim(&leases, &offered, "w").await.unwrap();
    complete(&leases, &held, LeaseOutcome::Succeeded, None, None)
        .await
        .unwrap();
    wait_phase(&ns, "drain", TaskPhase::Succeeded, T, || op.logs())
        .await
        .unwrap();
    ns.finish().await.unwrap();
}

#[tokio::test]
async fn a_task_with_a_253_character_name_gets_its_events() {
    // kube-rs names an Event `<task>.<nanoseconds hex>`: 270 characters
    // here, which the API server refused, so such a task had no Events.
    let (ns, op) = setup("longname").await;
    let name = format!("{}-z", "a".repeat(251));
    assert_eq!(name.len(), 253);
    tasks::create(&ns, &name, json!({"queue": "q"}))
        .await
        .unwrap();
    wait_phase(&ns, &name, TaskPhase::Ready, T, || op.logs())
        .await
        .unwrap();
    batchlease_e2e::wait_for(
        "an Event about the long-named task",
        T,
        || op.logs(),
        || {
            let (ns, name) = (&ns, name.as_str());
            async move {
                let reasons = event_reasons(ns, name).await?;
                Ok(reasons.contains(&"LeaseIssued".to_owned()).then_some(()))
            }
        },
    )
    .await
    .unwrap();
    let logs = std::fs::read_to_string(op.log_path()).unwrap();
    assert!(!logs.contains("publishing event failed"), "{logs}");
    // Its log is a file, not a terminal: no colour codes in it.
    assert!(!logs.contains('\u{1b}'), "ANSI escapes in a log file");
    ns.cleanup().await.unwrap();
}

#[tokio::test]
async fn a_tls_failure_is_logged_with_its_cause() {
    // The API server's certificate checked against a CA that did not sign
    // it: the log must say why the connection failed, not only
    // `client error (Connect)`.
    let cluster = Cluster::with_crds().await.unwrap();
    let ns = cluster.namespace("tls").await.unwrap();
    let dir = batchlease_e2e::secrets::PrivateDir::new(&ns.name).unwrap();
    let (key, ca) = (dir.path().join("other.key"), dir.path().join("other.crt"));
    let out = std::process::Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-days",
            "1",
        ])
        .args([
            "-subj",
            "/CN=not-the-cluster-ca",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
        ])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&ca)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let admin = std::fs::read_to_string(std::env::var("KUBECONFIG").unwrap()).unwrap();
    let wrong: String = admin
        .lines()
        .map(|l| match l.split_once("certificate-authority:") {
            Some((indent, _)) => format!("{indent}certificate-authority: {}\n", ca.display()),
            None => format!("{l}\n"),
        })
        .collect();
    let kc = dir.write("kubeconfig-wrong-ca", &wrong).unwrap();
    let op = Operator::start_with(
        &ns.name,
        "tls",
        vec![format!("--kubeconfig={}", kc.display())],
    )
    .unwrap();
    let log = batchlease_e2e::wait_for(
        "the operator's first failed request logged",
        T,
        || op.logs(),
        || async {
            let log = std::fs::read_to_string(op.log_path()).unwrap_or_default();
            Ok(log
                .contains("reading the leader lease failed")
                .then_some(log))
        },
    )
    .await
    .unwrap();
    assert!(
        log.contains("invalid peer certificate") && log.contains("UnknownIssuer"),
        "the cause is missing: {log}"
    );
    ns.cleanup().await.unwrap();
}
