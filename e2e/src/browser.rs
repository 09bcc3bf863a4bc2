//! A headless Chromium the tests drive, for the web dashboard
//! (`kubectl batchlease dashboard`): pages are loaded, read, clicked and
//! typed into as a user would, and timed for the benchmark.
//!
//! Chromium is driven through `chromedriver` with the W3C WebDriver
//! protocol (JSON over HTTP). The client is the few requests below over
//! hyper, which kube already brings into the lock file, rather than a
//! WebDriver crate (fantoccini): that crate adds its own dependency tree
//! (the `webdriver` crate, cookies, TLS features to keep from pulling
//! OpenSSL) for a dozen endpoints on a localhost HTTP server, and the
//! harness needs chromedriver's own endpoints anyway (`se/log` for the
//! console, `goog/cdp/execute` for the DevTools commands the measurements
//! use), which a generic client leaves to raw calls.
//!
//! Text is read in the page (`innerText` of `document.querySelector`, in
//! one script) rather than with WebDriver's find-element-then-get-text: the
//! dashboard re-renders as server-sent events arrive, and an element found
//! in one request can be gone ("stale") by the next.
//!
//! The binaries are `chromium` and `chromedriver` on `PATH` (hack/deps.sh
//! installs both), or `BATCHLEASE_CHROMIUM` and `BATCHLEASE_CHROMEDRIVER`.
//! Tests call [`skip`] first: it skips a test on a machine without them,
//! unless `BATCHLEASE_REQUIRE_BROWSER` is set (CI sets it, so a missing
//! browser fails there instead of passing silently).

use std::cell::RefCell;
use std::fmt;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::Context;
use base64::Engine;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};

use crate::ports::free_port;
use crate::process::Process;
use crate::secrets::PrivateDir;
use crate::wait::wait_for;

mod measure;
mod procs;

pub use procs::RendererMemory;
use procs::kill_descendants;

/// Keys for [`Browser::press_key`], [`Browser::press_chord`] and
/// [`Browser::type_into`]: WebDriver's code points for the keys that are
/// not characters.
pub mod keys {
    pub const TAB: &str = "\u{E004}";
    pub const ENTER: &str = "\u{E007}";
    pub const SHIFT: &str = "\u{E008}";
    pub const ESCAPE: &str = "\u{E00C}";
    pub const SPACE: &str = "\u{E00D}";
    pub const ARROW_LEFT: &str = "\u{E012}";
    pub const ARROW_UP: &str = "\u{E013}";
    pub const ARROW_RIGHT: &str = "\u{E014}";
    pub const ARROW_DOWN: &str = "\u{E015}";
}

/// How long one WebDriver command may take. Navigation waits for the page's
/// load event, which on a loaded 2-core CI machine can take seconds; a
/// command past this is a hung browser, and the test should say so rather
/// than hang.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

/// How long chromedriver may take to answer `/status` and Chromium to start
/// (both well under a second on an idle machine).
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// How long each diagnostic request of a failed wait may take: they run
/// after a deadline passed, often because the browser is unwell.
const DIAGNOSTIC_TIMEOUT: Duration = Duration::from_secs(5);

/// What WebDriver calls a reference to an element in JSON.
const ELEMENT_KEY: &str = "element-6066-11e4-a52e-4f735466cecf";

/// How often a click or typing is retried when the element found went
/// stale before it could be used (the page re-rendered in between).
const STALE_RETRIES: usize = 3;

/// The Chromium binary: `BATCHLEASE_CHROMIUM`, else `chromium` (Debian) or
/// `chromium-browser` on `PATH`.
pub fn chromium_bin() -> Option<PathBuf> {
    bin_from("BATCHLEASE_CHROMIUM", &["chromium", "chromium-browser"])
}

/// The chromedriver binary: `BATCHLEASE_CHROMEDRIVER`, else `chromedriver`
/// on `PATH`.
pub fn chromedriver_bin() -> Option<PathBuf> {
    bin_from("BATCHLEASE_CHROMEDRIVER", &["chromedriver"])
}

fn bin_from(var: &str, names: &[&str]) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(var).filter(|v| !v.is_empty()) {
        return Some(PathBuf::from(p)).filter(|p| p.is_file());
    }
    let path = std::env::var_os("PATH")?;
    names.iter().find_map(|name| {
        std::env::split_paths(&path)
            .map(|dir| dir.join(name))
            .find(|p| p.is_file())
    })
}

