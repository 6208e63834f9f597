//! The declared section: the one lifecycle every context that tells nodes
//! something follows (rule 6: whole sections, never deltas).
//!
//! A context computes the desired items of each node and hands them to
//! [`Sections::declare`]; this component does the rest, always in the caller's
//! transaction and through the context's own outbox:
//!
//! - **declare**: a node whose items' digest differs from the stored one gets
//!   generation + 1 (1 for its first non-empty section), its row is upserted and
//!   the whole section is queued in the outbox, in bulk (one upsert and one
//!   outbox insert per 500 nodes). Equal digests declare nothing.
//! - **hello** ([`Sections::on_hello`]): a node behind its declared generation
//!   is sent the section again at once; a node ahead of it (the database was
//!   restored from an older backup, or the row was lost) is declared the same
//!   items under a generation above its own, so it does not ignore what follows.
//! - **heartbeat** ([`Sections::on_heartbeat`], or [`Sections::catch_up_sql`]
//!   inside a context's own one-statement heartbeat): the same, but a node
//!   behind is sent its section at most once per `resend_after`.
//! - **resync** ([`resync`]): the periodic whole-fleet recompute of a
//!   [`SectionOwner`], which declares whatever differs from what is stored
//!   (a row changed or lost behind the component's back, an event missed).
//!
//! What a node *applied* is the node's own statement about itself: inventory
//! records it for every section (hello, heartbeat, `applied` reports). The
//! section table holds what was declared and when it was last sent.
//!
//! The table is `<schema>.sections`, one row per node, created from the one
//! definition in [`table`].

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use mesh_protocol::{
    Declaration, DeclarationItems, Envelope, MAX_DECLARATION_BYTES, MAX_ITEMS, NodeId,
    ProtocolRange, Report, Section, digest_items,
};
use serde::Serialize;
use sqlx::types::Json;
use sqlx::{AssertSqlSafe, PgConnection, PgPool};
use thiserror::Error;

use crate::{Context, OutboxSignal, outbox};

/// Rows written per statement when declaring in bulk.
const CHUNK: usize = 500;

/// Room left in a declaration for the envelope around the items.
const ENVELOPE_OVERHEAD: usize = 1024;

/// The table's one definition. Migrations run these strings, and refinery
/// checksums what it ran: the text of a shape is frozen once released. A new
/// shape is a new function here (an `ALTER` from the previous one) that every
/// context adds as a new migration.
pub mod table {
    /// Shape 1 of `<schema>.sections`: the section declared to each node.
    ///
    /// - `generation`: the newest declared generation (monotonic per node).
    /// - `digest`: [`mesh_protocol::digest_items`] of `items`; a recompute with
    ///   the same digest declares nothing.
    /// - `items`: the whole section as declared (re-sent as it is).
    /// - `declared_at`: when `generation` was last raised.
    /// - `last_sent_at`: when the section was last queued in the outbox;
    ///   heartbeats re-send to a node behind at most once per `resend_after`.
    pub fn create_v1(schema: &str) -> String {
        format!(
            "-- The section declared to each node (mesh_plumbing::section, table shape 1).\n\
             CREATE TABLE {schema}.sections (\n\
             \x20   node text PRIMARY KEY,\n\
             \x20   generation bigint NOT NULL CHECK (generation > 0),\n\
             \x20   digest text NOT NULL,\n\
             \x20   items jsonb NOT NULL,\n\
             \x20   declared_at timestamptz NOT NULL DEFAULT now(),\n\
             \x20   last_sent_at timestamptz NOT NULL DEFAULT now()\n\
             );\n"
        )
    }

    /// For a context whose `<schema>.sections` predates the component: the
    /// table is recreated from [`create_v1`] and every row kept (columns the
    /// shape does not have are dropped with the old table, and with them its
    /// constraints: a context re-adds its own, e.g. a foreign key, after this).
    pub fn adopt_v1(schema: &str) -> String {
        format!(
            "ALTER TABLE {schema}.sections RENAME TO sections_adopted;\n\
             ALTER INDEX {schema}.sections_pkey RENAME TO sections_adopted_pkey;\n\
             {create}\
             INSERT INTO {schema}.sections (node, generation, digest, items, declared_at, last_sent_at)\n\
             \x20   SELECT node, generation, digest, items, declared_at, last_sent_at FROM {schema}.sections_adopted;\n\
             DROP TABLE {schema}.sections_adopted;\n",
            create = create_v1(schema)
        )
    }
}

