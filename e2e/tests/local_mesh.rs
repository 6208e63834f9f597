//! What bundle/local-mesh, README and the docs tell a newcomer to type is
//! what works (issue 39):
//! - every path under `examples/` that the local mesh's banner, README.md,
//!   examples/README.md or docs/ name exists;
//! - every `meshctl` command the banner prints runs, against a mesh like the
//!   local one (a web node labelled by its operator), and the file it
//!   declares lands; the commands the banner prints for a revoked node (its
//!   re-admission, decision 0050) bring the node back.
//!
//! The banner is read from the script itself, so a command changed there is
//! the command tested here.

use std::path::{Path, PathBuf};
use std::time::Duration;

use mesh_e2e::{Mesh, hello, meshctl_command, output, publish_as, wait_for};
use serde_json::json;

const WITHIN: Duration = Duration::from_secs(60);

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The markdown files under `dir`, recursively.
fn markdown(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            markdown(&p, out);
        } else if p.extension().is_some_and(|x| x == "md") {
            out.push(p);
        }
    }
}

/// Every `examples/<path>` named in `text` (a path starts after a character
/// that cannot be part of one, so `e2e/examples/x` is not taken).
fn example_paths(text: &str) -> Vec<String> {
    let path_char = |c: char| c.is_ascii_alphanumeric() || "_./-".contains(c);
    let mut out = Vec::new();
    for (at, _) in text.match_indices("examples/") {
        if text[..at].chars().next_back().is_some_and(path_char) {
            continue;
        }
        let path: String = text[at..].chars().take_while(|c| path_char(*c)).collect();
        out.push(path.trim_end_matches('.').to_owned());
    }
    out
}

#[test]
fn every_examples_path_the_banner_readme_and_docs_name_exists() {
    let mut files = vec![
        root().join("bundle/local-mesh"),
        root().join("README.md"),
        root().join("examples/README.md"),
    ];
    markdown(&root().join("docs"), &mut files);
    let mut named = 0;
    let mut missing = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        for path in example_paths(&text) {
            named += 1;
            if !root().join(&path).exists() {
                missing.push(format!("{} names {path}", f.display()));
            }
        }
    }
    assert!(missing.is_empty(), "no such file: {missing:#?}");
    // The banner and README do name some: the scan is not vacuous.
    assert!(named >= 3, "only {named} examples/ paths found");
}

/// The texts bundle/local-mesh prints with `cat <<TXT … TXT`, in order.
fn banners() -> Vec<String> {
    let script =
        std::fs::read_to_string(root().join("bundle/local-mesh")).expect("bundle/local-mesh");
    let mut out = Vec::new();
    let mut current: Option<Vec<&str>> = None;
    for line in script.lines() {
        match &mut current {
            None if line.trim_end().ends_with("<<TXT") => current = Some(Vec::new()),
            None => {}
            Some(lines) if line == "TXT" => {
                out.push(lines.join("\n"));
                current = None;
            }
            Some(lines) => lines.push(line),
        }
    }
    out
}

/// The `meshctl …` commands of a banner line: each `;`-separated piece that
/// starts with `meshctl `, up to a comment (three spaces, then anything).
fn meshctl_commands(line: &str) -> Vec<String> {
    line.split(';')
        .map(str::trim)
        .filter(|p| p.starts_with("meshctl "))
        .map(|p| p.split("   ").next().unwrap_or(p).trim().to_owned())
        .collect()
}

/// Run `command` (as the banner prints it, `meshctl …`) from the
/// repository's root, as a newcomer in it would, against `mesh`.
fn run(mesh: &Mesh, command: &str) -> anyhow::Result<String> {
    let args: Vec<&str> = command.split_whitespace().skip(1).collect();
    let (code, out, err) = output(
        meshctl_command()?
            .current_dir(root())
            .args(&args)
            .env("MESH_API", &mesh.api)
            .env("MESH_TOKEN", mesh.admin_token()),
    )?;
    anyhow::ensure!(code == 0, "`{command}` exited {code}: {out}{err}");
    Ok(out)
}

#[tokio::test(flavor = "multi_thread")]
async fn the_local_mesh_banners_commands_run() -> anyhow::Result<()> {
    let texts = banners();
    assert_eq!(
        texts.len(),
        2,
        "the banner, and what it says of a revoked node"
    );
    let mut mesh = Mesh::start().await?;

    // A web node, labelled by its operator as the local mesh labels web-1.
    let web = mesh.add_agent("web", &[]).await?;
    wait_for("the web node to be listed", WITHIN, || async {
        Ok((mesh.get(&format!("/v1/nodes/{web}")).await?.0 == 200).then_some(()))
    })
    .await?;
    let (status, v) = mesh
        .put(
            &format!("/v1/nodes/{web}/labels"),
            &json!({"labels": {"role": "web"}}),
        )
        .await?;
    assert_eq!(status, 200, "{v}");

    let mut ran = Vec::new();
    for line in texts[0].lines() {
        for command in meshctl_commands(line) {
            run(&mesh, &command)?;
            ran.push(command);
        }
    }
    assert!(
        ran.iter()
            .any(|c| c.starts_with("meshctl apply -f examples/")),
        "the banner declares no file: {ran:?}"
    );
    // What it declared lands on the web node.
    let motd = mesh.agent(&web).file("/etc/motd");
    wait_for(
        "the banner's file to land on the web node",
        WITHIN,
        || async { Ok(motd.exists().then_some(())) },
    )
    .await?;

    // A node revoked in an earlier session: what the banner prints for it
    // brings it back (node-add and the agent's start are the test kit's
    // node and a hello here).
    let creds = mesh.env.add_node("revoked").await?;
    let node = creds.node.to_string();
    publish_as(
        &creds,
        &format!("{node}.hello"),
        &hello(&node, &[]).encode(),
        true,
    )
    .await?;
    wait_for("the node to be listed", WITHIN, || async {
        Ok((mesh.get(&format!("/v1/nodes/{node}")).await?.0 == 200).then_some(()))
    })
    .await?;
    run(&mesh, &format!("meshctl node revoke {node}"))?;
    let text = texts[1]
        .replace("$name", &node)
        .replace("$label", "role=web");
    assert!(
        text.contains(&format!("meshctl node readmit {node}")),
        "{text}"
    );
    let mut ran = Vec::new();
    for line in text.lines() {
        if line.contains("mesh-bundle node-add") {
            let creds = mesh.env.add_node("revoked").await?;
            let listed = || async {
                publish_as(
                    &creds,
                    &format!("{node}.hello"),
                    &hello(&node, &[]).encode(),
                    true,
                )
                .await?;
                let (_, v) = mesh.get(&format!("/v1/nodes/{node}")).await?;
                Ok((v["state"] == "alive").then_some(()))
            };
            wait_for("the re-admitted node to be heard", WITHIN, listed).await?;
            continue;
        }
        for command in meshctl_commands(line) {
            run(&mesh, &command)?;
            ran.push(command);
        }
    }
    assert_eq!(
        ran,
        [
            format!("meshctl node readmit {node}"),
            format!("meshctl label {node} role=web")
        ]
    );
    let (_, v) = mesh.get(&format!("/v1/nodes/{node}")).await?;
    assert_eq!(v["labels"]["operator"]["role"], "web", "{v}");
    mesh.teardown().await
}
