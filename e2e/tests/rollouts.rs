//! Delivery end to end (issue 14): artifacts pushed with `meshctl artifact
//! push` to the real OCI registry the bundle raised, revisions, rollouts over
//! three real agents, a tampered, an unsigned and a foreign-signed artifact
//! refused by the agents, an automatic rollback, approvals and the freeze.
//!
//! Each agent's unit writes `<root>/srv/web/version` ("<version> <pid>") from
//! a script in its artifact, so the test sees which revision runs where and
//! whether the old process is gone.

use std::path::{Path, PathBuf};
use std::time::Duration;

use mesh_e2e::{Mesh, wait_for};
use mesh_protocol::{ARTIFACT_REPOSITORY, ArtifactDigest, ArtifactSignature, DeclarationSigner};
use serde_json::{Value, json};

const WITHIN: Duration = Duration::from_secs(90);

/// A mesh whose controller pushes to the bundle's registry and ticks rollouts
/// five times a second. Its fleet trusts the controller's own signatures
/// (`trust_controller_artifact_signatures`, decision 0048), so an artifact
/// pushed runs without an operator's signature: these tests are about
/// rollouts; operator-held keys are e2e/tests/signing.rs's.
async fn mesh() -> anyhow::Result<Mesh> {
    let mesh = Mesh::prepare().await?;
    let registry = mesh_testkit::registry_url()?;
    let path = mesh.dir.path().join("controller.toml");
    let mut toml = std::fs::read_to_string(&path)?;
    toml.push_str(&format!(
        "registry_url = {registry:?}\nrollout_tick_ms = 200\ntrust_controller_artifact_signatures = true\n"
    ));
    std::fs::write(&path, toml)?;
    let mut mesh = mesh;
    mesh.start_controller(&[]).await?;
    Ok(mesh)
}

async fn agents(mesh: &mut Mesh, n: usize) -> anyhow::Result<Vec<String>> {
    let mut nodes = Vec::new();
    for i in 0..n {
        let node = mesh.add_agent(&format!("w{i}"), &[("role", "web")]).await?;
        // The unit (its module's user, decision 0051) writes its version there.
        mesh_testkit::open_to_units(&mesh.agent(&node).file("/srv/web"))?;
        nodes.push(node);
    }
    Ok(nodes)
}

/// A directory holding `run.sh`, whose unit writes "<version> <pid>" to its
/// working directory (unless `fail`: it exits 1 at once).
fn app(dir: &Path, version: &str, fail: bool) -> anyhow::Result<PathBuf> {
    let app = dir.join(format!("app-{version}"));
    std::fs::create_dir_all(&app)?;
    let script = if fail {
        "#!/bin/sh\nexit 1\n".to_owned()
    } else {
        format!("#!/bin/sh\necho \"{version} $$\" > ./version\nexec sleep 600\n")
    };
    let path = app.join("run.sh");
    std::fs::write(&path, script)?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
    // Something unique, so no other test's blob is this one.
    std::fs::write(app.join("nonce"), uuid::Uuid::now_v7().to_string())?;
    Ok(app)
}

/// Push `dir` with meshctl: its digest.
fn push(mesh: &Mesh, dir: &Path) -> anyhow::Result<ArtifactDigest> {
    let (code, out, err) = mesh.meshctl(&["artifact", "push", &dir.to_string_lossy()])?;
    anyhow::ensure!(code == 0, "meshctl artifact push: {code} {err}");
    Ok(ArtifactDigest::parse("digest", out.trim())?)
}

/// A revision of `web` running `run.sh` of `artifact` in /srv/web.
fn revision(mesh: &Mesh, artifact: &ArtifactDigest) -> anyhow::Result<String> {
    let (code, out, err) = mesh.meshctl(&[
        "revision",
        "create",
        "web",
        "--artifact",
        artifact.as_str(),
        "--command",
        "run.sh",
        "--working-dir",
        "/srv/web",
        "--restart",
        "on_failure",
    ])?;
    anyhow::ensure!(code == 0, "meshctl revision create: {code} {err}");
    Ok(out.trim().to_owned())
}

