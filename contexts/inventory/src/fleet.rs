//! The fleet reconcile: from modules, intent layers, nodes and current
//! assignments, compute where every replica runs, apply the difference
//! (make-before-break where the old node is reachable), advance drains, declare
//! each node's inventory section whose units changed, and tell the record where
//! each module runs (`inventory.module.placed` / `.removed`) and the conditions
//! it found (`inventory.fleet.conditions`) where those changed.
//!
//! Level-triggered and idempotent: it does not care why it was called. The
//! controller's sweeper calls it periodically (after judging liveness); module and
//! node API writes call it in their own transaction. A PostgreSQL advisory lock
//! serializes reconciles, so two never decide from the same stale read.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};
use mesh_plumbing::outbox;
use mesh_plumbing::section::Items;
use mesh_protocol::{
    DeclarationItems, Endpoints, HeartbeatPlan, ModulePlacement, ModulePort, ModuleRemoved,
    ModuleTargets, NodeId, Provides, RecordEvent, RecordKind, Requirement, SettingsFile,
};
use sqlx::PgConnection;
use sqlx::types::Json;

use crate::conditions::{self, Condition, Found};
use crate::drains;
use crate::module::{ModuleSpec, unit_name};
use crate::nodes::LabelTrust;
use crate::placement::{
    Bounds, Intent, NodeFacts, PlacementError, Request, Resources, Snapshot, effective_replicas,
    place,
};
use crate::state::{
    ACTIVE, Assignment, Assignments, Module, NodeRow, RETIRING, ReconcileReport, lock,
};
use crate::{Error, SCHEMA, SECTIONS};

/// What a reconcile needs besides the database.
#[derive(Debug, Clone)]
pub(crate) struct Pass {
    pub now: DateTime<Utc>,
    /// Why liveness cannot be judged yet (none: it can).
    pub not_observed: Option<String>,
    pub controller_node: Option<String>,
    pub max_unreachable_share: f64,
    /// What every node's inventory section carries besides its units.
    pub plan: Carried,
    /// Which stated labels select (placement sees effective labels only).
    pub trust: LabelTrust,
}

/// What every node's inventory section carries besides its units: the
/// heartbeat plan (none: the floor) and the mesh's endpoints (none: the
/// controller knows none to tell; decision 0044).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Carried {
    pub heartbeat: Option<HeartbeatPlan>,
    pub endpoints: Option<Endpoints>,
}

impl Carried {
    /// The items of a node that runs nothing.
    pub(crate) fn bare(&self) -> DeclarationItems {
        DeclarationItems {
            heartbeat: self.heartbeat,
            endpoints: self.endpoints.clone(),
            ..DeclarationItems::default()
        }
    }
}

#[derive(sqlx::FromRow)]
struct ModuleRow {
    name: String,
    spec: Json<ModuleSpec>,
    placement_error: Option<String>,
}

async fn load_modules(tx: &mut PgConnection) -> Result<BTreeMap<String, Module>, Error> {
    let rows: Vec<ModuleRow> =
        sqlx::query_as("SELECT name, spec, placement_error FROM inventory.modules ORDER BY name")
            .fetch_all(&mut *tx)
            .await?;
    let intents: Vec<(String, String, Json<serde_json::Value>)> =
        sqlx::query_as("SELECT module, layer, value FROM inventory.intents")
            .fetch_all(&mut *tx)
            .await?;
    let mut targets = crate::targets::load(tx).await?;
    let mut modules: BTreeMap<String, Module> = rows
        .into_iter()
        .map(|m| {
            let intent = Intent {
                user: m.spec.0.user_replicas(),
                ..Intent::default()
            };
            let targets = targets.remove(&m.name).unwrap_or_default();
            (
                m.name,
                Module {
                    spec: m.spec.0,
                    intent,
                    placement_error: m.placement_error,
                    targets,
                },
            )
        })
        .collect();
    for (module, layer, value) in intents {
        let Some(m) = modules.get_mut(&module) else {
            continue;
        };
        let corrupt = |e: serde_json::Error| Error::Corrupt {
            node: module.clone(),
            reason: format!("intent {layer}: {e}"),
        };
        match layer.as_str() {
            "policy" => {
                m.intent.policy = Some(serde_json::from_value::<Bounds>(value.0).map_err(corrupt)?)
            }
            "autoscaler" => {
                let a: crate::module::AutoscalerIntent =
                    serde_json::from_value(value.0).map_err(corrupt)?;
                m.intent.autoscaler = Some(a.replicas);
            }
            _ => {}
        }
    }
    Ok(modules)
}

