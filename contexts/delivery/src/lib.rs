//! The delivery context: source to artifact to node, with an unforgeable
//! history of every attempt (issue 14, docs/decisions/0032).
//!
//! It owns the PostgreSQL schema `delivery` and nothing else: artifacts by
//! digest (pushed through the API, stored in the OCI registry by the
//! controller's [`ArtifactStore`] and signed there), immutable revisions of
//! each module's runnable definition, rollouts of one run per target node,
//! approvals, the freeze, and each run's append-only receipt log
//! ([`receipts`]). It learns where modules run from `inventory.module.*`,
//! replica health from `observability.module.health`, and what nodes hold
//! and run from their `applied` and `units` reports. It tells each node the
//! artifacts to hold (its `delivery` section, through the section
//! component) and tells inventory, through the record
//! (`delivery.module.targets`), which revision each node's replicas run;
//! inventory alone declares units. It never publishes, never speaks AMQP or
//! HTTP (the store is the controller's) and never reads another schema.

mod api;
mod error;
mod inputs;
pub mod keys;
pub mod receipts;
pub mod revisions;
pub mod rollouts;

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use mesh_plumbing::audit::{self, Audit};
use mesh_plumbing::openapi::tagged;
use mesh_plumbing::section::{self, Items, SectionOwner, Sections};
use mesh_plumbing::{Context, HandlerError, MigrateError, OutboxSignal};
use mesh_protocol::{
    ArtifactDigest, ArtifactItem, DeclarationItems, Envelope, NodeId, RecordEvent, Report, Section,
};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};
use tokio::sync::Notify;
use uuid::Uuid;

pub use error::Error;
pub use keys::{NewSignature, NewSigningKey, SigningKeyView};
pub use receipts::{Receipt, ReceiptError, ReceiptLog};
pub use revisions::{
    ArtifactStore, ArtifactView, BoxFuture, NewRevision, RevisionUnitSpec, RevisionView,
};
pub use rollouts::{
    FreezeRequest, FreezeView, RolloutRequest, RolloutView, RunFilter, RunView, Tick,
};

/// The most runs one page of `GET /v1/runs` holds.
pub const MAX_RUNS_PAGE: i64 = 500;

/// The schema (and record context name) this crate owns.
pub const SCHEMA: &str = "delivery";

/// The delivery section of each node, in `delivery.sections`.
pub const SECTIONS: Sections = Sections::new(SCHEMA, Section::Delivery);

#[allow(non_snake_case)]
mod embedded {
    refinery::embed_migrations!("../../migrations/delivery");
}

/// Apply the delivery migrations, connected as the delivery role (`url`).
pub async fn migrate(url: &str) -> Result<Vec<String>, MigrateError> {
    mesh_plumbing::migrate(url, SCHEMA, embedded::migrations::runner()).await
}

/// Tunables of the delivery context.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Largest artifact `POST /v1/artifacts` takes. Default 256 MiB.
    pub artifact_max_bytes: usize,
    /// A node whose heartbeat says it is behind on its delivery section is
    /// sent it again at most once per this interval. Default 30 s.
    pub resend_after: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            artifact_max_bytes: 256 * 1024 * 1024,
            resend_after: Duration::from_secs(30),
        }
    }
}

/// `GET|PUT /v1/modules/{name}/delivery`.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DeliveryPolicy {
    /// Rollouts of the module wait in `awaiting_approval` until an operator
    /// approves or denies them.
    pub require_approval: bool,
}

/// The delivery context, shared by the controller's router, its API and its
/// rollout clock.
pub struct Delivery {
    pool: PgPool,
    signal: OutboxSignal,
    settings: Settings,
    store: Arc<dyn ArtifactStore>,
    wake: Notify,
}

