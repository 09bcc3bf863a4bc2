//! The dashboard with many tasks: time to first render of the tasks and
//! queues pages, time to the next page, the page's JavaScript heap, the
//! renderer's and the dashboard process's memory — at a small size and at
//! N, side by side in one run, so the ratio shows what N costs (paging on
//! the server is meant to keep the page flat).

use std::time::Duration;

use batchlease_e2e::Cluster;
use batchlease_e2e::browser::{self, Browser};
use batchlease_e2e::dashboard::Dashboard;
use tokio::time::Instant;

use super::common::{create_tasks, emit, rss_mib};

/// What one size measured.
#[derive(Debug)]
struct Size {
    tasks: usize,
    tasks_page: Duration,
    queues_page: Duration,
    next_page: Duration,
    heap_mib: f64,
    renderer_mib: Option<f64>,
    dashboard_mib: Option<f64>,
}

const T: Duration = Duration::from_secs(300);

async fn measure(cluster: &Cluster, n: usize, conc: usize) -> anyhow::Result<Size> {
    let ns = cluster.namespace("bench-dash").await?;
    create_tasks(&ns, "t", n, "demo", conc).await?;
    let dash = Dashboard::start(&ns.name, Some(&ns.name), None).await?;
    let b = Browser::start(&batchlease_e2e::process::out_dir(&ns.name)?).await?;
    let total = format!("{n} task");
    // Warm: the dashboard's first list of n tasks is not the page's cost.
    b.goto(&dash.page("#/tasks")).await?;
    b.wait_text("#total", "all tasks listed", |t| t.starts_with(&total), T)
        .await?;
    let tasks_page = b
        .time_to_text(
            &format!("{}/?fresh=1#/tasks", dash.url),
            "#total",
            |t| t.starts_with(&total),
            T,
        )
        .await?;
    let pending = n.to_string();
    let queues_page = b
        .time_to_text(
            &format!("{}/?fresh=2#/queues", dash.url),
            "#queues td[data-phase=Pending]",
            |t| t.trim() == pending,
            T,
        )
        .await?;
    b.goto(&dash.page("#/tasks")).await?;
    b.wait_text("#total", "all tasks listed", |t| t.starts_with(&total), T)
        .await?;
    let next_page = if n > 100 {
        let started = Instant::now();
        b.click("#next").await?;
        b.wait_text(
            "#tasks-data .pager",
            "the second page",
            |t| t.contains("101–"),
            T,
        )
        .await?;
        started.elapsed()
    } else {
        Duration::ZERO
    };
    b.collect_garbage().await?;
    let heap = b.js_heap_bytes().await?;
    let renderer = b
        .renderer_memory()
        .into_iter()
        .filter(|r| !r.webui)
        .map(|r| r.rss_bytes)
        .max();
    let dashboard_mib = rss_mib(dash.process.pid());
    b.close().await?;
    drop(dash);
    ns.cleanup().await?;
    Ok(Size {
        tasks: n,
        tasks_page,
        queues_page,
        next_page,
        heap_mib: heap as f64 / 1_048_576.0,
        renderer_mib: renderer.map(|r| r as f64 / 1_048_576.0),
        dashboard_mib,
    })
}

/// Measures at 100 tasks and at `n`, and reports both with their ratio.
pub async fn run(
    cluster: &Cluster,
    n: usize,
    conc: usize,
    report: &mut String,
) -> anyhow::Result<()> {
    if browser::skip("bench dashboard") {
        emit(report, "dashboard: skipped (no browser)\n");
        return Ok(());
    }
    let small = measure(cluster, 100.min(n), conc).await?;
    let big = if n > 100 {
        Some(measure(cluster, n, conc).await?)
    } else {
        None
    };
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let mib = |m: Option<f64>| m.map_or("?".into(), |m| format!("{m:.0} MiB"));
    let line = |s: &Size| {
        format!(
            "{} tasks: tasks page {:.0} ms, queues page {:.0} ms, next page {:.0} ms; JS heap {:.1} MiB, renderer RSS {}, dashboard RSS {}",
            s.tasks,
            ms(s.tasks_page),
            ms(s.queues_page),
            ms(s.next_page),
            s.heap_mib,
            mib(s.renderer_mib),
            mib(s.dashboard_mib),
        )
    };
    let mut text = format!(
        "dashboard (headless Chromium; time from navigation start to the page showing every task counted, by the page's clock): {}",
        line(&small)
    );
    if let Some(b) = &big {
        text.push_str(&format!(
            "; {}; ×{:.2} the tasks page's time and ×{:.2} the JS heap for ×{} the tasks",
            line(b),
            ms(b.tasks_page) / ms(small.tasks_page).max(1.0),
            b.heap_mib / small.heap_mib.max(0.01),
            b.tasks / small.tasks.max(1),
        ));
    }
    text.push('\n');
    emit(report, &text);
    Ok(())
}
