//! The fleet lifecycle against a real PostgreSQL: liveness judged only after a
//! full grace of observation, modules with ETags, placement, failure handling,
//! partitions, drains (make-before-break, blocked by stateful modules), units.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use chrono::Utc;
use mesh_inventory::{Inventory, InventorySettings};
use mesh_plumbing::{Context, InStep, OutboxSignal};
use mesh_protocol::{
    Declaration, Envelope, Heartbeat, Hello, Labels, NodeId, Report, Section, UnitState,
    UnitStatus, Units,
};
use mesh_testkit::TestEnv;
use serde_json::{Value, json};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tower::ServiceExt;

/// What the controller's auth layer puts in every authenticated request.
fn audit(method: &str, uri: &str) -> mesh_plumbing::audit::Audit {
    audit_as(mesh_plumbing::api::Role::Admin, method, uri)
}

fn audit_as(
    role: mesh_plumbing::api::Role,
    method: &str,
    uri: &str,
) -> mesh_plumbing::audit::Audit {
    let principal = mesh_plumbing::api::Principal {
        id: uuid::Uuid::now_v7(),
        name: "tester".into(),
        role,
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
    let env = TestEnv::new().await.unwrap();
    let url = env.database_url("inventory");
    mesh_inventory::migrate(&url).await.unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .unwrap();
    let settings = InventorySettings {
        grace: Duration::from_secs(5),
        controller_node: NodeId::parse(&format!("{}-a", env.id())).ok(),
        label_trust: mesh_inventory::LabelTrust::new(["role".to_owned(), "zone".to_owned()]),
        controller_metrics: Some(mesh_inventory::ControllerTarget {
            address: "127.0.0.1:7700".into(),
            scheme: "http".into(),
        }),
        ..InventorySettings::default()
    };
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

impl Fixture {
    fn node(&self, suffix: &str) -> String {
        format!("{}-{suffix}", self.env.id())
    }

    async fn handle(&self, reports: &[Envelope<Report>]) {
        let mut tx = self.pool.begin().await.unwrap();
        self.inventory
            .handle_reports(&mut tx, reports)
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }

    async fn hello(&self, suffix: &str, labels: &[(&str, &str)]) -> String {
        let id = self.node(suffix);
        let l: Labels = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let env = Envelope::new(
            NodeId::parse(&id).unwrap(),
            1,
            Report::Hello(Hello {
                hostname: id.clone(),
                arch: "x86_64".into(),
                cpus: 2,
                memory_bytes: 4 << 30,
                labels: l,
                agent_version: "test".into(),
                public_key: None,
                seal_key: None,
                overlay: None,
                applied: Default::default(),
                protocol: None,
                outage: None,
                metrics: None,
            }),
        );
        self.handle(&[env]).await;
        id
    }

    /// A heartbeat as an agent of today sends it: with its interval.
    fn beat(&self, id: &str, seq: u64, interval_ms: Option<u64>) -> Envelope<Report> {
        Envelope::new(
            NodeId::parse(id).unwrap(),
            seq,
            Report::Heartbeat(Heartbeat {
                interval_ms,
                applied: Default::default(),
            }),
        )
    }

    /// A batch of heartbeats as the controller's router takes them: in memory
    /// where it can, the durable path for the rest. Returns how many took it.
    async fn route(&self, beats: &[Envelope<Report>], in_step: &InStep) -> usize {
        let durable = self.inventory.heard(beats, in_step);
        if !durable.is_empty() {
            self.handle(&durable).await;
            self.inventory.written_alive(&durable);
        }
        durable.len()
    }

    async fn last_seq(&self, id: &str) -> (i64, Option<i64>) {
        sqlx::query_as("SELECT last_seq, beat_ms FROM inventory.nodes WHERE id = $1")
            .bind(id)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    async fn heartbeat(&self, id: &str) {
        let env = Envelope::new(
            NodeId::parse(id).unwrap(),
            2,
            Report::Heartbeat(Heartbeat {
                interval_ms: None,
                applied: Default::default(),
            }),
        );
        self.handle(&[env]).await;
    }

    /// Make the controller believe it last heard `id` an hour ago.
    async fn silence(&self, id: &str) {
        self.heard_ago(id, 3600).await;
    }

    /// Make the controller believe it last heard `id` `secs` seconds ago.
    async fn heard_ago(&self, id: &str, secs: i64) {
        sqlx::query(
            "UPDATE inventory.nodes SET heard_at = now() - make_interval(secs => $2) WHERE id = $1",
        )
        .bind(id)
        .bind(secs as f64)
        .execute(&self.pool)
        .await
        .unwrap();
    }

    /// Pretend the controller has observed reports for an hour.
    fn observed(&self) {
        self.inventory
            .observe_from(Utc::now() - chrono::Duration::hours(1));
    }

    async fn sweep(&self) -> mesh_inventory::SweepReport {
        self.inventory.sweep(Utc::now()).await.unwrap()
    }

    async fn request(
        &self,
        method: &str,
        uri: &str,
        headers: &[(&str, &str)],
        body: Option<Value>,
    ) -> (StatusCode, Option<String>, Value) {
        self.request_with(audit(method, uri), method, uri, headers, body)
            .await
    }

    /// A request carrying `audit` (its principal and role), as the auth
    /// layer hands it on.
    async fn request_with(
        &self,
        audit: mesh_plumbing::audit::Audit,
        method: &str,
        uri: &str,
        headers: &[(&str, &str)],
        body: Option<Value>,
    ) -> (StatusCode, Option<String>, Value) {
        let mut builder = Request::builder()
            .method(method)
            .uri(uri)
            .header("content-type", "application/json")
            .extension(audit);
        for (k, v) in headers {
            builder = builder.header(*k, *v);
        }
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let response = self
            .inventory
            .clone()
            .routes()
            .split_for_parts()
            .0
            .oneshot(builder.body(Body::from(body)).unwrap())
            .await
            .unwrap();
        let status = response.status();
        let etag = response
            .headers()
            .get("etag")
            .map(|v| v.to_str().unwrap().to_owned());
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        (
            status,
            etag,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        )
    }

    /// (node, unit name, role) of a module's assignments.
    async fn placed(&self, module: &str) -> Vec<(String, String, String)> {
        sqlx::query_as(
            "SELECT node, name, role FROM inventory.assignments WHERE module = $1 ORDER BY replica, node",
        )
        .bind(module)
        .fetch_all(&self.pool)
        .await
        .unwrap()
    }

    /// The newest inventory section declared to `node`: unit names.
    async fn declared_units(&self, node: &str) -> Option<(u64, Vec<String>)> {
        let payload: Option<Vec<u8>> = sqlx::query_scalar(
            "SELECT payload FROM inventory.outbox WHERE exchange = 'declarations' AND node = $1 \
             ORDER BY id DESC LIMIT 1",
        )
        .bind(node)
        .fetch_optional(&self.pool)
        .await
        .unwrap();
        let env: Envelope<Declaration> =
            Envelope::decode(&payload?, mesh_protocol::MAX_DECLARATION_BYTES).unwrap();
        assert_eq!(env.body.section, Section::Inventory);
        Some((
            env.body.generation,
            env.body
                .items
                .units
                .iter()
                .map(|u| u.name.clone())
                .collect(),
        ))
    }

    async fn events(&self, event: &str) -> Vec<String> {
        sqlx::query_scalar(
            "SELECT convert_from(payload, 'UTF8')::jsonb -> 'body' ->> 'node' FROM inventory.outbox \
             WHERE exchange = 'record' AND routing_key = $1 ORDER BY id",
        )
        .bind(format!("inventory.{event}"))
        .fetch_all(&self.pool)
        .await
        .unwrap()
    }

    async fn units(&self, id: &str, seq: u64, units: &[(&str, &str, UnitState, u32)]) {
        let env = Envelope::new(
            NodeId::parse(id).unwrap(),
            seq,
            Report::Units(Units {
                units: units
                    .iter()
                    .map(|(name, module, state, restarts)| UnitStatus {
                        reason: None,
                        oom_kills: 0,
                        uid: None,
                        data_bytes: None,
                        revision: None,
                        name: name.to_string(),
                        module: module.to_string(),
                        state: *state,
                        pid: Some(4242),
                        exit_code: None,
                        restarts: *restarts,
                        started_at: Some(Utc::now()),
                    })
                    .collect(),
            }),
        );
        self.handle(&[env]).await;
    }
}

fn web(replicas: u32) -> Value {
    json!({
        "unit": {"command": "/bin/sleep", "args": ["1000"], "resources": {"cpu_millis": 100}},
        "placement": {"match_labels": {"labels": {"role": "web"}, "replicas": replicas}}
    })
}

#[tokio::test]
async fn liveness_is_judged_only_after_a_full_grace_of_observation() {
    let f = setup().await;
    let a = f.hello("a", &[]).await;
    let b = f.hello("b", &[]).await;
    // The controller was down for an hour: everyone's last report is stale.
    f.silence(&a).await;
    f.silence(&b).await;
    // Not observing at all, then observing for less than the grace: no judgement.
    let report = f.sweep().await;
    assert!(report.not_judged.is_some() && report.unreachable.is_empty());
    f.inventory.observe_from(Utc::now());
    let report = f.sweep().await;
    assert!(report.not_judged.is_some(), "{report:?}");
    assert!(report.unreachable.is_empty());
    // During the grace, b's buffered reports arrive; a stays silent. (The
    // observation started 6 s ago, past the 5 s grace.)
    f.heartbeat(&b).await;
    f.inventory
        .observe_from(Utc::now() - chrono::Duration::seconds(6));
    let later = Utc::now();
    let report = f.inventory.sweep(later).await.unwrap();
    assert_eq!(report.not_judged, None);
    assert_eq!(report.unreachable, vec![a.clone()]);
    assert_eq!(f.events("node.unreachable").await, vec![a.clone()]);
    let (_, _, view) = f.request("GET", "/v1/nodes", &[], None).await;
    let states: Vec<(String, String)> = view["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| {
            (
                n["id"].as_str().unwrap().to_owned(),
                n["state"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        states,
        vec![
            (a.clone(), "unreachable".into()),
            (b.clone(), "alive".into())
        ]
    );
    // Judged once; heard again, alive again (one event each).
    assert!(
        f.inventory
            .sweep(later)
            .await
            .unwrap()
            .unreachable
            .is_empty()
    );
    f.heartbeat(&a).await;
    f.heartbeat(&a).await;
    assert_eq!(f.events("node.alive").await, vec![a.clone()]);
    // The broker session ends: judging stops until a new grace has passed.
    f.inventory.observe_stop();
    f.silence(&a).await;
    assert!(f.inventory.sweep(later).await.unwrap().not_judged.is_some());
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn module_etags_validation_and_intent_layers() {
    let f = setup().await;
    f.observed();
    for s in ["a", "b", "c", "d"] {
        f.hello(s, &[("role", "web")]).await;
    }
    let (status, etag, view) = f.request("PUT", "/v1/modules/web", &[], Some(web(2))).await;
    assert_eq!(status, StatusCode::CREATED, "{view}");
    assert_eq!(etag.as_deref(), Some("\"1\""));
    assert_eq!(view["effective_replicas"], 2);
    assert_eq!(view["assignments"].as_array().unwrap().len(), 2);
    // Replacing without saying which revision: 428. Stale: 412. Current: 200.
    let (status, _, body) = f.request("PUT", "/v1/modules/web", &[], Some(web(3))).await;
    assert_eq!(status, StatusCode::PRECONDITION_REQUIRED, "{body}");
    let (status, etag, _) = f
        .request(
            "PUT",
            "/v1/modules/web",
            &[("if-match", "\"1\"")],
            Some(web(3)),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(etag.as_deref(), Some("\"2\""));
    let (status, _, body) = f
        .request(
            "PUT",
            "/v1/modules/web",
            &[("if-match", "\"1\"")],
            Some(web(1)),
        )
        .await;
    assert_eq!(status, StatusCode::PRECONDITION_FAILED, "{body}");
    assert_eq!(f.placed("web").await.len(), 3);
    // Concurrent writers with the same revision: exactly one wins.
    let w1 = f.request(
        "PUT",
        "/v1/modules/web",
        &[("if-match", "\"2\"")],
        Some(web(2)),
    );
    let w2 = f.request(
        "PUT",
        "/v1/modules/web",
        &[("if-match", "\"2\"")],
        Some(web(4)),
    );
    let (r1, r2) = tokio::join!(w1, w2);
    let mut statuses = vec![r1.0, r2.0];
    statuses.sort();
    assert_eq!(
        statuses,
        vec![StatusCode::OK, StatusCode::PRECONDITION_FAILED]
    );

    // A stateful module must be pinned: 422 naming the field.
    let stateful = json!({
        "unit": {"command": "/bin/sleep"}, "stateful": true,
        "placement": {"match_labels": {"labels": {}, "replicas": 1}}
    });
    let (status, _, body) = f
        .request("PUT", "/v1/modules/db", &[], Some(stateful))
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(body["field"], "placement");
    let (status, _, body) = f
        .request("PUT", "/v1/modules/web-2", &[], Some(web(1)))
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(body["field"], "name");

    // Intent layers: the autoscaler asks more, policy caps it.
    f.request("PUT", "/v1/modules/web", &[("if-match", "*")], Some(web(1)))
        .await;
    let (status, _, _) = f
        .request(
            "PUT",
            "/v1/modules/web/intent/autoscaler",
            &[],
            Some(json!({"replicas": 4})),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    let (_, _, view) = f.request("GET", "/v1/modules/web", &[], None).await;
    assert_eq!(view["effective_replicas"], 4);
    f.request(
        "PUT",
        "/v1/modules/web/intent/policy",
        &[],
        Some(json!({"max": 3})),
    )
    .await;
    let (_, _, view) = f.request("GET", "/v1/modules/web", &[], None).await;
    assert_eq!(view["effective_replicas"], 3);
    assert_eq!(
        view["intent"],
        json!({"user": 1, "policy": {"max": 3}, "autoscaler": 4})
    );
    assert_eq!(f.placed("web").await.len(), 3);
    let (status, _, body) = f
        .request(
            "PUT",
            "/v1/modules/web/intent/policy",
            &[],
            Some(json!({"min": 4, "max": 3})),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    let (status, _, _) = f
        .request(
            "PUT",
            "/v1/modules/web/intent/user",
            &[],
            Some(json!({"replicas": 2})),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    // Deleting the module stops its units: every node gets a section without them.
    let (status, _, _) = f.request("DELETE", "/v1/modules/web", &[], None).await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    assert!(f.placed("web").await.is_empty());
    for s in ["a", "b", "c"] {
        let (_, units) = f.declared_units(&f.node(s)).await.unwrap();
        assert!(units.is_empty(), "{s}: {units:?}");
    }
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn failed_node_replicas_move_and_a_partition_pauses() {
    let f = setup().await;
    f.observed();
    let ids: Vec<String> = futures_ids(&f, &["a", "b", "c", "d"]).await;
    let (a, c, d) = (&ids[0], &ids[2], &ids[3]);
    f.request("PUT", "/v1/modules/web", &[], Some(web(2))).await;
    let placed = f.placed("web").await;
    assert_eq!(
        placed,
        vec![
            (a.clone(), "web-0".into(), "active".into()),
            (ids[1].clone(), "web-1".into(), "active".into())
        ]
    );
    assert_eq!(
        f.declared_units(a).await.unwrap(),
        (1, vec!["web-0".into()])
    );

    // a goes silent: unreachable, and its replica goes to c (the first free node).
    f.silence(a).await;
    let report = f.sweep().await;
    assert_eq!(report.unreachable, vec![a.clone()]);
    assert_eq!(
        f.placed("web").await,
        vec![
            (c.clone(), "web-0".into(), "active".into()),
            (ids[1].clone(), "web-1".into(), "active".into())
        ]
    );
    // a's section no longer has it: when a returns, the surplus stops.
    assert_eq!(f.declared_units(a).await.unwrap(), (2, vec![]));
    assert_eq!(
        f.declared_units(c).await.unwrap(),
        (1, vec!["web-0".into()])
    );
    f.heartbeat(a).await;
    f.sweep().await;
    assert_eq!(f.placed("web").await[0].0, *c, "nothing moves back");

    // Nothing was wrong so far: no conditions were told.
    let mut seen = 0;
    assert!(f.new_conditions(&mut seen).await.is_empty());

    // Two of four unreachable (50% > 30%): re-placement pauses, and the
    // record is told the condition.
    f.silence(c).await;
    f.silence(d).await;
    let report = f.sweep().await;
    assert_eq!(report.unreachable.len(), 2);
    let paused = report.reconcile.paused.clone().unwrap();
    assert_eq!(f.placed("web").await[0].0, *c, "paused: not moved");
    let told = f.new_conditions(&mut seen).await;
    assert_eq!(told.len(), 1, "{told:?}");
    let v1 = told[0]["version"].as_i64().unwrap();
    assert_eq!(report.reconcile.conditions, Some(v1));
    assert_eq!(
        told[0]["conditions"],
        json!([{"key": "replacement_paused", "kind": "replacement_paused",
                "stateful": false, "message": paused}])
    );
    // Still paused: the set is unchanged, nothing more is told.
    let report = f.sweep().await;
    assert!(report.reconcile.paused.is_some());
    assert_eq!(report.reconcile.conditions, None);
    assert!(f.new_conditions(&mut seen).await.is_empty());
    // One comes back: 25%, re-placement resumes and the condition is over:
    // the record is told a set without it.
    f.heartbeat(d).await;
    f.sweep().await;
    assert_eq!(f.placed("web").await[0].0, *a);
    let told = f.new_conditions(&mut seen).await;
    assert_eq!(told.len(), 1, "{told:?}");
    assert_eq!(told[0]["conditions"], json!([]));
    assert!(told[0]["version"].as_i64().unwrap() > v1);
    assert!(f.told_conditions().await.is_empty());
    f.env.teardown().await.unwrap();
}

async fn futures_ids(f: &Fixture, suffixes: &[&str]) -> Vec<String> {
    let mut ids = Vec::new();
    for s in suffixes {
        ids.push(f.hello(s, &[("role", "web")]).await);
    }
    ids
}

#[tokio::test]
async fn stateful_never_moves_and_blocks_a_drain() {
    let f = setup().await;
    f.observed();
    let ids = futures_ids(&f, &["a", "b", "c"]).await;
    let a = &ids[0];
    let db = json!({
        "unit": {"command": "/bin/sleep", "args": ["1000"]}, "stateful": true,
        "placement": {"exact_node": {"node": a}}
    });
    let (status, _, view) = f
        .request("PUT", "/v1/modules/db", &[], Some(db.clone()))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{view}");
    assert_eq!(
        f.placed("db").await,
        vec![(a.clone(), "db".into(), "active".into())]
    );

    // Unreachable: not moved, and the record is told so (stateful), with
    // re-placement paused (one of three nodes is more than 30%).
    let mut seen = 0;
    f.silence(a).await;
    f.sweep().await;
    assert_eq!(f.placed("db").await[0].0, *a);
    let told = f.new_conditions(&mut seen).await;
    assert_eq!(told.len(), 1, "{told:?}");
    let keys: Vec<&str> = told[0]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["key"].as_str().unwrap())
        .collect();
    assert_eq!(keys, vec!["pinned_unreachable:db", "replacement_paused"]);
    let condition = &told[0]["conditions"][0];
    assert_eq!(condition["key"], "pinned_unreachable:db");
    assert_eq!(condition["kind"], "pinned_unreachable");
    assert_eq!(condition["node"], json!(a));
    assert_eq!(condition["module"], "db");
    assert_eq!(condition["stateful"], true);
    assert!(
        condition["message"]
            .as_str()
            .unwrap()
            .starts_with("stateful module `db` is pinned to unreachable node"),
        "{condition}"
    );
    // What was told is kept: a row each, with the event's version.
    let version = told[0]["version"].as_i64().unwrap();
    assert_eq!(
        f.told_conditions().await,
        vec![
            ("pinned_unreachable:db".to_owned(), version),
            ("replacement_paused".to_owned(), version)
        ]
    );
    f.sweep().await;
    assert!(f.new_conditions(&mut seen).await.is_empty());
    f.heartbeat(a).await;
    f.sweep().await;
    let told = f.new_conditions(&mut seen).await;
    assert_eq!(told.len(), 1, "{told:?}");
    assert_eq!(told[0]["conditions"], json!([]));

    // Drain: blocked with a reason naming the module, visible in the node view.
    let (status, _, body) = f
        .request("POST", &format!("/v1/nodes/{a}/drain"), &[], None)
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["admin_state"], "draining");
    let reason = body["drain_blocked"].as_str().unwrap_or_default();
    assert!(reason.contains("`db` is stateful"), "{body}");
    f.sweep().await;
    let view = f
        .inventory
        .node(&NodeId::parse(a).unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(view.state, "draining");
    assert!(view.drain_blocked.unwrap().contains("db"));
    assert_eq!(f.placed("db").await[0].0, *a, "still not moved");

    // The operator stops it: the drain finishes.
    let mut stopped = db.clone();
    stopped["desired"] = json!("stopped");
    f.request("PUT", "/v1/modules/db", &[("if-match", "*")], Some(stopped))
        .await;
    f.sweep().await;
    let view = f
        .inventory
        .node(&NodeId::parse(a).unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(view.state, "drained");
    assert_eq!(view.drain_blocked, None);
    let (_, body) = (
        0,
        f.request("POST", &format!("/v1/nodes/{a}/undrain"), &[], None)
            .await
            .2,
    );
    assert_eq!(body["admin_state"], "active");
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn drain_is_make_before_break_and_units_are_recorded() {
    let f = setup().await;
    f.observed();
    let ids = futures_ids(&f, &["a", "b", "c"]).await;
    let (a, b, c) = (&ids[0], &ids[1], &ids[2]);
    f.request("PUT", "/v1/modules/web", &[], Some(web(2))).await;
    f.units(a, 10, &[("web-0", "web", UnitState::Running, 0)])
        .await;
    f.units(b, 10, &[("web-1", "web", UnitState::Running, 2)])
        .await;
    let (_, _, view) = f.request("GET", "/v1/modules/web", &[], None).await;
    let first = &view["assignments"][1];
    assert_eq!(first["unit_state"], "running", "{view}");
    assert_eq!(first["restarts"], 2);
    assert_eq!(first["pid"], 4242);
    // An older units report changes nothing.
    f.units(b, 9, &[("web-1", "web", UnitState::Failed, 0)])
        .await;
    let (_, _, view) = f.request("GET", "/v1/modules/web", &[], None).await;
    assert_eq!(view["assignments"][1]["unit_state"], "running");

    // Drain a: the replacement on c is declared first; a keeps running its copy.
    let (_, _, body) = f
        .request("POST", &format!("/v1/nodes/{a}/drain"), &[], None)
        .await;
    assert_eq!(body["admin_state"], "draining", "{body}");
    assert!(
        body["drain_blocked"]
            .as_str()
            .unwrap()
            .contains("replacement")
    );
    assert_eq!(
        f.placed("web").await,
        vec![
            (a.clone(), "web-0".into(), "retiring".into()),
            (c.clone(), "web-0".into(), "active".into()),
            (b.clone(), "web-1".into(), "active".into()),
        ]
    );
    assert_eq!(
        f.declared_units(a).await.unwrap().1,
        vec!["web-0".to_owned()]
    );
    assert_eq!(
        f.declared_units(c).await.unwrap().1,
        vec!["web-0".to_owned()]
    );
    f.sweep().await;
    assert_eq!(f.placed("web").await.len(), 3, "the old one waits");
    // The replacement runs: the old copy goes, then the node is drained.
    f.units(c, 10, &[("web-0", "web", UnitState::Running, 0)])
        .await;
    f.sweep().await;
    assert_eq!(f.placed("web").await.len(), 2);
    assert_eq!(f.declared_units(a).await.unwrap().1, Vec::<String>::new());
    let view = f
        .inventory
        .node(&NodeId::parse(a).unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(view.state, "drained");
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn nothing_is_placed_before_the_grace_nor_on_the_unknown() {
    let f = setup().await;
    f.hello("b", &[("role", "web")]).await;
    // Just started: the module is stored but placement waits (fails closed).
    f.inventory.observe_from(Utc::now());
    let (status, _, view) = f.request("PUT", "/v1/modules/web", &[], Some(web(1))).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(view["assignments"].as_array().unwrap().is_empty(), "{view}");
    f.observed();
    f.sweep().await;
    assert_eq!(f.placed("web").await.len(), 1);
    // Too few nodes: nothing partial, and the reason is in the module view.
    f.request("PUT", "/v1/modules/web", &[("if-match", "*")], Some(web(2)))
        .await;
    let (_, _, view) = f.request("GET", "/v1/modules/web", &[], None).await;
    assert_eq!(view["assignments"].as_array().unwrap().len(), 1);
    assert!(
        view["placement_error"]
            .as_str()
            .unwrap()
            .contains("needs 2"),
        "{view}"
    );
    // controller_node runs on the configured node (`<id>-a`), once it exists.
    let ctl = json!({"unit": {"command": "/bin/true"}, "placement": {"controller_node": {}}});
    f.request("PUT", "/v1/modules/ctl", &[], Some(ctl)).await;
    assert!(f.placed("ctl").await.is_empty());
    let a = f.hello("a", &[]).await;
    f.sweep().await;
    assert_eq!(
        f.placed("ctl").await,
        vec![(a, "ctl".into(), "active".into())]
    );
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn resync_repairs_a_units_section_changed_or_lost_behind_its_back() {
    let f = setup().await;
    f.observed();
    let ids = futures_ids(&f, &["a", "b", "c"]).await;
    let (a, b, c) = (&ids[0], &ids[1], &ids[2]);
    f.request("PUT", "/v1/modules/web", &[], Some(web(2))).await;
    let (ga, units_a) = f.declared_units(a).await.unwrap();
    let (gb, units_b) = f.declared_units(b).await.unwrap();
    assert_eq!((ga, gb), (1, 1));
    assert!(f.declared_units(c).await.is_none(), "c runs nothing");
    let resync = || mesh_plumbing::section::resync(&*f.inventory);
    assert_eq!(resync().await.unwrap().declared, 0, "nothing differs");

    // a's row was edited, b's lost, and c's says it runs something.
    sqlx::query("UPDATE inventory.sections SET digest = 'tampered' WHERE node = $1")
        .bind(a)
        .execute(&f.pool)
        .await
        .unwrap();
    sqlx::query("DELETE FROM inventory.sections WHERE node = $1")
        .bind(b)
        .execute(&f.pool)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO inventory.sections (node, generation, digest, items) \
         VALUES ($1, 3, 'stale', '{\"files\": [], \"units\": []}')",
    )
    .bind(c)
    .execute(&f.pool)
    .await
    .unwrap();
    let report = resync().await.unwrap();
    assert_eq!((report.nodes, report.declared), (3, 3), "{report:?}");
    assert_eq!(f.declared_units(a).await.unwrap(), (2, units_a));
    assert_eq!(f.declared_units(b).await.unwrap(), (1, units_b));
    assert_eq!(f.declared_units(c).await.unwrap(), (4, Vec::new()));
    assert_eq!(resync().await.unwrap().declared, 0, "repaired");
    // The assignments were not touched: resync declares, it does not place.
    assert_eq!(f.placed("web").await.len(), 2);
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn heartbeats_in_step_stay_in_memory_until_the_liveness_write() {
    let f = setup().await;
    let a = f.hello("a", &[]).await;
    let in_step = InStep::new();
    // First heard since start: the durable path writes it at once.
    assert_eq!(f.route(&[f.beat(&a, 10, Some(10_000))], &in_step).await, 1);
    assert_eq!(f.last_seq(&a).await, (10, Some(10_000)));
    // Known alive and in step: memory only, until the write.
    assert_eq!(f.route(&[f.beat(&a, 11, Some(15_000))], &in_step).await, 0);
    assert_eq!(f.last_seq(&a).await, (10, Some(10_000)));
    assert_eq!(f.inventory.write_liveness().await.unwrap(), 1);
    assert_eq!(f.last_seq(&a).await, (11, Some(15_000)));
    assert_eq!(
        f.inventory.write_liveness().await.unwrap(),
        0,
        "nothing new"
    );
    // Out of step (config declared generation 2, the node applied none): durable.
    in_step.declared(&a, Section::Config, 2, 1);
    assert_eq!(f.route(&[f.beat(&a, 12, None)], &in_step).await, 1);
    assert_eq!(
        f.last_seq(&a).await,
        (12, Some(15_000)),
        "no interval said: kept"
    );
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn a_node_judged_unreachable_is_revived_at_once_and_written_beats_revive_too() {
    let f = setup().await;
    let a = f.hello("a", &[]).await;
    let b = f.hello("b", &[]).await;
    let in_step = InStep::new();
    f.route(&[f.beat(&a, 2, None), f.beat(&b, 2, None)], &in_step)
        .await;
    f.observed();
    f.silence(&a).await;
    f.silence(&b).await;
    // b's beat is in memory when the sweep comes: the sweep writes it first.
    assert_eq!(f.route(&[f.beat(&b, 3, None)], &in_step).await, 0);
    assert_eq!(f.sweep().await.unreachable, vec![a.clone()]);
    // a's next heartbeat is a state change: the durable path, an event at once.
    assert_eq!(f.route(&[f.beat(&a, 3, None)], &in_step).await, 1);
    assert_eq!(f.events("node.alive").await, vec![a.clone()]);
    // A beat kept in memory for a node judged meanwhile revives it when written.
    assert_eq!(f.route(&[f.beat(&b, 4, None)], &in_step).await, 0);
    sqlx::query("UPDATE inventory.nodes SET state = 'unreachable' WHERE id = $1")
        .bind(&b)
        .execute(&f.pool)
        .await
        .unwrap();
    f.inventory.write_liveness().await.unwrap();
    assert_eq!(f.events("node.alive").await, vec![a.clone(), b.clone()]);
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn a_node_beating_slower_than_the_fleet_is_judged_by_its_own_interval() {
    let f = setup().await;
    // Grace 5 s at a 10 s floor: half an interval. A node that says it beats
    // every 60 s gets half of that, 30 s; one that says nothing, the fleet's.
    let slow = f.hello("slow", &[]).await;
    let quiet = f.hello("quiet", &[]).await;
    let in_step = InStep::new();
    f.route(
        &[f.beat(&slow, 2, Some(60_000)), f.beat(&quiet, 2, None)],
        &in_step,
    )
    .await;
    f.observed();
    f.heard_ago(&slow, 20).await;
    f.heard_ago(&quiet, 20).await;
    assert_eq!(f.sweep().await.unreachable, vec![quiet.clone()]);
    f.heard_ago(&slow, 31).await;
    assert_eq!(f.sweep().await.unreachable, vec![slow.clone()]);
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn past_the_budget_the_interval_and_grace_stretch_and_every_node_is_told() {
    let env = TestEnv::new().await.unwrap();
    let url = env.database_url("inventory");
    mesh_inventory::migrate(&url).await.unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .unwrap();
    // 3 nodes at 0.2 heartbeats/s need 15 s; the floor is 10 s, its grace 30 s.
    let inventory = Inventory::new(
        pool.clone(),
        OutboxSignal::default(),
        InventorySettings {
            heartbeat_budget: 0.2,
            label_trust: mesh_inventory::LabelTrust::new(["role".to_owned(), "zone".to_owned()]),
            ..InventorySettings::default()
        },
    );
    let f = Fixture {
        env,
        pool,
        inventory: Arc::new(inventory),
    };
    let a = f.hello("a", &[]).await;
    let b = f.hello("b", &[]).await;
    let view = |f: &Fixture| f.inventory.heartbeat();
    f.sweep().await;
    assert_eq!(view(&f).interval_ms, 10_000, "two nodes fit the budget");
    let declared: i64 = sqlx::query_scalar("SELECT count(*) FROM inventory.sections")
        .fetch_one(&f.pool)
        .await
        .unwrap();
    assert_eq!(declared, 0, "at the floor nothing is declared");
    let c = f.hello("c", &[]).await;
    f.sweep().await;
    let v = view(&f);
    assert_eq!((v.interval_ms, v.grace_ms, v.nodes), (15_000, 45_000, 3));
    assert_eq!(v.detection_ms, 47_000, "grace plus one sweep");
    let plans: Vec<(String, Value)> =
        sqlx::query_as("SELECT node, items->'heartbeat' FROM inventory.sections ORDER BY node")
            .fetch_all(&f.pool)
            .await
            .unwrap();
    let want = json!({"interval_ms": 15_000, "grace_ms": 45_000});
    assert_eq!(
        plans,
        vec![(a, want.clone()), (b, want.clone()), (c.clone(), want)]
    );
    // The API says the same.
    let (_, _, body) = f.request("GET", "/v1/nodes", &[], None).await;
    assert_eq!(body["heartbeat"]["interval_ms"], 15_000);
    assert_eq!(body["heartbeat"]["detection_ms"], 47_000);
    // One node revoked: two fit with room to spare, back to the floor, and
    // the plan leaves every section.
    sqlx::query("UPDATE inventory.nodes SET admin_state = 'revoked' WHERE id = $1")
        .bind(&c)
        .execute(&f.pool)
        .await
        .unwrap();
    f.sweep().await;
    assert_eq!(view(&f).interval_ms, 10_000);
    let left: i64 =
        sqlx::query_scalar("SELECT count(*) FROM inventory.sections WHERE items ? 'heartbeat'")
            .fetch_one(&f.pool)
            .await
            .unwrap();
    assert_eq!(left, 0);
    f.env.teardown().await.unwrap();
}

impl Fixture {
    /// `inventory.module.*` events in the outbox, oldest first: (event, body).
    async fn module_events(&self) -> Vec<(String, Value)> {
        let rows: Vec<(String, Vec<u8>)> = sqlx::query_as(
            "SELECT routing_key, payload FROM inventory.outbox \
             WHERE exchange = 'record' AND routing_key LIKE 'inventory.module.%' ORDER BY id",
        )
        .fetch_all(&self.pool)
        .await
        .unwrap();
        rows.into_iter()
            .map(|(key, payload)| {
                // Every event decodes as the protocol's typed event.
                mesh_protocol::RecordEvent::decode(&payload).unwrap();
                let v: Value = serde_json::from_slice(&payload).unwrap();
                (key, v["body"].clone())
            })
            .collect()
    }

    /// Bodies of the `inventory.fleet.conditions` events written since `seen`
    /// of them were, oldest first; each decodes as the protocol's typed event.
    async fn new_conditions(&self, seen: &mut usize) -> Vec<Value> {
        let rows: Vec<Vec<u8>> = sqlx::query_scalar(
            "SELECT payload FROM inventory.outbox \
             WHERE exchange = 'record' AND routing_key = 'inventory.fleet.conditions' ORDER BY id",
        )
        .fetch_all(&self.pool)
        .await
        .unwrap();
        let all: Vec<Value> = rows
            .into_iter()
            .map(|payload| {
                let event = mesh_protocol::RecordEvent::decode(&payload).unwrap();
                assert!(
                    matches!(event.kind, mesh_protocol::RecordKind::FleetConditions(_)),
                    "{event:?}"
                );
                let v: Value = serde_json::from_slice(&payload).unwrap();
                v["body"].clone()
            })
            .collect();
        let new = all[*seen..].to_vec();
        *seen = all.len();
        new
    }

    /// What inventory last told the record: (key, version) of each condition.
    async fn told_conditions(&self) -> Vec<(String, i64)> {
        sqlx::query_as("SELECT key, version FROM inventory.conditions ORDER BY key")
            .fetch_all(&self.pool)
            .await
            .unwrap()
    }

    /// The module events written since `seen` of them were.
    async fn new_module_events(&self, seen: &mut usize) -> Vec<(String, Value)> {
        let all = self.module_events().await;
        let new = all[*seen..].to_vec();
        *seen = all.len();
        new
    }
}

fn placed(body: &Value) -> (Vec<String>, i64) {
    let nodes = body["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap().to_owned())
        .collect();
    (nodes, body["version"].as_i64().unwrap())
}

#[tokio::test]
async fn where_modules_run_is_told_to_the_record_on_change_only() {
    let f = setup().await;
    f.observed();
    let ids = futures_ids(&f, &["a", "b", "c"]).await;
    let (a, b, c) = (&ids[0], &ids[1], &ids[2]);
    let mut seen = 0;
    let mut spec = web(2);
    spec["settings_files"] = json!([{"name": "app.env", "format": "env"}]);
    let (status, _, view) = f
        .request("PUT", "/v1/modules/web", &[], Some(spec.clone()))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{view}");
    assert_eq!(view["settings_files"][0]["format"], "env", "{view}");
    let events = f.new_module_events(&mut seen).await;
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].0, "inventory.module.placed");
    assert_eq!(events[0].1["module"], "web");
    assert_eq!(
        events[0].1["settings_files"],
        json!([{"name": "app.env", "format": "env"}])
    );
    let (nodes, v1) = placed(&events[0].1);
    assert_eq!(nodes, vec![a.clone(), b.clone()]);

    // Nothing changed: a reconcile, a sweep write nothing.
    f.inventory.reconcile().await.unwrap();
    f.sweep().await;
    assert!(f.new_module_events(&mut seen).await.is_empty());

    // Drain a (make-before-break): while a's copy retires, a stays in the set.
    f.units(a, 10, &[("web-0", "web", UnitState::Running, 0)])
        .await;
    f.request("POST", &format!("/v1/nodes/{a}/drain"), &[], None)
        .await;
    let events = f.new_module_events(&mut seen).await;
    assert_eq!(events.len(), 1, "{events:?}");
    let (nodes, v2) = placed(&events[0].1);
    assert_eq!(nodes, vec![a.clone(), b.clone(), c.clone()]);
    assert!(v2 > v1, "{v2} > {v1}");
    // The replacement runs: a's assignment goes, and a leaves the set.
    f.units(c, 10, &[("web-0", "web", UnitState::Running, 0)])
        .await;
    f.sweep().await;
    let events = f.new_module_events(&mut seen).await;
    assert_eq!(events.len(), 1, "{events:?}");
    let (nodes, v3) = placed(&events[0].1);
    assert_eq!(nodes, vec![b.clone(), c.clone()]);
    assert!(v3 > v2);

    // Changing the settings files writes one event, with the same nodes.
    spec["settings_files"] = json!([
        {"name": "app.env", "format": "env"},
        {"name": "app.toml", "format": "toml"}
    ]);
    let (status, _, _) = f
        .request(
            "PUT",
            "/v1/modules/web",
            &[("if-match", "*")],
            Some(spec.clone()),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    let events = f.new_module_events(&mut seen).await;
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].1["settings_files"][1]["name"], "app.toml");
    let (nodes, v4) = placed(&events[0].1);
    assert_eq!(nodes, vec![b.clone(), c.clone()]);
    assert!(v4 > v3);
    // Changing the ports writes one event carrying them; the view shows them.
    spec["ports"] = json!([
        {"name": "http", "port": 8080, "from": ["api"], "expose": "www.example.com"}
    ]);
    let (status, _, view) = f
        .request(
            "PUT",
            "/v1/modules/web",
            &[("if-match", "*")],
            Some(spec.clone()),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{view}");
    assert_eq!(view["ports"][0]["port"], 8080, "{view}");
    let events = f.new_module_events(&mut seen).await;
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(
        events[0].1["ports"],
        json!([{"name": "http", "port": 8080, "protocol": "tcp", "from": ["api"],
                "expose": "www.example.com"}])
    );
    let (_, v4) = placed(&events[0].1);
    // Bad ports are refused, naming the field.
    let mut bad = spec.clone();
    bad["ports"] = json!([{"name": "a", "port": 80}, {"name": "b", "port": 80}]);
    let (status, _, body) = f
        .request("PUT", "/v1/modules/web", &[("if-match", "*")], Some(bad))
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(body["field"], "ports[1].port", "{body}");

    // What the module requires and provides (resource grants) is told with
    // its placement: a change of them alone writes one event carrying them.
    spec["requires"] = json!([
        {"kind": "postgres.database", "name": "main", "options": {"encoding": "UTF8"}}
    ]);
    spec["provides"] = json!([
        {"kind": "s3.bucket", "host": "10.0.0.2", "port": 3900,
         "admin": {"server": "garage", "config": "/var/lib/garage/garage.toml"}}
    ]);
    let (status, _, view) = f
        .request(
            "PUT",
            "/v1/modules/web",
            &[("if-match", "*")],
            Some(spec.clone()),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{view}");
    assert_eq!(view["requires"][0]["name"], "main", "{view}");
    let events = f.new_module_events(&mut seen).await;
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].1["requires"], spec["requires"]);
    assert_eq!(events[0].1["provides"], spec["provides"]);
    let (_, v5) = placed(&events[0].1);
    assert!(v5 > v4);
    // Bad requirements and provided kinds are refused, naming the field.
    for (field, value, named) in [
        (
            "requires",
            json!([{"kind": "postgres.database", "name": "main", "options": {"bogus": "1"}}]),
            "requires[0].options.bogus",
        ),
        (
            "requires",
            json!([{"kind": "amqp.vhost", "name": "a"}, {"kind": "s3.bucket", "name": "a"}]),
            "requires[1].name",
        ),
        (
            "provides",
            json!([{"kind": "amqp.vhost", "host": "h", "port": 5672,
                    "admin": {"server": "postgres", "socket_dir": "/run/pg"}}]),
            "provides[0].admin",
        ),
    ] {
        let mut bad = spec.clone();
        bad[field] = value;
        let (status, _, body) = f
            .request("PUT", "/v1/modules/web", &[("if-match", "*")], Some(bad))
            .await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
        assert_eq!(body["field"], named, "{body}");
    }
    assert!(f.new_module_events(&mut seen).await.is_empty());

    // A bad settings file name is refused, naming the field.
    let mut bad = spec.clone();
    bad["settings_files"] = json!([{"name": "../passwd", "format": "env"}]);
    let (status, _, body) = f
        .request("PUT", "/v1/modules/web", &[("if-match", "*")], Some(bad))
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(body["field"], "settings_files[0].name", "{body}");

    // Deleting writes `inventory.module.removed` once, with a higher version.
    let (status, _, _) = f.request("DELETE", "/v1/modules/web", &[], None).await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let events = f.new_module_events(&mut seen).await;
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].0, "inventory.module.removed");
    assert_eq!(events[0].1["module"], "web");
    let v5 = events[0].1["version"].as_i64().unwrap();
    assert!(v5 > v4);
    f.inventory.reconcile().await.unwrap();
    assert!(f.new_module_events(&mut seen).await.is_empty());

    // Re-created: versions keep growing past the removal.
    f.request("PUT", "/v1/modules/web", &[], Some(web(1))).await;
    let events = f.new_module_events(&mut seen).await;
    assert_eq!(events.len(), 1, "{events:?}");
    let (_, v6) = placed(&events[0].1);
    assert!(v6 > v5);
    assert_eq!(events[0].1["settings_files"], json!([]));
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn a_replica_moved_off_an_unreachable_node_is_told_and_unplaced_modules_too() {
    let f = setup().await;
    f.observed();
    let ids = futures_ids(&f, &["a", "b", "c", "d"]).await;
    let (a, b) = (&ids[0], &ids[1]);
    let mut seen = 0;
    // A module nothing matches yet is told with no nodes.
    let nowhere = json!({
        "unit": {"command": "/bin/sleep", "args": ["1000"]},
        "placement": {"match_labels": {"labels": {"role": "gpu"}, "replicas": 1}}
    });
    f.request("PUT", "/v1/modules/train", &[], Some(nowhere))
        .await;
    f.request("PUT", "/v1/modules/web", &[], Some(web(1))).await;
    let events = f.new_module_events(&mut seen).await;
    assert_eq!(events.len(), 2, "{events:?}");
    assert_eq!(events[0].1["module"], "train");
    assert_eq!(events[0].1["nodes"], json!([]));
    let (nodes, v1) = placed(&events[1].1);
    assert_eq!(nodes, vec![a.clone()]);

    // a goes silent: its replica moves to b, and the record hears it once.
    f.silence(a).await;
    f.sweep().await;
    let events = f.new_module_events(&mut seen).await;
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].1["module"], "web");
    let (nodes, v2) = placed(&events[0].1);
    assert_eq!(nodes, vec![b.clone()]);
    assert!(v2 > v1);
    f.sweep().await;
    assert!(f.new_module_events(&mut seen).await.is_empty());
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn fleet_conditions_are_told_to_the_record_on_change_only() {
    let f = setup().await;
    f.observed();
    // Four nodes: one unreachable (25%) does not pause re-placement.
    let ids = futures_ids(&f, &["a", "b", "c", "d"]).await;
    let mut seen = 0;
    f.request("PUT", "/v1/modules/web", &[], Some(web(1))).await;
    f.sweep().await;
    assert!(
        f.new_conditions(&mut seen).await.is_empty(),
        "nothing wrong, nothing told"
    );

    // A module nothing matches: one event with the whole set, this condition.
    let gpu = json!({
        "unit": {"command": "/bin/sleep", "args": ["1000"]},
        "placement": {"match_labels": {"labels": {"role": "gpu"}, "replicas": 1}}
    });
    let (status, _, view) = f.request("PUT", "/v1/modules/train", &[], Some(gpu)).await;
    assert_eq!(status, StatusCode::CREATED, "{view}");
    let told = f.new_conditions(&mut seen).await;
    assert_eq!(told.len(), 1, "{told:?}");
    let v1 = told[0]["version"].as_i64().unwrap();
    let conditions = told[0]["conditions"].as_array().unwrap();
    assert_eq!(conditions.len(), 1, "{told:?}");
    assert_eq!(conditions[0]["key"], "unplaced:train");
    assert_eq!(conditions[0]["kind"], "placement_unsatisfied");
    assert_eq!(conditions[0]["module"], "train");
    assert_eq!(conditions[0]["stateful"], false);
    assert!(conditions[0].get("node").is_none(), "{told:?}");
    let message = conditions[0]["message"].as_str().unwrap();
    assert!(
        message.starts_with("module `train` cannot be placed"),
        "{message}"
    );
    assert_eq!(
        view["placement_error"]
            .as_str()
            .map(|e| message.ends_with(e)),
        Some(true),
        "{view}"
    );

    // Unchanged across passes (reconciles, sweeps, an unrelated write): no event.
    f.inventory.reconcile().await.unwrap();
    f.sweep().await;
    f.request(
        "PUT",
        "/v1/modules/web/intent/autoscaler",
        &[],
        Some(json!({"replicas": 2})),
    )
    .await;
    assert_eq!(f.placed("web").await.len(), 2);
    assert!(f.new_conditions(&mut seen).await.is_empty());
    assert_eq!(
        f.told_conditions().await,
        vec![("unplaced:train".to_owned(), v1)]
    );

    // A second condition joins: the whole set again, in key order.
    let db = json!({
        "unit": {"command": "/bin/sleep", "args": ["1000"]}, "stateful": true,
        "placement": {"exact_node": {"node": ids[1]}}
    });
    f.request("PUT", "/v1/modules/db", &[], Some(db)).await;
    assert!(f.new_conditions(&mut seen).await.is_empty(), "placed: fine");
    f.silence(&ids[1]).await;
    f.sweep().await;
    let told = f.new_conditions(&mut seen).await;
    assert_eq!(told.len(), 1, "{told:?}");
    let v2 = told[0]["version"].as_i64().unwrap();
    assert!(v2 > v1);
    let keys: Vec<&str> = told[0]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["key"].as_str().unwrap())
        .collect();
    assert_eq!(keys, vec!["pinned_unreachable:db", "unplaced:train"]);

    // The labels come: train is placed; its condition is over, the other stays.
    f.hello("e", &[("role", "gpu")]).await;
    f.inventory.reconcile().await.unwrap();
    assert_eq!(f.placed("train").await.len(), 1);
    let told = f.new_conditions(&mut seen).await;
    assert_eq!(told.len(), 1, "{told:?}");
    let v3 = told[0]["version"].as_i64().unwrap();
    assert!(v3 > v2);
    assert_eq!(told[0]["conditions"][0]["key"], "pinned_unreachable:db");
    assert_eq!(told[0]["conditions"].as_array().unwrap().len(), 1);

    // Deleting the module of the last one clears the set: told once, empty.
    f.request("DELETE", "/v1/modules/db", &[], None).await;
    let told = f.new_conditions(&mut seen).await;
    assert_eq!(told.len(), 1, "{told:?}");
    assert_eq!(told[0]["conditions"], json!([]));
    assert!(told[0]["version"].as_i64().unwrap() > v3);
    assert!(f.told_conditions().await.is_empty());
    f.sweep().await;
    f.inventory.reconcile().await.unwrap();
    assert!(f.new_conditions(&mut seen).await.is_empty());
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn probes_are_validated_and_declared_with_the_unit() {
    let f = setup().await;
    f.observed();
    let ids = futures_ids(&f, &["a"]).await;
    let mut spec = web(1);
    spec["unit"]["probes"] = json!([
        {"name": "ready", "http": {"port": 8080, "path": "/healthz"}},
        {"name": "alive", "tcp": {"port": 8080}, "interval_secs": 5, "timeout_secs": 10}
    ]);
    let (status, _, body) = f
        .request("PUT", "/v1/modules/web", &[], Some(spec.clone()))
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert_eq!(body["field"], "unit.probes[1].timeout_secs", "{body}");
    // Neither check, or two of them: the probe itself is named.
    spec["unit"]["probes"][1] =
        json!({"name": "alive", "tcp": {"port": 8080}, "exec": {"command": "true"}});
    let (status, _, body) = f
        .request("PUT", "/v1/modules/web", &[], Some(spec.clone()))
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert_eq!(body["field"], "unit.probes[1]", "{body}");
    spec["unit"]["probes"][1] = json!({"name": "ready", "tcp": {"port": 8080}});
    let (status, _, body) = f
        .request("PUT", "/v1/modules/web", &[], Some(spec.clone()))
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert_eq!(body["field"], "unit.probes[1].name", "{body}");
    assert!(
        f.placed("web").await.is_empty(),
        "nothing refused is placed"
    );

    spec["unit"]["probes"][1] = json!({"name": "alive", "tcp": {"port": 8080}, "interval_secs": 5,
                                        "timeout_secs": 5, "failure_threshold": 2});
    let (status, _, view) = f
        .request("PUT", "/v1/modules/web", &[], Some(spec.clone()))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{view}");
    assert_eq!(
        view["unit"]["probes"][0]["http"]["expect_status"], 200,
        "{view}"
    );
    // The node's inventory section carries them on the unit, defaults filled.
    let payload: Vec<u8> = sqlx::query_scalar(
        "SELECT payload FROM inventory.outbox WHERE exchange = 'declarations' AND node = $1 \
         ORDER BY id DESC LIMIT 1",
    )
    .bind(&ids[0])
    .fetch_one(&f.pool)
    .await
    .unwrap();
    let env: Envelope<Declaration> =
        Envelope::decode(&payload, mesh_protocol::MAX_DECLARATION_BYTES).unwrap();
    let unit = &env.body.items.units[0];
    assert_eq!(unit.name, "web-0");
    assert_eq!(unit.probes.len(), 2);
    assert_eq!(unit.probes[0].name, "ready");
    assert_eq!(unit.probes[0].kind(), "http");
    assert_eq!(unit.probes[0].interval_secs, 10);
    assert_eq!(unit.probes[0].timeout_secs, 2);
    assert_eq!(unit.probes[0].failure_threshold, 3);
    assert_eq!(unit.probes[1].kind(), "tcp");
    assert_eq!(unit.probes[1].interval_secs, 5);
    assert_eq!(unit.probes[1].failure_threshold, 2);
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn a_module_as_root_needs_an_admin_and_its_replicas_show_their_box() {
    use mesh_plumbing::api::Role;
    let f = setup().await;
    f.observed();
    let db = f.hello("db", &[("role", "db")]).await;
    let uri = "/v1/modules/db";
    let module = json!({
        "unit": {"command": "/bin/sleep", "args": ["1000"], "user": "root",
                 "resources": {"memory_bytes": 64 << 20, "pids": 16}},
        "stateful": true,
        "placement": {"exact_node": {"node": db}}
    });
    let audited = |kind: &'static str| {
        let pool = f.pool.clone();
        async move {
            let rows: Vec<Value> = sqlx::query_scalar(
                "SELECT convert_from(payload, 'UTF8')::jsonb -> 'body' FROM inventory.outbox \
                 WHERE exchange = 'record' AND routing_key = $1 ORDER BY id",
            )
            .bind(kind)
            .fetch_all(&pool)
            .await
            .unwrap();
            rows
        }
    };

    // An operator may not make a module run as root: 403 naming why, nothing
    // written, and the refusal's entry (the auth layer writes it) says root.
    let operator = audit_as(Role::Operator, "PUT", uri);
    let (status, _, body) = f
        .request_with(operator.clone(), "PUT", uri, &[], Some(module.clone()))
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
    let detail = body["detail"].as_str().unwrap();
    assert!(
        detail.contains("root") && detail.contains("admin"),
        "{detail}"
    );
    assert!(detail.contains("operator"), "{detail}");
    let (status, _, _) = f.request("GET", uri, &[], None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(f.declared_units(&db).await.is_none());
    assert!(audited("inventory.operator.audit").await.is_empty());
    assert!(!operator.recorded());
    assert!(operator.detail().unwrap().contains("runs as root"));

    // An admin may; the entry committed with the change says it runs as root.
    let (status, _, view) = f
        .request_with(
            audit_as(Role::Admin, "PUT", uri),
            "PUT",
            uri,
            &[],
            Some(module.clone()),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{view}");
    assert_eq!(view["unit"]["user"], "root");
    assert_eq!(view["unit"]["resources"]["pids"], 16);
    let entries = audited("inventory.operator.audit").await;
    assert_eq!(entries.len(), 1, "{entries:?}");
    assert_eq!(entries[0]["outcome"], "ok");
    assert_eq!(entries[0]["role"], "admin");
    assert!(
        entries[0]["detail"]
            .as_str()
            .unwrap()
            .contains("module `db` runs as root"),
        "{entries:?}"
    );
    // The unit declared runs as root, in its limits, stateful.
    let payload: Vec<u8> = sqlx::query_scalar(
        "SELECT payload FROM inventory.outbox WHERE exchange = 'declarations' AND node = $1 \
         ORDER BY id DESC LIMIT 1",
    )
    .bind(&db)
    .fetch_one(&f.pool)
    .await
    .unwrap();
    let env: Envelope<Declaration> =
        Envelope::decode(&payload, mesh_protocol::MAX_DECLARATION_BYTES).unwrap();
    let unit = &env.body.items.units[0];
    assert_eq!(unit.user, mesh_protocol::UnitUser::Root);
    assert_eq!(
        unit.limits,
        mesh_protocol::UnitLimits {
            cpu_millis: None,
            memory_bytes: Some(64 << 20),
            pids: Some(16),
        }
    );
    assert!(unit.stateful);

    // An operator changing the module back to its own user needs no admin,
    // and the entry says nothing of root.
    let mut own = module.clone();
    own["unit"].as_object_mut().unwrap().remove("user");
    let (status, _, view) = f
        .request_with(
            audit_as(Role::Operator, "PUT", uri),
            "PUT",
            uri,
            &[("if-match", "*")],
            Some(own),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{view}");
    assert!(view["unit"].get("user").is_none(), "{view}");
    let entries = audited("inventory.operator.audit").await;
    assert_eq!(entries.len(), 2);
    assert!(entries[1].get("detail").is_none(), "{entries:?}");

    // The node reports the unit's box: the view shows it per replica.
    let env = Envelope::new(
        NodeId::parse(&db).unwrap(),
        5,
        Report::Units(Units {
            units: vec![UnitStatus {
                reason: Some(mesh_protocol::REASON_OOM_KILLED.to_owned()),
                oom_kills: 2,
                uid: Some(mesh_protocol::MODULE_UID_MIN),
                data_bytes: Some(4096),
                revision: None,
                name: "db".into(),
                module: "db".into(),
                state: UnitState::Running,
                pid: Some(77),
                exit_code: None,
                restarts: 2,
                started_at: Some(Utc::now()),
            }],
        }),
    );
    f.handle(&[env]).await;
    let (status, _, view) = f.request("GET", uri, &[], None).await;
    assert_eq!(status, StatusCode::OK);
    let replica = &view["assignments"][0];
    assert_eq!(replica["node"], db.as_str());
    assert_eq!(replica["reason"], "oom_killed");
    assert_eq!(replica["oom_kills"], 2);
    assert_eq!(replica["uid"], mesh_protocol::MODULE_UID_MIN);
    assert_eq!(replica["data_bytes"], 4096);
    // The node's view (the controller's, from the same read) lists the same.
    let units = f.inventory.assignments(None, Some(&db)).await.unwrap();
    assert_eq!(
        (units[0].oom_kills, units[0].reason.as_deref()),
        (2, Some("oom_killed"))
    );
    // A report no longer listing the unit: no uid (not running); the last
    // reason, kills and volume size stay as last reported.
    let env = Envelope::new(
        NodeId::parse(&db).unwrap(),
        6,
        Report::Units(Units { units: vec![] }),
    );
    f.handle(&[env]).await;
    let (_, _, view) = f.request("GET", uri, &[], None).await;
    let replica = &view["assignments"][0];
    assert!(
        replica["uid"].is_null() && replica["unit_state"].is_null(),
        "{replica}"
    );
    assert_eq!(replica["oom_kills"], 2);
    assert_eq!(replica["data_bytes"], 4096);
    f.env.teardown().await.unwrap();
}

/// Issue 35: `GET /v1/prometheus/targets` in Prometheus' HTTP SD format: the
/// controller's endpoint, each agent that serves metrics at its scrape
/// address with inventory's labels, one target per placed replica of a
/// module with `metrics`; paged by node like every list.
#[tokio::test]
async fn prometheus_discovers_the_controller_agents_and_module_replicas() {
    let f = setup().await;
    f.observed();
    let a = f.node("a");
    let hello = |suffix: &str, metrics: Option<&str>| {
        let id = f.node(suffix);
        Envelope::new(
            NodeId::parse(&id).unwrap(),
            1,
            Report::Hello(Hello {
                hostname: format!("{id}.example"),
                arch: "x86_64".into(),
                cpus: 2,
                memory_bytes: 4 << 30,
                labels: [("role".to_owned(), "web".to_owned())].into(),
                agent_version: "test".into(),
                public_key: None,
                seal_key: None,
                overlay: None,
                applied: Default::default(),
                protocol: None,
                outage: None,
                metrics: metrics.map(Into::into),
            }),
        )
    };
    // a serves metrics on loopback; b serves none and has no advertised address.
    f.handle(&[hello("a", Some("127.0.0.1:9464")), hello("b", None)])
        .await;
    let (status, _, _) = f
        .request(
            "PUT",
            &format!("/v1/nodes/{a}/labels"),
            &[("if-match", "*")],
            Some(json!({"labels": {"team-name": "ops"}})),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    let mut spec = web(1);
    spec["placement"] = json!({"exact_node": {"node": a}});
    spec["metrics"] = json!({"port": 9100, "path": "/stats"});
    let (status, _, view) = f.request("PUT", "/v1/modules/web", &[], Some(spec)).await;
    assert_eq!(status, StatusCode::CREATED, "{view}");
    f.inventory.reconcile().await.unwrap();

    let (status, _, groups) = f.request("GET", "/v1/prometheus/targets", &[], None).await;
    assert_eq!(status, StatusCode::OK, "{groups}");
    assert_eq!(
        groups,
        json!([
            {"targets": ["127.0.0.1:7700"], "labels": {"job": "mesh-controller"}},
            {"targets": ["127.0.0.1:9464"], "labels": {
                "job": "mesh-agent", "node": a, "hostname": format!("{a}.example"),
                "state": "alive", "label_team_name": "ops"}},
            {"targets": ["127.0.0.1:9100"], "labels": {
                "job": "mesh-module", "node": a, "hostname": format!("{a}.example"),
                "state": "alive", "label_team_name": "ops", "module": "web",
                "replica": "0", "__metrics_path__": "/stats"}},
        ])
    );

    // Paged by node: after a, only b, which has nothing to scrape.
    let (status, _, page) = f
        .request(
            "GET",
            &format!("/v1/prometheus/targets?after={a}&limit=1"),
            &[],
            None,
        )
        .await;
    assert_eq!((status, page), (StatusCode::OK, json!([])));
    let (status, _, problem) = f
        .request("GET", "/v1/prometheus/targets?limit=0", &[], None)
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{problem}");
    let (status, _, problem) = f
        .request("GET", "/v1/prometheus/targets?job=x", &[], None)
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{problem}");
    // A bad metrics spec names its field.
    let mut spec = web(1);
    spec["metrics"] = json!({"port": 0});
    let (status, _, problem) = f.request("PUT", "/v1/modules/bad", &[], Some(spec)).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{problem}");
    assert!(problem.to_string().contains("metrics.port"), "{problem}");
}
