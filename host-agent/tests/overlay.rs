//! A real overlay: three hosts as network namespaces on a bridge of the
//! test's own, a real agent (the binary, `ip netns exec`) in each against the
//! real broker, each applying the connectivity section the test declares
//! (signed as the controller signs) through WireGuard — wireguard-go here,
//! where the kernel has no module — and nftables:
//!
//! - a TCP connection between two nodes' overlay addresses succeeds;
//! - the ruleset applied on c admits its module port from a (granted) and
//!   refuses it from b, while b reaches c's other port;
//! - b's agent restarted re-adopts its interface: same interface, same
//!   wireguard-go, traffic still flows;
//! - c revoked (its peer entry removed from a's and b's declarations):
//!   connections to it fail, a and b still talk.
//!
//! Addresses exist only on this machine: 10.201.<k>.0/24 on veths the test
//! makes (one leg in the root namespace, 10.201.<k>.254, each namespace's
//! default route: the agents reach the broker over AMQPS at this machine's
//! advertised address, delivered locally, as a second host would), overlay
//! 10.88.0.0/16 inside the namespaces. Every namespace, link and process is
//! removed by a guard, even on failure. Skipped, saying why, where not root
//! or where ip / wg / wireguard-go / nft / /dev/net/tun are missing (Debian:
//! iproute2, wireguard-tools, wireguard-go, nftables).
//!
//! Interface names differ per node (`m<id>a`…): wireguard-go's control socket
//! is `/var/run/wireguard/<if>.sock`, one directory for every namespace of
//! this machine, so three "hosts" on one machine cannot all call it `mesh0`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

mod common;

use common::{controller_side, declaration_queue_for};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use futures_util::StreamExt;
use lapin::{Channel, Consumer};
use mesh_protocol::{
    Applied, Declaration, DeclarationItems, DeclarationSigner, Envelope, FirewallPlan,
    MAX_REPORT_BYTES, NodeId, OverlayPeer, OverlayPlan, Report, Section,
};
use mesh_testkit::TestEnv;
use tokio::time::{Instant, timeout};

const DEADLINE: Duration = Duration::from_secs(20);
const PORT: u16 = 51820;

