//! The test kit against the real PostgreSQL and RabbitMQ; these double as the
//! security tests of the foundation: a context role is confined to its schema, a
//! node user is confined to its own identity, exchange and routing keys.

use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Confirmation, Connection, ConnectionProperties, ExchangeKind};
use mesh_bundle::CONTEXTS;
use mesh_bundle::provision::{self, Names, Rabbit};
use mesh_credentials::{AdminCredentials, AgentCredentials, ControllerCredentials};
use mesh_protocol::topology::{DECLARATIONS_EXCHANGE, REPORTS_EXCHANGE};
use mesh_testkit::TestEnv;
use sqlx::{Connection as _, PgConnection};

const T: Duration = Duration::from_secs(20);

/// Publishes once on a fresh confirming channel: `Ok(())` when confirmed,
/// `Err(code)` when the broker refused it by closing the channel.
async fn publish(conn: &Connection, exchange: &str, key: &str, user_id: &str) -> Result<(), u16> {
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let props = BasicProperties::default()
        .with_user_id(user_id.into())
        .with_delivery_mode(2);
    let attempt = async {
        let c = ch
            .basic_publish(
                exchange.into(),
                key.into(),
                BasicPublishOptions::default(),
                b"{}",
                props,
            )
            .await
            .map_err(code)?;
        match c.await.map_err(code)? {
            Confirmation::Ack(_) => Ok(()),
            other => panic!("unexpected confirmation {other:?}"),
        }
    };
    tokio::time::timeout(T, attempt)
        .await
        .expect("broker answered in time")
}

fn code(e: lapin::Error) -> u16 {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(a) => a.get_id(),
        other => panic!("expected a channel close, got {other:?}"),
    }
}

async fn connect(url: &str) -> Connection {
    tokio::time::timeout(T, Connection::connect(url, ConnectionProperties::default()))
        .await
        .expect("connect in time")
        .expect("connect")
}

async fn admin_pg(admin: &AdminCredentials) -> PgConnection {
    provision::connect_admin(admin, "postgres").await.unwrap()
}

