//! The agent's configuration: a TOML file (every field optional, defaults below)
//! with command-line flags layered on top.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use mesh_protocol::{Labels, validate_labels};
use serde::Deserialize;

use crate::duration::de_duration;
pub use crate::duration::{DurationError, parse_duration};

/// Why the configuration could not be loaded. Every variant names the file and,
/// where there is one, the field.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {error}")]
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("invalid config field `{field}`: {reason}")]
    Invalid { field: String, reason: String },
}

impl ConfigError {
    fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        ConfigError::Invalid {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

/// The agent's configuration. Every field has a default; a config file may set any
/// subset. Unknown fields are refused, so a typo is an error rather than a silently
/// ignored setting.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Directory of the agent's own state: `credentials.toml` (written at enrolment)
    /// and `store.json` (what has been applied, the report sequence counter, and
    /// unconfirmed `applied` reports). Default `/var/lib/mesh-agent`.
    pub state_dir: PathBuf,
    /// The directory declared file paths are applied under: a declared `/etc/x`
    /// lands at `<root>/etc/x`. Nothing is ever written outside it. Default `/`;
    /// tests point it at a temporary directory.
    pub root: PathBuf,
    /// Labels this node gives itself, sent in every hello. Operator labels set on
    /// the controller override them. Keys 1..=63 of `[a-z0-9._/-]`, values at most
    /// 255 characters, at most 64 labels. Default: none.
    pub labels: Labels,
    /// How often a heartbeat is published (the first one is jittered uniformly
    /// within one interval so a fleet restarted together does not beat in step).
    /// Seconds, or a string such as `"10s"` / `"500ms"`. Default 10 s.
    #[serde(deserialize_with = "de_duration")]
    pub heartbeat_interval: Duration,
    /// The AMQP heartbeat the agent asks the broker for: how long a silent
    /// connection lives before either side gives it up (a `heartbeat` in the
    /// broker URL wins). Heartbeat reports flow every `heartbeat_interval`, so
    /// these frames are only sent on a connection with nothing else to say;
    /// each one costs the broker on every idle connection of the fleet
    /// (docs/benchmarks.md, real connections). Seconds or a string such as
    /// `"60s"`; whole seconds, 1 to 65535. Default 60 s.
    #[serde(deserialize_with = "de_duration")]
    pub amqp_heartbeat: Duration,
    /// How long one attempt to reach a broker endpoint may take, all of it:
    /// the TCP connect, the TLS handshake and the AMQP handshake; also the
    /// longest wait for the broker to open a channel in a new session. An
    /// endpoint that has not answered by then is given up and the next one
    /// tried (a dead broker behind a load balancer accepts the connection and
    /// never answers). Seconds or a string such as `"10s"`; at least 100 ms.
    /// Default 10 s. How long a node can be cut off in all is bounded in
    /// docs/protocol.md ("Reaching the broker").
    #[serde(deserialize_with = "de_duration")]
    pub connect_timeout: Duration,
    /// Most reports kept while they cannot be published (disconnected, or not yet
    /// confirmed by the broker): hellos, units, health, resources and `applied`
    /// reports (heartbeats are never kept: a missed one is skipped, the next
    /// follows; a newer units, health or resources report replaces a waiting
    /// one). When full, the oldest units report, then health report, then
    /// resources report, then hello is dropped first (each is a whole state,
    /// and one is sent on every connect);
    /// `applied` reports are dropped only if nothing else is left, and the next
    /// heartbeat still carries the applied generations. Default 10000.
    pub report_buffer: usize,
    /// Smallest delay before reconnecting to the broker (and before retrying a
    /// refused publish or a missing declaration queue). Default 0.5 s.
    #[serde(deserialize_with = "de_duration")]
    pub reconnect_min: Duration,
    /// Largest such delay. The delay doubles per failure up to this cap and each
    /// actual wait is drawn uniformly from 0..=delay ("full jitter"), so a fleet
    /// that lost its broker together does not return together. Default 30 s.
    #[serde(deserialize_with = "de_duration")]
    pub reconnect_max: Duration,
    /// Address to serve Prometheus metrics on (`GET /metrics`), e.g.
    /// `"127.0.0.1:9464"`. Default: none, metrics are not served.
    pub metrics_listen: Option<SocketAddr>,
    /// Hostname reported in hello instead of the kernel's. Default: none (read
    /// `/proc/sys/kernel/hostname`). Meant for tests that run several agents on one
    /// machine.
    pub hostname: Option<String>,
    /// How long graceful shutdown may spend publishing buffered reports before the
    /// agent exits anyway. Default 5 s.
    #[serde(deserialize_with = "de_duration")]
    pub shutdown_timeout: Duration,
    /// Declarations handed to the agent at once by the broker (AMQP prefetch). The
    /// agent applies one at a time; a small window only hides round trips.
    /// Default 4.
    pub prefetch: u16,
    /// Seconds between two periodic `health` reports (`summary: true`: every
    /// probe's result, whole), sent besides the report that follows every
    /// change of a probe's state. No health report at all while no unit has
    /// probes. Whole seconds, 1 to 86400. Default 60.
    pub health_summary_secs: u64,
    /// The unit supervisor: the `[units]` table (stop timeout, restart backoff,
    /// log rotation). Defaults in [`crate::units::UnitsConfig`].
    pub units: crate::units::UnitsConfig,
    /// The WireGuard overlay: the `[overlay]` table (the endpoint stated in
    /// hello, the tools). Defaults in [`OverlayConfig`].
    pub overlay: OverlayConfig,
    /// The packet filter: the `[firewall]` table. Defaults in [`FirewallConfig`].
    pub firewall: FirewallConfig,
    /// The artifact cache: the `[artifacts]` table (largest artifact, fetch
    /// timeout). Defaults in [`crate::artifacts::ArtifactsConfig`].
    pub artifacts: crate::artifacts::ArtifactsConfig,
    /// The resources of resource grants this node's provider modules serve:
    /// the `[provisioning]` table. Defaults in [`ProvisioningConfig`].
    pub provisioning: ProvisioningConfig,
    /// Other endpoints of the same broker (the nodes of a RabbitMQ cluster),
    /// each `"<host>:<port>"`: when the broker of the credentials' URL does
    /// not answer, or a session is lost, the agent tries the next one
    /// (round-robin, the URL's own endpoint first, each attempt after the
    /// usual backoff), with the URL's user, password, vhost and scheme: an
    /// `amqps://` URL verifies each endpoint's certificate against the mesh CA
    /// and the endpoint's host; a plain `amqp://` URL reaches loopback
    /// endpoints only (docs/decisions/0043). After them come the mesh's
    /// broker endpoints the controller declared and the store keeps, each
    /// endpoint tried once per round (docs/decisions/0044). Default: none
    /// (the URL's only, then the kept ones).
    pub brokers: Vec<String>,
}

/// The `[provisioning]` table: how the agent reconciles the resources its
/// provisioning section declares (decision 0039).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ProvisioningConfig {
    /// How often every declared resource is reconciled again (besides at
    /// start, and after each provisioning or config section applied): a
    /// resource found missing is created again, a server that came back is
    /// set up. Each pass runs the servers' CLIs once per resource. Seconds or
    /// a string such as `"30s"`; 1 s to 1 day. Default 30 s.
    #[serde(deserialize_with = "de_duration")]
    pub interval: Duration,
}