/// The effective replica count of a module (pinned placements run one).
fn replicas_of(m: &Module) -> u32 {
    if m.spec.placement.is_pinned() {
        1
    } else {
        effective_replicas(&m.intent)
    }
}

fn replica_u32(a: &Assignment) -> u32 {
    u32::try_from(a.replica).unwrap_or(0)
}

/// Reconcile the whole fleet inside `tx` (which it locks), in phases: load
/// the state, drop surplus copies, retire replaced ones (make-before-break),
/// judge authority, place each module, judge drains, then write placement
/// errors, drains, assignments, module placements (the record), sections and
/// conditions (the record; nodes before assignments before sections: every
/// writer locks in that order).
pub(crate) async fn reconcile(
    tx: &mut PgConnection,
    pass: &Pass,
) -> Result<ReconcileReport, Error> {
    lock(tx).await?;
    let State {
        nodes,
        mut modules,
        before,
    } = load(tx).await?;
    let mut report = ReconcileReport::default();
    let mut found = Found::new();
    // The assignments after this pass, keyed (node, unit name).
    let mut after: Assignments = before
        .iter()
        .filter(|a| modules.contains_key(&a.module))
        .map(|a| ((a.node.clone(), a.name.clone()), a.clone()))
        .collect();
    drop_surplus(&mut after);
    retire_replaced(&mut after, &nodes);
    let not_authoritative = authority(&nodes, pass, &mut found, &mut report);
    place_modules(
        &nodes,
        &mut modules,
        &mut after,
        not_authoritative.as_ref(),
        pass,
        &mut found,
    );
    let drains = drains::judge(&nodes, &modules, &after, not_authoritative.as_ref());
    write_placement_errors(tx, &modules).await?;
    drains::write(tx, &nodes, drains, &mut report).await?;
    write_assignments(tx, &before, &after, &mut report).await?;
    report.published = publish_placements(tx, &modules, &after).await?;
    // Sections of every node that holds or held units.
    let mut touched: BTreeSet<String> = before.iter().map(|a| a.node.clone()).collect();
    touched.extend(after.keys().map(|(node, _)| node.clone()));
    report.declared = declare(tx, &touched, &after, &modules, &pass.plan).await?;
    report.conditions = conditions::tell(tx, found).await?;
    Ok(report)
}

/// What a reconcile starts from: every node (by id), module and assignment.
struct State {
    nodes: BTreeMap<String, NodeRow>,
    modules: BTreeMap<String, Module>,
    before: Vec<Assignment>,
}

/// Whether node `id` is known and alive.
pub(crate) fn reachable(nodes: &BTreeMap<String, NodeRow>, id: &str) -> bool {
    nodes.get(id).is_some_and(|n| n.state == "alive")
}

