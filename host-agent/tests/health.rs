//! Probes and health reports with real units (python3 servers), real checks
//! and the real broker: an HTTP probe turns unhealthy after exactly its
//! failure threshold and back; TCP and exec probes turn and return; the first
//! check waits its initial delay; a restart of the unit, or other probes,
//! start them anew; a unit stopped or removed drops them; the agent's restart
//! leaves the unit running (same pid) and its probes resume; and the first
//! hello after a broker outage states it.
//!
//! Every wait is on a condition with a deadline.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

mod common;

use common::{api, controller_side, declaration_queue_for, free_port, kill_connections, scrape};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use futures_util::StreamExt;
use lapin::{Channel, Consumer};
use mesh_host_agent::metrics::Metrics;
use mesh_host_agent::store::SectionState;
use mesh_host_agent::units::{Supervisor, UnitsConfig};
use mesh_host_agent::{Config, Store};
use mesh_protocol::{
    Declaration, DeclarationItems, DeclarationSigner, DesiredState, Envelope, Health,
    MAX_REPORT_BYTES, NodeId, Probe, ProbeResult, ProbeState, Report, RestartPolicy, Section,
    UnitItem, UnitState,
};
use mesh_testkit::TestEnv;
use tokio::time::{Instant, timeout};

const DEADLINE: Duration = Duration::from_secs(30);

/// The real python3 (not a shim that needs the test's environment).
fn python() -> String {
    // The system's: units run as their module's user, who cannot reach an
    // interpreter under root's home (pyenv).
    if Path::new("/usr/bin/python3").is_file() {
        return "/usr/bin/python3".to_owned();
    }
    let out = std::process::Command::new("python3")
        .args(["-c", "import sys; print(sys.executable)"])
        .output()
        .expect("python3 runs");
    String::from_utf8(out.stdout)
        .expect("utf-8")
        .trim()
        .to_owned()
}

/// An HTTP server on `port` answering 503 while `flag` exists, else 200.
const HTTP_SERVER: &str = r#"
import http.server, os, sys
port, flag = int(sys.argv[1]), sys.argv[2]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(503 if os.path.exists(flag) else 200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"#;

/// A TCP listener on `port` while `flag` exists.
const TCP_SERVER: &str = r#"
import os, socket, sys, time
port, flag = int(sys.argv[1]), sys.argv[2]
s = None
while True:
    up = os.path.exists(flag)
    if up and s is None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen(16)
        s.setblocking(False)
    elif not up and s is not None:
        s.close()
        s = None
    if s is not None:
        try:
            c, _ = s.accept()
            c.close()
        except BlockingIOError:
            pass
    time.sleep(0.02)
"#;

fn probe(json: serde_json::Value) -> Probe {
    let p: Probe = serde_json::from_value(json).expect("a probe");
    p.validate("probe").expect("a valid probe");
    p
}

fn python_unit(name: &str, script: &str, port: u16, flag: &Path, probes: Vec<Probe>) -> UnitItem {
    UnitItem {
        user: Default::default(),
        limits: Default::default(),
        stateful: false,
        artifact: None,
        revision: None,
        name: name.into(),
        module: "web".into(),
        command: python(),
        args: vec![
            "-c".into(),
            script.into(),
            port.to_string(),
            flag.to_string_lossy().into_owned(),
        ],
        env: Default::default(),
        working_dir: None,
        restart: RestartPolicy::Always,
        desired: DesiredState::Running,
        probes,
    }
}

fn units_config() -> UnitsConfig {
    UnitsConfig {
        stop_timeout: Duration::from_secs(2),
        restart_backoff_min: Duration::from_millis(50),
        restart_backoff_max: Duration::from_millis(200),
        shim_program: Some(env!("CARGO_BIN_EXE_mesh-agent").into()),
        ..Default::default()
    }
}

// ------------------------------------------------------------ the broker's side

struct Received {
    envelope: Envelope<Report>,
}

async fn wait_report(
    consumer: &mut Consumer,
    what: &str,
    pred: impl Fn(&Received) -> bool,
) -> anyhow::Result<Received> {
    let until = Instant::now() + DEADLINE;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        let d = match timeout(left, consumer.next()).await {
            Ok(Some(d)) => d?,
            Ok(None) => bail!("report consumer ended while waiting for {what}"),
            Err(_) => bail!("no {what} within {DEADLINE:?}"),
        };
        let r = Received {
            envelope: Envelope::<Report>::decode(&d.data, MAX_REPORT_BYTES)
                .context("report decodes")?,
        };
        if pred(&r) {
            return Ok(r);
        }
    }
}

