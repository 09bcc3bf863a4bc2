//! `/metrics`: the SDK's worker metrics in the Prometheus text format.

use std::sync::Arc;

use tracing::{info, warn};

/// Serves `registry` on `addr` until the runner exits.
pub async fn serve(
    addr: std::net::SocketAddr,
    registry: Arc<prometheus_client::registry::Registry>,
) {
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let registry = registry.clone();
            async move {
                let mut body = String::new();
                match prometheus_client::encoding::text::encode(&mut body, &registry) {
                    Ok(()) => (axum::http::StatusCode::OK, body),
                    Err(_) => (axum::http::StatusCode::INTERNAL_SERVER_ERROR, String::new()),
                }
            }
        }),
    );
    let listener = match tokio::net::TcpListener::bind(addr).await {
        Ok(l) => l,
        Err(e) => {
            warn!(%addr, error = %e, "cannot serve /metrics");
            return;
        }
    };
    info!(%addr, "serving /metrics");
    if let Err(e) = axum::serve(listener, app).await {
        warn!(error = %e, "/metrics server ended");
    }
}