/// Why a browser cannot be started here, if it cannot.
pub fn missing() -> Option<String> {
    let mut why = Vec::new();
    if chromium_bin().is_none() {
        why.push("chromium (PATH or BATCHLEASE_CHROMIUM)");
    }
    if chromedriver_bin().is_none() {
        why.push("chromedriver (PATH or BATCHLEASE_CHROMEDRIVER)");
    }
    (!why.is_empty()).then(|| format!("not installed: {}", why.join(", ")))
}

/// Whether test `test` should return at once because there is no browser:
/// true (after printing why) when Chromium or chromedriver is missing.
///
/// # Panics
///
/// When they are missing and `BATCHLEASE_REQUIRE_BROWSER` is set: hack/test.sh
/// sets it because hack/deps.sh installed them, so a browser test that
/// would not run is a failure there, not a skip.
pub fn skip(test: &str) -> bool {
    let Some(why) = missing() else {
        return false;
    };
    if std::env::var_os("BATCHLEASE_REQUIRE_BROWSER").is_some_and(|v| !v.is_empty()) {
        panic!("{test}: BATCHLEASE_REQUIRE_BROWSER is set, but the browser is {why}");
    }
    eprintln!(
        "skipping {test}: the browser is {why} (hack/deps.sh installs it; \
         BATCHLEASE_REQUIRE_BROWSER=1 makes this a failure)"
    );
    true
}

/// A WebDriver command that failed in the browser (the driver answered with
/// an error), as opposed to one that got no answer.
#[derive(Debug, Clone)]
pub struct WebDriverError {
    /// The request, e.g. `POST /element/…/click`.
    pub command: String,
    /// WebDriver's error code, e.g. `no such element`, `stale element reference`.
    pub error: String,
    /// The message's first line (the rest is chromedriver's native stack).
    pub message: String,
}

impl fmt::Display for WebDriverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}: {}", self.command, self.error, self.message)
    }
}

impl std::error::Error for WebDriverError {}

/// Whether `e` is WebDriver's error `code`.
fn is_webdriver_error(e: &anyhow::Error, code: &str) -> bool {
    e.downcast_ref::<WebDriverError>()
        .is_some_and(|w| w.error == code)
}

/// A reference to an element of the current page, as WebDriver hands them
/// out; it goes stale when the page replaces the element.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Element(pub String);

/// The element that has the keyboard focus.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActiveElement {
    /// Lower-case tag name (`body` when nothing in particular has focus).
    pub tag: String,
    /// The `id` attribute, empty when there is none.
    pub id: String,
    /// Its `innerText`.
    pub text: String,
}

impl fmt::Display for ActiveElement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "<{}", self.tag)?;
        if !self.id.is_empty() {
            write!(f, " id={:?}", self.id)?;
        }
        write!(f, "> {:?}", self.text)
    }
}

/// The JSON-over-HTTP side: requests to chromedriver, each with a deadline.
#[derive(Debug, Clone)]
struct Driver {
    http: Client<HttpConnector, Full<Bytes>>,
    port: u16,
}

impl Driver {
    /// Sends `method path` with `body` and returns the reply's `value`;
    /// an error reply is a [`WebDriverError`].
    async fn command(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
        timeout: Duration,
    ) -> anyhow::Result<Value> {
        let what = format!("{method} {path}");
        let body = match &body {
            Some(b) => Bytes::from(serde_json::to_vec(b)?),
            None => Bytes::new(),
        };
        let req = Request::builder()
            .method(method)
            .uri(format!("http://127.0.0.1:{}{path}", self.port))
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(body))?;
        let exchange = async {
            let resp = self.http.request(req).await?;
            let status = resp.status();
            let bytes = resp.into_body().collect().await?.to_bytes();
            anyhow::Ok((status, bytes))
        };
        let (status, bytes) = tokio::time::timeout(timeout, exchange)
            .await
            .map_err(|_| anyhow::anyhow!("{what}: no answer from chromedriver in {timeout:?}"))?
            .with_context(|| format!("{what}: request to chromedriver"))?;
        let mut reply: Value = serde_json::from_slice(&bytes).with_context(|| {
            format!(
                "{what}: HTTP {status}, not JSON: {}",
                String::from_utf8_lossy(&bytes)
            )
        })?;
        let value = reply
            .get_mut("value")
            .map(Value::take)
            .unwrap_or(Value::Null);
        if status.is_success() {
            return Ok(value);
        }
        let field = |k: &str| value.get(k).and_then(Value::as_str).unwrap_or_default();
        Err(WebDriverError {
            command: what,
            error: field("error").to_owned(),
            message: field("message")
                .lines()
                .next()
                .unwrap_or_default()
                .to_owned(),
        }
        .into())
    }
}