fn health_of(r: &Received) -> Option<&Health> {
    match &r.envelope.body {
        Report::Health(h) => Some(h),
        _ => None,
    }
}

fn result_in<'a>(h: &'a Health, unit: &str, probe: &str) -> Option<&'a ProbeResult> {
    h.probes.iter().find(|p| p.unit == unit && p.probe == probe)
}

/// Whether `r` is a health report saying `unit`'s `probe` is `state`.
fn says(r: &Received, unit: &str, probe: &str, state: ProbeState) -> bool {
    health_of(r)
        .and_then(|h| result_in(h, unit, probe))
        .is_some_and(|p| p.state == state)
}

async fn publish_declaration(
    ch: &Channel,
    signer: &DeclarationSigner,
    node: &NodeId,
    decl: Declaration,
) -> anyhow::Result<()> {
    common::publish_declaration(ch, signer, node, decl).await
}

/// Record `units` as the inventory section at `generation`, as an applied
/// declaration would have.
fn store_units(state: &Path, generation: u64, units: Vec<UnitItem>) -> anyhow::Result<()> {
    let mut store = Store::open(state)?;
    store.record(
        Section::Inventory,
        SectionState {
            generation,
            last_generation: generation,
            units,
            ..Default::default()
        },
        None,
        10,
    )?;
    Ok(())
}

struct Agent {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), mesh_host_agent::AgentError>>,
}

fn start_agent(config: Config) -> Agent {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(mesh_host_agent::run(config, async {
        let _ = stopped.await;
    }));
    Agent { stop, task }
}

impl Agent {
    async fn stop(self) -> anyhow::Result<()> {
        let _ = self.stop.send(());
        timeout(Duration::from_secs(15), self.task)
            .await
            .context("agent did not stop")???;
        Ok(())
    }
}

fn agent_config(state: &Path, root: &Path) -> Config {
    Config {
        state_dir: state.to_owned(),
        root: root.to_owned(),
        heartbeat_interval: Duration::from_millis(200),
        reconnect_min: Duration::from_millis(50),
        reconnect_max: Duration::from_millis(300),
        health_summary_secs: 1,
        units: units_config(),
        ..Config::default()
    }
}

/// Stop what the agents left running (they leave units to the next agent).
async fn drain(state: &Path) -> anyhow::Result<()> {
    let drained = tokio::process::Command::new(env!("CARGO_BIN_EXE_mesh-agent"))
        .args(["drain-local", "--stop-timeout", "2s", "--state-dir"])
        .arg(state)
        .output()
        .await?;
    anyhow::ensure!(drained.status.success(), "{drained:?}");
    Ok(())
}

