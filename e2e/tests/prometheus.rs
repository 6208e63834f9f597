//! Prometheus and Alertmanager, the real programs (issue 35): Debian's
//! `prometheus` (2.42) and `prometheus-alertmanager` (0.25), each on a free
//! loopback port with a throwaway config and data directory, killed at the
//! end.
//!
//! - Prometheus discovers the local mesh's controller and agents through
//!   `GET /v1/prometheus/targets` (`http_sd_configs` with a viewer token)
//!   and scrapes them: `up == 1` for each, read through its HTTP API.
//! - A stopped agent raises `node_unreachable`; the controller delivers it
//!   to Alertmanager (`alertmanager_urls`), which routes it to a webhook
//!   receiver (this test's own HTTP listener) with the node's name; its
//!   resolution reaches the receiver too.
//! - The controller stopped: the shipped rule `MeshControllerDown`
//!   (docs/prometheus/mesh-rules.yml) fires in Prometheus and reaches the
//!   receiver, which no alert of the controller's own could do.
//!
//! How long each alert takes from the fault to the receiver is printed
//! (`cargo test -p mesh-e2e --test prometheus -- --nocapture`).

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use mesh_e2e::{Mesh, Proc, wait_for};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader};

const PROMETHEUS: &str = "/usr/bin/prometheus";
const ALERTMANAGER: &str = "/usr/bin/prometheus-alertmanager";

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// What the webhook receiver got: each notification's body and when.
type Received = Arc<Mutex<Vec<(Instant, Value)>>>;

