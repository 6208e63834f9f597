//! Broker endpoints (docs/decisions/0043): the broker the credentials name
//! does not answer (a port nobody listens on), and the controller (setting
//! `broker_endpoints`) and an agent (config `brokers`) reach the broker
//! through their alternate endpoint, with the same user, password and vhost;
//! a file declared then lands on the agent and is reported applied.

use std::time::Duration;

use anyhow::Context as _;
use mesh_e2e::{Mesh, wait_for};
use serde_json::json;

const WITHIN: Duration = Duration::from_secs(90);

/// A port on loopback nobody listens on (bound, then released).
fn dead_port() -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// `url` with its port replaced by `port`; also returns the old port.
fn with_port(url: &str, port: u16) -> anyhow::Result<(String, u16)> {
    let mut u = url::Url::parse(url).context("a broker URL of the test environment")?;
    let old = u.port().unwrap_or(5672);
    u.set_port(Some(port))
        .map_err(|()| anyhow::anyhow!("cannot set the port of a broker URL"))?;
    Ok((u.to_string(), old))
}

#[tokio::test(flavor = "multi_thread")]
async fn controller_and_agent_reach_the_broker_through_their_alternate_endpoint()
-> anyhow::Result<()> {
    let mut mesh = Mesh::prepare().await?;
    let dead = dead_port()?;

    // The controller's credentials name the dead port; its alternate is the
    // broker's real one.
    let mut creds = mesh.env.controller_credentials();
    let (url, live) = with_port(creds.broker_url.expose(), dead)?;
    creds.broker_url = mesh_credentials::Secret::new(url);
    creds.write(&mesh.dir.path().join("credentials.toml"))?;
    let toml_path = mesh.dir.path().join("controller.toml");
    let mut settings = std::fs::read_to_string(&toml_path)?;
    settings.push_str(&format!("broker_endpoints = [\"127.0.0.1:{live}\"]\n"));
    std::fs::write(&toml_path, settings)?;
    mesh.start_controller(&[]).await?;
    wait_for(
        "the controller's broker session through its alternate endpoint",
        WITHIN,
        || async {
            let log = mesh.controller_log();
            Ok(log
                .lines()
                .any(|l| {
                    l.contains("broker session started") && l.contains(&format!("127.0.0.1:{live}"))
                })
                .then_some(()))
        },
    )
    .await?;

    // The agent: enrolled, stopped, its credentials pointed at the dead port,
    // `brokers` naming the live one, started again.
    mesh.agent_toml = Some(format!("brokers = [\"127.0.0.1:{live}\"]\n"));
    let node = mesh.add_agent("alt", &[("role", "alt")]).await?;
    mesh.stop_agent(&node);
    let state_dir = mesh.agent(&node).state_dir.clone();
    let mut agent_creds = mesh.agent(&node).creds.agent_credentials()?;
    let (url, _) = with_port(agent_creds.broker_url.expose(), dead)?;
    agent_creds.broker_url = mesh_credentials::Secret::new(url);
    agent_creds.write(&state_dir)?;
    let log_before = mesh.log_of(&format!("agent-{node}")).len();
    mesh.start_agent(&node)?;
    let dead_text = format!("127.0.0.1:{dead}");
    let live_text = format!("127.0.0.1:{live}");
    wait_for(
        "the agent to fail on the dead endpoint and connect through the live one",
        WITHIN,
        || async {
            let log = mesh.log_of(&format!("agent-{node}"));
            let log = log.get(log_before..).unwrap_or_default();
            let failed = log
                .lines()
                .any(|l| l.contains("cannot connect to the broker") && l.contains(&dead_text));
            let connected = log
                .lines()
                .any(|l| l.contains("connected to the broker") && l.contains(&live_text));
            Ok((failed && connected).then_some(()))
        },
    )
    .await?;
    let password = mesh.agent(&node).creds.password.clone();
    assert!(
        !mesh.log_of(&format!("agent-{node}")).contains(&password),
        "the agent's log holds its broker password"
    );

    // A file declared now lands on the agent and is reported applied.
    let (status, body) = mesh
        .put(
            "/v1/files/alt",
            &json!({"path": "/etc/alt", "content": "through the alternate\n", "mode": "0644", "selector": {"role": "alt"}}),
        )
        .await?;
    assert!(status == 200 || status == 201, "{status} {body}");
    let path = mesh.agent(&node).file("/etc/alt");
    wait_for("the file on the agent", WITHIN, || {
        let path = path.clone();
        async move {
            Ok(
                (std::fs::read_to_string(&path).ok().as_deref() == Some("through the alternate\n"))
                    .then_some(()),
            )
        }
    })
    .await?;
    wait_for("the node to report the file applied", WITHIN, || async {
        let (status, view) = mesh.get(&format!("/v1/nodes/{node}")).await?;
        anyhow::ensure!(status == 200, "GET node: {status} {view}");
        let config = &view["sections"]["config"];
        Ok((config["declared"] == json!(1) && config["applied"] == json!(1)).then_some(()))
    })
    .await?;
    mesh.teardown().await
}
