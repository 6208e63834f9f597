//! `mesh-bench ideal-consume` (hidden): the ideal consumer of baseline (e), run
//! as a child process of `mesh-bench fleet` so that its CPU is read from /proc
//! like the controller's. It takes a queue (prefetch 1,000) in batches of at
//! most 200 (waiting at most 20 ms for a batch to fill), decodes every report,
//! and acks each batch with `multiple`; no database. It says `ready` on stdout
//! once it consumes, stops when its stdin closes, and then prints how many
//! messages it took.

use anyhow::Context as _;
use futures_util::StreamExt;
use lapin::Connection;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use mesh_protocol::{Envelope, Report};

/// The environment variable carrying the broker URL (kept off the command line).
pub const URL_VAR: &str = "MESH_BENCH_AMQP_URL";

pub async fn consume(queue: &str) -> anyhow::Result<()> {
    let url = std::env::var(URL_VAR).with_context(|| format!("{URL_VAR} is not set"))?;
    let conn = Connection::connect(&url, Default::default()).await?;
    let ch = conn.create_channel().await?;
    ch.basic_qos(1000, BasicQosOptions::default()).await?;
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "bench.ideal-consume".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    println!("ready");
    let mut stdin_closed = tokio::task::spawn_blocking(|| {
        let mut sink = Vec::new();
        let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
    });
    let mut taken = 0u64;
    loop {
        let first = tokio::select! {
            _ = &mut stdin_closed => break,
            d = consumer.next() => match d {
                Some(d) => d?,
                None => break,
            },
        };
        let batch = crate::wire::fill_batch(first, &mut consumer).await?;
        for d in &batch {
            Envelope::<Report>::decode(&d.data, mesh_protocol::MAX_REPORT_BYTES)?;
        }
        taken += batch.len() as u64;
        if let Some(last) = batch.last() {
            last.acker.ack(BasicAckOptions { multiple: true }).await?;
        }
    }
    println!("{taken}");
    let _ = conn.close(200, "done".into()).await;
    Ok(())
}
