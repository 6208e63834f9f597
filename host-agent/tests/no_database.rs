//! Architecture invariant: the host agent never touches a database, so neither its
//! library nor its binary may depend, even transitively, on a database driver.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::process::Command;

#[test]
fn no_database_crate_in_the_dependency_graph() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "tree",
            "--offline",
            "-p",
            "mesh-host-agent",
            "-e",
            "normal,build",
            "--prefix",
            "none",
            "--format",
            "{p}",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo tree runs");
    assert!(
        out.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tree = String::from_utf8_lossy(&out.stdout);
    assert!(
        tree.contains("lapin"),
        "unexpected cargo tree output:\n{tree}"
    );
    for line in tree.lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        for banned in [
            "sqlx",
            "tokio-postgres",
            "postgres",
            "refinery",
            "mesh-bundle",
            "diesel",
            "rusqlite",
            // Not a database, but the controller's alone: the OpenAPI document
            // (mesh-protocol's `openapi` feature stays off for the agent).
            "utoipa",
        ] {
            assert!(
                name != banned && !name.starts_with(&format!("{banned}-")),
                "the host agent depends on `{name}`"
            );
        }
    }
}
