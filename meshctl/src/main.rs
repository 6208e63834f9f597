//! `meshctl`: the operator's command line for the mesh's HTTP API.
//!
//! Every command is a few API requests with the operator's bearer token
//! against the API; where the API, the token and the CA come from (flag, env,
//! config file, default) is `config.rs`. Secrets it receives (join tokens, API
//! tokens) are printed once, on stdout, and nowhere else. `get`, `label`,
//! `drain` are in `resources.rs`, `describe` and `status` in `describe.rs`,
//! `events` and `get nodes -w` in `events.rs`, tables and `-o` in
//! `output.rs`; the delivery commands (artifacts, revisions, rollouts, runs,
//! the freeze) are in `delivery.rs`, packing in `pack.rs`, the live view and
//! every exit code in `progress.rs`, HTTP and problems in `client.rs`.
//!
//! An `https://` API is verified against the mesh CA (`--ca` / `MESH_CA`,
//! default `/etc/mesh/ca.pem`) and nothing else: no system roots, never
//! skipped. Plain `http://` is accepted for a loopback API only (the bearer
//! token would otherwise cross the network in cleartext).
//!
//! Errors (the API's problems: title, detail, field) go to stderr with exit
//! code 1 (7 for a failed precondition, HTTP 412); `rollout status` (and
//! `rollout start --wait`) exit with the rollout's end. Every code is in
//! `progress.rs` (`EXIT_CODES_HELP`).

// The commands' `///` docs are their `--help` (clap), where `<file>` is the
// usual notation of an argument, not an HTML tag: rustdoc is told so.
#![allow(rustdoc::invalid_html_tags)]

mod client;
mod config;
mod delivery;
mod describe;
mod events;
mod logs;
mod manifest;
mod output;
mod pack;
mod plan;
mod progress;
mod resources;
mod signing;

