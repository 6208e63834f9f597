//! The config context against a real PostgreSQL, one fresh database per test.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use mesh_config::{Config, ConfigSettings, SECTIONS};
use mesh_plumbing::section::{self, Items};
use mesh_plumbing::{Context, OutboxSignal};
use mesh_protocol::{
    Applied, Declaration, DeclarationItems, Envelope, FileItem, FileMode, Heartbeat, Hello, Labels,
    MAX_DECLARATION_BYTES, NodeId, NodeLabelsChanged, Outcome, RecordEvent, RecordKind, Report,
    Section,
};
use mesh_testkit::TestEnv;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tower::ServiceExt;

/// What the controller's auth layer puts in every authenticated request.
fn audit(method: &str, uri: &str) -> mesh_plumbing::audit::Audit {
    let principal = mesh_plumbing::api::Principal {
        id: uuid::Uuid::now_v7(),
        name: "tester".into(),
        role: mesh_plumbing::api::Role::Admin,
    };
    mesh_plumbing::audit::Audit::new(
        principal,
        format!("{method} {uri}"),
        uri,
        uuid::Uuid::now_v7(),
    )
}

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
    let keyring = mesh_config::Keyring::load(Some(env.master_keys_path())).unwrap();
    let config = Arc::new(Config::new(
        pool.clone(),
        OutboxSignal::default(),
        ConfigSettings::default(),
        keyring,
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
    let event = RecordEvent::new(match event {
        "node.joined" => RecordKind::NodeJoined(body),
        "node.updated" => RecordKind::NodeUpdated(body),
        other => panic!("not a labels event: {other}"),
    });
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
        "SELECT id, node, routing_key, exchange, payload FROM config.outbox \
         WHERE id > $1 AND exchange = 'declarations' ORDER BY id",
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

/// A request as an admin; a PUT creates or replaces whatever is there
/// (`If-Match: *`, then without a precondition when there is nothing to
/// replace). Tests of preconditions use [`request_with`].
async fn request(
    f: &Fixture,
    method: &str,
    uri: &str,
    body: &str,
) -> (StatusCode, String, serde_json::Value) {
    if method == "PUT" {
        let (status, ct, json, _) = request_with(f, method, uri, body, &[("if-match", "*")]).await;
        if status != StatusCode::PRECONDITION_FAILED {
            return (status, ct, json);
        }
    }
    let (status, ct, json, _) = request_with(f, method, uri, body, &[]).await;
    (status, ct, json)
}

/// A request as an admin with `headers`: (status, content type, body, ETag).
async fn request_with(
    f: &Fixture,
    method: &str,
    uri: &str,
    body: &str,
    headers: &[(&str, &str)],
) -> (StatusCode, String, serde_json::Value, Option<String>) {
    request_as(
        f,
        method,
        uri,
        body,
        headers,
        mesh_plumbing::api::Role::Admin,
    )
    .await
}

/// [`request_with`] as a token of `role`.
async fn request_as(
    f: &Fixture,
    method: &str,
    uri: &str,
    body: &str,
    headers: &[(&str, &str)],
    role: mesh_plumbing::api::Role,
) -> (StatusCode, String, serde_json::Value, Option<String>) {
    let principal = mesh_plumbing::api::Principal {
        id: uuid::Uuid::now_v7(),
        name: "tester".into(),
        role,
    };
    let audit = mesh_plumbing::audit::Audit::new(
        principal,
        format!("{method} {uri}"),
        uri,
        uuid::Uuid::now_v7(),
    );
    let mut builder = Request::builder()
        .method(method)
        .uri(uri)
        .header("content-type", "application/json")
        .extension(audit);
    for (k, v) in headers {
        builder = builder.header(*k, *v);
    }
    let response = f
        .config
        .clone()
        .routes()
        .split_for_parts()
        .0
        .oneshot(builder.body(Body::from(body.to_owned())).unwrap())
        .await
        .unwrap();
    let status = response.status();
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .map(|v| v.to_str().unwrap().to_owned())
    };
    let content_type = header("content-type").unwrap_or_default();
    let etag = header("etag");
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    let json = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
    (status, content_type, json, etag)
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
            seal_key: None,
            overlay: None,
            applied: [(Section::Config, config_applied)].into_iter().collect(),
            protocol: None,
            outage: None,
            metrics: None,
        }),
    )
}

