//! One attempt: the task's files in a private directory, the command
//! started in its own process group with the task in its environment, its
//! output passed through, its checkpoint file watched, and its end turned
//! into the attempt's outcome.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use batchlease_worker_sdk::{JsonObject, Output, TaskContext, TaskError};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::checkpoint_file;
use crate::child::{self, StopCause, Stops};
use crate::child_env::{self, AttemptInfo};
use crate::exit::{self, ChildEnd, ExitPolicy, Verdict};
use crate::grace::{self, Grace};
use crate::output::{self, LogFormat, Origin, Stream};
use crate::workdir::PrivateDir;

/// What every attempt shares.
#[derive(Debug)]
pub struct Config {
    /// The command and its arguments (at least the program).
    pub command: Vec<String>,
    pub policy: ExitPolicy,
    pub grace: Duration,
    pub log_format: LogFormat,
    /// Where attempts' private directories are made.
    pub work_root: PathBuf,
    /// Fired when the runner drains.
    pub drain: CancellationToken,
    /// The running children's process groups (killed if the runner exits).
    pub live: child::LiveGroups,
    /// The fenced store, when the runner has one: the attempt's storage
    /// deadline is extended while the child runs (`extend`).
    pub store: Option<Arc<batchlease_worker_sdk::postgres::FencedPool>>,
}

/// How often the checkpoint file is looked at (a `stat`; read only when it
/// changed). Also bounded by TTL/6 so a change travels with the next
/// renewal even on short leases.
const CHECKPOINT_POLL: Duration = Duration::from_millis(250);

/// The floor of both polls: a TTL under the CRD's minimum must not make
/// them spin.
pub const MIN_POLL: Duration = Duration::from_millis(50);

/// How long the output of an exited child may still be drained (a
/// grandchild holding the pipe is killed with the group, so this is short).
const OUTPUT_DRAIN: Duration = Duration::from_secs(2);

