//! The unit supervisor with real processes (and real shims: the `mesh-agent`
//! binary): start, kill -9 and restart, stop, removal, spec change, restart
//! policies, process groups, captured output and its rotation, units left
//! running by a supervisor's shutdown and adopted by the next one; and the
//! agent running units from its store without a broker, across in-process
//! restarts and across a crash of the real binary.
//!
//! Every wait is on a condition with a deadline.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::collections::BTreeMap;
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
        shim_program: Some(env!("CARGO_BIN_EXE_mesh-agent").into()),
        ..UnitsConfig::default()
    }
}

fn sh(name: &str, script: &str) -> UnitItem {
    UnitItem {
        user: Default::default(),
        limits: Default::default(),
        stateful: false,
        artifact: None,
        revision: None,
        name: name.into(),
        module: "m".into(),
        command: "/bin/sh".into(),
        args: vec!["-c".into(), script.into()],
        env: Default::default(),
        working_dir: None,
        restart: RestartPolicy::Always,
        desired: DesiredState::Running,
        probes: Vec::new(),
    }
}

struct Fixture {
    _dir: tempfile::TempDir,
    root: PathBuf,
    state: PathBuf,
    sup: Supervisor,
}

async fn fixture(config: UnitsConfig) -> Fixture {
    let dir = mesh_testkit::units_tempdir().unwrap();
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
        user: Default::default(),
        limits: Default::default(),
        stateful: false,
        artifact: None,
        revision: None,
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
    fx.sup.stop_all().await;
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
        user: Default::default(),
        limits: Default::default(),
        stateful: false,
        artifact: None,
        revision: None,
        restart: RestartPolicy::OnFailure,
        ..v1.clone()
    };
    fx.sup.declare(std::slice::from_ref(&v1b));
    tokio::task::yield_now().await;
    assert_eq!(fx.sup.statuses()[0].pid, Some(pid1));

    // New args: the old process stops, a new one starts with the new spec.
    let v2 = UnitItem {
        user: Default::default(),
        limits: Default::default(),
        stateful: false,
        artifact: None,
        revision: None,
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
    fx.sup.stop_all().await;
}

