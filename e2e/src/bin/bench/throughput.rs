//! Throughput against the API server's own limit (issue 12 item 6): raw
//! writes with the same client and concurrency (ConfigMap creates,
//! BatchTask creates, BatchTask status updates — the operator's commonest
//! write), then tasks end to end with the writes the API server counted
//! per task, and the ratio of the two.

use anyhow::Context;
use batchlease_api::BatchTask;
use batchlease_e2e::conformance::Kind;
use batchlease_e2e::{Cluster, api_requests};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, PostParams};
use serde_json::json;
use tokio::time::Instant;

use crate::common::{
    component_pid, cpu_seconds, create_all, create_tasks, emit, run_tasks_counted,
};

/// The raw rate the end-to-end phase is compared with.
pub struct Raw {
    /// BatchTask status updates per second.
    pub status_updates: f64,
}

/// `n` of each raw write, `conc` at a time, no operator anywhere.
pub async fn raw(
    cluster: &Cluster,
    n: usize,
    conc: usize,
    report: &mut String,
) -> anyhow::Result<Raw> {
    let ns = cluster.namespace("bench-raw").await?;
    let cms: Api<ConfigMap> = ns.api();
    let start = Instant::now();
    create_all(&cms, n, conc, |i| {
        json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": format!("cm-{i:05}")}, "data": {"k": "v"}})
    })
    .await?;
    let configmap_creates = n as f64 / start.elapsed().as_secs_f64();
    ns.cleanup().await?;

    // BatchTask creates with no operator: the CRD's own cost (schema, CEL).
    let ns = cluster.namespace("bench-crd").await?;
    let start = Instant::now();
    create_tasks(&ns, "raw", n, "nobody", conc).await?;
    let task_creates = n as f64 / start.elapsed().as_secs_f64();

    // One status update per task, as the operator writes them: a PUT of
    // the status subresource carrying the resourceVersion just read.
    let tasks: Api<BatchTask> = ns.api();
    let list = tasks.list(&Default::default()).await?;
    let apiserver = component_pid("kube-apiserver");
    let cpu0 = apiserver.and_then(cpu_seconds);
    anyhow::ensure!(
        list.items.len() == n,
        "{} of {n} raw tasks listed",
        list.items.len()
    );
    let start = Instant::now();
    futures::stream::iter(list.items)
        .map(|mut t| {
            let tasks = tasks.clone();
            async move {
                let name = t.metadata.name.clone().unwrap_or_default();
                let mut status = t.status.take().unwrap_or_default();
                status.observed_generation = Some(1);
                t.status = Some(status);
                tasks
                    .replace_status(&name, &PostParams::default(), &t)
                    .await
                    .with_context(|| format!("status update of {name}"))?;
                Ok::<_, anyhow::Error>(())
            }
        })
        .buffer_unordered(conc)
        .try_collect::<Vec<_>>()
        .await?;
    let status_updates = n as f64 / start.elapsed().as_secs_f64();
    // The API server's CPU per raw status update, to set beside its CPU
    // per task end to end.
    let status_update_cpu_ms = apiserver
        .and_then(cpu_seconds)
        .zip(cpu0)
        .map(|(b, a)| (b - a) * 1000.0 / n as f64);
    ns.cleanup().await?;
    emit(
        report,
        &format!(
            "raw API writes, {n} each, concurrency {conc}, no operator: ConfigMap creates {configmap_creates:.0}/s; \
             BatchTask creates {task_creates:.0}/s ({:.2}× ConfigMap); BatchTask status updates (PUT with resourceVersion) {status_updates:.0}/s, \
             kube-apiserver CPU {} per update\n",
            task_creates / configmap_creates,
            status_update_cpu_ms.map_or_else(|| "n/a".into(), |m| format!("{m:.2} ms")),
        ),
    );
    Ok(Raw { status_updates })
}

/// `n` no-op tasks end to end; writes and 409s per task counted by the API
/// server; with `raw`, the ratio of tasks/s to the rate the raw status
/// updates allow at the counted writes per task.
pub async fn end_to_end(
    cluster: &Cluster,
    n: usize,
    conc: usize,
    raw: Option<&Raw>,
    report: &mut String,
) -> anyhow::Result<()> {
    let (task_rate, requests, cpu) = run_tasks_counted(
        cluster,
        "bench-e2e",
        n,
        conc,
        Kind::RustSdk,
        |_| json!({"queue": "demo", "payload": {"steps": 0, "stepMillis": 0}}),
    )
    .await?;
    emit(
        report,
        &format!(
            "end-to-end: {n} no-op tasks (operator + 2 demo workers × 8 slots + fenced PostgreSQL commit): {task_rate:.1} tasks/s\n\
             CPU during the run: {}\n",
            cpu.line(n)
        ),
    );
    // The protocol's writes (tasks and their status, leases), the user's
    // create included; Events and Leases in rows of their own.
    let (table, writes, conflicts) =
        api_requests::per_task(&requests, n, &["batchtasks", "taskleases"]);
    emit(
        report,
        &format!(
            "API writes counted by the API server (apiserver_request_total), per task:\n{table}\
             protocol writes per task (batchtasks + taskleases, the user's create included): {writes:.2} \
             ({:.2} beyond the create); 409 conflicts per task: {conflicts:.2}\n",
            writes - 1.0
        ),
    );
    if let Some(raw) = raw {
        let limit = raw.status_updates / writes;
        emit(
            report,
            &format!(
                "limit at {writes:.2} writes per task and {:.0} raw status updates/s: {limit:.1} tasks/s; \
                 achieved {task_rate:.1} tasks/s; ratio {:.2}\n",
                raw.status_updates,
                task_rate / limit
            ),
        );
    }
    Ok(())
}

/// No-op tasks end to end for each kind of worker (`conformance::KINDS`),
/// side by side on one control plane: two workers × 8 slots of the kind,
/// each task the conformance behaviour with no steps — a registration, one
/// fenced effect and a completion (for `batchlease-run`, a shell script
/// with `python3` and `psql` started per task: the price of a command).
pub async fn kinds(
    cluster: &Cluster,
    n: usize,
    conc: usize,
    report: &mut String,
) -> anyhow::Result<()> {
    let mut rates = Vec::new();
    for kind in batchlease_e2e::conformance::KINDS {
        let prefix = format!("bench-kind-{}", kind.label());
        let (rate, _, cpu) = run_tasks_counted(
            cluster,
            &prefix,
            n,
            conc,
            kind,
            |_| json!({"queue": kind.queue(), "payload": {"steps": 0, "stepMillis": 0}}),
        )
        .await?;
        eprintln!("{kind:?}: {rate:.1} tasks/s");
        rates.push((kind, rate, cpu));
    }
    let base = rates.first().map_or(1.0, |r| r.1);
    let mut line = format!("worker kinds ({n} no-op tasks each, 2 workers × 8 slots):");
    for (kind, rate, cpu) in &rates {
        line.push_str(&format!(
            " {}: {rate:.1} tasks/s ({:.2}× the Rust SDK; workers {:.1} ms CPU/task);",
            kind.label(),
            rate / base,
            cpu.workers * 1000.0 / n.max(1) as f64,
        ));
    }
    line.push('\n');
    emit(report, &line);
    Ok(())
}
