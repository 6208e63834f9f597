//! The agent against the real broker, in-process: it says hello with its broker
//! identity, waits for its declaration queue, applies declarations to disk and
//! reports them, serves metrics, and shuts down gracefully.
//!
//! The controller is not here: the test declares the topology itself, as the
//! environment's admin user (full permissions on the test vhost).

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

mod common;

use common::{controller_side, declaration_queue_for, free_port, kill_connections, scrape};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, bail};
use futures_util::StreamExt;
use lapin::options::BasicPublishOptions;
use lapin::{BasicProperties, Channel, Consumer};
use mesh_host_agent::{Config, Store};
use mesh_protocol::topology::DECLARATIONS_EXCHANGE;
use mesh_protocol::{
    Declaration, DeclarationItems, DeclarationSigner, Envelope, FileItem, FileMode,
    MAX_REPORT_BYTES, NodeId, Outcome, Report, Section,
};
use mesh_testkit::TestEnv;
use tokio::time::{Instant, timeout};

const DEADLINE: Duration = Duration::from_secs(30);

struct Received {
    user_id: Option<String>,
    kind: Option<String>,
    message_id: Option<String>,
    content_type: Option<String>,
    delivery_mode: Option<u8>,
    envelope: Envelope<Report>,
}

/// The next report matching `pred`, within the deadline.
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
        let p = &d.properties;
        let r = Received {
            user_id: p.user_id().as_ref().map(|s| s.to_string()),
            kind: p.kind().as_ref().map(|s| s.to_string()),
            message_id: p.message_id().as_ref().map(|s| s.to_string()),
            content_type: p.content_type().as_ref().map(|s| s.to_string()),
            delivery_mode: *p.delivery_mode(),
            envelope: Envelope::<Report>::decode(&d.data, MAX_REPORT_BYTES)
                .context("report decodes")?,
        };
        if pred(&r) {
            return Ok(r);
        }
    }
}

fn file(path: &str, content: &str, mode: u32) -> FileItem {
    FileItem {
        path: path.into(),
        content: content.into(),
        mode: FileMode::new(mode).unwrap(),
    }
}

async fn declare(
    ch: &Channel,
    signer: &DeclarationSigner,
    node: &NodeId,
    generation: u64,
    files: Vec<FileItem>,
) -> anyhow::Result<()> {
    let decl = Declaration {
        section: Section::Config,
        generation,
        items: DeclarationItems {
            heartbeat: None,
            files,
            ..Default::default()
        },
    };
    publish_raw(
        ch,
        signer,
        node,
        &Envelope::new(node.clone(), generation, decl).encode(),
    )
    .await
}

/// Publish as the controller does: signed with the environment's controller key.
async fn publish_raw(
    ch: &Channel,
    signer: &DeclarationSigner,
    node: &NodeId,
    bytes: &[u8],
) -> anyhow::Result<()> {
    let mut headers = lapin::types::FieldTable::default();
    headers.insert(
        mesh_protocol::topology::SIGNATURE_HEADER.into(),
        lapin::types::AMQPValue::LongString(signer.sign_hex(bytes).into()),
    );
    let confirm = ch
        .basic_publish(
            DECLARATIONS_EXCHANGE.into(),
            node.as_str().into(),
            BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            bytes,
            BasicProperties::default()
                .with_message_id(uuid::Uuid::now_v7().to_string().into())
                .with_type("declaration".into())
                .with_content_type("application/json".into())
                .with_delivery_mode(2)
                .with_headers(headers),
        )
        .await?
        .await?;
    anyhow::ensure!(
        matches!(confirm, lapin::Confirmation::Ack(None)),
        "declaration not routed: {confirm:?}"
    );
    Ok(())
}

fn applied(r: &Received) -> Option<&mesh_protocol::Applied> {
    match &r.envelope.body {
        Report::Applied(a) => Some(a),
        _ => None,
    }
}

