//! Trust for automation (issue 29, point 3; decision 0049): a CI job proves
//! who it is with an OIDC ID token from an issuer an admin trusts, and gets a
//! mesh API token of the trust's role that lives an hour at most. No
//! long-lived secret sits in the CI system.
//!
//! A trust names an issuer, the audience its tokens must carry, a pattern the
//! subject must match and the role it grants. An exchange is refused, with a
//! problem naming why, unless the ID token is signed (RS256 or ES256 only;
//! `alg: none`, HMAC and anything else are refused before any key is looked
//! at) by a key in the issuer's JWKS, was issued by the trust's issuer, for
//! its audience, is within its lifetime and its subject matches. The issuer's
//! keys are found through its discovery document and cached; only the
//! trust's own issuer is ever fetched, never a URL the token names.
//!
//! The fetching itself is the controller's ([`HttpFetch`]): this crate never
//! speaks HTTP.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use chrono::{DateTime, Utc};
use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::jwk::JwkSet;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use mesh_plumbing::api::{Principal, Role};
use mesh_plumbing::audit::{self, Audit};
use mesh_protocol::{Secret, new_token, token_sha256_hex};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::tokens::{API_TOKEN_PREFIX, NewToken, TokenView, validate_name};
use crate::{BoxFuture, Error, Identity, SCHEMA};

/// The longest an exchanged token lives (and a trust's default).
pub const EXCHANGED_MAX_TTL: Duration = Duration::from_secs(3600);

/// The shortest an exchanged token lives.
pub const EXCHANGED_MIN_TTL: Duration = Duration::from_secs(60);

/// Largest ID token an exchange reads.
pub const MAX_ID_TOKEN_BYTES: usize = 16 * 1024;

/// How long an issuer's keys are used before they are fetched again.
const KEYS_FRESH_FOR: Duration = Duration::from_secs(600);

/// An unknown key id makes the keys be fetched again, at most this often per
/// issuer (a key rotated at the issuer is found; a stream of made-up key ids
/// does not turn into a stream of fetches).
const REFETCH_AT_MOST_EVERY: Duration = Duration::from_secs(30);

/// Clock skew tolerated on `exp` and `nbf`.
const LEEWAY_SECS: u64 = 30;

/// Where the controller fetches a document for identity: the discovery
/// document and key set of a trusted issuer. Bounded in time and size by the
/// implementation; an error is said in words (no secret in them).
pub trait HttpFetch: Send + Sync + 'static {
    fn get<'a>(&'a self, url: &'a str) -> BoxFuture<'a, Result<Vec<u8>, String>>;
}

/// No fetching at all: every exchange is refused as unavailable. What an
/// [`Identity`] has until the controller gives it a client.
pub struct NoFetch;

impl HttpFetch for NoFetch {
    fn get<'a>(&'a self, _url: &'a str) -> BoxFuture<'a, Result<Vec<u8>, String>> {
        Box::pin(async { Err("this controller has no HTTP client for OIDC issuers".to_owned()) })
    }
}

/// An issuer's keys as last fetched.
pub(crate) struct CachedKeys {
    keys: JwkSet,
    fetched: Instant,
}

/// The key sets of issuers, by issuer URL.
pub(crate) type KeyCache = tokio::sync::Mutex<HashMap<String, CachedKeys>>;

/// A trust as listed.
#[derive(Debug, Clone, Serialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct TrustView {
    pub name: String,
    /// The issuer's URL, exactly as its tokens' `iss` claim says it.
    pub issuer: String,
    /// What an ID token's `aud` claim must hold.
    pub audience: String,
    /// What its `sub` claim must match (`*` matches any run of characters).
    pub subject: String,
    /// The role of the tokens it gives.
    pub role: String,
    /// How long those tokens live, in seconds (at most 3600).
    pub ttl_secs: i32,
    pub created_at: DateTime<Utc>,
    pub created_by: String,
    pub updated_at: DateTime<Utc>,
    pub updated_by: String,
}

macro_rules! trust_view {
    () => {
        "name, issuer, audience, subject, role, ttl_secs, created_at, created_by, updated_at, updated_by"
    };
}

/// What `PUT /v1/trust/{name}` asks for.
#[derive(Debug, Clone)]
pub struct TrustSpec {
    pub issuer: String,
    pub audience: String,
    pub subject: String,
    pub role: Role,
    pub ttl: Option<Duration>,
}

