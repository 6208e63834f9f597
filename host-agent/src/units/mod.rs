//! The unit supervisor: runs the units a node's inventory section declares as
//! supervised child processes, and says how they are doing.
//!
//! Level-triggered: [`Supervisor::declare`] takes the whole desired list and
//! compares it with what runs. A new unit is started; a unit no longer listed is
//! stopped and forgotten; a unit whose process spec (module, command, args, env,
//! working dir) changed is stopped and started again with the new spec, its
//! restart count reset; a change of `desired` or `restart` alone is applied in
//! place (a running process is not disturbed by a policy change).
//!
//! Each unit has a runner task that owns its process, through the process's
//! shim ([`shim`]: `mesh-agent unit-shim`, the unit's parent, which keeps its
//! output and learns its exit status, and outlives the agent):
//! - the process leads its own process group; stopping sends SIGTERM to the group,
//!   then SIGKILL after `stop_timeout`, so a unit's whole tree goes;
//! - when the process exits, what is left of its group is killed, and the restart
//!   policy decides: `always` restarts, `on_failure` restarts after a non-zero exit
//!   or a signal, `never` does not. Restarts wait a capped exponential backoff
//!   (`restart_backoff_min`, doubling up to `restart_backoff_max`), reset once the
//!   process ran for `restart_reset_after`;
//! - stdout and stderr go to rotating files under `<state_dir>/units/<name>/`
//!   (see `logs`), written by the shim;
//! - the environment is not the agent's: the process gets `PATH`, `HOME` and
//!   `LANG` from the agent (a default `PATH` if it has none), `MESH_UNIT` and
//!   `MESH_MODULE`, then the declared `env` on top;
//! - `working_dir` is applied under the agent's root, as declared files are (a
//!   unit declared with `/srv/app` next to a file `/srv/app/app.conf` finds it as
//!   `./app.conf`); without one the process starts in the root. It must exist: a
//!   missing one is a failed start (retried with backoff). `command` is not
//!   rebased: an absolute path or a name looked up in `PATH`;
//! - a unit with an `artifact` runs from the artifact cache
//!   ([`crate::artifacts`]): a relative `command` is resolved in the artifact's
//!   directory, which is also the working dir when none is declared, and the
//!   process gets `MESH_ARTIFACT_DIR`. While the artifact is not cached the
//!   unit does not start: it is `failed` (no restarts) until the cache gains
//!   it. Its `artifact` and `revision` are part of its spec: a new revision
//!   restarts it.
//!
//! The agent's own restart restarts no unit (decision 0016): on shutdown it
//! leaves them running ([`Supervisor::shutdown`]); on start
//! ([`Supervisor::start`]) it finds them through their pid files and adopts
//! those still declared with the same spec, as they are (same pid, same restart
//! count), stops the others, and restarts (and counts) those that exited while
//! it was away, as their restart policy says. [`drain_local`]
//! (`mesh-agent drain-local`) stops them all, for decommissioning.
//!
//! State changes land in a `watch` channel holding every unit's [`UnitStatus`];
//! the agent turns it into `units` reports ([`Reporter`]).
//!
//! Each runner also runs its unit's declared probes while the process runs
//! ([`probes`]); their results land on a [`probes::HealthBoard`], which the
//! agent turns into `health` reports ([`probes::HealthReporter`]).

pub mod cgroup;
mod logs;
pub mod probes;
mod process;
mod runner;
pub mod sandbox;
pub mod shim;
pub mod systemd;
pub mod tail;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use mesh_protocol::{UnitItem, UnitStatus, Units};
use serde::Deserialize;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{info, warn};

pub use logs::RotatingLog;
pub use process::{EXIT_FILE, PID_FILE, drain_local};

use crate::metrics::Metrics;
use process::{Found, ProcessSpec};

/// The directory under the state dir that holds one directory per unit.
pub const UNITS_DIR: &str = "units";

/// Units reports are sent at most this often; a burst of changes in between is
/// one report with the newest state.
pub const REPORT_MIN_INTERVAL: Duration = Duration::from_millis(500);

