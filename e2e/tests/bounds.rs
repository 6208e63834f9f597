//! Every queue's bound, as docs/protocol.md states it, against the real broker.
//!
//! A real controller declares its topology in this test's vhost (and a node's
//! declaration queue after its hello); then the controller is stopped, so that
//! nothing consumes, and:
//!
//! 1. every queue the broker holds is in the doc's table (exactly one row),
//!    every row names at least one queue, and each queue's declared arguments
//!    (`x-max-length`, `x-overflow`, a dead-letter exchange or none) are the
//!    row's, read through the management API;
//! 2. each queue is filled past its bound for real and behaves as the row says:
//!    `reject-publish` NACKs the publishes beyond the bound and keeps the first;
//!    `drop-head` confirms them all and keeps the newest, the oldest dropped
//!    without reaching the dead-letter queue. `decl.<node>` is filled past its
//!    real bound (64); the others (100,000 and more) get a test policy with
//!    `max-length` 5, which RabbitMQ combines with the queue's own argument by
//!    taking the smaller, while `x-overflow` stays the queue's own.
//!    The unroutable queue is filled the way a hostile node would: `<node>.bogus`
//!    through `reports` and its alternate exchange, the NACKs reaching the node.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context as _, anyhow, bail, ensure};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueuePurgeOptions};
use lapin::{BasicProperties, Confirmation, Connection};
use mesh_e2e::sim::{SimNode, add_nodes, drain, queue_depth};
use mesh_e2e::{Mesh, wait_for};
use mesh_testkit::TestEnv;
use serde_json::{Value, json};

/// One row of docs/protocol.md's "Queues and their bounds".
#[derive(Debug)]
struct Row {
    /// As written, e.g. `decl.<node>`.
    queue: String,
    max_len: i64,
    overflow: String,
    /// The row says the oldest are dead-lettered (else: dropped).
    dead_lettered: bool,
}

impl Row {
    /// Whether `name` is this row's queue (`<...>` stands for one name part).
    fn matches(&self, name: &str) -> bool {
        match self.queue.split_once('<') {
            None => self.queue == name,
            Some((prefix, rest)) => {
                rest.ends_with('>')
                    && name
                        .strip_prefix(prefix)
                        .is_some_and(|p| !p.is_empty() && !p.contains('.'))
            }
        }
    }
}

fn doc_rows() -> anyhow::Result<Vec<Row>> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/protocol.md");
    let text = std::fs::read_to_string(path).with_context(|| path.to_owned())?;
    let section = text
        .split("## Queues and their bounds")
        .nth(1)
        .ok_or_else(|| anyhow!("no section `Queues and their bounds` in {path}"))?;
    let section = section.split("\n## ").next().unwrap_or(section);
    // The table of bounds: from its header to the first line that is not a row
    // (the section also holds a table of queue arguments).
    let table = section
        .split("| queue | bound to |")
        .nth(1)
        .ok_or_else(|| anyhow!("no table `| queue | bound to |` in {path}"))?;
    let mut rows = Vec::new();
    for line in table
        .lines()
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .filter(|l| l.starts_with("| `"))
    {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        ensure!(cells.len() >= 6, "a row of fewer than 5 cells: {line}");
        let max_len = cells[3]
            .replace(',', "")
            .parse()
            .with_context(|| format!("max length of {line}"))?;
        let at_bound = cells[4];
        let overflow = at_bound
            .split_whitespace()
            .next()
            .unwrap_or_default()
            .to_owned();
        ensure!(
            overflow == "drop-head" || overflow == "reject-publish",
            "unknown overflow in {line}"
        );
        rows.push(Row {
            queue: cells[1].trim_matches('`').to_owned(),
            max_len,
            overflow,
            dead_lettered: at_bound.contains("dead-lettered")
                && !at_bound.contains("not dead-lettered"),
        });
    }
    ensure!(!rows.is_empty(), "no queue rows in {path}");
    Ok(rows)
}

struct Api {
    http: reqwest::Client,
    base: String,
    user: String,
    password: String,
    vhost: String,
}