/// Issue 13: an HTTP probe of a real unit. Healthy; after the unit answers
/// 503, still healthy (failures counted, summaries say so) until exactly
/// `failure_threshold` failures in a row, then unhealthy (a change report,
/// not a summary); healthy again after it recovers. Declared without probes,
/// one empty health report follows and then none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_probe_turns_unhealthy_after_its_threshold_and_back() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let creds = env.add_node("hp").await?;
    let node = creds.node.clone();
    let (admin, ch, mut reports) = controller_side(&env).await?;
    declaration_queue_for(&ch, &node).await?;

    let state = tempfile::tempdir()?;
    let root = mesh_testkit::units_tempdir()?;
    let flags = mesh_testkit::units_tempdir()?;
    creds.write_to(state.path())?;
    let port = free_port();
    let failing = flags.path().join("fail");
    let ready = probe(serde_json::json!({
        "name": "ready",
        "http": {"port": port, "path": "/healthz"},
        "interval_secs": 1,
        "timeout_secs": 1,
        "failure_threshold": 3,
    }));
    let unit = python_unit("web-0", HTTP_SERVER, port, &failing, vec![ready]);
    store_units(state.path(), 1, vec![unit.clone()])?;
    let metrics_port = free_port();
    let agent = start_agent(Config {
        metrics_listen: Some(([127, 0, 0, 1], metrics_port).into()),
        ..agent_config(state.path(), root.path())
    });

    let r = wait_report(&mut reports, "health: ready healthy", |r| {
        says(r, "web-0", "ready", ProbeState::Healthy)
    })
    .await?;
    let h = health_of(&r).context("health")?;
    let p = result_in(h, "web-0", "ready").context("ready")?;
    assert_eq!(p.module, "web");
    assert_eq!(p.detail.as_deref(), Some("HTTP 200"));
    assert_eq!(p.failures, 0);
    assert!(p.checked_at.is_some());
    assert_eq!(h.probes.len(), 1);

    // Failing: healthy with 1, then 2 failures (the summaries say so), then
    // unhealthy at the third, not before.
    std::fs::write(&failing, "")?;
    let mut counted = Vec::new();
    let r = loop {
        let r = wait_report(&mut reports, "health after failing", |r| {
            health_of(r).is_some()
        })
        .await?;
        let h = health_of(&r).context("health")?;
        let p = result_in(h, "web-0", "ready").context("ready")?.clone();
        if p.state == ProbeState::Unhealthy {
            break r;
        }
        assert_eq!(p.state, ProbeState::Healthy, "{p:?}");
        assert!(p.failures < 3, "{p:?}");
        if p.failures > 0 {
            assert_eq!(p.detail.as_deref(), Some("HTTP 503"));
            assert!(h.summary, "no change, so a summary: {h:?}");
            counted.push(p.failures);
        }
    };
    let h = health_of(&r).context("health")?;
    let p = result_in(h, "web-0", "ready").context("ready")?;
    assert!(!h.summary, "a change is not a summary: {h:?}");
    assert_eq!(p.failures, 3, "{p:?}");
    assert_eq!(p.detail.as_deref(), Some("HTTP 503"));
    assert!(
        !counted.is_empty(),
        "a summary showed the failures counted while still healthy"
    );
    let text = scrape(metrics_port).await?;
    for needle in [
        "mesh_agent_probe_healthy{unit=\"web-0\",probe=\"ready\"} 0",
        "mesh_agent_probe_checks_total{unit=\"web-0\",probe=\"ready\",result=\"fail\"} ",
        "mesh_agent_probe_checks_total{unit=\"web-0\",probe=\"ready\",result=\"ok\"} ",
        "mesh_agent_applied_generation{section=\"inventory\"} 1",
        "mesh_agent_broker_connected 1",
    ] {
        assert!(text.contains(needle), "{needle} missing from\n{text}");
    }

    // Recovered: healthy again at the first success.
    std::fs::remove_file(&failing)?;
    let r = wait_report(&mut reports, "health: healthy again", |r| {
        says(r, "web-0", "ready", ProbeState::Healthy)
    })
    .await?;
    let h = health_of(&r).context("health")?;
    assert!(!h.summary);
    assert_eq!(result_in(h, "web-0", "ready").map(|p| p.failures), Some(0));

    // Declared without probes: one empty list, then silence (the agent
    // keeps beating; a few seconds of heartbeats carry no health report).
    let decl = Declaration {
        section: Section::Inventory,
        generation: 2,
        items: DeclarationItems {
            units: vec![UnitItem {
                user: Default::default(),
                limits: Default::default(),
                stateful: false,
                artifact: None,
                revision: None,
                probes: vec![],
                ..unit.clone()
            }],
            ..Default::default()
        },
    };
    publish_declaration(&ch, env.signer(), &node, decl).await?;
    wait_report(&mut reports, "health: empty", |r| {
        health_of(r).is_some_and(|h| h.probes.is_empty())
    })
    .await?;
    let quiet_until = Instant::now() + Duration::from_secs(3);
    let mut beats = 0;
    while Instant::now() < quiet_until {
        let r = wait_report(&mut reports, "a report", |_| true).await?;
        assert!(
            health_of(&r).is_none(),
            "no health report without probes: {:?}",
            r.envelope.body
        );
        if matches!(r.envelope.body, Report::Heartbeat(_)) {
            beats += 1;
        }
    }
    assert!(beats >= 5, "heartbeats went on ({beats})");
    let text = scrape(metrics_port).await?;
    assert!(!text.contains("mesh_agent_probe_healthy{"), "{text}");

    agent.stop().await?;
    drain(state.path()).await?;
    drop(reports);
    let _ = admin.close(200, "done".into()).await;
    env.teardown().await
}

