//! Alerts: the rules (pure: what should be open, given what observability
//! knows and the controller observed) and their sync with
//! `observability.alerts` (raise what is new, resolve what is over, each
//! with its record event).
//!
//! Every alert has a key (what it is about; at most one open alert per key),
//! an id, a kind, a severity, a subject, a sentence, `since` and, once
//! resolved, `resolved_at`. Resolved alerts are kept for `alert_retention`.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};
use mesh_protocol::{AlertChanged, FleetCondition, HealthState, RecordEvent, RecordKind, Severity};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::health::{ModuleHealthView, NodeRow};
use crate::{Error, Settings};

/// Every kind of alert there is, as `GET /v1/alerts?kind=` names them.
pub const ALERT_KINDS: [&str; 16] = [
    NODE_UNREACHABLE,
    UNIT_CRASH_LOOPING,
    UNIT_OOM_KILLED,
    MODULE_BELOW_REPLICAS,
    MODULE_DEGRADED,
    STATEFUL_MODULE_UNREACHABLE,
    PINNED_MODULE_UNREACHABLE,
    CERTIFICATE_EXPIRING,
    NODE_BEHIND,
    DEAD_LETTER_QUEUE,
    QUEUE_DEPTH,
    REPLACEMENT_PAUSED,
    CONTROLLER_UNREACHABLE,
    FLEET_CONDITION,
    GRANT_WAITING,
    GRANT_FAILED,
];

pub const NODE_UNREACHABLE: &str = "node_unreachable";
pub const UNIT_CRASH_LOOPING: &str = "unit_crash_looping";
/// A unit was OOM-killed `oom_kills` times since it was declared (over its
/// memory limit; decision 0051).
pub const UNIT_OOM_KILLED: &str = "unit_oom_killed";
pub const MODULE_BELOW_REPLICAS: &str = "module_below_replicas";
pub const MODULE_DEGRADED: &str = "module_degraded";
pub const STATEFUL_MODULE_UNREACHABLE: &str = "stateful_module_unreachable";
pub const PINNED_MODULE_UNREACHABLE: &str = "pinned_module_unreachable";
pub const CERTIFICATE_EXPIRING: &str = "certificate_expiring";
pub const NODE_BEHIND: &str = "node_behind";
pub const DEAD_LETTER_QUEUE: &str = "dead_letter_queue";
pub const QUEUE_DEPTH: &str = "queue_depth";
pub const REPLACEMENT_PAUSED: &str = "replacement_paused";
pub const CONTROLLER_UNREACHABLE: &str = "controller_unreachable";
/// A fleet condition of a kind this version does not know (a newer inventory's).
pub const FLEET_CONDITION: &str = "fleet_condition";
/// A resource grant waits for its provider (provisioning's condition).
pub const GRANT_WAITING: &str = "grant_waiting";
/// A resource grant's provider refused it (provisioning's condition).
pub const GRANT_FAILED: &str = "grant_failed";

/// What the controller observed outside any context's tables, handed to each
/// evaluation: the broker's queue depths and the nodes behind on a section.
/// `None` for what it has not observed yet: alerts of that kind stay as they
/// are (neither raised nor resolved) until it has.
#[derive(Debug, Clone, Default)]
pub struct Observations {
    pub queues: Option<Vec<QueueDepth>>,
    pub behind: Option<Vec<Behind>>,
}

/// One queue's depth, read from the broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueDepth {
    pub queue: String,
    pub messages: u64,
    /// The depth above which it is alerted (a report queue's warning depth);
    /// for the dead-letter queue, 0: any message is alerted.
    pub warn_above: u64,
    /// The dead-letter queue (alert `dead_letter_queue`, not `queue_depth`).
    pub dead_letter: bool,
}

/// A node behind on a section: the controller declared (and the broker
/// confirmed) a newer generation than the node applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Behind {
    pub node: String,
    pub section: String,
    pub declared: i64,
    pub applied: Option<i64>,
}

/// A node behind, with when observability first saw it so.
#[derive(Debug, Clone)]
pub(crate) struct BehindRow {
    pub behind: Behind,
    pub since: DateTime<Utc>,
}

/// A certificate's newest issue for a node and name.
#[derive(Debug, Clone)]
pub(crate) struct CertificateRow {
    pub node: String,
    pub name: String,
    pub not_after: DateTime<Utc>,
    pub issued_at: DateTime<Utc>,
}

