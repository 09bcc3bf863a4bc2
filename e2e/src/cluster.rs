//! Connecting to the test control plane, installing the CRDs once, and a
//! throwaway namespace per test.

use std::time::Duration;

use anyhow::{Context, bail};
use futures::TryStreamExt;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch,
    PatchParams, PostParams, WatchEvent, WatchParams,
};
use kube::runtime::wait::{await_condition, conditions};
use kube::{Client, ResourceExt};
use rand::Rng;
use tokio::sync::OnceCell;

use crate::history::{Checks, History};
use crate::kubectl;
use crate::wait::wait_for;

/// The control plane the tests talk to.
#[derive(Clone)]
pub struct Cluster {
    pub client: Client,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster").finish_non_exhaustive()
    }
}

static CRDS: OnceCell<()> = OnceCell::const_new();

impl Cluster {
    /// Connects using `KUBECONFIG`, which `e2e/controlplane/up.sh` writes.
    pub async fn connect() -> anyhow::Result<Self> {
        if std::env::var_os("KUBECONFIG").is_none()
            || std::env::var_os("BATCHLEASE_CP_DIR").is_none()
        {
            bail!(
                "the e2e tests need the local control plane: run `hack/test.sh`, or \
                 `. $(e2e/controlplane/up.sh)/env` first"
            );
        }
        let client = Client::try_default()
            .await
            .context("building a client from KUBECONFIG")?;
        Ok(Self { client })
    }

    /// Connects and makes sure the batchlease CRDs are installed and
    /// `Established` (once per test binary; idempotent across binaries).
    pub async fn with_crds() -> anyhow::Result<Self> {
        let cluster = Self::connect().await?;
        CRDS.get_or_try_init(|| cluster.install_crds()).await?;
        Ok(cluster)
    }

    /// Server-side applies the generated CRDs and waits until each is
    /// `Established` and, where the apply created or changed it, until the
    /// API server's watch cache serves it (see [`watch_cache_serves`]).
    pub async fn install_crds(&self) -> anyhow::Result<()> {
        let api: Api<CustomResourceDefinition> = Api::all(self.client.clone());
        let pp = PatchParams::apply("batchlease-e2e").force();
        for crd in batchlease_api::crds() {
            let name = crd.name_any();
            let before = api
                .get_opt(&name)
                .await
                .with_context(|| format!("reading CRD {name}"))?
                .and_then(|c| c.resource_version());
            let applied = api
                .patch(&name, &pp, &Patch::Apply(&crd))
                .await
                .with_context(|| format!("applying CRD {name}"))?;
            let established = await_condition(api.clone(), &name, conditions::is_crd_established());
            tokio::time::timeout(Duration::from_secs(30), established)
                .await
                .with_context(|| format!("CRD {name} not Established within 30s"))??;
            if applied.resource_version() != before {
                let served = served_resource(&applied)?;
                let objects: Api<DynamicObject> = Api::all_with(self.client.clone(), &served);
                wait_for(
                    &format!("the API server's watch cache to serve {name}"),
                    Duration::from_secs(30),
                    String::new,
                    || watch_cache_serves(&objects),
                )
                .await?;
            }
        }
        Ok(())
    }

    /// A fresh namespace named `bl-<prefix>-<random>`.
    pub async fn namespace(&self, prefix: &str) -> anyhow::Result<TestNamespace> {
        let suffix: u32 = rand::rng().random_range(0..0xff_ffff);
        let name = format!("bl-{prefix}-{suffix:06x}");
        let ns: Namespace = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": { "name": name, "labels": { "batchlease.dev/e2e": "true" } }
        }))?;
        Api::<Namespace>::all(self.client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .with_context(|| format!("creating namespace {name}"))?;
        // The fenced table's audit trigger must exist before any worker
        // writes, or the history would miss those writes.
        if std::env::var_os("BATCHLEASE_PG_URL").is_some() {
            crate::pg::connect().await?;
        }
        let history = History::record(&self.client, &name).await?;
        Ok(TestNamespace {
            name,
            client: self.client.clone(),
            history,
            checks: Checks::default(),
        })
    }
}

/// The storage version of `crd` as an API resource, to list and watch it
/// untyped.
fn served_resource(crd: &CustomResourceDefinition) -> anyhow::Result<ApiResource> {
    let version = crd
        .spec
        .versions
        .iter()
        .find(|v| v.storage)
        .with_context(|| format!("CRD {} has no storage version", crd.name_any()))?;
    let gvk = GroupVersionKind::gvk(&crd.spec.group, &version.name, &crd.spec.names.kind);
    Ok(ApiResource::from_gvk_with_plural(
        &gvk,
        &crd.spec.names.plural,
    ))
}

