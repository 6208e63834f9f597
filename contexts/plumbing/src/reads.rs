//! Reads that tolerate lag, served by a PostgreSQL streaming replica when it
//! is usable, else by the primary (docs/decisions/0041).
//!
//! A context holds one [`Reads`]: its primary pool (the one it writes
//! through) and, when the controller is given a replica, a pool on the
//! replica with the same role and database. [`Reads::lag_tolerant`] runs a
//! read on the replica while the last [`Reads::check`] found it usable (in
//! recovery, and its lag within the bound), and again on the primary when the
//! replica fails it (refused, timed out, any error): the answer is the
//! primary's then, never an error of the replica's. A failed read also marks
//! the replica unusable until the next check finds it well, so one outage
//! costs one failed attempt, not one per request. Writes never touch it:
//! [`Reads::primary`] is the only pool a transaction is opened on.
//!
//! Lag, as [`Reads::check`] reads it on the replica: zero while a WAL
//! receiver streams from the primary and everything received is replayed
//! (`pg_last_wal_replay_lsn() >= pg_last_wal_receive_lsn()`: an idle primary
//! sends nothing, and the replica is as new as it); else the age of the last
//! transaction replayed (`now() - pg_last_xact_replay_timestamp()`), which
//! grows while the replica is cut off from its primary. Unknown (nothing
//! replayed yet and not caught up) is unusable.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgConnectOptions;
use thiserror::Error;

/// Where a read was served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    Replica,
    Primary,
}

impl Target {
    pub const ALL: [Target; 2] = [Target::Replica, Target::Primary];

    /// The metric label: `replica` or `primary`.
    pub fn as_str(self) -> &'static str {
        match self {
            Target::Replica => "replica",
            Target::Primary => "primary",
        }
    }
}

/// Lag-tolerant reads served, by target: shared by every context's [`Reads`]
/// that was given the same one (the controller's metrics read it).
#[derive(Debug, Default)]
pub struct ReadStats {
    replica: AtomicU64,
    primary: AtomicU64,
}

impl ReadStats {
    /// Reads served by `target` so far.
    pub fn served(&self, target: Target) -> u64 {
        self.counter(target).load(Ordering::Relaxed)
    }

    fn counter(&self, target: Target) -> &AtomicU64 {
        match target {
            Target::Replica => &self.replica,
            Target::Primary => &self.primary,
        }
    }

    fn count(&self, target: Target) {
        self.counter(target).fetch_add(1, Ordering::Relaxed);
    }
}

/// How a replica is judged and waited for.
#[derive(Debug, Clone, Copy)]
pub struct ReplicaSettings {
    /// Largest lag at which reads go to the replica.
    pub max_lag: Duration,
    /// Longest a read (or a check) may take on the replica before it is
    /// given up (and the read runs on the primary).
    pub timeout: Duration,
}

/// Why a check of the replica found nothing.
#[derive(Debug, Error)]
pub enum ReplicaError {
    #[error("the replica did not answer within {0:?}")]
    TimedOut(Duration),
    #[error("the replica: {0}")]
    Database(#[from] sqlx::Error),
}

/// What a check of the replica found.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReplicaStatus {
    /// `pg_is_in_recovery()`: false for a promoted replica (a primary of its
    /// own, whose data diverges: never read from).
    pub in_recovery: bool,
    /// How far it is behind the primary (none: unknown).
    pub lag: Option<Duration>,
    /// In recovery and its lag known and within the bound.
    pub usable: bool,
}

impl ReplicaStatus {
    /// Judge what the replica answered: `streaming` (a WAL receiver runs),
    /// `caught_up` (replayed everything received), `age_secs` (of the last
    /// transaction replayed; none when nothing was replayed since it started).
    pub fn judge(
        in_recovery: bool,
        streaming: bool,
        caught_up: bool,
        age_secs: Option<f64>,
        max_lag: Duration,
    ) -> ReplicaStatus {
        let lag = if streaming && caught_up {
            Some(Duration::ZERO)
        } else {
            age_secs.map(|s| Duration::try_from_secs_f64(s.max(0.0)).unwrap_or(Duration::MAX))
        };
        ReplicaStatus {
            in_recovery,
            lag,
            usable: in_recovery && lag.is_some_and(|l| l <= max_lag),
        }
    }
}

