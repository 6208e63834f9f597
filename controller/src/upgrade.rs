//! Report queues an older controller declared, brought to today's arguments
//! without losing a report (docs/decisions/0017-one-controller-fenced.md).
//!
//! Report queues now carry `x-single-active-consumer`. RabbitMQ refuses to
//! declare an existing queue with different arguments (406 PRECONDITION_FAILED,
//! which closes the channel), and no policy can add that argument: the queue must
//! be deleted and declared again, and a queue can only be deleted without loss
//! when it is empty. So, once per queue, the controller (holding the fence, so
//! nothing else consumes) does this:
//!
//! 1. declare a holding queue `<queue>.upgrade` (bounded like the queue,
//!    `reject-publish`, dead-lettering into `reports`) and bind it like the
//!    queue: from now on what agents publish lands there too;
//! 2. unbind the old queue: nothing new lands in it;
//! 3. if it is empty, delete it (`if-empty`, `if-unused`), declare it with the
//!    new arguments, bind it; else this broker session consumes the old queue as
//!    it is until it is empty ([`wait_drained`]) and the next session does 3;
//! 4. unbind the holding queue and move what it holds into the new queue by
//!    rejecting each message: the broker dead-letters it into `reports` with its
//!    own routing key and properties (`user_id` included, which a republish
//!    could not keep), and `reports` routes it to the new queue; then delete it.
//!
//! At every moment some queue is bound for the kind, so no report is unroutable.
//! A report published between steps 1 and 2, or between the new queue's binding
//! and step 4, is in two queues: the inbox (hello, applied, units) or
//! idempotence (heartbeats) makes the second copy harmless. Each step is
//! idempotent; a crash between steps is finished by the next session.

use std::time::Duration;

use lapin::options::{
    BasicGetOptions, BasicNackOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, Connection, ErrorKind};
use mesh_protocol::ReportKind;
use mesh_protocol::topology::{self, REPORTS_EXCHANGE};
use tokio_util::sync::CancellationToken;

use crate::amqp::{self, AmqpResult, QueueType};

/// The holding queue of `kind`'s report queue during its upgrade.
pub fn holding_queue(kind: ReportKind) -> String {
    format!("{}.upgrade", topology::report_queue(kind))
}

fn binding_key(kind: ReportKind) -> String {
    format!("*.{}", kind.as_str())
}

/// Is `e` the broker refusing a declare because the existing queue lacks (or
/// has another) `x-single-active-consumer`?
pub fn is_single_active_consumer_mismatch(e: &lapin::Error) -> bool {
    match e.kind() {
        ErrorKind::ProtocolError(amqp) => {
            matches!(
                amqp.kind(),
                AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED)
            ) && amqp
                .get_message()
                .as_str()
                .contains(amqp::SINGLE_ACTIVE_CONSUMER)
        }
        _ => false,
    }
}

/// Is `e` the broker refusing a declare because the existing queue is of
/// another type (`x-queue-type`)?
pub fn is_queue_type_mismatch(e: &lapin::Error) -> bool {
    is_precondition_failed(e)
        && matches!(e.kind(), ErrorKind::ProtocolError(amqp)
            if amqp.get_message().as_str().contains(amqp::QUEUE_TYPE))
}

fn is_precondition_failed(e: &lapin::Error) -> bool {
    matches!(e.kind(), ErrorKind::ProtocolError(amqp)
        if matches!(amqp.kind(), AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED)))
}

fn durable() -> QueueDeclareOptions {
    QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    }
}

fn passive() -> QueueDeclareOptions {
    QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    }
}

/// The holding queue's arguments: the kind's length limit, `reject-publish`
/// (an overflow is refused to the agent, which retries, and is never
/// dead-lettered), and `reports` as its dead-letter exchange, for step 4.
/// Always a classic queue, whatever `queue_type`: it lives for one upgrade
/// only, and [`finish`] deletes it `if-empty`, which the broker refuses on a
/// quorum queue (a connection error, 540 NOT_IMPLEMENTED).
fn holding_args(kind: ReportKind) -> FieldTable {
    let mut args = FieldTable::default();
    for (k, v) in amqp::report_queue_bound(kind).inner() {
        args.insert(k.clone(), v.clone());
    }
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString(LongString::from("reject-publish")),
    );
    args.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString(LongString::from(REPORTS_EXCHANGE)),
    );
    args
}

/// Bring every report queue to today's arguments where that can be done now,
/// before `amqp::declare_topology`. Returns the kinds whose old queue still
/// holds reports: this session must consume it as it is (and must not declare
/// or bind it); [`wait_drained`] ends the session once it is empty, and the
/// next session finishes the upgrade.
pub async fn prepare(conn: &Connection, queue_type: QueueType) -> AmqpResult<Vec<ReportKind>> {
    let mut draining = Vec::new();
    for kind in ReportKind::ALL {
        if !prepare_one(conn, kind, queue_type).await? {
            draining.push(kind);
        }
    }
    Ok(draining)
}

