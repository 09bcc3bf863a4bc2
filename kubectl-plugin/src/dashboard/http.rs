//! The dashboard's HTTP side: the page, its JSON, its event stream, and
//! the two writes (cancel, redrive), made with the user's credentials.
//!
//! It holds the user's credentials, so every request must show the
//! session's secret: the URL the dashboard prints carries it
//! (`/?token=…`), and the first visit trades it for an `HttpOnly`,
//! `SameSite=Strict` cookie. That keeps out other users of the machine
//! (loopback is reachable by all of them) and other web sites (the cookie
//! is never sent cross-site). A request whose `Host` is not one this
//! server answers to is refused first (DNS rebinding), and a write must
//! also carry the token in a header that only the dashboard's own page
//! can set (a cross-site form cannot, and this server grants no CORS).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use batchlease_api::BatchTask;
use futures::Stream;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::Api;
use serde::Serialize;

use super::cache::Cache;
use super::{assets, view_locks, view_queues, view_task, view_tasks};
use crate::{cancel, redrive, writes};

/// The header a write must carry, with the page's token.
pub const TOKEN_HEADER: &str = "x-batchlease-token";
/// Changes closer together than this reach the pages as one.
const COALESCE: Duration = Duration::from_millis(250);

/// What the handlers share.
#[derive(Clone)]
pub struct App {
    pub cache: Arc<Cache>,
    pub client: Client,
    pub token: String,
    /// `Host` values accepted: this server's address by IP and as
    /// `localhost` (empty: any).
    pub hosts: Vec<String>,
    pub started: Timestamp,
    /// Becomes `true` when the server shuts down: the event streams end.
    pub stopping: tokio::sync::watch::Receiver<bool>,
}

impl std::fmt::Debug for App {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("App")
            .field("hosts", &self.hosts)
            .field("started", &self.started)
            .finish_non_exhaustive()
    }
}

/// The router, guarded.
pub fn router(app: App) -> Router {
    Router::new()
        .route("/", get(index))
        .route("/app.js", get(app_js))
        .route("/app.css", get(app_css))
        .route("/api/info", get(info))
        .route("/api/queues", get(queues))
        .route("/api/tasks", get(tasks))
        .route("/api/task/{namespace}/{name}", get(task))
        .route("/api/task/{namespace}/{name}/cancel", post(cancel_task))
        .route("/api/task/{namespace}/{name}/redrive", post(redrive_task))
        .route("/api/locks", get(locks))
        .route("/api/events", get(events))
        .layer(middleware::from_fn_with_state(app.clone(), guard))
        .with_state(app)
}

/// The cookie that carries the session's secret.
const COOKIE: &str = "batchlease_dashboard";

/// `Host` as compared: with the port HTTP leaves out when it is 80.
fn normalized_host(h: &str) -> String {
    let has_port = h.rsplit_once(':').is_some_and(|(_, p)| !p.contains(']'));
    if has_port {
        h.to_owned()
    } else {
        format!("{h}:80")
    }
}

/// Equal, in time independent of where they differ.
fn same_secret(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

fn cookie_secret(headers: &axum::http::HeaderMap) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|c| {
            let (k, v) = c.trim().split_once('=')?;
            (k == COOKIE).then(|| v.to_owned())
        })
}

/// Refuses foreign `Host`s, requests without the session's cookie and
/// writes without the page's token; trades the URL's token for the
/// cookie; adds the headers that keep the page out of frames, its data
/// out of caches and its types unsniffed.
async fn guard(State(app): State<App>, req: Request, next: Next) -> Response {
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .map(normalized_host)
        .unwrap_or_default();
    if !app.hosts.contains(&host) {
        return error(
            StatusCode::MISDIRECTED_REQUEST,
            format!(
                "this dashboard answers to {} only (--allow-host adds a name)",
                app.hosts.join(", ")
            ),
        );
    }
    let offered = req
        .uri()
        .query()
        .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("token=")));
    if let Some(t) = offered {
        if !same_secret(t, &app.token) {
            return error(StatusCode::UNAUTHORIZED, "wrong token in the URL");
        }
        // Into the cookie, and out of the address bar and history.
        let cookie = format!("{COOKIE}={}; HttpOnly; SameSite=Strict; Path=/", app.token);
        let mut res = (StatusCode::SEE_OTHER, [(header::LOCATION, "/")]).into_response();
        if let Ok(v) = HeaderValue::from_str(&cookie) {
            res.headers_mut().insert(header::SET_COOKIE, v);
        }
        return res;
    }
    if !cookie_secret(req.headers()).is_some_and(|c| same_secret(&c, &app.token)) {
        return error(
            StatusCode::UNAUTHORIZED,
            "open the URL `kubectl batchlease dashboard` printed: it carries this session's token",
        );
    }
    let safe = matches!(
        *req.method(),
        axum::http::Method::GET | axum::http::Method::HEAD
    );
    if !safe {
        let ok = req
            .headers()
            .get(TOKEN_HEADER)
            .and_then(|h| h.to_str().ok())
            .is_some_and(|t| same_secret(t, &app.token));
        if !ok {
            return error(
                StatusCode::FORBIDDEN,
                "a write must come from the dashboard's own page (missing or wrong token)",
            );
        }
    }
    let mut res = next.run(req).await;
    let h = res.headers_mut();
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
        ),
    );
    res
}

#[derive(Debug, Serialize)]
struct ErrorBody {
    error: String,
}

fn error(code: StatusCode, msg: impl Into<String>) -> Response {
    (code, Json(ErrorBody { error: msg.into() })).into_response()
}

async fn app_js() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/javascript")], assets::APP_JS)
}

async fn app_css() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/css")], assets::APP_CSS)
}

