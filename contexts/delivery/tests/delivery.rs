//! The delivery context against a real PostgreSQL, one fresh database per
//! test: record events and reports fed the way the controller's router feeds
//! them (inbox, handler, commit), rollouts moved by `tick` as the
//! controller's clock moves them, read back through the context's methods,
//! its outbox (`delivery.module.targets`) and the receipt logs.
//!
//! Revisions here have no artifact (the artifact path, with the real
//! registry and real agents, is e2e/tests/delivery.rs); the store refuses.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::sync::Arc;
use std::time::Duration;

use mesh_delivery::{
    ArtifactStore, BoxFuture, Delivery, DeliveryPolicy, Error, FreezeRequest, NewRevision,
    NewSignature, NewSigningKey, RevisionUnitSpec, RolloutRequest, RolloutView, SCHEMA, Settings,
};
use mesh_plumbing::api::{Principal, Role};
use mesh_plumbing::audit::Audit;
use mesh_plumbing::{Context, inbox};
use mesh_protocol::{
    ArtifactDigest, ArtifactSignature, DeclarationSigner, Envelope, ModulePlacement, ModuleTargets,
    NodeId, RecordEvent, RecordKind, Report, UnitState, UnitStatus, Units,
};
use mesh_testkit::TestEnv;
use sqlx::postgres::PgPoolOptions;
use uuid::Uuid;

/// Most tests push no artifact; the signing keys' test keeps what it is
/// given in memory (the real registry: e2e/tests/rollouts.rs and
/// e2e/tests/signing.rs).
#[derive(Default)]
struct NoRegistry {
    accepts: bool,
    signatures: std::sync::Mutex<Vec<ArtifactSignature>>,
}

impl ArtifactStore for NoRegistry {
    fn push<'a>(
        &'a self,
        bytes: &'a [u8],
    ) -> BoxFuture<'a, Result<(ArtifactDigest, Option<String>), String>> {
        Box::pin(async move {
            if self.accepts {
                Ok((ArtifactDigest::of(bytes), None))
            } else {
                Err("no registry in this test".to_owned())
            }
        })
    }
    fn attach_signature<'a>(
        &'a self,
        signature: &'a ArtifactSignature,
    ) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            if !self.accepts {
                return Err("no registry in this test".to_owned());
            }
            let mut held = self.signatures.lock().map_err(|e| e.to_string())?;
            held.retain(|s| s.digest != signature.digest || s.key != signature.key);
            held.push(signature.clone());
            Ok(())
        })
    }
    fn controller_key(&self) -> String {
        DeclarationSigner::from_seed([7; 32]).public_key_hex()
    }
    fn controller_trusted(&self) -> bool {
        false
    }
    fn pull_location(&self) -> (String, String) {
        (
            "http://127.0.0.1:5000".to_owned(),
            "mesh/artifacts".to_owned(),
        )
    }
}

struct Fixture {
    env: TestEnv,
    delivery: Arc<Delivery>,
    seq: std::sync::atomic::AtomicU64,
}

fn audit(name: &str) -> Audit {
    Audit::new(
        Principal {
            id: Uuid::now_v7(),
            name: name.to_owned(),
            role: Role::Operator,
        },
        "POST /v1/test".to_owned(),
        "/v1/test",
        Uuid::now_v7(),
    )
}

async fn setup() -> Fixture {
    setup_with(NoRegistry::default()).await
}

async fn setup_with(store: NoRegistry) -> Fixture {
    let env = TestEnv::new().await.unwrap();
    let url = env.database_url(SCHEMA);
    mesh_delivery::migrate(&url).await.unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .unwrap();
    let delivery = Arc::new(Delivery::new(
        pool,
        mesh_plumbing::OutboxSignal::default(),
        Settings::default(),
        Arc::new(store),
    ));
    Fixture {
        env,
        delivery,
        seq: 1.into(),
    }
}

impl Fixture {
    fn delivery_store_controller_key(&self) -> String {
        DeclarationSigner::from_seed([7; 32]).public_key_hex()
    }

    fn node(&self, suffix: &str) -> NodeId {
        NodeId::parse(&format!("{}-{suffix}", self.env.id())).unwrap()
    }

