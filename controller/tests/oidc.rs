//! Issue 29, point 3: OIDC trust for automation (decision 0049). A local
//! issuer the test runs (its own ES256 and RS256 keys, its discovery document
//! and JWKS on loopback) signs ID tokens; the API's router over a real
//! isolated environment exchanges the valid ones for short-lived tokens of the
//! trust's role and refuses every other, with a 401 problem naming why:
//! wrong audience, expired, subject not matching, unknown key id, `alg: none`,
//! an HMAC token keyed with the public key, a forged signature, another
//! issuer. The issuer's keys are fetched once and cached.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use base64::Engine;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use chrono::Utc;
use common::{at, call};
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use mesh_testkit::TestEnv;
use ring::rand::SystemRandom;
use ring::signature::{ECDSA_P256_SHA256_FIXED_SIGNING, EcdsaKeyPair, KeyPair};
use serde_json::{Value, json};
use sqlx::postgres::PgPoolOptions;

/// A signing key of the test issuer: its JWK and how to sign with it.
struct Key {
    kid: &'static str,
    alg: Algorithm,
    encoding: EncodingKey,
    jwk: Value,
}

fn ec_key(kid: &'static str) -> anyhow::Result<Key> {
    let rng = SystemRandom::new();
    let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &rng)
        .map_err(|_| anyhow::anyhow!("no P-256 key"))?;
    let pair = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, pkcs8.as_ref(), &rng)
        .map_err(|_| anyhow::anyhow!("the P-256 key does not load"))?;
    // Uncompressed point: 0x04, x (32 bytes), y (32 bytes).
    let point = pair.public_key().as_ref();
    anyhow::ensure!(point.len() == 65, "a P-256 point is 65 bytes");
    Ok(Key {
        kid,
        alg: Algorithm::ES256,
        encoding: EncodingKey::from_ec_der(pkcs8.as_ref()),
        jwk: json!({
            "kty": "EC", "crv": "P-256", "use": "sig", "alg": "ES256", "kid": kid,
            "x": URL_SAFE_NO_PAD.encode(&point[1..33]),
            "y": URL_SAFE_NO_PAD.encode(&point[33..]),
        }),
    })
}

/// The RSA key of tests/fixtures/oidc-test-rsa.txt (ring makes no RSA keys).
fn rsa_key(kid: &'static str) -> anyhow::Result<Key> {
    let text = include_str!("fixtures/oidc-test-rsa.txt");
    let mut lines = text.lines().filter(|l| !l.starts_with('#'));
    let der = STANDARD.decode(lines.next().unwrap_or_default())?;
    let n = lines.next().unwrap_or_default();
    Ok(Key {
        kid,
        alg: Algorithm::RS256,
        encoding: EncodingKey::from_rsa_der(&der),
        jwk: json!({"kty": "RSA", "use": "sig", "alg": "RS256", "kid": kid, "n": n, "e": "AQAB"}),
    })
}

/// The test issuer: discovery document and key set on loopback, counting how
/// often its keys are fetched.
struct Issuer {
    url: String,
    jwks: Value,
    fetches: AtomicUsize,
}

async fn serve_issuer(keys: &[&Key]) -> anyhow::Result<Arc<Issuer>> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let issuer = Arc::new(Issuer {
        jwks: json!({"keys": keys.iter().map(|k| k.jwk.clone()).collect::<Vec<_>>()}),
        url,
        fetches: AtomicUsize::new(0),
    });
    let app = Router::new()
        .route(
            "/.well-known/openid-configuration",
            get(|State(i): State<Arc<Issuer>>| async move {
                axum::Json(json!({"issuer": i.url, "jwks_uri": format!("{}/jwks", i.url)}))
            }),
        )
        .route(
            "/jwks",
            get(|State(i): State<Arc<Issuer>>| async move {
                i.fetches.fetch_add(1, Ordering::SeqCst);
                axum::Json(i.jwks.clone())
            }),
        )
        .with_state(issuer.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(issuer)
}

/// An ID token signed with `key`: `claims` over a valid default (this issuer,
/// audience `mesh`, subject of main, ten minutes to live).
fn id_token(issuer: &Issuer, key: &Key, claims: Value) -> anyhow::Result<String> {
    let now = Utc::now().timestamp();
    let mut all = json!({
        "iss": issuer.url, "aud": "mesh", "sub": "repo:acme/app:ref:refs/heads/main",
        "iat": now, "exp": now + 600,
    });
    if let (Some(all), Some(over)) = (all.as_object_mut(), claims.as_object()) {
        for (k, v) in over {
            all.insert(k.clone(), v.clone());
        }
    }
    let mut header = Header::new(key.alg);
    header.kid = Some(key.kid.to_owned());
    Ok(jsonwebtoken::encode(&header, &all, &key.encoding)?)
}

