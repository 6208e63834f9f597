//! `mesh-bench report-queues`: what a quorum queue costs against a classic
//! one on the report path (decision 0042, docs/scaling.md), on any broker: the
//! machine's own, or the three-node cluster of `bundle/rabbit-cluster`.
//!
//! For each run and each queue type (classic, then quorum, alternating so a
//! drift of the machine's load touches both), a fresh queue with the
//! arguments of `reports.applied` (docs/protocol.md: `x-max-length` 100,000,
//! `reject-publish`, single active consumer; the quorum one adds
//! `x-queue-type quorum`), bound `*.applied` to a fresh durable topic
//! exchange. One publisher paces persistent `applied` reports (~300 bytes of
//! JSON, `user_id`-less so no broker user is needed) with publisher confirms
//! (pipelined, never waited for one by one) at `--rate`; one consumer takes
//! them with prefetch 1,000 and acks with `multiple` every 200 or after 20 ms
//! without a delivery, as the controller does. After `--warmup-secs`, for
//! `--secs`: messages consumed per second, the broker's CPU (utime+stime of
//! every `beam.smp` booting rabbit whose HOME is `--broker-home`: the whole
//! cluster's nodes, or the machine's broker only), and the p50/p99 of
//! publish→consume and publish→confirm. With several URLs the queue is
//! declared through the first (so its classic home or quorum leader is that
//! node), the publisher connects to the second and the consumer to the last:
//! every message crosses the cluster, as an agent's report does when its
//! agent, the queue and the controller are on three different nodes.
//! Prints one row per run and the medians. A benchmark: it fails only when
//! the harness does (a refused publish is a harness failure).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, anyhow, bail, ensure};
use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Connection, ExchangeKind};
use mesh_protocol::{Applied, Envelope, ItemOutcome, NodeId, Outcome, Report, Section};

use crate::procfs::{cpu_secs, pids};

pub struct Options {
    pub urls: Vec<String>,
    pub broker_home: String,
    pub rate: f64,
    pub secs: u64,
    pub warmup_secs: u64,
    pub runs: usize,
    pub idle_secs: u64,
    /// Idle declaration-like queues declared per type after the runs (0: none).
    pub idle_queues: usize,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Classic,
    Quorum,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Classic => "classic (durable, bounded, single active consumer)",
            Kind::Quorum => "quorum (same arguments)",
        }
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct Measured {
    offered: f64,
    consumed: f64,
    broker_pct: f64,
    p50_ms: f64,
    p99_ms: f64,
    confirm_p50_ms: f64,
    confirm_p99_ms: f64,
}

/// The broker's Erlang VMs: every `beam.smp` booting `rabbit` whose `-home`
/// is `home` (a `rabbitmqctl` call runs a short-lived `beam.smp` without
/// `rabbit boot`: not counted).
fn broker_pids(home: &str) -> Vec<u32> {
    pids("beam.smp")
        .into_iter()
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| {
                    let args: Vec<&[u8]> = c.split(|b| *b == 0).collect();
                    args.windows(2)
                        .any(|w| w[0] == b"rabbit" && w[1] == b"boot")
                        && args
                            .windows(2)
                            .any(|w| w[0] == b"-home" && w[1] == home.as_bytes())
                })
                .unwrap_or(false)
        })
        .collect()
}

fn broker_cpu(home: &str) -> f64 {
    broker_pids(home).into_iter().map(cpu_secs).sum()
}

/// An `applied` report of a node that applied a config declaration of three
/// files: ~300 bytes, the size of the report path's durable reports.
fn payload() -> anyhow::Result<Vec<u8>> {
    let node = NodeId::parse("t00000000-n1234").map_err(|e| anyhow!("node id: {e:?}"))?;
    let items = ["/etc/app/app.toml", "/etc/app/tls.pem", "/etc/app/env"]
        .into_iter()
        .map(|item| ItemOutcome {
            item: item.to_owned(),
            ok: true,
            error: None,
        })
        .collect();
    Ok(Envelope::new(
        node,
        42,
        Report::Applied(Applied {
            section: Some(Section::Config),
            generation: Some(17),
            outcome: Outcome::Applied,
            items,
            error: None,
            unsupported_section: None,
        }),
    )
    .encode())
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    quantile(&v, 0.5)
}

