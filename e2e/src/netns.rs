//! A second host on this machine: a network namespace with its own veth
//! address, for tests of what crosses a network (joining over HTTPS, AMQPS to
//! the advertised address).
//!
//! [`Netns::create`] makes namespace `mesh-<hex>` and a veth pair
//! `mh-<hex>` (this host, `10.202.<n>.1/30`) / `mn-<hex>` (inside,
//! `10.202.<n>.2/30`, default route through the host side). Traffic from the
//! namespace reaches only this machine: an address of this host (its
//! advertised address among them) is delivered locally, and nothing forwards
//! further. Dropping it kills whatever still runs inside and deletes the
//! namespace and the pair, even when a test fails half-way.

use std::path::Path;
use std::process::Command;

use anyhow::{Context as _, bail};

/// A network namespace with a veth pair to this host; removed on drop.
pub struct Netns {
    pub name: String,
    host_if: String,
    /// This host's side of the pair.
    pub host_addr: String,
    /// The namespace's own address.
    pub addr: String,
}

fn ip(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .context("running `ip` (iproute2; bundle/up installs it)")?;
    if !out.status.success() {
        bail!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

impl Netns {
    /// Makes the namespace and its veth pair (needs root).
    pub fn create() -> anyhow::Result<Netns> {
        let tag = hex::encode(rand::random::<[u8; 3]>());
        let n = rand::random::<u8>();
        let ns = Netns {
            name: format!("mesh-{tag}"),
            host_if: format!("mh-{tag}"),
            host_addr: format!("10.202.{n}.1"),
            addr: format!("10.202.{n}.2"),
        };
        let inner = format!("mn-{tag}");
        // From here on, `ns` is dropped (cleaned up) on any failure.
        ip(&["netns", "add", &ns.name])?;
        ip(&[
            "link",
            "add",
            &ns.host_if,
            "type",
            "veth",
            "peer",
            "name",
            &inner,
        ])?;
        ip(&["link", "set", &inner, "netns", &ns.name])?;
        ip(&[
            "addr",
            "add",
            &format!("{}/30", ns.host_addr),
            "dev",
            &ns.host_if,
        ])?;
        ip(&["link", "set", &ns.host_if, "up"])?;
        let exec = |args: &[&str]| {
            let mut all = vec!["netns", "exec", ns.name.as_str(), "ip"];
            all.extend_from_slice(args);
            ip(&all)
        };
        exec(&["link", "set", "lo", "up"])?;
        exec(&["addr", "add", &format!("{}/30", ns.addr), "dev", &inner])?;
        exec(&["link", "set", &inner, "up"])?;
        exec(&["route", "add", "default", "via", &ns.host_addr])?;
        Ok(ns)
    }

    /// `program` to run inside the namespace (`ip netns exec <name> program`).
    pub fn command(&self, program: &Path) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name]).arg(program);
        cmd
    }

    /// Like [`Netns::command`], for tokio.
    pub fn tokio_command(&self, program: &Path) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new("ip");
        cmd.args(["netns", "exec", &self.name]).arg(program);
        cmd
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Whatever still runs inside first (a failed test's agent).
        if let Ok(out) = Command::new("ip")
            .args(["netns", "pids", &self.name])
            .output()
        {
            for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                let _ = Command::new("kill").args(["-KILL", pid]).status();
            }
        }
        // Deleting the namespace destroys its end of the pair, and with it ours.
        let _ = ip(&["netns", "del", &self.name]);
        let _ = Command::new("ip")
            .args(["link", "del", &self.host_if])
            .stderr(std::process::Stdio::null())
            .status();
    }
}