/// A headless Chromium session behind its own chromedriver, and the
/// directory its screenshots go to.
///
/// [`Browser::close`] ends the session; dropping it without closing ends
/// it too, but blocking (Drop cannot await), and kills whatever of
/// Chromium is left.
#[derive(Debug)]
pub struct Browser {
    driver: Driver,
    /// `/session/<id>`, the prefix of every command's path.
    session: String,
    out_dir: PathBuf,
    startup: Duration,
    /// Numbers the screenshots written to `out_dir`, in order.
    shots: AtomicU32,
    closed: bool,
    // Dropped after `drop` ended the session: chromedriver, then the
    // profile directory Chromium wrote to.
    process: Process,
    _profile: PrivateDir,
}

impl Browser {
    /// Starts chromedriver on a free port and a headless Chromium session
    /// through it; screenshots go to `out_dir` (created if need be).
    pub async fn start(out_dir: &Path) -> anyhow::Result<Self> {
        let started = Instant::now();
        let chromium = chromium_bin().context("chromium is not installed")?;
        let chromedriver = chromedriver_bin().context("chromedriver is not installed")?;
        std::fs::create_dir_all(out_dir)
            .with_context(|| format!("creating {}", out_dir.display()))?;
        let profile = PrivateDir::new("chromium")?;
        let port = free_port()?;
        // Chromium writes to $XDG_CONFIG_HOME and $XDG_CACHE_HOME besides
        // its profile (crash reports, caches): into the profile directory
        // too, removed with it, not the home directory of whoever runs the
        // tests.
        let env = ["XDG_CONFIG_HOME", "XDG_CACHE_HOME"]
            .iter()
            .map(|k| {
                let dir = profile.path().join(k.to_lowercase());
                (k.to_string(), dir.display().to_string())
            })
            .collect();
        let process = Process::start(
            chromedriver.display().to_string(),
            "browser",
            &format!("chromedriver-{port}"),
            vec![format!("--port={port}")],
            env,
        )?;
        let driver = Driver {
            http: Client::builder(TokioExecutor::new()).build_http(),
            port,
        };
        let process = Mutex::new(process);
        let up = wait_for(
            "chromedriver to answer /status",
            START_TIMEOUT,
            || lock(&process).logs(),
            || {
                let (driver, process) = (&driver, &process);
                async move {
                    // One that exited (bad flags, port taken) will never
                    // answer: that ends the wait at once.
                    if let Some(status) = lock(process).exited() {
                        return Ok(Some(Err(anyhow::anyhow!("chromedriver exited ({status})"))));
                    }
                    let v = driver
                        .command(Method::GET, "/status", None, COMMAND_TIMEOUT)
                        .await?;
                    let ready = v.get("ready").and_then(Value::as_bool).unwrap_or(false);
                    Ok(ready.then_some(Ok(())))
                }
            },
        )
        .await;
        let process = process.into_inner().unwrap_or_else(PoisonError::into_inner);
        up?.map_err(|e| anyhow::anyhow!("{e:#}\n{}", process.logs()))?;
        let args = [
            "--headless=new",
            // Chromium's sandbox refuses to run as root (CI runs as root).
            "--no-sandbox",
            "--disable-gpu",
            // /dev/shm is small in containers; Chromium then crashes tabs.
            "--disable-dev-shm-usage",
            "--window-size=1400,1000",
            // performance.memory otherwise rounds to 100 kB buckets and
            // updates only every 20 minutes, useless to a benchmark.
            "--enable-precise-memory-info",
            &format!(
                "--user-data-dir={}",
                profile.path().join("profile").display()
            ),
        ];
        let caps = json!({
            "capabilities": {
                "alwaysMatch": {
                    "browserName": "chrome",
                    "goog:chromeOptions": {
                        "binary": chromium.display().to_string(),
                        "args": args,
                    },
                    // The page's console, for the diagnostics of a failed wait.
                    "goog:loggingPrefs": { "browser": "ALL" },
                }
            }
        });
        let session = driver
            .command(Method::POST, "/session", Some(caps), START_TIMEOUT)
            .await;
        let session = match session {
            Ok(s) => s,
            Err(e) => {
                // A Chromium that hung while starting outlives its
                // chromedriver (killed when `process` drops).
                if let Some(pid) = process.pid() {
                    kill_descendants(pid);
                }
                anyhow::bail!(
                    "starting {} through chromedriver: {e:#}\n{}",
                    chromium.display(),
                    process.logs()
                );
            }
        };
        let id = session
            .get("sessionId")
            .and_then(Value::as_str)
            .with_context(|| format!("new session without an id: {session}"))?;
        let mut browser = Self {
            driver,
            session: format!("/session/{id}"),
            out_dir: out_dir.to_owned(),
            startup: Duration::ZERO,
            shots: AtomicU32::new(0),
            closed: false,
            process,
            _profile: profile,
        };
        // The first command of a session waits until Chromium's first tab
        // is ready: measured 0.1 s to 5 s after the session was created.
        // Taken here, that wait counts as start-up rather than landing in
        // whatever the test does (and times) first.
        browser
            .exec("return 1;", &[])
            .await
            .context("the first command of the session")?;
        browser.startup = started.elapsed();
        Ok(browser)
    }