/// A token given for an ID token: the only time its secret is seen.
#[derive(Debug, Clone)]
pub struct Exchanged {
    pub token: NewToken,
    /// The ID token's subject, as the issuer signed it.
    pub subject: String,
}

/// An issuer URL: `https://`, or `http://` on a loopback address (a test
/// issuer, or one reached through a local proxy); no query, no fragment.
fn validate_issuer(issuer: &str) -> Result<(), Error> {
    let url =
        url::Url::parse(issuer).map_err(|e| Error::invalid("issuer", format!("not a URL: {e}")))?;
    let loopback = match url.host() {
        Some(url::Host::Domain(d)) => d == "localhost",
        Some(url::Host::Ipv4(a)) => a.is_loopback(),
        Some(url::Host::Ipv6(a)) => a.is_loopback(),
        None => false,
    };
    match url.scheme() {
        "https" => {}
        "http" if loopback => {}
        "http" => {
            return Err(Error::invalid(
                "issuer",
                "must be https:// (http:// only on a loopback address)",
            ));
        }
        other => {
            return Err(Error::invalid(
                "issuer",
                format!("scheme `{other}`: must be https://"),
            ));
        }
    }
    if url.query().is_some() || url.fragment().is_some() || !url.username().is_empty() {
        return Err(Error::invalid(
            "issuer",
            "must have no query, fragment or user",
        ));
    }
    if issuer.len() > 512 {
        return Err(Error::invalid("issuer", "at most 512 characters"));
    }
    Ok(())
}

/// A subject pattern: 1 to 256 printable characters, `*` matching any run of
/// characters, with at least one character that is not `*`: a pattern of
/// stars alone would trust every subject of an issuer that many share (a CI
/// provider's issuer signs tokens for all its users).
fn validate_subject(pattern: &str) -> Result<(), Error> {
    if pattern.is_empty() || pattern.len() > 256 || pattern.chars().any(char::is_control) {
        return Err(Error::invalid(
            "subject",
            "must be 1 to 256 printable characters",
        ));
    }
    if pattern.chars().all(|c| c == '*') {
        return Err(Error::invalid(
            "subject",
            "must name something: a pattern of `*` alone trusts every subject of the issuer (all its users, on a shared CI issuer)",
        ));
    }
    Ok(())
}

/// Whether `subject` matches `pattern`, where `*` matches any run of
/// characters (none too) and every other character itself.
pub fn subject_matches(pattern: &str, subject: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    let (first, rest) = match parts.split_first() {
        Some(x) => x,
        None => return subject.is_empty(),
    };
    let Some(mut left) = subject.strip_prefix(first) else {
        return false;
    };
    let Some((last, middle)) = rest.split_last() else {
        // No star: the whole subject.
        return left.is_empty();
    };
    for part in middle {
        match left.find(part) {
            Some(i) => left = &left[i + part.len()..],
            None => return false,
        }
    }
    left.ends_with(last)
}

/// The refusal of an exchange: 401 with `why`.
fn refused(why: impl Into<String>) -> Error {
    Error::ExchangeRefused(why.into())
}

/// The parts of an ID token read before its signature is checked: only to
/// choose the key and to refuse early, never to trust.
#[derive(Debug)]
struct Unverified {
    alg: Algorithm,
    kid: String,
    iss: Option<String>,
    exp: Option<i64>,
}

fn segment_json(segment: &str, what: &str) -> Result<serde_json::Value, Error> {
    let bytes = URL_SAFE_NO_PAD
        .decode(segment.trim_end_matches('='))
        .map_err(|_| refused(format!("the ID token's {what} is not base64url")))?;
    serde_json::from_slice(&bytes)
        .map_err(|_| refused(format!("the ID token's {what} is not JSON")))
}

