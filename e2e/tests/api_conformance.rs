//! The HTTP API against its own OpenAPI document, by schemathesis (decision
//! 0019): a real controller on an isolated environment, every route in the
//! document, with the admin token; stateless (examples, coverage, fuzzing) then
//! stateful (sequences of calls along the document's links). It fails on any
//! 5xx and on any answer the document does not describe (status, content
//! type, headers, body schema), and on the other checks bundle/schemathesis.toml
//! keeps.
//!
//! Ignored by `cargo test`: it needs schemathesis, which `bundle/api-conformance`
//! installs (pinned, in a venv under target/) and then runs this test with
//! `MESH_SCHEMATHESIS` naming the `st` program.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context as _, bail};
use mesh_e2e::Mesh;

/// Test cases per operation and phase: enough to reach every route's edges,
/// few enough for a run of a few minutes on two cores.
const MAX_EXAMPLES: &str = "25";

fn st() -> anyhow::Result<PathBuf> {
    let st = std::env::var_os("MESH_SCHEMATHESIS")
        .map(PathBuf::from)
        .context(
            "MESH_SCHEMATHESIS is not set: run bundle/api-conformance, which installs schemathesis",
        )?;
    if !st.exists() {
        bail!("{st:?} (MESH_SCHEMATHESIS) does not exist: run bundle/api-conformance");
    }
    Ok(st)
}

fn config_file() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../bundle/schemathesis.toml")
}

/// Run one `st run` and fail with its output when it finds anything.
fn run(mesh: &Mesh, phases: &str) -> anyhow::Result<()> {
    let report = mesh
        .dir
        .path()
        .join(format!("st-{}", phases.replace(',', "-")));
    let output = Command::new(st()?)
        .arg("--config-file")
        .arg(config_file())
        .arg("--no-color")
        .args(["run", &format!("{}/v1/openapi.json", mesh.api)])
        .args(["--url", &mesh.api])
        .args(["--phases", phases])
        .args(["--max-examples", MAX_EXAMPLES])
        .args(["--seed", "9"])
        .args(["--workers", "1"])
        .args(["--generation-database", "none"])
        .args(["--request-timeout", "10"])
        .args([
            "-H",
            &format!("Authorization: Bearer {}", mesh.admin_token()),
        ])
        .arg("--report-dir")
        .arg(&report)
        // Its cache of crashes (for `st replay`) goes with the environment.
        .current_dir(mesh.dir.path())
        .output()
        .context("running schemathesis")?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("==> schemathesis, phases {phases}:\n{stdout}{stderr}");
    if !output.status.success() {
        bail!(
            "schemathesis found problems in phases {phases} (exit {:?}); its report is above. \
             The controller's log:\n{}",
            output.status.code(),
            mesh.controller_log()
                .lines()
                .filter(|l| l.contains("ERROR") || l.contains("WARN"))
                .take(40)
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
    Ok(())
}

#[tokio::test]
#[ignore = "needs schemathesis: run bundle/api-conformance"]
async fn the_api_conforms_to_its_document() -> anyhow::Result<()> {
    st()?;
    let mesh = Mesh::start().await?;
    let stateless = run(&mesh, "examples,coverage,fuzzing");
    let stateful = run(&mesh, "stateful");
    mesh.teardown().await?;
    stateless?;
    stateful
}
