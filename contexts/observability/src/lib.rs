//! The observability context: health from probes, alerts, and the record
//! kept for a window and streamed to operators as server-sent events.
//!
//! - **Health** (`health.rs`): nodes report their units and probe results
//!   (`units`, `health` reports, recorded by `inputs.rs`); the record tells
//!   where modules run and which nodes are reachable. An evaluation
//!   (`evaluate.rs`, on the controller's interval and after reports
//!   committed) derives the health of every replica, module and node and
//!   tells the record each module whose health changed
//!   (`observability.module.health`, for delivery's rollout gate).
//! - **Alerts** (`alerts.rs`): the same evaluation makes the open alerts what
//!   the rules say (node unreachable, crash loops, modules degraded or below
//!   their replicas, pinned modules on unreachable nodes, certificates
//!   expiring, nodes behind, dead letters and deep queues, re-placement
//!   paused, the controller unreachable as nodes saw it), raising and
//!   resolving each with its record event. `GET /v1/health`, `GET /v1/alerts`
//!   (`health_api.rs`).
//! - **The event stream** (`events.rs`, `api.rs`): `GET /v1/events`.
//!
//! It owns the PostgreSQL schema `observability` and nothing else. It
//! subscribes to every record event but the operators' audit entries (the
//! audit log is admin-only, the stream is viewer) and appends each, once (the
//! inbox), to `observability.events` in the handler's transaction; the row's
//! `position` is the stream's event id. Rows older than the retention window
//! are pruned with every batch appended (and by [`Observability::prune`]); a
//! client resuming from a pruned position is answered 410 and re-lists.
//!
//! It never publishes, declares nothing to nodes, never speaks AMQP and
//! never reads another context's schema. A stream never slows the
//! controller: each client has a bounded buffer and is dropped, with a
//! reason, when it reads too slowly; the number of streams is bounded.

mod alertmanager;
mod alerts;
mod api;
mod error;
mod evaluate;
mod events;
mod health;
mod health_api;
mod inputs;

use std::sync::Arc;
use std::time::Duration;

use mesh_plumbing::reads::Reads;
use mesh_plumbing::{Context, HandlerError, MigrateError, OutboxSignal};
use mesh_protocol::{Envelope, RecordEvent, Report};
use sqlx::{PgConnection, PgPool};
use tokio::sync::{Notify, Semaphore, watch};

pub use alertmanager::{AlertPoster, Delivered, PostableAlert};
pub use alerts::{ALERT_KINDS, Behind, Observations, QueueDepth, humanize};
pub use error::Error;
pub use evaluate::Summary;
pub use events::{EventView, Filter, Position};
pub use health::{ModuleHealthView, NodeHealthView, ProbeView, ReplicaView};
pub use health_api::{AlertList, AlertView, AlertsParams, HealthView};

/// The schema (and record context name) this crate owns.
pub const SCHEMA: &str = "observability";

// refinery names a Rust migration's module after its file.
#[allow(non_snake_case)]
mod embedded {
    refinery::embed_migrations!("../../migrations/observability");
}

/// Apply the observability migrations, connected as the observability role
/// (`url`). Returns the migrations applied now (none when up to date).
pub async fn migrate(url: &str) -> Result<Vec<String>, MigrateError> {
    mesh_plumbing::migrate(url, SCHEMA, embedded::migrations::runner()).await
}

/// What this context subscribes to: every record event of
/// [`mesh_protocol::RECORD_EVENTS`] but `*.operator.audit` and
/// `provisioning.credentials.*` (encrypted credentials: not for the
/// viewers' event stream).
pub const SUBSCRIPTIONS: [&str; 16] = [
    "inventory.node.joined",
    "inventory.node.updated",
    "inventory.node.unreachable",
    "inventory.node.alive",
    "inventory.module.placed",
    "inventory.module.removed",
    "inventory.fleet.conditions",
    "identity.node.enrolled",
    "identity.node.revoked",
    "identity.node.readmitted",
    "connectivity.certificate.issued",
    "observability.module.health",
    "observability.alert.raised",
    "observability.alert.resolved",
    "delivery.module.targets",
    "provisioning.grants.conditions",
];

