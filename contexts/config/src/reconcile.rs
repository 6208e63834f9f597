//! Desired config sections from files and node labels; the section component
//! (`mesh_plumbing::section`) compares them with what was declared and declares
//! what changed, in bulk.

use std::collections::{BTreeMap, HashMap};

use mesh_plumbing::section::{Declared, Items};
use mesh_protocol::{DeclarationItems, FileItem, FileMode, Labels, NodeId, SealedFileItem};
use sqlx::PgConnection;
use sqlx::types::Json;

use crate::derive::{self, Derived};
use crate::secrets::Keyring;
use crate::{Error, SECTIONS};

/// Advisory lock class of reconciles (key 0: the whole fleet) and of one node's
/// reconcile (key: hashtext(node)). Two-int keys, "mesh" / "mesi" in ASCII.
const LOCK_FLEET: i32 = 0x6d65_7368;
const LOCK_NODE: i32 = 0x6d65_7369;

pub(crate) enum Scope<'a> {
    All,
    /// These nodes only (the node events of a batch): the shared fleet lock,
    /// then each node's lock in a fixed order.
    Nodes(&'a [NodeId]),
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

/// The operator files of the chosen ones (shared by every node with the same
/// ones), less those whose path a module's derived file takes.
fn build(files: &[FileRow], chosen: &[usize], derived: Option<&Derived>) -> Result<Items, Error> {
    let mut items = DeclarationItems::default();
    for &i in chosen {
        let f = &files[i];
        if derived.is_some_and(|d| d.claims(&f.path)) {
            continue;
        }
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
    if let Some(d) = derived {
        items.files.extend(d.files.iter().cloned());
        items.secrets.extend(d.secrets.iter().cloned());
        items
            .secrets
            .sort_by(|a: &SealedFileItem, b| a.path.cmp(&b.path));
    }
    Ok(Items::new(items)?)
}

/// The desired config section of every node of `scope`, inside `tx`, after
/// taking the reconcile locks (a whole-fleet reconcile exclusively, a reconcile
/// of some nodes shared plus each node's own).
pub(crate) async fn desired(
    tx: &mut PgConnection,
    scope: Scope<'_>,
    keyring: &Keyring,
) -> Result<Vec<(NodeId, Items)>, Error> {
    match scope {
        Scope::All => {
            sqlx::query("SELECT pg_advisory_xact_lock($1, 0)")
                .bind(LOCK_FLEET)
                .execute(&mut *tx)
                .await?;
        }
        Scope::Nodes(nodes) => {
            // Node locks in ascending key order (distinct keys), so that two
            // reconciles of overlapping nodes cannot deadlock.
            let nodes: Vec<&str> = nodes.iter().map(NodeId::as_str).collect();
            sqlx::query("SELECT pg_advisory_xact_lock_shared($1, 0)")
                .bind(LOCK_FLEET)
                .execute(&mut *tx)
                .await?;
            sqlx::query(
                "SELECT pg_advisory_xact_lock($1, k.key) FROM \
                 (SELECT DISTINCT hashtext(n) AS key FROM UNNEST($2::text[]) AS n ORDER BY 1) AS k",
            )
            .bind(LOCK_NODE)
            .bind(&nodes)
            .execute(&mut *tx)
            .await?;
        }
    }
    // None: every node.
    let only: Option<Vec<&str>> = match scope {
        Scope::All => None,
        Scope::Nodes(nodes) => Some(nodes.iter().map(NodeId::as_str).collect()),
    };
    let files: Vec<FileRow> = sqlx::query_as(
        "SELECT name, path, content, mode, node, selector FROM config.files \
         WHERE $1::text[] IS NULL OR node = ANY($1) OR selector IS NOT NULL ORDER BY name",
    )
    .bind(&only)
    .fetch_all(&mut *tx)
    .await?;
    let nodes: Vec<(String, Json<Labels>)> = sqlx::query_as(
        "SELECT node, labels FROM config.nodes WHERE $1::text[] IS NULL OR node = ANY($1) ORDER BY node",
    )
    .bind(&only)
    .fetch_all(&mut *tx)
    .await?;

    // What the modules on these nodes derive: settings files and sealed secrets.
    let mut derived = derive::derive(tx, &nodes, only.as_deref(), keyring).await?;

    let mut cache: HashMap<Vec<usize>, Items> = HashMap::new();
    let mut desired = Vec::with_capacity(nodes.len());
    for (node, labels) in nodes {
        let chosen = choose(&node, &labels.0, &files);
        let items = match derived.remove(&node) {
            Some(d) => build(&files, &chosen, Some(&d))?,
            None => match cache.get(&chosen) {
                Some(items) => items.clone(),
                None => {
                    let items = build(&files, &chosen, None)?;
                    cache.insert(chosen, items.clone());
                    items
                }
            },
        };
        let node = NodeId::parse(&node).map_err(|e| Error::Corrupt {
            what: "node id".to_owned(),
            reason: e.to_string(),
        })?;
        desired.push((node, items));
    }
    Ok(desired)
}

/// Reconcile the nodes of `scope` inside `tx`: compute each node's files and
/// declare a new generation where they changed (the section component).
pub(crate) async fn reconcile(
    tx: &mut PgConnection,
    scope: Scope<'_>,
    keyring: &Keyring,
) -> Result<Declared, Error> {
    let desired = desired(tx, scope, keyring).await?;
    Ok(SECTIONS.declare(tx, desired).await?)
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
