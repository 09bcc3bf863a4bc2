//! The child process of one attempt and the rule that it never outlives
//! its lease.
//!
//! The SDK *drops* the handler's future at the kill switch's instant, so
//! nothing the handler awaits can be relied on to stop the child. Each
//! child is therefore owned by a supervisor task spawned on its own (it
//! survives the handler), which sends SIGTERM to the child's process group
//! when the kill switch fires, the task is cancelled, the handler is
//! dropped for any other reason, or the runner drains — and SIGKILL to the
//! group once the grace is over. When the child exits by itself, whatever
//! it left behind in its group is killed too: the task's processes end
//! with the task.

use std::collections::BTreeSet;
use std::process::ExitStatus;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::process::Child;
use tokio::sync::oneshot;
use tokio::time::{Instant, sleep_until};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// Why the supervisor stopped the child.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopCause {
    /// The kill switch fired, the task was cancelled or a drain stopped
    /// the attempt (`TaskContext::cancellation`), or the handler was
    /// dropped.
    Revoked,
    /// The runner is draining (SIGTERM or SIGINT to the runner).
    Drain,
}

impl StopCause {
    fn as_str(self) -> &'static str {
        match self {
            Self::Revoked => "revoked",
            Self::Drain => "drain",
        }
    }
}

/// What the supervisor reports when the child is gone.
#[derive(Debug)]
pub struct Ended {
    pub status: std::io::Result<ExitStatus>,
    /// Set when the runner had signalled the child before it ended.
    pub stopped: Option<StopCause>,
}

/// Sends `sig` to process group `pgid`; a group already gone is fine.
pub fn signal_group(pgid: Pid, sig: Signal) {
    match killpg(pgid, sig) {
        Ok(()) | Err(nix::errno::Errno::ESRCH) => {}
        Err(e) => {
            warn!(pgid = pgid.as_raw(), signal = sig.as_str(), error = %e, "signalling the child's process group failed")
        }
    }
}

/// The process groups of running children. Supervisors die with the
/// runtime, so the runner's own end — an error out of `main`, a panic
/// unwinding it — must take the children along itself ([`KillOnExit`]).
#[derive(Debug, Default, Clone)]
pub struct LiveGroups(Arc<Mutex<BTreeSet<i32>>>);

impl LiveGroups {
    fn set(&self) -> std::sync::MutexGuard<'_, BTreeSet<i32>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// SIGKILL to every group still running.
    pub fn kill_all(&self) {
        let groups: Vec<i32> = self.set().iter().copied().collect();
        for g in groups {
            warn!(
                pgid = g,
                "the runner is exiting: SIGKILL to a child's process group"
            );
            signal_group(Pid::from_raw(g), Signal::SIGKILL);
        }
    }
}

/// Kills every live child's group when dropped (held by `main`).
#[derive(Debug)]
pub struct KillOnExit(pub LiveGroups);

impl Drop for KillOnExit {
    fn drop(&mut self) {
        self.0.kill_all();
    }
}

/// What stops a child.
#[derive(Debug, Clone)]
pub struct Stops {
    /// `TaskContext::cancellation`: the kill switch, a cancel, or a drain
    /// past its grace.
    pub revoked: CancellationToken,
    /// Fired when the handler's future ends or is dropped.
    pub abandoned: CancellationToken,
    /// Fired when the runner drains.
    pub drain: CancellationToken,
    /// Where the child's group is listed while it runs.
    pub live: LiveGroups,
}

/// Supervises `child` (started in its own process group) until it is gone;
/// the returned receiver gets how it ended. Spawned: it outlives a dropped
/// handler.
pub fn supervise(
    child: Child,
    stops: Stops,
    grace: Duration,
    label: String,
) -> oneshot::Receiver<Ended> {
    let (tx, rx) = oneshot::channel();
    tokio::spawn(async move {
        let ended = run(child, stops, grace, &label).await;
        let _ = tx.send(ended);
    });
    rx
}

async fn run(mut child: Child, stops: Stops, grace: Duration, label: &str) -> Ended {
    let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) else {
        // Already reaped: nothing to supervise.
        return Ended {
            status: child.wait().await,
            stopped: None,
        };
    };
    // process_group(0): the group's id is the child's pid.
    let pgid = Pid::from_raw(pid);
    stops.live.set().insert(pid);
    let mut stopped: Option<StopCause> = None;
    let mut kill_at: Option<Instant> = None;
    let status = loop {
        tokio::select! {
            status = child.wait() => break status,
            _ = stops.revoked.cancelled(), if stopped != Some(StopCause::Revoked) => {
                stop(pgid, StopCause::Revoked, grace, label, &mut stopped, &mut kill_at);
            }
            _ = stops.abandoned.cancelled(), if stopped != Some(StopCause::Revoked) => {
                stop(pgid, StopCause::Revoked, grace, label, &mut stopped, &mut kill_at);
            }
            _ = stops.drain.cancelled(), if stopped.is_none() => {
                stop(pgid, StopCause::Drain, grace, label, &mut stopped, &mut kill_at);
            }
            _ = sleep_until(kill_at.unwrap_or_else(Instant::now)), if kill_at.is_some() => {
                warn!(task = label, pgid = pid, ?grace, "grace over: SIGKILL to the child's process group");
                signal_group(pgid, Signal::SIGKILL);
                kill_at = None;
            }
        }
    };
    // The leader is gone; anything it left in its group goes too (at once
    // if it was stopped by us and has used up its grace, else now anyway:
    // nothing of the task may outlive its attempt).
    signal_group(pgid, Signal::SIGKILL);
    stops.live.set().remove(&pid);
    Ended { status, stopped }
}

