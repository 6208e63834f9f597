//! Operator-held signing keys (issue 29, point 4; decision 0048).
//!
//! Admins add and remove the Ed25519 public keys whose artifact signatures
//! nodes trust; each node that holds artifacts is declared the list, whole,
//! in its delivery section (`artifact_keys`), so a key removed is gone from
//! the next generation. The controller's own key is on the list only when the
//! fleet opts in (`trust_controller_artifact_signatures`). Operators sign an
//! artifact's digest with the private half, which the mesh never sees, and
//! upload the signature; it is verified against these keys before the
//! registry keeps it beside the artifact. Nothing here can make a signature.

use chrono::{DateTime, Utc};
use mesh_protocol::{ArtifactDigest, ArtifactSignature, PublicKey, TrustedArtifactKey};
use serde::{Deserialize, Serialize};
use sqlx::PgConnection;

use crate::Error;

/// The name the controller's own key has in a declaration (never an
/// operator key's: refused when added).
pub const CONTROLLER_KEY_NAME: &str = "controller";

/// Most signing keys a mesh holds (a delivery section declares them all).
pub const MAX_SIGNING_KEYS: i64 = mesh_protocol::MAX_ARTIFACT_KEYS as i64 - 1;

/// `POST /v1/signing-keys`.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewSigningKey {
    /// 1 to 63 of a-z 0-9 . _ -, starting with a letter or digit; not
    /// `controller`.
    pub name: String,
    /// The Ed25519 public key, 64 hex digits (`meshctl key generate` writes
    /// it to `<file>.pub`).
    pub key: String,
}

/// A signing key as the API shows it.
#[derive(Debug, Clone, Serialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct SigningKeyView {
    pub name: String,
    /// Ed25519 public key, 64 lowercase hex digits.
    pub key: String,
    pub added_by: String,
    pub added_at: DateTime<Utc>,
}

/// `POST /v1/artifacts/{digest}/signatures`: a signature made offline with
/// an operator's key, of `mesh artifact signature v1\n<digest>` (what
/// `meshctl artifact sign` makes).
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewSignature {
    /// The signer's Ed25519 public key, 64 hex digits: one of the mesh's
    /// signing keys.
    pub key: String,
    /// Ed25519 over the payload, 128 hex digits.
    pub signature: String,
}

fn valid_name(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b.iter().all(|c| {
            c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, b'.' | b'_' | b'-')
        })
}

/// Check a key name (`field` names it in the error).
pub fn check_name(field: &str, name: &str) -> Result<(), Error> {
    if !valid_name(name) {
        return Err(Error::invalid(
            field,
            format!(
                "`{}` is not a key name: 1 to 63 of a-z 0-9 . _ -, starting with a letter or digit",
                name.chars().take(80).collect::<String>()
            ),
        ));
    }
    Ok(())
}

/// Parse a hex Ed25519 public key (`field` names it in the error).
pub fn parse_key(field: &str, key: &str) -> Result<PublicKey, Error> {
    PublicKey::from_hex(key).map_err(|e| {
        Error::invalid(
            field,
            format!("not an Ed25519 public key (64 hex digits): {e}"),
        )
    })
}

/// Add a key: `(key, created)`; the same name and key again is no change.
pub(crate) async fn add(
    tx: &mut PgConnection,
    new: &NewSigningKey,
    controller_key: &str,
    by: &str,
) -> Result<(SigningKeyView, bool), Error> {
    check_name("name", &new.name)?;
    if new.name == CONTROLLER_KEY_NAME {
        return Err(Error::invalid(
            "name",
            "`controller` names the controller's own key in declarations: choose another",
        ));
    }
    let key = parse_key("key", &new.key)?.to_hex();
    if key == controller_key {
        return Err(Error::invalid(
            "key",
            "this is the controller's own key: a fleet that trusts it sets trust_controller_artifact_signatures instead",
        ));
    }
    let existing: Option<SigningKeyView> = sqlx::query_as(
        "SELECT name, key, added_by, added_at FROM delivery.signing_keys WHERE name = $1 OR key = $2 ORDER BY name LIMIT 1",
    )
    .bind(&new.name)
    .bind(&key)
    .fetch_optional(&mut *tx)
    .await?;
    if let Some(v) = existing {
        if v.name == new.name && v.key == key {
            return Ok((v, false));
        }
        return Err(if v.name == new.name {
            Error::Conflict(format!(
                "a signing key named `{}` exists with another key: remove it first",
                v.name
            ))
        } else {
            Error::Conflict(format!("this key is already the signing key `{}`", v.name))
        });
    }
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM delivery.signing_keys")
        .fetch_one(&mut *tx)
        .await?;
    if count >= MAX_SIGNING_KEYS {
        return Err(Error::Conflict(format!(
            "the mesh already has {MAX_SIGNING_KEYS} signing keys: remove one first"
        )));
    }
    let v: SigningKeyView = sqlx::query_as(
        "INSERT INTO delivery.signing_keys (name, key, added_by) VALUES ($1, $2, $3) RETURNING name, key, added_by, added_at",
    )
    .bind(&new.name)
    .bind(&key)
    .bind(by)
    .fetch_one(&mut *tx)
    .await?;
    Ok((v, true))
}

