//! Keeping a status write within the operator's size budget.
//!
//! Checkpoints and results come from workers; the SDK caps them, but a
//! careless or hostile writer of a lease need not use the SDK. Copied into
//! the task's status unchecked, an oversized one made the settle write fail
//! every time — the task stuck Running, retried every few seconds forever.
//! Here the copy is checked before the write: what does not fit is left out
//! and reported (an Event), and the write that records the outcome succeeds.

use batchlease_api::{BatchTask, BatchTaskStatus, MAX_CHECKPOINT_BYTES, MAX_RESULT_BYTES};

/// Bytes a whole BatchTask (as JSON) may take after a status write. etcd
/// refuses objects over 1.5 MiB; the rest is headroom for metadata the
/// API server adds (managedFields) and for the encoding's differences.
pub const OBJECT_BUDGET: usize = 1_000_000;

/// Something left out of a status write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dropped {
    /// The worker's checkpoint (the previous one, if any, is kept).
    Checkpoint { bytes: usize },
    /// The worker's result.
    Result { bytes: usize },
}

impl Dropped {
    /// Event reason.
    pub fn reason(self) -> &'static str {
        match self {
            Self::Checkpoint { .. } => "CheckpointTooLarge",
            Self::Result { .. } => "ResultTooLarge",
        }
    }

    /// Event note.
    pub fn note(self) -> String {
        match self {
            Self::Checkpoint { bytes } => format!(
                "the worker's checkpoint ({bytes} bytes) exceeds the limit ({MAX_CHECKPOINT_BYTES} bytes, and the object's {OBJECT_BUDGET}); not recorded"
            ),
            Self::Result { bytes } => format!(
                "the worker's result ({bytes} bytes) exceeds the limit ({MAX_RESULT_BYTES} bytes, and the object's {OBJECT_BUDGET}); not recorded"
            ),
        }
    }
}

/// `status` as it may be written for `task`: a checkpoint or result that
/// is new in `status` (not in the task's current status) and too large on
/// its own, or makes the whole object exceed [`OBJECT_BUDGET`], is reverted
/// to what the task had (checkpoint first, it is the less valuable).
pub fn fit(task: &BatchTask, mut status: BatchTaskStatus) -> (BatchTaskStatus, Vec<Dropped>) {
    let before = task.status.clone().unwrap_or_default();
    let mut dropped = Vec::new();
    if status.checkpoint != before.checkpoint
        && let Some(bytes) = status.checkpoint.as_ref().map(|c| c.len())
        && bytes > MAX_CHECKPOINT_BYTES
    {
        status.checkpoint = before.checkpoint.clone();
        dropped.push(Dropped::Checkpoint { bytes });
    }
    if status.result != before.result
        && let Some(bytes) = status.result.as_ref().map(|r| r.len())
        && bytes > MAX_RESULT_BYTES
    {
        status.result = before.result.clone();
        dropped.push(Dropped::Result { bytes });
    }
    if size_with(task, &status) > OBJECT_BUDGET && status.checkpoint != before.checkpoint {
        let bytes = status.checkpoint.as_ref().map_or(0, |c| c.len());
        status.checkpoint = before.checkpoint.clone();
        dropped.push(Dropped::Checkpoint { bytes });
    }
    if size_with(task, &status) > OBJECT_BUDGET && status.result != before.result {
        let bytes = status.result.as_ref().map_or(0, |r| r.len());
        status.result = before.result.clone();
        dropped.push(Dropped::Result { bytes });
    }
    (status, dropped)
}

/// Bytes of `task` as JSON with `status` in place of its own.
fn size_with(task: &BatchTask, status: &BatchTaskStatus) -> usize {
    let shell = BatchTask {
        metadata: task.metadata.clone(),
        spec: task.spec.clone(),
        status: None,
    };
    let spec_and_meta = serde_json::to_vec(&shell).map_or(usize::MAX, |v| v.len());
    let status = serde_json::to_vec(status).map_or(usize::MAX, |v| v.len());
    spec_and_meta.saturating_add(status)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use batchlease_api::{BatchTaskSpec, JsonObject};

    fn object(bytes: usize) -> JsonObject {
        // {"x":"…"} is 8 bytes plus the string.
        JsonObject::from_text(format!(r#"{{"x":"{}"}}"#, "a".repeat(bytes - 8))).unwrap()
    }

    fn task(payload: usize, checkpoint: Option<usize>) -> BatchTask {
        let mut spec = BatchTaskSpec::for_queue("q");
        spec.payload = Some(object(payload));
        let mut t = BatchTask::new("t", spec);
        t.status = Some(BatchTaskStatus {
            checkpoint: checkpoint.map(object),
            ..Default::default()
        });
        t
    }

    fn with(checkpoint: Option<usize>, result: Option<usize>) -> BatchTaskStatus {
        BatchTaskStatus {
            checkpoint: checkpoint.map(object),
            result: result.map(object),
            ..Default::default()
        }
    }

    #[test]
    fn table() {
        let limit = MAX_RESULT_BYTES;
        // (what, payload, old checkpoint, new checkpoint, new result,
        //  expected checkpoint, expected result, dropped)
        type Case = (
            &'static str,
            usize,
            Option<usize>,
            Option<usize>,
            Option<usize>,
            Option<usize>,
            Option<usize>,
            Vec<Dropped>,
        );
        let cases: Vec<Case> = vec![
            (
                "small",
                100,
                None,
                Some(50),
                Some(60),
                Some(50),
                Some(60),
                vec![],
            ),
            (
                "at the limits",
                100,
                None,
                Some(limit),
                Some(limit),
                Some(limit),
                Some(limit),
                vec![],
            ),
            (
                "result over its limit",
                100,
                None,
                Some(50),
                Some(limit + 1),
                Some(50),
                None,
                vec![Dropped::Result { bytes: limit + 1 }],
            ),
            (
                "checkpoint over its limit keeps the old one",
                100,
                Some(40),
                Some(limit + 1),
                None,
                Some(40),
                None,
                vec![Dropped::Checkpoint { bytes: limit + 1 }],
            ),
            (
                "a large payload leaves room for the result only",
                OBJECT_BUDGET - limit - 1000,
                None,
                Some(limit),
                Some(limit),
                None,
                Some(limit),
                vec![Dropped::Checkpoint { bytes: limit }],
            ),
            (
                "a payload at the budget leaves room for neither",
                OBJECT_BUDGET,
                None,
                Some(100),
                Some(100),
                None,
                None,
                vec![
                    Dropped::Checkpoint { bytes: 100 },
                    Dropped::Result { bytes: 100 },
                ],
            ),
            (
                "an unchanged large checkpoint is not this write's doing",
                OBJECT_BUDGET,
                Some(100),
                Some(100),
                None,
                Some(100),
                None,
                vec![],
            ),
        ];
        for (what, payload, old_cp, cp, result, want_cp, want_result, want_dropped) in cases {
            let t = task(payload, old_cp);
            let (status, dropped) = fit(&t, with(cp, result));
            assert_eq!(
                status.checkpoint.as_ref().map(JsonObject::len),
                want_cp,
                "{what}: checkpoint"
            );
            assert_eq!(
                status.result.as_ref().map(JsonObject::len),
                want_result,
                "{what}: result"
            );
            assert_eq!(dropped, want_dropped, "{what}: dropped");
        }
    }
}
