//! The provisioning context against a real PostgreSQL, one fresh database
//! per test: grants follow requirements, credentials are sealed for config,
//! provider nodes get their section and report back, revoked grants age out.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use base64::Engine as _;
use mesh_plumbing::{Context, OutboxSignal};
use mesh_protocol::{
    AdminAccess, AdminServer, CredentialsIssued, DeclarationItems, Envelope, FleetConditions,
    ModulePlacement, ModuleRemoved, NodeId, Provides, RecordEvent, RecordKind, Report, Requirement,
    ResourceItem, ResourceKind, ResourceState, ResourceStatus, ResourceStatusState, Resources,
};
use mesh_provisioning::{Provisioning, SECTIONS, Settings};
use mesh_testkit::TestEnv;
use serde_json::Value;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tower::ServiceExt;
use uuid::Uuid;

struct Fixture {
    env: TestEnv,
    pool: PgPool,
    prov: Arc<Provisioning>,
}

async fn setup_with(keyring: bool) -> Fixture {
    let env = TestEnv::new().await.unwrap();
    let url = env.database_url("provisioning");
    mesh_provisioning::migrate(&url).await.unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .unwrap();
    let settings = Settings {
        master_keys_file: keyring.then(|| env.master_keys_path()),
        ..Settings::default()
    };
    let prov = Arc::new(Provisioning::new(
        pool.clone(),
        OutboxSignal::default(),
        settings,
    ));
    Fixture { env, pool, prov }
}

async fn setup() -> Fixture {
    setup_with(true).await
}

fn node(f: &Fixture, suffix: &str) -> NodeId {
    NodeId::parse(&format!("{}-{suffix}", f.env.id())).unwrap()
}

fn pg_provides() -> Provides {
    Provides {
        kind: ResourceKind::PostgresDatabase,
        host: "10.0.0.2".into(),
        port: 5433,
        admin: AdminAccess {
            server: AdminServer::Postgres,
            socket_dir: Some("/run/pg".into()),
            user: None,
            node: None,
            home: None,
            config: None,
        },
    }
}

fn db(name: &str) -> Requirement {
    Requirement {
        kind: ResourceKind::PostgresDatabase,
        name: name.into(),
        options: [("encoding".to_owned(), "UTF8".to_owned())].into(),
        provider: None,
        delete: false,
    }
}

async fn events(f: &Fixture, events: &[RecordEvent]) {
    let refs: Vec<&RecordEvent> = events.iter().collect();
    let mut tx = f.pool.begin().await.unwrap();
    f.prov.handle_events(&mut tx, &refs).await.unwrap();
    tx.commit().await.unwrap();
}

async fn placed(
    f: &Fixture,
    module: &str,
    version: i64,
    nodes: &[&NodeId],
    requires: Vec<Requirement>,
    provides: Vec<Provides>,
) {
    let mut nodes: Vec<NodeId> = nodes.iter().map(|n| (*n).clone()).collect();
    nodes.sort();
    events(
        f,
        &[RecordEvent::new(RecordKind::ModulePlaced(
            ModulePlacement {
                module: module.into(),
                version,
                nodes,
                settings_files: Vec::new(),
                ports: Vec::new(),
                requires,
                provides,
            },
        ))],
    )
    .await;
}

async fn removed(f: &Fixture, module: &str, version: i64) {
    events(
        f,
        &[RecordEvent::new(RecordKind::ModuleRemoved(ModuleRemoved {
            module: module.into(),
            version,
        }))],
    )
    .await;
}

fn status(grant: Uuid, state: ResourceStatusState, version: Option<i64>) -> ResourceStatus {
    ResourceStatus {
        grant,
        state,
        credential_version: version,
        reason: None,
        recreated: false,
    }
}

async fn report(f: &Fixture, node: &NodeId, resources: Vec<ResourceStatus>) {
    let env = Envelope::new(
        node.clone(),
        1,
        Report::Resources(Resources {
            generation: 1,
            resources,
        }),
    );
    let mut tx = f.pool.begin().await.unwrap();
    f.prov.handle_reports(&mut tx, &[env]).await.unwrap();
    tx.commit().await.unwrap();
}

