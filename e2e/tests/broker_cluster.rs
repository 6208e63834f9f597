//! A three-node RabbitMQ cluster on this machine (`bundle/rabbit-cluster`,
//! decision 0042), beside the machine's own broker, which it never touches.
//!
//! The cluster is raised in a temporary directory on ports nobody else holds
//! and taken down by a guard, whatever the test's outcome. Then:
//!
//! 1. a quorum queue with the report queues' arguments (bounded,
//!    reject-publish, single active consumer) has a member on each node;
//! 2. 1,000 persistent messages are published to it with publisher confirms
//!    (each with its own id), through a node that is not the queue's leader;
//! 3. the leader's node is killed (SIGKILL: no goodbye to its peers);
//! 4. all 1,000 are consumed through another surviving node: every id exactly
//!    once, nothing left in the queue;
//! 5. meanwhile a durable classic queue homed on the killed node is
//!    unavailable (its home node is down), as docs/scaling.md says;
//! 6. the node is started again: it rejoins the cluster, the quorum queue has
//!    its three members online again, and the classic queue is back with the
//!    message it held.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, anyhow, bail, ensure};
use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Connection};
use mesh_e2e::wait_for;
use serde_json::Value;

const MESSAGES: usize = 1_000;
const QUORUM: &str = "cluster.reports.applied";
const CLASSIC: &str = "cluster.classic";

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../bundle/rabbit-cluster")
}

/// `bash bundle/rabbit-cluster <args>`: its stdout, or an error with its
/// stderr.
async fn rabbit_cluster(args: &[&str], within: Duration) -> anyhow::Result<String> {
    let run = tokio::process::Command::new("bash")
        .arg(script())
        .args(args)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(within, run)
        .await
        .map_err(|_| anyhow!("bundle/rabbit-cluster {args:?} took longer than {within:?}"))??;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    ensure!(
        out.status.success(),
        "bundle/rabbit-cluster {args:?} failed ({}): {}{stdout}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(stdout)
}

/// The cluster of this test; `down` when dropped, even when the test failed
/// (or `up` did, half-way).
struct Cluster {
    dir: PathBuf,
    env: BTreeMap<String, String>,
    _tmp: tempfile::TempDir,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let down = std::process::Command::new("bash")
            .arg(script())
            .arg("down")
            .arg(&self.dir)
            .stdin(std::process::Stdio::null())
            .output();
        match down {
            Ok(out) if out.status.success() => {}
            Ok(out) => eprintln!(
                "bundle/rabbit-cluster down {:?}: {}",
                self.dir,
                String::from_utf8_lossy(&out.stderr)
            ),
            Err(e) => eprintln!("bundle/rabbit-cluster down {:?}: {e}", self.dir),
        }
    }
}

impl Cluster {
    async fn up() -> anyhow::Result<Cluster> {
        let tmp = tempfile::Builder::new().prefix("mesh-cluster-").tempdir()?;
        let mut cluster = Cluster {
            dir: tmp.path().join("cluster"),
            env: BTreeMap::new(),
            _tmp: tmp,
        };
        let dir = cluster.dir.to_string_lossy().into_owned();
        // Three VMs booting at once on two loaded cores, then two joins: the
        // script's own waits have deadlines of 180 s each.
        rabbit_cluster(&["up", &dir], Duration::from_secs(600)).await?;
        let text = std::fs::read_to_string(cluster.dir.join("cluster.env"))?;
        cluster.env = text
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        Ok(cluster)
    }

    fn var(&self, key: &str) -> anyhow::Result<&str> {
        self.env
            .get(key)
            .map(String::as_str)
            .with_context(|| format!("cluster.env has no {key}"))
    }

    fn url(&self, n: usize) -> anyhow::Result<&str> {
        self.var(&format!("N{n}_URL"))
    }

    fn name(&self, n: usize) -> anyhow::Result<&str> {
        self.var(&format!("N{n}_NAME"))
    }

    /// Which node (1..3) is `name`.
    fn number(&self, name: &str) -> anyhow::Result<usize> {
        (1..=3)
            .find(|n| self.name(*n).ok() == Some(name))
            .with_context(|| format!("{name} is none of this cluster's nodes"))
    }

    async fn run(&self, verb: &str, rest: &[&str]) -> anyhow::Result<String> {
        let dir = self.dir.to_string_lossy().into_owned();
        let mut args = vec![verb, dir.as_str()];
        args.extend_from_slice(rest);
        rabbit_cluster(&args, Duration::from_secs(400)).await
    }

