//! The agent's main loop: connect, state (hello, heartbeats, applied), apply what
//! is declared, reconnect when the broker goes away, and shut down gracefully.
//!
//! One task owns all state (store, buffer, connection); nothing is shared behind
//! locks. Blocking file work runs on the blocking pool.

use std::pin::Pin;
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::future::BoxFuture;
use futures_util::stream::FuturesUnordered;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions,
};
use lapin::types::AMQPValue;
use lapin::types::FieldTable;
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, Consumer, Event,
};
use mesh_protocol::topology::{
    REPORTS_EXCHANGE, SIGNATURE_HEADER, declaration_queue, report_routing_key,
};
use mesh_protocol::{
    Applied, Declaration, DecodeError, Envelope, Health, Heartbeat, HeartbeatPlan, ItemOutcome,
    LogsRequest, MAX_REPORT_BYTES, NodeId, Outage, Outcome, ProtocolRange, Report, ReportKind,
    ResourceStatusState, Resources, Section, Units,
};
use rand::Rng;
use tokio::time::{Instant, Interval, MissedTickBehavior, sleep_until};
use tracing::{Instrument, debug, error, info, info_span, warn};
use uuid::Uuid;

use crate::apply::{self, Applier, ApplyReport};
use crate::buffer::{Outgoing, ReportBuffer};
use crate::config::Config;
use crate::credentials::Credentials;
use crate::facts;
use crate::metrics::Metrics;
use crate::provision::worker::{Declared, Worker};
use crate::store::{PendingReport, Store};
use crate::units::probes::HealthReporter;
use crate::units::{Reporter, Supervisor};

/// Reports handed to the broker and not yet confirmed, at most.
const PUBLISH_WINDOW: usize = 64;
/// How long a graceful close waits for the broker's answer before the
/// connection is let go (a dead peer never answers).
const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);

/// Capped exponential backoff with full jitter: each wait is uniform in
/// `0..=cap`, the cap doubling per failure from `min` up to `max`.
#[derive(Debug, Clone)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    cap: Duration,
}

impl Backoff {
    pub fn new(min: Duration, max: Duration) -> Self {
        Backoff { min, max, cap: min }
    }

    pub fn next_delay(&mut self) -> Duration {
        let cap = self.cap;
        self.cap = (self.cap * 2).min(self.max);
        let secs = rand::rng().random_range(0.0..=cap.as_secs_f64());
        Duration::from_secs_f64(secs).max(Duration::from_millis(10))
    }

    pub fn reset(&mut self) {
        self.cap = self.min;
    }
}

/// A broker outage being lived through: since when (the agent's clock, and
/// its monotonic one), and the reports lost meanwhile.
#[derive(Debug, Clone, Copy)]
struct OutageTrack {
    since: chrono::DateTime<chrono::Utc>,
    at: Instant,
    dropped: u64,
}

/// How a connected session ended.
enum SessionEnd {
    Shutdown,
    Lost(String),
}

type Shutdown<'a> = Pin<&'a mut (dyn Future<Output = ()> + Send)>;
type ConfirmFuture = BoxFuture<'static, (Uuid, Result<Confirmation, lapin::Error>)>;

pub(crate) struct Agent {
    config: Config,
    creds: Credentials,
    store: Store,
    applier: Applier,
    buffer: ReportBuffer,
    metrics: Metrics,
    /// Runs the inventory section's units; outlives broker sessions.
    units: Supervisor,
    reporter: Reporter,
    /// Probe results, for `health` reports.
    health: HealthReporter,
    /// The last health report stating a change, until the broker confirms
    /// it (a summary that replaces it in the buffer states the change too).
    health_change: Option<Uuid>,
    /// The broker outage since the last connection was lost, until a hello
    /// stating it is confirmed (`outage_hello`).
    outage: Option<OutageTrack>,
    outage_hello: Option<Uuid>,
    /// When the connection was lost (for the outage metric).
    disconnected_at: Option<Instant>,
    /// The heartbeat plan the controller declared (none: beat at the
    /// configured interval); `retime` is set when it changed.
    plan: Option<HeartbeatPlan>,
    retime: bool,
    /// The overlay and firewall of the connectivity section; `changes`: item
    /// outcomes a periodic check changed, to state again.
    connectivity: Option<crate::connectivity::Shared>,
    connectivity_changes: Option<tokio::sync::mpsc::Receiver<Vec<ItemOutcome>>>,
    /// The node's certificates (none: not set up, as in some tests).
    certs: Option<crate::certs::Certs>,
    /// The artifact cache the delivery section fills (none: not set up).
    artifacts: Option<crate::artifacts::Artifacts>,
    /// Reconciles the provisioning section's resources in the background;
    /// its findings become `resources` reports.
    resources: Worker,
}

impl Agent {
    pub(crate) fn new(
        config: Config,
        creds: Credentials,
        store: Store,
        applier: Applier,
        metrics: Metrics,
        units: Supervisor,
    ) -> Self {
        let mut buffer = ReportBuffer::new(config.report_buffer);
        // Applied reports that were never confirmed before the last exit.
        for p in &store.data().pending_reports {
            if let Ok(kind) = ReportKind::parse(&p.kind) {
                buffer.push(Outgoing {
                    id: p.id,
                    kind,
                    seq: p.seq,
                    payload: p.payload.clone().into_bytes(),
                });
            }
        }
        metrics.set_buffered(buffer.len());
        for (section, generation) in store.applied_generations() {
            metrics.set_applied_generation(section.as_str(), generation);
        }
        let reporter = units.reporter();
        let health = units.health_reporter();
        let plan = crate::plan::load(&config.state_dir);
        // The resources as last declared, reconciled at once (rule 8): no
        // broker, no controller needed.
        let provisioning = store.section(Section::Provisioning);
        let found = store.data().resources.as_ref();
        if let Some(f) = found {
            metrics.set_resources(&f.resources);
        }
        let resources = Worker::start(
            applier.clone(),
            config.provisioning.interval,
            Declared {
                generation: provisioning.generation,
                resources: provisioning.resources,
            },
            found,
        );
        Agent {
            resources,
            plan,
            retime: false,
            connectivity: None,
            connectivity_changes: None,
            certs: None,
            artifacts: None,
            config,
            creds,
            store,
            applier,
            buffer,
            metrics,
            units,
            reporter,
            health,
            health_change: None,
            outage: None,
            outage_hello: None,
            disconnected_at: None,
        }
    }

    /// Apply the connectivity section's overlay and firewall with `c`, and
    /// state again what its checks change.
    pub(crate) fn with_connectivity(
        mut self,
        c: crate::connectivity::Shared,
        changes: tokio::sync::mpsc::Receiver<Vec<ItemOutcome>>,
    ) -> Self {
        self.connectivity = Some(c);
        self.connectivity_changes = Some(changes);
        self
    }

    /// Cache the delivery section's artifacts with `artifacts`.
    pub(crate) fn with_artifacts(mut self, artifacts: crate::artifacts::Artifacts) -> Self {
        self.artifacts = Some(artifacts);
        self
    }

    /// Ask for, install and renew the node's certificates with `certs`.
    pub(crate) fn with_certs(mut self, certs: crate::certs::Certs) -> Self {
        self.certs = Some(certs);
        self
    }

