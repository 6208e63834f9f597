//! A module's recent unit output, fetched through the agents (decision 0033):
//! `GET /v1/modules/{name}/logs` (operator role: output may hold anything a
//! unit prints; every request is audited).
//!
//! The controller asks each node that runs the module with a logs request on
//! the node's own declaration queue (`decl.<node>`, signed like a
//! declaration, transient, with an AMQP expiration of the wait so it never
//! piles up there); the agent answers with a `logs` report, which the
//! pipeline hands here ([`LogsHub::answer`]). Answers are matched to waiting
//! requests by request id in memory: nothing is written to any database, and
//! an answer nobody waits for is dropped (late: its request ended) or
//! dead-lettered (`unsolicited`: no such request, or a node that was not
//! asked answering for one). The sender is the broker-validated `user_id`,
//! as for every report.
//!
//! Bounds: `logs_max_requests` requests at once (one more is 503),
//! `logs_max_nodes` nodes per request (the rest are named in `omitted`),
//! `logs_wait_ms` of waiting (the nodes that did not answer are named in a
//! 504 that still carries what the others said), and each answer within one
//! report (64 KiB: the agent's `MAX_LOG_ANSWER_BYTES` of lines).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::http::header::CONTENT_TYPE;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Confirmation};
use mesh_plumbing::api::{ApiQuery, Problem};
use mesh_plumbing::openapi::{BadRequest, NotFound, Unprocessable};
use mesh_protocol::topology::{DECLARATIONS_EXCHANGE, SIGNATURE_HEADER};
use mesh_protocol::{
    DeclarationSigner, Envelope, LogPosition, Logs, LogsRequest, MAX_LOG_LINES, NodeId, Report,
};
use serde::{Deserialize, Serialize};
use tokio::sync::{Semaphore, oneshot};
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use uuid::Uuid;

use crate::amqp::Refusal;
use crate::metrics::{Metrics, OutcomeLabels};
use crate::router::Contexts;

/// Lines per stream when `tail` is not given.
pub const DEFAULT_TAIL: u32 = 100;
/// Longest `after` cursor taken, in characters.
pub const MAX_CURSOR_CHARS: usize = 64 * 1024;
/// Requests remembered after they ended, so that a late answer is dropped
/// quietly rather than dead-lettered as unsolicited.
const RECENT: usize = 4096;

/// The bounds of logs requests (from the controller's settings).
#[derive(Debug, Clone, Copy)]
pub struct LogsSettings {
    /// How long a request waits for its nodes' answers.
    pub wait: Duration,
    /// Requests served at once.
    pub max_requests: usize,
    /// Nodes one request asks.
    pub max_nodes: usize,
}

/// A request waiting for one node's answer.
struct Waiter {
    node: NodeId,
    tx: Option<oneshot::Sender<Logs>>,
}

/// What came of asking one node.
#[derive(Debug)]
pub enum NodeOutcome {
    Answered(Logs),
    /// Published, no answer within the wait.
    NoAnswer,
    /// Not asked, or the broker did not take the request: why.
    NotAsked(String),
}

/// Why a request could not be made at all.
#[derive(Debug, thiserror::Error)]
pub enum LogsError {
    #[error("{0} logs requests are being served; retry shortly")]
    Busy(usize),
    #[error("the controller is not connected to the broker; retry shortly")]
    Unavailable,
}

/// The controller's side of logs requests: publishes them, and hands each
/// answer to the request waiting for it. In memory only.
pub struct LogsHub {
    settings: LogsSettings,
    signer: Arc<DeclarationSigner>,
    metrics: Metrics,
    slots: Arc<Semaphore>,
    /// The broker session's publishing channel (confirm mode), while up.
    channel: Mutex<Option<Channel>>,
    waiting: Mutex<HashMap<Uuid, Waiter>>,
    /// Requests that ended (id, the node asked), newest last.
    recent: Mutex<VecDeque<(Uuid, NodeId)>>,
}

