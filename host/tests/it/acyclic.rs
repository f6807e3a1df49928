//! Import cycles between the files of one folder.
//!
//! Reads host/src as text (no compiler involved) and draws, inside every folder,
//! an edge A -> B when file A names a path (`use crate::…`, `super::…`, `self::…`,
//! or an inline `crate::a::b::f(…)`) that resolves to file B of the same folder. A
//! sub-folder counts as one node of its parent folder (its files are one unit). A
//! folder's `mod.rs` is its face: its `mod`/`pub use` lines are not edges, and a
//! name it re-exports (`pub use x::Name`) resolves to the file that defines it.
//! Test-only files (`#[cfg(test)] mod x;`) and `#[cfg(test)] mod … { }` blocks are
//! skipped: tests may look at any file they check. The test fails on a cycle and
//! names its files and the edges that tie them.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// One source file: its module path (`["model", "lora"]`) and its text without
/// comments, strings or test modules.
struct Source {
    file: PathBuf,
    module: Vec<String>,
    code: String,
}

/// Removes comments, string/char literals and `#[cfg(test)] mod … { … }` blocks.
fn strip(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i..].starts_with(b"/*") {
            let mut depth = 0;
            while i < b.len() {
                if b[i..].starts_with(b"/*") {
                    depth += 1;
                    i += 2;
                } else if b[i..].starts_with(b"*/") {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if b[i] == b'r' && (b[i..].starts_with(b"r\"") || b[i..].starts_with(b"r#")) {
            let hashes = b[i + 1..].iter().take_while(|&&c| c == b'#').count();
            if b.get(i + 1 + hashes) != Some(&b'"') {
                out.push('r');
                i += 1;
                continue;
            }
            let close: Vec<u8> = std::iter::once(b'"').chain(std::iter::repeat_n(b'#', hashes)).collect();
            i += 2 + hashes;
            while i < b.len() && !b[i..].starts_with(&close) {
                i += 1;
            }
            i += close.len();
            out.push_str("\"\"");
        } else if b[i] == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
        } else if b[i] == b'\'' && char_literal_len(&b[i..]).is_some() {
            i += char_literal_len(&b[i..]).unwrap_or(1);
            out.push_str("' '");
        } else {
            let c = text[i..].chars().next().unwrap_or(' ');
            out.push(c);
            i += c.len_utf8();
        }
    }
    drop_test_blocks(&out)
}

/// The length of a char literal at the start of `b` (`'a'`, `'\n'`, `'\''`), or
/// None for a lifetime.
fn char_literal_len(b: &[u8]) -> Option<usize> {
    if b.get(1) == Some(&b'\\') {
        let end = b[2..].iter().position(|&c| c == b'\'')?;
        return Some(end + 3);
    }
    let s = std::str::from_utf8(&b[1..]).ok().or_else(|| std::str::from_utf8(&b[1..b.len().min(5)]).ok())?;
    let c = s.chars().next()?;
    (b.get(1 + c.len_utf8()) == Some(&b'\'')).then_some(2 + c.len_utf8())
}

