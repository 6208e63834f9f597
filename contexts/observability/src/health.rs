//! Health, derived (pure: no I/O, no clock): of each replica from its unit's
//! state and its probes, of each module from its replicas, of each node from
//! its liveness and the replicas it runs.
//!
//! - A replica is **unknown** while its node is unreachable or revoked, its
//!   unit has not been reported or is starting, or a probe has not decided;
//!   **unhealthy** when its unit failed or exited, or a probe is unhealthy;
//!   **healthy** when its unit runs and every probe (if it has any) is healthy.
//! - A module is **unknown** with no replica or none decided, **healthy** when
//!   every replica is, **down** when none is healthy and one is unhealthy,
//!   **degraded** otherwise.
//! - A node is **unknown** while unreachable or revoked, **degraded** when a
//!   replica on it is unhealthy, **healthy** otherwise.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use mesh_protocol::HealthState;
use serde::{Deserialize, Serialize};

/// A node as observability knows it from the record.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct NodeRow {
    pub state: String,
    pub revoked: bool,
    pub unreachable_since: Option<DateTime<Utc>>,
}

impl NodeRow {
    fn heard(&self) -> bool {
        self.state == "alive" && !self.revoked
    }
}

/// A unit as its node reported it last.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct UnitRow {
    pub node: String,
    pub unit: String,
    pub module: String,
    pub state: String,
    pub restarts: i64,
}

/// One probe's result as its node stated it last.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ProbeView {
    pub probe: String,
    /// `unknown`, `healthy` or `unhealthy`.
    pub state: String,
    /// When the state last changed on the node.
    pub since: DateTime<Utc>,
    pub checked_at: Option<DateTime<Utc>>,
    /// Failures in a row.
    pub failures: i64,
    /// The last check's outcome in words (`HTTP 503`, `connection refused`).
    pub detail: Option<String>,
}

/// A probe row with what it belongs to.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ProbeRow {
    pub node: String,
    pub unit: String,
    pub view: ProbeView,
}

/// One replica's health, with the unit state and probe results that decided it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ReplicaView {
    pub node: String,
    pub unit: String,
    pub module: String,
    pub health: HealthState,
    /// The unit's state as its node reported it (none: not reported yet).
    pub unit_state: Option<String>,
    /// Why it is not healthy, in words (none when healthy).
    pub reason: Option<String>,
    pub probes: Vec<ProbeView>,
}

/// A module's health and its replicas'.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ModuleHealthView {
    pub module: String,
    pub health: HealthState,
    pub replicas: Vec<ReplicaView>,
}

/// A node's health and the replicas it runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct NodeHealthView {
    pub node: String,
    /// `alive` or `unreachable`, as inventory judged it.
    pub state: String,
    pub revoked: bool,
    pub health: HealthState,
    pub replicas: Vec<ReplicaView>,
}

/// What health is derived from.
#[derive(Debug, Default)]
pub(crate) struct Inputs {
    pub nodes: BTreeMap<String, NodeRow>,
    /// Module → the nodes it has assignments on (removed modules absent).
    pub modules: BTreeMap<String, Vec<String>>,
    pub units: Vec<UnitRow>,
    pub probes: Vec<ProbeRow>,
}

/// Every module's and node's health, modules and nodes in name order.
pub(crate) fn derive(inputs: &Inputs) -> (Vec<ModuleHealthView>, Vec<NodeHealthView>) {
    let mut probes: BTreeMap<(&str, &str), Vec<ProbeView>> = BTreeMap::new();
    for p in &inputs.probes {
        probes
            .entry((p.node.as_str(), p.unit.as_str()))
            .or_default()
            .push(p.view.clone());
    }
    let mut units: BTreeMap<(&str, &str), Vec<&UnitRow>> = BTreeMap::new();
    for u in &inputs.units {
        units
            .entry((u.module.as_str(), u.node.as_str()))
            .or_default()
            .push(u);
    }
    let mut modules = Vec::with_capacity(inputs.modules.len());
    let mut by_node: BTreeMap<String, Vec<ReplicaView>> = BTreeMap::new();
    for (module, nodes) in &inputs.modules {
        let mut replicas = Vec::new();
        for node in nodes {
            let row = inputs.nodes.get(node);
            match units.get(&(module.as_str(), node.as_str())) {
                Some(list) => {
                    for u in list {
                        let p = probes
                            .get(&(node.as_str(), u.unit.as_str()))
                            .cloned()
                            .unwrap_or_default();
                        replicas.push(replica(row, node, &u.unit, module, Some(&u.state), p));
                    }
                }
                None => replicas.push(replica(row, node, module, module, None, Vec::new())),
            }
        }
        let health = module_health(&replicas);
        for r in &replicas {
            by_node.entry(r.node.clone()).or_default().push(r.clone());
        }
        modules.push(ModuleHealthView {
            module: module.clone(),
            health,
            replicas,
        });
    }
    let nodes = inputs
        .nodes
        .iter()
        .map(|(node, row)| {
            let replicas = by_node.remove(node.as_str()).unwrap_or_default();
            let health = if !row.heard() {
                HealthState::Unknown
            } else if replicas.iter().any(|r| r.health == HealthState::Unhealthy) {
                HealthState::Degraded
            } else {
                HealthState::Healthy
            };
            NodeHealthView {
                node: node.clone(),
                state: row.state.clone(),
                revoked: row.revoked,
                health,
                replicas,
            }
        })
        .collect();
    (modules, nodes)
}

fn replica(
    node_row: Option<&NodeRow>,
    node: &str,
    unit: &str,
    module: &str,
    unit_state: Option<&str>,
    probes: Vec<ProbeView>,
) -> ReplicaView {
    let (health, reason) = replica_health(node_row, node, unit_state, &probes);
    ReplicaView {
        node: node.to_owned(),
        unit: unit.to_owned(),
        module: module.to_owned(),
        health,
        unit_state: unit_state.map(str::to_owned),
        reason,
        probes,
    }
}

