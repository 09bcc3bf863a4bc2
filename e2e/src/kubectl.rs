//! Running the real `kubectl` (and `helm`) built by `e2e/controlplane/build.sh`.

use std::process::Command;

use anyhow::Context;

/// What a finished command printed.
#[derive(Debug)]
pub struct Output {
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    /// stdout and stderr together, for diagnostics.
    pub fn combined(&self) -> String {
        format!("{}{}", self.stdout, self.stderr)
    }
}

/// The kubectl binary: `$BATCHLEASE_KUBECTL`, which the control plane's env
/// file sets to the v1.37 build (the machine's own kubectl may be too old).
pub fn binary() -> String {
    std::env::var("BATCHLEASE_KUBECTL").unwrap_or_else(|_| "kubectl".into())
}

/// Runs kubectl with `args`, from the repository root so relative paths such
/// as `examples/` work.
pub fn run(args: &[&str]) -> anyhow::Result<Output> {
    let root = crate::repo_root();
    let out = Command::new(binary())
        .args(args)
        .current_dir(root)
        .output()
        .with_context(|| format!("running {} {}", binary(), args.join(" ")))?;
    Ok(Output {
        success: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    })
}

/// Runs kubectl and keeps at most `max` bytes of its stdout, then stops
/// it: diagnostics of a namespace holding a 10,000-level object would
/// otherwise be YAML of quadratic size (every level indents further).
pub fn run_capped(args: &[&str], max: usize) -> anyhow::Result<String> {
    use std::io::Read;
    let root = crate::repo_root();
    let mut child = Command::new(binary())
        .args(args)
        .current_dir(root)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .with_context(|| format!("running {} {}", binary(), args.join(" ")))?;
    let mut out = Vec::new();
    if let Some(stdout) = child.stdout.take() {
        stdout.take(max as u64 + 1).read_to_end(&mut out)?;
    }
    let cut = out.len() > max;
    let _ = child.kill();
    let _ = child.wait();
    out.truncate(max);
    let mut text = String::from_utf8_lossy(&out).into_owned();
    if cut {
        text.push_str(&format!("\n… (cut at {max} bytes)\n"));
    }
    Ok(text)
}

/// Runs kubectl and fails with its output unless it succeeded.
pub fn ok(args: &[&str]) -> anyhow::Result<String> {
    let out = run(args)?;
    anyhow::ensure!(
        out.success,
        "kubectl {} failed:\n{}",
        args.join(" "),
        out.combined()
    );
    Ok(out.stdout)
}

/// A kubeconfig that authenticates as ServiceAccount `sa` of `namespace`
/// with a fresh token (TokenRequest), against the same server and CA as
/// `KUBECONFIG`. Written to `dir` (0600: the token is good for an hour).
pub fn service_account_kubeconfig(
    namespace: &str,
    sa: &str,
    dir: &crate::secrets::PrivateDir,
) -> anyhow::Result<std::path::PathBuf> {
    let token = ok(&["create", "token", sa, "-n", namespace, "--duration=1h"])?;
    token_kubeconfig(namespace, sa, token.trim(), dir)
}

/// Like [`service_account_kubeconfig`], with a token bound to Pod `pod`
/// (`kubectl create token --bound-object-kind Pod`): the API server then
/// names the pod in the request's user info
/// (`authentication.kubernetes.io/pod-name`), as it does for a real pod's
/// projected token.
pub fn pod_token_kubeconfig(
    namespace: &str,
    sa: &str,
    pod: &str,
    dir: &crate::secrets::PrivateDir,
) -> anyhow::Result<std::path::PathBuf> {
    let uid = ok(&[
        "get",
        "pod",
        pod,
        "-n",
        namespace,
        "-o",
        "jsonpath={.metadata.uid}",
    ])?;
    let token = ok(&[
        "create",
        "token",
        sa,
        "-n",
        namespace,
        "--duration=1h",
        "--bound-object-kind=Pod",
        &format!("--bound-object-name={pod}"),
        &format!("--bound-object-uid={}", uid.trim()),
    ])?;
    token_kubeconfig(namespace, pod, token.trim(), dir)
}

/// A kubeconfig for `token` (user and file named `name`).
fn token_kubeconfig(
    namespace: &str,
    name: &str,
    token: &str,
    dir: &crate::secrets::PrivateDir,
) -> anyhow::Result<std::path::PathBuf> {
    let admin = std::fs::read_to_string(std::env::var("KUBECONFIG")?)?;
    let field = |key: &str| {
        admin
            .lines()
            .find_map(|l| l.trim().strip_prefix(key).map(|v| v.trim().to_owned()))
            .ok_or_else(|| anyhow::anyhow!("no {key} in KUBECONFIG"))
    };
    let (server, ca) = (field("server:")?, field("certificate-authority:")?);
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: e2e\n  cluster:\n    server: {server}\n    certificate-authority: {ca}\n\
         users:\n- name: {name}\n  user:\n    token: {token}\ncontexts:\n- name: {name}\n  context: {{cluster: e2e, user: {name}, namespace: {namespace}}}\n\
         current-context: {name}\n"
    );
    dir.write(&format!("kubeconfig-{name}"), &text)
}