/// Takes a request's waiters out of the table when the request ends, however
/// it ends (answered, timed out, its client gone).
struct Registered<'a> {
    hub: &'a LogsHub,
    ids: Vec<(Uuid, NodeId)>,
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        if let Ok(mut w) = self.hub.waiting.lock() {
            for (id, _) in &self.ids {
                w.remove(id);
            }
        }
        if let Ok(mut r) = self.hub.recent.lock() {
            for pair in self.ids.drain(..) {
                if r.len() >= RECENT {
                    r.pop_front();
                }
                r.push_back(pair);
            }
        }
    }
}

impl LogsHub {
    pub fn new(settings: LogsSettings, signer: Arc<DeclarationSigner>, metrics: Metrics) -> Self {
        LogsHub {
            slots: Arc::new(Semaphore::new(settings.max_requests.max(1))),
            settings,
            signer,
            metrics,
            channel: Mutex::new(None),
            waiting: Mutex::new(HashMap::new()),
            recent: Mutex::new(VecDeque::new()),
        }
    }

    pub fn settings(&self) -> LogsSettings {
        self.settings
    }

    /// The broker session's channel to publish requests on (`None` when the
    /// session ends).
    pub fn attach(&self, channel: Option<Channel>) {
        if let Ok(mut c) = self.channel.lock() {
            *c = channel;
        }
    }

    fn count_answer(&self, outcome: &str) {
        self.metrics
            .logs_answers
            .get_or_create(&OutcomeLabels {
                outcome: outcome.to_owned(),
            })
            .inc();
    }

    /// An authenticated `logs` report (its sender is `env.node`, the
    /// broker's `user_id`): handed to the request waiting for it. Err: the
    /// reason to dead-letter it with.
    pub fn answer(&self, env: &Envelope<Report>) -> Result<(), Refusal> {
        let Report::Logs(logs) = &env.body else {
            return Err(Refusal::new("wrong_queue", "not a logs answer"));
        };
        let mut waiting = self
            .waiting
            .lock()
            .map_err(|_| Refusal::new("handler", "the logs table is poisoned"))?;
        match waiting.get_mut(&logs.request) {
            Some(w) if w.node != env.node => {
                self.count_answer("unsolicited");
                Err(Refusal::new(
                    "unsolicited",
                    format!(
                        "node `{}` answered logs request {}, which asked node `{}`",
                        env.node, logs.request, w.node
                    ),
                ))
            }
            Some(w) => {
                match w.tx.take() {
                    Some(tx) => {
                        // The request may have ended this instant: nothing to do.
                        let _ = tx.send(logs.clone());
                        self.count_answer("accepted");
                    }
                    None => {
                        tracing::debug!(request = %logs.request, node = %env.node, "a second answer to a logs request: dropped");
                        self.count_answer("duplicate");
                    }
                }
                Ok(())
            }
            None => {
                drop(waiting);
                let asked = self.recent.lock().ok().and_then(|r| {
                    r.iter()
                        .rev()
                        .find(|(id, _)| *id == logs.request)
                        .map(|(_, n)| n.clone())
                });
                match asked {
                    Some(node) if node == env.node => {
                        tracing::debug!(request = %logs.request, node = %env.node, "a logs answer after its request ended: dropped");
                        self.count_answer("late");
                        Ok(())
                    }
                    Some(node) => {
                        self.count_answer("unsolicited");
                        Err(Refusal::new(
                            "unsolicited",
                            format!(
                                "node `{}` answered logs request {}, which asked node `{node}`",
                                env.node, logs.request
                            ),
                        ))
                    }
                    None => {
                        self.count_answer("unsolicited");
                        Err(Refusal::new(
                            "unsolicited",
                            format!(
                                "node `{}` answered logs request {}, which this controller never made or no longer remembers",
                                env.node, logs.request
                            ),
                        ))
                    }
                }
            }
        }
    }

