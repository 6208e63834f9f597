//! `meshctl` end to end (issue 15): the real binary against a running mesh
//! (real controller, real agents). Every subcommand it gained runs at least
//! once; `-o json` is parsed and checked against what the API says; label
//! selectors filter; `label`, `drain` and `undrain` are observed through the
//! API; `get nodes -w` shows a stopped agent's node turn unreachable;
//! `events --follow` resumes after the controller restarts, with nothing
//! lost or repeated; completions and man pages are well-formed; the config
//! file's precedence holds; `get grants` and `describe grant` read a live
//! controller's grants (issue 16).

use std::io::{BufRead as _, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use mesh_e2e::{GRACE, Mesh, meshctl_command, output, wait_for};
use reqwest::Method;
use serde_json::{Value, json};

const WITHIN: Duration = Duration::from_secs(60);

/// `meshctl` that must succeed: its stdout.
fn ok(mesh: &Mesh, args: &[&str]) -> anyhow::Result<String> {
    let (code, out, err) = mesh.meshctl(args)?;
    anyhow::ensure!(code == 0, "meshctl {args:?}: exit {code}\n{err}\n{out}");
    Ok(out)
}

/// `meshctl … -o json`, parsed.
fn json_of(mesh: &Mesh, args: &[&str]) -> anyhow::Result<Value> {
    let mut all = args.to_vec();
    all.extend(["-o", "json"]);
    let out = ok(mesh, &all)?;
    serde_json::from_str(&out).map_err(|e| anyhow::anyhow!("meshctl {args:?} -o json: {e}: {out}"))
}

fn ids(v: &Value, key: &str) -> Vec<String> {
    let mut ids: Vec<String> = v
        .as_array()
        .map(|a| {
            a.iter()
                .map(|x| x[key].as_str().unwrap_or("").to_owned())
                .collect()
        })
        .unwrap_or_default();
    ids.sort();
    ids
}

/// Every item of a list endpoint (all pages) as the API answers.
async fn api_list(mesh: &Mesh, path: &str, key: &str) -> anyhow::Result<Value> {
    let mut items = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let sep = if path.contains('?') { '&' } else { '?' };
        let url = match &after {
            Some(a) => format!("{path}{sep}after={a}"),
            None => path.to_owned(),
        };
        let (status, page) = mesh.get(&url).await?;
        anyhow::ensure!(status == 200, "GET {url}: {status} {page}");
        items.extend(page[key].as_array().cloned().unwrap_or_default());
        match page["next"].as_str() {
            Some(n) => after = Some(n.to_owned()),
            None => return Ok(Value::Array(items)),
        }
    }
}

async fn node_state(mesh: &Mesh, node: &str) -> anyhow::Result<Value> {
    let (status, v) = mesh.get(&format!("/v1/nodes/{node}")).await?;
    anyhow::ensure!(status == 200, "GET node {node}: {status} {v}");
    Ok(v)
}

async fn all_alive(mesh: &Mesh, n: usize) -> anyhow::Result<()> {
    wait_for(&format!("{n} alive nodes"), WITHIN, || async {
        let (_, v) = mesh.get("/v1/nodes").await?;
        let alive = v["nodes"]
            .as_array()
            .map_or(0, |a| a.iter().filter(|n| n["state"] == "alive").count());
        Ok((alive == n).then_some(()))
    })
    .await
}

/// Lines a child prints, read on a thread (stdout piped).
fn lines_of(child: &mut Child) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    if let Some(stdout) = child.stdout.take() {
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
    }
    rx
}

/// Collect lines until `done` says so, or fail after `within`.
fn until(
    rx: &mpsc::Receiver<String>,
    seen: &mut Vec<String>,
    within: Duration,
    what: &str,
    done: impl Fn(&[String]) -> bool,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + within;
    while !done(seen) {
        let left = deadline.saturating_duration_since(Instant::now());
        anyhow::ensure!(
            !left.is_zero(),
            "timed out waiting for {what}; got:\n{}",
            seen.join("\n")
        );
        if let Ok(line) = rx.recv_timeout(left.min(Duration::from_millis(200))) {
            seen.push(line);
        }
    }
    Ok(())
}

