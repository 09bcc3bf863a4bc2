//! The crates' module structure, read from their source: which module
//! refers to which, and the circles ("import cycles") among them.
//!
//! A circle is files that cannot be read, tested or changed one at a time:
//! each needs the others. Review catches a new one late, and a tool run by
//! hand (`farm-studio look`) only when someone runs it; `tests/structure.rs`
//! fails the build instead. This is a reader of Rust's *paths*, not a
//! compiler: it knows the module tree from the file names (`foo.rs`,
//! `foo/mod.rs`, `foo/bar.rs`) and counts a file as referring to a module
//! when its code names a path into it — `use crate::b::X`, `crate::b::f()`,
//! `super::X`, `self::child::X`, or `child::f()` for a module declared
//! below it. It agrees with `farm-studio look` on the circles that tool
//! finds, and differs from it where noted:
//!
//! - Comments, doc comments and string literals are not code.
//! - Test code imports freely: `#[cfg(test)]` items (the `mod tests`
//!   blocks) and files named `tests.rs` or `*_tests.rs` are not read.
//! - `mod x;` is a declaration, not a reference.
//! - A re-export (`pub use`, `pub(crate) use`) hands names on: it is not a
//!   reference of its own, and a path through it is followed to the module
//!   that defines the name (`crate::TaskError` leads to `error`, not to
//!   `lib.rs`). A facade such as `postgres.rs` re-exporting its children's
//!   types is therefore no circle with them, while a parent that *calls*
//!   into a child which uses the parent's own items is one.
//! - `src/bin/` holds other crates and is not read.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::Path;

/// One source file of a crate: its path under `src/`, its module path
/// (`["postgres", "connect"]`; the crate root is `[]`), and its text.
#[derive(Debug, Clone)]
pub struct SourceFile {
    pub rel: String,
    pub module: Vec<String>,
    pub text: String,
}

/// Whether a file under `src/` holds only tests (read by nobody here).
pub fn is_test_file(rel: &str) -> bool {
    let name = rel.rsplit('/').next().unwrap_or(rel);
    name == "tests.rs" || name.ends_with("_tests.rs")
}

/// The module path of a file under `src/` (`/`-separated), or `None` for a
/// file that is not a module of the library or binary root (`src/bin/…`,
/// not Rust).
pub fn module_of(rel: &str) -> Option<Vec<String>> {
    let stem = rel.strip_suffix(".rs")?;
    if stem.starts_with("bin/") {
        return None;
    }
    let mut parts: Vec<String> = stem.split('/').map(str::to_owned).collect();
    match parts.last().map(String::as_str) {
        // lib.rs and main.rs are both roots: the operator's binary names
        // the library's modules through `crate::` (it imports them into
        // its root), so one tree of files serves both.
        Some("lib" | "main") if parts.len() == 1 => parts.clear(),
        Some("mod") => {
            parts.pop();
        }
        _ => {}
    }
    Some(parts)
}

/// Reads every module file under `src` (tests and `bin/` left out).
pub fn read_tree(src: &Path) -> std::io::Result<Vec<SourceFile>> {
    let mut files = Vec::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            let Ok(rel) = path.strip_prefix(src) else {
                continue;
            };
            let rel = rel.to_string_lossy().replace('\\', "/");
            if is_test_file(&rel) {
                continue;
            }
            if let Some(module) = module_of(&rel) {
                let text = std::fs::read_to_string(&path)?;
                files.push(SourceFile { rel, module, text });
            }
        }
    }
    files.sort_by(|a, b| a.rel.cmp(&b.rel));
    Ok(files)
}

/// Every non-test `.rs` file under `src` (`bin/` included) longer than
/// `max` lines, longest first, with its line count.
pub fn long_files(src: &Path, max: usize) -> std::io::Result<Vec<(String, usize)>> {
    let mut long = Vec::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            let rel = path
                .strip_prefix(src)
                .unwrap_or(&path)
                .to_string_lossy()
                .replace('\\', "/");
            if !rel.ends_with(".rs") || is_test_file(&rel) {
                continue;
            }
            let lines = std::fs::read_to_string(&path)?.lines().count();
            if lines > max {
                long.push((rel, lines));
            }
        }
    }
    long.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    Ok(long)
}

