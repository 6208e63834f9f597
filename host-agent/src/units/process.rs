//! Process groups, signals and pid files: the unit's whole process tree is one
//! group (the unit's first process leads it), so stopping the unit reaches every
//! process it started.
//!
//! A pid file (`<state_dir>/units/<name>/pid`: the leader's pid and its start
//! time from `/proc/<pid>/stat`) exists while a unit's process runs. If the agent
//! dies without stopping its units (SIGKILL, crash, power cut of the agent only),
//! the next agent finds the pid files and stops those groups before it starts
//! anything: their output pipes went with the old agent, so they cannot be
//! adopted, and running the new instance next to them would run the unit twice.
//! The start time guards against a recycled pid.

use std::path::Path;
use std::time::Duration;

use rustix::process::{Pid, Signal};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use tracing::{info, warn};

/// File name of the pid file inside a unit's directory.
pub const PID_FILE: &str = "pid";

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
/// `/proc/<pid>/stat`; `None` if there is no such process (or no `/proc`).
pub fn proc_stat(pid: u32) -> Option<(u64, u32)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) state ppid pgrp …`; comm may contain spaces and parentheses.
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the comm: state(0) ppid(1) pgrp(2) … starttime is field 22 of the
    // whole line, index 19 here.
    let pgrp = fields.get(2)?.parse().ok()?;
    let start = fields.get(19)?.parse().ok()?;
    Some((start, pgrp))
}

/// What a pid file says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PidRecord {
    pub pid: u32,
    /// Start time in clock ticks since boot; `None` where `/proc` is missing.
    pub start_time: Option<u64>,
}

impl PidRecord {
    pub fn of(pid: u32) -> Self {
        PidRecord {
            pid,
            start_time: proc_stat(pid).map(|(start, _)| start),
        }
    }

    /// Whether the recorded process still runs, leads its group, and is the same
    /// process (not a recycled pid).
    pub fn still_running(&self) -> bool {
        match (proc_stat(self.pid), self.start_time) {
            (Some((start, pgrp)), Some(recorded)) => start == recorded && pgrp == self.pid,
            _ => false,
        }
    }
}

pub fn write_pid_file(dir: &Path, pid: u32) -> std::io::Result<()> {
    let bytes = serde_json::to_vec(&PidRecord::of(pid)).map_err(std::io::Error::other)?;
    crate::store::write_atomic(&dir.join(PID_FILE), &bytes, 0o644)
}

pub fn remove_pid_file(dir: &Path) {
    match std::fs::remove_file(dir.join(PID_FILE)) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => warn!(dir = %dir.display(), error = %e, "cannot remove the pid file"),
    }
}

/// Stop every unit process group a previous agent left running (see the module
/// docs): SIGTERM to each, SIGKILL to those still there after `timeout`. Removes
/// the pid files. Returns how many groups it stopped.
pub async fn reap_stale(units_dir: &Path, timeout: Duration) -> usize {
    let Ok(entries) = std::fs::read_dir(units_dir) else {
        return 0;
    };
    let mut groups = Vec::new();
    for entry in entries.flatten() {
        let dir = entry.path();
        let Ok(bytes) = std::fs::read(dir.join(PID_FILE)) else {
            continue;
        };
        match serde_json::from_slice::<PidRecord>(&bytes) {
            Ok(rec) if rec.still_running() => {
                warn!(unit_dir = %dir.display(), pid = rec.pid, "stopping a unit process left running by a previous agent");
                if signal_group(rec.pid, Signal::TERM).is_ok() {
                    groups.push(rec.pid);
                }
            }
            Ok(_) => {}
            Err(e) => {
                warn!(unit_dir = %dir.display(), error = %e, "ignoring an unreadable pid file")
            }
        }
        remove_pid_file(&dir);
    }
    let deadline = Instant::now() + timeout;
    while groups.iter().any(|g| group_exists(*g)) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for g in &groups {
        if group_exists(*g) {
            let _ = signal_group(*g, Signal::KILL);
        }
    }
    if !groups.is_empty() {
        info!(
            count = groups.len(),
            "stopped unit processes left by a previous agent"
        );
    }
    groups.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_own_stat_and_refuses_dangerous_groups() {
        let me = std::process::id();
        let (start, _pgrp) = proc_stat(me).expect("/proc/self/stat");
        assert!(start > 0);
        assert!(PidRecord::of(me).start_time.is_some());
        assert!(signal_group(0, Signal::TERM).is_err());
        assert!(signal_group(1, Signal::TERM).is_err());
        assert!(!group_exists(1));
        assert!(proc_stat(u32::MAX).is_none());
    }
}