/// The supervisor's settings: the `[units]` table of the agent's config file.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct UnitsConfig {
    /// How long a unit's processes get between SIGTERM and SIGKILL when it is
    /// stopped (declared stopped, removed, spec changed, `mesh-agent
    /// drain-local`). Default 10 s.
    #[serde(deserialize_with = "crate::duration::de_duration")]
    pub stop_timeout: Duration,
    /// Wait before the first restart of a unit that exited. Default 1 s.
    #[serde(deserialize_with = "crate::duration::de_duration")]
    pub restart_backoff_min: Duration,
    /// The wait doubles with every restart up to this cap. Default 60 s.
    #[serde(deserialize_with = "crate::duration::de_duration")]
    pub restart_backoff_max: Duration,
    /// A process that ran at least this long before exiting is restarted after
    /// `restart_backoff_min` again (its backoff is reset). Default 60 s.
    #[serde(deserialize_with = "crate::duration::de_duration")]
    pub restart_reset_after: Duration,
    /// Size at which a unit's `stdout.log` / `stderr.log` is rotated.
    /// Default 10 MiB.
    pub log_max_bytes: u64,
    /// Rotated files kept per stream (`stdout.log.1` … `.N`); 0 keeps only the
    /// current file, truncating it when full. Default 5. Both log settings
    /// reach a unit at its (re)start: an adopted process keeps those it was
    /// started with.
    pub log_files: usize,
    /// Whether each module's units run as the module's own user `mesh-<module>`
    /// (units declared `user: root` excepted). Default true; only an agent
    /// running as root can. See [`sandbox`].
    pub module_users: bool,
    /// How units' limits are enforced: `auto` (default: systemd's transient
    /// scopes where systemd is PID 1, the cgroup filesystem elsewhere),
    /// `systemd`, `cgroupfs`, or `off`.
    pub cgroups: sandbox::CgroupMode,
    /// The cgroup (under each hierarchy) that holds the units' cgroups with the
    /// `cgroupfs` backend. Default `mesh-units`.
    pub cgroup_root: String,
    /// A unit's pids limit when it declares none. Default 4096.
    pub default_pids: u64,
    /// How long the data volume of a module that left the node is kept before
    /// it (and the module's user) is removed; never for a stateful module.
    /// Default 24 h.
    #[serde(deserialize_with = "crate::duration::de_duration")]
    pub data_retention: Duration,
    /// The program run as each unit's shim, with the argument `unit-shim`. Not
    /// a config file setting: `None` (the agent's own executable) outside
    /// tests, which run the agent inside a test binary and name `mesh-agent`.
    #[serde(skip)]
    pub shim_program: Option<PathBuf>,
}

impl Default for UnitsConfig {
    fn default() -> Self {
        UnitsConfig {
            stop_timeout: Duration::from_secs(10),
            restart_backoff_min: Duration::from_secs(1),
            restart_backoff_max: Duration::from_secs(60),
            restart_reset_after: Duration::from_secs(60),
            log_max_bytes: 10 * 1024 * 1024,
            log_files: 5,
            module_users: true,
            cgroups: sandbox::CgroupMode::Auto,
            cgroup_root: "mesh-units".to_owned(),
            default_pids: 4096,
            data_retention: Duration::from_secs(24 * 3600),
            shim_program: None,
        }
    }
}

impl UnitsConfig {
    /// Check what types cannot; errors name the field (`units.<field>`).
    pub fn validate(&self) -> Result<(), (String, String)> {
        let bad = |f: &str, r: &str| Err((format!("units.{f}"), r.to_owned()));
        if self.restart_backoff_min.is_zero() {
            return bad("restart_backoff_min", "must be greater than zero");
        }
        if self.restart_backoff_max < self.restart_backoff_min {
            return bad(
                "restart_backoff_max",
                "must not be smaller than restart_backoff_min",
            );
        }
        if self.log_max_bytes < 1024 {
            return bad("log_max_bytes", "must be at least 1024");
        }
        if self.log_files > 1000 {
            return bad("log_files", "must be at most 1000");
        }
        if self.default_pids < mesh_protocol::MIN_PIDS {
            return bad("default_pids", "must be at least 2");
        }
        if self.cgroup_root.is_empty()
            || self.cgroup_root.contains(['/', '\0'])
            || self.cgroup_root.starts_with('.')
        {
            return bad(
                "cgroup_root",
                "must be one directory name (no /, not starting with .)",
            );
        }
        Ok(())
    }
}

