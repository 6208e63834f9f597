//! The node's WireGuard overlay: its key pair, and the interface the
//! connectivity section declares, applied for real.
//!
//! - **The key.** `<state_dir>/wireguard.key`: the private key in base64 (as
//!   `wg genkey` prints it), mode 0600, made once on the node and never sent,
//!   logged or put on a command line. Its public key is stated in every hello
//!   ([`mesh_protocol::OverlayFacts`]).
//! - **The interface.** Through the kernel's WireGuard where `ip link add
//!   <if> type wireguard` works, else through `wireguard-go <if>` (userspace,
//!   over `/dev/net/tun`). wireguard-go daemonizes: it is started in its own
//!   process group, outside the agent's, so it outlives the agent (traffic
//!   keeps flowing while the agent restarts or upgrades) and is re-adopted by
//!   the next agent as it is: an interface that exists is configured, never
//!   re-created. Its supervision is level-triggered: every check (at start,
//!   on each declaration and every `check_interval`) makes the interface
//!   exist and match; a wireguard-go that died took its interface with it, so
//!   the next check starts a new one.
//! - **The configuration.** `wg syncconf` from a mode-0600 temporary file
//!   (the private key never on a command line): only what differs changes, so
//!   a re-applied identical plan touches nothing and live sessions survive,
//!   and the peer set becomes exactly the declared one (a removed peer is
//!   removed). Then the declared address (`ip address replace`, any other
//!   global address on the interface removed), routes for allowed addresses
//!   outside the overlay's prefix (`proto static`, the stale ones removed),
//!   and `ip link set up`.
//! - **Removal.** A generation without an overlay removes the interface the
//!   agent applied (`ip link del`; wireguard-go exits with it).

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use base64::Engine as _;
use mesh_protocol::{OverlayFacts, OverlayPlan, Secret, validate_cidr};

use crate::command::{self, PrivateFile, ToolError};
use crate::config::OverlayConfig;

/// The private key's file in the state directory.
pub const KEY_FILE: &str = "wireguard.key";

/// Why the key could not be loaded or made.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("WireGuard key {path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("WireGuard key {path} is not a base64 32-byte key")]
    Malformed { path: PathBuf },
}

/// The node's WireGuard key pair.
#[derive(Clone)]
pub struct WireguardKey {
    private: Secret<String>,
    public: String,
}

impl std::fmt::Debug for WireguardKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WireguardKey")
            .field("public", &self.public)
            .finish_non_exhaustive()
    }
}

impl WireguardKey {
    /// From the 32 bytes of a private key (clamped as `wg genkey` does).
    pub fn from_bytes(mut bytes: [u8; 32]) -> WireguardKey {
        bytes[0] &= 248;
        bytes[31] = (bytes[31] & 127) | 64;
        let secret = x25519_dalek::StaticSecret::from(bytes);
        let public = x25519_dalek::PublicKey::from(&secret);
        let b64 = base64::engine::general_purpose::STANDARD;
        WireguardKey {
            private: Secret::new(b64.encode(secret.to_bytes())),
            public: b64.encode(public.as_bytes()),
        }
    }

    /// Parse a private key as `wg genkey` prints it.
    pub fn parse(text: &str) -> Option<WireguardKey> {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(text.trim())
            .ok()?;
        Some(WireguardKey::from_bytes(bytes.try_into().ok()?))
    }

    /// Base64, as `wg pubkey` prints it.
    pub fn public(&self) -> &str {
        &self.public
    }

    /// `<state_dir>/wireguard.key`, made (fresh, mode 0600) when missing;
    /// `true` when it was made now.
    pub fn load_or_create(state_dir: &Path) -> Result<(WireguardKey, bool), KeyError> {
        let path = state_dir.join(KEY_FILE);
        let io = |error| KeyError::Io {
            path: path.clone(),
            error,
        };
        match std::fs::read_to_string(&path) {
            Ok(text) => {
                let key = WireguardKey::parse(&text)
                    .ok_or_else(|| KeyError::Malformed { path: path.clone() })?;
                Ok((key, false))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                std::fs::create_dir_all(state_dir).map_err(io)?;
                let key = WireguardKey::from_bytes(rand::random());
                let text = format!("{}\n", key.private.expose());
                crate::store::write_atomic(&path, text.as_bytes(), 0o600).map_err(io)?;
                Ok((key, true))
            }
            Err(e) => Err(io(e)),
        }
    }
}