fn mode_of(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hello_declarations_and_shutdown() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let creds = env.add_node("a").await?;
    let node = creds.node.clone();

    let (admin, ch, mut reports) = controller_side(&env).await?;

    // The agent, in-process.
    let state = tempfile::tempdir()?;
    let root = mesh_testkit::units_tempdir()?;
    creds.write_to(state.path())?;
    let metrics_port = free_port();
    let config = Config {
        state_dir: state.path().to_owned(),
        root: root.path().to_owned(),
        labels: [("role".to_owned(), "test".to_owned())].into(),
        heartbeat_interval: Duration::from_millis(300),
        reconnect_min: Duration::from_millis(50),
        reconnect_max: Duration::from_millis(400),
        metrics_listen: Some(([127, 0, 0, 1], metrics_port).into()),
        hostname: Some("test-host".into()),
        ..Config::default()
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let agent = tokio::spawn(mesh_host_agent::run(config, async {
        let _ = stopped.await;
    }));

    // 1. Hello, with the broker-validated identity and the documented properties.
    let hello = wait_report(&mut reports, "hello", |r| {
        r.kind.as_deref() == Some("hello")
    })
    .await?;
    assert_eq!(hello.user_id.as_deref(), Some(node.as_str()));
    assert_eq!(hello.message_id, Some(hello.envelope.id.to_string()));
    assert_eq!(hello.content_type.as_deref(), Some("application/json"));
    assert_eq!(hello.delivery_mode, Some(2));
    assert_eq!(hello.envelope.node, node);
    let Report::Hello(h) = &hello.envelope.body else {
        bail!("not a hello")
    };
    assert_eq!(h.hostname, "test-host");
    assert_eq!(h.labels.get("role").map(String::as_str), Some("test"));
    assert!(h.applied.is_empty());
    assert!(h.memory_bytes > 0);

    // 2. The declaration queue appears only now (the agent has been retrying).
    declaration_queue_for(&ch, &node).await?;

    declare(
        &ch,
        env.signer(),
        &node,
        1,
        vec![
            file("/etc/mesh-test/a.conf", "a=1\n", 0o640),
            file("/etc/mesh-test/b", "b", 0o600),
        ],
    )
    .await?;
    let r = wait_report(&mut reports, "applied generation 1", |r| {
        applied(r).is_some_and(|a| a.generation == Some(1))
    })
    .await?;
    let a = applied(&r).unwrap();
    assert_eq!(a.outcome, Outcome::Applied, "{a:?}");
    assert_eq!(a.section, Some(Section::Config));
    assert_eq!(r.user_id.as_deref(), Some(node.as_str()));
    assert_eq!(
        std::fs::read_to_string(root.path().join("etc/mesh-test/a.conf"))?,
        "a=1\n"
    );
    assert_eq!(mode_of(&root.path().join("etc/mesh-test/a.conf")), 0o640);
    assert_eq!(mode_of(&root.path().join("etc/mesh-test/b")), 0o600);

    // 3. Generation 2 drops b.
    declare(
        &ch,
        env.signer(),
        &node,
        2,
        vec![file("/etc/mesh-test/a.conf", "a=2\n", 0o644)],
    )
    .await?;
    let r = wait_report(&mut reports, "applied generation 2", |r| {
        applied(r).is_some_and(|a| a.generation == Some(2))
    })
    .await?;
    assert_eq!(applied(&r).unwrap().outcome, Outcome::Applied);
    assert_eq!(
        std::fs::read_to_string(root.path().join("etc/mesh-test/a.conf"))?,
        "a=2\n"
    );
    assert!(!root.path().join("etc/mesh-test/b").exists());

    // 4. Garbage is rejected, acked, and changes nothing.
    publish_raw(&ch, env.signer(), &node, b"{not json").await?;
    let r = wait_report(&mut reports, "rejected", |r| {
        applied(r).is_some_and(|a| a.outcome == Outcome::Rejected)
    })
    .await?;
    assert!(
        applied(&r)
            .unwrap()
            .error
            .as_deref()
            .unwrap_or("")
            .contains("malformed"),
        "{:?}",
        applied(&r)
    );

    // 5. A stale generation restates generation 2, touching nothing.
    declare(
        &ch,
        env.signer(),
        &node,
        1,
        vec![file("/etc/mesh-test/stale", "x", 0o644)],
    )
    .await?;
    let r = wait_report(&mut reports, "restated generation 2", |r| {
        applied(r).is_some_and(|a| a.generation == Some(2) && a.items.is_empty())
    })
    .await?;
    assert_eq!(applied(&r).unwrap().outcome, Outcome::Applied);
    assert!(!root.path().join("etc/mesh-test/stale").exists());

    // 6. Heartbeats carry the applied generation.
    let r = wait_report(&mut reports, "heartbeat with config 2", |r| {
        matches!(&r.envelope.body, Report::Heartbeat(h) if h.applied.get(&Section::Config) == Some(&2))
    })
    .await?;
    assert_eq!(r.user_id.as_deref(), Some(node.as_str()));

    // 7. Metrics.
    let text = scrape(metrics_port).await?;
    assert!(
        text.contains("mesh_agent_reports_published_total{kind=\"hello\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("mesh_agent_declarations_applied_total{outcome=\"applied\"} 2"),
        "{text}"
    );
    assert!(
        text.contains("mesh_agent_declarations_applied_total{outcome=\"rejected\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("mesh_agent_declarations_applied_total{outcome=\"stale\"} 1"),
        "{text}"
    );
    assert!(text.contains("mesh_agent_reconnects_total 0"), "{text}");

    // 8. Graceful shutdown, then the store says what was applied.
    let _ = stop.send(());
    timeout(Duration::from_secs(15), agent)
        .await
        .context("agent did not stop")???;
    let store = Store::open(state.path())?;
    let s = store.section(Section::Config);
    assert_eq!(s.generation, 2);
    assert_eq!(s.paths, ["/etc/mesh-test/a.conf".to_owned()].into());
    assert!(
        store.data().pending_reports.is_empty(),
        "{:?}",
        store.data().pending_reports
    );

    // 9. A restarted agent says hello with what it has applied.
    let config = Config {
        state_dir: state.path().to_owned(),
        root: root.path().to_owned(),
        hostname: Some("test-host".into()),
        ..Config::default()
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let agent = tokio::spawn(mesh_host_agent::run(config, async {
        let _ = stopped.await;
    }));
    let r = wait_report(&mut reports, "hello after restart", |r| {
        r.kind.as_deref() == Some("hello")
    })
    .await?;
    let Report::Hello(h) = &r.envelope.body else {
        bail!("not a hello")
    };
    assert_eq!(h.applied.get(&Section::Config), Some(&2));
    assert!(r.envelope.seq > hello.envelope.seq);
    let _ = stop.send(());
    timeout(Duration::from_secs(15), agent)
        .await
        .context("agent did not stop")???;

    drop(reports);
    let _ = admin.close(200, "done".into()).await;
    env.teardown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnects_after_losing_the_broker() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let creds = env.add_node("r").await?;
    let node = creds.node.clone();
    let (admin, ch, mut reports) = controller_side(&env).await?;
    declaration_queue_for(&ch, &node).await?;

    let state = tempfile::tempdir()?;
    let root = mesh_testkit::units_tempdir()?;
    creds.write_to(state.path())?;
    let metrics_port = free_port();
    let config = Config {
        state_dir: state.path().to_owned(),
        root: root.path().to_owned(),
        heartbeat_interval: Duration::from_millis(200),
        reconnect_min: Duration::from_millis(50),
        reconnect_max: Duration::from_millis(300),
        metrics_listen: Some(([127, 0, 0, 1], metrics_port).into()),
        ..Config::default()
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let agent = tokio::spawn(mesh_host_agent::run(config, async {
        let _ = stopped.await;
    }));
    let first = wait_report(&mut reports, "hello", |r| {
        r.kind.as_deref() == Some("hello")
    })
    .await?;

    // The agent connects a moment after it starts.
    let until = Instant::now() + DEADLINE;
    while kill_connections(&env, node.as_str()).await? == 0 {
        anyhow::ensure!(
            Instant::now() < until,
            "the agent's connection never showed up"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // A new hello on the new connection, and declarations flow again.
    let second = wait_report(&mut reports, "hello after reconnect", |r| {
        r.kind.as_deref() == Some("hello")
    })
    .await?;
    assert!(second.envelope.seq > first.envelope.seq);
    declare(
        &ch,
        env.signer(),
        &node,
        1,
        vec![file("/etc/after-reconnect", "ok", 0o644)],
    )
    .await?;
    wait_report(&mut reports, "applied after reconnect", |r| {
        applied(r).is_some_and(|a| a.generation == Some(1) && a.outcome == Outcome::Applied)
    })
    .await?;
    assert_eq!(
        std::fs::read_to_string(root.path().join("etc/after-reconnect"))?,
        "ok"
    );
    let text = scrape(metrics_port).await?;
    assert!(text.contains("mesh_agent_reconnects_total 1"), "{text}");

    let _ = stop.send(());
    timeout(Duration::from_secs(15), agent)
        .await
        .context("agent did not stop")???;
    drop(reports);
    let _ = admin.close(200, "done".into()).await;
    env.teardown().await
}

/// The real binary: flags over a config file, a hello with them, and a graceful
/// exit on SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_runs_and_stops_on_sigterm() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let creds = env.add_node("bin").await?;
    let (admin, _ch, mut reports) = controller_side(&env).await?;
    let state = tempfile::tempdir()?;
    let root = mesh_testkit::units_tempdir()?;
    creds.write_to(state.path())?;
    let config_file = state.path().join("agent.toml");
    std::fs::write(
        &config_file,
        "hostname = \"from-file\"\nheartbeat_interval = \"1h\"\n[labels]\nzone = \"a\"\nrole = \"file\"\n",
    )?;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_mesh-agent"))
        .args(["--log-format", "json", "run", "--config"])
        .arg(&config_file)
        .arg("--state-dir")
        .arg(state.path())
        .arg("--root")
        .arg(root.path())
        .args([
            "--label",
            "role=flag",
            "--heartbeat-interval",
            "0.2",
            "--hostname",
            "from-flag",
        ])
        .kill_on_drop(true)
        .spawn()?;

    let hello = wait_report(&mut reports, "hello", |r| {
        r.kind.as_deref() == Some("hello")
    })
    .await?;
    let Report::Hello(h) = &hello.envelope.body else {
        bail!("not a hello")
    };
    assert_eq!(h.hostname, "from-flag");
    assert_eq!(h.labels.get("zone").map(String::as_str), Some("a"));
    assert_eq!(h.labels.get("role").map(String::as_str), Some("flag"));
    // The flag's interval, not the file's hour.
    wait_report(&mut reports, "heartbeat", |r| {
        r.kind.as_deref() == Some("heartbeat")
    })
    .await?;

    let pid = child.id().context("child has a pid")?;
    let status = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()?;
    anyhow::ensure!(status.success(), "kill failed");
    let exit = timeout(Duration::from_secs(15), child.wait())
        .await
        .context("agent did not exit on SIGTERM")??;
    assert!(exit.success(), "{exit}");

    drop(reports);
    let _ = admin.close(200, "done".into()).await;
    env.teardown().await
}

fn units_of(r: &Received) -> Option<&[mesh_protocol::UnitStatus]> {
    match &r.envelope.body {
        Report::Units(u) => Some(&u.units),
        _ => None,
    }
}

/// End to end through the broker: an inventory declaration with a file and a
/// unit → the file is written, the unit runs in its working dir under the root,
/// `units` reports say so (after connecting, and on every change), a kill -9 is
/// a restart in the next report, and a generation without the unit stops it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declared_units_run_and_are_reported() -> anyhow::Result<()> {
    use mesh_protocol::{DesiredState, RestartPolicy, UnitItem, UnitState};
    let env = TestEnv::new().await?;
    let creds = env.add_node("u").await?;
    let node = creds.node.clone();
    let (admin, ch, mut reports) = controller_side(&env).await?;
    declaration_queue_for(&ch, &node).await?;

    let state = tempfile::tempdir()?;
    let root = mesh_testkit::units_tempdir()?;
    creds.write_to(state.path())?;
    let config = Config {
        state_dir: state.path().to_owned(),
        root: root.path().to_owned(),
        heartbeat_interval: Duration::from_millis(500),
        reconnect_min: Duration::from_millis(50),
        reconnect_max: Duration::from_millis(400),
        units: mesh_host_agent::units::UnitsConfig {
            restart_backoff_min: Duration::from_millis(50),
            stop_timeout: Duration::from_secs(2),
            shim_program: Some(env!("CARGO_BIN_EXE_mesh-agent").into()),
            ..Default::default()
        },
        ..Config::default()
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let agent = tokio::spawn(mesh_host_agent::run(config, async {
        let _ = stopped.await;
    }));

    // After connecting: a units report, empty (nothing declared yet).
    let r = wait_report(&mut reports, "units report after connect", |r| {
        units_of(r).is_some()
    })
    .await?;
    assert_eq!(units_of(&r), Some(&[][..]));
    assert_eq!(r.user_id.as_deref(), Some(node.as_str()));

    let unit = UnitItem {
        user: Default::default(),
        limits: Default::default(),
        stateful: false,
        artifact: None,
        revision: None,
        name: "svc-0".into(),
        module: "svc".into(),
        command: "/bin/sh".into(),
        args: vec!["-c".into(), "cat app.conf; exec sleep 1000".into()],
        env: Default::default(),
        working_dir: Some("/srv/svc".into()),
        restart: RestartPolicy::Always,
        desired: DesiredState::Running,
        probes: Vec::new(),
    };
    let decl = |generation, units: Vec<UnitItem>| Declaration {
        section: Section::Inventory,
        generation,
        items: DeclarationItems {
            heartbeat: None,
            files: vec![file("/srv/svc/app.conf", "port=8080\n", 0o644)],
            units,
            secrets: vec![],
            ..Default::default()
        },
    };
    publish_raw(
        &ch,
        env.signer(),
        &node,
        &Envelope::new(node.clone(), 1, decl(1, vec![unit.clone()])).encode(),
    )
    .await?;
    let r = wait_report(&mut reports, "applied inventory 1", |r| {
        applied(r).is_some_and(|a| a.generation == Some(1))
    })
    .await?;
    let a = applied(&r).unwrap();
    assert_eq!(a.outcome, Outcome::Applied, "{a:?}");
    assert!(a.items.iter().any(|i| i.item == "svc-0" && i.ok), "{a:?}");

    let r = wait_report(&mut reports, "units report: svc-0 running", |r| {
        units_of(r).is_some_and(|u| {
            u.iter()
                .any(|s| s.name == "svc-0" && s.state == UnitState::Running)
        })
    })
    .await?;
    let s = units_of(&r).unwrap()[0].clone();
    assert_eq!((s.module.as_str(), s.restarts), ("svc", 0));
    assert!(s.started_at.is_some());
    let pid = s.pid.context("a running unit has a pid")?;
    assert!(Path::new(&format!("/proc/{pid}")).exists());
    // It ran in its working dir, under the root, next to its declared file.
    let log = state.path().join("units/svc-0/stdout.log");
    let until = Instant::now() + DEADLINE;
    while std::fs::read_to_string(&log).unwrap_or_default() != "port=8080\n" {
        anyhow::ensure!(Instant::now() < until, "the unit's output never arrived");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // kill -9: restarted, and the report says so.
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid as i32).context("pid")?,
        rustix::process::Signal::KILL,
    )?;
    let r = wait_report(&mut reports, "units report: restarted", |r| {
        units_of(r).is_some_and(|u| {
            u.iter().any(|s| {
                s.name == "svc-0"
                    && s.state == UnitState::Running
                    && s.restarts == 1
                    && s.pid != Some(pid)
            })
        })
    })
    .await?;
    assert_eq!(units_of(&r).unwrap().len(), 1);

    // Generation 2 drops the unit: stopped, and the list is empty again.
    publish_raw(
        &ch,
        env.signer(),
        &node,
        &Envelope::new(node.clone(), 2, decl(2, vec![])).encode(),
    )
    .await?;
    wait_report(&mut reports, "units report: empty", |r| {
        units_of(r).is_some_and(|u| u.is_empty())
    })
    .await?;
    assert_eq!(
        Store::open(state.path())?
            .section(Section::Inventory)
            .generation,
        2
    );

    let _ = stop.send(());
    timeout(Duration::from_secs(15), agent)
        .await
        .context("agent did not stop")???;
    drop(reports);
    let _ = admin.close(200, "done".into()).await;
    env.teardown().await
}

/// Whether `pid` is a live (not zombie) process.
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rfind(')')
            .and_then(|i| s[i + 1..].split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X")
    })
}

/// The agent binary, as a service manager runs it.
fn agent_binary(config: &Path, state: &Path, root: &Path) -> anyhow::Result<tokio::process::Child> {
    Ok(
        tokio::process::Command::new(env!("CARGO_BIN_EXE_mesh-agent"))
            .args(["run", "--config"])
            .arg(config)
            .arg("--state-dir")
            .arg(state)
            .arg("--root")
            .arg(root)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()?,
    )
}

/// Issue 9, item 3: an agent's restart restarts no unit. The real binary runs
/// two units from its store; it is replaced (SIGTERM, then the same binary
/// again; later SIGKILL and again): the units keep their pids, restart counts
/// and output, and are never signalled (each writes a mark file on TERM, HUP or
/// INT). One killed while the agent is away is restarted and counted in the
/// next `units` report. `mesh-agent drain-local` stops them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agents_restart_restarts_no_unit() -> anyhow::Result<()> {
    use mesh_protocol::{DesiredState, RestartPolicy, UnitItem, UnitState, UnitStatus};
    let env = TestEnv::new().await?;
    let creds = env.add_node("keep").await?;
    let node = creds.node.clone();
    let (admin, ch, mut reports) = controller_side(&env).await?;
    declaration_queue_for(&ch, &node).await?;

    let state = tempfile::tempdir()?;
    let root = mesh_testkit::units_tempdir()?;
    let marks = mesh_testkit::units_tempdir()?;
    mesh_testkit::open_to_units(marks.path())?;
    creds.write_to(state.path())?;
    let config = state.path().join("agent.toml");
    std::fs::write(
        &config,
        "heartbeat_interval = \"200ms\"\nreconnect_min = \"50ms\"\nreconnect_max = \"400ms\"\n\
         [units]\nstop_timeout = \"2s\"\nrestart_backoff_min = \"50ms\"\n\
         log_max_bytes = 1024\nlog_files = 2\n",
    )?;
    let unit = |name: &str, script: &str| UnitItem {
        user: Default::default(),
        limits: Default::default(),
        stateful: false,
        artifact: None,
        revision: None,
        name: name.into(),
        module: "keep".into(),
        command: "/bin/sh".into(),
        args: vec![
            "-c".into(),
            format!(
                "trap 'echo TERM >> \"$MARK\"; exit 0' TERM\n\
                 trap 'echo HUP >> \"$MARK\"' HUP\n\
                 trap 'echo INT >> \"$MARK\"' INT\n\
                 echo \"pid $$\" > \"$MARK.pid\"\n{script}"
            ),
        ],
        env: [(
            "MARK".to_owned(),
            marks.path().join(name).to_string_lossy().into_owned(),
        )]
        .into(),
        working_dir: None,
        restart: RestartPolicy::Always,
        desired: DesiredState::Running,
        probes: Vec::new(),
    };
    // `talker` says a numbered line every 20 ms (a gap would be a lost line);
    // `quiet` says nothing.
    let talker = unit(
        "talker",
        "i=0; while true; do i=$((i+1)); echo \"line $i ------------------------------\"; sleep 0.02; done",
    );
    let quiet = unit("quiet", "while true; do sleep 0.1; done");
    let mut store = Store::open(state.path())?;
    store.record(
        Section::Inventory,
        mesh_host_agent::store::SectionState {
            generation: 1,
            last_generation: 1,
            units: vec![talker, quiet],
            ..Default::default()
        },
        None,
        10,
    )?;
    drop(store);

    fn both_running(u: &[UnitStatus]) -> bool {
        u.len() == 2
            && u.iter()
                .all(|s| s.state == UnitState::Running && s.pid.is_some())
    }
    let of = |u: &[UnitStatus], name: &str| u.iter().find(|s| s.name == name).cloned();
    let log = state.path().join("units/talker");
    let lines = || -> Vec<u64> {
        ["stdout.log.2", "stdout.log.1", "stdout.log"]
            .iter()
            .map(|n| std::fs::read_to_string(log.join(n)).unwrap_or_default())
            .collect::<String>()
            .lines()
            .filter_map(|l| l.strip_prefix("line ")?.split(' ').next()?.parse().ok())
            .collect()
    };
    let last = || lines().into_iter().max().unwrap_or(0);

    // 1. The first agent starts both from its store.
    let mut agent = agent_binary(&config, state.path(), root.path())?;
    let r = wait_report(&mut reports, "units report: both running", |r| {
        units_of(r).is_some_and(both_running)
    })
    .await?;
    let u = units_of(&r).unwrap();
    let (talker0, quiet0) = (of(u, "talker").unwrap(), of(u, "quiet").unwrap());
    assert_eq!((talker0.restarts, quiet0.restarts), (0, 0));
    let (tp, qp) = (talker0.pid.unwrap(), quiet0.pid.unwrap());
    wait_until("output before", || last() > 5).await?;

    // 2. Replaced gracefully.
    let pid = agent.id().context("agent pid")?;
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid as i32).context("pid")?,
        rustix::process::Signal::TERM,
    )?;
    let exit = timeout(Duration::from_secs(15), agent.wait()).await??;
    assert!(exit.success(), "{exit}");
    assert!(alive(tp) && alive(qp), "the units outlive a stopped agent");
    let at_stop = last();
    wait_until("output while the agent is away", || last() > at_stop + 10).await?;
    // `quiet` dies while the agent is away; its shim records it.
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(qp as i32).context("pid")?,
        rustix::process::Signal::KILL,
    )?;
    let exit_record = state.path().join("units/quiet/exit");
    wait_until("quiet's exit record", || exit_record.exists()).await?;

    let mut agent = agent_binary(&config, state.path(), root.path())?;
    let r = wait_report(&mut reports, "units report after the restart", |r| {
        units_of(r)
            .is_some_and(|u| both_running(u) && of(u, "quiet").is_some_and(|q| q.pid != Some(qp)))
    })
    .await?;
    let u = units_of(&r).unwrap();
    let (talker1, quiet1) = (of(u, "talker").unwrap(), of(u, "quiet").unwrap());
    assert_eq!(talker1.pid, Some(tp), "adopted: the same process");
    assert_eq!(talker1.restarts, 0, "adopted: not counted as a restart");
    assert_eq!(talker1.started_at, talker0.started_at);
    assert_eq!(quiet1.restarts, 1, "died while the agent was away: counted");
    let qp1 = quiet1.pid.unwrap();
    let during = last();
    wait_until("output with the new agent", || last() > during + 10).await?;

    // 3. Replaced after a crash (SIGKILL): the same.
    agent.kill().await?;
    assert!(alive(tp) && alive(qp1), "the units outlive a killed agent");
    let mut agent = agent_binary(&config, state.path(), root.path())?;
    let r = wait_report(&mut reports, "units report after the crash", |r| {
        units_of(r).is_some_and(both_running)
    })
    .await?;
    let u = units_of(&r).unwrap();
    let (talker2, quiet2) = (of(u, "talker").unwrap(), of(u, "quiet").unwrap());
    assert_eq!((talker2.pid, talker2.restarts), (Some(tp), 0));
    assert_eq!((quiet2.pid, quiet2.restarts), (Some(qp1), 1));
    let after = last();
    wait_until("output after the crash", || last() > after + 10).await?;

    // Never signalled (the marks are only written by the traps).
    for name in ["talker", "quiet"] {
        assert!(
            !marks.path().join(name).exists(),
            "{name} was signalled: {:?}",
            std::fs::read_to_string(marks.path().join(name))
        );
    }

    // 4. Decommissioning: stop the agent, drain the node.
    let pid = agent.id().context("agent pid")?;
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid as i32).context("pid")?,
        rustix::process::Signal::TERM,
    )?;
    timeout(Duration::from_secs(15), agent.wait()).await??;
    assert!(alive(tp) && alive(qp1));
    let drained = tokio::process::Command::new(env!("CARGO_BIN_EXE_mesh-agent"))
        .args(["drain-local", "--stop-timeout", "2s", "--state-dir"])
        .arg(state.path())
        .output()
        .await?;
    assert!(drained.status.success(), "{drained:?}");
    assert!(
        String::from_utf8_lossy(&drained.stdout).contains("stopped 2 unit(s): quiet talker"),
        "{drained:?}"
    );
    assert!(!alive(tp) && !alive(qp1), "drain-local stops every unit");
    for name in ["talker", "quiet"] {
        assert_eq!(
            std::fs::read_to_string(marks.path().join(name))
                .ok()
                .as_deref(),
            Some("TERM\n"),
            "{name} got its SIGTERM"
        );
    }

    // Every line the talker wrote, before, during and after each absence,
    // is in its logs (those not rotated away), in order, with no gap; the
    // files stay within the cap (1 KiB, 2 rotated ones: about 70 lines).
    let kept = lines();
    assert!(kept.len() > 40, "{kept:?}");
    for w in kept.windows(2) {
        assert_eq!(w[1], w[0] + 1, "a line lost: {w:?}");
    }
    assert!(kept[kept.len() - 1] > after + 10);
    for n in ["stdout.log", "stdout.log.1", "stdout.log.2"] {
        let len = std::fs::metadata(log.join(n))
            .with_context(|| n.to_string())?
            .len();
        assert!(len <= 1024, "{n} has {len} bytes");
    }
    assert!(!log.join("stdout.log.3").exists());

    drop(reports);
    let _ = admin.close(200, "done".into()).await;
    env.teardown().await
}

