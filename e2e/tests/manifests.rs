//! Manifests end to end (issue 15, decision 0034): the real `meshctl plan`
//! and `meshctl apply` against a real controller and agents.
//!
//! - Every file in `examples/` (the test lists the directory, so a new
//!   example is covered as soon as it is added) is planned, applied with the
//!   plan's ETags, planned again with no change left; what the API answers is
//!   what the manifests say (read here from the files, independently of
//!   meshctl), and a declared file, the module's settings and its granted
//!   secret land on the matching node's root and not on the other node.
//! - A plan made stale by a concurrent change fails `apply --plan` with exit 7
//!   and writes nothing; a plan is refused for another manifest.
//! - Bad manifests (unknown field, bad YAML, unknown kind) fail with exit 1
//!   naming the file, the resource and the field.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use mesh_e2e::{Mesh, meshctl_at, wait_for};
use serde_json::{Value, json};

const WITHIN: Duration = Duration::from_secs(60);

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples")
}

/// Every resource of every manifest in `examples/`, as the test reads them
/// (not meshctl): (file, resource).
fn example_resources() -> anyhow::Result<Vec<(PathBuf, Value)>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(examples())?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    files.sort();
    let mut out = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap_or_default();
        match f.extension().and_then(|e| e.to_str()) {
            Some("yaml" | "yml") => {
                for doc in serde_norway::Deserializer::from_str(&text) {
                    let v: Value = serde::Deserialize::deserialize(doc)?;
                    if !v.is_null() {
                        out.push((f.clone(), v));
                    }
                }
            }
            Some("toml") => {
                let v: Value = toml::from_str(&text)?;
                match v.get("resource").and_then(Value::as_array) {
                    Some(items) => out.extend(items.iter().map(|i| (f.clone(), i.clone()))),
                    None => out.push((f.clone(), v)),
                }
            }
            _ => {}
        }
    }
    Ok(out)
}

fn text(v: &Value, k: &str) -> String {
    v[k].as_str().unwrap_or_default().to_owned()
}

/// What a manifest's resource says, checked against the API's answer.
async fn check_applied(mesh: &Mesh, file: &Path, r: &Value) -> anyhow::Result<()> {
    let dir = file.parent().unwrap_or(Path::new("."));
    let kind = text(r, "kind");
    let name = text(r, "name");
    let at = format!("{} {kind} {name}", file.display());
    match kind.as_str() {
        "File" => {
            let (status, v) = mesh.get(&format!("/v1/files/{name}")).await?;
            anyhow::ensure!(status == 200, "{at}: {status} {v}");
            let content = match r.get("content_file").and_then(Value::as_str) {
                Some(p) => std::fs::read_to_string(dir.join(p))?,
                None => text(r, "content"),
            };
            anyhow::ensure!(v["content"] == json!(content), "{at}: content {v}");
            anyhow::ensure!(v["path"] == r["path"], "{at}: path {v}");
            let mode = u32::from_str_radix(r["mode"].as_str().unwrap_or("0644"), 8)?;
            anyhow::ensure!(v["mode"] == json!(format!("{mode:04o}")), "{at}: mode {v}");
            anyhow::ensure!(v.get("selector") == r.get("selector"), "{at}: selector {v}");
            anyhow::ensure!(v.get("node") == r.get("node"), "{at}: node {v}");
        }
        "Module" => {
            let (status, v) = mesh.get(&format!("/v1/modules/{name}")).await?;
            anyhow::ensure!(status == 200, "{at}: {status} {v}");
            for k in ["command", "args", "env", "resources"] {
                if let Some(want) = r["unit"].get(k) {
                    anyhow::ensure!(&v["unit"][k] == want, "{at}: unit.{k} {v}");
                }
            }
            anyhow::ensure!(v["placement"] == r["placement"], "{at}: placement {v}");
            anyhow::ensure!(
                v["settings_files"] == r["settings_files"],
                "{at}: settings_files {v}"
            );
        }
        "Settings" => {
            let path = match text(r, "scope").as_str() {
                "global" => "global".to_owned(),
                "labels" => format!("labels/{name}"),
                "node" => format!("nodes/{name}"),
                "module" => format!("modules/{name}"),
                other => anyhow::bail!("{at}: scope {other}"),
            };
            let (status, v) = mesh.get(&format!("/v1/settings/{path}")).await?;
            anyhow::ensure!(status == 200, "{at}: {status} {v}");
            anyhow::ensure!(v["values"] == r["values"], "{at}: values {v}");
            anyhow::ensure!(v.get("selector") == r.get("selector"), "{at}: selector {v}");
        }
        "Secret" => {
            let (status, v) = mesh.get(&format!("/v1/secrets/{name}")).await?;
            anyhow::ensure!(status == 200, "{at}: {status} {v}");
            anyhow::ensure!(v["version"] == 1, "{at}: one version, from value_file: {v}");
            for g in r["grants"].as_array().into_iter().flatten() {
                let module = text(g, "module");
                let file = g.get("file").and_then(Value::as_str).unwrap_or(&name);
                let (status, grant) = mesh
                    .get(&format!("/v1/modules/{module}/grants/{name}"))
                    .await?;
                anyhow::ensure!(status == 200, "{at}: grant to {module}: {status}");
                anyhow::ensure!(grant["file"] == json!(file), "{at}: grant {grant}");
            }
            let body = mesh
                .get(&format!("/v1/secrets/{name}"))
                .await?
                .1
                .to_string();
            let value = std::fs::read_to_string(dir.join(text(r, "value_file")))?;
            anyhow::ensure!(
                !body.contains(&value),
                "{at}: a secret's value in an answer"
            );
        }
        "Grant" => {
            let (module, secret) = (text(r, "module"), text(r, "secret"));
            let (status, v) = mesh
                .get(&format!("/v1/modules/{module}/grants/{secret}"))
                .await?;
            anyhow::ensure!(status == 200, "{at}: {status} {v}");
            let file = r.get("file").and_then(Value::as_str).unwrap_or(&secret);
            anyhow::ensure!(v["file"] == json!(file), "{at}: file {v}");
        }
        other => anyhow::bail!("{at}: the test does not know kind {other}: add it here"),
    }
    Ok(())
}

