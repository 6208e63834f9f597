//! `GET /v1/events`: the record as server-sent events (viewer role).
//!
//! Each client gets a task that reads the table in pages after its position
//! and hands events to a bounded buffer; the response streams that buffer. A
//! client that leaves the buffer full (it reads too slowly) is dropped with a
//! last `event: dropped` saying why; nobody waits for it. New events wake the
//! tasks after their batch committed (a poll bounds a missed wake-up).

use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use mesh_plumbing::api::{ApiQuery, Problem};
use mesh_plumbing::openapi::{BadRequest, Busy, Gone, Unprocessable};
use mesh_protocol::NodeId;
use serde::Deserialize;
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::TrySendError;
use utoipa::IntoParams;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::events::{self, EventView, Filter, Position};
use crate::{Error, Observability};

/// The header a reconnecting SSE client sends: the last id it received.
pub const LAST_EVENT_ID: &str = "Last-Event-ID";

pub(crate) fn routes() -> OpenApiRouter<Arc<Observability>> {
    OpenApiRouter::new().routes(routes!(stream_events))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
struct EventsParams {
    /// Only events of this context, e.g. `inventory`.
    context: Option<String>,
    /// Only events of this name within their context, e.g. `node.joined`.
    kind: Option<String>,
    /// Only events whose body names this node.
    node: Option<String>,
    /// Only events whose body names this module.
    module: Option<String>,
    /// Resume after this position, for clients that cannot set
    /// `Last-Event-ID` (the header wins when both are given).
    after: Option<String>,
    /// `false`: end the stream once every kept event after the position was
    /// sent, instead of following new ones. Default `true`.
    follow: Option<bool>,
}

/// The record as server-sent events: each with `id: <position>`,
/// `event: <context>.<event>` and the event as JSON `data` (position, id,
/// context, event, node, module, sent_at, body). Without a position the
/// stream starts at the newest event (only what happens from now); with
/// `Last-Event-ID` (or `after`) it sends every kept event after it first, in
/// order. Events are kept for the controller's `event_retention_secs`
/// (default 24 h); an older position is answered 410: re-list, then follow
/// again. Operators' audit entries are not on the stream (`GET /v1/audit`,
/// admin). A client that reads too slowly is sent `event: dropped` with the
/// reason and disconnected; at most `event_streams` are open at once (503).
#[utoipa::path(
    get,
    path = "/v1/events",
    tag = "observability",
    params(
        EventsParams,
        ("Last-Event-ID" = Option<String>, Header, description = "Resume after this position (the `id` of the last event received)."),
    ),
    responses(
        (status = 200, description = "The event stream", content_type = "text/event-stream", body = String),
        BadRequest,
        Gone,
        Unprocessable,
        Busy,
    )
)]
async fn stream_events(
    State(obs): State<Arc<Observability>>,
    headers: HeaderMap,
    ApiQuery(params): ApiQuery<EventsParams>,
) -> Result<Response, Problem> {
    if let Some(node) = &params.node {
        NodeId::parse(node).map_err(|e| Problem::unprocessable("node", e.to_string()))?;
    }
    let asked = match headers.get(LAST_EVENT_ID) {
        Some(v) => {
            let s = v.to_str().map_err(|_| Error::Invalid {
                field: LAST_EVENT_ID.to_owned(),
                reason: "not visible ASCII".to_owned(),
            })?;
            Some(Position::parse(LAST_EVENT_ID, s)?)
        }
        None => params
            .after
            .as_deref()
            .map(|s| Position::parse("after", s))
            .transpose()?,
    };
    let permit = obs
        .streams
        .clone()
        .try_acquire_owned()
        .map_err(|_| Error::TooManyStreams(obs.settings.max_streams))?;
    let (through, newest) = events::bounds(&obs.pool).await?;
    let start = match asked {
        Some(p) if p < through => {
            return Err(Error::Gone {
                asked: p.0,
                through: through.0,
            }
            .into());
        }
        Some(p) => p,
        None => newest,
    };
    let filter = Filter {
        context: params.context,
        kind: params.kind,
        node: params.node,
        module: params.module,
    };
    // A history (`follow=false`) ends at what was appended when it was
    // asked: everything through `newest`. The replica may serve it once it
    // has replayed that far (decision 0041); a stream that follows reads the
    // primary, which its wake-ups come from.
    let through = (!params.follow.unwrap_or(true)).then_some(newest);
    let (tx, rx) = mpsc::channel(obs.settings.stream_buffer.max(1));
    let dropped = Arc::new(Mutex::new(None::<String>));
    tokio::spawn(feed(
        obs,
        start,
        filter,
        through,
        tx,
        dropped.clone(),
        permit,
    ));
    let stream = futures_util::stream::unfold(Some((rx, dropped)), |state| async move {
        let (mut rx, dropped) = state?;
        match rx.recv().await {
            Some(view) => Some((Ok::<_, Infallible>(event(&view)), Some((rx, dropped)))),
            None => {
                let reason = dropped.lock().ok().and_then(|mut r| r.take())?;
                let data = serde_json::json!({ "reason": reason }).to_string();
                Some((Ok(Event::default().event("dropped").data(data)), None))
            }
        }
    });
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response())
}

fn event(view: &EventView) -> Event {
    Event::default()
        .id(view.position.to_string())
        .event(format!("{}.{}", view.context, view.event))
        .data(serde_json::to_string(view).unwrap_or_default())
}

/// One client's reader: pages of the table into its bounded buffer, until
/// the client leaves, falls behind by a whole buffer, or (a history, with
/// `through`) has everything. Holds the client's stream slot.
async fn feed(
    obs: Arc<Observability>,
    mut after: Position,
    filter: Filter,
    through: Option<Position>,
    tx: mpsc::Sender<EventView>,
    dropped: Arc<Mutex<Option<String>>>,
    _permit: tokio::sync::OwnedSemaphorePermit,
) {
    let mut wake = obs.appended.subscribe();
    let limit = obs.settings.page.max(1);
    loop {
        wake.borrow_and_update();
        let page = match through {
            None => events::page(&obs.pool, after, &filter, limit).await,
            Some(through) => events::history(obs.reads(), through, after, &filter, limit).await,
        };
        let page = match page {
            Ok(page) => page,
            Err(e) => {
                tracing::warn!(error = %e, "event stream: reading events failed");
                set(
                    &dropped,
                    "the controller could not read its events; reconnect with Last-Event-ID",
                );
                return;
            }
        };
        let more = page.len() as i64 == limit;
        for view in page {
            let position = view.position;
            match tx.try_send(view) {
                Ok(()) => after = Position(position),
                Err(TrySendError::Full(_)) => {
                    tracing::info!(after = after.0, "event stream: client too slow, dropped");
                    set(
                        &dropped,
                        &format!(
                            "too slow: {} events unread; reconnect with Last-Event-ID {}",
                            obs.settings.stream_buffer, after.0
                        ),
                    );
                    return;
                }
                Err(TrySendError::Closed(_)) => return,
            }
        }
        if more {
            continue;
        }
        if through.is_some() {
            return;
        }
        tokio::select! {
            _ = wake.changed() => {}
            _ = tokio::time::sleep(obs.settings.poll) => {}
            _ = tx.closed() => return,
        }
    }
}

fn set(dropped: &Mutex<Option<String>>, reason: &str) {
    if let Ok(mut r) = dropped.lock() {
        *r = Some(reason.to_owned());
    }
}