async fn index(State(app): State<App>) -> Html<String> {
    Html(assets::INDEX_HTML.replace("{{TOKEN}}", &app.token))
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct Info {
    namespace: Option<String>,
    watches: std::collections::BTreeMap<&'static str, super::cache::WatchHealth>,
    /// Renewals and checkpoints before this time were not seen.
    journal_since: Timestamp,
    now: Timestamp,
}

fn info_of(app: &App) -> Info {
    Info {
        namespace: app.cache.scope.namespace.clone(),
        watches: app.cache.health(),
        journal_since: app.started,
        now: Timestamp::now(),
    }
}

async fn info(State(app): State<App>) -> Json<Info> {
    Json(info_of(&app))
}

async fn queues(State(app): State<App>) -> Json<Vec<view_queues::QueueRow>> {
    Json(view_queues::queues(&app.cache.snapshot(), Timestamp::now()))
}

async fn tasks(State(app): State<App>, Query(q): Query<view_tasks::TaskQuery>) -> Response {
    match view_tasks::tasks(&app.cache.snapshot(), &q, Timestamp::now()) {
        Ok(page) => Json(page).into_response(),
        Err(e) => error(StatusCode::BAD_REQUEST, e.to_string()),
    }
}

async fn task(State(app): State<App>, Path((ns, name)): Path<(String, String)>) -> Response {
    let snap = app.cache.snapshot();
    let keys = view_task::lease_keys(&snap, &ns, &name);
    let journal = app.cache.with_journal(|j| j.subset(keys));
    match view_task::detail(&snap, &journal, &ns, &name) {
        Some(d) => Json(d).into_response(),
        None => not_found(&ns, &name),
    }
}

async fn locks(State(app): State<App>) -> Json<Vec<view_locks::LockRow>> {
    Json(view_locks::locks(&app.cache.snapshot(), Timestamp::now()))
}

#[derive(Debug, Serialize)]
struct Done {
    message: String,
}

fn not_found(ns: &str, name: &str) -> Response {
    error(StatusCode::NOT_FOUND, format!("no task {ns}/{name}"))
}

/// An API server refusal keeps its status code and its words (a 403 says
/// which permission the user lacks).
fn api_error(e: &kube::Error) -> Response {
    match e {
        kube::Error::Api(s) => error(
            StatusCode::from_u16(s.code).unwrap_or(StatusCode::BAD_GATEWAY),
            s.message.clone(),
        ),
        e => error(
            StatusCode::BAD_GATEWAY,
            batchlease_api::Chain(e).to_string(),
        ),
    }
}

/// The task as the API server has it now: a write is decided on fresh
/// data, not on a cache that may lag (or be stale behind a failing watch).
async fn fresh(app: &App, ns: &str, name: &str) -> Result<BatchTask, Box<Response>> {
    if app
        .cache
        .scope
        .namespace
        .as_deref()
        .is_some_and(|s| s != ns)
    {
        return Err(Box::new(not_found(ns, name)));
    }
    let api: Api<BatchTask> = Api::namespaced(app.client.clone(), ns);
    match api.get_opt(name).await {
        Ok(Some(t)) => Ok(t),
        Ok(None) => Err(Box::new(not_found(ns, name))),
        Err(e) => Err(Box::new(api_error(&e))),
    }
}

async fn cancel_task(State(app): State<App>, Path((ns, name)): Path<(String, String)>) -> Response {
    let t = match fresh(&app, &ns, &name).await {
        Ok(t) => t,
        Err(r) => return *r,
    };
    let d = cancel::decide(&t);
    if d.needs_patch() {
        let api: Api<BatchTask> = Api::namespaced(app.client.clone(), &ns);
        if let Err(e) = writes::cancel(&api, &name, &d.uid).await {
            return api_error(&e);
        }
    }
    Json(Done {
        message: d.message(),
    })
    .into_response()
}

async fn redrive_task(
    State(app): State<App>,
    Path((ns, name)): Path<(String, String)>,
) -> Response {
    let t = match fresh(&app, &ns, &name).await {
        Ok(t) => t,
        Err(r) => return *r,
    };
    let targets = match redrive::targets(
        std::slice::from_ref(&t),
        &redrive::Selection::Task(name.clone()),
    ) {
        Ok(t) => t,
        Err(e) => return error(StatusCode::CONFLICT, e),
    };
    let api: Api<BatchTask> = Api::namespaced(app.client.clone(), &ns);
    for t in &targets {
        if let Err(e) = writes::redrive(&api, &t.name, &t.uid, t.redrive).await {
            return api_error(&e);
        }
    }
    Json(Done {
        message: format!("batchtask/{name} redriven"),
    })
    .into_response()
}

/// Server-sent events: `change` with the watches' health whenever the
/// caches changed (coalesced), and at once on connect. The browser's
/// EventSource reconnects by itself when this stream breaks.
async fn events(State(app): State<App>) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let rx = app.cache.subscribe();
    let first = futures::stream::once({
        let app = app.clone();
        async move { Ok(change_event(&app)) }
    });
    let stop = app.stopping.clone();
    let rest = futures::stream::unfold((app, rx, stop), |(app, mut rx, mut stop)| async move {
        if *stop.borrow() {
            return None;
        }
        tokio::select! {
            r = rx.changed() => r.ok()?,
            _ = stop.changed() => return None,
        }
        tokio::time::sleep(COALESCE).await;
        rx.borrow_and_update();
        let ev = change_event(&app);
        Some((Ok(ev), (app, rx, stop)))
    });
    Sse::new(futures::StreamExt::chain(first, rest)).keep_alive(KeepAlive::default())
}

fn change_event(app: &App) -> Event {
    let data = serde_json::to_string(&info_of(app)).unwrap_or_else(|_| "{}".into());
    Event::default().event("change").data(data)
}
