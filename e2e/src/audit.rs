//! The API server's audit log (`BATCHLEASE_AUDIT_LOG`, written by the
//! control plane of `e2e/controlplane/up.sh`): who wrote what, and when the
//! API server applied it.

use serde::Deserialize;

/// One write the API server accepted.
#[derive(Debug, Clone, PartialEq)]
pub struct Write {
    pub user: String,
    pub verb: String,
    pub resource: String,
    pub name: String,
    /// When the response was complete (seconds since the epoch).
    pub at: f64,
    /// When the API server received the request (seconds since the
    /// epoch): the write took effect between this and [`Write::at`].
    pub received: f64,
    /// `objectRef.resourceVersion`: for an update (PUT), the version the
    /// request carried — the write's precondition, i.e. the version it
    /// replaced. At Metadata level the log does not record the version a
    /// write produced.
    pub resource_version: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Event {
    stage: String,
    verb: String,
    user: User,
    object_ref: Option<ObjectRef>,
    response_status: Option<Status>,
    request_received_timestamp: String,
    stage_timestamp: String,
}

#[derive(Deserialize)]
struct User {
    username: String,
}

#[derive(Deserialize)]
struct ObjectRef {
    resource: Option<String>,
    subresource: Option<String>,
    namespace: Option<String>,
    name: Option<String>,
    resource_version: Option<String>,
}

#[derive(Deserialize)]
struct Status {
    code: Option<u16>,
}

/// Every accepted write in `namespace`, in the order they completed.
pub fn writes_in(namespace: &str) -> anyhow::Result<Vec<Write>> {
    let path = std::env::var("BATCHLEASE_AUDIT_LOG")?;
    let text = std::fs::read_to_string(path)?;
    let mut out = Vec::new();
    for line in text.lines() {
        let Ok(e) = serde_json::from_str::<Event>(line) else {
            continue;
        };
        let Some(obj) = e.object_ref else { continue };
        let ok = e
            .response_status
            .and_then(|s| s.code)
            .is_some_and(|c| (200..300).contains(&c));
        if e.stage != "ResponseComplete" || !ok || obj.namespace.as_deref() != Some(namespace) {
            continue;
        }
        let at = seconds(&e.stage_timestamp)?;
        let received = seconds(&e.request_received_timestamp)?;
        let resource = match obj.subresource {
            Some(sub) => format!("{}/{sub}", obj.resource.unwrap_or_default()),
            None => obj.resource.unwrap_or_default(),
        };
        out.push(Write {
            user: e.user.username,
            verb: e.verb,
            resource,
            name: obj.name.unwrap_or_default(),
            at,
            received,
            resource_version: obj.resource_version.filter(|v| !v.is_empty()),
        });
    }
    Ok(out)
}

/// An audit timestamp (RFC 3339, microseconds) as seconds since the epoch.
fn seconds(t: &str) -> anyhow::Result<f64> {
    Ok(t.parse::<k8s_openapi::jiff::Timestamp>()
        .map(|t| t.as_microsecond() as f64 / 1e6)?)
}
