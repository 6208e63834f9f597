//! Issue 29, point 4: nothing the controller alone holds can make a node run
//! code (decision 0048). A real controller (its own key not trusted: the
//! default), the bundle's OCI registry and two real agents:
//!
//! (a) an artifact pushed with an operator token and no operator signature
//!     is refused by every node, "no trusted signature" in each run;
//! (b) one signed offline by an operator key an admin added runs on every
//!     node;
//! (c) one signed by a key that was then removed is refused by every node,
//!     and the revision of (b) keeps running.
//!
//! Every step goes through meshctl as operators use it: the operator's token
//! pushes, signs and rolls out; the admin's adds and removes keys.

use std::path::{Path, PathBuf};
use std::time::Duration;

use mesh_e2e::{Mesh, meshctl_at, wait_for};
use mesh_protocol::{ARTIFACT_REPOSITORY, ArtifactDigest};
use serde_json::{Value, json};

const WITHIN: Duration = Duration::from_secs(90);

/// A mesh whose controller pushes to the bundle's registry, ticks rollouts
/// five times a second and does not trust its own signatures (nothing said:
/// the default).
async fn mesh() -> anyhow::Result<Mesh> {
    let mut mesh = Mesh::prepare().await?;
    let registry = mesh_testkit::registry_url()?;
    let path = mesh.dir.path().join("controller.toml");
    let mut toml = std::fs::read_to_string(&path)?;
    anyhow::ensure!(
        !toml.contains("trust_controller_artifact_signatures"),
        "this test needs the default"
    );
    toml.push_str(&format!(
        "registry_url = {registry:?}\nrollout_tick_ms = 200\n"
    ));
    std::fs::write(&path, toml)?;
    mesh.start_controller(&[]).await?;
    Ok(mesh)
}

/// A directory whose `run.sh` writes "<version> <pid>" to its working
/// directory and sleeps.
fn app(dir: &Path, version: &str) -> anyhow::Result<PathBuf> {
    let app = dir.join(format!("app-{version}"));
    std::fs::create_dir_all(&app)?;
    let path = app.join("run.sh");
    std::fs::write(
        &path,
        format!("#!/bin/sh\necho \"{version} $$\" > ./version\nexec sleep 600\n"),
    )?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
    std::fs::write(app.join("nonce"), uuid::Uuid::now_v7().to_string())?;
    Ok(app)
}

fn s(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// meshctl as `token`; fails on a non-zero exit, with its words.
fn ctl(mesh: &Mesh, token: &str, args: &[&str]) -> anyhow::Result<String> {
    let (code, out, err) = meshctl_at(&mesh.api, token, args)?;
    anyhow::ensure!(code == 0, "meshctl {args:?}: exit {code}: {err}");
    Ok(out.trim().to_owned())
}

/// A revision of `web` running `run.sh` of `artifact` in /srv/web.
fn revision(mesh: &Mesh, token: &str, artifact: &str) -> anyhow::Result<String> {
    ctl(
        mesh,
        token,
        &[
            "revision",
            "create",
            "web",
            "--artifact",
            artifact,
            "--command",
            "run.sh",
            "--working-dir",
            "/srv/web",
            "--restart",
            "on_failure",
        ],
    )
}

/// Roll `revision` out to both nodes at once (each node's refusal is its
/// own run's failure) and watch it end: (exit code, the rollout's view).
async fn rollout(mesh: &Mesh, token: &str, revision: &str) -> anyhow::Result<(i32, Value)> {
    let (code, out, err) = meshctl_at(
        &mesh.api,
        token,
        &[
            "rollout",
            "start",
            "web",
            "--revision",
            revision,
            "--max-unavailable",
            "2",
            "--failure-threshold",
            "2",
            "--settle",
            "1",
            "--wait",
            "--timeout",
            "120",
        ],
    )?;
    let id = out.lines().next().unwrap_or_default().trim().to_owned();
    anyhow::ensure!(!id.is_empty(), "no rollout id: {code} {out} {err}");
    let (status, view) = mesh.get(&format!("/v1/rollouts/{id}")).await?;
    anyhow::ensure!(status == 200, "GET rollout: {status} {view}");
    Ok((code, view))
}

/// The rollout failed, every node's run refused the artifact with
/// "no trusted signature" and `more`.
fn refused_by_every_node(code: i32, view: &Value, more: &str) -> anyhow::Result<()> {
    anyhow::ensure!(code == 3, "a failed rollout exits 3: {code} {view}");
    anyhow::ensure!(view["state"] == "failed", "{view}");
    let runs = view["runs"].as_array().cloned().unwrap_or_default();
    anyhow::ensure!(runs.len() == 2, "a run per node: {view}");
    for run in &runs {
        let reason = run["reason"].as_str().unwrap_or_default();
        anyhow::ensure!(run["state"] == "failed", "{run}");
        anyhow::ensure!(
            reason.contains("no trusted signature") && reason.contains(more),
            "expected `no trusted signature` and `{more}` in {run}"
        );
    }
    Ok(())
}

/// What each node's unit wrote: "<version> <pid>", by node.
fn versions(mesh: &Mesh, nodes: &[String]) -> Vec<Option<String>> {
    nodes
        .iter()
        .map(|n| {
            std::fs::read_to_string(mesh.agent(n).file("/srv/web/version"))
                .ok()
                .map(|t| t.trim().to_owned())
        })
        .collect()
}

fn alive(pid: &str) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z "))
}