impl Default for ProvisioningConfig {
    fn default() -> Self {
        ProvisioningConfig {
            interval: Duration::from_secs(30),
        }
    }
}

impl ProvisioningConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if !(Duration::from_secs(1)..=Duration::from_secs(86_400)).contains(&self.interval) {
            return Err(ConfigError::invalid(
                "provisioning.interval",
                "must be 1s to 1 day",
            ));
        }
        Ok(())
    }
}

/// The `[overlay]` table: how the node takes part in the WireGuard overlay
/// the connectivity section declares.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OverlayConfig {
    /// Take part: make the node's WireGuard key (`<state_dir>/wireguard.key`),
    /// state its public key in hello, apply the declared interface. Off: no
    /// key, no overlay facts, a declared interface reported not applied.
    /// Default true.
    pub enabled: bool,
    /// Where peers reach this node, stated in hello: `"ip:port"`, or `"ip"`
    /// (the port is then `listen_port`). Default: none (the node is reached
    /// only by peers it contacts first).
    pub endpoint: Option<String>,
    /// The port stated with an endpoint given as a bare address; the
    /// controller is expected to declare it as the interface's listen port.
    /// Default 51820.
    pub listen_port: u16,
    /// Use the kernel's WireGuard when `ip link add … type wireguard` works;
    /// false: always wireguard-go. Default true.
    pub kernel: bool,
    /// The userspace implementation (a path, or a name looked up in `PATH`).
    /// Default `wireguard-go`.
    pub wireguard_go: PathBuf,
    /// wireguard-tools' `wg`. Default `wg`.
    pub wg: PathBuf,
    /// iproute2's `ip`. Default `ip`.
    pub ip: PathBuf,
    /// How often the applied interface and ruleset are checked and repaired
    /// (a wireguard-go that died is started again). Default 30 s.
    #[serde(deserialize_with = "de_duration")]
    pub check_interval: Duration,
}

