//! The provisioning context (decision 0039): resource grants between modules
//! (a database, a broker vhost, a bucket).
//!
//! It owns the PostgreSQL schema `provisioning` and nothing else. It learns
//! what each module requires and provides, and where it runs, from the
//! record (`inventory.module.placed` / `.removed`), keeping its own copy; it
//! learns what provider nodes made of each grant from their `resources`
//! reports (a node speaks only of the grants its provider module serves).
//! It tells config each grant's credential on the record
//! (`provisioning.credentials.issued`, sealed under the secrets master key
//! in config's at-rest form; `.withdrawn` on revocation), the grants that
//! wait or failed (`provisioning.grants.conditions`), and each provider node
//! its `provisioning` section (the `resources` to make, revoke or delete)
//! through the section component. It never publishes, never speaks AMQP and
//! never reads another context's schema; the schema never holds a password.
//!
//! Every change ends in one level-triggered pass (`reconcile`) under the
//! context's advisory lock; the controller's resync timer runs it too (it
//! ages revoked grants out of their retention and issues credentials that
//! waited for a master keyring).

mod api;
mod error;
pub mod plan;
mod query;
mod reconcile;
mod reports;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use mesh_plumbing::openapi::tagged;
use mesh_plumbing::section::{self, Items, SectionOwner, Sections};
use mesh_plumbing::{Context, HandlerError, MigrateError, OutboxSignal};
use mesh_protocol::{Envelope, ModuleEvent, NodeId, RecordEvent, Report, Section};
use sqlx::{PgConnection, PgPool};

pub use error::Error;
pub use mesh_plumbing::section::Declared as ReconcileReport;
pub use plan::{
    Choice, Credential, ModuleFacts, Wanted, credential_file, new_credential, resolve,
    resource_name,
};
pub use query::{GrantFilter, GrantView, ProviderNodeView};
pub use reconcile::{GrantState, consumer_file, module_secret_path, provider_file, secret_name};

/// The context's schema (and its role's name): `bundle/up` provisions both.
pub const SCHEMA: &str = "provisioning";

/// The section it declares to provider nodes: their grants' `resources`.
pub const SECTIONS: Sections = Sections::new(SCHEMA, Section::Provisioning);

/// Default retention of a revoked grant's data: 7 days.
pub const DEFAULT_GRANT_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

/// Most grants one page of `GET /v1/grants` holds.
pub const MAX_GRANTS_PAGE: i64 = 500;

// refinery names a Rust migration's module after its file (`V2__sections`).
#[allow(non_snake_case)]
mod embedded {
    refinery::embed_migrations!("../../migrations/provisioning");
}

/// Apply the provisioning migrations, connected as the provisioning role
/// (`url`). Returns the migrations applied now (none when up to date).
pub async fn migrate(url: &str) -> Result<Vec<String>, MigrateError> {
    mesh_plumbing::migrate(url, SCHEMA, embedded::migrations::runner()).await
}

/// Tunables of the provisioning context.
#[derive(Debug, Clone)]
pub struct Settings {
    /// How long a revoked grant's data is kept on its provider's server
    /// before it is deleted (a requirement asked again within it takes the
    /// grant, and its data, up again). Default 7 days.
    pub retention: Duration,
    /// A node whose heartbeat says it is behind on its provisioning section
    /// is sent it again at most once per this interval. Default 30 s.
    pub resend_after: Duration,
    /// The secrets master keyring (config's), read at each issue; none: no
    /// credential is issued and grants wait, saying so.
    pub master_keys_file: Option<PathBuf>,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            retention: DEFAULT_GRANT_RETENTION,
            resend_after: Duration::from_secs(30),
            master_keys_file: None,
        }
    }
}

/// The provisioning context, shared by the controller's router and its API.
pub struct Provisioning {
    pool: PgPool,
    signal: OutboxSignal,
    settings: Settings,
}

