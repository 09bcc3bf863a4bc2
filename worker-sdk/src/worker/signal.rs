//! The shutdown signal every worker binary waits for.

/// Resolves at the first SIGTERM (the kubelet stopping the pod) or SIGINT
/// (^C): the `shutdown` future every worker binary hands to
/// [`Worker::run`], which then drains. Where no SIGTERM handler can be
/// installed, SIGINT alone.
pub async fn shutdown_signal() {
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