/// Hide the password of an AMQP URL for printing.
fn shown(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut u) => {
            if u.password().is_some() {
                let _ = u.set_password(None);
            }
            u.to_string()
        }
        Err(_) => "(unparsable URL)".to_owned(),
    }
}

const HEADER_SENT: &str = "x-bench-sent-ns";

/// The brokers' resident memory, bytes (every VM of `home`).
fn broker_rss(home: &str) -> u64 {
    broker_pids(home)
        .into_iter()
        .filter_map(|pid| {
            let statm = std::fs::read_to_string(format!("/proc/{pid}/statm")).ok()?;
            statm.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .sum::<u64>()
        * 4096
}

/// `n` idle queues with the arguments of `decl.<node>` (`x-max-length` 64,
/// drop-head; quorum or classic), declared over 8 channels through the first
/// URL: the time that took, then the broker's CPU over `idle_secs` (after 5 s
/// to settle) and its RSS against before; the queues are deleted after.
async fn idle_queues(
    opts: &Options,
    kind: Kind,
    n: usize,
    tag: &str,
) -> anyhow::Result<(f64, f64, f64)> {
    let conn = Connection::connect(&opts.urls[0], Default::default()).await?;
    let rss0 = broker_rss(&opts.broker_home);
    let names: Vec<String> = (0..n).map(|i| format!("bench.idle.{tag}.{i:06}")).collect();
    let per = n.div_ceil(8).max(1);
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for part in names.chunks(per) {
        let ch = conn.create_channel().await?;
        let part = part.to_vec();
        tasks.push(tokio::spawn(async move {
            for q in &part {
                let mut args = FieldTable::default();
                args.insert("x-max-length".into(), AMQPValue::LongLongInt(64));
                args.insert(
                    "x-overflow".into(),
                    AMQPValue::LongString(LongString::from("drop-head")),
                );
                if kind == Kind::Quorum {
                    args.insert(
                        "x-queue-type".into(),
                        AMQPValue::LongString(LongString::from("quorum")),
                    );
                }
                ch.queue_declare(
                    q.as_str().into(),
                    QueueDeclareOptions {
                        durable: true,
                        ..Default::default()
                    },
                    args,
                )
                .await?;
            }
            anyhow::Ok((ch, part))
        }));
    }
    let mut declared = Vec::new();
    for t in tasks {
        declared.push(t.await??);
    }
    let declare_secs = t0.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let c0 = broker_cpu(&opts.broker_home);
    let t1 = Instant::now();
    tokio::time::sleep(Duration::from_secs(opts.idle_secs.max(1))).await;
    let cpu = (broker_cpu(&opts.broker_home) - c0) / t1.elapsed().as_secs_f64() * 100.0;
    let rss = broker_rss(&opts.broker_home) as f64 - rss0 as f64;
    let mut tasks = Vec::new();
    for (ch, part) in declared {
        tasks.push(tokio::spawn(async move {
            for q in &part {
                ch.queue_delete(q.as_str().into(), Default::default())
                    .await?;
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let _ = conn.close(200, "bench done".into()).await;
    Ok((declare_secs, cpu, rss / 1e6))
}

async fn measure(opts: &Options, kind: Kind, tag: &str) -> anyhow::Result<Measured> {
    let declare_url = &opts.urls[0];
    let publish_url = opts.urls.get(1).unwrap_or(&opts.urls[0]);
    let consume_url = opts.urls.last().unwrap_or(&opts.urls[0]);
    let queue = format!("bench.report-queues.{tag}");
    let exchange = format!("{queue}.x");

    // Declare through the first node: a classic queue's home, a quorum
    // queue's first leader.
    let dc = Connection::connect(declare_url, Default::default()).await?;
    let dch = dc.create_channel().await?;
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongLongInt(100_000));
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString(LongString::from("reject-publish")),
    );
    args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
    if kind == Kind::Quorum {
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString(LongString::from("quorum")),
        );
    }
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    dch.queue_declare(queue.as_str().into(), durable, args)
        .await
        .with_context(|| format!("declaring {queue}"))?;
    dch.exchange_declare(
        exchange.as_str().into(),
        ExchangeKind::Topic,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await?;
    dch.queue_bind(
        queue.as_str().into(),
        exchange.as_str().into(),
        "*.applied".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;

    let epoch = Instant::now();
    let window_start = Duration::from_secs(opts.warmup_secs);
    let window_end = window_start + Duration::from_secs(opts.secs);
    let total = (opts.rate * (opts.warmup_secs + opts.secs) as f64) as u64;

    // The consumer: latencies of the messages published inside the window.
    let cc = Connection::connect(consume_url, Default::default()).await?;
    let cch = cc.create_channel().await?;
    cch.basic_qos(1000, BasicQosOptions::default()).await?;
    let mut consumer = cch
        .basic_consume(
            queue.as_str().into(),
            "bench.report-queues".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let consumed_in_window = Arc::new(AtomicU64::new(0));
    let counted = consumed_in_window.clone();
    let consume = tokio::spawn(async move {
        let mut got = 0u64;
        let mut latencies = Vec::new();
        let mut unacked: Option<lapin::message::Delivery> = None;
        let mut since = 0;
        while got < total {
            let next = if unacked.is_some() {
                match tokio::time::timeout(Duration::from_millis(20), consumer.next()).await {
                    Ok(d) => d,
                    Err(_) => {
                        if let Some(d) = unacked.take() {
                            d.acker.ack(BasicAckOptions { multiple: true }).await?;
                            since = 0;
                        }
                        continue;
                    }
                }
            } else {
                match tokio::time::timeout(Duration::from_secs(60), consumer.next()).await {
                    Ok(d) => d,
                    Err(_) => bail!("no delivery for 60 s after {got} of {total}"),
                }
            };
            let d = next.ok_or_else(|| anyhow!("consumer ended"))??;
            let now = epoch.elapsed();
            got += 1;
            let sent = d
                .properties
                .headers()
                .as_ref()
                .and_then(|h| h.inner().get(HEADER_SENT).cloned());
            if let Some(AMQPValue::LongLongInt(ns)) = sent {
                let sent = Duration::from_nanos(ns as u64);
                if sent >= window_start && sent < window_end {
                    latencies.push((now - sent).as_secs_f64() * 1e3);
                    counted.fetch_add(1, Ordering::Relaxed);
                }
            }
            since += 1;
            if since >= 200 || got == total {
                d.acker.ack(BasicAckOptions { multiple: true }).await?;
                since = 0;
                unacked = None;
            } else {
                unacked = Some(d);
            }
        }
        anyhow::Ok(latencies)
    });

    // The confirms, awaited in order by a task of their own: the publisher
    // never waits for one.
    let pc = Connection::connect(publish_url, Default::default()).await?;
    let pch = pc.create_channel().await?;
    pch.confirm_select(ConfirmSelectOptions::default()).await?;
    let (confirm_tx, mut confirm_rx) =
        tokio::sync::mpsc::unbounded_channel::<(Duration, lapin::PublisherConfirm)>();
    let confirms = tokio::spawn(async move {
        let mut latencies = Vec::new();
        while let Some((sent, c)) = confirm_rx.recv().await {
            let c = tokio::time::timeout(Duration::from_secs(60), c)
                .await
                .map_err(|_| anyhow!("no confirm within 60 s"))??;
            ensure!(c.is_ack(), "the broker refused a publish: {c:?}");
            if sent >= window_start && sent < window_end {
                latencies.push((epoch.elapsed() - sent).as_secs_f64() * 1e3);
            }
        }
        anyhow::Ok(latencies)
    });

    let body = payload()?;
    let home = opts.broker_home.clone();
    let mut cpu_at_start = None;
    let mut cpu_window = None;
    for i in 0..total {
        let at = Duration::from_secs_f64(i as f64 / opts.rate);
        if cpu_at_start.is_none() && at >= window_start {
            cpu_at_start = Some((broker_cpu(&home), Instant::now()));
        }
        if cpu_window.is_none()
            && at >= window_end
            && let Some((c0, t0)) = cpu_at_start
        {
            cpu_window = Some((broker_cpu(&home) - c0, t0.elapsed().as_secs_f64()));
        }
        tokio::time::sleep_until((epoch + at).into()).await;
        let sent = epoch.elapsed();
        let mut headers = FieldTable::default();
        headers.insert(
            HEADER_SENT.into(),
            AMQPValue::LongLongInt(sent.as_nanos() as i64),
        );
        let props = BasicProperties::default()
            .with_delivery_mode(2)
            .with_content_type("application/json".into())
            .with_message_id(format!("{tag}-{i:08}").as_str().into())
            .with_headers(headers);
        let c = pch
            .basic_publish(
                exchange.as_str().into(),
                "t00000000-n1234.applied".into(),
                BasicPublishOptions::default(),
                &body,
                props,
            )
            .await?;
        confirm_tx
            .send((sent, c))
            .map_err(|_| anyhow!("the confirm task ended early"))?;
    }
    let (cpu, secs) = match (cpu_window, cpu_at_start) {
        (Some(w), _) => w,
        (None, Some((c0, t0))) => (broker_cpu(&home) - c0, t0.elapsed().as_secs_f64()),
        (None, None) => bail!("the measuring window never started"),
    };
    drop(confirm_tx);
    let mut confirm_lat = confirms.await??;
    let mut lat = consume.await??;
    let consumed = consumed_in_window.load(Ordering::Relaxed);
    let _ = dch
        .queue_delete(queue.as_str().into(), Default::default())
        .await;
    let _ = dch
        .exchange_delete(exchange.as_str().into(), Default::default())
        .await;
    for c in [pc, cc, dc] {
        let _ = c.close(200, "bench done".into()).await;
    }
    lat.sort_by(f64::total_cmp);
    confirm_lat.sort_by(f64::total_cmp);
    Ok(Measured {
        offered: opts.rate,
        consumed: consumed as f64 / opts.secs as f64,
        broker_pct: cpu / secs * 100.0,
        p50_ms: quantile(&lat, 0.5),
        p99_ms: quantile(&lat, 0.99),
        confirm_p50_ms: quantile(&confirm_lat, 0.5),
        confirm_p99_ms: quantile(&confirm_lat, 0.99),
    })
}

/// The URLs and HOME of a cluster raised by `bundle/rabbit-cluster up <dir>`,
/// from its `cluster.env`.
pub fn cluster(dir: &std::path::Path) -> anyhow::Result<(Vec<String>, String)> {
    let path = dir.join("cluster.env");
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "{}: not a cluster of bundle/rabbit-cluster (run `bash bundle/rabbit-cluster up {}`)",
            path.display(),
            dir.display()
        )
    })?;
    let var = |key: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
            .map(str::to_owned)
            .with_context(|| format!("{} has no {key}", path.display()))
    };
    let urls: Vec<String> = var("URLS")?.split(',').map(str::to_owned).collect();
    ensure!(
        urls.len() >= 3,
        "{}: URLS names fewer than three nodes",
        path.display()
    );
    Ok((urls, format!("{}/home", var("DIR")?)))
}

pub async fn run(opts: Options) -> anyhow::Result<()> {
    ensure!(!opts.urls.is_empty(), "no broker URL (--url)");
    ensure!(
        opts.rate > 0.0 && opts.rate.is_finite(),
        "--rate must be > 0"
    );
    ensure!(opts.secs > 0, "--secs must be > 0");
    ensure!(opts.runs > 0, "--runs must be > 0");
    let vms = broker_pids(&opts.broker_home);
    ensure!(
        !vms.is_empty(),
        "no running broker (beam.smp booting rabbit) has HOME {} (--broker-home)",
        opts.broker_home
    );
    let size = payload()?.len();
    eprintln!(
        "broker: {} VM(s) with HOME {} (pids {vms:?}); declare via {}, publish via {}, consume via {}; {size}-byte reports at {} msg/s",
        vms.len(),
        opts.broker_home,
        shown(&opts.urls[0]),
        shown(opts.urls.get(1).unwrap_or(&opts.urls[0])),
        shown(opts.urls.last().unwrap_or(&opts.urls[0])),
        opts.rate
    );
    let idle = if opts.idle_secs > 0 {
        let c0 = broker_cpu(&opts.broker_home);
        let t0 = Instant::now();
        tokio::time::sleep(Duration::from_secs(opts.idle_secs)).await;
        Some((broker_cpu(&opts.broker_home) - c0) / t0.elapsed().as_secs_f64() * 100.0)
    } else {
        None
    };
    let stamp = std::process::id();
    let mut rows: Vec<(Kind, usize, Measured)> = Vec::new();
    for run in 1..=opts.runs {
        for kind in [Kind::Classic, Kind::Quorum] {
            let tag = format!("{stamp}-{run}-{kind:?}").to_lowercase();
            eprintln!("run {run}: {}…", kind.name());
            let m = measure(&opts, kind, &tag).await?;
            eprintln!(
                "  {:.0} msg/s, broker {:.1} % of a core, p50 {:.1} ms, p99 {:.1} ms",
                m.consumed, m.broker_pct, m.p50_ms, m.p99_ms
            );
            rows.push((kind, run, m));
        }
    }
    let mut idle_rows = Vec::new();
    if opts.idle_queues > 0 {
        for kind in [Kind::Classic, Kind::Quorum] {
            eprintln!("{} idle declaration queues, {kind:?}…", opts.idle_queues);
            let tag = format!("{stamp}-{kind:?}").to_lowercase();
            idle_rows.push((
                kind,
                idle_queues(&opts, kind, opts.idle_queues, &tag).await?,
            ));
        }
    }
    println!(
        "| queue | run | offered msg/s | consumed msg/s | broker CPU, % of a core | publish→consume p50 | p99 | publish→confirm p50 | p99 |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    if let Some(idle) = idle {
        println!(
            "| idle (nothing published, {} s) | | | | {idle:.1} | | | | |",
            opts.idle_secs
        );
    }
    let line = |name: &str, run: &str, m: &Measured| {
        println!(
            "| {name} | {run} | {:.0} | {:.0} | {:.1} | {:.1} ms | {:.1} ms | {:.1} ms | {:.1} ms |",
            m.offered,
            m.consumed,
            m.broker_pct,
            m.p50_ms,
            m.p99_ms,
            m.confirm_p50_ms,
            m.confirm_p99_ms
        )
    };
    for (kind, run, m) in &rows {
        line(kind.name(), &run.to_string(), m);
    }
    for kind in [Kind::Classic, Kind::Quorum] {
        let of = |f: fn(&Measured) -> f64| {
            median(
                rows.iter()
                    .filter(|(k, _, _)| *k == kind)
                    .map(|(_, _, m)| f(m))
                    .collect(),
            )
        };
        let m = Measured {
            offered: of(|m| m.offered),
            consumed: of(|m| m.consumed),
            broker_pct: of(|m| m.broker_pct),
            p50_ms: of(|m| m.p50_ms),
            p99_ms: of(|m| m.p99_ms),
            confirm_p50_ms: of(|m| m.confirm_p50_ms),
            confirm_p99_ms: of(|m| m.confirm_p99_ms),
        };
        line(kind.name(), &format!("median of {}", opts.runs), &m);
    }
    if !idle_rows.is_empty() {
        println!();
        println!(
            "| {} idle queues like `decl.<node>` (x-max-length 64, drop-head) | declared in | broker CPU idle, % of a core | broker RSS added |",
            opts.idle_queues
        );
        println!("|---|---:|---:|---:|");
        for (kind, (secs, cpu, mb)) in &idle_rows {
            println!("| {kind:?} | {secs:.1} s | {cpu:.1} | {mb:.0} MB |");
        }
    }
    Ok(())
}
