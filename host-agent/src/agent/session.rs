//! One broker session, on one connection: state the node (hello, units,
//! resources, certificates, health), send the buffered reports within a
//! window of unconfirmed publishes, beat, consume the node's declaration
//! queue and hand each delivery to [`super::declarations`], until the
//! connection is lost or shutdown comes (then flush what can be flushed
//! before the deadline).
//!
//! A refused publish or a failed consume never ends the session: the
//! channel is opened again after a backoff. Only a closed connection does.

use std::time::Duration;

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use lapin::{Channel, Confirmation, Connection, Consumer, Event};
use mesh_protocol::ItemOutcome;
use mesh_protocol::topology::declaration_queue;
use tokio::time::{Instant, Interval, MissedTickBehavior, sleep_until};
use tracing::{debug, info, warn};
use uuid::Uuid;

use super::backoff::Backoff;
use super::channel::{
    CLOSE_TIMEOUT, ConfirmFuture, next_delivery, open_publisher, publish, start_consumer,
};
use super::{Agent, Shutdown};

/// Reports handed to the broker and not yet confirmed, at most.
const PUBLISH_WINDOW: usize = 64;

/// How a connected session ended.
pub(super) enum SessionEnd {
    Shutdown,
    Lost(String),
}

/// What a session holds besides the agent: its channels, the confirms in
/// flight, and the pauses and backoffs of its publishing and consuming.
struct Live {
    publisher: Channel,
    confirms: FuturesUnordered<ConfirmFuture>,
    /// Heartbeats' confirms: awaited only so that lapin lets go of them (a
    /// dropped confirm stays registered on its channel), their outcome unused.
    beats: FuturesUnordered<lapin::PublisherConfirm>,
    consumer: Option<(Channel, Consumer)>,
    consume_backoff: Backoff,
    consume_at: Instant,
    publish_backoff: Backoff,
    paused_until: Option<Instant>,
    queue: String,
}

impl Agent {
    /// Run one session on `conn` until it is lost or shutdown comes.
    ///
    /// Longer than most: one `select!` over every event of a session, each
    /// arm a line or a call, so that what a session waits on reads in one
    /// place.
    pub(super) async fn session(
        &mut self,
        conn: &Connection,
        heartbeat: &mut Interval,
        shutdown: &mut Shutdown<'_>,
    ) -> SessionEnd {
        let mut live = match self.open_session(conn).await {
            Ok(live) => live,
            Err(end) => return end,
        };
        let summary_every = Duration::from_secs(self.config.health_summary_secs.max(1));
        let mut summary = tokio::time::interval_at(Instant::now() + summary_every, summary_every);
        summary.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut events = conn.events_listener();

        loop {
            if let Err(end) = self.fill_window(conn, &mut live).await {
                return end;
            }
            let certs_due = self.certs_due();
            let step = tokio::select! {
                () = &mut *shutdown => {
                    if let Some((ch, _)) = live.consumer.take() {
                        // Unacked deliveries (there are none mid-apply) go back to the queue.
                        let _ = tokio::time::timeout(CLOSE_TIMEOUT, ch.close(200, "agent shutting down".into())).await;
                    }
                    self.flush(&live.publisher, live.confirms).await;
                    return SessionEnd::Shutdown;
                }
                Some(_) = live.beats.next(), if !live.beats.is_empty() => Ok(()),
                Some((id, result)) = live.confirms.next(), if !live.confirms.is_empty() => {
                    self.on_confirm(conn, &mut live, id, result).await
                }
                () = self.reporter.due() => {
                    self.push_units();
                    Ok(())
                },
                found = self.resources.found() => {
                    self.resources_found(found);
                    Ok(())
                },
                () = self.health.due() => {
                    self.push_health(false);
                    Ok(())
                },
                _ = summary.tick() => {
                    if self.health.any() {
                        self.push_health(true);
                    }
                    Ok(())
                }
                Some(items) = next_change(&mut self.connectivity_changes) => {
                    self.restate_connectivity(items);
                    Ok(())
                },
                () = sleep_until(certs_due), if self.certs.is_some() => {
                    self.push_certificates(false);
                    Ok(())
                },
                _ = heartbeat.tick() => {
                    if let Some(confirm) = self.beat(&live.publisher).await {
                        live.beats.push(confirm);
                    }
                    lost_unless_connected(conn, "connection is no longer open")
                }
                ev = events.next() => on_event(conn, ev),
                () = sleep_until(live.consume_at), if live.consumer.is_none() => {
                    self.consume(conn, &mut live).await
                }
                () = sleep_until(live.paused_until.unwrap_or_else(Instant::now)), if live.paused_until.is_some() => {
                    live.paused_until = None;
                    Ok(())
                }
                delivery = next_delivery(&mut live.consumer), if live.consumer.is_some() => {
                    self.on_delivery(conn, &mut live, heartbeat, delivery).await
                }
            };
            if let Err(end) = step {
                return end;
            }
        }
    }

