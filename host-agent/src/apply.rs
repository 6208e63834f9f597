//! Applying a declaration to disk: the one place the agent changes the host.
//!
//! Level-triggered and idempotent: a declaration is a whole section, so applying
//! it means "make these files exist with this content and mode, and remove the
//! files this section declared before and no longer does". Everything is checked
//! before anything is written; each file is written atomically; nothing is ever
//! written outside the root.
//!
//! Secrets (`items.secrets`) arrive sealed to this node's seal key, bound to the
//! node and the path; each is opened before anything is written, and one that
//! does not open refuses the whole declaration (naming the path, never a
//! value). Opened values are written like files, with their mode, and tracked
//! like files: a later generation without one removes it (how a revoked grant
//! takes a secret off the node). Opened bytes are held in a [`Secret`] (Debug:
//! `[redacted]`) and never logged. An agent older than secrets ignores the
//! field (unknown fields are ignored and counted) and writes none of them.

use std::collections::BTreeSet;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use chrono::Utc;
use mesh_protocol::sealing::{self, SealPublicKey, SealSecretKey};
use mesh_protocol::{
    Declaration, DecodeError, Envelope, ItemOutcome, MAX_DECLARATION_BYTES, NodeId, Outcome,
    SealedFileItem, Secret, Section, UnknownFields, digest_items, validate_path,
};

use crate::store::{SectionState, write_atomic_owned};
use crate::units::sandbox::{ModuleUser, ensure_user};

/// Decode a delivery's body: the agent's one parse point for declarations. The
/// envelope must be addressed to this node. Fields this agent does not know (a
/// newer controller's) are ignored and returned, to be counted; a section it
/// does not know is [`DecodeError::UnsupportedSection`].
pub fn decode(
    bytes: &[u8],
    node: &NodeId,
) -> Result<(Envelope<Declaration>, UnknownFields), DecodeError> {
    let (env, unknown) = Envelope::<Declaration>::decode_noting(bytes, MAX_DECLARATION_BYTES)?;
    if &env.node != node {
        return Err(DecodeError::Invalid {
            field: "node".into(),
            reason: format!("declaration is for `{}`, this node is `{node}`", env.node),
        });
    }
    Ok((env, unknown))
}

/// Best effort: the section and generation of a message that could not be
/// decoded, so that its rejection can still say what it was about.
pub fn peek_section(bytes: &[u8]) -> (Option<Section>, Option<u64>) {
    if bytes.len() > MAX_DECLARATION_BYTES {
        return (None, None);
    }
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(bytes) else {
        return (None, None);
    };
    let body = v.get("body");
    let section = body
        .and_then(|b| b.get("section"))
        .and_then(|s| s.as_str())
        .and_then(Section::parse);
    let generation = body
        .and_then(|b| b.get("generation"))
        .and_then(serde_json::Value::as_u64);
    (section, generation)
}

/// What came of handling one declaration.
#[derive(Debug, Clone, PartialEq)]
pub struct ApplyReport {
    pub section: Section,
    /// The generation the `applied` report names: the declared one, or for a stale
    /// declaration the one already applied.
    pub generation: u64,
    pub outcome: Outcome,
    pub items: Vec<ItemOutcome>,
    pub error: Option<String>,
    /// True if the declaration was not newer than what is applied: nothing was
    /// touched and the report restates the current generation.
    pub stale: bool,
    /// The section's state to record; `None` when nothing changed.
    pub state: Option<SectionState>,
}

/// Applies declarations under a root directory.
#[derive(Debug, Clone)]
pub struct Applier {
    root: PathBuf,
    /// `root`, canonicalized: symlinks found under the root must resolve inside it.
    canonical_root: PathBuf,
    /// Directories nothing may be written into (the agent's state directory).
    protected: Vec<PathBuf>,
    /// This node and its seal key, to open secrets with; none: every declared
    /// secret is refused.
    sealing: Option<(NodeId, SealSecretKey)>,
    /// Files under `/modules/<module>/` belong to the module's user (the
    /// sandbox, decision 0051): its secrets 0400, no other module's user
    /// reaches them.
    module_owners: bool,
}

/// Why one path cannot be applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct PathError(String);

impl Applier {
    /// `root` must exist. Paths under any of `protected` are refused.
    pub fn new(root: &Path, protected: &[PathBuf]) -> std::io::Result<Applier> {
        let canonical_root = root.canonicalize()?;
        let protected = protected
            .iter()
            .map(|p| p.canonicalize().unwrap_or_else(|_| p.clone()))
            .collect();
        Ok(Applier {
            root: root.to_owned(),
            canonical_root,
            protected,
            sealing: None,
            module_owners: false,
        })
    }

    /// Open declared secrets as `node` with `key` (secrets are sealed to
    /// `key`'s public key, bound to `node` and their path).
    pub fn with_seal_key(mut self, node: NodeId, key: SealSecretKey) -> Applier {
        self.sealing = Some((node, key));
        self
    }

    /// Give files under `/modules/<module>/` to the module's user (made if
    /// new): only an agent running as root can.
    pub fn with_module_owners(mut self, on: bool) -> Applier {
        self.module_owners = on;
        self
    }

