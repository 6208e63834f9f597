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
//!
//! Fleet lifecycle: inventory also owns modules (what to run), their intent layers,
//! assignments (which replica runs on which node), node liveness and drains, and
//! declares each node's `inventory` section (the units it must run). Liveness is
//! judged by [`Inventory::sweep`] only after the controller has observed reports
//! for a full grace period ([`Inventory::observe_from`]); placement is the pure
//! function in [`placement`]. What a reconcile finds wrong with the fleet it
//! tells the record (`inventory.fleet.conditions`, the whole set when it
//! changes); it keeps no alerts (observability owns them). Which revision a
//! node's replicas of a module run, delivery decides
//! (`delivery.module.targets`, see `targets.rs`); inventory still declares
//! every unit.

mod api;
mod conditions;
mod drains;
mod error;
mod fleet;
mod join;
mod liveness;
pub mod module;
mod modules_api;
mod nodes;
pub mod placement;
mod protocol;
mod query;
mod reports;
mod revocations;
mod scrape;
mod state;
mod sweep;
mod targets;
mod units;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};

use mesh_plumbing::openapi::tagged;
use mesh_plumbing::reads::Reads;
use mesh_plumbing::section::{Items, SectionOwner, Sections};
use mesh_plumbing::{Context, HandlerError, MigrateError, OutboxSignal};
use mesh_protocol::{Envelope, NodeId, RecordEvent, RecordKind, Report, Section};
use sqlx::{PgConnection, PgPool};

pub use error::Error;
pub use liveness::HeartbeatView;
pub use nodes::LabelTrust;
pub use query::{
    AppliedView, AssignmentView, LabelsView, ModuleView, NODE_STATES, NodeSummary, NodeView,
    ProtocolView,
};
pub use scrape::{ControllerTarget, TargetGroup};
pub use state::ReconcileReport;
pub use sweep::SweepReport;

/// The schema (and record context name) this crate owns.
pub const SCHEMA: &str = "inventory";

/// The inventory section (units) of each node, in `inventory.sections`.
pub const SECTIONS: Sections = Sections::new(SCHEMA, Section::Inventory);

// refinery names a Rust migration's module after its file (`V5__sections`).
#[allow(non_snake_case)]
mod embedded {
    refinery::embed_migrations!("../../migrations/inventory");
}

/// The inventory migrations, for a test that stops at a version
/// (`set_target`) to check what a later one keeps.
pub fn migrations() -> refinery::Runner {
    embedded::migrations::runner()
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
    /// A node not heard from for this long is judged unreachable (and heard from
    /// again, alive). Default 30 s: three heartbeat intervals of 10 s
    /// (docs/decisions/0006-liveness-grace.md says why).
    pub grace: Duration,
    /// Largest share of (non-revoked) nodes that may be unreachable at once before
    /// automatic re-placement pauses. Default 0.3.
    pub max_unreachable_share: f64,
    /// The node the controller runs on (placement `controller_node`). Default none.
    pub controller_node: Option<NodeId>,
    /// A node whose heartbeat says it is behind on its inventory section is sent
    /// the section again at most once per this interval (the section component's
    /// catch-up). Default 30 s.
    pub resend_after: Duration,
    /// The shortest heartbeat interval: what nodes beat at while the fleet fits
    /// the budget. `grace` is the grace at this interval. Default 10 s.
    pub heartbeat_floor: Duration,
    /// Heartbeats per second the whole fleet may cost; past it the interval
    /// and the grace stretch together. Default 1000 (10,000 nodes at 10 s).
    pub heartbeat_budget: f64,
    /// How often last_seen is written for the fleet from memory (and the
    /// longest the API's last_seen lags). Default 5 s.
    pub liveness_write: Duration,
    /// How often the sweeper runs (part of the detection time the API shows).
    /// Default 2 s.
    pub sweep_interval: Duration,
    /// The mesh's endpoints every node's inventory section carries (decision
    /// 0044): declared to a node when it joins, to the whole fleet at the
    /// first sweep after start (a controller in a new home tells every node
    /// at once), and kept by the periodic resync. Default none (no field).
    pub endpoints: Option<mesh_protocol::Endpoints>,
    /// Which keys of what a node states about itself select it (issue 29):
    /// default none, only operator labels (set through the API or bound to
    /// the node's join token) do.
    pub label_trust: LabelTrust,
    /// Where the controller serves its own metrics, as Prometheus reaches
    /// it: the first target group of `GET /v1/prometheus/targets`. Default
    /// none (the controller's own is not listed).
    pub controller_metrics: Option<ControllerTarget>,
}

