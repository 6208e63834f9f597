//! The rules the dependency graph can show: the host agent depends on no
//! database driver, and no context crate depends on another context crate.
//! Read from `cargo metadata`, so a new dependency that breaks a rule fails here.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use serde_json::Value;

const DATABASE_CRATES: &[&str] = &[
    "sqlx",
    "sqlx-core",
    "sqlx-postgres",
    "tokio-postgres",
    "postgres",
    "refinery",
    "refinery-core",
    "diesel",
    "sea-orm",
];
const CONTEXTS: &[&str] = &[
    "mesh-inventory",
    "mesh-identity",
    "mesh-config",
    "mesh-connectivity",
    "mesh-provisioning",
    "mesh-delivery",
    "mesh-observability",
];

struct Graph {
    names: BTreeMap<String, String>,
    /// Package id → ids of its normal and build dependencies (dev excluded).
    deps: BTreeMap<String, Vec<String>>,
}

fn graph() -> Graph {
    let out = Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--manifest-path"])
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/../Cargo.toml"))
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: Value = serde_json::from_slice(&out.stdout).expect("metadata is JSON");
    let names = meta["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .map(|p| {
            (
                p["id"].as_str().unwrap_or_default().to_owned(),
                p["name"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    let deps = meta["resolve"]["nodes"]
        .as_array()
        .expect("resolve nodes")
        .iter()
        .map(|n| {
            let ids = n["deps"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|d| {
                    d["dep_kinds"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .any(|k| k["kind"].as_str() != Some("dev"))
                })
                .filter_map(|d| d["pkg"].as_str().map(str::to_owned))
                .collect();
            (n["id"].as_str().unwrap_or_default().to_owned(), ids)
        })
        .collect();
    Graph { names, deps }
}

impl Graph {
    fn id(&self, name: &str) -> Option<&String> {
        self.names
            .iter()
            .find(|(_, n)| n.as_str() == name)
            .map(|(id, _)| id)
    }

    /// Names of everything `name` depends on, transitively, dev-dependencies excluded.
    fn closure(&self, name: &str) -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut todo: Vec<&String> = self.id(name).into_iter().collect();
        while let Some(id) = todo.pop() {
            for dep in self.deps.get(id).into_iter().flatten() {
                if seen.insert(dep.clone()) {
                    todo.push(dep);
                }
            }
        }
        seen.iter()
            .filter_map(|id| self.names.get(id).cloned())
            .collect()
    }
}

#[test]
fn the_host_agent_depends_on_no_database_driver() {
    let g = graph();
    let closure = g.closure("mesh-host-agent");
    assert!(
        closure.contains("lapin"),
        "the closure was computed (the agent uses lapin)"
    );
    let bad: Vec<_> = DATABASE_CRATES
        .iter()
        .filter(|c| closure.contains(**c))
        .collect();
    assert!(
        bad.is_empty(),
        "mesh-host-agent depends on database crates: {bad:?}"
    );
}

#[test]
fn no_context_depends_on_another_context() {
    let g = graph();
    let present: Vec<_> = CONTEXTS.iter().filter(|c| g.id(c).is_some()).collect();
    assert!(present.len() >= 2, "contexts found: {present:?}");
    for ctx in &present {
        let closure = g.closure(ctx);
        assert!(closure.contains("mesh-plumbing"), "{ctx} closure computed");
        for other in &present {
            assert!(
                other == ctx || !closure.contains(**other),
                "{ctx} depends on {other}"
            );
        }
    }
}

/// Production crates: everything in the workspace but the test crates.
fn production_crates(g: &Graph) -> Vec<String> {
    const TEST_CRATES: &[&str] = &["mesh-testkit", "mesh-e2e", "mesh-bench", "mesh-soak"];
    g.names
        .values()
        .filter(|n| n.starts_with("mesh-") && !TEST_CRATES.contains(&n.as_str()))
        .cloned()
        .collect()
}

#[test]
fn no_production_crate_depends_on_the_test_kit() {
    let g = graph();
    let production = production_crates(&g);
    assert!(
        production.iter().any(|c| c == "mesh-bundle"),
        "workspace crates found: {production:?}"
    );
    for krate in &production {
        assert!(
            !g.closure(krate).contains("mesh-testkit"),
            "{krate} depends on mesh-testkit (tests only: make it a dev-dependency)"
        );
    }
}

#[test]
fn credential_files_have_one_definition_shared_by_writers_and_readers() {
    let g = graph();
    // The writers (bundle, mesh-agent join) and the readers (controller, agent)
    // share mesh-credentials...
    for krate in ["mesh-bundle", "mesh-controller", "mesh-host-agent"] {
        assert!(
            g.closure(krate).contains("mesh-credentials"),
            "{krate} does not use mesh-credentials"
        );
    }
    // ...which the host agent can depend on: no database driver, no broker client.
    let closure = g.closure("mesh-credentials");
    assert!(closure.contains("mesh-protocol"), "closure computed");
    for banned in DATABASE_CRATES
        .iter()
        .chain(&["lapin", "mesh-bundle", "tokio"])
    {
        assert!(
            !closure.contains(*banned),
            "mesh-credentials depends on {banned}"
        );
    }
}

// ---------------------------------------------------------------------------
// No circle between a crate's top-level modules.
//
// A module reaches another through `crate::<module>` (or `super::` climbing to
// the crate root). Read from the sources: each crate's `src/*.rs` and
// `src/<module>/` (its `mod.rs` and the files under it belong to `<module>`);
// `lib.rs`, `main.rs` and `src/bin/` are roots, not modules. Comments and
// string literals are not read.

/// Crates that still have a circle, each with why. Empty is the goal: a crate
/// listed here that no longer has one fails too, so the list cannot go stale.
/// Crates allowed a circle, with why (none: the agent's was broken when it
/// was split into rooms, issue 31).
const KNOWN_CIRCLES: &[(&str, &str)] = &[];

fn workspace_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The workspace members' directories, from the root Cargo.toml.
fn member_dirs() -> Vec<String> {
    let text = std::fs::read_to_string(workspace_root().join("Cargo.toml")).expect("Cargo.toml");
    let manifest: toml::Table = text.parse().expect("Cargo.toml is TOML");
    manifest["workspace"]["members"]
        .as_array()
        .expect("workspace.members")
        .iter()
        .filter_map(|m| m.as_str().map(str::to_owned))
        .collect()
}

/// `text` with comments, string and char literals blanked (newlines kept).
fn code_only(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        let rest = &text[i..];
        if rest.starts_with("//") {
            let end = rest.find('\n').unwrap_or(rest.len());
            i += end;
        } else if rest.starts_with("/*") {
            let mut depth = 0;
            let mut j = i;
            while j < b.len() {
                if text[j..].starts_with("/*") {
                    depth += 1;
                    j += 2;
                } else if text[j..].starts_with("*/") {
                    depth -= 1;
                    j += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if b[j] == b'\n' {
                        out.push('\n');
                    }
                    j += 1;
                }
            }
            i = j;
        } else if let Some(hashes) = raw_string_start(rest) {
            let open = 2 + hashes + usize::from(rest.starts_with("br"));
            let close = format!("\"{}", "#".repeat(hashes));
            let end = rest[open..]
                .find(&close)
                .map_or(rest.len(), |e| open + e + close.len());
            out.extend(rest[..end].chars().filter(|c| *c == '\n'));
            out.push_str("\"\"");
            i += end;
        } else if b[i] == b'"' {
            let mut j = i + 1;
            while j < b.len() && b[j] != b'"' {
                if b[j] == b'\n' {
                    out.push('\n');
                }
                j += if b[j] == b'\\' { 2 } else { 1 };
            }
            out.push_str("\"\"");
            i = j + 1;
        } else if b[i] == b'\'' {
            // A char literal ('x', '\n', '\u{..}') or a lifetime ('a).
            let after = &rest[1..];
            let lit = if after.starts_with('\\') {
                after[2..].find('\'').map(|e| e + 4)
            } else {
                let c = after.chars().next().map_or(1, char::len_utf8);
                (after[c..].starts_with('\'')).then_some(c + 2)
            };
            match lit {
                Some(len) => {
                    out.push_str("' '");
                    i += len;
                }
                None => {
                    out.push('\'');
                    i += 1;
                }
            }
        } else {
            let c = rest.chars().next().expect("not at the end");
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

/// The number of `#`s of a raw string literal starting here (`r"`, `r#"`, `br"`).
fn raw_string_start(rest: &str) -> Option<usize> {
    let r = rest.strip_prefix('b').unwrap_or(rest).strip_prefix('r')?;
    let hashes = r.len() - r.trim_start_matches('#').len();
    r[hashes..].starts_with('"').then_some(hashes)
}

fn ident_at(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// The first segments after `prefix::` in each occurrence: `a` of
/// `crate::a::b`, and `a`, `b` of `crate::{a::x, b}`.
fn first_segments(code: &str, at: usize) -> Vec<String> {
    let rest = code[at..].trim_start();
    if let Some(group) = rest.strip_prefix('{') {
        let mut depth = 0;
        let mut names = Vec::new();
        let mut item_start = true;
        for (k, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => break,
                '}' => depth -= 1,
                ',' if depth == 0 => item_start = true,
                c if c.is_whitespace() => {}
                _ if item_start && depth == 0 => {
                    names.push(ident_at(&group[k..]).to_owned());
                    item_start = false;
                }
                _ => {}
            }
        }
        names
    } else {
        vec![ident_at(rest).to_owned()]
    }
}

/// The top-level modules `file`'s code reaches. `path` is the file's module
/// path inside the crate (`["units", "probes"]` for `src/units/probes.rs`).
fn reached(code: &str, path: &[String]) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    // Inline modules (`mod tests { .. }`) deepen `super::`; track them by brace depth.
    let mut inline: Vec<usize> = Vec::new();
    let mut depth = 0usize;
    let b = code.as_bytes();
    let is_ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut i = 0;
    while i < b.len() {
        let before_ok = i == 0 || !is_ident(b[i - 1]);
        let rest = &code[i..];
        if b[i] == b'{' {
            depth += 1;
        } else if b[i] == b'}' {
            depth = depth.saturating_sub(1);
            if inline.last() == Some(&depth) {
                inline.pop();
            }
        } else if before_ok && rest.starts_with("mod ") {
            let name = ident_at(rest[4..].trim_start());
            let after = rest[4..].trim_start()[name.len()..].trim_start();
            if after.starts_with('{') {
                inline.push(depth);
            }
        } else if before_ok && rest.starts_with("crate::") && (i < 2 || &code[i - 2..i] != "$") {
            out.extend(first_segments(code, i + "crate::".len()));
        } else if before_ok && rest.starts_with("super::") {
            let mut ups = 0;
            let mut j = i;
            while code[j..].starts_with("super::") {
                ups += 1;
                j += "super::".len();
            }
            let here = path.len() + inline.len();
            if ups == here {
                out.extend(first_segments(code, j));
            } else if ups < here && ups >= inline.len() {
                // Still inside the file's own top-level module, or below it.
            }
            i = j;
            continue;
        }
        i += 1;
    }
    out
}

/// Each top-level module of the crate at `dir` and the others it reaches.
fn module_graph(dir: &std::path::Path) -> BTreeMap<String, BTreeSet<String>> {
    let src = dir.join("src");
    let mut files: Vec<(String, Vec<String>, std::path::PathBuf)> = Vec::new();
    let Ok(entries) = std::fs::read_dir(&src) else {
        return BTreeMap::new();
    };
    for entry in entries.flatten() {
        let p = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if p.is_dir() && name != "bin" {
            let mut todo = vec![(p, vec![name.clone()])];
            while let Some((d, path)) = todo.pop() {
                for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
                    let f = e.file_name().to_string_lossy().into_owned();
                    if e.path().is_dir() {
                        let mut sub = path.clone();
                        sub.push(f);
                        todo.push((e.path(), sub));
                    } else if let Some(stem) = f.strip_suffix(".rs") {
                        let mut sub = path.clone();
                        if stem != "mod" {
                            sub.push(stem.to_owned());
                        }
                        files.push((name.clone(), sub, e.path()));
                    }
                }
            }
        } else if let Some(stem) = name.strip_suffix(".rs")
            && stem != "lib"
            && stem != "main"
        {
            files.push((stem.to_owned(), vec![stem.to_owned()], p));
        }
    }
    let modules: BTreeSet<String> = files.iter().map(|(m, ..)| m.clone()).collect();
    let mut graph: BTreeMap<String, BTreeSet<String>> = modules
        .iter()
        .map(|m| (m.clone(), BTreeSet::new()))
        .collect();
    for (module, path, file) in &files {
        let text = std::fs::read_to_string(file).expect("source is UTF-8");
        let reach = reached(&code_only(&text), path);
        let edges = graph.get_mut(module).expect("module listed");
        edges.extend(
            reach
                .into_iter()
                .filter(|r| r != module && modules.contains(r)),
        );
    }
    graph
}

/// The strongly connected components of more than one module (Tarjan).
fn circles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct State<'a> {
        graph: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a str) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on_stack.insert(v);
        for w in &s.graph[v] {
            let w = w.as_str();
            if !s.index.contains_key(w) {
                visit(s, w);
                let lw = s.low[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(lw);
            } else if s.on_stack.contains(w) {
                let iw = s.index[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                component.push(w.to_owned());
                if w == v {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                s.out.push(component);
            }
        }
    }
    let mut s = State {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !s.index.contains_key(v.as_str()) {
            visit(&mut s, v);
        }
    }
    s.out
}

/// The edges of a circle, `a -> b`, for the failure message.
fn describe(graph: &BTreeMap<String, BTreeSet<String>>, circle: &[String]) -> String {
    let mut edges = Vec::new();
    for a in circle {
        for b in &graph[a] {
            if circle.contains(b) {
                edges.push(format!("{a} -> {b}"));
            }
        }
    }
    format!("{} ({})", circle.join(", "), edges.join(", "))
}

#[test]
fn no_circle_between_a_crates_top_level_modules() {
    let mut found = Vec::new();
    let mut crates_read = 0;
    for member in member_dirs() {
        let graph = module_graph(&workspace_root().join(&member));
        crates_read += usize::from(!graph.is_empty());
        let known = KNOWN_CIRCLES.iter().find(|(m, _)| *m == member);
        let circles = circles(&graph);
        match (known, circles.is_empty()) {
            (Some(_), true) => found.push(format!(
                "{member}: listed in KNOWN_CIRCLES but has no circle any more; strike it"
            )),
            (Some(_), false) | (None, true) => {}
            (None, false) => {
                for c in &circles {
                    found.push(format!("{member}: {}", describe(&graph, c)));
                }
            }
        }
    }
    assert!(crates_read >= 10, "crates read: {crates_read}");
    assert!(
        found.is_empty(),
        "modules that reach each other through `crate::` (move the shared types down or the caller up):\n{}",
        found.join("\n")
    );
}

#[test]
fn the_circle_check_sees_a_circle() {
    let a = code_only("use crate::b::X; // crate::c\nlet s = \"crate::c\";");
    assert_eq!(reached(&a, &["a".into()]), BTreeSet::from(["b".into()]));
    let grouped =
        code_only("use crate::{b::X, c};\nmod tests { use super::*; use super::super::d; }");
    assert_eq!(
        reached(&grouped, &["a".into()]),
        BTreeSet::from(["b".into(), "c".into(), "d".into()])
    );
    let nested = code_only("use super::sibling; use super::super::e::Y;");
    assert_eq!(
        reached(&nested, &["a".into(), "inner".into()]),
        BTreeSet::from(["e".into()])
    );
    let graph = BTreeMap::from([
        ("a".to_owned(), BTreeSet::from(["b".to_owned()])),
        ("b".to_owned(), BTreeSet::from(["a".to_owned()])),
        ("c".to_owned(), BTreeSet::from(["a".to_owned()])),
    ]);
    assert_eq!(circles(&graph), vec![vec!["a".to_owned(), "b".to_owned()]]);
}
