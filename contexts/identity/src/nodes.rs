//! Node enrolment and revocation: join tokens, the join itself (a node trades a
//! join token and its public key for its broker account), revocation, and
//! re-admission. Revocation is final until an admin re-admits the node
//! (decision 0050): a revoked node gets no join token and cannot join.

use std::time::Duration;

use chrono::{DateTime, Utc};
use mesh_plumbing::audit::{self, Audit};
use mesh_plumbing::outbox;
use mesh_protocol::{
    Labels, NodeId, NodeIdentityChanged, PublicKey, RESERVED_LABEL_PREFIX, RecordEvent, RecordKind,
    Secret, new_token, token_sha256_hex, validate_labels,
};
use serde::{Deserialize, Serialize};

use crate::{Error, Identity, SCHEMA};

/// Prefix of every join token.
pub const JOIN_TOKEN_PREFIX: &str = "mesh_jt_";

/// A join token just created: the only time its secret is seen.
#[derive(Debug, Clone)]
pub struct NewJoinToken {
    pub node: NodeId,
    pub token: Secret<String>,
    pub expires_at: DateTime<Utc>,
}

/// What a node sends to join (`POST /v1/join`).
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct JoinRequest {
    /// The join token an operator created for this node.
    #[schema(value_type = String)]
    pub token: Secret<String>,
    /// The node's id.
    pub node: String,
    /// The node's Ed25519 public key, 64 hex digits. Its private key never
    /// leaves the node.
    pub public_key: String,
}

/// What a node receives when it joined: how to reach the broker (its own user
/// and password, at the advertised AMQPS endpoint), the key every declaration
/// to it is signed with, the API's URL and the mesh CA.
#[derive(Debug, Clone)]
pub struct Enrolled {
    pub node: NodeId,
    pub broker_url: Secret<String>,
    pub controller_key: String,
    pub api_url: Option<String>,
    pub ca_certificate: Option<String>,
}

/// A node identity as listed (no secret in it).
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct NodeIdentity {
    pub name: String,
    /// None for a node added by `mesh-bundle node-add` and then revoked: it
    /// never enrolled a key through identity.
    pub public_key: Option<String>,
    pub enrolled_at: DateTime<Utc>,
    pub enrolled_by: String,
    pub revoked_at: Option<DateTime<Utc>>,
}

/// The result of a revocation.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Revoked {
    pub node: String,
    pub revoked_at: DateTime<Utc>,
    /// Whether this call deleted the node's broker user: false when it had
    /// none, or when an earlier, interrupted revocation (answered 503) already
    /// deleted it. Either way the user is gone once this is returned.
    pub broker_user_deleted: bool,
    pub connections_closed: usize,
}

/// The result of a re-admission.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Readmitted {
    pub node: String,
    /// When it had been revoked.
    pub revoked_at: DateTime<Utc>,
    pub readmitted_at: DateTime<Utc>,
    /// The admin (token name) who re-admitted it.
    pub readmitted_by: String,
    /// What to do next: the node has no broker user until it is given
    /// credentials again.
    pub next: String,
}

/// Why a revoked node gets nothing, naming the command that re-admits it.
pub fn revoked_refusal(node: &NodeId, revoked_at: DateTime<Utc>) -> String {
    format!(
        "node `{node}` was revoked at {revoked_at}: it gets no credentials until an admin re-admits it with `meshctl node readmit {node}`"
    )
}

/// A join token's row: node, expires_at, used_at, created_by, expired now,
/// the labels bound to it.
type JoinTokenRow = (
    String,
    DateTime<Utc>,
    Option<DateTime<Utc>>,
    String,
    bool,
    sqlx::types::Json<Labels>,
);

fn ttl_secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

