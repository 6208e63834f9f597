//! The broker side of the controller: connecting, declaring the topology that
//! docs/protocol.md describes (every queue bounded), and dead-lettering.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;

use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::tcp::OwnedTLSConfig;
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use mesh_protocol::topology::{self, *};
use mesh_protocol::{NodeId, ReportKind};

pub type AmqpResult<T> = Result<T, lapin::Error>;

/// The AMQP heartbeat asked for unless configured (`amqp_heartbeat_secs`).
pub const DEFAULT_HEARTBEAT_SECS: u64 = 10;
/// The deadline of one connection attempt unless configured (`connect_timeout_ms`).
pub const DEFAULT_CONNECT_TIMEOUT_MS: u64 = 10_000;

/// Connects to the URL's own host and port, within the default attempt
/// deadline and heartbeat (tests and tools; the session uses [`connect_to`]).
pub async fn connect(url: &str) -> AmqpResult<Connection> {
    connect_to(
        url,
        None,
        Duration::from_secs(DEFAULT_HEARTBEAT_SECS),
        Duration::from_millis(DEFAULT_CONNECT_TIMEOUT_MS),
    )
    .await
}

/// Connects with the user, password, vhost and scheme of `url` to `endpoint`
/// (`(host, port)`, one of `broker_endpoints`: another node of the same
/// cluster) or, without one, to the URL's own host and port; asking for an
/// AMQP heartbeat of `heartbeat` unless the URL names one; the whole attempt
/// (TCP connect, TLS and AMQP handshakes) within `deadline`
/// ([`mesh_amqp::connect`]: a silent peer fails the attempt and leaves no
/// socket or thread behind).
/// A plain `amqp://` URL reaches loopback endpoints only, as its own host.
pub async fn connect_to(
    url: &str,
    endpoint: Option<&(String, u16)>,
    heartbeat: Duration,
    deadline: Duration,
) -> AmqpResult<Connection> {
    let props = ConnectionProperties::default().with_connection_name("mesh-controller".into());
    let mut uri: lapin::uri::AMQPUri = url
        .parse()
        // lapin's parse error may quote the URL (its password): not kept.
        .map_err(|_: String| {
            lapin::Error::from(std::io::Error::other(
                "the broker URL in the credentials is not an AMQP URL",
            ))
        })?;
    if uri.query.heartbeat.is_none() {
        uri.query.heartbeat = Some(u16::try_from(heartbeat.as_secs()).unwrap_or(u16::MAX));
    }
    if let Some((host, port)) = endpoint {
        if uri.scheme == lapin::uri::AMQPScheme::AMQP
            && !mesh_credentials::advertise::is_loopback_host(host)
        {
            return Err(lapin::Error::from(std::io::Error::other(format!(
                "plain amqp:// to {host}:{port} refused: plain AMQP is for a loopback broker only"
            ))));
        }
        uri.authority.host = host.clone();
        uri.authority.port = *port;
    }
    match mesh_amqp::connect(uri, props, OwnedTLSConfig::default(), deadline).await {
        Ok(conn) => Ok(conn),
        Err(mesh_amqp::ConnectError::Amqp(e)) => Err(e),
        Err(timed_out @ mesh_amqp::ConnectError::TimedOut(_)) => Err(lapin::Error::from(
            std::io::Error::new(std::io::ErrorKind::TimedOut, timed_out.to_string()),
        )),
    }
}

/// The type of the queues whose loss would lose something (setting
/// `queue_type`, docs/decisions/0043).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QueueType {
    /// One broker: classic queues, as always.
    #[default]
    Classic,
    /// A cluster: the hello, applied and certificates report queues, the
    /// declaration queues, the record queues, `dead-letter` and
    /// `reports.unroutable` are quorum queues (replicated; durable,
    /// non-exclusive). The other report queues stay classic and are declared
    /// non-durable (`report_queue_options`); an upgrade's holding queue
    /// stays classic and durable (`crate::upgrade`).
    Quorum,
}

