//! `mesh-bench broker-paths`: what each feature of the real report path costs
//! the broker. Baseline (a) (a durable queue fed through the default exchange)
//! is run again with the real path's features added one at a time: the topic
//! exchange and its binding, the queue's bound, the report's properties, the
//! consumer's batched acks. Each row: messages/s and the broker's CPU per
//! message. A benchmark: it fails only when the harness fails.

use std::time::Instant;

use anyhow::{anyhow, ensure};
use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Connection, ExchangeKind};
use mesh_e2e::Mesh;

use crate::fleet::{cpu_secs, pids, sample_payload, settle};

/// One variant of the path: what is added to plain (a).
#[derive(Clone, Copy, Default)]
pub(crate) struct Path {
    topic: bool,
    bounded: bool,
    properties: bool,
    batched_acks: bool,
}

pub(crate) struct Measured {
    pub(crate) rate: f64,
    broker_us: f64,
}

fn broker_cpu() -> f64 {
    pids("beam.smp").into_iter().map(cpu_secs).sum()
}

/// Publish `n` heartbeat-sized persistent messages (confirms pipelined, window
/// 1,000) along `path` into a fresh durable queue `q` while another connection
/// consumes them (prefetch 1,000).
pub(crate) async fn measure(
    mesh: &Mesh,
    q: &str,
    path: Path,
    n: usize,
) -> anyhow::Result<Measured> {
    let user = mesh.env.admin_credentials().rabbitmq_user.as_str();
    let url = mesh.env.admin_amqp_url();
    let pc = Connection::connect(&url, Default::default()).await?;
    let pch = pc.create_channel().await?;
    pch.confirm_select(ConfirmSelectOptions::default()).await?;
    let mut args = FieldTable::default();
    if path.bounded {
        args.insert("x-max-length".into(), AMQPValue::LongLongInt(100_000));
        args.insert(
            "x-overflow".into(),
            AMQPValue::LongString(LongString::from("drop-head")),
        );
    }
    pch.queue_declare(
        q.into(),
        QueueDeclareOptions {
            durable: true,
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
    cch.basic_qos(1000, BasicQosOptions::default()).await?;
    let mut consumer = cch
        .basic_consume(
            q.into(),
            "bench.paths".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let payload = sample_payload();
    let b0 = broker_cpu();
    let start = Instant::now();
    let consume = tokio::spawn(async move {
        let mut got = 0;
        while got < n {
            let d = consumer
                .next()
                .await
                .ok_or_else(|| anyhow!("consumer ended"))??;
            got += 1;
            if !path.batched_acks {
                d.acker.ack(BasicAckOptions::default()).await?;
            } else if got % 200 == 0 || got == n {
                d.acker.ack(BasicAckOptions { multiple: true }).await?;
            }
        }
        anyhow::Ok(())
    });
    let mut confirms = Vec::new();
    for i in 0..n {
        let mut props = BasicProperties::default().with_delivery_mode(2);
        if path.properties {
            props = props
                .with_user_id(user.into())
                .with_message_id(format!("{i:032x}").as_str().into())
                .with_content_type("application/json".into());
        }
        confirms.push(
            pch.basic_publish(
                exchange.as_str().into(),
                key.as_str().into(),
                BasicPublishOptions::default(),
                &payload,
                props,
            )
            .await?,
        );
        if confirms.len() >= 1000 {
            settle(&mut confirms).await?;
        }
    }
    settle(&mut confirms).await?;
    consume.await??;
    let secs = start.elapsed().as_secs_f64();
    let broker = broker_cpu() - b0;
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
    })
}

pub async fn run(n: usize) -> anyhow::Result<()> {
    let mesh = Mesh::start().await?;
    let all = Path {
        topic: true,
        bounded: true,
        properties: true,
        batched_acks: false,
    };
    let variants = [
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
    let mut out = Vec::new();
    for (i, (name, path)) in variants.iter().enumerate() {
        eprintln!("{name}…");
        let m = measure(&mesh, &format!("bench.path{i}"), *path, n).await;
        match m {
            Ok(m) => out.push((*name, m)),
            Err(e) => {
                let _ = mesh.teardown().await;
                return Err(e);
            }
        }
    }
    println!("| path | msg/s | broker CPU per message |");
    println!("|---|---:|---:|");
    for (name, m) in &out {
        println!("| {name} | {:.0} | {:.0} µs |", m.rate, m.broker_us);
    }
    mesh.teardown().await
}
