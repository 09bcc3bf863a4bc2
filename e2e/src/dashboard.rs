//! `kubectl batchlease dashboard` as a user starts it: the plugin binary
//! on a free loopback port, with the test's kubeconfig (or another, e.g.
//! one that goes through a [`crate::proxy::Proxy`]), its URL (with the
//! session's token) read from the first line it prints.

use std::path::Path;
use std::time::Duration;

use anyhow::Context;

use crate::process::Process;
use crate::wait_for;

/// A running dashboard.
#[derive(Debug)]
pub struct Dashboard {
    pub process: Process,
    /// `http://127.0.0.1:<port>` (no trailing slash).
    pub url: String,
    /// The session's secret from the printed URL.
    pub token: String,
}

impl Dashboard {
    /// Starts it for `namespace` (`None`: `-A`), with `kubeconfig` instead
    /// of the test's when given.
    pub async fn start(
        group: &str,
        namespace: Option<&str>,
        kubeconfig: Option<&Path>,
    ) -> anyhow::Result<Self> {
        let bin = std::env::var("BATCHLEASE_PLUGIN_BIN")
            .context("BATCHLEASE_PLUGIN_BIN unset: run hack/test.sh (it builds the plugin)")?;
        let mut args: Vec<String> = match namespace {
            Some(ns) => vec!["-n".into(), ns.into()],
            None => vec!["-A".into()],
        };
        if let Some(k) = kubeconfig {
            args.extend(["--kubeconfig".into(), k.display().to_string()]);
        }
        args.extend(["dashboard".into(), "--address".into(), "127.0.0.1:0".into()]);
        let process = Process::start(bin, group, "dashboard", args, vec![])?;
        let log = process.log.clone();
        let (url, token) = wait_for(
            "the dashboard to print its URL",
            Duration::from_secs(30),
            || process.logs(),
            || {
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                async move {
                    Ok(text.lines().find_map(|l| {
                        let rest = l.strip_prefix("Dashboard: ")?;
                        let printed = rest.split_whitespace().next()?;
                        let (base, token) = printed.split_once("/?token=")?;
                        Some((base.to_owned(), token.to_owned()))
                    }))
                }
            },
        )
        .await?;
        Ok(Self {
            process,
            url,
            token,
        })
    }

    /// The URL of a page (`#/tasks`, …), as printed: with the token,
    /// which the dashboard trades for its cookie and redirects to `/`
    /// (the route after `#` stays).
    pub fn page(&self, route: &str) -> String {
        format!("{}/?token={}{route}", self.url, self.token)
    }

    /// The last lines of its log.
    pub fn logs(&self) -> String {
        self.process.logs()
    }
}
