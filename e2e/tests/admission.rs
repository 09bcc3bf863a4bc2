//! Holder-only admission (design §9): the chart's ValidatingAdmissionPolicy
//! lets only a Held lease's holder write it. Workers authenticate with
//! ServiceAccount tokens bound to Pod objects (a Pod object exists without
//! a kubelet), which is what a real pod's projected token is, so the API
//! server names the pod in each request; the operator runs on the chart's
//! own ServiceAccount, and its writes — offering, expiring and settling
//! leases it does not hold — must go through untouched.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::time::Duration;

use batchlease_api::{LeaseOutcome, LeasePhase, TaskLease, TaskPhase};
use batchlease_e2e::operator::Operator;
use batchlease_e2e::secrets::PrivateDir;
use batchlease_e2e::tasks::{self, wait_lease, wait_phase};
use batchlease_e2e::workers::{self, WorkerOpts};
use batchlease_e2e::{Cluster, chart, helm, kubectl, wait_for};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Api, PostParams, ResourceExt};
use kube::core::Status;
use serde_json::json;

async fn client_for(kubeconfig: &Path) -> kube::Client {
    let kc = kube::config::Kubeconfig::read_from(kubeconfig).unwrap();
    let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .unwrap();
    kube::Client::try_from(cfg).unwrap()
}

/// Replaces `l` as `api`'s user: the API server's answer.
async fn write(
    api: &Api<TaskLease>,
    l: &TaskLease,
    dry_run: bool,
) -> Result<TaskLease, Box<Status>> {
    let pp = PostParams {
        dry_run,
        ..Default::default()
    };
    match api.replace(&l.name_any(), &pp, l).await {
        Ok(l) => Ok(l),
        Err(kube::Error::Api(s)) => Err(s),
        Err(e) => panic!("writing lease {}: {e}", l.name_any()),
    }
}

#[track_caller]
fn assert_denied(r: Result<TaskLease, Box<Status>>, needle: &str) {
    let s = r.expect_err("the write should have been denied");
    assert_eq!(s.code, 403, "{s:?}");
    assert!(
        s.message.contains("holder-only") && s.message.contains(needle),
        "denial should say why ({needle}): {}",
        s.message
    );
}

fn claim(mut l: TaskLease, holder: &str) -> TaskLease {
    let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
    l.spec.holder_identity = Some(holder.into());
    l.spec.acquire_time = Some(now.clone());
    l.spec.renew_time = Some(now);
    l.status.get_or_insert_with(Default::default).phase = Some(LeasePhase::Held);
    l
}

fn renew(mut l: TaskLease) -> TaskLease {
    l.spec.renew_time = Some(MicroTime(k8s_openapi::jiff::Timestamp::now()));
    l
}

fn complete(mut l: TaskLease) -> TaskLease {
    let st = l.status.get_or_insert_with(Default::default);
    st.phase = Some(LeasePhase::Completed);
    st.outcome = Some(LeaseOutcome::Succeeded);
    l
}

