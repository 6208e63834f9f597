//! The controller's own Prometheus metrics, served at `GET /metrics`.
//!
//! Every family is named `mesh_controller_*` in base units (`_seconds`);
//! prometheus-client adds `_total` to every counter. docs/observability.md
//! ("The controller's") lists each family, and `controller/tests/observability.rs`
//! checks that list against what `/metrics` serves, both ways.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Metric, Registry};

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

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VersionLabels {
    pub version: String,
}

/// A context's handler and what it handled: a report kind, or `record`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HandlerLabels {
    pub context: String,
    pub kind: String,
}

/// An API request: the route pattern axum matched (`unmatched` when none),
/// the method and the status.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub route: String,
    pub method: String,
    pub status: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabels {
    pub route: String,
    pub method: String,
}

/// Every outcome of a logs request (`mesh_controller_logs_requests_total`).
pub const LOGS_REQUEST_OUTCOMES: [&str; 4] = ["answered", "timeout", "busy", "unavailable"];
/// Every outcome of a `logs` answer (`mesh_controller_logs_answers_total`).
pub const LOGS_ANSWER_OUTCOMES: [&str; 4] = ["accepted", "late", "duplicate", "unsolicited"];

/// How a logs request or answer ended (decision 0033).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: String,
}

/// Where a lag-tolerant read was served: `replica` or `primary`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TargetLabels {
    pub target: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabels {
    pub state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HealthLabels {
    pub health: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CertificateLabels {
    /// `api` (the HTTPS API's), `mesh_ca`.
    pub certificate: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AlertLabels {
    pub kind: String,
    pub severity: String,
}

/// A histogram family whose histograms are made by a plain function.
pub type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

/// A gauge holding seconds (a float).
pub type SecondsGauge = Gauge<f64, AtomicU64>;

/// Buckets of handler and batch durations: 0.5 ms to ~16 s.
pub(crate) fn batch_buckets() -> Histogram {
    Histogram::new(exponential_buckets(0.0005, 2.0, 16))
}

/// Buckets of API request durations: 1 ms to ~16 s.
fn request_buckets() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 15))
}

/// The module health states `mesh_controller_modules{health}` always carries
/// (zero when no module is in it).
pub const MODULE_HEALTH: [&str; 4] = ["healthy", "degraded", "down", "unknown"];

