//! Process groups, signals, and the records a unit's shim leaves beside its
//! logs, through which an agent finds (and adopts) what runs.
//!
//! A unit's whole process tree is one group (the unit's first process leads
//! it), so stopping the unit reaches every process it started. The unit is the
//! child of its shim (see [`super::shim`]), not of the agent, so both outlive
//! the agent.
//!
//! Records in `<state_dir>/units/<name>/`, written by the shim (mode 0600: the
//! spec holds the declared environment, as the store does):
//! - `pid` ([`PidRecord`]) while the unit runs: the leader's pid and start
//!   time, the shim's pid and start time, the boot id, when it started, the
//!   restart count at its start and the process spec it was started with;
//! - `exit` ([`ExitRecord`]) once the unit's leader exited: its exit code, for
//!   the agent that watches the shim, or for the next one if none does.
//!
//! Start times (clock ticks since boot, `/proc/<pid>/stat`) and the boot id
//! guard against recycled pids: a recorded process is only ever signalled or
//! adopted while the process with that pid started at the recorded time.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use chrono::{DateTime, Utc};
use mesh_protocol::UnitItem;
use rustix::process::{Pid, Signal};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use tracing::{info, warn};

/// File name of the pid file inside a unit's directory.
pub const PID_FILE: &str = "pid";
/// File name of the exit record inside a unit's directory.
pub const EXIT_FILE: &str = "exit";

/// Send `sig` to every process in group `pgid`. Refuses pgid 0 and 1, which would
/// mean "our own group" and "every process".
pub fn signal_group(pgid: u32, sig: Signal) -> std::io::Result<()> {
    let pid = i32::try_from(pgid)
        .ok()
        .filter(|p| *p > 1)
        .and_then(Pid::from_raw)
        .ok_or_else(|| std::io::Error::other(format!("refusing to signal process group {pgid}")))?;
    rustix::process::kill_process_group(pid, sig).map_err(std::io::Error::from)
}

/// Whether any process of group `pgid` is left.
pub fn group_exists(pgid: u32) -> bool {
    let Some(pid) = i32::try_from(pgid)
        .ok()
        .filter(|p| *p > 1)
        .and_then(Pid::from_raw)
    else {
        return false;
    };
    // EPERM means it exists but is not ours to signal: still "exists".
    match rustix::process::test_kill_process_group(pid) {
        Ok(()) => true,
        Err(e) => e != rustix::io::Errno::SRCH,
    }
}

