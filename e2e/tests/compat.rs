//! Version skew against a real controller and broker (decision 0020):
//! - a report or record event with fields this version does not know is
//!   handled, and the fields are counted (`mesh_controller_unknown_fields_total{kind}`);
//! - an unknown report kind on an existing queue, and an unknown record event,
//!   are dead-lettered with reason `unknown_kind`, and the rest flows;
//! - leniency loosens no security: identity is still the `user_id`, a body
//!   naming another node is still refused, even with unknown fields;
//! - an agent whose protocol range excludes the controller's is refused, the
//!   reason in its node view, and nothing is declared to it until it says
//!   hello in a version the controller speaks.

use std::time::Duration;

use anyhow::Context;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use mesh_e2e::sim::{SimNode, add_nodes, metric_sum, metrics, scalar};
use mesh_e2e::{Mesh, drain_dead_letters, wait_for};
use mesh_protocol::{Envelope, Report, Section};
use serde_json::{Value, json};

fn as_json(env: &Envelope<Report>) -> Value {
    serde_json::from_slice(&env.encode()).unwrap_or(Value::Null)
}

/// Publish to the `record` exchange as the vhost's administrator, as another
/// context's relay would.
async fn publish_record(mesh: &Mesh, key: &str, payload: &[u8]) -> anyhow::Result<()> {
    let conn = lapin::Connection::connect(&mesh.env.admin_amqp_url(), Default::default()).await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let confirm = ch
        .basic_publish(
            "record".into(),
            key.into(),
            BasicPublishOptions::default(),
            payload,
            lapin::BasicProperties::default()
                .with_message_id(uuid::Uuid::now_v7().to_string().as_str().into())
                .with_content_type("application/json".into())
                .with_delivery_mode(2),
        )
        .await?
        .await?;
    anyhow::ensure!(
        confirm.is_ack(),
        "record publish not confirmed: {confirm:?}"
    );
    let _ = conn.close(200, "done".into()).await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn unknown_fields_are_handled_and_counted_unknown_kinds_dead_lettered() -> anyhow::Result<()>
{
    let mesh = Mesh::start().await?;
    let mut creds = add_nodes(&mesh.env, "k", 2).await?;
    let other = creds.pop().context("two nodes")?;
    let mut node = SimNode::connect(creds.pop().context("two nodes")?).await?;
    let id = node.node().to_string();
    let applied_key = format!("{id}.applied");

    // A hello from a newer agent: unknown fields in the envelope and the body.
    let mut hello = as_json(&node.hello(&[("role", "skew")]));
    hello["trace"] = json!({"span": "abc"});
    hello["body"]["gpu"] = json!({"model": "none", "count": 0});
    node.raw(
        &format!("{id}.hello"),
        hello.to_string().as_bytes(),
        None,
        true,
    )
    .await?
    .await?;
    // Reports of different kinds travel on different queues: wait for the hello
    // to be handled, so the applied report below finds its node (an applied
    // report of a node inventory does not know yet is not recorded; a real
    // agent's next heartbeat carries its applied generations again).
    wait_for(
        "the hello to be handled",
        Duration::from_secs(30),
        || async {
            let (status, _) = mesh.get(&format!("/v1/nodes/{id}")).await?;
            Ok((status == 200).then_some(()))
        },
    )
    .await?;
    // An applied report with an unknown field, then one of an unknown kind on
    // the same (existing) queue, then one naming another node.
    let mut applied = as_json(&node.applied(Section::Config, 1));
    applied["body"]["duration_ms"] = json!(12);
    node.raw(&applied_key, applied.to_string().as_bytes(), None, true)
        .await?
        .await?;
    let mut bogus = as_json(&node.applied(Section::Config, 2));
    bogus["kind"] = json!("bogus");
    node.raw(&applied_key, bogus.to_string().as_bytes(), None, true)
        .await?
        .await?;
    let mut impostor = as_json(&node.applied(Section::Config, 3));
    impostor["node"] = json!(other.node.as_str());
    impostor["body"]["extra"] = json!(true);
    node.raw(&applied_key, impostor.to_string().as_bytes(), None, true)
        .await?
        .await?;
    let mut anonymous = as_json(&node.applied(Section::Config, 4));
    anonymous["body"]["extra"] = json!(true);
    node.raw(&applied_key, anonymous.to_string().as_bytes(), None, false)
        .await?
        .await?;

    // Record events: a known one with an unknown field, and an unknown one.
    let joined = json!({
        "v": 1, "id": uuid::Uuid::now_v7(), "context": "inventory", "event": "node.updated",
        "sent_at": "2026-11-30T12:00:00Z", "future": 1,
        "body": {"node": "x-rec", "labels": {}, "version": 1, "zone": "eu"},
    });
    publish_record(
        &mesh,
        "inventory.node.updated",
        joined.to_string().as_bytes(),
    )
    .await?;
    let exploded = json!({
        "v": 1, "id": uuid::Uuid::now_v7(), "context": "inventory", "event": "node.exploded",
        "sent_at": "2026-11-30T12:00:00Z", "body": {"node": "x-rec"},
    });
    publish_record(
        &mesh,
        "inventory.node.exploded",
        exploded.to_string().as_bytes(),
    )
    .await?;

    // The hello and the applied report were handled.
    let view = wait_for(
        "the applied report to be recorded",
        Duration::from_secs(30),
        || async {
            let (status, view) = mesh.get(&format!("/v1/nodes/{id}")).await?;
            Ok(
                (status == 200 && view["applied"]["config"]["generation"] == json!(1))
                    .then_some(view),
            )
        },
    )
    .await?;
    assert_eq!(view["labels"]["effective"]["role"], json!("skew"), "{view}");
    assert_eq!(view["refused"], Value::Null, "{view}");
    // The config context handled the known record event despite its unknown fields.
    wait_for("config to learn x-rec", Duration::from_secs(30), || async {
        let n = scalar(
            &mesh.env,
            "config",
            "SELECT count(*) FROM config.nodes WHERE node = 'x-rec'",
        )
        .await?;
        Ok((n == 1).then_some(()))
    })
    .await?;

    // Counted, by kind: 2 in the hello, 1 in the applied, 2 in the record
    // event for each context that consumes it (config, connectivity and
    // observability subscribe to inventory.node.*: each copy is decoded, and
    // counted, once).
    let counted = wait_for(
        "unknown fields to be counted",
        Duration::from_secs(30),
        || async {
            let text = metrics(&mesh).await?;
            let sum = |kind: &str| {
                metric_sum(
                    &text,
                    "mesh_controller_unknown_fields_total",
                    &format!("kind=\"{kind}\""),
                )
            };
            let got = (sum("hello"), sum("applied"), sum("inventory.node.updated"));
            Ok((got.0 >= 2.0 && got.1 >= 1.0 && got.2 >= 6.0).then_some(got))
        },
    )
    .await?;
    assert_eq!(counted, (2.0, 1.0, 6.0));

    // Dead-lettered, each with its reason: the unknown report kind, the
    // unknown record event (unknown_kind: once from each record queue it was
    // routed to, config's and connectivity's, bound to inventory.node.*;
    // observability binds each known event by name, so it never gets it),
    // the impostor and the anonymous one.
    wait_for(
        "five dead letters counted",
        Duration::from_secs(30),
        || async {
            let text = metrics(&mesh).await?;
            Ok((metric_sum(&text, "mesh_controller_dead_lettered_total", "") >= 5.0).then_some(()))
        },
    )
    .await?;
    let mut letters = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while letters.len() < 5 && tokio::time::Instant::now() < deadline {
        letters.extend(drain_dead_letters(&mesh.env.admin_amqp_url()).await?);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut codes: Vec<&str> = letters.iter().map(|(c, _, _)| c.as_str()).collect();
    codes.sort_unstable();
    assert_eq!(
        codes,
        [
            "impersonation",
            "unauthenticated",
            "unknown_kind",
            "unknown_kind",
            "unknown_kind"
        ],
        "{letters:?}"
    );
    assert!(
        letters
            .iter()
            .any(|(c, r, _)| c == "unknown_kind" && r.contains("inventory.node.exploded")),
        "{letters:?}"
    );
    assert!(
        letters.iter().any(|(c, r, u)| c == "unknown_kind"
            && r.contains("bogus")
            && u.as_deref() == Some(id.as_str())),
        "{letters:?}"
    );
    // The impostor's claim changed nothing of the other node.
    let (status, _) = mesh.get(&format!("/v1/nodes/{}", other.node)).await?;
    assert_eq!(status, 404);

    // Nothing stopped: a later report is still handled.
    let later = node.applied(Section::Config, 5);
    node.send(&later).await?.await?;
    wait_for("the later report", Duration::from_secs(30), || async {
        let (_, view) = mesh.get(&format!("/v1/nodes/{id}")).await?;
        Ok((view["applied"]["config"]["generation"] == json!(5)).then_some(()))
    })
    .await?;
    node.close().await;
    mesh.teardown().await
}

/// Rows of the inventory outbox about node `id` that match `what`.
async fn outbox(mesh: &Mesh, id: &str, what: &str) -> anyhow::Result<i64> {
    scalar(
        &mesh.env,
        "inventory",
        &format!(
            "SELECT count(*) FROM inventory.outbox WHERE {what} AND \
             (node = '{id}' OR convert_from(payload, 'UTF8')::jsonb -> 'body' ->> 'node' = '{id}')"
        ),
    )
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn an_agent_the_controller_cannot_speak_to_is_refused_with_a_reason() -> anyhow::Result<()> {
    let mesh = Mesh::start().await?;
    let (status, body) = mesh
        .put(
            "/v1/files/motd",
            &json!({"path": "/etc/motd", "content": "skew", "mode": "0644", "selector": {"role": "skew"}}),
        )
        .await?;
    assert!(status < 300, "PUT file: {status} {body}");
    let mut creds = add_nodes(&mesh.env, "r", 1).await?;
    let mut node = SimNode::connect(creds.pop().context("one node")?).await?;
    let id = node.node().to_string();

    // A hello (always a v1 envelope) from an agent that speaks v2..v3 only.
    let mut hello = as_json(&node.hello(&[("role", "skew")]));
    hello["body"]["protocol"] = json!({"min": 2, "max": 3});
    node.raw(
        &format!("{id}.hello"),
        hello.to_string().as_bytes(),
        None,
        true,
    )
    .await?
    .await?;
    let view = wait_for(
        "the refusal in the node's view",
        Duration::from_secs(30),
        || async {
            let (status, view) = mesh.get(&format!("/v1/nodes/{id}")).await?;
            Ok((status == 200 && view["refused"].is_string()).then_some(view))
        },
    )
    .await?;
    let reason = view["refused"].as_str().unwrap_or_default();
    assert!(
        reason.contains("v2..v3") && reason.contains("v1..v1"),
        "the reason names both ranges: {reason}"
    );
    assert_eq!(view["state"], json!("refused"), "{view}");
    assert_eq!(view["protocol"], json!({"min": 2, "max": 3}), "{view}");
    // Declared nothing, told nobody: no declaration and no node.joined in the
    // inventory outbox (the same transaction as the refusal), so config never
    // hears of the node.
    assert_eq!(
        outbox(&mesh, &id, "true").await?,
        0,
        "nothing written for a refused node"
    );
    let sections = format!("SELECT count(*) FROM config.sections WHERE node = '{id}'");
    assert_eq!(scalar(&mesh.env, "config", &sections).await?, 0);

    // The same node upgraded to an agent that speaks v1: the refusal lifts,
    // it joins, and config declares its section.
    let hello = node.hello(&[("role", "skew")]);
    node.send(&hello).await?.await?;
    wait_for(
        "config to declare the node's section",
        Duration::from_secs(30),
        || async { Ok((scalar(&mesh.env, "config", &sections).await? == 1).then_some(())) },
    )
    .await?;
    let (_, view) = mesh.get(&format!("/v1/nodes/{id}")).await?;
    assert_eq!(view["refused"], Value::Null, "{view}");
    assert_eq!(view["state"], json!("alive"), "{view}");
    assert_eq!(view["protocol"], json!({"min": 1, "max": 1}), "{view}");
    assert_eq!(outbox(&mesh, &id, "kind = 'node.joined'").await?, 1);
    node.close().await;
    mesh.teardown().await
}
