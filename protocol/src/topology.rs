//! Names and bounds of every exchange and queue. docs/protocol.md lists the same
//! table with the reason for each bound; change both together.

use crate::{NodeId, ReportKind};

/// The virtual host of a production mesh; tests use one vhost each.
pub const DEFAULT_VHOST: &str = "mesh";

/// Topic exchange nodes publish reports to, routing key `<node>.<kind>`.
pub const REPORTS_EXCHANGE: &str = "reports";
/// Direct exchange the controller publishes declarations to, routing key `<node>`.
pub const DECLARATIONS_EXCHANGE: &str = "declarations";
/// Topic exchange of domain events, routing key `<context>.<event>`.
pub const RECORD_EXCHANGE: &str = "record";
/// Fanout exchange for messages the controller could not process.
pub const DEAD_LETTER_EXCHANGE: &str = "dead-letter";
/// The one queue behind [`DEAD_LETTER_EXCHANGE`].
pub const DEAD_LETTER_QUEUE: &str = "dead-letter";

/// Header a dead-lettered message carries: why it was refused, in words.
pub const REASON_HEADER: &str = "x-mesh-reason";
/// Header a dead-lettered message carries: the reason's short metric label.
pub const REASON_CODE_HEADER: &str = "x-mesh-reason-code";
/// Header a dead-lettered message carries: the queue it was taken from.
pub const ORIGIN_QUEUE_HEADER: &str = "x-mesh-origin-queue";

/// Header a dead-lettered message carries: the broker user that sent it, if any.
pub const ORIGIN_USER_HEADER: &str = "x-mesh-origin-user";

/// Bound of the heartbeat queue (messages); overflow drops the oldest heartbeat,
/// which the next one from the same node supersedes anyway.
pub const HEARTBEAT_QUEUE_MAX_LEN: i64 = 200_000;
/// Bound of the hello and applied queues (messages); overflow refuses the publish
/// (reject-publish), so the agent keeps the report in its buffer and retries.
pub const REPORT_QUEUE_MAX_LEN: i64 = 100_000;
/// Bound of the units queue (messages); overflow drops the oldest: a units report
/// is a node's whole list, superseded by its next one.
pub const UNITS_QUEUE_MAX_LEN: i64 = 100_000;
/// Bound of each node's declaration queue (messages); overflow drops the oldest:
/// declarations are whole sections and a behind node is re-sent the newest.
pub const DECLARATION_QUEUE_MAX_LEN: i64 = 64;
/// Bound of each context's record queue (messages); overflow refuses the publish,
/// so the outbox relay keeps the event and retries.
pub const RECORD_QUEUE_MAX_LEN: i64 = 100_000;
/// Bound of the dead-letter queue (messages); overflow drops the oldest poison.
pub const DEAD_LETTER_QUEUE_MAX_LEN: i64 = 100_000;

pub fn report_queue(kind: ReportKind) -> String {
    format!("reports.{}", kind.as_str())
}

pub fn report_routing_key(node: &NodeId, kind: ReportKind) -> String {
    format!("{node}.{}", kind.as_str())
}

pub fn declaration_queue(node: &NodeId) -> String {
    format!("decl.{node}")
}

pub fn record_queue(context: &str) -> String {
    format!("record.{context}")
}
