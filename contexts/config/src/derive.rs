//! What the modules on a node derive into its config section: each settings
//! file a module declares, rendered from the module's effective settings on
//! that node (`/modules/<module>/<name>`, mode 0644), and each secret granted
//! to the module, sealed to the node's own key
//! (`/modules/<module>/secrets/<file>`, mode 0600).
//!
//! Sealing is randomized, so the sealed form of each secret file is kept in
//! `config.sealed` and reused while the secret's version, the node's key and
//! the path stay the same: a node's section (and its digest) changes only
//! when what it would open changes. A secret that cannot be opened now (its
//! master key missing) keeps the sealed form the node already has; a node
//! that has stated no key yet gets no secret until it does (logged).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use mesh_protocol::sealing::{self, SealPublicKey};
use mesh_protocol::{FileItem, FileMode, Labels, SealedFileItem, SettingsFile};
use sqlx::PgConnection;
use sqlx::types::Json;

use crate::secrets::{self, Keyring, grant_path};
use crate::settings::{self, Layer};
use crate::{Error, layers, module_dir};

/// Mode of a rendered settings file.
const SETTINGS_MODE: u32 = 0o644;
/// Mode of a secret's file.
const SECRET_MODE: u32 = 0o600;

/// What a node's modules add to its config section.
#[derive(Debug, Default)]
pub(crate) struct Derived {
    pub files: Vec<FileItem>,
    pub secrets: Vec<SealedFileItem>,
}

impl Derived {
    /// Whether a derived file takes `path` (an operator file there yields).
    pub fn claims(&self, path: &str) -> bool {
        self.files.iter().any(|f| f.path == path) || self.secrets.iter().any(|s| s.path == path)
    }
}

struct Grant {
    module: String,
    secret: String,
    file: String,
    version: i64,
}

struct Cached {
    secret: String,
    version: i64,
    seal_key: String,
    sealed: String,
}