/// Every unit's status, by name, with the id of the runner that owns the entry
/// (a replaced runner must not remove its successor's entry).
type Snapshot = BTreeMap<String, (u64, UnitStatus)>;

/// What the runners share.
struct Shared {
    config: UnitsConfig,
    root: PathBuf,
    units_dir: PathBuf,
    status: watch::Sender<Snapshot>,
    metrics: Metrics,
    /// Every probe's result.
    board: probes::HealthBoard,
    /// The agent's state dir, where the artifact cache is.
    state_dir: PathBuf,
    /// Bumped whenever the artifact cache gains an artifact: a unit waiting
    /// for its artifact tries again.
    cache: watch::Sender<u64>,
    /// What of the sandbox this agent can give its units.
    sandbox: SandboxEnv,
}

/// What of the sandbox this agent can give (decided once, at start).
#[derive(Debug, Clone)]
pub(crate) struct SandboxEnv {
    /// Units run as their modules' users.
    pub users: bool,
    /// Who enforces limits, if anyone.
    pub backend: Option<sandbox::Backend>,
    /// Tells this agent's cgroups and scopes from another's on the same host
    /// (a hash of its units directory).
    pub key: String,
}

impl SandboxEnv {
    fn decide(config: &UnitsConfig, units_dir: &Path) -> SandboxEnv {
        let root = rustix::process::geteuid().is_root();
        let key = format!(
            "{:08x}",
            sandbox::fnv(units_dir.as_os_str().as_encoded_bytes()) as u32
        );
        if !root {
            warn!("the agent does not run as root: units run as its own user, without limits");
            return SandboxEnv {
                users: false,
                backend: None,
                key,
            };
        }
        let cgroupfs = || sandbox::Backend::Cgroupfs {
            root: config.cgroup_root.clone(),
        };
        let backend = match config.cgroups {
            sandbox::CgroupMode::Off => None,
            sandbox::CgroupMode::Systemd => Some(sandbox::Backend::Systemd),
            sandbox::CgroupMode::Cgroupfs => Some(cgroupfs()),
            sandbox::CgroupMode::Auto if systemd::booted() => Some(sandbox::Backend::Systemd),
            sandbox::CgroupMode::Auto if cgroup::detect().is_some() => Some(cgroupfs()),
            sandbox::CgroupMode::Auto => {
                warn!("no cgroup filesystem and no systemd: units' limits are not enforced");
                None
            }
        };
        if !config.module_users {
            warn!("units.module_users is off: units run as root");
        }
        info!(module_users = config.module_users, backend = ?backend, "units run boxed");
        SandboxEnv {
            users: config.module_users,
            backend,
            key,
        }
    }
}

impl Shared {
    /// Change one runner's entry and tell the watchers.
    fn update(&self, runner: u64, status: UnitStatus) {
        self.status.send_modify(|m| {
            m.insert(status.name.clone(), (runner, status));
        });
        self.count_running();
    }

    /// Drop a runner's entry (if it is still that runner's).
    fn forget(&self, runner: u64, name: &str) {
        self.status.send_if_modified(|m| {
            if m.get(name).is_some_and(|(id, _)| *id == runner) {
                m.remove(name);
                self.metrics.unit_forgotten(name);
                true
            } else {
                false
            }
        });
        self.count_running();
    }

    fn count_running(&self) {
        let n = self
            .status
            .borrow()
            .values()
            .filter(|(_, s)| s.state == mesh_protocol::UnitState::Running)
            .count();
        self.metrics.set_units_running(n);
    }
}

