//! The config context against a real PostgreSQL, one fresh database per test.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use mesh_bundle::testkit::TestEnv;
use mesh_config::{Config, ConfigSettings};
use mesh_plumbing::{Context, OutboxSignal};
use mesh_protocol::{
    Applied, Declaration, Envelope, Heartbeat, Hello, Labels, MAX_DECLARATION_BYTES, NodeId,
    NodeLabelsChanged, Outcome, RecordEvent, Report, Section,
};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tower::ServiceExt;

struct Fixture {
    env: TestEnv,
    pool: PgPool,
    config: Arc<Config>,
}

async fn setup() -> Fixture {
    let env = TestEnv::new().await.unwrap();
    let url = env.database_url("config");
    let applied = mesh_config::migrate(&url).await.unwrap();
    assert!(!applied.is_empty());
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .unwrap();
    let config = Arc::new(Config::new(
        pool.clone(),
        OutboxSignal::default(),
        ConfigSettings::default(),
    ));
    Fixture { env, pool, config }
}

fn node(f: &Fixture, suffix: &str) -> NodeId {
    NodeId::parse(&format!("{}-{suffix}", f.env.id())).unwrap()
}

fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

async fn node_event(f: &Fixture, event: &str, node: &NodeId, l: Labels, version: i64) {
    let body = NodeLabelsChanged {
        node: node.clone(),
        labels: l,
        version,
    };
    let event = RecordEvent::new("inventory", event, &body);
    let mut tx = f.pool.begin().await.unwrap();
    f.config.handle_event(&mut tx, &event).await.unwrap();
    tx.commit().await.unwrap();
}

async fn handle(f: &Fixture, reports: &[Envelope<Report>]) {
    let mut tx = f.pool.begin().await.unwrap();
    f.config.handle_reports(&mut tx, reports).await.unwrap();
    tx.commit().await.unwrap();
}

/// Declarations in the outbox after row id `after`: (outbox id, node, declaration).
async fn declarations(f: &Fixture, after: i64) -> Vec<(i64, String, Declaration)> {
    let rows: Vec<(i64, String, String, String, Vec<u8>)> = sqlx::query_as(
        "SELECT id, node, routing_key, exchange, payload FROM config.outbox WHERE id > $1 ORDER BY id",
    )
    .bind(after)
    .fetch_all(&f.pool)
    .await
    .unwrap();
    rows.into_iter()
        .map(|(id, node, key, exchange, payload)| {
            assert_eq!(exchange, "declarations");
            assert_eq!(node, key);
            let env = Envelope::<Declaration>::decode(&payload, MAX_DECLARATION_BYTES).unwrap();
            assert_eq!(env.node.as_str(), node);
            assert_eq!(env.seq, env.body.generation);
            (id, node, env.body)
        })
        .collect()
}

async fn last_outbox_id(f: &Fixture) -> i64 {
    sqlx::query_scalar("SELECT coalesce(max(id), 0) FROM config.outbox")
        .fetch_one(&f.pool)
        .await
        .unwrap()
}

async fn request(
    f: &Fixture,
    method: &str,
    uri: &str,
    body: &str,
) -> (StatusCode, String, serde_json::Value) {
    let response = f
        .config
        .clone()
        .routes()
        .split_for_parts()
        .0
        .oneshot(
            Request::builder()
                .method(method)
                .uri(uri)
                .header("content-type", "application/json")
                .body(Body::from(body.to_owned()))
                .unwrap(),
        )
        .await
        .unwrap();
    let status = response.status();
    let content_type = response
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    let json = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
    (status, content_type, json)
}

fn hello(node: &NodeId, config_applied: u64) -> Envelope<Report> {
    Envelope::new(
        node.clone(),
        1,
        Report::Hello(Hello {
            hostname: "h".into(),
            arch: "x86_64".into(),
            cpus: 1,
            memory_bytes: 1 << 30,
            labels: Labels::new(),
            agent_version: "0.1.0".into(),
            public_key: None,
            applied: [(Section::Config, config_applied)].into_iter().collect(),
        }),
    )
}

