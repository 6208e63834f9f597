// config.sections takes the one shape of mesh_plumbing::section (table shape 1):
// every row is kept; the copy of applied outcomes nobody read goes (what nodes
// applied is inventory's record). Decision 0015.
pub fn migration() -> String {
    mesh_plumbing::section::table::adopt_v1("config")
}
