//! Typed configuration: a TOML file (every field optional, with the default
//! documented here), then `MESH_CONTROLLER_*` environment variables, then flags.
//! Credentials live in a separate file written by the bundle (mode 0600).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use mesh_credentials::{BrokerManagement, ControllerCredentials, CredentialsError, Secret};
use serde::Deserialize;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error(transparent)]
    Credentials(#[from] CredentialsError),
    #[error(
        "{path}: credentials for context `{context}` are missing (expected databases.{context})"
    )]
    MissingContext { path: PathBuf, context: String },
    #[error("environment variable {name}: {message}")]
    Env { name: String, message: String },
    #[error("setting `{field}`: {message}")]
    Invalid {
        field: &'static str,
        message: String,
    },
}

/// The controller's settings.
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    /// File with the broker URL and one database URL per context, written by
    /// `bundle/up`. Default `/etc/mesh/controller-credentials.toml`.
    pub credentials: PathBuf,
    /// Address the plain-HTTP API listens on: loopback only (this host's
    /// operators, the local mesh, tests); anything else is refused, since a
    /// join token, a node's broker password and every bearer token would cross
    /// the network in cleartext. Default `127.0.0.1:7700`.
    pub api_listen: SocketAddr,
    /// Address the HTTPS API listens on (rustls; a certificate the controller
    /// issues itself from the mesh CA). Default: `0.0.0.0` and the port of
    /// `advertise_api`, when the credentials name a CA; without a CA there is
    /// no HTTPS listener.
    pub api_listen_tls: Option<SocketAddr>,
    /// The API's URL other machines reach, `https://<address>:<port>`: handed
    /// to nodes at their join, printed in join commands, and a name in the
    /// API's certificate. Default: `advertise_api` of the credentials file
    /// (bundle/up writes this host's primary address there); none on a
    /// loopback-only mesh.
    pub advertise_api: Option<String>,
    /// The broker's AMQPS endpoint nodes are handed, `<address>:<port>`.
    /// Default: `advertise_broker` of the credentials file; without either,
    /// nodes are handed the controller's own broker address (a loopback-only
    /// mesh).
    pub advertise_broker: Option<String>,
    /// Lifetime of the API's TLS certificate, in seconds: issued from the mesh
    /// CA at start and again at two thirds of it, in the background (new
    /// connections get the new one). Default 86400 (one day).
    pub api_certificate_lifetime_secs: u64,
    /// Unacknowledged deliveries the broker may push per report queue (AMQP
    /// prefetch). Bounds the controller's memory. Default 1000.
    pub prefetch: u16,
    /// Most reports handled in one transaction per context. Default 200.
    pub batch_max: usize,
    /// How long to wait for a batch to fill once its first report arrived, in
    /// milliseconds. Bounds the latency batching adds. Default 20.
    pub batch_wait_ms: u64,
    /// Most outbox rows the relay publishes per round and context. Default 500.
    pub relay_batch: i64,
    /// The relay's poll interval when nothing woke it, in milliseconds. Default 500.
    pub relay_poll_ms: u64,
    /// A node behind on a section is re-sent that section on a heartbeat only if
    /// the last send is older than this, in seconds. Default 30.
    pub resend_after_secs: u64,
    /// Connections per context pool. Default 4.
    pub pool_size: u32,
    /// Longest wait between reconnect attempts to the broker, in milliseconds
    /// (full jitter, doubling from 200 ms). Default 10000.
    pub reconnect_max_ms: u64,
    /// How long one attempt to reach a broker endpoint may take, all of it
    /// (the TCP connect, the TLS and AMQP handshakes), and then each step of
    /// starting a session (declaring the topology, opening channels), in
    /// milliseconds. An endpoint that has not answered by then is given up
    /// and the next of `broker_endpoints` tried: a dead broker behind a load
    /// balancer accepts the connection and never answers. Default 10000; at
    /// least 100.
    pub connect_timeout_ms: u64,
    /// The AMQP heartbeat the controller asks the broker for, in seconds (a
    /// `heartbeat` in the broker URL wins): a connection silent for twice
    /// this is given up (lapin) and the session starts again on the next
    /// endpoint. One connection, so a short one costs nothing. Default 10;
    /// 1 to 65535.
    pub amqp_heartbeat_secs: u64,
    /// How long graceful shutdown may take before tasks are abandoned, in
    /// seconds. Default 10.
    pub shutdown_deadline_secs: u64,
    /// The shortest heartbeat interval, in milliseconds: what agents beat at
    /// (their own `heartbeat_interval`; keep the two equal) while the fleet
    /// fits `heartbeat_budget_per_sec`. Default 10000.
    pub heartbeat_interval_ms: u64,
    /// Heartbeats per second the whole fleet may cost. While nodes ÷ the
    /// floor interval stays within it, nodes beat at the floor; past it, the
    /// interval and the grace stretch together (in rungs of floor × 1.5ᵏ) and every
    /// node's inventory section declares the new interval; `GET /v1/nodes`
    /// says what detection time that gives. Default 1000 (10,000 nodes at 10 s).
    pub heartbeat_budget_per_sec: f64,
    /// How often the fleet's last heartbeats, kept in memory, are written to
    /// the database, in milliseconds (a node whose state changes is written at
    /// once). The API's `last_seen` lags a heartbeat by at most this (plus
    /// the write itself). Default 5000.
    pub liveness_write_ms: u64,
    /// Heartbeat intervals a node may miss before it is judged unreachable: the
    /// grace is `heartbeat_interval_ms × grace_intervals`. After the controller
    /// starts (or its broker session returns), no node is judged for one grace.
    /// Default 3 (30 s; docs/decisions/0006-liveness-grace.md says why).
    pub grace_intervals: u32,
    /// Largest share of nodes that may be unreachable at once before automatic
    /// re-placement pauses (and an alert says why): past it, the pattern is a
    /// partition or a control-plane problem, not dead machines. Default 0.3.
    pub max_unreachable_share: f64,
    /// The node this controller runs on: where modules with placement
    /// `controller_node` run. Assigned, never elected. Default none (such modules
    /// stay unplaced, with the reason in their view).
    pub controller_node: Option<String>,
    /// How often the sweeper judges liveness and reconciles the fleet, in
    /// milliseconds. Default 2000.
    pub sweep_interval_ms: u64,
    /// How often every context that declares a section recomputes the section
    /// of every node and declares what differs from what it stored (a row
    /// changed or lost behind its back, a change whose trigger was missed), in
    /// seconds. The first runs one interval after start. Costs one read of each
    /// context's nodes and sections; nothing is written when nothing differs.
    /// Default 300 (minimum 1).
    pub resync_interval_secs: u64,
    /// The overlay network every node's WireGuard address comes from (IPv4,
    /// prefix 8 to 30): each node gets the lowest free host address, kept
    /// across restarts, freed when the node is revoked. Changing it gives every
    /// node a new address. Default `10.88.0.0/16`.
    pub overlay_cidr: String,
    /// The UDP port every node's WireGuard interface (`mesh0`) listens on.
    /// Default 51820.
    pub overlay_port: u16,
    /// Who peers with whom: `full` (every node with every other) or
    /// `hub-and-spoke` (nodes labelled `mesh.hub=true` peer with everyone,
    /// the others with the hubs only). Default `full`.
    pub overlay_policy: String,
    /// The mesh's DNS domain: the names file maps `<module>.<domain>` and
    /// `<node>.<domain>`, and certificates carry them. Default `mesh.internal`.
    pub mesh_domain: String,
    /// Lifetime of every certificate the mesh CA signs, in seconds (agents
    /// renew at two thirds of it). Default 86400 (24 h); 300 to 2592000.
    pub certificate_lifetime_secs: u64,
    /// How long the event stream (`GET /v1/events`) keeps an event, in
    /// seconds: a client may resume from a position this recent; an older one
    /// is answered 410. Default 86400 (24 h); at least 1.
    pub event_retention_secs: u64,
    /// Event streams open at once; one more is answered 503. Default 64.
    pub event_streams: usize,
    /// How long a logs request (`GET /v1/modules/{name}/logs`) waits for the
    /// nodes' answers, in milliseconds; also the request's AMQP expiration in
    /// the node's queue. Default 10000; 100 to 25000 (meshctl waits 30 s).
    pub logs_wait_ms: u64,
    /// Logs requests served at once; one more is answered 503. Default 16.
    pub logs_max_requests: usize,
    /// Nodes one logs request asks at most (the others are named in its
    /// `omitted`). Default 64.
    pub logs_max_nodes: usize,
    /// How often health and alerts are evaluated, in milliseconds (also soon
    /// after reports committed, at most five times as often). Default 5000;
    /// at least 100.
    pub evaluate_ms: u64,
    /// How often rollouts are moved on, in milliseconds (also soon after
    /// reports or events committed). Default 1000; at least 50.
    pub rollout_tick_ms: u64,
    /// The OCI registry the controller pushes artifacts to (base URL; plain
    /// `http://` only to loopback). Default `http://127.0.0.1:5000`, the
    /// bundle's.
    pub registry_url: String,
    /// Whether nodes trust artifacts the controller signs itself: when true
    /// the controller signs every artifact pushed through the API with its
    /// own key and declares that key (named `controller`) beside the
    /// operators' signing keys. Default false, and that is the safe choice
    /// (issue 29, point 4; decision 0048): a node then runs only artifacts
    /// signed by a key an admin added (`meshctl signing-key add`), with the
    /// private half held by an operator (`meshctl artifact sign`), so
    /// neither an operator token nor the controller's host alone can make a
    /// node run code. Opting in gives that up for the convenience of
    /// push-and-run.
    pub trust_controller_artifact_signatures: bool,
    /// The registry base URL agents pull artifacts from, when it differs
    /// from `registry_url` (another name for the same registry). Default:
    /// `registry_url`.
    pub registry_pull_url: Option<String>,
    /// Largest artifact `POST /v1/artifacts` takes, in bytes. Default
    /// 268435456 (256 MiB).
    pub artifact_max_bytes: usize,
    /// How long a probe's history of state changes is kept, in seconds.
    /// Default 604800 (7 days).
    pub probe_retention_secs: u64,
    /// How long a resolved alert is kept, in seconds. Default 604800 (7 days).
    pub alert_retention_secs: u64,
    /// How long a revoked resource grant's data (its database, vhost or
    /// bucket) is kept on the provider's server before it is deleted, in
    /// seconds; a requirement asked again within it takes the grant and its
    /// data up again (decision 0039). Default 604800 (7 days); at least 1.
    pub grant_retention_secs: u64,
    /// Restarts of one unit within `crash_window_secs` that raise
    /// `unit_crash_looping`. Default 3; at least 1.
    pub crash_restarts: u32,
    /// Default 600 (10 minutes).
    pub crash_window_secs: u64,
    /// OOM kills of one unit since it was declared (its node counts them)
    /// that raise `unit_oom_killed`. Default 3; at least 1.
    pub oom_kills: u32,
    /// A certificate with less left than this, in seconds, or than a
    /// quarter of its lifetime (agents renew at two thirds; whichever is
    /// shorter), raises `certificate_expiring`. Default 1209600 (14 days).
    pub certificate_alert_secs: u64,
    /// A node behind on a declared generation for longer than this, in
    /// seconds, raises `node_behind`. Default 300.
    pub behind_alert_secs: u64,
    /// How long `controller_unreachable` stays open after a node reported
    /// the broker outage it lived through, in seconds. Default 900.
    pub outage_alert_secs: u64,
    /// Alertmanagers every alert is delivered to (issue 35, decision 0053):
    /// base URLs, `http(s)://<host>:<port>`, each sent `POST /api/v2/alerts`
    /// (https ones verified against the CA bundle of `oidc_ca_file`). Default
    /// none: alerts stay in the API and the dashboard.
    pub alertmanager_urls: Vec<String>,
    /// How often every open alert is sent to Alertmanager again, in seconds
    /// (it resolves one not re-sent within its `resolve_timeout`, 5 minutes
    /// by default). Default 60; 1 to 240.
    pub alertmanager_resend_secs: u64,
    /// How often the controller reads the gauges it serves from the broker
    /// and the database, in seconds: the depth of every queue it consumes and
    /// of the dead-letter queue (one passive declare per queue on its own
    /// connection: `mesh_controller_queue_messages`, and the value other parts
    /// of the controller read, `broker_stats::QueueDepths`), the nodes per
    /// state and the age of each context's oldest unsent outbox row. Default
    /// 10 (minimum 1).
    pub broker_stats_secs: u64,
    /// The host (a name, an IP address, or a socket directory) of a
    /// PostgreSQL streaming replica of the mesh database (`bundle/replica`):
    /// the reads that tolerate lag (`GET /v1/nodes`, `GET /v1/audit`) are
    /// served there while it is usable (docs/decisions/0041). Each context
    /// connects with its own role, password and database, those of its URL in
    /// the credentials file, on this host and `replica_port`: the replica
    /// needs no credential of its own. Writes never go there. Default none
    /// (every read on the primary).
    pub replica_host: Option<String>,
    /// The replica's port. Default 5432.
    pub replica_port: u16,
    /// How often the replica is asked whether it is in recovery and how far
    /// behind the primary it is, in milliseconds (what decides where the
    /// reads go, and the `mesh_controller_replica_*` gauges). Default 1000;
    /// at least 100.
    pub replica_check_ms: u64,
    /// The lag bound, in milliseconds: a replica further behind than this
    /// (or whose lag is unknown, or that is not in recovery, or that does
    /// not answer) serves nothing, and its reads go to the primary. A list
    /// served by the replica is at most this old, plus one `replica_check_ms`.
    /// Default 5000; at least 1.
    pub replica_max_lag_ms: u64,
    /// Longest a read (or a check) may take on the replica, in milliseconds,
    /// connecting included; past it the read runs on the primary and the
    /// replica serves nothing until its next check. Default 2000; at least 100.
    pub replica_timeout_ms: u64,
    /// Other endpoints of the broker (the other nodes of a RabbitMQ cluster),
    /// each `"<host>:<port>"`: when the broker of the credentials' URL does
    /// not answer or a session ends, the controller tries the next one
    /// (round-robin, the URL's own endpoint first, with the usual backoff),
    /// with the URL's user, password, vhost and scheme; a plain `amqp://` URL
    /// reaches loopback endpoints only (docs/decisions/0043). Checked at
    /// start, an invalid entry named by its index. Nodes are told them too,
    /// after the advertised broker, in their inventory section: they must be
    /// addresses nodes reach (docs/decisions/0044). Default: none.
    pub broker_endpoints: Vec<String>,
    /// The type of the queues whose loss would lose something: the hello,
    /// applied and certificates report queues, every node's declaration
    /// queue, the record queues, the dead-letter queue and the unroutable
    /// queue. `"classic"` (default, one broker: every queue classic and
    /// durable) or `"quorum"` (a cluster: those queues quorum, replicated,
    /// surviving a node). With `"quorum"` the superseded-state report queues
    /// (heartbeats, units, health, resources) and the logs answers' queue
    /// stay classic and are declared non-durable, so that they go with
    /// their node instead of failing every session start while it is down;
    /// an upgrade's holding queue stays classic and durable
    /// (docs/protocol.md, docs/decisions/0043). Changing it on a running
    /// mesh needs queues deleted first: the broker refuses a declare with
    /// another durability or type (406), and the controller's session ends
    /// with the broker's message. Only the hello, applied and certificates
    /// report queues are migrated from classic to quorum by the controller
    /// itself (`crate::upgrade`).
    pub queue_type: String,
    /// Keys of the labels a node states about itself (in its hello) that
    /// select it like operator labels do: for placement, file and settings
    /// selectors, connectivity roles (`mesh.hub`) and grants. Default none,
    /// and that is the safe choice: a trusted key is one any node can claim
    /// (an agent restarted with `--label role=db` is then a db node: it gets
    /// db's files, settings, replicas and their secrets). Operator labels
    /// (`meshctl label`, or bound to the join token: `meshctl node add
    /// --label`) override a trusted stated label of the same key. Keys under
    /// `mesh.io/` are reserved and refused (docs/security.md, issue 29).
    pub trusted_stated_labels: Vec<String>,
    /// PEM bundle of the CAs that OIDC issuers' https endpoints are verified
    /// against (`POST /v1/tokens/exchange`, decision 0049): an issuer is
    /// usually a public service, so the system's bundle by default. Nothing
    /// else the controller talks to uses it. Missing: https issuers cannot be
    /// verified (loopback http ones, for tests, still work). Default
    /// `/etc/ssl/certs/ca-certificates.crt`.
    pub oidc_ca_file: PathBuf,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            credentials: PathBuf::from("/etc/mesh/controller-credentials.toml"),
            api_listen: SocketAddr::from(([127, 0, 0, 1], 7700)),
            api_listen_tls: None,
            advertise_api: None,
            advertise_broker: None,
            api_certificate_lifetime_secs: 86_400,
            prefetch: 1000,
            batch_max: 200,
            batch_wait_ms: 20,
            relay_batch: 500,
            relay_poll_ms: 500,
            resend_after_secs: 30,
            pool_size: 4,
            reconnect_max_ms: 10_000,
            connect_timeout_ms: crate::amqp::DEFAULT_CONNECT_TIMEOUT_MS,
            amqp_heartbeat_secs: crate::amqp::DEFAULT_HEARTBEAT_SECS,
            shutdown_deadline_secs: 10,
            heartbeat_interval_ms: 10_000,
            heartbeat_budget_per_sec: 1000.0,
            liveness_write_ms: 5000,
            grace_intervals: 3,
            max_unreachable_share: 0.3,
            controller_node: None,
            sweep_interval_ms: 2000,
            resync_interval_secs: 300,
            overlay_cidr: mesh_connectivity::DEFAULT_CIDR.to_owned(),
            overlay_port: mesh_connectivity::DEFAULT_PORT,
            overlay_policy: "full".to_owned(),
            mesh_domain: mesh_connectivity::DEFAULT_DOMAIN.to_owned(),
            certificate_lifetime_secs: mesh_connectivity::DEFAULT_CERTIFICATE_LIFETIME.as_secs(),
            event_retention_secs: mesh_observability::DEFAULT_RETENTION.as_secs(),
            event_streams: mesh_observability::Settings::default().max_streams,
            logs_wait_ms: 10_000,
            logs_max_requests: 16,
            logs_max_nodes: 64,
            evaluate_ms: 5000,
            rollout_tick_ms: 1000,
            registry_url: "http://127.0.0.1:5000".to_owned(),
            trust_controller_artifact_signatures: false,
            registry_pull_url: None,
            artifact_max_bytes: 256 * 1024 * 1024,
            probe_retention_secs: 7 * 24 * 3600,
            alert_retention_secs: 7 * 24 * 3600,
            grant_retention_secs: mesh_provisioning::DEFAULT_GRANT_RETENTION.as_secs(),
            crash_restarts: 3,
            crash_window_secs: 600,
            oom_kills: 3,
            certificate_alert_secs: 14 * 24 * 3600,
            behind_alert_secs: 300,
            outage_alert_secs: 900,
            alertmanager_urls: Vec::new(),
            alertmanager_resend_secs: 60,
            broker_stats_secs: 10,
            replica_host: None,
            replica_port: 5432,
            replica_check_ms: 1000,
            replica_max_lag_ms: 5000,
            replica_timeout_ms: 2000,
            broker_endpoints: Vec::new(),
            queue_type: "classic".to_owned(),
            trusted_stated_labels: Vec::new(),
            oidc_ca_file: PathBuf::from("/etc/ssl/certs/ca-certificates.crt"),
        }
    }
}

