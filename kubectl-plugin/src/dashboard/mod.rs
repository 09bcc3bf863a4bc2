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

/// Serves the dashboard on `address` until Ctrl-C or SIGTERM. `allow`
/// adds `Host` values it answers to (a name it is reached by when it does
/// not listen on loopback).
pub async fn serve(
    client: kube::Client,
    scope: Scope,
    address: &str,
    allow: &[String],
) -> anyhow::Result<()> {
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
    let (stop, stopping) = tokio::sync::watch::channel(false);
    let cache = cache::Cache::start(&client, scope.clone());
    let app = http::App {
        cache,
        client,
        token: token.clone(),
        hosts: hosts(local, allow),
        started: Timestamp::now(),
        stopping: stopping.clone(),
    };
    let place = match &scope.namespace {
        Some(ns) => format!("namespace {ns}"),
        None => "all namespaces".to_owned(),
    };
    // The first line a script (or a test) reads: the URL, with the
    // session's secret (exchanged for a cookie on first use).
    let shown = if local.ip().is_unspecified() {
        format!("localhost:{}", local.port())
    } else {
        local.to_string()
    };
    println!("Dashboard: http://{shown}/?token={token} ({place}; Ctrl-C to stop)");
    if !local.ip().is_loopback() {
        eprintln!(
            "warning: {local} is not a loopback address: whoever has the URL above reads what your credentials can read, and cancels or redrives tasks as you"
        );
    }
    let serve = axum::serve(listener, http::router(app)).with_graceful_shutdown(async move {
        shutdown_signal().await;
        // Ends the pages' event streams, which would otherwise keep
        // graceful shutdown waiting for as long as a tab is open.
        let _ = stop.send(true);
    });
    serve.await.context("serving the dashboard")
}

/// Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// The `Host` values this server answers to: its address (unless it is
/// `0.0.0.0`), `localhost`, `127.0.0.1` and `[::1]` with its port, and
/// those the user allowed. Never "any": a web site can point a name of its
/// own at this machine (DNS rebinding) and would then be same-origin with
/// the dashboard.
fn hosts(local: SocketAddr, allow: &[String]) -> Vec<String> {
    let port = local.port();
    let mut h = vec![];
    if !local.ip().is_unspecified() {
        h.push(local.to_string());
    }
    for name in [
        format!("localhost:{port}"),
        format!("127.0.0.1:{port}"),
        format!("[::1]:{port}"),
    ] {
        if !h.contains(&name) {
            h.push(name);
        }
    }
    for a in allow {
        // A name without a port is taken at the dashboard's port.
        let a = if a.contains(':') && !a.ends_with(']') {
            a.clone()
        } else {
            format!("{a}:{port}")
        };
        if !h.contains(&a) {
            h.push(a);
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hosts_answered_to_are_never_any() {
        let h = hosts(SocketAddr::from(([127, 0, 0, 1], 8470)), &[]);
        assert_eq!(h, vec!["127.0.0.1:8470", "localhost:8470", "[::1]:8470"]);
        let h = hosts(SocketAddr::from(([10, 1, 2, 3], 80)), &[]);
        assert_eq!(
            h,
            vec!["10.1.2.3:80", "localhost:80", "127.0.0.1:80", "[::1]:80"]
        );
        // 0.0.0.0: loopback names and what the user allowed, no wildcard.
        let h = hosts(
            SocketAddr::from(([0, 0, 0, 0], 8470)),
            &["box.example".into(), "box.example:9000".into()],
        );
        assert_eq!(
            h,
            vec![
                "localhost:8470",
                "127.0.0.1:8470",
                "[::1]:8470",
                "box.example:8470",
                "box.example:9000"
            ]
        );
    }
}