    /// `rabbitmqctl list_queues name type leader members online` as node `n`
    /// sees them, by queue name.
    async fn queues(&self, n: usize) -> anyhow::Result<BTreeMap<String, Value>> {
        let nth = n.to_string();
        let out = self
            .run(
                "ctl",
                &[
                    &nth,
                    "-q",
                    "list_queues",
                    "name",
                    "type",
                    "leader",
                    "members",
                    "online",
                    "--formatter",
                    "json",
                ],
            )
            .await?;
        let list: Vec<Value> = serde_json::from_str(out.trim())
            .with_context(|| format!("list_queues as node {n}: {out}"))?;
        Ok(list
            .into_iter()
            .filter_map(|q| Some((q["name"].as_str()?.to_owned(), q)))
            .collect())
    }
}

fn names(v: &Value) -> Vec<String> {
    let mut out: Vec<String> = v
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

/// The arguments of `reports.applied` (docs/protocol.md), as a quorum queue.
fn quorum_args() -> FieldTable {
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(LongString::from("quorum")),
    );
    args.insert("x-max-length".into(), AMQPValue::LongLongInt(100_000));
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString(LongString::from("reject-publish")),
    );
    args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
    args
}

fn durable() -> QueueDeclareOptions {
    QueueDeclareOptions {
        durable: true,
        ..Default::default()
    }
}

async fn connect(url: &str) -> anyhow::Result<Connection> {
    tokio::time::timeout(
        Duration::from_secs(30),
        Connection::connect(url, Default::default()),
    )
    .await
    .map_err(|_| anyhow!("connecting to {url} took longer than 30 s"))?
    .with_context(|| format!("connecting to {url}"))
}

async fn confirm_channel(conn: &Connection) -> anyhow::Result<Channel> {
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    Ok(ch)
}

/// Publish persistent messages with ids `ids` to `queue` (default exchange),
/// pipelined, and require every confirm to be an ack.
async fn publish(ch: &Channel, queue: &str, ids: std::ops::Range<usize>) -> anyhow::Result<()> {
    let mut pending = Vec::new();
    for i in ids {
        let id = format!("m{i:05}");
        let props = BasicProperties::default()
            .with_delivery_mode(2)
            .with_message_id(id.as_str().into());
        pending.push(
            ch.basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                id.as_bytes(),
                props,
            )
            .await?,
        );
    }
    for (i, c) in pending.into_iter().enumerate() {
        let c = tokio::time::timeout(Duration::from_secs(60), c)
            .await
            .map_err(|_| anyhow!("publish {i} to {queue}: no confirm within 60 s"))??;
        ensure!(
            c.is_ack(),
            "publish {i} to {queue}: the broker refused it: {c:?}"
        );
    }
    Ok(())
}