impl Settings {
    /// Read `path` if given (a missing file is an error), then apply environment
    /// overrides `MESH_CONTROLLER_CREDENTIALS` and `MESH_CONTROLLER_API_LISTEN`.
    pub fn load(path: Option<&Path>) -> Result<Settings, ConfigError> {
        let mut settings = match path {
            Some(p) => {
                let text = std::fs::read_to_string(p).map_err(|source| ConfigError::Read {
                    path: p.into(),
                    source,
                })?;
                toml::from_str(&text).map_err(|e| ConfigError::Parse {
                    path: p.into(),
                    message: e.to_string(),
                })?
            }
            None => Settings::default(),
        };
        if let Ok(v) = std::env::var("MESH_CONTROLLER_CREDENTIALS") {
            settings.credentials = PathBuf::from(v);
        }
        if let Ok(v) = std::env::var("MESH_CONTROLLER_API_LISTEN") {
            settings.api_listen = v.parse().map_err(|e| ConfigError::Env {
                name: "MESH_CONTROLLER_API_LISTEN".into(),
                message: format!("`{v}` is not a socket address: {e}"),
            })?;
        }
        settings.validate()?;
        Ok(settings)
    }

    /// Check what the types do not.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !self.api_listen.ip().is_loopback() {
            return Err(ConfigError::Invalid {
                field: "api_listen",
                message: format!(
                    "{} is not a loopback address: the plain-HTTP API is for this host only (tokens would cross the network in cleartext); other machines use the HTTPS listener, api_listen_tls",
                    self.api_listen
                ),
            });
        }
        if let Some(api) = &self.advertise_api {
            mesh_credentials::advertise::check_api_url(api).map_err(|message| {
                ConfigError::Invalid {
                    field: "advertise_api",
                    message,
                }
            })?;
        }
        if let Some(broker) = &self.advertise_broker {
            mesh_protocol::parse_host_port(broker).map_err(|message| ConfigError::Invalid {
                field: "advertise_broker",
                message,
            })?;
        }
        for (i, key) in self.trusted_stated_labels.iter().enumerate() {
            let mut probe = mesh_protocol::Labels::new();
            probe.insert(key.clone(), String::new());
            if let Err(e) = mesh_protocol::validate_labels("trusted_stated_labels", &probe) {
                return Err(ConfigError::Invalid {
                    field: "trusted_stated_labels",
                    message: format!("entry {}: {e}", i + 1),
                });
            }
            if key.starts_with(mesh_protocol::RESERVED_LABEL_PREFIX) {
                return Err(ConfigError::Invalid {
                    field: "trusted_stated_labels",
                    message: format!(
                        "entry {} (`{key}`): keys under `{}` are reserved",
                        i + 1,
                        mesh_protocol::RESERVED_LABEL_PREFIX
                    ),
                });
            }
        }
        if self.connect_timeout_ms < 100 {
            return Err(ConfigError::Invalid {
                field: "connect_timeout_ms",
                message: "must be at least 100".into(),
            });
        }
        if !(1..=65_535).contains(&self.amqp_heartbeat_secs) {
            return Err(ConfigError::Invalid {
                field: "amqp_heartbeat_secs",
                message: "must be 1 to 65535".into(),
            });
        }
        if !(60..=365 * 86_400).contains(&self.api_certificate_lifetime_secs) {
            return Err(ConfigError::Invalid {
                field: "api_certificate_lifetime_secs",
                message: "must be between 60 and 31536000 seconds".into(),
            });
        }
        if !(0.0..=1.0).contains(&self.max_unreachable_share) {
            return Err(ConfigError::Invalid {
                field: "max_unreachable_share",
                message: "must be between 0 and 1".into(),
            });
        }
        if let Some(node) = &self.controller_node {
            mesh_protocol::NodeId::parse(node).map_err(|e| ConfigError::Invalid {
                field: "controller_node",
                message: e.to_string(),
            })?;
        }
        if !(self.heartbeat_budget_per_sec.is_finite() && self.heartbeat_budget_per_sec > 0.0) {
            return Err(ConfigError::Invalid {
                field: "heartbeat_budget_per_sec",
                message: "must be a positive number of heartbeats per second".into(),
            });
        }
        if self.liveness_write_ms == 0 {
            return Err(ConfigError::Invalid {
                field: "liveness_write_ms",
                message: "must be at least 1".into(),
            });
        }
        self.connectivity_plan()?;
        if self.event_retention_secs == 0 {
            return Err(ConfigError::Invalid {
                field: "event_retention_secs",
                message: "must be at least 1".into(),
            });
        }
        if self.broker_stats_secs == 0 {
            return Err(ConfigError::Invalid {
                field: "broker_stats_secs",
                message: "must be at least 1".into(),
            });
        }
        if !(100..=25_000).contains(&self.logs_wait_ms) {
            return Err(ConfigError::Invalid {
                field: "logs_wait_ms",
                message: "must be 100 to 25000".into(),
            });
        }
        if self.logs_max_requests == 0 || self.logs_max_nodes == 0 {
            return Err(ConfigError::Invalid {
                field: if self.logs_max_requests == 0 {
                    "logs_max_requests"
                } else {
                    "logs_max_nodes"
                },
                message: "must be at least 1".into(),
            });
        }
        if self.event_streams == 0 {
            return Err(ConfigError::Invalid {
                field: "event_streams",
                message: "must be at least 1".into(),
            });
        }
        if self.rollout_tick_ms < 50 {
            return Err(ConfigError::Invalid {
                field: "rollout_tick_ms",
                message: "must be at least 50".into(),
            });
        }
        if self.artifact_max_bytes == 0 {
            return Err(ConfigError::Invalid {
                field: "artifact_max_bytes",
                message: "must be at least 1".into(),
            });
        }
        if self.evaluate_ms < 100 {
            return Err(ConfigError::Invalid {
                field: "evaluate_ms",
                message: "must be at least 100".into(),
            });
        }
        for (field, value) in [
            ("probe_retention_secs", self.probe_retention_secs),
            ("alert_retention_secs", self.alert_retention_secs),
            ("grant_retention_secs", self.grant_retention_secs),
            ("crash_restarts", u64::from(self.crash_restarts)),
            ("crash_window_secs", self.crash_window_secs),
            ("oom_kills", u64::from(self.oom_kills)),
            ("outage_alert_secs", self.outage_alert_secs),
        ] {
            if value == 0 {
                return Err(ConfigError::Invalid {
                    field,
                    message: "must be at least 1".into(),
                });
            }
        }
        if !(1..=240).contains(&self.alertmanager_resend_secs) {
            return Err(ConfigError::Invalid {
                field: "alertmanager_resend_secs",
                message: "must be 1 to 240 (under Alertmanager's default resolve_timeout)".into(),
            });
        }
        for (i, url) in self.alertmanager_urls.iter().enumerate() {
            let scheme_ok = url.starts_with("http://") || url.starts_with("https://");
            if !scheme_ok || url.len() > 2048 || url.chars().any(char::is_whitespace) {
                return Err(ConfigError::Invalid {
                    field: "alertmanager_urls",
                    message: format!("entry {i}: must be an http:// or https:// URL"),
                });
            }
        }
        if !(300..=2_592_000).contains(&self.certificate_lifetime_secs) {
            return Err(ConfigError::Invalid {
                field: "certificate_lifetime_secs",
                message: "must be 300 (5 minutes) to 2592000 (30 days)".into(),
            });
        }
        self.validate_replica()?;
        self.broker_endpoint_list()?;
        self.queue_type()?;
        if self.heartbeat_interval_ms == 0 || self.grace_intervals == 0 {
            return Err(ConfigError::Invalid {
                field: "grace_intervals",
                message: "heartbeat_interval_ms and grace_intervals must be at least 1".into(),
            });
        }
        Ok(())
    }

    /// `broker_endpoints` as `(host, port)`, in order; an invalid entry is
    /// named by its index.
    pub fn broker_endpoint_list(&self) -> Result<Vec<(String, u16)>, ConfigError> {
        self.broker_endpoints
            .iter()
            .enumerate()
            .map(|(i, e)| {
                mesh_protocol::parse_host_port(e).map_err(|m| ConfigError::Invalid {
                    field: "broker_endpoints",
                    message: format!("entry {i}: {m}"),
                })
            })
            .collect()
    }

    /// `queue_type`, checked.
    pub fn queue_type(&self) -> Result<crate::amqp::QueueType, ConfigError> {
        match self.queue_type.as_str() {
            "classic" => Ok(crate::amqp::QueueType::Classic),
            "quorum" => Ok(crate::amqp::QueueType::Quorum),
            other => Err(ConfigError::Invalid {
                field: "queue_type",
                message: format!("`{other}` is neither \"classic\" nor \"quorum\""),
            }),
        }
    }

    /// The read replica's settings (decision 0041).
    fn validate_replica(&self) -> Result<(), ConfigError> {
        if let Some(host) = &self.replica_host
            && (host.is_empty() || host.contains(|c: char| c.is_whitespace() || c == '@'))
        {
            return Err(ConfigError::Invalid {
                field: "replica_host",
                message: "must be a host name, an IP address or a socket directory (no credentials: each context's role and password come from its database URL)".into(),
            });
        }
        if self.replica_port == 0 {
            return Err(ConfigError::Invalid {
                field: "replica_port",
                message: "must be 1 to 65535".into(),
            });
        }
        for (field, value, least) in [
            ("replica_check_ms", self.replica_check_ms, 100),
            ("replica_max_lag_ms", self.replica_max_lag_ms, 1),
            ("replica_timeout_ms", self.replica_timeout_ms, 100),
        ] {
            if value < least {
                return Err(ConfigError::Invalid {
                    field,
                    message: format!("must be at least {least}"),
                });
            }
        }
        Ok(())
    }

    /// The overlay settings of the connectivity context, checked.
    pub fn connectivity_plan(&self) -> Result<mesh_connectivity::PlanSettings, ConfigError> {
        let invalid = |field: &'static str| {
            move |e: mesh_connectivity::Error| ConfigError::Invalid {
                field,
                message: match e {
                    mesh_connectivity::Error::Invalid { reason, .. } => reason,
                    other => other.to_string(),
                },
            }
        };
        let cidr = mesh_connectivity::Cidr::parse("overlay_cidr", &self.overlay_cidr)
            .map_err(invalid("overlay_cidr"))?;
        let policy = mesh_connectivity::Policy::parse("overlay_policy", &self.overlay_policy)
            .map_err(invalid("overlay_policy"))?;
        if self.overlay_port == 0 {
            return Err(ConfigError::Invalid {
                field: "overlay_port",
                message: "must be 1 to 65535".into(),
            });
        }
        mesh_protocol::validate_dns_name("mesh_domain", &self.mesh_domain).map_err(|e| {
            ConfigError::Invalid {
                field: "mesh_domain",
                message: e.to_string(),
            }
        })?;
        Ok(mesh_connectivity::PlanSettings {
            cidr,
            listen_port: self.overlay_port,
            policy,
            domain: self.mesh_domain.clone(),
        })
    }

    pub fn batch_wait(&self) -> Duration {
        Duration::from_millis(self.batch_wait_ms)
    }

    pub fn relay_poll(&self) -> Duration {
        Duration::from_millis(self.relay_poll_ms)
    }

    /// `connect_timeout_ms` as a duration.
    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }

    /// How long a node may stay silent before it is judged unreachable.
    pub fn grace(&self) -> Duration {
        Duration::from_millis(self.heartbeat_interval_ms)
            .saturating_mul(self.grace_intervals.max(1))
    }

    pub fn liveness_write(&self) -> Duration {
        Duration::from_millis(self.liveness_write_ms.max(1))
    }

    pub fn sweep_interval(&self) -> Duration {
        Duration::from_millis(self.sweep_interval_ms.max(100))
    }

    pub fn resync_interval(&self) -> Duration {
        Duration::from_secs(self.resync_interval_secs.max(1))
    }

    pub fn broker_stats_interval(&self) -> Duration {
        Duration::from_secs(self.broker_stats_secs.max(1))
    }
}