#[tokio::test(flavor = "multi_thread")]
async fn only_artifacts_signed_by_a_trusted_operator_key_run() -> anyhow::Result<()> {
    if mesh_testkit::registry_url().is_err() {
        return mesh_testkit::skip("the bundle's OCI registry does not answer (bundle/up)");
    }
    let mut mesh = mesh().await?;
    let admin = mesh.admin_token().to_owned();
    let operator = mesh.create_token("deployer", "operator").await?;
    let mut nodes = Vec::new();
    for i in 0..2 {
        let node = mesh.add_agent(&format!("s{i}"), &[("role", "web")]).await?;
        // The unit (its module's user, decision 0051) writes its version there.
        mesh_testkit::open_to_units(&mesh.agent(&node).file("/srv/web"))?;
        nodes.push(node);
    }
    let (status, body) = mesh
        .put(
            "/v1/modules/web",
            &json!({
                "unit": { "command": "/bin/sleep", "args": ["600"] },
                "placement": { "match_labels": { "labels": { "role": "web" }, "replicas": 2 } },
            }),
        )
        .await?;
    anyhow::ensure!(status < 300, "PUT module: {status} {body}");
    wait_for("web placed on both nodes", WITHIN, || async {
        let (_, body) = mesh.get("/v1/modules/web").await?;
        let n = body["assignments"].as_array().map_or(0, Vec::len);
        Ok((n >= 2).then_some(()))
    })
    .await?;
    let work = tempfile::tempdir()?;
    // Nobody trusts the controller's key: it is not declared, and nothing
    // is on the list yet.
    let (status, keys) = mesh.get("/v1/signing-keys").await?;
    assert_eq!(status, 200, "{keys}");
    assert_eq!(keys["keys"], json!([]), "{keys}");
    assert!(keys.get("controller_key").is_none(), "{keys}");

    // (a) Pushed with an operator token, signed by no operator: the
    // controller stored it and made no signature, and every node refuses it.
    let unsigned = ctl(
        &mesh,
        &operator,
        &["artifact", "push", &s(&app(work.path(), "v1")?)],
    )?;
    let digest = ArtifactDigest::parse("digest", &unsigned)?;
    let registry = mesh_oci::Registry::new(&mesh_testkit::registry_url()?, reqwest::Client::new())?;
    assert!(
        registry
            .fetch_signatures(ARTIFACT_REPOSITORY, &digest)
            .await?
            .is_empty(),
        "the controller signed {digest}"
    );
    let (code, view) = rollout(&mesh, &operator, &revision(&mesh, &operator, &unsigned)?).await?;
    refused_by_every_node(code, &view, "no signature in the registry")?;
    assert_eq!(versions(&mesh, &nodes), [None, None], "nothing ran");

    // (b) Signed offline with a key the operator holds, its public half
    // added by an admin: it runs on every node.
    let alice = work.path().join("alice.key");
    let alice_pub = ctl(&mesh, &operator, &["key", "generate", &s(&alice)])?;
    // An operator cannot trust a key; an admin can.
    let (code, _, err) = meshctl_at(
        &mesh.api,
        &operator,
        &["signing-key", "add", "alice", "--key", &alice_pub],
    )?;
    assert_ne!(code, 0, "an operator added a signing key");
    assert!(err.contains("403"), "{err}");
    ctl(
        &mesh,
        &admin,
        &[
            "signing-key",
            "add",
            "alice",
            "--key",
            &format!("{}.pub", s(&alice)),
        ],
    )?;
    let v2 = app(work.path(), "v2")?;
    let signed = ctl(&mesh, &operator, &["artifact", "push", &s(&v2)])?;
    let again = ctl(
        &mesh,
        &operator,
        &["artifact", "sign", &s(&v2), "--key", &s(&alice)],
    )?;
    assert_eq!(again, signed, "sign names the digest push printed");
    let (code, view) = rollout(&mesh, &operator, &revision(&mesh, &operator, &signed)?).await?;
    assert_eq!(code, 0, "a signed artifact rolls out: {view}");
    let running = wait_for("both nodes to run v2", WITHIN, || async {
        let v = versions(&mesh, &nodes);
        let pids: Option<Vec<String>> = v
            .iter()
            .map(|x| {
                x.as_deref()
                    .and_then(|t| t.strip_prefix("v2 "))
                    .filter(|p| alive(p))
                    .map(str::to_owned)
            })
            .collect();
        Ok(pids)
    })
    .await?;

    // (c) Signed by a key that was trusted then, removed since: refused by
    // every node; v2 keeps running, untouched.
    let bob = work.path().join("bob.key");
    let bob_pub = ctl(&mesh, &operator, &["key", "generate", &s(&bob)])?;
    ctl(
        &mesh,
        &admin,
        &["signing-key", "add", "bob", "--key", &bob_pub],
    )?;
    let v3 = app(work.path(), "v3")?;
    let by_bob = ctl(&mesh, &operator, &["artifact", "push", &s(&v3)])?;
    ctl(
        &mesh,
        &operator,
        &["artifact", "sign", &by_bob, "--key", &s(&bob)],
    )?;
    ctl(&mesh, &admin, &["signing-key", "remove", "bob"])?;
    // Nor is a signature by the removed key taken any more.
    let (code, _, err) = meshctl_at(
        &mesh.api,
        &operator,
        &["artifact", "sign", &by_bob, "--key", &s(&bob)],
    )?;
    assert_ne!(code, 0, "a removed key's signature was taken");
    assert!(err.contains("not a signing key"), "{err}");
    let (code, view) = rollout(&mesh, &operator, &revision(&mesh, &operator, &by_bob)?).await?;
    refused_by_every_node(code, &view, "does not trust")?;
    let now: Vec<String> = versions(&mesh, &nodes)
        .into_iter()
        .map(|v| v.unwrap_or_default())
        .collect();
    let expected: Vec<String> = running.iter().map(|p| format!("v2 {p}")).collect();
    assert_eq!(now, expected, "v2 keeps running");
    assert!(running.iter().all(|p| alive(p)));

    // Every key change is in the audit log, by the admin (identity appends
    // the entries the record carries: wait for them).
    for (target, n) in [("/v1/signing-keys", 2), ("/v1/signing-keys/bob", 1)] {
        wait_for(
            &format!("{n} audit entries of {target}"),
            WITHIN,
            || async {
                let (status, audit) = mesh
                    .get(&format!("/v1/audit?target={target}&limit=100"))
                    .await?;
                anyhow::ensure!(status == 200, "{audit}");
                let ok = audit["entries"].as_array().map_or(0, |e| {
                    e.iter()
                        .filter(|x| x["outcome"] == "ok" && x["principal"] == "bootstrap-admin")
                        .count()
                });
                Ok((ok == n).then_some(()))
            },
        )
        .await?;
    }
    mesh.teardown().await
}
