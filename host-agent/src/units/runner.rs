//! One unit's runner: owns its process, restarts it per policy, stops it when
//! told, and keeps its status current. See the module docs of [`super`].

use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use mesh_protocol::{DesiredState, RestartPolicy, UnitItem, UnitState, UnitStatus};
use rustix::process::Signal;
use tokio::process::{Child, Command};
use tokio::sync::{Mutex, watch};
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep_until};
use tracing::{info, warn};

use super::Shared;
use super::logs::{RotatingLog, pump};
use super::process::{remove_pid_file, signal_group, write_pid_file};

/// `PATH` for units when the agent has none.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// A process of the unit that runs now.
struct Running {
    child: Child,
    pid: u32,
    started: Instant,
}

pub(super) struct Runner {
    id: u64,
    shared: Arc<Shared>,
    control: watch::Receiver<UnitItem>,
    item: UnitItem,
    dir: PathBuf,
    stdout: Arc<Mutex<RotatingLog>>,
    stderr: Arc<Mutex<RotatingLog>>,
    /// Restarts since the unit was declared (or declared running again).
    restarts: u32,
    /// Whether a process was started since then (the next start is a restart).
    started_once: bool,
    /// The wait before the next restart.
    backoff: Duration,
    state: UnitState,
    pid: Option<u32>,
    exit_code: Option<i32>,
    started_at: Option<DateTime<Utc>>,
}

impl Runner {
    pub(super) fn new(id: u64, shared: Arc<Shared>, control: watch::Receiver<UnitItem>) -> Self {
        let item = control.borrow().clone();
        let dir = shared.units_dir.join(&item.name);
        let log = |name: &str| {
            Arc::new(Mutex::new(RotatingLog::new(
                dir.join(name),
                shared.config.log_max_bytes,
                shared.config.log_files,
            )))
        };
        let (stdout, stderr) = (log("stdout.log"), log("stderr.log"));
        let backoff = shared.config.restart_backoff_min;
        Runner {
            id,
            shared,
            control,
            item,
            dir,
            stdout,
            stderr,
            restarts: 0,
            started_once: false,
            backoff,
            state: UnitState::Starting,
            pid: None,
            exit_code: None,
            started_at: None,
        }
    }

    fn publish(&self) {
        self.shared.update(
            self.id,
            UnitStatus {
                name: self.item.name.clone(),
                module: self.item.module.clone(),
                state: self.state,
                pid: self.pid,
                exit_code: self.exit_code,
                restarts: self.restarts,
                started_at: self.started_at,
            },
        );
    }

    /// Run until the unit is no longer declared (the control sender is dropped),
    /// then stop its process and drop its status entry.
    pub(super) async fn run(mut self, predecessor: Option<JoinHandle<()>>) {
        let want = self.item.desired == DesiredState::Running;
        self.state = if want {
            UnitState::Starting
        } else {
            UnitState::Stopped
        };
        // A runner of the same name being stopped (removed, or replaced for a new
        // spec) finishes first: never two processes of one unit.
        if let Some(p) = predecessor {
            let _ = p.await;
        }
        self.publish();
        if let Err(e) = tokio::fs::create_dir_all(&self.dir).await {
            warn!(unit = %self.item.name, dir = %self.dir.display(), error = %e, "cannot create the unit's directory");
        }
        let mut running: Option<Running> = None;
        let mut next_start: Option<Instant> = want.then(Instant::now);

        loop {
            if self.item.desired == DesiredState::Stopped {
                next_start = None;
                if let Some(r) = running.take() {
                    self.stop(r).await;
                }
                if self.state != UnitState::Stopped {
                    self.state = UnitState::Stopped;
                    self.pid = None;
                    self.publish();
                }
            } else if running.is_none() && next_start.is_some_and(|t| t <= Instant::now()) {
                next_start = None;
                match self.spawn() {
                    Ok(r) => running = Some(r),
                    Err(e) => {
                        warn!(unit = %self.item.name, command = %self.item.command, error = %e, "cannot start the unit");
                        next_start = self.exited(false, None, Duration::ZERO);
                    }
                }
            }

            tokio::select! {
                status = wait(&mut running), if running.is_some() => {
                    let Some(r) = running.take() else { continue };
                    // What is left of the group goes with its leader.
                    let _ = signal_group(r.pid, Signal::KILL);
                    remove_pid_file(&self.dir);
                    let ran = r.started.elapsed();
                    let (ok, code) = match status {
                        Ok(s) => (s.success(), Some(exit_code(s))),
                        Err(e) => {
                            warn!(unit = %self.item.name, error = %e, "cannot wait for the unit's process");
                            (false, None)
                        }
                    };
                    info!(unit = %self.item.name, pid = r.pid, exit_code = ?code, ran_for = ?ran, "unit process exited");
                    next_start = self.exited(ok, code, ran);
                }
                () = sleep_until(next_start.unwrap_or_else(Instant::now)), if next_start.is_some() && running.is_none() => {}
                changed = self.control.changed() => {
                    if changed.is_err() {
                        // No longer declared.
                        if let Some(r) = running.take() {
                            self.stop(r).await;
                        }
                        self.shared.forget(self.id, &self.item.name);
                        return;
                    }
                    let new = self.control.borrow_and_update().clone();
                    let restart_now = self.item.desired == DesiredState::Stopped
                        && new.desired == DesiredState::Running;
                    let policy_changed = new.restart != self.item.restart;
                    self.item = new;
                    if restart_now {
                        // Declared running again: a fresh start, a fresh count.
                        self.restarts = 0;
                        self.started_once = false;
                        self.backoff = self.shared.config.restart_backoff_min;
                        self.exit_code = None;
                        self.state = UnitState::Starting;
                        self.publish();
                        next_start = Some(Instant::now());
                    } else if policy_changed && running.is_none() && self.item.desired == DesiredState::Running {
                        // The new policy decides about the exit already seen.
                        let ok = self.exit_code == Some(0);
                        if restarts_after(self.item.restart, ok) {
                            if next_start.is_none() {
                                next_start = Some(Instant::now());
                            }
                        } else {
                            next_start = None;
                            self.state = if ok { UnitState::Exited } else { UnitState::Failed };
                            self.publish();
                        }
                    }
                }
            }
        }
    }

