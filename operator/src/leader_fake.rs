//! Test only: an API server for the Leases of one namespace, in memory, for
//! paused-time tests of the election. It keeps one Lease with real
//! resourceVersion CAS (create 409s when present, replace 409s on a stale
//! version and 404s when absent), applies each request when it *answers*,
//! and can delay any request or answer it with a forced status instead
//! (scripted in order of arrival). Every answer is logged with its time.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use kube::client::Body;
use tokio::time::Instant;

/// The answer to one scripted request.
#[derive(Clone, Debug)]
pub(crate) struct Scripted {
    pub method: &'static str,
    pub delay: Duration,
    /// Answer with this status without applying the request.
    pub forced: Option<u16>,
}

/// One answered request.
#[derive(Clone, Debug)]
pub(crate) struct Answered {
    pub method: String,
    pub status: u16,
    pub at: Instant,
}

#[derive(Debug, Default)]
struct State {
    lease: Option<Lease>,
    rv: u64,
    script: VecDeque<Scripted>,
    log: Vec<Answered>,
}

/// The fake server; clones share it.
#[derive(Clone, Debug, Default)]
pub(crate) struct FakeLeases(Arc<Mutex<State>>);

impl FakeLeases {
    /// A kube client whose every request this fake answers.
    pub fn client(&self) -> kube::Client {
        let me = self.clone();
        let svc = tower::service_fn(move |req: http::Request<Body>| {
            let me = me.clone();
            async move { Ok::<_, Infallible>(me.answer(req).await) }
        });
        kube::Client::new(svc, "ns")
    }

    /// Queues a scripted answer for the next request of `method`.
    pub fn script(&self, method: &'static str, delay: Duration, forced: Option<u16>) {
        self.0.lock().unwrap().script.push_back(Scripted {
            method,
            delay,
            forced,
        });
    }

    /// The Lease as stored.
    pub fn lease(&self) -> Option<Lease> {
        self.0.lock().unwrap().lease.clone()
    }

    /// Writes the Lease as a third party would (`kubectl edit`): `None`
    /// deletes it. Returns its new version.
    pub fn put(&self, lease: Option<Lease>) -> Option<String> {
        let mut s = self.0.lock().unwrap();
        s.rv += 1;
        let rv = s.rv.to_string();
        s.lease = lease.map(|mut l| {
            l.metadata.resource_version = Some(rv.clone());
            l
        });
        s.lease.as_ref().map(|_| rv)
    }

    /// Edits the stored Lease's spec (it must exist).
    pub fn edit(&self, f: impl FnOnce(&mut LeaseSpec)) {
        let mut l = self.lease().expect("a Lease to edit");
        f(l.spec.get_or_insert_with(Default::default));
        self.put(Some(l));
    }

    /// Every answered request so far.
    pub fn log(&self) -> Vec<Answered> {
        self.0.lock().unwrap().log.clone()
    }

    async fn answer(&self, req: http::Request<Body>) -> http::Response<Body> {
        let method = req.method().as_str().to_owned();
        let scripted = {
            let mut s = self.0.lock().unwrap();
            match s.script.front() {
                Some(x) if x.method == method => s.script.pop_front(),
                _ => None,
            }
        };
        let body = req.into_body().collect_bytes().await.unwrap_or_default();
        if let Some(x) = &scripted {
            tokio::time::sleep(x.delay).await;
        }
        let mut s = self.0.lock().unwrap();
        let (status, out) = match scripted.and_then(|x| x.forced) {
            Some(code) => (code, status_body(code)),
            None => apply(&mut s, &method, &body),
        };
        s.log.push(Answered {
            method,
            status,
            at: Instant::now(),
        });
        http::Response::builder()
            .status(status)
            .header("content-type", "application/json")
            .body(Body::from(out))
            .unwrap()
    }
}

fn apply(s: &mut State, method: &str, body: &[u8]) -> (u16, Vec<u8>) {
    let stored = |s: &State| serde_json::to_vec(s.lease.as_ref().unwrap()).unwrap();
    match method {
        "GET" => match &s.lease {
            Some(_) => (200, stored(s)),
            None => (404, status_body(404)),
        },
        "POST" | "PUT" => {
            let mut sent: Lease = serde_json::from_slice(body).unwrap();
            match (method, &s.lease) {
                ("POST", Some(_)) => return (409, status_body(409)),
                ("PUT", None) => return (404, status_body(404)),
                ("PUT", Some(cur))
                    if cur.metadata.resource_version != sent.metadata.resource_version =>
                {
                    return (409, status_body(409));
                }
                _ => {}
            }
            s.rv += 1;
            sent.metadata.resource_version = Some(s.rv.to_string());
            s.lease = Some(sent);
            (if method == "POST" { 201 } else { 200 }, stored(s))
        }
        _ => (405, status_body(405)),
    }
}

fn status_body(code: u16) -> Vec<u8> {
    // kube's `get_opt` reads a 404 as "absent" by its reason.
    let reason = match code {
        404 => "NotFound",
        409 => "Conflict",
        _ => "InternalError",
    };
    serde_json::to_vec(&serde_json::json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": format!("fake {code}"), "reason": reason, "code": code,
    }))
    .unwrap()
}