#[tokio::test]
async fn restart_policies() {
    let mut fx = fixture(fast()).await;
    let never = UnitItem {
        user: Default::default(),
        limits: Default::default(),
        stateful: false,
        artifact: None,
        revision: None,
        restart: RestartPolicy::Never,
        ..sh("never", "exec sleep 1000")
    };
    let clean_exit = UnitItem {
        user: Default::default(),
        limits: Default::default(),
        stateful: false,
        artifact: None,
        revision: None,
        restart: RestartPolicy::OnFailure,
        ..sh("clean", "exit 0")
    };
    let failing = UnitItem {
        user: Default::default(),
        limits: Default::default(),
        stateful: false,
        artifact: None,
        revision: None,
        restart: RestartPolicy::OnFailure,
        ..sh("failing", "exit 3")
    };
    let missing = sh("missing", "unused");
    let missing = UnitItem {
        user: Default::default(),
        limits: Default::default(),
        stateful: false,
        artifact: None,
        revision: None,
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
    fx.sup.stop_all().await;
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
    fx.sup.stop_all().await;
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
    fx.sup.stop_all().await;
}

#[tokio::test]
async fn output_is_captured_and_rotation_caps_its_size() {
    let mut fx = fixture(fast()).await;
    std::fs::create_dir_all(fx.root.join("srv/app")).unwrap();
    let item = UnitItem {
        user: Default::default(),
        limits: Default::default(),
        stateful: false,
        artifact: None,
        revision: None,
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
    // The two streams are copied independently: no order between them.
    wait_for("stderr", || {
        std::fs::read_to_string(dir.join("stderr.log")).is_ok_and(|t| t == "oops\n")
    })
    .await;
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
        user: Default::default(),
        limits: Default::default(),
        stateful: false,
        artifact: None,
        revision: None,
        restart: RestartPolicy::Never,
        ..sh(
            "probe",
            "echo \"$GREETING from $(pwd) as $MESH_UNIT/$MESH_MODULE\"",
        )
    };
    let probe = UnitItem {
        user: Default::default(),
        limits: Default::default(),
        stateful: false,
        artifact: None,
        revision: None,
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
    fx.sup.stop_all().await;
}

#[tokio::test]
async fn stop_all_stops_every_unit() {
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
    timeout(DEADLINE, fx.sup.stop_all())
        .await
        .expect("stopped within the deadline");
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
    let root = mesh_testkit::units_tempdir().unwrap();
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
    // Graceful shutdown leaves it running.
    let _ = stop.send(());
    timeout(DEADLINE, agent).await.unwrap().unwrap().unwrap();
    assert!(alive(pid), "graceful shutdown leaves units running");

    // A second run with the same state dir adopts it: still that process, and
    // it says so (the gauge of running units).
    let port = free_port();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let agent = tokio::spawn(mesh_host_agent::run(
        Config {
            metrics_listen: Some(([127, 0, 0, 1], port).into()),
            ..offline_agent(state.path(), root.path())
        },
        async {
            let _ = stopped.await;
        },
    ));
    wait_metric(port, "mesh_agent_units_running 1").await;
    assert_eq!(unit_pid(state.path(), "kept", None).await, pid);
    let _ = stop.send(());
    timeout(DEADLINE, agent).await.unwrap().unwrap().unwrap();
    assert!(alive(pid));

    // drain-local (decommissioning) stops it.
    let stopped =
        mesh_host_agent::units::drain_local(&state.path().join("units"), Duration::from_secs(2))
            .await;
    assert_eq!(stopped, vec!["kept".to_owned()]);
    assert!(!alive(pid));
    assert!(!state.path().join("units/kept/pid").exists());
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Wait until the agent's metrics on `port` have a line `line`.
async fn wait_metric(port: u16, line: &str) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let until = Instant::now() + DEADLINE;
    loop {
        let mut out = String::new();
        if let Ok(mut s) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
            let _ = s
                .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .await;
            let _ = s.read_to_string(&mut out).await;
        }
        if out.lines().any(|l| l == line) {
            return;
        }
        assert!(
            Instant::now() < until,
            "no `{line}` within {DEADLINE:?}: {out}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A unit that writes `<marks>/<name>` if it is ever signalled (TERM, HUP,
/// INT), and otherwise runs until it is killed.
fn trapping(name: &str, marks: &Path) -> UnitItem {
    UnitItem {
        user: Default::default(),
        limits: Default::default(),
        stateful: false,
        artifact: None,
        revision: None,
        env: [(
            "MARK".to_owned(),
            marks.join(name).to_string_lossy().into_owned(),
        )]
        .into(),
        ..sh(
            name,
            "trap 'echo TERM >> \"$MARK\"; exit 0' TERM\n\
             trap 'echo HUP >> \"$MARK\"' HUP\n\
             trap 'echo INT >> \"$MARK\"' INT\n\
             echo \"pid $$\"\n\
             while true; do sleep 0.1; done",
        )
    }
}

fn status(sup: &Supervisor, name: &str) -> Option<UnitStatus> {
    sup.statuses().into_iter().find(|u| u.name == name)
}

/// A supervisor's shutdown (the agent stopping for a restart) leaves every unit
/// running; the next supervisor adopts those still declared as they are (same
/// pid, same restart count, never signalled), watches them although they are
/// not its children, restarts and counts one that died meanwhile, restarts one
/// whose spec changed meanwhile, and stops one no longer declared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn units_outlive_their_supervisor_and_are_adopted() {
    let Fixture {
        _dir: dir,
        root,
        state,
        sup: mut first,
    } = fixture(fast()).await;
    let marks = dir.path().join("marks");
    mesh_testkit::open_to_units(&marks).unwrap();
    let (a, b, c, d) = (
        trapping("a", &marks),
        trapping("b", &marks),
        trapping("c", &marks),
        trapping("d", &marks),
    );
    // `e` ran once and failed; `never` restart it.
    let e = UnitItem {
        user: Default::default(),
        limits: Default::default(),
        stateful: false,
        artifact: None,
        revision: None,
        restart: RestartPolicy::Never,
        ..sh(
            "e",
            &format!("echo run >> {}; exit 3", marks.join("e.runs").display()),
        )
    };
    first.declare(&[a.clone(), b.clone(), c.clone(), d.clone(), e.clone()]);
    wait_unit(&first, "e", "e failed", |u| u.state == UnitState::Failed).await;
    let mut pids = BTreeMap::new();
    for n in ["a", "b", "c", "d"] {
        pids.insert(
            n,
            wait_unit(&first, n, "running", running).await.pid.unwrap(),
        );
    }
    // One restart of `a` before: its count must survive the supervisor.
    kill9(pids["a"]);
    let u = wait_unit(&first, "a", "a restarted", |u| {
        running(u) && u.pid != Some(pids["a"])
    })
    .await;
    assert_eq!(u.restarts, 1);
    pids.insert("a", u.pid.unwrap());
    let a_started = u.started_at;

    timeout(DEADLINE, first.shutdown())
        .await
        .expect("shutdown within the deadline");
    for (n, pid) in &pids {
        assert!(alive(*pid), "{n} must outlive the supervisor");
    }
    // `b` dies while nobody watches: its shim records how.
    kill9(pids["b"]);
    wait_for("b's exit record", || state.join("units/b/exit").exists()).await;

    // The next supervisor: `c` is no longer declared, `d` has a new spec.
    let mut next = Supervisor::start(fast(), &root, &state, Metrics::new()).await;
    let d2 = UnitItem {
        user: Default::default(),
        limits: Default::default(),
        stateful: false,
        artifact: None,
        revision: None,
        env: [
            (
                "MARK".to_owned(),
                marks.join("d").to_string_lossy().into_owned(),
            ),
            ("VERSION".to_owned(), "2".to_owned()),
        ]
        .into(),
        ..d.clone()
    };
    next.declare(&[a.clone(), b.clone(), d2, e.clone()]);
    let ua = wait_unit(&next, "a", "a adopted", running).await;
    assert_eq!((ua.pid, ua.restarts), (Some(pids["a"]), 1), "{ua:?}");
    assert_eq!(ua.started_at, a_started);
    let ub = wait_unit(&next, "b", "b restarted", |u| {
        running(u) && u.pid != Some(pids["b"])
    })
    .await;
    assert_eq!(ub.restarts, 1, "a unit that died while away is counted");
    let ud = wait_unit(&next, "d", "d restarted with its new spec", |u| {
        running(u) && u.pid != Some(pids["d"])
    })
    .await;
    assert_eq!(ud.restarts, 0, "a new spec is a new unit");
    wait_for("c stopped", || !alive(pids["c"])).await;
    wait_for("d's old process stopped", || !alive(pids["d"])).await;
    assert!(status(&next, "c").is_none());
    // Stopped ones were told (TERM); the adopted one never was.
    assert_eq!(std::fs::read_to_string(marks.join("c")).unwrap(), "TERM\n");
    assert_eq!(std::fs::read_to_string(marks.join("d")).unwrap(), "TERM\n");
    assert!(!marks.join("a").exists(), "the adopted unit was signalled");
    assert!(!marks.join("b").exists());
    // `e`'s exit is remembered, not forgotten into a fresh start.
    let ue = wait_unit(&next, "e", "e failed", |u| u.state == UnitState::Failed).await;
    assert_eq!((ue.exit_code, ue.restarts, ue.pid), (Some(3), 0, None));
    assert_eq!(
        std::fs::read_to_string(marks.join("e.runs")).unwrap(),
        "run\n"
    );

    // The adopted process is not this supervisor's child; its exit is seen all
    // the same, and handled by the restart policy.
    kill9(pids["a"]);
    let ua = wait_unit(&next, "a", "adopted a restarted", |u| {
        running(u) && u.pid != Some(pids["a"])
    })
    .await;
    assert_eq!(ua.restarts, 2);
    let left: Vec<u32> = next.statuses().iter().filter_map(|u| u.pid).collect();
    timeout(DEADLINE, next.stop_all()).await.expect("stopped");
    for pid in left {
        wait_for("every unit gone", || !alive(pid)).await;
    }
    drop(dir);
}

/// The output a unit writes while no agent runs is kept: its shim owns the
/// pipes and rotates the files on its own. Numbered lines: a gap would be a
/// lost line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_written_while_no_supervisor_runs_is_kept_and_rotated() {
    // 2 KiB files, 5 rotated ones kept: about 300 of these 40-byte lines.
    let config = UnitsConfig {
        log_max_bytes: 2048,
        log_files: 5,
        ..fast()
    };
    let Fixture {
        _dir: dir,
        root,
        state,
        sup: mut first,
    } = fixture(config.clone()).await;
    let ticker = sh(
        "ticker",
        "i=0; while true; do i=$((i+1)); echo \"tick $i ------------------------\"; sleep 0.01; done",
    );
    first.declare(std::slice::from_ref(&ticker));
    let pid = wait_unit(&first, "ticker", "running", running)
        .await
        .pid
        .unwrap();
    let logs = state.join("units/ticker");
    let files: Vec<String> = (1..=5)
        .rev()
        .map(|i| format!("stdout.log.{i}"))
        .chain(["stdout.log".to_owned()])
        .collect();
    let ticks = || -> Vec<u64> {
        let text: String = files
            .iter()
            .map(|n| std::fs::read_to_string(logs.join(n)).unwrap_or_default())
            .collect();
        text.lines()
            .filter_map(|l| l.strip_prefix("tick ")?.split(' ').next()?.parse().ok())
            .collect()
    };
    let last = || ticks().into_iter().max().unwrap_or(0);
    wait_for("output before", || last() > 5).await;
    timeout(DEADLINE, first.shutdown()).await.expect("shutdown");
    let at_shutdown = last();
    // No supervisor: the output keeps landing, and is rotated (2 KiB is about
    // 50 lines).
    wait_for("output while no supervisor runs", || {
        last() > at_shutdown + 60
    })
    .await;
    let during = last();
    let mut next = Supervisor::start(config, &root, &state, Metrics::new()).await;
    next.declare(std::slice::from_ref(&ticker));
    let u = wait_unit(&next, "ticker", "adopted", running).await;
    assert_eq!(u.pid, Some(pid));
    wait_for("output after", || last() > during + 20).await;
    timeout(DEADLINE, next.stop_all()).await.expect("stopped");
    wait_for("ticker gone", || !alive(pid)).await;

    // Now that nothing writes: every line there, in order, no gap, from
    // before the shutdown to after the adoption; each file within the cap.
    for n in &files {
        let len = std::fs::metadata(logs.join(n)).map_or(0, |m| m.len());
        assert!(len <= 2048, "{n} has {len} bytes");
    }
    assert!(logs.join("stdout.log.1").exists(), "never rotated");
    let ticks = ticks();
    for w in ticks.windows(2) {
        assert_eq!(w[1], w[0] + 1, "a gap in the output: {w:?}");
    }
    let (first_kept, last_kept) = (ticks[0], ticks[ticks.len() - 1]);
    assert!(
        first_kept <= at_shutdown && last_kept > during + 20,
        "kept {first_kept}..={last_kept}; shut down at {at_shutdown}, adopted after {during}"
    );
    drop(dir);
}

/// The real binary, killed with SIGKILL, leaves its unit running (with its
/// shim); the next agent adopts it: the same process, never signalled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_agents_units_are_adopted_by_the_next_agent() {
    let state = tempfile::tempdir().unwrap();
    let root = mesh_testkit::units_tempdir().unwrap();
    let marks = mesh_testkit::units_tempdir().unwrap();
    mesh_testkit::open_to_units(marks.path()).unwrap();
    let port = free_port();
    let config = Config {
        metrics_listen: Some(([127, 0, 0, 1], port).into()),
        ..offline_agent(state.path(), root.path())
    };
    seed_store(state.path(), vec![trapping("survivor", marks.path())]);

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
    // The unit outlived the agent (its shim left the agent's session).
    assert!(alive(orphan));

    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let agent = tokio::spawn(mesh_host_agent::run(config, async {
        let _ = stopped.await;
    }));
    wait_metric(port, "mesh_agent_units_running 1").await;
    assert_eq!(unit_pid(state.path(), "survivor", None).await, orphan);
    assert!(!marks.path().join("survivor").exists(), "it was signalled");
    let _ = stop.send(());
    timeout(DEADLINE, agent).await.unwrap().unwrap().unwrap();
    assert!(alive(orphan));
    mesh_host_agent::units::drain_local(&state.path().join("units"), Duration::from_secs(2)).await;
    assert!(!alive(orphan));
    assert_eq!(
        std::fs::read_to_string(marks.path().join("survivor")).unwrap(),
        "TERM\n"
    );
}
