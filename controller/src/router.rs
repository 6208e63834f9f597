//! Routing: which context handles which message. One exhaustive match per kind of
//! message, so adding a report kind is a compile error until it is routed.
//! What the contexts are and how they are built is in [`crate::contexts`].

use mesh_config::Config;
use mesh_connectivity::Connectivity;
use mesh_delivery::Delivery;
use mesh_identity::Identity;
use mesh_inventory::Inventory;
use mesh_observability::Observability;
use mesh_plumbing::{Context, HandlerError, inbox};
use mesh_protocol::{Envelope, RecordEvent, Report, ReportKind};
use mesh_provisioning::Provisioning;
use std::time::Instant;

use crate::metrics::{HandlerLabels, Histograms};

pub use crate::contexts::{Contexts, ContextsError};

impl Contexts {
    /// Hand a batch of authenticated reports of one kind to every context that
    /// owns a part of them. Each context commits its own transaction (its state,
    /// its inbox, its outbox); the caller acknowledges only after all committed.
    pub async fn route_reports(
        &self,
        kind: ReportKind,
        batch: &[Envelope<Report>],
    ) -> Result<(), HandlerError> {
        match kind {
            // hello: facts and labels (inventory), the seal key (config), the
            // overlay facts (connectivity); every context catches the node up on
            // its section (mesh_plumbing::section).
            // observability reads the outage the agent lived through;
            // delivery and provisioning catch the node up on their sections.
            ReportKind::Hello => {
                let (a, b, c, d) = tokio::join!(
                    all(
                        run(&self.handler_seconds, kind, &*self.inventory, batch, true),
                        run(&self.handler_seconds, kind, &*self.config, batch, true),
                        run(
                            &self.handler_seconds,
                            kind,
                            &*self.connectivity,
                            batch,
                            true
                        ),
                    ),
                    run(
                        &self.handler_seconds,
                        kind,
                        &*self.observability,
                        batch,
                        true
                    ),
                    run(&self.handler_seconds, kind, &*self.delivery, batch, true),
                    run(
                        &self.handler_seconds,
                        kind,
                        &*self.provisioning,
                        batch,
                        true
                    ),
                );
                a.and(b).and(c).and(d)
            }
            // heartbeat: liveness, in memory (inventory, written in batches);
            // only a heartbeat out of step with what was declared to its node,
            // or of a node not known alive, takes the durable path, where
            // inventory writes it at once and every context catches the node
            // up on its section (mesh_plumbing::section; decision 0023).
            // Idempotent by nature (last_seen only grows), so no inbox row per
            // heartbeat: that would double the cost of the hottest path.
            ReportKind::Heartbeat => self.route_heartbeats(batch).await.map(|_| ()),
            // units: what runs where (inventory owns assignments and units);
            // observability derives health and crash loops from them;
            // delivery's rollouts see which revision runs where.
            ReportKind::Units => {
                let (a, b, c) = tokio::join!(
                    run(&self.handler_seconds, kind, &*self.inventory, batch, true),
                    run(
                        &self.handler_seconds,
                        kind,
                        &*self.observability,
                        batch,
                        true
                    ),
                    run(&self.handler_seconds, kind, &*self.delivery, batch, true),
                );
                a.and(b).and(c)
            }
            // applied: what the node applied of each section (inventory records it
            // for every section; decision 0015); delivery reads its own
            // section's artifact outcomes (pulled and verified, or why not).
            ReportKind::Applied => {
                let (a, b) = tokio::join!(
                    run(&self.handler_seconds, kind, &*self.inventory, batch, true),
                    run(&self.handler_seconds, kind, &*self.delivery, batch, true),
                );
                a.and(b)
            }
            // certificates: CSRs to sign and what the node holds (connectivity).
            ReportKind::Certificates => {
                run(
                    &self.handler_seconds,
                    kind,
                    &*self.connectivity,
                    batch,
                    true,
                )
                .await
            }
            // logs: answers to logs requests, kept in memory by the pipeline
            // (crate::logs), never handed to a context (decision 0033).
            ReportKind::Logs => Err(HandlerError::Permanent(
                "a logs answer is for the controller's logs requests, not for a context".into(),
            )),
            // resources: what provider nodes found of their grants'
            // resources (provisioning; decision 0039).
            ReportKind::Resources => {
                run(
                    &self.handler_seconds,
                    kind,
                    &*self.provisioning,
                    batch,
                    true,
                )
                .await
            }
            // health: probe results (observability owns health and alerts).
            ReportKind::Health => {
                run(
                    &self.handler_seconds,
                    kind,
                    &*self.observability,
                    batch,
                    true,
                )
                .await
            }
        }
    }

    /// Heartbeats: liveness, in memory (inventory, written in batches); only
    /// those out of step with what was declared to their node, or of a node
    /// not known alive, take the durable path, where inventory writes them at
    /// once and every context catches the node up on its section. Returns how
    /// many took the durable path.
    pub async fn route_heartbeats(
        &self,
        batch: &[Envelope<Report>],
    ) -> Result<usize, HandlerError> {
        let durable = self.inventory.heard(batch, &self.in_step);
        if durable.is_empty() {
            return Ok(0);
        }
        all(
            run(
                &self.handler_seconds,
                ReportKind::Heartbeat,
                &*self.inventory,
                &durable,
                false,
            ),
            run(
                &self.handler_seconds,
                ReportKind::Heartbeat,
                &*self.config,
                &durable,
                false,
            ),
            run(
                &self.handler_seconds,
                ReportKind::Heartbeat,
                &*self.connectivity,
                &durable,
                false,
            ),
        )
        .await?;
        let (a, b) = tokio::join!(
            run(
                &self.handler_seconds,
                ReportKind::Heartbeat,
                &*self.delivery,
                &durable,
                false,
            ),
            run(
                &self.handler_seconds,
                ReportKind::Heartbeat,
                &*self.provisioning,
                &durable,
                false,
            ),
        );
        a.and(b)?;
        self.inventory.written_alive(&durable);
        Ok(durable.len())
    }

