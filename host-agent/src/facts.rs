//! The facts a hello states about this host, read from the kernel.

use mesh_protocol::{AppliedGenerations, Hello, Labels, OverlayFacts, ProtocolRange};

/// The agent's version (defined at the crate root, where every module may
/// reach it without a circle).
pub use crate::AGENT_VERSION;

/// Build a hello from the host's facts. `hostname` overrides the kernel's;
/// `seal_key` is the node's seal public key (hex) that secrets are sealed to;
/// `overlay` its WireGuard public key and endpoint (none: overlay disabled).
pub fn hello(
    hostname: Option<&str>,
    labels: &Labels,
    applied: AppliedGenerations,
    seal_key: Option<String>,
    overlay: Option<OverlayFacts>,
) -> Hello {
    Hello {
        hostname: hostname.map(str::to_owned).unwrap_or_else(kernel_hostname),
        arch: std::env::consts::ARCH.to_owned(),
        cpus: std::thread::available_parallelism()
            .map_or(1, |n| u32::try_from(n.get()).unwrap_or(u32::MAX)),
        memory_bytes: memory_bytes().unwrap_or(0),
        labels: labels.clone(),
        agent_version: AGENT_VERSION.to_owned(),
        public_key: None,
        seal_key,
        overlay,
        applied,
        protocol: Some(ProtocolRange::THIS),
        outage: None,
        metrics: None,
    }
}

/// `/proc/sys/kernel/hostname`, or `unknown`.
fn kernel_hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty() && s.len() <= 255 && !s.chars().any(char::is_control))
        .unwrap_or_else(|| "unknown".to_owned())
}

/// `MemTotal` from `/proc/meminfo`, in bytes.
fn memory_bytes() -> Option<u64> {
    parse_meminfo(&std::fs::read_to_string("/proc/meminfo").ok()?)
}

fn parse_meminfo(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let mut parts = line.split_whitespace().skip(1);
    let value: u64 = parts.next()?.parse().ok()?;
    match parts.next() {
        Some("kB") => value.checked_mul(1024),
        None => Some(value),
        Some(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo() {
        assert_eq!(
            parse_meminfo("MemTotal:       16318788 kB\nMemFree: 1 kB\n"),
            Some(16318788 * 1024)
        );
        assert_eq!(parse_meminfo("nothing"), None);
    }

    #[test]
    fn hello_is_valid() {
        let key = mesh_protocol::sealing::SealSecretKey::from_seed([1; 32])
            .public()
            .to_hex();
        let h = hello(
            Some("h1"),
            &Labels::new(),
            AppliedGenerations::new(),
            Some(key.clone()),
            Some(OverlayFacts {
                public_key: crate::overlay::WireguardKey::from_bytes([2; 32])
                    .public()
                    .to_owned(),
                endpoint: Some("10.201.0.2:51820".into()),
            }),
        );
        assert_eq!(h.hostname, "h1");
        assert_eq!(h.seal_key, Some(key));
        assert!(h.cpus >= 1);
        assert!(h.memory_bytes > 0);
        // Round-trips through the protocol's own validation.
        let env = mesh_protocol::Envelope::new(
            mesh_protocol::NodeId::parse("n").unwrap(),
            1,
            mesh_protocol::Report::Hello(h),
        );
        mesh_protocol::Envelope::<mesh_protocol::Report>::decode(
            &env.encode(),
            mesh_protocol::MAX_REPORT_BYTES,
        )
        .unwrap();
    }
}
