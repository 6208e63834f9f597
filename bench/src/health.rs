//! `mesh-bench health`: what observability's health and alerts cost as the
//! fleet grows, against a real PostgreSQL (a fresh test environment per
//! size). Each node runs `units` units of one module each, every unit with
//! two probes. Measured: recording one `health` report per node (batches of
//! 200, as the router hands them), an evaluation that finds every module's
//! health new (one `observability.module.health` each), a steady evaluation
//! (nothing changed: what runs every `evaluate_ms`), and one after a tenth of
//! the probes turned unhealthy (alerts raised).

use std::time::Instant;

use chrono::Utc;
use mesh_observability::{Observability, Observations, SCHEMA, Settings};
use mesh_plumbing::{Context, OutboxSignal, inbox};
use mesh_protocol::{
    Envelope, Health, Labels, ModulePlacement, NodeId, NodeLabelsChanged, ProbeResult, ProbeState,
    RecordEvent, RecordKind, Report, UnitState, UnitStatus, Units,
};
use mesh_testkit::TestEnv;
use sqlx::postgres::PgPoolOptions;

struct Row {
    nodes: usize,
    probes: usize,
    record_ms: f64,
    first_ms: f64,
    steady_ms: f64,
    failing_ms: f64,
}

fn units_report(units: usize) -> Report {
    Report::Units(Units {
        units: (0..units)
            .map(|u| UnitStatus {
                reason: None,
                oom_kills: 0,
                uid: None,
                data_bytes: None,
                revision: None,
                name: format!("m{u}"),
                module: format!("m{u}"),
                state: UnitState::Running,
                pid: Some(100),
                exit_code: None,
                restarts: 0,
                started_at: None,
            })
            .collect(),
    })
}

fn health_report(units: usize, failing: bool) -> Report {
    let now = Utc::now();
    Report::Health(Health {
        probes: (0..units)
            .flat_map(|u| {
                ["ready", "port"].into_iter().map(move |p| ProbeResult {
                    unit: format!("m{u}"),
                    module: format!("m{u}"),
                    probe: p.into(),
                    state: if failing && p == "ready" {
                        ProbeState::Unhealthy
                    } else {
                        ProbeState::Healthy
                    },
                    since: now,
                    checked_at: Some(now),
                    failures: 0,
                    detail: failing.then(|| "HTTP 503".to_owned()),
                })
            })
            .collect(),
        summary: false,
    })
}

async fn handle(obs: &Observability, batch: Vec<Envelope<Report>>) -> anyhow::Result<()> {
    let mut tx = obs.pool().begin().await?;
    let ids: Vec<_> = batch.iter().map(|e| e.id).collect();
    inbox::claim(&mut tx, SCHEMA, &ids).await?;
    obs.handle_reports(&mut tx, &batch).await?;
    tx.commit().await?;
    Ok(())
}

async fn one(nodes: usize, units: usize) -> anyhow::Result<Row> {
    let env = TestEnv::new().await?;
    let url = env.database_url(SCHEMA);
    mesh_observability::migrate(&url).await?;
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await?;
    let obs = Observability::new(pool, OutboxSignal::default(), Settings::default());
    let ids: Vec<NodeId> = (0..nodes)
        .map(|i| NodeId::parse(&format!("n{i}")))
        .collect::<Result<_, _>>()?;
    // The record: every node, and each module placed on every node.
    let mut events: Vec<RecordEvent> = ids
        .iter()
        .map(|n| {
            RecordEvent::new(RecordKind::NodeJoined(NodeLabelsChanged {
                node: n.clone(),
                labels: Labels::default(),
                version: 1,
            }))
        })
        .collect();
    let mut sorted = ids.clone();
    sorted.sort();
    for u in 0..units {
        events.push(RecordEvent::new(RecordKind::ModulePlaced(
            ModulePlacement {
                module: format!("m{u}"),
                version: 1,
                nodes: sorted.clone(),
                settings_files: Vec::new(),
                ports: Vec::new(),
                requires: Vec::new(),
                provides: Vec::new(),
            },
        )));
    }
    for chunk in events.chunks(500) {
        let mut tx = obs.pool().begin().await?;
        let refs: Vec<&RecordEvent> = chunk.iter().collect();
        obs.handle_events(&mut tx, &refs).await?;
        tx.commit().await?;
    }
    let mut seq = 1;
    let mut reports = |make: &dyn Fn(usize) -> Report, which: &dyn Fn(usize) -> bool| {
        seq += 1;
        ids.iter()
            .enumerate()
            .filter(|(i, _)| which(*i))
            .map(|(i, n)| Envelope::new(n.clone(), seq, make(i)))
            .collect::<Vec<_>>()
    };
    for chunk in reports(&|_| units_report(units), &|_| true).chunks(200) {
        handle(&obs, chunk.to_vec()).await?;
    }
    let healthy = reports(&|_| health_report(units, false), &|_| true);
    let t = Instant::now();
    for chunk in healthy.chunks(200) {
        handle(&obs, chunk.to_vec()).await?;
    }
    let record_ms = t.elapsed().as_secs_f64() * 1e3;
    let first_ms = timed(&obs).await?;
    let steady_ms = timed(&obs).await?;
    let failing = reports(&|_| health_report(units, true), &|i| i % 10 == 0);
    for chunk in failing.chunks(200) {
        handle(&obs, chunk.to_vec()).await?;
    }
    let failing_ms = timed(&obs).await?;
    env.teardown().await?;
    Ok(Row {
        nodes,
        probes: nodes * units * 2,
        record_ms,
        first_ms,
        steady_ms,
        failing_ms,
    })
}

/// One evaluation, in milliseconds.
async fn timed(obs: &Observability) -> anyhow::Result<f64> {
    let start = Instant::now();
    obs.evaluate(&Observations::default()).await?;
    Ok(start.elapsed().as_secs_f64() * 1e3)
}

/// Print the table for each fleet size.
pub async fn run(sizes: &[usize], units: usize) -> anyhow::Result<()> {
    println!(
        "{:>7} {:>9} {:>22} {:>18} {:>18} {:>22}",
        "nodes",
        "probes",
        "record health (ms)",
        "first eval (ms)",
        "steady eval (ms)",
        "eval, 10% failing (ms)"
    );
    for &n in sizes {
        let r = one(n, units).await?;
        println!(
            "{:>7} {:>9} {:>22.1} {:>18.1} {:>18.1} {:>22.1}",
            r.nodes, r.probes, r.record_ms, r.first_ms, r.steady_ms, r.failing_ms
        );
    }
    Ok(())
}