/// Tunables of the observability context.
#[derive(Debug, Clone)]
pub struct Settings {
    /// How long an event is kept (and a position can be resumed from).
    /// Default 24 h.
    pub retention: Duration,
    /// Concurrent event streams; one more is answered 503. Default 64.
    pub max_streams: usize,
    /// Events a client may have unread before it is dropped as too slow.
    /// Default 1024.
    pub stream_buffer: usize,
    /// Rows a stream reads per query. Default 256.
    pub page: i64,
    /// A stream looks for new events at least this often, in case a wake-up
    /// was missed. Default 5 s.
    pub poll: Duration,
    /// How often health and alerts are evaluated (also soon after reports
    /// committed, at most this often). Default 5 s.
    pub evaluate_every: Duration,
    /// How long a probe's history of state changes is kept. Default 7 days.
    pub probe_retention: Duration,
    /// How long a resolved alert is kept. Default 7 days.
    pub alert_retention: Duration,
    /// Restarts of one unit within `crash_window` that make it crash-looping.
    /// Default 3.
    pub crash_restarts: u32,
    /// Default 10 minutes.
    pub crash_window: Duration,
    /// OOM kills of one unit since it was declared that raise
    /// `unit_oom_killed`. Default 3.
    pub oom_kills: u32,
    /// A certificate whose `not_after` is closer than this, or than a
    /// quarter of its lifetime (whichever is shorter), is alerted. Default
    /// 14 days.
    pub certificate_window: Duration,
    /// A node behind on a section for longer than this is alerted. Default 5 min.
    pub behind_after: Duration,
    /// How long the controller-unreachable alert stays open after a node
    /// reported an outage (it is about the past). Default 15 minutes.
    pub outage_window: Duration,
    /// Alertmanagers every alert is delivered to (base URLs, e.g.
    /// `http://127.0.0.1:9093`; `POST /api/v2/alerts` of each), as
    /// Prometheus sends to all of its. Default none: alerts stay in the API.
    pub alertmanager_urls: Vec<String>,
    /// How often every open alert is sent again (Alertmanager resolves one
    /// not re-sent within its `resolve_timeout`, 5 minutes by default).
    /// Default 60 s.
    pub alertmanager_resend: Duration,
    /// The dashboard's URL, linked from each delivered alert. Default none.
    pub dashboard_url: Option<String>,
}

/// Default retention window.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 3600);

impl Default for Settings {
    fn default() -> Self {
        Settings {
            retention: DEFAULT_RETENTION,
            max_streams: 64,
            stream_buffer: 1024,
            page: 256,
            poll: Duration::from_secs(5),
            evaluate_every: Duration::from_secs(5),
            probe_retention: Duration::from_secs(7 * 24 * 3600),
            alert_retention: Duration::from_secs(7 * 24 * 3600),
            crash_restarts: 3,
            crash_window: Duration::from_secs(600),
            oom_kills: 3,
            certificate_window: Duration::from_secs(14 * 24 * 3600),
            behind_after: Duration::from_secs(300),
            outage_window: Duration::from_secs(900),
            alertmanager_urls: Vec::new(),
            alertmanager_resend: Duration::from_secs(60),
            dashboard_url: None,
        }
    }
}

/// The observability context, shared by the controller's router and its API.
pub struct Observability {
    pool: PgPool,
    /// The reads that tolerate lag (the event history, `follow=false`): the
    /// replica when the controller has one (decision 0041), else `pool`.
    reads: Reads,
    settings: Settings,
    /// Raised after a batch of events committed: wakes every stream.
    appended: watch::Sender<u64>,
    streams: Arc<Semaphore>,
    /// Raised after reports or events committed: an evaluation is due.
    changed: Arc<Notify>,
    /// Wakes the relay after an evaluation wrote record events.
    signal: OutboxSignal,
    /// Raised after an evaluation raised or resolved alerts: a delivery to
    /// Alertmanager is due.
    alerts_changed: Arc<Notify>,
}

impl Observability {
    /// `pool` must be connected as the observability role.
    /// `signal` wakes the relay after an evaluation wrote record events.
    pub fn new(pool: PgPool, signal: OutboxSignal, settings: Settings) -> Self {
        Observability {
            reads: Reads::new(pool.clone()),
            pool,
            streams: Arc::new(Semaphore::new(settings.max_streams)),
            settings,
            appended: watch::Sender::new(0),
            changed: Arc::new(Notify::new()),
            alerts_changed: Arc::new(Notify::new()),
            signal,
        }
    }