fn unverified(id_token: &str) -> Result<Unverified, Error> {
    let parts: Vec<&str> = id_token.split('.').collect();
    if parts.len() != 3 {
        return Err(refused(
            "the ID token is not a JWS in compact form (header.payload.signature)",
        ));
    }
    let header = segment_json(parts[0], "header")?;
    let alg = header["alg"].as_str().unwrap_or_default();
    let alg = match alg {
        "RS256" => Algorithm::RS256,
        "ES256" => Algorithm::ES256,
        "none" | "" => {
            return Err(refused(
                "the ID token is unsigned (`alg: none`): only RS256 and ES256 are accepted",
            ));
        }
        other => {
            return Err(refused(format!(
                "the ID token's algorithm `{other}` is not accepted: only RS256 and ES256"
            )));
        }
    };
    if parts[2].is_empty() {
        return Err(refused("the ID token has no signature"));
    }
    let kid = header["kid"]
        .as_str()
        .filter(|k| !k.is_empty())
        .ok_or_else(|| refused("the ID token's header names no key (`kid`)"))?
        .to_owned();
    let claims = segment_json(parts[1], "payload")?;
    Ok(Unverified {
        alg,
        kid,
        iss: claims["iss"].as_str().map(str::to_owned),
        exp: claims["exp"].as_i64(),
    })
}

#[derive(Deserialize)]
struct Claims {
    sub: String,
}

impl Identity {
    /// Create or replace trust `name`, with its audit entry in the same
    /// transaction. A change to an existing trust revokes the tokens it gave
    /// (what it trusted before is no longer what an admin chose). Returns the
    /// trust and whether it was created.
    pub async fn put_trust(
        &self,
        name: &str,
        spec: &TrustSpec,
        audit: &Audit,
    ) -> Result<(TrustView, bool), Error> {
        validate_name("name", name)?;
        validate_issuer(&spec.issuer)?;
        if spec.audience.is_empty() || spec.audience.len() > 256 {
            return Err(Error::invalid("audience", "must be 1 to 256 characters"));
        }
        validate_subject(&spec.subject)?;
        let ttl = spec.ttl.unwrap_or(EXCHANGED_MAX_TTL);
        if ttl < EXCHANGED_MIN_TTL || ttl > EXCHANGED_MAX_TTL {
            return Err(Error::invalid(
                "ttl_secs",
                format!(
                    "must be {} to {} seconds",
                    EXCHANGED_MIN_TTL.as_secs(),
                    EXCHANGED_MAX_TTL.as_secs()
                ),
            ));
        }
        let by = audit.principal().name.as_str();
        let mut tx = self.pool.begin().await?;
        let before: Option<TrustView> = sqlx::query_as(concat!(
            "SELECT ",
            trust_view!(),
            " FROM identity.trusts WHERE name = $1 FOR UPDATE"
        ))
        .bind(name)
        .fetch_optional(&mut *tx)
        .await?;
        let view: TrustView = sqlx::query_as(concat!(
            "INSERT INTO identity.trusts (name, issuer, audience, subject, role, ttl_secs, created_by, updated_by) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $7) \
             ON CONFLICT (name) DO UPDATE SET issuer = $2, audience = $3, subject = $4, role = $5, \
             ttl_secs = $6, updated_at = now(), updated_by = $7 RETURNING ",
            trust_view!()
        ))
        .bind(name)
        .bind(&spec.issuer)
        .bind(&spec.audience)
        .bind(&spec.subject)
        .bind(spec.role.as_str())
        .bind(ttl.as_secs() as i32)
        .bind(by)
        .fetch_one(&mut *tx)
        .await?;
        let changed = before.as_ref().is_some_and(|b| {
            (&b.issuer, &b.audience, &b.subject, &b.role, b.ttl_secs)
                != (
                    &view.issuer,
                    &view.audience,
                    &view.subject,
                    &view.role,
                    view.ttl_secs,
                )
        });
        let revoked = if changed {
            revoke_given(&mut tx, name).await?
        } else {
            0
        };
        audit::record_ok(&mut tx, SCHEMA, audit).await?;
        tx.commit().await?;
        tracing::info!(trust = name, issuer = %view.issuer, role = %view.role, by, revoked, "OIDC trust put");
        Ok((view, before.is_none()))
    }

    /// Every trust, by name.
    pub async fn trusts(&self) -> Result<Vec<TrustView>, Error> {
        Ok(sqlx::query_as(concat!(
            "SELECT ",
            trust_view!(),
            " FROM identity.trusts ORDER BY name LIMIT $1"
        ))
        .bind(self.settings.max_page)
        .fetch_all(&self.pool)
        .await?)
    }

    /// Trust `name`.
    pub async fn trust(&self, name: &str) -> Result<TrustView, Error> {
        let row: Option<TrustView> = sqlx::query_as(concat!(
            "SELECT ",
            trust_view!(),
            " FROM identity.trusts WHERE name = $1"
        ))
        .bind(name)
        .fetch_optional(&self.pool)
        .await?;
        row.ok_or_else(|| Error::NotFound(format!("no trust `{name}`")))
    }

