//! The demo's `"spawn"` knob: expand the task into children, optionally
//! stopping half-way on the first attempt so a test can kill the worker
//! mid-expansion and watch the retry complete it without duplicates.

use batchlease_worker_sdk::{BatchTaskSpec, Child, JsonObject, Subgraph, TaskContext, TaskError};
use serde::Deserialize;
use serde_json::json;
use tracing::{info, warn};

/// `"spawn": {"children": n, "version": "v1", "stallAfter": k, "chain": b}`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Spawn {
    /// How many children.
    pub children: u32,
    /// The sub-graph's version (part of the children's names).
    #[serde(default = "v1")]
    pub version: String,
    /// On the first attempt, create only children `0..k`, then wait until
    /// the attempt is cancelled.
    #[serde(default)]
    pub stall_after: Option<u32>,
    /// Child i runs after child i-1.
    #[serde(default)]
    pub chain: bool,
}

fn v1() -> String {
    "v1".into()
}

/// What every child runs: a short demo task.
fn child_payload() -> serde_json::Value {
    json!({"steps": 1, "stepMillis": 50})
}

/// Children `0..upto` of the sub-graph `knob` describes, on `queue`. A
/// prefix names the same children as the whole (names depend on the
/// logical index and version only), so a cut-short expansion is completed
/// by a later full one.
pub fn subgraph(queue: &str, knob: &Spawn, upto: u32) -> Result<Subgraph, TaskError> {
    let payload = JsonObject::from_serialize(&child_payload())
        .map_err(|e| TaskError::permanent(e.to_string()))?;
    let mut graph = Subgraph::new(knob.version.clone());
    for i in 0..upto.min(knob.children) {
        let mut spec = BatchTaskSpec::for_queue(queue);
        spec.payload = Some(payload.clone());
        let child = Child::new(spec);
        graph.push(match i {
            i if knob.chain && i > 0 => child.after(i - 1),
            _ => child,
        });
    }
    Ok(graph)
}

/// Spawns the children; returns their names. On the first attempt with
/// `stallAfter: k` (k < children) it spawns `0..k` and never returns
/// normally: it waits for the kill switch.
pub async fn spawn(ctx: &TaskContext, knob: &Spawn) -> Result<Vec<String>, TaskError> {
    let stall = knob
        .stall_after
        .filter(|&k| k < knob.children && ctx.attempt() == 1);
    let upto = stall.unwrap_or(knob.children);
    let names = ctx.spawn(&subgraph(ctx.queue(), knob, upto)?).await?;
    info!(
        task = ctx.task_name(),
        token = ctx.fencing_token(),
        spawned = names.len(),
        of = knob.children,
        "children spawned"
    );
    if stall.is_some() {
        warn!(
            task = ctx.task_name(),
            token = ctx.fencing_token(),
            "stalling mid-expansion until cancelled"
        );
        ctx.cancellation().cancelled().await;
        return Err(TaskError::retryable("stalled mid-expansion").with_reason("DemoStalled"));
    }
    Ok(names)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn knob(children: u32, chain: bool) -> Spawn {
        Spawn {
            children,
            version: "v1".into(),
            stall_after: None,
            chain,
        }
    }

    #[test]
    fn children_are_chained_or_independent() {
        let cases: &[(u32, bool, u32, &[&[u32]])] = &[
            (3, false, 3, &[&[], &[], &[]]),
            (3, true, 3, &[&[], &[0], &[1]]),
            (4, true, 2, &[&[], &[0]]),
            (2, true, 9, &[&[], &[0]]),
            (0, true, 0, &[]),
        ];
        for &(n, chain, upto, want) in cases {
            let g = subgraph("demo", &knob(n, chain), upto).unwrap();
            let after: Vec<&[u32]> = g.children.iter().map(|c| c.after.as_slice()).collect();
            assert_eq!(after, want, "{n} chain={chain} upto={upto}");
            assert_eq!(g.version, "v1");
            for c in &g.children {
                assert_eq!(c.spec.queue, "demo");
                assert_eq!(
                    c.spec.payload.as_ref().unwrap().to_value().unwrap(),
                    child_payload()
                );
            }
        }
    }

    #[test]
    fn the_knob_parses_with_defaults() {
        let cases = [
            (json!({"children": 3}), knob(3, false)),
            (
                json!({"children": 2, "version": "v2", "stallAfter": 1, "chain": true}),
                Spawn {
                    children: 2,
                    version: "v2".into(),
                    stall_after: Some(1),
                    chain: true,
                },
            ),
        ];
        for (v, want) in cases {
            assert_eq!(serde_json::from_value::<Spawn>(v).unwrap(), want);
        }
    }
}
