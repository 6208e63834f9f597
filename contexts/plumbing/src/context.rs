use std::future::Future;
use std::sync::Arc;

use mesh_protocol::{Envelope, RecordEvent, Report};
use sqlx::{PgConnection, PgPool};
use thiserror::Error;
use tokio::sync::Notify;

/// Why a handler did not handle a message. The controller requeues a transient
/// error (the message is retried after the cause passes) and dead-letters a
/// permanent one with the error as the reason.
#[derive(Debug, Error)]
pub enum HandlerError {
    #[error("transient: {0}")]
    Transient(String),
    #[error("{0}")]
    Permanent(String),
}

impl HandlerError {
    pub fn is_transient(&self) -> bool {
        matches!(self, HandlerError::Transient(_))
    }

    pub fn metric_label(&self) -> &'static str {
        match self {
            HandlerError::Transient(_) => "transient",
            HandlerError::Permanent(_) => "permanent",
        }
    }
}

impl From<sqlx::Error> for HandlerError {
    /// Data and integrity errors (SQLSTATE classes 22 and 23) say the message is
    /// wrong and will stay wrong: permanent. Everything else (connection lost,
    /// pool timed out, serialization failure) may pass: transient.
    fn from(e: sqlx::Error) -> Self {
        HandlerError::of_database(&e)
    }
}

impl HandlerError {
    /// The class of a database error (what `HandlerError::from(sqlx::Error)`
    /// gives), for one held by reference: a context's error that wraps it.
    pub fn of_database(e: &sqlx::Error) -> Self {
        if let sqlx::Error::Database(db) = e
            && let Some(code) = db.code()
            && (code.starts_with("22") || code.starts_with("23"))
        {
            return HandlerError::Permanent(format!("database refused: {db}"));
        }
        HandlerError::Transient(e.to_string())
    }
}

/// Wakes the outbox relay after a commit that wrote to an outbox, so declarations
/// leave at once instead of at the relay's next poll.
#[derive(Clone, Default, Debug)]
pub struct OutboxSignal(Arc<Notify>);

impl OutboxSignal {
    pub fn notify(&self) {
        self.0.notify_one();
    }

    pub async fn notified(&self) {
        self.0.notified().await;
    }
}

/// Whether a context's database answers (`SELECT 1` on its pool): the
/// controller's health check, which reads nothing of any context.
pub async fn reachable(pool: &PgPool) -> bool {
    sqlx::query("SELECT 1").execute(pool).await.is_ok()
}

/// A bounded context as the controller sees it. Each context owns one schema,
/// named [`Context::SCHEMA`], reached through its own pool (its own role).
///
/// Handlers run inside a transaction the controller opened on the context's pool;
/// the inbox has already filtered out messages this context handled before. They
/// write their own tables and their outbox through `tx`, never anything else, and
/// never publish.
pub trait Context: Send + Sync + 'static {
    /// The schema this context owns; also its name on the record.
    const SCHEMA: &'static str;

    /// The pool connected as this context's role.
    fn pool(&self) -> &PgPool;

    /// Record routing-key patterns (`inventory.node.*`) this context consumes.
    fn subscriptions(&self) -> &'static [&'static str] {
        &[]
    }

    /// Handle a batch of reports (from one or many nodes; the node of each has been
    /// authenticated). Must be idempotent for heartbeats, which skip the inbox.
    fn handle_reports(
        &self,
        tx: &mut PgConnection,
        reports: &[Envelope<Report>],
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;

    /// Handle one record event this context subscribed to. The default hands
    /// it to [`Context::handle_events`] as a batch of one: a context overrides
    /// one of the two (a context that overrides neither handles nothing).
    fn handle_event(
        &self,
        tx: &mut PgConnection,
        event: &RecordEvent,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send {
        async move { self.handle_events(tx, &[event]).await }
    }

    /// Called after a transaction of [`Context::handle_events`] or
    /// [`Context::handle_reports`] committed (the observability context wakes
    /// its event streams and its evaluation). Must not block.
    fn committed(&self) {}

    /// Handle a batch of record events this context subscribed to, in the order
    /// they were delivered (the inbox has already filtered out those handled
    /// before, and duplicates within the batch). The default hands them to
    /// [`Context::handle_event`] one by one; a context that can act on many at
    /// once (one statement for the batch instead of one per event) overrides
    /// it, with the same outcome as the one-by-one handling but for
    /// intermediate steps a later event of the batch supersedes.
    fn handle_events(
        &self,
        tx: &mut PgConnection,
        events: &[&RecordEvent],
    ) -> impl Future<Output = Result<(), HandlerError>> + Send {
        async move {
            for event in events {
                self.handle_event(&mut *tx, event).await?;
            }
            Ok(())
        }
    }
}
