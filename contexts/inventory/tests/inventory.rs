//! The inventory context against a real PostgreSQL, one fresh database per test.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use chrono::{DateTime, Duration, Utc};
use mesh_inventory::{Inventory, InventorySettings};
use mesh_plumbing::{Context, OutboxSignal};
use mesh_protocol::{
    Applied, Envelope, Heartbeat, Hello, Labels, NodeId, NodeLabelsChanged, Outcome, RecordEvent,
    RecordKind, Report, Section,
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
    inventory: Arc<Inventory>,
}

async fn setup() -> Fixture {
    setup_with(InventorySettings {
        label_trust: mesh_inventory::LabelTrust::new(["role".to_owned(), "zone".to_owned()]),
        ..InventorySettings::default()
    })
    .await
}

async fn setup_with(settings: InventorySettings) -> Fixture {
    let env = TestEnv::new().await.unwrap();
    let url = env.database_url("inventory");
    let applied = mesh_inventory::migrate(&url).await.unwrap();
    assert!(!applied.is_empty());
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .unwrap();
    let inventory = Arc::new(Inventory::new(
        pool.clone(),
        OutboxSignal::default(),
        settings,
    ));
    Fixture {
        env,
        pool,
        inventory,
    }
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

/// Effective labels: `pairs` and the node's read-only `mesh.io/node`.
fn effective(node: &NodeId, pairs: &[(&str, &str)]) -> Labels {
    let mut l = labels(pairs);
    l.insert(mesh_protocol::NODE_LABEL.to_owned(), node.to_string());
    l
}

fn hello(node: &NodeId, seq: u64, l: Labels, applied: &[(Section, u64)]) -> Envelope<Report> {
    Envelope::new(
        node.clone(),
        seq,
        Report::Hello(Hello {
            hostname: format!("{node}.example"),
            arch: "x86_64".into(),
            cpus: 4,
            memory_bytes: 8 << 30,
            labels: l,
            agent_version: "0.1.0".into(),
            public_key: None,
            seal_key: None,
            overlay: None,
            applied: applied.iter().copied().collect(),
            protocol: None,
            outage: None,
            metrics: None,
        }),
    )
}

fn heartbeat(
    node: &NodeId,
    seq: u64,
    sent_at: DateTime<Utc>,
    applied: &[(Section, u64)],
) -> Envelope<Report> {
    let mut env = Envelope::new(
        node.clone(),
        seq,
        Report::Heartbeat(Heartbeat {
            interval_ms: None,
            applied: applied.iter().copied().collect(),
        }),
    );
    env.sent_at = sent_at;
    env
}

async fn handle(f: &Fixture, reports: &[Envelope<Report>]) {
    let mut tx = f.pool.begin().await.unwrap();
    f.inventory.handle_reports(&mut tx, reports).await.unwrap();
    tx.commit().await.unwrap();
}

/// Node events in the outbox, oldest first: (event name, body).
async fn events(f: &Fixture) -> Vec<(String, NodeLabelsChanged)> {
    let rows: Vec<(String, Vec<u8>)> = sqlx::query_as(
        "SELECT routing_key, payload FROM inventory.outbox \
         WHERE exchange = 'record' AND kind LIKE 'node.%' ORDER BY id",
    )
    .fetch_all(&f.pool)
    .await
    .unwrap();
    rows.into_iter()
        .map(|(key, payload)| {
            let event = RecordEvent::decode(&payload).unwrap();
            assert_eq!(event.routing_key(), key);
            match event.kind {
                RecordKind::NodeJoined(b) => ("node.joined".to_owned(), b),
                RecordKind::NodeUpdated(b) => ("node.updated".to_owned(), b),
                other => panic!("inventory wrote an event it does not own: {other:?}"),
            }
        })
        .collect()
}

async fn request(
    f: &Fixture,
    method: &str,
    uri: &str,
    body: &str,
) -> (StatusCode, String, serde_json::Value) {
    let (status, headers, json) = request_with(f, method, uri, &[], body).await;
    let content_type = headers
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    (status, content_type, json)
}

/// A request with `headers`; the answer's status, headers and JSON body
/// (null if none).
async fn request_with(
    f: &Fixture,
    method: &str,
    uri: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (StatusCode, axum::http::HeaderMap, serde_json::Value) {
    let mut builder = Request::builder()
        .method(method)
        .uri(uri)
        .header("content-type", "application/json")
        .extension(audit(method, uri));
    for (k, v) in headers {
        builder = builder.header(*k, *v);
    }
    let response = f
        .inventory
        .clone()
        .routes()
        .split_for_parts()
        .0
        .oneshot(builder.body(Body::from(body.to_owned())).unwrap())
        .await
        .unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    let json = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
    (status, headers, json)
}

/// A labels write that replaces whatever is there (`If-Match: *`).
async fn put_labels(f: &Fixture, uri: &str, body: &str) -> (StatusCode, String, serde_json::Value) {
    let (status, headers, json) = request_with(f, "PUT", uri, &[("if-match", "*")], body).await;
    let content_type = headers
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    (status, content_type, json)
}

#[tokio::test]
async fn migrating_twice_is_a_no_op() {
    let f = setup().await;
    let again = mesh_inventory::migrate(&f.env.database_url("inventory"))
        .await
        .unwrap();
    assert!(again.is_empty(), "{again:?}");
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn hello_then_heartbeat_batch() {
    let f = setup().await;
    let (a, b, stranger) = (node(&f, "a"), node(&f, "b"), node(&f, "zz"));
    handle(
        &f,
        &[
            hello(&a, 1, labels(&[]), &[(Section::Config, 2)]),
            hello(&b, 1, labels(&[]), &[]),
        ],
    )
    .await;

    let t0 = Utc::now() - Duration::seconds(60);
    let batch = vec![
        heartbeat(&a, 2, t0 + Duration::seconds(10), &[(Section::Config, 3)]),
        heartbeat(&a, 4, t0 + Duration::seconds(30), &[(Section::Config, 5)]),
        heartbeat(&a, 3, t0 + Duration::seconds(20), &[(Section::Config, 4)]),
        heartbeat(
            &b,
            2,
            t0 + Duration::seconds(5),
            &[(Section::Config, 1), (Section::Delivery, 7)],
        ),
        heartbeat(&b, 2, t0 + Duration::seconds(5), &[(Section::Config, 1)]), // redelivered
        heartbeat(&stranger, 9, t0, &[(Section::Config, 1)]),
    ];
    // Pretend the hellos are old so the heartbeats move last_seen.
    sqlx::query("UPDATE inventory.nodes SET last_seen = $1")
        .bind(t0)
        .execute(&f.pool)
        .await
        .unwrap();
    handle(&f, &batch).await;

    let va = f.inventory.node(&a).await.unwrap().unwrap();
    assert_eq!(
        va.last_seen.timestamp_micros(),
        (t0 + Duration::seconds(30)).timestamp_micros()
    );
    assert_eq!(va.last_seq, 4);
    assert_eq!(va.state, "alive");
    assert_eq!(va.applied["config"].generation, 5);
    let vb = f.inventory.node(&b).await.unwrap().unwrap();
    assert_eq!(
        vb.last_seen.timestamp_micros(),
        (t0 + Duration::seconds(5)).timestamp_micros()
    );
    assert_eq!(vb.applied["config"].generation, 1);
    assert_eq!(vb.applied["delivery"].generation, 7);
    assert!(
        f.inventory.node(&stranger).await.unwrap().is_none(),
        "unknown nodes are ignored"
    );

    // An older heartbeat (and an older generation) never moves anything back.
    handle(&f, &[heartbeat(&a, 1, t0, &[(Section::Config, 1)])]).await;
    let va = f.inventory.node(&a).await.unwrap().unwrap();
    assert_eq!(
        va.last_seen.timestamp_micros(),
        (t0 + Duration::seconds(30)).timestamp_micros()
    );
    assert_eq!(va.applied["config"].generation, 5);
    // Heartbeats write no events.
    assert_eq!(events(&f).await.len(), 2);
    f.env.teardown().await.unwrap();
}

/// Declarations of the inventory section in the outbox, oldest first: (node, generation).
async fn inventory_declarations(f: &Fixture) -> Vec<(String, u64)> {
    let rows: Vec<(String, Vec<u8>)> = sqlx::query_as(
        "SELECT node, payload FROM inventory.outbox WHERE exchange = 'declarations' ORDER BY id",
    )
    .fetch_all(&f.pool)
    .await
    .unwrap();
    rows.into_iter()
        .map(|(node, payload)| {
            let v: serde_json::Value = serde_json::from_slice(&payload).unwrap();
            assert_eq!(v["body"]["section"], "inventory", "{v}");
            (node, v["body"]["generation"].as_u64().unwrap())
        })
        .collect()
}

#[tokio::test]
async fn heartbeats_resend_a_section_a_node_is_behind_on_at_most_once_per_resend_after() {
    let f = setup().await;
    let (a, b, c) = (node(&f, "a"), node(&f, "b"), node(&f, "c"));
    let hellos: Vec<_> = [&a, &b, &c]
        .iter()
        .map(|n| hello(n, 1, labels(&[]), &[(Section::Inventory, 3)]))
        .collect();
    handle(&f, &hellos).await;
    // a and b were declared generation 3 long ago; c has no inventory section.
    for n in [&a, &b] {
        sqlx::query(
            "INSERT INTO inventory.sections (node, generation, digest, items, last_sent_at) \
             VALUES ($1, 3, 'd', '{\"files\": []}', now() - interval '1 hour')",
        )
        .bind(n.as_str())
        .execute(&f.pool)
        .await
        .unwrap();
    }
    let before = inventory_declarations(&f).await.len();

    // a is behind (applied 2), b is current (3), c reports nothing: only a is
    // sent its section again, under the same generation.
    let now = Utc::now();
    handle(
        &f,
        &[
            heartbeat(&a, 2, now, &[(Section::Inventory, 2)]),
            heartbeat(&b, 2, now, &[(Section::Inventory, 3)]),
            heartbeat(&c, 2, now, &[]),
        ],
    )
    .await;
    let sent = inventory_declarations(&f).await;
    assert_eq!(sent[before..], [(a.to_string(), 3)], "{sent:?}");

    // Still behind a moment later: not again within resend_after.
    handle(&f, &[heartbeat(&a, 3, now, &[(Section::Inventory, 2)])]).await;
    assert_eq!(inventory_declarations(&f).await.len(), before + 1);

    // Once resend_after has passed, again.
    sqlx::query("UPDATE inventory.sections SET last_sent_at = now() - interval '1 hour'")
        .execute(&f.pool)
        .await
        .unwrap();
    handle(&f, &[heartbeat(&a, 4, now, &[(Section::Inventory, 2)])]).await;
    assert_eq!(inventory_declarations(&f).await.len(), before + 2);
    // The heartbeats' other effects in the same statement.
    let va = f.inventory.node(&a).await.unwrap().unwrap();
    assert_eq!(va.last_seq, 4);
    assert_eq!(
        va.applied["inventory"].generation, 3,
        "from the hello, never lowered"
    );

    // b ahead (its row was restored to an older generation): lifted above
    // it at once, in the same one statement, whatever the last send.
    handle(&f, &[heartbeat(&b, 5, now, &[(Section::Inventory, 9)])]).await;
    let sent = inventory_declarations(&f).await;
    assert_eq!(sent[before + 2..], [(b.to_string(), 10)], "{sent:?}");
    let generation: i64 =
        sqlx::query_scalar("SELECT generation FROM inventory.sections WHERE node = $1")
            .bind(b.as_str())
            .fetch_one(&f.pool)
            .await
            .unwrap();
    assert_eq!(generation, 10);
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn the_section_table_migration_keeps_every_row_and_the_node_link() {
    let env = TestEnv::new().await.unwrap();
    let url = env.database_url("inventory");
    mesh_plumbing::migrate(
        &url,
        "inventory",
        mesh_inventory::migrations().set_target(refinery::Target::Version(4)),
    )
    .await
    .unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .unwrap();
    for n in ["n1", "n2"] {
        sqlx::query(
            "INSERT INTO inventory.nodes (id, hostname, arch, cpus, memory_bytes, agent_version) \
             VALUES ($1, 'h', 'x86_64', 1, 1, 'old')",
        )
        .bind(n)
        .execute(&pool)
        .await
        .unwrap();
        sqlx::query(
            "INSERT INTO inventory.sections (node, generation, digest, items, declared_at) \
             VALUES ($1, 6, 'd6', '{\"files\": []}', '2026-01-02T03:04:05Z')",
        )
        .bind(n)
        .execute(&pool)
        .await
        .unwrap();
    }
    let applied = mesh_inventory::migrate(&url).await.unwrap();
    assert_eq!(
        applied,
        [
            "V5__sections",
            "V6__protocol",
            "V7__heartbeat_interval",
            "V8__module_placements",
            "V9__module_ports",
            "V10__conditions",
            "V11__module_health",
            "V12__module_targets",
            "V13__module_resources",
            "V14__trusted_labels",
            "V15__node_label",
            "V16__revoked_nodes",
            "V17__unit_sandbox",
            "V18__scrape_targets"
        ],
        "{applied:?}"
    );
    let kept: Vec<(String, i64, String, DateTime<Utc>)> = sqlx::query_as(
        "SELECT node, generation, digest, declared_at FROM inventory.sections ORDER BY node",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(kept.len(), 2);
    assert_eq!((kept[0].1, kept[0].2.as_str()), (6, "d6"));
    assert_eq!(kept[0].3.to_rfc3339(), "2026-01-02T03:04:05+00:00");
    // A section still goes with its node, and names only a known one.
    sqlx::query("DELETE FROM inventory.nodes WHERE id = 'n1'")
        .execute(&pool)
        .await
        .unwrap();
    let left: Vec<String> = sqlx::query_scalar("SELECT node FROM inventory.sections")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(left, ["n2"]);
    let err = sqlx::query(
        "INSERT INTO inventory.sections (node, generation, digest, items) VALUES ('nobody', 1, 'd', '{}')",
    )
    .execute(&pool)
    .await
    .unwrap_err();
    assert!(err.to_string().contains("foreign key"), "{err}");
    pool.close().await;
    env.teardown().await.unwrap();
}

#[tokio::test]
async fn the_conditions_migration_drops_the_alerts_and_starts_with_nothing_told() {
    let env = TestEnv::new().await.unwrap();
    let url = env.database_url("inventory");
    mesh_plumbing::migrate(
        &url,
        "inventory",
        mesh_inventory::migrations().set_target(refinery::Target::Version(9)),
    )
    .await
    .unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .unwrap();
    // An alert the old reconcile kept open: it was never told to the record.
    sqlx::query(
        "INSERT INTO inventory.alerts (key, kind, message) \
         VALUES ('replacement_paused', 'replacement_paused', 'paused')",
    )
    .execute(&pool)
    .await
    .unwrap();
    let applied = mesh_inventory::migrate(&url).await.unwrap();
    assert_eq!(
        applied,
        [
            "V10__conditions",
            "V11__module_health",
            "V12__module_targets",
            "V13__module_resources",
            "V14__trusted_labels",
            "V15__node_label",
            "V16__revoked_nodes",
            "V17__unit_sandbox",
            "V18__scrape_targets"
        ]
    );
    let alerts: Option<String> = sqlx::query_scalar("SELECT to_regclass('inventory.alerts')::text")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(alerts, None, "inventory keeps no alerts");
    // Nothing told yet: the first pass that finds a condition tells it.
    let told: i64 = sqlx::query_scalar("SELECT count(*) FROM inventory.conditions")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(told, 0);
    let versions: Vec<i64> = sqlx::query_scalar(
        "SELECT nextval('inventory.conditions_version') FROM generate_series(1, 2)",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(versions[1] > versions[0], "{versions:?}");
    pool.close().await;
    env.teardown().await.unwrap();
}

#[tokio::test]
async fn joined_once_and_updated_on_label_change() {
    let f = setup().await;
    let a = node(&f, "a");
    handle(&f, &[hello(&a, 1, labels(&[("role", "web")]), &[])]).await;
    handle(&f, &[hello(&a, 2, labels(&[("role", "web")]), &[])]).await; // reconnect, same labels
    let ev = events(&f).await;
    assert_eq!(ev.len(), 1, "{ev:?}");
    assert_eq!(ev[0].0, "node.joined");
    assert_eq!(
        ev[0].1,
        NodeLabelsChanged {
            node: a.clone(),
            labels: effective(&a, &[("role", "web")]),
            version: 1
        }
    );

    handle(&f, &[hello(&a, 3, labels(&[("role", "db")]), &[])]).await;
    let ev = events(&f).await;
    assert_eq!(ev.len(), 2);
    assert_eq!(ev[1].0, "node.updated");
    assert_eq!(ev[1].1.labels, effective(&a, &[("role", "db")]));
    assert_eq!(ev[1].1.version, 2);

    // An operator label overrides the reported one.
    let (status, _, body) = put_labels(
        &f,
        &format!("/v1/nodes/{a}/labels"),
        r#"{"labels": {"role": "web", "zone": "a"}}"#,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(
        body["labels"]["effective"],
        serde_json::json!({"role": "web", "zone": "a", "mesh.io/node": a.as_str()})
    );
    assert_eq!(body["version"], 3);
    let ev = events(&f).await;
    assert_eq!(ev.len(), 3);
    assert_eq!(
        ev[2].1.labels,
        effective(&a, &[("role", "web"), ("zone", "a")])
    );
    assert_eq!(ev[2].1.version, 3);

    // The same labels again change nothing; a hello whose reported change is
    // masked by the operator's changes nothing either.
    let (status, _, _) = put_labels(
        &f,
        &format!("/v1/nodes/{a}/labels"),
        r#"{"labels": {"role": "web", "zone": "a"}}"#,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    handle(&f, &[hello(&a, 4, labels(&[("role", "cache")]), &[])]).await;
    assert_eq!(events(&f).await.len(), 3);

    let view = f.inventory.node(&a).await.unwrap().unwrap();
    assert_eq!(view.labels.reported, labels(&[("role", "cache")]));
    assert_eq!(
        view.labels.operator,
        labels(&[("role", "web"), ("zone", "a")])
    );
    assert_eq!(view.version, 3);

    let (status, _, body) = request(&f, "GET", "/v1/nodes", "").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["nodes"][0]["id"], a.as_str());
    assert_eq!(
        body["nodes"][0]["labels"],
        serde_json::json!({"role": "web", "zone": "a", "mesh.io/node": a.as_str()})
    );
    assert_eq!(body["nodes"][0]["state"], "alive");
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn applied_reports() {
    let f = setup().await;
    let a = node(&f, "a");
    handle(&f, &[hello(&a, 1, labels(&[]), &[])]).await;
    let applied = |seq, generation, outcome, error: Option<&str>| {
        Envelope::new(
            a.clone(),
            seq,
            Report::Applied(Applied {
                section: Some(Section::Config),
                generation: Some(generation),
                outcome,
                items: vec![],
                error: error.map(str::to_owned),
                unsupported_section: None,
            }),
        )
    };
    handle(&f, &[applied(2, 1, Outcome::Applied, None)]).await;
    handle(&f, &[applied(3, 2, Outcome::Failed, Some("disk full"))]).await;
    let view = f.inventory.node(&a).await.unwrap().unwrap();
    let config = &view.applied["config"];
    assert_eq!(
        config.generation, 1,
        "a failure does not advance the generation"
    );
    assert_eq!(config.outcome.as_deref(), Some("failed"));
    assert_eq!(config.outcome_generation, Some(2));
    assert_eq!(config.error.as_deref(), Some("disk full"));

    // In one batch: applied 3, then a late failure about generation 2.
    handle(
        &f,
        &[
            applied(5, 3, Outcome::Applied, None),
            applied(4, 2, Outcome::Failed, Some("old")),
        ],
    )
    .await;
    let view = f.inventory.node(&a).await.unwrap().unwrap();
    let config = &view.applied["config"];
    assert_eq!(config.generation, 3);
    assert_eq!(config.outcome.as_deref(), Some("applied"));
    assert_eq!(config.error, None);
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn api_errors_are_problems_naming_the_field() {
    let f = setup().await;
    let a = node(&f, "a");
    handle(&f, &[hello(&a, 1, labels(&[]), &[])]).await;
    let uri = format!("/v1/nodes/{a}/labels");

    let (status, ct, body) = put_labels(&f, &uri, r#"{"labels": {"Bad Key": "x"}}"#).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(ct, "application/problem+json");
    assert_eq!(body["field"], "labels.Bad Key", "{body}");

    let (status, ct, body) = put_labels(&f, &uri, "not json").await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(ct, "application/problem+json");

    let (status, _, body) = put_labels(&f, &uri, r#"{"labels": {}, "extra": 1}"#).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(body["field"], "extra", "{body}");

    let (status, _, body) = put_labels(&f, &uri, r#"{"labels": {"role": 5}}"#).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(body["field"], "labels.role", "{body}");

    let (status, _, body) = put_labels(&f, &uri, r#"{}"#).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(body["field"], "labels", "{body}");

    let (status, ct, body) = put_labels(
        &f,
        &format!("/v1/nodes/{}/labels", node(&f, "nobody")),
        r#"{"labels": {}}"#,
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    assert_eq!(ct, "application/problem+json");

    let (status, _, body) = request(&f, "GET", "/v1/nodes?limit=0", "").await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(body["field"], "limit");
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn pages_of_nodes() {
    let f = setup().await;
    let ids: Vec<NodeId> = (0..5).map(|i| node(&f, &format!("n{i}"))).collect();
    let hellos: Vec<_> = ids.iter().map(|n| hello(n, 1, labels(&[]), &[])).collect();
    handle(&f, &hellos).await;
    let (_, _, first) = request(&f, "GET", "/v1/nodes?limit=3", "").await;
    assert_eq!(first["nodes"].as_array().unwrap().len(), 3);
    let next = first["next"].as_str().unwrap();
    let (_, _, second) = request(&f, "GET", &format!("/v1/nodes?limit=3&after={next}"), "").await;
    let got: Vec<&str> = second["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["id"].as_str().unwrap())
        .collect();
    assert_eq!(got, vec![ids[3].as_str(), ids[4].as_str()]);
    assert!(second.get("next").is_none());
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn a_selector_lists_the_nodes_whose_effective_labels_match() {
    let f = setup().await;
    let web_eu = node(&f, "web-eu");
    let web_us = node(&f, "web-us");
    let db_eu = node(&f, "db-eu");
    handle(
        &f,
        &[
            hello(&web_eu, 1, labels(&[("role", "web"), ("zone", "eu")]), &[]),
            hello(&web_us, 1, labels(&[("role", "web"), ("zone", "us")]), &[]),
            // Reported `web`, but the operator's label overrides it.
            hello(&db_eu, 1, labels(&[("role", "web"), ("zone", "eu")]), &[]),
        ],
    )
    .await;
    let (status, _, _) = put_labels(
        &f,
        &format!("/v1/nodes/{db_eu}/labels"),
        r#"{"labels": {"role": "db"}}"#,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let ids = |body: &serde_json::Value| -> Vec<String> {
        body["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n["id"].as_str().unwrap().to_owned())
            .collect()
    };
    let (status, _, body) = request(&f, "GET", "/v1/nodes?selector=role%3Dweb", "").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(ids(&body), vec![web_eu.to_string(), web_us.to_string()]);
    let (_, _, body) = request(&f, "GET", "/v1/nodes?selector=role=web,zone=eu", "").await;
    assert_eq!(
        ids(&body),
        vec![web_eu.to_string()],
        "every pair must match"
    );
    let (_, _, body) = request(&f, "GET", "/v1/nodes?selector=role=db", "").await;
    assert_eq!(ids(&body), vec![db_eu.to_string()], "operator labels win");
    let (_, _, body) = request(&f, "GET", "/v1/nodes?selector=zone=mars", "").await;
    assert_eq!(ids(&body), Vec::<String>::new());
    // Pages count only matching nodes; `next` resumes among them.
    let (_, _, first) = request(&f, "GET", "/v1/nodes?selector=zone=eu&limit=1", "").await;
    assert_eq!(ids(&first), vec![db_eu.to_string()]);
    let next = first["next"].as_str().unwrap();
    let (_, _, second) = request(
        &f,
        "GET",
        &format!("/v1/nodes?selector=zone=eu&limit=1&after={next}"),
        "",
    )
    .await;
    assert_eq!(ids(&second), vec![web_eu.to_string()]);

    for bad in ["role", "role=web,", "=web", "Role=web", "role=a,role=b", ""] {
        let (status, ct, body) = request(
            &f,
            "GET",
            &format!(
                "/v1/nodes?selector={}",
                bad.replace('=', "%3D").replace(',', "%2C")
            ),
            "",
        )
        .await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{bad}: {body}");
        assert_eq!(ct, "application/problem+json");
        assert_eq!(body["field"], "selector", "{bad}: {body}");
    }
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn roles_cannot_cross_schemas() {
    let f = setup().await;
    let config = PgPoolOptions::new()
        .max_connections(1)
        .connect(&f.env.database_url("config"))
        .await
        .unwrap();
    let err = sqlx::query("SELECT count(*) FROM inventory.nodes")
        .execute(&config)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("permission denied"), "{err}");
    let err = sqlx::query("SELECT count(*) FROM config.files")
        .execute(&f.pool)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("permission denied"), "{err}");
    config.close().await;
    f.env.teardown().await.unwrap();
}

async fn identity_event(f: &Fixture, event: &str, node: &NodeId, at: DateTime<Utc>) {
    identity_event_with(f, event, node, at, None).await
}

async fn identity_event_with(
    f: &Fixture,
    event: &str,
    node: &NodeId,
    at: DateTime<Utc>,
    labels: Option<Labels>,
) {
    let body = mesh_protocol::NodeIdentityChanged {
        node: node.clone(),
        public_key: None,
        at,
        labels,
    };
    let event = RecordEvent::new(match event {
        "node.enrolled" => RecordKind::NodeEnrolled(body),
        "node.revoked" => RecordKind::NodeRevoked(body),
        "node.readmitted" => RecordKind::NodeReadmitted(body),
        other => panic!("not an identity event: {other}"),
    });
    let mut tx = f.pool.begin().await.unwrap();
    f.inventory.handle_event(&mut tx, &event).await.unwrap();
    tx.commit().await.unwrap();
    f.inventory.committed();
}

async fn state_of(f: &Fixture, node: &NodeId) -> String {
    f.inventory.node(node).await.unwrap().unwrap().state
}

#[tokio::test]
async fn identity_revocation_and_reenrolment_reach_inventory_in_order() {
    let f = setup().await;
    let a = node(&f, "a");
    handle(&f, &[hello(&a, 1, labels(&[]), &[])]).await;
    assert_eq!(state_of(&f, &a).await, "alive");
    assert!(f.inventory.subscriptions().contains(&"identity.node.*"));

    let t0 = Utc::now();
    identity_event(&f, "node.revoked", &a, t0).await;
    assert_eq!(state_of(&f, &a).await, "revoked");
    // An enrolment older than the revocation, arriving late, changes nothing.
    identity_event(&f, "node.enrolled", &a, t0 - Duration::seconds(5)).await;
    assert_eq!(state_of(&f, &a).await, "revoked");
    // A newer one (re-enrolment under a fresh key) makes it schedulable again.
    identity_event(&f, "node.enrolled", &a, t0 + Duration::seconds(5)).await;
    assert_eq!(state_of(&f, &a).await, "alive");
    f.env.teardown().await.unwrap();
}

/// Decision 0050: the revoked nodes are known in memory (what the pipeline
/// refuses reports by), from the first revocation on, for a node inventory
/// never heard from too; a re-admission takes it out once committed, and a
/// controller started later loads the same set.
#[tokio::test]
async fn revoked_nodes_are_known_in_memory_until_readmitted_and_across_restarts() {
    let f = setup().await;
    let a = node(&f, "a");
    let unheard = node(&f, "never-heard");
    handle(&f, &[hello(&a, 1, labels(&[]), &[])]).await;
    assert!(f.inventory.revoked_nodes().is_empty());
    let t0 = Utc::now();
    identity_event(&f, "node.revoked", &a, t0).await;
    identity_event(&f, "node.revoked", &unheard, t0).await;
    let revoked = f.inventory.revoked_nodes();
    assert!(revoked.contains(&a) && revoked.contains(&unheard));
    assert_eq!(state_of(&f, &a).await, "revoked");

    // A controller started now loads both.
    let restarted = Inventory::new(
        f.pool.clone(),
        OutboxSignal::default(),
        InventorySettings::default(),
    );
    assert_eq!(restarted.load_revocations().await.unwrap(), 2);
    assert!(restarted.revoked_nodes().contains(&unheard));

    // A re-admission older than the revocation changes nothing; a newer one
    // makes the node active (unreachable until it is heard) and counted.
    identity_event(&f, "node.readmitted", &a, t0 - Duration::seconds(5)).await;
    assert!(f.inventory.revoked_nodes().contains(&a));
    identity_event(&f, "node.readmitted", &a, t0 + Duration::seconds(5)).await;
    assert!(!f.inventory.revoked_nodes().contains(&a));
    assert!(f.inventory.revoked_nodes().contains(&unheard));
    assert_ne!(state_of(&f, &a).await, "revoked");
    assert_eq!(restarted.load_revocations().await.unwrap(), 1);
    f.env.teardown().await.unwrap();
}

/// What the controller's router does with a batch of reports: the inbox keeps
/// the messages not handled before (one copy of a message delivered twice in
/// the batch), the context handles them, one transaction.
async fn route(f: &Fixture, reports: &[Envelope<Report>]) {
    let mut tx = f.pool.begin().await.unwrap();
    let ids: Vec<_> = reports.iter().map(|e| e.id).collect();
    let mut fresh = mesh_plumbing::inbox::claim(&mut tx, "inventory", &ids)
        .await
        .unwrap();
    let fresh: Vec<Envelope<Report>> = reports
        .iter()
        .filter(|e| fresh.remove(&e.id))
        .cloned()
        .collect();
    if !fresh.is_empty() {
        f.inventory.handle_reports(&mut tx, &fresh).await.unwrap();
    }
    tx.commit().await.unwrap();
}

/// Everything a hello writes, except the controller's clock (`heard_at`,
/// `first_seen`, `updated_at`): node rows, applied rows, and each node's
/// events in order (event ids and the order between nodes aside).
async fn hello_state(f: &Fixture) -> (Vec<String>, Vec<String>, Vec<String>) {
    let nodes: Vec<String> = sqlx::query_scalar(
        "SELECT concat_ws(' | ', id, hostname, arch, cpus, memory_bytes, agent_version, public_key, \
         reported_labels, operator_labels, last_seen, hello_at, last_seq, state, version, \
         unreachable_since, admin_state, units_seq, protocol_min, protocol_max, refused) \
         FROM inventory.nodes ORDER BY id",
    )
    .fetch_all(&f.pool)
    .await
    .unwrap();
    let applied: Vec<String> = sqlx::query_scalar(
        "SELECT concat_ws(' | ', node, section, generation, outcome, outcome_generation, error) \
         FROM inventory.applied ORDER BY node, section",
    )
    .fetch_all(&f.pool)
    .await
    .unwrap();
    let mut events: Vec<String> = events(f)
        .await
        .into_iter()
        .map(|(kind, b)| format!("{} {kind} v{} {:?}", b.node, b.version, b.labels))
        .collect();
    // Stable: a node's events keep their order.
    events.sort_by(|a, b| a.split(' ').next().cmp(&b.split(' ').next()));
    (nodes, applied, events)
}

fn protocol_hello(node: &NodeId, seq: u64, min: u16, max: u16) -> Envelope<Report> {
    let mut env = hello(node, seq, labels(&[("role", "old")]), &[]);
    if let Report::Hello(h) = &mut env.body {
        h.protocol = Some(mesh_protocol::ProtocolRange { min, max });
    }
    env
}

#[tokio::test]
async fn a_batch_of_hellos_writes_what_handling_them_one_by_one_writes() {
    let (batched, single) = (setup().await, setup().await);
    // The same node names in both databases.
    let id = |s: &str| NodeId::parse(&format!("eq-{s}")).unwrap();
    let t0 = Utc::now() - Duration::seconds(600);
    let at = |env: Envelope<Report>, secs: i64| {
        let mut env = env;
        env.sent_at = t0 + Duration::seconds(secs);
        env
    };

    // Before: a known node, a node refused earlier, a node heard of long ago.
    let known_first = at(
        hello(
            &id("known"),
            1,
            labels(&[("role", "web")]),
            &[(Section::Config, 1)],
        ),
        0,
    );
    let before = vec![
        known_first.clone(),
        at(protocol_hello(&id("was-refused"), 1, 2, 3), 0),
        at(hello(&id("late"), 5, labels(&[]), &[]), 100),
    ];
    for f in [&batched, &single] {
        route(f, &before).await;
    }

    let new1 = at(
        hello(
            &id("new1"),
            1,
            labels(&[("role", "web")]),
            &[(Section::Config, 3), (Section::Inventory, 2)],
        ),
        200,
    );
    let batch = vec![
        new1.clone(),
        at(hello(&id("new2"), 1, labels(&[]), &[]), 201),
        // A known node says hello again with other labels: updated.
        at(
            hello(
                &id("known"),
                2,
                labels(&[("role", "db")]),
                &[(Section::Config, 2)],
            ),
            202,
        ),
        // An agent this controller cannot speak to: refused, no event.
        at(protocol_hello(&id("bad"), 1, 2, 3), 203),
        // Delivered twice in the batch, and a redelivery of a handled hello.
        new1.clone(),
        known_first.clone(),
        // A new node with two hellos in the batch: joined, then updated.
        at(
            hello(
                &id("twice"),
                1,
                labels(&[("role", "a")]),
                &[(Section::Config, 1)],
            ),
            204,
        ),
        at(
            hello(
                &id("twice"),
                2,
                labels(&[("role", "b")]),
                &[(Section::Config, 2)],
            ),
            205,
        ),
        // A refused node's agent upgraded: the refusal lifts, it joins.
        at(
            hello(&id("was-refused"), 2, labels(&[("role", "new")]), &[]),
            206,
        ),
        // An older hello arriving late: it proves the node alive, no more.
        at(
            hello(
                &id("late"),
                4,
                labels(&[("role", "stale")]),
                &[(Section::Config, 9)],
            ),
            50,
        ),
        // A node whose first hello is refused and whose second is not.
        at(protocol_hello(&id("mixed"), 1, 2, 3), 207),
        at(hello(&id("mixed"), 2, labels(&[("role", "m")]), &[]), 208),
    ];
    route(&batched, &batch).await;
    for env in &batch {
        route(&single, std::slice::from_ref(env)).await;
    }

    let (b, s) = (hello_state(&batched).await, hello_state(&single).await);
    assert_eq!(b.0, s.0, "node rows");
    assert_eq!(b.1, s.1, "applied rows");
    assert_eq!(b.2, s.2, "events");

    // And what that is, for the new nodes.
    let v = batched.inventory.node(&id("new1")).await.unwrap().unwrap();
    assert_eq!(v.version, 1);
    assert_eq!(v.labels.reported, labels(&[("role", "web")]));
    assert_eq!(v.applied["config"].generation, 3);
    assert_eq!(v.applied["inventory"].generation, 2);
    let joined = |node: &str| {
        b.2.iter()
            .filter(|e| e.starts_with(&format!("eq-{node} node.joined")))
            .count()
    };
    for node in ["new1", "new2", "twice", "was-refused", "mixed", "known"] {
        assert_eq!(joined(node), 1, "{node}: {:?}", b.2);
    }
    assert_eq!(joined("bad"), 0, "{:?}", b.2);
    assert!(
        b.2.iter()
            .any(|e| e.starts_with("eq-known node.updated v2")),
        "{:?}",
        b.2
    );
    assert!(
        b.2.iter()
            .any(|e| e.starts_with("eq-twice node.updated v2")),
        "{:?}",
        b.2
    );
    let bad: Option<String> =
        sqlx::query_scalar("SELECT refused FROM inventory.nodes WHERE id = 'eq-bad'")
            .fetch_one(&batched.pool)
            .await
            .unwrap();
    assert!(bad.is_some());
    batched.env.teardown().await.unwrap();
    single.env.teardown().await.unwrap();
}

#[tokio::test]
async fn labels_have_etags_two_writers_one_wins() {
    let f = setup().await;
    let a = node(&f, "a");
    handle(&f, &[hello(&a, 1, labels(&[("role", "web")]), &[])]).await;
    let uri = format!("/v1/nodes/{a}/labels");

    // Read: the labels and their ETag; the same tag again is 304, no body.
    let (status, headers, body) = request_with(&f, "GET", &uri, &[], "").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(
        body["labels"]["reported"],
        serde_json::json!({"role": "web"})
    );
    let tag = headers["etag"].to_str().unwrap().to_owned();
    assert_eq!(tag, "\"1\"");
    let (status, headers, body) =
        request_with(&f, "GET", &uri, &[("if-none-match", &tag)], "").await;
    assert_eq!(status, StatusCode::NOT_MODIFIED);
    assert_eq!(headers["etag"], tag.as_str());
    assert_eq!(body, serde_json::Value::Null);

    // A write without If-Match: 428, naming the header to send.
    let (status, headers, body) =
        request_with(&f, "PUT", &uri, &[], r#"{"labels": {"zone": "a"}}"#).await;
    assert_eq!(status, StatusCode::PRECONDITION_REQUIRED, "{body}");
    assert_eq!(headers["content-type"], "application/problem+json");
    assert!(
        body["detail"].as_str().unwrap().contains("If-Match: \"1\""),
        "{body}"
    );

    // Two writers read the same ETag: one wins, the other gets 412.
    let if_match = [("if-match", tag.as_str())];
    let (first, second) = tokio::join!(
        request_with(&f, "PUT", &uri, &if_match, r#"{"labels": {"zone": "a"}}"#),
        request_with(&f, "PUT", &uri, &if_match, r#"{"labels": {"zone": "b"}}"#),
    );
    let mut statuses = [first.0, second.0];
    statuses.sort();
    assert_eq!(
        statuses,
        [StatusCode::OK, StatusCode::PRECONDITION_FAILED],
        "{} {}",
        first.2,
        second.2
    );
    let winner = if first.0 == StatusCode::OK {
        &first
    } else {
        &second
    };
    assert_eq!(winner.1["etag"], "\"2\"");
    assert_eq!(winner.2["revision"], 2);

    // The old tag is no longer current: GET answers in full with the new one.
    let (status, headers, body) =
        request_with(&f, "GET", &uri, &[("if-none-match", &tag)], "").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["etag"], "\"2\"");
    assert_eq!(body["labels"]["operator"], winner.2["labels"]["operator"]);

    // The current tag writes; so does `*`; each write raises the revision.
    let (status, headers, _) = request_with(
        &f,
        "PUT",
        &uri,
        &[("if-match", "\"2\"")],
        r#"{"labels": {}}"#,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["etag"], "\"3\"");
    let (status, headers, _) =
        request_with(&f, "PUT", &uri, &[("if-match", "*")], r#"{"labels": {}}"#).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["etag"], "\"4\"");
    let (status, _, body) = request_with(
        &f,
        "PUT",
        &uri,
        &[("if-match", "nonsense")],
        r#"{"labels": {}}"#,
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(body["field"], "if-match");
    let (status, _, _) = request_with(
        &f,
        "GET",
        &format!("/v1/nodes/{}/labels", node(&f, "nobody")),
        &[],
        "",
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    f.env.teardown().await.unwrap();
}

/// Decision 0044: the mesh's endpoints in the settings are declared in the
/// inventory section of a node that joins (in the join's transaction) and,
/// at the first sweep after start, of every node; once, and only where the
/// section differs. Without endpoints a node that runs nothing is declared
/// nothing.
#[tokio::test]
async fn the_mesh_endpoints_are_declared_at_join_and_at_the_first_sweep() {
    let f = setup().await;
    let (a, b) = (node(&f, "a"), node(&f, "b"));
    handle(&f, &[hello(&a, 1, labels(&[]), &[])]).await;
    assert!(inventory_declarations(&f).await.is_empty());

    // The controller starts again, knowing the mesh's endpoints.
    let endpoints = mesh_protocol::Endpoints {
        brokers: vec!["10.0.0.1:5671".into(), "10.0.0.2:5671".into()],
        api: vec!["https://10.0.0.1:7443".into()],
    };
    let inventory = Inventory::new(
        f.pool.clone(),
        OutboxSignal::default(),
        InventorySettings {
            endpoints: Some(endpoints.clone()),
            label_trust: mesh_inventory::LabelTrust::new(["role".to_owned(), "zone".to_owned()]),
            ..InventorySettings::default()
        },
    );
    let mut tx = f.pool.begin().await.unwrap();
    inventory
        .handle_reports(&mut tx, &[hello(&b, 1, labels(&[]), &[])])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        inventory_declarations(&f).await,
        vec![(b.as_str().to_owned(), 1)]
    );
    inventory.sweep(Utc::now()).await.unwrap();
    inventory.sweep(Utc::now()).await.unwrap();
    assert_eq!(
        inventory_declarations(&f).await,
        vec![(b.as_str().to_owned(), 1), (a.as_str().to_owned(), 1)]
    );
    let payloads: Vec<Vec<u8>> = sqlx::query_scalar(
        "SELECT payload FROM inventory.outbox WHERE exchange = 'declarations' ORDER BY id",
    )
    .fetch_all(&f.pool)
    .await
    .unwrap();
    for p in payloads {
        let v: serde_json::Value = serde_json::from_slice(&p).unwrap();
        let told: mesh_protocol::Endpoints =
            serde_json::from_value(v["body"]["items"]["endpoints"].clone()).unwrap();
        assert_eq!(told, endpoints, "{v}");
    }
    f.env.teardown().await.unwrap();
}

/// Issue 29: by default what a node states about itself selects nothing. A
/// node stating `role=db` and `mesh.hub=true` joins with no effective label
/// (its stated ones shown as stated), no selector finds it, and restating
/// changes nothing on the record; operator labels select; the labels bound
/// to its join token (told by identity before its hello) are its operator
/// labels from the first hello; a re-join's token labels apply at once; and
/// nobody sets a `mesh.io/` key.
#[tokio::test]
async fn stated_labels_select_nothing_operator_and_token_labels_do() {
    let f = setup_with(InventorySettings::default()).await;
    let hostile = node(&f, "web-2");
    let stated = labels(&[
        ("role", "db"),
        ("mesh.hub", "true"),
        ("mesh.io/node", "db-1"),
    ]);
    handle(&f, &[hello(&hostile, 1, stated.clone(), &[])]).await;
    let ev = events(&f).await;
    assert_eq!(ev.len(), 1, "{ev:?}");
    assert_eq!(ev[0].0, "node.joined");
    // Only what the controller verified: its id, not the `mesh.io/node` it
    // stated.
    assert_eq!(
        ev[0].1.labels,
        effective(&hostile, &[]),
        "stated labels selected"
    );
    let view = f.inventory.node(&hostile).await.unwrap().unwrap();
    assert_eq!(
        view.labels.reported, stated,
        "stated labels shown as stated"
    );
    assert_eq!(
        view.labels.effective,
        effective(&hostile, &[]),
        "{:?}",
        view.labels
    );
    // The verified id selects the node; the id it claimed does not.
    let by_id = f
        .inventory
        .nodes(
            None,
            100,
            Some(&labels(&[("mesh.io/node", hostile.as_str())])),
        )
        .await
        .unwrap();
    assert_eq!(
        by_id.iter().map(|n| n.id.as_str()).collect::<Vec<_>>(),
        [hostile.as_str()]
    );
    let claimed = f
        .inventory
        .nodes(None, 100, Some(&labels(&[("mesh.io/node", "db-1")])))
        .await
        .unwrap();
    assert!(claimed.is_empty(), "{claimed:?}");
    let found = f
        .inventory
        .nodes(None, 100, Some(&labels(&[("role", "db")])))
        .await
        .unwrap();
    assert!(
        found.is_empty(),
        "a selector found a node by what it stated: {found:?}"
    );
    // Restating other labels: nothing selects, nothing is told.
    handle(&f, &[hello(&hostile, 2, labels(&[("role", "web")]), &[])]).await;
    assert_eq!(events(&f).await.len(), 1);

    // Labels bound to a join token, told before the node's first hello.
    let web = node(&f, "web-3");
    let at = Utc::now();
    identity_event_with(
        &f,
        "node.enrolled",
        &web,
        at,
        Some(labels(&[("role", "web")])),
    )
    .await;
    handle(&f, &[hello(&web, 1, labels(&[("role", "db")]), &[])]).await;
    let ev = events(&f).await;
    let joined = ev
        .iter()
        .find(|(_, b)| b.node == web)
        .expect("web-3 joined");
    assert_eq!(joined.1.labels, effective(&web, &[("role", "web")]));
    let found = f
        .inventory
        .nodes(None, 100, Some(&labels(&[("role", "web")])))
        .await
        .unwrap();
    assert_eq!(
        found.iter().map(|n| n.id.as_str()).collect::<Vec<_>>(),
        [web.as_str()]
    );

    // A re-join of a known node under a token with labels: applied now.
    identity_event_with(
        &f,
        "node.enrolled",
        &hostile,
        Utc::now(),
        Some(labels(&[("tier", "gold")])),
    )
    .await;
    let updated = events(&f)
        .await
        .into_iter()
        .rfind(|(k, b)| k == "node.updated" && b.node == hostile)
        .expect("web-2 updated");
    assert_eq!(updated.1.labels, effective(&hostile, &[("tier", "gold")]));

    // Nobody sets a reserved key.
    let err = f
        .inventory
        .set_operator_labels(
            &web,
            labels(&[("mesh.io/node", "db-1")]),
            Some(&mesh_plumbing::etag::Precondition::Any),
            &audit("PUT", "/v1/nodes/web-3/labels"),
        )
        .await
        .unwrap_err();
    assert!(err.to_string().contains("mesh.io/node"), "{err}");
    f.env.teardown().await.unwrap();
}

/// Issue 29: on upgrade every node's effective labels of before (stated,
/// overridden by the operator's) become its operator labels, so nothing it
/// was selected for moves; reserved keys are not carried over.
#[tokio::test]
async fn the_trusted_labels_migration_keeps_what_selected_each_node() {
    let env = TestEnv::new().await.unwrap();
    let url = env.database_url("inventory");
    mesh_plumbing::migrate(
        &url,
        "inventory",
        mesh_inventory::migrations().set_target(refinery::Target::Version(13)),
    )
    .await
    .unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO inventory.nodes (id, hostname, arch, cpus, memory_bytes, agent_version, \
         reported_labels, operator_labels, last_seen, hello_at, heard_at) VALUES \
         ('a', 'a', 'x86_64', 1, 1, '0', '{\"role\": \"db\", \"zone\": \"eu\", \"mesh.io/x\": \"y\"}', \
          '{\"zone\": \"us\"}', now(), now(), now()), \
         ('b', 'b', 'x86_64', 1, 1, '0', '{}', '{\"role\": \"web\"}', now(), now(), now())",
    )
    .execute(&pool)
    .await
    .unwrap();
    let before: Vec<(String, i64)> =
        sqlx::query_as("SELECT id, labels_revision FROM inventory.nodes ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    let applied = mesh_inventory::migrate(&url).await.unwrap();
    assert_eq!(
        applied,
        [
            "V14__trusted_labels",
            "V15__node_label",
            "V16__revoked_nodes",
            "V17__unit_sandbox",
            "V18__scrape_targets"
        ]
    );
    let after: Vec<(String, sqlx::types::Json<Labels>, i64)> = sqlx::query_as(
        "SELECT id, operator_labels, labels_revision FROM inventory.nodes ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(after[0].1.0, labels(&[("role", "db"), ("zone", "us")]));
    assert_eq!(after[0].2, before[0].1 + 1, "a's labels revision");
    assert_eq!(after[1].1.0, labels(&[("role", "web")]));
    assert_eq!(after[1].2, before[1].1, "b stated nothing: untouched");

    // V15: every node's effective labels now hold `mesh.io/node`; the next
    // sweep tells the record so about every node, its version raised (the
    // other contexts keep only a newer version), and the one after nothing.
    let versions: Vec<i64> = sqlx::query_scalar("SELECT version FROM inventory.nodes ORDER BY id")
        .fetch_all(&pool)
        .await
        .unwrap();
    let inventory = Inventory::new(
        pool.clone(),
        OutboxSignal::default(),
        InventorySettings::default(),
    );
    let report = inventory.sweep(Utc::now()).await.unwrap();
    assert_eq!(report.announced, 2, "{report:?}");
    let told: Vec<NodeLabelsChanged> = sqlx::query_scalar::<_, Vec<u8>>(
        "SELECT payload FROM inventory.outbox WHERE kind = 'node.updated' ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .unwrap()
    .into_iter()
    .map(|p| match RecordEvent::decode(&p).unwrap().kind {
        RecordKind::NodeUpdated(b) => b,
        other => panic!("{other:?}"),
    })
    .collect();
    assert_eq!(told.len(), 2, "{told:?}");
    let (a, b) = (NodeId::parse("a").unwrap(), NodeId::parse("b").unwrap());
    assert_eq!(told[0].node, a);
    assert_eq!(
        told[0].labels,
        effective(&a, &[("role", "db"), ("zone", "us")])
    );
    assert_eq!(told[0].version, versions[0] + 1);
    assert_eq!(told[1].labels, effective(&b, &[("role", "web")]));
    assert_eq!(told[1].version, versions[1] + 1);
    assert_eq!(inventory.sweep(Utc::now()).await.unwrap().announced, 0);
    pool.close().await;
    env.teardown().await.unwrap();
}
