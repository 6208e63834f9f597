// provisioning.sections in the one shape of mesh_plumbing::section (table shape 1):
// the provisioning section declared to each provider node.
pub fn migration() -> String {
    mesh_plumbing::section::table::create_v1("provisioning")
}