    /// Run until `shutdown` resolves, then leave the units running for the next
    /// agent (their shims keep their output; decision 0016).
    pub(crate) async fn run(mut self, shutdown: Shutdown<'_>) {
        self.serve(shutdown).await;
        self.resources.stop();
        self.units.shutdown().await;
    }

    async fn serve(&mut self, shutdown: Shutdown<'_>) {
        let mut shutdown = shutdown;
        let interval = self.interval();
        if let Some(plan) = self.plan {
            info!(
                interval_ms = plan.interval_ms,
                "beating at the interval the controller declared"
            );
        }
        let first = rand::rng().random_range(Duration::ZERO..=interval);
        let mut heartbeat = tokio::time::interval_at(Instant::now() + first, interval);
        heartbeat.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut backoff = Backoff::new(self.config.reconnect_min, self.config.reconnect_max);
        let mut connected_before = false;
        // The credentials' own endpoint, then each of `brokers`, then the
        // mesh's endpoints the controller declared and the store keeps
        // (decision 0044), each once: a failed attempt or a lost session
        // moves on to the next one. The list is taken again before every
        // attempt (what the controller declared meanwhile counts).
        let configured = match self.config.broker_endpoints() {
            Ok(list) => list,
            Err(e) => {
                warn!(error = %e, "ignoring the brokers setting");
                Vec::new()
            }
        };
        let mut at = 0usize;

        loop {
            let props = ConnectionProperties::default()
                .with_connection_name(format!("mesh-agent {}", self.creds.node).into());
            let creds = self.creds.clone();
            let endpoints =
                crate::broker::candidates(&self.creds, &configured, &self.store.broker_endpoints());
            let crate::broker::Candidate {
                target,
                endpoint,
                source,
            } = endpoints[at % endpoints.len()].clone();
            let source = source.as_str();
            let connect = crate::broker::connect(
                &creds,
                target.as_ref(),
                self.config.amqp_heartbeat,
                self.config.connect_timeout,
                props,
            );
            tokio::pin!(connect);
            let attempt = loop {
                tokio::select! {
                    () = &mut shutdown => {
                        info!("shutdown while disconnected; {} reports left unsent", self.buffer.len());
                        return;
                    }
                    _ = heartbeat.tick() => self.missed_heartbeat(),
                    found = self.resources.found() => self.resources_found(found),
                    r = &mut connect => break r,
                }
            };
            let conn = match attempt {
                Ok(conn) => conn,
                Err(e) => {
                    let timed_out = matches!(e, crate::broker::BrokerError::TimedOut { .. });
                    if timed_out {
                        warn!(url = %self.creds.redacted_url(), %endpoint, source, error = %e, "connecting to the broker timed out; trying the next endpoint");
                    } else {
                        warn!(url = %self.creds.redacted_url(), %endpoint, source, error = %e, "cannot connect to the broker");
                    }
                    at = (at + 1) % endpoints.len();
                    if !self.wait(&mut backoff, &mut heartbeat, &mut shutdown).await {
                        return;
                    }
                    continue;
                }
            };
            if connected_before {
                self.metrics.reconnected();
            }
            if let Some(at) = self.disconnected_at.take() {
                self.metrics.outage_ended(at.elapsed().as_secs_f64());
            }
            self.metrics.set_connected(true);
            connected_before = true;
            backoff.reset();
            info!(url = %self.creds.redacted_url(), %endpoint, source, "connected to the broker");
            match self.session(&conn, &mut heartbeat, &mut shutdown).await {
                SessionEnd::Shutdown => {
                    mesh_amqp::close(&conn, "agent shutting down", CLOSE_TIMEOUT).await;
                    info!("shut down; {} reports left unsent", self.buffer.len());
                    return;
                }
                SessionEnd::Lost(reason) => {
                    warn!(%reason, %endpoint, source, "lost the broker connection");
                    at = (at + 1) % endpoints.len();
                    self.lost_broker();
                    mesh_amqp::close(&conn, "agent reconnecting", CLOSE_TIMEOUT).await;
                    self.buffer.reset_in_flight();
                    if !self.wait(&mut backoff, &mut heartbeat, &mut shutdown).await {
                        return;
                    }
                }
            }
        }
    }

    /// The broker connection is gone: an outage begins (unless the last one
    /// was not yet stated in a confirmed hello: it goes on).
    fn lost_broker(&mut self) {
        self.metrics.set_connected(false);
        self.metrics.outage_began();
        self.disconnected_at = Some(Instant::now());
        self.outage_hello = None;
        if self.outage.is_none() {
            self.outage = Some(OutageTrack {
                since: chrono::Utc::now(),
                at: Instant::now(),
                dropped: 0,
            });
        }
    }

    /// Wait one backoff delay, still beating. False if shutdown came first.
    async fn wait(
        &mut self,
        backoff: &mut Backoff,
        heartbeat: &mut Interval,
        shutdown: &mut Shutdown<'_>,
    ) -> bool {
        let until = Instant::now() + backoff.next_delay();
        loop {
            tokio::select! {
                () = &mut *shutdown => {
                    info!("shutdown while disconnected; {} reports left unsent", self.buffer.len());
                    return false;
                }
                _ = heartbeat.tick() => self.missed_heartbeat(),
                found = self.resources.found() => self.resources_found(found),
                () = sleep_until(until) => return true,
            }
        }
    }

