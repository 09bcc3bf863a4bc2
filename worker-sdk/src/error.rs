//! Errors: what a handler reports ([`TaskError`]) and what the SDK reports
//! ([`Error`]). Variants are categories, fit for metric labels.

/// How a handler failed. Retryable failures spend the task's retry budget;
/// permanent ones dead-letter the task at once.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TaskError {
    /// A retry may succeed (a timeout, a flaky dependency).
    #[error("{reason}: {message}")]
    Retryable { reason: String, message: String },
    /// A retry cannot help (bad input); the task is dead-lettered now.
    #[error("{reason} (permanent): {message}")]
    Permanent { reason: String, message: String },
    /// A speculative commit lost its compare-and-swap (design §6): the
    /// operator retries without spending a retry, and quarantines the task
    /// to Exclusive mode after `maxSpeculativeAborts`.
    #[error("CompareAndSwapLost: {message}")]
    Aborted { message: String },
}

impl TaskError {
    /// A retryable failure with reason `HandlerFailed`.
    pub fn retryable(message: impl Into<String>) -> Self {
        Self::Retryable {
            reason: "HandlerFailed".into(),
            message: message.into(),
        }
    }

    /// A permanent failure with reason `PermanentFailure`.
    pub fn permanent(message: impl Into<String>) -> Self {
        Self::Permanent {
            reason: "PermanentFailure".into(),
            message: message.into(),
        }
    }

    /// Replaces the short CamelCase reason shown in the task's status.
    #[must_use]
    pub fn with_reason(self, reason: impl Into<String>) -> Self {
        match self {
            Self::Retryable { message, .. } => Self::Retryable {
                reason: reason.into(),
                message,
            },
            Self::Permanent { message, .. } => Self::Permanent {
                reason: reason.into(),
                message,
            },
            aborted @ Self::Aborted { .. } => aborted,
        }
    }
}

