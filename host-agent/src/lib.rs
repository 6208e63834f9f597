//! The mesh host agent: runs on every node, states what the node is and has
//! applied, and applies what the controller declares for it.
//!
//! What it does:
//! - publishes reports to the `reports` exchange: a `hello` with the host's facts
//!   on every connect, a `heartbeat` on an interval, an `applied` after every
//!   declaration; each carries `user_id` = the node's broker user and counts as
//!   sent only once the broker confirmed it (reports wait in a bounded buffer,
//!   across disconnects, until then);
//! - consumes its own queue `decl.<node>` and applies each declaration — a whole
//!   section at a generation — idempotently: validated first, files written
//!   atomically under its root, files the section no longer declares removed,
//!   stale generations ignored, the result kept in a local store;
//! - runs the units its inventory section declares as supervised child processes
//!   ([`units`]): restarted per policy with capped backoff, output captured to
//!   rotating files by a shim per unit, state stated in `units` reports; its
//!   own restart restarts no unit: it leaves them running when it stops, and
//!   adopts them when it starts, starting at once (without waiting for anyone)
//!   what its store says must run and does not;
//! - reconciles the resources of resource grants its provisioning section
//!   declares (a database, a vhost, a bucket on the provider modules' servers
//!   on this node) in a background worker ([`provision::worker`]), one pass
//!   at a time, through the servers' own CLIs, and states them in `resources`
//!   reports: when they change and after every connect; its restart creates
//!   nothing that exists (the store keeps what it found);
//! - runs each running unit's declared probes beside it ([`units::probes`]) and
//!   states every result, whole, in `health` reports: when a probe's state
//!   changes, and as a summary every `health_summary_secs`;
//! - keeps running when the broker or the controller is away, reconnecting with
//!   capped, jittered backoff, and keeps every unit running as last declared;
//!   the first hello after it reaches the broker again states the outage.
//!
//! What it never does:
//! - **It never touches a database.** It holds no database credential and this
//!   crate depends on no database driver (sqlx, tokio-postgres, refinery).
//! - **It never asks.** It states (reports) and is told (declarations); there is
//!   no request/response, no query of controller state.
//! - It never declares broker topology (exchanges, queues, bindings): the
//!   controller does; the agent's broker user may not.
//! - It never writes outside its root, nor into its own state directory.
//! - It never logs its broker password, nor a secret's value.
//! - Its seal key (`seal.key`, the X25519 key secrets are sealed to) never
//!   leaves the node: only its public key is stated, in every hello.
//! - Its WireGuard private key (`wireguard.key`, 0600) never leaves the node
//!   either, nor appears on a command line or in a log: hello states the
//!   public key, `wg` reads the private one from a 0600 file.
//! - Its restart tears down no working overlay interface: it re-adopts the
//!   interface (and wireguard-go) and the nftables table it left.
//!
//! Entry point: [`run`]. The `mesh-agent` binary is a thin wrapper around it.

/// The agent's version, as hello states it and the metrics label it.
pub const AGENT_VERSION: &str = env!("CARGO_PKG_VERSION");

mod agent;
pub mod apply;
pub mod artifacts;
pub mod broker;
pub mod buffer;
pub mod certs;
pub mod command;
pub mod config;
pub mod connectivity;
pub mod credentials;
pub mod duration;
pub mod facts;
pub mod firewall;
pub mod join;
pub mod logs;
pub mod metrics;
pub mod overlay;
pub mod plan;
pub mod provision;
pub mod store;
pub mod units;

use std::future::Future;

pub use agent::Backoff;
pub use config::{Config, ConfigError};
pub use credentials::{Credentials, CredentialsError, Secret};
pub use store::{Store, StoreError};

use tracing::{error, info};

/// Why the agent could not start. Once running it does not fail: it reconnects.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Credentials(#[from] CredentialsError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Connectivity(#[from] connectivity::ConnectivityError),
    #[error(transparent)]
    Certs(#[from] certs::CertError),
    #[error("the artifact cache: {0}")]
    Artifacts(String),
    #[error("root {path}: {error}")]
    Root {
        path: std::path::PathBuf,
        error: std::io::Error,
    },
    #[error("cannot serve metrics on {addr}: {error}")]
    Metrics {
        addr: std::net::SocketAddr,
        error: std::io::Error,
    },
}

