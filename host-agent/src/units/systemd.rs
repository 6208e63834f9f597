//! The systemd backend of the sandbox: where systemd is PID 1, a unit's
//! process runs in a transient scope (`<name>.scope`) that systemd makes
//! through its D-Bus API with the unit's limits (`MemoryMax`, `TasksMax`,
//! `CPUQuotaPerSecUSec`). The scope outlives the agent and the shim as the
//! process does: systemd keeps a scope while a process is in it, whoever made
//! it.
//!
//! Only the unit's shim calls this, synchronously and as root:
//! - [`start_scope`] asks `Manager.StartTransientUnit` for the scope with the
//!   process's pid (which waits, not yet exec'd, until it is placed) and the
//!   holder's, and waits for systemd to have started it (the unit `active`). A scope of the same
//!   name left by an earlier process of the unit is killed and forgotten first.
//! - [`finish`], after the unit's leader exited, says whether the kernel
//!   OOM-killed in the scope, kills what is left in it (`KillUnit`) and lets
//!   systemd forget it (`ResetFailedUnit`: a failed scope stays loaded).
//!
//! The connection is the system bus (dbus-daemon; systemd's private socket
//! does not work with zbus, see `connect`). One connection per call, made
//! on the spot; every exchange is bounded in time (a systemd that is gone or
//! hung never hangs the shim).
//!
//! What it never does: start, stop or change any unit other than the scope it
//! is asked about; it never runs `systemctl` (nothing is shelled out).
//!
//! OOM kills: the kernel counts them in the scope's cgroup (`memory.events` on
//! cgroup v2, `memory.oom_control` on v1 and hybrid), and systemd 253 and
//! later also end an OOM-killed scope with `Result=oom-kill` (v2 only; Debian
//! 12's systemd 252 does not). systemd removes a scope's cgroup as soon as it
//! is empty, before the shim could read the counter; so the scope also holds a
//! *holder*, a fork of the shim that waits until [`finish`] read the counter
//! (see `spawn_holder`). `TasksMax` is the unit's pids + 1 for it.

use std::os::fd::OwnedFd;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use zbus::blocking::Connection;
use zbus::zvariant::{OwnedObjectPath, OwnedValue, Value};

use super::cgroup;
use super::sandbox::Limits;

const DESTINATION: &str = "org.freedesktop.systemd1";
const MANAGER_PATH: &str = "/org/freedesktop/systemd1";
const MANAGER: &str = "org.freedesktop.systemd1.Manager";
const UNIT: &str = "org.freedesktop.systemd1.Unit";
const SCOPE: &str = "org.freedesktop.systemd1.Scope";
const JOB: &str = "org.freedesktop.systemd1.Job";
const PROPERTIES: &str = "org.freedesktop.DBus.Properties";

/// How long [`start_scope`] waits for systemd to have made the scope.
pub const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long [`finish`] spends at most.
pub const FINISH_TIMEOUT: Duration = Duration::from_secs(5);
/// Any one method call.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// Between two looks at a unit's state.
const POLL: Duration = Duration::from_millis(10);
/// The CPU quota systemd is given at least: 1 % (the kernel's minimum quota
/// of 1 ms per 100 ms period).
const MIN_CPU_USEC_PER_SEC: u64 = 10_000;

/// A unit process's scope.
#[derive(Debug)]
pub struct Scope {
    /// `<name>.scope`.
    pub unit: String,
    /// Its cgroup as systemd names it (`/system.slice/<name>.scope`), if
    /// systemd said: where the kernel's OOM counter is read.
    pub control_group: Option<String>,
    /// The holder's stdin, until [`finish`] lets it go.
    holder: Mutex<Option<OwnedFd>>,
}

/// Whether systemd is PID 1 here (as `sd_booted()` tells).
pub fn booted() -> bool {
    std::path::Path::new("/run/systemd/system").is_dir()
}

/// Ask systemd to make the scope `<name>.scope` holding `pid`, with `limits`;
/// returns once systemd made it (its start job finished). The error names
/// what failed.
pub fn start_scope(name: &str, pid: u32, limits: &Limits) -> Result<Scope, String> {
    let unit = scope_name(name);
    let (holder_pid, holder) =
        spawn_holder().map_err(|e| format!("{unit}: cannot start its holder: {e}"))?;
    let limits = *limits;
    let what = format!("{unit}: systemd");
    // On an error `holder` is dropped here: the holder exits.
    let (unit, control_group) = bounded(START_TIMEOUT, &what, move || {
        let conn = connect()?;
        start(
            &conn,
            &unit,
            &[pid, holder_pid],
            &limits,
            Instant::now() + START_TIMEOUT,
        )
    })?;
    Ok(Scope {
        unit,
        control_group,
        holder: Mutex::new(Some(holder)),
    })
}

