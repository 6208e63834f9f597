//! Operators' API tokens: bearer, 256 random bits, stored as SHA-256; each with a
//! name, a role and an expiry (issue 29: tokens that end). A token past its
//! expiry authenticates nothing and says so; rotating one makes a new secret of
//! the same name and role and revokes the old.

use std::time::Duration;

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
    /// After this the token authenticates nothing.
    pub expires_at: DateTime<Utc>,
    /// The last request it authenticated (written at most once a minute).
    pub last_used_at: Option<DateTime<Utc>>,
    /// The token this one replaced (`POST /v1/tokens/{id}/rotate`).
    pub rotated_from: Option<Uuid>,
    /// The OIDC trust that gave it for an ID token (`POST /v1/tokens/exchange`).
    pub trust: Option<String>,
    /// That ID token's subject.
    pub subject: Option<String>,
}

/// The columns of a [`TokenView`] (a literal, for `concat!`).
macro_rules! view {
    () => {
        "id, name, role, created_at, created_by, revoked_at, expires_at, last_used_at, rotated_from, trust, subject"
    };
}
pub(crate) use view;

/// What a bearer token stands for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Authenticated {
    /// A live token: its principal.
    Principal(Principal),
    /// Not a token of this mesh, or revoked.
    Unknown,
    /// A token of this mesh whose lifetime ended at `at`.
    Expired { name: String, at: DateTime<Utc> },
}

