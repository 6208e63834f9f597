//! One controller, fenced (docs/decisions/0017-one-controller-fenced.md): a
//! second controller started with the same credentials refuses to run and
//! leaves no trace; the first one SIGKILLed, a new one starts and nothing is
//! lost or doubled; a controller that loses its lock's session takes it again,
//! or stops when another took it; report queues an older controller declared
//! are upgraded to single-active-consumer without losing a report.

use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context as _, anyhow};
use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use mesh_e2e::sim::{
    add_nodes, confirmed, connect_all, inbox_count, queue_depth, scalar, wait_scalar,
};
use mesh_e2e::{Mesh, bin, wait_for};
use mesh_protocol::topology::{
    HEALTH_QUEUE_MAX_LEN, HEARTBEAT_QUEUE_MAX_LEN, REPORT_QUEUE_MAX_LEN, UNITS_QUEUE_MAX_LEN,
    report_queue,
};
use mesh_protocol::{ReportKind, Section};
use serde_json::{Value, json};
use uuid::Uuid;

/// The fence's advisory lock key as `pg_locks` shows it (controller/src/fence.rs).
const LOCK_CLASSID: i64 = 0x6d65_7368;
const LOCK_OBJID: i64 = 1;

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

/// What a controller run by hand printed, and how it ended.
struct Run {
    status: std::process::ExitStatus,
    stdout: String,
    stderr: String,
    api_port: u16,
}

/// Run another `mesh-controller run` with the mesh's credentials file (the same
/// credentials as the running one) and its own API port; it must exit by itself
/// within `within`.
async fn another_controller(mesh: &Mesh, within: Duration) -> anyhow::Result<Run> {
    let api_port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let config = mesh.dir.path().join(format!("controller-{api_port}.toml"));
    std::fs::write(
        &config,
        format!(
            "credentials = {:?}\napi_listen = \"127.0.0.1:{api_port}\"\n",
            mesh.dir.path().join("credentials.toml")
        ),
    )?;
    let child = tokio::process::Command::new(bin("mesh-controller")?)
        .arg("--config")
        .arg(&config)
        .arg("run")
        .env("RUST_LOG", "info,mesh_controller=debug")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context("spawning a second mesh-controller")?;
    let out = tokio::time::timeout(within, child.wait_with_output())
        .await
        .map_err(|_| anyhow!("the second controller did not exit within {within:?}"))??;
    Ok(Run {
        status: out.status,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        api_port,
    })
}

/// The refused controller named the holder and did nothing at all.
fn assert_refused(run: &Run, holder_pid: u32) {
    let all = format!("{}\n{}", run.stdout, run.stderr);
    assert!(!run.status.success(), "the second controller ran: {all}");
    for wanted in [
        "another controller is running".to_owned(),
        format!("host={}", hostname()),
        format!("pid={holder_pid}"),
        "since=20".to_owned(),
    ] {
        assert!(
            run.stderr.contains(&wanted),
            "stderr does not name `{wanted}`:\n{}",
            run.stderr
        );
    }
    for never in [
        "migrations applied",
        "API listening",
        "broker session started",
        "consuming",
        "controller fence taken",
    ] {
        assert!(
            !all.contains(never),
            "the second controller got to `{never}`:\n{all}"
        );
    }
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", run.api_port)).is_err(),
        "something listens on the second controller's API port"
    );
}

/// Consumers on `queue` right now (passive declare as the vhost's admin).
async fn consumers(mesh: &Mesh, queue: &str) -> anyhow::Result<u32> {
    let conn = lapin::Connection::connect(&mesh.env.admin_amqp_url(), Default::default()).await?;
    let ch = conn.create_channel().await?;
    let q = ch
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    let _ = conn.close(200, "done".into()).await;
    Ok(q.consumer_count())
}