impl Identity {
    /// A single-use join token for `node`, valid for `ttl` (default and maximum
    /// from the settings), created by the request's principal, with its audit
    /// entry in the same transaction. `labels` are bound to it: the node that
    /// enrols with it gets them as its operator labels (inventory), whatever
    /// it says of itself. Keys under `mesh.io/` are reserved and refused.
    pub async fn create_join_token(
        &self,
        node: &NodeId,
        ttl: Option<Duration>,
        labels: &Labels,
        audit: &Audit,
    ) -> Result<NewJoinToken, Error> {
        validate_labels("labels", labels).map_err(|e| match e {
            mesh_protocol::DecodeError::Invalid { field, reason } => Error::invalid(field, reason),
            other => Error::invalid("labels", other.to_string()),
        })?;
        if let Some(key) = labels.keys().find(|k| k.starts_with(RESERVED_LABEL_PREFIX)) {
            return Err(Error::invalid(
                format!("labels.{key}"),
                format!(
                    "keys under `{RESERVED_LABEL_PREFIX}` are reserved for what the controller verifies itself"
                ),
            ));
        }
        let by = audit.principal().name.as_str();
        let ttl = ttl.unwrap_or(self.settings.join_token_ttl);
        if ttl.is_zero() || ttl > self.settings.join_token_max_ttl {
            return Err(Error::invalid(
                "ttl_secs",
                format!(
                    "must be between 1 and {} seconds",
                    self.settings.join_token_max_ttl.as_secs()
                ),
            ));
        }
        let token = new_token(JOIN_TOKEN_PREFIX, rand::random());
        let mut tx = self.pool.begin().await?;
        // FOR SHARE: a revocation (which locks the row for update) cannot
        // slip between this check and the commit.
        let revoked: Option<Option<DateTime<Utc>>> =
            sqlx::query_scalar("SELECT revoked_at FROM identity.nodes WHERE name = $1 FOR SHARE")
                .bind(node.as_str())
                .fetch_optional(&mut *tx)
                .await?;
        if let Some(Some(at)) = revoked {
            tracing::warn!(%node, by, "join token refused: the node is revoked");
            return Err(Error::Conflict(revoked_refusal(node, at)));
        }
        let expires_at: DateTime<Utc> = sqlx::query_scalar(
            "INSERT INTO identity.join_tokens (token_sha256, node, created_by, expires_at, labels) \
             VALUES ($1, $2, $3, now() + make_interval(secs => $4), $5) RETURNING expires_at",
        )
        .bind(token_sha256_hex(&token))
        .bind(node.as_str())
        .bind(by)
        .bind(ttl_secs(ttl))
        .bind(sqlx::types::Json(labels))
        .fetch_one(&mut *tx)
        .await?;
        audit::record_ok(&mut tx, SCHEMA, audit).await?;
        tx.commit().await?;
        tracing::info!(%node, by, %expires_at, "join token created");
        Ok(NewJoinToken {
            node: node.clone(),
            token: Secret::new(token),
            expires_at,
        })
    }

