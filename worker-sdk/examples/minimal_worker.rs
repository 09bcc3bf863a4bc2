// [snippet]
//! A worker without a database: each task's result goes into its status.
use batchlease_worker_sdk::{Output, TaskContext, TaskError, WorkerBuilder};
use serde::Deserialize;
use serde_json::json;

/// A task's `spec.payload`, e.g. `{"name": "world", "times": 2}`.
#[derive(Deserialize)]
struct Greet {
    name: String,
    #[serde(default)]
    times: Option<usize>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // In a pod: its service account. Elsewhere: KUBECONFIG.
    let config = kube::Config::infer().await?;
    let namespace = std::env::var("TASK_NAMESPACE").unwrap_or_else(|_| "default".into());
    let worker = WorkerBuilder::new(config, namespace)
        .queue("greetings")
        .slots(4)
        .build()?;
    worker
        .run(
            |ctx: TaskContext| async move {
                // A payload of the wrong shape: a permanent InvalidPayload.
                let job: Greet = ctx.payload()?;
                let times = job.times.unwrap_or(1);
                let text = vec![format!("hello, {}", job.name); times].join(" ");
                Ok::<_, TaskError>(Output::json(json!({ "greeting": text })))
            },
            shutdown(),
        )
        .await?;
    Ok(())
}

/// SIGTERM (what the kubelet sends) or Ctrl-C: stop claiming, let running
/// tasks finish within the drain grace, give back the rest.
async fn shutdown() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
// [/snippet]