/// `web` on every node labelled role=web; its own spec sleeps (no artifact).
async fn module(mesh: &Mesh, replicas: usize) -> anyhow::Result<()> {
    let (status, body) = mesh
        .put(
            "/v1/modules/web",
            &json!({
                "unit": { "command": "/bin/sleep", "args": ["600"] },
                "placement": { "match_labels": { "labels": { "role": "web" }, "replicas": replicas } },
            }),
        )
        .await?;
    anyhow::ensure!(status < 300, "PUT module: {status} {body}");
    Ok(())
}

/// Start a rollout through meshctl and follow it to its end: (exit code, rollout id).
fn rollout(mesh: &Mesh, revision: &str, extra: &[&str]) -> anyhow::Result<(i32, String, String)> {
    let mut args = vec![
        "rollout",
        "start",
        "web",
        "--revision",
        revision,
        "--max-unavailable",
        "1",
        "--settle",
        "1",
        "--wait",
        "--timeout",
        "120",
    ];
    args.extend_from_slice(extra);
    let (code, out, err) = mesh.meshctl(&args)?;
    let id = out.lines().next().unwrap_or_default().trim().to_owned();
    if code != 0 {
        for node in mesh.agents.keys() {
            eprintln!(
                "--- agent {node}:\n{}",
                mesh.log_of(&format!("agent-{node}"))
            );
        }
    }
    Ok((code, id, format!("{out}\n{err}")))
}

/// What each node's unit wrote: (version, pid) by node.
fn versions(mesh: &Mesh, nodes: &[String]) -> Vec<Option<(String, u32)>> {
    nodes
        .iter()
        .map(|n| {
            let text = std::fs::read_to_string(mesh.agent(n).file("/srv/web/version")).ok()?;
            let (v, pid) = text.trim().split_once(' ')?;
            Some((v.to_owned(), pid.parse().ok()?))
        })
        .collect()
}

fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| !s.contains(") Z "))
            .unwrap_or(false)
}

async fn wait_versions(mesh: &Mesh, nodes: &[String], version: &str) -> anyhow::Result<Vec<u32>> {
    wait_for(&format!("every node to run {version}"), WITHIN, || async {
        let v = versions(mesh, nodes);
        let pids: Option<Vec<u32>> = v
            .iter()
            .map(|x| {
                x.as_ref()
                    .filter(|(ver, pid)| ver == version && alive(*pid))
                    .map(|(_, p)| *p)
            })
            .collect();
        Ok(pids)
    })
    .await
}

async fn rollout_view(mesh: &Mesh, id: &str) -> anyhow::Result<Value> {
    let (status, body) = mesh.get(&format!("/v1/rollouts/{id}")).await?;
    anyhow::ensure!(status == 200, "GET rollout: {status} {body}");
    Ok(body)
}

/// The array `key` of a list answer: an error when it is missing or not an
/// array, so that a wrong answer cannot pass as an empty list.
fn list(answer: &Value, key: &str) -> anyhow::Result<Vec<Value>> {
    answer[key]
        .as_array()
        .cloned()
        .ok_or_else(|| anyhow::anyhow!("no array `{key}` in {answer}"))
}

/// A run's (or rollout's) `id`: an error when it has none.
fn id_of(v: &Value) -> anyhow::Result<&str> {
    v["id"]
        .as_str()
        .ok_or_else(|| anyhow::anyhow!("no `id` in {v}"))
}

async fn receipt_kinds(mesh: &Mesh, run: &str) -> anyhow::Result<Vec<String>> {
    let (status, body) = mesh.get(&format!("/v1/runs/{run}/receipts")).await?;
    anyhow::ensure!(status == 200, "receipts: {status} {body}");
    let receipts = list(&body, "receipts")?;
    for (i, r) in receipts.iter().enumerate() {
        anyhow::ensure!(r["seq"] == json!(i + 1), "receipts out of order: {body}");
        anyhow::ensure!(r["run"] == json!(run), "a receipt of another run: {body}");
    }
    Ok(receipts
        .iter()
        .map(|r| r["kind"].as_str().unwrap_or_default().to_owned())
        .collect())
}