impl Delivery {
    pub fn new(
        pool: PgPool,
        signal: OutboxSignal,
        settings: Settings,
        store: Arc<dyn ArtifactStore>,
    ) -> Self {
        Delivery {
            pool,
            signal,
            settings,
            store,
            wake: Notify::new(),
        }
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// The API routes: artifacts, revisions, policies, rollouts, runs,
    /// receipts and the freeze, each with its OpenAPI description.
    pub fn routes(self: Arc<Self>) -> utoipa_axum::router::OpenApiRouter {
        let limit = self.settings.artifact_max_bytes;
        tagged(api::routes(limit), SCHEMA).with_state(self)
    }

    /// Resolves when something happened that may move a rollout (a commit of
    /// reports or events, an operator's change). The controller's rollout
    /// clock waits on it or on its interval.
    pub async fn woken(&self) {
        self.wake.notified().await;
    }

    fn wake(&self) {
        self.wake.notify_one();
    }

    /// Move every rollout on as far as the nodes' statements allow; declare
    /// the delivery sections and tell the record the targets that changed,
    /// in the same transaction.
    pub async fn tick(&self) -> Result<Tick, Error> {
        self.tick_at(Utc::now()).await
    }

    /// [`Delivery::tick`] as if the clock read `now` (tests of deadlines).
    pub async fn tick_at(&self, now: chrono::DateTime<Utc>) -> Result<Tick, Error> {
        let mut tx = self.pool.begin().await?;
        let tick = rollouts::tick(&mut tx, now).await?;
        let mut declared = 0;
        if tick.staged || !tick.modules.is_empty() {
            let desired = desired_sections(&mut tx, self.store.as_ref()).await?;
            declared = SECTIONS.declare(&mut tx, desired).await?.declared;
            rollouts::note_staged_generations(&mut tx).await?;
        }
        if !tick.modules.is_empty() {
            rollouts::publish_targets(&mut tx, &tick.modules).await?;
        }
        tx.commit().await?;
        if declared > 0 || !tick.modules.is_empty() {
            self.signal.notify();
        }
        if tick.moved > 0 {
            // A move may enable the next one (a slot freed): look again soon.
            self.wake();
        }
        Ok(tick)
    }

    /// Rollouts by state (for the controller's gauge).
    pub async fn rollout_counts(&self) -> Result<Vec<(String, i64)>, Error> {
        Ok(
            sqlx::query_as("SELECT state, count(*) FROM delivery.rollouts GROUP BY state")
                .fetch_all(&self.pool)
                .await?,
        )
    }

    /// Recompute every node's delivery section and declare what differs.
    pub async fn resync(&self) -> Result<section::Declared, Error> {
        section::resync(self).await
    }

    async fn commit(
        &self,
        mut tx: sqlx::Transaction<'_, sqlx::Postgres>,
        audit: &Audit,
    ) -> Result<(), Error> {
        audit::record_ok(&mut tx, SCHEMA, audit).await?;
        tx.commit().await?;
        self.signal.notify();
        self.wake();
        Ok(())
    }

    /// Store `bytes` in the registry by digest (with the controller's
    /// signature only in a fleet that trusts it), and record it:
    /// `(artifact, created)`.
    pub async fn push_artifact(
        &self,
        bytes: &[u8],
        audit: &Audit,
    ) -> Result<(ArtifactView, bool), Error> {
        if bytes.len() > self.settings.artifact_max_bytes {
            return Err(Error::TooLarge {
                limit: self.settings.artifact_max_bytes,
            });
        }
        if bytes.is_empty() {
            return Err(Error::invalid("body", "an artifact has at least one byte"));
        }
        let expected = ArtifactDigest::of(bytes);
        let (digest, key) = self.store.push(bytes).await.map_err(Error::Store)?;
        if digest != expected {
            return Err(Error::Store(format!(
                "the registry stored {digest}, the bytes are {expected}"
            )));
        }
        let mut tx = self.pool.begin().await?;
        let out = revisions::record_artifact(
            &mut tx,
            &digest,
            bytes.len(),
            key.as_deref(),
            &audit.principal().name,
        )
        .await?;
        self.commit(tx, audit).await?;
        Ok(out)
    }

    pub async fn artifacts(&self) -> Result<Vec<ArtifactView>, Error> {
        let mut tx = self.pool.begin().await?;
        revisions::list_artifacts(&mut tx).await
    }

    /// Keep an operator's signature of the artifact `digest` (pushed through
    /// the API) beside it in the registry, once it verifies against one of
    /// the mesh's signing keys: `(artifact, created)`.
    pub async fn add_signature(
        &self,
        digest: &ArtifactDigest,
        new: &NewSignature,
        audit: &Audit,
    ) -> Result<(ArtifactView, bool), Error> {
        let mut tx = self.pool.begin().await?;
        if revisions::artifact(&mut tx, digest).await?.is_none() {
            return Err(Error::NotFound(format!(
                "artifact {digest} (push it first: meshctl artifact push)"
            )));
        }
        let (signature, name) = keys::verify(&mut tx, digest, new).await?;
        let known: Option<String> = sqlx::query_scalar(
            "SELECT signature FROM delivery.artifact_signatures WHERE digest = $1 AND key = $2",
        )
        .bind(digest.as_str())
        .bind(&signature.key)
        .fetch_optional(&mut *tx)
        .await?;
        // The registry first: a signature it does not hold is never recorded.
        self.store
            .attach_signature(&signature)
            .await
            .map_err(Error::Store)?;
        keys::record_signature(&mut tx, &signature, &name, &audit.principal().name).await?;
        let view = revisions::artifact(&mut tx, digest)
            .await?
            .ok_or_else(|| Error::NotFound(format!("artifact {digest}")))?;
        self.commit(tx, audit).await?;
        Ok((view, known.as_deref() != Some(signature.signature.as_str())))
    }

    /// Add a signing key and declare it to every node that holds artifacts,
    /// in one transaction: `(key, created)`.
    pub async fn add_signing_key(
        &self,
        new: &NewSigningKey,
        audit: &Audit,
    ) -> Result<(SigningKeyView, bool), Error> {
        let mut tx = self.pool.begin().await?;
        rollouts::lock(&mut tx).await?;
        let out = keys::add(
            &mut tx,
            new,
            &self.store.controller_key(),
            &audit.principal().name,
        )
        .await?;
        self.redeclare(&mut tx).await?;
        self.commit(tx, audit).await?;
        Ok(out)
    }

    /// Remove a signing key: gone from the next delivery section of every
    /// node that holds artifacts, declared in the same transaction.
    pub async fn remove_signing_key(
        &self,
        name: &str,
        audit: &Audit,
    ) -> Result<SigningKeyView, Error> {
        let mut tx = self.pool.begin().await?;
        rollouts::lock(&mut tx).await?;
        let out = keys::remove(&mut tx, name).await?;
        self.redeclare(&mut tx).await?;
        self.commit(tx, audit).await?;
        Ok(out)
    }

    /// The mesh's signing keys, by name.
    pub async fn signing_keys(&self) -> Result<Vec<SigningKeyView>, Error> {
        let mut tx = self.pool.begin().await?;
        keys::list(&mut tx).await
    }

    /// The controller's public key when the fleet trusts its signatures.
    pub fn trusted_controller_key(&self) -> Option<String> {
        self.store
            .controller_trusted()
            .then(|| self.store.controller_key())
    }

    /// Declare the delivery sections again (the trusted keys changed).
    async fn redeclare(&self, tx: &mut PgConnection) -> Result<(), Error> {
        let desired = desired_sections(tx, self.store.as_ref()).await?;
        SECTIONS.declare(tx, desired).await?;
        rollouts::note_staged_generations(tx).await?;
        Ok(())
    }

    pub async fn create_revision(
        &self,
        module: &str,
        new: &NewRevision,
        audit: &Audit,
    ) -> Result<(RevisionView, bool), Error> {
        let mut tx = self.pool.begin().await?;
        let out = revisions::create(&mut tx, module, new, &audit.principal().name).await?;
        self.commit(tx, audit).await?;
        Ok(out)
    }

    pub async fn revisions(&self, module: &str) -> Result<Vec<RevisionView>, Error> {
        let mut tx = self.pool.begin().await?;
        revisions::list(&mut tx, module).await
    }

    pub async fn revision(&self, id: Uuid) -> Result<RevisionView, Error> {
        let mut tx = self.pool.begin().await?;
        revisions::get(&mut tx, id)
            .await?
            .ok_or_else(|| Error::NotFound(format!("revision {id}")))
    }

    pub async fn policy(&self, module: &str) -> Result<DeliveryPolicy, Error> {
        let require_approval: Option<bool> =
            sqlx::query_scalar("SELECT require_approval FROM delivery.policies WHERE module = $1")
                .bind(module)
                .fetch_optional(&self.pool)
                .await?;
        Ok(DeliveryPolicy {
            require_approval: require_approval.unwrap_or(false),
        })
    }

    pub async fn set_policy(
        &self,
        module: &str,
        policy: &DeliveryPolicy,
        audit: &Audit,
    ) -> Result<DeliveryPolicy, Error> {
        mesh_protocol::validate_module_name("name", module)?;
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "INSERT INTO delivery.policies (module, require_approval) VALUES ($1, $2) \
             ON CONFLICT (module) DO UPDATE SET require_approval = excluded.require_approval",
        )
        .bind(module)
        .bind(policy.require_approval)
        .execute(&mut *tx)
        .await?;
        self.commit(tx, audit).await?;
        Ok(policy.clone())
    }

