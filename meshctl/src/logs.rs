//! `meshctl logs <module> [--node N] [--tail N] [--follow]`: a module's
//! recent unit output, fetched through the agents by the controller
//! (`GET /v1/modules/{name}/logs`, operator role; decision 0033).
//!
//! Lines a unit wrote to stdout go to stdout, its stderr to stderr, each
//! prefixed `[<node>]` when several nodes answer (`[<node>/<unit>]` when a
//! node runs several units of the module). `--follow` asks again with the
//! cursor of the last answer every `--interval` seconds (at once while a
//! node has more than one answer carries) until Ctrl-C. A node that does
//! not answer is named on stderr; without `--follow` that exits 1 after
//! printing what the others said.

use std::collections::BTreeSet;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use reqwest::{Method, StatusCode};
use serde_json::Value;

use crate::client::{Api, ApiError, urlencode};

#[derive(clap::Args, Debug)]
pub struct LogsArgs {
    /// The module whose units' output to show.
    pub module: String,
    /// Only this node's units.
    #[arg(long)]
    pub node: Option<String>,
    /// Lines per stream of each unit (1 to 1000): the last ones; with
    /// --follow, at most this many per poll.
    #[arg(long, default_value_t = 100)]
    pub tail: u32,
    /// Keep polling for new output (with the cursor) until Ctrl-C.
    #[arg(short, long)]
    pub follow: bool,
    /// Seconds between two polls of --follow.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=60))]
    pub interval: u64,
}

/// The path of one request.
pub fn path(args: &LogsArgs, after: Option<&str>) -> String {
    let mut query = vec![format!("tail={}", args.tail)];
    if let Some(n) = &args.node {
        query.push(format!("node={}", urlencode(n)));
    }
    if let Some(c) = after {
        query.push(format!("after={}", urlencode(c)));
    }
    format!(
        "/v1/modules/{}/logs?{}",
        urlencode(&args.module),
        query.join("&")
    )
}

/// What printing an answer found.
#[derive(Default)]
struct Printed {
    /// Nodes that gave no output, with why.
    missing: Vec<(String, String)>,
    /// A stream has more than this answer carried.
    more: bool,
}

/// Print an answer's lines: stdout lines to `out`, stderr lines to `err`.
fn print(answer: &Value, out: &mut impl std::io::Write, err: &mut impl std::io::Write) -> Printed {
    let mut printed = Printed::default();
    let nodes = answer["nodes"].as_array().cloned().unwrap_or_default();
    let several = nodes.len() > 1;
    for node in &nodes {
        let name = node["node"].as_str().unwrap_or("?");
        let status = node["status"].as_str().unwrap_or("?");
        if status != "ok" {
            let why = node["error"].as_str().unwrap_or(status).to_owned();
            if status == "error" {
                let _ = writeln!(err, "meshctl: {name}: {why}");
            } else {
                printed.missing.push((name.to_owned(), why));
            }
        }
        let units = node["units"].as_array().cloned().unwrap_or_default();
        for unit in &units {
            let unit_name = unit["unit"].as_str().unwrap_or("?");
            let prefix = match (several, units.len() > 1) {
                (_, true) => format!("[{name}/{unit_name}] "),
                (true, false) => format!("[{name}] "),
                (false, false) => String::new(),
            };
            for stream in unit["streams"].as_array().into_iter().flatten() {
                let which = stream["stream"].as_str().unwrap_or("stdout");
                if stream["gap"].as_bool() == Some(true) {
                    let _ = writeln!(
                        err,
                        "meshctl: {name}/{unit_name} {which}: some output was rotated away before it was read"
                    );
                }
                printed.more |= stream["more"].as_bool() == Some(true);
                for line in stream["lines"].as_array().into_iter().flatten() {
                    let line = line.as_str().unwrap_or_default();
                    let _ = if which == "stderr" {
                        writeln!(err, "{prefix}{line}")
                    } else {
                        writeln!(out, "{prefix}{line}")
                    };
                }
            }
        }
    }
    let _ = out.flush();
    printed
}

