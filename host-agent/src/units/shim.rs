//! A unit's shim: `mesh-agent unit-shim`, one small process per running unit
//! (the role containerd-shim and conmon play for containers). It owns the
//! unit's stdout/stderr pipes and writes them to the rotating logs, is the
//! unit's parent (so it learns the exit status), and outlives the agent: the
//! agent can stop, restart or be upgraded while units run and their output is
//! kept. See docs/decisions/0016-units-outlive-their-agent.md.
//!
//! The exchange with the agent that starts it:
//! 1. the agent writes one [`Launch`] (JSON) on the shim's stdin and closes it;
//! 2. the shim leaves the agent's session (`setsid`: no signal meant for the
//!    agent's terminal or group reaches it), starts the unit as the leader of
//!    its own process group with the launch's environment and working dir,
//!    writes the pid file (`PidRecord`), and answers one [`Reply`] line on
//!    stdout, which it never writes again;
//! 3. it copies the unit's output into `stdout.log` / `stderr.log` (rotated as
//!    the launch says) until the unit's leader exits; then kills what is left
//!    of the group, drains the pipes (at most [`DRAIN`]), writes the exit record
//!    (`ExitRecord`), removes the pid file, and exits.
//!
//! The agent that started it waits for it as a child; a later agent adopts it
//! through the pid file and watches it by pidfd. Its own diagnostics (rare:
//! a log file that cannot be written) go to its stderr, `shim.log` in the
//! unit's directory.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{ExitCode, Stdio};
use std::time::Duration;

use chrono::{DateTime, Utc};
use rustix::process::Signal;
use serde::{Deserialize, Serialize};

use super::cgroup::{self, Cgroup};
use super::logs::{RotatingLog, pump};
use super::process::{
    EXIT_FILE, ExitRecord, PID_FILE, PidRecord, ProcRef, ProcessSpec, boot_id, remove_record,
    signal_group, write_record,
};
use super::sandbox::{Backend, CgroupPlan, Plan};
use super::systemd;

/// The subcommand the agent runs its shims with (hidden from `--help`).
pub const SUBCOMMAND: &str = "unit-shim";

/// How long the shim keeps reading the pipes after the unit's group is gone
/// (a process that left the group may still hold them).
pub const DRAIN: Duration = Duration::from_secs(2);

/// What the agent tells a shim to run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Launch {
    pub unit: String,
    /// The unit's directory: logs and records.
    pub dir: PathBuf,
    pub command: String,
    pub args: Vec<String>,
    /// The unit's whole environment (nothing else is inherited).
    pub env: BTreeMap<String, String>,
    pub working_dir: PathBuf,
    pub log_max_bytes: u64,
    pub log_files: usize,
    /// The unit's restart count with this start, kept in the records.
    pub restarts: u32,
    /// The declaration this process runs, kept in the records.
    pub spec: ProcessSpec,
    /// The unit's box: its user and cgroup (decision 0051). Absent from an
    /// older agent's launch: the shim's own user, no cgroup.
    #[serde(default)]
    pub sandbox: Plan,
}

/// The shim's one answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reply {
    Started {
        pid: u32,
        start_time: Option<u64>,
        started_at: DateTime<Utc>,
    },
    Failed {
        error: String,
    },
}

fn answer(reply: &Reply) {
    // The agent may be gone already: nothing to do about a failed write
    // (SIGPIPE is ignored in Rust programs; the write just fails).
    let mut out = std::io::stdout().lock();
    if let Ok(mut line) = serde_json::to_vec(reply) {
        line.push(b'\n');
        let _ = out.write_all(&line);
        let _ = out.flush();
    }
}

fn fail(error: String) -> ExitCode {
    eprintln!("mesh-agent unit-shim: {error}");
    answer(&Reply::Failed { error });
    ExitCode::from(2)
}

