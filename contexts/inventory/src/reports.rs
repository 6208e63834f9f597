//! Report handlers. A batch may mix kinds and nodes: the hellos of nodes never
//! seen before join set-based (`join.rs`: a statement for the batch), every
//! other hello is handled one by one (a known node, a refused agent: rare, and
//! they may emit events); heartbeats and applied reports with one statement per
//! batch each (a heartbeat batch's: liveness, applied generations and inventory
//! sections to catch up, in one round trip; the catch-up part is the section
//! component's statement).

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use mesh_plumbing::applied;
use mesh_plumbing::section::Resend;
use mesh_protocol::{
    Applied, DeclarationItems, Envelope, Hello, Labels, LivenessState, NodeId, NodeLiveness,
    ProtocolRange, RecordKind, Report, Section,
};
use sqlx::PgConnection;
use sqlx::types::Json;

use crate::nodes::{LabelTrust, clamp, emit, emit_liveness, to_i64, upsert_generations};
use crate::{Error, InventorySettings, SECTIONS};

pub(crate) async fn handle(
    tx: &mut PgConnection,
    reports: &[Envelope<Report>],
    settings: &InventorySettings,
    plan: &crate::fleet::Carried,
) -> Result<(), Error> {
    // The controller's clock when it handled the batch: liveness is judged on it,
    // never on the node's clock.
    let heard_at = Utc::now();
    let mut heartbeats = Vec::new();
    let mut applied = Vec::new();
    let mut units = Vec::new();
    let mut hellos = Vec::new();
    for env in reports {
        match &env.body {
            Report::Hello(h) => hellos.push((env, h)),
            Report::Heartbeat(_) => heartbeats.push(env),
            Report::Applied(a) => applied.push((env, a)),
            Report::Units(u) => units.push((env, u)),
            // Certificates are connectivity's alone, health observability's,
            // resources provisioning's; logs answers the controller's (never
            // a context's).
            Report::Certificates(_)
            | Report::Health(_)
            | Report::Logs(_)
            | Report::Resources(_) => {}
        }
    }
    // New nodes first, all at once; the rest one by one, in the batch's order.
    // They are disjoint sets of nodes, so the order between them changes nothing.
    let trust = &settings.label_trust;
    let joined =
        crate::join::new_nodes(tx, &crate::join::candidates(&hellos), heard_at, trust).await?;
    // Where Prometheus scrapes each node, from its newest hello only.
    crate::scrape::record(tx, &hellos).await?;
    for (env, h) in hellos {
        if joined.contains(env.node.as_str()) {
            continue;
        }
        if let Some(reason) = h.refusal(ProtocolRange::THIS) {
            crate::protocol::refuse(tx, env, h, &reason, heard_at).await?;
            continue;
        }
        let was_refused = crate::protocol::was_refused(tx, &env.node).await?;
        hello(tx, env, h, heard_at, trust).await?;
        crate::protocol::accepted(tx, &env.node, h, was_refused, trust).await?;
    }
    // Nodes behind or ahead on their inventory section: caught up at once.
    SECTIONS.on_hello(tx, reports).await?;
    // After the catch-up, which knows no section of theirs yet (before it,
    // the catch-up would send the new section a second time).
    declare_joined(tx, &joined, plan).await?;
    heartbeat_batch(tx, &heartbeats, heard_at, settings.resend_after).await?;
    applied_batch(tx, &applied).await?;
    crate::units::record(tx, &units, heard_at).await?;
    Ok(())
}

/// Nodes that joined now are declared what every node's section carries
/// (the mesh's endpoints, the heartbeat plan) at once, not at the next
/// reconcile that places on them or the next resync. They run nothing yet;
/// no other writer sees their rows before this transaction commits, so this
/// declare needs no fleet lock. Nothing to carry: nothing declared. A node
/// that reports a generation above 1 (its agent kept a store the database
/// does not know) ignores this one as stale, and its next heartbeat lifts
/// the section above its own (the section component's catch-up).
async fn declare_joined(
    tx: &mut PgConnection,
    joined: &std::collections::HashSet<String>,
    plan: &crate::fleet::Carried,
) -> Result<(), Error> {
    if joined.is_empty() {
        return Ok(());
    }
    let bare = mesh_plumbing::section::Items::new(plan.bare())?;
    if bare.is_empty() {
        return Ok(());
    }
    let mut desired = Vec::with_capacity(joined.len());
    for node in joined {
        let id = NodeId::parse(node).map_err(|e| Error::Corrupt {
            node: node.clone(),
            reason: e.to_string(),
        })?;
        desired.push((id, bare.clone()));
    }
    SECTIONS.declare(tx, desired).await?;
    Ok(())
}

