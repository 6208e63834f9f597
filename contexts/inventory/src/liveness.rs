//! Liveness in memory, written in batches (docs/decisions/0023).
//!
//! A heartbeat of a node the database already has as alive, and whose applied
//! generations are what was declared to it, changes nothing but the node's last
//! heard time. That is kept here and written for the whole fleet every
//! `liveness_write` (one statement per 2,000 nodes), before every sweep, and
//! at once for a node whose state changes: a node not known alive here (first
//! heard since the controller started, or judged unreachable) takes the
//! durable path with its heartbeat. So `last_seen` in the database (and in
//! the API) is never older than `liveness_write` plus one write, and liveness
//! is judged only on written times, with a grace many intervals long.
//!
//! The heartbeat budget: the fleet's heartbeat interval is the floor while
//! `nodes ÷ floor` stays within the budget of heartbeats per second; past it,
//! interval and grace stretch together, in rungs of × 1.5, so the fleet's
//! heartbeats cost what the budget allows and detection time grows instead.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;

use chrono::{DateTime, Utc};
use mesh_plumbing::InStep;
use mesh_protocol::{Envelope, HeartbeatPlan, Report};
use serde::Serialize;
use sqlx::PgConnection;

use crate::nodes::to_i64;
use crate::{Error, Inventory};

/// Nodes per liveness statement.
const CHUNK: usize = 2000;

/// What the controller last heard from a node.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Beat {
    sent_at: DateTime<Utc>,
    seq: i64,
    heard_at: DateTime<Utc>,
    interval_ms: Option<i64>,
}

impl Beat {
    fn merge(&mut self, other: Beat) {
        self.sent_at = self.sent_at.max(other.sent_at);
        self.seq = self.seq.max(other.seq);
        self.heard_at = self.heard_at.max(other.heard_at);
        if other.interval_ms.is_some() {
            self.interval_ms = other.interval_ms;
        }
    }
}

#[derive(Debug, Default)]
struct Heard {
    /// Nodes the database has as alive, as far as this controller knows.
    alive: HashSet<String>,
    /// Heard since the last write.
    pending: HashMap<String, Beat>,
}

/// The fleet's heartbeat interval and grace now, and what they come from.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, utoipa::ToSchema)]
pub struct HeartbeatView {
    /// The interval nodes are asked to beat at, in ms.
    pub interval_ms: u64,
    /// How long a node may be silent before it is judged unreachable, in ms.
    pub grace_ms: u64,
    /// Longest time from a node's last heartbeat until it is judged
    /// unreachable: the grace plus one sweep.
    pub detection_ms: u64,
    /// The shortest interval (the controller's `heartbeat_interval_ms`).
    pub floor_ms: u64,
    /// Heartbeats per second the whole fleet may cost.
    pub budget_per_sec: f64,
    /// Nodes counted (not revoked) when the interval was last chosen.
    pub nodes: u64,
    /// Longest time the API's `last_seen` lags the last heartbeat, in ms.
    pub last_seen_lag_ms: u64,
}

#[derive(Debug)]
pub(crate) struct Liveness {
    heard: Mutex<Heard>,
    /// The interval chosen now (ms) and the nodes it was chosen for.
    plan: Mutex<(u64, u64)>,
}

/// The interval for `nodes` at `budget` heartbeats per second, never below
/// `floor`: the first rung of `floor × 1.5^k` (whole seconds) that fits. Rungs
/// of 1.5 keep re-declarations few while a fleet grows (a new rung re-declares
/// every node's inventory section: four rungs from 10,000 to 50,000 nodes) and
/// the fleet within two thirds of its budget.
pub(crate) fn interval_for(nodes: u64, floor: Duration, budget: f64) -> u64 {
    let floor_ms = u64::try_from(floor.as_millis()).unwrap_or(u64::MAX);
    if budget <= 0.0 || !budget.is_finite() {
        return floor_ms;
    }
    let needed_ms = nodes as f64 / budget * 1000.0;
    let mut rung = floor_ms as f64;
    let mut k = 0;
    while rung < needed_ms && k < 64 {
        k += 1;
        rung = floor_ms as f64 * 1.5f64.powi(k);
    }
    if k == 0 {
        return floor_ms;
    }
    let whole = ((rung / 1000.0).ceil() * 1000.0) as u64;
    whole.clamp(floor_ms, *mesh_protocol::HEARTBEAT_INTERVAL_MS.end())
}