    /// Ask each of `nodes` (with the positions it gave before) for the output
    /// of its units of `module`, and wait at most the configured wait.
    pub async fn request(
        &self,
        module: &str,
        tail: u32,
        nodes: Vec<(NodeId, Vec<LogPosition>)>,
    ) -> Result<Vec<(NodeId, NodeOutcome)>, LogsError> {
        let _permit = self.slots.clone().try_acquire_owned().map_err(|_| {
            self.count_request("busy");
            LogsError::Busy(self.settings.max_requests)
        })?;
        let Some(channel) = self.channel.lock().ok().and_then(|c| c.clone()) else {
            self.count_request("unavailable");
            return Err(LogsError::Unavailable);
        };
        let deadline = tokio::time::Instant::now() + self.settings.wait;
        let expiration = self.settings.wait.as_millis().max(1).to_string();
        let mut registered = Registered {
            hub: self,
            ids: Vec::new(),
        };
        let mut pending = Vec::new();
        for (node, after) in nodes {
            let env = Envelope::new(
                node.clone(),
                0,
                LogsRequest {
                    module: module.to_owned(),
                    tail,
                    after,
                },
            );
            let (tx, rx) = oneshot::channel();
            if let Ok(mut w) = self.waiting.lock() {
                w.insert(
                    env.id,
                    Waiter {
                        node: node.clone(),
                        tx: Some(tx),
                    },
                );
            }
            registered.ids.push((env.id, node.clone()));
            let payload = env.encode();
            let mut headers = FieldTable::default();
            headers.insert(
                SIGNATURE_HEADER.into(),
                AMQPValue::LongString(LongString::from(self.signer.sign_hex(&payload))),
            );
            let props = BasicProperties::default()
                .with_message_id(env.id.to_string().as_str().into())
                .with_type(LogsRequest::KIND.into())
                .with_content_type("application/json".into())
                .with_delivery_mode(1)
                .with_expiration(expiration.as_str().into())
                .with_headers(headers);
            let published = channel
                .basic_publish(
                    DECLARATIONS_EXCHANGE.into(),
                    node.as_str().into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..BasicPublishOptions::default()
                    },
                    &payload,
                    props,
                )
                .await;
            pending.push((node, env.id, published, rx));
        }
        let mut out = Vec::with_capacity(pending.len());
        let mut waits = Vec::new();
        for (node, id, published, rx) in pending {
            let refused = match published {
                Err(e) => Some(format!("the broker did not take the request: {e}")),
                Ok(confirm) => match tokio::time::timeout_at(deadline, confirm).await {
                    Ok(Ok(Confirmation::Ack(None) | Confirmation::NotRequested)) => None,
                    Ok(Ok(Confirmation::Ack(Some(_)))) => Some(
                        "the node has no declaration queue on this broker (it never said hello)"
                            .to_owned(),
                    ),
                    Ok(Ok(Confirmation::Nack(_))) => {
                        Some("the broker refused the request".to_owned())
                    }
                    Ok(Err(e)) => Some(format!("the broker did not take the request: {e}")),
                    Err(_) => None,
                },
            };
            match refused {
                Some(why) => {
                    tracing::debug!(%node, request = %id, why, "logs request not delivered");
                    out.push((node, NodeOutcome::NotAsked(why)));
                }
                None => waits.push((node, rx)),
            }
        }
        for (node, rx) in waits {
            let outcome = match tokio::time::timeout_at(deadline, rx).await {
                Ok(Ok(logs)) => NodeOutcome::Answered(logs),
                _ => {
                    self.metrics.logs_timeouts.inc();
                    NodeOutcome::NoAnswer
                }
            };
            out.push((node, outcome));
        }
        drop(registered);
        out.sort_by(|a, b| a.0.cmp(&b.0));
        let complete = out
            .iter()
            .all(|(_, o)| matches!(o, NodeOutcome::Answered(_)));
        self.count_request(if complete { "answered" } else { "timeout" });
        Ok(out)
    }

    fn count_request(&self, outcome: &str) {
        self.metrics
            .logs_requests
            .get_or_create(&OutcomeLabels {
                outcome: outcome.to_owned(),
            })
            .inc();
    }
}

// ---- the API ----