/// Why the component could not do its part.
#[derive(Debug, Error)]
pub enum SectionError {
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    /// A stored value that does not read back (a bug or a manual edit).
    #[error("stored section of node `{node}` is unreadable: {reason}")]
    Corrupt { node: String, reason: String },
    /// Items that do not serialize (they always should).
    #[error("section items do not serialize: {0}")]
    Items(String),
}

impl From<SectionError> for crate::HandlerError {
    fn from(e: SectionError) -> Self {
        match e {
            SectionError::Database(db) => crate::HandlerError::from(db),
            other => crate::HandlerError::Permanent(other.to_string()),
        }
    }
}

/// The desired items of one node's section, with their JSON and digest computed
/// once: nodes with the same items share one `Items` (cheap to clone).
#[derive(Debug, Clone)]
pub struct Items {
    items: Arc<DeclarationItems>,
    json: Arc<str>,
    digest: Arc<str>,
    too_large: Option<Arc<str>>,
}

impl Items {
    /// Put `items` in canonical order (files by path, units by name) and compute
    /// their JSON, digest and whether an agent would accept them.
    pub fn new(mut items: DeclarationItems) -> Result<Items, SectionError> {
        items.files.sort_by(|a, b| a.path.cmp(&b.path));
        items.units.sort_by(|a, b| a.name.cmp(&b.name));
        items.secrets.sort_by(|a, b| a.path.cmp(&b.path));
        items.artifacts.sort_by(|a, b| a.digest.cmp(&b.digest));
        items.resources.sort_by_key(|r| r.grant);
        let json = serde_json::to_string(&items).map_err(|e| SectionError::Items(e.to_string()))?;
        let too_large = if items.files.len() > MAX_ITEMS {
            Some(format!("{} files, limit {MAX_ITEMS}", items.files.len()))
        } else if items.secrets.len() > MAX_ITEMS {
            Some(format!(
                "{} secrets, limit {MAX_ITEMS}",
                items.secrets.len()
            ))
        } else if items.resources.len() > mesh_protocol::MAX_RESOURCES {
            Some(format!(
                "{} resources, limit {}",
                items.resources.len(),
                mesh_protocol::MAX_RESOURCES
            ))
        } else if items.units.len() > MAX_ITEMS {
            Some(format!("{} units, limit {MAX_ITEMS}", items.units.len()))
        } else if json.len() + ENVELOPE_OVERHEAD > MAX_DECLARATION_BYTES {
            Some(format!(
                "{} bytes, limit {MAX_DECLARATION_BYTES}",
                json.len() + ENVELOPE_OVERHEAD
            ))
        } else {
            None
        };
        let digest = digest_items(&items);
        Ok(Items {
            items: Arc::new(items),
            json: json.into(),
            digest: digest.into(),
            too_large: too_large.map(Into::into),
        })
    }

    pub fn items(&self) -> &DeclarationItems {
        &self.items
    }

    pub fn digest(&self) -> &str {
        &self.digest
    }

    /// No files, no secrets, no units, no heartbeat plan, no overlay, no
    /// packet filter, no certificates, no artifacts, no resources and no
    /// endpoints.
    pub fn is_empty(&self) -> bool {
        self.items.files.is_empty()
            && self.items.secrets.is_empty()
            && self.items.units.is_empty()
            && self.items.heartbeat.is_none()
            && self.items.overlay.is_none()
            && self.items.firewall.is_none()
            && self.items.certificates.is_empty()
            && self.items.artifacts.is_empty()
            && self.items.resources.is_empty()
            && self.items.endpoints.is_none()
    }

    /// Why an agent would refuse these items (too many, too large); none: it
    /// would accept them.
    pub fn too_large(&self) -> Option<&str> {
        self.too_large.as_deref()
    }
}

/// What [`Sections::declare`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Declared {
    /// Nodes whose desired section was compared.
    pub nodes: usize,
    /// Nodes a new generation was declared to.
    pub declared: usize,
    /// Nodes whose new section an agent would refuse, with the reason (they
    /// were declared all the same; a caller that must refuse rolls back).
    pub too_large: Vec<(String, String)>,
}

