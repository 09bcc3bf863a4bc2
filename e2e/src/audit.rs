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
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Event {
    stage: String,
    verb: String,
    user: User,
    object_ref: Option<ObjectRef>,
    response_status: Option<Status>,
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
        let at = e
            .stage_timestamp
            .parse::<k8s_openapi::jiff::Timestamp>()
            .map(|t| t.as_millisecond() as f64 / 1000.0)?;
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
        });
    }
    Ok(out)
}