/// The next interval: up at once when the fleet outgrows the current one,
/// down only once the fleet fits the lower one with 10 % to spare (so a fleet
/// at a boundary does not flap and re-declare every node's section).
pub(crate) fn next_interval(current: u64, nodes: u64, floor: Duration, budget: f64) -> u64 {
    let wanted = interval_for(nodes, floor, budget);
    if wanted >= current {
        return wanted;
    }
    let with_room = interval_for(nodes.saturating_add(nodes / 9), floor, budget);
    with_room.min(current)
}

impl Liveness {
    pub(crate) fn new(floor: Duration) -> Self {
        Liveness {
            heard: Mutex::new(Heard::default()),
            plan: Mutex::new((u64::try_from(floor.as_millis()).unwrap_or(u64::MAX), 0)),
        }
    }

    fn heard(&self) -> std::sync::MutexGuard<'_, Heard> {
        self.heard.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn interval_ms(&self) -> u64 {
        self.plan.lock().unwrap_or_else(|e| e.into_inner()).0
    }

    fn set_plan(&self, interval_ms: u64, nodes: u64) -> bool {
        let mut plan = self.plan.lock().unwrap_or_else(|e| e.into_inner());
        let changed = plan.0 != interval_ms;
        *plan = (interval_ms, nodes);
        changed
    }

    fn nodes(&self) -> u64 {
        self.plan.lock().unwrap_or_else(|e| e.into_inner()).1
    }
}

impl Inventory {
    /// The fleet's heartbeat interval and grace now.
    pub fn heartbeat(&self) -> HeartbeatView {
        let interval_ms = self.liveness.interval_ms();
        let grace_ms = self.grace_ms(interval_ms);
        HeartbeatView {
            interval_ms,
            grace_ms,
            detection_ms: grace_ms
                + u64::try_from(self.settings.sweep_interval.as_millis()).unwrap_or(0),
            floor_ms: self.floor_ms(),
            budget_per_sec: self.settings.heartbeat_budget,
            nodes: self.liveness.nodes(),
            last_seen_lag_ms: u64::try_from(self.settings.liveness_write.as_millis())
                .unwrap_or(u64::MAX),
        }
    }

    fn floor_ms(&self) -> u64 {
        u64::try_from(self.settings.heartbeat_floor.as_millis()).unwrap_or(u64::MAX)
    }

    /// The grace at `interval_ms`: the configured grace (at the floor)
    /// stretched in proportion.
    fn grace_ms(&self, interval_ms: u64) -> u64 {
        let grace = u64::try_from(self.settings.grace.as_millis()).unwrap_or(u64::MAX);
        let floor = self.floor_ms().max(1);
        grace.saturating_mul(interval_ms) / floor
    }

    /// The grace liveness is judged with now.
    pub(crate) fn grace(&self) -> Duration {
        Duration::from_millis(self.grace_ms(self.liveness.interval_ms()))
    }

    /// The plan declared in every node's inventory section: none while the
    /// fleet beats at the floor (agents beat at their own interval, the floor).
    pub(crate) fn declared_plan(&self) -> Option<HeartbeatPlan> {
        let interval_ms = self.liveness.interval_ms();
        (interval_ms > self.floor_ms()).then(|| HeartbeatPlan {
            interval_ms,
            grace_ms: self.grace_ms(interval_ms),
        })
    }

    /// What every node's inventory section carries besides its units: the
    /// declared plan and the mesh's endpoints (the settings').
    pub(crate) fn carried(&self) -> crate::fleet::Carried {
        crate::fleet::Carried {
            heartbeat: self.declared_plan(),
            endpoints: self.settings.endpoints.clone(),
        }
    }