/// The `[Interface]` and `[Peer]` sections `wg syncconf` reads.
pub fn render_config(key: &WireguardKey, plan: &OverlayPlan) -> Secret<String> {
    let mut text = format!(
        "[Interface]\nPrivateKey = {}\nListenPort = {}\n",
        key.private.expose(),
        plan.listen_port
    );
    for p in &plan.peers {
        text.push_str(&format!(
            "\n# {}\n[Peer]\nPublicKey = {}\nAllowedIPs = {}\n",
            p.node,
            p.public_key,
            p.allowed_ips.join(", ")
        ));
        if let Some(e) = &p.endpoint {
            text.push_str(&format!("Endpoint = {e}\n"));
        }
        if let Some(k) = p.persistent_keepalive {
            text.push_str(&format!("PersistentKeepalive = {k}\n"));
        }
    }
    Secret::new(text)
}

/// How an interface is driven.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Driver {
    Kernel,
    WireguardGo,
}

impl Driver {
    pub fn as_str(self) -> &'static str {
        match self {
            Driver::Kernel => "kernel",
            Driver::WireguardGo => "wireguard-go",
        }
    }
}

/// What applying a plan did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    pub driver: Driver,
    /// The interface was made now (else an existing one was adopted).
    pub created: bool,
}

/// Why a plan could not be applied: the item's error in the `applied` report.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OverlayError {
    #[error("overlay is disabled in this agent's config ([overlay] enabled = false)")]
    Disabled,
    #[error("wireguard-go not found and the kernel has no wireguard module ({kernel})")]
    NoWireguard { kernel: String },
    #[error("cannot start wireguard-go: {0}")]
    WireguardGo(String),
    #[error("{interface} exists but is not a WireGuard interface: {error}")]
    NotWireguard { interface: String, error: String },
    #[error("{0}")]
    Tool(#[from] ToolError),
    #[error("{0}")]
    Io(String),
}

/// Applies the declared interface with the host's tools.
#[derive(Debug, Clone)]
pub struct Overlay {
    config: OverlayConfig,
    /// Where the temporary config files go (in the state directory).
    tmp_dir: PathBuf,
    key: WireguardKey,
}

impl Overlay {
    pub fn new(config: OverlayConfig, state_dir: &Path, key: WireguardKey) -> Overlay {
        Overlay {
            config,
            tmp_dir: state_dir.join("tmp"),
            key,
        }
    }

    pub fn key(&self) -> &WireguardKey {
        &self.key
    }

    /// What hello states: the public key and the configured endpoint.
    pub fn facts(&self) -> OverlayFacts {
        OverlayFacts {
            public_key: self.key.public.clone(),
            endpoint: self.config.stated_endpoint(),
        }
    }

    fn ip(&self, args: &[&str]) -> Result<String, ToolError> {
        command::run(&self.config.ip, args, None)
    }