/// An outage a node stated.
#[derive(Debug, Clone)]
pub(crate) struct OutageRow {
    pub node: String,
    pub since: DateTime<Utc>,
    pub seconds: i64,
    pub buffered: i64,
    pub dropped: i64,
}

/// A unit whose restarts grew within the crash window.
#[derive(Debug, Clone)]
pub(crate) struct Restarting {
    pub node: String,
    pub unit: String,
    pub module: String,
    pub state: String,
    pub grew: i64,
    pub first: DateTime<Utc>,
}

/// A unit its node reports OOM-killed at least `oom_kills` times since it
/// was declared.
#[derive(Debug, Clone)]
pub(crate) struct OomKilled {
    pub node: String,
    pub unit: String,
    pub module: String,
    pub state: String,
    pub kills: i64,
}

/// What the rules read.
pub(crate) struct RuleInputs<'a> {
    pub now: DateTime<Utc>,
    pub settings: &'a Settings,
    pub nodes: &'a BTreeMap<String, NodeRow>,
    pub modules: &'a [ModuleHealthView],
    pub conditions: &'a [FleetCondition],
    pub certificates: &'a [CertificateRow],
    pub outages: &'a [OutageRow],
    pub restarting: &'a [Restarting],
    pub oom_killed: &'a [OomKilled],
    pub behind: Option<&'a [BehindRow]>,
    pub queues: Option<&'a [QueueDepth]>,
}

/// An alert as the rules want it open.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Wanted {
    pub kind: &'static str,
    pub severity: Severity,
    pub subject: String,
    pub message: String,
    /// Since when the condition holds (for an alert raised now).
    pub since: DateTime<Utc>,
}

/// A duration in words an operator reads at a glance: `45 s`, `12 min`,
/// `3 h 20 min`, `6 days`.
pub fn humanize(secs: i64) -> String {
    let s = secs.max(0);
    match s {
        0..120 => format!("{s} s"),
        120..7200 => format!("{} min", s / 60),
        7200..172_800 => {
            let (h, m) = (s / 3600, (s % 3600) / 60);
            if m == 0 {
                format!("{h} h")
            } else {
                format!("{h} h {m} min")
            }
        }
        _ => format!("{} days", s / 86_400),
    }
}

fn secs(from: DateTime<Utc>, to: DateTime<Utc>) -> i64 {
    (to - from).num_seconds()
}

