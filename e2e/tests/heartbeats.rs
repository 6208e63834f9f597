//! Heartbeats as a lease (decision 0023), end to end with real agents: past
//! the fleet's heartbeat budget every agent is told a longer interval, beats at
//! it (its heartbeats say so), keeps it across a restart, and the API states
//! the detection time; a heartbeat in step with its node is written from
//! memory within the liveness write interval.

use std::time::Duration;

use mesh_e2e::sim::{scalar, wait_scalar};
use mesh_e2e::{Mesh, wait_for};

#[tokio::test(flavor = "multi_thread")]
async fn past_the_budget_agents_beat_at_the_declared_interval_and_keep_it() -> anyhow::Result<()> {
    let mut mesh = Mesh::prepare().await?;
    // Floor 1 s (grace 3 s) and a budget of 0.6 heartbeats/s: two nodes need
    // 3.3 s, the rung 1 s × 1.5³ = 3.375 s rounded up to 4 s, grace 12 s.
    let path = mesh.dir.path().join("controller.toml");
    let toml = std::fs::read_to_string(&path)? + "heartbeat_budget_per_sec = 0.6\n";
    std::fs::write(&path, toml)?;
    mesh.start_controller(&[]).await?;
    let a = mesh.add_agent("a", &[]).await?;
    let b = mesh.add_agent("b", &[]).await?;
    let view = wait_for(
        "the fleet's interval to stretch to 4 s",
        Duration::from_secs(30),
        || async {
            let (status, body) = mesh.get("/v1/nodes").await?;
            anyhow::ensure!(status == 200, "GET /v1/nodes: {status} {body}");
            Ok((body["heartbeat"]["interval_ms"] == 4000).then_some(body))
        },
    )
    .await?;
    assert_eq!(view["heartbeat"]["grace_ms"], 12_000);
    assert_eq!(view["heartbeat"]["floor_ms"], 1000);
    assert_eq!(view["heartbeat"]["nodes"], 2);
    // Each agent applied its inventory section's plan and says it beats at 4 s.
    wait_scalar(
        &mesh.env,
        "both agents to beat at 4 s",
        "inventory",
        "SELECT count(*) FROM inventory.nodes WHERE beat_ms = 4000",
        2,
        Duration::from_secs(30),
    )
    .await?;
    for node in [&a, &b] {
        let plan = std::fs::read_to_string(mesh.agent(node).state_dir.join("heartbeat-plan.json"))?;
        let plan: serde_json::Value = serde_json::from_str(&plan)?;
        assert_eq!(plan["interval_ms"], 4000, "{node}: {plan}");
    }
    // Liveness is written from memory: last_seen follows the heartbeats
    // within the write interval (250 ms here) plus the interval.
    let before: i64 = scalar(
        &mesh.env,
        "inventory",
        &format!("SELECT last_seq FROM inventory.nodes WHERE id = '{a}'"),
    )
    .await?;
    wait_for(
        "a's next heartbeat written",
        Duration::from_secs(15),
        || async {
            let now: i64 = scalar(
                &mesh.env,
                "inventory",
                &format!("SELECT last_seq FROM inventory.nodes WHERE id = '{a}'"),
            )
            .await?;
            Ok((now > before).then_some(()))
        },
    )
    .await?;
    // A restarted agent beats at the kept plan from its first heartbeat: the
    // node is not judged unreachable meanwhile.
    mesh.stop_agent(&a);
    mesh.start_agent(&a)?;
    let log = mesh.dir.path().join(format!("agent-{a}.log"));
    wait_for(
        "the restarted agent to beat at the declared interval",
        Duration::from_secs(30),
        || async {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            Ok(text
                .matches("beating at the interval the controller declared")
                .next()
                .map(|_| ()))
        },
    )
    .await?;
    let unreachable = scalar(
        &mesh.env,
        "inventory",
        "SELECT count(*) FROM inventory.nodes WHERE state <> 'alive'",
    )
    .await?;
    assert_eq!(unreachable, 0);
    mesh.teardown().await
}
