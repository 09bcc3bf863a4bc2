//! What every phase uses: bulk creates, counting, memory, the standard
//! operator + demo workers run, and the report.

use std::time::Duration;

use anyhow::Context;
use batchlease_api::{BatchTask, TaskPhase};
use batchlease_e2e::conformance::{Kind, StartOpts};
use batchlease_e2e::operator::Operator;
use batchlease_e2e::tasks::phase_of;
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

/// How many tasks of namespace `ns` the operator counts in `phase`
/// (`batchlease_tasks`, from its cache, summed over queues): how the
/// benchmark learns that a run is done without costing the API server
/// anything — a LIST of every task each 100 ms cost it more CPU than the
/// tasks themselves.
pub async fn operator_count(op: &Operator, ns: &str, phase: TaskPhase) -> anyhow::Result<usize> {
    let (_, body) = op.get("/metrics").await?;
    Ok(sum_tasks(&body, ns, phase.as_str()))
}

/// Pure: `batchlease_tasks` samples of namespace `ns` and phase `phase` in
/// Prometheus text, summed.
pub fn sum_tasks(text: &str, ns: &str, phase: &str) -> usize {
    let (want_ns, want_phase) = (format!("namespace=\"{ns}\""), format!("phase=\"{phase}\""));
    text.lines()
        .filter_map(|l| l.strip_prefix("batchlease_tasks{"))
        .filter_map(|rest| rest.rsplit_once("} "))
        .filter(|(labels, _)| {
            let labels: Vec<&str> = labels.split(',').collect();
            labels.contains(&want_ns.as_str()) && labels.contains(&want_phase.as_str())
        })
        .filter_map(|(_, v)| v.trim().parse::<f64>().ok())
        .map(|v| v as usize)
        .sum()
}

/// An operator in `ns` electing its leader at the production defaults (a
/// 15 s Lease renewed every 10/3 s, 5 s grace), not the tests' quick 6 s
/// one, once it leads: a phase that measures the operator's own requests,
/// or loads the API server so much that a quick term would lapse,
/// measures the election otherwise.
pub async fn operator_at_defaults(ns: &str) -> anyhow::Result<Operator> {
    let op = Operator::start_with(
        ns,
        "op",
        vec![
            "--events=important".into(),
            "--leader-lease-seconds=15".into(),
            "--leader-grace-seconds=5".into(),
        ],
    )?;
    op.wait_leading(Duration::from_secs(60)).await?;
    Ok(op)
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
    Ok(
        run_tasks_counted(cluster, prefix, n, conc, Kind::RustSdk, false, spec)
            .await?
            .0,
    )
}

/// [`run_tasks`], also returning the requests the API server counted from
/// the first create to the last task seen `Succeeded` (cluster-wide: the
/// control plane's own leader elections are in it too, as rows of their
/// own). `per_worker`: the workers renew per worker (and take bound
/// attempts), else per lease.
pub async fn run_tasks_counted(
    cluster: &Cluster,
    prefix: &str,
    n: usize,
    conc: usize,
    kind: Kind,
    per_worker: bool,
    spec: impl Fn(usize) -> serde_json::Value,
) -> anyhow::Result<(f64, api_requests::Counts, Cpu)> {
    let ns = cluster.namespace(prefix).await?;
    let db = pg::connect().await?;
    // The table the command and Python kinds write their effect to.
    batchlease_e2e::conformance::prepare(&db).await?;
    let op = Operator::start_with(&ns.name, "op", vec!["--events=important".into()])?;
    op.wait_leading(Duration::from_secs(60)).await?;
    let opts = StartOpts {
        slots: 8,
        renew_per_worker: per_worker,
        ..Default::default()
    };
    let w1 = kind.start_opts(&ns.name, "bench-w1", &opts)?;
    let w2 = kind.start_opts(&ns.name, "bench-w2", &opts)?;
    let note = quiet_cluster(cluster).await?;
    if !note.is_empty() {
        eprintln!("note:{note}");
    }
    let before = api_requests::snapshot()?;
    let events0 = api_requests::watch_events()?;
    let pids = [
        component_pid("kube-apiserver"),
        component_pid("etcd"),
        op.pid(),
        w1.pid(),
        w2.pid(),
        Some(std::process::id()),
    ];
    let cpu0 = cpu_of(&pids);
    let pg0 = cpu_of_all("postgres");
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
        || async {
            // A no-op task that dead-letters will not succeed: stop now.
            // Counted by the operator, not by LISTs (see `operator_count`).
            let dead = operator_count(&op, &ns.name, TaskPhase::DeadLettered).await?;
            anyhow::ensure!(dead == 0, "{dead} tasks dead-lettered");
            Ok((operator_count(&op, &ns.name, TaskPhase::Succeeded).await? == n).then_some(()))
        },
    )
    .await?;
    let secs = start.elapsed().as_secs_f64();
    let rate = n as f64 / secs;
    let requests = api_requests::delta(&before, &api_requests::snapshot()?);
    let events1 = api_requests::watch_events()?;
    let events_sent = ["batchtasks", "taskleases"]
        .iter()
        .map(|r| events1.get(*r).unwrap_or(&0.0) - events0.get(*r).unwrap_or(&0.0))
        .sum();
    let cpu1 = cpu_of(&pids);
    let used: Vec<f64> = cpu0
        .iter()
        .zip(&cpu1)
        .map(|(a, b)| a.zip(*b).map_or(0.0, |(a, b)| b - a))
        .collect();
    let pg = cpu_of_all("postgres") - pg0;
    let cpu = Cpu {
        secs,
        apiserver: used[0],
        etcd: used[1],
        operator: used[2],
        workers: used[3] + used[4],
        postgres: pg,
        load: used[5],
        events_sent,
    };
    // Every task Succeeded as the API server has it, now that the
    // measurement is over: the operator's count must not be trusted blind.
    let done = count_phase(&ns, TaskPhase::Succeeded).await?;
    anyhow::ensure!(
        done == n,
        "the operator counted {n} tasks Succeeded, the API server has {done}"
    );
    drop((w1, w2, op));
    ns.cleanup().await?;
    Ok((rate, requests, cpu))
}

