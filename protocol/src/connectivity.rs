//! The connectivity vocabulary: what a node states about its overlay (in
//! hello), the certificates it asks for and holds (the `certificates` report),
//! and what the connectivity section tells it (its WireGuard interface and
//! peers, its nftables ruleset, its certificates). The names file travels as a
//! plain file item.

use std::net::{IpAddr, SocketAddr};

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::{DecodeError, NodeId, validate_module_name};

/// The most peers one overlay declaration lists.
pub const MAX_PEERS: usize = 4096;
/// The most certificates a node asks for or holds at once (its own and one
/// per module it runs).
pub const MAX_CERTIFICATES: usize = 64;
/// Largest PEM text of one CSR or certificate, in bytes.
pub const MAX_PEM_BYTES: usize = 16 * 1024;
/// Largest nftables ruleset, in bytes.
pub const MAX_RULESET_BYTES: usize = 256 * 1024;
/// The certificate name of the node's own certificate; any other name is a
/// module's ([`validate_module_name`]).
pub const NODE_CERTIFICATE: &str = "node";

/// Check a WireGuard key as `wg` prints it: base64 of 32 bytes (44 characters).
pub fn validate_wireguard_key(field: &str, key: &str) -> Result<(), DecodeError> {
    use base64::Engine as _;
    match base64::engine::general_purpose::STANDARD.decode(key) {
        Ok(bytes) if bytes.len() == 32 && key.len() == 44 => Ok(()),
        _ => Err(DecodeError::invalid(
            field,
            "a WireGuard key: base64 of 32 bytes (44 characters)",
        )),
    }
}

/// Check an endpoint: `ip:port` (IPv6 in brackets).
pub fn validate_endpoint(field: &str, endpoint: &str) -> Result<(), DecodeError> {
    endpoint.parse::<SocketAddr>().map(|_| ()).map_err(|_| {
        DecodeError::invalid(
            field,
            format!(
                "`{}`: an endpoint is ip:port",
                endpoint.chars().take(80).collect::<String>()
            ),
        )
    })
}

/// Check an address with prefix length, such as `10.88.0.2/16` or `10.88.0.2/32`.
pub fn validate_cidr(field: &str, cidr: &str) -> Result<(IpAddr, u8), DecodeError> {
    let bad = || {
        DecodeError::invalid(
            field,
            format!(
                "`{}`: an address with a prefix length, such as 10.88.0.2/32",
                cidr.chars().take(80).collect::<String>()
            ),
        )
    };
    let (ip, len) = cidr.split_once('/').ok_or_else(bad)?;
    let ip: IpAddr = ip.parse().map_err(|_| bad())?;
    let len: u8 = len.parse().map_err(|_| bad())?;
    let max = if ip.is_ipv4() { 32 } else { 128 };
    if len > max {
        return Err(bad());
    }
    Ok((ip, len))
}

/// Check a certificate's name: [`NODE_CERTIFICATE`] or a module's name.
pub fn validate_certificate_name(field: &str, name: &str) -> Result<(), DecodeError> {
    if name == NODE_CERTIFICATE {
        return Ok(());
    }
    validate_module_name(field, name)
}

fn validate_pem(field: &str, pem: &str, label: &str) -> Result<(), DecodeError> {
    if pem.len() > MAX_PEM_BYTES {
        return Err(DecodeError::invalid(
            field,
            format!("{} bytes, limit {MAX_PEM_BYTES}", pem.len()),
        ));
    }
    if !pem.contains(&format!("-----BEGIN {label}-----")) {
        return Err(DecodeError::invalid(field, format!("not a PEM {label}")));
    }
    Ok(())
}

/// What a node states about its overlay, in hello: its WireGuard public key
/// (the private key never leaves the node) and where its peers reach it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OverlayFacts {
    /// Base64 WireGuard public key.
    pub public_key: String,
    /// `ip:port` its peers send to; absent: the node is reachable only by
    /// peers it contacts first (behind NAT).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
}