/// `src` with comments and the contents of string and character literals
/// blanked (newlines kept), so that a path in a doc comment or a message
/// is not taken for a reference.
pub fn strip_comments_and_literals(src: &str) -> String {
    let c: Vec<char> = src.chars().collect();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    let ident = |ch: char| ch.is_alphanumeric() || ch == '_';
    // Copies the newlines of c[from..to] (line numbers survive).
    let blank = |out: &mut String, from: usize, to: usize| {
        out.push(' ');
        out.extend(c[from..to.min(c.len())].iter().filter(|&&ch| ch == '\n'));
    };
    while i < c.len() {
        let prev_ident = i > 0 && ident(c[i - 1]);
        let at = |k: usize| c.get(i + k).copied();
        if c[i] == '/' && at(1) == Some('/') {
            let end = (i..c.len()).find(|&k| c[k] == '\n').unwrap_or(c.len());
            blank(&mut out, i, end);
            i = end;
        } else if c[i] == '/' && at(1) == Some('*') {
            let (mut depth, mut k) = (1, i + 2);
            while k < c.len() && depth > 0 {
                if c[k] == '/' && c.get(k + 1) == Some(&'*') {
                    depth += 1;
                    k += 2;
                } else if c[k] == '*' && c.get(k + 1) == Some(&'/') {
                    depth -= 1;
                    k += 2;
                } else {
                    k += 1;
                }
            }
            blank(&mut out, i, k);
            i = k;
        } else if !prev_ident && let Some(start) = raw_string_quote(&c, i) {
            // r"…", r#"…"#, br"…": ends at `"` followed by as many `#`.
            let hashes = start - i - if c[i] == 'b' { 2 } else { 1 };
            let mut k = start + 1;
            while k < c.len() {
                if c[k] == '"' && (1..=hashes).all(|h| c.get(k + h) == Some(&'#')) {
                    break;
                }
                k += 1;
            }
            let end = (k + 1 + hashes).min(c.len());
            out.push_str("\"\"");
            blank(&mut out, i, end);
            i = end;
        } else if c[i] == '"' {
            let mut k = i + 1;
            while k < c.len() && c[k] != '"' {
                k += if c[k] == '\\' { 2 } else { 1 };
            }
            out.push_str("\"\"");
            blank(&mut out, i, k + 1);
            i = k + 1;
        } else if c[i] == '\'' && at(1) == Some('\\') {
            // An escaped character: '\n', '\'', '\u{…}'.
            let end = (i + 3..c.len()).find(|&k| c[k] == '\'').unwrap_or(c.len());
            out.push_str("' '");
            i = end + 1;
        } else if c[i] == '\'' && at(2) == Some('\'') {
            out.push_str("' '");
            i += 3;
        } else {
            // A lifetime's quote, or any other character.
            out.push(c[i]);
            i += 1;
        }
    }
    out
}