    async fn events(&self, events: &[RecordEvent]) {
        let mut tx = self.delivery.pool().begin().await.unwrap();
        let ids: Vec<_> = events.iter().map(|e| e.id).collect();
        let mut fresh = inbox::claim(&mut tx, SCHEMA, &ids).await.unwrap();
        let fresh: Vec<&RecordEvent> = events.iter().filter(|e| fresh.remove(&e.id)).collect();
        if !fresh.is_empty() {
            self.delivery.handle_events(&mut tx, &fresh).await.unwrap();
        }
        tx.commit().await.unwrap();
    }

    async fn report(&self, node: &NodeId, report: Report) {
        let seq = self.seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let env = Envelope::new(node.clone(), seq, report);
        let mut tx = self.delivery.pool().begin().await.unwrap();
        inbox::claim(&mut tx, SCHEMA, &[env.id]).await.unwrap();
        self.delivery.handle_reports(&mut tx, &[env]).await.unwrap();
        tx.commit().await.unwrap();
    }

    /// `web` placed on `nodes`.
    async fn place(&self, nodes: &[NodeId], version: i64) {
        let mut nodes = nodes.to_vec();
        nodes.sort();
        self.events(&[RecordEvent::new(RecordKind::ModulePlaced(
            ModulePlacement {
                module: "web".to_owned(),
                version,
                nodes,
                settings_files: vec![],
                ports: vec![],
                requires: Vec::new(),
                provides: Vec::new(),
            },
        ))])
        .await;
    }

    async fn revision(&self, command: &str) -> Uuid {
        self.revision_of(command, None).await
    }

    /// A new revision of `web` running `command`, from `artifact` if any.
    async fn revision_of(&self, command: &str, artifact: Option<ArtifactDigest>) -> Uuid {
        let new = NewRevision {
            artifact,
            unit: RevisionUnitSpec {
                command: command.to_owned(),
                args: vec![],
                env: Default::default(),
                working_dir: None,
                restart: Default::default(),
                probes: vec![],
            },
            settings_digest: None,
        };
        let (rev, created) = self
            .delivery
            .create_revision("web", &new, &audit("alice"))
            .await
            .unwrap();
        assert!(created);
        rev.id
    }

    /// The node states its `web` unit running `revision` (or failed).
    async fn unit(&self, node: &NodeId, revision: Uuid, state: UnitState, restarts: u32) {
        self.report(
            node,
            Report::Units(Units {
                units: vec![UnitStatus {
                    reason: None,
                    oom_kills: 0,
                    uid: None,
                    data_bytes: None,
                    revision: Some(revision),
                    name: "web-0".to_owned(),
                    module: "web".to_owned(),
                    state,
                    pid: Some(42),
                    exit_code: None,
                    restarts,
                    started_at: Some(chrono::Utc::now()),
                }],
            }),
        )
        .await;
    }

    /// The newest `delivery.module.targets` in the outbox.
    async fn targets(&self) -> Option<ModuleTargets> {
        let rows = mesh_plumbing::outbox::pending(self.delivery.pool(), SCHEMA, 10_000)
            .await
            .unwrap();
        rows.iter()
            .rev()
            .filter(|r| r.routing_key == "delivery.module.targets")
            .find_map(|r| match RecordEvent::decode(&r.payload).ok()?.kind {
                RecordKind::ModuleTargets(t) => Some(t),
                _ => None,
            })
    }

    async fn rollout(&self, id: Uuid) -> RolloutView {
        self.delivery.rollout(id).await.unwrap()
    }

    /// Tick and answer for every node as `answer` says, until the rollout is
    /// final or the deadline passes. Returns the most runs seen deploying or
    /// settling at once.
    async fn drive(
        &self,
        id: Uuid,
        answer: impl Fn(&str, Uuid) -> (UnitState, u32),
    ) -> (RolloutView, usize) {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let mut most = 0;
        loop {
            self.delivery.tick().await.unwrap();
            let view = self.rollout(id).await;
            let busy: Vec<_> = view
                .runs
                .iter()
                .filter(|r| matches!(r.state.as_str(), "deploying" | "settling"))
                .collect();
            most = most.max(busy.len());
            if !matches!(view.state.as_str(), "running" | "awaiting_approval")
                || std::time::Instant::now() > deadline
            {
                return (view, most);
            }
            for run in busy {
                let node = NodeId::parse(&run.node).unwrap();
                let (state, restarts) = answer(&run.node, run.revision);
                self.unit(&node, run.revision, state, restarts).await;
            }
        }
    }
}