/// The file at `declared` under `node`'s root, once it holds `want`.
async fn lands(mesh: &Mesh, node: &str, declared: &str, want: &str) -> anyhow::Result<PathBuf> {
    let path = mesh.agent(node).file(declared);
    wait_for(&format!("{declared} on {node}"), WITHIN, || async {
        Ok(std::fs::read_to_string(&path)
            .ok()
            .filter(|t| t.contains(want))
            .map(|_| ()))
    })
    .await?;
    Ok(path)
}

#[tokio::test(flavor = "multi_thread")]
async fn every_example_is_planned_applied_and_lands() -> anyhow::Result<()> {
    let mut mesh = Mesh::start().await?;
    // Two web nodes: the example module asks for two replicas, and placement
    // never places part of a replica set.
    let web = mesh
        .add_agent("web", &[("role", "web"), ("zone", "eu")])
        .await?;
    let web2 = mesh
        .add_agent("web2", &[("role", "web"), ("zone", "us")])
        .await?;
    let db = mesh.add_agent("db", &[("role", "db")]).await?;
    wait_for("the three nodes alive", WITHIN, || async {
        let (_, nodes) = mesh.get("/v1/nodes").await?;
        let n = nodes["nodes"].as_array().cloned().unwrap_or_default();
        Ok((n.len() == 3 && n.iter().all(|n| n["state"] == "alive")).then_some(()))
    })
    .await?;
    let dir = tempfile::tempdir()?;
    let plan_file = dir.path().join("plan.json");
    let ex = examples();
    let ex = ex.to_str().unwrap_or_default();
    let resources = example_resources()?;
    let kinds: std::collections::BTreeSet<String> =
        resources.iter().map(|(_, r)| text(r, "kind")).collect();
    for k in ["Module", "File", "Settings", "Secret", "Grant"] {
        assert!(kinds.contains(k), "examples/ has no {k}: {kinds:?}");
    }

    // The plan: everything is created; each change names the nodes it reaches.
    let (code, out, err) = mesh.meshctl(&[
        "plan",
        "-f",
        ex,
        "--detailed-exitcode",
        "--out",
        plan_file.to_str().unwrap_or_default(),
    ])?;
    assert_eq!(
        code, 2,
        "plan with changes and --detailed-exitcode: {out}{err}"
    );
    assert!(out.contains("+ Module web: create"), "{out}");
    assert!(out.contains("+ File motd: create"), "{out}");
    let motd_reach = out
        .lines()
        .skip_while(|l| !l.starts_with("+ File motd"))
        .find(|l| l.trim_start().starts_with("reaches:"))
        .unwrap_or_default();
    assert!(
        motd_reach.contains(&web) && motd_reach.contains(&web2) && !motd_reach.contains(&db),
        "motd reaches the web node only: {motd_reach}\n{out}"
    );
    assert!(
        !out.contains("example-value-not-a-real"),
        "a secret's value in the plan: {out}"
    );
    let saved: Value = serde_json::from_str(&std::fs::read_to_string(&plan_file)?)?;
    assert!(
        saved["resources"]
            .as_array()
            .is_some_and(|r| r.len() == resources.len() + 1),
        "one entry a resource (the secret's grant counts): {saved}"
    );
    // `apply --dry-run` is the same plan.
    let (code, dry, err) =
        mesh.meshctl(&["apply", "--dry-run", "--detailed-exitcode", "-f", ex])?;
    assert_eq!(code, 2, "{dry}{err}");
    assert_eq!(dry, out);

    // Apply exactly that plan.
    let (code, applied, err) = mesh.meshctl(&[
        "apply",
        "-f",
        ex,
        "--plan",
        plan_file.to_str().unwrap_or_default(),
    ])?;
    assert_eq!(code, 0, "apply: {applied}{err}");
    assert!(applied.contains("+ Module web: created"), "{applied}");
    assert!(!applied.contains("example-value-not-a-real"), "{applied}");

    // Nothing left to change.
    let (code, again, err) = mesh.meshctl(&["plan", "-f", ex, "--detailed-exitcode"])?;
    assert_eq!(code, 0, "a second plan has no change: {again}{err}");
    assert!(
        again
            .lines()
            .all(|l| !l.starts_with('+') && !l.starts_with('~')),
        "{again}"
    );
    assert!(again.contains("0 to create, 0 to update"), "{again}");

    // What the API holds is what the manifests say.
    for (file, r) in &resources {
        check_applied(&mesh, file, r).await?;
    }

    // And it lands on the matching node's root, not on the other.
    let motd = text(
        resources
            .iter()
            .map(|(_, r)| r)
            .find(|r| r["kind"] == "File" && r["name"] == "motd")
            .unwrap_or(&Value::Null),
        "content",
    );
    lands(&mesh, &web, "/etc/motd", &motd).await?;
    lands(&mesh, &web2, "/etc/motd", &motd).await?;
    lands(&mesh, &web, "/srv/web/banner.txt", "Welcome").await?;
    // The module runs on the web node with its settings (the labels layer
    // web-eu over the global one; the module's layer) and its secrets.
    let env = lands(&mesh, &web, "/modules/web/app.env", "WORKERS=4").await?;
    let env = std::fs::read_to_string(env)?;
    assert!(
        env.contains("LOG_LEVEL=debug") && env.contains("PORT=8080"),
        "{env}"
    );
    // web2 is not in zone eu: the global layer's LOG_LEVEL.
    let env2 = lands(&mesh, &web2, "/modules/web/app.env", "WORKERS=4").await?;
    let env2 = std::fs::read_to_string(env2)?;
    assert!(env2.contains("LOG_LEVEL=info"), "{env2}");
    let pass = lands(&mesh, &web, "/modules/web/secrets/db.pass", "example-value").await?;
    assert_eq!(
        std::fs::read_to_string(&pass)?,
        std::fs::read_to_string(examples().join("db-password.example"))?
    );
    // The module's user's to read, nobody else's (decision 0051).
    assert_eq!(
        std::fs::metadata(&pass)?.permissions().mode() & 0o777,
        0o400
    );
    lands(&mesh, &web, "/modules/web/secrets/api-key", "example-value").await?;
    assert!(
        !mesh.agent(&db).file("/etc/motd").exists(),
        "the db node has no motd"
    );
    assert!(
        !mesh.agent(&db).file("/modules/web").exists(),
        "the db node runs no web"
    );
    mesh.teardown().await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_plan_made_stale_by_a_concurrent_change_writes_nothing() -> anyhow::Result<()> {
    let mesh = Mesh::start().await?;
    let (status, _) = mesh
        .put(
            "/v1/files/stale-a",
            &json!({"path": "/etc/a", "content": "before\n", "mode": "0644", "selector": {}}),
        )
        .await?;
    assert_eq!(status, 201);
    let dir = tempfile::tempdir()?;
    let m = dir.path().join("m.yaml");
    let manifest = "kind: File\nname: stale-a\npath: /etc/a\ncontent: from the manifest\nselector: {}\n---\n\
                    kind: File\nname: stale-b\npath: /etc/b\ncontent: new\nselector: {}\n";
    std::fs::write(&m, manifest)?;
    let m = m.to_str().unwrap_or_default().to_owned();
    let plan = dir.path().join("plan.json");
    let plan = plan.to_str().unwrap_or_default().to_owned();
    let (code, out, err) = mesh.meshctl(&["plan", "-f", &m, "--out", &plan])?;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("~ File stale-a: update (ETag \"1\")"), "{out}");
    assert!(
        out.contains("content: <7 bytes, sha256:") && out.contains("=> \"from the manifest\""),
        "{out}"
    );
    assert!(out.contains("+ File stale-b: create"), "{out}");

    // Someone else changes stale-a between the plan and the apply.
    let (status, _, _) = mesh
        .request(
            reqwest::Method::PUT,
            "/v1/files/stale-a",
            &[("if-match", "\"1\"")],
            Some(&json!({"path": "/etc/a", "content": "concurrent\n", "mode": "0644", "selector": {}})),
        )
        .await?;
    assert_eq!(status, 200);
    let (code, out, err) = mesh.meshctl(&["apply", "-f", &m, "--plan", &plan])?;
    assert_eq!(code, 7, "a stale plan exits 7: {out}{err}");
    assert!(err.contains("File stale-a") && err.contains("412"), "{err}");
    let (_, a) = mesh.get("/v1/files/stale-a").await?;
    assert_eq!(a["content"], "concurrent\n", "not overwritten: {a}");
    let (status, _) = mesh.get("/v1/files/stale-b").await?;
    assert_eq!(status, 404, "nothing written, not even the create");

    // A plan is refused for another manifest.
    std::fs::write(&m, manifest.replace("content: new", "content: newer"))?;
    let (code, _, err) = mesh.meshctl(&["apply", "-f", &m, "--plan", &plan])?;
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("different manifest"), "{err}");
    let (status, _) = mesh.get("/v1/files/stale-b").await?;
    assert_eq!(status, 404);

    // Planned afresh (apply plans itself), it goes through.
    let (code, out, err) = mesh.meshctl(&["apply", "-f", &m])?;
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("~ File stale-a: updated (ETag \"3\")"),
        "{out}"
    );
    let (_, a) = mesh.get("/v1/files/stale-a").await?;
    assert_eq!(a["content"], "from the manifest");
    let (_, b) = mesh.get("/v1/files/stale-b").await?;
    assert_eq!(b["content"], "newer");

    // A secret a manifest declares without a value_file is missing: plan
    // says so, apply refuses naming it and writes nothing.
    std::fs::write(
        &m,
        "kind: Secret\nname: not-set\ngrants: [{module: web}]\n---\n\
         kind: File\nname: stale-c\npath: /etc/c\ncontent: c\nselector: {}\n",
    )?;
    let (code, out, _) = mesh.meshctl(&["plan", "-f", &m, "--detailed-exitcode"])?;
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("! Secret not-set: missing"), "{out}");
    let (code, _, err) = mesh.meshctl(&["apply", "-f", &m])?;
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("Secret not-set") && err.contains("nothing was written"),
        "{err}"
    );
    let (status, _) = mesh.get("/v1/files/stale-c").await?;
    assert_eq!(status, 404);
    mesh.teardown().await
}