/// One request: the answer (200, or the 504 that still carries what came).
async fn fetch(api: &Api, path: &str) -> anyhow::Result<(StatusCode, Value)> {
    let (status, bytes) = api.get_any(path).await?;
    if status == StatusCode::OK || status == StatusCode::GATEWAY_TIMEOUT {
        let v: Value = serde_json::from_slice(&bytes)
            .with_context(|| format!("GET {path}: {status}: the answer is not JSON"))?;
        if v["nodes"].is_array() {
            return Ok((status, v));
        }
    }
    Err(ApiError::from_answer(Method::GET, path, status, &bytes).into())
}

pub async fn run(api: &Api, args: LogsArgs) -> anyhow::Result<ExitCode> {
    let (stdout, stderr) = (std::io::stdout(), std::io::stderr());
    let mut cursor: Option<String> = None;
    let mut warned: BTreeSet<String> = BTreeSet::new();
    let mut busy_said = false;
    loop {
        let path = path(&args, cursor.as_deref());
        let answer = match fetch(api, &path).await {
            Ok(a) => Some(a),
            // With --follow, a controller busy or between broker sessions
            // is waited out; every other error ends the command.
            Err(e)
                if args.follow
                    && e.downcast_ref::<ApiError>()
                        .is_some_and(|a| a.status == StatusCode::SERVICE_UNAVAILABLE) =>
            {
                if !busy_said {
                    eprintln!("meshctl: {e}; retrying");
                    busy_said = true;
                }
                None
            }
            Err(e) => return Err(e),
        };
        let mut more = false;
        if let Some((status, v)) = answer {
            busy_said = false;
            let printed = print(&v, &mut stdout.lock(), &mut stderr.lock());
            more = printed.more;
            let now: BTreeSet<String> = printed.missing.iter().map(|(n, _)| n.clone()).collect();
            for (node, why) in &printed.missing {
                if !warned.contains(node) {
                    eprintln!("meshctl: no output from {node}: {why}");
                }
            }
            warned = now;
            if cursor.is_none()
                && let Some(omitted) = v["omitted"].as_array().filter(|o| !o.is_empty())
            {
                eprintln!(
                    "meshctl: {} more node(s) run {} and were not asked (name one with --node)",
                    omitted.len(),
                    args.module
                );
            }
            cursor = v["cursor"].as_str().map(str::to_owned);
            if !args.follow {
                return Ok(if status == StatusCode::OK {
                    ExitCode::SUCCESS
                } else {
                    ExitCode::from(crate::progress::EXIT_ERROR)
                });
            }
        }
        let wait = if more {
            Duration::ZERO
        } else {
            Duration::from_secs(args.interval)
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => return Ok(ExitCode::SUCCESS),
            () = tokio::time::sleep(wait) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn args(node: Option<&str>) -> LogsArgs {
        LogsArgs {
            module: "web".into(),
            node: node.map(str::to_owned),
            tail: 20,
            follow: false,
            interval: 2,
        }
    }

    #[test]
    fn the_path_carries_node_tail_and_cursor() {
        assert_eq!(path(&args(None), None), "/v1/modules/web/logs?tail=20");
        assert_eq!(
            path(&args(Some("node-a")), Some("ab_c-")),
            "/v1/modules/web/logs?tail=20&node=node-a&after=ab_c-"
        );
    }

    #[test]
    fn lines_are_prefixed_only_when_several_nodes_answer() {
        let stream = |which: &str, lines: &[&str]| json!({"stream": which, "lines": lines, "gap": false, "more": false});
        let one = json!({"nodes": [
            {"node": "a", "status": "ok", "units": [{"unit": "web-0", "streams": [stream("stdout", &["hi"]), stream("stderr", &["oops"])]}]}
        ]});
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let p = print(&one, &mut out, &mut err);
        assert_eq!(String::from_utf8(out).unwrap(), "hi\n");
        assert_eq!(String::from_utf8(err).unwrap(), "oops\n");
        assert!(p.missing.is_empty());
        let two = json!({"nodes": [
            {"node": "a", "status": "ok", "units": [{"unit": "web-0", "streams": [stream("stdout", &["one"])]}]},
            {"node": "b", "status": "timeout", "error": "no answer", "units": []}
        ]});
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let p = print(&two, &mut out, &mut err);
        assert_eq!(String::from_utf8(out).unwrap(), "[a] one\n");
        assert_eq!(p.missing, [("b".to_owned(), "no answer".to_owned())]);
    }
}
