//! The connectivity context: who peers with whom on the overlay, which node
//! is reachable under which name, what may talk to what, and the mesh CA's
//! short-lived certificates; and the `connectivity` section of each node
//! that results (its WireGuard interface and peers, the names file
//! `/etc/mesh/hosts`, its nftables ruleset, its certificates).
//!
//! It owns the PostgreSQL schema `connectivity` and nothing else. It learns
//! of nodes from their hellos (the WireGuard public key and endpoint; the node
//! is the broker-verified sender, never a field of the body) and from the
//! record: labels from `inventory.node.joined` / `.updated` (the hub label),
//! revocation and re-enrolment from `identity.node.*`, where modules run and
//! their ports from `inventory.module.placed` / `.removed`. It learns of
//! certificates a node asks for and holds from its `certificates` reports. It
//! tells nodes their whole section through its outbox and the section
//! component; it never publishes, never speaks AMQP and never reads another
//! context's schema.
//!
//! Every change recomputes every node's section from the schema (the pure
//! [`plan`]) and the section component declares a new generation only to the
//! nodes whose items' digest changed. Writers are serialized by one advisory
//! lock taken first in each transaction (`reconcile::lock`).

mod api;
mod certs;
mod error;
pub mod plan;
mod query;
mod reconcile;
mod reports;

use std::sync::Arc;
use std::time::Duration;

use mesh_credentials::pki::MeshCa;
use mesh_plumbing::openapi::tagged;
use mesh_plumbing::section::{self, Items, SectionOwner, Sections};
use mesh_plumbing::{Context, HandlerError, MigrateError, OutboxSignal};
use mesh_protocol::{Envelope, NodeId, RecordEvent, RecordKind, Report, Section};
use sqlx::{PgConnection, PgPool};

use crate::reconcile::Scope;

pub use error::Error;
pub use mesh_plumbing::section::Declared as ReconcileReport;
pub use plan::{Cidr, HOSTS_PATH, HUB_LABEL, INTERFACE, PlanSettings, Policy, TABLE};
pub use query::{
    CertificateView, CertificatesView, ExposureView, HeldView, OverlayNodeView, OverlayView,
    RequestView,
};

/// The schema (and record context name) this crate owns.
pub const SCHEMA: &str = "connectivity";

/// The connectivity section of each node, in `connectivity.sections`.
pub const SECTIONS: Sections = Sections::new(SCHEMA, Section::Connectivity);

// refinery names a Rust migration's module after its file (`V2__sections`).
#[allow(non_snake_case)]
mod embedded {
    refinery::embed_migrations!("../../migrations/connectivity");
}

/// Apply the connectivity migrations, connected as the connectivity role
/// (`url`). Returns the migrations applied now (none when up to date).
pub async fn migrate(url: &str) -> Result<Vec<String>, MigrateError> {
    mesh_plumbing::migrate(url, SCHEMA, embedded::migrations::runner()).await
}

/// Tunables of the connectivity context.
#[derive(Clone)]
pub struct Settings {
    /// The overlay network, addresses, policy and names the plan is made of.
    pub plan: PlanSettings,
    /// Lifetime of every certificate the CA signs. Default 24 h.
    pub certificate_lifetime: Duration,
    /// The mesh CA; none: requests are recorded as waiting (`no CA
    /// configured`) and signed by the first resync that has one.
    pub ca: Option<Arc<MeshCa>>,
    /// A node whose heartbeat says it is behind on its connectivity section is
    /// sent it again at most once per this interval. Default 30 s.
    pub resend_after: Duration,
}

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settings")
            .field("plan", &self.plan)
            .field("certificate_lifetime", &self.certificate_lifetime)
            .field("ca", &self.ca.as_ref().map(|_| "[configured]"))
            .field("resend_after", &self.resend_after)
            .finish()
    }
}

/// Default overlay network.
pub const DEFAULT_CIDR: &str = "10.88.0.0/16";
/// Default WireGuard listen port.
pub const DEFAULT_PORT: u16 = 51820;
/// Default mesh domain.
pub const DEFAULT_DOMAIN: &str = "mesh.internal";
/// Default certificate lifetime.
pub const DEFAULT_CERTIFICATE_LIFETIME: Duration = Duration::from_secs(24 * 3600);

impl Default for Settings {
    fn default() -> Self {
        Settings {
            plan: PlanSettings {
                cidr: Cidr::parse("overlay_cidr", DEFAULT_CIDR)
                    .unwrap_or_else(|_| unreachable!("the default CIDR parses")),
                listen_port: DEFAULT_PORT,
                policy: Policy::Full,
                domain: DEFAULT_DOMAIN.to_owned(),
            },
            certificate_lifetime: DEFAULT_CERTIFICATE_LIFETIME,
            ca: None,
            resend_after: Duration::from_secs(30),
        }
    }
}

impl Settings {
    fn ca_pem(&self) -> Option<&str> {
        self.ca.as_deref().map(MeshCa::certificate_pem)
    }
}