/// The broker's reply code of a refused AMQP method (0 if not a broker reply).
fn amqp_code(e: &lapin::Error) -> (u16, String) {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(a) => (a.get_id(), a.get_message().to_string()),
        _ => (0, e.to_string()),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_quorum_queue_survives_its_leaders_node_killed_and_the_node_rejoins() -> anyhow::Result<()>
{
    let t0 = std::time::Instant::now();
    let step = |what: &str| eprintln!("{:>6.1} s  {what}", t0.elapsed().as_secs_f64());
    let cluster = Cluster::up().await?;
    step("cluster up");
    let all: Vec<String> = {
        let mut v = (1..=3)
            .map(|n| cluster.name(n).map(str::to_owned))
            .collect::<anyhow::Result<Vec<_>>>()?;
        v.sort();
        v
    };

    // 1. The quorum queue, declared through node 1 (its leader starts there:
    // RabbitMQ places a new queue's leader on the declaring client's node).
    let c1 = connect(cluster.url(1)?).await?;
    let ch1 = c1.create_channel().await?;
    ch1.queue_declare(QUORUM.into(), durable(), quorum_args())
        .await
        .context("declaring the quorum queue")?;
    let queue = wait_for(
        "the quorum queue to have a member online on every node",
        Duration::from_secs(120),
        || async {
            let q = cluster.queues(1).await?;
            let q = q
                .get(QUORUM)
                .cloned()
                .context("the quorum queue is not listed")?;
            Ok((q["type"] == "quorum" && names(&q["online"]) == all).then_some(q))
        },
    )
    .await?;
    let leader = cluster.number(queue["leader"].as_str().context("no leader")?)?;
    let others: Vec<usize> = (1..=3).filter(|n| *n != leader).collect();
    let (via, survivor) = (others[0], others[1]);
    eprintln!("quorum queue leader: node {leader}; publishing via {via}, consuming via {survivor}");

    // 5 (set-up). A durable classic queue homed on the leader's node, holding
    // one message.
    let cl = connect(cluster.url(leader)?).await?;
    let chl = confirm_channel(&cl).await?;
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-master-locator".into(),
        AMQPValue::LongString(LongString::from("client-local")),
    );
    chl.queue_declare(CLASSIC.into(), durable(), args).await?;
    publish(&chl, CLASSIC, 0..1).await?;

    // 2. 1,000 persistent, confirmed messages through a follower's node.
    let cv = connect(cluster.url(via)?).await?;
    let chv = confirm_channel(&cv).await?;
    publish(&chv, QUORUM, 0..MESSAGES).await?;
    step("1,000 messages published and confirmed");
    let _ = cv.close(200, "published".into()).await;
    let _ = c1.close(200, "declared".into()).await;

    // 3. SIGKILL the leader's node.
    let nth = leader.to_string();
    cluster.run("stop-node", &[&nth, "--kill"]).await?;
    step("the leader's node killed");
    drop(chl);
    drop(cl);

    // 4. Consume everything through the other surviving node, once the
    // remaining two members elected a leader.
    let cs = connect(cluster.url(survivor)?).await?;
    let mut consumer = wait_for(
        "a consumer on the quorum queue through a surviving node",
        Duration::from_secs(120),
        || async {
            let ch = cs.create_channel().await?;
            ch.basic_qos(200, BasicQosOptions::default()).await?;
            let consume = ch.basic_consume(
                QUORUM.into(),
                "cluster-test".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            );
            let consumer = tokio::time::timeout(Duration::from_secs(30), consume)
                .await
                .map_err(|_| anyhow!("basic.consume unanswered for 30 s"))??;
            Ok(Some((ch, consumer)))
        },
    )
    .await?;
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut received = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while seen.len() < MESSAGES {
        let next = tokio::time::timeout_at(deadline, consumer.1.next())
            .await
            .map_err(|_| {
                anyhow!(
                    "only {} of {MESSAGES} distinct messages consumed within 120 s of the kill",
                    seen.len()
                )
            })?;
        let d = next.context("the consumer ended")??;
        received += 1;
        let id = String::from_utf8_lossy(&d.data).into_owned();
        ensure!(
            d.properties.message_id().as_ref().map(|m| m.as_str()) == Some(id.as_str()),
            "a message whose body {id:?} is not its id {:?}",
            d.properties.message_id()
        );
        *seen.entry(id).or_default() += 1;
        d.acker.ack(BasicAckOptions::default()).await?;
    }
    let repeated: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    ensure!(
        repeated.is_empty(),
        "messages delivered more than once: {repeated:?}"
    );
    ensure!(
        received == MESSAGES,
        "{received} deliveries for {MESSAGES} messages"
    );
    let expected: Vec<String> = (0..MESSAGES).map(|i| format!("m{i:05}")).collect();
    ensure!(
        seen.keys().cloned().collect::<Vec<_>>() == expected,
        "the consumed ids are not the published ones"
    );
    // Nothing left behind (every message acked, none ready).
    let probe = cs.create_channel().await?;
    let depth = probe
        .queue_declare(
            QUORUM.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?
        .message_count();
    ensure!(
        depth == 0,
        "{depth} messages still ready in the quorum queue"
    );
    step("every message consumed once through a survivor");

    // 5. The classic queue lives on the dead node only: unavailable.
    let probe = cs.create_channel().await?;
    match probe
        .queue_declare(
            CLASSIC.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
    {
        Ok(q) => bail!(
            "the classic queue homed on the killed node answered ({} messages)",
            q.message_count()
        ),
        Err(e) => {
            let (code, text) = amqp_code(&e);
            ensure!(
                code == 404 && text.contains("down"),
                "the classic queue on the killed node: expected 404 (home node down), got {code} {text}"
            );
            eprintln!("classic queue while its node is down: {code} {text}");
        }
    }
    drop(consumer);

    // 6. Start the node again: it rejoins, the quorum queue has three members
    // online, the classic queue is back with its message.
    cluster.run("start-node", &[&nth]).await?;
    step("the node started and running in the cluster");
    wait_for(
        "the restarted node's quorum member to be online again",
        Duration::from_secs(180),
        || async {
            let q = cluster.queues(survivor).await?;
            let q = q.get(QUORUM).context("the quorum queue is not listed")?;
            Ok((names(&q["members"]) == all && names(&q["online"]) == all).then_some(()))
        },
    )
    .await?;
    let back = wait_for(
        "the classic queue to be available again",
        Duration::from_secs(120),
        || async {
            let ch = cs.create_channel().await?;
            let q = ch
                .queue_declare(
                    CLASSIC.into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await?;
            Ok(Some(q.message_count()))
        },
    )
    .await?;
    ensure!(
        back == 1,
        "the classic queue came back with {back} messages, not 1"
    );
    step("three quorum members online, the classic queue back");
    let status = cluster.run("status", &[]).await?;
    let running = status
        .lines()
        .find_map(|l| l.split_once("running (as node ").map(|(_, r)| r))
        .context("status names no running members")?;
    for name in &all {
        ensure!(
            running.contains(name.as_str()),
            "{name} is not running in the cluster: {status}"
        );
    }
    let _ = cs.close(200, "done".into()).await;
    Ok(())
}
