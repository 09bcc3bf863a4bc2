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

/// The raw rate the end-to-end phase is compared with, and what the API
/// server's CPU costs per request of each kind, to decompose its CPU per
/// task.
pub struct Raw {
    /// BatchTask status updates per second.
    pub status_updates: f64,
    /// kube-apiserver CPU per status update (ms).
    pub write_ms: Option<f64>,
    /// kube-apiserver CPU per GET of a BatchTask (ms).
    pub read_ms: Option<f64>,
    /// kube-apiserver CPU per watch event sent (ms), from status updates
    /// with [`WATCHERS`] watches open, less the updates' own cost.
    pub event_ms: Option<f64>,
}

/// The watches open during the calibration of a watch event's cost.
const WATCHERS: usize = 8;

/// One status update of each of `items`, `conc` at a time.
async fn update_statuses(
    tasks: &Api<BatchTask>,
    items: Vec<BatchTask>,
    conc: usize,
    generation: i64,
) -> anyhow::Result<()> {
    futures::stream::iter(items)
        .map(|mut t| {
            let tasks = tasks.clone();
            async move {
                let name = t.metadata.name.clone().unwrap_or_default();
                let mut status = t.status.take().unwrap_or_default();
                status.observed_generation = Some(generation);
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
    Ok(())
}

/// kube-apiserver CPU ms per unit of `n` over what `f` did.
async fn apiserver_ms<F: std::future::Future<Output = anyhow::Result<()>>>(
    n: usize,
    f: F,
) -> anyhow::Result<Option<f64>> {
    let apiserver = component_pid("kube-apiserver");
    let cpu0 = apiserver.and_then(cpu_seconds);
    f.await?;
    Ok(apiserver
        .and_then(cpu_seconds)
        .zip(cpu0)
        .map(|(b, a)| (b - a) * 1000.0 / n.max(1) as f64))
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
    anyhow::ensure!(
        list.items.len() == n,
        "{} of {n} raw tasks listed",
        list.items.len()
    );
    let start = Instant::now();
    let status_update_cpu_ms =
        apiserver_ms(n, update_statuses(&tasks, list.items, conc, 1)).await?;
    let status_updates = n as f64 / start.elapsed().as_secs_f64();
    // A GET of each task, as a worker reads its task before a claim.
    let names: Vec<String> = (0..n).map(|i| format!("raw-{i:05}")).collect();
    let read_ms = apiserver_ms(n, async {
        futures::stream::iter(names)
            .map(|name| {
                let tasks = tasks.clone();
                async move { tasks.get(&name).await.context("raw GET") }
            })
            .buffer_unordered(conc)
            .try_collect::<Vec<_>>()
            .await?;
        Ok(())
    })
    .await?;
    // The same updates again with WATCHERS watches open: the difference is
    // what sending each event to each watcher costs.
    let event_ms = {
        let list = tasks.list(&Default::default()).await?;
        let seen = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let stop = tokio_util::sync::CancellationToken::new();
        for _ in 0..WATCHERS {
            let (tasks, seen, stop) = (tasks.clone(), seen.clone(), stop.clone());
            let wp = kube::api::WatchParams::default();
            let rv = list.metadata.resource_version.clone().unwrap_or_default();
            let mut stream = tasks.watch(&wp, &rv).await?.boxed();
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        () = stop.cancelled() => return,
                        ev = stream.next() => match ev {
                            Some(Ok(kube::api::WatchEvent::Modified(_))) => {
                                seen.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            }
                            Some(_) => {}
                            None => return,
                        },
                    }
                }
            });
        }
        let watched = apiserver_ms(n, async {
            update_statuses(&tasks, list.items, conc, 2).await?;
            batchlease_e2e::wait_for(
                "every watch to see every update",
                std::time::Duration::from_secs(300),
                || {
                    format!(
                        "{} of {} events seen",
                        seen.load(std::sync::atomic::Ordering::Relaxed),
                        n * WATCHERS
                    )
                },
                || async {
                    Ok(
                        (seen.load(std::sync::atomic::Ordering::Relaxed) >= n * WATCHERS)
                            .then_some(()),
                    )
                },
            )
            .await?;
            Ok(())
        })
        .await?;
        stop.cancel();
        watched
            .zip(status_update_cpu_ms)
            .map(|(w, u)| ((w - u) / WATCHERS as f64).max(0.0))
    };
    ns.cleanup().await?;
    emit(
        report,
        &format!(
            "raw API writes, {n} each, concurrency {conc}, no operator: ConfigMap creates {configmap_creates:.0}/s; \
             BatchTask creates {task_creates:.0}/s ({:.2}× ConfigMap); BatchTask status updates (PUT with resourceVersion) {status_updates:.0}/s; \
             kube-apiserver CPU per status update {}, per GET {}, per watch event sent {} (the updates again with {WATCHERS} watches open)\n",
            task_creates / configmap_creates,
            ms(status_update_cpu_ms),
            ms(read_ms),
            ms(event_ms),
        ),
    );
    Ok(Raw {
        status_updates,
        write_ms: status_update_cpu_ms,
        read_ms,
        event_ms,
    })
}

