//! What the controller tells about itself (docs/observability.md): its
//! metrics, checked against the page's table both ways; the depth of its
//! queues, read from the broker into a gauge and a watch; and its logs: the
//! real binary with `--log-format json` writes one JSON object per line, one
//! access log line per request, with the request id that the response header
//! and the audit entry carry.
//!
//! Real parts only: an isolated environment of the test kit (database, roles,
//! vhost), the real broker, the `mesh-controller` binary this crate builds.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, anyhow};
use lapin::options::BasicPublishOptions;
use lapin::{BasicProperties, Connection, ConnectionProperties};
use mesh_controller::broker_stats::{self, QueueDepths};
use mesh_controller::metrics::Metrics;
use mesh_protocol::topology::{DEAD_LETTER_EXCHANGE, DEAD_LETTER_QUEUE};
use mesh_testkit::TestEnv;
use prometheus_client::registry::Registry;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

const WITHIN: Duration = Duration::from_secs(30);

/// Poll `check` until it gives a value, or fail after `within` naming `what`.
async fn wait_for<T, F, Fut>(what: &str, within: Duration, mut check: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<Option<T>>>,
{
    let deadline = Instant::now() + within;
    let mut last = None;
    loop {
        match check().await {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last = Some(e),
        }
        if Instant::now() >= deadline {
            return Err(anyhow!(
                "timed out after {within:?} waiting for {what} (last error: {last:?})"
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The family names docs/observability.md's controller table lists (first
/// column, in backticks), as a scrape shows them (counters with `_total`).
fn documented_families() -> anyhow::Result<BTreeSet<String>> {
    let page = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/observability.md"),
    )?;
    let section = page
        .split("\n### The controller's\n")
        .nth(1)
        .ok_or_else(|| anyhow!("no section \"### The controller's\""))?;
    let section = section.split("\n#").next().unwrap_or(section);
    let names: BTreeSet<String> = section
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .filter(|n| n.starts_with("mesh_controller_"))
        .map(str::to_owned)
        .collect();
    anyhow::ensure!(!names.is_empty(), "the controller's table lists nothing");
    Ok(names)
}

/// The families a scrape declares (`# TYPE`), counters named with `_total`
/// as their samples are.
fn served_families(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| {
            let mut parts = l.split(' ');
            let name = parts.next()?;
            Some(match parts.next()? {
                "counter" => format!("{name}_total"),
                _ => name.to_owned(),
            })
        })
        .collect()
}

fn render(registry: &Registry) -> String {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry).unwrap_or_default();
    text
}

/// The value of the sample `line_prefix` (name and labels, exactly), if any.
fn sample(text: &str, line_prefix: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(line_prefix)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

#[test]
fn every_registered_family_is_documented_and_every_documented_one_registered() -> anyhow::Result<()>
{
    let mut registry = Registry::default();
    let metrics = Metrics::new(&mut registry);
    let registered: BTreeSet<String> = metrics.families().iter().cloned().collect();
    assert_eq!(registered.len(), metrics.families().len(), "a family twice");
    assert_eq!(
        documented_families()?,
        registered,
        "docs/observability.md's controller table and controller/src/metrics.rs differ"
    );
    // What a scrape of families that have series declares is what was
    // registered under those names.
    let served = served_families(&render(&registry));
    assert!(!served.is_empty());
    assert!(served.is_subset(&registered), "{served:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_database_gauges_oldest_unsent_outbox_row_and_nodes_per_state() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("credentials.toml");
    env.write_controller_credentials(&path)?;
    let creds = mesh_controller::config::Credentials::load(&path)?;
    mesh_controller::router::Contexts::migrate(&creds).await?;
    let pool = sqlx::PgPool::connect(&env.database_url("identity")).await?;
    use mesh_plumbing::outbox;
    assert_eq!(outbox::oldest_unsent(&pool, "identity").await?, None);
    let ids: Vec<i64> = sqlx::query_scalar(
        "INSERT INTO identity.outbox (message_id, exchange, routing_key, kind, payload, created_at) \
         VALUES (gen_random_uuid(), 'record', 'identity.test', 'test', '\\x00', now() - interval '5 seconds'), \
                (gen_random_uuid(), 'record', 'identity.test', 'test', '\\x00', now()) RETURNING id",
    )
    .fetch_all(&pool)
    .await?;
    let age = outbox::oldest_unsent(&pool, "identity")
        .await?
        .ok_or_else(|| anyhow!("no age with two rows unsent"))?;
    assert!((5.0..60.0).contains(&age), "{age}");
    outbox::mark_sent(&pool, "identity", &ids[..1]).await?;
    let age = outbox::oldest_unsent(&pool, "identity")
        .await?
        .ok_or_else(|| anyhow!("no age with one row unsent"))?;
    assert!((0.0..5.0).contains(&age), "{age}");
    outbox::mark_sent(&pool, "identity", &ids).await?;
    assert_eq!(outbox::oldest_unsent(&pool, "identity").await?, None);
    pool.close().await;

    // Nodes per state, as GET /v1/nodes names them; every state present.
    let contexts = mesh_controller::router::Contexts::connect(
        &creds,
        &mesh_controller::config::Settings::default(),
        mesh_plumbing::OutboxSignal::default(),
    )
    .await?;
    let inventory = sqlx::PgPool::connect(&env.database_url("inventory")).await?;
    for (id, state, admin_state) in [
        ("n-1", "alive", "active"),
        ("n-2", "alive", "active"),
        ("n-3", "unreachable", "active"),
        ("n-4", "unreachable", "revoked"),
        ("n-5", "alive", "draining"),
    ] {
        sqlx::query(
            "INSERT INTO inventory.nodes (id, hostname, arch, cpus, memory_bytes, agent_version, state, admin_state) \
             VALUES ($1, $1, 'x86_64', 1, 1, 'test', $2, $3)",
        )
        .bind(id)
        .bind(state)
        .bind(admin_state)
        .execute(&inventory)
        .await?;
    }
    inventory.close().await;
    let counts = contexts.inventory.node_counts().await?;
    for (_, pool) in contexts.schemas() {
        pool.close().await;
    }
    drop(contexts);
    let want: Vec<(String, i64)> = [
        ("alive", 2),
        ("unreachable", 1),
        ("draining", 1),
        ("drained", 0),
        ("refused", 0),
        ("revoked", 1),
    ]
    .into_iter()
    .map(|(s, n)| (s.to_owned(), n))
    .collect();
    assert_eq!(counts, want);
    let mut registry = Registry::default();
    let metrics = Metrics::new(&mut registry);
    metrics.set_node_counts(&counts);
    let text = render(&registry);
    assert_eq!(
        sample(&text, "mesh_controller_nodes{state=\"alive\"}"),
        Some(2.0)
    );
    assert_eq!(
        sample(&text, "mesh_controller_nodes{state=\"drained\"}"),
        Some(0.0)
    );
    env.teardown().await
}

#[tokio::test(flavor = "multi_thread")]
async fn queue_depths_reach_the_gauge_and_the_watch() -> anyhow::Result<()> {
    const N: u64 = 25;
    let env = TestEnv::new().await?;
    let conn = std::sync::Arc::new(
        Connection::connect(&env.controller_amqp_url(), ConnectionProperties::default()).await?,
    );
    let ch = mesh_controller::amqp::confirm_channel(&conn).await?;
    mesh_controller::amqp::declare_topology(
        &ch,
        &[],
        &[],
        mesh_controller::amqp::QueueType::Classic,
    )
    .await?;
    for n in 0..N {
        let confirm = ch
            .basic_publish(
                DEAD_LETTER_EXCHANGE.into(),
                "".into(),
                BasicPublishOptions::default(),
                format!("poison {n}").as_bytes(),
                BasicProperties::default(),
            )
            .await?;
        anyhow::ensure!(confirm.await?.is_ack(), "the broker refused message {n}");
    }

    let mut registry = Registry::default();
    let metrics = Metrics::new(&mut registry);
    let (tx, mut rx) = tokio::sync::watch::channel(None::<QueueDepths>);
    // A queue that does not exist first: its passive declare closes the
    // channel, and every queue after it is still read, on a fresh one.
    let mut queues = vec!["record.no-such-context".to_owned()];
    queues.extend(broker_stats::watched_queues(&[]));
    let shutdown = CancellationToken::new();
    let stats = tokio::spawn(broker_stats::run(
        conn.clone(),
        queues,
        Duration::from_millis(200),
        metrics,
        tx,
        shutdown.clone(),
    ));

    let reading = wait_for("the dead-letter depth in the watch", WITHIN, || {
        let current = rx.borrow_and_update().clone();
        async move { Ok(current.filter(|d| d.dead_letter() == Some(N))) }
    })
    .await?;
    assert_eq!(reading.get("record.no-such-context"), None);
    assert_eq!(reading.get("reports.hello"), Some(0));
    assert_eq!(reading.get("reports.unroutable"), Some(0));
    assert!(reading.above_warning().is_empty(), "{reading:?}");
    assert!(chrono::Utc::now() - reading.at < chrono::TimeDelta::seconds(30));
    let line = format!("mesh_controller_queue_messages{{queue=\"{DEAD_LETTER_QUEUE}\"}}");
    wait_for("the dead-letter gauge", WITHIN, || {
        let found = sample(&render(&registry), &line);
        async move { Ok((found == Some(N as f64)).then_some(())) }
    })
    .await?;
    let text = render(&registry);
    assert!(
        !text.contains("record.no-such-context"),
        "a queue that could not be read has no gauge: {text}"
    );

    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(10), stats).await??;
    let _ = conn.close(200, "done".into()).await;
    env.teardown().await
}

/// The controller binary, killed when dropped.
struct Controller(Child);

impl Drop for Controller {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_running_controller_logs_counts_and_audits_each_request_by_its_id() -> anyhow::Result<()>
{
    let env = TestEnv::new().await?;
    let dir = tempfile::tempdir()?;
    let credentials = dir.path().join("credentials.toml");
    env.write_controller_credentials(&credentials)?;
    let port = free_port()?;
    let settings = dir.path().join("controller.toml");
    std::fs::write(
        &settings,
        format!(
            "credentials = {credentials:?}\napi_listen = \"127.0.0.1:{port}\"\nrelay_poll_ms = 200\nshutdown_deadline_secs = 3\nbroker_stats_secs = 1\n"
        ),
    )?;
    let log_path = dir.path().join("controller.log");
    let log = std::fs::File::create(&log_path)?;
    let controller = Controller(
        Command::new(env!("CARGO_BIN_EXE_mesh-controller"))
            .arg("--config")
            .arg(&settings)
            .args(["--log-format", "json", "run"])
            .env("RUST_LOG", "info,mesh_controller=debug")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("spawning mesh-controller")?,
    );
    let api = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()?;
    wait_for(
        "the controller to be healthy",
        Duration::from_secs(60),
        || {
            let r = http.get(format!("{api}/healthz")).send();
            async move { Ok(r.await?.status().is_success().then_some(())) }
        },
    )
    .await
    .with_context(|| std::fs::read_to_string(&log_path).unwrap_or_default())?;
    let admin = env.admin_token().to_owned();

    // A trusted id comes back, and the audit entry of the change carries it.
    let id = uuid::Uuid::new_v4();
    let r = http
        .post(format!("{api}/v1/tokens"))
        .bearer_auth(&admin)
        .header("x-request-id", id.to_string())
        .json(&json!({"name": "observer", "role": "viewer"}))
        .send()
        .await?;
    assert_eq!(r.status(), 201);
    assert_eq!(r.headers()["x-request-id"], id.to_string().as_str());
    let entry = wait_for("the audit entry with the request id", WITHIN, || {
        let r = http
            .get(format!(
                "{api}/v1/audit?action=POST%20/v1/tokens&outcome=ok"
            ))
            .bearer_auth(&admin)
            .send();
        async move {
            let page: Value = r.await?.json().await?;
            Ok(page["entries"]
                .as_array()
                .and_then(|e| e.iter().find(|e| e["request_id"] == id.to_string()))
                .cloned())
        }
    })
    .await?;
    assert_eq!(entry["target"], "/v1/tokens");

    // An untrusted id is replaced; the access log keeps the client's value.
    let r = http
        .get(format!("{api}/v1/nodes/no-such-node"))
        .bearer_auth(&admin)
        .header("x-request-id", "bad id \"quoted\"")
        .send()
        .await?;
    assert_eq!(r.status(), 404);
    let replaced = r.headers()["x-request-id"].to_str()?.to_owned();
    uuid::Uuid::parse_str(&replaced).context("a new id is a UUID")?;
    // No route: counted as `unmatched`, never by its raw path.
    let r = http.get(format!("{api}/no/such/path/123")).send().await?;
    assert_eq!(r.status(), 404);
    assert!(r.headers().contains_key("x-request-id"));
    // No token: 401, logged and counted with its route.
    let r = http.get(format!("{api}/v1/nodes")).send().await?;
    assert_eq!(r.status(), 401);

    // The metrics: every documented family, nothing undocumented, the
    // requests by route pattern, the broker's and the database's gauges.
    let text = wait_for("the gauges of the stats tasks", WITHIN, || {
        let r = http.get(format!("{api}/metrics")).send();
        async move {
            let text = r.await?.text().await?;
            let ready = sample(&text, "mesh_controller_queue_messages{queue=\"dead-letter\"}")
                .is_some()
                && sample(&text, "mesh_controller_nodes{state=\"alive\"}").is_some()
                && sample(
                    &text,
                    "mesh_controller_handler_duration_seconds_count{context=\"identity\",kind=\"record\"}",
                )
                .is_some();
            Ok(ready.then_some(text))
        }
    })
    .await?;
    // Every family served is documented (those with no series yet are not
    // in a scrape: `every_registered_family_is_documented` covers them).
    let documented = documented_families()?;
    let served = served_families(&text);
    let undocumented: Vec<_> = served.difference(&documented).collect();
    assert!(
        undocumented.is_empty(),
        "/metrics serves families docs/observability.md does not list: {undocumented:?}"
    );
    for always in [
        "mesh_controller_build_info",
        "mesh_controller_broker_connected",
        "mesh_controller_queue_messages",
        "mesh_controller_nodes",
        "mesh_controller_modules",
        "mesh_controller_http_requests_total",
        "mesh_controller_http_request_duration_seconds",
        "mesh_controller_handler_duration_seconds",
        "mesh_controller_outbox_oldest_unsent_seconds",
    ] {
        assert!(served.contains(always), "{always} not served:\n{text}");
    }
    for (line, want) in [
        (
            "mesh_controller_http_requests_total{route=\"/v1/tokens\",method=\"POST\",status=\"201\"}",
            1.0,
        ),
        (
            "mesh_controller_http_requests_total{route=\"/v1/nodes/{id}\",method=\"GET\",status=\"404\"}",
            1.0,
        ),
        (
            "mesh_controller_http_requests_total{route=\"unmatched\",method=\"GET\",status=\"404\"}",
            1.0,
        ),
        (
            "mesh_controller_http_requests_total{route=\"/v1/nodes\",method=\"GET\",status=\"401\"}",
            1.0,
        ),
        (
            "mesh_controller_http_request_duration_seconds_count{route=\"/v1/nodes/{id}\",method=\"GET\"}",
            1.0,
        ),
        ("mesh_controller_broker_connected", 1.0),
        ("mesh_controller_nodes{state=\"alive\"}", 0.0),
        ("mesh_controller_modules{health=\"unknown\"}", 0.0),
        ("mesh_controller_api_unauthenticated_total", 1.0),
    ] {
        assert_eq!(sample(&text, line), Some(want), "{line} in:\n{text}");
    }
    assert!(
        !text.contains("no-such-node") && !text.contains("/no/such/path"),
        "a raw path in the metrics"
    );
    assert!(
        text.contains(&format!(
            "mesh_controller_build_info{{version=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION")
        )),
        "{text}"
    );
    assert!(
        sample(
            &text,
            "mesh_controller_outbox_oldest_unsent_seconds{context=\"identity\"}"
        )
        .is_some(),
        "{text}"
    );

    // The log: every line one JSON object; one access line per request.
    let access = wait_for("the access log lines", WITHIN, || {
        let log = std::fs::read_to_string(&log_path);
        async move {
            let mut access = Vec::new();
            for line in log?.lines().filter(|l| !l.trim().is_empty()) {
                let v: Value = serde_json::from_str(line)
                    .with_context(|| format!("a log line that is not JSON: {line}"))?;
                if v["target"] == "mesh_controller::access" {
                    access.push(v["fields"].clone());
                }
            }
            Ok((access.len() >= 4).then_some(access))
        }
    })
    .await?;
    let find = |pred: &dyn Fn(&Value) -> bool| access.iter().find(|f| pred(f)).cloned();
    let token = find(&|f| f["request_id"] == id.to_string())
        .ok_or_else(|| anyhow!("no access line with {id}: {access:?}"))?;
    assert_eq!(token["method"], "POST");
    assert_eq!(token["route"], "/v1/tokens");
    assert_eq!(token["status"], 201);
    assert!(token["latency_ms"].as_f64().is_some(), "{token}");
    assert!(token.get("client_request_id").is_none(), "{token}");
    let untrusted = find(&|f| f["request_id"] == replaced.as_str())
        .ok_or_else(|| anyhow!("no access line with {replaced}: {access:?}"))?;
    assert_eq!(untrusted["route"], "/v1/nodes/{id}");
    assert_eq!(untrusted["status"], 404);
    assert_eq!(untrusted["client_request_id"], "bad id \\\"quoted\\\"");
    assert!(
        find(&|f| f["route"] == "unmatched" && f["status"] == 404).is_some(),
        "{access:?}"
    );
    assert!(
        find(&|f| f["route"] == "/v1/nodes" && f["status"] == 401).is_some(),
        "{access:?}"
    );

    drop(controller);

    // The default format is text: the same access line, as key=value (the
    // first /healthz may answer 503, before the broker session is up).
    let text_log = dir.path().join("controller-text.log");
    let log = std::fs::File::create(&text_log)?;
    let controller = Controller(
        Command::new(env!("CARGO_BIN_EXE_mesh-controller"))
            .arg("--config")
            .arg(&settings)
            .arg("run")
            .env("RUST_LOG", "info")
            .env_remove("MESH_LOG_FORMAT")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("spawning mesh-controller")?,
    );
    let id = uuid::Uuid::now_v7();
    wait_for("a text access line", Duration::from_secs(60), || {
        let r = http
            .get(format!("{api}/healthz"))
            .header("x-request-id", id.to_string())
            .send();
        let log = std::fs::read_to_string(&text_log);
        async move {
            let _ = r.await;
            let log = log?;
            Ok(log
                .lines()
                .find(|l| {
                    l.contains("mesh_controller::access")
                        && l.contains(&id.to_string())
                        && l.contains("status=200")
                })
                .map(str::to_owned))
        }
    })
    .await
    .map(|line| {
        assert!(serde_json::from_str::<Value>(&line).is_err(), "{line}");
        assert!(line.contains("route=\"/healthz\""), "{line}");
    })?;
    drop(controller);
    env.teardown().await
}
