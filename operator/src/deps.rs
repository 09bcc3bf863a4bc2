//! Dependencies of a task (design §5): may it run, must it wait, did a
//! dependency fail, or is it on a cycle? Pure functions over a lookup of
//! tasks by name, so they are table-tested without a server.

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;

use batchlease_api::graph::{self, Cycle, Node};
use batchlease_api::{BatchTask, TaskPhase};

/// Names listed in a condition message before "and N more".
const LISTED: usize = 5;

/// Largest dependency closure examined for a cycle. A graph this large is
/// checked in milliseconds (see `e2e/bench/RESULTS.md`); the bound only
/// keeps one reconcile from walking an unbounded namespace.
pub const MAX_CLOSURE: usize = 100_000;

/// Whether a task's dependencies let it run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Readiness {
    /// Every dependency succeeded (or there are none).
    Ready,
    /// Some dependencies do not exist yet or have not finished.
    Waiting {
        missing: Vec<String>,
        unfinished: Vec<String>,
    },
    /// Some dependencies ended without succeeding: `failed` are
    /// dead-lettered or rejected (the task cannot run unless they are
    /// redriven and succeed), `cancelled` were cancelled (final: they never
    /// will).
    Failed {
        failed: Vec<String>,
        cancelled: Vec<String>,
    },
    /// The task is on a dependency cycle: it can never run.
    Cycle(Cycle),
}

impl Readiness {
    /// The condition message naming what the task waits for.
    pub fn message(&self) -> String {
        match self {
            Self::Ready => "every dependency succeeded".into(),
            Self::Waiting {
                missing,
                unfinished,
            } => {
                let mut parts = Vec::new();
                if !unfinished.is_empty() {
                    parts.push(format!("waiting for {}", list(unfinished)));
                }
                if !missing.is_empty() {
                    parts.push(format!("missing: {}", list(missing)));
                }
                parts.join("; ")
            }
            Self::Failed { failed, cancelled } => {
                let mut parts = Vec::new();
                if !failed.is_empty() {
                    parts.push(format!(
                        "{} cannot succeed (dead-lettered or rejected); redrive it to run this task",
                        list(failed)
                    ));
                }
                if !cancelled.is_empty() {
                    parts.push(format!(
                        "{} was cancelled (final): cancel or delete this task",
                        list(cancelled)
                    ));
                }
                parts.join("; ")
            }
            Self::Cycle(c) => format!("dependency cycle: {}", describe(c, None)),
        }
    }
}

/// Tasks of a cycle named in full in a message; a longer cycle is shown
/// from `from` (the task the message is about) with its middle elided, so
/// a status or an Event (1 kB) never grows with the cycle.
const CYCLE_SHOWN: usize = 10;

/// `a → b → c → a`, or for a long cycle `x → y → … → w → x (N tasks)`
/// starting at `from`.
pub fn describe(cycle: &Cycle, from: Option<&str>) -> String {
    let n = cycle.path.len();
    if n <= CYCLE_SHOWN {
        return cycle.to_string();
    }
    let start = from
        .and_then(|f| cycle.path.iter().position(|p| p == f))
        .unwrap_or(0);
    let at = |i: usize| cycle.path[(start + i) % n].as_str();
    let head: Vec<&str> = (0..CYCLE_SHOWN - 2).map(at).collect();
    format!(
        "{} → … → {} → {} ({n} tasks)",
        head.join(" → "),
        at(n - 1),
        at(0)
    )
}

fn list(names: &[String]) -> String {
    let mut s = names
        .iter()
        .take(LISTED)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > LISTED {
        s.push_str(&format!(" and {} more", names.len() - LISTED));
    }
    s
}

/// Phase of a task as a dependency: only `Succeeded` satisfies it.
fn phase_of(t: &BatchTask) -> Option<TaskPhase> {
    t.status.as_ref().and_then(|s| s.phase)
}

/// Whether `task` may run as far as its dependencies go. `lookup` finds a
/// task of the same namespace by name (the operator's cache).
///
/// A cycle is looked for only when some dependency has not succeeded (a
/// task whose dependencies all succeeded cannot be waiting on a cycle) and
/// `check_cycles` says the graph may have changed since the task was last
/// found on none (the caller remembers; a walk of a large closure on
/// every look would cost every namespace its reconciles).
pub fn assess(
    task: &BatchTask,
    lookup: &dyn Fn(&str) -> Option<Arc<BatchTask>>,
    check_cycles: bool,
) -> Readiness {
    let mut missing = Vec::new();
    let mut unfinished = Vec::new();
    let mut failed = Vec::new();
    let mut cancelled = Vec::new();
    for name in &task.spec.depends_on {
        match lookup(name).as_deref().map(phase_of) {
            None => missing.push(name.clone()),
            Some(Some(TaskPhase::Succeeded)) => {}
            Some(Some(TaskPhase::DeadLettered | TaskPhase::Rejected)) => failed.push(name.clone()),
            Some(Some(TaskPhase::Cancelled)) => cancelled.push(name.clone()),
            Some(_) => unfinished.push(name.clone()),
        }
    }
    if missing.is_empty() && unfinished.is_empty() && failed.is_empty() && cancelled.is_empty() {
        return Readiness::Ready;
    }
    if check_cycles && let Some(cycle) = find_cycle(task, lookup) {
        return Readiness::Cycle(cycle);
    }
    if !failed.is_empty() || !cancelled.is_empty() {
        return Readiness::Failed { failed, cancelled };
    }
    Readiness::Waiting {
        missing,
        unfinished,
    }
}

