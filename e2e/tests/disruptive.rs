//! The fault suite, part two: restarts of the machine's PostgreSQL and RabbitMQ.
//! They cut every test sharing those services, so every test here is
//! `#[ignore]`d and `bundle/test` runs them alone, one at a time, after the rest:
//!
//! ```sh
//! cargo test -p mesh-e2e --test disruptive -- --ignored --test-threads=1
//! ```
//!
//! Restarts use the Debian tools present wherever `bundle/up` ran:
//! `pg_ctlcluster --skip-systemctl-redirect <ver> main restart -m fast` and
//! `rabbitmqctl stop_app` / `start_app` (every connection closed; durable queues
//! and persistent messages kept).

use std::time::Duration;

use mesh_e2e::sim::{
    SimNode, add_nodes, broker_connections, broker_sockets_limit, confirmed, connect_all,
    inbox_count, metric_sum, metrics, queue_depth, restart_broker, restart_postgres, scalar,
    wait_scalar,
};
use mesh_e2e::{Mesh, wait_for};
use mesh_protocol::Section;
use serde_json::json;

/// How long the controller may take to absorb 1,000 nodes reconnecting at once
/// (each a hello and a heartbeat) after a broker restart, counted from the
/// broker being up. Documented in docs/benchmarks.md ("Thundering herd").
const HERD_BOUND: Duration = Duration::from_secs(45);

/// PostgreSQL restarts (fast shutdown: every session cut) while 10,000 reports
/// stream in. The controller holds its batch and retries it in place, does not
/// acknowledge what it could not commit, keeps its broker session, refuses
/// nothing, and after the restart applies every report.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "restarts PostgreSQL: run alone (bundle/test does)"]
async fn a_database_restart_mid_stream_loses_nothing() -> anyhow::Result<()> {
    let mesh = Mesh::start().await?;
    let creds = add_nodes(&mesh.env, "d", 20).await?;
    let mut nodes = connect_all(creds, 16).await?;
    let mut ids = Vec::new();
    let mut confirms = Vec::new();
    for n in &mut nodes {
        let h = n.hello(&[]);
        ids.push(h.id);
        confirms.push(n.send(&h).await?);
    }
    confirmed(confirms).await?;
    let publisher = tokio::spawn(async move {
        let mut ids = Vec::new();
        let mut tick = tokio::time::interval(Duration::from_millis(20));
        for _ in 0..500 {
            tick.tick().await;
            let mut confirms = Vec::new();
            for n in &mut nodes {
                let a = n.applied(Section::Config, 1);
                ids.push(a.id);
                confirms.push(n.send(&a).await?);
            }
            confirmed(confirms).await?;
        }
        for n in nodes {
            n.close().await;
        }
        anyhow::Ok(ids)
    });
    tokio::time::sleep(Duration::from_secs(3)).await;
    let took = restart_postgres(&mesh.env).await?;
    eprintln!("PostgreSQL restarted in {took:?}");
    // The outage happened in the middle of the stream, not after it.
    assert!(
        !publisher.is_finished(),
        "the stream ended before the database came back; the test proved nothing"
    );
    ids.extend(publisher.await??);
    assert_eq!(ids.len(), 20 * 501);

    // inventory handles every report; config only the 20 hellos (applied
    // reports are inventory's record: decision 0015).
    for (context, expected) in [("inventory", ids.len()), ("config", 20)] {
        wait_for(
            &format!("every report in the {context} inbox"),
            Duration::from_secs(120),
            || async {
                Ok((inbox_count(&mesh.env, context, &ids).await? == expected as i64).then_some(()))
            },
        )
        .await?;
    }
    assert_eq!(
        queue_depth(&mesh.env, "dead-letter").await?,
        0,
        "nothing refused"
    );
    let text = metrics(&mesh).await?;
    // Whether a batch had to be retried depends on timing: a pool that finds
    // its connections dead waits (acquire timeout) for new ones, and a restart
    // shorter than that wait is ridden out without an error. Either way nothing
    // may be lost or refused, and the broker session must hold.
    eprintln!(
        "batches retried during the outage: {}",
        metric_sum(&text, "mesh_controller_batches_retried_total", "")
    );
    assert_eq!(
        metric_sum(&text, "mesh_controller_broker_connects_total", ""),
        1.0,
        "the broker session was dropped instead of holding the batch"
    );
    mesh.teardown().await
}

