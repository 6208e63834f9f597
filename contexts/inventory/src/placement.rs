//! Placement and the intent resolver: pure functions, no I/O.
//!
//! [`place`] decides on which nodes a module's replicas run, from the module and
//! an authoritative snapshot of the nodes (design rule 9):
//!
//! - **Fails closed.** A snapshot that is not authoritative (the controller has
//!   not yet observed the fleet for a full grace period, or too large a share of
//!   it is unreachable at once) gives [`PlacementError::NotAuthoritative`]; the
//!   caller then changes nothing.
//! - **Never partial.** `Ok` holds exactly one node per replica, all distinct (one
//!   replica per node); if too few nodes fit, it is
//!   [`PlacementError::Unsatisfied`] and no replica is placed.
//! - **Deterministic and stable.** The same input gives the same output. A current
//!   replica stays where it is while its node is still eligible; missing replicas
//!   go to eligible nodes in ascending node-id order. A node joining never moves a
//!   running replica.
//! - **Eligible** means reachable (alive), schedulable (not draining, drained or
//!   revoked), labels containing the selector, and capacity for the module's
//!   requests (node capacity minus what other modules already hold there).
//! - **Pinned placements never move.** `exact_node` (the only placement a stateful
//!   module may have) and `controller_node` name one node; a replica already there
//!   stays there even while the node is unreachable or draining.

use std::collections::{BTreeMap, BTreeSet};

use mesh_protocol::{Labels, NodeId};
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Resource requests of one replica, or what a node offers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Resources {
    /// Thousandths of a CPU (a node offers `cpus × 1000`). Default 0.
    #[serde(default)]
    pub cpu_millis: u64,
    /// Bytes of memory. Default 0.
    #[serde(default)]
    pub memory_bytes: u64,
    /// Processes and threads one replica may have (its cgroup's `pids.max`).
    /// A limit only, never a request: placement ignores it, and a node offers
    /// none. Default 0: the agent's default limit.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub pids: u64,
}

/// The largest CPU limit a unit may declare (1024 cores), as agents check it.
pub const MAX_CPU_MILLIS: u64 = 1_024_000;

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl Resources {
    /// Sums of requests; `pids` is not a request and is not summed.
    pub fn saturating_add(self, other: Resources) -> Resources {
        Resources {
            cpu_millis: self.cpu_millis.saturating_add(other.cpu_millis),
            memory_bytes: self.memory_bytes.saturating_add(other.memory_bytes),
            pids: 0,
        }
    }

    pub fn saturating_sub(self, other: Resources) -> Resources {
        Resources {
            cpu_millis: self.cpu_millis.saturating_sub(other.cpu_millis),
            memory_bytes: self.memory_bytes.saturating_sub(other.memory_bytes),
            pids: 0,
        }
    }

    /// The unit's limits: each request is also the replica's limit (its
    /// cgroup's CPU quota and memory maximum), and `pids` its process limit;
    /// 0 is no limit. A CPU or memory request below the smallest limit an
    /// agent enforces (or CPU above the largest) is limited at that bound, so
    /// a module stored before limits existed is never declared a unit its
    /// agents would refuse. `pids` is checked where it is written
    /// ([`crate::module::ModuleSpec::validate`]).
    pub fn limits(&self) -> mesh_protocol::UnitLimits {
        use mesh_protocol::{MIN_CPU_MILLIS, MIN_MEMORY_BYTES};
        let some = |n: u64| (n > 0).then_some(n);
        mesh_protocol::UnitLimits {
            cpu_millis: some(self.cpu_millis).map(|c| c.clamp(MIN_CPU_MILLIS, MAX_CPU_MILLIS)),
            memory_bytes: some(self.memory_bytes).map(|m| m.max(MIN_MEMORY_BYTES)),
            pids: some(self.pids),
        }
    }

    /// Whether `request` fits in what is left of `self` after `used`
    /// (CPU and memory; `pids` is a limit only).
    pub fn fits(self, used: Resources, request: Resources) -> bool {
        let left = self.saturating_sub(used);
        request.cpu_millis <= left.cpu_millis && request.memory_bytes <= left.memory_bytes
    }
}

