//! The background tasks of one leadership term, watched.
//!
//! Each task of a term (a controller per watched namespace) runs until the
//! term's stop token is cancelled. One that ends before — its stream ended,
//! or it panicked — leaves a leader that still renews its election Lease
//! (that is a separate task) but reconciles nothing: every standby stays
//! blocked while no task makes progress. So an early end is a fault of the
//! process, never a normal end of a term: the caller fails `/healthz` and
//! exits non-zero, and Kubernetes restarts it (a lost term is different:
//! the controllers are stopped on purpose and the replica campaigns again).

use std::fmt;

use tokio::task::{JoinError, JoinHandle, JoinSet};

/// How a task ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Its future returned.
    Returned,
    /// It panicked, with this message.
    Panicked(String),
    /// It was aborted.
    Cancelled,
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Returned => f.write_str("returned"),
            Self::Panicked(msg) => write!(f, "panicked: {msg}"),
            Self::Cancelled => f.write_str("was cancelled"),
        }
    }
}

impl From<Result<(), JoinError>> for Outcome {
    fn from(r: Result<(), JoinError>) -> Self {
        match r {
            Ok(()) => Self::Returned,
            Err(e) if e.is_panic() => {
                let payload = e.into_panic();
                let msg = payload
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "(no message)".into());
                Self::Panicked(msg)
            }
            Err(_) => Self::Cancelled,
        }
    }
}

/// A task that ended, and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ended {
    pub name: String,
    pub outcome: Outcome,
}

impl fmt::Display for Ended {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.name, self.outcome)
    }
}

/// The tasks of one term.
#[derive(Debug, Default)]
pub struct TermTasks {
    set: JoinSet<Ended>,
}

impl TermTasks {
    /// Watches an already spawned task. Aborting the watcher (dropping
    /// these `TermTasks`) does not abort the task: stop it by its own
    /// token, then [`TermTasks::drain`].
    pub fn adopt(&mut self, name: String, task: JoinHandle<()>) {
        self.set.spawn(async move {
            Ended {
                name,
                outcome: task.await.into(),
            }
        });
    }

    /// Resolves when the first task ends (never, with no tasks). While the
    /// term runs, any such end is unexpected.
    pub async fn first_ended(&mut self) -> Ended {
        loop {
            match self.set.join_next().await {
                Some(Ok(ended)) => return ended,
                // The watcher itself cannot panic; only an abort ends it.
                Some(Err(_)) => continue,
                None => std::future::pending::<()>().await,
            }
        }
    }

    /// Waits for every remaining task to end (after the term's stop token
    /// was cancelled).
    pub async fn drain(&mut self) {
        while self.set.join_next().await.is_some() {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio_util::sync::CancellationToken;

    /// A task like a controller: runs until its stop token is cancelled.
    fn controller(stop: &CancellationToken) -> JoinHandle<()> {
        let stop = stop.clone();
        tokio::spawn(async move { stop.cancelled().await })
    }

    #[tokio::test]
    async fn a_panicking_task_is_reported_with_its_name_and_message() {
        let stop = CancellationToken::new();
        let mut tasks = TermTasks::default();
        tasks.adopt("controller a".into(), controller(&stop));
        tasks.adopt(
            "controller b".into(),
            tokio::spawn(async { panic!("watch stream broke") }),
        );
        let ended = tokio::time::timeout(Duration::from_secs(5), tasks.first_ended())
            .await
            .unwrap();
        assert_eq!(
            ended,
            Ended {
                name: "controller b".into(),
                outcome: Outcome::Panicked("watch stream broke".into()),
            }
        );
        assert_eq!(
            ended.to_string(),
            "controller b panicked: watch stream broke"
        );
        stop.cancel();
        tokio::time::timeout(Duration::from_secs(5), tasks.drain())
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn a_task_that_returns_early_is_reported_too() {
        let stop = CancellationToken::new();
        let mut tasks = TermTasks::default();
        tasks.adopt("controller a".into(), controller(&stop));
        tasks.adopt("controller b".into(), tokio::spawn(async {}));
        let ended = tokio::time::timeout(Duration::from_secs(5), tasks.first_ended())
            .await
            .unwrap();
        assert_eq!(ended.name, "controller b");
        assert_eq!(ended.outcome, Outcome::Returned);
    }

    #[tokio::test(start_paused = true)]
    async fn healthy_tasks_never_end_on_their_own_and_drain_after_stop() {
        let stop = CancellationToken::new();
        let mut tasks = TermTasks::default();
        tasks.adopt("controller a".into(), controller(&stop));
        tasks.adopt("controller b".into(), controller(&stop));
        assert!(
            tokio::time::timeout(Duration::from_secs(3600), tasks.first_ended())
                .await
                .is_err(),
            "no task ended while the term ran"
        );
        stop.cancel();
        tokio::time::timeout(Duration::from_secs(1), tasks.drain())
            .await
            .unwrap();
        // With nothing left, `first_ended` never resolves (a term with no
        // tasks is not a fault).
        assert!(
            tokio::time::timeout(Duration::from_secs(3600), tasks.first_ended())
                .await
                .is_err()
        );
    }
}