/// CPU seconds each part used during a run of [`run_tasks_counted`].
pub struct Cpu {
    pub secs: f64,
    pub apiserver: f64,
    pub etcd: f64,
    pub operator: f64,
    pub workers: f64,
    pub postgres: f64,
    /// This process: the creates and the watches that time them.
    pub load: f64,
    /// Watch events of BatchTasks and TaskLeases the API server sent
    /// meanwhile (to every watcher: the operator, the workers).
    pub events_sent: f64,
}

impl Cpu {
    /// `part cores (ms/task), …` for `n` tasks.
    pub fn line(&self, n: usize) -> String {
        let parts = [
            ("kube-apiserver", self.apiserver),
            ("etcd", self.etcd),
            ("operator", self.operator),
            ("2 workers", self.workers),
            ("PostgreSQL", self.postgres),
            ("load generator", self.load),
        ];
        let total: f64 = parts.iter().map(|p| p.1).sum();
        let mut out: Vec<String> = parts
            .iter()
            .map(|(name, c)| {
                format!(
                    "{name} {:.2} cores ({:.1} ms/task)",
                    c / self.secs,
                    c * 1000.0 / n.max(1) as f64
                )
            })
            .collect();
        out.push(format!(
            "total {:.2} cores of {}",
            total / self.secs,
            std::thread::available_parallelism().map_or(0, |p| p.get())
        ));
        out.join(", ")
    }
}

/// CPU seconds used so far by every process named `comm` (e.g. all of
/// PostgreSQL's backends).
pub fn cpu_of_all(comm: &str) -> f64 {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0.0;
    };
    let want = format!("({comm})");
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .is_ok_and(|s| s.split_whitespace().nth(1) == Some(want.as_str()))
        })
        .filter_map(cpu_seconds)
        .sum()
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

/// How long [`quiet_cluster`] waits at most (set once by `main`).
pub static QUIET_WAIT: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();

/// Waits (up to [`QUIET_WAIT`]) for namespaces being deleted — earlier phases'
/// and tests' — to be gone: the namespace controller's deletes would be
/// counted in a phase's API requests. Returns a note for the report if
/// some were still there.
pub async fn quiet_cluster(cluster: &Cluster) -> anyhow::Result<String> {
    let deadline = QUIET_WAIT
        .get()
        .copied()
        .unwrap_or(Duration::from_secs(600));
    use k8s_openapi::api::core::v1::Namespace;
    let namespaces: Api<Namespace> = Api::all(cluster.client.clone());
    let terminating = || async {
        anyhow::Ok(
            namespaces
                .list(&Default::default())
                .await?
                .items
                .iter()
                .filter(|n| n.metadata.deletion_timestamp.is_some())
                .count(),
        )
    };
    let start = Instant::now();
    loop {
        let n = terminating().await?;
        if n == 0 {
            return Ok(String::new());
        }
        if start.elapsed() >= deadline {
            return Ok(format!(
                " ({n} namespaces of earlier phases were still being deleted: their deletes are in the counts)"
            ));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_the_operators_task_counts_of_one_namespace_and_phase() {
        let text = r#"# HELP batchlease_tasks BatchTasks by namespace, queue and phase
batchlease_tasks{namespace="a",queue="q1",phase="Succeeded"} 3
batchlease_tasks{namespace="a",queue="q2",phase="Succeeded"} 4
batchlease_tasks{namespace="a",queue="q1",phase="Running"} 9
batchlease_tasks{namespace="ab",queue="q1",phase="Succeeded"} 100
batchlease_tasks_total{namespace="a",queue="q1",phase="Succeeded"} 50
"#;
        assert_eq!(sum_tasks(text, "a", "Succeeded"), 7);
        assert_eq!(sum_tasks(text, "a", "Running"), 9);
        assert_eq!(sum_tasks(text, "a", "DeadLettered"), 0);
    }
}
