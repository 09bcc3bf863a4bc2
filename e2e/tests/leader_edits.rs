//! The election Lease edited under two replicas (issue 23): deleted, as
//! `kubectl delete leases --all` does; its duration shrunk to 1 s and its
//! holder set to the standby; two replicas given the same `--identity`.
//! While a stream of tasks keeps the leader writing, the API server's audit
//! log (one client certificate per replica) must show that no two replicas
//! wrote in overlapping terms, and that the Lease was taken only after a
//! full duration (6 s in these tests) of the edited state.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use batchlease_api::{BatchTask, TaskLease};
use batchlease_e2e::operator::Operator;
use batchlease_e2e::{TestNamespace, audit, wait_for};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;

const T: Duration = Duration::from_secs(60);
/// The test replicas' lease duration.
const DURATION: f64 = 6.0;
/// The test replicas renew every term/3 = 1.33 s; a deposed leader learns
/// of it at its next renewal. Allow that, one request, and scheduling.
const NOTICE: f64 = 3.0;
/// The test process and the API server read the same host clock; their
/// timestamps differ by the request's own time.
const SLACK: f64 = 0.3;
const LEASE: &str = "batchlease-operator";

/// Wall-clock seconds (the audit log's clock).
fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// Two replicas, `op-a` leading and `op-b` standing by (ready), with
/// `extra` flags each.
async fn two_replicas(
    ns: &TestNamespace,
    a_extra: Vec<String>,
    b_extra: Vec<String>,
) -> (Operator, Operator) {
    let a = Operator::start_with(&ns.name, "op-a", a_extra).unwrap();
    a.wait_leading(T).await.unwrap();
    let b = Operator::start_with(&ns.name, "op-b", b_extra).unwrap();
    wait_for(
        "standby op-b ready",
        T,
        || b.logs(),
        || async { Ok((b.get("/readyz").await.map(|r| r.0).unwrap_or(0) == 200).then_some(())) },
    )
    .await
    .unwrap();
    (a, b)
}

