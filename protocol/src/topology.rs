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
/// Fanout exchange that is the alternate exchange of [`REPORTS_EXCHANGE`]: a
/// report whose routing key matches no queue (an unknown kind, `<node>.bogus`)
/// goes here instead of being dropped by the broker. Set by the policy
/// [`REPORTS_POLICY`], not by an exchange argument (decision 0021).
pub const UNROUTABLE_EXCHANGE: &str = "reports.unroutable";
/// The one queue behind [`UNROUTABLE_EXCHANGE`]; the controller dead-letters
/// everything in it with reason `unroutable`.
pub const UNROUTABLE_QUEUE: &str = "reports.unroutable";
/// The vhost policy that gives [`REPORTS_EXCHANGE`] its alternate exchange
/// (provisioned by the bundle; a policy applies to an exchange that already
/// exists, where a new exchange argument would be refused).
pub const REPORTS_POLICY: &str = "mesh-reports-alternate-exchange";

/// Header a dead-lettered message carries: why it was refused, in words.
pub const REASON_HEADER: &str = "x-mesh-reason";
/// Header a dead-lettered message carries: the reason's short metric label.
pub const REASON_CODE_HEADER: &str = "x-mesh-reason-code";
/// Header a dead-lettered message carries: the queue it was taken from.
pub const ORIGIN_QUEUE_HEADER: &str = "x-mesh-origin-queue";

/// Header a dead-lettered message carries: the broker user that sent it, if any.
pub const ORIGIN_USER_HEADER: &str = "x-mesh-origin-user";

/// Header every declaration carries: the controller's Ed25519 signature of the
/// message body (the exact bytes), 128 hex digits. Agents apply nothing without a
/// valid one ([`crate::signing`]).
pub const SIGNATURE_HEADER: &str = "x-mesh-signature";

/// Bound of the heartbeat queue (messages); overflow drops the oldest heartbeat,
/// which the next one from the same node supersedes anyway.
pub const HEARTBEAT_QUEUE_MAX_LEN: i64 = 200_000;
/// Bound of the hello and applied queues (messages); overflow refuses the publish
/// (reject-publish), so the agent keeps the report in its buffer and retries.
pub const REPORT_QUEUE_MAX_LEN: i64 = 100_000;
/// Bound of the units queue (messages); overflow drops the oldest: a units report
/// is a node's whole list, superseded by its next one.
pub const UNITS_QUEUE_MAX_LEN: i64 = 100_000;
/// Bound of the health queue (messages); overflow drops the oldest: a health
/// report is a node's whole list of probe results, superseded by its next one.
pub const HEALTH_QUEUE_MAX_LEN: i64 = 100_000;
/// Bound of the resources queue (messages); overflow drops the oldest: a
/// resources report is a provider node's whole list, superseded by its next.
pub const RESOURCES_QUEUE_MAX_LEN: i64 = 100_000;
/// Bound of the logs queue (messages); overflow drops the oldest: an answer
/// is wanted for seconds only (it also expires), and the controller asks at
/// most `logs_max_requests` × `logs_max_nodes` at once (decision 0033).
pub const LOGS_QUEUE_MAX_LEN: i64 = 1_000;
/// How long a logs answer may wait in `reports.logs` (its AMQP expiration,
/// milliseconds): after that nobody waits for it any more.
pub const LOGS_ANSWER_EXPIRATION_MS: u64 = 30_000;
/// Bound of each node's declaration queue (messages); overflow drops the oldest:
/// declarations are whole sections and a behind node is re-sent the newest.
pub const DECLARATION_QUEUE_MAX_LEN: i64 = 64;
/// Bound of each context's record queue (messages); overflow refuses the publish,
/// so the outbox relay keeps the event and retries.
pub const RECORD_QUEUE_MAX_LEN: i64 = 100_000;
/// Bound of the dead-letter queue (messages); overflow drops the oldest poison.
pub const DEAD_LETTER_QUEUE_MAX_LEN: i64 = 100_000;
/// Bound of the unroutable queue (messages); overflow refuses the publish
/// (reject-publish): the sender of an unknown kind gets a NACK, so nothing it
/// sent vanishes unseen, and only that sender is slowed.
pub const UNROUTABLE_QUEUE_MAX_LEN: i64 = 10_000;

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

/// A node's broker permissions, exactly as docs/protocol.md's table says: on the
/// vhost, configure nothing, write only `reports`, read only its own declaration
/// queue; on the `reports` topic exchange, routing keys `<node>.` only.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodePermissions {
    pub configure: String,
    pub write: String,
    pub read: String,
    /// The topic exchange the topic permission applies to ([`REPORTS_EXCHANGE`]).
    pub topic_exchange: &'static str,
    pub topic_write: String,
    pub topic_read: String,
}

pub fn node_permissions(node: &NodeId) -> NodePermissions {
    // A node id is [a-z0-9-]: nothing in it needs escaping in a regex.
    NodePermissions {
        configure: "^$".to_owned(),
        write: format!("^{REPORTS_EXCHANGE}$"),
        read: format!("^decl\\.{node}$"),
        topic_exchange: REPORTS_EXCHANGE,
        topic_write: format!("^{node}\\."),
        topic_read: format!("^{node}\\."),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_permissions_match_the_table() {
        let p = node_permissions(&NodeId::parse("node-a").unwrap());
        assert_eq!(p.configure, "^$");
        assert_eq!(p.write, "^reports$");
        assert_eq!(p.read, r"^decl\.node-a$");
        assert_eq!(p.topic_write, r"^node-a\.");
        assert_eq!(p.topic_read, r"^node-a\.");
    }
}