fn replica_health(
    node_row: Option<&NodeRow>,
    node: &str,
    unit_state: Option<&str>,
    probes: &[ProbeView],
) -> (HealthState, Option<String>) {
    match node_row {
        Some(n) if n.revoked => {
            return (
                HealthState::Unknown,
                Some(format!("node `{node}` is revoked")),
            );
        }
        Some(n) if !n.heard() => {
            return (
                HealthState::Unknown,
                Some(format!("node `{node}` is unreachable")),
            );
        }
        _ => {}
    }
    match unit_state {
        None => {
            return (
                HealthState::Unknown,
                Some("the unit is not reported yet".into()),
            );
        }
        Some("running") => {}
        Some("starting") => return (HealthState::Unknown, Some("the unit is starting".into())),
        Some(other) => return (HealthState::Unhealthy, Some(format!("the unit is {other}"))),
    }
    let failing: Vec<String> = probes
        .iter()
        .filter(|p| p.state == "unhealthy")
        .map(|p| match &p.detail {
            Some(d) => format!("probe `{}`: {d}", p.probe),
            None => format!("probe `{}` failed", p.probe),
        })
        .collect();
    if !failing.is_empty() {
        return (HealthState::Unhealthy, Some(failing.join("; ")));
    }
    let undecided: Vec<&str> = probes
        .iter()
        .filter(|p| p.state != "healthy")
        .map(|p| p.probe.as_str())
        .collect();
    if !undecided.is_empty() {
        return (
            HealthState::Unknown,
            Some(format!("probes not decided yet: {}", undecided.join(", "))),
        );
    }
    (HealthState::Healthy, None)
}

fn module_health(replicas: &[ReplicaView]) -> HealthState {
    let count = |h: HealthState| replicas.iter().filter(|r| r.health == h).count();
    let (healthy, unhealthy) = (count(HealthState::Healthy), count(HealthState::Unhealthy));
    if replicas.is_empty() || (healthy == 0 && unhealthy == 0) {
        HealthState::Unknown
    } else if healthy == replicas.len() {
        HealthState::Healthy
    } else if healthy == 0 {
        HealthState::Down
    } else {
        HealthState::Degraded
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alive() -> NodeRow {
        NodeRow {
            state: "alive".into(),
            revoked: false,
            unreachable_since: None,
        }
    }

    fn unit(node: &str, unit: &str, state: &str) -> UnitRow {
        UnitRow {
            node: node.into(),
            unit: unit.into(),
            module: "web".into(),
            state: state.into(),
            restarts: 0,
        }
    }

    fn probe(node: &str, unit: &str, state: &str) -> ProbeRow {
        ProbeRow {
            node: node.into(),
            unit: unit.into(),
            view: ProbeView {
                probe: "ready".into(),
                state: state.into(),
                since: DateTime::<Utc>::UNIX_EPOCH,
                checked_at: None,
                failures: 0,
                detail: Some("HTTP 503".into()),
            },
        }
    }

    fn inputs() -> Inputs {
        Inputs {
            nodes: [("a".to_owned(), alive()), ("b".to_owned(), alive())].into(),
            modules: [("web".to_owned(), vec!["a".to_owned(), "b".to_owned()])].into(),
            units: vec![unit("a", "web-0", "running"), unit("b", "web-1", "running")],
            probes: vec![
                probe("a", "web-0", "healthy"),
                probe("b", "web-1", "healthy"),
            ],
        }
    }

    #[test]
    fn one_failing_probe_degrades_the_module_and_its_node() {
        let mut i = inputs();
        let (m, _) = derive(&i);
        assert_eq!(m[0].health, HealthState::Healthy);
        i.probes[0] = probe("a", "web-0", "unhealthy");
        let (m, n) = derive(&i);
        assert_eq!(m[0].health, HealthState::Degraded);
        assert_eq!(m[0].replicas[0].health, HealthState::Unhealthy);
        assert_eq!(
            m[0].replicas[0].reason.as_deref(),
            Some("probe `ready`: HTTP 503")
        );
        assert_eq!(n[0].health, HealthState::Degraded);
        assert_eq!(n[1].health, HealthState::Healthy);
        i.probes[1] = probe("b", "web-1", "unhealthy");
        assert_eq!(derive(&i).0[0].health, HealthState::Down);
    }

    #[test]
    fn an_unreachable_node_makes_its_replica_unknown_not_unhealthy() {
        let mut i = inputs();
        i.nodes.get_mut("b").unwrap().state = "unreachable".into();
        let (m, n) = derive(&i);
        assert_eq!(m[0].replicas[1].health, HealthState::Unknown);
        assert_eq!(m[0].health, HealthState::Degraded);
        assert_eq!(n[1].health, HealthState::Unknown);
    }

    #[test]
    fn without_probes_a_running_unit_is_healthy_and_a_failed_one_is_not() {
        let mut i = inputs();
        i.probes.clear();
        assert_eq!(derive(&i).0[0].health, HealthState::Healthy);
        i.units[1].state = "failed".into();
        let (m, _) = derive(&i);
        assert_eq!(m[0].replicas[1].health, HealthState::Unhealthy);
        assert_eq!(m[0].health, HealthState::Degraded);
    }

    #[test]
    fn a_module_with_nothing_reported_is_unknown() {
        let mut i = inputs();
        i.units.clear();
        i.probes.clear();
        let (m, _) = derive(&i);
        assert_eq!(m[0].health, HealthState::Unknown);
        assert_eq!(m[0].replicas.len(), 2);
    }
}
