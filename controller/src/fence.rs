//! One controller, fenced (docs/decisions/0017-one-controller-fenced.md).
//!
//! The controller is assigned, never elected; this makes a second instance,
//! started by mistake with the same credentials, refuse to run. The fence is a
//! PostgreSQL session advisory lock on the mesh database, taken on a dedicated
//! connection (never a pooled one, which a pool may close or recycle) before the
//! controller does anything else: before migrations, before the API, before any
//! broker connection. The lock lives exactly as long as that session: a graceful
//! stop releases it last; a killed process's socket closes and PostgreSQL ends
//! the session at once; a vanished host's session ends when the server's TCP
//! keepalives (set on this session: [`KEEPALIVE_OPTIONS`]) give up.
//!
//! The holder names itself in the session's `application_name`
//! (`mesh-controller pid=<pid> host=<host>`); a refused instance reads it, with
//! the session's `backend_start` (when the fence was taken) and `client_addr`,
//! from `pg_locks` joined with `pg_stat_activity`. It writes no table at all.
//!
//! Guarantees: while [`Fence::hold`] runs, at most one controller per database
//! holds the lock. If the lock's session is lost while the controller runs (a
//! database restart, the session terminated), the controller takes the lock
//! again at once; if another controller took it in between, it stops (the
//! process exits non-zero) instead of going on acting as the holder.

use std::fmt;
use std::time::Duration;

use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection};
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

/// The advisory lock's key: "mesh" in the high 32 bits, 1 in the low ones. In
/// `pg_locks` a bigint key shows as `classid` = high, `objid` = low, `objsubid` = 1.
pub const LOCK_KEY: i64 = 0x6d65_7368_0000_0001;
const LOCK_CLASSID: i64 = LOCK_KEY >> 32;
const LOCK_OBJID: i64 = LOCK_KEY & 0xffff_ffff;

/// The prefix of the holder's `application_name`.
pub const APPLICATION_NAME_PREFIX: &str = "mesh-controller";

/// Server-side settings of the lock's session: the server probes an idle peer
/// after 10 s, every 5 s, and drops it after 3 unanswered probes; data it sent
/// and that stays unacknowledged for 30 s drops it too. So the lock of a
/// controller whose host vanished is released within about 30 s, instead of the
/// operating system's default of over two hours. `idle_session_timeout` and
/// `statement_timeout` are switched off for this session whatever the
/// database's defaults: the session is idle by design.
pub const KEEPALIVE_OPTIONS: [(&str, &str); 6] = [
    ("tcp_keepalives_idle", "10"),
    ("tcp_keepalives_interval", "5"),
    ("tcp_keepalives_count", "3"),
    ("tcp_user_timeout", "30000"),
    ("idle_session_timeout", "0"),
    ("statement_timeout", "0"),
];

/// How often the holder checks its lock's session, and how long a check may take.
const PING_EVERY: Duration = Duration::from_secs(1);
const PING_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a holder that lost its session tries to take the lock again.
const RETAKE_EVERY: Duration = Duration::from_millis(500);

/// How long a starting controller waits for the session of a holder that no
/// longer runs on this host to end (a restart right after a crash).
const STALE_WAIT: Duration = Duration::from_secs(30);

/// PostgreSQL keeps at most 63 bytes of `application_name`, printable ASCII.
const APPLICATION_NAME_MAX: usize = 63;

#[derive(Debug, thiserror::Error)]
pub enum FenceError {
    #[error(
        "another controller is running: {0}. This one stops before touching anything \
         (no migration, no broker connection, no API). Stop that one first, or, if its \
         host is gone, wait until PostgreSQL drops its session (about 30 s; see \
         docs/decisions/0017-one-controller-fenced.md)"
    )]
    Held(Holder),
    #[error(
        "the controller fence was lost and another controller took it: {0}. This one \
         stops instead of going on as a second controller"
    )]
    TakenOver(Holder),
    #[error("taking the controller fence (advisory lock on the mesh database): {0}")]
    Database(#[from] sqlx::Error),
    #[error("the database URL for the controller fence is invalid: {0}")]
    Url(sqlx::Error),
}

