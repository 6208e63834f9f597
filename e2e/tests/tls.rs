//! TLS on every wire, with a second host for real (issue 12).
//!
//! The test makes a network namespace with its own veth address (a second
//! host on this machine; its traffic reaches only this machine's addresses),
//! starts a controller that advertises this host's address (the bundle's: the
//! broker's one TLS listener has a certificate for it, from the bundle's CA,
//! which the controller also issues its HTTPS certificate from), and then:
//!
//! - `meshctl` over HTTPS, verified against the mesh CA, prints the join
//!   command (the advertised `https://` API and the CA's hash);
//! - that command with another CA's hash is refused by the agent before the
//!   token is sent (the same token then still joins: it was never used);
//! - the printed command, run inside the namespace, joins over HTTPS: the node
//!   is handed the advertised AMQPS endpoint, never loopback, and keeps the CA;
//! - the agent, run inside the namespace, connects over AMQPS to the advertised
//!   address (the broker's plain listener is on loopback only, out of its
//!   reach), receives a declaration and applies it under its root.
//!
//! Needs root, iproute2 and `bundle/up` having run (CI runs it first).

use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context as _, anyhow};
use mesh_credentials::AgentCredentials;
use mesh_e2e::netns::Netns;
use mesh_e2e::{Mesh, Proc, bin, wait_for};
use serde_json::json;

const DEADLINE: Duration = Duration::from_secs(60);

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("0.0.0.0:0")?
        .local_addr()?
        .port())
}

/// The words of a printed `mesh-agent join …` command, `mesh-agent` itself
/// replaced by the binary under test and the state dir appended.
fn join_args(command: &str, state_dir: &std::path::Path) -> anyhow::Result<Vec<String>> {
    let mut words = command.split_whitespace().map(str::to_owned);
    anyhow::ensure!(
        words.next().as_deref() == Some("mesh-agent"),
        "not a mesh-agent command: {command}"
    );
    let mut args: Vec<String> = words.collect();
    args.push("--state-dir".into());
    args.push(state_dir.display().to_string());
    Ok(args)
}

