//! The attempt's private directory: the payload, checkpoint and result
//! files live in a fresh 0700 directory (another user of the host must
//! not read a payload or forge a result), removed when the attempt is over.

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// A directory removed on drop.
#[derive(Debug)]
pub struct PrivateDir {
    path: PathBuf,
}

impl PrivateDir {
    /// `root/batchlease-run.<pid>.<token>.<random>`, mode 0700.
    pub fn create(root: &Path, token: i64) -> std::io::Result<Self> {
        let path = root.join(format!(
            "batchlease-run.{}.{token}.{:08x}",
            std::process::id(),
            rand_suffix()
        ));
        std::fs::DirBuilder::new().mode(0o700).create(&path)?;
        Ok(Self { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `name` (mode 0600) with `content`.
    pub fn write(&self, name: &str, content: &[u8]) -> std::io::Result<PathBuf> {
        let p = self.path.join(name);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&p)?;
        f.write_all(content)?;
        Ok(p)
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

fn rand_suffix() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    // A per-process random key (std's SipHash seed), no extra dependency.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish() as u32
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn private_and_removed() {
        let d = PrivateDir::create(&std::env::temp_dir(), 7).unwrap();
        let p = d.path().to_owned();
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o700
        );
        let f = d.write("a", b"x").unwrap();
        assert_eq!(
            std::fs::metadata(&f).unwrap().permissions().mode() & 0o777,
            0o600
        );
        drop(d);
        assert!(!p.exists());
    }
}