struct Handle {
    item: UnitItem,
    control: watch::Sender<UnitItem>,
    task: JoinHandle<()>,
}

/// Supervises the node's units. Owned by the agent's main task.
pub struct Supervisor {
    shared: Arc<Shared>,
    units: BTreeMap<String, Handle>,
    /// Runners told to stop (removed or replaced) that may not have finished yet.
    stopping: BTreeMap<String, JoinHandle<()>>,
    /// What a previous agent left, until the first [`Supervisor::declare`].
    found: Option<BTreeMap<String, Found>>,
    next_runner: u64,
    /// The modules of the declared units (none before the first
    /// declaration), for the sweep of the volumes of modules that left.
    declared_modules: watch::Sender<Option<BTreeSet<String>>>,
    sweeper: JoinHandle<()>,
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        self.sweeper.abort();
    }
}

/// Sweep the data volumes of modules that left (see [`sandbox`]) at each
/// declaration and every quarter of the retention (1 s to 1 h).
async fn sweep_volumes(
    shared: Arc<Shared>,
    mut declared: watch::Receiver<Option<BTreeSet<String>>>,
) {
    let every =
        (shared.config.data_retention / 4).clamp(Duration::from_secs(1), Duration::from_secs(3600));
    loop {
        let modules = declared.borrow_and_update().clone();
        if let Some(modules) = modules {
            let s = shared.clone();
            let _ = tokio::task::spawn_blocking(move || {
                sandbox::sweep_volumes(
                    &s.state_dir,
                    &modules,
                    s.config.data_retention,
                    s.sandbox.users,
                )
            })
            .await;
        }
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            changed = declared.changed() => if changed.is_err() { return },
        }
    }
}

impl Supervisor {
    /// A supervisor for units under `root` (working dirs) and `state_dir` (logs,
    /// pid files). Finds what a previous agent left (see `process`); the
    /// first [`Supervisor::declare`] adopts it or stops it. Unit processes left
    /// without their shim (their output has nowhere to go) are stopped here,
    /// which may take up to `config.stop_timeout`.
    pub async fn start(
        config: UnitsConfig,
        root: &Path,
        state_dir: &Path,
        metrics: Metrics,
    ) -> Supervisor {
        let units_dir = state_dir.join(UNITS_DIR);
        let (found, orphans) = process::scan(&units_dir);
        if !orphans.is_empty() {
            let groups: Vec<u32> = orphans.iter().map(|(_, pid)| *pid).collect();
            process::stop_groups(&groups, config.stop_timeout).await;
        }
        let (status, _) = watch::channel(Snapshot::new());
        metrics.set_units_running(0);
        let sandbox = SandboxEnv::decide(&config, &units_dir);
        let board = probes::HealthBoard::new(metrics.clone());
        let shared = Arc::new(Shared {
            config,
            root: root.to_owned(),
            units_dir,
            status,
            metrics,
            board,
            state_dir: state_dir.to_owned(),
            cache: watch::channel(0).0,
            sandbox,
        });
        let (declared_modules, rx) = watch::channel(None);
        let sweeper = tokio::spawn(sweep_volumes(shared.clone(), rx));
        Supervisor {
            shared,
            units: BTreeMap::new(),
            stopping: BTreeMap::new(),
            found: Some(found),
            next_runner: 1,
            declared_modules,
            sweeper,
        }
    }

