// inventory.sections takes the one shape of mesh_plumbing::section (table shape
// 1), every row kept, and inventory's own constraint on it again: a section
// belongs to a node inventory knows, and goes with it. Decision 0015.
pub fn migration() -> String {
    mesh_plumbing::section::table::adopt_v1("inventory")
        + "ALTER TABLE inventory.sections ADD CONSTRAINT sections_node_fkey \
           FOREIGN KEY (node) REFERENCES inventory.nodes (id) ON DELETE CASCADE;\n"
}
