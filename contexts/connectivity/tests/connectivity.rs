//! The connectivity context against a real PostgreSQL, one fresh database
//! per test, fed reports and record events the way the controller's router
//! feeds them (inbox first).

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use chrono::Utc;
use mesh_connectivity::{Connectivity, SCHEMA, Settings};
use mesh_credentials::pki::{self, CertInfo, MeshCa};
use mesh_plumbing::{Context, OutboxSignal, inbox};
use mesh_protocol::{
    CertificateIssued, CertificateRequest, Certificates, DeclarationItems, Envelope,
    HeldCertificate, Hello, Labels, ModulePlacement, ModulePort, ModuleRemoved, NodeId,
    NodeIdentityChanged, NodeLabelsChanged, OverlayFacts, PortProtocol, RecordEvent, RecordKind,
    Report,
};
use mesh_testkit::TestEnv;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

struct Fixture {
    env: TestEnv,
    pool: PgPool,
    conn: Arc<Connectivity>,
    ca: Arc<MeshCa>,
    seq: std::sync::atomic::AtomicU64,
}

fn settings(ca: Option<Arc<MeshCa>>) -> Settings {
    Settings {
        ca,
        ..Settings::default()
    }
}

async fn setup() -> Fixture {
    let env = TestEnv::new().await.unwrap();
    let url = env.database_url(SCHEMA);
    let applied = mesh_connectivity::migrate(&url).await.unwrap();
    assert!(!applied.is_empty());
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .unwrap();
    let ca = Arc::new(MeshCa::generate("test mesh CA").unwrap());
    let conn = Arc::new(Connectivity::new(
        pool.clone(),
        OutboxSignal::default(),
        settings(Some(ca.clone())),
    ));
    Fixture {
        env,
        pool,
        conn,
        ca,
        seq: 1.into(),
    }
}

impl Fixture {
    fn node(&self, suffix: &str) -> NodeId {
        NodeId::parse(&format!("{}-{suffix}", self.env.id())).unwrap()
    }

    fn envelope(&self, node: &NodeId, body: Report) -> Envelope<Report> {
        let seq = self.seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Envelope::new(node.clone(), seq, body)
    }

    /// As the router does: the inbox claim, then the handler, one transaction.
    async fn handle(&self, reports: &[Envelope<Report>]) {
        let mut tx = self.pool.begin().await.unwrap();
        let ids: Vec<_> = reports.iter().map(|e| e.id).collect();
        let mut fresh = inbox::claim(&mut tx, SCHEMA, &ids).await.unwrap();
        let fresh: Vec<_> = reports
            .iter()
            .filter(|e| fresh.remove(&e.id))
            .cloned()
            .collect();
        if !fresh.is_empty() {
            self.conn.handle_reports(&mut tx, &fresh).await.unwrap();
        }
        tx.commit().await.unwrap();
    }

    async fn event(&self, kind: RecordKind) {
        let event = RecordEvent::new(kind);
        let mut tx = self.pool.begin().await.unwrap();
        self.conn.handle_events(&mut tx, &[&event]).await.unwrap();
        tx.commit().await.unwrap();
    }

    async fn hello(&self, node: &NodeId, key: Option<String>, endpoint: Option<&str>) {
        let hello = self.envelope(
            node,
            Report::Hello(Hello {
                hostname: "h".into(),
                arch: "x86_64".into(),
                cpus: 1,
                memory_bytes: 1 << 30,
                labels: Labels::new(),
                agent_version: "0.1.0".into(),
                public_key: None,
                seal_key: None,
                overlay: key.map(|public_key| OverlayFacts {
                    public_key,
                    endpoint: endpoint.map(str::to_owned),
                }),
                applied: Default::default(),
                protocol: None,
                outage: None,
                metrics: None,
            }),
        );
        self.handle(&[hello]).await;
    }

    async fn placed(&self, module: &str, version: i64, nodes: &[&NodeId], ports: Vec<ModulePort>) {
        let mut nodes: Vec<NodeId> = nodes.iter().map(|n| (*n).clone()).collect();
        nodes.sort();
        self.event(RecordKind::ModulePlaced(ModulePlacement {
            module: module.into(),
            version,
            nodes,
            settings_files: vec![],
            ports,
            requires: Vec::new(),
            provides: Vec::new(),
        }))
        .await;
    }