impl Api {
    fn new(env: &TestEnv) -> anyhow::Result<Api> {
        let a = env.admin_credentials();
        Ok(Api {
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(30))
                .build()?,
            base: a.rabbitmq_api.clone(),
            user: a.rabbitmq_user.clone(),
            password: a.rabbitmq_password.expose().clone(),
            vhost: urlencoding::encode(env.vhost()).into_owned(),
        })
    }

    async fn get(&self, path: &str) -> anyhow::Result<Value> {
        Ok(self
            .http
            .get(format!("{}/api/{path}", self.base))
            .basic_auth(&self.user, Some(&self.password))
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?)
    }

    async fn put(&self, path: &str, body: &Value) -> anyhow::Result<()> {
        self.http
            .put(format!("{}/api/{path}", self.base))
            .basic_auth(&self.user, Some(&self.password))
            .json(body)
            .send()
            .await?
            .error_for_status()?;
        Ok(())
    }
}

/// Publish `n` tiny persistent messages with ids `<tag>-<i>` and return the
/// broker's answer to each, in order: true for an ack, false for a nack.
async fn fill(
    ch: &lapin::Channel,
    exchange: &str,
    routing_key: &str,
    tag: &str,
    n: usize,
    user_id: Option<&str>,
) -> anyhow::Result<Vec<bool>> {
    let mut confirms = Vec::with_capacity(n);
    for i in 0..n {
        let mut props = BasicProperties::default()
            .with_message_id(format!("{tag}-{i}").as_str().into())
            .with_delivery_mode(2);
        if let Some(u) = user_id {
            props = props.with_user_id(u.into());
        }
        confirms.push(
            ch.basic_publish(
                exchange.into(),
                routing_key.into(),
                BasicPublishOptions::default(),
                b"{}",
                props,
            )
            .await?,
        );
    }
    let mut acks = Vec::with_capacity(n);
    for c in confirms {
        acks.push(match c.await? {
            Confirmation::Ack(None) => true,
            Confirmation::Nack(_) => false,
            other => bail!("{routing_key}: unexpected confirmation {other:?}"),
        });
    }
    Ok(acks)
}

/// Test policy bound: small enough to fill at once.
const SMALL: usize = 5;
/// Messages published beyond the bound.
const OVER: usize = 3;

