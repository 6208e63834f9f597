//! The security boundary, attacked: enrolment with join tokens (reuse, expiry,
//! another node's token), what a node's own broker user cannot do, declarations
//! with bad or missing signatures, revocation, API tokens and roles with their
//! audit trail, and secrets that must not reach any log.

use std::time::Duration;

use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Connection, ExchangeKind};
use mesh_bundle::provision::Rabbit;
use mesh_e2e::{Mesh, hello, publish_as, wait_for};
use mesh_protocol::topology::SIGNATURE_HEADER;
use mesh_protocol::{
    Declaration, DeclarationItems, DeclarationSigner, Envelope, FileItem, FileMode, NodeId, Section,
};
use reqwest::Method;
use serde_json::{Value, json};

const WITHIN: Duration = Duration::from_secs(30);

fn field(state: &std::path::Path, name: &str) -> String {
    let text = std::fs::read_to_string(state.join("credentials.toml")).unwrap();
    let v: toml::Value = toml::from_str(&text).unwrap();
    v[name].as_str().unwrap().to_owned()
}

async fn listed(mesh: &Mesh, node: &str) -> anyhow::Result<()> {
    wait_for(&format!("{node} to be listed"), WITHIN, || async {
        Ok((mesh.get(&format!("/v1/nodes/{node}")).await?.0 == 200).then_some(()))
    })
    .await
}

async fn identity_row(mesh: &Mesh, node: &str) -> anyhow::Result<Option<(String, bool)>> {
    let pool = sqlx::PgPool::connect(&mesh.env.database_url("identity")).await?;
    let row: Option<(String, bool)> = sqlx::query_as(
        "SELECT COALESCE(public_key, ''), revoked_at IS NOT NULL FROM identity.nodes WHERE name = $1",
    )
    .bind(node)
    .fetch_optional(&pool)
    .await?;
    pool.close().await;
    Ok(row)
}

async fn join_token(mesh: &Mesh, node: &str, ttl: Option<u64>) -> anyhow::Result<String> {
    let body = match ttl {
        Some(t) => json!({ "ttl_secs": t }),
        None => json!({}),
    };
    let (status, v) = mesh
        .post_json(&format!("/v1/nodes/{node}/join-tokens"), &body)
        .await?;
    anyhow::ensure!(status == 201, "{status} {v}");
    Ok(v["token"].as_str().unwrap().to_owned())
}

#[tokio::test(flavor = "multi_thread")]
async fn enrolment_refuses_bad_tokens_and_leaks_no_secret() -> anyhow::Result<()> {
    let mut mesh = Mesh::start().await?;
    // Every log at debug, for the secret scan at the end.
    mesh.kill_controller();
    mesh.start_controller(&[("RUST_LOG", "debug")]).await?;
    let rabbit = Rabbit::new(mesh.env.admin_credentials());

    // A good join: the agent runs with what it received and applies a signed declaration.
    let node = format!("{}-a", mesh.env.id());
    let token = join_token(&mesh, &node, None).await?;
    let state = mesh.dir.path().join("agent-a/state");
    assert!(mesh.run_join(&node, &token, &state, "a").await?.success());
    let key_mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(state.join("node.key"))?.permissions(),
    ) & 0o777;
    assert_eq!(key_mode, 0o600);
    assert_eq!(
        field(&state, "controller_key"),
        mesh.env.controller_public_key()
    );
    mesh.add_joined_agent(&node, state.clone(), &[("role", "web")])?;
    listed(&mesh, &node).await?;
    let (status, _) = mesh
        .put("/v1/files/motd", &json!({"path": "/etc/motd", "content": "signed\n", "mode": "0644", "selector": {"role": "web"}}))
        .await?;
    assert!(status == 200 || status == 201, "{status}");
    let path = mesh.agent(&node).file("/etc/motd");
    wait_for("the signed declaration to be applied", WITHIN, || {
        let ok = std::fs::read_to_string(&path).is_ok_and(|t| t == "signed\n");
        async move { Ok(ok.then_some(())) }
    })
    .await?;
    let key_before = identity_row(&mesh, &node).await?.expect("enrolled");

    // Reuse: refused, and nothing changes (same key, the agent's credentials intact).
    let other_state = mesh.dir.path().join("reuse/state");
    assert!(
        !mesh
            .run_join(&node, &token, &other_state, "reuse")
            .await?
            .success()
    );
    assert!(
        mesh.log_of("join-reuse").contains("already used"),
        "{}",
        mesh.log_of("join-reuse")
    );
    assert_eq!(identity_row(&mesh, &node).await?, Some(key_before.clone()));
    assert!(!other_state.join("credentials.toml").exists());

    // A token for another node: refused, no user, no identity for either name.
    let b = format!("{}-b", mesh.env.id());
    let c = format!("{}-c", mesh.env.id());
    let for_b = join_token(&mesh, &b, None).await?;
    assert!(
        !mesh
            .run_join(&c, &for_b, &mesh.dir.path().join("c/state"), "c")
            .await?
            .success()
    );
    assert!(
        mesh.log_of("join-c").contains("another node"),
        "{}",
        mesh.log_of("join-c")
    );
    // Expired: refused, nothing created.
    let d = format!("{}-d", mesh.env.id());
    let short = join_token(&mesh, &d, Some(1)).await?;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        !mesh
            .run_join(&d, &short, &mesh.dir.path().join("d/state"), "d")
            .await?
            .success()
    );
    assert!(
        mesh.log_of("join-d").contains("expired"),
        "{}",
        mesh.log_of("join-d")
    );
    // Unknown: 401 problem+json.
    let (status, v) = mesh
        .request_as(
            Method::POST,
            "/v1/join",
            None,
            Some(&json!({"token": "mesh_jt_nope", "node": d, "public_key": DeclarationSigner::from_seed([3; 32]).public_key_hex()})),
        )
        .await?;
    assert_eq!(status, 401, "{v}");
    for n in [&b, &c, &d] {
        assert!(!rabbit.user_exists(n).await?, "broker user {n} created");
        assert_eq!(identity_row(&mesh, n).await?, None, "identity {n} created");
    }
    // The token for b is still good after c's failed attempt with it.
    assert!(
        mesh.run_join(&b, &for_b, &mesh.dir.path().join("b/state"), "b")
            .await?
            .success()
    );

    // No secret in any log: join tokens, the admin token, the broker password,
    // the node's private key, the controller's signing key.
    let password = mesh_credentials::password_of(&field(&state, "broker_url")).unwrap();
    let node_key = std::fs::read_to_string(state.join("node.key"))?
        .trim()
        .to_owned();
    let secrets = [
        ("join token", token.as_str()),
        ("other join token", for_b.as_str()),
        ("expired join token", short.as_str()),
        ("admin token", mesh.admin_token()),
        ("broker password", password.as_str()),
        ("node private key", node_key.as_str()),
        ("controller signing key", &mesh.env.signer().to_hex()),
    ];
    let logs = [
        "controller",
        "join-a",
        "join-reuse",
        "join-c",
        "join-d",
        "join-b",
        &format!("agent-{node}"),
    ];
    for log in logs {
        let text = mesh.log_of(log);
        assert!(!text.is_empty() || log == "join-b", "log {log} is empty");
        for (what, secret) in &secrets {
            assert!(
                !text.contains(secret),
                "the {what} appears in the {log} log"
            );
        }
    }
    assert!(
        mesh.log_of("join-a").contains("DEBUG"),
        "the join ran at debug level"
    );
    mesh.teardown().await
}

