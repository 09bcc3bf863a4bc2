//! Dependency-graph algorithms over task names, shared by the operator
//! (run-time cycle detection among BatchTasks) and the worker SDK (checking a
//! spawned sub-graph before it is created).
//!
//! They are pure functions of a slice of [`Node`]s so both callers can feed
//! them whatever they hold (listed objects, a builder's in-memory tasks) and
//! so they are table-tested without a cluster.
//!
//! Everything is iterative: a user may chain 10,000+ tasks, and a recursive
//! depth-first search needs a stack frame per task of the chain, which can
//! overflow a thread's stack (2 MiB for a Tokio worker; the tests run the
//! 10,000-task graphs on 256 KiB). Time is linear in nodes plus edges, up to
//! a logarithmic factor from the sorting that makes results deterministic (the same graph always gives the same order
//! and the same cycles, whatever order the objects were listed in, so status
//! messages and events do not flap between reconciles).
//!
//! Names are matched exactly. Edges to names that are not in the slice are
//! ignored: a missing task blocks its dependents, but it is not part of any
//! cycle. When a name appears more than once, the first node wins and the
//! later ones are ignored with their edges — callers pass objects of one
//! namespace, where names are unique, so a duplicate is a caller's mistake
//! that must not make the answer depend on which copy is seen last.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::fmt;

/// One task: its name and the names it depends on. Edges to names that are not
/// in the slice are ignored (a missing task is not part of any cycle).
#[derive(Debug, Clone, Copy)]
pub struct Node<'a> {
    /// The task's name.
    pub name: &'a str,
    /// Names of the tasks it depends on (BatchTask `spec.dependsOn`).
    pub depends_on: &'a [String],
}

/// A dependency cycle. `path[0]` is the smallest name on the cycle (so the same
/// cycle always prints the same way); `path[i]` depends on `path[i+1]` and the
/// last depends on `path[0]`. Display: "a → b → c → a" (arrows read "depends on").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cycle {
    /// The names on the cycle, each depending on the next, starting at the
    /// smallest.
    pub path: Vec<String>,
}

impl fmt::Display for Cycle {
    /// The path with its first name repeated at the end, so a reader sees the
    /// loop close: "a → b → a"; a self-dependency prints as "a → a".
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some(first) = self.path.first() else {
            return Ok(());
        };
        for name in &self.path {
            write!(f, "{name} → ")?;
        }
        f.write_str(first)
    }
}

/// Kahn's algorithm. Ok: every name, dependencies before dependents (ties broken
/// by name, so deterministic). Err: the names Kahn could not order (sorted):
/// those on a cycle and those that depend on one, directly or not.
///
/// Each distinct name appears once (see the module docs on duplicates).
/// O((V + E) log V).
pub fn topological_order<'a>(nodes: &[Node<'a>]) -> Result<Vec<&'a str>, Vec<&'a str>> {
    let graph = Graph::new(nodes);
    let (order, ordered) = graph.kahn();
    if order.len() == graph.len() {
        return Ok(order.into_iter().map(|i| graph.names[i]).collect());
    }
    let mut stuck: Vec<&'a str> = (0..graph.len())
        .filter(|&i| !ordered[i])
        .map(|i| graph.names[i])
        .collect();
    stuck.sort_unstable();
    Err(stuck)
}