impl Default for InventorySettings {
    fn default() -> Self {
        InventorySettings {
            max_page: 1000,
            grace: Duration::from_secs(30),
            max_unreachable_share: 0.3,
            controller_node: None,
            resend_after: Duration::from_secs(30),
            heartbeat_floor: Duration::from_secs(10),
            heartbeat_budget: 1000.0,
            liveness_write: Duration::from_secs(5),
            sweep_interval: Duration::from_secs(2),
            endpoints: None,
            label_trust: LabelTrust::default(),
            controller_metrics: None,
        }
    }
}

/// The inventory context, shared by the controller's report router and its API.
pub struct Inventory {
    pool: PgPool,
    /// The reads that tolerate lag (`GET /v1/nodes`): the replica when the
    /// controller gave one and it is usable, else `pool` (decision 0041).
    reads: Reads,
    signal: OutboxSignal,
    settings: InventorySettings,
    /// Since when the controller has been consuming reports without a break
    /// (none: it is not). Liveness is judged only after a full grace of it.
    observing_since: Mutex<Option<DateTime<Utc>>>,
    /// Last heard times not yet written, and the fleet's heartbeat interval.
    liveness: liveness::Liveness,
    /// Whether a sweep since start has declared the whole fleet's sections
    /// with the settings' endpoints.
    endpoints_told: std::sync::atomic::AtomicBool,
    /// The revoked nodes, in memory (decision 0050).
    revocations: revocations::Revocations,
}

impl Inventory {
    /// `pool` must be connected as the inventory role; `signal` wakes the outbox
    /// relay after an API request wrote an event.
    pub fn new(pool: PgPool, signal: OutboxSignal, settings: InventorySettings) -> Self {
        Inventory {
            reads: Reads::new(pool.clone()),
            pool,
            signal,
            liveness: liveness::Liveness::new(settings.heartbeat_floor),
            settings,
            observing_since: Mutex::new(None),
            endpoints_told: std::sync::atomic::AtomicBool::new(false),
            revocations: Default::default(),
        }
    }

    /// Load the revoked nodes into memory (at start, before reports are
    /// consumed). Returns how many are revoked.
    pub async fn load_revocations(&self) -> Result<usize, Error> {
        self.revocations.load(&self.pool).await
    }

    /// The nodes revoked now, as identity last said on the record (decision
    /// 0050): their reports are refused, never recorded. One shared set, read
    /// once per batch: no database read per report.
    pub fn revoked_nodes(&self) -> Arc<std::collections::HashSet<NodeId>> {
        self.revocations.snapshot()
    }

    /// The controller started consuming reports at `at` (its broker session is up).
    /// Until a full grace has passed since, no node is judged.
    pub fn observe_from(&self, at: DateTime<Utc>) {
        *self
            .observing_since
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(at);
    }

    /// The controller stopped consuming reports (its broker session ended): what
    /// it last heard says nothing about the nodes until it observes again.
    pub fn observe_stop(&self) {
        *self
            .observing_since
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// Why liveness cannot be judged at `now` (none: it can).
    pub fn not_observed(&self, now: DateTime<Utc>) -> Option<String> {
        let since = *self
            .observing_since
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let grace = self.grace();
        let grace_secs = grace.as_secs();
        let grace = chrono::Duration::from_std(grace).unwrap_or(chrono::Duration::MAX);
        match since {
            None => Some(
                "the controller is not receiving reports (broker session down or starting)".into(),
            ),
            Some(since) if now.signed_duration_since(since) < grace => Some(format!(
                "the controller has observed reports only since {since}, less than the grace ({grace_secs} s)"
            )),
            Some(_) => None,
        }
    }

    pub fn settings(&self) -> &InventorySettings {
        &self.settings
    }

    /// Serve the reads that tolerate lag through `reads` (its primary must be
    /// this context's pool; the controller adds the replica).
    pub fn with_reads(mut self, reads: Reads) -> Self {
        self.reads = reads;
        self
    }

    /// The reads that tolerate lag, and where they go.
    pub fn reads(&self) -> &Reads {
        &self.reads
    }

    /// The API routes this context serves: `GET /v1/nodes`,
    /// `GET|PUT /v1/nodes/{id}/labels`, `POST /v1/nodes/{id}/drain|undrain`,
    /// `GET /v1/modules`, `GET|PUT|DELETE /v1/modules/{name}`,
    /// `GET|PUT|DELETE /v1/modules/{name}/intent/{layer}`,
    /// `GET /v1/prometheus/targets`.
    /// Each route carries its OpenAPI description (decision 0019).
    pub fn routes(self: Arc<Self>) -> utoipa_axum::router::OpenApiRouter {
        tagged(
            api::routes()
                .merge(modules_api::routes())
                .merge(scrape::routes()),
            SCHEMA,
        )
        .with_state(self)
    }
}

/// The inventory section: the fleet reconcile declares what it changed; the
/// periodic resync compares every node's units, as assigned now, with what is
/// stored.
impl SectionOwner for Inventory {
    const SECTIONS: Sections = SECTIONS;
    type Error = Error;

