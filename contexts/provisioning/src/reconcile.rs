//! The one level-triggered pass every change ends in, under the context's
//! advisory lock ([`lock`]): grants follow the requirements, credentials are
//! issued (sealed for config) or withdrawn, revoked grants age out of their
//! retention, each grant's state follows what its provider nodes reported,
//! the grant conditions are told when their set changes, and the section of
//! every provider node is computed from the result.
//!
//! The pass reads the schema whole (modules, grants, statuses), decides in
//! memory, writes back only the rows that changed (in bulk) and queues its
//! record events in the same transaction: withdrawals before issues, so a
//! consumer's file handed from an old grant to a new one is free when config
//! takes it.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use base64::Engine as _;
use chrono::{DateTime, Utc};
use mesh_credentials::{MasterKeys, crypt};
use mesh_plumbing::outbox;
use mesh_plumbing::section::Items;
use mesh_protocol::{
    CredentialFile, CredentialsIssued, CredentialsWithdrawn, DeclarationItems, FleetCondition,
    FleetConditions, MAX_EVENT_BYTES, NodeId, Provides, RecordEvent, RecordKind, Requirement,
    ResourceItem, ResourceKind, ResourceState, ResourceStatusState,
};
use sqlx::PgConnection;
use sqlx::types::Json;
use uuid::Uuid;

use crate::plan::{self, ModuleFacts, Wanted};
use crate::{Error, SCHEMA, Settings};

/// Advisory lock of every writing transaction: "prov" in ASCII, key 0.
const LOCK: i32 = 0x7072_6f76;

/// Take the context's lock for the rest of the transaction.
pub(crate) async fn lock(tx: &mut PgConnection) -> Result<(), Error> {
    sqlx::query("SELECT pg_advisory_xact_lock($1, 0)")
        .bind(LOCK)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// What the API says of a grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum GrantState {
    /// Recorded; no provider can serve it yet (the reason says why).
    Requested,
    /// Declared to the provider's nodes, not yet ready on all of them at the
    /// current credential version.
    Provisioning,
    /// Every provider node reports it ready at the current version.
    Ready,
    /// A provider node's server refused (the reason: its words).
    Failed,
    /// The requirement, its consumer or its provider is gone.
    Revoked,
}

impl GrantState {
    pub const ALL: [GrantState; 5] = [
        GrantState::Requested,
        GrantState::Provisioning,
        GrantState::Ready,
        GrantState::Failed,
        GrantState::Revoked,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            GrantState::Requested => "requested",
            GrantState::Provisioning => "provisioning",
            GrantState::Ready => "ready",
            GrantState::Failed => "failed",
            GrantState::Revoked => "revoked",
        }
    }

    pub fn parse(s: &str) -> Option<GrantState> {
        GrantState::ALL.into_iter().find(|g| g.as_str() == s)
    }
}

pub(crate) fn declared_str(s: ResourceState) -> &'static str {
    match s {
        ResourceState::Present => "present",
        ResourceState::Revoked => "revoked",
        ResourceState::Deleted => "deleted",
    }
}

fn parse_declared(s: &str) -> Option<ResourceState> {
    match s {
        "present" => Some(ResourceState::Present),
        "revoked" => Some(ResourceState::Revoked),
        "deleted" => Some(ResourceState::Deleted),
        _ => None,
    }
}

pub(crate) fn parse_status(s: &str) -> Option<ResourceStatusState> {
    [
        ResourceStatusState::Ready,
        ResourceStatusState::Waiting,
        ResourceStatusState::Failed,
        ResourceStatusState::Revoked,
        ResourceStatusState::Deleted,
    ]
    .into_iter()
    .find(|x| x.as_str() == s)
}

/// The secret config keeps a grant's credential as.
pub fn secret_name(grant: Uuid) -> String {
    format!("grant-{}", grant.simple())
}

/// The consumer's file name of a requirement's credential.
pub fn consumer_file(requirement: &str) -> String {
    format!("grant-{requirement}.env")
}

/// The provider module's file name of a grant's credential.
pub fn provider_file(grant: Uuid) -> String {
    format!("{}.env", secret_name(grant))
}

/// Where config delivers `module`'s file `file` on its nodes.
pub fn module_secret_path(module: &str, file: &str) -> String {
    format!("/modules/{module}/secrets/{file}")
}

