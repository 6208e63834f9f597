//! Startup and the life of the controller: take the fence (a second controller
//! stops there, having touched nothing), migrate, connect the contexts, serve
//! the API, and keep a broker session (consumers + relay) alive across broker
//! restarts. One shutdown token fans out to every task; each is joined; the
//! fence is released last.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use lapin::Connection;
use mesh_plumbing::OutboxSignal;
use mesh_protocol::{ReportKind, redact_url};
use prometheus_client::registry::Registry;
use rand::Rng;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::amqp::{self, DeclarationQueues};
use crate::api::{self, ApiState};
use crate::broker_stats::{self, QueueDepths};
use crate::config::{ConfigError, Credentials, Settings};
use crate::fence::{Fence, FenceError};
use crate::metrics::Metrics;
use crate::pipeline::{FAILPOINT_ENV, Pipeline, PipelineError, Source};
use crate::relay::Relay;
use crate::router::{Contexts, ContextsError};
use crate::upgrade;

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Contexts(#[from] ContextsError),
    #[error(transparent)]
    Fence(#[from] FenceError),
    #[error("{0}")]
    FenceLost(String),
    #[error("binding the API on {addr}: {source}")]
    Bind {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error("serving the API: {0}")]
    Serve(std::io::Error),
    #[error("the API's HTTPS listener: {0}")]
    Tls(String),
    #[error("the Alertmanager client: {0}")]
    Alertmanager(reqwest::Error),
}

/// How long a graceful close of a broker connection waits for the broker's
/// answer (a dead peer never answers).
const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);
/// The HTTPS listener and its certificate, when the credentials name the
/// mesh CA and an address to listen on is known (`api_listen_tls`, else the
/// advertised API's port); otherwise `None`, with a log line saying why.
async fn https_listener(
    settings: &Settings,
    creds: &Credentials,
    shutdown: CancellationToken,
) -> Result<Option<(crate::tls::TlsListener, crate::tls::ApiCertificate)>, AppError> {
    let Some(ca) = creds.mesh_ca()? else {
        tracing::warn!(
            "HTTPS off: the credentials name no mesh CA (ca_certificate_file, ca_key_file; run bundle/up again); the API is on loopback only"
        );
        return Ok(None);
    };
    let advertised = crate::config::Advertised::of(settings, creds);
    let Some(addr) = advertised.tls_listen(settings) else {
        tracing::warn!(
            "HTTPS off: neither api_listen_tls nor advertise_api is set; the API is on loopback only"
        );
        return Ok(None);
    };
    let mut names: Vec<String> = Vec::new();
    let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_ascii_lowercase());
    let listen_ip = (!addr.ip().is_unspecified()).then(|| addr.ip().to_string());
    for n in [
        advertised.api_host(),
        listen_ip,
        Some("127.0.0.1".into()),
        Some("localhost".into()),
        hostname,
    ]
    .into_iter()
    .flatten()
    {
        if !n.is_empty() && !names.contains(&n) {
            names.push(n);
        }
    }
    let lifetime = Duration::from_secs(settings.api_certificate_lifetime_secs);
    let certificate = crate::tls::ApiCertificate::issue(ca, names, lifetime)
        .map_err(|e| AppError::Tls(e.to_string()))?;
    let config = certificate
        .server_config()
        .map_err(|e| AppError::Tls(e.to_string()))?;
    let tcp = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| AppError::Bind { addr, source })?;
    let listener = crate::tls::TlsListener::new(tcp, config, shutdown).map_err(AppError::Serve)?;
    tracing::info!(
        addr = %listener_addr(&listener),
        advertise_api = advertised.api.as_deref().unwrap_or("-"),
        names = ?certificate.names(),
        not_after = %certificate.not_after(),
        "API listening (HTTPS)"
    );
    Ok(Some((listener, certificate)))
}

fn listener_addr(l: &crate::tls::TlsListener) -> String {
    axum::serve::Listener::local_addr(l)
        .map(|a| a.to_string())
        .unwrap_or_default()
}

