//! Resource grants end to end (issue 16, decision 0039): a real controller and
//! three real agents, each on a host of its own (network namespaces on one
//! LAN, addresses only on this machine). Host b runs three provider modules
//! whose units are real servers on b's LAN address: PostgreSQL (`pg`),
//! RabbitMQ (`mq`) and Garage (`s3`). Module `app` on host a requires a
//! database, a vhost and a bucket; module `other` on host c requires the same
//! kinds, so each credential can be shown refused on another grant's
//! resource.
//!
//! - Before any provider exists the grants wait, with a `grant_waiting`
//!   alert; it resolves once they are served.
//! - app's credential files (0600) arrive on a. From a's namespace, `psql`
//!   opens `app-db` over the LAN and writes, and is refused `other-db`; the
//!   vhost user publishes and consumes on its vhost and is refused the
//!   others; the key reads and writes its bucket and gets 403 on another.
//! - The provider's node gets its copies and none of app's other secrets; the
//!   consumer's node gets nothing of the providers'.
//! - app moved to host c: the credentials appear there, leave a, and work.
//! - meshctl lists and describes the grants.
//! - Revoke (the requirements removed): the login is refused, the vhost user
//!   and the key too; the files leave; the data is kept; the grant is
//!   `revoked` with `retain_until`.
//! - No credential in clear: not in any API answer, not in a dump of every
//!   schema (outboxes included: what crossed the broker), in clear or
//!   hex-encoded, and not in any log.
//!
//! - The failure modes: a request the provider refuses is `failed` in
//!   PostgreSQL's words with a `grant_failed` alert; a database dropped on
//!   the provider is re-created and the consumer's credential rotated (the
//!   old password refused); the provider's module stopped, the grant waits
//!   with a `grant_waiting` alert, and started again it is ready and the
//!   alert resolves. A grant's login is refused on the server's own
//!   `postgres` and `template1` too.
//!
//! Skipped, saying why, where not root, where the bundle's TLS is not
//! advertised beyond loopback, or where PostgreSQL's, RabbitMQ's or Garage's
//! binaries are missing (bundle/up installs the first two, bundle/garage
//! builds the third). With `MESH_REQUIRE_ALL` set (to anything but empty or
//! `0`; bundle/test sets it) each of these fails the test instead, so that CI
//! cannot pass without running it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context as _, anyhow, bail, ensure};
use mesh_e2e::netns::Lan;
use mesh_e2e::{AGENT_OFF_THE_OVERLAY, Mesh, Proc, output, wait_for};
use serde_json::{Value, json};

const WITHIN: Duration = Duration::from_secs(120);
const HOSTS: [&str; 3] = ["a", "b", "c"];
const PG_PORT: u16 = 5432;
const MQ_PORT: u16 = 5672;
const S3_PORT: u16 = 3900;
const GARAGE: &str = "/var/cache/mesh-ci/garage-2.5.0/bin/garage";

fn garage_bin() -> Option<PathBuf> {
    if Command::new("garage")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
    {
        return Some(PathBuf::from("garage"));
    }
    Path::new(GARAGE).exists().then(|| PathBuf::from(GARAGE))
}

/// Why this machine cannot run the test, if it cannot.
fn unavailable() -> Option<String> {
    if !rustix::process::geteuid().is_root() {
        return Some("not root".into());
    }
    if !Path::new("/usr/lib/rabbitmq/bin/rabbitmq-server").exists() {
        return Some("no /usr/lib/rabbitmq/bin/rabbitmq-server (rabbitmq-server)".into());
    }
    let pg = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| d.flatten().any(|e| e.path().join("bin/initdb").exists()))
        .unwrap_or(false);
    if !pg {
        return Some("no /usr/lib/postgresql/*/bin/initdb (postgresql)".into());
    }
    if garage_bin().is_none() {
        return Some(format!(
            "no garage binary ({GARAGE}: run bash bundle/garage)"
        ));
    }
    match mesh_testkit::bundle_tls() {
        Err(e) => Some(format!("no bundle TLS: {e}")),
        Ok(tls) if mesh_credentials::advertise::is_loopback_host(&tls.advertise_host) => {
            Some(format!(
                "bundle/up advertises {} (loopback): no other host can reach it",
                tls.advertise_host
            ))
        }
        Ok(_) => None,
    }
}