/// The shim's whole life. Synchronous: two threads copy the pipes while the
/// main thread waits for the unit.
// Long on purpose: the shim's life in order (read the launch spec, leave
// the agent's session, spawn the unit in its sandbox, record its pid and
// answer, copy its output, wait, clean its group up, record the exit),
// synchronous and in a process of its own; no step is used elsewhere.
pub fn main() -> ExitCode {
    let mut input = Vec::new();
    if let Err(e) = std::io::stdin().lock().read_to_end(&mut input) {
        return fail(format!("cannot read the launch: {e}"));
    }
    let launch: Launch = match serde_json::from_slice(&input) {
        Ok(l) => l,
        Err(e) => return fail(format!("invalid launch: {e}")),
    };
    // Out of the agent's session and process group: signals for the agent (a
    // terminal's ^C, a service manager signalling its group) are not for us.
    let _ = rustix::process::setsid();

    let (mut child, placed) = match spawn_boxed(&launch) {
        Ok(c) => c,
        Err(e) => {
            let who = launch
                .sandbox
                .uid
                .map_or_else(String::new, |u| format!(" as uid {u}"));
            return fail(format!(
                "cannot start {}{who} in {}: {e}",
                launch.command,
                launch.working_dir.display()
            ));
        }
    };
    let pid = child.id();
    let started_at = Utc::now();
    let leader = ProcRef::of(pid);
    let record = PidRecord {
        pid,
        start_time: leader.start_time,
        boot_id: boot_id(),
        shim: Some(ProcRef::of(std::process::id())),
        started_at: Some(started_at),
        restarts: launch.restarts,
        spec: Some(launch.spec.clone()),
    };
    if let Err(e) = write_record(&launch.dir, PID_FILE, &record) {
        // Without a pid file no later agent could find it: do not run it.
        let _ = signal_group(pid, Signal::KILL);
        let _ = child.wait();
        return fail(format!("cannot write the pid file: {e}"));
    }
    answer(&Reply::Started {
        pid,
        start_time: leader.start_time,
        started_at,
    });

    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let mut pumps = 0;
    let streams: [(Option<Box<dyn Read + Send>>, &str); 2] = [
        (
            child
                .stdout
                .take()
                .map(|s| Box::new(s) as Box<dyn Read + Send>),
            "stdout.log",
        ),
        (
            child
                .stderr
                .take()
                .map(|s| Box::new(s) as Box<dyn Read + Send>),
            "stderr.log",
        ),
    ];
    for (src, file) in streams {
        let Some(src) = src else { continue };
        let log = RotatingLog::new(
            launch.dir.join(file),
            launch.log_max_bytes,
            launch.log_files,
        );
        let unit = launch.unit.clone();
        let done = done_tx.clone();
        pumps += 1;
        std::thread::spawn(move || {
            pump(src, log, &unit);
            let _ = done.send(());
        });
    }
    drop(done_tx);

    let status = child.wait();
    let exited_at = Utc::now();
    // What is left of the group goes with its leader; with a cgroup, whatever
    // is left in it (a process that left the group) goes too.
    let _ = signal_group(pid, Signal::KILL);
    let oom_killed = placed.as_ref().is_some_and(Placed::finish);
    let deadline = std::time::Instant::now() + DRAIN;
    for _ in 0..pumps {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if done_rx.recv_timeout(left).is_err() {
            break;
        }
    }
    let (code, success) = match &status {
        Ok(s) => (
            s.code().or_else(|| s.signal().map(|sig| 128 + sig)),
            s.success(),
        ),
        Err(e) => {
            eprintln!(
                "mesh-agent unit-shim: unit {}: cannot wait: {e}",
                launch.unit
            );
            (None, false)
        }
    };
    let exit = ExitRecord {
        pid,
        start_time: leader.start_time,
        code,
        success,
        started_at,
        exited_at,
        restarts: launch.restarts,
        spec: launch.spec,
        reason: oom_killed.then(|| mesh_protocol::REASON_OOM_KILLED.to_owned()),
    };
    if let Err(e) = write_record(&launch.dir, EXIT_FILE, &exit) {
        eprintln!(
            "mesh-agent unit-shim: unit {}: cannot write the exit record: {e}",
            launch.unit
        );
    }
    remove_record(&launch.dir, PID_FILE);
    ExitCode::SUCCESS
}

/// Where a unit process was put.
enum Placed {
    Cgroupfs(Cgroup),
    Systemd(systemd::Scope),
}

impl Placed {
    /// After the unit's leader exited: kill what is left, say whether the
    /// kernel OOM-killed in it, and let go of the cgroup.
    fn finish(&self) -> bool {
        match self {
            Placed::Cgroupfs(cg) => {
                let oom = cg.oom_kills() > 0;
                cg.remove(DRAIN);
                oom
            }
            Placed::Systemd(scope) => systemd::finish(scope),
        }
    }
}

