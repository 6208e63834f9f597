//! One unit's runner: owns its process (through the process's shim), restarts
//! it per policy, stops it when told, and keeps its status current. See the
//! module docs of [`super`].

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use mesh_protocol::{DesiredState, RestartPolicy, UnitItem, UnitState, UnitStatus};
use rustix::process::Signal;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep_until};
use tracing::{info, warn};

use super::Shared;
use super::probes::{self, ExecContext, ProbeSet, UnitRef};
use super::process::{
    EXIT_FILE, ExitRecord, Found, PID_FILE, PidRecord, ProcRef, ProcessSpec, read_record,
    remove_record, signal_group,
};
use super::sandbox::{self, CgroupPlan, Limits, Plan};
use super::shim::{self, Launch, Reply};

/// `PATH` for units when the agent has none.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// How often an adopted shim is looked for in `/proc`.
const ADOPTED_POLL: Duration = Duration::from_millis(100);

/// How long a new shim may take to start its unit and answer.
const SHIM_ANSWER: Duration = Duration::from_secs(10);

/// The program run as a unit's shim when the config names none: the agent's
/// own executable, even if it was replaced on disk since it started (an
/// upgrade in progress).
const SELF_EXE: &str = "/proc/self/exe";

/// How the agent learns that a unit's shim ended.
enum ShimWatch {
    /// A shim this agent started: its child.
    Child(tokio::process::Child),
    /// An adopted shim (not this agent's child, so no `wait` for it): `/proc`,
    /// polled every [`ADOPTED_POLL`], with its start time (a recycled pid is
    /// not taken for it).
    Adopted(ProcRef),
}

impl ShimWatch {
    /// Resolves once the shim has exited (at once, every time, after that).
    async fn exited(&mut self) {
        match self {
            ShimWatch::Child(c) => {
                let _ = c.wait().await;
            }
            ShimWatch::Adopted(p) => {
                while p.alive() {
                    tokio::time::sleep(ADOPTED_POLL).await;
                }
            }
        }
    }

    fn kill(&mut self, shim: ProcRef) {
        match self {
            ShimWatch::Child(c) => {
                let _ = c.start_kill();
            }
            ShimWatch::Adopted(p) => {
                if p.alive()
                    && let Some(pid) = i32::try_from(shim.pid)
                        .ok()
                        .and_then(rustix::process::Pid::from_raw)
                {
                    let _ = rustix::process::kill_process(pid, Signal::KILL);
                }
            }
        }
    }
}

/// A process of the unit that runs now, and its shim.
pub(super) struct Running {
    watch: ShimWatch,
    shim: ProcRef,
    leader: ProcRef,
    started: Instant,
}

impl Running {
    /// A unit process a previous agent started, found through its pid file.
    pub(super) fn adopt(record: &PidRecord) -> Option<Running> {
        let shim = record.shim?;
        let watch = ShimWatch::Adopted(shim);
        let ran = record
            .started_at
            .and_then(|t| (Utc::now() - t).to_std().ok())
            .unwrap_or(Duration::ZERO);
        Some(Running {
            watch,
            shim,
            leader: record.leader(),
            started: Instant::now().checked_sub(ran).unwrap_or_else(Instant::now),
        })
    }
}

pub(super) struct Runner {
    id: u64,
    shared: Arc<Shared>,
    control: watch::Receiver<UnitItem>,
    item: UnitItem,
    dir: PathBuf,
    /// Restarts since the unit was declared (or declared running again),
    /// across agent restarts (kept in the unit's records).
    restarts: u32,
    /// Whether a process was started since then (the next start is a restart).
    started_once: bool,
    /// The wait before the next restart.
    backoff: Duration,
    state: UnitState,
    pid: Option<u32>,
    exit_code: Option<i32>,
    started_at: Option<DateTime<Utc>>,
    /// The unit's probes while its process runs (they end when dropped).
    probes: Option<ProbeSet>,
    /// The uid its process runs as (its module's user, or root).
    uid: Option<u32>,
    /// Why its last process ended, when more is known than the exit code.
    reason: Option<String>,
    /// OOM kills since it was declared (by this agent).
    oom_kills: u32,
    /// Its module's data volume's size, as of its last start or exit.
    data_bytes: Option<u64>,
}

