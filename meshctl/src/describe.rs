//! `meshctl describe node|module|run|grant` (one screen per resource: what it
//! is, what was declared and applied, its units or replicas with their
//! health, its recent events or receipts; a grant's provider nodes and
//! retention) and `meshctl status` (the fleet on a few lines).

use crate::client::{Api, urlencode};
use crate::events::{self, Filters};
use crate::output::{self, Format, age, labels, s};
use crate::resources::{self, Kind};
use anyhow::bail;
use chrono::{DateTime, Utc};
use clap::ValueEnum;
use reqwest::Method;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// What `describe` shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DescribeKind {
    #[value(alias = "nodes", alias = "no")]
    Node,
    #[value(alias = "modules", alias = "mod")]
    Module,
    #[value(alias = "runs")]
    Run,
    #[value(alias = "grants")]
    Grant,
}

/// How many recent events `describe` shows.
const RECENT_EVENTS: usize = 10;

/// `meshctl describe`.
pub async fn describe(
    api: &Api,
    kind: DescribeKind,
    name: &str,
    format: Option<Format>,
) -> anyhow::Result<()> {
    let id = urlencode(name);
    let (object, text) = match kind {
        DescribeKind::Node => {
            let node = api
                .call(Method::GET, &format!("/v1/nodes/{id}"), None)
                .await?;
            let recent = recent(
                api,
                Filters {
                    node: Some(name.to_owned()),
                    ..Filters::default()
                },
            )
            .await;
            let text = node_text(&node, &recent);
            (
                json!({ "node": node, "events": events_json(&recent) }),
                text,
            )
        }
        DescribeKind::Module => {
            let module = api
                .call(Method::GET, &format!("/v1/modules/{id}"), None)
                .await?;
            let recent = recent(
                api,
                Filters {
                    module: Some(name.to_owned()),
                    ..Filters::default()
                },
            )
            .await;
            let text = module_text(&module, &recent);
            (
                json!({ "module": module, "events": events_json(&recent) }),
                text,
            )
        }
        DescribeKind::Run => {
            let run = api
                .call(Method::GET, &format!("/v1/runs/{id}"), None)
                .await?;
            let receipts = api
                .call(Method::GET, &format!("/v1/runs/{id}/receipts"), None)
                .await?;
            let text = run_text(&run, &receipts)?;
            (
                json!({ "run": run, "receipts": receipts["receipts"] }),
                text,
            )
        }
        DescribeKind::Grant => {
            let id = resolve_grant(api, name).await?;
            let grant = api
                .call(Method::GET, &format!("/v1/grants/{}", urlencode(&id)), None)
                .await?;
            let text = grant_text(&grant, Utc::now());
            (json!({ "grant": grant }), text)
        }
    };
    match format {
        Some(f @ (Format::Json | Format::Yaml)) => print!("{}", output::encode(f, &object)?),
        _ => print!("{text}"),
    }
    Ok(())
}

/// Recent events, or the reason there are none to show.
async fn recent(api: &Api, filters: Filters) -> Result<Vec<events::SseEvent>, String> {
    events::recent(api, filters, RECENT_EVENTS)
        .await
        .map_err(|e| format!("{e:#}"))
}

fn events_json(recent: &Result<Vec<events::SseEvent>, String>) -> Value {
    match recent {
        Ok(evs) => Value::Array(
            evs.iter()
                .map(|e| serde_json::from_str(&e.data).unwrap_or(Value::Null))
                .collect(),
        ),
        Err(_) => Value::Null,
    }
}

fn events_text(out: &mut String, recent: &Result<Vec<events::SseEvent>, String>) {
    out.push_str("Recent events:\n");
    match recent {
        Ok(evs) if evs.is_empty() => out.push_str("  (none kept)\n"),
        Ok(evs) => {
            for e in evs {
                let _ = writeln!(out, "  {}", events::line(e).trim_start());
            }
        }
        Err(e) => {
            let _ = writeln!(out, "  (unavailable: {e})");
        }
    }
}

/// Indents a table by two spaces.
fn indent(table: &str) -> String {
    table.lines().map(|l| format!("  {l}\n")).collect()
}

