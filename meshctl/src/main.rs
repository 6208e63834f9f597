//! `meshctl`: the operator's command line for the mesh's HTTP API.
//!
//! Every command is one API request with the operator's bearer token
//! (`--token` / `MESH_TOKEN`) against `--api` / `MESH_API`. Secrets it receives
//! (join tokens, API tokens) are printed once, on stdout, and nowhere else.
//!
//! An `https://` API is verified against the mesh CA (`--ca` / `MESH_CA`,
//! default `/etc/mesh/ca.pem`) and nothing else: no system roots, never
//! skipped. Plain `http://` is accepted for a loopback API only (the bearer
//! token would otherwise cross the network in cleartext).
//!
//! Errors (the API's problems: title, detail, field) go to stderr with exit
//! code 1.

mod client;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use client::{Api, urlencode};
use serde_json::json;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "meshctl",
    version,
    about = "Operate a mesh through its HTTP API",
    after_help = "Errors (usage, transport, the API's problems) exit 1."
)]
struct Cli {
    /// The controller's API.
    #[arg(
        long,
        env = "MESH_API",
        default_value = "http://127.0.0.1:7700",
        global = true
    )]
    api: String,
    /// Your API token (bundle/up wrote the first admin token to /etc/mesh/admin-token).
    #[arg(long, env = "MESH_TOKEN", hide_env_values = true, global = true)]
    token: Option<String>,
    /// The mesh CA's certificate (PEM) an https:// API is verified against.
    #[arg(
        long,
        env = "MESH_CA",
        default_value = "/etc/mesh/ca.pem",
        global = true
    )]
    ca: std::path::PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Nodes: enrol (join token) and revoke.
    #[command(subcommand)]
    Node(NodeCommand),
    /// API tokens of operators.
    #[command(subcommand)]
    Token(TokenCommand),
    /// Read the audit log (admin).
    Audit {
        #[arg(long)]
        principal: Option<String>,
        #[arg(long)]
        target: Option<String>,
        #[arg(long, default_value_t = 100)]
        limit: u32,
    },
}

#[derive(Subcommand)]
enum NodeCommand {
    /// Create a single-use join token for node <id> and print it; on the node:
    /// `MESH_JOIN_TOKEN=<token> mesh-agent join --api <advertised API>
    /// --ca-hash sha256:<CA pin> --node <id>`.
    Add {
        id: String,
        /// Validity in seconds (default 3600).
        #[arg(long)]
        ttl: Option<u64>,
        /// Print the whole join command, token included, on stdout (instead
        /// of the token alone).
        #[arg(long)]
        join_command: bool,
    },
    /// Revoke node <id>: delete its broker user, close its connections (admin).
    Revoke { id: String },
}

#[derive(Subcommand)]
enum TokenCommand {
    /// Create an API token and print it (shown once).
    Create {
        #[arg(long, value_parser = ["admin", "operator", "viewer"])]
        role: String,
        /// A name for it (who or what uses it). Default: `<role>-token`.
        #[arg(long)]
        name: Option<String>,
    },
    /// List API tokens (never their secrets).
    List,
    /// Revoke an API token by id.
    Revoke { id: String },
}

#[tokio::main]
async fn main() -> ExitCode {
    // Usage errors exit 1 like every other error (clap's own would be 2);
    // --help and --version exit 0.
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(1)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    match run(cli).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("meshctl: {e:#}");
            ExitCode::from(1)
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    // The one crypto provider (ring) of every TLS connection (decision 0028).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let api = Api::new(&cli.api, &cli.ca, cli.token)?;
    use reqwest::Method;
    match cli.command {
        Command::Node(NodeCommand::Add {
            id,
            ttl,
            join_command,
        }) => {
            let body = match ttl {
                Some(t) => json!({ "ttl_secs": t }),
                None => json!({}),
            };
            let v = api
                .call(
                    Method::POST,
                    &format!("/v1/nodes/{id}/join-tokens"),
                    Some(body),
                )
                .await?;
            let token = v["token"].as_str().context("no token in the answer")?;
            // The advertised API and the CA's pin when the mesh has them; a
            // loopback-only mesh joins over the API this command used.
            let (join_api, pin) = match (v["api_url"].as_str(), v["ca_hash"].as_str()) {
                (Some(url), Some(hash)) => (url, format!(" --ca-hash {hash}")),
                _ => (api.base.as_str(), String::new()),
            };
            let command = format!("mesh-agent join --api {join_api}{pin} --node {id}");
            eprintln!(
                "join token for {id} (single use, expires {}); on the node run:\n  MESH_JOIN_TOKEN=<token> {command}",
                v["expires_at"].as_str().unwrap_or("?"),
            );
            if join_command {
                println!("{command} --token {token}");
            } else {
                println!("{token}");
            }
        }
        Command::Node(NodeCommand::Revoke { id }) => {
            let v = api
                .call(Method::DELETE, &format!("/v1/nodes/{id}"), None)
                .await?;
            println!("{}", serde_json::to_string_pretty(&v)?);
        }
        Command::Token(TokenCommand::Create { role, name }) => {
            let name = name.unwrap_or_else(|| format!("{role}-token"));
            let v = api
                .call(
                    Method::POST,
                    "/v1/tokens",
                    Some(json!({ "name": name, "role": role })),
                )
                .await?;
            eprintln!(
                "API token `{name}` ({role}), id {}; shown once:",
                v["id"].as_str().unwrap_or("?")
            );
            println!("{}", v["token"].as_str().context("no token in the answer")?);
        }
        Command::Token(TokenCommand::List) => {
            let v = api.call(Method::GET, "/v1/tokens", None).await?;
            println!("{}", serde_json::to_string_pretty(&v)?);
        }
        Command::Token(TokenCommand::Revoke { id }) => {
            let v = api
                .call(Method::DELETE, &format!("/v1/tokens/{id}"), None)
                .await?;
            println!("{}", serde_json::to_string_pretty(&v)?);
        }
        Command::Audit {
            principal,
            target,
            limit,
        } => {
            let mut query = vec![format!("limit={limit}")];
            if let Some(p) = principal {
                query.push(format!("principal={}", urlencode(&p)));
            }
            if let Some(t) = target {
                query.push(format!("target={}", urlencode(&t)));
            }
            let v = api
                .call(Method::GET, &format!("/v1/audit?{}", query.join("&")), None)
                .await?;
            println!("{}", serde_json::to_string_pretty(&v)?);
        }
    }
    Ok(ExitCode::SUCCESS)
}