/// The derived items of every node of `nodes` (id, labels) that runs a
/// module; `only` is the reconcile's scope (`None`: every node).
pub(crate) async fn derive(
    tx: &mut PgConnection,
    nodes: &[(String, Json<Labels>)],
    only: Option<&[&str]>,
    keyring: &Keyring,
) -> Result<HashMap<String, Derived>, Error> {
    let mut out: HashMap<String, Derived> = HashMap::new();
    let modules: Vec<(String, Vec<String>, Json<Vec<SettingsFile>>)> = sqlx::query_as(
        "SELECT module, nodes, settings_files FROM config.modules \
         WHERE NOT removed AND cardinality(nodes) > 0 AND ($1::text[] IS NULL OR nodes && $1) \
         ORDER BY module",
    )
    .bind(only)
    .fetch_all(&mut *tx)
    .await?;
    if modules.is_empty() {
        return Ok(out);
    }
    let layers: Vec<Layer> = if modules.iter().any(|m| !m.2.0.is_empty()) {
        layers::all(tx).await?
    } else {
        Vec::new()
    };
    let names: Vec<&str> = modules.iter().map(|m| m.0.as_str()).collect();
    let grants: Vec<Grant> = sqlx::query_as::<_, (String, String, String, i64)>(
        "SELECT g.module, g.secret, g.file, s.version FROM config.grants g \
         JOIN config.secrets s ON s.name = g.secret WHERE g.module = ANY($1) \
         ORDER BY g.module, g.secret",
    )
    .bind(&names)
    .fetch_all(&mut *tx)
    .await?
    .into_iter()
    .map(|(module, secret, file, version)| Grant {
        module,
        secret,
        file,
        version,
    })
    .collect();
    let mut by_module: BTreeMap<&str, Vec<&Grant>> = BTreeMap::new();
    for g in &grants {
        by_module.entry(g.module.as_str()).or_default().push(g);
    }

    let (keys, cached) = if grants.is_empty() {
        (HashMap::new(), HashMap::new())
    } else {
        let keys: HashMap<String, String> = sqlx::query_as::<_, (String, String)>(
            "SELECT node, seal_key FROM config.node_keys WHERE $1::text[] IS NULL OR node = ANY($1)",
        )
        .bind(only)
        .fetch_all(&mut *tx)
        .await?
        .into_iter()
        .collect();
        let cached: HashMap<(String, String), Cached> =
            sqlx::query_as::<_, (String, String, String, i64, String, String)>(
                "SELECT node, path, secret, version, seal_key, sealed FROM config.sealed \
                 WHERE $1::text[] IS NULL OR node = ANY($1)",
            )
            .bind(only)
            .fetch_all(&mut *tx)
            .await?
            .into_iter()
            .map(|(node, path, secret, version, seal_key, sealed)| {
                (
                    (node, path),
                    Cached {
                        secret,
                        version,
                        seal_key,
                        sealed,
                    },
                )
            })
            .collect();
        (keys, cached)
    };

    // Which modules each node runs.
    let mut on_node: HashMap<&str, Vec<usize>> = HashMap::new();
    for (i, m) in modules.iter().enumerate() {
        for n in &m.1 {
            on_node.entry(n.as_str()).or_default().push(i);
        }
    }

    // Pass 1: settings files, and which sealed files are current or missing.
    struct Want<'a> {
        node: &'a str,
        path: String,
        grant: &'a Grant,
        key: &'a str,
    }
    let mut wants: Vec<Want> = Vec::new();
    for (node, labels) in nodes {
        let Some(mods) = on_node.get(node.as_str()) else {
            continue;
        };
        let mut d = Derived::default();
        for &i in mods {
            let (module, _, files) = &modules[i];
            if !files.0.is_empty() {
                let eff = settings::effective(&layers, module, node, &labels.0);
                for f in &files.0 {
                    d.files.push(FileItem {
                        path: format!("{}/{}", module_dir(module), f.name),
                        content: settings::render(f.format, &eff),
                        mode: file_mode(SETTINGS_MODE)?,
                    });
                }
            }
            for g in by_module.get(module.as_str()).into_iter().flatten() {
                match keys.get(node.as_str()) {
                    Some(key) => wants.push(Want {
                        node,
                        path: grant_path(module, &g.file),
                        grant: g,
                        key,
                    }),
                    None => tracing::warn!(
                        node = %node, module = %module, secret = %g.secret,
                        "the node has stated no seal key: its secret waits for a hello that does"
                    ),
                }
            }
        }
        out.insert(node.clone(), d);
    }

    // Pass 2: open (once each) the secrets some node lacks the current seal of.
    let is_current: Vec<bool> = wants
        .iter()
        .map(|w| {
            cached
                .get(&(w.node.to_owned(), w.path.clone()))
                .is_some_and(|c| {
                    c.secret == w.grant.secret
                        && c.version == w.grant.version
                        && c.seal_key == w.key
                })
        })
        .collect();
    let needed: BTreeSet<String> = wants
        .iter()
        .zip(&is_current)
        .filter(|(_, current)| !**current)
        .map(|(w, _)| w.grant.secret.clone())
        .collect();
    let needed: Vec<String> = needed.into_iter().collect();
    let values: HashMap<String, (i64, Result<Vec<u8>, String>)> =
        secrets::values(tx, keyring, &needed)
            .await?
            .into_iter()
            .map(|(name, version, value)| (name, (version, value)))
            .collect();

    // Pass 3: the sealed items, sealing what is not current.
    // New sealed forms, keyed by (node, path) like the cache.
    let mut fresh: Vec<((String, String), Cached)> = Vec::new();
    let mut kept: Vec<(String, String)> = Vec::new();
    for (w, current) in wants.iter().zip(is_current) {
        let node_key = (w.node.to_owned(), w.path.clone());
        let have = cached.get(&node_key);
        let sealed_now = if current {
            have.map(|c| (c.version, c.sealed.clone()))
        } else {
            match values.get(&w.grant.secret) {
                Some((version, Ok(value))) if *version == w.grant.version => {
                    match seal_to(w.key, w.node, &w.path, value) {
                        Ok(sealed) => {
                            fresh.push((
                                node_key.clone(),
                                Cached {
                                    secret: w.grant.secret.clone(),
                                    version: *version,
                                    seal_key: w.key.to_owned(),
                                    sealed: sealed.clone(),
                                },
                            ));
                            Some((*version, sealed))
                        }
                        Err(reason) => {
                            tracing::warn!(node = %w.node, secret = %w.grant.secret, %reason, "cannot seal the secret to the node");
                            None
                        }
                    }
                }
                other => {
                    let reason = match other {
                        Some((_, Err(reason))) => reason.clone(),
                        _ => "the secret changed during the reconcile".to_owned(),
                    };
                    tracing::error!(secret = %w.grant.secret, %reason, "cannot open the secret: nodes keep what they have");
                    // Fail safe: the node keeps the sealed form it was sent
                    // for this key and path.
                    have.filter(|c| c.seal_key == w.key && c.secret == w.grant.secret)
                        .map(|c| (c.version, c.sealed.clone()))
                }
            }
        };
        let Some((version, sealed)) = sealed_now else {
            continue;
        };
        kept.push(node_key);
        if let Some(d) = out.get_mut(w.node) {
            d.secrets.push(SealedFileItem {
                path: w.path.clone(),
                mode: file_mode(SECRET_MODE)?,
                secret: w.grant.secret.clone(),
                version,
                sealed,
            });
        }
    }
    store_sealed(tx, only, &fresh, &kept).await?;
    Ok(out)
}

