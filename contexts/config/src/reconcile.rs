//! Desired config sections from files and node labels, compared with what was
//! declared; changed sections are written and declared in bulk.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use mesh_plumbing::outbox;
use mesh_protocol::{
    Declaration, DeclarationItems, FileItem, FileMode, Labels, MAX_DECLARATION_BYTES, MAX_ITEMS,
    NodeId, Section, digest_items,
};
use serde::Serialize;
use sqlx::PgConnection;
use sqlx::types::Json;

use crate::{Error, SCHEMA};

/// Advisory lock class of reconciles (key 0: the whole fleet) and of one node's
/// reconcile (key: hashtext(node)). Two-int keys, "mesh" / "mesi" in ASCII.
const LOCK_FLEET: i32 = 0x6d65_7368;
const LOCK_NODE: i32 = 0x6d65_7369;

/// Rows written per statement.
const CHUNK: usize = 500;

/// Room left in a declaration for the envelope around the items.
const ENVELOPE_OVERHEAD: usize = 1024;

pub(crate) enum Scope<'a> {
    All,
    Node(&'a NodeId),
}

/// What a reconcile did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ReconcileReport {
    /// Nodes whose desired section was computed.
    pub nodes: usize,
    /// Nodes a new generation was declared to.
    pub declared: usize,
    /// Nodes whose new section exceeds what an agent accepts, with the reason.
    pub too_large: Vec<(String, String)>,
}

#[derive(sqlx::FromRow)]
pub(crate) struct FileRow {
    pub name: String,
    pub path: String,
    pub content: String,
    pub mode: i32,
    pub node: Option<String>,
    pub selector: Option<Json<Labels>>,
}