/// Runs one attempt of `ctx`'s task.
pub async fn run(ctx: TaskContext, cfg: Arc<Config>) -> Result<Output, TaskError> {
    let label = format!("{}/{}", ctx.namespace(), ctx.task_name());
    let token = ctx.fencing_token();
    let ttl = ctx.fence().ttl();
    let g = grace::for_attempt(cfg.grace, ttl);
    if let Grace::Clamped { configured, to } = g {
        warn!(task = %label, token, ?ttl, ?configured, clamped_to = ?to,
            "--kill-grace does not end before this task's lease could be reissued (TTL/3 less a margin): using the shorter grace for this attempt");
    }
    let grace = g.get();
    let dir = PrivateDir::create(&cfg.work_root, token).map_err(|e| {
        TaskError::retryable(format!("creating the attempt's directory: {e}"))
            .with_reason("WorkDirFailed")
    })?;
    let previous = ctx.previous_checkpoint_raw().map(JsonObject::as_str);
    prepare_files(&dir, ctx.payload_raw().map(JsonObject::as_str), previous).map_err(|e| {
        TaskError::retryable(format!("writing the attempt's files: {e}"))
            .with_reason("WorkDirFailed")
    })?;
    let vars = child_env::vars(&AttemptInfo {
        namespace: ctx.namespace(),
        name: ctx.task_name(),
        uid: ctx.task_uid(),
        queue: ctx.queue(),
        attempt: ctx.attempt(),
        token,
        lease_seconds: ttl.as_secs(),
        dir: dir.path(),
    });
    let (program, args) = cfg
        .command
        .split_first()
        .ok_or_else(|| TaskError::permanent("no command given").with_reason("SpawnFailed"))?;
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args)
        .envs(vars)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own group: signals reach everything it starts, and a
        // terminal's ^C to the runner does not hit it behind our back.
        .process_group(0);
    for v in child_env::WITHHELD {
        cmd.env_remove(v);
    }
    let mut proc = cmd.spawn().map_err(|e| spawn_failed(program, &e))?;
    let origin = Origin {
        namespace: ctx.namespace().to_owned(),
        name: ctx.task_name().to_owned(),
        token,
    };
    let mut pumps = Vec::new();
    if let Some(out) = proc.stdout.take() {
        pumps.push(tokio::spawn(output::pump(
            out,
            cfg.log_format,
            origin.clone(),
            Stream::Stdout,
        )));
    }
    if let Some(err) = proc.stderr.take() {
        pumps.push(tokio::spawn(output::pump(
            err,
            cfg.log_format,
            origin,
            Stream::Stderr,
        )));
    }
    info!(task = %label, token, attempt = ctx.attempt(), pid = proc.id(), ?grace, "command started");
    let abandoned = CancellationToken::new();
    // Fires when this future ends *or is dropped* (the SDK drops it at the
    // kill switch): the supervisor then stops the child.
    let _abandon_on_drop = abandoned.clone().drop_guard();
    if let Some(store) = &cfg.store {
        batchlease_worker_sdk::postgres::spawn_extender(
            store.clone(),
            ctx.fence().clone(),
            ctx.task_uid().to_owned(),
            abandoned.clone(),
        );
    }
    let mut ended = child::supervise(
        proc,
        Stops {
            revoked: ctx.cancellation(),
            abandoned,
            drain: cfg.drain.clone(),
            live: cfg.live.clone(),
        },
        grace,
        label.clone(),
    );
    let mut watch = CheckpointWatch::new(dir.path().join(child_env::CHECKPOINT_FILE), previous);
    // Never zero (tokio's interval panics on it), whatever the lease says.
    let mut tick = tokio::time::interval(CHECKPOINT_POLL.min(ttl / 6).max(MIN_POLL));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let ended = loop {
        tokio::select! {
            e = &mut ended => break e,
            _ = tick.tick() => watch.poll(&ctx, &label, false),
        }
    };
    // The last word of the child (a checkpoint written just before a
    // retry code goes with the completion).
    watch.poll(&ctx, &label, true);
    let _ = tokio::time::timeout(OUTPUT_DRAIN, futures_join(pumps)).await;
    let ended = ended.map_err(|_| {
        TaskError::retryable("the child's supervisor ended without a status")
            .with_reason("RunnerFailed")
    })?;
    let status = ended.status.map_err(|e| {
        TaskError::retryable(format!("waiting for the command: {e}")).with_reason("RunnerFailed")
    })?;
    let end = ChildEnd::of(status);
    info!(task = %label, token, ?end, stopped = ?ended.stopped, "command ended");
    if ended.stopped == Some(StopCause::Revoked) {
        // The SDK has dropped (or is dropping) this attempt: nothing we
        // return is written.
        return Err(TaskError::retryable("the attempt was revoked").with_reason("KillSwitch"));
    }
    match exit::classify(end, &cfg.policy, ended.stopped == Some(StopCause::Drain)) {
        Verdict::Succeeded => read_result(&dir.path().join(child_env::RESULT_FILE)),
        Verdict::Retryable { reason, message } => {
            Err(TaskError::retryable(message).with_reason(reason))
        }
        Verdict::Permanent { reason, message } => {
            Err(TaskError::permanent(message).with_reason(reason))
        }
        Verdict::Interrupted { message } => {
            Err(TaskError::retryable(message).with_reason(exit::DRAINED_REASON))
        }
    }
}

async fn futures_join(handles: Vec<tokio::task::JoinHandle<()>>) {
    for h in handles {
        let _ = h.await;
    }
}

/// The payload (`{}` when the task has none, as the SDK reads it), the
/// previous checkpoint (empty when there is none) and an empty result.
fn prepare_files(
    dir: &PrivateDir,
    payload: Option<&str>,
    checkpoint: Option<&str>,
) -> std::io::Result<()> {
    dir.write(child_env::PAYLOAD_FILE, payload.unwrap_or("{}").as_bytes())?;
    dir.write(
        child_env::CHECKPOINT_FILE,
        checkpoint.unwrap_or("").as_bytes(),
    )?;
    dir.write(child_env::RESULT_FILE, b"")?;
    Ok(())
}

/// A command that could not start. The runner checked at start that it
/// exists and is executable (preflight.rs), so a failure now is the
/// worker's environment (the file removed or replaced, out of processes
/// or descriptors), never the task's input: retryable, never a
/// dead-letter.
fn spawn_failed(program: &str, e: &std::io::Error) -> TaskError {
    TaskError::retryable(format!("starting {program}: {e}")).with_reason("SpawnFailed")
}

/// The result file of a command that exited 0.
pub fn read_result(path: &Path) -> Result<Output, TaskError> {
    let bytes = std::fs::read(path).map_err(|e| {
        TaskError::permanent(format!("reading the result file: {e}")).with_reason("InvalidResult")
    })?;
    result_of(&bytes)
}

