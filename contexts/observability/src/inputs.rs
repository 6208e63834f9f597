//! What observability learns, recorded as it arrives: the nodes' reports
//! (probe results, units, broker outages) and the record (nodes, modules,
//! fleet conditions, certificates). Deriving health and alerts from them is
//! [`crate::evaluate`]'s, on its own clock.

use std::collections::BTreeMap;

use mesh_protocol::{Envelope, Health, Outage, RecordEvent, RecordKind, Report, Units};
use sqlx::PgConnection;

use crate::Error;

/// A node's `seq` as PostgreSQL's `bigint` (a seq past `i64::MAX` is kept as
/// the largest: it only orders reports).
fn seq(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// Record a batch of reports: the newest health and units report of each
/// node (by its `seq`; an older one arriving late changes nothing), and every
/// outage a hello states.
pub(crate) async fn reports(
    tx: &mut PgConnection,
    reports: &[Envelope<Report>],
) -> Result<(), Error> {
    let mut health: BTreeMap<&str, (u64, &Health)> = BTreeMap::new();
    let mut units: BTreeMap<&str, (u64, &Units)> = BTreeMap::new();
    let mut outages: Vec<(&str, &Outage)> = Vec::new();
    for env in reports {
        let node = env.node.as_str();
        match &env.body {
            Report::Health(h) => newest(&mut health, node, env.seq, h),
            Report::Units(u) => newest(&mut units, node, env.seq, u),
            Report::Hello(h) => {
                if let Some(o) = &h.outage {
                    outages.push((node, o));
                }
            }
            Report::Heartbeat(_)
            | Report::Applied(_)
            | Report::Certificates(_)
            | Report::Logs(_)
            | Report::Resources(_) => {}
        }
    }
    for (node, (n, h)) in health {
        record_health(tx, node, n, h).await?;
    }
    for (node, (n, u)) in units {
        record_units(tx, node, n, u).await?;
    }
    for (node, o) in outages {
        sqlx::query(
            "INSERT INTO observability.outages (node, since, seconds, buffered, dropped) \
             VALUES ($1, $2, $3, $4, $5) ON CONFLICT (node, since) DO NOTHING",
        )
        .bind(node)
        .bind(o.since)
        .bind(seq(o.seconds))
        .bind(seq(o.buffered))
        .bind(seq(o.dropped))
        .execute(&mut *tx)
        .await?;
    }
    Ok(())
}

fn newest<'a, T>(map: &mut BTreeMap<&'a str, (u64, &'a T)>, node: &'a str, n: u64, body: &'a T) {
    let entry = map.entry(node).or_insert((n, body));
    if n >= entry.0 {
        *entry = (n, body);
    }
}

/// Is `n` newer than the node's last report of `kind`? Records it if so.
async fn fresh(tx: &mut PgConnection, node: &str, kind: &str, n: u64) -> Result<bool, Error> {
    let fresh: Option<String> = sqlx::query_scalar(
        "INSERT INTO observability.report_seqs AS r (node, kind, seq) VALUES ($1, $2, $3) \
         ON CONFLICT (node, kind) DO UPDATE SET seq = excluded.seq, reported_at = now() \
         WHERE r.seq < excluded.seq RETURNING node",
    )
    .bind(node)
    .bind(kind)
    .bind(seq(n))
    .fetch_optional(&mut *tx)
    .await?;
    Ok(fresh.is_some())
}

/// A node's probe results, whole: the probes it no longer lists are gone; a
/// state that changed is appended to the history.
async fn record_health(tx: &mut PgConnection, node: &str, n: u64, h: &Health) -> Result<(), Error> {
    if !fresh(tx, node, "health", n).await? {
        return Ok(());
    }
    let len = h.probes.len();
    let (
        mut units,
        mut probes,
        mut modules,
        mut states,
        mut since,
        mut checked,
        mut failures,
        mut details,
    ) = (
        Vec::with_capacity(len),
        Vec::with_capacity(len),
        Vec::with_capacity(len),
        Vec::with_capacity(len),
        Vec::with_capacity(len),
        Vec::with_capacity(len),
        Vec::with_capacity(len),
        Vec::with_capacity(len),
    );
    for p in &h.probes {
        units.push(p.unit.as_str());
        probes.push(p.probe.as_str());
        modules.push(p.module.as_str());
        states.push(p.state.as_str());
        since.push(p.since);
        checked.push(p.checked_at);
        failures.push(i64::from(p.failures));
        details.push(p.detail.as_deref());
    }
    // History first: the rows whose state differs from the one stored (or new).
    sqlx::query(
        "INSERT INTO observability.probe_history (node, unit, probe, module, state, detail, at) \
         SELECT $1, u.unit, u.probe, u.module, u.state, u.detail, u.since \
         FROM UNNEST($2::text[], $3::text[], $4::text[], $5::text[], $6::timestamptz[], $7::text[]) \
              AS u(unit, probe, module, state, since, detail) \
         LEFT JOIN observability.probes p ON p.node = $1 AND p.unit = u.unit AND p.probe = u.probe \
         WHERE p.state IS DISTINCT FROM u.state",
    )
    .bind(node)
    .bind(&units)
    .bind(&probes)
    .bind(&modules)
    .bind(&states)
    .bind(&since)
    .bind(&details)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "DELETE FROM observability.probes p WHERE p.node = $1 AND NOT EXISTS \
         (SELECT 1 FROM UNNEST($2::text[], $3::text[]) AS u(unit, probe) \
          WHERE u.unit = p.unit AND u.probe = p.probe)",
    )
    .bind(node)
    .bind(&units)
    .bind(&probes)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "INSERT INTO observability.probes AS p (node, unit, probe, module, state, since, checked_at, failures, detail) \
         SELECT DISTINCT ON (u.unit, u.probe) $1, u.unit, u.probe, u.module, u.state, u.since, u.checked, u.failures, u.detail \
         FROM UNNEST($2::text[], $3::text[], $4::text[], $5::text[], $6::timestamptz[], \
                     $7::timestamptz[], $8::bigint[], $9::text[]) \
              AS u(unit, probe, module, state, since, checked, failures, detail) \
         ON CONFLICT (node, unit, probe) DO UPDATE SET module = excluded.module, state = excluded.state, \
             since = excluded.since, checked_at = excluded.checked_at, failures = excluded.failures, \
             detail = excluded.detail",
    )
    .bind(node)
    .bind(&units)
    .bind(&probes)
    .bind(&modules)
    .bind(&states)
    .bind(&since)
    .bind(&checked)
    .bind(&failures)
    .bind(&details)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// A node's units, whole (with each one's OOM kills since it was declared);