fn ms(v: Option<f64>) -> String {
    v.map_or_else(|| "n/a".into(), |m| format!("{m:.3} ms"))
}

/// `n` no-op tasks end to end, once with the workers renewing per lease
/// (today's protocol) and once per worker (bound attempts), side by side;
/// writes and 409s per task counted by the API server; with `raw`, the
/// ratio of tasks/s to the rate the raw status updates allow at the
/// counted writes per task.
pub async fn end_to_end(
    cluster: &Cluster,
    n: usize,
    conc: usize,
    raw: Option<&Raw>,
    report: &mut String,
) -> anyhow::Result<()> {
    for (per_worker, renewals) in [(false, "per lease"), (true, "per worker")] {
        end_to_end_one(cluster, n, conc, raw, per_worker, renewals, report).await?;
    }
    Ok(())
}

async fn end_to_end_one(
    cluster: &Cluster,
    n: usize,
    conc: usize,
    raw: Option<&Raw>,
    per_worker: bool,
    renewals: &str,
    report: &mut String,
) -> anyhow::Result<()> {
    let (task_rate, requests, cpu) = run_tasks_counted(
        cluster,
        "bench-e2e",
        n,
        conc,
        Kind::RustSdk,
        per_worker,
        |_| json!({"queue": "demo", "payload": {"steps": 0, "stepMillis": 0}}),
    )
    .await?;
    emit(
        report,
        &format!(
            "end-to-end, renewals {renewals}: {n} no-op tasks (operator + 2 demo workers × 8 slots + fenced PostgreSQL commit): {task_rate:.1} tasks/s\n\
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
        if let (Some(w), Some(r), Some(e)) = (raw.write_ms, raw.read_ms, raw.event_ms) {
            let n = n.max(1) as f64;
            let writes_all: f64 = requests
                .iter()
                .filter(|((verb, _, _), _)| api_requests::WRITES.contains(&verb.as_str()))
                .map(|(_, v)| v)
                .sum::<f64>()
                / n;
            let reads: f64 = requests
                .iter()
                .filter(|((verb, _, _), _)| matches!(verb.as_str(), "GET" | "LIST"))
                .map(|(_, v)| v)
                .sum::<f64>()
                / n;
            // Which reads: by resource and verb, per task.
            let mut by: std::collections::BTreeMap<(&str, &str), f64> = Default::default();
            for ((verb, resource, _), v) in &requests {
                if matches!(verb.as_str(), "GET" | "LIST") {
                    *by.entry((resource.as_str(), verb.as_str())).or_default() += v / n;
                }
            }
            let which = by
                .iter()
                .filter(|(_, v)| **v >= 0.01)
                .map(|((r, verb), v)| format!("{r} {verb} {v:.2}"))
                .collect::<Vec<_>>()
                .join(", ");
            let events = cpu.events_sent / n;
            let measured = cpu.apiserver * 1000.0 / n;
            let (pw, pr, pe) = (writes_all * w, reads * r, events * e);
            emit(
                report,
                &format!(
                    "kube-apiserver CPU per task {measured:.1} ms, decomposed at the raw phase's costs: writes {writes_all:.2} × {w:.2} ms = {pw:.1} ms; \
                     reads (GET, LIST) {reads:.2} × {r:.2} ms = {pr:.1} ms ({which}); watch events sent {events:.1} × {e:.3} ms = {pe:.1} ms; the rest {:.1} ms\n",
                    measured - pw - pr - pe,
                ),
            );
        }
        emit(
            report,
            &format!(
                "renewals {renewals}: limit at {writes:.2} writes per task and {:.0} raw status updates/s: {limit:.1} tasks/s; \
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
            false,
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
