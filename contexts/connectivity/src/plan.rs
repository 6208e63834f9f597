//! What each node is told, as pure functions of a snapshot of the mesh (no
//! I/O, no clock): its WireGuard interface and peers, the names file and its
//! nftables ruleset. The same snapshot gives the same text, byte for byte, so
//! the section component's digests change only when something did.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::net::Ipv4Addr;

use mesh_protocol::{
    FirewallPlan, Labels, ModulePort, NodeId, OverlayPeer, OverlayPlan, PortProtocol,
};

use crate::Error;

/// The overlay's WireGuard interface on every node.
pub const INTERFACE: &str = "mesh0";
/// The nftables table the ruleset owns (family `inet`, name `mesh`).
pub const TABLE: &str = "inet mesh";
/// Where the names file lands on every node (hosts format, 0644).
pub const HOSTS_PATH: &str = "/etc/mesh/hosts";
/// The label that makes a node a hub under the hub-and-spoke policy.
pub const HUB_LABEL: &str = "mesh.hub";
/// Seconds between keepalives a node without an endpoint (behind NAT) sends
/// its peers, so the way back stays open.
pub const KEEPALIVE_SECS: u16 = 25;

/// An IPv4 network: the overlay's address range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    network: u32,
    prefix: u8,
}

impl Cidr {
    /// Parse `10.88.0.0/16`: IPv4 only, prefix 8 to 30 (at least two hosts),
    /// no host bits set.
    pub fn parse(field: &str, text: &str) -> Result<Cidr, Error> {
        let invalid = |reason: &str| Error::Invalid {
            field: field.to_owned(),
            reason: format!("`{}`: {reason}", text.chars().take(80).collect::<String>()),
        };
        let (ip, len) = text
            .split_once('/')
            .ok_or_else(|| invalid("an IPv4 network such as 10.88.0.0/16"))?;
        let ip: Ipv4Addr = ip
            .parse()
            .map_err(|_| invalid("an IPv4 network such as 10.88.0.0/16 (IPv6 is not supported)"))?;
        let prefix: u8 = len
            .parse()
            .map_err(|_| invalid("the prefix length is a number"))?;
        if !(8..=30).contains(&prefix) {
            return Err(invalid("the prefix length must be 8 to 30"));
        }
        let network = u32::from(ip);
        if network & !Self::mask(prefix) != 0 {
            return Err(invalid("host bits are set: give the network address"));
        }
        Ok(Cidr { network, prefix })
    }

    fn mask(prefix: u8) -> u32 {
        u32::MAX << (32 - u32::from(prefix))
    }

    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    /// The lowest address a node gets (the network address + 1).
    pub fn first_host(&self) -> u32 {
        self.network + 1
    }

    /// The highest address a node gets (the broadcast address - 1).
    pub fn last_host(&self) -> u32 {
        (self.network | !Self::mask(self.prefix)) - 1
    }

    /// Whether `address` is a host address of this network.
    pub fn holds(&self, address: u32) -> bool {
        (self.first_host()..=self.last_host()).contains(&address)
    }

    /// How many host addresses it has.
    pub fn hosts(&self) -> u64 {
        u64::from(self.last_host() - self.first_host()) + 1
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", Ipv4Addr::from(self.network), self.prefix)
    }
}

/// The lowest host addresses of `cidr` not in `used`, as many as `n` (fewer
/// when the network is full).
pub fn lowest_free(cidr: &Cidr, used: &BTreeSet<u32>, n: usize) -> Vec<u32> {
    let mut free = Vec::with_capacity(n);
    let mut candidate = cidr.first_host();
    while free.len() < n && candidate <= cidr.last_host() {
        if !used.contains(&candidate) {
            free.push(candidate);
        }
        match candidate.checked_add(1) {
            Some(c) => candidate = c,
            None => break,
        }
    }
    free
}

/// Who peers with whom.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// Every node peers with every other (the default).
    #[default]
    Full,
    /// Nodes labelled `mesh.hub=true` are hubs and peer with everyone; every
    /// other node peers with the hubs only, and routes the whole overlay
    /// through the first hub (by node id). With no hub at all, every node
    /// peers with every other, as `full` (a missing label must not cut the
    /// mesh in pieces).
    HubAndSpoke,
}

impl Policy {
    pub fn parse(field: &str, text: &str) -> Result<Policy, Error> {
        match text {
            "full" => Ok(Policy::Full),
            "hub-and-spoke" => Ok(Policy::HubAndSpoke),
            other => Err(Error::Invalid {
                field: field.to_owned(),
                reason: format!(
                    "`{}`: `full` or `hub-and-spoke`",
                    other.chars().take(40).collect::<String>()
                ),
            }),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Policy::Full => "full",
            Policy::HubAndSpoke => "hub-and-spoke",
        }
    }
}

