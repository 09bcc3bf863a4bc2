//! Every Rust code block of the README and `docs/sdk.md` is a region of
//! `examples/quickstart.rs`, which the build compiles: documentation that
//! does not compile fails here.

use std::path::Path;

fn root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// The ```rust blocks of a markdown file.
fn rust_blocks(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current: Option<Vec<&str>> = None;
    for line in text.lines() {
        match (&mut current, line.trim_start()) {
            (None, l) if l.starts_with("```rust") => current = Some(Vec::new()),
            (Some(_), "```") => out.push(dedent(&current.take().unwrap_or_default())),
            (Some(lines), _) => lines.push(line),
            (None, _) => {}
        }
    }
    out
}

/// The regions between `// [snippet]` and `// [/snippet]`.
fn regions(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current: Option<Vec<&str>> = None;
    for line in text.lines() {
        match (&mut current, line.trim()) {
            (None, "// [snippet]") => current = Some(Vec::new()),
            (Some(_), "// [/snippet]") => out.push(dedent(&current.take().unwrap_or_default())),
            (Some(lines), _) => lines.push(line),
            (None, _) => {}
        }
    }
    out
}

fn dedent(lines: &[&str]) -> String {
    let indent = lines
        .iter()
        .filter(|l| !l.trim().is_empty())
        .map(|l| l.len() - l.trim_start().len())
        .min()
        .unwrap_or(0);
    lines
        .iter()
        .map(|l| l.get(indent..).unwrap_or("").trim_end())
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn every_documented_rust_block_is_compiled_code() {
    let example = std::fs::read_to_string(root().join("worker-sdk/examples/quickstart.rs"))
        .unwrap_or_default();
    let compiled = regions(&example);
    assert!(!compiled.is_empty(), "no snippet regions in the example");
    for doc in ["README.md", "docs/sdk.md"] {
        let text = std::fs::read_to_string(root().join(doc)).unwrap_or_default();
        let blocks = rust_blocks(&text);
        assert!(!blocks.is_empty(), "{doc} has no rust block");
        for block in blocks {
            assert!(
                compiled.contains(&block),
                "{doc}: this block is not a region of examples/quickstart.rs:\n{block}"
            );
        }
    }
}

#[test]
fn the_block_parser_finds_blocks_and_regions() {
    let md = "text\n```rust\n    let a = 1;\n    f(a);\n```\n```sh\nls\n```\n";
    assert_eq!(rust_blocks(md), ["let a = 1;\nf(a);"]);
    let rs = "x\n    // [snippet]\n    let a = 1;\n    f(a);\n    // [/snippet]\n";
    assert_eq!(regions(rs), ["let a = 1;\nf(a);"]);
}