impl Default for OverlayConfig {
    fn default() -> Self {
        OverlayConfig {
            enabled: true,
            endpoint: None,
            listen_port: 51820,
            kernel: true,
            wireguard_go: PathBuf::from("wireguard-go"),
            wg: PathBuf::from("wg"),
            ip: PathBuf::from("ip"),
            check_interval: Duration::from_secs(30),
        }
    }
}

impl OverlayConfig {
    /// The endpoint hello states (`ip:port`), from `endpoint` and `listen_port`.
    pub fn stated_endpoint(&self) -> Option<String> {
        let e = self.endpoint.as_deref()?;
        if e.parse::<SocketAddr>().is_ok() {
            return Some(e.to_owned());
        }
        let ip: std::net::IpAddr = e.parse().ok()?;
        Some(SocketAddr::new(ip, self.listen_port).to_string())
    }

    fn validate(&self) -> Result<(), ConfigError> {
        if let Some(e) = &self.endpoint
            && self.stated_endpoint().is_none()
        {
            return Err(ConfigError::invalid(
                "overlay.endpoint",
                format!("`{e}` is neither ip:port nor an ip address"),
            ));
        }
        if self.listen_port == 0 {
            return Err(ConfigError::invalid("overlay.listen_port", "1 to 65535"));
        }
        if self.check_interval < Duration::from_millis(100) {
            return Err(ConfigError::invalid(
                "overlay.check_interval",
                "must be at least 100ms",
            ));
        }
        Ok(())
    }
}

/// The `[firewall]` table: the nftables ruleset the connectivity section declares.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FirewallConfig {
    /// Load the declared ruleset. Off: it is reported not applied. Default true.
    pub enabled: bool,
    /// nftables' `nft`. Default `nft`.
    pub nft: PathBuf,
}

impl Default for FirewallConfig {
    fn default() -> Self {
        FirewallConfig {
            enabled: true,
            nft: PathBuf::from("nft"),
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            state_dir: PathBuf::from("/var/lib/mesh-agent"),
            root: PathBuf::from("/"),
            labels: BTreeMap::new(),
            heartbeat_interval: Duration::from_secs(10),
            amqp_heartbeat: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(10),
            report_buffer: 10_000,
            reconnect_min: Duration::from_millis(500),
            reconnect_max: Duration::from_secs(30),
            metrics_listen: None,
            hostname: None,
            shutdown_timeout: Duration::from_secs(5),
            prefetch: 4,
            health_summary_secs: 60,
            units: crate::units::UnitsConfig::default(),
            overlay: OverlayConfig::default(),
            firewall: FirewallConfig::default(),
            artifacts: crate::artifacts::ArtifactsConfig::default(),
            provisioning: ProvisioningConfig::default(),
            brokers: Vec::new(),
        }
    }
}