/// One grant as the pass holds it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Grant {
    pub id: Uuid,
    pub consumer: String,
    pub requirement: String,
    pub kind: ResourceKind,
    pub options: BTreeMap<String, String>,
    pub delete: bool,
    pub provider: Option<String>,
    pub provides: Option<Provides>,
    pub resource: String,
    pub login: Option<String>,
    pub credential_version: i64,
    pub declared: ResourceState,
    pub state: GrantState,
    pub reason: Option<String>,
    pub revoked_at: Option<DateTime<Utc>>,
    pub retain_until: Option<DateTime<Utc>>,
}

impl Grant {
    fn live(&self) -> bool {
        self.revoked_at.is_none()
    }
}

#[derive(sqlx::FromRow)]
struct GrantRow {
    id: Uuid,
    consumer: String,
    requirement: String,
    kind: String,
    options: Json<BTreeMap<String, String>>,
    delete_on_revoke: bool,
    provider: Option<String>,
    provides: Option<Json<Provides>>,
    resource: String,
    login: Option<String>,
    credential_version: i64,
    declared: String,
    state: String,
    reason: Option<String>,
    revoked_at: Option<DateTime<Utc>>,
    retain_until: Option<DateTime<Utc>>,
}

impl TryFrom<GrantRow> for Grant {
    type Error = Error;

    fn try_from(r: GrantRow) -> Result<Grant, Error> {
        let what = || format!("grant {}", r.id);
        Ok(Grant {
            id: r.id,
            kind: ResourceKind::parse(&r.kind)
                .ok_or_else(|| Error::corrupt(what(), format!("kind `{}`", r.kind)))?,
            declared: parse_declared(&r.declared)
                .ok_or_else(|| Error::corrupt(what(), format!("declared `{}`", r.declared)))?,
            state: GrantState::parse(&r.state)
                .ok_or_else(|| Error::corrupt(what(), format!("state `{}`", r.state)))?,
            consumer: r.consumer,
            requirement: r.requirement,
            options: r.options.0,
            delete: r.delete_on_revoke,
            provider: r.provider,
            provides: r.provides.map(|p| p.0),
            resource: r.resource,
            login: r.login,
            credential_version: r.credential_version,
            reason: r.reason,
            revoked_at: r.revoked_at,
            retain_until: r.retain_until,
        })
    }
}

/// What a provider node last reported of a grant.
#[derive(Debug, Clone)]
pub(crate) struct Status {
    pub node: String,
    pub state: ResourceStatusState,
    pub credential_version: Option<i64>,
    pub reason: Option<String>,
    pub recreated: bool,
}

/// The modules the record told of, not removed, by name.
pub(crate) async fn modules(tx: &mut PgConnection) -> Result<BTreeMap<String, ModuleFacts>, Error> {
    type Row = (
        String,
        Vec<String>,
        Json<Vec<Requirement>>,
        Json<Vec<Provides>>,
    );
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT module, nodes, requires, provides FROM provisioning.modules \
         WHERE NOT removed ORDER BY module",
    )
    .fetch_all(&mut *tx)
    .await?;
    let mut out = BTreeMap::new();
    for (module, nodes, requires, provides) in rows {
        let mut ids = Vec::with_capacity(nodes.len());
        for n in &nodes {
            ids.push(NodeId::parse(n).map_err(|e| Error::corrupt(format!("module {module}"), e))?);
        }
        out.insert(
            module,
            ModuleFacts {
                nodes: ids,
                requires: requires.0,
                provides: provides.0,
            },
        );
    }
    Ok(out)
}

const GRANT_COLUMNS: &str = "id, consumer, requirement, kind, options, delete_on_revoke, provider, \
     provides, resource, login, credential_version, declared, state, reason, revoked_at, retain_until";

async fn grants(tx: &mut PgConnection) -> Result<Vec<Grant>, Error> {
    let sql = format!(
        "SELECT {GRANT_COLUMNS} FROM provisioning.grants ORDER BY consumer, requirement, id"
    );
    let rows: Vec<GrantRow> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .fetch_all(&mut *tx)
        .await?;
    rows.into_iter().map(Grant::try_from).collect()
}

