//! Where the demo worker gets its PostgreSQL connection string.
//!
//! The string usually carries a password, so it is never a flag: a command
//! line is readable by every user of the host (`ps`, `/proc/*/cmdline`), and
//! clap prints a flag's environment value in `--help`. It comes from a file
//! (`--pg-url-file`, e.g. a mounted Secret) or from the environment
//! ([`ENV`]), and is kept only as the SDK's parsed
//! [`ConnectOptions`], whose `Debug` and `describe()` hide the password.
//! TLS is the SDK's: `sslmode` (`disable` … `verify-full`) and
//! `sslrootcert` (a CA file, or `system`) in the string, else
//! `PGSSLMODE` / `PGSSLROOTCERT`.

use std::path::Path;

use anyhow::Context;
use batchlease_worker_sdk::postgres::ConnectOptions;

/// The environment variable with the connection string when no file is given.
pub const ENV: &str = "BATCHLEASE_PG_URL";

/// The connection string from `file` (surrounding whitespace trimmed: a
/// Secret's file may end with a newline), or else from [`ENV`]; `None`
/// when neither is given (the demo then runs without the fenced store).
pub fn load(file: Option<&Path>) -> anyhow::Result<Option<ConnectOptions>> {
    let raw = match file {
        Some(path) => std::fs::read_to_string(path)
            .with_context(|| format!("reading --pg-url-file {}", path.display()))?,
        None => match std::env::var(ENV) {
            Ok(raw) => raw,
            Err(std::env::VarError::NotPresent) => return Ok(None),
            Err(e) => return Err(e).with_context(|| format!("reading {ENV}")),
        },
    };
    // The SDK's errors never quote the string.
    Ok(Some(ConnectOptions::parse(raw.trim())?))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn described_and_debugged_without_the_password() {
        for s in [
            "postgres://app:s3cret-pw@db.example:5433/tasks?sslmode=disable",
            "host=db.example port=5433 user=app password=s3cret-pw dbname=tasks",
            "postgres://app@db.example:5433/tasks?password=s3cret-pw",
        ] {
            let pg = ConnectOptions::parse(s).unwrap();
            assert!(
                pg.describe()
                    .starts_with("app@db.example:5433/tasks (sslmode="),
                "{s}"
            );
            assert!(!format!("{pg:?}").contains("s3cret"), "{s}");
        }
    }

    #[test]
    fn an_invalid_string_is_not_quoted_in_the_error() {
        let err = ConnectOptions::parse("host='db password=s3cret-pw").unwrap_err();
        assert!(!format!("{err:#}").contains("s3cret"), "{err:#}");
    }

    #[test]
    fn from_a_file_trimmed() {
        let dir = std::env::temp_dir().join(format!("pg-url-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("url");
        std::fs::write(&file, "postgres://app:pw@h/db\n").unwrap();
        let pg = load(Some(&file)).unwrap().unwrap();
        assert_eq!(pg.config().get_password(), Some(&b"pw"[..]));
        assert!(pg.describe().starts_with("app@h:5432/db (sslmode="));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_missing_file_is_an_error_not_no_store() {
        let missing = std::env::temp_dir().join("pg-url-test-no-such-file");
        let err = load(Some(&missing)).unwrap_err();
        assert!(
            format!("{err:#}").contains("reading --pg-url-file"),
            "{err:#}"
        );
    }
}