fn providers() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("providers")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grants_reach_exactly_their_consumer_follow_it_and_are_revoked() -> anyhow::Result<()> {
    if let Some(why) = unavailable() {
        return mesh_testkit::skip(&why);
    }
    let mut mesh = Mesh::start().await?;
    let lan = Lan::create(mesh.env.id(), &HOSTS)?;
    // The servers' directories: the postgres user must reach its data dir.
    let servers = tempfile::Builder::new()
        .prefix("mesh-providers")
        .tempdir()?;
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(servers.path(), std::fs::Permissions::from_mode(0o755))?;
    }
    let mut agents = Vec::new();
    let result = grants(&mut mesh, &lan, servers.path(), &mut agents).await;
    drop(agents);
    drop(lan);
    if let Err(e) = &result {
        eprintln!("failed: {e:#}");
        for h in HOSTS {
            let log = mesh.log_of(&format!("agent-{h}"));
            let lines: Vec<&str> = log.lines().collect();
            eprintln!(
                "--- agent {h}, last 60 lines ---\n{}",
                lines[lines.len().saturating_sub(60)..].join("\n")
            );
        }
        for (s, f) in [
            ("pg", "pg/server.log"),
            ("mq", "mq/server.log"),
            ("s3", "s3/server.log"),
        ] {
            let log = std::fs::read_to_string(servers.path().join(f)).unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            eprintln!(
                "--- server {s}, last 20 lines ---\n{}",
                lines[lines.len().saturating_sub(20)..].join("\n")
            );
        }
    }
    let torn = mesh.teardown().await;
    result?;
    torn
}

struct Host {
    node: String,
    root: PathBuf,
}

impl Host {
    fn file(&self, declared: &str) -> PathBuf {
        self.root.join(declared.trim_start_matches('/'))
    }
}

/// A module of one long sleeper pinned to `node`, with `extra` fields.
fn module(node: &str, unit: Value, extra: Value) -> Value {
    let mut m = json!({
        "unit": unit,
        "placement": {"exact_node": {"node": node}},
    });
    if let (Some(m), Some(extra)) = (m.as_object_mut(), extra.as_object()) {
        for (k, v) in extra {
            m.insert(k.clone(), v.clone());
        }
    }
    m
}

fn sleeper() -> Value {
    json!({"command": "sleep", "args": ["100000"]})
}

fn requires() -> Value {
    json!([
        {"kind": "postgres.database", "name": "db"},
        {"kind": "amqp.vhost", "name": "mq"},
        {"kind": "s3.bucket", "name": "files"},
    ])
}

async fn put_module(mesh: &Mesh, name: &str, spec: &Value) -> anyhow::Result<()> {
    let (status, body) = mesh.put(&format!("/v1/modules/{name}"), spec).await?;
    ensure!(
        status == 200 || status == 201,
        "PUT /v1/modules/{name}: {status} {body}"
    );
    Ok(())
}

/// Every grant of `module` (consumer or provider), from every page.
async fn grants_of(mesh: &Mesh, module: &str) -> anyhow::Result<Vec<Value>> {
    let (status, body) = mesh
        .get(&format!("/v1/grants?module={module}&limit=500"))
        .await?;
    ensure!(
        status == 200,
        "GET /v1/grants?module={module}: {status} {body}"
    );
    Ok(body["grants"].as_array().cloned().unwrap_or_default())
}

/// Until every grant of consumer `module` is in `state` (and there are `n`).
async fn wait_grants(
    mesh: &Mesh,
    module: &str,
    n: usize,
    state: &str,
) -> anyhow::Result<Vec<Value>> {
    wait_for(
        &format!("{n} grants of {module} {state}"),
        WITHIN,
        || async {
            let g: Vec<Value> = grants_of(mesh, module)
                .await?
                .into_iter()
                .filter(|g| g["consumer"] == module)
                .collect();
            let states: Vec<String> = g
                .iter()
                .map(|g| format!("{}={} ({})", g["requirement"], g["state"], g["reason"]))
                .collect();
            if g.len() == n && g.iter().all(|g| g["state"] == state) {
                Ok(Some(g))
            } else if g.iter().any(|g| g["state"] == "failed") && state != "failed" {
                Err(anyhow!("a grant failed: {}", states.join(", ")))
            } else {
                Err(anyhow!("{}", states.join(", ")))
            }
        },
    )
    .await
}

