//! `meshctl describe node|module|run` (one screen per resource: what it is,
//! what was declared and applied, its units or replicas with their health,
//! its recent events or receipts) and `meshctl status` (the fleet on a few
//! lines).

use crate::client::{Api, urlencode};
use crate::events::{self, Filters};
use crate::output::{self, Format, age, labels, s};
use crate::resources::{self, Kind};
use chrono::Utc;
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
        "  reported:    {}",
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
                "REPLICA", "NODE", "UNIT", "ROLE", "STATE", "RESTARTS", "HEALTH", "REVISION",
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
