//! `mesh-bench heartbeats`: many simulated nodes (each its own broker user and
//! connection, since `user_id` must equal the connection's user) publish
//! heartbeats as fast as the broker confirms them, against a real controller
//! process in an isolated environment. Prints reports/s committed and the
//! controller's CPU and memory. A benchmark, not a test: it exits non-zero only
//! when the harness itself fails, never on a slow figure.
//!
//! Build first: `cargo build --release --workspace --bins`, then run
//! `target/release/mesh-bench heartbeats --nodes 200 --seconds 20`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};
use futures_util::StreamExt;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Connection};
use mesh_e2e::{Mesh, hello, wait_for};
use mesh_protocol::{Envelope, Heartbeat, NodeId, Report};

mod declares;
mod fleet;
mod health;
mod ideal;
mod paths;
mod plan;
mod procfs;
mod queues;
mod rollout;
mod starts;
mod wire;

#[derive(Parser)]
#[command(name = "mesh-bench")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// The whole benchmark of docs/benchmarks.md: baselines, ingest, steady
    /// fleet, fan-out, idle cost, catch-up. Prints a table, writes JSON.
    Fleet {
        /// Simulated nodes (distinct node identities).
        #[arg(long, default_value_t = 10_000)]
        nodes: usize,
        /// Broker connections the simulated nodes are multiplexed over (one
        /// channel per 12 nodes, spread over them).
        #[arg(long, default_value_t = 8)]
        connections: usize,
        /// Steady-fleet measurement window (the issue asks for at least 60 s).
        #[arg(long, default_value_t = 60)]
        steady_secs: u64,
        /// How long the controller is stopped under steady traffic: 5 minutes,
        /// the catch-up figure of docs/benchmarks.md.
        #[arg(long, default_value_t = 300)]
        catchup_secs: u64,
        /// Heartbeats published in the ingest phase.
        #[arg(long, default_value_t = 100_000)]
        ingest_messages: usize,
        /// Messages per baseline measurement.
        #[arg(long, default_value_t = 50_000)]
        baseline_messages: usize,
        /// Real AMQP connections, one per node with its own broker user, held
        /// idle for 60 s (phase `real`).
        #[arg(long, default_value_t = 2_000)]
        real_connections: usize,
        /// The controller's `liveness_write_ms` (how often it writes last_seen
        /// for the fleet); the p99 heartbeat→last_seen target is this + 100 ms.
        /// Left out for a controller that does not know the setting.
        #[arg(long, default_value_t = 5_000)]
        liveness_write_ms: u64,
        /// Where the JSON goes.
        #[arg(long, default_value = "target/mesh-bench-fleet.json")]
        json: std::path::PathBuf,
        /// Phases to leave out, comma-separated (the join always runs). Figures
        /// that need a skipped baseline are printed without their ratio.
        #[arg(long, value_delimiter = ',')]
        skip: Vec<fleet::Phase>,
    },
    /// What each feature of the report path (topic exchange, queue bound,
    /// properties, batched acks) adds to baseline (a), and what each choice of
    /// the heartbeat queue costs (delivery mode, confirms, durability, queue
    /// type, single active consumer, prefetch): msg/s and broker CPU.
    BrokerPaths {
        /// Messages per variant.
        #[arg(long, default_value_t = 50_000)]
        messages: usize,
        /// The paced rate of the heartbeat-queue variants, messages/s.
        #[arg(long, default_value_t = 1_000.0)]
        rate: f64,
        /// How long each heartbeat-queue variant is paced, seconds.
        #[arg(long, default_value_t = 10)]
        paced_secs: u64,
    },
    /// Classic against quorum queues on the report path, on any broker (the
    /// machine's, or a `bundle/rabbit-cluster` cluster): paced persistent,
    /// confirmed reports into a bounded classic queue, then a quorum queue
    /// with the same arguments; msg/s, the broker's CPU (every node) and
    /// publish→consume / publish→confirm p50 and p99; each run and the medians.
    ReportQueues {
        /// Broker URLs, comma-separated: the queue is declared through the
        /// first, published to through the second, consumed from the last.
        #[arg(
            long = "url",
            env = "MESH_BENCH_BROKER_URLS",
            hide_env_values = true,
            value_delimiter = ',',
            default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
        )]
        urls: Vec<String>,
        /// A cluster raised by `bundle/rabbit-cluster up <dir>`: its three
        /// nodes' URLs (declare via node 1, publish via node 2, consume via
        /// node 3) and its HOME, instead of --url and --broker-home.
        #[arg(long)]
        cluster: Option<std::path::PathBuf>,
        /// The broker's HOME: its CPU is that of every beam.smp booting rabbit
        /// with this HOME (the machine's broker: /var/lib/rabbitmq).
        #[arg(long, default_value = "/var/lib/rabbitmq")]
        broker_home: String,
        /// Reports per second offered.
        #[arg(long, default_value_t = 1_000.0)]
        rate: f64,
        /// Measured window per queue and run, seconds (after the warm-up).
        #[arg(long, default_value_t = 20)]
        secs: u64,
        /// Warm-up before each window, seconds.
        #[arg(long, default_value_t = 5)]
        warmup_secs: u64,
        /// Runs (each: classic, then quorum); medians are printed.
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// The broker's idle CPU is read over this long first (0: not read).
        #[arg(long, default_value_t = 10)]
        idle_secs: u64,
        /// After the runs: this many idle queues shaped like `decl.<node>`,
        /// classic then quorum, and what they cost the broker idle (0: none).
        #[arg(long, default_value_t = 0)]
        idle_queues: usize,
    },
    /// Queue creation per second on 1 and on many channels (decision 0024):
    /// durable bounded queues shaped like `decl.<node>`, declared and bound
    /// as the controller's hello path does, in a vhost of its own on the
    /// local broker, removed afterwards.
    QueueDeclares {
        /// Queues declared per channel count and run.
        #[arg(long, default_value_t = 2_000)]
        queues: usize,
        /// Channel counts, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "1,32")]
        channels: Vec<usize>,
        /// Runs (each: every channel count in turn).
        #[arg(long, default_value_t = 3)]
        runs: usize,
    },
    /// The ideal consumer of baseline (e), run by `fleet` as a child process.
    #[command(hide = true)]
    IdealConsume {
        #[arg(long)]
        queue: String,
    },
    /// The connectivity plan (peers, names, ruleset of every node) per
    /// fleet size: time to compute every node's section, and the largest
    /// section against the declaration limit. Pure: no broker, no database.
    ConnectivityPlan {
        /// Fleet sizes, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "10,100,1000,3000")]
        nodes: Vec<usize>,
    },
    /// Health and alerts (observability) per fleet size, against a real
    /// PostgreSQL: recording a health report of every node, and an
    /// evaluation (first, steady, with a tenth of the probes failing).
    Health {
        /// Fleet sizes, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "100,1000,5000")]
        nodes: Vec<usize>,
        /// Units (one module each, two probes each) on every node.
        #[arg(long, default_value_t = 3)]
        units: usize,
    },
    /// A rollout (delivery) per fleet size, against a real PostgreSQL:
    /// starting it, each tick of the rollout clock, and the units reports
    /// that move it, with max_unavailable a tenth of the fleet.
    Rollout {
        /// Fleet sizes, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "10,100,1000")]
        nodes: Vec<usize>,
    },
    /// Unit starts per second through the agent's supervisor, as the agent's
    /// own user without a cgroup and then boxed (module user, cgroup with
    /// limits; decision 0051). Needs root.
    UnitStarts {
        /// Units started at once per round.
        #[arg(long, default_value_t = 200)]
        units: usize,
        /// Rounds per mode (the median is reported).
        #[arg(long, default_value_t = 3)]
        rounds: usize,
    },
    /// Heartbeat ingest: reports/s committed, controller CPU and RSS.
    Heartbeats {
        /// Simulated nodes (broker users and connections).
        #[arg(long, default_value_t = 200)]
        nodes: usize,
        /// How long the nodes publish.
        #[arg(long, default_value_t = 20)]
        seconds: u64,
        /// Unconfirmed publishes in flight per node.
        #[arg(long, default_value_t = 32)]
        window: usize,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Cmd::Fleet {
            nodes,
            connections,
            steady_secs,
            catchup_secs,
            ingest_messages,
            baseline_messages,
            real_connections,
            liveness_write_ms,
            json,
            skip,
        } => {
            let options = fleet::Options {
                nodes,
                connections,
                steady_secs,
                catchup_secs,
                ingest_messages,
                baseline_messages,
                real_connections,
                liveness_write_ms,
                skip,
            };
            let rows = fleet::run(options).await?;
            fleet::print(&rows);
            if let Some(dir) = json.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("creating {}", dir.display()))?;
            }
            std::fs::write(&json, serde_json::to_vec_pretty(&rows)?)
                .with_context(|| format!("writing {}", json.display()))?;
            eprintln!("written: {}", json.display());
            Ok(())
        }
        Cmd::BrokerPaths {
            messages,
            rate,
            paced_secs,
        } => paths::run(messages, rate, paced_secs).await,
        Cmd::ReportQueues {
            urls,
            cluster,
            broker_home,
            rate,
            secs,
            warmup_secs,
            runs,
            idle_secs,
            idle_queues,
        } => {
            let (urls, broker_home) = match cluster {
                Some(dir) => queues::cluster(&dir)?,
                None => (urls, broker_home),
            };
            queues::run(queues::Options {
                urls,
                broker_home,
                rate,
                secs,
                warmup_secs,
                runs,
                idle_secs,
                idle_queues,
            })
            .await
        }
        Cmd::QueueDeclares {
            queues,
            channels,
            runs,
        } => declares::run(queues, &channels, runs).await,
        Cmd::IdealConsume { queue } => ideal::consume(&queue).await,
        Cmd::ConnectivityPlan { nodes } => plan::run(&nodes),
        Cmd::Health { nodes, units } => health::run(&nodes, units).await,
        Cmd::Rollout { nodes } => rollout::run(&nodes).await,
        Cmd::UnitStarts { units, rounds } => starts::run(units, rounds).await,
        Cmd::Heartbeats {
            nodes,
            seconds,
            window,
        } => heartbeats(nodes, seconds, window).await,
    }
}