/// The connectivity context, shared by the controller's router and its API.
pub struct Connectivity {
    pool: PgPool,
    signal: OutboxSignal,
    settings: Settings,
}

impl Connectivity {
    /// `pool` must be connected as the connectivity role; `signal` wakes the
    /// outbox relay after a resync declared something.
    pub fn new(pool: PgPool, signal: OutboxSignal, settings: Settings) -> Self {
        Connectivity {
            pool,
            signal,
            settings,
        }
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// The API routes this context serves: `GET /v1/overlay` and
    /// `GET /v1/certificates`, each with its OpenAPI description.
    pub fn routes(self: Arc<Self>) -> utoipa_axum::router::OpenApiRouter {
        tagged(api::routes(), SCHEMA).with_state(self)
    }

    /// Recompute every node's section and declare what differs (the
    /// controller's periodic resync; it also signs requests that waited for a
    /// CA and forgets certificates expired for more than a week).
    pub async fn resync(&self) -> Result<ReconcileReport, Error> {
        section::resync(self).await
    }

    /// The section stored for `node`, if any.
    pub async fn section(&self, node: &NodeId) -> Result<Option<section::Stored>, Error> {
        Ok(SECTIONS.stored(&self.pool, node).await?)
    }
}

impl SectionOwner for Connectivity {
    const SECTIONS: Sections = SECTIONS;
    type Error = Error;

    fn outbox_signal(&self) -> &OutboxSignal {
        &self.signal
    }

    async fn desired(&self, tx: &mut PgConnection) -> Result<Vec<(NodeId, Items)>, Error> {
        reconcile::lock(tx).await?;
        certs::waiting(tx, &self.settings).await?;
        query::prune(tx).await?;
        reconcile::desired(tx, &self.settings).await
    }
}

impl Context for Connectivity {
    const SCHEMA: &'static str = SCHEMA;

    fn pool(&self) -> &PgPool {
        &self.pool
    }

    fn subscriptions(&self) -> &'static [&'static str] {
        &["inventory.node.*", "inventory.module.*", "identity.node.*"]
    }

    /// Hellos (overlay facts; every node behind is caught up), heartbeats of
    /// the durable path (caught up at most once per `resend_after`) and
    /// certificates reports.
    async fn handle_reports(
        &self,
        tx: &mut PgConnection,
        reports: &[Envelope<Report>],
    ) -> Result<(), HandlerError> {
        self.reports(tx, reports).await.map_err(HandlerError::from)
    }

    /// The events of a batch in one upsert per kind and one reconcile.
    async fn handle_events(
        &self,
        tx: &mut PgConnection,
        events: &[&RecordEvent],
    ) -> Result<(), HandlerError> {
        self.events(tx, events).await.map_err(HandlerError::from)
    }
}

impl Connectivity {
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
        let mut scope = reports::hellos(tx, reports).await?;
        for env in reports {
            if let Report::Certificates(body) = &env.body {
                use tracing::Instrument as _;
                let span = tracing::info_span!("certificates", node = %env.node, id = %env.id);
                if certs::report(tx, &self.settings, &env.node, body)
                    .instrument(span)
                    .await?
                {
                    scope.add(Scope::Nodes([env.node.clone()].into()));
                }
            }
        }
        reconcile::reconcile(tx, &self.settings, &scope).await?;
        Ok(())
    }

    async fn events(&self, tx: &mut PgConnection, events: &[&RecordEvent]) -> Result<(), Error> {
        reconcile::lock(tx).await?;
        let mut labels = Vec::new();
        let mut modules = Vec::new();
        let mut changed = false;
        let mut scope = Scope::none();
        for event in events {
            match &event.kind {
                RecordKind::NodeJoined(body) | RecordKind::NodeUpdated(body) => labels.push(body),
                RecordKind::ModulePlaced(p) => modules.push(mesh_protocol::ModuleEvent::Placed(p)),
                RecordKind::ModuleRemoved(r) => {
                    modules.push(mesh_protocol::ModuleEvent::Removed(r))
                }
                // In delivery order: a revocation and a re-enrolment of one
                // node in one batch end as the later says.
                RecordKind::NodeRevoked(body) => {
                    changed |= reports::identity(tx, body, true).await?
                }
                // Re-admitted (decision 0050): back as an enrolment is; it
                // is on the overlay again once it states a key after it.
                RecordKind::NodeEnrolled(body) | RecordKind::NodeReadmitted(body) => {
                    changed |= reports::identity(tx, body, false).await?
                }
                _ => {
                    tracing::debug!(key = %event.routing_key(), "not an event connectivity acts on");
                }
            }
        }
        let hub_and_spoke = self.settings.plan.policy == Policy::HubAndSpoke;
        scope.add(reports::labels(tx, &labels, hub_and_spoke).await?);
        changed |= reports::modules(tx, &modules).await?;
        if changed {
            scope = Scope::All;
        }
        reconcile::reconcile(tx, &self.settings, &scope).await?;
        Ok(())
    }
}