/// The webhook receiver: a minimal HTTP/1.1 server on loopback that keeps
/// every POSTed JSON body (Alertmanager's webhook notifications) and answers
/// 200.
async fn receiver() -> anyhow::Result<(SocketAddr, Received)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let got: Received = Arc::default();
    let keep = got.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let keep = keep.clone();
            tokio::spawn(async move {
                let (read, mut write) = stream.into_split();
                let mut read = BufReader::new(read);
                loop {
                    let mut length = 0usize;
                    let mut line = String::new();
                    // The request line, then headers up to the blank line.
                    if read.read_line(&mut line).await.unwrap_or(0) == 0 {
                        return;
                    }
                    loop {
                        line.clear();
                        if read.read_line(&mut line).await.unwrap_or(0) == 0 {
                            return;
                        }
                        let l = line.trim_end();
                        if l.is_empty() {
                            break;
                        }
                        if let Some((k, v)) = l.split_once(':')
                            && k.eq_ignore_ascii_case("content-length")
                        {
                            length = v.trim().parse().unwrap_or(0);
                        }
                    }
                    let mut body = vec![0; length];
                    if read.read_exact(&mut body).await.is_err() {
                        return;
                    }
                    if let Ok(v) = serde_json::from_slice::<Value>(&body) {
                        keep.lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .push((Instant::now(), v));
                    }
                    let ok = "HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
                    if write.write_all(ok.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    Ok((addr, got))
}

/// The first notification alert received after `since` with `status` whose
/// labels hold every pair of `labels`: (when it arrived, the alert).
fn find(
    got: &Received,
    since: Instant,
    status: &str,
    labels: &[(&str, &str)],
) -> Option<(Instant, Value)> {
    let got = got.lock().unwrap_or_else(|e| e.into_inner());
    got.iter()
        .filter(|(at, _)| *at >= since)
        .flat_map(|(at, n)| {
            n["alerts"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .map(move |a| (*at, a))
        })
        .find(|(_, a)| a["status"] == status && labels.iter().all(|(k, v)| a["labels"][*k] == *v))
}

/// Prometheus' answer to an instant query: its result vector.
async fn query(http: &reqwest::Client, prometheus: &str, q: &str) -> anyhow::Result<Vec<Value>> {
    let v: Value = http
        .get(format!("{prometheus}/api/v1/query"))
        .query(&[("query", q)])
        .send()
        .await?
        .json()
        .await?;
    ensure!(v["status"] == "success", "{q}: {v}");
    Ok(v["data"]["result"].as_array().cloned().unwrap_or_default())
}

fn spawn(cmd: &mut Command, log: &Path) -> anyhow::Result<Proc> {
    let out = std::fs::File::create(log)?;
    cmd.stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out);
    Proc::spawn(cmd)
}

#[tokio::test]
async fn prometheus_discovers_the_mesh_and_alerts_reach_a_person_even_with_the_controller_down()
-> anyhow::Result<()> {
    for tool in [PROMETHEUS, ALERTMANAGER] {
        if !Path::new(tool).exists() {
            return mesh_testkit::skip(&format!(
                "{tool} missing (bundle/up installs prometheus and prometheus-alertmanager)"
            ));
        }
    }
    let (hook, got) = receiver().await?;
    let am_port = free_port()?;
    let prom_port = free_port()?;
    let alertmanager = format!("http://127.0.0.1:{am_port}");
    let prometheus = format!("http://127.0.0.1:{prom_port}");

    // The controller delivers its alerts to Alertmanager, re-sending open
    // ones every 5 s (the harness's sweep and grace are already short).
    let mut mesh = Mesh::prepare().await?;
    let settings = mesh.dir.path().join("controller.toml");
    let mut toml = std::fs::read_to_string(&settings)?;
    toml.push_str(&format!(
        "alertmanager_urls = [\"{alertmanager}\"]\nalertmanager_resend_secs = 5\n"
    ));
    std::fs::write(&settings, toml)?;
    mesh.start_controller(&[]).await?;

    // Two agents, each serving metrics on a loopback port of its own.
    let mut agents = Vec::new();
    for suffix in ["a", "b"] {
        let port = free_port()?;
        mesh.agent_toml = Some(format!("metrics_listen = \"127.0.0.1:{port}\"\n"));
        let node = mesh.add_agent(suffix, &[]).await?;
        agents.push((node, port));
    }
    let token = mesh.create_token("prometheus", "viewer").await?;

    // Alertmanager: everything to the webhook, at once, resolutions too.
    let dir = tempfile::tempdir()?;
    let am_config = dir.path().join("alertmanager.yml");
    std::fs::write(
        &am_config,
        format!(
            "route:\n  receiver: test\n  group_by: ['alertname', 'node']\n  group_wait: 1s\n  group_interval: 1s\n  repeat_interval: 1h\n\
             receivers:\n  - name: test\n    webhook_configs:\n      - url: http://{hook}/hook\n        send_resolved: true\n"
        ),
    )?;
    std::fs::create_dir_all(dir.path().join("am-data"))?;
    let _alertmanager = spawn(
        Command::new(ALERTMANAGER)
            .arg(format!("--config.file={}", am_config.display()))
            .arg(format!(
                "--storage.path={}",
                dir.path().join("am-data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{am_port}"))
            .arg("--cluster.listen-address="),
        &dir.path().join("alertmanager.log"),
    )?;

    // Prometheus: the mesh's targets from discovery, the shipped rules.
    let rules = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/prometheus/mesh-rules.yml");
    let prom_config = dir.path().join("prometheus.yml");
    std::fs::write(
        &prom_config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
             rule_files:\n  - {rules}\n\
             alerting:\n  alertmanagers:\n    - static_configs:\n        - targets: ['127.0.0.1:{am_port}']\n\
             scrape_configs:\n  - job_name: mesh\n    http_sd_configs:\n      - url: {api}/v1/prometheus/targets\n        refresh_interval: 1s\n        authorization:\n          type: Bearer\n          credentials: {token}\n",
            rules = rules.canonicalize()?.display(),
            api = mesh.api,
        ),
    )?;
    std::fs::create_dir_all(dir.path().join("prom-data"))?;
    let _prometheus = spawn(
        Command::new(PROMETHEUS)
            .arg(format!("--config.file={}", prom_config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("prom-data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{prom_port}")),
        &dir.path().join("prometheus.log"),
    )?;
    let logs = |dir: &Path| {
        for name in ["prometheus.log", "alertmanager.log"] {
            let text = std::fs::read_to_string(dir.join(name)).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(20).collect();
            eprintln!("--- {name} (last lines, newest first)\n{}", tail.join("\n"));
        }
    };
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()?;

    // Discovered and scraped: up == 1 for the controller and each agent.
    let scraped = wait_for(
        "Prometheus to scrape the controller and both agents (up == 1)",
        Duration::from_secs(60),
        || async {
            let up = query(&http, &prometheus, "up == 1").await?;
            let controller = up.iter().any(|s| s["metric"]["job"] == "mesh-controller");
            let nodes = agents.iter().all(|(node, port)| {
                up.iter().any(|s| {
                    s["metric"]["job"] == "mesh-agent"
                        && s["metric"]["node"] == node.as_str()
                        && s["metric"]["instance"] == format!("127.0.0.1:{port}")
                        && s["metric"]["state"] == "alive"
                })
            });
            Ok((controller && nodes).then_some(up))
        },
    )
    .await;
    if scraped.is_err() {
        logs(dir.path());
    }
    let up = scraped?;
    println!("Prometheus scrapes {} mesh targets, each up", up.len());
    // A metric of each: the agent's own gauge is there under its node.
    let confirms = query(
        &http,
        &prometheus,
        "mesh_agent_last_confirm_timestamp_seconds > 0",
    )
    .await?;
    ensure!(confirms.len() == 2, "{confirms:?}");

    // A stopped agent: node_unreachable reaches the receiver, named.
    let (b, b_port) = agents[1].clone();
    let fault = Instant::now();
    mesh.stop_agent(&b);
    let firing = wait_for(
        "node_unreachable of the stopped node at the webhook receiver",
        Duration::from_secs(60),
        || async {
            Ok(find(
                &got,
                fault,
                "firing",
                &[("alertname", "node_unreachable"), ("node", b.as_str())],
            ))
        },
    )
    .await;
    if firing.is_err() {
        logs(dir.path());
        eprintln!("{}", mesh.controller_log());
    }
    let (at, alert) = firing?;
    println!(
        "node_unreachable: fault to receiver in {:.1} s",
        at.duration_since(fault).as_secs_f64()
    );
    ensure!(alert["labels"]["severity"] == "critical", "{alert}");
    ensure!(alert["labels"]["subject"] == format!("node/{b}"), "{alert}");
    ensure!(
        alert["annotations"]["message"]
            .as_str()
            .is_some_and(|m| m.contains(b.as_str())),
        "{alert}"
    );
    ensure!(
        alert["annotations"]["dashboard"]
            .as_str()
            .is_some_and(|d| d.ends_with("/dashboard#alerts")),
        "{alert}"
    );

    // Back: its resolution reaches the receiver too.
    let back = Instant::now();
    mesh.agent_toml = Some(format!("metrics_listen = \"127.0.0.1:{b_port}\"\n"));
    mesh.start_agent(&b)?;
    let (at, _) = wait_for(
        "the resolved node_unreachable at the webhook receiver",
        Duration::from_secs(60),
        || async {
            Ok(find(
                &got,
                back,
                "resolved",
                &[("alertname", "node_unreachable"), ("node", b.as_str())],
            ))
        },
    )
    .await?;
    println!(
        "node_unreachable resolved: agent restarted to receiver in {:.1} s",
        at.duration_since(back).as_secs_f64()
    );

    // The controller stopped: only Prometheus can tell, through the shipped
    // rule (`for: 1m`).
    let fault = Instant::now();
    mesh.kill_controller();
    let fired = wait_for(
        "MeshControllerDown at the webhook receiver",
        Duration::from_secs(150),
        || async {
            Ok(find(
                &got,
                fault,
                "firing",
                &[
                    ("alertname", "MeshControllerDown"),
                    ("job", "mesh-controller"),
                ],
            ))
        },
    )
    .await;
    if fired.is_err() {
        logs(dir.path());
    }
    let (at, alert) = fired?;
    println!(
        "MeshControllerDown: controller killed to receiver in {:.1} s (the rule's `for: 1m` included)",
        at.duration_since(fault).as_secs_f64()
    );
    ensure!(alert["labels"]["severity"] == "critical", "{alert}");
    ensure!(
        alert["annotations"]["summary"]
            .as_str()
            .is_some_and(|s| s.contains("controller")),
        "{alert}"
    );
    drop((_prometheus, _alertmanager));
    mesh.teardown().await.context("teardown")
}