    fn outbox_signal(&self) -> &OutboxSignal {
        &self.signal
    }

    async fn desired(&self, tx: &mut PgConnection) -> Result<Vec<(NodeId, Items)>, Error> {
        fleet::desired_sections(tx, &self.carried()).await
    }
}

impl Context for Inventory {
    const SCHEMA: &'static str = SCHEMA;

    fn pool(&self) -> &PgPool {
        &self.pool
    }

    fn committed(&self) {
        self.revocations.committed();
    }

    async fn handle_reports(
        &self,
        tx: &mut PgConnection,
        reports: &[Envelope<Report>],
    ) -> Result<(), HandlerError> {
        reports::handle(tx, reports, &self.settings, &self.carried())
            .await
            .map_err(HandlerError::from)
    }

    /// Identity's word on a node: revoked nodes are never scheduled again (the
    /// next sweep moves their stateless assignments) and their reports are
    /// refused (decision 0050); re-admission and re-enrolment make them
    /// schedulable again. Observability's word on a module's health, shown
    /// in the module view. Delivery's word on which revision each node's
    /// replicas of a module run: the sections of the nodes it changes are
    /// declared in the event's transaction (the router wakes the relay after
    /// the commit).
    fn subscriptions(&self) -> &'static [&'static str] {
        &[
            "identity.node.*",
            "observability.module.health",
            "delivery.module.targets",
        ]
    }

    async fn handle_event(
        &self,
        tx: &mut PgConnection,
        event: &RecordEvent,
    ) -> Result<(), HandlerError> {
        let (body, revoked) = match &event.kind {
            RecordKind::NodeRevoked(body) => (body, true),
            RecordKind::NodeEnrolled(body) | RecordKind::NodeReadmitted(body) => (body, false),
            RecordKind::ModuleHealth(body) => {
                return query::record_module_health(tx, body)
                    .await
                    .map_err(HandlerError::from);
            }
            RecordKind::ModuleTargets(body) => {
                let declared = fleet::retarget(tx, body, &self.carried()).await?;
                tracing::debug!(module = %body.module, version = body.version, declared, "module targets");
                return Ok(());
            }
            _ => {
                tracing::debug!(key = %event.routing_key(), "not an event inventory acts on");
                return Ok(());
            }
        };
        self.revocations
            .record(tx, &body.node, revoked, body.at)
            .await?;
        if let (false, Some(labels)) = (revoked, &body.labels) {
            nodes::enrolled_labels(tx, body, labels, &self.settings.label_trust).await?;
        }
        // Only the newest identity change counts; a node inventory has not heard
        // from yet gets its state when it says hello (and cannot, once revoked).
        let sql = if revoked {
            "UPDATE inventory.nodes SET admin_state = 'revoked', drain_blocked = NULL, identity_at = $2 \
             WHERE id = $1 AND (identity_at IS NULL OR identity_at < $2)"
        } else {
            "UPDATE inventory.nodes SET admin_state = CASE WHEN admin_state = 'revoked' THEN 'active' ELSE admin_state END, \
             identity_at = $2 WHERE id = $1 AND (identity_at IS NULL OR identity_at < $2)"
        };
        sqlx::query(sql)
            .bind(body.node.as_str())
            .bind(body.at)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }
}