/// The controller's credentials file, `controller-credentials.toml`, as the
/// controller uses it. The file itself — fields, format, checks, errors naming
/// the file and the field, secrets that never print — is defined once in
/// [`ControllerCredentials`], which `mesh-bundle up` and the test kit write it
/// with; its fields are read through `Deref`. This adds what the controller
/// requires of it to run: a database URL per context it runs, a signing key and
/// a management account.
#[derive(Debug, Clone)]
pub struct Credentials(ControllerCredentials);

impl std::ops::Deref for Credentials {
    type Target = ControllerCredentials;

    fn deref(&self) -> &ControllerCredentials {
        &self.0
    }
}

impl Credentials {
    pub fn load(path: &Path) -> Result<Credentials, ConfigError> {
        Ok(Credentials(ControllerCredentials::load(path)?))
    }

    /// The declaration-signing key, read from the file named in `signing_key_file`.
    pub fn signer(&self) -> Result<mesh_protocol::DeclarationSigner, ConfigError> {
        let path = self
            .signing_key_file
            .as_ref()
            .ok_or_else(|| ConfigError::Parse {
                path: self.path().to_owned(),
                message: "signing_key_file is missing (run bundle/up again)".into(),
            })?;
        Ok(mesh_credentials::key::read_signing_key(path)?)
    }