/// The controller holding the fence, as PostgreSQL shows it.
#[derive(Debug, Clone, Default)]
pub struct Holder {
    /// `application_name` of the holding session, verbatim.
    pub application_name: String,
    /// The holder's host and process id, parsed from `application_name`.
    pub host: Option<String>,
    pub pid: Option<u32>,
    /// When the holding session started, i.e. since when it holds the fence.
    pub since: Option<chrono::DateTime<chrono::Utc>>,
    /// The address the holder connects from.
    pub client_addr: Option<String>,
    /// The PostgreSQL backend serving the holder (for `pg_terminate_backend`).
    pub backend_pid: Option<i32>,
    /// False when the lock was free again by the time it was looked up.
    pub found: bool,
}

impl Holder {
    /// True when the holder named this host and its process is not running
    /// here any more (no `mesh-controller` process with its pid).
    fn is_dead_on(&self, host: &str) -> bool {
        let Some(pid) = self.pid else {
            return false;
        };
        if application_name(pid, host) != self.application_name || pid == std::process::id() {
            return false;
        }
        match std::fs::read_to_string(format!("/proc/{pid}/comm")) {
            Ok(comm) => !comm.trim().starts_with(APPLICATION_NAME_PREFIX),
            Err(e) => e.kind() == std::io::ErrorKind::NotFound,
        }
    }
}

impl fmt::Display for Holder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.found {
            return write!(
                f,
                "a controller held the fence a moment ago and has released it since (start again)"
            );
        }
        let unknown = || "unknown".to_owned();
        write!(
            f,
            "host={} pid={} since={}",
            self.host.clone().unwrap_or_else(unknown),
            self.pid.map(|p| p.to_string()).unwrap_or_else(unknown),
            self.since
                .map(|s| s.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
                .unwrap_or_else(unknown),
        )?;
        if let Some(addr) = &self.client_addr {
            write!(f, " (connected from {addr}")?;
            if let Some(b) = self.backend_pid {
                write!(f, ", database backend pid {b}")?;
            }
            write!(f, ")")?;
        }
        if self.host.is_none() {
            write!(f, " application_name={:?}", self.application_name)?;
        }
        Ok(())
    }
}

/// This process's name in `application_name`, as PostgreSQL will store it
/// (printable ASCII, at most 63 bytes): `mesh-controller pid=<pid> host=<host>`.
pub fn application_name(pid: u32, host: &str) -> String {
    let full = format!("{APPLICATION_NAME_PREFIX} pid={pid} host={host}");
    full.chars()
        .map(|c| if (' '..='~').contains(&c) { c } else { '?' })
        .take(APPLICATION_NAME_MAX)
        .collect()
}

/// Parse `application_name` back into (pid, host); None if it is not ours.
fn parse_application_name(name: &str) -> (Option<u32>, Option<String>) {
    let Some(rest) = name.strip_prefix(APPLICATION_NAME_PREFIX) else {
        return (None, None);
    };
    let mut pid = None;
    let mut host = None;
    for word in rest.split_whitespace() {
        if let Some(p) = word.strip_prefix("pid=") {
            pid = p.parse().ok();
        } else if let Some(h) = word.strip_prefix("host=") {
            host = Some(h.to_owned());
        }
    }
    (pid, host)
}

/// This machine's host name (Linux), else `$HOSTNAME`, else `unknown`.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown".to_owned())
}

/// application_name, backend_start, client_addr, backend pid.
type HolderRow = (
    Option<String>,
    Option<chrono::DateTime<chrono::Utc>>,
    Option<String>,
    i32,
);