/// Sessions holding the fence's lock on the mesh's database (as the admin).
async fn fence_holders(mesh: &Mesh) -> anyhow::Result<Vec<(i32, String)>> {
    let pool = sqlx::PgPool::connect(&mesh.env.admin_database_url()).await?;
    let rows: Vec<(i32, Option<String>)> = sqlx::query_as(
        "SELECT l.pid, a.application_name FROM pg_locks l \
         LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
         WHERE l.locktype = 'advisory' AND l.granted \
           AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
           AND l.classid = $1::bigint::oid AND l.objid = $2::bigint::oid AND l.objsubid = 1",
    )
    .bind(LOCK_CLASSID)
    .bind(LOCK_OBJID)
    .fetch_all(&pool)
    .await?;
    pool.close().await;
    Ok(rows
        .into_iter()
        .map(|(pid, name)| (pid, name.unwrap_or_default()))
        .collect())
}

/// Rows of every context's migration history, as a fingerprint of "migrated".
async fn migration_rows(mesh: &Mesh) -> anyhow::Result<Vec<i64>> {
    let mut out = Vec::new();
    for ctx in ["inventory", "config", "identity", "connectivity"] {
        out.push(
            scalar(
                &mesh.env,
                ctx,
                &format!("SELECT count(*) FROM {ctx}.refinery_schema_history"),
            )
            .await?,
        );
    }
    Ok(out)
}

const NODES: usize = 20;
const ROUNDS: usize = 300;
const HELLO_EVERY: usize = 100;

