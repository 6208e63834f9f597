//! The delivery commands: artifacts, revisions, a module's delivery policy,
//! rollouts (and their live view), runs (approve, deny, receipts) and the
//! freeze.
//!
//! What a script captures is printed alone on stdout (a digest, a revision
//! or rollout id); what a person reads goes to stderr.

use crate::client::{Api, Body, urlencode};
use crate::output::compact_table as table;
use crate::progress::{self, Screen};
use anyhow::{Context as _, bail};
use clap::{Args, Subcommand};
use reqwest::{Method, StatusCode};
use serde_json::{Map, Value, json};
use std::io::{IsTerminal as _, Write as _};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

/// The exit codes of a watched rollout, shown in `--help`.
pub const EXIT_CODES: &str = "\
Exit codes:
  0  the rollout succeeded
  1  usage, transport or API error
  3  the rollout failed
  4  the rollout was rolled back
  5  the rollout was denied or canceled
  6  --timeout elapsed before the rollout ended";

#[derive(Subcommand)]
pub enum ArtifactCommand {
    /// Pack <path> as a tar archive (a directory's contents at its root, or one
    /// file), push it, and print its digest alone on stdout.
    Push {
        /// A directory or a single file.
        path: PathBuf,
    },
    /// List the artifacts the controller has.
    List,
    /// Sign an artifact with a key you hold and upload the signature: a
    /// file or directory (its digest as `push` computes it) or a digest
    /// (`sha256:…`). Prints the digest alone on stdout.
    Sign {
        /// A directory, a single file, or `sha256:…`.
        target: String,
        /// Your private key file (`meshctl key generate`).
        #[arg(long)]
        key: PathBuf,
    },
}

#[derive(Subcommand)]
pub enum RevisionCommand {
    /// Create a revision of <module> and print its id alone on stdout.
    Create(RevisionCreate),
    /// List the revisions of <module>.
    List { module: String },
}

#[derive(Args)]
pub struct RevisionCreate {
    pub module: String,
    /// The whole definition as JSON (`{"artifact","unit","settings_digest"}`); `-` reads stdin.
    #[arg(short = 'f', long = "file", conflicts_with_all = ["artifact", "command", "args", "env", "working_dir", "restart"])]
    pub file: Option<PathBuf>,
    /// The artifact the unit runs from (`sha256:…`, as `artifact push` printed).
    #[arg(long)]
    pub artifact: Option<String>,
    /// The unit's command (relative to the artifact's root, when it has one).
    #[arg(long, required_unless_present = "file")]
    pub command: Option<String>,
    /// One argument of the command (repeat for more, in order).
    #[arg(long = "arg", value_name = "ARG", allow_hyphen_values = true)]
    pub args: Vec<String>,
    /// One environment variable, KEY=VALUE (repeat for more).
    #[arg(long, value_name = "KEY=VALUE", value_parser = parse_env)]
    pub env: Vec<(String, String)>,
    #[arg(long)]
    pub working_dir: Option<String>,
    #[arg(long, value_parser = ["always", "on_failure", "never"], default_value = "always")]
    pub restart: String,
}

fn parse_env(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(format!("`{s}` is not KEY=VALUE")),
    }
}

#[derive(Subcommand)]
pub enum ModuleCommand {
    /// Show, or set with --require-approval, the delivery policy of <module>.
    Delivery {
        module: String,
        /// Whether each rollout of the module waits for an approval.
        #[arg(long, action = clap::ArgAction::Set, value_name = "true|false")]
        require_approval: Option<bool>,
    },
}

/// How a rollout is watched.
#[derive(Args, Clone)]
pub struct Watch {
    /// How often to poll the rollout, in milliseconds.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..))]
    pub interval_ms: u64,
    /// Give up (exit 6) after this many seconds.
    #[arg(long, value_name = "SECS")]
    pub timeout: Option<u64>,
}

