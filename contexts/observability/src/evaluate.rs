//! One evaluation: load what observability knows, derive health, tell the
//! record each module whose health changed, make the open alerts what the
//! rules say, and prune what is past its retention. Level-triggered and
//! idempotent: the controller runs it on an interval and after reports
//! committed; two at once serialize on an advisory lock.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use mesh_protocol::{
    FleetCondition, HealthState, MAX_PROBE_DETAIL, ModuleHealth, NodeId, RecordEvent, RecordKind,
    ReplicaHealth,
};
use sqlx::PgConnection;

use crate::alerts::{
    self, BehindRow, CertificateRow, Observations, OomKilled, OutageRow, Restarting, RuleInputs,
};
use crate::health::{
    self, Inputs, ModuleHealthView, NodeHealthView, NodeRow, ProbeRow, ProbeView, UnitRow,
};
use crate::{Error, SCHEMA, Settings};

const EVALUATE_LOCK: i64 = 0x006f_6273_6572_7601;

/// What one evaluation found, for the controller's metrics.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Summary {
    /// Modules by health (`healthy`, `degraded`, `down`, `unknown`).
    pub modules: BTreeMap<&'static str, i64>,
    /// Open alerts by (kind, severity).
    pub alerts: BTreeMap<(String, String), i64>,
    /// Alerts raised and resolved by this evaluation.
    pub raised: usize,
    pub resolved: usize,
    /// Modules whose health changed (an `observability.module.health` each).
    pub health_changed: usize,
}

/// Load the inputs health is derived from.
pub(crate) async fn health_inputs(tx: &mut PgConnection) -> Result<Inputs, Error> {
    let nodes: Vec<(String, String, bool, Option<DateTime<Utc>>)> =
        sqlx::query_as("SELECT node, state, revoked, unreachable_since FROM observability.nodes")
            .fetch_all(&mut *tx)
            .await?;
    let modules: Vec<(String, Vec<String>)> =
        sqlx::query_as("SELECT module, nodes FROM observability.modules WHERE NOT removed")
            .fetch_all(&mut *tx)
            .await?;
    let units: Vec<(String, String, String, String, i64)> = sqlx::query_as(
        "SELECT node, unit, module, state, restarts FROM observability.units ORDER BY node, unit",
    )
    .fetch_all(&mut *tx)
    .await?;
    type P = (
        String,
        String,
        String,
        String,
        DateTime<Utc>,
        Option<DateTime<Utc>>,
        i64,
        Option<String>,
    );
    let probes: Vec<P> = sqlx::query_as(
        "SELECT node, unit, probe, state, since, checked_at, failures, detail \
         FROM observability.probes ORDER BY node, unit, probe",
    )
    .fetch_all(&mut *tx)
    .await?;
    Ok(Inputs {
        nodes: nodes
            .into_iter()
            .map(|(n, state, revoked, unreachable_since)| {
                (
                    n,
                    NodeRow {
                        state,
                        revoked,
                        unreachable_since,
                    },
                )
            })
            .collect(),
        modules: modules.into_iter().collect(),
        units: units
            .into_iter()
            .map(|(node, unit, module, state, restarts)| UnitRow {
                node,
                unit,
                module,
                state,
                restarts,
            })
            .collect(),
        probes: probes
            .into_iter()
            .map(
                |(node, unit, probe, state, since, checked_at, failures, detail)| ProbeRow {
                    node,
                    unit,
                    view: ProbeView {
                        probe,
                        state,
                        since,
                        checked_at,
                        failures,
                        detail,
                    },
                },
            )
            .collect(),
    })
}

/// Health as it stands, derived now.
pub(crate) async fn current_health(
    tx: &mut PgConnection,
) -> Result<(Vec<ModuleHealthView>, Vec<NodeHealthView>), Error> {
    let inputs = health_inputs(tx).await?;
    Ok(health::derive(&inputs))
}

