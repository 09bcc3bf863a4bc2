//! `kubectl batchlease dashboard`: a live web view of queues, tasks, each
//! task's graph and attempt timeline (who held it under which token, its
//! renewals and checkpoints, how it ended), resource locks and dead
//! letters, served on this machine with the user's kubeconfig. It needs no
//! privilege in the cluster beyond what the user has: it reads with the
//! user's list/watch and writes (cancel, redrive) as the user.

mod assets;
mod cache;
mod http;
mod journal;
mod snapshot;
mod view_locks;
mod view_queues;
mod view_task;
mod view_tasks;

use std::net::SocketAddr;

use anyhow::Context;
use k8s_openapi::jiff::Timestamp;
use rand::Rng;

pub use cache::Scope;

/// Serves the dashboard on `address` until Ctrl-C (or SIGTERM).
pub async fn serve(client: kube::Client, scope: Scope, address: &str) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .with_context(|| format!("listening on {address}"))?;
    let local = listener.local_addr()?;
    let token: String = {
        let mut rng = rand::rng();
        (0..32)
            .map(|_| char::from(b"0123456789abcdef"[rng.random_range(0..16)]))
            .collect()
    };
    let cache = cache::Cache::start(&client, scope.clone());
    let app = http::App {
        cache,
        client,
        token,
        hosts: hosts(local),
        started: Timestamp::now(),
    };
    let place = match &scope.namespace {
        Some(ns) => format!("namespace {ns}"),
        None => "all namespaces".to_owned(),
    };
    // The first line a script (or a test) reads: the URL.
    println!("Dashboard: http://{local}/ ({place}; Ctrl-C to stop)");
    if !local.ip().is_loopback() {
        eprintln!(
            "warning: {local} is not a loopback address: anyone who can reach it can read what your credentials can, and cancel or redrive tasks as you"
        );
    }
    axum::serve(listener, http::router(app))
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
        .context("serving the dashboard")
}

/// The `Host` values this server answers to: its address, and
/// `localhost` with its port when it listens on loopback; any (empty) on
/// an unspecified address (`0.0.0.0`), where the user chose to be reached
/// by whatever name.
fn hosts(local: SocketAddr) -> Vec<String> {
    if local.ip().is_unspecified() {
        return vec![];
    }
    let mut h = vec![local.to_string()];
    if local.ip().is_loopback() {
        h.push(format!("localhost:{}", local.port()));
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_answers_to_localhost_too_and_other_addresses_to_themselves() {
        let h = hosts(SocketAddr::from(([127, 0, 0, 1], 8470)));
        assert_eq!(h, vec!["127.0.0.1:8470", "localhost:8470"]);
        let h = hosts(SocketAddr::from(([10, 1, 2, 3], 80)));
        assert_eq!(h, vec!["10.1.2.3:80"]);
        assert!(hosts(SocketAddr::from(([0, 0, 0, 0], 80))).is_empty());
    }
}
