//! Delivery's targets against a real PostgreSQL: `delivery.module.targets`
//! decides which revision each node's replicas of a module run; inventory
//! declares the units, changing only the sections of the nodes whose revision
//! changed, never flapping against the resync, and a module's own spec still
//! runs wherever the targets do not reach.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use chrono::Utc;
use mesh_inventory::{Inventory, InventorySettings};
use mesh_plumbing::{Context, OutboxSignal};
use mesh_protocol::{
    ArtifactDigest, Declaration, Envelope, Hello, Labels, ModuleTargets, NodeId, NodeTarget,
    RecordEvent, RecordKind, Report, RevisionUnit, Section, UnitItem,
};
use mesh_testkit::TestEnv;
use serde_json::{Value, json};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tower::ServiceExt;
use uuid::Uuid;

fn audit(method: &str, uri: &str) -> mesh_plumbing::audit::Audit {
    let principal = mesh_plumbing::api::Principal {
        id: Uuid::now_v7(),
        name: "tester".into(),
        role: mesh_plumbing::api::Role::Admin,
    };
    mesh_plumbing::audit::Audit::new(principal, format!("{method} {uri}"), uri, Uuid::now_v7())
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
        label_trust: mesh_inventory::LabelTrust::new(["role".to_owned(), "zone".to_owned()]),
        ..InventorySettings::default()
    };
    let inventory = Arc::new(Inventory::new(
        pool.clone(),
        OutboxSignal::default(),
        settings,
    ));
    // Placement is authoritative: the controller has observed for an hour.
    inventory.observe_from(Utc::now() - chrono::Duration::hours(1));
    Fixture {
        env,
        pool,
        inventory,
    }
}

