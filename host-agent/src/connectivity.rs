//! What the connectivity section declares beyond files: the WireGuard
//! interface ([`crate::overlay`]) and the nftables ruleset
//! ([`crate::firewall`]), kept as desired state and reconciled.
//!
//! Level-triggered: the plans of the newest applied generation are kept in
//! `<state_dir>/connectivity.json` (written atomically); [`Connectivity::apply`]
//! replaces them and makes the host match, and [`Connectivity::check`] makes
//! it match again — at start (before the broker is reached: a restarted agent
//! re-adopts the interface and table it left, touching nothing that matches)
//! and every `[overlay] check_interval`. Neither ever tears down a working
//! interface to re-create it.
//!
//! Each plan is one item of the section's `applied` report: `overlay:<if>`
//! and `firewall:<table>`, `ok` or not with the reason (no WireGuard, no nft,
//! disabled by config, a tool's error). They never make the files of the
//! section fail: a node that cannot run the overlay still gets its files and
//! says why its overlay is not applied. When a check changes an item's
//! outcome (wireguard-go was installed, the table was found missing and
//! loaded again), the agent states the section's `applied` again.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use mesh_protocol::{FirewallPlan, ItemOutcome, OverlayFacts, OverlayPlan};
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::config::Config;
use crate::firewall::{Firewall, FirewallError};
use crate::overlay::{KeyError, Overlay, OverlayError, WireguardKey};

/// The desired state's file in the state directory.
pub const STATE_FILE: &str = "connectivity.json";
const STATE_VERSION: u32 = 1;

/// Why connectivity could not start.
#[derive(Debug, thiserror::Error)]
pub enum ConnectivityError {
    #[error(transparent)]
    Key(#[from] KeyError),
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{path} is not valid: {message}")]
    Malformed { path: PathBuf, message: String },
}

/// The plans last declared, kept across restarts.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Desired {
    version: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    overlay: Option<OverlayPlan>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    firewall: Option<FirewallPlan>,
}

/// The item names in `applied` reports.
pub fn overlay_item(plan: &OverlayPlan) -> String {
    format!("overlay:{}", plan.interface)
}

pub fn firewall_item(plan: &FirewallPlan) -> String {
    format!("firewall:{}", plan.table)
}

/// The overlay and firewall of this node.
#[derive(Debug)]
pub struct Connectivity {
    path: PathBuf,
    /// None: `[overlay] enabled = false`.
    overlay: Option<Overlay>,
    /// None: `[firewall] enabled = false`.
    firewall: Option<Firewall>,
    desired: Desired,
    /// The outcomes last stated, to tell when a check changed them.
    last: Vec<ItemOutcome>,
}

impl Connectivity {
    /// Load the key (made when missing; `true` then) and the desired state.
    pub fn open(config: &Config) -> Result<(Connectivity, bool), ConnectivityError> {
        let state_dir = &config.state_dir;
        let (overlay, made) = if config.overlay.enabled {
            let (key, made) = WireguardKey::load_or_create(state_dir)?;
            (
                Some(Overlay::new(config.overlay.clone(), state_dir, key)),
                made,
            )
        } else {
            (None, false)
        };
        let firewall = config
            .firewall
            .enabled
            .then(|| Firewall::new(config.firewall.clone(), state_dir));
        let path = state_dir.join(STATE_FILE);
        let desired = load(&path)?;
        Ok((
            Connectivity {
                path,
                overlay,
                firewall,
                desired,
                last: Vec::new(),
            },
            made,
        ))
    }

    /// What hello states about the overlay (none when it is disabled).
    pub fn facts(&self) -> Option<OverlayFacts> {
        self.overlay.as_ref().map(Overlay::facts)
    }