/// A section as stored: what was declared to a node.
#[derive(Debug, Clone, PartialEq)]
pub struct Stored {
    pub generation: i64,
    pub digest: String,
    pub items: DeclarationItems,
    pub declared_at: DateTime<Utc>,
    pub last_sent_at: DateTime<Utc>,
}

/// A section to send again, as a catch-up statement returns it.
#[derive(Debug, Clone, PartialEq)]
pub struct Resend {
    pub node: String,
    pub generation: i64,
    pub items: DeclarationItems,
}

fn to_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn to_u64(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

/// One context's section: the table `<schema>.sections` and the section name
/// its declarations carry. A context holds one as a constant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sections {
    pub schema: &'static str,
    pub section: Section,
}

impl Sections {
    pub const fn new(schema: &'static str, section: Section) -> Self {
        Sections { schema, section }
    }

    /// The generation of this section a hello or heartbeat reports (0: none).
    pub fn reported(&self, report: &Report) -> Option<i64> {
        let applied = match report {
            Report::Hello(h) => &h.applied,
            Report::Heartbeat(h) => &h.applied,
            _ => return None,
        };
        Some(to_i64(applied.get(&self.section).copied().unwrap_or(0)))
    }

    /// Declare to each node of `desired` whose items differ from what is stored:
    /// generation + 1, the row upserted and the section queued in the outbox, in
    /// bulk. A node with nothing stored and nothing desired is left alone; a node
    /// whose items all went away gets a generation with none, so its agent
    /// removes them. The caller serializes declares of one node (its own lock):
    /// two must not compute the same generation from one stale read.
    pub async fn declare(
        &self,
        tx: &mut PgConnection,
        mut desired: Vec<(NodeId, Items)>,
    ) -> Result<Declared, SectionError> {
        let mut report = Declared {
            nodes: desired.len(),
            ..Declared::default()
        };
        if desired.is_empty() {
            return Ok(report);
        }
        // Key order: every writer of these rows locks them in node order.
        desired.sort_by(|a, b| a.0.as_str().cmp(b.0.as_str()));
        desired.dedup_by(|a, b| a.0 == b.0);
        let nodes: Vec<&str> = desired.iter().map(|(n, _)| n.as_str()).collect();
        let sql = format!(
            "SELECT node, generation, digest FROM {}.sections WHERE node = ANY($1)",
            self.schema
        );
        let stored: Vec<(String, i64, String)> = sqlx::query_as(AssertSqlSafe(sql))
            .bind(&nodes)
            .fetch_all(&mut *tx)
            .await?;
        let stored: BTreeMap<String, (i64, String)> =
            stored.into_iter().map(|(n, g, d)| (n, (g, d))).collect();
        let mut changes = Vec::new();
        for (node, items) in desired {
            let generation = match stored.get(node.as_str()) {
                Some((_, digest)) if **digest == *items.digest => continue,
                Some((generation, _)) => generation + 1,
                None if items.is_empty() => continue,
                None => 1,
            };
            if let Some(reason) = items.too_large() {
                report
                    .too_large
                    .push((node.as_str().to_owned(), reason.to_owned()));
            }
            changes.push((node, generation, items));
            if changes.len() >= CHUNK {
                report.declared += self.flush(tx, std::mem::take(&mut changes)).await?;
            }
        }
        report.declared += self.flush(tx, changes).await?;
        Ok(report)
    }

    /// Store and declare a chunk of changed sections: one upsert, one outbox insert.
    async fn flush(
        &self,
        tx: &mut PgConnection,
        changes: Vec<(NodeId, i64, Items)>,
    ) -> Result<usize, SectionError> {
        if changes.is_empty() {
            return Ok(0);
        }
        let n = changes.len();
        let (mut nodes, mut generations, mut digests, mut json) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        for (node, generation, items) in &changes {
            nodes.push(node.as_str());
            generations.push(*generation);
            digests.push(&*items.digest);
            json.push(&*items.json);
        }
        let sql = format!(
            "INSERT INTO {s}.sections AS s (node, generation, digest, items, declared_at, last_sent_at) \
             SELECT u.node, u.generation, u.digest, u.items::jsonb, now(), now() \
             FROM UNNEST($1::text[], $2::bigint[], $3::text[], $4::text[]) AS u(node, generation, digest, items) \
             ON CONFLICT (node) DO UPDATE SET generation = excluded.generation, digest = excluded.digest, \
             items = excluded.items, declared_at = now(), last_sent_at = now()",
            s = self.schema
        );
        sqlx::query(AssertSqlSafe(sql))
            .bind(&nodes)
            .bind(&generations)
            .bind(&digests)
            .bind(&json)
            .execute(&mut *tx)
            .await?;
        let declarations = changes
            .into_iter()
            .map(|(node, generation, items)| {
                let declaration = Declaration {
                    section: self.section,
                    generation: to_u64(generation),
                    items: (*items.items).clone(),
                };
                (node, declaration)
            })
            .collect();
        outbox::declare_many(tx, self.schema, declarations).await?;
        Ok(n)
    }