impl Config {
    /// Parse a config file's text; `path` is only used in error messages.
    pub fn parse(text: &str, path: &Path) -> Result<Config, ConfigError> {
        let config: Config = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
        Ok(config)
    }

    /// Read and parse a config file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|error| ConfigError::Read {
            path: path.to_owned(),
            error,
        })?;
        Config::parse(&text, path)
    }

    /// Check the values that types alone cannot: called by [`crate::run`].
    pub fn validate(&self) -> Result<(), ConfigError> {
        validate_labels("labels", &self.labels).map_err(|e| match e {
            mesh_protocol::DecodeError::Invalid { field, reason } => {
                ConfigError::invalid(field, reason)
            }
            other => ConfigError::invalid("labels", other.to_string()),
        })?;
        if self.heartbeat_interval < Duration::from_millis(10) {
            return Err(ConfigError::invalid(
                "heartbeat_interval",
                "must be at least 10ms",
            ));
        }
        if !(1..=65535).contains(&self.amqp_heartbeat.as_secs()) {
            return Err(ConfigError::invalid(
                "amqp_heartbeat",
                "must be 1 to 65535 whole seconds",
            ));
        }
        if self.connect_timeout < Duration::from_millis(100) {
            return Err(ConfigError::invalid(
                "connect_timeout",
                "must be at least 100ms",
            ));
        }
        if self.report_buffer == 0 {
            return Err(ConfigError::invalid("report_buffer", "must be at least 1"));
        }
        if self.reconnect_min.is_zero() {
            return Err(ConfigError::invalid(
                "reconnect_min",
                "must be greater than zero",
            ));
        }
        if self.reconnect_max < self.reconnect_min {
            return Err(ConfigError::invalid(
                "reconnect_max",
                "must not be smaller than reconnect_min",
            ));
        }
        if self.prefetch == 0 {
            return Err(ConfigError::invalid("prefetch", "must be at least 1"));
        }
        if !(1..=86_400).contains(&self.health_summary_secs) {
            return Err(ConfigError::invalid(
                "health_summary_secs",
                "must be 1 to 86400",
            ));
        }
        if let Some(h) = &self.hostname
            && (h.is_empty() || h.len() > 255 || h.chars().any(char::is_control))
        {
            return Err(ConfigError::invalid(
                "hostname",
                "must be 1 to 255 characters without control characters",
            ));
        }
        self.units
            .validate()
            .map_err(|(field, reason)| ConfigError::invalid(field, reason))?;
        self.overlay.validate()?;
        self.provisioning.validate()?;
        self.artifacts
            .validate()
            .map_err(|(field, reason)| ConfigError::invalid(field, reason))?;
        self.broker_endpoints()?;
        if !self.root.is_absolute() {
            return Err(ConfigError::invalid("root", "must be an absolute path"));
        }
        if !self.state_dir.is_absolute() {
            return Err(ConfigError::invalid(
                "state_dir",
                "must be an absolute path",
            ));
        }
        Ok(())
    }
}

