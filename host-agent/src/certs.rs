//! The node's certificates: its own (`node`) and one per module it runs, each
//! for a key made on the node that never leaves it. The agent asks with a CSR
//! (the `certificates` report), the connectivity section hands back the
//! certificate, and the agent renews at two thirds of the lifetime.
//!
//! - **Keys.** `<state_dir>/certs/<name>.key` (ECDSA P-256, PKCS#8 PEM, mode
//!   0600), made once per name and kept across renewals (a renewal is a new
//!   certificate for the same key; deleting the file rotates it: a new key, a
//!   new CSR). Never sent, never logged.
//! - **CSRs.** `node`: CN and SAN the node id; a module: CN and SAN the
//!   module's name. The names a certificate carries are the signer's choice
//!   (connectivity adds `<node>.<domain>` / `<module>.<domain>`): the CSR
//!   proves possession of the key, nothing more.
//! - **Installed.** A declared certificate is used only if it parses, chains
//!   to the declared CA, is valid now and certifies this name's key; then
//!   `<root>/etc/mesh/tls/<name>.pem` (0644), `<name>.key` (0600, a copy of
//!   the key for the module to read) and `ca.pem` (0644) are written
//!   atomically. Anything else is refused (item `certificate:<name>` with the
//!   reason) and the current certificate stays.
//! - **Renewal.** From two thirds of a certificate's lifetime
//!   (`not_before + 2/3 (not_after − not_before)`) the agent asks again, and
//!   again every tenth of the lifetime (at least 1 s, at most 5 min) until a
//!   new one arrives. Meanwhile it keeps its current certificate and states
//!   it in `held` with `renew_error` saying since when renewal waits and how
//!   long the certificate has left.
//!
//! A `certificates` report is stated on every connect, when the names change
//! (the inventory section's modules), after certificates are declared, and
//! when a renewal falls due.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use chrono::{DateTime, TimeDelta, Utc};
use mesh_credentials::pki::{self, CertInfo};
use mesh_protocol::{
    CertificateItem, CertificateRequest, Certificates, HeldCertificate, ItemOutcome,
    NODE_CERTIFICATE, NodeId, Secret,
};
use tracing::{info, warn};

/// Keys' directory in the state directory.
pub const KEYS_DIR: &str = "certs";
/// Where certificates are installed, under the agent's root.
pub const TLS_DIR: &str = "etc/mesh/tls";
/// The CA's file in [`TLS_DIR`].
pub const CA_FILE: &str = "ca.pem";
/// Asking again for a name that has no certificate.
const FIRST_RETRY: TimeDelta = TimeDelta::seconds(30);

/// Why the certificates could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("certificate key {path}: {error}")]
    Key { path: PathBuf, error: String },
}

/// One name's certificate and renewal state.
#[derive(Debug, Clone)]
struct Held {
    info: CertInfo,
    /// Renewal asked since (none: not yet due or asked).
    renewing_since: Option<DateTime<Utc>>,
}

/// The node's keys and certificates.
#[derive(Debug)]
pub struct Certs {
    node: NodeId,
    keys_dir: PathBuf,
    tls_dir: PathBuf,
    /// The names wanted: `node` and the modules the node runs.
    names: BTreeSet<String>,
    keys: BTreeMap<String, Secret<String>>,
    held: BTreeMap<String, Held>,
    /// Last time each name was asked for.
    asked: BTreeMap<String, DateTime<Utc>>,
}

impl Certs {
    /// Load what is installed under `root` (certificates that still match
    /// their keys) for `node`.
    pub fn open(node: NodeId, state_dir: &Path, root: &Path) -> Result<Certs, CertError> {
        let keys_dir = state_dir.join(KEYS_DIR);
        let mut c = Certs {
            node,
            keys_dir,
            tls_dir: root.join(TLS_DIR),
            names: BTreeSet::from([NODE_CERTIFICATE.to_owned()]),
            keys: BTreeMap::new(),
            held: BTreeMap::new(),
            asked: BTreeMap::new(),
        };
        c.load_or_create(NODE_CERTIFICATE)?;
        c.adopt_installed();
        Ok(c)
    }