    /// The statement that catches nodes up, for a context to run alone or as a
    /// data-modifying CTE of its own heartbeat statement. `reported` is a FROM
    /// item of two columns, the node (text) and the generation of this section
    /// it reported (bigint); it is aliased `r(node, applied)`. A node ahead of
    /// its stored generation gets generation `applied + 1` at once; a node
    /// behind is re-sent its generation: at once when `resend_after` is `None`
    /// (hello), else only if the last send is older than `resend_after`
    /// (an SQL expression in seconds, e.g. a parameter `$3`). Returns
    /// `(node, generation, items)` of each row to send, marked sent now.
    pub fn catch_up_sql(&self, reported: &str, resend_after: Option<&str>) -> String {
        let behind = match resend_after {
            None => "r.applied < s.generation".to_owned(),
            Some(secs) => format!(
                "r.applied < s.generation AND s.last_sent_at < now() - make_interval(secs => {secs})"
            ),
        };
        format!(
            "UPDATE {s}.sections AS s SET \
               generation = CASE WHEN r.applied > s.generation THEN r.applied + 1 ELSE s.generation END, \
               declared_at = CASE WHEN r.applied > s.generation THEN now() ELSE s.declared_at END, \
               last_sent_at = now() \
             FROM {reported} AS r(node, applied) \
             WHERE s.node = r.node AND (r.applied > s.generation OR ({behind})) \
             RETURNING s.node, s.generation, s.items",
            s = self.schema
        )
    }

    /// Queue the sections a catch-up statement returned, in one bulk insert.
    pub async fn resend(
        &self,
        tx: &mut PgConnection,
        rows: Vec<Resend>,
    ) -> Result<usize, SectionError> {
        if rows.is_empty() {
            return Ok(0);
        }
        let mut declarations = Vec::with_capacity(rows.len());
        for row in rows {
            let node = NodeId::parse(&row.node).map_err(|e| SectionError::Corrupt {
                node: row.node.clone(),
                reason: e.to_string(),
            })?;
            declarations.push((
                node,
                Declaration {
                    section: self.section,
                    generation: to_u64(row.generation),
                    items: row.items,
                },
            ));
        }
        let n = declarations.len();
        tracing::debug!(
            section = self.section.as_str(),
            nodes = n,
            "sending sections again to nodes behind or ahead"
        );
        outbox::declare_many(tx, self.schema, declarations).await?;
        Ok(n)
    }

    /// Run [`Sections::catch_up_sql`] over `(node, reported generation)` rows
    /// (a node named twice counts with its last row) and queue what it returns.
    async fn catch_up(
        &self,
        tx: &mut PgConnection,
        reported: BTreeMap<&str, i64>,
        resend_after: Option<Duration>,
    ) -> Result<usize, SectionError> {
        if reported.is_empty() {
            return Ok(0);
        }
        let (nodes, generations): (Vec<&str>, Vec<i64>) = reported.into_iter().unzip();
        let sql = self.catch_up_sql(
            "UNNEST($1::text[], $2::bigint[])",
            resend_after.map(|_| "$3"),
        );
        let mut query = sqlx::query_as(AssertSqlSafe(sql))
            .bind(&nodes)
            .bind(&generations);
        if let Some(after) = resend_after {
            query = query.bind(after.as_secs_f64());
        }
        let rows: Vec<(String, i64, Json<DeclarationItems>)> = query.fetch_all(&mut *tx).await?;
        let rows = rows
            .into_iter()
            .map(|(node, generation, items)| Resend {
                node,
                generation,
                items: items.0,
            })
            .collect();
        self.resend(tx, rows).await
    }