    /// Evaluate health and alerts now, with what the controller observed:
    /// derive every replica's, module's and node's health, write
    /// `observability.module.health` for each module whose health changed,
    /// raise and resolve alerts (each with its record event), prune what is
    /// past its retention. Idempotent; concurrent calls serialize.
    pub async fn evaluate(&self, observations: &Observations) -> Result<Summary, Error> {
        let mut tx = self.pool.begin().await?;
        let summary = evaluate::run(&mut tx, &self.settings, observations).await?;
        tx.commit().await?;
        if summary.raised + summary.resolved + summary.health_changed > 0 {
            self.signal.notify();
        }
        if summary.raised + summary.resolved > 0 {
            self.alerts_changed.notify_one();
        }
        Ok(summary)
    }

    /// Resolves when reports or events committed since the last call (an
    /// evaluation is due), or never; the caller bounds it with its interval.
    pub async fn changed(&self) {
        self.changed.notified().await;
    }

    /// Resolves when an evaluation raised or resolved alerts since the last
    /// call (a delivery to Alertmanager is due), or never.
    pub async fn alerts_changed(&self) {
        self.alerts_changed.notified().await;
    }

    /// Every module's and node's health, derived now.
    pub async fn health(&self) -> Result<(Vec<ModuleHealthView>, Vec<NodeHealthView>), Error> {
        let mut tx = self.pool.begin().await?;
        let out = evaluate::current_health(&mut tx).await?;
        tx.commit().await?;
        Ok(out)
    }

    /// A page of alerts (`GET /v1/alerts`).
    /// `after` is the previous page's `next`, `limit` 1 to 500.
    pub async fn alerts(
        &self,
        params: &AlertsParams,
        after: Option<uuid::Uuid>,
        limit: i64,
    ) -> Result<AlertList, Error> {
        health_api::list(&self.pool, params, after, limit).await
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// Serve the reads that tolerate lag through `reads` (its primary must be
    /// this context's pool).
    pub fn with_reads(mut self, reads: Reads) -> Self {
        self.reads = reads;
        self
    }

    /// The reads that tolerate lag, and where they go.
    pub fn reads(&self) -> &Reads {
        &self.reads
    }

    /// The API routes this context serves: `GET /v1/events`, `/v1/health`
    /// and `/v1/alerts`, with their OpenAPI descriptions.
    pub fn routes(self: Arc<Self>) -> utoipa_axum::router::OpenApiRouter {
        api::routes().merge(health_api::routes()).with_state(self)
    }

    /// Forget events older than the retention window; returns how many.
    pub async fn prune(&self) -> Result<u64, Error> {
        let mut tx = self.pool.begin().await?;
        let n = events::prune(&mut tx, self.settings.retention).await?;
        tx.commit().await?;
        Ok(n)
    }

    /// Events after `after` that pass `filter`, at most `limit`, oldest
    /// first (what a stream sends; also for tests).
    pub async fn read(
        &self,
        after: Position,
        filter: &Filter,
        limit: i64,
    ) -> Result<Vec<EventView>, Error> {
        events::page(&self.pool, after, filter, limit).await
    }
}

impl Context for Observability {
    const SCHEMA: &'static str = SCHEMA;

    fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Every record event but `*.operator.audit` (admin-only, not for the
    /// viewer's stream).
    fn subscriptions(&self) -> &'static [&'static str] {
        &SUBSCRIPTIONS
    }

    /// Probe results (`health`), units (`units`) and the outages hellos state.
    async fn handle_reports(
        &self,
        tx: &mut PgConnection,
        reports: &[Envelope<Report>],
    ) -> Result<(), HandlerError> {
        inputs::reports(tx, reports).await?;
        Ok(())
    }

    async fn handle_events(
        &self,
        tx: &mut PgConnection,
        events: &[&RecordEvent],
    ) -> Result<(), HandlerError> {
        inputs::events(tx, events).await?;
        events::append(tx, events).await?;
        events::prune(tx, self.settings.retention).await?;
        Ok(())
    }

    fn committed(&self) {
        self.appended.send_modify(|n| *n = n.wrapping_add(1));
        self.changed.notify_one();
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn subscriptions_are_the_record_without_audit_or_credentials() {
        let expected: Vec<&str> = mesh_protocol::RECORD_EVENTS
            .into_iter()
            .filter(|p| !p.ends_with(mesh_protocol::AUDIT_EVENT))
            .filter(|p| !p.starts_with("provisioning.credentials."))
            .collect();
        assert_eq!(super::SUBSCRIPTIONS.as_slice(), expected.as_slice());
    }
}