    /// Count the fleet and choose its interval. True when it changed (every
    /// node's inventory section must then be declared again).
    pub(crate) async fn choose_interval(&self, tx: &mut PgConnection) -> Result<bool, Error> {
        let nodes: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM inventory.nodes WHERE admin_state <> 'revoked'",
        )
        .fetch_one(&mut *tx)
        .await?;
        let nodes = u64::try_from(nodes).unwrap_or(0);
        let next = next_interval(
            self.liveness.interval_ms(),
            nodes,
            self.settings.heartbeat_floor,
            self.settings.heartbeat_budget,
        );
        let changed = self.liveness.set_plan(next, nodes);
        if changed {
            tracing::info!(
                nodes,
                interval_ms = next,
                grace_ms = self.grace_ms(next),
                "heartbeat interval chosen for the fleet"
            );
        }
        Ok(changed)
    }

    /// Choose the fleet's heartbeat interval now (at start, before any
    /// report: the sections declared from then on carry its plan).
    pub async fn choose_heartbeat(&self) -> Result<(), Error> {
        let mut tx = self.pool.begin().await?;
        self.choose_interval(&mut tx).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Note a batch of heartbeats in memory. Returns those that must take the
    /// durable path: of a node not known alive (its state changes, or this
    /// controller has not written it yet), or out of step with what was
    /// declared to it (`in_step`).
    pub fn heard(&self, batch: &[Envelope<Report>], in_step: &InStep) -> Vec<Envelope<Report>> {
        let heard_at = Utc::now();
        let mut durable = Vec::new();
        let mut heard = self.liveness.heard();
        for env in batch {
            let Report::Heartbeat(hb) = &env.body else {
                continue;
            };
            let node = env.node.as_str();
            if !heard.alive.contains(node) || !in_step.in_step(node, &hb.applied) {
                durable.push(env.clone());
                continue;
            }
            let beat = Beat {
                sent_at: env.sent_at.min(heard_at),
                seq: to_i64(env.seq),
                heard_at,
                interval_ms: hb.interval_ms.map(to_i64),
            };
            heard
                .pending
                .entry(node.to_owned())
                .and_modify(|b| b.merge(beat))
                .or_insert(beat);
        }
        durable
    }

    /// The durable path wrote these heartbeats' nodes as alive (those it knows).
    pub fn written_alive(&self, batch: &[Envelope<Report>]) {
        let mut heard = self.liveness.heard();
        for env in batch {
            heard.alive.insert(env.node.as_str().to_owned());
        }
    }

    /// Nodes judged unreachable: their next heartbeat takes the durable path,
    /// which says so on the record at once.
    pub(crate) fn judged_unreachable(&self, nodes: &[String]) {
        let mut heard = self.liveness.heard();
        for node in nodes {
            heard.alive.remove(node);
        }
    }

    /// Write what was heard since the last write. A node judged unreachable
    /// meanwhile is revived (record event `inventory.node.alive`) in the same
    /// transaction. On failure what was taken is kept for the next write.
    pub async fn write_liveness(&self) -> Result<usize, Error> {
        let pending = std::mem::take(&mut self.liveness.heard().pending);
        if pending.is_empty() {
            return Ok(0);
        }
        let mut rows: Vec<(String, Beat)> = pending.into_iter().collect();
        rows.sort_by(|a, b| a.0.cmp(&b.0));
        let total = rows.len();
        let mut written = 0;
        while written < total {
            let end = (written + CHUNK).min(total);
            if let Err(e) = self.write_chunk(&rows[written..end]).await {
                let mut heard = self.liveness.heard();
                for (node, beat) in rows.drain(written..) {
                    heard
                        .pending
                        .entry(node)
                        .and_modify(|b| b.merge(beat))
                        .or_insert(beat);
                }
                return Err(e);
            }
            written = end;
        }
        Ok(total)
    }

    async fn write_chunk(&self, rows: &[(String, Beat)]) -> Result<(), Error> {
        let mut ids = Vec::with_capacity(rows.len());
        let mut sent = Vec::with_capacity(rows.len());
        let mut seqs = Vec::with_capacity(rows.len());
        let mut heard = Vec::with_capacity(rows.len());
        let mut beats = Vec::with_capacity(rows.len());
        for (id, b) in rows {
            ids.push(id.as_str());
            sent.push(b.sent_at);
            seqs.push(b.seq);
            heard.push(b.heard_at);
            beats.push(b.interval_ms);
        }
        let mut tx = self.pool.begin().await?;
        let revived: Vec<(String, DateTime<Utc>, DateTime<Utc>)> = sqlx::query_as(
            "WITH u AS (SELECT * FROM UNNEST($1::text[], $2::timestamptz[], $3::bigint[], \
                        $4::timestamptz[], $5::bigint[]) AS u(id, sent_at, seq, heard_at, beat_ms)), \
             prev AS (SELECT n.id, n.state, n.heard_at FROM inventory.nodes n JOIN u ON u.id = n.id \
                      ORDER BY n.id FOR UPDATE OF n), \
             seen AS (UPDATE inventory.nodes AS n SET last_seen = greatest(n.last_seen, u.sent_at), \
                      last_seq = greatest(n.last_seq, u.seq), state = 'alive', unreachable_since = NULL, \
                      heard_at = greatest(n.heard_at, u.heard_at), beat_ms = coalesce(u.beat_ms, n.beat_ms) \
                      FROM u, prev WHERE n.id = u.id AND prev.id = n.id \
                      RETURNING n.id, prev.state, prev.heard_at, u.heard_at AS now_heard) \
             SELECT id, heard_at, now_heard FROM seen WHERE state = 'unreachable'",
        )
        .bind(&ids)
        .bind(&sent)
        .bind(&seqs)
        .bind(&heard)
        .bind(&beats)
        .fetch_all(&mut *tx)
        .await?;
        for (node, last_heard, heard_at) in &revived {
            crate::reports::revived(&mut tx, node, *heard_at, *last_heard).await?;
        }
        tx.commit().await?;
        if !revived.is_empty() {
            self.signal.notify();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FLOOR: Duration = Duration::from_secs(10);

    #[test]
    fn the_floor_until_the_budget_is_spent_then_rungs_of_one_and_a_half() {
        assert_eq!(interval_for(0, FLOOR, 1000.0), 10_000);
        assert_eq!(interval_for(10_000, FLOOR, 1000.0), 10_000);
        assert_eq!(interval_for(10_001, FLOOR, 1000.0), 15_000);
        assert_eq!(interval_for(15_000, FLOOR, 1000.0), 15_000);
        assert_eq!(
            interval_for(15_001, FLOOR, 1000.0),
            23_000,
            "22.5 s, whole seconds"
        );
        assert_eq!(
            interval_for(50_000, FLOOR, 1000.0),
            51_000,
            "33.75 s < 50 s <= 50.6 s"
        );
        let second = Duration::from_secs(1);
        assert_eq!(interval_for(3, second, 1.0), 4_000, "1, 1.5, 2.25, 3.4");
        assert_eq!(interval_for(4, second, 1.0), 6_000, "then 5.1");
        assert_eq!(interval_for(5, FLOOR, 0.0), 10_000, "no budget: the floor");
        assert_eq!(interval_for(u64::MAX, FLOOR, 1e-9), 3_600_000, "capped");
    }

    #[test]
    fn the_interval_goes_down_only_with_room_to_spare() {
        // 15 s chosen for 10,500 nodes; shrinking to 10,000 is not enough room.
        assert_eq!(next_interval(15_000, 10_000, FLOOR, 1000.0), 15_000);
        assert_eq!(next_interval(15_000, 9_000, FLOOR, 1000.0), 10_000);
        assert_eq!(next_interval(51_000, 40_000, FLOOR, 1000.0), 51_000);
        assert_eq!(next_interval(51_000, 30_000, FLOOR, 1000.0), 34_000);
        assert_eq!(
            next_interval(10_000, 10_001, FLOOR, 1000.0),
            15_000,
            "up at once"
        );
    }
}