    /// Enrol a node: check its join token (known, unused, unexpired, for this
    /// node), record its identity, consume the token, create its broker user, and
    /// only then commit. Any refusal or failure changes nothing.
    pub async fn join(&self, req: &JoinRequest) -> Result<Enrolled, Error> {
        let node = NodeId::parse(&req.node).map_err(|e| Error::invalid("node", e.to_string()))?;
        let key = PublicKey::from_hex(&req.public_key)
            .map_err(|e| Error::invalid("public_key", e.to_string()))?;
        let mut tx = self.pool.begin().await?;
        let row: Option<JoinTokenRow> = sqlx::query_as(
            "SELECT node, expires_at, used_at, created_by, expires_at <= now(), labels \
                 FROM identity.join_tokens WHERE token_sha256 = $1 FOR UPDATE",
        )
        .bind(token_sha256_hex(req.token.expose()))
        .fetch_optional(&mut *tx)
        .await?;
        let Some((token_node, expires_at, used_at, created_by, expired, labels)) = row else {
            tracing::warn!(%node, "join refused: unknown token");
            return Err(Error::UnknownJoinToken);
        };
        let refuse = |why: String| {
            tracing::warn!(%node, reason = %why, "join refused");
            Err(Error::JoinRefused(why))
        };
        let previous: Option<Option<DateTime<Utc>>> =
            sqlx::query_scalar("SELECT revoked_at FROM identity.nodes WHERE name = $1 FOR UPDATE")
                .bind(node.as_str())
                .fetch_optional(&mut *tx)
                .await?;
        if let Some(Some(at)) = previous {
            // A token of a revoked node was voided by the revocation; this
            // says why, rather than that it was used.
            tracing::warn!(%node, "join refused: the node is revoked");
            return Err(Error::Conflict(revoked_refusal(&node, at)));
        }
        if let Some(at) = used_at {
            return refuse(format!("the join token was already used (at {at})"));
        }
        if expired {
            return refuse(format!("the join token expired at {expires_at}"));
        }
        if token_node != node.as_str() {
            return refuse(format!("the join token is for another node, not `{node}`"));
        }
        sqlx::query("UPDATE identity.join_tokens SET used_at = now() WHERE token_sha256 = $1")
            .bind(token_sha256_hex(req.token.expose()))
            .execute(&mut *tx)
            .await?;
        sqlx::query(
            "INSERT INTO identity.nodes (name, public_key, enrolled_by) VALUES ($1, $2, $3) \
             ON CONFLICT (name) DO UPDATE SET public_key = EXCLUDED.public_key, \
             enrolled_at = now(), enrolled_by = EXCLUDED.enrolled_by, revoked_at = NULL",
        )
        .bind(node.as_str())
        .bind(key.to_hex())
        .bind(&created_by)
        .execute(&mut *tx)
        .await?;
        let event = RecordEvent::new(RecordKind::NodeEnrolled(NodeIdentityChanged {
            node: node.clone(),
            public_key: Some(key.to_hex()),
            at: Utc::now(),
            labels: (!labels.0.is_empty()).then_some(labels.0),
        }));
        outbox::record(&mut tx, SCHEMA, &event).await?;
        // The broker last: if it fails, the transaction rolls back and the token
        // stays unused.
        let password = hex::encode(rand::random::<[u8; 32]>());
        if matches!(previous, Some(None)) {
            // Re-enrolment of an enrolled node (a new key): its old session ends.
            self.accounts.close_connections(&node).await?;
        }
        self.accounts.create_node_user(&node, &password).await?;
        tx.commit().await?;
        self.signal.notify();
        tracing::info!(%node, enrolled_by = %created_by, "node enrolled");
        Ok(Enrolled {
            broker_url: Secret::new(self.accounts.node_broker_url(&node, &password)),
            node,
            controller_key: self.settings.controller_key.clone(),
            api_url: self.settings.api_url.clone(),
            ca_certificate: self.settings.ca_certificate.clone(),
        })
    }

    /// Revoke a node: delete its broker user, close its connections, mark it
    /// revoked, void its unused join tokens, and tell the record, with the
    /// request's audit entry in the same transaction. A node that was never
    /// enrolled through identity (bundle node-add) but has a broker user is
    /// revoked too, and recorded (without a key) so that it stays revoked.
    /// It stays revoked until [`Identity::readmit_node`].
    pub async fn revoke_node(&self, node: &NodeId, audit: &Audit) -> Result<Revoked, Error> {
        let mut tx = self.pool.begin().await?;
        let marked: Option<DateTime<Utc>> = sqlx::query_scalar(
            "UPDATE identity.nodes SET revoked_at = COALESCE(revoked_at, now()) WHERE name = $1 \
             RETURNING revoked_at",
        )
        .bind(node.as_str())
        .fetch_optional(&mut *tx)
        .await?;
        sqlx::query(
            "UPDATE identity.join_tokens SET used_at = now() WHERE node = $1 AND used_at IS NULL",
        )
        .bind(node.as_str())
        .execute(&mut *tx)
        .await?;
        // Delete first (no new connection can authenticate), then close what is open.
        let deleted = self.accounts.delete_node_user(node).await?;
        let closed = self.accounts.close_connections(node).await?;
        let revoked_at =
            match marked {
                Some(at) => at,
                None if deleted => sqlx::query_scalar(
                    "INSERT INTO identity.nodes AS n (name, public_key, enrolled_by, revoked_at) \
                     VALUES ($1, NULL, 'mesh-bundle node-add', now()) \
                     ON CONFLICT (name) DO UPDATE SET revoked_at = COALESCE(n.revoked_at, now()) \
                     RETURNING revoked_at",
                )
                .bind(node.as_str())
                .fetch_one(&mut *tx)
                .await?,
                None => return Err(Error::NotFound(format!("no node `{node}` is enrolled"))),
            };
        let event = RecordEvent::new(RecordKind::NodeRevoked(NodeIdentityChanged {
            node: node.clone(),
            public_key: None,
            at: revoked_at,
            labels: None,
        }));
        outbox::record(&mut tx, SCHEMA, &event).await?;
        audit::record_ok(&mut tx, SCHEMA, audit).await?;
        tx.commit().await?;
        self.signal.notify();
        tracing::info!(%node, deleted, closed, "node revoked");
        Ok(Revoked {
            node: node.to_string(),
            revoked_at,
            broker_user_deleted: deleted,
            connections_closed: closed,
        })
    }