/// RabbitMQ's application stops for 4 s and starts again while an operator
/// changes a file 30 times for 8 real agents. Agents and controller reconnect
/// with jittered backoff (their reconnect times spread), every agent ends with
/// the newest file, every node's applied report for the newest generation
/// arrives (nothing lost: the relay keeps unconfirmed rows, the agent keeps
/// unconfirmed reports), and heartbeats flow again.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "restarts RabbitMQ: run alone (bundle/test does)"]
async fn a_broker_restart_mid_stream_loses_no_declaration_nor_applied_report() -> anyhow::Result<()>
{
    let mut mesh = Mesh::start().await?;
    let mut agents = Vec::new();
    for i in 0..8 {
        agents.push(mesh.add_agent(&format!("b{i}"), &[("role", "web")]).await?);
    }
    let file = |n: usize| json!({"path": "/etc/app.conf", "content": format!("version {n}"), "mode": "0644", "selector": {"role": "web"}});
    let (status, body) = mesh.put("/v1/files/app", &file(0)).await?;
    assert!(status < 300, "{status} {body}");
    let has = |mesh: &Mesh, n: usize| {
        agents.iter().all(|a| {
            std::fs::read_to_string(mesh.agent(a).file("/etc/app.conf"))
                .map(|t| t == format!("version {n}"))
                .unwrap_or(false)
        })
    };
    wait_for(
        "every agent to have version 0",
        Duration::from_secs(60),
        || {
            let ok = has(&mesh, 0);
            async move { Ok(ok.then_some(())) }
        },
    )
    .await?;

    let before_restart = std::time::SystemTime::now();
    let changes = async {
        for n in 1..=30 {
            tokio::time::sleep(Duration::from_millis(300)).await;
            // The API stays up while the broker is down: changes are stored and
            // wait in the outbox.
            let (status, body) = mesh.put("/v1/files/app", &file(n)).await?;
            anyhow::ensure!(status < 300, "{status} {body}");
        }
        anyhow::Ok(())
    };
    let restart = async {
        tokio::time::sleep(Duration::from_secs(2)).await;
        restart_broker(Duration::from_secs(4)).await
    };
    let (changed, up) = tokio::join!(changes, restart);
    changed?;
    let up = up?;
    let up_wall = std::time::SystemTime::now() - up.elapsed();

    wait_for(
        "every agent to have version 30",
        Duration::from_secs(90),
        || {
            let ok = has(&mesh, 30);
            async move { Ok(ok.then_some(())) }
        },
    )
    .await?;
    wait_for(
        "every node's applied report for the newest generation",
        Duration::from_secs(60),
        || async {
            // Declared by config, applied as inventory recorded it: the node view.
            for a in &agents {
                let (status, view) = mesh.get(&format!("/v1/nodes/{a}")).await?;
                anyhow::ensure!(status == 200, "GET node: {status} {view}");
                let config = &view["sections"]["config"];
                if config["declared"].is_null() || config["applied"] != config["declared"] {
                    return Ok(None);
                }
            }
            Ok(Some(()))
        },
    )
    .await?;
    let sections = scalar(&mesh.env, "config", "SELECT count(*) FROM config.sections").await?;
    assert_eq!(sections, 8);

    // Reconnect times: after the broker came back, spread by jitter.
    let epoch_ms = |t: std::time::SystemTime| {
        t.duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0)
    };
    // The management API lists connections from statistics sampled every few
    // seconds: wait until every agent's new connection is listed.
    let after = epoch_ms(before_restart);
    let conns = wait_for(
        "every agent's new connection to be listed",
        // The listing comes from statistics, up to one interval (30 s) late.
        Duration::from_secs(90),
        || async {
            let conns = broker_connections(&mesh.env).await?;
            let fresh = conns
                .iter()
                .filter(|(user, at)| agents.contains(user) && *at >= after)
                .count();
            Ok((fresh == agents.len()).then_some(conns))
        },
    )
    .await?;
    let mut agent_times: Vec<u64> = conns
        .iter()
        .filter(|(user, at)| agents.contains(user) && *at >= after)
        .map(|(_, at)| *at)
        .collect();
    agent_times.sort_unstable();
    eprintln!(
        "agent reconnects, ms after the broker was up: {:?}",
        agent_times
            .iter()
            .map(|t| *t as i64 - epoch_ms(up_wall) as i64)
            .collect::<Vec<_>>()
    );
    assert!(
        !conns
            .iter()
            .any(|(user, at)| agents.contains(user) && *at < after),
        "an agent kept a connection from before the restart: {conns:?}"
    );
    let spread = agent_times[7] - agent_times[0];
    assert!(
        spread >= 250,
        "agents reconnected within {spread} ms of each other: no jitter?"
    );
    let controller_user = mesh.env.names().controller_user.clone();
    assert!(
        conns
            .iter()
            .any(|(u, at)| *u == controller_user && *at + 1000 >= epoch_ms(before_restart)),
        "the controller reconnected: {conns:?}"
    );
    // Heartbeats flow again: every node was seen after the broker came back.
    wait_scalar(
        &mesh.env,
        "heartbeats after the restart",
        "inventory",
        "SELECT count(*) FROM inventory.nodes WHERE last_seen < now() - interval '3 seconds'",
        0,
        Duration::from_secs(30),
    )
    .await?;
    assert_eq!(
        queue_depth(&mesh.env, "dead-letter").await?,
        0,
        "nothing refused"
    );
    mesh.teardown().await
}

