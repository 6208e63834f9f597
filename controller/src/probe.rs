//! The broker's publishing path, probed: can a report reach the broker now?
//!
//! Liveness is judged only while the controller observes reports
//! ([`Inventory::observe_from`]). A broker session that is up does not prove
//! it: under a resource alarm (a full disk, memory above the watermark) the
//! broker blocks every publishing connection, the agents' included, while
//! the controller's consumers stay connected and hear nothing. Judged then,
//! every node would turn unreachable at once (found by the fleet soak, issue
//! 32: seven of ten nodes three seconds into a disk alarm).
//!
//! So the controller publishes an empty message of its own, one at a time,
//! on a connection of its own (a blocked connection also stops reading the
//! acks of consumers sharing it), to the declarations exchange with the empty
//! routing key that no node's queue is bound with (a node id is never empty):
//! the broker drops it and confirms. A confirm that does not come within
//! [`Timing::stale_after`] means the broker does not take publishes:
//! observation stops ([`Inventory::observe_stop`]) until the confirm comes,
//! and liveness is judged again only a full grace after that, when the nodes
//! have had a grace to report.

use std::sync::Arc;
use std::time::Duration;

use lapin::BasicProperties;
use lapin::options::BasicPublishOptions;
use mesh_inventory::Inventory;
use mesh_protocol::topology::DECLARATIONS_EXCHANGE;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::amqp;
use crate::metrics::Metrics;

/// How often the probe publishes and how long a confirm may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// Between one confirmed probe and the next.
    pub every: Duration,
    /// A probe not confirmed within this stops observation.
    pub stale_after: Duration,
}

impl Timing {
    /// From the grace liveness is judged with: a third of it (within 200 ms
    /// and 10 s), so a blocked broker is noticed well before any node could
    /// be judged; a probe every half of that.
    pub fn for_grace(grace: Duration) -> Timing {
        let stale_after = (grace / 3).clamp(Duration::from_millis(200), Duration::from_secs(10));
        Timing {
            every: stale_after / 2,
            stale_after,
        }
    }
}

/// Where the probe connects: the session's broker.
pub struct Target<'a> {
    pub url: &'a str,
    pub endpoint: Option<&'a (String, u16)>,
    pub heartbeat: Duration,
    pub connect_timeout: Duration,
}

/// Probe until `end`: never returns before it (a session task that returns
/// ends the session), reconnecting its own connection when it is lost.
pub async fn run(
    target: Target<'_>,
    inventory: Arc<Inventory>,
    metrics: Metrics,
    end: CancellationToken,
) {
    let mut stale = false;
    while !end.is_cancelled() {
        let timing = Timing::for_grace(Duration::from_millis(inventory.heartbeat().grace_ms));
        let conn = match amqp::connect_to(
            target.url,
            target.endpoint,
            target.heartbeat,
            target.connect_timeout,
        )
        .await
        {
            Ok(conn) => conn,
            Err(e) => {
                tracing::debug!(error = %e, "probe: cannot connect; trying again");
                if end
                    .run_until_cancelled(tokio::time::sleep(timing.stale_after))
                    .await
                    .is_none()
                {
                    return;
                }
                continue;
            }
        };
        if let Err(e) = probe(&conn, &inventory, &metrics, &end, &mut stale).await {
            tracing::debug!(error = %e, "probe: connection lost; reconnecting");
        }
        mesh_amqp::close(&conn, "probe ending", Duration::from_secs(1)).await;
    }
}

/// One connection's probes; returns at `end` or on a broker error.
async fn probe(
    conn: &lapin::Connection,
    inventory: &Inventory,
    metrics: &Metrics,
    end: &CancellationToken,
    stale: &mut bool,
) -> Result<(), lapin::Error> {
    let ch = amqp::confirm_channel(conn).await?;
    loop {
        let timing = Timing::for_grace(Duration::from_millis(inventory.heartbeat().grace_ms));
        let started = Instant::now();
        let publish = async {
            ch.basic_publish(
                DECLARATIONS_EXCHANGE.into(),
                "".into(),
                BasicPublishOptions::default(),
                b"",
                BasicProperties::default(),
            )
            .await?
            .await
        };
        tokio::pin!(publish);
        let confirmed = loop {
            tokio::select! {
                _ = end.cancelled() => return Ok(()),
                confirmed = &mut publish => break confirmed?,
                _ = tokio::time::sleep_until(started + timing.stale_after), if !*stale => {
                    *stale = true;
                    metrics.broker_publishing_blocked.set(1);
                    inventory.observe_stop();
                    tracing::warn!(
                        waited_ms = timing.stale_after.as_millis() as u64,
                        "the broker does not confirm a publish (a resource alarm?): \
                         no report can reach it, so no node is judged until it does"
                    );
                }
            }
        };
        if confirmed.is_nack() {
            tracing::debug!("probe: the broker refused the probe");
        } else if *stale {
            *stale = false;
            metrics.broker_publishing_blocked.set(0);
            inventory.observe_from(chrono::Utc::now());
            tracing::info!(
                "the broker confirms publishes again: nodes are judged after a full grace"
            );
        }
        if end
            .run_until_cancelled(tokio::time::sleep(timing.every))
            .await
            .is_none()
        {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_blocked_broker_is_noticed_well_within_the_grace() {
        let t = Timing::for_grace(Duration::from_secs(30));
        assert_eq!(t.stale_after, Duration::from_secs(10));
        assert_eq!(t.every, Duration::from_secs(5));
        let short = Timing::for_grace(Duration::from_secs(3));
        assert_eq!(short.stale_after, Duration::from_secs(1));
        assert!(Timing::for_grace(Duration::ZERO).stale_after >= Duration::from_millis(200));
        assert!(
            Timing::for_grace(Duration::from_secs(3600)).stale_after <= Duration::from_secs(10)
        );
    }
}