/// Where a module runs: exactly one variant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Placement {
    /// One replica pinned to one node. The only placement of a stateful module.
    ExactNode { node: NodeId },
    /// `replicas` (the user intent layer) on nodes whose labels contain every pair
    /// of `labels` (`{}` matches every node), one per node.
    MatchLabels {
        #[serde(default)]
        labels: Labels,
        #[serde(default = "one")]
        replicas: u32,
    },
    /// One replica on the node the controller runs on (setting `controller_node`).
    ControllerNode {},
}

fn one() -> u32 {
    1
}

impl Placement {
    /// Exact and controller placements name one node and never move by themselves.
    pub fn is_pinned(&self) -> bool {
        !matches!(self, Placement::MatchLabels { .. })
    }
}

/// One node as placement sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeFacts {
    pub id: String,
    /// Effective labels.
    pub labels: Labels,
    /// Alive (heard from within the grace).
    pub reachable: bool,
    /// Not draining, drained or revoked.
    pub schedulable: bool,
    pub capacity: Resources,
    /// Requests of the replicas of *other* modules assigned to the node.
    pub used: Resources,
}

impl NodeFacts {
    fn eligible(&self) -> bool {
        self.reachable && self.schedulable
    }
}

/// What placement decides from: the nodes and whether they may be trusted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// `None`: authoritative. `Some(reason)`: not, and why.
    pub not_authoritative: Option<String>,
    pub nodes: Vec<NodeFacts>,
    /// The node the controller runs on (for `controller_node`), if configured.
    pub controller_node: Option<String>,
}

/// One module as placement needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request<'a> {
    pub placement: &'a Placement,
    pub stateful: bool,
    /// Requests of one replica.
    pub resources: Resources,
    /// Effective replicas ([`effective_replicas`]); pinned placements run one.
    pub replicas: u32,
    /// Where replicas are now: (replica, node).
    pub current: &'a [(u32, String)],
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PlacementError {
    #[error("the node snapshot is not authoritative: {0}")]
    NotAuthoritative(String),
    #[error("a stateful module must use placement exact_node")]
    StatefulNotPinned,
    #[error("node `{0}` is not known")]
    UnknownNode(String),
    #[error("placement controller_node, but the controller's node is not configured")]
    NoControllerNode,
    #[error("node `{node}` cannot take it: {reason}")]
    PinnedUnavailable { node: String, reason: String },
    #[error("needs {needed} eligible nodes, {fit} fit")]
    Unsatisfied { needed: u32, fit: u32 },
}

impl PlacementError {
    pub fn metric_label(&self) -> &'static str {
        match self {
            PlacementError::NotAuthoritative(_) => "not_authoritative",
            PlacementError::StatefulNotPinned => "stateful_not_pinned",
            PlacementError::UnknownNode(_) => "unknown_node",
            PlacementError::NoControllerNode => "no_controller_node",
            PlacementError::PinnedUnavailable { .. } => "pinned_unavailable",
            PlacementError::Unsatisfied { .. } => "unsatisfied",
        }
    }
}