/// The env file at `path`, as key → value.
fn env_file(path: &Path) -> anyhow::Result<BTreeMap<String, String>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
    Ok(text
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect())
}

/// Until the file at `path` exists with mode 0400 (its module user's, decision
/// 0051), and holds credential
/// version ≥ `version`: its keys.
async fn wait_credentials(path: &Path, version: i64) -> anyhow::Result<BTreeMap<String, String>> {
    wait_for(&format!("{}", path.display()), WITHIN, || async {
        use std::os::unix::fs::PermissionsExt as _;
        let meta = std::fs::metadata(path)?;
        let mode = meta.permissions().mode() & 0o777;
        ensure!(mode == 0o400, "{} has mode {mode:o}", path.display());
        let env = env_file(path)?;
        let v: i64 = env
            .get("MESH_CREDENTIAL_VERSION")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        Ok((v >= version).then_some(env))
    })
    .await
}

async fn wait_gone(path: &Path) -> anyhow::Result<()> {
    wait_for(&format!("{} to go", path.display()), WITHIN, || async {
        Ok((!path.exists()).then_some(()))
    })
    .await
}

/// `psql` in host `ns` with the credential file's connection, running `sql`
/// against `database`: (ok, stdout and stderr).
fn psql_in(
    ns: &str,
    creds: &BTreeMap<String, String>,
    database: &str,
    sql: &str,
) -> (bool, String) {
    let mut cmd = Command::new("ip");
    cmd.args([
        "netns",
        "exec",
        ns,
        "psql",
        "-X",
        "-v",
        "ON_ERROR_STOP=1",
        "-tA",
        "-c",
        sql,
    ]);
    for k in ["PGHOST", "PGPORT", "PGUSER", "PGPASSWORD"] {
        cmd.env(k, creds.get(k).map(String::as_str).unwrap_or_default());
    }
    cmd.env("PGDATABASE", database)
        .env("PGCONNECT_TIMEOUT", "10");
    match output(&mut cmd) {
        Ok((code, out, err)) => (code == 0, format!("{out}{err}")),
        Err(e) => (false, e.to_string()),
    }
}

/// As the provider's local administrator, over its socket.
fn psql_admin(sock: &Path, database: &str, sql: &str) -> anyhow::Result<String> {
    let (code, out, err) = output(
        Command::new("psql")
            .args(["-X", "-tA", "-h"])
            .arg(sock)
            .args([
                "-p",
                &PG_PORT.to_string(),
                "-U",
                "postgres",
                "-d",
                database,
                "-c",
                sql,
            ]),
    )?;
    ensure!(code == 0, "psql as postgres: {err}");
    Ok(out.trim().to_owned())
}

/// Publish one message to a queue of `vhost` and get it back, as the
/// credential's user, over the LAN.
async fn amqp_roundtrip(
    addr: &str,
    creds: &BTreeMap<String, String>,
    vhost: &str,
) -> anyhow::Result<()> {
    use lapin::options::{BasicGetOptions, BasicPublishOptions, QueueDeclareOptions};
    let user = creds.get("AMQP_USER").context("AMQP_USER")?;
    let pw = creds.get("AMQP_PASSWORD").context("AMQP_PASSWORD")?;
    let url = format!(
        "amqp://{}:{}@{addr}:{MQ_PORT}/{}?connection_timeout=10000",
        urlencoding::encode(user),
        urlencoding::encode(pw),
        urlencoding::encode(vhost)
    );
    let conn = lapin::Connection::connect(&url, lapin::ConnectionProperties::default())
        .await
        .map_err(|e| anyhow!("connecting to {vhost}: {}", redact(&e.to_string(), pw)))?;
    let ch = conn.create_channel().await?;
    ch.queue_declare(
        "probe".into(),
        QueueDeclareOptions::default(),
        Default::default(),
    )
    .await?;
    ch.basic_publish(
        "".into(),
        "probe".into(),
        BasicPublishOptions::default(),
        b"hello",
        lapin::BasicProperties::default(),
    )
    .await?
    .await?;
    let got = wait_for("the probe message", Duration::from_secs(10), || async {
        Ok(ch
            .basic_get("probe".into(), BasicGetOptions { no_ack: true })
            .await?)
    })
    .await?;
    ensure!(got.delivery.data == b"hello", "got {:?}", got.delivery.data);
    let _ = conn.close(200, "bye".into()).await;
    Ok(())
}