    async fn items(&self, node: &NodeId) -> DeclarationItems {
        self.conn
            .section(node)
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("no section for {node}"))
            .items
    }

    async fn generation(&self, node: &NodeId) -> i64 {
        self.conn.section(node).await.unwrap().unwrap().generation
    }

    async fn hosts(&self, node: &NodeId) -> String {
        let items = self.items(node).await;
        let file = items
            .files
            .iter()
            .find(|f| f.path == mesh_connectivity::HOSTS_PATH)
            .expect("the names file");
        assert_eq!(file.mode.bits(), 0o644);
        file.content.clone()
    }

    /// node id → overlay address, from the view.
    async fn addresses(&self) -> BTreeMap<String, String> {
        self.conn
            .overlay_view()
            .await
            .unwrap()
            .nodes
            .into_iter()
            .filter_map(|n| n.address.map(|a| (n.node, a)))
            .collect()
    }

    async fn certificate_count(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM connectivity.certificates")
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    /// The `connectivity.certificate.issued` events in the outbox, oldest
    /// first, decoded as the protocol reads them.
    async fn issued(&self) -> Vec<CertificateIssued> {
        let rows: Vec<Vec<u8>> = sqlx::query_scalar(
            "SELECT payload FROM connectivity.outbox WHERE exchange = 'record' \
             AND routing_key = 'connectivity.certificate.issued' ORDER BY id",
        )
        .fetch_all(&self.pool)
        .await
        .unwrap();
        rows.iter()
            .map(|payload| match RecordEvent::decode(payload).unwrap().kind {
                RecordKind::CertificateIssued(body) => body,
                other => panic!("{other:?}"),
            })
            .collect()
    }
}

/// A WireGuard key (base64 of 32 bytes) that differs by `i`.
fn key(i: u8) -> String {
    format!("{}{}=", char::from(b'A' + i), "A".repeat(42))
}

fn port(name: &str, port: u16, from: &[&str], expose: Option<&str>) -> ModulePort {
    ModulePort {
        name: name.into(),
        port,
        protocol: PortProtocol::Tcp,
        from: from.iter().map(|s| s.to_string()).collect(),
        expose: expose.map(str::to_owned),
    }
}