    /// From starting chromedriver to Chromium's first tab answering.
    pub fn startup_time(&self) -> Duration {
        self.startup
    }

    /// Where screenshots go.
    pub fn out_dir(&self) -> &Path {
        &self.out_dir
    }

    /// chromedriver's log (Chromium's own output goes there too).
    pub fn driver_log(&self) -> &Path {
        &self.process.log
    }

    /// Ends the session (Chromium exits) and stops chromedriver. Dropping
    /// does the same, blocking; this says whether it worked.
    pub async fn close(mut self) -> anyhow::Result<()> {
        self.closed = true;
        self.driver
            .command(Method::DELETE, &self.session, None, COMMAND_TIMEOUT)
            .await
            .map(drop)
    }

    async fn cmd(&self, method: Method, path: &str, body: Option<Value>) -> anyhow::Result<Value> {
        self.cmd_within(method, path, body, COMMAND_TIMEOUT).await
    }

    async fn cmd_within(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
        timeout: Duration,
    ) -> anyhow::Result<Value> {
        let path = format!("{}{path}", self.session);
        self.driver.command(method, &path, body, timeout).await
    }

    /// Loads `url` and waits for its load event.
    pub async fn goto(&self, url: &str) -> anyhow::Result<()> {
        self.cmd(Method::POST, "/url", Some(json!({ "url": url })))
            .await
            .map(drop)
    }

    /// The current page's URL.
    pub async fn url(&self) -> anyhow::Result<String> {
        let v = self.cmd(Method::GET, "/url", None).await?;
        Ok(v.as_str().unwrap_or_default().to_owned())
    }

    /// The first element matching `css`; an error (WebDriver's `no such
    /// element`) when there is none.
    pub async fn find(&self, css: &str) -> anyhow::Result<Element> {
        let v = self
            .cmd(Method::POST, "/element", Some(locator(css)))
            .await?;
        element(&v)
    }

    /// Every element matching `css`, in document order.
    pub async fn find_all(&self, css: &str) -> anyhow::Result<Vec<Element>> {
        let v = self
            .cmd(Method::POST, "/elements", Some(locator(css)))
            .await?;
        v.as_array()
            .context("elements: not a list")?
            .iter()
            .map(element)
            .collect()
    }

    /// Clicks `el` as a user would (scrolled into view; an error when
    /// something covers it or it is disabled).
    pub async fn click_element(&self, el: &Element) -> anyhow::Result<()> {
        let path = format!("/element/{}/click", el.0);
        self.cmd(Method::POST, &path, Some(json!({})))
            .await
            .map(drop)
    }

    /// Clicks the first element matching `css`, found again when the page
    /// replaced it between finding and clicking.
    pub async fn click(&self, css: &str) -> anyhow::Result<()> {
        self.retry_stale(css, |el| async move { self.click_element(&el).await })
            .await
            .with_context(|| format!("clicking `{css}`"))
    }

    /// Types `text` into `el` (focusing it first); [`keys`] in `text` are
    /// pressed as keys.
    pub async fn type_into_element(&self, el: &Element, text: &str) -> anyhow::Result<()> {
        let path = format!("/element/{}/value", el.0);
        self.cmd(Method::POST, &path, Some(json!({ "text": text })))
            .await
            .map(drop)
    }