/// Load the snapshot a pass works on (inside the fleet lock).
async fn load(tx: &mut PgConnection) -> Result<State, Error> {
    let nodes: Vec<NodeRow> = sqlx::query_as(
        // A refused node (its agent speaks no protocol version this controller
        // does) is not schedulable, like one that is not active.
        "SELECT id, reported_labels, operator_labels, cpus, memory_bytes, state, \
         CASE WHEN refused IS NOT NULL AND admin_state = 'active' THEN 'refused' ELSE admin_state END AS admin_state, \
         drain_blocked FROM inventory.nodes ORDER BY id",
    )
    .fetch_all(&mut *tx)
    .await?;
    let nodes: BTreeMap<String, NodeRow> = nodes.into_iter().map(|n| (n.id.clone(), n)).collect();
    let modules = load_modules(tx).await?;
    let before: Vec<Assignment> = sqlx::query_as(
        "SELECT node, name, module, replica, role, placed_at, unit_state FROM inventory.assignments \
         ORDER BY node, name",
    )
    .fetch_all(&mut *tx)
    .await?;
    Ok(State {
        nodes,
        modules,
        before,
    })
}

/// Surplus: two active copies of one replica (a node came back after its
/// replica was placed elsewhere). The newest placement wins; ties by node id.
fn drop_surplus(after: &mut Assignments) {
    let mut newest: BTreeMap<(String, i32), (DateTime<Utc>, String)> = BTreeMap::new();
    for a in after.values().filter(|a| a.role == ACTIVE) {
        let key = (a.module.clone(), a.replica);
        let candidate = (a.placed_at, a.node.clone());
        let wins = match newest.get(&key) {
            None => true,
            Some((at, node)) => candidate.0 > *at || (candidate.0 == *at && candidate.1 < *node),
        };
        if wins {
            newest.insert(key, candidate);
        }
    }
    after.retain(|_, a| {
        a.role != ACTIVE
            || newest
                .get(&(a.module.clone(), a.replica))
                .is_none_or(|(_, node)| *node == a.node)
    });
}

/// Make-before-break: a retiring copy goes once its replacement runs, or at
/// once if its node is unreachable (it cannot be told) or nothing replaces it.
fn retire_replaced(after: &mut Assignments, nodes: &BTreeMap<String, NodeRow>) {
    let running: BTreeSet<(String, i32)> = after
        .values()
        .filter(|a| a.role == ACTIVE && a.unit_state.as_deref() == Some("running"))
        .map(|a| (a.module.clone(), a.replica))
        .collect();
    let replaced: BTreeSet<(String, i32)> = after
        .values()
        .filter(|a| a.role == ACTIVE)
        .map(|a| (a.module.clone(), a.replica))
        .collect();
    after.retain(|_, a| {
        a.role != RETIRING
            || (reachable(nodes, &a.node)
                && replaced.contains(&(a.module.clone(), a.replica))
                && !running.contains(&(a.module.clone(), a.replica)))
    });
}

/// Authority: observed long enough, and not too many unreachable at once.
/// Returns why placement must not move anything (none: it may), and finds the
/// `replacement_paused` condition.
fn authority(
    nodes: &BTreeMap<String, NodeRow>,
    pass: &Pass,
    found: &mut Found,
    report: &mut ReconcileReport,
) -> Option<String> {
    let counted: Vec<&NodeRow> = nodes
        .values()
        .filter(|n| n.admin_state != "revoked")
        .collect();
    let unreachable = counted.iter().filter(|n| n.state != "alive").count();
    let mut not_authoritative = pass.not_observed.clone();
    if not_authoritative.is_none() && !counted.is_empty() {
        #[allow(clippy::cast_precision_loss)]
        let share = unreachable as f64 / counted.len() as f64;
        if share > pass.max_unreachable_share {
            let reason = format!(
                "{unreachable} of {} nodes are unreachable ({:.0}%, more than {:.0}%): that looks like a partition \
                 or a control-plane problem, not dead machines; automatic re-placement is paused",
                counted.len(),
                share * 100.0,
                pass.max_unreachable_share * 100.0
            );
            found.insert(
                "replacement_paused".into(),
                Condition {
                    kind: "replacement_paused",
                    node: None,
                    module: None,
                    stateful: false,
                    message: reason.clone(),
                },
            );
            report.paused = Some(reason.clone());
            not_authoritative = Some(reason);
        }
    }
    not_authoritative
}