/// SIGTERM now, SIGKILL at the end of the grace (the earlier deadline wins
/// when a drain is followed by the kill switch).
fn stop(
    pgid: Pid,
    cause: StopCause,
    grace: Duration,
    label: &str,
    stopped: &mut Option<StopCause>,
    kill_at: &mut Option<Instant>,
) {
    info!(
        task = label,
        pgid = pgid.as_raw(),
        cause = cause.as_str(),
        ?grace,
        "SIGTERM to the child's process group"
    );
    signal_group(pgid, Signal::SIGTERM);
    let at = Instant::now() + grace;
    *kill_at = Some(kill_at.map_or(at, |k| k.min(at)));
    *stopped = Some(cause);
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn spawn(script: &str) -> Child {
        tokio::process::Command::new("sh")
            .arg("-c")
            .arg(script)
            .process_group(0)
            .spawn()
            .unwrap()
    }

    /// Waits for `cond` with a deadline (no fixed sleeps: a loaded CI
    /// machine is slow to fork and to reap).
    async fn until(what: &str, mut cond: impl FnMut() -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !cond() {
            assert!(
                std::time::Instant::now() < deadline,
                "timed out waiting: {what}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn stops() -> Stops {
        Stops {
            revoked: CancellationToken::new(),
            abandoned: CancellationToken::new(),
            drain: CancellationToken::new(),
            live: LiveGroups::default(),
        }
    }

    #[tokio::test]
    async fn a_child_that_exits_reports_its_status() {
        let rx = supervise(
            spawn("exit 75"),
            stops(),
            Duration::from_secs(1),
            "t".into(),
        );
        let e = rx.await.unwrap();
        assert_eq!(e.status.unwrap().code(), Some(75));
        assert_eq!(e.stopped, None);
    }

    #[tokio::test]
    async fn revocation_terms_then_kills_the_whole_group() {
        let s = stops();
        // Ignores SIGTERM, with a grandchild in the same group.
        let child = spawn("trap '' TERM; sleep 30 & sleep 30; wait");
        let pgid = child.id().unwrap() as i32;
        let rx = supervise(child, s.clone(), Duration::from_millis(300), "t".into());
        // The shell and both sleeps: the trap is in place.
        until("the group to start", || live_members(pgid).len() >= 3).await;
        let t0 = std::time::Instant::now();
        s.revoked.cancel();
        let e = rx.await.unwrap();
        assert!(t0.elapsed() < Duration::from_secs(5));
        assert_eq!(e.stopped, Some(StopCause::Revoked));
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(e.status.unwrap().signal(), Some(9));
        // No live member of the group is left (a killed grandchild may
        // stay a zombie until its new parent reaps it, and SIGKILL to a
        // group is delivered to each member on its own schedule).
        until("the group to die", || live_members(pgid).is_empty()).await;
    }

    /// Processes of group `pgid` that are not zombies, from /proc.
    fn live_members(pgid: i32) -> Vec<i32> {
        let mut out = Vec::new();
        for e in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
                continue;
            };
            // pid (comm) state ppid pgrp …; comm may contain spaces.
            let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
                continue;
            };
            let f: Vec<&str> = rest.split_whitespace().collect();
            if f.len() > 2 && f[2] == pgid.to_string() && f[0] != "Z" {
                out.push(e.file_name().to_string_lossy().parse().unwrap_or(0));
            }
        }
        out
    }

    #[tokio::test]
    async fn a_dropped_handler_stops_the_child() {
        let s = stops();
        let rx = supervise(
            spawn("sleep 30"),
            s.clone(),
            Duration::from_secs(5),
            "t".into(),
        );
        {
            let _guard = s.abandoned.clone().drop_guard();
        }
        let e = rx.await.unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(e.status.unwrap().signal(), Some(15));
    }

    #[tokio::test]
    async fn the_runners_exit_kills_live_children() {
        let s = stops();
        let child = spawn("sleep 30 & sleep 30");
        let pgid = child.id().unwrap() as i32;
        let rx = supervise(child, s.clone(), Duration::from_secs(30), "t".into());
        until("the group to be listed", || !s.live.set().is_empty()).await;
        assert_eq!(s.live.set().iter().copied().collect::<Vec<_>>(), vec![pgid]);
        drop(KillOnExit(s.live.clone()));
        let e = rx.await.unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(e.status.unwrap().signal(), Some(9));
        assert!(s.live.set().is_empty());
    }

    #[tokio::test]
    async fn drain_forwards_sigterm() {
        let s = stops();
        let child = spawn("trap 'exit 3' TERM; sleep 30 & wait");
        let pgid = child.id().unwrap() as i32;
        let rx = supervise(child, s.clone(), Duration::from_secs(5), "t".into());
        // The shell and its sleep: the trap is in place.
        until("the group to start", || live_members(pgid).len() >= 2).await;
        s.drain.cancel();
        let e = rx.await.unwrap();
        assert_eq!(e.stopped, Some(StopCause::Drain));
        assert_eq!(e.status.unwrap().code(), Some(3));
    }
}
