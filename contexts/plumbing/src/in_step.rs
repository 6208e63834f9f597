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
//! publishes each declaration, so it can only be ahead of what a node could
//! have applied, never behind: a stale entry sends a heartbeat down the
//! durable path once more, never skips one that needed it.

use std::collections::HashMap;
use std::sync::RwLock;

use mesh_protocol::{AppliedGenerations, Section};

/// Declared generations per node and section.
#[derive(Debug, Default)]
pub struct InStep {
    declared: RwLock<HashMap<String, AppliedGenerations>>,
}

impl InStep {
    pub fn new() -> Self {
        InStep::default()
    }

    /// Record that `generation` of `section` was declared to `node` (never
    /// lowers what is there).
    pub fn declared(&self, node: &str, section: Section, generation: u64) {
        let mut map = self.declared.write().unwrap_or_else(|e| e.into_inner());
        let entry = map.entry(node.to_owned()).or_default();
        let g = entry.entry(section).or_insert(0);
        *g = (*g).max(generation);
    }

    /// Load what a context's section table holds: `(node, generation)` rows.
    pub fn load(&self, section: Section, rows: impl IntoIterator<Item = (String, i64)>) {
        let mut map = self.declared.write().unwrap_or_else(|e| e.into_inner());
        for (node, generation) in rows {
            let g = map
                .entry(node)
                .or_default()
                .entry(section)
                .or_insert(0);
            *g = (*g).max(u64::try_from(generation).unwrap_or(0));
        }
    }

    /// True when `applied` names exactly the generations declared to `node`
    /// (a section declared nothing and reported 0 or absent counts as equal).
    pub fn in_step(&self, node: &str, applied: &AppliedGenerations) -> bool {
        let map = self.declared.read().unwrap_or_else(|e| e.into_inner());
        let none = AppliedGenerations::new();
        let declared = map.get(node).unwrap_or(&none);
        let reported_match = applied
            .iter()
            .all(|(s, g)| declared.get(s).copied().unwrap_or(0) == *g);
        let declared_match = declared
            .iter()
            .all(|(s, g)| applied.get(s).copied().unwrap_or(0) == *g);
        reported_match && declared_match
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
        assert!(idx.in_step("n1", &gens(&[])), "nothing declared, nothing applied");
        assert!(idx.in_step("n1", &gens(&[(Section::Config, 0)])));
        assert!(!idx.in_step("n1", &gens(&[(Section::Config, 1)])), "ahead");
        idx.load(Section::Config, [("n1".to_owned(), 3)]);
        idx.declared("n1", Section::Inventory, 2);
        assert!(idx.in_step("n1", &gens(&[(Section::Config, 3), (Section::Inventory, 2)])));
        assert!(!idx.in_step("n1", &gens(&[(Section::Config, 3)])), "inventory missing");
        assert!(!idx.in_step("n1", &gens(&[(Section::Config, 2), (Section::Inventory, 2)])), "behind");
        idx.declared("n1", Section::Config, 1);
        assert!(
            idx.in_step("n1", &gens(&[(Section::Config, 3), (Section::Inventory, 2)])),
            "a lower generation never lowers the index"
        );
        assert!(!idx.in_step("n2", &gens(&[(Section::Config, 3)])));
    }
}