/// A node heard again after it was judged unreachable: say so on the record.
pub(crate) async fn revived(
    tx: &mut PgConnection,
    node: &str,
    heard_at: DateTime<Utc>,
    last_heard: DateTime<Utc>,
) -> Result<(), Error> {
    let node = NodeId::parse(node).map_err(|e| Error::Corrupt {
        node: node.to_owned(),
        reason: e.to_string(),
    })?;
    tracing::info!(node = %node, "node alive again");
    emit_liveness(
        tx,
        NodeLiveness {
            node,
            state: LivenessState::Alive,
            at: heard_at,
            last_heard: Some(last_heard),
        },
    )
    .await
}

async fn hello(
    tx: &mut PgConnection,
    env: &Envelope<Report>,
    hello: &Hello,
    heard_at: DateTime<Utc>,
    trust: &LabelTrust,
) -> Result<(), Error> {
    let node = &env.node;
    let sent_at = clamp(env.sent_at);
    let seq = to_i64(env.seq);
    // A new node's operator labels are those bound to its join token, if
    // identity told them (`inventory.enrolled_labels`).
    let inserted: Option<Json<Labels>> = sqlx::query_scalar(
        "INSERT INTO inventory.nodes (id, hostname, arch, cpus, memory_bytes, agent_version, public_key, \
         reported_labels, last_seen, hello_at, last_seq, heard_at, operator_labels) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $9, $10, $11, \
                 COALESCE((SELECT labels FROM inventory.enrolled_labels WHERE node = $1), '{}')) \
         ON CONFLICT (id) DO NOTHING RETURNING operator_labels",
    )
    .bind(node.as_str())
    .bind(&hello.hostname)
    .bind(&hello.arch)
    .bind(i64::from(hello.cpus))
    .bind(to_i64(hello.memory_bytes))
    .bind(&hello.agent_version)
    .bind(&hello.public_key)
    .bind(Json(&hello.labels))
    .bind(sent_at)
    .bind(seq)
    .bind(heard_at)
    .fetch_optional(&mut *tx)
    .await?;

    if let Some(operator) = inserted {
        let labels = trust.effective(node.as_str(), &hello.labels, &operator.0);
        emit(tx, RecordKind::NodeJoined, node, labels, 1).await?;
    } else {
        type Row = (
            Json<Labels>,
            Json<Labels>,
            i64,
            DateTime<Utc>,
            String,
            DateTime<Utc>,
        );
        let (reported, operator, version, hello_at, state, last_heard): Row = sqlx::query_as(
            "SELECT reported_labels, operator_labels, version, hello_at, state, heard_at FROM inventory.nodes \
             WHERE id = $1 FOR UPDATE",
        )
        .bind(node.as_str())
        .fetch_one(&mut *tx)
        .await?;
        // Any report proves the node is there now, old or new.
        sqlx::query(
            "UPDATE inventory.nodes SET state = 'alive', unreachable_since = NULL, \
             heard_at = greatest(heard_at, $2) WHERE id = $1",
        )
        .bind(node.as_str())
        .bind(heard_at)
        .execute(&mut *tx)
        .await?;
        if state == "unreachable" {
            revived(tx, node.as_str(), heard_at, last_heard).await?;
        }
        if sent_at < hello_at {
            // An older hello arriving late: it proves the node was alive, no more.
            sqlx::query(
                "UPDATE inventory.nodes SET last_seen = greatest(last_seen, $2), last_seq = greatest(last_seq, $3) \
                 WHERE id = $1",
            )
            .bind(node.as_str())
            .bind(sent_at)
            .bind(seq)
            .execute(&mut *tx)
            .await?;
        } else {
            let before = trust.effective(node.as_str(), &reported.0, &operator.0);
            let after = trust.effective(node.as_str(), &hello.labels, &operator.0);
            let changed = before != after;
            let version = if changed { version + 1 } else { version };
            sqlx::query(
                "UPDATE inventory.nodes SET hostname = $2, arch = $3, cpus = $4, memory_bytes = $5, \
                 agent_version = $6, public_key = $7, reported_labels = $8, hello_at = $9, \
                 last_seen = greatest(last_seen, $9), last_seq = greatest(last_seq, $10), \
                 version = $11, units_seq = least(units_seq, $10) WHERE id = $1",
            )
            .bind(node.as_str())
            .bind(&hello.hostname)
            .bind(&hello.arch)
            .bind(i64::from(hello.cpus))
            .bind(to_i64(hello.memory_bytes))
            .bind(&hello.agent_version)
            .bind(&hello.public_key)
            .bind(Json(&hello.labels))
            .bind(sent_at)
            .bind(seq)
            .bind(version)
            .execute(&mut *tx)
            .await?;
            if changed {
                emit(tx, RecordKind::NodeUpdated, node, after, version).await?;
            }
        }
    }

    let generations = hello
        .applied
        .iter()
        .map(|(s, g)| ((node.as_str(), s.as_str()), to_i64(*g)))
        .collect();
    upsert_generations(tx, generations).await
}

