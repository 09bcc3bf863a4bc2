//! The images `hack/image.sh` builds without a container daemon: valid
//! archives (`crane validate`, the reader `docker load`'s format shares),
//! labelled as OCI says, every blob matching its digest; and the operator's
//! image runs. It is unpacked and run by runc, as the chart's Deployment
//! would run it — the entrypoint with the rendered args and env, user
//! 65532, read-only root, no capabilities — with the service-account token
//! mounted where a pod has it (in-cluster configuration, no kubeconfig):
//! it becomes ready and issues a lease.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use batchlease_api::LeasePhase;
use batchlease_e2e::oci::{self, Container, Unpacked};
use batchlease_e2e::ports::free_port;
use batchlease_e2e::process::Process;
use batchlease_e2e::secrets::PrivateDir;
use batchlease_e2e::tasks::{self, wait_lease};
use batchlease_e2e::{Cluster, helm, kubectl, wait_for};
use serde_json::json;

const VERSION: &str = env!("CARGO_PKG_VERSION");

fn check_image(bin: &str, img: &Unpacked) {
    let reference = format!("ghcr.io/batchlease/{bin}:{VERSION}");
    let cfg = &img.config["config"];
    assert_eq!(cfg["User"], "65532:65532", "runs as nonroot: {cfg}");
    assert_eq!(cfg["Entrypoint"], json!([format!("/usr/local/bin/{bin}")]));
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
    let entry = img.rootfs.join(format!("usr/local/bin/{bin}"));
    let mode = std::fs::metadata(&entry).unwrap().permissions().mode();
    assert!(mode & 0o111 != 0, "{} not executable", entry.display());
    let passwd = std::fs::read_to_string(img.rootfs.join("etc/passwd")).unwrap();
    assert!(passwd.contains("nonroot:x:65532:65532"), "{passwd}");
    assert!(img.rootfs.join("lib64/ld-linux-x86-64.so.2").exists());
    // It runs on the image's own libraries, not the host's.
    let ld = img.rootfs.join("lib64/ld-linux-x86-64.so.2");
    let libs = img.rootfs.join("lib/x86_64-linux-gnu");
    let out = std::process::Command::new(&ld)
        .args(["--inhibit-cache", "--library-path"])
        .arg(&libs)
        .arg(&entry)
        .arg("--help")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{bin} --help on the image's libraries: {}",
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
