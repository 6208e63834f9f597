//! The delivery context (stub; built by issue 14).