/// Every alert that should be open now, by key.
pub(crate) fn rules(i: &RuleInputs<'_>) -> BTreeMap<String, Wanted> {
    let mut out = BTreeMap::new();
    let now = i.now;
    for (node, row) in i.nodes {
        if row.state == "unreachable" && !row.revoked {
            let since = row.unreachable_since.unwrap_or(now);
            out.insert(
                format!("{NODE_UNREACHABLE}:{node}"),
                Wanted {
                    kind: NODE_UNREACHABLE,
                    severity: Severity::Critical,
                    subject: format!("node/{node}"),
                    message: format!(
                        "{node} unreachable for {} (last heard {})",
                        humanize(secs(since, now)),
                        since.format("%Y-%m-%d %H:%M:%S UTC")
                    ),
                    since,
                },
            );
        }
    }
    for r in i.restarting {
        if r.grew >= i64::from(i.settings.crash_restarts) {
            out.insert(
                format!("{UNIT_CRASH_LOOPING}:{}/{}", r.node, r.unit),
                Wanted {
                    kind: UNIT_CRASH_LOOPING,
                    severity: Severity::Warning,
                    subject: format!("unit/{}/{}", r.node, r.unit),
                    message: format!(
                        "unit `{}` of module `{}` on {} restarted {} times in the last {} (now {})",
                        r.unit,
                        r.module,
                        r.node,
                        r.grew,
                        humanize(
                            i64::try_from(i.settings.crash_window.as_secs()).unwrap_or(i64::MAX)
                        ),
                        r.state
                    ),
                    since: r.first,
                },
            );
        }
    }
    for o in i.oom_killed {
        if o.kills < i64::from(i.settings.oom_kills) {
            continue;
        }
        out.insert(
            format!("{UNIT_OOM_KILLED}:{}/{}", o.node, o.unit),
            Wanted {
                kind: UNIT_OOM_KILLED,
                severity: Severity::Warning,
                subject: format!("unit/{}/{}", o.node, o.unit),
                message: format!(
                    "unit `{}` of module `{}` on {} was OOM-killed {} times since it was declared (now {}): it needs more than its memory limit (`unit.resources.memory_bytes`)",
                    o.unit, o.module, o.node, o.kills, o.state
                ),
                since: now,
            },
        );
    }
    for m in i.modules {
        if !matches!(m.health, HealthState::Degraded | HealthState::Down) {
            continue;
        }
        let unhealthy: Vec<String> = m
            .replicas
            .iter()
            .filter(|r| r.health == HealthState::Unhealthy)
            .map(|r| {
                format!(
                    "{} {}: {}",
                    r.node,
                    r.unit,
                    r.reason.as_deref().unwrap_or("unhealthy")
                )
            })
            .collect();
        let (severity, word) = if m.health == HealthState::Down {
            (Severity::Critical, "down")
        } else {
            (Severity::Warning, "degraded")
        };
        out.insert(
            format!("{MODULE_DEGRADED}:{}", m.module),
            Wanted {
                kind: MODULE_DEGRADED,
                severity,
                subject: format!("module/{}", m.module),
                message: format!(
                    "module `{}` is {word}: {} of {} replicas unhealthy ({})",
                    m.module,
                    unhealthy.len(),
                    m.replicas.len(),
                    unhealthy.join("; ")
                ),
                since: now,
            },
        );
    }
    for c in i.conditions {
        let (kind, severity) = match c.kind.as_str() {
            "placement_unsatisfied" => (MODULE_BELOW_REPLICAS, Severity::Warning),
            "pinned_unreachable" if c.stateful => (STATEFUL_MODULE_UNREACHABLE, Severity::Critical),
            "pinned_unreachable" => (PINNED_MODULE_UNREACHABLE, Severity::Warning),
            "replacement_paused" => (REPLACEMENT_PAUSED, Severity::Critical),
            "grant_waiting" => (GRANT_WAITING, Severity::Warning),
            "grant_failed" => (GRANT_FAILED, Severity::Warning),
            _ => (FLEET_CONDITION, Severity::Warning),
        };
        let subject = match (&c.module, &c.node) {
            (Some(m), _) => format!("module/{m}"),
            (None, Some(n)) => format!("node/{n}"),
            (None, None) => "fleet".to_owned(),
        };
        out.insert(
            format!("{kind}:{}", c.key),
            Wanted {
                kind,
                severity,
                subject,
                message: c.message.clone(),
                since: now,
            },
        );
    }
    let window =
        chrono::Duration::from_std(i.settings.certificate_window).unwrap_or(chrono::Duration::MAX);
    for c in i.certificates {
        let revoked = i.nodes.get(&c.node).is_some_and(|n| n.revoked);
        // Agents renew at two thirds of a certificate's lifetime: one with
        // less than a quarter left has missed its renewal for a while. The
        // configured window bounds it for long-lived certificates.
        let quarter = (c.not_after - c.issued_at) / 4;
        if revoked || c.not_after - now > window.min(quarter) {
            continue;
        }
        let left = secs(now, c.not_after);
        let (severity, message) = if left <= 0 {
            (
                Severity::Critical,
                format!(
                    "certificate `{}` of {} expired {} ago ({})",
                    c.name,
                    c.node,
                    humanize(-left),
                    c.not_after.format("%Y-%m-%d %H:%M UTC")
                ),
            )
        } else {
            (
                Severity::Warning,
                format!(
                    "certificate `{}` of {} expires in {} ({}) and was not renewed",
                    c.name,
                    c.node,
                    humanize(left),
                    c.not_after.format("%Y-%m-%d %H:%M UTC")
                ),
            )
        };
        out.insert(
            format!("{CERTIFICATE_EXPIRING}:{}/{}", c.node, c.name),
            Wanted {
                kind: CERTIFICATE_EXPIRING,
                severity,
                subject: format!("node/{}", c.node),
                message,
                since: now,
            },
        );
    }
    if !i.outages.is_empty() {
        let mut nodes = BTreeSet::new();
        let parts: Vec<String> = i
            .outages
            .iter()
            .map(|o| {
                nodes.insert(o.node.as_str());
                format!(
                    "{} for {} from {} ({} reports buffered, {} dropped)",
                    o.node,
                    humanize(o.seconds),
                    o.since.format("%H:%M:%S UTC"),
                    o.buffered,
                    o.dropped
                )
            })
            .collect();
        let since = i.outages.iter().map(|o| o.since).min().unwrap_or(now);
        out.insert(
            CONTROLLER_UNREACHABLE.to_owned(),
            Wanted {
                kind: CONTROLLER_UNREACHABLE,
                severity: Severity::Warning,
                subject: "controller".to_owned(),
                message: format!(
                    "{} node{} could not reach the controller's broker: {}",
                    nodes.len(),
                    if nodes.len() == 1 { "" } else { "s" },
                    parts.join("; ")
                ),
                since,
            },
        );
    }
    let after =
        chrono::Duration::from_std(i.settings.behind_after).unwrap_or(chrono::Duration::MAX);
    for b in i.behind.unwrap_or_default() {
        if now - b.since < after {
            continue;
        }
        let d = &b.behind;
        out.insert(
            format!("{NODE_BEHIND}:{}/{}", d.node, d.section),
            Wanted {
                kind: NODE_BEHIND,
                severity: Severity::Warning,
                subject: format!("node/{}", d.node),
                message: format!(
                    "{} is behind on its {} section for {}: generation {} declared, {} applied",
                    d.node,
                    d.section,
                    humanize(secs(b.since, now)),
                    d.declared,
                    d.applied.map_or("none".to_owned(), |a| a.to_string())
                ),
                since: b.since,
            },
        );
    }
    for q in i.queues.unwrap_or_default() {
        if q.dead_letter && q.messages > 0 {
            out.insert(
                format!("{DEAD_LETTER_QUEUE}:{}", q.queue),
                Wanted {
                    kind: DEAD_LETTER_QUEUE,
                    severity: Severity::Warning,
                    subject: format!("queue/{}", q.queue),
                    message: format!(
                        "the dead-letter queue `{}` holds {} message{}: read each one's x-mesh-reason, fix the sender, then purge it (docs/observability.md, Dead letters)",
                        q.queue,
                        q.messages,
                        if q.messages == 1 { "" } else { "s" }
                    ),
                    since: now,
                },
            );
        } else if !q.dead_letter && q.messages > q.warn_above {
            out.insert(
                format!("{QUEUE_DEPTH}:{}", q.queue),
                Wanted {
                    kind: QUEUE_DEPTH,
                    severity: Severity::Warning,
                    subject: format!("queue/{}", q.queue),
                    message: format!(
                        "queue `{}` holds {} messages, above its warning depth {}: the controller is not keeping up (or not consuming)",
                        q.queue, q.messages, q.warn_above
                    ),
                    since: now,
                },
            );
        }
    }
    out
}

