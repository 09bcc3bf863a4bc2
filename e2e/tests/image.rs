//! The images `hack/image.sh` builds without a container daemon: valid
//! archives (`crane validate`, the reader `docker load`'s format shares),
//! labelled as OCI says, every blob matching its digest; and the operator's
//! image runs. It is unpacked and run by runc, as the chart's Deployment
//! would run it — the entrypoint with the rendered args and env, user
//! 65532, read-only root, no capabilities — with the service-account token
//! mounted where a pod has it (in-cluster configuration, no kubeconfig):
//! it becomes ready and issues a lease. The Python worker's image
//! (`examples/python-worker` on Debian's python3.11) runs the same way, as
//! `examples/python-worker/deployment.yaml` would: it runs a task to the
//! end, commits its fenced row, and drains and exits 0 on SIGTERM.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use batchlease_api::{LeasePhase, TaskPhase};
use batchlease_e2e::oci::{self, Container, Unpacked};
use batchlease_e2e::operator::Operator;
use batchlease_e2e::ports::free_port;
use batchlease_e2e::process::Process;
use batchlease_e2e::secrets::PrivateDir;
use batchlease_e2e::tasks::{self, wait_lease, wait_phase};
use batchlease_e2e::{Cluster, helm, identity, kubectl, pg, wait_for, workers};
use serde_json::json;

const VERSION: &str = env!("CARGO_PKG_VERSION");
const PYTHON_WORKER: &str = "batchlease-python-worker";

