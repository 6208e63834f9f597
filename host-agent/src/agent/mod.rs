//! The agent's main loop: connect, state (hello, heartbeats, applied), apply what
//! is declared, reconnect when the broker goes away, and shut down gracefully.
//!
//! One task owns all state (store, buffer, connection); nothing is shared behind
//! locks. Blocking file work runs on the blocking pool. [`Agent`] holds that
//! state; its rooms each add the methods of one concern:
//!
//! - [`connect`] (with [`backoff`]): reaching the broker, endpoint after
//!   endpoint, and living through outages;
//! - [`session`]: one connected session, a `select!` over what it waits on;
//! - [`channel`]: the AMQP steps themselves (publish, confirm, consume), which
//!   know nothing of the agent;
//! - [`declarations`]: verify, decode, apply and record a declaration, one
//!   file per section kind;
//! - [`reports`]: the outgoing reports, built, fitted ([`fit`]) and buffered.

mod backoff;
mod channel;
mod connect;
mod declarations;
mod fit;
mod reports;
mod session;

use std::pin::Pin;
use std::time::Duration;

use mesh_protocol::{HeartbeatPlan, ItemOutcome, ReportKind, Section};
use tokio::time::Instant;
use uuid::Uuid;

pub use backoff::Backoff;

use crate::apply::Applier;
use crate::buffer::{Outgoing, ReportBuffer};
use crate::config::Config;
use crate::credentials::Credentials;
use crate::metrics::Metrics;
use crate::provision::worker::{Declared, Worker};
use crate::store::Store;
use crate::units::probes::HealthReporter;
use crate::units::{Reporter, Supervisor};

/// A broker outage being lived through: since when (the agent's clock, and
/// its monotonic one), and the reports lost meanwhile.
#[derive(Debug, Clone, Copy)]
struct OutageTrack {
    since: chrono::DateTime<chrono::Utc>,
    at: Instant,
    dropped: u64,
}

type Shutdown<'a> = Pin<&'a mut (dyn Future<Output = ()> + Send)>;

pub(crate) struct Agent {
    config: Config,
    creds: Credentials,
    store: Store,
    applier: Applier,
    buffer: ReportBuffer,
    metrics: Metrics,
    /// Runs the inventory section's units; outlives broker sessions.
    units: Supervisor,
    reporter: Reporter,
    /// Probe results, for `health` reports.
    health: HealthReporter,
    /// The last health report stating a change, until the broker confirms
    /// it (a summary that replaces it in the buffer states the change too).
    health_change: Option<Uuid>,
    /// The broker outage since the last connection was lost, until a hello
    /// stating it is confirmed (`outage_hello`).
    outage: Option<OutageTrack>,
    outage_hello: Option<Uuid>,
    /// When the connection was lost (for the outage metric).
    disconnected_at: Option<Instant>,
    /// The heartbeat plan the controller declared (none: beat at the
    /// configured interval); `retime` is set when it changed.
    plan: Option<HeartbeatPlan>,
    retime: bool,
    /// The overlay and firewall of the connectivity section; `changes`: item
    /// outcomes a periodic check changed, to state again.
    connectivity: Option<crate::connectivity::Shared>,
    connectivity_changes: Option<tokio::sync::mpsc::Receiver<Vec<ItemOutcome>>>,
    /// The node's certificates (none: not set up, as in some tests).
    certs: Option<crate::certs::Certs>,
    /// The artifact cache the delivery section fills (none: not set up).
    artifacts: Option<crate::artifacts::Artifacts>,
    /// Reconciles the provisioning section's resources in the background;
    /// its findings become `resources` reports.
    resources: Worker,
}

impl Agent {
    pub(crate) fn new(
        config: Config,
        creds: Credentials,
        store: Store,
        applier: Applier,
        metrics: Metrics,
        units: Supervisor,
    ) -> Self {
        let mut buffer = ReportBuffer::new(config.report_buffer);
        // Applied reports that were never confirmed before the last exit.
        for p in &store.data().pending_reports {
            if let Ok(kind) = ReportKind::parse(&p.kind) {
                buffer.push(Outgoing {
                    id: p.id,
                    kind,
                    seq: p.seq,
                    payload: p.payload.clone().into_bytes(),
                });
            }
        }
        metrics.set_buffered(buffer.len());
        for (section, generation) in store.applied_generations() {
            metrics.set_applied_generation(section.as_str(), generation);
        }
        let reporter = units.reporter();
        let health = units.health_reporter();
        let plan = crate::plan::load(&config.state_dir);
        // The resources as last declared, reconciled at once (rule 8): no
        // broker, no controller needed.
        let provisioning = store.section(Section::Provisioning);
        let found = store.data().resources.as_ref();
        if let Some(f) = found {
            metrics.set_resources(&f.resources);
        }
        let resources = Worker::start(
            applier.clone(),
            config.provisioning.interval,
            Declared {
                generation: provisioning.generation,
                resources: provisioning.resources,
            },
            found,
        );
        Agent {
            resources,
            plan,
            retime: false,
            connectivity: None,
            connectivity_changes: None,
            certs: None,
            artifacts: None,
            config,
            creds,
            store,
            applier,
            buffer,
            metrics,
            units,
            reporter,
            health,
            health_change: None,
            outage: None,
            outage_hello: None,
            disconnected_at: None,
        }
    }

    /// Apply the connectivity section's overlay and firewall with `c`, and
    /// state again what its checks change.
    pub(crate) fn with_connectivity(
        mut self,
        c: crate::connectivity::Shared,
        changes: tokio::sync::mpsc::Receiver<Vec<ItemOutcome>>,
    ) -> Self {
        self.connectivity = Some(c);
        self.connectivity_changes = Some(changes);
        self
    }

    /// Cache the delivery section's artifacts with `artifacts`.
    pub(crate) fn with_artifacts(mut self, artifacts: crate::artifacts::Artifacts) -> Self {
        self.artifacts = Some(artifacts);
        self
    }

    /// Ask for, install and renew the node's certificates with `certs`.
    pub(crate) fn with_certs(mut self, certs: crate::certs::Certs) -> Self {
        self.certs = Some(certs);
        self
    }

    /// Run until `shutdown` resolves, then leave the units running for the next
    /// agent (their shims keep their output; decision 0016).
    pub(crate) async fn run(mut self, shutdown: Shutdown<'_>) {
        self.serve(shutdown).await;
        self.resources.stop();
        self.units.shutdown().await;
    }

    /// The interval to beat at: the declared plan's, else the configured one.
    fn interval(&self) -> Duration {
        self.plan.map_or(self.config.heartbeat_interval, |p| {
            Duration::from_millis(p.interval_ms)
        })
    }
}