/// One evaluation, in `tx` (the caller commits).
pub(crate) async fn run(
    tx: &mut PgConnection,
    settings: &Settings,
    obs: &Observations,
) -> Result<Summary, Error> {
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(EVALUATE_LOCK)
        .execute(&mut *tx)
        .await?;
    let now: DateTime<Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(&mut *tx)
        .await?;
    let inputs = health_inputs(tx).await?;
    let (modules, _) = health::derive(&inputs);
    let mut events = health_changes(tx, &modules).await?;
    let health_changed = events.len();

    let sets: Vec<serde_json::Value> =
        sqlx::query_scalar("SELECT conditions FROM observability.conditions ORDER BY source")
            .fetch_all(&mut *tx)
            .await?;
    let mut conditions: Vec<FleetCondition> = Vec::new();
    for v in sets {
        let set: Vec<FleetCondition> = serde_json::from_value(v).map_err(|e| Error::Corrupt {
            what: "observability.conditions".to_owned(),
            reason: e.to_string(),
        })?;
        conditions.extend(set);
    }
    // The newest certificate of each node and name (by not_after).
    let certificates: Vec<(String, String, DateTime<Utc>, DateTime<Utc>)> = sqlx::query_as(
        "SELECT DISTINCT ON (node, name) node, name, not_after, issued_at \
         FROM observability.certificates ORDER BY node, name, not_after DESC",
    )
    .fetch_all(&mut *tx)
    .await?;
    let certificates: Vec<CertificateRow> = certificates
        .into_iter()
        .map(|(node, name, not_after, issued_at)| CertificateRow {
            node,
            name,
            not_after,
            issued_at,
        })
        .collect();
    let outages: Vec<(String, DateTime<Utc>, i64, i64, i64)> = sqlx::query_as(
        "SELECT node, since, seconds, buffered, dropped FROM observability.outages \
         WHERE reported_at > $1 - make_interval(secs => $2) ORDER BY node, since",
    )
    .bind(now)
    .bind(settings.outage_window.as_secs_f64())
    .fetch_all(&mut *tx)
    .await?;
    let outages: Vec<OutageRow> = outages
        .into_iter()
        .map(|(node, since, seconds, buffered, dropped)| OutageRow {
            node,
            since,
            seconds,
            buffered,
            dropped,
        })
        .collect();
    let restarting: Vec<(String, String, String, String, i64, DateTime<Utc>)> = sqlx::query_as(
        "SELECT r.node, r.unit, coalesce(u.module, ''), coalesce(u.state, 'gone'), \
                sum(r.grew)::bigint, min(r.at) \
         FROM observability.unit_restarts r \
         LEFT JOIN observability.units u ON u.node = r.node AND u.unit = r.unit \
         WHERE r.at > $1 - make_interval(secs => $2) \
         GROUP BY r.node, r.unit, u.module, u.state",
    )
    .bind(now)
    .bind(settings.crash_window.as_secs_f64())
    .fetch_all(&mut *tx)
    .await?;
    let restarting: Vec<Restarting> = restarting
        .into_iter()
        .filter(|r| r.3 != "gone")
        .map(|(node, unit, module, state, grew, first)| Restarting {
            node,
            unit,
            module,
            state,
            grew,
            first,
        })
        .collect();
    // Units OOM-killed often enough since they were declared: the count is
    // the node's (it starts again at a redeclaration), so the alert resolves
    // when the unit is redeclared or gone.
    let oom_killed: Vec<(String, String, String, String, i64)> = sqlx::query_as(
        "SELECT node, unit, module, state, oom_kills FROM observability.units \
         WHERE oom_kills >= $1 ORDER BY node, unit",
    )
    .bind(i64::from(settings.oom_kills))
    .fetch_all(&mut *tx)
    .await?;
    let oom_killed: Vec<OomKilled> = oom_killed
        .into_iter()
        .map(|(node, unit, module, state, kills)| OomKilled {
            node,
            unit,
            module,
            state,
            kills,
        })
        .collect();
    let behind = match &obs.behind {
        Some(list) => Some(record_behind(tx, list, now).await?),
        None => None,
    };
    let wanted = alerts::rules(&RuleInputs {
        now,
        settings,
        nodes: &inputs.nodes,
        modules: &modules,
        conditions: &conditions,
        certificates: &certificates,
        outages: &outages,
        restarting: &restarting,
        oom_killed: &oom_killed,
        behind: behind.as_deref(),
        queues: obs.queues.as_deref(),
    });
    let keep = alerts::unobserved_kinds(obs);
    let alert_events = alerts::sync(tx, &wanted, &keep, now).await?;
    let raised = alert_events
        .iter()
        .filter(|e| matches!(e.kind, RecordKind::AlertRaised(_)))
        .count();
    let resolved = alert_events.len() - raised;
    events.extend(alert_events);
    mesh_plumbing::outbox::record_many(tx, SCHEMA, &events).await?;
    prune(tx, settings, now).await?;

    let mut summary = Summary {
        raised,
        resolved,
        health_changed,
        ..Summary::default()
    };
    for h in [
        HealthState::Healthy,
        HealthState::Degraded,
        HealthState::Down,
        HealthState::Unknown,
    ] {
        summary.modules.insert(h.as_str(), 0);
    }
    for m in &modules {
        *summary.modules.entry(m.health.as_str()).or_default() += 1;
    }
    let open: Vec<(String, String, i64)> = sqlx::query_as(
        "SELECT kind, severity, count(*) FROM observability.alerts WHERE resolved_at IS NULL \
         GROUP BY kind, severity",
    )
    .fetch_all(&mut *tx)
    .await?;
    summary.alerts = open.into_iter().map(|(k, s, n)| ((k, s), n)).collect();
    Ok(summary)
}