/// A child process killed on drop.
struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn meshctl_gets_describes_labels_and_drains_what_the_api_holds() -> anyhow::Result<()> {
    let mut mesh = Mesh::start().await?;
    let web_eu = mesh
        .add_agent("web-eu", &[("role", "web"), ("zone", "eu")])
        .await?;
    let web_us = mesh
        .add_agent("web-us", &[("role", "web"), ("zone", "us")])
        .await?;
    let db = mesh
        .add_agent("db", &[("role", "db"), ("zone", "eu")])
        .await?;
    all_alive(&mesh, 3).await?;

    // get nodes: -o json is the API's objects, all of them.
    let nodes = json_of(&mesh, &["get", "nodes"])?;
    let api_nodes = api_list(&mesh, "/v1/nodes", "nodes").await?;
    assert_eq!(ids(&nodes, "id"), ids(&api_nodes, "id"));
    let mut want = vec![web_eu.clone(), web_us.clone(), db.clone()];
    want.sort();
    assert_eq!(ids(&nodes, "id"), want);
    for n in nodes.as_array().unwrap() {
        let from_api = api_nodes
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["id"] == n["id"])
            .unwrap();
        assert_eq!(n["labels"], from_api["labels"]);
        assert_eq!(n["state"], "alive");
    }
    let yaml = ok(&mesh, &["get", "nodes", "-o", "yaml"])?;
    let from_yaml: Value = serde_norway::from_str(&yaml)?;
    assert_eq!(ids(&from_yaml, "id"), want, "{yaml}");
    let table = ok(&mesh, &["get", "nodes"])?;
    let mut lines = table.lines();
    assert!(lines.next().unwrap().starts_with("NAME"), "{table}");
    assert_eq!(lines.count(), 3, "{table}");
    assert!(table.contains("role=web,zone=eu"), "{table}");
    let wide = ok(&mesh, &["get", "nodes", "-o", "wide"])?;
    assert!(wide.contains("HOSTNAME"), "{wide}");

    // -l: every pair must match; the API does the filtering.
    let web = json_of(&mesh, &["get", "nodes", "-l", "role=web"])?;
    let mut want_web = vec![web_eu.clone(), web_us.clone()];
    want_web.sort();
    assert_eq!(ids(&web, "id"), want_web);
    let eu_web = json_of(&mesh, &["get", "nodes", "-l", "role=web,zone=eu"])?;
    assert_eq!(ids(&eu_web, "id"), vec![web_eu.clone()]);
    let eu_web = json_of(&mesh, &["get", "no", "-l", "role=web", "-l", "zone=eu"])?;
    assert_eq!(ids(&eu_web, "id"), vec![web_eu.clone()]);
    let (code, _, err) = mesh.meshctl(&["get", "modules", "-l", "role=web"])?;
    assert_eq!(code, 1);
    assert!(err.contains("modules have no labels"), "{err}");
    let (code, _, err) = mesh.meshctl(&["get", "nodes", "-l", "role"])?;
    assert_eq!(code, 1);
    assert!(err.contains("key=value"), "{err}");

    // label: set, then remove; the API sees each.
    let out = ok(&mesh, &["label", &db, "tier=gold", "owner=ops"])?;
    assert!(out.contains("tier=gold"), "{out}");
    let (_, labels) = mesh.get(&format!("/v1/nodes/{db}/labels")).await?;
    assert_eq!(
        labels["labels"]["operator"],
        json!({"tier": "gold", "owner": "ops"})
    );
    ok(&mesh, &["label", &db, "tier-"])?;
    let (_, labels) = mesh.get(&format!("/v1/nodes/{db}/labels")).await?;
    assert_eq!(labels["labels"]["operator"], json!({"owner": "ops"}));
    let gold = json_of(&mesh, &["get", "nodes", "-l", "owner=ops"])?;
    assert_eq!(ids(&gold, "id"), vec![db.clone()]);
    let (code, _, err) = mesh.meshctl(&["label", &db, "Bad Key=x"])?;
    assert_eq!(code, 1);
    assert!(
        err.contains("422") && err.contains("field: labels.Bad Key"),
        "the problem's field: {err}"
    );

    // A file and a module, so the other lists have something.
    let (status, _) = mesh
        .put(
            "/v1/files/motd",
            &json!({"path": "/etc/motd", "content": "hello\n", "mode": "0644", "selector": {"role": "web"}}),
        )
        .await?;
    assert!(status == 200 || status == 201, "PUT file: {status}");
    let (status, _, body) = mesh
        .request(
            Method::PUT,
            "/v1/modules/web",
            &[],
            Some(&json!({
                "unit": {"command": "sleep", "args": ["1000"]},
                "placement": {"match_labels": {"labels": {"role": "web"}, "replicas": 2}}
            })),
        )
        .await?;
    assert_eq!(status, 201, "PUT module: {body}");
    wait_for("2 running replicas of web", WITHIN, || async {
        let (_, m) = mesh.get("/v1/modules/web").await?;
        let running = m["assignments"].as_array().map_or(0, |a| {
            a.iter().filter(|x| x["unit_state"] == "running").count()
        });
        Ok((running == 2).then_some(()))
    })
    .await?;

    // Every kind: -o json matches the API's list.
    for (kind, path, key, id) in [
        ("modules", "/v1/modules", "modules", "name"),
        ("files", "/v1/files", "files", "name"),
        ("settings", "/v1/settings", "layers", "name"),
        ("secrets", "/v1/secrets", "secrets", "name"),
        ("alerts", "/v1/alerts", "alerts", "id"),
        ("runs", "/v1/runs", "runs", "id"),
        ("tokens", "/v1/tokens", "tokens", "id"),
    ] {
        let got = json_of(&mesh, &["get", kind])?;
        let want = api_list(&mesh, path, key).await?;
        assert_eq!(ids(&got, id), ids(&want, id), "get {kind}");
        let table = ok(&mesh, &["get", kind])?;
        assert_eq!(
            table.lines().count(),
            1 + got.as_array().unwrap().len(),
            "get {kind}: a header and a row each\n{table}"
        );
    }
    let files = json_of(&mesh, &["get", "files"])?;
    assert_eq!(files[0]["path"], "/etc/motd");
    let modules = ok(&mesh, &["get", "modules"])?;
    assert!(
        modules.contains("web") && modules.contains("2/2"),
        "{modules}"
    );

    // describe node: state, labels, sections declared vs applied, units.
    let web_node = wait_for("the config section applied on web-eu", WITHIN, || async {
        let n = node_state(&mesh, &web_eu).await?;
        let c = &n["sections"]["config"];
        Ok((c["declared"].is_i64() && c["declared"] == c["applied"]).then_some(n))
    })
    .await?;
    let text = ok(&mesh, &["describe", "node", &web_eu])?;
    for want in [
        "Name:",
        "State:",
        "alive",
        "role=web,zone=eu",
        "Sections",
        "config",
        "in sync",
        "Units:",
        "web-",
        "Recent events:",
    ] {
        assert!(text.contains(want), "describe node lacks {want}:\n{text}");
    }
    let described = json_of(&mesh, &["describe", "node", &web_eu])?;
    assert_eq!(described["node"]["id"], web_node["id"]);
    assert_eq!(
        described["node"]["sections"]["config"],
        web_node["sections"]["config"]
    );
    assert!(
        described["events"]
            .as_array()
            .is_some_and(|e| !e.is_empty()),
        "{described}"
    );

    // describe module: its replicas with their nodes.
    let text = ok(&mesh, &["describe", "module", "web"])?;
    for want in [
        "Name:          web",
        "Command:       sleep 1000",
        "Replicas:",
        &web_eu,
        &web_us,
        "running",
    ] {
        assert!(text.contains(want), "describe module lacks {want}:\n{text}");
    }

    // A rollout, so runs and describe run have something.
    let rev = ok(
        &mesh,
        &[
            "revision",
            "create",
            "web",
            "--command",
            "sleep",
            "--arg",
            "1001",
        ],
    )?;
    let rev = rev.trim().to_owned();
    let (code, out, err) = mesh.meshctl(&[
        "rollout",
        "start",
        "web",
        "--revision",
        &rev,
        "--settle",
        "0",
        "--wait",
        "--timeout",
        "60",
        "--interval-ms",
        "200",
    ])?;
    assert_eq!(code, 0, "rollout: {out}\n{err}");
    let runs = json_of(&mesh, &["get", "runs"])?;
    let api_runs = api_list(&mesh, "/v1/runs", "runs").await?;
    assert_eq!(ids(&runs, "id"), ids(&api_runs, "id"));
    assert_eq!(runs.as_array().unwrap().len(), 2, "{runs}");
    let run = runs[0]["id"].as_str().unwrap().to_owned();
    let text = ok(&mesh, &["describe", "run", &run])?;
    for want in [
        "Run:",
        "State:         succeeded",
        "Receipts:",
        "run.succeeded",
    ] {
        assert!(text.contains(want), "describe run lacks {want}:\n{text}");
    }

    // drain / undrain: the API's admin state follows.
    let out = ok(&mesh, &["drain", &db])?;
    assert!(out.contains(&db), "{out}");
    let n = node_state(&mesh, &db).await?;
    assert!(
        matches!(n["admin_state"].as_str(), Some("draining" | "drained")),
        "{n}"
    );
    let drained = json_of(&mesh, &["get", "nodes", "-l", "role=db"])?;
    assert!(
        matches!(drained[0]["state"].as_str(), Some("draining" | "drained")),
        "{drained}"
    );
    ok(&mesh, &["undrain", &db])?;
    let n = node_state(&mesh, &db).await?;
    assert_eq!(n["admin_state"], "active", "{n}");

    // status: the fleet in numbers, as the API has it.
    let status = json_of(&mesh, &["status"])?;
    assert_eq!(status["nodes"]["total"], 3, "{status}");
    assert_eq!(status["modules"]["total"], 1, "{status}");
    let (_, list) = mesh.get("/v1/nodes").await?;
    assert_eq!(
        status["heartbeat"]["detection_ms"],
        list["heartbeat"]["detection_ms"]
    );
    let text = ok(&mesh, &["status"])?;
    for want in [
        "Nodes:      3",
        "Modules:    1",
        "Alerts:",
        "Rollouts:   0 in progress",
        "Detection:  a node is judged unreachable within",
    ] {
        assert!(text.contains(want), "status lacks {want}:\n{text}");
    }

    // events without --follow: the kept events, filtered, then exit.
    let out = ok(
        &mesh,
        &[
            "events",
            "--context",
            "inventory",
            "--node",
            &db,
            "-o",
            "json",
        ],
    )?;
    let evs: Vec<Value> = out
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    assert!(!evs.is_empty());
    assert!(
        evs.iter()
            .all(|e| e["context"] == "inventory" && e["node"] == db.as_str()),
        "{out}"
    );
    let out = ok(&mesh, &["events", "--kind", "node.joined"])?;
    assert_eq!(
        out.lines()
            .filter(|l| l.contains("inventory.node.joined"))
            .count(),
        3,
        "{out}"
    );

    // An API problem prints its title, detail and field; exit 1.
    let (code, _, err) = mesh.meshctl(&["describe", "node", "nobody-here"])?;
    assert_eq!(code, 1);
    assert!(err.contains("404"), "{err}");

    config_precedence(&mesh)?;
    mesh.teardown().await
}

