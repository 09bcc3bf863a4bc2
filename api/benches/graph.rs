//! Cost of the dependency-graph checks (`batchlease_api::graph`) on graphs of
//! 10,000 tasks, the size the operator and the SDK must handle without
//! noticing: `cargo bench -p batchlease-api --bench graph`.
//!
//! Plain `std::time::Instant` and a median over `RUNS` runs: no benchmark
//! framework is in the dependency tree, and these numbers only need to show
//! the order of magnitude (milliseconds, not seconds) and that nothing is
//! quadratic. Every call includes indexing the slice by name, as callers pay
//! it. Prints a markdown table for e2e/bench/RESULTS.md.

use std::hint::black_box;
use std::time::{Duration, Instant};

use batchlease_api::graph::{Node, cycle_through, find_cycles, topological_order};

const LAYERS: usize = 100;
const WIDTH: usize = 100;
const CHAIN: usize = 10_000;
const RUNS: usize = 20;

/// Owned (name, depends on) pairs that [`Node`]s borrow.
type Owned = Vec<(String, Vec<String>)>;

fn layered_name(layer: usize, k: usize) -> String {
    format!("l{layer:03}-n{k:03}")
}

/// `LAYERS` × `WIDTH` tasks; each task of a layer after the first depends on
/// three of the layer before (the same position and two others, spread so
/// that layers mix). With `cycle`, `l000-n000` also depends on `l099-n000`,
/// closing a cycle through every layer along position 0.
fn layered(cycle: bool) -> Owned {
    let mut out = Vec::with_capacity(LAYERS * WIDTH);
    for layer in 0..LAYERS {
        for k in 0..WIDTH {
            let deps = if layer == 0 {
                if cycle && k == 0 {
                    vec![layered_name(LAYERS - 1, 0)]
                } else {
                    Vec::new()
                }
            } else {
                [k, (k + 1) % WIDTH, (k + 37) % WIDTH]
                    .iter()
                    .map(|&j| layered_name(layer - 1, j))
                    .collect()
            };
            out.push((layered_name(layer, k), deps));
        }
    }
    out
}

/// `c00000` depends on `c00001`, …, up to `c09999`.
fn chain() -> Owned {
    (0..CHAIN)
        .map(|i| {
            let deps = if i + 1 < CHAIN {
                vec![format!("c{:05}", i + 1)]
            } else {
                Vec::new()
            };
            (format!("c{i:05}"), deps)
        })
        .collect()
}

fn nodes(owned: &Owned) -> Vec<Node<'_>> {
    owned
        .iter()
        .map(|(name, deps)| Node {
            name,
            depends_on: deps,
        })
        .collect()
}

/// Median, min and max wall time of `RUNS` runs of `f`, after one warm-up
/// run whose result describes what was computed.
fn measure<T>(mut f: impl FnMut() -> T, describe: impl Fn(&T) -> String) -> (String, [f64; 3]) {
    let what = describe(&f());
    let mut times: Vec<Duration> = (0..RUNS)
        .map(|_| {
            let start = Instant::now();
            black_box(f());
            start.elapsed()
        })
        .collect();
    times.sort_unstable();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let median = times.get(RUNS / 2).copied().unwrap_or_default();
    let min = times.first().copied().unwrap_or_default();
    let max = times.last().copied().unwrap_or_default();
    (what, [ms(median), ms(min), ms(max)])
}

fn main() {
    let graphs: [(&str, Owned, String); 3] = [
        (
            "layered DAG 100 × 100",
            layered(false),
            layered_name(LAYERS / 2, 0),
        ),
        (
            "layered, one cycle through all 100 layers",
            layered(true),
            layered_name(LAYERS / 2, 0),
        ),
        ("chain", chain(), format!("c{:05}", CHAIN / 2)),
    ];
    println!("median of {RUNS} runs (after one warm-up), release build\n");
    println!("| graph | nodes | edges | check | result | median ms | min ms | max ms |");
    println!("|---|---:|---:|---|---|---:|---:|---:|");
    for (label, owned, probe) in &graphs {
        let nodes = nodes(owned);
        let edges: usize = owned.iter().map(|(_, d)| d.len()).sum();
        let rows = [
            measure(
                || topological_order(black_box(&nodes)),
                |r| match r {
                    Ok(order) => format!("ordered {}", order.len()),
                    Err(stuck) => format!("{} unordered", stuck.len()),
                },
            ),
            measure(
                || cycle_through(black_box(&nodes), black_box(probe)),
                |r| match r {
                    Some(c) => format!("cycle of {}", c.path.len()),
                    None => "none".to_owned(),
                },
            ),
            measure(
                || find_cycles(black_box(&nodes)),
                |r| {
                    if r.is_empty() {
                        return "none".to_owned();
                    }
                    let lens: Vec<String> = r.iter().map(|c| c.path.len().to_string()).collect();
                    format!("cycles of length {}", lens.join(", "))
                },
            ),
        ];
        let checks = [
            "`topological_order`".to_owned(),
            format!("`cycle_through({probe})`"),
            "`find_cycles`".to_owned(),
        ];
        for (check, (result, [median, min, max])) in checks.iter().zip(rows) {
            println!(
                "| {label} | {} | {edges} | {check} | {result} | {median:.2} | {min:.2} | {max:.2} |",
                nodes.len()
            );
        }
    }
}