/// Compare each module's health (its own and its replicas') with what was
/// last told; store and return an `observability.module.health` event for
/// each that changed, and forget removed modules.
async fn health_changes(
    tx: &mut PgConnection,
    modules: &[ModuleHealthView],
) -> Result<Vec<RecordEvent>, Error> {
    let told: Vec<(String, String, serde_json::Value)> =
        sqlx::query_as("SELECT module, health, replicas FROM observability.module_health")
            .fetch_all(&mut *tx)
            .await?;
    let told: BTreeMap<String, (String, serde_json::Value)> =
        told.into_iter().map(|(m, h, r)| (m, (h, r))).collect();
    let mut events = Vec::new();
    let mut current = Vec::with_capacity(modules.len());
    for m in modules {
        current.push(m.module.as_str());
        let replicas: Vec<ReplicaHealth> = m
            .replicas
            .iter()
            .filter_map(|r| {
                Some(ReplicaHealth {
                    node: NodeId::parse(&r.node).ok()?,
                    unit: r.unit.clone(),
                    health: r.health,
                    reason: r
                        .reason
                        .as_ref()
                        .map(|x| x.chars().take(4 * MAX_PROBE_DETAIL).collect()),
                })
            })
            .collect();
        let json = serde_json::to_value(&replicas).map_err(|e| Error::Corrupt {
            what: "replica health".to_owned(),
            reason: e.to_string(),
        })?;
        if told
            .get(&m.module)
            .is_some_and(|(h, r)| h == m.health.as_str() && *r == json)
        {
            continue;
        }
        let (version, at): (i64, DateTime<Utc>) = sqlx::query_as(
            "INSERT INTO observability.module_health AS h (module, health, replicas, version) \
             VALUES ($1, $2, $3, nextval('observability.health_version')) \
             ON CONFLICT (module) DO UPDATE SET health = excluded.health, replicas = excluded.replicas, \
                 version = excluded.version, \
                 since = CASE WHEN h.health = excluded.health THEN h.since ELSE now() END \
             RETURNING version, now()",
        )
        .bind(&m.module)
        .bind(m.health.as_str())
        .bind(&json)
        .fetch_one(&mut *tx)
        .await?;
        events.push(RecordEvent::new(RecordKind::ModuleHealth(ModuleHealth {
            module: m.module.clone(),
            version,
            health: m.health,
            replicas,
            at,
        })));
    }
    sqlx::query("DELETE FROM observability.module_health WHERE NOT (module = ANY($1))")
        .bind(&current)
        .execute(&mut *tx)
        .await?;
    Ok(events)
}