fn redact(s: &str, secret: &str) -> String {
    s.replace(secret, "<password>")
}

/// One S3 request with the credential file's key, over the LAN: the status.
async fn s3(
    addr: &str,
    creds: &BTreeMap<String, String>,
    method: &str,
    path: &str,
    body: &[u8],
) -> anyhow::Result<u16> {
    let host = format!("{addr}:{S3_PORT}");
    let r = mesh_testkit::s3::Request {
        host: &host,
        region: "garage",
        key: creds
            .get("AWS_ACCESS_KEY_ID")
            .context("AWS_ACCESS_KEY_ID")?,
        secret: creds
            .get("AWS_SECRET_ACCESS_KEY")
            .context("AWS_SECRET_ACCESS_KEY")?,
        method,
        path,
        body,
    };
    let mut req = reqwest::Client::new()
        .request(method.parse()?, format!("http://{host}{path}"))
        .timeout(Duration::from_secs(10))
        .body(body.to_vec());
    for (k, v) in mesh_testkit::s3::signed_headers(&r, chrono::Utc::now()) {
        req = req.header(k, v);
    }
    Ok(req.send().await?.status().as_u16())
}

/// Every file under `dir` (relative paths), none when it does not exist.
fn files_under(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if let Ok(rel) = p.strip_prefix(dir) {
                out.push(rel.to_string_lossy().into_owned());
            }
        }
    }
    out.sort();
    out
}

async fn open_alerts(mesh: &Mesh, kind: &str) -> anyhow::Result<Vec<Value>> {
    let (status, body) = mesh
        .get(&format!("/v1/alerts?kind={kind}&state=open"))
        .await?;
    ensure!(status == 200, "GET /v1/alerts: {status} {body}");
    Ok(body["alerts"].as_array().cloned().unwrap_or_default())
}