/// 1,000 simulated nodes (each its own broker user and connection) reconnect all
/// at once, without jitter, after a broker restart, each sending a hello and a
/// heartbeat: the controller absorbs the herd within [`HERD_BOUND`].
#[tokio::test(flavor = "multi_thread")]
#[ignore = "restarts RabbitMQ: run alone (bundle/test does)"]
async fn a_thousand_nodes_reconnecting_at_once_are_absorbed() -> anyhow::Result<()> {
    const HERD: usize = 1000;
    let mesh = Mesh::start().await?;
    let limit = broker_sockets_limit(&mesh.env).await?;
    anyhow::ensure!(
        limit >= HERD as u64 + 100,
        "the broker may hold only {limit} sockets, fewer than {HERD} nodes need: \
         start it with a higher file limit (bundle/up does: ulimit -n 65536)"
    );
    let creds = add_nodes(&mesh.env, "h", HERD).await?;
    let mut nodes = connect_all(creds.clone(), 50).await?;
    let mut confirms = Vec::new();
    for n in &mut nodes {
        let h = n.hello(&[]);
        confirms.push(n.send(&h).await?);
    }
    confirmed(confirms).await?;
    wait_for(
        "every node to be known",
        Duration::from_secs(120),
        || async {
            let n = scalar(
                &mesh.env,
                "inventory",
                "SELECT count(*) FROM inventory.nodes",
            )
            .await?;
            Ok((n == HERD as i64).then_some(()))
        },
    )
    .await?;

    let up = restart_broker(Duration::from_secs(2)).await?;
    drop(nodes);
    // The herd: every node at once, no jitter (the worst case, not what agents do).
    let herd = futures_util::future::join_all(creds.into_iter().map(|c| async move {
        let mut n = SimNode::connect(c).await?;
        let h = n.hello(&[]);
        let hb = n.heartbeat(Default::default());
        confirmed(vec![n.send(&h).await?, n.send(&hb).await?]).await?;
        anyhow::Ok((n, h.id))
    }))
    .await;
    let connected = up.elapsed();
    let mut ids = Vec::with_capacity(HERD);
    let mut nodes = Vec::with_capacity(HERD);
    for r in herd {
        let (n, id) = r?;
        ids.push(id);
        nodes.push(n);
    }
    wait_for("the controller to absorb the herd", HERD_BOUND, || async {
        Ok((inbox_count(&mesh.env, "inventory", &ids).await? == HERD as i64).then_some(()))
    })
    .await?;
    wait_for("the heartbeat queue to drain", HERD_BOUND, || async {
        Ok((queue_depth(&mesh.env, "reports.heartbeat").await? == 0).then_some(()))
    })
    .await?;
    let absorbed = up.elapsed();
    eprintln!(
        "herd of {HERD}: all reconnected and published {connected:?} after the broker was up; \
         absorbed after {absorbed:?} (bound {HERD_BOUND:?})"
    );
    assert!(absorbed <= HERD_BOUND);
    for n in nodes {
        n.close().await;
    }
    mesh.teardown().await
}