/// A token in compact form from raw header and claims, signed with `sig`.
fn raw_token(header: Value, claims: Value, sig: &[u8]) -> String {
    format!(
        "{}.{}.{}",
        URL_SAFE_NO_PAD.encode(header.to_string()),
        URL_SAFE_NO_PAD.encode(claims.to_string()),
        URL_SAFE_NO_PAD.encode(sig)
    )
}

async fn exchange(
    router: &Router,
    trust: &str,
    token: &str,
) -> anyhow::Result<(StatusCode, Value)> {
    call(
        router,
        "POST",
        "/v1/tokens/exchange",
        "",
        Some(json!({"trust": trust, "id_token": token})),
    )
    .await
}

/// Asserts a 401 whose detail holds `why`.
async fn refused(router: &Router, token: &str, why: &str) -> anyhow::Result<()> {
    let (status, problem) = exchange(router, "ci", token).await?;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{why}: {problem}");
    let detail = problem["detail"].as_str().unwrap_or_default();
    assert!(detail.contains(why), "expected `{why}` in: {problem}");
    Ok(())
}

#[tokio::test]
async fn an_id_token_of_a_trusted_issuer_is_exchanged_and_every_other_refused() -> anyhow::Result<()>
{
    let env = TestEnv::new().await?;
    let dir = tempfile::tempdir()?;
    let router = common::api_router(&env, dir.path()).await?;
    let admin = env.admin_token().to_owned();
    let ec = ec_key("ec-1")?;
    let rsa = rsa_key("rsa-1")?;
    let issuer = serve_issuer(&[&ec, &rsa]).await?;

    // An admin trusts the issuer's tokens for audience `mesh` from the main
    // branches of one repository, as operators.
    let trust = json!({
        "issuer": issuer.url, "audience": "mesh",
        "subject": "repo:acme/app:ref:refs/heads/*", "role": "operator", "ttl_secs": 1800,
    });
    let (status, put) = call(&router, "PUT", "/v1/trust/ci", &admin, Some(trust.clone())).await?;
    assert_eq!(status, StatusCode::CREATED, "{put}");
    let (status, _) = call(&router, "PUT", "/v1/trust/ci", &admin, Some(trust.clone())).await?;
    assert_eq!(status, StatusCode::OK, "the same trust again replaces it");

    // What a trust may not be, each refused naming the field.
    for (field, bad) in [
        ("subject", json!({"subject": "*"})),
        ("issuer", json!({"issuer": "http://issuer.example"})),
        ("ttl_secs", json!({"ttl_secs": 7200})),
        ("audience", json!({"audience": ""})),
    ] {
        let mut body = trust.clone();
        if let (Some(b), Some(o)) = (body.as_object_mut(), bad.as_object()) {
            for (k, v) in o {
                b.insert(k.clone(), v.clone());
            }
        }
        let (status, problem) = call(&router, "PUT", "/v1/trust/bad", &admin, Some(body)).await?;
        assert_eq!(
            status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{field}: {problem}"
        );
        assert!(problem.to_string().contains(field), "{field}: {problem}");
    }

    // A valid ES256 token: an operator's token of half an hour.
    let (status, got) = exchange(&router, "ci", &id_token(&issuer, &ec, json!({}))?).await?;
    assert_eq!(status, StatusCode::CREATED, "{got}");
    assert_eq!(got["role"], "operator");
    assert_eq!(got["trust"], "ci");
    assert_eq!(got["subject"], "repo:acme/app:ref:refs/heads/main");
    let left = at(&got, "expires_at")? - Utc::now();
    assert!((1790..=1800).contains(&left.num_seconds()), "{left}");
    let secret = got["token"].as_str().unwrap_or_default().to_owned();
    let exchanged_id = got["id"].as_str().unwrap_or_default().to_owned();
    let (status, _) = call(&router, "GET", "/v1/nodes", &secret, None).await?;
    assert_eq!(status, StatusCode::OK, "the token works");
    let (status, _) = call(&router, "GET", "/v1/tokens", &secret, None).await?;
    assert_eq!(
        status,
        StatusCode::FORBIDDEN,
        "with the trust's role, no more"
    );

    // A valid RS256 token too.
    let (status, got) = exchange(&router, "ci", &id_token(&issuer, &rsa, json!({}))?).await?;
    assert_eq!(status, StatusCode::CREATED, "{got}");

    // Every bad token is refused, naming why.
    refused(
        &router,
        &id_token(&issuer, &ec, json!({"aud": "other"}))?,
        "audience is not `mesh`",
    )
    .await?;
    let long_ago = Utc::now().timestamp() - 3600;
    refused(
        &router,
        &id_token(
            &issuer,
            &ec,
            json!({"iat": long_ago - 600, "exp": long_ago}),
        )?,
        "expired at",
    )
    .await?;
    refused(
        &router,
        &id_token(&issuer, &ec, json!({"sub": "repo:acme/app:pull_request"}))?,
        "does not match trust `ci`'s pattern",
    )
    .await?;
    refused(
        &router,
        &id_token(
            &issuer,
            &ec,
            json!({"sub": "repo:evil/app:ref:refs/heads/main"}),
        )?,
        "does not match",
    )
    .await?;
    let stranger = ec_key("ec-unknown")?;
    refused(
        &router,
        &id_token(&issuer, &stranger, json!({}))?,
        "key `ec-unknown` is not in the key set",
    )
    .await?;
    // A key of another issuer under a known key id: the signature fails.
    let forged = ec_key("ec-1")?;
    refused(
        &router,
        &id_token(&issuer, &forged, json!({}))?,
        "signature does not verify",
    )
    .await?;
    let claims = json!({
        "iss": issuer.url, "aud": "mesh", "sub": "repo:acme/app:ref:refs/heads/main",
        "exp": Utc::now().timestamp() + 600,
    });
    refused(
        &router,
        &raw_token(json!({"alg": "none"}), claims.clone(), b""),
        "alg: none",
    )
    .await?;
    refused(
        &router,
        &raw_token(json!({"alg": "none", "kid": "ec-1"}), claims.clone(), b"x"),
        "alg: none",
    )
    .await?;
    // HMAC keyed with what an attacker knows (the public key) is refused
    // before any key is looked at.
    let hs = jsonwebtoken::encode(
        &Header {
            kid: Some("rsa-1".into()),
            ..Header::new(Algorithm::HS256)
        },
        &claims,
        &EncodingKey::from_secret(rsa.jwk["n"].as_str().unwrap_or_default().as_bytes()),
    )?;
    refused(&router, &hs, "`HS256` is not accepted").await?;
    refused(
        &router,
        &id_token(&issuer, &ec, json!({"iss": "https://elsewhere.example"}))?,
        "issued by `https://elsewhere.example`",
    )
    .await?;
    refused(&router, "not-a-jwt", "compact form").await?;
    let (status, problem) =
        exchange(&router, "nosuch", &id_token(&issuer, &ec, json!({}))?).await?;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{problem}");
    assert!(
        problem.to_string().contains("no trust `nosuch`"),
        "{problem}"
    );

    // The issuer's keys were fetched once: cached, and a made-up key id
    // does not make them be fetched again within the refetch interval.
    assert_eq!(issuer.fetches.load(Ordering::SeqCst), 1, "key set fetches");

    // An exchanged token is not rotated into a long-lived one.
    let (status, problem) = call(
        &router,
        "POST",
        &format!("/v1/tokens/{exchanged_id}/rotate"),
        &admin,
        None,
    )
    .await?;
    assert_eq!(status, StatusCode::CONFLICT, "{problem}");

    // The exchange's audit entry names the subject (identity's outbox, bound
    // for the record and the audit log).
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect(&env.database_url("identity"))
        .await?;
    let audited: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM identity.outbox WHERE convert_from(payload, 'UTF8') LIKE $1",
    )
    .bind("%POST /v1/tokens/exchange%oidc:repo:acme/app:ref:refs/heads/main%")
    .fetch_one(&pool)
    .await?;
    assert!(audited >= 2, "audit entries of the exchanges: {audited}");

    // A trust whose issuer cannot be reached: 503, nothing exchanged.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0")?;
        l.local_addr()?
    };
    let mut down = trust.clone();
    down["issuer"] = json!(format!("http://{closed}"));
    let (status, _) = call(&router, "PUT", "/v1/trust/down", &admin, Some(down)).await?;
    assert_eq!(status, StatusCode::CREATED);
    let mut claims_down = claims.clone();
    claims_down["iss"] = json!(format!("http://{closed}"));
    let token = jsonwebtoken::encode(
        &Header {
            kid: Some("ec-1".into()),
            ..Header::new(Algorithm::ES256)
        },
        &claims_down,
        &ec.encoding,
    )?;
    let (status, problem) = exchange(&router, "down", &token).await?;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{problem}");

    // Deleting the trust revokes what it gave.
    let (status, _) = call(&router, "DELETE", "/v1/trust/ci", &admin, None).await?;
    assert_eq!(status, StatusCode::OK);
    let (status, problem) = call(&router, "GET", "/v1/nodes", &secret, None).await?;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{problem}");
    let (status, _) = exchange(&router, "ci", &id_token(&issuer, &ec, json!({}))?).await?;
    assert_eq!(status, StatusCode::UNAUTHORIZED);

    // Only admins manage trust.
    let (status, op) = call(
        &router,
        "POST",
        "/v1/tokens",
        &admin,
        Some(json!({"name": "op", "role": "operator"})),
    )
    .await?;
    assert_eq!(status, StatusCode::CREATED, "{op}");
    let op = op["token"].as_str().unwrap_or_default();
    let (status, _) = call(&router, "PUT", "/v1/trust/ci", op, Some(trust)).await?;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let (status, _) = call(&router, "GET", "/v1/trust", op, None).await?;
    assert_eq!(status, StatusCode::FORBIDDEN);
    pool.close().await;
    env.teardown().await
}