/// Wait for a plain condition (files, /proc), polling, within the deadline.
async fn wait_until(what: &str, check: impl Fn() -> bool) -> anyhow::Result<()> {
    let deadline = Instant::now() + DEADLINE;
    while !check() {
        anyhow::ensure!(Instant::now() < deadline, "no {what} within {DEADLINE:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// Version skew (decision 0020): the hello states the agent's protocol range; a
/// declaration of a section this agent does not know is reported `unsupported`
/// (with the section and a reason) and changes nothing; fields it does not know
/// are ignored and counted; and every other section goes on being applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_section_is_reported_unsupported_and_nothing_else_stops() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let creds = env.add_node("u").await?;
    let node = creds.node.clone();
    let (admin, ch, mut reports) = controller_side(&env).await?;
    let state = tempfile::tempdir()?;
    let root = mesh_testkit::units_tempdir()?;
    creds.write_to(state.path())?;
    let metrics_port = free_port();
    let config = Config {
        state_dir: state.path().to_owned(),
        root: root.path().to_owned(),
        heartbeat_interval: Duration::from_millis(300),
        metrics_listen: Some(([127, 0, 0, 1], metrics_port).into()),
        hostname: Some("test-host".into()),
        ..Config::default()
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let agent = tokio::spawn(mesh_host_agent::run(config, async {
        let _ = stopped.await;
    }));
    let hello = wait_report(&mut reports, "hello", |r| {
        r.kind.as_deref() == Some("hello")
    })
    .await?;
    let Report::Hello(h) = &hello.envelope.body else {
        bail!("not a hello")
    };
    assert_eq!(h.protocol, Some(mesh_protocol::ProtocolRange::THIS));
    declaration_queue_for(&ch, &node).await?;

    // A newer controller's section, with a field this agent does not know.
    let unknown = serde_json::json!({
        "v": 1, "id": uuid::Uuid::now_v7(), "kind": "declaration", "node": node.as_str(),
        "seq": 3, "sent_at": "2026-11-30T12:00:00Z",
        "body": {"section": "observability", "generation": 3,
                 "items": {"files": [], "probes": [{"url": "http://x"}]}},
    });
    publish_raw(&ch, env.signer(), &node, unknown.to_string().as_bytes()).await?;
    let r = wait_report(&mut reports, "applied of the unknown section", |r| {
        applied(r).is_some_and(|a| a.outcome == Outcome::Unsupported)
    })
    .await?;
    let a = applied(&r).unwrap();
    assert_eq!(
        a.unsupported_section.as_deref(),
        Some("observability"),
        "{a:?}"
    );
    assert_eq!(a.section, None);
    assert_eq!(a.generation, Some(3));
    let error = a.error.as_deref().unwrap_or_default();
    assert!(
        error.contains("`observability` is not supported") && error.contains("v1..v1"),
        "{error}"
    );
    assert_eq!(r.user_id.as_deref(), Some(node.as_str()));
    assert!(!root.path().join("etc").exists(), "nothing written");

    // A known section with unknown fields in the body and in a file item.
    let mut known: serde_json::Value = serde_json::from_slice(
        &Envelope::new(
            node.clone(),
            1,
            Declaration {
                section: Section::Config,
                generation: 1,
                items: DeclarationItems {
                    heartbeat: None,
                    files: vec![file("/etc/mesh-test/skew", "ok\n", 0o644)],
                    ..Default::default()
                },
            },
        )
        .encode(),
    )?;
    known["body"]["rollout"] = serde_json::json!("canary");
    known["body"]["items"]["files"][0]["owner"] = serde_json::json!("root");
    publish_raw(&ch, env.signer(), &node, known.to_string().as_bytes()).await?;
    let r = wait_report(&mut reports, "applied config generation 1", |r| {
        applied(r).is_some_and(|a| a.section == Some(Section::Config))
    })
    .await?;
    let a = applied(&r).unwrap();
    assert_eq!(a.outcome, Outcome::Applied, "{a:?}");
    assert_eq!(
        std::fs::read_to_string(root.path().join("etc/mesh-test/skew"))?,
        "ok\n"
    );
    let text = scrape(metrics_port).await?;
    for needle in [
        "mesh_agent_declarations_applied_total{outcome=\"unsupported\"} 1",
        "mesh_agent_declarations_applied_total{outcome=\"applied\"} 1",
        "mesh_agent_unknown_fields_total{kind=\"declaration\"} 2",
    ] {
        assert!(text.contains(needle), "{needle} missing from\n{text}");
    }

    let _ = stop.send(());
    timeout(Duration::from_secs(15), agent)
        .await
        .context("agent did not stop")???;
    drop(reports);
    let _ = admin.close(200, "done".into()).await;
    env.teardown().await
}

/// Secrets sealed to the node (issue 11): an agent enrolled by the test kit has
/// no seal key, makes one at start and states its public key in hello; a
/// secret sealed to it for this node and path is opened and written 0600; one
/// sealed for another node refuses the whole declaration; a generation
/// without the secret removes it; a restart keeps the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sealed_secret_arrives_and_is_written_0600() -> anyhow::Result<()> {
    use mesh_protocol::SealedFileItem;
    use mesh_protocol::sealing::{self, SealPublicKey};

    let env = TestEnv::new().await?;
    let creds = env.add_node("s").await?;
    let node = creds.node.clone();
    let (admin, ch, mut reports) = controller_side(&env).await?;
    let state = tempfile::tempdir()?;
    let root = mesh_testkit::units_tempdir()?;
    creds.write_to(state.path())?;
    let key_file = state
        .path()
        .join(mesh_host_agent::credentials::SEAL_KEY_FILE);
    assert!(!key_file.exists());
    let config = || Config {
        state_dir: state.path().to_owned(),
        root: root.path().to_owned(),
        heartbeat_interval: Duration::from_millis(300),
        reconnect_min: Duration::from_millis(50),
        reconnect_max: Duration::from_millis(400),
        ..Config::default()
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let agent = tokio::spawn(mesh_host_agent::run(config(), async {
        let _ = stopped.await;
    }));

    let hello = wait_report(&mut reports, "hello", |r| {
        r.kind.as_deref() == Some("hello")
    })
    .await?;
    let Report::Hello(h) = &hello.envelope.body else {
        bail!("not a hello")
    };
    let stated = h.seal_key.clone().context("hello states a seal key")?;
    assert_eq!(mode_of(&key_file), 0o600);
    let on_disk =
        mesh_protocol::sealing::SealSecretKey::from_hex(&std::fs::read_to_string(&key_file)?)?;
    assert_eq!(on_disk.public().to_hex(), stated);
    let to = SealPublicKey::from_hex(&stated)?;

    declaration_queue_for(&ch, &node).await?;
    let path = "/etc/mesh-test/db.password";
    let sealed_for = |for_node: &str, n: u8| -> anyhow::Result<SealedFileItem> {
        Ok(SealedFileItem {
            path: path.into(),
            mode: FileMode::new(0o600)?,
            secret: "db-password".into(),
            version: 1,
            sealed: sealing::seal(
                &to,
                &sealing::secret_aad(for_node, path),
                b"hunter2\n",
                [n; 32],
            )?,
        })
    };
    let publish = |generation: u64, secrets: Vec<SealedFileItem>| {
        let decl = Declaration {
            section: Section::Config,
            generation,
            items: DeclarationItems {
                files: vec![file("/etc/mesh-test/app.conf", "db=1\n", 0o644)],
                secrets,
                ..Default::default()
            },
        };
        Envelope::new(node.clone(), generation, decl).encode()
    };

    // 1. Sealed to this node's key but for another node: refused, nothing written.
    publish_raw(
        &ch,
        env.signer(),
        &node,
        &publish(1, vec![sealed_for("other", 1)?]),
    )
    .await?;
    let r = wait_report(&mut reports, "applied generation 1", |r| {
        applied(r).is_some_and(|a| a.generation == Some(1))
    })
    .await?;
    let a = applied(&r).unwrap();
    assert_eq!(a.outcome, Outcome::Rejected, "{a:?}");
    let error = a.error.clone().unwrap_or_default();
    assert!(
        error.contains(path) && !error.contains("hunter2"),
        "{error}"
    );
    assert!(!root.path().join("etc/mesh-test").exists());

    // 2. Sealed for this node and path: written 0600.
    publish_raw(
        &ch,
        env.signer(),
        &node,
        &publish(2, vec![sealed_for(node.as_str(), 2)?]),
    )
    .await?;
    let r = wait_report(&mut reports, "applied generation 2", |r| {
        applied(r).is_some_and(|a| a.generation == Some(2))
    })
    .await?;
    let a = applied(&r).unwrap();
    assert_eq!(a.outcome, Outcome::Applied, "{a:?}");
    let written = root.path().join("etc/mesh-test/db.password");
    assert_eq!(std::fs::read_to_string(&written)?, "hunter2\n");
    assert_eq!(mode_of(&written), 0o600);

    // 3. The grant is revoked: the next generation has no secret, the file goes.
    publish_raw(&ch, env.signer(), &node, &publish(3, vec![])).await?;
    let r = wait_report(&mut reports, "applied generation 3", |r| {
        applied(r).is_some_and(|a| a.generation == Some(3))
    })
    .await?;
    assert_eq!(applied(&r).unwrap().outcome, Outcome::Applied);
    assert!(!written.exists());
    assert!(root.path().join("etc/mesh-test/app.conf").exists());
    let _ = stop.send(());
    timeout(Duration::from_secs(15), agent)
        .await
        .context("agent did not stop")???;

    // 4. A restart keeps the key it made.
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let agent = tokio::spawn(mesh_host_agent::run(config(), async {
        let _ = stopped.await;
    }));
    let r = wait_report(&mut reports, "hello after restart", |r| {
        r.kind.as_deref() == Some("hello") && r.envelope.seq > hello.envelope.seq
    })
    .await?;
    let Report::Hello(h) = &r.envelope.body else {
        bail!("not a hello")
    };
    assert_eq!(h.seal_key.as_deref(), Some(stated.as_str()));
    let _ = stop.send(());
    timeout(Duration::from_secs(15), agent)
        .await
        .context("agent did not stop")???;
    drop(reports);
    let _ = admin.close(200, "done".into()).await;
    env.teardown().await
}

/// The mesh's endpoints (decision 0044): an inventory section's `endpoints`
/// is kept in the store once applied; a later one naming an endpoint that is
/// not a host:port is rejected whole, naming it, and nothing of it is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declared_endpoints_are_kept_and_an_invalid_one_is_rejected() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let creds = env.add_node("ep").await?;
    let node = creds.node.clone();
    let (admin, ch, mut reports) = controller_side(&env).await?;
    let state = tempfile::tempdir()?;
    let root = mesh_testkit::units_tempdir()?;
    creds.write_to(state.path())?;
    let config = Config {
        state_dir: state.path().to_owned(),
        root: root.path().to_owned(),
        heartbeat_interval: Duration::from_millis(300),
        hostname: Some("test-host".into()),
        ..Config::default()
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let agent = tokio::spawn(mesh_host_agent::run(config, async {
        let _ = stopped.await;
    }));
    wait_report(&mut reports, "hello", |r| {
        r.kind.as_deref() == Some("hello")
    })
    .await?;
    declaration_queue_for(&ch, &node).await?;
    let kept = || -> anyhow::Result<serde_json::Value> {
        let store: serde_json::Value =
            serde_json::from_slice(&std::fs::read(state.path().join("store.json"))?)?;
        Ok(store["endpoints"].clone())
    };
    let inventory = |generation: u64, brokers: serde_json::Value| {
        serde_json::json!({
            "v": 1, "id": uuid::Uuid::now_v7(), "kind": "declaration", "node": node.as_str(),
            "seq": generation, "sent_at": "2026-11-30T12:00:00Z",
            "body": {"section": "inventory", "generation": generation,
                     "items": {"files": [], "endpoints": {
                         "brokers": brokers, "api": ["https://ctl.example:7443"]}}},
        })
    };

    let first = inventory(1, serde_json::json!(["127.0.0.1:5673", "[::1]:5674"]));
    publish_raw(&ch, env.signer(), &node, first.to_string().as_bytes()).await?;
    let r = wait_report(&mut reports, "applied inventory generation 1", |r| {
        applied(r).is_some_and(|a| a.section == Some(Section::Inventory))
    })
    .await?;
    assert_eq!(applied(&r).unwrap().outcome, Outcome::Applied);
    let want = serde_json::json!({
        "brokers": ["127.0.0.1:5673", "[::1]:5674"],
        "api": ["https://ctl.example:7443"],
    });
    assert_eq!(kept()?, want);

    let bad = inventory(2, serde_json::json!(["127.0.0.1:5675", "amqp://h:1"]));
    publish_raw(&ch, env.signer(), &node, bad.to_string().as_bytes()).await?;
    let r = wait_report(&mut reports, "inventory generation 2 rejected", |r| {
        applied(r).is_some_and(|a| a.outcome == Outcome::Rejected)
    })
    .await?;
    let a = applied(&r).unwrap();
    let error = a.error.as_deref().unwrap_or_default();
    assert!(
        error.contains("body.items.endpoints.brokers[1]") && error.contains("amqp://h:1"),
        "{error}"
    );
    assert_eq!(kept()?, want, "nothing of a rejected declaration is kept");

    let _ = stop.send(());
    timeout(Duration::from_secs(15), agent)
        .await
        .context("agent did not stop")???;
    drop(reports);
    let _ = admin.close(200, "done".into()).await;
    env.teardown().await
}

/// A unit hammering at its pids limit (issue 30) does not stop its node from
/// answering: the agent's heartbeats keep their interval while the unit's
/// every fork past the limit fails. The hammer is bounded (at most 400
/// children, 8 s) so that a broken limit could not hurt the machine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unit_at_its_pids_limit_leaves_the_heartbeats_on_time() -> anyhow::Result<()> {
    use mesh_protocol::{DesiredState, RestartPolicy, UnitItem, UnitLimits, UnitState};
    if !rustix::process::geteuid().is_root() {
        return mesh_testkit::skip("the pids limit needs root (cgroups)");
    }
    let env = TestEnv::new().await?;
    let creds = env.add_node("bomb").await?;
    let node = creds.node.clone();
    let (admin, ch, mut reports) = controller_side(&env).await?;
    declaration_queue_for(&ch, &node).await?;
    let state = tempfile::tempdir()?;
    let root = mesh_testkit::units_tempdir()?;
    creds.write_to(state.path())?;
    let interval = Duration::from_millis(500);
    let config = Config {
        state_dir: state.path().to_owned(),
        root: root.path().to_owned(),
        heartbeat_interval: interval,
        reconnect_min: Duration::from_millis(50),
        reconnect_max: Duration::from_millis(400),
        units: mesh_host_agent::units::UnitsConfig {
            shim_program: Some(env!("CARGO_BIN_EXE_mesh-agent").into()),
            ..Default::default()
        },
        ..Config::default()
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let agent = tokio::spawn(mesh_host_agent::run(config, async {
        let _ = stopped.await;
    }));
    const HAMMER: &str = "import os, time\n\
        end, n, refused = time.time() + 8, 0, 0\n\
        while time.time() < end and n < 400:\n    \
            try:\n        \
                if os.fork() == 0:\n            \
                    time.sleep(30)\n            \
                    os._exit(0)\n        \
                n += 1\n    \
            except OSError:\n        \
                refused += 1\n\
        print('forked', n, 'refused', refused, flush=True)\n\
        time.sleep(1000)\n";
    let bomb = UnitItem {
        name: "bomb".into(),
        module: "bombmod".into(),
        command: "/usr/bin/python3".into(),
        args: vec!["-c".into(), HAMMER.into()],
        env: Default::default(),
        working_dir: None,
        restart: RestartPolicy::Never,
        desired: DesiredState::Running,
        probes: Vec::new(),
        artifact: None,
        revision: None,
        user: Default::default(),
        limits: UnitLimits {
            pids: Some(32),
            ..Default::default()
        },
        stateful: false,
    };
    let decl = Declaration {
        section: Section::Inventory,
        generation: 1,
        items: DeclarationItems {
            units: vec![bomb],
            ..Default::default()
        },
    };
    publish_raw(
        &ch,
        env.signer(),
        &node,
        &Envelope::new(node.clone(), 1, decl).encode(),
    )
    .await?;
    wait_report(&mut reports, "units report: the bomb running", |r| {
        units_of(r).is_some_and(|u| {
            u.iter()
                .any(|s| s.name == "bomb" && s.state == UnitState::Running)
        })
    })
    .await?;
    // Heartbeats while it hammers: none late.
    let mut beats = Vec::new();
    let until = Instant::now() + Duration::from_secs(6);
    while Instant::now() < until {
        let r = wait_report(&mut reports, "a heartbeat", |r| {
            r.kind.as_deref() == Some("heartbeat")
        })
        .await?;
        assert_eq!(r.user_id.as_deref(), Some(node.as_str()));
        beats.push(Instant::now());
    }
    let worst = beats
        .windows(2)
        .map(|w| w[1] - w[0])
        .max()
        .context("at least two heartbeats")?;
    anyhow::ensure!(
        worst <= interval * 3,
        "a heartbeat came {worst:?} after the one before (interval {interval:?})"
    );
    // It was at its limit, refused forks all along.
    let log = state.path().join("units/bomb/stdout.log");
    let until = Instant::now() + DEADLINE;
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains("forked")
    {
        anyhow::ensure!(Instant::now() < until, "the hammer never said what it did");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let said = std::fs::read_to_string(&log)?;
    anyhow::ensure!(said.starts_with("forked 31 refused "), "{said}");
    anyhow::ensure!(!said.contains("refused 0\n"), "{said}");

    let _ = stop.send(());
    timeout(Duration::from_secs(15), agent)
        .await
        .context("agent did not stop")???;
    mesh_host_agent::units::drain_local(&state.path().join("units"), Duration::from_secs(2)).await;
    drop(reports);
    let _ = admin.close(200, "done".into()).await;
    env.teardown().await
}