impl OverlayFacts {
    pub fn validate(&self, field: &str) -> Result<(), DecodeError> {
        validate_wireguard_key(&format!("{field}.public_key"), &self.public_key)?;
        if let Some(e) = &self.endpoint {
            validate_endpoint(&format!("{field}.endpoint"), e)?;
        }
        Ok(())
    }
}

/// The node's WireGuard interface as the connectivity section declares it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct OverlayPlan {
    /// Interface name, such as `mesh0` (1 to 15 of `[a-z0-9_-]`).
    pub interface: String,
    /// The node's own overlay address with the overlay's prefix length
    /// (`10.88.0.2/16`).
    pub address: String,
    /// UDP port the interface listens on.
    pub listen_port: u16,
    /// Sorted by node.
    pub peers: Vec<OverlayPeer>,
}

/// One peer of a node's WireGuard interface.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct OverlayPeer {
    pub node: NodeId,
    pub public_key: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// Addresses routed to this peer (`10.88.0.3/32`; a hub carries more).
    pub allowed_ips: Vec<String>,
    /// Seconds between keepalives; absent: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistent_keepalive: Option<u16>,
}

impl OverlayPlan {
    pub fn validate(&self, field: &str) -> Result<(), DecodeError> {
        let iface_ok = !self.interface.is_empty()
            && self.interface.len() <= 15
            && self
                .interface
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-');
        if !iface_ok {
            return Err(DecodeError::invalid(
                format!("{field}.interface"),
                "1 to 15 characters of a-z 0-9 _ -",
            ));
        }
        validate_cidr(&format!("{field}.address"), &self.address)?;
        if self.peers.len() > MAX_PEERS {
            return Err(DecodeError::invalid(
                format!("{field}.peers"),
                format!("more than {MAX_PEERS} peers"),
            ));
        }
        for (i, p) in self.peers.iter().enumerate() {
            let at = format!("{field}.peers[{i}]");
            validate_wireguard_key(&format!("{at}.public_key"), &p.public_key)?;
            if let Some(e) = &p.endpoint {
                validate_endpoint(&format!("{at}.endpoint"), e)?;
            }
            if p.allowed_ips.is_empty() || p.allowed_ips.len() > MAX_PEERS {
                return Err(DecodeError::invalid(
                    format!("{at}.allowed_ips"),
                    format!("1 to {MAX_PEERS} addresses"),
                ));
            }
            for (j, a) in p.allowed_ips.iter().enumerate() {
                validate_cidr(&format!("{at}.allowed_ips[{j}]"), a)?;
            }
        }
        Ok(())
    }
}

/// The node's packet filter as the connectivity section declares it: one
/// nftables table, replaced whole (`nft -f`); the ruleset deletes and
/// re-creates only its own table, so it leaves the host's other tables alone.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct FirewallPlan {
    /// The table the ruleset owns (`inet mesh`).
    pub table: String,
    /// The whole ruleset, as `nft -f` reads it.
    pub ruleset: String,
}

impl FirewallPlan {
    pub fn validate(&self, field: &str) -> Result<(), DecodeError> {
        let ok = !self.table.is_empty()
            && self.table.len() <= 64
            && self
                .table
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b' ');
        if !ok {
            return Err(DecodeError::invalid(
                format!("{field}.table"),
                "1 to 64 characters of A-Z a-z 0-9 _ - and space",
            ));
        }
        if self.ruleset.len() > MAX_RULESET_BYTES || self.ruleset.contains('\0') {
            return Err(DecodeError::invalid(
                format!("{field}.ruleset"),
                format!("at most {MAX_RULESET_BYTES} bytes, no NUL"),
            ));
        }
        Ok(())
    }
}

/// A certificate the connectivity section hands a node: issued by the mesh
/// CA for a CSR the node sent, so the key it certifies never left the node.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CertificateItem {
    /// [`NODE_CERTIFICATE`] or a module's name.
    pub name: String,
    /// Hex serial number.
    pub serial: String,
    pub not_after: DateTime<Utc>,
    /// The certificate (PEM).
    pub certificate: String,
    /// The mesh CA's certificate (PEM): what the node verifies peers against.
    pub ca: String,
}