/// Why the SDK refused or failed an operation.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The attempt's lease is no longer ours (kill switch fired, lease
    /// expired, task deleted): no commit or completion may happen any more.
    #[error("the attempt with fencing token {token} was revoked: {reason}")]
    Revoked { token: i64, reason: &'static str },
    /// The storage holds a newer fencing token: this attempt is a zombie.
    #[error("fenced: storage already holds token {current}, ours is {token}")]
    Fenced { token: i64, current: i64 },
    /// The storage holds a newer fencing token for one of the attempt's
    /// resource locks: another holder of that resource registered after
    /// us (we are a zombie of that lock). `current` equal to `token` means
    /// the token was registered by another task: a reused token is refused
    /// rather than trusted.
    #[error("fenced on resource {resource}: storage holds its token {current}, ours is {token}")]
    ResourceFenced {
        resource: String,
        token: i64,
        current: i64,
    },
    /// An earlier attempt's commit already stuck: the work is done (see
    /// `TaskContext::earlier_commit`); ours was not written.
    #[error("attempt {token} not committed: attempt {earlier} already committed this task")]
    CommittedEarlier { token: i64, earlier: i64 },
    /// This attempt already committed a different payload: a second commit
    /// by one token is a bug in the handler, not a retry.
    #[error("attempt {token} already committed a different payload")]
    PayloadMismatch { token: i64 },
    /// The API server refused our write of the lease (it is not ours).
    #[error("the API server rejected the {what} of lease {lease}: {source}")]
    Rejected {
        what: &'static str,
        lease: String,
        #[source]
        source: kube::Error,
    },
    /// Any other Kubernetes API error.
    #[error("kubernetes API error during {what}: {source}")]
    Kube {
        what: &'static str,
        #[source]
        source: kube::Error,
    },
    /// A storage error other than fencing.
    #[cfg(feature = "postgres")]
    #[error("postgres error during {what}: {source}")]
    Postgres {
        what: &'static str,
        #[source]
        source: tokio_postgres::Error,
    },
    /// A call did not answer within its budget.
    #[error("{what} timed out")]
    Timeout { what: &'static str },
    /// A write kept conflicting with our own earlier writes.
    #[error("{what} kept conflicting; gave up")]
    Contended { what: &'static str },
    /// A checkpoint or result that is not a JSON object (or cannot be
    /// serialized): the CRDs accept objects only.
    #[error("{what} is not a valid JSON object: {source}")]
    InvalidJson {
        what: &'static str,
        #[source]
        source: batchlease_api::JsonObjectError,
    },
    /// A checkpoint or result over its size limit: it would be refused by
    /// the API server or make the task's status too large.
    #[error("{what} is {bytes} bytes; the limit is {limit}")]
    TooLarge {
        what: &'static str,
        bytes: usize,
        limit: usize,
    },
    /// A checkpoint or result nested deeper than
    /// [`MAX_DEPTH`](batchlease_api::MAX_DEPTH) levels.
    #[error("{what} is nested {depth} levels deep; the limit is {limit}")]
    TooDeep {
        what: &'static str,
        depth: usize,
        limit: usize,
    },
    /// The API server refused our own write of a lease that is still ours
    /// (422 Invalid): retrying the same write cannot help, so the attempt
    /// ends with this error instead of looping until the kill switch.
    #[error("the API server refused the {what} of lease {lease} as invalid: {message}")]
    Invalid {
        what: &'static str,
        lease: String,
        message: String,
    },
    /// A dependency of the task is not `Succeeded` (any more): it was
    /// deleted, re-created or redriven after this attempt was issued.
    /// `phase` is the phase found, `NotFound` when the task is gone.
    #[error("dependency {name} is {phase}, not Succeeded")]
    DependencyNotSucceeded { name: String, phase: &'static str },
    /// The handler asked for the result of a task that is not in its
    /// `spec.dependsOn`: only dependencies are known to have succeeded.
    #[error("{name} is not a dependency of this task")]
    NotADependency { name: String },
    /// A sub-graph that cannot be spawned as given; nothing was created.
    #[error("invalid sub-graph: {0}")]
    InvalidSubgraph(#[from] crate::subgraph::SubgraphError),
    /// A child's name is taken by an object that is not the child we would
    /// create: another owner, or another spec (the sub-graph is not a
    /// deterministic function of the task, or its version was reused).
    #[error("child {name} already exists with a different {differs}")]
    SpawnConflict { name: String, differs: String },
    /// The API server refused to create a child (e.g. 422: its spec is
    /// invalid; 403: the worker may not create BatchTasks).
    #[error("the API server refused to create child {name}: {source}")]
    SpawnRefused {
        name: String,
        #[source]
        source: kube::Error,
    },
    /// The worker was configured wrongly.
    #[error("invalid worker configuration: {0}")]
    Config(&'static str),
}

impl Error {
    /// Low-cardinality label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Revoked { .. } => "revoked",
            Self::Fenced { .. } => "fenced",
            Self::ResourceFenced { .. } => "resource_fenced",
            Self::CommittedEarlier { .. } => "committed_earlier",
            Self::PayloadMismatch { .. } => "payload_mismatch",
            Self::Rejected { .. } => "rejected",
            Self::Kube { .. } => "kube",
            #[cfg(feature = "postgres")]
            Self::Postgres { .. } => "postgres",
            Self::Contended { .. } => "contended",
            Self::Timeout { .. } => "timeout",
            Self::InvalidJson { .. } => "invalid_json",
            Self::TooLarge { .. } => "too_large",
            Self::TooDeep { .. } => "too_deep",
            Self::Invalid { .. } => "invalid",
            Self::DependencyNotSucceeded { .. } => "dependency_not_succeeded",
            Self::NotADependency { .. } => "not_a_dependency",
            Self::InvalidSubgraph(_) => "invalid_subgraph",
            Self::SpawnConflict { .. } => "spawn_conflict",
            Self::SpawnRefused { .. } => "spawn_refused",
            Self::Config(_) => "config",
        }
    }
}

/// A fenced or revoked commit inside a handler is a zombie's failure: the
/// attempt is over. Handlers can `?` SDK errors.
impl From<Error> for TaskError {
    fn from(e: Error) -> Self {
        let reason = match &e {
            Error::Revoked { .. } => "Revoked",
            Error::Fenced { .. } | Error::ResourceFenced { .. } => "Fenced",
            // A dependency that is not Succeeded any more may be again
            // (re-created, redriven): worth a retry.
            Error::DependencyNotSucceeded { .. } => "DependencyNotSucceeded",
            // The same handler would ask the same again.
            Error::NotADependency { .. } => return permanent("NotADependency", &e),
            Error::InvalidSubgraph(_) => return permanent("InvalidSubgraph", &e),
            Error::SpawnConflict { .. } => return permanent("SpawnConflict", &e),
            // An invalid child stays invalid; a forbidden create may be
            // allowed once RBAC is fixed, a throttled one later.
            Error::SpawnRefused {
                source: kube::Error::Api(s),
                ..
            } if matches!(s.code, 400 | 422) => return permanent("SpawnRefused", &e),
            Error::SpawnRefused { .. } => "SpawnRefused",
            // The same handler would produce the same output again: a
            // retry cannot help.
            Error::TooLarge { what: "result", .. } => return permanent("ResultTooLarge", &e),
            Error::TooLarge { .. } => return permanent("CheckpointTooLarge", &e),
            Error::TooDeep { what: "result", .. } => return permanent("ResultTooDeep", &e),
            Error::TooDeep { .. } => return permanent("CheckpointTooDeep", &e),
            Error::InvalidJson { .. } => return permanent("InvalidJson", &e),
            _ => "SdkError",
        };
        TaskError::Retryable {
            reason: reason.into(),
            message: e.to_string(),
        }
    }
}

fn permanent(reason: &str, e: &Error) -> TaskError {
    TaskError::Permanent {
        reason: reason.into(),
        message: e.to_string(),
    }
}
