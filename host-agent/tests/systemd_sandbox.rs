//! The systemd backend of the units' sandbox under a real systemd as PID 1:
//! a Debian 12 container (mesh_testkit::container) runs `mesh-agent
//! unit-shim` with launches whose cgroup plan is `systemd`. A unit runs as its
//! module's user in `<name>.scope` with `MemoryMax` and `TasksMax` set; one
//! that allocates past its memory ends `oom_killed`; a fork bomb is held at
//! `TasksMax`; the scope outlives its shim being killed.
//!
//! Needs root and systemd-nspawn (the tree is made once per machine when
//! missing); elsewhere it skips, and fails under MESH_REQUIRE_ALL.

use std::io::{BufRead as _, BufReader, Write as _};
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use mesh_testkit::container::{self, Bind, Container};
use serde_json::{Value, json};

const UID: u32 = 60_150;
/// Where the host's temp dir is inside: unit dirs and their records.
const SHARED: &str = "/mesh-test";
const AGENT: &str = "/usr/local/bin/mesh-agent";

fn launch(unit: &str, argv: &[&str], memory: Option<u64>, pids: u64) -> Value {
    json!({
        "unit": unit,
        "dir": format!("{SHARED}/{unit}"),
        "command": argv[0],
        "args": &argv[1..],
        "env": {"PATH": "/usr/bin:/bin"},
        "working_dir": "/",
        "log_max_bytes": 1_000_000,
        "log_files": 2,
        "restarts": 0,
        "spec": {"module": "box", "command": argv[0], "args": &argv[1..], "env": {}, "working_dir": null},
        "sandbox": {
            "uid": UID,
            "gid": UID,
            "cgroup": {
                "backend": "systemd",
                "name": format!("mesh-{unit}-t"),
                "limits": {"cpu_millis": 500, "memory_bytes": memory, "pids": pids}
            }
        }
    })
}

