//! Opening connections to PostgreSQL, over TLS where the connection string
//! asks for it, with libpq's meaning of `sslmode` and `sslrootcert`.
//!
//! `tokio-postgres` parses `sslmode=disable|prefer|require` only and has
//! no TLS of its own; managed PostgreSQL services require TLS and document
//! `sslmode=verify-full` with their CA file. [`ConnectOptions`] reads both
//! parameters (in a `postgres://` URL or in libpq `key=value` pairs, else
//! from `PGSSLMODE` / `PGSSLROOTCERT`), hands the rest of the string to
//! `tokio-postgres`, and connects with rustls (`tokio-postgres-rustls`; no
//! OpenSSL):
//!
//! | `sslmode` | TLS | server certificate |
//! |---|---|---|
//! | `disable` | never | — |
//! | `allow`, `prefer` (default) | if the server offers it | not checked (checked against `sslrootcert` when one is given) |
//! | `require` | always | not checked, or as `verify-ca` when `sslrootcert` is given (libpq's rule) |
//! | `verify-ca` | always | signed by a CA of `sslrootcert` |
//! | `verify-full` | always | signed by a CA of `sslrootcert` **and** issued for the host name (or IP address) connected to |
//!
//! `sslrootcert` is a PEM file of one or more CA certificates, or `system`
//! for the host's trust store (then `sslmode` defaults to, and must be,
//! `verify-full`, as in libpq 16). The verifying modes without
//! `sslrootcert` read `~/.postgresql/root.crt` when it exists and are an
//! error otherwise. Client certificates (`sslcert`, `sslkey`) are not
//! supported.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::future::BoxFuture;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use rustls::{ClientConfig, RootCertStore};
use tokio_postgres::Client;
use tokio_postgres::config::Host;
use tokio_postgres_rustls::MakeRustlsConnect;

use super::tls_verify::{ChainOnly, Unchecked};

/// The value of `sslmode` (libpq's names; `allow` is read as `prefer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SslMode {
    /// No TLS.
    Disable,
    /// TLS if the server offers it (the default).
    Prefer,
    /// TLS always; the certificate is checked only when `sslrootcert` is
    /// given.
    Require,
    /// TLS always, the certificate signed by a CA of `sslrootcert`.
    VerifyCa,
    /// As `VerifyCa`, and the certificate names the host connected to.
    VerifyFull,
}

impl SslMode {
    fn parse(s: &str) -> Result<Self, ConnectError> {
        Ok(match s {
            "disable" => Self::Disable,
            "allow" | "prefer" => Self::Prefer,
            "require" => Self::Require,
            "verify-ca" => Self::VerifyCa,
            "verify-full" => Self::VerifyFull,
            _ => return Err(ConnectError::SslMode),
        })
    }

    /// libpq's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Disable => "disable",
            Self::Prefer => "prefer",
            Self::Require => "require",
            Self::VerifyCa => "verify-ca",
            Self::VerifyFull => "verify-full",
        }
    }
}

impl fmt::Display for SslMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a connection string cannot be used. No variant quotes the string:
/// it usually carries a password.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// Not a `postgres://` URL nor libpq `key=value` pairs.
    #[error(
        "the PostgreSQL connection string is not valid ({0}; expected a postgres:// URL or \
         libpq key=value pairs)"
    )]
    Invalid(String),
    /// `sslmode` is not one of libpq's values.
    #[error("sslmode must be disable, allow, prefer, require, verify-ca or verify-full")]
    SslMode,
    /// `sslrootcert=system` with a mode weaker than `verify-full`.
    #[error(
        "sslrootcert=system needs sslmode=verify-full (the system's CAs sign certificates for \
         anyone; only the host name check makes them mean something), not sslmode={mode}"
    )]
    WeakModeWithSystemRoots { mode: SslMode },
    /// A verifying mode without a CA to verify with.
    #[error(
        "sslmode={mode} needs the server's CA certificate: sslrootcert=<PEM file> in the \
         connection string (or PGSSLROOTCERT), or sslrootcert=system for the system's CAs"
    )]
    NoRootCert { mode: SslMode },
    /// The `sslrootcert` file could not be read.
    #[error("reading sslrootcert {path}: {source}")]
    ReadRootCert {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The `sslrootcert` file holds no usable certificate.
    #[error("sslrootcert {path} holds no usable PEM certificate ({detail})")]
    BadRootCert { path: PathBuf, detail: String },
    /// `sslrootcert=system`, and the host's trust store had no certificate.
    #[error("sslrootcert=system: no CA certificate found in the system's trust store")]
    NoSystemRoots,
    /// rustls refused the TLS configuration.
    #[error("TLS configuration: {0}")]
    Tls(#[from] rustls::Error),
}

impl ConnectError {
    /// Low-cardinality label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Invalid(_) => "invalid",
            Self::SslMode => "sslmode",
            Self::WeakModeWithSystemRoots { .. } => "weak_sslmode",
            Self::NoRootCert { .. } => "no_root_cert",
            Self::ReadRootCert { .. } | Self::BadRootCert { .. } | Self::NoSystemRoots => {
                "root_cert"
            }
            Self::Tls(_) => "tls",
        }
    }
}