/// Remember since when each node has been behind on each section (a node
/// no longer behind is forgotten; one further behind keeps its `since`).
async fn record_behind(
    tx: &mut PgConnection,
    list: &[alerts::Behind],
    now: DateTime<Utc>,
) -> Result<Vec<BehindRow>, Error> {
    let nodes: Vec<&str> = list.iter().map(|b| b.node.as_str()).collect();
    let sections: Vec<&str> = list.iter().map(|b| b.section.as_str()).collect();
    let declared: Vec<i64> = list.iter().map(|b| b.declared).collect();
    let applied: Vec<Option<i64>> = list.iter().map(|b| b.applied).collect();
    sqlx::query(
        "DELETE FROM observability.behind b WHERE NOT EXISTS \
         (SELECT 1 FROM UNNEST($1::text[], $2::text[]) AS u(node, section) \
          WHERE u.node = b.node AND u.section = b.section)",
    )
    .bind(&nodes)
    .bind(&sections)
    .execute(&mut *tx)
    .await?;
    type Row = (String, String, i64, Option<i64>, DateTime<Utc>);
    let rows: Vec<Row> = sqlx::query_as(
        "INSERT INTO observability.behind AS b (node, section, declared, applied, since) \
         SELECT DISTINCT ON (u.node, u.section) u.node, u.section, u.declared, u.applied, $5 \
         FROM UNNEST($1::text[], $2::text[], $3::bigint[], $4::bigint[]) AS u(node, section, declared, applied) \
         ON CONFLICT (node, section) DO UPDATE SET declared = excluded.declared, applied = excluded.applied \
         RETURNING node, section, declared, applied, since",
    )
    .bind(&nodes)
    .bind(&sections)
    .bind(&declared)
    .bind(&applied)
    .bind(now)
    .fetch_all(&mut *tx)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(node, section, declared, applied, since)| BehindRow {
            behind: alerts::Behind {
                node,
                section,
                declared,
                applied,
            },
            since,
        })
        .collect())
}

/// Forget what is past its retention: resolved alerts, probe history,
/// outages and restarts past their windows.
async fn prune(tx: &mut PgConnection, s: &Settings, now: DateTime<Utc>) -> Result<(), Error> {
    sqlx::query(
        "DELETE FROM observability.alerts WHERE resolved_at < $1 - make_interval(secs => $2)",
    )
    .bind(now)
    .bind(s.alert_retention.as_secs_f64())
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "DELETE FROM observability.probe_history WHERE recorded_at < $1 - make_interval(secs => $2)",
    )
    .bind(now)
    .bind(s.probe_retention.as_secs_f64())
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "DELETE FROM observability.outages WHERE reported_at < $1 - make_interval(secs => $2)",
    )
    .bind(now)
    .bind(s.outage_window.as_secs_f64())
    .execute(&mut *tx)
    .await?;
    // Certificates superseded by a newer one of the same node and name.
    sqlx::query(
        "DELETE FROM observability.certificates c WHERE EXISTS \
         (SELECT 1 FROM observability.certificates n WHERE n.node = c.node AND n.name = c.name \
          AND n.not_after > c.not_after)",
    )
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "DELETE FROM observability.unit_restarts WHERE at < $1 - make_interval(secs => $2)",
    )
    .bind(now)
    .bind(s.crash_window.as_secs_f64())
    .execute(&mut *tx)
    .await?;
    Ok(())
}