/// Start a shim in the container with `launch`; the shim's process (nsenter
/// on the host) and the unit's pid inside, from the shim's reply.
fn start_shim(
    c: &Container,
    shared: &Path,
    launch: &Value,
) -> anyhow::Result<(std::process::Child, u32)> {
    let unit = launch["unit"].as_str().unwrap_or_default();
    let dir = shared.join(unit);
    std::fs::create_dir_all(&dir)?;
    let mut shim = c
        .command(&[AGENT, "unit-shim"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut stdin = shim
        .stdin
        .take()
        .ok_or_else(|| anyhow::anyhow!("no stdin"))?;
    stdin.write_all(&serde_json::to_vec(launch)?)?;
    drop(stdin);
    let stdout = shim
        .stdout
        .take()
        .ok_or_else(|| anyhow::anyhow!("no stdout"))?;
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line)?;
    let reply: Value = serde_json::from_str(&line).map_err(|e| {
        let mut err = String::new();
        if let Some(mut s) = shim.stderr.take() {
            let _ = std::io::Read::read_to_string(&mut s, &mut err);
        }
        anyhow::anyhow!("shim's reply {line:?}: {e}; stderr: {err}")
    })?;
    let pid = reply["started"]["pid"]
        .as_u64()
        .ok_or_else(|| anyhow::anyhow!("the shim did not start the unit: {reply}"))?;
    Ok((shim, u32::try_from(pid)?))
}

fn show(c: &Container, scope: &str, property: &str) -> anyhow::Result<String> {
    c.sh(&format!("systemctl show -P {property} {scope}"))
}

fn exit_record(shared: &Path, unit: &str, within: Duration) -> anyhow::Result<Value> {
    let file = shared.join(unit).join("exit");
    let deadline = Instant::now() + within;
    loop {
        if let Ok(text) = std::fs::read_to_string(&file) {
            return Ok(serde_json::from_str(&text)?);
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "no exit record at {} within {within:?}",
            file.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn units_run_in_systemd_scopes_with_their_limits() -> anyhow::Result<()> {
    if let Some(why) = container::unavailable() {
        return mesh_testkit::skip(&why);
    }
    let shared = tempfile::tempdir()?;
    // The unit's user writes its logs' directory through the shim (root);
    // the shared dir itself only needs to be reachable.
    let t0 = Instant::now();
    let c = Container::boot(&[
        Bind::read_only(env!("CARGO_BIN_EXE_mesh-agent"), AGENT),
        Bind::writable(shared.path(), SHARED),
    ])?;
    eprintln!("container {} booted in {:?}", c.name(), t0.elapsed());
    let result = checks(&c, shared.path());
    if result.is_err() {
        eprintln!(
            "--- journal ---\n{}",
            c.sh("journalctl -n 80 --no-pager").unwrap_or_default()
        );
    }
    let t1 = Instant::now();
    c.shutdown()?;
    eprintln!("container halted in {:?}", t1.elapsed());
    result
}

fn checks(c: &Container, shared: &Path) -> anyhow::Result<()> {
    c.sh(&format!(
        "groupadd --system --gid {UID} mesh-box && useradd --system --uid {UID} --gid {UID} --no-create-home --shell /usr/sbin/nologin mesh-box"
    ))?;

    // 1. Its user, its scope and limits; the scope outlives the shim.
    let t = Instant::now();
    let l = launch("sleeper", &["/bin/sleep", "300"], Some(64 << 20), 16);
    let (mut shim, pid) = start_shim(c, shared, &l)?;
    let scope = "mesh-sleeper-t.scope";
    assert_eq!(c.sh(&format!("stat -c %u /proc/{pid}"))?, UID.to_string());
    let cgroup = c.sh(&format!("cat /proc/{pid}/cgroup"))?;
    assert!(
        cgroup.lines().any(|l| l.ends_with(&format!("/{scope}"))),
        "{cgroup}"
    );
    assert_eq!(show(c, scope, "ActiveState")?, "active");
    assert_eq!(show(c, scope, "MemoryMax")?, (64u64 << 20).to_string());
    assert_eq!(
        show(c, scope, "TasksMax")?,
        "17",
        "the unit's 16 and the holder"
    );
    assert_eq!(show(c, scope, "CPUQuotaPerSecUSec")?, "500ms");
    // Enforced, not only said: the kernel's files of its cgroup.
    let memory_limit = c.sh(&format!(
        "cat /sys/fs/cgroup/memory/system.slice/{scope}/memory.limit_in_bytes 2>/dev/null || cat /sys/fs/cgroup/system.slice/{scope}/memory.max"
    ))?;
    assert_eq!(memory_limit, (64u64 << 20).to_string());
    let pids_limit = c.sh(&format!(
        "cat /sys/fs/cgroup/pids/system.slice/{scope}/pids.max 2>/dev/null || cat /sys/fs/cgroup/system.slice/{scope}/pids.max"
    ))?;
    assert_eq!(pids_limit, "17");
    // The shim goes; the unit and its scope stay.
    let record: Value =
        serde_json::from_str(&std::fs::read_to_string(shared.join("sleeper/pid"))?)?;
    let shim_pid = record["shim"]["pid"]
        .as_u64()
        .ok_or_else(|| anyhow::anyhow!("no shim in the pid record: {record}"))?;
    c.sh(&format!("kill -KILL {shim_pid}"))?;
    let _ = shim.wait();
    std::thread::sleep(Duration::from_millis(500));
    c.sh(&format!("kill -0 {pid}"))?;
    assert_eq!(show(c, scope, "ActiveState")?, "active");
    assert_eq!(
        show(c, scope, "TasksCurrent")?,
        "1",
        "the unit alone: the holder left with the shim"
    );
    c.sh(&format!("systemctl kill -s KILL {scope}"))?;
    eprintln!("scope, user, limits, outliving the shim: {:?}", t.elapsed());

    // 2. Past its memory: OOM-killed, and the exit record says so.
    let t = Instant::now();
    let l = launch(
        "hog",
        &["/usr/bin/perl", "-e", "$x = 'a' x 300_000_000; sleep 30"],
        Some(64 << 20),
        16,
    );
    let (mut shim, _) = start_shim(c, shared, &l)?;
    let status = shim.wait()?;
    assert!(status.success(), "shim: {status}");
    let exit = exit_record(shared, "hog", Duration::from_secs(10))?;
    assert_eq!(exit["reason"], "oom_killed", "{exit}");
    assert_eq!(exit["code"], 137, "{exit}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while c.sh("systemctl list-units --all --no-legend 'mesh-hog-t.scope' | wc -l")? != "0" {
        assert!(
            Instant::now() < deadline,
            "systemd still has the scope: {}",
            c.sh("systemctl status --no-pager mesh-hog-t.scope || true")?
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!("OOM: {:?}", t.elapsed());

    // 3. A fork bomb is held at TasksMax: every process forks without end;
    // the leader stays (exec).
    let t = Instant::now();
    let l = launch(
        "bomb",
        &[
            "/bin/sh",
            "-c",
            "b() { while :; do b & done; }; b & exec sleep 30",
        ],
        None,
        16,
    );
    let (mut shim, _) = start_shim(c, shared, &l)?;
    let scope = "mesh-bomb-t.scope";
    let mut most = 0u64;
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        if let Ok(n) = show(c, scope, "TasksCurrent")?.parse::<u64>() {
            most = most.max(n);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(most <= 17, "{most} tasks in the scope, past TasksMax=17");
    // The kernel refused forks at the limit (pids.events' `max`).
    let events = c.sh(&format!(
        "cat /sys/fs/cgroup/pids/system.slice/{scope}/pids.events 2>/dev/null || cat /sys/fs/cgroup/system.slice/{scope}/pids.events"
    ))?;
    let refused: u64 = events
        .lines()
        .find_map(|l| l.strip_prefix("max ").and_then(|n| n.trim().parse().ok()))
        .unwrap_or(0);
    assert!(refused > 0, "no fork refused at the limit: {events}");
    c.sh(&format!("systemctl kill -s KILL {scope}"))?;
    let status = shim.wait()?;
    assert!(status.success(), "shim: {status}");
    let stderr = std::fs::read_to_string(shared.join("bomb/stderr.log")).unwrap_or_default();
    assert!(stderr.contains("fork"), "no fork failed? {stderr}");
    eprintln!(
        "fork bomb: {:?} (at most {most} tasks, {refused} forks refused)",
        t.elapsed()
    );
    Ok(())
}