    /// Make the host match a new generation's plans (absent: remove what the
    /// previous one applied), keep them, and return their items.
    pub fn apply(
        &mut self,
        overlay: Option<&OverlayPlan>,
        firewall: Option<&FirewallPlan>,
    ) -> Vec<ItemOutcome> {
        let prev = std::mem::take(&mut self.desired);
        self.desired = Desired {
            version: STATE_VERSION,
            overlay: overlay.cloned(),
            firewall: firewall.cloned(),
        };
        if let Err(e) = save(&self.path, &self.desired) {
            warn!(error = %e, "cannot keep the connectivity plans; they hold until the agent restarts");
        }
        let mut items = Vec::new();
        // A plan gone, or renamed: remove what the previous one applied.
        if let Some(old) = &prev.overlay
            && overlay.is_none_or(|p| p.interface != old.interface)
            && let Some(o) = &self.overlay
        {
            match o.remove(&old.interface) {
                Ok(()) => info!(interface = %old.interface, "overlay interface removed"),
                Err(e) => items.push(failed(overlay_item(old), format!("remove: {e}"))),
            }
        }
        if let Some(old) = &prev.firewall
            && firewall.is_none_or(|p| p.table != old.table)
            && let Some(f) = &self.firewall
        {
            match f.remove(&old.table) {
                Ok(()) => info!(table = %old.table, "firewall table removed"),
                Err(e) => items.push(failed(firewall_item(old), format!("remove: {e}"))),
            }
        }
        if let Some(plan) = overlay {
            items.push(self.apply_overlay(plan));
        }
        if let Some(plan) = firewall {
            let unchanged = prev.firewall.as_ref() == Some(plan);
            items.push(self.apply_firewall(plan, unchanged));
        }
        self.last = items.clone();
        items
    }

    /// Make the host match the kept plans again. `Some(items)` when their
    /// outcomes differ from those last stated.
    pub fn check(&mut self) -> Option<Vec<ItemOutcome>> {
        let mut items = Vec::new();
        if let Some(plan) = self.desired.overlay.clone() {
            items.push(self.apply_overlay(&plan));
        }
        if let Some(plan) = self.desired.firewall.clone() {
            items.push(self.apply_firewall(&plan, true));
        }
        if items == self.last {
            return None;
        }
        self.last = items.clone();
        Some(items)
    }

    fn apply_overlay(&self, plan: &OverlayPlan) -> ItemOutcome {
        let item = overlay_item(plan);
        let result = match &self.overlay {
            None => Err(OverlayError::Disabled),
            Some(o) => o.apply(plan),
        };
        match result {
            Ok(done) => {
                if done.created {
                    info!(
                        interface = %plan.interface,
                        driver = done.driver.as_str(),
                        address = %plan.address,
                        peers = plan.peers.len(),
                        "overlay interface created"
                    );
                }
                ItemOutcome {
                    item,
                    ok: true,
                    error: None,
                }
            }
            Err(e) => {
                warn!(interface = %plan.interface, error = %e, "overlay not applied");
                failed(item, e.to_string())
            }
        }
    }

    /// Load the ruleset unless it is `unchanged` and its table is loaded.
    fn apply_firewall(&self, plan: &FirewallPlan, unchanged: bool) -> ItemOutcome {
        let item = firewall_item(plan);
        let result = match &self.firewall {
            None => Err(FirewallError::Disabled),
            Some(f) => {
                let loaded = if unchanged {
                    f.loaded(&plan.table)
                } else {
                    Ok(false)
                };
                match loaded {
                    Ok(true) => Ok(()),
                    Ok(false) => f.apply(plan).inspect(|()| {
                        info!(table = %plan.table, "firewall ruleset loaded");
                    }),
                    Err(e) => Err(e),
                }
            }
        };
        match result {
            Ok(()) => ItemOutcome {
                item,
                ok: true,
                error: None,
            },
            Err(e) => {
                warn!(table = %plan.table, error = %e, "firewall not applied");
                failed(item, e.to_string())
            }
        }
    }
}

/// [`Connectivity`] shared by the agent (declarations) and the check task;
/// every call runs on the blocking pool (the host's tools block).
#[derive(Debug, Clone)]
pub struct Shared(Arc<Mutex<Connectivity>>);

impl Shared {
    pub fn new(c: Connectivity) -> Shared {
        Shared(Arc::new(Mutex::new(c)))
    }

    async fn with<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Connectivity) -> T + Send + 'static,
    ) -> Option<T> {
        let inner = self.0.clone();
        tokio::task::spawn_blocking(move || {
            let mut c = inner.lock().unwrap_or_else(|p| p.into_inner());
            f(&mut c)
        })
        .await
        .ok()
    }

    pub fn facts(&self) -> Option<OverlayFacts> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).facts()
    }

    /// [`Connectivity::apply`]; the items say so if it panicked.
    pub async fn apply(
        &self,
        overlay: Option<OverlayPlan>,
        firewall: Option<FirewallPlan>,
    ) -> Vec<ItemOutcome> {
        let names: Vec<String> = overlay
            .iter()
            .map(overlay_item)
            .chain(firewall.iter().map(firewall_item))
            .collect();
        match self
            .with(move |c| c.apply(overlay.as_ref(), firewall.as_ref()))
            .await
        {
            Some(items) => items,
            None => names
                .into_iter()
                .map(|n| failed(n, "applying panicked".into()))
                .collect(),
        }
    }

    /// [`Connectivity::check`].
    pub async fn check(&self) -> Option<Vec<ItemOutcome>> {
        self.with(Connectivity::check).await.flatten()
    }

    /// Check every `interval` until dropped (abort the task); outcomes that
    /// changed go to `changes`, for the agent to state.
    pub fn spawn_checks(
        &self,
        interval: Duration,
        changes: tokio::sync::mpsc::Sender<Vec<ItemOutcome>>,
    ) -> tokio::task::JoinHandle<()> {
        let me = self.clone();
        tokio::spawn(async move {
            let mut tick =
                tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if let Some(items) = me.check().await
                    && changes.send(items).await.is_err()
                {
                    return;
                }
            }
        })
    }
}

