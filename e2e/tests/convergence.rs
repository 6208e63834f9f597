//! The whole loop: agents join, a file declared for a label selector reaches
//! exactly the matching nodes, and every change converges — including to a node
//! that was down while it happened.

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use mesh_e2e::{Mesh, wait_for};
use serde_json::json;

const WITHIN: Duration = Duration::from_secs(30);

/// Wait until the file under `node`'s root has `content` and `mode`.
async fn file_is(
    mesh: &Mesh,
    node: &str,
    path: &str,
    content: &str,
    mode: u32,
) -> anyhow::Result<()> {
    let p = mesh.agent(node).file(path);
    wait_for(
        &format!("{path} on {node} to read {content:?} with mode {mode:o}"),
        WITHIN,
        || {
            let p = p.clone();
            async move {
                let Ok(meta) = std::fs::metadata(&p) else {
                    return Ok(None);
                };
                let text = std::fs::read_to_string(&p)?;
                Ok((text == content && meta.permissions().mode() & 0o7777 == mode).then_some(()))
            }
        },
    )
    .await
}

async fn file_absent(mesh: &Mesh, node: &str, path: &str) -> anyhow::Result<()> {
    let p = mesh.agent(node).file(path);
    wait_for(&format!("{path} to be gone from {node}"), WITHIN, || {
        let gone = !p.exists();
        async move { Ok(gone.then_some(())) }
    })
    .await
}