use anyhow::Context as _;
use clap::{CommandFactory as _, FromArgMatches as _, Parser, Subcommand};
use client::{Api, urlencode};
use serde_json::json;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "meshctl",
    version,
    about = "Operate a mesh through its HTTP API",
    after_help = progress::EXIT_CODES_HELP
)]
struct Cli {
    /// The controller's API [env MESH_API; config `api`; default http://127.0.0.1:7700].
    #[arg(long, env = "MESH_API", global = true)]
    api: Option<String>,
    /// Your API token (bundle/up wrote the first admin token to /etc/mesh/admin-token).
    #[arg(long, env = "MESH_TOKEN", hide_env_values = true, global = true)]
    token: Option<String>,
    /// A file holding your API token [env MESH_TOKEN_FILE; config `token_file`].
    #[arg(long, env = "MESH_TOKEN_FILE", global = true)]
    token_file: Option<PathBuf>,
    /// The mesh CA's certificate (PEM) an https:// API is verified against
    /// [env MESH_CA; config `ca`; default /etc/mesh/ca.pem].
    #[arg(long, env = "MESH_CA", global = true)]
    ca: Option<PathBuf>,
    /// A config file (TOML: api, token_file, ca) [env MESH_CONFIG; default
    /// ~/.config/mesh/meshctl.toml when it exists]. Flags and env win over it.
    #[arg(long, env = "MESH_CONFIG", global = true)]
    config: Option<PathBuf>,
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
    /// OIDC trust for automation (admin): which issuer's ID tokens are
    /// exchanged for short-lived API tokens of which role.
    #[command(subcommand)]
    Trust(TrustCommand),
    /// Read the audit log (admin).
    Audit {
        #[arg(long)]
        principal: Option<String>,
        #[arg(long)]
        target: Option<String>,
        #[arg(long, default_value_t = 100)]
        limit: u32,
    },
    /// Artifacts: push a file or directory (a tar archive by digest), list
    /// them, sign one with a key you hold.
    #[command(subcommand)]
    Artifact(delivery::ArtifactCommand),
    /// Your own signing key pair (no API needed).
    #[command(subcommand)]
    Key(signing::KeyCommand),
    /// The keys whose artifact signatures nodes trust (admin).
    #[command(subcommand)]
    SigningKey(signing::SigningKeyCommand),
    /// Revisions of a module: what a rollout deploys.
    #[command(subcommand)]
    Revision(delivery::RevisionCommand),
    /// A module's delivery policy.
    #[command(subcommand)]
    Module(delivery::ModuleCommand),
    /// Rollouts: start, watch, list, continue, cancel.
    #[command(subcommand)]
    Rollout(delivery::RolloutCommand),
    /// Runs (one node's part of a rollout): approve, deny, receipts.
    #[command(subcommand)]
    Run(delivery::RunCommand),
    /// The delivery freeze: set, lift, status.
    #[command(subcommand)]
    Freeze(delivery::FreezeCommand),
    /// List resources: a table, or the API's objects with -o json|yaml.
    Get {
        #[arg(value_enum)]
        kind: resources::Kind,
        /// Only those whose labels hold every pair: key=value[,key=value]
        /// (nodes only).
        #[arg(short = 'l', long = "selector")]
        selector: Vec<String>,
        /// Output format (default: a table).
        #[arg(short, long, value_enum)]
        output: Option<output::Format>,
        /// Watch (nodes): print the table, then each row that changes.
        #[arg(short, long)]
        watch: bool,
        /// Alerts: resolved ones too (default: open ones).
        #[arg(long)]
        all: bool,
        #[command(flatten)]
        grants: resources::GrantFilters,
    },
    /// Show one resource on one screen: node, module, run or grant.
    Describe {
        #[arg(value_enum)]
        kind: describe::DescribeKind,
        /// The node's id, the module's name, the run's id; a grant's id, the
        /// start of one, or consumer/requirement (app/db).
        name: String,
        #[arg(short, long, value_enum)]
        output: Option<output::Format>,
    },
    /// The fleet in a few lines: nodes by state, modules by health, open
    /// alerts, rollouts in progress, the detection time in force.
    Status {
        #[arg(short, long, value_enum)]
        output: Option<output::Format>,
    },
    /// Set (key=value) or remove (key-) a node's operator labels.
    Label {
        node: String,
        /// key=value to set, key- to remove.
        #[arg(required = true)]
        changes: Vec<String>,
    },
    /// Drain a node: its replicas move elsewhere, nothing new lands on it.
    Drain { node: String },
    /// End a node's drain: it takes replicas again.
    Undrain { node: String },
    /// The events stream; --follow keeps it open and resumes after any
    /// disconnect from the last event seen.
    Events {
        /// Follow new events (from now, or after --after) until interrupted.
        #[arg(short, long)]
        follow: bool,
        /// Only this context's events, e.g. inventory.
        #[arg(long)]
        context: Option<String>,
        /// Only this event, e.g. node.unreachable.
        #[arg(long)]
        kind: Option<String>,
        /// Only events naming this node.
        #[arg(long)]
        node: Option<String>,
        /// Only events naming this module.
        #[arg(long)]
        module: Option<String>,
        /// Start after this position (an event's id).
        #[arg(long)]
        after: Option<String>,
        /// -o json: one event (the API's object) per line.
        #[arg(short, long, value_enum)]
        output: Option<output::Format>,
    },
    /// Print a shell completion script on stdout.
    Completion {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Write man pages for meshctl and every subcommand into <dir>.
    Man { dir: PathBuf },
    /// Apply manifests (modules, files, settings, secrets, grants) with the
    /// ETags their plan read: a change made in between fails (412, exit 7).
    Apply(plan::ApplyArgs),
    /// Compare manifests with the live mesh: what apply would change, and
    /// the nodes each change reaches.
    Plan(plan::PlanArgs),
    /// A module's recent unit output, through the agents (operator role).
    Logs(logs::LogsArgs),
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
        /// Labels bound to the token, key=value[,key=value] (repeatable): the
        /// node joins with them as its operator labels, what selects it
        /// (what it says of itself does not).
        #[arg(long = "label", short = 'l')]
        labels: Vec<String>,
        /// Print the whole join command, token included, on stdout (instead
        /// of the token alone).
        #[arg(long)]
        join_command: bool,
    },
    /// Revoke node <id>: delete its broker user, close its connections (admin).
    /// Final until `meshctl node readmit <id>`: a revoked node gets no join
    /// token, `mesh-bundle node-add` refuses it, its reports are refused.
    Revoke { id: String },
    /// Re-admit revoked node <id> (admin, audited): it may be given
    /// credentials again (`meshctl node add <id>`, or `mesh-bundle node-add`
    /// on a local mesh) and its reports count again.
    Readmit { id: String },
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
        /// Lifetime: seconds, or a number with `m`, `h` or `d` (`30d`).
        /// Default 90 days, at most 366.
        #[arg(long, value_parser = parse_ttl)]
        ttl: Option<u64>,
    },
    /// List API tokens (never their secrets): their expiry and last use too.
    List,
    /// Rotate an API token by id: a new secret with the same name and role
    /// is printed (shown once) and the old one is revoked.
    Rotate {
        id: String,
        /// The new token's lifetime, as at `create`. Default 90 days.
        #[arg(long, value_parser = parse_ttl)]
        ttl: Option<u64>,
    },
    /// Revoke an API token by id.
    Revoke { id: String },
    /// Exchange an OIDC ID token (a CI job's) for an API token of the
    /// trust's role, living an hour at most; prints it (shown once). Needs
    /// no API token.
    Exchange {
        /// The trust to exchange under (`meshctl trust put`).
        #[arg(long)]
        trust: String,
        /// A file holding the ID token, or `-` for standard input.
        #[arg(long)]
        id_token_file: PathBuf,
    },
}

