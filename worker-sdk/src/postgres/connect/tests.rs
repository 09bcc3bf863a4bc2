//! Parsing connection strings and libpq's TLS parameters, and what each
//! `sslmode` asks of the server's certificate.

#![allow(clippy::unwrap_used)]

use super::*;

fn no_env(_: &str) -> Option<String> {
    None
}

#[test]
fn tls_parameters_are_taken_out_of_a_url() {
    let s = "postgres://app:p%40ss@db:5433/tasks?sslmode=verify-full&application_name=w&sslrootcert=%2Fetc%2Fca.crt";
    assert_eq!(
        split_tls_params(s).unwrap(),
        Split {
            rest: "postgres://app:p%40ss@db:5433/tasks?application_name=w".into(),
            sslmode: Some("verify-full".into()),
            sslrootcert: Some("/etc/ca.crt".into()),
        }
    );
    let plain = split_tls_params("postgresql://db/x").unwrap();
    assert_eq!(plain.rest, "postgresql://db/x");
    assert_eq!(plain.sslmode, None);
}

#[test]
fn a_question_mark_in_the_password_does_not_hide_sslmode() {
    // tokio-postgres reads the credentials up to the first `@`: the
    // query is what follows the first `?` after it.
    let s = "postgres://u:pa?ss@db/x?sslmode=require";
    let split = split_tls_params(s).unwrap();
    assert_eq!(split.sslmode.as_deref(), Some("require"));
    assert_eq!(split.rest, "postgres://u:pa?ss@db/x");
    let pg = ConnectOptions::parse_with_env(s, no_env).unwrap();
    assert_eq!(pg.config().get_password(), Some(&b"pa?ss"[..]));
    assert!(
        pg.describe().ends_with("(sslmode=require)"),
        "{}",
        pg.describe()
    );
    // An sslmode the split cannot see (an unencoded `@` in the password
    // moves the credentials' end) is refused, never overwritten.
    let hidden = "postgres://u:p@ss@db/x?sslmode=require";
    if let Ok(split) = split_tls_params(hidden)
        && split.sslmode.is_none()
    {
        assert_eq!(
            ConnectOptions::parse_with_env(hidden, no_env)
                .unwrap_err()
                .kind(),
            "invalid"
        );
    }
}

#[test]
fn tls_parameters_are_taken_out_of_key_value_pairs() {
    let s = r"host=db  port = 5433 password='it\'s' sslmode=require sslrootcert='/a b/ca.crt' user=a\ b";
    let split = split_tls_params(s).unwrap();
    assert_eq!(split.sslmode.as_deref(), Some("require"));
    assert_eq!(split.sslrootcert.as_deref(), Some("/a b/ca.crt"));
    assert_eq!(
        split.rest,
        r"host='db' port='5433' password='it\'s' user='a b'"
    );
    assert_eq!(
        split_tls_params("host=db port").unwrap_err().kind(),
        "invalid"
    );
}