#[tokio::test]
async fn five_nodes_peer_with_each_other_revoked_ones_leave_and_addresses_last() {
    let f = setup().await;
    let nodes: Vec<NodeId> = ["a", "b", "c", "d", "e"]
        .iter()
        .map(|s| f.node(s))
        .collect();
    for (i, n) in nodes.iter().enumerate() {
        let i = u8::try_from(i).unwrap();
        f.hello(n, Some(key(i)), Some(&format!("192.0.2.{}:51820", i + 1)))
            .await;
    }
    let addresses = f.addresses().await;
    assert_eq!(addresses.len(), 5);
    let unique: BTreeSet<&String> = addresses.values().collect();
    assert_eq!(unique.len(), 5, "addresses collide: {addresses:?}");
    // The lowest free addresses, in the order nodes were first heard of.
    for (i, n) in nodes.iter().enumerate() {
        assert_eq!(addresses[n.as_str()], format!("10.88.0.{}", i + 1));
    }

    for (i, n) in nodes.iter().enumerate() {
        let items = f.items(n).await;
        let plan = items.overlay.expect("an overlay plan");
        plan.validate("overlay").unwrap();
        assert_eq!(plan.interface, "mesh0");
        assert_eq!(plan.address, format!("10.88.0.{}/16", i + 1));
        assert_eq!(plan.listen_port, 51820);
        assert_eq!(plan.peers.len(), 4, "{plan:?}");
        for p in &plan.peers {
            let j = nodes.iter().position(|m| *m == p.node).unwrap();
            assert_ne!(i, j, "a node is not its own peer");
            let j8 = u8::try_from(j).unwrap();
            assert_eq!(p.public_key, key(j8));
            assert_eq!(
                p.endpoint.as_deref(),
                Some(format!("192.0.2.{}:51820", j + 1).as_str())
            );
            assert_eq!(p.allowed_ips, vec![format!("10.88.0.{}/32", j + 1)]);
        }
        assert!(items.firewall.is_some());
        assert!(
            f.hosts(n)
                .await
                .contains(&format!("10.88.0.{} {n} {n}.mesh.internal", i + 1))
        );
    }

    // A node off the overlay (no key) gets its own section only: nobody
    // else's changes.
    let before: Vec<i64> = {
        let mut g = Vec::new();
        for n in &nodes {
            g.push(f.generation(n).await);
        }
        g
    };
    let keyless = f.node("k");
    f.hello(&keyless, None, None).await;
    let items = f.items(&keyless).await;
    assert!(items.overlay.is_none() && items.firewall.is_none());
    assert!(!f.hosts(&keyless).await.contains(keyless.as_str()));
    for (n, g) in nodes.iter().zip(&before) {
        assert_eq!(f.generation(n).await, *g, "{n}");
    }
    // A hello that states the same facts declares nothing new.
    let g = f.generation(&nodes[0]).await;
    f.hello(&nodes[0], Some(key(0)), Some("192.0.2.1:51820"))
        .await;
    assert_eq!(f.generation(&nodes[0]).await, g);
    // A new endpoint reaches every peer.
    f.hello(&nodes[0], Some(key(0)), Some("198.51.100.1:51820"))
        .await;
    let b = f.items(&nodes[1]).await.overlay.unwrap();
    assert_eq!(b.peers[0].endpoint.as_deref(), Some("198.51.100.1:51820"));

    // Judged unreachable, a node stays everyone's peer: nothing is declared.
    let mut gens = Vec::new();
    for n in &nodes {
        gens.push(f.generation(n).await);
    }
    f.event(RecordKind::NodeUnreachable(mesh_protocol::NodeLiveness {
        node: nodes[3].clone(),
        state: mesh_protocol::LivenessState::Unreachable,
        at: Utc::now(),
        last_heard: None,
    }))
    .await;
    for (n, g) in nodes.iter().zip(&gens) {
        assert_eq!(f.generation(n).await, *g, "{n}");
    }

    // Revoke c: it leaves every config and the names, its address is freed.
    let c = nodes[2].clone();
    let gen_c = f.generation(&c).await;
    f.event(RecordKind::NodeRevoked(NodeIdentityChanged {
        node: c.clone(),
        public_key: None,
        at: Utc::now(),
        labels: None,
    }))
    .await;
    for n in nodes.iter().filter(|n| **n != c) {
        let plan = f.items(n).await.overlay.unwrap();
        assert_eq!(plan.peers.len(), 3, "{plan:?}");
        assert!(plan.peers.iter().all(|p| p.node != c));
        assert!(!f.hosts(n).await.contains(c.as_str()));
    }
    assert_eq!(
        f.generation(&c).await,
        gen_c,
        "a revoked node is declared nothing"
    );
    assert!(!f.addresses().await.contains_key(c.as_str()));
    // Its late hello does not bring it back.
    f.hello(&c, Some(key(2)), Some("192.0.2.3:51820")).await;
    assert!(!f.addresses().await.contains_key(c.as_str()));

    // A new node takes the lowest free address: c's.
    let g6 = f.node("f");
    f.hello(&g6, Some(key(9)), None).await;
    assert_eq!(f.addresses().await[g6.as_str()], "10.88.0.3");
    // Behind NAT (no endpoint): it keeps its peers' way open.
    let plan = f.items(&g6).await.overlay.unwrap();
    assert!(
        plan.peers
            .iter()
            .all(|p| p.persistent_keepalive == Some(25))
    );

    // A restart: the context re-opened on the same database keeps every
    // address and declares nothing new.
    let before = f.addresses().await;
    let mut generations = BTreeMap::new();
    for n in nodes.iter().filter(|n| **n != c).chain([&g6]) {
        generations.insert(n.clone(), f.generation(n).await);
    }
    let url = f.env.database_url(SCHEMA);
    assert!(mesh_connectivity::migrate(&url).await.unwrap().is_empty());
    let reopened = Connectivity::new(
        PgPoolOptions::new()
            .max_connections(2)
            .connect(&url)
            .await
            .unwrap(),
        OutboxSignal::default(),
        settings(Some(f.ca.clone())),
    );
    let report = reopened.resync().await.unwrap();
    assert_eq!(report.declared, 0, "{report:?}");
    assert_eq!(f.addresses().await, before);
    for (n, g) in generations {
        assert_eq!(f.generation(&n).await, g);
    }

    // Re-enrolled, c is back once it states a key after it.
    f.event(RecordKind::NodeEnrolled(NodeIdentityChanged {
        node: c.clone(),
        public_key: Some("00".repeat(32)),
        at: Utc::now(),
        labels: None,
    }))
    .await;
    let view = f.conn.overlay_view().await.unwrap();
    let vc = view.nodes.iter().find(|n| n.node == c.as_str()).unwrap();
    assert!(
        vc.public_key.is_none(),
        "the key stated before revocation is forgotten"
    );
    f.hello(&c, Some(key(12)), Some("192.0.2.3:51820")).await;
    let plan = f.items(&nodes[0]).await.overlay.unwrap();
    assert!(
        plan.peers
            .iter()
            .any(|p| p.node == c && p.public_key == key(12))
    );
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn concurrent_hellos_never_share_an_address() {
    let f = setup().await;
    let nodes: Vec<NodeId> = (0..12).map(|i| f.node(&format!("n{i}"))).collect();
    let mut tasks = Vec::new();
    for (i, n) in nodes.iter().enumerate() {
        let env = f.envelope(
            n,
            Report::Hello(Hello {
                hostname: "h".into(),
                arch: "x86_64".into(),
                cpus: 1,
                memory_bytes: 1,
                labels: Labels::new(),
                agent_version: "0.1.0".into(),
                public_key: None,
                seal_key: None,
                overlay: Some(OverlayFacts {
                    public_key: key(u8::try_from(i).unwrap()),
                    endpoint: None,
                }),
                applied: Default::default(),
                protocol: None,
                outage: None,
                metrics: None,
            }),
        );
        let (pool, conn) = (f.pool.clone(), f.conn.clone());
        tasks.push(tokio::spawn(async move {
            let mut tx = pool.begin().await.unwrap();
            conn.handle_reports(&mut tx, &[env]).await.unwrap();
            tx.commit().await.unwrap();
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let addresses = f.addresses().await;
    assert_eq!(addresses.len(), 12);
    let unique: BTreeSet<&String> = addresses.values().collect();
    assert_eq!(unique.len(), 12, "{addresses:?}");
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn a_full_overlay_network_leaves_nodes_without_an_address_and_says_so() {
    let env = TestEnv::new().await.unwrap();
    let url = env.database_url(SCHEMA);
    mesh_connectivity::migrate(&url).await.unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect(&url)
        .await
        .unwrap();
    let mut s = settings(None);
    // Two host addresses.
    s.plan.cidr = mesh_connectivity::Cidr::parse("overlay_cidr", "10.99.0.0/30").unwrap();
    let conn = Connectivity::new(pool.clone(), OutboxSignal::default(), s);
    for (i, name) in ["a", "b", "c"].iter().enumerate() {
        let node = NodeId::parse(&format!("{}-{name}", env.id())).unwrap();
        let hello = Envelope::new(
            node,
            1,
            Report::Hello(Hello {
                hostname: "h".into(),
                arch: "x86_64".into(),
                cpus: 1,
                memory_bytes: 1,
                labels: Labels::new(),
                agent_version: "0.1.0".into(),
                public_key: None,
                seal_key: None,
                overlay: Some(OverlayFacts {
                    public_key: key(u8::try_from(i).unwrap()),
                    endpoint: None,
                }),
                applied: Default::default(),
                protocol: None,
                outage: None,
                metrics: None,
            }),
        );
        let mut tx = pool.begin().await.unwrap();
        conn.handle_reports(&mut tx, &[hello]).await.unwrap();
        tx.commit().await.unwrap();
    }
    let view = conn.overlay_view().await.unwrap();
    assert_eq!(view.unallocated, vec![format!("{}-c", env.id())]);
    let c = NodeId::parse(&format!("{}-c", env.id())).unwrap();
    let items = conn.section(&c).await.unwrap().unwrap().items;
    assert!(items.overlay.is_none(), "no address, no overlay");
    env.teardown().await.unwrap();
}

#[tokio::test]
async fn the_names_file_follows_a_module_scaling_up_and_down() {
    let f = setup().await;
    let (a, b, c) = (f.node("a"), f.node("b"), f.node("c"));
    for (i, n) in [&a, &b, &c].into_iter().enumerate() {
        f.hello(
            n,
            Some(key(u8::try_from(i).unwrap())),
            Some("192.0.2.1:51820"),
        )
        .await;
    }
    let header = "# The mesh's names (connectivity section): declared whole, do not edit.\n";
    let nodes_part = format!(
        "10.88.0.1 {a} {a}.mesh.internal\n10.88.0.2 {b} {b}.mesh.internal\n10.88.0.3 {c} {c}.mesh.internal\n"
    );
    assert_eq!(f.hosts(&a).await, format!("{header}{nodes_part}"));

    f.placed("web", 10, &[&a, &b], vec![]).await;
    let two =
        format!("{header}{nodes_part}10.88.0.1 web.mesh.internal\n10.88.0.2 web.mesh.internal\n");
    for n in [&a, &b, &c] {
        assert_eq!(f.hosts(n).await, two);
    }
    // Scale up to three.
    f.placed("web", 11, &[&a, &b, &c], vec![]).await;
    assert_eq!(
        f.hosts(&c).await,
        format!(
            "{header}{nodes_part}10.88.0.1 web.mesh.internal\n10.88.0.2 web.mesh.internal\n10.88.0.3 web.mesh.internal\n"
        )
    );
    // Down to one; a stale event arriving late changes nothing.
    f.placed("web", 13, &[&b], vec![]).await;
    f.placed("web", 12, &[&a, &b, &c], vec![]).await;
    let one = format!("{header}{nodes_part}10.88.0.2 web.mesh.internal\n");
    assert_eq!(f.hosts(&a).await, one);
    // Removed: no line.
    let g = f.generation(&a).await;
    f.event(RecordKind::ModuleRemoved(ModuleRemoved {
        module: "web".into(),
        version: 14,
    }))
    .await;
    assert_eq!(f.hosts(&a).await, format!("{header}{nodes_part}"));
    assert_eq!(f.generation(&a).await, g + 1);
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn a_module_is_reachable_only_from_the_modules_it_names() {
    let f = setup().await;
    let (a, b, c, d) = (f.node("a"), f.node("b"), f.node("c"), f.node("d"));
    for (i, n) in [&a, &b, &c, &d].into_iter().enumerate() {
        f.hello(
            n,
            Some(key(u8::try_from(i).unwrap())),
            Some("192.0.2.1:51820"),
        )
        .await;
    }
    f.placed(
        "api",
        1,
        &[&a, &b],
        vec![port("http", 8080, &[], Some("api.example.com"))],
    )
    .await;
    f.placed("db", 2, &[&c], vec![port("pg", 5432, &["api"], None)])
        .await;

    let fw = f.items(&c).await.firewall.expect("a ruleset");
    assert_eq!(fw.table, "inet mesh");
    let rules: Vec<&str> = fw.ruleset.lines().map(str::trim).collect();
    // Idempotent shape: the table is created, deleted and created again.
    assert_eq!(
        &rules[1..4],
        [
            "table inet mesh",
            "delete table inet mesh",
            "table inet mesh {"
        ]
    );
    let accept = "ip saddr { 10.88.0.1, 10.88.0.2 } tcp dport 5432 accept";
    assert!(rules.contains(&accept), "{}", fw.ruleset);
    assert!(
        rules.contains(&"tcp dport 5432 drop"),
        "pg is not exposed: {}",
        fw.ruleset
    );
    assert!(rules.contains(&"iifname \"mesh0\" jump overlay"));
    assert!(rules.contains(&"udp dport 51820 accept"));
    // The overlay chain ends in drop: d (no api) reaches nothing on c.
    let overlay: Vec<&str> = rules
        .iter()
        .skip_while(|l| **l != "chain overlay {")
        .take_while(|l| **l != "}")
        .copied()
        .collect();
    assert_eq!(overlay.last(), Some(&"drop"), "{overlay:?}");
    assert!(!fw.ruleset.contains("10.88.0.4"), "d is granted nothing");
    // a runs api: its public port is exposed; no pg rule there.
    let fw_a = f.items(&a).await.firewall.unwrap();
    assert!(
        fw_a.ruleset
            .lines()
            .any(|l| l.trim() == "tcp dport 8080 accept")
    );
    assert!(!fw_a.ruleset.contains("5432"));
    // d joins api: it may reach pg from now on.
    f.placed(
        "api",
        3,
        &[&a, &b, &d],
        vec![port("http", 8080, &[], Some("api.example.com"))],
    )
    .await;
    let fw = f.items(&c).await.firewall.unwrap();
    assert!(
        fw.ruleset
            .contains("ip saddr { 10.88.0.1, 10.88.0.2, 10.88.0.4 } tcp dport 5432 accept")
    );
    // Which nodes serve each public name.
    let view = f.conn.overlay_view().await.unwrap();
    assert_eq!(view.exposures.len(), 1);
    assert_eq!(view.exposures[0].name, "api.example.com");
    assert_eq!(view.exposures[0].nodes.len(), 3);

    // nft itself accepts every ruleset.
    let nft = std::path::Path::new("/usr/sbin/nft");
    if nft.exists() {
        let dir = tempfile::tempdir().unwrap();
        for n in [&a, &b, &c, &d] {
            let fw = f.items(n).await.firewall.unwrap();
            let path = dir.path().join(format!("{n}.nft"));
            std::fs::write(&path, &fw.ruleset).unwrap();
            let out = std::process::Command::new(nft)
                .arg("-c")
                .arg("-f")
                .arg(&path)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "nft -c -f refused the ruleset of {n}: {}\n{}",
                String::from_utf8_lossy(&out.stderr),
                fw.ruleset
            );
        }
    } else {
        // Under MESH_REQUIRE_ALL a missing nft fails the test.
        mesh_testkit::skip("`nft -c -f` of the rulesets: /usr/sbin/nft is not installed").unwrap();
    }
    f.env.teardown().await.unwrap();
}

fn request(name: &str, csr: String) -> CertificateRequest {
    CertificateRequest {
        name: name.into(),
        csr,
    }
}

#[tokio::test]
async fn csrs_are_signed_for_the_sender_only_and_once() {
    let f = setup().await;
    let (a, b) = (f.node("a"), f.node("b"));
    f.hello(&a, Some(key(0)), None).await;
    f.hello(&b, Some(key(1)), None).await;
    let key_a = pki::new_key().unwrap();
    let names = vec![a.to_string(), format!("{a}.mesh.internal")];
    let csr = pki::csr(key_a.expose(), a.as_str(), &names).unwrap();
    let report = f.envelope(
        &a,
        Report::Certificates(Certificates {
            requests: vec![request("node", csr.clone())],
            held: vec![],
        }),
    );
    f.handle(std::slice::from_ref(&report)).await;

    let items = f.items(&a).await;
    assert_eq!(items.certificates.len(), 1);
    let cert = &items.certificates[0];
    cert.validate("c").unwrap();
    assert_eq!(cert.name, "node");
    assert_eq!(cert.ca, f.ca.certificate_pem());
    pki::verify_chain(&cert.certificate, f.ca.certificate_pem()).unwrap();
    let info = CertInfo::parse(&cert.certificate).unwrap();
    assert_eq!(info.common_name.as_deref(), Some(a.as_str()));
    assert!(
        info.dns_names.contains(&a.to_string()),
        "{:?}",
        info.dns_names
    );
    assert_eq!(
        info.public_key_der,
        pki::public_key_der(key_a.expose()).unwrap()
    );
    assert_eq!(info.serial, cert.serial);
    let lifetime = (info.not_after - Utc::now()).num_seconds();
    assert!(
        (23 * 3600..=24 * 3600 + 60).contains(&lifetime),
        "{lifetime}"
    );
    assert_eq!(f.certificate_count().await, 1);
    // The record is told, in the transaction that stored it.
    let issued = f.issued().await;
    assert_eq!(issued.len(), 1, "{issued:?}");
    assert_eq!(issued[0].node, a);
    assert_eq!(issued[0].name, "node");
    assert_eq!(issued[0].serial, cert.serial);
    assert!(
        (issued[0].not_after - info.not_after).num_seconds().abs() <= 1,
        "{issued:?} {}",
        info.not_after
    );

    // Redelivered: the inbox keeps it from minting a second one; the same
    // request in a new report (a CSR made again for the same key and names:
    // other bytes, ECDSA signs at random) is answered with the certificate
    // already issued.
    f.handle(std::slice::from_ref(&report)).await;
    let remade = pki::csr(key_a.expose(), a.as_str(), &names).unwrap();
    assert_ne!(remade, csr);
    let again = f.envelope(
        &a,
        Report::Certificates(Certificates {
            requests: vec![request("node", remade)],
            held: vec![],
        }),
    );
    f.handle(&[again]).await;
    assert_eq!(f.certificate_count().await, 1);
    assert_eq!(f.issued().await.len(), 1, "nothing new to tell");
    // A fresh key at once: refused (one new certificate a minute), nothing signed.
    let fresh = pki::new_key().unwrap();
    let rekey = f.envelope(
        &a,
        Report::Certificates(Certificates {
            requests: vec![request(
                "node",
                pki::csr(fresh.expose(), a.as_str(), &names).unwrap(),
            )],
            held: vec![],
        }),
    );
    f.handle(&[rekey]).await;
    assert_eq!(f.certificate_count().await, 1);
    let view = f.conn.certificates_view(Some(a.as_str())).await.unwrap();
    assert!(
        view.requests[0].reason.contains("ask again later"),
        "{view:?}"
    );

    // b asks for a's name: refused, recorded, nothing signed.
    let key_b = pki::new_key().unwrap();
    let stolen = pki::csr(key_b.expose(), a.as_str(), &names).unwrap();
    let g = f.generation(&b).await;
    let bad = f.envelope(
        &b,
        Report::Certificates(Certificates {
            requests: vec![
                request("node", stolen),
                // b's own CN, a's name among its SANs.
                request(
                    "node",
                    pki::csr(key_b.expose(), b.as_str(), &[a.to_string()]).unwrap(),
                ),
                // A module b does not run.
                request(
                    "db",
                    pki::csr(key_b.expose(), "db.mesh.internal", &["db.mesh.internal".into()])
                        .unwrap(),
                ),
                request("api", "-----BEGIN CERTIFICATE REQUEST-----\ngarbage\n-----END CERTIFICATE REQUEST-----\n".into()),
            ],
            held: vec![],
        }),
    );
    f.handle(&[bad]).await;
    assert_eq!(f.certificate_count().await, 1, "nothing signed for b");
    assert_eq!(f.issued().await.len(), 1, "nothing refused is told");
    assert_eq!(f.generation(&b).await, g);
    assert!(f.items(&b).await.certificates.is_empty());
    let view = f.conn.certificates_view(Some(b.as_str())).await.unwrap();
    assert!(view.certificates.is_empty());
    let reasons: BTreeMap<&str, &str> = view
        .requests
        .iter()
        .map(|r| (r.name.as_str(), r.reason.as_str()))
        .collect();
    assert!(
        view.requests.iter().all(|r| r.status == "refused"),
        "{view:?}"
    );
    // The latest request per name is kept: the SAN refusal replaced the CN one.
    assert!(
        reasons["node"].contains("is not a name of node"),
        "{reasons:?}"
    );
    assert!(reasons["db"].contains("not placed on node"), "{reasons:?}");
    assert!(reasons["api"].contains("CSR"), "{reasons:?}");

    // A module's certificate once the module runs on b.
    f.placed("db", 5, &[&b], vec![]).await;
    let module_key = pki::new_key().unwrap();
    let ok = f.envelope(
        &b,
        Report::Certificates(Certificates {
            requests: vec![request(
                "db",
                pki::csr(
                    module_key.expose(),
                    "db.mesh.internal",
                    &["db.mesh.internal".into()],
                )
                .unwrap(),
            )],
            held: vec![],
        }),
    );
    f.handle(&[ok]).await;
    let items = f.items(&b).await;
    assert_eq!(items.certificates.len(), 1);
    let info = CertInfo::parse(&items.certificates[0].certificate).unwrap();
    assert_eq!(info.dns_names, vec!["db.mesh.internal".to_owned()]);
    let issued = f.issued().await;
    assert_eq!(issued.len(), 2, "{issued:?}");
    assert_eq!((&issued[1].node, issued[1].name.as_str()), (&b, "db"));
    assert_eq!(issued[1].serial, items.certificates[0].serial);
    // As the agent asks (CN and SAN the module's bare name): the mesh name
    // is what it is certified for.
    f.placed("web", 7, &[&b], vec![]).await;
    let web_key = pki::new_key().unwrap();
    let web = f.envelope(
        &b,
        Report::Certificates(Certificates {
            requests: vec![request(
                "web",
                pki::csr(web_key.expose(), "web", &["web".into()]).unwrap(),
            )],
            held: vec![],
        }),
    );
    f.handle(&[web]).await;
    let items = f.items(&b).await;
    let web = items.certificates.iter().find(|c| c.name == "web").unwrap();
    let web_info = CertInfo::parse(&web.certificate).unwrap();
    assert_eq!(web_info.dns_names, vec!["web.mesh.internal".to_owned()]);
    assert_eq!(
        web_info.public_key_der,
        pki::public_key_der(web_key.expose()).unwrap()
    );
    // Moved off b: b is no longer declared db's certificate.
    f.placed("db", 6, &[&a], vec![]).await;
    assert!(
        f.items(&b)
            .await
            .certificates
            .iter()
            .all(|c| c.name != "db")
    );

    // What a node holds, and why it could not renew, shows in the view.
    let serial = f.items(&a).await.certificates[0].serial.clone();
    let held = f.envelope(
        &a,
        Report::Certificates(Certificates {
            requests: vec![],
            held: vec![HeldCertificate {
                name: "node".into(),
                serial: serial.clone(),
                not_after: info.not_after,
                renew_error: Some("controller unreachable".into()),
            }],
        }),
    );
    f.handle(&[held]).await;
    let view = f.conn.certificates_view(Some(a.as_str())).await.unwrap();
    let c = &view.certificates[0];
    assert_eq!(c.serial, serial);
    assert_eq!(c.subject, format!("CN={a}"));
    assert!(c.remaining_secs > 23 * 3600);
    let h = c.held.as_ref().unwrap();
    assert_eq!(h.renew_error.as_deref(), Some("controller unreachable"));

    // Revoked: its certificates are recorded revoked.
    f.event(RecordKind::NodeRevoked(NodeIdentityChanged {
        node: a.clone(),
        public_key: None,
        at: Utc::now(),
        labels: None,
    }))
    .await;
    let view = f.conn.certificates_view(Some(a.as_str())).await.unwrap();
    assert!(view.certificates.iter().all(|c| c.revoked_at.is_some()));
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn without_a_ca_requests_wait_and_are_signed_once_there_is_one() {
    let f = setup().await;
    let no_ca = Connectivity::new(f.pool.clone(), OutboxSignal::default(), settings(None));
    let a = f.node("a");
    let key_a = pki::new_key().unwrap();
    let csr = pki::csr(key_a.expose(), a.as_str(), &[]).unwrap();
    let report = f.envelope(
        &a,
        Report::Certificates(Certificates {
            requests: vec![request("node", csr)],
            held: vec![],
        }),
    );
    let mut tx = f.pool.begin().await.unwrap();
    no_ca.handle_reports(&mut tx, &[report]).await.unwrap();
    tx.commit().await.unwrap();
    let view = no_ca.certificates_view(None).await.unwrap();
    assert!(view.certificates.is_empty());
    assert!(f.issued().await.is_empty(), "nothing signed, nothing told");
    assert_eq!(view.requests.len(), 1);
    assert_eq!(view.requests[0].status, "waiting");
    assert_eq!(view.requests[0].reason, "no CA configured");

    // The controller comes back with a CA: the resync signs what waited.
    mesh_plumbing::section::resync(&*f.conn).await.unwrap();
    let items = f.items(&a).await;
    assert_eq!(items.certificates.len(), 1);
    let info = CertInfo::parse(&items.certificates[0].certificate).unwrap();
    let issued = f.issued().await;
    assert_eq!(issued.len(), 1, "{issued:?}");
    assert_eq!((&issued[0].node, issued[0].name.as_str()), (&a, "node"));
    assert_eq!(issued[0].serial, items.certificates[0].serial);
    // No names asked for: both of the node's.
    assert_eq!(
        info.dns_names,
        vec![a.to_string(), format!("{a}.mesh.internal")]
    );
    assert!(
        f.conn
            .certificates_view(None)
            .await
            .unwrap()
            .requests
            .is_empty()
    );
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn hub_and_spoke_follows_the_hub_label() {
    let env = TestEnv::new().await.unwrap();
    let url = env.database_url(SCHEMA);
    mesh_connectivity::migrate(&url).await.unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect(&url)
        .await
        .unwrap();
    let mut s = settings(None);
    s.plan.policy = mesh_connectivity::Policy::HubAndSpoke;
    let conn = Connectivity::new(pool.clone(), OutboxSignal::default(), s);
    let ids: Vec<NodeId> = ["hub", "s1", "s2"]
        .iter()
        .map(|n| NodeId::parse(&format!("{}-{n}", env.id())).unwrap())
        .collect();
    let mut tx = pool.begin().await.unwrap();
    for (i, n) in ids.iter().enumerate() {
        let hello = Envelope::new(
            n.clone(),
            1,
            Report::Hello(Hello {
                hostname: "h".into(),
                arch: "x86_64".into(),
                cpus: 1,
                memory_bytes: 1,
                labels: Labels::new(),
                agent_version: "0.1.0".into(),
                public_key: None,
                seal_key: None,
                overlay: Some(OverlayFacts {
                    public_key: key(u8::try_from(i).unwrap()),
                    endpoint: Some("192.0.2.9:51820".into()),
                }),
                applied: Default::default(),
                protocol: None,
                outage: None,
                metrics: None,
            }),
        );
        conn.handle_reports(&mut tx, &[hello]).await.unwrap();
    }
    let mut labels = Labels::new();
    labels.insert(mesh_connectivity::HUB_LABEL.into(), "true".into());
    let joined = RecordEvent::new(RecordKind::NodeJoined(NodeLabelsChanged {
        node: ids[0].clone(),
        labels,
        version: 1,
    }));
    conn.handle_events(&mut tx, &[&joined]).await.unwrap();
    tx.commit().await.unwrap();
    let spoke = conn
        .section(&ids[1])
        .await
        .unwrap()
        .unwrap()
        .items
        .overlay
        .unwrap();
    assert_eq!(spoke.peers.len(), 1);
    assert_eq!(spoke.peers[0].node, ids[0]);
    assert_eq!(spoke.peers[0].allowed_ips, vec!["10.88.0.0/16".to_owned()]);
    let hub = conn
        .section(&ids[0])
        .await
        .unwrap()
        .unwrap()
        .items
        .overlay
        .unwrap();
    assert_eq!(hub.peers.len(), 2);
    env.teardown().await.unwrap();
}