impl Provisioning {
    /// `pool` must be connected as the provisioning role; `signal` wakes the
    /// outbox relay after a resync wrote something.
    pub fn new(pool: PgPool, signal: OutboxSignal, settings: Settings) -> Self {
        Provisioning {
            pool,
            signal,
            settings,
        }
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// The API routes: `GET /v1/grants` and `GET /v1/grants/{id}`, each
    /// with its OpenAPI description.
    pub fn routes(self: Arc<Self>) -> utoipa_axum::router::OpenApiRouter {
        tagged(api::routes(), SCHEMA).with_state(self)
    }

    /// The pass and every provider node's section (the controller's timer):
    /// revoked grants age out, waiting credentials are issued once a keyring
    /// is there, what differs is declared. Wakes the relay after it.
    pub async fn resync(&self) -> Result<ReconcileReport, Error> {
        let report = section::resync(self).await?;
        // The pass may have written record events without declaring.
        self.signal.notify();
        Ok(report)
    }

    /// The section stored for `node`, if any.
    pub async fn section(&self, node: &NodeId) -> Result<Option<section::Stored>, Error> {
        Ok(SECTIONS.stored(&self.pool, node).await?)
    }

    /// The pass and the declaration of what it changed (the caller holds
    /// the lock).
    async fn reconcile(&self, tx: &mut PgConnection) -> Result<ReconcileReport, Error> {
        let world = reconcile::pass(tx, &self.settings).await?;
        let desired = reconcile::desired(tx, &world).await?;
        let report = SECTIONS.declare(tx, desired).await?;
        if !report.too_large.is_empty() {
            tracing::error!(nodes = ?report.too_large, "provisioning sections an agent would refuse");
        }
        Ok(report)
    }

    async fn reports(
        &self,
        tx: &mut PgConnection,
        reports: &[Envelope<Report>],
    ) -> Result<(), Error> {
        reconcile::lock(tx).await?;
        SECTIONS.on_hello(tx, reports).await?;
        SECTIONS
            .on_heartbeat(tx, reports, self.settings.resend_after)
            .await?;
        if reports::resources(tx, reports).await? {
            self.reconcile(tx).await?;
        }
        Ok(())
    }

    async fn events(&self, tx: &mut PgConnection, events: &[&RecordEvent]) -> Result<(), Error> {
        reconcile::lock(tx).await?;
        let modules: Vec<ModuleEvent<'_>> = events
            .iter()
            .filter_map(|e| ModuleEvent::of(&e.kind))
            .collect();
        if reports::modules(tx, &modules).await? {
            self.reconcile(tx).await?;
        }
        Ok(())
    }
}

impl SectionOwner for Provisioning {
    const SECTIONS: Sections = SECTIONS;
    type Error = Error;

    fn outbox_signal(&self) -> &OutboxSignal {
        &self.signal
    }

    async fn desired(&self, tx: &mut PgConnection) -> Result<Vec<(NodeId, Items)>, Error> {
        reconcile::lock(tx).await?;
        let world = reconcile::pass(tx, &self.settings).await?;
        reconcile::desired(tx, &world).await
    }
}

impl Context for Provisioning {
    const SCHEMA: &'static str = SCHEMA;

    fn pool(&self) -> &PgPool {
        &self.pool
    }

    fn subscriptions(&self) -> &'static [&'static str] {
        &["inventory.module.*"]
    }

    /// Hellos and durable heartbeats (every provider node behind is caught
    /// up on its section) and `resources` reports.
    async fn handle_reports(
        &self,
        tx: &mut PgConnection,
        reports: &[Envelope<Report>],
    ) -> Result<(), HandlerError> {
        self.reports(tx, reports).await.map_err(HandlerError::from)
    }

    /// The module events of a batch in one upsert and one pass.
    async fn handle_events(
        &self,
        tx: &mut PgConnection,
        events: &[&RecordEvent],
    ) -> Result<(), HandlerError> {
        self.events(tx, events).await.map_err(HandlerError::from)
    }
}