impl Runner {
    pub(super) fn new(id: u64, shared: Arc<Shared>, control: watch::Receiver<UnitItem>) -> Self {
        let item = control.borrow().clone();
        let dir = shared.units_dir.join(&item.name);
        let backoff = shared.config.restart_backoff_min;
        Runner {
            id,
            shared,
            control,
            item,
            dir,
            restarts: 0,
            started_once: false,
            backoff,
            state: UnitState::Starting,
            pid: None,
            exit_code: None,
            started_at: None,
            probes: None,
            uid: None,
            reason: None,
            oom_kills: 0,
            data_bytes: None,
        }
    }

    fn unit_ref(&self) -> UnitRef {
        UnitRef {
            runner: self.id,
            unit: self.item.name.clone(),
            module: self.item.module.clone(),
        }
    }

    /// Start the unit's probes anew (all `unknown`) for a process that
    /// started at `started`.
    fn start_probes(&mut self, started: Instant) {
        self.probes = None;
        if self.item.probes.is_empty() {
            self.shared.board.forget(self.id, &self.item.name);
            return;
        }
        let user = (self.shared.sandbox.users && sandbox::runs_as_module(&self.item))
            .then(|| sandbox::ensure_user(&self.item.module).ok())
            .flatten()
            .map(|u| (u.uid, u.gid));
        let ctx = ExecContext {
            env: self.env(),
            dir: self.working_dir(),
            user,
        };
        self.probes = Some(ProbeSet::start(
            &self.shared.board,
            &self.unit_ref(),
            &self.item.probes,
            started,
            &ctx,
        ));
    }

    /// The process does not run: its probes stop, listed `unknown`.
    fn idle_probes(&mut self) {
        self.probes = None;
        if self.item.probes.is_empty() {
            self.shared.board.forget(self.id, &self.item.name);
        } else {
            self.shared.board.reset(
                self.id,
                &self.item.name,
                &self.item.module,
                &self.item.probes,
                probes::NOT_RUNNING,
            );
        }
    }

    /// The unit is stopped or gone: so are its probes.
    fn drop_probes(&mut self) {
        self.probes = None;
        self.shared.board.forget(self.id, &self.item.name);
    }