    /// Hand record events to the context whose record queue they came from.
    pub async fn route_events(
        &self,
        context: &str,
        events: &[RecordEvent],
    ) -> Result<(), HandlerError> {
        match context {
            c if c == Inventory::SCHEMA => {
                run_events(&self.handler_seconds, &*self.inventory, events).await
            }
            c if c == Config::SCHEMA => {
                run_events(&self.handler_seconds, &*self.config, events).await
            }
            c if c == Identity::SCHEMA => {
                run_events(&self.handler_seconds, &*self.identity, events).await
            }
            c if c == Connectivity::SCHEMA => {
                run_events(&self.handler_seconds, &*self.connectivity, events).await
            }
            c if c == Observability::SCHEMA => {
                run_events(&self.handler_seconds, &*self.observability, events).await
            }
            c if c == Delivery::SCHEMA => {
                run_events(&self.handler_seconds, &*self.delivery, events).await
            }
            c if c == Provisioning::SCHEMA => {
                run_events(&self.handler_seconds, &*self.provisioning, events).await
            }
            other => Err(HandlerError::Permanent(format!(
                "no context named `{other}`"
            ))),
        }
    }
}

/// Three contexts' transactions at once: they share nothing (own pools, own
/// schemas), and one consumer per queue is bound by the latency of a batch, so
/// running them side by side instead of one after the other shortens every
/// batch (docs/benchmarks.md). All must commit before the batch is acked; if
/// one fails, the retry repeats all, which the inbox (or, for heartbeats,
/// idempotence) makes harmless, as before.
async fn all(
    a: impl Future<Output = Result<(), HandlerError>>,
    b: impl Future<Output = Result<(), HandlerError>>,
    c: impl Future<Output = Result<(), HandlerError>>,
) -> Result<(), HandlerError> {
    let (a, b, c) = tokio::join!(a, b, c);
    a.and(b).and(c)
}

/// Record how long `context`'s transaction took for one batch of `kind`
/// (`mesh_controller_handler_duration_seconds`), failed or not.
fn observe(timer: &Histograms<HandlerLabels>, context: &str, kind: &str, started: Instant) {
    timer
        .get_or_create(&HandlerLabels {
            context: context.to_owned(),
            kind: kind.to_owned(),
        })
        .observe(started.elapsed().as_secs_f64());
}

async fn run<C: Context>(
    timer: &Histograms<HandlerLabels>,
    kind: ReportKind,
    ctx: &C,
    batch: &[Envelope<Report>],
    use_inbox: bool,
) -> Result<(), HandlerError> {
    let started = Instant::now();
    let outcome = handle_reports(ctx, batch, use_inbox).await;
    observe(timer, C::SCHEMA, kind.as_str(), started);
    outcome
}

async fn handle_reports<C: Context>(
    ctx: &C,
    batch: &[Envelope<Report>],
    use_inbox: bool,
) -> Result<(), HandlerError> {
    let mut tx = ctx.pool().begin().await?;
    if use_inbox {
        let ids: Vec<_> = batch.iter().map(|e| e.id).collect();
        let mut fresh = inbox::claim(&mut tx, C::SCHEMA, &ids).await?;
        // `remove` keeps one copy of a message delivered twice within the batch.
        let fresh: Vec<Envelope<Report>> = batch
            .iter()
            .filter(|e| fresh.remove(&e.id))
            .cloned()
            .collect();
        if fresh.len() < batch.len() {
            tracing::debug!(
                context = C::SCHEMA,
                duplicates = batch.len() - fresh.len(),
                "inbox filtered redeliveries"
            );
        }
        if !fresh.is_empty() {
            ctx.handle_reports(&mut tx, &fresh).await?;
        }
    } else {
        ctx.handle_reports(&mut tx, batch).await?;
    }
    tx.commit().await?;
    ctx.committed();
    Ok(())
}

async fn run_events<C: Context>(
    timer: &Histograms<HandlerLabels>,
    ctx: &C,
    events: &[RecordEvent],
) -> Result<(), HandlerError> {
    let started = Instant::now();
    let outcome = handle_events(ctx, events).await;
    observe(timer, C::SCHEMA, "record", started);
    outcome
}

async fn handle_events<C: Context>(ctx: &C, events: &[RecordEvent]) -> Result<(), HandlerError> {
    let mut tx = ctx.pool().begin().await?;
    let ids: Vec<_> = events.iter().map(|e| e.id).collect();
    let mut fresh = inbox::claim(&mut tx, C::SCHEMA, &ids).await?;
    // `remove` keeps one copy of an event delivered twice within the batch.
    let fresh: Vec<&RecordEvent> = events.iter().filter(|e| fresh.remove(&e.id)).collect();
    if !fresh.is_empty() {
        ctx.handle_events(&mut tx, &fresh).await?;
    }
    tx.commit().await?;
    if !fresh.is_empty() {
        ctx.committed();
    }
    Ok(())
}