/// The replica of one context: its pool and what the last check found.
#[derive(Debug)]
struct Replica {
    pool: PgPool,
    settings: ReplicaSettings,
    usable: AtomicBool,
    /// Lag of the last check in milliseconds; `u64::MAX`: unknown.
    lag_ms: AtomicU64,
}

/// A context's reads: the primary, and a replica for what tolerates lag.
/// Cheap to clone (pools and state are shared).
#[derive(Debug, Clone)]
pub struct Reads {
    primary: PgPool,
    replica: Option<Arc<Replica>>,
    stats: Arc<ReadStats>,
}

const CHECK_SQL: &str = "SELECT pg_is_in_recovery(), \
     EXISTS (SELECT 1 FROM pg_stat_wal_receiver), \
     COALESCE(pg_last_wal_replay_lsn() >= pg_last_wal_receive_lsn(), false), \
     EXTRACT(EPOCH FROM now() - pg_last_xact_replay_timestamp())::float8";

impl Reads {
    /// Reads on `primary` only (no replica).
    pub fn new(primary: PgPool) -> Reads {
        Reads {
            primary,
            replica: None,
            stats: Arc::default(),
        }
    }

    /// Count into `stats` (shared with other contexts' reads).
    pub fn with_stats(mut self, stats: Arc<ReadStats>) -> Reads {
        self.stats = stats;
        self
    }

    /// Serve lag-tolerant reads from `pool` (the same role and database on
    /// the replica) once a [`Reads::check`] found it usable.
    pub fn with_replica(mut self, pool: PgPool, settings: ReplicaSettings) -> Reads {
        self.replica = Some(Arc::new(Replica {
            pool,
            settings,
            usable: AtomicBool::new(false),
            lag_ms: AtomicU64::new(u64::MAX),
        }));
        self
    }

    /// The connection options of a context's database URL (`primary_url`:
    /// role, password, database, options) on the replica at `host`:`port`.
    /// The role's password comes from the URL, so a replica needs no
    /// credential of its own.
    pub fn replica_options(
        primary_url: &str,
        host: &str,
        port: u16,
    ) -> Result<PgConnectOptions, sqlx::Error> {
        let options: PgConnectOptions = primary_url.parse()?;
        Ok(options.host(host).port(port))
    }

    /// The primary: every write, and every read that must see the latest.
    pub fn primary(&self) -> &PgPool {
        &self.primary
    }

    /// The replica's pool, if one is configured.
    pub fn replica(&self) -> Option<&PgPool> {
        self.replica.as_ref().map(|r| &r.pool)
    }

    /// Whether lag-tolerant reads go to the replica now.
    pub fn usable(&self) -> bool {
        self.replica
            .as_ref()
            .is_some_and(|r| r.usable.load(Ordering::Relaxed))
    }

    /// The replica's lag at the last check (none: no replica, or unknown).
    pub fn lag(&self) -> Option<Duration> {
        let ms = self.replica.as_ref()?.lag_ms.load(Ordering::Relaxed);
        (ms != u64::MAX).then(|| Duration::from_millis(ms))
    }

    /// The reads served so far, by target.
    pub fn stats(&self) -> &ReadStats {
        &self.stats
    }