    /// The module a declared path belongs to (`/modules/<module>/...`), if
    /// its files are given to the module's user.
    fn owning_module<'a>(&self, declared: &'a str) -> Option<&'a str> {
        if !self.module_owners {
            return None;
        }
        let rest = declared.strip_prefix("/modules/")?;
        let (module, tail) = rest.split_once('/')?;
        (!module.is_empty() && !tail.is_empty()).then_some(module)
    }

    /// Make `<root>/modules/<module>` `root:<module>` 0750 and the directories
    /// below it down to `target` the module user's (`secrets` 0500, others
    /// 0750), so that no other module's user gets in.
    fn own_dirs(&self, module: &str, target: &Path, user: &ModuleUser) -> std::io::Result<()> {
        use std::os::unix::fs::chown;
        let modules = self.root.join("modules");
        let top = modules.join(module);
        chown(&modules, Some(0), Some(0))?;
        std::fs::set_permissions(&modules, std::fs::Permissions::from_mode(0o755))?;
        chown(&top, Some(0), Some(user.gid))?;
        std::fs::set_permissions(&top, std::fs::Permissions::from_mode(0o750))?;
        let mut dir = target.parent();
        while let Some(d) = dir {
            if d == top || !d.starts_with(&top) {
                break;
            }
            chown(d, Some(user.uid), Some(user.gid))?;
            let mode = if d.file_name().is_some_and(|n| n == "secrets") {
                0o500
            } else {
                0o750
            };
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(mode))?;
            dir = d.parent();
        }
        Ok(())
    }

    /// Write one declared file or secret, owned by its module's user where
    /// it has one.
    fn write_item(
        &self,
        declared: &str,
        target: &Path,
        content: &[u8],
        mode: u32,
        secret: bool,
    ) -> std::io::Result<()> {
        let Some(module) = self.owning_module(declared) else {
            return write_file(target, content, mode, None);
        };
        let user = ensure_user(module)?;
        // A module's secret is for its user to read, and nobody else.
        let mode = if secret { 0o400 } else { mode };
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent)?;
        }
        self.own_dirs(module, target, &user)?;
        write_file(target, content, mode, Some((user.uid, user.gid)))
    }

    /// The public key secrets are sealed to, once [`Applier::with_seal_key`] gave one.
    pub fn seal_public_key(&self) -> Option<SealPublicKey> {
        self.sealing.as_ref().map(|(_, key)| key.public())
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Open one declared secret: its value, or why not (never the value).
    fn open_secret(&self, item: &SealedFileItem) -> Result<Secret<Vec<u8>>, String> {
        let Some((node, key)) = &self.sealing else {
            return Err("this agent has no seal key to open secrets with".into());
        };
        let aad = sealing::secret_aad(node.as_str(), &item.path);
        sealing::open(key, &aad, &item.sealed)
            .map(Secret::new)
            .map_err(|e| e.to_string())
    }

    /// Apply `decl` on top of `prev`, the section's recorded state: validate
    /// everything (paths, secrets) before touching the disk, write each file
    /// and secret atomically, then remove what the previous generation
    /// declared and this one does not.
    pub fn apply(&self, decl: &Declaration, prev: &SectionState) -> ApplyReport {
        let section = decl.section;
        if decl.generation <= prev.generation {
            return ApplyReport {
                section,
                generation: prev.generation,
                outcome: Outcome::Applied,
                items: Vec::new(),
                error: None,
                stale: true,
                state: None,
            };
        }
        let reject = |items, error| rejected(decl, prev, items, error);

        // 1. Validate everything before touching the disk.
        if let Err(e) = decl.validate() {
            return reject(Vec::new(), e.to_string());
        }
        if let Some(error) = misplaced(decl) {
            return reject(Vec::new(), error);
        }
        let (targets, opened) = match self.resolve_all(decl) {
            Ok(resolved) => resolved,
            Err((items, error)) => return reject(items, error),
        };

        // 2. Write each file and each opened secret atomically.
        let (mut items, written, failed) = self.write_all(decl, &targets, opened);
        let mut state = prev.clone();
        state.last_generation = decl.generation;
        state.updated_at = Some(Utc::now());
        if failed {
            // Keep what is there; the older generation's files stay in place.
            state.paths.extend(written);
            state.last_outcome = Some(Outcome::Failed);
            state.last_error = first_failure(&items);
            return ApplyReport {
                section,
                generation: decl.generation,
                outcome: Outcome::Failed,
                error: state.last_error.clone(),
                items,
                stale: false,
                state: Some(state),
            };
        }

        // 3. Remove what the previous generation declared and this one does not.
        let kept = self.remove_undeclared(prev, &written, &mut items);
        let failed = !kept.is_empty();
        state.paths = written.into_iter().chain(kept).collect();
        if failed {
            state.last_outcome = Some(Outcome::Failed);
            state.last_error = first_failure(&items);
        } else {
            applied(&mut state, decl, &mut items);
        }
        ApplyReport {
            section,
            generation: decl.generation,
            outcome: state.last_outcome.unwrap_or(Outcome::Failed),
            error: state.last_error.clone(),
            items,
            stale: false,
            state: Some(state),
        }
    }

    /// Where each declared file lands, and each secret opened (for this node
    /// and its path), before anything is written. Err: every item's outcome
    /// and the first error.
    #[allow(clippy::type_complexity)]
    fn resolve_all(
        &self,
        decl: &Declaration,
    ) -> Result<(Vec<PathBuf>, Vec<(PathBuf, Secret<Vec<u8>>)>), (Vec<ItemOutcome>, String)> {
        let mut targets = Vec::with_capacity(decl.items.files.len());
        let mut items = Vec::new();
        let mut first_error = None;
        for f in &decl.items.files {
            match self.resolve(&f.path) {
                Ok(t) => {
                    items.push(ItemOutcome {
                        item: f.path.clone(),
                        ok: true,
                        error: None,
                    });
                    targets.push(t);
                }
                Err(e) => {
                    first_error.get_or_insert_with(|| format!("{}: {e}", f.path));
                    items.push(ItemOutcome {
                        item: f.path.clone(),
                        ok: false,
                        error: Some(e.to_string()),
                    });
                }
            }
        }
        // Every secret opens, for this node and its path, before anything is written.
        let mut opened = Vec::with_capacity(decl.items.secrets.len());
        for item in &decl.items.secrets {
            let result = self
                .resolve(&item.path)
                .map_err(|e| e.to_string())
                .and_then(|t| self.open_secret(item).map(|value| (t, value)));
            match result {
                Ok(pair) => {
                    items.push(ItemOutcome {
                        item: item.path.clone(),
                        ok: true,
                        error: None,
                    });
                    opened.push(pair);
                }
                Err(e) => {
                    first_error.get_or_insert_with(|| format!("{}: {e}", item.path));
                    items.push(ItemOutcome {
                        item: item.path.clone(),
                        ok: false,
                        error: Some(e),
                    });
                }
            }
        }
        match first_error {
            Some(error) => Err((items, error)),
            None => Ok((targets, opened)),
        }
    }

    /// Write each file (to its target) and each opened secret atomically:
    /// every item's outcome, the paths written, and whether one failed. The
    /// opened secrets are dropped (wiped) once written.
    fn write_all(
        &self,
        decl: &Declaration,
        targets: &[PathBuf],
        opened: Vec<(PathBuf, Secret<Vec<u8>>)>,
    ) -> (Vec<ItemOutcome>, BTreeSet<String>, bool) {
        let writes = decl
            .items
            .files
            .iter()
            .zip(targets)
            .map(|(f, t)| (&f.path, t, f.content.as_bytes(), f.mode.bits(), false))
            .chain(
                decl.items
                    .secrets
                    .iter()
                    .zip(&opened)
                    .map(|(s, (t, value))| {
                        (&s.path, t, value.expose().as_slice(), s.mode.bits(), true)
                    }),
            );
        let mut items = Vec::with_capacity(decl.items.files.len() + opened.len());
        let mut written = BTreeSet::new();
        let mut failed = false;
        for (path, target, content, mode, secret) in writes {
            match self.write_item(path, target, content, mode, secret) {
                Ok(()) => {
                    written.insert(path.clone());
                    items.push(ItemOutcome {
                        item: path.clone(),
                        ok: true,
                        error: None,
                    });
                }
                Err(e) => {
                    failed = true;
                    items.push(ItemOutcome {
                        item: path.clone(),
                        ok: false,
                        error: Some(format!("write: {e}")),
                    });
                }
            }
        }
        drop(opened);
        (items, written, failed)
    }

    /// Remove the files `prev` has and this generation did not write; those
    /// that cannot be removed are kept (returned) and their items say why.
    fn remove_undeclared(
        &self,
        prev: &SectionState,
        written: &BTreeSet<String>,
        items: &mut Vec<ItemOutcome>,
    ) -> BTreeSet<String> {
        let mut kept = BTreeSet::new();
        for path in prev.paths.difference(written) {
            let result = self
                .resolve(path)
                .map_err(|e| e.to_string())
                .and_then(|t| remove_file(&t).map_err(|e| e.to_string()));
            if let Err(e) = result {
                kept.insert(path.clone());
                items.push(ItemOutcome {
                    item: path.clone(),
                    ok: false,
                    error: Some(format!("remove: {e}")),
                });
            }
        }
        kept
    }

    /// Where a declared path lands, after checking that it stays under the root:
    /// the path is absolute and normalized, no existing component under the root
    /// is a symlink resolving outside it or a non-directory, the file itself is not
    /// a directory, and it is not inside a protected directory.
    pub fn resolve(&self, declared: &str) -> Result<PathBuf, PathError> {
        let parts = validate_path("path", declared).map_err(|e| PathError(e.to_string()))?;
        let mut cur = self.root.clone();
        let last = parts.len() - 1;
        let mut parent_exists = true;
        for (i, part) in parts.iter().enumerate() {
            cur.push(part);
            if !parent_exists {
                continue;
            }
            match std::fs::symlink_metadata(&cur) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => parent_exists = false,
                Err(e) => return Err(PathError(format!("{}: {e}", cur.display()))),
                Ok(m) if i == last => {
                    if m.is_dir() {
                        return Err(PathError(format!("{} is a directory", cur.display())));
                    }
                }
                Ok(m) if m.file_type().is_symlink() => {
                    let resolved = cur.canonicalize().map_err(|e| {
                        PathError(format!(
                            "{}: symlink cannot be resolved: {e}",
                            cur.display()
                        ))
                    })?;
                    if !resolved.starts_with(&self.canonical_root) {
                        return Err(PathError(format!(
                            "{} is a symlink leading outside the root",
                            cur.display()
                        )));
                    }
                    if !resolved.is_dir() {
                        return Err(PathError(format!("{} is not a directory", cur.display())));
                    }
                }
                Ok(m) if m.is_dir() => {}
                Ok(_) => return Err(PathError(format!("{} is not a directory", cur.display()))),
            }
        }
        // The deepest existing ancestor, resolved, must not be a protected directory.
        let mut probe = cur.parent().map(Path::to_path_buf);
        while let Some(p) = probe {
            if let Ok(c) = p.canonicalize() {
                let full = c.join(cur.strip_prefix(&p).unwrap_or(Path::new("")));
                if self.protected.iter().any(|d| full.starts_with(d)) {
                    return Err(PathError("inside the agent's state directory".into()));
                }
                break;
            }
            probe = p.parent().map(Path::to_path_buf);
        }
        Ok(cur)
    }
}

