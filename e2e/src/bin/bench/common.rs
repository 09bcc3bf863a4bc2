//! What every phase uses: bulk creates, counting, memory, the standard
//! operator + demo workers run, and the report.

use std::time::Duration;

use anyhow::Context;
use batchlease_api::{BatchTask, TaskPhase};
use batchlease_e2e::operator::Operator;
use batchlease_e2e::tasks::phase_of;
use batchlease_e2e::workers::{self, WorkerOpts};
use batchlease_e2e::{Cluster, TestNamespace, api_requests, pg, wait_for};
use futures::{StreamExt, TryStreamExt};
use kube::api::{Api, PostParams};
use serde_json::json;
use tokio::time::Instant;

pub async fn create_all<K>(
    api: &Api<K>,
    n: usize,
    conc: usize,
    object: impl Fn(usize) -> serde_json::Value,
) -> anyhow::Result<()>
where
    K: kube::Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    futures::stream::iter(0..n)
        .map(|i| {
            let api = api.clone();
            let obj = serde_json::from_value::<K>(object(i));
            async move {
                api.create(&PostParams::default(), &obj?)
                    .await
                    .context("create")?;
                Ok::<_, anyhow::Error>(())
            }
        })
        .buffer_unordered(conc)
        .try_collect::<Vec<_>>()
        .await?;
    Ok(())
}

pub async fn create_tasks(
    ns: &TestNamespace,
    prefix: &str,
    n: usize,
    queue: &str,
    conc: usize,
) -> anyhow::Result<()> {
    create_all(&ns.api::<BatchTask>(), n, conc, |i| {
        json!({
            "apiVersion": "batchlease.dev/v1alpha1", "kind": "BatchTask",
            "metadata": {"name": format!("{prefix}-{i:05}")},
            "spec": {"queue": queue, "payload": {"steps": 0, "stepMillis": 0}},
        })
    })
    .await
}

pub async fn count_phase(ns: &TestNamespace, phase: TaskPhase) -> anyhow::Result<usize> {
    let list = ns.api::<BatchTask>().list(&Default::default()).await?;
    Ok(list
        .items
        .iter()
        .filter(|t| phase_of(t) == Some(phase))
        .count())
}

pub fn rss_mib(pid: Option<u32>) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{}/status", pid?)).ok()?;
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kib / 1024.0)
}

/// Runs `n` tasks built by `spec(i)` to success with an operator and two
/// demo workers × 8 slots in a fresh namespace; tasks/s from the first
/// create to the last success.
pub async fn run_tasks(
    cluster: &Cluster,
    prefix: &str,
    n: usize,
    conc: usize,
    spec: impl Fn(usize) -> serde_json::Value,
) -> anyhow::Result<f64> {
    Ok(run_tasks_counted(cluster, prefix, n, conc, spec).await?.0)
}

/// [`run_tasks`], also returning the requests the API server counted from
/// the first create to the last task seen `Succeeded` (cluster-wide: the
/// control plane's own leader elections are in it too, as rows of their
/// own).
pub async fn run_tasks_counted(
    cluster: &Cluster,
    prefix: &str,
    n: usize,
    conc: usize,
    spec: impl Fn(usize) -> serde_json::Value,
) -> anyhow::Result<(f64, api_requests::Counts)> {
    let ns = cluster.namespace(prefix).await?;
    let _db = pg::connect().await?;
    let op = Operator::start_with(&ns.name, "op", vec!["--events=important".into()])?;
    op.wait_leading(Duration::from_secs(60)).await?;
    let opts = WorkerOpts {
        slots: 8,
        ..Default::default()
    };
    let w1 = workers::start(&ns.name, "bench-w1", &opts)?;
    let w2 = workers::start(&ns.name, "bench-w2", &opts)?;
    let before = api_requests::snapshot()?;
    let start = Instant::now();
    create_all(&ns.api::<BatchTask>(), n, conc, |i| {
        json!({
            "apiVersion": "batchlease.dev/v1alpha1", "kind": "BatchTask",
            "metadata": {"name": format!("t-{i:05}")},
            "spec": spec(i),
        })
    })
    .await?;
    wait_for(
        "all tasks succeeded",
        Duration::from_secs(3600),
        || format!("{}{}{}", op.logs(), w1.logs(), w2.logs()),
        || async { Ok((count_phase(&ns, TaskPhase::Succeeded).await? == n).then_some(())) },
    )
    .await?;
    let rate = n as f64 / start.elapsed().as_secs_f64();
    let requests = api_requests::delta(&before, &api_requests::snapshot()?);
    drop((w1, w2, op));
    ns.cleanup().await?;
    Ok((rate, requests))
}

/// Prints a result line as soon as it is known, and keeps it for the summary.
pub fn emit(report: &mut String, line: &str) {
    print!("{line}");
    report.push_str(line);
}

/// CPU seconds (user + system) process `pid` has used so far.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces), from field 3.
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    // USER_HZ is 100 on every Linux this runs on.
    Some(ticks / 100.0)
}

/// The pid of control-plane component `name` (`etcd`, `kube-apiserver`).
pub fn component_pid(name: &str) -> Option<u32> {
    let dir = std::env::var_os("BATCHLEASE_CP_DIR")?;
    let path = std::path::Path::new(&dir)
        .join("run")
        .join(format!("{name}.pid"));
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// CPU seconds of the processes of `pids` (those that run) so far.
pub fn cpu_of(pids: &[Option<u32>]) -> Vec<Option<f64>> {
    pids.iter().map(|p| p.and_then(cpu_seconds)).collect()
}