    /// Delete trust `name` and revoke the tokens it gave, with the audit
    /// entry, in one transaction.
    pub async fn delete_trust(&self, name: &str, audit: &Audit) -> Result<TrustView, Error> {
        let mut tx = self.pool.begin().await?;
        let row: Option<TrustView> = sqlx::query_as(concat!(
            "DELETE FROM identity.trusts WHERE name = $1 RETURNING ",
            trust_view!()
        ))
        .bind(name)
        .fetch_optional(&mut *tx)
        .await?;
        let view = row.ok_or_else(|| Error::NotFound(format!("no trust `{name}`")))?;
        let revoked = revoke_given(&mut tx, name).await?;
        audit::record_ok(&mut tx, SCHEMA, audit).await?;
        tx.commit().await?;
        tracing::info!(trust = name, revoked, "OIDC trust deleted");
        Ok(view)
    }

    /// Exchange `id_token` under trust `trust_name` for a mesh API token of
    /// the trust's role, living the trust's lifetime (an hour at most). The
    /// audit entry (principal: the trust and the token's subject) commits with
    /// the token. Every refusal is [`Error::ExchangeRefused`] naming why; an
    /// issuer whose keys cannot be fetched is [`Error::IssuerUnavailable`].
    pub async fn exchange(
        &self,
        trust_name: &str,
        id_token: &str,
        request_id: Uuid,
        target: &str,
    ) -> Result<Exchanged, Error> {
        if id_token.len() > MAX_ID_TOKEN_BYTES {
            return Err(Error::invalid(
                "id_token",
                format!("at most {MAX_ID_TOKEN_BYTES} bytes"),
            ));
        }
        let trust = match self.trust(trust_name).await {
            Ok(t) => t,
            Err(Error::NotFound(_)) => {
                return Err(refused(format!("no trust `{trust_name}`")));
            }
            Err(e) => return Err(e),
        };
        let head = unverified(id_token)?;
        // Only the trust's issuer is ever fetched: a token naming another is
        // refused before any key is looked for.
        match head.iss.as_deref() {
            Some(iss) if iss == trust.issuer => {}
            Some(iss) => {
                return Err(refused(format!(
                    "the ID token was issued by `{iss}`; trust `{trust_name}` trusts `{}`",
                    trust.issuer
                )));
            }
            None => return Err(refused("the ID token has no `iss` claim")),
        }
        let jwk = self.issuer_key(&trust.issuer, &head.kid).await?;
        let key = DecodingKey::from_jwk(&jwk).map_err(|e| {
            refused(format!(
                "the issuer's key `{}` is not a usable key: {e}",
                head.kid
            ))
        })?;
        let mut validation = Validation::new(head.alg);
        validation.set_audience(&[trust.audience.as_str()]);
        validation.set_issuer(&[trust.issuer.as_str()]);
        validation.set_required_spec_claims(&["exp", "iss", "aud", "sub"]);
        validation.leeway = LEEWAY_SECS;
        validation.validate_nbf = true;
        let data = jsonwebtoken::decode::<Claims>(id_token, &key, &validation).map_err(|e| {
            refused(match e.kind() {
                ErrorKind::InvalidAudience => format!(
                    "the ID token's audience is not `{}`, the one trust `{trust_name}` requires",
                    trust.audience
                ),
                ErrorKind::ExpiredSignature => {
                    match head.exp.and_then(|s| DateTime::<Utc>::from_timestamp(s, 0)) {
                        Some(at) => format!(
                            "the ID token expired at {}",
                            at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
                        ),
                        None => "the ID token expired".to_owned(),
                    }
                }
                ErrorKind::ImmatureSignature => "the ID token is not valid yet (`nbf`)".to_owned(),
                ErrorKind::InvalidIssuer => {
                    format!("the ID token's issuer is not `{}`", trust.issuer)
                }
                ErrorKind::InvalidSignature => format!(
                    "the ID token's signature does not verify with the issuer's key `{}`",
                    head.kid
                ),
                ErrorKind::InvalidAlgorithm => format!(
                    "the issuer's key `{}` is not a key for {:?}",
                    head.kid, head.alg
                ),
                ErrorKind::MissingRequiredClaim(c) => {
                    format!("the ID token has no `{c}` claim")
                }
                _ => format!("the ID token does not verify: {e}"),
            })
        })?;
        let subject = data.claims.sub;
        if !subject_matches(&trust.subject, &subject) {
            return Err(refused(format!(
                "the ID token's subject `{subject}` does not match trust `{trust_name}`'s pattern `{}`",
                trust.subject
            )));
        }
        let role = Role::parse(&trust.role).ok_or_else(|| {
            Error::Corrupt(format!("trust {trust_name} has role `{}`", trust.role))
        })?;
        let id = Uuid::now_v7();
        let by: String = format!("oidc:{subject}").chars().take(512).collect();
        let audit = Audit::new(
            Principal {
                id,
                name: format!("{trust_name} ({by})"),
                role,
            },
            "POST /v1/tokens/exchange".to_owned(),
            target,
            request_id,
        );
        let token = new_token(API_TOKEN_PREFIX, rand::random());
        let mut tx = self.pool.begin().await?;
        let view: TokenView = sqlx::query_as(concat!(
            "INSERT INTO identity.tokens (id, name, role, token_sha256, created_by, expires_at, trust, subject) \
             VALUES ($1, $2, $3, $4, $5, now() + make_interval(secs => $6), $2, $7) RETURNING ",
            crate::tokens::view!()
        ))
        .bind(id)
        .bind(trust_name)
        .bind(role.as_str())
        .bind(token_sha256_hex(&token))
        .bind(&by)
        .bind(f64::from(trust.ttl_secs))
        .bind(&subject)
        .fetch_one(&mut *tx)
        .await?;
        audit::record_ok(&mut tx, SCHEMA, &audit).await?;
        tx.commit().await?;
        self.signal.notify();
        tracing::info!(token_id = %id, trust = trust_name, subject = %subject, role = %role, expires_at = %view.expires_at, "ID token exchanged for an API token");
        Ok(Exchanged {
            token: NewToken {
                view,
                token: Secret::new(token),
            },
            subject,
        })
    }

