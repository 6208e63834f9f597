//! A small client of the OCI distribution API (stub; built by issue 14).