fn check_image(bin: &str, img: &Unpacked) {
    let reference = format!("ghcr.io/batchlease/{bin}:{VERSION}");
    let cfg = &img.config["config"];
    assert_eq!(cfg["User"], "65532:65532", "runs as nonroot: {cfg}");
    let python = bin == PYTHON_WORKER;
    let entrypoint = if python {
        json!(["/usr/bin/python3.11", "/app/worker.py"])
    } else {
        json!([format!("/usr/local/bin/{bin}")])
    };
    assert_eq!(cfg["Entrypoint"], entrypoint);
    let labels = &cfg["Labels"];
    assert_eq!(labels["org.opencontainers.image.title"], bin);
    assert_eq!(labels["org.opencontainers.image.version"], VERSION);
    assert_eq!(labels["org.opencontainers.image.licenses"], "Apache-2.0");
    for key in [
        "org.opencontainers.image.revision",
        "org.opencontainers.image.source",
        "org.opencontainers.image.created",
        "org.opencontainers.image.base.name",
    ] {
        assert!(
            labels[key].as_str().is_some_and(|v| !v.is_empty()),
            "label {key}: {labels}"
        );
    }
    assert_eq!(
        img.manifest["annotations"], *labels,
        "manifest annotations = labels"
    );
    assert_eq!(
        img.config["created"],
        labels["org.opencontainers.image.created"]
    );
    let desc = &img.index["manifests"][0];
    assert_eq!(desc["annotations"]["io.containerd.image.name"], reference);
    assert_eq!(
        desc["annotations"]["org.opencontainers.image.ref.name"],
        VERSION
    );
    assert_eq!(
        desc["platform"],
        json!({"architecture": "amd64", "os": "linux"})
    );
    assert_eq!(img.docker_manifest[0]["RepoTags"], json!([reference]));
    // The root filesystem: the binary, the C runtime it links, the
    // nonroot user.
    let entry = img
        .rootfs
        .join(entrypoint[0].as_str().unwrap().trim_start_matches('/'));
    let mode = std::fs::metadata(&entry).unwrap().permissions().mode();
    assert!(mode & 0o111 != 0, "{} not executable", entry.display());
    let passwd = std::fs::read_to_string(img.rootfs.join("etc/passwd")).unwrap();
    assert!(passwd.contains("nonroot:x:65532:65532"), "{passwd}");
    assert!(img.rootfs.join("lib64/ld-linux-x86-64.so.2").exists());
    // It runs on the image's own libraries, not the host's.
    let ld = img.rootfs.join("lib64/ld-linux-x86-64.so.2");
    let libs = img.rootfs.join("lib/x86_64-linux-gnu");
    let mut cmd = std::process::Command::new(&ld);
    cmd.args(["--inhibit-cache", "--library-path"]);
    if python {
        // The interpreter, the stdlib's extension modules and the
        // packages the worker imports, on the image's libraries and
        // stdlib only (a clean environment: no host site-packages).
        let usr_libs = img.rootfs.join("usr/lib/x86_64-linux-gnu");
        cmd.arg(format!("{}:{}", libs.display(), usr_libs.display()))
            .arg(&entry)
            .args(["-c", "import ssl, sqlite3, multiprocessing, json, asyncio, psycopg, batchlease; assert psycopg.pq.__impl__ == 'binary'"])
            .env_clear()
            .env("PYTHONHOME", img.rootfs.join("usr"))
            .env("PYTHONPATH", img.rootfs.join("app/site-packages"))
            .env("PYTHONDONTWRITEBYTECODE", "1");
        assert!(img.rootfs.join("app/worker.py").is_file());
        let env = cfg["Env"].as_array().unwrap();
        for var in [
            "PYTHONPATH=/app/site-packages",
            "PYTHONDONTWRITEBYTECODE=1",
            "PYTHONUNBUFFERED=1",
        ] {
            assert!(env.contains(&json!(var)), "{var} in {cfg}");
        }
    } else {
        cmd.arg(&libs).arg(&entry).arg("--help");
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{bin} on the image's libraries: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn image_archives_are_valid_and_labelled() {
    let crane = oci::env("BATCHLEASE_CRANE").unwrap();
    for bin in [
        "batchlease-operator",
        "batchlease-demo-worker",
        "batchlease-run",
        PYTHON_WORKER,
    ] {
        let archive = oci::archive(bin).unwrap();
        let out = std::process::Command::new(&crane)
            .args(["validate", "--tarball"])
            .arg(&archive)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "crane validate --tarball {}: {}{}",
            archive.display(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let dir = PrivateDir::new(&format!("image-{bin}")).unwrap();
        let img = oci::unpack(&archive, dir.path()).unwrap();
        check_image(bin, &img);
    }
}

#[tokio::test]
async fn the_operator_image_runs_and_issues_a_lease() {
    let cluster = Cluster::with_crds().await.unwrap();
    let ns = cluster.namespace("image").await.unwrap();
    let n = ns.name.as_str();
    let release = format!("i{}", &n[n.len() - 6..]);
    let port = free_port().unwrap();
    let sets = [
        format!("watchNamespaces={{{n}}}"),
        "replicaCount=1".to_owned(),
        format!("metrics.port={port}"),
        "logFormat=text".to_owned(),
    ];
    let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
    let mut install = vec![
        "install",
        &release,
        "charts/batchlease-operator",
        "-n",
        n,
        "--wait=false",
    ];
    for s in &sets {
        install.extend(["--set", s]);
    }
    helm::ok(&install).unwrap();
    let sa = format!("{release}-batchlease-operator");
    // The pod the kubelet would run: its token is bound to it.
    let pod = format!("{sa}-0");
    let obj = batchlease_e2e::chart::pod_object(&pod, &sa);
    ns.api::<k8s_openapi::api::core::v1::Pod>()
        .create(&Default::default(), &obj)
        .await
        .unwrap();
    let (args, mut env) = helm::rendered_operator(&release, n, &sets, &pod).unwrap();

    let dir = PrivateDir::new(n).unwrap();
    let img = oci::unpack(&oci::archive("batchlease-operator").unwrap(), dir.path()).unwrap();
    // What the kubelet mounts at /var/run/secrets/kubernetes.io/serviceaccount
    // (0644 files, as a projected volume's default mode), and the
    // environment it sets for the in-cluster configuration.
    let uid = kubectl::ok(&[
        "get",
        "pod",
        &pod,
        "-n",
        n,
        "-o",
        "jsonpath={.metadata.uid}",
    ])
    .unwrap();
    let token = kubectl::ok(&[
        "create",
        "token",
        &sa,
        "-n",
        n,
        "--duration=1h",
        "--bound-object-kind=Pod",
        &format!("--bound-object-name={pod}"),
        &format!("--bound-object-uid={uid}"),
    ])
    .unwrap();
    let sa_dir = dir.path().join("serviceaccount");
    std::fs::create_dir(&sa_dir).unwrap();
    std::fs::set_permissions(&sa_dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let kubeconfig = std::fs::read_to_string(std::env::var("KUBECONFIG").unwrap()).unwrap();
    let field = |key: &str| {
        kubeconfig
            .lines()
            .find_map(|l| l.trim().strip_prefix(key).map(|v| v.trim().to_owned()))
            .unwrap()
    };
    let server = field("server:");
    let (host, api_port) = server
        .trim_start_matches("https://")
        .rsplit_once(':')
        .unwrap();
    for (file, content) in [
        ("token", token.trim().as_bytes().to_vec()),
        (
            "ca.crt",
            std::fs::read(field("certificate-authority:")).unwrap(),
        ),
        ("namespace", n.as_bytes().to_vec()),
    ] {
        let p = sa_dir.join(file);
        std::fs::write(&p, content).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    env.extend([
        ("KUBERNETES_SERVICE_HOST".to_owned(), host.to_owned()),
        ("KUBERNETES_SERVICE_PORT".to_owned(), api_port.to_owned()),
        ("RUST_LOG".to_owned(), "info,kube=warn".to_owned()),
    ]);

    // runc when it can run here; otherwise the image's entrypoint from the
    // unpacked root filesystem, with the same args and env (the token then
    // comes through a kubeconfig: nothing can be mounted without root).
    let mut _container = None;
    let mut _process = None;
    let logs: Box<dyn Fn() -> String> = match oci::runc_usable() {
        Ok(runc) => {
            let bundle = dir.path().join("bundle");
            std::fs::create_dir(&bundle).unwrap();
            oci::bundle_config(
                &runc,
                &bundle,
                &img,
                &args,
                &env,
                &pod,
                &[(
                    sa_dir.clone(),
                    "/var/run/secrets/kubernetes.io/serviceaccount",
                )],
            )
            .unwrap();
            let state = dir.path().join("runc-state");
            let c = Container::run(&runc, &state, &bundle, n, &release).unwrap();
            let log = c.process.log.clone();
            _container = Some(c);
            Box::new(move || std::fs::read_to_string(&log).unwrap_or_default())
        }
        Err(why) => {
            eprintln!(
                "SKIPPED the runc part: {why}; running the image's entrypoint from its root filesystem instead"
            );
            let kc = kubectl::service_account_kubeconfig(n, &sa, &dir).unwrap();
            env.push(("KUBECONFIG".into(), kc.display().to_string()));
            let entry = img.rootfs.join("usr/local/bin/batchlease-operator");
            let p = Process::start(
                entry.display().to_string(),
                n,
                "image-operator",
                args.clone(),
                env.clone(),
            )
            .unwrap();
            let log = p.log.clone();
            _process = Some(p);
            Box::new(move || std::fs::read_to_string(&log).unwrap_or_default())
        }
    };

    // Ready (its /readyz, the chart's readinessProbe) …
    wait_for(
        "the image's operator ready",
        Duration::from_secs(60),
        &logs,
        || async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let Ok(mut s) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
                return Ok(None);
            };
            s.write_all(b"GET /readyz HTTP/1.0\r\nHost: localhost\r\n\r\n")
                .await?;
            let mut buf = String::new();
            s.read_to_string(&mut buf).await?;
            Ok((buf.split_whitespace().nth(1) == Some("200")).then_some(()))
        },
    )
    .await
    .unwrap();
    if let Some(c) = &_container {
        assert_eq!(c.status().unwrap(), "running");
    }
    // … and at work: it issues a task's lease.
    tasks::create(&ns, "job", json!({"queue": "demo", "payload": {}}))
        .await
        .unwrap();
    wait_lease(
        &ns,
        "job-1",
        LeasePhase::Offered,
        Duration::from_secs(30),
        &logs,
    )
    .await
    .unwrap();
    drop(_container);
    drop(_process);
    helm::ok(&["uninstall", &release, "-n", n]).unwrap();
    ns.cleanup().await.unwrap();
}

/// The Python worker's image, run by runc as its Deployment would run it
/// (`examples/python-worker/deployment.yaml`: read-only root, an emptyDir
/// on /tmp for the forkserver, user 65532, no capabilities), with a
/// kubeconfig mounted read-only and the harness's PostgreSQL on loopback
/// (host networking): it claims a task, runs it to `Succeeded` with its
/// result and fenced row, and on SIGTERM drains and exits 0.
#[tokio::test]
async fn the_python_worker_image_runs_a_task_and_drains() {
    let runc = match oci::runc_usable() {
        Ok(runc) => runc,
        Err(why) => {
            // No fallback as for the operator: the worker's forkserver
            // would start the host's interpreter, not the image's.
            eprintln!("SKIPPED: {why}");
            return;
        }
    };
    let (ns, op) = Operator::in_new_namespace("pyimage", "op", Duration::from_secs(30))
        .await
        .unwrap();
    let n = ns.name.as_str();
    let dir = PrivateDir::new(n).unwrap();
    let img = oci::unpack(&oci::archive(PYTHON_WORKER).unwrap(), dir.path()).unwrap();

    // A self-contained kubeconfig (its own client identity, the key and CA
    // inline) the container's user can read, in a directory of its own:
    // the bind mount hides the private directory above it.
    let kc = identity::kubeconfig_as("python-worker-image", &dir).unwrap();
    let flat = kubectl::ok(&[
        "config",
        "view",
        "--flatten",
        "--minify",
        &format!("--kubeconfig={}", kc.display()),
    ])
    .unwrap();
    let kube_dir = dir.path().join("kube");
    std::fs::create_dir(&kube_dir).unwrap();
    std::fs::set_permissions(&kube_dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let kube_file = kube_dir.join("kubeconfig");
    std::fs::write(&kube_file, flat).unwrap();
    std::fs::set_permissions(&kube_file, std::fs::Permissions::from_mode(0o644)).unwrap();

    let pod = "python-worker-0";
    let args: Vec<String> = ["--namespace", n, "--queue", "py", "--slots", "1"]
        .map(String::from)
        .to_vec();
    let env = vec![
        (
            "KUBECONFIG".to_owned(),
            "/var/run/batchlease/kubeconfig".to_owned(),
        ),
        ("POD_NAME".to_owned(), pod.to_owned()),
        ("BATCHLEASE_PG_URL".to_owned(), workers::pg_url().unwrap()),
    ];
    let bundle = dir.path().join("bundle");
    std::fs::create_dir(&bundle).unwrap();
    oci::bundle_config(
        &runc,
        &bundle,
        &img,
        &args,
        &env,
        pod,
        &[(kube_dir.clone(), "/var/run/batchlease")],
    )
    .unwrap();
    let id = format!("py{}", &n[n.len() - 6..]);
    let mut c = Container::run(&runc, &dir.path().join("runc-state"), &bundle, n, &id).unwrap();
    let log = c.process.log.clone();
    let logs = || {
        format!(
            "{}--- the container ---\n{}",
            op.logs(),
            std::fs::read_to_string(&log).unwrap_or_default()
        )
    };

    let task = tasks::create(
        &ns,
        "py",
        json!({"queue": "py", "payload": {"steps": 2, "stepMillis": 100}}),
    )
    .await
    .unwrap();
    let done = wait_phase(
        &ns,
        "py",
        TaskPhase::Succeeded,
        Duration::from_secs(90),
        logs,
    )
    .await
    .unwrap();
    let status = done.status.unwrap();
    let result = serde_json::to_value(&status.result).unwrap();
    assert_eq!(
        result,
        json!({"steps": 2, "resumedFrom": 0, "token": 1, "committed": true}),
        "{}",
        logs()
    );
    // The SDK's identity is <POD_NAME>/<suffix>.
    let lease = ns
        .api::<batchlease_api::TaskLease>()
        .get("py-1")
        .await
        .unwrap();
    let holder = lease.spec.holder_identity.unwrap_or_default();
    assert!(holder.starts_with(&format!("{pod}/")), "holder {holder}");
    // Its fenced row.
    let uid = task.metadata.uid.unwrap();
    let db = pg::connect().await.unwrap();
    let row = db
        .query_one(
            "SELECT token, steps FROM python_worker_results WHERE task_uid = $1",
            &[&uid],
        )
        .await
        .unwrap();
    assert_eq!((row.get::<_, i64>(0), row.get::<_, i64>(1)), (1, 2));

    // SIGTERM (runc passes it on to the worker, PID 1 in the container):
    // it drains and exits 0.
    assert_eq!(c.status().unwrap(), "running");
    c.process.signal("TERM").unwrap();
    let exit = wait_for(
        "the Python worker's container to exit after SIGTERM",
        Duration::from_secs(40),
        logs,
        || {
            let exited = c.process.exited();
            async move { Ok(exited) }
        },
    )
    .await
    .unwrap();
    assert!(exit.success(), "exit {exit}\n{}", logs());
    drop(c);
    drop(op);
    ns.cleanup().await.unwrap();
}