/// The argument that makes a queue a quorum queue.
pub(crate) const QUEUE_TYPE: &str = "x-queue-type";

impl QueueType {
    /// `args` with this queue type's argument (none for classic).
    fn apply(self, mut args: FieldTable) -> FieldTable {
        if self == QueueType::Quorum {
            args.insert(
                QUEUE_TYPE.into(),
                AMQPValue::LongString(LongString::from("quorum")),
            );
        }
        args
    }
}

/// Whether `kind`'s report queue is of the configured type: the kinds whose
/// reports may not be lost (reject-publish). The superseded-state kinds
/// (drop-head: heartbeats, units, health, resources) and logs answers (a
/// per-message expiration) stay classic: see [`report_queue_options`].
pub(crate) fn replicated(kind: ReportKind) -> bool {
    matches!(
        kind,
        ReportKind::Hello | ReportKind::Applied | ReportKind::Certificates
    )
}

/// How `kind`'s report queue is declared. Durable, except with quorum
/// queues for the kinds that stay classic: a durable classic queue lives on
/// one node of a cluster, and while that node is down every declare and
/// consume of it fails (404, "home node is down"), which would stop the
/// controller's whole session until the node returns. A transient classic
/// queue is removed with its node instead, and the controller's next
/// session declares it again on the node it reaches: what it held was a
/// superseded state (or a logs answer wanted for seconds), which the next
/// report replaces (docs/decisions/0043).
pub(crate) fn report_queue_options(kind: ReportKind, queue_type: QueueType) -> QueueDeclareOptions {
    QueueDeclareOptions {
        durable: queue_type == QueueType::Classic || replicated(kind),
        ..QueueDeclareOptions::default()
    }
}

/// The `<host>:<port>` of a broker URL, for logs (never the password).
pub fn url_endpoint(url: &str) -> Option<String> {
    let uri: lapin::uri::AMQPUri = url.parse().ok()?;
    Some(format!("{}:{}", uri.authority.host, uri.authority.port))
}

/// The host (without brackets) and port of a broker URL; none when it does
/// not parse.
pub fn url_host_port(url: &str) -> Option<(String, u16)> {
    let uri: lapin::uri::AMQPUri = url.parse().ok()?;
    let host = uri
        .authority
        .host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    Some((host, uri.authority.port))
}

/// A channel in confirm mode, for publishing.
pub async fn confirm_channel(conn: &Connection) -> AmqpResult<Channel> {
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    Ok(ch)
}

/// Queue arguments: a bound, what happens at the bound, and nothing else.
/// Strings are LongString: a ShortString in queue arguments crashes the broker's
/// connection handler (../shared/facts.md).
fn bounded(max_len: i64, overflow: &str) -> FieldTable {
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongLongInt(max_len));
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString(LongString::from(overflow)),
    );
    args
}

fn durable() -> QueueDeclareOptions {
    QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    }
}

/// The arguments of the queue of one kind of report: its bound, and a single
/// active consumer, the fence's second line (docs/decisions/0017): should two
/// controllers ever consume, the broker delivers to one of them only.
pub(crate) fn report_queue_args(kind: ReportKind, queue_type: QueueType) -> FieldTable {
    let mut args = report_queue_bound(kind);
    args.insert(SINGLE_ACTIVE_CONSUMER.into(), AMQPValue::Boolean(true));
    if replicated(kind) {
        queue_type.apply(args)
    } else {
        args
    }
}

/// The queue argument that makes a queue deliver to one consumer at a time.
pub(crate) const SINGLE_ACTIVE_CONSUMER: &str = "x-single-active-consumer";