    /// Every certificate held, by name (`node`, a module's), and when it
    /// expires: `mesh_agent_certificate_expiry_timestamp_seconds`.
    pub fn expiries(&self) -> Vec<(String, DateTime<Utc>)> {
        self.held
            .iter()
            .map(|(name, h)| (name.clone(), h.info.not_after))
            .collect()
    }

    /// The names wanted now: `node` plus `modules`. True when they changed.
    pub fn set_modules<'a>(&mut self, modules: impl IntoIterator<Item = &'a str>) -> bool {
        let mut names: BTreeSet<String> = modules.into_iter().map(str::to_owned).collect();
        names.insert(NODE_CERTIFICATE.to_owned());
        names.retain(|n| mesh_protocol::validate_certificate_name("name", n).is_ok());
        if names == self.names {
            return false;
        }
        self.names = names;
        self.held.retain(|n, _| self.names.contains(n));
        self.asked.retain(|n, _| self.names.contains(n));
        for name in self.names.clone() {
            if let Err(e) = self.load_or_create(&name) {
                warn!(name = %name, error = %e, "cannot make a certificate key");
            }
        }
        self.adopt_installed();
        true
    }

    fn key_path(&self, name: &str) -> PathBuf {
        self.keys_dir.join(format!("{name}.key"))
    }

    fn load_or_create(&mut self, name: &str) -> Result<(), CertError> {
        if self.keys.contains_key(name) {
            return Ok(());
        }
        let path = self.key_path(name);
        let key = match std::fs::read_to_string(&path) {
            Ok(pem) => {
                pki::public_key_der(&pem).map_err(|e| CertError::Key {
                    path: path.clone(),
                    error: e.to_string(),
                })?;
                Secret::new(pem)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let key = pki::new_key().map_err(|e| CertError::Key {
                    path: path.clone(),
                    error: e.to_string(),
                })?;
                let io = |error| CertError::Io {
                    path: path.clone(),
                    error,
                };
                make_dir(&self.keys_dir, 0o700).map_err(io)?;
                crate::store::write_atomic(&path, key.expose().as_bytes(), 0o600).map_err(io)?;
                info!(name, path = %path.display(), "made a certificate key");
                key
            }
            Err(error) => return Err(CertError::Io { path, error }),
        };
        self.keys.insert(name.to_owned(), key);
        Ok(())
    }

    /// Certificates installed before (by an earlier agent) that match their key.
    fn adopt_installed(&mut self) {
        for name in &self.names {
            if self.held.contains_key(name) {
                continue;
            }
            let Some(key) = self.keys.get(name) else {
                continue;
            };
            let Ok(pem) = std::fs::read_to_string(self.tls_dir.join(format!("{name}.pem"))) else {
                continue;
            };
            if let Ok(info) = CertInfo::parse(&pem)
                && matches_key(&info, key)
            {
                self.held.insert(
                    name.clone(),
                    Held {
                        info,
                        renewing_since: None,
                    },
                );
            }
        }
    }

    /// Install the declared certificates that are for this node's keys; one
    /// item each (`certificate:<name>`).
    pub fn install(&mut self, items: &[CertificateItem]) -> Vec<ItemOutcome> {
        let mut out = Vec::new();
        for item in items {
            let name = format!("certificate:{}", item.name);
            if self.held.get(&item.name).map(|h| h.info.serial.as_str()) == Some(&item.serial) {
                out.push(ItemOutcome {
                    item: name,
                    ok: true,
                    error: None,
                });
                continue;
            }
            match self.check_and_write(item) {
                Ok(info) => {
                    info!(name = %item.name, serial = %info.serial, not_after = %info.not_after, "certificate installed");
                    self.held.insert(
                        item.name.clone(),
                        Held {
                            info,
                            renewing_since: None,
                        },
                    );
                    out.push(ItemOutcome {
                        item: name,
                        ok: true,
                        error: None,
                    });
                }
                Err(e) => {
                    warn!(name = %item.name, error = %e, "declared certificate refused; keeping the current one");
                    out.push(ItemOutcome {
                        item: name,
                        ok: false,
                        error: Some(e),
                    });
                }
            }
        }
        out
    }

    fn check_and_write(&self, item: &CertificateItem) -> Result<CertInfo, String> {
        if !self.names.contains(&item.name) {
            return Err(format!(
                "this node did not ask for a certificate named `{}`",
                item.name
            ));
        }
        let key = self
            .keys
            .get(&item.name)
            .ok_or("this node has no key for it")?;
        let info = CertInfo::parse(&item.certificate).map_err(|e| e.to_string())?;
        pki::verify_chain(&item.certificate, &item.ca).map_err(|e| e.to_string())?;
        if !matches_key(&info, key) {
            return Err("it certifies another key than this node's".into());
        }
        if let Some(h) = self.held.get(&item.name)
            && h.info.not_after > info.not_after
        {
            return Err(format!(
                "it expires ({}) before the one held ({})",
                info.not_after, h.info.not_after
            ));
        }
        let write = |file: String, content: &[u8], mode: u32| {
            make_dir(&self.tls_dir, 0o755)
                .and_then(|()| crate::store::write_atomic(&self.tls_dir.join(&file), content, mode))
                .map_err(|e| format!("{}: {e}", self.tls_dir.join(&file).display()))
        };
        write(CA_FILE.to_owned(), item.ca.as_bytes(), 0o644)?;
        write(format!("{}.key", item.name), key.expose().as_bytes(), 0o600)?;
        write(
            format!("{}.pem", item.name),
            item.certificate.as_bytes(),
            0o644,
        )?;
        Ok(info)
    }

    /// The report to state now: a CSR for each name without a certificate or
    /// due for renewal, and every certificate held. `force`: also when
    /// nothing is due (on connect).
    pub fn report(&mut self, now: DateTime<Utc>, force: bool) -> Option<Certificates> {
        let mut requests = Vec::new();
        let mut held = Vec::new();
        for name in self.names.clone() {
            let due = match self.held.get(&name) {
                None => true,
                Some(h) => now >= h.info.renew_at() || now >= h.info.not_after,
            };
            let mut renew_error = None;
            if due {
                if !force
                    && self
                        .asked
                        .get(&name)
                        .is_some_and(|t| now < *t + self.retry(&name))
                {
                    // Asked recently: wait for the answer.
                } else {
                    match self.csr(&name) {
                        Ok(csr) => {
                            requests.push(CertificateRequest {
                                name: name.clone(),
                                csr,
                            });
                            self.asked.insert(name.clone(), now);
                        }
                        Err(e) => renew_error = Some(format!("cannot make a CSR: {e}")),
                    }
                }
                if let Some(h) = self.held.get_mut(&name) {
                    let since = *h.renewing_since.get_or_insert(now);
                    if since < now && renew_error.is_none() {
                        let left = (h.info.not_after - now).num_seconds().max(0);
                        renew_error = Some(format!(
                            "renewal asked since {since}, no new certificate yet; the current one expires at {} (in {left} s)",
                            h.info.not_after
                        ));
                    }
                }
            }
            if let Some(h) = self.held.get(&name) {
                held.push(HeldCertificate {
                    name: name.clone(),
                    serial: h.info.serial.clone(),
                    not_after: h.info.not_after,
                    renew_error,
                });
            }
        }
        (force || !requests.is_empty()).then_some(Certificates { requests, held })
    }

    /// When [`Certs::report`] has something to ask next.
    pub fn next_due(&self) -> Option<DateTime<Utc>> {
        self.names
            .iter()
            .map(|name| {
                let asked = self.asked.get(name).map(|t| *t + self.retry(name));
                match self.held.get(name) {
                    None => asked.unwrap_or_else(Utc::now),
                    Some(h) => {
                        let at = h.info.renew_at();
                        match asked {
                            Some(a) if h.renewing_since.is_some() => a.max(at),
                            _ => at,
                        }
                    }
                }
            })
            .min()
    }

    /// How long to wait for an answer before asking again.
    fn retry(&self, name: &str) -> TimeDelta {
        match self.held.get(name) {
            None => FIRST_RETRY,
            Some(h) => ((h.info.not_after - h.info.not_before) / 10)
                .clamp(TimeDelta::seconds(1), TimeDelta::minutes(5)),
        }
    }

    fn csr(&self, name: &str) -> Result<String, String> {
        let key = self.keys.get(name).ok_or("no key")?;
        let cn = if name == NODE_CERTIFICATE {
            self.node.as_str()
        } else {
            name
        };
        pki::csr(key.expose(), cn, &[cn.to_owned()]).map_err(|e| e.to_string())
    }
}