/// Place each module's replicas (pure: `after`, the modules' placement errors
/// and the conditions found change, nothing is written). A moved replica's old copy is
/// retired if its node can be told, dropped if not.
fn place_modules(
    nodes: &BTreeMap<String, NodeRow>,
    modules: &mut BTreeMap<String, Module>,
    after: &mut Assignments,
    not_authoritative: Option<&String>,
    pass: &Pass,
    found: &mut Found,
) {
    // What every node already holds, by module.
    let mut used: BTreeMap<String, Resources> = BTreeMap::new();
    for a in after.values() {
        if let Some(m) = modules.get(&a.module) {
            let u = used.entry(a.node.clone()).or_default();
            *u = u.saturating_add(m.spec.unit.resources);
        }
    }

    let names: Vec<String> = modules.keys().cloned().collect();
    for name in &names {
        let Some(m) = modules.get_mut(name) else {
            continue;
        };
        let replicas = replicas_of(m);
        let resources = m.spec.unit.resources;
        // Scale down: replicas beyond the count go, whatever the snapshot.
        after.retain(|_, a| a.module != *name || replica_u32(a) < replicas);
        let current: Vec<(u32, String)> = after
            .values()
            .filter(|a| a.module == *name && a.role == ACTIVE)
            .map(|a| (replica_u32(a), a.node.clone()))
            .collect();
        let mine: BTreeMap<String, Resources> =
            after
                .values()
                .filter(|a| a.module == *name)
                .fold(BTreeMap::new(), |mut acc, a| {
                    let r: &mut Resources = acc.entry(a.node.clone()).or_default();
                    *r = r.saturating_add(resources);
                    acc
                });
        let snapshot = Snapshot {
            not_authoritative: not_authoritative.cloned(),
            nodes: nodes
                .values()
                .map(|n| NodeFacts {
                    id: n.id.clone(),
                    labels: pass
                        .trust
                        .effective(&n.id, &n.reported_labels.0, &n.operator_labels.0),
                    reachable: n.state == "alive",
                    schedulable: n.admin_state == "active",
                    capacity: Resources {
                        cpu_millis: u64::try_from(n.cpus).unwrap_or(0).saturating_mul(1000),
                        memory_bytes: u64::try_from(n.memory_bytes).unwrap_or(0),
                        pids: 0,
                    },
                    used: used
                        .get(&n.id)
                        .copied()
                        .unwrap_or_default()
                        .saturating_sub(mine.get(&n.id).copied().unwrap_or_default()),
                })
                .collect(),
            controller_node: pass.controller_node.clone(),
        };
        let request = Request {
            placement: &m.spec.placement,
            stateful: m.spec.stateful,
            resources,
            replicas,
            current: &current,
        };
        match place(&request, &snapshot) {
            Ok(targets) => {
                m.placement_error = None;
                for (replica, target) in targets.into_iter().enumerate() {
                    let replica = u32::try_from(replica).unwrap_or(u32::MAX);
                    let old = current
                        .iter()
                        .find(|(r, _)| *r == replica)
                        .map(|(_, n)| n.clone());
                    if old.as_deref() == Some(target.as_str()) {
                        continue;
                    }
                    let unit = unit_name(name, &m.spec.placement, replica);
                    if let Some(old) = old
                        && let Some(a) = after.get_mut(&(old.clone(), unit.clone()))
                    {
                        if reachable(nodes, &old) {
                            a.role = RETIRING.into();
                        } else {
                            after.remove(&(old, unit.clone()));
                        }
                    }
                    let replica_i32 = i32::try_from(replica).unwrap_or(i32::MAX);
                    let entry = after
                        .entry((target.clone(), unit.clone()))
                        .or_insert_with(|| Assignment {
                            node: target.clone(),
                            name: unit.clone(),
                            module: name.clone(),
                            replica: replica_i32,
                            role: ACTIVE.into(),
                            placed_at: pass.now,
                            unit_state: None,
                        });
                    // A retiring copy on the target comes back to life.
                    entry.role = ACTIVE.into();
                    entry.placed_at = pass.now;
                    let u = used.entry(target).or_default();
                    *u = u.saturating_add(resources);
                }
            }
            Err(PlacementError::NotAuthoritative(_)) => {}
            Err(e) => {
                let message = format!("module `{name}` cannot be placed: {e}");
                found.insert(
                    format!("unplaced:{name}"),
                    Condition {
                        kind: "placement_unsatisfied",
                        node: None,
                        module: Some(name.clone()),
                        stateful: m.spec.stateful,
                        message,
                    },
                );
                m.placement_error = Some(e.to_string());
            }
        }
        // A pinned module on an unreachable node is never moved: say so.
        if m.spec.placement.is_pinned() {
            for (_, node) in &current {
                if !reachable(nodes, node) {
                    let what = if m.spec.stateful {
                        "stateful module"
                    } else {
                        "module"
                    };
                    found.insert(
                        format!("pinned_unreachable:{name}"),
                        Condition {
                            kind: "pinned_unreachable",
                            node: Some(node.clone()),
                            module: Some(name.clone()),
                            stateful: m.spec.stateful,
                            message: format!(
                                "{what} `{name}` is pinned to unreachable node `{node}` and is not moved; \
                                 bring the node back, or move the module (change its exact_node) or stop it"
                            ),
                        },
                    );
                }
            }
        }
    }
}