fn request(revision: Uuid) -> RolloutRequest {
    serde_json::from_value(serde_json::json!({
        "module": "web", "revision": revision, "max_unavailable": 1, "settle_secs": 0,
    }))
    .unwrap()
}

fn kinds(receipts: &[mesh_delivery::Receipt]) -> Vec<&str> {
    receipts.iter().map(|r| r.kind.as_str()).collect()
}

#[tokio::test]
async fn a_rollout_goes_node_by_node_with_receipts_in_order() {
    let f = setup().await;
    let nodes = [f.node("a"), f.node("b"), f.node("c")];
    f.place(&nodes, 1).await;
    let rev = f.revision("/bin/web-v1").await;
    let view = f
        .delivery
        .start_rollout(&request(rev), &audit("alice"))
        .await
        .unwrap();
    assert_eq!(view.state, "running");
    assert_eq!((view.nodes_total, view.steps), (3, 3));
    let (done, most) = f.drive(view.id, |_, _| (UnitState::Running, 0)).await;
    assert_eq!(done.state, "succeeded", "{done:?}");
    assert_eq!(done.nodes_done, 3);
    assert_eq!(most, 1, "max_unavailable 1: one node at a time");
    for run in &done.runs {
        let receipts = f.delivery.receipts(run.id).await.unwrap();
        assert_eq!(
            kinds(&receipts),
            [
                "run.queued",
                "run.started",
                "unit.deployed",
                "unit.running",
                "run.succeeded"
            ]
        );
        assert!(
            receipts
                .windows(2)
                .all(|w| w[0].seq + 1 == w[1].seq && w[0].at <= w[1].at)
        );
    }
    let targets = f.targets().await.unwrap();
    assert_eq!(targets.targets.len(), 3);
    assert!(targets.targets.iter().all(|t| t.revision == rev));
    assert_eq!(targets.revisions.len(), 1);
    assert_eq!(targets.revisions[0].command, "/bin/web-v1");
    // The same revision again: every node already runs it.
    let again = f
        .delivery
        .start_rollout(&request(rev), &audit("alice"))
        .await;
    assert!(matches!(again, Err(mesh_delivery::Error::Conflict(_))));
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn a_failing_revision_is_rolled_back_on_every_node_it_reached() {
    let f = setup().await;
    let nodes = [f.node("a"), f.node("b"), f.node("c")];
    f.place(&nodes, 1).await;
    let good = f.revision("/bin/web-v1").await;
    let first = f
        .delivery
        .start_rollout(&request(good), &audit("alice"))
        .await
        .unwrap();
    let (done, _) = f.drive(first.id, |_, _| (UnitState::Running, 0)).await;
    assert_eq!(done.state, "succeeded");
    let bad = f.revision("/bin/false").await;
    let second = f
        .delivery
        .start_rollout(&request(bad), &audit("alice"))
        .await
        .unwrap();
    assert_eq!(second.previous_revision, Some(good));
    let (done, _) = f
        .drive(second.id, |_, rev| {
            if rev == bad {
                (UnitState::Failed, 1)
            } else {
                (UnitState::Running, 0)
            }
        })
        .await;
    assert_eq!(done.state, "rolled_back", "{done:?}");
    assert!(done.reason.as_deref().unwrap_or("").contains("failed"));
    let targets = f.targets().await.unwrap();
    assert!(
        targets.targets.iter().all(|t| t.revision == good),
        "every node runs the previous revision again: {targets:?}"
    );
    let reached = &done.runs[0];
    let receipts = f.delivery.receipts(reached.id).await.unwrap();
    assert_eq!(
        kinds(&receipts),
        [
            "run.queued",
            "run.started",
            "unit.deployed",
            "run.failed",
            "run.rolled_back"
        ]
    );
    for run in &done.runs[1..] {
        let receipts = f.delivery.receipts(run.id).await.unwrap();
        assert_eq!(kinds(&receipts), ["run.queued", "run.canceled"]);
    }
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn approval_holds_the_rollout_and_a_denial_ends_it_with_the_reason() {
    let f = setup().await;
    let nodes = [f.node("a"), f.node("b")];
    f.place(&nodes, 1).await;
    f.delivery
        .set_policy(
            "web",
            &DeliveryPolicy {
                require_approval: true,
            },
            &audit("alice"),
        )
        .await
        .unwrap();
    let rev = f.revision("/bin/web-v1").await;
    let view = f
        .delivery
        .start_rollout(&request(rev), &audit("alice"))
        .await
        .unwrap();
    assert_eq!(view.state, "awaiting_approval");
    for _ in 0..3 {
        f.delivery.tick().await.unwrap();
    }
    assert!(
        f.targets().await.is_none(),
        "nothing starts before approval"
    );
    assert!(
        f.rollout(view.id)
            .await
            .runs
            .iter()
            .all(|r| r.state == "awaiting_approval")
    );
    // A denial needs a reason.
    assert!(matches!(
        f.delivery
            .decide(view.runs[0].id, false, None, &audit("bob"))
            .await,
        Err(mesh_delivery::Error::Invalid { .. })
    ));
    f.delivery
        .decide(
            view.runs[0].id,
            false,
            Some("not during the sale"),
            &audit("bob"),
        )
        .await
        .unwrap();
    let denied = f.rollout(view.id).await;
    assert_eq!(denied.state, "denied");
    for run in &denied.runs {
        assert_eq!(run.state, "canceled");
        let receipts = f.delivery.receipts(run.id).await.unwrap();
        assert_eq!(
            kinds(&receipts),
            [
                "run.queued",
                "approval.requested",
                "approval.denied",
                "run.canceled"
            ]
        );
        assert_eq!(receipts[2].detail["decided_by"], "bob");
        assert_eq!(receipts[2].detail["reason"], "not during the sale");
    }
    f.delivery.tick().await.unwrap();
    assert!(f.targets().await.is_none());

    // Approved, it runs.
    let view = f
        .delivery
        .start_rollout(&request(rev), &audit("alice"))
        .await
        .unwrap();
    f.delivery
        .decide(view.runs[1].id, true, None, &audit("carol"))
        .await
        .unwrap();
    let (done, _) = f.drive(view.id, |_, _| (UnitState::Running, 0)).await;
    assert_eq!(done.state, "succeeded");
    let receipts = f.delivery.receipts(done.runs[0].id).await.unwrap();
    assert_eq!(receipts[2].kind, "approval.approved");
    assert_eq!(receipts[2].detail["decided_by"], "carol");
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn a_freeze_refuses_rollouts_with_its_reason_until_lifted() {
    let f = setup().await;
    let nodes = [f.node("a"), f.node("b")];
    f.place(&nodes, 1).await;
    let rev = f.revision("/bin/web-v1").await;
    f.delivery
        .set_freeze(
            &FreezeRequest {
                reason: "end of quarter".to_owned(),
                pause_in_flight: true,
            },
            &audit("alice"),
        )
        .await
        .unwrap();
    match f.delivery.start_rollout(&request(rev), &audit("bob")).await {
        Err(mesh_delivery::Error::Conflict(detail)) => {
            assert!(detail.contains("end of quarter"), "{detail}")
        }
        other => panic!("expected a conflict, got {other:?}"),
    }
    f.delivery.lift_freeze(&audit("alice")).await.unwrap();
    let view = f
        .delivery
        .start_rollout(&request(rev), &audit("bob"))
        .await
        .unwrap();
    // A freeze set while it runs pauses it at its next step; lifting resumes.
    f.delivery.tick().await.unwrap();
    f.delivery
        .set_freeze(
            &FreezeRequest {
                reason: "incident 42".to_owned(),
                pause_in_flight: true,
            },
            &audit("alice"),
        )
        .await
        .unwrap();
    let (paused, _) = f.drive(view.id, |_, _| (UnitState::Running, 0)).await;
    assert_eq!(paused.state, "paused", "{paused:?}");
    assert_eq!(paused.paused_reason.as_deref(), Some("freeze: incident 42"));
    assert_eq!(paused.nodes_done, 1, "the step in flight finished");
    f.delivery.lift_freeze(&audit("alice")).await.unwrap();
    let (done, _) = f.drive(view.id, |_, _| (UnitState::Running, 0)).await;
    assert_eq!(done.state, "succeeded");
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn a_canary_pauses_after_the_first_node_until_continued() {
    let f = setup().await;
    let nodes = [f.node("a"), f.node("b"), f.node("c")];
    f.place(&nodes, 1).await;
    let rev = f.revision("/bin/web-v1").await;
    let mut req = request(rev);
    req.canary = 1;
    let view = f
        .delivery
        .start_rollout(&req, &audit("alice"))
        .await
        .unwrap();
    let (paused, _) = f.drive(view.id, |_, _| (UnitState::Running, 0)).await;
    assert_eq!(paused.state, "paused");
    assert_eq!(paused.nodes_done, 1);
    assert!(paused.paused_reason.unwrap().starts_with("canary"));
    f.delivery
        .continue_rollout(view.id, &audit("alice"))
        .await
        .unwrap();
    let (done, _) = f.drive(view.id, |_, _| (UnitState::Running, 0)).await;
    assert_eq!(done.state, "succeeded");
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn receipts_and_revisions_refuse_update_and_delete_as_the_runtime_role() {
    let f = setup().await;
    f.place(&[f.node("a")], 1).await;
    let rev = f.revision("/bin/web-v1").await;
    let view = f
        .delivery
        .start_rollout(&request(rev), &audit("alice"))
        .await
        .unwrap();
    let run = view.runs[0].id;
    let pool = f.delivery.pool();
    for sql in [
        "UPDATE delivery.receipts SET kind = 'run.succeeded'",
        "DELETE FROM delivery.receipts",
        "TRUNCATE delivery.receipts",
        "UPDATE delivery.revisions SET unit = '{}'",
        "DELETE FROM delivery.revisions",
    ] {
        let err = sqlx::query(sql).execute(pool).await.unwrap_err();
        assert!(
            err.to_string().contains("permission denied")
                || err.to_string().contains("append-only"),
            "{sql}: {err}"
        );
    }
    // An insert out of order, or back in time, is refused by the table too.
    for (seq, at) in [(5, "now()"), (1, "now()"), (2, "now() - interval '1 hour'")] {
        let sql = format!(
            "INSERT INTO delivery.receipts (id, run, seq, kind, at) VALUES ('{}', '{run}', {seq}, 'run.forged', {at})",
            Uuid::now_v7()
        );
        assert!(
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .execute(pool)
                .await
                .is_err(),
            "seq {seq} at {at} must be refused"
        );
    }
    let receipts = f.delivery.receipts(run).await.unwrap();
    assert_eq!(kinds(&receipts), ["run.queued"]);
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn a_role_cannot_touch_another_schema() {
    let f = setup().await;
    let err = sqlx::query("SELECT 1 FROM inventory.nodes")
        .execute(f.delivery.pool())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("permission denied"), "{err}");
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn a_run_stages_its_artifact_in_the_nodes_delivery_section_first() {
    let f = setup().await;
    let a = f.node("a");
    f.place(std::slice::from_ref(&a), 1).await;
    let digest = ArtifactDigest::of(b"an artifact");
    let rev = f.revision_of("run.sh", Some(digest.clone())).await;
    let view = f
        .delivery
        .start_rollout(&request(rev), &audit("alice"))
        .await
        .unwrap();
    f.delivery.tick().await.unwrap();
    let stored = mesh_delivery::SECTIONS
        .stored(f.delivery.pool(), &a)
        .await
        .unwrap()
        .expect("a delivery section for the node");
    assert_eq!(stored.items.artifacts.len(), 1);
    assert_eq!(stored.items.artifacts[0].digest, digest);
    assert_eq!(stored.items.artifacts[0].registry, "http://127.0.0.1:5000");
    // Not deployed before the node says it holds the artifact.
    for _ in 0..3 {
        f.delivery.tick().await.unwrap();
    }
    assert_eq!(f.rollout(view.id).await.runs[0].state, "staging");
    assert!(f.targets().await.is_none());
    // A node that never says (an agent older than artifacts) fails the run
    // past the deadline, and nothing was deployed.
    let later = chrono::Utc::now() + chrono::Duration::seconds(301);
    f.delivery.tick_at(later).await.unwrap();
    let view = f.rollout(view.id).await;
    assert_eq!(view.state, "failed", "{view:?}");
    let reason = view.runs[0].reason.clone().unwrap_or_default();
    assert!(
        reason.contains("did not report holding artifact"),
        "{reason}"
    );
    assert!(f.targets().await.is_none());
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn with_probes_only_a_healthy_replica_passes_the_gate() {
    let f = setup().await;
    let a = f.node("a");
    f.place(std::slice::from_ref(&a), 1).await;
    let new: NewRevision = serde_json::from_value(serde_json::json!({
        "unit": {"command": "/bin/web", "probes": [{"name": "ready", "tcp": {"port": 8080}}]},
    }))
    .unwrap();
    let (rev, _) = f
        .delivery
        .create_revision("web", &new, &audit("alice"))
        .await
        .unwrap();
    let view = f
        .delivery
        .start_rollout(&request(rev.id), &audit("alice"))
        .await
        .unwrap();
    for _ in 0..4 {
        f.delivery.tick().await.unwrap();
        f.unit(&a, rev.id, UnitState::Running, 0).await;
    }
    let held = f.rollout(view.id).await;
    assert_eq!(held.runs[0].state, "settling", "no health yet: held");
    let health = |state: mesh_protocol::HealthState, version| {
        RecordEvent::new(RecordKind::ModuleHealth(mesh_protocol::ModuleHealth {
            module: "web".to_owned(),
            version,
            health: state,
            replicas: vec![mesh_protocol::ReplicaHealth {
                node: a.clone(),
                unit: "web-0".to_owned(),
                health: state,
                reason: None,
            }],
            at: chrono::Utc::now(),
        }))
    };
    f.events(&[health(mesh_protocol::HealthState::Unknown, 1)])
        .await;
    f.delivery.tick().await.unwrap();
    assert_eq!(
        f.rollout(view.id).await.runs[0].state,
        "settling",
        "unknown: held"
    );
    f.events(&[health(mesh_protocol::HealthState::Healthy, 2)])
        .await;
    f.delivery.tick().await.unwrap();
    f.delivery.tick().await.unwrap();
    assert_eq!(f.rollout(view.id).await.state, "succeeded");
    f.env.teardown().await.unwrap();
}

/// `GET /v1/runs` through the context's own router: the answer's JSON.
async fn get(f: &Fixture, uri: &str) -> (u16, serde_json::Value) {
    use tower::ServiceExt as _;
    let response = f
        .delivery
        .clone()
        .routes()
        .split_for_parts()
        .0
        .oneshot(
            axum::http::Request::builder()
                .uri(uri)
                .extension(audit("alice"))
                .body(axum::body::Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    let status = response.status().as_u16();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null),
    )
}

#[tokio::test]
async fn runs_are_listed_newest_first_filtered_and_paged() {
    let f = setup().await;
    let nodes = [f.node("a"), f.node("b"), f.node("c")];
    f.place(&nodes, 1).await;
    let rev = f.revision("/bin/web-v1").await;
    let view = f
        .delivery
        .start_rollout(&request(rev), &audit("alice"))
        .await
        .unwrap();
    let (done, _) = f.drive(view.id, |_, _| (UnitState::Running, 0)).await;
    assert_eq!(done.state, "succeeded", "{done:?}");
    let mut by_id: Vec<Uuid> = done.runs.iter().map(|r| r.id).collect();
    by_id.sort();
    by_id.reverse();

    let ids = |v: &serde_json::Value| -> Vec<Uuid> {
        v["runs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["id"].as_str().unwrap().parse().unwrap())
            .collect()
    };
    let (status, all) = get(&f, "/v1/runs").await;
    assert_eq!(status, 200, "{all}");
    assert_eq!(ids(&all), by_id, "newest first");
    assert!(all.get("next").is_none());
    let first = &all["runs"][0];
    assert_eq!(first["module"], "web");
    assert_eq!(first["rollout"], view.id.to_string());
    assert_eq!(first["state"], "succeeded");
    assert_eq!(first["last_receipt"]["kind"], "run.succeeded");

    let (_, page) = get(&f, "/v1/runs?limit=2").await;
    assert_eq!(ids(&page), by_id[..2]);
    let next = page["next"].as_str().unwrap();
    let (_, rest) = get(&f, &format!("/v1/runs?limit=2&after={next}")).await;
    assert_eq!(ids(&rest), by_id[2..]);

    let b = nodes[1].to_string();
    let (_, on_b) = get(&f, &format!("/v1/runs?node={b}&module=web&state=succeeded")).await;
    assert_eq!(on_b["runs"].as_array().unwrap().len(), 1, "{on_b}");
    assert_eq!(on_b["runs"][0]["node"], b);
    let (_, of) = get(&f, &format!("/v1/runs?rollout={}", view.id)).await;
    assert_eq!(ids(&of).len(), 3);
    let (_, none) = get(&f, &format!("/v1/runs?rollout={}", Uuid::now_v7())).await;
    assert_eq!(ids(&none), Vec::<Uuid>::new());
    let (_, none) = get(&f, "/v1/runs?state=failed").await;
    assert_eq!(ids(&none), Vec::<Uuid>::new());

    for (uri, field) in [
        ("/v1/runs?rollout=nope", "rollout"),
        ("/v1/runs?after=nope", "after"),
        ("/v1/runs?state=sleeping", "state"),
        ("/v1/runs?node=Not_A_Node", "node"),
        ("/v1/runs?limit=0", "limit"),
        ("/v1/runs?limit=501", "limit"),
    ] {
        let (status, problem) = get(&f, uri).await;
        assert_eq!(status, 422, "{uri}: {problem}");
        assert_eq!(problem["field"], field, "{uri}: {problem}");
    }
    let (status, _) = get(&f, "/v1/runs?colour=red").await;
    assert_eq!(status, 400, "an unknown parameter");
    f.env.teardown().await.unwrap();
}

fn admin() -> Audit {
    Audit::new(
        Principal {
            id: Uuid::now_v7(),
            name: "root".to_owned(),
            role: Role::Admin,
        },
        "POST /v1/signing-keys".to_owned(),
        "/v1/signing-keys",
        Uuid::now_v7(),
    )
}

fn invalid_field(e: Error) -> String {
    match e {
        Error::Invalid { field, .. } => field,
        other => panic!("expected an invalid field, got {other}"),
    }
}

/// Issue 29, point 4: signing keys are added and removed by admins (each
/// change audited in its transaction), declared whole to every node that
/// holds artifacts (and never the controller's key, in a fleet that does not
/// trust it), and an operator's signature is kept only when it verifies
/// against one of them.
#[tokio::test]
async fn signing_keys_are_declared_to_nodes_holding_artifacts_and_signatures_verified() {
    let f = setup_with(NoRegistry {
        accepts: true,
        ..NoRegistry::default()
    })
    .await;
    let a = f.node("a");
    f.place(std::slice::from_ref(&a), 1).await;
    let (artifact, created) = f
        .delivery
        .push_artifact(b"an artifact", &audit("alice"))
        .await
        .unwrap();
    assert!(created);
    assert_eq!(artifact.signed_by, None, "the controller signed nothing");
    let digest = ArtifactDigest::parse("digest", &artifact.digest).unwrap();
    let rev = f.revision_of("run.sh", Some(digest.clone())).await;
    f.delivery
        .start_rollout(&request(rev), &audit("alice"))
        .await
        .unwrap();
    f.delivery.tick().await.unwrap();
    let section = |f: &Fixture| {
        let (pool, a) = (f.delivery.pool().clone(), a.clone());
        async move {
            mesh_delivery::SECTIONS
                .stored(&pool, &a)
                .await
                .unwrap()
                .expect("a delivery section")
        }
    };
    let first = section(&f).await;
    assert_eq!(
        first.items.artifact_keys,
        Some(vec![]),
        "no key is trusted yet, the controller's neither"
    );

    // Refused, naming the field; nothing changes.
    let alice = DeclarationSigner::from_seed([1; 32]);
    for (name, key, field) in [
        ("alice", "not hex".to_owned(), "key"),
        ("alice", "ab".repeat(31), "key"),
        ("Alice!", alice.public_key_hex(), "name"),
        ("controller", alice.public_key_hex(), "name"),
        ("ctl", f.delivery_store_controller_key(), "key"),
    ] {
        let e = f
            .delivery
            .add_signing_key(
                &NewSigningKey {
                    name: name.to_owned(),
                    key,
                },
                &admin(),
            )
            .await
            .unwrap_err();
        assert_eq!(invalid_field(e), field, "{name}");
    }
    assert!(f.delivery.signing_keys().await.unwrap().is_empty());

    // Added: declared in the next generation, in the same transaction.
    let new = NewSigningKey {
        name: "alice".to_owned(),
        key: alice.public_key_hex(),
    };
    let (view, created) = f.delivery.add_signing_key(&new, &admin()).await.unwrap();
    assert!(created);
    assert_eq!(view.added_by, "root");
    let (_, again) = f.delivery.add_signing_key(&new, &admin()).await.unwrap();
    assert!(!again, "the same key again changes nothing");
    let other = NewSigningKey {
        name: "alice".to_owned(),
        key: DeclarationSigner::from_seed([2; 32]).public_key_hex(),
    };
    assert!(matches!(
        f.delivery.add_signing_key(&other, &admin()).await,
        Err(Error::Conflict(_))
    ));
    let second = section(&f).await;
    assert_eq!(second.generation, first.generation + 1);
    let keys = second.items.artifact_keys.clone().unwrap_or_default();
    assert_eq!(keys.len(), 1);
    assert_eq!(
        (keys[0].name.as_str(), &keys[0].key),
        ("alice", &alice.public_key_hex())
    );

    // A signature is verified before the registry keeps it.
    let good = ArtifactSignature::sign(&alice, &digest);
    let upload = |s: &ArtifactSignature| NewSignature {
        key: s.key.clone(),
        signature: s.signature.clone(),
    };
    let (view, created) = f
        .delivery
        .add_signature(&digest, &upload(&good), &audit("bob"))
        .await
        .unwrap();
    assert!(created);
    assert_eq!(view.signers, ["alice"]);
    let (_, again) = f
        .delivery
        .add_signature(&digest, &upload(&good), &audit("bob"))
        .await
        .unwrap();
    assert!(!again);
    let stranger = ArtifactSignature::sign(&DeclarationSigner::from_seed([3; 32]), &digest);
    let e = f
        .delivery
        .add_signature(&digest, &upload(&stranger), &audit("bob"))
        .await
        .unwrap_err();
    assert_eq!(invalid_field(e), "key", "not a signing key");
    let other_digest = ArtifactSignature::sign(&alice, &ArtifactDigest::of(b"other"));
    let e = f
        .delivery
        .add_signature(&digest, &upload(&other_digest), &audit("bob"))
        .await
        .unwrap_err();
    assert_eq!(invalid_field(e), "signature", "signs another digest");
    assert!(matches!(
        f.delivery
            .add_signature(
                &ArtifactDigest::of(b"never pushed"),
                &upload(&good),
                &audit("bob")
            )
            .await,
        Err(Error::NotFound(_))
    ));

    // Removed: gone from the next generation.
    let removed = f
        .delivery
        .remove_signing_key("alice", &admin())
        .await
        .unwrap();
    assert_eq!(removed.key, alice.public_key_hex());
    let third = section(&f).await;
    assert_eq!(third.generation, second.generation + 1);
    assert_eq!(third.items.artifact_keys, Some(vec![]));
    assert!(matches!(
        f.delivery.remove_signing_key("alice", &admin()).await,
        Err(Error::NotFound(_))
    ));
    // Every key request that succeeded has its entry, written in its own
    // transaction: the add, the repeated add (a request too) and the remove;
    // the refused ones have none here (the auth layer writes theirs).
    let audited: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM delivery.outbox WHERE routing_key = 'delivery.operator.audit' \
         AND convert_from(payload, 'UTF8') LIKE '%/v1/signing-keys%'",
    )
    .fetch_one(f.delivery.pool())
    .await
    .unwrap();
    assert_eq!(audited, 3);
    f.env.teardown().await.unwrap();
}
