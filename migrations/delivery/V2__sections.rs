// delivery.sections in the one shape of mesh_plumbing::section (table shape 1).
pub fn migration() -> String {
    mesh_plumbing::section::table::create_v1("delivery")
}