/// Apply every context's migrations and return what was applied. Holds the
/// fence meanwhile: refused while a controller runs, so that migrations never
/// run beside one.
pub async fn migrate(settings: &Settings) -> Result<Vec<(&'static str, Vec<String>)>, AppError> {
    let creds = Credentials::load(&settings.credentials)?;
    let fence = Fence::take(creds.fence_database()?.expose()).await?;
    let applied = Contexts::migrate(&creds).await;
    fence.release().await;
    Ok(applied?)
}

/// Run the controller until `shutdown` is cancelled. The fence comes first:
/// if another controller holds it, this returns [`FenceError::Held`] before any
/// migration, API socket or broker connection; if it is lost while running and
/// another controller took it, every task stops and this returns
/// [`AppError::FenceLost`]. The fence is released after every task stopped.
pub async fn run(settings: Settings, shutdown: CancellationToken) -> Result<(), AppError> {
    let creds = Credentials::load(&settings.credentials)?;
    let fence = Arc::new(Fence::take(creds.fence_database()?.expose()).await?);
    let outcome = run_fenced(settings, creds, fence.clone(), shutdown).await;
    fence.release().await;
    outcome
}

async fn run_fenced(
    settings: Settings,
    creds: Credentials,
    fence: Arc<Fence>,
    shutdown: CancellationToken,
) -> Result<(), AppError> {
    let mut tasks = JoinSet::new();
    let fence_shutdown = shutdown.clone();
    tasks.spawn(async move {
        let held = fence.hold(fence_shutdown).await;
        ("fence", held.map_err(|e| e.to_string()))
    });
    for (context, applied) in Contexts::migrate(&creds).await? {
        if !applied.is_empty() {
            tracing::info!(context, ?applied, "migrations applied");
        }
    }
    let signal = OutboxSignal::default();
    let signer = Arc::new(creds.signer()?);
    let mut registry = Registry::default();
    let metrics = Metrics::new(&mut registry);
    let mut contexts = Contexts::connect(&creds, &settings, signal.clone()).await?;
    contexts.handler_seconds = metrics.handler_seconds.clone();
    let schemas: Vec<&str> = contexts.schemas().iter().map(|(s, _)| *s).collect();
    metrics.initialize(&schemas);
    let contexts = Arc::new(contexts);
    // Before the first report: what was declared to each node (heartbeats in
    // step stay in memory) and the fleet's heartbeat interval.
    let known = contexts.load_in_step().await.map_err(ContextsError::from)?;
    contexts
        .inventory
        .choose_heartbeat()
        .await
        .map_err(ContextsError::from)?;
    tracing::info!(nodes = known, heartbeat = ?contexts.inventory.heartbeat(), "liveness ready");
    // Before the first report too: a revoked node's reports are refused from
    // its first one (decision 0050).
    let revoked = contexts
        .inventory
        .load_revocations()
        .await
        .map_err(ContextsError::from)?;
    tracing::info!(revoked, "revoked nodes loaded");
    if let Some(hash) = &creds.bootstrap_admin_token_sha256 {
        match contexts.identity.ensure_bootstrap_admin(hash).await {
            Ok(true) => tracing::info!("first admin API token (bootstrap-admin) registered"),
            Ok(false) => {}
            Err(e) => tracing::error!(error = %e, "cannot register the first admin API token"),
        }
    }
    let logs = Arc::new(crate::logs::LogsHub::new(
        crate::logs::LogsSettings {
            wait: Duration::from_millis(settings.logs_wait_ms),
            max_requests: settings.logs_max_requests,
            max_nodes: settings.logs_max_nodes,
        },
        signer.clone(),
        metrics.clone(),
    ));
    let broker_up = Arc::new(AtomicBool::new(false));
    // The latest reading of the broker's queues: written by the broker
    // session's stats task, read through `ApiState::queue_depths` (or a clone
    // of `queue_depths` handed to a task).
    let (depths_tx, queue_depths) = watch::channel(None::<QueueDepths>);

    let listener = tokio::net::TcpListener::bind(settings.api_listen)
        .await
        .map_err(|source| AppError::Bind {
            addr: settings.api_listen,
            source,
        })?;
    let addr = listener.local_addr().map_err(AppError::Serve)?;
    tracing::info!(%addr, "API listening (plain HTTP, loopback only)");
    let app = api::router(ApiState {
        contexts: contexts.clone(),
        registry: Arc::new(registry),
        broker_up: broker_up.clone(),
        signal: signal.clone(),
        metrics: metrics.clone(),
        queue_depths: queue_depths.clone(),
        logs: logs.clone(),
    });

    // The mesh CA's end, for Prometheus' certificate rules (issue 35).
    if let Ok(Some(ca)) = creds.mesh_ca()
        && let Ok(info) = mesh_credentials::pki::CertInfo::parse(ca.certificate_pem())
    {
        metrics
            .certificate_expiry
            .get_or_create(&crate::metrics::CertificateLabels {
                certificate: "mesh_ca".to_owned(),
            })
            .set(info.not_after.timestamp() as f64);
    }
    if let Some((tls, certificate)) = https_listener(&settings, &creds, shutdown.clone()).await? {
        let tls_app = app.clone();
        let api_shutdown = shutdown.clone();
        tasks.spawn(async move {
            let served = axum::serve(tls, tls_app)
                .with_graceful_shutdown(api_shutdown.cancelled_owned())
                .await;
            ("api-https", served.map_err(|e| e.to_string()))
        });
        let renew_shutdown = shutdown.clone();
        let expiry = metrics
            .certificate_expiry
            .get_or_create(&crate::metrics::CertificateLabels {
                certificate: "api".to_owned(),
            })
            .clone();
        tasks.spawn(async move {
            certificate.renew(renew_shutdown, expiry).await;
            ("api-certificate", Ok(()))
        });
    }
    let api_shutdown = shutdown.clone();
    tasks.spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(api_shutdown.cancelled_owned())
            .await;
        ("api", served.map_err(|e| e.to_string()))
    });
    let session = Session {
        contexts: contexts.clone(),
        signer,
        metrics: metrics.clone(),
        settings: settings.clone(),
        signal,
        broker_url: creds.broker_url.expose().clone(),
        broker_up,
        queue_depths: depths_tx,
        logs,
    };
    let broker_shutdown = shutdown.clone();
    tasks.spawn(async move {
        session.run(broker_shutdown).await;
        ("broker", Ok(()))
    });
    let sweeper_shutdown = shutdown.clone();
    let sweeper_contexts = contexts.clone();
    let sweep_interval = settings.sweep_interval();
    tasks.spawn(async move {
        sweeper(sweeper_contexts, sweep_interval, sweeper_shutdown).await;
        ("sweeper", Ok(()))
    });
    let writer_shutdown = shutdown.clone();
    let writer_contexts = contexts.clone();
    let writer_metrics = metrics.clone();
    let write_interval = settings.liveness_write();
    tasks.spawn(async move {
        liveness_writer(
            writer_contexts,
            writer_metrics,
            write_interval,
            writer_shutdown,
        )
        .await;
        ("liveness", Ok(()))
    });
    let resync_shutdown = shutdown.clone();
    let resync_contexts = contexts.clone();
    let resync_interval = settings.resync_interval();
    tasks.spawn(async move {
        resync(resync_contexts, resync_interval, resync_shutdown).await;
        ("resync", Ok(()))
    });
    let evaluator_shutdown = shutdown.clone();
    let evaluator_contexts = contexts.clone();
    let evaluator_metrics = metrics.clone();
    let evaluator_depths = queue_depths.clone();
    tasks.spawn(async move {
        crate::evaluator::run(
            evaluator_contexts,
            evaluator_metrics,
            evaluator_depths,
            evaluator_shutdown,
        )
        .await;
        ("evaluator", Ok(()))
    });
    let alerts_out = crate::alertmanager::HttpPoster::new(&settings.oidc_ca_file)
        .map_err(AppError::Alertmanager)?;
    let alerts_shutdown = shutdown.clone();
    let alerts_contexts = contexts.clone();
    let alerts_metrics = metrics.clone();
    tasks.spawn(async move {
        crate::alertmanager::run(alerts_contexts, alerts_out, alerts_metrics, alerts_shutdown)
            .await;
        ("alertmanager", Ok(()))
    });
    let clock_shutdown = shutdown.clone();
    let clock_contexts = contexts.clone();
    let clock_every = std::time::Duration::from_millis(settings.rollout_tick_ms);
    let clock_metrics = metrics.clone();
    tasks.spawn(async move {
        crate::rollout_clock::run(clock_contexts, clock_metrics, clock_every, clock_shutdown).await;
        ("rollouts", Ok(()))
    });
    let stats_shutdown = shutdown.clone();
    let stats_contexts = contexts.clone();
    let stats_metrics = metrics.clone();
    let stats_interval = settings.broker_stats_interval();
    tasks.spawn(async move {
        database_stats(
            stats_contexts,
            stats_metrics,
            stats_interval,
            stats_shutdown,
        )
        .await;
        ("stats", Ok(()))
    });
    let replica_shutdown = shutdown.clone();
    let replica_metrics = metrics.clone();
    let replica_every = Duration::from_millis(settings.replica_check_ms);
    let replicas = contexts.replicas.clone();
    tasks.spawn(async move {
        crate::replica::run(replicas, replica_metrics, replica_every, replica_shutdown).await;
        ("replica", Ok(()))
    });
    let housekeeping_shutdown = shutdown.clone();
    let housekeeping_contexts = contexts.clone();
    tasks.spawn(async move {
        housekeeping(housekeeping_contexts, housekeeping_shutdown).await;
        ("housekeeping", Ok(()))
    });

    // The first task to end (normally because of shutdown) ends them all.
    let mut outcome = Ok(());
    if let Some(Ok((name, result))) = tasks.join_next().await {
        log_exit(name, &result);
        if let Err(e) = result {
            outcome = Err(if name == "fence" {
                AppError::FenceLost(e)
            } else {
                AppError::Serve(std::io::Error::other(e))
            });
        }
    }
    shutdown.cancel();
    let deadline = Duration::from_secs(settings.shutdown_deadline_secs);
    let joined = tokio::time::timeout(deadline, async {
        while let Some(done) = tasks.join_next().await {
            if let Ok((name, result)) = done {
                log_exit(name, &result);
            }
        }
    })
    .await;
    if joined.is_err() {
        tracing::warn!(
            ?deadline,
            "tasks did not stop before the deadline; abandoning them"
        );
    }
    outcome
}

