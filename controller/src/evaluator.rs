//! The observability context's evaluation, on the controller's clock: every
//! `evaluate_every` and soon after reports or events committed (at most that
//! often), with what the controller observed outside any context's tables
//! (`Observations`: the broker's queue depths, nodes behind on a section).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use mesh_observability::{Behind, Observations, QueueDepth};
use tokio_util::sync::CancellationToken;

use crate::broker_stats::{self, QueueDepthsWatch};
use crate::contexts::Contexts;
use crate::metrics::Metrics;

/// A queue reading older than this is not judged on (the broker is away, or
/// the stats task is stuck): queue alerts stay as they are.
const STALE_DEPTHS: Duration = Duration::from_secs(120);

/// Evaluate health and alerts until `shutdown`; each evaluation's counts go
/// to the module-health and open-alert gauges.
pub async fn run(
    contexts: Arc<Contexts>,
    metrics: Metrics,
    depths: QueueDepthsWatch,
    shutdown: CancellationToken,
) {
    let every = contexts.observability.settings().evaluate_every;
    // Reports arriving in a stream wake it often: never more than this.
    let spacing = (every / 5).max(Duration::from_millis(200));
    loop {
        let observations = observations(&contexts, &depths).await;
        match contexts.observability.evaluate(&observations).await {
            Ok(summary) => {
                let modules: Vec<(String, i64)> = summary
                    .modules
                    .iter()
                    .map(|(h, n)| ((*h).to_owned(), *n))
                    .collect();
                metrics.set_module_health_counts(&modules);
                let alerts: Vec<((String, String), i64)> = summary
                    .alerts
                    .iter()
                    .map(|(k, n)| (k.clone(), *n))
                    .collect();
                metrics.set_open_alerts(&alerts);
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
async fn observations(contexts: &Contexts, depths: &QueueDepthsWatch) -> Observations {
    Observations {
        queues: queues(depths),
        behind: behind(contexts).await,
    }
}

/// The broker's latest queue depths, as the alerts read them: the
/// dead-letter queue (any message) and each report queue against its warning
/// depth. None without a recent reading.
fn queues(depths: &QueueDepthsWatch) -> Option<Vec<QueueDepth>> {
    let reading = depths.borrow();
    let d = reading.as_ref()?;
    let age = (chrono::Utc::now() - d.at).to_std().unwrap_or_default();
    if age > STALE_DEPTHS {
        return None;
    }
    Some(
        d.depths
            .iter()
            .filter_map(|(queue, &messages)| {
                if queue == mesh_protocol::topology::DEAD_LETTER_QUEUE {
                    return Some(QueueDepth {
                        queue: queue.clone(),
                        messages,
                        warn_above: 0,
                        dead_letter: true,
                    });
                }
                Some(QueueDepth {
                    queue: queue.clone(),
                    messages,
                    warn_above: broker_stats::warning_depth(queue)?,
                    dead_letter: false,
                })
            })
            .collect(),
    )
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
