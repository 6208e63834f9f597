//! The unit supervisor with real processes: start, kill -9 and restart, stop,
//! removal, spec change, restart policies, process groups, captured output and
//! its rotation; and the agent running units from its store without a broker,
//! across in-process restarts and across a crash of the real binary.
//!
//! Every wait is on a condition with a deadline.

use std::path::{Path, PathBuf};
use std::time::Duration;

use mesh_host_agent::metrics::Metrics;
use mesh_host_agent::store::SectionState;
use mesh_host_agent::units::{Supervisor, UnitsConfig};
use mesh_host_agent::{Config, Store};
use mesh_protocol::{DesiredState, RestartPolicy, Section, UnitItem, UnitState, UnitStatus};
use rustix::process::{Pid, Signal};
use tokio::time::{Instant, timeout};

const DEADLINE: Duration = Duration::from_secs(15);

fn fast() -> UnitsConfig {
    UnitsConfig {
        stop_timeout: Duration::from_secs(2),
        restart_backoff_min: Duration::from_millis(50),
        restart_backoff_max: Duration::from_millis(200),
        restart_reset_after: Duration::from_secs(60),
        log_max_bytes: 1024,
        log_files: 2,
    }
}

fn sh(name: &str, script: &str) -> UnitItem {
    UnitItem {
        name: name.into(),
        module: "m".into(),
        command: "/bin/sh".into(),
        args: vec!["-c".into(), script.into()],
        env: Default::default(),
        working_dir: None,
        restart: RestartPolicy::Always,
        desired: DesiredState::Running,
    }
}

struct Fixture {
    _dir: tempfile::TempDir,
    root: PathBuf,
    state: PathBuf,
    sup: Supervisor,
}

async fn fixture(config: UnitsConfig) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    let state = dir.path().join("state");
    std::fs::create_dir_all(&root).unwrap();
    std::fs::create_dir_all(&state).unwrap();
    let sup = Supervisor::start(config, &root, &state, Metrics::new()).await;
    Fixture {
        _dir: dir,
        root,
        state,
        sup,
    }
}