fn matches_key(info: &CertInfo, key: &Secret<String>) -> bool {
    pki::public_key_der(key.expose()).is_ok_and(|der| der == info.public_key_der)
}

fn make_dir(dir: &Path, mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(mode)
        .create(dir)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn issue(ca: &pki::MeshCa, csr: &str, secs: u64) -> CertificateItem {
        let parsed = pki::Csr::parse(csr).unwrap();
        let cn = parsed.common_name().unwrap().to_owned();
        let issued = ca
            .sign(
                &parsed,
                &cn,
                std::slice::from_ref(&cn),
                Duration::from_secs(secs),
            )
            .unwrap();
        CertificateItem {
            name: NODE_CERTIFICATE.into(),
            serial: issued.serial,
            not_after: issued.not_after,
            certificate: issued.certificate_pem,
            ca: ca.certificate_pem().to_owned(),
        }
    }

    #[test]
    fn ask_install_and_renew_at_two_thirds() {
        let state = tempfile::tempdir().unwrap();
        let root = tempfile::tempdir().unwrap();
        let node = NodeId::parse("n1").unwrap();
        let mut c = Certs::open(node.clone(), state.path(), root.path()).unwrap();
        let now = Utc::now();
        let r = c.report(now, true).unwrap();
        assert_eq!(r.requests.len(), 1);
        assert!(r.held.is_empty());
        let csr = pki::Csr::parse(&r.requests[0].csr).unwrap();
        assert_eq!(csr.common_name(), Some("n1"));
        // Asked: nothing more until the retry, unless forced.
        assert!(c.report(now, false).is_none());

        let ca = pki::MeshCa::generate("test CA").unwrap();
        let item = issue(&ca, &r.requests[0].csr, 3600);
        let out = c.install(std::slice::from_ref(&item));
        assert!(out[0].ok, "{out:?}");
        let tls = root.path().join(TLS_DIR);
        assert!(tls.join("node.pem").exists() && tls.join(CA_FILE).exists());
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(tls.join("node.key"))
                .unwrap()
                .permissions(),
        );
        assert_eq!(mode & 0o777, 0o600);

        // Not due before two thirds; due after; renew_error once it waits.
        let info = CertInfo::parse(&item.certificate).unwrap();
        let due = info.renew_at();
        assert_eq!(c.next_due(), Some(due));
        assert!(c.report(due - TimeDelta::seconds(1), false).is_none());
        let r = c.report(due, false).unwrap();
        assert_eq!(r.requests.len(), 1);
        assert_eq!(r.held[0].serial, item.serial);
        assert_eq!(r.held[0].renew_error, None);
        let later = due + c.retry(NODE_CERTIFICATE);
        let r = c.report(later, false).unwrap();
        let err = r.held[0].renew_error.as_deref().unwrap();
        assert!(err.contains("no new certificate yet"), "{err}");

        // A certificate for another key is refused; the current one stays.
        let other = pki::new_key().unwrap();
        let foreign = issue(&ca, &pki::csr(other.expose(), "n1", &[]).unwrap(), 3600);
        let out = c.install(&[foreign]);
        assert!(!out[0].ok);
        assert!(out[0].error.as_deref().unwrap().contains("another key"));

        // A restarted agent adopts what is installed.
        let mut again = Certs::open(node, state.path(), root.path()).unwrap();
        let r = again.report(Utc::now(), true).unwrap();
        assert!(r.requests.is_empty());
        assert_eq!(r.held[0].serial, item.serial);
    }

    #[test]
    fn modules_get_their_own_keys() {
        let state = tempfile::tempdir().unwrap();
        let root = tempfile::tempdir().unwrap();
        let mut c = Certs::open(NodeId::parse("n1").unwrap(), state.path(), root.path()).unwrap();
        assert!(c.set_modules(["web"]));
        assert!(!c.set_modules(["web"]));
        let r = c.report(Utc::now(), true).unwrap();
        let names: Vec<_> = r.requests.iter().map(|q| q.name.as_str()).collect();
        assert_eq!(names, ["node", "web"]);
        assert!(state.path().join("certs/web.key").exists());
    }
}