/// Kinds whose open alerts stay as they are while the controller has not
/// observed what decides them.
pub(crate) fn unobserved_kinds(obs: &Observations) -> Vec<&'static str> {
    let mut keep = Vec::new();
    if obs.queues.is_none() {
        keep.extend([DEAD_LETTER_QUEUE, QUEUE_DEPTH]);
    }
    if obs.behind.is_none() {
        keep.push(NODE_BEHIND);
    }
    keep
}

/// Make the open alerts what `wanted` says: raise the new ones, resolve the
/// ones no longer wanted (but those of `keep` kinds), update the sentence of
/// the rest. Returns the record events to write.
pub(crate) async fn sync(
    tx: &mut PgConnection,
    wanted: &BTreeMap<String, Wanted>,
    keep: &[&str],
    now: DateTime<Utc>,
) -> Result<Vec<RecordEvent>, Error> {
    type Row = (Uuid, String, String, String, String, String, DateTime<Utc>);
    let open: Vec<Row> = sqlx::query_as(
        "SELECT id, key, kind, severity, subject, message, since FROM observability.alerts \
         WHERE resolved_at IS NULL FOR UPDATE",
    )
    .fetch_all(&mut *tx)
    .await?;
    let mut events = Vec::new();
    let mut seen = BTreeSet::new();
    for (id, key, kind, severity, subject, message, since) in open {
        seen.insert(key.clone());
        match wanted.get(&key) {
            None if keep.contains(&kind.as_str()) => {}
            None => {
                sqlx::query(
                    "UPDATE observability.alerts SET resolved_at = $2, updated_at = $2 WHERE id = $1",
                )
                .bind(id)
                .bind(now)
                .execute(&mut *tx)
                .await?;
                events.push(RecordEvent::new(RecordKind::AlertResolved(AlertChanged {
                    id,
                    kind,
                    severity: parse_severity(&severity),
                    subject,
                    message,
                    since,
                    resolved_at: Some(now),
                })));
            }
            Some(w) => {
                if w.message != message || w.severity.as_str() != severity {
                    sqlx::query(
                        "UPDATE observability.alerts SET message = $2, severity = $3, updated_at = $4 \
                         WHERE id = $1",
                    )
                    .bind(id)
                    .bind(&w.message)
                    .bind(w.severity.as_str())
                    .bind(now)
                    .execute(&mut *tx)
                    .await?;
                }
            }
        }
    }
    for (key, w) in wanted {
        if seen.contains(key) {
            continue;
        }
        let id = Uuid::now_v7();
        sqlx::query(
            "INSERT INTO observability.alerts (id, key, kind, severity, subject, message, since, updated_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        )
        .bind(id)
        .bind(key)
        .bind(w.kind)
        .bind(w.severity.as_str())
        .bind(&w.subject)
        .bind(&w.message)
        .bind(w.since)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        events.push(RecordEvent::new(RecordKind::AlertRaised(AlertChanged {
            id,
            kind: w.kind.to_owned(),
            severity: w.severity,
            subject: w.subject.clone(),
            message: w.message.clone(),
            since: w.since,
            resolved_at: None,
        })));
    }
    Ok(events)
}

pub(crate) fn parse_severity(s: &str) -> Severity {
    match s {
        "critical" => Severity::Critical,
        "info" => Severity::Info,
        _ => Severity::Warning,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> Settings {
        Settings::default()
    }

    fn empty<'a>(s: &'a Settings, nodes: &'a BTreeMap<String, NodeRow>) -> RuleInputs<'a> {
        RuleInputs {
            now: "2026-12-08T00:00:00Z".parse().unwrap(),
            settings: s,
            nodes,
            modules: &[],
            conditions: &[],
            certificates: &[],
            outages: &[],
            restarting: &[],
            oom_killed: &[],
            behind: None,
            queues: None,
        }
    }

    #[test]
    fn an_unreachable_node_says_for_how_long() {
        let s = settings();
        let nodes: BTreeMap<String, NodeRow> = [(
            "db-1".to_owned(),
            NodeRow {
                state: "unreachable".into(),
                revoked: false,
                unreachable_since: Some("2026-12-02T00:00:00Z".parse().unwrap()),
            },
        )]
        .into();
        let w = rules(&empty(&s, &nodes));
        let a = &w["node_unreachable:db-1"];
        assert!(
            a.message.starts_with("db-1 unreachable for 6 days"),
            "{}",
            a.message
        );
        assert_eq!(a.severity, Severity::Critical);
    }

    #[test]
    fn queues_alert_above_their_warning_depth_and_the_dead_letter_queue_at_one() {
        let s = settings();
        let nodes = BTreeMap::new();
        let queues = vec![
            QueueDepth {
                queue: "dead-letter".into(),
                messages: 1,
                warn_above: 0,
                dead_letter: true,
            },
            QueueDepth {
                queue: "reports.hello".into(),
                messages: 10,
                warn_above: 10,
                dead_letter: false,
            },
        ];
        let mut i = empty(&s, &nodes);
        i.queues = Some(&queues);
        let w = rules(&i);
        assert!(w.contains_key("dead_letter_queue:dead-letter"));
        assert!(
            !w.contains_key("queue_depth:reports.hello"),
            "at the depth is not above it"
        );
    }

    #[test]
    fn a_unit_oom_killed_three_times_is_alerted() {
        let s = settings();
        let nodes = BTreeMap::new();
        let oom = |kills| OomKilled {
            node: "db-1".into(),
            unit: "db".into(),
            module: "db".into(),
            state: "running".into(),
            kills,
        };
        let mut i = empty(&s, &nodes);
        let two = [oom(2)];
        i.oom_killed = &two;
        assert!(rules(&i).is_empty(), "two kills are not yet an alert");
        let three = [oom(3)];
        i.oom_killed = &three;
        let w = rules(&i);
        let a = &w["unit_oom_killed:db-1/db"];
        assert_eq!((a.kind, a.severity), (UNIT_OOM_KILLED, Severity::Warning));
        assert_eq!(a.subject, "unit/db-1/db");
        assert!(a.message.contains("OOM-killed 3 times"), "{}", a.message);
    }

    #[test]
    fn durations_read_at_a_glance() {
        assert_eq!(humanize(45), "45 s");
        assert_eq!(humanize(12 * 60), "12 min");
        assert_eq!(humanize(3 * 3600 + 20 * 60), "3 h 20 min");
        assert_eq!(humanize(6 * 86_400 + 5), "6 days");
    }
}