pub fn node_text(n: &Value, recent: &Result<Vec<events::SseEvent>, String>) -> String {
    let now = Utc::now();
    let mut out = String::new();
    let _ = writeln!(out, "Name:          {}", s(n, "id"));
    let _ = writeln!(out, "Hostname:      {}", s(n, "hostname"));
    let mut state = format!(
        "{} (liveness {}, admin {})",
        s(n, "state"),
        s(n, "liveness"),
        s(n, "admin_state")
    );
    if let Some(b) = n["drain_blocked"].as_str() {
        let _ = write!(state, "; drain blocked: {b}");
    }
    if let Some(r) = n["refused"].as_str() {
        let _ = write!(state, "; refused: {r}");
    }
    let _ = writeln!(out, "State:         {state}");
    if let Some(since) = n["unreachable_since"].as_str() {
        let _ = writeln!(
            out,
            "Unreachable:   since {since} ({} ago)",
            age(Some(since), now)
        );
    }
    let _ = writeln!(
        out,
        "Last seen:     {} ({} ago), first seen {}",
        s(n, "last_seen"),
        age(n["last_seen"].as_str(), now),
        s(n, "first_seen")
    );
    let _ = writeln!(
        out,
        "Agent:         {} on {}, {} cpus, {} MiB",
        s(n, "agent_version"),
        s(n, "arch"),
        s(n, "cpus"),
        n["memory_bytes"]
            .as_i64()
            .map_or("-".into(), |b| (b >> 20).to_string())
    );
    let _ = writeln!(
        out,
        "Labels:        {}",
        labels(n["labels"].get("effective"))
    );
    let _ = writeln!(
        out,
        "  stated:      {} (what the node says; selects nothing unless trusted)",
        labels(n["labels"].get("reported"))
    );
    let _ = writeln!(
        out,
        "  operator:    {}",
        labels(n["labels"].get("operator"))
    );
    out.push_str("Sections (declared vs applied):\n");
    let rows: Vec<Vec<String>> = n["sections"]
        .as_object()
        .map(|m| {
            m.iter()
                .map(|(name, sec)| {
                    let declared = sec["declared"].as_i64();
                    let applied = sec["applied"].as_i64();
                    let verdict = match (declared, applied) {
                        (None, _) => "nothing declared",
                        (Some(d), Some(a)) if a >= d => "in sync",
                        (Some(_), _) => "behind",
                    };
                    vec![
                        name.clone(),
                        s(sec, "declared"),
                        s(sec, "applied"),
                        verdict.to_owned(),
                        s(sec, "outcome"),
                        s(sec, "error"),
                    ]
                })
                .collect()
        })
        .unwrap_or_default();
    out.push_str(&indent(&output::table(
        &["SECTION", "DECLARED", "APPLIED", "", "OUTCOME", "ERROR"],
        &rows,
    )));
    // Health of each replica on the node, by unit name.
    let health: BTreeMap<String, &Value> = n["health"]["replicas"]
        .as_array()
        .map(|r| r.iter().map(|x| (s(x, "unit"), x)).collect())
        .unwrap_or_default();
    out.push_str("Units:\n");
    let units: Vec<Vec<String>> = n["units"]
        .as_array()
        .map(|u| {
            u.iter()
                .map(|x| {
                    let h = health.get(&s(x, "name"));
                    vec![
                        s(x, "name"),
                        s(x, "module"),
                        s(x, "role"),
                        s(x, "unit_state"),
                        s(x, "restarts"),
                        h.map_or("-".into(), |h| s(h, "health")),
                        h.map_or("-".into(), |h| s(h, "reason")),
                    ]
                })
                .collect()
        })
        .unwrap_or_default();
    if units.is_empty() {
        out.push_str("  (none)\n");
    } else {
        out.push_str(&indent(&output::table(
            &[
                "UNIT", "MODULE", "ROLE", "STATE", "RESTARTS", "HEALTH", "REASON",
            ],
            &units,
        )));
    }
    let _ = writeln!(
        out,
        "Health:        {}",
        n["health"].get("health").map_or("-".into(), |h| match h {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        })
    );
    events_text(&mut out, recent);
    out
}

pub fn module_text(m: &Value, recent: &Result<Vec<events::SseEvent>, String>) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "Name:          {}", s(m, "name"));
    let unit = &m["unit"];
    let args: Vec<String> = unit["args"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|x| x.as_str().unwrap_or("").to_owned())
                .collect()
        })
        .unwrap_or_default();
    let _ = writeln!(
        out,
        "Command:       {}{}{}",
        s(unit, "command"),
        if args.is_empty() { "" } else { " " },
        args.join(" ")
    );
    let _ = writeln!(
        out,
        "Spec:          restart {}, desired {}, stateful {}, revision {}",
        s(unit, "restart"),
        s(m, "desired"),
        s(m, "stateful"),
        s(m, "revision")
    );
    let resources = &unit["resources"];
    let limit = |key: &str| match resources.get(key).and_then(Value::as_u64) {
        None | Some(0) => "none".to_owned(),
        Some(n) => n.to_string(),
    };
    let _ = writeln!(
        out,
        "Box:           user {}, cpu_millis {}, memory_bytes {}, pids {}",
        unit["user"].as_str().unwrap_or("module"),
        limit("cpu_millis"),
        limit("memory_bytes"),
        limit("pids")
    );
    let _ = writeln!(
        out,
        "Placement:     {}",
        m.get("placement").map_or("-".into(), Value::to_string)
    );
    let _ = writeln!(
        out,
        "Replicas:      {} effective (intent {})",
        s(m, "effective_replicas"),
        m.get("intent").map_or("-".into(), Value::to_string)
    );
    if let Some(e) = m["placement_error"].as_str() {
        let _ = writeln!(out, "Placement error: {e}");
    }
    let _ = writeln!(
        out,
        "Health:        {}",
        m["health"]
            .get("health")
            .and_then(Value::as_str)
            .unwrap_or("-")
    );
    let health: BTreeMap<(String, String), &Value> = m["health"]["replicas"]
        .as_array()
        .map(|r| {
            r.iter()
                .map(|x| ((s(x, "node"), s(x, "unit")), x))
                .collect()
        })
        .unwrap_or_default();
    out.push_str("Replicas:\n");
    let rows: Vec<Vec<String>> = m["assignments"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|x| {
                    let h = health.get(&(s(x, "node"), s(x, "name")));
                    vec![
                        s(x, "replica"),
                        s(x, "node"),
                        s(x, "name"),
                        s(x, "role"),
                        s(x, "unit_state"),
                        s(x, "restarts"),
                        h.map_or("-".into(), |h| s(h, "health")),
                        s(x, "uid"),
                        s(x, "oom_kills"),
                        s(x, "reason"),
                        s(x, "data_bytes"),
                        s(x, "revision"),
                    ]
                })
                .collect()
        })
        .unwrap_or_default();
    if rows.is_empty() {
        out.push_str("  (none placed)\n");
    } else {
        out.push_str(&indent(&output::table(
            &[
                "REPLICA",
                "NODE",
                "UNIT",
                "ROLE",
                "STATE",
                "RESTARTS",
                "HEALTH",
                "UID",
                "OOM KILLS",
                "REASON",
                "DATA BYTES",
                "REVISION",
            ],
            &rows,
        )));
    }
    events_text(&mut out, recent);
    out
}