/// Flag > env > config file > default, with the file found by --config,
/// MESH_CONFIG or ~/.config/mesh/meshctl.toml; a bad file is an error
/// naming it.
fn config_precedence(mesh: &Mesh) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let token = dir.path().join("token");
    std::fs::write(&token, format!("{}\n", mesh.admin_token()))?;
    let good = dir.path().join("good.toml");
    // token_file relative to the file.
    std::fs::write(
        &good,
        format!("api = {:?}\ntoken_file = \"token\"\n", mesh.api),
    )?;
    let nowhere = "http://127.0.0.1:9";

    let get = |cmd: &mut Command| output(cmd.args(["get", "nodes", "-o", "json"]));
    // The file alone (named by --config, by MESH_CONFIG, or found at home).
    let (code, out, err) = get(meshctl_command()?.arg("--config").arg(&good))?;
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        serde_json::from_str::<Value>(&out)?
            .as_array()
            .map(Vec::len),
        Some(3)
    );
    let (code, _, err) = get(meshctl_command()?.env("MESH_CONFIG", &good))?;
    assert_eq!(code, 0, "{err}");
    let home = dir.path().join("home");
    std::fs::create_dir_all(home.join(".config/mesh"))?;
    std::fs::copy(&good, home.join(".config/mesh/meshctl.toml"))?;
    std::fs::copy(&token, home.join(".config/mesh/token"))?;
    let (code, _, err) = get(meshctl_command()?.env("HOME", &home))?;
    assert_eq!(code, 0, "the default file: {err}");
    // Env beats the file: a dead API from MESH_API fails...
    let (code, _, err) = get(meshctl_command()?
        .arg("--config")
        .arg(&good)
        .env("MESH_API", nowhere))?;
    assert_eq!(code, 1, "MESH_API must win over the file");
    assert!(err.contains("GET /v1/nodes"), "{err}");
    // ...and a flag beats env.
    let (code, _, err) = get(meshctl_command()?
        .arg("--config")
        .arg(&good)
        .env("MESH_API", nowhere)
        .args(["--api", &mesh.api]))?;
    assert_eq!(code, 0, "--api must win over MESH_API: {err}");
    // A wrong token from env beats the file's token file (401).
    let (code, _, err) = get(meshctl_command()?
        .arg("--config")
        .arg(&good)
        .env("MESH_TOKEN", "wrong"))?;
    assert_eq!(code, 1);
    assert!(err.contains("401"), "{err}");
    // MESH_TOKEN_FILE alone.
    let (code, _, err) = get(meshctl_command()?
        .env("MESH_API", &mesh.api)
        .env("MESH_TOKEN_FILE", &token))?;
    assert_eq!(code, 0, "{err}");

    // Bad files: an unknown key, a missing file; errors name them; the token
    // is never printed.
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "api = \"http://127.0.0.1:1\"\ntokn = \"x\"\n")?;
    let (code, _, err) = get(meshctl_command()?.arg("--config").arg(&bad))?;
    assert_eq!(code, 1);
    assert!(err.contains("bad.toml") && err.contains("tokn"), "{err}");
    let missing = dir.path().join("missing.toml");
    let (code, _, err) = get(meshctl_command()?.env("MESH_CONFIG", &missing))?;
    assert_eq!(code, 1);
    assert!(err.contains("missing.toml"), "{err}");
    let (_, out, err) = output(
        meshctl_command()?
            .arg("--config")
            .arg(&good)
            .args(["get", "nodes", "-o", "json", "--api", nowhere]),
    )?;
    assert!(!out.contains(mesh.admin_token()) && !err.contains(mesh.admin_token()));
    Ok(())
}

