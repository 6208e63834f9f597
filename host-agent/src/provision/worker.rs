//! The provisioning worker: one background task that runs
//! [`Provisioner::pass`] over the provisioning section's resources, one pass
//! at a time, never two at once, and hands each pass's findings to the agent.
//!
//! It passes at start (over what the store holds, so with the controller
//! away), whenever the declared resources change (a provisioning section
//! applied), when [`Worker::kick`]ed (a config section applied: it may have
//! brought a credential file), and every `[provisioning] interval` after the
//! last pass. A kick or a change during a pass makes exactly one more pass
//! after it. The agent's apply path only hands over and kicks: it never waits
//! on a server's CLI.
//!
//! Credential files are read at their declared path under the agent's root,
//! resolved as the applier resolves a declared path (never outside the root,
//! never through a symlink leading out of it), at most
//! [`MAX_CREDENTIAL_BYTES`]; their content is never logged.

use std::io::Read;
use std::sync::Arc;
use std::time::Duration;

use mesh_protocol::{ResourceItem, Resources};
use tokio::sync::{Notify, mpsc, watch};
use tokio::time::{Instant, MissedTickBehavior};
use tracing::debug;

use super::Provisioner;
use crate::apply::Applier;

/// Largest credential file read; a larger one is not a credential file.
pub const MAX_CREDENTIAL_BYTES: u64 = 64 * 1024;

/// The provisioning section as applied: its generation (0: none yet) and
/// its resources.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Declared {
    pub generation: u64,
    pub resources: Vec<ResourceItem>,
}

/// The agent's handle on the worker. Dropping it ends the worker after the
/// pass it is in (if any); [`Worker::stop`] ends it at once.
pub struct Worker {
    declared: watch::Sender<Declared>,
    kick: Arc<Notify>,
    found: mpsc::Receiver<Resources>,
    task: tokio::task::JoinHandle<()>,
}

impl Worker {
    /// Start the worker over `declared` (from the store), remembering
    /// `found` (the store's last findings), passing every `interval`.
    /// Credential files are read through `applier` (under its root).
    pub fn start(
        applier: Applier,
        interval: Duration,
        declared: Declared,
        found: Option<&Resources>,
    ) -> Worker {
        let mut provisioner = Provisioner::new();
        if let Some(f) = found {
            provisioner.remember(&f.resources);
        }
        let (declared_tx, declared_rx) = watch::channel(declared);
        let kick = Arc::new(Notify::new());
        let (found_tx, found_rx) = mpsc::channel(1);
        let task = tokio::spawn(run(
            provisioner,
            applier,
            interval,
            declared_rx,
            kick.clone(),
            found_tx,
        ));
        Worker {
            declared: declared_tx,
            kick,
            found: found_rx,
            task,
        }
    }

    /// A provisioning section was applied: pass over its resources (at once,
    /// or right after the pass under way). Nothing happens if nothing changed.
    pub fn declare(&self, declared: Declared) {
        self.declared.send_if_modified(|d| {
            if *d == declared {
                false
            } else {
                *d = declared;
                true
            }
        });
    }

    /// Pass again (a config section was applied: a credential file may have
    /// come or changed).
    pub fn kick(&self) {
        self.kick.notify_one();
    }

    /// The next pass's findings (pending forever should the worker have
    /// ended, which it does only with its handle).
    pub async fn found(&mut self) -> Resources {
        match self.found.recv().await {
            Some(r) => r,
            None => std::future::pending().await,
        }
    }

    /// End the worker now (a pass under way is cut off: its CLI commands are
    /// killed, and the next agent's pass makes the server match again).
    pub fn stop(&self) {
        self.task.abort();
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn run(
    mut provisioner: Provisioner,
    applier: Applier,
    interval: Duration,
    mut declared: watch::Receiver<Declared>,
    kick: Arc<Notify>,
    found: mpsc::Sender<Resources>,
) {
    let mut timer = tokio::time::interval_at(Instant::now() + interval, interval);
    timer.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut first = true;
    loop {
        if !first {
            tokio::select! {
                changed = declared.changed() => {
                    if changed.is_err() {
                        return;
                    }
                }
                () = kick.notified() => {}
                _ = timer.tick() => {}
            }
        }
        first = false;
        let now = declared.borrow_and_update().clone();
        if now.generation == 0 {
            // No provisioning section yet: nothing to reconcile, nothing to state.
            continue;
        }
        let started = Instant::now();
        let statuses = provisioner
            .pass(&now.resources, |path| read_credential(&applier, path))
            .await;
        debug!(
            generation = now.generation,
            resources = statuses.len(),
            ms = started.elapsed().as_millis() as u64,
            "provisioning pass done"
        );
        // The interval counts from the end of the last pass, whatever caused it.
        timer.reset();
        let report = Resources {
            generation: now.generation,
            resources: statuses,
        };
        if found.send(report).await.is_err() {
            return;
        }
    }
}

/// The credential file at its declared `path` under the root, if it is
/// there and readable (None: not delivered yet, or not a credential file).
fn read_credential(applier: &Applier, path: &str) -> Option<String> {
    let target = applier.resolve(path).ok()?;
    let file = std::fs::File::open(&target).ok()?;
    let mut text = String::new();
    file.take(MAX_CREDENTIAL_BYTES + 1)
        .read_to_string(&mut text)
        .ok()?;
    if text.len() as u64 > MAX_CREDENTIAL_BYTES {
        return None;
    }
    Some(text)
}