fn log_exit(name: &str, result: &Result<(), String>) {
    match result {
        Ok(()) => tracing::info!(task = name, "stopped"),
        Err(e) => tracing::error!(task = name, error = %e, "failed"),
    }
}

/// Judge liveness and reconcile the fleet every `interval` (inventory decides
/// whether it has observed long enough to judge; see `Inventory::sweep`).
async fn sweeper(contexts: Arc<Contexts>, interval: Duration, shutdown: CancellationToken) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
        match contexts.inventory.sweep(chrono::Utc::now()).await {
            Ok(report) => {
                if !report.unreachable.is_empty() || report.reconcile.changed() {
                    tracing::info!(
                        unreachable = ?report.unreachable,
                        placed = report.reconcile.placed,
                        removed = report.reconcile.removed,
                        declared = report.reconcile.declared,
                        drained = ?report.reconcile.drained,
                        paused = ?report.reconcile.paused,
                        conditions = ?report.reconcile.conditions,
                        "fleet swept"
                    );
                }
            }
            Err(e) => tracing::warn!(error = %e, "sweeping the fleet failed; retrying next round"),
        }
    }
}

/// Write the fleet's last heartbeats, kept in memory, every `interval`, and
/// once more at shutdown (decision 0023).
async fn liveness_writer(
    contexts: Arc<Contexts>,
    metrics: Metrics,
    interval: Duration,
    shutdown: CancellationToken,
) {
    loop {
        let stop = tokio::select! {
            _ = shutdown.cancelled() => true,
            _ = tokio::time::sleep(interval) => false,
        };
        match contexts.inventory.write_liveness().await {
            Ok(n) => {
                metrics
                    .liveness_written
                    .inc_by(u64::try_from(n).unwrap_or(u64::MAX));
                tracing::trace!(nodes = n, "liveness written");
            }
            Err(e) => {
                tracing::warn!(error = %e, "writing liveness failed; kept for the next write")
            }
        }
        if stop {
            return;
        }
    }
}

