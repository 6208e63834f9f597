//! The nemesis: lands each fault of the schedule at its time and heals it
//! after its duration, recording both in the history. Kinds:
//!
//! - `controller-kill`: SIGKILL, restarted by the harness (the supervisor);
//! - `agent-kill`: SIGKILL of one agent (its units live on), restarted;
//! - `agent-pause`: SIGSTOP of one agent for longer than the grace, SIGCONT;
//! - `partition`: every packet through one to three hosts' LAN interface
//!   dropped (an nftables table in their namespaces), the table deleted;
//! - `rabbitmq-restart`: `rabbitmqctl stop_app`, `start_app`;
//! - `postgres-restart`: `pg_ctlcluster … stop -m fast|immediate`, `start`;
//! - `broker-alarm`: the disk free limit above any disk, or the memory
//!   watermark near zero (every publisher blocked), then the originals.

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, anyhow};
use tokio::sync::Mutex;

use crate::fleet::{Fleet, capture, run};
use crate::history::{Event, History};
use crate::schedule::Fault;

pub use mesh_e2e::sim::BrokerLimits;

/// The machine's PostgreSQL cluster version (`pg_lsclusters`).
fn postgres_version() -> anyhow::Result<String> {
    let out = capture(Command::new("pg_lsclusters").arg("-h"))?;
    out.lines()
        .find(|l| l.split_whitespace().nth(1) == Some("main"))
        .and_then(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .ok_or_else(|| anyhow!("no `main` cluster in pg_lsclusters: {out}"))
}

pub struct Nemesis {
    pub fleet: Arc<Mutex<Fleet>>,
    pub history: History,
    pub limits: Option<BrokerLimits>,
    pub admin_db: String,
}

impl Nemesis {
    /// Land `fault`.
    pub async fn start(&self, f: &Fault) -> anyhow::Result<()> {
        let mut fleet = self.fleet.lock().await;
        match f.kind.as_str() {
            "controller-kill" => {
                fleet.mesh.kill_controller();
                fleet.update_pids();
            }
            "agent-kill" => {
                for &i in &f.agents {
                    fleet.kill_agent(i);
                }
            }
            "agent-pause" => {
                for &i in &f.agents {
                    fleet.signal_agent(i, "-STOP")?;
                }
            }
            "partition" => {
                for &i in &f.agents {
                    fleet.partition(i)?;
                }
            }
            "rabbitmq-restart" => {
                drop(fleet);
                blocking(|| run(Command::new("rabbitmqctl").args(["-q", "stop_app"]))).await?;
            }
            "postgres-restart" => {
                drop(fleet);
                let mode = f.variant.clone().unwrap_or_else(|| "fast".into());
                blocking(move || {
                    let ver = postgres_version()?;
                    run(Command::new("pg_ctlcluster").args([
                        "--skip-systemctl-redirect",
                        &ver,
                        "main",
                        "stop",
                        "-m",
                        &mode,
                    ]))
                })
                .await?;
            }
            "broker-alarm" => {
                drop(fleet);
                let variant = f.variant.clone().unwrap_or_else(|| "disk".into());
                blocking(move || {
                    if variant == "memory" {
                        run(Command::new("rabbitmqctl").args([
                            "-q",
                            "set_vm_memory_high_watermark",
                            "0.0000001",
                        ]))
                    } else {
                        // A petabyte: above the free space of any disk here.
                        run(Command::new("rabbitmqctl").args([
                            "-q",
                            "set_disk_free_limit",
                            "1000000000000000",
                        ]))
                    }
                })
                .await?;
            }
            other => anyhow::bail!("unknown fault kind {other}"),
        }
        Ok(())
    }

    /// Heal `fault`.
    pub async fn heal(&self, f: &Fault) -> anyhow::Result<()> {
        let mut fleet = self.fleet.lock().await;
        match f.kind.as_str() {
            "controller-kill" => {
                let r = fleet.mesh.start_controller(&[]).await;
                fleet.update_pids();
                r?;
            }
            "agent-kill" => {
                for &i in &f.agents {
                    fleet.start_agent(i)?;
                }
            }
            "agent-pause" => {
                for &i in &f.agents {
                    fleet.signal_agent(i, "-CONT")?;
                }
            }
            "partition" => {
                for &i in &f.agents {
                    fleet.heal_partition(i)?;
                }
            }
            "rabbitmq-restart" => {
                drop(fleet);
                blocking(|| {
                    run(Command::new("rabbitmqctl").args(["-q", "start_app"]))?;
                    run(Command::new("rabbitmqctl").args([
                        "-q",
                        "await_startup",
                        "--timeout",
                        "60",
                    ]))
                })
                .await?;
            }
            "postgres-restart" => {
                drop(fleet);
                blocking(|| {
                    let ver = postgres_version()?;
                    run(Command::new("pg_ctlcluster").args([
                        "--skip-systemctl-redirect",
                        &ver,
                        "main",
                        "start",
                    ]))
                })
                .await?;
                let url = self.admin_db.clone();
                mesh_e2e::wait_for(
                    "PostgreSQL to accept connections",
                    Duration::from_secs(60),
                    || {
                        let url = url.clone();
                        async move {
                            Ok(sqlx::PgPool::connect(&url).await.ok().map(|p| {
                                tokio::spawn(async move { p.close().await });
                            }))
                        }
                    },
                )
                .await?;
            }
            "broker-alarm" => {
                drop(fleet);
                let limits = self
                    .limits
                    .clone()
                    .ok_or_else(|| anyhow!("the broker's limits were not read"))?;
                blocking(move || limits.restore()).await?;
            }
            other => anyhow::bail!("unknown fault kind {other}"),
        }
        Ok(())
    }

    /// Run the faults of the schedule from `start`; returns when the last
    /// one is healed (or at `stop`, healing what is active).
    pub async fn run(
        &self,
        faults: &[Fault],
        start: Instant,
        stop: tokio::sync::watch::Receiver<bool>,
    ) {
        let mut actions: Vec<(u64, bool, &Fault)> = faults
            .iter()
            .flat_map(|f| [(f.at_ms, true, f), (f.end_ms(), false, f)])
            .collect();
        // Heals before starts at the same instant.
        actions.sort_by_key(|(t, is_start, f)| (*t, *is_start, f.id));
        let mut active: Vec<&Fault> = Vec::new();
        for (t, is_start, f) in actions {
            let at = start + Duration::from_millis(t);
            if *stop.borrow() {
                break;
            }
            let mut stop2 = stop.clone();
            tokio::select! {
                _ = tokio::time::sleep_until(at.into()) => {}
                _ = stop2.changed() => break,
            }
            if is_start {
                self.land(f).await;
                active.push(f);
            } else if active.iter().any(|a| a.id == f.id) {
                self.cure(f).await;
                active.retain(|a| a.id != f.id);
            }
        }
        for f in active {
            self.cure(f).await;
        }
    }

    pub async fn land(&self, f: &Fault) {
        let names: Vec<String> = {
            let fleet = self.fleet.lock().await;
            f.agents
                .iter()
                .map(|&i| fleet.agents[i].host.node.clone())
                .collect()
        };
        self.history.record(Event::FaultStart {
            fault: f.id,
            kind: f.kind.clone(),
            agents: names,
            variant: f.variant.clone(),
        });
        eprintln!(
            "[{:>6.1}s] fault {} start: {} {:?} {}",
            self.history.now_ms() as f64 / 1000.0,
            f.id,
            f.kind,
            f.agents,
            f.variant.as_deref().unwrap_or("")
        );
        if let Err(e) = self.start(f).await {
            self.history.record(Event::Note {
                text: format!("fault {} ({}) did not start cleanly: {e:#}", f.id, f.kind),
            });
        }
    }

    pub async fn cure(&self, f: &Fault) {
        let error = self.heal(f).await.err().map(|e| format!("{e:#}"));
        eprintln!(
            "[{:>6.1}s] fault {} healed: {}{}",
            self.history.now_ms() as f64 / 1000.0,
            f.id,
            f.kind,
            error
                .as_deref()
                .map(|e| format!(" (error: {e})"))
                .unwrap_or_default()
        );
        self.history.record(Event::FaultHeal {
            fault: f.id,
            kind: f.kind.clone(),
            error,
        });
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> anyhow::Result<T> + Send + 'static,
) -> anyhow::Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .context("a blocking task panicked")?
}
