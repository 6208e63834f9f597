//! The config context: files operators declare (for one node, or for every node
//! whose labels match a selector) and the `config` section of each node that
//! results.
//!
//! It owns the PostgreSQL schema `config` and nothing else. It learns of nodes
//! only from record events `inventory.node.joined` / `inventory.node.updated`
//! (keeping its own copy of each node's labels and version), and of the generation
//! each node holds from its hellos and heartbeats (what nodes applied is
//! inventory's record). It tells nodes their whole config section through its
//! outbox; it never publishes, never speaks AMQP and never reads another context's
//! schema.
//!
//! Reconciling is level-triggered: for each node it computes the files that match
//! now and hands them to the section component ([`mesh_plumbing::section`]),
//! which declares a new generation only when their digest differs from the
//! stored one, and catches up nodes on hello and heartbeat. Precedence when two
//! files name the same path for one node: a file targeted at the node beats a
//! selector file; between files of the same kind the lexicographically smallest
//! file name wins. Reconciles are serialized by a PostgreSQL advisory lock (a
//! whole-fleet reconcile exclusively, a reconcile of some nodes — the node
//! events of a batch — shared plus each node's lock), so two never compute the
//! same generation from a stale read.

mod api;
use mesh_credentials::crypt;
mod derive;
mod error;
mod layers;
mod provisioned;
mod query;
mod reconcile;
mod reports;
mod secrets;
mod secrets_api;
pub mod settings;
mod settings_api;

use std::sync::Arc;
use std::time::Duration;

use mesh_plumbing::openapi::tagged;
use mesh_plumbing::section::{self, Items, SectionOwner, Sections};
use mesh_plumbing::{Context, HandlerError, MigrateError, OutboxSignal};
use mesh_protocol::{Envelope, NodeId, RecordEvent, RecordKind, Report, Section};
use sqlx::{PgConnection, PgPool};

pub use error::Error;
pub use layers::{EffectiveView, LayerView, NodeSettings};
/// What a reconcile did: the section component's report.
pub use mesh_plumbing::section::Declared as ReconcileReport;
pub use query::{FileSpec, FileSummary, FileView, SectionStatus, Target};
pub use secrets::{
    GrantView, Keyring, MAX_SECRET_BYTES, RotationReport, SecretVersion, SecretView, grant_path,
};

/// The schema (and record context name) this crate owns.
pub const SCHEMA: &str = "config";

/// The config section of each node, in `config.sections`.
pub const SECTIONS: Sections = Sections::new(SCHEMA, Section::Config);

/// The directory of a module on a node.
pub fn module_dir(module: &str) -> String {
    format!("/modules/{module}")
}

// refinery names a Rust migration's module after its file (`V3__sections`).
#[allow(non_snake_case)]
mod embedded {
    refinery::embed_migrations!("../../migrations/config");
}

/// The config migrations, for a test that stops at a version
/// (`set_target`) to check what a later one keeps.
pub fn migrations() -> refinery::Runner {
    embedded::migrations::runner()
}

/// Apply the config migrations, connected as the config role (`url`). Returns
/// the migrations applied now (none when already up to date).
pub async fn migrate(url: &str) -> Result<Vec<String>, MigrateError> {
    mesh_plumbing::migrate(url, SCHEMA, embedded::migrations::runner()).await
}

/// Tunables of the config context.
#[derive(Debug, Clone)]
pub struct ConfigSettings {
    /// A node whose heartbeat says it is behind on its config section is sent the
    /// section again, at most once per this interval (hello always re-sends at
    /// once). Bounds the cost of a lost declaration. Default 30 s.
    pub resend_after: Duration,
}

impl Default for ConfigSettings {
    fn default() -> Self {
        ConfigSettings {
            resend_after: Duration::from_secs(30),
        }
    }
}

/// The config context, shared by the controller's router and its API.
pub struct Config {
    pool: PgPool,
    signal: OutboxSignal,
    settings: ConfigSettings,
    keyring: Keyring,
}

impl Config {
    /// `pool` must be connected as the config role; `signal` wakes the outbox
    /// relay after an API request wrote declarations; `keyring` is the
    /// secrets master keyring (one loaded from no file refuses secrets).
    pub fn new(
        pool: PgPool,
        signal: OutboxSignal,
        settings: ConfigSettings,
        keyring: Keyring,
    ) -> Self {
        Config {
            pool,
            signal,
            settings,
            keyring,
        }
    }