    /// The mesh CA, from `ca_certificate_file` and `ca_key_file`: what the
    /// API's HTTPS certificate is issued from, what nodes are handed at their
    /// join, and what the connectivity context signs certificates with. `None`
    /// when the credentials name none (an older file: no HTTPS, certificate
    /// requests wait). The key is read here, into the controller's memory, and
    /// nowhere else.
    pub fn mesh_ca(
        &self,
    ) -> Result<Option<std::sync::Arc<mesh_credentials::pki::MeshCa>>, ConfigError> {
        match (&self.ca_certificate_file, &self.ca_key_file) {
            (Some(cert), Some(key)) => mesh_credentials::pki::MeshCa::load(cert, key)
                .map(|ca| Some(std::sync::Arc::new(ca)))
                .map_err(|e| ConfigError::Parse {
                    path: self.path().to_owned(),
                    message: format!("the mesh CA (ca_certificate_file, ca_key_file): {e}"),
                }),
            _ => Ok(None),
        }
    }

    /// The management API account, required to enrol and revoke nodes.
    pub fn broker_management(&self) -> Result<&BrokerManagement, ConfigError> {
        self.0
            .broker_management
            .as_ref()
            .ok_or_else(|| ConfigError::Parse {
                path: self.path().to_owned(),
                message: "broker_management is missing (run bundle/up again)".into(),
            })
    }

