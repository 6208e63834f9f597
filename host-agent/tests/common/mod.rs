//! What the host agent's broker tests share: the controller's side of the
//! broker (its exchanges, a queue watching every report) and a node's
//! declaration queue, declared as the controller declares them.

use lapin::options::{
    BasicConsumeOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ConnectionProperties, Consumer, ExchangeKind};
use mesh_protocol::NodeId;
use mesh_protocol::topology::{
    DECLARATION_QUEUE_MAX_LEN, DECLARATIONS_EXCHANGE, REPORTS_EXCHANGE, declaration_queue,
};
use mesh_testkit::TestEnv;

/// The controller's part: the exchanges, and a queue watching every report.
pub async fn controller_side(env: &TestEnv) -> anyhow::Result<(Connection, Channel, Consumer)> {
    let admin = Connection::connect(&env.admin_amqp_url(), ConnectionProperties::default()).await?;
    let ch = admin.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
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
    .await?;
    ch.exchange_declare(
        DECLARATIONS_EXCHANGE.into(),
        ExchangeKind::Direct,
        durable,
        FieldTable::default(),
    )
    .await?;
    let watch = ch
        .queue_declare(
            "".into(),
            QueueDeclareOptions {
                exclusive: true,
                auto_delete: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    ch.queue_bind(
        watch.name().clone(),
        REPORTS_EXCHANGE.into(),
        "#".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    let reports = ch
        .basic_consume(
            watch.name().clone(),
            "watch".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    Ok((admin, ch, reports))
}

/// Declare `decl.<node>` as the controller does, bound to `declarations`.
pub async fn declaration_queue_for(ch: &Channel, node: &NodeId) -> anyhow::Result<()> {
    let mut args = FieldTable::default();
    args.insert(
        "x-max-length".into(),
        AMQPValue::LongLongInt(DECLARATION_QUEUE_MAX_LEN),
    );
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString("drop-head".into()),
    );
    let q = declaration_queue(node);
    ch.queue_declare(
        q.as_str().into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await?;
    ch.queue_bind(
        q.as_str().into(),
        DECLARATIONS_EXCHANGE.into(),
        node.as_str().into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    Ok(())
}

/// A free TCP port on loopback (for an agent's metrics listener).
#[allow(dead_code)]
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// `GET /metrics` of an agent's loopback listener, the raw answer.
#[allow(dead_code)]
pub async fn scrape(port: u16) -> anyhow::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await?;
    let mut out = String::new();
    s.read_to_string(&mut out).await?;
    Ok(out)
}

/// A client of the broker's management API and the URL of `path` under it.
#[allow(dead_code)]
pub fn api(env: &TestEnv, path: &str) -> (reqwest::Client, String) {
    let a = env.admin_credentials();
    (
        reqwest::Client::new(),
        format!("{}/api/{path}", a.rabbitmq_api.trim_end_matches('/')),
    )
}

/// Close every broker connection of `user` through the management API (as a
/// broker restart or a network cut would); returns how many there were.
#[allow(dead_code)]
pub async fn kill_connections(env: &TestEnv, user: &str) -> anyhow::Result<usize> {
    let a = env.admin_credentials();
    let (http, url) = api(
        env,
        &format!("connections/username/{}", urlencoding::encode(user)),
    );
    let conns: Vec<serde_json::Value> = http
        .get(&url)
        .basic_auth(&a.rabbitmq_user, Some(a.rabbitmq_password.expose()))
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    let n = conns.iter().filter(|c| c["user"] == user).count();
    if n > 0 {
        http.delete(&url)
            .basic_auth(&a.rabbitmq_user, Some(a.rabbitmq_password.expose()))
            .send()
            .await?
            .error_for_status()?;
    }
    Ok(n)
}

/// Publish `decl` to `node` as the controller does: signed with `signer`,
/// persistent, mandatory, confirmed; an unrouted one is an error.
#[allow(dead_code)]
pub async fn publish_declaration(
    ch: &Channel,
    signer: &mesh_protocol::DeclarationSigner,
    node: &NodeId,
    decl: mesh_protocol::Declaration,
) -> anyhow::Result<()> {
    let bytes = mesh_protocol::Envelope::new(node.clone(), decl.generation, decl).encode();
    let mut headers = FieldTable::default();
    headers.insert(
        mesh_protocol::topology::SIGNATURE_HEADER.into(),
        AMQPValue::LongString(signer.sign_hex(&bytes).into()),
    );
    let confirm = ch
        .basic_publish(
            DECLARATIONS_EXCHANGE.into(),
            node.as_str().into(),
            lapin::options::BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            &bytes,
            lapin::BasicProperties::default()
                .with_message_id(uuid::Uuid::now_v7().to_string().into())
                .with_type("declaration".into())
                .with_content_type("application/json".into())
                .with_delivery_mode(2)
                .with_headers(headers),
        )
        .await?
        .await?;
    anyhow::ensure!(
        matches!(confirm, lapin::Confirmation::Ack(None)),
        "declaration not routed: {confirm:?}"
    );
    Ok(())
}
