//! Connectivity end to end (issue 12): a real controller, nodes enrolled the
//! real way (join tokens, `mesh-agent join`), each stating its WireGuard key
//! and endpoint in a hello from its own broker user (simulated agents: what
//! applying the overlay needs is the agent's part). Every node's declared
//! WireGuard configuration lists the other four with the right keys,
//! endpoints and allowed IPs; `certificates` reports reach the connectivity
//! context (a request for another node's name refused, naming why); a revoked
//! node disappears from every one.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use lapin::options::{BasicGetOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use mesh_e2e::sim::{SimNode, confirmed, request_certificate};
use mesh_e2e::{Mesh, wait_for};
use mesh_protocol::{
    Declaration, DeclarationItems, Envelope, MAX_DECLARATION_BYTES, OverlayFacts, Report, Section,
};
use mesh_testkit::NodeCredentials;

const WITHIN: Duration = Duration::from_secs(30);

/// A WireGuard key (base64 of 32 bytes) that differs by `i`.
fn key(i: u8) -> String {
    format!("{}{}=", char::from(b'A' + i), "A".repeat(42))
}

/// A queue of the broker admin's bound beside `decl.<node>`: a copy of
/// every declaration the node is sent.
async fn copy_of_declarations(ch: &lapin::Channel, node: &str) -> anyhow::Result<String> {
    let name = format!("copy-{node}");
    ch.queue_declare(
        name.as_str().into(),
        QueueDeclareOptions {
            exclusive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await?;
    ch.queue_bind(
        name.as_str().into(),
        "declarations".into(),
        node.into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    Ok(name)
}

/// The newest connectivity section seen in `queue` so far, kept in `newest`.
async fn newest_connectivity(
    ch: &lapin::Channel,
    queue: &str,
    newest: &mut Option<(u64, DeclarationItems)>,
) -> anyhow::Result<()> {
    while let Some(msg) = ch
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await?
    {
        let env = Envelope::<Declaration>::decode(&msg.delivery.data, MAX_DECLARATION_BYTES)?;
        let d = env.body;
        if d.section == Section::Connectivity
            && newest.as_ref().is_none_or(|(g, _)| d.generation > *g)
        {
            *newest = Some((d.generation, d.items));
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn five_nodes_peer_with_the_other_four_and_a_revoked_one_leaves_every_config()
-> anyhow::Result<()> {
    let mesh = Mesh::start().await?;
    let admin = lapin::Connection::connect(&mesh.env.admin_amqp_url(), Default::default()).await?;
    let ch = admin.create_channel().await?;

    let mut nodes = Vec::new();
    for i in 0..5u8 {
        let (node, state_dir) = mesh.join_node(&format!("n{i}")).await?;
        let creds = mesh_credentials::AgentCredentials::load(&state_dir)?;
        let copy = copy_of_declarations(&ch, &node).await?;
        nodes.push((node, NodeCredentials::from_agent(&creds), copy));
    }
    for (i, (_, creds, _)) in nodes.iter().enumerate() {
        let i = u8::try_from(i)?;
        let mut sim = SimNode::connect(creds.clone()).await?;
        let mut hello = sim.hello(&[]);
        if let Report::Hello(h) = &mut hello.body {
            h.overlay = Some(OverlayFacts {
                public_key: key(i),
                endpoint: Some(format!("192.0.2.{}:51820", i + 1)),
            });
        }
        confirmed(vec![sim.send(&hello).await?]).await?;
        sim.close().await;
    }

    // The overlay view: five addresses, all different, each with its key.
    let view = wait_for("five nodes on the overlay", WITHIN, || async {
        let (status, view) = mesh.get("/v1/overlay").await?;
        anyhow::ensure!(status == 200, "GET /v1/overlay: {status} {view}");
        let on = view["nodes"]
            .as_array()
            .map(|n| n.iter().filter(|n| n["public_key"].is_string()).count())
            .unwrap_or(0);
        Ok((on == 5).then_some(view))
    })
    .await?;
    let mut address: BTreeMap<String, String> = BTreeMap::new();
    for n in view["nodes"].as_array().into_iter().flatten() {
        let (Some(node), Some(a)) = (n["node"].as_str(), n["address"].as_str()) else {
            anyhow::bail!("a node without an address: {n}");
        };
        address.insert(node.to_owned(), a.to_owned());
    }
    let distinct: std::collections::BTreeSet<&String> = address.values().collect();
    anyhow::ensure!(distinct.len() == 5, "addresses collide: {address:?}");

    // Every node is declared the other four, with their keys, endpoints and
    // addresses.
    let mut newest: Vec<Option<(u64, DeclarationItems)>> = vec![None; 5];
    let deadline = Instant::now() + WITHIN;
    loop {
        for (i, (_, _, copy)) in nodes.iter().enumerate() {
            newest_connectivity(&ch, copy, &mut newest[i]).await?;
        }
        let done = newest.iter().all(|n| {
            n.as_ref()
                .and_then(|(_, items)| items.overlay.as_ref())
                .is_some_and(|o| o.peers.len() == 4)
        });
        if done {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "timed out waiting for every node to be declared its four peers: {newest:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for (i, (node, _, _)) in nodes.iter().enumerate() {
        let Some((_, items)) = &newest[i] else {
            anyhow::bail!("no section for {node}");
        };
        let Some(plan) = &items.overlay else {
            anyhow::bail!("no overlay for {node}");
        };
        anyhow::ensure!(plan.address == format!("{}/16", address[node]), "{plan:?}");
        for p in &plan.peers {
            let j = nodes
                .iter()
                .position(|(n, _, _)| n == p.node.as_str())
                .ok_or_else(|| anyhow::anyhow!("unknown peer {}", p.node))?;
            anyhow::ensure!(i != j, "{node} peers with itself");
            let j8 = u8::try_from(j)?;
            anyhow::ensure!(p.public_key == key(j8), "{p:?}");
            anyhow::ensure!(
                p.endpoint.as_deref() == Some(format!("192.0.2.{}:51820", j + 1).as_str()),
                "{p:?}"
            );
            anyhow::ensure!(
                p.allowed_ips == vec![format!("{}/32", address[p.node.as_str()])],
                "{p:?}"
            );
        }
        let hosts = items
            .files
            .iter()
            .find(|f| f.path == "/etc/mesh/hosts")
            .ok_or_else(|| anyhow::anyhow!("no names file for {node}"))?;
        for (n, a) in &address {
            anyhow::ensure!(
                hosts.content.contains(&format!("{a} {n} ")),
                "{n} missing from {}",
                hosts.content
            );
        }
        anyhow::ensure!(items.firewall.is_some(), "no ruleset for {node}");
    }

    // Certificates reports are routed to connectivity: n0's own request is
    // signed by the mesh CA (the test kit gives each environment its own),
    // n1's for n0's name is refused, naming why.
    let (n0, n1) = (nodes[0].0.clone(), nodes[1].0.clone());
    for (i, cn) in [(0usize, n0.as_str()), (1, n0.as_str())] {
        let key = mesh_credentials::pki::new_key()?;
        let csr = mesh_credentials::pki::csr(key.expose(), cn, &[cn.to_owned()])?;
        request_certificate(nodes[i].1.clone(), 2, "node", csr).await?;
    }
    let view = wait_for("both certificate requests handled", WITHIN, || async {
        let (status, view) = mesh.get("/v1/certificates").await?;
        anyhow::ensure!(status == 200, "GET /v1/certificates: {status} {view}");
        let requests = view["requests"].as_array().map_or(0, Vec::len);
        let certificates = view["certificates"].as_array().map_or(0, Vec::len);
        Ok((requests == 1 && certificates == 1).then_some(view))
    })
    .await?;
    let requests = view["requests"].as_array().cloned().unwrap_or_default();
    let of = |node: &str| requests.iter().find(|r| r["node"] == node).cloned();
    let signed = &view["certificates"][0];
    anyhow::ensure!(
        signed["node"] == n0.as_str() && signed["name"] == "node",
        "{view}"
    );
    let r1 = of(&n1).ok_or_else(|| anyhow::anyhow!("no request of {n1}: {view}"))?;
    anyhow::ensure!(r1["status"] == "refused", "{r1}");
    anyhow::ensure!(
        r1["reason"]
            .as_str()
            .is_some_and(|r| r.contains("is not the sending node")),
        "{r1}"
    );

    // Revoke n2: it leaves every other node's peers and names.
    let gone = nodes[2].0.clone();
    let status = mesh.delete(&format!("/v1/nodes/{gone}")).await?;
    anyhow::ensure!(status == 204 || status == 200, "revoke: {status}");
    let deadline = Instant::now() + WITHIN;
    loop {
        let mut done = true;
        for (i, (node, _, copy)) in nodes.iter().enumerate() {
            if *node == gone {
                continue;
            }
            newest_connectivity(&ch, copy, &mut newest[i]).await?;
            let Some((_, items)) = &newest[i] else {
                done = false;
                continue;
            };
            let peers_ok = items.overlay.as_ref().is_some_and(|o| {
                o.peers.len() == 3 && o.peers.iter().all(|p| p.node.as_str() != gone)
            });
            let names_ok = items
                .files
                .iter()
                .all(|f| !f.content.contains(gone.as_str()));
            done &= peers_ok && names_ok;
        }
        if done {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "timed out waiting for {gone} to leave every config: {newest:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (_, view) = mesh.get("/v1/overlay").await?;
    anyhow::ensure!(
        view["nodes"]
            .as_array()
            .is_some_and(|n| n.len() == 4 && n.iter().all(|n| n["node"] != gone.as_str())),
        "{view}"
    );
    let _ = admin.close(200, "done".into()).await;
    mesh.teardown().await?;
    Ok(())
}
