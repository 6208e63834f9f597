//! The fault suite, part one: faults that touch only this test's own environment
//! (its controller process, its vhost), so they run in parallel with the rest.
//! Broker and database restarts disturb every test on the machine: they are in
//! `tests/disruptive.rs`, run serially by `bundle/test`.
//!
//! Simulated nodes (`mesh_e2e::sim`): each its own broker user and connection,
//! publishing like an agent (persistent, `user_id`, confirms), no agent process.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use mesh_e2e::sim::{
    SimNode, add_nodes, confirmed, connect_all, drain, inbox_count, metric_sum, metrics,
    queue_depth, scalar, wait_scalar,
};
use mesh_e2e::{Mesh, wait_for};
use mesh_protocol::{Envelope, Report, Section};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use uuid::Uuid;

fn seed() -> u64 {
    let seed = std::env::var("MESH_FAULT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("fault seed: {seed} (MESH_FAULT_SEED={seed} replays it)");
    seed
}

const CRASH_NODES: usize = 50;
/// Reports per node: 10 hellos (one before the storm) and 990 `applied`.
const CRASH_PER_NODE: usize = 1000;
const HELLO_EVERY: usize = 100;
const KILLS: usize = 20;

/// SIGKILL the controller at random points, at least 20 times, while 50,000
/// reports from 50 nodes stream in. Afterwards:
/// - every report is in the inbox of each context that handles it, exactly the
///   sent ids (the inbox row commits in the transaction of the report's effect);
/// - effects happened once: one `node.joined` per node, and exactly one config
///   re-declaration per later hello (each hello of a node behind on its config
///   section causes one; a hello handled twice would cause two);
/// - every declaration caused was published, confirmed, and is in its node's queue.
#[tokio::test(flavor = "multi_thread")]
async fn a_controller_killed_twenty_times_under_load_loses_and_doubles_nothing()
-> anyhow::Result<()> {
    let started = Instant::now();
    let mut rng = StdRng::seed_from_u64(seed());
    let mut mesh = Mesh::start().await?;
    let (status, body) = mesh
        .put(
            "/v1/files/motd",
            &json!({"path": "/etc/motd", "content": "crash storm", "mode": "0644", "selector": {"role": "sim"}}),
        )
        .await?;
    assert!(status < 300, "PUT file: {status} {body}");
    let creds = add_nodes(&mesh.env, "c", CRASH_NODES).await?;
    let mut nodes = connect_all(creds, 16).await?;

    // The first hellos: each node joins, config declares its section (generation 1).
    let mut ids: Vec<Uuid> = Vec::with_capacity(CRASH_NODES * CRASH_PER_NODE);
    let mut confirms = Vec::new();
    for n in &mut nodes {
        let h = n.hello(&[("role", "sim")]);
        ids.push(h.id);
        confirms.push(n.send(&h).await?);
    }
    confirmed(confirms).await?;
    wait_for(
        "every node's config section to be declared",
        Duration::from_secs(60),
        || async {
            let n = scalar(&mesh.env, "config", "SELECT count(*) FROM config.sections").await?;
            Ok((n == CRASH_NODES as i64).then_some(()))
        },
    )
    .await?;

    // The stream, paced (at most one round of 50 every 10 ms) so that the kills
    // land in the middle of it.
    let publisher = tokio::spawn(async move {
        let mut ids = Vec::with_capacity(CRASH_NODES * CRASH_PER_NODE);
        let mut tick = tokio::time::interval(Duration::from_millis(10));
        for round in 1..CRASH_PER_NODE {
            tick.tick().await;
            let mut confirms = Vec::with_capacity(nodes.len());
            for n in &mut nodes {
                let env = if round.is_multiple_of(HELLO_EVERY) {
                    n.hello(&[("role", "sim")])
                } else {
                    n.applied(Section::Config, 1)
                };
                ids.push(env.id);
                confirms.push(n.send(&env).await?);
            }
            confirmed(confirms).await?;
        }
        for n in nodes {
            n.close().await;
        }
        anyhow::Ok(ids)
    });

    let mut kills = 0;
    while kills < KILLS || !publisher.is_finished() {
        tokio::time::sleep(Duration::from_millis(rng.random_range(100..1500))).await;
        mesh.kill_controller();
        kills += 1;
        mesh.start_controller(&[]).await?;
    }
    ids.extend(publisher.await??);
    assert_eq!(ids.len(), CRASH_NODES * CRASH_PER_NODE);
    eprintln!("{kills} kills, stream done after {:?}", started.elapsed());

    // inventory handles every report; config only hellos (applied reports
    // are inventory's record: decision 0015), so its inbox holds the hellos.
    for (context, expected) in [
        ("inventory", ids.len()),
        ("config", CRASH_NODES * CRASH_PER_NODE.div_ceil(HELLO_EVERY)),
    ] {
        wait_for(
            &format!("every report in the {context} inbox"),
            Duration::from_secs(180),
            || async {
                let n = inbox_count(&mesh.env, context, &ids).await?;
                Ok((n == expected as i64).then_some(()))
            },
        )
        .await?;
    }
    // Nothing left in the report queues, and nothing refused.
    for q in ["reports.hello", "reports.applied"] {
        wait_for(
            &format!("{q} to be empty"),
            Duration::from_secs(60),
            || async { Ok((queue_depth(&mesh.env, q).await? == 0).then_some(())) },
        )
        .await?;
    }
    assert_eq!(queue_depth(&mesh.env, "dead-letter").await?, 0);

    // Exactly once: one joined event per node…
    let joined = scalar(
        &mesh.env,
        "inventory",
        "SELECT count(*) FROM inventory.outbox WHERE kind = 'node.joined'",
    )
    .await?;
    assert_eq!(joined, CRASH_NODES as i64, "node.joined events");
    // …and one declaration per node (reconcile) plus one per later hello, all sent.
    let expected = (CRASH_NODES * (CRASH_PER_NODE / HELLO_EVERY)) as i64;
    wait_scalar(
        &mesh.env,
        "every declaration to be confirmed by the broker",
        "config",
        "SELECT count(*) FROM config.outbox WHERE sent_at IS NULL",
        0,
        Duration::from_secs(60),
    )
    .await?;
    // Per node: never more than that (a hello handled twice would make two),
    // and at least one re-send after its first. Fewer than one per hello only
    // where two hellos of a node were handled in one batch, which the section
    // component catches up once (`Sections::on_hello` counts a node once per
    // batch): that happens when the controller stayed down over two hello
    // rounds (a slow restart on a loaded machine).
    let pool = sqlx::PgPool::connect(&mesh.env.database_url("config")).await?;
    let per_node: Vec<(String, i64)> = sqlx::query_as(
        "SELECT node, count(*) FROM config.outbox WHERE exchange = 'declarations' GROUP BY node",
    )
    .fetch_all(&pool)
    .await?;
    pool.close().await;
    let most = expected / CRASH_NODES as i64;
    assert_eq!(per_node.len(), CRASH_NODES, "declared nodes: {per_node:?}");
    for (node, n) in &per_node {
        assert!(
            (2..=most).contains(n),
            "{node}: {n} config declarations, expected 2 to {most} (one per hello at most)"
        );
    }
    let declared: i64 = per_node.iter().map(|(_, n)| n).sum();
    eprintln!("config declarations: {declared} for {expected} hellos");

    // Delivered: every declaration's message is in its node's queue.
    let pool = sqlx::PgPool::connect(&mesh.env.database_url("config")).await?;
    let rows: Vec<(String, Uuid)> = sqlx::query_as(
        "SELECT node, message_id FROM config.outbox WHERE exchange = 'declarations'",
    )
    .fetch_all(&pool)
    .await?;
    pool.close().await;
    let mut by_node: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (node, id) in rows {
        by_node.entry(node).or_default().insert(id.to_string());
    }
    for (node, wanted) in by_node {
        let got: BTreeSet<String> = drain(&mesh.env, &format!("decl.{node}"))
            .await?
            .into_iter()
            .filter_map(|(id, _)| id)
            .collect();
        let missing: Vec<_> = wanted.difference(&got).collect();
        assert!(
            missing.is_empty(),
            "{node}: declarations not delivered: {missing:?}"
        );
    }
    eprintln!(
        "crash storm test took {:?}; redeliveries the inbox filtered: {} batches",
        started.elapsed(),
        mesh.controller_log()
            .matches("inbox filtered redeliveries")
            .count()
    );
    mesh.teardown().await
}

const POISON: usize = 10_000;
const POISON_NODES: usize = 20;
const VALID_PER_NODE: usize = 100;
/// Reports published under `<node>.bogus`, a kind no queue is bound for.
const UNROUTABLE: usize = 500;

/// One generated bad message: routing-key kind, payload, with user_id, expected code.
fn poison(
    rng: &mut StdRng,
    i: usize,
    me: &mut SimNode,
    other: &str,
) -> (&'static str, Vec<u8>, bool, &'static str) {
    let valid = me.applied(Section::Config, 1);
    let as_json = |env: &Envelope<Report>| -> Value {
        serde_json::from_slice(&env.encode()).unwrap_or(Value::Null)
    };
    let key = if i.is_multiple_of(3) {
        "hello"
    } else {
        "applied"
    };
    match i % 10 {
        0 => {
            let len = rng.random_range(1..300);
            let bytes: Vec<u8> = (0..len).map(|_| rng.random()).collect();
            (key, bytes, true, "malformed")
        }
        1 => {
            let bytes = valid.encode();
            let cut = rng.random_range(0..bytes.len());
            (key, bytes[..cut].to_vec(), true, "malformed")
        }
        2 if (i / 10).is_multiple_of(4) => {
            let mut bytes = valid.encode();
            bytes.truncate(bytes.len() - 1);
            bytes.extend(std::iter::repeat_n(b' ', 65 * 1024));
            bytes.push(b'}');
            ("applied", bytes, true, "too_large")
        }
        2 => {
            let mut v = as_json(&valid);
            v["v"] = json!(2);
            (
                "applied",
                v.to_string().into_bytes(),
                true,
                "unsupported_version",
            )
        }
        3 => {
            // A heartbeat on the hello or applied queue.
            let hb = me.heartbeat(Default::default());
            (key, hb.encode(), true, "wrong_queue")
        }
        4 => {
            let mut v = as_json(&valid);
            v["kind"] = json!("bogus");
            ("applied", v.to_string().into_bytes(), true, "unknown_kind")
        }
        5 => {
            let mut v = as_json(&valid);
            v["node"] = json!(other);
            ("applied", v.to_string().into_bytes(), true, "impersonation")
        }
        6 => ("applied", valid.encode(), false, "unauthenticated"),
        7 => {
            let mut v = as_json(&valid);
            v["body"]["section"] = Value::Null;
            ("applied", v.to_string().into_bytes(), true, "invalid")
        }
        8 => {
            // Unknown fields are accepted (decision 0020); an unknown value of
            // a known field is not.
            let mut v = as_json(&valid);
            v["body"]["outcome"] = json!("exploded");
            ("applied", v.to_string().into_bytes(), true, "invalid")
        }
        _ => {
            let mut v = as_json(&valid);
            v["seq"] = json!("not a number");
            ("applied", v.to_string().into_bytes(), true, "malformed")
        }
    }
}

/// 10,000 malformed, truncated, oversized, wrong-kind, unknown-kind,
/// wrong-identity (impersonation, no user_id) and invalid messages mixed into
/// valid traffic: each is dead-lettered once with its reason, every valid report
/// is applied, and the consumer never restarts (one broker connection, the
/// process up all along). Reports under a routing key of an unknown kind
/// (`<node>.bogus`), which no queue is bound for, are dead-lettered too, each
/// exactly once, with reason `unroutable` (the alternate exchange of `reports`).
#[tokio::test(flavor = "multi_thread")]
async fn ten_thousand_poison_messages_are_dead_lettered_and_valid_traffic_flows()
-> anyhow::Result<()> {
    let started = Instant::now();
    let mut rng = StdRng::seed_from_u64(seed());
    let mut mesh = Mesh::start().await?;
    let creds = add_nodes(&mesh.env, "p", POISON_NODES).await?;
    let mut nodes = connect_all(creds, 16).await?;
    let names: Vec<String> = nodes.iter().map(|n| n.node().to_string()).collect();

    let mut valid_ids = Vec::new();
    let mut expected: BTreeMap<&'static str, usize> = BTreeMap::new();
    let mut confirms = Vec::new();
    for n in &mut nodes {
        let h = n.hello(&[]);
        valid_ids.push(h.id);
        confirms.push(n.send(&h).await?);
    }
    confirmed(confirms).await?;
    let total = POISON + POISON_NODES * VALID_PER_NODE;
    let mut sent_poison = 0;
    let mut confirms = Vec::new();
    for i in 0..total {
        let who = i % POISON_NODES;
        let n = &mut nodes[who];
        // Valid and poison interleaved at random, in the proportion of their totals.
        let poison_left = POISON - sent_poison;
        let valid_left = total - i - poison_left;
        if valid_left == 0 || (poison_left > 0 && rng.random_range(0..total - i) < poison_left) {
            let other = &names[(who + 1) % POISON_NODES];
            let (kind, payload, with_user, code) = poison(&mut rng, sent_poison, n, other);
            *expected.entry(code).or_default() += 1;
            let key = format!("{}.{kind}", n.node());
            confirms.push(n.raw(&key, &payload, None, with_user).await?);
            sent_poison += 1;
        } else {
            let a = n.applied(Section::Config, 1);
            valid_ids.push(a.id);
            confirms.push(n.send(&a).await?);
        }
        if confirms.len() >= 500 {
            confirmed(std::mem::take(&mut confirms)).await?;
        }
    }
    confirmed(confirms).await?;
    assert_eq!(sent_poison, POISON);
    assert_eq!(valid_ids.len(), POISON_NODES * (VALID_PER_NODE + 1));

    // Unroutable: a valid report under a routing key of a kind no queue takes.
    let mut unroutable_ids = BTreeSet::new();
    let mut confirms = Vec::new();
    for i in 0..UNROUTABLE {
        let n = &mut nodes[i % POISON_NODES];
        let a = n.applied(Section::Config, 1);
        let id = a.id.to_string();
        let key = format!("{}.bogus", n.node());
        confirms.push(n.raw(&key, &a.encode(), Some(&id), true).await?);
        unroutable_ids.insert(id);
    }
    confirmed(confirms).await?;
    *expected.entry("unroutable").or_default() += UNROUTABLE;
    let dead_letters = POISON + UNROUTABLE;

    wait_for(
        "every poison message dead-lettered",
        Duration::from_secs(120),
        || async {
            Ok(
                (queue_depth(&mesh.env, "dead-letter").await? as usize >= dead_letters)
                    .then_some(()),
            )
        },
    )
    .await?;
    wait_for(
        "every valid report applied",
        Duration::from_secs(120),
        || async {
            let n = inbox_count(&mesh.env, "inventory", &valid_ids).await?;
            Ok((n == valid_ids.len() as i64).then_some(()))
        },
    )
    .await?;

    let dead = drain(&mesh.env, "dead-letter").await?;
    assert_eq!(dead.len(), dead_letters, "dead letters");
    let mut got: BTreeMap<&str, usize> = BTreeMap::new();
    let mut unroutable_seen = BTreeSet::new();
    for (id, headers) in &dead {
        if let Some(id) = id.as_ref().filter(|id| unroutable_ids.contains(*id)) {
            assert_eq!(
                headers.get("x-mesh-reason-code").map(String::as_str),
                Some("unroutable"),
                "{headers:?}"
            );
            assert!(
                unroutable_seen.insert(id.clone()),
                "{id} dead-lettered twice"
            );
        }
        let code = headers
            .get("x-mesh-reason-code")
            .map(String::as_str)
            .unwrap_or("");
        let reason = headers
            .get("x-mesh-reason")
            .map(String::as_str)
            .unwrap_or("");
        assert!(
            !reason.is_empty(),
            "a dead letter without a reason: {headers:?}"
        );
        assert!(headers.contains_key("x-mesh-origin-queue"), "{headers:?}");
        let known = expected
            .keys()
            .find(|k| **k == code)
            .copied()
            .unwrap_or("other");
        *got.entry(known).or_default() += 1;
    }
    assert_eq!(got, expected, "dead letters by reason code");
    assert_eq!(
        unroutable_seen, unroutable_ids,
        "unroutable reports dead-lettered"
    );

    let text = metrics(&mesh).await?;
    assert_eq!(
        metric_sum(&text, "mesh_controller_dead_lettered_total", ""),
        dead_letters as f64
    );
    assert_eq!(
        metric_sum(
            &text,
            "mesh_controller_dead_lettered_total",
            "reason=\"unroutable\""
        ),
        UNROUTABLE as f64
    );
    assert_eq!(
        metric_sum(&text, "mesh_controller_broker_connects_total", ""),
        1.0,
        "the consumer restarted:\n{text}"
    );
    let pid = mesh.controller().map(|p| p.pid()).unwrap_or(0);
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let state = stat.rsplit_once(") ").and_then(|(_, r)| r.chars().next());
    assert!(
        matches!(state, Some('R' | 'S' | 'D')),
        "the controller is not running ({state:?})"
    );
    assert!(!mesh.controller_log().contains("broker session ended"));
    for n in nodes {
        n.close().await;
    }
    eprintln!("poison test took {:?}", started.elapsed());
    mesh.teardown().await
}
