//! The browser harness (e2e/src/browser.rs) against a small page served
//! here: no cluster needed, only Chromium and chromedriver (hack/deps.sh).
//! Each test skips when they are missing, unless BATCHLEASE_REQUIRE_BROWSER
//! is set (as hack/test.sh does).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use axum::Router;
use axum::response::Html;
use axum::routing::get;
use batchlease_e2e::browser::{self, Browser, keys};
use serde_json::json;

/// Far longer than anything here takes when it works.
const TIMEOUT: Duration = Duration::from_secs(20);

/// How long after loading the page's timer changes `#ticker`, and after
/// `#start` is clicked its timer changes `#delayed`.
const TICK_MS: u64 = 400;

/// A button that counts clicks, an input echoed below it, a button that
/// starts a timer, a timer started at load, and a list.
fn page() -> String {
    format!(
        r#"<!doctype html>
<html><head><meta charset="utf-8"><title>browser harness</title>
<link rel="icon" href="data:,"></head>
<body>
<h1 id="title">Harness page</h1>
<button id="go">Go</button>
<p id="clicked">not clicked</p>
<input id="name" aria-label="name">
<p id="echo"></p>
<button id="start">Start</button>
<p id="delayed">idle</p>
<p id="ticker">waiting</p>
<ul><li class="item">one</li><li class="item">two</li><li class="item">three</li></ul>
<script>
let clicks = 0;
document.getElementById('go').addEventListener('click', () => {{
  clicks += 1;
  document.getElementById('clicked').textContent = 'clicked ' + clicks;
}});
document.getElementById('name').addEventListener('input', e => {{
  document.getElementById('echo').textContent = 'hello ' + e.target.value;
}});
document.getElementById('start').addEventListener('click', () => {{
  setTimeout(() => {{ document.getElementById('delayed').textContent = 'done'; }}, {TICK_MS});
}});
setTimeout(() => {{ document.getElementById('ticker').textContent = 'ticked'; }}, {TICK_MS});
console.log('harness page loaded');
</script>
</body></html>"#
    )
}

/// Serves [`page`] on a loopback port for the rest of the test; returns its URL.
async fn serve() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = Router::new().route("/", get(|| async { Html(page()) }));
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}/")
}

/// A fresh `<tmp>/batchlease-e2e-browser-<test>` for the test's screenshots
/// (emptied first, so what a test finds there is its own).
fn out_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("batchlease-e2e-browser-{test}"));
    let _ = std::fs::remove_dir_all(&dir);
    println!("{test}: screenshots in {}", dir.display());
    dir
}

async fn start(test: &str) -> Browser {
    let b = Browser::start(&out_dir(test)).await.unwrap();
    println!("{test}: chromium started in {:?}", b.startup_time());
    b
}

#[tokio::test]
async fn reads_clicks_types_and_waits() {
    if browser::skip("reads_clicks_types_and_waits") {
        return;
    }
    let url = serve().await;
    let b = start("reads_clicks_types_and_waits").await;
    b.goto(&url).await.unwrap();
    assert_eq!(b.url().await.unwrap(), url);
    assert_eq!(b.text("#title").await.unwrap(), "Harness page");
    assert_eq!(b.texts(".item").await.unwrap(), ["one", "two", "three"]);
    assert_eq!(b.text_opt("#missing").await.unwrap(), None);
    let err = b.text("#missing").await.unwrap_err();
    assert!(format!("{err:#}").contains("#missing"), "{err:#}");

    // The timer starts with the click, so the wait sees the text change
    // however slowly this runs.
    assert_eq!(b.text("#delayed").await.unwrap(), "idle");
    b.click("#start").await.unwrap();
    let done = b
        .wait_text("#delayed", "the timer", |t| t == "done", TIMEOUT)
        .await
        .unwrap();
    assert_eq!(done, "done");
    b.wait_text(
        "#ticker",
        "the timer started at load",
        |t| t == "ticked",
        TIMEOUT,
    )
    .await
    .unwrap();

    b.click("#go").await.unwrap();
    assert_eq!(b.text("#clicked").await.unwrap(), "clicked 1");
    let go = b.find("#go").await.unwrap();
    b.click_element(&go).await.unwrap();
    assert_eq!(b.text("#clicked").await.unwrap(), "clicked 2");
    assert_eq!(b.find_all("li").await.unwrap().len(), 3);

    b.type_into("#name", "batchlease").await.unwrap();
    assert_eq!(b.text("#echo").await.unwrap(), "hello batchlease");

    let v = b
        .exec(
            "return arguments[0] + arguments[1];",
            &[json!(40), json!(2)],
        )
        .await
        .unwrap();
    assert_eq!(v, json!(42));
    let title = b.exec("return document.title;", &[]).await.unwrap();
    assert_eq!(title, json!("browser harness"));

    let shot = b.screenshot_named("page").await.unwrap();
    let png = std::fs::read(&shot).unwrap();
    assert!(
        png.starts_with(b"\x89PNG\r\n\x1a\n"),
        "{} is not a PNG",
        shot.display()
    );
    println!("screenshot: {} ({} bytes)", shot.display(), png.len());

    let console = b.console_log().await.unwrap();
    assert!(
        console.iter().any(|l| l.contains("harness page loaded")),
        "{console:?}"
    );
    b.close().await.unwrap();
}