    /// Types `text` into the first element matching `css` (see
    /// [`Browser::type_into_element`]).
    pub async fn type_into(&self, css: &str, text: &str) -> anyhow::Result<()> {
        self.retry_stale(
            css,
            |el| async move { self.type_into_element(&el, text).await },
        )
        .await
        .with_context(|| format!("typing into `{css}`"))
    }

    /// Finds `css` and does `act` on it, again when the element went stale.
    async fn retry_stale<F, Fut>(&self, css: &str, mut act: F) -> anyhow::Result<()>
    where
        F: FnMut(Element) -> Fut,
        Fut: std::future::Future<Output = anyhow::Result<()>>,
    {
        let mut tries = 0;
        loop {
            let el = self.find(css).await?;
            match act(el).await {
                Err(e)
                    if tries < STALE_RETRIES
                        && is_webdriver_error(&e, "stale element reference") =>
                {
                    tries += 1;
                }
                r => return r,
            }
        }
    }

    /// Presses and releases `key` (a character or one of [`keys`]) where
    /// the keyboard focus is.
    pub async fn press_key(&self, key: &str) -> anyhow::Result<()> {
        self.press_chord(&[key]).await
    }

    /// Presses `keys` in order, then releases them in reverse, e.g.
    /// `[keys::SHIFT, keys::TAB]` for Shift+Tab.
    pub async fn press_chord(&self, keys: &[&str]) -> anyhow::Result<()> {
        let down = keys
            .iter()
            .map(|k| json!({ "type": "keyDown", "value": k }));
        let up = keys
            .iter()
            .rev()
            .map(|k| json!({ "type": "keyUp", "value": k }));
        let actions = json!({
            "actions": [{
                "type": "key",
                "id": "keyboard",
                "actions": down.chain(up).collect::<Vec<_>>(),
            }]
        });
        self.cmd(Method::POST, "/actions", Some(actions))
            .await
            .map(drop)
            .with_context(|| format!("pressing {keys:?}"))
    }

    /// Runs `js` as a function body with `arguments` = `args` and returns
    /// what it returns (a promise is awaited).
    pub async fn exec(&self, js: &str, args: &[Value]) -> anyhow::Result<Value> {
        self.exec_within(js, args, COMMAND_TIMEOUT).await
    }

    async fn exec_within(
        &self,
        js: &str,
        args: &[Value],
        timeout: Duration,
    ) -> anyhow::Result<Value> {
        let body = json!({ "script": js, "args": args });
        self.cmd_within(Method::POST, "/execute/sync", Some(body), timeout)
            .await
    }

    /// The `innerText` of the first element matching `css` (what a user
    /// reads), `None` when nothing matches.
    pub async fn text_opt(&self, css: &str) -> anyhow::Result<Option<String>> {
        self.text_within(css, COMMAND_TIMEOUT).await
    }

    async fn text_within(&self, css: &str, timeout: Duration) -> anyhow::Result<Option<String>> {
        const JS: &str = "const e = document.querySelector(arguments[0]);\
                          return e === null ? null : e.innerText;";
        let v = self
            .exec_within(JS, &[json!(css)], timeout)
            .await
            .with_context(|| format!("reading the text of `{css}`"))?;
        Ok(v.as_str().map(str::to_owned))
    }

    /// The `innerText` of the first element matching `css`; an error when
    /// nothing matches.
    pub async fn text(&self, css: &str) -> anyhow::Result<String> {
        self.text_opt(css)
            .await?
            .with_context(|| format!("no element matches `{css}`"))
    }

    /// The `innerText` of every element matching `css`, in document order.
    pub async fn texts(&self, css: &str) -> anyhow::Result<Vec<String>> {
        const JS: &str =
            "return Array.from(document.querySelectorAll(arguments[0]), e => e.innerText);";
        let v = self
            .exec(JS, &[json!(css)])
            .await
            .with_context(|| format!("reading the texts of `{css}`"))?;
        Ok(serde_json::from_value(v)?)
    }

    /// The element with the keyboard focus.
    pub async fn active_element(&self) -> anyhow::Result<ActiveElement> {
        const JS: &str = "const e = document.activeElement;\
                          return e === null ? ['', '', ''] \
                              : [e.tagName.toLowerCase(), e.id, e.innerText];";
        let v: [String; 3] = serde_json::from_value(self.exec(JS, &[]).await?)?;
        let [tag, id, text] = v;
        Ok(ActiveElement { tag, id, text })
    }

