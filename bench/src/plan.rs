//! `mesh-bench connectivity-plan`: what computing the connectivity section
//! of every node costs as the fleet grows (the pure plan of
//! `mesh_connectivity::plan`: WireGuard peers, names file, ruleset), and how
//! large one node's section gets — the bound a full mesh runs into.

use std::collections::BTreeMap;
use std::time::Instant;

use anyhow::Context as _;
use mesh_connectivity::plan::{Module, Node, Snapshot};
use mesh_connectivity::{Cidr, PlanSettings, Policy};
use mesh_protocol::{
    DeclarationItems, FileItem, FileMode, MAX_DECLARATION_BYTES, ModulePort, NodeId, PortProtocol,
};

/// One row of the table.
struct Row {
    nodes: usize,
    policy: Policy,
    millis: f64,
    per_node_us: f64,
    section_bytes: usize,
}

fn snapshot(nodes: usize, policy: Policy) -> anyhow::Result<Snapshot> {
    use base64::Engine as _;
    let mut s = Snapshot::default();
    for i in 0..nodes {
        let id = NodeId::parse(&format!("node-{i}"))?;
        let mut key = [0u8; 32];
        key[..8].copy_from_slice(&(i as u64).to_le_bytes());
        let mut labels = BTreeMap::new();
        if policy == Policy::HubAndSpoke && i < 2 {
            labels.insert(mesh_connectivity::HUB_LABEL.to_owned(), "true".to_owned());
        }
        s.nodes.insert(
            id.clone(),
            Node {
                id,
                address: Some(0x0a58_0000 + 1 + i as u32),
                public_key: Some(base64::engine::general_purpose::STANDARD.encode(key)),
                endpoint: Some(format!("192.0.2.{}:51820", i % 250 + 1)),
                labels: labels.into_iter().collect(),
            },
        );
    }
    // Ten modules of three replicas, each port reachable from the next module.
    for m in 0..10usize {
        let nodes = (0..3)
            .map(|r| NodeId::parse(&format!("node-{}", (m * 3 + r) % nodes.max(1))))
            .collect::<Result<std::collections::BTreeSet<_>, _>>()?;
        s.modules.insert(
            format!("mod-{m}"),
            Module {
                name: format!("mod-{m}"),
                nodes: nodes.into_iter().collect(),
                ports: vec![ModulePort {
                    name: "api".into(),
                    port: 8000 + m as u16,
                    protocol: PortProtocol::Tcp,
                    from: vec![format!("mod-{}", (m + 1) % 10)],
                    expose: None,
                }],
            },
        );
    }
    Ok(s)
}

fn measure(nodes: usize, policy: Policy) -> anyhow::Result<Row> {
    let settings = PlanSettings {
        cidr: Cidr::parse("overlay_cidr", "10.88.0.0/16")?,
        listen_port: 51820,
        policy,
        domain: "mesh.internal".into(),
    };
    let s = snapshot(nodes, policy)?;
    let start = Instant::now();
    let mut largest = 0;
    let hosts = s.hosts(&settings.domain);
    for id in s.nodes.keys() {
        let items = DeclarationItems {
            files: vec![FileItem {
                path: mesh_connectivity::HOSTS_PATH.to_owned(),
                content: hosts.clone(),
                mode: FileMode::new(0o644)?,
            }],
            overlay: s.overlay(id, &settings),
            firewall: s.firewall(id, &settings),
            ..DeclarationItems::default()
        };
        let bytes = serde_json::to_vec(&items)?.len();
        largest = largest.max(bytes);
        std::hint::black_box(mesh_protocol::digest_items(&items));
    }
    let elapsed = start.elapsed().as_secs_f64();
    Ok(Row {
        nodes,
        policy,
        millis: elapsed * 1e3,
        per_node_us: elapsed * 1e6 / nodes.max(1) as f64,
        section_bytes: largest,
    })
}

pub fn run(sizes: &[usize]) -> anyhow::Result<()> {
    println!(
        "| nodes | policy | every node's section | per node | largest section | of the declaration limit |"
    );
    println!("|---:|---|---:|---:|---:|---:|");
    for &n in sizes {
        for policy in [Policy::Full, Policy::HubAndSpoke] {
            let r = measure(n, policy).with_context(|| format!("{n} nodes"))?;
            println!(
                "| {} | {} | {:.1} ms | {:.1} µs | {} KiB | {:.0} % |",
                r.nodes,
                r.policy.as_str(),
                r.millis,
                r.per_node_us,
                r.section_bytes / 1024,
                100.0 * r.section_bytes as f64 / MAX_DECLARATION_BYTES as f64
            );
        }
    }
    Ok(())
}