/// Two controllers against one mesh: the second refuses (non-zero exit, its
/// stderr names host, pid and since of the first) and leaves nothing: no
/// consumer on any queue, no broker connection, no migration, no rows. The
/// first is SIGKILLed in the middle of a stream of reports; a new one, started
/// at once, takes the fence as soon as PostgreSQL ends the killed one's session,
/// and every report is handled exactly once.
#[tokio::test(flavor = "multi_thread")]
async fn a_second_controller_refuses_and_a_restored_one_loses_and_doubles_nothing()
-> anyhow::Result<()> {
    let mut mesh = Mesh::start().await?;
    let first_pid = mesh
        .controller()
        .map(|p| p.pid())
        .context("no controller")?;
    let (status, body) = mesh
        .put(
            "/v1/files/motd",
            &json!({"path": "/etc/motd", "content": "fenced", "mode": "0644", "selector": {"role": "sim"}}),
        )
        .await?;
    assert!(status < 300, "PUT file: {status} {body}");
    let creds = add_nodes(&mesh.env, "f", NODES).await?;
    let mut nodes = connect_all(creds, 8).await?;
    let mut ids: Vec<Uuid> = Vec::new();
    let mut confirms = Vec::new();
    for n in &mut nodes {
        let h = n.hello(&[("role", "sim")]);
        ids.push(h.id);
        confirms.push(n.send(&h).await?);
    }
    confirmed(confirms).await?;
    wait_for(
        "every node's config section to be declared",
        Duration::from_secs(60),
        || async {
            let n = scalar(&mesh.env, "config", "SELECT count(*) FROM config.sections").await?;
            Ok((n == NODES as i64).then_some(()))
        },
    )
    .await?;

    // The second controller, same credentials.
    let migrated = migration_rows(&mesh).await?;
    let second_started = std::time::SystemTime::now();
    let run = another_controller(&mesh, Duration::from_secs(30)).await?;
    assert_refused(&run, first_pid);
    eprintln!("the second controller said: {}", run.stderr.trim());
    // It left nothing: the first is the only consumer of every report queue,
    // the only controller connection is the first's, no migration ran again,
    // and the fence is still the first's.
    for kind in ReportKind::ALL {
        let q = report_queue(kind);
        assert_eq!(consumers(&mesh, &q).await?, 1, "consumers of {q}");
    }
    let started_ms = second_started
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis() as u64;
    let controller_user = &mesh.env.names().controller_user;
    let late: Vec<_> = mesh_e2e::sim::broker_connections(&mesh.env)
        .await?
        .into_iter()
        .filter(|(u, at)| u == controller_user && *at >= started_ms)
        .collect();
    assert!(
        late.is_empty(),
        "controller connections after the second started: {late:?}"
    );
    assert_eq!(migration_rows(&mesh).await?, migrated, "migration history");
    let holders = fence_holders(&mesh).await?;
    assert_eq!(holders.len(), 1, "{holders:?}");
    assert!(
        holders[0].1.contains(&format!("pid={first_pid} ")),
        "the fence is not the first controller's: {holders:?}"
    );

    // A stream of reports across a SIGKILL of the first controller.
    let publisher = tokio::spawn(async move {
        let mut ids = Vec::new();
        let mut tick = tokio::time::interval(Duration::from_millis(10));
        for round in 1..ROUNDS {
            tick.tick().await;
            let mut confirms = Vec::with_capacity(nodes.len());
            for n in &mut nodes {
                let env = if round.is_multiple_of(HELLO_EVERY) {
                    n.hello(&[("role", "sim")])
                } else {
                    n.applied(Section::Config, 1)
                };
                ids.push(env.id);
                confirms.push(n.send(&env).await?);
            }
            confirmed(confirms).await?;
        }
        for n in nodes {
            n.close().await;
        }
        anyhow::Ok(ids)
    });
    // In the middle of the stream (it lasts about 3 s): once the first has
    // handled some of it.
    wait_for(
        "the first controller to handle part of the stream",
        Duration::from_secs(30),
        || async {
            let n = scalar(
                &mesh.env,
                "inventory",
                "SELECT count(*) FROM inventory.inbox",
            )
            .await?;
            Ok((n > (NODES * 20) as i64).then_some(()))
        },
    )
    .await?;
    mesh.kill_controller();
    let killed = Instant::now();
    assert!(
        !publisher.is_finished(),
        "the stream ended before the kill; the test proved nothing"
    );
    // Started at once, as a supervisor would: if PostgreSQL has not ended the
    // killed one's session yet, the new one waits for it (its holder is a
    // controller of this host that no longer runs) instead of refusing.
    mesh.start_controller(&[]).await?;
    eprintln!(
        "a new controller healthy {:?} after the SIGKILL",
        killed.elapsed()
    );
    let new_pid = mesh
        .controller()
        .map(|p| p.pid())
        .context("no controller")?;
    let holders = fence_holders(&mesh).await?;
    assert!(
        holders.len() == 1 && holders[0].1.contains(&format!("pid={new_pid} ")),
        "the fence is not the new controller's: {holders:?}"
    );
    // The fence is the new one's now: another refusal names it.
    let run = another_controller(&mesh, Duration::from_secs(30)).await?;
    assert_refused(&run, new_pid);

    ids.extend(publisher.await??);
    assert_eq!(ids.len(), NODES * ROUNDS);
    // inventory handles every report; config only hellos (applied reports
    // are inventory's record: decision 0015), so its inbox holds the hellos.
    for (context, expected) in [
        ("inventory", ids.len()),
        ("config", NODES * ROUNDS.div_ceil(HELLO_EVERY)),
    ] {
        wait_for(
            &format!("every report in the {context} inbox"),
            Duration::from_secs(120),
            || async {
                let n = inbox_count(&mesh.env, context, &ids).await?;
                Ok((n == expected as i64).then_some(()))
            },
        )
        .await?;
    }
    for q in ["reports.hello", "reports.applied"] {
        wait_for(
            &format!("{q} to be empty"),
            Duration::from_secs(60),
            || async { Ok((queue_depth(&mesh.env, q).await? == 0).then_some(())) },
        )
        .await?;
    }
    assert_eq!(
        queue_depth(&mesh.env, "dead-letter").await?,
        0,
        "refused reports"
    );
    // Once: one node.joined per node, one config declaration per hello.
    let joined = scalar(
        &mesh.env,
        "inventory",
        "SELECT count(*) FROM inventory.outbox WHERE kind = 'node.joined'",
    )
    .await?;
    assert_eq!(joined, NODES as i64, "node.joined events");
    wait_scalar(
        &mesh.env,
        "every declaration to be confirmed by the broker",
        "config",
        "SELECT count(*) FROM config.outbox WHERE sent_at IS NULL",
        0,
        Duration::from_secs(60),
    )
    .await?;
    let declared = scalar(
        &mesh.env,
        "config",
        "SELECT count(*) FROM config.outbox WHERE exchange = 'declarations'",
    )
    .await?;
    assert_eq!(
        declared,
        (NODES * ROUNDS.div_ceil(HELLO_EVERY)) as i64,
        "config declarations (one per hello)"
    );
    mesh.teardown().await
}