/// Write one file atomically, unless it already has this content, mode and
/// owner.
fn write_file(
    target: &Path,
    content: &[u8],
    mode: u32,
    owner: Option<(u32, u32)>,
) -> std::io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    if let Ok(m) = std::fs::symlink_metadata(target)
        && m.is_file()
        && m.len() == content.len() as u64
        && m.permissions().mode() & 0o7777 == mode
        && owner.is_none_or(|(u, g)| m.uid() == u && m.gid() == g)
    {
        let mut existing = Vec::with_capacity(content.len());
        std::fs::File::open(target)?.read_to_end(&mut existing)?;
        if existing == content {
            return Ok(());
        }
    }
    if let Some(parent) = target.parent() {
        std::fs::create_dir_all(parent)?;
    }
    write_atomic_owned(target, content, mode, owner)
}

/// Remove one file (already gone is fine) and make the removal durable.
fn remove_file(target: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(target) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    }
    if let Some(parent) = target.parent() {
        std::fs::File::open(parent)?.sync_all()?;
    }
    Ok(())
}

/// The report of a declaration that cannot be applied: nothing of it was
/// written, and the state keeps what was applied before.
fn rejected(
    decl: &Declaration,
    prev: &SectionState,
    items: Vec<ItemOutcome>,
    error: String,
) -> ApplyReport {
    let mut state = prev.clone();
    state.last_generation = decl.generation;
    state.last_outcome = Some(Outcome::Rejected);
    state.last_error = Some(error.clone());
    state.updated_at = Some(Utc::now());
    ApplyReport {
        section: decl.section,
        generation: decl.generation,
        outcome: Outcome::Rejected,
        items,
        error: Some(error),
        stale: false,
        state: Some(state),
    }
}

