//! A module's unit output through the agents (decision 0033), end to end:
//! real agents run a unit that prints; `meshctl logs` shows its lines per
//! node (prefixed when several answer), `--node` selects one, `--follow` sees
//! a line printed after it started. The route needs the operator role (a
//! viewer gets 403) and is audited; bad input is a 4xx naming the field. A
//! node that never answers (a simulated node: it beats, it never reads its
//! queue) is named in a 504 that still carries a cursor; an answer forged by
//! another node for that request, and one naming no request, change nothing
//! and are dead-lettered `unsolicited` with the reason.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lapin::options::{BasicAckOptions, BasicGetOptions};
use mesh_e2e::sim::SimNode;
use mesh_e2e::{Mesh, bin, drain_dead_letters, publish_as, wait_for};
use mesh_protocol::{
    Envelope, LogPosition, LogStream, Logs, LogsRequest, NodeId, Report, StreamLogs, UnitLogs,
};
use reqwest::Method;
use serde_json::{Value, json};

const WITHIN: Duration = Duration::from_secs(30);

async fn put_module(mesh: &Mesh, name: &str, spec: &Value) -> anyhow::Result<()> {
    let (status, body) = mesh.put(&format!("/v1/modules/{name}"), spec).await?;
    anyhow::ensure!(
        status == 200 || status == 201,
        "PUT module {name}: {status} {body}"
    );
    Ok(())
}

