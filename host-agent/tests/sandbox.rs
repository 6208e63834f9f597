//! The unit sandbox (decision 0051) with real processes, real users and real
//! cgroups, without systemd (this machine's PID 1 is not systemd; the systemd
//! backend has its own test, `systemd_sandbox.rs`):
//! - a unit runs as its module's user (read from /proc), cannot read another
//!   module's secrets nor the agent's keys, and reads its own;
//! - its data volume survives a restart, a new revision and an agent restart,
//!   and goes (with the user) once the module left for the retention;
//! - over its memory limit it is OOM-killed and reported `oom_killed`; a fork
//!   bomb is held at its pids limit; a busy loop gets its CPU quota and no more
//!   (read from the cgroup's own usage);
//! - an agent restart keeps every unit's pid and cgroup.
//!
//! Every wait is on a condition with a deadline. Module names are this file's
//! own (`box…`): users are per host, tests run in parallel.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::path::{Path, PathBuf};
use std::time::Duration;

use mesh_host_agent::apply::Applier;
use mesh_host_agent::metrics::Metrics;
use mesh_host_agent::store::SectionState;
use mesh_host_agent::units::sandbox::{data_dir, user_name};
use mesh_host_agent::units::{Supervisor, UnitsConfig, cgroup};
use mesh_protocol::{
    Declaration, DeclarationItems, DesiredState, FileItem, FileMode, RestartPolicy, Section,
    UnitItem, UnitLimits, UnitState, UnitStatus, UnitUser,
};
use tokio::time::{Instant, timeout};

const DEADLINE: Duration = Duration::from_secs(20);

/// Root is needed to make users and cgroups: without it these tests fail
/// under MESH_REQUIRE_ALL=1 and skip (saying so) elsewhere.
fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

const NEEDS_ROOT: &str = "the sandbox needs root (users, cgroups)";

fn config() -> UnitsConfig {
    UnitsConfig {
        stop_timeout: Duration::from_secs(2),
        restart_backoff_min: Duration::from_millis(50),
        restart_backoff_max: Duration::from_millis(200),
        shim_program: Some(env!("CARGO_BIN_EXE_mesh-agent").into()),
        ..UnitsConfig::default()
    }
}

fn sh(name: &str, module: &str, script: &str) -> UnitItem {
    UnitItem {
        name: name.into(),
        module: module.into(),
        command: "/bin/sh".into(),
        args: vec!["-c".into(), script.into()],
        env: Default::default(),
        working_dir: None,
        restart: RestartPolicy::Always,
        desired: DesiredState::Running,
        probes: Vec::new(),
        artifact: None,
        revision: None,
        user: UnitUser::Module,
        limits: UnitLimits::default(),
        stateful: false,
    }
}

struct Fixture {
    _dir: tempfile::TempDir,
    root: PathBuf,
    state: PathBuf,
}

/// A root and a state dir that units can pass through, as a package's are
/// (`/` and `/var/lib/mesh-agent`): a test's temporary directory is 0700.
fn dirs() -> Fixture {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let root = dir.path().join("root");
    let state = dir.path().join("state");
    std::fs::create_dir_all(&root).unwrap();
    std::fs::create_dir_all(&state).unwrap();
    std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755)).unwrap();
    Fixture {
        _dir: dir,
        root,
        state,
    }
}

async fn wait_unit(
    sup: &Supervisor,
    name: &str,
    what: &str,
    pred: impl Fn(&UnitStatus) -> bool,
) -> UnitStatus {
    let found = |list: &[UnitStatus]| list.iter().any(|u| u.name == name && pred(u));
    timeout(DEADLINE, sup.wait_until(found))
        .await
        .unwrap_or_else(|_| panic!("no {what} within {DEADLINE:?}: {:?}", sup.statuses()));
    sup.statuses()
        .into_iter()
        .find(|u| u.name == name && pred(u))
        .unwrap()
}