/// The node of each replica (index = replica), or why none can be given.
pub fn place(request: &Request<'_>, snapshot: &Snapshot) -> Result<Vec<String>, PlacementError> {
    if let Some(reason) = &snapshot.not_authoritative {
        return Err(PlacementError::NotAuthoritative(reason.clone()));
    }
    // One entry per id, in id order (the first of duplicates wins).
    let mut nodes: BTreeMap<&str, &NodeFacts> = BTreeMap::new();
    for n in &snapshot.nodes {
        nodes.entry(n.id.as_str()).or_insert(n);
    }
    let pinned = match request.placement {
        Placement::ExactNode { node } => Some(node.as_str().to_owned()),
        Placement::ControllerNode {} => Some(
            snapshot
                .controller_node
                .clone()
                .ok_or(PlacementError::NoControllerNode)?,
        ),
        Placement::MatchLabels { .. } => None,
    };
    if request.stateful && !matches!(request.placement, Placement::ExactNode { .. }) {
        return Err(PlacementError::StatefulNotPinned);
    }
    if let Some(target) = pinned {
        let Some(node) = nodes.get(target.as_str()) else {
            return Err(PlacementError::UnknownNode(target));
        };
        // Already there: stays, whatever the node's state (never moves).
        if request.current.iter().any(|(r, n)| *r == 0 && *n == target) {
            return Ok(vec![target]);
        }
        let reason = if !node.reachable {
            Some("it is unreachable".to_owned())
        } else if !node.schedulable {
            Some("it is draining, drained or revoked".to_owned())
        } else if !node.capacity.fits(node.used, request.resources) {
            Some("not enough free capacity for the module's requests".to_owned())
        } else {
            None
        };
        return match reason {
            Some(reason) => Err(PlacementError::PinnedUnavailable {
                node: target,
                reason,
            }),
            None => Ok(vec![target]),
        };
    }
    let Placement::MatchLabels { labels, .. } = request.placement else {
        return Err(PlacementError::NoControllerNode);
    };
    let wanted = request.replicas;
    let matches = |n: &NodeFacts| {
        n.eligible()
            && labels
                .iter()
                .all(|(k, v)| n.labels.get(k).is_some_and(|x| x == v))
    };
    let mut result: Vec<Option<String>> = vec![None; usize::try_from(wanted).unwrap_or(0)];
    let mut taken: BTreeSet<&str> = BTreeSet::new();
    // Keep current replicas on nodes that are still eligible (lowest replica first).
    let mut current: Vec<&(u32, String)> = request.current.iter().collect();
    current.sort();
    for (replica, node) in current {
        let Some(slot) = result.get_mut(usize::try_from(*replica).unwrap_or(usize::MAX)) else {
            continue;
        };
        if slot.is_some() || taken.contains(node.as_str()) {
            continue;
        }
        if let Some(facts) = nodes.get(node.as_str())
            && matches(facts)
        {
            taken.insert(facts.id.as_str());
            *slot = Some(facts.id.clone());
        }
    }
    let kept = u32::try_from(taken.len()).unwrap_or(u32::MAX);
    // Fill the rest from eligible nodes with room, in node-id order.
    let free: Vec<String> = nodes
        .values()
        .filter(|n| {
            !taken.contains(n.id.as_str())
                && matches(n)
                && n.capacity.fits(n.used, request.resources)
        })
        .map(|n| n.id.clone())
        .collect();
    let missing = result.iter().filter(|s| s.is_none()).count();
    let unsatisfied = || PlacementError::Unsatisfied {
        needed: wanted,
        fit: kept.saturating_add(u32::try_from(free.len()).unwrap_or(u32::MAX)),
    };
    if free.len() < missing {
        return Err(unsatisfied());
    }
    let mut next = free.iter().cloned();
    result
        .into_iter()
        .map(|slot| slot.or_else(|| next.next()))
        .collect::<Option<Vec<String>>>()
        .ok_or_else(unsatisfied)
}

/// Policy bounds (the `policy` intent layer).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Bounds {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max: Option<u32>,
}

/// The intent layers of a module's replica count, each with its own writer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Intent {
    /// The operator's count (the module's `placement.match_labels.replicas`).
    pub user: Option<u32>,
    /// Bounds an organisation's policy puts on the count.
    pub policy: Option<Bounds>,
    /// What an autoscaler recommends.
    pub autoscaler: Option<u32>,
}

