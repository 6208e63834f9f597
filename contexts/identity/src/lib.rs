//! The identity context: who may do what. Node identities (the Ed25519 public key
//! each node enrolled with), single-use expiring join tokens, operators' API
//! tokens with their roles, the OIDC trusts that give automation short-lived
//! tokens for its ID tokens, and the append-only audit log of every operator
//! action.
//!
//! It owns the PostgreSQL schema `identity` and nothing else. Tokens are stored
//! only as SHA-256 hashes; a token is shown once, in the response that created it.
//! It creates and deletes node broker users through [`BrokerAccounts`], a trait
//! the controller implements (with the RabbitMQ management API): this crate never
//! speaks AMQP nor HTTP to the broker, and never reads another context's schema.
//! It learns of operator actions from `*.operator.audit` record events and tells
//! others of enrolments, revocations and re-admissions with
//! `identity.node.enrolled` / `identity.node.revoked` /
//! `identity.node.readmitted`, written to its outbox in the same transaction.

mod api;
mod audit;
mod error;
mod nodes;
mod tokens;
mod trust;
mod trust_api;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use mesh_plumbing::openapi::tagged;
use mesh_plumbing::reads::Reads;
use mesh_plumbing::{Context, HandlerError, MigrateError, OutboxSignal};
use mesh_protocol::{Envelope, NodeId, RecordEvent, RecordKind, Report};
use sqlx::{PgConnection, PgPool};

pub use audit::{AuditFilter, AuditPage, AuditRow};
pub use error::Error;
pub use mesh_plumbing::api::{Principal, Role};
pub use nodes::{
    Enrolled, JoinRequest, NewJoinToken, NodeIdentity, Readmitted, Revoked, revoked_refusal,
};
pub use tokens::{Authenticated, NewToken, TokenView};
pub use trust::{
    EXCHANGED_MAX_TTL, Exchanged, HttpFetch, NoFetch, TrustSpec, TrustView, subject_matches,
};

/// The schema (and record context name) this crate owns.
pub const SCHEMA: &str = "identity";

#[allow(non_snake_case)]
mod embedded {
    refinery::embed_migrations!("../../migrations/identity");
}

/// The identity migrations, for a test that stops at a version
/// (`set_target`) to check what a later one keeps.
pub fn migrations() -> refinery::Runner {
    embedded::migrations::runner()
}

/// Apply the identity migrations, connected as the identity role (`url`).
pub async fn migrate(url: &str) -> Result<Vec<String>, MigrateError> {
    mesh_plumbing::migrate(url, SCHEMA, embedded::migrations::runner()).await
}

/// A failure of the broker's account management, in words (no secret in it).
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct BrokerError(pub String);

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The broker accounts of nodes, as identity needs them. The controller
/// implements it with the broker's management API; identity never knows how.
pub trait BrokerAccounts: Send + Sync + 'static {
    /// Create (or replace) the node's broker user with `password` and exactly
    /// the rights of docs/protocol.md's permission table.
    fn create_node_user<'a>(
        &'a self,
        node: &'a NodeId,
        password: &'a str,
    ) -> BoxFuture<'a, Result<(), BrokerError>>;
    /// Delete the node's broker user; Ok(false) when there was none.
    fn delete_node_user<'a>(&'a self, node: &'a NodeId)
    -> BoxFuture<'a, Result<bool, BrokerError>>;
    /// Close every broker connection of the node; returns how many.
    fn close_connections<'a>(
        &'a self,
        node: &'a NodeId,
    ) -> BoxFuture<'a, Result<usize, BrokerError>>;
    /// The URL the node's agent connects with (user = node, its password).
    fn node_broker_url(&self, node: &NodeId, password: &str) -> String;
}

/// Tunables of the identity context.
#[derive(Debug, Clone)]
pub struct IdentitySettings {
    /// How long a join token is valid when its creator does not say. Default 1 h.
    pub join_token_ttl: Duration,
    /// Longest validity a join token may be given. Default 7 days.
    pub join_token_max_ttl: Duration,
    /// How long an API token lives when its creator does not say (also the
    /// bootstrap admin token's lifetime). Default 90 days.
    pub api_token_ttl: Duration,
    /// Longest lifetime an API token may be given. Default 366 days.
    pub api_token_max_ttl: Duration,
    /// The controller's declaration-signing public key (hex), handed to every
    /// node at enrolment.
    pub controller_key: String,
    /// Largest page `GET /v1/audit` and `GET /v1/tokens` return. Default 1000.
    pub max_page: i64,
    /// The API's advertised `https://` URL: handed to a node at its join and
    /// named in the join command a join token's answer carries. Default none
    /// (a loopback-only mesh).
    pub api_url: Option<String>,
    /// The mesh CA's certificate (PEM), handed to a node at its join (the node
    /// keeps the one its pinned handshake proved; this copy must match it).
    pub ca_certificate: Option<String>,
    /// The mesh CA's pin, `sha256:<hex>` of its public key: what a join
    /// command carries (`--ca-hash`).
    pub ca_pin: Option<String>,
}