pub fn run_text(r: &Value, receipts: &Value) -> anyhow::Result<String> {
    let mut out = String::new();
    let _ = writeln!(out, "Run:           {}", s(r, "id"));
    let _ = writeln!(
        out,
        "Rollout:       {} (module {}, step {})",
        s(r, "rollout"),
        s(r, "module"),
        s(r, "step")
    );
    let _ = writeln!(out, "Node:          {}", s(r, "node"));
    let _ = writeln!(out, "State:         {}", s(r, "state"));
    if let Some(reason) = r["reason"].as_str() {
        let _ = writeln!(out, "Reason:        {reason}");
    }
    let _ = writeln!(
        out,
        "Revision:      {} (previous {})",
        s(r, "revision"),
        s(r, "previous_revision")
    );
    let _ = writeln!(out, "Updated:       {}", s(r, "updated_at"));
    out.push_str("Receipts:\n");
    out.push_str(&indent(&crate::delivery::receipts_table(receipts)?));
    Ok(out)
}

/// How `describe grant` names a grant.
#[derive(Debug, PartialEq, Eq)]
pub enum GrantRef {
    /// A whole id: asked for directly.
    Id(String),
    /// The start of an id (lower case): it must be the start of exactly one.
    Prefix(String),
    /// `consumer/requirement`.
    Pair {
        consumer: String,
        requirement: String,
    },
}

/// Whether `s` is a whole UUID (8-4-4-4-12 hex digits).
fn is_uuid(s: &str) -> bool {
    let groups: Vec<&str> = s.split('-').collect();
    groups.len() == 5
        && groups
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(g, n)| g.len() == n && g.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Reads `describe grant`'s argument.
pub fn grant_ref(arg: &str) -> anyhow::Result<GrantRef> {
    if let Some((consumer, requirement)) = arg.split_once('/') {
        if consumer.is_empty() || requirement.is_empty() || requirement.contains('/') {
            bail!(
                "grant `{arg}`: consumer/requirement is a module's name and one of its requirements, e.g. app/db"
            );
        }
        return Ok(GrantRef::Pair {
            consumer: consumer.to_owned(),
            requirement: requirement.to_owned(),
        });
    }
    let lower = arg.to_ascii_lowercase();
    if lower.is_empty() || !lower.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-') {
        bail!(
            "grant `{arg}`: give a grant's id (or the start of one) or consumer/requirement (`meshctl get grants -o wide` shows both)"
        );
    }
    Ok(if is_uuid(&lower) {
        GrantRef::Id(lower)
    } else {
        GrantRef::Prefix(lower)
    })
}

/// How many candidates an ambiguity names before `and N more`.
const CANDIDATES_SHOWN: usize = 10;

/// `id  consumer/requirement  state` of each candidate, indented.
fn candidates(grants: &[&Value]) -> String {
    let mut out = String::new();
    for g in grants.iter().take(CANDIDATES_SHOWN) {
        let _ = write!(
            out,
            "\n  {}   {}/{}   {}",
            s(g, "id"),
            s(g, "consumer"),
            s(g, "requirement"),
            s(g, "state")
        );
    }
    if grants.len() > CANDIDATES_SHOWN {
        let _ = write!(out, "\n  and {} more", grants.len() - CANDIDATES_SHOWN);
    }
    out
}

