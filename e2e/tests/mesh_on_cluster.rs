//! The mesh on a three-node RabbitMQ cluster (`bundle/rabbit-cluster`,
//! decisions 0042 and 0043), beside the machine's own broker, which it never
//! touches. The cluster is raised in a temporary directory and taken down by
//! a guard whatever the outcome; the test environment's vhost and users are
//! provisioned through node 1's management API.
//!
//! The controller runs with `queue_type = "quorum"` and `broker_endpoints` =
//! the three nodes, its credentials naming node 2; agent a's credentials name
//! node 2 too, agent b's node 1; both have `brokers` = the three nodes.
//! Heartbeats stream throughout. Node 2 is SIGKILLed as a file changes (the
//! declaration and the agents' applied reports cross the kill): the
//! controller and agent a fail over; that change and one made while node 2
//! is down reach both agents, and both report them applied (applied ==
//! declared); every applied report the broker confirmed to an agent was
//! handled by the controller (the agents' and the controller's metrics).
//! Node 2 is started again, rejoins (three running members), and a further
//! change lands too.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context as _, anyhow, ensure};
use mesh_e2e::sim::{metric_sum, metrics};
use mesh_e2e::{Mesh, wait_for};
use mesh_testkit::TestEnv;
use serde_json::{Value, json};

const WITHIN: Duration = Duration::from_secs(120);

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

    fn port(&self, key: &str) -> anyhow::Result<u16> {
        self.var(key)?
            .parse()
            .with_context(|| format!("cluster.env {key} is not a port"))
    }

    fn name(&self, n: usize) -> anyhow::Result<&str> {
        self.var(&format!("N{n}_NAME"))
    }

    async fn run(&self, verb: &str, rest: &[&str]) -> anyhow::Result<String> {
        let dir = self.dir.to_string_lossy().into_owned();
        let mut args = vec![verb, dir.as_str()];
        args.extend_from_slice(rest);
        rabbit_cluster(&args, Duration::from_secs(400)).await
    }

    /// `rabbitmqctl list_queues name type` as node `n` sees them, for
    /// `vhost`.
    async fn queue_types(&self, n: usize, vhost: &str) -> anyhow::Result<BTreeMap<String, String>> {
        let nth = n.to_string();
        let out = self
            .run(
                "ctl",
                &[
                    &nth,
                    "-q",
                    "list_queues",
                    "-p",
                    vhost,
                    "name",
                    "type",
                    "--formatter",
                    "json",
                ],
            )
            .await?;
        let list: Vec<Value> = serde_json::from_str(out.trim())
            .with_context(|| format!("list_queues as node {n}: {out}"))?;
        Ok(list
            .into_iter()
            .filter_map(|q| {
                Some((
                    q["name"].as_str()?.to_owned(),
                    q["type"].as_str()?.to_owned(),
                ))
            })
            .collect())
    }
}