async fn grants(
    mesh: &mut Mesh,
    lan: &Lan,
    servers: &Path,
    agents: &mut Vec<Proc>,
) -> anyhow::Result<()> {
    let mut hosts = Vec::new();
    for (i, name) in HOSTS.iter().enumerate() {
        let extra = format!("[provisioning]\ninterval = \"2s\"\n{AGENT_OFF_THE_OVERLAY}");
        let (host, agent) = lan.spawn_agent(mesh, i, name, &extra).await?;
        agents.push(agent);
        hosts.push(Host {
            node: host.node,
            root: host.root,
        });
    }
    let (a, b, c) = (&hosts[0], &hosts[1], &hosts[2]);
    let b_addr = lan.addr(1);

    // An operator's secret for app, and one for the provider module: neither
    // may reach the other's node.
    for (secret, module) in [("app-key", "app"), ("pg-key", "pg")] {
        let (status, body) = mesh
            .put(
                &format!("/v1/secrets/{secret}"),
                &json!({"value": format!("operator-{secret}")}),
            )
            .await?;
        ensure!(
            status == 200 || status == 201,
            "PUT /v1/secrets/{secret}: {status} {body}"
        );
        let (status, body) = mesh
            .put(&format!("/v1/modules/{module}/grants/{secret}"), &json!({}))
            .await?;
        ensure!(
            status == 200 || status == 201,
            "grant {secret}: {status} {body}"
        );
    }

    // 1. The consumers first: nothing provides yet, so the grants wait.
    put_module(
        mesh,
        "app",
        &module(&a.node, sleeper(), json!({"requires": requires()})),
    )
    .await?;
    put_module(
        mesh,
        "other",
        &module(&c.node, sleeper(), json!({"requires": requires()})),
    )
    .await?;
    let waiting = wait_grants(mesh, "app", 3, "requested").await?;
    for g in &waiting {
        ensure!(
            g["reason"]
                .as_str()
                .is_some_and(|r| r.contains("no module provides")),
            "{g}"
        );
    }
    wait_for("a grant_waiting alert", WITHIN, || async {
        let open = open_alerts(mesh, "grant_waiting").await?;
        Ok((!open.is_empty()).then_some(()))
    })
    .await?;

    // 2. The providers, each a real server run as a unit on host b.
    let pg_dir = servers.join("pg");
    let mq_dir = servers.join("mq");
    let s3_dir = servers.join("s3");
    let script = |name: &str| providers().join(name).to_string_lossy().into_owned();
    let log_wrap = |dir: &Path, args: Vec<String>| {
        // Each server logs to its directory (read on failure).
        let cmd = format!(
            "mkdir -p {dir} && exec \"$@\" >>{dir}/server.log 2>&1",
            dir = dir.display()
        );
        let mut all = vec!["-c".to_owned(), cmd, "server".to_owned()];
        all.extend(args);
        // A provider's server switches to its own user (postgres, rabbitmq,
        // garage's): it starts as root, which only an admin may ask for
        // (decision 0051).
        json!({"command": "sh", "args": all, "user": "root"})
    };
    let pg_unit = log_wrap(
        &pg_dir,
        vec![
            "bash".into(),
            script("postgres.sh"),
            pg_dir.display().to_string(),
            PG_PORT.to_string(),
            b_addr.clone(),
        ],
    );
    let mq_node = format!("prov-{}@localhost", mesh.env.id());
    let mq_unit = log_wrap(
        &mq_dir,
        vec![
            "bash".into(),
            script("rabbitmq.sh"),
            mq_dir.display().to_string(),
            MQ_PORT.to_string(),
            mq_node.clone(),
        ],
    );
    let s3_unit = log_wrap(
        &s3_dir,
        vec![
            "bash".into(),
            script("garage.sh"),
            s3_dir.display().to_string(),
            S3_PORT.to_string(),
            b_addr.clone(),
        ],
    );
    let provides = |kind: &str, port: u16, admin: Value| json!({"provides": [{"kind": kind, "host": b_addr, "port": port, "admin": admin}]});
    let pg_spec = module(
        &b.node,
        pg_unit,
        provides(
            "postgres.database",
            PG_PORT,
            json!({"server": "postgres", "socket_dir": pg_dir.join("sock").display().to_string()}),
        ),
    );
    put_module(mesh, "pg", &pg_spec).await?;
    put_module(
        mesh,
        "mq",
        &module(
            &b.node,
            mq_unit,
            provides(
                "amqp.vhost",
                MQ_PORT,
                json!({"server": "rabbitmq", "node": mq_node, "home": mq_dir.display().to_string()}),
            ),
        ),
    )
    .await?;
    put_module(
        mesh,
        "s3",
        &module(
            &b.node,
            s3_unit,
            provides(
                "s3.bucket",
                S3_PORT,
                json!({"server": "garage", "config": s3_dir.join("garage.toml").display().to_string()}),
            ),
        ),
    )
    .await?;

    let ready = wait_grants(mesh, "app", 3, "ready").await?;
    wait_grants(mesh, "other", 3, "ready").await?;
    for g in &ready {
        ensure!(g["provider_nodes"][0]["node"] == b.node.as_str(), "{g}");
        ensure!(g["consumer_nodes"] == json!([a.node]), "{g}");
    }
    wait_for("grant_waiting to resolve", WITHIN, || async {
        Ok(open_alerts(mesh, "grant_waiting")
            .await?
            .is_empty()
            .then_some(()))
    })
    .await?;

    // 3. app's credentials on a, each working on its own resource only.
    let db = wait_credentials(&a.file("/modules/app/secrets/grant-db.env"), 1).await?;
    let mq = wait_credentials(&a.file("/modules/app/secrets/grant-mq.env"), 1).await?;
    let files = wait_credentials(&a.file("/modules/app/secrets/grant-files.env"), 1).await?;
    ensure!(
        db.get("PGDATABASE").map(String::as_str) == Some("app-db"),
        "{:?}",
        db.keys()
    );
    ensure!(
        db.get("PGHOST") == Some(&b_addr),
        "PGHOST is not b's address"
    );
    let (ok, out) = psql_in(
        lan.ns(0),
        &db,
        "app-db",
        "CREATE TABLE IF NOT EXISTS kept (v text); INSERT INTO kept VALUES ('still here'); SELECT count(*) FROM kept",
    );
    ensure!(
        ok,
        "app's login on app-db from a: {}",
        redact(&out, &db["PGPASSWORD"])
    );
    let (ok, out) = psql_in(lan.ns(0), &db, "other-db", "SELECT 1");
    ensure!(!ok, "app's login opened other-db: {out}");
    ensure!(!out.contains(&db["PGPASSWORD"]), "psql echoed the password");
    // Nor the provider server's own databases.
    for own in ["postgres", "template1"] {
        let (ok, out) = psql_in(lan.ns(0), &db, own, "SELECT 1");
        ensure!(
            !ok && out.contains("permission denied"),
            "app's login on {own}: {}",
            redact(&out, &db["PGPASSWORD"])
        );
    }

    let vhost = mq.get("AMQP_VHOST").context("AMQP_VHOST")?.clone();
    ensure!(vhost == "app-mq", "AMQP_VHOST {vhost}");
    amqp_roundtrip(&b_addr, &mq, "app-mq").await?;
    ensure!(
        amqp_roundtrip(&b_addr, &mq, "other-mq").await.is_err(),
        "app's vhost user reached other-mq"
    );
    ensure!(
        amqp_roundtrip(&b_addr, &mq, "/").await.is_err(),
        "app's vhost user reached the default vhost"
    );

    let bucket = files.get("S3_BUCKET").context("S3_BUCKET")?.clone();
    ensure!(bucket == "app-files", "S3_BUCKET {bucket}");
    let put = s3(&b_addr, &files, "PUT", "/app-files/hello.txt", b"hello").await?;
    ensure!(put == 200, "PUT into app-files: {put}");
    let get = s3(&b_addr, &files, "GET", "/app-files/hello.txt", b"").await?;
    ensure!(get == 200, "GET from app-files: {get}");
    let other = s3(&b_addr, &files, "PUT", "/other-files/x.txt", b"x").await?;
    ensure!(other == 403, "PUT into other-files with app's key: {other}");
    let other = s3(&b_addr, &files, "GET", "/other-files/x.txt", b"").await?;
    ensure!(other == 403, "GET from other-files with app's key: {other}");

    // 4. Each node holds exactly its modules' secrets.
    let on_b = files_under(&b.root.join("modules"));
    ensure!(
        on_b.iter()
            .all(|f| !f.starts_with("app/") && !f.starts_with("other/")),
        "b holds a consumer's file: {on_b:?}"
    );
    ensure!(
        on_b.iter().filter(|f| f.contains("grant-")).count() >= 6,
        "b lacks the providers' copies of the six credentials: {on_b:?}"
    );
    ensure!(
        on_b.iter().any(|f| f == "pg/secrets/pg-key"),
        "b lacks pg-key: {on_b:?}"
    );
    let on_a = files_under(&a.root.join("modules"));
    ensure!(
        on_a.iter().all(|f| f.starts_with("app/")),
        "a holds another module's file: {on_a:?}"
    );
    ensure!(
        on_a.iter().any(|f| f == "app/secrets/app-key"),
        "a lacks app-key: {on_a:?}"
    );

    // 5. meshctl against the live controller.
    let (code, out, err) = mesh.meshctl(&["get", "grants", "--module", "app"])?;
    ensure!(code == 0, "meshctl get grants: {code} {err}");
    ensure!(
        out.contains("app") && out.contains("postgres.database") && out.contains("ready"),
        "meshctl get grants:\n{out}"
    );
    let (code, out, err) = mesh.meshctl(&["describe", "grant", "app/db"])?;
    ensure!(code == 0, "meshctl describe grant app/db: {code} {err}");
    ensure!(
        out.contains("app-db") && out.contains(&b.node),
        "describe:\n{out}"
    );

    // 6. app moves to host c: its credentials follow it and work there.
    put_module(
        mesh,
        "app",
        &module(&c.node, sleeper(), json!({"requires": requires()})),
    )
    .await?;
    let moved = wait_credentials(&c.file("/modules/app/secrets/grant-db.env"), 1).await?;
    wait_gone(&a.file("/modules/app/secrets/grant-db.env")).await?;
    wait_gone(&a.file("/modules/app/secrets/grant-mq.env")).await?;
    wait_gone(&a.file("/modules/app/secrets/grant-files.env")).await?;
    let (ok, out) = psql_in(lan.ns(2), &moved, "app-db", "SELECT v FROM kept");
    ensure!(
        ok && out.contains("still here"),
        "app's login from c: {}",
        redact(&out, &moved["PGPASSWORD"])
    );

    // 7. Every credential, to look for.
    let mut secrets: Vec<String> = Vec::new();
    // Both consumers run on c by now.
    for owner in ["app", "other"] {
        let host = c;
        for (file, key) in [
            ("db", "PGPASSWORD"),
            ("mq", "AMQP_PASSWORD"),
            ("files", "AWS_SECRET_ACCESS_KEY"),
        ] {
            let env = wait_credentials(
                &host.file(&format!("/modules/{owner}/secrets/grant-{file}.env")),
                1,
            )
            .await?;
            let s = env
                .get(key)
                .with_context(|| format!("{owner} {file}: no {key}"))?;
            ensure!(s.len() >= 32, "{owner} {file}: a short secret");
            secrets.push(s.clone());
        }
    }

    // 8. Revoke: app requires nothing any more.
    put_module(mesh, "app", &module(&c.node, sleeper(), json!({}))).await?;
    let revoked = wait_grants(mesh, "app", 3, "revoked").await?;
    for g in &revoked {
        ensure!(
            g["retain_until"].is_string(),
            "a revoked grant without retain_until: {g}"
        );
    }
    wait_gone(&c.file("/modules/app/secrets/grant-db.env")).await?;
    wait_gone(&c.file("/modules/app/secrets/grant-mq.env")).await?;
    wait_gone(&c.file("/modules/app/secrets/grant-files.env")).await?;
    wait_for("app's login to be refused", WITHIN, || async {
        let (ok, _) = psql_in(lan.ns(2), &moved, "app-db", "SELECT 1");
        Ok((!ok).then_some(()))
    })
    .await?;
    wait_for("app's vhost user to be refused", WITHIN, || async {
        Ok(amqp_roundtrip(&b_addr, &mq, "app-mq")
            .await
            .is_err()
            .then_some(()))
    })
    .await?;
    wait_for("app's key to be refused", WITHIN, || async {
        let s = s3(&b_addr, &files, "GET", "/app-files/hello.txt", b"").await?;
        Ok((s == 403).then_some(()))
    })
    .await?;
    // The data is kept.
    let kept = psql_admin(&pg_dir.join("sock"), "app-db", "SELECT v FROM kept")?;
    ensure!(
        kept == "still here",
        "app-db after the revocation: {kept:?}"
    );
    // other's grants are untouched.
    let others = wait_grants(mesh, "other", 3, "ready").await?;
    ensure!(others.len() == 3, "{others:?}");

    // 9. No credential in clear, anywhere.
    let mut answers = String::new();
    for path in [
        "/v1/grants?limit=500",
        "/v1/secrets",
        "/v1/modules",
        "/v1/modules/app",
        "/v1/modules/other",
        "/v1/audit?limit=100",
    ] {
        let (status, body) = mesh.get(path).await?;
        answers.push_str(&format!("{path} {status} {body}\n"));
    }
    for g in revoked.iter().chain(&others) {
        let id = g["id"].as_str().unwrap_or_default();
        let (_, body) = mesh.get(&format!("/v1/grants/{id}")).await?;
        answers.push_str(&body.to_string());
    }
    let dump = output(
        Command::new("pg_dump")
            .arg("--data-only")
            .arg(mesh.env.admin_database_url()),
    )?;
    ensure!(dump.0 == 0, "pg_dump: {}", dump.2);
    ensure!(
        dump.1.contains("provisioning"),
        "the dump holds no provisioning schema"
    );
    let mut logs = mesh.controller_log();
    for h in HOSTS {
        logs.push_str(&mesh.log_of(&format!("agent-{h}")));
    }
    for f in ["pg/server.log", "mq/server.log", "s3/server.log"] {
        logs.push_str(&std::fs::read_to_string(servers.join(f)).unwrap_or_default());
    }
    for (i, s) in secrets.iter().enumerate() {
        let hexed = hex::encode(s.as_bytes());
        for (what, text) in [
            ("an API answer", &answers),
            ("the database", &dump.1),
            ("a log", &logs),
        ] {
            if text.contains(s.as_str()) || text.contains(&hexed) {
                bail!("credential {i} is in {what} in clear");
            }
        }
    }

    // 10. The failure modes, through the agents, the API and the alerts.
    failure_modes(mesh, lan, c, &pg_dir, &pg_spec).await
}