    /// The key `kid` of `issuer`: from the cache while it is fresh, else
    /// fetched (discovery document, then its `jwks_uri`), and fetched again
    /// for an unknown key id at most every [`REFETCH_AT_MOST_EVERY`].
    async fn issuer_key(&self, issuer: &str, kid: &str) -> Result<jsonwebtoken::jwk::Jwk, Error> {
        let mut cache = self.issuer_keys.lock().await;
        if let Some(c) = cache.get(issuer) {
            let fresh = c.fetched.elapsed() < KEYS_FRESH_FOR;
            if let Some(k) = c.keys.find(kid).filter(|_| fresh) {
                return Ok(k.clone());
            }
            if fresh && c.fetched.elapsed() < REFETCH_AT_MOST_EVERY {
                return Err(unknown_kid(kid, issuer));
            }
        }
        let keys = self.fetch_keys(issuer).await?;
        let found = keys.find(kid).cloned();
        cache.insert(
            issuer.to_owned(),
            CachedKeys {
                keys,
                fetched: Instant::now(),
            },
        );
        found.ok_or_else(|| unknown_kid(kid, issuer))
    }

    async fn fetch_keys(&self, issuer: &str) -> Result<JwkSet, Error> {
        let unavailable = |what: &str, e: String| {
            Error::IssuerUnavailable(format!("{what} of issuer `{issuer}`: {e}"))
        };
        let discovery = format!(
            "{}/.well-known/openid-configuration",
            issuer.trim_end_matches('/')
        );
        let doc = self
            .issuer_fetch
            .get(&discovery)
            .await
            .map_err(|e| unavailable("the discovery document", e))?;
        let doc: serde_json::Value = serde_json::from_slice(&doc)
            .map_err(|e| unavailable("the discovery document", e.to_string()))?;
        if doc["issuer"].as_str() != Some(issuer) {
            return Err(unavailable(
                "the discovery document",
                format!("names issuer {}, not this one", doc["issuer"]),
            ));
        }
        let jwks_uri = doc["jwks_uri"]
            .as_str()
            .ok_or_else(|| unavailable("the discovery document", "no `jwks_uri`".into()))?;
        validate_issuer(jwks_uri).map_err(|_| {
            unavailable(
                "the discovery document",
                format!("jwks_uri `{jwks_uri}` is not https"),
            )
        })?;
        let set = self
            .issuer_fetch
            .get(jwks_uri)
            .await
            .map_err(|e| unavailable("the key set", e))?;
        let set: JwkSet =
            serde_json::from_slice(&set).map_err(|e| unavailable("the key set", e.to_string()))?;
        tracing::info!(
            issuer,
            keys = set.keys.len(),
            "fetched an OIDC issuer's keys"
        );
        Ok(set)
    }
}