/// PostgreSQL restarts under a running controller: the fence's session
/// (docs/decisions/0017) goes with it. The controller takes the fence again
/// without dropping its broker session, and is still the only one: a second
/// controller started afterwards is refused, naming it.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "restarts PostgreSQL: run alone (bundle/test does)"]
async fn a_database_restart_keeps_the_controller_fenced() -> anyhow::Result<()> {
    use anyhow::Context as _;
    let mut mesh = Mesh::start().await?;
    let pid = mesh
        .controller()
        .map(|p| p.pid())
        .context("no controller")?;
    let took = restart_postgres(&mesh.env).await?;
    eprintln!("PostgreSQL restarted in {took:?}");
    wait_for(
        "the controller to take its fence again",
        Duration::from_secs(60),
        || async {
            Ok(mesh
                .controller_log()
                .contains("controller fence taken again")
                .then_some(()))
        },
    )
    .await?;
    mesh.wait_healthy().await?;
    let text = metrics(&mesh).await?;
    assert_eq!(
        metric_sum(&text, "mesh_controller_broker_connects_total", ""),
        1.0,
        "the broker session was dropped for the fence"
    );
    let second = tokio::process::Command::new(mesh_e2e::bin("mesh-controller")?)
        .arg("--config")
        .arg(mesh.dir.path().join("controller.toml"))
        .arg("run")
        .arg("--api-listen")
        .arg("127.0.0.1:0")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let out = tokio::time::timeout(Duration::from_secs(30), second.wait_with_output())
        .await
        .context("the second controller did not exit")??;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the second controller ran: {stderr}");
    assert!(
        stderr.contains("another controller is running") && stderr.contains(&format!("pid={pid} ")),
        "the refusal does not name the running controller: {stderr}"
    );
    mesh.teardown().await
}

