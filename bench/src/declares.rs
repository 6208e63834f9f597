//! `mesh-bench queue-declares`: how fast the broker creates the queues a
//! fleet's join needs, on 1 channel and on many (decision 0024: the hello path
//! declares `decl.<node>` queues over `DeclareChannels::COUNT` = 32 channels).
//!
//! Against the local RabbitMQ, in a vhost of its own (`mesh-bench-declares-`
//! and a random suffix, created through the management API with the admin
//! credentials the tests use, `mesh_testkit::admin_credentials`), removed at
//! the end with everything in it, whether the run succeeded or not. For each
//! channel count, `--queues` fresh durable classic queues shaped like
//! `decl.<node>` (`x-max-length` [`DECLARATION_QUEUE_MAX_LEN`], `drop-head`),
//! each bound to a direct exchange, declared and bound exactly as the
//! controller does (`amqp::declare_nowait`, then `ensure_all`'s barrier):
//! spread round-robin over the channels, `nowait`, then one passive declare
//! per channel waited for (the broker answers a channel's frames in order, so
//! its answer means every queue before it exists). Queues per second are
//! counted from the first declare to the last barrier's answer. Every channel
//! count gets fresh queue names; the queues of one count are deleted (their
//! vhost kept) before the next, so each starts from the same broker.
//! A benchmark: it fails only when the harness does.

use std::time::Instant;

use anyhow::Context as _;
use lapin::options::{
    ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, Connection, ExchangeKind};
use mesh_protocol::topology::DECLARATION_QUEUE_MAX_LEN;

const EXCHANGE: &str = "declarations";

/// One measured channel count.
pub struct Rate {
    pub channels: usize,
    pub queues: usize,
    pub secs: f64,
}

pub async fn run(queues: usize, channel_counts: &[usize], runs: usize) -> anyhow::Result<()> {
    let admin = mesh_testkit::admin_credentials()?;
    let api = mesh_broker_admin::Management::new(
        &admin.rabbitmq_api,
        &admin.rabbitmq_user,
        admin.rabbitmq_password.expose(),
    );
    let vhost = format!("mesh-bench-declares-{:08x}", rand::random::<u32>());
    api.put_vhost(&vhost).await?;
    let result = async {
        api.put_permissions(&vhost, &admin.rabbitmq_user, ".*", ".*", ".*")
            .await?;
        let mut url = url::Url::parse(admin.amqp_url.expose()).context("amqp url")?;
        url.set_path(&format!("/{}", urlencoding::encode(&vhost)));
        measure(url.as_str(), queues, channel_counts, runs).await
    }
    .await;
    let removed = api.delete_vhost(&vhost).await;
    let rates = result?;
    removed.with_context(|| format!("deleting the vhost {vhost}"))?;
    eprintln!("vhost {vhost} deleted");
    println!("| channels | queues | seconds | queues/s |");
    println!("|---:|---:|---:|---:|");
    for r in &rates {
        println!(
            "| {} | {} | {:.2} | {:.0} |",
            r.channels,
            r.queues,
            r.secs,
            r.queues as f64 / r.secs
        );
    }
    Ok(())
}

async fn measure(
    url: &str,
    queues: usize,
    channel_counts: &[usize],
    runs: usize,
) -> anyhow::Result<Vec<Rate>> {
    let conn = Connection::connect(url, Default::default()).await?;
    let setup = conn.create_channel().await?;
    setup
        .exchange_declare(
            EXCHANGE.into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    let mut rates = Vec::new();
    for run in 0..runs {
        for &count in channel_counts {
            let mut channels = Vec::with_capacity(count);
            for _ in 0..count.max(1) {
                channels.push(conn.create_channel().await?);
            }
            let names: Vec<String> = (0..queues)
                .map(|i| format!("decl.r{run}-c{count}-n{i}"))
                .collect();
            let started = Instant::now();
            declare_all(&channels, &names).await?;
            let secs = started.elapsed().as_secs_f64();
            eprintln!(
                "run {}: {count} channel(s): {queues} queues in {secs:.2} s ({:.0}/s)",
                run + 1,
                queues as f64 / secs
            );
            rates.push(Rate {
                channels: count,
                queues,
                secs,
            });
            for name in &names {
                setup
                    .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
                    .await?;
            }
            for ch in channels {
                let _ = ch.close(200, "done".into()).await;
            }
        }
    }
    let _ = conn.close(200, "done".into()).await;
    Ok(rates)
}

/// As the controller's `DeclarationQueues::ensure_all`: round-robin, nowait
/// declare and bind, then one passive declare per channel waited for.
async fn declare_all(channels: &[Channel], names: &[String]) -> anyhow::Result<()> {
    let mut args = FieldTable::default();
    args.insert(
        "x-max-length".into(),
        AMQPValue::LongLongInt(DECLARATION_QUEUE_MAX_LEN),
    );
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString(LongString::from("drop-head")),
    );
    let mut last: Vec<Option<&str>> = vec![None; channels.len()];
    for (i, name) in names.iter().enumerate() {
        let k = i % channels.len();
        let ch = &channels[k];
        ch.queue_declare(
            name.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                nowait: true,
                ..QueueDeclareOptions::default()
            },
            args.clone(),
        )
        .await?;
        ch.queue_bind(
            name.as_str().into(),
            EXCHANGE.into(),
            name.as_str().into(),
            QueueBindOptions { nowait: true },
            FieldTable::default(),
        )
        .await?;
        last[k] = Some(name);
    }
    let barriers = channels.iter().zip(&last).filter_map(|(ch, name)| {
        Some(ch.queue_declare(
            (*name)?.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        ))
    });
    futures_util::future::try_join_all(barriers).await?;
    Ok(())
}
