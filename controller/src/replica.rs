//! The read replica (docs/decisions/0041): each context that serves reads
//! that tolerate lag gets a [`Reads`] with its own pool and a pool on the
//! replica (`replica_host`, `replica_port`; the context's role, password and
//! database from its URL in the credentials file, so the replica needs no
//! credential of its own), and the replica clock ([`run`]) asks the replica
//! every `replica_check_ms` whether it is in recovery and how far behind it
//! is, which decides where those reads go, and puts what it found and the
//! reads served in the metrics.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use mesh_plumbing::reads::{ReadStats, Reads, ReplicaSettings, Target};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio_util::sync::CancellationToken;

use crate::config::{ConfigError, Credentials, Settings};
use crate::metrics::Metrics;

/// Where the replica is and how it is judged, and every context's reads
/// handed out (the clock checks each).
pub struct Replicas {
    at: Option<(String, u16)>,
    settings: ReplicaSettings,
    pool_size: u32,
    stats: Arc<ReadStats>,
    reads: Mutex<Vec<(&'static str, Reads)>>,
}

impl Replicas {
    /// From the controller's settings (none: every read on the primary).
    pub fn new(settings: &Settings) -> Replicas {
        Replicas {
            at: settings
                .replica_host
                .clone()
                .map(|host| (host, settings.replica_port)),
            settings: ReplicaSettings {
                max_lag: Duration::from_millis(settings.replica_max_lag_ms),
                timeout: Duration::from_millis(settings.replica_timeout_ms),
            },
            pool_size: settings.pool_size,
            stats: Arc::default(),
            reads: Mutex::new(Vec::new()),
        }
    }

    /// Whether a replica is configured.
    pub fn configured(&self) -> bool {
        self.at.is_some()
    }

    /// The reads of `context`, whose own pool is `primary`: on the replica
    /// too when one is configured (connected lazily: a replica that is not
    /// there yet only means reads go to the primary).
    pub fn reads_for(
        &self,
        creds: &Credentials,
        context: &'static str,
        primary: &PgPool,
    ) -> Result<Reads, ConfigError> {
        let mut reads = Reads::new(primary.clone()).with_stats(self.stats.clone());
        if let Some((host, port)) = &self.at {
            let url = creds.database(context)?;
            let options = Reads::replica_options(url.expose(), host, *port).map_err(|e| {
                ConfigError::Parse {
                    path: creds.path().to_owned(),
                    message: format!(
                        "databases.{context}: not a database URL the replica can be reached with: {e}"
                    ),
                }
            })?;
            let pool = PgPoolOptions::new()
                .max_connections(self.pool_size)
                .acquire_timeout(self.settings.timeout)
                .connect_lazy_with(options.application_name("mesh-controller-replica-reads"));
            reads = reads.with_replica(pool, self.settings);
        }
        self.reads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((context, reads.clone()));
        Ok(reads)
    }

    fn handed_out(&self) -> Vec<(&'static str, Reads)> {
        self.reads.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// The replica clock: every `every`, check the replica of every context that
/// reads from one, and put the replica's state and the reads served into the
/// metrics (served from the start, with or without a replica).
pub async fn run(
    replicas: Arc<Replicas>,
    metrics: Metrics,
    every: Duration,
    shutdown: CancellationToken,
) {
    let reads = replicas.handed_out();
    let mut counted = [0u64; 2];
    let mut was_usable: Option<bool> = None;
    let mut ticker = tokio::time::interval(every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = ticker.tick() => {}
        }
        if replicas.configured() {
            let mut usable = true;
            let mut lag = Some(Duration::ZERO);
            for (context, r) in &reads {
                match r.check().await {
                    None => continue,
                    Some(Ok(status)) => {
                        usable &= status.usable;
                        lag = lag.zip(status.lag).map(|(a, b)| a.max(b));
                        if !status.usable && was_usable != Some(false) {
                            tracing::warn!(context, in_recovery = status.in_recovery, lag = ?status.lag, "the replica is not usable: lag-tolerant reads go to the primary");
                        }
                    }
                    Some(Err(e)) => {
                        usable = false;
                        lag = None;
                        if was_usable != Some(false) {
                            tracing::warn!(context, error = %e, "the replica does not answer: lag-tolerant reads go to the primary");
                        }
                    }
                }
            }
            if usable && was_usable != Some(true) {
                tracing::info!(lag = ?lag, "the replica is usable: lag-tolerant reads go to it");
            }
            was_usable = Some(usable);
            metrics.replica_usable.set(i64::from(usable));
            metrics
                .replica_lag_seconds
                .set(lag.map_or(f64::NAN, |l| l.as_secs_f64()));
        }
        for (i, target) in Target::ALL.into_iter().enumerate() {
            let served = replicas.stats.served(target);
            metrics
                .replica_reads
                .get_or_create(&crate::metrics::TargetLabels {
                    target: target.as_str().to_owned(),
                })
                .inc_by(served.saturating_sub(counted[i]));
            counted[i] = served;
        }
    }
}