/// The bound of the queue of one kind of report.
pub(crate) fn report_queue_bound(kind: ReportKind) -> FieldTable {
    match kind {
        // The newest heartbeat of a node supersedes the older ones: drop the oldest.
        ReportKind::Heartbeat => bounded(HEARTBEAT_QUEUE_MAX_LEN, "drop-head"),
        // Losing a hello or an applied report is not acceptable: refuse the publish,
        // the agent keeps it buffered and retries.
        ReportKind::Hello | ReportKind::Applied | ReportKind::Certificates => {
            bounded(REPORT_QUEUE_MAX_LEN, "reject-publish")
        }
        // A units report is a node's whole list, superseded by its next one.
        ReportKind::Units => bounded(UNITS_QUEUE_MAX_LEN, "drop-head"),
        // So is a health report: every probe result of the node, whole.
        ReportKind::Health => bounded(HEALTH_QUEUE_MAX_LEN, "drop-head"),
        // A logs answer is wanted for seconds (it expires anyway): drop the
        // oldest (decision 0033).
        ReportKind::Logs => bounded(LOGS_QUEUE_MAX_LEN, "drop-head"),
        // A resources report is a provider node's whole list, superseded by
        // its next one (decision 0039).
        ReportKind::Resources => bounded(RESOURCES_QUEUE_MAX_LEN, "drop-head"),
    }
}