/// Drops every `#[cfg(test)]` item that opens a brace block (test modules).
fn drop_test_blocks(code: &str) -> String {
    let mut out = String::new();
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let after = &rest[at + "#[cfg(test)]".len()..];
        let item_end = after.find([';', '{']).unwrap_or(after.len());
        if !after[..item_end].trim_start().starts_with("mod") || !after[item_end..].starts_with('{') {
            out.push_str("#[cfg(test)]");
            rest = after;
            continue;
        }
        let mut depth = 0;
        let mut end = after.len();
        for (k, c) in after[item_end..].char_indices() {
            depth += match c {
                '{' => 1,
                '}' => -1,
                _ => 0,
            };
            if depth == 0 {
                end = item_end + k + 1;
                break;
            }
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

/// Every `.rs` file under `dir`, except those declared `#[cfg(test)] mod x;`.
fn collect(src: &Path, dir: &Path, module: &[String], out: &mut Vec<Source>) {
    let mut entries: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .collect();
    entries.sort();
    let face = ["mod.rs", "lib.rs"].iter().map(|f| dir.join(f)).find(|p| p.exists());
    let test_only: BTreeSet<String> = face
        .map(|p| fs::read_to_string(p).expect("reading a module file"))
        .map(|t| test_only_modules(&t))
        .unwrap_or_default();
    for path in entries {
        let name = path.file_stem().and_then(|s| s.to_str()).unwrap_or_default().to_string();
        if test_only.contains(&name) || name == "main" && dir == src {
            continue;
        }
        if path.is_dir() {
            let mut m = module.to_vec();
            m.push(name);
            collect(src, &path, &m, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let mut m = module.to_vec();
            if name != "mod" && name != "lib" {
                m.push(name);
            }
            let text =
                fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
            out.push(Source { file: path, module: m, code: strip(&text) });
        }
    }
}

/// The names `x` of `#[cfg(test)] mod x;` lines.
fn test_only_modules(text: &str) -> BTreeSet<String> {
    let lines: Vec<&str> = text.lines().map(str::trim).collect();
    lines
        .windows(2)
        .filter(|w| w[0] == "#[cfg(test)]")
        .filter_map(|w| w[1].strip_prefix("mod ").or_else(|| w[1].strip_prefix("pub mod ")))
        .filter_map(|r| r.strip_suffix(';'))
        .map(str::to_string)
        .collect()
}

/// Every path named in `code` that starts at `crate`, `super` or `self`, made
/// absolute (a module path followed by the item names), with `use` groups expanded.
fn named_paths(code: &str, module: &[String], is_face: bool) -> Vec<Vec<String>> {
    let mut paths = Vec::new();
    let b = code.as_bytes();
    let mut i = 0;
    while i < b.len() {
        let starts_word =
            i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_' || b[i - 1] == b':');
        let root = ["crate::", "super::", "self::"].into_iter().find(|r| code[i..].starts_with(r));
        match root {
            Some(_) if starts_word => {
                // A face's re-exports (`pub use x::Name;` in mod.rs) only hand names on.
                let line_start = code[..i].rfind(['\n', ';', '{', '}']).map_or(0, |k| k + 1);
                let reexport = is_face && code[line_start..i].trim_start().starts_with("pub use");
                let (tree, used) = use_tree(&code[i..]);
                if !reexport {
                    for p in tree {
                        paths.push(absolute(&p, module));
                    }
                }
                i += used.max(1);
            }
            _ => i += 1,
        }
    }
    paths
}

/// Makes a path absolute from the module that names it.
fn absolute(path: &[String], module: &[String]) -> Vec<String> {
    let mut base: Vec<String> = module.to_vec();
    let mut rest = path;
    match path.first().map(String::as_str) {
        Some("crate") => {
            base.clear();
            rest = &path[1..];
        }
        Some("self") => rest = &path[1..],
        _ => {
            while rest.first().map(String::as_str) == Some("super") {
                base.pop();
                rest = &rest[1..];
            }
        }
    }
    base.extend(rest.iter().cloned());
    base
}

/// Parses one path or `use` tree at the start of `s`: returns its leaves (each a
/// list of segments) and the number of bytes read.
fn use_tree(s: &str) -> (Vec<Vec<String>>, usize) {
    let b = s.as_bytes();
    let mut segs = Vec::new();
    let mut i = 0;
    loop {
        let start = i;
        while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
            i += 1;
        }
        if i > start {
            segs.push(s[start..i].to_string());
        }
        if s[i..].starts_with("::{") {
            i += 3;
            let mut leaves = Vec::new();
            loop {
                while i < b.len() && (b[i] as char).is_whitespace() || b.get(i) == Some(&b',') {
                    i += 1;
                }
                if i >= b.len() || b[i] == b'}' {
                    i += 1;
                    break;
                }
                let (sub, used) = use_tree(&s[i..]);
                for l in sub {
                    leaves.push(segs.iter().cloned().chain(l).collect());
                }
                i += used.max(1);
            }
            return (leaves, i);
        }
        if s[i..].starts_with("::") && i > start {
            i += 2;
            continue;
        }
        return (vec![segs], i);
    }
}

/// The file that a module path names (its longest prefix that is a file), and the
/// first item name after it.
fn resolve<'a>(
    path: &'a [String],
    files: &BTreeMap<Vec<String>, usize>,
) -> Option<(usize, Option<&'a String>)> {
    (0..=path.len()).rev().find_map(|n| files.get(&path[..n]).map(|&f| (f, path.get(n))))
}

/// `pub use x::{A, B}` lines of a face: item name -> module path of its file.
fn reexports(src: &Source) -> BTreeMap<String, Vec<String>> {
    let mut out = BTreeMap::new();
    for stmt in src.code.split(';') {
        let Some(rest) = stmt.trim().strip_prefix("pub use ") else { continue };
        let rest = if rest.starts_with("self::") || rest.starts_with("super::") || rest.starts_with("crate::")
        {
            rest.to_string()
        } else {
            format!("self::{rest}")
        };
        for leaf in use_tree(&rest).0 {
            let abs = absolute(&leaf, &src.module);
            if let Some(name) = abs.last() {
                out.insert(name.clone(), abs[..abs.len() - 1].to_vec());
            }
        }
    }
    out
}

type Edges = BTreeMap<(String, String), BTreeSet<String>>;

/// The edges between nodes of one folder: (from, to) -> names used.
fn folder_edges(sources: &[Source], folder: &[String]) -> Edges {
    let files: BTreeMap<Vec<String>, usize> =
        sources.iter().enumerate().map(|(k, s)| (s.module.clone(), k)).collect();
    let node = |m: &[String], file: &Path| -> Option<String> {
        if m.len() < folder.len() || m[..folder.len()] != *folder {
            return None;
        }
        let is_face = file.file_name().is_some_and(|f| f == "mod.rs" || f == "lib.rs");
        match m.get(folder.len()) {
            None if is_face => Some("mod.rs".to_string()),
            None => None,
            Some(child) if m.len() == folder.len() + 1 && !is_face => Some(format!("{child}.rs")),
            Some(child) => Some(format!("{child}/")),
        }
    };
    let mut edges = Edges::new();
    for s in sources {
        let Some(from) = node(&s.module, &s.file) else { continue };
        let is_face = s.file.file_name().is_some_and(|f| f == "mod.rs" || f == "lib.rs");
        for p in named_paths(&s.code, &s.module, is_face) {
            let Some((mut target, mut item)) = resolve(&p, &files) else { continue };
            // A name re-exported by a face resolves to its defining file.
            if let Some(name) = item {
                if let Some(m) = reexports(&sources[target]).get(name) {
                    if let Some((t, _)) = resolve(m, &files) {
                        target = t;
                        item = Some(name);
                    }
                }
            }
            let t = &sources[target];
            let Some(to) = node(&t.module, &t.file) else { continue };
            if to != from {
                edges.entry((from.clone(), to)).or_default().insert(item.cloned().unwrap_or_default());
            }
        }
    }
    edges
}

/// The strongly connected groups of more than one node (Tarjan).
fn cycles(edges: &Edges) -> Vec<Vec<String>> {
    let nodes: BTreeSet<&String> = edges.keys().flat_map(|(a, b)| [a, b]).collect();
    let nodes: Vec<&String> = nodes.into_iter().collect();
    let idx = |n: &String| nodes.iter().position(|m| *m == n).unwrap_or(0);
    let adj: Vec<Vec<usize>> =
        nodes.iter().map(|n| edges.keys().filter(|(a, _)| a == *n).map(|(_, b)| idx(b)).collect()).collect();
    let mut state =
        Tarjan { index: vec![None; nodes.len()], low: vec![0; nodes.len()], ..Default::default() };
    for v in 0..nodes.len() {
        if state.index[v].is_none() {
            state.visit(v, &adj);
        }
    }
    state.groups.into_iter().map(|g| g.into_iter().map(|k| nodes[k].clone()).collect()).collect()
}

#[derive(Default)]
struct Tarjan {
    index: Vec<Option<usize>>,
    low: Vec<usize>,
    stack: Vec<usize>,
    next: usize,
    groups: Vec<Vec<usize>>,
}

impl Tarjan {
    fn visit(&mut self, v: usize, adj: &[Vec<usize>]) {
        self.index[v] = Some(self.next);
        self.low[v] = self.next;
        self.next += 1;
        self.stack.push(v);
        for &w in &adj[v] {
            match self.index[w] {
                None => {
                    self.visit(w, adj);
                    self.low[v] = self.low[v].min(self.low[w]);
                }
                Some(iw) if self.stack.contains(&w) => self.low[v] = self.low[v].min(iw),
                _ => {}
            }
        }
        if Some(self.low[v]) == self.index[v] {
            let mut group = Vec::new();
            while let Some(w) = self.stack.pop() {
                group.push(w);
                if w == v {
                    break;
                }
            }
            if group.len() > 1 {
                group.sort();
                self.groups.push(group);
            }
        }
    }
}

/// Every folder of host/src, as a module path.
fn folders(sources: &[Source]) -> BTreeSet<Vec<String>> {
    sources
        .iter()
        .filter(|s| s.file.file_name().is_some_and(|f| f == "mod.rs" || f == "lib.rs"))
        .map(|s| s.module.clone())
        .collect()
}

/// The cycles of every folder, each as a readable report.
fn all_cycles() -> Vec<String> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut sources = Vec::new();
    collect(&src, &src, &[], &mut sources);
    let mut reports = Vec::new();
    for folder in folders(&sources) {
        let edges = folder_edges(&sources, &folder);
        for group in cycles(&edges) {
            let ties: Vec<String> = edges
                .iter()
                .filter(|((a, b), _)| group.contains(a) && group.contains(b))
                .map(|((a, b), names)| {
                    format!("    {a} -> {b}: {}", names.iter().cloned().collect::<Vec<_>>().join(", "))
                })
                .collect();
            reports.push(format!("src/{}: {}\n{}", folder.join("/"), group.join(", "), ties.join("\n")));
        }
    }
    reports
}