/// Write each module's placement error where it changed.
async fn write_placement_errors(
    tx: &mut PgConnection,
    modules: &BTreeMap<String, Module>,
) -> Result<(), Error> {
    for (name, m) in modules {
        sqlx::query(
            "UPDATE inventory.modules SET placement_error = $2 WHERE name = $1 \
             AND placement_error IS DISTINCT FROM $2",
        )
        .bind(name)
        .bind(&m.placement_error)
        .execute(&mut *tx)
        .await?;
    }
    Ok(())
}

/// Write the assignments that changed (deleted, updated, inserted), counting
/// what was placed and removed.
async fn write_assignments(
    tx: &mut PgConnection,
    before: &[Assignment],
    after: &Assignments,
    report: &mut ReconcileReport,
) -> Result<(), Error> {
    let before_map: BTreeMap<(String, String), &Assignment> = before
        .iter()
        .map(|a| ((a.node.clone(), a.name.clone()), a))
        .collect();
    let (mut del_nodes, mut del_names) = (Vec::new(), Vec::new());
    for key in before_map.keys() {
        if !after.contains_key(key) {
            del_nodes.push(key.0.clone());
            del_names.push(key.1.clone());
        }
    }
    report.removed = del_nodes.len();
    if !del_nodes.is_empty() {
        sqlx::query(
            "DELETE FROM inventory.assignments a USING UNNEST($1::text[], $2::text[]) AS d(node, name) \
             WHERE a.node = d.node AND a.name = d.name",
        )
        .bind(&del_nodes)
        .bind(&del_names)
        .execute(&mut *tx)
        .await?;
    }
    for (key, a) in after {
        match before_map.get(key) {
            Some(b) if *b == a => {}
            Some(b) => {
                if b.placed_at != a.placed_at {
                    report.placed += 1;
                }
                sqlx::query(
                    "UPDATE inventory.assignments SET role = $3, placed_at = $4 WHERE node = $1 AND name = $2",
                )
                .bind(&a.node)
                .bind(&a.name)
                .bind(&a.role)
                .bind(a.placed_at)
                .execute(&mut *tx)
                .await?;
            }
            None => {
                report.placed += 1;
                sqlx::query(
                    "INSERT INTO inventory.assignments (node, name, module, replica, role, placed_at) \
                     VALUES ($1, $2, $3, $4, $5, $6)",
                )
                .bind(&a.node)
                .bind(&a.name)
                .bind(&a.module)
                .bind(a.replica)
                .bind(&a.role)
                .bind(a.placed_at)
                .execute(&mut *tx)
                .await?;
            }
        }
    }
    Ok(())
}