async fn statuses(tx: &mut PgConnection) -> Result<HashMap<Uuid, Vec<Status>>, Error> {
    type Row = (Uuid, String, String, Option<i64>, Option<String>, bool);
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT grant_id, node, state, credential_version, reason, recreated \
         FROM provisioning.statuses ORDER BY grant_id, node",
    )
    .fetch_all(&mut *tx)
    .await?;
    let mut out: HashMap<Uuid, Vec<Status>> = HashMap::new();
    for (grant, node, state, credential_version, reason, recreated) in rows {
        let state = parse_status(&state)
            .ok_or_else(|| Error::corrupt(format!("status of {grant}"), &state))?;
        out.entry(grant).or_default().push(Status {
            node,
            state,
            credential_version,
            reason,
            recreated,
        });
    }
    Ok(out)
}

/// What one pass decided, beyond the grants themselves.
#[derive(Default)]
struct Plan {
    grants: Vec<Grant>,
    /// Rows to delete: never issued (nothing on any server), or deleted.
    removed: BTreeSet<Uuid>,
    /// Live grants that need a new credential (taken up, rotated, moved).
    issue: BTreeSet<Uuid>,
    /// Grants whose credential is withdrawn from config.
    withdraw: Vec<Uuid>,
    /// Why a live grant waits (no provider, no key, an unusable name).
    waits: HashMap<Uuid, String>,
}

impl Plan {
    fn revoke(&mut self, i: usize, why: String, now: DateTime<Utc>, retention: chrono::Duration) {
        let g = &mut self.grants[i];
        g.revoked_at = Some(now);
        g.reason = Some(why);
        self.issue.remove(&g.id);
        if g.provider.is_none() || g.credential_version == 0 {
            // Nothing was issued, so nothing was made on any server.
            self.removed.insert(g.id);
            return;
        }
        self.withdraw.push(g.id);
        if g.delete {
            g.declared = ResourceState::Deleted;
            g.retain_until = Some(now);
        } else {
            g.declared = ResourceState::Revoked;
            g.retain_until = Some(now + retention);
        }
    }
}

/// Whether the live grant `g` still serves the requirement `w` (its kind, its
/// provider still named or unnamed, still providing the kind); else why not.
fn keeps(g: &Grant, w: &Wanted, modules: &BTreeMap<String, ModuleFacts>) -> Result<(), String> {
    let r = &w.requirement;
    if g.kind != r.kind {
        return Err(format!("the requirement now asks for {}", r.kind));
    }
    let Some(p) = &g.provider else {
        return Ok(());
    };
    if let Some(named) = &r.provider
        && named != p
    {
        return Err(format!("the requirement now names provider `{named}`"));
    }
    let m = modules
        .get(p)
        .ok_or_else(|| format!("provider module `{p}` was removed"))?;
    if !m.provides.iter().any(|x| x.kind == g.kind) {
        return Err(format!("module `{p}` no longer provides {}", g.kind));
    }
    Ok(())
}

fn provides_of(
    modules: &BTreeMap<String, ModuleFacts>,
    p: &str,
    kind: ResourceKind,
) -> Option<Provides> {
    modules
        .get(p)
        .and_then(|m| m.provides.iter().find(|x| x.kind == kind).cloned())
}

/// Bring the kept grant `g` in line with its requirement.
fn update(p: &mut Plan, i: usize, w: &Wanted, modules: &BTreeMap<String, ModuleFacts>) {
    let g = &mut p.grants[i];
    g.options = w.requirement.options.clone();
    g.delete = w.requirement.delete;
    match (&g.provider, &w.provider) {
        (None, Ok(c)) => {
            g.provider = Some(c.module.clone());
            g.provides = Some(c.provides.clone());
        }
        (None, Err(why)) => {
            p.waits.insert(g.id, why.clone());
        }
        (Some(name), _) => {
            let now = provides_of(modules, name, g.kind);
            let moved = match (&g.provides, &now) {
                (Some(a), Some(b)) => a.host != b.host || a.port != b.port,
                _ => false,
            };
            if moved && g.credential_version > 0 {
                // The credential file names the server's host and port.
                p.issue.insert(g.id);
            }
            if now.is_some() {
                g.provides = now;
            }
        }
    }
}

fn new_grant(w: &Wanted) -> Grant {
    let r = &w.requirement;
    let (provider, provides) = match &w.provider {
        Ok(c) => (Some(c.module.clone()), Some(c.provides.clone())),
        Err(_) => (None, None),
    };
    Grant {
        id: Uuid::now_v7(),
        consumer: w.consumer.clone(),
        requirement: r.name.clone(),
        kind: r.kind,
        options: r.options.clone(),
        delete: r.delete,
        provider,
        provides,
        resource: format!("{}-{}", w.consumer, r.name),
        login: None,
        credential_version: 0,
        declared: ResourceState::Present,
        state: GrantState::Requested,
        reason: None,
        revoked_at: None,
        retain_until: None,
    }
}

