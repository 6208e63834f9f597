//! Which generation of each section was declared to each node, in memory: the
//! controller's cheap answer to "is this heartbeat's node in step?".
//!
//! A heartbeat carries the generations its node applied. When they equal what
//! was declared to the node, no context has anything to do with it but note
//! that the node is alive, and the controller does that in memory
//! (docs/decisions/0023). Only a heartbeat out of step (behind, ahead, or of a
//! node this index has not heard of) takes the durable path, where each context
//! catches the node up as before.
//!
//! Filled at start from each context's `<schema>.sections`
//! ([`crate::section::Sections::generations`]) and raised by the relay as it
//! publishes each declaration (the newest outbox row wins, whatever its
//! generation). A wrong entry can only send heartbeats down the durable path,
//! where each context compares them with what it stored: it never hides a
//! node that is behind, since the entry of a declaration is raised only once
//! the broker confirmed it.

use std::collections::{BTreeMap, HashMap};
use std::sync::RwLock;

use mesh_protocol::{AppliedGenerations, Section};

/// A declared generation and the outbox row that carried it (0: loaded at
/// start), which orders declarations confirmed out of order.
type Entry = (u64, i64);

/// Declared generations per node and section.
#[derive(Debug, Default)]
pub struct InStep {
    declared: RwLock<HashMap<String, BTreeMap<Section, Entry>>>,
}

impl InStep {
    pub fn new() -> Self {
        InStep::default()
    }

    /// Record that `generation` of `section` was declared to `node` by the
    /// outbox row `row` (ids grow with each row a context writes). A row older
    /// than the one recorded is ignored; a newer one wins even with a lower
    /// generation (a section re-created after its row was lost starts again).
    pub fn declared(&self, node: &str, section: Section, generation: u64, row: i64) {
        let mut map = self.declared.write().unwrap_or_else(|e| e.into_inner());
        let entry = map
            .entry(node.to_owned())
            .or_default()
            .entry(section)
            .or_insert((0, i64::MIN));
        if row >= entry.1 {
            *entry = (generation, row);
        }
    }

    /// Load what a context's section table holds: `(node, generation)` rows.
    pub fn load(&self, section: Section, rows: impl IntoIterator<Item = (String, i64)>) {
        let mut map = self.declared.write().unwrap_or_else(|e| e.into_inner());
        for (node, generation) in rows {
            let generation = u64::try_from(generation).unwrap_or(0);
            map.entry(node)
                .or_default()
                .insert(section, (generation, 0));
        }
    }

    /// True when `applied` names exactly the generations declared to `node`
    /// (a section declared nothing and reported 0 or absent counts as equal).
    pub fn in_step(&self, node: &str, applied: &AppliedGenerations) -> bool {
        let map = self.declared.read().unwrap_or_else(|e| e.into_inner());
        let none = BTreeMap::new();
        let declared = map.get(node).unwrap_or(&none);
        let generation = |s: &Section| declared.get(s).map_or(0, |e| e.0);
        applied.iter().all(|(s, g)| generation(s) == *g)
            && declared
                .iter()
                .all(|(s, e)| applied.get(s).copied().unwrap_or(0) == e.0)
    }

    /// Every declared generation above 0, as `(node, section, generation)`.
    pub fn snapshot(&self) -> Vec<(String, Section, u64)> {
        let map = self.declared.read().unwrap_or_else(|e| e.into_inner());
        map.iter()
            .flat_map(|(node, sections)| {
                sections
                    .iter()
                    .filter(|(_, e)| e.0 > 0)
                    .map(|(s, e)| (node.clone(), *s, e.0))
            })
            .collect()
    }

    /// Nodes known (those with at least one declared section).
    pub fn len(&self) -> usize {
        self.declared
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gens(pairs: &[(Section, u64)]) -> AppliedGenerations {
        pairs.iter().copied().collect()
    }

    #[test]
    fn in_step_only_when_every_section_matches() {
        let idx = InStep::new();
        assert!(
            idx.in_step("n1", &gens(&[])),
            "nothing declared, nothing applied"
        );
        assert!(idx.in_step("n1", &gens(&[(Section::Config, 0)])));
        assert!(!idx.in_step("n1", &gens(&[(Section::Config, 1)])), "ahead");
        idx.load(Section::Config, [("n1".to_owned(), 3)]);
        idx.declared("n1", Section::Inventory, 2, 10);
        assert!(idx.in_step(
            "n1",
            &gens(&[(Section::Config, 3), (Section::Inventory, 2)])
        ));
        assert!(
            !idx.in_step("n1", &gens(&[(Section::Config, 3)])),
            "inventory missing"
        );
        assert!(
            !idx.in_step(
                "n1",
                &gens(&[(Section::Config, 2), (Section::Inventory, 2)])
            ),
            "behind"
        );
        assert!(!idx.in_step("n2", &gens(&[(Section::Config, 3)])));
    }

    #[test]
    fn the_newest_row_wins_whatever_its_generation() {
        let idx = InStep::new();
        idx.declared("n1", Section::Config, 5, 20);
        // Confirmed out of order: an older row changes nothing.
        idx.declared("n1", Section::Config, 4, 19);
        assert!(idx.in_step("n1", &gens(&[(Section::Config, 5)])));
        // The section was lost and declared again from 1: a newer row.
        idx.declared("n1", Section::Config, 1, 21);
        assert!(idx.in_step("n1", &gens(&[(Section::Config, 1)])));
        assert!(!idx.in_step("n1", &gens(&[(Section::Config, 5)])));
    }
}
