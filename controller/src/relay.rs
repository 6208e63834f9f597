//! The outbox relay: publishes what handlers wrote to their outboxes, with
//! publisher confirms, and marks rows sent only once the broker confirmed them.
//!
//! Guarantees: every outbox row is published at least once; a row is marked
//! sent only after an Ack that did not return it unroutable.
//! Assumptions: receivers are idempotent (agents apply the newest generation;
//! contexts keep an inbox), so a publish repeated after a crash is harmless.
//! Caveats: a declaration returned unroutable means its node's queue is missing:
//! the queue is declared again and the row retried on the next round.

use std::sync::Arc;

use lapin::Confirmation;
use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Connection};
use mesh_plumbing::OutboxSignal;
use mesh_plumbing::outbox::{self, OutboxRow};
use mesh_protocol::topology::{DECLARATIONS_EXCHANGE, SIGNATURE_HEADER};
use mesh_protocol::{DeclarationSigner, NodeId};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::amqp::{self, DeclarationQueues};
use crate::metrics::Metrics;
use crate::router::Contexts;

pub struct Relay {
    pub contexts: Arc<Contexts>,
    /// Signs every declaration (header `x-mesh-signature`); agents apply nothing
    /// unsigned.
    pub signer: Arc<DeclarationSigner>,
    pub metrics: Metrics,
    pub declaration_queues: Arc<DeclarationQueues>,
    pub signal: OutboxSignal,
    pub batch: i64,
    pub poll: std::time::Duration,
}

fn properties(row: &OutboxRow, signer: &DeclarationSigner) -> BasicProperties {
    let props = BasicProperties::default()
        .with_message_id(row.message_id.to_string().as_str().into())
        .with_type(row.kind.as_str().into())
        .with_content_type("application/json".into())
        .with_delivery_mode(2);
    if row.exchange != DECLARATIONS_EXCHANGE {
        return props;
    }
    // The signature covers the exact bytes published.
    let mut headers = FieldTable::default();
    headers.insert(
        SIGNATURE_HEADER.into(),
        AMQPValue::LongString(LongString::from(signer.sign_hex(&row.payload))),
    );
    props.with_headers(headers)
}

impl Relay {
    pub async fn run(
        self: Arc<Self>,
        conn: Arc<Connection>,
        shutdown: CancellationToken,
    ) -> Result<(), lapin::Error> {
        let ch = amqp::confirm_channel(&conn).await?;
        loop {
            let mut full = false;
            for (schema, pool) in self.contexts.schemas() {
                full |= self.round(&ch, schema, pool).await?;
            }
            if full {
                continue;
            }
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                _ = self.signal.notified() => {}
                _ = tokio::time::sleep(self.poll) => {}
            }
        }
    }

    /// Publish one batch of `schema`'s outbox. Returns true if the batch was full
    /// (more may be waiting).
    async fn round(
        &self,
        ch: &lapin::Channel,
        schema: &'static str,
        pool: &PgPool,
    ) -> Result<bool, lapin::Error> {
        let rows = match outbox::pending(pool, schema, self.batch).await {
            Ok(rows) => rows,
            Err(e) => {
                tracing::warn!(context = schema, error = %e, "reading the outbox failed; retrying next round");
                return Ok(false);
            }
        };
        let labels = Metrics::context(schema);
        if rows.is_empty() {
            self.metrics.outbox_backlog.get_or_create(&labels).set(0);
            return Ok(false);
        }
        let mut pending = Vec::with_capacity(rows.len());
        for row in &rows {
            let node = row.node.as_deref().and_then(|n| NodeId::parse(n).ok());
            if row.exchange == DECLARATIONS_EXCHANGE {
                match &node {
                    Some(node) => self.declaration_queues.ensure(ch, node).await?,
                    None => {
                        tracing::error!(
                            context = schema,
                            row = row.id,
                            "declaration without a valid node; skipped"
                        );
                        continue;
                    }
                }
            }
            let options = BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            };
            let confirm = ch
                .basic_publish(
                    row.exchange.as_str().into(),
                    row.routing_key.as_str().into(),
                    options,
                    &row.payload,
                    properties(row, &self.signer),
                )
                .await?;
            pending.push((row, node, confirm));
        }
        let mut sent = Vec::with_capacity(pending.len());
        for (row, node, confirm) in pending {
            match confirm.await? {
                Confirmation::Ack(None) | Confirmation::NotRequested => sent.push(row.id),
                Confirmation::Ack(Some(_returned)) => match node {
                    // The node's queue is gone: declare it again next round.
                    Some(node) if row.exchange == DECLARATIONS_EXCHANGE => {
                        self.declaration_queues.forget(&node)
                    }
                    // A record event no context subscribes to: nobody is waiting for it.
                    _ => sent.push(row.id),
                },
                Confirmation::Nack(_) => {
                    tracing::warn!(
                        context = schema,
                        row = row.id,
                        "broker refused the publish (queue full?); retrying"
                    );
                }
            }
        }
        if let Err(e) = outbox::mark_sent(pool, schema, &sent).await {
            // They will be published again: receivers are idempotent.
            tracing::warn!(context = schema, error = %e, "marking rows sent failed");
        }
        self.metrics
            .published
            .get_or_create(&labels)
            .inc_by(sent.len() as u64);
        self.metrics
            .outbox_backlog
            .get_or_create(&labels)
            .set((rows.len() - sent.len()) as i64);
        // Go again at once only if the batch was full and all of it went out;
        // a refused publish waits for the next round instead of spinning.
        Ok(rows.len() as i64 >= self.batch && sent.len() == rows.len())
    }
}