/// The state of the logs route.
#[derive(Clone)]
pub struct LogsApi {
    pub contexts: Arc<Contexts>,
    pub hub: Arc<LogsHub>,
}

pub fn routes(state: LogsApi) -> OpenApiRouter {
    OpenApiRouter::new()
        .routes(routes!(module_logs))
        .with_state(state)
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
struct LogsParams {
    /// Only this node (it must run the module).
    node: Option<String>,
    /// Lines per stream of each unit: the last ones, or at most this many
    /// after `after`. 1 to 1000, default 100.
    tail: Option<u32>,
    /// The `cursor` of a previous answer: only what was written since.
    after: Option<String>,
}

/// One stream of one unit.
#[derive(Debug, Serialize, ToSchema)]
pub struct StreamView {
    /// `stdout` or `stderr`.
    pub stream: String,
    /// Whole lines, oldest first (cut at 4096 bytes; bytes that are not UTF-8
    /// replaced).
    pub lines: Vec<String>,
    /// Output was lost between the cursor and the first line (rotated away
    /// before it was read).
    pub gap: bool,
    /// More output follows than this answer carries: ask again with `cursor`.
    pub more: bool,
}

/// One unit's output.
#[derive(Debug, Serialize, ToSchema)]
pub struct UnitView {
    pub unit: String,
    pub streams: Vec<StreamView>,
}

/// What one node said.
#[derive(Debug, Serialize, ToSchema)]
pub struct NodeLogsView {
    pub node: String,
    /// `ok` (answered), `error` (answered, but could not read: `error` says
    /// why), `timeout` (asked, no answer within the wait), `not_asked` (judged
    /// unreachable, revoked, or the broker did not take the request: `error`
    /// says which).
    pub status: String,
    pub error: Option<String>,
    pub units: Vec<UnitView>,
}

/// A module's recent output, per node.
#[derive(Debug, Serialize, ToSchema)]
pub struct LogsView {
    pub module: String,
    pub nodes: Vec<NodeLogsView>,
    /// Pass as `after` to get only what is written from now on.
    pub cursor: String,
    /// Nodes running the module that were not asked: more than the
    /// controller asks at once (`logs_max_nodes`; ask with `node`).
    pub omitted: Vec<String>,
}

/// 504: some nodes did not answer within the wait (or could not be asked):
/// a problem naming them in `missing`, with what the others said and a
/// cursor, as for 200.
#[derive(Debug, Serialize, ToSchema)]
pub struct LogsTimeout {
    #[serde(flatten)]
    pub problem: Problem,
    /// The nodes whose output is missing.
    pub missing: Vec<String>,
    #[serde(flatten)]
    pub answer: LogsView,
}

/// The positions of each node, as a cursor carries them.
type Cursor = BTreeMap<String, Vec<LogPosition>>;

fn encode_cursor(c: &Cursor) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD
        .encode(serde_json::to_vec(c).unwrap_or_default())
}

fn decode_cursor(s: &str) -> Result<Cursor, Problem> {
    let bad =
        |why: &str| Problem::unprocessable("after", format!("not a cursor of this API: {why}"));
    if s.len() > MAX_CURSOR_CHARS {
        return Err(bad("too long"));
    }
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(s.trim_end_matches('='))
        .map_err(|_| bad("not base64url"))?;
    let c: Cursor = serde_json::from_slice(&bytes).map_err(|_| bad("not its JSON"))?;
    for (node, positions) in &c {
        NodeId::parse(node).map_err(|_| bad("a node is not a node id"))?;
        if positions.len() > 2 * mesh_protocol::MAX_LOG_UNITS {
            return Err(bad("too many positions"));
        }
        for p in positions {
            mesh_protocol::validate_unit_name("after", &p.unit)
                .map_err(|_| bad("a unit is not a unit name"))?;
        }
    }
    Ok(c)
}

fn problem(status: StatusCode, field: Option<&str>, detail: String) -> Problem {
    match field {
        Some(f) => Problem::field(status, f, detail),
        None => Problem::new(status, detail),
    }
}