    /// Open the publishing channel and state the node: what every session
    /// begins with.
    async fn open_session(&mut self, conn: &Connection) -> Result<Live, SessionEnd> {
        let publisher = match open_publisher(conn, self.config.connect_timeout).await {
            Ok(ch) => ch,
            Err(e) => {
                return Err(SessionEnd::Lost(format!(
                    "cannot open the publishing channel: {e}"
                )));
            }
        };
        self.buffer.reset_in_flight();
        self.push_hello();
        self.push_units();
        self.push_resources();
        self.push_certificates(true);
        // Probe results, whole, after every connect (if there are any).
        if self.health.any() {
            self.push_health(true);
        }
        Ok(Live {
            publisher,
            confirms: FuturesUnordered::new(),
            beats: FuturesUnordered::new(),
            consumer: None,
            consume_backoff: Backoff::new(self.config.reconnect_min, self.config.reconnect_max),
            consume_at: Instant::now(),
            publish_backoff: Backoff::new(self.config.reconnect_min, self.config.reconnect_max),
            paused_until: None,
            queue: declaration_queue(&self.creds.node),
        })
    }

    /// Fill the window of unconfirmed publishes from the buffer (unless
    /// publishing is paused after a failure).
    async fn fill_window(&mut self, conn: &Connection, live: &mut Live) -> Result<(), SessionEnd> {
        if live.paused_until.is_some_and(|t| t > Instant::now()) {
            return Ok(());
        }
        live.paused_until = None;
        while live.confirms.len() < PUBLISH_WINDOW {
            let Some(out) = self.buffer.next_to_send() else {
                break;
            };
            match publish(&live.publisher, &self.creds.node, &out).await {
                Ok(f) => live.confirms.push(f),
                Err(e) => {
                    self.buffer.retry(out.id);
                    warn!(error = %e, "publish failed");
                    lost_unless_connected(conn, &e.to_string())?;
                    live.publisher = reopen_publisher(conn, self.config.connect_timeout).await?;
                    live.paused_until = Some(Instant::now() + live.publish_backoff.next_delay());
                    break;
                }
            }
        }
        Ok(())
    }

    /// A confirm came: the report is done, or it is retried after a pause on
    /// a fresh channel.
    async fn on_confirm(
        &mut self,
        conn: &Connection,
        live: &mut Live,
        id: Uuid,
        result: Result<Confirmation, lapin::Error>,
    ) -> Result<(), SessionEnd> {
        let Err(reason) = self.confirmed(id, result) else {
            live.publish_backoff.reset();
            return Ok(());
        };
        warn!(%reason, "report not accepted; will retry");
        live.paused_until = Some(Instant::now() + live.publish_backoff.next_delay());
        lost_unless_connected(conn, &reason)?;
        // A fresh channel for what follows, whether this one is closed or
        // only refused: a channel that published to a quorum queue whose
        // leader's node died can keep being refused for it after a new
        // leader is elected, while a new channel finds the leader (the relay
        // does the same: decision 0043). Seen on the three-node cluster under
        // load: an `applied` report nacked for three minutes. The old
        // channel's confirms still in flight resolve by themselves (retried
        // if refused).
        let fresh = reopen_publisher(conn, self.config.connect_timeout).await?;
        let old = std::mem::replace(&mut live.publisher, fresh);
        if old.status().connected() {
            tokio::spawn(async move {
                let _ = tokio::time::timeout(
                    CLOSE_TIMEOUT,
                    old.close(200, "replaced after a refused publish".into()),
                )
                .await;
            });
        }
        Ok(())
    }

    /// Start consuming the declaration queue; until the controller declared
    /// it, try again after a backoff.
    async fn consume(&mut self, conn: &Connection, live: &mut Live) -> Result<(), SessionEnd> {
        let queue = &live.queue;
        match start_consumer(
            conn,
            queue,
            self.config.prefetch,
            self.config.connect_timeout,
        )
        .await
        {
            Ok(c) => {
                info!(%queue, "consuming declarations");
                live.consume_backoff.reset();
                live.consumer = Some(c);
            }
            Err(e) => {
                lost_unless_connected(conn, &e.to_string())?;
                let delay = live.consume_backoff.next_delay();
                info!(%queue, error = %e, retry_in = ?delay, "cannot consume declarations yet (the controller declares the queue when it first hears of this node)");
                live.consume_at = Instant::now() + delay;
            }
        }
        Ok(())
    }