/// Probe results straight from the supervisor, polled until `pred` holds.
async fn wait_probes(
    sup: &Supervisor,
    what: &str,
    pred: impl Fn(&[ProbeResult]) -> bool,
) -> Vec<ProbeResult> {
    let until = Instant::now() + DEADLINE;
    loop {
        let results = sup.probe_results();
        if pred(&results) {
            return results;
        }
        assert!(
            Instant::now() < until,
            "no {what} within {DEADLINE:?}: {results:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn state_of(results: &[ProbeResult], probe: &str) -> Option<ProbeState> {
    results.iter().find(|p| p.probe == probe).map(|p| p.state)
}

fn both(results: &[ProbeResult], state: ProbeState) -> bool {
    state_of(results, "port") == Some(state) && state_of(results, "flag") == Some(state)
}

/// A TCP probe and an exec probe of a real unit turn unhealthy and healthy
/// with what they check; a restart of the unit starts them anew; new probes
/// replace the old; removing the unit drops them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_and_exec_probes_turn_and_return() {
    let dir = mesh_testkit::units_tempdir().unwrap();
    let root = dir.path().join("root");
    let state = dir.path().join("state");
    std::fs::create_dir_all(&root).unwrap();
    std::fs::create_dir_all(&state).unwrap();
    let metrics = Metrics::new();
    let mut sup = Supervisor::start(units_config(), &root, &state, metrics.clone()).await;

    let port = free_port();
    let up: PathBuf = dir.path().join("up");
    std::fs::write(&up, "").unwrap();
    let probes = vec![
        probe(serde_json::json!({
            "name": "port",
            "tcp": {"port": port},
            "interval_secs": 1,
            "timeout_secs": 1,
            "failure_threshold": 2,
        })),
        // No shell: `test` found in the unit's PATH.
        probe(serde_json::json!({
            "name": "flag",
            "exec": {"command": "test", "args": ["-e", up.to_string_lossy()]},
            "interval_secs": 1,
            "timeout_secs": 1,
            "failure_threshold": 2,
        })),
    ];
    let unit = python_unit("svc-0", TCP_SERVER, port, &up, probes);
    sup.declare(std::slice::from_ref(&unit));

    let r = wait_probes(&sup, "both healthy", |r| both(r, ProbeState::Healthy)).await;
    assert_eq!(r.len(), 2);
    let detail = |r: &[ProbeResult], name: &str| {
        r.iter()
            .find(|p| p.probe == name)
            .and_then(|p| p.detail.clone())
    };
    assert_eq!(detail(&r, "port").as_deref(), Some("connected"));
    assert_eq!(detail(&r, "flag").as_deref(), Some("exit status 0"));

    // The flag goes: the listener closes, `test` fails.
    std::fs::remove_file(&up).unwrap();
    let r = wait_probes(&sup, "both unhealthy", |r| both(r, ProbeState::Unhealthy)).await;
    assert_eq!(detail(&r, "port").as_deref(), Some("connection refused"));
    assert_eq!(detail(&r, "flag").as_deref(), Some("exit status 1"));
    assert!(r.iter().all(|p| p.failures >= 2), "{r:?}");
    assert!(
        metrics
            .render()
            .contains("mesh_agent_probe_healthy{unit=\"svc-0\",probe=\"port\"} 0")
    );

    std::fs::write(&up, "").unwrap();
    wait_probes(&sup, "both healthy again", |r| both(r, ProbeState::Healthy)).await;

    // The unit restarts (kill -9): its probes start anew, then turn healthy.
    let pid = sup
        .statuses()
        .iter()
        .find(|u| u.name == "svc-0")
        .and_then(|u| u.pid)
        .unwrap();
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid as i32).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    timeout(
        DEADLINE,
        sup.wait_until(|l| {
            l.iter().any(|u| {
                u.name == "svc-0"
                    && u.state == UnitState::Running
                    && u.pid.is_some_and(|p| p != pid)
            })
        }),
    )
    .await
    .expect("restarted");
    wait_probes(&sup, "healthy after the restart", |r| {
        both(r, ProbeState::Healthy)
    })
    .await;
    assert!(
        metrics
            .render()
            .contains("mesh_agent_unit_restarts_total{unit=\"svc-0\"} 1")
    );

    // Other probes: only the new one is listed.
    let other = UnitItem {
        user: Default::default(),
        limits: Default::default(),
        stateful: false,
        artifact: None,
        revision: None,
        probes: vec![probe(serde_json::json!({
            "name": "port2",
            "tcp": {"port": port},
            "interval_secs": 1,
            "timeout_secs": 1,
        }))],
        ..unit.clone()
    };
    sup.declare(std::slice::from_ref(&other));
    let r = wait_probes(&sup, "only the new probe", |r| {
        r.len() == 1 && state_of(r, "port2") == Some(ProbeState::Healthy)
    })
    .await;
    assert_eq!(r[0].unit, "svc-0");
    assert_eq!(
        sup.statuses()[0].restarts,
        1,
        "new probes restart no process"
    );

    // Removed: no probes left, no series.
    sup.declare(&[]);
    wait_probes(&sup, "no probes", |r| r.is_empty()).await;
    timeout(DEADLINE, sup.wait_until(|l| l.is_empty()))
        .await
        .expect("removed");
    let text = metrics.render();
    assert!(!text.contains("svc-0"), "{text}");
    sup.stop_all().await;
}