#[derive(Subcommand)]
pub enum RolloutCommand {
    /// Start a rollout of <module> to a revision and print its id alone on stdout.
    #[command(after_help = EXIT_CODES)]
    Start {
        module: String,
        /// The revision's id (as `revision create` printed).
        #[arg(long)]
        revision: String,
        /// How many nodes may be down at once.
        #[arg(long)]
        max_unavailable: Option<u64>,
        /// How many extra replicas may run during the rollout.
        #[arg(long)]
        max_extra: Option<u64>,
        /// How long a node must stay healthy before the next step, in seconds.
        #[arg(long = "settle", value_name = "SECS")]
        settle_secs: Option<u64>,
        /// How many failed nodes fail the rollout.
        #[arg(long)]
        failure_threshold: Option<u64>,
        /// Do not roll back automatically when it fails.
        #[arg(long)]
        no_rollback: bool,
        /// Deploy to a canary first: `--canary` is one node, `--canary=N` N nodes.
        #[arg(long, value_name = "N", num_args = 0..=1, require_equals = true, default_missing_value = "1")]
        canary: Option<u64>,
        /// Then watch it as `rollout status` does (and exit as it does).
        #[arg(long)]
        wait: bool,
        #[command(flatten)]
        watch: Watch,
    },
    /// Watch a rollout until it ends; its exit code tells how it ended.
    #[command(after_help = EXIT_CODES)]
    Status {
        id: String,
        #[command(flatten)]
        watch: Watch,
    },
    /// List rollouts.
    List {
        #[arg(long)]
        module: Option<String>,
        /// Only those in this state (running, paused, succeeded, …).
        #[arg(long)]
        state: Option<String>,
    },
    /// Continue a paused rollout.
    Continue { id: String },
    /// Cancel a rollout.
    Cancel { id: String },
}

#[derive(Subcommand)]
pub enum RunCommand {
    /// Approve a run awaiting approval (and so its rollout).
    Approve {
        id: String,
        #[arg(long)]
        reason: Option<String>,
    },
    /// Deny a run awaiting approval (and so its rollout).
    Deny {
        id: String,
        #[arg(long)]
        reason: String,
    },
    /// The receipts of a run: seq, time, kind, detail.
    Receipts { id: String },
}

#[derive(Subcommand)]
pub enum FreezeCommand {
    /// Freeze deliveries: no rollout starts; in-flight ones pause unless --keep-running.
    Set {
        #[arg(long)]
        reason: String,
        /// Let the rollouts in flight go on.
        #[arg(long)]
        keep_running: bool,
    },
    /// Lift the freeze.
    Lift,
    /// Whether deliveries are frozen, since when, by whom, why.
    Status,
}

fn text<'a>(v: &'a Value, k: &str) -> &'a str {
    v.get(k).and_then(Value::as_str).unwrap_or("-")
}

