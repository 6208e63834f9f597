//! Simulated nodes and fault injection for the fault suite and the benchmark.
//!
//! A simulated node is a broker connection as its own node user, publishing
//! reports like an agent would (persistent, `user_id` set, publisher confirms
//! pipelined), without running a `mesh-agent` process: thousands fit on one
//! machine. Node users are created in bulk with one definitions import.
//!
//! Faults: SIGKILL of the controller (see `Mesh::kill_controller`), a PostgreSQL
//! restart ([`restart_postgres`]) and a RabbitMQ application restart
//! ([`restart_broker`]). The two restarts disturb every test sharing the
//! machine's services: only the serial `disruptive` test binary uses them.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context as _, anyhow, bail, ensure};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, PublisherConfirm};
use mesh_protocol::{
    Applied, AppliedGenerations, Envelope, Heartbeat, NodeId, Outcome, Report, Section,
};
use mesh_testkit::{NodeCredentials, TestEnv};
use serde_json::json;
use sha2::{Digest, Sha256};
use uuid::Uuid;

use crate::Mesh;

/// One simulated node: its own broker connection and confirm channel.
pub struct SimNode {
    pub creds: NodeCredentials,
    pub conn: Connection,
    pub ch: Channel,
    seq: u64,
}

impl SimNode {
    pub async fn connect(creds: NodeCredentials) -> anyhow::Result<SimNode> {
        let conn = Connection::connect(&creds.broker_url, Default::default())
            .await
            .with_context(|| format!("connecting as {}", creds.node))?;
        let ch = conn.create_channel().await?;
        ch.confirm_select(ConfirmSelectOptions::default()).await?;
        Ok(SimNode {
            creds,
            conn,
            ch,
            seq: 0,
        })
    }

    pub fn node(&self) -> &NodeId {
        &self.creds.node
    }

    fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    /// A hello with `labels`, claiming no section applied.
    pub fn hello(&mut self, labels: &[(&str, &str)]) -> Envelope<Report> {
        let mut env = crate::hello(self.creds.node.as_str(), labels);
        env.seq = self.next_seq();
        env
    }

    pub fn heartbeat(&mut self, applied: AppliedGenerations) -> Envelope<Report> {
        let seq = self.next_seq();
        Envelope::new(
            self.creds.node.clone(),
            seq,
            Report::Heartbeat(Heartbeat {
                interval_ms: None,
                applied,
            }),
        )
    }

    /// An `applied` report of `section` at `generation`, outcome applied.
    pub fn applied(&mut self, section: Section, generation: u64) -> Envelope<Report> {
        let seq = self.next_seq();
        Envelope::new(
            self.creds.node.clone(),
            seq,
            Report::Applied(Applied {
                section: Some(section),
                generation: Some(generation),
                outcome: Outcome::Applied,
                items: vec![],
                error: None,
                unsupported_section: None,
            }),
        )
    }

    /// Publish a report on its own routing key; returns the broker's confirm.
    pub async fn send(&self, env: &Envelope<Report>) -> anyhow::Result<PublisherConfirm> {
        let key = format!("{}.{}", self.creds.node, env.kind());
        self.raw(&key, &env.encode(), Some(&env.id.to_string()), true)
            .await
    }

    /// Publish raw bytes to `reports` with `routing_key`, with or without `user_id`.
    pub async fn raw(
        &self,
        routing_key: &str,
        payload: &[u8],
        message_id: Option<&str>,
        with_user_id: bool,
    ) -> anyhow::Result<PublisherConfirm> {
        let mut props = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_delivery_mode(2);
        if let Some(id) = message_id {
            props = props.with_message_id(id.into());
        }
        if with_user_id {
            props = props.with_user_id(self.creds.node.as_str().into());
        }
        Ok(self
            .ch
            .basic_publish(
                "reports".into(),
                routing_key.into(),
                BasicPublishOptions::default(),
                payload,
                props,
            )
            .await?)
    }

    pub async fn close(self) {
        let _ = self.conn.close(200, "simulated node done".into()).await;
    }
}