/// After the scope's process ended: whether the kernel OOM-killed in it (its
/// cgroup's counter, or systemd's `Result=oom-kill`). Also kills what is left
/// in it and lets systemd forget it (a failed scope stays loaded). Never
/// takes longer than [`FINISH_TIMEOUT`]; a systemd that is gone gives the
/// counter's answer alone.
pub fn finish(scope: &Scope) -> bool {
    // The kernel's count first, while the holder keeps the cgroup.
    let counted = scope
        .control_group
        .as_deref()
        .is_some_and(|cg| oom_kills(cg) > 0);
    // The holder goes (KillUnit below takes it too, if systemd answers).
    drop(
        scope
            .holder
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take(),
    );
    let unit = scope.unit.clone();
    let what = format!("{unit}: systemd");
    match bounded(FINISH_TIMEOUT, &what, move || {
        let conn = connect()?;
        Ok(release(&conn, &unit, Instant::now() + FINISH_TIMEOUT))
    }) {
        Ok(said) => counted || said,
        Err(e) => {
            eprintln!("mesh-agent unit-shim: {e}");
            counted
        }
    }
}

/// Start the holder: a fork of the shim that never execs. It writes its pid,
/// then waits in the pre-exec hook until its stdin pipe closes (the shim lets
/// it go, or is gone), then exits. It sits in the scope beside the unit so
/// that the scope's cgroup (and the kernel's OOM counter in it) still exists
/// when the unit's last process ended: systemd removes an empty scope's cgroup
/// at once. It costs a task (`TasksMax` is the unit's pids + 1) and a few
/// pages; it is never the OOM killer's choice (`oom_score_adj` -1000). If the
/// shim is killed the holder exits, and the scope lives on with the unit.
fn spawn_holder() -> std::io::Result<(u32, OwnedFd)> {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;

    let pipe =
        || rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).map_err(std::io::Error::from);
    let (pid_r, pid_w) = pipe()?;
    let (hold_r, hold_w) = pipe()?;
    let hold_w_raw = hold_w.as_raw_fd();
    // Never exec'd: the hook does not return Ok.
    let mut cmd = std::process::Command::new("/proc/self/exe");
    cmd.stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    // SAFETY: the hook runs in the forked child and only makes raw system
    // calls (getpid, write, close, read) on descriptors it owns or was given
    // the number of.
    unsafe {
        cmd.pre_exec(move || {
            // The fork has a copy of the pipe's write end: without closing it,
            // it would never see the pipe close.
            rustix::io::close(hold_w_raw);
            let pid = rustix::process::getpid()
                .as_raw_nonzero()
                .get()
                .to_ne_bytes();
            rustix::io::write(&pid_w, &pid)?;
            let mut buf = [0u8; 16];
            loop {
                match rustix::io::read(&hold_r, &mut buf) {
                    Ok(0) => break,
                    Ok(_) | Err(rustix::io::Errno::INTR) => {}
                    Err(_) => break,
                }
            }
            Err(std::io::Error::other("released"))
        });
    }
    // `spawn` returns once the hook gave up, which is when the holder exits;
    // its thread reaps it then.
    std::thread::Builder::new()
        .name("scope-holder".into())
        .spawn(move || {
            let _ = cmd.spawn();
        })?;
    let mut buf = [0u8; 4];
    match rustix::io::read(&pid_r, &mut buf) {
        Ok(4) => {}
        _ => return Err(std::io::Error::other("the holder did not start")),
    }
    let pid = u32::from_ne_bytes(buf);
    // Root may lower it; a holder the OOM killer took would leave a scope
    // whose cgroup goes before its counter is read.
    let _ = std::fs::write(format!("/proc/{pid}/oom_score_adj"), "-1000");
    Ok((pid, hold_w))
}

/// `<name>.scope`, `name` escaped as systemd escapes unit names (bytes other
/// than ASCII letters, digits, `:`, `_` and `.` as `\xNN`; `-` kept; a
/// leading `.` escaped), cut to systemd's 255-byte limit with a hash.
pub fn scope_name(name: &str) -> String {
    let mut escaped = String::with_capacity(name.len());
    for (i, b) in name.bytes().enumerate() {
        match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b':' | b'_' | b'-' => {
                escaped.push(char::from(b))
            }
            b'.' if i > 0 => escaped.push('.'),
            _ => escaped.push_str(&format!("\\x{b:02x}")),
        }
    }
    if escaped.is_empty() {
        escaped.push_str("unit");
    }
    const MAX: usize = 255 - ".scope".len();
    if escaped.len() > MAX {
        let hash = format!("-{:016x}", super::sandbox::fnv(name.as_bytes()));
        // Escapes are ASCII: any byte index is a char boundary.
        escaped.truncate(MAX - hash.len());
        escaped.push_str(&hash);
    }
    format!("{escaped}.scope")
}

