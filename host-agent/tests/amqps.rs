//! The agent's broker connection over AMQPS, against the real broker's TLS
//! listener (bundle/up configures it with a certificate from the bundle's
//! CA): it connects when it verifies the broker against that CA, and refuses,
//! with an error that says so, a broker whose certificate is not signed by the
//! CA it holds, or does not name the host it dialled. Nothing is sent before
//! the handshake verified, so the node's password never reaches such a broker.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::time::Duration;

use lapin::ConnectionProperties;
use mesh_credentials::AgentCredentials;
use mesh_host_agent::broker::{self, BrokerError};
use mesh_protocol::{PublicKey, Secret};
use mesh_testkit::{TestEnv, bundle_tls};

const DEADLINE: Duration = Duration::from_secs(20);

/// The node's credentials pointing at `amqps://<host>:<port>` with `ca`.
fn amqps(
    node: &mesh_testkit::NodeCredentials,
    host: &str,
    port: u16,
    ca: &str,
) -> AgentCredentials {
    let mut url = url::Url::parse(&node.broker_url).expect("the test kit's URL");
    url.set_scheme("amqps").expect("amqps is a scheme");
    url.set_host(Some(host)).expect("a host");
    url.set_port(Some(port)).expect("a port");
    AgentCredentials {
        node: node.node.clone(),
        broker_url: Secret::new(url.to_string()),
        controller_key: PublicKey::from_hex(&node.controller_key).expect("hex key"),
        ca_certificate: Some(ca.to_owned()),
        api_url: None,
    }
}

async fn connect(creds: &AgentCredentials) -> Result<lapin::Connection, BrokerError> {
    tokio::time::timeout(
        DEADLINE,
        broker::connect(
            creds,
            None,
            Duration::from_secs(10),
            DEADLINE,
            ConnectionProperties::default(),
        ),
    )
    .await
    .expect("the connection attempt ends within the deadline")
}

#[tokio::test]
async fn the_agent_verifies_the_broker_against_the_mesh_ca() -> anyhow::Result<()> {
    let tls = bundle_tls()?;
    let env = TestEnv::new().await?;
    let node = env.add_node("tls").await?;
    let ca = tls.ca_pem()?;

    // The bundle's CA: the handshake verifies, the node logs in as itself.
    let ok = amqps(&node, "127.0.0.1", tls.amqps_port, &ca);
    let conn = connect(&ok).await?;
    let ch = conn.create_channel().await?;
    ch.close(200, "ok".into()).await?;
    conn.close(200, "ok".into()).await?;

    // The same broker through the address it advertises (its certificate names it).
    let advertised = amqps(&node, &tls.advertise_host, tls.amqps_port, &ca);
    connect(&advertised).await?.close(200, "ok".into()).await?;

    // Another CA: the broker's certificate is not its, so it is refused.
    let other = mesh_credentials::pki::MeshCa::generate("another CA")?;
    let wrong = amqps(&node, "127.0.0.1", tls.amqps_port, other.certificate_pem());
    let err = connect(&wrong)
        .await
        .expect_err("a broker not signed by the CA");
    let text = err.to_string();
    assert!(matches!(err, BrokerError::Untrusted { .. }), "{text}");
    assert!(
        text.contains("does not verify against the mesh CA") && text.contains("UnknownIssuer"),
        "{text}"
    );
    assert!(!text.contains(&node.password), "{text}");

    // The right CA but a host the certificate does not name: refused too.
    let unnamed = amqps(&node, "127.0.0.2", tls.amqps_port, &ca);
    let err = connect(&unnamed)
        .await
        .expect_err("a name the certificate lacks");
    assert!(
        matches!(err, BrokerError::Untrusted { .. })
            && err.to_string().contains("not valid for name"),
        "{err}"
    );

    env.teardown().await?;
    Ok(())
}