fn unknown_kid(kid: &str, issuer: &str) -> Error {
    refused(format!(
        "the ID token's key `{kid}` is not in the key set of issuer `{issuer}`"
    ))
}

/// Revoke the live tokens trust `name` gave; how many.
async fn revoke_given(tx: &mut sqlx::PgConnection, name: &str) -> Result<u64, Error> {
    Ok(sqlx::query(
        "UPDATE identity.tokens SET revoked_at = now() WHERE trust = $1 AND revoked_at IS NULL",
    )
    .bind(name)
    .execute(&mut *tx)
    .await?
    .rows_affected())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_match_their_pattern() {
        let p = "repo:acme/app:ref:refs/heads/*";
        assert!(subject_matches(p, "repo:acme/app:ref:refs/heads/main"));
        assert!(subject_matches(p, "repo:acme/app:ref:refs/heads/"));
        assert!(!subject_matches(p, "repo:acme/app2:ref:refs/heads/main"));
        assert!(!subject_matches(p, "repo:acme/app:pull_request"));
        assert!(subject_matches("exact", "exact"));
        assert!(!subject_matches("exact", "exactly"));
        assert!(!subject_matches("exact", "inexact"));
        assert!(subject_matches("a*b*c", "abc"));
        assert!(subject_matches("a*b*c", "a-x-b-y-c"));
        assert!(!subject_matches("a*b*c", "a-x-c-y-b"));
        assert!(!subject_matches("a*b", "a"));
        assert!(subject_matches("*:main", "repo:main"));
        assert!(!subject_matches("*:main", "repo:main2"));
    }

    #[test]
    fn a_pattern_of_stars_alone_is_refused() {
        assert!(validate_subject("*").is_err());
        assert!(validate_subject("**").is_err());
        assert!(validate_subject("").is_err());
        assert!(validate_subject("repo:acme/*").is_ok());
    }

    #[test]
    fn issuers_are_https_or_loopback_http() {
        assert!(validate_issuer("https://token.actions.githubusercontent.com").is_ok());
        assert!(validate_issuer("http://127.0.0.1:8080").is_ok());
        assert!(validate_issuer("http://localhost:8080/realm").is_ok());
        assert!(validate_issuer("http://[::1]:8080").is_ok());
        assert!(validate_issuer("http://issuer.example").is_err());
        assert!(validate_issuer("ftp://issuer.example").is_err());
        assert!(validate_issuer("https://issuer.example/?a=b").is_err());
        assert!(validate_issuer("not a url").is_err());
    }

    fn b64(v: serde_json::Value) -> String {
        URL_SAFE_NO_PAD.encode(v.to_string())
    }

    #[test]
    fn unsigned_and_other_algorithms_are_refused_before_any_key() {
        let body = b64(serde_json::json!({"iss": "https://i", "sub": "s", "exp": 1}));
        let none = format!("{}.{body}.", b64(serde_json::json!({"alg": "none"})));
        let e = unverified(&none).expect_err("alg none");
        assert!(e.to_string().contains("alg: none"), "{e}");
        let hs = format!(
            "{}.{body}.c2ln",
            b64(serde_json::json!({"alg": "HS256", "kid": "k"}))
        );
        let e = unverified(&hs).expect_err("HS256");
        assert!(e.to_string().contains("`HS256` is not accepted"), "{e}");
        let nokid = format!("{}.{body}.c2ln", b64(serde_json::json!({"alg": "ES256"})));
        let e = unverified(&nokid).expect_err("no kid");
        assert!(e.to_string().contains("kid"), "{e}");
        assert!(unverified("a.b").is_err());
        let ok = format!(
            "{}.{body}.c2ln",
            b64(serde_json::json!({"alg": "RS256", "kid": "k"}))
        );
        let u = unverified(&ok).expect("well formed");
        assert_eq!(u.kid, "k");
        assert_eq!(u.iss.as_deref(), Some("https://i"));
    }
}