#[tokio::test]
async fn get_nodes_watch_shows_a_stopped_agent_turn_unreachable() -> anyhow::Result<()> {
    let mut mesh = Mesh::start().await?;
    let a = mesh.add_agent("a", &[("role", "web")]).await?;
    let b = mesh.add_agent("b", &[("role", "web")]).await?;
    all_alive(&mesh, 2).await?;
    let mut watch = Kill(
        meshctl_command()?
            .args(["get", "nodes", "-w"])
            .env("MESH_API", &mesh.api)
            .env("MESH_TOKEN", mesh.admin_token())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?,
    );
    let rx = lines_of(&mut watch.0);
    let mut seen = Vec::new();
    until(&rx, &mut seen, WITHIN, "the table", |s| {
        s.len() >= 3 && s.iter().filter(|l| l.contains(" alive ")).count() == 2
    })?;
    assert!(seen[0].starts_with("NAME"), "{seen:?}");
    let stopped = Instant::now();
    mesh.stop_agent(&b);
    // Within the grace, the sweep and the stream's latency (and well under
    // the periodic re-list's 10 s on top of it).
    until(
        &rx,
        &mut seen,
        GRACE + Duration::from_secs(8),
        &format!("{b} unreachable"),
        |s| {
            s.iter()
                .skip(3)
                .any(|l| l.starts_with(&b) && l.contains("unreachable"))
        },
    )?;
    let took = stopped.elapsed();
    assert!(
        !seen.iter().skip(3).any(|l| l.starts_with(&a)),
        "only the row that changed is printed again: {seen:?}"
    );
    eprintln!("unreachable shown {took:?} after the agent stopped");
    drop(watch);
    mesh.teardown().await
}