/// Declare every exchange and queue the controller uses; `record_subscriptions`
/// lists, per context, the record routing-key patterns it consumes. The report
/// queues of `upgrading` kinds are left as they are (an older controller's,
/// being drained: see `crate::upgrade`).
pub async fn declare_topology(
    ch: &Channel,
    record_subscriptions: &[(&str, &[&str])],
    upgrading: &[ReportKind],
    queue_type: QueueType,
) -> AmqpResult<()> {
    let durable_ex = ExchangeDeclareOptions {
        durable: true,
        ..ExchangeDeclareOptions::default()
    };
    for (name, kind) in [
        (REPORTS_EXCHANGE, ExchangeKind::Topic),
        (DECLARATIONS_EXCHANGE, ExchangeKind::Direct),
        (RECORD_EXCHANGE, ExchangeKind::Topic),
        (DEAD_LETTER_EXCHANGE, ExchangeKind::Fanout),
    ] {
        ch.exchange_declare(name.into(), kind, durable_ex, FieldTable::default())
            .await?;
    }
    ch.queue_declare(
        DEAD_LETTER_QUEUE.into(),
        durable(),
        queue_type.apply(bounded(DEAD_LETTER_QUEUE_MAX_LEN, "drop-head")),
    )
    .await?;
    ch.queue_bind(
        DEAD_LETTER_QUEUE.into(),
        DEAD_LETTER_EXCHANGE.into(),
        "".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    for kind in ReportKind::ALL {
        if upgrading.contains(&kind) {
            continue;
        }
        let queue = topology::report_queue(kind);
        ch.queue_declare(
            queue.as_str().into(),
            report_queue_options(kind, queue_type),
            report_queue_args(kind, queue_type),
        )
        .await?;
        let key = format!("*.{}", kind.as_str());
        ch.queue_bind(
            queue.as_str().into(),
            REPORTS_EXCHANGE.into(),
            key.as_str().into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    }
    for (context, patterns) in record_subscriptions {
        if patterns.is_empty() {
            continue;
        }
        let queue = topology::record_queue(context);
        ch.queue_declare(
            queue.as_str().into(),
            durable(),
            queue_type.apply(bounded(RECORD_QUEUE_MAX_LEN, "reject-publish")),
        )
        .await?;
        for pattern in *patterns {
            ch.queue_bind(
                queue.as_str().into(),
                RECORD_EXCHANGE.into(),
                (*pattern).into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
        }
    }
    declare_unroutable(ch, queue_type).await
}

/// The alternate exchange of `reports` and its queue: a report published under
/// a routing key no queue is bound for (`<node>.bogus`) lands here instead of
/// being dropped, and the controller dead-letters it (reason `unroutable`).
/// `reports` gets it as its alternate exchange from the vhost policy
/// [`REPORTS_POLICY`] the bundle provisions (decision 0021), not from an
/// exchange argument, which an existing `reports` would refuse.
async fn declare_unroutable(ch: &Channel, queue_type: QueueType) -> AmqpResult<()> {
    ch.exchange_declare(
        UNROUTABLE_EXCHANGE.into(),
        ExchangeKind::Fanout,
        ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        },
        FieldTable::default(),
    )
    .await?;
    ch.queue_declare(
        UNROUTABLE_QUEUE.into(),
        durable(),
        queue_type.apply(bounded(UNROUTABLE_QUEUE_MAX_LEN, "reject-publish")),
    )
    .await?;
    ch.queue_bind(
        UNROUTABLE_QUEUE.into(),
        UNROUTABLE_EXCHANGE.into(),
        "".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    Ok(())
}

/// Declare `decl.<node>` and bind it to `declarations`, without waiting for
/// the broker's replies.
async fn declare_nowait(ch: &Channel, node: &NodeId, queue_type: QueueType) -> AmqpResult<()> {
    let queue = topology::declaration_queue(node);
    ch.queue_declare(
        queue.as_str().into(),
        QueueDeclareOptions {
            nowait: true,
            ..durable()
        },
        queue_type.apply(bounded(DECLARATION_QUEUE_MAX_LEN, "drop-head")),
    )
    .await?;
    ch.queue_bind(
        queue.as_str().into(),
        DECLARATIONS_EXCHANGE.into(),
        node.as_str().into(),
        QueueBindOptions { nowait: true },
        FieldTable::default(),
    )
    .await?;
    Ok(())
}

/// Channels the hello path declares nodes' queues on, side by side
/// ([`DeclarationQueues::ensure_all`]).
pub struct DeclareChannels(Vec<Channel>);

impl DeclareChannels {
    /// How many: the broker creates one queue at a time per channel, and with
    /// 32 a fleet's join created ~800 queues/s on this machine against ~140 on
    /// one (decision 0024). Idle channels cost the broker next to nothing.
    pub const COUNT: usize = 32;

    pub async fn open(conn: &Connection) -> AmqpResult<Self> {
        let mut channels = Vec::with_capacity(Self::COUNT);
        for _ in 0..Self::COUNT {
            channels.push(conn.create_channel().await?);
        }
        Ok(DeclareChannels(channels))
    }
}

/// Declares each node's declaration queue once per connection.
#[derive(Default)]
pub struct DeclarationQueues {
    known: Mutex<HashSet<NodeId>>,
    queue_type: QueueType,
}

impl DeclarationQueues {
    /// Declaration queues of `queue_type`.
    pub fn new(queue_type: QueueType) -> Self {
        DeclarationQueues {
            known: Mutex::default(),
            queue_type,
        }
    }

    /// Make sure `decl.<node>` exists and is bound, declaring it at most once per
    /// connection (the set is cleared on reconnect).
    ///
    /// Declare and bind are sent without waiting for the broker's reply
    /// (`nowait`): a fan-out to 10,000 nodes after a start would otherwise wait
    /// for 20,000 round trips, one after the other (measured: 15 s instead of
    /// 4 s). The broker handles a channel's frames in order, so a declaration
    /// published next on the same channel finds the queue; one published on
    /// another channel may overtake the declare, and then comes back unroutable
    /// (it is published `mandatory`): the relay forgets the node, declares again
    /// and retries the row. A declare the broker refuses closes the channel,
    /// which ends the session; the next one starts with an empty set.
    pub async fn ensure(&self, ch: &Channel, node: &NodeId) -> AmqpResult<()> {
        if self.known.lock().map(|k| k.contains(node)).unwrap_or(false) {
            return Ok(());
        }
        declare_nowait(ch, node, self.queue_type).await?;
        if let Ok(mut k) = self.known.lock() {
            k.insert(node.clone());
        }
        Ok(())
    }

    /// Make sure the queues of `nodes` exist, and return only once they do:
    /// the hello path, before the batch's handling commits, so that nothing it
    /// causes to be declared can reach the broker before the node's queue.
    ///
    /// Creating a durable queue is latency-bound in the broker, and one
    /// channel creates one queue at a time (measured here: ~140 queues/s on
    /// one channel, ~650–800/s spread over 16–32, with the machine loaded;
    /// decision 0024). So the declares (and binds) of the nodes not declared
    /// on this connection yet are spread over `channels`, a node's declare and
    /// bind on one channel in order, sent without waiting (`nowait`), and then
    /// one passive declare per channel used waits for a reply: the broker
    /// handles a channel's frames in order, so when it answers, every queue
    /// declared before it on that channel exists. A declare the broker refuses
    /// closes its channel, and the error ends the session as before.
    pub async fn ensure_all(
        &self,
        channels: &DeclareChannels,
        nodes: &[&NodeId],
    ) -> AmqpResult<()> {
        let mut fresh: Vec<&NodeId> = match self.known.lock() {
            Ok(known) => nodes
                .iter()
                .copied()
                .filter(|n| !known.contains(*n))
                .collect(),
            Err(_) => nodes.to_vec(),
        };
        fresh.sort_unstable();
        fresh.dedup();
        if fresh.is_empty() {
            return Ok(());
        }
        let channels = &channels.0;
        let mut last: Vec<Option<String>> = vec![None; channels.len()];
        for (i, node) in fresh.iter().enumerate() {
            let k = i % channels.len();
            declare_nowait(&channels[k], node, self.queue_type).await?;
            last[k] = Some(topology::declaration_queue(node));
        }
        let barriers = channels.iter().zip(&last).filter_map(|(ch, queue)| {
            let queue = queue.as_ref()?;
            Some(ch.queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            ))
        });
        futures_util::future::try_join_all(barriers).await?;
        if let Ok(mut k) = self.known.lock() {
            k.extend(fresh.into_iter().cloned());
        }
        Ok(())
    }

    pub fn forget(&self, node: &NodeId) {
        if let Ok(mut k) = self.known.lock() {
            k.remove(node);
        }
    }

    pub fn clear(&self) {
        if let Ok(mut k) = self.known.lock() {
            k.clear();
        }
    }
}

/// Why a message is refused, for the dead-letter headers.
#[derive(Debug, Clone)]
pub struct Refusal {
    /// Short stable label (metrics, `x-mesh-reason-code`).
    pub code: &'static str,
    /// Words for an operator (`x-mesh-reason`).
    pub reason: String,
}

impl Refusal {
    pub fn new(code: &'static str, reason: impl Into<String>) -> Self {
        Refusal {
            code,
            reason: reason.into(),
        }
    }
}

/// Publish a copy of a refused message to the dead-letter exchange with the reason
/// in its headers, keeping its original properties. Returns the confirm future so
/// callers can pipeline; the original may be acknowledged only once it is an Ack.
pub async fn dead_letter(
    ch: &Channel,
    origin_queue: &str,
    data: &[u8],
    properties: &BasicProperties,
    refusal: &Refusal,
) -> AmqpResult<lapin::PublisherConfirm> {
    let mut headers = properties.headers().clone().unwrap_or_default();
    let text = |v: &str| AMQPValue::LongString(LongString::from(v));
    headers.insert(REASON_HEADER.into(), text(&refusal.reason));
    headers.insert(REASON_CODE_HEADER.into(), text(refusal.code));
    headers.insert(ORIGIN_QUEUE_HEADER.into(), text(origin_queue));
    // The sender's user_id cannot travel as a property (the broker refuses a publish
    // whose user_id is not the publisher's own user): it travels as a header.
    if let Some(user) = properties.user_id() {
        headers.insert(ORIGIN_USER_HEADER.into(), text(user.as_str()));
    }
    let mut props = BasicProperties::default()
        .with_headers(headers)
        .with_delivery_mode(2);
    if let Some(id) = properties.message_id() {
        props = props.with_message_id(id.clone());
    }
    if let Some(kind) = properties.kind() {
        props = props.with_type(kind.clone());
    }
    if let Some(ct) = properties.content_type() {
        props = props.with_content_type(ct.clone());
    }
    ch.basic_publish(
        DEAD_LETTER_EXCHANGE.into(),
        origin_queue.into(),
        BasicPublishOptions::default(),
        data,
        props,
    )
    .await
}