/// utime + stime of a process, in seconds, and its RSS in bytes.
fn cpu_and_rss(pid: u32) -> anyhow::Result<(f64, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let after = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .context("odd /proc stat")?;
    let fields: Vec<&str> = after.split_whitespace().collect();
    // Fields after the command: state is [0]; utime is field 14 → [11], stime [12], rss [21].
    let ticks = 100.0; // USER_HZ on Linux
    let utime: f64 = fields.get(11).context("utime")?.parse()?;
    let stime: f64 = fields.get(12).context("stime")?.parse()?;
    let rss_pages: u64 = fields.get(21).context("rss")?.parse()?;
    Ok(((utime + stime) / ticks, rss_pages * 4096))
}

async fn handled(mesh: &Mesh) -> anyhow::Result<u64> {
    let text = reqwest::get(format!("{}/metrics", mesh.api))
        .await?
        .text()
        .await?;
    Ok(text
        .lines()
        .filter(|l| {
            l.starts_with("mesh_controller_messages_handled_total{")
                && l.contains("reports.heartbeat")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64)
}

async fn heartbeats(nodes: usize, seconds: u64, window: usize) -> anyhow::Result<()> {
    let mut mesh = Mesh::start().await?;
    let pid = mesh.controller().context("controller running")?.pid();
    eprintln!("creating {nodes} node users…");
    let creds: Vec<_> = futures_util::stream::iter(0..nodes)
        .map(|i| {
            let env = &mesh.env;
            async move { env.add_node(&format!("sim-{i}")).await }
        })
        .buffer_unordered(16)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<_, _>>()?;
    eprintln!("connecting and saying hello…");
    let mut conns = Vec::with_capacity(nodes);
    for c in &creds {
        let conn = Connection::connect(&c.broker_url, Default::default()).await?;
        let ch = conn.create_channel().await?;
        ch.confirm_select(ConfirmSelectOptions::default()).await?;
        let props = BasicProperties::default()
            .with_user_id(c.node.as_str().into())
            .with_delivery_mode(2);
        ch.basic_publish(
            "reports".into(),
            format!("{}.hello", c.node).as_str().into(),
            BasicPublishOptions::default(),
            &hello(c.node.as_str(), &[]).encode(),
            props,
        )
        .await?
        .await?;
        conns.push((conn, ch, c.node.clone()));
    }
    let listed = || async {
        let (_, list) = mesh.get("/v1/nodes").await?;
        Ok((list["nodes"].as_array().map(Vec::len) == Some(nodes)).then_some(()))
    };
    wait_for(
        "every simulated node to be listed",
        Duration::from_secs(120),
        listed,
    )
    .await?;

    let before = handled(&mesh).await?;
    let (cpu0, _) = cpu_and_rss(pid)?;
    let published = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let stop_at = start + Duration::from_secs(seconds);
    let mut tasks = Vec::new();
    for (_conn, ch, node) in &conns {
        let ch = ch.clone();
        let node: NodeId = node.clone();
        let published = published.clone();
        tasks.push(tokio::spawn(async move {
            let key = format!("{node}.heartbeat");
            let mut seq = 2;
            let mut inflight = std::collections::VecDeque::new();
            while Instant::now() < stop_at {
                let env = Envelope::new(
                    node.clone(),
                    seq,
                    Report::Heartbeat(Heartbeat {
                        interval_ms: Some(10_000),
                        applied: Default::default(),
                    }),
                );
                seq += 1;
                let props = BasicProperties::default()
                    .with_user_id(node.as_str().into())
                    .with_message_id(env.id.to_string().as_str().into())
                    // Transient, as agents send heartbeats; the confirm window
                    // only paces the publishers.
                    .with_delivery_mode(1);
                let confirm = ch
                    .basic_publish(
                        "reports".into(),
                        key.as_str().into(),
                        BasicPublishOptions::default(),
                        &env.encode(),
                        props,
                    )
                    .await?;
                inflight.push_back(confirm);
                if inflight.len() >= window
                    && let Some(c) = inflight.pop_front()
                    && c.await?.is_ack()
                {
                    published.fetch_add(1, Ordering::Relaxed);
                }
            }
            for c in inflight {
                if c.await?.is_ack() {
                    published.fetch_add(1, Ordering::Relaxed);
                }
            }
            Ok::<(), lapin::Error>(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let publish_secs = start.elapsed().as_secs_f64();
    let total = published.load(Ordering::Relaxed);
    let target = before + total;
    let drained = wait_for(
        "the controller to commit every heartbeat",
        Duration::from_secs(300),
        || async {
            let now = handled(&mesh).await?;
            Ok((now >= target).then_some(Instant::now()))
        },
    )
    .await?;
    let (cpu1, rss) = cpu_and_rss(pid)?;
    let ingest_secs = drained.duration_since(start).as_secs_f64();
    if total == 0 {
        bail!("nothing was published");
    }
    let rate = total as f64 / ingest_secs;
    let cpu_share = (cpu1 - cpu0) / ingest_secs;
    println!("| figure | value |");
    println!("|---|---:|");
    println!("| simulated nodes | {nodes} |");
    println!("| heartbeats published (confirmed) | {total} |");
    println!("| publish phase | {publish_secs:.1} s |");
    println!("| until all committed | {ingest_secs:.1} s |");
    println!("| reports/s committed | {rate:.0} |");
    println!(
        "| controller CPU (share of one core) | {:.0}% |",
        cpu_share * 100.0
    );
    println!(
        "| controller CPU per 1,000 reports | {:.1} ms |",
        (cpu1 - cpu0) * 1000.0 / total as f64 * 1000.0
    );
    println!("| controller RSS at the end | {:.0} MB |", rss as f64 / 1e6);
    for (conn, _, _) in conns {
        let _ = conn.close(200, "bench done".into()).await;
    }
    mesh.teardown().await
}