    /// The hellos of a batch: each node behind is sent its section again at
    /// once, each node ahead gets a generation above its own (one statement, one
    /// bulk insert). A node with two hellos in the batch counts with its last.
    pub async fn on_hello(
        &self,
        tx: &mut PgConnection,
        reports: &[Envelope<Report>],
    ) -> Result<usize, SectionError> {
        let mut reported = BTreeMap::new();
        for env in reports {
            // An agent this controller cannot speak to is declared nothing
            // (inventory records why; decision 0020).
            if let Report::Hello(h) = &env.body
                && h.refusal(ProtocolRange::THIS).is_none()
                && let Some(g) = self.reported(&env.body)
            {
                reported.insert(env.node.as_str(), g);
            }
        }
        self.catch_up(tx, reported, None).await
    }

    /// The heartbeats of a batch, for a context that has no heartbeat statement
    /// of its own: like [`Sections::on_hello`], but a node behind is re-sent its
    /// section at most once per `resend_after`. Idempotent (heartbeats skip the
    /// inbox): a node counts with the highest generation it reported.
    pub async fn on_heartbeat(
        &self,
        tx: &mut PgConnection,
        reports: &[Envelope<Report>],
        resend_after: Duration,
    ) -> Result<usize, SectionError> {
        let mut reported: BTreeMap<&str, i64> = BTreeMap::new();
        for env in reports {
            if let (Report::Heartbeat(_), Some(g)) = (&env.body, self.reported(&env.body)) {
                let entry = reported.entry(env.node.as_str()).or_insert(g);
                *entry = (*entry).max(g);
            }
        }
        self.catch_up(tx, reported, Some(resend_after)).await
    }

    /// Every node's stored generation: what the in-memory [`crate::InStep`]
    /// index starts from.
    pub async fn generations(&self, pool: &PgPool) -> Result<Vec<(String, i64)>, SectionError> {
        let sql = format!("SELECT node, generation FROM {}.sections", self.schema);
        Ok(sqlx::query_as(AssertSqlSafe(sql)).fetch_all(pool).await?)
    }

    /// The section stored for `node`, if any.
    pub async fn stored(
        &self,
        pool: &PgPool,
        node: &NodeId,
    ) -> Result<Option<Stored>, SectionError> {
        let sql = format!(
            "SELECT generation, digest, items, declared_at, last_sent_at FROM {}.sections WHERE node = $1",
            self.schema
        );
        type Row = (
            i64,
            String,
            Json<DeclarationItems>,
            DateTime<Utc>,
            DateTime<Utc>,
        );
        let row: Option<Row> = sqlx::query_as(AssertSqlSafe(sql))
            .bind(node.as_str())
            .fetch_optional(pool)
            .await?;
        Ok(row.map(
            |(generation, digest, items, declared_at, last_sent_at)| Stored {
                generation,
                digest,
                items: items.0,
                declared_at,
                last_sent_at,
            },
        ))
    }
}

/// A context that declares a section. The controller resyncs every one of
/// them periodically ([`resync`]); a context's own writes call
/// [`Sections::declare`] with what they changed.
pub trait SectionOwner: Context {
    /// Its section table and section.
    const SECTIONS: Sections;

    /// The context's error; the component's errors convert into it.
    type Error: From<SectionError> + From<sqlx::Error> + std::fmt::Display + Send;

    /// The signal that wakes the outbox relay after a commit that declared.
    fn outbox_signal(&self) -> &OutboxSignal;

    /// The desired items of every node the context knows of, computed inside
    /// `tx`, after taking whatever lock serializes the context's declares.
    fn desired(
        &self,
        tx: &mut PgConnection,
    ) -> impl Future<Output = Result<Vec<(NodeId, Items)>, Self::Error>> + Send;
}

/// Recompute every node's section of `owner` and declare what differs from
/// what is stored, in one transaction; wake the relay if anything was declared.
/// Level-triggered: it repairs a row changed or lost behind the component's
/// back, or a change whose trigger was missed.
pub async fn resync<C: SectionOwner>(owner: &C) -> Result<Declared, C::Error> {
    let mut tx = owner.pool().begin().await?;
    let desired = owner.desired(&mut tx).await?;
    let report = C::SECTIONS.declare(&mut tx, desired).await?;
    tx.commit().await?;
    if report.declared > 0 {
        owner.outbox_signal().notify();
    }
    Ok(report)
}
