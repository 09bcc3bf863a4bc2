//! The dashboard's HTTP side: the page, its JSON, its event stream, and
//! the two writes (cancel, redrive), made with the user's credentials.
//!
//! It listens on loopback and holds the user's credentials, so it guards
//! against the two ways another web page could use them: a request whose
//! `Host` is not this server's address is refused (DNS rebinding), and a
//! write must carry a random token that only the dashboard's own page can
//! read (a cross-site form or `fetch` cannot set the header without a CORS
//! preflight, which this server never grants).

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

/// Refuses foreign `Host`s and tokenless writes; adds the headers that
/// keep the page out of frames and its data out of caches.
async fn guard(State(app): State<App>, req: Request, next: Next) -> Response {
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or_default();
    if !app.hosts.is_empty() && !app.hosts.iter().any(|h| h == host) {
        return error(
            StatusCode::MISDIRECTED_REQUEST,
            format!("this dashboard answers to {} only", app.hosts.join(", ")),
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
            .is_some_and(|t| t == app.token);
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
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static("default-src 'self'; frame-ancestors 'none'"),
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
    match app
        .cache
        .with_journal(|j| view_task::detail(&snap, j, &ns, &name))
    {
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

/// The task as the cache has it, if it is in the dashboard's scope.
fn cached(app: &App, ns: &str, name: &str) -> Option<Arc<BatchTask>> {
    app.cache.snapshot().task(ns, name).cloned()
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

async fn cancel_task(State(app): State<App>, Path((ns, name)): Path<(String, String)>) -> Response {
    let Some(t) = cached(&app, &ns, &name) else {
        return not_found(&ns, &name);
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
    let Some(t) = cached(&app, &ns, &name) else {
        return not_found(&ns, &name);
    };
    let targets = match redrive::targets(
        std::slice::from_ref(&*t),
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
    let rest = futures::stream::unfold((app, rx), |(app, mut rx)| async move {
        rx.changed().await.ok()?;
        tokio::time::sleep(COALESCE).await;
        rx.borrow_and_update();
        let ev = change_event(&app);
        Some((Ok(ev), (app, rx)))
    });
    Sse::new(futures::StreamExt::chain(first, rest)).keep_alive(KeepAlive::default())
}

fn change_event(app: &App) -> Event {
    let data = serde_json::to_string(&info_of(app)).unwrap_or_else(|_| "{}".into());
    Event::default().event("change").data(data)
}
