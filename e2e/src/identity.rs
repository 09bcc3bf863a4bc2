//! A client identity of its own for each component a test starts, so the
//! API server's audit log tells who wrote what (all would be `admin`
//! otherwise).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

use crate::secrets::PrivateDir;

/// Writes a kubeconfig in `dir` that authenticates as user `name` (a
/// client certificate signed by the test CA, in group `system:masters`, so
/// authorization is as for the admin) and returns its path. The key and
/// the kubeconfig are 0600; all of it goes when `dir` is dropped.
pub fn kubeconfig_as(name: &str, dir: &PrivateDir) -> anyhow::Result<PathBuf> {
    let cp = std::env::var("BATCHLEASE_CP_DIR").context("BATCHLEASE_CP_DIR unset")?;
    let pki = Path::new(&cp).join("pki");
    // Created 0600 before openssl writes the key into it (it truncates and
    // keeps the mode), whatever mode this openssl would have chosen.
    let key = dir.write(&format!("{name}.key"), "")?;
    let csr = dir.path().join(format!("{name}.csr"));
    let crt = dir.path().join(format!("{name}.crt"));
    // Extensions make it an X.509 v3 certificate (rustls refuses v1).
    let ext = dir.path().join(format!("{name}.ext"));
    std::fs::write(
        &ext,
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth\n",
    )?;
    let subject = format!("/O=system:masters/CN={name}");
    let steps: [Vec<&str>; 3] = [
        vec![
            "genpkey",
            "-algorithm",
            "EC",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-out",
        ],
        vec!["req", "-new", "-subj", &subject, "-key"],
        vec!["x509", "-req", "-days", "2", "-CAcreateserial", "-in"],
    ];
    let run = |args: Vec<String>| -> anyhow::Result<()> {
        let out = Command::new("openssl").args(&args).output()?;
        if !out.status.success() {
            bail!(
                "openssl {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    };
    let p = |p: &Path| p.display().to_string();
    let mut a: Vec<String> = steps[0].iter().map(|s| s.to_string()).collect();
    a.push(p(&key));
    run(a)?;
    let mut a: Vec<String> = steps[1].iter().map(|s| s.to_string()).collect();
    a.extend([p(&key), "-out".into(), p(&csr)]);
    run(a)?;
    let mut a: Vec<String> = steps[2].iter().map(|s| s.to_string()).collect();
    a.extend([
        p(&csr),
        "-CA".into(),
        p(&pki.join("ca.crt")),
        "-CAkey".into(),
        p(&pki.join("ca.key")),
        "-CAserial".into(),
        p(&dir.path().join("ca.srl")),
        "-extfile".into(),
        p(&ext),
        "-out".into(),
        p(&crt),
    ]);
    run(a)?;
    let admin = std::fs::read_to_string(std::env::var("KUBECONFIG")?)?;
    let mine = admin
        .replace(&p(&pki.join("admin.crt")), &p(&crt))
        .replace(&p(&pki.join("admin.key")), &p(&key));
    dir.write(&format!("{name}.kubeconfig"), &mine)
}