/// `(start time in clock ticks since boot, process group)` of `pid`, from
/// `/proc/<pid>/stat`; `None` if there is no such process (or no `/proc`), or
/// it is a zombie (it exited; only its parent's wait is missing).
pub fn proc_stat(pid: u32) -> Option<(u64, u32)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) state ppid pgrp …`; comm may contain spaces and parentheses.
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    if matches!(fields.first(), Some(&"Z") | Some(&"X")) {
        return None;
    }
    // After the comm: state(0) ppid(1) pgrp(2) … starttime is field 22 of the
    // whole line, index 19 here.
    let pgrp = fields.get(2)?.parse().ok()?;
    let start = fields.get(19)?.parse().ok()?;
    Some((start, pgrp))
}

/// This boot's id (`/proc/sys/kernel/random/boot_id`): start times count from
/// boot, so a record of another boot names no live process.
pub fn boot_id() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .ok()
        .map(|s| s.trim().to_owned())
}

/// The part of a unit's declaration that its process is started with: a
/// change here is a new process; `restart` and `desired` are not part of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessSpec {
    pub module: String,
    pub command: String,
    pub args: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub working_dir: Option<String>,
    /// Absent in records of agents older than artifacts (and for units
    /// without one), so those records still compare equal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact: Option<mesh_protocol::ArtifactDigest>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<uuid::Uuid>,
    /// Absent (the module's user, no limits) in records of agents older than
    /// the sandbox, so those records still compare equal.
    #[serde(default, skip_serializing_if = "mesh_protocol::UnitUser::is_module")]
    pub user: mesh_protocol::UnitUser,
    #[serde(default, skip_serializing_if = "mesh_protocol::UnitLimits::is_empty")]
    pub limits: mesh_protocol::UnitLimits,
}

impl ProcessSpec {
    pub fn of(item: &UnitItem) -> Self {
        ProcessSpec {
            module: item.module.clone(),
            command: item.command.clone(),
            args: item.args.clone(),
            env: item.env.clone(),
            working_dir: item.working_dir.clone(),
            artifact: item.artifact.clone(),
            revision: item.revision,
            user: item.user,
            limits: item.limits,
        }
    }
}

/// A process, named so that a recycled pid is never taken for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcRef {
    pub pid: u32,
    /// Start time in clock ticks since boot; `None` where `/proc` is missing.
    pub start_time: Option<u64>,
}

impl ProcRef {
    pub fn of(pid: u32) -> Self {
        ProcRef {
            pid,
            start_time: proc_stat(pid).map(|(start, _)| start),
        }
    }

    /// Whether the process runs and is the recorded one (same start time).
    pub fn alive(&self) -> bool {
        match (proc_stat(self.pid), self.start_time) {
            (Some((start, _)), Some(recorded)) => start == recorded,
            _ => false,
        }
    }

    /// Whether it runs, is the recorded one, and leads its process group.
    pub fn leads_its_group(&self) -> bool {
        match (proc_stat(self.pid), self.start_time) {
            (Some((start, pgrp)), Some(recorded)) => start == recorded && pgrp == self.pid,
            _ => false,
        }
    }
}

/// What a pid file says. Agents before decision 0016 wrote only `pid` and
/// `start_time` (their units had no shim): such a record has no `shim`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PidRecord {
    /// The unit's leader (its process group id).
    pub pid: u32,
    pub start_time: Option<u64>,
    #[serde(default)]
    pub boot_id: Option<String>,
    /// The shim that owns the unit's output and waits for it.
    #[serde(default)]
    pub shim: Option<ProcRef>,
    #[serde(default)]
    pub started_at: Option<DateTime<Utc>>,
    /// The unit's restart count when this process started.
    #[serde(default)]
    pub restarts: u32,
    #[serde(default)]
    pub spec: Option<ProcessSpec>,
}

impl PidRecord {
    pub fn leader(&self) -> ProcRef {
        ProcRef {
            pid: self.pid,
            start_time: self.start_time,
        }
    }

    fn this_boot(&self) -> bool {
        match (&self.boot_id, boot_id()) {
            (Some(recorded), Some(now)) => *recorded == now,
            _ => true,
        }
    }

    /// Whether the recorded leader still runs and leads its group.
    pub fn leader_running(&self) -> bool {
        self.this_boot() && self.leader().leads_its_group()
    }

    /// Whether the recorded shim still runs.
    pub fn shim_running(&self) -> bool {
        self.this_boot() && self.shim.is_some_and(|s| s.alive())
    }
}

/// How a unit's process ended, as its shim saw it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitRecord {
    pub pid: u32,
    pub start_time: Option<u64>,
    /// The exit code, or 128 + the signal that killed it (as shells say it);
    /// `None` if the shim could not wait for it.
    pub code: Option<i32>,
    pub success: bool,
    pub started_at: DateTime<Utc>,
    pub exited_at: DateTime<Utc>,
    /// The restart count when this process started.
    pub restarts: u32,
    pub spec: ProcessSpec,
    /// Why it ended, when the shim knows more than the exit code
    /// ([`mesh_protocol::REASON_OOM_KILLED`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl ExitRecord {
    /// How long the process ran.
    pub fn ran(&self) -> Duration {
        (self.exited_at - self.started_at)
            .to_std()
            .unwrap_or(Duration::ZERO)
    }
}

/// Write one of the records (atomically, mode 0600).
pub fn write_record(dir: &Path, name: &str, record: &impl Serialize) -> std::io::Result<()> {
    let bytes = serde_json::to_vec(record).map_err(std::io::Error::other)?;
    crate::store::write_atomic(&dir.join(name), &bytes, 0o600)
}

/// Read one of the records: `None` if there is none; an unreadable one is
/// said, removed, and `None`.
pub fn read_record<T: for<'de> Deserialize<'de>>(dir: &Path, name: &str) -> Option<T> {
    let bytes = std::fs::read(dir.join(name)).ok()?;
    match serde_json::from_slice(&bytes) {
        Ok(r) => Some(r),
        Err(e) => {
            warn!(unit_dir = %dir.display(), file = name, error = %e, "ignoring an unreadable unit record");
            remove_record(dir, name);
            None
        }
    }
}

pub fn remove_record(dir: &Path, name: &str) {
    match std::fs::remove_file(dir.join(name)) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            warn!(dir = %dir.display(), file = name, error = %e, "cannot remove a unit record")
        }
    }
}

/// What an agent finds of a unit when it starts.
#[derive(Debug)]
pub enum Found {
    /// Its shim still runs (and so, most likely, the unit): adopt it.
    Running(PidRecord),
    /// It exited while no agent watched; its shim recorded how.
    Exited(ExitRecord),
    /// It is gone without a word: its shim was killed, or the node rebooted.
    Lost(PidRecord),
}

/// Look at every unit directory: what runs, what exited, what was lost. Leaders
/// still running without their shim (its output has nowhere to go: a killed
/// shim, or a unit of an agent before 0016) are returned in the second list,
/// to be stopped.
pub fn scan(units_dir: &Path) -> (BTreeMap<String, Found>, Vec<(String, u32)>) {
    let mut found = BTreeMap::new();
    let mut orphans = Vec::new();
    let Ok(entries) = std::fs::read_dir(units_dir) else {
        return (found, orphans);
    };
    for entry in entries.flatten() {
        let dir = entry.path();
        let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        // An exit record stays until the unit's next process starts: it is the
        // last word on the unit unless a pid file names a newer process.
        let exit: Option<ExitRecord> = read_record(&dir, EXIT_FILE);
        let Some(record) = read_record::<PidRecord>(&dir, PID_FILE) else {
            if let Some(exit) = exit {
                found.insert(name, Found::Exited(exit));
            }
            continue;
        };
        if record.shim_running() {
            found.insert(name, Found::Running(record));
            continue;
        }
        if record.leader_running() {
            warn!(unit = %name, pid = record.pid, "a unit process runs without its shim (its output has nowhere to go); stopping it");
            orphans.push((name.clone(), record.pid));
        }
        remove_record(&dir, PID_FILE);
        match exit {
            Some(exit) if exit.pid == record.pid => found.insert(name, Found::Exited(exit)),
            stale => {
                if stale.is_some() {
                    remove_record(&dir, EXIT_FILE);
                }
                found.insert(name, Found::Lost(record))
            }
        };
    }
    (found, orphans)
}

/// SIGTERM to each group, SIGKILL to those still there after `timeout`; waits
/// until they are gone (at most `timeout` plus a few seconds).
pub async fn stop_groups(groups: &[u32], timeout: Duration) {
    for g in groups {
        let _ = signal_group(*g, Signal::TERM);
    }
    let deadline = Instant::now() + timeout;
    while groups.iter().any(|g| group_exists(*g)) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for g in groups {
        if group_exists(*g) {
            let _ = signal_group(*g, Signal::KILL);
        }
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while groups.iter().any(|g| group_exists(*g)) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `mesh-agent drain-local`: stop every unit under `units_dir` (SIGTERM to its
/// group, SIGKILL after `timeout`), wait for their shims to finish, and remove
/// their records, so that a later agent starts them afresh. The agent must not
/// run meanwhile (it would restart them). Returns the names of the units
/// stopped.
pub async fn drain_local(units_dir: &Path, timeout: Duration) -> Vec<String> {
    let (found, orphans) = scan(units_dir);
    let mut groups: Vec<u32> = orphans.iter().map(|(_, pid)| *pid).collect();
    let mut shims = Vec::new();
    let mut stopped: Vec<String> = orphans.into_iter().map(|(n, _)| n).collect();
    for (name, f) in &found {
        if let Found::Running(record) = f {
            if record.leader_running() {
                groups.push(record.pid);
            }
            shims.extend(record.shim);
            stopped.push(name.clone());
        }
    }
    stop_groups(&groups, timeout).await;
    // The shims record the exits and go.
    let deadline = Instant::now() + Duration::from_secs(5);
    while shims.iter().any(ProcRef::alive) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for name in found.keys().chain(stopped.iter()) {
        let dir = units_dir.join(name);
        remove_record(&dir, PID_FILE);
        remove_record(&dir, EXIT_FILE);
    }
    stopped.sort();
    stopped.dedup();
    if !stopped.is_empty() {
        info!(units = ?stopped, "stopped the node's units");
    }
    stopped
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_own_stat_and_refuses_dangerous_groups() {
        let me = std::process::id();
        let (start, _pgrp) = proc_stat(me).expect("/proc/self/stat");
        assert!(start > 0);
        assert!(ProcRef::of(me).alive());
        assert!(signal_group(0, Signal::TERM).is_err());
        assert!(signal_group(1, Signal::TERM).is_err());
        assert!(!group_exists(1));
        assert!(proc_stat(u32::MAX).is_none());
        assert!(boot_id().is_some_and(|b| !b.is_empty()));
    }

    #[test]
    fn a_record_of_an_agent_before_0016_has_no_shim() {
        let r: PidRecord = serde_json::from_str(r#"{"pid":42,"start_time":7}"#).unwrap();
        assert_eq!(
            (r.pid, r.start_time, r.shim, r.restarts),
            (42, Some(7), None, 0)
        );
        assert!(!r.shim_running());
    }
}