/// The settings the plan is computed with.
#[derive(Debug, Clone)]
pub struct PlanSettings {
    pub cidr: Cidr,
    pub listen_port: u16,
    pub policy: Policy,
    /// The mesh's DNS domain (`mesh.internal`): modules are named
    /// `<module>.<domain>`, nodes also `<node>.<domain>`.
    pub domain: String,
}

/// One node as the plan sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    pub id: NodeId,
    pub address: Option<u32>,
    pub public_key: Option<String>,
    pub endpoint: Option<String>,
    pub labels: Labels,
}

impl Node {
    /// On the overlay: it has stated a key and holds an address.
    pub fn on_overlay(&self) -> bool {
        self.public_key.is_some() && self.address.is_some()
    }

    pub fn is_hub(&self) -> bool {
        self.labels.get(HUB_LABEL).map(String::as_str) == Some("true")
    }
}

/// A module as the plan sees it: the nodes it runs on and its ports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Module {
    pub name: String,
    pub nodes: Vec<NodeId>,
    pub ports: Vec<ModulePort>,
}

/// The snapshot every node's items are computed from: the mesh's nodes (not
/// revoked) and modules.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub nodes: BTreeMap<NodeId, Node>,
    pub modules: BTreeMap<String, Module>,
}

fn ip(address: u32) -> Ipv4Addr {
    Ipv4Addr::from(address)
}

impl Snapshot {
    /// The overlay address of `node`, if it is on the overlay.
    fn overlay_address(&self, node: &NodeId) -> Option<u32> {
        self.nodes
            .get(node)
            .filter(|n| n.on_overlay())
            .and_then(|n| n.address)
    }

    /// The WireGuard interface of `node`: none when it is not on the overlay.
    pub fn overlay(&self, node: &NodeId, settings: &PlanSettings) -> Option<OverlayPlan> {
        let me = self.nodes.get(node).filter(|n| n.on_overlay())?;
        let address = me.address?;
        let members: Vec<&Node> = self.nodes.values().filter(|n| n.on_overlay()).collect();
        let hubs: Vec<&NodeId> = members
            .iter()
            .filter(|n| n.is_hub())
            .map(|n| &n.id)
            .collect();
        let spoke = settings.policy == Policy::HubAndSpoke && !hubs.is_empty() && !me.is_hub();
        let keepalive = me.endpoint.is_none().then_some(KEEPALIVE_SECS);
        let mut peers = Vec::new();
        for peer in members {
            if peer.id == *node || (spoke && !peer.is_hub()) {
                continue;
            }
            let (Some(key), Some(peer_address)) = (&peer.public_key, peer.address) else {
                continue;
            };
            // A spoke routes the whole overlay through the first hub; a
            // WireGuard address belongs to one peer only, so other hubs
            // carry their own address.
            let allowed_ips = if spoke && hubs.first() == Some(&&peer.id) {
                vec![settings.cidr.to_string()]
            } else {
                vec![format!("{}/32", ip(peer_address))]
            };
            peers.push(OverlayPeer {
                node: peer.id.clone(),
                public_key: key.clone(),
                endpoint: peer.endpoint.clone(),
                allowed_ips,
                persistent_keepalive: keepalive,
            });
        }
        Some(OverlayPlan {
            interface: INTERFACE.to_owned(),
            address: format!("{}/{}", ip(address), settings.cidr.prefix()),
            listen_port: settings.listen_port,
            peers,
        })
    }

    /// The names file: `<address> <node> <node>.<domain>` for every node on
    /// the overlay (by node id), then `<address> <module>.<domain>`, one line
    /// per replica's node on the overlay (by module, then address).
    pub fn hosts(&self, domain: &str) -> String {
        let mut out = String::from(
            "# The mesh's names (connectivity section): declared whole, do not edit.\n",
        );
        for n in self.nodes.values() {
            if let Some(a) = self.overlay_address(&n.id) {
                let _ = writeln!(out, "{} {} {}.{domain}", ip(a), n.id, n.id);
            }
        }
        for m in self.modules.values() {
            let addresses: BTreeSet<u32> = m
                .nodes
                .iter()
                .filter_map(|n| self.overlay_address(n))
                .collect();
            for a in addresses {
                let _ = writeln!(out, "{} {}.{domain}", ip(a), m.name);
            }
        }
        out
    }

    /// The overlay addresses of the nodes running any of `modules`, sorted.
    fn sources(&self, modules: &[String]) -> BTreeSet<u32> {
        modules
            .iter()
            .filter_map(|m| self.modules.get(m))
            .flat_map(|m| m.nodes.iter())
            .filter_map(|n| self.overlay_address(n))
            .collect()
    }

