//! Settings and secrets end to end (issue 11), real controller, real agents,
//! real broker: a secret granted to a module reaches exactly the node that
//! runs it, sealed to that node; the broker's administrator reading a copy of
//! the node's declarations sees only ciphertext; the agent writes it 0600;
//! revoking the grant removes it; the value is in no API answer, log, metric
//! or outbox row.

use std::os::unix::fs::PermissionsExt as _;
use std::time::Duration;

use lapin::options::{BasicGetOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use mesh_e2e::{Mesh, wait_for};
use mesh_protocol::sealing::{self, SealSecretKey};
use mesh_protocol::{Declaration, Envelope, MAX_DECLARATION_BYTES};
use serde_json::json;

const WITHIN: Duration = Duration::from_secs(30);
const PLAIN: &str = "pl41n-db-password-never-in-clear";

/// A queue of the broker admin's, bound beside `decl.<node>`: a copy of
/// every declaration the node is sent.
async fn copy_of_declarations(ch: &lapin::Channel, node: &str) -> anyhow::Result<String> {
    let name = format!("copy-{node}");
    ch.queue_declare(
        name.as_str().into(),
        QueueDeclareOptions {
            exclusive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await?;
    ch.queue_bind(
        name.as_str().into(),
        "declarations".into(),
        node.into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    Ok(name)
}

/// Every message in `queue` now: (raw bytes, decoded declaration).
async fn take(ch: &lapin::Channel, queue: &str) -> anyhow::Result<Vec<(Vec<u8>, Declaration)>> {
    let mut out = Vec::new();
    while let Some(msg) = ch
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await?
    {
        let bytes = msg.delivery.data.clone();
        let env = Envelope::<Declaration>::decode(&bytes, MAX_DECLARATION_BYTES)?;
        out.push((bytes, env.body));
    }
    Ok(out)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_granted_secret_reaches_only_its_modules_node_sealed_and_leaves_with_the_grant()
-> anyhow::Result<()> {
    let mut mesh = Mesh::start().await?;
    let a = mesh.add_agent("app-1", &[("role", "app")]).await?;
    let b = mesh.add_agent("other-1", &[("role", "other")]).await?;
    wait_for("both nodes alive", WITHIN, || async {
        let (_, nodes) = mesh.get("/v1/nodes").await?;
        let n = nodes["nodes"].as_array().cloned().unwrap_or_default();
        Ok((n.len() == 2 && n.iter().all(|n| n["state"] == "alive")).then_some(()))
    })
    .await?;

    // The broker's administrator copies both nodes' declarations.
    let conn = lapin::Connection::connect(&mesh.env.admin_amqp_url(), Default::default()).await?;
    let ch = conn.create_channel().await?;
    let copy_a = copy_of_declarations(&ch, &a).await?;
    let copy_b = copy_of_declarations(&ch, &b).await?;

    // A file for every node: b gets config sections too, so what it is sent
    // can be checked, not only what it is not.
    let (status, body) = mesh
        .put(
            "/v1/files/motd",
            &json!({"path": "/etc/motd", "content": "hi\n", "mode": "0644", "selector": {}}),
        )
        .await?;
    assert_eq!(status, 201, "{body}");
    let (status, body) = mesh
        .put(
            "/v1/modules/app",
            &json!({
                "unit": {"command": "sleep", "args": ["1000"]},
                "placement": {"exact_node": {"node": a}},
                "settings_files": [{"name": "app.env", "format": "env"}]
            }),
        )
        .await?;
    assert_eq!(status, 201, "{body}");
    let (status, body) = mesh
        .put(
            "/v1/settings/global",
            &json!({"values": {"GREETING": "hello world"}}),
        )
        .await?;
    assert_eq!(status, 201, "{body}");
    let (status, body) = mesh
        .put("/v1/secrets/db-pw", &json!({"value": PLAIN}))
        .await?;
    assert_eq!(status, 201, "{body}");
    assert!(!body.to_string().contains(PLAIN), "{body}");
    let (status, body) = mesh.put("/v1/modules/app/grants/db-pw", &json!({})).await?;
    assert_eq!(status, 201, "{body}");

    // The agent writes the settings file and the secret, 0600.
    let secret_file = mesh.agent(&a).file("/modules/app/secrets/db-pw");
    let env_file = mesh.agent(&a).file("/modules/app/app.env");
    wait_for(
        "the secret and the settings file on node a",
        WITHIN,
        || async {
            Ok(
                (std::fs::read_to_string(&secret_file).ok().as_deref() == Some(PLAIN)
                    && std::fs::read_to_string(&env_file).is_ok())
                .then_some(()),
            )
        },
    )
    .await?;
    // The module's user's to read, nobody else's (decision 0051).
    assert_eq!(
        std::fs::metadata(&secret_file)?.permissions().mode() & 0o777,
        0o400
    );
    assert_eq!(
        std::fs::read_to_string(&env_file)?,
        "GREETING=\"hello world\"\n"
    );

    // What crossed the broker: ciphertext only; only a's own key opens it.
    let copies = take(&ch, &copy_a).await?;
    let carrying: Vec<_> = copies
        .iter()
        .filter(|(_, d)| !d.items.secrets.is_empty())
        .collect();
    assert!(!carrying.is_empty(), "no copy of the secret's declaration");
    let seal_key = std::fs::read_to_string(mesh.agent(&a).state_dir.join("seal.key"))?;
    let key = SealSecretKey::from_hex(&seal_key)?;
    for (bytes, d) in &carrying {
        assert!(
            !bytes.windows(PLAIN.len()).any(|w| w == PLAIN.as_bytes()),
            "plaintext on the broker"
        );
        let item = &d.items.secrets[0];
        let aad = sealing::secret_aad(&a, &item.path);
        assert_eq!(sealing::open(&key, &aad, &item.sealed)?, PLAIN.as_bytes());
        // b's key (another node's) cannot open it.
        let b_key = std::fs::read_to_string(mesh.agent(&b).state_dir.join("seal.key"))?;
        assert!(sealing::open(&SealSecretKey::from_hex(&b_key)?, &aad, &item.sealed).is_err());
    }
    // b runs nothing granted: it was sent its config section, and no
    // declaration it was sent names the secret.
    let to_b = take(&ch, &copy_b).await?;
    assert!(
        to_b.iter()
            .any(|(_, d)| d.section == mesh_protocol::Section::Config),
        "b was sent no config section"
    );
    for (bytes, d) in to_b {
        assert!(d.items.secrets.is_empty());
        assert!(!bytes.windows(5).any(|w| w == b"db-pw"));
    }
    assert!(!mesh.agent(&b).file("/modules/app/secrets/db-pw").exists());

    // Revoking the grant removes the file from a.
    let (status, _, body) = mesh
        .request(
            reqwest::Method::DELETE,
            "/v1/modules/app/grants/db-pw",
            &[],
            None,
        )
        .await?;
    assert_eq!(status, 204, "{body}");
    wait_for("the secret removed from node a", WITHIN, || async {
        Ok((!secret_file.exists()).then_some(()))
    })
    .await?;

    // Nowhere in clear: the config schema and its outbox after relay, the
    // API's answers, the metrics, the controller's and agents' logs.
    let pool = sqlx::PgPool::connect(&mesh.env.database_url("config")).await?;
    let rows: Vec<String> = sqlx::query_scalar(
        "SELECT encode(payload, 'escape') FROM config.outbox UNION ALL \
         SELECT row_to_json(t)::text FROM (SELECT * FROM config.secret_versions) t UNION ALL \
         SELECT row_to_json(t)::text FROM (SELECT * FROM config.secrets) t",
    )
    .fetch_all(&pool)
    .await?;
    let sent: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM config.outbox WHERE sent_at IS NOT NULL AND exchange = 'declarations'",
    )
    .fetch_one(&pool)
    .await?;
    assert!(sent > 0, "the relay published config's declarations");
    for row in rows {
        assert!(!row.contains(PLAIN), "{row}");
    }
    pool.close().await;
    for path in [
        "/v1/secrets",
        "/v1/secrets/db-pw",
        "/v1/modules/app/grants",
        "/v1/audit?limit=100",
    ] {
        let (status, body) = mesh.get(path).await?;
        assert_eq!(status, 200, "{path}: {body}");
        assert!(!body.to_string().contains(PLAIN), "{path}: {body}");
    }
    let metrics = reqwest::get(format!("http://127.0.0.1:{}/metrics", mesh.api_port()))
        .await?
        .text()
        .await?;
    assert!(!metrics.contains(PLAIN));
    for log in [mesh.controller_log(), mesh.log_of(&format!("agent-{a}"))] {
        assert!(!log.is_empty());
        assert!(!log.contains(PLAIN), "a log holds the secret");
    }
    let _ = conn.close(200, "done".into()).await;
    mesh.teardown().await
}
