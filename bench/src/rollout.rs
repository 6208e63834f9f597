//! `mesh-bench rollout`: what the delivery context's rollout costs as the
//! fleet grows, against a real PostgreSQL (a fresh test environment per
//! size). A module placed on every node, one revision rolled out with
//! `max_unavailable` a tenth of the fleet and no settle time; each tick is
//! timed, and after each the nodes' units reports (the new revision running)
//! are handed in in batches of 200, as the router hands them. Revisions carry
//! no artifact here: staging is the agent's pull, which this does not time.

use std::sync::Arc;
use std::time::Instant;

use mesh_delivery::{
    ArtifactStore, BoxFuture, Delivery, NewRevision, RevisionUnitSpec, RolloutRequest, SCHEMA,
    Settings,
};
use mesh_plumbing::api::{Principal, Role};
use mesh_plumbing::audit::Audit;
use mesh_plumbing::{Context, OutboxSignal, inbox};
use mesh_protocol::{
    ArtifactDigest, ArtifactSignature, Envelope, ModulePlacement, NodeId, RecordEvent, RecordKind,
    Report, UnitState, UnitStatus, Units,
};
use mesh_testkit::TestEnv;
use sqlx::postgres::PgPoolOptions;

/// Nothing is pushed in this benchmark.
struct NoRegistry;

impl ArtifactStore for NoRegistry {
    fn push<'a>(
        &'a self,
        _bytes: &'a [u8],
    ) -> BoxFuture<'a, Result<(ArtifactDigest, Option<String>), String>> {
        Box::pin(async { Err("no registry in the benchmark".to_owned()) })
    }
    fn attach_signature<'a>(
        &'a self,
        _signature: &'a ArtifactSignature,
    ) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async { Err("no registry in the benchmark".to_owned()) })
    }
    fn controller_key(&self) -> String {
        String::new()
    }
    fn controller_trusted(&self) -> bool {
        false
    }
    fn pull_location(&self) -> (String, String) {
        (String::new(), String::new())
    }
}

struct Row {
    nodes: usize,
    start_ms: f64,
    ticks: usize,
    tick_mean_ms: f64,
    tick_max_ms: f64,
    units_per_s: f64,
}

async fn one(n: usize) -> anyhow::Result<Row> {
    let env = TestEnv::new().await?;
    let url = env.database_url(SCHEMA);
    mesh_delivery::migrate(&url).await?;
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await?;
    let delivery = Delivery::new(
        pool,
        OutboxSignal::default(),
        Settings::default(),
        Arc::new(NoRegistry),
    );
    let audit = Audit::new(
        Principal {
            id: uuid::Uuid::now_v7(),
            name: "bench".into(),
            role: Role::Operator,
        },
        "POST /v1/rollouts".into(),
        "/v1/rollouts",
        uuid::Uuid::now_v7(),
    );
    let mut nodes: Vec<NodeId> = (0..n)
        .map(|i| NodeId::parse(&format!("{}-n{i:05}", env.id())))
        .collect::<Result<_, _>>()?;
    nodes.sort();
    let placed = RecordEvent::new(RecordKind::ModulePlaced(ModulePlacement {
        module: "web".into(),
        version: 1,
        nodes: nodes.clone(),
        settings_files: vec![],
        ports: vec![],
        requires: Vec::new(),
        provides: Vec::new(),
    }));
    let mut tx = delivery.pool().begin().await?;
    delivery.handle_events(&mut tx, &[&placed]).await?;
    tx.commit().await?;
    let (rev, _) = delivery
        .create_revision(
            "web",
            &NewRevision {
                artifact: None,
                unit: RevisionUnitSpec {
                    command: "/bin/web".into(),
                    args: vec![],
                    env: Default::default(),
                    working_dir: None,
                    restart: Default::default(),
                    probes: vec![],
                },
                settings_digest: None,
            },
            &audit,
        )
        .await?;
    let req: RolloutRequest = serde_json::from_value(serde_json::json!({
        "module": "web", "revision": rev.id, "max_unavailable": (n / 10).max(1), "settle_secs": 0,
    }))?;
    let started = Instant::now();
    let view = delivery.start_rollout(&req, &audit).await?;
    let start_ms = started.elapsed().as_secs_f64() * 1e3;
    let (mut ticks, mut tick_total, mut tick_max) = (0usize, 0f64, 0f64);
    let (mut reported, mut report_secs) = (0usize, 0f64);
    let mut seq = 1u64;
    loop {
        let t = Instant::now();
        delivery.tick().await?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        ticks += 1;
        tick_total += ms;
        tick_max = tick_max.max(ms);
        let v = delivery.rollout(view.id).await?;
        if v.state != "running" || ticks > 10_000 {
            anyhow::ensure!(v.state == "succeeded", "the rollout ended {}", v.state);
            break;
        }
        let deploying: Vec<Envelope<Report>> = v
            .runs
            .iter()
            .filter(|r| r.state == "deploying")
            .map(|r| {
                seq += 1;
                Ok(Envelope::new(
                    NodeId::parse(&r.node)?,
                    seq,
                    Report::Units(Units {
                        units: vec![UnitStatus {
                            reason: None,
                            oom_kills: 0,
                            uid: None,
                            data_bytes: None,
                            name: "web-0".into(),
                            module: "web".into(),
                            state: UnitState::Running,
                            pid: Some(1),
                            exit_code: None,
                            restarts: 0,
                            started_at: None,
                            revision: Some(rev.id),
                        }],
                    }),
                ))
            })
            .collect::<anyhow::Result<_>>()?;
        let t = Instant::now();
        for batch in deploying.chunks(200) {
            let mut tx = delivery.pool().begin().await?;
            let ids: Vec<_> = batch.iter().map(|e| e.id).collect();
            inbox::claim(&mut tx, SCHEMA, &ids).await?;
            delivery.handle_reports(&mut tx, batch).await?;
            tx.commit().await?;
        }
        report_secs += t.elapsed().as_secs_f64();
        reported += deploying.len();
    }
    env.teardown().await?;
    Ok(Row {
        nodes: n,
        start_ms,
        ticks,
        tick_mean_ms: tick_total / ticks as f64,
        tick_max_ms: tick_max,
        units_per_s: reported as f64 / report_secs.max(1e-9),
    })
}

/// Print the table for each fleet size.
pub async fn run(sizes: &[usize]) -> anyhow::Result<()> {
    println!(
        "{:>7} {:>18} {:>7} {:>15} {:>14} {:>20}",
        "nodes",
        "start rollout (ms)",
        "ticks",
        "tick mean (ms)",
        "tick max (ms)",
        "units reports/s"
    );
    for &n in sizes {
        let r = one(n).await?;
        println!(
            "{:>7} {:>18.1} {:>7} {:>15.1} {:>14.1} {:>20.0}",
            r.nodes, r.start_ms, r.ticks, r.tick_mean_ms, r.tick_max_ms, r.units_per_s
        );
    }
    Ok(())
}