#[test]
fn quoted_values_round_trip_through_tokio_postgres() {
    let s = r"host=db user=app password='p w\'s\\' dbname=tasks sslmode=disable";
    let pg = ConnectOptions::parse_with_env(s, no_env).unwrap();
    assert_eq!(pg.config().get_password(), Some(&br"p w's\"[..]));
    assert_eq!(pg.describe(), "app@db/tasks (sslmode=disable)");
}

#[test]
fn libpq_rules_for_mode_and_roots() {
    let file = Some(Path::new("/nonexistent/root.crt"));
    type Case<'a> = (
        Option<&'a str>,
        Option<&'a str>,
        Result<(SslMode, Roots), &'a str>,
    );
    let cases: Vec<Case<'_>> = vec![
        (None, None, Ok((SslMode::Prefer, Roots::None))),
        (Some("allow"), None, Ok((SslMode::Prefer, Roots::None))),
        (Some("require"), None, Ok((SslMode::Require, Roots::None))),
        (Some("disable"), None, Ok((SslMode::Disable, Roots::None))),
        (
            Some("verify-full"),
            Some("/ca.crt"),
            Ok((SslMode::VerifyFull, Roots::File("/ca.crt".into()))),
        ),
        (
            Some("require"),
            Some("/ca.crt"),
            Ok((SslMode::Require, Roots::File("/ca.crt".into()))),
        ),
        (
            None,
            Some("system"),
            Ok((SslMode::VerifyFull, Roots::System)),
        ),
        (Some("require"), Some("system"), Err("weak_sslmode")),
        (Some("verify-ca"), None, Err("no_root_cert")),
        (Some("verify-full"), Some(""), Err("no_root_cert")),
        (Some("full"), None, Err("sslmode")),
    ];
    for (mode, root, want) in cases {
        let got = resolve(mode, root, file).map_err(|e| e.kind());
        assert_eq!(got, want, "sslmode={mode:?} sslrootcert={root:?}");
    }
    // libpq's default CA file, when it exists.
    let dir = std::env::temp_dir().join(format!("pg-home-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ca = dir.join("root.crt");
    std::fs::write(&ca, "x").unwrap();
    assert_eq!(
        resolve(Some("verify-ca"), None, Some(&ca)).unwrap(),
        (SslMode::VerifyCa, Roots::File(ca.clone()))
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_checks_each_mode_makes() {
    let file = Roots::File("/ca".into());
    assert_eq!(check(SslMode::Prefer, &Roots::None), Check::Nothing);
    assert_eq!(check(SslMode::Require, &Roots::None), Check::Nothing);
    assert_eq!(check(SslMode::Require, &file), Check::Chain);
    assert_eq!(check(SslMode::VerifyCa, &file), Check::Chain);
    assert_eq!(check(SslMode::VerifyFull, &file), Check::ChainAndName);
}

#[test]
fn environment_defaults_apply_only_when_the_string_is_silent() {
    let env = |k: &str| match k {
        "PGSSLMODE" => Some("require".to_owned()),
        _ => None,
    };
    let pg = ConnectOptions::parse_with_env("postgres://db/x", env).unwrap();
    assert_eq!(pg.ssl_mode(), SslMode::Require);
    let pg = ConnectOptions::parse_with_env("postgres://db/x?sslmode=disable", env).unwrap();
    assert_eq!(pg.ssl_mode(), SslMode::Disable);
}

#[test]
fn errors_name_the_problem_never_the_password() {
    for (s, kind, says) in [
        ("host='db password=s3cret", "invalid", "unterminated"),
        (
            "postgres://u:s3cret@db/x?sslmode=verify",
            "sslmode",
            "sslmode must be",
        ),
        (
            "postgres://u:s3cret@db/x?bogus=1",
            "invalid",
            "unknown option `bogus`",
        ),
        (
            "postgres://u:s3cret@db/x?sslmode=verify-full&sslrootcert=/nonexistent/ca.crt",
            "root_cert",
            "reading sslrootcert /nonexistent/ca.crt",
        ),
    ] {
        let e = ConnectOptions::parse_with_env(s, no_env).unwrap_err();
        assert_eq!(e.kind(), kind, "{s}: {e}");
        assert!(e.to_string().contains(says), "{s}: {e}");
        assert!(!e.to_string().contains("s3cret"), "{s}: {e}");
    }
    let pg = ConnectOptions::parse_with_env("postgres://u:s3cret@db/x", no_env).unwrap();
    assert!(!format!("{pg:?}").contains("s3cret"), "{pg:?}");
    assert_eq!(pg.describe(), "u@db:5432/x (sslmode=prefer)");
}

#[test]
fn a_file_without_a_certificate_is_refused() {
    let dir = std::env::temp_dir().join(format!("pg-ca-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ca = dir.join("ca.crt");
    std::fs::write(&ca, "not a certificate\n").unwrap();
    let e = ConnectOptions::parse_with_env(
        &format!("host=db sslmode=verify-full sslrootcert={}", ca.display()),
        no_env,
    )
    .unwrap_err();
    assert!(matches!(e, ConnectError::BadRootCert { .. }), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
