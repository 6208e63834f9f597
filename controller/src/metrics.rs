//! The controller's own Prometheus metrics, served at `GET /metrics`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QueueLabels {
    pub queue: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub queue: String,
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    pub kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PathLabels {
    pub path: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ContextLabels {
    pub context: String,
}

/// Every metric the controller exports. Cheap to clone (the families are shared).
#[derive(Clone)]
pub struct Metrics {
    /// Messages taken from a queue and committed (handled or found duplicate).
    pub handled: Family<QueueLabels, Counter>,
    /// Messages refused to the dead-letter queue, by reason.
    pub dead_lettered: Family<ReasonLabels, Counter>,
    /// Batches that failed with a transient error and were retried in place.
    pub retried: Family<QueueLabels, Counter>,
    /// Seconds from taking a batch to acknowledging it.
    pub batch_seconds: Family<QueueLabels, Histogram>,
    /// Outbox rows confirmed by the broker.
    pub published: Family<ContextLabels, Counter>,
    /// Outbox rows not yet confirmed, as of the relay's last round.
    pub outbox_backlog: Family<ContextLabels, Gauge>,
    /// Connections to the broker made (the first and every reconnect).
    pub broker_connects: Counter,
    /// Fields of handled messages this version does not know (a newer sender's),
    /// ignored, by message kind (report kind, or record `<context>.<event>`).
    pub unknown_fields: Family<KindLabels, Counter>,
    /// API requests refused with 401 (no principal, so no audit entry).
    pub unauthenticated: Counter,
    /// Mutations that answered 2xx without writing their audit entry in their
    /// transaction (a handler's bug; the auth layer wrote the entry afterwards).
    pub mutations_unaudited: Family<ContextLabels, Counter>,
    /// Audit entries the auth layer could not write (403s and failures).
    pub audit_lost: Family<ContextLabels, Counter>,
    /// Heartbeats handled, by path: `memory` (in step, written later in
    /// batches) or `durable` (out of step or a state change: written at once).
    pub heartbeats: Family<PathLabels, Counter>,
    /// Nodes whose last heartbeat the liveness writer put in the database.
    pub liveness_written: Counter,
}

impl Metrics {
    pub fn new(registry: &mut Registry) -> Metrics {
        let m = Metrics {
            handled: Family::default(),
            dead_lettered: Family::default(),
            retried: Family::default(),
            batch_seconds: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.0005, 2.0, 16))
            }),
            published: Family::default(),
            outbox_backlog: Family::default(),
            broker_connects: Counter::default(),
            unknown_fields: Family::default(),
            unauthenticated: Counter::default(),
            mutations_unaudited: Family::default(),
            audit_lost: Family::default(),
            heartbeats: Family::default(),
            liveness_written: Counter::default(),
        };
        registry.register(
            "mesh_messages_handled",
            "Messages committed by their contexts",
            m.handled.clone(),
        );
        registry.register(
            "mesh_dead_lettered",
            "Messages refused to the dead-letter queue",
            m.dead_lettered.clone(),
        );
        registry.register(
            "mesh_batches_retried",
            "Batches retried after a transient error",
            m.retried.clone(),
        );
        registry.register(
            "mesh_batch_seconds",
            "Time from taking a batch to acknowledging it",
            m.batch_seconds.clone(),
        );
        registry.register(
            "mesh_outbox_published",
            "Outbox rows confirmed by the broker",
            m.published.clone(),
        );
        registry.register(
            "mesh_outbox_backlog",
            "Outbox rows waiting to be published",
            m.outbox_backlog.clone(),
        );
        registry.register(
            "mesh_broker_connects",
            "Connections made to the broker",
            m.broker_connects.clone(),
        );
        registry.register(
            "mesh_unknown_fields",
            "Fields of accepted messages this version does not know, ignored",
            m.unknown_fields.clone(),
        );
        registry.register(
            "mesh_api_unauthenticated",
            "API requests refused for a missing, unknown or revoked token",
            m.unauthenticated.clone(),
        );
        registry.register(
            "mesh_api_mutations_unaudited",
            "API mutations that succeeded without an audit entry in their transaction",
            m.mutations_unaudited.clone(),
        );
        registry.register(
            "mesh_api_audit_lost",
            "Audit entries of refused or failed API requests that could not be written",
            m.audit_lost.clone(),
        );
        registry.register(
            "mesh_heartbeats",
            "Heartbeats handled, by path (memory: in step; durable: written at once)",
            m.heartbeats.clone(),
        );
        registry.register(
            "mesh_liveness_written",
            "Nodes whose last heartbeat was written to the database from memory",
            m.liveness_written.clone(),
        );
        m
    }

    /// Count a heartbeat batch: `durable` of its `total` took the durable path.
    pub fn heartbeats(&self, total: usize, durable: usize) {
        let count = |path: &str, n: usize| {
            self.heartbeats
                .get_or_create(&PathLabels { path: path.into() })
                .inc_by(u64::try_from(n).unwrap_or(u64::MAX));
        };
        count("memory", total.saturating_sub(durable));
        count("durable", durable);
    }

    /// Count the fields a message of `kind` carried that this version ignored.
    pub fn unknown_fields(&self, kind: &str, unknown: &mesh_protocol::UnknownFields) {
        if unknown.is_empty() {
            return;
        }
        let count = u64::try_from(unknown.count).unwrap_or(u64::MAX);
        self.unknown_fields
            .get_or_create(&KindLabels {
                kind: kind.to_owned(),
            })
            .inc_by(count);
    }

    pub fn queue(queue: &str) -> QueueLabels {
        QueueLabels {
            queue: queue.to_owned(),
        }
    }

    pub fn context(context: &str) -> ContextLabels {
        ContextLabels {
            context: context.to_owned(),
        }
    }
}