/// Asserts nothing of `names` / `id` remains in PostgreSQL or RabbitMQ.
async fn assert_gone(admin: &AdminCredentials, id: &str, names: &Names) {
    let mut pg = admin_pg(admin).await;
    let dbs: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_database WHERE datname = $1")
        .bind(&names.database)
        .fetch_one(&mut pg)
        .await
        .unwrap();
    assert_eq!(dbs, 0, "database {} left behind", names.database);
    let roles: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pg_roles WHERE starts_with(rolname, $1)")
            .bind(&names.role_prefix)
            .fetch_one(&mut pg)
            .await
            .unwrap();
    assert_eq!(roles, 0, "roles {}_* left behind", names.role_prefix);
    let rabbit = Rabbit::new(admin);
    assert!(
        !rabbit.vhost_exists(&names.vhost).await.unwrap(),
        "vhost left behind"
    );
    let users = rabbit.users().await.unwrap();
    assert!(
        !users.iter().any(|u| u.contains(id)),
        "broker users of {id} left behind: {users:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn roundtrip_confines_roles_and_nodes_and_leaves_nothing() {
    let env = TestEnv::new().await.unwrap();
    let id = env.id().to_string();
    assert!(id.len() == 9 && id.starts_with('t'), "id {id}");
    assert!(id[1..].bytes().all(|b| b.is_ascii_hexdigit()), "id {id}");
    let admin = env.admin_credentials().clone();
    let names = env.names().clone();

    // A context role owns its schema ...
    let mut inv = PgConnection::connect(&env.database_url("inventory"))
        .await
        .unwrap();
    sqlx::raw_sql("CREATE TABLE inventory.t(x int); INSERT INTO inventory.t VALUES (1)")
        .execute(&mut inv)
        .await
        .unwrap();
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM inventory.t")
        .fetch_one(&mut inv)
        .await
        .unwrap();
    assert_eq!(n, 1);
    // ... and nothing else.
    let mut cfg = PgConnection::connect(&env.database_url("config"))
        .await
        .unwrap();
    sqlx::raw_sql("CREATE TABLE config.secret(x int)")
        .execute(&mut cfg)
        .await
        .unwrap();
    for sql in [
        "SELECT * FROM config.secret",
        "CREATE TABLE config.intruder(x int)",
        "CREATE TABLE public.intruder(x int)",
        "CREATE TABLE intruder(x int)",
    ] {
        let err = sqlx::raw_sql(sql)
            .execute(&mut inv)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("permission denied") || err.contains("no schema has been selected"),
            "`{sql}` as inventory: {err}"
        );
    }
    // Every context role can reach its own schema.
    for ctx in CONTEXTS {
        let mut c = PgConnection::connect(&env.database_url(ctx)).await.unwrap();
        let owner: String = sqlx::query_scalar(
            "SELECT nspowner::regrole::text FROM pg_namespace WHERE nspname = $1",
        )
        .bind(ctx)
        .fetch_one(&mut c)
        .await
        .unwrap();
        assert_eq!(owner, names.role(ctx));
        c.close().await.unwrap();
    }
    // The admin URL reaches the test database.
    let mut adm = PgConnection::connect(&env.admin_database_url())
        .await
        .unwrap();
    let db: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&mut adm)
        .await
        .unwrap();
    assert_eq!(db, names.database);
    adm.close().await.unwrap();
    // The controller credentials carry all seven contexts and round-trip as TOML.
    let creds = env.controller_credentials();
    assert_eq!(creds.databases.len(), 7);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("controller-credentials.toml");
    env.write_controller_credentials(&path).unwrap();
    let back = ControllerCredentials::load(&path).unwrap();
    assert_eq!(back, creds);
    assert!(
        creds
            .broker_url
            .expose()
            .ends_with(&format!("/{}", env.vhost()))
    );

    // The controller declares the topology (agents declare nothing).
    let controller = connect(&env.controller_amqp_url()).await;
    let ch = controller.create_channel().await.unwrap();
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.exchange_declare(
        REPORTS_EXCHANGE.into(),
        ExchangeKind::Topic,
        durable,
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.exchange_declare(
        DECLARATIONS_EXCHANGE.into(),
        ExchangeKind::Direct,
        durable,
        FieldTable::default(),
    )
    .await
    .unwrap();

    let a = env.add_node("a").await.unwrap();
    let b = env.add_node("b").await.unwrap();
    assert_eq!(a.node.as_str(), format!("{id}-a"));
    let node_dir = tempfile::tempdir().unwrap();
    a.write_to(node_dir.path()).unwrap();
    let file = AgentCredentials::load(node_dir.path()).unwrap();
    assert_eq!(file.node, a.node);
    assert_eq!(file.broker_url.expose(), &a.broker_url);
    assert_eq!(file.controller_key.to_hex(), env.controller_public_key());

    let conn_a = connect(&a.broker_url).await;
    let own_key = format!("{}.hello", a.node);
    // Control: its own identity, exchange and routing key are accepted.
    publish(&conn_a, REPORTS_EXCHANGE, &own_key, a.node.as_str())
        .await
        .unwrap();
    // Claiming another node's identity is refused (406).
    assert_eq!(
        publish(&conn_a, REPORTS_EXCHANGE, &own_key, b.node.as_str()).await,
        Err(406)
    );
    // Publishing declarations is refused (403).
    assert_eq!(
        publish(
            &conn_a,
            DECLARATIONS_EXCHANGE,
            a.node.as_str(),
            a.node.as_str()
        )
        .await,
        Err(403)
    );
    // Another node's routing key is refused (403).
    let other_key = format!("{}.hello", b.node);
    assert_eq!(
        publish(&conn_a, REPORTS_EXCHANGE, &other_key, a.node.as_str()).await,
        Err(403)
    );
    // Declaring anything is refused (403).
    let ch_a = conn_a.create_channel().await.unwrap();
    let err = ch_a
        .exchange_declare(
            "mine".into(),
            ExchangeKind::Topic,
            durable,
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(code(err), 403);

    // The admin URL has full permissions on the vhost.
    let adm = connect(&env.admin_amqp_url()).await;
    publish(
        &adm,
        DECLARATIONS_EXCHANGE,
        a.node.as_str(),
        &admin.rabbitmq_user,
    )
    .await
    .unwrap();

    // Teardown works with connections still open and leaves nothing behind.
    env.teardown().await.unwrap();
    assert_gone(&admin, &id, &names).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_cleans_up() {
    let env = TestEnv::new().await.unwrap();
    env.add_node("x").await.unwrap();
    let mut conn = PgConnection::connect(&env.database_url("delivery"))
        .await
        .unwrap();
    sqlx::raw_sql("CREATE TABLE delivery.t(x int)")
        .execute(&mut conn)
        .await
        .unwrap();
    let id = env.id().to_string();
    let admin = env.admin_credentials().clone();
    let names = env.names().clone();
    drop(env); // with a session still open
    assert_gone(&admin, &id, &names).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parallel_environments_are_isolated() {
    let (a, b, c) = tokio::try_join!(TestEnv::new(), TestEnv::new(), TestEnv::new()).unwrap();
    assert_ne!(a.id(), b.id());
    assert_ne!(b.id(), c.id());
    assert_ne!(a.vhost(), b.vhost());
    // A role of one environment cannot connect to another's database.
    let own = a.database_url("inventory");
    let (base, _) = own.rsplit_once('/').unwrap();
    let url = format!("{base}/{}", b.names().database);
    let err = PgConnection::connect(&url).await.unwrap_err().to_string();
    assert!(err.contains("permission denied"), "{err}");
    // A node of one environment cannot reach another's vhost.
    let node = a.add_node("n").await.unwrap();
    let (base, _) = node.broker_url.rsplit_once('/').unwrap();
    let url = format!("{base}/{}", urlencoding::encode(b.vhost()));
    let res = tokio::time::timeout(
        T,
        Connection::connect(&url, ConnectionProperties::default()),
    )
    .await
    .expect("answer in time");
    assert!(
        res.is_err(),
        "node of {} connected to {}",
        a.id(),
        b.vhost()
    );
    let (ra, rb, rc) = tokio::join!(a.teardown(), b.teardown(), c.teardown());
    ra.unwrap();
    rb.unwrap();
    rc.unwrap();
}