impl Fixture {
    async fn hello(&self, suffix: &str) -> String {
        let id = format!("{}-{suffix}", self.env.id());
        let labels: Labels = [("role".to_owned(), "web".to_owned())].into();
        let env = Envelope::new(
            NodeId::parse(&id).unwrap(),
            1,
            Report::Hello(Hello {
                hostname: id.clone(),
                arch: "x86_64".into(),
                cpus: 2,
                memory_bytes: 4 << 30,
                labels,
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
        let mut tx = self.pool.begin().await.unwrap();
        self.inventory
            .handle_reports(&mut tx, &[env])
            .await
            .unwrap();
        tx.commit().await.unwrap();
        id
    }

    async fn request(
        &self,
        method: &str,
        uri: &str,
        headers: &[(&str, &str)],
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let mut builder = Request::builder()
            .method(method)
            .uri(uri)
            .header("content-type", "application/json")
            .extension(audit(method, uri));
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
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        (
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        )
    }

    /// Hand one record event to the context as the controller's router does:
    /// in a transaction of its own, committed.
    async fn event(&self, kind: RecordKind) {
        let event = RecordEvent::new(kind);
        let mut tx = self.pool.begin().await.unwrap();
        self.inventory
            .handle_events(&mut tx, &[&event])
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }

    async fn targets(&self, version: i64, revisions: &[&RevisionUnit], targets: &[(&str, Uuid)]) {
        self.event(RecordKind::ModuleTargets(ModuleTargets {
            module: "web".into(),
            version,
            revisions: revisions.iter().map(|r| (*r).clone()).collect(),
            targets: targets
                .iter()
                .map(|(node, revision)| NodeTarget {
                    node: NodeId::parse(node).unwrap(),
                    revision: *revision,
                })
                .collect(),
        }))
        .await;
    }

    /// The newest inventory section declared to `node`: its generation and
    /// its one unit.
    async fn declared(&self, node: &str) -> (u64, UnitItem) {
        let payload: Vec<u8> = sqlx::query_scalar(
            "SELECT payload FROM inventory.outbox WHERE exchange = 'declarations' AND node = $1 \
             ORDER BY id DESC LIMIT 1",
        )
        .bind(node)
        .fetch_one(&self.pool)
        .await
        .unwrap();
        let env: Envelope<Declaration> =
            Envelope::decode(&payload, mesh_protocol::MAX_DECLARATION_BYTES).unwrap();
        assert_eq!(env.body.section, Section::Inventory);
        let mut units = env.body.items.units;
        assert_eq!(units.len(), 1, "{units:?}");
        (env.body.generation, units.remove(0))
    }

    /// Every node's declared generation, by node.
    async fn generations(&self, nodes: &[String]) -> Vec<u64> {
        let mut out = Vec::new();
        for n in nodes {
            out.push(self.declared(n).await.0);
        }
        out
    }

    /// Each assignment's `revision` in the module view, by node.
    async fn view_revisions(&self) -> BTreeMap<String, Value> {
        let (status, view) = self.request("GET", "/v1/modules/web", &[], None).await;
        assert_eq!(status, StatusCode::OK, "{view}");
        view["assignments"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| {
                (
                    a["node"].as_str().unwrap().to_owned(),
                    a["revision"].clone(),
                )
            })
            .collect()
    }

    async fn resync_declares(&self) -> usize {
        mesh_plumbing::section::resync(&*self.inventory)
            .await
            .unwrap()
            .declared
    }
}

fn web(command: &str, replicas: u32) -> Value {
    json!({
        "unit": {"command": command, "args": ["1000"], "resources": {"cpu_millis": 100}},
        "placement": {"match_labels": {"labels": {"role": "web"}, "replicas": replicas}}
    })
}

fn revision(name: &str) -> RevisionUnit {
    RevisionUnit {
        id: Uuid::now_v7(),
        artifact: Some(ArtifactDigest::of(name.as_bytes())),
        command: format!("bin/{name}"),
        args: vec!["--port".into(), "8080".into()],
        env: BTreeMap::new(),
        working_dir: None,
        restart: Default::default(),
        probes: Vec::new(),
    }
}

/// The unit `unit` is the revision's, under the module's own name and
/// desired state.
fn runs(unit: &UnitItem, r: &RevisionUnit) {
    assert_eq!(unit.module, "web");
    assert_eq!(unit.command, r.command);
    assert_eq!(unit.args, r.args);
    assert_eq!(unit.artifact, r.artifact);
    assert_eq!(unit.revision, Some(r.id));
    assert_eq!(unit.desired, mesh_protocol::DesiredState::Running);
}

/// The unit is the module's own spec.
fn runs_spec(unit: &UnitItem, command: &str) {
    assert_eq!(unit.command, command);
    assert_eq!(unit.args, ["1000"]);
    assert_eq!(unit.artifact, None);
    assert_eq!(unit.revision, None);
}

#[tokio::test]
async fn targets_move_only_the_nodes_they_change_and_the_resync_agrees() {
    let f = setup().await;
    let nodes = vec![f.hello("a").await, f.hello("b").await, f.hello("c").await];
    let (a, b, c) = (&nodes[0], &nodes[1], &nodes[2]);
    let (status, view) = f
        .request("PUT", "/v1/modules/web", &[], Some(web("/bin/sleep", 3)))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{view}");
    assert_eq!(f.generations(&nodes).await, [1, 1, 1]);
    for n in &nodes {
        runs_spec(&f.declared(n).await.1, "/bin/sleep");
    }
    let view = f.view_revisions().await;
    assert!(view.values().all(Value::is_null), "{view:?}");

    // Node a is targeted at v2: only its section moves, and it runs the
    // revision (artifact and revision id with it).
    let v2 = revision("v2");
    f.targets(1, &[&v2], &[(a, v2.id)]).await;
    assert_eq!(f.generations(&nodes).await, [2, 1, 1]);
    runs(&f.declared(a).await.1, &v2);
    runs_spec(&f.declared(b).await.1, "/bin/sleep");
    let view = f.view_revisions().await;
    assert_eq!(view[a], json!(v2.id.to_string()));
    assert!(view[b].is_null() && view[c].is_null(), "{view:?}");
    // The resync computes the same sections: nothing to declare.
    assert_eq!(f.resync_declares().await, 0, "the resync agrees");

    // A stale version (equal, or lower) changes nothing, whatever it says.
    f.targets(1, &[&v2], &[(a, v2.id), (b, v2.id)]).await;
    f.targets(0, &[], &[]).await;
    assert_eq!(f.generations(&nodes).await, [2, 1, 1]);
    runs(&f.declared(a).await.1, &v2);
    assert!(f.view_revisions().await[b].is_null());
    let kept: i64 =
        sqlx::query_scalar("SELECT version FROM inventory.module_targets WHERE module = 'web'")
            .fetch_one(&f.pool)
            .await
            .unwrap();
    assert_eq!(kept, 1, "the newest version is kept");

    // A module PUT changing the command: the targeted node keeps the
    // revision, the others take the new spec.
    let (status, view) = f
        .request(
            "PUT",
            "/v1/modules/web",
            &[("if-match", "\"1\"")],
            Some(web("/bin/true", 3)),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{view}");
    assert_eq!(f.generations(&nodes).await, [2, 2, 2]);
    runs(&f.declared(a).await.1, &v2);
    runs_spec(&f.declared(b).await.1, "/bin/true");
    runs_spec(&f.declared(c).await.1, "/bin/true");
    assert_eq!(f.resync_declares().await, 0, "the resync agrees");

    // Every node on v2: a keeps its generation (its revision is the same).
    f.targets(2, &[&v2], &[(a, v2.id), (b, v2.id), (c, v2.id)])
        .await;
    assert_eq!(f.generations(&nodes).await, [2, 3, 3]);
    for n in &nodes {
        runs(&f.declared(n).await.1, &v2);
    }
    assert_eq!(f.resync_declares().await, 0, "the resync agrees");

    // An empty set returns every node to the module's own spec.
    f.targets(3, &[], &[]).await;
    assert_eq!(f.generations(&nodes).await, [3, 4, 4]);
    for n in &nodes {
        runs_spec(&f.declared(n).await.1, "/bin/true");
    }
    let view = f.view_revisions().await;
    assert!(view.values().all(Value::is_null), "{view:?}");
    assert_eq!(f.resync_declares().await, 0, "the resync agrees");
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn a_new_replica_runs_the_spec_and_a_deleted_module_forgets_its_targets() {
    let f = setup().await;
    let a = f.hello("a").await;
    // Targets of a module inventory does not have are not kept.
    let v2 = revision("v2");
    f.targets(1, &[&v2], &[(&a, v2.id)]).await;
    let kept: i64 = sqlx::query_scalar("SELECT count(*) FROM inventory.module_targets")
        .fetch_one(&f.pool)
        .await
        .unwrap();
    assert_eq!(kept, 0);

    let (status, _) = f
        .request("PUT", "/v1/modules/web", &[], Some(web("/bin/sleep", 1)))
        .await;
    assert_eq!(status, StatusCode::CREATED);
    f.targets(2, &[&v2], &[(&a, v2.id)]).await;
    assert_eq!(f.declared(&a).await.0, 2);
    runs(&f.declared(&a).await.1, &v2);

    // Scaled to two: the new node's replica runs the module's own spec.
    let b = f.hello("b").await;
    let (status, view) = f
        .request(
            "PUT",
            "/v1/modules/web",
            &[("if-match", "\"1\"")],
            Some(web("/bin/sleep", 2)),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{view}");
    assert_eq!(f.declared(&a).await.0, 2, "a's unit did not change");
    runs(&f.declared(&a).await.1, &v2);
    let (gb, unit_b) = f.declared(&b).await;
    assert_eq!(gb, 1);
    runs_spec(&unit_b, "/bin/sleep");

    // Deleted, the module's targets go; created again it runs its own spec.
    let (status, _) = f.request("DELETE", "/v1/modules/web", &[], None).await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let kept: i64 = sqlx::query_scalar("SELECT count(*) FROM inventory.module_targets")
        .fetch_one(&f.pool)
        .await
        .unwrap();
    assert_eq!(kept, 0);
    let (status, _) = f
        .request("PUT", "/v1/modules/web", &[], Some(web("/bin/sleep", 2)))
        .await;
    assert_eq!(status, StatusCode::CREATED);
    for n in [&a, &b] {
        runs_spec(&f.declared(n).await.1, "/bin/sleep");
    }
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn a_targeted_revision_runs_in_the_modules_box_never_as_root() {
    let f = setup().await;
    let a = f.hello("a").await;
    let module = json!({
        "unit": {"command": "/bin/sleep", "args": ["1000"], "user": "root",
                 "resources": {"cpu_millis": 250, "memory_bytes": 64 << 20, "pids": 32}},
        "stateful": true,
        "placement": {"exact_node": {"node": a}}
    });
    let (status, view) = f.request("PUT", "/v1/modules/web", &[], Some(module)).await;
    assert_eq!(status, StatusCode::CREATED, "{view}");
    let boxed = |unit: &UnitItem, user| {
        assert_eq!(unit.user, user, "{unit:?}");
        assert_eq!(
            unit.limits,
            mesh_protocol::UnitLimits {
                cpu_millis: Some(250),
                memory_bytes: Some(64 << 20),
                pids: Some(32),
            }
        );
        assert!(unit.stateful, "{unit:?}");
    };
    let (generation, own) = f.declared(&a).await;
    assert_eq!(generation, 1);
    runs_spec(&own, "/bin/sleep");
    boxed(&own, mesh_protocol::UnitUser::Root);
    // Delivery targets the node at a revision: its command, artifact and
    // revision id, in the module's box (limits, stateful), but as the
    // module's user: revisions are an operator's, root is the admin's spec's
    // own unit's only (decision 0051).
    let v2 = revision("v2");
    f.targets(1, &[&v2], &[(&a, v2.id)]).await;
    let (generation, targeted) = f.declared(&a).await;
    assert_eq!(generation, 2);
    runs(&targeted, &v2);
    boxed(&targeted, mesh_protocol::UnitUser::Module);
    targeted.validate("unit").unwrap();
    assert_eq!(f.resync_declares().await, 0, "the resync agrees");
    f.env.teardown().await.unwrap();
}