#[derive(Subcommand)]
enum TrustCommand {
    /// Create or replace a trust: ID tokens of ISSUER for AUDIENCE whose
    /// subject matches SUBJECT are exchanged for tokens of ROLE. A changed
    /// trust revokes the tokens it gave.
    Put {
        name: String,
        /// The issuer's URL, as its tokens' `iss` says.
        #[arg(long)]
        issuer: String,
        /// What the ID token's `aud` must hold.
        #[arg(long)]
        audience: String,
        /// What its `sub` must match; `*` matches any run of characters
        /// (`repo:acme/app:ref:refs/heads/main`). `*` alone is refused.
        #[arg(long)]
        subject: String,
        #[arg(long, value_parser = ["admin", "operator", "viewer"])]
        role: String,
        /// The tokens' lifetime: seconds, or a number with `m` or `h`.
        /// Default and most 1h.
        #[arg(long, value_parser = parse_ttl)]
        ttl: Option<u64>,
    },
    /// List the trusts.
    List,
    /// Delete a trust and revoke the tokens it gave.
    Delete { name: String },
}

/// A token lifetime: seconds, or a number with `m`, `h` or `d`.
fn parse_ttl(text: &str) -> Result<u64, String> {
    let (digits, unit) = match text.char_indices().last() {
        Some((at, 'm')) => (&text[..at], 60),
        Some((at, 'h')) => (&text[..at], 3600),
        Some((at, 'd')) => (&text[..at], 86_400),
        Some((at, 's')) => (&text[..at], 1),
        _ => (text, 1),
    };
    digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(unit))
        .ok_or_else(|| {
            format!("`{text}` is not a lifetime: seconds, or a number with m, h or d (30d)")
        })
}

#[tokio::main]
async fn main() -> ExitCode {
    // Usage errors exit 1 like every other error (clap's own would be 2);
    // --help and --version exit 0.
    let parsed = Cli::command()
        .try_get_matches()
        .and_then(|m| Cli::from_arg_matches(&m).map(|cli| (cli, m)));
    let (cli, matches) = match parsed {
        Ok(p) => p,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(progress::EXIT_ERROR)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    match run(cli, &matches).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("meshctl: {e:#}");
            let precondition = e
                .downcast_ref::<client::ApiError>()
                .is_some_and(|a| a.status == reqwest::StatusCode::PRECONDITION_FAILED);
            ExitCode::from(if precondition {
                progress::EXIT_PRECONDITION
            } else {
                progress::EXIT_ERROR
            })
        }
    }
}

/// Where a global flag's value came from (clap knows flag from env).
fn source(matches: &clap::ArgMatches, id: &str) -> config::Source {
    match matches.value_source(id) {
        Some(clap::parser::ValueSource::CommandLine) => config::Source::Flag,
        Some(clap::parser::ValueSource::EnvVariable) => config::Source::Env,
        _ => config::Source::Default,
    }
}

/// The API client the settings resolve to (flag > env > file > default).
fn connect(cli: &mut Cli, matches: &clap::ArgMatches) -> anyhow::Result<Api> {
    let inputs = config::Inputs {
        api: cli.api.take().map(|v| (v, source(matches, "api"))),
        token: cli.token.take().map(|v| (v, source(matches, "token"))),
        token_file: cli
            .token_file
            .take()
            .map(|v| (v, source(matches, "token_file"))),
        ca: cli.ca.take().map(|v| (v, source(matches, "ca"))),
    };
    let file = match config::file_path(cli.config.take()) {
        Some(path) => {
            let parsed = config::read_file(&path)?;
            Some((path, parsed))
        }
        None => None,
    };
    let resolved = config::resolve(inputs, file.as_ref().map(|(p, f)| (p.as_path(), f.clone())));
    let token = config::load_token(resolved.token)?;
    Api::new(
        &resolved.api,
        &resolved.ca,
        token.map(|t| t.expose().to_owned()),
    )
    .with_context(|| {
        format!(
            "the API from {}, the CA from {}",
            resolved.api_from.describe("--api", "MESH_API"),
            resolved.ca_from.describe("--ca", "MESH_CA")
        )
    })
}