/// Grants follow the requirements: kept, taken up, made, or revoked.
fn follow(
    p: &mut Plan,
    modules: &BTreeMap<String, ModuleFacts>,
    now: DateTime<Utc>,
    retention: chrono::Duration,
) {
    let mut kept: BTreeSet<Uuid> = BTreeSet::new();
    for w in plan::resolve(modules) {
        let r = &w.requirement;
        let live = p
            .grants
            .iter()
            .position(|g| g.live() && g.consumer == w.consumer && g.requirement == r.name);
        if let Some(i) = live {
            match keeps(&p.grants[i], &w, modules) {
                Ok(()) => {
                    kept.insert(p.grants[i].id);
                    update(p, i, &w, modules);
                    continue;
                }
                Err(why) => p.revoke(i, why, now, retention),
            }
        }
        // A revoked grant of the same requirement on the same provider is
        // taken up again (and with it the data it kept).
        let taken = w.provider.as_ref().ok().and_then(|c| {
            p.grants
                .iter()
                .enumerate()
                .filter(|(_, g)| {
                    !g.live()
                        && !p.removed.contains(&g.id)
                        && g.consumer == w.consumer
                        && g.requirement == r.name
                        && g.kind == r.kind
                        && g.provider.as_deref() == Some(c.module.as_str())
                })
                .max_by_key(|(_, g)| g.revoked_at)
                .map(|(i, _)| i)
        });
        let i = match taken {
            Some(i) => {
                let g = &mut p.grants[i];
                g.revoked_at = None;
                g.retain_until = None;
                g.reason = None;
                g.declared = ResourceState::Present;
                p.withdraw.retain(|id| *id != g.id);
                p.issue.insert(g.id);
                i
            }
            None => {
                p.grants.push(new_grant(&w));
                p.grants.len() - 1
            }
        };
        kept.insert(p.grants[i].id);
        update(p, i, &w, modules);
    }
    for i in 0..p.grants.len() {
        let g = &p.grants[i];
        if g.live() && !kept.contains(&g.id) {
            let why = if modules.contains_key(&g.consumer) {
                format!(
                    "module `{}` no longer requires `{}`",
                    g.consumer, g.requirement
                )
            } else {
                format!("module `{}` was removed", g.consumer)
            };
            p.revoke(i, why, now, retention);
        }
    }
}

/// The nodes a provider module runs on now (none: removed or unplaced).
fn provider_nodes<'a>(modules: &'a BTreeMap<String, ModuleFacts>, g: &Grant) -> &'a [NodeId] {
    g.provider
        .as_ref()
        .and_then(|p| modules.get(p))
        .map_or(&[], |m| m.nodes.as_slice())
}

/// The reports of the nodes the provider runs on now.
fn current<'a>(
    modules: &BTreeMap<String, ModuleFacts>,
    statuses: &'a HashMap<Uuid, Vec<Status>>,
    g: &Grant,
) -> Vec<&'a Status> {
    let nodes = provider_nodes(modules, g);
    statuses
        .get(&g.id)
        .map(|s| {
            s.iter()
                .filter(|s| nodes.iter().any(|n| n.as_str() == s.node))
                .collect()
        })
        .unwrap_or_default()
}

/// The master keyring, read at each issue (a rotation by config replaces
/// the file), or why there is none.
fn keyring(settings: &Settings) -> Result<MasterKeys, String> {
    let Some(path) = &settings.master_keys_file else {
        return Err(
            "no secrets master keyring is configured (master_keys_file): the credential cannot be issued"
                .to_owned(),
        );
    };
    match MasterKeys::load_if_exists(path) {
        Ok(Some(keys)) => Ok(keys),
        Ok(None) => Err(format!(
            "the secrets master keyring {} does not exist: the credential cannot be issued",
            path.display()
        )),
        Err(e) => Err(format!(
            "the secrets master keyring cannot be read ({e}): the credential cannot be issued"
        )),
    }
}

