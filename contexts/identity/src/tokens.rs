//! Operators' API tokens: bearer, 256 random bits, stored as SHA-256; each with a
//! name and a role.

use chrono::{DateTime, Utc};
use mesh_plumbing::api::{Principal, Role};
use mesh_plumbing::audit::{self, Audit};
use mesh_protocol::{Secret, new_token, token_sha256_hex};
use serde::Serialize;
use uuid::Uuid;

use crate::{Error, Identity, SCHEMA};

/// Prefix of every API token, so a leaked one is recognisable.
pub const API_TOKEN_PREFIX: &str = "mesh_at_";

/// A token as listed: never its secret.
#[derive(Debug, Clone, Serialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct TokenView {
    pub id: Uuid,
    pub name: String,
    pub role: String,
    pub created_at: DateTime<Utc>,
    pub created_by: String,
    pub revoked_at: Option<DateTime<Utc>>,
}

/// A token just created: the only time its secret is seen.
#[derive(Debug, Clone)]
pub struct NewToken {
    pub view: TokenView,
    pub token: Secret<String>,
}

/// A token name: 1 to 64 of `[A-Za-z0-9._@-]`.
pub(crate) fn validate_name(field: &str, name: &str) -> Result<(), Error> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._@-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(Error::invalid(
            field,
            "must be 1 to 64 of A-Z a-z 0-9 . _ @ -",
        ))
    }
}

impl Identity {
    /// Create an API token with `role`, named `name`, by the request's
    /// principal, with its audit entry in the same transaction.
    pub async fn create_token(
        &self,
        name: &str,
        role: Role,
        audit: &Audit,
    ) -> Result<NewToken, Error> {
        validate_name("name", name)?;
        let by = audit.principal().name.as_str();
        let token = new_token(API_TOKEN_PREFIX, rand::random());
        let mut tx = self.pool.begin().await?;
        let view: TokenView = sqlx::query_as(
            "INSERT INTO identity.tokens (id, name, role, token_sha256, created_by) \
             VALUES ($1, $2, $3, $4, $5) \
             RETURNING id, name, role, created_at, created_by, revoked_at",
        )
        .bind(Uuid::now_v7())
        .bind(name)
        .bind(role.as_str())
        .bind(token_sha256_hex(&token))
        .bind(by)
        .fetch_one(&mut *tx)
        .await?;
        audit::record_ok(&mut tx, SCHEMA, audit).await?;
        tx.commit().await?;
        tracing::info!(token_id = %view.id, name, role = %role, by, "API token created");
        Ok(NewToken {
            view,
            token: Secret::new(token),
        })
    }

    /// Every token (revoked ones too), oldest first, after `after` (an id).
    pub async fn tokens(&self, after: Option<Uuid>, limit: i64) -> Result<Vec<TokenView>, Error> {
        Ok(sqlx::query_as(
            "SELECT id, name, role, created_at, created_by, revoked_at FROM identity.tokens \
             WHERE $1::uuid IS NULL OR id > $1 ORDER BY id LIMIT $2",
        )
        .bind(after)
        .bind(limit.clamp(1, self.settings.max_page))
        .fetch_all(&self.pool)
        .await?)
    }

    /// Revoke a token: it authenticates nothing from now on. Revoking a revoked
    /// token changes nothing. The request's audit entry commits with it.
    pub async fn revoke_token(&self, id: Uuid, audit: &Audit) -> Result<TokenView, Error> {
        let mut tx = self.pool.begin().await?;
        let row: Option<TokenView> = sqlx::query_as(
            "UPDATE identity.tokens SET revoked_at = COALESCE(revoked_at, now()) WHERE id = $1 \
             RETURNING id, name, role, created_at, created_by, revoked_at",
        )
        .bind(id)
        .fetch_optional(&mut *tx)
        .await?;
        let view = row.ok_or_else(|| Error::NotFound(format!("no token `{id}`")))?;
        audit::record_ok(&mut tx, SCHEMA, audit).await?;
        tx.commit().await?;
        tracing::info!(token_id = %id, name = %view.name, "API token revoked");
        Ok(view)
    }

    /// The principal a bearer token stands for; None when unknown or revoked.
    pub async fn authenticate(&self, token: &str) -> Result<Option<Principal>, Error> {
        let row: Option<(Uuid, String, String)> = sqlx::query_as(
            "SELECT id, name, role FROM identity.tokens \
             WHERE token_sha256 = $1 AND revoked_at IS NULL",
        )
        .bind(token_sha256_hex(token))
        .fetch_optional(&self.pool)
        .await?;
        match row {
            None => Ok(None),
            Some((id, name, role)) => {
                let role = Role::parse(&role)
                    .ok_or_else(|| Error::Corrupt(format!("token {id} has role `{role}`")))?;
                Ok(Some(Principal { id, name, role }))
            }
        }
    }

    /// Make sure the first admin token (created by `bundle/up`, known here only by
    /// its SHA-256) exists, as `bootstrap-admin`. Does nothing if a token with that
    /// hash exists, revoked or not: revoking it is permanent. Returns true if it
    /// was created now.
    pub async fn ensure_bootstrap_admin(&self, token_sha256: &str) -> Result<bool, Error> {
        let valid = token_sha256.len() == 64 && token_sha256.bytes().all(|b| b.is_ascii_hexdigit());
        if !valid {
            return Err(Error::invalid(
                "bootstrap_admin_token_sha256",
                "must be 64 hex digits",
            ));
        }
        let done = sqlx::query(
            "INSERT INTO identity.tokens (id, name, role, token_sha256, created_by) \
             VALUES ($1, 'bootstrap-admin', 'admin', $2, 'bundle') \
             ON CONFLICT (token_sha256) DO NOTHING",
        )
        .bind(Uuid::now_v7())
        .bind(token_sha256.to_ascii_lowercase())
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }
}