#[tokio::test]
async fn the_keyboard_reaches_and_activates_the_button() {
    if browser::skip("the_keyboard_reaches_and_activates_the_button") {
        return;
    }
    let url = serve().await;
    let b = start("the_keyboard_reaches_and_activates_the_button").await;
    b.goto(&url).await.unwrap();
    // Nothing has focus on a fresh page; the button is the first stop.
    assert_eq!(b.active_element().await.unwrap().tag, "body");
    b.press_key(keys::TAB).await.unwrap();
    let focused = b.active_element().await.unwrap();
    assert!(
        b.active_element_matches("#go").await.unwrap(),
        "focus on {focused}"
    );
    assert_eq!(b.active_element_text().await.unwrap(), "Go");
    b.press_key(keys::ENTER).await.unwrap();
    assert_eq!(b.text("#clicked").await.unwrap(), "clicked 1");
    // On to the input, and back with Shift+Tab.
    b.press_key(keys::TAB).await.unwrap();
    assert!(b.active_element_matches("#name").await.unwrap());
    b.press_chord(&[keys::SHIFT, keys::TAB]).await.unwrap();
    assert!(b.active_element_matches("#go").await.unwrap());
    b.press_key(keys::SPACE).await.unwrap();
    assert_eq!(b.text("#clicked").await.unwrap(), "clicked 2");
    b.close().await.unwrap();
}

#[tokio::test]
async fn a_wait_that_times_out_says_what_the_page_showed() {
    if browser::skip("a_wait_that_times_out_says_what_the_page_showed") {
        return;
    }
    let url = serve().await;
    let b = start("a_wait_that_times_out_says_what_the_page_showed").await;
    b.goto(&url).await.unwrap();
    b.exec("console.error('something broke');", &[])
        .await
        .unwrap();

    let started = Instant::now();
    let timeout = Duration::from_millis(800);
    let err = b
        .wait_text("#title", "a title never shown", |t| t == "never", timeout)
        .await
        .unwrap_err();
    let msg = format!("{err:#}");
    println!("{msg}");
    assert!(started.elapsed() >= timeout, "gave up early: {msg}");
    assert!(msg.contains("a title never shown"), "{msg}");
    assert!(msg.contains("`#title`"), "{msg}");
    assert!(msg.contains("\"Harness page\""), "the last text: {msg}");
    assert!(msg.contains(&format!("url: {url}")), "{msg}");
    assert!(msg.contains("something broke"), "the console: {msg}");
    let shot = msg
        .lines()
        .find_map(|l| l.strip_prefix("screenshot: "))
        .unwrap_or_else(|| panic!("no screenshot in: {msg}"));
    let png = std::fs::read(shot).unwrap();
    assert!(png.starts_with(b"\x89PNG"), "{shot} is not a PNG");
    assert!(shot.starts_with(b.out_dir().to_str().unwrap()), "{shot}");

    // An element that is not there at all is reported as such.
    let err = b
        .wait_text("#nowhere", "a missing element", |_| true, timeout)
        .await
        .unwrap_err();
    let msg = format!("{err:#}");
    assert!(msg.contains("no element matched `#nowhere`"), "{msg}");
    b.close().await.unwrap();
}

#[tokio::test]
async fn measures_time_to_text_and_memory() {
    if browser::skip("measures_time_to_text_and_memory") {
        return;
    }
    let url = serve().await;
    let b = start("measures_time_to_text_and_memory").await;
    let took = b
        .time_to_text(&url, "#ticker", |t| t == "ticked", TIMEOUT)
        .await
        .unwrap();
    println!("time to \"ticked\": {took:?}");
    // The timer starts after navigation did, so it cannot be earlier.
    assert!(took >= Duration::from_millis(TICK_MS), "{took:?}");
    assert!(took < TIMEOUT, "{took:?}");
    // Already there at load: the time is the parser's insertion, before
    // the load event.
    let title = b
        .time_to_text(&url, "#title", |t| t == "Harness page", TIMEOUT)
        .await
        .unwrap();
    println!("time to the title: {title:?}");
    assert!(title < took, "{title:?} vs {took:?}");
    // The observer is gone once the measurement is over.
    b.goto(&url).await.unwrap();
    let observer = b
        .exec("return window.__batchleaseTexts === undefined;", &[])
        .await
        .unwrap();
    assert_eq!(observer, json!(true));

    b.collect_garbage().await.unwrap();
    let heap = b.js_heap_bytes().await.unwrap();
    println!("JS heap: {heap} bytes");
    assert!(heap > 0);
    let renderers = b.renderer_memory();
    println!("renderers: {renderers:?}");
    assert!(
        renderers.iter().any(|r| !r.webui && r.rss_bytes > 0),
        "{renderers:?}"
    );
    b.close().await.unwrap();
}

/// A browser dropped without `close` still takes Chromium down with it.
#[tokio::test]
async fn dropping_the_browser_ends_chromium() {
    if browser::skip("dropping_the_browser_ends_chromium") {
        return;
    }
    let b = start("dropping_the_browser_ends_chromium").await;
    let pids: Vec<u32> = b.renderer_memory().iter().map(|r| r.pid).collect();
    assert!(!pids.is_empty());
    drop(b);
    batchlease_e2e::wait_for(
        "chromium's renderers to exit",
        TIMEOUT,
        || format!("renderers were {pids:?}"),
        || {
            let alive: Vec<u32> = pids
                .iter()
                .copied()
                .filter(|p| {
                    // A zombie (state Z) has exited; only its parent (or
                    // init) has yet to reap it.
                    std::fs::read_to_string(format!("/proc/{p}/stat"))
                        .ok()
                        .and_then(|s| {
                            let state = s.rsplit_once(')')?.1.split_whitespace().next()?;
                            Some(state != "Z")
                        })
                        .unwrap_or(false)
                })
                .collect();
            async move { Ok(alive.is_empty().then_some(())) }
        },
    )
    .await
    .unwrap();
}