#[test]
fn bad_manifests_fail_naming_file_resource_and_field() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    // No API is needed: a manifest is refused before any request.
    let run = |name: &str, body: &str| -> anyhow::Result<(i32, String, String)> {
        let f = dir.path().join(name);
        std::fs::write(&f, body)?;
        let f = f.to_str().unwrap_or_default().to_owned();
        let plan = meshctl_at("http://127.0.0.1:9", "t", &["plan", "-f", &f])?;
        let apply = meshctl_at("http://127.0.0.1:9", "t", &["apply", "-f", &f])?;
        assert_eq!(
            (plan.0, &plan.2),
            (apply.0, &apply.2),
            "plan and apply agree"
        );
        Ok((plan.0, f, plan.2))
    };
    let cases: BTreeMap<&str, (&str, Vec<&str>)> = BTreeMap::from([
        (
            "unknown-field.yaml",
            (
                "kind: Settings\nscope: global\nvalues: {A: 1}\n---\nkind: Module\nname: web\n\
                 unit: {command: /bin/true, bogus: 1}\nplacement: {controller_node: {}}\n",
                vec!["resource #2 (Module web)", "bogus"],
            ),
        ),
        (
            "nested-unknown.toml",
            (
                "[[resource]]\nkind = \"Module\"\nname = \"web\"\nunit = { command = \"/bin/true\", probes = [{ name = \"p\", tcp = { port = 80 }, colour = \"red\" }] }\nplacement = { controller_node = {} }\n",
                vec![
                    "resource #1 (Module web)",
                    "field `unit.probes[0].colour`",
                    "unknown field",
                ],
            ),
        ),
        (
            "bad.yaml",
            (
                "kind: File\nname: motd\npath: /etc/motd\ncontent: [unclosed\n",
                vec!["resource #1", "line"],
            ),
        ),
        (
            "unknown-kind.yaml",
            (
                "kind: Deployment\nname: web\n",
                vec![
                    "resource #1 (Deployment web)",
                    "field `kind`",
                    "unknown kind `Deployment`",
                ],
            ),
        ),
        (
            "wrong-type.yaml",
            (
                "kind: File\nname: motd\npath: /etc/motd\ncontent: hi\nmode: \"0999\"\nselector: {}\n",
                vec!["resource #1 (File motd)", "field `mode`"],
            ),
        ),
    ]);
    for (name, (body, wanted)) in cases {
        let (code, file, err) = run(name, body)?;
        assert_eq!(code, 1, "{name}: {err}");
        assert!(err.contains(&file), "{name}: names the file: {err}");
        for w in wanted {
            assert!(err.contains(w), "{name}: `{w}` missing from: {err}");
        }
    }
    Ok(())
}