/// Where the CA certificates come from.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Roots {
    /// None given: the server's certificate is not checked.
    None,
    /// A PEM file.
    File(PathBuf),
    /// The host's trust store (`sslrootcert=system`).
    System,
}

/// A parsed connection string that opens connections, over TLS as its
/// `sslmode` says. Cheap to clone; `Debug` and [`describe`](Self::describe)
/// never show the password.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use batchlease_worker_sdk::postgres::ConnectOptions;
///
/// let pg: ConnectOptions =
///     "postgres://app@db.example:5432/tasks?sslmode=verify-full&sslrootcert=/etc/pg/ca.crt"
///         .parse()?;
/// let client = pg.connect().await?;
/// # let _ = client; Ok(()) }
/// ```
#[derive(Clone)]
pub struct ConnectOptions {
    config: tokio_postgres::Config,
    mode: SslMode,
    roots: Roots,
    tls: MakeRustlsConnect,
}

impl fmt::Debug for ConnectOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConnectOptions")
            // tokio-postgres hides the password in its Debug.
            .field("config", &self.config)
            .field("sslmode", &self.mode)
            .field("sslrootcert", &self.roots)
            .finish_non_exhaustive()
    }
}

impl std::str::FromStr for ConnectOptions {
    type Err = ConnectError;

    fn from_str(s: &str) -> Result<Self, ConnectError> {
        Self::parse(s)
    }
}

impl ConnectOptions {
    /// Parses a `postgres://` URL or libpq `key=value` pairs. `sslmode`
    /// and `sslrootcert` not in the string are taken from `PGSSLMODE` and
    /// `PGSSLROOTCERT` (no other `PG*` variable is read); a CA file is read
    /// now, so a wrong path fails here rather than at the first connection.
    pub fn parse(s: &str) -> Result<Self, ConnectError> {
        Self::parse_with_env(s, |name| std::env::var(name).ok())
    }

    fn parse_with_env(s: &str, env: impl Fn(&str) -> Option<String>) -> Result<Self, ConnectError> {
        let split = split_tls_params(s.trim())?;
        let mut config: tokio_postgres::Config =
            split.rest.parse().map_err(|e: tokio_postgres::Error| {
                // Only messages that name an option, never a value: the
                // parser's others may quote part of the string.
                let msg = std::error::Error::source(&e).map_or_else(String::new, |s| s.to_string());
                let named = ["unknown option", "invalid value for option"]
                    .iter()
                    .find_map(|p| msg.find(p).map(|i| msg[i..].to_owned()));
                ConnectError::Invalid(named.unwrap_or_else(|| "cannot parse it".into()))
            })?;
        // Every sslmode of the string was taken out above; one that
        // tokio-postgres still found sits where it was not looked for, and
        // would be overwritten below: refuse rather than guess.
        if config.get_ssl_mode() != tokio_postgres::Config::new().get_ssl_mode() {
            return Err(ConnectError::Invalid(
                "sslmode appears where it is not read (percent-encode `?` and `@` in the password)"
                    .into(),
            ));
        }
        let mode = split.sslmode.or_else(|| env("PGSSLMODE"));
        let root = split.sslrootcert.or_else(|| env("PGSSLROOTCERT"));
        let home_root = env("HOME").map(|h| Path::new(&h).join(".postgresql/root.crt"));
        let (mode, roots) = resolve(mode.as_deref(), root.as_deref(), home_root.as_deref())?;
        config.ssl_mode(match mode {
            SslMode::Disable => tokio_postgres::config::SslMode::Disable,
            SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => {
                tokio_postgres::config::SslMode::Require
            }
        });
        let tls = MakeRustlsConnect::new(client_config(mode, &roots)?);
        Ok(Self {
            config,
            mode,
            roots,
            tls,
        })
    }

    /// The `tokio-postgres` configuration (everything but the TLS
    /// settings, which this type applies).
    pub fn config(&self) -> &tokio_postgres::Config {
        &self.config
    }

    /// The `sslmode` in effect.
    pub fn ssl_mode(&self) -> SslMode {
        self.mode
    }

    /// `user@host:port/dbname (sslmode=…)`, for logs and errors: which
    /// database is meant and how, never the password.
    pub fn describe(&self) -> String {
        format!("{} (sslmode={})", describe_config(&self.config), self.mode)
    }

