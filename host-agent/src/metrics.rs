//! Prometheus metrics, served on `metrics_listen` when it is set.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};
use std::sync::atomic::AtomicU64;

type Labels = Vec<(&'static str, &'static str)>;
/// Labels whose values are names the controller declared (units, probes).
type NameLabels = Vec<(&'static str, String)>;
type FloatGauge = Gauge<f64, AtomicU64>;
type FloatCounter = Counter<f64, AtomicU64>;

/// The label values of `mesh_agent_artifact_fetches_total{outcome}`: the
/// outcomes of the artifact cache's fetches, registered at zero.
pub const FETCH_OUTCOMES: &[&str] = &[
    "ok",
    "digest_mismatch",
    "no_signature",
    "untrusted",
    "error",
];

/// The agent's metrics. Cheap to clone (all handles are shared). Every family
/// is listed, with its type, labels and meaning, in docs/observability.md
/// ("The agent's").
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    certificate_expiry: Family<NameLabels, FloatGauge>,
    reports_published: Family<Labels, Counter>,
    reports_buffered: Gauge,
    declarations_applied: Family<Labels, Counter>,
    reconnects: Counter,
    unit_restarts: Family<NameLabels, Counter>,
    units_running: Gauge,
    unknown_fields: Family<Labels, Counter>,
    broker_connected: Gauge,
    last_confirm: FloatGauge,
    outages: Counter,
    outage_seconds: FloatCounter,
    applied_generation: Family<Labels, Gauge>,
    probe_healthy: Family<NameLabels, Gauge>,
    probe_checks: Family<NameLabels, Counter>,
    artifacts_cached: Gauge,
    artifact_fetches: Family<Labels, Counter>,
    resources: Family<Labels, Gauge>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    // Long on purpose: one registration per metric family, a few lines each;
    // the list of what the agent exports reads best whole.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("mesh_agent");
        let build_info = Family::<Labels, Gauge>::default();
        registry.register(
            "build_info",
            "Always 1; `version` is the agent's version",
            build_info.clone(),
        );
        build_info
            .get_or_create(&vec![("version", crate::AGENT_VERSION)])
            .set(1);
        let reports_published = Family::<Labels, Counter>::default();
        registry.register(
            "reports_published",
            "Reports confirmed by the broker (heartbeats: handed to it), by kind",
            reports_published.clone(),
        );
        let reports_buffered = Gauge::default();
        registry.register(
            "reports_buffered",
            "Reports waiting to be published or confirmed",
            reports_buffered.clone(),
        );
        let declarations_applied = Family::<Labels, Counter>::default();
        registry.register(
            "declarations_applied",
            "Declarations handled, by outcome (applied, failed, rejected, stale, unsupported)",
            declarations_applied.clone(),
        );
        let reconnects = Counter::default();
        registry.register(
            "reconnects",
            "Connections to the broker after the first",
            reconnects.clone(),
        );
        let broker_connected = Gauge::default();
        registry.register(
            "broker_connected",
            "1 while the agent holds a broker connection, else 0",
            broker_connected.clone(),
        );
        let last_confirm = FloatGauge::default();
        registry.register_with_unit(
            "last_confirm_timestamp",
            "Unix time the broker last confirmed a report of this agent (0: none yet)",
            Unit::Seconds,
            last_confirm.clone(),
        );
        let certificate_expiry = Family::<NameLabels, FloatGauge>::default();
        registry.register_with_unit(
            "certificate_expiry_timestamp",
            "Unix time each certificate the agent holds expires, by certificate (node, or a module's name)",
            Unit::Seconds,
            certificate_expiry.clone(),
        );
        let outages = Counter::default();
        registry.register(
            "broker_outages",
            "Broker connections lost (each one an outage until the agent is connected again)",
            outages.clone(),
        );
        let outage_seconds = FloatCounter::default();
        registry.register_with_unit(
            "broker_outage",
            "Time spent without the broker after losing it, counted when it is reached again",
            Unit::Seconds,
            outage_seconds.clone(),
        );
        let applied_generation = Family::<Labels, Gauge>::default();
        registry.register(
            "applied_generation",
            "The newest generation applied, by section",
            applied_generation.clone(),
        );
        let unit_restarts = Family::<NameLabels, Counter>::default();
        registry.register(
            "unit_restarts",
            "Unit processes started again after they exited (per policy), by unit",
            unit_restarts.clone(),
        );
        let units_running = Gauge::default();
        registry.register(
            "units_running",
            "Units whose process runs now",
            units_running.clone(),
        );
        let probe_healthy = Family::<NameLabels, Gauge>::default();
        registry.register(
            "probe_healthy",
            "A probe's state: 1 healthy, 0 unhealthy, -1 unknown; absent once its unit stops or goes",
            probe_healthy.clone(),
        );
        let probe_checks = Family::<NameLabels, Counter>::default();
        registry.register(
            "probe_checks",
            "Probe checks run, by unit, probe and result (ok, fail)",
            probe_checks.clone(),
        );
        let unknown_fields = Family::<Labels, Counter>::default();
        registry.register(
            "unknown_fields",
            "Fields of accepted messages this agent does not know (a newer controller's), ignored, by kind",
            unknown_fields.clone(),
        );
        let artifacts_cached = Gauge::default();
        registry.register(
            "artifacts_cached",
            "Artifacts held, verified and unpacked, in the agent's cache",
            artifacts_cached.clone(),
        );
        let artifact_fetches = Family::<Labels, Counter>::default();
        registry.register(
            "artifact_fetches",
            "Artifacts pulled from a registry, by outcome (ok, digest_mismatch, no_signature, untrusted, error)",
            artifact_fetches.clone(),
        );
        for outcome in FETCH_OUTCOMES {
            let _ = artifact_fetches.get_or_create(&vec![("outcome", *outcome)]);
        }
        let resources = Family::<Labels, Gauge>::default();
        registry.register(
            "resources",
            "Resources of the provisioning section, by the state the agent last found them in (ready, waiting, failed, revoked, deleted)",
            resources.clone(),
        );
        for state in RESOURCE_STATES {
            let _ = resources.get_or_create(&vec![("state", state.as_str())]);
        }
        // At 0 from the start where the label values are known (Prometheus'
        // advice: a series that first appears at 1 hides that increase from
        // rate(), and a family without series is absent from a scrape).
        let _ = unknown_fields.get_or_create(&vec![("kind", "declaration")]);
        for outcome in ["applied", "failed", "rejected", "stale", "unsupported"] {
            let _ = declarations_applied.get_or_create(&vec![("outcome", outcome)]);
        }
        Metrics {
            registry: Arc::new(registry),
            certificate_expiry,
            unknown_fields,
            reports_published,
            reports_buffered,
            declarations_applied,
            reconnects,
            unit_restarts,
            units_running,
            broker_connected,
            last_confirm,
            outages,
            outage_seconds,
            applied_generation,
            probe_healthy,
            probe_checks,
            artifacts_cached,
            artifact_fetches,
            resources,
        }
    }

    /// What the last provisioning pass found: resources per state.
    pub fn set_resources(&self, found: &[mesh_protocol::ResourceStatus]) {
        for state in RESOURCE_STATES {
            let n = found.iter().filter(|r| r.state == state).count();
            self.resources
                .get_or_create(&vec![("state", state.as_str())])
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    pub fn set_artifacts_cached(&self, n: usize) {
        self.artifacts_cached
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    pub fn artifact_fetched(&self, outcome: &'static str) {
        self.artifact_fetches
            .get_or_create(&vec![("outcome", outcome)])
            .inc();
    }

    pub fn report_published(&self, kind: &'static str) {
        self.reports_published
            .get_or_create(&vec![("kind", kind)])
            .inc();
    }

    /// The broker confirmed a report, now.
    /// The certificates held now and when each expires (one no longer
    /// held leaves the family).
    pub fn set_certificate_expiries(&self, held: &[(String, chrono::DateTime<chrono::Utc>)]) {
        self.certificate_expiry.clear();
        for (name, not_after) in held {
            self.certificate_expiry
                .get_or_create(&vec![("certificate", name.clone())])
                .set(not_after.timestamp() as f64);
        }
    }

    pub fn confirmed_now(&self) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        self.last_confirm.set(now);
    }

    pub fn set_buffered(&self, n: usize) {
        self.reports_buffered
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    pub fn declaration_applied(&self, outcome: &'static str) {
        self.declarations_applied
            .get_or_create(&vec![("outcome", outcome)])
            .inc();
    }

    /// The newest applied generation of `section`.
    pub fn set_applied_generation(&self, section: &'static str, generation: u64) {
        self.applied_generation
            .get_or_create(&vec![("section", section)])
            .set(i64::try_from(generation).unwrap_or(i64::MAX));
    }

    /// Count `n` ignored fields of a message of `kind`.
    pub fn unknown_fields(&self, kind: &'static str, n: usize) {
        if n > 0 {
            self.unknown_fields
                .get_or_create(&vec![("kind", kind)])
                .inc_by(u64::try_from(n).unwrap_or(u64::MAX));
        }
    }

    pub fn reconnected(&self) {
        self.reconnects.inc();
    }

    /// The agent holds a broker connection (or no longer does).
    pub fn set_connected(&self, connected: bool) {
        self.broker_connected.set(i64::from(connected));
    }

    /// The broker connection was lost.
    pub fn outage_began(&self) {
        self.outages.inc();
    }

    /// The broker was reached again after `seconds` without it.
    pub fn outage_ended(&self, seconds: f64) {
        self.outage_seconds.inc_by(seconds.max(0.0));
    }

    /// A unit is supervised: its restarts series exists from 0.
    pub fn unit_known(&self, unit: &str) {
        let _ = self
            .unit_restarts
            .get_or_create(&vec![("unit", unit.to_owned())]);
    }

    pub fn unit_restarted(&self, unit: &str) {
        self.unit_restarts
            .get_or_create(&vec![("unit", unit.to_owned())])
            .inc();
    }

    /// A unit is gone: its series go too.
    pub fn unit_forgotten(&self, unit: &str) {
        self.unit_restarts.remove(&vec![("unit", unit.to_owned())]);
    }

    pub fn set_units_running(&self, n: usize) {
        self.units_running.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// A probe's state: 1 healthy, 0 unhealthy, -1 unknown.
    pub fn set_probe_state(&self, unit: &str, probe: &str, state: mesh_protocol::ProbeState) {
        let v = match state {
            mesh_protocol::ProbeState::Healthy => 1,
            mesh_protocol::ProbeState::Unhealthy => 0,
            mesh_protocol::ProbeState::Unknown => -1,
        };
        self.probe_healthy
            .get_or_create(&probe_labels(unit, probe))
            .set(v);
    }

    /// A probe's check ran: `ok` or not.
    pub fn probe_checked(&self, unit: &str, probe: &str, ok: bool) {
        let mut labels = probe_labels(unit, probe);
        labels.push(("result", if ok { "ok" } else { "fail" }.to_owned()));
        self.probe_checks.get_or_create(&labels).inc();
    }

    /// A probe no longer runs (its unit stopped or went, or it is no longer
    /// declared): its series go.
    pub fn probe_forgotten(&self, unit: &str, probe: &str) {
        self.probe_healthy.remove(&probe_labels(unit, probe));
        for result in ["ok", "fail"] {
            let mut labels = probe_labels(unit, probe);
            labels.push(("result", result.to_owned()));
            self.probe_checks.remove(&labels);
        }
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }

    /// Serve `GET /metrics` on an already bound listener until `shutdown` resolves.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let app = Router::new()
            .route("/metrics", get(render))
            .with_state(self);
        axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
    }

    pub async fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
        tokio::net::TcpListener::bind(addr).await
    }
}

const RESOURCE_STATES: [mesh_protocol::ResourceStatusState; 5] = [
    mesh_protocol::ResourceStatusState::Ready,
    mesh_protocol::ResourceStatusState::Waiting,
    mesh_protocol::ResourceStatusState::Failed,
    mesh_protocol::ResourceStatusState::Revoked,
    mesh_protocol::ResourceStatusState::Deleted,
];

fn probe_labels(unit: &str, probe: &str) -> NameLabels {
    vec![("unit", unit.to_owned()), ("probe", probe.to_owned())]
}

async fn render(State(m): State<Metrics>) -> impl IntoResponse {
    (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        m.render(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_all_families() {
        let m = Metrics::new();
        m.report_published("hello");
        m.set_buffered(3);
        m.declaration_applied("applied");
        m.set_applied_generation("inventory", 7);
        m.reconnected();
        m.set_connected(true);
        m.confirmed_now();
        m.set_certificate_expiries(&[(
            "node".to_owned(),
            chrono::DateTime::from_timestamp(1_900_000_000, 0).unwrap(),
        )]);
        m.outage_began();
        m.outage_ended(2.5);
        m.unit_restarted("web-0");
        m.set_units_running(2);
        m.unknown_fields("declaration", 2);
        m.set_probe_state("web-0", "ready", mesh_protocol::ProbeState::Healthy);
        m.probe_checked("web-0", "ready", true);
        m.probe_checked("web-0", "ready", false);
        m.set_resources(&[mesh_protocol::ResourceStatus {
            grant: uuid::Uuid::nil(),
            state: mesh_protocol::ResourceStatusState::Ready,
            credential_version: Some(1),
            reason: None,
            recreated: false,
        }]);
        let text = m.render();
        for needle in [
            &format!(
                "mesh_agent_build_info{{version=\"{}\"}} 1",
                crate::AGENT_VERSION
            ),
            "mesh_agent_reports_published_total{kind=\"hello\"} 1",
            "mesh_agent_reports_buffered 3",
            "mesh_agent_declarations_applied_total{outcome=\"applied\"} 1",
            "mesh_agent_applied_generation{section=\"inventory\"} 7",
            "mesh_agent_reconnects_total 1",
            "mesh_agent_broker_connected 1",
            "mesh_agent_last_confirm_timestamp_seconds 1",
            "mesh_agent_certificate_expiry_timestamp_seconds{certificate=\"node\"} 1900000000",
            "mesh_agent_broker_outages_total 1",
            "mesh_agent_broker_outage_seconds_total 2.5",
            "mesh_agent_unit_restarts_total{unit=\"web-0\"} 1",
            "mesh_agent_units_running 2",
            "mesh_agent_unknown_fields_total{kind=\"declaration\"} 2",
            "mesh_agent_probe_healthy{unit=\"web-0\",probe=\"ready\"} 1",
            "mesh_agent_probe_checks_total{unit=\"web-0\",probe=\"ready\",result=\"ok\"} 1",
            "mesh_agent_probe_checks_total{unit=\"web-0\",probe=\"ready\",result=\"fail\"} 1",
            "mesh_agent_resources{state=\"ready\"} 1",
            "mesh_agent_resources{state=\"waiting\"} 0",
        ] {
            assert!(text.contains(needle), "{needle} missing from\n{text}");
        }
        // docs/observability.md lists exactly the families rendered.
        let doc = include_str!("../../docs/observability.md");
        let section = doc
            .split("### The agent's")
            .nth(1)
            .and_then(|rest| rest.split("\n## ").next())
            .expect("docs/observability.md has the agent's section");
        let documented: Vec<&str> = section
            .lines()
            .filter_map(|l| l.strip_prefix("| `")?.split('`').next())
            .collect();
        assert!(documented.len() >= 15, "{documented:?}");
        for family in &documented {
            assert!(
                text.lines().any(|l| l.starts_with(&format!("{family} "))
                    || l.starts_with(&format!("{family}{{"))),
                "{family} is documented but not rendered:\n{text}"
            );
        }
        for line in text.lines() {
            let Some(rest) = line.strip_prefix("# TYPE ") else {
                continue;
            };
            let mut parts = rest.split(' ');
            let (Some(name), Some(kind)) = (parts.next(), parts.next()) else {
                continue;
            };
            let sample = if kind == "counter" {
                format!("{name}_total")
            } else {
                name.to_owned()
            };
            assert!(
                documented.contains(&sample.as_str()),
                "{sample} is rendered but not in docs/observability.md"
            );
        }

        // Gone with their unit.
        m.probe_forgotten("web-0", "ready");
        m.unit_forgotten("web-0");
        let text = m.render();
        assert!(!text.contains("web-0"), "{text}");
    }
}
