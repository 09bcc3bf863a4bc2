//! `kubectl batchlease dashboard` in a real headless Chromium, against the
//! real control plane with the operator and demo workers: the pages load,
//! a running task's timeline gains renewals while the page is open, a
//! SIGSTOPped worker's attempt is shown expired and the next token held,
//! cancel and redrive from the page (confirmed) take effect, the pages are
//! usable with the keyboard, and a watch error is shown and recovered
//! from. Screenshots go to the test's output directory
//! (`/tmp/batchlease-e2e-<namespace>/`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::time::Duration;

use batchlease_api::{BatchTask, TaskPhase};
use batchlease_e2e::browser::{self, Browser, keys};
use batchlease_e2e::dashboard::Dashboard;
use batchlease_e2e::operator::Operator;
use batchlease_e2e::process::Process;
use batchlease_e2e::proxy::{Proxy, apiserver_addr, proxied_kubeconfig};
use batchlease_e2e::secrets::PrivateDir;
use batchlease_e2e::tasks::{self, wait_holder, wait_phase, wait_task};
use batchlease_e2e::workers::{self, WorkerOpts};
use batchlease_e2e::{TestNamespace, wait_for};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(60);

fn out_dir(ns: &TestNamespace) -> std::path::PathBuf {
    batchlease_e2e::process::out_dir(&ns.name).unwrap()
}

/// An operator in a new namespace, worker `w1`, task `job` of `payload`
/// with lease TTL `ttl`, held by `w1`; the dashboard of the namespace and
/// a browser.
async fn running_job(
    prefix: &str,
    ttl: i32,
    payload: serde_json::Value,
) -> (TestNamespace, Operator, Process, Dashboard, Browser) {
    let (ns, op) = Operator::in_new_namespace(prefix, "op", WAIT)
        .await
        .unwrap();
    let w = workers::start(&ns.name, "w1", &WorkerOpts::default()).unwrap();
    tasks::create(
        &ns,
        "job",
        json!({"queue": "demo", "leaseDurationSeconds": ttl, "payload": payload}),
    )
    .await
    .unwrap();
    wait_holder(&ns, "job", "w1", WAIT, || op.logs_with(&[&w]))
        .await
        .unwrap();
    let dash = Dashboard::start(&ns.name, Some(&ns.name), None)
        .await
        .unwrap();
    let b = Browser::start(&out_dir(&ns)).await.unwrap();
    (ns, op, w, dash, b)
}

fn count(text: &str) -> usize {
    text.trim()
        .trim_end_matches('+')
        .parse()
        .unwrap_or_else(|_| panic!("not a count: {text:?}"))
}

/// WCAG contrast of every visible piece of text on the page against its
/// effective background (the first opaque one up the tree): the lowest
/// ratio and the elements below 4.5:1 (the AA level for normal text).
const CONTRAST_JS: &str = r#"
const rgb = (c) => (c.match(/[\d.]+/g) || []).map(Number);
const lum = ([r, g, b]) => {
  const f = (v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4); };
  return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b);
};
const bg = (el) => {
  for (let e = el; e; e = e.parentElement) {
    const c = rgb(getComputedStyle(e).backgroundColor);
    if (c.length >= 3 && (c.length < 4 || c[3] > 0.5)) return c;
  }
  return [255, 255, 255];
};
let min = 99; const bad = [];
for (const el of document.querySelectorAll("body *")) {
  const own = [...el.childNodes].some((n) => n.nodeType === 3 && n.textContent.trim());
  const r = el.getBoundingClientRect();
  if (!own || r.width === 0 || r.height === 0 || el.closest("[hidden], dialog:not([open]), .skip")) continue;
  const style = getComputedStyle(el);
  const fg = rgb(style.color);
  const l1 = lum(fg), l2 = lum(bg(el));
  const ratio = (Math.max(l1, l2) + 0.05) / (Math.min(l1, l2) + 0.05);
  min = Math.min(min, ratio);
  if (ratio < 4.5) bad.push(`${el.tagName}.${el.className}: ${ratio.toFixed(2)} "${el.textContent.trim().slice(0, 30)}"`);
}
return { min, bad };
"#;

