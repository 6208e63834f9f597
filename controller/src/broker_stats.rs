//! What the broker holds: the depth of every queue the controller consumes,
//! and of the dead-letter queue, read every `broker_stats_secs` on the
//! controller's own connection.
//!
//! Each depth comes from a passive `queue.declare` (its declare-ok carries the
//! queue's ready messages): cheap, current, and allowed to the controller's
//! user (a passive declare is not permission-checked). The management API's
//! figures lag up to 30 s (decision 0011), so they are not used. A passive
//! declare of a missing queue closes its channel: the next queue is read on a
//! fresh one, and the missing queue has no depth in that reading.
//!
//! The latest reading goes to `mesh_controller_queue_messages{queue}` and to a
//! [`QueueDepthsWatch`]: `app::run` makes the channel; the API's state holds a
//! receiver (`ApiState::queue_depths`) and any task can be handed a clone.
//! It stays `None` until the first reading and keeps the last reading while
//! the broker is unreachable (its [`QueueDepths::at`] says how old it is).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use lapin::{Channel, Connection};
use mesh_protocol::ReportKind;
use mesh_protocol::topology::{self, *};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;

/// One reading of the broker's queues.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueDepths {
    /// When the reading was taken.
    pub at: DateTime<Utc>,
    /// Ready messages (not those delivered and awaiting their ack) per queue
    /// name: `reports.<kind>` of every report kind, `record.<context>` of
    /// every context that consumes the record, `reports.unroutable` and
    /// `dead-letter`. A queue that could not be read is absent.
    pub depths: BTreeMap<String, u64>,
}

impl QueueDepths {
    /// The depth of `queue`, if it was read.
    pub fn get(&self, queue: &str) -> Option<u64> {
        self.depths.get(queue).copied()
    }

    /// Messages waiting in the dead-letter queue, if it was read.
    pub fn dead_letter(&self) -> Option<u64> {
        self.get(DEAD_LETTER_QUEUE)
    }

    /// Every queue deeper than its [`warning_depth`]: (queue, depth, warning depth).
    pub fn above_warning(&self) -> Vec<(&str, u64, u64)> {
        self.depths
            .iter()
            .filter_map(|(queue, depth)| {
                let warning = warning_depth(queue)?;
                (*depth > warning).then_some((queue.as_str(), *depth, warning))
            })
            .collect()
    }
}

/// The receiving end of the controller's queue readings.
pub type QueueDepthsWatch = watch::Receiver<Option<QueueDepths>>;

/// Warning depth of `reports.heartbeat`: a tenth of its bound
/// ([`HEARTBEAT_QUEUE_MAX_LEN`]).
pub const HEARTBEAT_QUEUE_WARNING_DEPTH: u64 = HEARTBEAT_QUEUE_MAX_LEN.unsigned_abs() / 10;
/// Warning depth of `reports.hello`, `reports.applied` and
/// `reports.certificates`: a tenth of their bound ([`REPORT_QUEUE_MAX_LEN`]).
pub const REPORT_QUEUE_WARNING_DEPTH: u64 = REPORT_QUEUE_MAX_LEN.unsigned_abs() / 10;
/// Warning depth of `reports.units`: a tenth of its bound ([`UNITS_QUEUE_MAX_LEN`]).
pub const UNITS_QUEUE_WARNING_DEPTH: u64 = UNITS_QUEUE_MAX_LEN.unsigned_abs() / 10;
/// Warning depth of `reports.health`: a tenth of its bound ([`HEALTH_QUEUE_MAX_LEN`]).
pub const HEALTH_QUEUE_WARNING_DEPTH: u64 = HEALTH_QUEUE_MAX_LEN.unsigned_abs() / 10;

/// Warning depth of `reports.logs`: a tenth of its bound ([`LOGS_QUEUE_MAX_LEN`]).
pub const LOGS_QUEUE_WARNING_DEPTH: u64 = LOGS_QUEUE_MAX_LEN.unsigned_abs() / 10;

/// Warning depth of `reports.resources`: a tenth of its bound ([`RESOURCES_QUEUE_MAX_LEN`]).
pub const RESOURCES_QUEUE_WARNING_DEPTH: u64 = RESOURCES_QUEUE_MAX_LEN.unsigned_abs() / 10;

/// The warning depth of the queue of `kind`: a tenth of its bound. Past it
/// the controller is falling behind that kind of report (a sustained backlog,
/// long before the bound drops or refuses anything).
pub const fn report_queue_warning_depth(kind: ReportKind) -> u64 {
    match kind {
        ReportKind::Heartbeat => HEARTBEAT_QUEUE_WARNING_DEPTH,
        ReportKind::Hello | ReportKind::Applied | ReportKind::Certificates => {
            REPORT_QUEUE_WARNING_DEPTH
        }
        ReportKind::Units => UNITS_QUEUE_WARNING_DEPTH,
        ReportKind::Health => HEALTH_QUEUE_WARNING_DEPTH,
        ReportKind::Logs => LOGS_QUEUE_WARNING_DEPTH,
        ReportKind::Resources => RESOURCES_QUEUE_WARNING_DEPTH,
    }
}

