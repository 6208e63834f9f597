//! Samples taken every few seconds during the run, into the history: node
//! states as the API lists them, each module's unit processes on each host
//! (from /proc: a unit's environment names its module, its working
//! directory is under its host's directory), and resource use (CPU seconds
//! of the controller, the agents, PostgreSQL and RabbitMQ; the controller's
//! RSS and open descriptors; the broker's queue count in the test's vhost;
//! how many declared sections are not yet applied).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::fleet::Pids;
use crate::history::{Event, History};
use crate::workload::Client;

/// Clock ticks per second (`getconf CLK_TCK`; 100 on Linux).
const TICKS: f64 = 100.0;

/// utime + stime of `pid` in seconds.
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the command: state is field 3, utime 14, stime 15 (1-based).
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / TICKS)
}

fn comm(pid: u32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .ok()
        .map(|s| s.trim().to_owned())
}

fn all_pids() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_string_lossy().parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

pub fn rss_kb(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

pub fn open_fds(pid: u32) -> Option<u64> {
    Some(std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64)
}

/// Not a zombie.
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            !s.rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        })
        .unwrap_or(false)
}

/// Unit processes: (host name, module) → count, for every process whose
/// environment has `MESH_MODULE` and whose working directory is under a
/// host's directory.
pub fn unit_counts(hosts: &[(String, PathBuf)]) -> BTreeMap<(String, String), usize> {
    let mut out = BTreeMap::new();
    for pid in all_pids() {
        let Ok(cwd) = std::fs::read_link(format!("/proc/{pid}/cwd")) else {
            continue;
        };
        let Some((host, _)) = hosts.iter().find(|(_, dir)| cwd.starts_with(dir)) else {
            continue;
        };
        let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else {
            continue;
        };
        let module = env
            .split(|b| *b == 0)
            .find_map(|v| v.strip_prefix(b"MESH_MODULE="))
            .map(|m| String::from_utf8_lossy(m).into_owned());
        if let Some(module) = module
            && alive(pid)
        {
            *out.entry((host.clone(), module)).or_insert(0) += 1;
        }
    }
    out
}

pub struct Sampler {
    pub history: History,
    pub client: Client,
    pub pids: Arc<Mutex<Pids>>,
    /// (host name, host directory)
    pub hosts: Vec<(String, PathBuf)>,
    pub rabbitmq_api: String,
    pub rabbitmq_user: String,
    pub rabbitmq_password: String,
    pub vhost: String,
}

impl Sampler {
    /// The queues of the vhost and the messages ready in each (not those
    /// delivered and not yet acknowledged: in flight, not waiting).
    pub async fn queues(&self) -> anyhow::Result<Vec<(String, u64)>> {
        let list: Vec<serde_json::Value> = self
            .client
            .http
            .get(format!(
                "{}/api/queues/{}?columns=name,messages_ready",
                self.rabbitmq_api,
                urlencoding::encode(&self.vhost)
            ))
            .basic_auth(&self.rabbitmq_user, Some(&self.rabbitmq_password))
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        Ok(list
            .iter()
            .map(|q| {
                (
                    q["name"].as_str().unwrap_or_default().to_owned(),
                    q["messages_ready"].as_u64().unwrap_or(0),
                )
            })
            .collect())
    }

    /// Sections declared but not applied, over every node (None: the API
    /// did not answer).
    pub async fn behind(&self) -> Option<u64> {
        let mut behind = 0;
        for node in &self.client.nodes {
            let (status, view) = self.client.get(&format!("/v1/nodes/{node}")).await.ok()?;
            if status != 200 {
                return None;
            }
            if let Some(sections) = view["sections"].as_object() {
                behind += sections
                    .values()
                    .filter(|s| !s["declared"].is_null() && s["declared"] != s["applied"])
                    .count() as u64;
            }
        }
        Some(behind)
    }

    pub async fn once(&self) {
        // Node states.
        if let Ok((200, view)) = self.client.get("/v1/nodes").await {
            let states = view["nodes"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .map(|n| {
                            (
                                n["id"].as_str().unwrap_or_default().to_owned(),
                                n["state"].as_str().unwrap_or_default().to_owned(),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
            self.history.record(Event::NodeStates { states });
        }
        // Units.
        let hosts = self.hosts.clone();
        let units = tokio::task::spawn_blocking(move || unit_counts(&hosts))
            .await
            .unwrap_or_default();
        self.history.record(Event::Units {
            counts: units.into_iter().map(|((h, m), n)| (h, m, n)).collect(),
        });
        // Resources.
        let pids = self.pids.lock().map(|p| p.clone()).unwrap_or_default();
        let (cpu, rss, fds) = tokio::task::spawn_blocking(move || {
            let mut cpu = Vec::new();
            if let Some(c) = pids.controller.and_then(cpu_seconds) {
                cpu.push(("controller".to_owned(), c));
            }
            let agents: f64 = pids
                .agents
                .iter()
                .flatten()
                .filter_map(|p| cpu_seconds(*p))
                .sum();
            cpu.push(("agents".to_owned(), agents));
            let (mut pg, mut mq) = (0.0, 0.0);
            for pid in all_pids() {
                match comm(pid).as_deref() {
                    Some("postgres") => pg += cpu_seconds(pid).unwrap_or(0.0),
                    Some("beam.smp") | Some("erl_child_setup") | Some("epmd") => {
                        mq += cpu_seconds(pid).unwrap_or(0.0)
                    }
                    _ => {}
                }
            }
            cpu.push(("postgres".to_owned(), pg));
            cpu.push(("rabbitmq".to_owned(), mq));
            (
                cpu,
                pids.controller.and_then(rss_kb),
                pids.controller.and_then(open_fds),
            )
        })
        .await
        .unwrap_or_default();
        let queues = self.queues().await.ok().map(|q| q.len() as u64);
        let behind = self.behind().await;
        self.history.record(Event::Resources {
            cpu,
            rss_kb: rss,
            fds,
            queues,
            behind,
        });
    }

    pub async fn run(&self, every: Duration, stop: tokio::sync::watch::Receiver<bool>) {
        loop {
            if *stop.borrow() {
                return;
            }
            self.once().await;
            let mut stop2 = stop.clone();
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = stop2.changed() => return,
            }
        }
    }
}