/// Whether `pid` is a live (not zombie) process.
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => s
            .rfind(')')
            .and_then(|i| s[i + 1..].split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

fn kill9(pid: u32) {
    rustix::process::kill_process(Pid::from_raw(pid as i32).unwrap(), Signal::KILL).unwrap();
}

/// Wait until a unit named `name` satisfies `pred`; returns its status.
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

/// Wait for a plain condition (files, /proc), polling.
async fn wait_for(what: &str, mut check: impl FnMut() -> bool) {
    let until = Instant::now() + DEADLINE;
    while !check() {
        assert!(Instant::now() < until, "no {what} within {DEADLINE:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn running(u: &UnitStatus) -> bool {
    u.state == UnitState::Running && u.pid.is_some()
}

#[tokio::test]
async fn starts_restarts_after_kill_and_stops() {
    let mut fx = fixture(fast()).await;
    let item = sh("web", "exec sleep 1000");
    fx.sup.declare(std::slice::from_ref(&item));

    let u = wait_unit(&fx.sup, "web", "running unit", running).await;
    let pid1 = u.pid.unwrap();
    assert!(alive(pid1));
    assert_eq!(u.restarts, 0);
    assert_eq!(u.module, "m");
    assert!(u.started_at.is_some());
    // The pid file names it.
    let pidfile = std::fs::read_to_string(fx.state.join("units/web/pid")).unwrap();
    assert!(pidfile.contains(&pid1.to_string()), "{pidfile}");

    // kill -9: restarted, counted.
    kill9(pid1);
    let u = wait_unit(&fx.sup, "web", "restarted unit", |u| {
        running(u) && u.pid != Some(pid1)
    })
    .await;
    assert_eq!(u.restarts, 1);
    assert!(alive(u.pid.unwrap()));
    assert!(!alive(pid1));
    let pid2 = u.pid.unwrap();

    // Re-declaring the same spec (a new generation of the section) changes nothing.
    fx.sup.declare(std::slice::from_ref(&item));
    tokio::task::yield_now().await;
    let u = fx.sup.statuses().pop().unwrap();
    assert_eq!((u.pid, u.restarts), (Some(pid2), 1));

    // Desired stopped: stopped, still listed.
    let stopped = UnitItem {
        desired: DesiredState::Stopped,
        ..item.clone()
    };
    fx.sup.declare(std::slice::from_ref(&stopped));
    let u = wait_unit(&fx.sup, "web", "stopped unit", |u| {
        u.state == UnitState::Stopped
    })
    .await;
    assert_eq!(u.pid, None);
    wait_for("the stopped process to be gone", || !alive(pid2)).await;
    assert!(!fx.state.join("units/web/pid").exists());

    // Running again: a fresh start, a fresh count.
    fx.sup.declare(std::slice::from_ref(&item));
    let u = wait_unit(&fx.sup, "web", "running again", running).await;
    assert_eq!(u.restarts, 0);
    let pid3 = u.pid.unwrap();

    // Removed: stopped and no longer listed.
    fx.sup.declare(&[]);
    timeout(DEADLINE, fx.sup.wait_until(|l| l.is_empty()))
        .await
        .expect("removed unit leaves the list");
    wait_for("the removed unit's process to be gone", || !alive(pid3)).await;
    fx.sup.shutdown().await;
}

#[tokio::test]
async fn spec_change_restarts_and_policy_change_does_not() {
    let mut fx = fixture(fast()).await;
    let v1 = sh("api", "exec sleep 1000");
    fx.sup.declare(std::slice::from_ref(&v1));
    let pid1 = wait_unit(&fx.sup, "api", "running", running)
        .await
        .pid
        .unwrap();

    // Restart policy only: applied in place, the process is untouched.
    let v1b = UnitItem {
        restart: RestartPolicy::OnFailure,
        ..v1.clone()
    };
    fx.sup.declare(std::slice::from_ref(&v1b));
    tokio::task::yield_now().await;
    assert_eq!(fx.sup.statuses()[0].pid, Some(pid1));

    // New args: the old process stops, a new one starts with the new spec.
    let v2 = UnitItem {
        args: vec!["-c".into(), "exec sleep 999".into()],
        ..v1b.clone()
    };
    fx.sup.declare(std::slice::from_ref(&v2));
    let u = wait_unit(&fx.sup, "api", "restarted with the new spec", |u| {
        running(u) && u.pid != Some(pid1)
    })
    .await;
    assert_eq!(u.restarts, 0, "a new spec is a new unit");
    assert!(!alive(pid1));
    // The shell execs `sleep`; while an exec is under way /proc shows an
    // empty command line, so wait for the new one rather than read it once.
    let cmdline = format!("/proc/{}/cmdline", u.pid.unwrap());
    wait_for("the new process to run the new args", || {
        std::fs::read(&cmdline).is_ok_and(|c| String::from_utf8_lossy(&c).contains("999"))
    })
    .await;
    fx.sup.shutdown().await;
}

#[tokio::test]
async fn restart_policies() {
    let mut fx = fixture(fast()).await;
    let never = UnitItem {
        restart: RestartPolicy::Never,
        ..sh("never", "exec sleep 1000")
    };
    let clean_exit = UnitItem {
        restart: RestartPolicy::OnFailure,
        ..sh("clean", "exit 0")
    };
    let failing = UnitItem {
        restart: RestartPolicy::OnFailure,
        ..sh("failing", "exit 3")
    };
    let missing = sh("missing", "unused");
    let missing = UnitItem {
        command: "/nonexistent/mesh-test-binary".into(),
        ..missing
    };
    fx.sup.declare(&[never, clean_exit, failing, missing]);

    // never: killed, stays failed with the signal's code, not restarted.
    let pid = wait_unit(&fx.sup, "never", "running", running)
        .await
        .pid
        .unwrap();
    kill9(pid);
    let u = wait_unit(&fx.sup, "never", "failed", |u| u.state == UnitState::Failed).await;
    assert_eq!(u.exit_code, Some(137));
    assert_eq!(u.restarts, 0);
    assert_eq!(u.pid, None);

    // on_failure after exit 0: exited, not restarted.
    let u = wait_unit(&fx.sup, "clean", "exited", |u| u.state == UnitState::Exited).await;
    assert_eq!((u.exit_code, u.restarts), (Some(0), 0));

    // on_failure after exit 3: restarted again and again, with backoff.
    let u = wait_unit(&fx.sup, "failing", "restarted twice", |u| u.restarts >= 2).await;
    assert_eq!(u.exit_code.unwrap_or(3), 3);

    // A command that cannot start is failed and retried.
    let u = wait_unit(&fx.sup, "missing", "retried start", |u| {
        u.state == UnitState::Failed && u.restarts == 0
    })
    .await;
    assert_eq!(u.pid, None);

    // Nothing changed for `never` meanwhile.
    let u = fx
        .sup
        .statuses()
        .into_iter()
        .find(|u| u.name == "never")
        .unwrap();
    assert_eq!((u.state, u.restarts), (UnitState::Failed, 0));
    fx.sup.shutdown().await;
}

/// Backoff doubles per restart, but a process that ran `restart_reset_after`
/// is restarted after the minimum again. Eight restarts of a unit that runs
/// 150 ms take about 1.6 s with the reset; without it the backoff alone
/// (50 ms doubling: 50 + 100 + … + 3200) would take 6.35 s.
#[tokio::test]
async fn backoff_resets_after_a_stable_run() {
    let mut fx = fixture(UnitsConfig {
        restart_backoff_min: Duration::from_millis(50),
        restart_backoff_max: Duration::from_secs(10),
        restart_reset_after: Duration::from_millis(100),
        ..fast()
    })
    .await;
    let started = Instant::now();
    fx.sup.declare(&[sh("flappy", "sleep 0.15; exit 1")]);
    let u = timeout(
        Duration::from_secs(4),
        fx.sup
            .wait_until(|l| l.iter().any(|u| u.name == "flappy" && u.restarts >= 8)),
    )
    .await;
    assert!(
        u.is_ok(),
        "8 restarts took longer than 4 s: the backoff was not reset ({:?})",
        fx.sup.statuses()
    );
    assert!(started.elapsed() >= Duration::from_millis(8 * 150));
    fx.sup.shutdown().await;
}

#[tokio::test]
async fn stop_reaches_the_whole_process_group_and_ignored_sigterm_gets_sigkill() {
    let config = UnitsConfig {
        stop_timeout: Duration::from_millis(300),
        ..fast()
    };
    let mut fx = fixture(config).await;
    // A child in the background, its pid on stdout; the shell ignores SIGTERM.
    let item = sh(
        "tree",
        "trap '' TERM; sleep 1000 & echo child=$!; while true; do sleep 1; done",
    );
    fx.sup.declare(std::slice::from_ref(&item));
    let leader = wait_unit(&fx.sup, "tree", "running", running)
        .await
        .pid
        .unwrap();
    let log = fx.state.join("units/tree/stdout.log");
    let mut child = 0u32;
    wait_for("the child's pid in the log", || {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        match text.lines().find_map(|l| l.strip_prefix("child=")) {
            Some(p) => {
                child = p.trim().parse().unwrap();
                true
            }
            None => false,
        }
    })
    .await;
    assert!(alive(child));

    let started = Instant::now();
    fx.sup.declare(&[]);
    timeout(DEADLINE, fx.sup.wait_until(|l| l.is_empty()))
        .await
        .expect("removed");
    // The leader ignored SIGTERM: it took the stop timeout and a SIGKILL.
    assert!(started.elapsed() >= Duration::from_millis(300));
    wait_for("leader and child gone", || !alive(leader) && !alive(child)).await;
    fx.sup.shutdown().await;
}

#[tokio::test]
async fn output_is_captured_and_rotation_caps_its_size() {
    let mut fx = fixture(fast()).await;
    std::fs::create_dir_all(fx.root.join("srv/app")).unwrap();
    let item = UnitItem {
        env: [("GREETING".to_owned(), "hello".to_owned())].into(),
        working_dir: Some("/srv/app".into()),
        ..sh(
            "chatty",
            "echo \"$GREETING from $(pwd) as $MESH_UNIT/$MESH_MODULE\"; echo oops >&2; \
             i=0; while [ $i -lt 500 ]; do echo 0123456789012345678901234567890123456789; i=$((i+1)); done; \
             echo done; exec sleep 1000",
        )
    };
    fx.sup.declare(std::slice::from_ref(&item));
    let dir = fx.state.join("units/chatty");
    wait_for("the whole output", || {
        std::fs::read_to_string(dir.join("stdout.log")).is_ok_and(|t| t.contains("done"))
    })
    .await;
    assert_eq!(
        std::fs::read_to_string(dir.join("stderr.log")).unwrap(),
        "oops\n"
    );
    // 20 kB written, 1 KiB per file, 2 rotated files kept: the start is gone.
    let mut total = 0;
    for name in ["stdout.log", "stdout.log.1", "stdout.log.2"] {
        let len = std::fs::metadata(dir.join(name)).unwrap().len();
        assert!(len <= 1024, "{name} has {len} bytes");
        total += len;
    }
    assert!(!dir.join("stdout.log.3").exists());
    assert!(total > 2048);
    let all: String = ["stdout.log.2", "stdout.log.1", "stdout.log"]
        .iter()
        .map(|n| std::fs::read_to_string(dir.join(n)).unwrap())
        .collect();
    assert!(!all.contains("hello"), "the oldest output was rotated away");

    // The first line (declared env, working dir under the root) before it was
    // rotated away: run a unit that only says it.
    let probe = UnitItem {
        restart: RestartPolicy::Never,
        ..sh(
            "probe",
            "echo \"$GREETING from $(pwd) as $MESH_UNIT/$MESH_MODULE\"",
        )
    };
    let probe = UnitItem {
        env: item.env.clone(),
        working_dir: item.working_dir.clone(),
        ..probe
    };
    fx.sup.declare(&[item, probe]);
    wait_unit(&fx.sup, "probe", "exited", |u| u.state == UnitState::Exited).await;
    let expected = format!(
        "hello from {} as probe/m\n",
        fx.root.join("srv/app").canonicalize().unwrap().display()
    );
    wait_for("the probe's line", || {
        std::fs::read_to_string(fx.state.join("units/probe/stdout.log"))
            .is_ok_and(|t| t == expected)
    })
    .await;
    fx.sup.shutdown().await;
}

#[tokio::test]
async fn shutdown_stops_every_unit() {
    let mut fx = fixture(fast()).await;
    fx.sup
        .declare(&[sh("a", "exec sleep 1000"), sh("b", "exec sleep 1000")]);
    let a = wait_unit(&fx.sup, "a", "a running", running)
        .await
        .pid
        .unwrap();
    let b = wait_unit(&fx.sup, "b", "b running", running)
        .await
        .pid
        .unwrap();
    timeout(DEADLINE, fx.sup.shutdown())
        .await
        .expect("shutdown within the deadline");
    wait_for("both gone", || !alive(a) && !alive(b)).await;
    assert!(!fx.state.join("units/a/pid").exists());
}

// ---- The agent: units from the store, without a broker ----

fn offline_agent(state: &Path, root: &Path) -> Config {
    // Nothing listens on port 1: the broker is unreachable throughout.
    std::fs::write(
        state.join("credentials.toml"),
        format!(
            "node = \"node-u\"\nbroker_url = \"amqp://node-u:pw@127.0.0.1:1/mesh\"\ncontroller_key = \"{}\"\n",
            mesh_protocol::DeclarationSigner::from_seed([1; 32]).public_key_hex()
        ),
    )
    .unwrap();
    Config {
        state_dir: state.to_owned(),
        root: root.to_owned(),
        heartbeat_interval: Duration::from_millis(50),
        reconnect_min: Duration::from_millis(20),
        reconnect_max: Duration::from_millis(100),
        shutdown_timeout: Duration::from_millis(200),
        units: fast(),
        ..Config::default()
    }
}

/// What an applied inventory section left in the store.
fn seed_store(state: &Path, units: Vec<UnitItem>) {
    let mut store = Store::open(state).unwrap();
    let section = SectionState {
        generation: 1,
        last_generation: 1,
        units,
        ..SectionState::default()
    };
    store.record(Section::Inventory, section, None, 10).unwrap();
}

/// The unit's pid from its pid file, once there is one for a live process other
/// than `not`.
async fn unit_pid(state: &Path, name: &str, not: Option<u32>) -> u32 {
    let path = state.join("units").join(name).join("pid");
    let mut pid = 0;
    wait_for(&format!("a live process for {name}"), || {
        let Ok(text) = std::fs::read_to_string(&path) else {
            return false;
        };
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else {
            return false;
        };
        pid = v["pid"].as_u64().unwrap_or(0) as u32;
        pid != 0 && Some(pid) != not && alive(pid)
    })
    .await;
    pid
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_runs_units_from_its_store_while_the_broker_is_unreachable() {
    let state = tempfile::tempdir().unwrap();
    let root = tempfile::tempdir().unwrap();
    seed_store(state.path(), vec![sh("kept", "exec sleep 1000")]);

    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let agent = tokio::spawn(mesh_host_agent::run(
        offline_agent(state.path(), root.path()),
        async {
            let _ = stopped.await;
        },
    ));
    // Started from the store, with no declaration and no broker.
    let pid = unit_pid(state.path(), "kept", None).await;
    // The broker stays unreachable (dozens of failed connects at these settings);
    // the unit keeps running, untouched.
    let until = Instant::now() + Duration::from_secs(1);
    while Instant::now() < until {
        assert!(alive(pid), "the unit must keep running while offline");
        assert!(!agent.is_finished());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Graceful shutdown stops it.
    let _ = stop.send(());
    timeout(DEADLINE, agent).await.unwrap().unwrap().unwrap();
    assert!(!alive(pid), "graceful shutdown stops units");

    // A second run with the same state dir starts it again, at once.
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let agent = tokio::spawn(mesh_host_agent::run(
        offline_agent(state.path(), root.path()),
        async {
            let _ = stopped.await;
        },
    ));
    let pid2 = unit_pid(state.path(), "kept", Some(pid)).await;
    assert!(alive(pid2));
    let _ = stop.send(());
    timeout(DEADLINE, agent).await.unwrap().unwrap().unwrap();
    assert!(!alive(pid2));
}

/// The real binary, killed with SIGKILL, leaves its unit running (it could not
/// stop it); the next agent stops that leftover before starting the unit again,
/// so the unit never runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_agents_leftover_units_are_stopped_before_the_restart() {
    let state = tempfile::tempdir().unwrap();
    let root = tempfile::tempdir().unwrap();
    let config = offline_agent(state.path(), root.path());
    seed_store(state.path(), vec![sh("survivor", "exec sleep 1000")]);

    let mut bin = std::process::Command::new(env!("CARGO_BIN_EXE_mesh-agent"))
        .args(["run", "--state-dir"])
        .arg(state.path())
        .arg("--root")
        .arg(root.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let orphan = unit_pid(state.path(), "survivor", None).await;
    bin.kill().unwrap();
    bin.wait().unwrap();
    // The unit outlived the agent (its own process group).
    assert!(alive(orphan));

    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let agent = tokio::spawn(mesh_host_agent::run(config, async {
        let _ = stopped.await;
    }));
    let fresh = unit_pid(state.path(), "survivor", Some(orphan)).await;
    assert!(!alive(orphan), "the leftover was stopped first");
    assert!(alive(fresh));
    let _ = stop.send(());
    timeout(DEADLINE, agent).await.unwrap().unwrap().unwrap();
    assert!(!alive(fresh));
}