async fn wait_placed(mesh: &Mesh, replicas: usize) -> anyhow::Result<()> {
    wait_for("web placed on every node", WITHIN, || async {
        let (_, body) = mesh.get("/v1/modules/web").await?;
        let n = body["assignments"].as_array().map_or(0, Vec::len);
        Ok((n >= replicas).then_some(()))
    })
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn an_artifact_rolls_out_node_by_node_and_a_failing_revision_rolls_back() -> anyhow::Result<()>
{
    let mut mesh = mesh().await?;
    let nodes = agents(&mut mesh, 3).await?;
    module(&mesh, 3).await?;
    wait_placed(&mesh, 3).await?;
    let work = tempfile::tempdir()?;

    let v1 = push(&mesh, &app(work.path(), "v1", false)?)?;
    let rev1 = revision(&mesh, &v1)?;
    let (code, id, out) = rollout(&mesh, &rev1, &[])?;
    assert_eq!(code, 0, "rollout of v1: {out}\n{}", mesh.controller_log());
    let first = wait_versions(&mesh, &nodes, "v1").await?;

    let v2 = push(&mesh, &app(work.path(), "v2", false)?)?;
    let rev2 = revision(&mesh, &v2)?;
    let (code, id2, out) = rollout(&mesh, &rev2, &[])?;
    assert_eq!(code, 0, "rollout of v2: {out}");
    let second = wait_versions(&mesh, &nodes, "v2").await?;
    for pid in &first {
        assert!(!alive(*pid), "the v1 process {pid} still runs");
    }
    let view = rollout_view(&mesh, &id2).await?;
    assert_eq!(view["state"], "succeeded");
    assert_eq!(view["nodes_done"], 3);
    assert_eq!(view["previous_revision"], json!(rev1));
    // One run per node.
    let runs = list(&view, "runs")?;
    assert_eq!(runs.len(), 3, "{view}");
    for run in &runs {
        let kinds = receipt_kinds(&mesh, id_of(run)?).await?;
        assert_eq!(
            kinds,
            [
                "run.queued",
                "run.started",
                "artifact.staged",
                "unit.deployed",
                "unit.running",
                "run.succeeded"
            ],
            "{run}"
        );
    }
    // One step at a time: run k started only after run k-1 succeeded.
    let mut starts = Vec::new();
    for run in &runs {
        let (_, body) = mesh
            .get(&format!("/v1/runs/{}/receipts", id_of(run)?))
            .await?;
        let receipts = list(&body, "receipts")?;
        let at = |kind: &str| {
            receipts
                .iter()
                .find(|x| x["kind"] == kind)
                .and_then(|x| x["at"].as_str())
                .map(str::to_owned)
                .ok_or_else(|| anyhow::anyhow!("no `{kind}` receipt with `at` in {body}"))
        };
        starts.push((at("unit.deployed")?, at("run.succeeded")?));
    }
    for w in starts.windows(2) {
        assert!(w[1].0 >= w[0].1, "max_unavailable 1 overlapped: {starts:?}");
    }
    // The nodes' view of the module: every replica on the new revision.
    let (_, module) = mesh.get("/v1/modules/web").await?;
    let assignments = list(&module, "assignments")?;
    assert_eq!(assignments.len(), 3, "{module}");
    for a in assignments {
        assert_eq!(a["revision"], json!(rev2), "{module}");
    }
    let _ = id;

    // A revision whose unit exits at once: the first node fails, the rollout
    // rolls back, every node runs v2 again.
    let bad = push(&mesh, &app(work.path(), "bad", true)?)?;
    let rev_bad = revision(&mesh, &bad)?;
    let (code, id3, out) = rollout(&mesh, &rev_bad, &[])?;
    assert_eq!(code, 4, "a rolled back rollout exits 4: {out}");
    let view = rollout_view(&mesh, &id3).await?;
    assert_eq!(view["state"], "rolled_back", "{view}");
    let back = wait_versions(&mesh, &nodes, "v2").await?;
    // Nodes the failing revision never reached kept their process.
    let untouched = back.iter().zip(&second).filter(|(a, b)| a == b).count();
    assert!(untouched >= 1, "{back:?} vs {second:?}");
    let runs = list(&view, "runs")?;
    anyhow::ensure!(!runs.is_empty(), "no runs: {view}");
    let kinds = receipt_kinds(&mesh, id_of(&runs[0])?).await?;
    assert!(
        kinds.contains(&"run.failed".to_owned())
            && kinds.last().map(String::as_str) == Some("run.rolled_back"),
        "{kinds:?}"
    );
    mesh.teardown().await
}

/// Where the registry keeps a blob's bytes (bundle/up's storage root).
fn blob_path(digest: &ArtifactDigest) -> PathBuf {
    let hex = digest.hex();
    PathBuf::from("/var/lib/docker-registry/docker/registry/v2/blobs/sha256")
        .join(&hex[..2])
        .join(hex)
        .join("data")
}

fn tar_of(dir: &Path) -> anyhow::Result<Vec<u8>> {
    let out = std::process::Command::new("tar")
        .arg("-C")
        .arg(dir)
        .args(["-cf", "-", "."])
        .output()?;
    anyhow::ensure!(out.status.success(), "tar failed");
    Ok(out.stdout)
}

/// A rollout of `revision` ends failed with `reason` in its run, and every
/// node still runs `running` with the same processes.
async fn refused(
    mesh: &Mesh,
    nodes: &[String],
    revision: &str,
    reason: &str,
    running: &[u32],
) -> anyhow::Result<()> {
    let (code, id, out) = rollout(mesh, revision, &[])?;
    assert_eq!(code, 3, "a failed rollout exits 3: {out}");
    let view = rollout_view(mesh, &id).await?;
    assert_eq!(view["state"], "failed", "{view}");
    let run = &view["runs"][0];
    assert!(
        run["reason"].as_str().unwrap_or_default().contains(reason),
        "expected `{reason}` in {run}"
    );
    let kinds = receipt_kinds(mesh, id_of(run)?).await?;
    assert_eq!(kinds, ["run.queued", "run.started", "run.failed"]);
    let now: Vec<u32> = versions(mesh, nodes)
        .into_iter()
        .map(|v| v.map_or(0, |(_, p)| p))
        .collect();
    assert_eq!(now, running, "the old revision keeps running");
    assert!(running.iter().all(|p| alive(*p)));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn tampered_unsigned_and_foreign_signed_artifacts_are_refused_by_the_agent()
-> anyhow::Result<()> {
    let mut mesh = mesh().await?;
    let nodes = agents(&mut mesh, 1).await?;
    module(&mesh, 1).await?;
    wait_placed(&mesh, 1).await?;
    let work = tempfile::tempdir()?;
    let good = push(&mesh, &app(work.path(), "v1", false)?)?;
    let (code, _, out) = rollout(&mesh, &revision(&mesh, &good)?, &[])?;
    assert_eq!(code, 0, "{out}");
    let running = wait_versions(&mesh, &nodes, "v1").await?;

    // Tampered: the registry's stored bytes changed under the right digest.
    let tampered = push(&mesh, &app(work.path(), "tampered", false)?)?;
    let path = blob_path(&tampered);
    let mut bytes = std::fs::read(&path)?;
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&path, &bytes)?;
    refused(
        &mesh,
        &nodes,
        &revision(&mesh, &tampered)?,
        "digest mismatch",
        &running,
    )
    .await?;

    // Unsigned: pushed straight to the registry, around meshctl.
    let registry = mesh_oci::Registry::new(&mesh_testkit::registry_url()?, reqwest::Client::new())?;
    let unsigned = registry
        .push_artifact(
            ARTIFACT_REPOSITORY,
            &tar_of(&app(work.path(), "unsigned", false)?)?,
        )
        .await?;
    refused(
        &mesh,
        &nodes,
        &revision(&mesh, &unsigned)?,
        "no trusted signature: it has no signature",
        &running,
    )
    .await?;

    // Signed, but by a key the mesh does not trust.
    let foreign = registry
        .push_artifact(
            ARTIFACT_REPOSITORY,
            &tar_of(&app(work.path(), "foreign", false)?)?,
        )
        .await?;
    let stranger = DeclarationSigner::from_seed(rand::random());
    registry
        .push_signature(
            ARTIFACT_REPOSITORY,
            &ArtifactSignature::sign(&stranger, &foreign),
        )
        .await?;
    refused(
        &mesh,
        &nodes,
        &revision(&mesh, &foreign)?,
        "does not trust",
        &running,
    )
    .await?;
    mesh.teardown().await
}

#[tokio::test(flavor = "multi_thread")]
async fn approvals_and_the_freeze_hold_rollouts() -> anyhow::Result<()> {
    let mut mesh = mesh().await?;
    let nodes = agents(&mut mesh, 1).await?;
    module(&mesh, 1).await?;
    wait_placed(&mesh, 1).await?;
    let work = tempfile::tempdir()?;
    let v1 = push(&mesh, &app(work.path(), "v1", false)?)?;
    let rev1 = revision(&mesh, &v1)?;

    // The freeze: 409 with its reason, until lifted.
    let (code, _, err) = mesh.meshctl(&["freeze", "set", "--reason", "release week"])?;
    assert_eq!(code, 0, "{err}");
    let (status, body) = mesh
        .post_json(
            "/v1/rollouts",
            &json!({ "module": "web", "revision": rev1 }),
        )
        .await?;
    assert_eq!(status, 409, "{body}");
    assert!(
        body["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("release week"),
        "{body}"
    );
    let (code, _, err) = mesh.meshctl(&["freeze", "lift"])?;
    assert_eq!(code, 0, "{err}");

    // Approval: nothing starts until approved; `decided_by` is the token's.
    let (code, _, err) =
        mesh.meshctl(&["module", "delivery", "web", "--require-approval", "true"])?;
    assert_eq!(code, 0, "{err}");
    let (status, view) = mesh
        .post_json(
            "/v1/rollouts",
            &json!({ "module": "web", "revision": rev1, "settle_secs": 1 }),
        )
        .await?;
    assert_eq!(status, 201, "{view}");
    assert_eq!(view["state"], "awaiting_approval");
    let run = view["runs"][0]["id"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let approver = mesh.create_token("approver-carol", "operator").await?;
    let (status, body) = mesh
        .request_as(
            reqwest::Method::POST,
            &format!("/v1/runs/{run}/deny"),
            Some(&approver),
            Some(&json!({ "reason": "not during the sale", "decided_by": "mallory" })),
        )
        .await?;
    assert_eq!(status, 422, "the body cannot name who decided: {body}");
    let (status, body) = mesh
        .request_as(
            reqwest::Method::POST,
            &format!("/v1/runs/{run}/deny"),
            Some(&approver),
            Some(&json!({ "reason": "not during the sale" })),
        )
        .await?;
    assert_eq!(status, 200, "{body}");
    let (_, receipts) = mesh.get(&format!("/v1/runs/{run}/receipts")).await?;
    let denied = receipts["receipts"]
        .as_array()
        .and_then(|r| r.iter().find(|x| x["kind"] == "approval.denied"))
        .cloned()
        .unwrap_or_default();
    assert_eq!(
        denied["detail"]["decided_by"], "approver-carol",
        "{receipts}"
    );
    assert_eq!(denied["detail"]["reason"], "not during the sale");
    assert_eq!(
        receipt_kinds(&mesh, &run).await?.last().map(String::as_str),
        Some("run.canceled")
    );
    // Denied is final, and nothing ran before it: the revision never started.
    assert!(
        versions(&mesh, &nodes)[0].is_none(),
        "a unit started before approval"
    );

    // Approved, it runs.
    let (_, view) = mesh
        .post_json(
            "/v1/rollouts",
            &json!({ "module": "web", "revision": rev1, "settle_secs": 1 }),
        )
        .await?;
    let run = view["runs"][0]["id"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let (code, _, err) = mesh.meshctl(&["run", "approve", &run])?;
    assert_eq!(code, 0, "{err}");
    wait_versions(&mesh, &nodes, "v1").await?;
    let (code, _, out) = mesh.meshctl(&[
        "rollout",
        "status",
        view["id"].as_str().unwrap_or_default(),
        "--timeout",
        "60",
    ])?;
    assert_eq!(code, 0, "{out}");
    mesh.teardown().await
}