fn with_port(url: &str, port: u16) -> anyhow::Result<String> {
    let mut u = url::Url::parse(url).context("a broker URL of the test environment")?;
    u.set_port(Some(port))
        .map_err(|()| anyhow!("cannot set the port of a broker URL"))?;
    Ok(u.to_string())
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// The reports of `kind` the broker confirmed to the agent whose metrics
/// are on `port`.
async fn published(port: u16, kind: &str) -> anyhow::Result<f64> {
    let text = reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
        .await?
        .text()
        .await?;
    Ok(metric_sum(
        &text,
        "mesh_agent_reports_published_total",
        &format!("kind=\"{kind}\""),
    ))
}

fn step(started: Instant, what: &str) {
    eprintln!("[{:>6.1} s] {what}", started.elapsed().as_secs_f64());
}

async fn declare_motd(mesh: &Mesh, content: &str) -> anyhow::Result<()> {
    let (status, body) = mesh
        .put(
            "/v1/files/motd",
            &json!({"path": "/etc/motd", "content": content, "mode": "0644", "selector": {"role": "web"}}),
        )
        .await?;
    ensure!(status == 200 || status == 201, "PUT file: {status} {body}");
    Ok(())
}

/// `node` has the file with `content` and reports config `generation`
/// applied == declared; if not in time, the error carries the end of the
/// node's agent log and of the controller's.
async fn converged(mesh: &Mesh, node: &str, content: &str, generation: u64) -> anyhow::Result<()> {
    converging(mesh, node, content, generation)
        .await
        .map_err(|e| {
            let tail = |log: String| {
                let lines: Vec<&str> = log.lines().collect();
                lines[lines.len().saturating_sub(40)..].join("\n")
            };
            e.context(format!(
                "agent {node}'s log ends:\n{}\ncontroller's log ends:\n{}",
                tail(mesh.log_of(&format!("agent-{node}"))),
                tail(mesh.controller_log())
            ))
        })
}

async fn converging(mesh: &Mesh, node: &str, content: &str, generation: u64) -> anyhow::Result<()> {
    let path = mesh.agent(node).file("/etc/motd");
    wait_for(
        &format!("{node} to apply config generation {generation}"),
        WITHIN,
        || {
            let path = path.clone();
            async move {
                if std::fs::read_to_string(&path).ok().as_deref() != Some(content) {
                    return Ok(None);
                }
                let (status, view) = mesh.get(&format!("/v1/nodes/{node}")).await?;
                ensure!(status == 200, "GET node: {status} {view}");
                let config = &view["sections"]["config"];
                Ok((config["declared"] == json!(generation)
                    && config["applied"] == json!(generation))
                .then_some(()))
            }
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn the_mesh_survives_a_broker_node_killed_under_it() -> anyhow::Result<()> {
    let started = Instant::now();
    // Declared first, dropped last: the mesh (and its environment's
    // teardown through node 1) goes before the cluster.
    let cluster = Cluster::up().await?;
    step(started, "cluster up");
    let amqp = [
        cluster.port("N1_AMQP")?,
        cluster.port("N2_AMQP")?,
        cluster.port("N3_AMQP")?,
    ];
    let env = TestEnv::on_broker(amqp[0], cluster.port("N1_MGMT")?).await?;
    let vhost = env.vhost().to_owned();
    let mut mesh = Mesh::prepare_on(env)?;
    let endpoints = amqp
        .iter()
        .map(|p| format!("\"127.0.0.1:{p}\""))
        .collect::<Vec<_>>()
        .join(", ");

    // The controller on node 2, quorum queues, all three endpoints.
    let mut creds = mesh.env.controller_credentials();
    creds.broker_url =
        mesh_credentials::Secret::new(with_port(creds.broker_url.expose(), amqp[1])?);
    creds.write(&mesh.dir.path().join("credentials.toml"))?;
    let toml_path = mesh.dir.path().join("controller.toml");
    let mut settings = std::fs::read_to_string(&toml_path)?;
    settings.push_str(&format!(
        "queue_type = \"quorum\"\nbroker_endpoints = [{endpoints}]\n"
    ));
    std::fs::write(&toml_path, settings)?;
    mesh.start_controller(&[]).await?;
    let on_node2 = format!("127.0.0.1:{}", amqp[1]);
    wait_for("the controller's session on node 2", WITHIN, || async {
        Ok(mesh
            .controller_log()
            .lines()
            .any(|l| l.contains("broker session started") && l.contains(&on_node2))
            .then_some(()))
    })
    .await?;
    step(started, "controller on node 2");

    // Two agents with all three endpoints, each serving its metrics; a's
    // credentials name node 2.
    let metrics_a = free_port()?;
    let metrics_b = free_port()?;
    let agent_toml =
        |port: u16| format!("brokers = [{endpoints}]\nmetrics_listen = \"127.0.0.1:{port}\"\n");
    mesh.agent_toml = Some(agent_toml(metrics_a));
    let a = mesh.add_agent("a", &[("role", "web")]).await?;
    mesh.stop_agent(&a);
    let state_dir = mesh.agent(&a).state_dir.clone();
    let mut agent_creds = mesh.agent(&a).creds.agent_credentials()?;
    agent_creds.broker_url =
        mesh_credentials::Secret::new(with_port(agent_creds.broker_url.expose(), amqp[1])?);
    agent_creds.write(&state_dir)?;
    mesh.start_agent(&a)?;
    mesh.agent_toml = Some(agent_toml(metrics_b));
    let b = mesh.add_agent("b", &[("role", "web")]).await?;

    declare_motd(&mesh, "one\n").await?;
    converged(&mesh, &a, "one\n", 1).await?;
    converged(&mesh, &b, "one\n", 1).await?;
    step(started, "both agents applied generation 1");

    // The queues whose loss would lose something are quorum queues.
    let types = cluster.queue_types(1, &vhost).await?;
    for queue in [
        "reports.hello".to_owned(),
        "reports.applied".to_owned(),
        format!("decl.{a}"),
        format!("decl.{b}"),
    ] {
        ensure!(
            types.get(&queue).map(String::as_str) == Some("quorum"),
            "{queue} is not a quorum queue: {types:?}"
        );
    }

    // Kill node 2 (the controller's and agent a's) as the file changes:
    // the declaration and the agents' applied reports cross the kill while
    // heartbeats stream.
    let controller_log_len = mesh.controller_log().len();
    let (killed, declared) = tokio::join!(
        cluster.run("stop-node", &["2", "--kill"]),
        declare_motd(&mesh, "two\n")
    );
    killed?;
    declared?;
    step(started, "node 2 killed as generation 2 was declared");
    converged(&mesh, &a, "two\n", 2).await?;
    converged(&mesh, &b, "two\n", 2).await?;
    step(started, "both agents applied generation 2");
    let (node1, node3) = (
        format!("127.0.0.1:{}", amqp[0]),
        format!("127.0.0.1:{}", amqp[2]),
    );
    wait_for(
        "the controller's session on node 1 or 3 after the kill",
        WITHIN,
        || async {
            let log = mesh.controller_log();
            let after = log.get(controller_log_len..).unwrap_or_default();
            Ok(after
                .lines()
                .any(|l| {
                    l.contains("broker session started")
                        && (l.contains(&node1) || l.contains(&node3))
                })
                .then_some(()))
        },
    )
    .await?;
    step(started, "the controller moved to a surviving node");
    // A change made while node 2 is down lands on both.
    declare_motd(&mesh, "three\n").await?;
    converged(&mesh, &a, "three\n", 3).await?;
    converged(&mesh, &b, "three\n", 3).await?;
    step(
        started,
        "both agents applied generation 3 while node 2 is down",
    );
    // No applied report lost: every one the broker confirmed to an agent
    // was handled by the controller (a redelivery counts twice, so at
    // least as many; one lost with the killed node would leave fewer).
    wait_for(
        "the controller to handle every confirmed applied report",
        WITHIN,
        || async {
            let confirmed =
                published(metrics_a, "applied").await? + published(metrics_b, "applied").await?;
            let handled = metric_sum(
                &metrics(&mesh).await?,
                "mesh_controller_messages_handled_total",
                "queue=\"reports.applied\"",
            );
            Ok((confirmed >= 4.0 && handled >= confirmed).then_some((confirmed, handled)))
        },
    )
    .await
    .map(|(confirmed, handled)| {
        step(
            started,
            &format!("applied reports: {confirmed} confirmed to the agents, {handled} handled"),
        )
    })?;

    // Node 2 back: it rejoins, and a further change lands.
    cluster.run("start-node", &["2"]).await?;
    let all: Vec<String> = (1..=3)
        .map(|n| cluster.name(n).map(str::to_owned))
        .collect::<anyhow::Result<_>>()?;
    wait_for(
        "three running members",
        Duration::from_secs(180),
        || async {
            let status = cluster.run("status", &[]).await?;
            let running = status
                .lines()
                .find_map(|l| l.split_once("running (as node ").map(|(_, r)| r.to_owned()))
                .unwrap_or_default();
            Ok(all
                .iter()
                .all(|n| running.contains(n.as_str()))
                .then_some(()))
        },
    )
    .await?;
    step(started, "node 2 rejoined");
    declare_motd(&mesh, "four\n").await?;
    converged(&mesh, &a, "four\n", 4).await?;
    converged(&mesh, &b, "four\n", 4).await?;
    step(started, "both agents applied generation 4");
    mesh.teardown().await?;
    drop(cluster);
    Ok(())
}
