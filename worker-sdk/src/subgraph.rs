//! A sub-graph a running task spawns (design §5, dynamic expansion): its
//! children, how they depend on each other, and every check made before
//! anything is created — so an invalid sub-graph creates nothing at all
//! rather than half of itself.
//!
//! The plan is a pure function of the parent (name, UID) and the
//! sub-graph: the same input always gives the same child names, the same
//! specs and the same creation order. That determinism is what makes a
//! retried (or zombie) parent harmless: it can only create, or find, the
//! very objects its successor creates.

use std::collections::HashSet;

use batchlease_api::graph::{self, Node};
use batchlease_api::{BatchTaskSpec, names};

/// Most children one [`Subgraph`] may have. Each child is one create
/// round trip made while the parent's lease must stay renewed, and one
/// more object in the namespace for the operator to track: a thousand is
/// seconds of creates, far inside any lease, and a bigger expansion is
/// better split over several tasks (each spawning part of it).
pub const MAX_CHILDREN: usize = 1000;

/// Most entries of a task's `spec.dependsOn` (the CRD's `maxItems`): a
/// child whose existing dependencies plus siblings exceed it would be
/// refused by the API server half-way through the expansion.
pub const MAX_DEPENDS_ON: usize = 64;

/// Children to create under the running task, all at once and idempotently
/// (see `TaskContext::spawn`).
///
/// ```
/// # use batchlease_worker_sdk::{BatchTaskSpec, Child, Subgraph};
/// let mut graph = Subgraph::new("v1");
/// let extract = graph.push(Child::new(BatchTaskSpec::for_queue("etl")));
/// let load = graph.push(Child::new(BatchTaskSpec::for_queue("etl")).after(extract));
/// // A join: runs once both are done.
/// graph.push(Child::new(BatchTaskSpec::for_queue("etl")).after(extract).after(load));
/// assert_eq!(graph.children.len(), 3);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Subgraph {
    /// Part of every child's name: the same version names the same
    /// children (a retry finds them); a new version is a new set of
    /// children, created next to the old ones.
    pub version: String,
    /// The children; a child's position is its logical index.
    pub children: Vec<Child>,
}

/// One child of a [`Subgraph`].
#[derive(Debug, Clone, PartialEq)]
pub struct Child {
    /// The child's spec. Its `dependsOn` may name existing tasks of the
    /// namespace; the siblings of `after` are appended to it.
    pub spec: BatchTaskSpec,
    /// Logical indexes of the siblings this child depends on.
    pub after: Vec<u32>,
}

impl Subgraph {
    /// An empty sub-graph of `version`.
    pub fn new(version: impl Into<String>) -> Self {
        Self {
            version: version.into(),
            children: Vec::new(),
        }
    }

    /// Adds `child`; returns its logical index (for a later child's
    /// [`Child::after`]).
    pub fn push(&mut self, child: Child) -> u32 {
        self.children.push(child);
        u32::try_from(self.children.len() - 1).unwrap_or(u32::MAX)
    }

    /// Adds `child` (builder style).
    #[must_use]
    pub fn child(mut self, child: Child) -> Self {
        self.push(child);
        self
    }
}

impl Child {
    /// A child running `spec`, depending on no sibling.
    pub fn new(spec: BatchTaskSpec) -> Self {
        Self {
            spec,
            after: Vec::new(),
        }
    }

    /// Runs only after the sibling with logical index `sibling` succeeded.
    #[must_use]
    pub fn after(mut self, sibling: u32) -> Self {
        self.after.push(sibling);
        self
    }
}

/// Why a sub-graph cannot be spawned. Nothing was created.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubgraphError {
    /// More than [`MAX_CHILDREN`] children.
    #[error("{count} children; at most {MAX_CHILDREN} may be spawned at once")]
    TooManyChildren { count: usize },
    /// `after` names an index past the last child.
    #[error("child {child} is after sibling {after}, but there are only {count} children")]
    NoSuchSibling {
        child: u32,
        after: u32,
        count: usize,
    },
    /// `after` names the child itself.
    #[error("child {child} is after itself")]
    AfterItself { child: u32 },
    /// The siblings depend on each other in a loop (logical indexes,
    /// arrows read "depends on").
    #[error("the children form a cycle: {cycle}")]
    Cycle { cycle: String },
    /// The same name twice in a child's final `dependsOn` (its own
    /// `dependsOn` plus its siblings): the API server refuses duplicates.
    #[error("child {child} would depend on {name} twice")]
    DuplicateDependency { child: u32, name: String },
    /// A child's final `dependsOn` names the child itself.
    #[error("child {child} would depend on itself ({name})")]
    DependsOnItself { child: u32, name: String },
    /// A child's final `dependsOn` is longer than [`MAX_DEPENDS_ON`].
    #[error("child {child} would depend on {count} tasks; at most {MAX_DEPENDS_ON}")]
    TooManyDependencies { child: u32, count: usize },
}

