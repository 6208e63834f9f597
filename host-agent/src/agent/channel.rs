//! The AMQP side of a broker session, and nothing of the agent's state: open
//! the publishing channel (with publisher confirms) and the declarations'
//! consumer, and hand one report to the broker, persistent and confirmed or
//! transient. Every step that waits on the broker has a deadline.

use std::time::Duration;

use futures_util::StreamExt;
use futures_util::future::BoxFuture;
use lapin::message::Delivery;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Confirmation, Connection, Consumer};
use mesh_protocol::NodeId;
use mesh_protocol::topology::{REPORTS_EXCHANGE, report_routing_key};
use tracing::{Instrument, debug, info_span};
use uuid::Uuid;

use crate::buffer::Outgoing;

/// How long a graceful close waits for the broker's answer before the
/// connection is let go (a dead peer never answers).
pub(super) const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);

/// A published report's confirm, with the report's id.
pub(super) type ConfirmFuture = BoxFuture<'static, (Uuid, Result<Confirmation, lapin::Error>)>;

/// Hand one report to the broker, persistent and mandatory; the returned
/// future resolves to its confirm.
pub(super) async fn publish(
    ch: &Channel,
    node: &NodeId,
    out: &Outgoing,
) -> Result<ConfirmFuture, lapin::Error> {
    let span = info_span!("report", message_id = %out.id, node = %node, kind = out.kind.as_str(), seq = out.seq);
    let props = BasicProperties::default()
        .with_message_id(out.id.to_string().into())
        .with_type(out.kind.as_str().into())
        .with_user_id(node.as_str().into())
        .with_content_type("application/json".into())
        .with_delivery_mode(2);
    let confirm = ch
        .basic_publish(
            REPORTS_EXCHANGE.into(),
            report_routing_key(node, out.kind).into(),
            BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            },
            &out.payload,
            props,
        )
        .instrument(span.clone())
        .await?;
    span.in_scope(|| debug!("published, awaiting confirm"));
    let id = out.id;
    Ok(Box::pin(
        async move { (id, confirm.await) }.instrument(span),
    ))
}

/// Publish one transient report (delivery mode 1, never buffered),
/// expiring after `expiration_ms` when given. Returns its confirm, for the
/// caller to let settle without waiting on it.
pub(super) async fn publish_transient(
    ch: &Channel,
    node: &NodeId,
    out: &Outgoing,
    expiration_ms: Option<u64>,
) -> Result<lapin::PublisherConfirm, lapin::Error> {
    let mut props = BasicProperties::default()
        .with_message_id(out.id.to_string().into())
        .with_type(out.kind.as_str().into())
        .with_user_id(node.as_str().into())
        .with_content_type("application/json".into())
        .with_delivery_mode(1);
    if let Some(ms) = expiration_ms {
        props = props.with_expiration(ms.to_string().into());
    }
    let key = report_routing_key(node, out.kind);
    ch.basic_publish(
        REPORTS_EXCHANGE.into(),
        key.into(),
        BasicPublishOptions::default(),
        &out.payload,
        props,
    )
    .await
}

/// `step` within `deadline`: past it, an error saying the broker did not
/// answer (a stalled peer would otherwise hold the session forever; the
/// AMQP heartbeat ends such a connection later).
async fn within<T>(
    deadline: Duration,
    what: &str,
    step: impl std::future::Future<Output = Result<T, lapin::Error>>,
) -> Result<T, lapin::Error> {
    match tokio::time::timeout(deadline, step).await {
        Ok(result) => result,
        Err(_) => Err(lapin::Error::from(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!(
                "the broker did not answer {what} within {}s",
                deadline.as_secs_f64()
            ),
        ))),
    }
}

/// Open a channel to publish on, with publisher confirms.
pub(super) async fn open_publisher(
    conn: &Connection,
    deadline: Duration,
) -> Result<Channel, lapin::Error> {
    within(deadline, "opening the publishing channel", async {
        let ch = conn.create_channel().await?;
        ch.confirm_select(ConfirmSelectOptions::default()).await?;
        Ok(ch)
    })
    .await
}

/// Open a channel to consume the declaration queue `queue` on, with `prefetch`.
pub(super) async fn start_consumer(
    conn: &Connection,
    queue: &str,
    prefetch: u16,
    deadline: Duration,
) -> Result<(Channel, Consumer), lapin::Error> {
    let ch = within(deadline, "opening the declarations channel", async {
        let ch = conn.create_channel().await?;
        ch.basic_qos(prefetch, BasicQosOptions::default()).await?;
        Ok(ch)
    })
    .await?;
    let tag = format!("mesh-agent-{}", Uuid::now_v7());
    let consumer = within(
        deadline,
        "the consume of the declaration queue",
        ch.basic_consume(
            queue.into(),
            tag.as_str().into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        ),
    )
    .await;
    match consumer {
        Ok(c) => Ok((ch, c)),
        Err(e) => {
            // The broker closed the channel (404 when the queue is missing); make sure
            // it is gone on our side too.
            let _ = tokio::time::timeout(CLOSE_TIMEOUT, ch.close(200, "retrying".into())).await;
            Err(e)
        }
    }
}

/// The next delivery of `consumer` (never, while there is none).
pub(super) async fn next_delivery(
    consumer: &mut Option<(Channel, Consumer)>,
) -> Option<Result<Delivery, lapin::Error>> {
    match consumer {
        Some((_, c)) => c.next().await,
        None => std::future::pending().await,
    }
}