/// How often `last_used_at` is written for one token, at most.
const LAST_USED_EVERY_SECS: i64 = 60;

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
    /// The lifetime `ttl` asks for, or the default; refused when zero or past
    /// the longest allowed.
    fn token_ttl(&self, ttl: Option<Duration>) -> Result<Duration, Error> {
        let ttl = ttl.unwrap_or(self.settings.api_token_ttl);
        if ttl < Duration::from_secs(60) || ttl > self.settings.api_token_max_ttl {
            return Err(Error::invalid(
                "ttl_secs",
                format!(
                    "must be 60 to {} seconds",
                    self.settings.api_token_max_ttl.as_secs()
                ),
            ));
        }
        Ok(ttl)
    }

    /// Create an API token with `role`, named `name`, living `ttl` (default
    /// [`IdentitySettings::api_token_ttl`](crate::IdentitySettings)), by the
    /// request's principal, with its audit entry in the same transaction.
    pub async fn create_token(
        &self,
        name: &str,
        role: Role,
        ttl: Option<Duration>,
        audit: &Audit,
    ) -> Result<NewToken, Error> {
        validate_name("name", name)?;
        let ttl = self.token_ttl(ttl)?;
        let by = audit.principal().name.as_str();
        let token = new_token(API_TOKEN_PREFIX, rand::random());
        let mut tx = self.pool.begin().await?;
        let view: TokenView = sqlx::query_as(concat!(
            "INSERT INTO identity.tokens (id, name, role, token_sha256, created_by, expires_at) \
             VALUES ($1, $2, $3, $4, $5, now() + make_interval(secs => $6)) RETURNING ",
            view!()
        ))
        .bind(Uuid::now_v7())
        .bind(name)
        .bind(role.as_str())
        .bind(token_sha256_hex(&token))
        .bind(by)
        .bind(ttl.as_secs_f64())
        .fetch_one(&mut *tx)
        .await?;
        audit::record_ok(&mut tx, SCHEMA, audit).await?;
        tx.commit().await?;
        tracing::info!(token_id = %view.id, name, role = %role, by, expires_at = %view.expires_at, "API token created");
        Ok(NewToken {
            view,
            token: Secret::new(token),
        })
    }

    /// Rotate token `id`: a new secret with the same name and role, living
    /// `ttl` (default as at creation), and the old one revoked, in one
    /// transaction with the audit entry. A revoked token cannot be rotated (it
    /// stays revoked); an expired one can.
    pub async fn rotate_token(
        &self,
        id: Uuid,
        ttl: Option<Duration>,
        audit: &Audit,
    ) -> Result<NewToken, Error> {
        let ttl = self.token_ttl(ttl)?;
        let by = audit.principal().name.as_str();
        let mut tx = self.pool.begin().await?;
        type Old = (String, String, Option<DateTime<Utc>>, Option<String>);
        let old: Option<Old> = sqlx::query_as(
            "SELECT name, role, revoked_at, trust FROM identity.tokens WHERE id = $1 FOR UPDATE",
        )
        .bind(id)
        .fetch_optional(&mut *tx)
        .await?;
        let (name, role, revoked, trust) =
            old.ok_or_else(|| Error::NotFound(format!("no token `{id}`")))?;
        if let Some(trust) = trust {
            // Rotating would turn an hour's token into a long-lived one.
            return Err(Error::Conflict(format!(
                "token `{id}` was given by trust `{trust}` for an ID token: it is not rotated; exchange a new ID token"
            )));
        }
        if let Some(at) = revoked {
            return Err(Error::Conflict(format!(
                "token `{id}` ({name}) was revoked at {at}: a revoked token is not rotated; create a new one"
            )));
        }
        let token = new_token(API_TOKEN_PREFIX, rand::random());
        let view: TokenView = sqlx::query_as(concat!(
            "INSERT INTO identity.tokens (id, name, role, token_sha256, created_by, expires_at, rotated_from) \
             VALUES ($1, $2, $3, $4, $5, now() + make_interval(secs => $6), $7) RETURNING ",
            view!()
        ))
        .bind(Uuid::now_v7())
        .bind(&name)
        .bind(&role)
        .bind(token_sha256_hex(&token))
        .bind(by)
        .bind(ttl.as_secs_f64())
        .bind(id)
        .fetch_one(&mut *tx)
        .await?;
        sqlx::query("UPDATE identity.tokens SET revoked_at = now() WHERE id = $1")
            .bind(id)
            .execute(&mut *tx)
            .await?;
        audit::record_ok(&mut tx, SCHEMA, audit).await?;
        tx.commit().await?;
        tracing::info!(token_id = %view.id, replaced = %id, name = %name, by, expires_at = %view.expires_at, "API token rotated");
        Ok(NewToken {
            view,
            token: Secret::new(token),
        })
    }

    /// Every token (revoked ones too), oldest first, after `after` (an id).
    pub async fn tokens(&self, after: Option<Uuid>, limit: i64) -> Result<Vec<TokenView>, Error> {
        Ok(sqlx::query_as(concat!(
            "SELECT ",
            view!(),
            " FROM identity.tokens \
             WHERE $1::uuid IS NULL OR id > $1 ORDER BY id LIMIT $2"
        ))
        .bind(after)
        .bind(limit.clamp(1, self.settings.max_page))
        .fetch_all(&self.pool)
        .await?)
    }

    /// Revoke a token: it authenticates nothing from now on. Revoking a revoked
    /// token changes nothing. The request's audit entry commits with it.
    pub async fn revoke_token(&self, id: Uuid, audit: &Audit) -> Result<TokenView, Error> {
        let mut tx = self.pool.begin().await?;
        let row: Option<TokenView> = sqlx::query_as(concat!(
            "UPDATE identity.tokens SET revoked_at = COALESCE(revoked_at, now()) WHERE id = $1 \
             RETURNING ",
            view!()
        ))
        .bind(id)
        .fetch_optional(&mut *tx)
        .await?;
        let view = row.ok_or_else(|| Error::NotFound(format!("no token `{id}`")))?;
        audit::record_ok(&mut tx, SCHEMA, audit).await?;
        tx.commit().await?;
        tracing::info!(token_id = %id, name = %view.name, "API token revoked");
        Ok(view)
    }

    /// What a bearer token stands for: its principal while it lives (and its
    /// `last_used_at` brought up to date, at most once a minute), or why not.
    pub async fn authenticate(&self, token: &str) -> Result<Authenticated, Error> {
        type Row = (Uuid, String, String, DateTime<Utc>, bool);
        let row: Option<Row> = sqlx::query_as(
            "SELECT id, name, role, expires_at, expires_at <= now() FROM identity.tokens \
             WHERE token_sha256 = $1 AND revoked_at IS NULL",
        )
        .bind(token_sha256_hex(token))
        .fetch_optional(&self.pool)
        .await?;
        let Some((id, name, role, expires_at, expired)) = row else {
            return Ok(Authenticated::Unknown);
        };
        if expired {
            return Ok(Authenticated::Expired {
                name,
                at: expires_at,
            });
        }
        let role = Role::parse(&role)
            .ok_or_else(|| Error::Corrupt(format!("token {id} has role `{role}`")))?;
        sqlx::query(
            "UPDATE identity.tokens SET last_used_at = now() WHERE id = $1 \
             AND (last_used_at IS NULL OR last_used_at < now() - make_interval(secs => $2))",
        )
        .bind(id)
        .bind(LAST_USED_EVERY_SECS as f64)
        .execute(&self.pool)
        .await?;
        Ok(Authenticated::Principal(Principal { id, name, role }))
    }

    /// Make sure the first admin token (created by `bundle/up`, known here only by
    /// its SHA-256) exists, as `bootstrap-admin`, living the default lifetime
    /// from its first registration (replace it before: `meshctl token create`,
    /// or `meshctl token rotate`). Does nothing if a token with that
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
            "INSERT INTO identity.tokens (id, name, role, token_sha256, created_by, expires_at) \
             VALUES ($1, 'bootstrap-admin', 'admin', $2, 'bundle', now() + make_interval(secs => $3)) \
             ON CONFLICT (token_sha256) DO NOTHING",
        )
        .bind(Uuid::now_v7())
        .bind(token_sha256.to_ascii_lowercase())
        .bind(self.settings.api_token_ttl.as_secs_f64())
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }
}
