//! `mesh-agent`: the host agent binary. All behaviour lives in the library.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use mesh_host_agent::{Config, config::parse_duration};
use tracing_subscriber::EnvFilter;

#[derive(Parser)]
#[command(
    name = "mesh-agent",
    version,
    about = "The mesh host agent: states reports, applies declarations."
)]
struct Cli {
    /// Log format. The level comes from RUST_LOG (default `info`).
    #[arg(long, value_enum, default_value_t = LogFormat::Pretty, env = "MESH_LOG_FORMAT", global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Pretty,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Run the agent until SIGTERM or SIGINT.
    Run(RunArgs),
    /// Enrol this node with a join token and the mesh CA's hash (the command
    /// `meshctl node add <id>` prints): make the node's key pair, get its broker
    /// credentials over HTTPS pinned to the CA, write credentials.toml.
    Join(JoinArgs),
    /// Stop every unit this node runs (SIGTERM to each unit's process group,
    /// SIGKILL after the stop timeout) and exit: decommissioning. The agent
    /// leaves its units running when it stops; stop the agent first, or it
    /// restarts what its store declares.
    DrainLocal(DrainArgs),
    /// A unit's shim: started by the agent, one per running unit.
    #[command(hide = true)]
    UnitShim,
}

#[derive(clap::Args)]
struct DrainArgs {
    /// Config file (TOML): its state_dir and units.stop_timeout are used.
    #[arg(long)]
    config: Option<PathBuf>,
    /// State directory. Default /var/lib/mesh-agent.
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// SIGKILL a unit this long after its SIGTERM. Default 10s.
    #[arg(long, value_parser = parse_duration)]
    stop_timeout: Option<std::time::Duration>,
}

async fn drain_local(args: DrainArgs) -> anyhow::Result<()> {
    let mut config = match &args.config {
        Some(path) => Config::load(path)?,
        None => Config::default(),
    };
    if let Some(v) = args.state_dir {
        config.state_dir = v;
    }
    if let Some(v) = args.stop_timeout {
        config.units.stop_timeout = v;
    }
    let units_dir = config.state_dir.join(mesh_host_agent::units::UNITS_DIR);
    let stopped = mesh_host_agent::units::drain_local(&units_dir, config.units.stop_timeout).await;
    println!("stopped {} unit(s): {}", stopped.len(), stopped.join(" "));
    Ok(())
}

#[derive(clap::Args)]
struct JoinArgs {
    /// The controller's API, e.g. https://10.0.0.1:7443 (plain http:// only
    /// for a loopback API).
    #[arg(long, env = "MESH_API")]
    api: String,
    /// The mesh CA's public key hash, sha256:<64 hex digits> (as kubeadm's
    /// --discovery-token-ca-cert-hash): the join refuses a controller whose
    /// certificate chain has no CA with this key, before it sends the token.
    /// Required with an https:// API.
    #[arg(long, env = "MESH_CA_HASH")]
    ca_hash: Option<String>,
    /// The join token (single use). Prefer the environment variable: a flag is
    /// visible in the process list.
    #[arg(long, env = "MESH_JOIN_TOKEN", hide_env_values = true)]
    token: String,
    /// This node's id (the one the token was made for). Default: the hostname.
    #[arg(long)]
    node: Option<String>,
    /// State directory. Default /var/lib/mesh-agent.
    #[arg(long, default_value = "/var/lib/mesh-agent")]
    state_dir: PathBuf,
}

async fn join(args: JoinArgs) -> anyhow::Result<()> {
    let node = match args.node {
        Some(n) => n,
        None => std::fs::read_to_string("/proc/sys/kernel/hostname")
            .context("reading the hostname (pass --node)")?
            .trim()
            .to_ascii_lowercase(),
    };
    let node = mesh_host_agent::credentials::NodeId::parse(&node)
        .with_context(|| format!("node id `{node}`"))?;
    let token = mesh_host_agent::Secret::new(args.token);
    let joined = mesh_host_agent::join::join(
        &args.api,
        &token,
        args.ca_hash.as_deref(),
        &node,
        &args.state_dir,
    )
    .await?;
    tracing::info!(
        node = %joined.node,
        credentials = %joined.credentials.display(),
        public_key = %joined.public_key,
        broker = %joined.broker,
        "joined; start the agent with `mesh-agent run`"
    );
    println!(
        "joined as {}; credentials in {}",
        joined.node,
        joined.credentials.display()
    );
    Ok(())
}

#[derive(clap::Args)]
struct RunArgs {
    /// Config file (TOML). Every field is optional; flags below override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// State directory (credentials.toml, store.json). Default /var/lib/mesh-agent.
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Directory declared paths are applied under. Default /.
    #[arg(long)]
    root: Option<PathBuf>,
    /// A label `key=value` (repeatable); added to (and overriding) the config's labels.
    #[arg(long = "label", value_parser = parse_label)]
    labels: Vec<(String, String)>,
    /// Heartbeat interval: seconds, or with a unit (500ms, 10s, 1m). Default 10s.
    #[arg(long, value_parser = parse_duration)]
    heartbeat_interval: Option<std::time::Duration>,
    /// Serve Prometheus metrics on this address (GET /metrics). Default: off.
    #[arg(long)]
    metrics_listen: Option<SocketAddr>,
    /// Report this hostname instead of the kernel's (tests).
    #[arg(long)]
    hostname: Option<String>,
}

fn parse_label(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("`{s}` is not key=value"))
}

fn init_logging(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    // Colour only on a terminal: journald and log files get plain text.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()));
    match format {
        LogFormat::Pretty => builder.init(),
        LogFormat::Json => builder.json().with_current_span(true).init(),
    }
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot listen for SIGTERM; only SIGINT will stop the agent");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received; shutting down"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received; shutting down"),
    }
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    if matches!(cli.command, Command::UnitShim) {
        // A small synchronous process: no runtime, no logging set-up.
        return mesh_host_agent::units::shim::main();
    }
    init_logging(cli.log_format);
    // One crypto provider for every TLS connection of the process (decision
    // 0028); the agent's own clients also name it explicitly.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let result = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
        .and_then(|rt| rt.block_on(agent_main(cli.command)));
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("Error: {e:?}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn agent_main(command: Command) -> anyhow::Result<()> {
    let args = match command {
        Command::Run(args) => args,
        Command::Join(args) => return join(args).await,
        Command::DrainLocal(args) => return drain_local(args).await,
        Command::UnitShim => return Ok(()),
    };

    let mut config = match &args.config {
        Some(path) => Config::load(path)?,
        None => Config::default(),
    };
    if let Some(v) = args.state_dir {
        config.state_dir = v;
    }
    if let Some(v) = args.root {
        config.root = v;
    }
    config.labels.extend(args.labels);
    if let Some(v) = args.heartbeat_interval {
        config.heartbeat_interval = v;
    }
    if let Some(v) = args.metrics_listen {
        config.metrics_listen = Some(v);
    }
    if let Some(v) = args.hostname {
        config.hostname = Some(v);
    }

    // A second signal during the graceful shutdown forces the exit.
    let shutdown = async {
        shutdown_signal().await;
        tokio::spawn(async {
            shutdown_signal().await;
            tracing::warn!("second signal: exiting now");
            std::process::exit(130);
        });
    };
    mesh_host_agent::run(config, shutdown)
        .await
        .context("mesh-agent could not start")?;
    Ok(())
}
