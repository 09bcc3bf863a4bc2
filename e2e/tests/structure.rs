//! The crates' structure, held in CI: no import circle in the worker SDK or
//! the operator, and no operator file over 700 lines. A circle makes its
//! files one unit that can only be read, tested and changed together; a
//! file over 700 lines is a sign that it holds more than one thing. Both
//! creep in one reasonable change at a time, so a test keeps them out.
//!
//! No control plane, no environment: this reads source files only
//! (`batchlease_e2e::structure`). Run alone with
//! `cargo test -p batchlease-e2e --test structure`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use batchlease_e2e::structure::{
    SourceFile, circles, describe, graph, long_files, module_of, strip_comments_and_literals,
};

/// The line limit of an operator source file (tests excepted).
const MAX_LINES: usize = 700;

fn src_of(krate: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(krate)
        .join("src")
}

/// Fails, naming every circle with its files and what ties them.
fn assert_no_circle(krate: &str, aliases: &[&str]) {
    let src = src_of(krate);
    let found = batchlease_e2e::structure::crate_circles(&src, &format!("{krate}/src/"), aliases)
        .unwrap_or_else(|e| panic!("reading {}: {e}", src.display()));
    assert!(
        found.is_empty(),
        "{krate}/src has {} import circle(s); move what the files share to a module of its own, or \
         turn a reference around, so that each circle opens:\n{}",
        found.len(),
        found
            .iter()
            .enumerate()
            .map(|(i, c)| format!("circle {}: {c}", i + 1))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[test]
fn worker_sdk_has_no_import_circle() {
    assert_no_circle("worker-sdk", &["batchlease_worker_sdk"]);
}

#[test]
fn operator_has_no_import_circle() {
    // The binary (main.rs) imports the library's modules into its root and
    // names them as `crate::decide` or `batchlease_operator::decide`.
    assert_no_circle("operator", &["batchlease_operator"]);
}

#[test]
fn operator_files_stay_under_700_lines() {
    let src = src_of("operator");
    let long =
        long_files(&src, MAX_LINES).unwrap_or_else(|e| panic!("reading {}: {e}", src.display()));
    assert!(
        long.is_empty(),
        "operator/src files over {MAX_LINES} lines (tests excepted); split each where it holds \
         more than one thing:\n{}",
        long.iter()
            .map(|(f, n)| format!("  operator/src/{f}: {n} lines"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

// The reader itself, on small crates held in memory.

fn krate(files: &[(&str, &str)]) -> Vec<SourceFile> {
    files
        .iter()
        .map(|(rel, text)| SourceFile {
            rel: (*rel).to_owned(),
            module: module_of(rel).unwrap(),
            text: (*text).to_owned(),
        })
        .collect()
}

fn circles_of(files: &[(&str, &str)]) -> Vec<String> {
    let g = graph(&krate(files), &[]);
    circles(&g).iter().map(|c| describe(&g, c, "")).collect()
}

#[test]
fn files_map_to_module_paths() {
    assert_eq!(module_of("lib.rs").unwrap(), Vec::<String>::new());
    assert_eq!(module_of("main.rs").unwrap(), Vec::<String>::new());
    assert_eq!(module_of("a.rs").unwrap(), ["a"]);
    assert_eq!(module_of("a/mod.rs").unwrap(), ["a"]);
    assert_eq!(module_of("a/b.rs").unwrap(), ["a", "b"]);
    assert_eq!(module_of("a/lib.rs").unwrap(), ["a", "lib"]);
    assert_eq!(module_of("bin/tool.rs"), None);
    assert_eq!(module_of("fence.sql"), None);
}

#[test]
fn a_circle_is_found_with_what_ties_it() {
    let found = circles_of(&[
        ("lib.rs", "mod a; mod b; mod c;"),
        ("a.rs", "use crate::b::{Bee, bee};\npub struct Ay;"),
        (
            "b.rs",
            "pub struct Bee;\npub fn bee() -> usize { crate::c::see() }",
        ),
        ("c.rs", "pub fn see() -> usize { let _ = crate::a::Ay; 1 }"),
    ]);
    assert_eq!(
        found,
        [
            "3 files: a.rs, b.rs, c.rs\n  a.rs -> b.rs: Bee, bee\n  b.rs -> c.rs: see\n  c.rs -> a.rs: Ay"
        ]
    );
}

#[test]
fn a_chain_is_no_circle() {
    let found = circles_of(&[
        ("lib.rs", "mod a; mod b; mod c; pub use a::Ay;"),
        ("a.rs", "use crate::b::Bee;\npub struct Ay(Bee);"),
        ("b.rs", "pub struct Bee(crate::c::See);"),
        ("c.rs", "pub struct See;"),
    ]);
    assert_eq!(found, Vec::<String>::new());
}

#[test]
fn comments_and_strings_are_not_code() {
    let found = circles_of(&[
        ("lib.rs", "mod a; mod b;"),
        ("a.rs", "use crate::b::Bee;\npub struct Ay(Bee);"),
        (
            "b.rs",
            r##"//! See [`crate::a::Ay`].
/* use crate::a::Ay; /* nested */ crate::a::Ay */
pub struct Bee;
pub const S: &str = "crate::a::Ay";
pub const R: &str = r#"use crate::a::Ay; "quoted""#;
pub const C: char = '"';
pub fn f<'a>(s: &'a str) -> &'a str { s }"##,
        ),
    ]);
    assert_eq!(found, Vec::<String>::new());
    let stripped = strip_comments_and_literals("a // b\n\"c\\\"d\" 'e' '\\n' f<'g>");
    assert_eq!(stripped.lines().count(), 2);
    assert!(!stripped.contains('b') && !stripped.contains('c') && !stripped.contains('e'));
    assert!(stripped.contains("f<'g>"), "{stripped}");
}

#[test]
fn test_code_may_import_freely() {
    let found = circles_of(&[
        ("lib.rs", "mod a; mod b;"),
        ("a.rs", "use crate::b::Bee;\npub struct Ay(Bee);"),
        (
            "b.rs",
            "pub struct Bee;\n\
             #[cfg(test)]\nmod tests { use crate::a::Ay; fn f() -> Ay { todo!() } }\n\
             #[cfg(test)]\npub(crate) fn helper() -> crate::a::Ay { todo!() }\n\
             #[cfg(test)]\nuse crate::a::Ay;",
        ),
        ("b/tests.rs", "use crate::a::Ay;"),
    ]);
    assert_eq!(found, Vec::<String>::new());
    // The same reference outside a test item ties the circle.
    let found = circles_of(&[
        ("lib.rs", "mod a; mod b;"),
        ("a.rs", "use crate::b::Bee;\npub struct Ay(Bee);"),
        (
            "b.rs",
            "pub struct Bee;\n#[cfg(test)]\nmod tests {}\nuse crate::a::Ay;",
        ),
    ]);
    assert_eq!(
        found,
        ["2 files: a.rs, b.rs\n  a.rs -> b.rs: Bee\n  b.rs -> a.rs: Ay"]
    );
}

#[test]
fn a_child_and_the_parent_it_serves_are_a_circle_when_both_use_the_other() {
    // The parent calls into its child, which uses the parent's type.
    let found = circles_of(&[
        ("lib.rs", "mod m;"),
        ("m.rs", "mod a;\npub struct Em;\npub fn f() { a::alpha(); }"),
        ("m/a.rs", "use super::Em;\npub fn alpha() -> Em { Em }"),
    ]);
    assert_eq!(
        found,
        ["2 files: m.rs, m/a.rs\n  m.rs -> m/a.rs: alpha\n  m/a.rs -> m.rs: Em"]
    );
    // A parent that only declares and re-exports its children is their
    // face, not a user: no circle, and a path through the re-export leads
    // to the module that defines the name.
    let files = krate(&[
        ("lib.rs", "mod m; mod z;"),
        ("m.rs", "mod a;\nmod b;\npub use a::Ay;\npub struct Em;"),
        ("m/a.rs", "use super::Em;\npub struct Ay(Em);"),
        ("m/b.rs", "use super::Ay;\npub struct Bee(Ay);"),
        ("z.rs", "pub fn z() -> crate::m::Ay { todo!() }"),
    ]);
    let g = graph(&files, &[]);
    assert!(circles(&g).is_empty());
    let edges: Vec<(&str, &str)> = g
        .edges
        .keys()
        .map(|&(a, b)| (g.files[a].as_str(), g.files[b].as_str()))
        .collect();
    assert_eq!(
        edges,
        [("m/a.rs", "m.rs"), ("m/b.rs", "m/a.rs"), ("z.rs", "m/a.rs")]
    );
}
