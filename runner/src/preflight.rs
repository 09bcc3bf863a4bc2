//! Checks made once at start, before the first claim: what is wrong with
//! the worker itself (a typo in the command, an image without it, a
//! read-only temp directory) must stop the worker with a message naming
//! the fix, not be charged to tasks. Claimed first, each of those faults
//! would fail every attempt the same way and dead-letter the whole queue
//! as fast as the runner could claim it.

use std::ffi::OsString;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use crate::workdir::PrivateDir;

/// Why the runner refuses to start.
#[derive(Debug, thiserror::Error)]
pub enum PreflightError {
    #[error(
        "command {program:?} not found on PATH ({path}): check the command after `--` (a typo, or an image without it)"
    )]
    NotOnPath { program: String, path: String },
    #[error("command {0:?} does not exist: check the command after `--`")]
    Missing(PathBuf),
    #[error(
        "command {0:?} is not an executable file (chmod +x, or run it through its interpreter)"
    )]
    NotExecutable(PathBuf),
    #[error(
        "the work directory {dir:?} is not writable ({source}): each attempt gets a private directory there. On a read-only root filesystem mount an emptyDir at /tmp (the worker chart does: tmp.enabled), or set BATCHLEASE_WORK_DIR/TMPDIR to a writable directory"
    )]
    WorkDir {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The file `program` runs: itself when it names a path (has a `/`), else
/// the first executable match on `path` (what `execvp` does).
pub fn resolve(program: &str, path: Option<OsString>) -> Result<PathBuf, PreflightError> {
    if program.contains('/') {
        let p = PathBuf::from(program);
        return match std::fs::metadata(&p) {
            Ok(m) if is_executable(&m) => Ok(p),
            Ok(_) => Err(PreflightError::NotExecutable(p)),
            Err(_) => Err(PreflightError::Missing(p)),
        };
    }
    let path = path.unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|candidate| std::fs::metadata(candidate).is_ok_and(|m| is_executable(&m)))
        .ok_or_else(|| PreflightError::NotOnPath {
            program: program.to_owned(),
            path: path.to_string_lossy().into_owned(),
        })
}

fn is_executable(m: &std::fs::Metadata) -> bool {
    m.is_file() && m.permissions().mode() & 0o111 != 0
}

/// Makes and removes one private directory under `root`, as an attempt
/// would.
pub fn work_dir(root: &Path) -> Result<(), PreflightError> {
    PrivateDir::create(root, 0)
        .map(drop)
        .map_err(|source| PreflightError::WorkDir {
            dir: root.to_owned(),
            source,
        })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn scratch() -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "preflight-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn file(dir: &Path, name: &str, mode: u32) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        p
    }

    #[test]
    fn a_command_is_found_on_path_like_execvp_finds_it() {
        let d = scratch();
        let a = d.join("a");
        let b = d.join("b");
        std::fs::create_dir_all(&a).unwrap();
        std::fs::create_dir_all(&b).unwrap();
        // Not executable in the first directory: skipped, as execvp does.
        file(&a, "job", 0o644);
        let found = file(&b, "job", 0o755);
        let path = std::env::join_paths([&a, &b]).unwrap();
        assert_eq!(resolve("job", Some(path.clone())).unwrap(), found);
        let err = resolve("jbo", Some(path)).unwrap_err();
        assert!(matches!(err, PreflightError::NotOnPath { .. }), "{err}");
        assert!(
            err.to_string().contains("\"jbo\" not found on PATH"),
            "{err}"
        );
        assert!(matches!(
            resolve("job", None).unwrap_err(),
            PreflightError::NotOnPath { .. }
        ));
    }

    #[test]
    fn a_path_must_exist_and_be_an_executable_file() {
        let d = scratch();
        let ok = file(&d, "run.sh", 0o700);
        let plain = file(&d, "data.sh", 0o600);
        assert_eq!(resolve(ok.to_str().unwrap(), None).unwrap(), ok);
        assert!(matches!(
            resolve(plain.to_str().unwrap(), None).unwrap_err(),
            PreflightError::NotExecutable(_)
        ));
        assert!(matches!(
            resolve(d.join("nope").to_str().unwrap(), None).unwrap_err(),
            PreflightError::Missing(_)
        ));
        // A directory is not a command, whatever its mode.
        assert!(matches!(
            resolve(d.to_str().unwrap(), None).unwrap_err(),
            PreflightError::NotExecutable(_)
        ));
    }

    #[test]
    fn the_work_directory_must_take_an_attempt_s_directory() {
        let d = scratch();
        work_dir(&d).unwrap();
        // Nothing is left behind.
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 0);
        let err = work_dir(&d.join("missing")).unwrap_err();
        assert!(
            err.to_string().contains("mount an emptyDir at /tmp"),
            "{err}"
        );
    }
}