/// The recent output of a module's units (`stdout` and `stderr`), fetched
/// from each node that runs it (or the one `node` names) through its agent.
/// Without `after`: the last `tail` lines of each stream; with a previous
/// answer's `cursor`: what was written since (at most `tail` lines a stream;
/// `more` says when to ask again at once). A node judged unreachable is not
/// asked; a node that does not answer within the controller's
/// `logs_wait_ms` (default 10 s) is named in a 504 that still carries the
/// other nodes' output and a cursor. Every request is in the audit log.
#[utoipa::path(
    get,
    path = "/v1/modules/{name}/logs",
    tag = "inventory",
    params(
        ("name" = String, Path, description = "The module's name"),
        LogsParams,
    ),
    responses(
        (status = 200, description = "Every node asked answered", body = LogsView),
        BadRequest,
        NotFound,
        Unprocessable,
        (status = 503, description = "As many logs requests as the controller serves at once are being served, or the broker is not connected: retry shortly", body = Problem, content_type = "application/problem+json"),
        (status = 504, description = "Some nodes did not answer within the wait (or could not be asked); `missing` names them, the rest is as for 200", body = LogsTimeout, content_type = "application/problem+json"),
    )
)]
async fn module_logs(
    State(api): State<LogsApi>,
    Path(name): Path<String>,
    ApiQuery(params): ApiQuery<LogsParams>,
) -> Result<Response, Problem> {
    mesh_protocol::validate_module_name("name", &name)
        .map_err(|e| Problem::unprocessable("name", e.to_string()))?;
    let tail = params.tail.unwrap_or(DEFAULT_TAIL);
    if tail == 0 || tail > MAX_LOG_LINES {
        return Err(Problem::unprocessable(
            "tail",
            format!("{tail} is outside 1..={MAX_LOG_LINES}"),
        ));
    }
    let asked = params
        .node
        .as_deref()
        .map(|n| NodeId::parse(n).map_err(|e| Problem::unprocessable("node", e.to_string())))
        .transpose()?;
    let mut cursor = match params.after.as_deref() {
        Some(s) => decode_cursor(s)?,
        None => Cursor::new(),
    };
    let module = api
        .contexts
        .inventory
        .module(&name)
        .await
        .map_err(Problem::internal)?
        .ok_or_else(|| {
            problem(
                StatusCode::NOT_FOUND,
                Some("name"),
                format!("no module `{name}`"),
            )
        })?;
    let mut running: Vec<String> = module.assignments.iter().map(|a| a.node.clone()).collect();
    running.sort();
    running.dedup();
    if let Some(node) = &asked {
        if !running.iter().any(|n| n == node.as_str()) {
            let runs = if running.is_empty() {
                "it runs on no node".to_owned()
            } else {
                format!("it runs on {}", running.join(", "))
            };
            return Err(Problem::unprocessable(
                "node",
                format!("module `{name}` does not run on node `{node}`: {runs}"),
            ));
        }
        running = vec![node.as_str().to_owned()];
    }
    let max = api.hub.settings().max_nodes.max(1);
    let omitted = running.split_off(running.len().min(max));
    let states: BTreeMap<String, String> = api
        .contexts
        .inventory
        .node_states(&running)
        .await
        .map_err(Problem::internal)?
        .into_iter()
        .collect();
    let mut ask = Vec::new();
    let mut outcomes: Vec<(String, NodeOutcome)> = Vec::new();
    for node in &running {
        let state = states.get(node).map_or("unknown", String::as_str);
        match (state, NodeId::parse(node)) {
            ("alive" | "draining" | "drained", Ok(id)) => {
                let after = cursor.get(node).cloned().unwrap_or_default();
                ask.push((id, after));
            }
            (state, _) => outcomes.push((
                node.clone(),
                NodeOutcome::NotAsked(format!("the node is {state}: not asked")),
            )),
        }
    }
    if !ask.is_empty() {
        let answered = api
            .hub
            .request(&name, tail, ask)
            .await
            .map_err(|e| Problem::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string()))?;
        outcomes.extend(
            answered
                .into_iter()
                .map(|(n, o)| (n.as_str().to_owned(), o)),
        );
    }
    outcomes.sort_by(|a, b| a.0.cmp(&b.0));
    let mut nodes = Vec::with_capacity(outcomes.len());
    let mut missing = Vec::new();
    for (node, outcome) in outcomes {
        let view = match outcome {
            NodeOutcome::Answered(logs) => {
                let mut positions = Vec::new();
                let units = logs
                    .units
                    .into_iter()
                    .map(|u| UnitView {
                        unit: u.unit,
                        streams: u
                            .streams
                            .into_iter()
                            .map(|s| {
                                positions.push(s.position);
                                StreamView {
                                    stream: s.stream.as_str().to_owned(),
                                    lines: s.lines,
                                    gap: s.gap,
                                    more: s.more,
                                }
                            })
                            .collect(),
                    })
                    .collect();
                // A stream the agent did not read keeps its old position.
                if let Some(old) = cursor.get(&node) {
                    for p in old {
                        if !positions
                            .iter()
                            .any(|q: &LogPosition| q.unit == p.unit && q.stream == p.stream)
                        {
                            positions.push(p.clone());
                        }
                    }
                }
                cursor.insert(node.clone(), positions);
                NodeLogsView {
                    status: if logs.error.is_some() { "error" } else { "ok" }.to_owned(),
                    error: logs.error,
                    units,
                    node,
                }
            }
            NodeOutcome::NoAnswer => {
                missing.push(node.clone());
                NodeLogsView {
                    status: "timeout".to_owned(),
                    error: Some(format!(
                        "no answer within {} ms (agent down or busy, or older than logs requests)",
                        api.hub.settings().wait.as_millis()
                    )),
                    units: Vec::new(),
                    node,
                }
            }
            NodeOutcome::NotAsked(why) => {
                missing.push(node.clone());
                NodeLogsView {
                    status: "not_asked".to_owned(),
                    error: Some(why),
                    units: Vec::new(),
                    node,
                }
            }
        };
        nodes.push(view);
    }
    // Only the nodes of this answer (and those not asked this time) stay.
    cursor.retain(|n, _| nodes.iter().any(|v| &v.node == n) || omitted.contains(n));
    let view = LogsView {
        module: name,
        nodes,
        cursor: encode_cursor(&cursor),
        omitted,
    };
    if missing.is_empty() {
        return Ok(axum::Json(view).into_response());
    }
    let detail = format!(
        "no output from {}: {}",
        missing.join(", "),
        view.nodes
            .iter()
            .filter(|n| missing.contains(&n.node))
            .map(|n| format!("{} ({})", n.node, n.error.as_deref().unwrap_or(&n.status)))
            .collect::<Vec<_>>()
            .join("; ")
    );
    let body = LogsTimeout {
        problem: Problem::new(StatusCode::GATEWAY_TIMEOUT, detail),
        missing,
        answer: view,
    };
    Ok((
        StatusCode::GATEWAY_TIMEOUT,
        [(CONTENT_TYPE, "application/problem+json")],
        serde_json::to_vec(&body).unwrap_or_default(),
    )
        .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;
    use mesh_protocol::LogStream;

    #[test]
    fn a_cursor_round_trips_and_garbage_names_after() {
        let mut c = Cursor::new();
        c.insert(
            "node-a".into(),
            vec![LogPosition {
                unit: "web-0".into(),
                stream: LogStream::Stdout,
                file: 12,
                offset: 34,
                check: u64::MAX,
            }],
        );
        let s = encode_cursor(&c);
        assert_eq!(decode_cursor(&s).unwrap(), c);
        for bad in ["***", "e30x", &"A".repeat(MAX_CURSOR_CHARS + 1)] {
            let p = decode_cursor(bad).unwrap_err();
            assert_eq!(p.field.as_deref(), Some("after"), "{bad}");
        }
        let mut evil = Cursor::new();
        evil.insert("Not A Node".into(), vec![]);
        assert!(decode_cursor(&encode_cursor(&evil)).is_err());
    }
}