impl CertificateItem {
    pub fn validate(&self, field: &str) -> Result<(), DecodeError> {
        validate_certificate_name(&format!("{field}.name"), &self.name)?;
        validate_serial(&format!("{field}.serial"), &self.serial)?;
        validate_pem(
            &format!("{field}.certificate"),
            &self.certificate,
            "CERTIFICATE",
        )?;
        validate_pem(&format!("{field}.ca"), &self.ca, "CERTIFICATE")
    }
}

fn validate_serial(field: &str, serial: &str) -> Result<(), DecodeError> {
    if serial.is_empty() || serial.len() > 64 || !serial.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(DecodeError::invalid(field, "1 to 64 hex digits"));
    }
    Ok(())
}

/// The `certificates` report: the certificates a node asks for (a CSR signed
/// by a key that never leaves it) and those it holds, with their expiry and,
/// where renewal failed, why. State: persistent and confirmed, sent at start,
/// on every request and after every renewal attempt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Certificates {
    #[serde(default)]
    pub requests: Vec<CertificateRequest>,
    #[serde(default)]
    pub held: Vec<HeldCertificate>,
}

/// A certificate signing request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CertificateRequest {
    /// [`NODE_CERTIFICATE`] or a module's name: what the certificate is for.
    pub name: String,
    /// The CSR (PEM, PKCS#10).
    pub csr: String,
}

/// A certificate a node holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldCertificate {
    pub name: String,
    pub serial: String,
    pub not_after: DateTime<Utc>,
    /// Why the last renewal did not happen (none: renewal is not due or went well).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub renew_error: Option<String>,
}

impl Certificates {
    pub(crate) fn validate(&self) -> Result<(), DecodeError> {
        if self.requests.len() > MAX_CERTIFICATES || self.held.len() > MAX_CERTIFICATES {
            return Err(DecodeError::invalid(
                "body",
                format!("more than {MAX_CERTIFICATES} requests or held certificates"),
            ));
        }
        for (i, r) in self.requests.iter().enumerate() {
            let at = format!("body.requests[{i}]");
            validate_certificate_name(&format!("{at}.name"), &r.name)?;
            validate_pem(&format!("{at}.csr"), &r.csr, "CERTIFICATE REQUEST")?;
        }
        for (i, h) in self.held.iter().enumerate() {
            let at = format!("body.held[{i}]");
            validate_certificate_name(&format!("{at}.name"), &h.name)?;
            validate_serial(&format!("{at}.serial"), &h.serial)?;
            if let Some(e) = &h.renew_error
                && e.len() > crate::MAX_ERROR_CHARS
            {
                return Err(DecodeError::invalid(
                    format!("{at}.renew_error"),
                    format!("longer than {} characters", crate::MAX_ERROR_CHARS),
                ));
            }
        }
        Ok(())
    }
}

/// How a module's port is reached: from which modules over the overlay, and
/// whether it is exposed publicly under a name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ModulePort {
    /// 1 to 32 of `[a-z0-9-]`, unique within the module.
    pub name: String,
    pub port: u16,
    #[serde(default)]
    pub protocol: PortProtocol,
    /// The modules whose nodes may reach this port over the overlay.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub from: Vec<String>,
    /// The public name this port is exposed under (a DNS name); absent: not
    /// exposed outside the overlay.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expose: Option<String>,
}

/// The transport of a module port.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum PortProtocol {
    #[default]
    Tcp,
    Udp,
}

impl PortProtocol {
    pub fn as_str(self) -> &'static str {
        match self {
            PortProtocol::Tcp => "tcp",
            PortProtocol::Udp => "udp",
        }
    }
}

/// The most ports one module declares.
pub const MAX_PORTS: usize = 32;

/// Check a DNS name: labels of `[a-z0-9-]` (1 to 63 each) joined by dots, at
/// most 253 characters.
pub fn validate_dns_name(field: &str, name: &str) -> Result<(), DecodeError> {
    let ok = !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        });
    if ok {
        Ok(())
    } else {
        Err(DecodeError::invalid(
            field,
            format!(
                "`{}`: a DNS name (labels of a-z 0-9 - joined by dots)",
                name.chars().take(80).collect::<String>()
            ),
        ))
    }
}

