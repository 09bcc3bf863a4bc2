//! Where the tests keep credentials: ServiceAccount tokens, client keys and
//! the kubeconfigs that carry or point at them.
//!
//! They used to go to `<tmp>/batchlease-e2e-<namespace>` with default modes
//! (0755 directory, 0644 files: any local user could read a token good for
//! an hour against the test control plane) and were never removed. A
//! [`PrivateDir`] is 0700, its files 0600, and it is removed when its owner
//! (the test, the [`crate::operator::Operator`], the soak) drops it.
//!
//! Hand-rolled rather than the `tempfile` crate: a dozen lines of `std`
//! with `rand` (already a dependency) instead of a new dependency tree in
//! the shared lock file.

use std::fs::{DirBuilder, OpenOptions, Permissions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::Context;

/// A fresh directory under the system temp dir that only the current user
/// can enter (0700), removed with everything in it when dropped.
#[derive(Debug)]
pub struct PrivateDir {
    path: PathBuf,
}

impl PrivateDir {
    /// Creates `<tmp>/batchlease-e2e-<label>-<random>`.
    pub fn new(label: &str) -> anyhow::Result<Self> {
        let base = std::env::temp_dir();
        for _ in 0..16 {
            let suffix: u64 = rand::random();
            let path = base.join(format!("batchlease-e2e-{label}-{suffix:016x}"));
            // Created 0700 (the umask can only take bits away), so it is
            // never more open than that; `create` fails on an existing
            // path, so nobody else's directory is ever adopted.
            match DirBuilder::new().mode(0o700).create(&path) {
                Ok(()) => {
                    let dir = Self { path };
                    // Exactly 0700 whatever the umask (0700 & !umask could
                    // lack the owner's bits).
                    std::fs::set_permissions(&dir.path, Permissions::from_mode(0o700))
                        .with_context(|| format!("chmod 0700 {}", dir.path.display()))?;
                    return Ok(dir);
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => {
                    return Err(e).with_context(|| format!("creating {}", path.display()));
                }
            }
        }
        anyhow::bail!(
            "no fresh directory name under {} in 16 tries",
            base.display()
        )
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `contents` to file `name` in the directory, mode 0600, and
    /// returns its path. An existing file is replaced, and made 0600 before
    /// anything is written to it.
    pub fn write(&self, name: &str, contents: &str) -> anyhow::Result<PathBuf> {
        let path = self.path.join(name);
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        // `mode` applies only to a file that did not exist yet.
        f.set_permissions(Permissions::from_mode(0o600))
            .with_context(|| format!("chmod 0600 {}", path.display()))?;
        f.write_all(contents.as_bytes())
            .with_context(|| format!("writing {}", path.display()))?;
        Ok(path)
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        // Best effort: a failure here must not turn into a panic in drop,
        // and nothing in the directory is worth keeping for a post-mortem.
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn the_directory_is_0700_and_fresh() {
        let a = PrivateDir::new("unit").unwrap();
        let b = PrivateDir::new("unit").unwrap();
        assert_eq!(mode(a.path()), 0o700);
        assert_ne!(a.path(), b.path());
        assert!(a.path().starts_with(std::env::temp_dir()));
    }

    #[test]
    fn files_are_0600_even_when_they_existed_with_a_wider_mode() {
        let dir = PrivateDir::new("unit").unwrap();
        let fresh = dir.write("kubeconfig", "token: secret\n").unwrap();
        assert_eq!(mode(&fresh), 0o600);
        assert_eq!(std::fs::read_to_string(&fresh).unwrap(), "token: secret\n");

        let old = dir.path().join("old");
        std::fs::write(&old, "a longer earlier content").unwrap();
        std::fs::set_permissions(&old, Permissions::from_mode(0o644)).unwrap();
        dir.write("old", "new").unwrap();
        assert_eq!(mode(&old), 0o600);
        assert_eq!(std::fs::read_to_string(&old).unwrap(), "new");
    }

    #[test]
    fn dropping_removes_the_directory_and_its_files() {
        let dir = PrivateDir::new("unit").unwrap();
        let path = dir.path().to_owned();
        dir.write("kubeconfig", "token: secret\n").unwrap();
        std::fs::create_dir(path.join("sub")).unwrap();
        dir.write("sub/key", "k").unwrap();
        drop(dir);
        assert!(!path.exists(), "{} still exists", path.display());
    }
}