async fn wait_for(what: &str, mut check: impl FnMut() -> bool) {
    let until = Instant::now() + DEADLINE;
    while !check() {
        assert!(Instant::now() < until, "no {what} within {DEADLINE:?}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

fn running(u: &UnitStatus) -> bool {
    u.state == UnitState::Running && u.pid.is_some()
}

/// The real uid of `pid`, from /proc.
fn uid_of(pid: u32) -> u32 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap()
}

fn passwd_uid(name: &str) -> Option<u32> {
    std::fs::read_to_string("/etc/passwd")
        .unwrap()
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            (f[0] == name).then(|| f[2].parse().unwrap())
        })
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

fn files(items: Vec<(&str, &str, u32)>) -> Declaration {
    Declaration {
        section: Section::Config,
        generation: 1,
        items: DeclarationItems {
            files: items
                .into_iter()
                .map(|(path, content, mode)| FileItem {
                    path: path.into(),
                    content: content.into(),
                    mode: FileMode::new(mode).unwrap(),
                })
                .collect(),
            ..Default::default()
        },
    }
}

#[tokio::test]
async fn a_unit_runs_as_its_modules_user_and_reaches_no_other_modules_secrets_nor_the_agents_keys()
-> anyhow::Result<()> {
    if !is_root() {
        return mesh_testkit::skip(NEEDS_ROOT);
    }
    let fx = dirs();
    // The agent's own keys, as the agent makes them.
    let (_, _) =
        mesh_host_agent::credentials::load_or_create_seal_key(&fx.state).expect("seal key");
    let key = fx.state.join(mesh_host_agent::credentials::SEAL_KEY_FILE);
    assert!(key.is_file());
    // Two modules' files, as the config context declares them.
    let applier = Applier::new(&fx.root, std::slice::from_ref(&fx.state))
        .unwrap()
        .with_module_owners(true);
    let report = applier.apply(
        &files(vec![
            ("/modules/boxa/secrets/grant-db.env", "PASSWORD=a\n", 0o600),
            ("/modules/boxb/secrets/grant-db.env", "PASSWORD=b\n", 0o600),
            ("/modules/boxb/app.conf", "port=1\n", 0o644),
        ]),
        &SectionState::default(),
    );
    assert_eq!(report.error, None, "{report:?}");
    let b_secret = fx.root.join("modules/boxb/secrets/grant-db.env");
    let b_conf = fx.root.join("modules/boxb/app.conf");
    {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(&b_secret).unwrap();
        assert_eq!(
            Some(m.uid()),
            passwd_uid(&user_name("boxb")),
            "owned by boxb's user"
        );
    }

    let sup = Supervisor::start(config(), &fx.root, &fx.state, Metrics::new()).await;
    let mut sup = sup;
    let probe = |target: &Path| {
        format!(
            "if cat {} >/dev/null 2>&1; then echo read; else echo denied; fi",
            target.display()
        )
    };
    let a_script = format!(
        "{{ {}; {}; {}; {}; }} > \"$MESH_DATA_DIR/probe.tmp\"; mv \"$MESH_DATA_DIR/probe.tmp\" \"$MESH_DATA_DIR/probe\"; exec sleep 1000",
        probe(&b_secret),
        probe(&b_conf),
        probe(&key),
        probe(&fx.root.join("modules/boxa/secrets/grant-db.env")),
    );
    let root_unit = UnitItem {
        user: UnitUser::Root,
        ..sh("boxr", "boxr", "exec sleep 1000")
    };
    // Its exec probe runs as it does.
    let whoami: mesh_protocol::Probe = serde_json::from_value(serde_json::json!({
        "name": "whoami",
        "exec": {"command": "sh", "args": ["-c", format!("[ \"$(id -un)\" = {} ]", user_name("boxa"))]},
        "interval_secs": 1,
        "timeout_secs": 1,
        "success_threshold": 1,
    }))?;
    let a_unit = UnitItem {
        probes: vec![whoami],
        ..sh("boxa", "boxa", &a_script)
    };
    sup.declare(&[a_unit, root_unit]);
    let a = wait_unit(&sup, "boxa", "boxa running", running).await;
    let r = wait_unit(&sup, "boxr", "boxr running", running).await;
    let a_uid = passwd_uid(&user_name("boxa")).expect("boxa's user exists");
    assert!(
        (mesh_protocol::MODULE_UID_MIN..=mesh_protocol::MODULE_UID_MAX).contains(&a_uid),
        "{a_uid}"
    );
    assert_eq!(uid_of(a.pid.unwrap()), a_uid, "runs as its module's user");
    assert_eq!(a.uid, Some(a_uid), "and says so");
    assert_eq!(uid_of(r.pid.unwrap()), 0, "user: root runs as root");

    let out = data_dir(&fx.state, "boxa").join("probe");
    wait_for("boxa's probe", || out.is_file()).await;
    assert_eq!(
        read(&out).lines().collect::<Vec<_>>(),
        ["denied", "denied", "denied", "read"],
        "another module's secret, its settings and the agent's seal key are unreadable; its own secret is not"
    );
    wait_for("boxa's exec probe healthy (it runs as boxa's user)", || {
        sup.probe_results()
            .iter()
            .any(|r| r.probe == "whoami" && r.state == mesh_protocol::ProbeState::Healthy)
    })
    .await;
    sup.stop_all().await;
    Ok(())
}

#[tokio::test]
async fn the_data_volume_outlives_restarts_revisions_and_the_agent_and_goes_when_the_module_left()
-> anyhow::Result<()> {
    if !is_root() {
        return mesh_testkit::skip(NEEDS_ROOT);
    }
    let fx = dirs();
    let cfg = UnitsConfig {
        data_retention: Duration::from_secs(1),
        ..config()
    };
    let script = "echo start >> \"$MESH_DATA_DIR/starts\"; exec sleep 1000";
    let v1 = sh("boxv", "boxv", script);
    let mut sup = Supervisor::start(cfg.clone(), &fx.root, &fx.state, Metrics::new()).await;
    sup.declare(std::slice::from_ref(&v1));
    let starts = data_dir(&fx.state, "boxv").join("starts");
    let count = || read(&starts).lines().count();
    let u = wait_unit(&sup, "boxv", "running", running).await;
    wait_for("first start written", || count() == 1).await;
    let uid = passwd_uid(&user_name("boxv")).unwrap();
    {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(data_dir(&fx.state, "boxv")).unwrap();
        assert_eq!((m.uid(), m.mode() & 0o777), (uid, 0o700));
    }
    // Restarted after a crash: the volume is kept.
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(u.pid.unwrap() as i32).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    wait_for("second start", || count() == 2).await;
    // A new revision: kept.
    let v2 = UnitItem {
        revision: Some(uuid::Uuid::from_u128(0x30)),
        ..v1.clone()
    };
    sup.declare(std::slice::from_ref(&v2));
    wait_for("third start (new revision)", || count() == 3).await;
    let u = wait_unit(&sup, "boxv", "running v2", |u| {
        running(u) && u.revision == v2.revision
    })
    .await;
    assert!(u.data_bytes.is_some_and(|b| b > 0), "{u:?}");
    // The agent restarts (as for an upgrade): the unit is adopted, the volume kept.
    sup.shutdown().await;
    let mut sup = Supervisor::start(cfg, &fx.root, &fx.state, Metrics::new()).await;
    sup.declare(std::slice::from_ref(&v2));
    let adopted = wait_unit(&sup, "boxv", "adopted", running).await;
    assert_eq!(adopted.pid, u.pid, "adopted, not restarted");
    assert_eq!(count(), 3);
    // The module leaves: after the retention its volume and its user go.
    sup.declare(&[]);
    let dir = data_dir(&fx.state, "boxv");
    wait_for("the volume removed after the retention", || !dir.exists()).await;
    wait_for("the module's user removed", || {
        passwd_uid(&user_name("boxv")).is_none()
    })
    .await;
    sup.stop_all().await;
    Ok(())
}

#[tokio::test]
async fn a_stateful_modules_volume_is_kept_when_it_leaves() -> anyhow::Result<()> {
    if !is_root() {
        return mesh_testkit::skip(NEEDS_ROOT);
    }
    let fx = dirs();
    let cfg = UnitsConfig {
        data_retention: Duration::ZERO,
        ..config()
    };
    let db = UnitItem {
        stateful: true,
        ..sh(
            "boxs",
            "boxs",
            "echo x > \"$MESH_DATA_DIR/f\"; exec sleep 1000",
        )
    };
    let gone = sh("boxg", "boxg", "exec sleep 1000");
    let mut sup = Supervisor::start(cfg, &fx.root, &fx.state, Metrics::new()).await;
    sup.declare(&[db, gone]);
    wait_unit(&sup, "boxs", "running", running).await;
    wait_unit(&sup, "boxg", "running", running).await;
    sup.declare(&[]);
    let g = data_dir(&fx.state, "boxg");
    wait_for("the stateless module's volume removed", || !g.exists()).await;
    assert!(
        data_dir(&fx.state, "boxs").join("f").is_file(),
        "the stateful module's volume is kept"
    );
    sup.stop_all().await;
    Ok(())
}

/// The cgroup directory of `pid` for `controller`.
fn cgroup_of(pid: u32, controller: &str) -> PathBuf {
    cgroup::of_process(pid, controller).expect("the process has a cgroup")
}

#[tokio::test]
async fn over_its_memory_limit_a_unit_is_oom_killed_and_reported() -> anyhow::Result<()> {
    if !is_root() {
        return mesh_testkit::skip(NEEDS_ROOT);
    }
    let fx = dirs();
    let hog = UnitItem {
        restart: RestartPolicy::Never,
        limits: UnitLimits {
            memory_bytes: Some(32 << 20),
            ..Default::default()
        },
        // 256 MiB written, not just reserved.
        ..sh(
            "boxm",
            "boxm",
            "sleep 0.2; exec python3 -c 'b = bytearray(b\"x\") * (256 << 20); print(len(b))'",
        )
    };
    let mut sup = Supervisor::start(config(), &fx.root, &fx.state, Metrics::new()).await;
    sup.declare(std::slice::from_ref(&hog));
    let u = wait_unit(&sup, "boxm", "OOM-killed", |u| {
        u.state == UnitState::Failed && u.reason.is_some()
    })
    .await;
    assert_eq!(u.reason.as_deref(), Some(mesh_protocol::REASON_OOM_KILLED));
    assert_eq!(u.oom_kills, 1);
    assert_eq!(u.exit_code, Some(128 + 9), "killed by SIGKILL");
    sup.stop_all().await;
    Ok(())
}

#[tokio::test]
async fn a_fork_bomb_is_held_at_its_pids_limit_and_a_busy_loop_at_its_cpu_quota()
-> anyhow::Result<()> {
    if !is_root() {
        return mesh_testkit::skip(NEEDS_ROOT);
    }
    let fx = dirs();
    // Bounded (200 forks) so that a broken limit cannot hurt the machine.
    const BOMB: &str = "import os, time\nn = 0\nfor i in range(200):\n    try:\n        if os.fork() == 0:\n            time.sleep(1000)\n            os._exit(0)\n        n += 1\n    except OSError:\n        pass\nprint('forked', n, flush=True)\ntime.sleep(1000)\n";
    let bomb = UnitItem {
        limits: UnitLimits {
            pids: Some(16),
            ..Default::default()
        },
        // A shell dies at its first refused fork: Python counts them instead.
        command: "python3".into(),
        args: vec!["-c".into(), BOMB.into()],
        ..sh("boxf", "boxf", "")
    };
    let busy = UnitItem {
        limits: UnitLimits {
            cpu_millis: Some(200),
            ..Default::default()
        },
        ..sh("boxc", "boxc", "while :; do :; done")
    };
    let mut sup = Supervisor::start(config(), &fx.root, &fx.state, Metrics::new()).await;
    sup.declare(&[bomb, busy]);
    let f = wait_unit(&sup, "boxf", "bomb running", running).await;
    let pids = cgroup_of(f.pid.unwrap(), "pids");
    wait_for("the bomb at its limit", || {
        read(&pids.join("pids.current")).trim() == "16"
    })
    .await;
    // Refused forks are counted by the kernel.
    let events = read(&pids.join("pids.events"));
    assert!(
        events
            .lines()
            .any(|l| l.starts_with("max ") && l != "max 0"),
        "{events}"
    );
    assert_eq!(read(&pids.join("pids.max")).trim(), "16");
    let log = fx.state.join("units/boxf/stdout.log");
    wait_for("the bomb's count", || read(&log).contains("forked")).await;
    assert_eq!(read(&log).trim(), "forked 15", "15 children and itself");
    // The node still forks.
    assert!(
        std::process::Command::new("true")
            .status()
            .unwrap()
            .success()
    );

    let c = wait_unit(&sup, "boxc", "busy loop running", running).await;
    let usage = cpu_usage_reader(c.pid.unwrap());
    let (u0, t0) = (usage(), std::time::Instant::now());
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (u1, t1) = (usage(), std::time::Instant::now());
    let share = (u1 - u0) as f64 / (t1 - t0).as_nanos() as f64;
    assert!(
        share <= 0.25,
        "cpu 0.2 used {:.1} % of a core",
        share * 100.0
    );
    assert!(
        share >= 0.05,
        "the busy loop hardly ran ({:.1} %): the premise failed",
        share * 100.0
    );
    sup.stop_all().await;
    Ok(())
}

/// A reader of the CPU time (ns) used in `pid`'s cgroup: v1's
/// `cpuacct.usage`, or v2's `cpu.stat` `usage_usec`.
fn cpu_usage_reader(pid: u32) -> impl Fn() -> u64 {
    let v2 = Path::new("/sys/fs/cgroup/cgroup.controllers").is_file();
    let dir = cgroup_of(pid, if v2 { "cpu" } else { "cpuacct" });
    move || {
        if v2 {
            read(&dir.join("cpu.stat"))
                .lines()
                .find_map(|l| l.strip_prefix("usage_usec "))
                .and_then(|n| n.trim().parse::<u64>().ok())
                .map(|us| us * 1000)
                .unwrap()
        } else {
            read(&dir.join("cpuacct.usage")).trim().parse().unwrap()
        }
    }
}

#[tokio::test]
async fn an_agent_restart_keeps_every_units_pid_and_cgroup() -> anyhow::Result<()> {
    if !is_root() {
        return mesh_testkit::skip(NEEDS_ROOT);
    }
    let fx = dirs();
    let item = UnitItem {
        limits: UnitLimits {
            memory_bytes: Some(64 << 20),
            pids: Some(32),
            cpu_millis: Some(500),
        },
        ..sh("boxk", "boxk", "exec sleep 1000")
    };
    let mut sup = Supervisor::start(config(), &fx.root, &fx.state, Metrics::new()).await;
    sup.declare(std::slice::from_ref(&item));
    let u = wait_unit(&sup, "boxk", "running", running).await;
    let pid = u.pid.unwrap();
    let before = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    let mem = cgroup_of(pid, "memory");
    assert!(
        mem.ends_with(format!("mesh-units/mesh-boxk-{}", key_of(&fx.state)))
            || mem.to_string_lossy().contains("mesh-boxk"),
        "{}",
        mem.display()
    );
    sup.shutdown().await;
    let mut sup = Supervisor::start(config(), &fx.root, &fx.state, Metrics::new()).await;
    sup.declare(std::slice::from_ref(&item));
    let adopted = wait_unit(&sup, "boxk", "adopted", running).await;
    assert_eq!(adopted.pid, Some(pid), "same process");
    assert_eq!(
        std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap(),
        before,
        "same cgroups"
    );
    let v2 = Path::new("/sys/fs/cgroup/cgroup.controllers").is_file();
    let limit = if v2 {
        "memory.max"
    } else {
        "memory.limit_in_bytes"
    };
    assert_eq!(read(&mem.join(limit)).trim(), (64u64 << 20).to_string());
    sup.stop_all().await;
    wait_for("its cgroup removed once stopped", || !mem.exists()).await;
    Ok(())
}

fn key_of(state: &Path) -> String {
    let units = state.join("units");
    format!(
        "{:08x}",
        mesh_host_agent::units::sandbox::fnv(units.as_os_str().as_encoded_bytes()) as u32
    )
}