    /// Ask the replica whether it is in recovery and how far behind it is,
    /// and mark it usable or not for the reads that follow (none: no
    /// replica). A replica that does not answer is unusable.
    pub async fn check(&self) -> Option<Result<ReplicaStatus, ReplicaError>> {
        let replica = self.replica.as_ref()?;
        let settings = replica.settings;
        let asked = tokio::time::timeout(
            settings.timeout,
            sqlx::query_as::<_, (bool, bool, bool, Option<f64>)>(CHECK_SQL)
                .fetch_one(&replica.pool),
        )
        .await;
        let status = match asked {
            Ok(Ok((in_recovery, streaming, caught_up, age))) => Ok(ReplicaStatus::judge(
                in_recovery,
                streaming,
                caught_up,
                age,
                settings.max_lag,
            )),
            Ok(Err(e)) => Err(ReplicaError::Database(e)),
            Err(_) => Err(ReplicaError::TimedOut(settings.timeout)),
        };
        let (usable, lag) = match &status {
            Ok(s) => (s.usable, s.lag),
            Err(_) => (false, None),
        };
        replica.usable.store(usable, Ordering::Relaxed);
        replica.lag_ms.store(
            lag.map_or(u64::MAX, |l| {
                u64::try_from(l.as_millis()).unwrap_or(u64::MAX - 1)
            }),
            Ordering::Relaxed,
        );
        Some(status)
    }

    /// Run a read that tolerates the replica's lag: on the replica while it
    /// is usable, else (or when the replica fails it) on the primary. `read`
    /// is handed the pool to run on and may be called twice; it must only
    /// read.
    pub async fn lag_tolerant<T, F, Fut>(&self, read: F) -> Result<T, sqlx::Error>
    where
        F: Fn(PgPool) -> Fut,
        Fut: Future<Output = Result<T, sqlx::Error>>,
    {
        self.lag_tolerant_if(|_| async { Ok(true) }, read).await
    }