#[tokio::test]
async fn events_follow_resumes_after_the_controller_restarts() -> anyhow::Result<()> {
    let mut mesh = Mesh::start().await?;
    let a = mesh.add_agent("a", &[("role", "web")]).await?;
    all_alive(&mesh, 1).await?;
    let mut follow = Kill(
        meshctl_command()?
            .args([
                "events",
                "--follow",
                "--after",
                "0",
                "--context",
                "inventory",
                "-o",
                "json",
            ])
            .env("MESH_API", &mesh.api)
            .env("MESH_TOKEN", mesh.admin_token())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?,
    );
    let stderr = follow.0.stderr.take();
    let errors = std::thread::spawn(move || {
        let mut text = String::new();
        if let Some(mut e) = stderr {
            use std::io::Read as _;
            let _ = e.read_to_string(&mut text);
        }
        text
    });
    let rx = lines_of(&mut follow.0);
    let mut seen = Vec::new();
    let labelled = |phase: &'static str| {
        move |s: &[String]| {
            s.iter().any(|l| {
                serde_json::from_str::<Value>(l).is_ok_and(|e| {
                    e["event"] == "node.updated" && e["body"]["labels"]["phase"] == phase
                })
            })
        }
    };
    ok(&mesh, &["label", &a, "phase=before"])?;
    until(
        &rx,
        &mut seen,
        WITHIN,
        "the event before the restart",
        labelled("before"),
    )?;

    // The controller goes away; meshctl keeps trying.
    mesh.kill_controller();
    tokio::time::sleep(Duration::from_secs(2)).await;
    mesh.start_controller(&[]).await?;
    ok(&mesh, &["label", &a, "phase=after"])?;
    until(
        &rx,
        &mut seen,
        WITHIN,
        "the event after the restart",
        labelled("after"),
    )?;
    // A little longer: anything repeated would arrive now.
    let _ = until(&rx, &mut seen, Duration::from_secs(2), "nothing", |_| false);

    let events: Vec<Value> = seen
        .iter()
        .map(|l| serde_json::from_str(l))
        .collect::<Result<_, _>>()?;
    let positions: Vec<i64> = events
        .iter()
        .map(|e| e["position"].as_i64().unwrap())
        .collect();
    assert!(
        positions.windows(2).all(|w| w[0] < w[1]),
        "every event once, in order: {positions:?}"
    );
    for phase in ["before", "after"] {
        let n = events
            .iter()
            .filter(|e| e["event"] == "node.updated" && e["body"]["labels"]["phase"] == phase)
            .count();
        assert_eq!(n, 1, "the {phase} event exactly once: {seen:?}");
    }
    assert!(events.iter().all(|e| e["context"] == "inventory"));
    drop(follow);
    let errors = errors.join().unwrap_or_default();
    assert!(
        errors.contains("reconnecting"),
        "meshctl said it reconnects: {errors}"
    );
    assert!(errors.contains("resuming after"), "{errors}");
    mesh.teardown().await
}

