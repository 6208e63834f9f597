//! The real overlay, driven by the real controller (issue 12): three hosts as
//! network namespaces on a LAN of their own (addresses only on this machine),
//! a real agent in each, enrolled with a broker user of its own and reaching
//! the broker over AMQPS at this machine's advertised address, as a second
//! host would. The controller's connectivity context allocates the overlay
//! addresses and declares each node's WireGuard interface, names file and
//! nftables ruleset; each agent applies them (wireguard-go: the kernel here
//! has no WireGuard) and:
//!
//! - a TCP connection between two nodes' overlay addresses succeeds, both ways;
//! - the ruleset c applied admits its module's port from a (whose module the
//!   port names in `from`) and refuses it from b, while b reaches c's other
//!   port (granted to b's module): the tunnel is there, the filter decides;
//! - c revoked through the API (`DELETE /v1/nodes/{id}`): c leaves the
//!   overlay view, a's and b's interfaces and names files; connections to it
//!   fail; a and b still talk.
//!
//! Every agent runs in a mount namespace of its own where a per-host
//! directory is `/var/run/wireguard`: wireguard-go's control socket is
//! `/var/run/wireguard/<if>.sock`, shared by every namespace of a machine,
//! and the controller declares `mesh0` to every node. No agent runs in this
//! machine's namespace: each host's `mesh0` is in its own, its socket in its
//! own directory. The LAN is `10.203.<k>.0/24`, the overlay
//! `10.213.<k>.0/24` (k random per run). Every namespace, link and process is
//! removed by guards, even on failure.
//!
//! Skipped, saying why, where not root, where ip / unshare / wg /
//! wireguard-go / nft / /dev/net/tun are missing, or where `bundle/up` has
//! not made the broker's TLS listener.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context as _, anyhow, bail, ensure};
use mesh_e2e::netns::{Lan, LanHost, Listener, connect};
use mesh_e2e::{Mesh, Proc, wait_for};
use serde_json::{Value, json};

const WITHIN: Duration = Duration::from_secs(30);
const NAMES: [&str; 3] = ["a", "b", "c"];
const WG_PORT: u16 = 51820;
/// b's module port, granted to a's module.
const B_PORT: u16 = 7000;
/// c's module port granted to a's module only.
const C_GRANTED_TO_A: u16 = 7001;
/// c's module port granted to b's module only.
const C_GRANTED_TO_B: u16 = 7002;
/// a's module port, granted to b's module.
const A_PORT: u16 = 7003;

/// Why this machine cannot run the test, if it cannot.
fn unavailable() -> Option<String> {
    if !rustix::process::geteuid().is_root() {
        return Some("not root".into());
    }
    for (tool, arg, package) in [
        ("ip", "-V", "iproute2"),
        ("unshare", "--version", "util-linux"),
        ("wg", "--version", "wireguard-tools"),
        ("wireguard-go", "--version", "wireguard-go"),
        ("nft", "--version", "nftables"),
    ] {
        let found = Command::new(tool)
            .arg(arg)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok();
        if !found {
            return Some(format!("{tool} not found (Debian package {package})"));
        }
    }
    if !Path::new("/dev/net/tun").exists() {
        return Some("/dev/net/tun does not exist".into());
    }
    match mesh_testkit::bundle_tls() {
        Err(e) => Some(format!("no bundle TLS: {e}")),
        Ok(tls) if mesh_credentials::advertise::is_loopback_host(&tls.advertise_host) => {
            Some(format!(
                "bundle/up advertises {} (loopback): no other host can reach it",
                tls.advertise_host
            ))
        }
        Ok(_) => None,
    }
}