    /// A delivery (or the consumer's end): handle it, beat at a new interval
    /// if the declaration changed it, and consume again if the channel failed.
    async fn on_delivery(
        &mut self,
        conn: &Connection,
        live: &mut Live,
        heartbeat: &mut Interval,
        delivery: Option<Result<lapin::message::Delivery, lapin::Error>>,
    ) -> Result<(), SessionEnd> {
        let failed = match delivery {
            Some(Ok(d)) => {
                let handled = self.handle_delivery(d, &live.publisher).await;
                if std::mem::take(&mut self.retime) {
                    let interval = self.interval();
                    *heartbeat = tokio::time::interval_at(Instant::now() + interval, interval);
                    heartbeat.set_missed_tick_behavior(MissedTickBehavior::Delay);
                }
                match handled {
                    Ok(confirm) => {
                        live.beats.extend(confirm);
                        return Ok(());
                    }
                    Err(e) => {
                        lost_unless_connected(conn, &e)?;
                        warn!(error = %e, "declaration channel failed; re-consuming");
                        self.reconsume(live);
                        return Ok(());
                    }
                }
            }
            Some(Err(e)) => e.to_string(),
            None => "consumer cancelled".into(),
        };
        lost_unless_connected(conn, "connection closed")?;
        warn!(reason = %failed, "declaration consumer stopped; re-consuming");
        self.reconsume(live);
        Ok(())
    }

    /// Drop the consumer and start another after a backoff.
    fn reconsume(&mut self, live: &mut Live) {
        live.consumer = None;
        live.consume_at = Instant::now() + live.consume_backoff.next_delay();
    }

    /// Publish what can be published before the shutdown deadline.
    async fn flush(&mut self, publisher: &Channel, mut confirms: FuturesUnordered<ConfirmFuture>) {
        let deadline = Instant::now() + self.config.shutdown_timeout;
        let mut failed = false;
        loop {
            while !failed && confirms.len() < PUBLISH_WINDOW {
                let Some(out) = self.buffer.next_to_send() else {
                    break;
                };
                match publish(publisher, &self.creds.node, &out).await {
                    Ok(f) => confirms.push(f),
                    Err(_) => {
                        self.buffer.retry(out.id);
                        failed = true;
                    }
                }
            }
            if confirms.is_empty() {
                return;
            }
            tokio::select! {
                Some((id, result)) = confirms.next() => {
                    if self.confirmed(id, result).is_err() {
                        failed = true;
                    }
                }
                () = sleep_until(deadline) => {
                    warn!("shutdown deadline reached with {} reports unconfirmed", self.buffer.len());
                    return;
                }
            }
        }
    }

    /// Handle a publisher confirm. Err names why the report must be sent again.
    fn confirmed(
        &mut self,
        id: Uuid,
        result: Result<Confirmation, lapin::Error>,
    ) -> Result<(), String> {
        let outcome = match result {
            Ok(Confirmation::Ack(None)) => Ok(()),
            Ok(Confirmation::Ack(Some(returned))) => Err(format!(
                "returned by the broker ({} {}): no queue bound for it yet",
                returned.reply_code, returned.reply_text
            )),
            Ok(Confirmation::Nack(_)) => {
                Err("refused by the broker (nack; queue full?)".to_owned())
            }
            Ok(Confirmation::NotRequested) => Err("publisher confirms are not enabled".to_owned()),
            Err(e) => Err(e.to_string()),
        };
        match outcome {
            Ok(()) => {
                self.report_confirmed(id);
                Ok(())
            }
            Err(reason) => {
                self.buffer.retry(id);
                Err(reason)
            }
        }
    }
}

/// A connection-level event. Channel-level errors (a 404 on the declaration
/// queue) arrive here too; only a closed connection ends the session.
fn on_event(conn: &Connection, ev: Option<Event>) -> Result<(), SessionEnd> {
    match ev {
        Some(Event::Error(e)) => {
            lost_unless_connected(conn, &e.to_string())?;
            debug!(error = %e, "channel error");
        }
        Some(Event::ConnectionBlocked(reason)) => warn!(%reason, "the broker blocked publishing"),
        Some(Event::ConnectionUnblocked) => info!("the broker unblocked publishing"),
        Some(_) => {}
        None => return Err(SessionEnd::Lost("connection event stream ended".into())),
    }
    Ok(())
}

/// Err (the session is lost, for `reason`) unless `conn` is still open.
fn lost_unless_connected(conn: &Connection, reason: &str) -> Result<(), SessionEnd> {
    if conn.status().connected() {
        Ok(())
    } else {
        Err(SessionEnd::Lost(reason.to_owned()))
    }
}

/// A new publishing channel on `conn`; Err ends the session.
async fn reopen_publisher(conn: &Connection, deadline: Duration) -> Result<Channel, SessionEnd> {
    open_publisher(conn, deadline)
        .await
        .map_err(|e| SessionEnd::Lost(format!("cannot reopen the publishing channel: {e}")))
}

/// The next outcomes a connectivity check changed (never, without checks).
async fn next_change(
    changes: &mut Option<tokio::sync::mpsc::Receiver<Vec<ItemOutcome>>>,
) -> Option<Vec<ItemOutcome>> {
    match changes {
        Some(c) => c.recv().await,
        None => std::future::pending().await,
    }
}
