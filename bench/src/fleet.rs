//! `mesh-bench fleet`: the whole-system benchmark of docs/benchmarks.md.
//!
//! One run, against the machine's PostgreSQL and RabbitMQ in an isolated
//! environment (test kit) and a real release `mesh-controller` process:
//! baselines (raw broker, raw database, ideal pipeline), heartbeat ingest,
//! steady fleet, fan-out, catch-up and idle cost. Prints a table and writes it
//! as JSON. A benchmark, not a test: it fails only when the harness fails.
//!
//! Simulated nodes: the broker checks `user_id` against the connection's user,
//! so a node normally needs its own connection. Ten thousand connections (a
//! thread each in lapin) would measure the simulator, not the mesh; instead one
//! broker user with RabbitMQ's `impersonator` tag publishes for every simulated
//! node, with `user_id` = that node's id, over `--connections` connections.
//! The controller sees exactly what distinct agents would send (its identity
//! check is on `user_id`); what the broker spends on real agents' idle
//! connections is measured apart, by the real-connections phase.
//!
//! Heartbeats are sent as agents send them: transient (delivery mode 1),
//! carrying the interval the node beats at, and in the steady fleet never
//! waited for (the channels are in confirm mode, as an agent's, for its state
//! reports). Hellos stay persistent and confirmed.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, anyhow, bail, ensure};
use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueuePurgeOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection};
use mesh_e2e::sim::{metric_sum, metrics, scalar};
use mesh_e2e::{Mesh, wait_for};
use mesh_protocol::{AppliedGenerations, Envelope, Heartbeat, NodeId, Report, Section};
use serde::Serialize;
use serde_json::json;

use crate::procfs::{broker_cpu, broker_pids, cpu_secs, pids, rss_bytes};
use crate::wire::{fill_batch, settle};

pub struct Options {
    pub nodes: usize,
    pub connections: usize,
    pub steady_secs: u64,
    pub catchup_secs: u64,
    pub ingest_messages: usize,
    pub baseline_messages: usize,
    /// Real AMQP connections (own broker user each) of the real-connections phase.
    pub real_connections: usize,
    /// The controller's `liveness_write_ms` the benchmark passes.
    pub liveness_write_ms: u64,
    pub skip: Vec<Phase>,
}

/// The parts of a run that can be left out (`--skip`); the join always runs.
#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
pub enum Phase {
    Baselines,
    Ingest,
    Steady,
    Fanout,
    Idle,
    Catchup,
    /// Real AMQP connections, one per node with its own broker user, idle.
    Real,
}

impl Options {
    fn runs(&self, p: Phase) -> bool {
        !self.skip.contains(&p)
    }
}

#[derive(Serialize, Clone)]
pub struct Row {
    pub figure: String,
    pub value: f64,
    pub unit: String,
    pub baseline: Option<f64>,
    pub ratio: Option<f64>,
    pub target: String,
    pub pass: Option<bool>,
    /// Set when noise makes the measured value meaningless: what is printed
    /// instead of it (`value` is then NaN, `null` in the JSON).
    pub note: Option<String>,
}

fn row(figure: &str, value: f64, unit: &str) -> Row {
    Row {
        figure: figure.into(),
        value,
        unit: unit.into(),
        baseline: None,
        ratio: None,
        target: String::new(),
        pass: None,
        note: None,
    }
}

/// A figure taken from a difference of `delta` bytes that the measurement's
/// own drift, `noise` bytes with nothing changing, can swamp:
/// `value` (`delta` scaled) when `delta` is above the noise, else a row that
/// says "below noise" and names the noise instead of printing a figure that
/// means nothing (a negative memory per connection, say).
fn above_noise(figure: &str, delta: f64, noise: f64, value: f64, unit: &str) -> Row {
    if delta > noise {
        row(figure, value, unit)
    } else {
        Row {
            note: Some(format!(
                "below noise (changed {:.0} KiB; drift idle {:.0} KiB)",
                delta / 1024.0,
                noise / 1024.0
            )),
            ..row(figure, f64::NAN, unit)
        }
    }
}

impl Row {
    /// The ratio to a baseline; without one (skipped) the row has none.
    fn baseline(mut self, b: impl Into<Option<f64>>) -> Row {
        self.baseline = b.into();
        self.ratio = self
            .baseline
            .map(|b| if b > 0.0 { self.value / b } else { 0.0 });
        self
    }
    fn target(mut self, t: &str, pass: bool) -> Row {
        self.target = t.into();
        self.pass = Some(pass);
        self
    }
    /// A target judged against the baseline: unjudged when it was skipped.
    fn target_vs(self, t: &str, pass: impl FnOnce(f64) -> bool) -> Row {
        match self.ratio {
            Some(r) => self.target(t, pass(r)),
            None => self,
        }
    }
}

/// CPU seconds so far of the controller, the broker and every PostgreSQL process.
#[derive(Clone, Copy)]
struct Cpu {
    controller: f64,
    broker: f64,
    database: f64,
    /// This process: the simulated nodes (and the measuring).
    simulator: f64,
    at: Instant,
}

fn cpu(controller: u32) -> Cpu {
    Cpu {
        controller: cpu_secs(controller),
        broker: broker_pids().into_iter().map(cpu_secs).sum(),
        database: pids("postgres").into_iter().map(cpu_secs).sum(),
        simulator: cpu_secs(std::process::id()),
        at: Instant::now(),
    }
}

// ------------------------------------------------------------------ broker

async fn confirm_channel(url: &str) -> anyhow::Result<(Connection, Channel)> {
    let conn = Connection::connect(url, Default::default()).await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    Ok((conn, ch))
}

fn admin_http() -> anyhow::Result<reqwest::Client> {
    Ok(reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()?)
}

/// A broker user allowed to publish reports with any node's `user_id`.
async fn impersonator(mesh: &Mesh) -> anyhow::Result<String> {
    let env = &mesh.env;
    let admin = env.admin_credentials();
    let user = format!("{}-simulator", env.id());
    let password = hex_password();
    let http = admin_http()?;
    let api = &admin.rabbitmq_api;
    let vhost = urlencoding::encode(env.vhost()).into_owned();
    http.put(format!("{api}/api/users/{user}"))
        .basic_auth(&admin.rabbitmq_user, Some(admin.rabbitmq_password.expose()))
        .json(&json!({"password": password, "tags": "impersonator"}))
        .send()
        .await?
        .error_for_status()?;
    http.put(format!("{api}/api/permissions/{vhost}/{user}"))
        .basic_auth(&admin.rabbitmq_user, Some(admin.rabbitmq_password.expose()))
        .json(&json!({"configure": "^$", "write": "^reports$", "read": "^$"}))
        .send()
        .await?
        .error_for_status()?;
    let amqp = url::Url::parse(admin.amqp_url.expose())?;
    Ok(format!(
        "amqp://{user}:{password}@{}:{}/{vhost}",
        amqp.host_str().unwrap_or("127.0.0.1"),
        amqp.port().unwrap_or(5672)
    ))
}

fn hex_password() -> String {
    (0..32)
        .map(|_| format!("{:x}", rand::random::<u8>() % 16))
        .collect()
}

/// A report ready to publish: routing key, body, message id.
type Wire = (String, Vec<u8>, String);

/// Publishers for simulated nodes: confirm channels of the impersonator spread
/// over its connections. Node `i` always publishes on channel `i % channels`,
/// as an agent always uses its own channel: each channel carries at most
/// [`NODES_PER_CHANNEL`] nodes' routing keys.
struct Fleet {
    nodes: Vec<NodeId>,
    connections: Vec<Connection>,
    channels: Vec<Channel>,
    seq: AtomicU64,
    /// The interval every node beats at (the controller's plan), milliseconds:
    /// the steady fleet's pace and what each heartbeat says.
    interval_ms: AtomicU64,
}

/// RabbitMQ caches a channel's last 12 topic authorisations (routing key
/// included); an agent publishes under fewer keys than that, so a publish burst
/// of its finds them cached. A channel shared by more nodes would miss the
/// cache on every publish and measure a cost agents do not have.
const NODES_PER_CHANNEL: usize = 12;

/// Unconfirmed publishes in flight over the whole fleet during a burst.
const FLEET_WINDOW: usize = 4096;

/// The heartbeat interval when the controller states none (before its
/// heartbeat budget): agents' default, 10 s.
const DEFAULT_INTERVAL_MS: u64 = 10_000;

/// AMQP delivery mode of a report.
#[derive(Clone, Copy)]
enum Delivery {
    /// Heartbeats: lost with a broker restart, superseded by the next.
    Transient = 1,
    /// State reports (hello, applied, units).
    Persistent = 2,
}

impl Fleet {
    async fn connect(url: &str, nodes: Vec<NodeId>, connections: usize) -> anyhow::Result<Fleet> {
        let mut conns = Vec::new();
        for _ in 0..connections.max(1) {
            conns.push(Connection::connect(url, Default::default()).await?);
        }
        let mut channels = Vec::new();
        for c in 0..nodes.len().div_ceil(NODES_PER_CHANNEL).max(1) {
            let ch = conns[c % conns.len()].create_channel().await?;
            ch.confirm_select(ConfirmSelectOptions::default()).await?;
            channels.push(ch);
        }
        Ok(Fleet {
            nodes,
            connections: conns,
            channels,
            seq: AtomicU64::new(1),
            interval_ms: AtomicU64::new(DEFAULT_INTERVAL_MS),
        })
    }

    /// The channel node `i` publishes on.
    fn channel(&self, i: usize) -> &Channel {
        &self.channels[i % self.channels.len()]
    }

    /// The indexes of the nodes that publish on channel `c`.
    fn nodes_of(&self, c: usize) -> impl Iterator<Item = usize> + '_ {
        (c..self.nodes.len()).step_by(self.channels.len())
    }

    /// Each channel's share of [`FLEET_WINDOW`].
    fn window(&self) -> usize {
        (FLEET_WINDOW / self.channels.len()).max(4)
    }

    fn interval(&self) -> Duration {
        Duration::from_millis(self.interval_ms.load(Ordering::Relaxed).max(1))
    }

    /// Heartbeats per second of the whole fleet at its interval.
    fn rate(&self) -> f64 {
        self.nodes.len() as f64 / self.interval().as_secs_f64()
    }

    fn heartbeat(&self, node: &NodeId, applied: AppliedGenerations) -> Wire {
        self.heartbeat_with_seq(node, applied, self.seq.fetch_add(1, Ordering::Relaxed))
    }

    fn heartbeat_with_seq(&self, node: &NodeId, applied: AppliedGenerations, seq: u64) -> Wire {
        let env = Envelope::new(
            node.clone(),
            seq,
            Report::Heartbeat(Heartbeat {
                interval_ms: Some(self.interval_ms.load(Ordering::Relaxed)),
                applied,
            }),
        );
        (
            format!("{node}.heartbeat"),
            env.encode(),
            env.id.to_string(),
        )
    }

    /// Publish one report as `node`: state reports persistent (delivery mode
    /// 2), heartbeats transient (1), as agents do.
    async fn publish(
        ch: &Channel,
        node: &NodeId,
        key: &str,
        payload: &[u8],
        id: &str,
        mode: Delivery,
    ) -> anyhow::Result<lapin::PublisherConfirm> {
        let props = BasicProperties::default()
            .with_user_id(node.as_str().into())
            .with_message_id(id.into())
            .with_content_type("application/json".into())
            .with_delivery_mode(mode as u8);
        Ok(ch
            .basic_publish(
                "reports".into(),
                key.into(),
                BasicPublishOptions::default(),
                payload,
                props,
            )
            .await?)
    }
}