fn ip(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("ip").args(args).output()?;
    ensure!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

/// Run `args` in host `i` with its own `/var/run/wireguard` (`wg show …`).
fn in_host(
    lan: &Lan,
    host: &LanHost,
    i: usize,
    program: &str,
    args: &[&str],
) -> anyhow::Result<String> {
    let out = lan
        .command_with_wireguard_dir(i, &host.wireguard_dir, Path::new(program))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("{program} {} in {}", args.join(" "), lan.ns(i)))?;
    ensure!(
        out.status.success(),
        "{program} {} in {}: {}",
        args.join(" "),
        lan.ns(i),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The public keys of the peers of `mesh0` on host `i`.
fn wg_peers(lan: &Lan, host: &LanHost, i: usize) -> anyhow::Result<Vec<String>> {
    let out = in_host(lan, host, i, "wg", &["show", "mesh0", "peers"])?;
    Ok(out.split_whitespace().map(str::to_owned).collect())
}

/// Until `node`'s connectivity section is applied as declared, without error.
async fn connectivity_applied(mesh: &Mesh, node: &str) -> anyhow::Result<i64> {
    wait_for(
        &format!("{node} to apply its connectivity section"),
        WITHIN,
        || async {
            let (status, view) = mesh.get(&format!("/v1/nodes/{node}")).await?;
            ensure!(status == 200, "GET /v1/nodes/{node}: {status} {view}");
            let s = &view["sections"]["connectivity"];
            ensure!(s["error"].is_null(), "{node}: {s}");
            Ok(s["declared"]
                .as_i64()
                .filter(|d| s["applied"].as_i64() == Some(*d))
                .filter(|_| s["outcome"].as_str().is_none_or(|o| o == "applied")))
        },
    )
    .await
}

/// Create (or replace) module `name` with `spec`.
async fn put_module(mesh: &Mesh, name: &str, spec: &Value) -> anyhow::Result<()> {
    let (status, body) = mesh.put(&format!("/v1/modules/{name}"), spec).await?;
    ensure!(
        status == 200 || status == 201,
        "PUT /v1/modules/{name}: {status} {body}"
    );
    Ok(())
}

/// A module of one sleeper pinned to `node`, listening on `ports`.
fn module_on(node: &str, ports: Value) -> Value {
    json!({
        "unit": {"command": "sleep", "args": ["100000"]},
        "placement": {"exact_node": {"node": node}},
        "ports": ports,
    })
}

/// Connections from host `from` to `addr` until one is answered (the first
/// waits for a WireGuard handshake), within the deadline.
async fn reaches(lan: &Lan, from: usize, addr: SocketAddr) -> anyhow::Result<()> {
    wait_for(
        &format!("{} to reach {addr}", NAMES[from]),
        WITHIN,
        || async {
            connect(lan.ns(from), addr, Duration::from_secs(1)).await?;
            Ok(Some(()))
        },
    )
    .await
}

/// One attempt from host `from` to `addr`, which must not be answered.
async fn refused(lan: &Lan, from: usize, addr: SocketAddr, why: &str) -> anyhow::Result<()> {
    match connect(lan.ns(from), addr, Duration::from_secs(2)).await {
        Err(_) => Ok(()),
        Ok(()) => bail!("{} reached {addr}, {why}", NAMES[from]),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controller_declares_the_overlay_its_filter_and_a_revocation() -> anyhow::Result<()> {
    if let Some(why) = unavailable() {
        return mesh_testkit::skip(&why);
    }
    let mut mesh = Mesh::prepare().await?;
    let lan = Lan::create(mesh.env.id(), &NAMES)?;
    let cidr = format!("10.213.{}.0/24", lan.octet());
    let toml_path = mesh.dir.path().join("controller.toml");
    let mut toml = std::fs::read_to_string(&toml_path)?;
    toml.push_str(&format!(
        "overlay_cidr = \"{cidr}\"\noverlay_port = {WG_PORT}\nmesh_domain = \"mesh.test\"\n"
    ));
    std::fs::write(&toml_path, toml)?;
    mesh.start_controller(&[]).await?;

    let mut agents = Vec::new();
    let result = overlay(&mesh, &lan, &mut agents).await;
    // The agents, then whatever else runs in the namespaces, then these.
    drop(agents);
    drop(lan);
    if let Err(e) = &result {
        eprintln!("failed: {e:#}");
        for n in NAMES {
            eprintln!("--- agent {n} ---\n{}", mesh.log_of(&format!("agent-{n}")));
        }
        let log = mesh.controller_log();
        let lines: Vec<&str> = log.lines().collect();
        eprintln!(
            "--- controller (last 60 lines) ---\n{}",
            lines[lines.len().saturating_sub(60)..].join("\n")
        );
    }
    // The test's own failure first, should the teardown fail too.
    let torn = mesh.teardown().await;
    result?;
    torn
}

async fn overlay(mesh: &Mesh, lan: &Lan, agents: &mut Vec<Proc>) -> anyhow::Result<()> {
    // An agent per host: its own broker user, AMQPS to the advertised
    // address, its endpoint on the LAN.
    let mut hosts = Vec::new();
    for (i, name) in NAMES.iter().enumerate() {
        let overlay = format!(
            "[overlay]\nendpoint = \"{ip}\"\nlisten_port = {WG_PORT}\nkernel = false\n\
             check_interval = \"1s\"\n",
            ip = lan.addr(i),
        );
        let (host, agent) = lan.spawn_agent(mesh, i, name, &overlay).await?;
        agents.push(agent);
        hosts.push(host);
    }

    // The controller gives each an overlay address of its network, and
    // each applies its interface with the other two as peers.
    let view = wait_for("three nodes on the overlay", WITHIN, || async {
        let (status, view) = mesh.get("/v1/overlay").await?;
        ensure!(status == 200, "GET /v1/overlay: {status} {view}");
        let on = view["nodes"].as_array().map_or(0, |n| {
            n.iter()
                .filter(|n| n["public_key"].is_string() && n["address"].is_string())
                .count()
        });
        Ok((on == 3).then_some(view))
    })
    .await?;
    let mut address = BTreeMap::new();
    let mut key = BTreeMap::new();
    for n in view["nodes"].as_array().into_iter().flatten() {
        let (Some(node), Some(a), Some(k)) = (
            n["node"].as_str(),
            n["address"].as_str(),
            n["public_key"].as_str(),
        ) else {
            bail!("a node without an address or key: {n}");
        };
        address.insert(node.to_owned(), a.to_owned());
        key.insert(node.to_owned(), k.to_owned());
    }
    for (i, h) in hosts.iter().enumerate() {
        let a = address
            .get(&h.node)
            .ok_or_else(|| anyhow!("{} is not in {view}", h.node))?;
        ensure!(
            a.starts_with(&format!("10.213.{}.", lan.octet())),
            "{a} is not in the controller's overlay network"
        );
        ensure!(
            view["nodes"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|n| n["node"] == h.node.as_str()
                    && n["endpoint"] == format!("{}:{WG_PORT}", lan.addr(i)).as_str()),
            "{}'s endpoint: {view}",
            h.node
        );
    }
    let overlay_of = |i: usize, port: u16| -> anyhow::Result<SocketAddr> {
        Ok(format!("{}:{port}", address[&hosts[i].node]).parse()?)
    };
    for (i, h) in hosts.iter().enumerate() {
        connectivity_applied(mesh, &h.node).await?;
        // Its mesh0 is in its own namespace, its control socket in its own
        // directory: nothing of the test's is in this machine's.
        ip(&["-n", lan.ns(i), "link", "show", "dev", "mesh0"])?;
        ensure!(
            h.wireguard_dir.join("mesh0.sock").exists(),
            "{}'s wireguard-go socket is not in its own /var/run/wireguard",
            h.node
        );
        let others: Vec<&String> = hosts
            .iter()
            .filter(|o| o.node != h.node)
            .map(|o| &key[&o.node])
            .collect();
        wait_for(
            &format!("{}'s mesh0 to have the other two as peers", h.node),
            WITHIN,
            || async {
                let peers = wg_peers(lan, h, i)?;
                Ok((peers.len() == 2 && others.iter().all(|k| peers.contains(k))).then_some(()))
            },
        )
        .await?;
        let hosts_file = std::fs::read_to_string(h.root.join("etc/mesh/hosts"))?;
        for o in &hosts {
            let line = format!("{} {} {}.mesh.test", address[&o.node], o.node, o.node);
            ensure!(
                hosts_file.lines().any(|l| l == line),
                "{line:?} missing from {}'s names file:\n{hosts_file}",
                h.node
            );
        }
    }

    // A module on each node; c's two ports each granted to one of the others.
    let (a, b, c) = (&hosts[0].node, &hosts[1].node, &hosts[2].node);
    put_module(
        mesh,
        "front",
        &module_on(a, json!([{"name": "f", "port": A_PORT, "from": ["back"]}])),
    )
    .await?;
    put_module(
        mesh,
        "back",
        &module_on(b, json!([{"name": "b", "port": B_PORT, "from": ["front"]}])),
    )
    .await?;
    put_module(
        mesh,
        "store",
        &module_on(
            c,
            json!([
                {"name": "for-front", "port": C_GRANTED_TO_A, "from": ["front"]},
                {"name": "for-back", "port": C_GRANTED_TO_B, "from": ["back"]},
            ]),
        ),
    )
    .await?;
    // Each ruleset applied in its namespace admits its ports from the
    // granted node's overlay address.
    let granted = [
        (0usize, A_PORT, 1usize),
        (1, B_PORT, 0),
        (2, C_GRANTED_TO_A, 0),
        (2, C_GRANTED_TO_B, 1),
    ];
    for (i, h) in hosts.iter().enumerate() {
        let rules: Vec<String> = granted
            .iter()
            .filter(|(on, _, _)| *on == i)
            .map(|(_, port, from)| {
                format!(
                    "ip saddr {} tcp dport {port} accept",
                    address[&hosts[*from].node]
                )
            })
            .collect();
        wait_for(
            &format!("{}'s ruleset to admit {rules:?}", h.node),
            WITHIN,
            || async {
                let table = in_host(lan, h, i, "nft", &["list", "table", "inet", "mesh"])?;
                Ok(rules.iter().all(|r| table.contains(r)).then_some(()))
            },
        )
        .await?;
        connectivity_applied(mesh, &h.node).await?;
    }

    // TCP over the overlay, both ways between a and b.
    let _listeners = [
        Listener::bind(lan.ns(1), overlay_of(1, B_PORT)?)?,
        Listener::bind(lan.ns(0), overlay_of(0, A_PORT)?)?,
        Listener::bind(lan.ns(2), overlay_of(2, C_GRANTED_TO_A)?)?,
        Listener::bind(lan.ns(2), overlay_of(2, C_GRANTED_TO_B)?)?,
    ];
    reaches(lan, 0, overlay_of(1, B_PORT)?).await?;
    reaches(lan, 1, overlay_of(0, A_PORT)?).await?;
    // c's filter: its port for a admits a and refuses b, which reaches c's
    // port for b (so the tunnel b–c is up and the filter is what refuses).
    reaches(lan, 0, overlay_of(2, C_GRANTED_TO_A)?).await?;
    reaches(lan, 1, overlay_of(2, C_GRANTED_TO_B)?).await?;
    refused(
        lan,
        1,
        overlay_of(2, C_GRANTED_TO_A)?,
        "a port granted to a's module only",
    )
    .await?;

    // c revoked through the API: it leaves the overlay.
    let (status, body) = mesh
        .request_as(
            reqwest::Method::DELETE,
            &format!("/v1/nodes/{c}"),
            Some(mesh.admin_token()),
            None,
        )
        .await?;
    ensure!(status == 200, "DELETE /v1/nodes/{c}: {status} {body}");
    wait_for(
        &format!("{c} to leave the overlay view"),
        WITHIN,
        || async {
            let (_, view) = mesh.get("/v1/overlay").await?;
            let nodes = view["nodes"].as_array().cloned().unwrap_or_default();
            Ok((nodes.len() == 2 && nodes.iter().all(|n| n["node"] != c.as_str())).then_some(()))
        },
    )
    .await?;
    for (i, h) in hosts.iter().enumerate().take(2) {
        let other = &key[&hosts[1 - i].node];
        wait_for(
            &format!("{}'s mesh0 to lose {c}", h.node),
            WITHIN,
            || async {
                let peers = wg_peers(lan, h, i)?;
                Ok((peers == [other.clone()]).then_some(()))
            },
        )
        .await?;
        connectivity_applied(mesh, &h.node).await?;
        let hosts_file = std::fs::read_to_string(h.root.join("etc/mesh/hosts"))?;
        ensure!(
            !hosts_file.contains(c.as_str()) && hosts_file.contains(hosts[1 - i].node.as_str()),
            "{}'s names file after the revocation:\n{hosts_file}",
            h.node
        );
    }
    refused(lan, 0, overlay_of(2, C_GRANTED_TO_A)?, "which is revoked").await?;
    refused(lan, 1, overlay_of(2, C_GRANTED_TO_B)?, "which is revoked").await?;
    reaches(lan, 0, overlay_of(1, B_PORT)?).await?;
    reaches(lan, 1, overlay_of(0, A_PORT)?).await?;

    Ok(())
}