/// The index of the opening `"` when a raw string starts at `c[i]`.
fn raw_string_quote(c: &[char], i: usize) -> Option<usize> {
    let mut k = i;
    if c.get(k) == Some(&'b') {
        k += 1;
    }
    if c.get(k) != Some(&'r') {
        return None;
    }
    k += 1;
    while c.get(k) == Some(&'#') {
        k += 1;
    }
    (c.get(k) == Some(&'"')).then_some(k)
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Tok {
    Ident(String),
    /// `::`
    Sep,
    Punct(char),
}

fn tokens(code: &str) -> Vec<Tok> {
    let c: Vec<char> = code.chars().collect();
    let mut toks = Vec::new();
    let mut i = 0;
    while i < c.len() {
        let ch = c[i];
        if ch.is_whitespace() {
            i += 1;
        } else if ch.is_alphanumeric() || ch == '_' {
            let start = i;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            let word: String = c[start..i].iter().collect();
            // r#type is the identifier `type`; a number is no name.
            if ch.is_ascii_digit() {
                toks.push(Tok::Punct('0'));
            } else {
                toks.push(Tok::Ident(word));
            }
        } else if ch == ':' && c.get(i + 1) == Some(&':') {
            toks.push(Tok::Sep);
            i += 2;
        } else {
            toks.push(Tok::Punct(ch));
            i += 1;
        }
    }
    toks
}

fn is(t: Option<&Tok>, word: &str) -> bool {
    matches!(t, Some(Tok::Ident(w)) if w == word)
}

/// The tokens of `code` without its `#[cfg(test)]` items (test modules,
/// test-only helpers and imports): tests may import freely.
fn without_test_items(toks: Vec<Tok>) -> Vec<Tok> {
    let cfg_test = |t: &[Tok], i: usize, inner: bool| {
        let o = usize::from(inner);
        t.get(i) == Some(&Tok::Punct('#'))
            && (!inner || t.get(i + 1) == Some(&Tok::Punct('!')))
            && t.get(i + 1 + o) == Some(&Tok::Punct('['))
            && is(t.get(i + 2 + o), "cfg")
            && t.get(i + 3 + o) == Some(&Tok::Punct('('))
            && is(t.get(i + 4 + o), "test")
            && t.get(i + 5 + o) == Some(&Tok::Punct(')'))
            && t.get(i + 6 + o) == Some(&Tok::Punct(']'))
    };
    if cfg_test(&toks, 0, true) {
        return Vec::new();
    }
    let mut out = Vec::with_capacity(toks.len());
    let mut i = 0;
    while i < toks.len() {
        if !cfg_test(&toks, i, false) {
            out.push(toks[i].clone());
            i += 1;
            continue;
        }
        i += 7;
        // The item: up to a `;` outside any brackets, or the end of its
        // first top-level `{…}` block (further attributes included).
        let mut depth = 0usize;
        while i < toks.len() {
            match &toks[i] {
                Tok::Punct('(' | '[' | '{') => depth += 1,
                Tok::Punct(')' | ']') => depth = depth.saturating_sub(1),
                Tok::Punct('}') => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        i += 1;
                        break;
                    }
                }
                Tok::Punct(';') if depth == 0 => {
                    i += 1;
                    break;
                }
                _ => {}
            }
            i += 1;
        }
    }
    out
}

/// One leaf of a `use` tree: the whole path, the name it binds (`None` for
/// a glob), and whether the `use` is a re-export.
#[derive(Debug, Clone)]
struct UseLeaf {
    path: Vec<String>,
    name: Option<String>,
    export: bool,
}

/// What one file's code names: its `use` leaves and the paths written
/// elsewhere in it (each as its segments).
#[derive(Debug, Default)]
struct Refs {
    uses: Vec<UseLeaf>,
    paths: Vec<Vec<String>>,
}

fn parse_use_tree(
    toks: &[Tok],
    mut i: usize,
    prefix: &[String],
    export: bool,
    out: &mut Vec<UseLeaf>,
) -> usize {
    let mut path = prefix.to_vec();
    if toks.get(i) == Some(&Tok::Sep) {
        i += 1;
    }
    loop {
        match toks.get(i) {
            Some(Tok::Punct('{')) => {
                i += 1;
                while i < toks.len() && toks[i] != Tok::Punct('}') {
                    i = parse_use_tree(toks, i, &path, export, out);
                    if toks.get(i) == Some(&Tok::Punct(',')) {
                        i += 1;
                    }
                }
                return i + 1;
            }
            Some(Tok::Punct('*')) => {
                out.push(UseLeaf {
                    path,
                    name: None,
                    export,
                });
                return i + 1;
            }
            Some(Tok::Ident(seg)) => {
                i += 1;
                if toks.get(i) == Some(&Tok::Sep) {
                    path.push(seg.clone());
                    i += 1;
                    continue;
                }
                let name = if seg == "self" {
                    path.last().cloned().unwrap_or_default()
                } else {
                    path.push(seg.clone());
                    seg.clone()
                };
                let name = if is(toks.get(i), "as") {
                    i += 2;
                    match toks.get(i - 1) {
                        Some(Tok::Ident(alias)) => alias.clone(),
                        _ => name,
                    }
                } else {
                    name
                };
                out.push(UseLeaf {
                    path,
                    name: Some(name),
                    export,
                });
                return i;
            }
            // Not a use tree (`use<'a>` capturing); nothing to read.
            _ => return i + 1,
        }
    }
}