    async fn session(
        &mut self,
        conn: &Connection,
        heartbeat: &mut Interval,
        shutdown: &mut Shutdown<'_>,
    ) -> SessionEnd {
        let mut publisher = match open_publisher(conn, self.config.connect_timeout).await {
            Ok(ch) => ch,
            Err(e) => return SessionEnd::Lost(format!("cannot open the publishing channel: {e}")),
        };
        self.buffer.reset_in_flight();
        self.push_hello();
        self.push_units();
        self.push_resources();
        self.push_certificates(true);
        // Probe results, whole, after every connect (if there are any).
        if self.health.any() {
            self.push_health(true);
        }
        let summary_every = Duration::from_secs(self.config.health_summary_secs.max(1));
        let mut summary = tokio::time::interval_at(Instant::now() + summary_every, summary_every);
        summary.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut events = conn.events_listener();
        let mut confirms: FuturesUnordered<ConfirmFuture> = FuturesUnordered::new();
        // Heartbeats' confirms: awaited only so that lapin lets go of them (a
        // dropped confirm stays registered on its channel), their outcome unused.
        let mut beats: FuturesUnordered<lapin::PublisherConfirm> = FuturesUnordered::new();
        let mut consumer: Option<(Channel, Consumer)> = None;
        let mut consume_backoff =
            Backoff::new(self.config.reconnect_min, self.config.reconnect_max);
        let mut consume_at = Instant::now();
        let mut publish_backoff =
            Backoff::new(self.config.reconnect_min, self.config.reconnect_max);
        let mut paused_until: Option<Instant> = None;
        let queue = declaration_queue(&self.creds.node);

        loop {
            // Fill the window of unconfirmed publishes.
            if paused_until.is_none_or(|t| t <= Instant::now()) {
                paused_until = None;
                while confirms.len() < PUBLISH_WINDOW {
                    let Some(out) = self.buffer.next_to_send() else {
                        break;
                    };
                    match self.publish(&publisher, &out).await {
                        Ok(f) => confirms.push(f),
                        Err(e) => {
                            self.buffer.retry(out.id);
                            warn!(error = %e, "publish failed");
                            if !conn.status().connected() {
                                return SessionEnd::Lost(e.to_string());
                            }
                            match open_publisher(conn, self.config.connect_timeout).await {
                                Ok(ch) => publisher = ch,
                                Err(e) => {
                                    return SessionEnd::Lost(format!(
                                        "cannot reopen the publishing channel: {e}"
                                    ));
                                }
                            }
                            paused_until = Some(Instant::now() + publish_backoff.next_delay());
                            break;
                        }
                    }
                }
            }

            let certs_due = self.certs_due();
            tokio::select! {
                () = &mut *shutdown => {
                    if let Some((ch, _)) = consumer.take() {
                        // Unacked deliveries (there are none mid-apply) go back to the queue.
                        let _ = tokio::time::timeout(CLOSE_TIMEOUT, ch.close(200, "agent shutting down".into())).await;
                    }
                    self.flush(&publisher, confirms).await;
                    return SessionEnd::Shutdown;
                }
                Some(_) = beats.next(), if !beats.is_empty() => {}
                Some((id, result)) = confirms.next(), if !confirms.is_empty() => {
                    match self.confirmed(id, result) {
                        Ok(()) => publish_backoff.reset(),
                        Err(reason) => {
                            warn!(%reason, "report not accepted; will retry");
                            paused_until = Some(Instant::now() + publish_backoff.next_delay());
                            if !conn.status().connected() {
                                return SessionEnd::Lost(reason);
                            }
                            // A fresh channel for what follows, whether this one
                            // is closed or only refused: a channel that published
                            // to a quorum queue whose leader's node died can keep
                            // being refused for it after a new leader is elected,
                            // while a new channel finds the leader (the relay does
                            // the same: decision 0043). Seen on the three-node
                            // cluster under load: an `applied` report nacked for
                            // three minutes. The old channel's confirms still in
                            // flight resolve by themselves (retried if refused).
                            match open_publisher(conn, self.config.connect_timeout).await {
                                Ok(ch) => {
                                    let old = std::mem::replace(&mut publisher, ch);
                                    if old.status().connected() {
                                        tokio::spawn(async move {
                                            let _ = tokio::time::timeout(
                                                CLOSE_TIMEOUT,
                                                old.close(200, "replaced after a refused publish".into()),
                                            )
                                            .await;
                                        });
                                    }
                                }
                                Err(e) => return SessionEnd::Lost(format!("cannot reopen the publishing channel: {e}")),
                            }
                        }
                    }
                }
                () = self.reporter.due() => self.push_units(),
                found = self.resources.found() => self.resources_found(found),
                () = self.health.due() => self.push_health(false),
                _ = summary.tick() => {
                    if self.health.any() {
                        self.push_health(true);
                    }
                }
                Some(items) = next_change(&mut self.connectivity_changes) => self.restate_connectivity(items),
                () = sleep_until(certs_due), if self.certs.is_some() => self.push_certificates(false),
                _ = heartbeat.tick() => {
                    if let Some(confirm) = self.beat(&publisher).await {
                        beats.push(confirm);
                    }
                    if !conn.status().connected() {
                        return SessionEnd::Lost("connection is no longer open".into());
                    }
                }
                ev = events.next() => match ev {
                    // Channel-level errors (a 404 on the declaration queue) arrive
                    // here too; only a closed connection ends the session.
                    Some(Event::Error(e)) => {
                        if !conn.status().connected() {
                            return SessionEnd::Lost(e.to_string());
                        }
                        debug!(error = %e, "channel error");
                    }
                    Some(Event::ConnectionBlocked(reason)) => warn!(%reason, "the broker blocked publishing"),
                    Some(Event::ConnectionUnblocked) => info!("the broker unblocked publishing"),
                    Some(_) => {}
                    None => return SessionEnd::Lost("connection event stream ended".into()),
                },
                () = sleep_until(consume_at), if consumer.is_none() => {
                    match start_consumer(conn, &queue, self.config.prefetch, self.config.connect_timeout).await {
                        Ok(c) => {
                            info!(%queue, "consuming declarations");
                            consume_backoff.reset();
                            consumer = Some(c);
                        }
                        Err(e) => {
                            if !conn.status().connected() {
                                return SessionEnd::Lost(e.to_string());
                            }
                            let delay = consume_backoff.next_delay();
                            info!(%queue, error = %e, retry_in = ?delay, "cannot consume declarations yet (the controller declares the queue when it first hears of this node)");
                            consume_at = Instant::now() + delay;
                        }
                    }
                }
                () = sleep_until(paused_until.unwrap_or_else(Instant::now)), if paused_until.is_some() => {
                    paused_until = None;
                }
                delivery = next_delivery(&mut consumer), if consumer.is_some() => match delivery {
                    Some(Ok(d)) => {
                        let handled = match self.handle_delivery(d, &publisher).await {
                            Ok(Some(confirm)) => {
                                beats.push(confirm);
                                Ok(())
                            }
                            Ok(None) => Ok(()),
                            Err(e) => Err(e),
                        };
                        if std::mem::take(&mut self.retime) {
                            let interval = self.interval();
                            *heartbeat = tokio::time::interval_at(Instant::now() + interval, interval);
                            heartbeat.set_missed_tick_behavior(MissedTickBehavior::Delay);
                        }
                        if let Err(e) = handled {
                            if !conn.status().connected() {
                                return SessionEnd::Lost(e);
                            }
                            warn!(error = %e, "declaration channel failed; re-consuming");
                            consumer = None;
                            consume_at = Instant::now() + consume_backoff.next_delay();
                        }
                    }
                    other => {
                        if !conn.status().connected() {
                            return SessionEnd::Lost("connection closed".into());
                        }
                        let reason = match other {
                            Some(Err(e)) => e.to_string(),
                            _ => "consumer cancelled".into(),
                        };
                        warn!(%reason, "declaration consumer stopped; re-consuming");
                        consumer = None;
                        consume_at = Instant::now() + consume_backoff.next_delay();
                    }
                },
            }
        }
    }

    /// Publish what can be published before the shutdown deadline.
    async fn flush(&mut self, publisher: &Channel, mut confirms: FuturesUnordered<ConfirmFuture>) {
        let deadline = Instant::now() + self.config.shutdown_timeout;
        let mut failed = false;
        loop {
            while !failed && confirms.len() < PUBLISH_WINDOW {
                let Some(out) = self.buffer.next_to_send() else {
                    break;
                };
                match self.publish(publisher, &out).await {
                    Ok(f) => confirms.push(f),
                    Err(_) => {
                        self.buffer.retry(out.id);
                        failed = true;
                    }
                }
            }
            if confirms.is_empty() {
                return;
            }
            tokio::select! {
                Some((id, result)) = confirms.next() => {
                    if self.confirmed(id, result).is_err() {
                        failed = true;
                    }
                }
                () = sleep_until(deadline) => {
                    warn!("shutdown deadline reached with {} reports unconfirmed", self.buffer.len());
                    return;
                }
            }
        }
    }