/// The id of the one grant among `grants` that `r` names (a [`GrantRef::Id`]
/// is its own answer); none or several is an error that says which.
pub fn pick_grant(r: &GrantRef, grants: &[Value]) -> anyhow::Result<String> {
    match r {
        GrantRef::Id(id) => Ok(id.clone()),
        GrantRef::Prefix(prefix) => {
            let found: Vec<&Value> = grants
                .iter()
                .filter(|g| {
                    g.get("id")
                        .and_then(Value::as_str)
                        .is_some_and(|id| id.to_ascii_lowercase().starts_with(prefix.as_str()))
                })
                .collect();
            match found.as_slice() {
                [] => bail!(
                    "no grant's id starts with `{prefix}` (`meshctl get grants -o wide` lists them)"
                ),
                [one] => Ok(s(one, "id")),
                many => bail!(
                    "`{prefix}` starts the ids of {} grants; give more of the id:{}",
                    many.len(),
                    candidates(many)
                ),
            }
        }
        GrantRef::Pair {
            consumer,
            requirement,
        } => {
            let found: Vec<&Value> = grants
                .iter()
                .filter(|g| {
                    g.get("consumer").and_then(Value::as_str) == Some(consumer.as_str())
                        && g.get("requirement").and_then(Value::as_str)
                            == Some(requirement.as_str())
                })
                .collect();
            // A requirement removed and declared again leaves its revoked
            // grant beside the live one: the live one is meant.
            let live: Vec<&Value> = found
                .iter()
                .copied()
                .filter(|g| g.get("state").and_then(Value::as_str) != Some("revoked"))
                .collect();
            match (found.as_slice(), live.as_slice()) {
                ([], _) => bail!(
                    "no grant for module `{consumer}`'s requirement `{requirement}` (`meshctl get grants --module {consumer}` lists its grants)"
                ),
                ([one], _) | (_, [one]) => Ok(s(one, "id")),
                (many, _) => bail!(
                    "{} grants for `{consumer}/{requirement}`; give the id of one:{}",
                    many.len(),
                    candidates(many)
                ),
            }
        }
    }
}

/// The id of the grant `arg` names: a whole id as it is, otherwise read
/// from the list (a consumer's grants, or every grant for an id's start).
async fn resolve_grant(api: &Api, arg: &str) -> anyhow::Result<String> {
    let r = grant_ref(arg)?;
    let query = match &r {
        GrantRef::Id(id) => return Ok(id.clone()),
        GrantRef::Prefix(_) => vec!["limit=500".to_owned()],
        GrantRef::Pair { consumer, .. } => {
            vec![
                format!("module={}", urlencode(consumer)),
                "limit=500".to_owned(),
            ]
        }
    };
    let (grants, _) = resources::list(api, Kind::Grants, &query).await?;
    pick_grant(&r, &grants)
}

/// When `at` (RFC 3339) is, from `now`: `in 3d`, or `2h ago`. A time that
/// can only be past (`future` false) is never `in`: a controller's clock a
/// little ahead of this one's makes it `0s ago`.
fn when(at: &str, now: DateTime<Utc>, future: bool) -> String {
    match DateTime::parse_from_rfc3339(at) {
        Ok(t) => {
            let secs = (t.with_timezone(&Utc) - now).num_seconds();
            if future && secs > 0 {
                format!("in {}", output::duration(secs))
            } else {
                format!("{} ago", output::duration((-secs).max(0)))
            }
        }
        Err(_) => "unreadable time".to_owned(),
    }
}

/// A time field with how far it is from now, `None` when absent or null.
fn at(v: &Value, key: &str, now: DateTime<Utc>, future: bool) -> Option<String> {
    match v.get(key)? {
        Value::Null => None,
        Value::String(t) => Some(format!("{t} ({})", when(t, now, future))),
        other => Some(other.to_string()),
    }
}

/// A grant's options as `k=v, k=v` (`-` when none).
fn options(v: Option<&Value>) -> String {
    match v {
        Some(Value::Object(m)) if !m.is_empty() => m
            .iter()
            .map(|(k, v)| match v {
                Value::String(s) => format!("{k}={s}"),
                other => format!("{k}={other}"),
            })
            .collect::<Vec<_>>()
            .join(", "),
        None | Some(Value::Null) | Some(Value::Object(_)) => "-".to_owned(),
        Some(other) => other.to_string(),
    }
}

