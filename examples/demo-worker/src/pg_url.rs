//! Where the demo worker gets its PostgreSQL connection string, and how it
//! names the database in logs.
//!
//! The string usually carries a password, so it is never a flag: a command
//! line is readable by every user of the host (`ps`, `/proc/*/cmdline`), and
//! clap prints a flag's environment value in `--help`. It comes from a file
//! (`--pg-url-file`, e.g. a mounted Secret) or from the environment
//! ([`ENV`]), and is kept only as a parsed [`tokio_postgres::Config`], whose
//! `Debug` hides the password; logs use [`describe`].

use std::path::Path;

use anyhow::{Context, anyhow};
use tokio_postgres::Config;
use tokio_postgres::config::Host;

/// The environment variable with the connection string when no file is given.
pub const ENV: &str = "BATCHLEASE_PG_URL";

/// The connection string from `file` (surrounding whitespace trimmed: a
/// Secret's file may end with a newline), or else from [`ENV`]; `None`
/// when neither is given (the demo then runs without the fenced store).
pub fn load(file: Option<&Path>) -> anyhow::Result<Option<Config>> {
    let raw = match file {
        Some(path) => std::fs::read_to_string(path)
            .with_context(|| format!("reading --pg-url-file {}", path.display()))?,
        None => match std::env::var(ENV) {
            Ok(raw) => raw,
            Err(std::env::VarError::NotPresent) => return Ok(None),
            Err(e) => return Err(e).with_context(|| format!("reading {ENV}")),
        },
    };
    parse(raw.trim()).map(Some)
}

/// Parses a `postgres://` URL or libpq `key=value` pairs. The parser's own
/// message is not passed on: it may quote part of the string.
fn parse(s: &str) -> anyhow::Result<Config> {
    s.parse().map_err(|_| {
        anyhow!(
            "the PostgreSQL connection string is not valid (expected a postgres:// URL or \
             libpq key=value pairs)"
        )
    })
}

/// `user@host:port/dbname` of `config`, for logs and errors: everything
/// needed to tell which database is meant, never the password.
pub fn describe(config: &Config) -> String {
    let user = config.get_user().unwrap_or("(default user)");
    let ports = config.get_ports();
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .enumerate()
        .map(|(i, host)| {
            let host = match host {
                Host::Tcp(name) => name.clone(),
                Host::Unix(path) => path.display().to_string(),
            };
            // One port for all hosts, or one per host.
            match ports.get(i).or_else(|| ports.first()) {
                Some(port) => format!("{host}:{port}"),
                None => host,
            }
        })
        .collect();
    let hosts = if hosts.is_empty() {
        "(default host)".to_owned()
    } else {
        hosts.join(",")
    };
    let db = config.get_dbname().unwrap_or("(default database)");
    format!("{user}@{hosts}/{db}")
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
            let config = parse(s).unwrap();
            assert_eq!(describe(&config), "app@db.example:5433/tasks", "{s}");
            assert!(!format!("{config:?}").contains("s3cret"), "{s}");
        }
    }

    #[test]
    fn an_invalid_string_is_not_quoted_in_the_error() {
        let err = parse("host='db password=s3cret-pw").unwrap_err();
        assert!(!format!("{err:#}").contains("s3cret"), "{err:#}");
    }

    #[test]
    fn from_a_file_trimmed() {
        let dir = std::env::temp_dir().join(format!("pg-url-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("url");
        std::fs::write(&file, "postgres://app:pw@h/db\n").unwrap();
        let config = load(Some(&file)).unwrap().unwrap();
        assert_eq!(config.get_password(), Some(&b"pw"[..]));
        assert_eq!(describe(&config), "app@h:5432/db");
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