/// The states a rollout can be in, each a series of `mesh_controller_rollouts`.
pub const ROLLOUT_STATES: [&str; 8] = [
    "awaiting_approval",
    "running",
    "paused",
    "succeeded",
    "failed",
    "rolled_back",
    "denied",
    "canceled",
];

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
    pub batch_seconds: Histograms<QueueLabels>,
    /// Seconds each context's transaction took per batch (inbox, handler,
    /// commit), by context and kind (report kind, or `record`).
    pub handler_seconds: Histograms<HandlerLabels>,
    /// Outbox rows confirmed by the broker.
    pub published: Family<ContextLabels, Counter>,
    /// Outbox rows not yet confirmed, as of the relay's last round.
    pub outbox_backlog: Family<ContextLabels, Gauge>,
    /// Age of the oldest unsent outbox row per context (0 when none waits).
    pub outbox_oldest_unsent: Family<ContextLabels, SecondsGauge>,
    /// Connections to the broker made (the first and every reconnect).
    pub broker_connects: Counter,
    /// 1 while the broker session is up, else 0.
    pub broker_connected: Gauge,
    /// 1 while the broker does not confirm the controller's probe publish (a
    /// resource alarm blocks publishers: no node is judged), else 0.
    pub broker_publishing_blocked: Gauge,
    /// Messages in each queue the controller consumes (and the dead-letter
    /// queue), as of the last broker reading (`broker_stats_secs`).
    pub queue_messages: Family<QueueLabels, Gauge>,
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
    /// API requests answered, by route pattern, method and status.
    pub http_requests: Family<RequestLabels, Counter>,
    /// Seconds from a request's arrival to its response's head.
    pub http_request_seconds: Histograms<RouteLabels>,
    /// Heartbeats handled, by path: `memory` (in step, written later in
    /// batches) or `durable` (out of step or a state change: written at once).
    pub heartbeats: Family<PathLabels, Counter>,
    /// Nodes whose last heartbeat the liveness writer put in the database.
    pub liveness_written: Counter,
    /// Nodes by state, as inventory shows them (refreshed by the stats task).
    pub nodes: Family<StateLabels, Gauge>,
    /// Modules by health (set by the observability work through
    /// [`Metrics::set_module_health_counts`]).
    pub modules: Family<HealthLabels, Gauge>,
    /// Rollouts by state (set by the rollout clock through
    /// [`Metrics::set_rollout_counts`]).
    pub rollouts: Family<StateLabels, Gauge>,
    /// Open alerts by kind and severity (set through [`Metrics::set_open_alerts`]).
    pub alerts: Family<AlertLabels, Gauge>,
    /// When each certificate the controller holds expires (Unix seconds):
    /// `api` (its HTTPS listener's, renewed at two thirds) and `mesh_ca`.
    pub certificate_expiry: Family<CertificateLabels, SecondsGauge>,
    /// The fleet's heartbeat detection time now (grace plus one sweep; the
    /// budget stretches it as the fleet grows), in seconds.
    pub heartbeat_detection: SecondsGauge,
    /// Alerts Alertmanager accepted, counted once per Alertmanager (issue 35).
    pub alertmanager_sent: Counter,
    /// Posts to an Alertmanager that failed (unreachable, not 2xx); what
    /// they carried stays pending and is sent again.
    pub alertmanager_failed: Counter,
    /// Alert changes not yet accepted by every Alertmanager.
    pub alertmanager_pending: Gauge,
    /// Always 1, labelled with this build's version.
    pub build_info: Family<VersionLabels, Gauge>,
    /// Logs requests (`GET /v1/modules/{name}/logs`) by outcome: `answered`
    /// (every node asked answered), `timeout` (some did not, or could not be
    /// asked), `busy` (every slot taken), `unavailable` (no broker session).
    pub logs_requests: Family<OutcomeLabels, Counter>,
    /// `logs` reports by outcome: `accepted` (a request waited for it),
    /// `late` (its request had ended), `duplicate`, `unsolicited`
    /// (dead-lettered: no such request, or a node that was not asked).
    pub logs_answers: Family<OutcomeLabels, Counter>,
    /// Nodes asked for logs that did not answer within `logs_wait_ms`.
    pub logs_timeouts: Counter,
    /// The read replica's lag at its last check, in seconds (the largest of
    /// the contexts' checks; 0 with no replica; NaN while unknown: it does
    /// not answer, or replayed nothing yet). Decision 0041.
    pub replica_lag_seconds: SecondsGauge,
    /// 1 while lag-tolerant reads go to the replica (every context's check
    /// found it in recovery and within `replica_max_lag_ms`), else 0.
    pub replica_usable: Gauge,
    /// Lag-tolerant reads served, by target (`replica`, `primary`), as of
    /// the replica clock's last tick.
    pub replica_reads: Family<TargetLabels, Counter>,
    /// Every family registered, as a scrape names it (see [`Metrics::families`]).
    families: Arc<[String]>,
}

/// Registers families and keeps their names.
struct Registrar<'a> {
    registry: &'a mut Registry,
    names: Vec<String>,
}

impl Registrar<'_> {
    fn add(&mut self, name: &str, help: &str, metric: impl Metric) {
        self.names.push(match metric.metric_type() {
            MetricType::Counter => format!("{name}_total"),
            _ => name.to_owned(),
        });
        self.registry.register(name, help, metric);
    }
}

