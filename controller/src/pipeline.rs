//! The consumer pipeline: take a batch of deliveries from one queue, refuse what
//! cannot be trusted or read (dead-letter with the reason), hand the rest to the
//! contexts, and acknowledge only after every context committed.
//!
//! Guarantees: a delivery is acknowledged only after (a) the transactions that
//! handled it committed, or (b) its dead-letter copy was confirmed by the broker.
//! Assumptions: one consumer per queue and channel, so delivery tags grow within
//! a batch and from batch to batch; batches are acknowledged in delivery order,
//! so an ack with `multiple` covers the batch and committed batches before it.
//! Heartbeat batches are handled up to three at once (their handling commutes);
//! hello batches two at once, handled in turn (the next batch's queues are
//! declared while the one before is handled); every other queue's one at a time.
//! Caveats: a transient failure (database down) holds the batch and retries it in
//! place with capped backoff; the broker keeps the rest, bounded by the prefetch.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::Confirmation;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection};
use mesh_plumbing::{HandlerError, OutboxSignal};
use mesh_protocol::topology;
use mesh_protocol::{
    Envelope, MAX_REPORT_BYTES, NodeId, RecordEvent, Report, ReportKind, UnknownFields,
};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::amqp::{self, DeclarationQueues, DeclareChannels, Refusal};
use crate::config::Settings;
use crate::metrics::{Metrics, ReasonLabels};
use crate::router::Contexts;

/// The decoded messages of one batch, in delivery order.
#[derive(Clone)]
enum Batch {
    Reports(Vec<Envelope<Report>>),
    Events(Vec<RecordEvent>),
}

impl Batch {
    /// The `n`th item alone.
    fn one(&self, n: usize) -> Batch {
        match self {
            Batch::Reports(r) => Batch::Reports(r.get(n).cloned().into_iter().collect()),
            Batch::Events(e) => Batch::Events(e.get(n).cloned().into_iter().collect()),
        }
    }
}

/// Which queue a consumer drains.
#[derive(Debug, Clone, Copy)]
pub enum Source {
    Reports(ReportKind),
    Record(&'static str),
    /// The alternate exchange's queue of `reports`: every message in it is
    /// dead-lettered with reason `unroutable`.
    Unroutable,
}

impl Source {
    pub fn queue(self) -> String {
        match self {
            Source::Reports(kind) => topology::report_queue(kind),
            Source::Record(context) => topology::record_queue(context),
            Source::Unroutable => topology::UNROUTABLE_QUEUE.to_owned(),
        }
    }
}

/// For tests of crash safety only: when `MESH_FAILPOINT_EXIT_AFTER_COMMIT` names a
/// report kind, the process exits right after committing the first batch of that
/// kind and before acknowledging it, as a crash at the worst moment would.
pub const FAILPOINT_ENV: &str = "MESH_FAILPOINT_EXIT_AFTER_COMMIT";

pub struct Pipeline {
    pub contexts: Arc<Contexts>,
    pub metrics: Metrics,
    pub settings: Settings,
    pub declaration_queues: Arc<DeclarationQueues>,
    pub signal: OutboxSignal,
    pub failpoint: Option<String>,
    /// Where `logs` answers go: to the requests waiting for them, in memory
    /// (never to a context; decision 0033).
    pub logs: Arc<crate::logs::LogsHub>,
}

#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error("broker: {0}")]
    Broker(#[from] lapin::Error),
    #[error("the broker cancelled the consumer of {0}")]
    Cancelled(String),
    #[error("the broker refused a dead-letter copy from {0}")]
    DeadLetterRefused(String),
    #[error("a batch task failed: {0}")]
    Task(String),
}

/// How many batches of `source` may be handled at once. Heartbeats: 3, because
/// their handling is idempotent and order-free (greatest last_seen, last_seq and
/// generation; rows locked in key order, so concurrent batches cannot deadlock)
/// and overlapping the next batch's collection and statements with the previous
/// batch's commit is what keeps ingest near the ideal pipeline. Everything else:
/// 1, so that a node's reports of one kind are handled in the order it sent them.
/// Hellos: 2, handled in turn (below): while a batch is handled, the next one
/// is collected and its nodes' declaration queues are created, which is what
/// bounds a fleet's join (decision 0024).
fn batches_in_flight(source: Source) -> usize {
    match source {
        Source::Reports(ReportKind::Heartbeat) => 3,
        Source::Reports(ReportKind::Hello) => 2,
        _ => 1,
    }
}

/// Whether the batches of `source` that are in flight together are handled in
/// turn: each is prepared at once (authenticated, its queues declared) but
/// handled only after the batch before it committed, so a node's reports of
/// that kind still take effect in the order it sent them.
fn handled_in_turn(source: Source) -> bool {
    matches!(source, Source::Reports(ReportKind::Hello))
}

/// A batch's turn to be handled, for a queue handled in turn: it waits for
/// the batch before it to commit, and says when it committed. Empty (no
/// waiting) for every other queue.
#[derive(Default)]
struct Turn {
    before: Option<oneshot::Receiver<()>>,
    committed: Option<oneshot::Sender<()>>,
}

impl Turn {
    /// Wait for the batch before to commit. False if it ended without
    /// committing (shutdown, or a failure that ends the consumer): then this
    /// batch is not handled either, and its deliveries stay unacknowledged.
    async fn wait(&mut self) -> bool {
        match self.before.take() {
            Some(before) => before.await.is_ok(),
            None => true,
        }
    }

