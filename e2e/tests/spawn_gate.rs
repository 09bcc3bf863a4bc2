//! Spawning after the parent ended (issue 22, point 5): a worker that
//! passed its fence check and was paused before its create landed sends
//! the create when it resumes — after its parent was Cancelled. The
//! operator must never issue that child a lease.
//!
//! The paused worker is played by the test: it claims the parent's lease
//! (its fence holds), creates one sub-graph while it holds it (admitted:
//! the control), checks its fence again — the lease is still held — and
//! "pauses" while the parent is cancelled and ends `Cancelled`; then it
//! "resumes" and sends the second create. The creates are the SDK's own
//! (`create_children`, what `ctx.spawn` runs after its fence check), so the
//! child objects are exactly those a real worker sends. A real worker
//! paused by SIGSTOP between the check and the create does not make the
//! create land reliably: on resume its kill switch drops the handler, and
//! whether the request already left the client races with that drop
//! (which is the SDK doing its job) — the late create the operator must
//! stand up to is one that left before the pause, held in the network.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use batchlease_api::keys::condition;
use batchlease_api::{BatchTask, BatchTaskSpec, LeasePhase, TaskLease, TaskPhase};
use batchlease_e2e::operator::Operator;
use batchlease_e2e::tasks::{self, event_reasons, wait_lease, wait_phase};
use batchlease_e2e::{Cluster, wait_for, worker};
use batchlease_worker_sdk::{Child, Parent, Subgraph, create_children};
use kube::api::{Patch, PatchParams};
use serde_json::json;

const TTL: u64 = 5;
const T: Duration = Duration::from_secs(60);

/// One child on a queue no worker serves (an admitted child is issued a
/// lease and stays `Ready`: enough to tell admitted from refused).
fn one_child(version: &str) -> Subgraph {
    Subgraph::new(version).child(Child::new(BatchTaskSpec::for_queue("nobody")))
}

#[tokio::test]
async fn a_child_created_after_its_parent_was_cancelled_never_gets_a_lease() {
    let (ns, op) = Operator::in_new_namespace("spawn-late", "op", Duration::from_secs(30))
        .await
        .unwrap();
    let client = Cluster::connect().await.unwrap().client;
    tasks::create(
        &ns,
        "parent",
        json!({"queue": "zombie", "leaseDurationSeconds": TTL}),
    )
    .await
    .unwrap();
    let uid = tasks::uid(&ns, "parent").await.unwrap();
    let parent = Parent {
        namespace: &ns.name,
        name: "parent",
        uid: &uid,
    };
    let leases = ns.api::<TaskLease>();
    let offered = wait_lease(&ns, "parent-1", LeasePhase::Offered, T, || op.logs())
        .await
        .unwrap();
    worker::claim(&leases, &offered, "paused-worker")
        .await
        .unwrap();
    let fence_holds = || async {
        let l = leases.get("parent-1").await.unwrap();
        assert_eq!(
            (tasks::lease_phase(&l), l.spec.holder_identity.as_deref()),
            (Some(LeasePhase::Held), Some("paused-worker")),
            "the fence holds"
        );
    };

    // While the lease is held: created, admitted, issued.
    fence_holds().await;
    let (early, _) = create_children(&client, &parent, &one_child("v1"), || Ok(()))
        .await
        .unwrap();
    wait_lease(
        &ns,
        &format!("{}-1", early[0]),
        LeasePhase::Offered,
        T,
        || op.logs(),
    )
    .await
    .unwrap();

    // The fence check of the next create passes; then the worker pauses,
    // and the parent is cancelled and ends.
    fence_holds().await;
    ns.api::<BatchTask>()
        .patch(
            "parent",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"cancel": true}})),
        )
        .await
        .unwrap();
    wait_phase(
        &ns,
        "parent",
        TaskPhase::Cancelled,
        Duration::from_secs(TTL * 4),
        || op.logs(),
    )
    .await
    .unwrap();

    // The worker resumes: its create lands after the parent ended.
    let (late, created) = create_children(&client, &parent, &one_child("v2"), || Ok(()))
        .await
        .unwrap();
    assert_eq!(created, 1, "the late create made a new child");
    let late = late[0].clone();
    let t = wait_phase(&ns, &late, TaskPhase::Rejected, T, || op.logs())
        .await
        .unwrap();
    let st = t.status.unwrap();
    assert_eq!(st.fencing_token, 0, "never issued: {st:?}");
    let refused = st
        .conditions
        .iter()
        .find(|c| c.type_ == condition::SPAWN_REFUSED)
        .expect("a SpawnRefused condition");
    assert_eq!(
        (refused.status.as_str(), refused.reason.as_str()),
        ("True", "ParentFinished")
    );
    assert!(
        refused.message.contains("parent parent ended Cancelled"),
        "{}",
        refused.message
    );
    wait_for(
        "the ParentFinished Event",
        T,
        || op.logs(),
        || {
            let (ns, late) = (&ns, &late);
            async move {
                let reasons = event_reasons(ns, late).await?;
                Ok(reasons.iter().any(|r| r == "ParentFinished").then_some(()))
            }
        },
    )
    .await
    .unwrap();

    // Nothing was ever issued to it: no lease of it in the whole recorded
    // history, and the child created in time still has its offer.
    let (recorded, _) = ns.recorded().await.unwrap();
    let issued: Vec<String> = recorded
        .iter()
        .filter_map(|r| match &r.change {
            batchlease_e2e::history::Change::Lease(l) if l.spec.task_name == late => {
                Some(kube::ResourceExt::name_any(&**l))
            }
            _ => None,
        })
        .collect();
    assert!(issued.is_empty(), "leases of the late child: {issued:?}");
    let early_status = tasks::status(&ns, &early[0]).await.unwrap();
    assert_eq!(
        early_status.phase,
        Some(TaskPhase::Ready),
        "{early_status:?}"
    );
    ns.cleanup().await.unwrap();
}