/// The warning depth of a report queue by name (`reports.<kind>`); `None` for
/// any other queue (the dead-letter queue warns when it is not empty, which
/// is the caller's rule, not a depth).
pub fn warning_depth(queue: &str) -> Option<u64> {
    ReportKind::ALL
        .into_iter()
        .find(|kind| topology::report_queue(*kind) == queue)
        .map(report_queue_warning_depth)
}

/// The queues a reading covers: every report queue, the record queue of each
/// context in `record_subscriptions` that subscribes to anything,
/// `reports.unroutable` and `dead-letter`.
pub fn watched_queues(record_subscriptions: &[(&str, &[&str])]) -> Vec<String> {
    let mut queues: Vec<String> = ReportKind::ALL
        .into_iter()
        .map(topology::report_queue)
        .collect();
    for (context, patterns) in record_subscriptions {
        if !patterns.is_empty() {
            queues.push(topology::record_queue(context));
        }
    }
    queues.push(UNROUTABLE_QUEUE.to_owned());
    queues.push(DEAD_LETTER_QUEUE.to_owned());
    queues
}

/// Read the depth of each of `queues` by a passive declare on `channel`
/// (opened on `conn` when absent or closed). A queue whose declare fails is
/// left out; its channel is dropped and the next queue gets a fresh one.
/// Fails only when no channel can be opened (the connection is gone).
pub async fn read(
    conn: &Connection,
    channel: &mut Option<Channel>,
    queues: &[String],
) -> Result<QueueDepths, lapin::Error> {
    let mut depths = BTreeMap::new();
    for queue in queues {
        let ch = match channel.take() {
            Some(ch) if ch.status().connected() => ch,
            _ => conn.create_channel().await?,
        };
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        match ch
            .queue_declare(queue.as_str().into(), passive, FieldTable::default())
            .await
        {
            Ok(q) => {
                depths.insert(queue.clone(), u64::from(q.message_count()));
                *channel = Some(ch);
            }
            Err(e) => {
                // The broker closed the channel (404 for a missing queue).
                tracing::debug!(queue = %queue, error = %e, "cannot read the queue's depth");
            }
        }
    }
    Ok(QueueDepths {
        at: Utc::now(),
        depths,
    })
}

/// Read `queues` every `interval` until `shutdown`, publishing each reading to
/// the gauges and to `publish`. A failed reading is logged and retried on the
/// next round; it never ends the broker session.
pub async fn run(
    conn: Arc<Connection>,
    queues: Vec<String>,
    interval: Duration,
    metrics: Metrics,
    publish: watch::Sender<Option<QueueDepths>>,
    shutdown: CancellationToken,
) {
    let mut channel = None;
    loop {
        match read(&conn, &mut channel, &queues).await {
            Ok(reading) => {
                for queue in &queues {
                    let labels = Metrics::queue(queue);
                    match reading.get(queue) {
                        Some(depth) => {
                            metrics
                                .queue_messages
                                .get_or_create(&labels)
                                .set(i64::try_from(depth).unwrap_or(i64::MAX));
                        }
                        None => {
                            metrics.queue_messages.remove(&labels);
                        }
                    }
                }
                publish.send_replace(Some(reading));
            }
            Err(e) => {
                tracing::warn!(error = %e, "reading the broker's queue depths failed; retrying next round");
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep(interval) => {}
        }
    }
    if let Some(ch) = channel {
        let _ = ch.close(200, "broker stats ending".into()).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warning_depths_are_a_tenth_of_each_bound() {
        assert_eq!(HEARTBEAT_QUEUE_WARNING_DEPTH, 20_000);
        assert_eq!(REPORT_QUEUE_WARNING_DEPTH, 10_000);
        for kind in ReportKind::ALL {
            assert!(warning_depth(&topology::report_queue(kind)).is_some());
        }
        assert_eq!(warning_depth(DEAD_LETTER_QUEUE), None);
        let reading = QueueDepths {
            at: Utc::now(),
            depths: [
                ("reports.hello".to_owned(), 10_001),
                ("reports.heartbeat".to_owned(), 10_001),
                (DEAD_LETTER_QUEUE.to_owned(), 3),
            ]
            .into_iter()
            .collect(),
        };
        assert_eq!(
            reading.above_warning(),
            vec![("reports.hello", 10_001, 10_000)]
        );
        assert_eq!(reading.dead_letter(), Some(3));
    }

    #[test]
    fn every_consumed_queue_and_the_dead_letter_queue_are_watched() {
        let patterns: &[&str] = &["inventory.#"];
        let queues = watched_queues(&[("config", patterns), ("identity", &[])]);
        for kind in ReportKind::ALL {
            assert!(queues.contains(&topology::report_queue(kind)));
        }
        assert!(queues.contains(&"record.config".to_owned()));
        assert!(!queues.contains(&"record.identity".to_owned()));
        assert!(queues.contains(&"reports.unroutable".to_owned()));
        assert!(queues.contains(&"dead-letter".to_owned()));
    }
}