/// The credential file sealed in config's at-rest form under the current
/// master key, as `provisioning.credentials.issued`.
fn seal(keys: &MasterKeys, g: &Grant, provider: &str, file: &str) -> Result<RecordEvent, String> {
    let current = keys
        .current()
        .ok_or_else(|| "the secrets master keyring holds no key".to_owned())?;
    let secret = secret_name(g.id);
    let dk = crypt::new_data_key();
    let wrapped = crypt::wrap_key(&current.bytes(), &secret, &dk).map_err(|e| e.0)?;
    let ct = crypt::encrypt_value(&dk, &secret, g.credential_version, file.as_bytes())
        .map_err(|e| e.0)?;
    let b64 = base64::engine::general_purpose::STANDARD;
    Ok(RecordEvent::new(RecordKind::CredentialsIssued(
        CredentialsIssued {
            grant: g.id,
            secret,
            version: g.credential_version,
            files: vec![
                CredentialFile {
                    module: g.consumer.clone(),
                    file: consumer_file(&g.requirement),
                },
                CredentialFile {
                    module: provider.to_owned(),
                    file: provider_file(g.id),
                },
            ],
            key_id: current.id.clone(),
            wrapped_key: b64.encode(wrapped),
            ciphertext: b64.encode(ct),
        },
    )))
}

/// Issue a new credential to every live grant that needs one; the events.
fn credentials(p: &mut Plan, settings: &Settings) -> Vec<RecordEvent> {
    let due: Vec<usize> = (0..p.grants.len())
        .filter(|&i| {
            let g = &p.grants[i];
            g.live()
                && g.provider.is_some()
                && g.provides.is_some()
                && (g.credential_version == 0 || p.issue.contains(&g.id))
        })
        .collect();
    if due.is_empty() {
        return Vec::new();
    }
    let keys = keyring(settings);
    let mut rng = rand::rng();
    let mut events = Vec::new();
    for i in due {
        let g = &mut p.grants[i];
        let resource = match plan::resource_name(&g.consumer, &g.requirement) {
            Ok(r) => r,
            Err(why) => {
                p.waits.insert(g.id, why);
                continue;
            }
        };
        let keys = match &keys {
            Ok(k) => k,
            Err(why) => {
                if g.credential_version > 0 {
                    tracing::warn!(grant = %g.id, reason = %why, "a credential due for rotation cannot be issued");
                }
                p.waits.insert(g.id, why.clone());
                continue;
            }
        };
        let (Some(provider), Some(provides)) = (g.provider.clone(), g.provides.clone()) else {
            continue;
        };
        let credential = plan::new_credential(g.kind, &resource, &mut rng);
        let before = (g.login.clone(), g.credential_version);
        g.credential_version += 1;
        g.login = Some(credential.user.clone());
        let file = plan::credential_file(
            g.kind,
            &provides,
            &resource,
            &credential,
            g.credential_version,
        );
        match seal(keys, g, &provider, &file) {
            Ok(event) => {
                tracing::info!(grant = %g.id, consumer = %g.consumer, requirement = %g.requirement,
                    version = g.credential_version, "credential issued");
                events.push(event);
            }
            Err(why) => {
                (g.login, g.credential_version) = before;
                p.waits
                    .insert(g.id, format!("the credential cannot be sealed: {why}"));
            }
        }
    }
    events
}

/// The agent's words for a credential file not yet delivered: a normal,
/// brief wait after every issue, not a condition.
const NOT_YET_DELIVERED: &str = mesh_protocol::CREDENTIAL_NOT_YET_DELIVERED;

/// The state (and reason) of `g` from what its provider's nodes reported.
fn state_of(
    g: &Grant,
    modules: &BTreeMap<String, ModuleFacts>,
    statuses: &HashMap<Uuid, Vec<Status>>,
    waits: &HashMap<Uuid, String>,
) -> (GrantState, Option<String>) {
    if !g.live() {
        return (GrantState::Revoked, g.reason.clone());
    }
    let Some(provider) = &g.provider else {
        let why = waits
            .get(&g.id)
            .cloned()
            .unwrap_or_else(|| "no provider serves it yet".to_owned());
        return (GrantState::Requested, Some(why));
    };
    if let Some(why) = waits.get(&g.id) {
        if g.credential_version == 0 {
            return (GrantState::Requested, Some(why.clone()));
        }
    } else if g.credential_version == 0 {
        return (
            GrantState::Requested,
            Some("the credential is not issued yet".to_owned()),
        );
    }
    let nodes = provider_nodes(modules, g);
    if nodes.is_empty() {
        return (
            GrantState::Requested,
            Some(format!("provider module `{provider}` runs on no node")),
        );
    }
    let reports = current(modules, statuses, g);
    if let Some(f) = reports
        .iter()
        .find(|s| s.state == ResourceStatusState::Failed)
    {
        let words = f
            .reason
            .clone()
            .unwrap_or_else(|| "the server refused".to_owned());
        return (GrantState::Failed, Some(words));
    }
    let ready = nodes.iter().all(|n| {
        reports.iter().any(|s| {
            s.node == n.as_str()
                && s.state == ResourceStatusState::Ready
                && s.credential_version.unwrap_or(0) >= g.credential_version
        })
    });
    if ready {
        return (GrantState::Ready, None);
    }
    let waiting = reports
        .iter()
        .find(|s| s.state == ResourceStatusState::Waiting)
        .map(|s| match &s.reason {
            Some(r) => format!("{}: {r}", s.node),
            None => format!("{}: waiting", s.node),
        });
    (
        GrantState::Provisioning,
        waiting.or_else(|| waits.get(&g.id).cloned()),
    )
}