fn heartbeat(node: &NodeId, config_applied: u64) -> Envelope<Report> {
    Envelope::new(
        node.clone(),
        2,
        Report::Heartbeat(Heartbeat {
            applied: [(Section::Config, config_applied)].into_iter().collect(),
        }),
    )
}

#[tokio::test]
async fn migrating_twice_is_a_no_op() {
    let f = setup().await;
    let again = mesh_config::migrate(&f.env.database_url("config"))
        .await
        .unwrap();
    assert!(again.is_empty(), "{again:?}");
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn selector_files_follow_labels() {
    let f = setup().await;
    let (a, b, c) = (node(&f, "a"), node(&f, "b"), node(&f, "c"));
    node_event(&f, "node.joined", &a, labels(&[("role", "web")]), 1).await;
    node_event(&f, "node.joined", &b, labels(&[("role", "db")]), 1).await;
    node_event(
        &f,
        "node.joined",
        &c,
        labels(&[("role", "web"), ("zone", "x")]),
        1,
    )
    .await;
    assert!(
        declarations(&f, 0).await.is_empty(),
        "no files, nothing declared"
    );

    let body = r#"{"path": "/etc/web.conf", "content": "v1", "mode": "0644", "selector": {"role": "web"}}"#;
    let (status, _, file) = request(&f, "PUT", "/v1/files/web", body).await;
    assert_eq!(status, StatusCode::CREATED, "{file}");
    assert_eq!(file["mode"], "0644");
    let d = declarations(&f, 0).await;
    let mut to: Vec<&str> = d.iter().map(|(_, n, _)| n.as_str()).collect();
    to.sort();
    assert_eq!(to, vec![a.as_str(), c.as_str()]);
    for (_, _, decl) in &d {
        assert_eq!(decl.section, Section::Config);
        assert_eq!(decl.generation, 1);
        assert_eq!(decl.items.files.len(), 1);
        assert_eq!(decl.items.files[0].content, "v1");
        assert_eq!(decl.items.files[0].mode.bits(), 0o644);
    }

    // b is labelled web later: it gets the file.
    let mark = last_outbox_id(&f).await;
    node_event(&f, "node.updated", &b, labels(&[("role", "web")]), 2).await;
    let d = declarations(&f, mark).await;
    assert_eq!(d.len(), 1);
    assert_eq!(d[0].1, b.as_str());
    assert_eq!(d[0].2.generation, 1);

    // A redelivered old event (version 1, role=db) is ignored.
    let mark = last_outbox_id(&f).await;
    node_event(&f, "node.joined", &b, labels(&[("role", "db")]), 1).await;
    node_event(&f, "node.updated", &b, labels(&[("role", "db")]), 2).await;
    assert!(declarations(&f, mark).await.is_empty());
    let stored: sqlx::types::Json<Labels> =
        sqlx::query_scalar("SELECT labels FROM config.nodes WHERE node = $1")
            .bind(b.as_str())
            .fetch_one(&f.pool)
            .await
            .unwrap();
    assert_eq!(stored.0, labels(&[("role", "web")]));

    // Same body again: 200, nothing declared.
    let mark = last_outbox_id(&f).await;
    let (status, _, _) = request(&f, "PUT", "/v1/files/web", body).await;
    assert_eq!(status, StatusCode::OK);
    assert!(declarations(&f, mark).await.is_empty());

    // New content: generation 2 for all three.
    let (status, _, _) = request(
        &f,
        "PUT",
        "/v1/files/web",
        r#"{"path": "/etc/web.conf", "content": "v2", "mode": "600", "selector": {"role": "web"}}"#,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let d = declarations(&f, mark).await;
    assert_eq!(d.len(), 3);
    assert!(
        d.iter()
            .all(|(_, _, decl)| decl.generation == 2 && decl.items.files[0].content == "v2")
    );

    // b leaves the role: it gets an empty section.
    let mark = last_outbox_id(&f).await;
    node_event(&f, "node.updated", &b, labels(&[]), 3).await;
    let d = declarations(&f, mark).await;
    assert_eq!(d.len(), 1);
    assert_eq!((d[0].2.generation, d[0].2.items.files.len()), (3, 0));

    // Delete: a and c get an empty generation 3; b has nothing to lose.
    let mark = last_outbox_id(&f).await;
    let (status, _, _) = request(&f, "DELETE", "/v1/files/web", "").await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let d = declarations(&f, mark).await;
    let mut to: Vec<&str> = d.iter().map(|(_, n, _)| n.as_str()).collect();
    to.sort();
    assert_eq!(to, vec![a.as_str(), c.as_str()]);
    assert!(
        d.iter()
            .all(|(_, _, decl)| decl.generation == 3 && decl.items.files.is_empty())
    );
    let (status, ct, _) = request(&f, "DELETE", "/v1/files/web", "").await;
    assert_eq!(
        (status, ct.as_str()),
        (StatusCode::NOT_FOUND, "application/problem+json")
    );
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn node_file_beats_selector_file_for_the_same_path() {
    let f = setup().await;
    let (a, b) = (node(&f, "a"), node(&f, "b"));
    node_event(&f, "node.joined", &a, labels(&[]), 1).await;
    node_event(&f, "node.joined", &b, labels(&[]), 1).await;
    let all = r#"{"path": "/etc/p", "content": "all", "mode": "0644", "selector": {}}"#;
    let other = r#"{"path": "/etc/p", "content": "zzz", "mode": "0644", "selector": {}}"#;
    let only_a =
        format!(r#"{{"path": "/etc/p", "content": "only-a", "mode": "0640", "node": "{a}"}}"#);
    assert_eq!(
        request(&f, "PUT", "/v1/files/z-only-a", &only_a).await.0,
        StatusCode::CREATED
    );
    assert_eq!(
        request(&f, "PUT", "/v1/files/b-all", all).await.0,
        StatusCode::CREATED
    );
    assert_eq!(
        request(&f, "PUT", "/v1/files/c-all", other).await.0,
        StatusCode::CREATED
    );
    let d = declarations(&f, 0).await;
    let newest = |n: &NodeId| {
        d.iter()
            .rev()
            .find(|(_, node, _)| node == n.as_str())
            .unwrap()
            .2
            .clone()
    };
    assert_eq!(newest(&a).items.files[0].content, "only-a");
    assert_eq!(
        newest(&b).items.files[0].content,
        "all",
        "smallest file name wins between selectors"
    );
    let status = f.config.section(&a).await.unwrap().unwrap();
    assert_eq!(status.paths, vec!["/etc/p".to_owned()]);
    assert_eq!(status.generation, 1);
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn behind_nodes_are_sent_their_section_again() {
    let f = setup().await;
    let a = node(&f, "a");
    node_event(&f, "node.joined", &a, labels(&[]), 1).await;
    let body = r#"{"path": "/etc/p", "content": "x", "mode": "0644", "selector": {}}"#;
    request(&f, "PUT", "/v1/files/p", body).await;
    let first = declarations(&f, 0).await;
    assert_eq!(first.len(), 1);

    // Hello, behind: re-sent at once, same generation and items.
    let mark = last_outbox_id(&f).await;
    handle(&f, &[hello(&a, 0)]).await;
    let d = declarations(&f, mark).await;
    assert_eq!(d.len(), 1);
    assert_eq!(d[0].2, first[0].2);

    // Heartbeat, behind, but sent just now: not yet.
    let mark = last_outbox_id(&f).await;
    handle(&f, &[heartbeat(&a, 0), heartbeat(&a, 0)]).await;
    assert!(declarations(&f, mark).await.is_empty());
    // ... once resend_after has passed: once per batch.
    sqlx::query("UPDATE config.sections SET last_sent_at = now() - interval '1 minute'")
        .execute(&f.pool)
        .await
        .unwrap();
    handle(&f, &[heartbeat(&a, 0), heartbeat(&a, 0)]).await;
    let d = declarations(&f, mark).await;
    assert_eq!(d.len(), 1);
    assert_eq!(d[0].2, first[0].2);

    // Up to date: nothing, and the applied generation is recorded.
    let mark = last_outbox_id(&f).await;
    sqlx::query("UPDATE config.sections SET last_sent_at = now() - interval '1 minute'")
        .execute(&f.pool)
        .await
        .unwrap();
    handle(&f, &[heartbeat(&a, 1), hello(&a, 1)]).await;
    assert!(declarations(&f, mark).await.is_empty());
    assert_eq!(
        f.config
            .section(&a)
            .await
            .unwrap()
            .unwrap()
            .applied_generation,
        1
    );

    // Behind but sent just now while its applied generation advances: the
    // advance is recorded, nothing is re-sent.
    sqlx::query(
        "UPDATE config.sections SET generation = 2, applied_generation = 0, last_sent_at = now()",
    )
    .execute(&f.pool)
    .await
    .unwrap();
    handle(&f, &[heartbeat(&a, 1)]).await;
    assert!(declarations(&f, mark).await.is_empty());
    let s = f.config.section(&a).await.unwrap().unwrap();
    assert_eq!((s.generation, s.applied_generation), (2, 1));
    sqlx::query("UPDATE config.sections SET generation = 1")
        .execute(&f.pool)
        .await
        .unwrap();

    // Ahead (the database was restored from an older backup): a new generation above it.
    handle(&f, &[hello(&a, 7)]).await;
    let d = declarations(&f, mark).await;
    assert_eq!(d.len(), 1);
    assert_eq!(d[0].2.generation, 8);
    assert_eq!(d[0].2.items, first[0].2.items);

    // Applied reports.
    let applied = |generation, outcome, error: Option<&str>| {
        Envelope::new(
            a.clone(),
            3,
            Report::Applied(Applied {
                section: Some(Section::Config),
                generation: Some(generation),
                outcome,
                items: vec![],
                error: error.map(str::to_owned),
            }),
        )
    };
    handle(&f, &[applied(8, Outcome::Failed, Some("disk full"))]).await;
    let s = f.config.section(&a).await.unwrap().unwrap();
    assert_eq!(
        (s.generation, s.outcome.as_deref(), s.error.as_deref()),
        (8, Some("failed"), Some("disk full"))
    );
    assert_eq!(s.applied_generation, 7);
    handle(&f, &[applied(8, Outcome::Applied, None)]).await;
    let s = f.config.section(&a).await.unwrap().unwrap();
    assert_eq!(
        (s.applied_generation, s.outcome.as_deref(), s.error),
        (8, Some("applied"), None)
    );
    assert!(
        f.config
            .section(&node(&f, "nobody"))
            .await
            .unwrap()
            .is_none()
    );
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn api_errors_are_problems_naming_the_field() {
    let f = setup().await;
    let ok = r#""path": "/etc/x", "content": "c", "mode": "0644""#;
    let cases: Vec<(&str, String, &str)> = vec![
        (
            "/v1/files/Bad%20Name",
            format!(r#"{{{ok}, "selector": {{}}}}"#),
            "name",
        ),
        (
            "/v1/files/x",
            r#"{"path": "etc/x", "content": "c", "mode": "0644", "selector": {}}"#.into(),
            "path",
        ),
        (
            "/v1/files/x",
            r#"{"path": "/etc/../x", "content": "c", "mode": "0644", "selector": {}}"#.into(),
            "path",
        ),
        (
            "/v1/files/x",
            r#"{"path": "/etc/x", "content": "c", "mode": "0999", "selector": {}}"#.into(),
            "mode",
        ),
        (
            "/v1/files/x",
            r#"{"path": "/etc/x", "content": "c", "mode": "17777", "selector": {}}"#.into(),
            "mode",
        ),
        ("/v1/files/x", format!(r#"{{{ok}}}"#), "node"),
        (
            "/v1/files/x",
            format!(r#"{{{ok}, "node": "n1", "selector": {{}}}}"#),
            "selector",
        ),
        (
            "/v1/files/x",
            format!(r#"{{{ok}, "node": "Not_A_Node"}}"#),
            "node",
        ),
        (
            "/v1/files/x",
            format!(r#"{{{ok}, "selector": {{"Bad": "x"}}}}"#),
            "selector.Bad",
        ),
        (
            "/v1/files/x",
            format!(r#"{{{ok}, "selector": {{}}, "owner": "root"}}"#),
            "owner",
        ),
        (
            "/v1/files/x",
            r#"{"content": "c", "mode": "0644", "selector": {}}"#.into(),
            "path",
        ),
        (
            "/v1/files/x",
            r#"{"path": "/etc/x", "content": "c", "mode": 420, "selector": {}}"#.into(),
            "mode",
        ),
        (
            "/v1/files/x",
            format!(
                r#"{{"path": "/etc/x", "content": "{}", "mode": "0644", "selector": {{}}}}"#,
                "a".repeat(300_000)
            ),
            "content",
        ),
    ];
    for (uri, body, field) in cases {
        let (status, ct, problem) = request(&f, "PUT", uri, &body).await;
        assert_eq!(
            status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{field}: {problem}"
        );
        assert_eq!(ct, "application/problem+json");
        assert_eq!(problem["field"], field, "{problem}");
    }
    let (status, ct, _) = request(&f, "PUT", "/v1/files/x", "{not json").await;
    assert_eq!(
        (status, ct.as_str()),
        (StatusCode::BAD_REQUEST, "application/problem+json")
    );
    let (status, ct, _) = request(&f, "GET", "/v1/files/missing", "").await;
    assert_eq!(
        (status, ct.as_str()),
        (StatusCode::NOT_FOUND, "application/problem+json")
    );

    // Nothing was stored by any of these.
    let (status, _, list) = request(&f, "GET", "/v1/files", "").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(list["files"], serde_json::json!([]));

    let (status, _, _) = request(
        &f,
        "PUT",
        "/v1/files/good.conf_1",
        &format!(r#"{{{ok}, "node": "n1"}}"#),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED);
    let (_, _, file) = request(&f, "GET", "/v1/files/good.conf_1", "").await;
    assert_eq!(file["node"], "n1");
    assert_eq!(file["content"], "c");
    let (_, _, list) = request(&f, "GET", "/v1/files", "").await;
    assert_eq!(list["files"][0]["size"], 1);
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn a_file_change_for_thousands_of_nodes_is_one_bulk_reconcile() {
    let f = setup().await;
    let n = 10_000;
    let prefix = f.env.id().to_owned();
    sqlx::query(
        "INSERT INTO config.nodes (node, labels, version) \
         SELECT $1 || '-n' || i, CASE WHEN i % 2 = 0 THEN '{\"role\": \"web\"}'::jsonb ELSE '{}'::jsonb END, 1 \
         FROM generate_series(1, $2) AS i",
    )
    .bind(&prefix)
    .bind(n)
    .execute(&f.pool)
    .await
    .unwrap();
    let started = Instant::now();
    let body = r#"{"path": "/etc/web.conf", "content": "v1", "mode": "0644", "selector": {"role": "web"}}"#;
    assert_eq!(
        request(&f, "PUT", "/v1/files/web", body).await.0,
        StatusCode::CREATED
    );
    let took = started.elapsed();
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM config.outbox")
        .fetch_one(&f.pool)
        .await
        .unwrap();
    assert_eq!(count, i64::from(n / 2));
    eprintln!("reconciled {n} nodes, declared {count}, in {took:?}");
    assert!(took < Duration::from_secs(20), "{took:?}");
    let report = f.config.resync().await.unwrap();
    assert_eq!((report.nodes, report.declared), (n as usize, 0));
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn roles_cannot_cross_schemas() {
    let f = setup().await;
    let inventory = PgPoolOptions::new()
        .max_connections(1)
        .connect(&f.env.database_url("inventory"))
        .await
        .unwrap();
    let err = sqlx::query("SELECT count(*) FROM config.files")
        .execute(&inventory)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("permission denied"), "{err}");
    let err = sqlx::query("SELECT count(*) FROM inventory.nodes")
        .execute(&f.pool)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("permission denied"), "{err}");
    inventory.close().await;
    f.env.teardown().await.unwrap();
}
