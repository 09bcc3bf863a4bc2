//! The reconciler's side of the spawn gate ([`batchlease_operator::spawn_gate`]):
//! the direct reads it needs and the refusal it writes. Two calls from
//! `reconcile.rs`: [`admit`] at the start of a pass, [`children_pending`]
//! before a status write that ends a task.

use std::time::Duration;

use batchlease_api::BatchTask;
use batchlease_api::keys::LABEL_PARENT;
use batchlease_api::names;
use batchlease_operator::spawn_gate::{self, Admission, PARENT_FINISHED};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, ListParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use tracing::{debug, warn};

use crate::context::{Ctx, bounded};
use crate::effects::report::publish;
use crate::effects::writes::write_status;
use crate::error::Error;

/// How soon a parent whose final write waits for a child's first pass
/// looks again (the child's pass is usually under way already).
pub const CHILD_RECHECK: Duration = Duration::from_millis(250);

/// The gate for a spawned child's first pass: `Some(action)` ends the pass
/// (the child was refused, or its parent is gone); `None`: decide as
/// usual. The parent is read directly — a cached parent could show it
/// unfinished after it ended.
pub async fn admit(ctx: &Ctx, task: &BatchTask) -> Result<Option<Action>, Error> {
    let Some((parent_name, _)) = spawn_gate::parent_of(task) else {
        return Ok(None);
    };
    if !spawn_gate::needs_admission(task) {
        return Ok(None);
    }
    let api: Api<BatchTask> =
        Api::namespaced(ctx.client.clone(), &task.namespace().unwrap_or_default());
    let parent = bounded(ctx, "parent read", async {
        api.get_opt(parent_name)
            .await
            .map_err(|source| Error::Kube {
                what: "parent read",
                source,
            })
    })
    .await?;
    match spawn_gate::admission(task, parent.as_ref(), Timestamp::now()) {
        Admission::NotGated | Admission::Admitted => Ok(None),
        Admission::ParentGone => {
            debug!(task = %task.name_any(), parent = %parent_name, "parent gone; left to garbage collection");
            Ok(Some(Action::await_change()))
        }
        Admission::Refused { status, message } => {
            write_status(ctx, task, *status).await?;
            warn!(
                task = %task.name_any(),
                namespace = %task.namespace().unwrap_or_default(),
                parent = %parent_name,
                "spawned child created after its parent ended; rejected"
            );
            publish(ctx, task, EventType::Warning, PARENT_FINISHED, message).await;
            Ok(Some(Action::await_change()))
        }
    }
}

/// Whether `task` must not be written `new_status` yet: the write ends it,
/// and a child of it (listed directly, by label) has not had its first
/// pass. Ends that wait are rare: a child's first pass follows its
/// creation within moments.
pub async fn children_pending(
    ctx: &Ctx,
    task: &BatchTask,
    new_status: &batchlease_api::BatchTaskStatus,
) -> Result<bool, Error> {
    if !spawn_gate::ends(task, new_status) {
        return Ok(false);
    }
    let api: Api<BatchTask> =
        Api::namespaced(ctx.client.clone(), &task.namespace().unwrap_or_default());
    // No resourceVersion: a consistent read, not the watch cache of an
    // earlier moment.
    let params = ListParams::default().labels(&format!(
        "{LABEL_PARENT}={}",
        names::label_value(&task.name_any())
    ));
    let listed = bounded(ctx, "children list", async {
        api.list(&params).await.map_err(|source| Error::Kube {
            what: "children list",
            source,
        })
    })
    .await?;
    let waiting = spawn_gate::unadmitted(task, &listed.items);
    if waiting.is_empty() {
        return Ok(false);
    }
    debug!(task = %task.name_any(), children = ?waiting, "ending waits for its children's first pass");
    Ok(true)
}
