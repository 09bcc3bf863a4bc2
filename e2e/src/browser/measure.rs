//! What the benchmark measures in the browser: time to a text by the
//! page's own clock, the page's JavaScript heap, the renderers' memory.

use std::cell::RefCell;
use std::time::Duration;

use anyhow::Context;
use serde_json::json;

use super::Browser;
use super::procs::{RendererMemory, descendants, kb_field};
use crate::wait::wait_for;

impl Browser {
    /// Loads `url` and returns how long after navigation started the
    /// `innerText` of `css` first satisfied `predicate`, by the page's own
    /// clock (`performance.now()`, whose origin is the navigation start).
    ///
    /// A script registered before the page's own (DevTools'
    /// `Page.addScriptToEvaluateOnNewDocument`) records the text with a
    /// MutationObserver on every change from the first byte on, so the time
    /// is the change's, not when a poll from here happened to see it. The
    /// price: the page reads `innerText` (a layout) after each batch of DOM
    /// changes while this runs.
    pub async fn time_to_text(
        &self,
        url: &str,
        css: &str,
        predicate: impl FnMut(&str) -> bool,
        timeout: Duration,
    ) -> anyhow::Result<Duration> {
        let predicate = RefCell::new(predicate);
        let source = format!(
            "(() => {{
               const sel = {sel};
               const log = window.__batchleaseTexts = [];
               const record = () => {{
                 const e = document.querySelector(sel);
                 log.push([performance.now(), e === null ? null : e.innerText]);
               }};
               new MutationObserver(record).observe(document,
                 {{ subtree: true, childList: true, characterData: true }});
             }})();",
            sel = json!(css)
        );
        let added = self
            .cdp(
                "Page.addScriptToEvaluateOnNewDocument",
                json!({ "source": source }),
            )
            .await?;
        let id = added
            .get("identifier")
            .cloned()
            .context("addScriptToEvaluateOnNewDocument: no identifier")?;
        let timed = async {
            self.goto(url).await?;
            // The recorded changes so far, taken out of the page.
            const DRAIN: &str = "const l = window.__batchleaseTexts;\
                                 return l === undefined ? null : l.splice(0);";
            wait_for(
                &format!("the text of `{css}` on {url}"),
                timeout,
                String::new,
                || {
                    let drained = self.exec(DRAIN, &[]);
                    let predicate = &predicate;
                    async move {
                        let v = drained.await?;
                        anyhow::ensure!(!v.is_null(), "the observer is not in the page");
                        let log: Vec<(f64, Option<String>)> = serde_json::from_value(v)?;
                        Ok(log.into_iter().find_map(|(at, text)| {
                            text.filter(|t| (predicate.borrow_mut())(t))
                                .map(|_| Duration::from_secs_f64(at / 1000.0))
                        }))
                    }
                },
            )
            .await
        };
        let result = timed.await;
        // The script would otherwise run on every page loaded after this.
        let removed = self
            .cdp(
                "Page.removeScriptToEvaluateOnNewDocument",
                json!({ "identifier": id }),
            )
            .await;
        match result {
            Ok(d) => removed.map(|_| d),
            Err(e) => {
                let diag = self.diagnostics(css, "time-to-text").await;
                Err(anyhow::anyhow!("{e:#}\n{diag}"))
            }
        }
    }

    /// The page's JavaScript heap in use (`performance.memory.usedJSHeapSize`,
    /// exact thanks to `--enable-precise-memory-info`). Garbage not yet
    /// collected counts: [`Browser::collect_garbage`] first for a steadier
    /// number.
    pub async fn js_heap_bytes(&self) -> anyhow::Result<u64> {
        let v = self
            .exec("return performance.memory.usedJSHeapSize;", &[])
            .await?;
        v.as_u64()
            .with_context(|| format!("usedJSHeapSize is not a number: {v}"))
    }

    /// A full garbage collection in the page (DevTools'
    /// `HeapProfiler.collectGarbage`).
    pub async fn collect_garbage(&self) -> anyhow::Result<()> {
        self.cdp("HeapProfiler.collectGarbage", json!({}))
            .await
            .map(drop)
    }

    /// The memory of the Chromium renderer processes under our
    /// chromedriver, read from `/proc` (Linux only, best effort: a process
    /// that ends while being read is left out). Which renderer shows which
    /// page is not known from there: with one page open, the largest
    /// non-WebUI renderer is normally it, the others being spare ones
    /// Chromium starts ahead of need.
    pub fn renderer_memory(&self) -> Vec<RendererMemory> {
        let Some(root) = self.process.pid() else {
            return Vec::new();
        };
        descendants(root)
            .into_iter()
            .filter_map(|pid| {
                let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
                // Chromium rewrites its title: the arguments end up one
                // string, separated by spaces rather than NULs.
                let args: Vec<&[u8]> = cmdline.split(|b| *b == 0 || *b == b' ').collect();
                if !args.contains(&&b"--type=renderer"[..]) {
                    return None;
                }
                let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
                let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok();
                Some(RendererMemory {
                    pid,
                    rss_bytes: kb_field(&status, "VmRSS:")?,
                    pss_bytes: rollup.as_deref().and_then(|r| kb_field(r, "Pss:")),
                    webui: args.contains(&&b"--top-chrome-webui"[..]),
                })
            })
            .collect()
    }
}