#[test]
fn no_import_cycle_inside_a_folder() {
    let found = all_cycles();
    assert!(found.is_empty(), "import cycles between files of one folder:\n{}", found.join("\n"));
}

#[test]
fn the_checker_sees_a_known_cycle() {
    // x and y import each other, z closes a second loop through x; comments, strings
    // and test modules draw no edge, and a face's re-export resolves to its file.
    let module = |m: &str| m.split('/').map(str::to_string).collect::<Vec<_>>();
    let source = |m: &str, code: &str| Source {
        file: PathBuf::from(format!("src/{m}.rs")),
        module: module(m),
        code: strip(code),
    };
    let sources = vec![
        Source {
            file: PathBuf::from("src/a/mod.rs"),
            module: module("a"),
            code: strip("pub mod x; pub mod y; pub mod z; pub use x::X;"),
        },
        source("a/x", "use super::y::Y; // use super::z::Z;\n"),
        source("a/y", "use crate::a::{X, z};\nfn f() { let s = \"super::z::Z\"; }"),
        source("a/z", "fn g() { super::x::X::new(); }\n#[cfg(test)]\nmod tests { use super::super::y::Y; }"),
    ];
    let edges = folder_edges(&sources, &module("a"));
    let pairs: Vec<(String, String)> = edges.keys().cloned().collect();
    let p = |a: &str, b: &str| (a.to_string(), b.to_string());
    assert_eq!(pairs, vec![p("x.rs", "y.rs"), p("y.rs", "x.rs"), p("y.rs", "z.rs"), p("z.rs", "x.rs")]);
    assert_eq!(cycles(&edges), vec![vec!["x.rs".to_string(), "y.rs".to_string(), "z.rs".to_string()]]);
}