/// Heartbeats are transient (decision 0023): a broker restart loses the ones
/// queued, and no heartbeat flows while it is down. That is harmless only
/// because no node is judged on them: the controller judges nobody until a
/// full grace after its broker session is back. Here the broker stays down
/// longer than the grace, under a fleet running a module; afterwards no node
/// was ever unreachable (sampled throughout, and no `inventory.node.unreachable`
/// event on the record) and no replica moved.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "restarts RabbitMQ: run alone (bundle/test does)"]
async fn a_broker_restart_under_a_fleet_marks_no_node_unreachable_and_moves_no_replica()
-> anyhow::Result<()> {
    const GRACE: Duration = Duration::from_secs(6);
    let mut mesh = Mesh::prepare().await?;
    // A grace of 6 s (heartbeats every second); agents reconnect within a
    // second of the broker's return, so each is heard well inside the grace
    // that follows it.
    let path = mesh.dir.path().join("controller.toml");
    let toml =
        std::fs::read_to_string(&path)?.replace("grace_intervals = 3", "grace_intervals = 6");
    std::fs::write(&path, toml)?;
    mesh.agent_toml = Some("reconnect_max = \"1s\"\n".into());
    mesh.start_controller(&[]).await?;
    let mut agents = Vec::new();
    for i in 0..5 {
        agents.push(mesh.add_agent(&format!("f{i}"), &[("role", "web")]).await?);
    }
    let spec = json!({
        "unit": {"command": "sleep", "args": ["1000"]},
        "placement": {"match_labels": {"labels": {"role": "web"}, "replicas": 3}}
    });
    let (status, _, body) = mesh
        .request(reqwest::Method::PUT, "/v1/modules/steady", &[], Some(&spec))
        .await?;
    anyhow::ensure!(status == 201, "PUT module: {status} {body}");
    let placed = || running_replicas(&mesh, "steady");
    let before = wait_for("3 running replicas", Duration::from_secs(60), || async {
        let running = placed().await?;
        Ok((running.len() == 3).then_some(running))
    })
    .await?;

    let unreachable_now = || {
        scalar(
            &mesh.env,
            "inventory",
            "SELECT count(*) FROM inventory.nodes WHERE state <> 'alive'",
        )
    };
    let down = GRACE + Duration::from_secs(4);
    let restart = restart_broker(down);
    let watch = async {
        // Sampled every 100 ms while the broker is down and restarting.
        let mut worst = 0;
        let deadline = tokio::time::Instant::now() + down + Duration::from_secs(3);
        while tokio::time::Instant::now() < deadline {
            worst = worst.max(unreachable_now().await?);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        anyhow::Ok(worst)
    };
    let (up, worst) = tokio::join!(restart, watch);
    let up = up?;
    let mut worst = worst?;
    // Then for two graces after the broker is back: past the first judgement.
    while up.elapsed() < GRACE * 2 {
        worst = worst.max(unreachable_now().await?);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(worst, 0, "a node was judged unreachable across the restart");
    // Every node was heard after the broker came back.
    nobody_judged_and_nothing_moved(&mesh, "steady", &before, 3).await?;
    mesh.teardown().await
}

/// A resource alarm (memory above the watermark, a full disk) makes the
/// broker block every publishing connection while every session stays up:
/// no agent's heartbeat reaches it, and the controller, still consuming,
/// hears nobody. Found by the fleet soak (issue 32, seed 42): every node
/// not otherwise faulted was judged unreachable three seconds into a disk
/// alarm. The controller's probe publish (`controller/src/probe.rs`) is not
/// confirmed either, so observation stops: through an alarm four graces
/// long no node is ever unreachable (sampled throughout, and no
/// `inventory.node.unreachable` on the record), no replica moves, and after
/// it every node is heard again.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "raises a broker resource alarm: run alone (bundle/test does)"]
async fn a_broker_resource_alarm_marks_no_node_unreachable_and_moves_no_replica()
-> anyhow::Result<()> {
    use mesh_e2e::sim::BrokerLimits;
    const GRACE: Duration = Duration::from_secs(3);
    let mut mesh = Mesh::start().await?;
    for i in 0..3 {
        mesh.add_agent(&format!("alarm{i}"), &[("role", "web")])
            .await?;
    }
    let spec = json!({
        "unit": {"command": "sleep", "args": ["1000"]},
        "placement": {"match_labels": {"labels": {"role": "web"}, "replicas": 2}}
    });
    let (status, _, body) = mesh
        .request(
            reqwest::Method::PUT,
            "/v1/modules/alarmed",
            &[],
            Some(&spec),
        )
        .await?;
    anyhow::ensure!(status == 201, "PUT module: {status} {body}");
    let placed = || running_replicas(&mesh, "alarmed");
    let before = wait_for("2 running replicas", Duration::from_secs(60), || async {
        let running = placed().await?;
        Ok((running.len() == 2).then_some(running))
    })
    .await?;
    let unreachable_now = || {
        scalar(
            &mesh.env,
            "inventory",
            "SELECT count(*) FROM inventory.nodes WHERE state <> 'alive'",
        )
    };

    let limits = BrokerLimits::read()?;
    BrokerLimits::alarm_memory()?;
    let alarmed = async {
        let mut worst = 0;
        let until = tokio::time::Instant::now() + GRACE * 4;
        while tokio::time::Instant::now() < until {
            worst = worst.max(unreachable_now().await?);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        anyhow::Ok(worst)
    }
    .await;
    let blocked = metric_sum(
        &metrics(&mesh).await?,
        "mesh_controller_broker_publishing_blocked",
        "",
    );
    // The broker's limits come back whatever the test saw.
    limits.restore()?;
    let mut worst = alarmed?;
    let lifted = tokio::time::Instant::now();
    while lifted.elapsed() < GRACE * 2 {
        worst = worst.max(unreachable_now().await?);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(worst, 0, "a node was judged unreachable during the alarm");
    assert_eq!(
        blocked, 1.0,
        "the controller did not notice the blocked broker"
    );
    nobody_judged_and_nothing_moved(&mesh, "alarmed", &before, 2).await?;
    wait_for(
        "the probe confirmed again",
        Duration::from_secs(30),
        || async {
            let text = metrics(&mesh).await?;
            Ok(
                (metric_sum(&text, "mesh_controller_broker_publishing_blocked", "") == 0.0)
                    .then_some(()),
            )
        },
    )
    .await?;
    mesh.teardown().await
}

/// The broker stops for a while under two agents (issue 13): the controller
/// itself stays up, but each node could not reach it. After the broker is
/// back, each agent's first hello states the outage it lived through, and
/// the `controller_unreachable` alert names both nodes and what each saw.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "restarts RabbitMQ: run alone (bundle/test does)"]
async fn a_broker_outage_is_alerted_as_the_controller_unreachable_from_each_node()
-> anyhow::Result<()> {
    let mut mesh = Mesh::prepare().await?;
    let path = mesh.dir.path().join("controller.toml");
    let toml =
        std::fs::read_to_string(&path)?.replace("grace_intervals = 3", "grace_intervals = 10");
    std::fs::write(&path, toml)?;
    mesh.agent_toml = Some("reconnect_max = \"1s\"\n".into());
    mesh.start_controller(&[]).await?;
    let a = mesh.add_agent("oa", &[]).await?;
    let b = mesh.add_agent("ob", &[]).await?;
    for n in [&a, &b] {
        wait_for(&format!("{n} known"), Duration::from_secs(30), || async {
            let (status, _) = mesh.get(&format!("/v1/nodes/{n}")).await?;
            Ok((status == 200).then_some(()))
        })
        .await?;
    }
    restart_broker(Duration::from_secs(5)).await?;
    let alert = wait_for(
        "the controller_unreachable alert naming both nodes",
        Duration::from_secs(60),
        || async {
            let (status, v) = mesh.get("/v1/alerts?kind=controller_unreachable").await?;
            anyhow::ensure!(status == 200, "GET /v1/alerts: {status} {v}");
            Ok(v["alerts"].as_array().and_then(|list| {
                list.iter()
                    .find(|x| {
                        let m = x["message"].as_str().unwrap_or_default();
                        m.contains(a.as_str()) && m.contains(b.as_str())
                    })
                    .cloned()
            }))
        },
    )
    .await?;
    assert_eq!(alert["subject"], "controller", "{alert}");
    let message = alert["message"].as_str().unwrap_or_default();
    assert!(message.starts_with("2 nodes could not reach"), "{message}");
    assert!(message.contains("reports buffered"), "{message}");
    // Each outage is at least as long as the broker was away (5 s), as the
    // node saw it; the sentence says "for <n> s".
    for n in [&a, &b] {
        let part = message
            .split("; ")
            .find(|p| p.contains(n.as_str()))
            .unwrap_or_default();
        let secs: u64 = part
            .split(" for ")
            .nth(1)
            .and_then(|r| r.split(' ').next())
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        assert!(secs >= 4, "{n}'s outage: {part}");
    }
    mesh.teardown().await
}

/// `module`'s active replicas that run, as (replica, node), sorted.
async fn running_replicas(mesh: &Mesh, module: &str) -> anyhow::Result<Vec<(u64, String)>> {
    let (status, view) = mesh.get(&format!("/v1/modules/{module}")).await?;
    anyhow::ensure!(status == 200, "GET module: {status} {view}");
    let mut running: Vec<(u64, String)> = view["assignments"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter(|a| a["role"] == "active" && a["unit_state"] == "running")
        .map(|a| {
            (
                a["replica"].as_u64().unwrap_or(0),
                a["node"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    running.sort();
    Ok(running)
}

/// After a broker fault under a fleet: no `inventory.node.unreachable` on the
/// record, every node heard again (within `heard_secs` of now), and
/// `module`'s running replicas where they were (`before`).
async fn nobody_judged_and_nothing_moved(
    mesh: &Mesh,
    module: &str,
    before: &[(u64, String)],
    heard_secs: u32,
) -> anyhow::Result<()> {
    let events = scalar(
        &mesh.env,
        "inventory",
        "SELECT count(*) FROM inventory.outbox WHERE routing_key = 'inventory.node.unreachable'",
    )
    .await?;
    assert_eq!(events, 0, "an unreachable event was recorded");
    wait_scalar(
        &mesh.env,
        "every node heard after the fault",
        "inventory",
        &format!(
            "SELECT count(*) FROM inventory.nodes WHERE heard_at < now() - interval '{heard_secs} seconds'"
        ),
        0,
        Duration::from_secs(30),
    )
    .await?;
    assert_eq!(
        running_replicas(mesh, module).await?,
        before,
        "a replica moved"
    );
    Ok(())
}