/// The lock's session is cut under a running controller (as a database restart
/// or an administrator would): it takes the fence again and goes on. Cut again,
/// and another session takes the lock first: the controller stops, non-zero,
/// naming it, instead of going on as a second controller.
#[tokio::test(flavor = "multi_thread")]
async fn a_controller_that_loses_its_fence_takes_it_again_or_stops() -> anyhow::Result<()> {
    let mut mesh = Mesh::start().await?;
    let pid = mesh
        .controller()
        .map(|p| p.pid())
        .context("no controller")?;
    let mut admin =
        <sqlx::PgConnection as sqlx::Connection>::connect(&mesh.env.admin_database_url()).await?;

    let holders = fence_holders(&mesh).await?;
    assert_eq!(holders.len(), 1, "{holders:?}");
    let (backend, _) = holders[0].clone();
    let cut: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(backend)
        .fetch_one(&mut admin)
        .await?;
    assert!(cut);
    wait_for(
        "the controller to take its fence again",
        Duration::from_secs(30),
        || async {
            let h = fence_holders(&mesh).await?;
            Ok(
                (h.len() == 1 && h[0].0 != backend && h[0].1.contains(&format!("pid={pid} ")))
                    .then_some(()),
            )
        },
    )
    .await?;
    assert!(
        mesh.controller_log()
            .contains("controller fence taken again")
    );
    mesh.wait_healthy().await?;
    let run = another_controller(&mesh, Duration::from_secs(30)).await?;
    assert_refused(&run, pid);

    // Cut again, and take the lock in this session first (a blocking request,
    // queued before the controller notices): "another controller".
    let backend = fence_holders(&mesh).await?[0].0;
    sqlx::query("SET application_name = 'mesh-controller pid=1 host=impostor'")
        .execute(&mut admin)
        .await?;
    let cut: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(backend)
        .fetch_one(&mut admin)
        .await?;
    assert!(cut);
    sqlx::query("SELECT pg_advisory_lock(($1::bigint << 32) | $2::bigint)")
        .bind(LOCK_CLASSID)
        .bind(LOCK_OBJID)
        .execute(&mut admin)
        .await?;
    let mut controller = mesh.take_controller().context("no controller")?;
    let status = controller.wait_exit(Duration::from_secs(30)).await?;
    assert!(!status.success(), "the controller went on: {status}");
    let log = mesh.controller_log();
    assert!(
        log.contains("another controller took the fence") && log.contains("host=impostor"),
        "the controller's log does not name the taker:\n{log}"
    );
    sqlx::query("SELECT pg_advisory_unlock_all()")
        .execute(&mut admin)
        .await?;
    drop(admin);
    mesh.teardown().await
}

/// The queue arguments an older controller declared report queues with: the
/// bound, no single-active-consumer.
fn legacy_args(kind: ReportKind) -> FieldTable {
    let (max, overflow) = match kind {
        ReportKind::Heartbeat => (HEARTBEAT_QUEUE_MAX_LEN, "drop-head"),
        ReportKind::Units => (UNITS_QUEUE_MAX_LEN, "drop-head"),
        ReportKind::Health => (HEALTH_QUEUE_MAX_LEN, "drop-head"),
        _ => (REPORT_QUEUE_MAX_LEN, "reject-publish"),
    };
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongLongInt(max));
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString(LongString::from(overflow)),
    );
    args
}

/// A queue as the management API shows it (None when there is no such queue).
async fn queue_info(mesh: &Mesh, queue: &str) -> anyhow::Result<Option<Value>> {
    let admin = mesh.env.admin_credentials();
    let r = reqwest::Client::new()
        .get(format!(
            "{}/api/queues/{}/{}",
            admin.rabbitmq_api,
            urlencoding::encode(mesh.env.vhost()),
            urlencoding::encode(queue)
        ))
        .basic_auth(&admin.rabbitmq_user, Some(admin.rabbitmq_password.expose()))
        .send()
        .await?;
    if r.status() == reqwest::StatusCode::NOT_FOUND {
        return Ok(None);
    }
    Ok(Some(r.error_for_status()?.json().await?))
}