/// restarts that grew since the unit's last report are remembered with their
/// time.
async fn record_units(tx: &mut PgConnection, node: &str, n: u64, u: &Units) -> Result<(), Error> {
    if !fresh(tx, node, "units", n).await? {
        return Ok(());
    }
    let len = u.units.len();
    let (mut names, mut modules, mut states, mut restarts, mut oom_kills) = (
        Vec::with_capacity(len),
        Vec::with_capacity(len),
        Vec::with_capacity(len),
        Vec::with_capacity(len),
        Vec::with_capacity(len),
    );
    for s in &u.units {
        names.push(s.name.as_str());
        modules.push(s.module.as_str());
        states.push(s.state.as_str());
        restarts.push(i64::from(s.restarts));
        oom_kills.push(i64::from(s.oom_kills));
    }
    sqlx::query(
        "INSERT INTO observability.unit_restarts (node, unit, grew) \
         SELECT $1, u.name, u.restarts - o.restarts FROM UNNEST($2::text[], $3::bigint[]) AS u(name, restarts) \
         JOIN observability.units o ON o.node = $1 AND o.unit = u.name \
         WHERE u.restarts > o.restarts",
    )
    .bind(node)
    .bind(&names)
    .bind(&restarts)
    .execute(&mut *tx)
    .await?;
    sqlx::query("DELETE FROM observability.units WHERE node = $1")
        .bind(node)
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "INSERT INTO observability.units (node, unit, module, state, restarts, oom_kills) \
         SELECT DISTINCT ON (u.name) $1, u.name, u.module, u.state, u.restarts, u.oom_kills \
         FROM UNNEST($2::text[], $3::text[], $4::text[], $5::bigint[], $6::bigint[]) \
              AS u(name, module, state, restarts, oom_kills)",
    )
    .bind(node)
    .bind(&names)
    .bind(&modules)
    .bind(&states)
    .bind(&restarts)
    .bind(&oom_kills)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Record what the record tells of nodes, modules, conditions and