#[tokio::test]
async fn only_the_holder_may_write_a_held_lease() {
    let cluster = Cluster::with_crds().await.unwrap();
    let ns = cluster.namespace("admit").await.unwrap();
    let n = ns.name.as_str();
    let release = format!("a{}", &n[n.len() - 6..]);
    helm::ok(&[
        "install",
        &release,
        "charts/batchlease-operator",
        "-n",
        n,
        "--set",
        &format!("watchNamespaces={{{n}}}"),
        "--wait=false",
    ])
    .unwrap();
    let policy = format!("{release}-batchlease-operator-holder-only");
    // The policy's CEL type-checks against the CRD's schema.
    let warnings = wait_for(
        "the policy type-checked",
        Duration::from_secs(30),
        || {
            kubectl::ok(&["get", "validatingadmissionpolicy", &policy, "-o", "yaml"])
                .unwrap_or_default()
        },
        || async {
            let out = kubectl::ok(&[
                "get",
                "validatingadmissionpolicy",
                &policy,
                "-o",
                "jsonpath={.status.observedGeneration} {.status.typeChecking}",
            ])?;
            Ok((!out.trim().is_empty() && !out.starts_with(' ')).then_some(out))
        },
    )
    .await
    .unwrap();
    assert!(!warnings.contains("expressionWarnings"), "{warnings}");

    let sa = format!("{release}-batchlease-operator");
    let dir = PrivateDir::new(n).unwrap();
    let op_kc = kubectl::service_account_kubeconfig(n, &sa, &dir).unwrap();
    let op =
        Operator::start_with(n, "op", vec![format!("--kubeconfig={}", op_kc.display())]).unwrap();
    op.wait_leading(Duration::from_secs(30)).await.unwrap();

    let role = format!("{sa}-worker");
    let a_kc = chart::worker_pod(&ns, &role, "wa", &dir).await.unwrap();
    let b_kc = chart::worker_pod(&ns, &role, "wb", &dir).await.unwrap();
    let as_a: Api<TaskLease> = Api::namespaced(client_for(&a_kc).await, n);
    let as_b: Api<TaskLease> = Api::namespaced(client_for(&b_kc).await, n);

    let payload = json!({"steps": 1, "stepMillis": 10});
    tasks::create(&ns, "job", json!({"queue": "demo", "payload": payload}))
        .await
        .unwrap();
    tasks::create(
        &ns,
        "silent",
        json!({"queue": "demo", "leaseDurationSeconds": 5, "payload": payload}),
    )
    .await
    .unwrap();
    let logs = || op.logs();
    let offered = wait_lease(
        &ns,
        "job-1",
        LeasePhase::Offered,
        Duration::from_secs(30),
        logs,
    )
    .await
    .unwrap();

    // The binding takes effect once the API server has loaded it: probe
    // with dry runs (admission runs on them; nothing is stored) until A's
    // claim in B's name is refused.
    wait_for(
        "the holder-only policy in force",
        Duration::from_secs(30),
        || {
            kubectl::ok(&[
                "get",
                "validatingadmissionpolicybinding",
                &policy,
                "-o",
                "yaml",
            ])
            .unwrap_or_default()
        },
        || {
            let (as_a, l) = (as_a.clone(), claim(offered.clone(), "wb/1"));
            async move { Ok(write(&as_a, &l, true).await.err().filter(|s| s.code == 403)) }
        },
    )
    .await
    .unwrap();

    // A claim must name the claimant, and nobody but the operator
    // withdraws an offer.
    assert_denied(
        write(&as_a, &claim(offered.clone(), "wb/1"), false).await,
        "a claim must name the claimant: spec.holderIdentity must be wa/<suffix>",
    );
    assert_denied(
        write(&as_a, &claim(offered.clone(), "wa"), false).await,
        "a claim must name the claimant",
    );
    let mut released = offered.clone();
    released.status.get_or_insert_with(Default::default).phase = Some(LeasePhase::Released);
    assert_denied(
        write(&as_a, &released, false).await,
        "a worker may write an Offered lease only to claim it (phase Held), not leave it Released",
    );
    // Naming itself holder while leaving the lease Offered would make the
    // holder set-once and wedge the offer for everyone else.
    let mut squatted = offered.clone();
    squatted.spec.holder_identity = Some("wa/1".into());
    assert_denied(write(&as_a, &squatted, false).await, "not leave it Offered");
    // Nor may a worker address an offer to itself: not with its claim
    // (the CRD: the address is fixed from the claim on), not before it
    // (this policy: an offer is written only to claim it).
    let mut self_addressed = claim(offered.clone(), "wa/1");
    self_addressed.spec.offered_to = Some("wa/1".into());
    let s = write(&as_a, &self_addressed, false)
        .await
        .expect_err("a claim that changes offeredTo");
    assert!(
        s.code == 422
            && s.message
                .contains("offeredTo may change only while the lease is unclaimed"),
        "{s:?}"
    );
    let mut readdressed = offered.clone();
    readdressed.spec.offered_to = Some("wa/1".into());
    assert_denied(
        write(&as_a, &readdressed, false).await,
        "not leave it Offered",
    );
    // Without a pod-bound token the principal is `user:<user name>`: no
    // user can pass for a pod.
    let plain_kc = kubectl::service_account_kubeconfig(n, "worker", &dir).unwrap();
    let as_plain: Api<TaskLease> = Api::namespaced(client_for(&plain_kc).await, n);
    assert_denied(
        write(&as_plain, &claim(offered.clone(), "wb/1"), false).await,
        &format!(
            "spec.holderIdentity must be user:system:serviceaccount:{n}:worker/<suffix>, not wb/1"
        ),
    );

    // B claims; from now on only B writes it.
    let held = write(&as_b, &claim(offered, "wb/1"), false).await.unwrap();
    assert_denied(
        write(&as_a, &renew(held.clone()), false).await,
        "lease job-1 is held by wb/1; only its holder may renew, complete or release it (you are wa)",
    );
    assert_denied(
        write(&as_a, &complete(held.clone()), false).await,
        "held by wb/1",
    );
    // Not even the holder may touch what is not the claim's.
    let mut labelled = held.clone();
    labelled.labels_mut().insert("stolen".into(), "yes".into());
    assert_denied(
        write(&as_b, &labelled, false).await,
        "workers may not change a lease's owner references, finalizers or labels",
    );
    let mut finalized = held.clone();
    finalized.finalizers_mut().push("example.com/keep".into());
    assert_denied(write(&as_b, &finalized, false).await, "finalizers");
    let renewed = write(&as_b, &renew(held), false).await.unwrap();
    write(&as_b, &complete(renewed), false).await.unwrap();
    wait_phase(
        &ns,
        "job",
        TaskPhase::Succeeded,
        Duration::from_secs(30),
        || op.logs(),
    )
    .await
    .unwrap();

    // The operator expires a lease B holds and stopped renewing: a write to
    // a Held lease by someone other than its holder, which the policy lets
    // through for the operator's ServiceAccount only.
    let silent = wait_lease(
        &ns,
        "silent-1",
        LeasePhase::Offered,
        Duration::from_secs(30),
        || op.logs(),
    )
    .await
    .unwrap();
    write(&as_b, &claim(silent, "wb/2"), false).await.unwrap();
    let expired = wait_lease(
        &ns,
        "silent-1",
        LeasePhase::Expired,
        Duration::from_secs(30),
        || op.logs(),
    )
    .await
    .unwrap();
    assert_eq!(expired.spec.holder_identity.as_deref(), Some("wb/2"));

    // A demo worker in pod wa, on wa's token, with the SDK's default
    // identity (POD_NAME/<suffix>): the policy lets its claim, renewals and
    // completion through, and the re-issued task succeeds.
    let _db = batchlease_e2e::pg::connect().await.unwrap();
    let opts = WorkerOpts {
        kubeconfig: Some(a_kc.clone()),
        pod_name: Some("wa".into()),
        ..Default::default()
    };
    let worker = workers::start(n, "wa", &opts).unwrap();
    let done = wait_phase(
        &ns,
        "silent",
        TaskPhase::Succeeded,
        Duration::from_secs(60),
        || format!("{}{}", op.logs(), worker.logs()),
    )
    .await
    .unwrap();
    let history = done.status.unwrap().history;
    let last = history
        .last()
        .and_then(|h| h.holder.clone())
        .unwrap_or_default();
    assert!(last.starts_with("wa/"), "{history:?}");

    // The worker's presence record is refused by RBAC here (the chart's
    // worker role grants it only with workerRole.presenceRecords): that one
    // warning is expected; nothing else may be refused.
    let logs: String = format!("{}{}", op.logs(), worker.logs())
        .to_lowercase()
        .lines()
        .filter(|l| !l.contains("presence record"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert!(
        !logs.contains("forbidden") && !logs.contains("denied"),
        "{logs}"
    );
    worker_leases_are_written_by_their_holder_only(n, &a_kc, &b_kc).await;
    helm::ok(&["uninstall", &release, "-n", n]).unwrap();
    ns.cleanup().await.unwrap();
}

/// The second policy: a worker creates, renews and deletes only its own
/// WorkerLease; its status (revocations) is the operator's, by RBAC.
async fn worker_leases_are_written_by_their_holder_only(n: &str, a_kc: &Path, b_kc: &Path) {
    use batchlease_api::worker_lease::worker_lease_name;
    use batchlease_api::{WorkerLease, WorkerLeaseSpec};
    let as_a: Api<WorkerLease> = Api::namespaced(client_for(a_kc).await, n);
    let as_b: Api<WorkerLease> = Api::namespaced(client_for(b_kc).await, n);
    let object = |holder: &str| {
        WorkerLease::new(
            &worker_lease_name(holder),
            WorkerLeaseSpec {
                holder_identity: holder.into(),
                queues: vec!["demo".into()],
                lease_duration_seconds: 30,
                renew_time: Some(MicroTime(k8s_openapi::jiff::Timestamp::now())),
                holds: vec![],
                slots: None,
                takes_bound: None,
            },
        )
    };
    let denied = |r: Result<WorkerLease, kube::Error>, needle: &str| match r {
        Err(kube::Error::Api(s)) => {
            assert_eq!(s.code, 403, "{s:?}");
            assert!(
                s.message.contains(needle),
                "denial should say why ({needle}): {}",
                s.message
            );
        }
        other => panic!("the write should have been denied: {other:?}"),
    };
    let pp = PostParams::default();
    // A's own: created and renewed.
    let mine = as_a.create(&pp, &object("wa/1")).await.unwrap();
    let mut renewed = mine.clone();
    renewed.spec.renew_time = Some(MicroTime(k8s_openapi::jiff::Timestamp::now()));
    let mine = as_a.replace(&mine.name_any(), &pp, &renewed).await.unwrap();
    // B may not renew it, delete it, or create one in A's name.
    denied(
        as_b.replace(&mine.name_any(), &pp, &mine).await,
        "belongs to wa/1; only that worker may write or delete it (you are wb)",
    );
    match as_b.delete(&mine.name_any(), &Default::default()).await {
        Err(kube::Error::Api(s)) => {
            assert_eq!(s.code, 403, "{s:?}");
            assert!(s.message.contains("belongs to wa/1"), "{}", s.message);
        }
        other => panic!("B deleted A's WorkerLease: {other:?}"),
    }
    denied(as_b.create(&pp, &object("wa/2")).await, "belongs to wa/2");
    // The revocations are the operator's: workers have no RBAC for status.
    let mut revoked = mine.clone();
    revoked.revoke(batchlease_api::AttemptRef {
        name: "job-1".into(),
        uid: "u".into(),
    });
    match as_a.replace_status(&mine.name_any(), &pp, &revoked).await {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 403, "{s:?}"),
        other => panic!("a worker wrote its WorkerLease's status: {other:?}"),
    }
    // A deletes its own.
    as_a.delete(&mine.name_any(), &Default::default())
        .await
        .unwrap();
}
