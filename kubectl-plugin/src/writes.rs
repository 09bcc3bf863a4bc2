//! The plugin's two task writes, shared by the commands and the dashboard
//! (which writes with the same credentials, as the user): each patch
//! carries the task's UID, so a task deleted and created again under the
//! same name since it was read is not touched (the API server refuses the
//! patch with a conflict).

use batchlease_api::BatchTask;
use kube::api::{Api, Patch, PatchParams};

use crate::FIELD_MANAGER;

fn params() -> PatchParams {
    PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..Default::default()
    }
}

/// Raises `spec.redrive` of task `name` (UID `uid`) to `redrive`.
pub async fn redrive(
    api: &Api<BatchTask>,
    name: &str,
    uid: &str,
    redrive: i64,
) -> Result<(), kube::Error> {
    let patch = serde_json::json!({
        "metadata": {"uid": uid},
        "spec": {"redrive": redrive},
    });
    api.patch(name, &params(), &Patch::Merge(&patch))
        .await
        .map(drop)
}

/// Sets `spec.cancel` of task `name` (UID `uid`).
pub async fn cancel(api: &Api<BatchTask>, name: &str, uid: &str) -> Result<(), kube::Error> {
    let patch = serde_json::json!({
        "metadata": {"uid": uid},
        "spec": {"cancel": true},
    });
    api.patch(name, &params(), &Patch::Merge(&patch))
        .await
        .map(drop)
}