/// Who holds the fence now, as the database shows it.
pub async fn holder(conn: &mut PgConnection) -> Result<Holder, sqlx::Error> {
    let row: Option<HolderRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT a.application_name, a.backend_start, host(a.client_addr), l.pid \
         FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
         WHERE l.locktype = 'advisory' AND l.granted \
           AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
           AND l.classid = {LOCK_CLASSID} AND l.objid = {LOCK_OBJID} AND l.objsubid = 1 \
         LIMIT 1"
    )))
    .fetch_optional(conn)
    .await?;
    Ok(match row {
        None => Holder::default(),
        Some((name, since, client_addr, backend_pid)) => {
            let name = name.unwrap_or_default();
            let (pid, host) = parse_application_name(&name);
            Holder {
                application_name: name,
                host,
                pid,
                since,
                client_addr,
                backend_pid: Some(backend_pid),
                found: true,
            }
        }
    })
}

/// The fence, held for the life of the process.
pub struct Fence {
    options: PgConnectOptions,
    me: String,
    /// The session holding the lock; None while it is being taken again.
    conn: Mutex<Option<PgConnection>>,
}

impl Fence {
    /// Take the fence on the database `url` (a context role's URL on the mesh
    /// database: advisory locks belong to a database, not to a role), or say
    /// who holds it.
    pub async fn take(url: &str) -> Result<Fence, FenceError> {
        let me = application_name(std::process::id(), &hostname());
        let options: PgConnectOptions = url.parse().map_err(FenceError::Url)?;
        let options = options.application_name(&me).options(KEEPALIVE_OPTIONS);
        let host = hostname();
        let started = std::time::Instant::now();
        loop {
            let holder = match try_take(&options).await? {
                Ok(conn) => {
                    tracing::info!(application_name = %me, "controller fence taken");
                    return Ok(Fence {
                        options,
                        me,
                        conn: Mutex::new(Some(conn)),
                    });
                }
                Err(holder) => holder,
            };
            // A holder that has gone (released between our try and the look-up,
            // or a controller of this host that no longer runs, whose session
            // PostgreSQL has not ended yet: a restart right after a crash) is
            // waited for, briefly; a live one is refused at once.
            let gone = !holder.found || holder.is_dead_on(&host);
            if !gone || started.elapsed() >= STALE_WAIT {
                return Err(FenceError::Held(holder));
            }
            tracing::info!(%holder, "the fence's holder no longer runs; waiting for PostgreSQL to end its session");
            tokio::time::sleep(RETAKE_EVERY).await;
        }
    }

    /// This process's `application_name` on the lock's session.
    pub fn me(&self) -> &str {
        &self.me
    }

    /// Watch the lock's session until `shutdown`. When it is lost, take the lock
    /// again; if another controller holds it by then, return
    /// [`FenceError::TakenOver`]: the caller must stop acting at once.
    pub async fn hold(&self, shutdown: CancellationToken) -> Result<(), FenceError> {
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                _ = tokio::time::sleep(PING_EVERY) => {}
            }
            let mut guard = self.conn.lock().await;
            let alive = match guard.as_mut() {
                Some(conn) => matches!(
                    tokio::time::timeout(PING_TIMEOUT, conn.ping()).await,
                    Ok(Ok(()))
                ),
                None => false,
            };
            if alive {
                continue;
            }
            tracing::warn!(
                "the controller fence's database session was lost; taking the fence again"
            );
            // Dropping closes our end; if the old session still lives on the
            // server, it still holds the lock for us (see below).
            *guard = None;
            loop {
                let attempt = tokio::time::timeout(PING_TIMEOUT, try_take(&self.options)).await;
                match attempt.unwrap_or_else(|_| {
                    Err(sqlx::Error::Io(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "no answer from the database within 5 s",
                    )))
                }) {
                    Ok(Ok(conn)) => {
                        tracing::info!(application_name = %self.me, "controller fence taken again");
                        *guard = Some(conn);
                        break;
                    }
                    // Our own old session, not yet gone on the server: nobody
                    // else can hold the lock meanwhile; wait for it to end.
                    Ok(Err(holder)) if holder.application_name == self.me => {
                        tracing::debug!("the fence is still held by our previous session");
                    }
                    Ok(Err(holder)) if holder.found => {
                        tracing::error!(%holder, "another controller took the fence");
                        return Err(FenceError::TakenOver(holder));
                    }
                    Ok(Err(_)) => {}
                    Err(e) => {
                        tracing::debug!(error = %e, "cannot take the fence again yet");
                    }
                }
                tokio::select! {
                    _ = shutdown.cancelled() => return Ok(()),
                    _ = tokio::time::sleep(RETAKE_EVERY) => {}
                }
            }
        }
    }

    /// Release the fence: the last thing a graceful stop does.
    pub async fn release(&self) {
        if let Some(mut conn) = self.conn.lock().await.take() {
            let _ = sqlx::query("SELECT pg_advisory_unlock($1)")
                .bind(LOCK_KEY)
                .execute(&mut conn)
                .await;
            let _ = conn.close().await;
            tracing::info!("controller fence released");
        }
    }
}

