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
use prometheus_client::registry::Registry;

type Labels = Vec<(&'static str, &'static str)>;

/// The agent's metrics. Cheap to clone (all handles are shared).
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    reports_published: Family<Labels, Counter>,
    reports_buffered: Gauge,
    declarations_applied: Family<Labels, Counter>,
    reconnects: Counter,
    unit_restarts: Counter,
    units_running: Gauge,
    unknown_fields: Family<Labels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("mesh_agent");
        let reports_published = Family::<Labels, Counter>::default();
        registry.register(
            "reports_published",
            "Reports confirmed by the broker, by kind",
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
            "Declarations handled, by outcome (applied, failed, rejected, stale)",
            declarations_applied.clone(),
        );
        let reconnects = Counter::default();
        registry.register(
            "reconnects",
            "Connections to the broker after the first",
            reconnects.clone(),
        );
        let unit_restarts = Counter::default();
        registry.register(
            "unit_restarts",
            "Unit processes started again after they exited (per policy)",
            unit_restarts.clone(),
        );
        let units_running = Gauge::default();
        registry.register(
            "units_running",
            "Units whose process runs now",
            units_running.clone(),
        );
        let unknown_fields = Family::<Labels, Counter>::default();
        registry.register(
            "unknown_fields",
            "Fields of accepted messages this agent does not know (a newer controller's), ignored, by kind",
            unknown_fields.clone(),
        );
        Metrics {
            registry: Arc::new(registry),
            unknown_fields,
            reports_published,
            reports_buffered,
            declarations_applied,
            reconnects,
            unit_restarts,
            units_running,
        }
    }

    pub fn report_published(&self, kind: &'static str) {
        self.reports_published
            .get_or_create(&vec![("kind", kind)])
            .inc();
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

    pub fn unit_restarted(&self) {
        self.unit_restarts.inc();
    }

    pub fn set_units_running(&self, n: usize) {
        self.units_running.set(i64::try_from(n).unwrap_or(i64::MAX));
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
        m.reconnected();
        m.unit_restarted();
        m.set_units_running(2);
        m.unknown_fields("declaration", 2);
        let text = m.render();
        for needle in [
            "mesh_agent_reports_published_total{kind=\"hello\"} 1",
            "mesh_agent_reports_buffered 3",
            "mesh_agent_declarations_applied_total{outcome=\"applied\"} 1",
            "mesh_agent_reconnects_total 1",
            "mesh_agent_unit_restarts_total 1",
            "mesh_agent_units_running 2",
            "mesh_agent_unknown_fields_total{kind=\"declaration\"} 2",
        ] {
            assert!(text.contains(needle), "{needle} missing from\n{text}");
        }
    }
}