/// Whether `selector` matches `labels`: every pair is present ({} matches all).
pub(crate) fn matches(selector: &Labels, labels: &Labels) -> bool {
    selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// The files of one node, by path, given the files in name order.
/// Node-targeted files first, then selector files; the first to claim a path
/// keeps it, so the smallest name of the stronger kind wins.
fn choose(node: &str, labels: &Labels, files: &[FileRow]) -> Vec<usize> {
    let mut by_path: BTreeMap<&str, usize> = BTreeMap::new();
    for (i, f) in files.iter().enumerate() {
        if f.node.as_deref() == Some(node) {
            by_path.entry(f.path.as_str()).or_insert(i);
        }
    }
    for (i, f) in files.iter().enumerate() {
        if let Some(selector) = &f.selector
            && matches(&selector.0, labels)
        {
            by_path.entry(f.path.as_str()).or_insert(i);
        }
    }
    let mut chosen: Vec<usize> = by_path.into_values().collect();
    chosen.sort_unstable();
    chosen
}

/// A desired section, shared by every node with the same matching files.
struct Desired {
    items: Arc<DeclarationItems>,
    items_json: Arc<str>,
    digest: Arc<str>,
    too_large: Option<String>,
}

fn build(files: &[FileRow], chosen: &[usize]) -> Result<Desired, Error> {
    let mut items = DeclarationItems::default();
    for &i in chosen {
        let f = &files[i];
        let mode = u32::try_from(f.mode)
            .ok()
            .and_then(|m| FileMode::new(m).ok())
            .ok_or_else(|| Error::Corrupt {
                what: format!("mode of file `{}`", f.name),
                reason: f.mode.to_string(),
            })?;
        items.files.push(FileItem {
            path: f.path.clone(),
            content: f.content.clone(),
            mode,
        });
    }
    items.files.sort_by(|a, b| a.path.cmp(&b.path));
    let items_json = serde_json::to_string(&items).map_err(|e| Error::Corrupt {
        what: "declaration items".to_owned(),
        reason: e.to_string(),
    })?;
    let too_large = if items.files.len() > MAX_ITEMS {
        Some(format!("{} files, limit {MAX_ITEMS}", items.files.len()))
    } else if items_json.len() + ENVELOPE_OVERHEAD > MAX_DECLARATION_BYTES {
        Some(format!(
            "{} bytes, limit {MAX_DECLARATION_BYTES}",
            items_json.len() + ENVELOPE_OVERHEAD
        ))
    } else {
        None
    };
    let digest = digest_items(&items);
    Ok(Desired {
        items: Arc::new(items),
        items_json: items_json.into(),
        digest: digest.into(),
        too_large,
    })
}

/// A section to write and declare.
struct Change {
    node: NodeId,
    generation: i64,
    desired: Arc<Desired>,
}

/// Reconcile the nodes of `scope` inside `tx`: compute each node's files, and
/// where the digest differs from the declared one (or nothing was declared and
/// there are files) store generation + 1 and queue the declaration. A node whose
/// files all went away gets a generation with no files, so its agent removes them.
pub(crate) async fn reconcile(
    tx: &mut PgConnection,
    scope: Scope<'_>,
) -> Result<ReconcileReport, Error> {
    match scope {
        Scope::All => {
            sqlx::query("SELECT pg_advisory_xact_lock($1, 0)")
                .bind(LOCK_FLEET)
                .execute(&mut *tx)
                .await?;
        }
        Scope::Node(node) => {
            sqlx::query("SELECT pg_advisory_xact_lock_shared($1, 0), pg_advisory_xact_lock($2, hashtext($3))")
                .bind(LOCK_FLEET)
                .bind(LOCK_NODE)
                .bind(node.as_str())
                .execute(&mut *tx)
                .await?;
        }
    }
    let only: Option<&str> = match scope {
        Scope::All => None,
        Scope::Node(n) => Some(n.as_str()),
    };
    let files: Vec<FileRow> = sqlx::query_as(
        "SELECT name, path, content, mode, node, selector FROM config.files \
         WHERE $1::text IS NULL OR node = $1 OR selector IS NOT NULL ORDER BY name",
    )
    .bind(only)
    .fetch_all(&mut *tx)
    .await?;
    type NodeRow = (String, Json<Labels>, Option<i64>, Option<String>);
    let nodes: Vec<NodeRow> = sqlx::query_as(
        "SELECT n.node, n.labels, s.generation, s.digest FROM config.nodes n \
         LEFT JOIN config.sections s ON s.node = n.node WHERE $1::text IS NULL OR n.node = $1 ORDER BY n.node",
    )
    .bind(only)
    .fetch_all(&mut *tx)
    .await?;

    let mut report = ReconcileReport {
        nodes: nodes.len(),
        ..ReconcileReport::default()
    };
    let mut cache: HashMap<Vec<usize>, Arc<Desired>> = HashMap::new();
    let mut changes = Vec::new();
    for (node, labels, generation, digest) in nodes {
        let chosen = choose(&node, &labels.0, &files);
        let desired = match cache.get(&chosen) {
            Some(d) => d.clone(),
            None => {
                let d = Arc::new(build(&files, &chosen)?);
                cache.insert(chosen.clone(), d.clone());
                d
            }
        };
        let unchanged = match &digest {
            Some(stored) => **stored == *desired.digest,
            None => chosen.is_empty(),
        };
        if unchanged {
            continue;
        }
        let node_id = NodeId::parse(&node).map_err(|e| Error::Corrupt {
            what: "node id".to_owned(),
            reason: e.to_string(),
        })?;
        if let Some(reason) = &desired.too_large {
            report.too_large.push((node.clone(), reason.clone()));
        }
        changes.push(Change {
            node: node_id,
            generation: generation.unwrap_or(0) + 1,
            desired,
        });
        if changes.len() >= CHUNK {
            report.declared += flush(tx, std::mem::take(&mut changes)).await?;
        }
    }
    report.declared += flush(tx, changes).await?;
    Ok(report)
}

/// Store and declare a chunk of changed sections: one upsert, one outbox insert.
async fn flush(tx: &mut PgConnection, changes: Vec<Change>) -> Result<usize, Error> {
    if changes.is_empty() {
        return Ok(0);
    }
    let n = changes.len();
    let mut nodes = Vec::with_capacity(n);
    let mut generations = Vec::with_capacity(n);
    let mut digests = Vec::with_capacity(n);
    let mut items = Vec::with_capacity(n);
    for c in &changes {
        nodes.push(c.node.as_str());
        generations.push(c.generation);
        digests.push(&*c.desired.digest);
        items.push(&*c.desired.items_json);
    }
    sqlx::query(
        "INSERT INTO config.sections AS s (node, generation, digest, items, declared_at, last_sent_at) \
         SELECT u.node, u.generation, u.digest, u.items::jsonb, now(), now() \
         FROM UNNEST($1::text[], $2::bigint[], $3::text[], $4::text[]) AS u(node, generation, digest, items) \
         ON CONFLICT (node) DO UPDATE SET generation = excluded.generation, digest = excluded.digest, \
         items = excluded.items, declared_at = now(), last_sent_at = now()",
    )
    .bind(&nodes)
    .bind(&generations)
    .bind(&digests)
    .bind(&items)
    .execute(&mut *tx)
    .await?;
    let declarations = changes
        .iter()
        .map(|c| {
            let generation = u64::try_from(c.generation).unwrap_or(0);
            let declaration = Declaration {
                section: Section::Config,
                generation,
                items: (*c.desired.items).clone(),
            };
            (c.node.clone(), declaration)
        })
        .collect();
    outbox::declare_many(tx, SCHEMA, declarations).await?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(
        name: &str,
        path: &str,
        node: Option<&str>,
        selector: Option<&[(&str, &str)]>,
    ) -> FileRow {
        FileRow {
            name: name.to_owned(),
            path: path.to_owned(),
            content: name.to_owned(),
            mode: 0o644,
            node: node.map(str::to_owned),
            selector: selector.map(|s| {
                Json(
                    s.iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                )
            }),
        }
    }

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn selectors_match_subsets() {
        assert!(matches(&labels(&[]), &labels(&[])));
        assert!(matches(
            &labels(&[("role", "web")]),
            &labels(&[("role", "web"), ("zone", "a")])
        ));
        assert!(!matches(
            &labels(&[("role", "web")]),
            &labels(&[("role", "db")])
        ));
        assert!(!matches(&labels(&[("role", "web")]), &labels(&[])));
    }

    #[test]
    fn precedence_node_then_smallest_name() {
        // Files arrive in name order, as the query sorts them.
        let files = vec![
            file("a-sel", "/etc/x", None, Some(&[])),
            file("b-sel", "/etc/y", None, Some(&[("role", "web")])),
            file("c-node", "/etc/x", Some("n1"), None),
            file("d-node", "/etc/x", Some("n1"), None),
            file("e-sel", "/etc/y", None, Some(&[])),
            file("f-other", "/etc/z", Some("n2"), None),
        ];
        let web = labels(&[("role", "web")]);
        assert_eq!(choose("n1", &web, &files), vec![1, 2]);
        assert_eq!(choose("n1", &labels(&[]), &files), vec![2, 4]);
        assert_eq!(choose("n3", &labels(&[]), &files), vec![0, 4]);
        assert_eq!(choose("n2", &labels(&[]), &files), vec![0, 4, 5]);
    }
}