/// One child as it will be created.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PlannedChild {
    pub name: String,
    /// The child's spec with its final `dependsOn`.
    pub spec: BatchTaskSpec,
}

/// A checked sub-graph: the children in logical order, and the order to
/// create them in (every child after the siblings it depends on, so no
/// child ever names a sibling that does not exist yet).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Plan {
    pub children: Vec<PlannedChild>,
    pub create_order: Vec<usize>,
}

/// Checks `subgraph` and names its children under the parent `parent`
/// with UID `parent_uid`.
pub(crate) fn plan(
    parent: &str,
    parent_uid: &str,
    subgraph: &Subgraph,
) -> Result<Plan, SubgraphError> {
    let count = subgraph.children.len();
    if count > MAX_CHILDREN {
        return Err(SubgraphError::TooManyChildren { count });
    }
    for (child, c) in (0u32..).zip(&subgraph.children) {
        for &after in &c.after {
            if after == child {
                return Err(SubgraphError::AfterItself { child });
            }
            if usize::try_from(after).unwrap_or(usize::MAX) >= count {
                return Err(SubgraphError::NoSuchSibling {
                    child,
                    after,
                    count,
                });
            }
        }
    }
    let create_order = creation_order(subgraph)?;
    let names: Vec<String> = (0u32..)
        .take(count)
        .map(|i| names::child_name(parent, parent_uid, i, &subgraph.version))
        .collect();
    let mut children = Vec::with_capacity(count);
    for ((child, c), name) in (0u32..).zip(&subgraph.children).zip(&names) {
        let mut spec = c.spec.clone();
        // Indexes were checked against `count` above.
        spec.depends_on.extend(
            c.after
                .iter()
                .filter_map(|&a| names.get(a as usize))
                .cloned(),
        );
        check_depends_on(child, name, &spec.depends_on)?;
        children.push(PlannedChild {
            name: name.clone(),
            spec,
        });
    }
    Ok(Plan {
        children,
        create_order,
    })
}

/// Kahn's algorithm over the siblings (nodes named by logical index):
/// dependencies first, or the cycle that makes that impossible.
fn creation_order(subgraph: &Subgraph) -> Result<Vec<usize>, SubgraphError> {
    let labels: Vec<String> = (0..subgraph.children.len())
        .map(|i| i.to_string())
        .collect();
    let edges: Vec<Vec<String>> = subgraph
        .children
        .iter()
        .map(|c| c.after.iter().map(u32::to_string).collect())
        .collect();
    let nodes: Vec<Node<'_>> = labels
        .iter()
        .zip(&edges)
        .map(|(name, depends_on)| Node { name, depends_on })
        .collect();
    match graph::topological_order(&nodes) {
        Ok(order) => Ok(order.iter().filter_map(|l| l.parse().ok()).collect()),
        Err(_) => {
            let cycle = graph::find_cycles(&nodes)
                .first()
                .map_or_else(|| "(unnamed)".to_owned(), ToString::to_string);
            Err(SubgraphError::Cycle { cycle })
        }
    }
}

