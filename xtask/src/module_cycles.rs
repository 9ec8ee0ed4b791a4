//! Import cycles between the modules of a crate: two sibling modules that each use the
//! other (directly, or around a longer loop) are one idea split in two, or two ideas
//! that each know the other; either way data no longer flows one way through the crate.
//!
//! For every crate of the workspace (a directory with a `Cargo.toml` and a `src/`), every
//! `.rs` file under `src/` is a module (`src/bin/` holds separate crates and is skipped),
//! and every path that starts with `crate::`, `super::` or `self::` (in `use` trees, with
//! their `{…}` groups, and in expressions) is an edge from the file's module to the
//! deepest module the path names. A module using its own ancestor or descendant is fine;
//! any other edge is lifted to the two children of the modules' common ancestor that
//! contain them, and a strongly connected set of such siblings is a cycle.
//!
//! Limits: a path through a re-export counts as an edge to the module that re-exports
//! it, and paths without `crate::`/`super::`/`self::` (a child used by its parent,
//! external crates) are not edges. It must never change a file: it reads and reports.
//!
//! Run by the test suite (`cargo xtask test` runs the workspace's tests):
//! `cargo test -p xtask module_cycles`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module's path inside its crate (`[]` is the crate root).
type ModPath = Vec<String>;

/// One use of another module: the using module and the module used, as written.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Edge {
    /// The module whose file has the path.
    pub from: ModPath,
    /// The deepest module the path names.
    pub to: ModPath,
}

/// Sibling modules of one crate that use each other, and the uses that make the loop.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cycle {
    /// The crate's `src/` directory, relative to the root searched.
    pub src: PathBuf,
    /// The sibling modules in the loop, sorted.
    pub modules: Vec<ModPath>,
    /// Every use between modules inside them.
    pub edges: Vec<Edge>,
}

fn show(module: &[String]) -> String {
    if module.is_empty() {
        "crate".to_owned()
    } else {
        module.join("::")
    }
}

impl std::fmt::Display for Cycle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<String> = self.modules.iter().map(|m| show(m)).collect();
        writeln!(f, "{}: {}", self.src.display(), names.join(" <-> "))?;
        for e in &self.edges {
            writeln!(f, "    {} uses {}", show(&e.from), show(&e.to))?;
        }
        Ok(())
    }
}

/// The import cycles of every crate under `root` (directories named `target`, `node_modules`
/// or starting with `.` are not searched).
pub fn find_cycles(root: &Path) -> std::io::Result<Vec<Cycle>> {
    let mut cycles = Vec::new();
    for src in crate_sources(root)? {
        let modules = module_files(&src)?;
        let mut code = BTreeMap::new();
        for (module, file) in &modules {
            code.insert(module.clone(), code_only(&std::fs::read_to_string(file)?));
        }
        let aliases = module_aliases(&code, &modules);
        let mut edges = BTreeSet::new();
        for (module, text) in &code {
            for path in crate_paths(text) {
                if let Some(to) = resolve(module, &path, &modules, &aliases) {
                    edges.insert(Edge {
                        from: module.clone(),
                        to,
                    });
                }
            }
        }
        let rel = src.strip_prefix(root).unwrap_or(&src).to_path_buf();
        cycles.extend(
            sibling_cycles(&edges)
                .into_iter()
                .map(|(modules, edges)| Cycle {
                    src: rel.clone(),
                    modules,
                    edges,
                }),
        );
    }
    Ok(cycles)
}

/// `src/` directories of the crates under `root`.
fn crate_sources(root: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut found = Vec::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        if dir.join("Cargo.toml").is_file() && dir.join("src").is_dir() {
            found.push(dir.join("src"));
        }
        for entry in std::fs::read_dir(&dir)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let skip = name.starts_with('.') || name == "target" || name == "node_modules";
            if entry.file_type()?.is_dir() && !skip && name != "src" {
                dirs.push(entry.path());
            }
        }
    }
    found.sort();
    Ok(found)
}

/// Every module file under `src` by its module path (`lib.rs`/`main.rs` are the root,
/// `a/mod.rs` and `a.rs` are `a`).
fn module_files(src: &Path) -> std::io::Result<BTreeMap<ModPath, PathBuf>> {
    let mut files = BTreeMap::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            if path.is_dir() {
                if path != src.join("bin") {
                    dirs.push(path);
                }
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(src).unwrap_or(&path).with_extension("");
            let mut module: ModPath = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            let last = module.last().map(String::as_str);
            if last == Some("mod") || (module.len() == 1 && matches!(last, Some("lib" | "main"))) {
                module.pop();
            }
            files.insert(module, path);
        }
    }
    Ok(files)
}