    /// The end of every API change, inside its transaction `tx`: reconcile
    /// every node; refuse the change (roll it back) when it would give a node
    /// a section its agent refuses (`field` names what made it too large);
    /// write the request's audit entry; commit; wake the relay if anything
    /// was declared.
    async fn commit_change(
        &self,
        mut tx: sqlx::Transaction<'static, sqlx::Postgres>,
        audit: &mesh_plumbing::audit::Audit,
        field: &str,
    ) -> Result<(), Error> {
        let report = reconcile::reconcile(&mut tx, reconcile::Scope::All, &self.keyring).await?;
        if let Some((node, reason)) = report.too_large.into_iter().next() {
            // Dropping tx rolls back: nothing is stored.
            return Err(Error::SectionTooLarge {
                field: field.to_owned(),
                node,
                reason,
            });
        }
        mesh_plumbing::audit::record_ok(&mut tx, SCHEMA, audit).await?;
        tx.commit().await?;
        if report.declared > 0 {
            self.signal.notify();
        }
        Ok(())
    }

    /// The master keyring (its key ids: never the keys).
    pub fn keyring(&self) -> &Keyring {
        &self.keyring
    }

    pub fn settings(&self) -> &ConfigSettings {
        &self.settings
    }

    /// The API routes this context serves: files (`/v1/files…`), settings
    /// (`/v1/settings…`, `/v1/modules/{name}/settings/effective`), secrets
    /// (`/v1/secrets…`) and grants (`/v1/modules/{name}/grants…`).
    /// Each route carries its OpenAPI description (decision 0019).
    pub fn routes(self: Arc<Self>) -> utoipa_axum::router::OpenApiRouter {
        let routes = api::routes()
            .merge(settings_api::routes())
            .merge(secrets_api::routes());
        tagged(routes, SCHEMA).with_state(self)
    }

    /// Reconcile every known node in one transaction and wake the relay if
    /// anything was declared: the periodic resync that bounds anything missed
    /// (the controller runs it every `resync_interval_secs`, through
    /// [`section::resync`]).
    pub async fn resync(&self) -> Result<ReconcileReport, Error> {
        section::resync(self).await
    }
}

impl SectionOwner for Config {
    const SECTIONS: Sections = SECTIONS;
    type Error = Error;

    fn outbox_signal(&self) -> &OutboxSignal {
        &self.signal
    }

    async fn desired(&self, tx: &mut PgConnection) -> Result<Vec<(NodeId, Items)>, Error> {
        reconcile::desired(tx, reconcile::Scope::All, &self.keyring).await
    }
}

impl Context for Config {
    const SCHEMA: &'static str = SCHEMA;

    fn pool(&self) -> &PgPool {
        &self.pool
    }

    fn subscriptions(&self) -> &'static [&'static str] {
        &[
            "inventory.node.*",
            "inventory.module.*",
            "provisioning.credentials.*",
        ]
    }

    async fn handle_reports(
        &self,
        tx: &mut PgConnection,
        reports: &[Envelope<Report>],
    ) -> Result<(), HandlerError> {
        reports::handle(tx, reports, &self.settings, &self.keyring)
            .await
            .map_err(HandlerError::from)
    }

    /// The node events of a batch in one upsert and one reconcile of the nodes
    /// they changed (a fleet joining sends hundreds per batch).
    async fn handle_events(
        &self,
        tx: &mut PgConnection,
        events: &[&RecordEvent],
    ) -> Result<(), HandlerError> {
        let mut bodies = Vec::with_capacity(events.len());
        let mut modules = Vec::new();
        let mut credentials = Vec::new();
        for event in events {
            match &event.kind {
                RecordKind::NodeJoined(body) | RecordKind::NodeUpdated(body) => bodies.push(body),
                RecordKind::ModulePlaced(p) => modules.push(mesh_protocol::ModuleEvent::Placed(p)),
                RecordKind::ModuleRemoved(r) => {
                    modules.push(mesh_protocol::ModuleEvent::Removed(r))
                }
                RecordKind::CredentialsIssued(_) | RecordKind::CredentialsWithdrawn(_) => {
                    credentials.push(&event.kind)
                }
                // Known events config does not act on (the protocol decoded
                // them: an unknown one never reaches a context).
                _ => {
                    tracing::debug!(key = %event.routing_key(), "not an event config acts on");
                }
            }
        }
        // Nodes first: a module placed on a node config learns of in the
        // same batch finds it.
        reports::nodes_changed(tx, &bodies, &self.keyring)
            .await
            .map_err(HandlerError::from)?;
        reports::modules_changed(tx, &modules, &self.keyring)
            .await
            .map_err(HandlerError::from)?;
        // Credentials last: a module placed in the same batch is known.
        for kind in credentials {
            match kind {
                RecordKind::CredentialsIssued(b) => provisioned::issued(tx, b, &self.keyring).await,
                RecordKind::CredentialsWithdrawn(b) => {
                    provisioned::withdrawn(tx, b, &self.keyring).await
                }
                _ => Ok(()),
            }
            .map_err(HandlerError::from)?;
        }
        Ok(())
    }
}
