//! The read replica (issue 17, point 4; docs/decisions/0041): a streaming
//! replica of this machine's PostgreSQL cluster, raised by `bundle/replica`
//! in a directory of its own on a free port, serves the API's reads that
//! tolerate lag (`GET /v1/nodes`, `GET /v1/audit`, the event history
//! `GET /v1/events?follow=false`) while it is usable; stopped,
//! every answer stays 200, served by the primary, and the controller says the
//! replica is unusable.
//!
//! Real parts only: the real cluster and its real replica (pg_basebackup,
//! streaming), the real broker, the `mesh-controller` binary. Needs root (the
//! script runs PostgreSQL as the postgres user) and the primary's `local
//! replication` rule that bundle/up adds.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context as _, anyhow, ensure};
use mesh_e2e::{Mesh, hello, publish_as, wait_for};
use sqlx::ConnectOptions;
use sqlx::postgres::PgConnectOptions;

const WITHIN: Duration = Duration::from_secs(120);

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../bundle/replica")
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// A replica raised by `bundle/replica up`; dropped (a test that failed
/// included), it is stopped and its directory removed.
struct Replica {
    dir: PathBuf,
    port: u16,
}

impl Replica {
    fn up() -> anyhow::Result<Replica> {
        let port = free_port()?;
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_nanos();
        let replica = Replica {
            dir: std::env::temp_dir()
                .join(format!("mesh-replica-{}-{stamp:x}", std::process::id())),
            port,
        };
        let out = Command::new("bash")
            .arg(script())
            .arg("up")
            .arg(&replica.dir)
            .arg(port.to_string())
            .output()
            .context("running bundle/replica up")?;
        ensure!(
            out.status.success(),
            "bundle/replica up failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(replica)
    }

    /// Stop it and remove its directory (idempotent).
    fn down(&self) -> anyhow::Result<()> {
        let out = Command::new("bash")
            .arg(script())
            .arg("down")
            .arg(&self.dir)
            .output()
            .context("running bundle/replica down")?;
        ensure!(
            out.status.success(),
            "bundle/replica down failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }

    /// A superuser connection to the replica.
    async fn connect(&self) -> anyhow::Result<sqlx::PgConnection> {
        Ok(PgConnectOptions::new()
            .host("127.0.0.1")
            .port(self.port)
            .username("postgres")
            .database("postgres")
            .connect()
            .await?)
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        if let Err(e) = self.down() {
            eprintln!("{e:#}");
        }
    }
}

/// The value of the sample `name{labels}` (exactly) in the controller's /metrics.
async fn sample(mesh: &Mesh, series: &str) -> anyhow::Result<Option<f64>> {
    let text = reqwest::get(format!("{}/metrics", mesh.api))
        .await?
        .text()
        .await?;
    Ok(text.lines().find_map(|l| {
        let (name, value) = l.rsplit_once(' ')?;
        (name == series).then(|| value.parse().ok())?
    }))
}

const REPLICA_READS: &str = "mesh_controller_replica_reads_total{target=\"replica\"}";
const PRIMARY_READS: &str = "mesh_controller_replica_reads_total{target=\"primary\"}";
const USABLE: &str = "mesh_controller_replica_usable";
const LAG: &str = "mesh_controller_replica_lag_seconds";

async fn count(mesh: &Mesh, series: &str) -> anyhow::Result<f64> {
    sample(mesh, series)
        .await?
        .ok_or_else(|| anyhow!("{series} is not served"))
}

/// Wait until `series` is above `than` (the counters are synced on the
/// replica clock's tick).
async fn grows(mesh: &Mesh, series: &str, than: f64) -> anyhow::Result<f64> {
    wait_for(&format!("{series} to grow past {than}"), WITHIN, || async {
        let now = count(mesh, series).await?;
        Ok((now > than).then_some(now))
    })
    .await
}

/// The ids of the nodes `GET /v1/nodes` lists (must answer 200).
async fn listed(mesh: &Mesh) -> anyhow::Result<Vec<String>> {
    let (status, body) = mesh.get("/v1/nodes").await?;
    ensure!(status == 200, "GET /v1/nodes: {status} {body}");
    Ok(body["nodes"]
        .as_array()
        .ok_or_else(|| anyhow!("no nodes in {body}"))?
        .iter()
        .filter_map(|n| n["id"].as_str().map(str::to_owned))
        .collect())
}

/// The actions of the audit entries `GET /v1/audit` lists (must answer 200).
async fn audited(mesh: &Mesh) -> anyhow::Result<Vec<String>> {
    let (status, body) = mesh.get("/v1/audit").await?;
    ensure!(status == 200, "GET /v1/audit: {status} {body}");
    Ok(body["entries"]
        .as_array()
        .ok_or_else(|| anyhow!("no entries in {body}"))?
        .iter()
        .filter_map(|e| e["action"].as_str().map(str::to_owned))
        .collect())
}

/// The event history after position 0 (`follow=false`: the stream ends),
/// as the SSE text it was sent as (must answer 200).
async fn history(mesh: &Mesh) -> anyhow::Result<String> {
    let resp = reqwest::Client::new()
        .get(format!("{}/v1/events?follow=false&after=0", mesh.api))
        .bearer_auth(mesh.admin_token())
        .timeout(WITHIN)
        .send()
        .await?;
    ensure!(resp.status() == 200, "GET /v1/events: {}", resp.status());
    Ok(resp.text().await?)
}

/// Whether the history names every one of `nodes`.
fn names_all(history: &str, nodes: &[String]) -> bool {
    nodes.iter().all(|n| history.contains(&format!("\"{n}\"")))
}

/// How long a commit on the primary takes to be replayed on the replica:
/// `rounds` one-row commits, each waited for on the replica by its LSN, on
/// connections held open. Printed, never asserted (no timing assertions).
async fn measure_lag(
    mesh: &Mesh,
    replica: &Replica,
    rounds: usize,
) -> anyhow::Result<Vec<Duration>> {
    use sqlx::Connection as _;
    let mut primary = sqlx::PgConnection::connect(&mesh.env.database_url("inventory")).await?;
    let mut standby = replica.connect().await?;
    let mut took = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        // A transaction that takes an id commits with a commit record; the
        // WAL position read after it is past that record.
        sqlx::query("SELECT txid_current()")
            .execute(&mut primary)
            .await?;
        let lsn: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
            .fetch_one(&mut primary)
            .await?;
        let start = Instant::now();
        let deadline = start + WITHIN;
        loop {
            let replayed: bool =
                sqlx::query_scalar("SELECT pg_last_wal_replay_lsn() >= $1::pg_lsn")
                    .bind(&lsn)
                    .fetch_one(&mut standby)
                    .await?;
            if replayed {
                took.push(start.elapsed());
                break;
            }
            ensure!(Instant::now() < deadline, "{lsn} never replayed");
            tokio::task::yield_now().await;
        }
    }
    took.sort();
    Ok(took)
}

#[tokio::test(flavor = "multi_thread")]
async fn the_replica_serves_lists_and_audit_and_the_primary_takes_over_when_it_stops()
-> anyhow::Result<()> {
    let replica = Replica::up()?;
    let mut mesh = Mesh::prepare().await?;
    let toml = mesh.dir.path().join("controller.toml");
    let mut settings = std::fs::read_to_string(&toml)?;
    settings.push_str(&format!(
        "replica_host = \"127.0.0.1\"\nreplica_port = {}\nreplica_check_ms = 200\nreplica_max_lag_ms = 5000\n",
        replica.port
    ));
    std::fs::write(&toml, settings)?;
    mesh.start_controller(&[]).await?;

    // Usable once checked: in recovery, streaming, within the bound.
    wait_for("the replica to be usable", WITHIN, || async {
        Ok((sample(&mesh, USABLE).await? == Some(1.0)).then_some(()))
    })
    .await?;

    // Nodes join (written on the primary); the list shows them all.
    let mut nodes = Vec::new();
    for suffix in ["r1", "r2", "r3"] {
        let creds = mesh.env.add_node(suffix).await?;
        let key = format!("{}.hello", creds.node);
        publish_as(
            &creds,
            &key,
            &hello(creds.node.as_str(), &[]).encode(),
            true,
        )
        .await?;
        nodes.push(creds.node.to_string());
    }
    wait_for("the nodes to be listed", WITHIN, || async {
        let ids = listed(&mesh).await?;
        Ok(nodes.iter().all(|n| ids.contains(n)).then_some(()))
    })
    .await?;

    // GET /v1/nodes is served by the replica: its counter grows with a
    // request, and the replica has the inventory role's connection of the
    // controller's replica pool.
    let before = count(&mesh, REPLICA_READS).await?;
    let ids = listed(&mesh).await?;
    ensure!(nodes.iter().all(|n| ids.contains(n)), "{ids:?}");
    grows(&mesh, REPLICA_READS, before).await?;
    let inventory: PgConnectOptions = mesh.env.database_url("inventory").parse()?;
    let identity: PgConnectOptions = mesh.env.database_url("identity").parse()?;
    let mut standby = replica.connect().await?;
    let roles: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT usename::text FROM pg_stat_activity \
         WHERE application_name = 'mesh-controller-replica-reads' AND datname = $1",
    )
    .bind(inventory.get_database())
    .fetch_all(&mut standby)
    .await?;
    ensure!(
        roles.iter().any(|r| r == inventory.get_username())
            && roles.iter().any(|r| r == identity.get_username()),
        "the replica's sessions of the controller: {roles:?}"
    );
    drop(standby);

    // GET /v1/audit too: an audited mutation (on the primary) is listed,
    // and the replica served the request.
    mesh.create_token("replica-reader", "viewer").await?;
    wait_for("the token's audit entry to be listed", WITHIN, || async {
        Ok(audited(&mesh)
            .await?
            .iter()
            .any(|a| a == "POST /v1/tokens")
            .then_some(()))
    })
    .await?;
    let before = count(&mesh, REPLICA_READS).await?;
    ensure!(audited(&mesh).await?.iter().any(|a| a == "POST /v1/tokens"));
    grows(&mesh, REPLICA_READS, before).await?;

    // The event history (`follow=false`) too, once the replica holds every
    // event appended when it was asked: the nodes' events are in it, and
    // the replica served it.
    wait_for("the nodes' events in the history", WITHIN, || async {
        Ok(names_all(&history(&mesh).await?, &nodes).then_some(()))
    })
    .await?;
    let before = count(&mesh, REPLICA_READS).await?;
    ensure!(names_all(&history(&mesh).await?, &nodes));
    grows(&mesh, REPLICA_READS, before).await?;

    // What lag was: measured commit to replay, and what the controller saw.
    let took = measure_lag(&mesh, &replica, 20).await?;
    eprintln!(
        "replication lag, commit on the primary to replay on the replica, 20 commits: median {:?}, max {:?}; mesh_controller_replica_lag_seconds now {:?}",
        took[took.len() / 2],
        took[took.len() - 1],
        sample(&mesh, LAG).await?
    );

    // The replica stops: every answer stays 200 (the primary's), and the
    // controller marks the replica unusable.
    // (A request in flight meanwhile may be the one that finds it gone: it
    // is answered by the primary all the same.)
    let primary_before = count(&mesh, PRIMARY_READS).await?;
    replica.down()?;
    let deadline = Instant::now() + WITHIN;
    let mut answered = 0;
    loop {
        let ids = listed(&mesh).await?;
        ensure!(nodes.iter().all(|n| ids.contains(n)), "{ids:?}");
        ensure!(
            audited(&mesh).await?.iter().any(|a| a == "POST /v1/tokens"),
            "the audit entry is gone"
        );
        ensure!(
            names_all(&history(&mesh).await?, &nodes),
            "the nodes' events are gone from the history"
        );
        answered += 3;
        if sample(&mesh, USABLE).await? == Some(0.0) {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "the stopped replica is still usable after {WITHIN:?}"
        );
    }
    grows(&mesh, PRIMARY_READS, primary_before).await?;
    // From then on, the primary serves every one of them.
    let replica_reads = count(&mesh, REPLICA_READS).await?;
    let primary_reads = count(&mesh, PRIMARY_READS).await?;
    let ids = listed(&mesh).await?;
    ensure!(nodes.iter().all(|n| ids.contains(n)), "{ids:?}");
    ensure!(names_all(&history(&mesh).await?, &nodes));
    grows(&mesh, PRIMARY_READS, primary_reads).await?;
    ensure!(
        count(&mesh, REPLICA_READS).await? == replica_reads,
        "a read went to the stopped replica"
    );
    eprintln!("{answered} answers while the replica stopped, every one 200");
    mesh.teardown().await
}
