//! The fleet under test: the e2e harness's [`Mesh`] (the real controller on
//! an isolated database and vhost made by the test kit) and one real agent
//! per host of a [`Lan`] (network namespaces on a bridge, each agent
//! reaching the broker over AMQPS at the advertised address, as a second
//! machine would). The harness is the supervisor: it restarts what the
//! nemesis killed.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context as _, anyhow};
use mesh_e2e::netns::{Lan, LanHost};
use mesh_e2e::{AGENT_OFF_THE_OVERLAY, Mesh, Proc};

use crate::schedule::ROLES;

/// Process ids the sampler reads (they change with every restart).
#[derive(Debug, Clone, Default)]
pub struct Pids {
    pub controller: Option<u32>,
    pub agents: Vec<Option<u32>>,
}

pub struct Agent {
    pub name: String,
    pub host: LanHost,
    pub role: &'static str,
    pub proc: Option<Proc>,
}

pub struct Fleet {
    pub mesh: Mesh,
    pub lan: Lan,
    pub agents: Vec<Agent>,
    pub pids: Arc<Mutex<Pids>>,
}

/// The labels of agent `i`.
pub fn role_of(i: usize) -> &'static str {
    ROLES[i % ROLES.len()]
}

/// Why this machine cannot run the soak, if it cannot.
pub fn unavailable() -> Option<String> {
    if !rustix_is_root() {
        return Some("not root (network namespaces need it)".into());
    }
    for (tool, arg) in [
        ("ip", "-V"),
        ("unshare", "--version"),
        ("nft", "--version"),
        ("rabbitmqctl", "-q status"),
    ] {
        let ok = Command::new(tool)
            .args(arg.split(' '))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok();
        if !ok {
            return Some(format!("{tool} not found"));
        }
    }
    if let Err(e) = mesh_testkit::bundle_tls() {
        return Some(format!("no bundle TLS (run bundle/up): {e}"));
    }
    None
}

fn rustix_is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .map(|l| l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}

impl Fleet {
    /// The controller, then `n` agents on a LAN of their own; returns when
    /// every node is alive.
    pub async fn raise(n: usize) -> anyhow::Result<Fleet> {
        let mut mesh = Mesh::prepare().await?;
        mesh.start_controller(&[]).await?;
        let names: Vec<String> = (0..n).map(|i| format!("h{i:02}")).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let lan = Lan::create(mesh.env.id(), &refs)?;
        let mut agents = Vec::new();
        for (i, name) in names.iter().enumerate() {
            let role = role_of(i);
            let zone = if i % 2 == 0 { "a" } else { "b" };
            let extra = format!(
                "{AGENT_OFF_THE_OVERLAY}\n[labels]\nrole = \"{role}\"\nzone = \"{zone}\"\n"
            );
            let (host, proc) = lan.spawn_agent(&mesh, i, name, &extra).await?;
            agents.push(Agent {
                name: name.clone(),
                host,
                role,
                proc: Some(proc),
            });
        }
        let pids = Arc::new(Mutex::new(Pids::default()));
        let mut fleet = Fleet {
            mesh,
            lan,
            agents,
            pids,
        };
        fleet.update_pids();
        let nodes: Vec<String> = fleet.agents.iter().map(|a| a.host.node.clone()).collect();
        mesh_e2e::wait_for(
            &format!("{n} alive nodes"),
            Duration::from_secs(120),
            || async {
                let (_, view) = fleet.mesh.get("/v1/nodes").await?;
                let alive = view["nodes"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .filter(|v| {
                                v["state"] == "alive"
                                    && v["id"]
                                        .as_str()
                                        .is_some_and(|x| nodes.iter().any(|n| n == x))
                            })
                            .count()
                    })
                    .unwrap_or(0);
                Ok((alive == n).then_some(()))
            },
        )
        .await?;
        Ok(fleet)
    }

    pub fn dir(&self) -> &Path {
        self.mesh.dir.path()
    }

    pub fn update_pids(&mut self) {
        let pids = Pids {
            controller: self.mesh.controller().map(|p| p.pid()),
            agents: self
                .agents
                .iter()
                .map(|a| a.proc.as_ref().map(Proc::pid))
                .collect(),
        };
        if let Ok(mut p) = self.pids.lock() {
            *p = pids;
        }
    }

    /// Restart agent `i` with the configuration it was enrolled with.
    pub fn start_agent(&mut self, i: usize) -> anyhow::Result<()> {
        let a = &self.agents[i];
        let config = a
            .host
            .state_dir
            .parent()
            .ok_or_else(|| anyhow!("state dir without parent"))?
            .join("agent.toml");
        let log = self.dir().join(format!("agent-{}.log", a.name));
        let append = || {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&log)
        };
        let proc = Proc::spawn(
            self.lan
                .command_with_wireguard_dir(i, &a.host.wireguard_dir, &mesh_e2e::bin("mesh-agent")?)
                .arg("run")
                .arg("--config")
                .arg(&config)
                .env("RUST_LOG", "info,mesh_host_agent=debug")
                .stdin(Stdio::null())
                .stdout(append()?)
                .stderr(append()?),
        )?;
        self.agents[i].proc = Some(proc);
        self.update_pids();
        Ok(())
    }

    pub fn kill_agent(&mut self, i: usize) {
        if let Some(mut p) = self.agents[i].proc.take() {
            p.kill();
        }
        self.update_pids();
    }

    pub fn signal_agent(&self, i: usize, signal: &str) -> anyhow::Result<()> {
        let pid = self.agents[i]
            .proc
            .as_ref()
            .map(Proc::pid)
            .ok_or_else(|| anyhow!("agent {} is not running", self.agents[i].name))?;
        run(Command::new("kill").args([signal, &pid.to_string()]))
    }

    /// Drop every packet through the host's LAN interface, both ways: the
    /// agent reaches neither the broker nor the API.
    pub fn partition(&self, i: usize) -> anyhow::Result<()> {
        let rules = "table inet mesh-soak {\n  chain out { type filter hook output priority 0; policy accept; oifname \"eth0\" drop; }\n  chain in { type filter hook input priority 0; policy accept; iifname \"eth0\" drop; }\n}\n";
        let mut child = Command::new("ip")
            .args(["netns", "exec", self.lan.ns(i), "nft", "-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("ip netns exec … nft")?;
        if let Some(mut stdin) = child.stdin.take() {
            use std::io::Write as _;
            stdin.write_all(rules.as_bytes())?;
        }
        let out = child.wait_with_output()?;
        anyhow::ensure!(
            out.status.success(),
            "nft in {}: {}",
            self.lan.ns(i),
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }

    pub fn heal_partition(&self, i: usize) -> anyhow::Result<()> {
        run(Command::new("ip").args([
            "netns",
            "exec",
            self.lan.ns(i),
            "nft",
            "delete",
            "table",
            "inet",
            "mesh-soak",
        ]))
    }

    pub fn host_dir(&self, i: usize) -> PathBuf {
        self.dir().join(format!("host-{}", self.agents[i].name))
    }
}

/// Run a command; an error with its output when it fails.
pub fn run(cmd: &mut Command) -> anyhow::Result<()> {
    let out = cmd
        .current_dir("/tmp")
        .output()
        .with_context(|| format!("running {cmd:?}"))?;
    anyhow::ensure!(
        out.status.success(),
        "{cmd:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout).trim(),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

/// A command's stdout, trimmed.
pub fn capture(cmd: &mut Command) -> anyhow::Result<String> {
    let out = cmd
        .current_dir("/tmp")
        .output()
        .with_context(|| format!("running {cmd:?}"))?;
    anyhow::ensure!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}