/// A shortest cycle through `name` (BFS along depends_on edges back to `name`),
/// or None when `name` is on no cycle. A self-dependency is the cycle "a → a".
/// O(V + E).
///
/// Among several shortest cycles the one found first wins; dependencies are
/// visited in name order, so the choice does not depend on the order of the
/// slice or of `depends_on`.
///
/// Each call indexes the whole slice: to check every node of a graph, call
/// [`topological_order`] or [`find_cycles`] once instead of this per node.
pub fn cycle_through(nodes: &[Node<'_>], name: &str) -> Option<Cycle> {
    let graph = Graph::new(nodes);
    let start = *graph.index.get(name)?;
    let mut bfs = Bfs::new(graph.len());
    bfs.shortest_cycle(&graph, start, |_| true)
        .map(|path| graph.cycle(path))
}

/// One cycle per strongly connected component that contains a cycle (iterative
/// Tarjan on what Kahn left — no recursion: graphs may have 10,000+ nodes in a
/// chain), sorted by path. Empty iff the graph is acyclic.
///
/// The cycle reported for a component is a shortest cycle through its
/// smallest name: one line a user can read and break, rather than every
/// elementary cycle (there can be exponentially many). Breaking it may leave
/// another cycle in the same component; the next check reports that one.
pub fn find_cycles(nodes: &[Node<'_>]) -> Vec<Cycle> {
    let graph = Graph::new(nodes);
    let (_, ordered) = graph.kahn();
    // Kahn removed every node that is on no cycle and depends on none; only
    // what is left can be in a cyclic component.
    let (components, component_of) = graph.tarjan(&ordered);
    let mut bfs = Bfs::new(graph.len());
    let mut cycles: Vec<Cycle> = components
        .iter()
        .enumerate()
        .filter_map(|(id, members)| {
            // Tarjan emits no empty component; `?` keeps that assumption
            // from becoming a panic.
            let smallest = *members.iter().min_by_key(|&&i| graph.names[i])?;
            // Every cycle through `smallest` stays inside its component, so
            // the search never leaves it: the work over all components
            // together stays linear.
            bfs.shortest_cycle(&graph, smallest, |j| component_of[j] == id)
                .map(|path| graph.cycle(path))
        })
        .collect();
    cycles.sort_unstable_by(|a, b| a.path.cmp(&b.path));
    cycles
}

/// The graph with names replaced by indices: index `i` is the `i`th distinct
/// name in slice order, `deps[i]` its known dependencies (deduplicated, in
/// name order).
#[derive(Debug)]
struct Graph<'a> {
    names: Vec<&'a str>,
    index: HashMap<&'a str, usize>,
    deps: Vec<Vec<usize>>,
}

impl<'a> Graph<'a> {
    fn new(nodes: &[Node<'a>]) -> Self {
        let mut names = Vec::with_capacity(nodes.len());
        let mut index = HashMap::with_capacity(nodes.len());
        let mut firsts = Vec::with_capacity(nodes.len());
        for node in nodes {
            if !index.contains_key(node.name) {
                index.insert(node.name, names.len());
                names.push(node.name);
                firsts.push(node);
            }
        }
        let deps = firsts
            .iter()
            .map(|node| {
                let mut deps: Vec<usize> = node
                    .depends_on
                    .iter()
                    .filter_map(|dep| index.get(dep.as_str()).copied())
                    .collect();
                deps.sort_unstable_by_key(|&j| names[j]);
                deps.dedup();
                deps
            })
            .collect();
        Graph { names, index, deps }
    }

    fn len(&self) -> usize {
        self.names.len()
    }

    /// Kahn's algorithm with a min-heap by name: the order, and which nodes
    /// made it into the order.
    fn kahn(&self) -> (Vec<usize>, Vec<bool>) {
        let n = self.len();
        let mut dependents = vec![Vec::new(); n];
        for (i, deps) in self.deps.iter().enumerate() {
            for &j in deps {
                dependents[j].push(i);
            }
        }
        let mut waiting: Vec<usize> = self.deps.iter().map(Vec::len).collect();
        let mut ready: BinaryHeap<Reverse<(&str, usize)>> = (0..n)
            .filter(|&i| waiting[i] == 0)
            .map(|i| Reverse((self.names[i], i)))
            .collect();
        let mut order = Vec::with_capacity(n);
        let mut ordered = vec![false; n];
        while let Some(Reverse((_, i))) = ready.pop() {
            order.push(i);
            ordered[i] = true;
            for &d in &dependents[i] {
                waiting[d] -= 1;
                if waiting[d] == 0 {
                    ready.push(Reverse((self.names[d], d)));
                }
            }
        }
        (order, ordered)
    }

    /// Iterative Tarjan over the nodes Kahn could not order (`skip[i]` true
    /// for the others): the strongly connected components that contain a
    /// cycle — more than one node, or one node depending on itself — and
    /// for each node the position of its component in that list
    /// (`usize::MAX` for none).
    fn tarjan(&self, skip: &[bool]) -> (Vec<Vec<usize>>, Vec<usize>) {
        const UNSEEN: usize = usize::MAX;
        let n = self.len();
        let mut index = vec![UNSEEN; n];
        let mut low = vec![0; n];
        let mut on_stack = vec![false; n];
        let mut stack = Vec::new();
        // The explicit call stack: (node, position of its next dependency).
        let mut calls: Vec<(usize, usize)> = Vec::new();
        let mut next_index = 0;
        let mut components = Vec::new();
        let mut component_of = vec![usize::MAX; n];
        for root in 0..n {
            if skip[root] || index[root] != UNSEEN {
                continue;
            }
            index[root] = next_index;
            low[root] = next_index;
            next_index += 1;
            stack.push(root);
            on_stack[root] = true;
            calls.push((root, 0));
            while let Some(&mut (v, ref mut pos)) = calls.last_mut() {
                if let Some(&w) = self.deps[v].get(*pos) {
                    *pos += 1;
                    if skip[w] {
                        continue;
                    }
                    if index[w] == UNSEEN {
                        index[w] = next_index;
                        low[w] = next_index;
                        next_index += 1;
                        stack.push(w);
                        on_stack[w] = true;
                        calls.push((w, 0));
                    } else if on_stack[w] {
                        low[v] = low[v].min(index[w]);
                    }
                    continue;
                }
                // All of v's dependencies are done: return from v.
                calls.pop();
                if let Some(&(parent, _)) = calls.last() {
                    low[parent] = low[parent].min(low[v]);
                }
                if low[v] != index[v] {
                    continue;
                }
                let mut members = Vec::new();
                while let Some(w) = stack.pop() {
                    on_stack[w] = false;
                    members.push(w);
                    if w == v {
                        break;
                    }
                }
                let cyclic = members.len() > 1 || self.deps[v].contains(&v);
                if cyclic {
                    for &w in &members {
                        component_of[w] = components.len();
                    }
                    components.push(members);
                }
            }
        }
        (components, component_of)
    }

    /// The cycle of the given indices, rotated to start at its smallest name.
    fn cycle(&self, mut path: Vec<usize>) -> Cycle {
        let smallest = path
            .iter()
            .enumerate()
            .min_by_key(|&(_, &i)| self.names[i])
            .map_or(0, |(pos, _)| pos);
        path.rotate_left(smallest);
        Cycle {
            path: path.into_iter().map(|i| self.names[i].to_owned()).collect(),
        }
    }
}

/// Breadth-first search state, reusable across searches so that many small
/// searches (one per component) cost their own size, not V each.
#[derive(Debug)]
struct Bfs {
    /// `seen[i] == epoch`: visited in the current search.
    seen: Vec<u32>,
    epoch: u32,
    parent: Vec<usize>,
    queue: VecDeque<usize>,
}

impl Bfs {
    fn new(n: usize) -> Self {
        Bfs {
            seen: vec![0; n],
            epoch: 0,
            parent: vec![0; n],
            queue: VecDeque::new(),
        }
    }

    /// A shortest cycle through `start` using only nodes `allowed` (and
    /// `start`), as indices from `start` along depends_on edges.
    ///
    /// Nodes leave the queue in order of distance from `start`, so the first
    /// one with an edge back to `start` closes a shortest cycle.
    fn shortest_cycle(
        &mut self,
        graph: &Graph<'_>,
        start: usize,
        allowed: impl Fn(usize) -> bool,
    ) -> Option<Vec<usize>> {
        self.epoch = self.epoch.wrapping_add(1);
        if self.epoch == 0 {
            // Wrapped after 2^32 searches: old marks could alias; clear them.
            self.seen.fill(0);
            self.epoch = 1;
        }
        self.queue.clear();
        self.seen[start] = self.epoch;
        self.queue.push_back(start);
        while let Some(u) = self.queue.pop_front() {
            for &w in &graph.deps[u] {
                if w == start {
                    let mut path = vec![u];
                    let mut at = u;
                    while at != start {
                        at = self.parent[at];
                        path.push(at);
                    }
                    path.reverse();
                    return Some(path);
                }
                if self.seen[w] != self.epoch && allowed(w) {
                    self.seen[w] = self.epoch;
                    self.parent[w] = u;
                    self.queue.push_back(w);
                }
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A graph written as (name, depends on).
    type Spec = &'static [(&'static str, &'static [&'static str])];

    /// Owned dependency lists, so that [`Node`]s can borrow them.
    fn owned(spec: &[(&str, &[&str])]) -> Vec<(String, Vec<String>)> {
        spec.iter()
            .map(|(name, deps)| {
                let deps = deps.iter().map(|d| (*d).to_owned()).collect();
                ((*name).to_owned(), deps)
            })
            .collect()
    }

    fn nodes(owned: &[(String, Vec<String>)]) -> Vec<Node<'_>> {
        owned
            .iter()
            .map(|(name, deps)| Node {
                name,
                depends_on: deps,
            })
            .collect()
    }

    struct Case {
        what: &'static str,
        graph: Spec,
        /// `topological_order`: Ok(order) or Err(unordered names).
        order: Result<&'static [&'static str], &'static [&'static str]>,
        /// `find_cycles`, as displayed.
        cycles: &'static [&'static str],
        /// `cycle_through(name)`, as displayed.
        through: &'static [(&'static str, Option<&'static str>)],
    }

    fn cases() -> Vec<Case> {
        vec![
            Case {
                what: "empty graph",
                graph: &[],
                order: Ok(&[]),
                cycles: &[],
                through: &[("a", None)],
            },
            Case {
                what: "chain",
                graph: &[("a", &["b"]), ("b", &["c"]), ("c", &[])],
                order: Ok(&["c", "b", "a"]),
                cycles: &[],
                through: &[("a", None), ("b", None), ("c", None)],
            },
            Case {
                what: "diamond",
                graph: &[
                    ("top", &["right", "left"]),
                    ("left", &["bottom"]),
                    ("right", &["bottom"]),
                    ("bottom", &[]),
                ],
                order: Ok(&["bottom", "left", "right", "top"]),
                cycles: &[],
                through: &[("top", None), ("bottom", None)],
            },
            Case {
                what: "independent nodes: ties broken by name, not slice order",
                graph: &[("z", &[]), ("y", &[]), ("x", &[])],
                order: Ok(&["x", "y", "z"]),
                cycles: &[],
                through: &[("x", None)],
            },
            Case {
                what: "3-cycle, listed from its middle",
                graph: &[("c", &["a"]), ("a", &["b"]), ("b", &["c"])],
                order: Err(&["a", "b", "c"]),
                cycles: &["a → b → c → a"],
                through: &[
                    ("a", Some("a → b → c → a")),
                    ("b", Some("a → b → c → a")),
                    ("c", Some("a → b → c → a")),
                ],
            },
            Case {
                what: "self-loop",
                graph: &[("a", &["a"]), ("b", &[])],
                order: Err(&["a"]),
                cycles: &["a → a"],
                through: &[("a", Some("a → a")), ("b", None)],
            },
            Case {
                what: "two disjoint cycles",
                graph: &[
                    ("y", &["z"]),
                    ("x", &["y"]),
                    ("z", &["x"]),
                    ("b", &["a"]),
                    ("a", &["b"]),
                ],
                order: Err(&["a", "b", "x", "y", "z"]),
                cycles: &["a → b → a", "x → y → z → x"],
                through: &[("a", Some("a → b → a")), ("z", Some("x → y → z → x"))],
            },
            Case {
                what: "a node that only depends on a cycle",
                graph: &[("d", &["a"]), ("a", &["b"]), ("b", &["a"])],
                order: Err(&["a", "b", "d"]),
                cycles: &["a → b → a"],
                through: &[("d", None), ("a", Some("a → b → a"))],
            },
            Case {
                what: "a cycle plus a tail it depends on",
                graph: &[
                    ("a", &["b"]),
                    ("b", &["c"]),
                    ("c", &["a", "t1"]),
                    ("t1", &["t2"]),
                    ("t2", &[]),
                ],
                order: Err(&["a", "b", "c"]),
                cycles: &["a → b → c → a"],
                through: &[("t1", None), ("t2", None), ("c", Some("a → b → c → a"))],
            },
            Case {
                what: "edges to missing names are ignored",
                graph: &[("a", &["missing", "b"]), ("b", &["gone"])],
                order: Ok(&["b", "a"]),
                cycles: &[],
                through: &[("a", None), ("missing", None)],
            },
            Case {
                what: "overlapping cycles in one SCC",
                // a → b → a, a → c → d → a and b → c → d → a → b.
                graph: &[
                    ("a", &["b", "c"]),
                    ("b", &["a", "c"]),
                    ("c", &["d"]),
                    ("d", &["a"]),
                ],
                order: Err(&["a", "b", "c", "d"]),
                cycles: &["a → b → a"],
                through: &[
                    ("a", Some("a → b → a")),
                    ("b", Some("a → b → a")),
                    ("c", Some("a → c → d → a")),
                    ("d", Some("a → c → d → a")),
                ],
            },
            Case {
                what: "two shortest cycles: dependencies visited in name order",
                graph: &[("a", &["c", "b"]), ("c", &["a"]), ("b", &["a"])],
                order: Err(&["a", "b", "c"]),
                cycles: &["a → b → a"],
                through: &[("a", Some("a → b → a")), ("c", Some("a → c → a"))],
            },
            Case {
                what: "duplicate names: the first wins, the second's edges are ignored",
                graph: &[("a", &["b"]), ("b", &[]), ("a", &["a"]), ("b", &["a"])],
                order: Ok(&["b", "a"]),
                cycles: &[],
                through: &[("a", None), ("b", None)],
            },
            Case {
                what: "duplicate dependency",
                graph: &[("a", &["b", "b"]), ("b", &[])],
                order: Ok(&["b", "a"]),
                cycles: &[],
                through: &[("a", None)],
            },
            Case {
                what: "self-loop and a 2-cycle sharing a node: one SCC",
                graph: &[("a", &["a", "b"]), ("b", &["a"])],
                order: Err(&["a", "b"]),
                cycles: &["a → a"],
                through: &[("a", Some("a → a")), ("b", Some("a → b → a"))],
            },
        ]
    }

    #[test]
    fn table() {
        for case in cases() {
            let owned = owned(case.graph);
            let nodes = nodes(&owned);
            let what = case.what;

            let order = topological_order(&nodes);
            let want = case.order.map(<[_]>::to_vec).map_err(<[_]>::to_vec);
            assert_eq!(order, want, "{what}: topological_order");

            let cycles: Vec<String> = find_cycles(&nodes).iter().map(Cycle::to_string).collect();
            assert_eq!(cycles, case.cycles, "{what}: find_cycles");
            assert_eq!(
                cycles.is_empty(),
                order.is_ok(),
                "{what}: find_cycles is empty iff Kahn orders everything"
            );

            for (name, want) in case.through {
                let got = cycle_through(&nodes, name).map(|c| c.to_string());
                assert_eq!(got.as_deref(), *want, "{what}: cycle_through({name})");
            }
        }
    }

    /// Every cycle returned is a real cycle of the graph, starting at its
    /// smallest name.
    #[test]
    fn cycles_are_real_and_canonical() {
        for case in cases() {
            let owned = owned(case.graph);
            let nodes = nodes(&owned);
            let mut all = find_cycles(&nodes);
            all.extend(
                case.graph
                    .iter()
                    .filter_map(|(name, _)| cycle_through(&nodes, name)),
            );
            for cycle in all {
                assert_cycle(&nodes, &cycle, case.what);
            }
        }
    }

    fn assert_cycle(nodes: &[Node<'_>], cycle: &Cycle, what: &str) {
        let deps = |name: &str| {
            nodes
                .iter()
                .find(|n| n.name == name)
                .map(|n| n.depends_on)
                .unwrap_or_default()
        };
        let path = &cycle.path;
        assert!(!path.is_empty(), "{what}: empty cycle");
        assert_eq!(
            path.iter().min(),
            path.first(),
            "{what}: {cycle} not rotated"
        );
        for (i, name) in path.iter().enumerate() {
            let next = &path[(i + 1) % path.len()];
            assert!(
                deps(name).contains(next),
                "{what}: {cycle}: {name} does not depend on {next}"
            );
        }
    }

    #[test]
    fn display() {
        let cycle = |p: &[&str]| Cycle {
            path: p.iter().map(|s| (*s).to_owned()).collect(),
        };
        assert_eq!(cycle(&["a", "b", "c"]).to_string(), "a → b → c → a");
        assert_eq!(cycle(&["a"]).to_string(), "a → a");
        assert_eq!(cycle(&[]).to_string(), "");
    }

    /// Small pseudo-random graphs against an independent brute force
    /// (Floyd–Warshall distances): what is unordered, who is on a cycle, how
    /// long the shortest cycle through each node is, how many cyclic
    /// components there are.
    #[test]
    fn agrees_with_brute_force() {
        const N: usize = 6;
        const FAR: usize = usize::MAX / 4;
        let names = ["a", "b", "c", "d", "e", "f"];
        // A fixed linear congruential generator: the same graphs every run.
        let mut seed: u64 = 0x5eed;
        let mut next = move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            seed >> 33
        };
        for round in 0..2_000 {
            let n = 1 + (round % N);
            let mut spec: Vec<(&str, Vec<&str>)> = Vec::new();
            let mut dist = [[FAR; N]; N];
            for (i, name) in names.iter().enumerate().take(n) {
                let mut deps = Vec::new();
                for (j, dep) in names.iter().enumerate().take(n) {
                    if next() % 4 == 0 {
                        deps.push(*dep);
                        dist[i][j] = 1;
                    }
                }
                spec.push((name, deps));
            }
            for k in 0..n {
                for i in 0..n {
                    for j in 0..n {
                        dist[i][j] = dist[i][j].min(dist[i][k] + dist[k][j]);
                    }
                }
            }
            let on_cycle = |v: usize| dist[v][v] < FAR;
            let owned = owned(
                &spec
                    .iter()
                    .map(|(n, d)| (*n, d.as_slice()))
                    .collect::<Vec<_>>(),
            );
            let nodes = nodes(&owned);
            let what = format!("round {round}: {spec:?}");

            // Unordered: exactly the nodes that reach a cycle (or are on one).
            let stuck: Vec<&str> = (0..n)
                .filter(|&v| (0..n).any(|u| on_cycle(u) && (u == v || dist[v][u] < FAR)))
                .map(|v| names[v])
                .collect();
            match topological_order(&nodes) {
                Ok(order) => {
                    assert!(stuck.is_empty(), "{what}: ordered {order:?}");
                    assert_eq!(order.len(), n, "{what}");
                    for (pos, name) in order.iter().enumerate() {
                        for dep in &spec[names.iter().position(|x| x == name).unwrap_or(0)].1 {
                            assert!(order[..pos].contains(dep), "{what}: {name} before {dep}");
                        }
                    }
                }
                Err(got) => assert_eq!(got, stuck, "{what}"),
            }

            for v in 0..n {
                let got = cycle_through(&nodes, names[v]);
                let want = on_cycle(v).then_some(dist[v][v]);
                assert_eq!(
                    got.as_ref().map(|c| c.path.len()),
                    want,
                    "{what}: {}",
                    names[v]
                );
                if let Some(cycle) = got {
                    assert!(cycle.path.iter().any(|x| x == names[v]), "{what}: {cycle}");
                    assert_cycle(&nodes, &cycle, &what);
                }
            }

            // One cycle per cyclic component, each through its smallest node.
            let smallest_of_components: Vec<usize> = (0..n)
                .filter(|&v| on_cycle(v) && (0..v).all(|u| dist[u][v] >= FAR || dist[v][u] >= FAR))
                .collect();
            let cycles = find_cycles(&nodes);
            assert_eq!(
                cycles.len(),
                smallest_of_components.len(),
                "{what}: {cycles:?}"
            );
            for (cycle, v) in cycles.iter().zip(&smallest_of_components) {
                assert_eq!(
                    cycle.path.first().map(String::as_str),
                    Some(names[*v]),
                    "{what}"
                );
                assert_eq!(cycle.path.len(), dist[*v][*v], "{what}: {cycle}");
                assert_cycle(&nodes, cycle, &what);
            }
        }
    }

    const BIG: usize = 10_000;

    fn name(i: usize) -> String {
        format!("n{i:05}")
    }

    /// `n00000` depends on `n00001`, … up to `n09999`, which depends on
    /// `close` (if any).
    fn chain(close: Option<usize>) -> Vec<(String, Vec<String>)> {
        (0..BIG)
            .map(|i| {
                let next = if i + 1 < BIG { Some(i + 1) } else { close };
                (name(i), next.map(name).into_iter().collect())
            })
            .collect()
    }

    /// Deep graphs run on a small stack: a recursive search would overflow.
    fn on_small_stack(f: impl FnOnce() + Send + 'static) {
        std::thread::Builder::new()
            .stack_size(256 * 1024)
            .spawn(f)
            .unwrap()
            .join()
            .unwrap();
    }

    #[test]
    fn chain_of_10000() {
        on_small_stack(|| {
            let owned = chain(None);
            let nodes = nodes(&owned);
            let order = topological_order(&nodes).unwrap();
            let want: Vec<String> = (0..BIG).rev().map(name).collect();
            assert_eq!(order, want);
            assert!(find_cycles(&nodes).is_empty());
            assert_eq!(cycle_through(&nodes, &name(0)), None);
            assert_eq!(cycle_through(&nodes, &name(BIG - 1)), None);
        });
    }

    #[test]
    fn ring_of_10000() {
        on_small_stack(|| {
            let owned = chain(Some(0));
            let nodes = nodes(&owned);
            let all: Vec<String> = (0..BIG).map(name).collect();
            assert_eq!(topological_order(&nodes).unwrap_err(), all);
            let want = Cycle { path: all };
            assert_eq!(find_cycles(&nodes), vec![want.clone()]);
            assert_eq!(cycle_through(&nodes, &name(5_000)), Some(want));
        });
    }

    /// A 10,000-node chain hanging off a 2-cycle at its far end: Kahn
    /// orders nothing, so Tarjan walks the whole chain depth first.
    #[test]
    fn chain_of_10000_depending_on_a_cycle() {
        on_small_stack(|| {
            let owned = chain(Some(BIG - 2));
            let nodes = nodes(&owned);
            let all: Vec<String> = (0..BIG).map(name).collect();
            assert_eq!(topological_order(&nodes).unwrap_err(), all);
            let cycles: Vec<String> = find_cycles(&nodes).iter().map(Cycle::to_string).collect();
            assert_eq!(cycles, ["n09998 → n09999 → n09998"]);
            assert_eq!(cycle_through(&nodes, &name(0)), None);
        });
    }
}