#[tokio::test(flavor = "multi_thread")]
async fn every_queue_is_bounded_as_the_protocol_doc_states() -> anyhow::Result<()> {
    let rows = doc_rows()?;
    let mut mesh = Mesh::start().await?;
    let api = Api::new(&mesh.env)?;

    // A node says hello, so that the controller declares its declaration queue.
    let creds = add_nodes(&mesh.env, "b", 1).await?;
    let mut node = SimNode::connect(creds.into_iter().next().context("one node")?).await?;
    let decl = format!("decl.{}", node.node());
    let hello = node.hello(&[]);
    ensure!(node.send(&hello).await?.await?.is_ack(), "hello refused");
    wait_for(
        &format!("{decl} to be declared"),
        Duration::from_secs(30),
        || async { Ok(queue_depth(&mesh.env, &decl).await.ok().map(|_| ())) },
    )
    .await?;
    // Nothing consumes from now on; what the controller left in a queue goes.
    mesh.kill_controller();
    let admin = Connection::connect(&mesh.env.admin_amqp_url(), Default::default()).await?;
    let ch = admin.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;

    // 1. The declared arguments are the doc's.
    let queues = api
        .get(&format!(
            "queues/{}?columns=name,arguments,durable",
            api.vhost
        ))
        .await?;
    let queues = queues.as_array().context("a list of queues")?;
    let mut by_row: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for q in queues {
        let name = q["name"].as_str().context("queue name")?;
        let matching: Vec<&Row> = rows.iter().filter(|r| r.matches(name)).collect();
        ensure!(
            matching.len() == 1,
            "queue `{name}`: {} rows of docs/protocol.md's table match it, not one",
            matching.len()
        );
        let row = matching[0];
        let args = &q["arguments"];
        ensure!(q["durable"] == json!(true), "{name} is not durable");
        ensure!(
            args["x-max-length"] == json!(row.max_len),
            "{name}: x-max-length {} but the doc says {}",
            args["x-max-length"],
            row.max_len
        );
        ensure!(
            args["x-overflow"] == json!(row.overflow),
            "{name}: x-overflow {} but the doc says {}",
            args["x-overflow"],
            row.overflow
        );
        ensure!(
            args.get("x-dead-letter-exchange").is_some() == row.dead_lettered,
            "{name}: dead-letter exchange {:?}, but the doc says the oldest are {}",
            args.get("x-dead-letter-exchange"),
            if row.dead_lettered {
                "dead-lettered"
            } else {
                "dropped"
            }
        );
        ch.queue_purge(name.into(), QueuePurgeOptions::default())
            .await?;
        by_row.entry(&row.queue).or_default().push(name.to_owned());
    }
    for row in &rows {
        ensure!(
            by_row.contains_key(row.queue.as_str()),
            "docs/protocol.md lists `{}`, but the controller declared no such queue",
            row.queue
        );
    }

    // 2. Filled past the bound. Every queue but the declaration queues gets a
    // small bound from a test policy (the smaller of policy and argument wins).
    api.put(
        &format!("policies/{}/test-small-bounds", api.vhost),
        &json!({
            "pattern": "^(?!decl\\.)",
            "apply-to": "queues",
            "definition": {"max-length": SMALL},
            "priority": 0,
        }),
    )
    .await?;
    wait_for(
        "the test policy to apply to every queue",
        // The management API reports what the broker applied at its next
        // statistics tick: every 30 s where bundle/up set it (decision 0011).
        Duration::from_secs(90),
        || async {
            let qs = api
                .get(&format!("queues/{}?columns=name,policy", api.vhost))
                .await?;
            let ok = qs.as_array().is_some_and(|qs| {
                qs.iter().all(|q| {
                    q["name"].as_str().is_some_and(|n| n.starts_with("decl."))
                        || q["policy"] == json!("test-small-bounds")
                })
            });
            Ok(ok.then_some(()))
        },
    )
    .await?;

    // Drop-head queues first: their dropped oldest must not reach dead-letter.
    let mut order: Vec<(&Row, &String)> = by_row
        .iter()
        .flat_map(|(q, names)| {
            let row = rows.iter().find(|r| r.queue == *q);
            names.iter().filter_map(move |n| Some((row?, n)))
        })
        .collect();
    order.sort_by_key(|(r, n)| (n.as_str() == "dead-letter", r.overflow == "reject-publish"));
    let unroutable = mesh_protocol::topology::UNROUTABLE_QUEUE;
    for (row, name) in order {
        let bound = if name.starts_with("decl.") {
            usize::try_from(row.max_len)?
        } else {
            SMALL
        };
        let n = bound + OVER;
        let acks = if name == unroutable {
            // As a node would: an unknown kind through `reports`, whose
            // alternate exchange (the provisioned policy) routes it here.
            let key = format!("{}.bogus", node.node());
            let mut acks = Vec::with_capacity(n);
            for i in 0..n {
                let c = node
                    .raw(&key, b"{}", Some(&format!("{name}-{i}")), true)
                    .await?
                    .await?;
                acks.push(match c {
                    Confirmation::Ack(None) => true,
                    Confirmation::Nack(_) => false,
                    other => bail!("{key}: unexpected confirmation {other:?}"),
                });
            }
            acks
        } else {
            fill(&ch, "", name, name, n, None).await?
        };
        let ids = |range: std::ops::Range<usize>| -> Vec<Option<String>> {
            range.map(|i| Some(format!("{name}-{i}"))).collect()
        };
        let kept: Vec<Option<String>> = drain(&mesh.env, name)
            .await?
            .into_iter()
            .map(|(id, _)| id)
            .collect();
        match row.overflow.as_str() {
            "reject-publish" => {
                let want: Vec<bool> = (0..n).map(|i| i < bound).collect();
                ensure!(
                    acks == want,
                    "{name} (reject-publish, bound {bound}): confirms {acks:?}, want the first {bound} acked and the rest nacked"
                );
                ensure!(
                    kept == ids(0..bound),
                    "{name}: kept {kept:?}, want the first {bound}"
                );
            }
            _ => {
                ensure!(
                    acks.iter().all(|a| *a),
                    "{name} (drop-head): a publish was nacked: {acks:?}"
                );
                ensure!(
                    kept == ids(OVER..n),
                    "{name} (drop-head, bound {bound}): kept {kept:?}, want the newest {bound}"
                );
                if name != "dead-letter" {
                    ensure!(
                        queue_depth(&mesh.env, "dead-letter").await? == 0,
                        "{name}: its dropped oldest reached the dead-letter queue"
                    );
                }
            }
        }
        eprintln!("{name}: {} at bound {bound} as documented", row.overflow);
    }
    let _ = admin.close(200, "done".into()).await;
    node.close().await;
    mesh.teardown().await
}
