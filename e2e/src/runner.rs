//! `batchlease-run` (the `runner/` crate) as a real process: a worker that
//! runs a shell command per attempt.

use anyhow::Context;

use crate::process::Process;

/// The runner binary, built by `hack/test.sh` (`BATCHLEASE_RUN_BIN`).
pub fn binary() -> anyhow::Result<String> {
    std::env::var("BATCHLEASE_RUN_BIN")
        .context("BATCHLEASE_RUN_BIN unset: run hack/test.sh (it builds batchlease-run)")
}

/// Options of a runner process.
#[derive(Debug, Clone)]
pub struct RunnerOpts {
    pub queue: String,
    pub slots: usize,
    /// `--kill-grace` in seconds.
    pub kill_grace: f64,
    /// Register attempts in the harness's PostgreSQL (`BATCHLEASE_PG_URL`).
    pub fenced_store: bool,
    /// More flags.
    pub extra: Vec<String>,
    /// More environment variables (the child inherits them).
    pub env: Vec<(String, String)>,
}

impl Default for RunnerOpts {
    fn default() -> Self {
        Self {
            queue: "sh".into(),
            slots: 1,
            kill_grace: 1.0,
            fenced_store: true,
            extra: Vec::new(),
            env: Vec::new(),
        }
    }
}

/// Starts runner `identity` for `namespace`, running `sh -c script` per
/// attempt.
pub fn start(
    namespace: &str,
    identity: &str,
    opts: &RunnerOpts,
    script: &str,
) -> anyhow::Result<Process> {
    let mut args = vec![
        format!("--namespace={namespace}"),
        format!("--queue={}", opts.queue),
        format!("--slots={}", opts.slots),
        format!("--identity={identity}"),
        format!("--kill-grace={}", opts.kill_grace),
    ];
    args.extend(opts.extra.iter().cloned());
    args.extend(["--".into(), "sh".into(), "-c".into(), script.into()]);
    let mut env = vec![(
        "RUST_LOG".to_owned(),
        "info,kube=warn,batchlease_worker_sdk=debug,batchlease_run=debug".to_owned(),
    )];
    if opts.fenced_store {
        env.push(("BATCHLEASE_PG_URL".into(), crate::workers::pg_url()?));
    }
    env.extend(opts.env.iter().cloned());
    Process::start(
        binary()?,
        namespace,
        &format!("runner-{identity}"),
        args,
        env,
    )
}

/// Processes of process group `pgid` that are alive (not zombies), from
/// /proc: what must be empty once a child's grace is over.
pub fn live_group_members(pgid: i32) -> Vec<i32> {
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in dir.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ppid pgrp …; comm may hold spaces and parens.
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let f: Vec<&str> = rest.split_whitespace().collect();
        if f.len() > 2 && f[2] == pgid.to_string() && f[0] != "Z" {
            out.push(pid);
        }
    }
    out
}