/// Run `f` on a thread of its own and wait at most `within` for it: a hung
/// systemd (or bus) leaves that thread behind, never the caller.
fn bounded<T: Send + 'static>(
    within: Duration,
    what: &str,
    f: impl FnOnce() -> Result<T, String> + Send + 'static,
) -> Result<T, String> {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    std::thread::Builder::new()
        .name("systemd".into())
        .spawn(move || {
            let _ = tx.send(f());
        })
        .map_err(|e| format!("{what}: cannot start a thread: {e}"))?;
    match rx.recv_timeout(within) {
        Ok(r) => r,
        Err(_) => Err(format!("{what} did not answer within {within:?}")),
    }
}

/// The system bus. Not systemd's private socket (`/run/systemd/private`):
/// zbus panics on the sender field of its messages (systemd 252; observed),
/// so units need dbus-daemon where they run in scopes.
fn connect() -> Result<Connection, String> {
    zbus::blocking::connection::Builder::system()
        .and_then(|b| b.method_timeout(CALL_TIMEOUT).build())
        .map_err(|e| format!("cannot reach systemd on the system bus: {e}"))
}

/// The D-Bus error's name, when `e` is one.
fn error_name(e: &zbus::Error) -> Option<&str> {
    match e {
        zbus::Error::MethodError(name, _, _) => Some(name.as_str()),
        _ => None,
    }
}

fn call<B>(conn: &Connection, method: &str, body: &B) -> zbus::Result<zbus::Message>
where
    B: serde::Serialize + zbus::zvariant::DynamicType,
{
    conn.call_method(Some(DESTINATION), MANAGER_PATH, Some(MANAGER), method, body)
}

/// The unit's object, if systemd has it loaded.
fn unit_path(conn: &Connection, unit: &str) -> zbus::Result<Option<OwnedObjectPath>> {
    match call(conn, "GetUnit", &(unit,)) {
        Ok(reply) => Ok(Some(reply.body().deserialize()?)),
        Err(e) if error_name(&e) == Some("org.freedesktop.systemd1.NoSuchUnit") => Ok(None),
        Err(e) => Err(e),
    }
}

/// A string property of an object.
fn property(
    conn: &Connection,
    path: &OwnedObjectPath,
    iface: &str,
    name: &str,
) -> zbus::Result<String> {
    let reply = conn.call_method(
        Some(DESTINATION),
        path.as_str(),
        Some(PROPERTIES),
        "Get",
        &(iface, name),
    )?;
    let value: OwnedValue = reply.body().deserialize()?;
    String::try_from(value).map_err(zbus::Error::from)
}

/// The unit's `ActiveState`, `None` when it is not loaded.
fn active_state(conn: &Connection, unit: &str) -> zbus::Result<Option<String>> {
    match unit_path(conn, unit)? {
        Some(path) => property(conn, &path, UNIT, "ActiveState").map(Some),
        None => Ok(None),
    }
}

/// Whether the job still exists (it is gone once it finished).
fn job_pending(conn: &Connection, job: &OwnedObjectPath) -> bool {
    property(conn, job, JOB, "State").is_ok()
}

