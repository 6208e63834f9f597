//! The API's router over a real isolated environment, as the controller
//! builds it at start (migrated contexts, the environment's admin token), for
//! the tests that call it in-process.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use chrono::{DateTime, Utc};
use mesh_controller::api::{self, ApiState};
use mesh_controller::config::{Credentials, Settings};
use mesh_controller::logs::{LogsHub, LogsSettings};
use mesh_controller::router::Contexts;
use mesh_plumbing::OutboxSignal;
use mesh_testkit::TestEnv;
use serde_json::Value;
use tower::ServiceExt;

/// The router, its credentials file written into `dir`.
pub async fn api_router(env: &TestEnv, dir: &Path) -> anyhow::Result<Router> {
    let path = dir.join("credentials.toml");
    env.write_controller_credentials(&path)?;
    let creds = Credentials::load(&path)?;
    Contexts::migrate(&creds).await?;
    let signal = OutboxSignal::default();
    let contexts = Contexts::connect(&creds, &Settings::default(), signal.clone()).await?;
    // As the controller does at start: the environment's admin token.
    if let Some(hash) = &creds.bootstrap_admin_token_sha256 {
        contexts.identity.ensure_bootstrap_admin(hash).await?;
    }
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = mesh_controller::metrics::Metrics::new(&mut registry);
    // No broker here: a logs request finds no node to ask.
    let logs = LogsHub::new(
        LogsSettings {
            wait: std::time::Duration::from_secs(1),
            max_requests: 1,
            max_nodes: 1,
        },
        Arc::new(mesh_protocol::DeclarationSigner::from_seed([1; 32])),
        metrics.clone(),
    );
    Ok(api::router(ApiState {
        logs: Arc::new(logs),
        contexts: Arc::new(contexts),
        registry: Arc::new(registry),
        broker_up: Arc::new(AtomicBool::new(true)),
        signal,
        metrics,
        queue_depths: tokio::sync::watch::channel(None).1,
    }))
}

/// One request through `router` with `token` as its bearer and `body` as its
/// JSON: the status and the answer's JSON (null when it is none).
#[allow(dead_code)]
pub async fn call(
    router: &Router,
    method: &str,
    uri: &str,
    token: &str,
    body: Option<Value>,
) -> anyhow::Result<(StatusCode, Value)> {
    let mut req = Request::builder()
        .method(method)
        .uri(uri)
        .header("authorization", format!("Bearer {token}"));
    let body = match body {
        Some(b) => {
            req = req.header("content-type", "application/json");
            Body::from(serde_json::to_vec(&b)?)
        }
        None => Body::empty(),
    };
    let resp = router.clone().oneshot(req.body(body)?).await?;
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20).await?;
    Ok((
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    ))
}

/// The instant at `key` of `v` (RFC 3339).
#[allow(dead_code)]
pub fn at(v: &Value, key: &str) -> anyhow::Result<DateTime<Utc>> {
    let text = v[key]
        .as_str()
        .ok_or_else(|| anyhow::anyhow!("no `{key}` in {v}"))?;
    Ok(DateTime::parse_from_rfc3339(text)?.with_timezone(&Utc))
}