/// `get grants` and `describe grant` against a live controller: a module
/// requiring a database no module provides has a grant that waits, saying
/// why; meshctl's lists are the API's, its filters the API's, and a grant is
/// found by id, a start of one, or consumer/requirement.
#[tokio::test]
async fn meshctl_gets_and_describes_grants() -> anyhow::Result<()> {
    let mesh = Mesh::start().await?;
    let spec = json!({
        "unit": {"command": "sleep", "args": ["1000"]},
        "placement": {"match_labels": {"labels": {"role": "app"}, "replicas": 1}},
        "requires": [{"kind": "postgres.database", "name": "db"}]
    });
    let (status, body) = mesh.put("/v1/modules/app", &spec).await?;
    anyhow::ensure!(
        status == 200 || status == 201,
        "PUT module: {status} {body}"
    );
    let grant = wait_for("app's grant", WITHIN, || async {
        let (status, v) = mesh.get("/v1/grants?module=app").await?;
        anyhow::ensure!(status == 200, "GET /v1/grants: {status} {v}");
        Ok(v["grants"].as_array().and_then(|g| g.first()).cloned())
    })
    .await?;
    let id = grant["id"].as_str().unwrap_or_default().to_owned();
    assert_eq!(grant["state"], "requested", "{grant}");

    // -o json is the API's objects, every page; the table is for people.
    let listed = json_of(&mesh, &["get", "grants"])?;
    let from_api = api_list(&mesh, "/v1/grants", "grants").await?;
    assert_eq!(ids(&listed, "id"), ids(&from_api, "id"));
    assert_eq!(ids(&listed, "id"), vec![id.clone()]);
    let table = ok(&mesh, &["get", "grants"])?;
    let lines: Vec<&str> = table.lines().collect();
    assert!(
        lines[0].starts_with("CONSUMER   REQUIREMENT   KIND"),
        "{table}"
    );
    let row: Vec<&str> = lines[1].split_whitespace().collect();
    assert_eq!(
        row[..5],
        ["app", "db", "postgres.database", "-", "requested"],
        "{table}"
    );
    let wide = ok(&mesh, &["get", "grant", "-o", "wide"])?;
    assert!(wide.contains(&id) && wide.contains("app-db"), "{wide}");

    // The filters are the API's query parameters.
    for (args, n) in [
        (&["--module", "app"][..], 1),
        (&["--module", "other"], 0),
        (&["--kind", "postgres.database", "--state", "requested"], 1),
        (&["--kind", "amqp.vhost"], 0),
        (&["--resource", "app-db"], 1),
        (&["--state", "ready"], 0),
    ] {
        let mut all = vec!["get", "grants"];
        all.extend_from_slice(args);
        let v = json_of(&mesh, &all)?;
        assert_eq!(v.as_array().map(Vec::len), Some(n), "{args:?}: {v}");
    }
    let (code, _, err) = mesh.meshctl(&["get", "grants", "--state", "sleeping"])?;
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("422") && err.contains("state"), "{err}");
    let (code, _, err) = mesh.meshctl(&["get", "grants", "-l", "role=app"])?;
    assert_eq!(code, 1);
    assert!(err.contains("grants have no labels"), "{err}");

    // describe: by consumer/requirement, by the start of the id, by the id.
    let text = ok(&mesh, &["describe", "grant", "app/db"])?;
    for line in [
        format!("Grant:          {id}"),
        "State:          requested".to_owned(),
        "Provider:       none chosen yet".to_owned(),
        "Reason:         ".to_owned(),
    ] {
        assert!(text.contains(&line), "`{line}` in\n{text}");
    }
    let by_prefix = ok(&mesh, &["describe", "grant", &id[..8]])?;
    assert!(
        by_prefix.contains(&format!("Grant:          {id}")),
        "{by_prefix}"
    );
    let v: Value = serde_json::from_str(&ok(&mesh, &["describe", "grant", &id, "-o", "json"])?)?;
    for key in [
        "id",
        "consumer",
        "requirement",
        "kind",
        "resource",
        "credential_file",
    ] {
        assert_eq!(v["grant"][key], grant[key], "{key}: the API's object");
    }
    for (name, says) in [
        ("ffffffff", "no grant's id starts with"),
        ("other/db", "no grant for module `other`"),
        ("ffffffff-ffff-4fff-8fff-ffffffffffff", "404"),
    ] {
        let (code, _, err) = mesh.meshctl(&["describe", "grant", name])?;
        assert_eq!(code, 1, "{name}: {err}");
        assert!(err.contains(says), "{name}: {err}");
    }
    mesh.teardown().await
}

