//! Joining, set-based: the common hello — a node never seen before, whose agent
//! this controller speaks — for a whole batch at once. One statement inserts
//! every such node (it returns those that were new), one writes their
//! `inventory.node.joined` events, one records the generations they reported.
//! Every other hello (a node already known, a refused agent, a node named by
//! more than one hello of the batch) goes through the one-by-one path in
//! `reports.rs`, after this, in the batch's order; the rows and events are the
//! same as if every hello had gone that way.

use std::collections::{BTreeMap, HashMap, HashSet};

use chrono::{DateTime, Utc};
use mesh_plumbing::outbox;
use mesh_protocol::{
    Envelope, Hello, Labels, NodeLabelsChanged, ProtocolRange, RecordEvent, RecordKind, Report,
};
use sqlx::PgConnection;
use sqlx::types::Json;

use crate::nodes::{LabelTrust, clamp, to_i64, upsert_generations};
use crate::{Error, SCHEMA};

/// The hellos of a batch that may join set-based: accepted ones (this
/// controller speaks the agent's protocol) of nodes named by no other hello of
/// the batch, by node (so that rows are written in key order).
pub(crate) fn candidates<'a>(
    hellos: &[(&'a Envelope<Report>, &'a Hello)],
) -> BTreeMap<&'a str, (&'a Envelope<Report>, &'a Hello)> {
    let mut count: HashMap<&str, usize> = HashMap::new();
    for (env, _) in hellos {
        *count.entry(env.node.as_str()).or_default() += 1;
    }
    hellos
        .iter()
        .filter(|(env, h)| {
            count.get(env.node.as_str()) == Some(&1) && h.refusal(ProtocolRange::THIS).is_none()
        })
        .map(|(env, h)| (env.node.as_str(), (*env, *h)))
        .collect()
}

/// Insert the `candidates` nodes that do not exist yet, write their
/// `inventory.node.joined` events and raise the generations they reported, as
/// the one-by-one path does for a new node (facts, protocol range, version 1,
/// the labels bound to its join token as operator labels, the trusted keys of
/// the hello's labels beneath them). Returns the nodes it inserted; the
/// caller handles the others one by one.
pub(crate) async fn new_nodes<'a>(
    tx: &mut PgConnection,
    candidates: &BTreeMap<&'a str, (&'a Envelope<Report>, &'a Hello)>,
    heard_at: DateTime<Utc>,
    trust: &LabelTrust,
) -> Result<HashSet<String>, Error> {
    if candidates.is_empty() {
        return Ok(HashSet::new());
    }
    let n = candidates.len();
    let mut ids = Vec::with_capacity(n);
    let mut hostnames = Vec::with_capacity(n);
    let mut arches = Vec::with_capacity(n);
    let mut cpus = Vec::with_capacity(n);
    let mut memory = Vec::with_capacity(n);
    let mut agents = Vec::with_capacity(n);
    let mut keys = Vec::with_capacity(n);
    let mut labels = Vec::with_capacity(n);
    let mut sent = Vec::with_capacity(n);
    let mut seqs = Vec::with_capacity(n);
    let mut mins = Vec::with_capacity(n);
    let mut maxes = Vec::with_capacity(n);
    for (node, (env, hello)) in candidates {
        let range = hello.protocol();
        ids.push(*node);
        hostnames.push(hello.hostname.as_str());
        arches.push(hello.arch.as_str());
        cpus.push(i64::from(hello.cpus));
        memory.push(to_i64(hello.memory_bytes));
        agents.push(hello.agent_version.as_str());
        keys.push(hello.public_key.as_deref());
        labels.push(
            serde_json::to_string(&hello.labels).map_err(|e| Error::Corrupt {
                node: (*node).to_owned(),
                reason: format!("labels do not serialize: {e}"),
            })?,
        );
        sent.push(clamp(env.sent_at));
        seqs.push(to_i64(env.seq));
        mins.push(i32::from(range.min));
        maxes.push(i32::from(range.max));
    }
    // Keys are unique (one hello per node) and sorted: rows are locked in key
    // order. A node that exists already conflicts and is not returned.
    let inserted: Vec<(String, Json<Labels>)> = sqlx::query_as(
        "INSERT INTO inventory.nodes (id, hostname, arch, cpus, memory_bytes, agent_version, public_key, \
         reported_labels, last_seen, hello_at, last_seq, heard_at, protocol_min, protocol_max, operator_labels) \
         SELECT u.id, u.hostname, u.arch, u.cpus, u.memory, u.agent, u.key, u.labels::jsonb, \
                u.sent_at, u.sent_at, u.seq, $12, u.pmin, u.pmax, \
                COALESCE((SELECT e.labels FROM inventory.enrolled_labels e WHERE e.node = u.id), '{}') \
         FROM UNNEST($1::text[], $2::text[], $3::text[], $4::bigint[], $5::bigint[], $6::text[], \
                     $7::text[], $8::text[], $9::timestamptz[], $10::bigint[], $11::integer[], $13::integer[]) \
              AS u(id, hostname, arch, cpus, memory, agent, key, labels, sent_at, seq, pmin, pmax) \
         ORDER BY u.id \
         ON CONFLICT (id) DO NOTHING RETURNING id, operator_labels",
    )
    .bind(&ids)
    .bind(&hostnames)
    .bind(&arches)
    .bind(&cpus)
    .bind(&memory)
    .bind(&agents)
    .bind(&keys)
    .bind(&labels)
    .bind(&sent)
    .bind(&seqs)
    .bind(&mins)
    .bind(heard_at)
    .bind(&maxes)
    .fetch_all(&mut *tx)
    .await?;
    let operator: BTreeMap<String, Labels> = inserted
        .into_iter()
        .map(|(id, labels)| (id, labels.0))
        .collect();
    let inserted: HashSet<String> = operator.keys().cloned().collect();
    if inserted.is_empty() {
        return Ok(inserted);
    }
    let mut events = Vec::with_capacity(inserted.len());
    let mut generations = BTreeMap::new();
    for (node, (env, hello)) in candidates {
        if !inserted.contains(*node) {
            continue;
        }
        events.push(RecordEvent::new(RecordKind::NodeJoined(
            NodeLabelsChanged {
                node: env.node.clone(),
                labels: trust.effective(
                    node,
                    &hello.labels,
                    operator.get(*node).unwrap_or(&Labels::new()),
                ),
                version: 1,
            },
        )));
        for (section, generation) in &hello.applied {
            generations.insert((*node, section.as_str()), to_i64(*generation));
        }
    }
    outbox::record_many(tx, SCHEMA, &events).await?;
    upsert_generations(tx, generations).await?;
    tracing::debug!(nodes = inserted.len(), "nodes joined");
    Ok(inserted)
}
