//! Backup and restore against the real PostgreSQL and RabbitMQ (decision
//! 0040): a test environment's schemas backed up under one snapshot, a
//! restore over the live source refused without --force, and with it the
//! source replaced by the backup's moment, each schema's objects owned by its
//! own role. (The whole drill, with a controller and agents and a fresh
//! cluster, is e2e/tests/restore.rs.)

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use mesh_bundle::backup::{self, BackupError, BackupSource, RecoveryKey, RestoreOptions};
use mesh_testkit::TestEnv;
use sqlx::PgPool;

#[tokio::test(flavor = "multi_thread")]
async fn a_backup_restores_over_its_source_only_with_force() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let pool = PgPool::connect(&env.database_url("inventory")).await?;
    sqlx::raw_sql(
        "CREATE TABLE inventory.refinery_schema_history (version int4 PRIMARY KEY, \
             name varchar(255), applied_on varchar(255), checksum varchar(255)); \
         INSERT INTO inventory.refinery_schema_history VALUES (1, 'init', 'now', '42'); \
         CREATE TABLE inventory.t (k text PRIMARY KEY, v text NOT NULL); \
         INSERT INTO inventory.t VALUES ('a', 'before'); \
         CREATE TABLE inventory.outbox (id bigserial PRIMARY KEY, message_id uuid NOT NULL UNIQUE, \
             exchange text NOT NULL, routing_key text NOT NULL, kind text NOT NULL, node text, \
             payload bytea NOT NULL, created_at timestamptz NOT NULL DEFAULT now(), sent_at timestamptz); \
         INSERT INTO inventory.outbox (message_id, exchange, routing_key, kind, payload, sent_at) VALUES \
             (gen_random_uuid(), 'record', 'inventory.node.joined', 'node.joined', '\\x00', now()), \
             (gen_random_uuid(), 'declarations', 'n1', 'section', '\\x00', now()), \
             (gen_random_uuid(), 'record', 'inventory.node.left', 'node.left', '\\x00', NULL);",
    )
    .execute(&pool)
    .await?;

    let dir = tempfile::tempdir()?;
    let creds = dir.path().join("controller-credentials.toml");
    env.write_controller_credentials(&creds)?;
    let key = RecoveryKey::generate();
    let archive = dir.path().join("backup.tar");
    let src = BackupSource {
        controller_file: creds,
        admin: env.admin_credentials().clone(),
        admin_token_file: None,
        pg_bin: None,
    };
    let done = backup::backup(&src, &key, &archive).await?;
    let inventory = &done.manifest.schemas[0];
    assert_eq!(inventory.name, "inventory");
    assert_eq!(inventory.role, env.names().role("inventory"));
    assert_eq!(inventory.migrations.len(), 1);
    assert_eq!(inventory.migrations[0].name, "init");
    assert_eq!(done.manifest.postgres.database, env.names().database);
    // The role's password is in the archive only sealed.
    let bytes = std::fs::read(&archive)?;
    let pw = mesh_credentials::password_of(&env.database_url("inventory")).unwrap_or_default();
    assert!(pw.len() >= 32);
    assert!(!bytes.windows(pw.len()).any(|w| w == pw.as_bytes()));

    // After the backup: a change the restore must undo.
    sqlx::query("UPDATE inventory.t SET v = 'after'")
        .execute(&pool)
        .await?;
    pool.close().await;

    let opened = backup::verify(&archive, &key)?;
    let mut opts = RestoreOptions {
        etc: dir.path().join("etc"),
        admin: env.admin_credentials().clone(),
        force: false,
        broker: true,
        pg_bin: None,
    };
    let err = backup::restore(&opened, &opts).await.unwrap_err();
    assert!(matches!(err, BackupError::HoldsData(_)), "{err}");
    assert!(
        err.to_string().contains("schema inventory has 3 table(s)"),
        "{err}"
    );
    assert!(!opts.etc.exists(), "a refused restore wrote its etc");

    opts.force = true;
    let lines = backup::restore(&opened, &opts).await?;
    assert!(
        lines
            .iter()
            .any(|l| l.contains("schema inventory restored as")),
        "{lines:?}"
    );
    // The restored credentials open the schema as its own role, at the backup's moment.
    let restored = mesh_credentials::ControllerCredentials::load(
        &opts.etc.join("controller-credentials.toml"),
    )?;
    let pool = PgPool::connect(restored.databases["inventory"].expose()).await?;
    let (v, owner): (String, String) = sqlx::query_as(
        "SELECT t.v, pg_tables.tableowner::text FROM inventory.t, pg_tables \
         WHERE schemaname = 'inventory' AND tablename = 't'",
    )
    .fetch_one(&pool)
    .await?;
    assert_eq!(v, "before");
    assert_eq!(owner, env.names().role("inventory"));
    // The record events the relay had published are to be published again
    // (the broker's copies were not in the backup); declarations are not
    // (the sections' catch-up re-sends them).
    let unsent: Vec<(String, bool)> =
        sqlx::query_as("SELECT exchange, sent_at IS NULL FROM inventory.outbox ORDER BY id")
            .fetch_all(&pool)
            .await?;
    assert_eq!(
        unsent,
        vec![
            ("record".to_owned(), true),
            ("declarations".to_owned(), false),
            ("record".to_owned(), true),
        ]
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains("schema inventory: 1 record event(s) to publish again")),
        "{lines:?}"
    );
    pool.close().await;
    // The broker's vhost is back.
    let rabbit = mesh_bundle::provision::Rabbit::new(env.admin_credentials());
    assert!(rabbit.vhost_exists(env.vhost()).await?);
    drop(opened);
    env.teardown().await
}