    /// The database URL the controller fence (docs/decisions/0017) is taken on:
    /// the inventory role's, on the mesh database. Advisory locks belong to a
    /// database, not to a role, and every context's schema is in that one
    /// database; the fence writes nothing, so the role needs no rights beyond
    /// connecting (and seeing its own sessions, to name the holder).
    pub fn fence_database(&self) -> Result<&Secret<String>, ConfigError> {
        self.database("inventory")
    }

    /// The database URL of `context`, connecting as that context's own role.
    pub fn database(&self, context: &str) -> Result<&Secret<String>, ConfigError> {
        self.databases
            .get(context)
            .ok_or_else(|| ConfigError::MissingContext {
                path: self.path().to_owned(),
                context: context.to_owned(),
            })
    }
}

/// Where the controller is reached from other machines, after the settings
/// (first) and the credentials file (bundle/up's defaults) were consulted.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Advertised {
    /// `https://<address>:<port>`.
    pub api: Option<String>,
    /// `<address>:<port>` of the broker's AMQPS listener.
    pub broker: Option<String>,
}

impl Advertised {
    /// Where Prometheus scrapes the controller's own `/metrics` (issue 35):
    /// the advertised HTTPS API when there is one (`tls`: a mesh CA, so the
    /// HTTPS listener runs), else the plain-HTTP listener on loopback.
    pub fn metrics_target(
        &self,
        settings: &Settings,
        tls: bool,
    ) -> mesh_inventory::ControllerTarget {
        match self.api.as_deref().and_then(|u| u.strip_prefix("https://")) {
            Some(rest) if tls => mesh_inventory::ControllerTarget {
                address: rest.split('/').next().unwrap_or(rest).to_owned(),
                scheme: "https".to_owned(),
            },
            _ => mesh_inventory::ControllerTarget {
                address: settings.api_listen.to_string(),
                scheme: "http".to_owned(),
            },
        }
    }

