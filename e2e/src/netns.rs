//! Other hosts on this machine: network namespaces with veth addresses of
//! their own, for tests of what crosses a network (joining over HTTPS, AMQPS
//! to the advertised address, the overlay between nodes). [`Netns`] is one
//! host; [`Lan`] is several on a bridge of their own; [`Listener`] and
//! [`connect`] are TCP from inside a namespace.
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

/// Run `f` on a thread of its own inside network namespace `ns` (the sockets
/// it makes live there). The thread is new each time: entering a namespace
/// is for the rest of a thread's life, so no pooled thread is ever moved.
pub fn in_netns<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> std::io::Result<T> + Send + 'static,
) -> std::io::Result<T> {
    let path = Path::new("/run/netns").join(ns);
    std::thread::spawn(move || {
        let file = std::fs::File::open(&path)?;
        rustix::thread::move_into_link_name_space(
            std::os::fd::AsFd::as_fd(&file),
            Some(rustix::thread::LinkNameSpaceType::Network),
        )?;
        f()
    })
    .join()
    .map_err(|_| std::io::Error::other("the thread in the namespace panicked"))?
}

/// A TCP listener inside a namespace answering every connection with
/// `ok\n`; it stops listening when dropped.
pub struct Listener {
    task: tokio::task::JoinHandle<()>,
}

impl Listener {
    /// Bind `addr` inside `ns` (call from within a tokio runtime).
    pub fn bind(ns: &str, addr: std::net::SocketAddr) -> anyhow::Result<Listener> {
        let std = in_netns(ns, move || {
            let l = std::net::TcpListener::bind(addr)?;
            l.set_nonblocking(true)?;
            Ok(l)
        })
        .with_context(|| format!("binding {addr} in {ns}"))?;
        let listener = tokio::net::TcpListener::from_std(std)?;
        let task = tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let _ = tokio::io::AsyncWriteExt::write_all(&mut s, b"ok\n").await;
                });
            }
        });
        Ok(Listener { task })
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One TCP connection from inside `ns` to `addr`, within `wait`: Ok when the
/// greeting of a [`Listener`] arrives.
pub async fn connect(
    ns: &str,
    addr: std::net::SocketAddr,
    wait: std::time::Duration,
) -> std::io::Result<()> {
    let ns = ns.to_owned();
    let r = tokio::task::spawn_blocking(move || {
        in_netns(&ns, move || {
            use std::io::Read;
            let mut s = std::net::TcpStream::connect_timeout(&addr, wait)?;
            s.set_read_timeout(Some(wait))?;
            let mut buf = [0u8; 3];
            s.read_exact(&mut buf)?;
            if &buf == b"ok\n" {
                Ok(())
            } else {
                Err(std::io::Error::other(format!("greeting {buf:?}")))
            }
        })
    })
    .await;
    r.map_err(std::io::Error::other)?
}

/// Hosts on one LAN of their own: namespace `<tag>-hub` holds a bridge, and
/// each host `<tag>-<name>` a veth (`eth0`, `10.203.<k>.<i+1>/24`) on it. A
/// leg in this machine's namespace (`mr<tag>`, `10.203.<k>.254`) is every
/// host's default route, so a host reaches this machine's own addresses (the
/// broker's advertised AMQPS listener among them) as a second host would,
/// and nothing beyond. Dropping it kills whatever runs in the namespaces and
/// deletes them and the leg, even when a test fails half-way.
pub struct Lan {
    k: u8,
    hosts: Vec<String>,
    namespaces: Vec<String>,
    root_link: Option<String>,
}

impl Lan {
    /// Make the LAN with one host per name (needs root). `tag` is unique to
    /// the test (its environment's id) and at most 12 characters, so the
    /// leg's name fits an interface name.
    pub fn create(tag: &str, names: &[&str]) -> anyhow::Result<Lan> {
        anyhow::ensure!(tag.len() <= 12, "tag `{tag}` is longer than 12");
        anyhow::ensure!(names.len() < 250, "at most 249 hosts");
        // A subnet no route of this machine's uses yet (another test's LAN).
        let k = (0..20)
            .map(|_| rand::random_range(1..=250u8))
            .find(|k| {
                Command::new("ip")
                    .args(["route", "show", &format!("10.203.{k}.0/24")])
                    .output()
                    .is_ok_and(|o| o.status.success() && o.stdout.is_empty())
            })
            .context("no free 10.203.<k>.0/24 on this machine")?;
        let mut lan = Lan {
            k,
            hosts: Vec::new(),
            namespaces: Vec::new(),
            root_link: None,
        };
        // From here on, `lan` is dropped (cleaned up) on any failure.
        let hub = format!("{tag}-hub");
        ip(&["netns", "add", &hub])?;
        lan.namespaces.push(hub.clone());
        ip(&["-n", &hub, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &hub, "link", "set", "br0", "up"])?;
        for (i, name) in names.iter().enumerate() {
            let ns = format!("{tag}-{name}");
            ip(&["netns", "add", &ns])?;
            lan.namespaces.push(ns.clone());
            lan.hosts.push(ns.clone());
            let port = format!("v{i}");
            ip(&[
                "link", "add", "eth0", "netns", &ns, "type", "veth", "peer", "name", &port,
                "netns", &hub,
            ])?;
            ip(&["-n", &hub, "link", "set", &port, "master", "br0", "up"])?;
            let addr = format!("{}/24", lan.addr(i));
            ip(&["-n", &ns, "address", "add", &addr, "dev", "eth0"])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        }
        let root = format!("mr{tag}");
        ip(&[
            "link", "add", &root, "type", "veth", "peer", "name", "vr", "netns", &hub,
        ])?;
        lan.root_link = Some(root.clone());
        ip(&["-n", &hub, "link", "set", "vr", "master", "br0", "up"])?;
        ip(&[
            "address",
            "add",
            &format!("{}/24", lan.root_addr()),
            "dev",
            &root,
        ])?;
        ip(&["link", "set", &root, "up"])?;
        for ns in &lan.hosts {
            ip(&["-n", ns, "route", "add", "default", "via", &lan.root_addr()])?;
        }
        Ok(lan)
    }