/// The grant of consumer `module` for `requirement`, as the API has it.
async fn grant_of(mesh: &Mesh, module: &str, requirement: &str) -> anyhow::Result<Value> {
    grants_of(mesh, module)
        .await?
        .into_iter()
        .find(|g| g["consumer"] == module && g["requirement"] == requirement)
        .with_context(|| format!("no grant {module}/{requirement}"))
}

/// Until an open alert of `kind` names grant `name` (`module/requirement`),
/// or (`open` false) none does.
async fn wait_grant_alert(mesh: &Mesh, kind: &str, name: &str, open: bool) -> anyhow::Result<()> {
    let what = format!(
        "{kind} for {name} {}",
        if open { "open" } else { "resolved" }
    );
    wait_for(&what, WITHIN, || async {
        let named = open_alerts(mesh, kind)
            .await?
            .iter()
            .any(|a| a["message"].as_str().is_some_and(|m| m.contains(name)));
        Ok((named == open).then_some(()))
    })
    .await
}

/// Issue 16's failure modes, on `other`'s database grant (its consumer on
/// host c) and on a third consumer's: a request the provider refuses, a
/// resource the provider lost, and the provider down.
async fn failure_modes(
    mesh: &Mesh,
    lan: &Lan,
    c: &Host,
    pg_dir: &Path,
    pg_spec: &Value,
) -> anyhow::Result<()> {
    let sock = pg_dir.join("sock");

    // a. A request the provider refuses: failed, in PostgreSQL's words, and
    //    alerted.
    put_module(
        mesh,
        "bad",
        &module(
            &c.node,
            sleeper(),
            json!({"requires": [{"kind": "postgres.database", "name": "db", "options": {"encoding": "BOGUS"}}]}),
        ),
    )
    .await?;
    let failed = wait_grants(mesh, "bad", 1, "failed").await?;
    ensure!(
        failed[0]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("BOGUS is not a valid encoding name")),
        "the refusal's reason: {}",
        failed[0]
    );
    wait_grant_alert(mesh, "grant_failed", "bad/db", true).await?;

    // b. A provider that lost a resource: re-created, and the consumer's
    //    credential rotated (the old password refused, the new one opens it).
    let path = c.file("/modules/other/secrets/grant-db.env");
    let before = grant_of(mesh, "other", "db").await?;
    let version = before["credential_version"]
        .as_i64()
        .context("credential_version")?;
    let old = wait_credentials(&path, version).await?;
    psql_admin(&sock, "postgres", "DROP DATABASE \"other-db\" WITH (FORCE)")?;
    let new = wait_credentials(&path, version + 1).await?;
    ensure!(
        new["PGPASSWORD"] != old["PGPASSWORD"],
        "the rotated credential has the old password"
    );
    wait_for(
        "other's rotated credential to open other-db",
        WITHIN,
        || async {
            let (ok, _) = psql_in(lan.ns(2), &new, "other-db", "SELECT 1");
            Ok(ok.then_some(()))
        },
    )
    .await?;
    let (ok, out) = psql_in(lan.ns(2), &old, "other-db", "SELECT 1");
    ensure!(
        !ok,
        "the rotated-out password still opens other-db: {}",
        redact(&out, &old["PGPASSWORD"])
    );
    wait_for("other/db ready at the new version", WITHIN, || async {
        let g = grant_of(mesh, "other", "db").await?;
        Ok(
            (g["state"] == "ready" && g["credential_version"].as_i64() > Some(version))
                .then_some(()),
        )
    })
    .await?;

    // c. The provider down (its module stopped by the operator): the grant
    //    waits, alerted; started again, it is ready and the alert resolves.
    let mut stopped = pg_spec.clone();
    stopped["desired"] = json!("stopped");
    put_module(mesh, "pg", &stopped).await?;
    wait_for("other/db to wait for its provider", WITHIN, || async {
        let g = grant_of(mesh, "other", "db").await?;
        ensure!(
            g["state"] == "provisioning" || g["state"] == "requested",
            "other/db is {} ({})",
            g["state"],
            g["reason"]
        );
        Ok(Some(()))
    })
    .await?;
    wait_grant_alert(mesh, "grant_waiting", "other/db", true).await?;
    let (ok, _) = psql_in(lan.ns(2), &new, "other-db", "SELECT 1");
    ensure!(!ok, "other-db answered with its provider stopped");
    put_module(mesh, "pg", pg_spec).await?;
    wait_grants(mesh, "other", 3, "ready").await?;
    wait_grant_alert(mesh, "grant_waiting", "other/db", false).await?;
    let (ok, out) = psql_in(lan.ns(2), &new, "other-db", "SELECT 1");
    ensure!(
        ok,
        "other's login after the provider's return: {}",
        redact(&out, &new["PGPASSWORD"])
    );
    Ok(())
}
