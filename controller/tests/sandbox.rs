//! Issue 30: a module runs in a box; running it as root is an admin's
//! decision. Through the API's router (the real auth layer) over a real
//! isolated environment: an operator's module with `unit.user: root` is
//! refused 403 naming why, an admin's is accepted, and both entries say the
//! module runs as root, in inventory's outbox and, once identity appended
//! them from the record, in `GET /v1/audit`.

mod common;

use common::call;

use axum::http::StatusCode;
use mesh_controller::config::{Credentials, Settings};
use mesh_controller::router::Contexts;
use mesh_plumbing::{Context, OutboxSignal, inbox};
use mesh_protocol::RecordEvent;
use mesh_testkit::TestEnv;
use serde_json::{Value, json};

#[tokio::test]
async fn a_module_as_root_is_an_admins_decision_and_audited_as_such() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let dir = tempfile::tempdir()?;
    let router = common::api_router(&env, dir.path()).await?;
    let admin = env.admin_token().to_owned();
    let (status, created) = call(
        &router,
        "POST",
        "/v1/tokens",
        &admin,
        Some(json!({"name": "deployer", "role": "operator"})),
    )
    .await?;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    let operator = created["token"].as_str().unwrap_or_default().to_owned();

    let module = json!({
        "unit": {"command": "/bin/sleep", "args": ["1000"], "user": "root",
                 "resources": {"cpu_millis": 100, "memory_bytes": 64 << 20, "pids": 64}},
        "placement": {"match_labels": {"labels": {"role": "db"}, "replicas": 1}}
    });
    let (status, problem) = call(
        &router,
        "PUT",
        "/v1/modules/db",
        &operator,
        Some(module.clone()),
    )
    .await?;
    assert_eq!(status, StatusCode::FORBIDDEN, "{problem}");
    let detail = problem["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains("runs as root") || detail.contains("run as root"),
        "{problem}"
    );
    assert!(detail.contains("admin role"), "{problem}");
    let (status, _) = call(&router, "GET", "/v1/modules/db", &operator, None).await?;
    assert_eq!(status, StatusCode::NOT_FOUND, "nothing was written");
    // The same module without root is the operator's to write.
    let mut own = module.clone();
    if let Some(unit) = own["unit"].as_object_mut() {
        unit.remove("user");
    }
    let (status, view) = call(&router, "PUT", "/v1/modules/web", &operator, Some(own)).await?;
    assert_eq!(status, StatusCode::CREATED, "{view}");

    let (status, view) = call(&router, "PUT", "/v1/modules/db", &admin, Some(module)).await?;
    assert_eq!(status, StatusCode::CREATED, "{view}");
    assert_eq!(view["unit"]["user"], "root", "{view}");
    assert_eq!(view["unit"]["resources"]["pids"], 64, "{view}");

    // The entries, as inventory wrote them to its outbox: the refusal (the
    // auth layer's, after the response) and the change (in its transaction).
    let path = dir.path().join("credentials.toml");
    let creds = Credentials::load(&path)?;
    let contexts = Contexts::connect(&creds, &Settings::default(), OutboxSignal::default()).await?;
    let payloads: Vec<Vec<u8>> = sqlx::query_scalar(
        "SELECT payload FROM inventory.outbox WHERE exchange = 'record' \
         AND routing_key = 'inventory.operator.audit' ORDER BY id",
    )
    .fetch_all(contexts.inventory.pool())
    .await?;
    let events: Vec<RecordEvent> = payloads
        .iter()
        .map(|p| RecordEvent::decode(p))
        .collect::<Result<_, _>>()?;
    let bodies: Vec<Value> = payloads
        .iter()
        .map(|p| serde_json::from_slice::<Value>(p).map(|v| v["body"].clone()))
        .collect::<Result<_, _>>()?;
    let on_db: Vec<&Value> = bodies
        .iter()
        .filter(|b| b["target"] == "/v1/modules/db")
        .collect();
    assert_eq!(on_db.len(), 2, "{bodies:?}");
    assert_eq!(
        (on_db[0]["outcome"].as_str(), on_db[0]["status"].as_u64()),
        (Some("denied"), Some(403))
    );
    assert_eq!(
        (on_db[1]["outcome"].as_str(), on_db[1]["role"].as_str()),
        (Some("ok"), Some("admin"))
    );
    for b in &on_db {
        assert_eq!(
            b["detail"], "module `db` runs as root (unit.user: root)",
            "{b}"
        );
    }
    let web: Vec<&Value> = bodies
        .iter()
        .filter(|b| b["target"] == "/v1/modules/web")
        .collect();
    assert_eq!(web.len(), 1);
    assert!(web[0].get("detail").is_none(), "{}", web[0]);

    // Identity appends them from the record, as the router hands them on;
    // the audit log shows the detail.
    let mut tx = contexts.identity.pool().begin().await?;
    let ids: Vec<_> = events.iter().map(|e| e.id).collect();
    let mut fresh = inbox::claim(&mut tx, mesh_identity::SCHEMA, &ids).await?;
    let fresh: Vec<&RecordEvent> = events.iter().filter(|e| fresh.remove(&e.id)).collect();
    contexts.identity.handle_events(&mut tx, &fresh).await?;
    tx.commit().await?;
    let (status, log) = call(
        &router,
        "GET",
        "/v1/audit?target=%2Fv1%2Fmodules%2Fdb",
        &admin,
        None,
    )
    .await?;
    assert_eq!(status, StatusCode::OK, "{log}");
    let entries = log["entries"].as_array().cloned().unwrap_or_default();
    let said: Vec<(&str, &str)> = entries
        .iter()
        .map(|e| {
            (
                e["outcome"].as_str().unwrap_or_default(),
                e["detail"].as_str().unwrap_or_default(),
            )
        })
        .collect();
    assert_eq!(
        said,
        [
            ("denied", "module `db` runs as root (unit.user: root)"),
            ("ok", "module `db` runs as root (unit.user: root)"),
        ],
        "{log}"
    );
    env.teardown().await?;
    Ok(())
}