async fn run(mut cli: Cli, matches: &clap::ArgMatches) -> anyhow::Result<ExitCode> {
    // The one crypto provider (ring) of every TLS connection (decision 0028).
    let _ = rustls::crypto::ring::default_provider().install_default();
    // Commands that need no API.
    if let Command::Key(k) = cli.command {
        return signing::key(k);
    }
    match &cli.command {
        Command::Completion { shell } => {
            // Into a buffer first: clap_complete panics on a failed write
            // (a closed pipe); this way it is an error like any other.
            let mut script = Vec::new();
            clap_complete::generate(*shell, &mut Cli::command(), "meshctl", &mut script);
            use std::io::Write as _;
            let mut stdout = std::io::stdout().lock();
            stdout
                .write_all(&script)
                .and_then(|()| stdout.flush())
                .context("writing the completion script")?;
            return Ok(ExitCode::SUCCESS);
        }
        Command::Man { dir } => {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            clap_mangen::generate_to(Cli::command(), dir)
                .with_context(|| format!("writing man pages into {}", dir.display()))?;
            return Ok(ExitCode::SUCCESS);
        }
        _ => {}
    }
    let api = connect(&mut cli, matches)?;
    use reqwest::Method;
    match cli.command {
        Command::Completion { .. } | Command::Man { .. } => {}
        Command::Get {
            kind,
            selector,
            output,
            watch,
            all,
            grants,
        } => {
            if watch {
                if kind != resources::Kind::Nodes {
                    anyhow::bail!("-w: only `get nodes` can be watched");
                }
                events::watch_nodes(&api, &selector, output).await?;
            } else {
                resources::get(&api, kind, &selector, all, &grants, output).await?;
            }
        }
        Command::Describe { kind, name, output } => {
            describe::describe(&api, kind, &name, output).await?
        }
        Command::Status { output } => describe::status(&api, output).await?,
        Command::Label { node, changes } => resources::label(&api, &node, &changes).await?,
        Command::Drain { node } => resources::drain(&api, &node, true).await?,
        Command::Undrain { node } => resources::drain(&api, &node, false).await?,
        Command::Events {
            follow,
            context,
            kind,
            node,
            module,
            after,
            output,
        } => {
            let filters = events::Filters {
                context,
                kind,
                node,
                module,
            };
            events::events(&api, filters, follow, after, output).await?
        }
        Command::Node(NodeCommand::Add {
            id,
            ttl,
            labels,
            join_command,
        }) => {
            let mut body = json!({ "labels": resources::parse_selector(&labels)? });
            if let Some(t) = ttl {
                body["ttl_secs"] = json!(t);
            }
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
        Command::Node(NodeCommand::Readmit { id }) => {
            let v = api
                .call(Method::POST, &format!("/v1/nodes/{id}/readmit"), None)
                .await?;
            eprintln!(
                "node {id} re-admitted (revoked at {}); {}",
                v["revoked_at"].as_str().unwrap_or("?"),
                v["next"].as_str().unwrap_or("give it credentials again")
            );
            println!("{}", serde_json::to_string_pretty(&v)?);
        }
        Command::Token(TokenCommand::Create { role, name, ttl }) => {
            let name = name.unwrap_or_else(|| format!("{role}-token"));
            let mut body = json!({ "name": name, "role": role });
            if let Some(ttl) = ttl {
                body["ttl_secs"] = json!(ttl);
            }
            let v = api.call(Method::POST, "/v1/tokens", Some(body)).await?;
            eprintln!(
                "API token `{name}` ({role}), id {}, expires {}; shown once:",
                v["id"].as_str().unwrap_or("?"),
                v["expires_at"].as_str().unwrap_or("?")
            );
            println!("{}", v["token"].as_str().context("no token in the answer")?);
        }
        Command::Token(TokenCommand::Rotate { id, ttl }) => {
            let body = ttl.map(|ttl| json!({ "ttl_secs": ttl }));
            let v = api
                .call(Method::POST, &format!("/v1/tokens/{id}/rotate"), body)
                .await?;
            eprintln!(
                "API token `{}` rotated: new id {}, expires {}; the old one ({id}) is revoked; shown once:",
                v["name"].as_str().unwrap_or("?"),
                v["id"].as_str().unwrap_or("?"),
                v["expires_at"].as_str().unwrap_or("?")
            );
            println!("{}", v["token"].as_str().context("no token in the answer")?);
        }
        Command::Token(TokenCommand::Exchange {
            trust,
            id_token_file,
        }) => {
            let id_token = if id_token_file.as_os_str() == "-" {
                std::io::read_to_string(std::io::stdin())
                    .context("reading the ID token from stdin")?
            } else {
                std::fs::read_to_string(&id_token_file).with_context(|| {
                    format!("reading the ID token from {}", id_token_file.display())
                })?
            };
            let body = json!({ "trust": trust, "id_token": id_token.trim() });
            let v = api
                .call(Method::POST, "/v1/tokens/exchange", Some(body))
                .await?;
            eprintln!(
                "API token of trust `{trust}` ({}) for `{}`, expires {}; shown once:",
                v["role"].as_str().unwrap_or("?"),
                v["subject"].as_str().unwrap_or("?"),
                v["expires_at"].as_str().unwrap_or("?")
            );
            println!("{}", v["token"].as_str().context("no token in the answer")?);
        }
        Command::Trust(TrustCommand::Put {
            name,
            issuer,
            audience,
            subject,
            role,
            ttl,
        }) => {
            let mut body = json!({
                "issuer": issuer, "audience": audience, "subject": subject, "role": role,
            });
            if let Some(ttl) = ttl {
                body["ttl_secs"] = json!(ttl);
            }
            let v = api
                .call(
                    Method::PUT,
                    &format!("/v1/trust/{}", urlencode(&name)),
                    Some(body),
                )
                .await?;
            println!("{}", serde_json::to_string_pretty(&v)?);
        }
        Command::Trust(TrustCommand::List) => {
            let v = api.call(Method::GET, "/v1/trust", None).await?;
            println!("{}", serde_json::to_string_pretty(&v)?);
        }
        Command::Trust(TrustCommand::Delete { name }) => {
            let v = api
                .call(
                    Method::DELETE,
                    &format!("/v1/trust/{}", urlencode(&name)),
                    None,
                )
                .await?;
            println!("{}", serde_json::to_string_pretty(&v)?);
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
        Command::Artifact(c) => return delivery::artifact(&api, c).await,
        Command::SigningKey(c) => return signing::signing_key(&api, c).await,
        Command::Key(_) => {}
        Command::Revision(c) => return delivery::revision(&api, c).await,
        Command::Module(c) => return delivery::module(&api, c).await,
        Command::Rollout(c) => return delivery::rollout(&api, c).await,
        Command::Run(c) => return delivery::run(&api, c).await,
        Command::Freeze(c) => return delivery::freeze(&api, c).await,
        Command::Apply(a) => return plan::apply(&api, a).await,
        Command::Plan(a) => return plan::plan(&api, a).await,
        Command::Logs(args) => return logs::run(&api, args).await,
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use delivery::{
        ArtifactCommand, FreezeCommand, ModuleCommand, RevisionCommand, RolloutCommand, RunCommand,
    };

    fn parse(args: &[&str]) -> Result<Command, clap::Error> {
        Cli::try_parse_from(std::iter::once("meshctl").chain(args.iter().copied()))
            .map(|c| c.command)
    }

    fn ok(args: &[&str]) -> Command {
        match parse(args) {
            Ok(c) => c,
            Err(e) => panic!("{args:?}: {e}"),
        }
    }

    #[test]
    fn trust_and_exchange_commands() {
        assert!(matches!(
            ok(&[
                "trust", "put", "ci", "--issuer", "https://i", "--audience", "mesh",
                "--subject", "repo:a/b:*", "--role", "operator", "--ttl", "30m",
            ]),
            Command::Trust(TrustCommand::Put { name, role, ttl: Some(1800), .. })
                if name == "ci" && role == "operator"
        ));
        assert!(
            parse(&[
                "trust",
                "put",
                "ci",
                "--issuer",
                "https://i",
                "--audience",
                "m",
                "--subject",
                "s",
                "--role",
                "root"
            ])
            .is_err(),
            "an unknown role"
        );
        assert!(matches!(
            ok(&["trust", "list"]),
            Command::Trust(TrustCommand::List)
        ));
        assert!(matches!(
            ok(&["trust", "delete", "ci"]),
            Command::Trust(TrustCommand::Delete { name }) if name == "ci"
        ));
        assert!(matches!(
            ok(&["token", "exchange", "--trust", "ci", "--id-token-file", "-"]),
            Command::Token(TokenCommand::Exchange { trust, id_token_file })
                if trust == "ci" && id_token_file.as_os_str() == "-"
        ));
        assert!(
            parse(&["token", "exchange", "--trust", "ci"]).is_err(),
            "the ID token is needed"
        );
    }

    #[test]
    fn artifact_commands() {
        assert!(matches!(
            ok(&["artifact", "push", "./app"]),
            Command::Artifact(ArtifactCommand::Push { path }) if path == std::path::Path::new("./app")
        ));
        assert!(matches!(
            ok(&["artifact", "list"]),
            Command::Artifact(ArtifactCommand::List)
        ));
        assert!(parse(&["artifact", "push"]).is_err());
    }

    #[test]
    fn revision_create_from_flags() {
        let Command::Revision(RevisionCommand::Create(r)) = ok(&[
            "revision",
            "create",
            "web",
            "--artifact",
            "sha256:abc",
            "--command",
            "bin/web",
            "--arg",
            "--port",
            "--arg",
            "8080",
            "--env",
            "A=1",
            "--env",
            "B=x=y",
            "--working-dir",
            "/srv",
            "--restart",
            "on_failure",
        ]) else {
            panic!("not revision create");
        };
        assert_eq!(r.module, "web");
        assert_eq!(
            delivery::revision_body(&r).unwrap(),
            json!({
                "artifact": "sha256:abc",
                "unit": {"command": "bin/web", "args": ["--port", "8080"],
                         "env": {"A": "1", "B": "x=y"}, "working_dir": "/srv",
                         "restart": "on_failure", "probes": []},
                "settings_digest": null,
            })
        );
        let Command::Revision(RevisionCommand::Create(r)) =
            ok(&["revision", "create", "web", "--command", "bin/x"])
        else {
            panic!("not revision create");
        };
        assert_eq!(
            delivery::revision_body(&r).unwrap(),
            json!({"artifact": null,
                   "unit": {"command": "bin/x", "args": [], "env": {}, "working_dir": null,
                            "restart": "always", "probes": []},
                   "settings_digest": null})
        );
    }

    #[test]
    fn revision_create_refuses_bad_input() {
        assert!(
            parse(&["revision", "create", "web"]).is_err(),
            "no --command nor -f"
        );
        assert!(
            parse(&[
                "revision",
                "create",
                "web",
                "--command",
                "x",
                "--env",
                "NOEQUALS"
            ])
            .is_err()
        );
        assert!(parse(&["revision", "create", "web", "--command", "x", "--env", "=v"]).is_err());
        assert!(
            parse(&[
                "revision",
                "create",
                "web",
                "--command",
                "x",
                "--restart",
                "sometimes"
            ])
            .is_err()
        );
        assert!(
            parse(&[
                "revision",
                "create",
                "web",
                "-f",
                "r.json",
                "--command",
                "x"
            ])
            .is_err()
        );
        let Command::Revision(RevisionCommand::Create(r)) = ok(&[
            "revision",
            "create",
            "web",
            "--command",
            "x",
            "--artifact",
            "abc",
        ]) else {
            panic!("not revision create");
        };
        assert!(
            delivery::revision_body(&r).is_err(),
            "an artifact is sha256:…"
        );
    }

    #[test]
    fn revision_create_from_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("revision.json");
        let def = json!({"artifact": null, "unit": {"command": "bin/x", "restart": "never"}, "settings_digest": null});
        std::fs::write(&f, def.to_string()).unwrap();
        let Command::Revision(RevisionCommand::Create(r)) =
            ok(&["revision", "create", "web", "-f", f.to_str().unwrap()])
        else {
            panic!("not revision create");
        };
        assert_eq!(delivery::revision_body(&r).unwrap(), def);
        std::fs::write(&f, "{\"artifact\": null}").unwrap();
        assert!(delivery::revision_body(&r).is_err(), "no unit");
        std::fs::write(&f, "not json").unwrap();
        assert!(delivery::revision_body(&r).is_err());
        assert!(matches!(
            ok(&["revision", "list", "web"]),
            Command::Revision(RevisionCommand::List { module }) if module == "web"
        ));
    }

    #[test]
    fn module_delivery() {
        assert!(matches!(
            ok(&["module", "delivery", "web", "--require-approval", "true"]),
            Command::Module(ModuleCommand::Delivery {
                require_approval: Some(true),
                ..
            })
        ));
        assert!(matches!(
            ok(&["module", "delivery", "web", "--require-approval", "false"]),
            Command::Module(ModuleCommand::Delivery {
                require_approval: Some(false),
                ..
            })
        ));
        assert!(matches!(
            ok(&["module", "delivery", "web"]),
            Command::Module(ModuleCommand::Delivery {
                require_approval: None,
                ..
            })
        ));
        assert!(parse(&["module", "delivery", "web", "--require-approval", "maybe"]).is_err());
        assert!(parse(&["module", "delivery", "web", "--require-approval"]).is_err());
    }

    #[test]
    fn rollout_start() {
        let Command::Rollout(RolloutCommand::Start {
            module,
            revision,
            max_unavailable,
            max_extra,
            settle_secs,
            failure_threshold,
            no_rollback,
            canary,
            wait,
            watch,
        }) = ok(&[
            "rollout",
            "start",
            "web",
            "--revision",
            "0190-rev",
            "--max-unavailable",
            "2",
            "--max-extra",
            "1",
            "--settle",
            "30",
            "--failure-threshold",
            "3",
            "--no-rollback",
            "--canary",
            "--wait",
            "--interval-ms",
            "200",
            "--timeout",
            "600",
        ])
        else {
            panic!("not rollout start");
        };
        assert_eq!((module.as_str(), revision.as_str()), ("web", "0190-rev"));
        assert_eq!(
            (max_unavailable, max_extra, settle_secs, failure_threshold),
            (Some(2), Some(1), Some(30), Some(3))
        );
        assert!(no_rollback && wait);
        assert_eq!(canary, Some(1));
        assert_eq!((watch.interval_ms, watch.timeout), (200, Some(600)));

        let Command::Rollout(RolloutCommand::Start {
            canary,
            no_rollback,
            wait,
            watch,
            max_unavailable,
            ..
        }) = ok(&["rollout", "start", "web", "--revision", "r", "--canary=2"])
        else {
            panic!("not rollout start");
        };
        assert_eq!(
            (canary, no_rollback, wait, max_unavailable),
            (Some(2), false, false, None)
        );
        assert_eq!((watch.interval_ms, watch.timeout), (1000, None));
        // `--canary` takes no separate value: the module stays the positional.
        assert!(matches!(
            ok(&["rollout", "start", "--canary", "web", "--revision", "r"]),
            Command::Rollout(RolloutCommand::Start { canary: Some(1), module, .. }) if module == "web"
        ));
        assert!(
            parse(&["rollout", "start", "web"]).is_err(),
            "--revision is required"
        );
        assert!(
            parse(&[
                "rollout",
                "start",
                "web",
                "--revision",
                "r",
                "--settle",
                "-1"
            ])
            .is_err()
        );
    }

    #[test]
    fn rollout_status_list_continue_cancel() {
        assert!(matches!(
            ok(&["rollout", "status", "r-1"]),
            Command::Rollout(RolloutCommand::Status { id, watch }) if id == "r-1" && watch.interval_ms == 1000 && watch.timeout.is_none()
        ));
        assert!(matches!(
            ok(&["rollout", "status", "r-1", "--interval-ms", "50", "--timeout", "5"]),
            Command::Rollout(RolloutCommand::Status { watch, .. }) if watch.interval_ms == 50 && watch.timeout == Some(5)
        ));
        assert!(parse(&["rollout", "status", "r-1", "--interval-ms", "0"]).is_err());
        assert!(parse(&["rollout", "status"]).is_err());
        assert!(matches!(
            ok(&["rollout", "list", "--module", "web"]),
            Command::Rollout(RolloutCommand::List { module: Some(m), state: None }) if m == "web"
        ));
        assert!(matches!(
            ok(&["rollout", "list"]),
            Command::Rollout(RolloutCommand::List {
                module: None,
                state: None
            })
        ));
        assert!(matches!(
            ok(&["rollout", "continue", "r-1"]),
            Command::Rollout(RolloutCommand::Continue { id }) if id == "r-1"
        ));
        assert!(matches!(
            ok(&["rollout", "cancel", "r-1"]),
            Command::Rollout(RolloutCommand::Cancel { id }) if id == "r-1"
        ));
    }

    #[test]
    fn run_commands() {
        assert!(matches!(
            ok(&["run", "approve", "u1"]),
            Command::Run(RunCommand::Approve { id, reason: None }) if id == "u1"
        ));
        assert!(matches!(
            ok(&["run", "approve", "u1", "--reason", "looks good"]),
            Command::Run(RunCommand::Approve { reason: Some(r), .. }) if r == "looks good"
        ));
        assert!(matches!(
            ok(&["run", "deny", "u1", "--reason", "not today"]),
            Command::Run(RunCommand::Deny { id, reason }) if id == "u1" && reason == "not today"
        ));
        assert!(
            parse(&["run", "deny", "u1"]).is_err(),
            "deny needs a reason"
        );
        assert!(matches!(
            ok(&["run", "receipts", "u1"]),
            Command::Run(RunCommand::Receipts { id }) if id == "u1"
        ));
    }

    #[test]
    fn freeze_commands() {
        assert!(matches!(
            ok(&["freeze", "set", "--reason", "release week"]),
            Command::Freeze(FreezeCommand::Set { reason, keep_running: false }) if reason == "release week"
        ));
        assert!(matches!(
            ok(&["freeze", "set", "--reason", "r", "--keep-running"]),
            Command::Freeze(FreezeCommand::Set {
                keep_running: true,
                ..
            })
        ));
        assert!(
            parse(&["freeze", "set"]).is_err(),
            "a freeze needs a reason"
        );
        assert!(matches!(
            ok(&["freeze", "lift"]),
            Command::Freeze(FreezeCommand::Lift)
        ));
        assert!(matches!(
            ok(&["freeze", "status"]),
            Command::Freeze(FreezeCommand::Status)
        ));
    }

    #[test]
    fn the_global_flags_go_anywhere_and_old_commands_still_parse() {
        let cli = Cli::try_parse_from([
            "meshctl",
            "rollout",
            "status",
            "r",
            "--api",
            "https://c:7443",
            "--token",
            "t",
        ])
        .unwrap();
        assert_eq!(cli.api.as_deref(), Some("https://c:7443"));
        assert_eq!(cli.token.as_deref(), Some("t"));
        assert!(matches!(
            ok(&["token", "list"]),
            Command::Token(TokenCommand::List)
        ));
        assert!(matches!(
            ok(&["node", "readmit", "web-1"]),
            Command::Node(NodeCommand::Readmit { id }) if id == "web-1"
        ));
        assert!(matches!(
            ok(&["node", "add", "web-3", "--join-command"]),
            Command::Node(NodeCommand::Add {
                join_command: true,
                ..
            })
        ));
    }

    #[test]
    fn the_operator_commands_parse() {
        assert!(matches!(
            ok(&["get", "nodes", "-l", "role=web,zone=eu", "-l", "tier=1", "-o", "json"]),
            Command::Get { kind: resources::Kind::Nodes, selector, output: Some(output::Format::Json), watch: false, all: false, grants }
                if selector == ["role=web,zone=eu", "tier=1"] && grants == resources::GrantFilters::default()
        ));
        assert!(matches!(
            ok(&["get", "no", "-w", "-o", "wide"]),
            Command::Get {
                kind: resources::Kind::Nodes,
                watch: true,
                output: Some(output::Format::Wide),
                ..
            }
        ));
        for (word, kind) in [
            ("modules", resources::Kind::Modules),
            ("file", resources::Kind::Files),
            ("settings", resources::Kind::Settings),
            ("secrets", resources::Kind::Secrets),
            ("alerts", resources::Kind::Alerts),
            ("run", resources::Kind::Runs),
            ("tokens", resources::Kind::Tokens),
            ("grants", resources::Kind::Grants),
            ("grant", resources::Kind::Grants),
        ] {
            assert!(
                matches!(ok(&["get", word]), Command::Get { kind: k, .. } if k == kind),
                "{word}"
            );
        }
        assert!(parse(&["get", "pods"]).is_err());
        assert!(parse(&["get", "nodes", "-o", "xml"]).is_err());
        assert!(matches!(
            ok(&["describe", "node", "web-1", "-o", "yaml"]),
            Command::Describe { kind: describe::DescribeKind::Node, name, output: Some(output::Format::Yaml) } if name == "web-1"
        ));
        assert!(parse(&["describe", "node"]).is_err(), "a name is needed");
        assert!(matches!(
            ok(&["describe", "grant", "app/db"]),
            Command::Describe { kind: describe::DescribeKind::Grant, name, output: None } if name == "app/db"
        ));
        assert!(matches!(
            ok(&["describe", "grants", "0193"]),
            Command::Describe {
                kind: describe::DescribeKind::Grant,
                ..
            }
        ));
        assert!(matches!(
            ok(&["get", "grants", "--module", "app", "--resource", "app-db", "--kind", "postgres.database", "--state", "ready", "-o", "wide"]),
            Command::Get { kind: resources::Kind::Grants, output: Some(output::Format::Wide), grants, .. }
                if grants == resources::GrantFilters {
                    module: Some("app".into()),
                    resource: Some("app-db".into()),
                    kind: Some("postgres.database".into()),
                    state: Some("ready".into()),
                }
        ));
        assert!(
            parse(&["get", "grants", "--module"]).is_err(),
            "a value is needed"
        );
        assert!(matches!(ok(&["status"]), Command::Status { output: None }));
        assert!(matches!(
            ok(&["label", "web-1", "role=web", "zone-"]),
            Command::Label { node, changes } if node == "web-1" && changes == ["role=web", "zone-"]
        ));
        assert!(parse(&["label", "web-1"]).is_err(), "a change is needed");
        assert!(matches!(ok(&["drain", "web-1"]), Command::Drain { node } if node == "web-1"));
        assert!(matches!(ok(&["undrain", "web-1"]), Command::Undrain { node } if node == "web-1"));
        assert!(matches!(
            ok(&["events", "-f", "--context", "inventory", "--kind", "node.joined", "--node", "a", "--module", "m", "--after", "5"]),
            Command::Events { follow: true, context: Some(c), kind: Some(k), node: Some(n), module: Some(m), after: Some(a), output: None }
                if c == "inventory" && k == "node.joined" && n == "a" && m == "m" && a == "5"
        ));
        assert!(matches!(
            ok(&["completion", "zsh"]),
            Command::Completion {
                shell: clap_complete::Shell::Zsh
            }
        ));
        assert!(parse(&["completion", "tcsh"]).is_err());
        assert!(
            matches!(ok(&["man", "/tmp/m"]), Command::Man { dir } if dir == std::path::Path::new("/tmp/m"))
        );
        let cli = Cli::try_parse_from([
            "meshctl",
            "status",
            "--config",
            "/c.toml",
            "--token-file",
            "/t",
        ])
        .unwrap();
        assert_eq!(cli.config.as_deref(), Some(std::path::Path::new("/c.toml")));
        assert_eq!(cli.token_file.as_deref(), Some(std::path::Path::new("/t")));
    }

    #[test]
    fn every_exit_code_is_in_the_top_level_help() {
        use clap::CommandFactory as _;
        let help = Cli::command().render_long_help().to_string();
        for (code, meaning) in [
            (progress::EXIT_SUCCEEDED, "success"),
            (progress::EXIT_ERROR, "error"),
            (progress::EXIT_CHANGES, "plan --detailed-exitcode"),
            (progress::EXIT_FAILED, "a watched rollout failed"),
            (progress::EXIT_ROLLED_BACK, "rolled back"),
            (progress::EXIT_DENIED_OR_CANCELED, "denied or canceled"),
            (progress::EXIT_TIMEOUT, "--timeout"),
            (progress::EXIT_PRECONDITION, "a precondition failed"),
        ] {
            let line = help
                .lines()
                .find(|l| l.trim_start().starts_with(&format!("{code}  ")))
                .unwrap_or_else(|| panic!("no line for {code} in\n{help}"));
            assert!(line.contains(meaning), "{code}: {line}");
        }
    }

    #[test]
    fn the_exit_codes_are_in_the_help() {
        use clap::CommandFactory as _;
        let mut cmd = Cli::command();
        let status = cmd
            .find_subcommand_mut("rollout")
            .and_then(|r| r.find_subcommand_mut("status"))
            .unwrap();
        let help = status.render_long_help().to_string();
        for code in [
            "0  the rollout succeeded",
            "3  the rollout failed",
            "4  the rollout was rolled back",
            "5  the rollout was denied or canceled",
            "6  --timeout",
        ] {
            assert!(help.contains(code), "{code} missing from\n{help}");
        }
        Cli::command().debug_assert();
    }

    #[test]
    fn a_token_lifetime_is_seconds_or_minutes_hours_days() {
        assert_eq!(parse_ttl("3600"), Ok(3600));
        assert_eq!(parse_ttl("90s"), Ok(90));
        assert_eq!(parse_ttl("15m"), Ok(900));
        assert_eq!(parse_ttl("12h"), Ok(43_200));
        assert_eq!(parse_ttl("30d"), Ok(2_592_000));
        for bad in ["", "d", "1w", "-5", "1.5d", "99999999999999999999d"] {
            let err = parse_ttl(bad).unwrap_err();
            assert!(err.contains("not a lifetime"), "{bad}: {err}");
        }
    }
}