async fn get(f: &Fixture, uri: &str) -> (StatusCode, Value) {
    let response = f
        .prov
        .clone()
        .routes()
        .split_for_parts()
        .0
        .oneshot(Request::get(uri).body(Body::empty()).unwrap())
        .await
        .unwrap();
    let status = response.status();
    if status.is_client_error() {
        assert_eq!(
            response.headers()["content-type"],
            "application/problem+json",
            "{uri}"
        );
    }
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .unwrap();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

async fn grants(f: &Fixture) -> Vec<Value> {
    let (status, body) = get(f, "/v1/grants").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    body["grants"].as_array().unwrap().clone()
}

async fn only_grant(f: &Fixture) -> Value {
    let all = grants(f).await;
    assert_eq!(all.len(), 1, "{all:?}");
    all[0].clone()
}

/// Record events in the outbox after row `after`.
async fn record(f: &Fixture, after: i64) -> Vec<RecordEvent> {
    let rows: Vec<Vec<u8>> = sqlx::query_scalar(
        "SELECT payload FROM provisioning.outbox WHERE id > $1 AND exchange = 'record' ORDER BY id",
    )
    .bind(after)
    .fetch_all(&f.pool)
    .await
    .unwrap();
    rows.iter()
        .map(|p| RecordEvent::decode(p).unwrap())
        .collect()
}

async fn last_id(f: &Fixture) -> i64 {
    sqlx::query_scalar("SELECT coalesce(max(id), 0) FROM provisioning.outbox")
        .fetch_one(&f.pool)
        .await
        .unwrap()
}

fn issued(events: &[RecordEvent]) -> Vec<&CredentialsIssued> {
    events
        .iter()
        .filter_map(|e| match &e.kind {
            RecordKind::CredentialsIssued(b) => Some(b),
            _ => None,
        })
        .collect()
}

fn withdrawn(events: &[RecordEvent]) -> Vec<Uuid> {
    events
        .iter()
        .filter_map(|e| match &e.kind {
            RecordKind::CredentialsWithdrawn(b) => Some(b.grant),
            _ => None,
        })
        .collect()
}

fn conditions(events: &[RecordEvent]) -> Vec<&FleetConditions> {
    events
        .iter()
        .filter_map(|e| match &e.kind {
            RecordKind::GrantConditions(b) => Some(b),
            _ => None,
        })
        .collect()
}

/// Open an issued credential exactly as config's provisioned.rs does.
fn open(f: &Fixture, c: &CredentialsIssued) -> String {
    let b64 = base64::engine::general_purpose::STANDARD;
    let keys = mesh_credentials::MasterKeys::load(&f.env.master_keys_path()).unwrap();
    let master = keys.get(&c.key_id).unwrap().bytes();
    let dk = mesh_credentials::crypt::unwrap_key(
        &master,
        &c.secret,
        &b64.decode(&c.wrapped_key).unwrap(),
    )
    .unwrap();
    let text = mesh_credentials::crypt::decrypt_value(
        &dk,
        &c.secret,
        c.version,
        &b64.decode(&c.ciphertext).unwrap(),
    )
    .unwrap();
    String::from_utf8(text).unwrap()
}

fn value_of<'a>(file: &'a str, key: &str) -> &'a str {
    file.lines()
        .find_map(|l| l.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("no {key} in the file"))
}

async fn section(f: &Fixture, n: &NodeId) -> Option<(i64, DeclarationItems)> {
    SECTIONS
        .stored(&f.pool, n)
        .await
        .unwrap()
        .map(|s| (s.generation, s.items))
}

async fn resources_of(f: &Fixture, n: &NodeId) -> Vec<ResourceItem> {
    section(f, n)
        .await
        .map(|s| s.1.resources)
        .unwrap_or_default()
}

