//! The delivery context's clock: rollouts move on every `rollout_tick_ms`
//! and soon after reports or events committed, or an operator's change.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::contexts::Contexts;
use crate::metrics::Metrics;

/// Tick rollouts until `shutdown`; each tick's counts go to
/// `mesh_controller_rollouts`.
pub async fn run(
    contexts: Arc<Contexts>,
    metrics: Metrics,
    every: Duration,
    shutdown: CancellationToken,
) {
    // A stream of reports wakes it often: never more than this.
    let spacing = (every / 10).max(Duration::from_millis(50));
    loop {
        match contexts.delivery.tick().await {
            Ok(t) if t.moved > 0 => {
                tracing::info!(moved = t.moved, modules = ?t.modules, "rollouts moved on");
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "moving rollouts on failed; retrying"),
        }
        match contexts.delivery.rollout_counts().await {
            Ok(counts) => metrics.set_rollout_counts(&counts),
            Err(e) => tracing::debug!(error = %e, "counting rollouts failed"),
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
            _ = contexts.delivery.woken() => {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(spacing) => {}
                }
            }
        }
    }
}
