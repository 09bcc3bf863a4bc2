//! The world of the node's worker tests (`e2e/tests/node_workers.rs`,
//! `node_worker_kinds.rs`): a namespace, the operator chart (for the worker
//! ClusterRole and the holder-only policy), the operator as a harness
//! process on the chart's ServiceAccount, the PostgreSQL Secret `pg`, and
//! the worker chart's release `w` with the image of any worker kind, its
//! pods on the node of `e2e/node/up.sh`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use batchlease_api::{BatchTask, LeasePhase, TaskPhase};
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use kube::api::ListParams;

use crate::history::Change;
use crate::operator::Operator;
use crate::secrets::PrivateDir;
use crate::tasks::{self, phase_of};
use crate::{Cluster, TestNamespace, chart, helm, kubectl, node, wait_for};

/// The worker chart.
pub const CHART: &str = "charts/batchlease-worker";

pub fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

pub fn pod_name(p: &Pod) -> String {
    p.metadata.name.clone().unwrap_or_default()
}

pub fn ready(p: &Pod) -> bool {
    p.metadata.deletion_timestamp.is_none()
        && p.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The worker container's status: (container id without `containerd://`,
/// restart count).
pub fn container(p: &Pod) -> Option<(String, i32)> {
    let cs = p.status.as_ref()?.container_statuses.as_ref()?.first()?;
    let id = cs
        .container_id
        .as_deref()?
        .trim_start_matches("containerd://");
    Some((id.to_owned(), cs.restart_count))
}

/// The pod a holder identity names (`<pod>/<6 hex digits>`).
pub fn holder_pod(holder: &str) -> &str {
    holder.rsplit_once('/').map_or(holder, |(pod, _)| pod)
}

/// A test's world: its namespace, the operator chart (for the worker
/// ClusterRole and the holder-only policy), the operator as a harness
/// process on the chart's ServiceAccount, the PostgreSQL Secret, and the
/// worker chart's release `w`.
#[derive(Debug)]
pub struct World {
    pub ns: TestNamespace,
    pub op: Operator,
    pub operator_chart: chart::Release,
    workers: Option<WorkerRelease>,
    _dir: PrivateDir,
}

/// `helm install w charts/batchlease-worker`, uninstalled when dropped.
#[derive(Debug)]
pub struct WorkerRelease {
    namespace: String,
    uninstalled: bool,
}

impl WorkerRelease {
    pub fn uninstall(&mut self) {
        self.uninstalled = true;
        helm::ok(&["uninstall", "w", "-n", &self.namespace]).unwrap();
    }
}

impl Drop for WorkerRelease {
    fn drop(&mut self) {
        if !self.uninstalled {
            let _ = helm::run(&["uninstall", "w", "-n", &self.namespace]);
        }
    }
}

pub const DEPLOYMENT: &str = "w-batchlease-worker";

impl World {
    /// Everything but the workers; then [`World::install_workers`].
    pub async fn new(prefix: &str) -> Self {
        let cluster = Cluster::with_crds().await.unwrap();
        let ns = cluster.namespace(prefix).await.unwrap();
        let n = ns.name.clone();
        // The ServiceAccount admission plugin refuses pods until the
        // namespace's `default` ServiceAccount exists.
        let sas = ns.api::<ServiceAccount>();
        wait_for(
            "the namespace's default ServiceAccount",
            Duration::from_secs(30),
            || node::diagnostics(&n),
            || {
                let sas = sas.clone();
                async move { Ok(sas.get_opt("default").await?.map(|_| ())) }
            },
        )
        .await
        .unwrap();
        // The operator chart for its worker ClusterRole and holder-only
        // policy; its own pods tolerate no taint and stay Pending: the
        // operator runs here as a process on its ServiceAccount.
        let op_release = format!("o{}", &n[n.len() - 6..]);
        let operator_chart = chart::Release::install(
            &op_release,
            &n,
            &[format!("watchNamespaces={{{n}}}"), "replicaCount=1".into()],
        )
        .unwrap();
        let dir = PrivateDir::new(&n).unwrap();
        let op_kc =
            kubectl::service_account_kubeconfig(&n, &operator_chart.full_name(), &dir).unwrap();
        let op = Operator::start_with(&n, "op", vec![format!("--kubeconfig={}", op_kc.display())])
            .unwrap();
        // The harness PostgreSQL: on 127.0.0.1, which hostNetwork pods share.
        let url = dir
            .write("pg-url", &crate::workers::pg_url().unwrap())
            .unwrap();
        kubectl::ok(&[
            "create",
            "secret",
            "generic",
            "pg",
            "-n",
            &n,
            &format!("--from-file=url={}", url.display()),
        ])
        .unwrap();
        op.wait_leading(Duration::from_secs(60)).await.unwrap();
        Self {
            ns,
            op,
            operator_chart,
            workers: None,
            _dir: dir,
        }
    }

    /// The worker chart: `replicas` pods with `slots` each on the node,
    /// `more` values on top (e.g. the grace periods).
    pub fn install_workers(&mut self, replicas: u32, slots: u32, more: &[String]) {
        self.install_workers_of("batchlease-demo-worker", replicas, slots, more);
    }

    /// [`World::install_workers`] with the image of `bin` (as hack/image.sh
    /// names it and e2e/node/import.sh imported it).
    pub fn install_workers_of(&mut self, bin: &str, replicas: u32, slots: u32, more: &[String]) {
        let n = self.ns.name.clone();
        let (api_host, api_port) = node::api_server().unwrap();
        let mut sets = vec![
            format!("workerRole.operatorRelease={}", self.operator_chart.name),
            "postgres.existingSecret=pg".to_owned(),
            "queues={demo}".into(),
            format!("replicaCount={replicas}"),
            format!("slots={slots}"),
            format!(
                "image.repository={}",
                node::image(bin)
                    .rsplit_once(':')
                    .map_or(String::new(), |(repo, _)| repo.to_owned())
            ),
            "image.pullPolicy=Never".into(),
            // Several replicas on one node: the node's network, no port.
            "hostNetwork=true".into(),
            "metrics.enabled=false".into(),
            format!("tolerations[0].key={}", node::TAINT),
            "tolerations[0].operator=Exists".into(),
            "tolerations[0].effect=NoSchedule".into(),
        ];
        sets.extend(more.iter().cloned());
        let strings = [
            "extraEnv[0].name=KUBERNETES_SERVICE_HOST".to_owned(),
            format!("extraEnv[0].value={api_host}"),
            "extraEnv[1].name=KUBERNETES_SERVICE_PORT".into(),
            format!("extraEnv[1].value={api_port}"),
            "extraEnv[2].name=RUST_LOG".into(),
            // Helm splits --set at unescaped commas.
            r"extraEnv[2].value=info\,kube=warn\,batchlease_worker_sdk=debug".into(),
        ];
        let mut args = vec!["install", "w", CHART, "-n", &n, "--wait=false"];
        for s in &sets {
            args.extend(["--set", s.as_str()]);
        }
        for s in &strings {
            args.extend(["--set-string", s.as_str()]);
        }
        helm::ok(&args).unwrap();
        self.workers = Some(WorkerRelease {
            namespace: n,
            uninstalled: false,
        });
    }

    pub fn diag(&self) -> String {
        // Another release's cluster-wide holder-only policy (a shared
        // control plane) would refuse this operator's expiries: listed.
        let policies = kubectl::run(&["get", "validatingadmissionpolicybindings"])
            .map(|o| o.combined())
            .unwrap_or_default();
        format!(
            "{}\n{}\n$ kubectl get validatingadmissionpolicybindings\n{policies}\n--- operator ---\n{}",
            node::diagnostics(&self.ns.name),
            self.ns.diagnostics(),
            self.op.logs()
        )
    }

    pub async fn pods(&self) -> anyhow::Result<Vec<Pod>> {
        Ok(self
            .ns
            .api::<Pod>()
            .list(&ListParams::default().labels("app.kubernetes.io/instance=w"))
            .await?
            .items)
    }

    /// Waits until `check` holds of the worker pods.
    pub async fn wait_pods<T>(
        &self,
        what: &str,
        timeout: Duration,
        check: impl Fn(&[Pod]) -> Option<T>,
    ) -> T {
        let check = &check;
        wait_for(
            what,
            timeout,
            || self.diag(),
            || async move { Ok(check(&self.pods().await?)) },
        )
        .await
        .unwrap()
    }

    /// Waits for `n` Ready worker pods (and no others); their names.
    pub async fn wait_ready(&self, n: usize, timeout: Duration) -> Vec<String> {
        self.wait_pods(&format!("{n} worker pods Ready"), timeout, |ps| {
            (ps.len() == n && ps.iter().all(ready)).then(|| ps.iter().map(pod_name).collect())
        })
        .await
    }

    pub async fn tasks(&self) -> anyhow::Result<Vec<BatchTask>> {
        Ok(self
            .ns
            .api::<BatchTask>()
            .list(&ListParams::default())
            .await?
            .items)
    }

    /// Waits until every task is Succeeded.
    pub async fn wait_all_succeeded(&self, timeout: Duration) -> Vec<BatchTask> {
        wait_for(
            "every task Succeeded",
            timeout,
            || self.diag(),
            || async {
                let ts = self.tasks().await?;
                Ok(ts
                    .iter()
                    .all(|t| phase_of(t) == Some(TaskPhase::Succeeded))
                    .then_some(ts))
            },
        )
        .await
        .unwrap()
    }

    /// Running tasks held by pod `pod`: task name → (uid, fencing token).
    pub async fn held_by(&self, pod: &str) -> BTreeMap<String, (String, i64)> {
        self.tasks()
            .await
            .unwrap()
            .into_iter()
            .filter_map(|t| {
                let s = t.status.as_ref()?;
                let holder = s.holder.as_deref()?;
                (s.phase == Some(TaskPhase::Running) && holder_pod(holder) == pod).then(|| {
                    (
                        t.metadata.name.clone().unwrap(),
                        (t.metadata.uid.clone().unwrap(), s.fencing_token),
                    )
                })
            })
            .collect()
    }

    /// Waits until each of `held` has a lease with a newer token Offered
    /// or Held; by task, how long after `since` (seconds since the epoch)
    /// the history's watch saw it first, and how long after the old
    /// lease's last renewal (its `renewTime`, the worker's clock: the same
    /// host's).
    pub async fn reassigned_after(
        &self,
        held: &BTreeMap<String, (String, i64)>,
        since: f64,
        timeout: Duration,
    ) -> BTreeMap<String, (f64, f64)> {
        wait_for(
            "the next lease of every affected task",
            timeout,
            || self.diag(),
            || async {
                let (leases, _) = self.ns.recorded().await?;
                let mut seen = BTreeMap::new();
                let mut renewed: BTreeMap<&str, f64> = BTreeMap::new();
                for r in &leases {
                    let Change::Lease(l) = &r.change else {
                        continue;
                    };
                    let live = matches!(
                        tasks::lease_phase(l),
                        Some(LeasePhase::Offered | LeasePhase::Held)
                    );
                    for (task, (uid, token)) in held {
                        if l.spec.task_uid != *uid {
                            continue;
                        }
                        if l.spec.fencing_token == *token
                            && let Some(t) = &l.spec.renew_time
                        {
                            let at = t.0.as_millisecond() as f64 / 1000.0;
                            let last = renewed.entry(task).or_insert(at);
                            *last = last.max(at);
                        }
                        if live && l.spec.fencing_token > *token {
                            seen.entry(task.clone()).or_insert(r.at);
                        }
                    }
                }
                if seen.len() < held.len() {
                    return Ok(None);
                }
                Ok(Some(
                    seen.into_iter()
                        .map(|(task, at)| {
                            let renewal = renewed.get(task.as_str()).copied().unwrap_or(f64::NAN);
                            (task, (at - since, at - renewal))
                        })
                        .collect(),
                ))
            },
        )
        .await
        .unwrap()
    }

    /// Writes of this operator that another release's holder-only policy
    /// denied: on a shared control plane, a cluster-wide operator chart
    /// installed meanwhile (another test binary, a demo) exempts only its
    /// own operator, and this one's expiries are refused until it goes.
    pub fn foreign_denials(&self) -> String {
        let ours = format!("'{}-holder-only'", self.operator_chart.full_name());
        let logs = self.op.logs();
        let denied: Vec<&str> = logs
            .lines()
            .filter(|l| l.contains("denied request") && !l.contains(&ours))
            .take(3)
            .collect();
        if denied.is_empty() {
            return String::new();
        }
        format!(
            "\nNOTE: another release's ValidatingAdmissionPolicy denied this operator's writes \
             (a shared control plane; not this test's fault), e.g.:\n{}",
            denied.join("\n")
        )
    }

    pub async fn finish(mut self) {
        if let Some(w) = self.workers.as_mut() {
            w.uninstall();
        }
        self.wait_pods("the worker pods gone", Duration::from_secs(90), |ps| {
            ps.is_empty().then_some(())
        })
        .await;
        self.operator_chart.uninstall().unwrap();
        drop(self.op);
        self.ns.finish().await.unwrap();
    }
}