fn heartbeat(node: &NodeId, config_applied: u64) -> Envelope<Report> {
    Envelope::new(
        node.clone(),
        2,
        Report::Heartbeat(Heartbeat {
            interval_ms: None,
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

    // Up to date: nothing.
    let mark = last_outbox_id(&f).await;
    sqlx::query("UPDATE config.sections SET last_sent_at = now() - interval '1 minute'")
        .execute(&f.pool)
        .await
        .unwrap();
    handle(&f, &[heartbeat(&a, 1), hello(&a, 1)]).await;
    assert!(declarations(&f, mark).await.is_empty());

    // Ahead (the database was restored from an older backup): a new generation above it.
    handle(&f, &[hello(&a, 7)]).await;
    let d = declarations(&f, mark).await;
    assert_eq!(d.len(), 1);
    assert_eq!(d[0].2.generation, 8);
    assert_eq!(d[0].2.items, first[0].2.items);
    let s = f.config.section(&a).await.unwrap().unwrap();
    assert_eq!((s.generation, &s.paths), (8, &vec!["/etc/p".to_owned()]));

    // Applied reports are inventory's record: config's section is unchanged.
    let mark = last_outbox_id(&f).await;
    let applied = Envelope::new(
        a.clone(),
        3,
        Report::Applied(Applied {
            section: Some(Section::Config),
            generation: Some(8),
            outcome: Outcome::Failed,
            items: vec![],
            error: Some("disk full".into()),
            unsupported_section: None,
        }),
    );
    handle(&f, &[applied]).await;
    assert_eq!(f.config.section(&a).await.unwrap().unwrap(), s);
    assert!(declarations(&f, mark).await.is_empty());
    assert!(
        f.config
            .section(&node(&f, "nobody"))
            .await
            .unwrap()
            .is_none()
    );
    f.env.teardown().await.unwrap();
}

// The section component (mesh_plumbing::section), on config's table.

fn items(files: &[(&str, &str)]) -> Items {
    Items::new(DeclarationItems {
        heartbeat: None,
        files: files
            .iter()
            .map(|(path, content)| FileItem {
                path: (*path).to_owned(),
                content: (*content).to_owned(),
                mode: FileMode::new(0o644).unwrap(),
            })
            .collect(),
        ..DeclarationItems::default()
    })
    .unwrap()
}

async fn declare(f: &Fixture, desired: Vec<(NodeId, Items)>) -> section::Declared {
    let mut tx = f.pool.begin().await.unwrap();
    let report = SECTIONS.declare(&mut tx, desired).await.unwrap();
    tx.commit().await.unwrap();
    report
}

/// (generation, last_sent_at) of `node`'s row.
async fn row(f: &Fixture, node: &NodeId) -> Option<(i64, chrono::DateTime<chrono::Utc>)> {
    sqlx::query_as("SELECT generation, last_sent_at FROM config.sections WHERE node = $1")
        .bind(node.as_str())
        .fetch_optional(&f.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn section_generation_grows_only_when_the_digest_changes() {
    let f = setup().await;
    let (a, b, c) = (node(&f, "a"), node(&f, "b"), node(&f, "c"));
    let x = items(&[("/etc/x", "1"), ("/etc/y", "2")]);
    let report = declare(
        &f,
        vec![
            (a.clone(), x.clone()),
            (b.clone(), x.clone()),
            (c.clone(), items(&[])),
        ],
    )
    .await;
    // c: nothing stored and nothing desired, nothing declared.
    assert_eq!((report.nodes, report.declared), (3, 2));
    let d = declarations(&f, 0).await;
    assert_eq!(d.len(), 2);
    assert!(d.iter().all(|(_, _, decl)| decl.generation == 1
        && decl.section == Section::Config
        && decl.items == *x.items()));
    assert_eq!(row(&f, &c).await, None);

    // The same items, in another order: same digest, nothing declared.
    let mark = last_outbox_id(&f).await;
    let reordered = items(&[("/etc/y", "2"), ("/etc/x", "1")]);
    assert_eq!(reordered.digest(), x.digest());
    let report = declare(&f, vec![(a.clone(), reordered), (b.clone(), x.clone())]).await;
    assert_eq!(report.declared, 0);
    assert!(declarations(&f, mark).await.is_empty());

    // a changes: generation 2 for a alone.
    let report = declare(
        &f,
        vec![(a.clone(), items(&[("/etc/x", "changed")])), (b.clone(), x)],
    )
    .await;
    assert_eq!(report.declared, 1);
    let d = declarations(&f, mark).await;
    assert_eq!(
        (d.len(), d[0].1.as_str(), d[0].2.generation),
        (1, a.as_str(), 2)
    );

    // Everything goes away: an empty generation 3, so the agent removes it.
    let mark = last_outbox_id(&f).await;
    declare(&f, vec![(a.clone(), items(&[]))]).await;
    let d = declarations(&f, mark).await;
    assert_eq!((d.len(), d[0].2.generation), (1, 3));
    assert!(d[0].2.items.files.is_empty());

    // Too large for an agent: reported (declared all the same; callers decide).
    let big = "x".repeat(200_000);
    let huge: Vec<(String, &str)> = (0..6)
        .map(|i| (format!("/etc/big{i}"), big.as_str()))
        .collect();
    let huge: Vec<(&str, &str)> = huge.iter().map(|(p, c)| (p.as_str(), *c)).collect();
    let report = declare(&f, vec![(b.clone(), items(&huge))]).await;
    assert_eq!(report.too_large.len(), 1, "{report:?}");
    assert_eq!(report.too_large[0].0, b.as_str());
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn section_hello_resends_to_a_node_behind_and_jumps_above_one_ahead() {
    let f = setup().await;
    let (a, b, stranger) = (node(&f, "a"), node(&f, "b"), node(&f, "stranger"));
    let x = items(&[("/etc/x", "1")]);
    declare(&f, vec![(a.clone(), x.clone()), (b.clone(), x.clone())]).await;
    let (_, sent) = row(&f, &a).await.unwrap();

    // a behind (0), b current (1), a stranger with no section: a alone, at
    // once, same generation and items, marked sent now.
    let mark = last_outbox_id(&f).await;
    let mut tx = f.pool.begin().await.unwrap();
    let n = SECTIONS
        .on_hello(&mut tx, &[hello(&a, 0), hello(&b, 1), hello(&stranger, 0)])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(n, 1);
    let d = declarations(&f, mark).await;
    assert_eq!(d.len(), 1);
    assert_eq!((d[0].1.as_str(), d[0].2.generation), (a.as_str(), 1));
    assert_eq!(d[0].2.items, *x.items());
    assert!(row(&f, &a).await.unwrap().1 > sent);

    // b ahead (a restore lost its generations 2..=7): generation 8, same items;
    // a node with two hellos in a batch counts with its last.
    let mark = last_outbox_id(&f).await;
    handle(&f, &[hello(&b, 0), hello(&b, 7)]).await;
    let d = declarations(&f, mark).await;
    assert_eq!(d.len(), 1, "{d:?}");
    assert_eq!((d[0].1.as_str(), d[0].2.generation), (b.as_str(), 8));
    assert_eq!(d[0].2.items, *x.items());
    assert_eq!(row(&f, &b).await.unwrap().0, 8);
    // The next change goes on from there.
    declare(&f, vec![(b.clone(), items(&[("/etc/x", "2")]))]).await;
    assert_eq!(row(&f, &b).await.unwrap().0, 9);
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn section_heartbeat_resends_after_resend_after_and_catches_up_a_node_ahead() {
    let f = setup().await;
    let (a, b) = (node(&f, "a"), node(&f, "b"));
    let x = items(&[("/etc/x", "1")]);
    declare(&f, vec![(a.clone(), x.clone()), (b.clone(), x.clone())]).await;
    let beat = |reports: Vec<Envelope<Report>>| {
        let pool = f.pool.clone();
        async move {
            let mut tx = pool.begin().await.unwrap();
            let n = SECTIONS
                .on_heartbeat(&mut tx, &reports, Duration::from_secs(30))
                .await
                .unwrap();
            tx.commit().await.unwrap();
            n
        }
    };

    // Behind, but sent just now: nothing.
    let mark = last_outbox_id(&f).await;
    assert_eq!(beat(vec![heartbeat(&a, 0)]).await, 0);
    assert!(declarations(&f, mark).await.is_empty());

    // Sent longer than resend_after ago: once per batch, whatever the number of
    // heartbeats in it; a node that is current is left alone.
    sqlx::query("UPDATE config.sections SET last_sent_at = now() - interval '1 minute'")
        .execute(&f.pool)
        .await
        .unwrap();
    let n = beat(vec![heartbeat(&a, 0), heartbeat(&a, 0), heartbeat(&b, 1)]).await;
    assert_eq!(n, 1);
    let d = declarations(&f, mark).await;
    assert_eq!(
        (d.len(), d[0].1.as_str(), d[0].2.generation),
        (1, a.as_str(), 1)
    );
    // ... and not again within resend_after.
    assert_eq!(beat(vec![heartbeat(&a, 0)]).await, 0);

    // Ahead (b's row was restored to generation 1; b holds 4): at once, whatever
    // the last send, generation 5.
    let mark = last_outbox_id(&f).await;
    assert_eq!(beat(vec![heartbeat(&b, 4)]).await, 1);
    let d = declarations(&f, mark).await;
    assert_eq!(
        (d.len(), d[0].1.as_str(), d[0].2.generation),
        (1, b.as_str(), 5)
    );
    assert_eq!(row(&f, &b).await.unwrap().0, 5);
    // Now behind, and just sent: nothing more.
    assert_eq!(beat(vec![heartbeat(&b, 4)]).await, 0);
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn resync_repairs_a_section_changed_or_lost_behind_its_back() {
    let f = setup().await;
    let (a, b) = (node(&f, "a"), node(&f, "b"));
    node_event(&f, "node.joined", &a, labels(&[]), 1).await;
    node_event(&f, "node.joined", &b, labels(&[]), 1).await;
    let body = r#"{"path": "/etc/p", "content": "x", "mode": "0644", "selector": {}}"#;
    request(&f, "PUT", "/v1/files/p", body).await;
    let first = declarations(&f, 0).await;
    assert_eq!(first.len(), 2);
    assert_eq!(
        section::resync(&*f.config).await.unwrap().declared,
        0,
        "nothing differs"
    );

    // a's row says other items; b's row is gone.
    sqlx::query(
        "UPDATE config.sections SET digest = 'tampered', items = '{\"files\": []}' WHERE node = $1",
    )
    .bind(a.as_str())
    .execute(&f.pool)
    .await
    .unwrap();
    sqlx::query("DELETE FROM config.sections WHERE node = $1")
        .bind(b.as_str())
        .execute(&f.pool)
        .await
        .unwrap();
    let mark = last_outbox_id(&f).await;
    let report = f.config.resync().await.unwrap();
    assert_eq!((report.nodes, report.declared), (2, 2));
    let mut d = declarations(&f, mark).await;
    d.sort_by(|x, y| x.1.cmp(&y.1));
    assert_eq!((d[0].1.as_str(), d[0].2.generation), (a.as_str(), 2));
    assert_eq!((d[1].1.as_str(), d[1].2.generation), (b.as_str(), 1));
    assert!(d.iter().all(|(_, _, decl)| decl.items == first[0].2.items));
    let s = f.config.section(&a).await.unwrap().unwrap();
    assert_eq!(s.digest, items(&[("/etc/p", "x")]).digest());
    // (Had b's agent held a higher generation, its next hello or heartbeat
    // would lift the section above it.) Repaired: nothing more differs.
    assert_eq!(f.config.resync().await.unwrap().declared, 0);
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn the_section_table_migration_keeps_every_row() {
    let env = TestEnv::new().await.unwrap();
    let url = env.database_url("config");
    mesh_plumbing::migrate(
        &url,
        "config",
        mesh_config::migrations().set_target(refinery::Target::Version(2)),
    )
    .await
    .unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .unwrap();
    // A row as the config context wrote it before the component, applied copy and all.
    sqlx::query(
        "INSERT INTO config.sections (node, generation, digest, items, declared_at, last_sent_at, \
         applied_generation, applied_outcome) \
         VALUES ('n1', 4, 'd4', '{\"files\": []}', '2026-01-02T03:04:05Z', '2026-01-02T03:04:06Z', 3, 'applied')",
    )
    .execute(&pool)
    .await
    .unwrap();
    let applied = mesh_config::migrate(&url).await.unwrap();
    assert_eq!(
        applied.first().map(String::as_str),
        Some("V3__sections"),
        "{applied:?}"
    );
    let kept: (i64, String, chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>) =
        sqlx::query_as("SELECT generation, digest, declared_at, last_sent_at FROM config.sections WHERE node = 'n1'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(kept.0, 4);
    assert_eq!(kept.1, "d4");
    assert_eq!(kept.2.to_rfc3339(), "2026-01-02T03:04:05+00:00");
    assert_eq!(kept.3.to_rfc3339(), "2026-01-02T03:04:06+00:00");
    // The shape is the component's: exactly its columns.
    let columns: Vec<String> = sqlx::query_scalar(
        "SELECT column_name::text FROM information_schema.columns \
         WHERE table_schema = 'config' AND table_name = 'sections' ORDER BY ordinal_position",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        columns,
        [
            "node",
            "generation",
            "digest",
            "items",
            "declared_at",
            "last_sent_at"
        ]
    );
    pool.close().await;
    env.teardown().await.unwrap();
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
    let count: i64 =
        sqlx::query_scalar("SELECT count(*) FROM config.outbox WHERE exchange = 'declarations'")
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

/// The audit entries in config's outbox: (request id, outcome, principal).
async fn audit_rows(f: &Fixture) -> Vec<(uuid::Uuid, String, String)> {
    let rows: Vec<(String, Vec<u8>)> = sqlx::query_as(
        "SELECT routing_key, payload FROM config.outbox WHERE kind = 'operator.audit' ORDER BY id",
    )
    .fetch_all(&f.pool)
    .await
    .unwrap();
    rows.into_iter()
        .map(|(key, payload)| {
            assert_eq!(key, "config.operator.audit");
            let event = RecordEvent::decode(&payload).unwrap();
            let RecordKind::OperatorAudit { entry, .. } = event.kind else {
                panic!("not an audit event: {}", event.routing_key());
            };
            (entry.request_id, entry.outcome, entry.principal)
        })
        .collect()
}

async fn send(
    f: &Fixture,
    method: &str,
    uri: &str,
    body: &str,
    audit: Option<mesh_plumbing::audit::Audit>,
) -> StatusCode {
    let mut builder = Request::builder().method(method).uri(uri);
    if let Some(audit) = audit {
        builder = builder.extension(audit);
    }
    f.config
        .clone()
        .routes()
        .split_for_parts()
        .0
        .oneshot(builder.body(Body::from(body.to_owned())).unwrap())
        .await
        .unwrap()
        .status()
}

#[tokio::test]
async fn a_change_commits_with_its_audit_entry_and_nothing_else_does() {
    let f = setup().await;
    let body = r#"{"path": "/etc/x", "content": "x", "mode": "0644", "selector": {}}"#;

    // A change: the file and exactly one `ok` entry for this request, together.
    let put = audit("PUT", "/v1/files/x");
    assert_eq!(
        send(&f, "PUT", "/v1/files/x", body, Some(put.clone())).await,
        StatusCode::CREATED
    );
    assert!(put.recorded());
    assert_eq!(
        audit_rows(&f).await,
        vec![(put.request_id(), "ok".to_owned(), "tester".to_owned())]
    );

    // A refused change writes no `ok` entry (the auth layer writes `failed`).
    let missing = audit("DELETE", "/v1/files/missing");
    assert_eq!(
        send(&f, "DELETE", "/v1/files/missing", "", Some(missing.clone())).await,
        StatusCode::NOT_FOUND
    );
    assert!(!missing.recorded());
    let bad = audit("PUT", "/v1/files/y");
    assert_eq!(
        send(&f, "PUT", "/v1/files/y", "{}", Some(bad.clone())).await,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    assert!(!bad.recorded());

    // A route reached without the auth layer's audit context changes nothing.
    assert_eq!(
        send(&f, "PUT", "/v1/files/z", body, None).await,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    assert_eq!(
        send(&f, "DELETE", "/v1/files/x", "", None).await,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    assert!(f.config.file("z").await.unwrap().is_none());
    assert!(f.config.file("x").await.unwrap().is_some());
    assert_eq!(audit_rows(&f).await.len(), 1);

    // The delete commits with its own entry.
    let delete = audit("DELETE", "/v1/files/x");
    assert_eq!(
        send(&f, "DELETE", "/v1/files/x", "", Some(delete.clone())).await,
        StatusCode::NO_CONTENT
    );
    let rows = audit_rows(&f).await;
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[1].0, delete.request_id());
    f.env.teardown().await.unwrap();
}

/// What the controller's router does with a batch of record events: the
/// inbox keeps those not handled before (one copy of an event delivered twice
/// in the batch), the context handles them together, one transaction.
async fn route_events(f: &Fixture, events: &[RecordEvent]) {
    let mut tx = f.pool.begin().await.unwrap();
    let ids: Vec<_> = events.iter().map(|e| e.id).collect();
    let mut fresh = mesh_plumbing::inbox::claim(&mut tx, "config", &ids)
        .await
        .unwrap();
    let fresh: Vec<&RecordEvent> = events.iter().filter(|e| fresh.remove(&e.id)).collect();
    if !fresh.is_empty() {
        f.config.handle_events(&mut tx, &fresh).await.unwrap();
    }
    tx.commit().await.unwrap();
}

fn labels_event(event: &str, node: &str, l: &[(&str, &str)], version: i64) -> RecordEvent {
    let body = NodeLabelsChanged {
        node: NodeId::parse(node).unwrap(),
        labels: labels(l),
        version,
    };
    RecordEvent::new(match event {
        "joined" => RecordKind::NodeJoined(body),
        _ => RecordKind::NodeUpdated(body),
    })
}

/// Config's nodes and the items of their non-empty sections (with the
/// generation, which a batch may leave lower: it skips a node's intermediate
/// sections; and a node whose files came and went within one batch was never
/// declared anything, where one by one it was declared them, then none).
async fn config_state(f: &Fixture) -> (Vec<String>, Vec<(String, i64, String)>) {
    let nodes = sqlx::query_scalar(
        "SELECT concat_ws(' | ', node, labels, version) FROM config.nodes ORDER BY node",
    )
    .fetch_all(&f.pool)
    .await
    .unwrap();
    let sections = sqlx::query_as(
        "SELECT node, generation, items::text FROM config.sections \
         WHERE coalesce(jsonb_array_length(items->'files'), 0) > 0 ORDER BY node",
    )
    .fetch_all(&f.pool)
    .await
    .unwrap();
    (nodes, sections)
}

#[tokio::test]
async fn a_batch_of_node_events_ends_where_handling_them_one_by_one_ends() {
    let (batched, single) = (setup().await, setup().await);
    for f in [&batched, &single] {
        let body = r#"{"path": "/etc/web.conf", "content": "web", "mode": "0644", "selector": {"role": "web"}}"#;
        assert_eq!(
            request(f, "PUT", "/v1/files/web", body).await.0,
            StatusCode::CREATED
        );
        let body = r#"{"path": "/etc/c.conf", "content": "c", "mode": "0600", "node": "eq-c"}"#;
        assert_eq!(
            request(f, "PUT", "/v1/files/c", body).await.0,
            StatusCode::CREATED
        );
        route_events(
            f,
            &[
                labels_event("joined", "eq-a", &[("role", "web")], 1),
                labels_event("joined", "eq-b", &[], 1),
            ],
        )
        .await;
    }
    let joined_c = labels_event("joined", "eq-c", &[("role", "web")], 1);
    let liveness = RecordEvent::new(RecordKind::NodeUnreachable(mesh_protocol::NodeLiveness {
        node: NodeId::parse("eq-a").unwrap(),
        state: mesh_protocol::LivenessState::Unreachable,
        at: chrono::Utc::now(),
        last_heard: None,
    }));
    let batch = vec![
        joined_c.clone(),
        labels_event("joined", "eq-d", &[], 1),
        // A known node's labels change: it loses the selector file.
        labels_event("updated", "eq-a", &[], 2),
        // Stale: not newer than what is stored.
        labels_event("updated", "eq-b", &[("role", "web")], 1),
        // Delivered twice in the batch.
        joined_c,
        // An event config does not act on.
        liveness,
        // Joined and changed again within the batch.
        labels_event("joined", "eq-e", &[("role", "web")], 1),
        labels_event("updated", "eq-e", &[], 2),
        // Two events of one version: the first is kept.
        labels_event("joined", "eq-f", &[("role", "web")], 1),
        labels_event("updated", "eq-f", &[], 1),
        // An older event arriving after a newer one.
        labels_event("updated", "eq-g", &[("role", "web")], 3),
        labels_event("joined", "eq-g", &[], 1),
    ];
    let before = last_outbox_id(&batched).await;
    route_events(&batched, &batch).await;
    for event in &batch {
        route_events(&single, std::slice::from_ref(event)).await;
    }

    let (b, s) = (config_state(&batched).await, config_state(&single).await);
    assert_eq!(b.0, s.0, "config's nodes");
    let items = |v: &[(String, i64, String)]| -> Vec<(String, String)> {
        v.iter().map(|(n, _, i)| (n.clone(), i.clone())).collect()
    };
    assert_eq!(items(&b.1), items(&s.1), "sections' items");
    for ((node, gb, _), (_, gs, _)) in b.1.iter().zip(&s.1) {
        assert!(
            gb <= gs,
            "{node}: generation {gb} after the batch, {gs} one by one"
        );
    }
    // One declaration per node the batch changed, none for the rest.
    let declared: Vec<String> = declarations(&batched, before)
        .await
        .into_iter()
        .map(|(_, node, _)| node)
        .collect();
    assert_eq!(declared, ["eq-a", "eq-c", "eq-f", "eq-g"], "{declared:?}");
    let view = |n: &str| {
        b.0.iter()
            .find(|r| r.starts_with(&format!("{n} |")))
            .cloned()
    };
    assert!(view("eq-f").unwrap().contains("web"), "{:?}", view("eq-f"));
    assert!(view("eq-g").unwrap().ends_with("| 3"), "{:?}", view("eq-g"));
    batched.env.teardown().await.unwrap();
    single.env.teardown().await.unwrap();
}

// ---------------------------------------------------------------------------
// Settings, secrets, grants (issue 11)
// ---------------------------------------------------------------------------

fn seal_key(n: u8) -> mesh_protocol::sealing::SealSecretKey {
    mesh_protocol::sealing::SealSecretKey::from_seed([n; 32])
}

/// A hello stating `key` as the node's seal key.
fn hello_sealed(node: &NodeId, key: &mesh_protocol::sealing::SealSecretKey) -> Envelope<Report> {
    let mut env = hello(node, 0);
    if let Report::Hello(h) = &mut env.body {
        h.seal_key = Some(key.public().to_hex());
    }
    env
}

async fn placed(
    f: &Fixture,
    module: &str,
    version: i64,
    nodes: &[&NodeId],
    files: &[(&str, &str)],
) {
    let files: Vec<mesh_protocol::SettingsFile> = files
        .iter()
        .map(|(name, format)| {
            serde_json::from_value(serde_json::json!({"name": name, "format": format})).unwrap()
        })
        .collect();
    let event = RecordEvent::new(RecordKind::ModulePlaced(mesh_protocol::ModulePlacement {
        module: module.to_owned(),
        version,
        nodes: nodes.iter().map(|n| (*n).clone()).collect(),
        settings_files: files,
        ports: Vec::new(),
        requires: Vec::new(),
        provides: Vec::new(),
    }));
    route_events(f, &[event]).await;
}

/// The newest declaration to each node after outbox row `after`.
async fn newest(f: &Fixture, after: i64) -> std::collections::BTreeMap<String, Declaration> {
    declarations(f, after)
        .await
        .into_iter()
        .map(|(_, node, d)| (node, d))
        .collect()
}

fn file_content<'a>(d: &'a Declaration, path: &str) -> Option<&'a str> {
    d.items
        .files
        .iter()
        .find(|i| i.path == path)
        .map(|i| i.content.as_str())
}

/// A fleet of three nodes known to config: a (web, eu), b (web), c (db).
async fn three_nodes(f: &Fixture) -> (NodeId, NodeId, NodeId) {
    let (a, b, c) = (node(f, "a"), node(f, "b"), node(f, "c"));
    node_event(
        f,
        "node.joined",
        &a,
        labels(&[("role", "web"), ("zone", "eu")]),
        1,
    )
    .await;
    node_event(f, "node.joined", &b, labels(&[("role", "web")]), 1).await;
    node_event(f, "node.joined", &c, labels(&[("role", "db")]), 1).await;
    (a, b, c)
}

#[tokio::test]
async fn settings_precedence_over_four_scopes_reaches_exactly_the_modules_nodes() {
    let f = setup().await;
    let (a, b, c) = three_nodes(&f).await;
    placed(
        &f,
        "app",
        1,
        &[&a, &b],
        &[("app.env", "env"), ("app.json", "json")],
    )
    .await;
    for (uri, body) in [
        ("/v1/settings/global", r#"{"values": {"A": "global", "B": "global", "C": "global", "D": "global", "PORT": 80}}"#.to_owned()),
        ("/v1/settings/labels/web", r#"{"selector": {"role": "web"}, "values": {"B": "web", "C": "web"}}"#.to_owned()),
        ("/v1/settings/labels/web-eu", r#"{"selector": {"role": "web", "zone": "eu"}, "values": {"B": "web-eu"}}"#.to_owned()),
        ("/v1/settings/labels/eu", r#"{"selector": {"zone": "eu"}, "values": {"T": "eu"}}"#.to_owned()),
        ("/v1/settings/labels/web2", r#"{"selector": {"role": "web"}, "values": {"T": "web2"}}"#.to_owned()),
        (&*format!("/v1/settings/nodes/{a}"), r#"{"values": {"C": "node-a", "D": "node-a"}}"#.to_owned()),
        ("/v1/settings/modules/app", r#"{"values": {"D": "module"}}"#.to_owned()),
    ] {
        let (status, _, body) = request(&f, "PUT", uri, &body).await;
        assert_eq!(status, StatusCode::CREATED, "{uri}: {body}");
    }
    let decl = newest(&f, 0).await;
    assert!(
        !decl.contains_key(c.as_str()),
        "c runs no module: nothing declared to it"
    );
    let env_a = file_content(&decl[a.as_str()], "/modules/app/app.env").unwrap();
    assert_eq!(
        env_a,
        "A=global\nB=web-eu\nC=node-a\nD=module\nPORT=80\nT=eu\n"
    );
    let env_b = file_content(&decl[b.as_str()], "/modules/app/app.env").unwrap();
    assert_eq!(env_b, "A=global\nB=web\nC=web\nD=module\nPORT=80\nT=web2\n");
    let json_a: serde_json::Value =
        serde_json::from_str(file_content(&decl[a.as_str()], "/modules/app/app.json").unwrap())
            .unwrap();
    assert_eq!(json_a["PORT"], 80);

    // The effective view names each value's layer, what it shadows and the tie.
    let (status, _, view) = request(&f, "GET", "/v1/modules/app/settings/effective", "").await;
    assert_eq!(status, StatusCode::OK, "{view}");
    let on_a = view["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["node"] == a.as_str())
        .unwrap();
    assert_eq!(
        on_a["settings"]["D"]["from"],
        serde_json::json!({"scope": "module", "name": "app"})
    );
    assert_eq!(
        on_a["settings"]["C"]["from"],
        serde_json::json!({"scope": "node", "name": a.as_str()})
    );
    assert_eq!(
        on_a["settings"]["B"]["from"],
        serde_json::json!({"scope": "labels", "name": "web-eu"})
    );
    assert_eq!(
        on_a["settings"]["A"]["from"],
        serde_json::json!({"scope": "global"})
    );
    // a: `eu` and `web2` both one pair: the smaller name wins, the tie is shown.
    assert_eq!(
        on_a["settings"]["T"]["tie"],
        serde_json::json!([{"scope": "labels", "name": "web2"}])
    );

    // b moves into zone eu: its labels change its settings, and only its.
    let before = last_outbox_id(&f).await;
    node_event(
        &f,
        "node.updated",
        &b,
        labels(&[("role", "web"), ("zone", "eu")]),
        2,
    )
    .await;
    let decl = newest(&f, before).await;
    assert_eq!(decl.keys().collect::<Vec<_>>(), vec![b.as_str()]);
    assert_eq!(
        file_content(&decl[b.as_str()], "/modules/app/app.env").unwrap(),
        "A=global\nB=web-eu\nC=web\nD=module\nPORT=80\nT=eu\n"
    );
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn a_value_change_redeclares_to_exactly_the_affected_nodes() {
    let f = setup().await;
    let (a, b, c) = three_nodes(&f).await;
    placed(&f, "app", 1, &[&a, &b], &[("app.env", "env")]).await;
    placed(&f, "db", 1, &[&c], &[("db.toml", "toml")]).await;
    request(&f, "PUT", "/v1/settings/global", r#"{"values": {"X": 1}}"#).await;
    // A node layer of a: a alone.
    let before = last_outbox_id(&f).await;
    let (status, _, _) = request(
        &f,
        "PUT",
        &format!("/v1/settings/nodes/{a}"),
        r#"{"values": {"X": 2}}"#,
    )
    .await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(
        newest(&f, before).await.keys().cloned().collect::<Vec<_>>(),
        vec![a.to_string()]
    );
    // The module layer of db: c alone.
    let before = last_outbox_id(&f).await;
    request(
        &f,
        "PUT",
        "/v1/settings/modules/db",
        r#"{"values": {"Y": "z"}}"#,
    )
    .await;
    assert_eq!(
        newest(&f, before).await.keys().cloned().collect::<Vec<_>>(),
        vec![c.to_string()]
    );
    // A layer for a module that runs nowhere, and a value equal to what
    // renders already: nobody.
    let before = last_outbox_id(&f).await;
    request(
        &f,
        "PUT",
        "/v1/settings/modules/idle",
        r#"{"values": {"Y": "z"}}"#,
    )
    .await;
    request(
        &f,
        "PUT",
        "/v1/settings/labels/db",
        r#"{"selector": {"role": "db"}, "values": {"Y": "z"}}"#,
    )
    .await;
    assert!(newest(&f, before).await.is_empty());
    // The global value: every node that runs a module.
    let before = last_outbox_id(&f).await;
    request(&f, "PUT", "/v1/settings/global", r#"{"values": {"X": 3}}"#).await;
    // a keeps its own X (the node layer): b and c.
    assert_eq!(
        newest(&f, before).await.keys().cloned().collect::<Vec<_>>(),
        vec![b.to_string(), c.to_string()]
    );
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn secrets_reach_only_granted_nodes_sealed_and_are_never_in_clear() {
    let f = setup().await;
    let (a, b, c) = three_nodes(&f).await;
    let keys = [
        (a.clone(), seal_key(1)),
        (b.clone(), seal_key(2)),
        (c.clone(), seal_key(3)),
    ];
    handle(
        &f,
        &keys
            .iter()
            .map(|(n, k)| hello_sealed(n, k))
            .collect::<Vec<_>>(),
    )
    .await;
    placed(&f, "app", 1, &[&a, &b], &[]).await;
    placed(&f, "other", 1, &[&c], &[]).await;
    const PLAIN: &str = "s3cr3t-value-that-must-not-leak";

    let (status, _, view) = request(
        &f,
        "PUT",
        "/v1/secrets/db-pw",
        &format!(r#"{{"value": "{PLAIN}"}}"#),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{view}");
    assert!(!view.to_string().contains(PLAIN));
    let before = last_outbox_id(&f).await;
    let (status, _, grant) = request(&f, "PUT", "/v1/modules/app/grants/db-pw", "{}").await;
    assert_eq!(status, StatusCode::CREATED, "{grant}");
    assert_eq!(grant["path"], "/modules/app/secrets/db-pw");
    let decl = newest(&f, before).await;
    assert_eq!(
        decl.keys().cloned().collect::<Vec<_>>(),
        vec![a.to_string(), b.to_string()]
    );
    for (n, key) in &keys[..2] {
        let items = &decl[n.as_str()].items.secrets;
        assert_eq!(items.len(), 1);
        assert_eq!(items[0].mode.bits(), 0o600);
        assert!(!items[0].sealed.contains(PLAIN));
        let aad = mesh_protocol::sealing::secret_aad(n.as_str(), &items[0].path);
        assert_eq!(
            mesh_protocol::sealing::open(key, &aad, &items[0].sealed).unwrap(),
            PLAIN.as_bytes()
        );
        // Another node's key does not open it.
        assert!(mesh_protocol::sealing::open(&keys[2].1, &aad, &items[0].sealed).is_err());
    }

    // A new version: exactly a and b, with the new value.
    let before = last_outbox_id(&f).await;
    let (status, _, _) = request(
        &f,
        "PUT",
        "/v1/secrets/db-pw",
        r#"{"value": "second-version"}"#,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let decl = newest(&f, before).await;
    assert_eq!(
        decl.keys().cloned().collect::<Vec<_>>(),
        vec![a.to_string(), b.to_string()]
    );
    assert_eq!(decl[a.as_str()].items.secrets[0].version, 2);

    // Nothing in the schema or the outbox holds the value in clear.
    let dump: Vec<String> = sqlx::query_scalar(
        "SELECT row_to_json(t)::text FROM (SELECT * FROM config.secrets) t UNION ALL \
         SELECT row_to_json(t)::text FROM (SELECT * FROM config.secret_versions) t UNION ALL \
         SELECT row_to_json(t)::text FROM (SELECT * FROM config.sealed) t UNION ALL \
         SELECT row_to_json(t)::text FROM (SELECT * FROM config.sections) t UNION ALL \
         SELECT encode(payload, 'escape') FROM config.outbox",
    )
    .fetch_all(&f.pool)
    .await
    .unwrap();
    assert!(dump.len() > 5);
    for row in &dump {
        assert!(
            !row.contains(PLAIN) && !row.contains("second-version"),
            "{row}"
        );
    }
    let (_, _, list) = request(&f, "GET", "/v1/secrets", "").await;
    let (_, _, one) = request(&f, "GET", "/v1/secrets/db-pw", "").await;
    assert_eq!(one["versions"].as_array().unwrap().len(), 2);
    assert_eq!(one["grants"][0]["module"], "app");
    for answer in [list, one] {
        assert!(
            !answer.to_string().contains("second-version") && !answer.to_string().contains(PLAIN)
        );
    }

    // The module leaves b: b's section loses the secret, a keeps it.
    let before = last_outbox_id(&f).await;
    placed(&f, "app", 2, &[&a], &[]).await;
    let decl = newest(&f, before).await;
    assert_eq!(
        decl.keys().cloned().collect::<Vec<_>>(),
        vec![b.to_string()]
    );
    assert!(decl[b.as_str()].items.secrets.is_empty());
    // A stale placement event changes nothing.
    let before = last_outbox_id(&f).await;
    placed(&f, "app", 1, &[&a, &b], &[]).await;
    assert!(newest(&f, before).await.is_empty());

    // Revoking the grant removes it from a.
    let before = last_outbox_id(&f).await;
    let (status, _, _) = request(&f, "DELETE", "/v1/modules/app/grants/db-pw", "").await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let decl = newest(&f, before).await;
    assert_eq!(
        decl.keys().cloned().collect::<Vec<_>>(),
        vec![a.to_string()]
    );
    assert!(decl[a.as_str()].items.secrets.is_empty());
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM config.sealed")
        .fetch_one(&f.pool)
        .await
        .unwrap();
    assert_eq!(
        left, 0,
        "no sealed form kept for a node that no longer gets it"
    );
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn a_node_without_a_seal_key_gets_its_secret_once_it_states_one() {
    let f = setup().await;
    let (a, _, _) = three_nodes(&f).await;
    placed(&f, "app", 1, &[&a], &[]).await;
    request(&f, "PUT", "/v1/secrets/tok", r#"{"value": "v"}"#).await;
    let before = last_outbox_id(&f).await;
    request(
        &f,
        "PUT",
        "/v1/modules/app/grants/tok",
        r#"{"file": "token.txt"}"#,
    )
    .await;
    assert!(
        newest(&f, before).await.is_empty(),
        "no key: nothing to seal to, nothing sent in clear"
    );
    let before = last_outbox_id(&f).await;
    handle(&f, &[hello_sealed(&a, &seal_key(9))]).await;
    let decl = newest(&f, before).await;
    let s = &decl[a.as_str()].items.secrets;
    assert_eq!(s[0].path, "/modules/app/secrets/token.txt");
    // The same key again: nothing new.
    let before = last_outbox_id(&f).await;
    handle(&f, &[hello_sealed(&a, &seal_key(9))]).await;
    assert!(
        newest(&f, before)
            .await
            .values()
            .all(|d| d.items.secrets == *s)
    );
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn master_key_rotation_keeps_secrets_readable_and_delivered_values_unchanged() {
    let f = setup().await;
    let (a, _, _) = three_nodes(&f).await;
    handle(&f, &[hello_sealed(&a, &seal_key(4))]).await;
    placed(&f, "app", 1, &[&a], &[]).await;
    request(&f, "PUT", "/v1/secrets/one", r#"{"value": "first"}"#).await;
    request(&f, "PUT", "/v1/secrets/two", r#"{"value": "second"}"#).await;
    request(&f, "PUT", "/v1/modules/app/grants/one", "{}").await;
    let old_ids = f.config.keyring().ids();
    let before = last_outbox_id(&f).await;

    let (status, _, report) = request(&f, "POST", "/v1/secrets/master-key/rotate", "").await;
    assert_eq!(status, StatusCode::OK, "{report}");
    assert_eq!(report["rewrapped"], 2);
    assert_eq!(report["retired"], serde_json::json!(old_ids));
    let new_id = report["key_id"].as_str().unwrap().to_owned();
    let ids: Vec<String> = sqlx::query_scalar("SELECT DISTINCT key_id FROM config.secrets")
        .fetch_all(&f.pool)
        .await
        .unwrap();
    assert_eq!(ids, vec![new_id.clone()]);
    // The file holds the new key only; a restarted controller reads it.
    let file = mesh_credentials::MasterKeys::load(&f.env.master_keys_path()).unwrap();
    assert_eq!(
        file.keys.iter().map(|k| k.id.clone()).collect::<Vec<_>>(),
        vec![new_id]
    );
    assert!(
        newest(&f, before).await.is_empty(),
        "what nodes hold did not change"
    );

    let restarted = Config::new(
        f.pool.clone(),
        OutboxSignal::default(),
        ConfigSettings::default(),
        mesh_config::Keyring::load(Some(f.env.master_keys_path())).unwrap(),
    );
    assert_eq!(restarted.resync().await.unwrap().declared, 0);
    // It still opens the data keys: a new version of each is delivered.
    let admin = audit("PUT", "/v1/secrets/one");
    for name in ["one", "two"] {
        let pre = mesh_plumbing::etag::Preconditions {
            if_match: Some(mesh_plumbing::etag::Precondition::Any),
            if_none_match: None,
        };
        restarted
            .put_secret(name, "rotated", &pre, &admin)
            .await
            .unwrap();
    }
    let decl = newest(&f, before).await;
    let item = &decl[a.as_str()].items.secrets[0];
    let aad = mesh_protocol::sealing::secret_aad(a.as_str(), &item.path);
    assert_eq!(
        mesh_protocol::sealing::open(&seal_key(4), &aad, &item.sealed).unwrap(),
        b"rotated"
    );
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn concurrent_writers_one_wins_the_other_gets_412_and_a_current_get_is_304() {
    let f = setup().await;
    // In this order: the grant's secret exists before the grant.
    let cases = [
        (
            "/v1/files/f",
            r#"{"path": "/etc/f", "content": "one", "mode": "0644", "selector": {}}"#,
            r#"{"path": "/etc/f", "content": "two", "mode": "0644", "selector": {}}"#,
        ),
        (
            "/v1/settings/global",
            r#"{"values": {"K": 1}}"#,
            r#"{"values": {"K": 2}}"#,
        ),
        (
            "/v1/settings/labels/web",
            r#"{"selector": {"role": "web"}, "values": {"K": 1}}"#,
            r#"{"selector": {"role": "web"}, "values": {"K": 2}}"#,
        ),
        (
            "/v1/secrets/s",
            r#"{"value": "one"}"#,
            r#"{"value": "two"}"#,
        ),
        ("/v1/modules/app/grants/s", r#"{}"#, r#"{"file": "other"}"#),
    ];
    for (uri, one, two) in cases {
        let (status, _, _, created) =
            request_with(&f, "PUT", uri, one, &[("if-none-match", "*")]).await;
        assert_eq!(status, StatusCode::CREATED, "{uri}");
        // Only creates: a second create is refused.
        let (status, _, _, _) = request_with(&f, "PUT", uri, one, &[("if-none-match", "*")]).await;
        assert_eq!(status, StatusCode::PRECONDITION_FAILED, "{uri}");
        let (status, _, _, etag) = request_with(&f, "GET", uri, "", &[]).await;
        assert_eq!(status, StatusCode::OK, "{uri}");
        let etag = etag.unwrap();
        assert_eq!(
            Some(&etag),
            created.as_ref(),
            "{uri}: the PUT's ETag is the GET's"
        );
        // A GET with the current tag: 304.
        let (status, _, _, _) = request_with(&f, "GET", uri, "", &[("if-none-match", &etag)]).await;
        assert_eq!(status, StatusCode::NOT_MODIFIED, "{uri}");
        // Two writers with the same tag at once: one wins, the other is stale.
        let if_match = [("if-match", etag.as_str())];
        let (r1, r2) = tokio::join!(
            request_with(&f, "PUT", uri, one, &if_match),
            request_with(&f, "PUT", uri, two, &if_match),
        );
        let mut statuses = [r1.0, r2.0];
        statuses.sort();
        assert_eq!(
            statuses,
            [StatusCode::OK, StatusCode::PRECONDITION_FAILED],
            "{uri}: {r1:?} {r2:?}"
        );
        let loser = if r1.0 == StatusCode::PRECONDITION_FAILED {
            &r1
        } else {
            &r2
        };
        assert_eq!(loser.1, "application/problem+json", "{uri}");
        // Without If-Match: 428; the old tag is no longer current.
        assert_eq!(
            request_with(&f, "PUT", uri, one, &[]).await.0,
            StatusCode::PRECONDITION_REQUIRED,
            "{uri}"
        );
        let (status, _, _, _) = request_with(&f, "GET", uri, "", &[("if-none-match", &etag)]).await;
        assert_eq!(status, StatusCode::OK, "{uri}");
    }
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn a_viewer_reads_a_files_metadata_not_its_content() {
    let f = setup().await;
    request(
        &f,
        "PUT",
        "/v1/files/f",
        r#"{"path": "/etc/f", "content": "private text", "mode": "0644", "selector": {}}"#,
    )
    .await;
    let (status, _, view, _) = request_as(
        &f,
        "GET",
        "/v1/files/f",
        "",
        &[],
        mesh_plumbing::api::Role::Viewer,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert!(view.get("content").is_none(), "{view}");
    assert_eq!(view["size"], 12);
    let (_, _, view, _) = request_as(
        &f,
        "GET",
        "/v1/files/f",
        "",
        &[],
        mesh_plumbing::api::Role::Operator,
    )
    .await;
    assert_eq!(view["content"], "private text");
    // `/modules/` is the modules' own.
    let (status, _, problem) = request(
        &f,
        "PUT",
        "/v1/files/g",
        r#"{"path": "/modules/app/x", "content": "", "mode": "0644", "selector": {}}"#,
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(problem["field"], "path");
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn a_batch_of_module_events_keeps_each_modules_newest() {
    let f = setup().await;
    let (a, b, c) = three_nodes(&f).await;
    request(&f, "PUT", "/v1/settings/global", r#"{"values": {"X": 1}}"#).await;
    let event = |module: &str, version: i64, nodes: &[&NodeId]| {
        RecordEvent::new(RecordKind::ModulePlaced(mesh_protocol::ModulePlacement {
            module: module.to_owned(),
            version,
            nodes: nodes.iter().map(|n| (*n).clone()).collect(),
            settings_files: serde_json::from_value(
                serde_json::json!([{"name": "s.env", "format": "env"}]),
            )
            .unwrap(),
            ports: Vec::new(),
            requires: Vec::new(),
            provides: Vec::new(),
        }))
    };
    // Newer before older, a module placed then removed, all in one batch.
    route_events(
        &f,
        &[
            event("app", 2, &[&a, &b]),
            event("app", 1, &[&c]),
            event("gone", 1, &[&c]),
            RecordEvent::new(RecordKind::ModuleRemoved(mesh_protocol::ModuleRemoved {
                module: "gone".into(),
                version: 2,
            })),
        ],
    )
    .await;
    let rows: Vec<(String, i64, bool, Vec<String>)> = sqlx::query_as(
        "SELECT module, version, removed, nodes FROM config.modules ORDER BY module",
    )
    .fetch_all(&f.pool)
    .await
    .unwrap();
    assert_eq!(
        rows,
        vec![
            ("app".into(), 2, false, vec![a.to_string(), b.to_string()]),
            ("gone".into(), 2, true, vec![]),
        ]
    );
    let decl = newest(&f, 0).await;
    assert_eq!(
        decl.keys().cloned().collect::<Vec<_>>(),
        vec![a.to_string(), b.to_string()]
    );
    assert!(file_content(&decl[a.as_str()], "/modules/app/s.env").is_some());
    // Moving the module later re-declares where it left and where it went.
    let before = last_outbox_id(&f).await;
    route_events(&f, &[event("app", 3, &[&b, &c])]).await;
    let decl = newest(&f, before).await;
    assert_eq!(
        decl.keys().cloned().collect::<Vec<_>>(),
        vec![a.to_string(), c.to_string()]
    );
    assert!(decl[a.as_str()].items.files.is_empty());
    f.env.teardown().await.unwrap();
}

/// A `provisioning.credentials.issued` as provisioning writes it: the file
/// under the keyring's current master key, in config's at-rest form.
fn issued(
    f: &Fixture,
    grant: uuid::Uuid,
    secret: &str,
    version: i64,
    value: &str,
    files: &[(&str, &str)],
) -> RecordEvent {
    use base64::Engine as _;
    let keys = mesh_credentials::MasterKeys::load(&f.env.master_keys_path()).unwrap();
    let current = keys.current().unwrap();
    let dk = mesh_credentials::crypt::new_data_key();
    let wrapped = mesh_credentials::crypt::wrap_key(&current.bytes(), secret, &dk).unwrap();
    let ct =
        mesh_credentials::crypt::encrypt_value(&dk, secret, version, value.as_bytes()).unwrap();
    let b64 = base64::engine::general_purpose::STANDARD;
    RecordEvent::new(RecordKind::CredentialsIssued(
        mesh_protocol::CredentialsIssued {
            grant,
            secret: secret.to_owned(),
            version,
            files: files
                .iter()
                .map(|(m, file)| mesh_protocol::CredentialFile {
                    module: (*m).to_owned(),
                    file: (*file).to_owned(),
                })
                .collect(),
            key_id: current.id.clone(),
            wrapped_key: b64.encode(wrapped),
            ciphertext: b64.encode(ct),
        },
    ))
}

#[tokio::test]
async fn grant_credentials_from_the_record_reach_exactly_the_consumers_and_providers_nodes() {
    let f = setup().await;
    let (a, b, c) = three_nodes(&f).await;
    let keys = [
        (a.clone(), seal_key(1)),
        (b.clone(), seal_key(2)),
        (c.clone(), seal_key(3)),
    ];
    handle(
        &f,
        &keys
            .iter()
            .map(|(n, k)| hello_sealed(n, k))
            .collect::<Vec<_>>(),
    )
    .await;
    placed(&f, "app", 1, &[&a], &[]).await;
    placed(&f, "db", 1, &[&c], &[]).await;
    let grant = uuid::Uuid::now_v7();
    let secret = format!("grant-{}", grant.simple());
    let provider_file = format!("{secret}.env");
    const V1: &str =
        "PGUSER=app-main\nPGPASSWORD=first-password-never-in-clear\nMESH_CREDENTIAL_VERSION=1\n";
    let before = last_outbox_id(&f).await;
    route_events(
        &f,
        &[issued(
            &f,
            grant,
            &secret,
            1,
            V1,
            &[("app", "grant-main.env"), ("db", &provider_file)],
        )],
    )
    .await;
    let decl = newest(&f, before).await;
    assert_eq!(
        decl.keys().cloned().collect::<Vec<_>>(),
        vec![a.to_string(), c.to_string()],
        "the consumer's node and the provider's, no other"
    );
    let open = |n: &NodeId, key: &mesh_protocol::sealing::SealSecretKey, d: &Declaration| {
        let item = &d.items.secrets[0];
        let aad = mesh_protocol::sealing::secret_aad(n.as_str(), &item.path);
        (
            item.path.clone(),
            String::from_utf8(mesh_protocol::sealing::open(key, &aad, &item.sealed).unwrap())
                .unwrap(),
        )
    };
    assert_eq!(
        open(&a, &keys[0].1, &decl[a.as_str()]),
        (
            "/modules/app/secrets/grant-main.env".to_owned(),
            V1.to_owned()
        )
    );
    assert_eq!(
        open(&c, &keys[2].1, &decl[c.as_str()]),
        (
            format!("/modules/db/secrets/{provider_file}"),
            V1.to_owned()
        )
    );

    // Operators see it, but cannot write, grant, revoke or delete it, nor
    // take a `grant-` file for their own grants.
    let (status, _, list) = request(&f, "GET", "/v1/secrets", "").await;
    assert_eq!(status, StatusCode::OK);
    assert!(list.to_string().contains(&secret), "{list}");
    assert!(!list.to_string().contains("first-password"), "{list}");
    let path = format!("/v1/secrets/{secret}");
    for (method, uri, body) in [
        ("PUT", path.as_str(), r#"{"value": "x"}"#),
        ("DELETE", path.as_str(), ""),
        ("PUT", &format!("/v1/modules/other/grants/{secret}"), "{}"),
        ("DELETE", &format!("/v1/modules/app/grants/{secret}"), ""),
    ] {
        let (status, _, problem) = request(&f, method, uri, body).await;
        assert_eq!(status, StatusCode::CONFLICT, "{method} {uri}: {problem}");
        assert!(
            problem.to_string().contains("managed by provisioning"),
            "{problem}"
        );
    }
    let (status, _, _) = request(&f, "PUT", "/v1/secrets/mine", r#"{"value": "v"}"#).await;
    assert_eq!(status, StatusCode::CREATED);
    let (status, _, problem) = request(
        &f,
        "PUT",
        "/v1/modules/app/grants/mine",
        r#"{"file": "grant-main.env"}"#,
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{problem}");
    assert_eq!(problem["field"], "file", "{problem}");

    // The consumer moves to b: the file follows it and leaves a.
    let before = last_outbox_id(&f).await;
    placed(&f, "app", 2, &[&b], &[]).await;
    let decl = newest(&f, before).await;
    assert!(decl[a.as_str()].items.secrets.is_empty());
    assert_eq!(open(&b, &keys[1].1, &decl[b.as_str()]).1, V1);

    // A rotation replaces the value on both nodes; an older issue is ignored.
    const V2: &str = "PGPASSWORD=second\nMESH_CREDENTIAL_VERSION=2\n";
    let before = last_outbox_id(&f).await;
    route_events(
        &f,
        &[
            issued(
                &f,
                grant,
                &secret,
                2,
                V2,
                &[("app", "grant-main.env"), ("db", &provider_file)],
            ),
            issued(
                &f,
                grant,
                &secret,
                1,
                V1,
                &[("app", "grant-main.env"), ("db", &provider_file)],
            ),
        ],
    )
    .await;
    let decl = newest(&f, before).await;
    assert_eq!(open(&b, &keys[1].1, &decl[b.as_str()]).1, V2);
    assert_eq!(open(&c, &keys[2].1, &decl[c.as_str()]).1, V2);

    // One that does not open under the keyring is refused, nothing stored.
    let mut bad = issued(&f, grant, &secret, 3, "x", &[("app", "grant-main.env")]);
    if let RecordKind::CredentialsIssued(b) = &mut bad.kind {
        b.key_id = "no-such-key".into();
    }
    let mut tx = f.pool.begin().await.unwrap();
    assert!(f.config.handle_event(&mut tx, &bad).await.is_err());
    drop(tx);

    // Withdrawn: gone from both nodes and from the schema.
    let before = last_outbox_id(&f).await;
    route_events(
        &f,
        &[RecordEvent::new(RecordKind::CredentialsWithdrawn(
            mesh_protocol::CredentialsWithdrawn {
                grant,
                secret: secret.clone(),
            },
        ))],
    )
    .await;
    let decl = newest(&f, before).await;
    assert!(decl[b.as_str()].items.secrets.is_empty());
    assert!(decl[c.as_str()].items.secrets.is_empty());
    let left: i64 =
        sqlx::query_scalar("SELECT count(*) FROM config.secrets WHERE managed_by IS NOT NULL")
            .fetch_one(&f.pool)
            .await
            .unwrap();
    assert_eq!(left, 0);
    // Nothing of it was ever in clear in the schema or the outbox.
    let dump: Vec<String> = sqlx::query_scalar(
        "SELECT row_to_json(t)::text FROM (SELECT * FROM config.secret_versions) t UNION ALL \
         SELECT row_to_json(t)::text FROM (SELECT * FROM config.sealed) t UNION ALL \
         SELECT encode(payload, 'escape') FROM config.outbox",
    )
    .fetch_all(&f.pool)
    .await
    .unwrap();
    for row in &dump {
        assert!(
            !row.contains("first-password") && !row.contains("PGPASSWORD=second"),
            "{row}"
        );
    }
}