/// A cycle through `task`, found with Kahn's algorithm on the part of the
/// graph a cycle through it must lie in: the tasks it depends on, directly
/// or not. Succeeded tasks are left out: an edge to a task that succeeded
/// is satisfied and blocks nobody, so only a cycle that can never make
/// progress counts (editing a finished task's `dependsOn` rejects no one).
/// `Ready` and `Running` tasks are left out too: they are past their
/// dependencies and may yet succeed; if one comes back to `Pending`, its
/// dependents are woken and look again.
pub fn find_cycle(
    task: &BatchTask,
    lookup: &dyn Fn(&str) -> Option<Arc<BatchTask>>,
) -> Option<Cycle> {
    let me = task.metadata.name.clone().unwrap_or_default();
    let mut closure: Vec<Arc<BatchTask>> = Vec::new();
    let mut seen: HashSet<String> = HashSet::from([me.clone()]);
    let mut queue: VecDeque<String> = task.spec.depends_on.iter().cloned().collect();
    while let Some(name) = queue.pop_front() {
        if closure.len() >= MAX_CLOSURE {
            break;
        }
        if !seen.insert(name.clone()) {
            continue;
        }
        let Some(t) = lookup(&name) else { continue };
        if matches!(
            phase_of(&t),
            Some(TaskPhase::Succeeded | TaskPhase::Ready | TaskPhase::Running)
        ) {
            continue;
        }
        queue.extend(t.spec.depends_on.iter().cloned());
        closure.push(t);
    }
    let mut nodes: Vec<Node<'_>> = Vec::with_capacity(closure.len() + 1);
    nodes.push(Node {
        name: &me,
        depends_on: &task.spec.depends_on,
    });
    for t in &closure {
        nodes.push(Node {
            name: t.metadata.name.as_deref().unwrap_or_default(),
            depends_on: &t.spec.depends_on,
        });
    }
    match graph::topological_order(&nodes) {
        Ok(_) => None,
        Err(unordered) if unordered.contains(&me.as_str()) => graph::cycle_through(&nodes, &me),
        Err(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use batchlease_api::{BatchTaskSpec, BatchTaskStatus};
    use std::collections::HashMap;

    fn t(name: &str, deps: &[&str], phase: Option<TaskPhase>) -> Arc<BatchTask> {
        let mut spec = BatchTaskSpec::for_queue("q");
        spec.depends_on = deps.iter().map(|s| s.to_string()).collect();
        let mut task = BatchTask::new(name, spec);
        task.status = phase.map(|p| BatchTaskStatus {
            phase: Some(p),
            ..Default::default()
        });
        Arc::new(task)
    }

    fn world(tasks: &[Arc<BatchTask>]) -> HashMap<String, Arc<BatchTask>> {
        tasks
            .iter()
            .map(|t| (t.metadata.name.clone().unwrap_or_default(), t.clone()))
            .collect()
    }

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn readiness_table() {
        use TaskPhase::*;
        let cycle = |p: &[&str]| Readiness::Cycle(Cycle { path: strings(p) });
        let cases: Vec<(&str, Vec<Arc<BatchTask>>, &str, Readiness)> = vec![
            ("no deps", vec![t("x", &[], None)], "x", Readiness::Ready),
            (
                "all succeeded",
                vec![
                    t("a", &[], Some(Succeeded)),
                    t("b", &[], Some(Succeeded)),
                    t("x", &["a", "b"], Some(Pending)),
                ],
                "x",
                Readiness::Ready,
            ),
            (
                "missing and unfinished",
                vec![
                    t("a", &[], Some(Running)),
                    t("x", &["a", "zz"], Some(Pending)),
                ],
                "x",
                Readiness::Waiting {
                    missing: strings(&["zz"]),
                    unfinished: strings(&["a"]),
                },
            ),
            (
                "a dead-lettered dependency",
                vec![
                    t("a", &[], Some(DeadLettered)),
                    t("b", &[], Some(Running)),
                    t("x", &["a", "b"], Some(Pending)),
                ],
                "x",
                Readiness::Failed {
                    failed: strings(&["a"]),
                    cancelled: vec![],
                },
            ),
            (
                "a 3-cycle",
                vec![
                    t("a", &["b"], Some(Pending)),
                    t("b", &["c"], Some(Pending)),
                    t("c", &["a"], Some(Pending)),
                ],
                "b",
                cycle(&["a", "b", "c"]),
            ),
            (
                "a cycle member already rejected is still on the cycle",
                vec![
                    t("a", &["b"], Some(Rejected)),
                    t("b", &["a"], Some(Pending)),
                ],
                "b",
                cycle(&["a", "b"]),
            ),
            (
                "depending on a cycle is not being on it",
                vec![
                    t("a", &["b"], Some(Rejected)),
                    t("b", &["a"], Some(Rejected)),
                    t("x", &["a"], Some(Pending)),
                ],
                "x",
                Readiness::Failed {
                    failed: strings(&["a"]),
                    cancelled: vec![],
                },
            ),
            (
                "depending on a cycle still being detected: waits",
                vec![
                    t("a", &["b"], Some(Pending)),
                    t("b", &["a"], Some(Pending)),
                    t("x", &["a"], Some(Pending)),
                ],
                "x",
                Readiness::Waiting {
                    missing: vec![],
                    unfinished: strings(&["a"]),
                },
            ),
            (
                "a cycle through a succeeded task blocks nobody",
                vec![
                    t("a", &["b"], Some(Succeeded)),
                    t("b", &["a"], Some(Pending)),
                ],
                "b",
                Readiness::Ready,
            ),
            (
                "a cycle through a running task is no cycle (it may succeed)",
                vec![t("a", &["b"], Some(Running)), t("b", &["a"], Some(Pending))],
                "b",
                Readiness::Waiting {
                    missing: vec![],
                    unfinished: strings(&["a"]),
                },
            ),
            (
                "a cycle closed through a missing task is no cycle yet",
                vec![t("a", &["b"], Some(Pending)), t("b", &["c"], Some(Pending))],
                "a",
                Readiness::Waiting {
                    missing: vec![],
                    unfinished: strings(&["b"]),
                },
            ),
        ];
        for (what, tasks, who, want) in cases {
            let w = world(&tasks);
            let lookup = |n: &str| w.get(n).cloned();
            let got = assess(&w[who], &lookup, true);
            assert_eq!(got, want, "{what}");
        }
    }

    #[test]
    fn messages_name_what_blocks() {
        let r = Readiness::Waiting {
            missing: strings(&["m"]),
            unfinished: strings(&["a", "b", "c", "d", "e", "f", "g"]),
        };
        assert_eq!(
            r.message(),
            "waiting for a, b, c, d, e and 2 more; missing: m"
        );
        let c = Readiness::Cycle(Cycle {
            path: strings(&["a", "b", "c"]),
        });
        assert_eq!(c.message(), "dependency cycle: a → b → c → a");
    }

    /// A cancelled dependency is named as cancelled, not as failed: it
    /// used to read "cannot succeed (dead-lettered or rejected); redrive
    /// it", and a redrive of a cancelled task is ignored.
    #[test]
    fn a_cancelled_dependency_is_said_to_be_cancelled() {
        use TaskPhase::*;
        let tasks = vec![
            t("gone", &[], Some(Cancelled)),
            t("bad", &[], Some(DeadLettered)),
            t("x", &["gone"], Some(Pending)),
            t("y", &["gone", "bad"], Some(Pending)),
        ];
        let w = world(&tasks);
        let lookup = |n: &str| w.get(n).cloned();
        let x = assess(&w["x"], &lookup, true);
        assert_eq!(
            x,
            Readiness::Failed {
                failed: vec![],
                cancelled: strings(&["gone"]),
            }
        );
        assert_eq!(
            x.message(),
            "gone was cancelled (final): cancel or delete this task"
        );
        assert!(!x.message().contains("redrive"), "{}", x.message());
        let y = assess(&w["y"], &lookup, true).message();
        assert_eq!(
            y,
            "bad cannot succeed (dead-lettered or rejected); redrive it to run this task; \
             gone was cancelled (final): cancel or delete this task"
        );
    }

    #[test]
    fn a_long_chain_is_walked_without_recursion() {
        let n = 20_000;
        let mut tasks: Vec<Arc<BatchTask>> = (1..n)
            .map(|i| {
                let dep = format!("t{}", i - 1);
                t(&format!("t{i}"), &[&dep], Some(TaskPhase::Pending))
            })
            .collect();
        // Close the ring: t0 depends on the last.
        let last = format!("t{}", n - 1);
        tasks.push(t("t0", &[&last], Some(TaskPhase::Pending)));
        let w = world(&tasks);
        let lookup = |name: &str| w.get(name).cloned();
        match assess(&w["t5"], &lookup, true) {
            Readiness::Cycle(c) => {
                assert_eq!(c.path.len(), n);
                let shown = describe(&c, Some("t5"));
                assert!(shown.starts_with("t5 → t4 → t3"), "{shown}");
                assert!(shown.ends_with("→ t6 → t5 (20000 tasks)"), "{shown}");
                assert!(shown.len() < 200, "{shown}");
            }
            other => panic!("{other:?}"),
        }
        // Not asked to check: it only waits.
        assert!(matches!(
            assess(&w["t5"], &lookup, false),
            Readiness::Waiting { .. }
        ));
    }
}