impl Metrics {
    pub fn new(registry: &mut Registry) -> Metrics {
        let m = Metrics {
            handled: Family::default(),
            dead_lettered: Family::default(),
            retried: Family::default(),
            batch_seconds: Family::new_with_constructor(batch_buckets),
            handler_seconds: Family::new_with_constructor(batch_buckets),
            published: Family::default(),
            outbox_backlog: Family::default(),
            outbox_oldest_unsent: Family::default(),
            broker_connects: Counter::default(),
            broker_connected: Gauge::default(),
            broker_publishing_blocked: Gauge::default(),
            queue_messages: Family::default(),
            unknown_fields: Family::default(),
            unauthenticated: Counter::default(),
            mutations_unaudited: Family::default(),
            audit_lost: Family::default(),
            http_requests: Family::default(),
            http_request_seconds: Family::new_with_constructor(request_buckets),
            heartbeats: Family::default(),
            liveness_written: Counter::default(),
            nodes: Family::default(),
            modules: Family::default(),
            rollouts: Family::default(),
            alerts: Family::default(),
            certificate_expiry: Family::default(),
            heartbeat_detection: SecondsGauge::default(),
            alertmanager_sent: Counter::default(),
            alertmanager_failed: Counter::default(),
            alertmanager_pending: Gauge::default(),
            build_info: Family::default(),
            logs_requests: Family::default(),
            logs_answers: Family::default(),
            logs_timeouts: Counter::default(),
            replica_lag_seconds: SecondsGauge::default(),
            replica_usable: Gauge::default(),
            replica_reads: Family::default(),
            families: Arc::from(Vec::new()),
        };
        m.build_info
            .get_or_create(&VersionLabels {
                version: env!("CARGO_PKG_VERSION").to_owned(),
            })
            .set(1);
        for health in MODULE_HEALTH {
            m.modules
                .get_or_create(&HealthLabels {
                    health: health.to_owned(),
                })
                .set(0);
        }
        // Known outcomes start at 0, so both families are in every scrape.
        for (family, outcomes) in [
            (&m.logs_requests, LOGS_REQUEST_OUTCOMES),
            (&m.logs_answers, LOGS_ANSWER_OUTCOMES),
        ] {
            for outcome in outcomes {
                let _ = family.get_or_create(&OutcomeLabels {
                    outcome: outcome.to_owned(),
                });
            }
        }
        for target in mesh_plumbing::reads::Target::ALL {
            let _ = m.replica_reads.get_or_create(&TargetLabels {
                target: target.as_str().to_owned(),
            });
        }
        let mut r = Registrar {
            registry,
            names: Vec::new(),
        };
        r.add(
            "mesh_controller_replica_lag_seconds",
            "The read replica's lag at its last check (0: no replica; NaN: unknown)",
            m.replica_lag_seconds.clone(),
        );
        r.add(
            "mesh_controller_replica_usable",
            "1 while lag-tolerant reads go to the read replica, else 0",
            m.replica_usable.clone(),
        );
        r.add(
            "mesh_controller_replica_reads",
            "Lag-tolerant reads served, by target (replica, primary)",
            m.replica_reads.clone(),
        );
        r.add(
            "mesh_controller_build_info",
            "The controller's build: always 1, labelled with its version",
            m.build_info.clone(),
        );
        r.add(
            "mesh_controller_logs_requests",
            "Logs requests of the API, by outcome",
            m.logs_requests.clone(),
        );
        r.add(
            "mesh_controller_logs_answers",
            "Logs answers of agents, by outcome",
            m.logs_answers.clone(),
        );
        r.add(
            "mesh_controller_logs_timeouts",
            "Nodes asked for logs that did not answer within the wait",
            m.logs_timeouts.clone(),
        );
        r.add(
            "mesh_controller_messages_handled",
            "Messages committed by their contexts",
            m.handled.clone(),
        );
        r.add(
            "mesh_controller_dead_lettered",
            "Messages refused to the dead-letter queue",
            m.dead_lettered.clone(),
        );
        r.add(
            "mesh_controller_batches_retried",
            "Batches retried after a transient error",
            m.retried.clone(),
        );
        r.add(
            "mesh_controller_batch_duration_seconds",
            "Time from taking a batch to acknowledging it",
            m.batch_seconds.clone(),
        );
        r.add(
            "mesh_controller_handler_duration_seconds",
            "Time a context's transaction took for one batch (inbox, handler, commit)",
            m.handler_seconds.clone(),
        );
        r.add(
            "mesh_controller_outbox_published",
            "Outbox rows confirmed by the broker",
            m.published.clone(),
        );
        r.add(
            "mesh_controller_outbox_backlog",
            "Outbox rows of the relay's last round the broker did not confirm",
            m.outbox_backlog.clone(),
        );
        r.add(
            "mesh_controller_outbox_oldest_unsent_seconds",
            "Age of the oldest outbox row not yet published (0: none waits)",
            m.outbox_oldest_unsent.clone(),
        );
        r.add(
            "mesh_controller_broker_connects",
            "Connections made to the broker",
            m.broker_connects.clone(),
        );
        r.add(
            "mesh_controller_broker_connected",
            "1 while the broker session is up, else 0",
            m.broker_connected.clone(),
        );
        r.add(
            "mesh_controller_broker_publishing_blocked",
            "1 while the broker does not confirm the controller's probe publish (no node is judged), else 0",
            m.broker_publishing_blocked.clone(),
        );
        r.add(
            "mesh_controller_queue_messages",
            "Messages in the queue, as of the last broker reading",
            m.queue_messages.clone(),
        );
        r.add(
            "mesh_controller_unknown_fields",
            "Fields of accepted messages this version does not know, ignored",
            m.unknown_fields.clone(),
        );
        r.add(
            "mesh_controller_api_unauthenticated",
            "API requests refused for a missing, unknown or revoked token",
            m.unauthenticated.clone(),
        );
        r.add(
            "mesh_controller_api_mutations_unaudited",
            "API mutations that succeeded without an audit entry in their transaction",
            m.mutations_unaudited.clone(),
        );
        r.add(
            "mesh_controller_api_audit_lost",
            "Audit entries of refused or failed API requests that could not be written",
            m.audit_lost.clone(),
        );
        r.add(
            "mesh_controller_http_requests",
            "API requests answered, by route pattern, method and status",
            m.http_requests.clone(),
        );
        r.add(
            "mesh_controller_http_request_duration_seconds",
            "Time from an API request's arrival to its response's head",
            m.http_request_seconds.clone(),
        );
        r.add(
            "mesh_controller_heartbeats",
            "Heartbeats handled, by path (memory: in step; durable: written at once)",
            m.heartbeats.clone(),
        );
        r.add(
            "mesh_controller_liveness_written",
            "Nodes whose last heartbeat was written to the database from memory",
            m.liveness_written.clone(),
        );
        r.add(
            "mesh_controller_nodes",
            "Nodes by state (alive, unreachable, draining, drained, refused, revoked)",
            m.nodes.clone(),
        );
        r.add(
            "mesh_controller_modules",
            "Modules by health (healthy, degraded, down, unknown)",
            m.modules.clone(),
        );
        r.add(
            "mesh_controller_rollouts",
            "Rollouts by state",
            m.rollouts.clone(),
        );
        r.add(
            "mesh_controller_alerts",
            "Open alerts by kind and severity",
            m.alerts.clone(),
        );
        r.add(
            "mesh_controller_certificate_expiry_timestamp_seconds",
            "When each certificate the controller holds expires, by certificate (api, mesh_ca)",
            m.certificate_expiry.clone(),
        );
        r.add(
            "mesh_controller_heartbeat_detection_seconds",
            "Longest time from a node's last heartbeat until it is judged unreachable (grace plus one sweep), as the heartbeat budget sets it now",
            m.heartbeat_detection.clone(),
        );
        r.add(
            "mesh_controller_alertmanager_sent",
            "Alerts Alertmanager accepted, once per Alertmanager",
            m.alertmanager_sent.clone(),
        );
        r.add(
            "mesh_controller_alertmanager_failed",
            "Posts to an Alertmanager that failed (kept pending, sent again)",
            m.alertmanager_failed.clone(),
        );
        r.add(
            "mesh_controller_alertmanager_pending",
            "Alert changes not yet accepted by every Alertmanager",
            m.alertmanager_pending.clone(),
        );
        Metrics {
            families: r.names.into(),
            ..m
        }
    }