/// Publish once on a fresh confirming channel: Ok when confirmed, Err(code) when refused.
async fn try_publish(
    conn: &Connection,
    exchange: &str,
    key: &str,
    user_id: &str,
) -> Result<(), u16> {
    let ch = conn.create_channel().await.map_err(code)?;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(code)?;
    let props = BasicProperties::default().with_user_id(user_id.into());
    let c = ch
        .basic_publish(
            exchange.into(),
            key.into(),
            BasicPublishOptions::default(),
            b"{}",
            props,
        )
        .await
        .map_err(code)?;
    c.await.map_err(code).map(|_| ())
}

fn code(e: lapin::Error) -> u16 {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(a) => a.get_id(),
        _ => 0,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_nodes_broker_user_can_only_state_about_itself() -> anyhow::Result<()> {
    let mesh = Mesh::start().await?;
    let (a, state) = mesh.join_node("a").await?;
    let (b, _) = mesh.join_node("b").await?;
    let conn = Connection::connect(&field(&state, "broker_url"), Default::default()).await?;
    // Control: its own identity and routing key are accepted.
    try_publish(&conn, "reports", &format!("{a}.heartbeat"), &a)
        .await
        .expect("own report");
    assert_eq!(
        try_publish(&conn, "reports", &format!("{a}.heartbeat"), &b).await,
        Err(406),
        "user_id of b"
    );
    assert_eq!(
        try_publish(&conn, "reports", &format!("{b}.heartbeat"), &a).await,
        Err(403),
        "b's routing key"
    );
    assert_eq!(
        try_publish(&conn, "declarations", &a, &a).await,
        Err(403),
        "declarations"
    );
    assert_eq!(
        try_publish(&conn, "record", "identity.operator.audit", &a).await,
        Err(403),
        "record"
    );
    // Another node's declaration queue (it exists: the controller declares it).
    let admin = Connection::connect(&mesh.env.admin_amqp_url(), Default::default()).await?;
    let ach = admin.create_channel().await?;
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongLongInt(64));
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString(LongString::from("drop-head")),
    );
    ach.queue_declare(format!("decl.{b}").as_str().into(), durable, args)
        .await?;
    let ch = conn.create_channel().await?;
    let err = ch
        .basic_consume(
            format!("decl.{b}").as_str().into(),
            "x".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(code(err), 403, "consuming b's declarations");
    let ch = conn.create_channel().await?;
    let err = ch
        .queue_declare("mine".into(), durable, FieldTable::default())
        .await
        .unwrap_err();
    assert_eq!(code(err), 403, "declaring a queue");
    let ch = conn.create_channel().await?;
    let err = ch
        .exchange_declare(
            "mine".into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(code(err), 403, "declaring an exchange");
    let _ = conn.close(200, "done".into()).await;
    let _ = admin.close(200, "done".into()).await;
    mesh.teardown().await
}

async fn publish_declaration(
    mesh: &Mesh,
    node: &str,
    generation: u64,
    signature: Option<String>,
) -> anyhow::Result<()> {
    let node_id = NodeId::parse(node)?;
    let decl = Declaration {
        section: Section::Config,
        generation,
        items: DeclarationItems {
            heartbeat: None,
            files: vec![FileItem {
                path: "/forged".into(),
                content: format!("forged {generation}"),
                mode: FileMode::new(0o644)?,
            }],
            ..Default::default()
        },
    };
    let bytes = Envelope::new(node_id, generation, decl).encode();
    publish_signed_bytes(mesh, node, &bytes, signature.as_deref()).await
}

async fn config_outcome(mesh: &Mesh, node: &str, error_has: &str) -> anyhow::Result<Value> {
    wait_for(
        &format!("a rejection naming `{error_has}`"),
        WITHIN,
        || async {
            let (_, v) = mesh.get(&format!("/v1/nodes/{node}")).await?;
            let s = &v["sections"]["config"];
            let hit = s["outcome"] == "rejected"
                && s["error"].as_str().is_some_and(|e| e.contains(error_has));
            Ok(hit.then(|| s.clone()))
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn declarations_without_the_controllers_signature_are_not_applied() -> anyhow::Result<()> {
    let mut mesh = Mesh::start().await?;
    let (node, state) = mesh.join_node("s").await?;
    mesh.add_joined_agent(&node, state, &[])?;
    listed(&mesh, &node).await?;
    let forged = mesh.agent(&node).file("/forged");

    // No signature; then garbage; then a valid signature by another key.
    publish_declaration(&mesh, &node, 100, None).await?;
    config_outcome(&mesh, &node, "no signature").await?;
    publish_declaration(&mesh, &node, 101, Some("zz".into())).await?;
    config_outcome(&mesh, &node, "not 128 hex").await?;
    let other = DeclarationSigner::from_seed(rand::random());
    let env_bytes = {
        // Sign exactly what will be published: build it, sign it, publish it.
        let node_id = NodeId::parse(&node)?;
        let decl = Declaration {
            section: Section::Config,
            generation: 102,
            items: DeclarationItems {
                heartbeat: None,
                files: vec![FileItem {
                    path: "/forged".into(),
                    content: "forged 102".into(),
                    mode: FileMode::new(0o644)?,
                }],
                ..Default::default()
            },
        };
        Envelope::new(node_id, 102, decl).encode()
    };
    publish_signed_bytes(&mesh, &node, &env_bytes, Some(&other.sign_hex(&env_bytes))).await?;
    config_outcome(&mesh, &node, "does not verify").await?;
    assert!(!forged.exists(), "a forged declaration was applied");
    // Control: the same declaration signed with the controller's key is applied.
    publish_signed_bytes(
        &mesh,
        &node,
        &env_bytes,
        Some(&mesh.env.signer().sign_hex(&env_bytes)),
    )
    .await?;
    wait_for("the genuine declaration to be applied", WITHIN, || {
        let ok = std::fs::read_to_string(&forged).is_ok_and(|t| t == "forged 102");
        async move { Ok(ok.then_some(())) }
    })
    .await?;
    mesh.teardown().await
}

/// Publish to the node's declaration queue as an intruder with full broker
/// rights would (the admin user), retrying until the queue exists.
async fn publish_signed_bytes(
    mesh: &Mesh,
    node: &str,
    bytes: &[u8],
    sig: Option<&str>,
) -> anyhow::Result<()> {
    wait_for("the declaration to be routed", WITHIN, || async {
        let conn = Connection::connect(&mesh.env.admin_amqp_url(), Default::default()).await?;
        let ch = conn.create_channel().await?;
        ch.confirm_select(ConfirmSelectOptions::default()).await?;
        let mut props = BasicProperties::default().with_delivery_mode(2);
        if let Some(sig) = sig {
            let mut h = FieldTable::default();
            h.insert(
                SIGNATURE_HEADER.into(),
                AMQPValue::LongString(LongString::from(sig)),
            );
            props = props.with_headers(h);
        }
        let c = ch
            .basic_publish(
                "declarations".into(),
                node.into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                bytes,
                props,
            )
            .await?
            .await?;
        let _ = conn.close(200, "done".into()).await;
        Ok(matches!(c, lapin::Confirmation::Ack(None)).then_some(()))
    })
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_revoked_node_is_cut_off_refused_until_readmitted_then_rejoins_under_a_new_key()
-> anyhow::Result<()> {
    let mut mesh = Mesh::start().await?;
    let (node, state) = mesh.join_node("r").await?;
    // A token made before the revocation, kept by someone.
    let kept = join_token(&mesh, &node, None).await?;
    let old_url = field(&state, "broker_url");
    mesh.add_joined_agent(&node, state.clone(), &[])?;
    listed(&mesh, &node).await?;
    let rabbit = Rabbit::new(mesh.env.admin_credentials());
    let vhost = mesh.env.vhost().to_owned();
    wait_for("the agent's connection", WITHIN, || async {
        Ok(rabbit
            .connections_of(&node)
            .await?
            .iter()
            .any(|c| c.vhost == vhost)
            .then_some(()))
    })
    .await?;
    let (old_key, _) = identity_row(&mesh, &node).await?.expect("enrolled");

    // A viewer or operator may not revoke; the admin may.
    let operator = mesh.create_token("ops", "operator").await?;
    let (status, _) = mesh
        .request_as(
            Method::DELETE,
            &format!("/v1/nodes/{node}"),
            Some(&operator),
            None,
        )
        .await?;
    assert_eq!(status, 403);
    // 503 means the broker's management API failed this time and the
    // revocation was not recorded ("try again"): an operator would retry, and
    // so does the test. The broker may hold part of the failed attempt (the
    // user deleted, its connections not yet closed), so after a 503 the
    // answer that completes it may say the user was already gone.
    let answered_503 = std::sync::atomic::AtomicBool::new(false);
    let (status, v) = wait_for("the revocation to be accepted", WITHIN, || async {
        let (status, v) = mesh
            .request_as(
                Method::DELETE,
                &format!("/v1/nodes/{node}"),
                Some(mesh.admin_token()),
                None,
            )
            .await?;
        if status == 503 {
            eprintln!("revocation answered 503: {v}");
            answered_503.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        Ok((status != 503).then_some((status, v)))
    })
    .await?;
    assert_eq!(status, 200, "{v}");
    if !answered_503.load(std::sync::atomic::Ordering::Relaxed) {
        assert_eq!(v["broker_user_deleted"], true, "{v}");
    }

    // Its connection is closed, its user gone, its publishes fail.
    wait_for("the node's connections to close", WITHIN, || async {
        Ok((!rabbit
            .connections_of(&node)
            .await?
            .iter()
            .any(|c| c.vhost == vhost))
        .then_some(()))
    })
    .await?;
    assert!(!rabbit.user_exists(&node).await?);
    assert!(
        Connection::connect(&old_url, Default::default())
            .await
            .is_err(),
        "the revoked user still connects"
    );
    assert_eq!(identity_row(&mesh, &node).await?.map(|r| r.1), Some(true));

    // Revocation is final (decision 0050): no join token, and the token kept
    // from before the revocation does not enrol it either; each refusal
    // names the node and the command that re-admits it.
    mesh.stop_agent(&node);
    let readmit = format!("meshctl node readmit {node}");
    let (status, v) = mesh
        .post_json(&format!("/v1/nodes/{node}/join-tokens"), &json!({}))
        .await?;
    assert_eq!(status, 409, "{v}");
    let detail = v["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains(&format!("`{node}`")) && detail.contains(&readmit),
        "{v}"
    );
    assert!(
        !mesh
            .run_join(&node, &kept, &state, "revoked")
            .await?
            .success(),
        "a revoked node joined with a token from before its revocation"
    );
    assert!(
        mesh.log_of("join-revoked").contains(&readmit),
        "the refused join does not say how to re-admit the node"
    );
    assert_eq!(identity_row(&mesh, &node).await?.map(|r| r.1), Some(true));
    assert!(!rabbit.user_exists(&node).await?);

    // Only an admin re-admits it, once; meshctl says what comes next.
    let (status, _) = mesh
        .request_as(
            Method::POST,
            &format!("/v1/nodes/{node}/readmit"),
            Some(&operator),
            None,
        )
        .await?;
    assert_eq!(status, 403);
    let (code, out, err) = mesh.meshctl(&["node", "readmit", &node])?;
    assert_eq!(code, 0, "{out}{err}");
    assert!(err.contains(&format!("node {node} re-admitted")), "{err}");
    let v: Value = serde_json::from_str(&out)?;
    assert_eq!(v["node"], node.as_str(), "{v}");
    assert_eq!(v["readmitted_by"], "bootstrap-admin", "{v}");
    let (code, out, err) = mesh.meshctl(&["node", "readmit", &node])?;
    assert_ne!(code, 0, "{out}");
    assert!(err.contains("is not revoked"), "{err}");
    assert_eq!(identity_row(&mesh, &node).await?.map(|r| r.1), Some(false));
    // Re-admission gives no credential by itself.
    assert!(!rabbit.user_exists(&node).await?);

    // A fresh token re-enrols it under a new key.
    let token = join_token(&mesh, &node, None).await?;
    assert!(
        mesh.run_join(&node, &token, &state, "rejoin")
            .await?
            .success()
    );
    let (new_key, revoked) = identity_row(&mesh, &node).await?.expect("enrolled");
    assert!(!revoked);
    assert_ne!(new_key, old_key);
    let conn = Connection::connect(&field(&state, "broker_url"), Default::default()).await?;
    try_publish(&conn, "reports", &format!("{node}.heartbeat"), &node)
        .await
        .expect("publishes again");
    let _ = conn.close(200, "done".into()).await;
    mesh.teardown().await
}

/// The node's state and when it was last heard (heard_at, last_seen), as
/// the API shows it.
async fn node_state(mesh: &Mesh, node: &str) -> anyhow::Result<(String, Value)> {
    let (status, v) = mesh.get(&format!("/v1/nodes/{node}")).await?;
    anyhow::ensure!(status == 200, "{status} {v}");
    Ok((
        v["state"].as_str().unwrap_or_default().to_owned(),
        json!([v["heard_at"], v["last_seen"]]),
    ))
}

/// Issue 39: a node added without the controller (`mesh-bundle node-add`,
/// the local mesh) and revoked is refused by node-add until an admin
/// re-admits it; a broker user re-created behind the controller's back
/// still gets it nowhere: its reports, heartbeats included, are
/// dead-lettered with reason `revoked`, counted, and never recorded as
/// liveness. Re-admission restores it.
#[tokio::test(flavor = "multi_thread")]
async fn a_revoked_node_re_provisioned_behind_the_controllers_back_is_refused_until_readmitted()
-> anyhow::Result<()> {
    let mesh = Mesh::start().await?;
    let creds = mesh.env.add_node("np").await?;
    let node = creds.node.to_string();
    let hello_of = |seq: u64| {
        let mut h = hello(&node, &[]);
        h.seq = seq;
        h.id = uuid::Uuid::now_v7();
        h.encode()
    };
    let heartbeat = |seq: u64| {
        mesh_protocol::Envelope::new(
            creds.node.clone(),
            seq,
            mesh_protocol::Report::Heartbeat(mesh_protocol::Heartbeat {
                applied: Default::default(),
                interval_ms: None,
            }),
        )
        .encode()
    };
    publish_as(&creds, &format!("{node}.hello"), &hello_of(1), true).await?;
    listed(&mesh, &node).await?;

    let status = mesh.delete(&format!("/v1/nodes/{node}")).await?;
    assert_eq!(status, 200);
    let (_, heard) = wait_for("inventory to show the node revoked", WITHIN, || async {
        let (state, heard) = node_state(&mesh, &node).await?;
        Ok((state == "revoked").then_some((state, heard)))
    })
    .await?;

    // node-add refuses it, naming the command that re-admits it.
    let refused = mesh
        .env
        .add_node("np")
        .await
        .expect_err("a revoked node was provisioned again");
    assert!(
        format!("{refused:#}").contains(&format!("meshctl node readmit {node}")),
        "{refused:#}"
    );
    let rabbit = Rabbit::new(mesh.env.admin_credentials());
    assert!(!rabbit.user_exists(&node).await?);

    // Its broker user re-created behind the controller's back (an older
    // mesh-bundle, a hand-made user): what it sends is refused.
    let password = creds.password.clone();
    mesh_bundle::provision::ensure_node_user(
        &rabbit,
        mesh.env.vhost(),
        &creds.node,
        &mesh_bundle::provision::Secret::known(password),
        &mut Default::default(),
    )
    .await?;
    let _ = mesh_e2e::drain_dead_letters(&mesh.env.admin_amqp_url()).await?;
    publish_as(&creds, &format!("{node}.heartbeat"), &heartbeat(2), true).await?;
    publish_as(&creds, &format!("{node}.hello"), &hello_of(3), true).await?;
    let url = mesh.env.admin_amqp_url();
    let taken = std::sync::Mutex::new(Vec::new());
    let letters = wait_for("both reports to be dead-lettered", WITHIN, || async {
        let got = mesh_e2e::drain_dead_letters(&url).await?;
        let mut taken = taken.lock().expect("not poisoned");
        taken.extend(got);
        Ok((taken.len() >= 2).then(|| taken.clone()))
    })
    .await?;
    for (code, reason, user) in &letters {
        assert_eq!(code, "revoked", "{reason}");
        assert!(
            reason.contains(&format!("meshctl node readmit {node}")),
            "{reason}"
        );
        assert_eq!(user.as_deref(), Some(node.as_str()));
    }
    let metrics = reqwest::get(format!("{}/metrics", mesh.api))
        .await?
        .text()
        .await?;
    for queue in ["reports.heartbeat", "reports.hello"] {
        let series = format!(
            "mesh_controller_dead_lettered_total{{queue=\"{queue}\",reason=\"revoked\"}} 1"
        );
        assert!(metrics.contains(&series), "no {series} in\n{metrics}");
    }
    // Never recorded as liveness: still revoked, heard no later than before.
    assert_eq!(
        node_state(&mesh, &node).await?,
        ("revoked".to_owned(), heard.clone())
    );

    // Re-admitted (admin, audited), it is added again and counts again.
    let (status, v) = mesh.post(&format!("/v1/nodes/{node}/readmit")).await?;
    assert_eq!(status, 200, "{v}");
    wait_for("inventory to show the node re-admitted", WITHIN, || async {
        Ok((node_state(&mesh, &node).await?.0 != "revoked").then_some(()))
    })
    .await?;
    let creds = mesh.env.add_node("np").await?;
    let seq = std::sync::atomic::AtomicU64::new(4);
    wait_for("the re-admitted node to be heard", WITHIN, || async {
        let n = seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        publish_as(&creds, &format!("{node}.hello"), &hello_of(n), true).await?;
        let (state, now) = node_state(&mesh, &node).await?;
        Ok((state == "alive" && now != heard).then_some(()))
    })
    .await?;
    // Audited: the entry arrives on the record.
    let query = format!("target=/v1/nodes/{node}/readmit");
    let entries = wait_for("the re-admission's audit entry", WITHIN, || async {
        let e = audit_entries(&mesh, &query).await?;
        Ok((!e.is_empty()).then_some(e))
    })
    .await?;
    assert_eq!(entries.len(), 1, "{entries:?}");
    assert_eq!(entries[0]["action"], "POST /v1/nodes/{id}/readmit");
    mesh.teardown().await
}

async fn audit_entries(mesh: &Mesh, query: &str) -> anyhow::Result<Vec<Value>> {
    let (status, v) = mesh.get(&format!("/v1/audit?{query}")).await?;
    anyhow::ensure!(status == 200, "{status} {v}");
    Ok(v["entries"].as_array().cloned().unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread")]
async fn api_tokens_roles_and_one_audit_entry_per_success() -> anyhow::Result<()> {
    let mesh = Mesh::start().await?;
    let file = json!({"path": "/etc/x", "content": "x", "mode": "0644", "selector": {}});

    // No token, a bad token: 401 problem+json.
    let r = reqwest::Client::new()
        .put(format!("{}/v1/files/x", mesh.api))
        .json(&file)
        .send()
        .await?;
    assert_eq!(r.status(), 401);
    assert_eq!(r.headers()["content-type"], "application/problem+json");
    let (status, _) = mesh
        .request_as(Method::GET, "/v1/nodes", Some("mesh_at_bogus"), None)
        .await?;
    assert_eq!(status, 401);
    // Open routes stay open.
    assert_eq!(
        reqwest::get(format!("{}/healthz", mesh.api))
            .await?
            .status(),
        200
    );

    let viewer = mesh.create_token("watcher", "viewer").await?;
    let operator = mesh.create_token("deployer", "operator").await?;
    assert_eq!(
        mesh.request_as(Method::GET, "/v1/nodes", Some(&viewer), None)
            .await?
            .0,
        200
    );
    let (status, v) = mesh
        .request_as(Method::PUT, "/v1/files/x", Some(&viewer), Some(&file))
        .await?;
    assert_eq!(status, 403, "{v}");
    assert!(
        v["detail"].as_str().unwrap_or("").contains("operator"),
        "{v}"
    );
    assert_eq!(
        mesh.request_as(
            Method::POST,
            "/v1/tokens",
            Some(&operator),
            Some(&json!({"name": "x", "role": "admin"}))
        )
        .await?
        .0,
        403
    );
    assert_eq!(
        mesh.request_as(Method::GET, "/v1/audit", Some(&operator), None)
            .await?
            .0,
        403
    );
    let (status, v) = mesh
        .request_as(Method::PUT, "/v1/files/x", Some(&operator), Some(&file))
        .await?;
    assert_eq!(status, 201, "{v}");

    // Exactly one `ok` entry for the success, one `denied` for the viewer's try.
    let ok = wait_for("the audit entry", WITHIN, || async {
        let e = audit_entries(&mesh, "target=/v1/files/x&outcome=ok").await?;
        Ok((!e.is_empty()).then_some(e))
    })
    .await?;
    assert_eq!(ok.len(), 1, "{ok:?}");
    assert_eq!(ok[0]["principal"], "deployer");
    assert_eq!(ok[0]["role"], "operator");
    assert_eq!(ok[0]["action"], "PUT /v1/files/{name}");
    assert_eq!(ok[0]["context"], "config");
    let denied = wait_for("the denied entry", WITHIN, || async {
        let e = audit_entries(&mesh, "target=/v1/files/x&outcome=denied").await?;
        Ok((!e.is_empty()).then_some(e))
    })
    .await?;
    assert_eq!(denied.len(), 1);
    assert_eq!(denied[0]["principal"], "watcher");
    // The admin's token creations are audited by identity itself.
    let tokens = audit_entries(&mesh, "action=POST%20/v1/tokens&outcome=ok").await?;
    assert!(tokens.len() <= 2);

    // Listing tokens never shows a secret; a revoked token authenticates nothing.
    let (_, list) = mesh.get("/v1/tokens").await?;
    let text = list.to_string();
    assert!(
        !text.contains(&viewer) && !text.contains(&operator) && !text.contains(mesh.admin_token())
    );
    let id = list["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "watcher")
        .unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(mesh.delete(&format!("/v1/tokens/{id}")).await?, 200);
    assert_eq!(
        mesh.request_as(Method::GET, "/v1/nodes", Some(&viewer), None)
            .await?
            .0,
        401
    );
    mesh.teardown().await
}

/// A request as the admin: (status, its `x-request-id`, JSON body or null).
async fn call(
    mesh: &Mesh,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&Value>,
) -> anyhow::Result<(u16, String, Value)> {
    let mut req = reqwest::Client::new()
        .request(method, format!("{}{path}", mesh.api))
        .bearer_auth(mesh.admin_token());
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    if let Some(b) = body {
        req = req.json(b);
    }
    let r = req.send().await?;
    let id = r
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    Ok((
        r.status().as_u16(),
        id,
        r.json().await.unwrap_or(Value::Null),
    ))
}

/// The value of every sample of `metric` in the controller's /metrics.
async fn samples(mesh: &Mesh, metric: &str) -> anyhow::Result<Vec<(String, f64)>> {
    let text = reqwest::get(format!("{}/metrics", mesh.api))
        .await?
        .text()
        .await?;
    Ok(text
        .lines()
        .filter(|l| l.starts_with(metric))
        .filter_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            Some((name.to_owned(), value.parse().ok()?))
        })
        .collect())
}

/// (method, path, body, answer, action, context).
type Route = (
    Method,
    String,
    Option<Value>,
    u16,
    &'static str,
    &'static str,
);

#[tokio::test(flavor = "multi_thread")]
async fn every_mutating_route_leaves_exactly_one_audit_entry_per_request() -> anyhow::Result<()> {
    let mesh = Mesh::start().await?;
    let creds = mesh.env.add_node("audited").await?;
    let node = creds.node.to_string();
    publish_as(
        &creds,
        &format!("{node}.hello"),
        &hello(&node, &[]).encode(),
        true,
    )
    .await?;
    listed(&mesh, &node).await?;
    let file = json!({"path": "/etc/audited", "content": "x", "mode": "0644", "selector": {"role": "none"}});
    let module = json!({
        "unit": {"command": "/bin/sleep", "args": ["1000"], "resources": {"cpu_millis": 1}},
        "placement": {"match_labels": {"labels": {"role": "none"}, "replicas": 1}}
    });
    let (_, _, created) = call(
        &mesh,
        Method::POST,
        "/v1/tokens",
        &[],
        Some(&json!({"name": "to-revoke", "role": "viewer"})),
    )
    .await?;
    let token_id = created["id"].as_str().unwrap_or_default().to_owned();

    // An artifact's bytes (the JSON body, as sent), signed by an operator's
    // key that the table adds before the signature and removes after it.
    let artifact = json!({"these bytes": uuid::Uuid::now_v7().to_string()});
    let artifact_digest = mesh_protocol::ArtifactDigest::of(&serde_json::to_vec(&artifact)?);
    let signer = mesh_protocol::DeclarationSigner::from_seed(rand::random());
    let signature = mesh_protocol::ArtifactSignature::sign(&signer, &artifact_digest);

    // Every mutating route of every context, each once, in an order that
    // succeeds: (method, path, body, answer, action, context).
    let n = node.as_str();
    let routes: Vec<Route> = vec![
        (
            Method::PUT,
            format!("/v1/nodes/{n}/labels"),
            Some(json!({"labels": {"tier": "a"}})),
            200,
            "PUT /v1/nodes/{id}/labels",
            "inventory",
        ),
        (
            Method::PUT,
            "/v1/files/audited".into(),
            Some(file),
            201,
            "PUT /v1/files/{name}",
            "config",
        ),
        (
            Method::DELETE,
            "/v1/files/audited".into(),
            None,
            204,
            "DELETE /v1/files/{name}",
            "config",
        ),
        (
            Method::PUT,
            "/v1/settings/global".into(),
            Some(json!({"values": {"K": 1}})),
            201,
            "PUT /v1/settings/global",
            "config",
        ),
        (
            Method::DELETE,
            "/v1/settings/global".into(),
            None,
            204,
            "DELETE /v1/settings/global",
            "config",
        ),
        (
            Method::PUT,
            "/v1/settings/labels/audited".into(),
            Some(json!({"selector": {"role": "none"}, "values": {"K": 1}})),
            201,
            "PUT /v1/settings/{scope}/{name}",
            "config",
        ),
        (
            Method::DELETE,
            "/v1/settings/labels/audited".into(),
            None,
            204,
            "DELETE /v1/settings/{scope}/{name}",
            "config",
        ),
        (
            Method::PUT,
            "/v1/secrets/audited".into(),
            Some(json!({"value": "never-in-an-audit-entry"})),
            201,
            "PUT /v1/secrets/{name}",
            "config",
        ),
        (
            Method::PUT,
            "/v1/modules/audited/grants/audited".into(),
            Some(json!({})),
            201,
            "PUT /v1/modules/{name}/grants/{secret}",
            "config",
        ),
        (
            Method::DELETE,
            "/v1/modules/audited/grants/audited".into(),
            None,
            204,
            "DELETE /v1/modules/{name}/grants/{secret}",
            "config",
        ),
        (
            Method::POST,
            "/v1/secrets/master-key/rotate".into(),
            None,
            200,
            "POST /v1/secrets/master-key/rotate",
            "config",
        ),
        (
            Method::DELETE,
            "/v1/secrets/audited".into(),
            None,
            204,
            "DELETE /v1/secrets/{name}",
            "config",
        ),
        (
            Method::PUT,
            "/v1/modules/audited".into(),
            Some(module),
            201,
            "PUT /v1/modules/{name}",
            "inventory",
        ),
        (
            Method::PUT,
            "/v1/modules/audited/intent/policy".into(),
            Some(json!({"min": 0, "max": 2})),
            200,
            "PUT /v1/modules/{name}/intent/{layer}",
            "inventory",
        ),
        (
            Method::DELETE,
            "/v1/modules/audited/intent/policy".into(),
            None,
            204,
            "DELETE /v1/modules/{name}/intent/{layer}",
            "inventory",
        ),
        (
            Method::DELETE,
            "/v1/modules/audited".into(),
            None,
            204,
            "DELETE /v1/modules/{name}",
            "inventory",
        ),
        (
            Method::POST,
            format!("/v1/nodes/{n}/drain"),
            None,
            200,
            "POST /v1/nodes/{id}/drain",
            "inventory",
        ),
        (
            Method::POST,
            format!("/v1/nodes/{n}/undrain"),
            None,
            200,
            "POST /v1/nodes/{id}/undrain",
            "inventory",
        ),
        (
            Method::POST,
            format!("/v1/nodes/{n}/join-tokens"),
            Some(json!({})),
            201,
            "POST /v1/nodes/{id}/join-tokens",
            "identity",
        ),
        (
            Method::POST,
            "/v1/tokens".into(),
            Some(json!({"name": "audited", "role": "viewer"})),
            201,
            "POST /v1/tokens",
            "identity",
        ),
        (
            Method::POST,
            format!("/v1/tokens/{token_id}/rotate"),
            Some(json!({"ttl_secs": 600})),
            201,
            "POST /v1/tokens/{id}/rotate",
            "identity",
        ),
        (
            Method::DELETE,
            format!("/v1/tokens/{token_id}"),
            None,
            200,
            "DELETE /v1/tokens/{id}",
            "identity",
        ),
        (
            Method::PUT,
            "/v1/trust/audited".into(),
            Some(json!({
                "issuer": "http://127.0.0.1:9", "audience": "mesh",
                "subject": "repo:acme/audited:*", "role": "viewer",
            })),
            201,
            "PUT /v1/trust/{name}",
            "identity",
        ),
        (
            Method::DELETE,
            "/v1/trust/audited".into(),
            None,
            200,
            "DELETE /v1/trust/{name}",
            "identity",
        ),
        (
            Method::DELETE,
            format!("/v1/nodes/{n}"),
            None,
            200,
            "DELETE /v1/nodes/{id}",
            "identity",
        ),
        (
            Method::POST,
            format!("/v1/nodes/{n}/readmit"),
            None,
            200,
            "POST /v1/nodes/{id}/readmit",
            "identity",
        ),
        (
            Method::POST,
            "/v1/artifacts".into(),
            Some(artifact.clone()),
            201,
            "POST /v1/artifacts",
            "delivery",
        ),
        (
            Method::POST,
            "/v1/signing-keys".into(),
            Some(json!({"name": "audited", "key": signer.public_key_hex()})),
            201,
            "POST /v1/signing-keys",
            "delivery",
        ),
        (
            Method::POST,
            format!("/v1/artifacts/{artifact_digest}/signatures"),
            Some(json!({"key": signature.key, "signature": signature.signature})),
            201,
            "POST /v1/artifacts/{digest}/signatures",
            "delivery",
        ),
        (
            Method::DELETE,
            "/v1/signing-keys/audited".into(),
            None,
            200,
            "DELETE /v1/signing-keys/{name}",
            "delivery",
        ),
        (
            Method::POST,
            "/v1/modules/audited/revisions".into(),
            Some(json!({"unit": {"command": "/bin/true"}})),
            201,
            "POST /v1/modules/{name}/revisions",
            "delivery",
        ),
        (
            Method::PUT,
            "/v1/modules/audited/delivery".into(),
            Some(json!({"require_approval": true})),
            200,
            "PUT /v1/modules/{name}/delivery",
            "delivery",
        ),
        (
            Method::PUT,
            "/v1/freeze".into(),
            Some(json!({"reason": "audited"})),
            200,
            "PUT /v1/freeze",
            "delivery",
        ),
        (
            Method::DELETE,
            "/v1/freeze".into(),
            None,
            204,
            "DELETE /v1/freeze",
            "delivery",
        ),
    ];
    let mut sent = Vec::new();
    for (method, path, body, want, action, context) in &routes {
        // A labels write says which labels it replaces: whatever is there.
        let headers: &[(&str, &str)] = if *action == "PUT /v1/nodes/{id}/labels" {
            &[("if-match", "*")]
        } else {
            &[]
        };
        let (status, id, v) = call(&mesh, method.clone(), path, headers, body.as_ref()).await?;
        assert_eq!(status, *want, "{method} {path}: {v}");
        assert!(!id.is_empty(), "{method} {path}: no x-request-id");
        sent.push((id, "ok", *action, *context, path.clone()));
    }
    // Failed mutations have an entry too (written after the response).
    for (path, action) in [
        ("/v1/files/missing", "DELETE /v1/files/{name}"),
        ("/v1/modules/missing", "DELETE /v1/modules/{name}"),
        ("/v1/tokens/missing", "DELETE /v1/tokens/{id}"),
    ] {
        let (status, id, v) = call(&mesh, Method::DELETE, path, &[], None).await?;
        assert_eq!(status, 404, "{path}: {v}");
        let context = if path.contains("files") {
            "config"
        } else if path.contains("modules") {
            "inventory"
        } else {
            "identity"
        };
        sent.push((id, "failed", action, context, path.to_owned()));
    }
    // Delivery's decisions on what does not exist: 404, each audited.
    let nobody = uuid::Uuid::now_v7();
    for (path, body, action) in [
        (
            "/v1/rollouts".to_owned(),
            Some(json!({"module": "audited", "revision": nobody})),
            "POST /v1/rollouts",
        ),
        (
            format!("/v1/rollouts/{nobody}/continue"),
            None,
            "POST /v1/rollouts/{id}/continue",
        ),
        (
            format!("/v1/rollouts/{nobody}/cancel"),
            None,
            "POST /v1/rollouts/{id}/cancel",
        ),
        (
            format!("/v1/runs/{nobody}/approve"),
            Some(json!({})),
            "POST /v1/runs/{id}/approve",
        ),
        (
            format!("/v1/runs/{nobody}/deny"),
            Some(json!({"reason": "audited"})),
            "POST /v1/runs/{id}/deny",
        ),
    ] {
        let (status, id, v) = call(&mesh, Method::POST, &path, &[], body.as_ref()).await?;
        assert_eq!(status, 404, "{path}: {v}");
        sent.push((id, "failed", action, "delivery", path));
    }

    let entries = wait_for("every request's audit entry", WITHIN, || async {
        let e = audit_entries(&mesh, "limit=1000").await?;
        let all = sent
            .iter()
            .all(|(id, ..)| e.iter().any(|x| x["request_id"] == id.as_str()));
        Ok(all.then_some(e))
    })
    .await?;
    for (id, outcome, action, context, path) in &sent {
        let mine: Vec<&Value> = entries
            .iter()
            .filter(|x| x["request_id"] == id.as_str())
            .collect();
        assert_eq!(mine.len(), 1, "{action} {path}: {mine:?}");
        let e = mine[0];
        assert_eq!(e["outcome"], *outcome, "{action}: {e}");
        assert_eq!(e["action"], *action, "{e}");
        assert_eq!(e["context"], *context, "{e}");
        assert_eq!(e["target"], path.as_str(), "{e}");
        assert_eq!(e["principal"], "bootstrap-admin", "{e}");
    }
    // Every success carried its entry in its own transaction: the auth layer
    // never had to write one afterwards.
    let unaudited = samples(&mesh, "mesh_controller_api_mutations_unaudited_total").await?;
    assert!(unaudited.iter().all(|(_, v)| *v == 0.0), "{unaudited:?}");
    assert!(
        !mesh
            .controller_log()
            .contains("MUTATION WITHOUT AUDIT ENTRY")
    );

    // A 401 has no principal: counted and logged, not in the audit log.
    let before = samples(&mesh, "mesh_controller_api_unauthenticated_total").await?;
    let r = reqwest::Client::new()
        .delete(format!("{}/v1/files/anything", mesh.api))
        .send()
        .await?;
    assert_eq!(r.status(), 401);
    let after = samples(&mesh, "mesh_controller_api_unauthenticated_total").await?;
    let total = |s: &[(String, f64)]| s.iter().map(|(_, v)| v).sum::<f64>();
    assert_eq!(total(&after), total(&before) + 1.0, "{after:?}");
    let anything = audit_entries(&mesh, "target=/v1/files/anything").await?;
    assert!(anything.is_empty(), "{anything:?}");

    // Once the API describes itself (/v1/openapi.json), this table must cover
    // every mutating operation it lists.
    let (status, doc) = mesh.get("/v1/openapi.json").await?;
    if status == 200 {
        let mut covered: std::collections::BTreeSet<&str> = routes.iter().map(|r| r.4).collect();
        covered.extend(sent.iter().map(|s| s.2));
        for (path, ops) in doc["paths"].as_object().into_iter().flatten() {
            for method in ["put", "post", "delete", "patch"] {
                // The join and the token exchange are authenticated by
                // what they carry, not by an API token: the exchange's
                // entry (principal: the trust and the ID token's subject)
                // is shown by controller/tests/oidc.rs.
                if ops.get(method).is_some() && path != "/v1/join" && path != "/v1/tokens/exchange"
                {
                    let action = format!("{} {path}", method.to_uppercase());
                    assert!(
                        covered.contains(action.as_str()),
                        "{action} is a mutating route this test does not cover"
                    );
                }
            }
        }
    }
    mesh.teardown().await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_controller_killed_between_a_change_and_its_answer_keeps_the_changes_audit_entry()
-> anyhow::Result<()> {
    let mut mesh = Mesh::start().await?;
    let file =
        json!({"path": "/etc/crash", "content": "x", "mode": "0644", "selector": {"role": "none"}});
    let module = json!({
        "unit": {"command": "/bin/sleep", "args": ["1000"], "resources": {"cpu_millis": 1}},
        "placement": {"match_labels": {"labels": {"role": "none"}, "replicas": 1}}
    });
    // One mutation per context, each served by a controller that exits right
    // after the change committed and before it answers.
    let changes = [
        (
            Method::PUT,
            "/v1/files/crash",
            file,
            "PUT /v1/files/{name}",
            "config",
        ),
        (
            Method::PUT,
            "/v1/modules/crash",
            module,
            "PUT /v1/modules/{name}",
            "inventory",
        ),
        (
            Method::POST,
            "/v1/tokens",
            json!({"name": "crash", "role": "viewer"}),
            "POST /v1/tokens",
            "identity",
        ),
    ];
    for (method, path, body, action, _) in &changes {
        mesh.kill_controller();
        mesh.start_controller(&[("MESH_FAILPOINT_EXIT_AFTER_API_COMMIT", action)])
            .await?;
        let answered = mesh
            .request_as(method.clone(), path, Some(mesh.admin_token()), Some(body))
            .await;
        assert!(
            answered.is_err(),
            "{action} was answered: the failpoint did not fire: {answered:?}"
        );
        let mut dead = mesh.take_controller().expect("controller running");
        let status = dead.wait_exit(WITHIN).await?;
        assert_eq!(
            status.code(),
            Some(87),
            "the failpoint did not fire: {}",
            mesh.controller_log()
        );
    }

    mesh.start_controller(&[]).await?;
    // Every change committed...
    assert_eq!(mesh.get("/v1/files/crash").await?.0, 200);
    assert_eq!(mesh.get("/v1/modules/crash").await?.0, 200);
    let (_, tokens) = mesh.get("/v1/tokens").await?;
    assert!(
        tokens["tokens"]
            .as_array()
            .is_some_and(|t| t.iter().any(|t| t["name"] == "crash")),
        "{tokens}"
    );
    // ...and has exactly one entry, which identity appends once the restarted
    // controller's relay publishes what the outbox kept.
    for (_, path, _, action, context) in &changes {
        let query = format!(
            "target={path}&action={}&outcome=ok",
            urlencoding::encode(action)
        );
        let entries = wait_for(&format!("the entry of {action}"), WITHIN, || async {
            let e = audit_entries(&mesh, &query).await?;
            Ok((!e.is_empty()).then_some(e))
        })
        .await?;
        assert_eq!(entries.len(), 1, "{entries:?}");
        assert_eq!(entries[0]["context"], *context);
        assert_eq!(entries[0]["principal"], "bootstrap-admin");
    }
    mesh.teardown().await
}

/// Wait for `path` (as declared) on `node`'s agent to hold `content`.
async fn wait_file(mesh: &Mesh, node: &str, path: &str, content: &str) -> anyhow::Result<()> {
    let file = mesh.agent(node).file(path);
    wait_for(&format!("{path} = {content:?} on {node}"), WITHIN, || {
        let file = file.clone();
        async move {
            Ok((std::fs::read_to_string(&file).ok().as_deref() == Some(content)).then_some(()))
        }
    })
    .await
}

/// PUT a node's operator labels (whatever is there), once the controller
/// knows the node.
async fn set_operator_labels(mesh: &Mesh, node: &str, labels: Value) -> anyhow::Result<()> {
    wait_for("the operator labels to be set", WITHIN, || {
        let labels = labels.clone();
        async move {
            let (status, _, _) = call(
                mesh,
                Method::PUT,
                &format!("/v1/nodes/{node}/labels"),
                &[("if-match", "*")],
                Some(&json!({ "labels": labels })),
            )
            .await?;
            Ok((status == 200).then_some(()))
        }
    })
    .await
}

/// Issue 29: by default nothing a node says about itself selects it. Web-2
/// (operator label `tier=front`, no `role` of the operator's) restarted
/// stating `role=db` and `mesh.hub=true` gets none of db's files (a newer
/// version reaches db, never web-2), no selector finds it as db, its stated
/// labels show as stated and its effective ones are its operator's only; a
/// node joined with a token bound to `tier=front`, stating `role=db`, is
/// selected as front from its first hello and never as db; nobody sets a
/// `mesh.io/` label.
#[tokio::test(flavor = "multi_thread")]
async fn a_node_cannot_state_its_way_into_a_selector() -> anyhow::Result<()> {
    let mut mesh = Mesh::prepare().await?;
    // The default: no stated key trusted (the harness opts in; not here).
    let toml = mesh.dir.path().join("controller.toml");
    let text = std::fs::read_to_string(&toml)?.replace(mesh_e2e::HARNESS_TRUST, "");
    std::fs::write(&toml, text)?;
    mesh.start_controller(&[]).await?;
    let db = mesh.add_agent("db", &[("role", "db")]).await?;
    let web2 = mesh.add_agent("web-2", &[("role", "web")]).await?;
    set_operator_labels(&mesh, &db, json!({"role": "db"})).await?;
    set_operator_labels(&mesh, &web2, json!({"tier": "front"})).await?;
    for (name, path, content, selector) in [
        ("db-conf", "/etc/db.conf", "db 1\n", json!({"role": "db"})),
        (
            "web-conf",
            "/etc/web.conf",
            "web 1\n",
            json!({"tier": "front"}),
        ),
    ] {
        let (status, body) = mesh
            .put(
                &format!("/v1/files/{name}"),
                &json!({"path": path, "content": content, "mode": "0644", "selector": selector}),
            )
            .await?;
        assert!(status == 200 || status == 201, "{status} {body}");
    }
    wait_file(&mesh, &db, "/etc/db.conf", "db 1\n").await?;
    wait_file(&mesh, &web2, "/etc/web.conf", "web 1\n").await?;

    // Web-2 restarted stating that it is a db node and a hub.
    mesh.stop_agent(&web2);
    if let Some(agent) = mesh.agents.get_mut(&web2) {
        agent.labels = [("role", "db"), ("mesh.hub", "true")]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
    }
    mesh.start_agent(&web2)?;
    let stated = json!({"role": "db", "mesh.hub": "true"});
    let view = wait_for("web-2's new statement to be heard", WITHIN, || async {
        let (status, view) = mesh.get(&format!("/v1/nodes/{web2}")).await?;
        anyhow::ensure!(status == 200, "{status} {view}");
        Ok((view["labels"]["reported"] == stated).then_some(view))
    })
    .await?;
    assert_eq!(
        view["labels"]["effective"],
        json!({"tier": "front", "mesh.io/node": web2.as_str()}),
        "{view}"
    );
    // A newer db file reaches db and never web-2.
    let (status, body) = mesh
        .put(
            "/v1/files/db-conf",
            &json!({"path": "/etc/db.conf", "content": "db 2\n", "mode": "0644", "selector": {"role": "db"}}),
        )
        .await?;
    assert!(status == 200 || status == 201, "{status} {body}");
    wait_file(&mesh, &db, "/etc/db.conf", "db 2\n").await?;
    let (status, body) = mesh.put("/v1/files/web-conf", &json!({"path": "/etc/web.conf", "content": "web 2\n", "mode": "0644", "selector": {"tier": "front"}})).await?;
    assert!(status == 200 || status == 201, "{status} {body}");
    wait_file(&mesh, &web2, "/etc/web.conf", "web 2\n").await?;
    assert!(
        !mesh.agent(&web2).file("/etc/db.conf").exists(),
        "web-2 received db's file by stating role=db"
    );
    let (status, list) = mesh.get("/v1/nodes?selector=role=db").await?;
    assert_eq!(status, 200, "{list}");
    let ids: Vec<&str> = list["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|n| n["id"].as_str())
        .collect();
    assert_eq!(ids, [db.as_str()], "{list}");

    // A node joined with a token bound to role=web, stating role=db.
    let web3 = format!("{}-web-3", mesh.env.id());
    let (status, body) = mesh
        .post_json(
            &format!("/v1/nodes/{web3}/join-tokens"),
            &json!({"labels": {"tier": "front"}}),
        )
        .await?;
    assert_eq!(status, 201, "{body}");
    let token = body["token"].as_str().unwrap_or_default().to_owned();
    let state_dir = mesh.dir.path().join("agent-web-3/state");
    let out = mesh.run_join(&web3, &token, &state_dir, "web-3").await?;
    assert!(out.success(), "mesh-agent join: {out}");
    mesh.add_joined_agent(&web3, state_dir, &[("role", "db")])?;
    wait_file(&mesh, &web3, "/etc/web.conf", "web 2\n").await?;
    let (_, view) = mesh.get(&format!("/v1/nodes/{web3}")).await?;
    assert_eq!(
        view["labels"]["operator"],
        json!({"tier": "front"}),
        "{view}"
    );
    assert_eq!(
        view["labels"]["effective"],
        json!({"tier": "front", "mesh.io/node": web3.as_str()}),
        "{view}"
    );
    assert!(!mesh.agent(&web3).file("/etc/db.conf").exists());

    // What the controller verified selects: `mesh.io/node`, the node's id
    // as the broker proved it, names one node in another context's selector.
    let (status, body) = mesh
        .put(
            "/v1/files/only-db",
            &json!({"path": "/etc/only-db", "content": "db alone\n", "mode": "0644", "selector": {"mesh.io/node": db.as_str()}}),
        )
        .await?;
    assert!(status == 200 || status == 201, "{status} {body}");
    wait_file(&mesh, &db, "/etc/only-db", "db alone\n").await?;
    for other in [&web2, &web3] {
        assert!(
            !mesh.agent(other).file("/etc/only-db").exists(),
            "{other} received a file for mesh.io/node={db}"
        );
    }

    // Nobody sets a reserved key: not an operator, not a join token.
    let (status, _, problem) = call(
        &mesh,
        Method::PUT,
        &format!("/v1/nodes/{db}/labels"),
        &[("if-match", "*")],
        Some(&json!({"labels": {"mesh.io/node": "web-2"}})),
    )
    .await?;
    assert_eq!(status, 422, "{problem}");
    assert!(problem.to_string().contains("mesh.io/node"), "{problem}");
    let (status, problem) = mesh
        .post_json(
            &format!("/v1/nodes/{}-x/join-tokens", mesh.env.id()),
            &json!({"labels": {"mesh.io/node": "db"}}),
        )
        .await?;
    assert_eq!(status, 422, "{problem}");
    assert!(problem.to_string().contains("mesh.io/node"), "{problem}");
    mesh.teardown().await
}