    /// Make the supervised units be `wanted` (the whole list). Never blocks:
    /// starting and stopping happen in the runners. The first call also
    /// decides about what a previous agent left: adopted if still wanted,
    /// stopped if not.
    pub fn declare(&mut self, wanted: &[UnitItem]) {
        self.stopping.retain(|_, t| !t.is_finished());
        sandbox::mark_present(&self.shared.state_dir, wanted);
        let modules: BTreeSet<String> = wanted.iter().map(|u| u.module.clone()).collect();
        self.declared_modules.send_if_modified(|m| {
            let changed = m.as_ref() != Some(&modules);
            *m = Some(modules);
            changed
        });
        let wanted: BTreeMap<&str, &UnitItem> =
            wanted.iter().map(|u| (u.name.as_str(), u)).collect();

        let mut found = self.found.take().unwrap_or_default();
        let leftovers: Vec<String> = found
            .keys()
            .filter(|n| !wanted.contains_key(n.as_str()))
            .cloned()
            .collect();
        for name in leftovers {
            if let Some(f) = found.remove(&name) {
                let task = tokio::spawn(stop_leftover(self.shared.clone(), name.clone(), f));
                self.stopping.insert(name, task);
            }
        }

        let gone: Vec<String> = self
            .units
            .keys()
            .filter(|n| !wanted.contains_key(n.as_str()))
            .cloned()
            .collect();
        for name in gone {
            if let Some(h) = self.units.remove(&name) {
                info!(unit = %name, "unit no longer declared; stopping it");
                // Dropping the control sender tells the runner to stop and forget.
                drop(h.control);
                self.stopping.insert(name, h.task);
            }
        }

        for (name, item) in wanted {
            match self.units.get_mut(name) {
                Some(h) if same_process(&h.item, item) => {
                    if &h.item != item {
                        h.item = item.clone();
                        h.control.send_replace(item.clone());
                    }
                }
                Some(_) => {
                    info!(unit = %name, "unit spec changed; restarting it");
                    if let Some(old) = self.units.remove(name) {
                        drop(old.control);
                        let h = self.spawn(item.clone(), Some(old.task));
                        self.units.insert(name.to_owned(), h);
                    }
                }
                None => {
                    let predecessor = self.stopping.remove(name);
                    let h = self.spawn_with(item.clone(), predecessor, found.remove(name));
                    self.units.insert(name.to_owned(), h);
                }
            }
        }
    }

    fn spawn(&mut self, item: UnitItem, predecessor: Option<JoinHandle<()>>) -> Handle {
        self.spawn_with(item, predecessor, None)
    }

    fn spawn_with(
        &mut self,
        item: UnitItem,
        predecessor: Option<JoinHandle<()>>,
        found: Option<Found>,
    ) -> Handle {
        let id = self.next_runner;
        self.next_runner += 1;
        let (control, rx) = watch::channel(item.clone());
        let runner = runner::Runner::new(id, self.shared.clone(), rx);
        let task = tokio::spawn(runner.run(predecessor, found));
        Handle {
            item,
            control,
            task,
        }
    }