    /// [`Reads::lag_tolerant`] for a read the replica can answer only once
    /// it holds something the caller was promised (replayed past a horizon):
    /// `ready`, asked on the replica first, says whether it does. Not ready
    /// says nothing of the replica's health: this read goes to the primary
    /// and the replica stays usable for the next.
    pub async fn lag_tolerant_if<T, R, RFut, F, Fut>(
        &self,
        ready: R,
        read: F,
    ) -> Result<T, sqlx::Error>
    where
        R: Fn(PgPool) -> RFut,
        RFut: Future<Output = Result<bool, sqlx::Error>>,
        F: Fn(PgPool) -> Fut,
        Fut: Future<Output = Result<T, sqlx::Error>>,
    {
        if let Some(replica) = self.replica.as_ref()
            && replica.usable.load(Ordering::Relaxed)
        {
            let pool = replica.pool.clone();
            let on_replica = async {
                if !ready(pool.clone()).await? {
                    return Ok(None);
                }
                read(pool).await.map(Some)
            };
            match tokio::time::timeout(replica.settings.timeout, on_replica).await {
                Ok(Ok(Some(answer))) => {
                    self.stats.count(Target::Replica);
                    return Ok(answer);
                }
                Ok(Ok(None)) => {
                    tracing::debug!(
                        "the replica has not replayed what this read needs: served by the primary"
                    );
                }
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "a read on the replica failed: served by the primary, the replica unused until its next check");
                    replica.usable.store(false, Ordering::Relaxed);
                }
                Err(_) => {
                    tracing::warn!(timeout = ?replica.settings.timeout, "a read on the replica timed out: served by the primary, the replica unused until its next check");
                    replica.usable.store(false, Ordering::Relaxed);
                }
            }
        }
        let answer = read(self.primary.clone()).await?;
        self.stats.count(Target::Primary);
        Ok(answer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sqlx::postgres::PgPoolOptions;

    const BOUND: Duration = Duration::from_secs(5);

    #[test]
    fn judged_by_recovery_and_lag() {
        let j = ReplicaStatus::judge;
        // Streaming and caught up: as new as the primary, however old its
        // last transaction.
        let s = j(true, true, true, Some(3600.0), BOUND);
        assert_eq!(s.lag, Some(Duration::ZERO));
        assert!(s.usable);
        // Behind: the age of what it replayed last.
        let s = j(true, true, false, Some(1.5), BOUND);
        assert_eq!(s.lag, Some(Duration::from_millis(1500)));
        assert!(s.usable);
        assert!(!j(true, true, false, Some(6.0), BOUND).usable);
        // Cut off from its primary: "caught up" with nothing says nothing.
        let s = j(true, false, true, Some(60.0), BOUND);
        assert_eq!(s.lag, Some(Duration::from_secs(60)));
        assert!(!s.usable);
        // Unknown lag, a promoted replica, a clock behind.
        assert!(!j(true, true, false, None, BOUND).usable);
        assert!(!j(false, true, true, Some(0.0), BOUND).usable);
        assert_eq!(
            j(true, true, false, Some(-0.2), BOUND).lag,
            Some(Duration::ZERO)
        );
    }

    #[test]
    fn replica_options_keep_the_role_and_database() {
        let o = Reads::replica_options("postgres://inv:pw@10.0.0.1:5432/mesh", "127.0.0.1", 5433)
            .unwrap();
        assert_eq!(o.get_host(), "127.0.0.1");
        assert_eq!(o.get_port(), 5433);
        assert_eq!(o.get_username(), "inv");
        assert_eq!(o.get_database(), Some("mesh"));
        assert!(Reads::replica_options("not a url", "h", 1).is_err());
    }

    fn local() -> PgPool {
        PgPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(Duration::from_secs(5))
            .connect_lazy("postgres://postgres@127.0.0.1:5432/postgres")
            .unwrap()
    }

    const SETTINGS: ReplicaSettings = ReplicaSettings {
        max_lag: BOUND,
        timeout: Duration::from_secs(5),
    };

    async fn which(reads: &Reads) -> Result<bool, sqlx::Error> {
        reads
            .lag_tolerant(|pool| async move {
                sqlx::query_scalar::<_, bool>("SELECT pg_is_in_recovery()")
                    .fetch_one(&pool)
                    .await
            })
            .await
    }

    #[tokio::test]
    async fn a_server_not_in_recovery_is_never_read_from() {
        // The machine's own primary given as the "replica".
        let reads = Reads::new(local()).with_replica(local(), SETTINGS);
        assert!(!reads.usable(), "unusable until checked");
        let status = reads.check().await.unwrap().unwrap();
        assert!(!status.in_recovery && !status.usable, "{status:?}");
        assert!(!reads.usable());
        assert!(!which(&reads).await.unwrap());
        assert_eq!(reads.stats().served(Target::Primary), 1);
        assert_eq!(reads.stats().served(Target::Replica), 0);
        assert!(Reads::new(local()).check().await.is_none(), "no replica");
    }

    #[tokio::test]
    async fn a_replica_that_refuses_is_unusable_and_the_primary_answers() {
        // A port nothing listens on: bind one, then let it go.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port();
        let options = Reads::replica_options(
            "postgres://postgres@127.0.0.1:5432/postgres",
            "127.0.0.1",
            port,
        )
        .unwrap();
        let replica = PgPoolOptions::new()
            .acquire_timeout(Duration::from_secs(2))
            .connect_lazy_with(options);
        let stats = Arc::new(ReadStats::default());
        let reads = Reads::new(local())
            .with_stats(stats.clone())
            .with_replica(replica, SETTINGS);
        let checked = reads.check().await.unwrap();
        assert!(checked.is_err(), "{checked:?}");
        assert!(!reads.usable());
        assert_eq!(reads.lag(), None);
        assert!(!which(&reads).await.unwrap());
        assert_eq!(stats.served(Target::Primary), 1);
        // Usable at its last check, gone since: the read it fails runs again
        // on the primary, and the replica is not tried again until checked.
        if let Some(r) = &reads.replica {
            r.usable.store(true, Ordering::Relaxed);
        }
        assert!(!which(&reads).await.unwrap());
        assert!(!reads.usable());
        assert_eq!(stats.served(Target::Primary), 2);
        assert_eq!(stats.served(Target::Replica), 0);
    }
}