    pub fn of(settings: &Settings, creds: &ControllerCredentials) -> Advertised {
        Advertised {
            api: settings
                .advertise_api
                .clone()
                .or_else(|| creds.advertise_api.clone()),
            broker: settings
                .advertise_broker
                .clone()
                .or_else(|| creds.advertise_broker.clone()),
        }
    }

    /// The HTTPS listener's address: `api_listen_tls`, else `0.0.0.0` on the
    /// advertised API's port, else none.
    pub fn tls_listen(&self, settings: &Settings) -> Option<SocketAddr> {
        settings.api_listen_tls.or_else(|| {
            let url = url::Url::parse(self.api.as_deref()?).ok()?;
            Some(SocketAddr::from((
                [0, 0, 0, 0],
                url.port_or_known_default()?,
            )))
        })
    }

    /// The mesh's endpoints every node's inventory section carries (decision
    /// 0044): the broker endpoint a joining node is handed (the advertised
    /// one when the credentials name a mesh CA, else the controller's own,
    /// `broker_url`'s), then each of `broker_endpoints`, without repeats; the
    /// advertised API (with a CA: without one the API is loopback-only). None
    /// when there is nothing to tell.
    pub fn endpoints(
        &self,
        settings: &Settings,
        broker_url: &str,
        tls: bool,
    ) -> Option<mesh_protocol::Endpoints> {
        let own = crate::amqp::url_host_port(broker_url)
            .map(|(h, p)| mesh_protocol::format_host_port(&h, p));
        let first = if tls { self.broker.clone() } else { None }.or(own);
        let mut brokers: Vec<String> = Vec::new();
        let rest = settings
            .broker_endpoint_list()
            .unwrap_or_default()
            .into_iter()
            .map(|(h, p)| mesh_protocol::format_host_port(&h, p));
        for e in first.into_iter().chain(rest) {
            // Written the one way, so that a repeat is seen.
            let Ok((h, p)) = mesh_protocol::parse_host_port(&e) else {
                continue;
            };
            let e = mesh_protocol::format_host_port(&h, p);
            if !brokers.contains(&e) {
                brokers.push(e);
            }
        }
        brokers.truncate(mesh_protocol::MAX_ENDPOINTS);
        let api: Vec<String> = if tls { self.api.clone() } else { None }
            .map(|a| a.trim_end_matches('/').to_owned())
            .filter(|a| mesh_protocol::check_api_endpoint(a).is_ok())
            .into_iter()
            .collect();
        (!brokers.is_empty() || !api.is_empty())
            .then_some(mesh_protocol::Endpoints { brokers, api })
    }

