//! The `units` report: the whole list of a node's supervised units and their
//! states, recorded on the node's assignments so the module view shows per
//! replica what runs, its pid and its restarts, and its box: the uid it runs
//! as, why its last process ended (`oom_killed`), its OOM kills since it was
//! declared and the size of its module's data volume on the node.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use mesh_protocol::{Envelope, Report, Units};
use sqlx::PgConnection;

use crate::Error;
use crate::nodes::to_i64;

/// Record the newest units report of each node in the batch, if it is newer
/// than the one recorded (by the node's `seq`). Assignments the report does not
/// list have no known unit state (the node has not started them, or lost them).
pub(crate) async fn record(
    tx: &mut PgConnection,
    reports: &[(&Envelope<Report>, &Units)],
    heard_at: DateTime<Utc>,
) -> Result<(), Error> {
    let mut newest: BTreeMap<&str, (u64, &Units)> = BTreeMap::new();
    for (env, units) in reports {
        let entry = newest.entry(env.node.as_str()).or_insert((env.seq, units));
        if env.seq >= entry.0 {
            *entry = (env.seq, units);
        }
    }
    for (node, (seq, units)) in newest {
        let fresh: Option<String> = sqlx::query_scalar(
            "UPDATE inventory.nodes SET units_seq = $2 WHERE id = $1 AND units_seq < $2 RETURNING id",
        )
        .bind(node)
        .bind(to_i64(seq))
        .fetch_optional(&mut *tx)
        .await?;
        if fresh.is_none() {
            continue;
        }
        let n = units.units.len();
        let mut names = Vec::with_capacity(n);
        let mut modules = Vec::with_capacity(n);
        let mut states = Vec::with_capacity(n);
        let mut pids = Vec::with_capacity(n);
        let mut codes = Vec::with_capacity(n);
        let mut restarts = Vec::with_capacity(n);
        let mut started = Vec::with_capacity(n);
        let mut reasons = Vec::with_capacity(n);
        let mut oom_kills = Vec::with_capacity(n);
        let mut uids = Vec::with_capacity(n);
        let mut data = Vec::with_capacity(n);
        for u in &units.units {
            names.push(u.name.as_str());
            modules.push(u.module.as_str());
            states.push(u.state.as_str());
            pids.push(u.pid.map(i64::from));
            codes.push(u.exit_code);
            restarts.push(i64::from(u.restarts));
            started.push(u.started_at);
            reasons.push(u.reason.as_deref());
            oom_kills.push(i64::from(u.oom_kills));
            uids.push(u.uid.map(i64::from));
            data.push(u.data_bytes.map(to_i64));
        }
        sqlx::query(
            "UPDATE inventory.assignments AS a SET unit_state = u.state, pid = u.pid, exit_code = u.code, \
             restarts = u.restarts, started_at = u.started, reported_at = $9, reason = u.reason, \
             oom_kills = u.oom_kills, uid = u.uid, data_bytes = u.data \
             FROM UNNEST($2::text[], $3::text[], $4::text[], $5::bigint[], $6::int[], $7::bigint[], \
                         $8::timestamptz[], $10::text[], $11::bigint[], $12::bigint[], $13::bigint[]) \
                  AS u(name, module, state, pid, code, restarts, started, reason, oom_kills, uid, data) \
             WHERE a.node = $1 AND a.name = u.name AND a.module = u.module",
        )
        .bind(node)
        .bind(&names)
        .bind(&modules)
        .bind(&states)
        .bind(&pids)
        .bind(&codes)
        .bind(&restarts)
        .bind(&started)
        .bind(heard_at)
        .bind(&reasons)
        .bind(&oom_kills)
        .bind(&uids)
        .bind(&data)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "UPDATE inventory.assignments SET unit_state = NULL, pid = NULL, uid = NULL, reported_at = $3 \
             WHERE node = $1 AND NOT (name = ANY($2))",
        )
        .bind(node)
        .bind(&names)
        .bind(heard_at)
        .execute(&mut *tx)
        .await?;
    }
    Ok(())
}