    fn committed(&mut self) {
        if let Some(done) = self.committed.take() {
            // The batch after may be gone (consumer ending): nothing to tell.
            let _ = done.send(());
        }
    }
}

type BatchTask = JoinHandle<Result<Handled, PipelineError>>;

/// Batch tasks of one consumer; aborted when the consumer ends, so that none
/// outlives its channel (what they did not acknowledge is delivered again).
#[derive(Default)]
struct InFlight(VecDeque<BatchTask>);

impl Drop for InFlight {
    fn drop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
    }
}

/// A batch whose handling ended.
struct Handled {
    batch: Vec<Delivery>,
    started: Instant,
    /// False when shutdown interrupted it before commit.
    done: bool,
}

/// What the consumer loop does next.
enum Step {
    Stop,
    Done(Result<Result<Handled, PipelineError>, tokio::task::JoinError>),
    /// The first delivery of the next batch (boxed: a delivery is large).
    Delivery(Box<Option<Result<Delivery, lapin::Error>>>),
}

/// The oldest batch in flight, once handled (pending forever when none is).
async fn head(
    in_flight: &mut VecDeque<BatchTask>,
) -> Result<Result<Handled, PipelineError>, tokio::task::JoinError> {
    match in_flight.front_mut() {
        Some(h) => h.await,
        None => std::future::pending().await,
    }
}