/// What the record is told of one module: the nodes it has assignments on
/// (sorted, once each), its settings files and its ports.
#[derive(Debug, PartialEq)]
struct Placed {
    nodes: Vec<String>,
    settings_files: Vec<SettingsFile>,
    ports: Vec<ModulePort>,
    requires: Vec<Requirement>,
    provides: Vec<Provides>,
}

/// A row of `inventory.module_placements`: what the record was last told.
#[derive(sqlx::FromRow)]
struct PublishedRow {
    module: String,
    nodes: Json<Vec<String>>,
    settings_files: Json<Vec<SettingsFile>>,
    ports: Json<Vec<ModulePort>>,
    requires: Json<Vec<Requirement>>,
    provides: Json<Vec<Provides>>,
}

/// Tell the record where each module runs, level-triggered: every module
/// whose nodes (any assignment role: a replica being replaced keeps its node
/// until its assignment goes, make-before-break) or settings files differ from
/// what was last published (or that was never published) gets
/// `inventory.module.placed`; every published module that is gone gets
/// `inventory.module.removed` once. Versions come from one sequence, so they
/// grow across delete and re-create. A statement each for the whole fleet.
/// Returns how many events were written.
async fn publish_placements(
    tx: &mut PgConnection,
    modules: &BTreeMap<String, Module>,
    after: &Assignments,
) -> Result<usize, Error> {
    let mut desired: BTreeMap<&str, Placed> = modules
        .iter()
        .map(|(name, m)| {
            (
                name.as_str(),
                Placed {
                    nodes: Vec::new(),
                    settings_files: m.spec.settings_files.clone(),
                    ports: m.spec.ports.clone(),
                    requires: m.spec.requires.clone(),
                    provides: m.spec.provides.clone(),
                },
            )
        })
        .collect();
    let mut held: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for a in after.values() {
        held.entry(a.module.as_str())
            .or_default()
            .insert(a.node.as_str());
    }
    for (module, nodes) in held {
        if let Some(p) = desired.get_mut(module) {
            p.nodes = nodes.into_iter().map(str::to_owned).collect();
        }
    }
    let rows: Vec<PublishedRow> = sqlx::query_as(
        "SELECT module, nodes, settings_files, ports, requires, provides \
         FROM inventory.module_placements",
    )
    .fetch_all(&mut *tx)
    .await?;
    let published: BTreeMap<String, Placed> = rows
        .into_iter()
        .map(|r| {
            (
                r.module,
                Placed {
                    nodes: r.nodes.0,
                    settings_files: r.settings_files.0,
                    ports: r.ports.0,
                    requires: r.requires.0,
                    provides: r.provides.0,
                },
            )
        })
        .collect();
    let changed: Vec<(&str, &Placed)> = desired
        .iter()
        .filter(|(name, p)| published.get(**name) != Some(*p))
        .map(|(name, p)| (*name, p))
        .collect();
    let removed: Vec<String> = published
        .keys()
        .filter(|name| !modules.contains_key(*name))
        .cloned()
        .collect();
    let count = changed.len() + removed.len();
    if count == 0 {
        return Ok(0);
    }
    let mut versions: Vec<i64> = sqlx::query_scalar(
        "SELECT nextval('inventory.module_event_version') FROM generate_series(1, $1)",
    )
    .bind(i64::try_from(count).unwrap_or(i64::MAX))
    .fetch_all(&mut *tx)
    .await?;
    versions.sort_unstable();
    let mut versions = versions.into_iter();
    let mut events = Vec::with_capacity(count);
    let (mut names, mut nodes, mut files, mut ports, mut placed_versions) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut requires, mut provides) = (Vec::new(), Vec::new());
    for (name, p) in &changed {
        let version = versions.next().ok_or_else(|| Error::Corrupt {
            node: (*name).to_owned(),
            reason: "the version sequence returned too few values".to_owned(),
        })?;
        let ids = p
            .nodes
            .iter()
            .map(|n| node_id(n))
            .collect::<Result<Vec<_>, _>>()?;
        events.push(RecordEvent::new(RecordKind::ModulePlaced(
            ModulePlacement {
                module: (*name).to_owned(),
                version,
                nodes: ids,
                settings_files: p.settings_files.clone(),
                ports: p.ports.clone(),
                requires: p.requires.clone(),
                provides: p.provides.clone(),
            },
        )));
        names.push((*name).to_owned());
        nodes.push(serde_json::to_string(&p.nodes).unwrap_or_else(|_| "[]".to_owned()));
        files.push(serde_json::to_string(&p.settings_files).unwrap_or_else(|_| "[]".to_owned()));
        ports.push(serde_json::to_string(&p.ports).unwrap_or_else(|_| "[]".to_owned()));
        requires.push(serde_json::to_string(&p.requires).unwrap_or_else(|_| "[]".to_owned()));
        provides.push(serde_json::to_string(&p.provides).unwrap_or_else(|_| "[]".to_owned()));
        placed_versions.push(version);
    }
    for name in &removed {
        let version = versions.next().ok_or_else(|| Error::Corrupt {
            node: name.clone(),
            reason: "the version sequence returned too few values".to_owned(),
        })?;
        events.push(RecordEvent::new(RecordKind::ModuleRemoved(ModuleRemoved {
            module: name.clone(),
            version,
        })));
    }
    if !names.is_empty() {
        sqlx::query(
            "INSERT INTO inventory.module_placements AS p \
                 (module, nodes, settings_files, ports, version, requires, provides) \
             SELECT u.module, u.nodes::jsonb, u.files::jsonb, u.ports::jsonb, u.version, \
                 u.requires::jsonb, u.provides::jsonb \
             FROM UNNEST($1::text[], $2::text[], $3::text[], $4::text[], $5::bigint[], \
                  $6::text[], $7::text[]) \
                  AS u(module, nodes, files, ports, version, requires, provides) \
             ON CONFLICT (module) DO UPDATE SET nodes = excluded.nodes, \
             settings_files = excluded.settings_files, ports = excluded.ports, \
             requires = excluded.requires, provides = excluded.provides, \
             version = excluded.version, published_at = now()",
        )
        .bind(&names)
        .bind(&nodes)
        .bind(&files)
        .bind(&ports)
        .bind(&placed_versions)
        .bind(&requires)
        .bind(&provides)
        .execute(&mut *tx)
        .await?;
    }
    if !removed.is_empty() {
        sqlx::query("DELETE FROM inventory.module_placements WHERE module = ANY($1)")
            .bind(&removed)
            .execute(&mut *tx)
            .await?;
    }
    outbox::record_many(tx, SCHEMA, &events).await?;
    Ok(count)
}