    /// The `innerText` of the element with the keyboard focus.
    pub async fn active_element_text(&self) -> anyhow::Result<String> {
        Ok(self.active_element().await?.text)
    }

    /// Whether the element with the keyboard focus matches `css`.
    pub async fn active_element_matches(&self, css: &str) -> anyhow::Result<bool> {
        const JS: &str = "const e = document.activeElement;\
                          return e !== null && e.matches(arguments[0]);";
        let v = self.exec(JS, &[json!(css)]).await?;
        Ok(v.as_bool().unwrap_or(false))
    }

    /// Writes a PNG of the viewport to `path`.
    pub async fn screenshot(&self, path: &Path) -> anyhow::Result<()> {
        self.screenshot_within(path, COMMAND_TIMEOUT).await
    }

    async fn screenshot_within(&self, path: &Path, timeout: Duration) -> anyhow::Result<()> {
        let v = self
            .cmd_within(Method::GET, "/screenshot", None, timeout)
            .await?;
        let png = base64::engine::general_purpose::STANDARD
            .decode(v.as_str().context("screenshot: not a string")?)
            .context("screenshot: not base64")?;
        std::fs::write(path, png).with_context(|| format!("writing {}", path.display()))
    }

    /// Writes a screenshot to the out dir, named `<n>-<name>.png` (numbered
    /// in the order taken), and returns its path.
    pub async fn screenshot_named(&self, name: &str) -> anyhow::Result<PathBuf> {
        let path = self.next_shot_path(name);
        self.screenshot(&path).await?;
        Ok(path)
    }

    fn next_shot_path(&self, name: &str) -> PathBuf {
        let n = self.shots.fetch_add(1, Ordering::Relaxed) + 1;
        self.out_dir.join(shot_name(n, name))
    }

    /// The page's console messages since the last call (chromedriver hands
    /// each out once), as `LEVEL message`.
    pub async fn console_log(&self) -> anyhow::Result<Vec<String>> {
        self.console_log_within(COMMAND_TIMEOUT).await
    }

    async fn console_log_within(&self, timeout: Duration) -> anyhow::Result<Vec<String>> {
        let v = self
            .cmd_within(
                Method::POST,
                "/se/log",
                Some(json!({ "type": "browser" })),
                timeout,
            )
            .await?;
        let entries = v.as_array().context("log: not a list")?;
        Ok(entries
            .iter()
            .map(|e| {
                let field = |k: &str| e.get(k).and_then(Value::as_str).unwrap_or_default();
                format!("{} {}", field("level"), field("message"))
            })
            .collect())
    }

    /// Polls the `innerText` of `css` until `predicate` holds and returns
    /// it. After `timeout` the error says `what` was awaited, the selector,
    /// the page's URL, the element's last text (or that nothing matched),
    /// where a screenshot went, and the console messages.
    pub async fn wait_text(
        &self,
        css: &str,
        what: &str,
        predicate: impl FnMut(&str) -> bool,
        timeout: Duration,
    ) -> anyhow::Result<String> {
        let last: Mutex<Option<Option<String>>> = Mutex::new(None);
        // Shared by every check's future (one runs at a time).
        let predicate = RefCell::new(predicate);
        let waited = wait_for(
            &format!("{what} (the text of `{css}`)"),
            timeout,
            String::new,
            || {
                let seen = self.text_opt(css);
                let last = &last;
                let predicate = &predicate;
                async move {
                    let text = seen.await?;
                    let ok = text.as_deref().is_some_and(|t| (predicate.borrow_mut())(t));
                    *last.lock().unwrap_or_else(PoisonError::into_inner) = Some(text.clone());
                    Ok(text.filter(|_| ok))
                }
            },
        )
        .await;
        match waited {
            Ok(text) => Ok(text),
            Err(e) => {
                let last = last.into_inner().unwrap_or_else(PoisonError::into_inner);
                let seen = match last {
                    None => "never read (every read failed)".to_owned(),
                    Some(None) => format!("no element matched `{css}`"),
                    Some(Some(t)) => format!("{t:?}"),
                };
                let diag = self.diagnostics(css, what).await;
                Err(anyhow::anyhow!(
                    "{e:#}\nlast text of `{css}`: {seen}\n{diag}"
                ))
            }
        }
    }