/// `Ok` once a watch started as the recorder's watcher starts it (a list at
/// resourceVersion 0, then a watch from the version that list returned) is
/// served without an error; an error (a 429 while the cache starts, a 410
/// ERROR event) makes [`wait_for`] ask again.
///
/// Right after a CRD is created, the API server's watch cache for it is
/// still starting: a list may be answered from etcd at a version the cache,
/// once started, no longer holds, and the watch from it then fails with
/// "too old resource version" (410) — or with 429 while the cache starts.
/// The recorder counts any watch error as a gap in a test's history, so the
/// first test of a run failed that way when it won this race (CI on
/// 2026-12-04). Once a watch from such a list is served, the cache is up and
/// later lists are answered from it.
async fn watch_cache_serves(api: &Api<DynamicObject>) -> anyhow::Result<Option<()>> {
    let list = api
        .list_metadata(&ListParams::default().match_any().limit(1))
        .await?;
    let version = list.metadata.resource_version.unwrap_or_default();
    let events = api
        .watch_metadata(&WatchParams::default().timeout(1), &version)
        .await?;
    futures::pin_mut!(events);
    while let Some(event) = events.try_next().await? {
        if let WatchEvent::Error(e) = event {
            anyhow::bail!("a watch from resourceVersion {version} failed: {e:?}");
        }
    }
    Ok(Some(()))
}

/// A namespace owned by one test, whose whole history is recorded (see
/// [`crate::history`]). Call [`TestNamespace::cleanup`] (or
/// [`TestNamespace::finish`]) at the end of a passing test: it checks the
/// history's invariants first. A failing test leaves the namespace for
/// inspection (the control plane is thrown away after the run anyway).
pub struct TestNamespace {
    pub name: String,
    client: Client,
    history: History,
    checks: Checks,
}

impl std::fmt::Debug for TestNamespace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestNamespace")
            .field("name", &self.name)
            .finish()
    }
}

impl TestNamespace {
    /// A typed API for namespaced kind `K` in this namespace.
    pub fn api<K>(&self) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        <K as kube::Resource>::DynamicType: Default,
    {
        Api::namespaced(self.client.clone(), &self.name)
    }

    /// Everything a human needs to see why a test failed in this namespace
    /// (each listing capped at [`DIAGNOSTICS_CAP`] bytes).
    pub fn diagnostics(&self) -> String {
        let mut out = String::new();
        for args in [
            vec!["get", "batchlease", "-o", "yaml"],
            vec!["get", "events", "--sort-by=.lastTimestamp"],
        ] {
            let mut full = args.clone();
            full.extend(["-n", &self.name]);
            out.push_str(&format!("$ kubectl {}\n", full.join(" ")));
            match kubectl::run_capped(&full, DIAGNOSTICS_CAP) {
                Ok(o) => out.push_str(&o),
                Err(e) => out.push_str(&format!("(kubectl failed: {e:#})\n")),
            }
        }
        out.push_str(&component_logs());
        out
    }

    /// The test restarts the control plane: gaps in the watches are
    /// expected (the checks still run on what was recorded).
    pub fn tolerate_watch_errors(&mut self) {
        self.checks.tolerate_watch_errors = true;
    }

    /// Checks the recorded history (safety invariants only), then deletes
    /// the namespace (the namespace controller removes its content).
    pub async fn cleanup(self) -> anyhow::Result<()> {
        let checks = self.checks;
        self.check_and_delete(checks).await
    }

    /// Like [`TestNamespace::cleanup`], and every task must have ended
    /// Succeeded, DeadLettered or Rejected: none is stuck.
    pub async fn finish(self) -> anyhow::Result<()> {
        let checks = Checks {
            all_final: true,
            ..self.checks
        };
        self.check_and_delete(checks).await
    }

    /// Everything recorded so far (leases, tasks), after catching up with
    /// the API server's current state.
    pub async fn recorded(
        &self,
    ) -> anyhow::Result<(Vec<crate::history::Recorded>, Vec<crate::history::Recorded>)> {
        self.history.catch_up(&self.client, &self.name).await?;
        let (leases, tasks, _) = self.history.snapshot();
        Ok((leases, tasks))
    }

    /// The WorkerLease changes recorded so far (call [`Self::recorded`]
    /// first to catch up).
    pub fn recorded_workers(&self) -> Vec<crate::history::Recorded> {
        self.history.workers()
    }

    /// The recorded history's violations under `checks` (empty: ok).
    pub async fn violations(&self, checks: Checks) -> anyhow::Result<Vec<String>> {
        self.history.violations(&checks).await
    }

    async fn check_and_delete(self, checks: Checks) -> anyhow::Result<()> {
        self.history.catch_up(&self.client, &self.name).await?;
        let violations = self.history.violations(&checks).await?;
        if !violations.is_empty() {
            bail!(
                "the history of namespace {} violates the protocol:\n  {}\n{}",
                self.name,
                violations.join("\n  "),
                self.diagnostics()
            );
        }
        Api::<Namespace>::all(self.client.clone())
            .delete(&self.name, &DeleteParams::background())
            .await?;
        Ok(())
    }
}

/// Bytes of each kubectl listing kept in diagnostics.
pub const DIAGNOSTICS_CAP: usize = 2_000_000;

/// The last lines of each control-plane component's log.
pub fn component_logs() -> String {
    let Some(dir) = std::env::var_os("BATCHLEASE_CP_DIR") else {
        return String::new();
    };
    let mut out = String::new();
    let logs = std::path::Path::new(&dir).join("logs");
    if let Ok(entries) = std::fs::read_dir(&logs) {
        for entry in entries.flatten() {
            let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(15).collect();
            out.push_str(&format!(
                "--- last lines of {} ---\n",
                entry.path().display()
            ));
            for line in tail.into_iter().rev() {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    out
}