#[test]
fn completions_and_man_pages_are_well_formed() -> anyhow::Result<()> {
    for shell in ["bash", "zsh", "fish"] {
        let (code, out, err) = output(meshctl_command()?.args(["completion", shell]))?;
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("meshctl"), "{shell}");
        for sub in [
            "describe",
            "events",
            "label",
            "drain",
            "undrain",
            "completion",
        ] {
            assert!(out.contains(sub), "{shell} completion lacks {sub}");
        }
        // Syntax-check it with the shell itself where the shell is here.
        if Command::new(shell)
            .arg("-c")
            .arg("true")
            .output()
            .is_ok_and(|o| o.status.success())
        {
            let file = tempfile::NamedTempFile::new()?;
            std::fs::write(file.path(), &out)?;
            let check = Command::new(shell).arg("-n").arg(file.path()).output()?;
            assert!(
                check.status.success(),
                "{shell} -n: {}",
                String::from_utf8_lossy(&check.stderr)
            );
        }
    }
    let (code, _, err) = output(meshctl_command()?.args(["completion", "tcsh"]))?;
    assert_eq!(code, 1, "an unknown shell is refused: {err}");

    let dir = tempfile::tempdir()?;
    let man = dir.path().join("man1");
    let (code, _, err) = output(meshctl_command()?.arg("man").arg(&man))?;
    assert_eq!(code, 0, "{err}");
    for page in [
        "meshctl.1",
        "meshctl-get.1",
        "meshctl-describe.1",
        "meshctl-status.1",
        "meshctl-events.1",
        "meshctl-label.1",
        "meshctl-drain.1",
        "meshctl-rollout-status.1",
        "meshctl-node-add.1",
    ] {
        let text =
            std::fs::read_to_string(man.join(page)).map_err(|e| anyhow::anyhow!("{page}: {e}"))?;
        assert!(
            text.starts_with(".ie") || text.contains(".TH "),
            "{page} is not roff:\n{text}"
        );
        assert!(text.contains(".SH NAME"), "{page}");
    }
    let top = std::fs::read_to_string(man.join("meshctl.1"))?;
    assert!(
        top.contains("Exit codes"),
        "the exit codes are in the man page"
    );
    // man(1) renders it without complaint where it is installed.
    let here = |tool: &str| {
        Command::new(tool)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if here("man") && here("nroff") {
        let shown = Command::new("man")
            .arg("-l")
            .arg(man.join("meshctl-get.1"))
            .env("MANPAGER", "cat")
            .env("MANWIDTH", "100")
            .output()?;
        let text = String::from_utf8_lossy(&shown.stdout);
        assert!(
            shown.status.success() && text.contains("selector"),
            "{text}"
        );
    }
    let help = output(meshctl_command()?.arg("--help"))?.1;
    for code in [
        "0  success",
        "1  error",
        "2  plan --detailed-exitcode",
        "3  a watched rollout failed",
        "7  a precondition failed",
    ] {
        assert!(help.contains(code), "--help lacks `{code}`:\n{help}");
    }
    Ok(())
}

