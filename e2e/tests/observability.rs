//! Health, alerts and metrics end to end (issue 13): a real controller and
//! real agents, units that are real processes, probes that are real HTTP
//! requests, the dead-letter queue of the real broker.
//!
//! - A unit whose HTTP probe starts failing turns its replica unhealthy and
//!   its module degraded, raises `module_degraded`; recovery resolves it.
//!   (Two hosts in network namespaces, so both replicas listen on the same
//!   loopback port, each on its own host.)
//! - A killed agent raises `node_unreachable`, whose duration grows; it
//!   resolves when the agent is back.
//! - A dead-lettered message raises `dead_letter_queue`; purging the queue
//!   the documented way (docs/observability.md) resolves it.
//! - Every metric family docs/observability.md lists is on the controller's
//!   and the agent's `/metrics` after the scenario.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context as _, anyhow, bail, ensure};
use mesh_e2e::netns::{Lan, in_netns};
use mesh_e2e::{AGENT_OFF_THE_OVERLAY, Mesh, Proc, wait_for};
use reqwest::Method;
use serde_json::{Value, json};

const WITHIN: Duration = Duration::from_secs(45);

async fn open_alerts(mesh: &Mesh, query: &str) -> anyhow::Result<Vec<Value>> {
    let (status, v) = mesh.get(&format!("/v1/alerts{query}")).await?;
    ensure!(status == 200, "GET /v1/alerts{query}: {status} {v}");
    Ok(v["alerts"].as_array().cloned().unwrap_or_default())
}

async fn wait_alert(mesh: &Mesh, kind: &str, subject: &str) -> anyhow::Result<Value> {
    wait_for(
        &format!("an open {kind} alert on {subject}"),
        WITHIN,
        || async {
            let open = open_alerts(mesh, &format!("?kind={kind}")).await?;
            Ok(open.into_iter().find(|a| a["subject"] == subject))
        },
    )
    .await
}

async fn wait_resolved(mesh: &Mesh, kind: &str, subject: &str) -> anyhow::Result<Value> {
    wait_for(
        &format!("the {kind} alert on {subject} to resolve"),
        WITHIN,
        || async {
            if open_alerts(mesh, &format!("?kind={kind}"))
                .await?
                .iter()
                .any(|a| a["subject"] == subject)
            {
                return Ok(None);
            }
            let all = open_alerts(mesh, &format!("?state=resolved&kind={kind}")).await?;
            Ok(all.into_iter().find(|a| a["subject"] == subject))
        },
    )
    .await
}

#[tokio::test]
async fn a_killed_agent_is_unreachable_for_longer_and_longer_until_it_is_back() -> anyhow::Result<()>
{
    let mut mesh = Mesh::start().await?;
    let node = mesh.add_agent("a", &[]).await?;
    wait_for("the node to be known", WITHIN, || async {
        let (status, _) = mesh.get(&format!("/v1/nodes/{node}")).await?;
        Ok((status == 200).then_some(()))
    })
    .await?;
    // Liveness is judged once the controller observed a full grace: the
    // alert comes then at the latest (WITHIN bounds it).
    mesh.stop_agent(&node);
    let subject = format!("node/{node}");
    let first = wait_alert(&mesh, "node_unreachable", &subject).await?;
    ensure!(first["severity"] == "critical", "{first}");
    let message = first["message"].as_str().unwrap_or_default();
    ensure!(
        message.starts_with(&format!("{node} unreachable for")),
        "{message}"
    );
    let d0 = first["duration_secs"].as_i64().unwrap_or(-1);
    let grown = wait_for("the outage's duration to grow", WITHIN, || async {
        let open = open_alerts(&mesh, "?kind=node_unreachable").await?;
        Ok(open
            .into_iter()
            .find(|a| a["subject"] == subject && a["duration_secs"].as_i64() > Some(d0 + 1)))
    })
    .await?;
    ensure!(
        grown["id"] == first["id"],
        "the same alert: {first} {grown}"
    );
    // The node view shows its health.
    let (_, view) = mesh.get(&format!("/v1/nodes/{node}")).await?;
    ensure!(view["health"]["health"] == "unknown", "{view}");

    mesh.start_agent(&node)?;
    let resolved = wait_resolved(&mesh, "node_unreachable", &subject).await?;
    ensure!(resolved["id"] == first["id"], "{resolved}");
    ensure!(resolved["resolved_at"].is_string(), "{resolved}");
    mesh.teardown().await
}