#[tokio::test]
async fn a_second_host_joins_over_https_and_applies_a_declaration_over_amqps() -> anyhow::Result<()>
{
    let tls = mesh_testkit::bundle_tls()?;
    anyhow::ensure!(
        !mesh_credentials::advertise::is_loopback_host(&tls.advertise_host),
        "bundle/up advertises {} (loopback): a second host cannot reach it; run bundle/up on a machine with a routable address or set MESH_ADVERTISE",
        tls.advertise_host
    );
    let ca = tls.ca()?;

    // A controller advertising this host's address, with the bundle's CA.
    let mut mesh = Mesh::prepare().await?;
    let https_port = free_port()?;
    let api = format!("https://{}:{https_port}", tls.advertise_host);
    let creds_path = mesh.dir.path().join("credentials.toml");
    let mut creds = mesh.env.controller_credentials();
    creds.ca_certificate_file = Some(tls.ca_certificate_file.clone());
    creds.ca_key_file = Some(tls.ca_key_file.clone());
    creds.write(&creds_path)?;
    let toml_path = mesh.dir.path().join("controller.toml");
    let mut toml = std::fs::read_to_string(&toml_path)?;
    toml.push_str(&format!(
        "advertise_api = \"{api}\"\nadvertise_broker = \"{}:{}\"\napi_listen_tls = \"0.0.0.0:{https_port}\"\n",
        tls.advertise_host, tls.amqps_port
    ));
    std::fs::write(&toml_path, toml)?;
    mesh.start_controller(&[]).await?;

    let host = Netns::create()?;
    let node = format!("{}-far", mesh.env.id());

    // meshctl over HTTPS (the mesh CA verifies the controller) prints the join command.
    let out = std::process::Command::new(bin("meshctl")?)
        .args(["--api", &api, "--ca"])
        .arg(&tls.ca_certificate_file)
        .args(["node", "add", &node, "--join-command"])
        .env("MESH_TOKEN", mesh.admin_token())
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "meshctl node add: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let command = String::from_utf8(out.stdout)?.trim().to_owned();
    assert!(
        command.starts_with(&format!(
            "mesh-agent join --api {api} --ca-hash {} --node {node} --token ",
            ca.pin()
        )),
        "{command}"
    );

    // The same command with another CA's hash: refused before the token is sent.
    let state_dir = mesh.dir.path().join("far/state");
    let root = mesh.dir.path().join("far/root");
    std::fs::create_dir_all(&root)?;
    let other = mesh_credentials::pki::MeshCa::generate("not the mesh's CA")?;
    let wrong = command.replace(&ca.pin(), &other.pin());
    let out = host
        .tokio_command(&bin("mesh-agent")?)
        .args(join_args(&wrong, &state_dir)?)
        .stdin(Stdio::null())
        .output()
        .await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a wrong CA hash joined: {stderr}");
    assert!(
        stderr.contains("is not the mesh the join command names")
            && stderr.contains("The join token was not sent")
            && stderr.contains(&other.pin()),
        "{stderr}"
    );
    assert!(!AgentCredentials::path_in(&state_dir).exists());
    // The controller holds the token unused.
    let identity = sqlx::PgPool::connect(&mesh.env.database_url("identity")).await?;
    let unused: bool =
        sqlx::query_scalar("SELECT used_at IS NULL FROM identity.join_tokens WHERE node = $1")
            .bind(&node)
            .fetch_one(&identity)
            .await?;
    assert!(unused, "the refused join used the token");

    // The printed command, inside the second host: joins over HTTPS with the
    // same token, which the refused attempt never used.
    let out = host
        .tokio_command(&bin("mesh-agent")?)
        .args(join_args(&command, &state_dir)?)
        .env("RUST_LOG", "debug")
        .stdin(Stdio::null())
        .output()
        .await?;
    anyhow::ensure!(
        out.status.success(),
        "the printed join command failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let joined = AgentCredentials::load(&state_dir)?;
    let token = command.rsplit(' ').next().unwrap_or_default();
    let password = joined.password().context("a broker password")?;
    for printed in [&out.stdout, &out.stderr] {
        let printed = String::from_utf8_lossy(printed);
        assert!(
            !printed.contains(token) && !printed.contains(password.expose().as_str()),
            "the join printed a secret at debug level: {printed}"
        );
    }
    let url = url::Url::parse(joined.broker_url.expose())?;
    assert_eq!(url.scheme(), "amqps");
    assert_eq!(
        url.host_str(),
        Some(tls.advertise_host.as_str()),
        "never loopback"
    );
    assert_eq!(url.port(), Some(tls.amqps_port));
    assert_eq!(joined.api_url.as_deref(), Some(api.as_str()));
    let used: bool =
        sqlx::query_scalar("SELECT used_at IS NOT NULL FROM identity.join_tokens WHERE node = $1")
            .bind(&node)
            .fetch_one(&identity)
            .await?;
    assert!(used, "the join used the token");
    identity.close().await;
    let kept = joined
        .ca_certificate
        .as_deref()
        .context("the node keeps the CA")?;
    assert_eq!(mesh_credentials::pki::pin_of(kept)?, ca.pin());

    // The agent on the second host: AMQPS to the advertised address.
    let _agent = Proc::spawn(
        host.command(&bin("mesh-agent")?)
            .arg("run")
            .arg("--state-dir")
            .arg(&state_dir)
            .arg("--root")
            .arg(&root)
            .args(["--heartbeat-interval", "1"])
            .env("RUST_LOG", "info,mesh_host_agent=debug")
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(
                mesh.dir.path().join("agent-far.log"),
            )?)
            .stderr(std::fs::File::create(
                mesh.dir.path().join("agent-far.err.log"),
            )?),
    )?;
    let (status, body) = mesh
        .put(
            "/v1/files/over-tls",
            &json!({"path": "/etc/over-tls", "content": "applied over AMQPS\n", "mode": "0644", "node": node}),
        )
        .await?;
    anyhow::ensure!(
        status == 200 || status == 201,
        "PUT /v1/files/over-tls: {status} {body}"
    );
    let file = root.join("etc/over-tls");
    wait_for("the declared file on the second host", DEADLINE, || {
        let file = file.clone();
        async move {
            Ok(std::fs::read_to_string(&file)
                .ok()
                .filter(|c| c == "applied over AMQPS\n"))
        }
    })
    .await
    .map_err(|e| {
        anyhow!(
            "{e}\n--- agent log ---\n{}{}",
            mesh.log_of("agent-far"),
            mesh.log_of("agent-far.err")
        )
    })?;

    let agent_log = mesh.log_of("agent-far") + &mesh.log_of("agent-far.err");
    assert!(
        !agent_log.contains(password.expose().as_str()),
        "the agent logged its password"
    );

    // The broker saw the node over TLS, from the second host's address.
    let admin = mesh.env.admin_credentials();
    let http = reqwest::Client::new();
    let conns: serde_json::Value = wait_for("the node's broker connection", DEADLINE, || {
        let req = http
            .get(format!("{}/api/connections", admin.rabbitmq_api))
            .basic_auth(&admin.rabbitmq_user, Some(admin.rabbitmq_password.expose()));
        let node = node.clone();
        async move {
            let v: serde_json::Value = req.send().await?.json().await?;
            Ok(v.as_array()
                .and_then(|a| a.iter().find(|c| c["user"] == node.as_str()).cloned()))
        }
    })
    .await?;
    assert_eq!(conns["ssl"], true, "{conns}");
    assert_eq!(conns["peer_host"], host.addr.as_str(), "{conns}");
    assert_eq!(conns["port"], tls.amqps_port, "{conns}");
    Ok(())
}