    /// Re-admit a revoked node: it may be given credentials again (a join
    /// token, `mesh-bundle node-add`) and its reports count again. Clears the
    /// revocation, keeps who re-admitted it and when, tells the record
    /// (`identity.node.readmitted`), with the request's audit entry, all in
    /// one transaction. It creates no broker user: the node has none until
    /// it joins (or is added) again. 404 for a node identity never knew,
    /// 409 for one that is not revoked.
    pub async fn readmit_node(&self, node: &NodeId, audit: &Audit) -> Result<Readmitted, Error> {
        let by = audit.principal().name.as_str();
        let mut tx = self.pool.begin().await?;
        let row: Option<Option<DateTime<Utc>>> =
            sqlx::query_scalar("SELECT revoked_at FROM identity.nodes WHERE name = $1 FOR UPDATE")
                .bind(node.as_str())
                .fetch_optional(&mut *tx)
                .await?;
        let revoked_at = match row {
            None => {
                return Err(Error::NotFound(format!(
                    "no node `{node}` was ever enrolled or revoked"
                )));
            }
            Some(None) => {
                return Err(Error::Conflict(format!(
                    "node `{node}` is not revoked: there is nothing to re-admit"
                )));
            }
            Some(Some(at)) => at,
        };
        let readmitted_at: DateTime<Utc> = sqlx::query_scalar(
            "UPDATE identity.nodes SET revoked_at = NULL, readmitted_at = now(), readmitted_by = $2 \
             WHERE name = $1 RETURNING readmitted_at",
        )
        .bind(node.as_str())
        .bind(by)
        .fetch_one(&mut *tx)
        .await?;
        let event = RecordEvent::new(RecordKind::NodeReadmitted(NodeIdentityChanged {
            node: node.clone(),
            public_key: None,
            at: readmitted_at,
            labels: None,
        }));
        outbox::record(&mut tx, SCHEMA, &event).await?;
        audit::record_ok(&mut tx, SCHEMA, audit).await?;
        tx.commit().await?;
        self.signal.notify();
        tracing::info!(%node, by, %revoked_at, "node re-admitted");
        Ok(Readmitted {
            node: node.to_string(),
            revoked_at,
            readmitted_at,
            readmitted_by: by.to_owned(),
            next: format!(
                "give it credentials again: `meshctl node add {node}` then `mesh-agent join` on the node, or `mesh-bundle node-add {node} --state-dir <its state dir>` on a local mesh"
            ),
        })
    }

    /// A node's identity, if it ever enrolled.
    pub async fn node_identity(&self, node: &NodeId) -> Result<Option<NodeIdentity>, Error> {
        Ok(sqlx::query_as(
            "SELECT name, public_key, enrolled_at, enrolled_by, revoked_at FROM identity.nodes \
             WHERE name = $1",
        )
        .bind(node.as_str())
        .fetch_optional(&self.pool)
        .await?)
    }
}