/// The grant conditions of the pass, by key.
fn conditions(grants: &[Grant]) -> Vec<FleetCondition> {
    let mut out = BTreeMap::new();
    for g in grants.iter().filter(|g| g.live()) {
        let name = format!("`{}/{}` ({})", g.consumer, g.requirement, g.kind);
        let reason = g.reason.clone().unwrap_or_default();
        let (kind, message) = match g.state {
            GrantState::Requested => ("grant_waiting", format!("grant {name} waits: {reason}")),
            GrantState::Provisioning
                if g.reason
                    .as_deref()
                    .is_some_and(|r| !r.contains(NOT_YET_DELIVERED)) =>
            {
                ("grant_waiting", format!("grant {name} waits: {reason}"))
            }
            GrantState::Failed => ("grant_failed", format!("grant {name} failed: {reason}")),
            _ => continue,
        };
        let message: String = message.chars().take(1000).collect();
        out.insert(
            format!("grant:{}", g.id),
            FleetCondition {
                key: format!("grant:{}", g.id),
                kind: kind.to_owned(),
                node: None,
                module: Some(g.consumer.clone()),
                stateful: false,
                message,
            },
        );
    }
    // Bounded so that one event carries the set (the first by key).
    let mut budget = MAX_EVENT_BYTES - 4096;
    let mut told = Vec::new();
    for c in out.into_values() {
        let size = serde_json::to_vec(&c).map_or(0, |v| v.len()) + 1;
        if told.len() == mesh_protocol::MAX_CONDITIONS || size > budget {
            tracing::warn!(
                "more grant conditions than one event carries: the first by key are told"
            );
            break;
        }
        budget -= size;
        told.push(c);
    }
    told
}

/// Tell the conditions if their set differs from the last told.
async fn tell(tx: &mut PgConnection, found: Vec<FleetCondition>) -> Result<bool, Error> {
    let json = serde_json::to_value(&found).map_err(|e| Error::corrupt("conditions", e))?;
    let stored: Option<Json<serde_json::Value>> =
        sqlx::query_scalar("SELECT conditions FROM provisioning.conditions")
            .fetch_optional(&mut *tx)
            .await?;
    let unchanged = match &stored {
        Some(s) => s.0 == json,
        None => found.is_empty(),
    };
    if unchanged {
        return Ok(false);
    }
    let version: i64 = sqlx::query_scalar("SELECT nextval('provisioning.conditions_version')")
        .fetch_one(&mut *tx)
        .await?;
    sqlx::query(
        "INSERT INTO provisioning.conditions (singleton, version, conditions) VALUES (true, $1, $2) \
         ON CONFLICT (singleton) DO UPDATE SET version = excluded.version, conditions = excluded.conditions",
    )
    .bind(version)
    .bind(Json(&json))
    .execute(&mut *tx)
    .await?;
    let event = RecordEvent::new(RecordKind::GrantConditions(FleetConditions {
        version,
        conditions: found,
    }));
    outbox::record(tx, SCHEMA, &event).await?;
    Ok(true)
}