impl Config {
    /// The `brokers` endpoints as `(host, port)`, in order; an invalid entry
    /// is named by its index.
    pub fn broker_endpoints(&self) -> Result<Vec<(String, u16)>, ConfigError> {
        self.brokers
            .iter()
            .enumerate()
            .map(|(i, b)| {
                mesh_protocol::parse_host_port(b)
                    .map_err(|reason| ConfigError::invalid(format!("brokers[{i}]"), reason))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse(text, Path::new("agent.toml")).and_then(|c| c.validate().map(|()| c))
    }

    #[test]
    fn empty_file_gives_defaults() {
        assert_eq!(parse("").unwrap(), Config::default());
    }

    #[test]
    fn fields_parse() {
        let c = parse(
            r#"
            state_dir = "/tmp/s"
            root = "/tmp/r"
            heartbeat_interval = "500ms"
            reconnect_min = 1
            reconnect_max = 2.5
            report_buffer = 7
            metrics_listen = "127.0.0.1:9464"
            hostname = "h1"
            [labels]
            role = "web"
            "#,
        )
        .unwrap();
        assert_eq!(c.heartbeat_interval, Duration::from_millis(500));
        assert_eq!(c.reconnect_min, Duration::from_secs(1));
        assert_eq!(c.reconnect_max, Duration::from_millis(2500));
        assert_eq!(c.report_buffer, 7);
        assert_eq!(c.labels.get("role").map(String::as_str), Some("web"));
        assert_eq!(c.metrics_listen, Some("127.0.0.1:9464".parse().unwrap()));
    }

    #[test]
    fn brokers_are_host_ports_and_a_bad_one_is_named_by_index() {
        let mut c = parse("brokers = [\"127.0.0.1:5673\", \"rabbit-2.example:5671\"]").unwrap();
        c.validate().unwrap();
        assert_eq!(
            c.broker_endpoints().unwrap(),
            vec![
                ("127.0.0.1".to_owned(), 5673),
                ("rabbit-2.example".to_owned(), 5671)
            ]
        );
        c.brokers.push("amqp://h:5672".into());
        let err = c.validate().unwrap_err().to_string();
        assert!(
            err.contains("brokers[2]") && err.contains("scheme"),
            "{err}"
        );
        c.brokers[2] = "h".into();
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("brokers[2]") && err.contains("port"), "{err}");
        assert!(Config::default().brokers.is_empty());
    }

    #[test]
    fn errors_name_the_field() {
        for (text, field) in [
            ("heartbeat_intervall = 3", "heartbeat_intervall"),
            ("heartbeat_interval = \"soon\"", "heartbeat_interval"),
            ("report_buffer = -1", "report_buffer"),
            ("report_buffer = 0", "report_buffer"),
            ("health_summary_secs = 0", "health_summary_secs"),
            ("health_summary_secs = \"1m\"", "health_summary_secs"),
            ("metrics_listen = \"nowhere\"", "metrics_listen"),
            ("[labels]\n\"Bad Key\" = \"x\"", "labels.Bad Key"),
            ("reconnect_min = 5\nreconnect_max = 1", "reconnect_max"),
            ("connect_timeout = \"50ms\"", "connect_timeout"),
            ("root = \"relative\"", "root"),
            ("[units]\nlog_files = 5000", "units.log_files"),
            ("[units]\nstop_timeuot = 1", "stop_timeuot"),
            ("[overlay]\nendpoint = \"somewhere\"", "overlay.endpoint"),
            ("[overlay]\nlisten_port = 0", "overlay.listen_port"),
            ("[firewall]\nnft_path = \"x\"", "nft_path"),
            ("[provisioning]\ninterval = 0", "provisioning.interval"),
            (
                "[provisioning]\ninterval = \"200ms\"",
                "provisioning.interval",
            ),
            (
                "[provisioning]\ninterval = \"25h\"",
                "provisioning.interval",
            ),
            ("[provisioning]\ninterval = \"soon\"", "interval"),
            ("[provisioning]\nintervall = 5", "intervall"),
        ] {
            let err = parse(text).unwrap_err().to_string();
            assert!(
                err.contains(field),
                "{text:?}: error `{err}` does not name `{field}`"
            );
        }
    }

    #[test]
    fn example_file_states_the_defaults() {
        let text = include_str!("../agent.example.toml");
        assert_eq!(parse(text).unwrap(), Config::default());
    }

    #[test]
    fn overlay_endpoint_takes_the_listen_port() {
        let c = parse("[overlay]\nendpoint = \"10.201.0.2\"\nlisten_port = 51900").unwrap();
        assert_eq!(
            c.overlay.stated_endpoint().as_deref(),
            Some("10.201.0.2:51900")
        );
        let c = parse("[overlay]\nendpoint = \"10.201.0.2:1\"").unwrap();
        assert_eq!(c.overlay.stated_endpoint().as_deref(), Some("10.201.0.2:1"));
        assert_eq!(parse("").unwrap().overlay.stated_endpoint(), None);
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("10").unwrap(), Duration::from_secs(10));
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert!(parse_duration("x").is_err());
        assert!(parse_duration("-1").is_err());
    }
}