/// Check a module's ports (`field` names the list): at most [`MAX_PORTS`],
/// names and (port, protocol) unique, port not 0, `from` valid module names,
/// `expose` a DNS name.
pub fn validate_ports(field: &str, ports: &[ModulePort]) -> Result<(), DecodeError> {
    if ports.len() > MAX_PORTS {
        return Err(DecodeError::invalid(
            field,
            format!("{} ports, at most {MAX_PORTS}", ports.len()),
        ));
    }
    let mut names = std::collections::BTreeSet::new();
    let mut numbers = std::collections::BTreeSet::new();
    for (i, p) in ports.iter().enumerate() {
        let at = format!("{field}[{i}]");
        let name_ok = !p.name.is_empty()
            && p.name.len() <= 32
            && p.name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        if !name_ok {
            return Err(DecodeError::invalid(
                format!("{at}.name"),
                "1 to 32 characters of a-z 0-9 -",
            ));
        }
        if !names.insert(p.name.as_str()) {
            return Err(DecodeError::invalid(
                format!("{at}.name"),
                format!("`{}` is declared twice", p.name),
            ));
        }
        if p.port == 0 {
            return Err(DecodeError::invalid(format!("{at}.port"), "1 to 65535"));
        }
        if !numbers.insert((p.port, p.protocol)) {
            return Err(DecodeError::invalid(
                format!("{at}.port"),
                format!("{}/{} is declared twice", p.port, p.protocol.as_str()),
            ));
        }
        if p.from.len() > crate::MAX_ITEMS {
            return Err(DecodeError::invalid(
                format!("{at}.from"),
                "too many modules",
            ));
        }
        for (j, m) in p.from.iter().enumerate() {
            validate_module_name(&format!("{at}.from[{j}]"), m)?;
        }
        if let Some(e) = &p.expose {
            validate_dns_name(&format!("{at}.expose"), e)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wireguard_keys_are_44_base64_characters() {
        assert!(
            validate_wireguard_key("k", "YAnz8lI3cTcxbkN8Vfm1l6lZ1fbCRvJv8T0ZHk8dYl4=").is_ok()
        );
        assert!(validate_wireguard_key("k", "short").is_err());
        assert!(validate_wireguard_key("k", &"A".repeat(44)).is_err());
    }

    #[test]
    fn cidrs_and_endpoints() {
        assert!(validate_cidr("a", "10.88.0.2/16").is_ok());
        assert!(validate_cidr("a", "fd00::1/128").is_ok());
        assert!(validate_cidr("a", "10.88.0.2/33").is_err());
        assert!(validate_cidr("a", "10.88.0.2").is_err());
        assert!(validate_endpoint("e", "10.0.0.1:51820").is_ok());
        assert!(validate_endpoint("e", "[fd00::1]:51820").is_ok());
        assert!(validate_endpoint("e", "host:51820").is_err());
    }

    #[test]
    fn ports_are_unique_and_named() {
        let p = |name: &str, port| ModulePort {
            name: name.into(),
            port,
            protocol: PortProtocol::Tcp,
            from: vec!["web".into()],
            expose: None,
        };
        assert!(validate_ports("ports", &[p("http", 80), p("admin", 81)]).is_ok());
        assert!(validate_ports("ports", &[p("http", 80), p("http", 81)]).is_err());
        assert!(validate_ports("ports", &[p("a", 80), p("b", 80)]).is_err());
        assert!(validate_ports("ports", &[p("a", 0)]).is_err());
        let mut bad = p("a", 80);
        bad.expose = Some("Not A Name".into());
        assert!(validate_ports("ports", &[bad]).is_err());
    }

    #[test]
    fn certificate_names() {
        assert!(validate_certificate_name("n", NODE_CERTIFICATE).is_ok());
        assert!(validate_certificate_name("n", "web").is_ok());
        assert!(validate_certificate_name("n", "../x").is_err());
    }
}