/// As the node of `creds`, ask for its certificate `name` with `csr` (a
/// `certificates` report with sequence number `seq`), confirmed by the broker.
pub async fn request_certificate(
    creds: NodeCredentials,
    seq: u64,
    name: &str,
    csr: String,
) -> anyhow::Result<()> {
    let sim = SimNode::connect(creds).await?;
    let report = Envelope::new(
        sim.node().clone(),
        seq,
        Report::Certificates(mesh_protocol::Certificates {
            requests: vec![mesh_protocol::CertificateRequest {
                name: name.into(),
                csr,
            }],
            held: vec![],
        }),
    );
    let sent = sim.send(&report).await;
    let done = match sent {
        Ok(confirm) => confirmed(vec![confirm]).await,
        Err(e) => Err(e),
    };
    sim.close().await;
    done
}

/// Wait for confirms; fail on the first one the broker did not ack.
pub async fn confirmed(confirms: Vec<PublisherConfirm>) -> anyhow::Result<()> {
    for c in confirms {
        let c = c.await?;
        ensure!(c.is_ack(), "the broker refused a publish: {c:?}");
    }
    Ok(())
}

/// RabbitMQ's `rabbit_password_hashing_sha256`: base64(salt ++ sha256(salt ++ password)).
fn password_hash(password: &str) -> String {
    let salt: [u8; 4] = rand::random();
    let mut h = Sha256::new();
    h.update(salt);
    h.update(password.as_bytes());
    let mut bytes = salt.to_vec();
    bytes.extend_from_slice(&h.finalize());
    base64(&bytes)
}