    fn publish(&self) {
        self.shared.update(
            self.id,
            UnitStatus {
                reason: self.reason.clone(),
                oom_kills: self.oom_kills,
                uid: self.uid,
                data_bytes: self.data_bytes,
                revision: self.item.revision,
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

    /// Take over what a previous agent left of this unit (see
    /// [`super::process::scan`]): a running process of the same spec is
    /// adopted as it is; one of another spec is stopped (a new spec is a new
    /// unit); an exit while no agent watched is handled as if it had been
    /// watched (restart policy, the restart counted). Returns the process that
    /// runs now and the time of the next start.
    async fn inherit(&mut self, found: Option<Found>) -> (Option<Running>, Option<Instant>) {
        let want = self.item.desired == DesiredState::Running;
        let fresh = want.then(Instant::now);
        let spec = ProcessSpec::of(&self.item);
        let name = self.item.name.clone();
        match found {
            None => (None, fresh),
            Some(Found::Running(record)) => {
                let Some(r) = Running::adopt(&record) else {
                    return (None, fresh);
                };
                if record.spec.as_ref() != Some(&spec) {
                    info!(unit = %name, pid = record.pid, "the unit's spec changed while the agent was away; restarting it");
                    self.stop(r).await;
                    self.state = UnitState::Starting;
                    self.exit_code = None;
                    return (None, fresh);
                }
                info!(unit = %name, pid = record.pid, restarts = record.restarts, "adopted the unit's running process");
                self.restarts = record.restarts;
                self.started_once = true;
                self.state = UnitState::Running;
                self.pid = Some(record.pid);
                self.started_at = record.started_at;
                self.uid = process_uid(record.pid);
                self.measure_volume();
                self.publish();
                (Some(r), None)
            }
            Some(Found::Exited(exit)) => {
                if exit.spec != spec || !want {
                    remove_record(&self.dir, EXIT_FILE);
                    return (None, fresh);
                }
                info!(unit = %name, pid = exit.pid, exit_code = ?exit.code, "the unit exited while the agent was away");
                self.restarts = exit.restarts;
                self.started_once = true;
                self.ended_because(exit.reason.clone());
                (None, self.exited(exit.success, exit.code, exit.ran()))
            }
            Some(Found::Lost(record)) => {
                if record.spec.as_ref() != Some(&spec) || !want {
                    return (None, fresh);
                }
                info!(unit = %name, pid = record.pid, "the unit's process ended unrecorded while the agent was away");
                self.restarts = record.restarts;
                self.started_once = true;
                (None, self.exited(false, None, Duration::ZERO))
            }
        }
    }

    /// Run until the unit is no longer declared (the control sender is dropped),
    /// then stop its process and drop its status entry. `found` is what a
    /// previous agent left of the unit.
    // Long on purpose: a unit's whole supervision (start, wait, restart with
    // backoff, stop, a new spec, an artifact arriving) is one loop over its
    // events, so that every transition of the unit reads in one place.
    pub(super) async fn run(mut self, predecessor: Option<JoinHandle<()>>, found: Option<Found>) {
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
        self.shared.metrics.unit_known(&self.item.name);
        if let Err(e) = tokio::fs::create_dir_all(&self.dir).await {
            warn!(unit = %self.item.name, dir = %self.dir.display(), error = %e, "cannot create the unit's directory");
        }
        let (mut running, mut next_start) = self.inherit(found).await;
        let mut cache = self.shared.cache.subscribe();
        let mut waiting_artifact = false;
        self.publish();
        match &running {
            Some(r) => self.start_probes(r.started),
            None if self.item.desired == DesiredState::Running => self.idle_probes(),
            None => {}
        }

        loop {
            if self.item.desired == DesiredState::Stopped {
                next_start = None;
                self.drop_probes();
                if let Some(r) = running.take() {
                    self.stop(r).await;
                }
                if self.state != UnitState::Stopped {
                    self.state = UnitState::Stopped;
                    self.pid = None;
                    self.publish();
                }
            } else if running.is_none()
                && next_start.is_some_and(|t| t <= Instant::now())
                && self.artifact_missing()
            {
                // Not from the network, not in a loop: the cache's next
                // artifact (or the next declaration) tries again.
                next_start = None;
                waiting_artifact = true;
                warn!(unit = %self.item.name, artifact = ?self.item.artifact, "the unit's artifact is not cached; not starting it until it is");
                self.pid = None;
                self.state = UnitState::Failed;
                self.publish();
            } else if running.is_none() && next_start.is_some_and(|t| t <= Instant::now()) {
                next_start = None;
                match self.spawn().await {
                    Ok(r) => {
                        self.start_probes(r.started);
                        running = Some(r);
                    }
                    Err(e) => {
                        warn!(unit = %self.item.name, command = %self.item.command, error = %e, "cannot start the unit");
                        next_start = self.exited(false, None, Duration::ZERO);
                    }
                }
            }

            tokio::select! {
                () = shim_exited(&mut running), if running.is_some() => {
                    let Some(r) = running.take() else { continue };
                    self.idle_probes();
                    let (ok, code, reason) = collect_exit(&self.item.name, &self.dir, &r);
                    let ran = r.started.elapsed();
                    info!(unit = %self.item.name, pid = r.leader.pid, exit_code = ?code, ?reason, ran_for = ?ran, "unit process exited");
                    self.ended_because(reason);
                    self.measure_volume();
                    next_start = self.exited(ok, code, ran);
                }
                () = sleep_until(next_start.unwrap_or_else(Instant::now)), if next_start.is_some() && running.is_none() => {}
                changed = cache.changed(), if waiting_artifact => {
                    if changed.is_err() || !self.artifact_missing() {
                        waiting_artifact = false;
                        if self.item.desired == DesiredState::Running {
                            next_start = Some(Instant::now());
                        }
                    }
                }
                changed = self.control.changed() => {
                    if changed.is_err() {
                        // No longer declared.
                        self.drop_probes();
                        if let Some(r) = running.take() {
                            self.stop(r).await;
                        }
                        remove_record(&self.dir, EXIT_FILE);
                        self.shared.forget(self.id, &self.item.name);
                        return;
                    }
                    let new = self.control.borrow_and_update().clone();
                    let restart_now = self.item.desired == DesiredState::Stopped
                        && new.desired == DesiredState::Running;
                    let policy_changed = new.restart != self.item.restart;
                    if waiting_artifact && new.desired == DesiredState::Running {
                        // The next declaration tries again.
                        waiting_artifact = false;
                        next_start = Some(Instant::now());
                    }
                    let probes_changed = new.probes != self.item.probes;
                    self.item = new;
                    if probes_changed && self.item.desired == DesiredState::Running {
                        // Other probes: they start anew.
                        match &running {
                            Some(r) => self.start_probes(r.started),
                            None => self.idle_probes(),
                        }
                    }
                    if restart_now {
                        // Declared running again: a fresh start, a fresh count.
                        self.restarts = 0;
                        self.oom_kills = 0;
                        self.reason = None;
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

    /// Note why the last process ended (an OOM kill counts).
    fn ended_because(&mut self, reason: Option<String>) {
        if reason.as_deref() == Some(mesh_protocol::REASON_OOM_KILLED) {
            self.oom_kills = self.oom_kills.saturating_add(1);
            warn!(unit = %self.item.name, oom_kills = self.oom_kills, memory_limit = ?self.item.limits.memory_bytes, "the unit was killed for going over its memory limit");
        }
        self.reason = reason;
    }

    /// Its module's data volume's size, now.
    fn measure_volume(&mut self) {
        let dir = sandbox::data_dir(&self.shared.state_dir, &self.item.module);
        self.data_bytes = dir.is_dir().then(|| sandbox::tree_bytes(&dir));
    }

    /// The unit's box (decision 0051): its module's user (made if new) unless
    /// it runs as root, its data volume, and its cgroup with its limits.
    async fn boxed(&mut self) -> std::io::Result<Plan> {
        let shared = self.shared.clone();
        let env = &shared.sandbox;
        let user = if env.users && sandbox::runs_as_module(&self.item) {
            let module = self.item.module.clone();
            let made = tokio::task::spawn_blocking(move || sandbox::ensure_user(&module))
                .await
                .map_err(std::io::Error::other)??;
            Some(made)
        } else {
            None
        };
        sandbox::ensure_volume(&self.shared.state_dir, &self.item.module, user.as_ref())?;
        self.uid = Some(
            user.as_ref()
                .map_or_else(|| rustix::process::geteuid().as_raw(), |u| u.uid),
        );
        self.measure_volume();
        Ok(Plan {
            uid: user.as_ref().map(|u| u.uid),
            gid: user.as_ref().map(|u| u.gid),
            cgroup: env.backend.clone().map(|backend| CgroupPlan {
                backend,
                name: format!("mesh-{}-{}", self.item.name, env.key),
                limits: Limits::of(&self.item.limits, self.shared.config.default_pids),
            }),
        })
    }

    /// What the shim is told to run.
    fn launch(&self, restarts: u32, sandbox: Plan) -> Launch {
        let item = &self.item;
        let env = self.env();
        Launch {
            unit: item.name.clone(),
            dir: self.dir.clone(),
            command: self.command(),
            args: item.args.clone(),
            env,
            working_dir: self.working_dir(),
            log_max_bytes: self.shared.config.log_max_bytes,
            log_files: self.shared.config.log_files,
            restarts,
            spec: ProcessSpec::of(item),
            sandbox,
        }
    }

    /// The unit's environment (its `exec` probes run in it too).
    fn env(&self) -> std::collections::BTreeMap<String, String> {
        let item = &self.item;
        let mut env = std::collections::BTreeMap::new();
        let path = std::env::var("PATH").unwrap_or_else(|_| DEFAULT_PATH.to_owned());
        env.insert("PATH".to_owned(), path);
        for var in ["HOME", "LANG"] {
            if let Ok(v) = std::env::var(var) {
                env.insert(var.to_owned(), v);
            }
        }
        env.insert("MESH_UNIT".to_owned(), item.name.clone());
        env.insert("MESH_MODULE".to_owned(), item.module.clone());
        let data = sandbox::data_dir(&self.shared.state_dir, &item.module)
            .to_string_lossy()
            .into_owned();
        if self.shared.sandbox.users && sandbox::runs_as_module(item) {
            // The agent's HOME is not the module user's to read.
            env.insert("HOME".to_owned(), data.clone());
        }
        env.insert("MESH_DATA_DIR".to_owned(), data);
        if let Some(dir) = self.artifact_dir() {
            env.insert(
                "MESH_ARTIFACT_DIR".to_owned(),
                dir.to_string_lossy().into_owned(),
            );
        }
        env.extend(item.env.iter().map(|(k, v)| (k.clone(), v.clone())));
        env
    }

    /// Start the unit through a new shim and wait for its answer.
    // Long on purpose: one start of the shim, in order (the sandbox plan, the
    // launch spec, the shim's process, its answer awaited within a deadline);
    // each step uses the last.
    async fn spawn(&mut self) -> std::io::Result<Running> {
        let restarts = if self.started_once {
            self.restarts.saturating_add(1)
        } else {
            self.restarts
        };
        let plan = self.boxed().await?;
        let launch =
            serde_json::to_vec(&self.launch(restarts, plan)).map_err(std::io::Error::other)?;
        let shim_log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("shim.log"))?;
        let program = self
            .shared
            .config
            .shim_program
            .clone()
            .unwrap_or_else(|| PathBuf::from(SELF_EXE));
        let mut child = tokio::process::Command::new(program)
            .arg(shim::SUBCOMMAND)
            .env_clear()
            .current_dir("/")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(shim_log)
            .kill_on_drop(false)
            .spawn()?;
        let shim = ProcRef::of(child.id().unwrap_or(0));
        let answer = async {
            let mut stdin = child
                .stdin
                .take()
                .ok_or_else(|| std::io::Error::other("no stdin"))?;
            stdin.write_all(&launch).await?;
            drop(stdin);
            let stdout = child
                .stdout
                .take()
                .ok_or_else(|| std::io::Error::other("no stdout"))?;
            let mut line = String::new();
            BufReader::new(stdout).read_line(&mut line).await?;
            serde_json::from_str::<Reply>(&line)
                .map_err(|e| std::io::Error::other(format!("the unit's shim gave no answer ({e})")))
        };
        let reply = match tokio::time::timeout(SHIM_ANSWER, answer).await {
            Ok(r) => r,
            Err(_) => Err(std::io::Error::other(
                "the unit's shim did not answer in time",
            )),
        };
        let (pid, start_time, started_at) = match reply {
            Ok(Reply::Started {
                pid,
                start_time,
                started_at,
            }) => (pid, start_time, started_at),
            Ok(Reply::Failed { error }) => {
                let _ = child.wait().await;
                return Err(std::io::Error::other(error));
            }
            Err(e) => {
                let _ = child.start_kill();
                let _ = child.wait().await;
                // If it got as far as starting the unit, that goes too.
                if let Some(rec) = read_record::<PidRecord>(&self.dir, PID_FILE)
                    && rec.leader_running()
                {
                    let _ = signal_group(rec.pid, Signal::KILL);
                }
                remove_record(&self.dir, PID_FILE);
                return Err(e);
            }
        };
        if self.started_once {
            self.shared.metrics.unit_restarted(&self.item.name);
        }
        self.restarts = restarts;
        self.started_once = true;
        info!(unit = %self.item.name, pid, restarts = self.restarts, "unit process started");
        self.state = UnitState::Running;
        self.pid = Some(pid);
        self.exit_code = None;
        self.started_at = Some(started_at);
        self.publish();
        Ok(Running {
            watch: ShimWatch::Child(child),
            shim,
            leader: ProcRef { pid, start_time },
            started: Instant::now(),
        })
    }

    /// `<root>/<working_dir>`, or the artifact's directory, or the root.
    fn working_dir(&self) -> PathBuf {
        match (&self.item.working_dir, self.artifact_dir()) {
            (Some(d), _) => self.shared.root.join(d.trim_start_matches('/')),
            (None, Some(a)) => a,
            (None, None) => self.shared.root.clone(),
        }
    }

    /// The cached directory of the unit's artifact, if it has one.
    fn artifact_dir(&self) -> Option<PathBuf> {
        self.item
            .artifact
            .as_ref()
            .map(|d| crate::artifacts::artifact_dir(&self.shared.state_dir, d))
    }

    /// What the shim runs: a relative command of a unit with an artifact is
    /// the artifact's file.
    fn command(&self) -> String {
        match self.artifact_dir() {
            Some(dir) if !self.item.command.starts_with('/') => {
                dir.join(&self.item.command).to_string_lossy().into_owned()
            }
            _ => self.item.command.clone(),
        }
    }

    /// The unit runs from an artifact that is not cached.
    fn artifact_missing(&self) -> bool {
        self.artifact_dir().is_some_and(|d| !d.is_dir())
    }

    /// Stop the process and record it stopped.
    async fn stop(&mut self, r: Running) {
        self.exit_code = stop_process(
            &self.item.name,
            &self.dir,
            r,
            self.shared.config.stop_timeout,
        )
        .await;
        self.pid = None;
        self.state = UnitState::Stopped;
        self.publish();
    }
}

/// SIGTERM to the unit's group; SIGKILL after `timeout`; wait for its shim to
/// record the exit. Returns the exit code.
pub(super) async fn stop_process(
    name: &str,
    dir: &Path,
    mut r: Running,
    timeout: Duration,
) -> Option<i32> {
    if r.leader.leads_its_group()
        && let Err(e) = signal_group(r.leader.pid, Signal::TERM)
    {
        warn!(unit = %name, pid = r.leader.pid, error = %e, "cannot signal the unit");
    }
    if tokio::time::timeout(timeout, r.watch.exited())
        .await
        .is_err()
    {
        warn!(unit = %name, pid = r.leader.pid, ?timeout, "unit ignored SIGTERM; killing it");
        let _ = signal_group(r.leader.pid, Signal::KILL);
        let grace = shim::DRAIN + Duration::from_secs(3);
        if tokio::time::timeout(grace, r.watch.exited()).await.is_err() {
            warn!(unit = %name, shim = r.shim.pid, "the unit's shim does not end; killing it");
            r.watch.kill(r.shim);
            let _ = tokio::time::timeout(grace, r.watch.exited()).await;
        }
    }
    let (_, code, _) = collect_exit(name, dir, &r);
    info!(unit = %name, pid = r.leader.pid, exit_code = ?code, "unit stopped");
    code
}

/// After the shim ended: how the unit ended, from its exit record. The record
/// stays until the unit's next process replaces it (or the unit goes): an agent
/// that stops before the restart leaves the next one the exit to act on (its
/// restart policy, its restart count).
/// A shim that ended without one (killed) leaves a unit whose output has
/// nowhere to go: what is left of it is killed, and it counts as failed.
fn collect_exit(name: &str, dir: &Path, r: &Running) -> (bool, Option<i32>, Option<String>) {
    let exit: Option<ExitRecord> = read_record(dir, EXIT_FILE);
    remove_record(dir, PID_FILE);
    match exit {
        Some(e) if e.pid == r.leader.pid => (e.success, e.code, e.reason),
        _ => {
            warn!(unit = %name, pid = r.leader.pid, shim = r.shim.pid, "the unit's shim ended without recording the unit's exit");
            if r.leader.leads_its_group() {
                let _ = signal_group(r.leader.pid, Signal::KILL);
            }
            (false, None, None)
        }
    }
}

/// The real uid of `pid`, from `/proc/<pid>/status`.
fn process_uid(pid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

fn restarts_after(policy: RestartPolicy, ok: bool) -> bool {
    match policy {
        RestartPolicy::Always => true,
        RestartPolicy::OnFailure => !ok,
        RestartPolicy::Never => false,
    }
}

async fn shim_exited(running: &mut Option<Running>) {
    match running {
        Some(r) => r.watch.exited().await,
        None => std::future::pending().await,
    }
}
