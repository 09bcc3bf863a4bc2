//! The images `hack/image.sh` writes, unpacked and checked the way an
//! engine would, and run with the real OCI runtime (runc, built by
//! `e2e/oci/build.sh`).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail, ensure};
use serde_json::{Value, json};

/// A tool of `e2e/oci/build.sh` or an input of `hack/test.sh`.
pub fn env(name: &str) -> anyhow::Result<String> {
    std::env::var(name).with_context(|| {
        format!("{name} unset: run hack/test.sh (it builds the images with hack/image.sh and the OCI tools with e2e/oci/build.sh)")
    })
}

/// The archive of image `bin` (`batchlease-operator`, …) of this version.
pub fn archive(bin: &str) -> anyhow::Result<PathBuf> {
    let dir = env("BATCHLEASE_IMAGE_DIR")?;
    let path = Path::new(&dir).join(format!("{bin}-{}.oci.tar", env!("CARGO_PKG_VERSION")));
    ensure!(path.is_file(), "no image archive {}", path.display());
    Ok(path)
}

fn run(cmd: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .with_context(|| format!("running {cmd}"))?;
    ensure!(
        out.status.success(),
        "{cmd} {} failed: {}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// An image archive taken apart: its OCI index, manifest and config, the
/// Docker `manifest.json`, and its layers unpacked in order.
#[derive(Debug)]
pub struct Unpacked {
    pub index: Value,
    pub manifest: Value,
    pub config: Value,
    pub docker_manifest: Value,
    pub rootfs: PathBuf,
}

/// Unpacks `archive` under `into`, checking every blob against its digest
/// and every layer against its `diff_id`.
pub fn unpack(archive: &Path, into: &Path) -> anyhow::Result<Unpacked> {
    let layout = into.join("layout");
    std::fs::create_dir_all(&layout)?;
    run(
        "tar",
        &[
            "-xf",
            &archive.to_string_lossy(),
            "-C",
            &layout.to_string_lossy(),
        ],
    )?;
    let read = |rel: &str| -> anyhow::Result<Value> {
        let text =
            std::fs::read_to_string(layout.join(rel)).with_context(|| format!("reading {rel}"))?;
        Ok(serde_json::from_str(&text)?)
    };
    let blob = |digest: &str| -> anyhow::Result<PathBuf> {
        let hex = digest
            .strip_prefix("sha256:")
            .context("not a sha256 digest")?;
        let path = layout.join("blobs/sha256").join(hex);
        let sum = run("sha256sum", &[&path.to_string_lossy()])?;
        ensure!(
            sum.starts_with(hex),
            "blob {digest} does not match its digest"
        );
        Ok(path)
    };
    let oci_layout = read("oci-layout")?;
    ensure!(oci_layout["imageLayoutVersion"] == "1.0.0", "{oci_layout}");
    let index = read("index.json")?;
    let desc = &index["manifests"][0];
    let manifest: Value = serde_json::from_slice(&std::fs::read(blob(
        desc["digest"].as_str().context("no manifest digest")?,
    )?)?)?;
    let config: Value = serde_json::from_slice(&std::fs::read(blob(
        manifest["config"]["digest"]
            .as_str()
            .context("no config digest")?,
    )?)?)?;
    let rootfs = into.join("rootfs");
    std::fs::create_dir_all(&rootfs)?;
    let layers = manifest["layers"].as_array().context("no layers")?;
    let diff_ids = config["rootfs"]["diff_ids"]
        .as_array()
        .context("no diff_ids")?;
    ensure!(
        layers.len() == diff_ids.len(),
        "layers and diff_ids differ in number"
    );
    for (layer, diff_id) in layers.iter().zip(diff_ids) {
        ensure!(
            layer["mediaType"] == "application/vnd.oci.image.layer.v1.tar+gzip",
            "{layer}"
        );
        let path = blob(layer["digest"].as_str().context("no layer digest")?)?;
        let raw = run(
            "sh",
            &[
                "-c",
                "gzip -dc \"$1\" | sha256sum",
                "sh",
                &path.to_string_lossy(),
            ],
        )?;
        let want = diff_id
            .as_str()
            .unwrap_or_default()
            .trim_start_matches("sha256:");
        ensure!(
            raw.starts_with(want),
            "layer {layer} does not match its diff_id {diff_id}"
        );
        run(
            "tar",
            &[
                "-xzf",
                &path.to_string_lossy(),
                "-C",
                &rootfs.to_string_lossy(),
                "--same-owner",
            ],
        )?;
    }
    Ok(Unpacked {
        index,
        manifest,
        config,
        docker_manifest: read("manifest.json")?,
        rootfs,
    })
}

/// Whether runc can run containers here, and if not, why.
pub fn runc_usable() -> Result<String, String> {
    let runc = env("BATCHLEASE_RUNC").map_err(|e| e.to_string())?;
    let uid = run("id", &["-u"]).map_err(|e| e.to_string())?;
    if uid.trim() != "0" {
        return Err(format!(
            "runc needs root to create namespaces and cgroups; the tests run as uid {}",
            uid.trim()
        ));
    }
    if !Path::new("/sys/fs/cgroup").is_dir() {
        return Err("no /sys/fs/cgroup: runc cannot place the container in a cgroup".into());
    }
    Ok(runc)
}

/// A runc bundle's `config.json`: runc's own default spec (`runc spec`),
/// changed as a pod with the chart's security context and host networking
/// would be: the image's entrypoint + `args`, its user, `env` on top of the
/// image's, a read-only root, no capabilities, no new privileges, and
/// `mounts` (host path → container path, read-only) bind-mounted.
///
/// Host networking: the control plane listens on the host's loopback and
/// there is no CNI here to give a network namespace a route to it.
pub fn bundle_config(
    runc: &str,
    bundle: &Path,
    image: &Unpacked,
    args: &[String],
    env: &[(String, String)],
    hostname: &str,
    mounts: &[(PathBuf, &str)],
) -> anyhow::Result<()> {
    run(runc, &["spec", "--bundle", &bundle.to_string_lossy()])?;
    let path = bundle.join("config.json");
    let mut spec: Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
    let cfg = &image.config["config"];
    let mut argv: Vec<String> = cfg["Entrypoint"]
        .as_array()
        .context("no Entrypoint")?
        .iter()
        .filter_map(|v| v.as_str().map(String::from))
        .collect();
    argv.extend(args.iter().cloned());
    let (uid, gid) = cfg["User"]
        .as_str()
        .and_then(|u| u.split_once(':'))
        .and_then(|(u, g)| Some((u.parse::<u32>().ok()?, g.parse::<u32>().ok()?)))
        .context("the image's User is not UID:GID")?;
    let mut envs: Vec<String> = cfg["Env"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default();
    envs.extend(env.iter().map(|(k, v)| format!("{k}={v}")));
    spec["process"]["args"] = json!(argv);
    spec["process"]["env"] = json!(envs);
    spec["process"]["terminal"] = json!(false);
    spec["process"]["user"] = json!({"uid": uid, "gid": gid});
    spec["process"]["cwd"] = json!(cfg["WorkingDir"].as_str().unwrap_or("/"));
    spec["process"]["noNewPrivileges"] = json!(true);
    spec["process"]["capabilities"] =
        json!({"bounding": [], "effective": [], "permitted": [], "ambient": []});
    spec["root"] = json!({"path": image.rootfs, "readonly": true});
    spec["hostname"] = json!(hostname);
    let extra = mounts.iter().map(|(src, dst)| {
        json!({"destination": dst, "type": "bind", "source": src, "options": ["rbind", "ro"]})
    });
    spec["mounts"]
        .as_array_mut()
        .context("no mounts in runc's spec")?
        .extend(extra);
    // The pod's /tmp is an emptyDir; a read-only root has none.
    spec["mounts"].as_array_mut().context("no mounts")?.push(
        json!({"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev", "mode=1777"]}),
    );
    let namespaces = spec["linux"]["namespaces"]
        .as_array_mut()
        .context("no namespaces in runc's spec")?;
    namespaces.retain(|n| n["type"] != "network");
    std::fs::write(&path, serde_json::to_vec_pretty(&spec)?)?;
    Ok(())
}

/// A container runc runs; killed and deleted when dropped.
#[derive(Debug)]
pub struct Container {
    runc: String,
    state: PathBuf,
    id: String,
    pub process: crate::process::Process,
}

impl Container {
    /// `runc run` of `bundle` in the foreground, its output in the log of
    /// `process`.
    pub fn run(
        runc: &str,
        state: &Path,
        bundle: &Path,
        group: &str,
        id: &str,
    ) -> anyhow::Result<Self> {
        let process = crate::process::Process::start(
            runc.into(),
            group,
            &format!("runc-{id}"),
            vec![
                format!("--root={}", state.display()),
                "run".into(),
                format!("--bundle={}", bundle.display()),
                id.into(),
            ],
            Vec::new(),
        )?;
        Ok(Self {
            runc: runc.into(),
            state: state.into(),
            id: id.into(),
            process,
        })
    }

    /// `runc state`'s status (`running`, `stopped`, …).
    pub fn status(&self) -> anyhow::Result<String> {
        let out = run(
            &self.runc,
            &[
                &format!("--root={}", self.state.display()),
                "state",
                &self.id,
            ],
        )?;
        let v: Value = serde_json::from_str(&out)?;
        match v["status"].as_str() {
            Some(s) => Ok(s.into()),
            None => bail!("no status in {out}"),
        }
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        let root = format!("--root={}", self.state.display());
        let _ = Command::new(&self.runc)
            .args([root.as_str(), "delete", "--force", &self.id])
            .output();
    }
}