/// One grant on one screen. Read leniently: a field this meshctl does not
/// know is not shown (`-o json` shows everything), a missing one is `-`.
pub fn grant_text(g: &Value, now: DateTime<Utc>) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "Grant:          {}", s(g, "id"));
    let _ = writeln!(
        out,
        "Consumer:       {} (requirement {})",
        s(g, "consumer"),
        s(g, "requirement")
    );
    let _ = writeln!(out, "Kind:           {}", s(g, "kind"));
    let provider = match g.get("provider") {
        None | Some(Value::Null) => "none chosen yet".to_owned(),
        Some(_) => s(g, "provider"),
    };
    let _ = writeln!(out, "Provider:       {provider}");
    let _ = writeln!(out, "Resource:       {}", s(g, "resource"));
    let user = match g.get("user") {
        None | Some(Value::Null) => "none issued yet".to_owned(),
        Some(_) => s(g, "user"),
    };
    let _ = writeln!(out, "User:           {user}");
    let _ = writeln!(out, "Options:        {}", options(g.get("options")));
    let _ = writeln!(out, "State:          {}", s(g, "state"));
    if let Some(reason) = g.get("reason").filter(|r| !r.is_null()) {
        let reason = match reason {
            Value::String(r) => r.clone(),
            other => other.to_string(),
        };
        let _ = writeln!(out, "Reason:         {reason}");
    }
    let version = g.get("credential_version").and_then(Value::as_i64);
    let credential = match version {
        Some(0) => "none issued yet".to_owned(),
        Some(v) => format!("version {v}"),
        None => s(g, "credential_version"),
    };
    let _ = writeln!(out, "Credential:     {credential}");
    let _ = writeln!(
        out,
        "  file:         {} (on the consumer's nodes)",
        s(g, "credential_file")
    );
    let names = |key: &str| -> String {
        g.get(key)
            .and_then(Value::as_array)
            .filter(|a| !a.is_empty())
            .map_or("-".to_owned(), |a| {
                a.iter()
                    .map(|n| match n {
                        Value::String(n) => n.clone(),
                        other => other.to_string(),
                    })
                    .collect::<Vec<_>>()
                    .join(", ")
            })
    };
    let _ = writeln!(out, "Consumer nodes: {}", names("consumer_nodes"));
    out.push_str("Provider nodes:\n");
    let rows: Vec<Vec<String>> = g
        .get("provider_nodes")
        .and_then(Value::as_array)
        .map(|nodes| {
            nodes
                .iter()
                .map(|n| {
                    let mut v = s(n, "credential_version");
                    if let (Some(theirs), Some(current)) =
                        (n.get("credential_version").and_then(Value::as_i64), version)
                        && theirs < current
                    {
                        let _ = write!(v, " (behind {current})");
                    }
                    vec![
                        s(n, "node"),
                        s(n, "state"),
                        v,
                        age(n.get("reported_at").and_then(Value::as_str), now),
                        resources::one_line(&s(n, "reason")),
                    ]
                })
                .collect()
        })
        .unwrap_or_default();
    if rows.is_empty() {
        out.push_str("  (none reported)\n");
    } else {
        out.push_str(&indent(&output::table(
            &["NODE", "STATE", "VERSION", "REPORTED", "REASON"],
            &rows,
        )));
    }
    for (label, key) in [
        ("Created:        ", "created_at"),
        ("Updated:        ", "updated_at"),
        ("Revoked:        ", "revoked_at"),
    ] {
        if let Some(t) = at(g, key, now, false) {
            let _ = writeln!(out, "{label}{t}");
        } else if key != "revoked_at" {
            let _ = writeln!(out, "{label}-");
        }
    }
    let delete = g.get("delete").and_then(Value::as_bool);
    let retention = match (at(g, "retain_until", now, true), delete) {
        (Some(t), _) => format!("the data is kept until {t}"),
        (None, Some(true)) => "delete: true, the data is deleted when the grant is revoked".into(),
        (None, _) if g.get("revoked_at").is_some_and(|r| !r.is_null()) => {
            "the data is kept (no deletion time given)".into()
        }
        (None, _) => "the data is kept for the retention once the grant is revoked".into(),
    };
    let _ = writeln!(out, "Retention:      {retention}");
    out
}

/// The fleet in numbers, from several lists.
pub async fn status(api: &Api, format: Option<Format>) -> anyhow::Result<()> {
    let (nodes, first) = resources::list(api, Kind::Nodes, &[]).await?;
    let health = api.call(Method::GET, "/v1/health", None).await?;
    let (alerts, _) = resources::list(api, Kind::Alerts, &[]).await?;
    let rollouts = api.call(Method::GET, "/v1/rollouts", None).await?;
    let summary = summarize(&nodes, &first["heartbeat"], &health, &alerts, &rollouts);
    match format {
        Some(f @ (Format::Json | Format::Yaml)) => print!("{}", output::encode(f, &summary)?),
        _ => print!("{}", status_text(&summary)),
    }
    Ok(())
}

/// Counts by a string field.
fn count_by<'a>(items: impl Iterator<Item = &'a Value>, key: &str) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for v in items {
        *out.entry(s(v, key)).or_insert(0) += 1;
    }
    out
}