    /// What the page looks like now, for a failed wait: URL, the element's
    /// text, a screenshot and the console. Each part is best effort, with a
    /// short deadline: the browser may be why the wait failed.
    async fn diagnostics(&self, css: &str, what: &str) -> String {
        let mut out = String::from("--- browser ---\n");
        let t = DIAGNOSTIC_TIMEOUT;
        let url = self.cmd_within(Method::GET, "/url", None, t).await;
        match url {
            Ok(v) => out.push_str(&format!("url: {}\n", v.as_str().unwrap_or_default())),
            Err(e) => out.push_str(&format!("url: unknown ({e:#})\n")),
        }
        match self.text_within(css, t).await {
            Ok(Some(text)) => out.push_str(&format!("text of `{css}` now: {text:?}\n")),
            Ok(None) => out.push_str(&format!("text of `{css}` now: no element matches\n")),
            Err(e) => out.push_str(&format!("text of `{css}` now: unknown ({e:#})\n")),
        }
        let shot = self.next_shot_path(&format!("timeout-{what}"));
        match self.screenshot_within(&shot, t).await {
            Ok(()) => out.push_str(&format!("screenshot: {}\n", shot.display())),
            Err(e) => out.push_str(&format!("screenshot: failed ({e:#})\n")),
        }
        match self.console_log_within(t).await {
            Ok(lines) if lines.is_empty() => out.push_str("console: (empty)\n"),
            Ok(lines) => {
                out.push_str("console:\n");
                for l in lines.iter().rev().take(40).rev() {
                    out.push_str(&format!("  {l}\n"));
                }
            }
            Err(e) => out.push_str(&format!("console: unknown ({e:#})\n")),
        }
        out.push_str(&format!(
            "chromedriver log: {}\n",
            self.process.log.display()
        ));
        out
    }

    /// Runs a Chrome DevTools Protocol command through chromedriver.
    pub async fn cdp(&self, cmd: &str, params: Value) -> anyhow::Result<Value> {
        let body = json!({ "cmd": cmd, "params": params });
        self.cmd(Method::POST, "/goog/cdp/execute", Some(body))
            .await
            .with_context(|| format!("DevTools command {cmd}"))
    }
}

impl Drop for Browser {
    /// Ends the session unless [`Browser::close`] did (blocking: a few
    /// milliseconds when chromedriver is well, at most seconds when not),
    /// then kills whatever of Chromium still runs: chromedriver, killed
    /// next by its [`Process`], would leave Chromium running on its own.
    fn drop(&mut self) {
        if !self.closed {
            delete_session_blocking(self.driver.port, &self.session);
        }
        if let Some(root) = self.process.pid() {
            kill_descendants(root);
        }
    }
}

/// `DELETE <session>` over a plain socket, for Drop, which cannot await.
fn delete_session_blocking(port: u16, session: &str) {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, Duration::from_secs(2)) else {
        return;
    };
    let _ = stream.set_write_timeout(Some(Duration::from_secs(2)));
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    let req = format!(
        "DELETE {session} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\
         Content-Length: 0\r\nConnection: close\r\n\r\n"
    );
    if stream.write_all(req.as_bytes()).is_ok() {
        // The reply comes once Chromium quit, so its first bytes are all
        // there is to wait for (chromedriver keeps the connection open
        // despite `Connection: close`: reading to the end would wait out
        // the timeout).
        let _ = stream.read(&mut [0; 1024]);
    }
}

/// `<n>-<name>.png`, the name reduced to what any file system and shell
/// take as is.
fn shot_name(n: u32, name: &str) -> String {
    let slug: String = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .take(60)
        .collect();
    format!("{n:02}-{slug}.png")
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn locator(css: &str) -> Value {
    json!({ "using": "css selector", "value": css })
}

fn element(v: &Value) -> anyhow::Result<Element> {
    v.get(ELEMENT_KEY)
        .and_then(Value::as_str)
        .map(|id| Element(id.to_owned()))
        .with_context(|| format!("not an element reference: {v}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn screenshot_names_are_numbered_and_tame() {
        assert_eq!(shot_name(1, "timeout-a b/../c"), "01-timeout-a-b----c.png");
        assert_eq!(
            shot_name(2, &"x".repeat(100)).len(),
            "02-".len() + 60 + ".png".len()
        );
    }
}