fn refs(text: &str) -> Refs {
    let toks = without_test_items(tokens(&strip_comments_and_literals(text)));
    let mut refs = Refs::default();
    let mut i = 0;
    while i < toks.len() {
        if is(toks.get(i), "use") && toks.get(i + 1) != Some(&Tok::Punct('<')) {
            let export = exported(&toks, i);
            let mut leaves = Vec::new();
            let mut k = i + 1;
            while k < toks.len() && toks[k] != Tok::Punct(';') {
                k = parse_use_tree(&toks, k, &[], export, &mut leaves);
            }
            refs.uses.extend(leaves);
            i = k + 1;
            continue;
        }
        let starts_path = matches!(toks.get(i), Some(Tok::Ident(_)))
            && toks.get(i + 1) == Some(&Tok::Sep)
            && i.checked_sub(1).and_then(|p| toks.get(p)) != Some(&Tok::Sep)
            && i.checked_sub(1).and_then(|p| toks.get(p)) != Some(&Tok::Punct('$'))
            && !is(i.checked_sub(1).and_then(|p| toks.get(p)), "in");
        if starts_path {
            let mut segs = Vec::new();
            let mut k = i;
            while let Some(Tok::Ident(seg)) = toks.get(k) {
                segs.push(seg.clone());
                if toks.get(k + 1) != Some(&Tok::Sep) {
                    break;
                }
                k += 2;
            }
            refs.paths.push(segs);
            i = k + 1;
            continue;
        }
        i += 1;
    }
    refs
}

/// Whether the `use` at `toks[i]` is a re-export (`pub use`, `pub(…) use`).
fn exported(toks: &[Tok], i: usize) -> bool {
    let Some(prev) = i.checked_sub(1) else {
        return false;
    };
    if is(toks.get(prev), "pub") {
        return true;
    }
    if toks.get(prev) != Some(&Tok::Punct(')')) {
        return false;
    }
    let open = (0..prev).rev().find(|&k| toks[k] == Tok::Punct('('));
    open.is_some_and(|o| o > 0 && is(toks.get(o - 1), "pub"))
}

/// The references between a crate's files.
#[derive(Debug, Default)]
pub struct Graph {
    /// The files' paths under `src/` (the nodes).
    pub files: Vec<String>,
    /// `(from, to)` file indices, and the names the first takes from the
    /// second.
    pub edges: BTreeMap<(usize, usize), BTreeSet<String>>,
}

/// Resolves paths against the module tree and the names `use` binds.
struct Resolver<'a> {
    modules: BTreeMap<&'a [String], usize>,
    /// Per module: a name it binds by `use` → (the module, the path).
    bindings: BTreeMap<&'a [String], BTreeMap<String, Vec<String>>>,
    /// Names of the crate itself besides `crate` (a binary naming its
    /// library, `batchlease_operator::decide`).
    aliases: &'a [&'a str],
}

impl Resolver<'_> {
    /// The module a path written in module `from` leads to, and the name
    /// it takes there; `None` for a path out of the crate (or not a path).
    fn resolve(
        &self,
        from: &[String],
        segs: &[String],
        depth: usize,
    ) -> Option<(Vec<String>, String)> {
        let first = segs.first()?.as_str();
        let (mut base, mut rest): (Vec<String>, &[String]) =
            if first == "crate" || self.aliases.contains(&first) {
                (Vec::new(), &segs[1..])
            } else if first == "self" {
                (from.to_vec(), &segs[1..])
            } else if first == "super" {
                let ups = segs.iter().take_while(|s| *s == "super").count();
                let keep = from.len().checked_sub(ups)?;
                (from[..keep].to_vec(), &segs[ups..])
            } else {
                let mut child = from.to_vec();
                child.push(first.to_owned());
                if !self.modules.contains_key(child.as_slice()) {
                    return None;
                }
                (from.to_vec(), segs)
            };
        while let Some(seg) = rest.first() {
            base.push(seg.clone());
            if self.modules.contains_key(base.as_slice()) {
                rest = &rest[1..];
            } else {
                base.pop();
                break;
            }
        }
        let Some(name) = rest.first() else {
            let name = base.last().cloned().unwrap_or_else(|| "crate".into());
            return Some((base, name));
        };
        if depth < 8
            && let Some(target) = self.bindings.get(base.as_slice()).and_then(|b| b.get(name))
        {
            let mut path = target.clone();
            path.extend(rest[1..].iter().cloned());
            if let Some(found) = self.resolve(&base, &path, depth + 1) {
                return Some(found);
            }
        }
        Some((base, name.clone()))
    }
}