    /// Whether `interface` exists (`ip link show`).
    pub fn exists(&self, interface: &str) -> Result<bool, ToolError> {
        match self.ip(&["-o", "link", "show", "dev", interface]) {
            Ok(_) => Ok(true),
            Err(ToolError::Failed { output, .. })
                if output.contains("does not exist") || output.contains("Cannot find device") =>
            {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Make the interface exist and match `plan`; idempotent.
    pub fn apply(&self, plan: &OverlayPlan) -> Result<Applied, OverlayError> {
        let iface = plan.interface.as_str();
        let (driver, created) = if self.exists(iface)? {
            (self.driver_of(iface), false)
        } else {
            (self.create(iface)?, true)
        };
        // The configuration: only what differs changes (wg syncconf).
        let conf = render_config(&self.key, plan);
        let file = PrivateFile::new(&self.tmp_dir, iface, conf.expose().as_bytes())
            .map_err(|e| OverlayError::Io(format!("temporary config file: {e}")))?;
        let path = file
            .path_str()
            .map_err(|e| OverlayError::Io(e.to_string()))?;
        match command::run(&self.config.wg, &["syncconf", iface, path], None) {
            Ok(_) => {}
            Err(ToolError::Failed { output, .. }) if !created => {
                return Err(OverlayError::NotWireguard {
                    interface: iface.to_owned(),
                    error: output,
                });
            }
            Err(e) => return Err(e.into()),
        }
        drop(file);
        self.set_address(iface, &plan.address)?;
        self.set_routes(iface, plan)?;
        self.ip(&["link", "set", "dev", iface, "up"])?;
        Ok(Applied { driver, created })
    }

    /// Remove an interface the agent applied (gone already is fine).
    pub fn remove(&self, interface: &str) -> Result<(), OverlayError> {
        if self.exists(interface)? {
            self.ip(&["link", "del", "dev", interface])?;
        }
        Ok(())
    }

    /// wireguard-go keeps its control socket in `/var/run/wireguard`.
    fn driver_of(&self, iface: &str) -> Driver {
        if Path::new("/var/run/wireguard")
            .join(format!("{iface}.sock"))
            .exists()
        {
            Driver::WireguardGo
        } else {
            Driver::Kernel
        }
    }

    fn create(&self, iface: &str) -> Result<Driver, OverlayError> {
        let kernel = if self.config.kernel {
            match self.ip(&["link", "add", "dev", iface, "type", "wireguard"]) {
                Ok(_) => return Ok(Driver::Kernel),
                Err(ToolError::Failed { output, .. }) => {
                    format!("ip link add type wireguard: {output}")
                }
                Err(e) => return Err(e.into()),
            }
        } else {
            "the kernel's WireGuard is not used ([overlay] kernel = false)".to_owned()
        };
        let mut cmd = Command::new(&self.config.wireguard_go);
        // It daemonizes (its child gets /dev/null for output unless LOG_LEVEL
        // is set) in a process group of its own: no signal meant for the
        // agent's group reaches it, and it outlives the agent.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        cmd.env_remove("WG_PROCESS_FOREGROUND")
            .env_remove("LOG_LEVEL")
            .env_remove("WG_TUN_FD")
            .env_remove("WG_UAPI_FD");
        match command::run_with(cmd, &self.config.wireguard_go, &[iface], None) {
            Ok(_) => {}
            Err(e) if e.is_not_found() => return Err(OverlayError::NoWireguard { kernel }),
            Err(e) => return Err(OverlayError::WireguardGo(e.to_string())),
        }
        // The daemon answers on its control socket once `wg show` works.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match command::run(&self.config.wg, &["show", iface, "public-key"], None) {
                Ok(_) => return Ok(Driver::WireguardGo),
                Err(e) if Instant::now() >= deadline => {
                    return Err(OverlayError::WireguardGo(format!(
                        "it started but does not answer: {e}"
                    )));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }

    /// The declared address, and no other global one.
    fn set_address(&self, iface: &str, address: &str) -> Result<(), OverlayError> {
        let want = validate_cidr("address", address)
            .map_err(|e| OverlayError::Io(format!("declared address: {e}")))?;
        let shown = self.ip(&["-o", "address", "show", "dev", iface])?;
        for have in parse_addresses(&shown) {
            if validate_cidr("address", &have).ok() != Some(want) {
                self.ip(&["address", "del", &have, "dev", iface])?;
            }
        }
        self.ip(&["address", "replace", address, "dev", iface])?;
        Ok(())
    }

    /// Routes for allowed addresses outside the interface's own prefix (a
    /// hub's); the kernel routes the prefix itself.
    fn set_routes(&self, iface: &str, plan: &OverlayPlan) -> Result<(), OverlayError> {
        let own = validate_cidr("address", &plan.address)
            .map(|(ip, len)| network(ip, len))
            .map_err(|e| OverlayError::Io(format!("declared address: {e}")))?;
        let mut want: Vec<(IpAddr, u8)> = plan
            .peers
            .iter()
            .flat_map(|p| &p.allowed_ips)
            .filter_map(|a| validate_cidr("allowed_ips", a).ok())
            .map(|(ip, len)| network(ip, len))
            .filter(|net| !contains(own, *net))
            .collect();
        want.sort();
        want.dedup();
        let mut have = Vec::new();
        for family in ["-4", "-6"] {
            let shown = self.ip(&[
                family, "-o", "route", "show", "dev", iface, "proto", "static",
            ])?;
            have.extend(parse_routes(&shown));
        }
        for r in &have {
            if !want.contains(r) {
                self.ip(&["route", "del", &cidr(*r), "dev", iface, "proto", "static"])?;
            }
        }
        for r in want {
            self.ip(&[
                "route",
                "replace",
                &cidr(r),
                "dev",
                iface,
                "proto",
                "static",
            ])?;
        }
        Ok(())
    }
}

/// The global addresses `ip -o address show` lists (link-local ones skipped).
fn parse_addresses(shown: &str) -> Vec<String> {
    shown
        .lines()
        .filter(|l| !l.contains("scope link") && !l.contains("scope host"))
        .filter_map(|l| {
            let mut t = l.split_whitespace();
            t.find(|w| *w == "inet" || *w == "inet6")?;
            t.next().map(str::to_owned)
        })
        .collect()
}

/// The destinations `ip -o route show` lists.
fn parse_routes(shown: &str) -> Vec<(IpAddr, u8)> {
    shown
        .lines()
        .filter_map(|l| {
            let dst = l.split_whitespace().next()?;
            let (ip, len) = match dst.split_once('/') {
                Some((ip, len)) => (ip.parse::<IpAddr>().ok()?, len.parse::<u8>().ok()?),
                None => {
                    let ip = dst.parse::<IpAddr>().ok()?;
                    (ip, if ip.is_ipv4() { 32 } else { 128 })
                }
            };
            Some(network(ip, len))
        })
        .collect()
}

fn cidr((ip, len): (IpAddr, u8)) -> String {
    format!("{ip}/{len}")
}

/// The network of an address: its host bits cleared.
fn network(ip: IpAddr, len: u8) -> (IpAddr, u8) {
    match ip {
        IpAddr::V4(v4) => {
            let bits = u32::from(v4);
            let mask = if len == 0 {
                0
            } else {
                u32::MAX << (32 - u32::from(len.min(32)))
            };
            (IpAddr::V4((bits & mask).into()), len)
        }
        IpAddr::V6(v6) => {
            let bits = u128::from(v6);
            let mask = if len == 0 {
                0
            } else {
                u128::MAX << (128 - u32::from(len.min(128)))
            };
            (IpAddr::V6((bits & mask).into()), len)
        }
    }
}

/// Whether network `inner` lies inside network `outer`.
fn contains(outer: (IpAddr, u8), inner: (IpAddr, u8)) -> bool {
    outer.0.is_ipv4() == inner.0.is_ipv4()
        && inner.1 >= outer.1
        && network(inner.0, outer.1) == outer
}

#[cfg(test)]
mod tests {
    use super::*;
    use mesh_protocol::{NodeId, OverlayPeer};

    #[test]
    fn keys_round_trip_and_match_wg() {
        let key = WireguardKey::from_bytes([7; 32]);
        let again = WireguardKey::parse(key.private.expose()).unwrap();
        assert_eq!(key.public(), again.public());
        mesh_protocol::validate_wireguard_key("k", key.public()).unwrap();
        assert!(!format!("{key:?}").contains(key.private.expose().as_str()));
        // Where wireguard-tools is installed, `wg pubkey` agrees.
        if let Ok(out) = command::run(
            Path::new("wg"),
            &["pubkey"],
            Some(key.private.expose().as_bytes()),
        ) {
            assert_eq!(out.trim(), key.public());
        }
    }

    #[test]
    fn key_file_is_made_once_with_mode_0600() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let (a, made) = WireguardKey::load_or_create(dir.path()).unwrap();
        assert!(made);
        let (b, made) = WireguardKey::load_or_create(dir.path()).unwrap();
        assert!(!made);
        assert_eq!(a.public(), b.public());
        let mode = std::fs::metadata(dir.path().join(KEY_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        std::fs::write(dir.path().join(KEY_FILE), "nonsense").unwrap();
        let e = WireguardKey::load_or_create(dir.path()).unwrap_err();
        assert!(e.to_string().contains("not a base64 32-byte key"), "{e}");
    }

    #[test]
    fn config_lists_exactly_the_declared_peers() {
        let key = WireguardKey::from_bytes([1; 32]);
        let peer = WireguardKey::from_bytes([2; 32]);
        let plan = OverlayPlan {
            interface: "mesh0".into(),
            address: "10.88.0.2/16".into(),
            listen_port: 51820,
            peers: vec![OverlayPeer {
                node: NodeId::parse("b").unwrap(),
                public_key: peer.public().to_owned(),
                endpoint: Some("10.201.0.3:51820".into()),
                allowed_ips: vec!["10.88.0.3/32".into(), "10.99.0.0/24".into()],
                persistent_keepalive: Some(25),
            }],
        };
        let text = render_config(&key, &plan);
        let text = text.expose();
        assert!(text.contains("ListenPort = 51820"));
        assert!(text.contains(&format!("PublicKey = {}", peer.public())));
        assert!(text.contains("AllowedIPs = 10.88.0.3/32, 10.99.0.0/24"));
        assert!(text.contains("Endpoint = 10.201.0.3:51820"));
        assert!(text.contains("PersistentKeepalive = 25"));
        assert_eq!(text.matches("[Peer]").count(), 1);
    }

    #[test]
    fn addresses_routes_and_networks() {
        let shown = "5: mesh0    inet 10.88.0.2/16 scope global mesh0\\       valid_lft forever\n\
                     5: mesh0    inet6 fe80::1/64 scope link \\       valid_lft forever\n";
        assert_eq!(parse_addresses(shown), vec!["10.88.0.2/16".to_owned()]);
        let routes =
            parse_routes("10.99.0.0/24 proto static scope link \n10.77.0.5 proto static\n");
        assert_eq!(
            routes,
            vec![
                ("10.99.0.0".parse().unwrap(), 24),
                ("10.77.0.5".parse().unwrap(), 32)
            ]
        );
        let own = network("10.88.0.2".parse().unwrap(), 16);
        assert_eq!(own, ("10.88.0.0".parse().unwrap(), 16));
        assert!(contains(own, network("10.88.3.4".parse().unwrap(), 32)));
        assert!(!contains(own, network("10.99.0.0".parse().unwrap(), 24)));
        assert!(!contains(own, network("10.0.0.0".parse().unwrap(), 8)));
    }
}