/// The source with comments, string and character literals blanked out (lifetimes kept).
fn code_only(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            out.push(' ');
        } else if c == 'r'
            && (next == Some('"') || next == Some('#'))
            && !chars[..i]
                .last()
                .is_some_and(|p| p.is_alphanumeric() || *p == '_')
        {
            // A raw string r"…" or r#"…"#: skip to the quote and as many hashes.
            let mut j = i + 1;
            let mut hashes = 0;
            while chars.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if chars.get(j) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            j += 1;
            while j < chars.len() {
                if chars[j] == '"' && (0..hashes).all(|h| chars.get(j + 1 + h) == Some(&'#')) {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            out.push_str("\"\"");
            i = j;
        } else if c == '"' {
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                i += if chars[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
        } else if c == '\'' && (next == Some('\\') || chars.get(i + 2) == Some(&'\'')) {
            // A character literal ('x', '\n', '\u{…}'); a lifetime has no closing quote.
            i += 1;
            while i < chars.len() && chars[i] != '\'' {
                i += if chars[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("' '");
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// Identifiers and the punctuation that matters to paths.
fn tokens(code: &str) -> Vec<String> {
    let mut tokens = Vec::new();
    let chars: Vec<char> = code.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_alphabetic() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            tokens.push(chars[start..i].iter().collect());
        } else if c == ':' && chars.get(i + 1) == Some(&':') {
            tokens.push("::".to_owned());
            i += 2;
        } else if c.is_whitespace() {
            i += 1;
        } else {
            tokens.push(c.to_string());
            i += 1;
        }
    }
    tokens
}

/// Every path starting with `crate`, `super` or `self` followed by `::`, with use-tree
/// groups expanded (`crate::a::{b, c::d}` is `crate::a::b` and `crate::a::c::d`).
fn crate_paths(code: &str) -> Vec<Vec<String>> {
    let tokens = tokens(code);
    let mut paths = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        let t = tokens[i].as_str();
        let starts = matches!(t, "crate" | "super" | "self")
            && tokens.get(i + 1).map(String::as_str) == Some("::")
            && (i == 0 || tokens[i - 1] != "::");
        if starts {
            let (end, mut found) = use_tree(&tokens, i, Vec::new());
            paths.append(&mut found);
            i = end.max(i + 1);
        } else {
            i += 1;
        }
    }
    paths
}

/// Parses a path or use tree from `tokens[i]` with `prefix` before it; returns the index
/// after it and the paths it names.
fn use_tree(tokens: &[String], mut i: usize, mut prefix: Vec<String>) -> (usize, Vec<Vec<String>>) {
    let ident = |t: &str| {
        t.chars()
            .next()
            .is_some_and(|c| c.is_alphabetic() || c == '_')
    };
    loop {
        match tokens.get(i).map(String::as_str) {
            Some("{") => {
                let mut paths = Vec::new();
                i += 1;
                loop {
                    match tokens.get(i).map(String::as_str) {
                        None => return (i, paths),
                        Some("}") => return (i + 1, paths),
                        Some(",") => i += 1,
                        Some(_) => {
                            let (end, mut found) = use_tree(tokens, i, prefix.clone());
                            paths.append(&mut found);
                            i = end.max(i + 1);
                        }
                    }
                }
            }
            Some(t) if ident(t) => {
                if t != "self" || prefix.is_empty() {
                    prefix.push(t.to_owned());
                }
                i += 1;
                if tokens.get(i).map(String::as_str) == Some("::") {
                    i += 1;
                    continue;
                }
                if tokens.get(i).map(String::as_str) == Some("as") {
                    i += 2;
                }
                return (i, vec![prefix]);
            }
            // `*`, `<` (turbofish) or anything else ends the path.
            _ => return (i, vec![prefix]),
        }
    }
}

/// Names that `use` statements give to modules (`use observe::session;` in the root makes
/// `crate::session` the module `observe::session`): (the module, the name) → the module
/// it names.
type Aliases = BTreeMap<(ModPath, String), ModPath>;

fn module_aliases(
    code: &BTreeMap<ModPath, String>,
    modules: &BTreeMap<ModPath, PathBuf>,
) -> Aliases {
    let mut aliases = Aliases::new();
    for (module, text) in code {
        let tokens = tokens(text);
        for (i, _) in tokens.iter().enumerate().filter(|(_, t)| *t == "use") {
            for path in use_tree(&tokens, i + 1, Vec::new()).1 {
                let Some(name) = path.last() else { continue };
                // A path without `crate`/`super`/`self` starts at this module's child.
                let absolute: ModPath = if matches!(path[0].as_str(), "crate" | "super" | "self") {
                    path.clone()
                } else {
                    ["self".to_owned()]
                        .into_iter()
                        .chain(path.iter().cloned())
                        .collect()
                };
                let own_child = [module.clone(), vec![name.clone()]].concat();
                if let Some(target) = resolve(module, &absolute, modules, &Aliases::new())
                    && target.last() == Some(name)
                    && target != own_child
                {
                    aliases.insert((module.clone(), name.clone()), target);
                }
            }
        }
    }
    aliases
}

/// The module `path` (used in `module`) names: the longest run of its segments that is a
/// module (directly or by a `use` alias), after `crate`/`super`/`self`. `None` when it
/// names `module` itself.
fn resolve(
    module: &ModPath,
    path: &[String],
    modules: &BTreeMap<ModPath, PathBuf>,
    aliases: &Aliases,
) -> Option<ModPath> {
    let mut segments = path.iter().map(String::as_str).peekable();
    let mut base: ModPath = match segments.next()? {
        "crate" => Vec::new(),
        "self" => module.clone(),
        "super" => module[..module.len().saturating_sub(1)].to_vec(),
        _ => return None,
    };
    while segments.peek() == Some(&"super") {
        segments.next();
        base.pop();
    }
    for segment in segments {
        base.push(segment.to_owned());
        if modules.contains_key(&base) {
            continue;
        }
        base.pop();
        match aliases.get(&(base.clone(), segment.to_owned())) {
            Some(target) => base = target.clone(),
            None => break,
        }
    }
    (&base != module).then_some(base)
}

/// Lifts each edge to the siblings under the two modules' common ancestor (edges between
/// a module and its ancestor are dropped) and returns the strongly connected sets of more
/// than one sibling, each with the edges inside it.
fn sibling_cycles(edges: &BTreeSet<Edge>) -> Vec<(Vec<ModPath>, Vec<Edge>)> {
    let mut lifted: BTreeMap<ModPath, BTreeSet<ModPath>> = BTreeMap::new();
    let mut witnesses: Vec<(ModPath, ModPath, Edge)> = Vec::new();
    for e in edges {
        let common = e.from.iter().zip(&e.to).take_while(|(a, b)| a == b).count();
        if common == e.from.len() || common == e.to.len() {
            continue;
        }
        let (a, b) = (e.from[..=common].to_vec(), e.to[..=common].to_vec());
        lifted.entry(a.clone()).or_default().insert(b.clone());
        lifted.entry(b.clone()).or_default();
        witnesses.push((a, b, e.clone()));
    }
    let mut cycles = Vec::new();
    for component in strongly_connected(&lifted) {
        if component.len() < 2 {
            continue;
        }
        let members: BTreeSet<&ModPath> = component.iter().collect();
        let inside = witnesses
            .iter()
            .filter(|(a, b, _)| members.contains(a) && members.contains(b))
            .map(|(_, _, e)| e.clone())
            .collect();
        let mut modules = component;
        modules.sort();
        cycles.push((modules, inside));
    }
    cycles.sort();
    cycles
}

/// Tarjan's strongly connected components (iteratively: module graphs are small, but a
/// recursion would be the only one in xtask).
fn strongly_connected(graph: &BTreeMap<ModPath, BTreeSet<ModPath>>) -> Vec<Vec<ModPath>> {
    let nodes: Vec<&ModPath> = graph.keys().collect();
    let index_of: BTreeMap<&ModPath, usize> =
        nodes.iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let successors: Vec<Vec<usize>> = nodes
        .iter()
        .map(|n| graph[*n].iter().map(|s| index_of[s]).collect())
        .collect();
    let n = nodes.len();
    let (mut index, mut low, mut on_stack) = (vec![usize::MAX; n], vec![0; n], vec![false; n]);
    let (mut stack, mut components, mut next_index) = (Vec::new(), Vec::new(), 0);
    for root in 0..n {
        if index[root] != usize::MAX {
            continue;
        }
        // (node, next successor to visit)
        let mut work = vec![(root, 0)];
        while let Some(&mut (v, ref mut k)) = work.last_mut() {
            if *k == 0 && index[v] == usize::MAX {
                index[v] = next_index;
                low[v] = next_index;
                next_index += 1;
                stack.push(v);
                on_stack[v] = true;
            }
            if let Some(&w) = successors[v].get(*k) {
                *k += 1;
                if index[w] == usize::MAX {
                    work.push((w, 0));
                } else if on_stack[w] {
                    low[v] = low[v].min(index[w]);
                }
                continue;
            }
            work.pop();
            if let Some(&(parent, _)) = work.last() {
                low[parent] = low[parent].min(low[v]);
            }
            if low[v] == index[v] {
                let mut component = Vec::new();
                while let Some(w) = stack.pop() {
                    on_stack[w] = false;
                    component.push(nodes[w].clone());
                    if w == v {
                        break;
                    }
                }
                components.push(component);
            }
        }
    }
    components
}

#[cfg(test)]
mod tests {
    use super::*;

    fn module(path: &str) -> ModPath {
        path.split("::")
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect()
    }

    /// A crate in a fresh directory: `files` are (path under src/, text).
    fn fake_crate(name: &str, files: &[(&str, &str)]) -> PathBuf {
        let root =
            std::env::temp_dir().join(format!("module-cycles-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for (path, text) in files {
            let file = root.join("c/src").join(path);
            std::fs::create_dir_all(file.parent().unwrap()).unwrap();
            std::fs::write(file, text).unwrap();
        }
        std::fs::write(root.join("c/Cargo.toml"), "[package]\n").unwrap();
        root
    }

    #[test]
    fn use_trees_expand_and_comments_and_strings_do_not_count() {
        let code = code_only(
            "use crate::a::{b, c::{d as e, self}, *};\n\
             // use crate::z;\n\
             let s = \"crate::y::q\"; let c = '\\''; fn f<'a>(x: &'a u8) {}\n\
             super::super::m::f(); self::n::<u8>();",
        );
        let paths: Vec<String> = crate_paths(&code).iter().map(|p| p.join("::")).collect();
        assert_eq!(
            paths,
            [
                "crate::a::b",
                "crate::a::c::d",
                "crate::a::c",
                "crate::a",
                "super::super::m::f",
                "self::n"
            ]
        );
    }

    #[test]
    fn finds_a_two_and_a_three_module_loop_but_not_parents_and_children() {
        let root = fake_crate(
            "loops",
            &[
                ("lib.rs", "mod a; mod b; mod p; mod x; mod y; mod z;"),
                ("a.rs", "use crate::b::thing;"),
                ("b.rs", "pub fn thing() { crate::a::other() }"),
                // A parent using its child and the child its parent: no cycle.
                ("p/mod.rs", "mod child; use self::child::C;"),
                ("p/child.rs", "use super::P; use crate::p::Q;"),
                ("x.rs", "use super::y::Y;"),
                ("y.rs", "use crate::z::{Z, self};"),
                // z's child uses x: lifted to z -> x, closing x -> y -> z -> x.
                ("z/mod.rs", "mod deep;"),
                ("z/deep.rs", "fn f() { super::super::x::g() }"),
            ],
        );
        let cycles = find_cycles(&root).unwrap();
        std::fs::remove_dir_all(&root).unwrap();
        let found: Vec<Vec<ModPath>> = cycles.iter().map(|c| c.modules.clone()).collect();
        assert_eq!(
            found,
            vec![
                vec![module("a"), module("b")],
                vec![module("x"), module("y"), module("z")],
            ]
        );
        assert!(cycles[1].edges.contains(&Edge {
            from: module("z::deep"),
            to: module("x"),
        }));
    }

    /// Cycles allowed to stay: (crate's `src/`, its sibling modules). None is: the check
    /// fails on any cycle, and on a listed one that is gone, so this list only shrinks.
    const KNOWN_CYCLES: &[(&str, &[&str])] = &[];

    #[test]
    fn no_crate_has_an_import_cycle_between_its_modules() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("xtask/ has a parent");
        let cycles = find_cycles(root).unwrap();
        let report: String = cycles.iter().map(ToString::to_string).collect();
        let found: Vec<(String, Vec<String>)> = cycles
            .iter()
            .map(|c| {
                let modules = c.modules.iter().map(|m| show(m)).collect();
                (c.src.display().to_string(), modules)
            })
            .collect();
        let known: Vec<(String, Vec<String>)> = KNOWN_CYCLES
            .iter()
            .map(|(src, modules)| {
                (
                    src.to_string(),
                    modules.iter().map(|m| m.to_string()).collect(),
                )
            })
            .collect();
        assert_eq!(
            found, known,
            "import cycles between modules (a new one must be cut; a listed one that is \
             gone must leave KNOWN_CYCLES):\n{report}"
        );
    }
}
