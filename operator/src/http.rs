//! `/metrics`, `/healthz` and `/readyz`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::registry::Registry;

/// What the endpoints report.
#[derive(Debug)]
pub struct Health {
    pub registry: Registry,
    /// Set once the caches synced (or while standing by as a non-leader).
    pub ready: AtomicBool,
    /// Whether the process still does its job; `/healthz` reports it.
    pub live: Liveness,
    /// Whether this replica holds the election Lease (set by the election
    /// task)…
    pub holding: Arc<AtomicBool>,
    /// … and whether a term's controllers run. Holding the Lease without
    /// them is not ready: every standby waits on a leader that does
    /// nothing (issue 23; brief between a win and the controllers' start).
    pub running: AtomicBool,
}

/// Liveness as `/healthz` reports it. A leader whose controllers died keeps
/// renewing its election Lease (that is a separate task), so it would block
/// every standby forever while doing nothing: "the process answers HTTP" is
/// not health. Once failed it stays failed — the process is on its way out
/// and the kubelet may restart it.
#[derive(Debug, Default)]
pub struct Liveness(Mutex<Option<String>>);

impl Liveness {
    /// Marks the process unhealthy; the first reason is kept (later ones
    /// are usually consequences of it).
    pub fn fail(&self, reason: impl Into<String>) {
        let mut failed = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if failed.is_none() {
            *failed = Some(reason.into());
        }
    }

    /// Why the process is unhealthy; `None` while it is healthy.
    pub fn failure(&self) -> Option<String> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// The endpoints' routes.
fn router(health: Arc<Health>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(health)
}

/// Serves until the process ends.
pub async fn serve(addr: SocketAddr, health: Arc<Health>) -> anyhow::Result<()> {
    let app = router(health);
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!(addr = %listener.local_addr()?, "serving /metrics, /healthz, /readyz");
    axum::serve(listener, app).await?;
    Ok(())
}

async fn metrics(State(h): State<Arc<Health>>) -> impl IntoResponse {
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, &h.registry) {
        Ok(()) => (
            StatusCode::OK,
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            body,
        )
            .into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

async fn healthz(State(h): State<Arc<Health>>) -> impl IntoResponse {
    match h.live.failure() {
        None => (StatusCode::OK, "ok".to_owned()),
        Some(reason) => (StatusCode::INTERNAL_SERVER_ERROR, reason),
    }
}

async fn readyz(State(h): State<Arc<Health>>) -> impl IntoResponse {
    if h.holding.load(Ordering::Acquire) && !h.running.load(Ordering::Acquire) {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "holding the leader lease without running controllers",
        )
    } else if h.ready.load(Ordering::Acquire) {
        (StatusCode::OK, "ready")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "caches not synced")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::Request;
    use tower::ServiceExt;

    async fn get(health: &Arc<Health>, path: &str) -> (StatusCode, String) {
        let response = router(health.clone())
            .oneshot(Request::get(path).body(Body::empty()).unwrap())
            .await
            .unwrap();
        let status = response.status();
        let body = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .unwrap();
        (status, String::from_utf8(body.to_vec()).unwrap())
    }

    #[tokio::test]
    async fn healthz_fails_once_liveness_failed_and_keeps_the_first_reason() {
        let health = Arc::new(Health {
            registry: Registry::default(),
            ready: AtomicBool::new(true),
            live: Liveness::default(),
            holding: Arc::default(),
            running: AtomicBool::new(false),
        });
        assert_eq!(
            get(&health, "/healthz").await,
            (StatusCode::OK, "ok".into())
        );
        health.live.fail("controller * ended: panicked");
        health.live.fail("a consequence");
        assert_eq!(
            get(&health, "/healthz").await,
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "controller * ended: panicked".into()
            )
        );
        // Readiness is separate: a dying replica may still be "ready".
        assert_eq!(get(&health, "/readyz").await.0, StatusCode::OK);
    }

    #[tokio::test]
    async fn holding_the_lease_without_controllers_is_not_ready() {
        let health = Arc::new(Health {
            registry: Registry::default(),
            ready: AtomicBool::new(true),
            live: Liveness::default(),
            holding: Arc::default(),
            running: AtomicBool::new(false),
        });
        // A standby: ready.
        assert_eq!(get(&health, "/readyz").await.0, StatusCode::OK);
        // Holding the Lease, no controllers: not ready.
        health.holding.store(true, Ordering::Release);
        assert_eq!(
            get(&health, "/readyz").await,
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "holding the leader lease without running controllers".into()
            )
        );
        health.running.store(true, Ordering::Release);
        assert_eq!(get(&health, "/readyz").await.0, StatusCode::OK);
    }
}