/// Make the scope holding `pids` (the unit's process, then the holder);
/// its name and cgroup.
fn start(
    conn: &Connection,
    unit: &str,
    pids: &[u32],
    limits: &Limits,
    deadline: Instant,
) -> Result<(String, Option<String>), String> {
    let mut properties: Vec<(&str, Value<'_>)> = vec![
        (
            "Description",
            Value::from(format!(
                "mesh unit process {}",
                pids.first().copied().unwrap_or(0)
            )),
        ),
        ("PIDs", Value::from(pids.to_vec())),
        ("TasksAccounting", Value::from(true)),
        // The holder is one of them.
        ("TasksMax", Value::from(limits.pids.saturating_add(1))),
    ];
    if let Some(m) = limits.memory_bytes {
        properties.push(("MemoryAccounting", Value::from(true)));
        properties.push(("MemoryMax", Value::from(m)));
        // No swap: over the limit means killed, not slowed.
        properties.push(("MemorySwapMax", Value::from(0u64)));
    }
    if let Some(c) = limits.cpu_millis {
        let usec = c.saturating_mul(1000).max(MIN_CPU_USEC_PER_SEC);
        properties.push(("CPUQuotaPerSecUSec", Value::from(usec)));
    }
    let aux: Vec<(&str, Vec<(&str, Value<'_>)>)> = Vec::new();
    let body = (unit, "fail", &properties, &aux);
    let job: OwnedObjectPath = match call(conn, "StartTransientUnit", &body) {
        Ok(reply) => reply
            .body()
            .deserialize()
            .map_err(|e| format!("{unit}: systemd's answer to StartTransientUnit: {e}"))?,
        Err(e) if error_name(&e) == Some("org.freedesktop.systemd1.UnitExists") => {
            // Left by an earlier process of this unit (something that left
            // its process group, or a failed scope nobody reset): it goes.
            clear(conn, unit, deadline)?;
            call(conn, "StartTransientUnit", &body)
                .and_then(|reply| reply.body().deserialize())
                .map_err(|e| {
                    format!("{unit}: StartTransientUnit (after clearing a leftover scope): {e}")
                })?
        }
        Err(e) => return Err(format!("{unit}: StartTransientUnit: {e}")),
    };
    loop {
        let state =
            active_state(conn, unit).map_err(|e| format!("{unit}: reading its state: {e}"))?;
        match state.as_deref() {
            Some("active") => break,
            Some("failed") => {
                let result = unit_path(conn, unit)
                    .ok()
                    .flatten()
                    .and_then(|p| property(conn, &p, SCOPE, "Result").ok())
                    .unwrap_or_default();
                let _ = call(conn, "ResetFailedUnit", &(unit,));
                return Err(format!(
                    "{unit}: systemd could not start it (result {result:?})"
                ));
            }
            other if !job_pending(conn, &job) => {
                return Err(format!(
                    "{unit}: its start job ended and it is {}",
                    other.unwrap_or("not loaded")
                ));
            }
            _ => {}
        }
        if Instant::now() >= deadline {
            return Err(format!("{unit}: not started within {START_TIMEOUT:?}"));
        }
        std::thread::sleep(POLL);
    }
    let control_group = unit_path(conn, unit)
        .ok()
        .flatten()
        .and_then(|p| property(conn, &p, SCOPE, "ControlGroup").ok())
        .filter(|cg| !cg.is_empty());
    Ok((unit.to_owned(), control_group))
}

/// Kill everything in the scope, reset it if it failed, and wait (until
/// `deadline`) for systemd to have forgotten it: a transient unit of that name
/// cannot start while one is loaded.
fn clear(conn: &Connection, unit: &str, deadline: Instant) -> Result<(), String> {
    let _ = call(conn, "KillUnit", &(unit, "all", sigkill()));
    loop {
        match active_state(conn, unit) {
            Ok(None) => return Ok(()),
            Ok(Some(s)) if s == "failed" => {
                let _ = call(conn, "ResetFailedUnit", &(unit,));
            }
            Ok(Some(_)) => {}
            Err(e) => return Err(format!("{unit}: reading a leftover scope's state: {e}")),
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "{unit}: a leftover scope of that name does not go away"
            ));
        }
        std::thread::sleep(POLL);
    }
}

/// After the leader exited: kill the rest, wait (until `deadline`) for the
/// scope to end, read systemd's `Result`, and reset it. Whether systemd says
/// OOM.
fn release(conn: &Connection, unit: &str, deadline: Instant) -> bool {
    let _ = call(conn, "KillUnit", &(unit, "all", sigkill()));
    let mut oom = false;
    loop {
        let Ok(Some(path)) = unit_path(conn, unit) else {
            // Ended well and collected already (or systemd cannot say).
            break;
        };
        let state = property(conn, &path, UNIT, "ActiveState").unwrap_or_default();
        if matches!(state.as_str(), "inactive" | "failed") || Instant::now() >= deadline {
            oom = property(conn, &path, SCOPE, "Result").is_ok_and(|r| r == "oom-kill");
            break;
        }
        std::thread::sleep(POLL);
    }
    let _ = call(conn, "ResetFailedUnit", &(unit,));
    oom
}

fn sigkill() -> i32 {
    rustix::process::Signal::KILL.as_raw()
}

/// The kernel's OOM kill count of the cgroup systemd calls `control_group`:
/// `memory.events` on cgroup v2, the memory hierarchy's `memory.oom_control`
/// on v1 (hybrid included); 0 when it cannot be read (gone already).
fn oom_kills(control_group: &str) -> u64 {
    let rel = control_group.trim_start_matches('/');
    let file = match cgroup::detect() {
        Some(cgroup::Layout::V2 { base }) => base.join(rel).join("memory.events"),
        Some(cgroup::Layout::V1 { memory, .. }) => memory.join(rel).join("memory.oom_control"),
        None => return 0,
    };
    cgroup::read_oom_kills(&file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scope_names_are_valid_unit_names() {
        assert_eq!(scope_name("mesh-web-ab12"), "mesh-web-ab12.scope");
        assert_eq!(scope_name("mesh-a b/c"), "mesh-a\\x20b\\x2fc.scope");
        assert_eq!(scope_name(".x"), "\\x2ex.scope");
        assert_eq!(scope_name(""), "unit.scope");
        let long = scope_name(&"é".repeat(200));
        assert!(long.len() <= 255, "{}", long.len());
        assert!(long.ends_with(".scope"));
        assert_ne!(long, scope_name(&"é".repeat(199)));
    }
}