/// Who signed an artifact: the operators' keys by name, and `controller`
/// when it signed at push time.
fn signers(a: &Value) -> String {
    let mut names: Vec<String> = a["signers"]
        .as_array()
        .map(|s| {
            s.iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default();
    if a["signed_by"].is_string() {
        names.push("controller".to_owned());
    }
    if names.is_empty() {
        "-".to_owned()
    } else {
        names.join(",")
    }
}

fn shown(v: &Value, k: &str) -> String {
    match v.get(k) {
        None | Some(Value::Null) => "-".to_owned(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    }
}

fn list<'a>(v: &'a Value, k: &str) -> anyhow::Result<&'a Vec<Value>> {
    v.get(k)
        .and_then(Value::as_array)
        .with_context(|| format!("no `{k}` list in the answer"))
}

/// The body of `POST /v1/modules/{name}/revisions` from the flags.
pub fn revision_body(r: &RevisionCreate) -> anyhow::Result<Value> {
    if let Some(file) = &r.file {
        let raw = if file.as_os_str() == "-" {
            let mut s = String::new();
            std::io::Read::read_to_string(&mut std::io::stdin(), &mut s)
                .context("reading the revision from stdin")?;
            s
        } else {
            std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?
        };
        let v: Value =
            serde_json::from_str(&raw).with_context(|| format!("{}: not JSON", file.display()))?;
        if !v.get("unit").is_some_and(Value::is_object) {
            bail!("{}: no `unit` object", file.display());
        }
        return Ok(v);
    }
    let Some(command) = &r.command else {
        bail!("--command (or -f) is required");
    };
    if let Some(a) = &r.artifact
        && !a.starts_with("sha256:")
    {
        bail!("--artifact `{a}`: an artifact is named `sha256:<hex>`");
    }
    let env: Map<String, Value> = r
        .env
        .iter()
        .map(|(k, v)| (k.clone(), Value::String(v.clone())))
        .collect();
    Ok(json!({
        "artifact": r.artifact,
        "unit": {
            "command": command,
            "args": r.args,
            "env": env,
            "working_dir": r.working_dir,
            "restart": r.restart,
            "probes": [],
        },
        "settings_digest": null,
    }))
}

/// The body of `POST /v1/rollouts`: the options given, the others left to the controller.
#[allow(clippy::too_many_arguments)]
pub fn rollout_body(
    module: &str,
    revision: &str,
    max_unavailable: Option<u64>,
    max_extra: Option<u64>,
    settle_secs: Option<u64>,
    failure_threshold: Option<u64>,
    no_rollback: bool,
    canary: Option<u64>,
) -> Value {
    let mut body = json!({ "module": module, "revision": revision });
    let opts = [
        ("max_unavailable", max_unavailable),
        ("max_extra", max_extra),
        ("settle_secs", settle_secs),
        ("failure_threshold", failure_threshold),
        ("canary", canary),
    ];
    for (k, v) in opts {
        if let Some(v) = v {
            body[k] = json!(v);
        }
    }
    if no_rollback {
        body["auto_rollback"] = json!(false);
    }
    body
}

pub async fn artifact(api: &Api, cmd: ArtifactCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        ArtifactCommand::Push { path } => {
            let archive = crate::pack::pack(&path)?;
            let local = crate::pack::digest(&archive);
            let size = archive.len();
            let (status, v) = api
                .send(Method::POST, "/v1/artifacts", Body::Bytes(archive))
                .await?;
            let remote = text(&v, "digest");
            if remote != local {
                bail!(
                    "the controller named the artifact {remote}, but its archive is {local} here: refusing it"
                );
            }
            let what = if status == StatusCode::CREATED {
                "pushed"
            } else {
                "already known"
            };
            let signed = match v.get("signed_by").and_then(Value::as_str) {
                Some(key) => format!("signed by the controller ({key})"),
                None => {
                    "not signed: nodes run it once an operator signs it (meshctl artifact sign)"
                        .to_owned()
                }
            };
            eprintln!("{what}: {} ({size} bytes), {signed}", path.display());
            println!("{local}");
        }
        ArtifactCommand::Sign { target, key } => {
            return crate::signing::sign(api, &target, &key).await;
        }
        ArtifactCommand::List => {
            let v = api.call(Method::GET, "/v1/artifacts", None).await?;
            let rows: Vec<Vec<String>> = list(&v, "artifacts")?
                .iter()
                .map(|a| {
                    vec![
                        shown(a, "digest"),
                        shown(a, "size"),
                        shown(a, "pushed_at"),
                        shown(a, "pushed_by"),
                        signers(a),
                    ]
                })
                .collect();
            print!(
                "{}",
                table(
                    &["DIGEST", "SIZE", "PUSHED_AT", "PUSHED_BY", "SIGNED_BY"],
                    &rows
                )
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn revision(api: &Api, cmd: RevisionCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        RevisionCommand::Create(r) => {
            let body = revision_body(&r)?;
            let path = format!("/v1/modules/{}/revisions", urlencode(&r.module));
            let (status, v) = api.send(Method::POST, &path, Body::Json(body)).await?;
            let id = v
                .get("id")
                .and_then(Value::as_str)
                .context("no id in the answer")?;
            let what = if status == StatusCode::CREATED {
                "created"
            } else {
                "already known"
            };
            eprintln!(
                "revision of {} {what}, digest {}",
                r.module,
                text(&v, "digest")
            );
            println!("{id}");
        }
        RevisionCommand::List { module } => {
            let path = format!("/v1/modules/{}/revisions", urlencode(&module));
            let v = api.call(Method::GET, &path, None).await?;
            let rows: Vec<Vec<String>> = list(&v, "revisions")?
                .iter()
                .map(|r| {
                    let unit = r.get("unit").cloned().unwrap_or(Value::Null);
                    vec![
                        shown(r, "id"),
                        shown(r, "created_at"),
                        shown(r, "created_by"),
                        shown(r, "artifact"),
                        shown(&unit, "command"),
                    ]
                })
                .collect();
            print!(
                "{}",
                table(
                    &["ID", "CREATED_AT", "CREATED_BY", "ARTIFACT", "COMMAND"],
                    &rows
                )
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn module(api: &Api, cmd: ModuleCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        ModuleCommand::Delivery {
            module,
            require_approval,
        } => {
            let path = format!("/v1/modules/{}/delivery", urlencode(&module));
            let v = match require_approval {
                Some(b) => {
                    api.call(Method::PUT, &path, Some(json!({ "require_approval": b })))
                        .await?
                }
                None => api.call(Method::GET, &path, None).await?,
            };
            println!("{}", serde_json::to_string_pretty(&v)?);
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// One line about a rollout, for `continue`, `cancel` and `list`.
fn rollout_row(r: &Value) -> Vec<String> {
    vec![
        shown(r, "id"),
        shown(r, "module"),
        shown(r, "state"),
        format!("{}/{}", shown(r, "step"), shown(r, "steps")),
        format!("{}/{}", shown(r, "nodes_done"), shown(r, "nodes_total")),
        shown(r, "created_at"),
        shown(r, "revision"),
    ]
}

const ROLLOUT_HEADER: [&str; 7] = [
    "ID",
    "MODULE",
    "STATE",
    "STEP",
    "NODES",
    "CREATED_AT",
    "REVISION",
];

pub async fn rollout(api: &Api, cmd: RolloutCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        RolloutCommand::Start {
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
        } => {
            let body = rollout_body(
                &module,
                &revision,
                max_unavailable,
                max_extra,
                settle_secs,
                failure_threshold,
                no_rollback,
                canary,
            );
            let v = api.call(Method::POST, "/v1/rollouts", Some(body)).await?;
            let id = v
                .get("id")
                .and_then(Value::as_str)
                .context("no id in the answer")?
                .to_owned();
            eprintln!("rollout of {module} started: {}", text(&v, "state"));
            println!("{id}");
            if wait {
                return status(api, &id, &watch).await;
            }
        }
        RolloutCommand::Status { id, watch } => return status(api, &id, &watch).await,
        RolloutCommand::List { module, state } => {
            let mut query = Vec::new();
            if let Some(m) = module {
                query.push(format!("module={}", urlencode(&m)));
            }
            if let Some(s) = state {
                query.push(format!("state={}", urlencode(&s)));
            }
            let path = if query.is_empty() {
                "/v1/rollouts".to_owned()
            } else {
                format!("/v1/rollouts?{}", query.join("&"))
            };
            let v = api.call(Method::GET, &path, None).await?;
            let rows: Vec<Vec<String>> = list(&v, "rollouts")?.iter().map(rollout_row).collect();
            print!("{}", table(&ROLLOUT_HEADER, &rows));
        }
        RolloutCommand::Continue { id } => {
            let path = format!("/v1/rollouts/{}/continue", urlencode(&id));
            let v = api.call(Method::POST, &path, Some(json!({}))).await?;
            print!("{}", table(&ROLLOUT_HEADER, &[rollout_row(&v)]));
        }
        RolloutCommand::Cancel { id } => {
            let path = format!("/v1/rollouts/{}/cancel", urlencode(&id));
            let v = api.call(Method::POST, &path, Some(json!({}))).await?;
            print!("{}", table(&ROLLOUT_HEADER, &[rollout_row(&v)]));
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The live view of rollout `id` until it ends (or `--timeout`): its exit
/// code tells how it ended.
pub async fn status(api: &Api, id: &str, watch: &Watch) -> anyhow::Result<ExitCode> {
    let path = format!("/v1/rollouts/{}", urlencode(id));
    let mut screen = Screen::new(std::io::stdout().is_terminal());
    let deadline = watch
        .timeout
        .map(|s| tokio::time::Instant::now() + Duration::from_secs(s));
    let interval = Duration::from_millis(watch.interval_ms);
    loop {
        let v = api.call(Method::GET, &path, None).await?;
        let frame = screen.frame(progress::render(&v));
        let mut out = std::io::stdout().lock();
        out.write_all(frame.as_bytes())?;
        out.flush()?;
        drop(out);
        let state = v.get("state").and_then(Value::as_str).unwrap_or("");
        if let Some(code) = progress::exit_code(state) {
            if code != progress::EXIT_SUCCEEDED {
                eprintln!("rollout {id} ended {state}");
            }
            return Ok(ExitCode::from(code));
        }
        let mut next = tokio::time::Instant::now() + interval;
        if let Some(d) = deadline {
            if tokio::time::Instant::now() >= d {
                eprintln!("rollout {id}: still {state} after --timeout; it goes on");
                return Ok(ExitCode::from(progress::EXIT_TIMEOUT));
            }
            next = next.min(d);
        }
        tokio::time::sleep_until(next).await;
    }
}

pub async fn run(api: &Api, cmd: RunCommand) -> anyhow::Result<ExitCode> {
    let (path, body) = match cmd {
        RunCommand::Approve { id, reason } => (
            format!("/v1/runs/{}/approve", urlencode(&id)),
            match reason {
                Some(r) => json!({ "reason": r }),
                None => json!({}),
            },
        ),
        RunCommand::Deny { id, reason } => {
            if reason.trim().is_empty() {
                bail!("--reason must say why");
            }
            (
                format!("/v1/runs/{}/deny", urlencode(&id)),
                json!({ "reason": reason }),
            )
        }
        RunCommand::Receipts { id } => {
            let path = format!("/v1/runs/{}/receipts", urlencode(&id));
            let v = api.call(Method::GET, &path, None).await?;
            print!("{}", receipts_table(&v)?);
            return Ok(ExitCode::SUCCESS);
        }
    };
    let v = api.call(Method::POST, &path, Some(body)).await?;
    println!(
        "run {} on {}: {}",
        text(&v, "id"),
        text(&v, "node"),
        text(&v, "state")
    );
    Ok(ExitCode::SUCCESS)
}

/// The receipts of a run as a table: seq, time, kind, detail (compact JSON).
pub fn receipts_table(v: &Value) -> anyhow::Result<String> {
    let rows: Vec<Vec<String>> = list(v, "receipts")?
        .iter()
        .map(|r| {
            let detail = match r.get("detail") {
                None | Some(Value::Null) => "-".to_owned(),
                Some(d) if d.as_object().is_some_and(Map::is_empty) => "-".to_owned(),
                Some(d) => d.to_string(),
            };
            vec![shown(r, "seq"), shown(r, "at"), shown(r, "kind"), detail]
        })
        .collect();
    Ok(table(&["SEQ", "TIME", "KIND", "DETAIL"], &rows))
}

fn freeze_line(v: &Value) -> String {
    if v.get("frozen").and_then(Value::as_bool) == Some(true) {
        let in_flight = if v.get("pause_in_flight").and_then(Value::as_bool) == Some(true) {
            "rollouts in flight are paused"
        } else {
            "rollouts in flight go on"
        };
        format!(
            "frozen since {} by {}: {} ({in_flight})",
            text(v, "since"),
            text(v, "by"),
            text(v, "reason")
        )
    } else {
        "not frozen".to_owned()
    }
}

pub async fn freeze(api: &Api, cmd: FreezeCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        FreezeCommand::Set {
            reason,
            keep_running,
        } => {
            if reason.trim().is_empty() {
                bail!("--reason must say why");
            }
            let body = json!({ "reason": reason, "pause_in_flight": !keep_running });
            let v = api.call(Method::PUT, "/v1/freeze", Some(body)).await?;
            println!("{}", freeze_line(&v));
        }
        FreezeCommand::Lift => {
            api.call(Method::DELETE, "/v1/freeze", None).await?;
            eprintln!("freeze lifted");
        }
        FreezeCommand::Status => {
            let v = api.call(Method::GET, "/v1/freeze", None).await?;
            println!("{}", freeze_line(&v));
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_pad_every_column_but_the_last() {
        let t = table(
            &["SEQ", "KIND"],
            &[
                vec!["1".into(), "run.queued".into()],
                vec!["10".into(), "x".into()],
            ],
        );
        assert_eq!(t, "SEQ  KIND\n1    run.queued\n10   x\n");
    }

    #[test]
    fn receipts_render_as_a_table() {
        let v = json!({"run": "u", "receipts": [
            {"seq": 1, "kind": "run.queued", "at": "2026-12-02T06:00:00Z", "detail": {}},
            {"seq": 2, "kind": "run.started", "at": "2026-12-02T06:00:01Z", "detail": {"pid": 42}}
        ]});
        assert_eq!(
            receipts_table(&v).unwrap(),
            "SEQ  TIME                  KIND         DETAIL\n\
             1    2026-12-02T06:00:00Z  run.queued   -\n\
             2    2026-12-02T06:00:01Z  run.started  {\"pid\":42}\n"
        );
        assert!(receipts_table(&json!({})).is_err());
    }

    #[test]
    fn freeze_lines() {
        assert_eq!(freeze_line(&json!({"frozen": false})), "not frozen");
        assert_eq!(
            freeze_line(
                &json!({"frozen": true, "reason": "release", "since": "t", "by": "ops", "pause_in_flight": true})
            ),
            "frozen since t by ops: release (rollouts in flight are paused)"
        );
    }

    #[test]
    fn rollout_bodies_carry_only_what_was_given() {
        assert_eq!(
            rollout_body("web", "r", None, None, None, None, false, None),
            json!({"module": "web", "revision": "r"})
        );
        assert_eq!(
            rollout_body(
                "web",
                "r",
                Some(2),
                Some(1),
                Some(30),
                Some(3),
                true,
                Some(1)
            ),
            json!({"module": "web", "revision": "r", "max_unavailable": 2, "max_extra": 1,
                   "settle_secs": 30, "failure_threshold": 3, "canary": 1, "auto_rollback": false})
        );
    }
}
