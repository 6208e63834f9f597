//! The controller: one process, on one assigned node (never elected, and fenced:
//! a second instance refuses to run, see [`fence`]). It consumes
//! the report queues, routes each message to the bounded context that owns it,
//! relays the contexts' outboxes to the broker, and serves the HTTP API.
//!
//! It is the only crate that wires AMQP (lapin) and HTTP (axum) to the contexts.
//! It never writes a context's tables itself: each context does, through its own
//! pool and role. It acknowledges a report only after every context committed.

pub mod access;
pub mod accounts;
pub mod alertmanager;
pub mod amqp;
pub mod api;
pub mod app;
pub mod artifacts;
pub mod auth;
pub mod broker_stats;
pub mod config;
pub mod contexts;
pub mod dashboard;
pub mod evaluator;
pub mod fence;
pub mod logs;
pub mod metrics;
pub mod oidc;
pub mod openapi;
pub mod pipeline;
pub mod probe;
pub mod relay;
pub mod replica;
pub mod rollout_clock;
pub mod router;
pub mod tls;
pub mod upgrade;