/// The cgroup a plan asks for, made before the process exists.
fn prepare(plan: &CgroupPlan) -> Result<Option<Cgroup>, String> {
    match &plan.backend {
        Backend::Systemd => Ok(None),
        Backend::Cgroupfs { root } => {
            let layout = cgroup::detect().ok_or("no cgroup filesystem is mounted")?;
            Cgroup::create(&layout, root, &plan.name, &plan.limits)
                .map(Some)
                .map_err(|e| format!("cannot make the unit's cgroup: {e}"))
        }
    }
}

/// Start the unit as its user, and in its cgroup before it runs anything of
/// its own: the child, after `setuid`, writes its pid to one pipe and waits on
/// another until the shim has placed it (a write to `cgroup.procs`, or a
/// systemd scope made for it), then execs. `Command::spawn` returns only once
/// the child exec'd, so it runs on a thread of its own meanwhile.
fn spawn_boxed(launch: &Launch) -> Result<(std::process::Child, Option<Placed>), String> {
    let mut cmd = std::process::Command::new(&launch.command);
    cmd.args(&launch.args)
        .env_clear()
        .envs(&launch.env)
        .current_dir(&launch.working_dir)
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // With a uid and no groups said, std drops the supplementary groups too.
    if let Some(gid) = launch.sandbox.gid {
        cmd.gid(gid);
    }
    if let Some(uid) = launch.sandbox.uid {
        cmd.uid(uid);
    }
    let Some(plan) = launch.sandbox.cgroup.clone() else {
        return cmd.spawn().map(|c| (c, None)).map_err(|e| e.to_string());
    };
    let cg = prepare(&plan)?;
    let (pid_r, pid_w) = pipe().map_err(|e| format!("cannot make a pipe: {e}"))?;
    let (go_r, go_w) = pipe().map_err(|e| format!("cannot make a pipe: {e}"))?;
    // SAFETY: the hook runs in the forked child before exec and only makes
    // raw system calls (getpid, write, read) on descriptors it owns.
    unsafe {
        cmd.pre_exec(move || {
            let pid = rustix::process::getpid()
                .as_raw_nonzero()
                .get()
                .to_ne_bytes();
            rustix::io::write(&pid_w, &pid)?;
            let mut go = [0u8; 1];
            match rustix::io::read(&go_r, &mut go) {
                Ok(1) => Ok(()),
                // The shim could not place it: it must not run unboxed.
                _ => Err(std::io::Error::other("not placed in its cgroup")),
            }
        });
    }
    let spawner = std::thread::spawn(move || cmd.spawn());
    let mut buf = [0u8; 4];
    let placed = match rustix::io::read(&pid_r, &mut buf) {
        Ok(4) => {
            let pid = i32::from_ne_bytes(buf) as u32;
            match (&plan.backend, cg) {
                (Backend::Cgroupfs { .. }, Some(cg)) => cg
                    .add(pid)
                    .map(|()| Placed::Cgroupfs(cg))
                    .map_err(|e| format!("cannot move the unit into its cgroup: {e}")),
                _ => systemd::start_scope(&plan.name, pid, &plan.limits).map(Placed::Systemd),
            }
        }
        // The child never got to the hook: spawn's own error says why.
        _ => Err(String::new()),
    };
    if placed.is_ok() {
        let _ = rustix::io::write(&go_w, &[1]);
    }
    drop(go_w);
    drop(pid_r);
    let spawned = spawner
        .join()
        .map_err(|_| "the spawning thread panicked".to_owned())?;
    match (spawned, placed) {
        (Ok(child), Ok(placed)) => Ok((child, Some(placed))),
        (Ok(mut child), Err(e)) => {
            let _ = child.kill();
            let _ = child.wait();
            Err(e)
        }
        (Err(e), Ok(placed)) => {
            placed.finish();
            Err(e.to_string())
        }
        (Err(e), Err(why)) if why.is_empty() => Err(e.to_string()),
        (Err(_), Err(why)) => Err(why),
    }
}

fn pipe() -> std::io::Result<(std::os::fd::OwnedFd, std::os::fd::OwnedFd)> {
    rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).map_err(std::io::Error::from)
}