    pub async fn start_rollout(
        &self,
        req: &RolloutRequest,
        audit: &Audit,
    ) -> Result<RolloutView, Error> {
        let mut tx = self.pool.begin().await?;
        let id = rollouts::create(&mut tx, req, &audit.principal().name, Utc::now()).await?;
        let view = rollouts::view(&mut tx, id).await?;
        self.commit(tx, audit).await?;
        Ok(view)
    }

    pub async fn rollout(&self, id: Uuid) -> Result<RolloutView, Error> {
        let mut tx = self.pool.begin().await?;
        rollouts::view(&mut tx, id).await
    }

    pub async fn rollouts(
        &self,
        module: Option<&str>,
        state: Option<&str>,
    ) -> Result<Vec<RolloutView>, Error> {
        let mut tx = self.pool.begin().await?;
        rollouts::list(&mut tx, module, state).await
    }

    pub async fn continue_rollout(&self, id: Uuid, audit: &Audit) -> Result<RolloutView, Error> {
        let mut tx = self.pool.begin().await?;
        rollouts::resume(&mut tx, id, &audit.principal().name, Utc::now()).await?;
        let view = rollouts::view(&mut tx, id).await?;
        self.commit(tx, audit).await?;
        Ok(view)
    }

    pub async fn cancel_rollout(&self, id: Uuid, audit: &Audit) -> Result<RolloutView, Error> {
        let mut tx = self.pool.begin().await?;
        rollouts::cancel(&mut tx, id, &audit.principal().name, Utc::now()).await?;
        let view = rollouts::view(&mut tx, id).await?;
        self.commit(tx, audit).await?;
        Ok(view)
    }