/// The file-to-file references of a crate's files (see the module doc for
/// what counts). `aliases` are other names of the crate's root.
pub fn graph(files: &[SourceFile], aliases: &[&str]) -> Graph {
    let parsed: Vec<Refs> = files.iter().map(|f| refs(&f.text)).collect();
    let mut resolver = Resolver {
        modules: files
            .iter()
            .enumerate()
            .map(|(i, f)| (f.module.as_slice(), i))
            .collect(),
        bindings: BTreeMap::new(),
        aliases,
    };
    for (f, r) in files.iter().zip(&parsed) {
        let b = resolver.bindings.entry(f.module.as_slice()).or_default();
        for u in &r.uses {
            if let Some(name) = &u.name {
                b.insert(name.clone(), u.path.clone());
            }
        }
    }
    let mut g = Graph {
        files: files.iter().map(|f| f.rel.clone()).collect(),
        edges: BTreeMap::new(),
    };
    for (from, (f, r)) in files.iter().zip(&parsed).enumerate() {
        let imports = r.uses.iter().filter(|u| !u.export);
        let imports = imports.map(|u| (&u.path, u.name.is_none()));
        for (path, glob) in imports.chain(r.paths.iter().map(|p| (p, false))) {
            let Some((module, name)) = resolver.resolve(&f.module, path, 0) else {
                continue;
            };
            let name = if glob { "*".to_owned() } else { name };
            let Some(&to) = resolver.modules.get(module.as_slice()) else {
                continue;
            };
            if to != from {
                g.edges.entry((from, to)).or_default().insert(name);
            }
        }
    }
    g
}

/// The circles of `g`: its strongly connected components of more than one
/// file (Tarjan's algorithm), each sorted, in file order.
pub fn circles(g: &Graph) -> Vec<Vec<usize>> {
    struct Tarjan<'a> {
        next: Vec<Vec<usize>>,
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on_stack: Vec<bool>,
        stack: Vec<usize>,
        counter: usize,
        found: &'a mut Vec<Vec<usize>>,
    }
    impl Tarjan<'_> {
        fn visit(&mut self, v: usize) {
            self.index[v] = Some(self.counter);
            self.low[v] = self.counter;
            self.counter += 1;
            self.stack.push(v);
            self.on_stack[v] = true;
            for w in self.next[v].clone() {
                match self.index[w] {
                    None => {
                        self.visit(w);
                        self.low[v] = self.low[v].min(self.low[w]);
                    }
                    Some(iw) if self.on_stack[w] => self.low[v] = self.low[v].min(iw),
                    Some(_) => {}
                }
            }
            if Some(self.low[v]) == self.index[v] {
                let mut component = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack[w] = false;
                    component.push(w);
                    if w == v {
                        break;
                    }
                }
                if component.len() > 1 {
                    component.sort_unstable();
                    self.found.push(component);
                }
            }
        }
    }
    let n = g.files.len();
    let mut next = vec![Vec::new(); n];
    for &(a, b) in g.edges.keys() {
        next[a].push(b);
    }
    let mut found = Vec::new();
    let mut t = Tarjan {
        next,
        index: vec![None; n],
        low: vec![0; n],
        on_stack: vec![false; n],
        stack: Vec::new(),
        counter: 0,
        found: &mut found,
    };
    for v in 0..n {
        if t.index[v].is_none() {
            t.visit(v);
        }
    }
    found.sort();
    found
}

/// A circle in words, as `farm-studio look` prints it: its files, then each
/// reference inside it with the names that tie it. `prefix` goes before
/// each file's path (`worker-sdk/src/`).
pub fn describe(g: &Graph, circle: &[usize], prefix: &str) -> String {
    let name = |i: usize| format!("{prefix}{}", g.files[i]);
    let files: Vec<String> = circle.iter().map(|&i| name(i)).collect();
    let mut s = format!("{} files: {}", circle.len(), files.join(", "));
    for (&(a, b), names) in &g.edges {
        if circle.contains(&a) && circle.contains(&b) {
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            let _ = write!(s, "\n  {} -> {}: {}", name(a), name(b), names.join(", "));
        }
    }
    s
}

/// The circles of the crate whose sources are under `src`, each described
/// (empty when there is none).
pub fn crate_circles(src: &Path, prefix: &str, aliases: &[&str]) -> std::io::Result<Vec<String>> {
    let files = read_tree(src)?;
    let g = graph(&files, aliases);
    Ok(circles(&g)
        .iter()
        .map(|c| describe(&g, c, prefix))
        .collect())
}