    /// Record an exit (or a failed start) and decide about a restart: the time
    /// of the next start, if any.
    fn exited(&mut self, ok: bool, code: Option<i32>, ran: Duration) -> Option<Instant> {
        let cfg = &self.shared.config;
        if ran >= cfg.restart_reset_after {
            self.backoff = cfg.restart_backoff_min;
        }
        self.pid = None;
        self.exit_code = code;
        let next = if restarts_after(self.item.restart, ok) {
            let delay = self.backoff;
            self.backoff = (self.backoff * 2).min(cfg.restart_backoff_max);
            // `starting`: a restart is pending after a clean exit; `failed`: after
            // a failure.
            self.state = if ok {
                UnitState::Starting
            } else {
                UnitState::Failed
            };
            Some(Instant::now() + delay)
        } else {
            self.state = if ok {
                UnitState::Exited
            } else {
                UnitState::Failed
            };
            None
        };
        self.publish();
        next
    }

    fn spawn(&mut self) -> std::io::Result<Running> {
        let item = &self.item;
        let mut cmd = Command::new(&item.command);
        cmd.args(&item.args).env_clear().env(
            "PATH",
            std::env::var_os("PATH").unwrap_or_else(|| DEFAULT_PATH.into()),
        );
        for var in ["HOME", "LANG"] {
            if let Some(v) = std::env::var_os(var) {
                cmd.env(var, v);
            }
        }
        cmd.env("MESH_UNIT", &item.name)
            .env("MESH_MODULE", &item.module)
            .envs(&item.env)
            .current_dir(self.working_dir())
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(false);
        let mut child = cmd.spawn()?;
        let Some(pid) = child.id() else {
            return Err(std::io::Error::other("the process exited at once"));
        };
        if let Err(e) = write_pid_file(&self.dir, pid) {
            warn!(unit = %item.name, error = %e, "cannot write the pid file");
        }
        if let Some(out) = child.stdout.take() {
            tokio::spawn(pump(out, self.stdout.clone(), item.name.clone()));
        }
        if let Some(err) = child.stderr.take() {
            tokio::spawn(pump(err, self.stderr.clone(), item.name.clone()));
        }
        if self.started_once {
            self.restarts = self.restarts.saturating_add(1);
            self.shared.metrics.unit_restarted();
        }
        self.started_once = true;
        info!(unit = %item.name, pid, restarts = self.restarts, "unit process started");
        self.state = UnitState::Running;
        self.pid = Some(pid);
        self.exit_code = None;
        self.started_at = Some(Utc::now());
        self.publish();
        Ok(Running {
            child,
            pid,
            started: Instant::now(),
        })
    }

    /// `<root>/<working_dir>`, or the root.
    fn working_dir(&self) -> PathBuf {
        match &self.item.working_dir {
            Some(d) => self.shared.root.join(d.trim_start_matches('/')),
            None => self.shared.root.clone(),
        }
    }

    /// SIGTERM to the group; SIGKILL after the stop timeout; wait for the leader.
    async fn stop(&mut self, mut r: Running) {
        let name = &self.item.name;
        if let Err(e) = signal_group(r.pid, Signal::TERM) {
            warn!(unit = %name, pid = r.pid, error = %e, "cannot signal the unit");
        }
        let timeout = self.shared.config.stop_timeout;
        let status = match tokio::time::timeout(timeout, r.child.wait()).await {
            Ok(s) => s,
            Err(_) => {
                warn!(unit = %name, pid = r.pid, ?timeout, "unit ignored SIGTERM; killing it");
                let _ = signal_group(r.pid, Signal::KILL);
                r.child.wait().await
            }
        };
        let _ = signal_group(r.pid, Signal::KILL);
        remove_pid_file(&self.dir);
        self.exit_code = status.ok().map(exit_code);
        self.pid = None;
        self.state = UnitState::Stopped;
        info!(unit = %name, pid = r.pid, exit_code = ?self.exit_code, "unit stopped");
        self.publish();
    }
}

fn restarts_after(policy: RestartPolicy, ok: bool) -> bool {
    match policy {
        RestartPolicy::Always => true,
        RestartPolicy::OnFailure => !ok,
        RestartPolicy::Never => false,
    }
}

/// The exit code, or 128 + the signal for a process killed by one (as shells
/// report it).
fn exit_code(s: ExitStatus) -> i32 {
    s.code()
        .or_else(|| s.signal().map(|sig| 128 + sig))
        .unwrap_or(-1)
}

async fn wait(running: &mut Option<Running>) -> std::io::Result<ExitStatus> {
    match running {
        Some(r) => r.child.wait().await,
        None => std::future::pending().await,
    }
}