/// The units `node` runs: per assignment, the revision the module's targets
/// name for the node (its artifact and revision id with it), else the
/// module's own spec; the desired state, user, limits and stateful flag are
/// always the module's ([`crate::module::ModuleSpec::runs`]).
fn units_of(
    node: &str,
    assignments: &BTreeMap<(String, String), Assignment>,
    modules: &BTreeMap<String, Module>,
    plan: &Carried,
) -> DeclarationItems {
    let mut items = plan.bare();
    let held = assignments
        .range((node.to_owned(), String::new())..)
        .take_while(|((n, _), _)| n == node);
    for (_, a) in held {
        if let Some(m) = modules.get(&a.module) {
            items
                .units
                .push(m.spec.runs(&a.module, &a.name, m.targets.of(node)));
        }
    }
    items
}

fn node_id(node: &str) -> Result<NodeId, Error> {
    NodeId::parse(node).map_err(|e| Error::Corrupt {
        node: node.to_owned(),
        reason: e.to_string(),
    })
}

/// Hand the inventory section of each node of `touched` to the section
/// component, which declares a new generation where the units changed.
async fn declare(
    tx: &mut PgConnection,
    touched: &BTreeSet<String>,
    after: &BTreeMap<(String, String), Assignment>,
    modules: &BTreeMap<String, Module>,
    plan: &Carried,
) -> Result<usize, Error> {
    let mut desired = Vec::with_capacity(touched.len());
    for node in touched {
        let items = Items::new(units_of(node, after, modules, plan))?;
        desired.push((node_id(node)?, items));
    }
    Ok(SECTIONS.declare(tx, desired).await?.declared)
}