/// Empty: no result. A JSON object within the SDK's limits: the task's
/// result. Anything else fails the attempt permanently (the same command
/// would write the same again).
pub fn result_of(bytes: &[u8]) -> Result<Output, TaskError> {
    let text = std::str::from_utf8(bytes)
        .map_err(|_| {
            TaskError::permanent("the result file is not UTF-8").with_reason("InvalidResult")
        })?
        .trim();
    if text.is_empty() {
        return Ok(Output::none());
    }
    let obj = JsonObject::from_text(text.to_owned()).map_err(|e| {
        TaskError::permanent(format!("the result file is not a JSON object: {e}"))
            .with_reason("InvalidResult")
    })?;
    Ok(Output::try_raw(obj)?)
}

/// Watches the checkpoint file: a `stat` per poll, a read only when its
/// size or mtime changed, a warning once per refused content.
struct CheckpointWatch {
    path: PathBuf,
    seen: Option<(u64, SystemTime)>,
    last: Vec<u8>,
}

impl CheckpointWatch {
    /// Nothing counts as seen: the first poll reads the file. The child
    /// may have written it before the watch began (a stamp taken then
    /// would already include that write, and a checkpoint written in the
    /// first milliseconds would wait for the child's end to be noticed).
    fn new(path: PathBuf, previous: Option<&str>) -> Self {
        Self {
            path,
            seen: None,
            last: previous.unwrap_or("").as_bytes().to_vec(),
        }
    }

    fn poll(&mut self, ctx: &TaskContext, label: &str, force: bool) {
        let now = stamp(&self.path);
        if !force && now == self.seen {
            return;
        }
        self.seen = now;
        if now.is_some_and(|(len, _)| len > checkpoint_file::MAX_FILE_BYTES) {
            let bytes = now.map_or(0, |(l, _)| l);
            if self.last != b"<too large>" {
                warn!(
                    task = label,
                    bytes, "checkpoint file too large: ignored, the last checkpoint stands"
                );
                self.last = b"<too large>".to_vec();
            }
            return;
        }
        let Ok(bytes) = std::fs::read(&self.path) else {
            return;
        };
        if bytes == self.last {
            return;
        }
        match checkpoint_file::parse(&bytes) {
            // Emptied: nothing new to record.
            Ok(None) => {}
            Ok(Some(cp)) => match ctx.checkpoint(cp) {
                Ok(()) => debug!(task = label, bytes = bytes.len(), "checkpoint recorded"),
                Err(e) => {
                    warn!(task = label, error = %e, "checkpoint refused: the last checkpoint stands")
                }
            },
            Err(e) => warn!(task = label, error = %e, kind = e.kind(),
                "checkpoint file is not a valid checkpoint: ignored, the last checkpoint stands"),
        }
        self.last = bytes;
    }
}

fn stamp(path: &Path) -> Option<(u64, SystemTime)> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.len(), m.modified().ok()?))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn result_file_table() {
        let cases: [(&[u8], Result<bool, &str>); 6] = [
            (b"", Ok(false)),
            (b"\n", Ok(false)),
            (b"{\"rows\": 3}\n", Ok(true)),
            (b"[1]", Err("InvalidResult")),
            (b"not json", Err("InvalidResult")),
            (b"\xff", Err("InvalidResult")),
        ];
        for (input, want) in cases {
            match (want, result_of(input)) {
                (Ok(some), Ok(out)) => assert_eq!(out != Output::none(), some),
                (Err(reason), Err(TaskError::Permanent { reason: r, .. })) => assert_eq!(r, reason),
                (w, g) => panic!("{:?}: want {w:?} got {g:?}", String::from_utf8_lossy(input)),
            }
        }
        let big = format!(
            "{{\"x\":\"{}\"}}",
            "y".repeat(batchlease_worker_sdk::MAX_RESULT_BYTES)
        );
        match result_of(big.as_bytes()) {
            Err(TaskError::Permanent { reason, .. }) => assert_eq!(reason, "ResultTooLarge"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_command_that_cannot_start_is_never_charged_as_permanent() {
        // The start check (preflight.rs) refused a missing command before
        // any claim; one that vanished since is the worker's fault.
        for kind in [
            std::io::ErrorKind::NotFound,
            std::io::ErrorKind::PermissionDenied,
            std::io::ErrorKind::Interrupted,
        ] {
            let e = std::io::Error::from(kind);
            match spawn_failed("x", &e) {
                TaskError::Retryable { reason, .. } => assert_eq!(reason, "SpawnFailed"),
                other => panic!("{kind:?}: {other:?}"),
            }
        }
    }
}
