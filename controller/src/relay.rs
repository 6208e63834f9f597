//! The outbox relay: publishes what handlers wrote to their outboxes, with
//! publisher confirms, and marks rows sent only once the broker confirmed them.
//!
//! Guarantees: every outbox row is published at least once; a row is marked
//! sent only after an Ack that did not return it unroutable.
//! Assumptions: receivers are idempotent (agents apply the newest generation;
//! contexts keep an inbox), so a publish repeated after a crash is harmless.
//! Caveats: a declaration returned unroutable means its node's queue is missing:
//! the queue is declared again and the row retried on the next round.
//!
//! Rounds are pipelined: up to `WINDOW` rounds are in flight, each settled
//! (confirms awaited, rows marked sent) by its own task while the next round is
//! read and published. A cursor keeps in-flight rows from being read twice; it
//! is dropped whenever nothing is in flight, so a row committed below it (ids
//! are allocated before commit) or refused is read on the next pass.

use std::collections::HashMap;
use std::sync::Arc;

use lapin::Confirmation;
use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Connection};
use mesh_plumbing::OutboxSignal;
use mesh_plumbing::outbox::{self, OutboxRow};
use mesh_protocol::topology::{DECLARATIONS_EXCHANGE, SIGNATURE_HEADER};
use mesh_protocol::{DeclarationSigner, NodeId, Section};
use sqlx::PgPool;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::amqp::{self, DeclarationQueues};
use crate::metrics::Metrics;
use crate::router::Contexts;

/// Rounds in flight at once, each up to `batch` rows: the relay reads and
/// publishes the next round while the broker confirms the ones before it.
const WINDOW: usize = 4;

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

/// One round handed to the broker: its rows and their pending confirms.
struct Round {
    schema: &'static str,
    pool: PgPool,
    published: Vec<Published>,
}

/// What the broker made of a round.
/// One row published in a round, awaiting its confirm.
struct Published {
    id: i64,
    node: Option<NodeId>,
    declaration: bool,
    /// A declaration's section and generation (raise the in-step index once
    /// confirmed).
    declared: Option<(Section, u64)>,
    confirm: lapin::PublisherConfirm,
}

struct Settled {
    /// Some publish was refused or returned: its row waits for a later round.
    refused: bool,
}

impl Relay {
    pub async fn run(
        self: Arc<Self>,
        conn: Arc<Connection>,
        shutdown: CancellationToken,
    ) -> Result<(), lapin::Error> {
        let mut ch = amqp::confirm_channel(&conn).await?;
        // A round the broker refused part of opens a fresh channel for the
        // rounds after it: a channel that published to a quorum queue whose
        // leader's node died can keep being refused for that queue after a
        // new leader is elected (seen on a three-node cluster, RabbitMQ 3.10,
        // e2e/tests/mesh_on_cluster.rs), while a new channel finds the leader.
        let mut reopen = false;
        let schemas = self.contexts.schemas();
        // Per schema, the highest id handed to the broker while rounds are in
        // flight: the next round reads on past it instead of waiting for the
        // confirms (and the UPDATE) of the rounds before it.
        let mut cursor: HashMap<&'static str, i64> = HashMap::new();
        let mut in_flight: JoinSet<Result<Settled, lapin::Error>> = JoinSet::new();
        let mut more = true;
        loop {
            if more && in_flight.len() < WINDOW {
                if std::mem::take(&mut reopen) {
                    tracing::info!("a publish was refused: the relay opens a fresh channel");
                    let old = std::mem::replace(&mut ch, amqp::confirm_channel(&conn).await?);
                    // Rounds still in flight hold their confirms, not the channel.
                    tokio::spawn(async move {
                        let _ = old
                            .close(200, "replaced after a refused publish".into())
                            .await;
                    });
                }
                if in_flight.is_empty() {
                    // Nothing in flight: read from the oldest unsent row again,
                    // which picks up rows committed out of id order and rows
                    // refused or not marked sent.
                    cursor.clear();
                }
                more = false;
                for (schema, pool) in &schemas {
                    let after = cursor.get(schema).copied().unwrap_or(0);
                    let Some((round, last, full)) =
                        self.publish_round(&ch, schema, pool, after).await?
                    else {
                        continue;
                    };
                    more |= full;
                    cursor.insert(schema, last);
                    let relay = self.clone();
                    in_flight.spawn(async move { relay.settle(round).await });
                }
                continue;
            }
            tokio::select! {
                Some(done) = in_flight.join_next(), if !in_flight.is_empty() => {
                    let settled = match done {
                        Ok(settled) => settled?,
                        // A settle task panicked: its rows stay unsent and are read again.
                        Err(e) => {
                            tracing::error!(error = %e, "settling a relay round failed");
                            Settled { refused: true }
                        }
                    };
                    // A refused publish waits for the next wake-up instead of spinning.
                    if settled.refused {
                        more = false;
                        reopen = true;
                    }
                }
                _ = shutdown.cancelled() => return Ok(()),
                _ = self.signal.notified(), if !more => more = true,
                _ = tokio::time::sleep(self.poll), if !more => more = true,
            }
        }
    }