/// Connect and try the lock once: the holding connection, or who holds it.
async fn try_take(options: &PgConnectOptions) -> Result<Result<PgConnection, Holder>, sqlx::Error> {
    let mut conn = PgConnection::connect_with(options).await?;
    let taken: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
        .bind(LOCK_KEY)
        .fetch_one(&mut conn)
        .await?;
    if taken {
        return Ok(Ok(conn));
    }
    let holder = holder(&mut conn).await;
    let _ = conn.close().await;
    Ok(Err(holder?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lock_key_reads_as_pg_locks_shows_it() {
        assert_eq!(LOCK_CLASSID, 0x6d65_7368);
        assert_eq!(LOCK_OBJID, 1);
    }

    #[test]
    fn application_name_fits_and_parses_back() {
        let name = application_name(4242, "ctl-1.example.org");
        assert_eq!(name, "mesh-controller pid=4242 host=ctl-1.example.org");
        assert_eq!(
            parse_application_name(&name),
            (Some(4242), Some("ctl-1.example.org".to_owned()))
        );
        let long = application_name(4_194_304, &"h".repeat(100));
        assert_eq!(long.len(), APPLICATION_NAME_MAX);
        assert_eq!(parse_application_name(&long).0, Some(4_194_304));
        assert_eq!(
            application_name(1, "hôte"),
            "mesh-controller pid=1 host=h?te"
        );
        assert_eq!(parse_application_name("psql"), (None, None));
    }

    #[test]
    fn a_holder_of_this_host_is_dead_only_when_its_process_is_gone() {
        let of = |pid: u32, host: &str| Holder {
            application_name: application_name(pid, host),
            pid: Some(pid),
            host: Some(host.to_owned()),
            found: true,
            ..Holder::default()
        };
        // No process has pid 2^22 + 1 (above Linux's pid_max limit).
        assert!(of(4_194_305, "here").is_dead_on("here"));
        assert!(!of(4_194_305, "there").is_dead_on("here"));
        // This very process never is.
        assert!(!of(std::process::id(), "here").is_dead_on("here"));
    }

    #[test]
    fn a_holder_is_named_with_host_pid_and_since() {
        let h = Holder {
            application_name: "mesh-controller pid=7 host=a".into(),
            host: Some("a".into()),
            pid: Some(7),
            since: chrono::DateTime::from_timestamp(1_800_000_000, 0),
            client_addr: Some("10.0.0.1".into()),
            backend_pid: Some(99),
            found: true,
        };
        assert_eq!(
            h.to_string(),
            "host=a pid=7 since=2027-01-15T08:00:00Z (connected from 10.0.0.1, database backend pid 99)"
        );
    }
}
