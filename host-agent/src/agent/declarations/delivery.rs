//! The delivery section: its artifacts, fetched, verified and cached
//! ([`crate::artifacts`]) before the section counts as applied.

use lapin::Channel;
use mesh_protocol::{ArtifactItem, Declaration, Outcome, TrustedArtifactKey};
use tokio::time::{Instant, MissedTickBehavior};

use super::SectionKind;
use crate::agent::Agent;
use crate::apply::ApplyReport;
use crate::store::SectionState;

/// What a delivery declaration brings beyond its files.
pub(super) struct Delivery {
    artifacts: Vec<ArtifactItem>,
    keys: Option<Vec<TrustedArtifactKey>>,
}

impl SectionKind for Delivery {
    fn take(decl: &Declaration) -> Self {
        Delivery {
            artifacts: decl.items.artifacts.clone(),
            keys: decl.items.artifact_keys.clone(),
        }
    }

    /// The artifacts are fetched, verified and cached (inline, each within
    /// `[artifacts] fetch_timeout`); the section is applied only once every
    /// one is cached, so a failed one is fetched again when the declaration
    /// comes again.
    async fn settle(
        &mut self,
        agent: &mut Agent,
        report: &mut ApplyReport,
        prev: &SectionState,
        publisher: &Channel,
    ) {
        let Some(artifacts) = agent.artifacts.clone() else {
            return;
        };
        // A pull may take longer than the controller's grace: the node's
        // lease (its heartbeat) goes on meanwhile, so a node busy pulling
        // is never judged unreachable for it.
        let fetch = artifacts.ensure_all(&self.artifacts, self.keys.as_deref());
        tokio::pin!(fetch);
        let every = agent.interval();
        let mut lease = tokio::time::interval_at(Instant::now() + every, every);
        lease.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let (items, gained) = loop {
            tokio::select! {
                out = &mut fetch => break out,
                _ = lease.tick() => {
                    // Transient and unconfirmed, as every heartbeat.
                    let _ = agent.beat(publisher).await;
                }
            }
        };
        if gained {
            agent.units.artifacts_changed();
        }
        if let Some(bad) = items.iter().find(|i| !i.ok) {
            let error = format!(
                "{}: {}",
                bad.item,
                bad.error.as_deref().unwrap_or("not cached")
            );
            report.outcome = Outcome::Failed;
            report.error.get_or_insert(error);
            if let Some(state) = &mut report.state {
                state.generation = prev.generation;
                state.digest = prev.digest.clone();
                state.last_outcome = Some(Outcome::Failed);
                state.last_error = report.error.clone();
            }
        }
        report.items.extend(items);
    }
}