/// Run the agent until `shutdown` resolves, then stop consuming, publish what
/// can be published within `config.shutdown_timeout`, and return.
///
/// Fails only at start: invalid config, missing or malformed credentials, an
/// unreadable store, a missing root, or a metrics address that cannot be bound.
pub async fn run(
    config: Config,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), AgentError> {
    config.validate()?;
    let creds = Credentials::load(&config.state_dir)?;
    let store = Store::open(&config.state_dir)?;
    let applier = open_applier(&config, &creds)?;
    let connectivity = open_connectivity(&config)?;
    let mut certs = certs::Certs::open(creds.node.clone(), &config.state_dir, &config.root)?;
    certs.set_modules(
        store
            .section(mesh_protocol::Section::Inventory)
            .units
            .iter()
            .map(|u| u.module.as_str()),
    );
    let metrics = metrics::Metrics::new();
    // The artifact cache trusts what the controller signed, and https
    // registries verified against the mesh CA alone.
    let artifacts = artifacts::Artifacts::new(
        &config.state_dir,
        config.artifacts.clone(),
        vec![creds.controller_key.clone()],
        creds.ca_certificate.as_deref(),
        metrics.clone(),
    )
    .map_err(AgentError::Artifacts)?;

    let (stop_metrics, metrics_task) = serve_metrics(&config, &metrics).await?;

    info!(
        node = %creds.node,
        broker = %creds.redacted_url(),
        root = %config.root.display(),
        state_dir = %config.state_dir.display(),
        version = facts::AGENT_VERSION,
        "mesh agent starting"
    );
    // Units run from the store at once (rule 8): no broker, no controller needed.
    // Started last, so that no start-up failure above leaves them orphaned.
    let mut supervisor = units::Supervisor::start(
        config.units.clone(),
        &config.root,
        &config.state_dir,
        metrics.clone(),
    )
    .await;
    supervisor.declare(&store.section(mesh_protocol::Section::Inventory).units);
    // The overlay and firewall as last declared, re-adopted (nothing that
    // matches is touched) or repaired, before the broker is reached.
    let _ = connectivity.check().await;
    let (changes_tx, changes) = tokio::sync::mpsc::channel(4);
    let checks = connectivity.spawn_checks(config.overlay.check_interval, changes_tx);
    let agent = agent::Agent::new(config, creds, store, applier, metrics, supervisor)
        .with_connectivity(connectivity, changes)
        .with_artifacts(artifacts)
        .with_certs(certs);
    let shutdown = std::pin::pin!(shutdown);
    agent.run(shutdown).await;
    checks.abort();

    let _ = stop_metrics.send(());
    if let Some(t) = metrics_task {
        let _ = t.await;
    }
    info!("mesh agent stopped");
    Ok(())
}

/// The applier of declarations under the root, with the node's seal key
/// (made now if the node had none) to open its secrets.
fn open_applier(config: &Config, creds: &Credentials) -> Result<apply::Applier, AgentError> {
    let (seal_key, made) = credentials::load_or_create_seal_key(&config.state_dir)?;
    if made {
        info!(
            path = %config.state_dir.join(credentials::SEAL_KEY_FILE).display(),
            seal_key = %seal_key.public().to_hex(),
            "made this node's seal key (it had none)"
        );
    }
    let applier = apply::Applier::new(&config.root, std::slice::from_ref(&config.state_dir))
        .map_err(|error| AgentError::Root {
            path: config.root.clone(),
            error,
        })?
        .with_seal_key(creds.node.clone(), seal_key)
        .with_module_owners(config.units.module_users && rustix::process::geteuid().is_root());
    Ok(applier)
}

/// The overlay and firewall, with the node's WireGuard key (made now if
/// the node had none).
fn open_connectivity(config: &Config) -> Result<connectivity::Shared, AgentError> {
    let (connectivity, made) = connectivity::Connectivity::open(config)?;
    if made && let Some(facts) = connectivity.facts() {
        info!(
            path = %config.state_dir.join(overlay::KEY_FILE).display(),
            public_key = %facts.public_key,
            "made this node's WireGuard key (it had none)"
        );
    }
    Ok(connectivity::Shared::new(connectivity))
}

/// Serve the metrics on `metrics_listen` (if set) until the returned sender
/// is used (or dropped).
async fn serve_metrics(
    config: &Config,
    metrics: &metrics::Metrics,
) -> Result<
    (
        tokio::sync::oneshot::Sender<()>,
        Option<tokio::task::JoinHandle<()>>,
    ),
    AgentError,
> {
    let (stop_metrics, metrics_stopped) = tokio::sync::oneshot::channel::<()>();
    let metrics_task = match config.metrics_listen {
        Some(addr) => {
            let listener = metrics::Metrics::bind(addr)
                .await
                .map_err(|error| AgentError::Metrics { addr, error })?;
            info!(addr = %listener.local_addr().unwrap_or(addr), "serving metrics");
            let m = metrics.clone();
            Some(tokio::spawn(async move {
                let stopped = async {
                    let _ = metrics_stopped.await;
                };
                if let Err(e) = m.serve(listener, stopped).await {
                    error!(error = %e, "metrics server failed");
                }
            }))
        }
        None => None,
    };
    Ok((stop_metrics, metrics_task))
}