fn file_mode(bits: u32) -> Result<FileMode, Error> {
    FileMode::new(bits).map_err(Error::from)
}

/// `value` sealed to the node's key for `path` (the AAD binds both).
fn seal_to(key_hex: &str, node: &str, path: &str, value: &[u8]) -> Result<String, String> {
    let key = SealPublicKey::from_hex(key_hex).map_err(|e| e.to_string())?;
    sealing::seal(
        &key,
        &sealing::secret_aad(node, path),
        value,
        rand::random(),
    )
    .map_err(|e| e.to_string())
}

/// Keep the sealed forms sent now, drop those of the scope's nodes no longer
/// sent (a revoked grant, a module gone from the node).
async fn store_sealed(
    tx: &mut PgConnection,
    only: Option<&[&str]>,
    fresh: &[((String, String), Cached)],
    kept: &[(String, String)],
) -> Result<(), Error> {
    let (kn, kp): (Vec<&str>, Vec<&str>) =
        kept.iter().map(|(n, p)| (n.as_str(), p.as_str())).unzip();
    sqlx::query(
        "DELETE FROM config.sealed s WHERE ($1::text[] IS NULL OR s.node = ANY($1)) \
         AND NOT EXISTS (SELECT 1 FROM UNNEST($2::text[], $3::text[]) AS k(node, path) \
                         WHERE k.node = s.node AND k.path = s.path)",
    )
    .bind(only)
    .bind(&kn)
    .bind(&kp)
    .execute(&mut *tx)
    .await?;
    if fresh.is_empty() {
        return Ok(());
    }
    let text =
        |f: fn(&((String, String), Cached)) -> &str| -> Vec<&str> { fresh.iter().map(f).collect() };
    let versions: Vec<i64> = fresh.iter().map(|(_, c)| c.version).collect();
    sqlx::query(
        "INSERT INTO config.sealed (node, path, secret, version, seal_key, sealed) \
         SELECT * FROM UNNEST($1::text[], $2::text[], $3::text[], $4::bigint[], $5::text[], $6::text[]) \
         ON CONFLICT (node, path) DO UPDATE SET secret = excluded.secret, version = excluded.version, \
         seal_key = excluded.seal_key, sealed = excluded.sealed",
    )
    .bind(text(|((node, _), _)| node))
    .bind(text(|((_, path), _)| path))
    .bind(text(|(_, c)| &c.secret))
    .bind(&versions)
    .bind(text(|(_, c)| &c.seal_key))
    .bind(text(|(_, c)| &c.sealed))
    .execute(&mut *tx)
    .await?;
    Ok(())
}