fn failed(item: String, error: String) -> ItemOutcome {
    ItemOutcome {
        item,
        ok: false,
        error: Some(error),
    }
}

fn load(path: &Path) -> Result<Desired, ConnectivityError> {
    match std::fs::read(path) {
        Ok(bytes) => {
            let d: Desired =
                serde_json::from_slice(&bytes).map_err(|e| ConnectivityError::Malformed {
                    path: path.to_owned(),
                    message: e.to_string(),
                })?;
            if d.version != STATE_VERSION {
                return Err(ConnectivityError::Malformed {
                    path: path.to_owned(),
                    message: format!(
                        "format version {}; this agent knows {STATE_VERSION}",
                        d.version
                    ),
                });
            }
            Ok(d)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Desired {
            version: STATE_VERSION,
            ..Desired::default()
        }),
        Err(error) => Err(ConnectivityError::Io {
            path: path.to_owned(),
            error,
        }),
    }
}

fn save(path: &Path, desired: &Desired) -> std::io::Result<()> {
    let bytes = serde_json::to_vec_pretty(desired).map_err(std::io::Error::other)?;
    crate::store::write_atomic(path, &bytes, 0o600)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(dir: &Path) -> Config {
        let mut c = Config {
            state_dir: dir.to_owned(),
            ..Config::default()
        };
        // Tools that are not there: every plan is refused with the reason.
        c.overlay.kernel = false;
        c.overlay.ip = "/nonexistent/ip".into();
        c.overlay.wireguard_go = "/nonexistent/wireguard-go".into();
        c.firewall.nft = "/nonexistent/nft".into();
        c
    }

    fn plans() -> (OverlayPlan, FirewallPlan) {
        (
            OverlayPlan {
                interface: "mesh0".into(),
                address: "10.88.0.2/16".into(),
                listen_port: 51820,
                peers: Vec::new(),
            },
            FirewallPlan {
                table: "inet mesh".into(),
                ruleset: "table inet mesh {}\n".into(),
            },
        )
    }

    #[test]
    fn plans_not_applied_say_why_and_are_kept() {
        let dir = tempfile::tempdir().unwrap();
        let (mut c, made) = Connectivity::open(&config(dir.path())).unwrap();
        assert!(made);
        assert!(c.facts().is_some());
        let (o, f) = plans();
        let items = c.apply(Some(&o), Some(&f));
        assert_eq!(items.len(), 2);
        assert_eq!(items[0].item, "overlay:mesh0");
        assert!(!items[0].ok);
        assert!(
            items[0]
                .error
                .as_deref()
                .unwrap()
                .contains("/nonexistent/ip not found"),
            "{items:?}"
        );
        assert_eq!(items[1].item, "firewall:inet mesh");
        assert!(
            items[1].error.as_deref().unwrap().contains("nft not found"),
            "{items:?}"
        );
        // Nothing changed: a check states nothing new.
        assert_eq!(c.check(), None);
        // The plans survive a restart.
        let (mut again, made) = Connectivity::open(&config(dir.path())).unwrap();
        assert!(!made);
        assert_eq!(again.check().map(|i| i.len()), Some(2));
    }

    #[test]
    fn disabled_parts_say_so() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = config(dir.path());
        cfg.overlay.enabled = false;
        cfg.firewall.enabled = false;
        let (mut c, made) = Connectivity::open(&cfg).unwrap();
        assert!(!made);
        assert!(c.facts().is_none());
        assert!(!dir.path().join(crate::overlay::KEY_FILE).exists());
        let (o, f) = plans();
        let items = c.apply(Some(&o), Some(&f));
        assert!(items[0].error.as_deref().unwrap().contains("disabled"));
        assert!(items[1].error.as_deref().unwrap().contains("disabled"));
    }
}