/// certificates. Each keeps the newest (versions, or idempotent upserts), so
/// a redelivered or late event changes nothing.
pub(crate) async fn events(tx: &mut PgConnection, events: &[&RecordEvent]) -> Result<(), Error> {
    for e in events {
        match &e.kind {
            RecordKind::NodeJoined(b) | RecordKind::NodeUpdated(b) => {
                sqlx::query(
                    "INSERT INTO observability.nodes (node) VALUES ($1) ON CONFLICT DO NOTHING",
                )
                .bind(b.node.as_str())
                .execute(&mut *tx)
                .await?;
            }
            RecordKind::NodeUnreachable(b) => {
                sqlx::query(
                    "INSERT INTO observability.nodes AS n (node, state, unreachable_since, updated_at) \
                     VALUES ($1, 'unreachable', $2, $3) \
                     ON CONFLICT (node) DO UPDATE SET state = 'unreachable', \
                         unreachable_since = excluded.unreachable_since, updated_at = excluded.updated_at \
                     WHERE n.updated_at <= excluded.updated_at",
                )
                .bind(b.node.as_str())
                .bind(b.last_heard.unwrap_or(b.at))
                .bind(b.at)
                .execute(&mut *tx)
                .await?;
            }
            RecordKind::NodeAlive(b) => {
                sqlx::query(
                    "INSERT INTO observability.nodes AS n (node, state, updated_at) VALUES ($1, 'alive', $2) \
                     ON CONFLICT (node) DO UPDATE SET state = 'alive', unreachable_since = NULL, \
                         updated_at = excluded.updated_at \
                     WHERE n.updated_at <= excluded.updated_at",
                )
                .bind(b.node.as_str())
                .bind(b.at)
                .execute(&mut *tx)
                .await?;
            }
            RecordKind::NodeEnrolled(b)
            | RecordKind::NodeRevoked(b)
            | RecordKind::NodeReadmitted(b) => {
                let revoked = matches!(e.kind, RecordKind::NodeRevoked(_));
                sqlx::query(
                    "INSERT INTO observability.nodes AS n (node, revoked) VALUES ($1, $2) \
                     ON CONFLICT (node) DO UPDATE SET revoked = excluded.revoked",
                )
                .bind(b.node.as_str())
                .bind(revoked)
                .execute(&mut *tx)
                .await?;
            }
            RecordKind::ModulePlaced(b) => {
                let nodes: Vec<&str> = b.nodes.iter().map(|n| n.as_str()).collect();
                sqlx::query(
                    "INSERT INTO observability.modules AS m (module, version, nodes, removed) \
                     VALUES ($1, $2, $3, false) \
                     ON CONFLICT (module) DO UPDATE SET version = excluded.version, \
                         nodes = excluded.nodes, removed = false \
                     WHERE m.version < excluded.version",
                )
                .bind(&b.module)
                .bind(b.version)
                .bind(&nodes)
                .execute(&mut *tx)
                .await?;
            }
            RecordKind::ModuleRemoved(b) => {
                sqlx::query(
                    "INSERT INTO observability.modules AS m (module, version, removed) \
                     VALUES ($1, $2, true) \
                     ON CONFLICT (module) DO UPDATE SET version = excluded.version, \
                         nodes = '{}', removed = true \
                     WHERE m.version < excluded.version",
                )
                .bind(&b.module)
                .bind(b.version)
                .execute(&mut *tx)
                .await?;
            }
            RecordKind::FleetConditions(b) => {
                conditions(tx, "inventory", b).await?;
            }
            RecordKind::GrantConditions(b) => {
                conditions(tx, "provisioning", b).await?;
            }
            RecordKind::CertificateIssued(b) => {
                sqlx::query(
                    "INSERT INTO observability.certificates (node, name, serial, not_after, issued_at) \
                     VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING",
                )
                .bind(b.node.as_str())
                .bind(&b.name)
                .bind(&b.serial)
                .bind(b.not_after)
                .bind(e.sent_at.min(b.not_after))
                .execute(&mut *tx)
                .await?;
            }
            // Its own events, and audit entries: only kept for the stream.
            RecordKind::ModuleHealth(_)
            | RecordKind::AlertRaised(_)
            | RecordKind::ModuleTargets(_)
            | RecordKind::AlertResolved(_)
            | RecordKind::CredentialsIssued(_)
            | RecordKind::CredentialsWithdrawn(_)
            | RecordKind::OperatorAudit { .. } => {}
        }
    }
    Ok(())
}

/// Keep the newest set of conditions `source` told (by its `version`).
async fn conditions(
    tx: &mut PgConnection,
    source: &str,
    b: &mesh_protocol::FleetConditions,
) -> Result<(), Error> {
    let conditions = serde_json::to_value(&b.conditions).map_err(|e| Error::Corrupt {
        what: format!("{source} conditions"),
        reason: e.to_string(),
    })?;
    sqlx::query(
        "INSERT INTO observability.conditions AS c (source, version, conditions) \
         VALUES ($1, $2, $3) \
         ON CONFLICT (source) DO UPDATE SET version = excluded.version, \
             conditions = excluded.conditions \
         WHERE c.version < excluded.version",
    )
    .bind(source)
    .bind(b.version)
    .bind(conditions)
    .execute(&mut *tx)
    .await?;
    Ok(())
}