    /// Publish one batch of `schema`'s outbox rows above `after`. Returns the
    /// round, the highest id read, and whether the batch was full (more may be
    /// waiting); none when nothing is waiting.
    async fn publish_round(
        &self,
        ch: &lapin::Channel,
        schema: &'static str,
        pool: &PgPool,
        after: i64,
    ) -> Result<Option<(Round, i64, bool)>, lapin::Error> {
        let rows = match outbox::pending_after(pool, schema, after, self.batch).await {
            Ok(rows) => rows,
            Err(e) => {
                tracing::warn!(context = schema, error = %e, "reading the outbox failed; retrying next round");
                return Ok(None);
            }
        };
        let Some(last) = rows.last().map(|r| r.id) else {
            if after == 0 {
                let labels = Metrics::context(schema);
                self.metrics.outbox_backlog.get_or_create(&labels).set(0);
            }
            return Ok(None);
        };
        let full = rows.len() as i64 >= self.batch;
        let mut published = Vec::with_capacity(rows.len());
        for row in &rows {
            let node = row.node.as_deref().and_then(|n| NodeId::parse(n).ok());
            let declaration = row.exchange == DECLARATIONS_EXCHANGE;
            if declaration {
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
            // What a published declaration raises in the in-step index.
            let declared = declaration
                .then(|| peek_declaration(&row.payload))
                .flatten();
            published.push(Published {
                id: row.id,
                node,
                declaration,
                declared,
                confirm,
            });
        }
        let round = Round {
            schema,
            pool: pool.clone(),
            published,
        };
        Ok(Some((round, last, full)))
    }

    /// Wait for a round's confirms and mark what the broker took as sent.
    async fn settle(&self, round: Round) -> Result<Settled, lapin::Error> {
        let Round {
            schema,
            pool,
            published,
        } = round;
        let total = published.len();
        let mut sent = Vec::with_capacity(total);
        for Published {
            id,
            node,
            declaration,
            declared,
            confirm,
        } in published
        {
            match confirm.await? {
                Confirmation::Ack(None) | Confirmation::NotRequested => {
                    if let (Some(node), Some((section, generation))) = (&node, declared) {
                        self.contexts
                            .in_step
                            .declared(node.as_str(), section, generation, id);
                    }
                    sent.push(id);
                }
                Confirmation::Ack(Some(_returned)) => match node {
                    // The node's queue is gone: declare it again next round.
                    Some(node) if declaration => self.declaration_queues.forget(&node),
                    // A record event no context subscribes to: nobody is waiting for it.
                    _ => sent.push(id),
                },
                Confirmation::Nack(_) => {
                    tracing::warn!(
                        context = schema,
                        row = id,
                        "broker refused the publish (queue full?); retrying"
                    );
                }
            }
        }
        if let Err(e) = outbox::mark_sent(&pool, schema, &sent).await {
            // They will be published again: receivers are idempotent.
            tracing::warn!(context = schema, error = %e, "marking rows sent failed");
        }
        let labels = Metrics::context(schema);
        self.metrics
            .published
            .get_or_create(&labels)
            .inc_by(sent.len() as u64);
        self.metrics
            .outbox_backlog
            .get_or_create(&labels)
            .set((total - sent.len()) as i64);
        Ok(Settled {
            refused: sent.len() < total,
        })
    }
}

/// The section and generation of a declaration envelope (none when it does
/// not read as one: the relay publishes it all the same, and the in-step index
/// is not raised, so that node's heartbeats take the durable path).
fn peek_declaration(payload: &[u8]) -> Option<(Section, u64)> {
    #[derive(serde::Deserialize)]
    struct Peek {
        body: PeekBody,
    }
    #[derive(serde::Deserialize)]
    struct PeekBody {
        section: String,
        generation: u64,
    }
    let peek: Peek = serde_json::from_slice(payload).ok()?;
    Some((Section::parse(&peek.body.section)?, peek.body.generation))
}
