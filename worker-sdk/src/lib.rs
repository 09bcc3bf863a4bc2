//! The batchlease worker SDK: claim TaskLeases of your queues, run a handler
//! under a background heartbeat, stop it locally the moment the lease can no
//! longer be proven yours (the kill switch), and commit results carrying the
//! attempt's fencing token so a zombie's late write is refused — by the API
//! server and by your storage.
//!
//! In task graphs a handler reads the results of its `dependsOn` tasks
//! ([`TaskContext::dependency_results`]) and expands itself into children
//! idempotently ([`TaskContext::spawn`], [`Subgraph`]); the fenced store
//! checks the tokens of the task's resource locks along with its own
//! ([`Fence::resource_tokens`], `postgres`).
//!
//! A payload is a JSON object (`spec.payload`); read it into your own type:
//!
//! ```no_run
//! # async fn demo(config: kube::Config) -> Result<(), batchlease_worker_sdk::Error> {
//! use batchlease_worker_sdk::{Output, TaskContext, TaskError, WorkerBuilder};
//!
//! /// `spec.payload: {rows: 1000}`
//! #[derive(serde::Deserialize)]
//! struct Job {
//!     rows: u64,
//! }
//!
//! let worker = WorkerBuilder::new(config, "default").queue("etl").slots(4).build()?;
//! worker
//!     .run(
//!         |ctx: TaskContext| async move {
//!             let job: Job = ctx.payload()?; // wrong shape: a permanent error
//!             ctx.checkpoint(serde_json::json!({"done": job.rows}))?;
//!             Ok::<_, TaskError>(Output::json(serde_json::json!({"rows": job.rows})))
//!         },
//!         async { let _ = tokio::signal::ctrl_c().await; },
//!     )
//!     .await
//! # }
//! ```

mod attempt;
mod claim_brake;
mod claim_order;
mod context;
mod dependencies;
mod error;
mod fence;
mod heartbeat_runtime;
// Public for the fleet simulator's hollow workers, which make the SDK's
// own lease writes.
#[doc(hidden)]
pub mod lease_ops;
mod metrics;
#[cfg(feature = "postgres")]
pub mod postgres;
mod presence;
mod registry;
mod spawn;
pub mod speculate;
mod subgraph;
mod worker;
mod worker_lease;
// Public for simulated workers, which renew a WorkerLease with the SDK's
// own requests.
#[doc(hidden)]
pub mod worker_lease_ops;

pub use attempt::Ended;
// For the fleet simulator's hollow workers, which must try offers in the
// SDK's order to cost the API server what SDK workers cost it.
#[doc(hidden)]
pub use claim_order::claim_order;
// And watch what the SDK watches (its offers' label selectors).
#[doc(hidden)]
pub use worker::offer_selectors;
// And write the SDK's presence record, at its period.
#[doc(hidden)]
pub use presence::{PERIOD as PRESENCE_PERIOD, record as presence_record};
// What a handler needs to describe children without depending on the API
// crate itself.
pub use batchlease_api::{
    BackoffSpec, BatchTaskSpec, JsonObject, JsonObjectError, MAX_CHECKPOINT_BYTES, MAX_DEPTH,
    MAX_RESULT_BYTES, TaskMode,
};
pub use context::{Output, TaskContext};
pub use error::{Error, TaskError};
pub use fence::{Fence, KillClock, KillReason};
pub use metrics::WorkerMetrics;
pub use registry::{EarlierCommit, Registry};
pub use spawn::LABEL_PARENT;
#[doc(hidden)]
pub use spawn::{Parent, create_children};
pub use subgraph::{Child, MAX_CHILDREN, MAX_DEPENDS_ON, Subgraph, SubgraphError};
pub use worker::{
    CHECKPOINT_INTERVAL_ENV, DEFAULT_DRAIN_GRACE, RENEW_PER_WORKER_ENV, Worker, WorkerBuilder,
    shutdown_signal,
};