    /// Every family this registers, named as a scrape shows it: counters with
    /// their `_total`. A family with no series yet is not in a scrape at all;
    /// this list is what docs/observability.md's table is checked against.
    pub fn families(&self) -> &[String] {
        &self.families
    }

    /// Create at 0 the series whose label values are known from the start
    /// (each report queue, each context, each report kind, the common
    /// dead-letter reasons), as Prometheus advises: a counter that first
    /// appears at 1 hides its first increase from `rate()`, and a family
    /// with no series is absent from a scrape altogether.
    pub fn initialize(&self, contexts: &[&str]) {
        for kind in mesh_protocol::ReportKind::ALL {
            let queue = mesh_protocol::topology::report_queue(kind);
            let _ = self.handled.get_or_create(&Self::queue(&queue));
            let _ = self.retried.get_or_create(&Self::queue(&queue));
            for reason in ["malformed", "invalid", "handler", "revoked"] {
                let _ = self.dead_lettered.get_or_create(&ReasonLabels {
                    queue: queue.clone(),
                    reason: reason.to_owned(),
                });
            }
            let _ = self.unknown_fields.get_or_create(&KindLabels {
                kind: kind.as_str().to_owned(),
            });
        }
        for context in contexts {
            let c = Self::context(context);
            let _ = self.published.get_or_create(&c);
            let _ = self.outbox_backlog.get_or_create(&c);
            let _ = self.mutations_unaudited.get_or_create(&c);
            let _ = self.audit_lost.get_or_create(&c);
        }
        for path in ["memory", "durable"] {
            let _ = self
                .heartbeats
                .get_or_create(&PathLabels { path: path.into() });
        }
        self.set_module_health_counts(&[]);
        self.set_rollout_counts(&[]);
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

    /// Count one answered API request and its duration.
    pub fn http_request(
        &self,
        route: &str,
        method: &str,
        status: u16,
        latency: std::time::Duration,
    ) {
        self.http_requests
            .get_or_create(&RequestLabels {
                route: route.to_owned(),
                method: method.to_owned(),
                status: status.to_string(),
            })
            .inc();
        self.http_request_seconds
            .get_or_create(&RouteLabels {
                route: route.to_owned(),
                method: method.to_owned(),
            })
            .observe(latency.as_secs_f64());
    }

    /// Replace `mesh_controller_nodes` with `counts` (state, nodes).
    pub fn set_node_counts(&self, counts: &[(String, i64)]) {
        self.nodes.clear();
        for (state, n) in counts {
            self.nodes
                .get_or_create(&StateLabels {
                    state: state.clone(),
                })
                .set(*n);
        }
    }

    /// Replace `mesh_controller_rollouts` with `counts` (state, rollouts):
    /// every state of [`ROLLOUT_STATES`] is set (0 when `counts` does not name it).
    pub fn set_rollout_counts(&self, counts: &[(String, i64)]) {
        for state in ROLLOUT_STATES {
            let n = counts
                .iter()
                .find(|(s, _)| s == state)
                .map_or(0, |(_, n)| *n);
            self.rollouts
                .get_or_create(&StateLabels {
                    state: state.to_owned(),
                })
                .set(n);
        }
    }

    /// Replace `mesh_controller_modules` with `counts` (health, modules): the
    /// family is cleared, then every state of [`MODULE_HEALTH`] is set (0 when
    /// `counts` does not name it) and every pair of `counts`.
    pub fn set_module_health_counts(&self, counts: &[(String, i64)]) {
        self.modules.clear();
        for health in MODULE_HEALTH {
            self.modules
                .get_or_create(&HealthLabels {
                    health: health.to_owned(),
                })
                .set(0);
        }
        for (health, n) in counts {
            self.modules
                .get_or_create(&HealthLabels {
                    health: health.clone(),
                })
                .set(*n);
        }
    }

    /// Replace `mesh_controller_alerts` with `counts` ((kind, severity), open
    /// alerts): the family is cleared, then every pair is set.
    pub fn set_open_alerts(&self, counts: &[((String, String), i64)]) {
        self.alerts.clear();
        for ((kind, severity), n) in counts {
            self.alerts
                .get_or_create(&AlertLabels {
                    kind: kind.clone(),
                    severity: severity.clone(),
                })
                .set(*n);
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn render(registry: &Registry) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, registry).unwrap_or_default();
        text
    }

    #[test]
    fn setters_replace_the_whole_family() {
        let mut registry = Registry::default();
        let m = Metrics::new(&mut registry);
        m.set_open_alerts(&[(("node.unreachable".into(), "warning".into()), 2)]);
        m.set_open_alerts(&[(("queue.depth".into(), "critical".into()), 1)]);
        m.set_module_health_counts(&[("degraded".into(), 3)]);
        let text = render(&registry);
        assert!(
            text.contains("mesh_controller_alerts{kind=\"queue.depth\",severity=\"critical\"} 1\n"),
            "{text}"
        );
        assert!(!text.contains("node.unreachable"), "{text}");
        assert!(
            text.contains("mesh_controller_modules{health=\"degraded\"} 3\n"),
            "{text}"
        );
        assert!(
            text.contains("mesh_controller_modules{health=\"healthy\"} 0\n"),
            "{text}"
        );
        assert!(
            text.contains(&format!(
                "mesh_controller_build_info{{version=\"{}\"}} 1\n",
                env!("CARGO_PKG_VERSION")
            )),
            "{text}"
        );
    }
}