/// An agent's restart restarts no unit: the same pid after it, and the
/// probes, which ran beside the first agent, start again beside the second
/// (a health report from it says healthy).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agents_restart_keeps_the_unit_and_its_probes_resume() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let creds = env.add_node("hr").await?;
    let node = creds.node.clone();
    let (admin, ch, mut reports) = controller_side(&env).await?;
    declaration_queue_for(&ch, &node).await?;

    let state = tempfile::tempdir()?;
    let root = mesh_testkit::units_tempdir()?;
    let flags = mesh_testkit::units_tempdir()?;
    creds.write_to(state.path())?;
    let port = free_port();
    let ready = probe(serde_json::json!({
        "name": "ready",
        "http": {"port": port, "path": "/"},
        "interval_secs": 1,
        "timeout_secs": 1,
    }));
    let unit = python_unit(
        "web-0",
        HTTP_SERVER,
        port,
        &flags.path().join("fail"),
        vec![ready],
    );
    store_units(state.path(), 1, vec![unit])?;

    let pid_in = |r: &Received| match &r.envelope.body {
        Report::Units(u) => u
            .units
            .iter()
            .find(|s| s.name == "web-0" && s.state == UnitState::Running)
            .and_then(|s| s.pid),
        _ => None,
    };

    let agent = start_agent(agent_config(state.path(), root.path()));
    let r = wait_report(&mut reports, "units: web-0 running", |r| {
        pid_in(r).is_some()
    })
    .await?;
    let pid = pid_in(&r).context("pid")?;
    let first = wait_report(&mut reports, "health: healthy", |r| {
        says(r, "web-0", "ready", ProbeState::Healthy)
    })
    .await?;
    agent.stop().await?;

    let agent = start_agent(agent_config(state.path(), root.path()));
    let hello = wait_report(&mut reports, "hello of the second agent", |r| {
        matches!(r.envelope.body, Report::Hello(_))
    })
    .await?;
    assert!(hello.envelope.seq > first.envelope.seq);
    let r = wait_report(&mut reports, "units after the restart", |r| {
        pid_in(r).is_some()
    })
    .await?;
    assert_eq!(pid_in(&r), Some(pid), "adopted: the same process");
    let r = wait_report(&mut reports, "health from the second agent: healthy", |r| {
        says(r, "web-0", "ready", ProbeState::Healthy)
    })
    .await?;
    let h = health_of(&r).context("health")?;
    let p = result_in(h, "web-0", "ready").context("ready")?;
    let first_p = health_of(&first)
        .and_then(|h| result_in(h, "web-0", "ready"))
        .context("ready")?;
    assert!(
        p.checked_at > first_p.checked_at,
        "checked again by the second agent"
    );
    assert!(
        std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "still running"
    );

    agent.stop().await?;
    drain(state.path()).await?;
    drop(reports);
    let _ = admin.close(200, "done".into()).await;
    env.teardown().await
}