/// Every signing key, by name.
pub(crate) async fn list(tx: &mut PgConnection) -> Result<Vec<SigningKeyView>, Error> {
    Ok(sqlx::query_as(
        "SELECT name, key, added_by, added_at FROM delivery.signing_keys ORDER BY name",
    )
    .fetch_all(&mut *tx)
    .await?)
}

/// Remove the key named `name`: what it was.
pub(crate) async fn remove(tx: &mut PgConnection, name: &str) -> Result<SigningKeyView, Error> {
    check_name("name", name)?;
    sqlx::query_as(
        "DELETE FROM delivery.signing_keys WHERE name = $1 RETURNING name, key, added_by, added_at",
    )
    .bind(name)
    .fetch_optional(&mut *tx)
    .await?
    .ok_or_else(|| Error::NotFound(format!("signing key `{name}`")))
}

/// The keys a node holding artifacts is declared: every signing key, and the
/// controller's when the fleet trusts it, by name.
pub(crate) async fn declared(
    tx: &mut PgConnection,
    controller: Option<&str>,
) -> Result<Vec<TrustedArtifactKey>, Error> {
    let mut keys: Vec<TrustedArtifactKey> = list(tx)
        .await?
        .into_iter()
        .map(|k| TrustedArtifactKey {
            name: k.name,
            key: k.key,
        })
        .collect();
    if let Some(key) = controller {
        keys.push(TrustedArtifactKey {
            name: CONTROLLER_KEY_NAME.to_owned(),
            key: key.to_owned(),
        });
    }
    keys.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(keys)
}

/// Verify `new` as a signature of `digest` by one of the mesh's signing keys:
/// the signature as the registry keeps it, and its key's name.
pub(crate) async fn verify(
    tx: &mut PgConnection,
    digest: &ArtifactDigest,
    new: &NewSignature,
) -> Result<(ArtifactSignature, String), Error> {
    let key = parse_key("key", &new.key)?;
    let hex = key.to_hex();
    let name: Option<String> =
        sqlx::query_scalar("SELECT name FROM delivery.signing_keys WHERE key = $1 FOR SHARE")
            .bind(&hex)
            .fetch_optional(&mut *tx)
            .await?;
    let name = name.ok_or_else(|| {
        Error::invalid(
            "key",
            format!(
                "{hex} is not a signing key of this mesh (an admin adds it: meshctl signing-key add)"
            ),
        )
    })?;
    let signature = ArtifactSignature {
        digest: digest.clone(),
        key: hex,
        signature: new.signature.trim().to_ascii_lowercase(),
    };
    signature.verify(digest, &[key]).map_err(|e| {
        Error::invalid(
            "signature",
            format!("not a signature of {digest} by the signing key `{name}`: {e}"),
        )
    })?;
    Ok((signature, name))
}

/// Record an uploaded signature (a newer one by the same key replaces it).
pub(crate) async fn record_signature(
    tx: &mut PgConnection,
    signature: &ArtifactSignature,
    key_name: &str,
    by: &str,
) -> Result<(), Error> {
    sqlx::query(
        "INSERT INTO delivery.artifact_signatures (digest, key, key_name, signature, uploaded_by) \
         VALUES ($1, $2, $3, $4, $5) \
         ON CONFLICT (digest, key) DO UPDATE SET key_name = excluded.key_name, \
         signature = excluded.signature, uploaded_by = excluded.uploaded_by, uploaded_at = now()",
    )
    .bind(signature.digest.as_str())
    .bind(&signature.key)
    .bind(key_name)
    .bind(&signature.signature)
    .bind(by)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_names() {
        for ok in ["alice", "release-2026", "a", "ci.bot_1"] {
            assert!(valid_name(ok), "{ok}");
        }
        for bad in ["", "Alice", "-x", "a b", &"a".repeat(64), "ключ"] {
            assert!(!valid_name(bad), "{bad}");
        }
    }
}