/// The fleet's summary as an object (what `-o json` prints).
pub fn summarize(
    nodes: &[Value],
    heartbeat: &Value,
    health: &Value,
    alerts: &[Value],
    rollouts: &Value,
) -> Value {
    let modules = health["modules"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    let in_progress: Vec<Value> = rollouts["rollouts"]
        .as_array()
        .map(|r| {
            r.iter()
                .filter(|x| {
                    matches!(
                        x["state"].as_str(),
                        Some("running" | "paused" | "awaiting_approval")
                    )
                })
                .map(|x| {
                    json!({
                        "id": x["id"], "module": x["module"], "state": x["state"],
                        "nodes_done": x["nodes_done"], "nodes_total": x["nodes_total"],
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    json!({
        "nodes": { "total": nodes.len(), "by_state": count_by(nodes.iter(), "state") },
        "modules": { "total": modules.len(), "by_health": count_by(modules.iter(), "health") },
        "alerts": { "open": alerts.len(), "by_severity": count_by(alerts.iter(), "severity") },
        "rollouts_in_progress": in_progress,
        "heartbeat": heartbeat,
    })
}

pub fn status_text(v: &Value) -> String {
    let counts = |m: &Value| -> String {
        m.as_object()
            .filter(|m| !m.is_empty())
            .map(|m| {
                m.iter()
                    .map(|(k, n)| format!("{n} {k}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .unwrap_or_else(|| "none".into())
    };
    let mut out = String::new();
    let _ = writeln!(
        out,
        "Nodes:      {} ({})",
        v["nodes"]["total"],
        counts(&v["nodes"]["by_state"])
    );
    let _ = writeln!(
        out,
        "Modules:    {} ({})",
        v["modules"]["total"],
        counts(&v["modules"]["by_health"])
    );
    let _ = writeln!(
        out,
        "Alerts:     {} open ({})",
        v["alerts"]["open"],
        counts(&v["alerts"]["by_severity"])
    );
    let rollouts = v["rollouts_in_progress"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    let _ = writeln!(out, "Rollouts:   {} in progress", rollouts.len());
    for r in rollouts {
        let _ = writeln!(
            out,
            "  {} {} {} ({}/{} nodes)",
            s(r, "id"),
            s(r, "module"),
            s(r, "state"),
            s(r, "nodes_done"),
            s(r, "nodes_total")
        );
    }
    let hb = &v["heartbeat"];
    match (
        hb["detection_ms"].as_u64(),
        hb["interval_ms"].as_u64(),
        hb["grace_ms"].as_u64(),
    ) {
        (Some(d), Some(i), Some(g)) => {
            let _ = writeln!(
                out,
                "Detection:  a node is judged unreachable within {} (heartbeat every {}, grace {})",
                output::millis(d),
                output::millis(i),
                output::millis(g)
            );
        }
        _ => out.push_str("Detection:  unknown (the API did not say)\n"),
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_counts_the_fleet() {
        let nodes = vec![
            json!({"id": "a", "state": "alive"}),
            json!({"id": "b", "state": "alive"}),
            json!({"id": "c", "state": "unreachable"}),
        ];
        let health =
            json!({"modules": [{"health": "healthy"}, {"health": "degraded"}], "nodes": []});
        let alerts = vec![json!({"severity": "critical"})];
        let rollouts = json!({"rollouts": [
            {"id": "r1", "module": "web", "state": "running", "nodes_done": 1, "nodes_total": 3},
            {"id": "r0", "module": "web", "state": "succeeded"}]});
        let hb = json!({"interval_ms": 1000, "grace_ms": 3000, "detection_ms": 4000});
        let v = summarize(&nodes, &hb, &health, &alerts, &rollouts);
        assert_eq!(
            v["nodes"]["by_state"],
            json!({"alive": 2, "unreachable": 1})
        );
        assert_eq!(v["rollouts_in_progress"].as_array().unwrap().len(), 1);
        let t = status_text(&v);
        assert_eq!(
            t,
            "Nodes:      3 (2 alive, 1 unreachable)\n\
             Modules:    2 (1 degraded, 1 healthy)\n\
             Alerts:     1 open (1 critical)\n\
             Rollouts:   1 in progress\n  r1 web running (1/3 nodes)\n\
             Detection:  a node is judged unreachable within 4s (heartbeat every 1s, grace 3s)\n"
        );
    }

    fn now() -> DateTime<Utc> {
        DateTime::parse_from_rfc3339("2026-12-04T05:00:00Z")
            .unwrap()
            .with_timezone(&Utc)
    }

    const ID1: &str = "0193a1b2-0000-7000-8000-000000000001";

    #[test]
    fn a_grant_on_one_screen() {
        let g = json!({
            "id": ID1, "consumer": "app", "requirement": "db", "kind": "postgres.database",
            "provider": "pg", "resource": "app-db", "user": "app-db",
            "options": {"encoding": "UTF8", "extensions": ["pgcrypto"]}, "delete": false,
            "state": "provisioning", "reason": null, "credential_version": 2,
            "credential_file": "/modules/app/secrets/grant-db.env",
            "consumer_nodes": ["node-a", "node-c"],
            "provider_nodes": [
                {"node": "node-b", "state": "ready", "credential_version": 2, "reason": null,
                 "reported_at": "2026-12-04T04:58:00Z"},
                {"node": "node-d", "state": "failed", "credential_version": 1,
                 "reason": "permission denied\nto create database", "reported_at": "2026-12-04T04:00:00Z",
                 "a_later_field": true}],
            "created_at": "2026-12-04T04:00:00Z", "updated_at": "2026-12-04T04:58:00Z",
            "revoked_at": null, "retain_until": null, "a_later_field": [1, 2]});
        let t = grant_text(&g, now());
        assert_eq!(
            t,
            format!(
                "Grant:          {ID1}\n\
                 Consumer:       app (requirement db)\n\
                 Kind:           postgres.database\n\
                 Provider:       pg\n\
                 Resource:       app-db\n\
                 User:           app-db\n\
                 Options:        encoding=UTF8, extensions=[\"pgcrypto\"]\n\
                 State:          provisioning\n\
                 Credential:     version 2\n  \
                 file:         /modules/app/secrets/grant-db.env (on the consumer's nodes)\n\
                 Consumer nodes: node-a, node-c\n\
                 Provider nodes:\n  \
                 NODE     STATE    VERSION        REPORTED   REASON\n  \
                 node-b   ready    2              2m         -\n  \
                 node-d   failed   1 (behind 2)   60m        permission denied to create database\n\
                 Created:        2026-12-04T04:00:00Z (60m ago)\n\
                 Updated:        2026-12-04T04:58:00Z (2m ago)\n\
                 Retention:      the data is kept for the retention once the grant is revoked\n"
            )
        );
    }

    #[test]
    fn a_revoked_grant_says_how_long_its_data_is_kept() {
        let g = json!({"id": ID1, "consumer": "app", "requirement": "db", "kind": "s3.bucket",
            "provider": "s3", "state": "revoked", "reason": "the requirement is gone",
            "credential_version": 1, "delete": false,
            "revoked_at": "2026-12-04T04:00:00Z", "retain_until": "2026-12-11T04:00:00Z"});
        let t = grant_text(&g, now());
        assert!(
            t.contains("State:          revoked\nReason:         the requirement is gone\n"),
            "{t}"
        );
        assert!(
            t.contains("Revoked:        2026-12-04T04:00:00Z (60m ago)\n"),
            "{t}"
        );
        assert!(
            t.contains("Retention:      the data is kept until 2026-12-11T04:00:00Z (in 6d)\n"),
            "{t}"
        );
        let past = json!({"state": "revoked", "revoked_at": "2026-11-01T00:00:00Z",
            "retain_until": "2026-12-01T00:00:00Z"});
        assert!(
            grant_text(&past, now()).contains("kept until 2026-12-01T00:00:00Z (3d ago)"),
            "the retention has passed"
        );
        let deleted =
            json!({"state": "revoked", "delete": true, "revoked_at": "2026-12-04T04:00:00Z"});
        assert!(grant_text(&deleted, now()).contains(
            "Retention:      delete: true, the data is deleted when the grant is revoked\n"
        ));
    }

    #[test]
    fn a_grant_with_only_some_fields_still_reads() {
        // What an older or newer API may send: fields missing, some unknown,
        // some of another type than expected. Nothing panics, absent is `-`.
        let g = json!({"id": ID1, "consumer": "app", "requirement": "db", "state": "requested",
            "reason": "no module provides postgres.database", "provider": null, "user": null,
            "credential_version": 0, "brand_new": {"nested": true}, "consumer_nodes": "node-a"});
        let t = grant_text(&g, now());
        for line in [
            "Provider:       none chosen yet\n",
            "User:           none issued yet\n",
            "Kind:           -\n",
            "Options:        -\n",
            "Reason:         no module provides postgres.database\n",
            "Credential:     none issued yet\n",
            "  file:         - (on the consumer's nodes)\n",
            "Consumer nodes: -\n",
            "Provider nodes:\n  (none reported)\n",
            "Created:        -\n",
        ] {
            assert!(t.contains(line), "`{line}` in\n{t}");
        }
        assert!(!t.contains("brand_new") && !t.contains("Revoked"), "{t}");
        let t = grant_text(&json!({}), now());
        assert!(t.starts_with("Grant:          -\n"), "{t}");
        assert!(t.contains("Credential:     -\n"), "{t}");
        let ahead =
            json!({"created_at": "2026-12-04T05:00:00.4Z", "updated_at": "2026-12-04T05:00:03Z"});
        let t = grant_text(&ahead, now());
        assert!(
            t.contains("Created:        2026-12-04T05:00:00.4Z (0s ago)\n"),
            "{t}"
        );
        assert!(
            t.contains("Updated:        2026-12-04T05:00:03Z (0s ago)\n"),
            "a clock ahead: {t}"
        );
        let t = grant_text(
            &json!({"created_at": "yesterday", "provider_nodes": [{}]}),
            now(),
        );
        assert!(
            t.contains("Created:        yesterday (unreadable time)\n"),
            "{t}"
        );
        assert!(
            t.contains("  -      -       -         -          -\n"),
            "{t}"
        );
    }

    #[test]
    fn a_grant_is_named_by_id_by_the_start_of_one_or_by_consumer_and_requirement() {
        assert_eq!(grant_ref(ID1).unwrap(), GrantRef::Id(ID1.into()));
        assert_eq!(
            grant_ref(&ID1.to_uppercase()).unwrap(),
            GrantRef::Id(ID1.into())
        );
        assert_eq!(
            grant_ref("0193A1").unwrap(),
            GrantRef::Prefix("0193a1".into())
        );
        assert_eq!(
            grant_ref("0193a1b2-0000").unwrap(),
            GrantRef::Prefix("0193a1b2-0000".into())
        );
        assert_eq!(
            grant_ref("app/db").unwrap(),
            GrantRef::Pair {
                consumer: "app".into(),
                requirement: "db".into()
            }
        );
        for bad in ["", "app", "/db", "app/", "a/b/c", "0193-xyz"] {
            let e = grant_ref(bad).unwrap_err().to_string();
            assert!(e.contains(&format!("`{bad}`")), "{bad}: {e}");
        }
    }

    fn grant(id: &str, consumer: &str, requirement: &str, state: &str) -> Value {
        json!({"id": id, "consumer": consumer, "requirement": requirement, "state": state})
    }

    #[test]
    fn an_id_prefix_names_one_grant_or_says_which() {
        let grants = vec![
            grant("0193aa00-0000-7000-8000-000000000001", "app", "db", "ready"),
            grant(
                "0193aa00-0000-7000-8000-000000000002",
                "app",
                "queue",
                "ready",
            ),
            grant(
                "0193bb00-0000-7000-8000-000000000003",
                "web",
                "db",
                "failed",
            ),
            json!({"consumer": "no id at all"}),
        ];
        let pick = |p: &str| pick_grant(&grant_ref(p).unwrap(), &grants);
        assert_eq!(
            pick("0193b").unwrap(),
            "0193bb00-0000-7000-8000-000000000003"
        );
        assert_eq!(
            pick("0193AA00-0000-7000-8000-00000000000")
                .unwrap_err()
                .to_string(),
            "`0193aa00-0000-7000-8000-00000000000` starts the ids of 2 grants; give more of the id:\n  \
             0193aa00-0000-7000-8000-000000000001   app/db   ready\n  \
             0193aa00-0000-7000-8000-000000000002   app/queue   ready"
        );
        assert_eq!(
            pick("0193c").unwrap_err().to_string(),
            "no grant's id starts with `0193c` (`meshctl get grants -o wide` lists them)"
        );
        // A whole id is asked for as it is (the API says 404 if unknown).
        assert_eq!(pick(ID1).unwrap(), ID1);
        // Many candidates: the first few, then how many more.
        let many: Vec<Value> = (0..13)
            .map(|i| {
                grant(
                    &format!("0193cc00-0000-7000-8000-{i:012}"),
                    "app",
                    &format!("r{i}"),
                    "ready",
                )
            })
            .collect();
        let e = pick_grant(&GrantRef::Prefix("0193cc".into()), &many)
            .unwrap_err()
            .to_string();
        assert_eq!(e.lines().count(), 1 + CANDIDATES_SHOWN + 1, "{e}");
        assert!(e.starts_with("`0193cc` starts the ids of 13 grants"), "{e}");
        assert!(e.ends_with("\n  and 3 more"), "{e}");
    }

    #[test]
    fn consumer_and_requirement_name_the_live_grant() {
        let grants = vec![
            grant(
                "0193aa00-0000-7000-8000-000000000001",
                "app",
                "db",
                "revoked",
            ),
            grant("0193aa00-0000-7000-8000-000000000002", "app", "db", "ready"),
            grant("0193aa00-0000-7000-8000-000000000003", "pg", "app", "ready"),
            grant(
                "0193aa00-0000-7000-8000-000000000004",
                "app",
                "bucket",
                "revoked",
            ),
        ];
        let pick = |p: &str| pick_grant(&grant_ref(p).unwrap(), &grants);
        assert_eq!(
            pick("app/db").unwrap(),
            "0193aa00-0000-7000-8000-000000000002"
        );
        // A revoked grant alone is still the one named.
        assert_eq!(
            pick("app/bucket").unwrap(),
            "0193aa00-0000-7000-8000-000000000004"
        );
        // The --module filter also returns a provider's grants: not these.
        assert_eq!(
            pick("app/app").unwrap_err().to_string(),
            "no grant for module `app`'s requirement `app` (`meshctl get grants --module app` lists its grants)"
        );
        let two_revoked = vec![
            grant(
                "0193aa00-0000-7000-8000-000000000001",
                "app",
                "db",
                "revoked",
            ),
            grant(
                "0193aa00-0000-7000-8000-000000000002",
                "app",
                "db",
                "revoked",
            ),
        ];
        let e = pick_grant(&grant_ref("app/db").unwrap(), &two_revoked)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("2 grants for `app/db`; give the id of one:\n"),
            "{e}"
        );
        assert!(
            e.contains("0193aa00-0000-7000-8000-000000000002   app/db   revoked"),
            "{e}"
        );
    }

    #[test]
    fn a_module_shows_each_replicas_box() {
        let m = json!({"name": "db", "revision": 2, "desired": "running", "stateful": true,
            "unit": {"command": "/usr/bin/db", "restart": "always", "user": "root",
                     "resources": {"cpu_millis": 0, "memory_bytes": 67108864, "pids": 64}},
            "placement": {"exact_node": {"node": "db-1"}}, "effective_replicas": 1,
            "assignments": [{"replica": 0, "node": "db-1", "name": "db", "role": "active",
                "unit_state": "running", "restarts": 3, "uid": 0, "oom_kills": 3,
                "reason": "oom_killed", "data_bytes": 4096, "revision": null}]});
        let t = module_text(&m, &Ok(vec![]));
        assert!(
            t.contains("Box:           user root, cpu_millis none, memory_bytes 67108864, pids 64"),
            "{t}"
        );
        assert!(
            t.contains("UID   OOM KILLS   REASON       DATA BYTES"),
            "{t}"
        );
        assert!(t.contains("0     3           oom_killed   4096"), "{t}");
    }

    #[test]
    fn a_node_on_one_screen() {
        let n = json!({"id": "web-1", "hostname": "h", "state": "alive", "liveness": "alive",
            "admin_state": "active", "labels": {"effective": {"role": "web"}, "reported": {"role": "web"}, "operator": {}},
            "sections": {"config": {"declared": 3, "applied": 3, "outcome": "ok"},
                         "inventory": {"declared": 2, "applied": 1}},
            "units": [{"name": "web-0", "module": "web", "role": "active", "unit_state": "running", "restarts": 0}],
            "health": {"health": "healthy", "replicas": [{"unit": "web-0", "health": "healthy"}]}});
        let t = node_text(&n, &Ok(vec![]));
        assert!(t.contains("Labels:        role=web"), "{t}");
        assert!(
            t.contains("config      3          3         in sync"),
            "{t}"
        );
        assert!(t.contains("inventory   2          1         behind"), "{t}");
        assert!(
            t.contains("web-0   web      active   running   0          healthy"),
            "{t}"
        );
        assert!(t.contains("(none kept)"), "{t}");
    }
}
