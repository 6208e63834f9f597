//! `meshctl`: the operator's command line for the mesh's HTTP API.
//!
//! Every command is one API request (`rollout status` polls one) with the
//! operator's bearer token (`--token` / `MESH_TOKEN`) against `--api` /
//! `MESH_API`. Secrets it receives (join tokens, API tokens) are printed once,
//! on stdout, and nowhere else. The delivery commands (artifacts, revisions,
//! rollouts, runs, the freeze) are in `delivery.rs`, packing in `pack.rs`, the
//! live view in `progress.rs`, HTTP and problems in `client.rs`.
//!
//! An `https://` API is verified against the mesh CA (`--ca` / `MESH_CA`,
//! default `/etc/mesh/ca.pem`) and nothing else: no system roots, never
//! skipped. Plain `http://` is accepted for a loopback API only (the bearer
//! token would otherwise cross the network in cleartext).
//!
//! Errors (the API's problems: title, detail, field) go to stderr with exit
//! code 1; `rollout status` (and `rollout start --wait`) exit with the
//! rollout's end (see `delivery::EXIT_CODES`).

mod client;
mod delivery;
mod logs;
mod pack;
mod progress;

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
    after_help = "Errors (usage, transport, the API's problems) exit 1; `rollout status` and `rollout start --wait` exit 0 succeeded, 3 failed, 4 rolled_back, 5 denied or canceled, 6 --timeout elapsed."
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
    /// Artifacts: push a file or directory (a tar archive by digest), list them.
    #[command(subcommand)]
    Artifact(delivery::ArtifactCommand),
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
                ExitCode::from(progress::EXIT_ERROR)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    match run(cli).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("meshctl: {e:#}");
            ExitCode::from(progress::EXIT_ERROR)
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
        Command::Artifact(c) => return delivery::artifact(&api, c).await,
        Command::Revision(c) => return delivery::revision(&api, c).await,
        Command::Module(c) => return delivery::module(&api, c).await,
        Command::Rollout(c) => return delivery::rollout(&api, c).await,
        Command::Run(c) => return delivery::run(&api, c).await,
        Command::Freeze(c) => return delivery::freeze(&api, c).await,
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
        assert_eq!(cli.api, "https://c:7443");
        assert_eq!(cli.token.as_deref(), Some("t"));
        assert!(matches!(
            ok(&["token", "list"]),
            Command::Token(TokenCommand::List)
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
}
