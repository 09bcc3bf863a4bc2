//! A child process of a test (operator, demo worker) with its own log file,
//! and the signals the tests send it.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use anyhow::Context;

/// `<tmp>/batchlease-e2e-<group>/`, created: where a test (a namespace's
/// group) keeps its processes' logs and its other output (screenshots).
pub fn out_dir(group: &str) -> anyhow::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("batchlease-e2e-{group}"));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// A started binary whose output goes to `log`.
#[derive(Debug)]
pub struct Process {
    child: Option<Child>,
    bin: String,
    args: Vec<String>,
    env: Vec<(String, String)>,
    /// Start with `env` only, not the test's environment.
    clean_env: bool,
    pub log: PathBuf,
}

impl Process {
    /// Starts `bin` with `args` and `env`, logging to `<tmp>/batchlease-e2e-<group>/<name>.log`.
    pub fn start(
        bin: String,
        group: &str,
        name: &str,
        args: Vec<String>,
        env: Vec<(String, String)>,
    ) -> anyhow::Result<Self> {
        Self::launch(bin, group, name, args, env, false)
    }

    /// Like [`Process::start`], with `env` as the whole environment (as a
    /// container's is), not added to the test's.
    pub fn start_clean(
        bin: String,
        group: &str,
        name: &str,
        args: Vec<String>,
        env: Vec<(String, String)>,
    ) -> anyhow::Result<Self> {
        Self::launch(bin, group, name, args, env, true)
    }

    fn launch(
        bin: String,
        group: &str,
        name: &str,
        args: Vec<String>,
        env: Vec<(String, String)>,
        clean_env: bool,
    ) -> anyhow::Result<Self> {
        let log = out_dir(group)?.join(format!("{name}.log"));
        let mut p = Self {
            child: None,
            bin,
            args,
            env,
            clean_env,
            log,
        };
        p.spawn()?;
        Ok(p)
    }

    fn spawn(&mut self) -> anyhow::Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let mut cmd = Command::new(&self.bin);
        if self.clean_env {
            cmd.env_clear();
        }
        let child = cmd
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::from(log.try_clone()?))
            .stderr(Stdio::from(log))
            .spawn()
            .with_context(|| format!("starting {}", self.bin))?;
        self.child = Some(child);
        Ok(())
    }

    /// The process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Sends a signal by name (`STOP`, `CONT`, `TERM`) with the `kill` command.
    pub fn signal(&self, sig: &str) -> anyhow::Result<()> {
        let pid = self.pid().context("process not running")?;
        let ok = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(pid.to_string())
            .status()?
            .success();
        anyhow::ensure!(ok, "kill -{sig} {pid} failed");
        Ok(())
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the same command again (same log).
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.kill();
        self.spawn()
    }

    /// The exit status, once the process ended on its own.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// The whole log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last lines of the log, for diagnostics.
    pub fn logs(&self) -> String {
        let text = self.log_text();
        let tail: Vec<&str> = text.lines().rev().take(60).collect();
        let mut out = format!("--- last lines of {} ---\n", self.log.display());
        for l in tail.into_iter().rev() {
            out.push_str(l);
            out.push('\n');
        }
        out
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        // A stopped process must be continued to die cleanly; one that
        // exited and was reaped has no pid left to signal (kill would
        // complain "No such process" in the test's output).
        if self.exited().is_none() {
            let _ = self.signal("CONT");
        }
        self.kill();
    }
}