/// Keep `delivery.module.targets` (`targets.rs`) under the fleet lock, and
/// declare the inventory section of every node holding the module whose
/// revision changed (the declarations commit with the targets). Returns how
/// many nodes a new generation was declared to.
pub(crate) async fn retarget(
    tx: &mut PgConnection,
    body: &ModuleTargets,
    plan: &Carried,
) -> Result<usize, Error> {
    lock(tx).await?;
    let changed = crate::targets::record(tx, body).await?;
    if changed.is_empty() {
        return Ok(0);
    }
    declare_holders(tx, &body.module, &changed, plan).await
}

/// Declare the inventory section of each node of `nodes` that holds an
/// assignment of `module`, from the assignments as they stand (no placement):
/// what a change of the module's targets declares. The caller holds the
/// fleet lock. Returns how many nodes a new generation was declared to.
pub(crate) async fn declare_holders(
    tx: &mut PgConnection,
    module: &str,
    nodes: &BTreeSet<String>,
    plan: &Carried,
) -> Result<usize, Error> {
    let nodes: Vec<&str> = nodes.iter().map(String::as_str).collect();
    let held: Vec<Assignment> = sqlx::query_as(
        "SELECT node, name, module, replica, role, placed_at, unit_state FROM inventory.assignments \
         WHERE node = ANY($1) ORDER BY node, name",
    )
    .bind(&nodes)
    .fetch_all(&mut *tx)
    .await?;
    let touched: BTreeSet<String> = held
        .iter()
        .filter(|a| a.module == module)
        .map(|a| a.node.clone())
        .collect();
    if touched.is_empty() {
        return Ok(0);
    }
    let held: Assignments = held
        .into_iter()
        .map(|a| ((a.node.clone(), a.name.clone()), a))
        .collect();
    let modules = load_modules(tx).await?;
    declare(tx, &touched, &held, &modules, plan).await
}

/// The inventory section every node should hold now, from the assignments as
/// they stand (no placement): what the periodic resync compares with what is
/// stored. Takes the fleet reconcile's lock.
pub(crate) async fn desired_sections(
    tx: &mut PgConnection,
    plan: &Carried,
) -> Result<Vec<(NodeId, Items)>, Error> {
    lock(tx).await?;
    let modules = load_modules(tx).await?;
    let assignments: Vec<Assignment> = sqlx::query_as(
        "SELECT node, name, module, replica, role, placed_at, unit_state FROM inventory.assignments \
         ORDER BY node, name",
    )
    .fetch_all(&mut *tx)
    .await?;
    let assignments: BTreeMap<(String, String), Assignment> = assignments
        .into_iter()
        .map(|a| ((a.node.clone(), a.name.clone()), a))
        .collect();
    // A refused agent is declared nothing until it says hello in a protocol
    // this controller speaks (decision 0020): not even what every node's
    // section carries.
    let nodes: Vec<String> =
        sqlx::query_scalar("SELECT id FROM inventory.nodes WHERE refused IS NULL ORDER BY id")
            .fetch_all(&mut *tx)
            .await?;
    // Nodes that run nothing share one computed section.
    let none = Items::new(plan.bare())?;
    let mut desired = Vec::with_capacity(nodes.len());
    for node in nodes {
        let units = units_of(&node, &assignments, &modules, plan);
        let items = if units.units.is_empty() {
            none.clone()
        } else {
            Items::new(units)?
        };
        desired.push((node_id(&node)?, items));
    }
    Ok(desired)
}