    /// Runs, newest first, at most `limit` (capped at 500), filtered.
    pub async fn runs(
        &self,
        filter: &rollouts::RunFilter<'_>,
        limit: i64,
    ) -> Result<Vec<RunView>, Error> {
        let mut tx = self.pool.begin().await?;
        rollouts::list_runs(&mut tx, filter, limit.clamp(1, MAX_RUNS_PAGE)).await
    }

    pub async fn run(&self, id: Uuid) -> Result<RunView, Error> {
        let mut tx = self.pool.begin().await?;
        rollouts::run(&mut tx, id).await
    }

    /// Approve or deny the rollout of `run`; `decided_by` is the operator's
    /// token identity from `audit`, never the request's body.
    pub async fn decide(
        &self,
        run: Uuid,
        approve: bool,
        reason: Option<&str>,
        audit: &Audit,
    ) -> Result<RunView, Error> {
        let mut tx = self.pool.begin().await?;
        rollouts::decide(
            &mut tx,
            run,
            approve,
            reason,
            &audit.principal().name,
            Utc::now(),
        )
        .await?;
        let view = rollouts::run(&mut tx, run).await?;
        self.commit(tx, audit).await?;
        Ok(view)
    }

    /// A run's receipts, validated as they are read.
    pub async fn receipts(&self, run: Uuid) -> Result<Vec<Receipt>, Error> {
        let mut tx = self.pool.begin().await?;
        let exists: Option<Uuid> = sqlx::query_scalar("SELECT id FROM delivery.runs WHERE id = $1")
            .bind(run)
            .fetch_optional(&mut *tx)
            .await?;
        if exists.is_none() {
            return Err(Error::NotFound(format!("run {run}")));
        }
        Ok(receipts::load(&mut tx, run).await?.entries().to_vec())
    }