    /// Opens a connection and spawns its task (which logs how the
    /// connection ended, if with an error) on the SDK's PostgreSQL
    /// runtime, where a handler that computes without awaiting cannot
    /// starve it (see `io_runtime.rs`). The future owns what it needs:
    /// pass `move || options.connect()` to
    /// [`FencedPool::new`](super::FencedPool::new).
    pub fn connect(&self) -> BoxFuture<'static, Result<Client, tokio_postgres::Error>> {
        let (config, tls) = (self.config.clone(), self.tls.clone());
        Box::pin(async move {
            if let Some(io) = super::io_runtime::handle() {
                let (c, t) = (config.clone(), tls.clone());
                // The socket is registered with the reactor of the runtime
                // that opens it: open it there too.
                if let Ok(opened) = io.spawn(open_and_drive(c, t)).await {
                    return opened;
                }
                // The runtime is shutting down (the process is ending):
                // fall back to the caller's.
            }
            open_and_drive(config, tls).await
        })
    }
}

/// Opens a connection and spawns its task on the current runtime.
async fn open_and_drive(
    config: tokio_postgres::Config,
    tls: MakeRustlsConnect,
) -> Result<Client, tokio_postgres::Error> {
    let (client, connection) = config.connect(tls).await?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::warn!(error = %e, "PostgreSQL connection ended");
        }
    });
    Ok(client)
}

/// `user@host:port/dbname` of a `tokio-postgres` configuration.
fn describe_config(config: &tokio_postgres::Config) -> String {
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

/// libpq's rules: the mode (default `prefer`, `verify-full` with
/// `sslrootcert=system`) and where its CAs come from.
fn resolve(
    mode: Option<&str>,
    root: Option<&str>,
    home_root: Option<&Path>,
) -> Result<(SslMode, Roots), ConnectError> {
    let mode = mode.map(SslMode::parse).transpose()?;
    match root {
        Some("system") => match mode {
            None | Some(SslMode::VerifyFull) => Ok((SslMode::VerifyFull, Roots::System)),
            Some(mode) => Err(ConnectError::WeakModeWithSystemRoots { mode }),
        },
        Some(path) if !path.is_empty() => Ok((
            mode.unwrap_or(SslMode::Prefer),
            Roots::File(PathBuf::from(path)),
        )),
        _ => {
            let mode = mode.unwrap_or(SslMode::Prefer);
            if !matches!(mode, SslMode::VerifyCa | SslMode::VerifyFull) {
                return Ok((mode, Roots::None));
            }
            match home_root {
                Some(p) if p.is_file() => Ok((mode, Roots::File(p.to_owned()))),
                _ => Err(ConnectError::NoRootCert { mode }),
            }
        }
    }
}

/// What the server's certificate must satisfy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Check {
    /// Nothing (the handshake's signature is still verified).
    Nothing,
    /// Signed by one of the roots.
    Chain,
    /// Signed by one of the roots and issued for the server's name.
    ChainAndName,
}

fn check(mode: SslMode, roots: &Roots) -> Check {
    match (mode, roots) {
        (SslMode::VerifyFull, _) => Check::ChainAndName,
        (SslMode::VerifyCa, _) => Check::Chain,
        // libpq: with a CA file, `require` (and `prefer`, when TLS is
        // used) verify the chain.
        (_, Roots::File(_) | Roots::System) => Check::Chain,
        (_, Roots::None) => Check::Nothing,
    }
}

fn load_roots(roots: &Roots) -> Result<RootCertStore, ConnectError> {
    let mut store = RootCertStore::empty();
    match roots {
        Roots::None => {}
        Roots::File(path) => {
            let pem = std::fs::read(path).map_err(|source| ConnectError::ReadRootCert {
                path: path.clone(),
                source,
            })?;
            let bad = |detail: String| ConnectError::BadRootCert {
                path: path.clone(),
                detail,
            };
            for cert in CertificateDer::pem_slice_iter(&pem) {
                let cert = cert.map_err(|e| bad(e.to_string()))?;
                store.add(cert).map_err(|e| bad(e.to_string()))?;
            }
            if store.is_empty() {
                return Err(bad("no CERTIFICATE block".into()));
            }
        }
        Roots::System => {
            // Certificates the platform store holds but webpki cannot
            // parse are skipped, as every rustls user of it does.
            let found = rustls_native_certs::load_native_certs();
            store.add_parsable_certificates(found.certs);
            if store.is_empty() {
                return Err(ConnectError::NoSystemRoots);
            }
        }
    }
    Ok(store)
}