/// `state` after `decl` was applied completely: its generation, digest,
/// units and resources; its units join the items.
fn applied(state: &mut SectionState, decl: &Declaration, items: &mut Vec<ItemOutcome>) {
    state.generation = decl.generation;
    state.digest = digest_items(&decl.items);
    state.last_outcome = Some(Outcome::Applied);
    state.last_error = None;
    // Units are handed to the supervisor once recorded (the agent does it):
    // an applied unit is a declared one; how it runs is the units report's.
    state.units = decl.items.units.clone();
    // Likewise resources go to the provisioning worker once recorded;
    // what came of them is the `resources` report's.
    state.resources = decl.items.resources.clone();
    items.extend(decl.items.units.iter().map(|u| ItemOutcome {
        item: u.name.clone(),
        ok: true,
        error: None,
    }));
}

/// Why a declaration carries an item its section may not declare (units
/// outside inventory, resources outside provisioning, artifacts and their
/// keys outside delivery), if it does.
fn misplaced(decl: &Declaration) -> Option<String> {
    let section = decl.section;
    let items = &decl.items;
    let (field, what, home) = if section != Section::Inventory && !items.units.is_empty() {
        ("units", "units", Section::Inventory)
    } else if section != Section::Provisioning && !items.resources.is_empty() {
        ("resources", "resources", Section::Provisioning)
    } else if section != Section::Delivery && items.artifact_keys.is_some() {
        ("artifact_keys", "trusted artifact keys", Section::Delivery)
    } else if section != Section::Delivery && !items.artifacts.is_empty() {
        ("artifacts", "artifacts", Section::Delivery)
    } else {
        return None;
    };
    Some(format!(
        "invalid field `body.items.{field}`: {what} are declared in the {home} section only, not in `{section}`"
    ))
}