/// True when `kind`'s queue has today's arguments (now).
async fn prepare_one(
    conn: &Connection,
    kind: ReportKind,
    queue_type: QueueType,
) -> AmqpResult<bool> {
    let queue = topology::report_queue(kind);
    let ch = conn.create_channel().await?;
    match ch
        .queue_declare(
            queue.as_str().into(),
            amqp::report_queue_options(kind, queue_type),
            amqp::report_queue_args(kind, queue_type),
        )
        .await
    {
        Ok(_) => {
            let _ = ch.close(200, "declared".into()).await;
            // A holding queue left by an upgrade a crash interrupted.
            finish(conn, kind).await?;
            return Ok(true);
        }
        Err(e) if is_single_active_consumer_mismatch(&e) => {}
        // A classic queue (an older controller's, or `queue_type` classic
        // before) where a quorum queue is wanted: the same upgrade. The old
        // queue is classic, so step 3's `if-empty` delete works (quorum
        // queues refuse `if-empty` and `if-unused` with a connection error).
        Err(e) if is_queue_type_mismatch(&e) && queue_type == QueueType::Quorum => {}
        Err(e) => return Err(e),
    }
    // The refusal closed that channel.
    let ch = conn.create_channel().await?;
    let holding = holding_queue(kind);
    let key = binding_key(kind);
    // Steps 1 and 2: the holding queue catches new reports; the old queue none.
    ch.queue_declare(holding.as_str().into(), durable(), holding_args(kind))
        .await?;
    ch.queue_bind(
        holding.as_str().into(),
        REPORTS_EXCHANGE.into(),
        key.as_str().into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    ch.queue_unbind(
        queue.as_str().into(),
        REPORTS_EXCHANGE.into(),
        key.as_str().into(),
        FieldTable::default(),
    )
    .await?;
    let old = ch
        .queue_declare(queue.as_str().into(), passive(), FieldTable::default())
        .await?;
    if old.message_count() > 0 || old.consumer_count() > 0 {
        tracing::warn!(
            queue,
            reports = old.message_count(),
            holding,
            "report queue declared by an older controller (without single-active-consumer): \
             new reports collect in the holding queue while this session drains it; \
             the next session replaces it"
        );
        let _ = ch.close(200, "draining".into()).await;
        return Ok(false);
    }
    // Step 3: empty and unused; `if_empty` guards against a report that
    // arrived before the unbind.
    match ch
        .queue_delete(
            queue.as_str().into(),
            QueueDeleteOptions {
                if_empty: true,
                if_unused: true,
                nowait: false,
            },
        )
        .await
    {
        Ok(_) => {}
        Err(e) if is_precondition_failed(&e) => {
            tracing::warn!(queue, "report queue not empty yet: draining it first");
            return Ok(false);
        }
        Err(e) => return Err(e),
    }
    ch.queue_declare(
        queue.as_str().into(),
        amqp::report_queue_options(kind, queue_type),
        amqp::report_queue_args(kind, queue_type),
    )
    .await?;
    ch.queue_bind(
        queue.as_str().into(),
        REPORTS_EXCHANGE.into(),
        key.as_str().into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    let _ = ch.close(200, "upgraded".into()).await;
    let moved = finish(conn, kind).await?;
    tracing::info!(
        queue,
        moved,
        "report queue upgraded to single-active-consumer; reports held meanwhile moved into it"
    );
    Ok(true)
}

/// Step 4: move what `kind`'s holding queue holds into the (new) report queue
/// and delete it. Returns how many reports moved (0 when there is none).
async fn finish(conn: &Connection, kind: ReportKind) -> AmqpResult<u64> {
    let holding = holding_queue(kind);
    let ch = conn.create_channel().await?;
    // Declared, not probed: a passive declare of a missing queue closes the
    // channel and lapin logs that as an error, at every session start. In the
    // usual case (no upgrade under way) this makes an unbound, empty holding
    // queue that the lines below delete again.
    ch.queue_declare(holding.as_str().into(), durable(), holding_args(kind))
        .await?;
    ch.queue_unbind(
        holding.as_str().into(),
        REPORTS_EXCHANGE.into(),
        binding_key(kind).as_str().into(),
        FieldTable::default(),
    )
    .await?;
    let moved = move_all(&ch, &holding).await?;
    ch.queue_delete(
        holding.as_str().into(),
        QueueDeleteOptions {
            if_empty: true,
            ..QueueDeleteOptions::default()
        },
    )
    .await?;
    let _ = ch.close(200, "moved".into()).await;
    Ok(moved)
}

/// Reject every message of `queue` (no requeue): each is dead-lettered into
/// `reports` as it was published, in order, batch by batch.
async fn move_all(ch: &Channel, queue: &str) -> AmqpResult<u64> {
    let mut moved = 0;
    loop {
        let mut last = None;
        for _ in 0..200 {
            match ch
                .basic_get(queue.into(), BasicGetOptions { no_ack: false })
                .await?
            {
                Some(msg) => last = Some(msg.delivery.delivery_tag),
                None => break,
            }
            moved += 1;
        }
        let Some(tag) = last else {
            return Ok(moved);
        };
        ch.basic_nack(
            tag,
            BasicNackOptions {
                multiple: true,
                requeue: false,
            },
        )
        .await?;
    }
}

/// For a session that consumes old queues (`draining`): return once every one
/// of them was empty at two checks a second apart, which ends the session so
/// that the next one finishes their upgrade. Pending forever when `draining`
/// is empty; returns at `shutdown`.
pub async fn wait_drained(
    conn: &Connection,
    draining: &[ReportKind],
    shutdown: CancellationToken,
) -> AmqpResult<()> {
    if draining.is_empty() {
        shutdown.cancelled().await;
        return Ok(());
    }
    let ch = conn.create_channel().await?;
    let mut empty_before = false;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
        let mut left = 0;
        for kind in draining {
            let queue = topology::report_queue(*kind);
            let q = ch
                .queue_declare(queue.as_str().into(), passive(), FieldTable::default())
                .await?;
            left += q.message_count();
        }
        if left == 0 && empty_before {
            tracing::info!(
                ?draining,
                "old report queues drained; restarting the broker session to replace them"
            );
            return Ok(());
        }
        empty_before = left == 0;
    }
}
