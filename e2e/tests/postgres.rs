//! The throwaway PostgreSQL cluster of `e2e/postgres/up.sh` is reachable on
//! loopback and usable for the fenced store's tests.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[tokio::test]
async fn throwaway_postgres_accepts_connections() {
    let url = std::env::var("BATCHLEASE_PG_URL").expect(
        "BATCHLEASE_PG_URL unset: run hack/test.sh (it starts PostgreSQL via e2e/postgres/up.sh)",
    );
    assert!(
        url.contains("@127.0.0.1:"),
        "PostgreSQL must listen on loopback only: {url}"
    );
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let schema = format!("e2e_{}", std::process::id());
    client
        .batch_execute(&format!(
            "CREATE SCHEMA {schema}; CREATE TABLE {schema}.t (id int primary key)"
        ))
        .await
        .unwrap();
    client
        .execute(&format!("INSERT INTO {schema}.t VALUES (1)"), &[])
        .await
        .unwrap();
    let dup = client
        .execute(&format!("INSERT INTO {schema}.t VALUES (1)"), &[])
        .await;
    assert!(dup.is_err(), "a real server enforces the primary key");
    let row = client
        .query_one("SHOW server_version_num", &[])
        .await
        .unwrap();
    let version: String = row.get(0);
    assert!(
        version.parse::<u32>().unwrap() >= 130000,
        "PostgreSQL {version} is too old"
    );
    client
        .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
        .await
        .unwrap();
}