/// The checks the API server would make on a child's `dependsOn` (and
/// refuse mid-expansion), made before anything is created.
fn check_depends_on(child: u32, name: &str, depends_on: &[String]) -> Result<(), SubgraphError> {
    if depends_on.len() > MAX_DEPENDS_ON {
        return Err(SubgraphError::TooManyDependencies {
            child,
            count: depends_on.len(),
        });
    }
    let mut seen = HashSet::with_capacity(depends_on.len());
    for d in depends_on {
        if d == name {
            return Err(SubgraphError::DependsOnItself {
                child,
                name: d.clone(),
            });
        }
        if !seen.insert(d.as_str()) {
            return Err(SubgraphError::DuplicateDependency {
                child,
                name: d.clone(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn spec() -> BatchTaskSpec {
        BatchTaskSpec::for_queue("q")
    }

    fn graph(edges: &[&[u32]]) -> Subgraph {
        Subgraph {
            version: "v1".into(),
            children: edges
                .iter()
                .map(|after| Child {
                    spec: spec(),
                    after: after.to_vec(),
                })
                .collect(),
        }
    }

    fn name(i: u32) -> String {
        names::child_name("p", "uid", i, "v1")
    }

    #[test]
    fn invalid_subgraphs_are_refused_before_anything_is_created() {
        let too_many = Subgraph {
            version: "v".into(),
            children: vec![Child::new(spec()); MAX_CHILDREN + 1],
        };
        let sixty_four: Vec<String> = (0..64).map(|i| format!("t{i}")).collect();
        let mut crowded = graph(&[&[], &[0]]);
        crowded.children[1].spec.depends_on = sixty_four.clone();
        let mut dup = graph(&[&[], &[0]]);
        dup.children[1].spec.depends_on = vec![name(0)];
        let mut dup_existing = graph(&[&[]]);
        dup_existing.children[0].spec.depends_on = vec!["a".into(), "a".into()];
        let mut itself = graph(&[&[]]);
        itself.children[0].spec.depends_on = vec![name(0)];
        let cases: Vec<(&str, Subgraph, SubgraphError)> = vec![
            (
                "too many children",
                too_many,
                SubgraphError::TooManyChildren { count: 1001 },
            ),
            (
                "index out of range",
                graph(&[&[], &[2]]),
                SubgraphError::NoSuchSibling {
                    child: 1,
                    after: 2,
                    count: 2,
                },
            ),
            (
                "after itself",
                graph(&[&[0]]),
                SubgraphError::AfterItself { child: 0 },
            ),
            (
                "two-cycle",
                graph(&[&[1], &[0]]),
                SubgraphError::Cycle {
                    cycle: "0 → 1 → 0".into(),
                },
            ),
            (
                "cycle behind a valid prefix",
                graph(&[&[], &[0, 3], &[1], &[2]]),
                SubgraphError::Cycle {
                    cycle: "1 → 3 → 2 → 1".into(),
                },
            ),
            (
                "siblings push dependsOn past 64",
                crowded,
                SubgraphError::TooManyDependencies {
                    child: 1,
                    count: 65,
                },
            ),
            (
                "a sibling named twice",
                dup,
                SubgraphError::DuplicateDependency {
                    child: 1,
                    name: name(0),
                },
            ),
            (
                "an existing task named twice",
                dup_existing,
                SubgraphError::DuplicateDependency {
                    child: 0,
                    name: "a".into(),
                },
            ),
            (
                "depends on its own name",
                itself,
                SubgraphError::DependsOnItself {
                    child: 0,
                    name: name(0),
                },
            ),
        ];
        for (what, g, want) in cases {
            assert_eq!(plan("p", "uid", &g), Err(want), "{what}");
        }
        // Exactly 64 is fine.
        let mut full = graph(&[&[]]);
        full.children[0].spec.depends_on = sixty_four;
        assert!(plan("p", "uid", &full).is_ok());
        assert_eq!(
            plan("p", "uid", &Subgraph::new("v")).unwrap().children,
            vec![]
        );
    }

    #[test]
    fn children_are_named_deterministically_and_created_dependencies_first() {
        // 0 ← 2, 1 ← 0: logical order differs from creation order.
        let mut g = graph(&[&[1], &[], &[0, 1]]);
        g.children[2].spec.depends_on = vec!["existing".into()];
        let p = plan("p", "uid", &g).unwrap();
        let names: Vec<&str> = p.children.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, [name(0), name(1), name(2)]);
        assert_eq!(p.create_order, [1, 0, 2]);
        // Existing names first, then siblings in `after` order.
        assert_eq!(p.children[0].spec.depends_on, [name(1)]);
        assert!(p.children[1].spec.depends_on.is_empty());
        assert_eq!(
            p.children[2].spec.depends_on,
            ["existing".to_owned(), name(0), name(1)]
        );
        assert_eq!(p, plan("p", "uid", &g).unwrap(), "deterministic");
        // A prefix of the sub-graph names the same children: an expansion
        // cut short is completed, not duplicated, by the full one.
        let prefix = Subgraph {
            version: g.version.clone(),
            children: g.children[..2].to_vec(),
        };
        let q = plan("p", "uid", &prefix).unwrap();
        assert_eq!(q.children[..], p.children[..2]);
    }

    #[test]
    fn the_builder_returns_logical_indexes() {
        let mut g = Subgraph::new("v2");
        let a = g.push(Child::new(spec()));
        let b = g.push(Child::new(spec()).after(a));
        let g = g.child(Child::new(spec()).after(a).after(b));
        assert_eq!((a, b), (0, 1));
        assert_eq!(g.children[2].after, [0, 1]);
    }
}
