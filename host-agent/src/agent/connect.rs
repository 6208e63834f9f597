//! Reaching the broker and staying there: connect to one endpoint after
//! another (the credentials' own, the configured `brokers`, then the mesh's
//! endpoints the controller declared; decision 0044), run a session on the
//! connection, and when it is lost, mark an outage and connect again after a
//! capped, jittered backoff. Heartbeats keep their rhythm while disconnected
//! (each one missed is counted in the outage), and provisioning findings keep
//! being kept.

use std::time::Duration;

use lapin::{Connection, ConnectionProperties};
use rand::Rng;
use tokio::time::{Instant, Interval, MissedTickBehavior, sleep_until};
use tracing::{debug, info, warn};

use super::backoff::Backoff;
use super::channel::CLOSE_TIMEOUT;
use super::session::SessionEnd;
use super::{Agent, OutageTrack, Shutdown};
use crate::broker::{BrokerError, Candidate};

impl Agent {
    /// Connect, run a session, and connect again when it is lost, until
    /// `shutdown` resolves.
    pub(super) async fn serve(&mut self, shutdown: Shutdown<'_>) {
        let mut shutdown = shutdown;
        let mut heartbeat = self.first_heartbeat();
        let mut backoff = Backoff::new(self.config.reconnect_min, self.config.reconnect_max);
        let mut connected_before = false;
        // The credentials' own endpoint, then each of `brokers`, then the
        // mesh's endpoints the controller declared and the store keeps
        // (decision 0044), each once: a failed attempt or a lost session
        // moves on to the next one. The list is taken again before every
        // attempt (what the controller declared meanwhile counts).
        let configured = match self.config.broker_endpoints() {
            Ok(list) => list,
            Err(e) => {
                warn!(error = %e, "ignoring the brokers setting");
                Vec::new()
            }
        };
        let mut at = 0usize;

        loop {
            let endpoints =
                crate::broker::candidates(&self.creds, &configured, &self.store.broker_endpoints());
            let candidate = endpoints[at % endpoints.len()].clone();
            let (endpoint, source) = (&candidate.endpoint, candidate.source.as_str());
            let Some(attempt) = self
                .connect(&candidate, &mut heartbeat, &mut shutdown)
                .await
            else {
                return;
            };
            let conn = match attempt {
                Ok(conn) => conn,
                Err(e) => {
                    if matches!(e, BrokerError::TimedOut { .. }) {
                        warn!(url = %self.creds.redacted_url(), %endpoint, source, error = %e, "connecting to the broker timed out; trying the next endpoint");
                    } else {
                        warn!(url = %self.creds.redacted_url(), %endpoint, source, error = %e, "cannot connect to the broker");
                    }
                    at = (at + 1) % endpoints.len();
                    if !self.wait(&mut backoff, &mut heartbeat, &mut shutdown).await {
                        return;
                    }
                    continue;
                }
            };
            self.reached_broker(connected_before);
            connected_before = true;
            backoff.reset();
            info!(url = %self.creds.redacted_url(), %endpoint, source, "connected to the broker");
            match self.session(&conn, &mut heartbeat, &mut shutdown).await {
                SessionEnd::Shutdown => {
                    mesh_amqp::close(&conn, "agent shutting down", CLOSE_TIMEOUT).await;
                    info!("shut down; {} reports left unsent", self.buffer.len());
                    return;
                }
                SessionEnd::Lost(reason) => {
                    warn!(%reason, %endpoint, source, "lost the broker connection");
                    at = (at + 1) % endpoints.len();
                    self.lost_broker();
                    mesh_amqp::close(&conn, "agent reconnecting", CLOSE_TIMEOUT).await;
                    self.buffer.reset_in_flight();
                    if !self.wait(&mut backoff, &mut heartbeat, &mut shutdown).await {
                        return;
                    }
                }
            }
        }
    }

    /// The heartbeat timer: at the declared plan's interval (else the
    /// configured one), its first tick at a random point of the first
    /// interval, so that a fleet started together does not beat together.
    fn first_heartbeat(&self) -> Interval {
        let interval = self.interval();
        if let Some(plan) = self.plan {
            info!(
                interval_ms = plan.interval_ms,
                "beating at the interval the controller declared"
            );
        }
        let first = rand::rng().random_range(Duration::ZERO..=interval);
        let mut heartbeat = tokio::time::interval_at(Instant::now() + first, interval);
        heartbeat.set_missed_tick_behavior(MissedTickBehavior::Delay);
        heartbeat
    }

    /// One connection attempt to `candidate`, still beating and keeping
    /// provisioning findings meanwhile. None if shutdown came first.
    async fn connect(
        &mut self,
        candidate: &Candidate,
        heartbeat: &mut Interval,
        shutdown: &mut Shutdown<'_>,
    ) -> Option<Result<Connection, BrokerError>> {
        let props = ConnectionProperties::default()
            .with_connection_name(format!("mesh-agent {}", self.creds.node).into());
        let creds = self.creds.clone();
        let connect = crate::broker::connect(
            &creds,
            candidate.target.as_ref(),
            self.config.amqp_heartbeat,
            self.config.connect_timeout,
            props,
        );
        tokio::pin!(connect);
        loop {
            tokio::select! {
                () = &mut *shutdown => {
                    info!("shutdown while disconnected; {} reports left unsent", self.buffer.len());
                    return None;
                }
                _ = heartbeat.tick() => self.missed_heartbeat(),
                found = self.resources.found() => self.resources_found(found),
                r = &mut connect => return Some(r),
            }
        }
    }

    /// A connection is up: the outage (if any) is over for the metrics.
    fn reached_broker(&mut self, connected_before: bool) {
        if connected_before {
            self.metrics.reconnected();
        }
        if let Some(at) = self.disconnected_at.take() {
            self.metrics.outage_ended(at.elapsed().as_secs_f64());
        }
        self.metrics.set_connected(true);
    }

    /// The broker connection is gone: an outage begins (unless the last one
    /// was not yet stated in a confirmed hello: it goes on).
    fn lost_broker(&mut self) {
        self.metrics.set_connected(false);
        self.metrics.outage_began();
        self.disconnected_at = Some(Instant::now());
        self.outage_hello = None;
        if self.outage.is_none() {
            self.outage = Some(OutageTrack {
                since: chrono::Utc::now(),
                at: Instant::now(),
                dropped: 0,
            });
        }
    }

    /// Wait one backoff delay, still beating. False if shutdown came first.
    async fn wait(
        &mut self,
        backoff: &mut Backoff,
        heartbeat: &mut Interval,
        shutdown: &mut Shutdown<'_>,
    ) -> bool {
        let until = Instant::now() + backoff.next_delay();
        loop {
            tokio::select! {
                () = &mut *shutdown => {
                    info!("shutdown while disconnected; {} reports left unsent", self.buffer.len());
                    return false;
                }
                _ = heartbeat.tick() => self.missed_heartbeat(),
                found = self.resources.found() => self.resources_found(found),
                () = sleep_until(until) => return true,
            }
        }
    }

    /// A heartbeat while disconnected: nothing to send it on, and liveness
    /// has no use for an old one (heartbeats are never buffered).
    fn missed_heartbeat(&mut self) {
        debug!("heartbeat skipped: not connected");
        if let Some(o) = &mut self.outage {
            o.dropped = o.dropped.saturating_add(1);
        }
    }
}