/// One statement for the whole batch (one round trip): last_seen of every
/// node in it; its applied generations raised (rows already current are left
/// alone); and the section component's catch-up of the inventory section
/// (`Sections::catch_up_sql`): nodes behind, last sent longer than
/// `resend_after` ago, and nodes ahead, marked sent now and returned to be
/// declared again (one bulk insert after).
/// Heartbeats skip the inbox, so all of it is idempotent (greatest). Nodes not
/// known yet (no hello) are ignored.
async fn heartbeat_batch(
    tx: &mut PgConnection,
    heartbeats: &[&Envelope<Report>],
    heard_at: DateTime<Utc>,
    resend_after: std::time::Duration,
) -> Result<(), Error> {
    if heartbeats.is_empty() {
        return Ok(());
    }
    // Per node: newest sent_at, highest seq and inventory generation, interval.
    type Seen = (DateTime<Utc>, i64, i64, Option<i64>);
    let mut seen: BTreeMap<&str, Seen> = BTreeMap::new();
    let mut generations: BTreeMap<(&str, &str), i64> = BTreeMap::new();
    for env in heartbeats {
        let entry = seen
            .entry(env.node.as_str())
            .or_insert((DateTime::<Utc>::MIN_UTC, 0, 0, None));
        entry.0 = entry.0.max(clamp(env.sent_at));
        entry.1 = entry.1.max(to_i64(env.seq));
        if let Report::Heartbeat(hb) = &env.body {
            let inventory = hb.applied.get(&Section::Inventory).copied().unwrap_or(0);
            entry.2 = entry.2.max(to_i64(inventory));
            entry.3 = hb.interval_ms.map(to_i64).or(entry.3);
            for (section, generation) in &hb.applied {
                let g = generations
                    .entry((env.node.as_str(), section.as_str()))
                    .or_insert(0);
                *g = (*g).max(to_i64(*generation));
            }
        }
    }
    let mut ids = Vec::with_capacity(seen.len());
    let mut times = Vec::with_capacity(seen.len());
    let mut seqs = Vec::with_capacity(seen.len());
    let mut inventory = Vec::with_capacity(seen.len());
    let mut beats = Vec::with_capacity(seen.len());
    for (id, (at, seq, applied, beat)) in seen {
        ids.push(id);
        times.push(at);
        seqs.push(seq);
        inventory.push(applied);
        beats.push(beat);
    }
    let (mut g_nodes, mut g_sections, mut g_generations) = (
        Vec::with_capacity(generations.len()),
        Vec::with_capacity(generations.len()),
        Vec::with_capacity(generations.len()),
    );
    for ((node, section), generation) in generations {
        g_nodes.push(node);
        g_sections.push(section);
        g_generations.push(generation);
    }
    // The previous state comes from the statement's snapshot (`prev`), locked
    // first in key order, so a node judged unreachable and heard again is seen
    // once and concurrent batches cannot deadlock. An applied row already at or
    // above its generation is filtered out before the insert: an `ON CONFLICT
    // DO UPDATE … WHERE` that updates nothing still locks the row.
    type Row = (
        String,
        String,
        Option<DateTime<Utc>>,
        Option<i64>,
        Option<Json<DeclarationItems>>,
    );
    let sql = format!(
        "WITH u AS (SELECT * FROM UNNEST($1::text[], $2::timestamptz[], $3::bigint[], $4::bigint[], \
                    $10::bigint[]) AS u(id, sent_at, seq, inventory, beat_ms)), \
         prev AS (SELECT n.id, n.state, n.heard_at FROM inventory.nodes n JOIN u ON u.id = n.id \
                  ORDER BY n.id FOR UPDATE OF n), \
         seen AS (UPDATE inventory.nodes AS n SET last_seen = greatest(n.last_seen, u.sent_at), \
                  last_seq = greatest(n.last_seq, u.seq), state = 'alive', unreachable_since = NULL, \
                  heard_at = greatest(n.heard_at, $5), beat_ms = coalesce(u.beat_ms, n.beat_ms) \
                  FROM u, prev WHERE n.id = u.id AND prev.id = n.id \
                  RETURNING n.id, prev.state, prev.heard_at), \
         applied AS (INSERT INTO inventory.applied AS a (node, section, generation) \
                  SELECT g.node, g.section, g.generation \
                  FROM UNNEST($6::text[], $7::text[], $8::bigint[]) AS g(node, section, generation) \
                  WHERE EXISTS (SELECT 1 FROM prev WHERE prev.id = g.node) \
                    AND NOT EXISTS (SELECT 1 FROM inventory.applied o WHERE o.node = g.node \
                                    AND o.section = g.section AND o.generation >= g.generation) \
                  ON CONFLICT (node, section) DO UPDATE SET generation = excluded.generation, \
                  updated_at = now() WHERE a.generation < excluded.generation), \
         resend AS ({catch_up}) \
         SELECT 'revived', id, heard_at, NULL::bigint, NULL::jsonb FROM seen WHERE state = 'unreachable' \
         UNION ALL SELECT 'resend', node, NULL, generation, items FROM resend",
        catch_up = SECTIONS.catch_up_sql("(SELECT id, inventory FROM u)", Some("$9")),
    );
    let rows: Vec<Row> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(&ids)
        .bind(&times)
        .bind(&seqs)
        .bind(&inventory)
        .bind(heard_at)
        .bind(&g_nodes)
        .bind(&g_sections)
        .bind(&g_generations)
        .bind(resend_after.as_secs_f64())
        .bind(&beats)
        .fetch_all(&mut *tx)
        .await?;
    let mut resend = Vec::new();
    for (what, node, last_heard, generation, items) in rows {
        match (what.as_str(), last_heard, generation, items) {
            ("revived", Some(last_heard), _, _) => revived(tx, &node, heard_at, last_heard).await?,
            ("resend", _, Some(generation), Some(items)) => {
                resend.push(Resend {
                    node,
                    generation,
                    items: items.0,
                });
            }
            _ => {
                return Err(Error::Corrupt {
                    node,
                    reason: format!("heartbeat statement returned an incomplete `{what}` row"),
                });
            }
        }
    }
    SECTIONS.resend(tx, resend).await?;
    Ok(())
}