/// The effective replica count: the larger of the user's and the autoscaler's
/// (absent counts as 0), clamped into the policy bounds. If the bounds cross
/// (min > max, which the API refuses) `max` wins: fewer replicas is the safe side.
pub fn effective_replicas(intent: &Intent) -> u32 {
    let wanted = intent.user.unwrap_or(0).max(intent.autoscaler.unwrap_or(0));
    let bounds = intent.policy.unwrap_or_default();
    let floored = bounds.min.map_or(wanted, |min| wanted.max(min));
    bounds.max.map_or(floored, |max| floored.min(max))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn node(id: &str, l: &[(&str, &str)]) -> NodeFacts {
        NodeFacts {
            id: id.to_owned(),
            labels: labels(l),
            reachable: true,
            schedulable: true,
            capacity: Resources {
                cpu_millis: 4000,
                memory_bytes: 8 << 30,
                pids: 0,
            },
            used: Resources::default(),
        }
    }

    fn snapshot(nodes: Vec<NodeFacts>) -> Snapshot {
        Snapshot {
            not_authoritative: None,
            nodes,
            controller_node: Some("c".into()),
        }
    }

    fn web(replicas: u32) -> Placement {
        Placement::MatchLabels {
            labels: labels(&[("role", "web")]),
            replicas,
        }
    }

    fn req<'a>(p: &'a Placement, replicas: u32, current: &'a [(u32, String)]) -> Request<'a> {
        Request {
            placement: p,
            stateful: false,
            resources: Resources::default(),
            replicas,
            current,
        }
    }

    #[test]
    fn resolver_clamps_the_larger_of_user_and_autoscaler() {
        let i = |user, min, max, auto| Intent {
            user,
            policy: Some(Bounds { min, max }),
            autoscaler: auto,
        };
        assert_eq!(effective_replicas(&Intent::default()), 0);
        assert_eq!(effective_replicas(&i(Some(3), None, None, None)), 3);
        assert_eq!(effective_replicas(&i(Some(3), None, None, Some(5))), 5);
        assert_eq!(effective_replicas(&i(Some(6), None, None, Some(5))), 6);
        assert_eq!(effective_replicas(&i(Some(3), None, Some(4), Some(5))), 4);
        assert_eq!(effective_replicas(&i(Some(1), Some(2), None, None)), 2);
        assert_eq!(effective_replicas(&i(None, Some(2), Some(3), Some(9))), 3);
        // Crossed bounds: max wins.
        assert_eq!(effective_replicas(&i(Some(5), Some(4), Some(2), None)), 2);
    }

    #[test]
    fn spreads_in_node_order_and_keeps_current() {
        let nodes = vec![
            node("d", &[("role", "web")]),
            node("b", &[("role", "web")]),
            node("a", &[("role", "db")]),
            node("c", &[("role", "web")]),
        ];
        let s = snapshot(nodes);
        let p = web(2);
        assert_eq!(place(&req(&p, 2, &[]), &s).unwrap(), vec!["b", "c"]);
        let current = vec![(0, "d".to_owned())];
        assert_eq!(place(&req(&p, 2, &current), &s).unwrap(), vec!["d", "b"]);
        assert_eq!(
            place(&req(&p, 4, &[]), &s).unwrap_err(),
            PlacementError::Unsatisfied { needed: 4, fit: 3 }
        );
    }

    #[test]
    fn fails_closed_without_authority() {
        let mut s = snapshot(vec![node("a", &[("role", "web")])]);
        s.not_authoritative = Some("starting".into());
        let p = web(1);
        assert!(matches!(
            place(&req(&p, 1, &[]), &s),
            Err(PlacementError::NotAuthoritative(_))
        ));
    }

    #[test]
    fn unreachable_draining_and_full_nodes_are_skipped() {
        let mut a = node("a", &[("role", "web")]);
        a.reachable = false;
        let mut b = node("b", &[("role", "web")]);
        b.schedulable = false;
        let mut c = node("c", &[("role", "web")]);
        c.used = c.capacity;
        let d = node("d", &[("role", "web")]);
        let s = snapshot(vec![a, b, c, d]);
        let p = web(1);
        let current = vec![(0, "a".to_owned())];
        let mut r = req(&p, 1, &current);
        r.resources.cpu_millis = 1000;
        assert_eq!(place(&r, &s).unwrap(), vec!["d"]);
        // Without requests, a full node still takes one (nothing to fit).
        assert_eq!(place(&req(&p, 1, &current), &s).unwrap(), vec!["c"]);
    }

    #[test]
    fn pinned_stays_put() {
        let mut a = node("a", &[]);
        a.reachable = false;
        let s = snapshot(vec![a, node("c", &[])]);
        let p = Placement::ExactNode {
            node: NodeId::parse("a").unwrap(),
        };
        let current = vec![(0, "a".to_owned())];
        let mut r = req(&p, 1, &current);
        r.stateful = true;
        assert_eq!(place(&r, &s).unwrap(), vec!["a"]);
        r.current = &[];
        assert!(matches!(
            place(&r, &s),
            Err(PlacementError::PinnedUnavailable { .. })
        ));
        let c = Placement::ControllerNode {};
        assert_eq!(place(&req(&c, 1, &[]), &s).unwrap(), vec!["c"]);
        let mut stateful = req(&c, 1, &[]);
        stateful.stateful = true;
        assert_eq!(
            place(&stateful, &s).unwrap_err(),
            PlacementError::StatefulNotPinned
        );
    }

    #[test]
    fn placement_json_is_one_variant() {
        let p: Placement =
            serde_json::from_str(r#"{"match_labels": {"labels": {"role": "web"}}}"#).unwrap();
        assert_eq!(p, web(1));
        let p: Placement = serde_json::from_str(r#"{"controller_node": {}}"#).unwrap();
        assert_eq!(p, Placement::ControllerNode {});
        assert!(
            serde_json::from_str::<Placement>(
                r#"{"controller_node": {}, "exact_node": {"node": "a"}}"#
            )
            .is_err()
        );
        assert!(serde_json::from_str::<Placement>(r#"{"exact_node": {"node": "A_"}}"#).is_err());
        assert!(
            serde_json::from_str::<Placement>(r#"{"exact_node": {"node": "a", "x": 1}}"#).is_err()
        );
    }

    // Property tests ---------------------------------------------------------

    fn arb_node() -> impl Strategy<Value = NodeFacts> {
        (
            0u8..8,
            prop::sample::select(vec!["web", "db"]),
            any::<bool>(),
            any::<bool>(),
            0u64..4,
            0u64..4,
        )
            .prop_map(|(id, role, reachable, schedulable, cap, used)| NodeFacts {
                id: format!("n{id}"),
                labels: labels(&[("role", role)]),
                reachable,
                schedulable,
                capacity: Resources {
                    cpu_millis: cap * 1000,
                    memory_bytes: cap << 30,
                    pids: 0,
                },
                used: Resources {
                    cpu_millis: used * 1000,
                    memory_bytes: used << 30,
                    pids: 0,
                },
            })
    }

    fn arb_placement() -> impl Strategy<Value = Placement> {
        prop_oneof![
            (0u8..8).prop_map(|n| Placement::ExactNode {
                node: NodeId::parse(&format!("n{n}")).unwrap()
            }),
            (prop::sample::select(vec!["web", "db", ""]), 0u32..6).prop_map(|(role, replicas)| {
                Placement::MatchLabels {
                    labels: if role.is_empty() {
                        Labels::new()
                    } else {
                        labels(&[("role", role)])
                    },
                    replicas,
                }
            }),
            Just(Placement::ControllerNode {}),
        ]
    }

    prop_compose! {
        fn arb_case()(
            nodes in prop::collection::vec(arb_node(), 0..8),
            placement in arb_placement(),
            stateful in any::<bool>(),
            cpu in 0u64..3,
            authoritative in prop::sample::select(vec![true, true, true, false]),
            controller in prop::option::of(0u8..8),
            current in prop::collection::vec((0u32..6, 0u8..8), 0..5),
        ) -> (Snapshot, Placement, bool, Resources, Vec<(u32, String)>) {
            let snapshot = Snapshot {
                not_authoritative: (!authoritative).then(|| "starting".to_owned()),
                nodes,
                controller_node: controller.map(|c| format!("n{c}")),
            };
            let current = current.into_iter().map(|(r, n)| (r, format!("n{n}"))).collect();
            (snapshot, placement, stateful, Resources { cpu_millis: cpu * 1000, memory_bytes: 0, pids: 0 }, current)
        }
    }

    fn replicas_of(p: &Placement) -> u32 {
        match p {
            Placement::MatchLabels { replicas, .. } => *replicas,
            _ => 1,
        }
    }

    proptest! {
        #[test]
        fn same_input_same_output((s, p, stateful, res, current) in arb_case()) {
            let r = Request { placement: &p, stateful, resources: res, replicas: replicas_of(&p), current: &current };
            prop_assert_eq!(place(&r, &s), place(&r, &s.clone()));
            // The order nodes are listed in does not matter (ids unique).
            let mut unique = s.clone();
            let mut seen = BTreeSet::new();
            unique.nodes.retain(|n| seen.insert(n.id.clone()));
            let mut reversed = unique.clone();
            reversed.nodes.reverse();
            prop_assert_eq!(place(&r, &unique), place(&r, &reversed));
        }

        #[test]
        fn never_partial_and_one_per_node((s, p, stateful, res, current) in arb_case()) {
            let replicas = replicas_of(&p);
            let r = Request { placement: &p, stateful, resources: res, replicas, current: &current };
            if let Ok(nodes) = place(&r, &s) {
                prop_assert!(s.not_authoritative.is_none());
                prop_assert_eq!(nodes.len(), replicas as usize);
                let distinct: BTreeSet<_> = nodes.iter().collect();
                prop_assert_eq!(distinct.len(), nodes.len());
            }
        }

        #[test]
        fn new_replicas_only_on_eligible_nodes((s, p, stateful, res, current) in arb_case()) {
            let r = Request { placement: &p, stateful, resources: res, replicas: replicas_of(&p), current: &current };
            if let Ok(nodes) = place(&r, &s) {
                for (replica, id) in nodes.iter().enumerate() {
                    let stays = current.iter().any(|(cr, cn)| *cr as usize == replica && cn == id);
                    let facts = s.nodes.iter().find(|n| &n.id == id);
                    prop_assert!(facts.is_some(), "placed on unknown node {}", id);
                    if !stays {
                        let f = facts.unwrap();
                        prop_assert!(f.reachable && f.schedulable, "new replica on unreachable or draining node {}", id);
                    }
                    if !p.is_pinned() {
                        let f = facts.unwrap();
                        prop_assert!(f.reachable && f.schedulable, "labelled replica on ineligible node {}", id);
                    }
                }
            }
        }

        #[test]
        fn stateful_never_moves((s, _p, _stateful, res, _current) in arb_case(), pinned in 0u8..8) {
            let node = format!("n{pinned}");
            let p = Placement::ExactNode { node: NodeId::parse(&node).unwrap() };
            let current = vec![(0, node.clone())];
            let r = Request { placement: &p, stateful: true, resources: res, replicas: 1, current: &current };
            match place(&r, &s) {
                Ok(nodes) => prop_assert_eq!(nodes, vec![node]),
                Err(e) => prop_assert!(matches!(e, PlacementError::NotAuthoritative(_) | PlacementError::UnknownNode(_)), "{e}"),
            }
            // A stateful module on anything but exact_node is never placed.
            for other in [Placement::ControllerNode {}, Placement::MatchLabels { labels: Labels::new(), replicas: 1 }] {
                let r = Request { placement: &other, stateful: true, resources: res, replicas: 1, current: &current };
                prop_assert!(place(&r, &s).is_err());
            }
        }
    }
}