fn sh(program: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("{program} {}", args.join(" ")))?;
    ensure!(
        out.status.success(),
        "{program} {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Why this machine cannot run the test, if it cannot.
fn unavailable() -> Option<String> {
    if !rustix::process::geteuid().is_root() {
        return Some("not root".into());
    }
    for (tool, package) in [
        ("ip", "iproute2"),
        ("wg", "wireguard-tools"),
        ("wireguard-go", "wireguard-go"),
        ("nft", "nftables"),
    ] {
        let found = Command::new(tool)
            .arg("--version")
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
    None
}

/// The namespaces, the root leg and the agents' processes; all removed on drop.
struct Lab {
    id: String,
    /// Third octet of the underlay 10.201.<k>.0/24.
    k: u8,
    namespaces: Vec<String>,
    root_link: Option<String>,
    agents: Vec<Option<Child>>,
}

impl Lab {
    fn new() -> anyhow::Result<Lab> {
        let pid = std::process::id();
        let mut lab = Lab {
            id: format!("{}", pid % 100_000),
            k: u8::try_from(20 + pid % 200).unwrap_or(20),
            namespaces: Vec::new(),
            root_link: None,
            agents: Vec::new(),
        };
        let hub = lab.ns("hub");
        sh("ip", &["netns", "add", &hub])?;
        lab.namespaces.push(hub.clone());
        sh("ip", &["-n", &hub, "link", "add", "br0", "type", "bridge"])?;
        sh("ip", &["-n", &hub, "link", "set", "br0", "up"])?;
        for (i, n) in ["a", "b", "c"].into_iter().enumerate() {
            let ns = lab.ns(n);
            sh("ip", &["netns", "add", &ns])?;
            lab.namespaces.push(ns.clone());
            let port = format!("v{n}");
            sh(
                "ip",
                &[
                    "link", "add", "eth0", "netns", &ns, "type", "veth", "peer", "name", &port,
                    "netns", &hub,
                ],
            )?;
            sh(
                "ip",
                &["-n", &hub, "link", "set", &port, "master", "br0", "up"],
            )?;
            let addr = format!("{}/24", lab.underlay(i));
            sh("ip", &["-n", &ns, "address", "add", &addr, "dev", "eth0"])?;
            sh("ip", &["-n", &ns, "link", "set", "eth0", "up"])?;
            sh("ip", &["-n", &ns, "link", "set", "lo", "up"])?;
        }
        // The root leg, for the broker.
        let root = format!("mr{}", lab.id);
        sh(
            "ip",
            &[
                "link", "add", &root, "type", "veth", "peer", "name", "vr", "netns", &hub,
            ],
        )?;
        lab.root_link = Some(root.clone());
        sh(
            "ip",
            &["-n", &hub, "link", "set", "vr", "master", "br0", "up"],
        )?;
        let addr = format!("{}/24", lab.root_addr());
        sh("ip", &["address", "add", &addr, "dev", &root])?;
        sh("ip", &["link", "set", &root, "up"])?;
        // The way to this machine's own addresses (the broker's AMQPS).
        for i in 0..3 {
            let ns = lab.node_ns(i);
            sh(
                "ip",
                &[
                    "-n",
                    &ns,
                    "route",
                    "add",
                    "default",
                    "via",
                    &lab.root_addr(),
                ],
            )?;
        }
        Ok(lab)
    }

    fn ns(&self, n: &str) -> String {
        format!("mt{}-{n}", self.id)
    }

    fn node_ns(&self, i: usize) -> String {
        self.ns(["a", "b", "c"][i])
    }

    fn underlay(&self, i: usize) -> String {
        format!("10.201.{}.{}", self.k, i + 1)
    }

    fn root_addr(&self) -> String {
        format!("10.201.{}.254", self.k)
    }

    fn interface(&self, i: usize) -> String {
        format!("m{}{}", self.id, ["a", "b", "c"][i])
    }

    /// Pids living in a namespace.
    fn pids(&self, ns: &str) -> Vec<u32> {
        sh("ip", &["netns", "pids", ns])
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect()
    }

    /// Stop agent `i` (SIGTERM, then wait); its wireguard-go stays.
    fn stop_agent(&mut self, i: usize) -> anyhow::Result<()> {
        let Some(mut child) = self.agents.get_mut(i).and_then(Option::take) else {
            bail!("agent {i} is not running");
        };
        let pid =
            rustix::process::Pid::from_raw(i32::try_from(child.id())?).context("agent pid")?;
        rustix::process::kill_process(pid, rustix::process::Signal::TERM)?;
        let until = std::time::Instant::now() + DEADLINE;
        loop {
            if child.try_wait()?.is_some() {
                return Ok(());
            }
            ensure!(std::time::Instant::now() < until, "agent {i} did not stop");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        for c in self.agents.iter_mut().flatten() {
            let _ = c.kill();
            let _ = c.wait();
        }
        // Whatever else runs in them (wireguard-go), then the namespaces.
        for ns in &self.namespaces {
            for pid in self.pids(ns) {
                if let Some(p) = rustix::process::Pid::from_raw(pid as i32) {
                    let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
                }
            }
        }
        for ns in &self.namespaces {
            let _ = sh("ip", &["netns", "del", ns]);
        }
        if let Some(l) = &self.root_link {
            let _ = sh("ip", &["link", "del", l]);
        }
        // wireguard-go removes its socket when it exits cleanly, not when killed.
        for i in 0..3 {
            let _ = std::fs::remove_file(
                Path::new("/var/run/wireguard").join(format!("{}.sock", self.interface(i))),
            );
        }
    }
}

/// Run `f` on a thread inside network namespace `ns`: the sockets it makes
/// live there.
fn in_ns<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> std::io::Result<T> + Send + 'static,
) -> std::io::Result<T> {
    let path = PathBuf::from("/run/netns").join(ns);
    std::thread::spawn(move || {
        let file = std::fs::File::open(&path)?;
        rustix::thread::move_into_link_name_space(
            file.as_fd(),
            Some(rustix::thread::LinkNameSpaceType::Network),
        )?;
        f()
    })
    .join()
    .map_err(|_| std::io::Error::other("thread panicked"))?
}

/// A listener in `ns` on `addr` answering each connection with `ok\n`.
fn listen(ns: &str, addr: SocketAddr) -> anyhow::Result<()> {
    let l = in_ns(ns, move || TcpListener::bind(addr)).with_context(|| format!("bind {addr}"))?;
    std::thread::spawn(move || {
        for s in l.incoming().flatten() {
            let mut s = s;
            let _ = s.write_all(b"ok\n");
        }
    });
    Ok(())
}

/// One connection attempt from `ns` to `addr`, within `wait`: the greeting.
fn connect(ns: &str, addr: SocketAddr, wait: Duration) -> std::io::Result<String> {
    in_ns(ns, move || {
        let mut s = TcpStream::connect_timeout(&addr, wait)?;
        s.set_read_timeout(Some(wait))?;
        let mut buf = [0u8; 3];
        s.read_exact(&mut buf)?;
        Ok(String::from_utf8_lossy(&buf).into_owned())
    })
}

/// Connections from `ns` to `addr` until one succeeds (a WireGuard handshake
/// comes first), within the deadline.
async fn reaches(ns: &str, addr: SocketAddr) -> anyhow::Result<()> {
    let until = Instant::now() + DEADLINE;
    loop {
        let (n, a) = (ns.to_owned(), addr);
        let r = tokio::task::spawn_blocking(move || connect(&n, a, Duration::from_secs(1))).await?;
        match r {
            Ok(greeting) if greeting == "ok\n" => return Ok(()),
            other if Instant::now() >= until => bail!("{ns} cannot reach {addr}: {other:?}"),
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// Publish a connectivity section as the controller does: signed.
async fn declare(
    ch: &Channel,
    signer: &DeclarationSigner,
    node: &NodeId,
    generation: u64,
    items: DeclarationItems,
) -> anyhow::Result<()> {
    let decl = Declaration {
        section: Section::Connectivity,
        generation,
        items,
    };
    common::publish_declaration(ch, signer, node, decl).await
}

/// Every report, kept until a wait takes it: the agents report in any order.
struct Reports {
    consumer: Consumer,
    seen: Vec<Envelope<Report>>,
}

/// The first report of `node` matching `pick` (taken), within the deadline.
async fn wait_report<T>(
    reports: &mut Reports,
    what: &str,
    node: &NodeId,
    pick: impl Fn(&Report) -> Option<T>,
) -> anyhow::Result<T> {
    let until = Instant::now() + DEADLINE;
    let mut i = 0;
    loop {
        while i < reports.seen.len() {
            if &reports.seen[i].node == node
                && let Some(t) = pick(&reports.seen[i].body)
            {
                reports.seen.remove(i);
                return Ok(t);
            }
            i += 1;
        }
        let left = until.saturating_duration_since(Instant::now());
        let d = match timeout(left, reports.consumer.next()).await {
            Ok(Some(d)) => d?,
            Ok(None) => bail!("report consumer ended while waiting for {what}"),
            Err(_) => bail!("no {what} of {node} within {DEADLINE:?}"),
        };
        reports
            .seen
            .push(Envelope::<Report>::decode(&d.data, MAX_REPORT_BYTES)?);
    }
}

async fn wait_applied(
    reports: &mut Reports,
    node: &NodeId,
    generation: u64,
) -> anyhow::Result<Applied> {
    wait_report(
        reports,
        &format!("applied {generation}"),
        node,
        |r| match r {
            Report::Applied(a)
                if a.section == Some(Section::Connectivity) && a.generation == Some(generation) =>
            {
                Some(a.clone())
            }
            _ => None,
        },
    )
    .await
}

fn item_ok(a: &Applied, item: &str) -> anyhow::Result<()> {
    let i = a
        .items
        .iter()
        .find(|i| i.item == item)
        .with_context(|| format!("no item {item} in {a:?}"))?;
    ensure!(i.ok, "{item} not applied: {:?}", i.error);
    Ok(())
}

struct Node {
    id: NodeId,
    public_key: String,
    endpoint: Option<String>,
}

fn overlay_addr(i: usize) -> String {
    format!("10.88.0.{}", i + 1)
}

fn plan(lab: &Lab, nodes: &[Node], me: usize, peers: &[usize]) -> OverlayPlan {
    OverlayPlan {
        interface: lab.interface(me),
        address: format!("{}/16", overlay_addr(me)),
        listen_port: PORT,
        peers: peers
            .iter()
            .map(|&p| OverlayPeer {
                node: nodes[p].id.clone(),
                public_key: nodes[p].public_key.clone(),
                endpoint: nodes[p].endpoint.clone(),
                allowed_ips: vec![format!("{}/32", overlay_addr(p))],
                persistent_keepalive: None,
            })
            .collect(),
    }
}

/// c's port 7001 only from a; its other ports from anyone on the overlay.
fn ruleset(interface: &str) -> String {
    format!(
        "table inet mesh {{}}\n\
         delete table inet mesh\n\
         table inet mesh {{\n\
         \tchain input {{\n\
         \t\ttype filter hook input priority 0; policy accept;\n\
         \t\tiifname \"{interface}\" tcp dport 7001 ip saddr {a} accept\n\
         \t\tiifname \"{interface}\" tcp dport 7001 reject with tcp reset\n\
         \t}}\n\
         }}\n",
        a = overlay_addr(0)
    )
}

fn start_agent(lab: &Lab, i: usize, dir: &Path) -> anyhow::Result<Child> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("agent.log"))?;
    let child = Command::new("ip")
        .args(["netns", "exec", &lab.node_ns(i)])
        .arg(env!("CARGO_BIN_EXE_mesh-agent"))
        .arg("run")
        .arg("--config")
        .arg(dir.join("agent.toml"))
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()?;
    Ok(child)
}

fn ifindex(lab: &Lab, i: usize) -> anyhow::Result<String> {
    let out = sh(
        "ip",
        &[
            "-n",
            &lab.node_ns(i),
            "-o",
            "link",
            "show",
            "dev",
            &lab.interface(i),
        ],
    )?;
    Ok(out.split(':').next().unwrap_or("").trim().to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_hosts_overlay_firewall_restart_and_revocation() -> anyhow::Result<()> {
    if let Some(why) = unavailable() {
        return mesh_testkit::skip(&why);
    }
    let env = TestEnv::new().await?;
    let dirs: Vec<tempfile::TempDir> = (0..3)
        .map(|_| tempfile::tempdir())
        .collect::<Result<_, _>>()?;
    let result = overlay(&env, &dirs).await;
    if result.is_err() || std::env::var_os("MESH_TEST_LOGS").is_some() {
        for (i, d) in dirs.iter().enumerate() {
            let log = std::fs::read_to_string(d.path().join("agent.log")).unwrap_or_default();
            eprintln!("--- agent {i} ---\n{log}");
        }
    }
    env.teardown().await?;
    result
}

async fn overlay(env: &TestEnv, dirs: &[tempfile::TempDir]) -> anyhow::Result<()> {
    let mut lab = Lab::new()?;
    let tls = mesh_testkit::bundle_tls()?;
    let (_admin, ch, consumer) = controller_side(env).await?;
    let mut reports = Reports {
        consumer,
        seen: Vec::new(),
    };

    // An agent per namespace, with its endpoint on the underlay.
    let mut ids = Vec::new();
    for (i, dir) in dirs.iter().enumerate() {
        let creds = env.add_node(["a", "b", "c"][i]).await?;
        let state = dir.path().join("state");
        let root = dir.path().join("root");
        std::fs::create_dir_all(&state)?;
        std::fs::create_dir_all(&root)?;
        creds.write_to_over_tls(&state, &tls)?;
        std::fs::write(
            dir.path().join("agent.toml"),
            format!(
                "state_dir = {state:?}\nroot = {root:?}\nheartbeat_interval = \"500ms\"\n\
                 reconnect_min = \"50ms\"\nreconnect_max = \"500ms\"\nhostname = \"{n}\"\n\
                 [overlay]\nendpoint = \"{ip}\"\nlisten_port = {PORT}\ncheck_interval = \"1s\"\n",
                n = ["a", "b", "c"][i],
                ip = lab.underlay(i),
            ),
        )?;
        declaration_queue_for(&ch, &creds.node).await?;
        ids.push(creds.node.clone());
        lab.agents.push(Some(start_agent(&lab, i, dir.path())?));
    }

    // Each states its public key and endpoint in hello.
    let mut nodes = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        let facts = wait_report(&mut reports, "hello", id, |r| match r {
            Report::Hello(h) => h.overlay.clone(),
            _ => None,
        })
        .await?;
        assert_eq!(
            facts.endpoint.as_deref(),
            Some(format!("{}:{PORT}", lab.underlay(i)).as_str())
        );
        let key = std::fs::read_to_string(dirs[i].path().join("state/wireguard.key"))?;
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(dirs[i].path().join("state/wireguard.key"))?.permissions(),
        );
        assert_eq!(mode & 0o777, 0o600);
        assert_ne!(
            key.trim(),
            facts.public_key,
            "hello states the public key only"
        );
        nodes.push(Node {
            id: id.clone(),
            public_key: facts.public_key,
            endpoint: facts.endpoint,
        });
    }

    // Generation 1: a full mesh; c filters its port 7001.
    for i in 0..3 {
        let peers: Vec<usize> = (0..3).filter(|&p| p != i).collect();
        let items = DeclarationItems {
            overlay: Some(plan(&lab, &nodes, i, &peers)),
            firewall: (i == 2).then(|| FirewallPlan {
                table: "inet mesh".into(),
                ruleset: ruleset(&lab.interface(2)),
            }),
            ..Default::default()
        };
        declare(&ch, env.signer(), &nodes[i].id, 1, items).await?;
    }
    for (i, node) in nodes.iter().enumerate() {
        let a = wait_applied(&mut reports, &node.id, 1).await?;
        item_ok(&a, &format!("overlay:{}", lab.interface(i)))?;
        if i == 2 {
            item_ok(&a, "firewall:inet mesh")?;
        }
    }

    // A TCP connection over the overlay: a → b.
    let b7000: SocketAddr = format!("{}:7000", overlay_addr(1)).parse()?;
    listen(&lab.node_ns(1), b7000)?;
    reaches(&lab.node_ns(0), b7000).await?;

    // The firewall on c: 7001 from a only; 7002 from b too.
    let c7001: SocketAddr = format!("{}:7001", overlay_addr(2)).parse()?;
    let c7002: SocketAddr = format!("{}:7002", overlay_addr(2)).parse()?;
    listen(&lab.node_ns(2), c7001)?;
    listen(&lab.node_ns(2), c7002)?;
    reaches(&lab.node_ns(0), c7001).await?;
    reaches(&lab.node_ns(1), c7002).await?;
    let (nsb, addr) = (lab.node_ns(1), c7001);
    let refused =
        tokio::task::spawn_blocking(move || connect(&nsb, addr, Duration::from_secs(2))).await?;
    match refused {
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {}
        other => bail!("b reached c's port 7001, which only a may: {other:?}"),
    }

    // b's agent restarts: the interface and its wireguard-go are re-adopted.
    let before = ifindex(&lab, 1)?;
    lab.stop_agent(1)?;
    // What runs in b's namespace now the agent is gone: its wireguard-go.
    let wg_go: Vec<u32> = lab.pids(&lab.node_ns(1));
    ensure!(!wg_go.is_empty(), "wireguard-go stopped with the agent");
    reaches(&lab.node_ns(0), b7000).await?;
    reports
        .seen
        .retain(|e| !(e.node == nodes[1].id && matches!(e.body, Report::Hello(_))));
    lab.agents[1] = Some(start_agent(&lab, 1, dirs[1].path())?);
    wait_report(&mut reports, "hello after restart", &nodes[1].id, |r| {
        matches!(r, Report::Hello(_)).then_some(())
    })
    .await?;
    assert_eq!(ifindex(&lab, 1)?, before, "the interface was re-created");
    for p in &wg_go {
        assert!(
            lab.pids(&lab.node_ns(1)).contains(p),
            "wireguard-go {p} was replaced"
        );
    }
    reaches(&lab.node_ns(0), b7000).await?;

    // c revoked: a and b are declared without it.
    for i in 0..2 {
        let items = DeclarationItems {
            overlay: Some(plan(&lab, &nodes, i, &[1 - i])),
            ..Default::default()
        };
        declare(&ch, env.signer(), &nodes[i].id, 2, items).await?;
    }
    for (i, node) in nodes.iter().enumerate().take(2) {
        let a = wait_applied(&mut reports, &node.id, 2).await?;
        item_ok(&a, &format!("overlay:{}", lab.interface(i)))?;
    }
    for from in 0..2 {
        let (ns, addr) = (lab.node_ns(from), c7002);
        let r =
            tokio::task::spawn_blocking(move || connect(&ns, addr, Duration::from_secs(1))).await?;
        ensure!(r.is_err(), "node {from} still reaches revoked c: {r:?}");
    }
    let peers = sh(
        "ip",
        &[
            "netns",
            "exec",
            &lab.node_ns(0),
            "wg",
            "show",
            &lab.interface(0),
            "peers",
        ],
    )?;
    ensure!(
        !peers.contains(&nodes[2].public_key) && peers.contains(&nodes[1].public_key),
        "a's peers after revocation: {peers}"
    );
    reaches(&lab.node_ns(0), b7000).await?;

    drop(lab);
    Ok(())
}

/// Sign `csr` with the CA for `secs` seconds from now (no backdating: the
/// renewal point is then exactly two thirds from now).
fn issue_short(
    ca_pem: &str,
    ca_key: &str,
    name: &str,
    csr: &str,
    secs: i64,
) -> anyhow::Result<mesh_protocol::CertificateItem> {
    let issuer = rcgen::Issuer::from_ca_cert_pem(ca_pem, rcgen::KeyPair::from_pem(ca_key)?)?;
    let mut params = rcgen::CertificateSigningRequestParams::from_pem(csr)?;
    let now = time::OffsetDateTime::now_utc().replace_nanosecond(0)?;
    params.params.not_before = now;
    params.params.not_after = now + time::Duration::seconds(secs);
    let serial: [u8; 8] = rand::random();
    let mut serial = serial.to_vec();
    serial[0] = (serial[0] & 0x7f) | 0x40;
    params.params.serial_number = Some(rcgen::SerialNumber::from_slice(&serial));
    let cert = params.signed_by(&issuer)?;
    let pem = cert.pem();
    let info = mesh_credentials::pki::CertInfo::parse(&pem)?;
    Ok(mesh_protocol::CertificateItem {
        name: name.into(),
        serial: info.serial,
        not_after: info.not_after,
        certificate: pem,
        ca: ca_pem.into(),
    })
}

/// The node asks with a CSR of its own key, installs what is issued, renews
/// at two thirds of the lifetime, and when no renewal comes keeps its
/// certificate and says so. The agent runs in-process; no namespace needed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_are_asked_installed_and_renewed_at_two_thirds() -> anyhow::Result<()> {
    use mesh_credentials::pki;
    let env = TestEnv::new().await?;
    let creds = env.add_node("d").await?;
    let node = creds.node.clone();
    let (_admin, ch, consumer) = controller_side(&env).await?;
    let mut reports = Reports {
        consumer,
        seen: Vec::new(),
    };
    declaration_queue_for(&ch, &node).await?;
    let state = tempfile::tempdir()?;
    let root = mesh_testkit::units_tempdir()?;
    creds.write_to(state.path())?;
    let mut config = mesh_host_agent::Config {
        state_dir: state.path().to_owned(),
        root: root.path().to_owned(),
        heartbeat_interval: Duration::from_millis(500),
        reconnect_min: Duration::from_millis(50),
        reconnect_max: Duration::from_millis(500),
        ..mesh_host_agent::Config::default()
    };
    config.overlay.enabled = false;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let agent = tokio::spawn(mesh_host_agent::run(config, async {
        let _ = stopped.await;
    }));

    let ca = pki::MeshCa::generate("test mesh CA")?;
    let ca_dir = tempfile::tempdir()?;
    ca.write(&ca_dir.path().join("ca.pem"), &ca_dir.path().join("ca.key"))?;
    let ca_key = std::fs::read_to_string(ca_dir.path().join("ca.key"))?;
    let ca_pem = ca.certificate_pem().to_owned();
    let csr_of = |r: &Report| match r {
        Report::Certificates(c) => c
            .requests
            .iter()
            .find(|q| q.name == "node")
            .map(|q| q.csr.clone()),
        _ => None,
    };

    // 1. The first request; the CSR is for the node, signed by its own key.
    let csr = wait_report(&mut reports, "certificate request", &node, csr_of).await?;
    let parsed = pki::Csr::parse(&csr)?;
    assert_eq!(parsed.common_name(), Some(node.as_str()));
    let key = std::fs::read_to_string(state.path().join("certs/node.key"))?;
    assert_eq!(parsed.public_key_der(), pki::public_key_der(&key)?);

    let tls = root.path().join("etc/mesh/tls");
    let mut generation = 0;
    let mut serial = String::new();
    let mut csr = csr;
    // 2. Issue twice; each time the renewal comes at two thirds.
    for _ in 0..2 {
        let item = issue_short(&ca_pem, &ca_key, "node", &csr, 6)?;
        let info = pki::CertInfo::parse(&item.certificate)?;
        generation += 1;
        declare(
            &ch,
            env.signer(),
            &node,
            generation,
            DeclarationItems {
                certificates: vec![item.clone()],
                ..Default::default()
            },
        )
        .await?;
        let a = wait_applied(&mut reports, &node, generation).await?;
        item_ok(&a, "certificate:node")?;
        assert_eq!(
            std::fs::read_to_string(tls.join("node.pem"))?,
            item.certificate
        );
        assert_eq!(std::fs::read_to_string(tls.join("ca.pem"))?, ca_pem);
        let key_mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(tls.join("node.key"))?.permissions(),
        );
        assert_eq!(key_mode & 0o777, 0o600);
        serial = item.serial.clone();
        csr = wait_report(&mut reports, "renewal request", &node, csr_of).await?;
        let asked = chrono::Utc::now();
        let renew_at = info.renew_at();
        assert!(
            asked >= renew_at - chrono::TimeDelta::milliseconds(100),
            "asked at {asked}, before two thirds ({renew_at})"
        );
        assert!(
            asked < renew_at + chrono::TimeDelta::milliseconds(1500),
            "asked at {asked}, long after two thirds ({renew_at})"
        );
        assert!(asked < info.not_after);
    }

    // 3. No renewal comes: the certificate is kept and the delay stated.
    let held = wait_report(&mut reports, "renew_error", &node, |r| match r {
        Report::Certificates(c) => c
            .held
            .iter()
            .find(|h| h.name == "node" && h.renew_error.is_some())
            .cloned(),
        _ => None,
    })
    .await?;
    assert_eq!(held.serial, serial);
    let why = held.renew_error.unwrap_or_default();
    assert!(why.contains("no new certificate yet"), "{why}");
    assert!(tls.join("node.pem").exists());

    let _ = stop.send(());
    timeout(DEADLINE, agent).await???;
    env.teardown().await?;
    Ok(())
}