impl Pipeline {
    /// Consume `source` until `shutdown` or a broker error. Unacknowledged
    /// deliveries return to the queue when the channel closes.
    pub async fn consume(
        self: Arc<Self>,
        conn: Arc<Connection>,
        source: Source,
        shutdown: CancellationToken,
    ) -> Result<(), PipelineError> {
        let queue = source.queue();
        let ch = conn.create_channel().await?;
        ch.basic_qos(self.settings.prefetch, BasicQosOptions::default())
            .await?;
        let dead_letters = amqp::confirm_channel(&conn).await?;
        // Hellos declare their nodes' queues, many at once (decision 0024).
        let declare = match source {
            Source::Reports(ReportKind::Hello) => {
                Some(Arc::new(DeclareChannels::open(&conn).await?))
            }
            _ => None,
        };
        let mut consumer = ch
            .basic_consume(
                queue.as_str().into(),
                format!("controller.{queue}").as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        tracing::info!(queue, "consuming");
        let batch_max = self.settings.batch_max.max(1);
        let depth = batches_in_flight(source);
        let in_turn = handled_in_turn(source);
        // The last batch's commit, which the next batch of a queue handled in
        // turn waits for.
        let mut previous: Option<oneshot::Receiver<()>> = None;
        // Batches being handled, oldest first. Each is handled by its own task
        // while the next is collected; they are acknowledged strictly in order,
        // so an ack with `multiple` covers only committed batches.
        let mut in_flight = InFlight::default();
        let in_flight = &mut in_flight.0;
        loop {
            let step = if in_flight.len() >= depth {
                Step::Done(head(in_flight).await)
            } else {
                tokio::select! {
                    _ = shutdown.cancelled() => Step::Stop,
                    done = head(in_flight), if !in_flight.is_empty() => Step::Done(done),
                    d = consumer.next() => Step::Delivery(Box::new(d)),
                }
            };
            let first = match step {
                Step::Stop => return Ok(()),
                Step::Done(done) => {
                    in_flight.pop_front();
                    if !self.finish(&queue, done).await? {
                        // Shutting down in the middle of retries: leave it unacked.
                        return Ok(());
                    }
                    continue;
                }
                Step::Delivery(d) => *d,
            };
            let mut batch = match first {
                Some(d) => vec![d?],
                None => return Err(PipelineError::Cancelled(queue)),
            };
            let deadline = tokio::time::Instant::now() + self.settings.batch_wait();
            while batch.len() < batch_max {
                match tokio::time::timeout_at(deadline, consumer.next()).await {
                    Ok(Some(d)) => batch.push(d?),
                    Ok(None) | Err(_) => break,
                }
            }
            let mut turn = Turn::default();
            if in_turn {
                let (committed, next) = oneshot::channel();
                turn = Turn {
                    before: previous.replace(next),
                    committed: Some(committed),
                };
            }
            let this = self.clone();
            let dead_letters = dead_letters.clone();
            let declare = declare.clone();
            let queue = queue.clone();
            let shutdown = shutdown.clone();
            in_flight.push_back(tokio::spawn(async move {
                let started = Instant::now();
                let span = tracing::debug_span!("batch", queue = %queue, size = batch.len());
                let done = this
                    .process(
                        &dead_letters,
                        declare.as_deref(),
                        turn,
                        source,
                        &queue,
                        &batch,
                        &shutdown,
                    )
                    .instrument(span)
                    .await?;
                Ok(Handled {
                    batch,
                    started,
                    done,
                })
            }));
        }
    }

    /// Acknowledge a handled batch (all batches before it are acknowledged
    /// already) and count it. Returns false if shutdown interrupted it.
    async fn finish(
        &self,
        queue: &str,
        done: Result<Result<Handled, PipelineError>, tokio::task::JoinError>,
    ) -> Result<bool, PipelineError> {
        let handled = done.map_err(|e| PipelineError::Task(e.to_string()))??;
        if !handled.done {
            return Ok(false);
        }
        if let Some(last) = handled.batch.last() {
            last.acker.ack(BasicAckOptions { multiple: true }).await?;
        }
        let labels = Metrics::queue(queue);
        self.metrics
            .handled
            .get_or_create(&labels)
            .inc_by(handled.batch.len() as u64);
        self.metrics
            .batch_seconds
            .get_or_create(&labels)
            .observe(handled.started.elapsed().as_secs_f64());
        Ok(true)
    }

    /// Handle one batch. Returns false when shutdown interrupted it before commit.
    /// `declare`: the channels a hello batch declares its nodes' queues on;
    /// `turn`: when it may be handled.
    #[allow(clippy::too_many_arguments)]
    async fn process(
        &self,
        dead_letters: &Channel,
        declare: Option<&DeclareChannels>,
        mut turn: Turn,
        source: Source,
        queue: &str,
        batch: &[Delivery],
        shutdown: &CancellationToken,
    ) -> Result<bool, PipelineError> {
        match source {
            Source::Reports(kind) => {
                let mut refused = Vec::new();
                let mut good = Vec::with_capacity(batch.len());
                // Once per batch, from memory (decision 0050).
                let revoked = self.contexts.inventory.revoked_nodes();
                for (i, d) in batch.iter().enumerate() {
                    match authenticate(kind, d) {
                        Ok((env, _)) if revoked.contains(&env.node) => {
                            refused.push((i, revoked_refusal(&env.node)))
                        }
                        Ok((env, unknown)) => {
                            self.note_unknown(kind.as_str(), &env.node, &unknown);
                            good.push((i, env));
                        }
                        Err(r) => refused.push((i, r)),
                    }
                }
                if kind == ReportKind::Logs {
                    // Answers to logs requests: to whoever waits for each,
                    // in memory; nothing to commit, nothing to wake.
                    for (i, env) in good {
                        if let Err(r) = self.logs.answer(&env) {
                            refused.push((i, r));
                        }
                    }
                    self.dead_letter(dead_letters, queue, batch, refused)
                        .await?;
                    return Ok(true);
                }
                self.dead_letter(dead_letters, queue, batch, refused)
                    .await?;
                if let Some(channels) = declare {
                    // A node that said hello can consume its declaration queue
                    // at once; and it exists before anything this batch causes
                    // to be declared to the node is committed (decision 0024).
                    let nodes: Vec<&NodeId> = good.iter().map(|(_, e)| &e.node).collect();
                    self.declaration_queues.ensure_all(channels, &nodes).await?;
                }
                let indices = good.iter().map(|(i, _)| *i).collect();
                let items = Batch::Reports(good.iter().map(|(_, e)| e.clone()).collect());
                if !turn.wait().await {
                    return Ok(false);
                }
                let Some(refused) = self.handle(queue, source, indices, items, shutdown).await
                else {
                    return Ok(false);
                };
                turn.committed();
                self.dead_letter(dead_letters, queue, batch, refused)
                    .await?;
                if self.failpoint.as_deref() == Some(kind.as_str()) {
                    tracing::warn!("failpoint: exiting after commit, before ack");
                    std::process::exit(86);
                }
            }
            Source::Record(_) => {
                let mut refused = Vec::new();
                let mut good = Vec::with_capacity(batch.len());
                for (i, d) in batch.iter().enumerate() {
                    match RecordEvent::decode_noting(&d.data) {
                        Ok((e, unknown)) => {
                            if !unknown.is_empty() {
                                let key = e.routing_key();
                                tracing::debug!(key, fields = ?unknown.paths, "ignored unknown fields");
                                self.metrics.unknown_fields(&key, &unknown);
                            }
                            good.push((i, e));
                        }
                        Err(e) => refused.push((i, Refusal::new(e.metric_label(), e.to_string()))),
                    }
                }
                self.dead_letter(dead_letters, queue, batch, refused)
                    .await?;
                let indices = good.iter().map(|(i, _)| *i).collect();
                let items = Batch::Events(good.into_iter().map(|(_, e)| e).collect());
                let Some(refused) = self.handle(queue, source, indices, items, shutdown).await
                else {
                    return Ok(false);
                };
                self.dead_letter(dead_letters, queue, batch, refused)
                    .await?;
            }
            Source::Unroutable => {
                let refused = batch.iter().map(unroutable).enumerate().collect();
                self.dead_letter(dead_letters, queue, batch, refused)
                    .await?;
                return Ok(true);
            }
        }
        // Handlers may have written outboxes: wake the relay.
        self.signal.notify();
        Ok(true)
    }

    /// Count the fields a report carried that this version does not know: a
    /// newer agent's additions, ignored (docs/protocol.md, Compatibility).
    fn note_unknown(&self, kind: &str, node: &NodeId, unknown: &UnknownFields) {
        if unknown.is_empty() {
            return;
        }
        tracing::debug!(kind, %node, fields = ?unknown.paths, "ignored unknown fields");
        self.metrics.unknown_fields(kind, unknown);
    }

    /// Hand `items` (taken from the batch at `indices`) to the contexts,
    /// retrying transient failures in place with capped backoff. On a permanent
    /// failure of several items, each is tried alone so that only the poisonous
    /// one is refused. Returns the refused items, or None if shutdown came first.
    async fn handle(
        &self,
        queue: &str,
        source: Source,
        indices: Vec<usize>,
        items: Batch,
        shutdown: &CancellationToken,
    ) -> Option<Vec<(usize, Refusal)>> {
        if indices.is_empty() {
            return Some(Vec::new());
        }
        match self.retry(queue, source, &items, shutdown).await? {
            Ok(()) => Some(Vec::new()),
            Err(e) if indices.len() == 1 => {
                Some(vec![(indices[0], Refusal::new("handler", e.to_string()))])
            }
            Err(_) => {
                let mut refused = Vec::new();
                for (n, i) in indices.into_iter().enumerate() {
                    if let Err(e) = self.retry(queue, source, &items.one(n), shutdown).await? {
                        refused.push((i, Refusal::new("handler", e.to_string())));
                    }
                }
                Some(refused)
            }
        }
    }

    async fn dispatch(&self, source: Source, items: &Batch) -> Result<(), HandlerError> {
        match (source, items) {
            (Source::Reports(ReportKind::Heartbeat), Batch::Reports(reports)) => {
                let durable = self.contexts.route_heartbeats(reports).await?;
                self.metrics.heartbeats(reports.len(), durable);
                Ok(())
            }
            (Source::Reports(kind), Batch::Reports(reports)) => {
                self.contexts.route_reports(kind, reports).await
            }
            (Source::Record(context), Batch::Events(events)) => {
                self.contexts.route_events(context, events).await
            }
            _ => Err(HandlerError::Permanent(
                "items do not match their queue".into(),
            )),
        }
    }

    /// Dispatch while it fails transiently. Returns its permanent outcome, or
    /// None if shutdown came first.
    async fn retry(
        &self,
        queue: &str,
        source: Source,
        items: &Batch,
        shutdown: &CancellationToken,
    ) -> Option<Result<(), HandlerError>> {
        let mut delay = Duration::from_millis(100);
        loop {
            match self.dispatch(source, items).await {
                Err(e) if e.is_transient() => {
                    self.metrics
                        .retried
                        .get_or_create(&Metrics::queue(queue))
                        .inc();
                    tracing::warn!(queue, error = %e, retry_in_ms = delay.as_millis() as u64, "transient failure; holding the batch");
                    tokio::select! {
                        _ = shutdown.cancelled() => return None,
                        _ = tokio::time::sleep(delay) => {}
                    }
                    delay = (delay * 2).min(Duration::from_secs(5));
                }
                outcome => return Some(outcome),
            }
        }
    }

    /// Publish a copy of each refused delivery to the dead-letter exchange and
    /// wait for the broker's confirms (pipelined).
    async fn dead_letter(
        &self,
        ch: &Channel,
        queue: &str,
        batch: &[Delivery],
        refused: Vec<(usize, Refusal)>,
    ) -> Result<(), PipelineError> {
        let mut confirms = Vec::with_capacity(refused.len());
        for (i, refusal) in &refused {
            let d = &batch[*i];
            tracing::warn!(
                queue,
                message_id = ?d.properties.message_id().as_ref().map(|s| s.as_str()),
                user = ?d.properties.user_id().as_ref().map(|s| s.as_str()),
                code = refusal.code,
                reason = %refusal.reason,
                "dead-lettering",
            );
            confirms.push(amqp::dead_letter(ch, queue, &d.data, &d.properties, refusal).await?);
            let labels = ReasonLabels {
                queue: queue.to_owned(),
                reason: refusal.code.to_owned(),
            };
            self.metrics.dead_lettered.get_or_create(&labels).inc();
        }
        for c in confirms {
            match c.await? {
                Confirmation::Ack(_) | Confirmation::NotRequested => {}
                Confirmation::Nack(_) => {
                    return Err(PipelineError::DeadLetterRefused(queue.to_owned()));
                }
            }
        }
        Ok(())
    }
}

/// Why a message the broker routed to the unroutable queue is refused: its
/// routing key matched no queue of `reports` (a kind this controller does not
/// know, or a key that is not `<node>.<kind>`).
pub fn unroutable(d: &Delivery) -> Refusal {
    let sender = d.properties.user_id().as_ref().map_or_else(
        || "an unknown sender".to_owned(),
        |u| format!("`{}`", u.as_str()),
    );
    Refusal::new(
        "unroutable",
        format!(
            "routing key `{}` from {sender} matches no queue: not `<node>.<kind>` with a report kind this controller knows",
            d.routing_key.as_str()
        ),
    )
}

/// Why a report of a revoked node is refused (decision 0050): it is never
/// recorded, not even as liveness, until an admin re-admits the node.
pub fn revoked_refusal(node: &NodeId) -> Refusal {
    Refusal::new(
        "revoked",
        format!(
            "node `{node}` is revoked: its reports are refused until an admin re-admits it with `meshctl node readmit {node}`"
        ),
    )
}

/// Establish who sent a report and read it. The sender is the broker-validated
/// `user_id`, never the body: a body that names another node is refused. Fields
/// this version does not know are ignored and returned, to be counted.
pub fn authenticate(
    kind: ReportKind,
    d: &Delivery,
) -> Result<(Envelope<Report>, UnknownFields), Refusal> {
    let Some(user) = d.properties.user_id() else {
        return Err(Refusal::new(
            "unauthenticated",
            "the report has no user_id property, so its sender is unknown",
        ));
    };
    let node = NodeId::parse(user.as_str()).map_err(|_| {
        Refusal::new(
            "unauthenticated",
            format!("user_id `{}` is not a node", user.as_str()),
        )
    })?;
    let (env, unknown) = Envelope::<Report>::decode_noting(&d.data, MAX_REPORT_BYTES)
        .map_err(|e| Refusal::new(e.metric_label(), format!("from {node}: {e}")))?;
    let span =
        tracing::debug_span!("report", message_id = %env.id, node = %node, kind = env.kind());
    let _enter = span.enter();
    if env.node != node {
        return Err(Refusal::new(
            "impersonation",
            format!(
                "the body names node `{}` but the sender is `{node}`",
                env.node
            ),
        ));
    }
    if env.body.report_kind() != kind {
        return Err(Refusal::new(
            "wrong_queue",
            format!(
                "a {} report arrived on the {} queue",
                env.kind(),
                kind.as_str()
            ),
        ));
    }
    let expected_key = topology::report_routing_key(&node, kind);
    if d.routing_key.as_str() != expected_key {
        return Err(Refusal::new(
            "routing_key",
            format!(
                "routing key `{}` does not match `{expected_key}`",
                d.routing_key.as_str()
            ),
        ));
    }
    tracing::trace!("accepted");
    Ok((env, unknown))
}
