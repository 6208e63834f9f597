//! Fleet lifecycle end to end: real controller and agents, real processes as
//! units. A node that dies loses its replicas to others and gets the surplus
//! stopped when it returns; a controller outage moves nothing; a stateful module
//! never moves and holds a drain; concurrent writers get 412; a killed unit is
//! restarted and counted.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use mesh_e2e::{GRACE, Mesh, wait_for};
use reqwest::Method;
use serde_json::{Value, json};

const WITHIN: Duration = Duration::from_secs(30);

fn sleeper(labels: Value, replicas: u32) -> Value {
    json!({
        "unit": {"command": "sleep", "args": ["1000"]},
        "placement": {"match_labels": {"labels": labels, "replicas": replicas}}
    })
}

/// The array `key` of a list answer: an error when it is missing or not an
/// array, so that a wrong answer cannot pass as an empty list.
fn list(answer: &Value, key: &str) -> anyhow::Result<Vec<Value>> {
    answer[key]
        .as_array()
        .cloned()
        .ok_or_else(|| anyhow::anyhow!("no array `{key}` in {answer}"))
}

async fn put_module(mesh: &Mesh, name: &str, spec: &Value) -> anyhow::Result<()> {
    let (status, _, body) = mesh
        .request(
            Method::PUT,
            &format!("/v1/modules/{name}"),
            &[("if-match", "*")],
            Some(spec),
        )
        .await?;
    if status == 412 {
        // Not there yet: create it.
        let (status, _, body) = mesh
            .request(Method::PUT, &format!("/v1/modules/{name}"), &[], Some(spec))
            .await?;
        anyhow::ensure!(status == 201, "PUT module {name}: {status} {body}");
        return Ok(());
    }
    anyhow::ensure!(status == 200, "PUT module {name}: {status} {body}");
    Ok(())
}

/// Active assignments of a module: replica → (node, unit state, pid, restarts).
async fn active(
    mesh: &Mesh,
    module: &str,
) -> anyhow::Result<BTreeMap<u64, (String, Option<String>, Option<u64>, u64)>> {
    let (status, view) = mesh.get(&format!("/v1/modules/{module}")).await?;
    anyhow::ensure!(status == 200, "GET module {module}: {status} {view}");
    Ok(list(&view, "assignments")?
        .iter()
        .filter(|a| a["role"] == "active")
        .map(|a| {
            (
                a["replica"].as_u64().unwrap_or(0),
                (
                    a["node"].as_str().unwrap_or_default().to_owned(),
                    a["unit_state"].as_str().map(str::to_owned),
                    a["pid"].as_u64(),
                    a["restarts"].as_u64().unwrap_or(0),
                ),
            )
        })
        .collect())
}

/// Wait until `replicas` active replicas of `module` report running; returns
/// replica → (node, pid).
async fn running(
    mesh: &Mesh,
    module: &str,
    replicas: usize,
) -> anyhow::Result<BTreeMap<u64, (String, u64)>> {
    wait_for(
        &format!("{replicas} running replicas of {module}"),
        WITHIN,
        || async {
            let a = active(mesh, module).await?;
            let ok = a.len() == replicas
                && a.values()
                    .all(|(_, s, pid, _)| s.as_deref() == Some("running") && pid.is_some());
            Ok(ok.then(|| {
                a.into_iter()
                    .map(|(r, (n, _, pid, _))| (r, (n, pid.unwrap_or(0))))
                    .collect()
            }))
        },
    )
    .await
}

async fn node_state(mesh: &Mesh, node: &str) -> anyhow::Result<Value> {
    let (status, view) = mesh.get(&format!("/v1/nodes/{node}")).await?;
    anyhow::ensure!(status == 200, "GET node {node}: {status} {view}");
    Ok(view)
}

async fn all_alive(mesh: &Mesh, n: usize) -> anyhow::Result<()> {
    wait_for(&format!("{n} alive nodes"), WITHIN, || async {
        let (_, nodes) = mesh.get("/v1/nodes").await?;
        let nodes = list(&nodes, "nodes")?;
        Ok((nodes.len() == n && nodes.iter().all(|n| n["state"] == "alive")).then_some(()))
    })
    .await
}

fn alive(pid: u64) -> bool {
    // A zombie is as good as gone.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            !s.rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        })
        .unwrap_or(false)
}