/// Issue 29, point 2: `meshctl token create --ttl` makes a token that ends
/// when asked, `get tokens` shows when, and `meshctl token rotate` prints a
/// new secret of the same name and role while the old one stops working.
#[tokio::test]
async fn meshctl_tokens_end_and_rotate() -> anyhow::Result<()> {
    let mesh = Mesh::start().await?;
    let (code, secret, err) = mesh.meshctl(&[
        "token",
        "create",
        "--role",
        "viewer",
        "--name",
        "ci-reader",
        "--ttl",
        "2h",
    ])?;
    anyhow::ensure!(code == 0, "token create: exit {code}\n{err}");
    let secret = secret.trim().to_owned();
    assert!(err.contains("expires"), "{err}");
    let (code, _, err) = mesh_e2e::meshctl_at(&mesh.api, &secret, &["get", "nodes"])?;
    anyhow::ensure!(code == 0, "the new token reads: exit {code}\n{err}");
    let tokens = json_of(&mesh, &["get", "tokens"])?;
    let mine = tokens
        .as_array()
        .and_then(|t| t.iter().find(|t| t["name"] == "ci-reader"))
        .cloned()
        .ok_or_else(|| anyhow::anyhow!("no ci-reader in {tokens}"))?;
    let expires = chrono::DateTime::parse_from_rfc3339(mine["expires_at"].as_str().unwrap_or(""))?;
    let left = expires.with_timezone(&chrono::Utc) - chrono::Utc::now();
    assert!((7100..=7200).contains(&left.num_seconds()), "{left}");
    let table = ok(&mesh, &["get", "tokens"])?;
    assert!(
        table.contains("EXPIRES") && (table.contains("in 2h") || table.contains("in 119m")),
        "{table}"
    );
    let id = mine["id"].as_str().unwrap_or_default();
    let (code, rotated, err) = mesh.meshctl(&["token", "rotate", id])?;
    anyhow::ensure!(code == 0, "token rotate: exit {code}\n{err}");
    let rotated = rotated.trim();
    assert!(err.contains("rotated") && err.contains(id), "{err}");
    assert_ne!(rotated, secret);
    let (code, _, _) = mesh_e2e::meshctl_at(&mesh.api, rotated, &["get", "nodes"])?;
    assert_eq!(code, 0, "the rotated token reads");
    let (code, _, err) = mesh_e2e::meshctl_at(&mesh.api, &secret, &["get", "nodes"])?;
    assert_ne!(code, 0, "the old secret still works");
    assert!(err.contains("revoked"), "{err}");
    let (code, _, err) = mesh.meshctl(&["token", "create", "--role", "viewer", "--ttl", "1w"])?;
    assert_ne!(code, 0);
    assert!(err.contains("not a lifetime"), "{err}");
    mesh.teardown().await
}
