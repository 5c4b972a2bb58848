//! The module layout keeps data flowing one way: no module of `src/` imports a module that,
//! directly or through others, imports it back. Checked on two levels: between files, and
//! between the top-level modules (`outbound`, `identity`, ...). Test-only code is left out.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

type ModPath = Vec<String>;

/// Every module file of the library, by module path (`outbound/cluster.rs` is
/// `["outbound", "cluster"]`), with its non-test source.
fn modules() -> BTreeMap<ModPath, String> {
    fn walk(dir: &Path, prefix: &ModPath, out: &mut BTreeMap<ModPath, String>) {
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        entries.sort();
        for p in entries {
            let name = p.file_stem().unwrap().to_str().unwrap().to_string();
            if p.is_dir() {
                let mut sub = prefix.clone();
                sub.push(name);
                walk(&p, &sub, out);
            } else if p.extension().is_some_and(|e| e == "rs") {
                let path = match name.as_str() {
                    "mod" | "lib" => prefix.clone(),
                    "main" if prefix.is_empty() => continue, // the binary, not the library
                    // A `tests.rs` file is a test module.
                    "tests" => continue,
                    _ => {
                        let mut m = prefix.clone();
                        m.push(name);
                        m
                    }
                };
                out.insert(path, non_test_code(&std::fs::read_to_string(&p).unwrap()));
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        &Vec::new(),
        &mut out,
    );
    out
}

/// The source without comment lines and without the `#[cfg(test)]` module at its end.
fn non_test_code(src: &str) -> String {
    let mut out = String::new();
    for line in src.lines() {
        let t = line.trim_start();
        if t.starts_with("#[cfg(test)]") {
            break;
        }
        if t.starts_with("//") {
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

fn is_ident_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// The module paths a file refers to, as written: `crate::a::b`, `super::x`, `self::y`,
/// `$crate::z`, groups `crate::{a, b}`, and (in files with submodules) `child::item`.
fn references(code: &str, here: &ModPath, children: &BTreeSet<String>) -> Vec<ModPath> {
    let parent: ModPath = here[..here.len().saturating_sub(1)].to_vec();
    let bytes = code.as_bytes();
    let mut refs = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if !is_ident_byte(bytes[i]) || (i > 0 && is_ident_byte(bytes[i - 1])) {
            i += 1;
            continue;
        }
        let start = i;
        while i < bytes.len() && is_ident_byte(bytes[i]) {
            i += 1;
        }
        let first = &code[start..i];
        if !code[i..].starts_with("::") || (start > 0 && bytes[start - 1] == b':') {
            continue;
        }
        let base: ModPath = match first {
            "crate" => Vec::new(),
            "super" => parent.clone(),
            "self" => here.clone(),
            c if children.contains(c) => {
                let mut m = here.clone();
                m.push(c.to_string());
                m
            }
            _ => continue,
        };
        // Then `::seg::seg...` or `::{a, b::c}`.
        let mut segs: Vec<Vec<String>> = vec![Vec::new()];
        let mut j = i;
        while code[j..].starts_with("::") {
            j += 2;
            if code[j..].starts_with('{') {
                let end = code[j..].find('}').map_or(code.len(), |e| j + e);
                let group: Vec<Vec<String>> = code[j + 1..end]
                    .split(',')
                    .map(|p| {
                        p.split("::")
                            .map(|s| s.trim().to_string())
                            .filter(|s| !s.is_empty() && s != "self")
                            .collect()
                    })
                    .collect();
                let prefix = segs.pop().unwrap_or_default();
                segs = group
                    .into_iter()
                    .map(|g| prefix.iter().cloned().chain(g).collect())
                    .collect();
                j = end;
                break;
            }
            let s = j;
            while j < bytes.len() && is_ident_byte(bytes[j]) {
                j += 1;
            }
            if s == j {
                break;
            }
            segs[0].push(code[s..j].to_string());
        }
        for seg in segs {
            let mut m = base.clone();
            m.extend(seg);
            refs.push(m);
        }
        i = j.max(i);
    }
    refs
}

/// The deepest existing module on `path`.
fn resolve(path: &ModPath, modules: &BTreeMap<ModPath, String>) -> ModPath {
    let mut best = Vec::new();
    for n in 0..=path.len() {
        if modules.contains_key(&path[..n].to_vec()) {
            best = path[..n].to_vec();
        }
    }
    best
}

fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn dfs(
        n: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(n.to_string(), 1);
        stack.push(n.to_string());
        for m in graph.get(n).into_iter().flatten() {
            match state.get(m.as_str()).copied().unwrap_or(0) {
                1 => {
                    let at = stack.iter().position(|x| x == m).unwrap();
                    let mut cycle = stack[at..].to_vec();
                    cycle.push(m.clone());
                    return Some(cycle);
                }
                0 => {
                    if let Some(c) = dfs(m, graph, state, stack) {
                        return Some(c);
                    }
                }
                _ => {}
            }
        }
        stack.pop();
        state.insert(n.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for n in graph.keys() {
        if state.get(n.as_str()).copied().unwrap_or(0) == 0 {
            if let Some(c) = dfs(n, graph, &mut state, &mut Vec::new()) {
                return Some(c);
            }
        }
    }
    None
}

fn name(m: &ModPath) -> String {
    if m.is_empty() {
        "crate".into()
    } else {
        m.join("::")
    }
}

/// (file-level graph, top-level graph)
fn graphs() -> (
    BTreeMap<String, BTreeSet<String>>,
    BTreeMap<String, BTreeSet<String>>,
) {
    let modules = modules();
    let mut files: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut top: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (here, code) in &modules {
        let children: BTreeSet<String> = modules
            .keys()
            .filter(|k| k.len() == here.len() + 1 && k.starts_with(here))
            .map(|k| k[here.len()].clone())
            .collect();
        for r in references(code, here, &children) {
            let to = resolve(&r, &modules);
            if &to == here {
                continue;
            }
            // `mod x;` in a parent is a declaration, not an import; only uses count.
            files.entry(name(here)).or_default().insert(name(&to));
            if let (Some(a), Some(b)) = (here.first(), to.first()) {
                if a != b {
                    top.entry(a.clone()).or_default().insert(b.clone());
                }
            }
        }
    }
    (files, top)
}

#[test]
fn no_file_imports_a_file_that_imports_it_back() {
    let (files, _) = graphs();
    assert!(
        files
            .get("outbound")
            .is_some_and(|e| e.contains("outbound::cluster")),
        "the scan must see outbound/mod.rs use outbound/cluster.rs: {files:?}"
    );
    assert_eq!(find_cycle(&files), None, "import cycle between files");
}

#[test]
fn no_top_level_module_imports_one_that_imports_it_back() {
    let (_, top) = graphs();
    assert!(
        top.get("outbound").is_some_and(|e| e.contains("catalog")),
        "the scan must see outbound use catalog: {top:?}"
    );
    assert_eq!(
        find_cycle(&top),
        None,
        "import cycle between top-level modules"
    );
}

#[test]
fn the_cycle_finder_finds_cycles() {
    let g: BTreeMap<String, BTreeSet<String>> = [
        ("a".to_string(), BTreeSet::from(["b".to_string()])),
        ("b".to_string(), BTreeSet::from(["c".to_string()])),
        ("c".to_string(), BTreeSet::from(["a".to_string()])),
    ]
    .into_iter()
    .collect();
    assert_eq!(
        find_cycle(&g),
        Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
    );
    let here = vec!["outbound".to_string(), "forward".to_string()];
    let refs = references(
        "use super::pool::{self, Conn};\nuse crate::{catalog::Labels, http::answer::Reason};\n",
        &here,
        &BTreeSet::new(),
    );
    assert!(
        refs.contains(&vec!["outbound".into(), "pool".into(), "Conn".into()]),
        "{refs:?}"
    );
    assert!(
        refs.contains(&vec!["catalog".into(), "Labels".into()]),
        "{refs:?}"
    );
    assert!(
        refs.contains(&vec!["http".into(), "answer".into(), "Reason".into()]),
        "{refs:?}"
    );
}
