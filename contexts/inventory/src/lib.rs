//! The inventory context: which nodes exist, their facts (hello), their labels
//! (reported by the node, overridden by operators), their liveness (last seen) and
//! the generations they have applied per section.
//!
//! It owns the PostgreSQL schema `inventory` and nothing else. It learns from
//! reports (hello, heartbeat, applied) and tells other contexts about nodes through
//! record events `inventory.node.joined` / `inventory.node.updated`
//! ([`mesh_protocol::NodeLabelsChanged`]), written to its outbox in the handler's
//! transaction. It never publishes, never speaks AMQP and never reads another
//! context's schema.
//!
//! Effective labels are the reported labels overridden key by key by the operator
//! labels (an operator label cannot remove a reported key, only change its value).
//! A node's `version` grows by one whenever its effective labels change; it is the
//! `version` of the events, so a receiver ignores an event older than what it has.

mod api;
mod error;
mod query;
mod reports;

use std::sync::Arc;

use mesh_plumbing::{Context, HandlerError, MigrateError, OutboxSignal};
use mesh_protocol::{Envelope, Report};
use sqlx::{PgConnection, PgPool};

pub use error::Error;
pub use query::{AppliedView, LabelsView, NodeSummary, NodeView};

/// The schema (and record context name) this crate owns.
pub const SCHEMA: &str = "inventory";

mod embedded {
    refinery::embed_migrations!("../../migrations/inventory");
}

/// Apply the inventory migrations, connected as the inventory role (`url`).
/// Returns the migrations applied now (none when already up to date).
pub async fn migrate(url: &str) -> Result<Vec<String>, MigrateError> {
    mesh_plumbing::migrate(url, SCHEMA, embedded::migrations::runner()).await
}

/// Tunables of the inventory context.
#[derive(Debug, Clone)]
pub struct InventorySettings {
    /// Largest page `GET /v1/nodes` returns (its `limit` is capped to this).
    /// Default 1000.
    pub max_page: i64,
}

impl Default for InventorySettings {
    fn default() -> Self {
        InventorySettings { max_page: 1000 }
    }
}

/// The inventory context, shared by the controller's report router and its API.
pub struct Inventory {
    pool: PgPool,
    signal: OutboxSignal,
    settings: InventorySettings,
}

impl Inventory {
    /// `pool` must be connected as the inventory role; `signal` wakes the outbox
    /// relay after an API request wrote an event.
    pub fn new(pool: PgPool, signal: OutboxSignal, settings: InventorySettings) -> Self {
        Inventory {
            pool,
            signal,
            settings,
        }
    }

    pub fn settings(&self) -> &InventorySettings {
        &self.settings
    }

    /// The API routes this context serves: `GET /v1/nodes`,
    /// `PUT /v1/nodes/{id}/labels`.
    pub fn routes(self: Arc<Self>) -> axum::Router {
        api::routes(self)
    }
}

impl Context for Inventory {
    const SCHEMA: &'static str = SCHEMA;

    fn pool(&self) -> &PgPool {
        &self.pool
    }

    async fn handle_reports(
        &self,
        tx: &mut PgConnection,
        reports: &[Envelope<Report>],
    ) -> Result<(), HandlerError> {
        reports::handle(tx, reports)
            .await
            .map_err(HandlerError::from)
    }
}
