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
    const TEST_CRATES: &[&str] = &["mesh-testkit", "mesh-e2e", "mesh-bench"];
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