// ------------------------------------------------------------------ baselines

/// A fresh durable queue `q` for a baseline: a confirm channel to publish on
/// and a consumer (prefetch 1,000), each on its own connection.
async fn baseline_queue(
    url: &str,
    q: &str,
) -> anyhow::Result<(Connection, Channel, Connection, lapin::Consumer)> {
    let (pc, pch) = confirm_channel(url).await?;
    pch.queue_declare(
        q.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await?;
    pch.queue_purge(q.into(), QueuePurgeOptions::default())
        .await?;
    let (cc, cch) = confirm_channel(url).await?;
    cch.basic_qos(1000, BasicQosOptions::default()).await?;
    let consumer = cch
        .basic_consume(
            q.into(),
            format!("bench.{q}").as_str().into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    Ok((pc, pch, cc, consumer))
}

/// (a) persistent publish with pipelined confirms → consume with manual acks,
/// one classic durable queue, heartbeat-sized messages: the first row of
/// `broker-paths`. Messages/s.
async fn baseline_broker(mesh: &Mesh, n: usize) -> anyhow::Result<f64> {
    let m = crate::paths::measure(
        mesh,
        "bench.baseline",
        crate::paths::Path::default(),
        n,
        None,
    )
    .await?;
    Ok(m.rate)
}

async fn bench_table(mesh: &Mesh, rows: usize) -> anyhow::Result<sqlx::PgPool> {
    let pool = sqlx::PgPool::connect(&mesh.env.database_url("observability")).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS observability.bench_nodes \
         (id text PRIMARY KEY, last_seen timestamptz NOT NULL, seq bigint NOT NULL)",
    )
    .execute(&pool)
    .await?;
    let ids: Vec<String> = (0..rows).map(|i| format!("node-{i}")).collect();
    sqlx::query(
        "INSERT INTO observability.bench_nodes SELECT u, now(), 0 FROM UNNEST($1::text[]) u \
         ON CONFLICT DO NOTHING",
    )
    .bind(&ids)
    .execute(&pool)
    .await?;
    Ok(pool)
}

async fn upsert(pool: &sqlx::PgPool, ids: &[String], seqs: &[i64]) -> anyhow::Result<()> {
    let mut tx = pool.begin().await?;
    sqlx::query(
        "INSERT INTO observability.bench_nodes AS n (id, last_seen, seq) \
         SELECT u.id, now(), u.seq FROM UNNEST($1::text[], $2::bigint[]) AS u(id, seq) \
         ON CONFLICT (id) DO UPDATE SET last_seen = excluded.last_seen, \
         seq = greatest(n.seq, excluded.seq)",
    )
    .bind(ids)
    .bind(seqs)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}

/// (b) batched UPSERTs (200 distinct rows per transaction, UNNEST) of the rows a
/// heartbeat updates, one connection. Rows/s.
async fn baseline_database(mesh: &Mesh, nodes: usize, n: usize) -> anyhow::Result<f64> {
    let pool = bench_table(mesh, nodes).await?;
    let start = Instant::now();
    let mut done = 0;
    let mut k = 0usize;
    // Rows in one statement must be distinct: a fleet smaller than 200 gives
    // smaller statements.
    let per = nodes.clamp(1, 200);
    while done < n {
        let ids: Vec<String> = (0..per)
            .map(|j| format!("node-{}", (k + j) % nodes))
            .collect();
        let seqs: Vec<i64> = (0..per).map(|j| (k + j) as i64).collect();
        k += per;
        upsert(&pool, &ids, &seqs).await?;
        done += per;
    }
    let rate = done as f64 / start.elapsed().as_secs_f64();
    pool.close().await;
    Ok(rate)
}

/// (c) the ideal pipeline: a publisher as in (a) while a consumer takes batches
/// of at most 200 (waiting at most 20 ms), UPSERTs them (no routing, no inbox,
/// no outbox), commits, then acks the batch with `multiple`. Messages/s.
///
/// With `pace` (messages/s) the publisher sends at that rate instead of as fast
/// as confirms come back: the floor of the steady fleet. Also returns the CPU
/// the broker and the database spent meanwhile (read before the consumer's
/// connections close: a closed backend's CPU leaves the count).
async fn baseline_pipeline(
    mesh: &Mesh,
    nodes: usize,
    n: usize,
    pace: Option<f64>,
) -> anyhow::Result<(f64, Spent)> {
    let pool = bench_table(mesh, nodes).await?;
    let url = mesh.env.admin_amqp_url();
    let q = "bench.pipeline";
    let (pc, pch, cc, consumer) = baseline_queue(&url, q).await?;
    let c0 = cpu(std::process::id());
    let start = Instant::now();
    let consume = ideal_consumer(consumer, pool, nodes, n, Default::default());
    let node = NodeId::parse("t00000000-n1").unwrap_or_else(|_| unreachable!("valid id"));
    let mut confirms = Vec::new();
    for i in 0..n {
        if let Some(rate) = pace {
            tokio::time::sleep_until((start + Duration::from_secs_f64(i as f64 / rate)).into())
                .await;
        }
        let env = Envelope::new(
            node.clone(),
            i as u64,
            Report::Heartbeat(Heartbeat {
                interval_ms: Some(10_000),
                applied: [(Section::Config, 3)].into(),
            }),
        );
        confirms.push(
            pch.basic_publish(
                "".into(),
                q.into(),
                BasicPublishOptions::default(),
                &env.encode(),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await?,
        );
        if confirms.len() >= 1000 {
            settle(&mut confirms).await?;
        }
    }
    settle(&mut confirms).await?;
    let pool = consume.await??;
    let rate = n as f64 / start.elapsed().as_secs_f64();
    let spent = Spent::between(&c0, &cpu(std::process::id()));
    pool.close().await;
    let _ = pch.queue_delete(q.into(), Default::default()).await;
    let _ = pc.close(200, "done".into()).await;
    let _ = cc.close(200, "done".into()).await;
    Ok((rate, spent))
}

/// The ideal pipeline's consumer: batches of at most 200 (waiting at most
/// 20 ms), decoded, UPSERTed (no routing, no inbox, no outbox), committed, then
/// acked with `multiple`; counts what it committed in `committed`. Returns the
/// pool when `n` messages are done, so the caller reads the database's CPU
/// before its backends exit.
fn ideal_consumer(
    mut consumer: lapin::Consumer,
    pool: sqlx::PgPool,
    nodes: usize,
    n: usize,
    committed: Arc<AtomicU64>,
) -> tokio::task::JoinHandle<anyhow::Result<sqlx::PgPool>> {
    tokio::spawn(async move {
        let mut got = 0;
        while got < n {
            let first = consumer
                .next()
                .await
                .ok_or_else(|| anyhow!("consumer ended"))??;
            let batch = fill_batch(first, &mut consumer).await?;
            let mut rows: BTreeMap<String, i64> = BTreeMap::new();
            for d in &batch {
                let env = Envelope::<Report>::decode(&d.data, mesh_protocol::MAX_REPORT_BYTES)?;
                let e = rows
                    .entry(format!("node-{}", env.seq as usize % nodes))
                    .or_insert(0);
                *e = (*e).max(env.seq as i64);
            }
            let (ids, seqs): (Vec<String>, Vec<i64>) = rows.into_iter().unzip();
            upsert(&pool, &ids, &seqs).await?;
            got += batch.len();
            if let Some(last) = batch.last() {
                last.acker.ack(BasicAckOptions { multiple: true }).await?;
            }
            committed.fetch_add(batch.len() as u64, Ordering::Relaxed);
        }
        anyhow::Ok(pool)
    })
}

/// Broker and database CPU between two readings, % of one core.
struct Spent {
    broker: f64,
    database: f64,
}

impl Spent {
    fn between(a: &Cpu, b: &Cpu) -> Spent {
        let secs = b.at.duration_since(a.at).as_secs_f64().max(1e-9);
        Spent {
            broker: (b.broker - a.broker) / secs * 100.0,
            database: (b.database - a.database) / secs * 100.0,
        }
    }
}

// ------------------------------------------------------------------ the mesh

async fn handled_heartbeats(mesh: &Mesh) -> anyhow::Result<u64> {
    let text = metrics(mesh).await?;
    Ok(metric_sum(
        &text,
        "mesh_controller_messages_handled_total",
        "reports.heartbeat",
    ) as u64)
}

/// The controller with benchmark settings: production defaults (heartbeat
/// budget and floor, grace, 2 s sweeps, 30 s re-send), info logging, and
/// `liveness_write_ms` as given. Returns the write interval in effect: `None`
/// when the controller does not know the setting (it predates batched
/// liveness and writes last_seen on every heartbeat); it is then left out.
async fn restart_controller(mesh: &mut Mesh, write_ms: u64) -> anyhow::Result<Option<u64>> {
    mesh.kill_controller();
    let dir = mesh.dir.path().to_owned();
    let path = dir.join("controller.toml");
    let mut base = format!(
        "credentials = {:?}\napi_listen = \"127.0.0.1:{}\"\nshutdown_deadline_secs = 3\n",
        dir.join("credentials.toml"),
        mesh.api_port()
    );
    // The simulated nodes state `role=sim` and the benchmark selects by it:
    // trusted, as the harness does (decision 0047), by a controller that
    // knows the setting (an older one trusted every stated label).
    std::fs::write(&path, format!("{base}{}", mesh_e2e::HARNESS_TRUST))?;
    let knows_trust = std::process::Command::new(mesh_e2e::bin("mesh-controller")?)
        .arg("--config")
        .arg(&path)
        .arg("migrate")
        .output()?
        .status
        .success();
    if knows_trust {
        base.push_str(mesh_e2e::HARNESS_TRUST);
    }
    std::fs::write(&path, format!("{base}liveness_write_ms = {write_ms}\n"))?;
    // `migrate` loads the settings as `run` does, and is idempotent.
    let check = std::process::Command::new(mesh_e2e::bin("mesh-controller")?)
        .arg("--config")
        .arg(&path)
        .arg("migrate")
        .output()?;
    let in_effect = if check.status.success() {
        Some(write_ms)
    } else {
        let err = String::from_utf8_lossy(&check.stderr);
        ensure!(
            err.contains("liveness_write_ms"),
            "mesh-controller refused its settings: {err}"
        );
        eprintln!(
            "warning: this mesh-controller has no `liveness_write_ms` (it writes last_seen \
             on every heartbeat); running without it"
        );
        std::fs::write(&path, base)?;
        None
    };
    mesh.start_controller(&[("RUST_LOG", "info")]).await?;
    Ok(in_effect)
}

/// The controller's heartbeat plan, from `GET /v1/nodes` (`heartbeat`);
/// `None` from a controller without a heartbeat budget.
#[derive(Clone, Copy, Debug, Default)]
struct Plan {
    interval_ms: u64,
    grace_ms: Option<u64>,
    detection_ms: Option<u64>,
    floor_ms: Option<u64>,
    budget_per_sec: Option<f64>,
    nodes: Option<u64>,
}

async fn heartbeat_plan(mesh: &Mesh) -> anyhow::Result<Option<Plan>> {
    let (status, body) = mesh.get("/v1/nodes?limit=1").await?;
    ensure!(status == 200, "GET /v1/nodes: {status} {body}");
    let Some(h) = body.get("heartbeat").filter(|h| h.is_object()) else {
        return Ok(None);
    };
    let u = |k: &str| h.get(k).and_then(serde_json::Value::as_u64);
    Ok(Some(Plan {
        interval_ms: u("interval_ms").context("heartbeat.interval_ms")?,
        grace_ms: u("grace_ms"),
        detection_ms: u("detection_ms"),
        floor_ms: u("floor_ms"),
        budget_per_sec: h.get("budget_per_sec").and_then(serde_json::Value::as_f64),
        nodes: u("nodes"),
    }))
}

/// The interval the controller will give a fleet of `nodes`, known before it
/// joins: the floor, stretched so that the fleet stays within the budget.
fn planned_interval_ms(plan: Option<Plan>, nodes: usize) -> u64 {
    match plan {
        Some(Plan {
            floor_ms: Some(floor),
            budget_per_sec: Some(budget),
            ..
        }) if budget > 0.0 => floor.max((nodes as f64 * 1000.0 / budget).ceil() as u64),
        Some(p) => p.interval_ms,
        None => DEFAULT_INTERVAL_MS,
    }
}

fn controller_pid(mesh: &mut Mesh) -> anyhow::Result<u32> {
    Ok(mesh.controller().context("controller running")?.pid())
}

/// Every node says hello (labels `role=sim`, persistent, confirmed); waits
/// until every hello is handled (inventory and config know every node) and the
/// join's declarations are confirmed: every node has a config declaration
/// marked sent (a file is declared to `role=sim` before the join) and no
/// outbox row is left unsent. What is measured next does not carry the join's
/// tail.
async fn join(mesh: &Mesh, fleet: &Fleet) -> anyhow::Result<Duration> {
    let start = Instant::now();
    let window = fleet.window();
    let mut tasks = Vec::new();
    for (c, ch) in fleet.channels.iter().enumerate() {
        let ch = ch.clone();
        let nodes: Vec<NodeId> = fleet.nodes_of(c).map(|i| fleet.nodes[i].clone()).collect();
        tasks.push(tokio::spawn(async move {
            let mut confirms = Vec::new();
            for node in nodes {
                let env = mesh_e2e::hello(node.as_str(), &[("role", "sim")]);
                confirms.push(
                    Fleet::publish(
                        &ch,
                        &node,
                        &format!("{node}.hello"),
                        &env.encode(),
                        &env.id.to_string(),
                        Delivery::Persistent,
                    )
                    .await?,
                );
                if confirms.len() >= window {
                    settle(&mut confirms).await?;
                }
            }
            settle(&mut confirms).await
        }));
    }
    for t in tasks {
        t.await??;
    }
    let n = fleet.nodes.len() as i64;
    wait_for("every hello handled", Duration::from_secs(900), || async {
        let config = scalar(&mesh.env, "config", "SELECT count(*) FROM config.nodes").await?;
        let inventory = scalar(
            &mesh.env,
            "inventory",
            "SELECT count(*) FROM inventory.nodes",
        )
        .await?;
        Ok((config >= n && inventory >= n).then_some(()))
    })
    .await?;
    wait_for(
        "every declaration of the join confirmed",
        Duration::from_secs(900),
        || async {
            let declared = scalar(
                &mesh.env,
                "config",
                "SELECT count(DISTINCT node) FROM config.outbox \
                 WHERE exchange = 'declarations' AND sent_at IS NOT NULL",
            )
            .await?;
            Ok((declared >= n && unsent(mesh).await? == 0).then_some(()))
        },
    )
    .await?;
    Ok(start.elapsed())
}

fn heartbeat_queue() -> String {
    mesh_protocol::topology::report_queue(mesh_protocol::ReportKind::Heartbeat)
}

/// Heartbeats ready in the controller's heartbeat queue.
async fn heartbeat_depth(mesh: &Mesh) -> anyhow::Result<u32> {
    mesh_e2e::sim::queue_depth(&mesh.env, &heartbeat_queue()).await
}

/// Outbox rows not yet confirmed by the broker, in config's and inventory's.
async fn unsent(mesh: &Mesh) -> anyhow::Result<i64> {
    let mut n = 0;
    for context in ["config", "inventory", "connectivity"] {
        let sql = format!("SELECT count(*) FROM {context}.outbox WHERE sent_at IS NULL");
        n += scalar(&mesh.env, context, &sql).await?;
    }
    Ok(n)
}

/// Who commits the heartbeats of an ingest, and where that is counted.
enum Committer {
    /// The controller: its `mesh_controller_messages_handled_total`.
    Controller,
    /// The ideal consumer of (c′), in this process.
    Ideal(Arc<AtomicU64>),
}

impl Committer {
    async fn committed(&self, mesh: &Mesh) -> anyhow::Result<u64> {
        match self {
            Committer::Controller => handled_heartbeats(mesh).await,
            Committer::Ideal(n) => Ok(n.load(Ordering::Relaxed)),
        }
    }
}

/// Heartbeats an ingest of `total` publishes: whole rounds over the channels.
fn ingest_size(fleet: &Fleet, total: usize) -> usize {
    total.div_ceil(fleet.channels.len()) * fleet.channels.len()
}

/// Heartbeat ingest: `total` heartbeats (transient, as agents send them) as
/// fast as the broker confirms them — the confirm window ([`Fleet::window`]
/// per channel) is only the pacing, agents do not wait for heartbeats' confirms;
/// committed/s and publish-to-commit latency (the k-th heartbeat published is
/// the k-th committed: one FIFO queue, one consumer). Each heartbeat reports
/// the generations declared to its node (`applied`), as an agent that applied
/// them does: a node reporting less is behind and is sent its sections again,
/// which would measure re-sending, not heartbeats.
async fn ingest(
    mesh: &Mesh,
    fleet: &Fleet,
    total: usize,
    applied: &BTreeMap<NodeId, AppliedGenerations>,
    by: &Committer,
) -> anyhow::Result<(f64, f64, f64)> {
    let before = by.committed(mesh).await?;
    let published: Arc<std::sync::Mutex<Vec<Instant>>> =
        Arc::new(std::sync::Mutex::new(Vec::with_capacity(total)));
    let per = total.div_ceil(fleet.channels.len());
    let window = fleet.window();
    let start = Instant::now();
    let mut tasks = Vec::new();
    for (c, ch) in fleet.channels.iter().enumerate() {
        let ch = ch.clone();
        let own: Vec<usize> = fleet.nodes_of(c).collect();
        let msgs: Vec<(NodeId, Wire)> = (0..per)
            .map(|i| {
                let node = fleet.nodes[own[i % own.len()]].clone();
                let hb = fleet.heartbeat(&node, applied.get(&node).cloned().unwrap_or_default());
                (node, hb)
            })
            .collect();
        let published = published.clone();
        tasks.push(tokio::spawn(async move {
            let mut confirms = Vec::new();
            for (node, (key, payload, id)) in msgs {
                confirms.push(
                    Fleet::publish(&ch, &node, &key, &payload, &id, Delivery::Transient).await?,
                );
                if let Ok(mut p) = published.lock() {
                    p.push(Instant::now());
                }
                if confirms.len() >= window {
                    settle(&mut confirms).await?;
                }
            }
            settle(&mut confirms).await
        }));
    }
    // Commit times, polled from the committer's counter.
    let sent = ingest_size(fleet, total);
    let mut commits: Vec<(u64, Instant)> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let h = by.committed(mesh).await?.saturating_sub(before);
        commits.push((h, Instant::now()));
        if h >= sent as u64 {
            break;
        }
        if Instant::now() > deadline {
            bail!("ingest: only {h} of {sent} heartbeats committed after 600 s");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for t in tasks {
        t.await??;
    }
    let elapsed = commits
        .last()
        .map(|(_, t)| t.duration_since(start))
        .unwrap_or_default();
    let rate = sent as f64 / elapsed.as_secs_f64();
    let mut published = published.lock().map_err(|_| anyhow!("poisoned"))?.clone();
    published.sort();
    let mut lat = Vec::with_capacity(published.len());
    let mut j = 0;
    for (k, p) in published.iter().enumerate() {
        while j < commits.len() && commits[j].0 < k as u64 + 1 {
            j += 1;
        }
        if let Some((_, t)) = commits.get(j) {
            lat.push(t.duration_since(*p).as_secs_f64() * 1000.0);
        }
    }
    lat.sort_by(|a, b| a.total_cmp(b));
    let pct = |q: f64| {
        lat.get(((lat.len() as f64 * q) as usize).min(lat.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0.0)
    };
    Ok((rate, pct(0.5), pct(0.99)))
}

/// A running steady heartbeat: its stop token and its task.
type Beat = (
    tokio_util_token::Token,
    tokio::task::JoinHandle<anyhow::Result<u64>>,
);

/// Steady heartbeats: every node once per the fleet's interval, spread
/// evenly, for as long as `stop` is not set. Transient, and no confirm is
/// waited for, as agents send them: the channels are in confirm mode (an
/// agent's also carries its state reports), so the broker confirms each, and a
/// confirm's handle is dropped once it is surely settled (lapin keeps a handle
/// dropped unsettled until `wait_for_confirms`). Returns heartbeats published.
fn steady(
    fleet: Arc<Fleet>,
    applied: Arc<BTreeMap<NodeId, AppliedGenerations>>,
    stop: tokio_util_token::Token,
) -> tokio::task::JoinHandle<anyhow::Result<u64>> {
    tokio::spawn(async move {
        let n = fleet.nodes.len();
        let tick = fleet.interval().as_secs_f64() / n as f64;
        // Ticks of 10 ms, each publishing the nodes whose slot fell in it.
        let mut timer = tokio::time::interval(Duration::from_millis(10));
        timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        let start = Instant::now();
        let mut next = 0usize;
        let mut pending: VecDeque<(Instant, lapin::PublisherConfirm)> = VecDeque::new();
        let mut sent = 0u64;
        while !stop.is_stopped() {
            timer.tick().await;
            let due = (start.elapsed().as_secs_f64() / tick) as usize;
            while next < due {
                let node = &fleet.nodes[next % n];
                let a = applied.get(node).cloned().unwrap_or_default();
                let (key, payload, id) = fleet.heartbeat(node, a);
                let ch = fleet.channel(next % n);
                let c = Fleet::publish(ch, node, &key, &payload, &id, Delivery::Transient).await?;
                pending.push_back((Instant::now(), c));
                next += 1;
                sent += 1;
            }
            while pending
                .front()
                .is_some_and(|(at, _)| at.elapsed() > Duration::from_secs(5))
            {
                pending.pop_front();
            }
        }
        Ok(sent)
    })
}

/// A tiny stop flag (no extra dependency).
mod tokio_util_token {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[derive(Clone, Default)]
    pub struct Token(Arc<AtomicBool>);

    impl Token {
        pub fn stop(&self) {
            self.0.store(true, Ordering::Relaxed);
        }
        pub fn is_stopped(&self) -> bool {
            self.0.load(Ordering::Relaxed)
        }
    }
}

/// Heartbeat-to-last_seen latency: probe heartbeats (sequence numbers far above
/// the fleet's, transient, never waited for), `every` apart for sample nodes,
/// each until `inventory.nodes.last_seq` shows it. One query for every probe
/// outstanding, every 20 ms: with liveness written in batches a probe waits up
/// to the write interval, so probes overlap. Milliseconds, one per probe (a
/// probe not seen within 60 s counts 60 s).
async fn probe_latencies(
    mesh: &Mesh,
    fleet: &Fleet,
    applied: &BTreeMap<NodeId, AppliedGenerations>,
    probes: usize,
    every: Duration,
) -> anyhow::Result<Vec<f64>> {
    let pool = sqlx::PgPool::connect(&mesh.env.database_url("inventory")).await?;
    let mut out = Vec::with_capacity(probes);
    // Outstanding probes: node, sequence number, when sent.
    let mut waiting: Vec<(String, i64, Instant)> = Vec::new();
    let start = Instant::now();
    let mut sent = 0;
    let mut pending = Vec::new();
    let mut poll = tokio::time::interval(Duration::from_millis(20));
    poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while sent < probes || !waiting.is_empty() {
        poll.tick().await;
        if sent < probes && start.elapsed() >= every * (sent as u32 + 1) {
            let k = (sent * 7919) % fleet.nodes.len();
            let (node, ch) = (&fleet.nodes[k], fleet.channel(k));
            let seq = 1_000_000_000 + sent as u64;
            // What the node applied, as its steady heartbeats say: a probe
            // reporting nothing would look behind and be re-sent its sections.
            let (key, payload, id) =
                fleet.heartbeat_with_seq(node, applied.get(node).cloned().unwrap_or_default(), seq);
            let at = Instant::now();
            pending.push(Fleet::publish(ch, node, &key, &payload, &id, Delivery::Transient).await?);
            waiting.push((node.to_string(), seq as i64, at));
            sent += 1;
        }
        if waiting.is_empty() {
            continue;
        }
        let ids: Vec<&str> = waiting.iter().map(|(n, _, _)| n.as_str()).collect();
        let seen: Vec<(String, i64)> =
            sqlx::query_as("SELECT id, last_seq FROM inventory.nodes WHERE id = ANY($1)")
                .bind(&ids)
                .fetch_all(&pool)
                .await?;
        let seen: BTreeMap<String, i64> = seen.into_iter().collect();
        waiting.retain(|(node, seq, at)| {
            if seen.get(node).is_some_and(|s| s >= seq) {
                out.push(at.elapsed().as_secs_f64() * 1000.0);
                false
            } else if at.elapsed() > Duration::from_secs(60) {
                out.push(60_000.0);
                false
            } else {
                true
            }
        });
    }
    drop(pending);
    pool.close().await;
    Ok(out)
}

fn percentile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(((v.len() as f64 * q) as usize).min(v.len().saturating_sub(1)))
        .copied()
        .unwrap_or(0.0)
}

/// Outbox rows the controller's relay published so far (declarations, events).
async fn outbox_published(mesh: &Mesh) -> anyhow::Result<f64> {
    Ok(metric_sum(
        &metrics(mesh).await?,
        "mesh_controller_outbox_published_total",
        "",
    ))
}

/// Messages through the broker on the vhost so far, counted where each passes
/// the controller: every report it consumed (handled or dead-lettered) and every
/// message its relay published. Nothing else publishes on the vhost. (The
/// management API's counters are updated once per statistics interval, 30 s on
/// a broker set up by `bundle/up`: too coarse for a minute's window.)
async fn vhost_published(mesh: &Mesh) -> anyhow::Result<u64> {
    let text = metrics(mesh).await?;
    let reports = metric_sum(
        &text,
        "mesh_controller_messages_handled_total",
        "queue=\"reports.",
    );
    let dead = metric_sum(&text, "mesh_controller_dead_lettered_total", "");
    let published = metric_sum(&text, "mesh_controller_outbox_published_total", "");
    Ok((reports + dead + published) as u64)
}

/// What each node has been declared, as a node that applied everything reports it.
async fn declared_generations(mesh: &Mesh) -> anyhow::Result<BTreeMap<NodeId, AppliedGenerations>> {
    let mut out: BTreeMap<NodeId, AppliedGenerations> = BTreeMap::new();
    // Every context that declares a section keeps `<context>.sections` in
    // plumbing's one shape, named as its section: a new section is stated
    // here without a change (issue 33: the fleet once stated two of five and
    // every steady heartbeat took the durable path unnoticed).
    for section in Section::ALL {
        let context = section.as_str();
        let pool = sqlx::PgPool::connect(&mesh.env.database_url(context)).await?;
        let sql = format!("SELECT node, generation FROM {context}.sections");
        let rows: Vec<(String, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .fetch_all(&pool)
            .await?;
        pool.close().await;
        for (node, g) in rows {
            if let Ok(node) = NodeId::parse(&node) {
                out.entry(node)
                    .or_default()
                    .insert(section, g.max(0) as u64);
            }
        }
    }
    Ok(out)
}

async fn put_files(
    mesh: &Mesh,
    count: usize,
    tag: &str,
    selector: (&str, &str),
) -> anyhow::Result<()> {
    for i in 0..count {
        let (status, body) = mesh
            .put(
                &format!("/v1/files/{tag}-{i}"),
                &json!({"path": format!("/etc/mesh-bench/{tag}-{i}"), "content": format!("{tag} {i}"), "mode": "0644", "selector": {selector.0: selector.1}}),
            )
            .await?;
        ensure!(status < 300, "PUT file: {status} {body}");
    }
    Ok(())
}

/// Modules `names` (`idle-<i>`), each a replica on every node labelled
/// group=many (`replicas` of them).
async fn put_modules(
    mesh: &Mesh,
    names: std::ops::Range<usize>,
    replicas: usize,
) -> anyhow::Result<()> {
    for i in names {
        let spec = json!({
            "unit": {"command": "sleep", "args": ["1000000"]},
            "placement": {"match_labels": {"labels": {"group": "many"}, "replicas": replicas}}
        });
        let (status, _, body) = mesh
            .request(
                reqwest::Method::PUT,
                &format!("/v1/modules/idle{i}"),
                &[], // a new module: no If-Match
                Some(&spec),
            )
            .await?;
        ensure!(status < 300, "PUT module: {status} {body}");
    }
    Ok(())
}

/// Declarations sent to `nodes` (both contexts' outboxes) so far.
async fn sent_to(mesh: &Mesh, nodes: &[NodeId]) -> anyhow::Result<i64> {
    let ids: Vec<&str> = nodes.iter().map(|n| n.as_str()).collect();
    let mut total = 0;
    for context in ["config", "inventory"] {
        let pool = sqlx::PgPool::connect(&mesh.env.database_url(context)).await?;
        let sql = format!(
            "SELECT count(*) FROM {context}.outbox WHERE exchange = 'declarations' \
             AND sent_at IS NOT NULL AND node = ANY($1)"
        );
        let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .bind(&ids)
            .fetch_one(&pool)
            .await?;
        pool.close().await;
        total += n;
    }
    Ok(total)
}

/// Once what was declared is out and applied (the simulated nodes report every
/// generation declared to them, as agents that applied it do): messages per
/// minute of each node in `group` over 30 s of steady heartbeats, counting its
/// heartbeats and the declarations sent to it.
/// `beat` is the steady heartbeat running now; it is replaced by one reporting
/// the settled generations, which is returned still running.
async fn idle_cost(
    mesh: &Mesh,
    fleet: &Arc<Fleet>,
    group: &[NodeId],
    beat: Beat,
) -> anyhow::Result<(f64, Beat)> {
    // Placement declares over several sweeps (2 s apart): what was declared is
    // settled when every node is alive (placement pauses otherwise), the
    // outboxes are empty and the declared generations did not change over three
    // sweeps.
    let applied = Arc::new(settled_generations(mesh, Duration::from_secs(6), true).await?);
    let stop = tokio_util_token::Token::default();
    let next = steady(fleet.clone(), applied, stop.clone());
    beat.0.stop();
    beat.1.await??;
    tokio::time::sleep(Duration::from_secs(15)).await; // past any re-send window
    let h0 = handled_heartbeats(mesh).await?;
    let d0 = sent_to(mesh, group).await?;
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(30)).await;
    let h1 = handled_heartbeats(mesh).await?;
    let d1 = sent_to(mesh, group).await?;
    let mins = t0.elapsed().as_secs_f64() / 60.0;
    let heartbeats = (h1 - h0) as f64 / fleet.nodes.len() as f64 / mins;
    let declarations = (d1 - d0) as f64 / group.len() as f64 / mins;
    Ok((heartbeats + declarations, (stop, next)))
}

/// What every node has been declared, once that stops changing: the outboxes
/// are empty and the declared generations are the same `every` apart (and, with
/// `all_alive`, every node is alive: placement pauses otherwise). What agents
/// that applied everything report.
async fn settled_generations(
    mesh: &Mesh,
    every: Duration,
    all_alive: bool,
) -> anyhow::Result<BTreeMap<NodeId, AppliedGenerations>> {
    let last = std::cell::RefCell::new(declared_generations(mesh).await?);
    wait_for(
        "declarations to settle",
        Duration::from_secs(900),
        || async {
            tokio::time::sleep(every).await;
            let unsent = unsent(mesh).await?;
            let not_alive = if all_alive {
                scalar(
                    &mesh.env,
                    "inventory",
                    "SELECT count(*) FROM inventory.nodes WHERE state <> 'alive'",
                )
                .await?
            } else {
                0
            };
            let now = declared_generations(mesh).await?;
            let settled = unsent == 0 && not_alive == 0 && now == *last.borrow();
            Ok(if settled {
                Some(now)
            } else {
                last.replace(now);
                None
            })
        },
    )
    .await
}

async fn sent_declarations(mesh: &Mesh, after_id: i64) -> anyhow::Result<(i64, i64)> {
    let pool = sqlx::PgPool::connect(&mesh.env.database_url("config")).await?;
    let r: (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(sent_at) FROM config.outbox WHERE id > $1 AND exchange = 'declarations'",
    )
    .bind(after_id)
    .fetch_one(&pool)
    .await?;
    pool.close().await;
    Ok(r)
}

pub async fn run(o: Options) -> anyhow::Result<Vec<Row>> {
    let mut rows = Vec::new();
    let mut mesh = Mesh::start().await?;
    let result = run_in(&mut mesh, &o, &mut rows).await;
    let teardown = mesh.teardown().await;
    result?;
    if let Err(e) = teardown {
        // The figures stand; say what is left behind.
        eprintln!("warning: {e:#}");
    }
    Ok(rows)
}

/// Rows as they are measured: kept, and shown at once (a run that fails late
/// still shows what it measured).
struct Rows<'a>(&'a mut Vec<Row>);

impl Rows<'_> {
    fn push(&mut self, r: Row) {
        let value = match &r.note {
            Some(note) => note.clone(),
            None => format!("{:.2}", r.value),
        };
        eprintln!(
            "  {}: {value} {} {}",
            r.figure,
            r.unit,
            r.ratio
                .map(|x| format!("(ratio {x:.2})"))
                .unwrap_or_default()
        );
        self.0.push(r);
    }
}

async fn run_in(mesh: &mut Mesh, o: &Options, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let mut rows = Rows(rows);
    // Without autovacuum the heartbeat tables bloat for the whole run and the
    // figures measure that (database CPU doubled in the steady fleet, measured).
    let autovacuum = scalar(
        &mesh.env,
        "inventory",
        "SELECT (current_setting('autovacuum') = 'on')::int::bigint",
    )
    .await?;
    ensure!(
        autovacuum == 1,
        "PostgreSQL's autovacuum is off: the figures would measure table bloat; \
         `bash bundle/up` turns it on (ALTER SYSTEM SET autovacuum = on; SELECT pg_reload_conf())"
    );
    let write_ms = restart_controller(mesh, o.liveness_write_ms).await?;
    // The interval the controller will give the fleet, known before it joins
    // (its budget and floor): the pace of the baselines' steady rates.
    let planned_ms = planned_interval_ms(heartbeat_plan(mesh).await?, o.nodes);
    let base = if o.runs(Phase::Baselines) {
        baselines(mesh, o, planned_ms, &mut rows).await?
    } else {
        Baselines::default()
    };
    let c = base.pipeline;
    if o.runs(Phase::Real) {
        real_phase(mesh, o, &mut rows).await?;
    }

    let url = impersonator(mesh).await?;
    let nodes: Vec<NodeId> = (0..o.nodes)
        .map(|i| NodeId::parse(&format!("{}-n{i}", mesh.env.id())))
        .collect::<Result<_, _>>()?;
    let fleet = Arc::new(Fleet::connect(&url, nodes, o.connections).await?);
    fleet.interval_ms.store(planned_ms, Ordering::Relaxed);
    eprintln!(
        "simulated fleet of {} nodes over {} channels on {} connections…",
        o.nodes,
        fleet.channels.len(),
        fleet.connections.len()
    );
    // A declared file for every node first, so that joining declares config.
    put_files(mesh, 1, "base", ("role", "sim")).await?;
    let joined = join(mesh, &fleet).await?.as_secs_f64();
    rows.push(
        row(
            "join: every hello handled and its declarations confirmed",
            joined,
            "s",
        )
        .target("< 15 s", joined < 15.0),
    );
    // The joined fleet's plan: every node beats at its interval from here on.
    match heartbeat_plan(mesh).await? {
        Some(plan) => {
            fleet.interval_ms.store(plan.interval_ms, Ordering::Relaxed);
            rows.push(row(
                &format!(
                    "heartbeat interval for {} nodes (GET /v1/nodes heartbeat.interval_ms)",
                    plan.nodes.unwrap_or(o.nodes as u64)
                ),
                plan.interval_ms as f64 / 1000.0,
                "s",
            ));
            if let Some(d) = plan.detection_ms {
                rows.push(row(
                    "detection time the budget gives (heartbeat.detection_ms)",
                    d as f64 / 1000.0,
                    "s",
                ));
            }
            if let Some(g) = plan.grace_ms {
                rows.push(row("grace (heartbeat.grace_ms)", g as f64 / 1000.0, "s"));
            }
        }
        None => eprintln!(
            "warning: GET /v1/nodes states no heartbeat plan (a controller without a \
             heartbeat budget): nodes beat at {DEFAULT_INTERVAL_MS} ms"
        ),
    }

    let ingested = if o.runs(Phase::Ingest) {
        Some(ingest_phase(mesh, &fleet, o, c, &mut rows).await?)
    } else {
        None
    };
    let pid = controller_pid(mesh)?;

    // Steady heartbeats from every node from here on: measured in the steady
    // phase, and the background of fan-out, idle cost and catch-up.
    // (Without the ingest before it, the join's last record events may still
    // be changing sections: wait until they are settled.)
    let applied = Arc::new(settled_generations(mesh, Duration::from_secs(3), false).await?);
    let stop = tokio_util_token::Token::default();
    let beat = steady(fleet.clone(), applied.clone(), stop.clone());
    // Warm up for one whole interval and then some: a node's first heartbeat
    // since the controller started takes the durable path by design (it is
    // not known alive in memory yet), and with a 5 s warm-up half the fleet's
    // first beats fell inside the steady window (23 % of it at 500 nodes).
    tokio::time::sleep(fleet.interval() + Duration::from_secs(5)).await;
    // The ingest leaves hundreds of thousands of dead row versions behind, which
    // autovacuum then cleans: its work is the ingest's aftermath, not the steady
    // fleet's (whose own vacuuming recurs and stays in the figure). Without the
    // ingest, the fleet was silent longer than the grace since the join and
    // every node comes back alive now: thousands of liveness events on the
    // record, the join's aftermath too. Wait for both to pass.
    wait_for(
        "the ingest's autovacuum and the fleet's revival to pass",
        Duration::from_secs(600),
        || async {
            let busy = scalar(
                &mesh.env,
                "inventory",
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE backend_type = 'autovacuum worker' AND datname = current_database()",
            )
            .await?;
            let not_alive = scalar(
                &mesh.env,
                "inventory",
                "SELECT count(*) FROM inventory.nodes WHERE state <> 'alive'",
            )
            .await?;
            let mut events = 0;
            for context in ["config", "inventory", "identity", "connectivity"] {
                let queue = mesh_protocol::topology::record_queue(context);
                events += mesh_e2e::sim::queue_depth(&mesh.env, &queue).await?;
            }
            let quiet = busy == 0 && not_alive == 0 && events == 0 && unsent(mesh).await? == 0;
            Ok(quiet.then_some(()))
        },
    )
    .await?;
    let whole = if o.runs(Phase::Steady) {
        let at = Steady {
            pid,
            floor: base.floor,
            write_ms,
        };
        Some(steady_phase(mesh, &fleet, &applied, o, at, &mut rows).await?)
    } else {
        None
    };
    if o.runs(Phase::Fanout) {
        fanout_phase(mesh, o, &mut rows).await?;
    }
    let mut beat = (stop, beat);
    if o.runs(Phase::Idle) {
        beat = idle_phase(mesh, &fleet, o, beat, &mut rows).await?;
    }
    let (stop, beat) = beat;
    if o.runs(Phase::Catchup) {
        catchup_phase(mesh, o, c, &mut rows).await?;
    }
    stop.stop();
    beat.await??;
    // Last, the controller stopped: (c′) and (e) take its heartbeat queue.
    let floor_runs = o.runs(Phase::Baselines) && whole.is_some();
    if ingested.is_some() || floor_runs {
        // The controller takes what is still queued first: the ideal consumers
        // count only the heartbeats published for them.
        wait_for(
            "the heartbeat queue to be empty",
            Duration::from_secs(120),
            || async {
                let d = heartbeat_depth(mesh).await?;
                Ok((d == 0).then_some(()))
            },
        )
        .await?;
        let declared = declared_generations(mesh).await?;
        mesh.kill_controller();
        if let Some(rate) = ingested {
            ideal_phase(mesh, &fleet, o, rate, &declared, &mut rows).await?;
        }
        if floor_runs {
            let e = floor_phase(mesh, &fleet, Arc::new(declared), &mut rows).await?;
            if let Some(all) = whole {
                rows.push(
                    row("steady: whole system ÷ (e)", all, "% of a core")
                        .baseline(e)
                        .target_vs("≤ 1.1 × (e)", |r| r <= 1.1),
                );
            }
        }
    }
    for conn in &fleet.connections {
        let _ = conn.close(200, "bench done".into()).await;
    }
    Ok(())
}

/// What the figures are divided by; `None` when the baselines were skipped.
#[derive(Default)]
struct Baselines {
    /// (c), messages/s.
    pipeline: Option<f64>,
    /// (d): broker + database CPU of the ideal pipeline at the steady rate,
    /// % of a core.
    floor: Option<f64>,
}

/// (a), (b), (c) and (d).
async fn baselines(
    mesh: &Mesh,
    o: &Options,
    interval_ms: u64,
    rows: &mut Rows<'_>,
) -> anyhow::Result<Baselines> {
    eprintln!("baselines…");
    let a = baseline_broker(mesh, o.baseline_messages).await?;
    rows.push(row("(a) broker: publish-confirm → consume-ack", a, "msg/s"));
    let b = baseline_database(mesh, o.nodes, o.baseline_messages * 2).await?;
    rows.push(row(
        "(b) database: 200-row UNNEST UPSERT per commit",
        b,
        "rows/s",
    ));
    let (c, _) = baseline_pipeline(mesh, o.nodes, o.baseline_messages, None).await?;
    rows.push(row(
        "(c) ideal pipeline: consume → batch UPSERT → commit → ack",
        c,
        "msg/s",
    ));
    // (d) the floor of the steady fleet with durable heartbeats: (c) paced at
    // its rate (every node once per interval) for 30 s, one queue. What moving
    // that many persistent, confirmed messages into one table costs the broker
    // and the database.
    let rate = o.nodes as f64 * 1000.0 / interval_ms.max(1) as f64;
    let (_, d) = baseline_pipeline(mesh, o.nodes, (rate * 30.0) as usize, Some(rate)).await?;
    rows.push(row(
        &format!("(d) ideal pipeline paced at {rate:.0} msg/s: broker CPU"),
        d.broker,
        "% of a core",
    ));
    rows.push(row(
        &format!("(d) ideal pipeline paced at {rate:.0} msg/s: database CPU"),
        d.database,
        "% of a core",
    ));
    Ok(Baselines {
        pipeline: Some(c),
        floor: Some(d.broker + d.database),
    })
}

/// The heartbeat ingest; returns its rate.
async fn ingest_phase(
    mesh: &mut Mesh,
    fleet: &Fleet,
    o: &Options,
    c: Option<f64>,
    rows: &mut Rows<'_>,
) -> anyhow::Result<f64> {
    eprintln!("heartbeat ingest…");
    let applied = declared_generations(mesh).await?;
    let pid = controller_pid(mesh)?;
    let i0 = cpu(pid);
    let (rate, p50, p99) = ingest(
        mesh,
        fleet,
        o.ingest_messages,
        &applied,
        &Committer::Controller,
    )
    .await?;
    let i1 = cpu(pid);
    // Judged against (c′) at the end of the run; (c) is kept for comparison.
    rows.push(row("heartbeat ingest, committed", rate, "msg/s").baseline(c));
    rows.push(row("heartbeat ingest, publish→commit p50", p50, "ms"));
    rows.push(row("heartbeat ingest, publish→commit p99", p99, "ms"));
    // Where the machine's two cores went while ingesting: the ratio to (c) is
    // bound by whichever process saturates first.
    let isecs = i1.at.duration_since(i0.at).as_secs_f64();
    let ishare = |a: f64, b: f64| (b - a) / isecs * 100.0;
    for (who, a, b) in [
        ("controller", i0.controller, i1.controller),
        ("broker", i0.broker, i1.broker),
        ("database", i0.database, i1.database),
        ("simulator", i0.simulator, i1.simulator),
    ] {
        rows.push(row(
            &format!("heartbeat ingest: {who} CPU"),
            ishare(a, b),
            "% of a core",
        ));
    }
    Ok(rate)
}

/// (c′): the same fleet publishing the same way (transient, the same confirm
/// window) into the same queue, taken by the ideal consumer of (c) instead of
/// the controller (stopped by the caller). Against (c), whose single publisher
/// confirms persistent messages in large batches, the ingest's ratio also
/// carries what many publishers cost the broker; against (c′) it is the
/// controller's.
async fn ideal_phase(
    mesh: &Mesh,
    fleet: &Fleet,
    o: &Options,
    rate: f64,
    applied: &BTreeMap<NodeId, AppliedGenerations>,
    rows: &mut Rows<'_>,
) -> anyhow::Result<()> {
    eprintln!("(c′) the ideal pipeline fed by the fleet…");
    let conn = Connection::connect(&mesh.env.admin_amqp_url(), Default::default()).await?;
    let ch = conn.create_channel().await?;
    ch.basic_qos(1000, BasicQosOptions::default()).await?;
    let consumer = ch
        .basic_consume(
            heartbeat_queue().as_str().into(),
            "bench.ideal".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let pool = bench_table(mesh, o.nodes).await?;
    let counter = Arc::new(AtomicU64::new(0));
    let n = ingest_size(fleet, o.ingest_messages);
    let consume = ideal_consumer(consumer, pool, o.nodes, n, counter.clone());
    let (ideal, _, _) = ingest(
        mesh,
        fleet,
        o.ingest_messages,
        applied,
        &Committer::Ideal(counter),
    )
    .await?;
    consume.await??.close().await;
    let _ = conn.close(200, "done".into()).await;
    rows.push(row(
        "(c′) ideal pipeline fed by the fleet (its publishers, exchange, queue, delivery mode)",
        ideal,
        "msg/s",
    ));
    rows.push(
        row("heartbeat ingest ÷ (c′)", rate, "msg/s")
            .baseline(ideal)
            .target_vs("≥ 0.85 × (c′)", |r| r >= 0.85),
    );
    Ok(())
}

/// (e) the floor of the steady fleet as heartbeats are sent now: the fleet's
/// channels publish transient heartbeats through `reports` into the
/// controller's heartbeat queue at the steady rate (nodes ÷ interval), no
/// confirm waited for, while an ideal consumer — `mesh-bench ideal-consume`,
/// its own process, so that its CPU is read from /proc as the controller's —
/// takes them (prefetch 1,000, batches of ≤ 200 waiting ≤ 20 ms, decoded,
/// acked with `multiple`; no database). 5 s of warm-up, then 30 s measured.
/// The controller is stopped (by the caller). Returns broker + consumer, % of
/// a core.
async fn floor_phase(
    mesh: &Mesh,
    fleet: &Arc<Fleet>,
    applied: Arc<BTreeMap<NodeId, AppliedGenerations>>,
    rows: &mut Rows<'_>,
) -> anyhow::Result<f64> {
    let rate = fleet.rate();
    eprintln!("(e) heartbeats as sent, {rate:.0} msg/s, taken by an ideal consumer…");
    let mut consumer = IdealConsumer::spawn(&mesh.env.admin_amqp_url(), &heartbeat_queue()).await?;
    let stop = tokio_util_token::Token::default();
    let beat = steady(fleet.clone(), applied, stop.clone());
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (b0, k0, t0) = (broker_cpu(), cpu_secs(consumer.pid), Instant::now());
    tokio::time::sleep(Duration::from_secs(30)).await;
    let (b1, k1) = (broker_cpu(), cpu_secs(consumer.pid));
    let secs = t0.elapsed().as_secs_f64();
    stop.stop();
    let sent = beat.await??;
    let taken = consumer.finish().await?;
    eprintln!("  (e): {sent} heartbeats published, {taken} taken by the ideal consumer");
    let broker = (b1 - b0) / secs * 100.0;
    let ideal = (k1 - k0) / secs * 100.0;
    let label = format!("(e) heartbeats as sent, {rate:.0} msg/s");
    rows.push(row(&format!("{label}: broker CPU"), broker, "% of a core"));
    rows.push(row(
        &format!("{label}: ideal consumer CPU"),
        ideal,
        "% of a core",
    ));
    rows.push(row(
        &format!("{label}: broker + ideal consumer"),
        broker + ideal,
        "% of a core",
    ));
    Ok(broker + ideal)
}

/// `mesh-bench ideal-consume` running as a child process.
struct IdealConsumer {
    child: tokio::process::Child,
    out: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
    pid: u32,
}

impl IdealConsumer {
    /// Start it on `queue` and wait until it consumes. The broker URL goes by
    /// environment, not on the command line.
    async fn spawn(url: &str, queue: &str) -> anyhow::Result<IdealConsumer> {
        use tokio::io::AsyncBufReadExt as _;
        let mut child = tokio::process::Command::new(std::env::current_exe()?)
            .args(["ideal-consume", "--queue", queue])
            .env(crate::ideal::URL_VAR, url)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .context("spawning mesh-bench ideal-consume")?;
        let pid = child.id().context("ideal-consume exited at once")?;
        let stdout = child.stdout.take().context("ideal-consume stdout")?;
        let mut out = tokio::io::BufReader::new(stdout).lines();
        let first = tokio::time::timeout(Duration::from_secs(30), out.next_line())
            .await
            .context("ideal-consume did not start within 30 s")??;
        ensure!(
            first.as_deref() == Some("ready"),
            "ideal-consume said {first:?}"
        );
        Ok(IdealConsumer { child, out, pid })
    }

    /// Close its stdin (it stops), and return what it took.
    async fn finish(&mut self) -> anyhow::Result<u64> {
        drop(self.child.stdin.take());
        let line = tokio::time::timeout(Duration::from_secs(30), self.out.next_line())
            .await
            .context("ideal-consume did not stop within 30 s")??
            .context("ideal-consume said nothing")?;
        let status = self.child.wait().await?;
        ensure!(status.success(), "ideal-consume failed: {status}");
        Ok(line.trim().parse()?)
    }
}

/// Where the steady phase reads its processes and what it is judged against.
struct Steady {
    pid: u32,
    /// (d), % of a core.
    floor: Option<f64>,
    /// The controller's `liveness_write_ms` in effect (`None`: per heartbeat).
    write_ms: Option<u64>,
}

/// The steady fleet: every node at its interval for `--steady-secs`. Returns
/// the whole system's CPU (controller + broker + database), % of a core.
async fn steady_phase(
    mesh: &Mesh,
    fleet: &Fleet,
    applied: &BTreeMap<NodeId, AppliedGenerations>,
    o: &Options,
    at: Steady,
    rows: &mut Rows<'_>,
) -> anyhow::Result<f64> {
    eprintln!(
        "steady fleet for {} s, every node every {} ms…",
        o.steady_secs,
        fleet.interval().as_millis()
    );
    let depth0 = heartbeat_depth(mesh).await?;
    let c0 = cpu(at.pid);
    let pub0 = vhost_published(mesh).await?;
    let out0 = outbox_published(mesh).await?;
    let paths0 = heartbeat_paths(mesh).await?;
    let probes = (o.steady_secs as usize).max(10) * 2;
    let every = Duration::from_secs_f64(o.steady_secs as f64 / probes as f64 * 0.9);
    // The window ends at `--steady-secs` whatever the probes still wait for.
    let window = async {
        tokio::time::sleep(Duration::from_secs(o.steady_secs)).await;
        let c1 = cpu(at.pid);
        let pub1 = vhost_published(mesh).await?;
        let out1 = outbox_published(mesh).await?;
        let depth1 = heartbeat_depth(mesh).await?;
        let paths1 = heartbeat_paths(mesh).await?;
        anyhow::Ok((c1, pub1, out1, depth1, paths1))
    };
    let (lat, end) = tokio::join!(probe_latencies(mesh, fleet, applied, probes, every), window);
    let (mut lat, (c1, pub1, out1, depth1, paths1)) = (lat?, end?);
    let secs = c1.at.duration_since(c0.at).as_secs_f64();
    let share = |a: f64, b: f64| (b - a) / secs * 100.0;
    let ctl = share(c0.controller, c1.controller);
    let brk = share(c0.broker, c1.broker);
    let db = share(c0.database, c1.database);
    let sim = share(c0.simulator, c1.simulator);
    let rss = rss_bytes(at.pid) as f64 / 1e6;
    let rate = fleet.rate();
    rows.push(row("steady: heartbeats/s offered", rate, "msg/s"));
    rows.push(row("steady: controller CPU", ctl, "% of a core").target("< 10%", ctl < 10.0));
    rows.push(row("steady: controller RSS", rss, "MB").target("< 150 MB", rss < 150.0));
    rows.push(row("steady: broker CPU (beam.smp)", brk, "% of a core"));
    rows.push(row(
        "steady: database CPU (all postgres)",
        db,
        "% of a core",
    ));
    rows.push(row(
        "steady: simulator CPU (not in the whole system)",
        sim,
        "% of a core",
    ));
    rows.push(
        row(
            "steady: broker + database CPU ÷ (d)",
            brk + db,
            "% of a core",
        )
        .baseline(at.floor),
    );
    let all = ctl + brk + db;
    // 10,000 nodes at 10 s: under 45 % (stretch 35 %); a larger fleet under
    // the default budget: under one core.
    rows.push(if o.nodes <= 10_000 {
        row("steady: whole system CPU", all, "% of a core")
            .target("< 45% (stretch < 35%)", all < 45.0)
    } else {
        row("steady: whole system CPU", all, "% of a core").target("< 100%", all < 100.0)
    });
    let p99 = percentile(&mut lat, 0.99);
    rows.push(row(
        "steady: heartbeat→last_seen p50",
        percentile(&mut lat, 0.5),
        "ms",
    ));
    let bound = at.write_ms.unwrap_or(0) as f64 + 100.0;
    let target = match at.write_ms {
        Some(w) => format!("≤ {w} + 100 ms (liveness_write_ms)"),
        None => "≤ 100 ms (written per heartbeat)".to_owned(),
    };
    rows.push(row("steady: heartbeat→last_seen p99", p99, "ms").target(&target, p99 <= bound));
    rows.push(row(
        "steady: heartbeat queue ready at start",
        f64::from(depth0),
        "msgs",
    ));
    rows.push(
        row(
            "steady: heartbeat queue ready at end",
            f64::from(depth1),
            "msgs",
        )
        .target(
            "≤ start + 1 s of heartbeats",
            f64::from(depth1) <= f64::from(depth0) + rate,
        ),
    );
    let per_node_min = (pub1 - pub0) as f64 / o.nodes as f64 / (secs / 60.0);
    rows.push(row(
        "idle cost, 1 file per node: broker msgs/node/min",
        per_node_min,
        "msg",
    ));
    let published = out1 - out0;
    rows.push(
        row(
            "idle cost, 1 file per node: controller-published msgs/min",
            published / (secs / 60.0),
            "msg",
        )
        .target("0 (premise)", published == 0.0),
    );
    let handled = paths1.total - paths0.total;
    let durable = paths1.durable - paths0.durable;
    let durable_share = if handled > 0.0 {
        durable / handled * 100.0
    } else {
        0.0
    };
    rows.push(
        row(
            "steady: heartbeats on the durable path",
            durable_share,
            "% of handled",
        )
        .target("≤ 1% (premise)", durable_share <= 1.0),
    );
    if let Err(e) = premise(handled, durable, published) {
        return Err(e.context(drift(mesh, applied).await?));
    }
    Ok(all)
}

/// What the simulated fleet states against what is declared now, for the
/// premise's failure: how many nodes differ, and a few of them.
async fn drift(
    mesh: &Mesh,
    applied: &BTreeMap<NodeId, AppliedGenerations>,
) -> anyhow::Result<String> {
    let now = declared_generations(mesh).await?;
    let none = AppliedGenerations::default();
    let differ: Vec<String> = now
        .iter()
        .filter(|(node, declared)| applied.get(*node).unwrap_or(&none) != *declared)
        .map(|(node, declared)| {
            format!(
                "{node}: states {:?}, declared {declared:?}",
                applied.get(node).unwrap_or(&none)
            )
        })
        .collect();
    Ok(format!(
        "{} of {} nodes state other generations than declared now{}{}",
        differ.len(),
        now.len(),
        if differ.is_empty() { "" } else { ", e.g. " },
        differ
            .iter()
            .take(3)
            .cloned()
            .collect::<Vec<_>>()
            .join("; ")
    ))
}

/// The steady phase measures a fleet in step: its nodes state the newest
/// generation of every section, so their heartbeats take the in-memory path
/// and the controller declares nothing. When that does not hold the figures
/// measure something else (re-sends, durable writes), and the run fails
/// saying which part of the premise broke rather than printing them as if
/// they were the steady fleet's.
fn premise(handled: f64, durable: f64, published: f64) -> anyhow::Result<()> {
    ensure!(
        handled > 0.0,
        "premise broken: the controller handled no heartbeat in the steady window"
    );
    ensure!(
        durable <= handled * 0.01,
        "premise broken: {durable} of {handled} steady heartbeats ({:.1} %) took the durable \
         path (out of step with what was declared to their node: does the simulated fleet \
         state every section's generation?)",
        durable / handled * 100.0
    );
    ensure!(
        published == 0.0,
        "premise broken: the controller published {published} messages to an idle fleet \
         (something is re-declared every pass)"
    );
    Ok(())
}

/// The controller's heartbeat counters (`mesh_controller_heartbeats_total`).
struct Paths {
    total: f64,
    durable: f64,
}

async fn heartbeat_paths(mesh: &Mesh) -> anyhow::Result<Paths> {
    let text = metrics(mesh).await?;
    Ok(Paths {
        total: metric_sum(&text, "mesh_controller_heartbeats_total", ""),
        durable: metric_sum(
            &text,
            "mesh_controller_heartbeats_total",
            "path=\"durable\"",
        ),
    })
}

/// Real connections: `--real-connections` node users (own user each, created
/// through the management API in one definitions import), one connection and
/// one confirm channel each, as agents connect, with the broker's AMQP
/// heartbeat (60 s by default, what agents ask for). The broker's
/// CPU idle without them (30 s) and with them idle (60 s, after 10 s to
/// settle), its RSS and the management API's connection memory before and
/// after: per connection, and extrapolated to 10,000 and 50,000.
async fn real_phase(mesh: &Mesh, o: &Options, rows: &mut Rows<'_>) -> anyhow::Result<()> {
    let n = o.real_connections.max(1);
    // lapin: one thread and one descriptor per connection.
    let nofile = raise_nofile(n as u64 + 1024)?;
    rows.push(row(
        "real connections: this process's descriptor limit (soft)",
        nofile as f64,
        "fds",
    ));
    ensure!(
        nofile >= n as u64 + 256,
        "{n} connections need more descriptors than this process may have ({nofile})"
    );
    if let Some(limit) = broker_nofile() {
        rows.push(row(
            "real connections: broker's descriptor limit (beam.smp, bundle/up)",
            limit as f64,
            "fds",
        ));
    }
    eprintln!("real connections: the broker idle for 30 s first…");
    let (b0, t0) = (broker_cpu(), Instant::now());
    // The memory figures are differences: how far they drift with nothing
    // changing (sampled every 3 s of the idle window) is their noise.
    let (mut rss, mut mem) = (Vec::new(), Vec::new());
    while t0.elapsed() < Duration::from_secs(30) {
        rss.push(broker_rss());
        if let Ok(m) = connection_memory(mesh).await {
            mem.push(m);
        }
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    let idle = (broker_cpu() - b0) / t0.elapsed().as_secs_f64() * 100.0;
    let rss0 = Sampled::of(&rss).context("no broker RSS sample")?;
    let mem0 = Sampled::of(&mem);
    eprintln!("real connections: {n} node users, one connection each…");
    let creds = mesh_e2e::sim::add_nodes(&mesh.env, "real", n).await?;
    let users: Vec<String> = creds.iter().map(|c| c.node.to_string()).collect();
    let t = Instant::now();
    let nodes = mesh_e2e::sim::connect_all(creds, 32).await;
    let result = match nodes {
        Ok(nodes) => {
            let connected = t.elapsed().as_secs_f64();
            let before = Before { idle, rss0, mem0 };
            let r = idle_connections(&nodes, n, connected, before, mesh, rows).await;
            futures_util::stream::iter(nodes)
                .for_each_concurrent(64, |node| node.close())
                .await;
            r
        }
        Err(e) => Err(e),
    };
    delete_users(mesh, &users).await;
    result
}

/// Samples of one quantity taken while nothing changed: the last one is the
/// "before" of a difference, their spread (max − min) its noise.
#[derive(Clone, Copy)]
struct Sampled {
    last: f64,
    noise: f64,
}

impl Sampled {
    fn of(samples: &[u64]) -> Option<Sampled> {
        let last = *samples.last()? as f64;
        let max = samples.iter().max()?;
        let min = samples.iter().min()?;
        Some(Sampled {
            last,
            noise: (max - min) as f64,
        })
    }
}

/// The broker without the connections, for [`idle_connections`].
struct Before {
    /// Its CPU, % of a core.
    idle: f64,
    /// Its RSS, bytes.
    rss0: Sampled,
    /// Its connection processes' memory (management API), bytes.
    mem0: Option<Sampled>,
}

/// The measuring part of [`real_phase`], with every connection open.
async fn idle_connections(
    nodes: &[mesh_e2e::sim::SimNode],
    n: usize,
    connected: f64,
    Before { idle, rss0, mem0 }: Before,
    mesh: &Mesh,
    rows: &mut Rows<'_>,
) -> anyhow::Result<()> {
    rows.push(row(
        &format!("real connections: {n} connected (own user each)"),
        connected,
        "s",
    ));
    if let Some(node) = nodes.first() {
        rows.push(row(
            "real connections: AMQP heartbeat negotiated (agents ask 60 s)",
            f64::from(node.conn.configuration().heartbeat()),
            "s",
        ));
    }
    tokio::time::sleep(Duration::from_secs(10)).await;
    eprintln!("real connections: {n} idle for 60 s…");
    let (b0, t0) = (broker_cpu(), Instant::now());
    tokio::time::sleep(Duration::from_secs(60)).await;
    let busy = (broker_cpu() - b0) / t0.elapsed().as_secs_f64() * 100.0;
    let rss1 = broker_rss();
    let mem1 = connection_memory(mesh).await.ok();
    let per = (busy - idle) / n as f64;
    rows.push(row(
        "real connections: broker CPU, none open",
        idle,
        "% of a core",
    ));
    rows.push(row(
        &format!("real connections: broker CPU, {n} idle"),
        busy,
        "% of a core",
    ));
    rows.push(row(
        "real connections: broker CPU per 1,000 connections",
        per * 1000.0,
        "% of a core",
    ));
    for k in [10_000.0, 50_000.0] {
        rows.push(row(
            &format!("real connections: broker CPU extrapolated to {k:.0}"),
            per * k,
            "% of a core",
        ));
    }
    // The broker frees memory late and unevenly, and anything else on the
    // machine's broker moves its RSS too: a difference within the idle
    // drift (or below zero) is reported as below noise, not as a figure.
    let rss_delta = rss1 as f64 - rss0.last;
    let rss_per = rss_delta / n as f64;
    rows.push(above_noise(
        "real connections: broker RSS per connection",
        rss_delta,
        rss0.noise,
        rss_per / 1024.0,
        "KiB",
    ));
    for k in [10_000.0, 50_000.0] {
        rows.push(above_noise(
            &format!("real connections: broker RSS extrapolated to {k:.0}"),
            rss_delta,
            rss0.noise,
            rss_per * k / 1e6,
            "MB",
        ));
    }
    if let (Some(m0), Some(m1)) = (mem0, mem1) {
        let delta = m1 as f64 - m0.last;
        rows.push(above_noise(
            "real connections: connection memory per connection (management API)",
            delta,
            m0.noise,
            delta / n as f64 / 1024.0,
            "KiB",
        ));
    }
    Ok(())
}

/// Raise this process's soft descriptor limit towards `want` (up to the
/// hard limit); returns the soft limit now.
fn raise_nofile(want: u64) -> anyhow::Result<u64> {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let lim = getrlimit(Resource::Nofile);
    let soft = lim.current.unwrap_or(u64::MAX);
    if soft >= want {
        return Ok(soft);
    }
    let new = lim.maximum.map_or(want, |hard| hard.min(want.max(soft)));
    setrlimit(
        Resource::Nofile,
        rustix::process::Rlimit {
            current: Some(new),
            maximum: lim.maximum,
        },
    )?;
    Ok(getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX))
}

/// The broker's soft descriptor limit, from /proc/<beam.smp>/limits.
fn broker_nofile() -> Option<u64> {
    let pid = broker_pids().into_iter().next()?;
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).ok()?;
    limits
        .lines()
        .find(|l| l.starts_with("Max open files"))?
        .split_whitespace()
        .nth(3)?
        .parse()
        .ok()
}

fn broker_rss() -> u64 {
    broker_pids().into_iter().map(rss_bytes).sum()
}

/// The broker's memory in connection processes (readers, writers, channels,
/// other), bytes, from the management API's memory breakdown.
async fn connection_memory(mesh: &Mesh) -> anyhow::Result<u64> {
    let admin = mesh.env.admin_credentials();
    let http = admin_http()?;
    let get = |url: String| {
        http.get(url)
            .basic_auth(&admin.rabbitmq_user, Some(admin.rabbitmq_password.expose()))
            .send()
    };
    let nodes: Vec<serde_json::Value> =
        get(format!("{}/api/nodes?columns=name", admin.rabbitmq_api))
            .await?
            .error_for_status()?
            .json()
            .await?;
    let name = nodes
        .first()
        .and_then(|n| n["name"].as_str())
        .context("no broker node")?;
    let memory: serde_json::Value = get(format!(
        "{}/api/nodes/{}/memory",
        admin.rabbitmq_api,
        urlencoding::encode(name)
    ))
    .await?
    .error_for_status()?
    .json()
    .await?;
    let m = memory["memory"]
        .as_object()
        .context("no memory breakdown")?;
    Ok(m.iter()
        .filter(|(k, _)| k.starts_with("connection_"))
        .filter_map(|(_, v)| v.as_u64())
        .sum())
}

/// Remove the real-connection phase's node users (the test kit's teardown
/// would otherwise, at the end of the run).
async fn delete_users(mesh: &Mesh, users: &[String]) {
    let admin = mesh.env.admin_credentials();
    let Ok(http) = admin_http() else { return };
    let r = http
        .post(format!("{}/api/users/bulk-delete", admin.rabbitmq_api))
        .basic_auth(&admin.rabbitmq_user, Some(admin.rabbitmq_password.expose()))
        .json(&json!({ "users": users }))
        .send()
        .await;
    if let Err(e) = r.and_then(|r| r.error_for_status()) {
        eprintln!("warning: deleting the real connections' users: {e} (teardown removes them)");
    }
}

async fn fanout_phase(mesh: &Mesh, o: &Options, rows: &mut Rows<'_>) -> anyhow::Result<()> {
    eprintln!("fan-out…");
    let last_id = scalar(
        &mesh.env,
        "config",
        "SELECT coalesce(max(id), 0) FROM config.outbox",
    )
    .await?;
    let fan_start = Instant::now();
    put_files(mesh, 1, "fan", ("role", "sim")).await?;
    let n = o.nodes as i64;
    let written_at = std::sync::Mutex::new(None);
    let fan = wait_for(
        "every declaration confirmed",
        Duration::from_secs(600),
        || async {
            let (written, sent) = sent_declarations(mesh, last_id).await?;
            if written >= n
                && let Ok(mut at) = written_at.lock()
            {
                at.get_or_insert_with(|| fan_start.elapsed());
            }
            Ok((written >= n && sent >= n).then_some(fan_start.elapsed()))
        },
    )
    .await?;
    if let Some(written) = written_at.lock().ok().and_then(|at| *at) {
        rows.push(row(
            "fan-out: every declaration written to the outbox",
            written.as_secs_f64(),
            "s",
        ));
    }
    rows.push(
        row(
            "fan-out: one change for every node, all confirmed",
            fan.as_secs_f64(),
            "s",
        )
        .target("< 5 s", fan.as_secs_f64() < 5.0),
    );
    Ok(())
}

/// Idle cost as what a node runs grows: one node in a hundred is labelled
/// group=many and assigned first 1 module, then 100 modules and 98 more
/// files. Their messages per minute (heartbeats + declarations sent to them)
/// must not grow: sections are re-sent only to nodes behind, never on a timer.
/// Heartbeats keep flowing throughout (`beat`): a fleet silent for longer than
/// the grace is judged unreachable, and placement pauses while it is.
async fn idle_phase(
    mesh: &Mesh,
    fleet: &Arc<Fleet>,
    o: &Options,
    mut beat: Beat,
    rows: &mut Rows<'_>,
) -> anyhow::Result<Beat> {
    let group: Vec<NodeId> = fleet
        .nodes
        .iter()
        .take((o.nodes / 100).max(1))
        .cloned()
        .collect();
    for node in &group {
        let (status, _, body) = mesh
            .request(
                reqwest::Method::PUT,
                &format!("/v1/nodes/{node}/labels"),
                &[("if-match", "*")],
                Some(&json!({"labels": {"group": "many"}})),
            )
            .await?;
        ensure!(status < 300, "PUT labels: {status} {body}");
    }
    eprintln!("idle cost with 1 module on {} nodes…", group.len());
    put_modules(mesh, 0..1, group.len()).await?;
    let one;
    (one, beat) = idle_cost(mesh, fleet, &group, beat).await?;
    eprintln!(
        "idle cost with 100 modules and 100 files on {} nodes…",
        group.len()
    );
    put_modules(mesh, 1..100, group.len()).await?;
    put_files(mesh, 98, "many", ("group", "many")).await?;
    let many;
    (many, beat) = idle_cost(mesh, fleet, &group, beat).await?;
    rows.push(row(
        "idle cost, 1 module: msgs/node/min of the nodes that run it",
        one,
        "msg",
    ));
    rows.push(
        row(
            "idle cost, 100 modules + 100 files: msgs/node/min of those nodes",
            many,
            "msg",
        )
        .baseline(one)
        .target(
            "= 1-module figure (±10%)",
            (many - one).abs() <= 0.1 * one.max(0.1),
        ),
    );
    Ok(beat)
}

/// The controller killed under steady traffic, then started: the backlog's
/// drain rate against (c).
async fn catchup_phase(
    mesh: &mut Mesh,
    o: &Options,
    c: Option<f64>,
    rows: &mut Rows<'_>,
) -> anyhow::Result<()> {
    eprintln!("catch-up: controller stopped for {} s…", o.catchup_secs);
    mesh.kill_controller();
    tokio::time::sleep(Duration::from_secs(o.catchup_secs)).await;
    let backlog = heartbeat_depth(mesh).await?;
    let restart = Instant::now();
    mesh.start_controller(&[("RUST_LOG", "info")]).await?;
    let drained = wait_for(
        "the backlog to drain",
        Duration::from_secs(1800),
        || async {
            let d = heartbeat_depth(mesh).await?;
            Ok((d < 200).then_some(restart.elapsed()))
        },
    )
    .await?;
    let drain_rate = backlog as f64 / drained.as_secs_f64();
    rows.push(row(
        "catch-up: backlog after the stop",
        backlog as f64,
        "msgs",
    ));
    rows.push(row(
        "catch-up: time to drain (incl. controller start)",
        drained.as_secs_f64(),
        "s",
    ));
    rows.push(row("catch-up: drain rate", drain_rate, "msg/s").baseline(c));
    Ok(())
}

pub fn print(rows: &[Row]) {
    println!("| figure | value | baseline | ratio | target | pass |");
    println!("|---|---:|---:|---:|---|---|");
    for r in rows {
        let num = |v: f64| {
            if v >= 100.0 {
                format!("{v:.0}")
            } else {
                format!("{v:.2}")
            }
        };
        println!(
            "| {} | {} | {} | {} | {} | {} |",
            r.figure,
            match &r.note {
                Some(note) => note.clone(),
                None => format!("{} {}", num(r.value), r.unit),
            },
            r.baseline.map(num).unwrap_or_default(),
            r.ratio.map(|x| format!("{x:.2}")).unwrap_or_default(),
            r.target,
            match r.pass {
                Some(true) => "pass",
                Some(false) => "FAIL",
                None => "",
            }
        );
    }
}

#[cfg(test)]
mod tests {
    use super::premise;

    #[test]
    fn the_steady_premise_holds_for_a_fleet_in_step() {
        assert!(premise(1000.0, 0.0, 0.0).is_ok());
        assert!(premise(1000.0, 10.0, 0.0).is_ok(), "1 % is allowed");
    }

    #[test]
    fn the_steady_premise_fails_naming_what_broke() {
        let durable = premise(1000.0, 11.0, 0.0).map_err(|e| e.to_string());
        assert!(
            durable.as_ref().is_err_and(|e| e.contains("durable path")),
            "{durable:?}"
        );
        let published = premise(1000.0, 0.0, 3.0).map_err(|e| e.to_string());
        assert!(
            published.as_ref().is_err_and(|e| e.contains("published 3")),
            "{published:?}"
        );
        let silent = premise(0.0, 0.0, 0.0).map_err(|e| e.to_string());
        assert!(
            silent.as_ref().is_err_and(|e| e.contains("no heartbeat")),
            "{silent:?}"
        );
    }
}
