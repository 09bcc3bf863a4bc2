//! The fenced store's migration on an empty database, run by many workers
//! at once — what the replicas of a worker Deployment do on their first
//! start. `CREATE TABLE IF NOT EXISTS` is no guard against a concurrent
//! creator (the later one fails on `pg_type_typname_nsp_index`); the SDK
//! serializes migrations with an advisory lock.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use batchlease_e2e::process::Process;
use batchlease_e2e::workers::{self, WorkerOpts};
use batchlease_e2e::{Cluster, wait_for};
use batchlease_worker_sdk::postgres::migrate;
use tokio_postgres::{Client, NoTls};

const T: Duration = Duration::from_secs(60);

/// A new, empty database on the test PostgreSQL; its URL.
async fn empty_database(prefix: &str) -> String {
    let url = workers::pg_url().unwrap();
    let (admin, conn) = tokio_postgres::connect(&url, NoTls).await.unwrap();
    tokio::spawn(conn);
    let name = format!("{prefix}_{}_{}", std::process::id(), rand_suffix());
    admin
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .unwrap();
    let (base, _) = url.rsplit_once('/').unwrap();
    format!("{base}/{name}")
}

fn rand_suffix() -> u32 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos()
}

async fn connect(url: &str) -> Client {
    let (client, conn) = tokio_postgres::connect(url, NoTls).await.unwrap();
    tokio::spawn(conn);
    client
}

#[tokio::test]
async fn ten_migrations_at_once_on_an_empty_database_all_succeed() {
    let url = empty_database("mig").await;
    let mut clients = Vec::new();
    for _ in 0..10 {
        clients.push(connect(&url).await);
    }
    let results = futures::future::join_all(clients.iter().map(migrate)).await;
    let failed: Vec<String> = results
        .iter()
        .filter_map(|r| {
            r.as_ref()
                .err()
                .map(|e| batchlease_api::Chain(e).to_string())
        })
        .collect();
    assert!(failed.is_empty(), "migrations failed: {failed:#?}");
    let tables: i64 = clients[0]
        .query_one(
            "SELECT count(*) FROM information_schema.tables WHERE table_name IN
               ('task_state', 'resource_fence', 'versioned_state', 'compensation_log')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(tables, 4);
}

#[tokio::test]
async fn ten_demo_workers_started_at_once_on_an_empty_database_all_start() {
    let cluster = Cluster::with_crds().await.unwrap();
    let ns = cluster.namespace("migw").await.unwrap();
    let url = empty_database("migw").await;
    let mut fleet: Vec<Process> = (0..10)
        .map(|i| {
            let opts = WorkerOpts {
                slots: 1,
                pg_url: Some(url.clone()),
                ..Default::default()
            };
            workers::start(&ns.name, &format!("w{i}"), &opts).unwrap()
        })
        .collect();
    let logs = |fleet: &[Process]| -> String { fleet.iter().map(Process::logs).collect() };
    for i in 0..fleet.len() {
        let f = &fleet;
        wait_for(
            &format!("worker w{i} has its fenced store"),
            T,
            || logs(f),
            || async move { Ok(f[i].log_text().contains("fenced store ready").then_some(())) },
        )
        .await
        .unwrap();
    }
    for (i, w) in fleet.iter_mut().enumerate() {
        assert_eq!(w.exited(), None, "worker w{i} exited\n{}", w.logs());
    }
    drop(fleet);
    ns.cleanup().await.unwrap();
}
