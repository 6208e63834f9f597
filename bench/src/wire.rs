//! Broker-side helpers every phase shares: a sample report, settling
//! publisher confirms, taking a batch of deliveries as the controller does.

use std::time::Duration;

use anyhow::ensure;
use futures_util::StreamExt;
use mesh_protocol::{AppliedGenerations, Envelope, Heartbeat, NodeId, Report, Section};

pub(crate) async fn settle(confirms: &mut Vec<lapin::PublisherConfirm>) -> anyhow::Result<()> {
    for c in confirms.drain(..) {
        let c = c.await?;
        ensure!(c.is_ack(), "the broker refused a publish: {c:?}");
    }
    Ok(())
}

pub(crate) fn sample_payload() -> Vec<u8> {
    let node = NodeId::parse("t00000000-n1234").unwrap_or_else(|_| unreachable!("valid id"));
    let mut applied = AppliedGenerations::new();
    applied.insert(Section::Config, 3);
    Envelope::new(
        node,
        42,
        Report::Heartbeat(Heartbeat {
            interval_ms: Some(10_000),
            applied,
        }),
    )
    .encode()
}

/// A batch as the controller takes one: `first` and whatever follows within
/// 20 ms, at most 200 deliveries.
pub(crate) async fn fill_batch(
    first: lapin::message::Delivery,
    consumer: &mut lapin::Consumer,
) -> anyhow::Result<Vec<lapin::message::Delivery>> {
    let mut batch = vec![first];
    let deadline = tokio::time::Instant::now() + Duration::from_millis(20);
    while batch.len() < 200 {
        match tokio::time::timeout_at(deadline, consumer.next()).await {
            Ok(Some(d)) => batch.push(d?),
            _ => break,
        }
    }
    Ok(batch)
}
