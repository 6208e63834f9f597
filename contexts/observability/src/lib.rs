//! The observability context, its first slice: the record, kept for a window
//! and streamed to operators as server-sent events (`GET /v1/events`).
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

mod api;
mod error;
mod events;

use std::sync::Arc;
use std::time::Duration;

use mesh_plumbing::{Context, HandlerError, MigrateError};
use mesh_protocol::{Envelope, RecordEvent, Report};
use sqlx::{PgConnection, PgPool};
use tokio::sync::{Semaphore, watch};

pub use error::Error;
pub use events::{EventView, Filter, Position};

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
/// [`mesh_protocol::RECORD_EVENTS`] but `*.operator.audit`.
pub const SUBSCRIPTIONS: [&str; 13] = [
    "inventory.node.joined",
    "inventory.node.updated",
    "inventory.node.unreachable",
    "inventory.node.alive",
    "inventory.module.placed",
    "inventory.module.removed",
    "inventory.fleet.conditions",
    "identity.node.enrolled",
    "identity.node.revoked",
    "connectivity.certificate.issued",
    "observability.module.health",
    "observability.alert.raised",
    "observability.alert.resolved",
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
        }
    }
}

/// The observability context, shared by the controller's router and its API.
pub struct Observability {
    pool: PgPool,
    settings: Settings,
    /// Raised after a batch of events committed: wakes every stream.
    appended: watch::Sender<u64>,
    streams: Arc<Semaphore>,
}

impl Observability {
    /// `pool` must be connected as the observability role.
    pub fn new(pool: PgPool, settings: Settings) -> Self {
        Observability {
            pool,
            streams: Arc::new(Semaphore::new(settings.max_streams)),
            settings,
            appended: watch::Sender::new(0),
        }
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// The API routes this context serves: `GET /v1/events`, with its
    /// OpenAPI description.
    pub fn routes(self: Arc<Self>) -> utoipa_axum::router::OpenApiRouter {
        api::routes().with_state(self)
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

    async fn handle_reports(
        &self,
        _tx: &mut PgConnection,
        _reports: &[Envelope<Report>],
    ) -> Result<(), HandlerError> {
        Ok(())
    }

    async fn handle_events(
        &self,
        tx: &mut PgConnection,
        events: &[&RecordEvent],
    ) -> Result<(), HandlerError> {
        events::append(tx, events).await?;
        events::prune(tx, self.settings.retention).await?;
        Ok(())
    }

    fn committed(&self) {
        self.appended.send_modify(|n| *n = n.wrapping_add(1));
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn subscriptions_are_the_record_without_audit() {
        let expected: Vec<&str> = mesh_protocol::RECORD_EVENTS
            .into_iter()
            .filter(|p| !p.ends_with(mesh_protocol::AUDIT_EVENT))
            .collect();
        assert_eq!(super::SUBSCRIPTIONS.as_slice(), expected.as_slice());
    }
}