/// Nodes whose replica of `module` reports running.
async fn running_on(mesh: &Mesh, module: &str, n: usize) -> anyhow::Result<Vec<String>> {
    wait_for(
        &format!("{n} running replicas of {module}"),
        WITHIN,
        || async {
            let (_, view) = mesh.get(&format!("/v1/modules/{module}")).await?;
            let nodes: Vec<String> = view["assignments"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|a| a["unit_state"] == "running")
                .filter_map(|a| a["node"].as_str().map(str::to_owned))
                .collect();
            Ok((nodes.len() == n).then_some(nodes))
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn unit_output_through_the_agents() -> anyhow::Result<()> {
    let mut mesh = Mesh::prepare().await?;
    // A short wait, so the node that never answers costs seconds.
    let config = mesh.dir.path().join("controller.toml");
    let mut text = std::fs::read_to_string(&config)?;
    text.push_str("logs_wait_ms = 4000\n");
    std::fs::write(&config, text)?;
    mesh.start_controller(&[]).await?;
    let a = mesh.add_agent("a", &[("role", "web")]).await?;
    let b = mesh.add_agent("b", &[("role", "web")]).await?;

    // Each replica prints two lines, then one more once `./more` exists in
    // its agent's root (its working directory).
    let script = "echo \"hello from $MESH_UNIT\"; echo \"to stderr from $MESH_UNIT\" >&2; \
                  while [ ! -f ./more ]; do sleep 0.2; done; echo \"after follow\"; exec sleep 1000";
    put_module(
        &mesh,
        "chatty",
        &json!({
            "unit": {"command": "sh", "args": ["-c", script]},
            "placement": {"match_labels": {"labels": {"role": "web"}, "replicas": 2}}
        }),
    )
    .await?;
    let mut nodes = running_on(&mesh, "chatty", 2).await?;
    nodes.sort();
    assert_eq!(nodes, [a.clone(), b.clone()]);

    // Both nodes answer: every line prefixed with its node.
    let (out, err) = wait_for("both nodes' lines", WITHIN, || async {
        let (code, out, err) = mesh.meshctl(&["logs", "chatty"])?;
        anyhow::ensure!(code == 0, "meshctl logs: {code} {err}");
        Ok((out.matches("hello from").count() == 2).then_some((out, err)))
    })
    .await?;
    for node in [&a, &b] {
        assert!(
            out.lines()
                .any(|l| l.starts_with(&format!("[{node}] hello from chatty-"))),
            "{node} missing from:\n{out}"
        );
        assert!(
            err.contains(&format!("[{node}] to stderr from chatty-")),
            "{node}'s stderr line missing from:\n{err}"
        );
    }

    // One node: its lines alone, unprefixed.
    let (code, out, err) = mesh.meshctl(&["logs", "chatty", "--node", &a])?;
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.matches("hello from").count(), 1, "{out}");
    assert!(out.starts_with("hello from chatty-"), "{out}");

    // --follow sees a line printed after it started.
    let mut follow = Command::new(bin("meshctl")?)
        .args([
            "logs",
            "chatty",
            "--node",
            &a,
            "--follow",
            "--interval",
            "1",
        ])
        .env("MESH_API", &mesh.api)
        .env("MESH_TOKEN", mesh.admin_token())
        .env_remove("MESH_TOKEN_FILE")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let seen = Arc::new(Mutex::new(String::new()));
    let reader = {
        let seen = seen.clone();
        let stdout = follow.stdout.take().expect("piped");
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Ok(mut s) = seen.lock() {
                    s.push_str(&line);
                    s.push('\n');
                }
            }
        })
    };
    let text = |seen: &Arc<Mutex<String>>| seen.lock().map(|s| s.clone()).unwrap_or_default();
    wait_for("--follow to print the first lines", WITHIN, || async {
        Ok(text(&seen).contains("hello from").then_some(()))
    })
    .await?;
    assert!(!text(&seen).contains("after follow"));
    std::fs::write(mesh.agent(&a).root.join("more"), "")?;
    wait_for("--follow to print the new line", WITHIN, || async {
        Ok(text(&seen).contains("after follow").then_some(()))
    })
    .await?;
    let _ = follow.kill();
    let _ = follow.wait();
    let _ = reader.join();
    let followed = text(&seen);
    assert_eq!(
        followed.matches("hello from").count(),
        1,
        "a line shown twice:\n{followed}"
    );

    // A viewer may not read output; an operator may; both are audited.
    let viewer = mesh.create_token("log-viewer", "viewer").await?;
    let (status, body) = mesh
        .request_as(Method::GET, "/v1/modules/chatty/logs", Some(&viewer), None)
        .await?;
    assert_eq!(status, 403, "{body}");
    let operator = mesh.create_token("log-operator", "operator").await?;
    let (status, body) = mesh
        .request_as(
            Method::GET,
            "/v1/modules/chatty/logs?tail=1",
            Some(&operator),
            None,
        )
        .await?;
    assert_eq!(status, 200, "{body}");
    for (who, outcome) in [("log-viewer", "denied"), ("log-operator", "ok")] {
        wait_for(&format!("the audit entry of {who}"), WITHIN, || async {
            let (_, log) = mesh.get(&format!("/v1/audit?principal={who}")).await?;
            let found = log["entries"].as_array().into_iter().flatten().any(|e| {
                e["action"] == "GET /v1/modules/{name}/logs"
                    && e["target"] == "/v1/modules/chatty/logs"
                    && e["outcome"] == outcome
            });
            Ok(found.then_some(()))
        })
        .await?;
    }

    // Bad input names the field.
    for (path, status, field) in [
        ("/v1/modules/chatty/logs?tail=0", 422, "tail"),
        ("/v1/modules/chatty/logs?tail=5000", 422, "tail"),
        ("/v1/modules/chatty/logs?node=nowhere", 422, "node"),
        ("/v1/modules/chatty/logs?node=Not_A_Node", 422, "node"),
        ("/v1/modules/chatty/logs?after=%21%21", 422, "after"),
        ("/v1/modules/absent/logs", 404, "name"),
    ] {
        let (got, body) = mesh.get(path).await?;
        assert_eq!(got, status, "{path}: {body}");
        assert_eq!(body["field"], field, "{path}: {body}");
    }
    let (code, _, err) = mesh.meshctl(&["logs", "chatty", "--tail", "0"])?;
    assert_eq!(code, 1);
    assert!(err.contains("field: tail"), "{err}");

    // A node that beats but never reads its queue (as an agent older than
    // logs requests would not answer them).
    let ghost_creds = mesh.env.add_node("ghost").await?;
    let ghost = ghost_creds.node.as_str().to_owned();
    let mut sim = SimNode::connect(ghost_creds).await?;
    let hello = sim.hello(&[]);
    sim.send(&hello).await?.await?;
    let beating = tokio::spawn(async move {
        loop {
            let beat = sim.heartbeat(Default::default());
            if sim.send(&beat).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    });
    put_module(
        &mesh,
        "ghostly",
        &json!({
            "unit": {"command": "sleep", "args": ["1000"]},
            "placement": {"exact_node": {"node": ghost}}
        }),
    )
    .await?;
    wait_for("ghostly placed on the ghost", WITHIN, || async {
        let (_, view) = mesh.get("/v1/modules/ghostly").await?;
        Ok((view["assignments"][0]["node"] == ghost.as_str()).then_some(()))
    })
    .await?;
    let asked = {
        let api = mesh.api.clone();
        let token = mesh.admin_token().to_owned();
        tokio::spawn(async move {
            let r = reqwest::Client::new()
                .get(format!("{api}/v1/modules/ghostly/logs"))
                .bearer_auth(token)
                .send()
                .await?;
            let status = r.status().as_u16();
            anyhow::Ok((status, r.json::<Value>().await?))
        })
    };
    // The request waits in the ghost's queue: read it (as the vhost's
    // administrator) to learn its id.
    let conn = lapin::Connection::connect(&mesh.env.admin_amqp_url(), Default::default()).await?;
    let ch = conn.create_channel().await?;
    let queue = format!("decl.{ghost}");
    let (request_id, expiration) =
        wait_for("the logs request in the ghost's queue", WITHIN, || async {
            while let Some(m) = ch
                .basic_get(queue.as_str().into(), BasicGetOptions::default())
                .await?
            {
                m.delivery.acker.ack(BasicAckOptions::default()).await?;
                let props = &m.delivery.properties;
                if props.kind().as_ref().map(|k| k.as_str()) == Some(LogsRequest::KIND) {
                    let env = Envelope::<LogsRequest>::decode(&m.delivery.data, 1 << 20)?;
                    assert_eq!(env.body.module, "ghostly");
                    let expiration = props.expiration().as_ref().map(|e| e.as_str().to_owned());
                    return Ok(Some((env.id, expiration)));
                }
            }
            Ok(None)
        })
        .await?;
    assert_eq!(
        expiration.as_deref(),
        Some("4000"),
        "the request expires with the wait"
    );
    let _ = conn.close(200, "done".into()).await;
    // Node b answers the ghost's request, with lines of its own making.
    let b_creds = mesh.agent(&b).creds.clone();
    let b_id = NodeId::parse(&b)?;
    let forged = |request| {
        Envelope::new(
            b_id.clone(),
            1,
            Report::Logs(Logs {
                request,
                module: "ghostly".into(),
                units: vec![UnitLogs {
                    unit: "ghostly".into(),
                    streams: vec![StreamLogs {
                        stream: LogStream::Stdout,
                        lines: vec!["forged line".into()],
                        position: LogPosition {
                            unit: "ghostly".into(),
                            stream: LogStream::Stdout,
                            file: 1,
                            offset: 1,
                            check: 0,
                        },
                        gap: false,
                        more: false,
                    }],
                }],
                error: None,
            }),
        )
        .encode()
    };
    publish_as(&b_creds, &format!("{b}.logs"), &forged(request_id), true).await?;
    publish_as(
        &b_creds,
        &format!("{b}.logs"),
        &forged(uuid::Uuid::now_v7()),
        true,
    )
    .await?;
    let (status, body) = asked.await??;
    assert_eq!(status, 504, "{body}");
    assert_eq!(body["missing"], json!([ghost.as_str()]), "{body}");
    assert!(
        body["detail"].as_str().unwrap_or("").contains(&ghost),
        "{body}"
    );
    assert_eq!(body["nodes"][0]["status"], "timeout", "{body}");
    assert_eq!(
        body["nodes"][0]["units"],
        json!([]),
        "the forged lines: {body}"
    );
    assert!(body["cursor"].is_string(), "{body}");
    // Both forged answers are dead-lettered, with the reason.
    let letters = wait_for("the forged answers dead-lettered", WITHIN, || async {
        let mut all = drain_dead_letters(&mesh.env.admin_amqp_url()).await?;
        all.retain(|(code, _, _)| code == "unsolicited");
        Ok((all.len() >= 2).then_some(all))
    })
    .await?;
    assert!(
        letters.iter().any(|(_, reason, user)| reason
            .contains(&format!("which asked node `{ghost}`"))
            && user.as_deref() == Some(b.as_str())),
        "{letters:?}"
    );
    assert!(
        letters
            .iter()
            .any(|(_, reason, _)| reason.contains("never made")),
        "{letters:?}"
    );
    // meshctl names the node that did not answer, prints what came, exits 1.
    let (code, _, err) = mesh.meshctl(&["logs", "ghostly"])?;
    assert_eq!(code, 1, "{err}");
    assert!(err.contains(&format!("no output from {ghost}")), "{err}");
    beating.abort();

    // The controller counted all of it.
    let metrics = mesh_e2e::sim::metrics(&mesh).await?;
    for (name, filter) in [
        (
            "mesh_controller_logs_requests_total",
            "outcome=\"answered\"",
        ),
        ("mesh_controller_logs_requests_total", "outcome=\"timeout\""),
        ("mesh_controller_logs_answers_total", "outcome=\"accepted\""),
        (
            "mesh_controller_logs_answers_total",
            "outcome=\"unsolicited\"",
        ),
        ("mesh_controller_logs_timeouts_total", ""),
    ] {
        assert!(
            mesh_e2e::sim::metric_sum(&metrics, name, filter) >= 1.0,
            "{name}{{{filter}}}:\n{metrics}"
        );
    }
    mesh.teardown().await
}