fn base64(bytes: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(T[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

fn admin_http() -> anyhow::Result<reqwest::Client> {
    Ok(reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()?)
}

/// Create `n` node users `<env id>-<prefix><i>` with exactly the permissions
/// `TestEnv::add_node` gives (node permissions, topic permissions on `reports`),
/// in one definitions import. The test kit's teardown removes them.
pub async fn add_nodes(
    env: &TestEnv,
    prefix: &str,
    n: usize,
) -> anyhow::Result<Vec<NodeCredentials>> {
    let admin = env.admin_credentials();
    let controller_key = env.controller_public_key();
    let mut users = Vec::with_capacity(n);
    let mut permissions = Vec::with_capacity(n);
    let mut topic_permissions = Vec::with_capacity(n);
    let mut creds = Vec::with_capacity(n);
    let amqp = url::Url::parse(admin.amqp_url.expose())?;
    let host = amqp.host_str().unwrap_or("127.0.0.1").to_owned();
    let port = amqp.port().unwrap_or(5672);
    for i in 0..n {
        let node = NodeId::parse(&format!("{}-{prefix}{i}", env.id()))
            .with_context(|| format!("node prefix `{prefix}`"))?;
        let password = hex::encode(rand::random::<[u8; 16]>());
        let p = mesh_protocol::topology::node_permissions(&node);
        users.push(json!({
            "name": node.as_str(),
            "password_hash": password_hash(&password),
            "hashing_algorithm": "rabbit_password_hashing_sha256",
            "tags": "",
        }));
        permissions.push(json!({
            "user": node.as_str(), "vhost": env.vhost(),
            "configure": p.configure, "write": p.write, "read": p.read,
        }));
        topic_permissions.push(json!({
            "user": node.as_str(), "vhost": env.vhost(), "exchange": p.topic_exchange,
            "write": p.topic_write, "read": p.topic_read,
        }));
        let broker_url = format!(
            "amqp://{}:{password}@{host}:{port}/{}",
            node.as_str(),
            urlencoding::encode(env.vhost())
        );
        creds.push(NodeCredentials {
            node,
            broker_url,
            password,
            controller_key: controller_key.clone(),
        });
    }
    let body = json!({
        "users": users,
        "permissions": permissions,
        "topic_permissions": topic_permissions,
    });
    let r = admin_http()?
        .post(format!("{}/api/definitions", admin.rabbitmq_api))
        .basic_auth(&admin.rabbitmq_user, Some(admin.rabbitmq_password.expose()))
        .json(&body)
        .send()
        .await?;
    ensure!(
        r.status().is_success(),
        "importing {n} node users: {} {}",
        r.status(),
        r.text().await.unwrap_or_default()
    );
    Ok(creds)
}

/// Connect every node, `concurrency` at a time.
pub async fn connect_all(
    creds: Vec<NodeCredentials>,
    concurrency: usize,
) -> anyhow::Result<Vec<SimNode>> {
    use futures_util::StreamExt;
    futures_util::stream::iter(creds)
        .map(SimNode::connect)
        .buffered(concurrency)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect()
}

/// How many of `ids` are in `context`'s inbox (as that context's role).
pub async fn inbox_count(env: &TestEnv, context: &str, ids: &[Uuid]) -> anyhow::Result<i64> {
    let pool = sqlx::PgPool::connect(&env.database_url(context)).await?;
    let sql = format!("SELECT count(*) FROM {context}.inbox WHERE message_id = ANY($1)");
    let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .bind(ids)
        .fetch_one(&pool)
        .await?;
    pool.close().await;
    Ok(n)
}

/// One number from `context`'s schema (as that context's role).
pub async fn scalar(env: &TestEnv, context: &str, sql: &str) -> anyhow::Result<i64> {
    let pool = sqlx::PgPool::connect(&env.database_url(context)).await?;
    let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(&pool)
        .await?;
    pool.close().await;
    Ok(n)
}

/// Wait (at most `within`) until [`scalar`] of `sql` in `context`'s schema is
/// `want`; `what` names the wait in the error.
pub async fn wait_scalar(
    env: &TestEnv,
    what: &str,
    context: &str,
    sql: &str,
    want: i64,
    within: std::time::Duration,
) -> anyhow::Result<()> {
    crate::wait_for(what, within, || async {
        Ok((scalar(env, context, sql).await? == want).then_some(()))
    })
    .await
}

/// Messages ready in `queue` (passive declare, as the admin of the vhost).
pub async fn queue_depth(env: &TestEnv, queue: &str) -> anyhow::Result<u32> {
    let conn = Connection::connect(&env.admin_amqp_url(), Default::default()).await?;
    let ch = conn.create_channel().await?;
    let q = ch
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    let _ = conn.close(200, "done".into()).await;
    Ok(q.message_count())
}

/// Take every message in `queue` (as the vhost's admin): (message id, headers as text).
pub async fn drain(
    env: &TestEnv,
    queue: &str,
) -> anyhow::Result<Vec<(Option<String>, BTreeMap<String, String>)>> {
    use futures_util::StreamExt;
    use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
    use lapin::types::AMQPValue;
    let expected = queue_depth(env, queue).await?;
    let conn = Connection::connect(&env.admin_amqp_url(), Default::default()).await?;
    let ch = conn.create_channel().await?;
    ch.basic_qos(1000, BasicQosOptions::default()).await?;
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "e2e-drain".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut out = Vec::with_capacity(expected as usize);
    while out.len() < expected as usize {
        let d = match tokio::time::timeout(Duration::from_secs(10), consumer.next()).await {
            Ok(Some(d)) => d?,
            Ok(None) => break,
            Err(_) => bail!(
                "draining {queue}: {} of {expected} after 10 s of silence",
                out.len()
            ),
        };
        let headers = d
            .properties
            .headers()
            .clone()
            .unwrap_or_default()
            .inner()
            .iter()
            .filter_map(|(k, v)| match v {
                AMQPValue::LongString(s) => Some((k.to_string(), s.to_string())),
                _ => None,
            })
            .collect();
        out.push((
            d.properties.message_id().as_ref().map(|s| s.to_string()),
            headers,
        ));
        d.acker.ack(BasicAckOptions::default()).await?;
    }
    let _ = conn.close(200, "done".into()).await;
    Ok(out)
}

/// The controller's /metrics as text.
pub async fn metrics(mesh: &Mesh) -> anyhow::Result<String> {
    Ok(reqwest::get(format!("{}/metrics", mesh.api))
        .await?
        .text()
        .await?)
}

/// Sum of every sample of `name` (any labels) whose line contains `filter`.
pub fn metric_sum(text: &str, name: &str, filter: &str) -> f64 {
    text.lines()
        .filter(|l| {
            (l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
                && l.contains(filter)
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The broker's resource limits, read before a resource alarm is raised on
/// purpose (the disruptive tests, the soak's nemesis) and restored after it.
#[derive(Debug, Clone)]
pub struct BrokerLimits {
    pub disk_free_limit: String,
    /// `0.4`, or `absolute <bytes>`.
    pub memory_watermark: Vec<String>,
}

impl BrokerLimits {
    pub fn read() -> anyhow::Result<BrokerLimits> {
        let disk = capture(std::process::Command::new("rabbitmqctl").args([
            "-q",
            "eval",
            "rabbit_disk_monitor:get_disk_free_limit().",
        ]))?;
        let mem = capture(std::process::Command::new("rabbitmqctl").args([
            "-q",
            "eval",
            "vm_memory_monitor:get_vm_memory_high_watermark().",
        ]))?;
        ensure!(
            disk.chars().all(|c| c.is_ascii_digit()) && !disk.is_empty(),
            "the broker's disk free limit is {disk:?}"
        );
        let memory_watermark = if let Some(rest) = mem.strip_prefix("{absolute,") {
            vec![
                "absolute".to_owned(),
                rest.trim_end_matches('}').trim().to_owned(),
            ]
        } else {
            ensure!(
                mem.parse::<f64>().is_ok(),
                "the broker's memory watermark is {mem:?}"
            );
            vec![mem]
        };
        Ok(BrokerLimits {
            disk_free_limit: disk,
            memory_watermark,
        })
    }

    pub fn restore(&self) -> anyhow::Result<()> {
        run(std::process::Command::new("rabbitmqctl").args([
            "-q",
            "set_disk_free_limit",
            &self.disk_free_limit,
        ]))?;
        run(std::process::Command::new("rabbitmqctl")
            .args(["-q", "set_vm_memory_high_watermark"])
            .args(&self.memory_watermark))
    }
}

impl BrokerLimits {
    /// Raise a memory alarm: the watermark near zero, so the broker blocks
    /// every publishing connection until [`BrokerLimits::restore`].
    pub fn alarm_memory() -> anyhow::Result<()> {
        run(std::process::Command::new("rabbitmqctl").args([
            "-q",
            "set_vm_memory_high_watermark",
            "0.0000001",
        ]))
    }
}

/// A command's stdout, trimmed.
fn capture(cmd: &mut std::process::Command) -> anyhow::Result<String> {
    let out = cmd
        .current_dir("/tmp")
        .output()
        .with_context(|| format!("running {cmd:?}"))?;
    ensure!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

fn run(cmd: &mut std::process::Command) -> anyhow::Result<()> {
    let out = cmd
        .current_dir("/tmp")
        .output()
        .with_context(|| format!("running {cmd:?}"))?;
    ensure!(
        out.status.success(),
        "{cmd:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// Restart the machine's PostgreSQL cluster (fast shutdown: every session is
/// cut) with the Debian tools: `pg_ctlcluster --skip-systemctl-redirect <ver>
/// main restart`, the version read from the server. Returns when it accepts
/// connections again. Disturbs every test sharing the server.
pub async fn restart_postgres(env: &TestEnv) -> anyhow::Result<Duration> {
    let pool = sqlx::PgPool::connect(&env.admin_database_url()).await?;
    let num: String = sqlx::query_scalar("SHOW server_version_num")
        .fetch_one(&pool)
        .await?;
    pool.close().await;
    let ver = num.parse::<u32>()? / 10000;
    let started = Instant::now();
    let ver_s = ver.to_string();
    tokio::task::spawn_blocking(move || {
        let cluster = run(std::process::Command::new("pg_ctlcluster").args([
            "--skip-systemctl-redirect",
            &ver_s,
            "main",
            "restart",
            "-m",
            "fast",
        ]));
        if cluster.is_ok() {
            return cluster;
        }
        // A server started without pg_ctlcluster (pg_lsclusters says "down" while
        // it runs) makes pg_ctlcluster refuse; pg_ctl restarts it with the
        // options it was started with (postmaster.opts).
        let data = format!("/var/lib/postgresql/{ver_s}/main");
        run(std::process::Command::new("runuser").args([
            "-u",
            "postgres",
            "--",
            &format!("/usr/lib/postgresql/{ver_s}/bin/pg_ctl"),
            "-D",
            &data,
            "restart",
            "-m",
            "fast",
            "-w",
            "-l",
            &format!("/var/log/postgresql/postgresql-{ver_s}-main.log"),
        ]))
        .map_err(|e| {
            anyhow!(
                "{e:#}; before that: {:#}",
                cluster.err().unwrap_or_else(|| anyhow!("?"))
            )
        })
    })
    .await??;
    crate::wait_for(
        "PostgreSQL to accept connections",
        Duration::from_secs(60),
        || async {
            Ok(sqlx::PgPool::connect(&env.admin_database_url())
                .await
                .ok()
                .map(|_| ()))
        },
    )
    .await?;
    Ok(started.elapsed())
}

/// Stop RabbitMQ's application for `down` (every connection is closed; durable
/// queues and persistent messages stay), then start it again. Returns when it
/// is up (`rabbitmqctl await_startup`).
pub async fn restart_broker(down: Duration) -> anyhow::Result<Instant> {
    tokio::task::spawn_blocking(|| {
        run(std::process::Command::new("rabbitmqctl").args(["-q", "stop_app"]))
    })
    .await??;
    tokio::time::sleep(down).await;
    tokio::task::spawn_blocking(|| {
        run(std::process::Command::new("rabbitmqctl").args(["-q", "start_app"]))?;
        run(std::process::Command::new("rabbitmqctl").args([
            "-q",
            "await_startup",
            "--timeout",
            "60",
        ]))
    })
    .await??;
    Ok(Instant::now())
}

/// The vhost's connections as the management API lists them:
/// (user, connected_at in ms since the epoch).
pub async fn broker_connections(env: &TestEnv) -> anyhow::Result<Vec<(String, u64)>> {
    let path = format!(
        "/api/vhosts/{}/connections?columns=user,connected_at",
        urlencoding::encode(env.vhost())
    );
    let list = management_list(env, &path).await?;
    list.iter()
        .map(|c| {
            Ok((
                c["user"]
                    .as_str()
                    .ok_or_else(|| anyhow!("no user in {c}"))?
                    .to_owned(),
                c["connected_at"]
                    .as_u64()
                    .ok_or_else(|| anyhow!("no connected_at in {c}"))?,
            ))
        })
        .collect()
}

/// The broker's socket limit (file descriptors it may use for connections).
/// Right after a broker restart the management API lists no node until its
/// first statistics (up to one interval, 30 s here): waits up to 90 s for it.
pub async fn broker_sockets_limit(env: &TestEnv) -> anyhow::Result<u64> {
    crate::wait_for(
        "the management API to list the broker's sockets_total",
        std::time::Duration::from_secs(90),
        || async {
            let nodes = management_list(env, "/api/nodes?columns=sockets_total").await?;
            Ok(nodes.first().and_then(|n| n["sockets_total"].as_u64()))
        },
    )
    .await
}

/// A list the management API returns for `path`, as the environment's admin.
async fn management_list(env: &TestEnv, path: &str) -> anyhow::Result<Vec<serde_json::Value>> {
    let admin = env.admin_credentials();
    Ok(admin_http()?
        .get(format!("{}{path}", admin.rabbitmq_api))
        .basic_auth(&admin.rabbitmq_user, Some(admin.rabbitmq_password.expose()))
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?)
}
