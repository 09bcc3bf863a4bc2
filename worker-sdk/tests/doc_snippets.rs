//! Every Rust code block of the README and `docs/sdk.md` is a region of
//! `examples/quickstart.rs`, and every one of `docs/write-a-worker.md` a
//! region of `examples/minimal_worker.rs` or `examples/tls_worker.rs`,
//! which the build compiles: documentation that does not compile fails
//! here. That page's Dockerfile and manifest are the files of
//! `examples/my-worker/` (the manifest is checked by the API server in
//! `e2e/tests/worker_manifest.rs`), and its Cargo.toml names the versions
//! this workspace builds with.

use std::path::Path;

fn root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// The ```rust blocks of a markdown file.
fn rust_blocks(text: &str) -> Vec<String> {
    blocks(text, "rust")
}

/// The ```lang blocks of a markdown file.
fn blocks(text: &str, lang: &str) -> Vec<String> {
    let fence = format!("```{lang}");
    let mut out = Vec::new();
    let mut current: Option<Vec<&str>> = None;
    for line in text.lines() {
        match (&mut current, line.trim_start()) {
            (None, l) if l == fence => current = Some(Vec::new()),
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

fn read(path: &str) -> String {
    std::fs::read_to_string(root().join(path)).unwrap_or_default()
}

#[test]
fn write_a_worker_shows_the_compiled_files() {
    let page = read("docs/write-a-worker.md");
    let rust = rust_blocks(&page);
    for example in [
        "worker-sdk/examples/minimal_worker.rs",
        "worker-sdk/examples/tls_worker.rs",
    ] {
        let region = regions(&read(example));
        assert_eq!(
            region.len(),
            1,
            "{example}: one snippet region, the whole program"
        );
        assert!(
            rust.contains(&region[0]),
            "docs/write-a-worker.md does not show {example} as it is:\n{}",
            region[0]
        );
    }
    assert_eq!(rust.len(), 2, "a rust block that is not compiled");
    for (lang, file) in [
        ("dockerfile", "examples/my-worker/Dockerfile"),
        ("yaml", "examples/my-worker/deployment.yaml"),
    ] {
        let shown = blocks(&page, lang);
        let text = read(file);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            shown,
            [dedent(&lines)],
            "docs/write-a-worker.md's {lang} block is not {file}"
        );
    }
}

/// The page's Cargo.toml asks for the versions this workspace builds
/// with, and picks a k8s-openapi version feature (a binary must).
#[test]
fn write_a_worker_dependencies_match_the_workspace() {
    let page = read("docs/write-a-worker.md");
    let toml = blocks(&page, "toml");
    assert_eq!(toml.len(), 1);
    let dep = |text: &str, name: &str| -> String {
        text.lines()
            .find(|l| l.starts_with(&format!("{name} = ")))
            .unwrap_or_default()
            .to_owned()
    };
    let version = |line: &str| -> String {
        line.split("version = \"")
            .nth(1)
            .and_then(|v| v.split('"').next())
            .unwrap_or_default()
            .to_owned()
    };
    let workspace = read("Cargo.toml");
    for (name, shown_prefix) in [("k8s-openapi", 2), ("kube", 1)] {
        let ours = version(&dep(&workspace, name));
        let shown = version(&dep(&toml[0], name));
        let want: Vec<&str> = ours.split('.').take(shown_prefix).collect();
        assert_eq!(shown, want.join("."), "{name}: the workspace has {ours}");
    }
    let k8s = dep(&toml[0], "k8s-openapi");
    assert!(
        k8s.contains("\"latest\"") || k8s.contains("\"earliest\"") || k8s.contains("\"v1_"),
        "the binary must pick a Kubernetes version feature: {k8s}"
    );
    let repo = workspace
        .lines()
        .find_map(|l| l.strip_prefix("repository = "))
        .unwrap_or_default()
        .trim_matches('"')
        .to_owned();
    assert!(
        dep(&toml[0], "batchlease-worker-sdk").contains(&format!("git = \"{repo}\"")),
        "the SDK's git dependency names {repo}"
    );
}

/// The manifest's pods get longer than the SDK's drain grace after
/// SIGTERM: running tasks finish or are given back before the SIGKILL.
#[test]
fn the_worker_deployment_outlasts_the_drain_grace() {
    let manifest = read("examples/my-worker/deployment.yaml");
    let grace: u64 = manifest
        .lines()
        .find_map(|l| l.trim().strip_prefix("terminationGracePeriodSeconds:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    let drain = batchlease_worker_sdk::DEFAULT_DRAIN_GRACE.as_secs();
    assert!(
        grace > drain,
        "terminationGracePeriodSeconds {grace} must exceed the drain grace {drain}"
    );
}

#[test]
fn the_block_parser_finds_blocks_and_regions() {
    let md = "text\n```rust\n    let a = 1;\n    f(a);\n```\n```sh\nls\n```\n";
    assert_eq!(rust_blocks(md), ["let a = 1;\nf(a);"]);
    let rs = "x\n    // [snippet]\n    let a = 1;\n    f(a);\n    // [/snippet]\n";
    assert_eq!(regions(rs), ["let a = 1;\nf(a);"]);
}