/// Write the grants that changed, in bulk: revoked ones first, so a live
/// one taking their place never meets them in the unique index.
async fn write(tx: &mut PgConnection, grants: &[&Grant]) -> Result<(), Error> {
    let (revoked, live): (Vec<&Grant>, Vec<&Grant>) = grants.iter().partition(|g| !g.live());
    for part in [revoked, live] {
        if part.is_empty() {
            continue;
        }
        let ids: Vec<Uuid> = part.iter().map(|g| g.id).collect();
        let consumers: Vec<&str> = part.iter().map(|g| g.consumer.as_str()).collect();
        let requirements: Vec<&str> = part.iter().map(|g| g.requirement.as_str()).collect();
        let kinds: Vec<&str> = part.iter().map(|g| g.kind.as_str()).collect();
        let options: Vec<Json<&BTreeMap<String, String>>> =
            part.iter().map(|g| Json(&g.options)).collect();
        let deletes: Vec<bool> = part.iter().map(|g| g.delete).collect();
        let providers: Vec<Option<&str>> = part.iter().map(|g| g.provider.as_deref()).collect();
        let provides: Vec<Option<Json<&Provides>>> =
            part.iter().map(|g| g.provides.as_ref().map(Json)).collect();
        let resources: Vec<&str> = part.iter().map(|g| g.resource.as_str()).collect();
        let logins: Vec<Option<&str>> = part.iter().map(|g| g.login.as_deref()).collect();
        let versions: Vec<i64> = part.iter().map(|g| g.credential_version).collect();
        let declared: Vec<&str> = part.iter().map(|g| declared_str(g.declared)).collect();
        let states: Vec<&str> = part.iter().map(|g| g.state.as_str()).collect();
        let reasons: Vec<Option<&str>> = part.iter().map(|g| g.reason.as_deref()).collect();
        let revoked_at: Vec<Option<DateTime<Utc>>> = part.iter().map(|g| g.revoked_at).collect();
        let retain: Vec<Option<DateTime<Utc>>> = part.iter().map(|g| g.retain_until).collect();
        sqlx::query(
            "INSERT INTO provisioning.grants AS g (id, consumer, requirement, kind, options, \
                 delete_on_revoke, provider, provides, resource, login, credential_version, declared, \
                 state, reason, revoked_at, retain_until) \
             SELECT * FROM UNNEST($1::uuid[], $2::text[], $3::text[], $4::text[], $5::jsonb[], \
                 $6::bool[], $7::text[], $8::jsonb[], $9::text[], $10::text[], $11::bigint[], \
                 $12::text[], $13::text[], $14::text[], $15::timestamptz[], $16::timestamptz[]) \
             ON CONFLICT (id) DO UPDATE SET kind = excluded.kind, options = excluded.options, \
                 delete_on_revoke = excluded.delete_on_revoke, provider = excluded.provider, \
                 provides = excluded.provides, resource = excluded.resource, login = excluded.login, \
                 credential_version = excluded.credential_version, declared = excluded.declared, \
                 state = excluded.state, reason = excluded.reason, revoked_at = excluded.revoked_at, \
                 retain_until = excluded.retain_until, updated_at = now()",
        )
        .bind(&ids)
        .bind(&consumers)
        .bind(&requirements)
        .bind(&kinds)
        .bind(&options)
        .bind(&deletes)
        .bind(&providers)
        .bind(&provides)
        .bind(&resources)
        .bind(&logins)
        .bind(&versions)
        .bind(&declared)
        .bind(&states)
        .bind(&reasons)
        .bind(&revoked_at)
        .bind(&retain)
        .execute(&mut *tx)
        .await?;
    }
    Ok(())
}

/// What the schema holds after a pass: the modules and the grants.
pub(crate) struct World {
    pub modules: BTreeMap<String, ModuleFacts>,
    pub grants: Vec<Grant>,
}