/// Everything the schema holds, as text.
async fn dump(f: &Fixture) -> String {
    let mut out = String::new();
    for table in ["grants", "statuses", "modules", "sections", "conditions"] {
        let rows: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT t::text FROM provisioning.{table} t"
        )))
        .fetch_all(&f.pool)
        .await
        .unwrap();
        out.push_str(&rows.join("\n"));
    }
    let payloads: Vec<Vec<u8>> = sqlx::query_scalar("SELECT payload FROM provisioning.outbox")
        .fetch_all(&f.pool)
        .await
        .unwrap();
    for p in payloads {
        out.push_str(&String::from_utf8_lossy(&p));
    }
    out
}

async fn resync(f: &Fixture) {
    f.prov.resync().await.unwrap();
}

#[tokio::test]
async fn a_grant_is_issued_sealed_for_config_and_declared_to_the_providers_nodes_only() {
    let f = setup().await;
    let (a, b) = (node(&f, "a"), node(&f, "b"));
    let before = last_id(&f).await;
    placed(&f, "pg", 1, &[&b], vec![], vec![pg_provides()]).await;
    placed(&f, "app", 1, &[&a], vec![db("db")], vec![]).await;

    let g = only_grant(&f).await;
    let id: Uuid = g["id"].as_str().unwrap().parse().unwrap();
    assert_eq!(g["consumer"], "app");
    assert_eq!(g["requirement"], "db");
    assert_eq!(g["kind"], "postgres.database");
    assert_eq!(g["provider"], "pg");
    assert_eq!(g["resource"], "app-db");
    assert_eq!(g["user"], "app-db");
    assert_eq!(g["options"]["encoding"], "UTF8");
    assert_eq!(g["delete"], false);
    assert_eq!(g["state"], "provisioning", "{g}");
    assert_eq!(g["credential_version"], 1);
    assert_eq!(g["credential_file"], "/modules/app/secrets/grant-db.env");
    assert_eq!(g["consumer_nodes"], serde_json::json!([a.as_str()]));
    assert!(g["revoked_at"].is_null() && g["retain_until"].is_null());

    // The credential: sealed under the master key, for the consumer's file
    // and the provider's copy, opening as config opens it.
    let told = record(&f, before).await;
    let issued = issued(&told);
    assert_eq!(issued.len(), 1);
    let c = issued[0];
    assert_eq!(c.grant, id);
    assert_eq!(c.secret, format!("grant-{}", id.simple()));
    assert_eq!(c.version, 1);
    let files: Vec<(&str, &str)> = c
        .files
        .iter()
        .map(|x| (x.module.as_str(), x.file.as_str()))
        .collect();
    let provider_file = format!("grant-{}.env", id.simple());
    assert_eq!(
        files,
        [("app", "grant-db.env"), ("pg", provider_file.as_str())]
    );
    let file = open(&f, c);
    assert_eq!(value_of(&file, "PGDATABASE"), "app-db");
    assert_eq!(value_of(&file, "PGUSER"), "app-db");
    assert_eq!(value_of(&file, "PGHOST"), "10.0.0.2");
    assert_eq!(value_of(&file, "MESH_CREDENTIAL_VERSION"), "1");
    let password = value_of(&file, "PGPASSWORD").to_owned();
    assert_eq!(password.len(), 64);
    assert!(conditions(&told).is_empty(), "nothing waits: {told:?}");

    // The provider's node is told what to make; the consumer's is told nothing.
    let items = resources_of(&f, &b).await;
    assert_eq!(items.len(), 1);
    let item = &items[0];
    assert_eq!(item.grant, id);
    assert_eq!(item.name, "app-db");
    assert_eq!(item.user, "app-db");
    assert_eq!(item.state, ResourceState::Present);
    assert_eq!(item.port, 5433);
    assert_eq!(item.admin, pg_provides().admin);
    assert_eq!(
        item.options,
        BTreeMap::from([("encoding".into(), "UTF8".into())])
    );
    assert_eq!(
        item.credential.as_deref(),
        Some(format!("/modules/pg/secrets/{provider_file}").as_str())
    );
    assert_eq!(item.credential_version, 1);
    item.validate("item").unwrap();
    assert!(section(&f, &a).await.is_none());

    // The consumer's node cannot speak for the provider's grant.
    let mut lie = status(id, ResourceStatusState::Failed, None);
    lie.reason = Some("lies".into());
    report(&f, &a, vec![lie]).await;
    assert_eq!(only_grant(&f).await["state"], "provisioning");
    assert!(
        only_grant(&f).await["provider_nodes"]
            .as_array()
            .unwrap()
            .is_empty()
    );

    // The provider's node reports it ready at the current version: ready.
    report(
        &f,
        &b,
        vec![status(id, ResourceStatusState::Ready, Some(1))],
    )
    .await;
    let g = only_grant(&f).await;
    assert_eq!(g["state"], "ready", "{g}");
    assert!(g["reason"].is_null());
    let pn = &g["provider_nodes"][0];
    assert_eq!(pn["node"], b.as_str());
    assert_eq!(pn["state"], "ready");
    assert_eq!(pn["credential_version"], 1);
    let (status_one, one) = get(&f, &format!("/v1/grants/{id}")).await;
    assert_eq!(status_one, StatusCode::OK);
    assert_eq!(one, g);

    // The password is nowhere: not in the schema, the outbox, nor the API.
    assert!(!dump(&f).await.contains(&password));
    assert!(!g.to_string().contains(&password));

    // A heartbeat of the provider node behind its section is caught up.
    let generation = section(&f, &b).await.unwrap().0;
    let hb = Envelope::new(
        b.clone(),
        2,
        Report::Heartbeat(mesh_protocol::Heartbeat {
            interval_ms: None,
            applied: [(mesh_protocol::Section::Provisioning, 0)].into(),
        }),
    );
    let mark = last_id(&f).await;
    let mut tx = f.pool.begin().await.unwrap();
    sqlx::query("UPDATE provisioning.sections SET last_sent_at = now() - interval '1 hour'")
        .execute(&mut *tx)
        .await
        .unwrap();
    f.prov.handle_reports(&mut tx, &[hb]).await.unwrap();
    tx.commit().await.unwrap();
    let resent: i64 =
        sqlx::query_scalar("SELECT count(*) FROM provisioning.outbox WHERE id > $1 AND node = $2")
            .bind(mark)
            .bind(b.as_str())
            .fetch_one(&f.pool)
            .await
            .unwrap();
    assert_eq!(resent, 1);
    assert_eq!(section(&f, &b).await.unwrap().0, generation);

    // A resync changes nothing.
    let mark = last_id(&f).await;
    let r = f.prov.resync().await.unwrap();
    assert_eq!(r.declared, 0);
    assert!(record(&f, mark).await.is_empty());
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn grants_wait_fail_and_rotate_once_when_recreated_and_tell_their_conditions() {
    let f = setup().await;
    let (a, b) = (node(&f, "a"), node(&f, "b"));
    // No provider: the grant waits, saying why, and the condition is told.
    let mark = last_id(&f).await;
    placed(&f, "app", 1, &[&a], vec![db("db")], vec![]).await;
    let g = only_grant(&f).await;
    let id: Uuid = g["id"].as_str().unwrap().parse().unwrap();
    assert_eq!(g["state"], "requested");
    assert_eq!(g["reason"], "no module provides postgres.database");
    assert!(g["provider"].is_null() && g["user"].is_null());
    assert_eq!(g["credential_version"], 0);
    let told = record(&f, mark).await;
    assert!(issued(&told).is_empty());
    let c = conditions(&told);
    assert_eq!(c.len(), 1);
    assert_eq!(c[0].conditions.len(), 1);
    let cond = &c[0].conditions[0];
    assert_eq!(cond.key, format!("grant:{id}"));
    assert_eq!(cond.kind, "grant_waiting");
    assert_eq!(cond.module.as_deref(), Some("app"));
    assert!(
        cond.message.contains("no module provides"),
        "{}",
        cond.message
    );
    let v1 = c[0].version;
    // Told once: the same set is not told again.
    let mark = last_id(&f).await;
    resync(&f).await;
    assert!(conditions(&record(&f, mark).await).is_empty());

    // A provider appears: the same grant is served, the condition resolves.
    let mark = last_id(&f).await;
    placed(&f, "pg", 1, &[&b], vec![], vec![pg_provides()]).await;
    let g = only_grant(&f).await;
    assert_eq!(g["id"], id.to_string());
    assert_eq!(g["state"], "provisioning");
    let told = record(&f, mark).await;
    assert_eq!(issued(&told).len(), 1);
    let c = conditions(&told);
    assert_eq!(c.len(), 1);
    assert!(c[0].conditions.is_empty() && c[0].version > v1);

    // The server refuses: failed, with its words, and the condition.
    let mark = last_id(&f).await;
    let mut refused = status(id, ResourceStatusState::Failed, None);
    refused.reason = Some("ERROR:  invalid locale name: \"xx\"".into());
    report(&f, &b, vec![refused]).await;
    let g = only_grant(&f).await;
    assert_eq!(g["state"], "failed");
    assert_eq!(g["reason"], "ERROR:  invalid locale name: \"xx\"");
    let c = conditions(&record(&f, mark).await)
        .into_iter()
        .cloned()
        .collect::<Vec<_>>();
    assert_eq!(c.len(), 1);
    assert_eq!(c[0].conditions[0].kind, "grant_failed");
    assert!(c[0].conditions[0].message.contains("invalid locale"));
    let (_, failed) = get(&f, "/v1/grants?state=failed").await;
    assert_eq!(failed["grants"].as_array().unwrap().len(), 1);

    // The server is down: the grant waits (a condition), with the agent's words.
    let mut down = status(id, ResourceStatusState::Waiting, None);
    down.reason = Some("psql: connection refused".into());
    report(&f, &b, vec![down]).await;
    let g = only_grant(&f).await;
    assert_eq!(g["state"], "provisioning");
    assert!(g["reason"].as_str().unwrap().contains("connection refused"));

    // Ready: every condition is over.
    let mark = last_id(&f).await;
    report(
        &f,
        &b,
        vec![status(id, ResourceStatusState::Ready, Some(1))],
    )
    .await;
    assert_eq!(only_grant(&f).await["state"], "ready");
    let c = conditions(&record(&f, mark).await)
        .into_iter()
        .cloned()
        .collect::<Vec<_>>();
    assert_eq!(c.len(), 1);
    assert!(c[0].conditions.is_empty());

    // The provider lost the resource and made it again: the credential
    // rotates, once, however often the report is repeated.
    let mark = last_id(&f).await;
    let mut again = status(id, ResourceStatusState::Ready, Some(1));
    again.recreated = true;
    report(&f, &b, vec![again.clone()]).await;
    report(&f, &b, vec![again.clone(), again.clone()]).await;
    let told = record(&f, mark).await;
    let rotated = issued(&told);
    assert_eq!(rotated.len(), 1, "{told:?}");
    assert_eq!(rotated[0].version, 2);
    let file = open(&f, rotated[0]);
    assert_eq!(value_of(&file, "MESH_CREDENTIAL_VERSION"), "2");
    let g = only_grant(&f).await;
    assert_eq!(g["credential_version"], 2);
    assert_eq!(g["state"], "provisioning", "ready only at the new version");
    assert_eq!(resources_of(&f, &b).await[0].credential_version, 2);
    report(
        &f,
        &b,
        vec![status(id, ResourceStatusState::Ready, Some(2))],
    )
    .await;
    assert_eq!(only_grant(&f).await["state"], "ready");
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn revoked_grants_keep_their_data_for_the_retention_are_taken_up_again_then_deleted() {
    let f = setup().await;
    let (a, b) = (node(&f, "a"), node(&f, "b"));
    placed(&f, "pg", 1, &[&b], vec![], vec![pg_provides()]).await;
    placed(&f, "app", 1, &[&a], vec![db("db")], vec![]).await;
    let id: Uuid = only_grant(&f).await["id"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    report(
        &f,
        &b,
        vec![status(id, ResourceStatusState::Ready, Some(1))],
    )
    .await;

    // The requirement goes: revoked, the credential withdrawn, the data kept.
    let mark = last_id(&f).await;
    placed(&f, "app", 2, &[&a], vec![], vec![]).await;
    let g = only_grant(&f).await;
    assert_eq!(g["state"], "revoked");
    assert_eq!(g["reason"], "module `app` no longer requires `db`");
    let revoked_at: chrono::DateTime<chrono::Utc> =
        g["revoked_at"].as_str().unwrap().parse().unwrap();
    let retain: chrono::DateTime<chrono::Utc> =
        g["retain_until"].as_str().unwrap().parse().unwrap();
    assert_eq!((retain - revoked_at).num_seconds(), 7 * 24 * 3600);
    assert_eq!(withdrawn(&record(&f, mark).await), [id]);
    let item = &resources_of(&f, &b).await[0];
    assert_eq!(item.state, ResourceState::Revoked);
    assert!(item.credential.is_none());
    item.validate("item").unwrap();
    let (_, list) = get(&f, "/v1/grants?state=revoked").await;
    assert_eq!(list["grants"].as_array().unwrap().len(), 1);

    // Asked again within the retention: the same grant, a new credential.
    let mark = last_id(&f).await;
    placed(&f, "app", 3, &[&a], vec![db("db")], vec![]).await;
    let g = only_grant(&f).await;
    assert_eq!(g["id"], id.to_string());
    assert_eq!(g["state"], "provisioning");
    assert!(g["revoked_at"].is_null());
    assert_eq!(g["credential_version"], 2);
    assert_eq!(issued(&record(&f, mark).await)[0].version, 2);
    assert_eq!(resources_of(&f, &b).await[0].state, ResourceState::Present);

    // The consumer goes; once the retention has passed, the data is deleted
    // and the grant forgotten when the provider says it is gone.
    let mark = last_id(&f).await;
    removed(&f, "app", 4).await;
    let g = only_grant(&f).await;
    assert_eq!(g["reason"], "module `app` was removed");
    assert_eq!(withdrawn(&record(&f, mark).await), [id]);
    sqlx::query("UPDATE provisioning.grants SET retain_until = now() - interval '1 second'")
        .execute(&f.pool)
        .await
        .unwrap();
    resync(&f).await;
    assert_eq!(resources_of(&f, &b).await[0].state, ResourceState::Deleted);
    assert_eq!(only_grant(&f).await["state"], "revoked");
    report(&f, &b, vec![status(id, ResourceStatusState::Deleted, None)]).await;
    assert!(grants(&f).await.is_empty());
    let (generation, items) = section(&f, &b).await.unwrap();
    assert!(items.resources.is_empty() && generation > 1);

    // `delete: true`: deleted at once on revocation.
    let mut gone = db("tmp");
    gone.delete = true;
    placed(&f, "app", 5, &[&a], vec![gone], vec![]).await;
    let id2: Uuid = only_grant(&f).await["id"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_ne!(id2, id);
    assert_eq!(only_grant(&f).await["delete"], true);
    placed(&f, "app", 6, &[&a], vec![], vec![]).await;
    let g = only_grant(&f).await;
    assert_eq!(g["state"], "revoked");
    assert_eq!(g["retain_until"], g["revoked_at"]);
    assert_eq!(resources_of(&f, &b).await[0].state, ResourceState::Deleted);
    report(
        &f,
        &b,
        vec![status(id2, ResourceStatusState::Deleted, None)],
    )
    .await;
    assert!(grants(&f).await.is_empty());

    // A provider that stops providing the kind: its grant is revoked and
    // the requirement waits again.
    placed(&f, "app", 7, &[&a], vec![db("db")], vec![]).await;
    let first: Uuid = only_grant(&f).await["id"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    placed(&f, "pg", 2, &[&b], vec![], vec![]).await;
    let all = grants(&f).await;
    assert_eq!(all.len(), 2, "{all:?}");
    let old = all.iter().find(|g| g["id"] == first.to_string()).unwrap();
    assert_eq!(old["state"], "revoked");
    assert_eq!(
        old["reason"],
        "module `pg` no longer provides postgres.database"
    );
    let new = all.iter().find(|g| g["id"] != first.to_string()).unwrap();
    assert_eq!(new["state"], "requested");
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn without_a_master_keyring_grants_wait_saying_so_and_are_issued_once_there_is_one() {
    let f = setup_with(false).await;
    let (a, b) = (node(&f, "a"), node(&f, "b"));
    let mark = last_id(&f).await;
    placed(&f, "pg", 1, &[&b], vec![], vec![pg_provides()]).await;
    placed(&f, "app", 1, &[&a], vec![db("db")], vec![]).await;
    let g = only_grant(&f).await;
    assert_eq!(g["state"], "requested");
    assert_eq!(g["provider"], "pg");
    assert!(
        g["reason"].as_str().unwrap().contains("master keyring"),
        "{g}"
    );
    let told = record(&f, mark).await;
    assert!(issued(&told).is_empty());
    assert_eq!(conditions(&told)[0].conditions[0].kind, "grant_waiting");
    assert!(
        section(&f, &b).await.is_none(),
        "nothing to make without a credential"
    );

    // The same schema, a controller with a keyring: the resync issues it.
    let with = Provisioning::new(
        f.pool.clone(),
        OutboxSignal::default(),
        Settings {
            master_keys_file: Some(f.env.master_keys_path()),
            ..Settings::default()
        },
    );
    let mark = last_id(&f).await;
    with.resync().await.unwrap();
    assert_eq!(issued(&record(&f, mark).await).len(), 1);
    assert_eq!(only_grant(&f).await["state"], "provisioning");
    assert_eq!(resources_of(&f, &b).await.len(), 1);
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn the_api_pages_filters_and_names_the_field_at_fault() {
    let f = setup().await;
    let (a, b) = (node(&f, "a"), node(&f, "b"));
    placed(&f, "pg", 1, &[&b], vec![], vec![pg_provides()]).await;
    placed(&f, "app", 1, &[&a], vec![db("one"), db("two")], vec![]).await;
    placed(&f, "web", 1, &[&a], vec![db("three")], vec![]).await;

    let (status, page) = get(&f, "/v1/grants?limit=2").await;
    assert_eq!(status, StatusCode::OK);
    let names: Vec<&str> = page["grants"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["requirement"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["one", "two"]);
    let next = page["next"].as_str().unwrap();
    let (_, page) = get(&f, &format!("/v1/grants?limit=2&after={next}")).await;
    assert_eq!(page["grants"][0]["requirement"], "three");
    assert!(page.get("next").is_none());

    for (query, n) in [
        ("module=pg", 3),
        ("module=web", 1),
        ("module=nobody", 0),
        ("resource=app-two", 1),
        ("kind=postgres.database", 3),
        ("kind=s3.bucket", 0),
        ("state=provisioning", 3),
        ("state=ready", 0),
    ] {
        let (status, body) = get(&f, &format!("/v1/grants?{query}")).await;
        assert_eq!(status, StatusCode::OK, "{query}: {body}");
        assert_eq!(body["grants"].as_array().unwrap().len(), n, "{query}");
    }

    for (uri, status, field) in [
        ("/v1/grants?bogus=1", StatusCode::BAD_REQUEST, None),
        (
            "/v1/grants?kind=mysql",
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("kind"),
        ),
        (
            "/v1/grants?state=gone",
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("state"),
        ),
        (
            "/v1/grants?limit=0",
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("limit"),
        ),
        (
            "/v1/grants?limit=501",
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("limit"),
        ),
        (
            "/v1/grants?after=x",
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("after"),
        ),
        (
            "/v1/grants?after=0193a9a0-0000-7000-8000-000000000000",
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("after"),
        ),
        (
            "/v1/grants?module=Bad_Name",
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("module"),
        ),
        (
            "/v1/grants/not-a-uuid",
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("id"),
        ),
        (
            "/v1/grants/0193a9a0-0000-7000-8000-000000000000",
            StatusCode::NOT_FOUND,
            None,
        ),
    ] {
        let (got, body) = get(&f, uri).await;
        assert_eq!(got, status, "{uri}: {body}");
        if let Some(field) = field {
            assert_eq!(body["field"], field, "{uri}: {body}");
        }
    }
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn ready_takes_every_provider_node_and_a_new_provider_revokes_the_old_grant_first() {
    let f = setup().await;
    let (a, b, c, d) = (node(&f, "a"), node(&f, "b"), node(&f, "c"), node(&f, "d"));
    placed(&f, "pg", 1, &[&b, &c], vec![], vec![pg_provides()]).await;
    placed(&f, "pg2", 1, &[&d], vec![], vec![pg_provides()]).await;
    // Two providers of the kind: the requirement must name one.
    placed(&f, "app", 1, &[&a], vec![db("db")], vec![]).await;
    let g = only_grant(&f).await;
    assert_eq!(g["state"], "requested");
    assert!(
        g["reason"]
            .as_str()
            .unwrap()
            .contains("several modules provide"),
        "{g}"
    );
    let mut named = db("db");
    named.provider = Some("pg".into());
    placed(&f, "app", 2, &[&a], vec![named.clone()], vec![]).await;
    let id: Uuid = only_grant(&f).await["id"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(only_grant(&f).await["provider"], "pg");
    assert_eq!(resources_of(&f, &b).await.len(), 1);
    assert_eq!(resources_of(&f, &c).await.len(), 1);
    assert!(section(&f, &d).await.is_none());

    // Ready on one provider node only: still provisioning.
    report(
        &f,
        &b,
        vec![status(id, ResourceStatusState::Ready, Some(1))],
    )
    .await;
    assert_eq!(only_grant(&f).await["state"], "provisioning");
    report(
        &f,
        &c,
        vec![status(id, ResourceStatusState::Ready, Some(1))],
    )
    .await;
    assert_eq!(only_grant(&f).await["state"], "ready");
    // A node's next report is its whole list: what it no longer lists is forgotten.
    report(&f, &c, vec![]).await;
    let g = only_grant(&f).await;
    assert_eq!(g["state"], "provisioning");
    assert_eq!(g["provider_nodes"].as_array().unwrap().len(), 1);

    // The requirement names the other provider: the old grant is revoked
    // and its credential withdrawn before the new one's is issued.
    let mark = last_id(&f).await;
    named.provider = Some("pg2".into());
    placed(&f, "app", 3, &[&a], vec![named], vec![]).await;
    let all = grants(&f).await;
    assert_eq!(all.len(), 2);
    let old = all.iter().find(|g| g["id"] == id.to_string()).unwrap();
    assert_eq!(old["state"], "revoked");
    assert_eq!(old["reason"], "the requirement now names provider `pg2`");
    let new = all.iter().find(|g| g["id"] != id.to_string()).unwrap();
    assert_eq!(new["provider"], "pg2");
    let told = record(&f, mark).await;
    let order: Vec<&str> = told
        .iter()
        .filter_map(|e| match &e.kind {
            RecordKind::CredentialsWithdrawn(_) => Some("withdrawn"),
            RecordKind::CredentialsIssued(_) => Some("issued"),
            _ => None,
        })
        .collect();
    assert_eq!(order, ["withdrawn", "issued"]);
    assert_eq!(resources_of(&f, &b).await[0].state, ResourceState::Revoked);
    assert_eq!(resources_of(&f, &d).await[0].state, ResourceState::Present);
    // pg2's node cannot speak for pg's grant.
    report(&f, &d, vec![status(id, ResourceStatusState::Deleted, None)]).await;
    assert_eq!(grants(&f).await.len(), 2);
    f.env.teardown().await.unwrap();
}