impl IdentitySettings {
    pub fn new(controller_key: String) -> Self {
        IdentitySettings {
            join_token_ttl: Duration::from_secs(3600),
            join_token_max_ttl: Duration::from_secs(7 * 24 * 3600),
            api_token_ttl: Duration::from_secs(90 * 24 * 3600),
            api_token_max_ttl: Duration::from_secs(366 * 24 * 3600),
            controller_key,
            max_page: 1000,
            api_url: None,
            ca_certificate: None,
            ca_pin: None,
        }
    }
}

/// The identity context, shared by the controller's router, auth layer and API.
pub struct Identity {
    pool: PgPool,
    /// The reads that tolerate lag (`GET /v1/audit`): the replica when the
    /// controller gave one and it is usable, else `pool` (decision 0041).
    reads: Reads,
    signal: OutboxSignal,
    settings: IdentitySettings,
    accounts: Arc<dyn BrokerAccounts>,
    /// Fetches OIDC issuers' discovery documents and keys (the controller's
    /// client; [`NoFetch`] until it gives one).
    issuer_fetch: Arc<dyn HttpFetch>,
    /// Issuers' keys as last fetched.
    issuer_keys: trust::KeyCache,
}

impl Identity {
    /// `pool` must be connected as the identity role.
    pub fn new(
        pool: PgPool,
        signal: OutboxSignal,
        settings: IdentitySettings,
        accounts: Arc<dyn BrokerAccounts>,
    ) -> Self {
        Identity {
            reads: Reads::new(pool.clone()),
            pool,
            signal,
            settings,
            accounts,
            issuer_fetch: Arc::new(NoFetch),
            issuer_keys: Default::default(),
        }
    }

    /// Fetch OIDC issuers' documents through `fetch` (the controller's HTTP
    /// client) for `POST /v1/tokens/exchange`.
    pub fn with_issuer_fetch(mut self, fetch: Arc<dyn HttpFetch>) -> Self {
        self.issuer_fetch = fetch;
        self
    }

    pub fn settings(&self) -> &IdentitySettings {
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

    /// The API routes this context serves: `POST /v1/join`,
    /// `POST /v1/nodes/{id}/join-tokens`, `DELETE /v1/nodes/{id}`,
    /// `POST /v1/nodes/{id}/readmit`,
    /// `POST|GET /v1/tokens`, `DELETE /v1/tokens/{id}`, `POST /v1/tokens/{id}/rotate`,
    /// `POST /v1/tokens/exchange`, `GET|PUT|DELETE /v1/trust/{name}`, `GET /v1/trust`,
    /// `GET /v1/audit`.
    /// Authentication is the controller's (it puts a
    /// [`mesh_plumbing::audit::Audit`] naming the [`Principal`] in the request's
    /// extensions); `POST /v1/join` is authenticated by its join token.
    /// Each route carries its OpenAPI description (decision 0019).
    pub fn routes(self: Arc<Self>) -> utoipa_axum::router::OpenApiRouter {
        tagged(api::routes().merge(trust_api::routes()), SCHEMA).with_state(self)
    }
}

impl Context for Identity {
    const SCHEMA: &'static str = SCHEMA;

    fn pool(&self) -> &PgPool {
        &self.pool
    }

    fn subscriptions(&self) -> &'static [&'static str] {
        &["*.operator.audit"]
    }

    /// Identity handles no report: a node's identity comes from the broker, not
    /// from what it says.
    async fn handle_reports(
        &self,
        _tx: &mut PgConnection,
        _reports: &[Envelope<Report>],
    ) -> Result<(), HandlerError> {
        Ok(())
    }

    async fn handle_event(
        &self,
        tx: &mut PgConnection,
        event: &RecordEvent,
    ) -> Result<(), HandlerError> {
        match &event.kind {
            RecordKind::OperatorAudit { entry, .. } => audit::append(tx, event, entry)
                .await
                .map_err(HandlerError::from),
            _ => {
                tracing::debug!(key = %event.routing_key(), "not an event identity acts on");
                Ok(())
            }
        }
    }
}