/// The broker management API: `path` under `/api/`.
/// Issue 13, part 3: the first hello after an outage states it. The node's
/// permission on the vhost is taken away and its connection closed, so the
/// agent cannot come back; given back a while later, the agent's next hello
/// says since when it lost the broker, for how long, and what it buffered and
/// dropped (the heartbeats it could not send). The first hello of the run
/// states none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_hello_after_an_outage_states_it() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let creds = env.add_node("out").await?;
    let node = creds.node.clone();
    let (admin, ch, mut reports) = controller_side(&env).await?;
    declaration_queue_for(&ch, &node).await?;

    let state = tempfile::tempdir()?;
    let root = mesh_testkit::units_tempdir()?;
    creds.write_to(state.path())?;
    let metrics_port = free_port();
    let agent = start_agent(Config {
        metrics_listen: Some(([127, 0, 0, 1], metrics_port).into()),
        ..agent_config(state.path(), root.path())
    });
    let first = wait_report(&mut reports, "hello", |r| {
        matches!(r.envelope.body, Report::Hello(_))
    })
    .await?;
    let Report::Hello(h) = &first.envelope.body else {
        bail!("not a hello")
    };
    assert_eq!(h.outage, None, "the first connect of a run states none");
    // Beating: the session runs.
    wait_report(&mut reports, "a heartbeat", |r| {
        matches!(r.envelope.body, Report::Heartbeat(_))
    })
    .await?;

    // Cut: no permission on the vhost, the connection closed.
    let a = env.admin_credentials();
    let (http, perms_url) = api(
        &env,
        &format!(
            "permissions/{}/{}",
            urlencoding::encode(env.vhost()),
            urlencoding::encode(node.as_str())
        ),
    );
    let perms: serde_json::Value = http
        .get(&perms_url)
        .basic_auth(&a.rabbitmq_user, Some(a.rabbitmq_password.expose()))
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    http.delete(&perms_url)
        .basic_auth(&a.rabbitmq_user, Some(a.rabbitmq_password.expose()))
        .send()
        .await?
        .error_for_status()?;
    let before = chrono::Utc::now();
    let until = Instant::now() + DEADLINE;
    while !scrape(metrics_port)
        .await?
        .contains("mesh_agent_broker_connected 0")
    {
        anyhow::ensure!(Instant::now() < until, "the agent never saw the cut");
        kill_connections(&env, node.as_str()).await?;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The outage lasts this long (the agent retries meanwhile, refused).
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let body = serde_json::json!({
        "configure": perms["configure"],
        "write": perms["write"],
        "read": perms["read"],
    });
    http.put(&perms_url)
        .basic_auth(&a.rabbitmq_user, Some(a.rabbitmq_password.expose()))
        .json(&body)
        .send()
        .await?
        .error_for_status()?;
    let restored = chrono::Utc::now();

    let r = wait_report(&mut reports, "hello after the outage", |r| {
        matches!(r.envelope.body, Report::Hello(_))
    })
    .await?;
    let Report::Hello(h) = &r.envelope.body else {
        bail!("not a hello")
    };
    let o = h.outage.as_ref().context("the hello states the outage")?;
    assert!(
        o.since >= before - chrono::Duration::seconds(1) && o.since <= restored,
        "{o:?}, cut at {before}, restored at {restored}"
    );
    assert!(o.seconds >= 2, "{o:?}");
    assert!(
        o.since + chrono::Duration::seconds(i64::try_from(o.seconds)?) <= chrono::Utc::now(),
        "{o:?}"
    );
    // Heartbeats every 200 ms could not be sent for 2.5 s and more.
    assert!(o.dropped >= 5, "{o:?}");
    assert!(o.buffered < 10, "{o:?}");

    let text = scrape(metrics_port).await?;
    for needle in [
        "mesh_agent_broker_connected 1",
        "mesh_agent_reconnects_total 1",
        "mesh_agent_broker_outages_total 1",
        "mesh_agent_build_info{version=",
    ] {
        assert!(text.contains(needle), "{needle} missing from\n{text}");
    }
    let outage = metric_value(&text, "mesh_agent_broker_outage_seconds_total");
    assert!(outage.is_some_and(|s| s >= 2.0), "{outage:?}\n{text}");
    // The hello's confirm reaches the agent a moment after the hello reached us.
    let until = Instant::now() + DEADLINE;
    loop {
        let text = scrape(metrics_port).await?;
        let confirmed = metric_value(&text, "mesh_agent_last_confirm_timestamp_seconds");
        if confirmed.is_some_and(|t| t >= restored.timestamp() as f64 - 1.0) {
            break;
        }
        anyhow::ensure!(
            Instant::now() < until,
            "no confirm after the outage: {confirmed:?}\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    agent.stop().await?;
    drop(reports);
    let _ = admin.close(200, "done".into()).await;
    env.teardown().await
}

/// The value of the first sample named `name` (with its labels, if any).
fn metric_value(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// The first check waits `initial_delay_secs` from the unit's start; a unit
/// declared stopped drops its probes, and declared running again starts them
/// anew.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_check_waits_the_initial_delay_and_a_stopped_unit_drops_its_probes() {
    let dir = mesh_testkit::units_tempdir().unwrap();
    let root = dir.path().join("root");
    let state = dir.path().join("state");
    std::fs::create_dir_all(&root).unwrap();
    std::fs::create_dir_all(&state).unwrap();
    let mut sup = Supervisor::start(units_config(), &root, &state, Metrics::new()).await;

    // The test listens itself: the check succeeds whenever it runs.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let unit = UnitItem {
        user: Default::default(),
        limits: Default::default(),
        stateful: false,
        artifact: None,
        revision: None,
        name: "late-0".into(),
        module: "late".into(),
        command: "/bin/sh".into(),
        args: vec!["-c".into(), "exec sleep 1000".into()],
        env: Default::default(),
        working_dir: None,
        restart: RestartPolicy::Always,
        desired: DesiredState::Running,
        probes: vec![probe(serde_json::json!({
            "name": "port",
            "tcp": {"port": port},
            "interval_secs": 1,
            "timeout_secs": 1,
            "initial_delay_secs": 2,
        }))],
    };
    sup.declare(std::slice::from_ref(&unit));
    timeout(
        DEADLINE,
        sup.wait_until(|l| l.iter().any(|u| u.state == UnitState::Running)),
    )
    .await
    .expect("running");
    let started_at = sup.statuses()[0].started_at.expect("started_at");
    let r = sup.probe_results();
    assert_eq!(r.len(), 1, "{r:?}");
    assert_eq!((r[0].state, r[0].checked_at), (ProbeState::Unknown, None));

    let r = wait_probes(&sup, "healthy after the delay", |r| {
        state_of(r, "port") == Some(ProbeState::Healthy)
    })
    .await;
    let checked = r[0].checked_at.expect("checked");
    assert!(
        checked >= started_at + chrono::Duration::milliseconds(1900),
        "checked at {checked}, the unit started at {started_at}"
    );

    // Stopped: no probes. Running again: anew, unknown first.
    let stopped = UnitItem {
        user: Default::default(),
        limits: Default::default(),
        stateful: false,
        artifact: None,
        revision: None,
        desired: DesiredState::Stopped,
        ..unit.clone()
    };
    sup.declare(std::slice::from_ref(&stopped));
    wait_probes(&sup, "no probes while stopped", |r| r.is_empty()).await;
    sup.declare(std::slice::from_ref(&unit));
    wait_probes(&sup, "unknown again", |r| {
        r.len() == 1 && r[0].state == ProbeState::Unknown
    })
    .await;
    wait_probes(&sup, "healthy again", |r| {
        state_of(r, "port") == Some(ProbeState::Healthy)
    })
    .await;
    drop(listener);
    sup.stop_all().await;
}
