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
    /// The pod a service-account token was bound to (the user's
    /// `authentication.kubernetes.io/pod-name`): a pod's own, mounted by
    /// the kubelet, or `kubectl create token --bound-object-kind=Pod`.
    pub pod: Option<String>,
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
    #[serde(default)]
    extra: std::collections::HashMap<String, Vec<String>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
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
        if let Some(w) = parse(line, namespace)? {
            out.push(w);
        }
    }
    Ok(out)
}

/// One line of the log, if it is an accepted write in `namespace`.
fn parse(line: &str, namespace: &str) -> anyhow::Result<Option<Write>> {
    let Ok(e) = serde_json::from_str::<Event>(line) else {
        return Ok(None);
    };
    let Some(obj) = e.object_ref else {
        return Ok(None);
    };
    let ok = e
        .response_status
        .and_then(|s| s.code)
        .is_some_and(|c| (200..300).contains(&c));
    if e.stage != "ResponseComplete" || !ok || obj.namespace.as_deref() != Some(namespace) {
        return Ok(None);
    }
    let at = seconds(&e.stage_timestamp)?;
    let received = seconds(&e.request_received_timestamp)?;
    let resource = match obj.subresource {
        Some(sub) => format!("{}/{sub}", obj.resource.unwrap_or_default()),
        None => obj.resource.unwrap_or_default(),
    };
    let pod = e
        .user
        .extra
        .get("authentication.kubernetes.io/pod-name")
        .and_then(|v| v.first().cloned());
    Ok(Some(Write {
        pod,
        user: e.user.username,
        verb: e.verb,
        resource,
        name: obj.name.unwrap_or_default(),
        at,
        received,
        resource_version: obj.resource_version.filter(|v| !v.is_empty()),
    }))
}

/// An audit timestamp (RFC 3339, microseconds) as seconds since the epoch.
fn seconds(t: &str) -> anyhow::Result<f64> {
    Ok(t.parse::<k8s_openapi::jiff::Timestamp>()
        .map(|t| t.as_microsecond() as f64 / 1e6)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_update_is_read_with_its_precondition_and_both_times() {
        // As kube-apiserver v1.37 writes it at Metadata level.
        let line = r#"{"kind":"Event","apiVersion":"audit.k8s.io/v1","level":"Metadata","auditID":"x","stage":"ResponseComplete","requestURI":"/apis/batchlease.dev/v1alpha1/namespaces/ns/batchtasks/parent/status?","verb":"update","user":{"username":"operator-op","groups":["system:masters"]},"sourceIPs":["127.0.0.1"],"objectRef":{"resource":"batchtasks","namespace":"ns","name":"parent","uid":"u","apiGroup":"batchlease.dev","apiVersion":"v1alpha1","resourceVersion":"4070","subresource":"status"},"responseStatus":{"metadata":{},"code":200},"requestReceivedTimestamp":"2026-12-01T22:31:24.806744Z","stageTimestamp":"2026-12-01T22:31:24.843302Z"}"#;
        let w = parse(line, "ns").unwrap().unwrap();
        assert_eq!(
            (
                w.user.as_str(),
                w.verb.as_str(),
                w.resource.as_str(),
                w.name.as_str()
            ),
            ("operator-op", "update", "batchtasks/status", "parent")
        );
        assert_eq!(w.resource_version.as_deref(), Some("4070"));
        assert!(
            (w.received - 1_796_164_284.806_744).abs() < 1e-5,
            "{}",
            w.received
        );
        assert!((w.at - 1_796_164_284.843_302).abs() < 1e-5, "{}", w.at);
        assert!(parse(line, "other").unwrap().is_none());
        let refused = line.replace(r#""code":200"#, r#""code":409"#);
        assert!(parse(&refused, "ns").unwrap().is_none());
        assert_eq!(w.pod, None);
    }

    #[test]
    fn a_pod_bound_token_names_its_pod() {
        let line = r#"{"kind":"Event","apiVersion":"audit.k8s.io/v1","level":"Metadata","auditID":"x","stage":"ResponseComplete","verb":"update","user":{"username":"system:serviceaccount:ns:op","groups":["system:serviceaccounts"],"extra":{"authentication.kubernetes.io/credential-id":["JTI=1"],"authentication.kubernetes.io/node-name":["e2e-node"],"authentication.kubernetes.io/pod-name":["op-7d9c-abcde"],"authentication.kubernetes.io/pod-uid":["u"]}},"objectRef":{"resource":"leases","namespace":"ns","name":"batchlease-operator","apiGroup":"coordination.k8s.io","apiVersion":"v1"},"responseStatus":{"metadata":{},"code":200},"requestReceivedTimestamp":"2026-12-01T22:31:24.806744Z","stageTimestamp":"2026-12-01T22:31:24.843302Z"}"#;
        let w = parse(line, "ns").unwrap().unwrap();
        assert_eq!(w.pod.as_deref(), Some("op-7d9c-abcde"));
        assert_eq!(w.user, "system:serviceaccount:ns:op");
    }
}
