// Rebuild when a migration is added: embed_migrations! reads the folder at
// compile time, and cargo does not know about files it has not seen yet.
fn main() {
    println!("cargo:rerun-if-changed=../../migrations/provisioning");
}