/// All applied reports of a batch in one upsert. The generation only advances
/// on outcome `applied`; the outcome and error are the newest report's, unless
/// it concerns an older generation than the recorded outcome's.
async fn applied_batch(
    tx: &mut PgConnection,
    reports: &[(&Envelope<Report>, &Applied)],
) -> Result<(), Error> {
    let rows = applied::fold(reports, |env, a| {
        // An unsupported section is recorded under its name, so the node's
        // view shows that its agent does not know it.
        let Some(section) = a.section_name() else {
            tracing::debug!(node = %env.node, "applied report without a section: nothing to record");
            return None;
        };
        Some((env.node.as_str(), section))
    });
    if rows.is_empty() {
        return Ok(());
    }
    let (mut nodes, mut sections, mut applied, mut outcomes, mut generations, mut errors) = (
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
    );
    for ((node, section), row) in rows {
        nodes.push(node);
        sections.push(section);
        applied.push(row.applied);
        outcomes.push(row.outcome);
        generations.push(row.generation);
        errors.push(row.error);
    }
    sqlx::query(
        "INSERT INTO inventory.applied AS a (node, section, generation, outcome, outcome_generation, error) \
         SELECT u.node, u.section, coalesce(u.applied, 0), u.outcome, u.generation, u.error \
         FROM UNNEST($1::text[], $2::text[], $3::bigint[], $4::text[], $5::bigint[], $6::text[]) \
              AS u(node, section, applied, outcome, generation, error) \
         WHERE EXISTS (SELECT 1 FROM inventory.nodes n WHERE n.id = u.node) \
         ON CONFLICT (node, section) DO UPDATE SET \
           generation = greatest(a.generation, excluded.generation), \
           outcome = CASE WHEN (excluded.outcome_generation IS NULL OR a.outcome_generation IS NULL \
                 OR excluded.outcome_generation >= a.outcome_generation) THEN excluded.outcome ELSE a.outcome END, \
           outcome_generation = CASE WHEN (excluded.outcome_generation IS NULL OR a.outcome_generation IS NULL \
                 OR excluded.outcome_generation >= a.outcome_generation) THEN excluded.outcome_generation ELSE a.outcome_generation END, \
           error = CASE WHEN (excluded.outcome_generation IS NULL OR a.outcome_generation IS NULL \
                 OR excluded.outcome_generation >= a.outcome_generation) THEN excluded.error ELSE a.error END, \
           updated_at = now()",
    )
    .bind(&nodes)
    .bind(&sections)
    .bind(&applied)
    .bind(&outcomes)
    .bind(&generations)
    .bind(&errors)
    .execute(&mut *tx)
    .await?;
    Ok(())
}
