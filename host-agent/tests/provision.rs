//! The provisioning drivers against real servers started from
//! `e2e/providers/*.sh` on free ports in temporary directories.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;

use mesh_host_agent::provision::{self, CredentialFile, Provisioner};
use mesh_protocol::{
    AdminAccess, AdminServer, ResourceItem, ResourceKind, ResourceState, ResourceStatusState,
};
use uuid::Uuid;

fn providers() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../e2e/providers")
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A server process, stopped (SIGTERM, then SIGKILL) on drop.
struct Server {
    child: Option<Child>,
    _dir: tempfile::TempDir,
    base: PathBuf,
    port: u16,
}

impl Server {
    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .arg("-TERM")
                .arg(child.id().to_string())
                .status();
            let deadline = Instant::now() + Duration::from_secs(15);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

fn wait_until(what: &str, deadline: Duration, mut ready: impl FnMut() -> bool) {
    let end = Instant::now() + deadline;
    while Instant::now() < end {
        if ready() {
            return;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    panic!("{what} not ready within {deadline:?}");
}

fn start_postgres() -> Server {
    let dir = mesh_testkit::units_tempdir().unwrap();
    // The server runs as the postgres user: it must reach its data dir.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let base = dir.path().join("pg");
    let port = free_port();
    let log = std::fs::File::create(dir.path().join("server.log")).unwrap();
    let child = Command::new("bash")
        .arg(providers().join("postgres.sh"))
        .arg(&base)
        .arg(port.to_string())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    let server = Server {
        child: Some(child),
        _dir: dir,
        base,
        port,
    };
    wait_until("postgres", Duration::from_secs(60), || {
        Command::new("pg_isready")
            .arg("-h")
            .arg(server.base.join("sock"))
            .arg("-p")
            .arg(port.to_string())
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    });
    server
}

fn pg_item(server: &Server, name: &str, state: ResourceState, version: i64) -> ResourceItem {
    ResourceItem {
        grant: Uuid::from_u128(
            name.bytes()
                .fold(0u128, |h, b| h.wrapping_mul(131) ^ u128::from(b)),
        ),
        kind: ResourceKind::PostgresDatabase,
        name: name.to_owned(),
        user: format!("{name}-user"),
        options: BTreeMap::new(),
        state,
        port: server.port,
        admin: AdminAccess {
            server: AdminServer::Postgres,
            socket_dir: Some(server.base.join("sock").to_string_lossy().into_owned()),
            user: None,
            node: None,
            home: None,
            config: None,
        },
        credential: Some(format!("/creds/{name}.env")),
        credential_version: version,
    }
}

fn cred_text(kind: ResourceKind, version: i64, password: &str) -> String {
    format!(
        "{}={password}\nMESH_CREDENTIAL_VERSION={version}\n",
        kind.password_key()
    )
}

/// `psql` over TCP with the grant's password: Ok(stdout) or Err(stderr).
fn tcp_query(
    server: &Server,
    user: &str,
    password: &str,
    db: &str,
    sql: &str,
) -> Result<String, String> {
    tcp_query_at(server.port, user, password, db, sql)
}

fn tcp_query_at(
    port: u16,
    user: &str,
    password: &str,
    db: &str,
    sql: &str,
) -> Result<String, String> {
    let out = Command::new("psql")
        .args(["-X", "-A", "-t", "-h", "127.0.0.1", "-p"])
        .arg(port.to_string())
        .args(["-U", user, "-d", db, "-c", sql])
        .env("PGPASSWORD", password)
        .env("PGCONNECT_TIMEOUT", "5")
        .output()
        .unwrap();
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// A session of `user` over TCP that stays open: `psql` holding the
/// connection, busy in `SELECT pg_sleep(60)` once `open` has returned
/// (its stdin kept open, so psql waits for more rather than exiting).
struct OpenSession {
    child: tokio::process::Child,
    _stdin: tokio::process::ChildStdin,
    // Kept open: psql does not die of a closed stdout.
    _stdout: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
}

impl OpenSession {
    async fn open(port: u16, user: &str, password: &str, db: &str) -> OpenSession {
        use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
        let mut child = tokio::process::Command::new("psql")
            .args([
                "-X",
                "-A",
                "-t",
                "-v",
                "ON_ERROR_STOP=1",
                "-h",
                "127.0.0.1",
                "-p",
            ])
            .arg(port.to_string())
            .args(["-U", user, "-d", db])
            .env("PGPASSWORD", password)
            .env("PGCONNECT_TIMEOUT", "5")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut stdin = child.stdin.take().unwrap();
        stdin
            .write_all(b"SELECT 'open';\nSELECT pg_sleep(60);\n")
            .await
            .unwrap();
        stdin.flush().await.unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let first = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
            .await
            .expect("the session opens within 10 s")
            .unwrap();
        assert_eq!(first.as_deref(), Some("open"), "the session is open");
        OpenSession {
            child,
            _stdin: stdin,
            _stdout: lines,
        }
    }

    /// Waits for psql to exit (the server cut the session), at most
    /// `deadline`: its exit status and what it wrote on stderr.
    async fn cut_within(mut self, deadline: Duration) -> (std::process::ExitStatus, String) {
        use tokio::io::AsyncReadExt;
        let status = tokio::time::timeout(deadline, self.child.wait())
            .await
            .unwrap_or_else(|_| panic!("the open session is still there after {deadline:?}"))
            .unwrap();
        let mut err = String::new();
        if let Some(mut stderr) = self.child.stderr.take() {
            stderr.read_to_string(&mut err).await.unwrap();
        }
        (status, err)
    }
}

fn admin_query(server: &Server, sql: &str) -> String {
    admin_query_at(&server.base.join("sock"), server.port, sql)
}

fn admin_query_at(socket_dir: &Path, port: u16, sql: &str) -> String {
    let out = Command::new("psql")
        .args(["-X", "-A", "-t", "-h"])
        .arg(socket_dir)
        .arg("-p")
        .arg(port.to_string())
        .args(["-U", "postgres", "-d", "postgres", "-c", sql])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

const PW_A: &str = "pw-a-0123456789abcdef0123456789abcdef";
const PW_B: &str = "pw-b-fedcba9876543210fedcba9876543210";

#[tokio::test]
async fn postgres_grant_lifecycle() {
    let mut server = start_postgres();
    let kind = ResourceKind::PostgresDatabase;
    let a = pg_item(&server, "app-a", ResourceState::Present, 1);
    let b = pg_item(&server, "app-b", ResourceState::Present, 1);
    let creds = |path: &str| -> Option<String> {
        match path {
            "/creds/app-a.env" => Some(cred_text(kind, 1, PW_A)),
            "/creds/app-b.env" => Some(cred_text(kind, 1, PW_B)),
            _ => None,
        }
    };

    // No credential of the declared version yet: waiting.
    let waiting = provision::reconcile(&a, None).await;
    assert_eq!(waiting.state, ResourceStatusState::Waiting);
    let old = CredentialFile::parse(kind, &cred_text(kind, 0, PW_A)).unwrap();
    let waiting = provision::reconcile(&a, Some(&old)).await;
    assert_eq!(waiting.state, ResourceStatusState::Waiting);
    assert_eq!(
        waiting.reason.as_deref(),
        Some("credential version 1 not yet delivered")
    );

    // Present creates.
    let mut p = Provisioner::new();
    let items = vec![a.clone(), b.clone()];
    let st = p.pass(&items, creds).await;
    for s in &st {
        assert_eq!(s.state, ResourceStatusState::Ready, "{s:?}");
        assert_eq!(s.credential_version, Some(1));
        assert!(!s.recreated);
    }
    assert!(provision::exists(&a).await.unwrap());

    // The credential opens its database over TCP, and not the other one.
    tcp_query(
        &server,
        "app-a-user",
        PW_A,
        "app-a",
        "CREATE TABLE t (x int); INSERT INTO t VALUES (7)",
    )
    .unwrap();
    let refused = tcp_query(&server, "app-a-user", PW_A, "app-b", "SELECT 1").unwrap_err();
    assert!(refused.contains("permission denied"), "{refused}");
    // Nor the server's own databases (PUBLIC's CONNECT on them is revoked).
    for db in ["postgres", "template1"] {
        let refused = tcp_query(&server, "app-a-user", PW_A, db, "SELECT 1").unwrap_err();
        assert!(refused.contains("permission denied"), "{db}: {refused}");
    }
    let refused = tcp_query(&server, "app-a-user", "wrong", "app-a", "SELECT 1").unwrap_err();
    assert!(
        refused.contains("password authentication failed"),
        "{refused}"
    );

    // A second pass changes nothing.
    let before = admin_query(
        &server,
        "SELECT rolname, rolpassword FROM pg_authid WHERE rolname LIKE 'app-%' ORDER BY 1",
    );
    let dbs_before = admin_query(
        &server,
        "SELECT datname, datdba FROM pg_database ORDER BY 1",
    );
    let st2 = p.pass(&items, creds).await;
    assert_eq!(st, st2);
    // (A SCRAM verifier is salted afresh on each ALTER ROLE … PASSWORD, so
    // compare logins rather than verifiers.)
    assert_eq!(
        before
            .lines()
            .map(|l| l.split('|').next().unwrap())
            .collect::<Vec<_>>(),
        vec!["app-a-user", "app-b-user"]
    );
    assert_eq!(
        dbs_before,
        admin_query(
            &server,
            "SELECT datname, datdba FROM pg_database ORDER BY 1"
        )
    );
    assert_eq!(
        tcp_query(&server, "app-a-user", PW_A, "app-a", "SELECT x FROM t")
            .unwrap()
            .trim(),
        "7"
    );

    // Dropped externally: created again, and recreated until a newer credential.
    admin_query(&server, "DROP DATABASE \"app-a\" WITH (FORCE)");
    let st3 = p.pass(&items, creds).await;
    assert_eq!(st3[0].state, ResourceStatusState::Ready);
    assert!(st3[0].recreated, "{:?}", st3[0]);
    assert!(!st3[1].recreated);
    let st4 = p.pass(&items, creds).await;
    assert!(
        st4[0].recreated,
        "still recreated until the credential rotates"
    );
    let a2 = pg_item(&server, "app-a", ResourceState::Present, 2);
    let creds2 = |path: &str| -> Option<String> {
        match path {
            "/creds/app-a.env" => Some(cred_text(kind, 2, PW_A)),
            other => creds(other),
        }
    };
    let st5 = p.pass(&[a2.clone(), b.clone()], creds2).await;
    assert_eq!(st5[0].state, ResourceStatusState::Ready);
    assert_eq!(st5[0].credential_version, Some(2));
    assert!(!st5[0].recreated);

    // Revoked: a session open with the credential is cut at once, a new
    // login refused, data kept.
    let session = OpenSession::open(server.port, "app-a-user", PW_A, "app-a").await;
    let other = OpenSession::open(server.port, "app-b-user", PW_B, "app-b").await;
    let ra = pg_item(&server, "app-a", ResourceState::Revoked, 2);
    let revoked_at = Instant::now();
    let st6 = p.pass(&[ra.clone(), b.clone()], creds2).await;
    assert_eq!(st6[0].state, ResourceStatusState::Revoked, "{:?}", st6[0]);
    let pass_took = revoked_at.elapsed();
    let (status, err) = session.cut_within(Duration::from_secs(10)).await;
    eprintln!(
        "postgres: the revoking pass took {pass_took:?}; the open session was cut {:?} after it returned",
        revoked_at.elapsed() - pass_took
    );
    assert!(!status.success(), "{status}: {err}");
    assert!(
        err.contains("terminating connection due to administrator command"),
        "{err}"
    );
    // (The backend leaves pg_stat_activity as it exits, about when psql
    // sees the connection go.)
    wait_until(
        "no session of the revoked role",
        Duration::from_secs(5),
        || {
            admin_query(
                &server,
                "SELECT count(*) FROM pg_stat_activity WHERE usename = 'app-a-user'",
            ) == "0"
        },
    );
    assert_eq!(
        admin_query(
            &server,
            "SELECT count(*) FROM pg_stat_activity WHERE usename = 'app-b-user'"
        ),
        "1",
        "another grant's session is left alone"
    );
    // Ended here, or its pg_sleep would hold the server's smart shutdown.
    admin_query(
        &server,
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = 'app-b-user'",
    );
    other.cut_within(Duration::from_secs(10)).await;
    let refused = tcp_query(&server, "app-a-user", PW_A, "app-a", "SELECT 1").unwrap_err();
    assert!(refused.contains("not permitted to log in"), "{refused}");
    assert!(provision::exists(&ra).await.unwrap());
    // Idempotent, also for a role that is not there.
    assert_eq!(
        provision::reconcile(&ra, None).await.state,
        ResourceStatusState::Revoked
    );
    let mut ghost = pg_item(&server, "ghost", ResourceState::Revoked, 1);
    ghost.credential = None;
    assert_eq!(
        provision::reconcile(&ghost, None).await.state,
        ResourceStatusState::Revoked
    );

    // Deleted: gone.
    let da = pg_item(&server, "app-a", ResourceState::Deleted, 2);
    let st7 = p.pass(&[da.clone(), b.clone()], creds2).await;
    assert_eq!(st7[0].state, ResourceStatusState::Deleted, "{:?}", st7[0]);
    assert!(!provision::exists(&da).await.unwrap());
    assert_eq!(
        admin_query(
            &server,
            "SELECT count(*) FROM pg_roles WHERE rolname = 'app-a-user'"
        ),
        "0"
    );
    assert_eq!(
        provision::reconcile(&da, None).await.state,
        ResourceStatusState::Deleted
    );

    // A value the server refuses: failed, in PostgreSQL's words, without the password.
    let mut bad = pg_item(&server, "app-c", ResourceState::Present, 1);
    bad.options.insert("encoding".into(), "BOGUS".into());
    let cred_c = CredentialFile::parse(kind, &cred_text(kind, 1, PW_A)).unwrap();
    let failed = provision::reconcile(&bad, Some(&cred_c)).await;
    assert_eq!(failed.state, ResourceStatusState::Failed);
    let reason = failed.reason.clone().unwrap();
    assert!(
        reason.contains("BOGUS is not a valid encoding name"),
        "{reason}"
    );
    // A statement that fails on the very line holding the password.
    let mut bad_limit = pg_item(&server, "app-d", ResourceState::Present, 1);
    bad_limit
        .options
        .insert("connection_limit".into(), "-5".into());
    let failed_limit = provision::reconcile(&bad_limit, Some(&cred_c)).await;
    assert_eq!(failed_limit.state, ResourceStatusState::Failed);
    let reason_limit = failed_limit.reason.clone().unwrap();
    assert!(
        reason_limit.contains("invalid connection limit"),
        "{reason_limit}"
    );
    // The Provisioner does not retry a failed item until it changes.
    let creds_c = |_: &str| Some(cred_text(kind, 1, PW_A));
    let f1 = p.pass(std::slice::from_ref(&bad), creds_c).await;
    assert_eq!(f1[0].state, ResourceStatusState::Failed);
    admin_query(&server, "CREATE DATABASE \"app-c\"");
    let f2 = p.pass(std::slice::from_ref(&bad), creds_c).await;
    assert_eq!(f2, f1, "not retried while unchanged");
    bad.options.insert("encoding".into(), "UTF8".into());
    let f3 = p.pass(std::slice::from_ref(&bad), creds_c).await;
    assert_eq!(f3[0].state, ResourceStatusState::Ready, "{:?}", f3[0]);

    // Server stopped: waiting.
    server.stop();
    let w = provision::reconcile(&b, Some(&cred_c)).await;
    assert_eq!(w.state, ResourceStatusState::Waiting, "{w:?}");
    assert!(provision::exists(&b).await.is_err());

    // No reason ever holds a password.
    let log = std::fs::read_to_string(server._dir.path().join("server.log")).unwrap();
    for s in st
        .iter()
        .chain(&st3)
        .chain(&st6)
        .chain(&st7)
        .chain([&failed, &failed_limit, &w])
        .chain(&f1)
    {
        let r = s.reason.clone().unwrap_or_default();
        assert!(!r.contains(PW_A) && !r.contains(PW_B), "{r}");
    }
    assert!(
        !log.contains(PW_A) && !log.contains(PW_B),
        "the server log holds a password"
    );
}

const RABBITMQCTL: &str = "/usr/lib/rabbitmq/bin/rabbitmqctl";

/// A free port whose distribution port (`rabbitmq.sh`: port + 20000) is a
/// port too, and free (a port from the kernel's ephemeral range may be above
/// 45535, past which the broker refuses to start).
fn free_rabbitmq_port() -> u16 {
    for _ in 0..1000 {
        let port = 20_000 + rand::random::<u16>() % 25_000;
        let free = |p: u16| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok();
        if free(port) && free(port + 20_000) {
            return port;
        }
    }
    panic!("no free port pair for rabbitmq");
}

/// A RabbitMQ of its own on free ports. A broker that has not booted within
/// a minute (a port taken between the check and the start, a loaded
/// machine) is stopped and another started on other ports, three times at
/// most; the last one's log is in the failure.
fn start_rabbitmq() -> (Server, String) {
    let mut last_log = String::new();
    for _ in 0..3 {
        let dir = mesh_testkit::units_tempdir().unwrap();
        let base = dir.path().join("rmq");
        let port = free_rabbitmq_port();
        let node = format!("mesh-prov-{port}@localhost");
        let log_path = dir.path().join("server.log");
        let log = std::fs::File::create(&log_path).unwrap();
        let child = Command::new("bash")
            .arg(providers().join("rabbitmq.sh"))
            .arg(&base)
            .arg(port.to_string())
            .arg(&node)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        let mut server = Server {
            child: Some(child),
            _dir: dir,
            base,
            port,
        };
        let end = Instant::now() + Duration::from_secs(60);
        while Instant::now() < end {
            let booted = Command::new(RABBITMQCTL)
                .env("HOME", &server.base)
                .args(["-n", &node, "-q", "await_startup", "--timeout", "5"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if booted {
                return (server, node);
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        last_log = std::fs::read_to_string(&log_path).unwrap_or_default();
        eprintln!("rabbitmq on {port} not booted within 60 s: trying other ports");
        server.stop();
    }
    panic!("rabbitmq not ready in three attempts; the last one's log:\n{last_log}");
}

fn amqp_item(server: &Server, node: &str, name: &str, state: ResourceState) -> ResourceItem {
    ResourceItem {
        grant: Uuid::from_u128(
            name.bytes()
                .fold(7u128, |h, b| h.wrapping_mul(131) ^ u128::from(b)),
        ),
        kind: ResourceKind::AmqpVhost,
        name: name.to_owned(),
        user: format!("{name}-user"),
        options: BTreeMap::new(),
        state,
        port: server.port,
        admin: AdminAccess {
            server: AdminServer::Rabbitmq,
            socket_dir: None,
            user: None,
            node: Some(node.to_owned()),
            home: Some(server.base.to_string_lossy().into_owned()),
            config: None,
        },
        credential: Some(format!("/creds/{name}.env")),
        credential_version: 1,
    }
}

/// Connect as `user` to `vhost`, declare a queue, publish to it and get the
/// message back.
async fn amqp_roundtrip(port: u16, user: &str, password: &str, vhost: &str) -> Result<(), String> {
    use lapin::options::{BasicGetOptions, BasicPublishOptions, QueueDeclareOptions};
    use lapin::types::FieldTable;
    use lapin::{BasicProperties, Connection, ConnectionProperties};
    let url = format!("amqp://{user}:{password}@127.0.0.1:{port}/{vhost}");
    let conn = tokio::time::timeout(
        Duration::from_secs(10),
        Connection::connect(&url, ConnectionProperties::default()),
    )
    .await
    .map_err(|_| "connect timed out".to_string())?
    .map_err(|e| format!("connect: {e}"))?;
    let ch = conn.create_channel().await.map_err(|e| e.to_string())?;
    ch.queue_declare(
        "q".into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .map_err(|e| e.to_string())?;
    ch.basic_publish(
        "".into(),
        "q".into(),
        BasicPublishOptions::default(),
        b"hello",
        BasicProperties::default(),
    )
    .await
    .map_err(|e| e.to_string())?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let got = ch
            .basic_get("q".into(), BasicGetOptions { no_ack: true })
            .await
            .map_err(|e| e.to_string())?;
        if let Some(m) = got {
            assert_eq!(m.delivery.data, b"hello");
            break;
        }
        if Instant::now() > deadline {
            return Err("message not delivered".into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = conn.close(200, "done".into()).await;
    Ok(())
}

/// A connection of `user` to `vhost` that stays open, consuming from a queue
/// of its own.
struct OpenAmqp {
    conn: lapin::Connection,
    consumer: lapin::Consumer,
}

impl OpenAmqp {
    async fn open(port: u16, user: &str, password: &str, vhost: &str) -> OpenAmqp {
        use lapin::options::{BasicConsumeOptions, QueueDeclareOptions};
        use lapin::types::FieldTable;
        use lapin::{Connection, ConnectionProperties};
        let url = format!("amqp://{user}:{password}@127.0.0.1:{port}/{vhost}");
        let conn = Connection::connect(&url, ConnectionProperties::default())
            .await
            .unwrap();
        let ch = conn.create_channel().await.unwrap();
        ch.queue_declare(
            "held".into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
        let consumer = ch
            .basic_consume(
                "held".into(),
                "held".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        OpenAmqp { conn, consumer }
    }

    /// Waits for the broker to close the connection (the consumer's stream
    /// ends or errs), at most `deadline`: how it ended.
    async fn cut_within(mut self, deadline: Duration) -> String {
        use futures_util::StreamExt;
        let how = match tokio::time::timeout(deadline, self.consumer.next()).await {
            Err(_) => panic!("the open connection is still there after {deadline:?}"),
            Ok(None) => "the consumer ended".to_owned(),
            Ok(Some(Err(e))) => e.to_string(),
            Ok(Some(Ok(d))) => panic!("a delivery instead of the close: {d:?}"),
        };
        assert!(
            !self.conn.status().connected(),
            "the connection is closed ({how})"
        );
        how
    }
}

fn amqp_connections(node: &str, home: &Path) -> Vec<String> {
    let out = Command::new(RABBITMQCTL)
        .env("HOME", home)
        .args(["-n", node, "-q", "list_connections", "user"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .skip(1)
        .map(|l| l.trim().to_owned())
        .collect()
}

#[tokio::test]
async fn rabbitmq_grant_lifecycle() {
    let (mut server, node) = start_rabbitmq();
    let kind = ResourceKind::AmqpVhost;
    let a = amqp_item(&server, &node, "app-a", ResourceState::Present);
    let b = amqp_item(&server, &node, "app-b", ResourceState::Present);
    let creds = |path: &str| -> Option<String> {
        match path {
            "/creds/app-a.env" => Some(cred_text(kind, 1, PW_A)),
            "/creds/app-b.env" => Some(cred_text(kind, 1, PW_B)),
            _ => None,
        }
    };
    let mut p = Provisioner::new();
    let items = vec![a.clone(), b.clone()];
    let st = p.pass(&items, creds).await;
    for s in &st {
        assert_eq!(s.state, ResourceStatusState::Ready, "{s:?}");
    }
    assert!(provision::exists(&a).await.unwrap());
    amqp_roundtrip(server.port, "app-a-user", PW_A, "app-a")
        .await
        .unwrap();
    let refused = amqp_roundtrip(server.port, "app-a-user", PW_A, "app-b").await;
    assert!(refused.is_err(), "another vhost must be refused");
    // A second pass changes nothing and the password still works.
    assert_eq!(p.pass(&items, creds).await, st);
    amqp_roundtrip(server.port, "app-a-user", PW_A, "app-a")
        .await
        .unwrap();

    // A refused option value: failed, in rabbitmqctl's words.
    let mut bad = amqp_item(&server, &node, "app-c", ResourceState::Present);
    bad.options.insert("max_queues".into(), "many".into());
    let c = CredentialFile::parse(kind, &cred_text(kind, 1, PW_A)).unwrap();
    assert_eq!(
        provision::reconcile(&bad, Some(&c)).await.state,
        ResourceStatusState::Failed
    );

    // Revoked: a connection open with the credential is closed by the
    // broker at once, a new one refused, vhost kept; idempotent.
    let held = OpenAmqp::open(server.port, "app-a-user", PW_A, "app-a").await;
    let other = OpenAmqp::open(server.port, "app-b-user", PW_B, "app-b").await;
    let ra = amqp_item(&server, &node, "app-a", ResourceState::Revoked);
    // (The revoked item last, so that the pass returns as its revoke does.)
    let revoked_at = Instant::now();
    let st2 = p.pass(&[b.clone(), ra.clone()], creds).await;
    assert_eq!(st2[1].state, ResourceStatusState::Revoked, "{:?}", st2[1]);
    let pass_took = revoked_at.elapsed();
    let how = held.cut_within(Duration::from_secs(10)).await;
    eprintln!(
        "rabbitmq: the revoking pass took {pass_took:?}; the open connection was closed {:?} after it returned: {how}",
        revoked_at.elapsed() - pass_took
    );
    assert_eq!(
        amqp_connections(&node, &server.base),
        vec!["app-b-user".to_owned()],
        "no connection of the deleted user is left; another grant's is"
    );
    assert!(other.conn.status().connected());
    other.conn.close(200, "done".into()).await.unwrap();
    assert!(
        amqp_roundtrip(server.port, "app-a-user", PW_A, "app-a")
            .await
            .is_err()
    );
    assert!(provision::exists(&ra).await.unwrap());
    assert_eq!(
        provision::reconcile(&ra, None).await.state,
        ResourceStatusState::Revoked
    );

    // Deleted: gone.
    let da = amqp_item(&server, &node, "app-a", ResourceState::Deleted);
    assert_eq!(
        provision::reconcile(&da, None).await.state,
        ResourceStatusState::Deleted
    );
    assert!(!provision::exists(&da).await.unwrap());

    // Stopped: waiting.
    server.stop();
    let w = provision::reconcile(&b, Some(&c)).await;
    assert_eq!(w.state, ResourceStatusState::Waiting, "{w:?}");
    for s in st.iter().chain(&st2).chain([&w]) {
        let r = s.reason.clone().unwrap_or_default();
        assert!(!r.contains(PW_A) && !r.contains(PW_B), "{r}");
    }
}

fn start_garage() -> Server {
    let dir = mesh_testkit::units_tempdir().unwrap();
    let base = dir.path().join("garage");
    let port = free_port();
    let log = std::fs::File::create(dir.path().join("server.log")).unwrap();
    let child = Command::new("bash")
        .arg(providers().join("garage.sh"))
        .arg(&base)
        .arg(port.to_string())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    let server = Server {
        child: Some(child),
        _dir: dir,
        base,
        port,
    };
    let garage = if Command::new("garage").arg("--version").output().is_ok() {
        "garage".to_owned()
    } else {
        "/var/cache/mesh-ci/garage-2.5.0/bin/garage".to_owned()
    };
    wait_until("garage", Duration::from_secs(60), || {
        Command::new(&garage)
            .arg("-c")
            .arg(server.base.join("garage.toml"))
            .args(["layout", "show"])
            .output()
            .is_ok_and(|o| {
                String::from_utf8_lossy(&o.stdout).contains("Current cluster layout version: 1")
            })
    });
    server
}

fn s3_item(server: &Server, name: &str, key: &str, state: ResourceState) -> ResourceItem {
    ResourceItem {
        grant: Uuid::from_u128(
            name.bytes()
                .fold(11u128, |h, b| h.wrapping_mul(131) ^ u128::from(b)),
        ),
        kind: ResourceKind::S3Bucket,
        name: name.to_owned(),
        user: key.to_owned(),
        options: BTreeMap::new(),
        state,
        port: server.port,
        admin: AdminAccess {
            server: AdminServer::Garage,
            socket_dir: None,
            user: None,
            node: None,
            home: None,
            config: Some(
                server
                    .base
                    .join("garage.toml")
                    .to_string_lossy()
                    .into_owned(),
            ),
        },
        credential: Some(format!("/creds/{name}.env")),
        credential_version: 1,
    }
}

/// One path-style S3 request signed with SigV4 (region `garage`): the
/// status and body.
async fn s3(
    port: u16,
    key: &str,
    secret: &str,
    method: &str,
    path: &str,
    body: &[u8],
) -> (u16, String) {
    let host = format!("127.0.0.1:{port}");
    let signed = mesh_testkit::s3::signed_headers(
        &mesh_testkit::s3::Request {
            host: &host,
            region: "garage",
            key,
            secret,
            method,
            path,
            body,
        },
        chrono::Utc::now(),
    );
    let mut request = reqwest::Client::new()
        .request(method.parse().unwrap(), format!("http://{host}{path}"))
        .body(body.to_vec());
    for (k, v) in signed {
        request = request.header(k, v);
    }
    let resp = request.send().await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.text().await.unwrap_or_default())
}

const KEY_A: &str = "GK0123456789abcdef01234567";
const KEY_B: &str = "GK76543210fedcba9876543210";
const S3_A: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
const S3_B: &str = "fedcba9876543210fedcba9876543210fedcba9876543210fedcba9876543210";
const KEY_C: &str = "GK0a1b2c3d4e5f60718293a4b5";
const S3_C: &str = "a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5";

#[tokio::test]
async fn garage_grant_lifecycle() {
    let mut server = start_garage();
    let kind = ResourceKind::S3Bucket;
    let a = s3_item(&server, "bucket-a", KEY_A, ResourceState::Present);
    let b = s3_item(&server, "bucket-b", KEY_B, ResourceState::Present);
    let creds = |path: &str| -> Option<String> {
        match path {
            "/creds/bucket-a.env" => Some(cred_text(kind, 1, S3_A)),
            "/creds/bucket-b.env" => Some(cred_text(kind, 1, S3_B)),
            _ => None,
        }
    };
    let mut p = Provisioner::new();
    let items = vec![a.clone(), b.clone()];
    let st = p.pass(&items, creds).await;
    for s in &st {
        assert_eq!(s.state, ResourceStatusState::Ready, "{s:?}");
    }
    assert!(provision::exists(&a).await.unwrap());
    let (put, text) = s3(server.port, KEY_A, S3_A, "PUT", "/bucket-a/obj", b"hello").await;
    assert_eq!(put, 200, "{text}");
    let (get, text) = s3(server.port, KEY_A, S3_A, "GET", "/bucket-a/obj", b"").await;
    assert_eq!((get, text.as_str()), (200, "hello"));
    let (other, _) = s3(server.port, KEY_A, S3_A, "PUT", "/bucket-b/obj", b"x").await;
    assert_eq!(other, 403);
    assert_eq!(p.pass(&items, creds).await, st);

    // Rotated: Garage cannot change a key's secret, so the credential of
    // version 2 is a new key id; once it is set up the grant's older key is
    // deleted (403 from then on), and no other grant's key is touched.
    let mut a2 = s3_item(&server, "bucket-a", KEY_C, ResourceState::Present);
    a2.credential_version = 2;
    let creds2 = |path: &str| -> Option<String> {
        match path {
            "/creds/bucket-a.env" => Some(cred_text(kind, 2, S3_C)),
            other => creds(other),
        }
    };
    let rotated = p.pass(&[a2.clone(), b.clone()], creds2).await;
    assert_eq!(rotated[0].state, ResourceStatusState::Ready, "{rotated:?}");
    assert_eq!(rotated[0].credential_version, Some(2));
    let (old, _) = s3(server.port, KEY_A, S3_A, "GET", "/bucket-a/obj", b"").await;
    assert_eq!(old, 403, "the rotated-out key is refused");
    let (new, text) = s3(server.port, KEY_C, S3_C, "GET", "/bucket-a/obj", b"").await;
    assert_eq!((new, text.as_str()), (200, "hello"), "the new key works");
    let (other_grant, _) = s3(server.port, KEY_B, S3_B, "GET", "/bucket-b/none", b"").await;
    assert_eq!(other_grant, 404, "another grant's key still works");
    assert_eq!(
        p.pass(&[a2.clone(), b.clone()], creds2).await,
        rotated,
        "a second pass changes nothing"
    );

    // Revoked: refused, bucket kept. Every key of the grant goes, whichever
    // id the declaration names (here the rotated-out one).
    let ra = s3_item(&server, "bucket-a", KEY_A, ResourceState::Revoked);
    assert_eq!(
        provision::reconcile(&ra, None).await.state,
        ResourceStatusState::Revoked
    );
    let (get, _) = s3(server.port, KEY_A, S3_A, "GET", "/bucket-a/obj", b"").await;
    assert_eq!(get, 403);
    let (get, _) = s3(server.port, KEY_C, S3_C, "GET", "/bucket-a/obj", b"").await;
    assert_eq!(get, 403, "the grant's current key is gone too");
    assert!(provision::exists(&ra).await.unwrap());
    assert_eq!(
        provision::reconcile(&ra, None).await.state,
        ResourceStatusState::Revoked
    );

    // Deleted (the empty bucket b): gone.
    let db = s3_item(&server, "bucket-b", KEY_B, ResourceState::Deleted);
    let d = provision::reconcile(&db, None).await;
    assert_eq!(d.state, ResourceStatusState::Deleted, "{d:?}");
    assert!(!provision::exists(&db).await.unwrap());

    server.stop();
    let c = CredentialFile::parse(kind, &cred_text(kind, 1, S3_A)).unwrap();
    let w = provision::reconcile(&a, Some(&c)).await;
    assert_eq!(w.state, ResourceStatusState::Waiting, "{w:?}");
    for s in st.iter().chain(&rotated).chain([&w, &d]) {
        let r = s.reason.clone().unwrap_or_default();
        assert!(
            !r.contains(S3_A) && !r.contains(S3_B) && !r.contains(S3_C),
            "{r}"
        );
    }
}

// ---- the agent itself: a provisioning section over the real broker ----

/// A real `mesh-agent` process (the binary), its output kept in a file;
/// on drop it is killed and the units it left are drained, so that a failed
/// test leaves no PostgreSQL behind.
struct AgentProcess {
    child: Option<tokio::process::Child>,
    state: PathBuf,
}

impl AgentProcess {
    fn start(config: &Path, state: &Path, log: &Path) -> AgentProcess {
        let out = std::fs::File::create(log).unwrap();
        let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_mesh-agent"))
            .args(["--log-format", "json", "run", "--config"])
            .arg(config)
            .env("RUST_LOG", "info,mesh_host_agent=debug")
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        AgentProcess {
            child: Some(child),
            state: state.to_owned(),
        }
    }

    /// SIGTERM, and a clean exit (units are left running: decision 0016).
    async fn stop(&mut self) {
        let mut child = self.child.take().expect("running");
        let pid = child.id().expect("a pid");
        let status = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        let exit = tokio::time::timeout(Duration::from_secs(30), child.wait())
            .await
            .expect("the agent exits on SIGTERM")
            .unwrap();
        assert!(exit.success(), "{exit}");
    }

    /// Stop every unit the agent left running (`mesh-agent drain-local`).
    fn drain(&self) {
        let _ = Command::new(env!("CARGO_BIN_EXE_mesh-agent"))
            .arg("drain-local")
            .arg("--state-dir")
            .arg(&self.state)
            .args(["--stop-timeout", "10s"])
            .stdout(Stdio::null())
            .status();
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.start_kill();
            let end = Instant::now() + Duration::from_secs(10);
            while Instant::now() < end && !matches!(child.try_wait(), Ok(Some(_))) {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        self.drain();
    }
}

/// The next report matching `pred` (with its AMQP delivery mode), within
/// the deadline.
async fn next_report(
    reports: &mut lapin::Consumer,
    what: &str,
    pred: impl Fn(&mesh_protocol::Envelope<mesh_protocol::Report>) -> bool,
) -> (mesh_protocol::Envelope<mesh_protocol::Report>, Option<u8>) {
    use futures_util::StreamExt;
    let deadline = Duration::from_secs(120);
    let until = tokio::time::Instant::now() + deadline;
    loop {
        let left = until.saturating_duration_since(tokio::time::Instant::now());
        let d = match tokio::time::timeout(left, reports.next()).await {
            Ok(Some(Ok(d))) => d,
            Ok(other) => panic!("report consumer ended while waiting for {what}: {other:?}"),
            Err(_) => panic!("no {what} within {deadline:?}"),
        };
        let env = mesh_protocol::Envelope::<mesh_protocol::Report>::decode(
            &d.data,
            mesh_protocol::MAX_REPORT_BYTES,
        )
        .expect("a report decodes");
        if pred(&env) {
            return (env, *d.properties.delivery_mode());
        }
    }
}

fn resources_of(
    env: &mesh_protocol::Envelope<mesh_protocol::Report>,
) -> Option<&mesh_protocol::Resources> {
    match &env.body {
        mesh_protocol::Report::Resources(r) => Some(r),
        _ => None,
    }
}

fn unit_of<'a>(
    env: &'a mesh_protocol::Envelope<mesh_protocol::Report>,
    name: &str,
) -> Option<&'a mesh_protocol::UnitStatus> {
    match &env.body {
        mesh_protocol::Report::Units(u) => u.units.iter().find(|u| u.name == name),
        _ => None,
    }
}

fn applied_of(
    env: &mesh_protocol::Envelope<mesh_protocol::Report>,
) -> Option<&mesh_protocol::Applied> {
    match &env.body {
        mesh_protocol::Report::Applied(a) => Some(a),
        _ => None,
    }
}

async fn wait_for_file(what: &str, path: &Path, needle: &str) {
    let deadline = Duration::from_secs(120);
    let until = Instant::now() + deadline;
    while !std::fs::read_to_string(path).is_ok_and(|t| t.contains(needle)) {
        assert!(Instant::now() < until, "no {what} within {deadline:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The agent reconciles its provisioning section in the background and
/// states it: a PostgreSQL provider runs as the node's unit (the fixture
/// script, as a provider module's unit would run it); a grant whose
/// credential file has not come is `waiting`; the config section delivers
/// the file, sealed to the node → `ready`, and the credential opens the
/// database; the agent's restart restarts no unit, creates nothing again and
/// states the grant again at once; revoked → the login is refused. The
/// password is in no line the agent logs, nor in its store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_provisions_a_postgres_grant_over_the_broker() {
    use mesh_protocol::sealing::{self, SealPublicKey};
    use mesh_protocol::{
        Declaration, DeclarationItems, DesiredState, FileMode, Report, RestartPolicy,
        SealedFileItem, Section, UnitItem, UnitState,
    };
    let env = mesh_testkit::TestEnv::new().await.unwrap();
    let creds = env.add_node("prov").await.unwrap();
    let node = creds.node.clone();
    let (admin, ch, mut reports) = common::controller_side(&env).await.unwrap();
    common::declaration_queue_for(&ch, &node).await.unwrap();

    let dir = mesh_testkit::units_tempdir().unwrap();
    // PostgreSQL runs as the postgres user: it must reach its data dir.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let state = dir.path().join("state");
    let root = dir.path().join("root");
    let pg_dir = dir.path().join("pg");
    std::fs::create_dir_all(&root).unwrap();
    creds.write_to(&state).unwrap();
    let pg_port = free_port();
    let metrics_port = common::free_port();
    let config = dir.path().join("agent.toml");
    std::fs::write(
        &config,
        format!(
            "state_dir = {state:?}\nroot = {root:?}\nhostname = \"provider\"\n\
             reconnect_min = \"50ms\"\nreconnect_max = \"1s\"\n\
             metrics_listen = \"127.0.0.1:{metrics_port}\"\n\
             [provisioning]\ninterval = \"2s\"\n"
        ),
    )
    .unwrap();
    let password = format!("pw-{:032x}", rand::random::<u128>());
    let log1 = dir.path().join("agent-1.log");
    let log2 = dir.path().join("agent-2.log");
    let mut agent = AgentProcess::start(&config, &state, &log1);

    let (hello, _) = next_report(&mut reports, "hello", |e| {
        matches!(e.body, Report::Hello(_))
    })
    .await;
    let Report::Hello(h) = &hello.body else {
        unreachable!()
    };
    let seal_to = SealPublicKey::from_hex(h.seal_key.as_deref().expect("a seal key")).unwrap();
    let declare = |section: Section, generation: u64, items: DeclarationItems| {
        common::publish_declaration(
            &ch,
            env.signer(),
            &node,
            Declaration {
                section,
                generation,
                items,
            },
        )
    };

    // 1. The provider module's server, as the node's unit.
    // A provider's server switches to its own user (postgres): it runs as root.
    let unit = UnitItem {
        user: mesh_protocol::UnitUser::Root,
        limits: Default::default(),
        stateful: false,
        artifact: None,
        revision: None,
        name: "pg".into(),
        module: "pg".into(),
        command: "/bin/bash".into(),
        args: vec![
            providers()
                .join("postgres.sh")
                .to_string_lossy()
                .into_owned(),
            pg_dir.to_string_lossy().into_owned(),
            pg_port.to_string(),
        ],
        env: [(
            "PATH".to_owned(),
            "/usr/sbin:/usr/bin:/sbin:/bin".to_owned(),
        )]
        .into(),
        working_dir: None,
        restart: RestartPolicy::Always,
        desired: DesiredState::Running,
        probes: Vec::new(),
    };
    declare(
        Section::Inventory,
        1,
        DeclarationItems {
            units: vec![unit],
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let (units, _) = next_report(&mut reports, "the pg unit running", |e| {
        unit_of(e, "pg").is_some_and(|u| u.state == UnitState::Running && u.pid.is_some())
    })
    .await;
    let pg_pid = unit_of(&units, "pg").unwrap().pid.unwrap();
    let sock = pg_dir.join("sock");
    wait_until(
        "postgres as the agent's unit",
        Duration::from_secs(120),
        || {
            Command::new("pg_isready")
                .arg("-h")
                .arg(&sock)
                .arg("-p")
                .arg(pg_port.to_string())
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        },
    );

    // 2. A grant whose credential file has not come: waiting.
    let grant = Uuid::now_v7();
    let credential_path = "/modules/pg/secrets/grant-main.env";
    let item = |state: ResourceState| ResourceItem {
        grant,
        kind: ResourceKind::PostgresDatabase,
        name: "app-main".into(),
        user: "app-main".into(),
        options: BTreeMap::new(),
        state,
        port: pg_port,
        admin: AdminAccess {
            server: AdminServer::Postgres,
            socket_dir: Some(sock.to_string_lossy().into_owned()),
            user: None,
            node: None,
            home: None,
            config: None,
        },
        credential: (state == ResourceState::Present).then(|| credential_path.to_owned()),
        credential_version: 1,
    };
    declare(
        Section::Provisioning,
        1,
        DeclarationItems {
            resources: vec![item(ResourceState::Present)],
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let (applied, _) = next_report(&mut reports, "provisioning applied", |e| {
        applied_of(e).is_some_and(|a| a.section == Some(Section::Provisioning))
    })
    .await;
    assert_eq!(
        applied_of(&applied).unwrap().outcome,
        mesh_protocol::Outcome::Applied
    );
    let (waiting, mode) = next_report(&mut reports, "resources: waiting", |e| {
        resources_of(e).is_some_and(|r| r.generation == 1)
    })
    .await;
    assert_eq!(mode, Some(2), "a resources report is persistent");
    let r = resources_of(&waiting).unwrap();
    assert_eq!(r.resources.len(), 1);
    assert_eq!(r.resources[0].grant, grant);
    assert_eq!(r.resources[0].state, ResourceStatusState::Waiting, "{r:?}");
    assert_eq!(
        admin_query_at(
            &sock,
            pg_port,
            "SELECT count(*) FROM pg_database WHERE datname = 'app-main'"
        ),
        "0"
    );

    // 3. Config delivers the credential file, sealed to this node: ready.
    let text = format!(
        "PGHOST=127.0.0.1\nPGPORT={pg_port}\nPGDATABASE=app-main\nPGUSER=app-main\n\
         PGPASSWORD={password}\nMESH_CREDENTIAL_VERSION=1\n"
    );
    let secret = SealedFileItem {
        path: credential_path.into(),
        mode: FileMode::new(0o600).unwrap(),
        secret: format!("provisioning.grant-{grant}"),
        version: 1,
        sealed: sealing::seal(
            &seal_to,
            &sealing::secret_aad(node.as_str(), credential_path),
            text.as_bytes(),
            [9; 32],
        )
        .unwrap(),
    };
    declare(
        Section::Config,
        1,
        DeclarationItems {
            secrets: vec![secret],
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let (ready, _) = next_report(&mut reports, "resources: ready", |e| {
        resources_of(e).is_some_and(|r| {
            r.resources
                .iter()
                .any(|s| s.state == ResourceStatusState::Ready)
        })
    })
    .await;
    let r = resources_of(&ready).unwrap().clone();
    assert_eq!(r.generation, 1);
    assert_eq!(r.resources[0].credential_version, Some(1));
    assert!(!r.resources[0].recreated);
    tcp_query_at(
        pg_port,
        "app-main",
        &password,
        "app-main",
        "CREATE TABLE kept (x int); INSERT INTO kept VALUES (7)",
    )
    .unwrap();
    let db_oid = admin_query_at(
        &sock,
        pg_port,
        "SELECT oid FROM pg_database WHERE datname = 'app-main'",
    );
    let role_oid = admin_query_at(
        &sock,
        pg_port,
        "SELECT oid FROM pg_roles WHERE rolname = 'app-main'",
    );
    let metrics = common::scrape(metrics_port).await.unwrap();
    assert!(
        metrics.contains("mesh_agent_resources{state=\"ready\"} 1"),
        "{metrics}"
    );

    // 4. The agent restarts: no unit restarted, nothing created again, the
    //    grant stated again at once (from the store).
    agent.stop().await;
    let last_seq = ready.seq;
    let mut agent = AgentProcess::start(&config, &state, &log2);
    // Both come after the connect (units first); gather them whatever the order.
    let mut again = None;
    let mut units = None;
    while again.is_none() || units.is_none() {
        let (e, _) = next_report(&mut reports, "resources and units after the restart", |e| {
            e.seq > last_seq
                && (resources_of(e).is_some()
                    || unit_of(e, "pg").is_some_and(|u| u.state == UnitState::Running))
        })
        .await;
        if resources_of(&e).is_some() {
            again.get_or_insert(e);
        } else {
            units.get_or_insert(e);
        }
    }
    let (again, units) = (again.unwrap(), units.unwrap());
    assert_eq!(resources_of(&again).unwrap(), &r, "stated again, unchanged");
    let u = unit_of(&units, "pg").unwrap();
    assert_eq!(
        (u.state, u.pid, u.restarts),
        (UnitState::Running, Some(pg_pid), 0),
        "the agent's restart restarts no unit"
    );
    // The restarted agent's own pass (from its store) made nothing anew.
    wait_for_file("a pass after the restart", &log2, "provisioning pass done").await;
    assert_eq!(
        admin_query_at(
            &sock,
            pg_port,
            "SELECT oid FROM pg_database WHERE datname = 'app-main'"
        ),
        db_oid
    );
    assert_eq!(
        admin_query_at(
            &sock,
            pg_port,
            "SELECT oid FROM pg_roles WHERE rolname = 'app-main'"
        ),
        role_oid
    );
    assert_eq!(
        tcp_query_at(
            pg_port,
            "app-main",
            &password,
            "app-main",
            "SELECT x FROM kept"
        )
        .unwrap()
        .trim(),
        "7"
    );
    let store = mesh_host_agent::Store::open(&state).unwrap();
    assert_eq!(store.data().resources.as_ref(), Some(&r));
    drop(store);

    // 5. Revoked: the login is refused, the data kept; then the file goes.
    declare(
        Section::Provisioning,
        2,
        DeclarationItems {
            resources: vec![item(ResourceState::Revoked)],
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let (revoked, _) = next_report(&mut reports, "resources: revoked", |e| {
        resources_of(e).is_some_and(|r| r.generation == 2)
    })
    .await;
    let rv = resources_of(&revoked).unwrap();
    assert_eq!(
        rv.resources[0].state,
        ResourceStatusState::Revoked,
        "{rv:?}"
    );
    let refused = tcp_query_at(pg_port, "app-main", &password, "app-main", "SELECT 1").unwrap_err();
    assert!(refused.contains("not permitted to log in"), "{refused}");
    declare(Section::Config, 2, DeclarationItems::default())
        .await
        .unwrap();
    next_report(&mut reports, "config 2 applied", |e| {
        applied_of(e).is_some_and(|a| a.section == Some(Section::Config) && a.generation == Some(2))
    })
    .await;
    assert!(!root.join(credential_path.trim_start_matches('/')).exists());
    let metrics = common::scrape(metrics_port).await.unwrap();
    assert!(
        metrics.contains("mesh_agent_resources{state=\"revoked\"} 1")
            && metrics.contains("mesh_agent_resources{state=\"ready\"} 0"),
        "{metrics}"
    );
    assert_eq!(
        admin_query_at(
            &sock,
            pg_port,
            "SELECT count(*) FROM pg_database WHERE datname = 'app-main'"
        ),
        "1",
        "a revoked grant keeps its data"
    );

    // 6. The password is in no line either agent logged, nor in its store,
    //    nor in the server's output the unit's shim kept.
    agent.stop().await;
    agent.drain();
    let mut logged = 0;
    for log in [&log1, &log2] {
        let text = std::fs::read_to_string(log).unwrap();
        logged += text.lines().count();
        for line in text.lines() {
            assert!(
                !line.contains(&password),
                "a log line holds the password: {line}"
            );
        }
    }
    let text = std::fs::read_to_string(&log1).unwrap();
    assert!(
        text.contains("resource reconciled") && text.contains(&grant.to_string()),
        "the agent logs what it reconciled ({logged} lines)"
    );
    let store = std::fs::read_to_string(state.join("store.json")).unwrap();
    assert!(!store.contains(&password), "the store holds the password");
    for stream in ["stdout.log", "stderr.log"] {
        let out = std::fs::read_to_string(state.join("units/pg").join(stream)).unwrap_or_default();
        assert!(
            !out.contains(&password),
            "the server's {stream} holds the password"
        );
    }
    drop(reports);
    let _ = admin.close(200, "done".into()).await;
    env.teardown().await.unwrap();
}