/// The first failed item, as a state's `last_error`.
fn first_failure(items: &[ItemOutcome]) -> Option<String> {
    items
        .iter()
        .find(|i| !i.ok)
        .map(|i| format!("{}: {}", i.item, i.error.as_deref().unwrap_or("")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use mesh_protocol::{DeclarationItems, FileItem, FileMode, MAX_FILE_BYTES};

    fn file(path: &str, content: &str, mode: u32) -> FileItem {
        FileItem {
            path: path.into(),
            content: content.into(),
            mode: FileMode::new(mode).unwrap(),
        }
    }

    fn decl(generation: u64, files: Vec<FileItem>) -> Declaration {
        Declaration {
            section: Section::Config,
            generation,
            items: DeclarationItems {
                heartbeat: None,
                files,
                ..Default::default()
            },
        }
    }

    struct Fixture {
        _dir: tempfile::TempDir,
        root: PathBuf,
        applier: Applier,
    }

    fn fixture() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        let state = dir.path().join("root/var/lib/mesh-agent");
        std::fs::create_dir_all(&state).unwrap();
        let applier = Applier::new(&root, std::slice::from_ref(&state)).unwrap();
        Fixture {
            _dir: dir,
            root,
            applier,
        }
    }

    /// Every file under `dir`, relative, sorted.
    fn tree(dir: &Path) -> Vec<String> {
        fn walk(base: &Path, dir: &Path, out: &mut Vec<String>) {
            for e in std::fs::read_dir(dir).unwrap() {
                let e = e.unwrap();
                let p = e.path();
                if e.file_type().unwrap().is_dir() {
                    walk(base, &p, out);
                } else {
                    out.push(p.strip_prefix(base).unwrap().display().to_string());
                }
            }
        }
        let mut out = Vec::new();
        walk(dir, dir, &mut out);
        out.sort();
        out
    }

    fn mode_of(p: &Path) -> u32 {
        std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
    }

    #[test]
    fn writes_content_and_mode_atomically() {
        let fx = fixture();
        let d = decl(
            1,
            vec![
                file("/etc/app/a.conf", "a=1\n", 0o644),
                file("/etc/secret", "s", 0o600),
            ],
        );
        let r = fx.applier.apply(&d, &SectionState::default());
        assert_eq!(r.outcome, Outcome::Applied, "{r:?}");
        assert!(r.items.iter().all(|i| i.ok));
        assert_eq!(
            std::fs::read_to_string(fx.root.join("etc/app/a.conf")).unwrap(),
            "a=1\n"
        );
        assert_eq!(mode_of(&fx.root.join("etc/app/a.conf")), 0o644);
        assert_eq!(mode_of(&fx.root.join("etc/secret")), 0o600);
        let state = r.state.unwrap();
        assert_eq!(state.generation, 1);
        assert_eq!(state.digest, digest_items(&d.items));
        assert_eq!(
            state.paths,
            ["/etc/app/a.conf".to_owned(), "/etc/secret".to_owned()].into()
        );
        // No temp file is left behind.
        assert_eq!(tree(&fx.root), vec!["etc/app/a.conf", "etc/secret"]);
    }

    #[test]
    fn bad_paths_and_oversize_are_rejected_with_nothing_written() {
        let fx = fixture();
        let big = "x".repeat(MAX_FILE_BYTES + 1);
        for bad in [
            vec![
                file("/ok", "1", 0o644),
                file("/etc/../../escape", "x", 0o644),
            ],
            vec![file("/ok", "1", 0o644), file("relative/path", "x", 0o644)],
            vec![file("/ok", "1", 0o644), file("/big", &big, 0o644)],
            vec![
                file("/ok", "1", 0o644),
                file("/var/lib/mesh-agent/credentials.toml", "x", 0o600),
            ],
            vec![file("/ok", "1", 0o644), file("/var/lib", "x", 0o600)],
        ] {
            let r = fx
                .applier
                .apply(&decl(1, bad.clone()), &SectionState::default());
            assert_eq!(r.outcome, Outcome::Rejected, "{bad:?}");
            assert!(r.error.is_some());
            let state = r.state.unwrap();
            assert_eq!(state.generation, 0);
            assert_eq!(state.last_outcome, Some(Outcome::Rejected));
            assert!(state.paths.is_empty());
            assert!(
                tree(&fx.root).is_empty(),
                "{bad:?} wrote {:?}",
                tree(&fx.root)
            );
        }
    }

    #[test]
    fn symlinks_escaping_the_root_are_refused() {
        let fx = fixture();
        let outside = fx._dir.path().join("outside");
        std::fs::create_dir_all(&outside).unwrap();
        std::os::unix::fs::symlink(&outside, fx.root.join("link")).unwrap();
        std::fs::create_dir_all(fx.root.join("inside")).unwrap();
        std::os::unix::fs::symlink(fx.root.join("inside"), fx.root.join("ok-link")).unwrap();

        let r = fx.applier.apply(
            &decl(1, vec![file("/link/x", "x", 0o644)]),
            &SectionState::default(),
        );
        assert_eq!(r.outcome, Outcome::Rejected, "{r:?}");
        assert!(std::fs::read_dir(&outside).unwrap().next().is_none());

        let r = fx.applier.apply(
            &decl(1, vec![file("/ok-link/x", "x", 0o644)]),
            &SectionState::default(),
        );
        assert_eq!(r.outcome, Outcome::Applied, "{r:?}");
        assert_eq!(
            std::fs::read_to_string(fx.root.join("inside/x")).unwrap(),
            "x"
        );
    }

    #[test]
    fn dropped_files_are_removed_and_stale_generations_ignored() {
        let fx = fixture();
        let r1 = fx.applier.apply(
            &decl(1, vec![file("/a", "1", 0o644), file("/b", "1", 0o644)]),
            &SectionState::default(),
        );
        let s1 = r1.state.unwrap();
        let r2 = fx
            .applier
            .apply(&decl(2, vec![file("/a", "2", 0o640)]), &s1);
        assert_eq!(r2.outcome, Outcome::Applied);
        let s2 = r2.state.unwrap();
        assert_eq!(tree(&fx.root), vec!["a"]);
        assert_eq!(std::fs::read_to_string(fx.root.join("a")).unwrap(), "2");
        assert_eq!(mode_of(&fx.root.join("a")), 0o640);
        assert_eq!(s2.paths, ["/a".to_owned()].into());

        // A stale or duplicate generation changes nothing and restates generation 2.
        for g in [1, 2] {
            let r = fx
                .applier
                .apply(&decl(g, vec![file("/c", "c", 0o644)]), &s2);
            assert!(r.stale);
            assert_eq!(r.generation, 2);
            assert_eq!(r.outcome, Outcome::Applied);
            assert!(r.state.is_none());
            assert_eq!(tree(&fx.root), vec!["a"]);
        }
    }

    #[test]
    fn failed_write_keeps_previous_generation() {
        let fx = fixture();
        let s1 = fx
            .applier
            .apply(
                &decl(1, vec![file("/a", "1", 0o644)]),
                &SectionState::default(),
            )
            .state
            .unwrap();
        // A read-only directory makes the write fail (unless running as root, where
        // permissions do not bind: then the apply simply succeeds).
        std::fs::create_dir_all(fx.root.join("ro")).unwrap();
        std::fs::set_permissions(fx.root.join("ro"), std::fs::Permissions::from_mode(0o500))
            .unwrap();
        let r = fx
            .applier
            .apply(&decl(2, vec![file("/ro/x", "x", 0o644)]), &s1);
        std::fs::set_permissions(fx.root.join("ro"), std::fs::Permissions::from_mode(0o700))
            .unwrap();
        let s2 = r.state.unwrap();
        if r.outcome == Outcome::Failed {
            assert_eq!(s2.generation, 1);
            assert!(s2.paths.contains("/a"));
            assert!(fx.root.join("a").exists());
        } else {
            assert_eq!(s2.generation, 2);
        }
    }

    #[test]
    fn units_are_recorded_for_the_inventory_section_only() {
        let fx = fixture();
        let unit = mesh_protocol::UnitItem {
            user: Default::default(),
            limits: Default::default(),
            stateful: false,
            artifact: None,
            revision: None,
            name: "web-0".into(),
            module: "web".into(),
            command: "/bin/true".into(),
            args: vec![],
            env: Default::default(),
            working_dir: None,
            restart: mesh_protocol::RestartPolicy::Always,
            desired: mesh_protocol::DesiredState::Running,
            probes: Vec::new(),
        };
        let mut d = decl(1, vec![file("/srv/web.conf", "x", 0o644)]);
        d.section = Section::Inventory;
        d.items.units = vec![unit.clone()];
        let r = fx.applier.apply(&d, &SectionState::default());
        assert_eq!(r.outcome, Outcome::Applied, "{r:?}");
        let s1 = r.state.unwrap();
        assert_eq!(s1.units, vec![unit.clone()]);
        assert!(r.items.iter().any(|i| i.item == "web-0" && i.ok));
        assert_eq!(tree(&fx.root), vec!["srv/web.conf"]);

        // A generation without units records none (the supervisor stops them).
        let mut d2 = decl(2, vec![]);
        d2.section = Section::Inventory;
        let s2 = fx.applier.apply(&d2, &s1).state.unwrap();
        assert!(s2.units.is_empty());

        // Units anywhere else: rejected, nothing touched, the old units kept.
        let mut bad = decl(3, vec![file("/etc/x", "x", 0o644)]);
        bad.items.units = vec![unit];
        let r = fx.applier.apply(&bad, &s1);
        assert_eq!(r.outcome, Outcome::Rejected);
        assert!(r.error.unwrap().contains("inventory"));
        assert!(!fx.root.join("etc/x").exists());
        assert_eq!(r.state.unwrap().units, s1.units);
    }

    #[test]
    fn artifacts_are_declared_in_the_delivery_section_only() {
        let fx = fixture();
        let artifact = mesh_protocol::ArtifactItem {
            digest: mesh_protocol::ArtifactDigest::of(b"a"),
            registry: "http://127.0.0.1:5000".into(),
            repository: "mesh/artifacts".into(),
        };
        let mut bad = decl(1, vec![file("/etc/x", "x", 0o644)]);
        bad.items.artifacts = vec![artifact.clone()];
        let r = fx.applier.apply(&bad, &SectionState::default());
        assert_eq!(r.outcome, Outcome::Rejected);
        assert!(r.error.unwrap().contains("delivery"));
        assert!(!fx.root.join("etc/x").exists());

        // In the delivery section the applier takes them (the agent caches them).
        let mut ok = decl(1, vec![]);
        ok.section = Section::Delivery;
        ok.items.artifacts = vec![artifact];
        let r = fx.applier.apply(&ok, &SectionState::default());
        assert_eq!(r.outcome, Outcome::Applied, "{r:?}");
    }

    #[test]
    fn resources_are_declared_in_the_provisioning_section_only() {
        let fx = fixture();
        let resource = mesh_protocol::ResourceItem {
            grant: uuid::Uuid::from_u128(7),
            kind: mesh_protocol::ResourceKind::PostgresDatabase,
            name: "app-main".into(),
            user: "app-main".into(),
            options: Default::default(),
            state: mesh_protocol::ResourceState::Present,
            port: 5433,
            admin: mesh_protocol::AdminAccess {
                server: mesh_protocol::AdminServer::Postgres,
                socket_dir: Some("/run/pg".into()),
                user: None,
                node: None,
                home: None,
                config: None,
            },
            credential: Some("/modules/pg/secrets/grant-x.env".into()),
            credential_version: 1,
        };
        // Anywhere else: rejected naming the field, nothing touched.
        for section in [Section::Config, Section::Inventory, Section::Delivery] {
            let mut bad = decl(1, vec![file("/etc/x", "x", 0o644)]);
            bad.section = section;
            bad.items.resources = vec![resource.clone()];
            let r = fx.applier.apply(&bad, &SectionState::default());
            assert_eq!(r.outcome, Outcome::Rejected, "{section}");
            let error = r.error.unwrap();
            assert!(
                error.contains("body.items.resources") && error.contains("provisioning"),
                "{error}"
            );
            assert!(!fx.root.join("etc/x").exists());
            let state = r.state.unwrap();
            assert_eq!(state.generation, 0);
            assert!(state.resources.is_empty());
        }

        // In the provisioning section they are recorded (the worker takes them).
        let mut ok = decl(1, vec![]);
        ok.section = Section::Provisioning;
        ok.items.resources = vec![resource.clone()];
        let r = fx.applier.apply(&ok, &SectionState::default());
        assert_eq!(r.outcome, Outcome::Applied, "{r:?}");
        let s1 = r.state.unwrap();
        assert_eq!(s1.resources, vec![resource]);
        // A generation without them records none (the grants are gone).
        let mut empty = decl(2, vec![]);
        empty.section = Section::Provisioning;
        assert!(
            fx.applier
                .apply(&empty, &s1)
                .state
                .unwrap()
                .resources
                .is_empty()
        );
    }

    #[test]
    fn decode_checks_the_node() {
        let node = NodeId::parse("node-a").unwrap();
        let other = NodeId::parse("node-b").unwrap();
        let bytes = Envelope::new(other, 1, decl(1, vec![])).encode();
        let err = decode(&bytes, &node).unwrap_err();
        assert!(err.to_string().contains("node-b"), "{err}");
        assert_eq!(peek_section(&bytes), (Some(Section::Config), Some(1)));
        assert!(decode(b"{", &node).is_err());
    }

    // ---- secrets sealed to this node ----

    const NODE: &str = "node-a";

    fn seal_key() -> SealSecretKey {
        SealSecretKey::from_seed([0x11; 32])
    }

    fn sealed_fixture() -> Fixture {
        let mut fx = fixture();
        fx.applier = fx
            .applier
            .with_seal_key(NodeId::parse(NODE).unwrap(), seal_key());
        fx
    }

    /// `value` sealed for `path` on `node` to `to`.
    fn secret_for(
        to: &SealPublicKey,
        node: &str,
        path: &str,
        value: &str,
        n: u8,
    ) -> SealedFileItem {
        SealedFileItem {
            path: path.into(),
            mode: FileMode::new(0o600).unwrap(),
            secret: "db-password".into(),
            version: i64::from(n),
            sealed: sealing::seal(
                to,
                &sealing::secret_aad(node, path),
                value.as_bytes(),
                [n; 32],
            )
            .unwrap(),
        }
    }

    fn secret(path: &str, value: &str, n: u8) -> SealedFileItem {
        secret_for(&seal_key().public(), NODE, path, value, n)
    }

    fn with_secrets(
        generation: u64,
        files: Vec<FileItem>,
        secrets: Vec<SealedFileItem>,
    ) -> Declaration {
        let mut d = decl(generation, files);
        d.items.secrets = secrets;
        d
    }

    #[test]
    fn a_sealed_secret_is_opened_and_written_0600() {
        let fx = sealed_fixture();
        let d = with_secrets(
            1,
            vec![file("/etc/app/app.conf", "db=x\n", 0o644)],
            vec![secret("/etc/app/db.password", "hunter2", 1)],
        );
        let r = fx.applier.apply(&d, &SectionState::default());
        assert_eq!(r.outcome, Outcome::Applied, "{r:?}");
        let path = fx.root.join("etc/app/db.password");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "hunter2");
        assert_eq!(mode_of(&path), 0o600);
        let state = r.state.clone().unwrap();
        assert_eq!(state.generation, 1);
        assert_eq!(state.digest, digest_items(&d.items));
        assert!(state.paths.contains("/etc/app/db.password"));
        // Nothing the agent reports or logs of it shows the value.
        assert!(!format!("{r:?}").contains("hunter2"));
        assert!(!format!("{:?}", d.items).contains(&d.items.secrets[0].sealed));
        assert_eq!(
            tree(&fx.root),
            vec!["etc/app/app.conf", "etc/app/db.password"]
        );
    }

    #[test]
    fn a_secret_that_does_not_open_refuses_the_whole_declaration() {
        let fx = sealed_fixture();
        let other_key = SealSecretKey::from_seed([0x22; 32]).public();
        let path = "/etc/app/db.password";
        for bad in [
            // Sealed to another node's key.
            secret_for(&other_key, NODE, path, "hunter2", 1),
            // Sealed to this key but for another node (copied from its section).
            secret_for(&seal_key().public(), "node-b", path, "hunter2", 2),
            // Sealed for another path of this node.
            SealedFileItem {
                path: path.into(),
                ..secret("/etc/app/other", "hunter2", 3)
            },
        ] {
            let d = with_secrets(
                1,
                vec![file("/etc/app/app.conf", "db=x\n", 0o644)],
                vec![secret("/etc/app/ok.password", "fine", 4), bad],
            );
            let r = fx.applier.apply(&d, &SectionState::default());
            assert_eq!(r.outcome, Outcome::Rejected, "{r:?}");
            let error = r.error.clone().unwrap();
            assert!(error.starts_with(path), "{error}");
            assert!(error.contains("does not open"), "{error}");
            assert!(!format!("{r:?}").contains("hunter2"));
            assert!(!format!("{r:?}").contains("fine"));
            let state = r.state.unwrap();
            assert_eq!(state.generation, 0);
            assert_eq!(state.last_outcome, Some(Outcome::Rejected));
            assert!(tree(&fx.root).is_empty(), "wrote {:?}", tree(&fx.root));
        }
        // An agent without a seal key opens nothing.
        let r = fixture().applier.apply(
            &with_secrets(1, vec![], vec![secret(path, "x", 5)]),
            &SectionState::default(),
        );
        assert_eq!(r.outcome, Outcome::Rejected, "{r:?}");
        assert!(r.error.unwrap().contains("no seal key"));
    }

    #[test]
    fn a_later_generation_without_the_secret_removes_it() {
        let fx = sealed_fixture();
        let d1 = with_secrets(
            1,
            vec![file("/etc/app/app.conf", "db=x\n", 0o644)],
            vec![
                secret("/etc/app/db.password", "hunter2", 1),
                secret("/etc/app/api.token", "t0ken", 2),
            ],
        );
        let r1 = fx.applier.apply(&d1, &SectionState::default());
        assert_eq!(r1.outcome, Outcome::Applied, "{r1:?}");
        // Generation 2: the grant of db.password was revoked; api.token rotated.
        let d2 = with_secrets(
            2,
            vec![file("/etc/app/app.conf", "db=x\n", 0o644)],
            vec![secret("/etc/app/api.token", "t0ken-2", 3)],
        );
        let r2 = fx.applier.apply(&d2, r1.state.as_ref().unwrap());
        assert_eq!(r2.outcome, Outcome::Applied, "{r2:?}");
        assert!(!fx.root.join("etc/app/db.password").exists());
        assert_eq!(
            std::fs::read_to_string(fx.root.join("etc/app/api.token")).unwrap(),
            "t0ken-2"
        );
        assert_eq!(
            r2.state.unwrap().paths,
            [
                "/etc/app/api.token".to_owned(),
                "/etc/app/app.conf".to_owned()
            ]
            .into()
        );
        assert_eq!(
            tree(&fx.root),
            vec!["etc/app/api.token", "etc/app/app.conf"]
        );
    }

    #[test]
    fn a_path_declared_as_file_and_secret_is_refused() {
        let fx = sealed_fixture();
        let d = with_secrets(
            1,
            vec![file("/etc/app/db.password", "plain", 0o644)],
            vec![secret("/etc/app/db.password", "hunter2", 1)],
        );
        let r = fx.applier.apply(&d, &SectionState::default());
        assert_eq!(r.outcome, Outcome::Rejected, "{r:?}");
        assert!(r.error.unwrap().contains("declared twice"));
        assert!(tree(&fx.root).is_empty());
    }
}