#[tokio::test]
async fn a_dead_letter_raises_its_alert_and_purging_the_queue_resolves_it() -> anyhow::Result<()> {
    let mut mesh = Mesh::start().await?;
    let node = mesh.add_agent("a", &[]).await?;
    // A report the controller cannot read: dead-lettered with its reason.
    let creds = mesh.agent(&node).creds.clone();
    mesh_e2e::publish_as(&creds, &format!("{node}.hello"), b"{not json", true).await?;
    let alert = wait_alert(&mesh, "dead_letter_queue", "queue/dead-letter").await?;
    ensure!(
        alert["message"]
            .as_str()
            .unwrap_or_default()
            .contains("holds 1 message"),
        "{alert}"
    );
    // The documented procedure: read the reasons, then purge.
    let status = std::process::Command::new("rabbitmqctl")
        .args(["purge_queue", "-p", mesh.env.vhost(), "dead-letter"])
        .stdout(Stdio::null())
        .status()
        .context("rabbitmqctl")?;
    ensure!(status.success(), "rabbitmqctl purge_queue: {status}");
    wait_resolved(&mesh, "dead_letter_queue", "queue/dead-letter").await?;
    mesh.teardown().await
}

/// Hosts of the probe test, each in its own network namespace.
const HOSTS: [&str; 2] = ["pa", "pb"];

/// A unit that answers `GET /healthz` on 127.0.0.1:`port` (of its own
/// host) with 200, or 503 while the file `fail` exists in its working
/// directory (the agent's root).
fn web(port: u16) -> Value {
    let script = format!(
        "import http.server, os\n\
         class H(http.server.BaseHTTPRequestHandler):\n\
         \x20   def do_GET(self):\n\
         \x20       self.send_response(503 if os.path.exists('fail') else 200)\n\
         \x20       self.end_headers()\n\
         \x20   def log_message(self, *a):\n\
         \x20       pass\n\
         http.server.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n"
    );
    json!({
        "unit": {
            "command": "python3",
            "args": ["-c", script],
            "probes": [{
                "name": "ready",
                "http": {"port": port, "path": "/healthz"},
                "interval_secs": 1,
                "timeout_secs": 1,
                "failure_threshold": 2,
            }],
        },
        "placement": {"match_labels": {"labels": {"role": "web"}, "replicas": 2}},
    })
}