/// The pass (the caller holds [`lock`]).
pub(crate) async fn pass(tx: &mut PgConnection, settings: &Settings) -> Result<World, Error> {
    let now = Utc::now();
    let retention = chrono::Duration::from_std(settings.retention).unwrap_or(chrono::Duration::MAX);
    let modules = modules(tx).await?;
    let before: HashMap<Uuid, Grant> = grants(tx).await?.into_iter().map(|g| (g.id, g)).collect();
    let statuses = statuses(tx).await?;
    let mut p = Plan {
        grants: before.values().cloned().collect(),
        ..Plan::default()
    };
    p.grants.sort_by(|a, b| {
        (&a.consumer, &a.requirement, a.id).cmp(&(&b.consumer, &b.requirement, b.id))
    });
    follow(&mut p, &modules, now, retention);

    // A resource its provider found missing and made again: the credential
    // rotates, once (the report that said so is then about an older version).
    for g in p
        .grants
        .iter()
        .filter(|g| g.live() && g.credential_version > 0)
    {
        if current(&modules, &statuses, g)
            .iter()
            .any(|s| s.recreated && s.credential_version == Some(g.credential_version))
        {
            tracing::info!(grant = %g.id, "resource re-created by its provider: rotating the credential");
            p.issue.insert(g.id);
        }
    }
    let issued = credentials(&mut p, settings);

    // Retention, then deletion.
    for i in 0..p.grants.len() {
        let g = &mut p.grants[i];
        if g.declared == ResourceState::Revoked && g.retain_until.is_some_and(|t| t <= now) {
            g.declared = ResourceState::Deleted;
        }
        if g.declared == ResourceState::Deleted && !g.live() {
            let nodes = provider_nodes(&modules, g);
            let reports = current(&modules, &statuses, g);
            let gone = nodes.iter().all(|n| {
                reports
                    .iter()
                    .any(|s| s.node == n.as_str() && s.state == ResourceStatusState::Deleted)
            });
            if gone {
                p.removed.insert(g.id);
            }
        }
    }

    for i in 0..p.grants.len() {
        let (state, reason) = state_of(&p.grants[i], &modules, &statuses, &p.waits);
        let g = &mut p.grants[i];
        g.state = state;
        g.reason = reason;
    }

    let removed: Vec<Uuid> = p
        .removed
        .iter()
        .copied()
        .filter(|id| before.contains_key(id))
        .collect();
    if !removed.is_empty() {
        sqlx::query("DELETE FROM provisioning.grants WHERE id = ANY($1)")
            .bind(&removed)
            .execute(&mut *tx)
            .await?;
    }
    let changed: Vec<&Grant> = p
        .grants
        .iter()
        .filter(|g| !p.removed.contains(&g.id) && before.get(&g.id) != Some(*g))
        .collect();
    write(tx, &changed).await?;

    let mut events: Vec<RecordEvent> = p
        .withdraw
        .iter()
        .filter_map(|id| p.grants.iter().find(|g| g.id == *id))
        .map(|g| {
            tracing::info!(grant = %g.id, reason = ?g.reason, "credential withdrawn");
            RecordEvent::new(RecordKind::CredentialsWithdrawn(CredentialsWithdrawn {
                grant: g.id,
                secret: secret_name(g.id),
            }))
        })
        .collect();
    events.extend(issued);
    if !events.is_empty() {
        outbox::record_many(tx, SCHEMA, &events).await?;
    }
    let grants: Vec<Grant> = p
        .grants
        .into_iter()
        .filter(|g| !p.removed.contains(&g.id))
        .collect();
    tell(tx, conditions(&grants)).await?;
    Ok(World { modules, grants })
}

/// The provisioning section of every provider node: a resource per grant
/// its provider module serves there, and an empty section for every node
/// that had one and serves none any more.
pub(crate) async fn desired(
    tx: &mut PgConnection,
    world: &World,
) -> Result<Vec<(NodeId, Items)>, Error> {
    let mut by_node: BTreeMap<NodeId, Vec<ResourceItem>> = BTreeMap::new();
    for g in &world.grants {
        let (Some(provider), Some(provides), Some(login)) = (&g.provider, &g.provides, &g.login)
        else {
            continue;
        };
        if g.credential_version == 0 {
            continue;
        }
        let Some(m) = world.modules.get(provider) else {
            continue;
        };
        let item = ResourceItem {
            grant: g.id,
            kind: g.kind,
            name: g.resource.clone(),
            user: login.clone(),
            options: g.options.clone(),
            state: g.declared,
            port: provides.port,
            admin: provides.admin.clone(),
            credential: (g.declared == ResourceState::Present)
                .then(|| module_secret_path(provider, &provider_file(g.id))),
            credential_version: g.credential_version,
        };
        for n in &m.nodes {
            by_node.entry(n.clone()).or_default().push(item.clone());
        }
    }
    let stored: Vec<String> = sqlx::query_scalar("SELECT node FROM provisioning.sections")
        .fetch_all(&mut *tx)
        .await?;
    for n in stored {
        let id = NodeId::parse(&n).map_err(|e| Error::corrupt(format!("section of {n}"), e))?;
        by_node.entry(id).or_default();
    }
    let mut out = Vec::with_capacity(by_node.len());
    for (node, resources) in by_node {
        let items = DeclarationItems {
            resources,
            ..DeclarationItems::default()
        };
        out.push((node, Items::new(items)?));
    }
    Ok(out)
}