    pub async fn freeze(&self) -> Result<FreezeView, Error> {
        let mut tx = self.pool.begin().await?;
        rollouts::freeze(&mut tx).await
    }

    pub async fn set_freeze(
        &self,
        req: &FreezeRequest,
        audit: &Audit,
    ) -> Result<FreezeView, Error> {
        let mut tx = self.pool.begin().await?;
        let view = rollouts::set_freeze(&mut tx, req, &audit.principal().name, Utc::now()).await?;
        self.commit(tx, audit).await?;
        Ok(view)
    }

    pub async fn lift_freeze(&self, audit: &Audit) -> Result<bool, Error> {
        let mut tx = self.pool.begin().await?;
        let lifted = rollouts::lift_freeze(&mut tx, Utc::now()).await?;
        self.commit(tx, audit).await?;
        Ok(lifted)
    }
}

/// Each node's delivery section: the artifacts it must hold and, when it
/// holds any, the keys whose signatures it trusts (decision 0048).
async fn desired_sections(
    tx: &mut PgConnection,
    store: &dyn ArtifactStore,
) -> Result<Vec<(NodeId, Items)>, Error> {
    let (registry, repository) = store.pull_location();
    let controller = store.controller_trusted().then(|| store.controller_key());
    let trusted = keys::declared(tx, controller.as_deref()).await?;
    let mut out = Vec::new();
    for (node, digests) in rollouts::desired_artifacts(tx).await? {
        let node = NodeId::parse(&node).map_err(|e| Error::Corrupt {
            what: "node id".to_owned(),
            reason: e.to_string(),
        })?;
        let artifact_keys = (!digests.is_empty()).then(|| trusted.clone());
        let items = DeclarationItems {
            artifact_keys,
            artifacts: digests
                .into_iter()
                .map(|digest| ArtifactItem {
                    digest,
                    registry: registry.clone(),
                    repository: repository.clone(),
                })
                .collect(),
            ..DeclarationItems::default()
        };
        out.push((node, Items::new(items)?));
    }
    Ok(out)
}

impl SectionOwner for Delivery {
    const SECTIONS: Sections = SECTIONS;
    type Error = Error;

    fn outbox_signal(&self) -> &OutboxSignal {
        &self.signal
    }

    async fn desired(&self, tx: &mut PgConnection) -> Result<Vec<(NodeId, Items)>, Error> {
        rollouts::lock(tx).await?;
        desired_sections(tx, self.store.as_ref()).await
    }
}

impl Context for Delivery {
    const SCHEMA: &'static str = SCHEMA;

    fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Where modules run and how healthy each replica is.
    fn subscriptions(&self) -> &'static [&'static str] {
        &["inventory.module.*", "observability.module.health"]
    }

    /// Hellos and heartbeats of the durable path (catch-up of the delivery
    /// section), units and applied reports (what runs, what was pulled).
    async fn handle_reports(
        &self,
        tx: &mut PgConnection,
        reports: &[Envelope<Report>],
    ) -> Result<(), HandlerError> {
        async {
            rollouts::lock(tx).await?;
            SECTIONS.on_hello(tx, reports).await?;
            SECTIONS
                .on_heartbeat(tx, reports, self.settings.resend_after)
                .await?;
            inputs::reports(tx, reports).await?;
            Ok::<_, Error>(())
        }
        .await
        .map_err(HandlerError::from)
    }

    async fn handle_events(
        &self,
        tx: &mut PgConnection,
        events: &[&RecordEvent],
    ) -> Result<(), HandlerError> {
        async {
            rollouts::lock(tx).await?;
            inputs::events(tx, events).await?;
            Ok::<_, Error>(())
        }
        .await
        .map_err(HandlerError::from)
    }

    fn committed(&self) {
        self.wake();
    }
}
