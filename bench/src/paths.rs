//! `mesh-bench broker-paths`: what each feature of the real report path costs
//! the broker, and what each choice of the heartbeat queue costs it.
//!
//! First table: baseline (a) (a durable queue fed through the default
//! exchange) run again with the real path's features added one at a time: the
//! topic exchange and its binding, the queue's bound, the report's properties,
//! the consumer's batched acks. Second table: heartbeats as agents send them
//! (transient, no publisher confirms waited for, the full report path), then
//! one choice changed at a time: persistent, confirms, a non-durable queue, a
//! quorum queue, single-active-consumer off, prefetch 100. Each row: messages/s
//! as fast as the path goes, the broker's CPU per message, and (second table)
//! the broker's share of a core with the publisher paced at `--rate`.
//! A benchmark: it fails only when the harness fails.

use std::time::{Duration, Instant};

use anyhow::{anyhow, ensure};
use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Connection, ExchangeKind};
use mesh_e2e::Mesh;

use crate::procfs::broker_cpu;
use crate::wire::{sample_payload, settle};

/// One variant of the path: what is added to plain (a).
#[derive(Clone, Copy)]
pub(crate) struct Path {
    topic: bool,
    bounded: bool,
    properties: bool,
    batched_acks: bool,
    /// Delivery mode 1 instead of 2.
    transient: bool,
    /// The publishing channel is not in confirm mode.
    no_confirms: bool,
    /// The queue is not durable.
    non_durable: bool,
    /// `x-queue-type = quorum` (durable by necessity).
    quorum: bool,
    /// `x-single-active-consumer = true`, as the controller's report queues.
    single_active: bool,
    prefetch: u16,
}

impl Default for Path {
    /// Baseline (a): default exchange, durable classic queue, persistent
    /// messages with confirms, prefetch 1,000, one ack per message.
    fn default() -> Path {
        Path {
            topic: false,
            bounded: false,
            properties: false,
            batched_acks: false,
            transient: false,
            no_confirms: false,
            non_durable: false,
            quorum: false,
            single_active: false,
            prefetch: 1000,
        }
    }
}

pub(crate) struct Measured {
    pub(crate) rate: f64,
    broker_us: f64,
    /// Broker share of one core at the paced rate (% of a core), if paced.
    paced: Option<f64>,
}