/// Report queues declared by an older controller (no single-active-consumer),
/// two of them holding reports, and nodes publishing all along: the controller
/// drains the old queues, declares them again with single-active-consumer, and
/// every report is handled exactly once; nothing is refused.
#[tokio::test(flavor = "multi_thread")]
async fn report_queues_of_an_older_controller_are_upgraded_without_losing_a_report()
-> anyhow::Result<()> {
    let mut mesh = Mesh::prepare().await?;
    // The topology an older controller left (report queues only; it declared
    // the rest as today's does). It predates logs answers (decision 0033)
    // and resource grants (decision 0039): `reports.logs` and
    // `reports.resources` are new, never upgraded.
    {
        let conn =
            lapin::Connection::connect(&mesh.env.admin_amqp_url(), Default::default()).await?;
        let ch = conn.create_channel().await?;
        ch.exchange_declare(
            "reports".into(),
            lapin::ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
        for kind in ReportKind::ALL
            .into_iter()
            .filter(|k| !matches!(k, ReportKind::Logs | ReportKind::Resources))
        {
            let q = report_queue(kind);
            ch.queue_declare(
                q.as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..QueueDeclareOptions::default()
                },
                legacy_args(kind),
            )
            .await?;
            ch.queue_bind(
                q.as_str().into(),
                "reports".into(),
                format!("*.{}", kind.as_str()).as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
        }
        let _ = conn.close(200, "done".into()).await;
    }
    let creds = add_nodes(&mesh.env, "u", 10).await?;
    let mut nodes = connect_all(creds, 8).await?;
    // A backlog in reports.hello and reports.applied; units and heartbeat empty.
    let mut ids = Vec::new();
    let mut confirms = Vec::new();
    for n in &mut nodes {
        let h = n.hello(&[]);
        ids.push(h.id);
        confirms.push(n.send(&h).await?);
        for _ in 0..50 {
            let a = n.applied(Section::Config, 1);
            ids.push(a.id);
            confirms.push(n.send(&a).await?);
        }
    }
    confirmed(confirms).await?;
    assert_eq!(queue_depth(&mesh.env, "reports.applied").await?, 500);

    // Nodes go on publishing while the controller starts and upgrades.
    let publisher = tokio::spawn(async move {
        let mut ids = Vec::new();
        let mut tick = tokio::time::interval(Duration::from_millis(20));
        for _ in 0..200 {
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
    mesh.start_controller(&[]).await?;
    ids.extend(publisher.await??);

    for kind in ReportKind::ALL {
        let q = report_queue(kind);
        wait_for(
            &format!("{q} to have single-active-consumer"),
            Duration::from_secs(60),
            || async {
                let info = queue_info(&mesh, &q).await?;
                Ok(info
                    .filter(|i| i["arguments"]["x-single-active-consumer"] == json!(true))
                    .map(|_| ()))
            },
        )
        .await?;
        let holding = format!("{q}.upgrade");
        wait_for(
            &format!("{holding} to be gone"),
            Duration::from_secs(60),
            || async { Ok(queue_info(&mesh, &holding).await?.is_none().then_some(())) },
        )
        .await?;
    }
    // inventory handles every report; config only hellos (applied reports
    // are inventory's record: decision 0015), so its inbox holds the hellos.
    for (context, expected) in [("inventory", ids.len()), ("config", 10)] {
        wait_for(
            &format!("every report in the {context} inbox"),
            Duration::from_secs(120),
            || async {
                let n = inbox_count(&mesh.env, context, &ids).await?;
                Ok((n == expected as i64).then_some(()))
            },
        )
        .await?;
    }
    assert_eq!(
        queue_depth(&mesh.env, "dead-letter").await?,
        0,
        "refused reports"
    );
    let joined = scalar(
        &mesh.env,
        "inventory",
        "SELECT count(*) FROM inventory.outbox WHERE kind = 'node.joined'",
    )
    .await?;
    assert_eq!(joined, 10, "node.joined events");
    let log = mesh.controller_log();
    // Both paths ran: an empty old queue replaced at once, a full one drained first.
    assert!(log.contains("report queue upgraded"), "{log}");
    assert!(log.contains("this session drains it"), "{log}");
    // Running now with the new queues: a second controller is still refused.
    let pid = mesh
        .controller()
        .map(|p| p.pid())
        .context("no controller")?;
    assert_refused(
        &another_controller(&mesh, Duration::from_secs(30)).await?,
        pid,
    );
    mesh.teardown().await
}