    /// The API's host (a name or an IP address): a name in its certificate.
    pub fn api_host(&self) -> Option<String> {
        let url = url::Url::parse(self.api.as_deref()?).ok()?;
        url.host_str()
            .map(|h| h.trim_start_matches('[').trim_end_matches(']').to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_api_only_on_loopback_and_advertised_endpoints_checked() {
        let s = |text: &str| toml::from_str::<Settings>(text).unwrap().validate();
        assert!(s("api_listen = \"127.0.0.1:7700\"").is_ok());
        let err = s("api_listen = \"0.0.0.0:7700\"").unwrap_err().to_string();
        assert!(
            err.contains("api_listen") && err.contains("loopback"),
            "{err}"
        );
        let err = s("advertise_api = \"http://192.0.2.2:7700\"")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("advertise_api") && err.contains("https"),
            "{err}"
        );
        let err = s("advertise_broker = \"192.0.2.2\"")
            .unwrap_err()
            .to_string();
        assert!(err.contains("advertise_broker"), "{err}");

        let settings: Settings = toml::from_str("advertise_broker = \"10.0.0.1:5671\"").unwrap();
        let mut creds = ControllerCredentials::new(
            Secret::new("amqp://c:pw@127.0.0.1:5672/mesh".into()),
            Default::default(),
        );
        creds.advertise_api = Some("https://192.0.2.2:7443".into());
        creds.advertise_broker = Some("192.0.2.2:5671".into());
        let a = Advertised::of(&settings, &creds);
        assert_eq!(a.api.as_deref(), Some("https://192.0.2.2:7443"));
        assert_eq!(a.broker.as_deref(), Some("10.0.0.1:5671"), "settings first");
        assert_eq!(
            a.tls_listen(&settings),
            Some("0.0.0.0:7443".parse().unwrap())
        );
        assert_eq!(a.api_host().as_deref(), Some("192.0.2.2"));
    }

    #[test]
    fn replica_settings_are_checked_and_named() {
        let defaults = Settings::default();
        assert_eq!(defaults.replica_host, None);
        assert_eq!(defaults.replica_port, 5432);
        assert_eq!(defaults.replica_check_ms, 1000);
        assert_eq!(defaults.replica_max_lag_ms, 5000);
        toml::from_str::<Settings>("replica_host = \"127.0.0.1\"\nreplica_port = 5433")
            .unwrap()
            .validate()
            .unwrap();
        for (text, field) in [
            ("replica_host = \"\"", "replica_host"),
            ("replica_host = \"u:pw@db\"", "replica_host"),
            ("replica_port = 0", "replica_port"),
            ("replica_check_ms = 10", "replica_check_ms"),
            ("replica_max_lag_ms = 0", "replica_max_lag_ms"),
            ("replica_timeout_ms = 0", "replica_timeout_ms"),
            ("connect_timeout_ms = 99", "connect_timeout_ms"),
            ("amqp_heartbeat_secs = 0", "amqp_heartbeat_secs"),
            ("amqp_heartbeat_secs = 65536", "amqp_heartbeat_secs"),
        ] {
            let settings: Settings = toml::from_str(text).unwrap();
            match settings.validate() {
                Err(ConfigError::Invalid { field: f, .. }) => assert_eq!(f, field, "{text}"),
                other => panic!("{text}: {other:?}"),
            }
        }
    }

    #[test]
    fn grant_retention_defaults_to_a_week_and_is_checked() {
        assert_eq!(Settings::default().grant_retention_secs, 604_800);
        let settings: Settings = toml::from_str("grant_retention_secs = 0").unwrap();
        match settings.validate() {
            Err(ConfigError::Invalid { field, .. }) => assert_eq!(field, "grant_retention_secs"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn broker_endpoints_and_queue_type_are_checked_and_named() {
        let mut s = Settings {
            broker_endpoints: vec!["127.0.0.1:5673".into(), "[::1]:5674".into()],
            queue_type: "quorum".into(),
            ..Settings::default()
        };
        s.validate().unwrap();
        assert_eq!(
            s.broker_endpoint_list().unwrap(),
            vec![("127.0.0.1".to_owned(), 5673), ("::1".to_owned(), 5674)]
        );
        assert_eq!(s.queue_type().unwrap(), crate::amqp::QueueType::Quorum);
        assert_eq!(
            Settings::default().queue_type().unwrap(),
            crate::amqp::QueueType::Classic
        );
        s.broker_endpoints.push("amqp://h:1".into());
        let err = s.validate().unwrap_err().to_string();
        assert!(
            err.contains("broker_endpoints") && err.contains("entry 2"),
            "{err}"
        );
        s.broker_endpoints.pop();
        s.broker_endpoints.push("h:0".into());
        let err = s.validate().unwrap_err().to_string();
        assert!(err.contains("entry 2") && err.contains("port"), "{err}");
        s.broker_endpoints.pop();
        s.queue_type = "stream".into();
        let err = s.validate().unwrap_err().to_string();
        assert!(
            err.contains("queue_type") && err.contains("stream"),
            "{err}"
        );
    }

    #[test]
    fn endpoints_told_to_nodes() {
        let settings = Settings {
            broker_endpoints: vec![
                "10.0.0.2:5671".into(),
                "10.0.0.1:5671".into(),
                "[2001:db8::3]:5671".into(),
            ],
            ..Settings::default()
        };
        let advertised = Advertised {
            api: Some("https://10.0.0.1:7443/".into()),
            broker: Some("10.0.0.1:5671".into()),
        };
        let url = "amqp://mesh_controller:pw@127.0.0.1:5672/mesh";
        // With a CA: the advertised broker first, no repeat, the API.
        let e = advertised.endpoints(&settings, url, true).unwrap();
        assert_eq!(
            e.brokers,
            vec!["10.0.0.1:5671", "10.0.0.2:5671", "[2001:db8::3]:5671"]
        );
        assert_eq!(e.api, vec!["https://10.0.0.1:7443"]);
        e.validate("endpoints").unwrap();
        // Without: the controller's own broker, no API.
        let e = advertised.endpoints(&settings, url, false).unwrap();
        assert_eq!(e.brokers[0], "127.0.0.1:5672");
        assert!(e.api.is_empty());
        assert!(!e.to_owned().brokers.iter().any(|b| b.contains("pw")));
        // Nothing to tell: none.
        assert_eq!(
            Advertised::default().endpoints(&Settings::default(), "not a url", false),
            None
        );
    }

    #[test]
    fn unknown_setting_is_named() {
        let err = toml::from_str::<Settings>("prefetch = 10\nbogus = 1\n").unwrap_err();
        assert!(err.to_string().contains("bogus"), "{err}");
    }

    #[test]
    fn connectivity_settings_are_checked_and_named() {
        let plan = Settings::default().connectivity_plan().unwrap();
        assert_eq!(plan.cidr.to_string(), "10.88.0.0/16");
        assert_eq!(plan.listen_port, 51820);
        assert_eq!(plan.domain, "mesh.internal");
        for (text, field) in [
            ("overlay_cidr = \"10.88.0.1/16\"", "overlay_cidr"),
            ("overlay_cidr = \"fd00::/64\"", "overlay_cidr"),
            ("overlay_policy = \"star\"", "overlay_policy"),
            ("overlay_port = 0", "overlay_port"),
            ("mesh_domain = \"Not A Domain\"", "mesh_domain"),
            (
                "certificate_lifetime_secs = 10",
                "certificate_lifetime_secs",
            ),
        ] {
            let settings: Settings = toml::from_str(text).unwrap();
            match settings.validate() {
                Err(ConfigError::Invalid { field: f, .. }) => assert_eq!(f, field, "{text}"),
                other => panic!("{text}: {other:?}"),
            }
        }
        let settings: Settings =
            toml::from_str("overlay_policy = \"hub-and-spoke\"\noverlay_cidr = \"10.9.0.0/24\"")
                .unwrap();
        settings.validate().unwrap();
    }

    #[test]
    fn credentials_never_print_and_name_what_is_missing() {
        let dir = std::env::temp_dir().join(format!("mesh-config-test-{}", std::process::id()));
        let path = dir.join("controller-credentials.toml");
        mesh_credentials::write_secret_file(
            &path,
            "broker_url = \"amqp://c:hunter2@h/mesh\"\n[databases]\ninventory = \"postgres://i:hunter2@h/m\"\n",
        )
        .unwrap();
        let c = Credentials::load(&path);
        let _ = std::fs::remove_dir_all(&dir);
        let c = c.unwrap();
        assert!(!format!("{c:?}").contains("hunter2"));
        assert_eq!(
            c.database("inventory").unwrap().expose(),
            "postgres://i:hunter2@h/m"
        );
        let err = c.database("config").unwrap_err().to_string();
        assert!(
            err.contains("databases.config") && err.contains("controller-credentials.toml"),
            "{err}"
        );
        let err = c.signer().unwrap_err().to_string();
        assert!(err.contains("signing_key_file"), "{err}");
        let err = c.broker_management().unwrap_err().to_string();
        assert!(err.contains("broker_management"), "{err}");
    }
}
