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
