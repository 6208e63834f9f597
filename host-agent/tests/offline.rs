//! The agent without a broker: start-up errors are clear, and with the broker
//! unreachable it keeps running and stops promptly when told to.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::time::Duration;

use mesh_host_agent::{AgentError, Config};

fn config(state: &std::path::Path, root: &std::path::Path) -> Config {
    Config {
        state_dir: state.to_owned(),
        root: root.to_owned(),
        heartbeat_interval: Duration::from_millis(20),
        reconnect_min: Duration::from_millis(20),
        reconnect_max: Duration::from_millis(100),
        shutdown_timeout: Duration::from_millis(200),
        ..Config::default()
    }
}

#[tokio::test]
async fn missing_or_malformed_credentials_refuse_to_start() {
    let state = tempfile::tempdir().unwrap();
    let root = mesh_testkit::units_tempdir().unwrap();
    let err = mesh_host_agent::run(config(state.path(), root.path()), async {})
        .await
        .unwrap_err();
    assert!(matches!(err, AgentError::Credentials(_)), "{err}");
    assert!(err.to_string().contains("credentials.toml"), "{err}");

    std::fs::write(state.path().join("credentials.toml"), "node = \"node-a\"\n").unwrap();
    let err = mesh_host_agent::run(config(state.path(), root.path()), async {})
        .await
        .unwrap_err();
    assert!(err.to_string().contains("`broker_url`"), "{err}");
}

#[tokio::test]
async fn keeps_running_without_a_broker_and_stops_when_told() {
    let state = tempfile::tempdir().unwrap();
    let root = mesh_testkit::units_tempdir().unwrap();
    // Nothing listens on port 1.
    std::fs::write(
        state.path().join("credentials.toml"),
        format!(
            "node = \"node-a\"\nbroker_url = \"amqp://node-a:pw@127.0.0.1:1/mesh\"\ncontroller_key = \"{}\"\n",
            mesh_protocol::DeclarationSigner::from_seed([1; 32]).public_key_hex()
        ),
    )
    .unwrap();
    let started = tokio::time::Instant::now();
    let run = mesh_host_agent::run(
        config(state.path(), root.path()),
        tokio::time::sleep(Duration::from_millis(500)),
    );
    tokio::time::timeout(Duration::from_secs(10), run)
        .await
        .expect("stops promptly")
        .unwrap();
    assert!(started.elapsed() >= Duration::from_millis(500));
    // Heartbeats are never buffered while disconnected (decision 0023): twenty
    // five ticks passed and none was built, so no sequence number was reserved.
    let store = mesh_host_agent::Store::open(state.path()).unwrap();
    assert_eq!(store.data().seq_reserved, 0);
}