async fn assert_readable(b: &Browser, page: &str) {
    let v = b.exec(CONTRAST_JS, &[]).await.unwrap();
    assert!(
        v["bad"].as_array().is_some_and(|a| a.is_empty()),
        "text below 4.5:1 contrast on {page}: {v}"
    );
}

/// The queues, tasks and task pages load; the running task's attempt row
/// counts more renewals while the page stays open (no reload), and its
/// timeline draws them; every text on the pages has a contrast of at
/// least 4.5:1 against its background.
#[tokio::test]
async fn pages_load_and_a_running_timeline_gains_renewals_live() {
    if browser::skip("pages_load_and_a_running_timeline_gains_renewals_live") {
        return;
    }
    // TTL 6 s: a renewal every 2 s; 20 s of work.
    let (ns, op, w, dash, b) =
        running_job("dash-live", 6, json!({"steps": 100, "stepMillis": 200})).await;
    let n = ns.name.clone();

    b.goto(&dash.page("#/queues")).await.unwrap();
    let row = format!("#queues tr[data-queue=\"{n}/demo\"]");
    b.wait_text(&row, "the demo queue's row", |t| t.contains("demo"), WAIT)
        .await
        .unwrap();
    b.wait_text(
        &format!("{row} td[data-phase=Running]"),
        "one Running task",
        |t| t.trim() == "1",
        WAIT,
    )
    .await
    .unwrap();
    assert!(b.text(&row).await.unwrap().contains("w1"), "holder shown");
    b.screenshot_named("queues").await.unwrap();
    assert_readable(&b, "the queues page").await;

    b.goto(&dash.page("#/tasks")).await.unwrap();
    b.wait_text(
        "#total",
        "the task count",
        |t| t.starts_with("1 task"),
        WAIT,
    )
    .await
    .unwrap();
    // Keyboard focus on the task's link survives the live re-renders (the
    // renewals change the row's data every 2 s).
    let link = format!("tr[data-task=\"{n}/job\"] a");
    let renders = b
        .exec(
            "document.querySelector(arguments[0]).focus(); return window.__renders",
            &[json!(link)],
        )
        .await
        .unwrap()
        .as_u64()
        .unwrap();
    wait_for(
        "the tasks table to re-render",
        WAIT,
        || dash.logs(),
        || async {
            let now = b.exec("return window.__renders", &[]).await?;
            Ok((now.as_u64().unwrap_or(0) > renders).then_some(()))
        },
    )
    .await
    .unwrap();
    assert!(
        b.active_element_matches(&link).await.unwrap(),
        "focus lost on re-render: {}",
        b.active_element().await.unwrap()
    );
    b.click(&link).await.unwrap();
    let renewals = "#attempts tr[data-token=\"1\"] td.renewals";
    let first = b
        .wait_text(renewals, "a renewal count", |t| !t.is_empty(), WAIT)
        .await
        .unwrap();
    assert_eq!(b.text("#holder").await.unwrap(), "w1");
    // Two more renewals arrive while we look: the page is live.
    let before = count(&first);
    b.wait_text(
        renewals,
        "two more renewals on the open page",
        |t| count(t) >= before + 2,
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    let ticks = b
        .exec(
            "return document.querySelectorAll('#timeline g.attempt[data-token=\"1\"] line.renewal').length",
            &[],
        )
        .await
        .unwrap();
    assert!(ticks.as_u64().unwrap_or(0) >= 3, "timeline ticks: {ticks}");
    b.screenshot_named("task-live").await.unwrap();
    assert_readable(&b, "the task page").await;
    wait_phase(&ns, "job", TaskPhase::Succeeded, WAIT, || {
        op.logs_with(&[&w])
    })
    .await
    .unwrap();
    b.wait_text("#task-phase", "Succeeded shown", |t| t == "Succeeded", WAIT)
        .await
        .unwrap();
    b.close().await.unwrap();
    drop((w, dash));
    ns.finish().await.unwrap();
}

/// The zombie story, drawn: worker w1 is SIGSTOPped while it holds token
/// 1; the page shows token 1 Expired and token 2 held by w2.
#[tokio::test]
async fn a_stopped_workers_attempt_shows_expired_and_the_next_token_held() {
    if browser::skip("a_stopped_workers_attempt_shows_expired_and_the_next_token_held") {
        return;
    }
    let (ns, op, w1, dash, b) =
        running_job("dash-zombie", 5, json!({"steps": 100, "stepMillis": 100})).await;
    let n = ns.name.clone();
    b.goto(&dash.page(&format!("#/task/{n}/job")))
        .await
        .unwrap();
    b.wait_text(
        "#attempts tr[data-token=\"1\"] td.holder",
        "token 1 held by w1",
        |t| t == "w1",
        WAIT,
    )
    .await
    .unwrap();
    w1.signal("STOP").unwrap();
    let w2 = workers::start(&n, "w2", &WorkerOpts::default()).unwrap();
    b.wait_text(
        "#attempts tr[data-token=\"1\"] td.outcome",
        "token 1 shown expired",
        |t| t.contains("Expired"),
        WAIT,
    )
    .await
    .unwrap();
    b.wait_text(
        "#attempts tr[data-token=\"2\"] td.holder",
        "token 2 held by w2",
        |t| t == "w2",
        WAIT,
    )
    .await
    .unwrap();
    b.wait_text("#fencing-token", "the task's token 2", |t| t == "2", WAIT)
        .await
        .unwrap();
    let expired_bar = b
        .exec(
            "return document.querySelectorAll('#timeline g.attempt[data-token=\"1\"] rect.bar.Expired').length",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(expired_bar, json!(1), "token 1's bar drawn as expired");
    b.screenshot_named("zombie").await.unwrap();
    w1.signal("CONT").unwrap();
    wait_phase(&ns, "job", TaskPhase::Succeeded, WAIT, || {
        op.logs_with(&[&w1, &w2])
    })
    .await
    .unwrap();
    b.wait_text(
        "#attempts tr[data-token=\"2\"] td:last-child",
        "token 2 committed",
        |t| t.contains("committed under token 2"),
        WAIT,
    )
    .await
    .unwrap();
    b.close().await.unwrap();
    drop((w1, w2, dash));
    ns.finish().await.unwrap();
}

/// Cancel from the task page, confirmed in the dialog (and first declined:
/// nothing written), ends the task Cancelled; a failed task is redriven
/// from the dead letters page. Keyboard only for the navigation.
#[tokio::test]
async fn cancel_and_redrive_from_the_page_with_confirmation() {
    if browser::skip("cancel_and_redrive_from_the_page_with_confirmation") {
        return;
    }
    let (ns, op) = Operator::in_new_namespace("dash-act", "op", WAIT)
        .await
        .unwrap();
    let n = ns.name.clone();
    let w = workers::start(&n, "w1", &WorkerOpts::default()).unwrap();
    tasks::create(
        &ns,
        "long",
        json!({"queue": "demo", "payload": {"steps": 600, "stepMillis": 100}}),
    )
    .await
    .unwrap();
    tasks::create(
        &ns,
        "bad",
        json!({"queue": "demo", "maxRetries": 0,
               "payload": {"steps": 1, "stepMillis": 10, "failureRate": 1.0}}),
    )
    .await
    .unwrap();
    wait_holder(&ns, "long", "w1", WAIT, || op.logs_with(&[&w]))
        .await
        .unwrap();
    wait_phase(&ns, "bad", TaskPhase::DeadLettered, WAIT, || {
        op.logs_with(&[&w])
    })
    .await
    .unwrap();
    let dash = Dashboard::start(&n, Some(&n), None).await.unwrap();
    let b = Browser::start(&out_dir(&ns)).await.unwrap();

    // Keyboard: from the top of the page, Tab reaches the "Tasks" link,
    // Enter follows it.
    b.goto(&dash.page("#/queues")).await.unwrap();
    b.wait_text("#queues", "the queues table", |t| t.contains("demo"), WAIT)
        .await
        .unwrap();
    // The first stop is "Skip to content": it moves the focus to the
    // content and leaves the page as it is.
    b.press_key(keys::TAB).await.unwrap();
    assert!(b.active_element_matches(".skip").await.unwrap());
    b.press_key(keys::ENTER).await.unwrap();
    assert!(b.active_element_matches("#main").await.unwrap());
    assert!(b.text("#queues").await.unwrap().contains("demo"));
    // Back to the top: Tab walks the header's links in order.
    b.goto(&dash.page("#/queues")).await.unwrap();
    b.wait_text("#queues", "the queues table", |t| t.contains("demo"), WAIT)
        .await
        .unwrap();
    let mut reached = false;
    for _ in 0..10 {
        b.press_key(keys::TAB).await.unwrap();
        if b.active_element_matches("#nav-tasks").await.unwrap() {
            reached = true;
            break;
        }
    }
    assert!(reached, "Tab never reached the Tasks link");
    b.press_key(keys::ENTER).await.unwrap();
    b.wait_text(
        "#total",
        "the tasks page by keyboard",
        |t| t.starts_with("2 tasks"),
        WAIT,
    )
    .await
    .unwrap();

    // Cancel, declined first: nothing is written.
    b.goto(&dash.page(&format!("#/task/{n}/long")))
        .await
        .unwrap();
    b.wait_text("#task-phase", "long Running", |t| t == "Running", WAIT)
        .await
        .unwrap();
    b.click("#cancel").await.unwrap();
    b.wait_text(
        "#confirm-text",
        "the confirmation",
        |t| t.contains("Cancel long?"),
        WAIT,
    )
    .await
    .unwrap();
    // The safe choice has the focus; Escape closes the dialog too.
    assert!(b.active_element_matches("#confirm-no").await.unwrap());
    b.press_key(keys::ESCAPE).await.unwrap();
    let open = b
        .exec("return document.getElementById('confirm').open", &[])
        .await
        .unwrap();
    assert_eq!(open, json!(false), "Escape closes the dialog");
    let t: BatchTask = ns.api::<BatchTask>().get("long").await.unwrap();
    assert!(!t.spec.cancel, "declined: spec.cancel not written");
    assert_eq!(
        b.text("#action-result").await.unwrap(),
        "",
        "no write answered"
    );
    b.click("#cancel").await.unwrap();
    b.click("#confirm-yes").await.unwrap();
    b.wait_text(
        "#action-result",
        "the cancel's answer",
        |t| t.contains("cancel requested"),
        WAIT,
    )
    .await
    .unwrap();
    wait_phase(&ns, "long", TaskPhase::Cancelled, WAIT, || {
        format!("{}\n{}", op.logs_with(&[&w]), dash.logs())
    })
    .await
    .unwrap();
    b.wait_text("#task-phase", "Cancelled shown", |t| t == "Cancelled", WAIT)
        .await
        .unwrap();
    // Written as the user, by the plugin's field manager.
    let t: BatchTask = ns.api::<BatchTask>().get("long").await.unwrap();
    let managers: Vec<String> = t
        .metadata
        .managed_fields
        .unwrap_or_default()
        .into_iter()
        .filter_map(|m| m.manager)
        .collect();
    assert!(
        managers.iter().any(|m| m == "kubectl-batchlease"),
        "{managers:?}"
    );
    b.screenshot_named("cancelled").await.unwrap();

    // Redrive from the dead letters page.
    b.goto(&dash.page("#/dead")).await.unwrap();
    let button = format!("button.redrive[data-task=\"{n}/bad\"]");
    b.wait_text(
        &format!("#dead tr[data-task=\"{n}/bad\"]"),
        "the dead letter with its reason",
        |t| t.contains("DeadLettered"),
        WAIT,
    )
    .await
    .unwrap();
    b.click(&button).await.unwrap();
    b.click("#confirm-yes").await.unwrap();
    wait_task(
        &ns,
        "bad",
        "spec.redrive raised",
        WAIT,
        || dash.logs(),
        |t| t.spec.redrive == 1,
    )
    .await
    .unwrap();
    b.close().await.unwrap();
    drop((w, dash));
    ns.finish().await.unwrap();
}

/// The dashboard's watches go through a proxy that is made to refuse
/// connections: the page shows the watch error in a banner; once the
/// proxy passes again the banner goes and a task created meanwhile is
/// listed.
#[tokio::test]
async fn a_watch_error_is_shown_and_the_page_recovers() {
    if browser::skip("a_watch_error_is_shown_and_the_page_recovers") {
        return;
    }
    let cluster = batchlease_e2e::Cluster::with_crds().await.unwrap();
    let ns = cluster.namespace("dash-watch").await.unwrap();
    let n = ns.name.clone();
    tasks::create(&ns, "before", json!({"queue": "demo"}))
        .await
        .unwrap();
    let proxy = Proxy::start(apiserver_addr().unwrap()).await.unwrap();
    let dir = PrivateDir::new(&n).unwrap();
    let kc = proxied_kubeconfig(&proxy, &dir).unwrap();
    let dash = Dashboard::start(&n, Some(&n), Some(&kc)).await.unwrap();
    let b = Browser::start(&out_dir(&ns)).await.unwrap();
    b.goto(&dash.page("#/tasks")).await.unwrap();
    b.wait_text("#total", "one task", |t| t.starts_with("1 task"), WAIT)
        .await
        .unwrap();
    proxy.refuse();
    tasks::create(&ns, "during", json!({"queue": "demo"}))
        .await
        .unwrap();
    b.wait_text(
        "#banner",
        "the watch error banner",
        |t| t.contains("Watch failing"),
        WAIT,
    )
    .await
    .unwrap();
    b.screenshot_named("watch-error").await.unwrap();
    // The last known rows stay, and the task created behind the failing
    // watch is not (yet) among them.
    assert!(b.text("#total").await.unwrap().starts_with("1 task"));
    proxy.restore();
    b.wait_text(
        "#total",
        "the task created meanwhile",
        |t| t.starts_with("2 tasks"),
        WAIT,
    )
    .await
    .unwrap();
    wait_for(
        "the banner to go",
        WAIT,
        || dash.logs(),
        || async {
            let hidden = b
                .exec("return document.getElementById('banner').hidden", &[])
                .await?;
            Ok((hidden == json!(true)).then_some(()))
        },
    )
    .await
    .unwrap();
    b.close().await.unwrap();
    drop(dash);
    // No operator ran: the tasks stay Pending by design.
    ns.cleanup().await.unwrap();
}

/// What another user of the machine or another web page could try with
/// the user's credentials: a request without the session's cookie, a
/// wrong token in the URL, a write without the page's token, a `Host`
/// that is not the dashboard's (DNS rebinding) — each refused, nothing
/// written; the printed URL's token is traded for an HttpOnly, SameSite
/// cookie; bad filters get a clear error.
#[tokio::test]
async fn foreign_requests_are_refused_and_bad_filters_explained() {
    let cluster = batchlease_e2e::Cluster::with_crds().await.unwrap();
    let ns = cluster.namespace("dash-guard").await.unwrap();
    let n = ns.name.clone();
    tasks::create(&ns, "t", json!({"queue": "demo"}))
        .await
        .unwrap();
    let dash = Dashboard::start(&n, Some(&n), None).await.unwrap();
    // (status code, response headers in lower case, body)
    let curl = |args: &[&str]| {
        let out = Command::new("curl")
            .args(["-s", "-D", "/dev/stderr", "-o", "-", "-w", "\n%{http_code}"])
            .args(args)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n').unwrap_or((&text, ""));
        (
            code.to_owned(),
            String::from_utf8_lossy(&out.stderr).to_lowercase(),
            body.to_owned(),
        )
    };
    let cookie = format!("Cookie: batchlease_dashboard={}", dash.token);
    let tasks_url = format!("{}/api/tasks", dash.url);
    let cancel = format!("{}/api/task/{n}/t/cancel", dash.url);

    // Another user of the machine, without the printed URL.
    let (code, _, body) = curl(&[&tasks_url]);
    assert_eq!(code, "401", "{body}");
    assert!(body.contains("open the URL"), "{body}");
    let (code, _, _) = curl(&[&format!("{}/?token=guessed", dash.url)]);
    assert_eq!(code, "401");
    let (code, _, _) = curl(&["-X", "POST", &cancel]);
    assert_eq!(code, "401");
    // The printed URL: its token becomes an HttpOnly, SameSite cookie.
    let (code, headers, _) = curl(&[&format!("{}/?token={}", dash.url, dash.token)]);
    assert_eq!(code, "303", "{headers}");
    assert!(headers.contains("location: /"), "{headers}");
    assert!(
        headers.contains("set-cookie: batchlease_dashboard=")
            && headers.contains("httponly")
            && headers.contains("samesite=strict"),
        "{headers}"
    );
    // With the cookie: reads work, with the protective headers.
    let (code, headers, body) = curl(&["-H", &cookie, &tasks_url]);
    assert_eq!(code, "200", "{body}");
    for h in [
        "x-frame-options: deny",
        "x-content-type-options: nosniff",
        "cache-control: no-store",
        "content-security-policy: default-src 'self'",
    ] {
        assert!(headers.contains(h), "{h} missing: {headers}");
    }
    // A write without the page's token, even with the cookie.
    let (code, _, body) = curl(&["-X", "POST", "-H", &cookie, &cancel]);
    assert_eq!(code, "403", "{body}");
    assert!(body.contains("token"), "{body}");
    let (code, _, _) = curl(&[
        "-X",
        "POST",
        "-H",
        &cookie,
        "-H",
        "X-Batchlease-Token: guessed",
        &cancel,
    ]);
    assert_eq!(code, "403");
    // DNS rebinding: a foreign Host is refused whatever it carries.
    let (code, _, body) = curl(&["-H", &cookie, "-H", "Host: evil.example", &tasks_url]);
    assert_eq!(code, "421", "{body}");
    let (code, _, body) = curl(&["-H", &cookie, &format!("{tasks_url}?phase=Done")]);
    assert_eq!(code, "400");
    assert!(body.contains("unknown phase"), "{body}");
    let t: BatchTask = ns.api::<BatchTask>().get("t").await.unwrap();
    assert!(!t.spec.cancel, "nothing was written");
    // The page carries the token for its own writes: they go through.
    let (_, _, page) = curl(&["-H", &cookie, &format!("{}/", dash.url)]);
    let token = page
        .split("name=\"batchlease-token\" content=\"")
        .nth(1)
        .and_then(|r| r.split('"').next())
        .unwrap()
        .to_owned();
    let (code, _, body) = curl(&[
        "-X",
        "POST",
        "-H",
        &cookie,
        "-H",
        &format!("X-Batchlease-Token: {token}"),
        &cancel,
    ]);
    assert_eq!(code, "200", "{body}");
    wait_task(
        &ns,
        "t",
        "spec.cancel set",
        WAIT,
        || dash.logs(),
        |t| t.spec.cancel,
    )
    .await
    .unwrap();
    drop(dash);
    // No operator ran: the task stays Pending by design.
    ns.cleanup().await.unwrap();
}