    /// The nftables ruleset of `node`: none when it is not on the overlay.
    ///
    /// One table, `inet mesh`, replaced whole (created, deleted, created
    /// again, so applying it twice is applying it once and no other table is
    /// touched). Its input chain accepts established and related traffic,
    /// loopback and the WireGuard port; traffic arriving on the overlay
    /// interface is accepted only to the ports of modules this node runs,
    /// from the overlay addresses of the nodes running the modules each port
    /// names in `from` (and ICMP), and dropped otherwise; on any other
    /// interface a module port is accepted if exposed and dropped if not.
    /// Everything else arriving on the underlay is left alone (policy
    /// accept): the host's own services (ssh, the broker, the controller)
    /// are not this table's to filter.
    pub fn firewall(&self, node: &NodeId, settings: &PlanSettings) -> Option<FirewallPlan> {
        self.nodes.get(node).filter(|n| n.on_overlay())?;
        let mut overlay = String::new();
        let mut public = String::new();
        for m in self.modules.values() {
            if !m.nodes.contains(node) {
                continue;
            }
            let mut ports = m.ports.clone();
            ports.sort_by(|a, b| a.name.cmp(&b.name));
            for p in &ports {
                let proto = match p.protocol {
                    PortProtocol::Tcp => "tcp",
                    PortProtocol::Udp => "udp",
                };
                let mut from = p.from.clone();
                from.sort();
                from.dedup();
                let sources = self.sources(&from);
                let _ = writeln!(
                    overlay,
                    "\t\t# {}/{}: {}/{proto} from [{}]",
                    m.name,
                    p.name,
                    p.port,
                    from.join(", ")
                );
                if !sources.is_empty() {
                    let set: Vec<String> = sources.iter().map(|a| ip(*a).to_string()).collect();
                    let _ = writeln!(
                        overlay,
                        "\t\tip saddr {{ {} }} {proto} dport {} accept",
                        set.join(", "),
                        p.port
                    );
                }
                match &p.expose {
                    Some(name) => {
                        let _ = writeln!(
                            public,
                            "\t\t# {}/{}: exposed as {name}\n\t\t{proto} dport {} accept",
                            m.name, p.name, p.port
                        );
                    }
                    None => {
                        let _ = writeln!(
                            public,
                            "\t\t# {}/{}: not exposed\n\t\t{proto} dport {} drop",
                            m.name, p.name, p.port
                        );
                    }
                }
            }
        }
        let ruleset = format!(
            "# The mesh's packet filter (connectivity section): replaced whole.\n\
             table inet mesh\n\
             delete table inet mesh\n\
             table inet mesh {{\n\
             \tchain input {{\n\
             \t\ttype filter hook input priority filter; policy accept;\n\
             \t\tct state established,related accept\n\
             \t\tiifname \"lo\" accept\n\
             \t\tiifname \"{INTERFACE}\" jump overlay\n\
             \t\tudp dport {port} accept\n\
             \t\tjump public\n\
             \t}}\n\
             \tchain overlay {{\n\
             \t\tmeta l4proto {{ icmp, ipv6-icmp }} accept\n\
             {overlay}\
             \t\tdrop\n\
             \t}}\n\
             \tchain public {{\n\
             {public}\
             \t}}\n\
             }}\n",
            port = settings.listen_port,
        );
        Some(FirewallPlan {
            table: TABLE.to_owned(),
            ruleset,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> NodeId {
        NodeId::parse(s).unwrap()
    }

    /// A WireGuard key (base64 of 32 bytes) that differs by `i`.
    fn key(i: u8) -> String {
        format!("{}{}=", char::from(b'A' + i), "A".repeat(42))
    }

    fn settings(policy: Policy) -> PlanSettings {
        PlanSettings {
            cidr: Cidr::parse("c", "10.88.0.0/16").unwrap(),
            listen_port: 51820,
            policy,
            domain: "mesh.internal".into(),
        }
    }

    fn snapshot(names: &[(&str, bool)]) -> Snapshot {
        let mut s = Snapshot::default();
        for (i, (n, hub)) in names.iter().enumerate() {
            let mut labels = Labels::new();
            if *hub {
                labels.insert(HUB_LABEL.into(), "true".into());
            }
            let i = u8::try_from(i).unwrap();
            s.nodes.insert(
                id(n),
                Node {
                    id: id(n),
                    address: Some(0x0a58_0001 + u32::from(i)),
                    public_key: Some(key(i + 1)),
                    endpoint: Some(format!("192.0.2.{}:51820", i + 1)),
                    labels,
                },
            );
        }
        s
    }

    #[test]
    fn cidrs() {
        let c = Cidr::parse("c", "10.88.0.0/16").unwrap();
        assert_eq!(c.to_string(), "10.88.0.0/16");
        assert_eq!(ip(c.first_host()).to_string(), "10.88.0.1");
        assert_eq!(ip(c.last_host()).to_string(), "10.88.255.254");
        assert_eq!(c.hosts(), 65534);
        assert!(Cidr::parse("c", "10.88.0.1/16").is_err());
        assert!(Cidr::parse("c", "fd00::/64").is_err());
        assert!(Cidr::parse("c", "10.0.0.0/31").is_err());
        assert!(Cidr::parse("c", "10.0.0.0").is_err());
        let small = Cidr::parse("c", "10.0.0.0/30").unwrap();
        let used: BTreeSet<u32> = [small.first_host()].into();
        assert_eq!(lowest_free(&small, &used, 5), vec![small.first_host() + 1]);
    }

    #[test]
    fn full_mesh_lists_every_other_node() {
        let s = snapshot(&[("a", false), ("b", false), ("c", false)]);
        let plan = s.overlay(&id("b"), &settings(Policy::Full)).unwrap();
        assert_eq!(plan.address, "10.88.0.2/16");
        let peers: Vec<(&str, &[String])> = plan
            .peers
            .iter()
            .map(|p| (p.node.as_str(), p.allowed_ips.as_slice()))
            .collect();
        assert_eq!(
            peers,
            vec![
                ("a", &["10.88.0.1/32".to_owned()][..]),
                ("c", &["10.88.0.3/32".to_owned()][..])
            ]
        );
        assert!(plan.peers.iter().all(|p| p.persistent_keepalive.is_none()));
        plan.validate("overlay").unwrap();
    }

    #[test]
    fn spokes_peer_with_hubs_only() {
        let s = snapshot(&[("a", false), ("h1", true), ("h2", true), ("z", false)]);
        let st = settings(Policy::HubAndSpoke);
        let spoke = s.overlay(&id("a"), &st).unwrap();
        let peers: Vec<(&str, Vec<String>)> = spoke
            .peers
            .iter()
            .map(|p| (p.node.as_str(), p.allowed_ips.clone()))
            .collect();
        assert_eq!(
            peers,
            vec![
                ("h1", vec!["10.88.0.0/16".to_owned()]),
                ("h2", vec!["10.88.0.3/32".to_owned()])
            ]
        );
        let hub = s.overlay(&id("h1"), &st).unwrap();
        assert_eq!(hub.peers.len(), 3);
        // No hub: everyone peers with everyone.
        let flat = snapshot(&[("a", false), ("b", false)]);
        assert_eq!(flat.overlay(&id("a"), &st).unwrap().peers.len(), 1);
    }

    #[test]
    fn hosts_and_firewall() {
        let mut s = snapshot(&[("a", false), ("b", false), ("c", false)]);
        s.modules.insert(
            "api".into(),
            Module {
                name: "api".into(),
                nodes: vec![id("a"), id("b")],
                ports: vec![],
            },
        );
        s.modules.insert(
            "db".into(),
            Module {
                name: "db".into(),
                nodes: vec![id("c")],
                ports: vec![
                    ModulePort {
                        name: "pg".into(),
                        port: 5432,
                        protocol: PortProtocol::Tcp,
                        from: vec!["api".into()],
                        expose: None,
                    },
                    ModulePort {
                        name: "web".into(),
                        port: 443,
                        protocol: PortProtocol::Tcp,
                        from: vec![],
                        expose: Some("db.example.com".into()),
                    },
                ],
            },
        );
        assert_eq!(
            s.hosts("mesh.internal"),
            "# The mesh's names (connectivity section): declared whole, do not edit.\n\
             10.88.0.1 a a.mesh.internal\n\
             10.88.0.2 b b.mesh.internal\n\
             10.88.0.3 c c.mesh.internal\n\
             10.88.0.1 api.mesh.internal\n\
             10.88.0.2 api.mesh.internal\n\
             10.88.0.3 db.mesh.internal\n"
        );
        let fw = s.firewall(&id("c"), &settings(Policy::Full)).unwrap();
        assert_eq!(fw.table, "inet mesh");
        assert!(
            fw.ruleset
                .contains("ip saddr { 10.88.0.1, 10.88.0.2 } tcp dport 5432 accept"),
            "{}",
            fw.ruleset
        );
        assert!(fw.ruleset.contains("tcp dport 5432 drop"));
        assert!(fw.ruleset.contains("tcp dport 443 accept"));
        // a runs no module with ports: its overlay chain drops all but ICMP.
        let fw = s.firewall(&id("a"), &settings(Policy::Full)).unwrap();
        assert!(!fw.ruleset.contains("dport 5432"));
    }
}