    /// The third octet of this LAN's `10.203.<k>.0/24` (random per LAN, one
    /// no route of this machine's used when it was made; the addresses exist
    /// only on this machine).
    pub fn octet(&self) -> u8 {
        self.k
    }

    /// The namespace of host `i`.
    pub fn ns(&self, i: usize) -> &str {
        &self.hosts[i]
    }

    /// The address of host `i` on the LAN.
    pub fn addr(&self, i: usize) -> String {
        format!("10.203.{}.{}", self.k, i + 1)
    }

    /// This machine's address on the LAN.
    pub fn root_addr(&self) -> String {
        format!("10.203.{}.254", self.k)
    }

    /// `program args…` run in host `i`, in a mount namespace of its own where
    /// `wireguard_dir` is `/var/run/wireguard`. wireguard-go keeps its control
    /// socket there, one directory for every namespace of the machine, and a
    /// controller declares the same interface name to every node: each host
    /// gets a directory of its own, as a real host has, and what the program
    /// starts (wireguard-go, `wg`) inherits it.
    pub fn command_with_wireguard_dir(
        &self,
        i: usize,
        wireguard_dir: &Path,
        program: &Path,
    ) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", self.ns(i)])
            .args(["unshare", "--mount", "--propagation", "private"])
            .args([
                "sh",
                "-c",
                "mkdir -p /var/run/wireguard && mount --bind \"$0\" /var/run/wireguard && exec \"$@\"",
            ])
            .arg(wireguard_dir)
            .arg(program);
        cmd
    }

    /// Pids living in namespace `ns`.
    fn pids(ns: &str) -> Vec<String> {
        Command::new("ip")
            .args(["netns", "pids", ns])
            .output()
            .map(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .split_whitespace()
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default()
    }
}

impl Drop for Lan {
    fn drop(&mut self) {
        // Whatever runs inside (agents, their units, wireguard-go) first.
        for ns in &self.namespaces {
            for pid in Lan::pids(ns) {
                let _ = Command::new("kill").args(["-KILL", &pid]).status();
            }
        }
        for ns in &self.namespaces {
            let _ = ip(&["netns", "del", ns]);
        }
        // Deleting the hub destroyed the leg's peer, and with it the leg.
        if let Some(l) = &self.root_link {
            let _ = Command::new("ip")
                .args(["link", "del", l])
                .stderr(std::process::Stdio::null())
                .status();
        }
    }
}

/// A host of a [`Lan`] running a real agent: its node id and directories.
#[derive(Debug, Clone)]
pub struct LanHost {
    pub node: String,
    pub state_dir: std::path::PathBuf,
    pub root: std::path::PathBuf,
    /// The host's own `/var/run/wireguard` (see [`Lan::command_with_wireguard_dir`]).
    pub wireguard_dir: std::path::PathBuf,
}

impl Lan {
    /// Enrol `name` (its own broker user) and start its agent on host `i`,
    /// reaching the broker over AMQPS at the advertised address as a second
    /// machine would, logging to `agent-<name>.log` in the mesh's directory.
    /// `extra_toml` follows the agent's base settings (state, root, a 1 s
    /// heartbeat, quick reconnects, hostname `name`): top-level keys first,
    /// then tables.
    pub async fn spawn_agent(
        &self,
        mesh: &crate::Mesh,
        i: usize,
        name: &str,
        extra_toml: &str,
    ) -> anyhow::Result<(LanHost, crate::Proc)> {
        let tls = mesh_testkit::bundle_tls()?;
        let creds = mesh.env.add_node(name).await?;
        let dir = mesh.dir.path().join(format!("host-{name}"));
        let host = LanHost {
            node: creds.node.as_str().to_owned(),
            state_dir: dir.join("state"),
            root: dir.join("root"),
            wireguard_dir: dir.join("run-wireguard"),
        };
        for d in [&host.state_dir, &host.root, &host.wireguard_dir] {
            std::fs::create_dir_all(d)?;
        }
        creds.write_to_over_tls(&host.state_dir, &tls)?;
        let config = dir.join("agent.toml");
        std::fs::write(
            &config,
            format!(
                "state_dir = {state:?}\nroot = {root:?}\nheartbeat_interval = \"1s\"\n\
                 reconnect_min = \"50ms\"\nreconnect_max = \"500ms\"\nhostname = \"{name}\"\n\
                 {extra_toml}",
                state = host.state_dir,
                root = host.root,
            ),
        )?;
        let log = mesh.dir.path().join(format!("agent-{name}.log"));
        let append = || {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&log)
        };
        let agent = crate::Proc::spawn(
            self.command_with_wireguard_dir(i, &host.wireguard_dir, &crate::bin("mesh-agent")?)
                .arg("run")
                .arg("--config")
                .arg(&config)
                .env("RUST_LOG", "info,mesh_host_agent=debug")
                .stdin(std::process::Stdio::null())
                .stdout(append()?)
                .stderr(append()?),
        )?;
        Ok((host, agent))
    }
}