/// Keeps the leader writing: a task every 250 ms (nobody claims them, so
/// each is offered, and offered again after its 5 s lease expires).
fn load(ns: &TestNamespace) -> tokio::task::JoinHandle<()> {
    let api: Api<BatchTask> = ns.api();
    tokio::spawn(async move {
        for i in 0.. {
            let task: BatchTask = serde_json::from_value(json!({
                "apiVersion": "batchlease.dev/v1alpha1", "kind": "BatchTask",
                "metadata": {"name": format!("job-{i}")},
                "spec": {"queue": "q", "leaseDurationSeconds": 5},
            }))
            .unwrap();
            if let Err(e) = api.create(&PostParams::default(), &task).await {
                eprintln!("creating job-{i}: {e}");
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    })
}

/// Waits until the new term has issued `n` more leases for the load than
/// there are now (instead of letting it write "for a while").
async fn wait_new_term_writes(ns: &TestNamespace, ops: [&Operator; 2], n: usize) {
    let leases: Api<TaskLease> = ns.api();
    let before = leases.list(&Default::default()).await.unwrap().items.len();
    wait_for(
        "the new term to issue leases",
        T,
        || format!("{}{}", ops[0].logs(), ops[1].logs()),
        || {
            let leases = leases.clone();
            async move {
                Ok(
                    (leases.list(&Default::default()).await?.items.len() >= before + n)
                        .then_some(()),
                )
            }
        },
    )
    .await
    .unwrap();
}

/// Waits until the leader `op` issued leases for the load.
async fn wait_writing(ns: &TestNamespace, op: &Operator) {
    let leases: Api<TaskLease> = ns.api();
    wait_for(
        "the leader to issue leases",
        T,
        || op.logs(),
        || {
            let leases = leases.clone();
            async move { Ok((leases.list(&Default::default()).await?.items.len() >= 3).then_some(())) }
        },
    )
    .await
    .unwrap();
}

/// Whether replica `op` leads now (its metric).
async fn leads(op: &Operator) -> bool {
    op.metric("batchlease_is_leader").await.ok().flatten() == Some(1.0)
}

/// The replicas' users in the audit log.
fn replica_users() -> [String; 2] {
    [Operator::user("op-a"), Operator::user("op-b")]
}

/// When the API server applied the edit (the first write of the election
/// Lease by someone else than the replicas from `before` on: a renewal may
/// land between `before` and it).
fn edit_time(writes: &[audit::Write], before: f64) -> f64 {
    let users = replica_users();
    writes
        .iter()
        .find(|w| w.at >= before - SLACK && w.resource == "leases" && !users.contains(&w.user))
        .map_or(before, |w| w.at)
}

/// The first update of the election Lease by a replica after `edited`:
/// the next term's start (a replica creates a missing Lease vacated, which
/// is no term; a renewal after the edit fails: the version changed).
fn first_take(writes: &[audit::Write], edited: f64) -> Option<audit::Write> {
    let users = replica_users();
    writes
        .iter()
        .find(|w| {
            w.at > edited && w.resource == "leases" && w.verb == "update" && users.contains(&w.user)
        })
        .cloned()
}

/// Waits until a replica took the Lease after the edit made at `before`
/// (audit log) and leads.
async fn wait_new_leader(ns: &TestNamespace, ops: [&Operator; 2], before: f64) {
    let name = ns.name.clone();
    wait_for(
        "a replica to take the Lease after the edit",
        T,
        || format!("{}\n{}", ops[0].logs(), ops[1].logs()),
        || {
            let name = name.clone();
            async move {
                let writes = audit::writes_in(&name)?;
                let took = first_take(&writes, edit_time(&writes, before)).is_some();
                let any = leads(ops[0]).await || leads(ops[1]).await;
                Ok((took && any).then_some(()))
            }
        },
    )
    .await
    .unwrap();
}

/// From the audit log, after the edit: the first update of the election
/// Lease by a replica (the next term's start) — no sooner than a full
/// duration after the edit — and no write of objects by any other replica
/// after it, nor by the taker between its own notice of the edit and it.
/// Returns the taker.
fn assert_one_writer_at_a_time(ns: &str, before: f64) -> String {
    let writes = audit::writes_in(ns).unwrap();
    let users = replica_users();
    let edited = edit_time(&writes, before);
    let took =
        first_take(&writes, edited).expect("a replica took the election Lease after the edit");
    let objects: Vec<_> = writes
        .iter()
        .filter(|w| w.at > edited && w.resource != "leases" && users.contains(&w.user))
        .collect();
    let report = || {
        format!(
            "edited at {edited:.3}, {} took the Lease at {:.3} ({:.3} s later); writes after the edit:\n{}",
            took.user,
            took.at,
            took.at - edited,
            writes
                .iter()
                .filter(|w| w.at > edited)
                .map(|w| format!(
                    "  {:.3} {} {} {} {}",
                    w.at - edited,
                    w.user,
                    w.verb,
                    w.resource,
                    w.name
                ))
                .collect::<Vec<_>>()
                .join("\n")
        )
    };
    assert!(
        took.at >= edited + DURATION - SLACK,
        "the Lease was taken before a full duration of the edited state: {}",
        report()
    );
    // The other replica: nothing once the taker's term began.
    let overlap: Vec<_> = objects
        .iter()
        .filter(|w| w.user != took.user && w.at >= took.at)
        .collect();
    assert!(
        overlap.is_empty(),
        "two replicas wrote: {overlap:?}\n{}",
        report()
    );
    // The taker: nothing between its notice of the edit and its new term
    // (it either stood by all along, or was the leader deposed by the edit).
    let early: Vec<_> = objects
        .iter()
        .filter(|w| w.user == took.user && w.at > edited + NOTICE && w.at < took.at)
        .collect();
    assert!(
        early.is_empty(),
        "wrote outside a term: {early:?}\n{}",
        report()
    );
    took.user
}

/// `kubectl delete leases --all -n <ns>`: the old leader's renewal finds no
/// Lease and its term ends at once; a replica creates it again at once but
/// vacated, and takes it only after a full duration of that version, so the
/// old term is over by then.
#[tokio::test]
async fn deleting_the_election_lease_never_gives_two_leaders() {
    let cluster = batchlease_e2e::Cluster::with_crds().await.unwrap();
    let ns = cluster.namespace("lease-deleted").await.unwrap();
    let (a, b) = two_replicas(&ns, Vec::new(), Vec::new()).await;
    let load = load(&ns);
    wait_writing(&ns, &a).await;
    let leases: Api<Lease> = ns.api();
    let edited = now();
    leases
        .delete_collection(&DeleteParams::default(), &Default::default())
        .await
        .unwrap();
    wait_new_leader(&ns, [&a, &b], edited).await;
    wait_new_term_writes(&ns, [&a, &b], 3).await;
    load.abort();
    assert_one_writer_at_a_time(&ns.name, edited);
    // The whole log: `logs()` is only its last lines, which the new
    // term's writes push the line out of.
    let a_log = std::fs::read_to_string(a.log_path()).unwrap_or_default();
    assert!(a_log.contains("the leader lease is gone"), "{}", a.logs());
    ns.cleanup().await.unwrap();
}

/// The Lease's duration shrunk to 1 s and its holder set to the standby's
/// own identity (read from its log): the leader is deposed at its next
/// renewal, and the standby — which does not lead, whatever the Lease
/// names — takes it only after its own 6 s of the edited state.
#[tokio::test]
async fn a_shrunk_lease_handed_to_the_standby_is_waited_out() {
    let cluster = batchlease_e2e::Cluster::with_crds().await.unwrap();
    let ns = cluster.namespace("lease-edited").await.unwrap();
    let (a, b) = two_replicas(&ns, Vec::new(), Vec::new()).await;
    let b_identity = identity_of(&b);
    let load = load(&ns);
    wait_writing(&ns, &a).await;
    let leases: Api<Lease> = ns.api();
    let edited = now();
    leases
        .patch(
            LEASE,
            &PatchParams::default(),
            &Patch::Merge(
                json!({"spec": {"holderIdentity": b_identity, "leaseDurationSeconds": 1}}),
            ),
        )
        .await
        .unwrap();
    wait_new_leader(&ns, [&a, &b], edited).await;
    wait_new_term_writes(&ns, [&a, &b], 3).await;
    load.abort();
    assert_one_writer_at_a_time(&ns.name, edited);
    ns.cleanup().await.unwrap();
}

/// Two replicas started with the same `--identity`: each gets its own
/// suffix, so only one leads (before, both "held" the Lease and led).
#[tokio::test]
async fn two_replicas_configured_with_one_identity_never_both_lead() {
    let cluster = batchlease_e2e::Cluster::with_crds().await.unwrap();
    let ns = cluster.namespace("same-identity").await.unwrap();
    let same = vec!["--identity=op".to_owned()];
    let (a, b) = two_replicas(&ns, same.clone(), same).await;
    let load = load(&ns);
    // Two renewal periods of each, sampled: never both leading.
    let until = tokio::time::Instant::now() + Duration::from_secs(4);
    while tokio::time::Instant::now() < until {
        let (la, lb) = (leads(&a).await, leads(&b).await);
        assert!(!(la && lb), "both lead\n{}\n{}", a.logs(), b.logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    load.abort();
    assert_ne!(identity_of(&a), identity_of(&b));
    let writes = audit::writes_in(&ns.name).unwrap();
    let b_wrote: Vec<_> = writes
        .iter()
        .filter(|w| w.user == Operator::user("op-b"))
        .collect();
    assert!(b_wrote.is_empty(), "the standby wrote: {b_wrote:?}");
    ns.cleanup().await.unwrap();
}

/// A replica's election identity, from its start-up log line.
fn identity_of(op: &Operator) -> String {
    let logs = op.logs();
    let line = logs
        .lines()
        .find(|l| l.contains("starting batchlease-operator"))
        .unwrap_or_else(|| panic!("no start-up line:\n{logs}"));
    let rest = &line[line.find("identity=").expect("identity field") + "identity=".len()..];
    rest.split_whitespace()
        .next()
        .unwrap_or_default()
        .to_owned()
}
