//! The observability context's evaluation, on the controller's clock: every
//! `evaluate_every` and soon after reports or events committed (at most that
//! often), with what the controller observed outside any context's tables
//! (`Observations`: the broker's queue depths, nodes behind on a section).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use mesh_observability::{Behind, Observations};
use tokio_util::sync::CancellationToken;

use crate::contexts::Contexts;

/// Evaluate health and alerts until `shutdown`.
pub async fn run(contexts: Arc<Contexts>, shutdown: CancellationToken) {
    let every = contexts.observability.settings().evaluate_every;
    // Reports arriving in a stream wake it often: never more than this.
    let spacing = (every / 5).max(Duration::from_millis(200));
    loop {
        let observations = observations(&contexts).await;
        match contexts.observability.evaluate(&observations).await {
            Ok(summary) => {
                if summary.raised + summary.resolved + summary.health_changed > 0 {
                    tracing::info!(
                        raised = summary.raised,
                        resolved = summary.resolved,
                        health_changed = summary.health_changed,
                        "evaluated health and alerts"
                    );
                }
            }
            Err(e) => tracing::warn!(error = %e, "evaluating health and alerts failed; retrying"),
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(spacing) => {}
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = contexts.observability.changed() => {}
            _ = tokio::time::sleep(every.saturating_sub(spacing)) => {}
        }
    }
}

/// What the controller observed that decides alerts no context can see.
async fn observations(contexts: &Contexts) -> Observations {
    Observations {
        queues: None,
        behind: behind(contexts).await,
    }
}

/// Nodes behind on a section: the in-step index (declarations the broker
/// confirmed) against what inventory recorded each reachable node applied.
/// None when inventory cannot be read (the alerts stay as they are).
async fn behind(contexts: &Contexts) -> Option<Vec<Behind>> {
    let applied = match contexts.inventory.applied_generations().await {
        Ok(rows) => rows,
        Err(e) => {
            tracing::debug!(error = %e, "reading applied generations failed");
            return None;
        }
    };
    let mut by_node: HashMap<String, HashMap<String, i64>> = HashMap::new();
    for (node, section, generation) in applied {
        by_node.entry(node).or_default().insert(section, generation);
    }
    Some(
        contexts
            .in_step
            .snapshot()
            .into_iter()
            .filter_map(|(node, section, declared)| {
                let sections = by_node.get(&node)?;
                let applied = sections.get(section.as_str()).copied();
                let declared = i64::try_from(declared).ok()?;
                (applied.unwrap_or(0) < declared).then(|| Behind {
                    node,
                    section: section.as_str().to_owned(),
                    declared,
                    applied,
                })
            })
            .collect(),
    )
}