async fn module_health(mesh: &Mesh, module: &str) -> anyhow::Result<Value> {
    let (status, v) = mesh.get(&format!("/v1/health?module={module}")).await?;
    ensure!(status == 200, "GET /v1/health: {status} {v}");
    v["modules"]
        .as_array()
        .and_then(|m| m.first().cloned())
        .ok_or_else(|| anyhow!("no module {module} in {v}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_http_probe_degrades_its_module_and_recovery_clears_the_alert()
-> anyhow::Result<()> {
    if !nix_root() {
        return mesh_testkit::skip("network namespaces need root");
    }
    let mut mesh = Mesh::start().await?;
    let lan = Lan::create(mesh.env.id(), &HOSTS)?;
    let mut agents = Vec::new();
    let result = probes(&mut mesh, &lan, &mut agents).await;
    drop(agents);
    drop(lan);
    if let Err(e) = &result {
        eprintln!("failed: {e:#}");
        for h in HOSTS {
            eprintln!("--- agent {h} ---\n{}", mesh.log_of(&format!("agent-{h}")));
        }
    }
    let torn = mesh.teardown().await;
    result?;
    torn
}

fn nix_root() -> bool {
    std::process::Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

async fn probes(mesh: &mut Mesh, lan: &Lan, agents: &mut Vec<Proc>) -> anyhow::Result<()> {
    let mut roots = Vec::new();
    let mut nodes = Vec::new();
    for (i, name) in HOSTS.iter().enumerate() {
        let extra = format!(
            "metrics_listen = \"127.0.0.1:{AGENT_METRICS_PORT}\"\n\
             labels = {{ role = \"web\" }}\n{AGENT_OFF_THE_OVERLAY}"
        );
        let (host, agent) = lan.spawn_agent(mesh, i, name, &extra).await?;
        agents.push(agent);
        roots.push(host.root);
        nodes.push(host.node);
    }
    let port = 18_080;
    let (status, _, body) = mesh
        .request(Method::PUT, "/v1/modules/web", &[], Some(&web(port)))
        .await?;
    ensure!(status == 201, "PUT /v1/modules/web: {status} {body}");

    let healthy = wait_for("web healthy on both hosts", WITHIN, || async {
        let m = module_health(mesh, "web").await?;
        Ok(
            (m["health"] == "healthy" && m["replicas"].as_array().map_or(0, Vec::len) == 2)
                .then_some(m),
        )
    })
    .await?;
    // Which replica runs on the first host.
    let replica = healthy["replicas"]
        .as_array()
        .and_then(|r| r.iter().find(|r| r["node"] == nodes[0].as_str()).cloned())
        .ok_or_else(|| anyhow!("no replica on {}: {healthy}", nodes[0]))?;

    std::fs::write(roots[0].join("fail"), b"")?;
    let degraded = wait_for("web degraded", WITHIN, || async {
        let m = module_health(mesh, "web").await?;
        Ok((m["health"] == "degraded").then_some(m))
    })
    .await?;
    let bad = degraded["replicas"]
        .as_array()
        .and_then(|r| r.iter().find(|r| r["node"] == nodes[0].as_str()).cloned())
        .ok_or_else(|| anyhow!("{degraded}"))?;
    ensure!(bad["health"] == "unhealthy", "{bad}");
    ensure!(bad["unit"] == replica["unit"], "{bad}");
    ensure!(bad["probes"][0]["state"] == "unhealthy", "{bad}");
    ensure!(
        bad["probes"][0]["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("503"),
        "{bad}"
    );
    let alert = wait_alert(mesh, "module_degraded", "module/web").await?;
    ensure!(
        alert["message"]
            .as_str()
            .unwrap_or_default()
            .contains("503"),
        "{alert}"
    );
    // The node view says the same, and so does the module view (inventory
    // learns it from the record: observability.module.health).
    let (_, view) = mesh.get(&format!("/v1/nodes/{}", nodes[0])).await?;
    ensure!(view["health"]["health"] == "degraded", "{view}");
    let module = wait_for("the module view's health", WITHIN, || async {
        let (_, v) = mesh.get("/v1/modules/web").await?;
        Ok((v["health"]["health"] == "degraded").then_some(v))
    })
    .await?;
    let told = module["health"]["replicas"]
        .as_array()
        .and_then(|r| r.iter().find(|r| r["node"] == nodes[0].as_str()).cloned())
        .ok_or_else(|| anyhow!("{module}"))?;
    ensure!(
        told["health"] == "unhealthy"
            && told["reason"]
                .as_str()
                .unwrap_or_default()
                .contains("HTTP 503"),
        "{told}"
    );

    // With the alert open, every family docs/observability.md lists is on
    // the controller's /metrics, with sensible values.
    let docs = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/observability.md"),
    )?;
    let controller = wait_for("the controller's gauges", WITHIN, || async {
        let text = reqwest::get(format!("{}/metrics", mesh.api))
            .await?
            .text()
            .await?;
        Ok(
            (sample(&text, "mesh_controller_nodes", &[("state", "alive")]) == Some(2.0)
                && sample(&text, "mesh_controller_modules", &[("health", "degraded")])
                    == Some(1.0)
                && sample(
                    &text,
                    "mesh_controller_alerts",
                    &[("kind", "module_degraded"), ("severity", "warning")],
                ) == Some(1.0))
            .then_some(text),
        )
    })
    .await?;
    families_present(&docs, "mesh_controller_", &controller)?;
    for (name, want) in [
        ("mesh_controller_build_info", 1.0),
        ("mesh_controller_broker_connected", 1.0),
    ] {
        ensure!(
            sample(&controller, name, &[]) == Some(want),
            "{name} is not {want}"
        );
    }
    ensure!(
        sample(
            &controller,
            "mesh_controller_queue_messages",
            &[("queue", "dead-letter")]
        ) == Some(0.0),
        "dead-letter depth"
    );
    ensure!(
        controller.contains("mesh_controller_http_requests_total{route=\"/v1/health\""),
        "no /v1/health requests counted"
    );

    std::fs::remove_file(roots[0].join("fail"))?;
    wait_resolved(mesh, "module_degraded", "module/web").await?;
    let m = module_health(mesh, "web").await?;
    if m["health"] != "healthy" {
        bail!("web not healthy after recovery: {m}");
    }

    // After the scenario, every family docs/observability.md lists is on
    // each agent's /metrics, with sensible values.
    let agent = in_netns(lan.ns(0), || {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", AGENT_METRICS_PORT))?;
        s.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")?;
        let mut out = String::new();
        s.read_to_string(&mut out)?;
        Ok(out)
    })?;
    families_present(&docs, "mesh_agent_", &agent)?;
    for (name, labels, want) in [
        ("mesh_agent_build_info", vec![], 1.0),
        ("mesh_agent_broker_connected", vec![], 1.0),
        ("mesh_agent_units_running", vec![], 1.0),
        ("mesh_agent_probe_healthy", vec![("probe", "ready")], 1.0),
    ] {
        ensure!(
            sample(&agent, name, &labels) == Some(want),
            "{name}{labels:?} is not {want}:\n{agent}"
        );
    }
    ensure!(
        sample(
            &agent,
            "mesh_agent_applied_generation",
            &[("section", "inventory")]
        )
        .is_some_and(|g| g >= 1.0),
        "no inventory generation applied:\n{agent}"
    );
    ensure!(
        sample(
            &agent,
            "mesh_agent_probe_checks_total",
            &[("probe", "ready"), ("result", "fail")]
        )
        .is_some_and(|n| n >= 2.0),
        "the failed checks are not counted:\n{agent}"
    );
    Ok(())
}

/// The agent's metrics port on each probe-test host (each its own loopback).
const AGENT_METRICS_PORT: u16 = 19_464;

/// Every family of `prefix` the page's tables list is in `text` (its
/// `# TYPE` line; a counter's family is named without `_total`).
fn families_present(docs: &str, prefix: &str, text: &str) -> anyhow::Result<()> {
    let listed: Vec<&str> = docs
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .filter(|f| f.starts_with(prefix))
        .collect();
    ensure!(listed.len() >= 10, "docs list only {listed:?}");
    for family in listed {
        let base = family.strip_suffix("_total").unwrap_or(family);
        ensure!(
            text.lines()
                .any(|l| l.starts_with(&format!("# TYPE {base} "))),
            "{family} (listed in docs/observability.md) is not served:\n{text}"
        );
    }
    Ok(())
}

/// The value of the first sample of `name` whose labels include `labels`.
fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(name)?;
        let (lbls, value) = match rest.strip_prefix('{') {
            Some(r) => {
                let (l, v) = r.split_once('}')?;
                (l, v)
            }
            None if rest.starts_with(' ') => ("", rest),
            None => return None,
        };
        labels
            .iter()
            .all(|(k, v)| lbls.contains(&format!("{k}=\"{v}\"")))
            .then(|| value.split_whitespace().next()?.parse().ok())?
    })
}

/// A node states only its own health: a health report whose body names
/// another node is dead-lettered (`impersonation`) and changes nothing of
/// that node; one that names no unit it runs is kept as its own.
#[tokio::test]
async fn a_node_cannot_state_another_nodes_health() -> anyhow::Result<()> {
    let mut mesh = Mesh::start().await?;
    let a = mesh.add_agent("a", &[]).await?;
    let b = mesh.add_agent("b", &[]).await?;
    let forged = mesh_protocol::Envelope::new(
        mesh_protocol::NodeId::parse(&b)?,
        1_000_000,
        mesh_protocol::Report::Health(mesh_protocol::Health {
            probes: vec![mesh_protocol::ProbeResult {
                unit: "web-0".into(),
                module: "web".into(),
                probe: "ready".into(),
                state: mesh_protocol::ProbeState::Unhealthy,
                since: "2026-01-01T00:00:00Z".parse()?,
                checked_at: None,
                failures: 9,
                detail: Some("forged".into()),
            }],
            summary: false,
        }),
    );
    let creds = mesh.agent(&a).creds.clone();
    mesh_e2e::publish_as(&creds, &format!("{a}.health"), &forged.encode(), true).await?;
    let letters = wait_for("the forged report dead-lettered", WITHIN, || async {
        let letters = mesh_e2e::drain_dead_letters(&mesh.env.admin_amqp_url()).await?;
        Ok((!letters.is_empty()).then_some(letters))
    })
    .await?;
    ensure!(letters[0].0 == "impersonation", "{letters:?}");
    ensure!(letters[0].2.as_deref() == Some(a.as_str()), "{letters:?}");
    let (_, health) = mesh.get(&format!("/v1/health?node={b}")).await?;
    ensure!(
        !health.to_string().contains("forged"),
        "b's health took a's word: {health}"
    );
    mesh.stop_agent(&b);
    mesh.teardown().await
}
