//! `mesh-controller`: run the controller, or apply migrations.

use std::path::PathBuf;

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};
use mesh_controller::app;
use mesh_controller::config::Settings;
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(name = "mesh-controller", version, about = "The mesh controller")]
struct Cli {
    /// Settings file (TOML). Every field has a default; each is documented in controller/src/config.rs.
    #[arg(long, global = true, env = "MESH_CONTROLLER_CONFIG")]
    config: Option<PathBuf>,
    /// Credentials file written by bundle/up (overrides the settings file).
    #[arg(long, global = true)]
    credentials: Option<PathBuf>,
    /// Log format: `text` (one human-readable line per event) or `json` (one
    /// JSON object per line, for a log collector). The level comes from
    /// RUST_LOG (default `info,sqlx=warn,lapin=warn`). docs/observability.md, "Logs".
    #[arg(long, value_enum, default_value_t = LogFormat::Text, env = "MESH_LOG_FORMAT", global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Run the controller until SIGINT or SIGTERM.
    Run {
        /// Address for the HTTP API (default 127.0.0.1:7700).
        #[arg(long)]
        api_listen: Option<std::net::SocketAddr>,
    },
    /// Apply every context's migrations, each as its own role, and exit.
    Migrate,
    /// Print the effective settings (after the file, the environment and the
    /// credentials' advertised endpoints) as TOML, and exit. No secret in it.
    Config,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    // One crypto provider for every TLS connection of the process (decision
    // 0028); the HTTPS listener also names it explicitly.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut settings = Settings::load(cli.config.as_deref()).context("loading settings")?;
    if let Some(c) = cli.credentials {
        settings.credentials = c;
    }
    match cli.command {
        Command::Config => {
            let creds = mesh_controller::config::Credentials::load(&settings.credentials)?;
            let advertised = mesh_controller::config::Advertised::of(&settings, &creds);
            let mut effective = settings.clone();
            effective.advertise_api = advertised.api.clone();
            effective.advertise_broker = advertised.broker.clone();
            if creds.mesh_ca()?.is_some() {
                effective.api_listen_tls = advertised.tls_listen(&settings);
            }
            print!(
                "{}",
                toml::to_string(&effective).context("encoding the settings")?
            );
            if effective.api_listen_tls.is_none() {
                println!(
                    "# HTTPS off: no mesh CA in the credentials, or no advertise_api / api_listen_tls"
                );
            }
        }
        Command::Migrate => {
            for (context, applied) in app::migrate(&settings).await? {
                println!(
                    "{context}: {} migration(s) applied {applied:?}",
                    applied.len()
                );
            }
        }
        Command::Run { api_listen } => {
            if let Some(addr) = api_listen {
                settings.api_listen = addr;
                settings.validate().context("--api-listen")?;
            }
            let shutdown = CancellationToken::new();
            tokio::spawn(signals(shutdown.clone()));
            app::run(settings, shutdown).await?;
        }
    }
    Ok(())
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| "info,sqlx=warn,lapin=warn".into());
    // Colour only on a terminal: journald and log files get plain text.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()));
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().with_current_span(true).init(),
    }
}

/// The first SIGINT/SIGTERM shuts down gracefully; the second exits at once.
async fn signals(shutdown: CancellationToken) {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot listen for SIGTERM");
            return;
        }
    };
    for round in 0..2 {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        if round == 0 {
            tracing::info!("shutting down (signal again to force)");
            shutdown.cancel();
        } else {
            std::process::exit(130);
        }
    }
}