/// Every `interval`, resync the sections of every context that declares one
/// (`Contexts::resync_sections`): anything that differs from what each context
/// computes now is declared again.
async fn resync(contexts: Arc<Contexts>, interval: Duration, shutdown: CancellationToken) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
        for (context, result) in contexts.resync_sections().await {
            match result {
                Ok(report) if report.declared > 0 => tracing::info!(
                    context,
                    nodes = report.nodes,
                    declared = report.declared,
                    "resync declared sections that differed from what was stored"
                ),
                Ok(report) => {
                    tracing::debug!(context, nodes = report.nodes, "resync: sections agree")
                }
                Err(e) => {
                    tracing::warn!(context, error = %e, "resync failed; retrying next round")
                }
            }
        }
    }
}

/// Every `interval`, the gauges read from the database: nodes per state
/// (inventory's `node_counts`) and the age of each context's oldest unsent
/// outbox row. Read here, not per scrape, so a scrape costs no query.
async fn database_stats(
    contexts: Arc<Contexts>,
    metrics: Metrics,
    interval: Duration,
    shutdown: CancellationToken,
) {
    loop {
        match contexts.inventory.node_counts().await {
            Ok(counts) => metrics.set_node_counts(&counts),
            Err(e) => tracing::warn!(error = %e, "counting nodes failed; retrying next round"),
        }
        metrics
            .heartbeat_detection
            .set(contexts.inventory.heartbeat().detection_ms as f64 / 1000.0);
        for (schema, pool) in contexts.schemas() {
            match mesh_plumbing::outbox::oldest_unsent(pool, schema).await {
                Ok(age) => {
                    metrics
                        .outbox_oldest_unsent
                        .get_or_create(&Metrics::context(schema))
                        .set(age.unwrap_or(0.0));
                }
                Err(e) => {
                    tracing::warn!(context = schema, error = %e, "reading the outbox's oldest row failed")
                }
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
    }
}

/// Forget inbox and outbox rows that can no longer matter, once an hour.
async fn housekeeping(contexts: Arc<Contexts>, shutdown: CancellationToken) {
    let keep = Duration::from_secs(7 * 24 * 3600);
    loop {
        for (schema, pool) in contexts.schemas() {
            if let Err(e) = mesh_plumbing::inbox::prune(pool, schema, keep).await {
                tracing::warn!(context = schema, error = %e, "pruning the inbox failed");
            }
            if let Err(e) = mesh_plumbing::outbox::prune(pool, schema, keep).await {
                tracing::warn!(context = schema, error = %e, "pruning the outbox failed");
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(3600)) => {}
        }
    }
}

/// The broker side: connect, declare, consume and relay; on any broker failure,
/// drop everything (unacked deliveries return to their queues) and reconnect
/// with capped, jittered backoff.
struct Session {
    contexts: Arc<Contexts>,
    signer: Arc<mesh_protocol::DeclarationSigner>,
    metrics: Metrics,
    settings: Settings,
    signal: OutboxSignal,
    broker_url: String,
    broker_up: Arc<AtomicBool>,
    /// Where the stats task publishes each reading of the broker's queues.
    queue_depths: watch::Sender<Option<QueueDepths>>,
    /// Logs requests publish on this session's channel (logs.rs).
    logs: Arc<crate::logs::LogsHub>,
}

impl Session {
    async fn run(self, shutdown: CancellationToken) {
        let queue_type = self.settings.queue_type().unwrap_or_default();
        let declaration_queues = Arc::new(DeclarationQueues::new(queue_type));
        let failpoint = std::env::var(FAILPOINT_ENV).ok();
        let mut attempt: u32 = 0;
        // The credentials' own endpoint (None), then each of
        // `broker_endpoints` (checked at start): a session that fails to
        // start or ends moves on to the next one, round-robin.
        let mut endpoints: Vec<Option<(String, u16)>> = vec![None];
        endpoints.extend(
            self.settings
                .broker_endpoint_list()
                .unwrap_or_default()
                .into_iter()
                .map(Some),
        );
        let mut at = 0usize;
        let url_endpoint = amqp::url_endpoint(&self.broker_url).unwrap_or_default();
        while !shutdown.is_cancelled() {
            let target = endpoints[at % endpoints.len()].clone();
            let endpoint = target
                .as_ref()
                .map(|(h, p)| format!("{h}:{p}"))
                .unwrap_or_else(|| url_endpoint.clone());
            match self
                .once(
                    &declaration_queues,
                    target.as_ref(),
                    &endpoint,
                    failpoint.clone(),
                    &shutdown,
                )
                .await
            {
                Ok(()) => attempt = 0,
                Err(e) => {
                    tracing::warn!(broker = %redact_url(&self.broker_url), %endpoint, error = %e, "broker session ended");
                    attempt = attempt.saturating_add(1);
                }
            }
            at = (at + 1) % endpoints.len();
            self.broker_up.store(false, Ordering::Relaxed);
            self.metrics.broker_connected.set(0);
            if shutdown.is_cancelled() {
                break;
            }
            let cap = Duration::from_millis(self.settings.reconnect_max_ms.max(200));
            let ceiling = Duration::from_millis(200)
                .saturating_mul(1 << attempt.min(16))
                .min(cap);
            let wait = rand::rng().random_range(Duration::ZERO..=ceiling);
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }

    async fn once(
        &self,
        declaration_queues: &Arc<DeclarationQueues>,
        target: Option<&(String, u16)>,
        endpoint: &str,
        failpoint: Option<String>,
        shutdown: &CancellationToken,
    ) -> Result<(), PipelineError> {
        let deadline = self.settings.connect_timeout();
        let conn = Arc::new(
            amqp::connect_to(
                &self.broker_url,
                target,
                Duration::from_secs(self.settings.amqp_heartbeat_secs),
                deadline,
            )
            .await?,
        );
        self.metrics.broker_connects.inc();
        // Report queues an older controller declared get today's arguments
        // (single-active-consumer) here, or are drained first (crate::upgrade).
        let queue_type = self.settings.queue_type().unwrap_or_default();
        // The start within the attempt's deadline: a broker that accepted the
        // connection and then stalls is given up, not waited on.
        let started = tokio::time::timeout(deadline, async {
            let upgrading = upgrade::prepare(&conn, queue_type).await?;
            let ch = conn.create_channel().await?;
            amqp::declare_topology(
                &ch,
                &self.contexts.record_subscriptions(),
                &upgrading,
                queue_type,
            )
            .await?;
            Ok::<_, lapin::Error>((upgrading, ch))
        })
        .await;
        let (upgrading, _topology) = match started {
            Ok(result) => result?,
            Err(_) => {
                mesh_amqp::close(&conn, "session start timed out", CLOSE_TIMEOUT).await;
                return Err(PipelineError::Cancelled(format!(
                    "the broker at {endpoint} did not declare the topology within {}s",
                    deadline.as_secs_f64()
                )));
            }
        };
        declaration_queues.clear();
        tracing::info!(broker = %redact_url(&self.broker_url), %endpoint, "broker session started");
        self.broker_up.store(true, Ordering::Relaxed);
        self.metrics.broker_connected.set(1);

        let session_end = shutdown.child_token();
        let pipeline = Arc::new(Pipeline {
            contexts: self.contexts.clone(),
            metrics: self.metrics.clone(),
            settings: self.settings.clone(),
            declaration_queues: declaration_queues.clone(),
            signal: self.signal.clone(),
            failpoint,
            logs: self.logs.clone(),
        });
        // Logs requests go out on a confirm channel of their own.
        self.logs.attach(Some(amqp::confirm_channel(&conn).await?));
        let mut tasks: JoinSet<Result<(), PipelineError>> = JoinSet::new();
        for kind in ReportKind::ALL {
            tasks.spawn(pipeline.clone().consume(
                conn.clone(),
                Source::Reports(kind),
                session_end.clone(),
            ));
        }
        // Reports no queue took (unknown kinds): dead-lettered, never lost.
        tasks.spawn(pipeline.clone().consume(
            conn.clone(),
            Source::Unroutable,
            session_end.clone(),
        ));
        for (context, patterns) in self.contexts.record_subscriptions() {
            if !patterns.is_empty() {
                tasks.spawn(pipeline.clone().consume(
                    conn.clone(),
                    Source::Record(context),
                    session_end.clone(),
                ));
            }
        }
        let relay = Arc::new(Relay {
            contexts: self.contexts.clone(),
            signer: self.signer.clone(),
            metrics: self.metrics.clone(),
            declaration_queues: declaration_queues.clone(),
            signal: self.signal.clone(),
            batch: self.settings.relay_batch,
            poll: self.settings.relay_poll(),
        });
        let relay_end = session_end.clone();
        let relay_conn = conn.clone();
        tasks.spawn(async move { Ok(relay.run(relay_conn, relay_end).await?) });
        // The depth of every queue consumed, and of the dead-letter queue.
        // Never ends the session: it returns only when the session ends.
        let stats_conn = conn.clone();
        let stats_end = session_end.clone();
        let queues = broker_stats::watched_queues(&self.contexts.record_subscriptions());
        let stats_metrics = self.metrics.clone();
        let stats_publish = self.queue_depths.clone();
        let stats_interval = self.settings.broker_stats_interval();
        tasks.spawn(async move {
            stats_end
                .clone()
                .run_until_cancelled(broker_stats::run(
                    stats_conn,
                    queues,
                    stats_interval,
                    stats_metrics,
                    stats_publish,
                    stats_end,
                ))
                .await;
            Ok(())
        });
        if !upgrading.is_empty() {
            let upgrade_conn = conn.clone();
            let upgrade_end = session_end.clone();
            tasks.spawn(async move {
                Ok(upgrade::wait_drained(&upgrade_conn, &upgrading, upgrade_end).await?)
            });
        }
        // Whether a report can reach the broker at all (a resource alarm
        // blocks every publisher while this session stays up): the probe
        // stops observation while it cannot. Never ends the session.
        let probe_end = session_end.clone();
        let probe_url = self.broker_url.clone();
        let probe_endpoint = target.cloned();
        let probe_heartbeat = Duration::from_secs(self.settings.amqp_heartbeat_secs);
        let probe_inventory = self.contexts.inventory.clone();
        let probe_metrics = self.metrics.clone();
        tasks.spawn(async move {
            let target = crate::probe::Target {
                url: &probe_url,
                endpoint: probe_endpoint.as_ref(),
                heartbeat: probe_heartbeat,
                connect_timeout: deadline,
            };
            crate::probe::run(target, probe_inventory, probe_metrics, probe_end).await;
            Ok(())
        });
        // Reports flow from now on: liveness may be judged after one full grace.
        self.contexts.inventory.observe_from(chrono::Utc::now());

        let first = tasks.join_next().await;
        self.logs.attach(None);
        self.contexts.inventory.observe_stop();
        session_end.cancel();
        // Every task heeds the cancel; one stuck on a stalled peer is aborted
        // after the shutdown deadline rather than holding the next session.
        let joined = tokio::time::timeout(
            Duration::from_secs(self.settings.shutdown_deadline_secs),
            async { while tasks.join_next().await.is_some() {} },
        )
        .await;
        if joined.is_err() {
            tracing::warn!(%endpoint, "session tasks did not end in time; aborted");
            tasks.shutdown().await;
        }
        mesh_amqp::close(&conn, "controller session ending", CLOSE_TIMEOUT).await;
        match first {
            Some(Ok(result)) => result,
            Some(Err(join)) => Err(PipelineError::Cancelled(format!(
                "a session task panicked: {join}"
            ))),
            None => Ok(()),
        }
    }
}

/// Keep `Connection` in the public surface used by tests.
pub type BrokerConnection = Connection;
