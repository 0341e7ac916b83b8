//! No module of a crate depends, through the others, on itself: every `crate::` and `super::`
//! path in a crate's non-test code is an edge from the module that names it to the module it
//! names (its longest prefix that is a module file), parents and children left out (a module
//! and its own submodules are one unit), and the graph has no cycle. A cycle is how a layer
//! comes to reach upward (a trainer's helpers used by the model it trains); this keeps the
//! crates layered as docs/DESIGN.md draws them.
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The crates' source folders, relative to the workspace.
const CRATES: &[&str] =
    &["engine/src", "kernels/src", "data/src", "apps/fastfold/src", "apps/diffusion/src", "apps/vit/src", "tests/src"];

type Module = Vec<String>;

/// The module a file is (`a/b.rs` and `a/b/mod.rs` are `a::b`; `lib.rs` and `main.rs` the root).
fn module_of(src: &Path, file: &Path) -> Module {
    let rel = file.strip_prefix(src).expect("a file under its crate's folder").with_extension("");
    let mut parts: Module = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib" | "main")) {
        parts.pop();
    }
    parts
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.expect("a folder entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `text` without comments, string literals and the inline test module (its `use` lines
/// are the tests', not the module's).
fn code_of(text: &str) -> String {
    // The test module, however visible (`mod tests`, `pub(super) mod tests`, ...).
    let test_module = text.match_indices("#[cfg(test)]\n").map(|(at, _)| at).find(|&at| {
        let line = text[at..].lines().nth(1).unwrap_or("");
        line.starts_with("mod tests") || (line.starts_with("pub") && line.contains(" mod tests"))
    });
    let text = match test_module {
        Some(at) => &text[..at],
        None => text,
    };
    let (bytes, mut out, mut i) = (text.as_bytes(), String::with_capacity(text.len()), 0);
    while i < bytes.len() {
        if text[i..].starts_with("//") {
            i = text[i..].find('\n').map_or(bytes.len(), |n| i + n);
        } else if text[i..].starts_with("/*") {
            i = text[i + 2..].find("*/").map_or(bytes.len(), |n| i + n + 4);
        } else if let Some(hashes) = raw_string_at(&text[i..]).filter(|_| i == 0 || !is_ident(bytes[i - 1])) {
            let close = format!("\"{}", "#".repeat(hashes));
            let body = i + 2 + hashes;
            i = text[body..].find(&close).map_or(bytes.len(), |n| body + n + close.len());
        } else if bytes[i] == b'"' && (i == 0 || bytes[i - 1] != b'\'') {
            i += 1;
            while i < bytes.len() && bytes[i] != b'"' {
                i += if bytes[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
        } else {
            let c = text[i..].chars().next().expect("a character");
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

fn is_ident(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// How many `#`s open the raw string literal at the start of `s` (`r"`, `r#"`, ...), if one does.
fn raw_string_at(s: &str) -> Option<usize> {
    let rest = s.strip_prefix('r')?;
    let hashes = rest.len() - rest.trim_start_matches('#').len();
    rest[hashes..].starts_with('"').then_some(hashes)
}

/// The paths a use tree starting at `s` names (`a::b`, `a::{b, c::d}`, `a::{self, b}`), each
/// as segments after `prefix`; returns them and where the tree ends.
fn use_tree(s: &[char], mut i: usize, prefix: Module) -> (Vec<Module>, usize) {
    let skip_ws = |i: &mut usize| {
        while *i < s.len() && s[*i].is_whitespace() {
            *i += 1;
        }
    };
    let mut path = prefix;
    loop {
        skip_ws(&mut i);
        if i < s.len() && s[i] == '{' {
            let mut all = Vec::new();
            i += 1;
            loop {
                skip_ws(&mut i);
                if i >= s.len() || s[i] == '}' {
                    return (all, i + 1);
                }
                let (inner, end) = use_tree(s, i, path.clone());
                all.extend(inner);
                i = end;
                skip_ws(&mut i);
                if i < s.len() && s[i] == ',' {
                    i += 1;
                }
            }
        }
        let start = i;
        while i < s.len() && (s[i].is_alphanumeric() || s[i] == '_') {
            i += 1;
        }
        let segment: String = s[start..i].iter().collect();
        if !segment.is_empty() && segment != "self" {
            path.push(segment);
        }
        if s.get(i) == Some(&':') && s.get(i + 1) == Some(&':') {
            i += 2;
        } else {
            return (vec![path], i);
        }
    }
}

/// Every module path `code` (module `me`'s) names through `crate::` or `super::`.
fn named_paths(code: &str, me: &Module) -> Vec<Module> {
    let s: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < s.len() {
        let word_start = i == 0 || !(s[i - 1].is_alphanumeric() || s[i - 1] == '_' || s[i - 1] == ':');
        let rest: String = s[i..(i + 7).min(s.len())].iter().collect();
        let base = if !word_start {
            None
        } else if rest.starts_with("crate::") {
            i += 7;
            Some(Module::new())
        } else if rest.starts_with("super::") {
            let mut up = me.clone();
            while s[i..].starts_with(&['s', 'u', 'p', 'e', 'r', ':', ':']) {
                up.pop();
                i += 7;
            }
            Some(up)
        } else {
            None
        };
        match base {
            Some(prefix) => {
                let (paths, end) = use_tree(&s, i, prefix);
                out.extend(paths);
                i = end.max(i + 1);
            }
            None => i += 1,
        }
    }
    out
}

/// The cycles among `edges` (each once, as the modules around it).
fn cycles(edges: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<Vec<Module>> {
    // Modules that reach themselves, grouped by the set they reach each other in.
    let reach = |from: &Module| -> BTreeSet<Module> {
        let mut seen = BTreeSet::new();
        let mut todo: Vec<&Module> = edges.get(from).into_iter().flatten().collect();
        while let Some(m) = todo.pop() {
            if seen.insert(m.clone()) {
                todo.extend(edges.get(m).into_iter().flatten());
            }
        }
        seen
    };
    let reached: BTreeMap<&Module, BTreeSet<Module>> = edges.keys().map(|m| (m, reach(m))).collect();
    let mut out: Vec<Vec<Module>> = Vec::new();
    for (m, r) in &reached {
        if !r.contains(*m) || out.iter().any(|c| c.contains(m)) {
            continue;
        }
        let component =
            reached.iter().filter(|(n, nr)| r.contains(**n) && nr.contains(*m)).map(|(n, _)| (*n).clone()).collect();
        out.push(component);
    }
    out
}

#[test]
fn no_crate_has_a_module_cycle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace");
    let mut found = Vec::new();
    for crate_src in CRATES {
        let src = root.join(crate_src);
        let mut files = Vec::new();
        rust_files(&src, &mut files);
        let modules: BTreeSet<Module> = files.iter().map(|f| module_of(&src, f)).collect();
        let mut edges: BTreeMap<Module, BTreeSet<Module>> = BTreeMap::new();
        for file in &files {
            let me = module_of(&src, file);
            let text = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            for path in named_paths(&code_of(&text), &me) {
                let Some(target) = (1..=path.len()).rev().map(|k| path[..k].to_vec()).find(|p| modules.contains(p))
                else {
                    continue;
                };
                // A module and its own submodules are one unit.
                if me.starts_with(&target) || target.starts_with(&me) {
                    continue;
                }
                edges.entry(me.clone()).or_default().insert(target);
            }
        }
        for cycle in cycles(&edges) {
            let name = |m: &Module| if m.is_empty() { "(root)".to_string() } else { m.join("::") };
            let inside: Vec<String> = cycle
                .iter()
                .flat_map(|a| {
                    let names =
                        edges[a].iter().filter(|b| cycle.contains(b)).map(|b| format!("{} -> {}", name(a), name(b)));
                    names.collect::<Vec<_>>()
                })
                .collect();
            found.push(format!("{crate_src}: {}", inside.join(", ")));
        }
    }
    assert!(
        found.is_empty(),
        "module cycles (break each by moving what both use where it belongs):\n{}",
        found.join("\n")
    );
}

#[test]
fn the_reader_sees_uses_and_paths() {
    let me: Module = vec!["train".into()];
    let code = code_of(
        "use crate::{layout::Layout, mesh::{self, Mesh}};\n// use crate::commented::Out;\nlet s = \"crate::in_a_string\";\nlet r = r#\"crate::raw \"quoted\"\"#;\nfn f() { super::sibling::g(); crate::model::soft(1); }\n",
    );
    let names: Vec<String> = named_paths(&code, &me).iter().map(|p| p.join("::")).collect();
    assert_eq!(names, ["layout::Layout", "mesh", "mesh::Mesh", "sibling::g", "model::soft"]);
    let a: Module = vec!["a".into()];
    let b: Module = vec!["b".into()];
    let c: Module = vec!["c".into()];
    let edges = BTreeMap::from([
        (a.clone(), BTreeSet::from([b.clone()])),
        (b.clone(), BTreeSet::from([a.clone(), c.clone()])),
        (c.clone(), BTreeSet::new()),
    ]);
    assert_eq!(cycles(&edges), vec![vec![a, b]]);
}