/// Wait until the node view shows the config section applied == declared == `generation`.
async fn applied_generation(mesh: &Mesh, node: &str, generation: u64) -> anyhow::Result<()> {
    wait_for(
        &format!("{node} to apply config generation {generation}"),
        WITHIN,
        || async {
            let (status, view) = mesh.get(&format!("/v1/nodes/{node}")).await?;
            anyhow::ensure!(status == 200, "GET node: {status} {view}");
            let config = &view["sections"]["config"];
            Ok(
                (config["declared"] == json!(generation) && config["applied"] == json!(generation))
                    .then_some(()),
            )
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn files_converge_on_exactly_the_matching_nodes() -> anyhow::Result<()> {
    let mut mesh = Mesh::start().await?;
    let web1 = mesh.add_agent("web-1", &[("role", "web")]).await?;
    let web2 = mesh.add_agent("web-2", &[("role", "web")]).await?;
    let db1 = mesh.add_agent("db-1", &[("role", "db")]).await?;

    // Three agents join and show as alive with their facts.
    wait_for("three alive nodes with facts", WITHIN, || async {
        let (_, nodes) = mesh.get("/v1/nodes").await?;
        let nodes = nodes["nodes"].as_array().cloned().unwrap_or_default();
        let ready = nodes.len() == 3
            && nodes.iter().all(|n| {
                n["state"] == "alive" && n["hostname"].as_str().is_some_and(|h| !h.is_empty())
            });
        Ok(ready.then_some(()))
    })
    .await?;
    let (status, view) = mesh.get(&format!("/v1/nodes/{web1}")).await?;
    assert_eq!(status, 200, "{view}");
    assert_eq!(view["labels"]["effective"]["role"], "web", "{view}");
    assert!(view["cpus"].as_u64().unwrap_or(0) >= 1, "{view}");

    // A file for role=web lands on exactly the two web nodes, with its mode.
    let (status, body) = mesh
        .put("/v1/files/motd", &json!({"path": "/etc/motd", "content": "hello web\n", "mode": "0640", "selector": {"role": "web"}}))
        .await?;
    assert!(status == 200 || status == 201, "{status} {body}");
    file_is(&mesh, &web1, "/etc/motd", "hello web\n", 0o640).await?;
    file_is(&mesh, &web2, "/etc/motd", "hello web\n", 0o640).await?;
    applied_generation(&mesh, &web1, 1).await?;
    applied_generation(&mesh, &web2, 1).await?;
    let (_, db_view) = mesh.get(&format!("/v1/nodes/{db1}")).await?;
    assert!(
        db_view["sections"]["config"]["declared"].is_null(),
        "db-1 got a config section: {db_view}"
    );
    assert!(!mesh.agent(&db1).file("/etc/motd").exists());

    // A node labelled later receives it.
    let (status, _, body) = mesh
        .request(
            reqwest::Method::PUT,
            &format!("/v1/nodes/{db1}/labels"),
            &[("if-match", "*")],
            Some(&json!({"labels": {"role": "web"}})),
        )
        .await?;
    assert_eq!(status, 200, "{body}");
    file_is(&mesh, &db1, "/etc/motd", "hello web\n", 0o640).await?;
    applied_generation(&mesh, &db1, 1).await?;

    // Changing the file converges everywhere.
    let (status, body) = mesh
        .put("/v1/files/motd", &json!({"path": "/etc/motd", "content": "changed\n", "mode": "0600", "selector": {"role": "web"}}))
        .await?;
    assert_eq!(status, 200, "{body}");
    for node in [&web1, &web2, &db1] {
        file_is(&mesh, node, "/etc/motd", "changed\n", 0o600).await?;
        applied_generation(&mesh, node, 2).await?;
    }

    // Deleting it removes it everywhere.
    assert_eq!(mesh.delete("/v1/files/motd").await?, 204);
    for node in [&web1, &web2, &db1] {
        file_absent(&mesh, node, "/etc/motd").await?;
        applied_generation(&mesh, node, 3).await?;
    }
    mesh.teardown().await
}

#[tokio::test(flavor = "multi_thread")]
async fn an_agent_down_during_a_change_converges_when_it_returns() -> anyhow::Result<()> {
    let mut mesh = Mesh::start().await?;
    let node = mesh.add_agent("solo", &[("role", "web")]).await?;
    mesh.put(
        "/v1/files/app",
        &json!({"path": "/srv/app.conf", "content": "v1", "mode": "0644", "node": node}),
    )
    .await?;
    file_is(&mesh, &node, "/srv/app.conf", "v1", 0o644).await?;

    mesh.stop_agent(&node);
    let (status, body) = mesh
        .put(
            "/v1/files/app",
            &json!({"path": "/srv/app.conf", "content": "v2", "mode": "0644", "node": node}),
        )
        .await?;
    assert_eq!(status, 200, "{body}");
    // Nothing applies it while the agent is down.
    assert_eq!(
        std::fs::read_to_string(mesh.agent(&node).file("/srv/app.conf"))?,
        "v1"
    );

    mesh.start_agent(&node)?;
    file_is(&mesh, &node, "/srv/app.conf", "v2", 0o644).await?;
    applied_generation(&mesh, &node, 2).await?;
    mesh.teardown().await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_declaration_lost_on_the_way_is_resent_from_the_hello() -> anyhow::Result<()> {
    let mut mesh = Mesh::start().await?;
    let node = mesh.add_agent("lossy", &[]).await?;
    mesh.put(
        "/v1/files/a",
        &json!({"path": "/a", "content": "one", "mode": "0644", "node": node}),
    )
    .await?;
    file_is(&mesh, &node, "/a", "one", 0o644).await?;

    // The agent is away, a change is declared, and its declaration is lost
    // (purged from the node's queue) before the agent comes back.
    mesh.stop_agent(&node);
    mesh.put(
        "/v1/files/a",
        &json!({"path": "/a", "content": "two", "mode": "0644", "node": node}),
    )
    .await?;
    let conn =
        lapin::Connection::connect(&mesh.env.controller_amqp_url(), Default::default()).await?;
    let ch = conn.create_channel().await?;
    let queue = format!("decl.{node}");
    wait_for("the declaration to be queued", WITHIN, || async {
        let q = ch
            .queue_declare(
                queue.as_str().into(),
                lapin::options::QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                Default::default(),
            )
            .await?;
        Ok((q.message_count() > 0).then_some(()))
    })
    .await?;
    ch.queue_purge(queue.as_str().into(), Default::default())
        .await?;

    mesh.start_agent(&node)?;
    file_is(&mesh, &node, "/a", "two", 0o644).await?;
    mesh.teardown().await
}

/// The periodic resync (`resync_interval_secs`) repairs a config section that
/// was changed, then lost, behind the controller's back; the catch-up lifts the
/// re-created section above the generation the node already holds.
#[tokio::test(flavor = "multi_thread")]
async fn resync_repairs_a_section_changed_or_lost_behind_the_controllers_back() -> anyhow::Result<()>
{
    let mut mesh = Mesh::start().await?;
    // The same controller, resyncing every second.
    mesh.kill_controller();
    let settings = mesh.dir.path().join("controller.toml");
    let mut text = std::fs::read_to_string(&settings)?;
    text.push_str("resync_interval_secs = 1\n");
    std::fs::write(&settings, text)?;
    mesh.start_controller(&[]).await?;
    let web = mesh.add_agent("web-1", &[("role", "web")]).await?;
    let (status, body) = mesh
        .put("/v1/files/motd", &json!({"path": "/etc/motd", "content": "kept\n", "mode": "0644", "selector": {"role": "web"}}))
        .await?;
    assert!(status == 200 || status == 201, "{status} {body}");
    file_is(&mesh, &web, "/etc/motd", "kept\n", 0o644).await?;
    applied_generation(&mesh, &web, 1).await?;

    let pool = sqlx::PgPool::connect(&mesh.env.database_url("config")).await?;
    // The stored section says something else: resync declares what the files
    // say now, as generation 2.
    sqlx::query(
        "UPDATE config.sections SET digest = 'tampered', items = '{\"files\": []}' WHERE node = $1",
    )
    .bind(&web)
    .execute(&pool)
    .await?;
    applied_generation(&mesh, &web, 2).await?;
    file_is(&mesh, &web, "/etc/motd", "kept\n", 0o644).await?;

    // The row is lost: resync declares generation 1, which the agent (at 2)
    // ignores; its next heartbeat shows it ahead, and it is lifted to 3.
    sqlx::query("DELETE FROM config.sections WHERE node = $1")
        .bind(&web)
        .execute(&pool)
        .await?;
    applied_generation(&mesh, &web, 3).await?;
    file_is(&mesh, &web, "/etc/motd", "kept\n", 0o644).await?;
    pool.close().await;
    mesh.teardown().await
}