    /// The artifact cache gained an artifact: units waiting for theirs start.
    pub fn artifacts_changed(&self) {
        self.shared.cache.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// A receiver for [`Reporter`].
    pub fn reporter(&self) -> Reporter {
        Reporter {
            rx: self.shared.status.subscribe(),
            pending: false,
            last: None,
        }
    }

    /// A receiver of probe results for `health` reports.
    pub fn health_reporter(&self) -> probes::HealthReporter {
        self.shared.board.reporter()
    }

    /// Every probe's result now (tests and diagnostics).
    pub fn probe_results(&self) -> Vec<mesh_protocol::ProbeResult> {
        self.shared.board.results()
    }

    /// Every unit's current status, by name.
    pub fn statuses(&self) -> Vec<UnitStatus> {
        snapshot_list(&self.shared.status.borrow())
    }

    /// Wait until `pred` holds for the statuses (tests and diagnostics).
    pub async fn wait_until(&self, pred: impl Fn(&[UnitStatus]) -> bool) {
        let mut rx = self.shared.status.subscribe();
        loop {
            if pred(&snapshot_list(&rx.borrow_and_update())) {
                return;
            }
            if rx.changed().await.is_err() {
                return;
            }
        }
    }

    /// The agent stops (a restart, an upgrade): leave every unit running, with
    /// its shim, for the next agent to adopt. Stops already under way (units
    /// removed, or replaced for a new spec) are finished first, within
    /// `stop_timeout` plus a few seconds; then the runners end where they are
    /// (whatever state they leave, the next agent's start reads it from the
    /// records).
    pub async fn shutdown(mut self) {
        let stopping: Vec<(String, JoinHandle<()>)> =
            std::mem::take(&mut self.stopping).into_iter().collect();
        let runners = std::mem::take(&mut self.units);
        let left = runners.len();
        for h in runners.values() {
            h.task.abort();
        }
        let deadline = Instant::now() + self.shared.config.stop_timeout + Duration::from_secs(5);
        for (name, task) in stopping {
            if tokio::time::timeout_at(deadline, task).await.is_err() {
                warn!(unit = %name, "unit did not stop before the deadline");
            }
        }
        for h in runners.into_values() {
            let _ = h.task.await;
        }
        if left > 0 {
            info!(units = left, "leaving the units running for the next agent");
        }
    }

    /// Stop every unit (SIGTERM, SIGKILL after `stop_timeout`) and wait for them,
    /// at most `stop_timeout` plus a few seconds: decommissioning from within
    /// the process (tests); `mesh-agent drain-local` does it from outside.
    pub async fn stop_all(mut self) {
        for (name, f) in self.found.take().unwrap_or_default() {
            let task = tokio::spawn(stop_leftover(self.shared.clone(), name.clone(), f));
            self.stopping.insert(name, task);
        }
        let mut tasks: Vec<(String, JoinHandle<()>)> =
            std::mem::take(&mut self.stopping).into_iter().collect();
        for (name, h) in std::mem::take(&mut self.units) {
            drop(h.control);
            tasks.push((name, h.task));
        }
        if tasks.is_empty() {
            return;
        }
        info!(units = tasks.len(), "stopping units");
        let deadline = Instant::now() + self.shared.config.stop_timeout + Duration::from_secs(5);
        for (name, task) in tasks {
            match tokio::time::timeout_at(deadline, task).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => warn!(unit = %name, error = %e, "unit runner failed"),
                Err(_) => warn!(unit = %name, "unit did not stop before the deadline"),
            }
        }
    }
}

/// Whether two declarations of a unit run the same process (so a change between
/// them needs no restart).
fn same_process(a: &UnitItem, b: &UnitItem) -> bool {
    ProcessSpec::of(a) == ProcessSpec::of(b)
}

/// What a previous agent left of a unit no longer declared: stopped if it
/// runs, its records removed.
async fn stop_leftover(shared: Arc<Shared>, name: String, found: Found) {
    let dir = shared.units_dir.join(&name);
    match found {
        Found::Running(record) => {
            if let Some(r) = runner::Running::adopt(&record) {
                info!(unit = %name, pid = record.pid, "unit no longer declared; stopping what a previous agent left running");
                runner::stop_process(&name, &dir, r, shared.config.stop_timeout).await;
            }
        }
        Found::Exited(_) | Found::Lost(_) => {}
    }
    process::remove_record(&dir, EXIT_FILE);
    process::remove_record(&dir, PID_FILE);
}

fn snapshot_list(s: &Snapshot) -> Vec<UnitStatus> {
    s.values().map(|(_, st)| st.clone()).collect()
}

/// Turns status changes into `units` report bodies, at most one per
/// [`REPORT_MIN_INTERVAL`]. Cancel-safe: [`Reporter::due`] may be dropped at any
/// point (it is one branch of the agent's `select!`) without losing a change.
pub struct Reporter {
    rx: watch::Receiver<Snapshot>,
    /// A change was seen that has not been reported yet.
    pending: bool,
    last: Option<Instant>,
}

impl Reporter {
    /// Resolves when a report is due: something changed since the last
    /// [`Reporter::take`], and the last one is at least the interval old. Never
    /// resolves once the supervisor is gone.
    pub async fn due(&mut self) {
        if !self.pending {
            if self.rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
            self.pending = true;
        }
        if let Some(last) = self.last {
            tokio::time::sleep_until(last + REPORT_MIN_INTERVAL).await;
        }
    }

    /// The whole list, now; marks everything up to now reported.
    pub fn take(&mut self) -> Units {
        self.pending = false;
        self.last = Some(Instant::now());
        Units {
            units: snapshot_list(&self.rx.borrow_and_update()),
        }
    }
}