fn client_config(mode: SslMode, roots: &Roots) -> Result<ClientConfig, ConnectError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()?;
    let check = if mode == SslMode::Disable {
        Check::Nothing
    } else {
        check(mode, roots)
    };
    Ok(match check {
        Check::ChainAndName => builder
            .with_root_certificates(load_roots(roots)?)
            .with_no_client_auth(),
        Check::Chain => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(ChainOnly {
                roots: Arc::new(load_roots(roots)?),
                algorithms: provider.signature_verification_algorithms,
            }))
            .with_no_client_auth(),
        Check::Nothing => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(Unchecked {
                algorithms: provider.signature_verification_algorithms,
            }))
            .with_no_client_auth(),
    })
}

/// The string with `sslmode` and `sslrootcert` taken out (tokio-postgres
/// refuses `verify-*` and does not know `sslrootcert`), and their values.
#[derive(Debug, PartialEq, Eq)]
struct Split {
    rest: String,
    sslmode: Option<String>,
    sslrootcert: Option<String>,
}

fn split_tls_params(s: &str) -> Result<Split, ConnectError> {
    if s.starts_with("postgres://") || s.starts_with("postgresql://") {
        split_url(s)
    } else {
        split_pairs(s)
    }
}

fn decode(s: &str) -> Result<String, ConnectError> {
    percent_encoding::percent_decode_str(s)
        .decode_utf8()
        .map(|v| v.into_owned())
        .map_err(|_| ConnectError::Invalid("a parameter is not UTF-8 once percent-decoded".into()))
}

fn split_url(s: &str) -> Result<Split, ConnectError> {
    // The query starts at the first `?` after the credentials: tokio-postgres
    // reads `user:password` up to the first `@`, and a password may hold a
    // literal `?` (`postgres://u:pa?ss@db/x?sslmode=require`). Cut at that
    // `?`, and `sslmode=require` would stay in the string unseen, then be
    // overwritten by the default — TLS silently optional.
    let scheme_end = s.find("://").map_or(0, |i| i + 3);
    let authority_from = s[scheme_end..]
        .find('@')
        .map_or(scheme_end, |i| scheme_end + i + 1);
    let (base, query) = match s[authority_from..].find('?') {
        Some(i) => (&s[..authority_from + i], Some(&s[authority_from + i + 1..])),
        None => (s, None),
    };
    let mut out = Split {
        rest: base.to_owned(),
        sslmode: None,
        sslrootcert: None,
    };
    let mut kept = Vec::new();
    for part in query.into_iter().flat_map(|q| q.split('&')) {
        let (key, value) = part.split_once('=').unwrap_or((part, ""));
        match decode(key)?.as_str() {
            "sslmode" => out.sslmode = Some(decode(value)?),
            "sslrootcert" => out.sslrootcert = Some(decode(value)?),
            _ => kept.push(part),
        }
    }
    if !kept.is_empty() {
        out.rest.push('?');
        out.rest.push_str(&kept.join("&"));
    }
    Ok(out)
}

/// libpq `key = value` pairs: values bare or single-quoted, `\` escaping
/// the next character in both.
fn split_pairs(s: &str) -> Result<Split, ConnectError> {
    let invalid = |what: &str| ConnectError::Invalid(what.to_owned());
    let mut out = Split {
        rest: String::new(),
        sslmode: None,
        sslrootcert: None,
    };
    let mut kept: Vec<String> = Vec::new();
    let mut it = s.chars().peekable();
    loop {
        while it.next_if(|c| c.is_whitespace()).is_some() {}
        if it.peek().is_none() {
            break;
        }
        let mut key = String::new();
        while let Some(c) = it.next_if(|c| *c != '=' && !c.is_whitespace()) {
            key.push(c);
        }
        while it.next_if(|c| c.is_whitespace()).is_some() {}
        if it.next() != Some('=') {
            return Err(invalid("a key without `=`"));
        }
        while it.next_if(|c| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        if it.next_if_eq(&'\'').is_some() {
            loop {
                match it.next() {
                    None => return Err(invalid("an unterminated quoted value")),
                    Some('\'') => break,
                    Some('\\') => value.extend(it.next()),
                    Some(c) => value.push(c),
                }
            }
        } else {
            while let Some(c) = it.next_if(|c| !c.is_whitespace()) {
                if c == '\\' {
                    value.extend(it.next());
                } else {
                    value.push(c);
                }
            }
        }
        match key.as_str() {
            "sslmode" => out.sslmode = Some(value),
            "sslrootcert" => out.sslrootcert = Some(value),
            _ => kept.push(format!(
                "{key}='{}'",
                value.replace('\\', "\\\\").replace('\'', "\\'")
            )),
        }
    }
    out.rest = kept.join(" ");
    Ok(out)
}

#[cfg(test)]
mod tests;
