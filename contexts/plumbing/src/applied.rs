//! Folding a batch of `applied` reports into one row per key (a node, or a node
//! and a section), so a context records a whole batch with one statement.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use mesh_protocol::{Applied, Envelope, Outcome, Report};

/// What a batch says about one key: the highest generation reported applied,
/// and the outcome, generation and error of the report that counts — that of
/// the highest generation, then the newest (`sent_at`, then `seq`).
#[derive(Debug, Clone, PartialEq)]
pub struct AppliedSummary {
    pub applied: Option<i64>,
    pub outcome: &'static str,
    pub generation: Option<i64>,
    pub error: Option<String>,
    newest: (i64, DateTime<Utc>, u64),
}

/// Fold `reports` by `key`; a report whose key is `None` is skipped.
pub fn fold<'a, K: Ord>(
    reports: &[(&'a Envelope<Report>, &'a Applied)],
    key: impl Fn(&'a Envelope<Report>, &'a Applied) -> Option<K>,
) -> BTreeMap<K, AppliedSummary> {
    let mut rows: BTreeMap<K, AppliedSummary> = BTreeMap::new();
    for (env, a) in reports {
        let Some(k) = key(env, a) else { continue };
        let generation = a.generation.map(|g| i64::try_from(g).unwrap_or(i64::MAX));
        let applied = if a.outcome == Outcome::Applied {
            generation
        } else {
            None
        };
        let row = rows.entry(k).or_insert(AppliedSummary {
            applied: None,
            outcome: "",
            generation: None,
            error: None,
            newest: (-1, DateTime::<Utc>::MIN_UTC, 0),
        });
        row.applied = row.applied.max(applied);
        let rank = (generation.unwrap_or(0), env.sent_at, env.seq);
        if rank >= row.newest {
            row.newest = rank;
            row.outcome = a.outcome.as_str();
            row.generation = generation;
            row.error = a.error_text();
        }
    }
    rows
}