/// Pids of processes of this mesh (working dir under its directory) whose
/// environment says they are unit `unit` of `module`.
fn unit_processes(mesh: &Mesh, module: &str, unit: &str) -> Vec<u64> {
    let want_module = format!("MESH_MODULE={module}");
    let want_unit = format!("MESH_UNIT={unit}");
    let mut pids = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return pids;
    };
    for entry in dir.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u64>() else {
            continue;
        };
        let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else {
            continue;
        };
        let ours = std::fs::read_link(format!("/proc/{pid}/cwd"))
            .is_ok_and(|cwd| cwd.starts_with(mesh.dir.path()));
        if !ours {
            continue;
        }
        let vars: Vec<&[u8]> = env.split(|b| *b == 0).collect();
        if vars.contains(&want_module.as_bytes())
            && vars.contains(&want_unit.as_bytes())
            && alive(pid)
        {
            pids.push(pid);
        }
    }
    pids
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_node_loses_its_replicas_and_stops_the_surplus_on_return() -> anyhow::Result<()> {
    let mut mesh = Mesh::start().await?;
    for s in ["a", "b", "c", "d"] {
        mesh.add_agent(s, &[("role", "web")]).await?;
    }
    all_alive(&mesh, 4).await?;
    put_module(&mesh, "killweb", &sleeper(json!({"role": "web"}), 2)).await?;
    let before = running(&mesh, "killweb", 2).await?;
    let (victim, old_pid) = before[&0].clone();
    let survivor = before[&1].0.clone();

    // SIGKILL the agent of replica 0: its unit is orphaned, still running.
    mesh.stop_agent(&victim);
    let killed = Instant::now();
    wait_for(
        "the killed node to be unreachable",
        GRACE + Duration::from_secs(2),
        || async {
            Ok((node_state(&mesh, &victim).await?["state"] == "unreachable").then_some(()))
        },
    )
    .await?;
    eprintln!("unreachable after {:?}", killed.elapsed());
    let after = running(&mesh, "killweb", 2).await?;
    assert!(after.values().all(|(n, _)| *n != victim), "{after:?}");
    assert_eq!(after[&1].0, survivor, "the healthy replica did not move");
    let (replacement, new_pid) = after[&0].clone();
    assert!(
        alive(old_pid),
        "the orphan keeps running while its agent is down"
    );

    // The agent returns: the surplus (the old copy of replica 0) stops; the
    // newest placement wins and nothing moves back.
    mesh.start_agent(&victim)?;
    wait_for("the node to be alive again", WITHIN, || async {
        Ok((node_state(&mesh, &victim).await?["state"] == "alive").then_some(()))
    })
    .await?;
    wait_for("exactly one process of killweb-0", WITHIN, || async {
        let pids = unit_processes(&mesh, "killweb", "killweb-0");
        if pids == vec![new_pid] && !alive(old_pid) {
            return Ok(Some(()));
        }
        Err(anyhow::anyhow!(
            "processes of killweb-0: {pids:?}; replacement {new_pid}; old {old_pid} alive: {}",
            alive(old_pid)
        ))
    })
    .await?;
    let settled = running(&mesh, "killweb", 2).await?;
    assert_eq!(settled[&0].0, replacement);
    // Every alert the outage raised (observability's) resolves.
    wait_for("no open alert", WITHIN, || async {
        let (_, alerts) = mesh.get("/v1/alerts").await?;
        if alerts["alerts"] == json!([]) {
            return Ok(Some(()));
        }
        Err(anyhow::anyhow!("open: {alerts}"))
    })
    .await?;
    mesh.teardown().await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_controller_outage_longer_than_the_grace_moves_nothing() -> anyhow::Result<()> {
    let mut mesh = Mesh::start().await?;
    for s in ["a", "b", "c"] {
        mesh.add_agent(s, &[("role", "web")]).await?;
    }
    all_alive(&mesh, 3).await?;
    put_module(&mesh, "steady", &sleeper(json!({"role": "web"}), 2)).await?;
    let before = running(&mesh, "steady", 2).await?;

    // Down for twice the grace: every node's last report is stale by then.
    mesh.kill_controller();
    let down = Instant::now();
    while down.elapsed() < GRACE * 2 {
        for (node, pid) in before.values() {
            assert!(
                alive(*pid),
                "unit on {node} stopped while the controller was down"
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    mesh.start_controller(&[]).await?;

    // For a grace and more after the restart: nobody unreachable, nothing moved,
    // the same processes running.
    let back = Instant::now();
    while back.elapsed() < GRACE + Duration::from_secs(2) {
        let (_, nodes) = mesh.get("/v1/nodes").await?;
        let nodes = list(&nodes, "nodes")?;
        assert_eq!(nodes.len(), 3, "after a controller restart: {nodes:?}");
        for n in nodes {
            assert_eq!(n["state"], "alive", "after a controller restart: {n}");
        }
        let now = active(&mesh, "steady").await?;
        for (replica, (node, pid)) in &before {
            assert_eq!(now[replica].0, *node, "replica {replica} moved");
            assert!(alive(*pid), "unit of replica {replica} stopped");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let after = running(&mesh, "steady", 2).await?;
    assert_eq!(after, before);
    mesh.teardown().await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stateful_module_never_moves_and_holds_the_drain() -> anyhow::Result<()> {
    let mut mesh = Mesh::start().await?;
    let a = mesh.add_agent("a", &[("role", "web")]).await?;
    let b = mesh.add_agent("b", &[("role", "web")]).await?;
    all_alive(&mesh, 2).await?;
    let db = json!({
        "unit": {"command": "sleep", "args": ["1000"]}, "stateful": true,
        "placement": {"exact_node": {"node": a}}
    });
    put_module(&mesh, "db", &db).await?;
    // A stateless module on the same node (`a` sorts first).
    put_module(&mesh, "front", &sleeper(json!({"role": "web"}), 1)).await?;
    let db_before = running(&mesh, "db", 1).await?;
    let front_before = running(&mesh, "front", 1).await?;
    assert_eq!(db_before[&0].0, a);
    assert_eq!(front_before[&0].0, a);

    let (status, body) = mesh.post(&format!("/v1/nodes/{a}/drain")).await?;
    assert_eq!(status, 200, "{body}");
    // The stateless one moves (make-before-break); the stateful one holds the drain.
    let front_after = wait_for("front to run on b", WITHIN, || async {
        let r = active(&mesh, "front").await?;
        Ok(r.get(&0)
            .filter(|(n, s, _, _)| *n == b && s.as_deref() == Some("running"))
            .cloned())
    })
    .await?;
    assert!(!alive(front_before[&0].1) || front_after.2 != Some(front_before[&0].1));
    let reason = wait_for("the drain to wait with a reason", WITHIN, || async {
        let view = node_state(&mesh, &a).await?;
        let only_db = view["units"].as_array().is_some_and(|u| u.len() == 1);
        Ok((view["state"] == "draining" && only_db).then(|| {
            view["drain_blocked"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        }))
    })
    .await?;
    assert!(reason.contains("`db` is stateful"), "{reason}");
    wait_for("the old copy of front to stop", WITHIN, || async {
        Ok((!alive(front_before[&0].1)).then_some(()))
    })
    .await?;
    let db_now = running(&mesh, "db", 1).await?;
    assert_eq!(db_now, db_before, "the stateful module never moved");

    // Stopping it lets the drain finish.
    let mut stopped = db.clone();
    stopped["desired"] = json!("stopped");
    put_module(&mesh, "db", &stopped).await?;
    wait_for("the node to be drained", WITHIN, || async {
        Ok((node_state(&mesh, &a).await?["state"] == "drained").then_some(()))
    })
    .await?;
    wait_for("the stopped db unit to exit", WITHIN, || async {
        Ok((!alive(db_before[&0].1)).then_some(()))
    })
    .await?;
    mesh.teardown().await
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_module_updates_one_wins_the_other_gets_412() -> anyhow::Result<()> {
    let mesh = Mesh::start().await?;
    let spec = sleeper(json!({"role": "none"}), 1);
    let (status, etag, body) = mesh
        .request(Method::PUT, "/v1/modules/race", &[], Some(&spec))
        .await?;
    assert_eq!(status, 201, "{body}");
    let etag = etag.expect("an ETag");
    let mut one = spec.clone();
    one["unit"]["args"] = json!(["1"]);
    let mut two = spec.clone();
    two["unit"]["args"] = json!(["2"]);
    let if_match = [("if-match", etag.as_str())];
    let (r1, r2) = tokio::join!(
        mesh.request(Method::PUT, "/v1/modules/race", &if_match, Some(&one)),
        mesh.request(Method::PUT, "/v1/modules/race", &if_match, Some(&two)),
    );
    let (r1, r2) = (r1?, r2?);
    let mut statuses = [r1.0, r2.0];
    statuses.sort();
    assert_eq!(statuses, [200, 412], "{r1:?} {r2:?}");
    let loser = if r1.0 == 412 { &r1 } else { &r2 };
    assert_eq!(loser.2["status"], 412, "problem+json: {loser:?}");
    // The winner's write is what is stored.
    let winner = if r1.0 == 200 { &one } else { &two };
    let (_, view) = mesh.get("/v1/modules/race").await?;
    assert_eq!(view["unit"]["args"], winner["unit"]["args"]);
    assert_eq!(view["revision"], 2);
    // Without If-Match on an existing module: 428.
    let (status, _, _) = mesh
        .request(Method::PUT, "/v1/modules/race", &[], Some(&spec))
        .await?;
    assert_eq!(status, 428);
    mesh.teardown().await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_unit_is_restarted_and_counted() -> anyhow::Result<()> {
    let mut mesh = Mesh::start().await?;
    let a = mesh.add_agent("a", &[("role", "solo")]).await?;
    all_alive(&mesh, 1).await?;
    put_module(&mesh, "crashy", &sleeper(json!({"role": "solo"}), 1)).await?;
    let before = running(&mesh, "crashy", 1).await?;
    let (node, pid) = before[&0].clone();
    assert_eq!(node, a);
    let killed = std::process::Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()?;
    assert!(killed.success());
    let (new_pid, restarts) = wait_for("crashy to be restarted", WITHIN, || async {
        let r = active(&mesh, "crashy").await?;
        Ok(r.get(&0).and_then(|(_, s, p, restarts)| {
            (s.as_deref() == Some("running") && *restarts >= 1 && *p != Some(pid))
                .then(|| (p.unwrap_or(0), *restarts))
        }))
    })
    .await?;
    assert!(alive(new_pid));
    assert_eq!(restarts, 1);
    mesh.teardown().await
}