/// Publish `n` heartbeat-sized messages (with confirms: pipelined, window
/// 1,000) along `path` into a fresh queue `q` while another connection
/// consumes them; then, with `paced = Some((rate, secs))`, publish at `rate`
/// for `secs` and read the broker's CPU over that time.
pub(crate) async fn measure(
    mesh: &Mesh,
    q: &str,
    path: Path,
    n: usize,
    paced: Option<(f64, u64)>,
) -> anyhow::Result<Measured> {
    let user = mesh.env.admin_credentials().rabbitmq_user.as_str();
    let url = mesh.env.admin_amqp_url();
    let pc = Connection::connect(&url, Default::default()).await?;
    let pch = pc.create_channel().await?;
    if !path.no_confirms {
        pch.confirm_select(ConfirmSelectOptions::default()).await?;
    }
    let mut args = FieldTable::default();
    if path.bounded {
        args.insert("x-max-length".into(), AMQPValue::LongLongInt(200_000));
        args.insert(
            "x-overflow".into(),
            AMQPValue::LongString(LongString::from("drop-head")),
        );
    }
    if path.quorum {
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString(LongString::from("quorum")),
        );
    }
    if path.single_active {
        args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
    }
    pch.queue_declare(
        q.into(),
        QueueDeclareOptions {
            durable: path.quorum || !path.non_durable,
            ..Default::default()
        },
        args,
    )
    .await?;
    let (exchange, key) = if path.topic {
        let x = format!("{q}.x");
        pch.exchange_declare(
            x.as_str().into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
        pch.queue_bind(
            q.into(),
            x.as_str().into(),
            "*.heartbeat".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
        (x, "t00000000-n1234.heartbeat".to_owned())
    } else {
        (String::new(), q.to_owned())
    };
    let cc = Connection::connect(&url, Default::default()).await?;
    let cch = cc.create_channel().await?;
    cch.basic_qos(path.prefetch, BasicQosOptions::default())
        .await?;
    let mut consumer = cch
        .basic_consume(
            q.into(),
            "bench.paths".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let total = n + paced
        .map(|(rate, secs)| (rate * secs as f64) as usize)
        .unwrap_or(0);
    let (consumed_tx, mut consumed_rx) = tokio::sync::watch::channel(0usize);
    let consume = tokio::spawn(async move {
        let mut got = 0;
        // Batched acks: every 200 and whenever the queue pauses (20 ms).
        let mut unacked: Option<lapin::message::Delivery> = None;
        let mut since = 0;
        while got < total {
            let next = if path.batched_acks && unacked.is_some() {
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
                consumer.next().await
            };
            let d = next.ok_or_else(|| anyhow!("consumer ended"))??;
            got += 1;
            if !path.batched_acks {
                d.acker.ack(BasicAckOptions::default()).await?;
            } else {
                since += 1;
                if since >= 200 || got == total {
                    d.acker.ack(BasicAckOptions { multiple: true }).await?;
                    since = 0;
                    unacked = None;
                } else {
                    unacked = Some(d);
                }
            }
            let _ = consumed_tx.send(got);
        }
        anyhow::Ok(())
    });
    let payload = sample_payload();
    let props = |i: usize| {
        let mut props =
            BasicProperties::default().with_delivery_mode(if path.transient { 1 } else { 2 });
        if path.properties {
            props = props
                .with_user_id(user.into())
                .with_message_id(format!("{i:032x}").as_str().into())
                .with_content_type("application/json".into());
        }
        props
    };
    let b0 = broker_cpu();
    let start = Instant::now();
    let mut confirms = Vec::new();
    for i in 0..n {
        let c = pch
            .basic_publish(
                exchange.as_str().into(),
                key.as_str().into(),
                BasicPublishOptions::default(),
                &payload,
                props(i),
            )
            .await?;
        if !path.no_confirms {
            confirms.push(c);
            if confirms.len() >= 1000 {
                settle(&mut confirms).await?;
            }
        }
    }
    settle(&mut confirms).await?;
    consumed_rx.wait_for(|got| *got >= n).await?;
    let secs = start.elapsed().as_secs_f64();
    let broker = broker_cpu() - b0;
    let mut paced_share = None;
    if let Some((rate, paced_secs)) = paced {
        // The paced part: as a steady fleet publishes, confirms (if any) not
        // waited for, at `rate` from one channel.
        let m = (rate * paced_secs as f64) as usize;
        let b0 = broker_cpu();
        let t0 = Instant::now();
        let mut pending = std::collections::VecDeque::new();
        for i in 0..m {
            tokio::time::sleep_until((t0 + Duration::from_secs_f64(i as f64 / rate)).into()).await;
            let c = pch
                .basic_publish(
                    exchange.as_str().into(),
                    key.as_str().into(),
                    BasicPublishOptions::default(),
                    &payload,
                    props(n + i),
                )
                .await?;
            if !path.no_confirms {
                pending.push_back(c);
                // Dropped once surely settled: never waited for.
                while pending.len() > rate as usize {
                    pending.pop_front();
                }
            }
        }
        consumed_rx.wait_for(|got| *got >= n + m).await?;
        let share = (broker_cpu() - b0) / t0.elapsed().as_secs_f64() * 100.0;
        paced_share = Some(share);
    }
    consume.await??;
    let _ = pch.queue_delete(q.into(), Default::default()).await;
    if path.topic {
        let _ = pch
            .exchange_delete(exchange.as_str().into(), Default::default())
            .await;
    }
    let _ = pc.close(200, "done".into()).await;
    let _ = cc.close(200, "done".into()).await;
    ensure!(secs > 0.0, "no time passed");
    Ok(Measured {
        rate: n as f64 / secs,
        broker_us: broker / n as f64 * 1e6,
        paced: paced_share,
    })
}

pub async fn run(n: usize, rate: f64, paced_secs: u64) -> anyhow::Result<()> {
    let mesh = Mesh::start().await?;
    let result = tables(&mesh, n, rate, paced_secs).await;
    let teardown = mesh.teardown().await;
    result?;
    teardown
}

async fn tables(mesh: &Mesh, n: usize, rate: f64, paced_secs: u64) -> anyhow::Result<()> {
    let all = Path {
        topic: true,
        bounded: true,
        properties: true,
        ..Path::default()
    };
    let features = [
        ("(a): default exchange → durable queue", Path::default()),
        (
            "+ topic exchange (binding `*.heartbeat`)",
            Path {
                topic: true,
                ..Path::default()
            },
        ),
        (
            "+ queue bound (x-max-length, drop-head)",
            Path {
                topic: true,
                bounded: true,
                ..Path::default()
            },
        ),
        ("+ properties (user_id, message_id, content type)", all),
        (
            "+ consumer acks 200 at once (`multiple`)",
            Path {
                batched_acks: true,
                ..all
            },
        ),
    ];
    // Heartbeats as agents send them: the whole report path, the
    // controller's queue (durable classic, single active consumer, prefetch
    // 1,000, acks in batches), transient, no publisher confirms.
    let hb = Path {
        topic: true,
        bounded: true,
        properties: true,
        batched_acks: true,
        transient: true,
        no_confirms: true,
        single_active: true,
        ..Path::default()
    };
    let choices = [
        (
            "heartbeats as sent: transient, no confirms, durable classic queue, single active consumer, prefetch 1,000",
            hb,
        ),
        (
            "persistent (delivery mode 2)",
            Path {
                transient: false,
                ..hb
            },
        ),
        (
            "publisher confirms (window 1,000 fast; paced: not waited for)",
            Path {
                no_confirms: false,
                ..hb
            },
        ),
        (
            "persistent + confirms (the previous heartbeat)",
            Path {
                transient: false,
                no_confirms: false,
                ..hb
            },
        ),
        (
            "non-durable queue",
            Path {
                non_durable: true,
                ..hb
            },
        ),
        ("quorum queue", Path { quorum: true, ..hb }),
        (
            "single active consumer off",
            Path {
                single_active: false,
                ..hb
            },
        ),
        (
            "prefetch 100",
            Path {
                prefetch: 100,
                ..hb
            },
        ),
    ];
    let mut first = Vec::new();
    for (i, (name, path)) in features.iter().enumerate() {
        eprintln!("{name}…");
        let m = measure(mesh, &format!("bench.path{i}"), *path, n, None).await?;
        first.push((*name, m));
    }
    let mut second = Vec::new();
    for (i, (name, path)) in choices.iter().enumerate() {
        eprintln!("{name}…");
        let m = measure(
            mesh,
            &format!("bench.choice{i}"),
            *path,
            n,
            Some((rate, paced_secs)),
        )
        .await?;
        second.push((*name, m));
    }
    println!("| path | msg/s | broker CPU per message |");
    println!("|---|---:|---:|");
    for (name, m) in &first {
        println!("| {name} | {:.0} | {:.0} µs |", m.rate, m.broker_us);
    }
    println!();
    println!(
        "| heartbeat queue choice (one change each) | msg/s | broker CPU per message | broker CPU at {rate:.0} msg/s |"
    );
    println!("|---|---:|---:|---:|");
    for (name, m) in &second {
        println!(
            "| {name} | {:.0} | {:.0} µs | {} |",
            m.rate,
            m.broker_us,
            m.paced
                .map(|p| format!("{p:.1} % of a core"))
                .unwrap_or_default()
        );
    }
    Ok(())
}
