//! The fenced store over TLS, against a PostgreSQL that refuses anything
//! else (`e2e/postgres/up.sh --tls`, as managed PostgreSQL services are):
//! the demo worker with `sslmode=verify-full` and the test CA runs a task
//! to `Succeeded` with its commit in that database; the same worker with
//! `sslmode=disable`, or with a CA that did not sign the server's
//! certificate, does not start and says why.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use batchlease_api::TaskPhase;
use batchlease_e2e::operator::Operator;
use batchlease_e2e::pg::TlsPostgres;
use batchlease_e2e::process::Process;
use batchlease_e2e::tasks::{self, wait_phase};
use batchlease_e2e::wait_for;
use batchlease_e2e::workers::{self, WorkerOpts};
use batchlease_worker_sdk::postgres::{ConnectOptions, SslMode};
use serde_json::json;

#[tokio::test]
async fn a_task_commits_over_verified_tls() {
    let pg = TlsPostgres::start().unwrap();
    let url = pg.verify_full_url(&pg.ca);
    let (ns, op) = Operator::in_new_namespace("pgtls", "op", Duration::from_secs(30))
        .await
        .unwrap();
    let worker = workers::start(
        &ns.name,
        "tls-w1",
        &WorkerOpts {
            pg_url: Some(url.clone()),
            ..Default::default()
        },
    )
    .unwrap();
    tasks::create(
        &ns,
        "job",
        json!({"queue": "demo", "payload": {"steps": 2, "stepMillis": 20}}),
    )
    .await
    .unwrap();
    let done = wait_phase(
        &ns,
        "job",
        TaskPhase::Succeeded,
        Duration::from_secs(60),
        || {
            format!(
                "{}\n--- postgres ---\n{}",
                op.logs_with(&[&worker]),
                pg.log()
            )
        },
    )
    .await
    .unwrap();
    let st = done.status.unwrap();
    let uid = tasks::uid(&ns, "job").await.unwrap();

    // The commit is in the TLS-only database, under the task's token, read
    // back through the SDK's own TLS connection.
    let options: ConnectOptions = url.parse().unwrap();
    assert_eq!(options.ssl_mode(), SslMode::VerifyFull);
    let client = options.connect().await.unwrap();
    let row = client
        .query_one(
            "SELECT committed_token, payload->>'worker' FROM task_state WHERE task_id = $1",
            &[&uid],
        )
        .await
        .unwrap();
    let (token, by): (Option<i64>, Option<String>) = (row.get(0), row.get(1));
    assert_eq!(token, Some(st.fencing_token), "{st:?}");
    assert_eq!(by.as_deref(), Some("tls-w1"));
    // Every connection over TCP is encrypted (the server refuses others,
    // and this checks it did not let one through).
    let plain: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
              WHERE a.client_addr IS NOT NULL AND NOT s.ssl",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(plain, 0);
    let tls: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
              WHERE a.client_addr IS NOT NULL AND s.ssl AND a.pid <> pg_backend_pid()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(tls >= 1, "the worker's pooled connections are TLS: {tls}");
    let log = worker.log_text();
    assert!(
        log.contains("fenced store ready") && log.contains("(sslmode=verify-full)"),
        "{}",
        worker.logs()
    );
    drop(worker);
    ns.finish().await.unwrap();
}

/// Starts the demo worker with `url` and waits until it exits; its log.
async fn exits_at_start(group: &str, name: &str, url: &str) -> String {
    let mut worker = Process::start(
        workers::binary().unwrap(),
        group,
        name,
        vec![format!("--namespace={group}"), "--queues=demo".into()],
        vec![
            ("RUST_LOG".into(), "info,kube=warn".into()),
            ("BATCHLEASE_PG_URL".into(), url.into()),
        ],
    )
    .unwrap();
    let status = wait_for(
        &format!("worker {name} to exit"),
        Duration::from_secs(30),
        || worker_log(group, name),
        || {
            let exited = worker.exited();
            async move { Ok(exited) }
        },
    )
    .await
    .unwrap();
    let log = worker.log_text();
    assert!(!status.success(), "{name} exited 0:\n{log}");
    log
}

fn worker_log(group: &str, name: &str) -> String {
    let path = std::env::temp_dir()
        .join(format!("batchlease-e2e-{group}"))
        .join(format!("{name}.log"));
    std::fs::read_to_string(path).unwrap_or_default()
}

#[tokio::test]
async fn without_tls_or_with_the_wrong_ca_the_worker_does_not_start() {
    let pg = TlsPostgres::start().unwrap();
    let group = format!("pgtls-refused-{}", rand::random::<u32>());

    // sslmode=disable: the server's pg_hba.conf refuses it, and the worker
    // says what to change.
    let log = exits_at_start(
        &group,
        "disable",
        &format!("{}?sslmode=disable", pg.plain_url),
    )
    .await;
    assert!(log.contains("(sslmode=disable)"), "{log}");
    assert!(log.contains("pg_hba.conf rejects connection"), "{log}");
    assert!(log.contains("no encryption"), "{log}");
    assert!(
        log.contains("the server accepts TLS connections only"),
        "{log}"
    );

    // verify-full with a CA that did not sign the server's certificate:
    // the handshake fails, nothing is sent.
    let other = std::env::temp_dir().join(format!("{group}-other-ca"));
    std::fs::create_dir_all(&other).unwrap();
    let ok = std::process::Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
        ])
        .args(["-nodes", "-days", "1", "-subj", "/CN=not-the-server-ca"])
        .arg("-keyout")
        .arg(other.join("ca.key"))
        .arg("-out")
        .arg(other.join("ca.crt"))
        .output()
        .unwrap();
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let log = exits_at_start(
        &group,
        "wrong-ca",
        &pg.verify_full_url(&other.join("ca.crt")),
    )
    .await;
    assert!(log.contains("(sslmode=verify-full)"), "{log}");
    assert!(log.contains("invalid peer certificate"), "{log}");
    // The right CA, but a name the certificate does not carry: verify-full
    // checks the name, verify-ca does not.
    let by_name = pg.plain_url.replace("127.0.0.1", "127.0.0.1.nip.invalid");
    let e = ConnectOptions::parse(&format!(
        "{by_name}?sslmode=verify-full&sslrootcert={}&hostaddr=127.0.0.1",
        pg.ca.display()
    ))
    .unwrap()
    .connect()
    .await
    .expect_err("a certificate for 127.0.0.1 does not name 127.0.0.1.nip.invalid");
    assert!(format!("{e:?}").contains("NotValidForName"), "{e:?}");
    let client = ConnectOptions::parse(&format!(
        "{by_name}?sslmode=verify-ca&sslrootcert={}&hostaddr=127.0.0.1",
        pg.ca.display()
    ))
    .unwrap()
    .connect()
    .await
    .unwrap();
    let ssl: bool = client
        .query_one(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(ssl);
    std::fs::remove_dir_all(&other).unwrap();
}