    /// Hand one report to the broker; the returned future resolves to its confirm.
    async fn publish(&self, ch: &Channel, out: &Outgoing) -> Result<ConfirmFuture, lapin::Error> {
        let node = &self.creds.node;
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

    /// Handle a publisher confirm. Err names why the report must be sent again.
    fn confirmed(
        &mut self,
        id: Uuid,
        result: Result<Confirmation, lapin::Error>,
    ) -> Result<(), String> {
        let outcome = match result {
            Ok(Confirmation::Ack(None)) => Ok(()),
            Ok(Confirmation::Ack(Some(returned))) => Err(format!(
                "returned by the broker ({} {}): no queue bound for it yet",
                returned.reply_code, returned.reply_text
            )),
            Ok(Confirmation::Nack(_)) => {
                Err("refused by the broker (nack; queue full?)".to_owned())
            }
            Ok(Confirmation::NotRequested) => Err("publisher confirms are not enabled".to_owned()),
            Err(e) => Err(e.to_string()),
        };
        match outcome {
            Ok(()) => {
                self.metrics.confirmed_now();
                if self.health_change == Some(id) {
                    self.health_change = None;
                }
                if self.outage_hello == Some(id) {
                    self.outage_hello = None;
                    self.outage = None;
                }
                if let Some(out) = self.buffer.confirmed(id) {
                    self.metrics.report_published(out.kind.as_str());
                    debug!(message_id = %id, kind = out.kind.as_str(), "report confirmed");
                    if out.kind == ReportKind::Applied
                        && let Err(e) = self.store.remove_pending(&[id])
                    {
                        error!(error = %e, "cannot update the store");
                    }
                }
                self.metrics.set_buffered(self.buffer.len());
                Ok(())
            }
            Err(reason) => {
                self.buffer.retry(id);
                Err(reason)
            }
        }
    }

    /// Handle one message of the declaration queue, then ack it: a logs
    /// request is answered (its answer's confirm returned, for the caller
    /// to let settle); anything else is a declaration, applied, its
    /// `applied` report kept.
    async fn handle_delivery(
        &mut self,
        delivery: Delivery,
        publisher: &Channel,
    ) -> Result<Option<lapin::PublisherConfirm>, String> {
        let message_id = delivery
            .properties
            .message_id()
            .as_ref()
            .map(|m| m.as_str().to_owned())
            .unwrap_or_default();
        let logs = crate::logs::is_request(&delivery.data);
        let kind = if logs {
            LogsRequest::KIND
        } else {
            Declaration::KIND
        };
        let span =
            info_span!("declaration", message_id = %message_id, node = %self.creds.node, kind);
        async {
            let mut confirm = None;
            if logs {
                match self.verify_logs_request(&delivery) {
                    Ok(()) => confirm = self.answer_logs(&delivery.data, publisher).await,
                    Err(e) => {
                        error!(error = %e, "logs request refused: bad signature; not answered")
                    }
                }
            } else {
                let report = match self.verify(&delivery) {
                    Ok(()) => self.apply_bytes(&delivery.data, publisher).await,
                    Err(rejected) => rejected,
                };
                self.push_applied(report);
            }
            delivery
                .ack(BasicAckOptions::default())
                .await
                .map(|_| confirm)
                .map_err(|e| format!("ack failed: {e}"))
        }
        .instrument(span)
        .await
    }

    /// Check a logs request's signature as a declaration's: only the
    /// controller may ask a node for its units' output.
    fn verify_logs_request(
        &self,
        delivery: &Delivery,
    ) -> Result<(), mesh_protocol::SignatureError> {
        let signature = delivery.properties.headers().as_ref().and_then(|h| {
            match h.inner().get(SIGNATURE_HEADER) {
                Some(AMQPValue::LongString(s)) => Some(s.to_string()),
                _ => None,
            }
        });
        self.creds
            .controller_key
            .verify_hex(&delivery.data, signature.as_deref())
    }

    /// Answer a (verified) logs request with the output of this node's
    /// units of its module: a `logs` report, transient, published at once
    /// and never buffered (nobody waits for it after its expiration). A
    /// request that cannot be read, or is for another node, is not
    /// answered (the controller's wait ends it).
    async fn answer_logs(
        &mut self,
        bytes: &[u8],
        publisher: &Channel,
    ) -> Option<lapin::PublisherConfirm> {
        let env = match Envelope::<LogsRequest>::decode(bytes, mesh_protocol::MAX_DECLARATION_BYTES)
        {
            Ok(env) => env,
            Err(e) => {
                warn!(error = %e, "logs request cannot be read; not answered");
                return None;
            }
        };
        if env.node != self.creds.node {
            warn!(to = %env.node, "logs request for another node; not answered");
            return None;
        }
        let units: Vec<String> = self
            .store
            .section(Section::Inventory)
            .units
            .iter()
            .filter(|u| u.module == env.body.module)
            .map(|u| u.name.clone())
            .collect();
        let units_dir = self.config.state_dir.join(crate::units::UNITS_DIR);
        let request = env.body.clone();
        let node = self.creds.node.clone();
        let id = env.id;
        let answer = tokio::task::spawn_blocking(move || {
            crate::logs::answer(&units_dir, &node, id, &request, &units)
        })
        .await
        .unwrap_or_else(|e| mesh_protocol::Logs {
            request: id,
            module: env.body.module.clone(),
            units: Vec::new(),
            error: Some(format!("reading the output failed: {e}")),
        });
        info!(request = %id, module = %answer.module, units = answer.units.len(), error = answer.error.as_deref().unwrap_or(""), "answering a logs request");
        let out = self.envelope(Report::Logs(answer));
        self.publish_transient(
            publisher,
            &out,
            Some(mesh_protocol::topology::LOGS_ANSWER_EXPIRATION_MS),
        )
        .await
    }

    /// Check the controller's signature of a declaration (header
    /// `x-mesh-signature` over the exact body) against the key received at
    /// enrolment. Err is the `rejected` report: nothing of it is applied.
    fn verify(&mut self, delivery: &Delivery) -> Result<(), Applied> {
        let signature = delivery.properties.headers().as_ref().and_then(|h| {
            match h.inner().get(SIGNATURE_HEADER) {
                Some(AMQPValue::LongString(s)) => Some(s.to_string()),
                _ => None,
            }
        });
        match self
            .creds
            .controller_key
            .verify_hex(&delivery.data, signature.as_deref())
        {
            Ok(()) => Ok(()),
            Err(e) => {
                let (section, generation) = apply::peek_section(&delivery.data);
                error!(error = %e, ?section, ?generation, "declaration rejected: bad signature");
                self.metrics.declaration_applied("rejected");
                Err(Applied {
                    section,
                    generation,
                    outcome: Outcome::Rejected,
                    items: Vec::new(),
                    error: Some(format!("signature: {e}")),
                    unsupported_section: None,
                })
            }
        }
    }

    /// Decode, apply, record. Never fails: every problem becomes the report.
    async fn apply_bytes(&mut self, bytes: &[u8], publisher: &Channel) -> Applied {
        let env = match apply::decode(bytes, &self.creds.node) {
            Ok((env, unknown)) => {
                self.metrics
                    .unknown_fields(Declaration::KIND, unknown.count);
                if !unknown.is_empty() {
                    debug!(fields = ?unknown.paths, "declaration: ignored fields this agent does not know");
                }
                env
            }
            // A section of a newer controller: nothing changes, and the
            // controller learns that this agent does not know it.
            Err(DecodeError::UnsupportedSection {
                section,
                generation,
            }) => {
                warn!(
                    section,
                    ?generation,
                    "declaration of a section this agent does not know"
                );
                self.metrics.declaration_applied("unsupported");
                return Applied {
                    section: None,
                    generation,
                    outcome: Outcome::Unsupported,
                    items: Vec::new(),
                    error: Some(format!(
                        "section `{section}` is not supported by mesh-agent {} (protocol {}); nothing was applied",
                        facts::AGENT_VERSION,
                        ProtocolRange::THIS
                    )),
                    unsupported_section: Some(section),
                };
            }
            Err(e) => {
                let (section, generation) = apply::peek_section(bytes);
                error!(error = %e, ?section, ?generation, size = bytes.len(), "declaration rejected");
                self.metrics.declaration_applied("rejected");
                return Applied {
                    section,
                    generation,
                    outcome: Outcome::Rejected,
                    items: Vec::new(),
                    error: Some(truncate(&e.to_string(), 2000)),
                    unsupported_section: None,
                };
            }
        };
        let decl = env.body;
        let plan = (decl.section == Section::Inventory).then_some(decl.items.heartbeat);
        let endpoints = (decl.section == Section::Inventory).then(|| decl.items.endpoints.clone());
        let plans = (decl.section == Section::Connectivity)
            .then(|| (decl.items.overlay.clone(), decl.items.firewall.clone()));
        let certs_declared = decl.items.certificates.clone();
        let artifacts_declared = (decl.section == Section::Delivery).then(|| {
            (
                decl.items.artifacts.clone(),
                decl.items.artifact_keys.clone(),
            )
        });
        let prev_state = self.store.section(decl.section);
        let prev = self.store.section(decl.section);
        let applier = self.applier.clone();
        let section = decl.section;
        let generation = decl.generation;
        let report: ApplyReport =
            match tokio::task::spawn_blocking(move || applier.apply(&decl, &prev)).await {
                Ok(r) => r,
                Err(e) => {
                    error!(error = %e, "applying panicked");
                    return Applied {
                        section: Some(section),
                        generation: Some(generation),
                        outcome: Outcome::Failed,
                        items: Vec::new(),
                        error: Some("the applier panicked".into()),
                        unsupported_section: None,
                    };
                }
            };
        let mut report = report;
        // The overlay and firewall follow the section's files, unless nothing
        // of it may be applied (rejected) or it is not newer (stale).
        if let (Some((overlay, firewall)), Some(c), false, false) = (
            plans,
            &self.connectivity,
            report.stale,
            report.outcome == Outcome::Rejected,
        ) {
            let items = c.apply(overlay, firewall).await;
            if report.error.is_none()
                && let Some(bad) = items.iter().find(|i| !i.ok)
            {
                report.error = Some(format!(
                    "{}: {}",
                    bad.item,
                    bad.error.as_deref().unwrap_or("not applied")
                ));
            }
            report.items.extend(items);
        }
        // The delivery section's artifacts: fetched, verified and cached
        // (inline, each within `[artifacts] fetch_timeout`); the section is
        // applied only once every one is cached, so a failed one is fetched
        // again when the declaration comes again.
        if let (Some((declared, keys)), Some(artifacts), false, false) = (
            artifacts_declared,
            self.artifacts.clone(),
            report.stale,
            report.outcome == Outcome::Rejected,
        ) {
            // A pull may take longer than the controller's grace: the node's
            // lease (its heartbeat) goes on meanwhile, so a node busy pulling
            // is never judged unreachable for it.
            let fetch = artifacts.ensure_all(&declared, keys.as_deref());
            tokio::pin!(fetch);
            let every = self.interval();
            let mut lease = tokio::time::interval_at(Instant::now() + every, every);
            lease.set_missed_tick_behavior(MissedTickBehavior::Delay);
            let (items, gained) = loop {
                tokio::select! {
                    out = &mut fetch => break out,
                    _ = lease.tick() => {
                        // Transient and unconfirmed, as every heartbeat.
                        let _ = self.beat(publisher).await;
                    }
                }
            };
            if gained {
                self.units.artifacts_changed();
            }
            if let Some(bad) = items.iter().find(|i| !i.ok) {
                let error = format!(
                    "{}: {}",
                    bad.item,
                    bad.error.as_deref().unwrap_or("not cached")
                );
                report.outcome = Outcome::Failed;
                report.error.get_or_insert(error);
                if let Some(state) = &mut report.state {
                    state.generation = prev_state.generation;
                    state.digest = prev_state.digest.clone();
                    state.last_outcome = Some(Outcome::Failed);
                    state.last_error = report.error.clone();
                }
            }
            report.items.extend(items);
        }
        // A unit whose artifact is not cached is declared (it starts once the
        // cache gains it), but its item says why it does not run yet.
        if section == Section::Inventory
            && !report.stale
            && report.outcome == Outcome::Applied
            && let Some(state) = &report.state
        {
            for unit in &state.units {
                if let Some(d) = &unit.artifact
                    && !crate::artifacts::is_cached(&self.config.state_dir, d)
                    && let Some(i) = report.items.iter_mut().find(|i| i.item == unit.name)
                {
                    i.ok = false;
                    i.error = Some(format!(
                        "artifact {d} is not cached: the unit starts once the delivery section caches it"
                    ));
                }
            }
        }
        if section == Section::Connectivity
            && !report.stale
            && report.outcome != Outcome::Rejected
            && let Some(certs) = &mut self.certs
        {
            let items = certs.install(&certs_declared);
            if report.error.is_none()
                && let Some(bad) = items.iter().find(|i| !i.ok)
            {
                report.error = Some(format!(
                    "{}: {}",
                    bad.item,
                    bad.error.as_deref().unwrap_or("not applied")
                ));
            }
            report.items.extend(items);
            self.push_certificates(true);
        }
        let label = if report.stale {
            "stale"
        } else {
            match report.outcome {
                Outcome::Applied => "applied",
                Outcome::Failed => "failed",
                Outcome::Rejected => "rejected",
                Outcome::Unsupported => "unsupported",
            }
        };
        self.metrics.declaration_applied(label);
        if report.stale {
            info!(%section, declared = generation, applied = report.generation, "declaration not newer than what is applied; restating");
        } else if report.outcome == Outcome::Applied {
            info!(%section, generation, files = report.items.len(), "declaration applied");
        } else {
            warn!(%section, generation, outcome = label, error = report.error.as_deref().unwrap_or(""), "declaration not applied");
        }
        if let (Some(plan), Outcome::Applied, false) = (plan, report.outcome, report.stale) {
            self.set_plan(plan);
        }
        // A valid, newer section's endpoints are kept even when an item of it
        // failed (a unit): they do not depend on the rest.
        if let (Some(endpoints), false, false) =
            (endpoints, report.stale, report.outcome == Outcome::Rejected)
        {
            self.set_endpoints(endpoints);
        }
        // A config section may bring a grant's credential file.
        if section == Section::Config && !report.stale && report.outcome == Outcome::Applied {
            self.resources.kick();
        }
        if let Some(state) = report.state {
            let units = (section == Section::Inventory).then(|| state.units.clone());
            // Handed over, never waited on: the worker passes in the background.
            if section == Section::Provisioning {
                self.resources.declare(Declared {
                    generation: state.generation,
                    resources: state.resources.clone(),
                });
            }
            self.metrics
                .set_applied_generation(section.as_str(), state.generation);
            if let Err(e) = self
                .store
                .record(section, state, None, self.config.report_buffer)
            {
                error!(error = %e, "cannot record the applied state");
            }
            // Level-triggered: the supervisor compares the whole list with what runs.
            if let Some(units) = units {
                self.units.declare(&units);
                // A certificate per module the node runs.
                if let Some(certs) = &mut self.certs
                    && certs.set_modules(units.iter().map(|u| u.module.as_str()))
                {
                    self.push_certificates(true);
                }
            }
        }
        Applied {
            section: Some(section),
            generation: Some(report.generation),
            outcome: report.outcome,
            items: report.items,
            error: report.error.map(|e| truncate(&e, 2000)),
            unsupported_section: None,
        }
    }

    fn envelope(&mut self, report: Report) -> Outgoing {
        let seq = self.store.next_seq();
        let env = Envelope::new(self.creds.node.clone(), seq, report);
        Outgoing {
            id: env.id,
            kind: env.body.report_kind(),
            seq,
            payload: env.encode(),
        }
    }

    fn push(&mut self, out: Outgoing) {
        let dropped = self.buffer.push(out);
        for d in &dropped.superseded {
            debug!(message_id = %d.id, kind = d.kind.as_str(), "a buffered report was superseded by a newer one");
        }
        for d in &dropped.evicted {
            if d.kind == ReportKind::Applied {
                warn!(message_id = %d.id, "report buffer full: dropped an applied report");
                if let Err(e) = self.store.remove_pending(&[d.id]) {
                    error!(error = %e, "cannot update the store");
                }
            } else {
                debug!(message_id = %d.id, kind = d.kind.as_str(), "report buffer full: dropped a report");
            }
        }
        if let Some(o) = &mut self.outage {
            o.dropped = o.dropped.saturating_add(dropped.evicted.len() as u64);
        }
        self.metrics.set_buffered(self.buffer.len());
    }

    /// The hello of a (re)connect; the first after an outage states it.
    fn push_hello(&mut self) {
        let mut hello = facts::hello(
            self.config.hostname.as_deref(),
            &self.config.labels,
            self.store.applied_generations(),
            self.applier.seal_public_key().map(|k| k.to_hex()),
            self.connectivity.as_ref().and_then(|c| c.facts()),
        );
        hello.outage = self.outage.map(|o| Outage {
            since: o.since,
            seconds: o.at.elapsed().as_secs(),
            buffered: self.buffer.len() as u64,
            dropped: o.dropped,
        });
        if let Some(o) = &hello.outage {
            info!(
                since = %o.since,
                seconds = o.seconds,
                buffered = o.buffered,
                dropped = o.dropped,
                "reached the broker again after an outage"
            );
        }
        let out = self.envelope(Report::Hello(hello));
        if self.outage.is_some() {
            self.outage_hello = Some(out.id);
        }
        self.push(out);
    }

    /// State every probe's result, whole: after a change (`summary` false),
    /// or periodically and after a connect (`summary` true; stated as a
    /// change still if a change is waiting to be stated or confirmed, since
    /// it replaces that report in the buffer).
    fn push_health(&mut self, summary: bool) {
        let changed = self.health.changed();
        let Some(probes) = self.health.take() else {
            return;
        };
        let summary = summary && !changed && self.health_change.is_none();
        let health = fit_health(Health { probes, summary }, &self.creds.node);
        let out = self.envelope(Report::Health(health));
        if !summary {
            self.health_change = Some(out.id);
        }
        self.push(out);
    }

    /// State the connectivity section's overlay and firewall items again, at
    /// the generation applied, when a check changed their outcome.
    fn restate_connectivity(&mut self, items: Vec<ItemOutcome>) {
        let generation = self.store.section(Section::Connectivity).generation;
        if generation == 0 {
            return;
        }
        let error = items.iter().find(|i| !i.ok).map(|i| {
            format!(
                "{}: {}",
                i.item,
                i.error.as_deref().unwrap_or("not applied")
            )
        });
        info!(
            generation,
            ok = error.is_none(),
            "connectivity changed; stating it again"
        );
        self.push_applied(Applied {
            section: Some(Section::Connectivity),
            generation: Some(generation),
            outcome: Outcome::Applied,
            items,
            error,
            unsupported_section: None,
        });
    }

    /// State the certificates asked for and held: on connect and after a
    /// change (`force`), and when a renewal falls due.
    fn push_certificates(&mut self, force: bool) {
        let Some(certs) = &mut self.certs else {
            return;
        };
        if let Some(report) = certs.report(chrono::Utc::now(), force) {
            for r in &report.requests {
                info!(name = %r.name, "asking for a certificate");
            }
            let out = self.envelope(Report::Certificates(report));
            self.push(out);
        }
    }

    /// When the next certificate falls due (far away when none will).
    fn certs_due(&self) -> Instant {
        let due = self.certs.as_ref().and_then(crate::certs::Certs::next_due);
        let wait = due.map_or(Duration::from_secs(3600), |at| {
            (at - chrono::Utc::now()).to_std().unwrap_or(Duration::ZERO)
        });
        Instant::now() + wait.max(Duration::from_millis(50))
    }

    /// A provisioning pass is done: keep and state what it found, if that
    /// differs from what was last stated (or it answers a newer generation).
    fn resources_found(&mut self, found: Resources) {
        let before = self.store.data().resources.clone();
        if before.as_ref() == Some(&found) {
            return;
        }
        for s in &found.resources {
            let was = before
                .as_ref()
                .and_then(|b| b.resources.iter().find(|r| r.grant == s.grant));
            if was == Some(s) {
                continue;
            }
            // Reasons are the servers' words, never a credential.
            let reason = s.reason.as_deref().unwrap_or("");
            match s.state {
                ResourceStatusState::Failed => {
                    warn!(grant = %s.grant, state = s.state.as_str(), reason, "resource failed")
                }
                ResourceStatusState::Waiting => {
                    info!(grant = %s.grant, state = s.state.as_str(), reason, "resource waiting")
                }
                _ => info!(
                    grant = %s.grant,
                    state = s.state.as_str(),
                    credential_version = ?s.credential_version,
                    recreated = s.recreated,
                    "resource reconciled"
                ),
            }
        }
        self.metrics.set_resources(&found.resources);
        if let Err(e) = self.store.set_resources(found) {
            // Stated from memory all the same; the file keeps the older findings.
            error!(error = %e, "cannot keep what the provisioning pass found; stated anyway");
        }
        self.push_resources();
    }

    /// State what the last provisioning pass found (after a connect, and
    /// when it changed). Nothing before the first pass.
    fn push_resources(&mut self) {
        let Some(found) = self.store.data().resources.clone() else {
            return;
        };
        let found = fit_resources(found, &self.creds.node);
        let out = self.envelope(Report::Resources(found));
        self.push(out);
    }

    /// State every unit, now (after a connect, and when [`Reporter::due`]).
    fn push_units(&mut self) {
        let units = fit_units(self.reporter.take(), &self.creds.node);
        let out = self.envelope(Report::Units(units));
        self.push(out);
    }

    /// The interval to beat at: the declared plan's, else the configured one.
    fn interval(&self) -> Duration {
        self.plan.map_or(self.config.heartbeat_interval, |p| {
            Duration::from_millis(p.interval_ms)
        })
    }

    /// Keep the plan an applied inventory section declared (none: back to the
    /// configured interval), and beat at it from now on.
    fn set_plan(&mut self, plan: Option<HeartbeatPlan>) {
        if plan == self.plan {
            return;
        }
        if let Err(e) = crate::plan::save(&self.config.state_dir, plan) {
            error!(error = %e, "cannot keep the heartbeat plan; it holds until the agent restarts");
        }
        self.plan = plan;
        self.retime = true;
        info!(
            interval_ms = self.interval().as_millis() as u64,
            "heartbeat interval changed"
        );
    }

    /// Keep the mesh's endpoints an applied inventory section declared
    /// (none: it declared none, and none are kept). They were validated
    /// with the declaration (an invalid one rejects it: nothing is kept).
    fn set_endpoints(&mut self, endpoints: Option<mesh_protocol::Endpoints>) {
        let shown = endpoints
            .as_ref()
            .map(|e| (e.brokers.join(","), e.api.join(",")));
        match self.store.set_endpoints(endpoints) {
            Ok(false) => {}
            Ok(true) => {
                let (brokers, api) = shown.unwrap_or_default();
                info!(%brokers, %api, "kept the mesh's endpoints the controller declared");
            }
            Err(e) => {
                error!(error = %e, "cannot keep the mesh's endpoints; the ones kept before stay");
            }
        }
    }

    /// A heartbeat while disconnected: nothing to send it on, and liveness
    /// has no use for an old one (heartbeats are never buffered).
    fn missed_heartbeat(&mut self) {
        debug!("heartbeat skipped: not connected");
        if let Some(o) = &mut self.outage {
            o.dropped = o.dropped.saturating_add(1);
        }
    }

    /// Publish one heartbeat: transient (delivery mode 1); the next one
    /// follows (decision 0023). Returns its confirm, for the caller to let
    /// settle without waiting on it.
    async fn beat(&mut self, ch: &Channel) -> Option<lapin::PublisherConfirm> {
        let interval_ms = u64::try_from(self.interval().as_millis()).unwrap_or(u64::MAX);
        let out = self.envelope(Report::Heartbeat(Heartbeat {
            interval_ms: Some(interval_ms),
            applied: self.store.applied_generations(),
        }));
        self.publish_transient(ch, &out, None).await
    }

    /// Publish one transient report (delivery mode 1, never buffered: a
    /// heartbeat, whose next one follows, and a logs answer, which is of use
    /// only to the request waiting for it), expiring after `expiration_ms`
    /// when given. Returns its confirm, for the caller to let settle without
    /// waiting on it.
    async fn publish_transient(
        &self,
        ch: &Channel,
        out: &Outgoing,
        expiration_ms: Option<u64>,
    ) -> Option<lapin::PublisherConfirm> {
        let mut props = BasicProperties::default()
            .with_message_id(out.id.to_string().into())
            .with_type(out.kind.as_str().into())
            .with_user_id(self.creds.node.as_str().into())
            .with_content_type("application/json".into())
            .with_delivery_mode(1);
        if let Some(ms) = expiration_ms {
            props = props.with_expiration(ms.to_string().into());
        }
        let key = report_routing_key(&self.creds.node, out.kind);
        match ch
            .basic_publish(
                REPORTS_EXCHANGE.into(),
                key.into(),
                BasicPublishOptions::default(),
                &out.payload,
                props,
            )
            .await
        {
            Ok(confirm) => {
                self.metrics.report_published(out.kind.as_str());
                Some(confirm)
            }
            Err(e) => {
                debug!(error = %e, kind = out.kind.as_str(), "transient report not published");
                None
            }
        }
    }

    /// Keep an applied report: in the store (so a restart does not lose it) and in
    /// the buffer. Shrinks it if needed to fit the report size limit.
    fn push_applied(&mut self, applied: Applied) {
        let applied = fit_applied(applied, &self.creds.node);
        let out = self.envelope(Report::Applied(applied));
        let pending = PendingReport {
            id: out.id,
            kind: out.kind.as_str().to_owned(),
            seq: out.seq,
            payload: String::from_utf8_lossy(&out.payload).into_owned(),
        };
        if let Err(e) = self.store.add_pending(pending, self.config.report_buffer) {
            error!(error = %e, "cannot persist the applied report; keeping it in memory only");
        }
        self.push(out);
    }
}

/// Shrink an applied report until its envelope fits [`MAX_REPORT_BYTES`]: first
/// keep only the failed items, then cut their messages, then drop them.
fn fit_applied(mut a: Applied, node: &NodeId) -> Applied {
    let fits = |a: &Applied| {
        let probe = Envelope::new(node.clone(), u64::MAX, Report::Applied(a.clone()));
        probe.encode().len() <= MAX_REPORT_BYTES
    };
    if fits(&a) {
        return a;
    }
    a.items.retain(|i| !i.ok);
    if fits(&a) {
        return a;
    }
    a.items = a
        .items
        .into_iter()
        .map(|i| ItemOutcome {
            item: truncate(&i.item, 200),
            ok: i.ok,
            error: i.error.map(|e| truncate(&e, 200)),
        })
        .collect();
    if fits(&a) {
        return a;
    }
    let n = a.items.len();
    a.items.clear();
    a.error = Some(format!(
        "{} ({n} item outcomes omitted for size)",
        truncate(a.error.as_deref().unwrap_or(""), 1000)
    ));
    a
}

/// Make a units report fit [`MAX_REPORT_BYTES`]: first drop the start times, then
/// (hundreds of units, far beyond what a node runs) cut the list, saying so in
/// the log.
fn fit_units(mut u: Units, node: &NodeId) -> Units {
    let fits = |u: &Units| {
        let probe = Envelope::new(node.clone(), u64::MAX, Report::Units(u.clone()));
        probe.encode().len() <= MAX_REPORT_BYTES
    };
    if fits(&u) {
        return u;
    }
    for s in &mut u.units {
        s.started_at = None;
    }
    let total = u.units.len();
    while !fits(&u) && !u.units.is_empty() {
        let keep = u.units.len() * 9 / 10;
        u.units.truncate(keep);
    }
    if u.units.len() < total {
        warn!(
            total,
            reported = u.units.len(),
            "too many units for one units report; the list is cut"
        );
    }
    u
}

/// Make a resources report fit [`MAX_REPORT_BYTES`]: first cut the reasons
/// to 200 characters, then drop them, then (hundreds of grants on one node)
/// cut the list, saying so in the log. Never refused: the controller learns
/// what fits.
fn fit_resources(mut r: Resources, node: &NodeId) -> Resources {
    let fits = |r: &Resources| {
        let probe = Envelope::new(node.clone(), u64::MAX, Report::Resources(r.clone()));
        probe.encode().len() <= MAX_REPORT_BYTES
    };
    r.resources.truncate(mesh_protocol::MAX_RESOURCES);
    if fits(&r) {
        return r;
    }
    let total = r.resources.len();
    for s in &mut r.resources {
        s.reason = s.reason.as_deref().map(|t| truncate(t, 200));
    }
    if !fits(&r) {
        for s in &mut r.resources {
            s.reason = None;
        }
    }
    while !fits(&r) && !r.resources.is_empty() {
        let keep = r.resources.len() * 9 / 10;
        r.resources.truncate(keep);
    }
    warn!(
        total,
        reported = r.resources.len(),
        "the resources report is too large; reasons shortened or dropped, and the list cut where still needed"
    );
    r
}

/// Make a health report fit [`MAX_REPORT_BYTES`]: first drop the details,
/// then (hundreds of probes, far beyond what a node runs) cut the list,
/// saying so in the log.
fn fit_health(mut h: Health, node: &NodeId) -> Health {
    let fits = |h: &Health| {
        let probe = Envelope::new(node.clone(), u64::MAX, Report::Health(h.clone()));
        probe.encode().len() <= MAX_REPORT_BYTES
    };
    h.probes.truncate(mesh_protocol::MAX_PROBE_RESULTS);
    if fits(&h) {
        return h;
    }
    for p in &mut h.probes {
        p.detail = None;
    }
    let total = h.probes.len();
    while !fits(&h) && !h.probes.is_empty() {
        let keep = h.probes.len() * 9 / 10;
        h.probes.truncate(keep);
    }
    if h.probes.len() < total {
        warn!(
            total,
            reported = h.probes.len(),
            "too many probes for one health report; the list is cut"
        );
    }
    h
}

fn truncate(s: &str, max_chars: usize) -> String {
    if s.chars().count() <= max_chars {
        s.to_owned()
    } else {
        s.chars().take(max_chars).collect::<String>() + "…"
    }
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

async fn open_publisher(conn: &Connection, deadline: Duration) -> Result<Channel, lapin::Error> {
    within(deadline, "opening the publishing channel", async {
        let ch = conn.create_channel().await?;
        ch.confirm_select(ConfirmSelectOptions::default()).await?;
        Ok(ch)
    })
    .await
}

async fn start_consumer(
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

async fn next_change(
    changes: &mut Option<tokio::sync::mpsc::Receiver<Vec<ItemOutcome>>>,
) -> Option<Vec<ItemOutcome>> {
    match changes {
        Some(c) => c.recv().await,
        None => std::future::pending().await,
    }
}

async fn next_delivery(
    consumer: &mut Option<(Channel, Consumer)>,
) -> Option<Result<Delivery, lapin::Error>> {
    match consumer {
        Some((_, c)) => c.next().await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_is_capped_and_jittered() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(800));
        for _ in 0..20 {
            assert!(b.next_delay() <= Duration::from_millis(800));
        }
        assert_eq!(b.cap, Duration::from_millis(800));
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }

    #[test]
    fn oversized_health_reports_are_shrunk() {
        let now = chrono::Utc::now();
        let probes: Vec<mesh_protocol::ProbeResult> = (0..600)
            .map(|i| mesh_protocol::ProbeResult {
                unit: format!("unit-{i}"),
                module: "m".into(),
                probe: "ready".into(),
                state: mesh_protocol::ProbeState::Unhealthy,
                since: now,
                checked_at: Some(now),
                failures: 3,
                detail: Some("d".repeat(mesh_protocol::MAX_PROBE_DETAIL)),
            })
            .collect();
        let node = NodeId::parse(&"n".repeat(63)).unwrap();
        let small = fit_health(
            Health {
                probes: probes.clone(),
                summary: false,
            },
            &node,
        );
        assert!(!small.probes.is_empty());
        assert!(small.probes.iter().all(|p| p.detail.is_none()));
        let env = Envelope::new(node.clone(), 1, Report::Health(small));
        assert!(env.encode().len() <= MAX_REPORT_BYTES);
        // A small one is left as it is.
        let few = Health {
            probes: probes[..3].to_vec(),
            summary: true,
        };
        assert_eq!(fit_health(few.clone(), &node), few);
    }

    #[test]
    fn oversized_resources_reports_are_cut_to_fit() {
        let node = NodeId::parse(&"n".repeat(63)).unwrap();
        let status = |i: u128, reason: Option<String>| mesh_protocol::ResourceStatus {
            grant: Uuid::from_u128(i),
            state: ResourceStatusState::Failed,
            credential_version: Some(1),
            reason,
            recreated: false,
        };
        let size = |r: &Resources| {
            Envelope::new(node.clone(), 1, Report::Resources(r.clone()))
                .encode()
                .len()
        };
        // Long reasons: shortened, every grant kept.
        let long = Resources {
            generation: 3,
            resources: (0..100)
                .map(|i| status(i, Some("r".repeat(mesh_protocol::MAX_REASON_CHARS))))
                .collect(),
        };
        assert!(size(&long) > MAX_REPORT_BYTES);
        let cut = fit_resources(long, &node);
        assert!(size(&cut) <= MAX_REPORT_BYTES);
        assert_eq!(cut.generation, 3);
        assert_eq!(cut.resources.len(), 100);
        assert!(cut.resources.iter().all(|s| {
            let r = s.reason.as_deref().unwrap();
            r.starts_with("rrr") && r.chars().count() <= 201
        }));
        // The most a section holds, each with a full reason: cut to what fits.
        let many = Resources {
            generation: 4,
            resources: (0..mesh_protocol::MAX_RESOURCES as u128)
                .map(|i| status(i, Some("x".repeat(mesh_protocol::MAX_REASON_CHARS))))
                .collect(),
        };
        let cut = fit_resources(many, &node);
        assert!(size(&cut) <= MAX_REPORT_BYTES);
        assert!(!cut.resources.is_empty());
        assert_eq!(cut.resources[0].grant, Uuid::from_u128(0));
        // A report that fits is left as it is.
        let small = Resources {
            generation: 1,
            resources: vec![status(1, Some("refused".into()))],
        };
        assert_eq!(fit_resources(small.clone(), &node), small);
    }

    #[test]
    fn oversized_applied_reports_are_shrunk() {
        let items = (0..1024)
            .map(|i| ItemOutcome {
                item: format!("/{}/{i}", "p".repeat(200)),
                ok: i % 2 == 0,
                error: Some("e".repeat(300)),
            })
            .collect();
        let a = Applied {
            section: Some(mesh_protocol::Section::Config),
            generation: Some(1),
            outcome: Outcome::Failed,
            items,
            error: Some("x".into()),
            unsupported_section: None,
        };
        let node = NodeId::parse(&"n".repeat(63)).unwrap();
        let small = fit_applied(a, &node);
        let env = Envelope::new(node, 1, Report::Applied(small));
        assert!(env.encode().len() <= MAX_REPORT_BYTES);
    }
}
